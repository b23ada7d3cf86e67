"""The DiT, top to bottom: norm, RoPE, attention, MLP, blocks, embedders, the model (init: model/init.py).

One request is one packed sequence `text | audio | video` of N tokens (batch dim 1, shape [1, N, hidden]).
Every token carries a tag (text 1, audio 2, video 0; padding -1 counts as video) and the index of its
timestep among the step's M distinct timesteps. AdaLN modulation is precomputed per step (`Modulation`), so
a block never touches the timestep: it gathers its shift/scale/gate rows with `rows = index*3 + tag`.

Dtypes: blocks, refiner, condition_proj and AdaLN projections run in `config.dtype` (bf16); the time
embedder, the patch/audio input projections and the output heads are an fp32 island. The text embedder
(model/text.py) is fp32 as well.
"""

from __future__ import annotations

import math
from concurrent.futures import Executor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import NUM_BLOCK_CHUNKS, NUM_FINAL_CHUNKS, NUM_MODALITIES, TAG_AUDIO, TAG_TEXT, TAG_VIDEO, DiTConfig
from model.init import init_parameters
from model.sampler import StepTimesteps
from model.text import ByteTextEmbedder

# ---------------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * weight, with the statistics in fp32."""

    def __init__(self, dim: int, eps: float, *, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) * self.weight


def rope_angles(positions: Tensor, axes_dims: tuple[int, ...], theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin of the 3-D RoPE angles. positions fp32 [N, 3] (t, h, w) -> cos, sin fp32 [N, sum(axes_dims)/2]."""
    angles = []
    for axis, dim in enumerate(axes_dims):
        inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)  # [dim/2]
        angles.append(positions[:, axis, None] * inv_freq[None, :])  # [N, dim/2]
    angles = torch.cat(angles, dim=-1)  # [N, R/2]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first R = 2*cos.shape[-1] dims of each head in (even, odd) pairs; the rest pass through.

    x [B, N, H, D]; cos/sin fp32 [N, R/2]. The rotation runs in fp32 and the result has x's dtype.
    """
    rot_dim = 2 * cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim].float(), x[..., rot_dim:]
    x0, x1 = x_rot.unflatten(-1, (-1, 2)).unbind(-1)  # each [B, N, H, R/2]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [N, 1, R/2]: broadcast over heads
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)  # [B, N, H, R]
    return torch.cat((rotated.to(x.dtype), x_pass), dim=-1)


class Attention(nn.Module):
    """Multi-head self-attention over the whole packed sequence (one SDPA call, no mask)."""

    def __init__(self, config: DiTConfig, *, device=None, dtype=None):
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        kw = dict(device=device, dtype=dtype)
        # The attention inner width (heads*head_dim) may differ from hidden (h3: 7168 vs 5376).
        self.q = nn.Linear(config.hidden, config.attn_dim, bias=True, **kw)
        self.k = nn.Linear(config.hidden, config.attn_dim, bias=True, **kw)
        self.v = nn.Linear(config.hidden, config.attn_dim, bias=True, **kw)
        self.o = nn.Linear(config.attn_dim, config.hidden, bias=True, **kw)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        B, N, _ = x.shape
        q = self.q(x).view(B, N, self.num_heads, self.head_dim)  # [B, N, H, Dh]
        k = self.k(x).view(B, N, self.num_heads, self.head_dim)
        v = self.v(x).view(B, N, self.num_heads, self.head_dim)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # [B, H, N, Dh]
        return self.o(out.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate) * up), with gate and up fused into one projection (gate first)."""

    def __init__(self, config: DiTConfig, *, device=None, dtype=None):
        super().__init__()
        self.gate_up = nn.Linear(config.hidden, 2 * config.ffn, bias=False, device=device, dtype=dtype)
        self.down = nn.Linear(config.ffn, config.hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # each [B, N, ffn]
        return self.down(F.silu(gate) * up)


# ---------------------------------------------------------------------------------------------------------
# Per-step state handed to the blocks
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Modulation:
    """One step's AdaLN modulation for its M distinct timesteps (model dtype).

    blocks: [num_blocks, M, adaln_width]; row m of block i is adaln_proj_i(adaln_input[m]), laid out as
            [3 modalities, 6 chunks, hidden] (chunks: shift/scale/gate for attention, then for the MLP).
    final:  [M, final_adaln_width], laid out as [2 chunks (shift, scale), hidden].
    """

    blocks: Tensor
    final: Tensor

    @property
    def num_rows(self) -> int:
        return self.final.shape[0]

    def to(self, device) -> "Modulation":
        return Modulation(self.blocks.to(device), self.final.to(device))


@dataclass
class BlockContext:
    """What a DiT block needs besides hidden_states: RoPE, its modulation rows and the step's Modulation."""

    rope_cos: Tensor  # fp32 [N, R/2]
    rope_sin: Tensor  # fp32 [N, R/2]
    rows: Tensor  # int64 [N]: timestep_index*3 + max(tag, 0), a row of blocks[i].reshape(M*3, 6, hidden)
    modulation: Modulation


@dataclass
class Packed:
    """The packed sequence of one request: text | audio | video."""

    tokens: Tensor  # [1, N, hidden] model dtype: the input of blocks[0]
    tags: Tensor  # int64 [N]: TAG_TEXT / TAG_AUDIO / TAG_VIDEO
    timestep_index: Tensor  # int64 [N]: index of the token's timestep among the step's M
    rope_cos: Tensor  # fp32 [N, R/2]
    rope_sin: Tensor  # fp32 [N, R/2]
    rows: Tensor  # int64 [N]: timestep_index*3 + max(tag, 0) (block modulation rows)
    final_rows: Tensor  # int64 [N]: timestep_index (final modulation rows)
    num_text: int
    num_audio: int
    video_grid: tuple[int, int, int]  # (F', H', W') in patches
    num_rows: int  # modulation rows (timesteps) the tokens index: 1 + the largest timestep index

    def context(self, modulation: Modulation) -> BlockContext:
        if modulation.num_rows < self.num_rows or modulation.blocks.shape[1] != modulation.num_rows:
            raise ValueError(
                f"modulation has {modulation.num_rows} rows (blocks {tuple(modulation.blocks.shape)}), "
                f"the tokens need {self.num_rows}"
            )
        return BlockContext(self.rope_cos, self.rope_sin, self.rows, modulation)


# ---------------------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------------------


class DiTBlock(nn.Module):
    """AdaLN block. Modulation comes precomputed in ctx; `adaln_proj` (if built) is only read by
    `DiT.resident_modulation` or an online rebuild, never in forward.

    No op writes into `hidden_states` (cache-dit diffs a block's input against its output)."""

    def __init__(self, config: DiTConfig, index: int, with_adaln: bool, *, device=None, dtype=None):
        super().__init__()
        self.index = index
        self.hidden = config.hidden
        kw = dict(device=device, dtype=dtype)
        self.norm1 = RMSNorm(config.hidden, config.norm_eps, **kw)
        self.attn = Attention(config, **kw)
        self.norm2 = RMSNorm(config.hidden, config.norm_eps, **kw)
        self.mlp = SwiGLU(config, **kw)
        if with_adaln:
            self.adaln_proj = nn.Linear(config.time_embed_dim, config.adaln_width, bias=True, **kw)

    def forward(self, hidden_states: Tensor, *, ctx: BlockContext) -> Tensor:
        x = hidden_states  # [1, N, hidden]
        mod = ctx.modulation.blocks[self.index]  # [M, 3*6*hidden]
        mod = mod.reshape(-1, NUM_BLOCK_CHUNKS, self.hidden)  # [M*3, 6, hidden]: one row per (timestep, modality)
        # Gather per-token rows three chunks at a time (attention first) to halve the peak of the gather.
        shift, scale, gate = mod[:, 0:3][ctx.rows].unbind(1)  # each [N, hidden]
        h = self.norm1(x) * (1 + scale) + shift
        x = x + gate * self.attn(h, (ctx.rope_cos, ctx.rope_sin))
        shift, scale, gate = mod[:, 3:6][ctx.rows].unbind(1)
        h = self.norm2(x) * (1 + scale) + shift
        x = x + gate * self.mlp(h)
        return x


class RefinerBlock(nn.Module):
    """Plain pre-norm transformer block on the text tokens only (no AdaLN, no RoPE)."""

    def __init__(self, config: DiTConfig, *, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.norm1 = RMSNorm(config.hidden, config.norm_eps, **kw)
        self.attn = Attention(config, **kw)
        self.norm2 = RMSNorm(config.hidden, config.norm_eps, **kw)
        self.mlp = SwiGLU(config, **kw)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TimeEmbedding(nn.Module):
    """fp32: sinusoid(t*1000) [M, freq_dim] -> linear1 -> SiLU -> linear2 -> [M, time_embed_dim]."""

    def __init__(self, config: DiTConfig, *, device=None):
        super().__init__()
        self.freq_dim = config.freq_dim
        self.linear1 = nn.Linear(config.freq_dim, config.hidden, device=device, dtype=torch.float32)
        self.linear2 = nn.Linear(config.hidden, config.time_embed_dim, device=device, dtype=torch.float32)

    def forward(self, t: Tensor) -> Tensor:
        return self.linear2(F.silu(self.linear1(timestep_sinusoid(t, self.freq_dim))))


def timestep_sinusoid(t: Tensor, dim: int) -> Tensor:
    """t fp32 [M] in [0, 1] -> fp32 [M, dim]: cos then sin of t*1000 at geometric frequencies."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None, :]  # [M, half]
    emb = torch.cat((args.cos(), args.sin()), dim=-1)
    return F.pad(emb, (0, dim - 2 * half))  # odd dim: one zero column


class FinalLayer(nn.Module):
    """RMSNorm modulated by one shift/scale per timestep (no per-modality rows); heads live on the DiT."""

    def __init__(self, config: DiTConfig, with_adaln: bool, *, device=None, dtype=None):
        super().__init__()
        self.norm = RMSNorm(config.hidden, config.norm_eps, device=device, dtype=dtype)
        if with_adaln:
            self.adaln_proj = nn.Linear(
                config.time_embed_dim, config.final_adaln_width, bias=True, device=device, dtype=dtype
            )

    def forward(self, x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        return self.norm(x) * (1 + scale) + shift


# ---------------------------------------------------------------------------------------------------------
# Patchify
# ---------------------------------------------------------------------------------------------------------


def patchify(video: Tensor, patch: tuple[int, int, int]) -> tuple[Tensor, tuple[int, int, int]]:
    """video [C, F, H, W] -> tokens [F'*H'*W', C*pt*ph*pw] (t-major, then h, then w) and the grid (F', H', W')."""
    C, Fr, H, W = video.shape
    pt, ph, pw = patch
    grid = (Fr // pt, H // ph, W // pw)
    x = video.reshape(C, grid[0], pt, grid[1], ph, grid[2], pw)
    x = x.permute(1, 3, 5, 0, 2, 4, 6)  # [F', H', W', C, pt, ph, pw]
    return x.reshape(grid[0] * grid[1] * grid[2], C * pt * ph * pw), grid


def unpatchify(tokens: Tensor, grid: tuple[int, int, int], patch: tuple[int, int, int], channels: int) -> Tensor:
    """Inverse of patchify: tokens [F'*H'*W', C*pt*ph*pw] -> video [C, F, H, W]."""
    pt, ph, pw = patch
    x = tokens.reshape(*grid, channels, pt, ph, pw)  # [F', H', W', C, pt, ph, pw]
    x = x.permute(3, 0, 4, 1, 5, 2, 6)  # [C, F', pt, H', ph, W', pw]
    return x.reshape(channels, grid[0] * pt, grid[1] * ph, grid[2] * pw)


# ---------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------


class DiT(nn.Module):
    """The MiniMax-H3-shaped DiT (inference only: parameters never require grad).

    `DiT(config, with_adaln=True, device=None, seed=0)` initialises every parameter deterministically from
    `seed` (model/init.py, shared with the checkpoint writer). On the meta device nothing
    is allocated or initialised (shapes only). `with_adaln=False` builds no `adaln_proj` modules at all:
    the caller then supplies the Modulation (e.g. from the AdaLN plan cache).
    """

    def __init__(self, config: DiTConfig, with_adaln: bool = True, device=None, *, seed: int = 0):
        super().__init__()
        self.config = config
        self.with_adaln = with_adaln
        target = torch.device(device) if device is not None else torch.get_default_device()
        meta, dtype = torch.device("meta"), config.torch_dtype
        kw = dict(device=meta, dtype=dtype)
        fp32 = dict(device=meta, dtype=torch.float32)

        # Built on meta first, then materialised once: no throwaway default init of a 33 B model.
        self.text_embedder = ByteTextEmbedder(config, device=meta)
        self.condition_proj = nn.Linear(config.text_dim, config.hidden, **kw)
        self.refiner = nn.ModuleList(RefinerBlock(config, **kw) for _ in range(config.num_refiner_blocks))
        self.video_in = nn.Linear(config.patch_dim, config.hidden, **fp32)
        self.audio_in = nn.Linear(config.audio_channels, config.hidden, **fp32)
        self.time_embed = TimeEmbedding(config, device=meta)
        self.blocks = nn.ModuleList(DiTBlock(config, i, with_adaln, **kw) for i in range(config.num_blocks))
        self.final = FinalLayer(config, with_adaln, **kw)
        self.video_out = nn.Linear(config.hidden, config.patch_dim, **fp32)
        self.audio_out = nn.Linear(config.hidden, config.audio_channels, **fp32)

        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights(seed)
        self.requires_grad_(False)
        self.eval()

    @property
    def device(self) -> torch.device:
        return self.video_in.weight.device

    def init_weights(self, seed: int, pool: Executor | None = None) -> None:
        """Fill every parameter from `seed` (model/init.py); equal to what `python -m model.checkpoint make --seed`
        writes."""
        init_parameters(self, self.config, seed, pool=pool)

    # --- AdaLN -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def adaln_input(self, timesteps: Tensor) -> Tensor:
        """timesteps fp32 [M] -> silu(time_embed(sinusoid(t*1000))) in model dtype [M, time_embed_dim]."""
        t = timesteps.to(device=self.device, dtype=torch.float32)
        return F.silu(self.time_embed(t)).to(self.config.torch_dtype)

    @torch.no_grad()
    def resident_modulation(self, adaln_input: Tensor) -> Modulation:
        """Project adaln_input [M, time_embed_dim] through every adaln_proj, one F.linear with exactly M rows each
        (an online rebuild makes the same call with the same shape, so the two agree bit for bit)."""
        if not self.with_adaln:
            raise RuntimeError("this DiT was built with with_adaln=False; supply the Modulation instead")
        blocks = torch.stack([F.linear(adaln_input, b.adaln_proj.weight, b.adaln_proj.bias) for b in self.blocks])
        final = F.linear(adaln_input, self.final.adaln_proj.weight, self.final.adaln_proj.bias)
        return Modulation(blocks=blocks, final=final)  # [num_blocks, M, adaln_width], [M, final_adaln_width]

    # --- Forward -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def prepare(self, video: Tensor, audio: Tensor, text_states: Tensor, step: StepTimesteps) -> Packed:
        """Embed and pack one request: text | audio | video. Text tokens use the video timestep's index."""
        cfg, dev, dtype = self.config, self.device, self.config.torch_dtype
        self._check_inputs(video, audio, text_states)
        video_tokens, grid = patchify(video.to(dev, torch.float32), cfg.patch)  # [Nv, patch_dim]
        vid = self.video_in(video_tokens).to(dtype)  # fp32 projection, then model dtype
        aud = self.audio_in(audio.to(dev, torch.float32)).to(dtype)  # [T, hidden]
        txt = self.condition_proj(text_states.to(dev, dtype))[None]  # [1, Lt, hidden]
        for block in self.refiner:
            txt = block(txt)
        tokens = torch.cat((txt[0], aud, vid))[None]  # [1, N, hidden]

        n_text, n_audio, n_video = txt.shape[1], aud.shape[0], vid.shape[0]

        def full(n, value):
            return torch.full((n,), value, dtype=torch.long, device=dev)

        tags = torch.cat((full(n_text, TAG_TEXT), full(n_audio, TAG_AUDIO), full(n_video, TAG_VIDEO)))
        index = torch.cat((full(n_text, step.video_index), full(n_audio, step.audio_index),
                           full(n_video, step.video_index)))
        rows = index * NUM_MODALITIES + tags.clamp(min=0)  # padding (-1) shares the video rows

        # RoPE positions (t, h, w): text at the origin (unrotated; the embedder carries its order),
        # audio frames along t, video patches on their grid.
        f, h, w = torch.meshgrid(*(torch.arange(n, dtype=torch.float32, device=dev) for n in grid), indexing="ij")
        pos_video = torch.stack((f, h, w), dim=-1).reshape(n_video, 3)
        pos_audio = F.pad(torch.arange(n_audio, dtype=torch.float32, device=dev)[:, None], (0, 2))
        pos_text = torch.zeros(n_text, 3, device=dev)
        cos, sin = rope_angles(torch.cat((pos_text, pos_audio, pos_video)), cfg.rope_axes_dims, cfg.rope_theta)
        num_rows = 1 + max(step.video_index, step.audio_index if n_audio else 0)
        return Packed(tokens, tags, index, cos, sin, rows, index, n_text, n_audio, grid, num_rows)

    def _check_inputs(self, video: Tensor, audio: Tensor, text_states: Tensor) -> None:
        cfg = self.config
        if video.dim() != 4 or video.shape[0] != cfg.video_channels:
            raise ValueError(f"video must be [C={cfg.video_channels}, F, H, W], got {tuple(video.shape)}")
        _, Fr, H, W = video.shape
        if any(n % p for n, p in zip((Fr, H, W), cfg.patch)) or min(Fr, H, W) == 0:
            raise ValueError(f"video F,H,W = {(Fr, H, W)} must be positive multiples of patch {cfg.patch}")
        if Fr > cfg.max_frames or H > cfg.max_height or W > cfg.max_width:
            raise ValueError(f"video F,H,W = {(Fr, H, W)} exceeds max {(cfg.max_frames, cfg.max_height, cfg.max_width)}")
        if audio.dim() != 2 or audio.shape[1] != cfg.audio_channels or audio.shape[0] > cfg.max_audio_len:
            raise ValueError(f"audio must be [T<={cfg.max_audio_len}, {cfg.audio_channels}], got {tuple(audio.shape)}")
        if text_states.dim() != 2 or text_states.shape[1] != cfg.text_dim or text_states.shape[0] == 0:
            raise ValueError(f"text_states must be [L>=1, {cfg.text_dim}], got {tuple(text_states.shape)}")

    @torch.no_grad()
    def output(self, hidden_states: Tensor, packed: Packed, modulation: Modulation) -> tuple[Tensor, Tensor]:
        """Final modulated norm and fp32 heads on the audio and video tokens -> (v_video [C,F,H,W], v_audio [T,Ca])."""
        cfg, n_text = self.config, packed.num_text
        x = hidden_states[:, n_text:]  # [1, Na+Nv, hidden]: text tokens need no output
        final = modulation.final.reshape(-1, NUM_FINAL_CHUNKS, cfg.hidden)  # [M, 2, hidden]
        shift, scale = final[packed.final_rows[n_text:]].unbind(1)  # each [Na+Nv, hidden]
        x = self.final(x, shift, scale)[0].float()  # [Na+Nv, hidden] fp32 for the heads
        v_audio = self.audio_out(x[: packed.num_audio])  # [T, Ca]
        v_video = unpatchify(self.video_out(x[packed.num_audio:]), packed.video_grid, cfg.patch, cfg.video_channels)
        return v_video, v_audio

    @torch.no_grad()
    def forward(
        self, video: Tensor, audio: Tensor, text_states: Tensor, step: StepTimesteps, modulation: Modulation
    ) -> tuple[Tensor, Tensor]:
        """Velocity for one step: video [C,F,H,W] fp32, audio [T,Ca] fp32, text_states [Lt,text_dim]
        -> (v_video [C,F,H,W] fp32, v_audio [T,Ca] fp32)."""
        packed = self.prepare(video, audio, text_states, step)
        ctx = packed.context(modulation)
        x = packed.tokens
        for block in self.blocks:
            x = block(x, ctx=ctx)
        return self.output(x, packed, modulation)

    def velocity(self, video: Tensor, audio: Tensor, text_states: Tensor, step: StepTimesteps) -> tuple[Tensor, Tensor]:
        """Convenience: resident modulation for step.timesteps, then forward (needs with_adaln=True)."""
        modulation = self.resident_modulation(self.adaln_input(step.timesteps))
        return self(video, audio, text_states, step, modulation)


# ---------------------------------------------------------------------------------------------------------
# Parameter inventory (shared with model/checkpoint.py)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def parameter_specs(config: DiTConfig, with_adaln: bool = True) -> dict[str, ParamSpec]:
    """Every parameter name (= checkpoint key) with shape and dtype, in module order; from a meta-device DiT,
    so it costs no memory even for h3."""
    model = DiT(config, with_adaln=with_adaln, device="meta")
    return {name: ParamSpec(tuple(p.shape), p.dtype) for name, p in model.named_parameters()}


def is_adaln_proj(name: str) -> bool:
    """A per-block or final AdaLN projection parameter (absent when with_adaln=False)."""
    return ".adaln_proj." in name


def is_adaln_rebuild_input(name: str) -> bool:
    """What rebuilding Modulation from a checkpoint reads: the time embedder and all AdaLN projections."""
    return is_adaln_proj(name) or name.startswith("time_embed.")
