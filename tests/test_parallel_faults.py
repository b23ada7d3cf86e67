"""Faults of a multi-device replica as traffic meets them (actors.gpu_worker.ParallelEngine, sp=2 gloo ranks on CPU,
a local Ray cluster, the tiny checkpoint): a rank that dies (os._exit inside it) or stalls (SIGSTOP) at each phase
of a request, a request queued behind the one that breaks, and a cancel that lands while rank 0 alone decodes.

Every failure must come back as a ServerFault naming the rank and what happened (died / did not answer within a
bound) within the configured bounds, the replica must then refuse work at once and report unhealthy, and nothing
the caller did right (a cancel, a bad request) may break it.

The ranks are real `GpuWorkerActor`s with one addition (`FaultyRank.arm`): a fault to trip at a named point of the
next request on that rank. A fault that breaks a replica gets one of its own (~15 core-seconds each), except the
last test, which breaks the replica the tests that must leave it serving share (`serving`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

import actors.gpu_worker as gpu_worker
from actors.gpu_worker import GpuWorkerActor, OwnPlacementGroup, ParallelEngine
from engine.api import GenerationRequest
from engine.config import EngineConfig
from engine.errors import ClientError, FaultCause, GenerationCancelled, ServerFault
from model.layout import H3Checkpoint
from model.tiny import make_tiny_checkpoint
from model.weights import TransformerWeights
from tests.serve_helpers import shared_ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.ray]  # slow: Ray: SP2 rank actors stalled and killed

TIMEOUT_S = 10.0  # collectives and coordinator calls (a stalled rank is found within it)
LOAD_TIMEOUT_S = 120.0
GRACE_S = 2.0  # the coordinator's grace after one rank failed (FAILURE_GRACE_S, shortened here)


class FaultyRank(GpuWorkerActor):
    """A real rank that can be told to die (`os._exit`) or stall (SIGSTOP itself) at one point of its next
    request: `"encode"` (the prompt encode), `"prepare"` (the AdaLN plans), `"forward:<n>"` (after n forwards),
    `"update"` (a weight update); or to have its caller cancel after its last forward (`"cancel-after-loop"`)."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self._armed: tuple[str, str] | None = None

    def arm(self, fault: str, at: str) -> None:
        self._armed = (fault, at)
        engine = self.engine
        for point, owner, name in (("encode", engine.prompt_stage, "encode"),
                                   ("prepare", engine.plan_cache, "prepare"),
                                   ("update", engine, "update_weights")):
            if at == point:
                original = getattr(owner, name)

                def tripped(*args, _original=original):
                    self._trip()
                    return _original(*args)

                setattr(owner, name, tripped)

    def _trip(self) -> None:
        fault, _ = self._armed
        if fault == "exit":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGSTOP)

    def generate(self, request_id: int, request: GenerationRequest):
        at = self._armed[1] if self._armed is not None else ""

        def progress(done: int, total: int) -> None:
            self._progress = (request_id, done, total)
            if at == f"forward:{done}":
                self._trip()
            if at == "cancel-after-loop" and done == total:  # past the last step boundary's cancel check
                self.cancel(request_id)

        def cancelled() -> bool:
            return request_id <= self._cancelled_through

        return self.answer(self.engine.generate(request, progress, cancelled))

    def pid(self) -> int:
        return os.getpid()


def request(**overrides) -> GenerationRequest:
    fields = dict(prompt="a red fox", steps=9, seconds=0.5, width=64, height=64, seed=11, return_video=False)
    return GenerationRequest(**{**fields, **overrides})


def engine_config(checkpoint: Path, **overrides) -> EngineConfig:
    fields = dict(
        checkpoint=str(checkpoint), device="cpu", max_steps=40, geometry={"short_edge": None, "min_seconds": 0.1},
        adaln={"gpu_plans": 32, "host_cache_gb": 0.01}, offload={"enabled": False}, cache_dit={"enabled": False},
        pool={"enabled": False},
        parallel={"sp": 2, "timeout_s": TIMEOUT_S, "load_timeout_s": LOAD_TIMEOUT_S, "text_encoder_tp": True},
    )
    return EngineConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("h3") / "tiny", "diffusers", seed=0)


@pytest.fixture(scope="module")
def ray_cluster():
    with shared_ray():  # the session's cluster (tests/serve_helpers.py), emptied after the module
        yield


@pytest.fixture
def faulty(monkeypatch):
    monkeypatch.setattr(gpu_worker, "GpuWorkerActor", FaultyRank)
    monkeypatch.setattr(gpu_worker, "FAILURE_GRACE_S", GRACE_S)


@pytest.fixture(scope="module")
def serving(ray_cluster, checkpoint) -> Iterator[ParallelEngine]:
    """One replica of faulty ranks for the tests that must leave it serving (each checks it still does): a
    replica start (two rank actors, their engines) is ~15 core-seconds. Online AdaLN without a host tier, so a
    schedule the replica has not run rebuilds its plans from the checkpoint."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpu_worker, "GpuWorkerActor", FaultyRank)
        patch.setattr(gpu_worker, "FAILURE_GRACE_S", GRACE_S)
        with replica(checkpoint, adaln={"mode": "online", "gpu_plans": 32, "host_cache_gb": 0.0}) as engine:
            yield engine


@contextlib.contextmanager
def replica(checkpoint: Path, **overrides) -> Iterator[ParallelEngine]:
    engine = ParallelEngine(engine_config(checkpoint, **overrides), OwnPlacementGroup())
    try:
        yield engine
    finally:
        engine.close()


def arm(engine: ParallelEngine, rank: int, fault: str, at: str) -> None:
    ray.get(engine.ranks[rank].arm.remote(fault, at), timeout=TIMEOUT_S)


def assert_unusable(engine: ParallelEngine, cause: str) -> None:
    """Later calls fail at once with the first cause; health() reports it (Serve replaces the replica)."""
    with pytest.raises(ServerFault, match=f"parallel replica unusable: .*{cause}"):
        engine.health()
    with pytest.raises(ServerFault, match=f"parallel replica unusable: .*{cause}"):
        engine.generate(request())


# --- a rank that dies or stalls -----------------------------------------------------------------------------


@pytest.mark.parametrize("at", ["encode", "prepare"])  # mid-denoise: the queued-request test below
def test_a_rank_that_dies_fails_the_request_naming_it(ray_cluster, checkpoint, faulty, at):
    with replica(checkpoint, adaln={"mode": "online", "gpu_plans": 32, "host_cache_gb": 0.01}) as engine:
        arm(engine, 1, "exit", at)
        with pytest.raises(ServerFault, match="generate: rank 1 of 2 died") as failed:
            engine.generate(request())
        assert failed.value.cause is FaultCause.RANK_FAILURE
        assert_unusable(engine, "rank 1 of 2 died")


def test_a_rank_that_stalls_mid_denoise_fails_the_request_within_the_timeout(ray_cluster, checkpoint, faulty):
    """Its peer's next collective fails after timeout_s; the stalled rank itself never answers and is given up
    on timeout_s (+ the grace) later. (Stalls in the encode and the plan preparation were probed alike.)"""
    with replica(checkpoint) as engine:
        arm(engine, 1, "stop", "forward:3")
        with pytest.raises(ServerFault, match=r"rank 1 of 2 did not finish within timeout_s=10 \(\+2 s\) of another "
                                              r"rank failing") as failed:
            engine.generate(request())
        assert failed.value.cause is FaultCause.RANK_FAILURE
        assert_unusable(engine, "rank 1 of 2 did not finish")


def test_a_rank_stalled_between_requests_turns_health_unhealthy(ray_cluster, checkpoint, faulty):
    with replica(checkpoint) as engine:
        assert engine.health()["status"] == "ok"  # sends the first probe, answered
        time.sleep(1.0)
        os.kill(ray.get(engine.ranks[1].pid.remote(), timeout=TIMEOUT_S), signal.SIGSTOP)
        # health() never waits: a probe unanswered for timeout_s turns it unhealthy
        with pytest.raises(ServerFault, match=r"rank\(s\) \[1\] did not answer a health check within timeout_s=10"):
            for _ in range(600):
                engine.health()
                time.sleep(0.1)
        assert_unusable(engine, "did not answer a health check")


def test_a_rank_that_dies_mid_denoise_fails_the_request_and_the_one_queued_behind_it_at_once(
        ray_cluster, checkpoint, faulty):
    with replica(checkpoint) as engine:
        arm(engine, 1, "exit", "forward:20")
        running = threading.Event()
        outcomes: dict[str, BaseException | None] = {}

        def generate(name: str, request: GenerationRequest) -> None:
            try:
                engine.generate(request, lambda done, total: running.set())
                outcomes[name] = None
            except BaseException as exc:  # noqa: BLE001 - the test's subject
                outcomes[name] = exc

        first = threading.Thread(target=generate, args=("running", request(steps=30)))
        first.start()
        assert running.wait(timeout=60)
        queued = threading.Thread(target=generate, args=("queued", request(seed=12)))
        queued.start()
        first.join(timeout=120)
        queued.join(timeout=60)
        assert set(outcomes) == {"running", "queued"}
        assert all(isinstance(error, ServerFault) and "generate: rank 1 of 2 died" in str(error)
                   for error in outcomes.values())
        assert outcomes["running"].cause is FaultCause.RANK_FAILURE
        assert_unusable(engine, "rank 1 of 2 died")


# --- what leaves the replica serving: a share that fails to rebuild, a cancel, a bad request -------------------


def test_a_share_of_a_plan_rebuild_that_fails_on_one_rank_fails_the_request_and_keeps_the_group(serving, checkpoint):
    """Each rank reads only its AdaLN units (tiny: 4 blocks, rank 1 owns blocks 2, 3 and the final layer), so a
    shard cut short in block 3's projection fails rank 1's share alone; rank 0's went well. Both must leave the
    rebuild together (a rank leaving alone pairs its next collective with its peer's exchange, and gloo aborts
    the process), fail the request with the cause, and serve once the file is back. (A schedule no other test
    runs: 7 steps, 6 plans to build.)"""
    h3 = H3Checkpoint.open(checkpoint)
    weights = TransformerWeights(h3.transformer_dir, h3.layout)
    location = weights.location("transformer_blocks.3.adaln_proj.linear.weight")
    saved = location.path.read_bytes()
    try:
        location.path.write_bytes(saved[: location.offset + location.nbytes // 2])
        with pytest.raises(ServerFault, match=r"rank\(s\) \[1\] could not rebuild their share") as failed:
            serving.generate(request(steps=7))
        assert failed.value.cause is FaultCause.CHECKPOINT_UNREADABLE
        assert serving.health()["status"] == "ok"
    finally:
        location.path.write_bytes(saved)
    result = serving.generate(request(steps=7))
    assert result.stats.parallel.ranks_agree and result.stats.adaln.built_plans == 6
    assert [ranks["held_plan_refs"] for ranks in serving.debug_stats()["ranks"]] == [0, 0]


def test_a_cancel_while_rank_0_decodes_cancels_and_the_replica_serves_on(serving):
    arm(serving, 0, "cancel", "cancel-after-loop")
    try:
        with pytest.raises(GenerationCancelled):
            serving.generate(request(return_video=True))
    finally:
        arm(serving, 0, "none", "")  # disarmed: no point is named "" (the replica is shared)
    assert serving.health()["status"] == "ok"
    assert serving.generate(request(return_video=True)).stats.parallel.ranks_agree


def test_a_bad_request_leaves_the_replica_serving(serving):
    for bad in (request(width=65), request(prompt="x " * 5000), request(guidance_scale=2.0)):
        with pytest.raises(ClientError):
            serving.generate(bad)
    assert serving.health()["status"] == "ok"
    assert serving.generate(request()).stats.parallel.ranks_agree


# --- last on the serving replica: a rank that dies in a weight update breaks it ------------------------------


def test_a_rank_that_dies_in_a_weight_update(serving, checkpoint):
    arm(serving, 1, "exit", "update")
    with pytest.raises(ServerFault, match="rank 1 of 2 died"):
        serving.update_weights(str(checkpoint))
    assert_unusable(serving, "rank 1 of 2 died")
