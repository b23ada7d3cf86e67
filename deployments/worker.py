"""The worker deployment: a thin Serve shim over a plain engine (one replica per GPU, or on CPU).

All model work happens in `engine.engine.Engine` (or whatever `engine_factory` builds, e.g. a fake in
tests; both implement `engine.api.EngineProtocol`). Generations run on one dedicated thread, so they are serialized per replica and the
replica's event loop stays free for health checks, `describe` and cancellations.

Routing: callers pass `schedule_key=` (the request's sampling schedule); with `ScheduleAffinityRouter`
(set by `build_app`) requests of one schedule go to the replica whose GPU plan slab holds them, and this
replica reports its ongoing count and its engine's `slab_state()` through `record_routing_stats()`. Callers
also pass `adapters=` (the request's LoRA adapter names): the replica reports the adapters its engine holds
(`held_adapters()`), so the router prefers a replica holding both the plans and the adapters. On arrival the
replica asks its engine to start loading the adapters it lacks (`prefetch_adapters`: a loader thread, while the
engine thread keeps denoising the running request).

Two calls, one per app shape (`stages` in serve_config.yaml; the ingress picks: `deployments/generation.py`):
`generate` runs a whole generation in the engine (`stages: fused`: `Engine.generate`, the one pipeline in this
process); `denoise` is the denoiser stage alone (`stages: split`: the engine holds the transformer only,
`denoiser_engine_factory`), conditioned on the TextEncoder's embedding and answering latents, so the replica is
free for the next request the moment its loop ends: its slot and its load report count denoising only. Both
answer the `GenerationResult`; `generate_stream` / `denoise_stream` are the same calls streaming progress first
(a caller that follows no progress calls the unary ones: a stream costs more per request).

Shutdown: Serve drains a replica for at most `worker.graceful_shutdown_timeout_s` (short by default, so
`serve run` stops within seconds of Ctrl-C). Drained in time, it calls `__del__`, which stops the weights
follower, asks every generation still running (one whose caller left) to stop at its next step and drops the
queued ones; requests that outlast the grace period are killed with the replica, `__del__` never runs, and
their callers hear a dead actor (the ingress, which outlives the workers when the whole app stops: a 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Iterator

from ray import serve

from deployments import IMPORT_STARTED_AT, PRELOADED
from deployments.errors import install_client_error_log_filter
from deployments.metrics import WorkerMetrics
from deployments.routing.reporter import ScheduleAffinityReporter
from deployments.schemas import ProgressEvent
from deployments.weights import WeightFollower
from engine.api import (
    EngineProtocol, GenerationRequest, GenerationResult, GenerationStats, GenerationTimings, SlabState,
)
from engine.config import EngineConfig
from engine.errors import ClientError, GenerationCancelled
from engine.stage_data import PromptEmbedding
from engine.startup import ReplicaStartup, process_started_at

#: This module's imports done (with `deployments.IMPORT_STARTED_AT`: the replica's module-import time).
IMPORTED_AT = time.time()

logger = logging.getLogger("ray.serve")

EngineFactory = Callable[[EngineConfig], EngineProtocol]


def default_engine_factory(config: EngineConfig) -> EngineProtocol:
    # Imported here so the Serve layer can be imported (and tested with a fake) without loading the model.
    from actors.host_cache_pool import make_pool_client
    from engine.engine import Engine, resolve_device

    if config.parallel.sp > 1:  # the replica coordinates `sp` rank actors in its own placement group
        from actors.gpu_worker import ParallelEngine, ReplicaBundles

        return ParallelEngine(config, ReplicaBundles.current())

    # The node-shared AdaLN plan pool (auto: on inside Ray with adaln.mode=online); None when off.
    remote = make_pool_client(config.pool, resolve_device(config.device), config.adaln.mode)
    return Engine(config, remote=remote)


def denoiser_engine_factory(config: EngineConfig) -> EngineProtocol:
    """The engine of a `stages: split` worker: the transformer and its AdaLN plans, no text encoder, no VAEs."""
    from actors.host_cache_pool import make_pool_client
    from engine.engine import DenoiserEngine, resolve_device

    remote = make_pool_client(config.pool, resolve_device(config.device), config.adaln.mode)
    return DenoiserEngine(config, remote=remote)


def module_import_times() -> tuple[float, float, bool]:
    """(this process's first import of our code, this module's imports done, whether Ray preloaded them). Read
    through this module-level function: Serve pickles a deployment class by value, with the driver's values of the
    globals it names."""
    return IMPORT_STARTED_AT, IMPORTED_AT, PRELOADED


#: The factories that build the real engine: the worker times the model stack's import before calling them.
REAL_FACTORIES = (default_engine_factory, denoiser_engine_factory)


def import_model_stack() -> float:
    """Import what the real engine needs (torch, diffusers, transformers, the engine and the pool client);
    seconds (about 0 when the replica's own imports already pulled it in)."""
    start = time.perf_counter()
    import actors.host_cache_pool  # noqa: F401
    import engine.engine  # noqa: F401

    return time.perf_counter() - start


@serve.deployment(name="Worker", ray_actor_options={"num_cpus": 1})
class Worker(ScheduleAffinityReporter):
    """Serve replica holding one engine. `build_app` sets `num_gpus` (1 on a GPU cluster, else 0)."""

    def __init__(self, engine_config: dict[str, Any], engine_factory: EngineFactory | None = None) -> None:
        """`engine_factory`: the engine to serve (default: the whole model; `denoiser_engine_factory` for a split
        app; a fake in tests)."""
        constructor_at = time.time()
        install_client_error_log_filter()  # a request over a model limit is one INFO line, not an ERROR traceback
        config = EngineConfig.model_validate(engine_config)
        # One thread: the engine owns one device and runs one generation at a time; later requests queue here.
        # Fleet weight updates run on this same thread, so they always fall between two generations.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        # Built on that thread too: what its start sets up per thread (the cuBLAS handle of the plan cache's
        # warm-up rebuild) is then the one the first request uses, not made on the request path.
        factory = engine_factory or default_engine_factory
        imports_s = self._executor.submit(import_model_stack).result() if factory in REAL_FACTORIES else 0.0
        build_started_at = time.time()
        self._engine = self._executor.submit(factory, config).result()
        build_ended_at = time.time()
        self._metrics = WorkerMetrics()
        self._outcomes = {"ok": 0, "cancelled": 0, "invalid": 0, "error": 0}
        self._last_request: dict[str, Any] = {}
        self._in_flight: set[threading.Event] = set()  # cancel flags of submitted, unfinished generations
        context = serve.get_replica_context()
        self._replica_id = context.replica_id.unique_id
        self._weights = WeightFollower(
            context.app_name, self._replica_id, self._executor,
            self._engine.update_weights, self._debug_state, self._on_weights_applied,
        )
        self._weights.start()  # applies the fleet's weights target (if any) before the first request
        import_started_at, imported_at, preloaded = module_import_times()
        self._startup = ReplicaStartup(
            role="worker", process_started_at=process_started_at(), import_started_at=import_started_at,
            imported_at=imported_at, constructor_at=constructor_at, build_started_at=build_started_at,
            build_ended_at=build_ended_at, ready_at=time.time(), imports_s=imports_s, engine=self._engine.startup,
            preloaded=preloaded)
        logger.info("replica %s: %s", self._replica_id, self._startup.summary())

    # ---------------------------------------------------------------------------------------------
    # Generation
    # ---------------------------------------------------------------------------------------------

    def _submit(self, request: GenerationRequest, cancelled: threading.Event,
                on_progress: Callable[[int, int], None] | None = None,
                embedding: PromptEmbedding | None = None) -> asyncio.Future:
        """Queue one generation on the engine thread; metrics are recorded when the engine is done with it
        (a cancelled request stops at its next step boundary, after the caller has gone)."""
        loop = asyncio.get_running_loop()
        last = {"step": 0, "steps": request.steps - 1, "outcome": "running"}  # steps - 1 forwards
        self._last_request = last

        def progress(step: int, steps: int) -> None:
            last["step"] = step
            if on_progress is not None:
                on_progress(step, steps)

        def run() -> GenerationResult:
            start = time.perf_counter()
            outcome: str = "error"
            stats: GenerationStats | None = None
            timings: GenerationTimings | None = None
            try:
                if embedding is None:
                    result = self._engine.generate(request, progress, cancelled.is_set)
                else:
                    result = self._engine.denoise(request, embedding, progress, cancelled.is_set)
                outcome, stats, timings = "ok", result.stats, result.timings
                adaln = result.stats.adaln
                missed = adaln is not None and adaln.built_plans + adaln.host_hit_plans + adaln.pool_hit_plans > 0
                adapters = result.stats.adapters
                self.record_service(time.perf_counter() - start, result.timings.plan_s, missed,
                                    adapters.load_s if adapters is not None and adapters.loaded else None)
                return result
            except GenerationCancelled:
                outcome = "cancelled"
                raise
            except ClientError:
                outcome = "invalid"
                raise
            finally:
                self._in_flight.discard(cancelled)
                last["outcome"] = outcome
                self._outcomes[outcome] += 1
                self._metrics.request_finished(outcome, time.perf_counter() - start, stats, timings)

        self._metrics.request_started()
        self._in_flight.add(cancelled)
        future = loop.run_in_executor(self._executor, run)
        # A caller that went away never reads the outcome: mark the exception retrieved (no asyncio warning).
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return future

    async def validate(self, request: GenerationRequest) -> None:
        """ClientError naming the field and the limit if the loaded model cannot take `request` (the video
        API's check before it queues a job: prompt tokens, snapped duration, sizes). Cheap, runs on the event
        loop's thread pool (a multi-GPU engine asks its rank 0 actor: a bounded Ray round trip), beside a running
        generation. A split app's prompt is checked by the TextEncoder (the tokenizer lives there)."""
        await asyncio.to_thread(self._engine.validate, request)

    async def generate(self, request: GenerationRequest, schedule_key: str | None = None,
                       adapters: tuple[str, ...] = ()) -> GenerationResult:
        """A whole generation (`stages: fused`): its `GenerationResult`. Model-limit errors (ClientError) are raised
        before any work. A caller that cancels the call stops the engine at its next step; the plan references are
        released there. `adapters`: the request's adapter names, for the router (`deployments.routing`)."""
        await self._validate(request, None)
        return await self._result(request, schedule_key, None)

    async def generate_stream(
        self, request: GenerationRequest, schedule_key: str | None = None, adapters: tuple[str, ...] = (),
    ) -> AsyncIterator[ProgressEvent | GenerationResult]:
        """`generate` with progress (`handle.options(stream=True)`): yields `ProgressEvent`s (step 0 once the
        request is accepted, then after every denoising step) and finally the `GenerationResult`. A caller that
        cancels or stops iterating stops the engine at its next step."""
        await self._validate(request, None)
        async for event in self._stream(request, schedule_key, None):
            yield event

    async def denoise(self, request: GenerationRequest, embedding: PromptEmbedding, schedule_key: str | None = None,
                      adapters: tuple[str, ...] = ()) -> GenerationResult:
        """The denoiser stage of a split app: `embedding` is the TextEncoder's for `request.prompt`; the
        `GenerationResult` with the latents and no MP4 (the Decoder decodes them). The replica takes its next
        request as soon as this one's loop ends. Errors and cancellation as `generate`."""
        await self._validate(request, embedding)
        return await self._result(request, schedule_key, embedding)

    async def denoise_stream(self, request: GenerationRequest, embedding: PromptEmbedding,
                             schedule_key: str | None = None, adapters: tuple[str, ...] = (),
                             ) -> AsyncIterator[ProgressEvent | GenerationResult]:
        """`denoise` with progress (`handle.options(stream=True)`), as `generate_stream` yields it."""
        await self._validate(request, embedding)
        async for event in self._stream(request, schedule_key, embedding):
            yield event

    async def _validate(self, request: GenerationRequest, embedding: PromptEmbedding | None) -> None:
        # Off the loop: a multi-GPU engine asks its rank 0 actor (a Ray round trip). A split denoiser plans a fl2va /
        # ref2va request from its embedding's `Conditions` (it holds neither the media encoders nor the VAEs).
        if embedding is not None and embedding.conditions is not None:
            await asyncio.to_thread(self._engine.validate, request, embedding)
        else:
            await asyncio.to_thread(self._engine.validate, request)

    @contextlib.contextmanager
    def _accepted(self, request: GenerationRequest, schedule_key: str | None, embedding: PromptEmbedding | None,
                  on_progress: Callable[[int, int], None] | None) -> Iterator[asyncio.Future]:
        """`request` queued on the engine thread, its schedule and adapters reported to the router meanwhile; a
        caller that leaves before it finished (cancelled, stopped iterating) stops the engine at its next step."""
        cancelled = threading.Event()
        with self.track_schedule(schedule_key, tuple(choice.name for choice in request.adapters)):
            # Cold adapters start loading now, beside the generation running on the engine thread.
            self._engine.prefetch_adapters(request)
            future = self._submit(request, cancelled, on_progress, embedding)
            try:
                yield future
            finally:
                if not future.done():
                    # Cancelled or closed by the caller: the engine stops at its next step and releases its plans.
                    cancelled.set()
                    logger.info("generation stopped by the caller; the engine stops after the current step")

    async def _result(self, request: GenerationRequest, schedule_key: str | None,
                      embedding: PromptEmbedding | None) -> GenerationResult:
        with self._accepted(request, schedule_key, embedding, None) as future:
            # Shielded: a cancelled call must leave the future running, so that `_accepted` sees it unfinished
            # and stops the engine (cancelling an executor's future does not stop its thread).
            return await asyncio.shield(future)

    async def _stream(self, request: GenerationRequest, schedule_key: str | None, embedding: PromptEmbedding | None,
                      ) -> AsyncIterator[ProgressEvent | GenerationResult]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[ProgressEvent] = asyncio.Queue()
        start = time.perf_counter()

        def on_progress(step: int, steps: int) -> None:  # engine thread -> event loop
            event = ProgressEvent(step=step, steps=steps, elapsed_s=time.perf_counter() - start)
            loop.call_soon_threadsafe(events.put_nowait, event)

        with self._accepted(request, schedule_key, embedding, on_progress) as future:
            yield ProgressEvent(step=0, steps=request.steps - 1, elapsed_s=0.0)
            while True:
                getter = asyncio.ensure_future(events.get())
                try:
                    await asyncio.wait({getter, future}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    getter.cancel()
                if getter.done() and not getter.cancelled():
                    yield getter.result()
                    continue
                if future.done():
                    await asyncio.sleep(0)  # let call_soon_threadsafe callbacks of the last steps land
                    while not events.empty():
                        yield events.get_nowait()
                    yield future.result()
                    return

    # ---------------------------------------------------------------------------------------------
    # Weights, stats
    # ---------------------------------------------------------------------------------------------

    async def validate_weights(self, path: str) -> dict[str, Any]:
        """Check the checkpoint at `path` against the served model without writing anything (runs beside a
        generation: read-only). WeightsRejected names the problem. Used once per fleet update by the admin
        route."""
        fingerprint = await asyncio.to_thread(self._engine.validate_weight_update, path)
        return {"path": str(path), "fingerprint": fingerprint}

    def _on_weights_applied(self, version: int) -> None:
        self.forget_schedules()  # recently served schedules no longer have warm plans
        self._metrics.weights_version.set(version)

    def _debug_state(self) -> dict[str, Any]:
        return dict(self._engine.debug_stats())

    async def debug_stats(self) -> dict[str, Any]:
        """Replica bookkeeping for tests and operators: held plan references (0 when idle), stale plans,
        weights version, outcomes, generations submitted to the engine thread and not finished (`in_flight`,
        queued or running), and the most recently submitted request's step and outcome."""
        return {
            "replica": self._replica_id,
            "in_flight": len(self._in_flight),
            "weights_version": self._weights.applied_version,
            "outcomes": dict(self._outcomes),
            "last_request": dict(self._last_request),
            **(await asyncio.to_thread(self._debug_state)),
        }

    def _shutdown(self) -> None:
        """Stop promptly (Serve calls `__del__` once draining ended or timed out): no more weight updates,
        every generation still queued or running stops at its next step boundary (its caller gets
        GenerationCancelled), and the engine thread takes no new work. Never waits for the engine."""
        self._weights.stop()
        for cancelled in list(self._in_flight):
            cancelled.set()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._shutdown()

    def slab_state(self) -> SlabState:
        """What the engine's GPU plan slab holds: reported to the router by `record_routing_stats`."""
        return self._engine.slab_state()

    def held_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters the engine holds or is loading: reported to the router by `record_routing_stats`."""
        return self._engine.held_adapters()

    async def health(self) -> dict[str, Any]:
        return self._engine.health()

    async def describe(self) -> dict[str, Any]:
        """The engine's model card, with this replica's id and start-up timings (`engine.startup`)."""
        return {**self._engine.describe(), "replica": self._replica_id, "startup": self._startup.as_dict()}

    async def check_health(self) -> None:
        """Serve's periodic replica health check: an engine that raises here gets its replica restarted."""
        self._engine.health()
