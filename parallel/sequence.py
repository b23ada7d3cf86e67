"""Ulysses sequence parallelism for diffusers' `MiniMaxH3Transformer3DModel`, on any `SpGroup` (gloo or NCCL).

    sp = SequenceParallel.install(transformer, group)        # every rank: the same model, one group
    video_v, audio_v = inputs.run(transformer)                # every rank: the same full inputs and outputs
    sp.remove()

The denoising loop (`model.denoise`) does not change: every rank runs it on the same latents, and the
transformer call returns the full velocities on every rank, so the ranks' latents stay bit-identical.

How one forward runs at degree N (S rows in the packed `[text | audio | video]` sequence):

1. Shard at the input (forward pre-hook on the transformer). The sequence is padded at its end to
   S_pad = N * ceil(S / N) rows; rank r owns rows [r * S_loc, (r + 1) * S_loc). The per-row inputs
   (`position_ids`, `token_tags`, `timestep_indices`) are cut to those rows, pad rows get zeros (position 0,
   tag video, timestep index 0: valid table rows whose results are thrown away). The video and audio latent
   rows that land on this rank are selected with their indices, made local. The model's own forward then
   builds only this rank's shard of the packed buffer; pad rows are never written (zero rows).
2. Text. The token refiner attends over the whole prompt, so it runs whole on every rank (a few hundred rows
   through 2 blocks) and a forward hook on it keeps this rank's text rows.
3. Blocks. Norms, AdaLN modulation (`adaln_indices` are built from the local tags and timestep indices),
   rotary embedding (built from the local positions) and MLP are row-local and run on the shard unchanged.
   Attention (`UlyssesAttnProcessor` on every `transformer_blocks[i].attn`): all-to-alls turn this rank's
   rows x all heads of q, k, v into all S_pad rows x H/N heads (per tensor and head chunk, started as soon as
   the tensor is written and overlapped with the next projection or chunk: `Exchange`, the processor's
   docstring has the layout that needs no permute copies); keys and values are cut to the S real rows,
   so pad rows contribute nothing to any real row (no mask: every attention backend, flash included, stays
   usable; pad queries compute garbage that is never read); per head chunk, an all-to-all returns this
   rank's rows x those heads, overlapping the next chunk's attention. Pads also never reach a real row anywhere else, every other op being row-local.
4. Gather (forward hook on the transformer): the output heads produced this rank's video and audio rows;
   they are all-gathered and put back in `video_indices` / `audio_indices` order. The stream waits for the
   gathers at once; the host checks them one forward late (`OutputChecks`): forward i's gathers are waited
   on, with the group's timeout, once forward i + 1's gathers are issued, and the last forward's by `settle()`
   at the end of the loop. So the host never drains the GPU queue inside a loop, and a peer that died anywhere
   in forward i (collectives are stream-ordered) still becomes a `CollectiveError` within about the timeout,
   raised by forward i + 1 or by `settle()`, naming forward i. The caller of a loop calls `settle()` before
   it reads the outputs on the host (a read would wait on the stream without a bound).

Everything between the input and output hooks sees shard-shaped tensors only, so the seams that wrap the
blocks keep working unchanged: `model.adaln.ExternalModulation` (its rows are indexed by the local
`adaln_indices`), cache-dit's DBCache (its residuals are local; `parallel.cache_decision` makes its decision
identical on every rank; its `num_local_real_rows` comes from here) and the layerwise offloader.

Valid degrees divide the head count (56 for H3: 1, 2, 4, 7, 8, 14, 28, 56); `check_degree` refuses others.

diffusers' machinery used: the model's forward, unchanged; the attention processor seam
(`AttentionModuleMixin.set_processor`); `dispatch_attention_fn`, so `set_attention_backend` still picks the
kernel; the model's rotary helper. The model's `_cp_plan` says which per-row tensors must follow the rows and
where to gather; we follow it but do not run it (`enable_parallelism`), because (a) it picks the device as
`rank % torch.accelerator.device_count()`, a ZeroDivisionError without an accelerator (no gloo/CPU path),
(b) its equal sharder asserts that S divides by N, and its uneven mode (`ulysses_anything`) all-gathers the
shard sizes before every exchange and runs variable-size all-to-alls, where padding keeps every exchange one
equal-split all-to-all, and (c) it splits the hidden states at `transformer_blocks.0`, but cache-dit's block
wrapper runs in front of that block and would diff its unsplit input against block 0's split output. Ours:
input sharding with pads, the local text rows, the key cut, the all-to-alls (written in place by rotary, and
overlapped with compute) and the ordered gather.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_minimax_h3 import (MiniMaxH3Attention, MiniMaxH3TransformerOutput,
                                                                  _apply_rotary_emb)
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from parallel.group import CollectiveError, HostCheck, PendingCollective, SpGroup

#: Released MiniMax-H3: 56 heads of 128 (h3.md section 2).
H3_NUM_HEADS = 56


class SequenceParallelError(ValueError):
    """A sequence-parallel degree the model cannot run; names the degree and the valid ones."""


def valid_degrees(num_heads: int) -> list[int]:
    """Degrees that split `num_heads` evenly (each rank attends with num_heads / degree whole heads)."""
    return [d for d in range(1, num_heads + 1) if num_heads % d == 0]


def check_degree(degree: int, num_heads: int = H3_NUM_HEADS, num_devices: int | None = None) -> None:
    """SequenceParallelError unless `degree` divides `num_heads` (and fits in `num_devices`, when given)."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise SequenceParallelError(f"sequence parallel degree {degree!r} must be an integer >= 1")
    if num_heads % degree:
        raise SequenceParallelError(f"sequence parallel degree {degree} does not divide the model's {num_heads} "
                                    f"attention heads; valid degrees: {valid_degrees(num_heads)}")
    if num_devices is not None and degree > num_devices:
        raise SequenceParallelError(f"sequence parallel degree {degree} needs {degree} devices on one node; "
                                    f"this node has {num_devices}")


# ---------------------------------------------------------------------------------------------------------
# How one forward's rows are split
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class RowShard:
    """The rows of one modality (given by their indices into the packed sequence) and the ranks owning them."""

    positions: Tensor  # int64 [n_r]: this rank's rows, as positions into the modality's indices / latent rows
    local_indices: Tensor  # int64 [n_r]: where those rows sit in this rank's shard
    order: Tensor  # int64 [n]: every rank's `positions`, concatenated in rank order
    counts: tuple[int, ...]  # rows per rank

    @classmethod
    def of(cls, indices: Tensor, rank: int, degree: int, rows_per_rank: int) -> RowShard:
        owner = torch.div(indices, rows_per_rank, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)  # stable: each rank's rows keep their order
        counts = tuple(torch.bincount(owner, minlength=degree).tolist())
        start = sum(counts[:rank])
        positions = order[start: start + counts[rank]]
        return cls(positions, indices.index_select(0, positions) - rank * rows_per_rank, order, counts)


@dataclass(frozen=True, eq=False)
class SequenceShard:
    """One forward's split of the packed sequence over the group, seen from one rank."""

    num_rows: int  # S: real rows of the packed sequence
    degree: int
    rank: int
    video: RowShard
    audio: RowShard
    text: RowShard

    @property
    def rows_per_rank(self) -> int:
        return math.ceil(self.num_rows / self.degree)

    @property
    def padded_rows(self) -> int:
        return self.rows_per_rank * self.degree

    @property
    def start(self) -> int:
        """First row of the packed sequence this rank owns."""
        return self.rank * self.rows_per_rank

    @property
    def num_local_real_rows(self) -> int:
        """Real rows in this rank's shard; they come first, the pads (if any) after them."""
        return max(0, min(self.rows_per_rank, self.num_rows - self.start))

    @classmethod
    def build(cls, num_rows: int, degree: int, rank: int, video_indices: Tensor, audio_indices: Tensor,
              text_indices: Tensor) -> SequenceShard:
        rows_per_rank = math.ceil(num_rows / degree)
        rows = {}
        for name, indices in (("video", video_indices), ("audio", audio_indices), ("text", text_indices)):
            in_range = indices.numel() == 0 or (int(indices.min()) >= 0 and int(indices.max()) < num_rows)
            if indices.ndim != 1 or not in_range:
                raise ValueError(f"{name}_indices must be 1-D positions in [0, {num_rows}) of the packed sequence")
            rows[name] = RowShard.of(indices, rank, degree, rows_per_rank)
        return cls(num_rows, degree, rank, rows["video"], rows["audio"], rows["text"])

    def local_rows(self, per_row: Tensor) -> Tensor:
        """This rank's rows of a [S, ...] per-row tensor, zero rows for its pads: [S_loc, ...]."""
        real = per_row[self.start: self.start + self.num_local_real_rows]
        num_pads = self.rows_per_rank - real.shape[0]
        if num_pads == 0:
            return real
        return torch.cat([real, per_row.new_zeros((num_pads, *per_row.shape[1:]))])


# ---------------------------------------------------------------------------------------------------------
# The installed feature
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Exchange:
    """How the attention's all-to-alls run (`UlyssesAttnProcessor`); results are the same bits either way.

    overlap: start each exchange and wait for it only where its result is read, so it runs beside the
        next projection or the next chunk's attention (NCCL: on the communicator's stream); False: wait at once.
    head_chunks: split each rank's head group in this many chunks (the largest divisor of heads / degree not
        above it), exchanged and attended one after another so that the exchanges of one chunk overlap the
        attention of another. More chunks hide more of the exchange but make smaller attention calls."""

    overlap: bool = True
    head_chunks: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.head_chunks, bool) or not isinstance(self.head_chunks, int) or self.head_chunks < 1:
            raise SequenceParallelError(f"head_chunks={self.head_chunks!r} must be an integer >= 1")


class OutputChecks:
    """The host-side checks of each forward's output gathers, made one forward late (module docstring, 4).

    Invariant: at most one forward's checks are outstanding; `defer` of forward i + 1 checks forward i's, after
    forward i + 1's gathers were issued, so the GPU queue holds all of forward i + 1 while the host waits."""

    def __init__(self) -> None:
        self.num_forwards = 0  # forwards since the last `settle` (the running loop's)
        self._outstanding: tuple[int, list[HostCheck]] | None = None

    def defer(self, checks: list[HostCheck]) -> None:
        """Hold this forward's checks; check the previous forward's (CollectiveError naming it)."""
        forward, self.num_forwards = self.num_forwards, self.num_forwards + 1
        previous, self._outstanding = self._outstanding, (forward, checks)
        if previous is not None:
            self._check(previous, f"by forward {forward}")

    def settle(self) -> None:
        """The end of a loop: check the last forward's gathers (bounded by the group's timeout) and start
        counting forwards afresh."""
        outstanding, self._outstanding, self.num_forwards = self._outstanding, None, 0
        if outstanding is not None:
            self._check(outstanding, "at the end of the loop")

    def drop(self) -> None:
        """Forget the outstanding checks unchecked (sequence parallel removed)."""
        self._outstanding, self.num_forwards = None, 0

    @staticmethod
    def _check(outstanding: tuple[int, list[HostCheck]], when: str) -> None:
        forward, checks = outstanding
        try:
            for check in checks:
                check.wait()
        except CollectiveError as exc:
            raise CollectiveError(f"sequence-parallel forward {forward} of the loop (its output gather, checked "
                                  f"{when}): {exc}") from exc


#: Per-row inputs of the transformer's forward, cut to the rank's rows (pads zero).
_PER_ROW_INPUTS = ("position_ids", "token_tags", "timestep_indices")


class SequenceParallel:
    """Sequence parallelism installed on one transformer (`install`); `remove` restores it.

    Invariants: `shard` is set exactly between a forward's input hook and its output hook; the attention
    processors read it, so a processor called outside a forward raises instead of using a stale split. A
    forward's output gathers are checked on the host by the next forward or by `settle()` (`OutputChecks`).
    """

    def __init__(self, transformer: MiniMaxH3Transformer3DModel, group: SpGroup, exchange: Exchange = Exchange()):
        self.transformer = transformer
        self.group = group
        self.exchange = exchange
        self.degree = group.world_size
        self._shard: SequenceShard | None = None
        #: The last layout's split: ((num_rows, video/audio/text index tensors), split); see `_split_of`.
        self._layout: tuple[tuple[int, Tensor, Tensor, Tensor], SequenceShard] | None = None
        #: Splits built so far (one per request layout, not one per forward).
        self.num_splits_built = 0
        self.output_checks = OutputChecks()
        self._original_processors: list[object] = []
        self._handles: list[RemovableHandle] = []
        # The class's forward, not the instance's: cache-dit replaces the latter by a (*args, **kwargs) wrapper.
        signature = inspect.signature(type(transformer).forward)
        self._forward_signature = signature.replace(parameters=list(signature.parameters.values())[1:])

    @classmethod
    def install(cls, transformer: MiniMaxH3Transformer3DModel, group: SpGroup,
                exchange: Exchange = Exchange()) -> SequenceParallel:
        """Shard `transformer`'s forwards over `group` (degree = group.world_size). Every rank installs it,
        with the same `exchange`."""
        if not isinstance(transformer, MiniMaxH3Transformer3DModel):
            raise TypeError(f"sequence parallel serves MiniMaxH3Transformer3DModel, got {type(transformer).__name__}")
        check_degree(group.world_size, transformer.config.num_attention_heads)
        attentions = [block.attn for block in transformer.transformer_blocks]
        if any(isinstance(attn.processor, UlyssesAttnProcessor) for attn in attentions):
            raise RuntimeError("sequence parallel is already installed on this transformer")
        sp = cls(transformer, group, exchange)
        sp._original_processors = [attn.processor for attn in attentions]
        for attn in attentions:
            processor = UlyssesAttnProcessor(sp)
            # Keep the backend diffusers' `set_attention_backend` chose for this model.
            processor._attention_backend = attn.processor._attention_backend
            attn.set_processor(processor)
        sp._handles = [
            transformer.register_forward_pre_hook(sp._shard_inputs, with_kwargs=True, prepend=True),
            transformer.token_refiner.register_forward_hook(sp._keep_local_text),
            transformer.register_forward_hook(sp._gather_outputs, prepend=True),
        ]
        return sp

    def remove(self) -> None:
        """Restore the processors and drop the hooks (the transformer runs unsharded again)."""
        for handle in self._handles:
            handle.remove()
        for block, processor in zip(self.transformer.transformer_blocks, self._original_processors):
            block.attn.set_processor(processor)
        self._handles, self._original_processors, self._shard, self._layout = [], [], None, None
        self.output_checks.drop()

    def begin_loop(self) -> None:
        """A loop starts: count its forwards from 0. A check left by a loop that ended with an error is dropped
        unchecked (a peer that died there fails the next collective instead)."""
        self.output_checks.drop()

    def settle(self) -> None:
        """The end of a denoising loop (or any run of forwards): wait on the host, bounded by the group's
        timeout, for the last forward's output gathers; CollectiveError (naming the forward) if a peer died.
        Call it before reading the outputs on the host. A no-op at degree 1 or when nothing is outstanding."""
        self.output_checks.settle()

    @property
    def shard(self) -> SequenceShard:
        """The running forward's split; RuntimeError outside a forward."""
        if self._shard is None:
            raise RuntimeError("no sequence-parallel forward is running: call the transformer (its hooks shard "
                               "the inputs) instead of its blocks")
        return self._shard

    @property
    def num_local_real_rows(self) -> int:
        """Real rows of this rank's shard in the running forward (pads excluded); for `parallel.cache_decision`."""
        return self.shard.num_local_real_rows

    # --- the hooks ------------------------------------------------------------------------------------

    def _shard_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        inputs = self._forward_signature.bind(*args, **kwargs).arguments
        shard = self._split_of(inputs["position_ids"].shape[0], inputs["video_indices"], inputs["audio_indices"],
                               inputs["text_indices"])
        for name in _PER_ROW_INPUTS:
            inputs[name] = shard.local_rows(inputs[name])
        inputs["hidden_states"] = inputs["hidden_states"].index_select(1, shard.video.positions)
        inputs["video_indices"] = shard.video.local_indices
        inputs["audio_hidden_states"] = inputs["audio_hidden_states"].index_select(1, shard.audio.positions)
        inputs["audio_indices"] = shard.audio.local_indices
        inputs["text_indices"] = shard.text.local_indices  # the refiner's output is cut to match (below)
        self._shard = shard
        return (), dict(inputs)

    def _split_of(self, num_rows: int, video_indices: Tensor, audio_indices: Tensor,
                  text_indices: Tensor) -> SequenceShard:
        """The split of this layout: built once per request, not per forward (building reads the index tensors
        back to the host, ~9 syncs that would drain the GPU queue every forward). A request's forwards pass the
        same index tensors (`model.denoise.Denoiser`'s frozen layout), so the last split is reused while they
        are the same objects; the memo holds them, so their ids cannot be recycled. Index tensors must not be
        written in place between forwards."""
        key = (num_rows, video_indices, audio_indices, text_indices)
        if self._layout is not None and self._layout[0][0] == num_rows and all(
                held is given for held, given in zip(self._layout[0][1:], key[1:])):
            return self._layout[1]
        shard = SequenceShard.build(num_rows, self.degree, self.group.rank, video_indices, audio_indices,
                                    text_indices)
        self._layout = (key, shard)
        self.num_splits_built += 1
        return shard

    def _keep_local_text(self, module: nn.Module, args: tuple, text_embeds: Tensor) -> Tensor:
        return text_embeds.index_select(1, self.shard.text.positions)  # [B, L, H] -> [B, L_r, H]

    def _gather_outputs(self, module: nn.Module, args: tuple,
                        output: MiniMaxH3TransformerOutput | tuple[Tensor, Tensor]):
        shard, self._shard = self.shard, None
        as_tuple = isinstance(output, tuple)
        video, audio = output if as_tuple else (output.sample, output.audio_sample)
        if self.degree > 1:
            checks: list[HostCheck] = []
            video = self._gather_rows(video, shard.video, checks)
            audio = self._gather_rows(audio, shard.audio, checks)
            # This forward is issued whole: now the host may wait for the previous forward's gathers (done
            # on the GPU long ago unless a peer died) without draining the queue.
            self.output_checks.defer(checks)
        return (video, audio) if as_tuple else MiniMaxH3TransformerOutput(sample=video, audio_sample=audio)

    def _gather_rows(self, local: Tensor, rows: RowShard, checks: list[HostCheck]) -> Tensor:
        """[B, n_r, C] on every rank -> [B, n, C] in the modality's index order, the same bytes on every rank;
        the gather's host check is appended to `checks`."""
        batch, _, channels = local.shape
        most = max(rows.counts)
        send = local.new_zeros((1, batch, most, channels))
        send[0, :, : local.shape[1]] = local
        received = local.new_empty((self.degree, batch, most, channels))
        # The stream waits here (the rows below read `received`); the host waits one forward later.
        checks.append(self.group.start_all_gather(received, send).wait_stream())
        stacked = torch.cat([received[r, :, :count] for r, count in enumerate(rows.counts)], dim=1)
        return torch.empty_like(stacked).index_copy_(1, rows.order, stacked)

    # --- the exchange around attention ------------------------------------------------------------------

    def chunks_for(self, heads: int) -> int:
        """Head chunks each rank's head group is exchanged and attended in: the largest divisor of the group's
        heads (heads / degree) not above `exchange.head_chunks`."""
        per_rank = heads // self.degree
        return max(c for c in range(1, min(self.exchange.head_chunks, per_rank) + 1) if per_rank % c == 0)

    def start_exchange(self, output: Tensor, input: Tensor) -> PendingCollective | None:
        """One all-to-all of the attention (dim 0 of both: the degree); None at degree 1 (`output` is `input`).
        Without `exchange.overlap` it is waited for at once (nothing runs beside it)."""
        if self.degree == 1:
            return None
        pending = self.group.start_all_to_all(output, input)
        if not self.exchange.overlap:
            pending.wait()
            return None
        return pending


def _wait(pending: PendingCollective | None) -> None:
    if pending is not None:
        pending.wait()


def _rotate_into(out: Tensor, x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """diffusers' `_apply_rotary_emb(x, cos, sin)` written into `out` (any strides), bit for bit, for x and out of
    shape [B, S, *heads, D] and cos, sin [S, rotary_dim]: `x_rot * cos + cat(-x2, x1) * sin` is, per half,
    x1 * cos - x2 * sin and x2 * cos + x1 * sin (negating a product or a summand is exact), then the
    unrotated channels. No concatenated temporaries, and the result lands where the all-to-all reads it."""
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    broadcast = (1, cos.shape[0]) + (1,) * (x.dim() - 3) + (rotary_dim,)
    cos = cos.to(x.dtype).view(broadcast)
    sin = sin.to(x.dtype).view(broadcast)
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    torch.sub(x1 * cos[..., :half], x2 * sin[..., :half], out=out[..., :half])
    torch.add(x2 * cos[..., half:], x1 * sin[..., half:], out=out[..., half:rotary_dim])
    out[..., rotary_dim:].copy_(x[..., rotary_dim:])


class UlyssesAttnProcessor:
    """`MiniMaxH3AttnProcessor`'s computation with the Ulysses exchange around the attention kernel.

    Projections, per-head norms and rotary run on this rank's rows; attention runs on all rows of H/N heads,
    with keys and values cut to the real rows (pads contribute nothing).

    Layout (N ranks, this rank's S_loc rows, H = N * C * hc heads of D: head group j of rank j, split in C
    chunks of hc heads): q, k and v are each written once, by rotary (q, k) or one copy (v), into a send
    buffer [C, N, B, S_loc, hc, D], so that send[c, j] is exactly what rank j needs of chunk c: contiguous,
    no permute copy before the exchange. The receive buffer's chunk c, [N, B, S_loc, hc, D], is for B = 1
    already [B, S_pad, hc, D] (rank i's rows in rank order): no copy after it either. The attention output
    of a chunk, [B, S_pad, hc, D], is for B = 1 already [N, B, S_loc, hc, D] (rows for rank j at j); what
    comes back is reordered to [B, S_loc, H, D] in the one copy left, in front of `to_out`.

    Overlap (`Exchange.overlap`): q's all-to-alls start once q is written and run while k is projected,
    k's while v is projected; chunk c's attention waits only for chunk c of q, k, v, so v's later chunks move
    while chunk 0 is attended; chunk c's output all-to-all runs while chunk c + 1 is attended. Left in the
    open: v's chunk 0 and the last chunk's output, 2 / C of one of the four tensors. Every byte and every
    kernel's input is the same as without overlap: only when the exchanges run changes.
    """

    _attention_backend = None  # set by install / diffusers' set_attention_backend; None: diffusers' default
    _parallel_config = None  # diffusers' own context parallel stays off: the exchange is done here

    def __init__(self, sp: SequenceParallel):
        self.sp = sp

    # Under `engine.compile` the block compiles around this call: its collectives start and wait on handles
    # and streams that dynamo cannot trace, so the exchange and its attention stay eager.
    @torch.compiler.disable
    def __call__(self, attn: MiniMaxH3Attention, hidden_states: Tensor,
                 rotary_emb: tuple[Tensor, Tensor] | None = None, attention_mask: Tensor | None = None) -> Tensor:
        if attention_mask is not None:
            raise ValueError("UlyssesAttnProcessor takes no attention_mask (MiniMax-H3 passes none)")
        sp = self.sp
        num_rows = sp.shard.num_rows
        n, heads = sp.degree, attn.heads
        chunks = sp.chunks_for(heads)
        head_chunk = heads // n // chunks
        batch, rows = hidden_states.shape[:2]

        if attn.fused_projections:
            projections = dict(zip("qkv", attn.to_qkv(hidden_states).chunk(3, dim=-1)))
        else:
            projections = {"q": None, "k": None, "v": None}
        received: dict[str, Tensor] = {}
        pending: dict[str, list[PendingCollective | None]] = {}
        # q, k, v in turn: each one's exchange starts as soon as it is written, beside the next projection.
        for name, projection, norm in (("q", attn.to_q, attn.norm_q), ("k", attn.to_k, attn.norm_k),
                                       ("v", attn.to_v, None)):
            x = projections[name]
            if x is None:
                x = projection(hidden_states)  # [B, S_loc, H * D]
            x = x.unflatten(-1, (heads, -1))  # [B, S_loc, H, D]
            send = x.new_empty((chunks, n, batch, rows, head_chunk, x.shape[-1]))
            target = send.permute(2, 3, 1, 0, 4, 5)  # [B, S_loc, N, C, hc, D]: head (j, c, i) = j*C*hc + c*hc + i
            if norm is not None:
                x = norm(x)
            x = x.unflatten(2, (n, chunks, head_chunk))
            if norm is not None and rotary_emb is not None:
                _rotate_into(target, x, *rotary_emb)
            else:
                target.copy_(x)
            received[name] = torch.empty_like(send) if n > 1 else send
            pending[name] = [sp.start_exchange(received[name][c], send[c]) for c in range(chunks)]

        out_received = None
        out_pending = []
        for c in range(chunks):
            for name in "qkv":
                _wait(pending[name][c])
            # [N, B, S_loc, hc, D] -> [B, S_pad, hc, D]: a view for B = 1
            query, key, value = (received[name][c].transpose(0, 1).reshape(batch, n * rows, head_chunk, -1)
                                 for name in "qkv")
            out = dispatch_attention_fn(query, key[:, :num_rows], value[:, :num_rows], attn_mask=None,
                                        dropout_p=0.0, is_causal=False, backend=self._attention_backend)
            # [B, S_pad, hc, D] -> [N, B, S_loc, hc, D]: rows for rank j at j (a view for B = 1)
            send = out.reshape(batch, n, rows, head_chunk, -1).transpose(0, 1).contiguous()
            if out_received is None:
                out_received = send.new_empty((chunks, *send.shape))
            if n > 1:
                out_pending.append(sp.start_exchange(out_received[c], send))
            else:
                out_received[c] = send
        for one in out_pending:
            _wait(one)
        # [C, N, B, S_loc, hc, D] (chunk c of head group i at [c, i]) -> [B, S_loc, H * D]: the one copy
        out = out_received.permute(2, 3, 1, 0, 4, 5).reshape(batch, rows, heads * out_received.shape[-1])
        out = out.to(query.dtype)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)
