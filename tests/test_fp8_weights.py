"""A weight update on an FP8 engine (`engine.quantization: fp8`) re-quantizes the new checkpoint's bf16 weights the
way the load does, resident or streamed by the offloader: the updated engine serves a fresh FP8 engine on the new
checkpoint bit for bit. On CPU with the float8 device checks faked away (torchao's float8 linears compute on a CPU
too: tests/test_forward_kernels.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.api import GenerationRequest
from engine.config import EngineConfig
from engine.engine import Engine
from model.tiny import make_tiny_checkpoint
from offload.wrapped import is_wrapped
from tests.weights_support import finetune_of


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8-weights")
    served = make_tiny_checkpoint(root / "seed0", "diffusers", seed=0)
    return served, finetune_of(served, root / "seed1")


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    monkeypatch.setattr("engine.fp8.check_fp8_device", lambda device: None)
    monkeypatch.setattr("torchao.quantization.quant_api._check_hardware_support", lambda granularity: None)


def fp8_engine(checkpoint: Path, offload: bool) -> Engine:
    return Engine(EngineConfig(checkpoint=str(checkpoint), device="cpu", quantization="fp8",
                               offload={"enabled": offload}, adaln={"host_cache_gb": 0.01},
                               geometry={"short_edge": None, "min_seconds": 0.1}))


def request() -> GenerationRequest:
    return GenerationRequest(prompt="a red fox", steps=4, seconds=0.5, width=64, height=64, seed=3, return_video=False)


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offload"])
def test_an_fp8_engine_updated_to_new_weights_serves_a_fresh_fp8_engine_on_them(checkpoints, fp8_on_cpu, offload):
    served, finetune = checkpoints
    engine = fp8_engine(served, offload)
    assert engine.forward_kernels.quantized_linears == 24
    before = engine.generate(request())
    engine.update_weights(finetune)
    after = engine.generate(request())
    fresh = fp8_engine(finetune, offload).generate(request())
    assert torch.equal(after.video, fresh.video) and torch.equal(after.audio, fresh.audio)
    assert not torch.equal(after.video, before.video)
    assert all(is_wrapped(block.attn.to_q.weight) for block in engine.transformer.transformer_blocks)
    if engine.offloader is not None:
        engine.offloader.check_invariants()
