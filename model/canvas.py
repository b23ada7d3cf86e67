"""The canvas MiniMax-H3 generates on, and the checkpoint settings that define it.

A checkpoint's canvas rule is three numbers from its model index, the names diffusers' modular pipeline reads as
configs (`canvas_short_edge`, `canvas_max_pixels`: the blocks that resolve a canvas; `reference_image_short_edge`:
the ref2va setup step): `modular_model_index.json` (else `model_index.json`) at a diffusers root, the
`_minimax_h3` block of a native partition's `model_index.json`. Absent keys are the released model's values (768,
768 x 1344, 2048); the tiny checkpoint (`model.tiny`) writes small ones so a bare request answers in seconds.

`resolve_canvas(aspect_w, aspect_h, rule)` is diffusers' `resolve_canvas_size` arithmetic: the short edge at
`short_edge`, the area capped at `max_pixels`, both axes rounded to the nearest 32 (VAE x16 times patch 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from model.layout import MODEL_INDEX, MODULAR_MODEL_INDEX, NATIVE_BLOCK, CheckpointError, H3Checkpoint, Layout

#: What both canvas axes round to: the VAE's x16 times the transformer's 2-wide patch.
CANVAS_MULTIPLE = 32
#: The aspect ratios the released model was trained over (1:4 .. 4:1).
MIN_ASPECT_RATIO = 1 / 4
MAX_ASPECT_RATIO = 4.0
#: The model-index keys, as diffusers names its `ConfigSpec`s.
CANVAS_KEYS = ("canvas_short_edge", "canvas_max_pixels", "reference_image_short_edge")


class CanvasError(ValueError):
    """An aspect ratio or size the canvas rule cannot place; `field` names the request field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class CanvasRule:
    """One checkpoint's canvas settings (the released model's by default)."""

    short_edge: int = 768
    max_pixels: int = 768 * 1344
    reference_image_short_edge: int = 2048
    multiple: int = CANVAS_MULTIPLE

    @classmethod
    def of(cls, checkpoint: H3Checkpoint) -> CanvasRule:
        """The rule the checkpoint's model index states (diffusers' reading of it), released values where absent."""
        values = _index_values(checkpoint)
        rule = cls(**{field: _positive_int(values[key], key, checkpoint.root)
                      for field, key in zip(("short_edge", "max_pixels", "reference_image_short_edge"), CANVAS_KEYS)
                      if key in values})
        return rule

    def default_size(self) -> tuple[int, int]:
        """(width, height) of a request that names no size and has no keyframe: 16:9 landscape."""
        height, width = resolve_canvas(16, 9, self)
        return width, height


def resolve_canvas(aspect_width: float, aspect_height: float, rule: CanvasRule,
                   field: str = "aspect_ratio") -> tuple[int, int]:
    """(height, width) of the canvas for an aspect ratio (or a keyframe's own size); CanvasError outside 1:4..4:1."""
    if aspect_width <= 0 or aspect_height <= 0:
        raise CanvasError(field, f"the aspect ratio must be positive, got {aspect_width}:{aspect_height}")
    ratio = aspect_width / aspect_height
    if not MIN_ASPECT_RATIO <= ratio <= MAX_ASPECT_RATIO:
        raise CanvasError(field, f"MiniMax-H3 takes aspect ratios from 1:4 to 4:1, got {aspect_width}:{aspect_height}")
    if ratio >= 1.0:
        width, height = rule.short_edge * ratio, float(rule.short_edge)
    else:
        width, height = float(rule.short_edge), rule.short_edge / ratio
    area = width * height
    if area > rule.max_pixels:
        scale = (rule.max_pixels / area) ** 0.5
        width, height = width * scale, height * scale
    multiple = rule.multiple
    return max(multiple, round(height / multiple) * multiple), max(multiple, round(width / multiple) * multiple)


def reference_image_size(width: int, height: int, rule: CanvasRule) -> tuple[int, int]:
    """(width, height) an image reference is encoded at: its own short edge at `reference_image_short_edge`
    (upscaling included, no area cap), both axes rounded to the multiple (diffusers' ref2va setup step)."""
    scale = rule.reference_image_short_edge / min(width, height)
    multiple = rule.multiple
    return (max(multiple, round(width * scale / multiple) * multiple),
            max(multiple, round(height * scale / multiple) * multiple))


def _index_values(checkpoint: H3Checkpoint) -> dict:
    if checkpoint.layout is Layout.DIFFUSERS:
        root = checkpoint.root
        path = root / MODULAR_MODEL_INDEX if (root / MODULAR_MODEL_INDEX).is_file() else root / MODEL_INDEX
        return _read(path)
    return _read(checkpoint.root / MODEL_INDEX).get(NATIVE_BLOCK, {})


def _read(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return value


def _positive_int(value: object, key: str, root: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"{root}: model index {key} must be a positive integer, got {value!r}")
    return value
