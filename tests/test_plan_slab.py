"""GPU slab bookkeeping (`SlotIndex`) and layout (`PlanSlab`): slot ids, LRU order, refcounts."""

import pytest
import torch

from cache.slab import PlanSlab, SlabFullError, SlotIndex, SlotState


def ready(index: SlotIndex, *keys: str) -> list[int]:
    """Build and commit `keys` (one reference each), as a finished rebuild does."""
    slots = [index.allocate(k) for k in keys]
    for slot in slots:
        index.commit(slot)
    return slots


def test_fresh_slab_hands_out_lowest_slots_first():
    index = SlotIndex(4)
    assert ready(index, "a", "b", "c") == [0, 1, 2]
    assert (index.num_free, index.num_used, index.num_evictable) == (1, 3, 0)
    index.check()


def test_building_slot_invisible_until_commit():
    index = SlotIndex(2)
    slot = index.allocate("a")
    assert index.lookup("a") is None  # a half-built plan is never a hit
    index.commit(slot)
    assert index.lookup("a") == 0


def test_lru_evicts_least_recently_used_plan_and_hits_refresh_recency():
    index = SlotIndex(3)
    a, b, c = ready(index, "a", "b", "c")
    for slot in (a, b, c):
        index.free(slot)
    assert index.lru_order() == [0, 1, 2]
    index.touch(index.lookup("a"))  # a pure hit on "a": it leaves the LRU list while in use...
    index.free(a)                   # ...and comes back as most recently used
    assert index.lru_order() == [1, 2, 0]
    # "b" is now the least recently used, then "c"; "a" survives both allocations.
    assert index.allocate("d") == 1
    assert index.allocate("e") == 2
    assert index.lookup("b") is None and index.lookup("c") is None and index.lookup("a") == 0
    assert index.num_evicted == 2
    index.check()


def test_in_flight_plans_never_evicted():
    index = SlotIndex(2)
    a, b = ready(index, "a", "b")
    index.free(b)                    # "a" stays referenced by an in-flight request
    assert index.allocate("c") == 1  # evicts "b", the only unreferenced plan
    with pytest.raises(SlabFullError, match="adaln.gpu_plans"):
        index.allocate("d")          # "a" is in flight and "c" is building: nothing to evict
    assert index.lookup("a") == 0
    index.check()


def test_refcounts_count_requests_sharing_a_plan():
    index = SlotIndex(2)
    (a,) = ready(index, "a")   # request 1 built it
    index.touch(a)             # request 2 hits it
    assert index.refcount(a) == 2
    index.free(a)
    assert index.refcount(a) == 1 and index.lru_order() == []  # still in flight: not evictable
    index.free(a)
    assert index.refcount(a) == 0 and index.lru_order() == [0]
    with pytest.raises(RuntimeError, match="refcount 0"):
        index.free(a)
    index.check()


def test_failed_build_gives_its_slot_back_and_forgets_the_key():
    index = SlotIndex(2)
    slot = index.allocate("a")
    index.abort(slot)
    assert index.lookup("a") is None and index.num_free == 2 and index.state(slot) is SlotState.FREE
    assert index.allocate("a") == 0  # a retry gets a fresh slot and rebuilds
    index.check()


def test_building_slot_cannot_be_freed_only_committed_or_aborted():
    index = SlotIndex(1)
    slot = index.allocate("a")
    with pytest.raises(RuntimeError, match="still building"):
        index.free(slot)


def test_invalidate_detaches_in_use_slots_until_their_last_free():
    index = SlotIndex(2)
    a, b = ready(index, "a", "b")
    index.free(b)
    index.invalidate()
    assert index.lookup("a") is None and index.lookup("b") is None
    assert index.state(a) is SlotState.DETACHED and index.state(b) is SlotState.FREE
    assert index.allocate("c") == 1
    with pytest.raises(SlabFullError):
        index.allocate("d")          # slot 0 still feeds the request that held "a"
    index.free(a)                    # that request finishes: slot 0 is free again
    assert index.allocate("d") == 0
    index.check()


def test_plan_slab_rows_and_buffers_allocated_once():
    slab = PlanSlab(num_plans=3, plan_width=4, num_blocks=2, adaln_width=8, final_width=4,
                    dtype=torch.bfloat16, device="cpu")
    assert slab.blocks.shape == (2, 12, 8) and slab.final.shape == (12, 4)
    assert slab.row_ids([(2, 2), (0, 3)]) == [8, 9, 0, 1, 2]
    with pytest.raises(ValueError, match="does not fit"):
        slab.row_ids([(0, 5)])


# -- the eviction order the router reads (engine.served)


def served(index: SlotIndex, key: str) -> None:
    """One request for `key` that finished: a hit or a build, then its reference dropped."""
    slot = index.lookup(key)
    if slot is None:
        (slot,) = ready(index, key)
    else:
        index.touch(slot)
    index.free(slot)


def test_eviction_order_lists_the_keys_next_victim_first():
    index = SlotIndex(3)
    for key in "abc":
        served(index, key)
    served(index, "a")  # a hit refreshes recency
    assert index.eviction_order() == list("bca")
    index.touch(index.lookup("c"))  # in flight: not evictable, so not listed
    assert index.eviction_order() == list("ba")


@pytest.mark.parametrize("seed", range(4))
def test_replicas_fed_the_same_calls_decide_alike(seed):
    """What a sequence-parallel replica relies on: every rank's index sees the same calls in the same order and
    must evict alike (no clock, no randomness, no hash order). Invariants hold after every call."""
    import random

    rng = random.Random(seed)
    ranks = [SlotIndex(8) for _ in range(2)]
    in_flight: list[list[int]] = []
    for _ in range(400):
        if in_flight and (rng.random() < 0.5 or len(in_flight) > 2):
            slots = in_flight.pop(rng.randrange(len(in_flight)))
            for index in ranks:
                for slot in slots:
                    index.free(slot)
        else:
            keys = rng.sample(range(14), rng.randint(1, 3))
            taken = []
            for index in ranks:
                slots = []
                try:
                    for key in keys:
                        slot = index.lookup(key)
                        if slot is None:
                            slot = index.allocate(key)
                            index.commit(slot)
                        else:
                            index.touch(slot)
                        slots.append(slot)
                except SlabFullError:
                    for slot in slots:
                        index.free(slot)
                    slots = None
                taken.append(slots)
            assert taken[0] == taken[1]
            if taken[0]:
                in_flight.append(taken[0])
        for index in ranks:
            index.check()
        assert ranks[0].eviction_order() == ranks[1].eviction_order()
        assert [ranks[0].key(s) for s in range(8)] == [ranks[1].key(s) for s in range(8)]
