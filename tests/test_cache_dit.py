"""cache-dit (the real library) on the tiny MiniMax-H3 transformer, alone and with the layerwise offloader on a fake
device: config validation, the block stack and its forward pattern, executed blocks vs cache-dit's decisions with
the exact cached forwards per config, offload on == off bit for bit, nothing leaking from one request into the next.

The transformer is `model.tiny.tiny_transformer(seed=0)` with 6 blocks instead of 4 (so Fn, Bn and a middle of
several blocks all exist), denoising the tiny t2va request of tests/denoise_support.py over 12 forwards. The cached
forwards below are what DBCache decides on these weights (their Fn residuals are deterministic on CPU).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from cache.cache_dit import CacheDitConfig, CacheDitOverrides
from model.tiny import TINY_TRANSFORMER, tiny_transformer
from offload import OffloadConfig
from tests.denoise_support import Run, denoise, offload, t2va_request

pytest.importorskip("cache_dit")
from diffusers import MiniMaxH3Transformer3DModel  # noqa: E402

from cache.cache_dit import (  # noqa: E402  (imports cache_dit lazily; needs it installed)
    BlockStack,
    BlockStackError,
    CacheDit,
    block_forward_pattern,
    find_block_stack,
)

NUM_BLOCKS = 6
SIX_BLOCKS = TINY_TRANSFORMER.model_copy(update={"num_layers": NUM_BLOCKS})
NUM_FORWARDS = 12
REQUEST = t2va_request(NUM_FORWARDS + 1)


def h3(seed: int = 0) -> MiniMaxH3Transformer3DModel:
    """A fresh seeded 6-block tiny transformer (Cache-DiT and offload modify the model they are applied to)."""
    return tiny_transformer(seed, SIX_BLOCKS)


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
#: The forwards each config caches on this request. F1B2: warmup 0-2, then at most two in a row (5 and 8 are
#: forced); F1B0: at most three in a row (5, 9 forced; 11's residual is 0.355 > 0.3); TaylorSeer: no streak limit,
#: 6 and 9 exceed 0.2; static mask: exactly the mask's zeros.
CACHED = {"F1B2": [3, 4, 6, 7, 9], "F1B0": [2, 3, 4, 6, 7, 8, 10], "F2B1-taylorseer": [2, 3, 4, 5, 7, 8, 10],
          "mask-static": [2, 3, 5, 7, 8, 10]}


def dbcache_order(fn: int, bn: int, cached: bool) -> list[int]:
    """Blocks DBCache runs in one forward: all of them, or Fn then Bn when cached."""
    return list(range(fn)) + list(range(NUM_BLOCKS - bn, NUM_BLOCKS)) if cached else list(range(NUM_BLOCKS))


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ValueError,
                       match=r"Fn_compute_blocks \+ Bn_compute_blocks = 3 \+ 2 exceeds the model's 4 blocks"):
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
    with pytest.raises(ValueError, match="Fn_compute_blocks"):  # cache-dit needs one block to decide on
        CacheDitConfig(Fn_compute_blocks=0)
    with pytest.raises(ValueError, match="Fn_compute_blocks"):
        CacheDitOverrides(Fn_compute_blocks=0)
    with pytest.raises(ValueError, match="steps_computation_mask='fast' .*5 steps"):
        CacheDitConfig(steps_computation_mask="fast").resolve_mask(5)


def test_overrides_merge_and_label():
    cfg = F1B2.merged(CacheDitOverrides(residual_diff_threshold=0.24, Bn_compute_blocks=0,
                                        max_continuous_cached_steps=3))
    assert cfg.label() == "F1B0 W3 R0.24 MC3"
    assert F1B2.label() == "F1B2 W3 R0.15 MC2"
    assert F1B2.merged(None) is F1B2
    assert CacheDitConfig().label() == "off"
    assert F1B2.merged(CacheDitOverrides(steps_computation_mask=[])).steps_computation_mask == []
    assert MASK_STATIC.label() == "F1B1 W2 R0.1 SCM-110010100101-static"


def test_cache_dit_refuses_fn_bn_beyond_the_blocks():
    with pytest.raises(ValueError, match="exceeds the model's 6 blocks"):
        CacheDit(h3(), CacheDitConfig(enabled=True, Fn_compute_blocks=4, Bn_compute_blocks=3))
    cache = CacheDit(h3(), F1B2)
    with pytest.raises(ValueError, match="exceeds the model's 6 blocks"):
        cache.refresh(NUM_FORWARDS, CacheDitOverrides(Fn_compute_blocks=5))


def test_steps_mask_policy_name_is_resolved_per_request():
    mask = CacheDitConfig(enabled=True, steps_computation_mask="fast").resolve_mask(20)
    assert len(mask) >= 20 and set(mask) <= {0, 1} and mask[0] == 1


# ---------------------------------------------------------------------------------------------------------
# The block stack Cache-DiT wraps
# ---------------------------------------------------------------------------------------------------------


def test_block_stack_of_the_h3_transformer_is_its_transformer_blocks_pattern_3():
    model = h3()
    stack = find_block_stack(model)
    assert stack == BlockStack(attr="transformer_blocks", blocks=model.transformer_blocks, forward_pattern="Pattern_3")
    assert stack.blocks is model.transformer_blocks  # not the token refiner's blocks


class _HiddenStatesBlock(nn.Module):
    def forward(self, hidden_states: Tensor, temb: Tensor) -> Tensor:
        return hidden_states


class _WanShaped(nn.Module):
    """Shaped like diffusers' Wan transformer: the block stack under `blocks`, after another module list."""

    def __init__(self) -> None:
        super().__init__()
        self.condition_layers = nn.ModuleList([nn.Linear(2, 2)])
        self.blocks = nn.ModuleList([_HiddenStatesBlock(), _HiddenStatesBlock()])


def test_block_stack_named_blocks_is_found_too():
    model = _WanShaped()
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


def test_a_stack_that_is_not_the_models_attribute_is_refused():
    model = h3()
    detached = BlockStack("transformer_blocks", nn.ModuleList(list(model.transformer_blocks)), "Pattern_3")
    with pytest.raises(BlockStackError, match="is not the stack's block list"):
        CacheDit(model, F1B2, stack=detached)


def test_h3_blocks_never_write_into_their_input():
    """DBCache diffs a block's input against its output: an in-place write would make the residual 0/0."""
    model = h3()
    seen: list[int] = []

    def before(block, args):
        block.saved = (args[0].clone(), args[0]._version)

    def after(block, args, output):
        hidden_states = args[0]
        assert hidden_states._version == block.saved[1] and torch.equal(hidden_states, block.saved[0])
        assert output.data_ptr() != hidden_states.data_ptr()
        seen.append(1)

    for block in model.transformer_blocks:
        block.register_forward_pre_hook(before)
        block.register_forward_hook(after)
    denoise(model, t2va_request(3))
    assert len(seen) == 2 * NUM_BLOCKS


# ---------------------------------------------------------------------------------------------------------
# Real cache-dit runs
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uncached() -> Run:
    return denoise(h3(), REQUEST)


@pytest.fixture(scope="module")
def cached_runs() -> dict[str, Run]:
    """Each config's run on a plain (not offloaded) transformer."""
    runs = {}
    for name, cfg in CONFIGS.items():
        model = h3()
        runs[name] = denoise(model, REQUEST, cache=CacheDit(model, cfg))
    return runs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_executed_blocks_match_cache_dits_decisions(name, cached_runs, uncached):
    cfg, run = CONFIGS[name], cached_runs[name]
    fn, bn = cfg.Fn_compute_blocks, cfg.Bn_compute_blocks
    assert run.cached == CACHED[name]
    assert run.ran == [dbcache_order(fn, bn, step in CACHED[name]) for step in range(NUM_FORWARDS)]
    for step, predicted in enumerate(run.predicted):
        if predicted is not None:
            assert predicted is (step not in CACHED[name]), step  # a firm prediction is never wrong
    first_cached = CACHED[name][0]
    assert torch.equal(run.video_velocity[first_cached - 1], uncached.video_velocity[first_cached - 1])
    assert not torch.equal(run.video, uncached.video)  # the cached forwards did change the result


@pytest.mark.parametrize("name", list(CONFIGS))
def test_offload_moves_no_weights_in_cached_forwards_and_loads_only_unannounced_middles(name, cached_runs):
    cfg = CONFIGS[name]
    model = h3()
    off = offload(model, prefetch_depth=1)
    run = denoise(model, REQUEST, cache=CacheDit(model, cfg), off=off)
    assert run.cached == CACHED[name] and run.ran == cached_runs[name].ran
    # Fn and Bn resident; the middle blocks are streamed only in forwards that compute them.
    fn, bn = cfg.Fn_compute_blocks, cfg.Bn_compute_blocks
    assert off.resident_indices == list(range(fn)) + list(range(NUM_BLOCKS - bn, NUM_BLOCKS))
    block_bytes = off.describe()["block_bytes"][0]
    assert off.stats.h2d_bytes_per_step == [0 if step in CACHED[name] else (NUM_BLOCKS - fn - bn) * block_bytes
                                            for step in range(NUM_FORWARDS)]
    assert off.stats.wasted_prefetches == 0
    unannounced = [s for s, p in enumerate(run.predicted) if p is None and s not in CACHED[name]]
    assert off.stats.sync_loads == len(unannounced)  # one synchronous load per unannounced miss, nothing else
    off.check_invariants()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_offload_on_equals_off_bit_for_bit(name, cached_runs):
    expect = cached_runs[name]
    for config in (OffloadConfig(enabled=True, prefetch_depth=2, skip_predictive=False, resident_cache_edges=False),
                   OffloadConfig(enabled=True, prefetch_depth=1, num_resident=1, residency_policy="strided")):
        model = h3()
        off = offload(model, config)
        run = denoise(model, REQUEST, cache=CacheDit(model, CONFIGS[name]), off=off)
        assert torch.equal(run.video, expect.video) and torch.equal(run.audio, expect.audio), config
        assert run.cached == expect.cached and run.ran == expect.ran
        off.check_invariants()


def test_refresh_leaks_nothing_from_one_request_into_the_next(cached_runs):
    """Request A (with a mask and TaylorSeer overrides) then request B on one model give B exactly what a
    fresh model gives B alone: outputs, cached forwards and the installed config."""
    model = h3()
    off = offload(model)
    cache = CacheDit(model, F1B2)
    first = denoise(model, REQUEST, cache=cache, off=off, overrides=CacheDitOverrides(
        steps_computation_mask=[1] * 4 + [0] * 8, enable_taylorseer=True, Fn_compute_blocks=2))
    # The mask forces forwards 0-3; then at most two cached in a row (6 computes); 8, 10, 11 exceed 0.15.
    assert first.cached == [4, 5, 7, 9] != CACHED["F1B2"]
    second = denoise(model, REQUEST, cache=cache, off=off)
    ctx = cache._context()
    assert ctx.cache_config.steps_computation_mask is None and ctx.calibrator_config is None
    assert ctx.cache_config.Fn_compute_blocks == 1
    alone = cached_runs["F1B2"]
    assert torch.equal(second.video, alone.video) and torch.equal(second.audio, alone.audio)
    assert second.cached == alone.cached == CACHED["F1B2"]
    assert cache.stats().num_cached_steps == len(CACHED["F1B2"])
    assert cache.stats().config == "F1B2 W3 R0.15 MC2"


def test_a_request_can_switch_caching_off(uncached):
    model = h3()
    off = offload(model)
    cache = CacheDit(model, F1B0)
    run = denoise(model, REQUEST, cache=cache, off=off, overrides=CacheDitOverrides(enabled=False))
    assert run.cached == [] and run.ran == [list(range(NUM_BLOCKS))] * NUM_FORWARDS
    assert run.predicted == [True] * NUM_FORWARDS
    assert torch.equal(run.video, uncached.video) and torch.equal(run.audio, uncached.audio)
    assert off.resident_indices == []  # no DBCache edges to keep


def test_disable_unwraps_the_model(uncached):
    model = h3()
    cache = CacheDit(model, F1B0)
    cache.disable()
    run = denoise(model, REQUEST)
    assert run.ran == [list(range(NUM_BLOCKS))] * NUM_FORWARDS
    assert torch.equal(run.video, uncached.video)
