"""Cache-DiT's compute-or-skip decision, made identically on every rank of a sequence-parallel group.

DBCache (cache-dit 1.5.3) runs the first Fn blocks of each step, then decides whether the middle blocks run or
the cached residual is reused. Under sequence parallelism every rank holds only its rows of the Fn residual, so a
rank-local decision can differ between ranks, and a rank that skips the middle blocks while another runs them
deadlocks in the next attention all-to-all. cache-dit's own multi-process path (`parallelized=True`, taken whenever
the default group has more than one rank) all-reduces the two bf16 means with `ReduceOp.AVG` over the default
group. It runs (on gloo too), but: it reduces over the whole default group, which is the replica only while
nothing else shares the process's world; the pad rows of the last shard count in its mean; and that every rank
gets the same float back is left to the backend's all-reduce algorithm.

The hook point we rely on (cache_dit/caching/cache_contexts/cache_manager.py, 1.5.3):
`CachedContextManager.can_cache(states, parallelized, threshold, prefix)` first applies the decisions that depend
only on step counters and the config (warmup, steps-computation mask, max cached and max continuous cached
steps, max accumulated diff, threshold <= 0), which are the same on every rank, then - if a previous residual is
stored - calls `self.similarity(prev, states, threshold=..., parallelized=..., prefix=...)`, the only decision
that reads tensor data. `install_rank_consistent_similarity(transformer._context_manager, ...)` sets
`similarity` as an instance attribute of the model's context manager (the object cache-dit's `CachedBlocks`
call as `context_manager`), which shadows the class's method there and nowhere else. The two all-reduces in
cache-dit's `similarity` are the only collectives its caching code issues, so none is left behind.

The replacement keeps cache-dit's contract (records the diff with `add_residual_diff`, -0.0 / -1.0 / -2.0 for
threshold <= 0, threshold >= 1, shape mismatch; returns diff < threshold) and computes the diff from the whole
sequence: each rank sums |t1 - t2| and |t1| over the real rows of its shard (pads excluded), the few sums are
all-gathered (one collective), and every rank adds the N rows in rank order in float64: the same numbers in the
same order, so the same diff bit for bit on every rank, whatever the backend. Sum over sum equals cache-dit's
mean over mean of the unsplit residual (both means divide by the same count). cache-dit's "important
condition" variant (only tokens whose own relative change exceeds a threshold) is served the same way, with the
selected sums and their count. cache-dit computes the means in the residual's dtype (bf16 for H3) and this in
fp32/fp64, so a one-device and a sequence-parallel run can decide differently only for a diff within bf16
rounding of the threshold (~0.4 %); the ranks of one run never differ.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from parallel.group import SpGroup

# cache-dit's codes for a diff that was not computed (recorded with add_residual_diff).
_NO_THRESHOLD = -0.0
_ALWAYS_SIMILAR = -1.0
_SHAPE_MISMATCH = -2.0

# Positions in the per-rank vector of sums.
_MISMATCH, _DIFF, _BASE, _SELECTED_DIFF, _SELECTED_BASE, _SELECTED_COUNT = range(6)


def local_l1_sums(prev: Tensor, curr: Tensor, num_real_rows: int | None, condition_threshold: float = 0.0) -> Tensor:
    """fp32 [6] on `prev`'s device: (shapes differ, Σ|prev - curr|, Σ|prev|, the same two sums over the
    selected tokens, number of selected elements) over the first `num_real_rows` rows (dim -2; None: all).

    Selected tokens (only when `condition_threshold` > 0): rows whose own mean |prev - curr| / mean |prev|
    exceeds it, as cache-dit's important-condition variant selects them."""
    sums = torch.zeros(6, dtype=torch.float32, device=prev.device)
    if prev.shape != curr.shape:
        sums[_MISMATCH] = 1.0
        return sums
    if num_real_rows is not None:
        prev, curr = prev[..., :num_real_rows, :], curr[..., :num_real_rows, :]
    change = (prev - curr).abs()
    base = prev.abs()
    sums[_DIFF] = change.sum(dtype=torch.float32)
    sums[_BASE] = base.sum(dtype=torch.float32)
    if condition_threshold > 0.0:
        selected = change.mean(dim=-1, dtype=torch.float32) / base.mean(dim=-1, dtype=torch.float32) > \
            condition_threshold  # [B, rows]
        sums[_SELECTED_DIFF] = change.float().sum(dim=-1)[selected].sum()
        sums[_SELECTED_BASE] = base.float().sum(dim=-1)[selected].sum()
        sums[_SELECTED_COUNT] = selected.sum() * prev.shape[-1]
    return sums


def global_relative_l1(prev: Tensor, curr: Tensor, group: SpGroup, num_real_rows: int | None = None,
                       condition_threshold: float = 0.0) -> float | None:
    """Σ|prev - curr| / Σ|prev| over every rank's real rows (None if the shapes differ on any rank); the same
    float on every rank. A collective: every rank of `group` must call it."""
    local = local_l1_sums(prev, curr, num_real_rows, condition_threshold)
    gathered = torch.empty(group.world_size * 6, dtype=torch.float32, device=local.device)
    group.all_gather(gathered, local, host_wait=True)
    total = [0.0] * 6
    for row in gathered.view(group.world_size, 6).tolist():  # rank order: the same additions on every rank
        total = [t + value for t, value in zip(total, row)]
    if total[_MISMATCH] > 0:
        return None
    if condition_threshold > 0.0 and total[_SELECTED_COUNT] > 0:
        return total[_SELECTED_DIFF] / total[_SELECTED_BASE]
    return total[_DIFF] / total[_BASE]


class RankConsistentSimilarity:
    """Stands in for `CachedContextManager.similarity` on one context manager (see the module docstring)."""

    def __init__(self, context_manager: object, group: SpGroup, num_real_rows: Callable[[], int] | None):
        self.context_manager = context_manager
        self.group = group
        self.num_real_rows = num_real_rows
        self.num_checks = 0  # residual checks that went through the group (one collective each)

    def __call__(self, t1: Tensor, t2: Tensor, *, threshold: float, parallelized: bool = False,
                 prefix: str = "Fn") -> bool:
        # `parallelized` is cache-dit's "reduce over the default group" switch; this always reduces over
        # `group` instead. Every branch before the collective depends only on the config (same on all ranks).
        manager = self.context_manager
        if threshold <= 0.0:
            manager.add_residual_diff(_NO_THRESHOLD)
            return False
        if threshold >= 1.0:
            manager.add_residual_diff(_ALWAYS_SIMILAR)
            return True
        reused = self._reused_cfg_diff()
        if reused is not None:
            diff = reused
        else:
            rows = self.num_real_rows() if self.num_real_rows is not None else None
            self.num_checks += 1
            diff = global_relative_l1(t1, t2, self.group, rows, manager.get_important_condition_threshold())
            if diff is None:
                manager.add_residual_diff(_SHAPE_MISMATCH)
                return False
        manager.add_residual_diff(diff)
        return diff < threshold

    def _reused_cfg_diff(self) -> float | None:
        """cache-dit reuses the non-CFG step's diff on a separate-CFG step (never the case for H3, which has
        no CFG); that diff was computed here, so it is the same on every rank."""
        manager = self.context_manager
        if manager.enable_separate_cfg() and manager.is_separate_cfg_step() and \
                not manager.cfg_diff_compute_separate():
            return manager.get_current_step_residual_diff()
        return None


def install_rank_consistent_similarity(context_manager: object, group: SpGroup,
                                       num_real_rows: Callable[[], int] | None = None) -> RankConsistentSimilarity:
    """Make `context_manager`'s (cache-dit's `CachedContextManager`, i.e. `transformer._context_manager` after
    `cache_dit.enable_cache`) residual check rank-consistent over `group`. `num_real_rows()` gives the real rows
    of this rank's shard in the running forward (`SequenceParallel.num_local_real_rows`); None: no pads.
    Every rank installs it; installing twice is an error."""
    if isinstance(context_manager.__dict__.get("similarity"), RankConsistentSimilarity):
        raise RuntimeError("a rank-consistent similarity is already installed on this context manager")
    similarity = RankConsistentSimilarity(context_manager, group, num_real_rows)
    context_manager.similarity = similarity  # shadows CachedContextManager.similarity for this object only
    return similarity
