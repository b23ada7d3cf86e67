"""The DiT: shapes and parameter counts, determinism, AdaLN modulation seams, block contract, text embedder."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.config import PRESET_NAMES, TAG_AUDIO, TAG_TEXT, TAG_VIDEO, DiTConfig, preset
from model.dit import DiT, Modulation, is_adaln_proj, patchify, unpatchify
from model.sampler import FlowMatchSchedule, StepTimesteps, euler_step
from model.text import ByteTextEmbedder, TextEncoder

# --- parameter counts ---------------------------------------------------------------------------------------


def expected_param_counts(c: DiTConfig) -> tuple[int, int]:
    """(total, adaln_proj) parameters, written out from the architecture description."""

    def linear(fan_in, fan_out, bias=True):
        return fan_in * fan_out + (fan_out if bias else 0)

    h, a, t = c.hidden, c.attn_dim, c.time_embed_dim
    core = 3 * linear(h, a) + linear(a, h) + linear(h, 2 * c.ffn, False) + linear(c.ffn, h, False) + 2 * h
    w = c.text_embedder_width
    text = 257 * w + (c.max_text_tokens + 1) * w + c.text_embedder_layers * 2 * linear(w, w) + linear(w, c.text_dim)
    adaln = c.num_blocks * linear(t, 18 * h) + linear(t, 2 * h)
    total = (
        text + linear(c.text_dim, h) + c.num_refiner_blocks * core
        + linear(c.patch_dim, h) + linear(c.audio_channels, h) + linear(c.freq_dim, h) + linear(h, t)
        + c.num_blocks * core + h + adaln + linear(h, c.patch_dim) + linear(h, c.audio_channels)
    )
    return total, adaln


def count(model: DiT) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    adaln = sum(p.numel() for n, p in model.named_parameters() if is_adaln_proj(n))
    return total, adaln


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_param_count_matches_architecture_for_every_preset(name):
    config = preset(name)
    assert count(DiT(config, device="meta")) == expected_param_counts(config)


def test_h3_on_meta_has_33_1b_params_of_which_13_0b_adaln():
    total, adaln = count(DiT(preset("h3"), device=torch.device("meta")))
    assert total == pytest.approx(33.1e9, rel=0.01)
    assert adaln == pytest.approx(13.0e9, rel=0.01)
    # One block's adaln_proj: 2688 x 96768 + bias = 260.1 M params.
    assert preset("h3").time_embed_dim * preset("h3").adaln_width + preset("h3").adaln_width == 260_209_152


def test_dtypes_bf16_blocks_and_fp32_island(tiny_model):
    dtypes = {n: p.dtype for n, p in tiny_model.named_parameters()}
    for name, dtype in dtypes.items():
        fp32 = name.split(".")[0] in ("time_embed", "video_in", "audio_in", "video_out", "audio_out", "text_embedder")
        assert dtype == (torch.float32 if fp32 else torch.bfloat16), name


def test_parameters_never_require_grad(tiny_model):
    assert not any(p.requires_grad for p in tiny_model.parameters())


# --- determinism --------------------------------------------------------------------------------------------


def test_same_seed_gives_bitwise_identical_parameters(tiny_config, tiny_model):
    other = DiT(tiny_config, seed=0)
    for (name, a), b in zip(tiny_model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name


def test_different_seed_gives_different_parameters(tiny_config, tiny_model):
    other = DiT(tiny_config, seed=1)
    assert not torch.equal(tiny_model.blocks[0].attn.q.weight, other.blocks[0].attn.q.weight)


def test_forward_twice_is_bitwise_identical_and_finite(tiny_model, tiny_inputs):
    step = StepTimesteps.from_sigmas(0.7, 0.4)
    v1, a1 = tiny_model.velocity(*tiny_inputs, step)
    v2, a2 = tiny_model.velocity(*tiny_inputs, step)
    assert torch.equal(v1, v2) and torch.equal(a1, a2)
    assert v1.shape == tiny_inputs[0].shape and a1.shape == tiny_inputs[1].shape
    assert v1.dtype == a1.dtype == torch.float32
    assert torch.isfinite(v1).all() and torch.isfinite(a1).all()


def test_50_block_random_model_stays_finite():
    config = preset("tiny", num_blocks=50)
    model = DiT(config, seed=3)
    video = torch.randn(config.video_channels, 1, 4, 4)
    v, a = model.velocity(video, torch.randn(3, config.audio_channels), torch.randn(2, config.text_dim),
                          StepTimesteps.from_sigmas(1.0, 1.0))
    assert torch.isfinite(v).all() and torch.isfinite(a).all()
    assert v.abs().max() < 100


def test_euler_sampling_loop_runs_and_stays_finite(tiny_model, tiny_inputs):
    video, audio, text = tiny_inputs
    schedule = FlowMatchSchedule(4, shift=3.0, audio_shift=5.0)
    for i in range(schedule.steps):
        v_video, v_audio = tiny_model.velocity(video, audio, text, schedule.step(i))
        video = euler_step(video, v_video, schedule.sigmas_video[i], schedule.sigmas_video[i + 1])
        audio = euler_step(audio, v_audio, schedule.sigmas_audio[i], schedule.sigmas_audio[i + 1])
    assert torch.isfinite(video).all() and torch.isfinite(audio).all()


# --- AdaLN modulation ---------------------------------------------------------------------------------------


def test_adaln_input_is_model_dtype_with_one_row_per_timestep(tiny_model, tiny_config):
    x = tiny_model.adaln_input(torch.tensor([0.9, 0.3]))
    assert x.shape == (2, tiny_config.time_embed_dim) and x.dtype == torch.bfloat16


def test_resident_modulation_equals_each_adaln_proj_applied_to_the_same_m_rows(tiny_model, tiny_config):
    adaln_input = tiny_model.adaln_input(torch.tensor([0.9, 0.3]))
    mod = tiny_model.resident_modulation(adaln_input)
    assert mod.blocks.shape == (tiny_config.num_blocks, 2, tiny_config.adaln_width)
    assert mod.final.shape == (2, tiny_config.final_adaln_width)
    for i, block in enumerate(tiny_model.blocks):
        assert torch.equal(mod.blocks[i], block.adaln_proj(adaln_input))
    assert torch.equal(mod.final, tiny_model.final.adaln_proj(adaln_input))


def test_rows_are_timestep_index_times_3_plus_tag(tiny_model, tiny_inputs):
    video, audio, text = tiny_inputs
    packed = tiny_model.prepare(video, audio, text, StepTimesteps.from_sigmas(0.8, 0.5))  # video 0, audio 1
    n_text, n_audio = text.shape[0], audio.shape[0]
    n_video = video.shape[1] * video.shape[2] * video.shape[3] // 4  # patch (1, 2, 2)
    assert packed.tags.tolist() == [TAG_TEXT] * n_text + [TAG_AUDIO] * n_audio + [TAG_VIDEO] * n_video
    # Text uses the video timestep (index 0): rows 0*3+1; audio 1*3+2; video 0*3+0.
    assert packed.rows.tolist() == [1] * n_text + [5] * n_audio + [0] * n_video
    assert packed.final_rows.tolist() == [0] * n_text + [1] * n_audio + [0] * n_video
    packed = tiny_model.prepare(video, audio, text, StepTimesteps.from_sigmas(0.5, 0.5))  # M = 1
    assert packed.rows.tolist() == [1] * n_text + [2] * n_audio + [0] * n_video


def test_block_applies_each_tokens_own_modality_and_timestep_chunks(tiny_model, tiny_inputs, tiny_config):
    step = StepTimesteps.from_sigmas(0.8, 0.5)
    packed = tiny_model.prepare(*tiny_inputs, step)
    mod = tiny_model.resident_modulation(tiny_model.adaln_input(step.timesteps))
    block = tiny_model.blocks[1]
    out = block(packed.tokens, ctx=packed.context(mod))

    # Reference: look up each token's 6 chunks by hand in [M, 3 modalities, 6, hidden].
    table = mod.blocks[1].reshape(step.num_rows, 3, 6, tiny_config.hidden)
    chunks = torch.stack([table[m, tag] for m, tag in zip(packed.timestep_index.tolist(), packed.tags.tolist())])
    shift1, scale1, gate1, shift2, scale2, gate2 = chunks.unbind(1)  # each [N, hidden]
    x = packed.tokens
    x = x + gate1 * block.attn(block.norm1(x) * (1 + scale1) + shift1, (packed.rope_cos, packed.rope_sin))
    x = x + gate2 * block.mlp(block.norm2(x) * (1 + scale2) + shift2)
    assert torch.equal(out, x)


def test_final_modulation_row_follows_the_tokens_timestep(tiny_model, tiny_inputs):
    step = StepTimesteps.from_sigmas(0.8, 0.5)
    mod = tiny_model.resident_modulation(tiny_model.adaln_input(step.timesteps))
    v_video, v_audio = tiny_model(*tiny_inputs, step, mod)
    final = mod.final.clone()
    final[1] += 1.0  # only the audio timestep's row
    v_video2, v_audio2 = tiny_model(*tiny_inputs, step, Modulation(mod.blocks, final))
    assert torch.equal(v_video, v_video2)
    assert not torch.equal(v_audio, v_audio2)


def test_modulation_with_too_few_rows_is_rejected(tiny_model, tiny_inputs):
    mod = tiny_model.resident_modulation(tiny_model.adaln_input(torch.tensor([0.8])))
    with pytest.raises(ValueError, match="rows"):
        tiny_model(*tiny_inputs, StepTimesteps.from_sigmas(0.8, 0.5), mod)


# --- with_adaln=False ----------------------------------------------------------------------------------------


def test_without_adaln_the_model_has_no_adaln_modules(tiny_config, tiny_model):
    bare = DiT(tiny_config, with_adaln=False, seed=0)
    assert not any("adaln" in n for n, _ in bare.named_modules())
    assert not any(is_adaln_proj(n) for n in bare.state_dict())
    assert count(bare)[0] == count(tiny_model)[0] - count(tiny_model)[1]
    with pytest.raises(RuntimeError, match="with_adaln=False"):
        bare.resident_modulation(bare.adaln_input(torch.tensor([0.5])))


def test_without_adaln_forward_with_supplied_modulation_equals_resident_model(tiny_config, tiny_model, tiny_inputs):
    bare = DiT(tiny_config, with_adaln=False, seed=0)
    step = StepTimesteps.from_sigmas(0.6, 0.2)
    mod = tiny_model.resident_modulation(tiny_model.adaln_input(step.timesteps))
    v_ref, a_ref = tiny_model.velocity(*tiny_inputs, step)
    v, a = bare(*tiny_inputs, step, mod)
    assert torch.equal(v, v_ref) and torch.equal(a, a_ref)


# --- block contract (offload, cache-dit) --------------------------------------------------------------------


def test_blocks_are_a_module_list_and_know_their_index(tiny_model):
    assert isinstance(tiny_model.blocks, torch.nn.ModuleList)
    assert [b.index for b in tiny_model.blocks] == list(range(len(tiny_model.blocks)))


def test_blocks_never_modify_their_input_in_place(tiny_model, tiny_inputs):
    step = StepTimesteps.from_sigmas(0.6, 0.2)
    packed = tiny_model.prepare(*tiny_inputs, step)
    ctx = packed.context(tiny_model.resident_modulation(tiny_model.adaln_input(step.timesteps)))
    x = packed.tokens
    for block in tiny_model.blocks:
        before, version = x.clone(), x._version
        out = block(x, ctx=ctx)
        assert x._version == version and torch.equal(x, before)
        assert out.data_ptr() != x.data_ptr()
        x = out


# --- inputs --------------------------------------------------------------------------------------------------


def test_patchify_then_unpatchify_is_identity():
    video = torch.randn(3, 4, 6, 8)
    tokens, grid = patchify(video, (2, 2, 2))
    assert tokens.shape == (2 * 3 * 4, 3 * 8) and grid == (2, 3, 4)
    assert torch.equal(unpatchify(tokens, grid, (2, 2, 2), 3), video)


def test_video_not_divisible_by_patch_is_rejected(tiny_model, tiny_inputs):
    video, audio, text = tiny_inputs
    with pytest.raises(ValueError, match="patch"):
        tiny_model.velocity(video[:, :, :7], audio, text, StepTimesteps.from_sigmas(0.5))


def test_empty_audio_is_allowed(tiny_model, tiny_inputs, tiny_config):
    video, _, text = tiny_inputs
    v, a = tiny_model.velocity(video, torch.zeros(0, tiny_config.audio_channels), text, StepTimesteps.from_sigmas(0.5))
    assert a.shape == (0, tiny_config.audio_channels) and torch.isfinite(v).all()


# --- text ----------------------------------------------------------------------------------------------------


def test_byte_embedder_is_a_text_encoder_with_one_token_per_byte_plus_bos(tiny_model, tiny_config):
    embedder = tiny_model.text_embedder
    assert isinstance(embedder, ByteTextEmbedder) and isinstance(embedder, TextEncoder)
    states = embedder.encode("héllo")  # é is 2 UTF-8 bytes
    assert states.shape == (1 + 6, tiny_config.text_dim) and states.dtype == torch.float32
    assert embedder.encode("").shape == (1, tiny_config.text_dim)
    assert not torch.equal(embedder.encode("ab"), embedder.encode("ba"))  # order matters


def test_text_embedder_rejects_prompt_longer_than_max_text_tokens(tiny_model, tiny_config):
    limit = tiny_config.max_text_tokens
    assert tiny_model.text_embedder.encode("x" * limit).shape[0] == limit + 1
    with pytest.raises(ValueError, match=f"max_text_tokens={limit}"):
        tiny_model.text_embedder.encode("x" * (limit + 1))
    with pytest.raises(ValueError, match=f"max_text_tokens={limit}"):
        tiny_model.text_embedder.encode("é" * (limit // 2 + 1))  # counted in bytes


def test_modulation_is_a_dataclass_with_blocks_and_final():
    assert [f.name for f in dataclasses.fields(Modulation)] == ["blocks", "final"]


def test_standalone_byte_embedder_equals_the_dits_submodule(tiny_config, tiny_model):
    standalone = ByteTextEmbedder(tiny_config, seed=0)
    assert torch.equal(standalone.encode("a red fox"), tiny_model.text_embedder.encode("a red fox"))
