"""AdaLN of diffusers' MiniMaxH3Transformer3DModel served from precomputed rows (model/adaln.py) and rebuilt by the
plan cache's streaming readers (cache/rebuild.py), bit for bit against the plain diffusers forward.

Tiny transformer (`model.tiny`, numbers in tests/adaln_support.py): 4 blocks, adaln_width 1152, final 128, one host
page 9472 bytes; blocks bf16, the 12 published fp32 tensors (patch projections, timestep MLP, output heads) fp32.
Checkpoints are real ones written by `model.tiny.make_tiny_checkpoint` in both layouts (the `tiny` and
`tiny_native` fixtures). A "small" transformer (8 blocks, hidden 256) has AdaLN units of 2.4 MB, so the
rebuild's 1 MiB reads really split one unit over several readers.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel

from cache.config import AdalnConfig
from cache.plan_cache import PlanCache, ResidentModulation
from cache.rebuild import _Files, resolve_adaln_units
from cache.residency import page_cache_bytes
from model.adaln import ExternalModulation, H3Adaln, Modulation, ModulationError, adaln_input, resident_modulation
from model.layout import Layout
from model.loading import load_transformer
from model.schedule import H3Schedule, StepPlan
from model.tiny import TINY_TRANSFORMER, tiny_transformer
from model.weights import H3TransformerConfig, TransformerWeights, adaln_unit_names, is_adaln_param, parameter_specs
from tests.adaln_support import (
    ADALN_WIDTH, FINAL_WIDTH, NUM_BLOCKS, TINY_ADALN_BYTES, Models, assert_equal_to_resident, assert_same_modulation,
    host_gb, online_cache, resident, resident_rows,
)

#: Distinct timesteps of a forward with M = 1, 2, 3: one shared level; video and audio; plus a keyframe at 0.999.
TIMESTEPS = {1: [0.0], 2: [0.25, 0.5], 3: [0.25, 0.5, 0.999]}
#: A real H3 schedule: 5 grid points = 4 forwards; forward 0 has one timestep (0.0 for video and audio), the
#: others two (video, audio), ascending.
SCHEDULE = H3Schedule.build(5)
#: Another schedule (video shift 6) whose plans share nothing with SCHEDULE's but forward 0's (to evict them).
OTHER = H3Schedule.build(5, video_shift=6.0)
#: 12 forwards: widths 1, 2, 2, ... (both GEMM shapes).
LONG = H3Schedule.build(13)


@pytest.fixture(params=list(Layout), ids=lambda layout: layout.value)
def served(request) -> Models:
    """The shared seed-0 tiny checkpoint, in each layout."""
    return request.getfixturevalue("tiny" if request.param is Layout.DIFFUSERS else "tiny_native")


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


# ---------------------------------------------------------------------------------------------------------
# The split of diffusers' AdaLN path (model/adaln.py)
# ---------------------------------------------------------------------------------------------------------


def test_released_h3_keeps_13_0b_of_its_33_1b_parameters_in_adaln_projections():
    """Why online mode exists: H3's AdaLN projections are 39% of the transformer (on meta, no memory)."""
    specs = parameter_specs(H3TransformerConfig())
    total = sum(math.prod(spec.shape) for spec in specs.values())
    adaln = sum(math.prod(spec.shape) for name, spec in specs.items() if is_adaln_param(name))
    assert (total, adaln) == (33_122_992_896, 13_039_369_728)
    # One block's adaln_proj.linear: [96768, 2688] + bias; the final norm_out.linear: [10752, 2688] + bias.
    assert adaln == 50 * (96768 * 2688 + 96768) + (10752 * 2688 + 10752)
    assert (len(specs), sum(spec.dtype == torch.float32 for spec in specs.values())) == (638, 12)


def test_checkpoint_has_the_published_dtypes(tiny):
    fp32 = sorted(name for name, p in tiny.resident.named_parameters() if p.dtype == torch.float32)
    assert fp32 == sorted(f"{module}.{leaf}" for module in (
        "proj_in", "audio_proj_in", "time_embedder.linear_1", "time_embedder.linear_2", "proj_out", "audio_proj_out",
    ) for leaf in ("weight", "bias"))
    assert {p.dtype for name, p in tiny.resident.named_parameters() if name not in fp32} == {torch.bfloat16}


def test_adaln_input_is_what_every_projection_receives(tiny):
    resident = tiny.resident
    timesteps = torch.tensor([0.25, 0.5])
    x = adaln_input(resident, timesteps)
    assert (x.dtype, tuple(x.shape)) == (torch.bfloat16, (2, 32))
    with torch.no_grad():
        temb = resident.time_embedder(resident.time_proj(timesteps))  # fp32, as diffusers' forward computes it
    assert temb.dtype == torch.float32
    assert torch.equal(x, torch.nn.functional.silu(temb).to(torch.bfloat16))
    with pytest.raises(ModulationError, match="1-D float32"):
        adaln_input(resident, timesteps.double())


def test_resident_modulation_is_each_modules_own_output(tiny):
    resident = tiny.resident
    timesteps = torch.tensor(TIMESTEPS[3])
    modulation = resident_rows(resident, timesteps)
    assert tuple(modulation.blocks.shape) == (NUM_BLOCKS, 3, ADALN_WIDTH) and modulation.num_rows == 3
    assert tuple(modulation.final.shape) == (3, FINAL_WIDTH) and modulation.final.dtype == torch.bfloat16
    with torch.no_grad():
        temb = resident.time_embedder(resident.time_proj(timesteps))
        for i, block in enumerate(resident.transformer_blocks):
            chunks = block.adaln_proj(temb)   # six [M*3, hidden] tensors, the block's own call
            assert torch.equal(torch.cat(chunks, dim=-1).reshape(3, ADALN_WIDTH), modulation.blocks[i])
        final = resident.norm_out.linear(torch.nn.functional.silu(temb).to(torch.bfloat16))
    assert torch.equal(final, modulation.final)


@pytest.mark.parametrize("num_timesteps", [1, 2, 3])
def test_external_modulation_forward_equals_diffusers_forward(tiny, served, num_timesteps):
    inputs = packed_inputs(TIMESTEPS[num_timesteps], keyframe_index=2 if num_timesteps == 3 else None)
    want_video, want_audio = forward(tiny.resident, inputs)
    served.external.set(resident_rows(tiny.resident, inputs["timestep"]))
    got_video, got_audio = forward(served.online, inputs)
    assert (got_video.dtype, tuple(got_video.shape), tuple(got_audio.shape)) == (torch.float32, (1, 8, 96), (1, 4, 32))
    assert torch.equal(got_video, want_video) and torch.equal(got_audio, want_audio)


def test_final_rows_follow_each_tokens_timestep(tiny):
    """Video rows read the final modulation row of the video timestep (index 0), audio rows that of the audio
    timestep (index 1): changing one row moves exactly one head's output."""
    inputs = packed_inputs(TIMESTEPS[2])
    rows = resident_rows(tiny.resident, inputs["timestep"])
    tiny.external.set(rows)
    video, audio = forward(tiny.online, inputs)
    for changed in (0, 1):
        final = rows.final.clone()
        final[changed] += 1.0
        tiny.external.set(Modulation(rows.blocks, final))
        got_video, got_audio = forward(tiny.online, inputs)
        assert torch.equal(got_video, video) is (changed == 1)
        assert torch.equal(got_audio, audio) is (changed == 0)


def test_installed_transformer_holds_no_adaln_weights(tiny):
    transformer = tiny.online
    names = [name for name, _ in transformer.named_parameters()]
    assert [n for n in names if is_adaln_param(n) or ".adaln_proj." in n] == []
    assert not any(p.is_meta for p in transformer.parameters())  # the meta adaln params went with their modules
    assert "norm_out.norm.weight" in names and "transformer_blocks.3.norm2.weight" in names
    assert [n for n in transformer.state_dict() if "dtype_marker" in n] == []  # markers are not weights
    assert not any(p.requires_grad for p in transformer.parameters())


def test_a_forward_without_set_raises(tiny):
    inputs = packed_inputs(TIMESTEPS[2])
    tiny.external.clear()
    with pytest.raises(RuntimeError, match=r"ExternalModulation.set\(modulation\) before each forward"):
        forward(tiny.online, inputs)
    tiny.external.set(resident_rows(tiny.resident, inputs["timestep"]))
    forward(tiny.online, inputs)
    with pytest.raises(RuntimeError, match="before each forward"):  # one set serves exactly one forward
        forward(tiny.online, inputs)


def test_rows_for_another_timestep_count_are_refused(tiny):
    tiny.external.set(resident_rows(tiny.resident, TIMESTEPS[2]))
    with pytest.raises(RuntimeError, match="3 distinct timesteps but the modulation set for it has 2 rows"):
        forward(tiny.online, packed_inputs(TIMESTEPS[3]))
    tiny.external.clear()


@pytest.mark.parametrize("rows, timesteps", [(3, 2), (1, 2), (2, 3)])
def test_compiled_blocks_refuse_rows_of_another_count_before_they_run(tiny, rows, timesteps):
    """Compiled, a block's row count is symbolic (one graph for every count): each block's forward pre-hook checks
    it outside the graph, so fewer rows than timesteps is the same clear error, not an out-of-range gather."""
    from engine.compiled import CompiledBlocks, CompileOptions

    online = load_transformer(tiny.reader, "cpu", skip=is_adaln_param)  # its own: compiling wraps its blocks
    external = ExternalModulation.install(online)
    CompiledBlocks(online.transformer_blocks, CompileOptions(backend="eager"), external).apply()
    external.set(resident_rows(tiny.resident, TIMESTEPS[rows]))
    with pytest.raises(RuntimeError, match=f"{timesteps} distinct timesteps but the modulation set for it has "
                                           f"{rows} rows"):
        forward(online, packed_inputs(TIMESTEPS[timesteps]))
    external.set(resident_rows(tiny.resident, TIMESTEPS[timesteps]))
    forward(online, packed_inputs(TIMESTEPS[timesteps]))


def test_set_checks_shape_and_dtype(tiny):
    good = resident_rows(tiny.resident, TIMESTEPS[2])
    with pytest.raises(ModulationError, match=r"expected \[4, 2, 1152\] / \[2, 128\]"):
        tiny.external.set(Modulation(good.blocks[:3], good.final))
    with pytest.raises(ModulationError, match=r"expected \[4, 2, 1152\] / \[2, 128\]"):
        tiny.external.set(Modulation(good.blocks, good.final[:, :64]))
    with pytest.raises(ModulationError, match="AdaLN dtype is torch.bfloat16"):
        tiny.external.set(Modulation(good.blocks.float(), good.final.float()))


def test_install_twice_and_resident_projection_after_install_are_errors(tiny):
    with pytest.raises(RuntimeError, match="already installed"):
        ExternalModulation.install(tiny.online)
    with pytest.raises(RuntimeError, match="no AdaLN weights"):
        resident_modulation(tiny.online, torch.zeros(1, 32, dtype=torch.bfloat16))


def test_h3_adaln_describes_resident_and_online_transformers_alike(tiny, tiny_native):
    for transformer in (tiny.resident, tiny_native.online):
        view = H3Adaln(transformer)
        assert (view.num_blocks, view.time_embed_dim, view.adaln_width, view.final_adaln_width, view.torch_dtype) \
            == (NUM_BLOCKS, 32, ADALN_WIDTH, FINAL_WIDTH, torch.bfloat16)
        assert view.unit_names() == adaln_unit_names(NUM_BLOCKS)
        assert view.unit_names()[0] == ("transformer_blocks.0.adaln_proj.linear", 0)
        assert view.unit_names()[-1] == ("norm_out.linear", None)
    with pytest.raises(TypeError, match="MiniMaxH3Transformer3DModel"):
        H3Adaln(torch.nn.Linear(2, 2))


def test_resident_mode_needs_the_adaln_weights(tiny):
    with pytest.raises(ValueError, match="adaln.mode=resident needs the model's AdaLN weights"):
        ResidentModulation(AdalnConfig(mode="resident"), tiny.online)
    never_loaded = load_transformer(tiny.reader, "cpu", skip=is_adaln_param)
    with pytest.raises(ValueError, match="needs the model's AdaLN weights: .* on meta"):
        ResidentModulation(AdalnConfig(mode="resident"), never_loaded)
    with pytest.raises(RuntimeError, match="built without its AdaLN weights"):
        resident_rows(never_loaded, [0.5])


# ---------------------------------------------------------------------------------------------------------
# The plan cache's rebuild and host tier serving the transformer (cache/plan_cache.py, cache/rebuild.py)
# ---------------------------------------------------------------------------------------------------------


def test_the_schedules_used_here_have_h3s_plan_shapes():
    assert [p.numel() for p in SCHEDULE.plans] == [1, 2, 2, 2]
    assert SCHEDULE.plans[0].tolist() == [0.0]
    assert all(bool((p[1:] > p[:-1]).all()) for p in SCHEDULE.plans)   # distinct, ascending
    assert len({tuple(p.tolist()) for p in SCHEDULE.plans + OTHER.plans}) == 1 + 3 + 3
    assert [p.numel() for p in LONG.plans] == [1] + [2] * 11


def test_online_rebuild_serves_the_diffusers_forward_bit_for_bit(tiny, served):
    cache = online_cache(served)
    with cache.prepare(SCHEDULE.plans) as prepared:
        assert prepared.stats.built_plans == 4
        # 4 blocks x (1152x32 + 1152) bf16 + final (128x32 + 128) bf16, in either layout
        assert prepared.stats.rebuild_bytes_read == TINY_ADALN_BYTES == 4 * 76032 + 8448
        for i, step in enumerate(SCHEDULE.steps):
            modulation = prepared.modulation(i)
            assert_same_modulation(modulation, resident_rows(tiny.resident, step.timesteps), f"step {i}")
            inputs = step_inputs(step)
            served.external.set(modulation)
            got, want = forward(served.online, inputs), forward(tiny.resident, inputs)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"step {i}: velocity differs"


@pytest.mark.parametrize("projection", ["match", "fp32"])
def test_resident_provider_and_online_cache_agree(tiny, tiny_native, projection):
    """ResidentModulation projects through the transformer's own weights; online rebuilds from the native
    layout; both are equal under either projection setting (fp32: both project in fp32 and cast)."""
    cache = online_cache(tiny_native, projection=projection)
    with cache.prepare(LONG.plans[:4]) as prepared:
        assert_equal_to_resident(prepared, resident(tiny, projection), LONG.plans[:4])


@pytest.mark.parametrize("readers,chunk_mb,buffers,direct_io", [
    (1, 1, 2, "never"), (3, 1, 3, "auto"), (16, 32, 2, "always"), (4, 1, 2, "always"),
])
def test_every_reader_pipeline_setting_rebuilds_the_resident_rows(tiny, readers, chunk_mb, buffers, direct_io):
    cache = online_cache(tiny, gpu_plans=16, readers=readers, read_chunk_mb=chunk_mb, staging_buffers=buffers,
                         direct_io=direct_io, direct_chunk_mb=chunk_mb)
    prepared = cache.prepare(LONG.plans)
    assert prepared.stats.built_plans == 12
    weight_path = str(tiny.reader.location("norm_out.linear.weight").path)
    direct_possible = _Files("always").direct_fd(weight_path) is not None
    # "always": 4 blocks + final, all through O_DIRECT where the filesystem allows it; "auto": the page cache
    # holds the freshly written checkpoint, so nothing is.
    expected_direct = 5 if direct_io == "always" and direct_possible else 0
    assert cache.rebuilder.num_direct_units == expected_direct
    assert_equal_to_resident(prepared, resident(tiny), LONG.plans)


def evict(path: Path, start: int = 0, length: int = 0) -> None:
    """Drop `length` bytes (0: to the end) of `path` from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def is_cached(path: Path, offset: int) -> bool:
    """Whether the page holding byte `offset` of `path` is in the page cache (mincore: a probe that reads
    nothing, so it starts no read-ahead that would cache what it asks about)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        cached = page_cache_bytes(fd, offset, 1)
    finally:
        os.close(fd)
    if cached is None:
        pytest.skip("mincore is not available here")
    return cached == 1


def test_units_not_in_the_page_cache_are_read_with_o_direct(tiny, tmp_path):
    cold_root = Path(shutil.copytree(tiny.path, tmp_path / "cold"))
    reader = TransformerWeights(cold_root / "transformer", Layout.DIFFUSERS)
    reader.fingerprint  # reads a few pages of every tensor (as serving does before its first rebuild)...
    for shard in (cold_root / "transformer").glob("*.safetensors"):
        evict(shard)    # ...then the checkpoint goes cold
    files = _Files("auto")
    cold = [u for u in resolve_adaln_units(reader, reader.config, adaln_unit_names(NUM_BLOCKS))
            if not files.cached(u.weight)]
    if not cold or files.direct_fd(str(cold[0].weight.path)) is None:
        pytest.skip("cannot evict the copy from the page cache or open it with O_DIRECT here")
    cache = online_cache(tiny, reader=reader, direct_io="auto")
    plans = LONG.plans[:3]
    prepared = cache.prepare(plans)
    assert cache.rebuilder.num_direct_units == len(cold)
    assert_equal_to_resident(prepared, resident(tiny), plans)


def test_a_unit_is_cold_although_fingerprinting_cached_its_first_middle_and_last_page(small, tmp_path):
    """`TransformerWeights.fingerprint` reads the first, middle and last page of every tensor; direct_io=auto
    must still see the rest of a unit cold, or a cold rebuild would never use O_DIRECT."""
    reader = small[0]
    span = resolve_adaln_units(reader, H3Adaln(small[1]), adaln_unit_names(8))[0].weight
    path = Path(shutil.copy(span.path, tmp_path / "shard.safetensors"))
    evict(path)
    if is_cached(path, span.offset + span.nbytes // 8):
        pytest.skip("cannot evict pages from the page cache here")
    # Cache only the fingerprinted pages, as a fingerprint of a cold file does. Reading the whole file and then
    # evicting around them would not do: the kernel may hold a file in large folios, which a partial
    # POSIX_FADV_DONTNEED cannot split, so the neighbours of a kept page would stay cached with it.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: each read caches its own page
        kept = [span.offset + at for at in (0, (span.nbytes - 64) // 2, span.nbytes - 64)]
        for offset in kept:
            os.pread(fd, 64, offset)
    finally:
        os.close(fd)
    assert [is_cached(path, p) for p in kept] == [True, True, True]   # what a start/middle/end probe would see
    assert not any(is_cached(path, span.offset + span.nbytes * eighth // 8) for eighth in (1, 3, 5, 7))
    assert not _Files("auto").cached(dataclasses.replace(span, path=str(path)))


def test_host_tier_restore_equals_the_rebuild(served):
    cache = online_cache(served, host_cache_gb=host_gb(13))  # both groups: 7 rows each, 1 shared
    with cache.prepare(SCHEDULE.plans) as built:
        assert (built.stats.built_plans, built.stats.host_stored_plans) == (4, 4)
        rebuilt = [built.modulation(i) for i in range(SCHEDULE.num_forwards)]
    cache.prepare(OTHER.plans).release()       # forward 0's plan hits; 3 new ones evict SCHEDULE's other 3
    with cache.prepare(SCHEDULE.plans) as again:
        assert (again.stats.gpu_hit_plans, again.stats.host_hit_plans, again.stats.built_plans) == (1, 3, 0)
        assert again.stats.h2d_bytes == 3 * 2 * 9472   # 3 plans of 2 rows
        for i in range(SCHEDULE.num_forwards):
            assert_same_modulation(again.modulation(i), rebuilt[i], f"step {i}")


# --- small: AdaLN units larger than one read --------------------------------------------------------------

SMALL = TINY_TRANSFORMER.model_copy(update=dict(hidden_size=256, attention_head_dim=128, ffn_dim=512,
                                                num_layers=8, time_embed_hidden_dim=256, time_embed_dim=256))
SMALL_PAGE_BYTES = (8 * 18 * 256 + 2 * 256) * 2   # 74752


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[TransformerWeights, MiniMaxH3Transformer3DModel, MiniMaxH3Transformer3DModel]:
    """A seeded 8-block transformer saved by diffusers as one file: (reader, online, resident)."""
    transformer_dir = tmp_path_factory.mktemp("small") / "transformer"
    tiny_transformer(seed=0, config=SMALL).save_pretrained(transformer_dir)
    reader = TransformerWeights(transformer_dir, Layout.DIFFUSERS)
    online = load_transformer(reader, "cpu", skip=is_adaln_param)
    ExternalModulation.install(online)
    return reader, online, load_transformer(reader, "cpu")


def test_small_units_are_split_over_readers_and_rebuild_and_restore_bit_exactly(small):
    reader, online, resident_small = small
    unit = resolve_adaln_units(reader, H3Adaln(online), adaln_unit_names(8))[0]
    assert unit.weight.nbytes == 4608 * 256 * 2 > 2 * (1 << 20)   # three 1 MiB reads per unit
    reference = ResidentModulation(AdalnConfig(mode="resident"), resident_small)
    plans = H3Schedule.build(7).plans               # 6 plans, widths 1, 2, 2, 2, 2, 2 = 11 pages
    others = H3Schedule.build(6).plans[1:]          # 4 other plans = 8 pages: both groups fit 24 pages
    for direct_io in ("never", "always"):
        cache = PlanCache(AdalnConfig(gpu_plans=6, plan_width=2, readers=4, read_chunk_mb=1, direct_chunk_mb=1,
                                      direct_io=direct_io, host_cache_gb=host_gb(24, SMALL_PAGE_BYTES)),
                          reader, online, "cpu")
        built = cache.prepare(plans)
        assert built.stats.built_plans == 6
        assert_equal_to_resident(built, reference, plans)
        built.release()
        cache.prepare(others).release()             # evicts the 4 least recently used (plans 0..3)
        restored = cache.prepare(plans)
        stats = restored.stats
        assert (stats.gpu_hit_plans, stats.host_hit_plans, stats.built_plans) == (2, 4, 0)
        assert stats.h2d_bytes == (1 + 3 * 2) * SMALL_PAGE_BYTES
        assert_equal_to_resident(restored, reference, plans)
        restored.release()
        cache.close()


# ---------------------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------------------


def test_on_cuda_online_rebuild_and_host_restore_equal_the_resident_forward(tiny, tiny_native, small):
    """The CPU tests above, on a GPU: cuBLAS picks kernels by shape and alignment, so this is where a rebuild
    that projected differently from the resident nn.Linear would show."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    resident_cuda = load_transformer(tiny.reader, "cuda")
    for models in (tiny, tiny_native):
        weights = models.reader
        transformer = load_transformer(weights, "cuda", skip=is_adaln_param)
        external = ExternalModulation.install(transformer)
        for projection in ("match", "fp32"):
            reference = ResidentModulation(AdalnConfig(mode="resident", projection=projection), resident_cuda)
            cache = PlanCache(AdalnConfig(gpu_plans=4, plan_width=2, host_cache_gb=host_gb(13), readers=2,
                                          read_chunk_mb=1, projection=projection), weights, transformer, "cuda")
            assert cache.host.pinned
            built = cache.prepare(SCHEDULE.plans)
            expected = reference.prepare(SCHEDULE.plans)
            for i, step in enumerate(SCHEDULE.steps):
                what = f"{weights.layout.value} {projection} step {i}"
                assert_same_modulation(built.modulation(i), expected.modulation(i), what)
                if projection == "match":
                    inputs = {name: tensor.cuda() for name, tensor in step_inputs(step).items()}
                    external.set(built.modulation(i))
                    got, want = forward(transformer, inputs), forward(resident_cuda, inputs)
                    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"{what}: velocity differs"
            built.release()
            cache.prepare(OTHER.plans).release()
            with cache.prepare(SCHEDULE.plans) as restored:
                assert (restored.stats.host_hit_plans, restored.stats.built_plans) == (3, 0)
                for i in range(SCHEDULE.num_forwards):
                    assert_same_modulation(restored.modulation(i), expected.modulation(i),
                                           f"{weights.layout.value} {projection} restored step {i}")
            cache.close()
    reader, _, _ = small
    online = load_transformer(reader, "cuda", skip=is_adaln_param)
    reference = ResidentModulation(AdalnConfig(mode="resident"), load_transformer(reader, "cuda"))
    cache = PlanCache(AdalnConfig(gpu_plans=12, plan_width=2, host_cache_gb=0.5, readers=4), reader, online, "cuda")
    built = cache.prepare(LONG.plans)
    assert built.stats.built_plans == 12
    assert_equal_to_resident(built, reference, LONG.plans)
    built.release()
    cache.slab.index.invalidate()                    # forget the GPU copies: restore from pinned pages
    with cache.prepare(LONG.plans) as restored:
        assert restored.stats.host_hit_plans == 12
        assert_equal_to_resident(restored, reference, LONG.plans)
    cache.close()
