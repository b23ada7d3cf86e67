"""The FP8 tier a request can choose (issue 25 item 4): `engine.fp8.LinearPrecision` keeps each block linear's bf16
weight and a float8 copy and swaps which one runs; the served tiers and a request's default (`engine.limits`).

On CPU with the float8 device checks lifted (torchao's float8 linears compute on a CPU too:
tests/test_forward_kernels.py). Asserted bit for bit: the bf16 side is the bf16 model, the fp8 side is the model
`quantize_blocks_fp8` makes, alternating on one model, with an unfused LoRA adapter installed too."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")
from engine.adapters import AdapterSet  # noqa: E402
from engine.api import AdapterChoice  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.fp8 import LinearPrecision, fp8_targets, quantize_blocks_fp8  # noqa: E402
from engine.limits import served_limits, served_qualities  # noqa: E402
from model.tiny import tiny_transformer  # noqa: E402
from model.tiny_adapter import TURBO_TARGETS, save_adapter, tiny_lora_factors  # noqa: E402
from offload.wrapped import is_wrapped  # noqa: E402
from tests.denoise_support import assert_same_velocities, denoise, t2va_request  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def cpu_fp8(monkeypatch):
    monkeypatch.setattr("engine.fp8.check_fp8_device", lambda device: None)
    monkeypatch.setattr("torchao.quantization.quant_api._check_hardware_support", lambda granularity: None)


def fp8_model():
    model = tiny_transformer(0)
    quantize_blocks_fp8(model.transformer_blocks, torch.device("cpu"))
    return model


def test_both_tiers_alternate_on_one_model_each_with_the_bits_of_its_own_model(cpu_fp8):
    request = t2va_request(3)
    want = {"bf16": denoise(tiny_transformer(0), request), "fp8": denoise(fp8_model(), request)}
    model = tiny_transformer(0)
    bf16_weights = {name: model.transformer_blocks.get_submodule(name).weight.clone()
                    for name in fp8_targets(model.transformer_blocks)}
    precision = LinearPrecision(model.transformer_blocks, torch.device("cpu"))
    assert precision.active == "bf16"
    for linears in ("fp8", "bf16", "bf16", "fp8", "bf16"):
        precision.use(linears)
        precision.check()
        assert all(is_wrapped(model.transformer_blocks.get_submodule(n).weight) == (linears == "fp8")
                   for n in precision.names)
        assert_same_velocities(denoise(model, request), want[linears])
    # The bf16 weights were never touched (the float8 copies were made beside them).
    assert all(torch.equal(model.transformer_blocks.get_submodule(n).weight, w) for n, w in bf16_weights.items())


@pytest.mark.slow
def test_both_tiers_compose_with_an_unfused_adapter(cpu_fp8, tmp_path):
    turbo = save_adapter(tmp_path / "turbo.safetensors", tiny_lora_factors(1, targets=TURBO_TARGETS, rank=4))
    configs = EngineConfig(adapters={"turbo": {"path": str(turbo)}}).adapters
    request = t2va_request(3)
    want = {}
    for linears, model in (("bf16", tiny_transformer(0)), ("fp8", fp8_model())):
        AdapterSet(configs, 10**9, model, None).apply((AdapterChoice(name="turbo"),))
        want[linears] = denoise(model, request)
    model = tiny_transformer(0)
    precision = LinearPrecision(model.transformer_blocks, torch.device("cpu"))  # before the adapter wraps them
    AdapterSet(configs, 10**9, model, None).apply((AdapterChoice(name="turbo"),))
    for linears in ("fp8", "bf16", "fp8"):
        precision.use(linears)
        assert_same_velocities(denoise(model, request), want[linears])


@pytest.mark.parametrize("quantization, cache_dit, tiers, default", [
    ("none", True, ("lossless", "high"), "lossless"),
    ("none", False, ("lossless",), "lossless"),
    ("fp8", True, ("fp8",), "fp8"),
    ("bf16+fp8", True, ("lossless", "high", "fp8"), "lossless"),
    ("bf16+fp8", False, ("lossless", "fp8"), "lossless"),
])
def test_served_tiers_and_the_default_tier_follow_the_quantization(quantization, cache_dit, tiers, default):
    assert served_qualities(quantization, cache_dit) == tiers
    limits = served_limits("m", max_steps=65, short_edge=None, max_pixels=64 * 64, size_multiple=32,
                           min_seconds=0.1, max_seconds=15, fps=24, frames_per_chunk=17, frame_offset=5,
                           max_prompt_tokens=64, default_flow_shift=12, default_audio_flow_shift=3,
                           quantization=quantization, qualities=tiers)
    assert limits.default_quality == default
    unserved = next(q for q in ("lossless", "high", "fp8") if q not in tiers) if len(tiers) < 3 else None
    if unserved is not None:
        message = limits.unserved_quality(unserved)
        assert all(repr(q) in message.rpartition("served: ")[2] for q in tiers), message


# --- the engine ---------------------------------------------------------------------------------------------

from pathlib import Path  # noqa: E402

from pydantic import ValidationError  # noqa: E402

from engine.api import GenerationRequest  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.errors import ClientError  # noqa: E402
from model.tiny import make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiers") / "tiny", "diffusers", seed=0)


def engine_of(checkpoint: Path, quantization: str) -> Engine:
    return Engine(EngineConfig(checkpoint=str(checkpoint), device="cpu", quantization=quantization,
                               adaln={"mode": "online", "host_cache_gb": 0.01}, pool={"enabled": False},
                               geometry={"short_edge": None, "min_seconds": 0.1}))


def tier_request(quality: str | None, seed: int = 3) -> GenerationRequest:
    return GenerationRequest(prompt="a red fox", steps=4, seconds=0.5, width=64, height=64, seed=seed,
                             return_video=False, quality=quality)


@pytest.mark.slow  # two tiers of engines built and compared: over ~5 s
def test_a_both_engine_serves_lossless_as_a_bf16_engine_and_fp8_as_an_fp8_engine_alternating(checkpoint, cpu_fp8):
    want = {"lossless": engine_of(checkpoint, "none").generate(tier_request(None)),
            "fp8": engine_of(checkpoint, "fp8").generate(tier_request(None))}
    both = engine_of(checkpoint, "bf16+fp8")
    assert both.limits.qualities == ("lossless", "fp8") and both.limits.quantization == "bf16+fp8"
    assert both.describe()["limits"]["qualities"] == ["lossless", "fp8"]
    for quality in ("fp8", "lossless", None, "fp8", "fp8", "lossless"):
        got = both.generate(tier_request(quality))
        tier = quality or "lossless"  # the default tier where bf16 is served
        assert torch.equal(got.video, want[tier].video) and torch.equal(got.audio, want[tier].audio), quality
        assert got.stats.linears == ("fp8" if tier == "fp8" else "bf16")
    assert not torch.equal(want["fp8"].video, want["lossless"].video)


@pytest.mark.parametrize("quantization, asked, served", [
    ("none", "fp8", "'lossless'"),
    ("fp8", "lossless", "'fp8'"),
])
def test_a_tier_the_server_does_not_serve_is_refused_naming_quality_and_the_served_tiers(
        checkpoint, cpu_fp8, quantization, asked, served):
    engine = engine_of(checkpoint, quantization)
    with pytest.raises(ClientError) as info:
        engine.validate(tier_request(asked))
    assert info.value.field == "quality" and f"served: {served}" in str(info.value)
    assert engine.generate(tier_request(None)).stats.linears == ("fp8" if quantization == "fp8" else "bf16")


@pytest.mark.parametrize("config, message", [
    ({"offload": {"enabled": True}}, "quantization: bf16\\+fp8 is not served with offload.enabled"),
    ({"adapters": {"turbo": {"path": "t.safetensors", "fuse": True}}},
     "fuse: true is not served with quantization: bf16\\+fp8"),
])
def test_both_is_refused_with_offload_and_with_fused_adapters(config, message):
    with pytest.raises(ValidationError, match=message):
        EngineConfig(quantization="bf16+fp8", **config)


# --- the video API (jobs.limits) ---------------------------------------------------------------------------


@pytest.mark.parametrize("qualities, asked, resolved", [
    (("lossless", "high"), None, "lossless"),  # a bf16 server: as before
    (("fp8",), None, "fp8"),
    (("lossless", "fp8"), "fp8", "fp8"),
    (("fp8",), "lossless", None),
    (("lossless", "high"), "fp8", None),
])
def test_a_video_job_gets_the_default_tier_or_a_served_one_else_a_422_on_quality(qualities, asked, resolved):
    from jobs.errors import InvalidVideoRequest
    from jobs.limits import resolve_spec
    from jobs.schemas import VideoCreateRequest

    quantization = {("fp8",): "fp8", ("lossless", "fp8"): "bf16+fp8"}.get(qualities, "none")
    limits = served_limits("m", max_steps=65, short_edge=None, max_pixels=64 * 64, size_multiple=32,
                           min_seconds=0.1, max_seconds=15, fps=24, frames_per_chunk=17, frame_offset=5,
                           max_prompt_tokens=64, default_flow_shift=12, default_audio_flow_shift=3,
                           quantization=quantization, qualities=qualities)
    request = VideoCreateRequest(prompt="a fox", **({} if asked is None else {"quality": asked}))
    if resolved is None:
        with pytest.raises(InvalidVideoRequest) as info:
            resolve_spec(request, limits, seed=1)
        assert info.value.field == "quality" and "served: " in str(info.value)
    else:
        assert resolve_spec(request, limits, seed=1).quality == resolved
