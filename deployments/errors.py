"""How a failure reaches the caller and the log: HTTP status and body, and the log level it deserves. The one
place errors become HTTP, for every route (`/v1/generations`, `/v1/videos`, admin, routing refusals).

The engine raises its error family (`engine.errors`, sorted by `kind`; a fault by its `cause`), the job layer
its own (`jobs.errors`); a failed Serve call is first read as an engine error (`engine_error`: Ray's wrapper
taken off, a dead replica or back pressure as `Unavailable`), then mapped here:

    status  type                    cause
    400     invalid_json            body is not JSON
    400     invalid_id              a path-like or malformed video id
    401     unauthorized            no listed API key / admin token
    404     not_found               no such route, job (or another client's)
    405     method_not_allowed      a method the route does not take
    409     conflict / cancelled    a job in the wrong state (cancelled meanwhile: sync)
    410     expired                 a job's output was deleted by retention
    413     payload_too_large       body over http.max_body_bytes / jobs.max_body_bytes
    415     unsupported_media_type  a video body that is neither JSON nor a form
    416     range_not_satisfiable   a Range past the end
    422     invalid_request         schema (pydantic), a model/server limit (`ClientError`: its `field` in `errors`),
                                    plan admission, a job-layer limit (`InvalidVideoRequest`)
    429     queue_full              a model's job queue at its bound (Retry-After)
    499     cancelled               the caller went away (GenerationCancelled)
    500     server_error            ServerFault (its cause, never a path) or a bug (its type)
    503     unavailable/overloaded  no worker could take it; the job database is down; the ingress is full
    504     timeout                 longer than http.request_timeout_s / jobs.sync_timeout_s

Client errors (4xx) are logged as one INFO line; server faults at ERROR with the traceback. Serve itself
logs every exception a replica method raises as ERROR "Request failed." with a traceback, which for a
handle caller's bad request (`{"steps": "8"}`) reads as a server failure: `install_client_error_log_filter`
turns those records into one INFO line when the exception is a `ClientError`.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException

from deployments.schemas import ErrorBody, ErrorResponse, FieldError
from engine.errors import ClientError, EngineError, ErrorKind, ServerFault, Unavailable
from jobs.errors import (InvalidVideoRequest, JobConflict, JobNotFound, OutputExpired, QueueFull, StoreUnavailable,
                         UploadTooLarge)

logger = logging.getLogger("ray.serve")

#: The logger Serve's replicas report failed requests on ("Request failed." + traceback).
SERVE_LOGGER_NAME = "ray.serve"


class RequestError(Exception):
    """A request we refuse: HTTP status, error type, message, per-field errors, headers (Retry-After, Allow)."""

    def __init__(self, status: int, kind: str, message: str, errors: list[FieldError] | None = None,
                 retry_after_s: int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.errors = status, kind, message, errors
        self.retry_after_s = retry_after_s  # sent as Retry-After
        self.headers = dict(headers or {})
        if retry_after_s is not None:
            self.headers["retry-after"] = str(retry_after_s)

    @property
    def is_client_error(self) -> bool:
        return 400 <= self.status < 500

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(type=self.kind, message=self.message, errors=self.errors))

    def response_body(self) -> dict[str, Any]:
        return self.body().model_dump(mode="json")

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.response_body(), headers=self.headers or None)

    def for_handle_caller(self) -> Exception:
        """What a Python handle caller gets: ClientError (a ValueError) for 4xx, RuntimeError otherwise."""
        if not self.is_client_error:
            return RuntimeError(self.message)
        field = ".".join(map(str, self.errors[0].loc)) if self.errors and self.errors[0].loc else "request"
        return ClientError(field, self.message.removeprefix(f"{field}: "))


def invalid_field(field: str, message: str) -> RequestError:
    """A 422 naming one field (`message` already says `field: ...`)."""
    return RequestError(422, "invalid_request", message, [FieldError(loc=[field], msg=message, type="value_error")])


def validation_error(exc: ValidationError | RequestValidationError) -> RequestError:
    """A pydantic error (a body, or FastAPI's check of a query parameter) as a 422 naming every bad field."""
    raw = exc.errors(include_url=False) if isinstance(exc, ValidationError) else exc.errors()
    errors = [FieldError(loc=[p if isinstance(p, int) else str(p) for p in err["loc"]], msg=err["msg"],
                         type=err["type"]) for err in raw]
    summary = "; ".join(f"{'.'.join(map(str, e.loc)) or 'body'}: {e.msg}" for e in errors)
    return RequestError(422, "invalid_request", summary, errors)


# --------------------------------------------------------------------------------------------------
# Engine errors (what a worker call raised)
# --------------------------------------------------------------------------------------------------


def unwrap(exc: BaseException) -> BaseException:
    """The exception a replica raised: Ray hands it to the caller wrapped in a RayTaskError."""
    return exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc


def engine_error(exc: BaseException) -> EngineError | None:
    """A failed worker call as the engine error family: the replica's own error, or `Unavailable` when no
    replica could take it (it died, back pressure, no replica); None for anything else (a bug)."""
    cause = unwrap(exc)
    if isinstance(cause, EngineError):
        return cause
    if isinstance(exc, RayActorError) or isinstance(cause, RayActorError):
        return Unavailable(f"no worker could take the request: {type(cause).__name__}", replica_lost=True)
    if isinstance(exc, (BackPressureError, DeploymentUnavailableError)):
        return Unavailable(f"no worker could take the request: {type(exc).__name__}")
    return None


def fault_summary(fault: ServerFault) -> str:
    """What a client is told of a ServerFault: its cause, never its message (paths and ranks stay in the log)."""
    return f"{fault.cause.value} ({fault.cause.description})"


def http_error(error: EngineError) -> RequestError:
    """An engine error's HTTP status and body."""
    if isinstance(error, ClientError):  # INVALID_REQUEST and ADMISSION: the request's field, not the server
        return invalid_field(error.field, str(error))
    if isinstance(error, ServerFault):
        cause = error.cause
        return RequestError(500, "server_error", f"generation failed: {cause.value} ({cause.description}; retry later)")
    if error.kind is ErrorKind.UNAVAILABLE:
        return RequestError(503, "unavailable", str(error))
    if error.kind is ErrorKind.CANCELLED:
        return RequestError(499, "cancelled", "the request was cancelled")
    raise AssertionError(f"no HTTP status for {error.kind}")  # every kind is listed above


def worker_error(exc: BaseException, request_id: str) -> RequestError:
    """A failed worker call as the RequestError the caller sees; server faults and bugs logged at ERROR."""
    error = engine_error(exc)
    if error is None:
        logger.error("generation %s failed", request_id, exc_info=exc)
        # The replica's exception type (not Ray's wrapper, "RayTaskError(RuntimeError)"); its message stays in the log.
        return RequestError(500, "server_error", f"generation failed: {type(unwrap(exc)).__name__}")
    if isinstance(error, ServerFault):
        logger.error("generation %s failed: %s", request_id, error.cause.description, exc_info=exc)
    return http_error(error)


# --------------------------------------------------------------------------------------------------
# Job-layer errors (the video API)
# --------------------------------------------------------------------------------------------------

#: The job layer's refusals the exception handlers answer.
JOB_ERRORS = (InvalidVideoRequest, JobNotFound, JobConflict, OutputExpired, QueueFull, StoreUnavailable)


def job_error(exc: Exception) -> RequestError:
    """A job-layer error's HTTP status and body."""
    if isinstance(exc, UploadTooLarge):  # before its base class: a 413 naming the field
        return RequestError(413, "payload_too_large", str(exc),
                            [FieldError(loc=[exc.field], msg=str(exc), type="too_large")])
    if isinstance(exc, InvalidVideoRequest):
        return invalid_field(exc.field, str(exc))
    if isinstance(exc, JobNotFound):
        return RequestError(404, "not_found", str(exc))
    if isinstance(exc, JobConflict):
        return RequestError(409, "conflict", str(exc))
    if isinstance(exc, OutputExpired):
        return RequestError(410, "expired", str(exc))
    if isinstance(exc, QueueFull):
        return RequestError(429, "queue_full", str(exc), retry_after_s=exc.retry_after_s or 1)
    if isinstance(exc, StoreUnavailable):
        logger.error("video job store unavailable: %s", exc)
        return RequestError(503, "unavailable", "the job database is unavailable; retry later", retry_after_s=5)
    raise TypeError(f"not a job-layer error: {type(exc).__name__}")


# --------------------------------------------------------------------------------------------------
# FastAPI exception handlers (registered once per app)
# --------------------------------------------------------------------------------------------------

#: Error types of Starlette's own refusals (a path no route has, a method the route does not take).
_ROUTING_ERROR_KINDS = {404: "not_found", 405: "method_not_allowed"}


def _logged(error: RequestError) -> RequestError:
    if error.status >= 500:
        logger.warning("request failed (%d): %s", error.status, error.message)
    return error


async def _request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return _logged(exc).response()


async def _engine_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, EngineError)
    return _logged(http_error(exc)).response()


async def _job_error(request: Request, exc: Exception) -> Response:
    return _logged(job_error(exc)).response()


async def _query_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc).response()


async def routing_error_response(request: Request, exc: Exception) -> Response:
    """Starlette's own HTTPException (FastAPI: `{"detail": ...}`) in the app's error shape; its headers (405:
    `Allow`) kept."""
    assert isinstance(exc, HTTPException)
    kind = _ROUTING_ERROR_KINDS.get(exc.status_code, "invalid_request" if exc.status_code < 500 else "server_error")
    path = request.url.path if len(request.url.path) <= 128 else request.url.path[:128] + "..."
    return RequestError(exc.status_code, kind, f"{request.method} {path}: {exc.detail}", headers=exc.headers).response()


def install_error_handlers(app: FastAPI) -> None:
    """Every error family's handler on `app`: a route raises RequestError, an engine error or a job-layer error
    and the client gets its status and body; FastAPI's own query checks and routing refusals get the same body."""
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(EngineError, _engine_error)
    for error_type in JOB_ERRORS:
        app.add_exception_handler(error_type, _job_error)
    app.add_exception_handler(RequestValidationError, _query_error)
    app.add_exception_handler(HTTPException, routing_error_response)


# --------------------------------------------------------------------------------------------------
# Logs
# --------------------------------------------------------------------------------------------------


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
