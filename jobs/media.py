"""A video job's uploaded media: keyframes (fl2va) and references (ref2va), from the API's fields to what a job
stores and runs from.

The API fields are the ones vllm-omni's and sglang's `/v1/videos` take:

    input_reference, input_references   keyframe images (fl2va); `frame_indices` says where each one goes:
                                        0 the first frame, -1 (or the clip's last frame) the last; without it
                                        one image is the first frame, two are the first and the last
    image_reference, image_references   reference images (ref2va)
    video_reference, audio_reference    a reference video (its soundtrack too) and a reference soundtrack

Each arrives as a multipart file or, in JSON (and as a form's text field), a base64 `data:` URL. Any other URL
is refused naming the field: the server fetches nothing (no SSRF). Sizes are checked before anything is
decoded: a file over `jobs.max_file_bytes` is `UploadTooLarge` (413), a `data:` URL by its encoded length
first. Formats, pixels and durations are checked by the edge (`engine.media`, before the job is queued) and
again by the engine.

The media travel with the job (`VideoSpec.media`), stored beside its record (`jobs.store`: one row per job in
`video_job_media`, dropped once the job is finished), so an accepted job survives a replica restart.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from jobs.errors import InvalidVideoRequest, UploadTooLarge

__all__ = [
    "KEYFRAME_FIELDS",
    "LIST_FIELDS",
    "MEDIA_FIELDS",
    "KeyframeMedia",
    "ReferenceMedia",
    "Upload",
    "VideoMedia",
    "VideoTask",
    "check_frame_indices",
    "check_upload_size",
    "data_url_bytes",
    "video_media",
]

VideoTask = Literal["t2va", "fl2va", "ref2va"]
ReferenceKind = Literal["image", "video", "audio"]

#: Keyframe fields, and each reference field with the kind of file it carries (references are read in this order).
KEYFRAME_FIELDS = ("input_reference", "input_references")
REFERENCE_FIELDS: dict[str, ReferenceKind] = {
    "image_reference": "image", "image_references": "image", "video_reference": "video", "audio_reference": "audio",
}
MEDIA_FIELDS = (*KEYFRAME_FIELDS, *REFERENCE_FIELDS)
#: Fields a form may repeat (each repeat one more item).
LIST_FIELDS = ("input_references", "image_references", "frame_indices")
#: First and last: the most keyframes MiniMax-H3 takes.
MAX_KEYFRAMES = 2
FIRST_FRAME, LAST_FRAME = 0, -1

_BYTES = ConfigDict(frozen=True, extra="forbid", val_json_bytes="base64", ser_json_bytes="base64")


class KeyframeMedia(BaseModel):
    """One keyframe: the image file and the frame it anchors (0 first, -1 or the clip's last frame: last)."""

    model_config = _BYTES

    field: str = Field(..., description="The API field it came from (`input_references[1]`), for error messages.")
    image: bytes = Field(..., min_length=1, description="PNG, JPEG or WebP file bytes.")
    frame_index: int = Field(..., description="0: the clip starts on it; -1 or the last frame's index: ends on it.")


class ReferenceMedia(BaseModel):
    """One reference file of a ref2va job."""

    model_config = _BYTES

    field: str = Field(..., description="The API field it came from (`image_references[0]`).")
    kind: ReferenceKind = Field(..., description="What the file is.")
    data: bytes = Field(..., min_length=1, description="PNG/JPEG/WebP, a video, or a soundtrack.")


class VideoMedia(BaseModel):
    """A job's uploads: keyframes or references (never both: they are different tasks)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    keyframes: tuple[KeyframeMedia, ...] = ()
    references: tuple[ReferenceMedia, ...] = ()

    @property
    def task(self) -> VideoTask:
        return "fl2va" if self.keyframes else "ref2va" if self.references else "t2va"

    @property
    def nbytes(self) -> int:
        return sum(len(k.image) for k in self.keyframes) + sum(len(r.data) for r in self.references)


@dataclass(frozen=True)
class Upload:
    """One uploaded file as the edge received it: the API field (`name`, its position in a list field) and bytes."""

    name: str
    data: bytes
    index: int | None = None  # position within a list field (`input_references[1]`); None for a single field

    @property
    def field(self) -> str:
        return self.name if self.index is None else f"{self.name}[{self.index}]"


def check_upload_size(field: str, size: int, max_file_bytes: int) -> None:
    if size > max_file_bytes:
        raise UploadTooLarge(field, f"{size} bytes is over jobs.max_file_bytes={max_file_bytes}")


def data_url_bytes(value: str, field: str, max_file_bytes: int) -> bytes:
    """The bytes of a base64 `data:` URL (`data:image/png;base64,...`). Any other URL is a 422 naming the field
    (the server fetches nothing); one over the limit is `UploadTooLarge`, judged by its length before decoding."""
    scheme, colon, rest = value.partition(":")
    if not colon or scheme.strip().lower() != "data":
        shown = value if len(value) <= 48 else value[:48] + "..."
        raise InvalidVideoRequest(field, f"{shown!r} is not a data: URL; send the file itself (multipart) or "
                                         "'data:<type>;base64,<bytes>' (the server fetches no URLs)")
    header, comma, payload = rest.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise InvalidVideoRequest(field, "a data: URL must be base64: 'data:<type>;base64,<bytes>'")
    check_upload_size(field, len(payload) // 4 * 3, max_file_bytes)  # decoded size, within 2 bytes
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidVideoRequest(field, "the data: URL's payload is not valid base64") from None
    if not data:
        raise InvalidVideoRequest(field, "the data: URL holds no bytes")
    check_upload_size(field, len(data), max_file_bytes)
    return data


def video_media(uploads: Sequence[Upload], frame_indices: Sequence[int] | None) -> VideoMedia | None:
    """The job's media from its uploads (None without any). Keyframes in the order given, each at its
    `frame_indices` entry; references in the order images, video, soundtrack. InvalidVideoRequest names the
    field for a request that mixes the tasks, puts two keyframes on one frame, or gives frame_indices that do
    not match the keyframes."""
    keyframe_uploads = [u for u in uploads if u.name in KEYFRAME_FIELDS]
    reference_uploads = sorted((u for u in uploads if u.name in REFERENCE_FIELDS),
                               key=lambda u: list(REFERENCE_FIELDS).index(u.name))
    if keyframe_uploads and reference_uploads:
        raise InvalidVideoRequest(
            reference_uploads[0].field, "keyframes (input_reference) and references (image_reference, "
            "video_reference, audio_reference) are different tasks (fl2va, ref2va): send one kind")
    if frame_indices is not None and not keyframe_uploads:
        raise InvalidVideoRequest("frame_indices", "places keyframes: give them as input_reference(s)")
    if keyframe_uploads:
        return VideoMedia(keyframes=_keyframes(keyframe_uploads, frame_indices))
    if reference_uploads:
        if all(REFERENCE_FIELDS[u.name] == "audio" for u in reference_uploads):
            raise InvalidVideoRequest("audio_reference", "a soundtrack needs an image or video reference beside it")
        return VideoMedia(references=tuple(ReferenceMedia(field=u.field, kind=REFERENCE_FIELDS[u.name], data=u.data)
                                           for u in reference_uploads))
    return None


def _keyframes(uploads: list[Upload], frame_indices: Sequence[int] | None) -> tuple[KeyframeMedia, ...]:
    if len(uploads) > MAX_KEYFRAMES:
        raise InvalidVideoRequest(uploads[MAX_KEYFRAMES].field,
                                  f"{len(uploads)} keyframes: MiniMax-H3 takes at most {MAX_KEYFRAMES} (first, last)")
    if frame_indices is None:
        frame_indices = (FIRST_FRAME, LAST_FRAME)[:len(uploads)]
    if len(frame_indices) != len(uploads):
        raise InvalidVideoRequest("frame_indices", f"{len(frame_indices)} frame indices for {len(uploads)} keyframe "
                                                   "image(s): give one per input_reference")
    if len(set(frame_indices)) != len(frame_indices):
        raise InvalidVideoRequest("frame_indices", f"{list(frame_indices)}: two keyframes on one frame")
    return tuple(KeyframeMedia(field=u.field, image=u.data, frame_index=i) for u, i in zip(uploads, frame_indices))


def check_frame_indices(media: VideoMedia, num_frames: int) -> None:
    """Each keyframe's index is the first frame (0) or the last (-1, or `num_frames - 1`), once each."""
    last = num_frames - 1
    anchors = []
    for keyframe in media.keyframes:
        if keyframe.frame_index not in (FIRST_FRAME, LAST_FRAME, last):
            raise InvalidVideoRequest("frame_indices", f"{keyframe.frame_index} for {keyframe.field}: MiniMax-H3 "
                                      f"places keyframes on the first frame (0) or the last (-1 or {last})")
        anchors.append(FIRST_FRAME if keyframe.frame_index == FIRST_FRAME and last != 0 else LAST_FRAME)
    if len(set(anchors)) != len(anchors):
        raise InvalidVideoRequest("frame_indices", f"two keyframes on the {'first' if anchors[0] == 0 else 'last'} "
                                                   "frame")
