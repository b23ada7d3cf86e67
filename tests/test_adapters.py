"""LoRA adapters (issue 24): files read and installed with diffusers' and peft's own code, served per request.

Adapters are tiny random LoRAs of the tiny transformer made as peft makes them (`model.tiny_adapter`:
`inject_adapter_in_model` with random factors, `get_peft_model_state_dict`, saved with safetensors under
diffusers' `transformer.` prefix), so every file here is what a peft/diffusers trainer would write. The oracle is diffusers' own: the modular
pipeline's denoise side with the same file loaded by `load_lora_weights` on its transformer, same embedding,
seed and steps, compared bit for bit with the engine's latents.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep
from pydantic import ValidationError
from safetensors.torch import save_file

from engine.adapters import AdapterSet
from engine.api import AdapterChoice, GenerationRequest, with_adapter_defaults
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ClientError, WeightsRejected
from model.adapters import (FALLBACK_ALPHA, AdapterError, AlphaSource, activate, fuse_into_base_, install_adapter,
                            installed_adapters, read_lora_file)
from model.packing import TEXT_TAG, audio_rows_to_channels
from model.provisioning import auto_adapter_path, ensure_adapter
from model.tiny import tiny_transformer
from model.tiny_adapter import TURBO_TARGETS, save_adapter, tiny_lora_factors
from model.weights import Transform, TransformerWeights, native_source
from tests.weights_support import WRONG_SHAPE_TENSOR, finetune_of, with_wrong_shape

pytestmark = pytest.mark.timeout(300)

RANK = 4


def lora_factors(seed: int, targets=TURBO_TARGETS, rank: int = RANK) -> dict[str, torch.Tensor]:
    return tiny_lora_factors(seed, targets=tuple(targets), rank=rank)


def native_factors(factors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`factors` under the native checkpoint's names and layouts, mapped as `model.weights` maps the base weights
    (fc1's lora_B rows [value; gate] -> native [gate; value]; lora_A untouched: the swap permutes output rows)."""
    native = {}
    for key, tensor in factors.items():
        module, _, factor = key.partition(".lora_")
        source = native_source(f"{module}.weight")
        assert source.transform in (Transform.VERBATIM, Transform.SWAP_HALVES), key  # no fused qkv here
        if source.transform is Transform.SWAP_HALVES and factor.startswith("B"):
            value, gate = tensor.chunk(2, dim=0)
            tensor = torch.cat([gate, value])
        native[f"{source.name.removesuffix('.weight')}.lora_{factor}"] = tensor
    return native


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    save_adapter(root / "turbo.safetensors", lora_factors(1))
    save_adapter(root / "style.safetensors", lora_factors(2, targets=["attn.to_out.0", "ff.net.2"]), alpha=None)
    return root


@pytest.fixture(scope="module")
def model() -> MiniMaxH3Transformer3DModel:
    return tiny_transformer(0)


# --- Reading a file: what the libraries convert, what we refuse -------------------------------------


def test_a_peft_dump_reads_as_its_factors_with_the_metadata_alpha(adapter_dir, model):
    lora = read_lora_file(adapter_dir / "turbo.safetensors", model)
    assert (lora.alpha, lora.alpha_source) == (8.0, AlphaSource.METADATA)
    # 4 blocks + 1 refiner block, 6 targets each, one A and one B per module
    assert len(lora.ranks) == 5 * 6 and set(lora.ranks.values()) == {RANK} and len(lora.factors) == 60
    assert torch.equal(lora.factors["transformer_blocks.2.ff.net.0.proj.lora_B.weight"],
                       lora_factors(1)["transformer_blocks.2.ff.net.0.proj.lora_B.weight"])


def test_a_file_declaring_no_alpha_gets_alpha_8_not_the_rank(adapter_dir, tmp_path):
    model = tiny_transformer(0)
    lora = read_lora_file(adapter_dir / "style.safetensors", model)
    assert (lora.alpha, lora.alpha_source) == (FALLBACK_ALPHA, AlphaSource.FALLBACK) and FALLBACK_ALPHA == 8.0
    install_adapter(model, "style", lora)
    assert model.transformer_blocks[0].attn.to_out[0].scaling["style"] == 8.0 / RANK


def test_a_native_layout_file_serves_the_same_model_as_its_diffusers_twin(tmp_path):
    """diffusers' conversion of native names (fc1 half-swapped) agrees with how model/weights.py maps the base."""
    factors = lora_factors(3, targets=["attn.to_out.0", "ff.net.0.proj", "ff.net.2"])
    native = save_adapter(tmp_path / "native.safetensors", native_factors(factors), prefix="diffusion_model.")
    twin = save_adapter(tmp_path / "diffusers.safetensors", factors)
    model = tiny_transformer(0)
    assert any(k.startswith("blocks.0.mlp.fc1") for k in native_factors(factors))
    a, b = read_lora_file(native, model), read_lora_file(twin, model)
    assert a.factors.keys() == b.factors.keys()
    assert all(torch.equal(a.factors[k], b.factors[k]) for k in a.factors)


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata=None) -> Path:
    save_file(tensors, str(path), metadata=metadata)
    return path


A = torch.zeros(RANK, 64, dtype=torch.bfloat16)  # tiny hidden 64 in
B = torch.zeros(64, RANK, dtype=torch.bfloat16)


@pytest.mark.parametrize("tensors, message", [
    ({"diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight": A,
      "diffusion_model.blocks.0.attn.qkv_proj.lora_B.weight": torch.zeros(192, RANK, dtype=torch.bfloat16)},
     "holds fused QKV factors ('diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight', 2 keys): a ComfyUI-style "
     "export"),
    ({"transformer.transformer_blocks.9.attn.to_q.lora_A.weight": A,
      "transformer.transformer_blocks.9.attn.to_q.lora_B.weight": B},
     "names no module of the MiniMax-H3 transformer ('transformer_blocks.9.attn.to_q')"),
    ({"transformer.transformer_blocks.0.adaln_proj.linear.lora_A.weight": torch.zeros(RANK, 32),
      "transformer.transformer_blocks.0.adaln_proj.linear.lora_B.weight": torch.zeros(1152, RANK)},
     "adapts 'transformer_blocks.0.adaln_proj.linear', an input of the AdaLN modulation"),
    ({"transformer.time_embedder.linear_1.lora_A.weight": torch.zeros(RANK, 32),
      "transformer.time_embedder.linear_1.lora_B.weight": torch.zeros(64, RANK)},
     "an input of the AdaLN modulation"),
    ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(RANK, 48, dtype=torch.bfloat16),
      "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": B},
     "'transformer_blocks.0.attn.to_q': lora_A (4, 48), lora_B (64, 4) do not fit the layer (64 x 64)"),
    ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": A,
      "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, RANK + 1, dtype=torch.bfloat16)},
     "do not fit the layer"),
    ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(RANK, 64, dtype=torch.int8),
      "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, RANK, dtype=torch.int8)},
     "is torch.int8; expected one of bf16, fp16, fp32"),
    ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": A},
     "'transformer_blocks.0.attn.to_q' has no lora_B factor"),
    ({"transformer.transformer_blocks.0.attn.norm_q.lora_A.weight": torch.zeros(RANK, 32),
      "transformer.transformer_blocks.0.attn.norm_q.lora_B.weight": torch.zeros(32, RANK)},
     "'transformer_blocks.0.attn.norm_q' is a RMSNorm, not a Linear layer"),
    ({"transformer_ref.transformer_blocks.0.attn.to_q.lora_A.weight": A,
      "transformer_ref.transformer_blocks.0.attn.to_q.lora_B.weight": B},
     "targets transformer_ref (the Ref2VA partition"),
], ids=["fused-qkv", "unknown-module", "adaln-proj", "time-embedder", "bad-A-shape", "bad-rank", "int-dtype",
        "missing-B", "norm", "ref2va"])
def test_a_file_the_server_cannot_serve_is_refused_naming_it(tmp_path, model, tensors, message):
    path = _write(tmp_path / "bad.safetensors", tensors)
    with pytest.raises(AdapterError) as info:
        read_lora_file(path, model)
    assert str(info.value).startswith(f"LoRA adapter {path}: ") and message in str(info.value)


def test_a_missing_or_unreadable_file_is_refused_naming_it(tmp_path, model):
    with pytest.raises(AdapterError, match=f"LoRA adapter {tmp_path / 'none.safetensors'}: no such file"):
        read_lora_file(tmp_path / "none.safetensors", model)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match=f"LoRA adapter {junk}: not a readable safetensors file"):
        read_lora_file(junk, model)


# --- The adapter set: LRU by bytes, one transformer -------------------------------------------------------


def test_a_set_holding_one_adapter_alternates_by_reloading_and_evicts_least_recently_used(adapter_dir, tmp_path):
    model = tiny_transformer(0)
    turbo = read_lora_file(adapter_dir / "turbo.safetensors", model).nbytes
    configs = EngineConfig(adapters={"turbo": {"path": str(adapter_dir / "turbo.safetensors")},
                                     "style": {"path": str(adapter_dir / "style.safetensors")}}).adapters
    adapters = AdapterSet(configs, turbo, model, None)
    assert adapters.held == ("turbo",)  # config order while they fit; style is read when named
    stats = adapters.apply((AdapterChoice(name="style"),))
    assert stats.loaded == ["style"] and adapters.held == ("style",) and installed_adapters(model) == {"style"}
    assert adapters.apply((AdapterChoice(name="style", scale=0.5),)).loaded == []
    assert adapters.apply(()) is None and adapters.held == ("style",)
    assert adapters.apply((AdapterChoice(name="turbo"),)).loaded == ["turbo"]
    adapters.check()
    with pytest.raises(AdapterError, match="together exceed engine.adapters_cache_mb"):
        adapters.apply((AdapterChoice(name="turbo"), AdapterChoice(name="style")))


def test_an_adapter_larger_than_the_cache_is_refused_at_start(adapter_dir, model):
    configs = EngineConfig(adapters={"turbo": {"path": str(adapter_dir / "turbo.safetensors")}}).adapters
    with pytest.raises(AdapterError, match="MB of factors exceed engine.adapters_cache_mb"):
        AdapterSet(configs, 1000, tiny_transformer(0), None)


# --- Requests: names, defaults, schedule key -------------------------------------------------------------


def small_request(**overrides) -> GenerationRequest:
    fields = dict(prompt="a red fox", steps=3, seconds=5.0, width=64, height=64, seed=11, return_video=False)
    return GenerationRequest(**{**fields, **overrides})


def test_request_adapters_are_at_most_two_distinct_names():
    with pytest.raises(ValidationError, match="adapters"):
        small_request(adapters=({"name": "a"}, {"name": "b"}, {"name": "c"}))
    with pytest.raises(ValidationError, match="names an adapter twice"):
        small_request(adapters=({"name": "a"}, {"name": "a", "scale": 0.5}))
    with pytest.raises(ValidationError, match="adapters.0.name"):
        small_request(adapters=({"name": "../etc/passwd"},))


# --- The engine: oracle, alternation, composition, fusion, offload, online AdaLN -----------------------------


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


def adapter_configs(adapter_dir: Path) -> dict:
    return {
        # A distilled-step adapter: 3 grid points and shift 6 unless the request says otherwise.
        "turbo": {"path": str(adapter_dir / "turbo.safetensors"), "steps": 3, "flow_shift": 6.0},
        "style": {"path": str(adapter_dir / "style.safetensors"), "scale": 0.5},
        "turbo-fused": {"path": str(adapter_dir / "turbo.safetensors"), "fuse": True},
    }


def make_engine(root: Path, adapter_dir: Path, **config) -> Engine:
    adaln = {"host_cache_gb": 0.01, **config.pop("adaln", {})}
    adapters = adapter_configs(adapter_dir)
    if config.get("offload", {}).get("enabled"):
        del adapters["turbo-fused"]  # fuse is not served with offload (engine.config)
    return Engine(EngineConfig(checkpoint_root=str(root), device="cpu", adaln=adaln, adapters=adapters, **config))


@pytest.fixture(scope="module")
def resident(checkpoint_root, adapter_dir) -> Engine:
    return make_engine(checkpoint_root, adapter_dir, adaln={"mode": "resident"})


@pytest.fixture(scope="module")
def offloaded(checkpoint_root, adapter_dir) -> Engine:
    """Online AdaLN (the plan cache) and layerwise offload: the adapters' factors resident beside streamed blocks."""
    return make_engine(checkpoint_root, adapter_dir, offload={"enabled": True})


def same_bits(a, b) -> bool:
    return torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio)


def diffusers_latents(engine: Engine, request: GenerationRequest, adapter: Path | None, scale: float = 1.0):
    """diffusers' own t2va denoise side on the engine's model (the seed-0 tiny transformer in its published dtypes,
    which the auto-made checkpoint holds), `adapter` loaded by the pipeline's `load_lora_weights` into its
    transformer, fed the engine's prompt embedding."""
    transformer = tiny_transformer(engine.config.checkpoint_seed)
    pipe = MiniMaxH3CoreDenoiseStep().init_pipeline()
    pipe.update_components(transformer=transformer, scheduler=MiniMaxH3Scheduler(shift=request.flow_shift),
                           audio_scheduler=MiniMaxH3Scheduler(shift=request.audio_flow_shift))
    if adapter is not None:
        pipe.load_lora_weights(str(adapter), adapter_name="oracle")
        transformer.set_adapters(["oracle"], [scale])
    embeds = engine.encode(request).embeds
    with torch.no_grad():
        out = pipe(prompt_embeds=embeds[None], text_token_tags=torch.full((embeds.shape[0],), TEXT_TAG),
                   height=request.height, width=request.width, num_frames=124, num_inference_steps=request.steps,
                   generator=torch.Generator("cpu").manual_seed(request.seed), output=["latents", "audio_latents"])
    return out["latents"][0], out["audio_latents"]


def test_an_adapter_request_is_bit_identical_to_diffusers_with_the_file_loaded(resident, adapter_dir):
    request = small_request(adapters=({"name": "turbo", "scale": 0.75},), flow_shift=6.0)
    ours = resident.generate(request)
    video, audio = diffusers_latents(resident, request, adapter_dir / "turbo.safetensors", scale=0.75)
    assert torch.equal(ours.video, video)
    assert torch.equal(audio_rows_to_channels(ours.audio, resident._checked(request)[0]), audio)
    assert ours.stats.adapters.scales == {"turbo": 0.75}


def test_requests_with_and_without_adapters_alternate_on_one_engine_each_with_its_own_bits(resident):
    plain, turbo = small_request(), small_request(adapters=({"name": "turbo", "scale": 1.0},), steps=3,
                                                  flow_shift=12.0)
    first_plain, first_turbo = resident.generate(plain), resident.generate(turbo)
    assert not same_bits(first_plain, first_turbo)  # the adapter changes the output
    assert first_plain.stats.adapters is None and "adapters" not in first_plain.stats.model_dump()
    for _ in range(2):
        assert same_bits(resident.generate(plain), first_plain)
        assert same_bits(resident.generate(turbo), first_turbo)
    resident.adapters.check()


def test_two_adapters_compose_and_their_scales_matter(resident):
    both = resident.generate(small_request(adapters=({"name": "turbo", "scale": 1.0}, {"name": "style"})))
    turbo = resident.generate(small_request(adapters=({"name": "turbo", "scale": 1.0},)))
    assert both.stats.adapters.scales == {"turbo": 1.0, "style": 0.5}  # style's configured scale
    assert not same_bits(both, turbo)
    stronger = resident.generate(small_request(adapters=({"name": "turbo", "scale": 1.0},
                                                         {"name": "style", "scale": 1.0})))
    assert not same_bits(both, stronger)


def test_an_adapters_defaults_fill_only_what_the_request_left_out(resident):
    served = resident.limits
    defaulted = with_adapter_defaults(GenerationRequest(prompt="a fox", adapters=({"name": "turbo"},)), served)
    assert (defaulted.steps, defaulted.flow_shift, defaulted.audio_flow_shift) == (3, 6.0, 3.0)
    explicit = with_adapter_defaults(GenerationRequest(prompt="a fox", steps=9, adapters=({"name": "turbo"},)),
                                     served)
    assert (explicit.steps, explicit.flow_shift) == (9, 6.0)
    out = resident.generate(GenerationRequest(prompt="a red fox", seconds=5.0, width=64, height=64, seed=11,
                                              return_video=False, adapters=({"name": "turbo"},)))
    assert (out.stats.steps, out.stats.forwards) == (3, 2)
    # The schedule key is the schedule's: an adapter changes which steps a request gets, never the key of them.
    assert out.stats.schedule_key == small_request(steps=3, flow_shift=6.0).schedule_key


def test_an_unknown_adapter_is_a_client_error_on_adapters_listing_the_served_ones(resident):
    with pytest.raises(ClientError) as info:
        resident.validate(small_request(adapters=({"name": "nope"},)))
    assert info.value.field == "adapters"
    assert "'nope' is not an adapter of this server (served: 'turbo', 'style', 'turbo-fused')" in str(info.value)
    assert [a["name"] for a in resident.describe()["limits"]["adapters"]] == ["turbo", "style", "turbo-fused"]


#: Fused (the delta added into the bf16 base weights once) vs unfused (the bf16 LoRA branch every forward) differ
#: by rounding only: each adapted layer's output lies within 2 bf16 steps (2 * 2^-8 of its largest value) of the
#: exact fp32 result either way; through the random tiny model's 2 forwards that grows to a max |difference| of
#: 0.29 in the latents (measured 2026-12-02), against a change of several units the adapter itself makes.
LAYER_BOUND_ULPS = 2
FUSED_MAX_ABS = 0.5


def test_fused_and_unfused_layers_are_both_the_exact_result_rounded_once(adapter_dir):
    model = tiny_transformer(0)
    install_adapter(model, "turbo", read_lora_file(adapter_dir / "turbo.safetensors", model))
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    layers = [model.transformer_blocks[0].attn.to_q, model.transformer_blocks[3].ff.net[0].proj]
    activate(model, {"turbo": 1.0})
    unfused = [layer(x).float() for layer in layers]
    exact = [torch.nn.functional.linear(
        x.float(), layer.base_layer.weight.float() + layer.get_delta_weight("turbo").float(),
        None if layer.base_layer.bias is None else layer.base_layer.bias.float()) for layer in layers]
    fuse_into_base_(model, "turbo", 1.0)
    activate(model, {})  # fused: the adapter inactive, its delta in the base weights
    fused = [layer(x).float() for layer in layers]
    for a, b, ref in zip(unfused, fused, exact):
        bound = LAYER_BOUND_ULPS * 2.0**-8 * ref.abs().max()
        assert (a - ref).abs().max() <= bound and (b - ref).abs().max() <= bound
        assert not torch.equal(a, b)  # not the same computation: a bound, not equality, is what is promised


def test_fused_equals_unfused_within_the_bound_and_unfusing_gives_the_checkpoint_bits_back(resident):
    plain = resident.generate(small_request())
    unfused = resident.generate(small_request(adapters=({"name": "turbo", "scale": 1.0},)))
    fused = resident.generate(small_request(adapters=({"name": "turbo-fused", "scale": 1.0},)))
    assert fused.stats.adapters.fused == "turbo-fused"
    difference = max((fused.video - unfused.video).abs().max().item(), (fused.audio - unfused.audio).abs().max().item())
    effect = max((plain.video - unfused.video).abs().max().item(), (plain.audio - unfused.audio).abs().max().item())
    assert 0 < difference <= FUSED_MAX_ABS and difference < effect / 4, (difference, effect)
    # Fused with an unfused adapter on top: both count.
    composed = resident.generate(small_request(adapters=({"name": "turbo-fused", "scale": 1.0}, {"name": "style"})))
    assert composed.stats.adapters.fused == "turbo-fused" and not same_bits(composed, fused)
    # A request without it gets the checkpoint's own bits: the base weights were read again, not subtracted.
    assert resident.adapters.fused == "turbo-fused"
    assert same_bits(resident.generate(small_request()), plain)
    assert resident.adapters.fused is None
    weights = TransformerWeights(resident.checkpoint.transformer_dir, resident.checkpoint.layout)
    base = resident.transformer.transformer_blocks[1].attn.to_q.get_base_layer().weight
    assert torch.equal(base, weights.tensor("transformer_blocks.1.attn.to_q.weight"))


def test_offload_with_an_adapter_gives_the_resident_bits_and_keeps_the_factors_resident(offloaded, resident):
    request = small_request(adapters=({"name": "turbo", "scale": 1.0}, {"name": "style"}), steps=4)
    out = offloaded.generate(request)
    assert same_bits(out, resident.generate(request))
    assert out.stats.offload.h2d_bytes > 0
    # The factors are not among the offloader's streamed tensors: they stay on the device beside its placeholders.
    streamed = set(offloaded.offloader.block_state(0))
    assert streamed and not any("lora" in name for name in streamed)
    layer = offloaded.transformer.transformer_blocks[0].attn.to_q
    assert layer.lora_A["turbo"].weight.numel() > 0 and layer.lora_A["turbo"].weight.device.type == "cpu"
    offloaded.offloader.check_invariants()


def test_an_adapter_request_hits_the_plans_built_without_it(offloaded):
    request = small_request(steps=5, flow_shift=7.0)  # a schedule no other test builds
    first = offloaded.generate(request)
    assert first.stats.adaln.built_plans > 0
    with_adapter = offloaded.generate(request.model_copy(update={"adapters": (AdapterChoice(name="turbo"),)}))
    plans = first.stats.adaln.built_plans + first.stats.adaln.gpu_hit_plans + first.stats.adaln.host_hit_plans
    assert (with_adapter.stats.adaln.built_plans, with_adapter.stats.adaln.host_hit_plans) == (0, 0)
    assert with_adapter.stats.adaln.gpu_hit_plans == plans
    assert not same_bits(first, with_adapter)


def test_a_configured_adapter_file_that_is_missing_stops_the_engine_naming_it(checkpoint_root, tmp_path):
    missing = tmp_path / "gone.safetensors"
    with pytest.raises(AdapterError, match=f"LoRA adapter {missing}: no such file"):
        Engine(EngineConfig(checkpoint_root=str(checkpoint_root), device="cpu", adaln={"mode": "resident"},
                            adapters={"gone": {"path": str(missing)}}))


def test_a_weight_update_keeps_the_adapters_installed(resident, adapter_dir, tmp_path):
    # Updating to the checkpoint it already serves: every base weight rewritten under the LoRA layers.
    before = resident.generate(small_request(adapters=({"name": "turbo", "scale": 1.0},)))
    resident.update_weights(resident.checkpoint.root)
    assert same_bits(resident.generate(small_request(adapters=({"name": "turbo", "scale": 1.0},))), before)
    resident.adapters.check()


def test_a_weight_update_runs_the_adapters_on_the_new_transformer_and_one_they_would_not_fit_is_refused(
        checkpoint_root, adapter_dir, tmp_path):
    # The adapters are not checked again after an update: the update's own check (before anything is written)
    # holds the new transformer to the served config, tensor names, shapes and dtypes, which is all an adapter's
    # check reads, and the weights are written into the same modules. A transformer an adapter would not fit
    # (another shape of an adapted to_q) is refused there.
    engine = make_engine(checkpoint_root, adapter_dir, adaln={"mode": "resident"})
    request = small_request(adapters=({"name": "turbo", "scale": 1.0},))
    before = engine.generate(request)
    with pytest.raises(WeightsRejected, match=f"shape mismatch for tensor '{WRONG_SHAPE_TENSOR}'"):
        engine.update_weights(with_wrong_shape(engine.checkpoint.root, tmp_path / "wrong"))
    assert same_bits(engine.generate(request), before)

    new = finetune_of(engine.checkpoint.root, tmp_path / "seed1")
    engine.update_weights(new)
    engine.adapters.check()
    after = engine.generate(request)
    fresh = Engine(EngineConfig(checkpoint=str(new), device="cpu", adaln={"mode": "resident"},
                                adapters=adapter_configs(adapter_dir)))
    assert same_bits(after, fresh.generate(request))  # the adapter on the new base weights, as a fresh start has it
    assert not same_bits(after, before) and not same_bits(after, engine.generate(small_request()))


def test_cache_dit_wrapping_the_blocks_serves_adapters_as_the_plain_engine_does(checkpoint_root, adapter_dir, resident):
    cache_dit = {"enabled": True, "Fn_compute_blocks": 1, "Bn_compute_blocks": 1, "max_warmup_steps": 1,
                 "residual_diff_threshold": 0.15, "max_continuous_cached_steps": 2}
    cached = make_engine(checkpoint_root, adapter_dir, adaln={"mode": "resident"}, cache_dit=cache_dit)
    request = small_request(adapters=({"name": "turbo", "scale": 1.0},))
    off = cached.generate(small_request(adapters=({"name": "turbo", "scale": 1.0},), cache_dit={"enabled": False}))
    assert same_bits(off, resident.generate(request))
    assert cached.generate(small_request(adapters=({"name": "turbo"},), steps=9)).stats.cache_dit.cached_steps


def test_the_tiny_adapter_cli_writes_a_file_the_server_reads(tmp_path, model):
    from model.tiny_adapter import main
    assert main(["--out", str(tmp_path / "tiny.safetensors"), "--seed", "5", "--rank", "2", "--alpha", "4"]) == 0
    lora = read_lora_file(tmp_path / "tiny.safetensors", model)
    assert (lora.alpha, set(lora.ranks.values()), len(lora.ranks)) == (4.0, {2}, 30)


def test_an_empty_path_is_a_seeded_tiny_adapter_made_once_under_the_checkpoint_root(tmp_path, model):
    config = EngineConfig(checkpoint_root=str(tmp_path / "a"), adapters={"turbo-tiny": {"path": ""}})
    path = ensure_adapter(config, "turbo-tiny")
    assert path == auto_adapter_path(config, "turbo-tiny") == tmp_path / "a" / "adapters" / "tiny-turbo-tiny.safetensors"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    lora = read_lora_file(path, model)  # every check the engine's start makes
    assert (lora.alpha, set(lora.ranks.values()), len(lora.ranks)) == (8.0, {RANK}, 30)
    mtime = path.stat().st_mtime_ns
    assert ensure_adapter(config, "turbo-tiny") == path and path.stat().st_mtime_ns == mtime  # reused, not remade
    # Seeded from the name alone: another root (another replica, a restart) makes the same bytes; another name not.
    again = ensure_adapter(EngineConfig(checkpoint_root=str(tmp_path / "b")), "turbo-tiny")
    assert again.read_bytes() == path.read_bytes()
    assert ensure_adapter(config, "style").read_bytes() != path.read_bytes()


def test_an_empty_adapter_path_beside_a_real_checkpoint_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ValidationError, match=r"engine\.adapters\.turbo-tiny\.path is empty"):
        EngineConfig(checkpoint=str(tmp_path / "h3"), adapters={"turbo-tiny": {"steps": 5}})
    settings = SimpleNamespace(checkpoint=str(tmp_path / "h3"), checkpoint_root=str(tmp_path), preset="tiny")
    with pytest.raises(ValueError, match=r"engine\.adapters\.turbo-tiny\.path is empty"):
        ensure_adapter(settings, "turbo-tiny")
    assert not (tmp_path / "adapters").exists()


def test_an_engine_serves_an_auto_made_adapter_at_its_steps(checkpoint_root, resident):
    engine = Engine(EngineConfig(checkpoint_root=str(checkpoint_root), device="cpu", adaln={"mode": "resident"},
                                 adapters={"turbo-tiny": {"path": "", "steps": 4}}))
    assert engine.adapters.held == ("turbo-tiny",)
    result = engine.generate(GenerationRequest(prompt="a red fox", seconds=5.0, width=64, height=64, seed=11,
                                               return_video=False, adapters=({"name": "turbo-tiny"},)))
    assert (result.stats.steps, result.stats.forwards) == (4, 3)
    assert result.stats.adapters.scales == {"turbo-tiny": 1.0}
    assert not same_bits(result, resident.generate(small_request(steps=4)))


@pytest.mark.parametrize("previous", [{"turbo": 0.3}, {}], ids=["after-turbo", "after-none"])
@pytest.mark.parametrize("scales", [{}, {"turbo": 1.0}, {"style": 0.5}, {"turbo": 0.7, "style": -1.5}])
def test_activate_sets_every_peft_layer_as_diffusers_set_adapters_does(adapter_dir, previous, scales):
    """`activate` walks the peft layers found once instead of diffusers' two walks of every module per switch;
    every layer ends in diffusers' state: enabled or not, active names, scalings, which factors require grad."""
    ours, theirs = tiny_transformer(0), tiny_transformer(0)
    for model in (ours, theirs):
        for name in ("turbo", "style"):
            install_adapter(model, name, read_lora_file(adapter_dir / f"{name}.safetensors", model))
        activate(model, previous)  # a previous request's state, then this one's
    activate(ours, scales)
    if scales:
        theirs.enable_lora()
        theirs.set_adapters(list(scales), list(scales.values()))
    else:
        theirs.disable_lora()

    def state(model):
        return {n: (m.disable_adapters, tuple(m.active_adapters), dict(m.scaling),
                    {p: q.requires_grad for p, q in m.named_parameters() if "lora_" in p})
                for n, m in model.named_modules() if hasattr(m, "scaling")}

    assert state(ours) == state(theirs) and len(state(ours)) == 5 * 6
