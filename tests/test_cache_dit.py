"""cache-dit (the real library) on small DiTs, alone and with the layerwise offloader on a fake device:
config validation, executed blocks vs cache-dit's decisions, offload on == off bit for bit, nothing
leaking from one request into the next."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from cache.cache_dit import CacheDitConfig, CacheDitOverrides
from offload import FakeDevice, LayerwiseOffloader, OffloadConfig

pytest.importorskip("cache_dit")
from cache.cache_dit import CacheDit  # noqa: E402  (imports cache_dit lazily; needs it installed)

WIDTH = 16


# ---------------------------------------------------------------------------------------------------------
# A DiT-shaped toy: Pattern_3 blocks with a keyword context, the DiT's forward signature
# ---------------------------------------------------------------------------------------------------------


@dataclass
class ToyContext:
    t: float


class ToyBlock(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.mod = nn.Parameter(torch.randn(2, WIDTH) * 0.1)

    def forward(self, hidden_states: torch.Tensor, *, ctx: ToyContext) -> torch.Tensor:
        h = self.norm(hidden_states) * (1 + ctx.t * self.mod[0]) + self.mod[1]
        return hidden_states + 0.3 * self.mlp(h)  # never in place: cache-dit diffs input and output


class ToyDiT(nn.Module):
    def __init__(self, num_blocks: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.video_in = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(ToyBlock(i) for i in range(num_blocks))
        self.video_out = nn.Linear(WIDTH, WIDTH)

    def forward(self, video, audio, text_states, step, modulation):
        ctx = ToyContext(t=float(step))
        x = self.video_in(video)
        for block in self.blocks:
            x = block(x, ctx=ctx)
        return self.video_out(x), audio


@dataclass
class Trace:
    ran: list[list[int]] = field(default_factory=list)  # blocks that ran, per step
    predicted: list[bool | None] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)


def record_blocks(model: nn.Module, trace: Trace) -> None:
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: trace.ran[-1].append(i))


def denoise(model, steps: int, seed: int, cache: CacheDit | None = None, off: LayerwiseOffloader | None = None,
            overrides: CacheDitOverrides | None = None, trace: Trace | None = None) -> torch.Tensor:
    """A flow-matching-like loop: x += dt * v(x, t). The engine's per-request / per-step calls."""
    trace = trace if trace is not None else Trace()
    if cache is not None:
        cfg = cache.refresh(steps, overrides)
        if off is not None:
            if cfg.enabled:
                off.set_cache_blocks(cfg.Fn_compute_blocks, cfg.Bn_compute_blocks)
            else:
                off.clear_cache_blocks()
    x = torch.randn(1, 12, WIDTH, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for i in range(steps):
            will = cache.predict_middle() if cache is not None else None
            trace.predicted.append(will)
            if off is not None:
                off.begin_step(will)
            trace.ran.append([])
            v, _ = model(x, None, None, 1 - i / steps, None)
            x = x - v / steps
    if cache is not None:
        trace.cached = cache.cached_steps()
    return x


def toy(num_blocks: int, config: CacheDitConfig | None, offload: OffloadConfig | None = None, seed: int = 0):
    model = ToyDiT(num_blocks, seed)
    trace = Trace()
    record_blocks(model, trace)
    off = LayerwiseOffloader(model.blocks, offload, FakeDevice(), root=model).apply() if offload else None
    cache = CacheDit(model, config) if config is not None else None
    return model, cache, off, trace


F1B2 = CacheDitConfig(enabled=True, Fn_compute_blocks=1, Bn_compute_blocks=2, max_warmup_steps=3,
                      residual_diff_threshold=0.15, max_continuous_cached_steps=2)
F1B0 = CacheDitConfig(enabled=True, Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=2,
                      residual_diff_threshold=0.3, max_continuous_cached_steps=3)
F2B1_TAYLOR = CacheDitConfig(enabled=True, Fn_compute_blocks=2, Bn_compute_blocks=1, max_warmup_steps=2,
                             residual_diff_threshold=0.2, enable_taylorseer=True, taylorseer_order=1)
MASK_STATIC = CacheDitConfig(enabled=True, Fn_compute_blocks=1, Bn_compute_blocks=1, max_warmup_steps=2,
                             residual_diff_threshold=0.1, steps_computation_mask=[1, 1, 0, 0, 1, 0, 1, 0, 0, 1, 0, 1],
                             steps_computation_policy="static")
CONFIGS = {"F1B2": F1B2, "F1B0": F1B0, "F2B1-taylorseer": F2B1_TAYLOR, "mask-static": MASK_STATIC}
STEPS = 12


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="Fn_compute_blocks \\+ Bn_compute_blocks = 3 \\+ 2 exceeds the model's 4 blocks"):
        CacheDitConfig(Fn_compute_blocks=3, Bn_compute_blocks=2).check_num_blocks(4)
    with pytest.raises(ValueError, match="residual_diff_threshold"):
        CacheDitConfig(residual_diff_threshold=-0.1)
    with pytest.raises(ValueError, match="Bn_compute_blocks"):
        CacheDitConfig(Bn_compute_blocks=-1)
    with pytest.raises(ValueError, match="max_continuous_cached_steps"):
        CacheDitConfig(max_continuous_cached_steps=-2)
    with pytest.raises(ValueError, match="steps_computation_mask"):
        CacheDitConfig(steps_computation_mask=[1, 2])
    with pytest.raises(ValueError, match="static"):
        CacheDitConfig(steps_computation_policy="static")
    with pytest.raises(ValueError, match="residual_diff_threshold"):
        CacheDitOverrides(residual_diff_threshold=-1.0)
    with pytest.raises(ValueError, match="unknown_field|extra"):
        CacheDitOverrides(unknown_field=1)
    with pytest.raises(ValueError, match="steps_computation_mask has 3 entries"):
        CacheDitConfig(steps_computation_mask=[1, 1, 0]).resolve_mask(4)


def test_overrides_merge_and_label():
    cfg = F1B2.merged(CacheDitOverrides(residual_diff_threshold=0.24, Bn_compute_blocks=0, max_continuous_cached_steps=3))
    assert cfg.label() == "F1B0 W3 R0.24 MC3"
    assert F1B2.label() == "F1B2 W3 R0.15 MC2"
    assert F1B2.merged(None) is F1B2
    assert CacheDitConfig().label() == "off"
    assert F1B2.merged(CacheDitOverrides(steps_computation_mask=[])).steps_computation_mask == []


def test_cache_dit_refuses_fn_bn_beyond_the_blocks():
    with pytest.raises(ValueError, match="exceeds the model's 3 blocks"):
        CacheDit(ToyDiT(3), CacheDitConfig(enabled=True, Fn_compute_blocks=2, Bn_compute_blocks=2))
    model = ToyDiT(4)
    cache = CacheDit(model, F1B2)
    with pytest.raises(ValueError, match="exceeds the model's 4 blocks"):
        cache.refresh(4, CacheDitOverrides(Fn_compute_blocks=3))


def test_steps_mask_policy_name_is_resolved_per_request():
    mask = CacheDitConfig(enabled=True, steps_computation_mask="fast").resolve_mask(20)
    assert len(mask) >= 20 and set(mask) <= {0, 1} and mask[0] == 1


# ---------------------------------------------------------------------------------------------------------
# Real cache-dit runs
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_executed_blocks_match_cache_dit_decisions(name):
    cfg = CONFIGS[name]
    n = 6
    model, cache, off, trace = toy(n, cfg, OffloadConfig(enabled=True, prefetch_depth=1))
    denoise(model, STEPS, seed=1, cache=cache, off=off, trace=trace)
    fn, bn = cfg.Fn_compute_blocks, cfg.Bn_compute_blocks
    assert trace.cached, "the config should cache some steps on this toy (else the test proves nothing)"
    for step, ran in enumerate(trace.ran):
        cached = step in trace.cached
        assert ran == (list(range(fn)) + list(range(n - bn, n)) if cached else list(range(n))), step
        if trace.predicted[step] is not None:
            assert trace.predicted[step] is (not cached), step  # a firm prediction is never wrong
    # Zero H2D bytes for cached steps: Fn and Bn resident, the middle streamed only when it runs.
    block_bytes = off.describe()["block_bytes"][0]
    for step, nbytes in enumerate(off.stats.h2d_bytes_per_step):
        assert nbytes == (0 if step in trace.cached else (n - fn - bn) * block_bytes), step
    assert off.stats.wasted_prefetches == 0
    forced = sum(1 for s, p in enumerate(trace.predicted) if p is None and s not in trace.cached)
    assert off.stats.sync_loads == forced  # one synchronous load per unannounced miss, nothing else
    off.check_invariants()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_offload_on_equals_off_bit_for_bit(name):
    cfg = CONFIGS[name]
    plain, plain_cache, _, plain_trace = toy(6, cfg)
    expect = denoise(plain, STEPS, seed=2, cache=plain_cache, trace=plain_trace)
    for offload in (OffloadConfig(enabled=True, prefetch_depth=2, skip_predictive=False, resident_cache_edges=False),
                    OffloadConfig(enabled=True, prefetch_depth=1, num_resident=1, residency_policy="strided")):
        model, cache, off, trace = toy(6, cfg, offload)
        out = denoise(model, STEPS, seed=2, cache=cache, off=off, trace=trace)
        assert torch.equal(out, expect)
        assert trace.cached == plain_trace.cached and trace.ran == plain_trace.ran


def test_refresh_leaks_nothing_from_one_request_into_the_next():
    """Request A (with a mask and TaylorSeer overrides) then request B on one model give B exactly what a
    fresh model gives B alone: outputs, cached steps and the installed config."""
    model, cache, off, trace = toy(6, F1B2, OffloadConfig(enabled=True))
    denoise(model, STEPS, seed=3, cache=cache, off=off, trace=trace, overrides=CacheDitOverrides(
        steps_computation_mask=[1] * 4 + [0] * 8, enable_taylorseer=True, Fn_compute_blocks=2))
    a_cached = cache.cached_steps()
    trace.ran, trace.predicted = [], []
    out_b = denoise(model, STEPS, seed=4, cache=cache, off=off, trace=trace)
    ctx = cache._context()
    assert ctx.cache_config.steps_computation_mask is None and ctx.calibrator_config is None
    assert ctx.cache_config.Fn_compute_blocks == 1

    fresh, fresh_cache, _, fresh_trace = toy(6, F1B2)
    expect_b = denoise(fresh, STEPS, seed=4, cache=fresh_cache, trace=fresh_trace)
    assert torch.equal(out_b, expect_b)
    assert cache.cached_steps() == fresh_trace.cached
    assert cache.stats().num_cached_steps == len(fresh_trace.cached) > 0
    assert cache.stats().config == "F1B2 W3 R0.15 MC2"
    assert a_cached != fresh_trace.cached  # A really was different


def test_a_request_can_switch_caching_off():
    model, cache, off, trace = toy(5, F1B0, OffloadConfig(enabled=True))
    out = denoise(model, 8, seed=5, cache=cache, off=off, overrides=CacheDitOverrides(enabled=False), trace=trace)
    assert cache.cached_steps() == [] and all(r == list(range(5)) for r in trace.ran)
    assert all(p is True for p in trace.predicted)
    uncached = denoise(ToyDiT(5), 8, seed=5)
    assert torch.equal(out, uncached)
    assert off.resident_indices == []  # no DBCache edges to keep


def test_disable_unwraps_the_model():
    model = ToyDiT(4)
    expect = denoise(ToyDiT(4), 4, seed=6)
    cache = CacheDit(model, F1B0)
    cache.disable()
    assert torch.equal(denoise(model, 4, seed=6), expect)


# ---------------------------------------------------------------------------------------------------------
# The real DiT (model/dit.py)
# ---------------------------------------------------------------------------------------------------------


def test_tiny_dit_cache_dit_and_offload_match_decisions_and_resident_run(tiny_inputs):
    from model.config import preset
    from model.dit import DiT
    from model.sampler import FlowMatchSchedule, euler_step

    config = preset("tiny", num_blocks=5)
    cfg = CacheDitConfig(enabled=True, Fn_compute_blocks=1, Bn_compute_blocks=1, max_warmup_steps=2,
                         residual_diff_threshold=0.95, max_continuous_cached_steps=2)  # random weights: diffs ~0.9
    video, audio, text = tiny_inputs
    steps = 8

    def generate(offload: bool):
        model = DiT(config, seed=0)
        trace = Trace()
        record_blocks(model, trace)
        off = None
        if offload:
            # adaln_proj is read by resident_modulation outside the blocks' forward: keep it resident.
            off = LayerwiseOffloader(model.blocks, OffloadConfig(enabled=True, resident_tensors=("adaln_proj",)),
                                     FakeDevice(), root=model).apply()
            off.set_cache_blocks(cfg.Fn_compute_blocks, cfg.Bn_compute_blocks)
        cache = CacheDit(model, cfg)
        cache.refresh(steps)
        sched = FlowMatchSchedule(steps)
        v_x, a_x = video.clone(), audio.clone()
        for i in range(steps):
            st = sched.step(i)
            will = cache.predict_middle()
            trace.predicted.append(will)
            if off is not None:
                off.begin_step(will)
            trace.ran.append([])
            mod = model.resident_modulation(model.adaln_input(st.timesteps))
            v_v, v_a = model(v_x, a_x, text, st, mod)
            v_x = euler_step(v_x, v_v, sched.sigmas_video[i], sched.sigmas_video[i + 1])
            a_x = euler_step(a_x, v_a, sched.sigmas_audio[i], sched.sigmas_audio[i + 1])
        trace.cached = cache.cached_steps()
        return (v_x, a_x), trace, off

    (v_ref, a_ref), ref_trace, _ = generate(offload=False)
    (v_out, a_out), trace, off = generate(offload=True)
    assert torch.equal(v_out, v_ref) and torch.equal(a_out, a_ref)
    assert trace.cached == ref_trace.cached and len(trace.cached) > 0
    for step, ran in enumerate(trace.ran):
        assert ran == ([0, 4] if step in trace.cached else [0, 1, 2, 3, 4]), step
        assert off.stats.h2d_bytes_per_step[step] == (0 if step in trace.cached else 3 * off.describe()["block_bytes"][1])
    off.check_invariants()
