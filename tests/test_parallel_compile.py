"""Sequence parallel with compiled blocks (`engine.compile`), through the engine: two gloo ranks (`parallel.launch`,
no Ray), each an `engine.Engine(config, group=...)` with `compile.mode: blocks`, against the one-process engine with
the same compile config, on the tiny seed-0 checkpoint, with the served features on (online AdaLN from the plan
cache, layerwise offload, Cache-DiT).

Compiled under dynamo's `eager` backend, as tests/test_forward_kernels.py explains: the capture, the guards, the
graph breaks and the recompiles are dynamo's own, and the numerics are eager's, so SP2 compiled must equal SP1
compiled bit for bit (and both the eager engine's). Inductor's numerics are bounded there, not here.

What else is asserted: the SP attention processor is a graph break (its collectives stay eager), counted by the
engine's compile stats on every rank; the warm-up at start compiled what a request of its canvas needs, so the
request compiles nothing on either rank (`since_warmup == 0`), and neither does another prompt length.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.api import GenerationRequest
from engine.config import EngineConfig
from engine.engine import Engine
from engine.stage_data import PromptEmbedding
from model.prompts import PromptCacheStats
from model.tiny import make_tiny_checkpoint
from tests.ranks_support import rank_reports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # slow: spawns gloo rank processes (each imports torch + diffusers) for whole engines

WORLD_SIZE = 2
TIMEOUT_S = 60.0  # dynamo traces between collectives: a rank may wait on its peer's first trace
CANVAS = dict(width=64, height=64, seconds=0.5, steps=9)  # 8 forwards, ~105 packed rows
CACHE_DIT = {"enabled": True, "Fn_compute_blocks": 1, "Bn_compute_blocks": 1, "max_warmup_steps": 1,
             "residual_diff_threshold": 0.15, "max_continuous_cached_steps": 2}


def request() -> GenerationRequest:
    return GenerationRequest(prompt="a red fox", seed=11, return_video=False, **CANVAS)


def engine_config(checkpoint: Path, *, sp: int, compiled: bool) -> EngineConfig:
    return EngineConfig(
        checkpoint=str(checkpoint), device="cpu", geometry={"short_edge": None, "min_seconds": 0.1},
        adaln={"mode": "online", "gpu_plans": 16, "host_cache_gb": 0.01}, offload={"enabled": True},
        cache_dit=CACHE_DIT, pool={"enabled": False},
        compile={"mode": "blocks" if compiled else "off", "backend": "eager", "warmup": [CANVAS]},
        parallel={"sp": sp, "timeout_s": TIMEOUT_S, "text_encoder_tp": False},
    )


def other_prompt_length(engine: Engine):
    """A denoise of the warm-up canvas with an 11-row prompt (the warm-up ran 64): another sequence length."""
    prompt = PromptEmbedding(torch.randn(11, 32, generator=torch.Generator().manual_seed(5)).bfloat16(), 0.0,
                             PromptCacheStats(0, 0, 0, 0, 0, 0))
    return engine.denoise(request(), prompt)


# ------------------------------------------------------------------------------------------- the ranks


def _rank_program(rank: int, world_size: int, init_method: str, checkpoint: Path, out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    from parallel.group import init_group

    group = init_group(rank, world_size, init_method, "cpu", timeout_s=TIMEOUT_S)
    engine = Engine(engine_config(checkpoint, sp=world_size, compiled=True), group=group)
    result = engine.generate(request())
    other = other_prompt_length(engine)
    torch.save({"video": result.video, "audio": result.audio, "cached": result.stats.cache_dit.cached_steps,
                "compile": result.stats.compile, "other": other.stats.compile,
                "started": engine.describe()["forward"]["compile"],
                "precompiled": engine.forward_kernels.compiled.options.precompiled}, out_dir / f"rank{rank}.pt")
    group.barrier()
    group.destroy()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("h3") / "tiny", "diffusers", seed=0)


@pytest.fixture(scope="module")
def ranks(checkpoint, tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("sp-compile")
    return rank_reports(_rank_program, WORLD_SIZE, out_dir, (checkpoint, out_dir), deadline_s=500.0)


@pytest.fixture(scope="module")
def one_process(checkpoint):
    """The one-process engine's result, compiled (the same config at sp 1) and eager."""
    torch._dynamo.reset()  # graphs of earlier tests in this process would serve this engine's warm-up
    return {compiled: Engine(engine_config(checkpoint, sp=1, compiled=compiled)).generate(request())
            for compiled in (True, False)}


# ------------------------------------------------------------------------------------------------ tests


def test_sp2_compiled_equals_sp1_compiled_and_eager_bit_for_bit(ranks, one_process):
    for want in one_process.values():
        for rank in ranks:
            assert torch.equal(rank["video"], want.video) and torch.equal(rank["audio"], want.audio)


def test_both_ranks_cache_the_forwards_one_device_caches(ranks, one_process):
    cached = one_process[True].stats.cache_dit.cached_steps
    assert cached, "Cache-DiT cached nothing on this request: the skip path would go untested"
    assert [rank["cached"] for rank in ranks] == [cached, cached]


def test_the_sp_exchange_is_a_counted_graph_break_and_one_device_has_none(ranks, one_process):
    for rank in ranks:
        assert rank["started"]["frames_compiled"] >= 1
        assert rank["started"]["graph_breaks"] >= 1  # the attention processor (its all-to-alls) stays eager
    assert one_process[True].stats.compile.graph_breaks == 0


def test_after_the_warm_up_neither_rank_compiles_for_a_request(ranks):
    for rank in ranks:
        assert rank["compile"].since_warmup == 0
        assert rank["other"].since_warmup == 0  # another prompt length: the dynamic graph serves it


def test_ranks_do_not_try_to_keep_the_broken_graph_whole(ranks):
    """compile.precompiled (on by default) is off on SP ranks: the exchange's graph break leaves nothing whole."""
    assert [report["precompiled"] for report in ranks] == [False] * WORLD_SIZE
