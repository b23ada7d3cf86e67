"""Finished videos and thumbnails, under a directory or any fsspec URL (shared storage on a cluster).

A job's outputs are named by its output key and the variant: `<key>.mp4` and `<key>.png`. Writes go to a
temporary name first and are then moved into place, so a reader never sees half a file (a move is atomic on
a local file system; on object stores the object appears whole when its upload completes). Reads are ranged,
for HTTP Range requests.
"""

from __future__ import annotations

import enum
import re
import secrets

import fsspec
from fsspec.spec import AbstractFileSystem

__all__ = ["OutputBlob", "OutputMissing", "OutputStore", "VideoVariant"]

_KEY = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class VideoVariant(enum.StrEnum):
    """What `GET /v1/videos/{id}/content?variant=` serves."""

    VIDEO = "video"
    THUMBNAIL = "thumbnail"

    @property
    def suffix(self) -> str:
        return ".mp4" if self is VideoVariant.VIDEO else ".png"

    @property
    def media_type(self) -> str:
        return "video/mp4" if self is VideoVariant.VIDEO else "image/png"


class OutputMissing(FileNotFoundError):
    """An output that is not (or no longer) in the store."""


class OutputBlob:
    """One stored output, open for ranged reads."""

    def __init__(self, fs: AbstractFileSystem, path: str, size: int) -> None:
        self._fs, self._path, self.size = fs, path, size

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) clipped to the size; OutputMissing if it was deleted meanwhile."""
        if offset < 0 or length < 0:
            raise ValueError(f"offset={offset} and length={length} must be >= 0")
        end = min(offset + length, self.size)
        if end <= offset:
            return b""
        try:
            return self._fs.cat_file(self._path, start=offset, end=end)
        except FileNotFoundError as exc:
            raise OutputMissing(self._path) from exc


class OutputStore:
    """put / open / delete of job outputs under `url` (a path, `file://...`, `memory://...`, `s3://...`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._fs, root = fsspec.core.url_to_fs(url)
        self._root = root.rstrip("/")
        self._fs.makedirs(self._root, exist_ok=True)

    def _path(self, key: str, variant: VideoVariant) -> str:
        # Keys are ours (job ids), but a path is never built from an unchecked string.
        if not _KEY.fullmatch(key):
            raise ValueError(f"output key {key!r} must match {_KEY.pattern}")
        return f"{self._root}/{key}{variant.suffix}"

    def put(self, key: str, variant: VideoVariant, data: bytes) -> None:
        path = self._path(key, variant)
        partial = f"{path}.{secrets.token_hex(4)}.partial"
        self._fs.pipe_file(partial, data)
        self._fs.mv(partial, path)

    def open(self, key: str, variant: VideoVariant) -> OutputBlob:
        path = self._path(key, variant)
        try:
            size = int(self._fs.size(path))
        except FileNotFoundError as exc:
            raise OutputMissing(path) from exc
        return OutputBlob(self._fs, path, size)

    def delete(self, key: str) -> None:
        """Delete every variant of `key`; missing ones are fine (deletion is idempotent)."""
        for variant in VideoVariant:
            try:
                self._fs.rm_file(self._path(key, variant))
            except FileNotFoundError:
                pass
