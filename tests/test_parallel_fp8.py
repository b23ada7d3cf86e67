"""Sequence parallel with the FP8 tier (`engine.quantization: fp8`) and compiled blocks, through the engine: two
gloo ranks (`parallel.launch`, no Ray), each an FP8 `engine.Engine(config, group=...)` compiled under dynamo's
eager backend, against the one-process FP8 engine without compile, on the tiny seed-0 checkpoint, with online
AdaLN, layerwise offload (the FP8 weights stream) and Cache-DiT on.

SP on CPU changes no reduction's order (tests/test_parallel_sequence.py), torchao's float8 linears are row-local,
and the eager backend runs eager's kernels: the latents must be equal bit for bit. The float8 device checks are
faked away in every process (torchao's float8 linears compute on a CPU too: tests/test_forward_kernels.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.api import GenerationRequest
from engine.config import EngineConfig
from engine.engine import Engine
from model.tiny import make_tiny_checkpoint
from tests.ranks_support import rank_reports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # slow: spawns gloo rank processes (each imports torch + diffusers) for whole engines

WORLD_SIZE = 2
TIMEOUT_S = 60.0  # dynamo traces between collectives: a rank may wait on its peer's first trace
CACHE_DIT = {"enabled": True, "Fn_compute_blocks": 1, "Bn_compute_blocks": 1, "max_warmup_steps": 1,
             "residual_diff_threshold": 0.15, "max_continuous_cached_steps": 2}


def request() -> GenerationRequest:
    return GenerationRequest(prompt="a red fox", steps=9, seconds=0.5, width=64, height=64, seed=11,
                             return_video=False)


def engine_config(checkpoint: Path, *, sp: int, compiled: bool) -> EngineConfig:
    return EngineConfig(
        checkpoint=str(checkpoint), device="cpu", geometry={"short_edge": None, "min_seconds": 0.1},
        quantization="fp8", adaln={"mode": "online", "gpu_plans": 16, "host_cache_gb": 0.01},
        offload={"enabled": True}, cache_dit=CACHE_DIT, pool={"enabled": False},
        compile={"mode": "blocks" if compiled else "off", "backend": "eager"},
        parallel={"sp": sp, "timeout_s": TIMEOUT_S, "text_encoder_tp": False},
    )


def fake_float8_device() -> None:
    import engine.fp8
    import torchao.quantization.quant_api

    engine.fp8.check_fp8_device = lambda device: None
    torchao.quantization.quant_api._check_hardware_support = lambda granularity: None


def _rank_program(rank: int, world_size: int, init_method: str, checkpoint: Path, out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    fake_float8_device()
    from parallel.group import init_group

    group = init_group(rank, world_size, init_method, "cpu", timeout_s=TIMEOUT_S)
    engine = Engine(engine_config(checkpoint, sp=world_size, compiled=True), group=group)
    result = engine.generate(request())
    torch.save({"video": result.video, "audio": result.audio, "cached": result.stats.cache_dit.cached_steps,
                "linears": engine.forward_kernels.quantized_linears,
                "streamed_bytes": sum(engine.offloader.stats.h2d_bytes_per_step)}, out_dir / f"rank{rank}.pt")
    group.barrier()
    group.destroy()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("h3") / "tiny", "diffusers", seed=0)


@pytest.fixture(scope="module")
def ranks(checkpoint, tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("sp-fp8")
    return rank_reports(_rank_program, WORLD_SIZE, out_dir, (checkpoint, out_dir), deadline_s=500.0)


def test_sp2_fp8_compiled_equals_the_one_process_fp8_engine_bit_for_bit(ranks, checkpoint, monkeypatch):
    monkeypatch.setattr("engine.fp8.check_fp8_device", lambda device: None)
    monkeypatch.setattr("torchao.quantization.quant_api._check_hardware_support", lambda granularity: None)
    want = Engine(engine_config(checkpoint, sp=1, compiled=False)).generate(request())
    assert want.stats.cache_dit.cached_steps, "Cache-DiT cached nothing: the skip path would go untested"
    for rank in ranks:
        assert rank["linears"] == 24 and rank["streamed_bytes"] > 0
        assert torch.equal(rank["video"], want.video) and torch.equal(rank["audio"], want.audio)
        assert rank["cached"] == want.stats.cache_dit.cached_steps
