"""One `ModelLimits`: what the engine serves, what the video API checks a job against at creation, and the same
answer as the engine's own check for every duration and size."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.model_limits import H3_HIDDEN_SIZE, geometry_limits, model_limits
from engine.limits import ModelLimits
from jobs.errors import InvalidVideoRequest
from jobs.limits import resolve_spec
from jobs.schemas import VideoCreateRequest
from model.geometry import GeometryError, VideoGeometry, frames_for_seconds, snap_num_frames
from model.canvas import CanvasRule
from model.tiny import TINY_CANVAS, TINY_TRANSFORMER

REPO = Path(__file__).resolve().parents[1]
H3 = model_limits(EngineConfig(), H3_HIDDEN_SIZE)
TINY = model_limits(EngineConfig(), TINY_TRANSFORMER.hidden_size)
TINY_RULE = {"short_edge": TINY_CANVAS["canvas_short_edge"], "max_pixels": TINY_CANVAS["canvas_max_pixels"]}


def test_engine_limits_import_nothing_but_pydantic():
    """jobs/ imports engine/limits.py (test_layering allows exactly it): it must not pull in torch."""
    tree = ast.parse((REPO / "engine" / "limits.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"__future__", "math", "fractions", "typing", "pydantic"}


def test_the_released_model_serves_its_size_rules_and_the_defaults_of_before():
    assert (H3.name, H3.short_edge, H3.min_edge, H3.max_edge, H3.max_pixels) == ("minimax-h3", 768, 768, 1344, 1032192)
    assert (H3.default_size, H3.default_seconds, H3.default_steps) == ("1344x768", 5.0, 50)
    assert (H3.min_seconds, H3.max_seconds, H3.min_steps, H3.max_steps) == (5.0, 15.0, 2, 65)
    assert (H3.default_flow_shift, H3.default_audio_flow_shift, H3.fps) == (12.0, 3.0, 24)
    assert (H3.max_prompt_chars, H3.max_prompt_tokens) == (20000, 2048)


def test_the_quick_start_tiny_model_takes_any_32_px_multiple_with_the_same_defaults():
    assert (TINY.short_edge, TINY.min_edge, TINY.max_edge, TINY.default_size) == (None, 32, 8192, "1344x768")
    assert (TINY.default_seconds, TINY.default_steps, TINY.min_seconds, TINY.max_seconds) == (5.0, 50, 5.0, 15.0)


def test_the_default_canvas_is_the_checkpoints_rule_where_the_geometry_takes_it():
    # The tiny checkpoint's model index (model.tiny.TINY_CANVAS): short edge 32, <= 32x64 px -> 64x32.
    tiny = model_limits(EngineConfig(), TINY_TRANSFORMER.hidden_size, canvas=CanvasRule(**TINY_RULE))
    assert (tiny.default_size, tiny.default_short_edge) == ("64x32", 32)
    assert resolve_spec(VideoCreateRequest(prompt="a fox"), tiny).model_dump(include={"width", "height"}) == {
        "width": 64, "height": 32}
    # A configured short edge the rule's canvas does not have: the geometry's own default.
    fixed = model_limits(EngineConfig(geometry={"short_edge": 768}), TINY_TRANSFORMER.hidden_size,
                         canvas=CanvasRule(**TINY_RULE))
    assert fixed.default_size == "1344x768"


def test_a_small_canvas_gets_a_small_16_9_default_and_a_clip_that_fits_a_short_bound():
    config = EngineConfig(geometry={"short_edge": None, "max_pixels": 128 * 128, "min_seconds": 0.2,
                                    "max_seconds": 5.0})
    limits = model_limits(config, TINY_TRANSFORMER.hidden_size)
    assert (limits.min_edge, limits.max_edge, limits.default_size) == (32, 512, "160x96")
    # 5 s snaps to 124 frames = 5.17 s, over the bound: the longest clip within it, 107 frames, is the default.
    assert (limits.default_seconds, limits.snapped_frames(limits.default_seconds)) == (106 / 24, 107)


@pytest.mark.parametrize("seconds", [0.01, 0.5, 1, 4.4375, 4.5, 5, 5.2, 9.99, 14.354, 14.375, 15, 16.5, 30, 59.9])
def test_the_video_apis_snap_is_the_models(seconds):
    assert H3.snapped_frames(seconds) == snap_num_frames(frames_for_seconds(seconds))


@pytest.mark.parametrize("seconds", [s / 8 for s in range(1, 8 * 17)])
@pytest.mark.parametrize("size", ["1344x768", "768x768", "768x1344", "1376x768", "1344x736"])
def test_a_job_is_refused_at_creation_exactly_when_the_engine_would_refuse_it(seconds, size):
    """No worker is asked about sizes or durations at creation: the served limits must give the engine's answer."""
    width, height = map(int, size.split("x"))
    try:
        VideoGeometry.from_seconds(width, height, seconds, geometry_limits(H3))
        engine_accepts = True
    except GeometryError:
        engine_accepts = False
    try:
        resolve_spec(VideoCreateRequest(prompt="a fox", seconds=seconds, size=size), H3)
        api_accepts = True
    except InvalidVideoRequest:
        api_accepts = False
    assert api_accepts == engine_accepts


def test_limits_whose_defaults_the_model_would_refuse_do_not_load():
    with pytest.raises(ValueError, match="default_steps=80 is outside 2..65"):
        ModelLimits.model_validate({**H3.model_dump(), "default_steps": 80})


def test_the_fake_engine_serves_the_tiny_models_width():
    from tests.fake_engine import TINY_HIDDEN_SIZE

    assert TINY_HIDDEN_SIZE == TINY_TRANSFORMER.hidden_size != H3_HIDDEN_SIZE
