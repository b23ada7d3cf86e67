"""Layerwise offload and Cache-DiT on diffusers' MiniMax-H3 transformer: the tiny seed-0 checkpoint (bf16 blocks,
fp32 input/time/output modules) loaded as the engine loads it, denoising a tiny t2va request on CPU with the
offloader's deferring fake device (a block that runs before its copy landed computes with NaN weights, so every
bit-exact comparison below also proves the waits are in place)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from torch import Tensor, nn

pytest.importorskip("cache_dit")
from diffusers import MiniMaxH3Transformer3DModel  # noqa: E402

from cache.cache_dit import (  # noqa: E402
    BlockStack,
    BlockStackError,
    CacheDit,
    CacheDitConfig,
    block_forward_pattern,
    find_block_stack,
)
from model.adaln import ExternalModulation, adaln_input, resident_modulation  # noqa: E402
from model.geometry import GeometryLimits, VideoGeometry  # noqa: E402
from model.layout import H3Checkpoint, Layout  # noqa: E402
from model.loading import load_transformer  # noqa: E402
from model.packing import PackedLayout  # noqa: E402
from model.schedule import H3Schedule, euler_update  # noqa: E402
from model.tiny import make_tiny_checkpoint  # noqa: E402
from model.weights import TransformerWeights, is_adaln_param  # noqa: E402
from offload import FakeDevice, LayerwiseOffloader, OffloadConfig  # noqa: E402

NUM_BLOCKS = 4  # the tiny transformer's num_layers (notes/seams.md)
NUM_TEXT_TOKENS = 5
NUM_STEPS = 9  # sigma grid points: 8 forward passes

# Bytes of one block's flat bf16 buffer (alignment 256 B = 128 elements; every slot starts aligned):
# norm1, norm2 [64] -> 128 each; to_q/to_k/to_v/to_out.0 [64, 64] = 4096 each; norm_q, norm_k [32] -> 128 each;
# ff.net.0.proj [256, 64] = 16384; ff.net.2 [64, 128] = 8192. Total 41472 elements.
BLOCK_BYTES_WITHOUT_ADALN = 41472 * 2
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
def weights(tmp_path_factory) -> TransformerWeights:
    root = make_tiny_checkpoint(tmp_path_factory.mktemp("h3") / "tiny", Layout.DIFFUSERS, seed=0, components=False)
    checkpoint = H3Checkpoint.open(root)
    return TransformerWeights(checkpoint.transformer_dir, checkpoint.layout)


@pytest.fixture
def model(weights) -> MiniMaxH3Transformer3DModel:
    """A fresh resident transformer (offload and Cache-DiT modify the model they are applied to)."""
    return load_transformer(weights, "cpu")


@dataclass(frozen=True)
class Request:
    layout: PackedLayout
    schedule: H3Schedule
    video: Tensor  # fp32 [Nv, 96] packed video rows (noise)
    audio: Tensor  # fp32 [2A, 32] channel-major audio rows (noise)
    text: Tensor  # [L, 32] text states

    def to(self, device: torch.device | str) -> Request:
        return Request(self.layout.to(device), self.schedule, self.video.to(device), self.audio.to(device),
                       self.text.to(device))


@pytest.fixture(scope="module")
def t2va() -> Request:
    """64x64 px, 5 frames -> 2 latent frames of 2x2 patches (8 video rows), 8 audio latents x 2 channels
    (16 rows), 5 text rows: a 29-row packed sequence, two distinct timesteps per step after the first."""
    geometry = VideoGeometry.from_frames(64, 64, 5, limits=GeometryLimits(short_edge=None, min_seconds=0.0))
    g = torch.Generator().manual_seed(1)
    return Request(
        layout=PackedLayout.build(geometry, NUM_TEXT_TOKENS),
        schedule=H3Schedule.build(NUM_STEPS),
        video=torch.randn(geometry.num_video_tokens, geometry.spec.patch_dim, generator=g),
        audio=torch.randn(geometry.num_audio_rows, geometry.spec.audio_latent_channels, generator=g),
        text=torch.randn(NUM_TEXT_TOKENS, 32, generator=g),  # the tiny text_dim
    )


@dataclass
class Run:
    """What one request did: per step the velocities, the blocks that ran, the skip prediction."""

    video_velocity: list[Tensor] = field(default_factory=list)
    audio_velocity: list[Tensor] = field(default_factory=list)
    ran: list[list[int]] = field(default_factory=list)
    predicted: list[bool | None] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    video: Tensor | None = None  # final sample


def record_blocks(model: MiniMaxH3Transformer3DModel, run: Run) -> None:
    for i, block in enumerate(model.transformer_blocks):
        block.register_forward_pre_hook(lambda module, args, i=i: run.ran[-1].append(i))


def denoise(model: MiniMaxH3Transformer3DModel, req: Request, *, cache: CacheDit | None = None,
            off: LayerwiseOffloader | None = None, before_step: Callable[[Tensor], None] | None = None) -> Run:
    """The engine's per-request and per-step calls around the transformer, Euler in fp32."""
    run = Run()
    record_blocks(model, run)
    sched, layout = req.schedule, req.layout
    if cache is not None:
        cfg = cache.refresh(sched.num_forwards)
        if off is not None:
            off.set_cache_blocks(cfg.Fn_compute_blocks, cfg.Bn_compute_blocks)
    video, audio = req.video.clone(), req.audio.clone()
    with torch.no_grad():
        for i, step in enumerate(sched.steps):
            timesteps = step.timesteps.to(video.device)
            if before_step is not None:
                before_step(timesteps)
            will = cache.predict_middle() if cache is not None else None
            run.predicted.append(will)
            if off is not None:
                off.begin_step(will)
            run.ran.append([])
            v_video, v_audio = model(
                video[None], audio[None], req.text[None], timesteps,
                layout.timestep_indices(step.video_index, step.audio_index), layout.token_tags, layout.position_ids,
                layout.video_indices, layout.audio_indices, layout.text_indices, return_dict=False,
            )
            run.video_velocity.append(v_video[0])
            run.audio_velocity.append(v_audio[0])
            video = euler_update(video, v_video[0], sched.video_timesteps[i],
                                 sched.video_sigmas[i], sched.video_sigmas[i + 1])
            audio = euler_update(audio, v_audio[0], sched.audio_timesteps[i],
                                 sched.audio_sigmas[i], sched.audio_sigmas[i + 1])
    run.video = video
    if cache is not None:
        run.cached = cache.cached_steps()
    return run


def offload(model: MiniMaxH3Transformer3DModel, **config) -> LayerwiseOffloader:
    return LayerwiseOffloader(model.transformer_blocks, OffloadConfig(enabled=True, **config), FakeDevice(),
                              root=model).apply()


def assert_same_velocities(run: Run, expect: Run) -> None:
    assert len(run.video_velocity) == len(expect.video_velocity)
    for step, (v, a, ev, ea) in enumerate(zip(run.video_velocity, run.audio_velocity, expect.video_velocity,
                                              expect.audio_velocity)):
        assert torch.equal(v, ev) and torch.equal(a, ea), f"step {step}"


@pytest.fixture(scope="module")
def resident_run(weights, t2va) -> Run:
    return denoise(load_transformer(weights, "cpu"), t2va)


@pytest.fixture(scope="module")
def resident_cached_run(weights, t2va) -> Run:
    model = load_transformer(weights, "cpu")
    return denoise(model, t2va, cache=CacheDit(model, DBCACHE))


# ---------------------------------------------------------------------------------------------------------
# The block stack Cache-DiT wraps
# ---------------------------------------------------------------------------------------------------------


def test_block_stack_of_the_h3_transformer_is_its_transformer_blocks_pattern_3(model):
    stack = find_block_stack(model)
    assert stack == BlockStack(attr="transformer_blocks", blocks=model.transformer_blocks, forward_pattern="Pattern_3")
    assert stack.blocks is model.transformer_blocks  # not the token refiner's blocks


class _OldStyleBlock(nn.Module):
    def forward(self, hidden_states: Tensor, *, ctx: object) -> Tensor:
        return hidden_states


class _OldStyleDiT(nn.Module):
    """Shaped like ditserve's old model/dit.py: a refiner list, then the block stack under `blocks`."""

    def __init__(self) -> None:
        super().__init__()
        self.refiner = nn.ModuleList([nn.Linear(2, 2)])
        self.blocks = nn.ModuleList([_OldStyleBlock(), _OldStyleBlock()])


def test_block_stack_of_an_old_style_dit_is_its_blocks():
    model = _OldStyleDiT()
    assert find_block_stack(model) == BlockStack(attr="blocks", blocks=model.blocks, forward_pattern="Pattern_3")


class _DualStreamBlock(nn.Module):
    def forward(self, hidden_states: Tensor, encoder_hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        return hidden_states, encoder_hidden_states


class _TupleBlock(nn.Module):
    def forward(self, hidden_states: Tensor, temb: Tensor) -> tuple[Tensor, Tensor]:
        return hidden_states, temb


class _UnannotatedBlock(nn.Module):
    def forward(self, hidden_states, temb):
        return hidden_states


class _ContextFirstBlock(nn.Module):
    def forward(self, temb: Tensor, hidden_states: Tensor) -> Tensor:
        return hidden_states


@pytest.mark.parametrize("block,message", [
    (_DualStreamBlock(), r"takes encoder_hidden_states \(a dual-stream block\)"),
    (_TupleBlock(), r"must be annotated to return torch.Tensor .* got tuple\[torch.Tensor, torch.Tensor\]"),
    (_UnannotatedBlock(), r"must be annotated to return torch.Tensor .* got None"),
    (_ContextFirstBlock(),
     r"must take hidden_states as its first positional argument, got \['temb', 'hidden_states'\]"),
])
def test_blocks_of_another_forward_pattern_are_refused_naming_the_block(block, message):
    with pytest.raises(BlockStackError, match=rf"^{type(block).__name__}\.forward {message}"):
        block_forward_pattern(block)


def test_a_model_without_a_block_stack_is_refused():
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(BlockStackError, match=r"Module has no block stack: expected a non-empty nn.ModuleList child "
                                              r"named one of \('transformer_blocks', 'blocks'\)"):
        find_block_stack(model)


def test_a_stack_that_is_not_the_models_attribute_is_refused(model):
    detached = BlockStack("transformer_blocks", nn.ModuleList(list(model.transformer_blocks)), "Pattern_3")
    with pytest.raises(BlockStackError, match="is not the stack's block list"):
        CacheDit(model, DBCACHE, stack=detached)


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
    assert off.describe()["block_bytes"] == [BLOCK_BYTES_WITHOUT_ADALN] * NUM_BLOCKS
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
# Cache-DiT, alone and with offload
# ---------------------------------------------------------------------------------------------------------


def test_dbcache_caches_exactly_the_expected_steps(resident_cached_run, resident_run):
    run = resident_cached_run
    assert run.cached == CACHED_STEPS
    for step, ran in enumerate(run.ran):
        assert ran == ([0, NUM_BLOCKS - 1] if step in CACHED_STEPS else list(range(NUM_BLOCKS))), step
    # warmup step 0 and step 3 (after two cached in a row) surely compute; the rest hinge on the residual
    assert run.predicted == [True, None, None, True, None, None, None, None]
    assert torch.equal(run.video_velocity[0], resident_run.video_velocity[0])  # step 0 computes every block
    assert not torch.equal(run.video, resident_run.video)  # the cached steps did change the result


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
    assert off.stats.h2d_bytes_per_step == [0 if step in CACHED_STEPS else 2 * BLOCK_BYTES_WITHOUT_ADALN
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
    assert [n for step, n in enumerate(off.stats.h2d_bytes_per_step) if step in expect.cached] == [0] * len(expect.cached)
