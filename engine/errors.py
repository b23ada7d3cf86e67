"""The engine's error types: what a caller (the HTTP layer) needs to pick a status, and nothing more.

The engine raises only these (plus bugs) from its public methods; it translates the lower layers' errors
(`cache.rebuild.RebuildError`, `model.layout.CheckpointError`, `cache.plan_cache.AdmissionError`,
`WeightUpdateError`, plain `ValueError`s from validation) at its boundary, keeping their messages and
chaining them as `__cause__`. So `deployments/` sorts errors by these classes and never imports `cache/`
or `model/`:

    EngineError
    ├── ClientError (ValueError)       4xx: the request is malformed or over a model/server limit
    │   ├── AdmissionRejected          the plan cache can never serve it (e.g. more plans than the slab holds)
    │   └── WeightsRejected            an admin weight update names a checkpoint the served model cannot take
    ├── ServerFault (RuntimeError)     5xx: the server broke, not the request (e.g. a checkpoint shard
    │                                  unreadable at rebuild time); `kind` names the lower layer's error type
    └── GenerationCancelled (RuntimeError)   the caller went away; the engine stopped between two steps

The same lower-layer error can land on either side: a broken shard is the server's fault while generating,
but the admin's when it names that checkpoint for a weight update.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ClientError(EngineError, ValueError):
    """The request cannot be served as sent (HTTP 4xx). The message names the field and the limit."""


class AdmissionRejected(ClientError):
    """The plan cache can never serve this request on this server (e.g. more AdaLN plans than
    `adaln.gpu_plans`); retrying will not help, a smaller request will."""


class WeightsRejected(ClientError):
    """A weight update's checkpoint does not fit the served model (config, keys, shapes, dtypes) or cannot
    be read; nothing was written."""


class ServerFault(EngineError, RuntimeError):
    """The server failed, not the request (HTTP 5xx); e.g. a checkpoint shard unreadable at rebuild time.

    `kind` is the lower layer's error type name (e.g. "RebuildError"): the HTTP layer shows it, the details
    (paths) stay in the server log.
    """

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):
        # Crosses process boundaries (Ray pickles it): rebuild from both fields, not from `args` alone.
        return type(self), (str(self), self.kind)


class GenerationCancelled(EngineError, RuntimeError):
    """The caller went away; the engine stopped between two steps."""


#: ServerFault kind of a multi-device replica that lost a rank (or whose ranks diverged): it is being replaced.
RANK_FAILURE = "RankFailure"
