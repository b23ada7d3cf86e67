"""Layerwise offload (alone and with Cache-DiT) on diffusers' MiniMax-H3 transformer: the tiny seed-0 checkpoint
(bf16 blocks, fp32 input/time/output modules) loaded as the engine loads it, denoising a tiny t2va request on CPU
with the offloader's deferring fake device (a block that runs before its copy landed computes with NaN weights, so
every bit-exact comparison below also proves the waits are in place). Served with AdaLN rows from outside the
blocks (`ExternalModulation`), with streamed or resident `adaln_proj`. Cache-DiT's own behaviour (configs, block
stack, decisions) is tested in test_cache_dit.py; generic offloader behaviour on toy blocks in test_offload.py."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

pytest.importorskip("cache_dit")
from diffusers import MiniMaxH3Transformer3DModel  # noqa: E402

from cache.cache_dit import CacheDit, CacheDitConfig  # noqa: E402
from model.adaln import ExternalModulation, adaln_input, resident_modulation  # noqa: E402
from model.loading import load_transformer  # noqa: E402
from model.weights import TransformerWeights, is_adaln_param  # noqa: E402
from offload import LayerwiseOffloader, OffloadConfig  # noqa: E402
from tests.denoise_support import Request, Run, assert_same_velocities, denoise, offload, t2va_request  # noqa: E402

NUM_BLOCKS = 4  # the tiny transformer's num_layers (notes/seams.md)
NUM_STEPS = 9  # sigma grid points: 8 forward passes

# Bytes of one block's flat bf16 buffer (alignment 256 B = 128 elements; every slot starts aligned):
# norm1, norm2 [64] -> 128 each; to_q/to_k/to_v/to_out.0 [64, 64] = 4096 each; norm_q, norm_k [32] -> 128 each;
# ff.net.0.proj [256, 64] = 16384; ff.net.2 [64, 128] = 8192. Total 41472 elements.
BLOCK_BYTES_WITHOUT_ADALN = 41472 * 2
# With AdaLN served from outside (ExternalModulation), adaln_proj holds the block's row index (one int64: a slot).
ROW_INDEX_BYTES = 256
# adaln_proj.linear: weight [3 * 6 * 64, 32] = 36864 elements, bias [1152] (a multiple of 128).
ADALN_BYTES = (36864 + 1152) * 2
# Cache-DiT on this request: Fn=1, Bn=1, one warmup step. The Fn residual's relative change, step by step, is
# 0.055, 0.116, (step 3 computes: two cached in a row), 0.105, 0.234, 0.179, 0.254 against 0.15
# (seed-0 tiny checkpoint, the request below).
DBCACHE = CacheDitConfig(enabled=True, Fn_compute_blocks=1, Bn_compute_blocks=1, max_warmup_steps=1,
                         residual_diff_threshold=0.15, max_continuous_cached_steps=2)
CACHED_STEPS = [1, 2, 4]


# ---------------------------------------------------------------------------------------------------------
# The tiny model and request
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def weights(tiny) -> TransformerWeights:
    """The seed-0 tiny checkpoint (diffusers layout) the engine would load."""
    return tiny.reader


@pytest.fixture
def model(weights) -> MiniMaxH3Transformer3DModel:
    """A fresh resident transformer (offload and Cache-DiT modify the model they are applied to)."""
    return load_transformer(weights, "cpu")


@pytest.fixture(scope="module")
def t2va() -> Request:
    """The tiny 29-row t2va request (tests/denoise_support.py) over 8 forwards."""
    return t2va_request(NUM_STEPS)


@pytest.fixture(scope="module")
def resident_run(weights, t2va) -> Run:
    return denoise(load_transformer(weights, "cpu"), t2va)


@pytest.fixture(scope="module")
def resident_cached_run(weights, t2va) -> Run:
    model = load_transformer(weights, "cpu")
    return denoise(model, t2va, cache=CacheDit(model, DBCACHE))


# ---------------------------------------------------------------------------------------------------------
# Offload alone
# ---------------------------------------------------------------------------------------------------------

OFFLOADS = {
    "adaln-resident-depth1": dict(prefetch_depth=1, resident_tensors=("adaln_proj",)),
    "adaln-resident-load-on-call": dict(prefetch_depth=0, resident_tensors=("adaln_proj",)),
    "adaln-resident-strided1-depth2": dict(prefetch_depth=2, num_resident=1, residency_policy="strided",
                                           resident_tensors=("adaln_proj",)),
    "adaln-streamed": dict(prefetch_depth=1),
}


@pytest.mark.parametrize("name", list(OFFLOADS))
def test_offloaded_forward_equals_resident_bit_for_bit(name, model, t2va, resident_run):
    config = OFFLOADS[name]
    off = offload(model, **config)
    run = denoise(model, t2va, off=off)
    assert_same_velocities(run, resident_run)
    assert run.ran == [list(range(NUM_BLOCKS))] * t2va.schedule.num_forwards
    block_bytes = BLOCK_BYTES_WITHOUT_ADALN + (0 if config.get("resident_tensors") else ADALN_BYTES)
    assert off.describe()["block_bytes"] == [block_bytes] * NUM_BLOCKS
    # Each step streams every streamed block once; the first also loads the next step's head (prefetch_depth
    # blocks, while its own last blocks run), which every later step then finds loaded.
    streamed, depth = NUM_BLOCKS - config.get("num_resident", 0), config["prefetch_depth"]
    rest = [streamed * block_bytes] * (t2va.schedule.num_forwards - 1)
    assert off.stats.h2d_bytes_per_step == [(streamed + depth) * block_bytes] + rest
    assert off.stats.wasted_prefetches == 0
    off.check_invariants()


def test_resident_adaln_proj_holds_real_weights_while_the_rest_of_the_block_is_streamed(model, t2va):
    off = offload(model, resident_tensors=("adaln_proj",))
    denoise(model, t2va, off=off)
    block = model.transformer_blocks[2]
    assert not off.is_on_device(2) and off.holds_placeholders(2)
    assert block.attn.to_q.weight.numel() == 0  # streamed and released
    assert block.adaln_proj.linear.weight.shape == (3 * 6 * 64, 32)  # resident, never a placeholder
    assert set(off.block_state(2)) == {"norm1.weight", "attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight",
                                       "attn.norm_q.weight", "attn.norm_k.weight", "attn.to_out.0.weight",
                                       "norm2.weight", "ff.net.0.proj.weight", "ff.net.2.weight"}


def test_a_missing_wait_shows_as_nan(model, t2va, monkeypatch):
    """Negative control: the fake device really defers copies on this model, so a block running before its
    weights landed cannot go unnoticed (the bit-exact tests above would fail)."""
    off = offload(model, resident_tensors=("adaln_proj",))
    monkeypatch.setattr(off, "_wait", lambda entry: None)
    run = denoise(model, t2va, off=off)
    assert torch.isnan(run.video_velocity[0]).all()


def external_adaln(weights: TransformerWeights, device: str = "cpu"):
    """The engine's plan-cache path: a transformer loaded (on the host) without its AdaLN weights, served rows
    through ExternalModulation (every adaln_proj becomes a module holding no parameters), and the per-step
    call that sets the rows, projected by a resident copy on `device`."""
    model = load_transformer(weights, "cpu", skip=is_adaln_param)
    external = ExternalModulation.install(model)
    projector = load_transformer(weights, device)

    def set_step(timesteps: Tensor) -> None:
        external.set(resident_modulation(projector, adaln_input(projector, timesteps)))

    return model, set_step


@pytest.mark.parametrize("resident_tensors", [(), ("adaln_proj",)])
def test_blocks_whose_adaln_proj_holds_no_parameters_stream_without_it(resident_tensors, weights, t2va, resident_run):
    model, set_step = external_adaln(weights)
    assert not any(True for _ in model.transformer_blocks[0].adaln_proj.parameters())
    off = offload(model, resident_tensors=resident_tensors)
    run = denoise(model, t2va, off=off, before_step=set_step)
    assert_same_velocities(run, resident_run)
    row_index = 0 if resident_tensors else ROW_INDEX_BYTES
    assert off.describe()["block_bytes"] == [BLOCK_BYTES_WITHOUT_ADALN + row_index] * NUM_BLOCKS
    off.check_invariants()


def test_adaln_proj_replaced_after_apply_is_reported(model):
    off = offload(model)  # adaln_proj streamed with the block
    ExternalModulation.install(model)
    with pytest.raises(RuntimeError, match=r"block 0 streams \['adaln_proj.linear.bias', 'adaln_proj.linear.weight'\] "
                                           r"of submodules no longer in the block"):
        off.check_invariants()


def test_meta_tensors_are_refused_at_apply_naming_them(weights):
    """load_transformer(skip=is_adaln_param) leaves the AdaLN projections on meta for ExternalModulation to
    replace: that must happen before the offloader is applied."""
    model = load_transformer(weights, "cpu", skip=is_adaln_param)
    with pytest.raises(ValueError, match=r"^10 tensors are on the meta device \(not loaded\): "
                                         r"norm_out.linear.bias, "
                                         r"norm_out.linear.weight, transformer_blocks.0.adaln_proj.linear.bias, "
                                         r"transformer_blocks.0.adaln_proj.linear.weight and 6 more; load or replace "
                                         r"them before applying the offloader$"):
        offload(model, resident_tensors=("adaln_proj",))
    assert model.transformer_blocks[0].attn.to_q.weight.numel() > 0  # nothing was touched
    ExternalModulation.install(model)
    offload(model, resident_tensors=("adaln_proj",)).check_invariants()


# ---------------------------------------------------------------------------------------------------------
# Cache-DiT with offload
# ---------------------------------------------------------------------------------------------------------


# With DBCache's edges (blocks 0 and 3) resident; strided residency adds candidate 2 of [1, 2].
RESIDENT_WITH_DBCACHE = {"adaln-resident-depth1": [0, 3], "adaln-resident-strided1-depth2": [0, 2, 3],
                         "adaln-streamed": [0, 3]}


@pytest.mark.parametrize("name", list(RESIDENT_WITH_DBCACHE))
def test_offload_with_dbcache_skips_moving_cached_blocks_and_matches_resident_bit_for_bit(
        name, model, t2va, resident_cached_run):
    config = OFFLOADS[name]
    off = offload(model, **config)
    cache = CacheDit(model, DBCACHE)
    run = denoise(model, t2va, cache=cache, off=off)
    assert run.cached == CACHED_STEPS
    assert run.ran == resident_cached_run.ran
    assert_same_velocities(run, resident_cached_run)
    assert torch.equal(run.video, resident_cached_run.video)
    # Fn and Bn blocks are resident; the middle blocks move only in steps that compute them.
    assert off.resident_indices == RESIDENT_WITH_DBCACHE[name]
    block_bytes = off.describe()["block_bytes"][0]
    num_streamed = len(off.streamed_indices)
    assert off.stats.h2d_bytes_per_step == [0 if step in CACHED_STEPS else num_streamed * block_bytes
                                            for step in range(t2va.schedule.num_forwards)]
    assert off.stats.wasted_prefetches == 0
    # one synchronous load per computed step nobody announced (the Fn residual decided), nothing else
    unannounced = [s for s, p in enumerate(run.predicted) if p is None and s not in CACHED_STEPS]
    assert unannounced == [5, 6, 7]
    assert off.stats.sync_loads == len(unannounced)
    off.check_invariants()


def test_dbcache_with_offload_and_external_adaln_matches_resident_bit_for_bit(weights, t2va, resident_cached_run):
    """The serving combination: AdaLN rows from outside the blocks, blocks streamed, DBCache skipping."""
    model, set_step = external_adaln(weights)
    off = offload(model)
    cache = CacheDit(model, DBCACHE)
    run = denoise(model, t2va, cache=cache, off=off, before_step=set_step)
    assert run.cached == CACHED_STEPS and run.ran == resident_cached_run.ran
    assert_same_velocities(run, resident_cached_run)
    streamed = BLOCK_BYTES_WITHOUT_ADALN + ROW_INDEX_BYTES
    assert off.stats.h2d_bytes_per_step == [0 if step in CACHED_STEPS else 2 * streamed
                                            for step in range(t2va.schedule.num_forwards)]
    off.check_invariants()


# ---------------------------------------------------------------------------------------------------------
# CUDA (real copy stream, events, pinned host buffers)
# ---------------------------------------------------------------------------------------------------------


def test_cuda_offload_with_dbcache_matches_resident_bit_for_bit(weights, t2va):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    req = t2va.to("cuda")
    resident = load_transformer(weights, "cuda")
    expect = denoise(resident, req, cache=CacheDit(resident, DBCACHE))
    assert expect.cached, "DBCache should cache some steps here, else this proves nothing about skipping"
    configs = [dict(prefetch_depth=1, resident_tensors=("adaln_proj",)),
               dict(prefetch_depth=2, skip_predictive=False, resident_cache_edges=False)]
    for config in configs:
        model = load_transformer(weights, "cpu")  # blocks stay in host buffers; apply moves the rest
        off = LayerwiseOffloader(model.transformer_blocks, OffloadConfig(enabled=True, **config), "cuda",
                                 root=model).apply()
        run = denoise(model, req, cache=CacheDit(model, DBCACHE), off=off)
        assert run.cached == expect.cached and run.ran == expect.ran, config
        assert_same_velocities(run, expect)
        off.check_invariants()
    model, set_step = external_adaln(weights, "cuda")
    off = LayerwiseOffloader(model.transformer_blocks, OffloadConfig(enabled=True), "cuda", root=model).apply()
    run = denoise(model, req, cache=CacheDit(model, DBCACHE), off=off, before_step=set_step)
    assert run.cached == expect.cached
    assert_same_velocities(run, expect)
    cached_bytes = [n for step, n in enumerate(off.stats.h2d_bytes_per_step) if step in expect.cached]
    assert cached_bytes == [0] * len(expect.cached)
