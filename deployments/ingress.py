"""HTTP + handle front door: validates requests, holds the worker handles, encodes responses.

One ingress serves every partition of the app (`deployments/partitions.py`): the request's task (and `model`)
picks the partition's Worker; `GET /v1/models` lists each served model, `/healthz` checks each Worker.

Video jobs (`/v1/videos`: create, get, list, content with Range, events, cancel, delete, sync; routes and
statuses in deployments/videos.py) run through the replica's `JobService`, which `deployments/video_jobs.py`
starts from the async constructor (once the worker has described the model) and stops in `__del__`.

Research routes: `POST /v1/generations` (`?stream=true` or `POST /v1/generations:stream`: server-sent events
`progress` per step, then `result`), `GET /healthz`, `GET /v1/models`, `POST|GET /admin/weights` (bearer
token; fleet weight update: deployments/admin.py); OpenAPI at `/docs`. Routing only: statuses and log
levels of failures live in deployments/errors.py, the weight update's orchestration in deployments/admin.py.
Python callers: `serve.get_app_handle("ditserve").generate.remote({...})` -> `GenerationResponse`;
`handle.options(stream=True).generate_stream.remote({...})` yields `ProgressEvent`s, then the response.

Status codes: 400 malformed JSON, 413 body over `http.max_body_bytes`, 422 a request that fails the schema
or the loaded model's limits (message names the field and the limit), 500 server fault, 503 worker
unavailable, 504 timeout. Handle callers get a ClientError (a ValueError) for what would be a 4xx.

No `from __future__ import annotations` here: FastAPI must see real annotations (`Request`) on methods that
`@serve.ingress` rewraps.
"""


import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.admin import WeightAdmin
from deployments.generation import GenerationRunner, runner_for
from deployments.errors import (RequestError, install_client_error_log_filter, install_error_handlers,
                               validation_error, worker_error)
from deployments.json_body import JsonBodyError, loads_body, read_body
from deployments.metrics import PendingGenerationsGauge, RetryAfterResponses, RoutingMetrics
from deployments.moving_mean import moving_mean
from deployments.partitions import PartitionName, ServedModels, ServedPartition, worker_deployment_name
from deployments.playground import playground_response
from deployments.schemas import (
    AdminOptions,
    ErrorResponse,
    GenerationResponse,
    HttpOptions,
    ProgressEvent,
    ServeTimings,
    VideoOptions,
)
from deployments.video_jobs import VideoJobs
from deployments.videos import VideoApiSlot, videos_router
from engine.api import GenerationRequest, with_adapter_defaults
from engine.errors import ClientError
from engine.pipeline import PipelineResult
from jobs.config import AuthConfig, JobsConfig

logger = logging.getLogger("ray.serve")

api = FastAPI(
    title="ditserve",
    description="MiniMax-H3 text to video+audio: video jobs (/v1/videos, MP4s) and, for research, "
    "generations with latents (/v1/generations).",
    version="0.1.0",
)
#: This replica's video API: routes are declared with the app, the job service exists once the replica started.
VIDEO_API = VideoApiSlot()
api.include_router(videos_router(VIDEO_API.get))
install_error_handlers(api)  # every route's errors (and 404 / 405) in the one error shape, not {"detail"}
api.add_middleware(RetryAfterResponses)  # counts every 429 / 503 sent with Retry-After, whoever answered it

_ERRORS = {
    400: {"model": ErrorResponse, "description": "Malformed JSON."},
    413: {"model": ErrorResponse, "description": "Body larger than http.max_body_bytes."},
    422: {"model": ErrorResponse, "description": "Invalid request: schema or model limits."},
    503: {"model": ErrorResponse, "description": "No healthy worker, or http.max_pending_generations reached "
          "(then with Retry-After)."},
    504: {"model": ErrorResponse, "description": "Generation took longer than http.request_timeout_s."},
}


def parse_request(payload: Any) -> GenerationRequest:
    """dict | GenerationRequest -> GenerationRequest, or RequestError(422) naming the bad fields. A dict of JSON's
    types (an HTTP body) is validated as JSON: arrays for the keyframes and references, base64 for their bytes."""
    if isinstance(payload, GenerationRequest):
        # Re-checked: an object made with model_construct() (or mutated) skipped validation.
        payload = payload.model_dump()
    if not isinstance(payload, dict):
        raise RequestError(422, "invalid_request", f"body must be a JSON object, got {type(payload).__name__}")
    try:
        return GenerationRequest.model_validate_json(json.dumps(payload, allow_nan=False))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ValidationError):
            raise validation_error(exc) from None
        # Not JSON's types (a handle caller's bytes, tuples or NaN): validated as the Python objects they are.
    try:
        return GenerationRequest.model_validate(payload)
    except ValidationError as exc:
        raise validation_error(exc) from None


class PendingGenerations:
    """`http.max_pending_generations`: the generations this ingress replica holds, running or waiting for a
    worker. One over the bound is refused at once (503 + Retry-After) rather than queued behind work that would
    outlast its timeout. Retry-After: the mean time of recent generations here (a slot frees about that often or
    sooner), at least 1 s. Touched only from the replica's event loop. `on_count`: told the count each time it
    changes (the replica's gauge)."""

    def __init__(self, limit: int | None, on_count: Callable[[int], None] = lambda count: None) -> None:
        self.limit, self.count = limit, 0
        self._on_count = on_count
        self._mean_s: float | None = None

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        if self.limit is not None and self.count >= self.limit:
            raise RequestError(503, "overloaded", f"the server holds {self.count} generations "
                               f"(http.max_pending_generations={self.limit}); retry later",
                               retry_after_s=self.retry_after_s())
        self.count += 1
        self._on_count(self.count)
        start = time.perf_counter()
        try:
            yield
            seconds = time.perf_counter() - start  # completed ones only: a refusal says nothing of the pace
            self._mean_s = moving_mean(self._mean_s, seconds)
        finally:
            self.count -= 1
            self._on_count(self.count)

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self._mean_s or 0.0))


#: `?stream=` values of POST /v1/generations; any other is a 422.
_STREAM_ON = ("1", "true", "yes")
_STREAM_OFF = ("", "0", "false", "no")


def _sse_event(name: str, item: Any) -> str:
    return f"event: {name}\ndata: {item.model_dump_json()}\n\n"


def _new_id() -> str:
    return f"gen-{uuid.uuid4().hex[:24]}"


def served_model(card: dict[str, Any]) -> dict[str, Any]:
    """A `GET /v1/models` entry: the worker's `describe()` with its tasks beside its limits (`limits.tasks`)."""
    limits = card.get("limits") or {}
    return {**card, "tasks": list(limits.get("tasks", ("t2va",)))}


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    async def __init__(
        self, worker: DeploymentHandle, http: dict[str, Any] | None = None, admin: dict[str, Any] | None = None,
        jobs: dict[str, Any] | None = None, auth: dict[str, Any] | None = None, videos: dict[str, Any] | None = None,
        text_encoder: DeploymentHandle | None = None, decoder: DeploymentHandle | None = None,
        partitions: list[PartitionName] | None = None, more_workers: list[DeploymentHandle] | None = None,
    ) -> None:
        """`text_encoder` and `decoder`: the other stages of a split app (both or neither); both APIs then run
        the pipeline here over the three handles (`deployments/generation.py`). `partitions`: what `worker` and
        each of `more_workers` serve, in that order (`AppConfig.partitions`; default: `worker` serves FL2VA);
        the task picks one (`deployments/partitions.py`)."""
        install_client_error_log_filter()  # a handle caller's bad request is one INFO line, not an ERROR traceback
        self._worker = worker  # the default partition's: health, admin weight updates
        workers = [worker, *(more_workers or ())]
        partitions = partitions or ["fl2va"]
        if len(partitions) != len(workers):
            raise ValueError(f"partitions {partitions} and {len(workers)} worker handles: one worker per partition")
        self._http = HttpOptions.model_validate(http or {})
        self._models = ServedModels(
            [ServedPartition(partition, handle, runner_for(handle, text_encoder, decoder))
             for partition, handle in zip(partitions, workers)], self._http.health_timeout_s)
        self._pending = PendingGenerations(self._http.max_pending_generations, PendingGenerationsGauge().set)
        context = serve.get_replica_context()
        self._admin = WeightAdmin(worker, AdminOptions.model_validate(admin or {}), context.app_name)
        # Each partition's Worker has its own router: its counters are reported under its deployment's name.
        self._routing_metrics = RoutingMetrics([worker_deployment_name(index, partition)
                                                for index, partition in enumerate(partitions)])
        self._videos = VideoJobs(
            self._models, VIDEO_API, JobsConfig.model_validate(jobs or {}), AuthConfig.model_validate(auth or {}),
            VideoOptions.model_validate(videos or {}), replica_id=context.replica_id.unique_id,
        )
        self._videos.start()

    async def __del__(self) -> None:
        """Serve calls this once the replica drained (or its drain timed out): jobs running here are released."""
        await self._videos.stop()

    # ---------------------------------------------------------------------------------------------
    # The one generation path (HTTP and handle callers both come through here)
    # ---------------------------------------------------------------------------------------------

    async def _generate(self, request: GenerationRequest, request_id: str, start: float) -> GenerationResponse:
        """The response, with `serve_timings` (how long each stage call took; `ingress_s` since `start`, when
        this replica got the request)."""
        with self._pending.admit():
            try:
                runner, request = await self._routed(request)
                finished = await asyncio.wait_for(runner.run(request), timeout=self._http.request_timeout_s)
            except RequestError:
                raise
            except asyncio.TimeoutError:  # the run was cancelled: the engine stops at its next step
                raise self._timeout_error() from None
            except Exception as exc:  # noqa: BLE001 - sorted by worker_error
                raise worker_error(exc, request_id) from None
            finally:
                self._routing_metrics.update()
        return await self._respond(finished, request, request_id, start)

    async def _respond(self, finished: PipelineResult, request: GenerationRequest, request_id: str,
                       start: float) -> GenerationResponse:
        encoding = time.perf_counter()
        # The preview PNG (and latents when asked) is CPU work: off the event loop.
        response = await asyncio.to_thread(GenerationResponse.from_result, finished.result, request_id=request_id,
                                           return_latents=request.return_latents)
        calls, done = finished.calls, time.perf_counter()
        response.serve_timings = ServeTimings(
            ingress_s=done - start, encode_call_s=calls.encode_call_s, engine_call_s=calls.denoise_call_s,
            decode_call_s=calls.decode_call_s, respond_s=done - encoding)
        return response

    async def _routed(self, request: GenerationRequest) -> tuple[GenerationRunner, GenerationRequest]:
        """The runner of the partition that serves `request` (its task, its `model`: RequestError 422 when none
        does), and `request` with its adapters' steps and shifts where it set none, resolved here rather than only
        in the engine: the router's schedule key and the progress it reports must be those of the schedule it
        runs."""
        try:
            index = await self._models.choose(request)
            if request.adapters:
                request = with_adapter_defaults(request, await self._models.limits(index))
        except (RequestError, ClientError):
            raise
        except Exception as exc:  # noqa: BLE001 - a worker that does not describe its model cannot take requests
            raise RequestError(503, "unavailable", f"worker describe failed: {type(exc).__name__}") from None
        return self._models.partitions[index].runner, request

    def _timeout_error(self) -> RequestError:
        return RequestError(
            504, "timeout", f"generation took longer than http.request_timeout_s={self._http.request_timeout_s}"
        )

    async def _stream(self, request: GenerationRequest, request_id: str) -> AsyncIterator[Any]:
        """Yields `ProgressEvent`s, then the `GenerationResponse`; RequestError on failure. Leaving early
        (the caller cancelled, closed the stream, or timed out) cancels the run, which stops the engine at its
        next step."""
        with self._pending.admit():  # one generator: closing it early must reach the finally below at once
            start = time.perf_counter()
            events: asyncio.Queue[ProgressEvent] = asyncio.Queue()

            def on_progress(step: int, steps: int) -> None:
                events.put_nowait(ProgressEvent(step=step, steps=steps, elapsed_s=time.perf_counter() - start))

            try:
                runner, request = await self._routed(request)
            except RequestError:
                raise
            except Exception as exc:  # noqa: BLE001 - sorted by worker_error
                raise worker_error(exc, request_id) from None
            run = asyncio.ensure_future(runner.run(request, on_progress))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._http.request_timeout_s
            try:
                while not run.done() or not events.empty():
                    getter = asyncio.ensure_future(events.get())
                    try:
                        await asyncio.wait({getter, run}, timeout=max(0.0, deadline - loop.time()),
                                           return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        getter.cancel()
                    if getter.done() and not getter.cancelled():
                        yield getter.result()
                    elif not run.done():
                        raise self._timeout_error()
                try:
                    finished = run.result()
                except Exception as exc:  # noqa: BLE001 - sorted by worker_error
                    raise worker_error(exc, request_id) from None
                yield await self._respond(finished, request, request_id, start)
            finally:
                if not run.done():
                    run.cancel()  # cancels the worker's stream: the engine stops at its next step
                    await asyncio.gather(run, return_exceptions=True)
                self._routing_metrics.update()

    async def generate_stream(self, request: dict[str, Any] | GenerationRequest) -> AsyncIterator[Any]:
        """Handle API with per-step progress: `handle.options(stream=True).generate_stream.remote({...})`
        yields `ProgressEvent`s (step 0 when accepted, then one per step) and finally the
        `GenerationResponse`. Cancelling the response generator stops the engine at its next step.
        Raises ClientError (a ValueError) on bad input."""
        try:
            async for item in self._stream(parse_request(request), _new_id()):
                yield item
        except RequestError as exc:
            raise exc.for_handle_caller() from None

    async def generate(self, request: dict[str, Any] | GenerationRequest) -> GenerationResponse:
        """Handle API: `serve.get_app_handle(app).generate.remote({...})`. Raises ClientError (a ValueError)
        on bad input."""
        start = time.perf_counter()
        try:
            return await self._generate(parse_request(request), _new_id(), start)
        except RequestError as exc:
            raise exc.for_handle_caller() from None

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
        stream = http_request.query_params.get("stream", "").lower()
        if stream in _STREAM_ON:
            return await self._create_generation_stream(http_request)
        start = time.perf_counter()
        request_id = _new_id()
        try:
            if stream not in _STREAM_OFF:  # `stream=on` must not quietly answer without streaming
                raise RequestError(422, "invalid_request", f"stream: {stream[:32]!r} is not true or false")
            payload = await self._read_json(http_request)
            response = await self._generate(parse_request(payload), request_id, start)
        except RequestError as exc:
            if exc.status < 500:
                logger.info("request %s refused (%d): %s", request_id, exc.status, exc.message)
            return exc.response()
        return JSONResponse(content=response.model_dump(mode="json"))

    @api.post(
        "/v1/generations:stream",
        responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}, "description": "Server-sent events."}},
        summary="Generate, streaming per-step progress as server-sent events.",
        description="Same body as POST /v1/generations (also reachable as POST /v1/generations?stream=true). "
        "Events: `progress` {step, steps, elapsed_s} (step 0 once accepted, then after every step), then "
        "`result` (a GenerationResponse), or `error` (an ErrorResponse) if it fails after it started. Errors "
        "found before the first event come back as plain JSON with their status. Closing the connection stops "
        "the generation at its next step.",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": GenerationRequest.model_json_schema()}},
            }
        },
    )
    async def create_generation_stream(self, http_request: Request) -> Any:
        return await self._create_generation_stream(http_request)

    async def _create_generation_stream(self, http_request: Request) -> Any:
        request_id = _new_id()
        try:
            request = parse_request(await self._read_json(http_request))
            events = self._stream(request, request_id)
            first = await events.__anext__()  # step 0: the worker accepted it (model limits checked)
        except RequestError as exc:
            if exc.status < 500:
                logger.info("request %s refused (%d): %s", request_id, exc.status, exc.message)
            return exc.response()

        async def sse() -> AsyncIterator[str]:
            try:
                yield _sse_event("progress", first)
                async for item in events:
                    yield _sse_event("result" if isinstance(item, GenerationResponse) else "progress", item)
            except RequestError as exc:
                yield f"event: error\ndata: {json.dumps(exc.response_body())}\n\n"
            finally:
                await events.aclose()  # cancels the worker's stream if the client went away

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    # ---------------------------------------------------------------------------------------------
    # Admin: fleet weight updates (deployments/admin.py does the work, deployments/weights.py has the design)
    # ---------------------------------------------------------------------------------------------

    @api.post("/admin/weights", summary="Load new weights on every worker replica (bearer token).",
              description="Body {\"path\": checkpoint dir under admin.weight_roots}. Validates once, then every "
              "live worker replica applies it between two requests; answers per replica.")
    async def update_weights(self, http_request: Request) -> JSONResponse:
        try:
            self._admin.authorize(http_request.headers.get("authorization", ""))
            return await self._admin.update(await self._read_json(http_request))
        except RequestError as exc:
            logger.info("admin weight update refused (%d): %s", exc.status, exc.message)
            return exc.response() if exc.status != 401 else JSONResponse(
                status_code=401, content=exc.response_body(), headers={"www-authenticate": "Bearer"})

    @api.get("/admin/weights", summary="The fleet's weights target and each live worker replica's state (bearer token).")
    async def weights_status(self, http_request: Request) -> JSONResponse:
        try:
            self._admin.authorize(http_request.headers.get("authorization", ""))
        except RequestError as exc:
            return exc.response()
        return await self._admin.status()

    async def _read_json(self, http_request: Request) -> Any:
        try:
            return loads_body(await read_body(http_request, self._http.max_body_bytes, "http.max_body_bytes"))
        except JsonBodyError as exc:
            raise RequestError(exc.status, exc.kind, exc.message) from None

    # ---------------------------------------------------------------------------------------------
    # Playground (GET /): a static page over the public API (deployments/playground.py)
    # ---------------------------------------------------------------------------------------------

    @api.get("/", include_in_schema=False)
    async def playground(self) -> Response:
        return playground_response(self._http.playground)

    @api.get("/healthz", summary="200 when a worker replica of every served partition answers its health check.")
    async def healthz(self) -> JSONResponse:
        workers = {}
        for served in self._models.partitions:
            try:
                workers[served.partition] = await asyncio.wait_for(served.worker.health.remote(),
                                                                   timeout=self._http.health_timeout_s)
            except Exception as exc:  # noqa: BLE001 - any failure means not healthy
                message = f"worker health check failed ({served.partition}): {type(exc).__name__}"
                return RequestError(503, "unavailable", message).response()
        body = {"status": "ok", "worker": workers[self._models.default.partition]}
        return JSONResponse(content={**body, "workers": workers} if len(workers) > 1 else body)

    @api.get("/v1/models", summary="The served models (one per partition), each with its tasks, limits and engine "
             "config.")
    async def models(self) -> JSONResponse:
        try:
            cards = await self._models.cards()
        except Exception as exc:  # noqa: BLE001
            return RequestError(503, "unavailable", f"worker describe failed: {type(exc).__name__}").response()
        return JSONResponse(content={"object": "list", "data": [
            served_model(card) for card in cards]})

