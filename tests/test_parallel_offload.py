"""Sequence parallel with layerwise offload and Cache-DiT, through the engine: two gloo ranks (spawned CPU
processes, `parallel.launch`, no Ray), each an `engine.Engine(config, group=...)` that streams its own copy of
the blocks, against the one-process engine with every block resident, on the tiny seed-0 checkpoint.

What is promised and asserted:
- the latents are the resident one-process engine's bit for bit (CPU: sharding never reorders a reduction, and
  streaming only moves bytes), for both AdaLN modes (online: plan rows from the rank-sharded rebuild, the blocks'
  adaln_proj holds no tensors; resident: adaln_proj streams with its block);
- Cache-DiT caches the same forwards on both ranks as on one device (the decision is taken on the residual
  reduced over the ranks, `parallel.cache_decision`);
- each rank's offloader moves zero bytes in a cached forward (the skipped middle blocks are never streamed) and
  exactly its streamed blocks' bytes in a computed one, the same on both ranks.
These engines keep the text encoder whole on every rank (`text_encoder_tp: false`), so both sides condition on
the same bits; the tensor parallel encoder rounds differently (tests/test_parallel_text_encoder.py bounds it).
The last engine runs the default `text_encoder_tp` through the same loop: its ranks agree with each other.

The request: 64x64 px, 0.5 s (7 latent frames), 9 sampling points = 8 forwards, ~105 packed rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.api import GenerationRequest
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import GenerationCancelled
from model.tiny import make_tiny_checkpoint
from tests.ranks_support import rank_reports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # slow: spawns gloo rank processes (each imports torch + diffusers) for whole engines

WORLD_SIZE = 2
TIMEOUT_S = 30.0
NUM_FORWARDS = 8
# Fn=1, Bn=1 of the 4 blocks: blocks 1 and 2 are the middle Cache-DiT skips (and the offloader streams).
CACHE_DIT = {"enabled": True, "Fn_compute_blocks": 1, "Bn_compute_blocks": 1, "max_warmup_steps": 1,
             "residual_diff_threshold": 0.15, "max_continuous_cached_steps": 2}
ADALN_MODES = ("online", "resident")
CANCEL_ASKED_AFTER = 3  # forwards done when rank 0's caller cancels
#: Same 16-epsilon bound as tests/test_parallel_text_encoder.py (where it is derived).
TOLERANCE_EPS = 16


def request() -> GenerationRequest:
    return GenerationRequest(prompt="a red fox", steps=NUM_FORWARDS + 1, seconds=0.5, width=64, height=64, seed=11,
                             return_video=False)


def engine_config(checkpoint: Path, *, sp: int, adaln_mode: str, offload: bool, text_encoder_tp: bool = False
                  ) -> EngineConfig:
    return EngineConfig(
        checkpoint=str(checkpoint), device="cpu", geometry={"short_edge": None, "min_seconds": 0.1},
        adaln={"mode": adaln_mode, "gpu_plans": 16, "host_cache_gb": 0.01}, offload={"enabled": offload},
        cache_dit=CACHE_DIT, pool={"enabled": False},
        parallel={"sp": sp, "timeout_s": TIMEOUT_S, "text_encoder_tp": text_encoder_tp},
    )


# ------------------------------------------------------------------------------------------- the ranks


def _rank_program(rank: int, world_size: int, init_method: str, checkpoint: Path, out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    from parallel.group import init_group
    from parallel.text_encoder import TextTensorParallel

    group = init_group(rank, world_size, init_method, "cpu", timeout_s=TIMEOUT_S)
    report: dict = {}
    for mode in ADALN_MODES:
        engine = Engine(engine_config(checkpoint, sp=world_size, adaln_mode=mode, offload=True), group=group)
        assert engine.prompt_encoder.split is None
        result = engine.generate(request())
        offloader = engine.offloader
        report[mode] = {
            "video": result.video, "audio": result.audio, "cached": result.stats.cache_dit.cached_steps,
            "bytes_per_step": list(offloader.stats.h2d_bytes_per_step),
            "streamed_bytes": sum(offloader.describe()["block_bytes"][i] for i in offloader.streamed_indices),
            "streamed": offloader.streamed_indices,
        }
    # Cancel mid-loop (engine with the last mode): rank 0's caller asks once 3 forwards are done, rank 1's
    # from the first (ignored: rank 0 decides). Agreed one boundary late, so both ranks run forward 3 and stop.
    seen: list[int] = []
    asks_after = CANCEL_ASKED_AFTER if rank == 0 else 1
    try:
        engine.generate(request(), lambda done, total: seen.append(done), lambda: len(seen) >= asks_after)
    except GenerationCancelled:
        report["cancel"] = {"seen": seen, "held_plan_refs": engine.debug_stats()["held_plan_refs"]}
    report["after_cancel"] = engine.generate(request()).video
    engine = Engine(engine_config(checkpoint, sp=world_size, adaln_mode="online", offload=True,
                                  text_encoder_tp=True), group=group)
    result = engine.generate(request())
    report["tp"] = {"split": isinstance(engine.prompt_encoder.split, TextTensorParallel),
                    "embedding": engine.prompt_encoder.encode(request().prompt),
                    "video": result.video, "audio": result.audio}
    torch.save(report, out_dir / f"rank{rank}.pt")
    group.barrier()
    group.destroy()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("h3") / "tiny", "diffusers", seed=0)


@pytest.fixture(scope="module")
def ranks(checkpoint, tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("sp-offload")
    return rank_reports(_rank_program, WORLD_SIZE, out_dir, (checkpoint, out_dir), deadline_s=420.0)


@pytest.fixture(scope="module")
def resident(checkpoint) -> dict[str, Engine]:
    """One process, every block resident, per AdaLN mode; and its first request's result."""
    engines = {mode: Engine(engine_config(checkpoint, sp=1, adaln_mode=mode, offload=False)) for mode in ADALN_MODES}
    assert all(engine.offloader is None for engine in engines.values())
    return {mode: engine.generate(request()) for mode, engine in engines.items()}


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("mode", ADALN_MODES)
def test_sp2_with_offload_and_cache_dit_equals_the_resident_one_process_engine_bit_for_bit(ranks, resident, mode):
    want = resident[mode]
    for rank in ranks:
        assert torch.equal(rank[mode]["video"], want.video) and torch.equal(rank[mode]["audio"], want.audio)


@pytest.mark.parametrize("mode", ADALN_MODES)
def test_both_ranks_cache_the_forwards_one_device_caches(ranks, resident, mode):
    cached = resident[mode].stats.cache_dit.cached_steps
    assert cached, "Cache-DiT cached nothing on this request: the skip path would go untested"
    assert [rank[mode]["cached"] for rank in ranks] == [cached, cached]


@pytest.mark.parametrize("mode", ADALN_MODES)
def test_each_rank_streams_zero_bytes_in_a_cached_forward_and_its_blocks_in_a_computed_one(ranks, resident, mode):
    cached = resident[mode].stats.cache_dit.cached_steps
    for rank in ranks:
        assert rank[mode]["streamed"] == [1, 2]  # Fn and Bn edges resident, the middle streamed
        expected = [0 if step in cached else rank[mode]["streamed_bytes"] for step in range(NUM_FORWARDS)]
        assert rank[mode]["bytes_per_step"] == expected
    assert ranks[0][mode]["streamed_bytes"] > 0
    assert ranks[0][mode]["bytes_per_step"] == ranks[1][mode]["bytes_per_step"]


def test_a_cancel_mid_loop_stops_every_rank_after_the_same_forward_one_boundary_late(ranks, resident):
    # asked at boundary 3 (3 forwards done) on rank 0: every rank runs forward 3 and stops at boundary 4
    want = list(range(1, CANCEL_ASKED_AFTER + 2))
    assert [rank["cancel"] for rank in ranks] == [{"seen": want, "held_plan_refs": 0}] * WORLD_SIZE
    # a rank that ran one forward more would leave the other in a collective: the next request runs, same bits
    for rank in ranks:
        assert torch.equal(rank["after_cancel"], resident[ADALN_MODES[-1]].video)


def test_with_the_tensor_parallel_text_encoder_the_ranks_agree(ranks, checkpoint):
    assert [rank["tp"]["split"] for rank in ranks] == [True, True]
    assert torch.equal(ranks[0]["tp"]["video"], ranks[1]["tp"]["video"])
    assert torch.equal(ranks[0]["tp"]["audio"], ranks[1]["tp"]["audio"])
    whole = Engine(engine_config(checkpoint, sp=1, adaln_mode="online", offload=False)).prompt_encoder
    want = whole.encode(request().prompt)
    got = ranks[0]["tp"]["embedding"]
    bound = TOLERANCE_EPS * torch.finfo(want.dtype).eps * want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= bound
