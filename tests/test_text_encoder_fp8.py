"""`text_encoder.quantization: fp8` (`engine.text_fp8`): the Qwen3-VL language model's decoder-layer linears in
torchao float8, quantized layer by layer as they load; on the tiny checkpoint on CPU with the float8 device checks
lifted (torchao's float8 linears compute on a CPU too: tests/test_forward_kernels.py).

Fidelity bound: the fp8 prompt embedding's relative error against the bf16 one, ||fp8 - bf16|| / ||bf16|| over the
whole [tokens, text_dim] embedding, is at most FP8_REL_ERROR. Measured while writing this on the tiny encoder
(width 32, 50 layers, random weights) over the four prompts below: 0.068-0.108 (worst token 0.14). Why so large
next to the transformer tier's 0.4% per block: e4m3 keeps 3 mantissa bits, so each GEMM's inputs round by up to
~6%, and 50 layers of 7 quantized GEMMs each feed one residual stream; a 32-wide random model averages that
rounding over few terms. 0.2 leaves room above the worst seen while an unquantized or a broken encoder (O(1)
error) still fails; bench.h3_modes reports the figure at the released width.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from engine.config import EngineConfig, TextEncoderConfig
from engine.fp8 import QuantizationError, stored_bytes
from engine.stages import PromptStage
from engine.text_fp8 import TextEncoderFp8, decoder_linears
from model.layout import H3Checkpoint
from model.text_encoder import PromptEncoder
from model.tiny import make_tiny_checkpoint
from offload.wrapped import is_wrapped

pytest.importorskip("torchao")
pytestmark = pytest.mark.timeout(300)

FP8_REL_ERROR = 0.2
PROMPTS = ("a", "a red fox trotting through fresh snow",
           "a lighthouse on a cliff at dusk, waves breaking below, gulls and wind",
           "a street market in the rain at night, neon signs reflected in puddles, people with umbrellas")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> H3Checkpoint:
    return H3Checkpoint.open(make_tiny_checkpoint(tmp_path_factory.mktemp("text-fp8") / "tiny", "diffusers", seed=0))


@pytest.fixture
def cpu_fp8(monkeypatch):
    monkeypatch.setattr("engine.fp8.check_fp8_device", lambda device, field="engine.quantization": None)
    monkeypatch.setattr("torchao.quantization.quant_api._check_hardware_support", lambda granularity: None)


def encoder(checkpoint: H3Checkpoint, transform: TextEncoderFp8 | None = None, vision: bool = False) -> PromptEncoder:
    return PromptEncoder(checkpoint.text_encoder_dir, checkpoint.tokenizer_dir, "cpu", layer_transform=transform,
                         vision=vision, processor_dir=checkpoint.processor_dir)


def relative_error(reference: torch.Tensor, other: torch.Tensor) -> float:
    return float((other.float() - reference.float()).norm() / reference.float().norm())


@pytest.mark.slow  # two encoders, eight encodes through CPU float8 (several seconds on a loaded machine)
def test_fp8_embeddings_are_within_the_bound_of_bf16_and_not_its_bits(checkpoint, cpu_fp8):
    bf16, fp8 = encoder(checkpoint), encoder(checkpoint, TextEncoderFp8(torch.device("cpu")))
    for prompt in PROMPTS:
        want, got = bf16.encode(prompt), fp8.encode(prompt)
        assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
        assert not torch.equal(got, want), prompt  # quantization did something
        assert relative_error(want, got) <= FP8_REL_ERROR, prompt
    # Other bits, another encoder: prompt caches keyed by its identity never hand out bf16 embeddings.
    assert fp8.identity != bf16.identity


def test_every_decoder_linear_is_quantized_and_nothing_else(checkpoint, cpu_fp8):
    transform = TextEncoderFp8(torch.device("cpu"))
    fp8 = encoder(checkpoint, transform, vision=True)
    bf16 = encoder(checkpoint)
    want = [f"model.layers.{i}.{name}" for i, layer in enumerate(bf16.module.layers) for name in decoder_linears(layer)]
    assert len(want) == 7 * bf16.num_loaded_layers  # q, k, v, o, gate, up, down
    assert [f"model.{name}" for name in transform.quantized] == want
    wrapped = [name for name, p in fp8.module.language_model.named_parameters() if is_wrapped(p)]
    assert [f"model.{name.removesuffix('.weight')}" for name in wrapped] == want
    # The embedding, the norms and the whole vision tower stay as stored.
    kept = {name: p for name, p in fp8.module.named_parameters() if not is_wrapped(p)}
    assert "language_model.embed_tokens.weight" in kept and any(name.startswith("visual.") for name in kept)
    assert all(p.dtype == torch.bfloat16 for p in kept.values())
    assert not any(is_wrapped(m.weight) for m in fp8.module.visual.modules() if isinstance(m, nn.Linear))
    assert stored_bytes(fp8.module) < stored_bytes(encoder(checkpoint, vision=True).module)


class Recording(TextEncoderFp8):
    """The fp8 transform, noting which decoder layers held weights when each layer was quantized."""

    def __init__(self, device: torch.device, layers: list[nn.Module]) -> None:
        super().__init__(device)
        self.layers, self.loaded_at = layers, []

    def apply(self, index: int, layer: nn.Module) -> None:
        super().apply(index, layer)
        self.loaded_at.append([i for i, other in enumerate(self.layers)
                               if not any(p.is_meta for p in other.parameters())])


def test_layers_are_quantized_as_they_load_so_the_bf16_stack_is_never_held_whole(checkpoint, cpu_fp8, monkeypatch):
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    built: list[nn.Module] = []
    real_init = modeling_qwen3_vl.Qwen3VLTextModel.__init__

    def remember(self, config):  # the layers of the model the encoder builds (on meta until each loads)
        real_init(self, config)
        built[:] = list(self.layers)

    monkeypatch.setattr(modeling_qwen3_vl.Qwen3VLTextModel, "__init__", remember)
    transform = Recording(torch.device("cpu"), built)
    encoder(checkpoint, transform)
    # When layer i was quantized, layers 0..i held weights (0..i-1 already float8) and i+1.. were not read yet.
    assert transform.loaded_at == [list(range(i + 1)) for i in range(len(built))]


def test_the_prompt_stage_reports_its_tier_and_memory(checkpoint, cpu_fp8):
    stages = {q: PromptStage(TextEncoderConfig(quantization=q, vision=False), checkpoint, torch.device("cpu"))
              for q in ("none", "fp8")}
    bf16, fp8 = stages["none"].weights, stages["fp8"].weights
    assert (bf16.quantization, bf16.quantized_linears) == ("none", 0)
    assert (fp8.quantization, fp8.quantized_linears, fp8.decoder_layers) == ("fp8", 7 * 50, 50)
    assert fp8.bytes == stored_bytes(stages["fp8"].encoder.module) < bf16.bytes
    assert "quantization fp8 (350 linears)" in fp8.summary()


def test_fp8_where_float8_cannot_run_is_refused_naming_the_field(checkpoint):
    with pytest.raises(QuantizationError, match="text_encoder.quantization: fp8 needs a CUDA GPU .* runs on cpu"):
        PromptStage(TextEncoderConfig(quantization="fp8", vision=False), checkpoint, torch.device("cpu"))
    with pytest.raises(ValidationError, match="text_encoder.device: cpu cannot"):
        EngineConfig(text_encoder={"quantization": "fp8", "device": "cpu"})
    assert EngineConfig().text_encoder.quantization == "none"  # served default: bf16



@pytest.mark.slow
def test_the_bench_reports_the_fp8_encoders_error_and_memory_beside_bf16(checkpoint, cpu_fp8):
    from bench.h3_modes import text_encoder_rows

    config = EngineConfig(checkpoint=str(checkpoint.root), device="cpu")
    bf16, fp8 = text_encoder_rows(config, PROMPTS[1])
    assert (bf16["text_encoder"], bf16["quantized_linears"], bf16["rel_error"]) == ("bf16", 0, 0.0)
    assert (fp8["text_encoder"], fp8["quantized_linears"]) == ("fp8", 350)
    assert 0 < fp8["rel_error"] <= FP8_REL_ERROR and 0 < fp8["GiB"] < bf16["GiB"]
