"""What an engine serves, from its config and its transformer's width: the `ModelLimits` both APIs check requests
against, the canvas checks' view of them, and the served model's name. Apart from `engine.engine` so that what
only needs the limits (the tests' fake-engine replicas) imports no model library.
"""

from __future__ import annotations

from engine.config import EngineConfig, GeometryConfig
from engine.limits import ModelLimits, served_limits, served_qualities
from model.canvas import CanvasRule
from model.geometry import H3_LATENTS, GeometryLimits
from model.schedule import AUDIO_SHIFT, VIDEO_SHIFT

#: The published transformer width: a checkpoint of this width gets the model's own size rules by default.
H3_HIDDEN_SIZE = 5376

#: The model's name in `ModelLimits.name` (what video clients put in `model`); the served id adds the weights'
#: fingerprint (`minimax-h3@<fingerprint>`).
MODEL_NAME = "minimax-h3"


def served_model_name(config: EngineConfig) -> str:
    """`minimax-h3` for the FL2VA partition, `minimax-h3-ref2va` for Ref2VA: two apps serving both partitions
    (README) name their models apart, so one job database could hold both queues."""
    return MODEL_NAME if config.partition == "fl2va" else f"{MODEL_NAME}-{config.partition}"


def model_limits(config: EngineConfig, hidden_size: int, tasks: tuple[str, ...] = ("t2va",),
                 canvas: CanvasRule = CanvasRule()) -> ModelLimits:
    """What the engine serves for a transformer `hidden_size` wide: `config.geometry`, or (null) the released
    model's size rules for a full-width checkpoint and any multiple of 32 px for a smaller (test) one. A request
    without a size gets the checkpoint's default canvas (`canvas`, its model index's rule: the tiny model's is
    64x32) where the geometry accepts it."""
    geometry = config.geometry
    if geometry is None:
        geometry = GeometryConfig() if hidden_size == H3_HIDDEN_SIZE else GeometryConfig(short_edge=None)
    return served_limits(
        served_model_name(config), max_steps=config.max_steps, short_edge=geometry.short_edge,
        max_pixels=geometry.max_pixels,
        size_multiple=H3_LATENTS.pixel_multiple, min_seconds=geometry.min_seconds, max_seconds=geometry.max_seconds,
        fps=H3_LATENTS.fps, frames_per_chunk=H3_LATENTS.frames_per_chunk, frame_offset=H3_LATENTS.latents_per_chunk,
        max_prompt_tokens=config.text_encoder.max_prompt_tokens, default_flow_shift=VIDEO_SHIFT,
        default_audio_flow_shift=AUDIO_SHIFT, tasks=tasks,
        adapters=tuple(adapter.served(name) for name, adapter in config.served_adapters().items()),
        quantization=config.quantization, qualities=served_qualities(config.quantization, config.cache_dit.enabled),
        canvas=canvas.default_size(),
    )


def geometry_limits(limits: ModelLimits) -> GeometryLimits:
    """The served limits as `model.geometry` checks a request's canvas and snapped duration."""
    return GeometryLimits(short_edge=limits.short_edge, max_pixels=limits.max_pixels,
                          min_seconds=limits.min_seconds, max_seconds=limits.max_seconds)
