"""The engine's error family: one `kind` per way a request can fail, each carried as data across processes.

The engine raises only these (plus bugs) from its public methods; it translates the lower layers' errors
(`cache.rebuild.RebuildError`, `model.layout.CheckpointError`, `cache.plan_cache.AdmissionError`,
`model.geometry.GeometryError`, `WeightUpdateError`, ...) at its boundary, keeping their messages and
chaining them as `__cause__`. The Serve layer maps `kind` (and a fault's `cause`) to an HTTP status and body
in one place (deployments/errors.py) and never imports `cache/` or `model/`:

    EngineError                        .kind
    ├── ClientError (ValueError)       INVALID_REQUEST  4xx: a request field over a model/server limit;
    │   │                                               `field` names it, `limit` says the bound
    │   ├── AdmissionRejected          ADMISSION        the plan cache can never serve it (more plans than the slab)
    │   └── WeightsRejected            INVALID_REQUEST  an admin weight update names a checkpoint the model cannot take
    ├── ServerFault (RuntimeError)     SERVER_FAULT     5xx: the server broke, not the request; `cause` says how
    ├── Unavailable (RuntimeError)     UNAVAILABLE      no worker could take the request (dead replica, back pressure)
    └── GenerationCancelled (RuntimeError)  CANCELLED   the caller went away; the engine stopped between two steps

The same lower-layer error can land on either side: a broken shard is the server's fault while generating,
but the admin's when it names that checkpoint for a weight update.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar

__all__ = [
    "AdmissionRejected", "ClientError", "EngineError", "ErrorKind", "FaultCause", "GenerationCancelled",
    "ServerFault", "Unavailable", "UploadField", "UploadKind", "WeightsRejected",
]


class ErrorKind(str, enum.Enum):
    """How a request failed: what the HTTP layer picks a status by."""

    INVALID_REQUEST = "invalid_request"
    ADMISSION = "admission"
    SERVER_FAULT = "server_fault"
    UNAVAILABLE = "unavailable"
    CANCELLED = "cancelled"


class FaultCause(str, enum.Enum):
    """Why the server failed a request (a `ServerFault`'s `cause`): what the client is told, without paths."""

    CHECKPOINT_UNREADABLE = "checkpoint_unreadable"  # a shard or file of the served checkpoint broke mid-request
    RANK_FAILURE = "rank_failure"  # a rank of a multi-device replica died or stopped answering: it is replaced
    RANK_DIVERGENCE = "rank_divergence"  # the ranks' plan caches disagree: the replica is unhealthy
    ENGINE_UNUSABLE = "engine_unusable"  # a weight update failed while writing: the replica must be rebuilt
    WEIGHT_UPDATE_FAILED = "weight_update_failed"  # that failure, as the update's own caller sees it
    NON_FINITE_LATENTS = "non_finite_latents"  # the denoiser produced NaN/inf: weights or numerics broken
    STAGE_MISSING = "stage_missing"  # a call this engine's parts cannot serve (e.g. generate on a denoiser)

    @property
    def description(self) -> str:
        """What a client is told of it."""
        if self is FaultCause.CHECKPOINT_UNREADABLE:
            return "the server could not read its checkpoint"
        return "a server fault"

    @property
    def replica_lost(self) -> bool:
        """The replica itself is gone or being replaced (a job that ran no step may be retried elsewhere)."""
        return self is FaultCause.RANK_FAILURE


def _rebuilt(cls: type[EngineError], args: tuple[Any, ...], state: dict[str, Any]) -> EngineError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class EngineError(Exception):
    """Base of every error the engine raises on purpose. `kind` says which way the request failed."""

    kind: ClassVar[ErrorKind]

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray pickles it from a replica to its caller: rebuilt from its fields (field, limit, cause), not from
        # `args` through `__init__`, whose signature differs per class.
        return _rebuilt, (type(self), self.args, dict(self.__dict__))


class UploadKind(str, enum.Enum):
    """A request's list of uploads (its field name)."""

    KEYFRAMES = "keyframes"
    REFERENCES = "references"


@dataclasses.dataclass(frozen=True)
class UploadField:
    """Which upload of a request a refusal is about: the list and the item's index in it, as data, so a caller
    that named the uploads otherwise (the video API's `input_references[1]`) maps it without reading `field`."""

    kind: UploadKind
    index: int


class ClientError(EngineError, ValueError):
    """The request cannot be served as sent (HTTP 4xx). `field` is the request field at fault (the engine's
    request names: `steps`, `width`, `seconds`, `prompt`, `cache_dit`, `keyframes[1].image`, ...), `detail` what
    is wrong with it, `limit` the bound it broke (None when it is not a bound), `upload` the keyframe or reference
    it is about (None when it is about no single upload). The message is `"{field}: {detail}"`."""

    kind = ErrorKind.INVALID_REQUEST

    def __init__(self, field: str, detail: str, limit: str | None = None, *, upload: UploadField | None = None) -> None:
        super().__init__(f"{field}: {detail}")
        self.field, self.detail, self.limit, self.upload = field, detail, limit, upload


class AdmissionRejected(ClientError):
    """The plan cache can never serve this request on this server (e.g. more AdaLN plans than
    `adaln.gpu_plans`); retrying will not help, fewer steps will. Its field is `steps`."""

    kind = ErrorKind.ADMISSION

    def __init__(self, detail: str, limit: str | None = None) -> None:
        super().__init__("steps", detail, limit)


class WeightsRejected(ClientError):
    """A weight update's checkpoint does not fit the served model (config, keys, shapes, dtypes) or cannot
    be read; nothing was written. Its field is the update's `path`."""

    def __init__(self, detail: str) -> None:
        super().__init__("path", detail)


class ServerFault(EngineError, RuntimeError):
    """The server failed, not the request (HTTP 5xx). `cause` says how; the message (paths, ranks) stays in the
    server log."""

    kind = ErrorKind.SERVER_FAULT

    def __init__(self, message: str, cause: FaultCause) -> None:
        super().__init__(message)
        self.cause = cause


class Unavailable(EngineError, RuntimeError):
    """No worker could take the request (a dead replica, back pressure, a deployment with no replica).
    `replica_lost`: the replica died under the call (a job that ran no step may be retried elsewhere)."""

    kind = ErrorKind.UNAVAILABLE

    def __init__(self, message: str, replica_lost: bool = False) -> None:
        super().__init__(message)
        self.replica_lost = replica_lost


class GenerationCancelled(EngineError, RuntimeError):
    """The caller went away; the engine stopped between two steps."""

    kind = ErrorKind.CANCELLED
