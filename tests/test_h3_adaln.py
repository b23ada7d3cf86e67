"""AdaLN of diffusers' MiniMaxH3Transformer3DModel served from precomputed rows (model/adaln.py) and from the plan
cache (cache/plan_cache.py), bit for bit against the plain diffusers forward.

Tiny transformer (seams.md, `model.tiny`): hidden 64, 4 blocks, time_embed_dim 32, so adaln_width = 3*6*64 = 1152,
final_adaln_width = 2*64 = 128 and one host page (one plan row) is (4*1152 + 128) bf16 = 9472 bytes. Blocks
bf16, the 12 published fp32 tensors (patch projections, timestep MLP, output heads) fp32. Checkpoints are
real ones written by `model.tiny.make_tiny_checkpoint` in both layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from safetensors.torch import load_file, save_file

from cache.config import GB, AdalnConfig
from cache.plan_cache import PlanCache, ResidentModulation, WeightUpdateError
from cache.plan_key import plan_key
from model.adaln import (
    ExternalModulation,
    H3Adaln,
    Modulation,
    ModulationError,
    adaln_input,
    resident_modulation,
)
from model.layout import H3Checkpoint, Layout
from model.loading import load_transformer
from model.schedule import H3Schedule, StepPlan
from model.tiny import make_tiny_checkpoint
from model.weights import TransformerWeights, adaln_unit_names, is_adaln_param

NUM_BLOCKS, ADALN_WIDTH, FINAL_WIDTH = 4, 1152, 128
PAGE_BYTES = (NUM_BLOCKS * ADALN_WIDTH + FINAL_WIDTH) * 2

#: Distinct timesteps of a forward with M = 1, 2, 3: one shared level; video and audio; plus a keyframe at 0.999.
TIMESTEPS = {1: [0.0], 2: [0.25, 0.5], 3: [0.25, 0.5, 0.999]}


def open_weights(root: Path) -> TransformerWeights:
    checkpoint = H3Checkpoint.open(root)
    return TransformerWeights(checkpoint.transformer_dir, checkpoint.layout)


@dataclass
class Served:
    """One checkpoint, served online: its reader and a transformer built without AdaLN weights."""

    root: Path
    weights: TransformerWeights
    transformer: MiniMaxH3Transformer3DModel
    external: ExternalModulation


def serve_online(root: Path) -> Served:
    weights = open_weights(root)
    transformer = load_transformer(weights, "cpu", skip=is_adaln_param)  # adaln params stay on meta
    return Served(root, weights, transformer, ExternalModulation.install(transformer))


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[Layout, Path]:
    """The seed-0 tiny checkpoint in both layouts (the same model)."""
    base = tmp_path_factory.mktemp("h3")
    return {layout: make_tiny_checkpoint(base / layout.value, layout, seed=0, components=False) for layout in Layout}


@pytest.fixture(scope="module")
def resident(roots) -> MiniMaxH3Transformer3DModel:
    """The reference: the plain diffusers transformer with every weight, from the diffusers layout."""
    return load_transformer(open_weights(roots[Layout.DIFFUSERS]), "cpu")


@pytest.fixture(scope="module")
def online(roots) -> dict[Layout, Served]:
    return {layout: serve_online(root) for layout, root in roots.items()}


def packed_inputs(timesteps: list[float] | torch.Tensor, video_index: int = 0, audio_index: int | None = None,
                  keyframe_index: int | None = None) -> dict[str, torch.Tensor]:
    """One packed sequence [text 3 | audio 4 | video 2x2x2 patches] for the distinct `timesteps`: text and video
    rows at `video_index`, audio rows at `audio_index` (default: the last timestep), and the first video frame
    (a keyframe) at `keyframe_index` if given."""
    timesteps = torch.as_tensor(timesteps, dtype=torch.float32)
    audio_index = timesteps.numel() - 1 if audio_index is None else audio_index
    g = torch.Generator().manual_seed(timesteps.numel())
    num_text, num_audio, grid = 3, 4, (2, 2, 2)
    num_video = grid[0] * grid[1] * grid[2]
    tags = torch.tensor([1] * num_text + [2] * num_audio + [0] * num_video)
    timestep_indices = torch.full((tags.shape[0],), video_index, dtype=torch.int64)
    timestep_indices[num_text: num_text + num_audio] = audio_index
    if keyframe_index is not None:
        timestep_indices[num_text + num_audio: num_text + num_audio + grid[1] * grid[2]] = keyframe_index
    video_positions = torch.cartesian_prod(*(torch.arange(n) for n in grid))
    audio_positions = torch.stack([torch.arange(num_audio), torch.zeros(num_audio, dtype=torch.int64),
                                   torch.zeros(num_audio, dtype=torch.int64)], dim=1)
    position_ids = torch.cat([torch.zeros(num_text, 3, dtype=torch.int64), audio_positions, video_positions])
    return dict(
        hidden_states=torch.randn(1, num_video, 96, generator=g),
        audio_hidden_states=torch.randn(1, num_audio, 32, generator=g),
        encoder_hidden_states=torch.randn(1, num_text, 32, generator=g),
        timestep=timesteps, timestep_indices=timestep_indices, token_tags=tags, position_ids=position_ids,
        video_indices=torch.arange(num_text + num_audio, num_text + num_audio + num_video),
        audio_indices=torch.arange(num_text, num_text + num_audio), text_indices=torch.arange(num_text),
    )


def step_inputs(step: StepPlan) -> dict[str, torch.Tensor]:
    return packed_inputs(step.timesteps, step.video_index, step.audio_index)


def forward(transformer: MiniMaxH3Transformer3DModel, inputs: dict[str, torch.Tensor]):
    with torch.no_grad():
        return transformer(**inputs, return_dict=False)


def step_modulation(transformer: MiniMaxH3Transformer3DModel, timesteps) -> Modulation:
    return resident_modulation(transformer, adaln_input(transformer, torch.as_tensor(timesteps)))


def assert_same_modulation(got: Modulation, want: Modulation, what: str) -> None:
    assert torch.equal(got.blocks, want.blocks), f"{what}: block modulation differs"
    assert torch.equal(got.final, want.final), f"{what}: final modulation differs"


# ---------------------------------------------------------------------------------------------------------
# The split of diffusers' AdaLN path (model/adaln.py)
# ---------------------------------------------------------------------------------------------------------


def test_checkpoint_has_the_published_dtypes(resident):
    fp32 = sorted(name for name, p in resident.named_parameters() if p.dtype == torch.float32)
    assert fp32 == sorted(f"{module}.{leaf}" for module in (
        "proj_in", "audio_proj_in", "time_embedder.linear_1", "time_embedder.linear_2", "proj_out", "audio_proj_out",
    ) for leaf in ("weight", "bias"))
    assert {p.dtype for name, p in resident.named_parameters() if name not in fp32} == {torch.bfloat16}


def test_adaln_input_is_what_every_projection_receives(resident):
    timesteps = torch.tensor([0.25, 0.5])
    x = adaln_input(resident, timesteps)
    assert (x.dtype, tuple(x.shape)) == (torch.bfloat16, (2, 32))
    with torch.no_grad():
        temb = resident.time_embedder(resident.time_proj(timesteps))  # fp32, as diffusers' forward computes it
    assert temb.dtype == torch.float32
    assert torch.equal(x, torch.nn.functional.silu(temb).to(torch.bfloat16))


def test_resident_modulation_is_each_modules_own_output(resident):
    timesteps = torch.tensor(TIMESTEPS[3])
    modulation = step_modulation(resident, timesteps)
    assert tuple(modulation.blocks.shape) == (NUM_BLOCKS, 3, ADALN_WIDTH) and modulation.num_rows == 3
    assert tuple(modulation.final.shape) == (3, FINAL_WIDTH) and modulation.final.dtype == torch.bfloat16
    with torch.no_grad():
        temb = resident.time_embedder(resident.time_proj(timesteps))
        for i, block in enumerate(resident.transformer_blocks):
            chunks = block.adaln_proj(temb)   # six [M*3, hidden] tensors, the block's own call
            assert torch.equal(torch.cat(chunks, dim=-1).reshape(3, ADALN_WIDTH), modulation.blocks[i])
        final = resident.norm_out.linear(torch.nn.functional.silu(temb).to(torch.bfloat16))
    assert torch.equal(final, modulation.final)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("num_timesteps", [1, 2, 3])
def test_external_modulation_forward_equals_diffusers_forward(resident, online, layout, num_timesteps):
    served = online[layout]
    inputs = packed_inputs(TIMESTEPS[num_timesteps], keyframe_index=2 if num_timesteps == 3 else None)
    want_video, want_audio = forward(resident, inputs)
    served.external.set(step_modulation(resident, inputs["timestep"]))
    got_video, got_audio = forward(served.transformer, inputs)
    assert (got_video.dtype, tuple(got_video.shape), tuple(got_audio.shape)) == (torch.float32, (1, 8, 96), (1, 4, 32))
    assert torch.equal(got_video, want_video) and torch.equal(got_audio, want_audio)


def test_installed_transformer_holds_no_adaln_weights(online):
    transformer = online[Layout.DIFFUSERS].transformer
    names = [name for name, _ in transformer.named_parameters()]
    assert [n for n in names if is_adaln_param(n) or ".adaln_proj." in n] == []
    assert not any(p.is_meta for p in transformer.parameters())  # the meta adaln params went with their modules
    assert "norm_out.norm.weight" in names and "transformer_blocks.3.norm2.weight" in names
    assert [n for n in transformer.state_dict() if "dtype_marker" in n] == []  # markers are not weights


def test_a_forward_without_set_raises(resident, online):
    served = online[Layout.DIFFUSERS]
    inputs = packed_inputs(TIMESTEPS[2])
    served.external.clear()
    with pytest.raises(RuntimeError, match=r"ExternalModulation.set\(modulation\) before each forward"):
        forward(served.transformer, inputs)
    served.external.set(step_modulation(resident, inputs["timestep"]))
    forward(served.transformer, inputs)
    with pytest.raises(RuntimeError, match="before each forward"):  # one set serves exactly one forward
        forward(served.transformer, inputs)


def test_rows_for_another_timestep_count_are_refused(resident, online):
    served = online[Layout.DIFFUSERS]
    served.external.set(step_modulation(resident, TIMESTEPS[2]))
    with pytest.raises(RuntimeError, match="3 distinct timesteps but the modulation set for it has 2 rows"):
        forward(served.transformer, packed_inputs(TIMESTEPS[3]))
    served.external.clear()


def test_set_checks_shape_and_dtype(resident, online):
    external = online[Layout.DIFFUSERS].external
    good = step_modulation(resident, TIMESTEPS[2])
    with pytest.raises(ModulationError, match=r"expected \[4, 2, 1152\] / \[2, 128\]"):
        external.set(Modulation(good.blocks[:3], good.final))
    with pytest.raises(ModulationError, match=r"expected \[4, 2, 1152\] / \[2, 128\]"):
        external.set(Modulation(good.blocks, good.final[:, :64]))
    with pytest.raises(ModulationError, match="AdaLN dtype is torch.bfloat16"):
        external.set(Modulation(good.blocks.float(), good.final.float()))


def test_install_twice_and_resident_projection_after_install_are_errors(online):
    transformer = online[Layout.DIFFUSERS].transformer
    with pytest.raises(RuntimeError, match="already installed"):
        ExternalModulation.install(transformer)
    with pytest.raises(RuntimeError, match="no AdaLN weights"):
        resident_modulation(transformer, torch.zeros(1, 32, dtype=torch.bfloat16))


def test_h3_adaln_describes_resident_and_online_transformers_alike(resident, online):
    for transformer in (resident, online[Layout.NATIVE].transformer):
        view = H3Adaln(transformer)
        assert (view.num_blocks, view.time_embed_dim, view.adaln_width, view.final_adaln_width, view.torch_dtype) \
            == (NUM_BLOCKS, 32, ADALN_WIDTH, FINAL_WIDTH, torch.bfloat16)
        assert view.unit_names()[0] == ("transformer_blocks.0.adaln_proj.linear", 0)
        assert view.unit_names()[-1] == ("norm_out.linear", None)
    with pytest.raises(TypeError, match="MiniMaxH3Transformer3DModel"):
        H3Adaln(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------------------
# The plan cache serving the transformer (cache/plan_cache.py)
# ---------------------------------------------------------------------------------------------------------

#: A real H3 schedule: 5 grid points = 4 forwards; forward 0 has one timestep (0.0 for video and audio), the
#: others two (video, audio), ascending.
SCHEDULE = H3Schedule.build(5)
#: Another schedule (video shift 6) whose plans share nothing with SCHEDULE's but forward 0's (to evict them).
OTHER = H3Schedule.build(5, video_shift=6.0)


def online_cache(served: Served, **settings) -> PlanCache:
    config = dict(gpu_plans=4, plan_width=2, host_cache_gb=0.0, readers=2, read_chunk_mb=1) | settings
    return PlanCache(AdalnConfig(**config), served.weights, served.transformer, "cpu")


def test_the_schedules_used_here_have_h3s_plan_shapes():
    assert [p.numel() for p in SCHEDULE.plans] == [1, 2, 2, 2]
    assert SCHEDULE.plans[0].tolist() == [0.0]
    assert all(bool((p[1:] > p[:-1]).all()) for p in SCHEDULE.plans)   # distinct, ascending
    assert len({tuple(p.tolist()) for p in SCHEDULE.plans + OTHER.plans}) == 1 + 3 + 3


def adaln_bytes(weights: TransformerWeights) -> int:
    """Bytes of every AdaLN tensor in the checkpoint: what one rebuild pass reads."""
    return sum(weights.location(f"{unit}.{part}").nbytes
               for unit, _ in adaln_unit_names(NUM_BLOCKS) for part in ("weight", "bias"))


@pytest.mark.parametrize("layout", list(Layout))
def test_online_rebuild_serves_the_diffusers_forward_bit_for_bit(resident, online, layout):
    served = online[layout]
    cache = online_cache(served)
    with cache.prepare(SCHEDULE.plans) as prepared:
        assert prepared.stats.built_plans == 4
        # 4 blocks x (1152x32 + 1152) bf16 + final (128x32 + 128) bf16
        assert prepared.stats.rebuild_bytes_read == adaln_bytes(served.weights) == 4 * 76032 + 8448
        for i, step in enumerate(SCHEDULE.steps):
            modulation = prepared.modulation(i)
            assert_same_modulation(modulation, step_modulation(resident, step.timesteps), f"step {i}")
            inputs = step_inputs(step)
            served.external.set(modulation)
            got, want = forward(served.transformer, inputs), forward(resident, inputs)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"step {i}: velocity differs"


@pytest.mark.parametrize("projection", ["match", "fp32"])
def test_resident_provider_and_online_cache_agree(resident, online, projection):
    """ResidentModulation projects through the transformer's own weights; online rebuilds from the native
    layout; both are equal under either projection setting (fp32: both project in fp32 and cast)."""
    reference = ResidentModulation(AdalnConfig(mode="resident", projection=projection), resident)
    cache = online_cache(online[Layout.NATIVE], projection=projection)
    with cache.prepare(SCHEDULE.plans) as prepared, reference.prepare(SCHEDULE.plans) as expected:
        for i in range(SCHEDULE.num_forwards):
            assert_same_modulation(prepared.modulation(i), expected.modulation(i), f"step {i}")


def test_resident_mode_needs_the_adaln_weights(online):
    with pytest.raises(ValueError, match="adaln.mode=resident needs the model's AdaLN weights"):
        ResidentModulation(AdalnConfig(mode="resident"), online[Layout.DIFFUSERS].transformer)
    never_loaded = load_transformer(online[Layout.DIFFUSERS].weights, "cpu", skip=is_adaln_param)
    with pytest.raises(ValueError, match="needs the model's AdaLN weights: .* on meta"):
        ResidentModulation(AdalnConfig(mode="resident"), never_loaded)
    with pytest.raises(RuntimeError, match="built without its AdaLN weights"):
        step_modulation(never_loaded, [0.5])


@pytest.mark.parametrize("layout", list(Layout))
def test_host_tier_restore_equals_the_rebuild(online, layout):
    served = online[layout]
    cache = online_cache(served, host_cache_gb=13 * PAGE_BYTES / GB)  # both groups: 7 rows each, 1 shared
    with cache.prepare(SCHEDULE.plans) as built:
        assert (built.stats.built_plans, built.stats.host_stored_plans) == (4, 4)
        rebuilt = [built.modulation(i) for i in range(SCHEDULE.num_forwards)]
    cache.prepare(OTHER.plans).release()       # forward 0's plan hits; 3 new ones evict SCHEDULE's other 3
    with cache.prepare(SCHEDULE.plans) as again:
        assert (again.stats.gpu_hit_plans, again.stats.host_hit_plans, again.stats.built_plans) == (1, 3, 0)
        assert again.stats.h2d_bytes == 3 * 2 * PAGE_BYTES   # 3 plans of 2 rows
        for i in range(SCHEDULE.num_forwards):
            assert_same_modulation(again.modulation(i), rebuilt[i], f"step {i}")


def write_misshaped_adaln(root: Path, name: str) -> None:
    """Rewrite the shard holding diffusers tensor `name` so that it has one column too few."""
    weights = open_weights(root)
    stored, path = weights.source(name).name, weights.location(name).path
    tensors = load_file(path)
    tensors[stored] = tensors[stored][:, :-1].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("layout", list(Layout))
def test_update_with_a_misshaped_adaln_tensor_is_rejected_before_anything_changes(online, layout, tmp_path):
    served = serve_online(make_tiny_checkpoint(tmp_path / "serving", layout, seed=0, components=False))
    cache = online_cache(served, gpu_plans=5, host_cache_gb=7 * PAGE_BYTES / GB)
    cache.prepare(SCHEDULE.plans).release()
    version, reader = cache.weights_version, cache.reader
    bad = make_tiny_checkpoint(tmp_path / "bad", layout, seed=1, components=False)
    write_misshaped_adaln(bad, "transformer_blocks.2.adaln_proj.linear.weight")
    with pytest.raises(WeightUpdateError, match=r"transformer_blocks\.2\.adaln_proj\.linear\.weight in .* is "
                                                r"torch.bfloat16 \[1152, 31\], expected torch.bfloat16 \[1152, 32\]"):
        cache.validate_weight_update_source(bad)
    with pytest.raises(WeightUpdateError, match="rejected weight update"):
        cache.refresh_weight_derived_caches(bad)
    # Nothing changed: same version and reader, every plan still in the slab and in the host tier.
    assert (cache.weights_version, cache.reader) == (version, reader)
    again = cache.prepare(SCHEDULE.plans)
    assert (again.stats.gpu_hit_plans, again.stats.built_plans) == (4, 0)
    again.release()
    keys = [plan_key(p, version) for p in SCHEDULE.plans]
    assert cache.host.lookup(keys) == keys


@pytest.mark.parametrize("layout", list(Layout))
def test_update_from_another_checkpoint_rebuilds_from_it(resident, layout, tmp_path):
    served = serve_online(make_tiny_checkpoint(tmp_path / "serving", layout, seed=0, components=False))
    cache = online_cache(served)
    cache.prepare(SCHEDULE.plans).release()
    new_root = make_tiny_checkpoint(tmp_path / "seed1", layout, seed=1, components=False)
    new_weights = open_weights(new_root)
    cache.validate_weight_update_source(new_root)
    with torch.no_grad():                            # the engine's weight write: every weight it holds
        for name, param in served.transformer.named_parameters():
            param.copy_(new_weights.tensor(name))
    cache.refresh_weight_derived_caches(new_root)
    new_resident = load_transformer(new_weights, "cpu")
    with cache.prepare(SCHEDULE.plans) as fresh:
        assert (fresh.stats.gpu_hit_plans, fresh.stats.built_plans) == (0, 4)
        for i, step in enumerate(SCHEDULE.steps):
            assert_same_modulation(fresh.modulation(i), step_modulation(new_resident, step.timesteps), f"step {i}")
    assert not torch.equal(step_modulation(new_resident, [0.0]).final, step_modulation(resident, [0.0]).final)


def test_on_cuda_online_rebuild_and_host_restore_equal_the_resident_forward(roots):
    """The CPU tests above, on a GPU: cuBLAS picks kernels by shape and alignment, so this is where a rebuild
    that projected differently from the resident nn.Linear would show."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    resident = load_transformer(open_weights(roots[Layout.DIFFUSERS]), "cuda")
    for layout in Layout:
        weights = open_weights(roots[layout])
        transformer = load_transformer(weights, "cuda", skip=is_adaln_param)
        external = ExternalModulation.install(transformer)
        for projection in ("match", "fp32"):
            reference = ResidentModulation(AdalnConfig(mode="resident", projection=projection), resident)
            cache = PlanCache(AdalnConfig(gpu_plans=4, plan_width=2, host_cache_gb=13 * PAGE_BYTES / GB, readers=2,
                                          read_chunk_mb=1, projection=projection), weights, transformer, "cuda")
            built = cache.prepare(SCHEDULE.plans)
            expected = reference.prepare(SCHEDULE.plans)
            for i, step in enumerate(SCHEDULE.steps):
                what = f"{layout.value} {projection} step {i}"
                assert_same_modulation(built.modulation(i), expected.modulation(i), what)
                if projection == "match":
                    inputs = {name: tensor.cuda() for name, tensor in step_inputs(step).items()}
                    external.set(built.modulation(i))
                    got, want = forward(transformer, inputs), forward(resident, inputs)
                    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"{what}: velocity differs"
            built.release()
            cache.prepare(OTHER.plans).release()
            with cache.prepare(SCHEDULE.plans) as restored:
                assert (restored.stats.host_hit_plans, restored.stats.built_plans) == (3, 0)
                for i in range(SCHEDULE.num_forwards):
                    assert_same_modulation(restored.modulation(i), expected.modulation(i), f"{layout.value} restored")
            cache.close()
