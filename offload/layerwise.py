"""Layerwise offload of a `nn.ModuleList` of blocks, aware of DBCache's block skipping.

Weights of streamed blocks live in consolidated host buffers (`pinned.py`); on the device such a block
holds empty placeholders until a copy stream loads it. Forward hooks on the blocks are the only seam
to the model: the pre-forward hook makes sure the block holds real weights (waiting on its copy, or
loading it synchronously) and tops up the prefetch window; the post-forward hook records that the
block ran and releases it.

Skip awareness (cache-dit's DBCache runs the first Fn blocks, then either the middle blocks or none of
them, then the last Bn blocks):

- Only blocks that actually ran are trusted: a jump from block a to block b releases the streamed
  blocks prefetched in the gap (they count as wasted) and loads b synchronously if it is not there.
- At a step boundary, prefetches the new step will not start with are released; the last blocks of a
  step still prefetch the next step's head.
- Skip prediction (`set_cache_blocks` + `begin_step(will_compute_middle)`): the Fn and Bn blocks stay
  resident, and the middle blocks are streamed only once the step is known to compute them: either
  `begin_step(True)` (warmup, steps mask, max (continuous) cached steps force it; see
  `cache.cache_dit.CacheDit.predict_middle`) or the first middle block's pre-forward hook fires (the
  residual check missed). A cached step therefore copies no weights at all.

Blocks are called with any arguments (the hooks never read them), e.g. the diffusers MiniMax-H3 block's
`(hidden_states, temb, adaln_indices, rotary_emb)`.
Block tensors named by `resident_tensors` (H3: `adaln_proj`, whose projection also serves the AdaLN plan
cache) are moved to the device once like the model's other weights; a block whose `adaln_proj` holds no
weights (AdaLN served from the plan cache) has only its row index there (`model.adaln._BlockRows.row_index`: one
aligned slot streamed, or kept resident when named). Every tensor must be loaded
(not meta) and every submodule replacement done before `apply`.
A tensor-subclass parameter (torchao's FP8 weights: fp8 data + fp32 scales) streams as the tensors it wraps
(`wrapped.py`), so an FP8 block moves about half a bf16 block's bytes.

Invariants (checked by `check_invariants`):
- every streamed tensor belongs to a submodule still in its block (replacing one after `apply` would
  leave its old weights streamed);
- a block holds real device weights iff its state is not OFF; otherwise every tensor is a placeholder;
- resident blocks are never OFF after `apply`;
- `device_bytes` equals the bytes of the blocks that are not OFF.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from device.pinned import PinnedMemory
from device.streams import Device, Event, Stream, make_device

from .pinned import BlockHostBuffers, BlockLayout, TensorSlot, slot_view
from .wrapped import inner_tensors, is_wrapped, rebuilt, rebuilt_on

logger = logging.getLogger(__name__)

#: Name under which the hooks are registered; a block carrying it cannot be offloaded twice.
HOOK_NAME = "ditserve_layerwise_offload"


class OffloadConfig(BaseModel):
    """How blocks are streamed. Same names as `offload:` in serve_config.yaml."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    enabled: bool = Field(False, description="Stream block weights from host memory instead of keeping them on the GPU.")
    prefetch_depth: int = Field(
        1, ge=0, description="Streamed blocks kept loaded ahead of the running one (0: load each block when called)."
    )
    num_resident: int = Field(
        0, ge=0, description="Blocks kept on the GPU besides the DBCache edges, chosen by residency_policy."
    )
    residency_policy: Literal["leading", "strided"] = Field(
        "leading",
        description="leading: the first num_resident candidate blocks stay resident; strided: resident blocks are "
        "spread evenly, so streamed blocks alternate with resident ones (same bytes, smoother PCIe load).",
    )
    resident_cache_edges: bool = Field(
        True, description="With DBCache on, keep its Fn and Bn blocks resident so a cached step moves no weights."
    )
    skip_predictive: bool = Field(
        True,
        description="With DBCache on, stream middle blocks only once the step is known to compute them "
        "(never speculatively into a step that may be cached).",
    )
    resident_tensors: tuple[str, ...] = Field(
        (),
        description="Block tensors never streamed, by name relative to the block (prefix match, e.g. 'adaln_proj'): "
        "moved to the device once, like non-block weights.",
    )
    pin_memory: bool = Field(True, description="Page-lock the host buffers (fast asynchronous copies).")
    pinned_budget_gb: float | None = Field(
        None, ge=0, description="Most pinned host memory in GiB; beyond it buffers are pageable (one warning). None: no limit."
    )
    alignment_bytes: int = Field(256, ge=1, description="Alignment of every tensor inside a block's host/device buffer.")

    @field_validator("alignment_bytes")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"alignment_bytes={v} must be a power of two")
        return v

    @property
    def pinned_budget_bytes(self) -> int | None:
        return None if self.pinned_budget_gb is None else int(self.pinned_budget_gb * 2**30)


@dataclass
class OffloadStats:
    """Counters since `apply` (or `reset_stats`). Loads done by `apply` for resident blocks are not counted."""

    h2d_bytes: int = 0  # bytes of block weights copied host -> device
    h2d_bytes_per_step: list[int] = field(default_factory=list)  # bytes issued during each step
    sync_loads: int = 0  # loads the compute stream had to wait for right away
    prefetches: int = 0  # loads issued ahead of use
    wasted_prefetches: int = 0  # loaded blocks released without having run
    block_calls: int = 0  # block forwards
    steps: int = 0
    peak_device_bytes: int = 0  # most block-weight bytes on the device at once (resident included)

    def snapshot(self) -> "OffloadStats":
        """A copy later steps do not change (what a request's result carries)."""
        return replace(self, h2d_bytes_per_step=list(self.h2d_bytes_per_step))


class _State(enum.Enum):
    OFF = "off"  # placeholders on the device; weights only in the host buffers
    LOADING = "loading"  # copy queued on the copy stream; the compute stream has not waited yet
    ON = "on"  # the compute stream waited for the copy; safe to run


@dataclass
class _Ref:
    """One place a block tensor is referenced from (a parameter or a buffer of some submodule, or the tensor
    named `inner` inside such a wrapper-subclass parameter)."""

    owner: nn.Module
    attr: str
    is_buffer: bool
    inner: str | None = None


@dataclass
class _Entry:
    index: int
    module: nn.Module
    layout: BlockLayout
    host: BlockHostBuffers
    refs: dict[str, list[_Ref]]  # slot name -> where the tensor is referenced
    origin: dict[str, torch.device]  # slot name -> device the tensor was on before apply
    event: Event
    state: _State = _State.OFF
    flat: dict[torch.dtype, torch.Tensor] | None = None  # device buffers while not OFF
    ran: bool = False  # ran since it was loaded
    copy_recorded: bool = False  # a copy from the host buffers may still be in flight
    handles: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes


def _excluded(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _block_tensors(
    block: nn.Module, exclude: tuple[str, ...] = ()
) -> tuple[list[tuple[str, torch.Tensor, bool]], dict[str, list[_Ref]]]:
    """A block's distinct tensors in module order (those named by `exclude` left out), and every
    (submodule, attribute) referencing each. A wrapper subclass contributes the tensors it wraps, named
    `{name}.{inner}` (`attn.to_q.weight.qdata`, `attn.to_q.weight.scale`)."""
    seen: dict[tuple[int, str | None], str] = {}
    tensors: list[tuple[str, torch.Tensor, bool]] = []
    refs: dict[str, list[_Ref]] = {}
    for prefix, sub in block.named_modules(remove_duplicate=False):
        for table, is_buffer in ((sub._parameters, False), (sub._buffers, True)):
            for attr, t in table.items():
                if t is None:
                    continue
                name = f"{prefix}.{attr}" if prefix else attr
                if _excluded(name, exclude):
                    continue
                parts = ([(f"{name}.{inner}", value, inner) for inner, value in inner_tensors(t).items()]
                         if is_wrapped(t) else [(name, t, None)])
                for slot_name, value, inner in parts:
                    key = (id(t), inner)
                    if key not in seen:
                        seen[key] = slot_name
                        tensors.append((slot_name, value, is_buffer))
                        refs[slot_name] = []
                    if all(r.owner is not sub or r.attr != attr for r in refs[seen[key]]):
                        refs[seen[key]].append(_Ref(sub, attr, is_buffer, inner))
    return tensors, refs


def plan_residency(
    num_blocks: int, num_resident: int, policy: str, edges: frozenset[int] = frozenset()
) -> frozenset[int]:
    """Indices kept on the device: the `edges` plus `num_resident` of the others, chosen by `policy`.

    strided: with M candidates and r resident, candidate floor((k + 1/2) * M / r) for k < r, so the
    streamed blocks are spread evenly between resident ones (16 blocks, r=4: 2, 6, 10, 14).
    """
    candidates = [i for i in range(num_blocks) if i not in edges]
    r = min(num_resident, len(candidates))
    if r == 0:
        chosen: list[int] = []
    elif policy == "leading":
        chosen = candidates[:r]
    elif policy == "strided":
        m = len(candidates)
        chosen = [candidates[(2 * k + 1) * m // (2 * r)] for k in range(r)]
    else:
        raise ValueError(f"unknown residency_policy {policy!r}; use leading or strided")
    return frozenset(edges) | frozenset(chosen)


class LayerwiseOffloader:
    """Streams the blocks of `blocks` between host buffers and `device`, hooked onto each block.

    `root` (optional) is the model holding the blocks: its other parameters and buffers are moved to
    the device by `apply` (non-block weights stay resident). Use:

        off = LayerwiseOffloader(model.blocks, OffloadConfig(enabled=True), "cuda", root=model).apply()
        off.set_cache_blocks(fn, bn)            # with DBCache on (per request if Fn/Bn change)
        for step: off.begin_step(will_compute_middle); model(...)
    """

    def __init__(
        self,
        blocks: nn.ModuleList,
        config: OffloadConfig,
        device: torch.device | str | Device | None = None,
        *,
        root: nn.Module | None = None,
    ):
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise ValueError("blocks must be a non-empty nn.ModuleList")
        self.blocks = blocks
        self.config = config
        self.device = make_device(device)
        self.root = root
        self.num_blocks = len(blocks)
        self.stats = OffloadStats()
        self._entries: list[_Entry] = []
        self._applied = False
        self._cache_blocks: tuple[int, int] | None = None
        self._resident: frozenset[int] = frozenset()
        self._streamed: list[int] = []
        self._middle: range | None = None  # gated middle blocks (skip prediction on)
        self._memory: PinnedMemory | None = None
        self._copy_stream: Stream | None = None
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self.device_bytes = 0
        # Per-step state.
        self._step_open = False
        self._last_ran: int | None = None
        self._running: int | None = None
        self._middle_known: bool | None = None  # will this step compute the middle blocks?
        self._step_blocks: list[int] = []
        self.last_step_blocks: list[int] = []  # blocks that ran in the previous completed step
        self._replan()

    # ------------------------------------------------------------------------------------------
    # Lifecycle
    # ------------------------------------------------------------------------------------------

    def apply(self) -> "LayerwiseOffloader":
        """Copy block weights into host buffers, leave placeholders, load resident blocks, hook."""
        if self._applied:
            raise RuntimeError("offloader already applied")
        for i, block in enumerate(self.blocks):
            if getattr(block, HOOK_NAME, None) is not None:
                raise RuntimeError(f"block {i} already carries the {HOOK_NAME!r} hooks; remove() them first")
        self._check_materialised()
        per_block = [_block_tensors(b, self.config.resident_tensors) for b in self.blocks]
        owner: dict[int, int] = {}
        for i, (tensors, _) in enumerate(per_block):
            for name, t, _ in tensors:
                if owner.setdefault(id(t), i) != i:
                    raise ValueError(f"block {i} tensor {name!r} is shared with block {owner[id(t)]}; cannot offload")
        self._memory = PinnedMemory(self.device, pin=self.config.pin_memory,
                                    budget_bytes=self.config.pinned_budget_bytes, owner="offload")
        self._copy_stream = self.device.new_stream("copy")
        entries: list[_Entry | None] = [None] * self.num_blocks
        # Streamed blocks get pinned memory first: resident ones are copied only on weight updates/replans.
        order = sorted(range(self.num_blocks), key=lambda i: (i in self._resident, i))
        for i in order:
            tensors, refs = per_block[i]
            layout = BlockLayout.build(tensors, self.config.alignment_bytes)
            host = BlockHostBuffers(layout, self._memory)
            with torch.no_grad():
                host.fill_({name: t for name, t, _ in tensors})
            entries[i] = _Entry(
                index=i, module=self.blocks[i], layout=layout, host=host, refs=refs,
                origin={name: t.device for name, t, _ in tensors}, event=self.device.new_event(),
            )
        self._entries = [e for e in entries if e is not None]
        for e in self._entries:
            # A wrapper's device is fixed when it is built: it must say the device its inner tensors will be on.
            self._rewrap(e, lambda t: rebuilt_on(t, self.device.torch_device))
            self._point_at_placeholders(e)
            e.handles = [
                e.module.register_forward_pre_hook(self._make_pre_hook(e.index)),
                e.module.register_forward_hook(self._make_post_hook(e.index)),
            ]
            setattr(e.module, HOOK_NAME, self)
        self._move_resident_tensors({id(t) for tensors, _ in per_block for _, t, _ in tensors})
        self._applied = True
        for i in sorted(self._resident):
            self._load(self._entries[i], count=False)
        for i in sorted(self._resident):
            self._wait(self._entries[i])
        return self

    def remove(self) -> None:
        """Unhook and give every block its weights back as ordinary tensors on their original devices."""
        if not self._applied:
            return
        self.device.synchronize()  # in-flight copies must land before the host buffers are read back
        for e in self._entries:
            for h in e.handles:
                h.remove()
            e.handles = []
            delattr(e.module, HOOK_NAME)
            for name, slot in e.host.slots.items():
                self._set_tensor(e, name, e.host.view(slot).to(e.origin[name], copy=True))
            self._rewrap(e, lambda t: rebuilt(t, inner_tensors(t)))  # on the devices of its inner tensors again
            e.state, e.flat = _State.OFF, None
        self.device_bytes = 0
        self._applied = False

    def _check_materialised(self) -> None:
        """ValueError naming the tensors still on the meta device: a loader may leave some there (e.g. AdaLN
        projections served from the plan cache) for the caller to replace, which must happen before `apply`,
        since neither a host buffer nor a resident copy can be made of a meta tensor."""
        named: dict[int, tuple[str, nn.Module]] = {}  # by module: its name (the root's names first)
        for i, block in enumerate(self.blocks):
            for n, sub in block.named_modules():
                named[id(sub)] = (f"block {i}" + (f" {n}" if n else ""), sub)
        if self.root is not None:
            named.update((id(sub), (n or type(sub).__name__, sub)) for n, sub in self.root.named_modules())
        meta = sorted({f"{prefix}.{attr}"
                       for prefix, sub in named.values()
                       for table in (sub._parameters, sub._buffers)
                       for attr, t in table.items() if t is not None and t.is_meta})
        if meta:
            shown = ", ".join(meta[:4]) + (f" and {len(meta) - 4} more" if len(meta) > 4 else "")
            raise ValueError(f"{len(meta)} tensors are on the meta device (not loaded): {shown}; "
                             "load or replace them before applying the offloader")

    def _move_resident_tensors(self, streamed: set[int]) -> None:
        """Non-block weights of `root` and the blocks' `resident_tensors` stay resident: move them once.
        `streamed`: ids of the tensors the host buffers hold (their references now hold placeholders)."""
        modules = list(self.root.modules()) if self.root is not None else []
        modules += [m for b in self.blocks for m in b.modules()]
        dev = self.device.torch_device
        with torch.no_grad():
            for sub in modules:
                for p in sub._parameters.values():
                    if p is not None and id(p) not in streamed and p.numel() and p.device != dev:
                        p.data = p.data.to(dev)
                for attr, b in list(sub._buffers.items()):
                    if b is not None and id(b) not in streamed and b.numel() and b.device != dev:
                        sub._buffers[attr] = b.to(dev)

    # ------------------------------------------------------------------------------------------
    # DBCache shape and residency
    # ------------------------------------------------------------------------------------------

    def set_cache_blocks(self, fn: int, bn: int) -> None:
        """DBCache is on with `fn` leading and `bn` trailing compute blocks (may change per request)."""
        if fn < 0 or bn < 0 or fn + bn > self.num_blocks:
            raise ValueError(f"Fn={fn}, Bn={bn} do not fit {self.num_blocks} blocks (need Fn, Bn >= 0 and Fn + Bn <= blocks)")
        if self._cache_blocks != (fn, bn):
            self._cache_blocks = (fn, bn)
            self._replan()

    def clear_cache_blocks(self) -> None:
        """DBCache is off: every step runs every block."""
        if self._cache_blocks is not None:
            self._cache_blocks = None
            self._replan()

    @property
    def resident_indices(self) -> list[int]:
        return sorted(self._resident)

    @property
    def streamed_indices(self) -> list[int]:
        return list(self._streamed)

    def _replan(self) -> None:
        edges: frozenset[int] = frozenset()
        self._middle = None
        if self._cache_blocks is not None:
            fn, bn = self._cache_blocks
            if self.config.resident_cache_edges:
                edges = frozenset(range(fn)) | frozenset(range(self.num_blocks - bn, self.num_blocks))
            if self.config.skip_predictive:
                self._middle = range(fn, self.num_blocks - bn)
        old = self._resident
        self._resident = plan_residency(self.num_blocks, self.config.num_resident, self.config.residency_policy, edges)
        self._streamed = [i for i in range(self.num_blocks) if i not in self._resident]
        if not self._applied:
            return
        for i in sorted(old - self._resident):
            if i != self._running:
                self._release(self._entries[i])
        for i in sorted(self._resident - old):
            self._load(self._entries[i], sync=False)

    # ------------------------------------------------------------------------------------------
    # Steps
    # ------------------------------------------------------------------------------------------

    def begin_step(self, will_compute_middle: bool | None = None) -> None:
        """A denoising step (one model forward) starts.

        `will_compute_middle`: True if DBCache will surely compute the middle blocks this step, False if
        it will surely skip them, None if that depends on the Fn residual. Without skip prediction it
        is ignored. Calling it is optional: a block index not above the last one that ran also starts
        a new step (with None).
        """
        self._start_step(will_compute_middle)

    def forward_ended(self) -> None:
        """The model call is over, whether or not it finished: a block whose forward raised (e.g. out of memory)
        never ran its post-forward hook, and would otherwise count as running until the next step (which
        refuses `load_block_state_`)."""
        self._running = None

    def _gated(self, i: int) -> bool:
        return self._middle is not None and i in self._middle

    def _may_run_now(self, i: int) -> bool:
        return not self._gated(i) or self._middle_known is True

    def _start_step(self, will: bool | None) -> None:
        self._running = None  # no block runs between steps (also after a block's forward raised)
        if self._step_open:
            self.last_step_blocks = self._step_blocks
        self._step_blocks = []
        self._middle_known = will if self._middle is not None else None
        self._last_ran = None
        self._step_open = True
        self.stats.steps += 1
        self.stats.h2d_bytes_per_step.append(0)
        if not self._applied:
            return
        head = set(self._window(after=-1))
        for i in self._streamed:
            # Leftover prefetches this step will not start with (e.g. a middle block prefetched before
            # a cached step, or Bn=0's block Fn): release them now rather than hold them all step.
            if i not in head and i != self._running:
                self._release(self._entries[i])
        self._top_up(after=-1)

    def _window(self, after: int) -> list[int]:
        """The streamed blocks that should be loaded while block `after` runs (-1: at step start)."""
        depth = self.config.prefetch_depth
        targets: list[int] = []
        if depth == 0:
            return targets
        for j in self._streamed:
            if len(targets) == depth:
                return targets
            if j > after and self._may_run_now(j):
                targets.append(j)
        # Near the end of the step: the next step's head, which must not count on the middle running.
        for j in self._streamed:
            if len(targets) == depth:
                break
            if j != after and j not in targets and not self._gated(j):
                targets.append(j)
        return targets

    def _top_up(self, after: int) -> None:
        for j in self._window(after):
            self._load(self._entries[j], sync=False)

    # ------------------------------------------------------------------------------------------
    # Hooks
    # ------------------------------------------------------------------------------------------

    def _make_pre_hook(self, index: int):
        def pre_forward(module: nn.Module, args):
            self._before_block(index)

        return pre_forward

    def _make_post_hook(self, index: int):
        def post_forward(module: nn.Module, args, output):
            self._after_block(index)

        return post_forward

    def _before_block(self, i: int) -> None:
        if not self._step_open or (self._last_ran is not None and i <= self._last_ran):
            self._start_step(None)
        lo = -1 if self._last_ran is None else self._last_ran
        for j in self._streamed:
            # Trust only blocks that ran: streamed blocks between the last one that ran and this one
            # were skipped (DBCache jumped over them); whatever was prefetched there is released.
            if lo < j < i:
                self._release(self._entries[j])
        if self._gated(i):
            self._middle_known = True  # a middle block runs: this step computes the middle
        e = self._entries[i]
        if e.state is _State.OFF:
            self._load(e, sync=True)
        self._wait(e)
        self._running = i
        self._top_up(after=i)

    def _after_block(self, i: int) -> None:
        e = self._entries[i]
        self._running = None
        self._last_ran = i
        self._step_blocks.append(i)
        self.stats.block_calls += 1
        e.ran = True
        if i not in self._resident:
            self._release(e)

    # ------------------------------------------------------------------------------------------
    # Loading and releasing
    # ------------------------------------------------------------------------------------------

    def _load(self, e: _Entry, *, sync: bool = False, count: bool = True) -> None:
        if e.state is not _State.OFF:
            if sync:
                self._wait(e)
            return
        assert self._copy_stream is not None
        with self.device.use_stream(self._copy_stream):
            # Allocated for the copy stream: the allocator hands out memory whose earlier users on that
            # stream are ordered before this copy, and `_release` guards compute-stream users.
            flat = {dt: self.device.empty(n, dt) for dt, n in e.layout.numel_per_dtype.items()}
            for dt, buf in flat.items():
                self.device.copy_(buf, e.host.flat[dt])
            e.event.record(self._copy_stream)
        e.copy_recorded = True
        e.flat = flat
        e.state = _State.LOADING
        e.ran = False
        for name, slot in e.host.slots.items():
            self._set_tensor(e, name, slot_view(flat[slot.dtype], slot))
        self.device_bytes += e.nbytes
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self.device_bytes)
        if count:
            self.stats.h2d_bytes += e.nbytes
            if self.stats.h2d_bytes_per_step and self._step_open:
                self.stats.h2d_bytes_per_step[-1] += e.nbytes
            if sync:
                self.stats.sync_loads += 1
            else:
                self.stats.prefetches += 1
        if sync:
            self._wait(e)

    def _wait(self, e: _Entry) -> None:
        if e.state is _State.LOADING:
            # The block's kernels read these weights: without this wait they could start before the
            # copy on the copy stream has landed and read uninitialised memory.
            self.device.current_stream().wait_event(e.event)
            e.state = _State.ON

    def _release(self, e: _Entry) -> None:
        if e.state is _State.OFF:
            return
        assert e.flat is not None
        if e.state is _State.ON:
            compute = self.device.current_stream()
            for buf in e.flat.values():
                # Kernels queued on the compute stream may still read these weights: without this the
                # allocator could hand the memory to the next prefetch while they run.
                self.device.free_after_use_on(buf, compute)
        if not e.ran:
            self.stats.wasted_prefetches += 1
        self._point_at_placeholders(e)
        e.flat = None
        e.state = _State.OFF
        self.device_bytes -= e.nbytes

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._placeholders:
            self._placeholders[dtype] = self.device.placeholder(dtype)
        return self._placeholders[dtype]

    def _point_at_placeholders(self, e: _Entry) -> None:
        for name, slot in e.host.slots.items():
            self._set_tensor(e, name, self._placeholder(slot.dtype))

    def _set_tensor(self, e: _Entry, name: str, value: torch.Tensor) -> None:
        for r in e.refs[name]:
            if r.inner is not None:
                setattr(self._get_outer(r), r.inner, value)
            elif r.is_buffer:
                r.owner._buffers[r.attr] = value
            else:
                r.owner._parameters[r.attr].data = value

    @staticmethod
    def _get_outer(r: _Ref) -> torch.Tensor:
        return r.owner._buffers[r.attr] if r.is_buffer else r.owner._parameters[r.attr]

    @classmethod
    def _get_tensor(cls, r: _Ref) -> torch.Tensor:
        outer = cls._get_outer(r)
        return getattr(outer, r.inner) if r.inner is not None else outer

    def _rewrap(self, e: _Entry, build: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every wrapper-subclass tensor of the block by `build(wrapper)` wherever it is referenced
        (one wrapper referenced from several submodules is rebuilt once and stays one tensor)."""
        new_by_id: dict[int, torch.Tensor] = {}
        places = {(id(r.owner), r.attr, r.is_buffer): r for refs in e.refs.values() for r in refs if r.inner is not None}
        for r in places.values():
            outer = self._get_outer(r)
            if id(outer) not in new_by_id:
                new = build(outer)
                new_by_id[id(outer)] = new if r.is_buffer else nn.Parameter(new, requires_grad=outer.requires_grad)
            if r.is_buffer:
                r.owner._buffers[r.attr] = new_by_id[id(outer)]
            else:
                r.owner._parameters[r.attr] = new_by_id[id(outer)]

    # ------------------------------------------------------------------------------------------
    # Weights
    # ------------------------------------------------------------------------------------------

    def block_state(self, index: int) -> dict[str, torch.Tensor]:
        """The host copy of block `index` (views into its host buffers; do not write into them)."""
        e = self._entry(index)
        return {name: e.host.view(slot) for name, slot in e.host.slots.items()}

    def load_block_state_(self, index: int, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Write new weights for block `index` (names relative to the block) into its host buffers and,
        if it is resident, into its device copy. A loaded streamed block is dropped and reloads on use.

        Checks every name and shape before writing anything; not allowed while a block runs.
        """
        e = self._entry(index)
        if self._running is not None:
            raise RuntimeError(f"cannot update block {index} while block {self._running} runs")
        names = set(e.host.slots)
        missing, unexpected = sorted(names - set(state_dict)), sorted(set(state_dict) - names)
        if unexpected or (strict and missing):
            raise ValueError(f"block {index}: missing tensors {missing}, unexpected tensors {unexpected}")
        for name, t in state_dict.items():
            slot = e.host.slots[name]
            if tuple(t.shape) != slot.shape:
                raise ValueError(f"block {index}: {name!r} has shape {tuple(t.shape)}, expected {slot.shape}")
        if e.copy_recorded:
            # The copy engine may still be reading the old host bytes (also after a release):
            # overwriting them now could tear the device copy.
            e.event.synchronize()
        with torch.no_grad():
            for name, t in state_dict.items():
                e.host.view(e.host.slots[name]).copy_(t)
            if e.state is not _State.OFF:
                if e.index in self._resident:
                    self._wait(e)
                    for name, t in state_dict.items():
                        slot = e.host.slots[name]
                        slot_view(e.flat[slot.dtype], slot).copy_(t)
                else:
                    self._release(e)

    def _entry(self, index: int) -> _Entry:
        if not self._applied:
            raise RuntimeError("offloader not applied")
        if not 0 <= index < self.num_blocks:
            raise ValueError(f"block index {index} out of range [0, {self.num_blocks})")
        return self._entries[index]

    # ------------------------------------------------------------------------------------------
    # Introspection
    # ------------------------------------------------------------------------------------------

    def is_on_device(self, index: int) -> bool:
        return self._entry(index).state is not _State.OFF

    def loaded_indices(self) -> list[int]:
        return [e.index for e in self._entries if e.state is not _State.OFF]

    def holds_real_weights(self, index: int) -> bool:
        """Every tensor of block `index` is a view of its device buffer with the right shape."""
        e = self._entry(index)
        if e.flat is None:
            return False
        for name, slot in e.host.slots.items():
            for r in e.refs[name]:
                t = self._get_tensor(r)
                if tuple(t.shape) != slot.shape or t.device != self.device.torch_device:
                    return False
                if t.untyped_storage().data_ptr() != e.flat[slot.dtype].untyped_storage().data_ptr():
                    return False
        return True

    def holds_placeholders(self, index: int) -> bool:
        e = self._entry(index)
        return all(self._get_tensor(r).numel() == 0 for refs in e.refs.values() for r in refs)

    def check_invariants(self) -> None:
        """Raise RuntimeError naming every violated invariant (see the module docstring)."""
        problems = []
        for e in self._entries:
            inside = {id(m) for m in e.module.modules()}
            detached = sorted(name for name, refs in e.refs.items() if any(id(r.owner) not in inside for r in refs))
            if detached:
                # e.g. an adaln_proj replaced after apply: its old weights would still be streamed every step
                problems.append(f"block {e.index} streams {detached} of submodules no longer in the block")
            if e.state is _State.OFF:
                if not self.holds_placeholders(e.index):
                    problems.append(f"block {e.index} is off the device but holds real tensors")
                if e.index in self._resident:
                    problems.append(f"resident block {e.index} is off the device")
            elif not self.holds_real_weights(e.index):
                problems.append(f"block {e.index} is on the device ({e.state.value}) without real weights")
        expect = sum(e.nbytes for e in self._entries if e.state is not _State.OFF)
        if expect != self.device_bytes:
            problems.append(f"device_bytes={self.device_bytes}, blocks on the device hold {expect}")
        if problems:
            raise RuntimeError("; ".join(problems))

    def reset_stats(self) -> None:
        self.stats = OffloadStats(peak_device_bytes=self.device_bytes)

    def describe(self) -> dict:
        """Plan and sizes, for logs and benchmarks."""
        sizes = [e.nbytes for e in self._entries]
        return {
            "num_blocks": self.num_blocks,
            "resident": self.resident_indices,
            "streamed": self.streamed_indices,
            "cache_blocks": self._cache_blocks,
            "block_bytes": sizes,
            "resident_bytes": sum(sizes[i] for i in self._resident) if sizes else 0,
            "pinned_bytes": self._memory.pinned_bytes if self._memory else 0,
            "pageable_bytes": self._memory.pageable_bytes if self._memory else 0,
            "config": self.config.model_dump(),
        }


__all__ = [
    "HOOK_NAME",
    "LayerwiseOffloader",
    "OffloadConfig",
    "OffloadStats",
    "TensorSlot",
    "plan_residency",
]
