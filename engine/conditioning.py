"""The engine's prepare step for keyframe (fl2va) and reference (ref2va) requests.

    stage = ConditioningStage(checkpoint, prompt_stage, vae_encoders, limits)
    geometry, schedule = stage.check(request)        # decode the uploads (limits first), canvas, geometry, plans
    embedding = stage.encode(request)                # Qwen3-VL presentation, through the prompt-embedding cache,
                                                     # with its `Conditions`: the canvas, the VAE condition latents
    geometry, schedule = conditioned_plan(request, embedding.conditions, limits)   # the denoiser's side

`check` is cheap enough for `Engine.validate` (the media decode and the canvas, no model call); `encode` runs the
models once per request: the preparation is kept for the last few request objects, so the calls of one
generation decode and encode once. The embedding carries everything the denoiser needs of the keyframes and
references, so the prepare side may be another process (`stages: split`: `engine.prepare.PrepareStage` in the
TextEncoder deployment) and `conditioned_plan` gives the denoiser the same geometry and schedule `check` gave.
Every input error is a `ClientError` naming the field (`keyframes[0].image`, `references[2]`).

A sequence-parallel replica prepares on rank 0 alone (the only rank holding the VAE encoders and the vision tower)
and hands the embedding to the other ranks (`prepared_on_rank_0`): every rank then plans and denoises from the same
`Conditions`, as a split app's denoiser does.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine.api import GenerationRequest, field_error
from engine.errors import ClientError, EngineError, FaultCause, ServerFault, UploadField, UploadKind
from engine.media import MediaError, MediaLimits, decode_audio, decode_image, decode_video
from engine.stage_data import Conditions, PromptEmbedding
from engine.stages import DecodeStage, PromptStage, VaeEncoders
from model.canvas import CanvasError, CanvasRule
from model.conditioning import (FPS, AudioReference, Conditioning, ConditioningError, ImageReference, Keyframe,
                                KeyframeAnchor, Reference, VideoReference)
from model.geometry import GeometryError, GeometryLimits, VideoGeometry, frames_for_seconds, snap_num_frames
from model.layout import H3Checkpoint
from model.prepare import ConditionEncoders, PreparedConditioning, prepare_conditioning, request_canvas
from model.schedule import H3Schedule, ScheduleError, Task
from parallel.group import SpGroup

#: Request objects whose preparation is kept (one generation calls check, then encode).
PREPARED_KEPT = 4

@dataclass(frozen=True, eq=False)
class _Entry:
    request: GenerationRequest  # held so its id() is not reused while the entry lives
    conditioning: Conditioning
    geometry: VideoGeometry
    schedule: H3Schedule
    prepared: PreparedConditioning | None = None


class ConditioningStage:
    """Keyframes and references on one engine: the prompt stage's encoder (loaded with its vision tower) and the
    VAEs' encoder halves (a fused engine's decode stage's modules, or loaded alone by a split app's prepare stage)."""

    def __init__(self, checkpoint: H3Checkpoint, prompt_stage: PromptStage, vae_encoders: VaeEncoders,
                 limits: GeometryLimits, media_limits: MediaLimits = MediaLimits(),
                 tasks: tuple[str, ...] | None = None) -> None:
        """`tasks`: what it prepares (default: the checkpoint's partition's; the prepare stage of an app serving
        both partitions: both's)."""
        self.checkpoint, self.prompt_stage, self.limits, self.media_limits = (checkpoint, prompt_stage, limits,
                                                                              media_limits)
        self._tasks = tasks if tasks is not None else checkpoint.tasks
        self.rule = CanvasRule.of(checkpoint)
        encoder = prompt_stage.encoder
        self.encoders = ConditionEncoders(encoder.tokenizer, encoder.image_processor,
                                          vae_encoders.visual, vae_encoders.audio,
                                          encoder.video_processor)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tasks(self) -> tuple[str, ...]:
        """The conditioned tasks this stage serves: its partition's (or those it was given)."""
        return tuple(task for task in self._tasks if task != Task.T2VA.value)

    def check(self, request: GenerationRequest) -> tuple[VideoGeometry, H3Schedule]:
        """The request's geometry and schedule; ClientError naming the field for any bad input."""
        return self._entry(request).geometry, self._entry(request).schedule

    def encode(self, request: GenerationRequest) -> PromptEmbedding:
        entry = self._prepared(request)
        start = time.perf_counter()
        cache = self.prompt_stage.cache
        # The prompt's own tokens were checked against max_prompt_tokens (`PromptStage.check`); the vision blocks
        # are the canvas's, bounded by the media limits.
        embeds = cache.get_or_encode_presentation(self.prompt_stage.encoder, entry.prepared.presentation)
        conditions = Conditions.of(entry.geometry.width, entry.geometry.height, entry.schedule.reference_audio,
                                   entry.prepared.conditions)
        return PromptEmbedding(embeds=embeds, encode_s=time.perf_counter() - start, cache=cache.stats(),
                               conditions=conditions)

    # --- Internals -------------------------------------------------------------------------------------

    def _entry(self, request: GenerationRequest) -> _Entry:
        with self._lock:
            entry = self._entries.get(id(request))
            if entry is not None and entry.request is request:
                return entry
        if request.task.value not in self.tasks:
            raise ClientError("keyframes" if request.keyframes else "references",
                              f"{request.task.value} is not served by this model (it serves "
                              f"{', '.join(self._tasks)})")
        try:
            conditioning = self._decoded(request)
            size = None
            if request.size_given:  # an edge left out is the default canvas's, as for t2va (`request_size`)
                default_width, default_height = self.rule.default_size()
                size = (request.width if request.width is not None else default_width,
                        request.height if request.height is not None else default_height)
            width, height = request_canvas(conditioning, size, self.rule)
            geometry = VideoGeometry.from_seconds(width, height, request.seconds, self.limits)
            schedule = H3Schedule.build(request.steps, request.flow_shift, request.audio_flow_shift, request.task,
                                        conditioning.has_reference_audio)
        except (MediaError, ConditioningError, CanvasError) as exc:
            raise _client_error(exc, request) from None
        except (GeometryError, ScheduleError) as exc:  # they name their field, value and limit
            raise field_error(exc, request) from None
        return self._keep(_Entry(request, conditioning, geometry, schedule))

    def _prepared(self, request: GenerationRequest) -> _Entry:
        entry = self._entry(request)
        if entry.prepared is None:
            size = (entry.geometry.width, entry.geometry.height)
            try:
                prepared = prepare_conditioning(entry.conditioning, request.prompt, size, entry.geometry.num_frames,
                                                self.rule, self.limits, self.encoders)
            except (ConditioningError, CanvasError) as exc:
                raise _client_error(exc, request) from None
            entry = self._keep(_Entry(request, entry.conditioning, entry.geometry, entry.schedule, prepared))
        return entry

    def _keep(self, entry: _Entry) -> _Entry:
        with self._lock:
            self._entries[id(entry.request)] = entry
            self._entries.move_to_end(id(entry.request))
            while len(self._entries) > PREPARED_KEPT:
                self._entries.popitem(last=False)
        return entry

    def _decoded(self, request: GenerationRequest) -> Conditioning:
        limits = self.media_limits
        if request.keyframes:
            num_frames = snap_num_frames(frames_for_seconds(request.seconds))
            keyframes = []
            for index, keyframe in enumerate(request.keyframes):
                field = f"keyframes[{index}]"
                try:
                    anchor = KeyframeAnchor(keyframe.anchor) if keyframe.anchor is not None else \
                        KeyframeAnchor.of_frame_index(keyframe.frame_index, num_frames, f"{field}.frame_index")
                    keyframes.append(Keyframe(decode_image(keyframe.image, f"{field}.image", limits), anchor))
                except (MediaError, ConditioningError) as exc:
                    raise _client_error(exc, request, index) from None
            return Conditioning(keyframes=tuple(keyframes))
        references: list[Reference] = []
        # A video reference is truncated to the generated clip (`normalize_references`): decode no more of it.
        clip_seconds = snap_num_frames(frames_for_seconds(request.seconds)) / FPS
        for index, reference in enumerate(request.references):
            field = f"references[{index}]"
            try:
                if reference.kind == "image":
                    references.append(ImageReference(decode_image(reference.data, field, limits)))
                elif reference.kind == "video":
                    video = decode_video(reference.data, field, limits, keep_seconds=clip_seconds)
                    references.append(VideoReference(video.frames, video.fps, video.audio, video.sample_rate))
                else:
                    audio = decode_audio(reference.data, field, limits)
                    references.append(AudioReference(audio.audio, audio.sample_rate))
            except MediaError as exc:
                raise _client_error(exc, request, index) from None
        return Conditioning(references=tuple(references))


def conditioning_stage(checkpoint: H3Checkpoint, prompt_stage: PromptStage | None, decode_stage: DecodeStage | None,
                       limits: GeometryLimits) -> ConditioningStage | None:
    """The stage of an engine that holds the vision encoder and both halves of the VAEs; None otherwise (a
    denoiser-only engine, `text_encoder.vision: false`: such an engine serves t2va only; a sequence-parallel rank
    other than 0, which takes rank 0's preparation: `prepared_on_rank_0`)."""
    if prompt_stage is None or decode_stage is None or not prompt_stage.encoder.has_vision:
        return None
    return ConditioningStage(checkpoint, prompt_stage, decode_stage.encoders(), limits)


@dataclass(frozen=True)
class RankZeroPrepared:
    """A fl2va / ref2va request as rank 0 of a sequence-parallel replica prepared it, for the other ranks: the
    embedding with its `Conditions` (on the CPU), or the error every rank raises (a bad upload refused on rank 0
    is refused alike on every rank, the group intact)."""

    embedding: PromptEmbedding | None
    error: EngineError | None = None


def prepared_on_rank_0(group: SpGroup, prepare: Callable[[], PromptEmbedding]) -> PromptEmbedding:
    """`prepare()` on rank 0, its embedding on every rank of `group` (a collective: every rank calls it for the same
    request at the same point; only rank 0's `prepare` runs). An error on rank 0 is raised on every rank: rank 0 its
    own, the others its `EngineError` (anything else: a ServerFault naming it)."""
    outcome, raised = None, None
    if group.rank == 0:
        try:
            outcome = RankZeroPrepared(prepare().cpu())
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once the other ranks know
            raised = exc
            shared = exc if isinstance(exc, EngineError) else ServerFault(
                f"rank 0 could not prepare the request's keyframes / references: {type(exc).__name__}: {exc}",
                FaultCause.RANK_FAILURE)
            outcome = RankZeroPrepared(None, shared)
    outcome = group.broadcast_object(outcome, 0, RankZeroPrepared)
    if raised is not None:
        raise raised
    if outcome.error is not None:
        raise outcome.error
    assert outcome.embedding is not None
    return outcome.embedding


def checked_conditioning(stage: ConditioningStage | None, request: GenerationRequest) -> ConditioningStage:
    """`stage`, or the ClientError a keyframe / reference request gets from an engine that cannot serve it."""
    if stage is None:
        field = "keyframes" if request.keyframes else "references"
        raise ClientError(field, f"{request.task.value} is not served by this engine (it needs Qwen3-VL's vision "
                          f"tower beside the VAEs: engine.text_encoder.vision: true); it serves t2va",
                          "engine.text_encoder.vision=true")
    return stage


def conditioned_plan(request: GenerationRequest, conditions: Conditions,
                     limits: GeometryLimits) -> tuple[VideoGeometry, H3Schedule]:
    """The geometry and schedule of a fl2va / ref2va `request` from what its prepare side made (`conditions`):
    what `ConditioningStage.check` gave there, without the media or the models. Errors as `check`'s."""
    try:
        geometry = VideoGeometry.from_seconds(conditions.width, conditions.height, request.seconds, limits)
        schedule = H3Schedule.build(request.steps, request.flow_shift, request.audio_flow_shift, request.task,
                                    conditions.reference_audio)
    except (GeometryError, ScheduleError) as exc:
        raise field_error(exc, request) from None
    return geometry, schedule


def _client_error(exc: MediaError | ConditioningError | CanvasError, request: GenerationRequest,
                  index: int | None = None) -> ClientError:
    """An upload or condition refused below the engine, as the ClientError on the field it names; about the
    request's upload `index` (here, or as the model's `ConditioningError.index` says) when it is about one."""
    detail = str(exc).removeprefix(f"{exc.field}: ")
    if index is None and isinstance(exc, ConditioningError):
        index = exc.index
    kind = UploadKind.KEYFRAMES if request.keyframes else UploadKind.REFERENCES
    return ClientError(exc.field, detail, upload=UploadField(kind, index) if index is not None else None)
