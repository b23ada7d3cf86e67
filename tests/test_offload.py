"""Layerwise offload on a fake device: layout, the placeholder invariant under DBCache-style block
skipping, skip prediction, residency, pinned budget, weight updates, bit-exact outputs."""

from __future__ import annotations

import itertools
import logging
import random

import pytest
import torch
from torch import nn

from device.streams import FakeDevice
from offload import (
    HOOK_NAME,
    LayerwiseOffloader,
    OffloadConfig,
    plan_residency,
)
from offload.pinned import BlockLayout, dense_stride

WIDTH = 8


class TinyBlock(nn.Module):
    """A block with every kind of tensor the offloader must carry: two dtypes, a transposed (non-contiguous)
    parameter, a buffer, a parameter tied twice inside the block."""

    def __init__(self, index: int, width: int = WIDTH):
        super().__init__()
        self.index = index
        self.lin = nn.Linear(width, width)
        self.proj_t = nn.Parameter(torch.randn(2 * width, width).t())  # [width, 2*width], strides (1, width)
        self.scale64 = nn.Parameter(torch.rand(width, dtype=torch.float64) + 0.5)
        self.register_buffer("shift", torch.randn(width))
        self.tied = nn.Module()
        self.tied.weight = self.lin.weight  # the same Parameter reached twice

    def forward(self, hidden_states: torch.Tensor, *, ctx=None) -> torch.Tensor:
        h = torch.tanh(self.lin(hidden_states)) + self.shift
        h = h * self.scale64.to(h.dtype) + 0.1 * (hidden_states @ self.proj_t) @ self.proj_t.t()
        return hidden_states + 0.5 * h + 0.01 * (hidden_states @ self.tied.weight)


def make_blocks(n: int, seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(TinyBlock(i) for i in range(n))


def dbcache_order(n: int, fn: int, bn: int, cached: bool) -> list[int]:
    """Blocks cache-dit's DBCache calls in one step: all of them, or Fn then Bn when cached."""
    if not cached:
        return list(range(n))
    return list(range(fn)) + list(range(n - bn, n))


def run(blocks: nn.ModuleList, order: list[int], x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for i in order:
            x = blocks[i](x)
    return x


X = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(1))


def offloader(blocks, **cfg) -> LayerwiseOffloader:
    return LayerwiseOffloader(blocks, OffloadConfig(enabled=True, **cfg), FakeDevice()).apply()


def check_real_iff_on_device(off: LayerwiseOffloader) -> None:
    off.check_invariants()
    for i in range(off.num_blocks):
        assert off.holds_real_weights(i) is off.is_on_device(i), i
        assert off.holds_placeholders(i) is (not off.is_on_device(i)), i


# ---------------------------------------------------------------------------------------------------------
# Host buffers
# ---------------------------------------------------------------------------------------------------------


def test_layout_one_buffer_per_dtype_aligned_offsets_strides_kept():
    block = TinyBlock(0)
    tensors = [(n, t, False) for n, t in block.named_parameters()] + [("shift", block.shift, True)]
    layout = BlockLayout.build(tensors, alignment_bytes=64)
    assert set(layout.numel_per_dtype) == {torch.float32, torch.float64}
    for s in layout.slots:
        assert (s.offset * s.dtype.itemsize) % 64 == 0, s.name
    proj = next(s for s in layout.slots if s.name == "proj_t")
    assert proj.stride == (1, WIDTH) and proj.shape == (WIDTH, 2 * WIDTH)
    for dtype, n in layout.numel_per_dtype.items():
        assert n * dtype.itemsize % 64 == 0
    assert dense_stride(torch.randn(4, 1).expand(4, 3)) == (3, 1)  # overlapping views are stored contiguously


def test_offloaded_parameters_keep_their_strides():
    blocks = make_blocks(2)
    before = [blocks[i].proj_t.stride() for i in range(2)]
    off = offloader(blocks, num_resident=1)
    run(blocks, [0, 1], X)
    assert blocks[0].proj_t.stride() == before[0]  # resident: a view of its device buffer
    assert blocks[1].proj_t.shape == (0,)  # streamed and done: placeholder
    off.remove()
    assert [blocks[i].proj_t.stride() for i in range(2)] == before


# ---------------------------------------------------------------------------------------------------------
# The invariant under DBCache schedules
# ---------------------------------------------------------------------------------------------------------

# (Fn, Bn) pairs valid for both block counts; prefetch depth; residency.
MATRIX = list(itertools.product(
    [4, 7],
    [(1, 0), (1, 2), (2, 1), (3, 0)],
    [0, 1, 2],
    [("leading", 0), ("leading", 2), ("strided", 2)],
    [True, False],
))


@pytest.mark.parametrize("num_blocks,fn_bn,depth,residency,predictive", MATRIX)
def test_block_is_on_device_iff_it_holds_real_weights(num_blocks, fn_bn, depth, residency, predictive):
    """hit, miss, hit again, hit, miss, miss: after every step (and before the first) the invariant holds
    and the outputs equal running the same blocks without offload, bit for bit."""
    fn, bn = fn_bn
    policy, r = residency
    blocks = make_blocks(num_blocks)
    expect = {c: run(blocks, dbcache_order(num_blocks, fn, bn, c), X) for c in (False, True)}
    off = offloader(blocks, prefetch_depth=depth, residency_policy=policy, num_resident=r,
                    skip_predictive=predictive, resident_cache_edges=predictive)
    off.set_cache_blocks(fn, bn)
    check_real_iff_on_device(off)
    previous = []
    for cached in (True, False, True, True, False, False):
        off.begin_step(None)
        assert off.last_step_blocks == previous  # only blocks that actually ran are recorded
        previous = dbcache_order(num_blocks, fn, bn, cached)
        out = run(blocks, previous, X)
        assert torch.equal(out, expect[cached])
        check_real_iff_on_device(off)
    # Memory bound: resident blocks plus the running one and the prefetch window (twice: the Bn blocks
    # may be prefetched while the middle is undecided).
    one = max(off.describe()["block_bytes"])
    assert off.stats.peak_device_bytes <= off.describe()["resident_bytes"] + (1 + 2 * depth) * one


def test_mixed_full_and_skip_schedule_without_begin_step():
    """SCM/TaylorSeer-like schedules: runs of full steps and of cached steps, step boundaries detected
    from the block order alone."""
    rng = random.Random(0)
    for num_blocks, fn, bn, depth in [(6, 1, 2, 1), (6, 2, 0, 2), (5, 1, 1, 3)]:
        blocks = make_blocks(num_blocks, seed=num_blocks)
        expect = {c: run(blocks, dbcache_order(num_blocks, fn, bn, c), X) for c in (False, True)}
        off = offloader(blocks, prefetch_depth=depth)
        off.set_cache_blocks(fn, bn)
        schedule = [rng.random() < 0.5 for _ in range(24)]
        for cached in schedule:
            assert torch.equal(run(blocks, dbcache_order(num_blocks, fn, bn, cached), X), expect[cached])
            check_real_iff_on_device(off)
        assert off.stats.steps == len(schedule)
        assert off.stats.block_calls == sum(len(dbcache_order(num_blocks, fn, bn, c)) for c in schedule)


def test_blocks_run_in_any_ascending_subset():
    """The offloader does not assume DBCache's shape: arbitrary jumps stay correct."""
    blocks = make_blocks(6)
    off = offloader(blocks, prefetch_depth=2)
    for order in ([0, 2, 5], [1, 3], [0, 1, 2, 3, 4, 5], [4], [5], [0, 5], [2, 3, 4]):
        assert torch.equal(run(blocks, order, X), run_reference(order))
        check_real_iff_on_device(off)


def run_reference(order, n=6):
    return run(make_blocks(n), order, X)


# ---------------------------------------------------------------------------------------------------------
# Skip awareness (sglang's rules)
# ---------------------------------------------------------------------------------------------------------


def test_jump_releases_the_prefetched_gap_and_counts_it_wasted():
    blocks = make_blocks(6)
    off = offloader(blocks, prefetch_depth=2, skip_predictive=False, resident_cache_edges=False)
    off.set_cache_blocks(1, 1)
    off.begin_step()
    run(blocks, [0], X)
    assert off.loaded_indices() == [1, 2]  # speculative prefetch of the middle
    run(blocks, [5], X)  # DBCache hit: 0 -> 5
    assert off.stats.wasted_prefetches == 2  # blocks 1 and 2 never ran
    assert off.stats.sync_loads == 1  # block 5 was not in the window: loaded synchronously
    assert off.loaded_indices() == [0, 1]  # released 1, 2; then the last block prefetched the next head


def test_step_boundary_releases_leftover_prefetch_with_bn0():
    """Fn=1, Bn=0, no prediction: block 1 is prefetched while block 0 runs and the step is cached; the next
    step starts with block 0, so block 1 is released at the boundary (not held all step)."""
    blocks = make_blocks(4)
    off = offloader(blocks, prefetch_depth=1, skip_predictive=False, resident_cache_edges=False)
    off.set_cache_blocks(1, 0)
    off.begin_step()
    run(blocks, [0], X)
    assert off.loaded_indices() == [1]  # prefetched for a middle that this cached step skipped
    off.begin_step()
    assert off.loaded_indices() == [0]
    assert off.stats.wasted_prefetches == 1


def test_last_block_prefetches_the_next_steps_head():
    blocks = make_blocks(5)
    off = offloader(blocks, prefetch_depth=2)
    off.begin_step()
    run(blocks, range(5), X)
    assert off.loaded_indices() == [0, 1]
    before = off.stats.sync_loads
    off.begin_step()
    run(blocks, range(5), X)
    assert off.stats.sync_loads == before  # the whole step ran from prefetches
    assert off.stats.h2d_bytes_per_step[-1] == 5 * off.describe()["block_bytes"][0]


def test_every_streamed_block_is_prefetched_in_steady_state():
    blocks = make_blocks(6)
    off = offloader(blocks, prefetch_depth=1)
    for _ in range(3):
        off.begin_step()
        run(blocks, range(6), X)
    assert off.stats.sync_loads == 0  # begin_step prefetched block 0, then each block the next one
    assert off.stats.wasted_prefetches == 0


# ---------------------------------------------------------------------------------------------------------
# Skip prediction (beyond sglang)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn,bn", [(1, 0), (1, 2), (2, 1)])
def test_cached_step_moves_no_weights(fn, bn):
    n = 8
    blocks = make_blocks(n)
    off = offloader(blocks, prefetch_depth=2)
    off.set_cache_blocks(fn, bn)
    assert off.resident_indices == list(range(fn)) + list(range(n - bn, n))
    block_bytes = off.describe()["block_bytes"][0]
    middle = n - fn - bn
    # warmup (known), unknown -> cached, unknown -> miss, forced (max continuous), unknown -> cached x2
    for will, cached in [(True, False), (None, True), (None, False), (True, False), (None, True), (None, True)]:
        off.begin_step(will)
        run(blocks, dbcache_order(n, fn, bn, cached), X)
        assert off.stats.h2d_bytes_per_step[-1] == (0 if cached else middle * block_bytes)
        check_real_iff_on_device(off)
    assert off.stats.wasted_prefetches == 0
    assert off.stats.sync_loads == 1  # only the unannounced miss (its first middle block)


def test_known_compute_step_prefetches_the_middle_during_fn():
    blocks = make_blocks(6)
    off = offloader(blocks, prefetch_depth=1)
    off.set_cache_blocks(1, 1)
    off.begin_step(True)
    assert off.loaded_indices() == [0, 1, 5]  # edges resident, middle head in flight
    run(blocks, range(6), X)
    assert off.stats.sync_loads == 0


def test_unknown_step_waits_for_the_middle_then_streams_it():
    blocks = make_blocks(6)
    off = offloader(blocks, prefetch_depth=2)
    off.set_cache_blocks(1, 1)
    off.begin_step(None)
    assert off.loaded_indices() == [0, 5]
    run(blocks, [0], X)
    assert off.loaded_indices() == [0, 5]  # the middle is not prefetched into a step that may be cached
    run(blocks, [1], X)  # the residual check missed: the middle runs
    assert off.stats.sync_loads == 1
    assert off.loaded_indices() == [0, 2, 3, 5]
    run(blocks, [2, 3, 4, 5], X)
    assert off.stats.sync_loads == 1


def test_leading_resident_middle_blocks_hide_the_decision():
    """With num_resident leading middle blocks, an unannounced miss starts on resident blocks while the
    first streamed ones are fetched: no synchronous load."""
    blocks = make_blocks(8)
    off = offloader(blocks, prefetch_depth=1, num_resident=1, residency_policy="leading")
    off.set_cache_blocks(1, 1)
    assert off.resident_indices == [0, 1, 7]
    off.begin_step(None)
    run(blocks, range(8), X)
    assert off.stats.sync_loads == 0


def test_static_mask_cached_step_announced_false_then_runs_anyway_is_safe():
    blocks = make_blocks(5)
    expect = run(blocks, range(5), X)
    off = offloader(blocks, prefetch_depth=2)
    off.set_cache_blocks(1, 1)
    off.begin_step(False)  # a wrong prediction costs a synchronous load, never correctness
    assert torch.equal(run(blocks, range(5), X), expect)
    check_real_iff_on_device(off)


# ---------------------------------------------------------------------------------------------------------
# Residency
# ---------------------------------------------------------------------------------------------------------


def test_residency_plans():
    assert plan_residency(16, 4, "leading") == {0, 1, 2, 3}
    assert plan_residency(16, 4, "strided") == {2, 6, 10, 14}
    assert plan_residency(16, 12, "strided") == set(range(16)) - {1, 5, 9, 13}
    assert plan_residency(8, 2, "leading", frozenset({0, 7})) == {0, 1, 2, 7}
    assert plan_residency(8, 2, "strided", frozenset({0, 7})) == {0, 2, 5, 7}
    assert plan_residency(4, 10, "leading") == {0, 1, 2, 3}


def test_changing_fn_bn_replans_residency():
    blocks = make_blocks(6)
    expect = run(blocks, range(6), X)
    off = offloader(blocks, prefetch_depth=1)
    off.set_cache_blocks(1, 1)
    assert off.resident_indices == [0, 5]
    off.set_cache_blocks(2, 0)
    assert off.resident_indices == [0, 1]
    check_real_iff_on_device(off)
    off.clear_cache_blocks()
    assert off.resident_indices == []
    assert torch.equal(run(blocks, range(6), X), expect)
    with pytest.raises(ValueError, match="Fn=4, Bn=3"):
        off.set_cache_blocks(4, 3)


def test_offloaded_peak_is_below_resident_bytes():
    blocks = make_blocks(8)
    off = offloader(blocks, prefetch_depth=1)
    for _ in range(2):
        run(blocks, range(8), X)
    total = sum(off.describe()["block_bytes"])
    assert off.stats.peak_device_bytes <= 2 * total / 8 < total


def test_resident_tensors_are_not_streamed():
    blocks = make_blocks(3)
    expect = run(blocks, range(3), X)
    off = offloader(blocks, resident_tensors=("scale64",))
    assert all(b.scale64.numel() == WIDTH for b in blocks)  # kept as they are, never a placeholder
    assert torch.float64 not in off._entries[0].layout.numel_per_dtype
    assert torch.equal(run(blocks, range(3), X), expect)


# ---------------------------------------------------------------------------------------------------------
# Pinned memory budget
# ---------------------------------------------------------------------------------------------------------


def test_pinned_budget_falls_back_to_pageable_with_one_warning(caplog):
    blocks = make_blocks(6)
    expect = run(blocks, range(6), X)
    one = BlockLayout.build([(n, t, False) for n, t in blocks[0].named_parameters()]
                            + [("shift", blocks[0].shift, True)], 256).nbytes
    with caplog.at_level(logging.WARNING, logger="device.pinned"):
        off = offloader(blocks, num_resident=2, pinned_budget_gb=2.5 * one / 2**30)
    warnings = [r for r in caplog.records if "pinned budget" in r.getMessage()]
    assert len(warnings) == 1
    d = off.describe()
    assert d["pinned_bytes"] <= 2.5 * one and d["pageable_bytes"] > 0
    # Streamed blocks were served first: the two pinned ones are streamed ones.
    assert [e.host.pinned for e in off._entries] == [False, False, True, True, False, False]
    assert torch.equal(run(blocks, range(6), X), expect)


# ---------------------------------------------------------------------------------------------------------
# Weight updates
# ---------------------------------------------------------------------------------------------------------


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    """A full state for one TinyBlock (names relative to the block), from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in TinyBlock(0).state_dict().items()
            if n != "tied.weight"}


def test_load_block_state_reaches_resident_loaded_and_offloaded_blocks():
    blocks = make_blocks(5)
    reference = make_blocks(5)
    off = offloader(blocks, num_resident=1, prefetch_depth=2)  # block 0 resident
    off.begin_step()
    run(blocks, [0], X)  # blocks 1, 2 now prefetched (in flight on the fake copy stream)
    for i in (0, 1, 4):
        state = new_weights(seed=10 + i)
        off.load_block_state_(i, state)
        reference[i].load_state_dict(state, strict=False)
    check_real_iff_on_device(off)
    assert torch.equal(run(blocks, range(5), X), run(reference, range(5), X))
    assert torch.equal(off.block_state(4)["proj_t"], reference[4].proj_t)
    assert off.block_state(4)["proj_t"].stride() == reference[4].proj_t.stride()


def test_load_block_state_checks_names_and_shapes_before_writing():
    blocks = make_blocks(2)
    off = offloader(blocks)
    good = new_weights(seed=3)
    before = off.block_state(1)["lin.bias"].clone()
    with pytest.raises(ValueError, match=r"missing tensors \['shift'\]"):
        off.load_block_state_(1, {k: v for k, v in good.items() if k != "shift"})
    with pytest.raises(ValueError, match="unexpected tensors \\['nope'\\]"):
        off.load_block_state_(1, {**good, "nope": torch.zeros(1)})
    with pytest.raises(ValueError, match="'lin.weight' has shape"):
        off.load_block_state_(1, {**good, "lin.weight": torch.zeros(2, 2)})
    assert torch.equal(off.block_state(1)["lin.bias"], before)
    off.load_block_state_(1, {"lin.bias": good["lin.bias"]}, strict=False)
    assert torch.equal(off.block_state(1)["lin.bias"], good["lin.bias"])


# ---------------------------------------------------------------------------------------------------------
# Fake device, hooks, lifecycle
# ---------------------------------------------------------------------------------------------------------


def test_hooks_cannot_be_applied_twice():
    blocks = make_blocks(2)
    off = offloader(blocks)
    assert getattr(blocks[0], HOOK_NAME) is off
    with pytest.raises(RuntimeError, match="already carries"):
        LayerwiseOffloader(blocks, OffloadConfig(enabled=True), FakeDevice()).apply()
    with pytest.raises(RuntimeError, match="already applied"):
        off.apply()


def test_remove_restores_ordinary_weights():
    blocks = make_blocks(4)
    before = {k: v.clone() for k, v in blocks.state_dict().items()}
    expect = run(blocks, range(4), X)
    off = offloader(blocks, prefetch_depth=2)
    run(blocks, [0, 3], X)
    off.remove()
    assert not hasattr(blocks[0], HOOK_NAME)
    after = blocks.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert blocks[1].tied.weight is blocks[1].lin.weight
    assert torch.equal(run(blocks, range(4), X), expect)


def test_tensor_shared_between_blocks_is_rejected():
    blocks = make_blocks(2)
    blocks[1].lin.weight = blocks[0].lin.weight
    with pytest.raises(ValueError, match="shared with block 0"):
        LayerwiseOffloader(blocks, OffloadConfig(enabled=True), FakeDevice()).apply()


def test_config_validation():
    with pytest.raises(ValueError, match="prefetch_depth"):
        OffloadConfig(prefetch_depth=-1)
    with pytest.raises(ValueError, match="alignment_bytes"):
        OffloadConfig(alignment_bytes=48)
    with pytest.raises(ValueError, match="residency_policy"):
        OffloadConfig(residency_policy="random")


# ---------------------------------------------------------------------------------------------------------
# CUDA (the real streams/events/pinned memory)
# ---------------------------------------------------------------------------------------------------------


def test_cuda_hit_miss_hit_matches_resident_bit_for_bit():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    blocks = make_blocks(6).cuda()
    x = X.cuda()
    expect = {c: run(blocks, dbcache_order(6, 1, 2, c), x) for c in (False, True)}
    for predictive, depth in [(True, 1), (False, 2)]:
        off = LayerwiseOffloader(blocks, OffloadConfig(enabled=True, prefetch_depth=depth, skip_predictive=predictive,
                                                       resident_cache_edges=predictive), "cuda").apply()
        off.set_cache_blocks(1, 2)
        for cached in (True, False, True, True, False):
            off.begin_step(None)
            assert torch.equal(run(blocks, dbcache_order(6, 1, 2, cached), x), expect[cached])
            check_real_iff_on_device(off)
        assert all(e.host.pinned for e in off._entries)
        off.remove()
