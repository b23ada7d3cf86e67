"""How a failure reaches the caller and the log: HTTP status and body, and the log level it deserves.

The engine raises `engine.errors` types (it translates the lower layers' errors at its boundary), so the
sorting here needs neither `cache/` nor `model/`:

    status  type            cause
    400     invalid_json    body is not JSON (ingress)
    413     payload_too_large  body over http.max_body_bytes (ingress)
    422     invalid_request schema (ingress) or model/server limits, plan admission (engine ClientError)
    499     cancelled       the caller went away (GenerationCancelled)
    500     server_error    ServerFault (e.g. a checkpoint shard unreadable at rebuild time) or a bug
    503     unavailable     no worker could take it (dead replica, back pressure)
    504     timeout         longer than http.request_timeout_s (ingress)

Client errors (4xx) are logged as one INFO line; server faults at ERROR with the traceback. Serve itself
logs every exception a replica method raises as ERROR "Request failed." with a traceback, which for a
handle caller's bad request (`{"steps": "8"}`) reads as a server failure: `install_client_error_log_filter`
turns those records into one INFO line when the exception is a `ClientError`.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from engine.errors import ClientError, GenerationCancelled, ServerFault

logger = logging.getLogger("ray.serve")

#: The logger Serve's replicas report failed requests on ("Request failed." + traceback).
SERVE_LOGGER_NAME = "ray.serve"


class RequestError(Exception):
    """A request we refuse; carries the HTTP status and the body."""

    def __init__(self, status: int, kind: str, message: str, errors: list[dict[str, Any]] | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.errors = status, kind, message, errors
        self.retry_after_s = retry_after_s  # sent as Retry-After

    @property
    def is_client_error(self) -> bool:
        return 400 <= self.status < 500

    def response_body(self) -> dict[str, Any]:
        return {"error": {"type": self.kind, "message": self.message, "errors": self.errors}}

    def response(self) -> JSONResponse:
        headers = {"retry-after": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse(status_code=self.status, content=self.response_body(), headers=headers)

    def for_handle_caller(self) -> Exception:
        """What a Python handle caller gets: ClientError (a ValueError) for 4xx, RuntimeError otherwise."""
        return ClientError(self.message) if self.is_client_error else RuntimeError(self.message)


def validation_error(exc: ValidationError) -> RequestError:
    """A pydantic error as a 422 naming every bad field."""
    errors = [
        {"loc": list(err["loc"]), "msg": err["msg"], "type": err["type"]} for err in exc.errors(include_url=False)
    ]
    summary = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors)
    return RequestError(422, "invalid_request", summary, errors)


#: ServerFault kinds of an unreadable checkpoint (others: a lost or diverged rank of a multi-GPU replica, ...).
CHECKPOINT_FAULTS = ("RebuildError", "CheckpointError")


def fault_cause(fault: ServerFault) -> str:
    """What a ServerFault tells the client of its cause (paths and ranks stay in the log)."""
    return "the server could not read its checkpoint" if fault.kind in CHECKPOINT_FAULTS else "a server fault"


def unwrap(exc: BaseException) -> BaseException:
    """The exception a replica raised: Ray hands it to the caller wrapped in a RayTaskError."""
    return exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc


def worker_error(exc: BaseException, request_id: str) -> RequestError:
    """A failed worker call as the RequestError the caller sees."""
    cause = unwrap(exc)
    if isinstance(cause, ServerFault):
        # The server broke, not the request: 5xx naming the type, details (paths, ranks) in the log only.
        what = fault_cause(cause)
        logger.error("generation %s failed: %s", request_id, what, exc_info=exc)
        return RequestError(500, "server_error", f"generation failed: {cause.kind} ({what}; retry later)")
    if isinstance(cause, ClientError):
        return RequestError(422, "invalid_request", str(cause))
    if isinstance(cause, GenerationCancelled):
        return RequestError(499, "cancelled", "the request was cancelled")
    if isinstance(exc, (RayActorError, BackPressureError, DeploymentUnavailableError)):
        return RequestError(503, "unavailable", f"no worker could take the request: {type(exc).__name__}")
    logger.error("generation %s failed", request_id, exc_info=exc)
    # The replica's exception type (not Ray's wrapper, "RayTaskError(RuntimeError)"); its message stays in the log.
    return RequestError(500, "server_error", f"generation failed: {type(cause).__name__}")


class ClientErrorLogFilter(logging.Filter):
    """Turns Serve's ERROR "Request failed." record with a ClientError's traceback into one INFO line.

    A filter on the logger (not a handler) so it runs before any handler sees the record; records of every
    other exception pass unchanged (a server fault keeps its ERROR and traceback).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, ClientError):
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.msg, record.args = "request refused (client error): %s", (str(exc).replace("\n", " "),)
            record.exc_info = record.exc_text = None
            record.stack_info = None
        return True


def install_client_error_log_filter(logger_name: str = SERVE_LOGGER_NAME) -> None:
    """Add `ClientErrorLogFilter` to `logger_name` once per process (replicas call it in __init__)."""
    target = logging.getLogger(logger_name)
    if not any(isinstance(f, ClientErrorLogFilter) for f in target.filters):
        target.addFilter(ClientErrorLogFilter())
