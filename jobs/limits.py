"""The resolution of an API request into a `VideoSpec` against the served model's `engine.limits.ModelLimits`.

Everything but the prompt's token count is checked here, at creation, from the limits the engine serves
(sizes, the snapped duration, steps, shifts, prompt characters): the job is refused before it is queued, with
the engine's own bounds, and no worker is asked. The token count needs the tokenizer (`VideoBackend.validate`).
"""

from __future__ import annotations

import secrets

from engine.limits import ModelLimits
from jobs.backend import VideoSpec
from jobs.errors import InvalidVideoRequest
from jobs.media import VideoMedia, check_frame_indices
from jobs.schemas import MAX_SEED, VideoCreateRequest

__all__ = ["parse_size", "resolve_spec"]


def parse_size(size: str, field: str = "size") -> tuple[int, int]:
    """`"1344x768"` -> (1344, 768)."""
    width, sep, height = size.partition("x")
    if not sep or not width.isdigit() or not height.isdigit():
        raise InvalidVideoRequest(field, f"{size!r} is not WIDTHxHEIGHT (e.g. '1344x768')")
    return int(width), int(height)


def check_size(limits: ModelLimits, width: int, height: int, field: str) -> None:
    problem = limits.size_problem(width, height)
    if problem is not None:
        raise InvalidVideoRequest(field, problem)


def size_from_aspect(limits: ModelLimits, aspect_ratio: str, short_edge: int) -> tuple[int, int]:
    """(width, height) with the short edge `short_edge` and the long edge the largest multiple of
    size_multiple within the ratio: 16:9 at 768 -> 1344x768, 9:16 -> 768x1344, 1:1 -> 768x768."""
    a, _, b = aspect_ratio.partition(":")
    ratio_w, ratio_h = int(a), int(b)
    if ratio_w == 0 or ratio_h == 0:
        raise InvalidVideoRequest("aspect_ratio", f"{aspect_ratio!r}: both sides must be positive")
    if short_edge % limits.size_multiple:
        raise InvalidVideoRequest(
            "short_edge", f"{short_edge} is not a multiple of the model's size_multiple={limits.size_multiple}"
        )
    larger, smaller = max(ratio_w, ratio_h), min(ratio_w, ratio_h)
    long_edge = short_edge * larger // smaller // limits.size_multiple * limits.size_multiple
    return (long_edge, short_edge) if ratio_w >= ratio_h else (short_edge, long_edge)


def resolve_spec(request: VideoCreateRequest, limits: ModelLimits, seed: int | None = None,
                 media: VideoMedia | None = None) -> VideoSpec:
    """The request with every default filled in, checked against the model. InvalidVideoRequest names the
    field, the value and the limit. `seed`: used when the request has none (None: drawn at random). `media`:
    the request's uploads (`jobs.media.video_media`); a job with media and no size takes the model's canvas."""
    prompt = request.prompt
    if not prompt.strip():
        raise InvalidVideoRequest("prompt", "must not be blank")
    if len(prompt) > limits.max_prompt_chars:
        raise InvalidVideoRequest(
            "prompt", f"{len(prompt)} characters exceed the model's max_prompt_chars={limits.max_prompt_chars}"
        )

    seconds = limits.default_seconds if request.seconds is None else request.seconds
    # The bounds hold for the clip the model makes: frames snapped up to 17n+5 (15 s -> 362 frames = 15.08 s).
    snapped = limits.snapped_seconds(seconds)
    if not limits.min_seconds <= snapped <= limits.max_seconds:
        raise InvalidVideoRequest(
            "seconds", f"{seconds:g} snaps to {limits.snapped_frames(seconds)} frames = {snapped:g} s at "
            f"{limits.fps} fps; the model's clips last min_seconds={limits.min_seconds:g} to "
            f"max_seconds={limits.max_seconds:g}")

    if request.size is not None:
        width, height = parse_size(request.size)
        check_size(limits, width, height, "size")
    elif request.aspect_ratio is not None:
        short_edge = limits.default_short_edge if request.short_edge is None else request.short_edge
        width, height = size_from_aspect(limits, request.aspect_ratio, short_edge)
        check_size(limits, width, height, "aspect_ratio")
    else:
        width, height = parse_size(limits.default_size, "default_size")
    task = "t2va" if media is None else media.task
    if task == "t2va" and "t2va" not in limits.tasks:
        raise InvalidVideoRequest("prompt", f"{limits.name} serves {', '.join(limits.tasks)}, not text alone: send "
                                            "references (image_reference, video_reference, audio_reference)")
    if media is not None:
        if media.task not in limits.tasks:
            field = media.keyframes[0].field if media.keyframes else media.references[0].field
            raise InvalidVideoRequest(field, f"{media.task} is not served by {limits.name} (it serves "
                                             f"{', '.join(limits.tasks)})")
        check_frame_indices(media, limits.snapped_frames(seconds))

    adapter = None
    if request.lora is not None:
        adapter = limits.adapter(request.lora.name)
        if adapter is None:
            raise InvalidVideoRequest("lora", limits.unknown_adapter(request.lora.name))
    # What the request leaves out: the adapter's default where it names one, else the model's.
    default_steps = adapter.steps if adapter is not None and adapter.steps is not None else limits.default_steps
    default_shift = (adapter.flow_shift if adapter is not None and adapter.flow_shift is not None
                     else limits.default_flow_shift)
    default_audio_shift = (adapter.audio_flow_shift if adapter is not None and adapter.audio_flow_shift is not None
                           else limits.default_audio_flow_shift)
    steps = default_steps if request.num_inference_steps is None else request.num_inference_steps
    if steps < limits.min_steps:
        raise InvalidVideoRequest("num_inference_steps", f"{steps} is below the model's min_steps={limits.min_steps}")
    if steps > limits.max_steps:
        raise InvalidVideoRequest("num_inference_steps", f"{steps} exceeds the model's max_steps={limits.max_steps}")

    shifts = {
        "flow_shift": default_shift if request.flow_shift is None else request.flow_shift,
        "audio_flow_shift": default_audio_shift if request.audio_flow_shift is None else request.audio_flow_shift,
    }
    for field, shift in shifts.items():
        if shift > limits.max_flow_shift:
            raise InvalidVideoRequest(field, f"{shift:g} exceeds the model's max_flow_shift={limits.max_flow_shift:g}")

    quality = limits.default_quality if request.quality is None else request.quality
    if quality not in limits.qualities:
        raise InvalidVideoRequest("quality", limits.unserved_quality(quality))

    if request.seed is not None:
        seed = request.seed
    elif seed is None:
        seed = secrets.randbelow(MAX_SEED + 1)
    return VideoSpec(
        model=limits.name, prompt=prompt, seconds=seconds, width=width, height=height, num_inference_steps=steps,
        seed=seed, flow_shift=shifts["flow_shift"], audio_flow_shift=shifts["audio_flow_shift"],
        quality=quality, task="t2va" if media is None else media.task, media=media,
        size_given=media is None or request.size is not None or request.aspect_ratio is not None,
        lora=request.lora,
    )
