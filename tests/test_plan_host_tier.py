"""Pinned host tier: bit-exact round trips, group LRU, shared-plan refcounts, pressure skips, fences."""

import logging

import pytest
import torch

from cache.host_tier import HostTier, allocate_pages
from cache.slab import PlanSlab
from device.streams import FakeDevice

NUM_BLOCKS, WIDTH, FINAL = 3, 16, 4
PAGE_BYTES = (NUM_BLOCKS * WIDTH + FINAL) * 2  # bf16


def make(pages: int, log: list | None = None):
    gpu = FakeDevice(log=log)
    slab = PlanSlab(num_plans=8, plan_width=2, num_blocks=NUM_BLOCKS, adaln_width=WIDTH, final_width=FINAL,
                    dtype=torch.bfloat16, device="cpu")
    gen = torch.Generator().manual_seed(0)
    slab.blocks.copy_(torch.randn(slab.blocks.shape, generator=gen))
    slab.final.copy_(torch.randn(slab.final.shape, generator=gen))
    tier = HostTier(capacity_bytes=pages * PAGE_BYTES, num_blocks=NUM_BLOCKS, adaln_width=WIDTH,
                    final_width=FINAL, dtype=torch.bfloat16, gpu=gpu)
    return tier, slab, gpu


def test_host_round_trip_is_bit_exact():
    tier, slab, gpu = make(pages=4)
    compute = gpu.current_stream()
    before_blocks, before_final = slab.blocks[:, [0, 1, 4]].clone(), slab.final[[0, 1, 4]].clone()
    tier.store_group("g", [("a", [0, 1]), ("b", [4])], slab, compute)
    tier.fence_slab_writes(compute)  # a slab writer waits for the D2H (on the fake it is still queued)
    slab.blocks.zero_()
    slab.final.zero_()
    # Restore into other slots: a -> rows 10, 11 and b -> row 6.
    assert tier.load([("a", [10, 11]), ("b", [6])], slab, compute) == 3 * PAGE_BYTES
    assert torch.equal(slab.blocks[:, [10, 11, 6]], before_blocks)
    assert torch.equal(slab.final[[10, 11, 6]], before_final)
    tier.check()


def test_group_lru_evicts_whole_groups_and_lookup_refreshes_recency():
    tier, slab, gpu = make(pages=4)
    compute = gpu.current_stream()
    tier.store_group("g1", [("a", [0]), ("b", [2])], slab, compute)
    tier.store_group("g2", [("c", [4]), ("d", [6])], slab, compute)
    assert tier.group_order() == ["g1", "g2"]
    assert tier.lookup(["x", "b"]) == ["b"]     # a hit on g1's plan makes g1 most recently used
    assert tier.group_order() == ["g2", "g1"]
    result = tier.store_group("g3", [("e", [8])], slab, compute)
    # g2 is the LRU group: both of its plans go (all or nothing), g1 stays whole.
    assert result.evicted_groups == 1 and tier.group_order() == ["g1", "g3"]
    assert "c" not in tier and "d" not in tier and "a" in tier and "b" in tier
    assert tier.num_free_pages == 1
    tier.check()


def test_plans_shared_by_groups_are_refcounted():
    tier, slab, gpu = make(pages=3)
    compute = gpu.current_stream()
    tier.store_group("g1", [("a", [0]), ("b", [2])], slab, compute)
    result = tier.store_group("g2", [("b", [2]), ("c", [4])], slab, compute)
    assert result.stored_plans == 1          # "b" is shared: only "c" is copied
    assert tier.num_free_pages == 0
    tier.evict()                             # g1 goes; "b" is still listed by g2
    assert "a" not in tier and "b" in tier and "c" in tier and tier.num_free_pages == 1
    tier.check()


def test_storing_a_group_keeps_its_shared_plans_while_evicting():
    tier, slab, gpu = make(pages=3)
    compute = gpu.current_stream()
    tier.store_group("g1", [("a", [0]), ("b", [2])], slab, compute)
    tier.store_group("g2", [("c", [4])], slab, compute)
    # g3 = {b, d, e} needs 2 new pages: evict g1 (LRU) then g2; "b" survives because g3 references it.
    result = tier.store_group("g3", [("b", [2]), ("d", [6]), ("e", [8])], slab, compute)
    assert result.evicted_groups == 2 and tier.group_order() == ["g3"]
    assert result.stored_plans == 2 and "b" in tier
    tier.check()


def test_group_larger_than_the_tier_is_skipped_and_counted():
    tier, slab, gpu = make(pages=2)
    compute = gpu.current_stream()
    tier.store_group("small", [("a", [0])], slab, compute)
    result = tier.store_group("big", [("b", [2, 3]), ("c", [4])], slab, compute)  # 3 pages > 2
    assert result.skipped and tier.num_pressure_skips == 1
    assert tier.group_order() == ["small"]   # nothing evicted for a group that can never fit
    tier.check()


def test_zero_capacity_turns_the_tier_off():
    tier, slab, gpu = make(pages=0)
    assert not tier.enabled
    assert tier.store_group("g", [("a", [0])], slab, gpu.current_stream()).stored_plans == 0
    assert tier.lookup(["a"]) == []


def test_pinned_allocation_failure_halves_then_falls_back_to_pageable(caplog):
    calls = []

    def flaky(shape, dtype, pin):
        calls.append((shape[0], pin))
        if pin:
            raise RuntimeError("CUDA error: out of memory")
        return torch.empty(shape, dtype=dtype)

    with caplog.at_level(logging.WARNING, logger="cache.host_tier"):
        pages, pinned = allocate_pages(8, 10, torch.bfloat16, True, flaky)
    assert calls == [(8, True), (4, True), (4, False)]
    assert not pinned and pages.shape == (4, 10)
    assert len(caplog.records) == 1 and "pageable" in caplog.records[0].message


def test_pinned_allocation_at_half_size_warns_once(caplog):
    def half_ok(shape, dtype, pin):
        if shape[0] > 4:
            raise RuntimeError("cudaHostAlloc failed")
        return torch.empty(shape, dtype=dtype)

    with caplog.at_level(logging.WARNING, logger="cache.host_tier"):
        pages, pinned = allocate_pages(8, 10, torch.bfloat16, True, half_ok)
    assert pinned and pages.shape == (4, 10) and len(caplog.records) == 1


def test_copies_are_fenced_both_ways():
    log: list[str] = []
    tier, slab, gpu = make(pages=4, log=log)
    compute = gpu.current_stream()
    tier.store_group("g", [("a", [0])], slab, compute)
    # D2H waits for the compute stream that wrote the rows, then records its completion event.
    assert log == ["host.wait_stream(compute)", "host.record(e1)"]
    log.clear()
    tier.fence_slab_writes(compute)
    assert log == ["compute.wait_event(e1)"]  # slab writers wait for that D2H
    log.clear()
    tier.load([("a", [2])], slab, compute)
    # H2D waits for forwards queued on the compute stream; the compute stream waits for the H2D.
    assert log == ["host.wait_stream(compute)", "host.record(e2)", "compute.wait_event(e2)"]


@pytest.mark.parametrize("fenced", [True, False])
def test_a_slab_write_that_skips_the_fence_corrupts_the_pages_on_the_fake(fenced):
    # The deferring fake runs the D2H only once something waits for it, as a GPU may: a rebuild writing the
    # recycled rows without `fence_slab_writes` lands before the D2H read them, and the pages get the new rows.
    tier, slab, gpu = make(pages=4)
    compute = gpu.current_stream()
    stored = slab.blocks[:, 0].clone()
    tier.store_group("g", [("a", [0])], slab, compute)
    if fenced:
        tier.fence_slab_writes(compute)
    slab.blocks[:, 0] = 0.0  # the rebuild of another plan into the released slot
    tier.load([("a", [5])], slab, compute)
    assert torch.equal(slab.blocks[:, 5], stored if fenced else torch.zeros_like(stored))
