"""Online rebuild == resident projection, bit for bit (torch.equal on every plan), for tiny and small."""

import os
import shutil

import pytest
import torch

from cache.rebuild import _Files, resolve_adaln_units
from model.checkpoint import CheckpointReader
from model.sampler import FlowMatchSchedule, StepTimesteps
from tests.adaln_support import assert_equal_to_resident, host_gb, models_for, online_cache, resident


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return models_for("small", tmp_path_factory)


def sampler_plans(steps: int) -> list[torch.Tensor]:
    """A real video+audio schedule: step 0 has width 1 (both sigmas are 1.0), the others width 2."""
    return FlowMatchSchedule(steps, shift=3.0, audio_shift=5.0).plans


@pytest.mark.parametrize("readers,chunk_mb,buffers,direct_io", [
    (1, 1, 2, "never"), (3, 1, 3, "auto"), (16, 32, 2, "always"), (4, 1, 2, "always"),
])
def test_online_equals_resident_tiny(tiny, readers, chunk_mb, buffers, direct_io):
    plans = sampler_plans(12)
    cache = online_cache(tiny, gpu_plans=16, readers=readers, read_chunk_mb=chunk_mb, staging_buffers=buffers,
                         direct_io=direct_io, direct_chunk_mb=chunk_mb)
    prepared = cache.prepare(plans)
    assert prepared.stats.built_plans == 12
    if direct_io == "always" and _Files("always").direct_fd(str(tiny.reader.location("final.adaln_proj.weight").path)):
        assert cache.rebuilder.num_direct_units == 5  # 4 blocks + final, all through O_DIRECT
    assert_equal_to_resident(prepared, resident(tiny), plans)


def test_units_not_in_the_page_cache_are_read_with_o_direct(tiny, tmp_path):
    cold_dir = shutil.copytree(tiny.path, tmp_path / "cold")
    for shard in cold_dir.glob("*.safetensors"):
        fd = os.open(shard, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    reader = CheckpointReader(cold_dir)
    files = _Files("auto")
    cold = [u for u in resolve_adaln_units(reader, reader.config) if not files.cached(u.weight)]
    if not cold or files.direct_fd(str(cold[0].weight.path)) is None:
        pytest.skip("cannot evict the copy from the page cache or open it with O_DIRECT here")
    cache = online_cache(tiny, reader=reader, direct_io="auto")
    plans = sampler_plans(3)
    prepared = cache.prepare(plans)
    assert cache.rebuilder.num_direct_units == len(cold)
    assert_equal_to_resident(prepared, resident(tiny), plans)


def test_online_equals_resident_small_rebuild_and_host_restore(small):
    plans = sampler_plans(6)
    page_bytes = (8 * 3 * 6 * 512 + 2 * 512) * 2
    # 6 plans = 11 pages (step 0 has width 1) and 4 more plans = 8 pages: both groups fit 24 pages.
    cache = online_cache(small, gpu_plans=6, host_cache_gb=host_gb(24, page_bytes), readers=4)
    reference = resident(small)
    built = cache.prepare(plans)
    assert built.stats.built_plans == 6
    assert_equal_to_resident(built, reference, plans)
    built.release()
    cache.prepare(sampler_plans(5)[1:]).release()   # 4 other plans: evict the 4 least recently used (0..3)
    restored = cache.prepare(plans)
    stats = restored.stats
    assert (stats.gpu_hit_plans, stats.host_hit_plans, stats.built_plans) == (2, 4, 0)
    assert_equal_to_resident(restored, reference, plans)


def test_fp32_projection_online_equals_fp32_resident(tiny):
    plans = sampler_plans(4)
    cache = online_cache(tiny, projection="fp32")
    assert_equal_to_resident(cache.prepare(plans), resident(tiny, projection="fp32"), plans)


def test_forward_with_online_modulation_equals_resident_forward(tiny):
    cfg = tiny.online.config
    gen = torch.Generator().manual_seed(0)
    video = torch.randn(cfg.video_channels, 2, 4, 4, generator=gen)
    audio = torch.randn(3, cfg.audio_channels, generator=gen)
    text = torch.randn(5, cfg.text_dim, generator=gen)
    step = StepTimesteps.from_sigmas(0.7, 0.4)
    prepared = online_cache(tiny).prepare([step.timesteps])
    got = tiny.online(video, audio, text, step, prepared.modulation(0))
    want = tiny.resident.velocity(video, audio, text, step)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_cuda_online_equals_resident_through_rebuild_and_host_restore(name, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from cache.config import AdalnConfig
    from cache.plan_cache import PlanCache, ResidentModulation
    from model.checkpoint import load_model

    models = models_for(name, tmp_path_factory)
    online = load_model(models.path, device="cuda", with_adaln=False)
    reference = ResidentModulation(AdalnConfig(mode="resident"), load_model(models.path, device="cuda"))
    plans = sampler_plans(8)                          # widths 1 and 2: both GEMM shapes
    cache = PlanCache(AdalnConfig(gpu_plans=8, plan_width=2, host_cache_gb=0.5, readers=4), models.reader,
                      online, "cuda")
    assert cache.host.pinned
    built = cache.prepare(plans)
    assert built.stats.built_plans == 8
    assert_equal_to_resident(built, reference, plans)
    built.release()
    cache.slab.index.invalidate()                    # forget the GPU copies: restore from pinned pages
    restored = cache.prepare(plans)
    assert restored.stats.host_hit_plans == 8
    assert_equal_to_resident(restored, reference, plans)
    restored.release()
    cache.close()
