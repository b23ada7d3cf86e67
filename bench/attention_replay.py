"""The attention call a block makes, caught as it runs and replayed alone: its kernel on the block's own q/k/v.

Why: inside the compiled FP8 block the attention kernel ran 9-14% slower than the same kernel on the same shapes
inside the bf16 block (bench/results/forward-breakdown-clocks-nvidia-h100.md, forward-breakdown-nvidia-h200.md).
Replaying each block's call alone, side by side and beside fresh N(0, 1) tensors of the same layout, splits the
causes: if the replays time alike, what slows it is the block around it (the clocks the FP8 GEMMs leave, the
compiled graph's layouts: `bench.forward_breakdown.attention_inputs`), not the values it reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def is_attention_op(op: torch._ops.OpOverload) -> bool:
    """SDPA's kernels as the dispatcher reaches them (`aten._scaled_dot_product_cudnn_attention`, `..._flash_...`,
    `..._efficient_...`) and our FA4 op (`ditserve::flash_attention_4`)."""
    name = op.name()
    return "scaled_dot_product" in name or "flash_attention" in name


@dataclass(frozen=True)
class AttentionCall:
    """One attention op as a block dispatched it, with the tensors it was handed (kept alive)."""

    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict[str, object]

    def __call__(self) -> object:
        return self.op(*self.args, **self.kwargs)

    def tensors(self) -> list[torch.Tensor]:
        """The tensor arguments in order: query, key, value, then any mask."""
        return [a for a in self.args if isinstance(a, torch.Tensor)]

    def with_tensors(self, replaced: list[torch.Tensor]) -> "AttentionCall":
        """The same call with its tensor arguments replaced in order (shapes and strides are the caller's)."""
        fresh = iter(replaced)
        args = tuple(next(fresh) if isinstance(a, torch.Tensor) else a for a in self.args)
        return AttentionCall(self.op, args, self.kwargs)

    def describe(self) -> str:
        """The op, then each of q/k/v's shape, strides and standard deviation."""
        parts = [f"{tuple(t.shape)} strides {t.stride()} std {t.float().std().item():.3g}" for t in self.tensors()[:3]]
        return f"{self.op.name()}: " + "; ".join(parts)


class _Catch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[AttentionCall] = []
        self.outputs: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_attention_op(func):
            self.calls.append(AttentionCall(func, tuple(args), dict(kwargs or {})))
            self.outputs.append(out)
        return out


def caught_attention(run: Callable[[], object]) -> tuple[AttentionCall, object]:
    """The one attention call `run` (an eager block's forward) makes, and what it returned there. A run making
    none or several is a ValueError: the replay would not say which kernel it times."""
    with torch.no_grad(), _Catch() as catch:
        run()
    if len(catch.calls) != 1:
        raise ValueError(f"expected one attention call, caught {len(catch.calls)}: "
                         f"{[c.op.name() for c in catch.calls]}")
    return catch.calls[0], catch.outputs[0]


def fresh_like(call: AttentionCall, seed: int = 0) -> AttentionCall:
    """`call` on N(0, 1) q/k/v of the same shapes, strides and dtypes (the control: values no block made); any
    further tensor (a mask) is kept."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    tensors = call.tensors()
    fresh = []
    for t in tensors[:3]:
        values = torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype)
        strided = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        fresh.append(strided.copy_(values))
    return call.with_tensors(fresh + tensors[3:])
