"""model.text_memo: the token refiner runs once per request, and the loop's bits do not change (tiny transformer,
CPU, one process; under sequence parallelism: tests/test_parallel_sequence.py)."""

from __future__ import annotations

import pytest
import torch

from model.denoise import Denoiser, denoise
from model.geometry import GeometryLimits, VideoGeometry
from model.schedule import H3Schedule
from model.text_memo import RefinedTextMemo
from model.tiny import tiny_transformer

STEPS = 5  # 4 forwards
GEOMETRY = VideoGeometry.from_frames(64, 64, 5, limits=GeometryLimits(short_edge=None, min_seconds=0.0))
NUM_TEXT_TOKENS = 7


def text(seed: int = 0) -> torch.Tensor:
    return torch.randn(NUM_TEXT_TOKENS, 32, generator=torch.Generator().manual_seed(seed)).bfloat16()


def run(transformer, embeds: torch.Tensor):
    with torch.no_grad():
        return denoise(transformer, embeds, GEOMETRY, H3Schedule.build(STEPS), seed=3)


def test_a_request_refines_its_text_once_and_gets_the_same_bits():
    want = run(tiny_transformer(seed=0), text())
    transformer = tiny_transformer(seed=0)
    memo = RefinedTextMemo.install(transformer)
    got = run(transformer, text())
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert (memo.num_refined, memo.num_reused) == (1, STEPS - 2)  # 4 forwards: 1 refine, 3 reuses


def test_another_request_or_cleared_memo_refines_again():
    transformer = tiny_transformer(seed=0)
    memo = RefinedTextMemo.install(transformer)
    embeds = text()
    run(transformer, embeds)
    run(transformer, embeds)  # a new Denoiser: a new view object, so no stale rows across requests
    assert memo.num_refined == 2
    denoiser = Denoiser(GEOMETRY, H3Schedule.build(STEPS), NUM_TEXT_TOKENS)
    inputs = denoiser.transformer_inputs(0, denoiser.initial_latents(0), embeds)
    with torch.no_grad():
        inputs.run(transformer)
        memo.clear()  # e.g. a weight update
        inputs.run(transformer)
        inputs.run(transformer)
    assert (memo.num_refined, memo.num_reused) == (4, 2 * (STEPS - 2) + 1)


def test_a_changed_refiner_is_seen_after_clear():
    transformer = tiny_transformer(seed=0)
    memo = RefinedTextMemo.install(transformer)
    denoiser = Denoiser(GEOMETRY, H3Schedule.build(STEPS), NUM_TEXT_TOKENS)
    inputs = denoiser.transformer_inputs(0, denoiser.initial_latents(0), text())
    with torch.no_grad():
        before = inputs.run(transformer)
        transformer.token_refiner.final_norm.weight.mul_(2.0)
        memo.clear()
        after = inputs.run(transformer)
    assert not torch.equal(before[0], after[0])


def test_installing_twice_is_refused_and_remove_restores_the_refiner():
    transformer = tiny_transformer(seed=0)
    memo = RefinedTextMemo.install(transformer)
    with pytest.raises(RuntimeError, match="already installed"):
        RefinedTextMemo.install(transformer)
    memo.remove()
    run(transformer, text())
    assert memo.num_refined == 0
    RefinedTextMemo.install(transformer).remove()  # installable again after remove
