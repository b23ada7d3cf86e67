"""Where a step's time goes: torch.profiler over a few forwards, reduced to a per-category table.

    with StepProfile(device) as profile:
        ...  # the forwards
    breakdown = profile.breakdown(num_steps)      # ms per step: gemm, attention, comm, other, idle, ...

On CUDA the intervals are the device's kernels (one rank, one device): a kernel's category comes from its name
(`category_of`). Categories can run at once (an all-to-all beside a GEMM), so they are also reduced over the
timeline: `busy` (any kernel running), `idle` (the window with no kernel at all: host-bound gaps, waits),
`comm_exposed` (only communication running: what overlap did not hide). The window is the first kernel's
start to the last kernel's end.

On CPU (degraded: host ops, not kernels) the intervals are the profiler's leaf ops on every thread, each
categorised by its nearest categorised ancestor (an `aten::addmm` under `aten::linear` is a GEMM, the
`aten::empty` inside a flash-attention op is attention); `idle` is then host time in no op (Python, hooks)
and gloo's own threads count as communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Table categories, in order. "other" is everything not named by the three before it (elementwise, norms,
#: copies, reductions, index ops).
CATEGORIES = ("gemm", "attention", "comm", "other")

# Substrings of lower-cased kernel / op names, checked in this order (attention before gemm: flash kernels are
# cutlass-built; comm first: nccl kernels name the ops they serve).
_NAME_RULES = (
    ("comm", ("nccl", "gloo", "all_to_all", "alltoall", "all_gather", "allgather", "all_reduce", "allreduce",
              "c10d::", "record_param_comms")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::baddbmm", "aten::_addmm_activation")),
)


def category_of(name: str) -> str | None:
    """The category a kernel or op name says, or None (the caller decides: "other", or an ancestor's)."""
    lowered = name.lower()
    for category, needles in _NAME_RULES:
        if any(needle in lowered for needle in needles):
            return category
    return None


@dataclass(frozen=True)
class Interval:
    category: str
    start_us: float
    end_us: float


def _measure(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def breakdown(intervals: list[Interval], num_steps: int) -> dict[str, float]:
    """ms per step: the window, each category's summed time, and the timeline's busy, idle and exposed comm."""
    if not intervals or num_steps < 1:
        return {}
    window = max(i.end_us for i in intervals) - min(i.start_us for i in intervals)
    result = {"window_ms": window}
    for category in CATEGORIES:
        result[f"{category}_ms"] = sum(i.end_us - i.start_us for i in intervals if i.category == category)
    busy = _measure([(i.start_us, i.end_us) for i in intervals])
    compute = _measure([(i.start_us, i.end_us) for i in intervals if i.category != "comm"])
    result["busy_ms"] = busy
    result["idle_ms"] = window - busy
    result["comm_exposed_ms"] = busy - compute  # time only communication ran
    return {key: round(value / 1e3 / num_steps, 3) for key, value in result.items()}


def _kernel_intervals(events) -> list[Interval]:
    # user annotations are record_function ranges mirrored on the device timeline, not kernels
    return [Interval(category_of(e.name) or "other", e.time_range.start, e.time_range.end)
            for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]


def _op_intervals(events) -> list[Interval]:
    intervals = []
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU or event.cpu_children:
            continue
        category, node = None, event
        while node is not None and category is None:
            category = category_of(node.name)
            node = node.cpu_parent
        intervals.append(Interval(category or "other", event.time_range.start, event.time_range.end))
    return intervals


class StepProfile:
    """torch.profiler around a block of forwards on `device` (kernels on CUDA, host ops on CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)

    def __enter__(self) -> StepProfile:
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the last kernels must end inside the profile
        self._profiler.__exit__(*exc)

    def intervals(self) -> list[Interval]:
        events = self._profiler.events()
        if self.device.type == "cuda":
            return _kernel_intervals(events)
        return _op_intervals(events)

    def breakdown(self, num_steps: int) -> dict[str, float]:
        return breakdown(self.intervals(), num_steps)
