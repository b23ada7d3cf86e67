"""A multi-device replica (actors.gpu_worker.ParallelEngine, sp=2: two rank actors on gloo, a local Ray cluster)
against the one-device engine (engine.engine.Engine, in this process) on the tiny seed-0 checkpoint, on CPU.

Both engines run the shipped features together: online AdaLN (plan cache, rebuilt 1/2 per rank), layerwise
offload and Cache-DiT. Bit-exact is the promise on CPU (parallel/ established it for the forward, the denoising
loop and the AdaLN exchange: sharding never changes the order of a reduction), so latents are compared with
`torch.equal`. The module's replica also takes a weight update and, last, a rank killed between requests;
ranks that diverge get a replica of their own; a rank that dies or stalls inside a request:
tests/test_parallel_faults.py.

The request is the tiny model's smallest useful one: 64x64 px for 0.5 s, i.e. 13 frames snapped up to 22 ->
7 latent frames of 2x2 patches (28 video rows) + 2 x 37 audio rows + the prompt's text rows, about 105 packed
rows: 53 per rank.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.gpu_worker import OwnPlacementGroup, ParallelEngine, ReplicaBundles, replica_bundles
from engine.api import GenerationRequest
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ClientError, FaultCause, GenerationCancelled, ServerFault, WeightsRejected
from model.layout import CheckpointError
from model.tiny import make_tiny_checkpoint
from parallel.config_check import check_parallel_config
from parallel.sequence import SequenceParallelError
from tests.serve_helpers import shared_ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.ray]  # slow: Ray: SP2 rank actors (gloo)

FPS = 24
NUM_FRAMES = 22  # 0.5 s -> round(0.5 * 24) + 1 = 13 frames, snapped up to 17 n + 5
FORWARDS = 8  # steps=9 sampling points
MAX_STEPS = 40
# Cache-DiT on the request below (8 forwards), seed-0 checkpoint: Fn=1, Bn=1, one warmup forward, at most two
# cached forwards in a row; forwards 1, 2 and 4 stay under the 0.15 residual threshold (the one-device engine's
# choice, asserted below).
CACHE_DIT = {"enabled": True, "Fn_compute_blocks": 1, "Bn_compute_blocks": 1, "max_warmup_steps": 1,
             "residual_diff_threshold": 0.15, "max_continuous_cached_steps": 2}
CACHED_STEPS = [1, 2, 4]
#: Bytes of one block's adaln_proj.linear (weight [1152, 32] + bias [1152], bf16) and of norm_out.linear
#: ([128, 32] + [128]) in the tiny checkpoint: what a rebuild streams per unit.
BLOCK_UNIT_BYTES = (1152 * 32 + 1152) * 2
FINAL_UNIT_BYTES = (128 * 32 + 128) * 2
GPU_PLANS = 32  # a 30-step request (29 plans) fits; a 9-step one after it must evict some of those
TIMEOUT_S = 20.0  # collectives and coordinator calls
LOAD_TIMEOUT_S = 120.0  # placing and starting the ranks


def request(**overrides) -> GenerationRequest:
    fields = dict(prompt="a red fox", steps=9, seconds=0.5, width=64, height=64, seed=11, return_video=False)
    return GenerationRequest(**{**fields, **overrides})


def engine_config(checkpoint: Path, sp: int, **overrides) -> EngineConfig:
    fields = dict(
        checkpoint=str(checkpoint), device="cpu", max_steps=MAX_STEPS,
        geometry={"short_edge": None, "min_seconds": 0.1},
        adaln={"gpu_plans": GPU_PLANS, "host_cache_gb": 0.01}, offload={"enabled": True}, cache_dit=CACHE_DIT,
        pool={"enabled": False},
        # the whole text encoder on every rank: the same embedding bits as one device (a tensor parallel encoder
        # rounds differently; tests/test_parallel_text_encoder.py and test_parallel_offload.py cover it)
        parallel={"sp": sp, "timeout_s": TIMEOUT_S, "load_timeout_s": LOAD_TIMEOUT_S, "text_encoder_tp": False},
    )
    return EngineConfig(**{**fields, **overrides})


def assert_same_latents(got, want) -> None:
    assert torch.equal(got.video, want.video) and torch.equal(got.audio, want.audio)


# --- engines -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("h3") / "tiny", "diffusers", seed=0)


@pytest.fixture(scope="module")
def seed1_checkpoint(tmp_path_factory) -> Path:
    """Another transformer of the same architecture (a weight update's source)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("seed1") / "tiny", "diffusers", seed=1, components=False)


@pytest.fixture(scope="module")
def ray_cluster():
    # 6 logical CPUs: the module's replica (2 ranks) beside one more (2 ranks, and a coordinator for the
    # Serve-like one)
    with shared_ray():  # the session's cluster (8 CPUs), emptied after the module
        yield


@pytest.fixture(scope="module")
def parallel(ray_cluster, checkpoint) -> ParallelEngine:
    engine = ParallelEngine(engine_config(checkpoint, sp=2), OwnPlacementGroup())
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def single(checkpoint) -> Engine:
    return Engine(engine_config(checkpoint, sp=1))


# --- the same bits as one device -------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dit", [None, {"enabled": False}], ids=["cache-dit", "no-cache-dit"])
def test_sp2_latents_equal_the_one_device_engine_bit_for_bit(parallel, single, cache_dit):
    got = parallel.generate(request(cache_dit=cache_dit))
    want = single.generate(request(cache_dit=cache_dit))
    assert_same_latents(got, want)
    assert got.stats.parallel.ranks_agree is True  # rank 1 ended with rank 0's latents too
    assert got.model == want.model


def decoded_mp4(mp4: bytes) -> tuple[list[np.ndarray], int]:
    """The MP4's RGB frames and its number of stereo audio samples; checks the streams on the way."""
    with av.open(io.BytesIO(mp4)) as container:
        (video,) = container.streams.video
        (sound,) = container.streams.audio
        assert (video.codec_context.name, video.width, video.height) == ("h264", 64, 64)
        assert (sound.codec_context.name, sound.channels) == ("aac", 2)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    with av.open(io.BytesIO(mp4)) as container:
        samples = sum(frame.samples for frame in container.decode(audio=0))
    return frames, samples


def test_sp2_mp4_is_decoded_by_rank_0_like_the_one_device_mp4(parallel, single):
    got = parallel.generate(request(return_video=True))
    want = single.generate(request(return_video=True))
    assert_same_latents(got, want)
    got_frames, got_samples = decoded_mp4(got.mp4)
    want_frames, want_samples = decoded_mp4(want.mp4)
    assert len(got_frames) == len(want_frames) == NUM_FRAMES and got_samples == want_samples
    # Same latents, but the VAEs ran in another process with another torch thread count (Ray gives a rank
    # actor 1, this process has 2), so their float sums may round differently: the MP4 bytes are not
    # promised equal (the AAC stream is not, here), the pictures are to within a level.
    for got_frame, want_frame in zip(got_frames, want_frames):
        assert np.abs(got_frame.astype(int) - want_frame.astype(int)).mean() <= 1.0


def test_unseeded_request_runs_one_seed_on_every_rank(parallel, single):
    got = parallel.generate(request(seed=None))
    assert got.stats.parallel.ranks_agree is True
    assert_same_latents(got, single.generate(request(seed=got.seed)))


# --- Cache-DiT and the plan cache decide alike on every rank ---------------------------------------------


def test_cache_dit_caches_the_same_steps_on_every_rank_as_on_one_device(parallel, single):
    got = parallel.generate(request())
    want = single.generate(request())
    assert want.stats.cache_dit.cached_steps == CACHED_STEPS
    assert got.stats.parallel.cached_steps_by_rank == [CACHED_STEPS, CACHED_STEPS]


def test_plan_caches_admit_and_evict_alike_on_every_rank(parallel):
    parallel.generate(request(steps=30))  # 29 plans
    evicting = parallel.generate(request(steps=9))  # 8 plans, 7 of them new: some of the 30-step ones go
    rank0, rank1 = evicting.stats.parallel.adaln_by_rank
    assert rank0.gpu_evicted_plans > 0
    per_rank = {"rebuild_s", "pool_lookup_s", "prepare_s",  # timings
                "rebuild_bytes_read", "page_cache_bytes", "disk_bytes"}  # each rank reads its share
    assert rank0.model_dump(exclude=per_rank) == rank1.model_dump(exclude=per_rank)
    stats = parallel.debug_stats()
    assert stats["ranks"][0] == stats["ranks"][1]
    assert stats["held_plan_refs"] == 0 and stats["resident_plans"] == GPU_PLANS


def test_a_plan_miss_reads_each_adaln_unit_once_across_the_ranks(parallel, single):
    got = parallel.generate(request(steps=4))  # a schedule no other test runs: its plans are rebuilt
    want = single.generate(request(steps=4))
    assert_same_latents(got, want)  # the exchanged rows are the ones one device projects
    # rank 0: blocks 0-1; rank 1: blocks 2-3 and the final layer; one device: all of them
    assert [ranks.rebuild_bytes_read for ranks in got.stats.parallel.adaln_by_rank] == [
        2 * BLOCK_UNIT_BYTES, 2 * BLOCK_UNIT_BYTES + FINAL_UNIT_BYTES]
    assert want.stats.adaln.rebuild_bytes_read == 4 * BLOCK_UNIT_BYTES + FINAL_UNIT_BYTES


# --- progress, cancel, client errors -------------------------------------------------------------------


def test_progress_is_reported_once_per_forward_in_order(parallel):
    calls = []
    parallel.generate(request(), lambda done, total: calls.append((done, total)))
    assert calls == [(done, FORWARDS) for done in range(1, FORWARDS + 1)]


def test_cancel_stops_every_rank_at_the_same_step_and_the_replica_serves_on(parallel, single):
    calls = []
    with pytest.raises(GenerationCancelled):
        parallel.generate(request(steps=30), lambda done, total: calls.append(done), cancelled=lambda: True)
    assert len(calls) < 29
    # A rank that ran one forward more than the other would have left it waiting in a collective: the next
    # request would fail. It runs, on both ranks, with the one-device bits.
    assert [ranks["held_plan_refs"] for ranks in parallel.debug_stats()["ranks"]] == [0, 0]
    assert_same_latents(parallel.generate(request()), single.generate(request()))


def test_a_request_over_a_limit_is_the_ranks_client_error_and_the_replica_stays_healthy(parallel):
    message = f"steps: {MAX_STEPS + 1} exceeds this server's max_steps={MAX_STEPS}"
    with pytest.raises(ClientError, match=message):
        parallel.validate(request(steps=MAX_STEPS + 1))
    with pytest.raises(ClientError, match=message):
        parallel.generate(request(steps=MAX_STEPS + 1))
    assert parallel.health()["status"] == "ok"


def test_health_and_describe(parallel, single):
    health = parallel.health()
    assert (health["status"], health["sp"]) == ("ok", 2)
    description = parallel.describe()
    assert description["parallel"] == {"sp": 2}
    assert description["id"] == single.describe()["id"]


# --- weight updates, then a rank lost: the module's replica, last (the loss breaks it) -----------------------


def test_a_weight_update_applies_on_every_rank(parallel, checkpoint, seed1_checkpoint):
    single = Engine(engine_config(checkpoint, sp=1))
    before = parallel.generate(request())
    described = parallel.update_weights(str(seed1_checkpoint))
    single.update_weights(str(seed1_checkpoint))
    fingerprint = single.weights.fingerprint
    assert described["fingerprint"] == fingerprint != before.model.removeprefix("minimax-h3@")
    assert [ranks["fingerprint"] for ranks in parallel.debug_stats()["ranks"]] == [fingerprint, fingerprint]
    after = parallel.generate(request())
    # Rank 1 computes half of every attention: had it kept the old weights, rank 0's latents would differ.
    assert_same_latents(after, single.generate(request()))
    assert not torch.equal(after.video, before.video)


def test_a_rejected_weight_update_names_the_problem_and_changes_no_rank(parallel, tmp_path):
    before = parallel.debug_stats()["ranks"]
    with pytest.raises(WeightsRejected, match="missing"):
        parallel.update_weights(str(tmp_path / "missing"))
    assert parallel.debug_stats()["ranks"] == before
    assert parallel.health()["status"] == "ok"


def test_a_rank_dying_between_requests_turns_health_unhealthy(parallel):
    """The module's last test on `parallel`: it leaves the replica unusable."""
    assert parallel.health()["status"] == "ok"  # sends the first probe
    ray.kill(parallel.ranks[1])
    # health() never waits: each call reads the previous probe's answers, which come back once Ray has
    # seen the death (or, for a rank that hangs, when timeout_s has passed).
    with pytest.raises(ServerFault, match=r"rank 1 of 2 died") as failed:
        for _ in range(600):
            parallel.health()
            time.sleep(0.05)
    assert failed.value.cause is FaultCause.RANK_FAILURE


# --- inside a Serve replica's placement group --------------------------------------------------------------


class Coordinator:
    """Stands in for the Serve worker replica: an actor in bundle 0 of a replica placement group, holding a
    ParallelEngine whose ranks go into bundles 1 and 2 (what Serve does with `placement_group_bundles`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = ParallelEngine(config, ReplicaBundles.current())

    def generate(self, request: GenerationRequest):
        return self.engine.generate(request)

    def placement_groups(self) -> list[str | None]:
        """This replica's placement group, then each rank's."""
        ranks = [ray.get(rank.placement_group_id.remote(), timeout=TIMEOUT_S) for rank in self.engine.ranks]
        return [ray.get_runtime_context().get_placement_group_id(), *ranks]


def test_a_replica_in_a_serve_placement_group_runs_its_ranks_in_its_bundles(ray_cluster, checkpoint, single):
    bundles = replica_bundles(sp=2, num_gpus_per_rank=0, replica_num_cpus=1.0)
    assert bundles == [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}]
    group = placement_group(bundles, strategy="STRICT_PACK")
    try:
        ray.get(group.ready(), timeout=LOAD_TIMEOUT_S)
        coordinator = ray.remote(Coordinator).options(num_cpus=1.0, scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)).remote(
            engine_config(checkpoint, sp=2))
        got = ray.get(coordinator.generate.remote(request()), timeout=LOAD_TIMEOUT_S)
        # bundle 0 holds the coordinator's one CPU, so the ranks run in bundles 1 and 2 of its group
        assert ray.get(coordinator.placement_groups.remote(), timeout=TIMEOUT_S) == [group.id.hex()] * 3
        assert_same_latents(got, single.generate(request()))
    finally:
        remove_placement_group(group)  # takes the coordinator and its ranks with it


# --- refused configs -------------------------------------------------------------------------------------


def test_a_degree_not_dividing_the_heads_is_refused_before_any_rank_starts(ray_cluster, checkpoint):
    with pytest.raises(SequenceParallelError, match=r"sequence parallel degree 3 does not divide the model's 2 "
                                                    r"attention heads; valid degrees: \[1, 2\]"):
        ParallelEngine(engine_config(checkpoint, sp=3), OwnPlacementGroup())


@pytest.mark.parametrize("sp, num_gpus_on_node, message", [
    (3, 8, r"degree 3 does not divide the model's 2 attention heads; valid degrees: \[1, 2\]"),
    (2, 1, "degree 2 needs 2 devices on one node; this node has 1"),
    (2, 0, None),  # CPU ranks: any number of processes share the node
    (2, 2, None),
    (1, 1, None),
])
def test_check_parallel_config_at_build_time(checkpoint, sp, num_gpus_on_node, message):
    config = engine_config(checkpoint, sp=sp)
    if message is None:
        check_parallel_config(config, num_gpus_on_node)
    else:
        with pytest.raises(SequenceParallelError, match=message):
            check_parallel_config(config, num_gpus_on_node)


def test_the_auto_made_tiny_checkpoint_is_checked_by_its_preset(tmp_path):
    config = EngineConfig(checkpoint_root=str(tmp_path), parallel={"sp": 4})
    with pytest.raises(SequenceParallelError, match=r"valid degrees: \[1, 2\]"):
        check_parallel_config(config, 0)
    assert not any(tmp_path.iterdir())  # cheap: nothing made, nothing read


def test_a_missing_checkpoint_is_refused_naming_it_before_any_rank_starts(ray_cluster, tmp_path):
    with pytest.raises(CheckpointError, match=str(tmp_path / "nope")):
        ParallelEngine(engine_config(tmp_path / "nope", sp=2), OwnPlacementGroup())


def test_a_one_process_engine_refuses_sp_above_1(checkpoint):
    with pytest.raises(ValueError, match="engine.parallel.sp=2 runs one process per device"):
        Engine(engine_config(checkpoint, sp=2))


# --- faults: a replica that cannot go on fails loudly and reports unhealthy ------------------------------


@contextlib.contextmanager
def replica(checkpoint: Path, **overrides) -> Iterator[ParallelEngine]:
    """A replica of its own, for a test that breaks it."""
    engine = ParallelEngine(engine_config(checkpoint, sp=2, **overrides), OwnPlacementGroup())
    try:
        yield engine
    finally:
        engine.close()


def test_ranks_whose_plan_caches_diverged_fail_the_request_loudly(ray_cluster, checkpoint):
    """Admission and eviction only stay alike if every rank sees every request; this one makes rank 1 drop its
    plans behind rank 0's back (a weight update sent to it alone)."""
    with replica(checkpoint, offload={"enabled": False}) as diverged:
        diverged.generate(request(steps=3))  # 2 plans, then 3 more: the same slab rows on both ranks
        diverged.generate(request(steps=5))
        ray.get(diverged.ranks[1].update_weights.remote(str(checkpoint)), timeout=TIMEOUT_S)  # rank 1 only
        # rank 0 finds the request's 4 plans in its slab, rank 1 (its slab emptied) would rebuild them: the
        # ranks disagree on what to rebuild before any of them streams a unit
        with pytest.raises(ServerFault, match="the AdaLN plan caches of the ranks diverged"):
            diverged.generate(request(steps=5))
        with pytest.raises(ServerFault, match="parallel replica unusable"):
            diverged.health()
