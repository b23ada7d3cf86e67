"""Injected faults at the engine level (plain torch, CPU): broken checkpoint shards at start and at rebuild
time, a refused pinned allocation, a weight update during traffic, slab overflow under concurrency.

Every fault must surface as a typed error with a message naming what broke, leave no half-built AdaLN plan
behind, and leave the engine serving the same bits as before once the cause is gone.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from cache.plan_cache import AdmissionError, SlabFullError
from cache.rebuild import RebuildError
from device.streams import FakeDevice
from engine.api import GenerationRequest
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import AdmissionRejected, FaultCause, ServerFault
from model.layout import CheckpointError, H3Checkpoint
from model.tiny import make_tiny_checkpoint
from model.weights import TensorLocation, TransformerWeights
from tests.adaln_support import assert_equal_to_resident, host_gb, online_cache, resident, schedule
from tests.weights_support import finetune_of

pytestmark = pytest.mark.timeout(180)


def request(**overrides) -> GenerationRequest:
    """64x64 px, 5 s: 148 video tokens + 414 audio rows; `steps - 1` forwards, one AdaLN plan each."""
    fields = dict(prompt="a red fox", steps=3, seconds=5.0, width=64, height=64, seed=11, return_video=False)
    return GenerationRequest(**{**fields, **overrides})


def online_engine(checkpoint: Path, **adaln) -> Engine:
    settings = {"mode": "online", "host_cache_gb": 0.0, "readers": 2, **adaln}
    return Engine(EngineConfig(checkpoint=str(checkpoint), device="cpu", adaln=settings))


def resident_engine(checkpoint: Path) -> Engine:
    return Engine(EngineConfig(checkpoint=str(checkpoint), device="cpu", adaln={"mode": "resident"}))


def same_bits(a, b) -> bool:
    return torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio)


def tensor_location(checkpoint: Path, name: str) -> TensorLocation:
    """Where the transformer tensor `name` (diffusers name) lies in the checkpoint at `checkpoint`."""
    h3 = H3Checkpoint.open(checkpoint)
    return TransformerWeights(h3.transformer_dir, h3.layout).location(name)


#: Block 1's AdaLN projection: read only by a plan rebuild in online mode. Its shard also holds block 1's
#: other weights, which every engine reads at start.
BLOCK1_ADALN = "transformer_blocks.1.adaln_proj.linear.weight"


def assert_no_plan_held_or_half_built(engine: Engine) -> None:
    index = engine.plan_cache.slab.index
    index.check()
    assert all(index.refcount(slot) == 0 for slot in range(index.capacity))
    assert index.num_used == 0  # nothing was committed: a failed build is never visible


# --- checkpoint shards ---------------------------------------------------------------------------


def missing(location: TensorLocation) -> None:
    location.path.unlink()


def truncated(location: TensorLocation) -> None:
    """Cut the shard in the middle of the tensor's bytes."""
    data = location.path.read_bytes()
    location.path.write_bytes(data[: location.offset + location.nbytes // 2])


def header_garbage(location: TensorLocation) -> None:
    data = location.path.read_bytes()
    location.path.write_bytes(b"\xff" * 64 + data[64:])


@pytest.mark.parametrize("breakage", [missing, truncated, header_garbage])
def test_broken_shard_at_start_is_a_checkpoint_error_naming_the_file(tiny_checkpoint, breakage):
    location = tensor_location(tiny_checkpoint, BLOCK1_ADALN)
    breakage(location)
    for mode in ("online", "resident"):
        with pytest.raises(CheckpointError, match=location.path.name):
            Engine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", adaln={"mode": mode}))


@pytest.mark.parametrize("breakage", [missing, truncated])
def test_broken_shard_at_rebuild_is_a_typed_error_then_a_retry_succeeds(tiny_checkpoint, breakage):
    engine = online_engine(tiny_checkpoint)
    before = engine.generate(request())
    engine.plan_cache.invalidate()  # the plans must now be rebuilt from disk
    location = tensor_location(tiny_checkpoint, BLOCK1_ADALN)
    saved = location.path.read_bytes()
    breakage(location)
    with pytest.raises(ServerFault, match=location.path.name) as info:
        engine.generate(request())
    # The engine's boundary: a server fault naming the lower layer's type, which stays chained.
    assert info.value.cause is FaultCause.CHECKPOINT_UNREADABLE and isinstance(info.value.__cause__, RebuildError)
    assert_no_plan_held_or_half_built(engine)
    assert engine.health()["failed"] == 1

    location.path.write_bytes(saved)  # the file is back
    after = engine.generate(request())
    assert same_bits(after, before) and after.stats.adaln.built_plans == 2  # steps=3: 2 forwards
    assert engine.health()["requests"] == 2


# --- pinned memory refused -----------------------------------------------------------------------


def test_refused_pinned_allocation_degrades_to_pageable_and_stays_bit_exact(tiny):
    a, b = schedule(0.9, 2), schedule(0.5, 2)
    # A host that cannot lock a single page: the host tier's 16 pinned pages are refused, then 8, then it
    # settles for 8 pageable ones (half of it still holds both groups); rebuild staging goes pageable too.
    gpu = FakeDevice(lockable_bytes=0)
    cache = online_cache(tiny, gpu_plans=2, host_cache_gb=host_gb(16), gpu=gpu)
    assert not cache.host.pinned and cache.host.enabled and cache.host.num_pages == 8 and gpu.locked_bytes == 0
    reference = resident(tiny)
    for plans in (a, b, a, b):  # the slab holds one schedule: every repeat restores from the (pageable) tier
        prepared = cache.prepare(plans)
        assert_equal_to_resident(prepared, reference, plans)
        prepared.release()
    assert cache.stats.built_plans == 4 and cache.stats.host_hit_plans == 4


# --- weight update during traffic ----------------------------------------------------------------


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """The seed-0 tiny checkpoint and a fine-tune of it (the seed-1 transformer with the same text encoder
    and VAEs: a weight update loads the transformer only)."""
    root = tmp_path_factory.mktemp("weights")
    old = make_tiny_checkpoint(root / "seed0", "diffusers", seed=0)
    return old, finetune_of(old, root / "finetune")


@pytest.mark.slow  # concurrent traffic over several engines: over ~5 s
@pytest.mark.parametrize("mode", ["online", "resident"])
def test_weight_update_during_traffic_gives_all_old_or_all_new_never_a_mix(two_checkpoints, mode):
    old_ckpt, new_ckpt = two_checkpoints
    requests = [request(seed=s, steps=2 + s % 2) for s in range(4)]
    make = (lambda c: online_engine(c)) if mode == "online" else resident_engine
    # The engine under test answers the old references itself: its caches then hold old plans, which each
    # update must drop (a stale plan would show as a mix).
    engine = make(old_ckpt)
    old_ref = {r.seed: engine.generate(r) for r in requests}
    new_engine = make(new_ckpt)
    new_ref = {r.seed: new_engine.generate(r) for r in requests}
    del new_engine
    results, errors = [], []
    stop = threading.Event()

    def traffic(r: GenerationRequest) -> None:
        while not stop.is_set():
            try:
                results.append((r.seed, engine.generate(r)))
            except Exception as exc:  # noqa: BLE001 - any error is a failure of the test
                errors.append(exc)

    threads = [threading.Thread(target=traffic, args=(r,)) for r in requests]
    for t in threads:
        t.start()
    try:
        for path in (new_ckpt, old_ckpt, new_ckpt):  # three updates while four clients keep generating
            while len(results) < 4:
                threading.Event().wait(0.01)
            results_before = len(results)
            engine.update_weights(path)
            while len(results) < results_before + 4:
                threading.Event().wait(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors
    num_old = num_new = 0
    for seed, result in results:
        if result.model == old_ref[seed].model:
            assert same_bits(result, old_ref[seed]), f"seed {seed}: labelled old weights, bits are not all-old"
            num_old += 1
        else:
            assert result.model == new_ref[seed].model
            assert same_bits(result, new_ref[seed]), f"seed {seed}: labelled new weights, bits are not all-new"
            num_new += 1
    assert num_old > 0 and num_new > 0
    assert same_bits(engine.generate(requests[0]), new_ref[0])  # the last update won


# --- slab overflow under concurrency -------------------------------------------------------------


@pytest.mark.slow  # concurrent traffic over several engines: over ~5 s
def test_concurrent_distinct_schedules_on_a_small_slab_are_exact_or_refused(tiny_checkpoint):
    engine = online_engine(tiny_checkpoint, gpu_plans=4, host_cache_gb=0.001)
    reference = resident_engine(tiny_checkpoint)
    # Distinct schedules (steps x shift); steps 6 needs 5 plans (one per forward) > gpu_plans=4: refused.
    requests = [request(steps=steps, flow_shift=shift, seed=steps * 10 + i)
                for i, shift in enumerate((1.0, 3.0, 5.0)) for steps in (2, 3, 5, 6)]
    expected = {r: reference.generate(r) for r in requests if r.steps <= 5}

    def run(r: GenerationRequest):
        try:
            return engine.generate(r)
        except (AdmissionRejected, SlabFullError) as exc:
            return exc

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(run, requests * 2))
    for r, outcome in zip(requests * 2, outcomes):
        if r.steps > 5:
            assert isinstance(outcome, AdmissionRejected) and "adaln.gpu_plans=4" in str(outcome)
            assert isinstance(outcome.__cause__, AdmissionError)
        else:
            assert not isinstance(outcome, Exception), outcome
            assert same_bits(outcome, expected[r]), f"steps={r.steps} flow_shift={r.flow_shift}: wrong bits"
    index = engine.plan_cache.slab.index
    index.check()
    assert all(index.refcount(slot) == 0 for slot in range(index.capacity))
    assert engine.plan_cache.stats.gpu_evicted_plans > 0  # the slab really overflowed and recycled slots


def test_slab_full_while_plans_are_held_is_typed_and_leaves_held_plans_intact(tiny):
    cache = online_cache(tiny, gpu_plans=4)
    reference = resident(tiny)
    a, b, c = schedule(0.9, 2), schedule(0.5, 2), schedule(0.3, 1)
    held_a, held_b = cache.prepare(a), cache.prepare(b)  # two in-flight requests fill the slab
    with pytest.raises(SlabFullError, match="adaln.gpu_plans=4"):
        cache.prepare(c)
    index = cache.slab.index
    index.check()
    assert index.num_used == 4 and sorted(index.refcount(s) for s in range(4)) == [1, 1, 1, 1]
    assert_equal_to_resident(held_a, reference, a)  # untouched by the refused request
    assert_equal_to_resident(held_b, reference, b)
    held_a.release()
    retry = cache.prepare(c)  # a finished request frees room
    assert_equal_to_resident(retry, reference, c)
    retry.release()
    held_b.release()
    index.check()
    assert all(index.refcount(s) == 0 for s in range(4))
