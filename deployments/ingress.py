"""HTTP + handle front door: validates requests, holds the worker handle, encodes responses.

Routes: `POST /v1/generations`, `GET /healthz`, `GET /v1/models`; OpenAPI at `/docs`.
Python callers: `serve.get_app_handle("ditserve").generate.remote({...})` -> `GenerationResponse`.

Status codes: 400 malformed JSON, 413 body over `http.max_body_bytes`, 422 a request that fails the schema
or the loaded model's limits (message names the field and the limit), 503 worker unavailable, 504 timeout.

No `from __future__ import annotations` here: FastAPI must see real annotations (`Request`) on methods that
`@serve.ingress` rewraps.
"""


import asyncio
import json
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from actors.api import GenerationCancelled, GenerationRequest, schedule_for
from deployments.schemas import ErrorResponse, GenerationResponse, HttpOptions

logger = logging.getLogger("ray.serve")

api = FastAPI(
    title="ditserve",
    description="Text to video+audio latents with a MiniMax-H3-shaped DiT.",
    version="0.1.0",
)

_ERRORS = {
    400: {"model": ErrorResponse, "description": "Malformed JSON."},
    413: {"model": ErrorResponse, "description": "Body larger than http.max_body_bytes."},
    422: {"model": ErrorResponse, "description": "Invalid request: schema or model limits."},
    503: {"model": ErrorResponse, "description": "No healthy worker."},
    504: {"model": ErrorResponse, "description": "Generation took longer than http.request_timeout_s."},
}


class RequestError(Exception):
    """A request we refuse; carries the HTTP status and the body."""

    def __init__(self, status: int, kind: str, message: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.errors = status, kind, message, errors

    def response(self) -> JSONResponse:
        body = {"error": {"type": self.kind, "message": self.message, "errors": self.errors}}
        return JSONResponse(status_code=self.status, content=body)


def _validation_error(exc: ValidationError) -> RequestError:
    errors = [
        {"loc": list(err["loc"]), "msg": err["msg"], "type": err["type"]} for err in exc.errors(include_url=False)
    ]
    summary = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors)
    return RequestError(422, "invalid_request", summary, errors)


def parse_request(payload: Any) -> GenerationRequest:
    """dict | GenerationRequest -> GenerationRequest, or RequestError(422) naming the bad fields."""
    if isinstance(payload, GenerationRequest):
        return payload
    if not isinstance(payload, dict):
        raise RequestError(422, "invalid_request", f"body must be a JSON object, got {type(payload).__name__}")
    try:
        return GenerationRequest.model_validate(payload)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _engine_value_error(exc: BaseException) -> str | None:
    """The message of a ValueError raised by the engine (Ray wraps it in RayTaskError(ValueError))."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ValueError):
        return str(cause)
    if isinstance(exc, ValueError) and cause is None:
        return str(exc)
    return None


def _new_id() -> str:
    return f"gen-{uuid.uuid4().hex[:24]}"


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    def __init__(self, worker: DeploymentHandle, http: dict[str, Any] | None = None) -> None:
        self._worker = worker
        self._http = HttpOptions.model_validate(http or {})
        self._model_card: dict[str, Any] | None = None

    # ---------------------------------------------------------------------------------------------
    # The one generation path (HTTP and handle callers both come through here)
    # ---------------------------------------------------------------------------------------------

    async def _generate(self, request: GenerationRequest, request_id: str) -> GenerationResponse:
        # The schedule key lets the router keep requests of one schedule on the replica with warm AdaLN plans.
        response = self._worker.generate.remote(request, schedule_key=schedule_for(request).schedule_key)
        try:
            result = await asyncio.wait_for(response, timeout=self._http.request_timeout_s)
        except asyncio.TimeoutError:
            response.cancel()  # stops the engine at its next step (a caller that goes away cancels by itself)
            raise RequestError(
                504, "timeout", f"generation took longer than http.request_timeout_s={self._http.request_timeout_s}"
            ) from None
        except Exception as exc:  # noqa: BLE001 - sorted below
            message = _engine_value_error(exc)
            if message is not None:
                raise RequestError(422, "invalid_request", message) from None
            if isinstance(getattr(exc, "cause", exc), GenerationCancelled):
                raise RequestError(499, "cancelled", "the request was cancelled") from None
            if isinstance(exc, (RayActorError, BackPressureError, DeploymentUnavailableError)):
                raise RequestError(503, "unavailable", f"no worker could take the request: {type(exc).__name__}") from None
            logger.exception("generation %s failed", request_id)
            raise RequestError(500, "server_error", f"generation failed: {type(exc).__name__}") from None
        # Encoding latents and the PNG is CPU work: keep it off the event loop.
        return await asyncio.to_thread(
            GenerationResponse.from_result, result, request_id=request_id, return_latents=request.return_latents
        )

    async def generate(self, request: dict[str, Any] | GenerationRequest) -> GenerationResponse:
        """Handle API: `serve.get_app_handle(app).generate.remote({...})`. Raises ValueError on bad input."""
        try:
            return await self._generate(parse_request(request), _new_id())
        except RequestError as exc:
            if exc.status in (400, 413, 422):
                raise ValueError(exc.message) from None
            raise RuntimeError(exc.message) from None

    # ---------------------------------------------------------------------------------------------
    # HTTP
    # ---------------------------------------------------------------------------------------------

    @api.post(
        "/v1/generations",
        response_model=GenerationResponse,
        responses=_ERRORS,
        summary="Generate video+audio latents from a prompt.",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": GenerationRequest.model_json_schema()}},
            }
        },
    )
    async def create_generation(self, http_request: Request) -> JSONResponse:
        request_id = _new_id()
        try:
            payload = await self._read_json(http_request)
            response = await self._generate(parse_request(payload), request_id)
        except RequestError as exc:
            if exc.status < 500:
                logger.info("request %s refused (%d): %s", request_id, exc.status, exc.message)
            return exc.response()
        return JSONResponse(content=response.model_dump(mode="json"))

    async def _read_json(self, http_request: Request) -> Any:
        limit = self._http.max_body_bytes
        declared = http_request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(413, "payload_too_large", f"body of {declared} bytes exceeds http.max_body_bytes={limit}")
        body = await http_request.body()
        if len(body) > limit:
            raise RequestError(413, "payload_too_large", f"body of {len(body)} bytes exceeds http.max_body_bytes={limit}")
        try:
            # Python's json accepts NaN/Infinity; the schema then rejects them with a field-level message.
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(400, "invalid_json", f"body is not valid JSON: {exc}") from None

    @api.get("/healthz", summary="200 when a worker replica answers its health check.")
    async def healthz(self) -> JSONResponse:
        try:
            worker = await asyncio.wait_for(self._worker.health.remote(), timeout=self._http.health_timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure means not healthy
            message = f"worker health check failed: {type(exc).__name__}"
            return RequestError(503, "unavailable", message).response()
        return JSONResponse(content={"status": "ok", "worker": worker})

    @api.get("/v1/models", summary="The served model, its limits and engine config.")
    async def models(self) -> JSONResponse:
        if self._model_card is None:
            try:
                self._model_card = await asyncio.wait_for(
                    self._worker.describe.remote(), timeout=self._http.health_timeout_s
                )
            except Exception as exc:  # noqa: BLE001
                return RequestError(503, "unavailable", f"worker describe failed: {type(exc).__name__}").response()
        return JSONResponse(content={"object": "list", "data": [self._model_card]})

