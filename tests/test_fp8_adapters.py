"""FP8 with LoRA adapters (issue 24): peft wraps torchao's float8 linears (`TorchaoLoraLinear`, its dispatch for any
torchao tensor-subclass weight) and adds the low-rank product, in the factors' dtype, to the float8 GEMM's output:
the quantized base is never touched, so an adapter needs no re-quantization and switching is as in bf16.

On a GPU the engine quantizes with `engine.fp8.quantize_blocks_fp8` (torchao's `Float8DynamicActivationFloat8Weight
Config`, rowwise). torchao refuses that config off a float8-capable GPU, though its float8 tensors' GEMM (torch's
`_scaled_mm`) runs on a CPU: here the same function runs with both hardware checks lifted (`cpu_fp8`), so the
weights are the tensor subclass the GPU would hold, and the forward is float8 x float8 rowwise on the CPU.

Asserted: every quantized linear is wrapped by peft's torchao LoRA layer and computes exactly the float8 base plus
the low-rank delta; with the adapters off the model gives the float8 model's bits back; alternating adapters
each give their own bits again; the adapter's effect on the velocities matches its bf16 effect within a bound
(the float8 rounding of the base's weights and activations: 7.7% measured on the tiny model, bounded at 15%);
`fuse: true` with fp8 stays refused (a fused delta would be re-quantized into the float8 weights).
"""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError

pytest.importorskip("torchao")
from peft.tuners.lora.torchao import TorchaoLoraLinear  # noqa: E402
from torchao.utils import TorchAOBaseTensor  # noqa: E402

from engine.adapters import AdapterSet  # noqa: E402
from engine.api import AdapterChoice  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.fp8 import fp8_targets, quantize_blocks_fp8  # noqa: E402
from model.adapters import lora_layers  # noqa: E402
from model.tiny import tiny_transformer  # noqa: E402
from model.tiny_adapter import TURBO_TARGETS, save_adapter, tiny_lora_factors  # noqa: E402
from tests.denoise_support import denoise, t2va_request  # noqa: E402

pytestmark = pytest.mark.timeout(300)

#: The adapter's effect on the last velocities under fp8 vs bf16, relative to its bf16 norm.
EFFECT_BOUND = 0.15


@pytest.fixture()
def cpu_fp8(monkeypatch):
    """`quantize_blocks_fp8` on a CPU: the engine's and torchao's float8-hardware checks lifted."""
    monkeypatch.setattr("engine.fp8.check_fp8_device", lambda device: None)
    monkeypatch.setattr("torchao.quantization.quant_api._check_hardware_support", lambda granularity: None)


@pytest.fixture(scope="module")
def adapter_configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    turbo = save_adapter(root / "turbo.safetensors", tiny_lora_factors(1, targets=TURBO_TARGETS, rank=4))
    style = save_adapter(root / "style.safetensors",
                         tiny_lora_factors(2, targets=("attn.to_out.0", "ff.net.2"), rank=4))
    return EngineConfig(adapters={"turbo": {"path": str(turbo)}, "style": {"path": str(style), "scale": 0.5}}).adapters


def fp8_model():
    model = tiny_transformer(0)
    quantize_blocks_fp8(model.transformer_blocks, torch.device("cpu"))
    return model


def test_fp8_with_unfused_adapters_is_served_and_fuse_stays_refused(tmp_path):
    EngineConfig(quantization="fp8", adapters={"turbo": {"path": str(tmp_path / "t.safetensors")}})
    with pytest.raises(ValidationError, match="fuse: true is not served with quantization: fp8"):
        EngineConfig(quantization="fp8", adapters={"turbo": {"path": str(tmp_path / "t.safetensors"), "fuse": True}})


def test_peft_wraps_every_float8_linear_and_adds_the_low_rank_delta_to_the_float8_gemm(cpu_fp8, adapter_configs):
    model = fp8_model()
    targets = [f"transformer_blocks.{name}" for name in fp8_targets(model.transformer_blocks)]
    modules = dict(model.named_modules())
    assert all(isinstance(modules[name].weight, TorchAOBaseTensor) for name in targets)
    base = {name: copy.deepcopy(modules[name]) for name in targets}  # the float8 linears, unwrapped
    adapters = AdapterSet(adapter_configs, 10**9, model, None)
    adapters.apply((AdapterChoice(name="turbo"),))
    layers = lora_layers(model, "turbo")
    assert set(targets) <= set(layers) and all(isinstance(layers[name], TorchaoLoraLinear) for name in targets)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in targets:
            layer = layers[name]
            x = torch.randn(7, layer.in_features, generator=generator).to(torch.bfloat16)
            a, b = layer.lora_A["turbo"].weight, layer.lora_B["turbo"].weight
            expect = base[name](x) + torch.nn.functional.linear(torch.nn.functional.linear(x.to(a.dtype), a), b) \
                * layer.scaling["turbo"]
            assert torch.equal(layer(x), expect.to(layer(x).dtype)), name


def test_fp8_adapters_alternate_with_their_own_bits_and_off_is_the_float8_model(cpu_fp8, adapter_configs):
    request = t2va_request(3)
    model = fp8_model()
    plain = denoise(model, request)
    adapters = AdapterSet(adapter_configs, 10**9, model, None)
    runs = {}
    sequence = [("turbo", ("turbo",)), ("none", ()), ("both", ("turbo", "style")), ("turbo again", ("turbo",))]
    for label, choices in sequence:
        adapters.apply(tuple(AdapterChoice(name=n) for n in choices))
        runs[label] = denoise(model, request)
    assert torch.equal(runs["none"].video, plain.video) and torch.equal(runs["none"].audio, plain.audio)
    assert torch.equal(runs["turbo again"].video, runs["turbo"].video)
    assert not torch.equal(runs["turbo"].video, plain.video)
    assert not torch.equal(runs["both"].video, runs["turbo"].video)


def test_an_adapters_effect_under_fp8_matches_its_bf16_effect_within_the_bound(cpu_fp8, adapter_configs):
    request = t2va_request(3)
    effects = {}
    for quantized in (False, True):
        model = fp8_model() if quantized else tiny_transformer(0)
        adapters = AdapterSet(adapter_configs, 10**9, model, None)
        adapters.apply(())
        off = denoise(model, request).video_velocity[-1].float()
        adapters.apply((AdapterChoice(name="turbo"),))
        on = denoise(model, request).video_velocity[-1].float()
        effects[quantized] = on - off
    error = (effects[True] - effects[False]).norm() / effects[False].norm()
    assert effects[False].norm() > 0 and error < EFFECT_BOUND, float(error)
