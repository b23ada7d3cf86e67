"""Request bodies read within a size limit and parsed as JSON, strictly: refuses what `json.loads` would let
through silently or turn into a server error (used by the ingress and the `/v1/videos` routes; no Ray here).

`read_body` stops at the limit: a chunked upload has no Content-Length to refuse up front, and reading it
whole first (`Request.body()`) would hold a client's gigabytes in the replica's memory before the 413.

- a key given twice in one object (`json.loads` keeps the last: a proxy that checked the first would be fooled);
- an integer literal over Python's 4300-digit limit (`json.loads` raises a bare ValueError);
- nesting past the parser's recursion limit.
NaN and Infinity literals parse; the schemas refuse them with a field-level message.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

__all__ = ["JsonBodyError", "loads_body", "read_body"]


class JsonBodyError(ValueError):
    """A body refused before any schema: HTTP status, error type, message."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


async def read_body(request: Request, max_bytes: int, setting: str) -> bytes:
    """The body, or JsonBodyError 413 payload_too_large naming `setting` (the config key of `max_bytes`) as soon
    as the declared length or the bytes received pass `max_bytes`; the rest is never read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(f"body of {declared} bytes", max_bytes, setting)
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > max_bytes:
            raise _too_large(f"body of more than {max_bytes} bytes", max_bytes, setting)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(what: str, max_bytes: int, setting: str) -> JsonBodyError:
    return JsonBodyError(413, "payload_too_large", f"{what} exceeds {setting}={max_bytes}")


def loads_body(body: bytes) -> Any:
    """The parsed body, or JsonBodyError: 400 invalid_json (not JSON), 422 invalid_request (a key twice)."""
    try:
        return json.loads(body, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        shown = exc.key if len(exc.key) <= 64 else exc.key[:64] + "..."
        raise JsonBodyError(422, "invalid_request", f"{shown}: given more than once") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise JsonBodyError(400, "invalid_json", f"body is not valid JSON: {exc}") from None
    except RecursionError:  # e.g. "[[[[..." deeper than the parser's recursion limit
        raise JsonBodyError(400, "invalid_json", "body is not valid JSON: nested too deeply") from None
    except ValueError:  # int() refuses literals over 4300 digits
        raise JsonBodyError(400, "invalid_json", "body is not valid JSON: a number has too many digits") from None
