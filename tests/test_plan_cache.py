"""The tier walk (`PlanCache.prepare`) on the real tiny H3 checkpoint: hits, host restores, rebuilds, admission,
failures, invalidation and weight updates. Tiny: 4 blocks; with plan_width=2 slot s owns rows 2s, 2s+1; helpers and
the tiny numbers are in tests/adaln_support.py."""

import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cache.plan_cache import AdmissionError, PlanRows, SlabFullError, WeightUpdateError
from cache.plan_key import plan_key
from cache.rebuild import RebuildError
from device.streams import FakeDevice
from model.layout import H3Checkpoint, Layout
from model.loading import load_transformer
from model.tiny import make_tiny_checkpoint
from model.weights import is_adaln_param
from tests.adaln_support import (
    TINY_ADALN_BYTES, DictRemote, FaultyReader, Models, assert_equal_to_resident, assert_same_modulation, host_gb,
    make_models, online_cache, open_weights, plan, resident, resident_rows, schedule,
)

A = schedule(0.1, 2)   # two plans of width 2
B = schedule(0.5, 2)
C = schedule(0.7, 2)


def slots_of(cache, plans):
    return [cache.slab.index.lookup(plan_key(p, cache.weights_version)) for p in plans]


@pytest.fixture(params=list(Layout), ids=lambda layout: layout.value)
def served(request) -> Models:
    """The shared seed-0 tiny checkpoint, in each layout."""
    return request.getfixturevalue("tiny" if request.param is Layout.DIFFUSERS else "tiny_native")


def test_first_request_builds_then_the_same_schedule_hits_the_gpu(tiny):
    cache = online_cache(tiny)
    first = cache.prepare(A)
    assert (first.stats.built_plans, first.stats.gpu_hit_plans) == (2, 0)
    assert first.row_index.tolist() == [0, 1, 2, 3]   # fresh slab: slots 0 and 1
    adaln_names = [n for n in tiny.reader.names() if is_adaln_param(n)]  # 4 blocks + norm_out, weight + bias
    assert len(adaln_names) == 10
    # One pass reads every AdaLN tensor once: 4 x (1152x32 + 1152) + (128x32 + 128) bf16.
    assert first.stats.rebuild_bytes_read == sum(tiny.reader.location(n).nbytes for n in adaln_names) \
        == TINY_ADALN_BYTES == 312576
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


def test_host_tier_restore_is_bit_exact(served):
    cache = online_cache(served, gpu_plans=2, host_cache_gb=host_gb(8))
    a = cache.prepare(A)
    assert a.stats.host_stored_plans == 2
    a.release()
    cache.prepare(B).release()            # evicts A's plans from the 2-slot slab
    assert slots_of(cache, A) == [None, None]
    again = cache.prepare(A)
    assert (again.stats.host_hit_plans, again.stats.built_plans, again.stats.gpu_hit_plans) == (2, 0, 0)
    assert again.stats.h2d_bytes == 4 * cache.host.page_bytes == 4 * 9472
    assert_equal_to_resident(again, resident(served), A)


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
    # Built once each (one pass each: 2 x 312576 bytes); every later request restores its group from the host.
    assert (cache.stats.built_plans, cache.stats.host_hit_plans) == (4, 8)
    assert cache.stats.rebuild_bytes_read == 2 * TINY_ADALN_BYTES


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
    faulty = FaultyReader(tiny.reader, missing={"transformer_blocks.2.adaln_proj.linear.weight"})
    cache = online_cache(tiny, reader=faulty)
    with pytest.raises(RebuildError, match=r"transformer_blocks\.2\.adaln_proj\.linear\.weight"):
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
    faulty.truncated.add("norm_out.linear.weight")  # the last unit fails, after the blocks were written
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
        cache.prepare([A[0], plan(0.5, 0.6, 0.7)])
    again = cache.prepare(A)
    assert (again.stats.gpu_hit_plans, again.stats.built_plans) == (2, 0)
    assert cache.stats.requests == 2      # the rejected request never started


def test_admission_boundary_counts_distinct_plans(tiny):
    cache = online_cache(tiny, gpu_plans=4)
    four = schedule(0.2, 4)
    cache.prepare(four + [four[0]]).release()     # 5 steps, 4 distinct plans: fits exactly
    with pytest.raises(AdmissionError, match="adaln.gpu_plans=4"):
        cache.prepare(schedule(0.2, 5))           # 5 distinct plans: rejected before any GPU work
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
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValueError, match="finite"):
            cache.prepare([plan(0.5), plan(0.25, bad)])
    # the largest finite fp32 and a subnormal are plans like any other
    big, tiny_value = torch.finfo(torch.float32).max, torch.finfo(torch.float32).smallest_normal / 2
    cache.prepare([plan(big), plan(tiny_value)]).release()
    with pytest.raises(ValueError, match="at least one plan"):
        cache.prepare([])


def test_stats_per_request_and_cumulative(tiny):
    cache = online_cache(tiny, gpu_plans=2, host_cache_gb=host_gb(4))
    cache.prepare(A).release()
    cache.prepare(B).release()            # evicts A's group from the 4-page host tier too
    begin = time.perf_counter()
    last = cache.prepare(B)
    called_s = time.perf_counter() - begin
    stats = last.stats.model_dump()
    assert 0 < stats.pop("prepare_s") <= called_s  # this call's own time, measured inside it
    assert stats == {
        "requests": 1, "gpu_hit_plans": 2, "host_hit_plans": 0, "pool_hit_plans": 0,
        "pool_published_plans": 0, "pool_lookup_s": 0.0, "built_plans": 0,
        "gpu_evicted_plans": 0, "host_stored_plans": 0, "host_evicted_groups": 0, "host_pressure_skips": 0,
        "rebuild_s": 0.0, "rebuild_bytes_read": 0, "page_cache_bytes": 0, "disk_bytes": 0, "h2d_bytes": 0,
    }
    total = cache.stats
    assert (total.requests, total.built_plans, total.gpu_hit_plans, total.host_evicted_groups) == (3, 4, 2, 1)
    assert total.gpu_evicted_plans == 2 and total.host_stored_plans == 4 and total.rebuild_s > 0


def test_remote_tier_seam_between_host_tier_and_rebuild(tiny):
    remote = DictRemote()
    builder = online_cache(tiny)
    builder.remote = remote
    builder.prepare(A).release()
    builder.close()  # drains the publish thread, which sends the plans to the remote after the request
    assert len(remote.plans) == 2
    other = online_cache(tiny)            # another worker with the same weights
    other.remote = remote
    got = other.prepare(A)
    assert (got.stats.pool_hit_plans, got.stats.built_plans) == (2, 0)
    assert_equal_to_resident(got, resident(tiny), A)


@pytest.mark.parametrize("built_with, served_with", [("fp32", "match"), ("match", "fp32")])
def test_a_remote_plan_built_under_another_projection_is_never_served(tiny, built_with, served_with):
    """Replicas of the same checkpoint on one node share the pool; one with another `adaln.projection` builds
    other bits (fp32 GEMM then cast vs the model dtype's GEMM: equal on this CPU, not on a GPU). Its plans are
    other plans: a miss, rebuilt, never restored."""
    remote = DictRemote()
    builder = online_cache(tiny, projection=built_with)
    builder.remote = remote
    builder.prepare(A).release()
    builder.close()
    assert len(remote.plans) == 2
    other = online_cache(tiny, projection=served_with)   # the same checkpoint, another projection
    other.remote = remote
    got = other.prepare(A)
    assert (got.stats.pool_hit_plans, got.stats.built_plans) == (0, 2)
    assert_equal_to_resident(got, resident(tiny, served_with), A)
    same = online_cache(tiny, projection=built_with)     # the builder's setting still hits
    same.remote = remote
    assert same.prepare(A).stats.pool_hit_plans == 2


def test_a_slow_remote_publish_never_holds_up_the_request(tiny):
    """The built plans reach the remote tier from the publish thread: `prepare` returns while `publish` is
    still blocked, and the published rows are the slab's (copied before `release` lets the rows go)."""
    entered, proceed = threading.Event(), threading.Event()

    class SlowRemote:
        def __init__(self):
            self.plans: dict = {}

        def lookup(self, keys):
            return {}

        def publish_group(self, plans, ready):
            entered.set()
            assert proceed.wait(60), "the test never let the publish finish"
            ready.synchronize()
            self.plans.update(plans)

    remote = SlowRemote()
    cache = online_cache(tiny)
    cache.remote = remote
    prepared = cache.prepare(A)           # would wait forever if the publish ran on the request path
    assert prepared.stats.pool_published_plans == 2 and remote.plans == {}
    assert entered.wait(60)               # the publish is running, blocked, while the request proceeds
    want = {k: (cache.slab.blocks[:, r].clone(), cache.slab.final[r].clone())
            for k, r in ((plan_key(p, cache.weights_version), prepared.step_rows(i)) for i, p in enumerate(A))}
    proceed.set()
    prepared.release()
    cache.close()                         # waits for the publish thread
    assert set(remote.plans) == set(want)
    for key, (blocks, final) in want.items():
        assert torch.equal(remote.plans[key].blocks, blocks) and torch.equal(remote.plans[key].final, final)


class QueuedRemote:
    """A remote tier that sends from its own thread, later (as `PoolClient` does): `publish_group` only queues,
    `send()` waits for each group's copies (`ready`) and keeps what they wrote."""

    def __init__(self):
        self.plans: dict = {}
        self.queued: list = []

    def lookup(self, keys):
        return {}

    def publish_group(self, plans, ready):
        self.queued.append((plans, ready))

    def send(self):
        for plans, ready in self.queued:
            ready.synchronize()
            self.plans.update({k: PlanRows(rows.blocks.clone(), rows.final.clone()) for k, rows in plans.items()})
        self.queued.clear()


@pytest.mark.parametrize("stage", ["_store", "_index"])
def test_a_request_failing_after_its_rebuild_never_publishes_rows_a_later_rebuild_overwrote(tiny, stage, monkeypatch):
    """A prepare that fails after its rebuild was offered to the remote tier (the D2H copies on the publish
    stream still queued) frees its slots; a later request rebuilds into them. The remote must still get A's rows:
    later slab writes wait for the publish copies, as after `release()`."""
    cache = online_cache(tiny, gpu=FakeDevice(), gpu_plans=2)  # the publish stream's copies wait for a fence
    remote = QueuedRemote()
    cache.remote = remote

    def fail(*args):
        raise RuntimeError("CUDA out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(cache, stage, fail)
        with pytest.raises(RuntimeError, match="out of memory"):
            cache.prepare(A)
    assert all(cache.slab.index.refcount(slot) == 0 for slot in range(2))
    cache.prepare(B).release()            # rebuilt into the two slots A's failed request gave back
    cache._publisher.drain()
    remote.send()
    reference = resident(tiny)
    for p in A:
        want = reference.prepare([p]).modulation(0)
        got = remote.plans[plan_key(p, cache.weights_version)]
        assert_same_modulation(got, want, f"published plan {p.tolist()}")
    cache.close()


def test_warm_up_sets_up_the_rebuild_so_the_first_miss_allocates_nothing(tiny):
    cache = online_cache(tiny)
    assert cache.rebuilder.num_staging_allocations == 0
    cache.warm_up()
    units = cache._resolved_units()
    assert cache.rebuilder.num_staging_allocations == 1
    assert cache.rebuilder.staging_nbytes >= cache.rebuilder.num_buffers * max(u.staging_bytes for u in units)
    assert len(cache.rebuilder._pool._threads) == cache.rebuilder.readers  # every reader started
    # Scratch rows only: the slab holds nothing and the tiers are untouched.
    assert cache.slab.index.num_free == cache.slab.index.capacity and cache.host.num_free_pages == cache.host.num_pages
    first = cache.prepare(A)
    assert first.stats.built_plans == 2 and cache.rebuilder.num_staging_allocations == 1
    assert_equal_to_resident(first, resident(tiny), A)
    first.release()


def test_rebuild_stats_split_bytes_into_page_cache_and_disk(tiny):
    for name in tiny.reader.names():      # read every shard once: all of it is in the page cache
        path = tiny.reader.location(name).path
        Path(path).read_bytes()
    prepared = online_cache(tiny).prepare(A)
    stats = prepared.stats
    assert stats.rebuild_bytes_read == TINY_ADALN_BYTES
    assert (stats.page_cache_bytes, stats.disk_bytes) == (TINY_ADALN_BYTES, 0)
    prepared.release()


def test_walk_fences_host_restores_before_the_forward(tiny):
    log: list[str] = []
    cache = online_cache(tiny, gpu_plans=2, host_cache_gb=host_gb(8), gpu=FakeDevice(log=log))
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


# ---------------------------------------------------------------------------------------------------------
# Weight updates
# ---------------------------------------------------------------------------------------------------------


def write_misshaped_adaln(root: Path, name: str) -> None:
    """Rewrite the shard holding diffusers tensor `name` so that it has one column too few."""
    weights = open_weights(root)
    stored, path = weights.source(name).name, weights.location(name).path
    tensors = load_file(path)
    tensors[stored] = tensors[stored][:, :-1].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def drop_from_index(root: Path, name: str) -> None:
    """Rename diffusers tensor `name`'s stored tensor in the transformer's index (its shard still holds it)."""
    weights = open_weights(root)
    stored = weights.source(name).name
    index_path = next(H3Checkpoint.open(root).transformer_dir.glob("*.index.json"))
    index = json.loads(index_path.read_text())
    index["weight_map"][stored + ".zzz"] = index["weight_map"].pop(stored)
    index_path.write_text(json.dumps(index))


def test_weights_version_of_the_caller_must_match(tiny):
    cache = online_cache(tiny)
    cache.prepare(A, weights_version=cache.weights_version).release()
    with pytest.raises(WeightUpdateError, match="refresh_weight_derived_caches"):
        cache.prepare(A, weights_version=("other", 0))


def test_weight_update_sources_are_validated_before_anything_changes(served, tmp_path):
    layout = served.reader.layout
    cache = online_cache(served, gpu_plans=5, host_cache_gb=host_gb(4))
    cache.prepare(A).release()
    version, reader = cache.weights_version, cache.reader
    with pytest.raises(WeightUpdateError, match="without a source path"):
        cache.validate_weight_update_source(None)
    with pytest.raises(WeightUpdateError, match="without a source path"):
        cache.refresh_weight_derived_caches(None)
    # Wrong shape: one AdaLN weight a column short (either layout stores AdaLN tensors verbatim).
    misshaped = make_tiny_checkpoint(tmp_path / "misshaped", layout, seed=1, components=False)
    write_misshaped_adaln(misshaped, "transformer_blocks.2.adaln_proj.linear.weight")
    with pytest.raises(WeightUpdateError, match=r"transformer_blocks\.2\.adaln_proj\.linear\.weight in .* is "
                                                r"torch.bfloat16 \[1152, 31\], expected torch.bfloat16 \[1152, 32\]"):
        cache.validate_weight_update_source(misshaped)
    with pytest.raises(WeightUpdateError, match="rejected weight update"):
        cache.refresh_weight_derived_caches(misshaped)
    # Missing tensor: the final layer's bias is not in the index.
    broken = Path(shutil.copytree(served.path, tmp_path / "broken"))
    drop_from_index(broken, "norm_out.linear.bias")
    stored = "norm_out.linear.bias" if layout is Layout.DIFFUSERS else "final_layer.adaln_proj.linear.bias"
    with pytest.raises(WeightUpdateError, match=rf"no usable tensor 'norm_out\.linear\.bias'.*{re.escape(stored)}"):
        cache.validate_weight_update_source(broken)
    # Not a checkpoint at all.
    with pytest.raises(WeightUpdateError, match="is not a MiniMax-H3 checkpoint"):
        cache.validate_weight_update_source(tmp_path)
    cache.validate_weight_update_source(served.path)
    # Nothing changed: same version and reader, every plan still in the slab and in the host tier.
    assert (cache.weights_version, cache.reader) == (version, reader)
    again = cache.prepare(A)
    assert (again.stats.gpu_hit_plans, again.stats.built_plans) == (2, 0)
    again.release()
    keys = [plan_key(p, version) for p in A]
    assert cache.host.lookup(keys) == keys
    # Resident mode reads weights from the model: tensor updates are fine, bad directories are not.
    resident(served).validate_weight_update_source(None)
    with pytest.raises(WeightUpdateError, match=r"\[1152, 31\]"):
        resident(served).validate_weight_update_source(misshaped)


def test_a_ref2va_partition_is_not_an_update_source_of_the_served_fl2va_transformer(tiny, tmp_path):
    native = make_tiny_checkpoint(tmp_path / "native", Layout.NATIVE, seed=1, components=False)
    ref = Path(shutil.copytree(native / "FL2VA", tmp_path / "Ref2VA"))  # same shapes, another task's weights
    (ref / "model_index.json").write_text(json.dumps({"_minimax_h3": {"partition": "ref2va", "tasks": ["ref2va"]}}))
    with pytest.raises(WeightUpdateError, match="is the Ref2VA partition, not the FL2VA one"):
        online_cache(tiny).validate_weight_update_source(ref)


@pytest.mark.parametrize("layout", list(Layout))
def test_refresh_rebuilds_from_the_new_checkpoint_and_old_plans_are_never_served(layout, tmp_path):
    serving = make_models(tmp_path / "serving", layout)  # a private copy: the update writes into it
    cache = online_cache(serving, host_cache_gb=host_gb(8))
    in_flight = cache.prepare(A)          # slots 0, 1 feed a request mid-denoise
    old_version = cache.weights_version
    new_root = make_tiny_checkpoint(tmp_path / "seed1", layout, seed=1, components=False)
    new_weights = open_weights(new_root)
    cache.validate_weight_update_source(new_root)
    with torch.no_grad():                 # the engine's weight write: every weight the online transformer holds
        for name, param in serving.online.named_parameters():
            param.copy_(new_weights.tensor(name))
    cache.refresh_weight_derived_caches(new_root)
    assert cache.weights_version != old_version and cache.reader.transformer_dir == new_weights.transformer_dir
    fresh = cache.prepare(A)
    assert (fresh.stats.gpu_hit_plans, fresh.stats.host_hit_plans, fresh.stats.built_plans) == (0, 0, 2)
    assert slots_of(cache, A) == [2, 3]   # slots 0, 1 still feed the in-flight request
    new_resident = load_transformer(new_weights, "cpu")
    for step, timesteps in enumerate(A):
        assert_same_modulation(fresh.modulation(step), resident_rows(new_resident, timesteps), f"step {step}")
    assert not torch.equal(resident_rows(new_resident, A[0]).final, resident_rows(serving.resident, A[0]).final)
    fresh.release()
    in_flight.release()
    assert cache.slab.index.num_free == 2  # detached slots come back on release


def test_warm_up_reserves_the_publish_staging_of_the_expected_plans_and_asks_the_pool_once(tiny):
    """With a remote tier, the warm-up has the caching host allocator hold the pinned staging one miss of the
    expected plans publishes (their exact shapes), so the first publish allocates nothing beside the request,
    and asks the remote once (its connections set up). Fake pinned memory stands in for CUDA's."""
    from device.pinned import PinnedMemory

    class RecordingPinned(PinnedMemory):
        pins_staging = True

        def __init__(self, device):
            super().__init__(device, owner="test")
            self.shapes: list = []

        def staging(self, shape, dtype):
            self.shapes.append((tuple(shape), dtype))
            return torch.empty(shape, dtype=dtype)

    class RecordingRemote:
        def __init__(self):
            self.asked: list = []
            self.published = threading.Event()

        def lookup(self, keys):
            self.asked.append(list(keys))
            return {}

        def publish_group(self, plans, ready):
            self.published.set()

    cache = online_cache(tiny)
    cache.remote = remote = RecordingRemote()
    cache._publisher._memory = memory = RecordingPinned(cache.gpu)
    cache.warm_up(A + A)                  # repeats count once: one miss publishes each distinct plan once
    assert len(remote.asked) == 1 and all(key not in dict.fromkeys(plan_key(p, cache.weights_version) for p in A)
                                          for key in remote.asked[0])
    dims, dtype = cache.model, cache.model.torch_dtype
    reserved = [(shape, dtype) for p in A for shape in ((dims.num_blocks, p.numel(), dims.adaln_width),
                                                        (p.numel(), dims.final_adaln_width))]
    assert memory.shapes == reserved
    memory.shapes.clear()
    cache.prepare(A).release()
    assert remote.published.wait(60)
    assert memory.shapes == reserved      # the first miss's publish stages exactly what was reserved
    cache.close()


def test_warm_up_reserves_at_most_a_slab_of_plans(tiny):
    """Expected plans beyond adaln.gpu_plans (a default request longer than a small slab admits) reserve a
    slab's worth and start the engine all the same."""
    from device.pinned import PinnedMemory

    class CountingPinned(PinnedMemory):
        pins_staging = True
        count = 0

        def staging(self, shape, dtype):
            self.count += 1
            return torch.empty(shape, dtype=dtype)

    cache = online_cache(tiny, gpu_plans=2)
    cache.remote = type("NoPool", (), {"lookup": lambda self, keys: {}, "publish_group": lambda self, p, r: True})()
    cache._publisher._memory = memory = CountingPinned(cache.gpu, owner="test")
    cache.warm_up(A + B + C)              # 6 distinct plans, a slab of 2
    assert memory.count == 2 * 2          # blocks and final of 2 plans
    cache.close()
