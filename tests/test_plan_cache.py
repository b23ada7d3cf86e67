"""The tier walk (`PlanCache.prepare`) on a real tiny checkpoint: hits, host restores, rebuilds, admission,
failures, invalidation and weight updates. Tiny: 4 blocks; with plan_width=2 slot s owns rows 2s, 2s+1."""

import re
import shutil

import pytest
import torch

from cache.plan_cache import AdmissionError, PlanRows, SlabFullError, WeightUpdateError
from cache.plan_key import plan_key
from cache.rebuild import RebuildError
from cache.streams import Streams
from model.checkpoint import load_model, make_checkpoint
from model.config import preset
from tests.adaln_support import (
    FaultyReader, assert_equal_to_resident, host_gb, online_cache, plan, resident, schedule,
)

A = schedule(0.9, 2)   # two plans of width 2
B = schedule(0.5, 2)
C = schedule(0.3, 2)


def slots_of(cache, plans):
    return [cache.slab.index.lookup(plan_key(p, cache.weights_version)) for p in plans]


def test_first_request_builds_then_the_same_schedule_hits_the_gpu(tiny):
    cache = online_cache(tiny)
    first = cache.prepare(A)
    assert (first.stats.built_plans, first.stats.gpu_hit_plans) == (2, 0)
    assert first.row_index.tolist() == [0, 1, 2, 3]   # fresh slab: slots 0 and 1
    adaln_names = [n for n in tiny.reader.keys() if ".adaln_proj." in n]  # 4 blocks + final, weight + bias
    assert len(adaln_names) == 10
    assert first.stats.rebuild_bytes_read == sum(tiny.reader.location(n).nbytes for n in adaln_names)
    first.release()
    second = cache.prepare(A)
    assert (second.stats.built_plans, second.stats.gpu_hit_plans) == (0, 2)
    assert_equal_to_resident(second, resident(tiny), A)


def test_modulation_rows_reach_the_forward_as_a_device_int_tensor(tiny):
    cache = online_cache(tiny)
    pointers = (cache.slab.blocks.data_ptr(), cache.slab.final.data_ptr())
    prepared = cache.prepare([A[0], A[1], A[0]])       # step 2 reuses step 0's plan
    assert prepared.row_index.dtype == torch.int64 and prepared.row_index.device == cache.device
    assert prepared.row_index.tolist() == [0, 1, 2, 3, 0, 1]
    assert prepared.step_rows(2).tolist() == [0, 1]
    mod = prepared.modulation(1)
    assert mod.blocks.shape == (4, 2, 1152) and mod.final.shape == (2, 128)
    prepared.release()
    cache.prepare(B).release()
    assert (cache.slab.blocks.data_ptr(), cache.slab.final.data_ptr()) == pointers  # never reallocated


def test_lru_order_across_requests(tiny):
    cache = online_cache(tiny, gpu_plans=3)
    cache.prepare(A).release()            # a0 -> slot 0, a1 -> slot 1
    cache.prepare(B[:1]).release()        # b0 -> slot 2; released last, so most recently used
    assert cache.slab.index.lru_order() == [0, 1, 2]
    c = cache.prepare(C)                  # evicts a0 then a1, the least recently used
    assert slots_of(cache, C) == [0, 1] and slots_of(cache, A) == [None, None]
    assert c.stats.gpu_evicted_plans == 2
    c.release()
    b = cache.prepare(B[:1])
    assert b.stats.gpu_hit_plans == 1 and slots_of(cache, B[:1]) == [2]


def test_in_flight_plans_never_evicted(tiny):
    cache = online_cache(tiny, gpu_plans=3)
    held = cache.prepare(A)               # slots 0, 1 stay referenced (a request mid-denoise)
    cache.prepare(B[:1]).release()        # slot 2
    c = cache.prepare(C[:1])              # must take slot 2: slots 0 and 1 are in flight
    assert slots_of(cache, C[:1]) == [2] and slots_of(cache, A) == [0, 1]
    with pytest.raises(SlabFullError, match="in-flight"):
        cache.prepare(B)                  # 2 new plans, 0 slots free or evictable
    assert cache.slab.index.refcount(0) == 1 and cache.slab.index.refcount(2) == 1  # failure took nothing
    c.release()
    assert_equal_to_resident(held, resident(tiny), A)
    held.release()


def test_refcounts_and_idempotent_release(tiny):
    cache = online_cache(tiny)
    r1, r2 = cache.prepare(A), cache.prepare(A)
    assert [cache.slab.index.refcount(s) for s in (0, 1)] == [2, 2]
    r1.release()
    r1.release()                          # idempotent (e.g. cancel after completion)
    assert [cache.slab.index.refcount(s) for s in (0, 1)] == [1, 1]
    assert cache.slab.index.lru_order() == []
    r2.release()
    assert cache.slab.index.lru_order() == [0, 1]
    with pytest.raises(RuntimeError, match="after release"):
        r2.modulation(0)


def test_host_tier_restore_is_bit_exact(tiny):
    cache = online_cache(tiny, gpu_plans=2, host_cache_gb=host_gb(8))
    a = cache.prepare(A)
    assert a.stats.host_stored_plans == 2
    a.release()
    cache.prepare(B).release()            # evicts A's plans from the 2-slot slab
    assert slots_of(cache, A) == [None, None]
    again = cache.prepare(A)
    assert (again.stats.host_hit_plans, again.stats.built_plans, again.stats.gpu_hit_plans) == (2, 0, 0)
    assert again.stats.h2d_bytes == 4 * cache.host.page_bytes
    assert_equal_to_resident(again, resident(tiny), A)


def test_two_alternating_schedules_both_stay_resident(tiny):
    cache = online_cache(tiny, gpu_plans=4, host_cache_gb=0.0)
    for _ in range(3):
        for plans in (A, B):
            cache.prepare(plans).release()
    assert cache.stats.built_plans == 4 and cache.stats.gpu_hit_plans == 8
    assert cache.stats.gpu_evicted_plans == 0


def test_alternating_schedules_beyond_the_slab_restore_from_the_host_tier(tiny):
    cache = online_cache(tiny, gpu_plans=2, host_cache_gb=host_gb(8))
    for _ in range(3):
        for plans in (A, B):
            cache.prepare(plans).release()
    # Built once each; every later request restores its group from the host tier.
    assert (cache.stats.built_plans, cache.stats.host_hit_plans, cache.stats.rebuild_bytes_read > 0) == (4, 8, True)


def test_pressure_skip_then_rebuild(tiny):
    cache = online_cache(tiny, gpu_plans=2, host_cache_gb=host_gb(3))  # A's group needs 4 pages
    a = cache.prepare(A)
    assert a.stats.host_pressure_skips == 1 and a.stats.host_stored_plans == 0
    a.release()
    cache.prepare(B).release()
    again = cache.prepare(A)
    assert (again.stats.host_hit_plans, again.stats.built_plans) == (0, 2)
    assert cache.stats.host_pressure_skips == 3
    assert_equal_to_resident(again, resident(tiny), A)


def test_failed_rebuild_missing_tensor_can_be_retried(tiny):
    faulty = FaultyReader(tiny.reader, missing={"blocks.2.adaln_proj.weight"})
    cache = online_cache(tiny, reader=faulty)
    with pytest.raises(RebuildError, match=r"blocks\.2\.adaln_proj\.weight"):
        cache.prepare(A)
    index = cache.slab.index
    assert index.num_free == 4 and slots_of(cache, A) == [None, None]  # slots given back
    faulty.missing.clear()                # the file is fixed
    retry = cache.prepare(A)
    assert retry.stats.built_plans == 2
    assert_equal_to_resident(retry, resident(tiny), A)


def test_failure_mid_stream_releases_hits_and_gives_new_slots_back(tiny):
    faulty = FaultyReader(tiny.reader)
    cache = online_cache(tiny, reader=faulty)
    cache.prepare(A[:1]).release()        # a0 in slot 0
    faulty.truncated.add("final.adaln_proj.weight")  # the last unit fails, after the blocks were written
    cache._units = None                   # the locations are re-read on the next rebuild
    with pytest.raises(RebuildError, match="short read"):
        cache.prepare(A)                  # a0 hits, a1 is rebuilt and fails
    index = cache.slab.index
    assert index.refcount(0) == 0 and index.lru_order() == [0]  # the hit's reference was dropped
    assert slots_of(cache, A) == [0, None] and index.num_free == 3
    faulty.truncated.clear()
    cache._units = None
    retry = cache.prepare(A)
    assert (retry.stats.gpu_hit_plans, retry.stats.built_plans) == (1, 1)
    assert_equal_to_resident(retry, resident(tiny), A)


def test_width_rejection_keeps_resident_plans(tiny):
    cache = online_cache(tiny, plan_width=2)
    cache.prepare(A).release()
    with pytest.raises(AdmissionError, match="adaln.plan_width"):
        cache.prepare([A[0], plan(0.7, 0.6, 0.5)])
    again = cache.prepare(A)
    assert (again.stats.gpu_hit_plans, again.stats.built_plans) == (2, 0)
    assert cache.stats.requests == 2      # the rejected request never started


def test_admission_boundary_counts_distinct_plans(tiny):
    cache = online_cache(tiny, gpu_plans=4)
    four = schedule(0.8, 4)
    cache.prepare(four + [four[0]]).release()     # 5 steps, 4 distinct plans: fits exactly
    with pytest.raises(AdmissionError, match="adaln.gpu_plans=4"):
        cache.prepare(schedule(0.8, 5))           # 5 distinct plans: rejected before any GPU work
    assert cache.stats.requests == 1


def test_invalidate_clears_every_tier(tiny):
    cache = online_cache(tiny, gpu_plans=4, host_cache_gb=host_gb(8))
    cache.prepare(A).release()
    cache.invalidate()
    assert cache.slab.index.num_free == 4 and cache.host.num_free_pages == 8
    again = cache.prepare(A)
    assert (again.stats.gpu_hit_plans, again.stats.host_hit_plans, again.stats.built_plans) == (0, 0, 2)


def test_invalid_plans_are_value_errors(tiny):
    cache = online_cache(tiny)
    with pytest.raises(ValueError, match="float32"):
        cache.prepare([torch.tensor([0.5], dtype=torch.float64)])
    with pytest.raises(ValueError, match="finite"):
        cache.prepare([plan(float("nan"))])
    with pytest.raises(ValueError, match="at least one plan"):
        cache.prepare([])


def test_stats_per_request_and_cumulative(tiny):
    cache = online_cache(tiny, gpu_plans=2, host_cache_gb=host_gb(4))
    cache.prepare(A).release()
    cache.prepare(B).release()            # evicts A's group from the 4-page host tier too
    last = cache.prepare(B)
    assert last.stats.model_dump() == {
        "requests": 1, "gpu_hit_plans": 2, "host_hit_plans": 0, "remote_hit_plans": 0, "pool_hit_plans": 0,
        "pool_published_plans": 0, "pool_lookup_s": 0.0, "built_plans": 0,
        "gpu_evicted_plans": 0, "host_stored_plans": 0, "host_evicted_groups": 0, "host_pressure_skips": 0,
        "rebuild_s": 0.0, "rebuild_bytes_read": 0, "h2d_bytes": 0,
    }
    total = cache.stats
    assert (total.requests, total.built_plans, total.gpu_hit_plans, total.host_evicted_groups) == (3, 4, 2, 1)
    assert total.gpu_evicted_plans == 2 and total.host_stored_plans == 4 and total.rebuild_s > 0


def test_weights_version_of_the_caller_must_match(tiny):
    cache = online_cache(tiny)
    cache.prepare(A, weights_version=cache.weights_version).release()
    with pytest.raises(WeightUpdateError, match="refresh_weight_derived_caches"):
        cache.prepare(A, weights_version=("other", 0))


def test_weight_update_sources_are_validated_before_anything_changes(tiny, tmp_path):
    cache = online_cache(tiny)
    cache.prepare(A).release()
    with pytest.raises(WeightUpdateError, match="without a source path"):
        cache.validate_weight_update_source(None)
    with pytest.raises(WeightUpdateError, match="without a source path"):
        cache.refresh_weight_derived_caches(None)
    # Wrong shapes: a checkpoint whose time_embed_dim differs.
    narrow = make_checkpoint(tmp_path / "narrow", preset("tiny", time_embed_dim=16), only="adaln")
    with pytest.raises(WeightUpdateError, match=r"blocks\.0\.adaln_proj\.weight.*\[1152, 16\]"):
        cache.validate_weight_update_source(narrow)
    # Missing tensor: drop one adaln tensor from a copy's index.
    broken = shutil.copytree(tiny.path, tmp_path / "broken")
    index_file = broken / "model.safetensors.index.json"
    index_file.write_text(index_file.read_text().replace('"final.adaln_proj.bias"', '"final.adaln_proj.zzz"'))
    with pytest.raises(WeightUpdateError, match=r"final\.adaln_proj\.bias"):
        cache.validate_weight_update_source(broken)
    cache.validate_weight_update_source(tiny.path)
    # Nothing was touched: the cached plans still hit.
    assert cache.prepare(A).stats.gpu_hit_plans == 2
    # Resident mode reads weights from the model: tensor updates are fine, bad directories are not.
    resident(tiny).validate_weight_update_source(None)
    with pytest.raises(WeightUpdateError):
        resident(tiny).validate_weight_update_source(narrow)


def test_refresh_bumps_the_version_so_old_plans_are_never_served(tiny, tmp_path):
    online = load_model(tiny.path, with_adaln=False)  # a private copy: the update mutates it
    cache = online_cache(tiny, host_cache_gb=host_gb(8))
    cache._adaln_input = online.adaln_input
    in_flight = cache.prepare(A)
    old_version = cache.weights_version
    new_dir = make_checkpoint(tmp_path / "seed1", preset("tiny"), seed=1)
    cache.validate_weight_update_source(new_dir)
    online.load_state_dict(load_model(new_dir, with_adaln=False).state_dict())  # the engine's weight write
    cache.refresh_weight_derived_caches(new_dir)
    assert cache.weights_version != old_version
    fresh = cache.prepare(A)
    assert (fresh.stats.gpu_hit_plans, fresh.stats.host_hit_plans, fresh.stats.built_plans) == (0, 0, 2)
    assert slots_of(cache, A) == [2, 3]   # slots 0, 1 still feed the in-flight request
    assert_equal_to_resident(fresh, resident(type(tiny)(new_dir, None, None, load_model(new_dir))), A)
    in_flight.release()
    assert cache.slab.index.num_free == 2  # detached slots come back on release


def test_remote_tier_seam_between_host_tier_and_rebuild(tiny):
    class DictRemote:
        def __init__(self):
            self.plans: dict = {}

        def lookup(self, keys):
            return {k: self.plans[k] for k in keys if k in self.plans}

        def publish(self, key, rows: PlanRows):
            self.plans[key] = rows

    remote = DictRemote()
    builder = online_cache(tiny)
    builder.remote = remote
    builder.prepare(A).release()
    assert len(remote.plans) == 2
    other = online_cache(tiny)            # another worker with the same weights
    other.remote = remote
    got = other.prepare(A)
    assert (got.stats.remote_hit_plans, got.stats.pool_hit_plans, got.stats.built_plans) == (2, 2, 0)
    assert_equal_to_resident(got, resident(tiny), A)


def test_walk_fences_host_restores_before_the_forward(tiny):
    log: list[str] = []
    cache = online_cache(tiny, gpu_plans=2, host_cache_gb=host_gb(8), streams=Streams("cpu", log=log))
    cache.prepare(A).release()
    cache.prepare(B).release()
    log.clear()
    cache.prepare(A).release()            # host hit
    assert [re.sub(r"e\d+", "E", op) for op in log[:4]] == [
        "compute.wait_event(E)",          # writes into recycled slots wait for the last D2H (B's store)
        "host.wait_stream(compute)",      # the H2D waits for forwards still reading those slots
        "host.record(E)",
        "compute.wait_event(E)",          # the forward waits for the H2D
    ]
    assert log[2].removeprefix("host.record") == log[3].removeprefix("compute.wait_event")
