"""The app's metrics through `ray.serve.metrics` (exported on each node's Prometheus port): the worker replicas'
engine stats, the ingress's load and refusals, the video job service's jobs.

Names as scraped (Ray prefixes `ray_`, counters end `_total`; Serve adds `deployment`, `replica`,
`application` tags):

| metric | kind | tags | what |
|---|---|---|---|
| `ray_ditserve_plans_total` | counter | `tier`: gpu, host, pool, built | AdaLN plans a request found per tier (built = rebuilt from the checkpoint) |
| `ray_ditserve_plan_warm_requests_total` | counter | `warm`: true, false | requests whose plans were all in the GPU slab (the affinity hit rate, seen from the worker) |
| `ray_ditserve_rebuild_seconds` | histogram | | seconds of one request's plan rebuild (only requests that rebuilt) |
| `ray_ditserve_rebuild_read_bytes_total` | counter | | checkpoint bytes read by rebuilds |
| `ray_ditserve_plan_copied_bytes_total` | counter | | plan bytes copied host tier -> GPU slab |
| `ray_ditserve_cache_dit_cached_steps_total` | counter | | denoising steps Cache-DiT served from its cache |
| `ray_ditserve_ongoing_requests` | gauge | | requests accepted by this replica and not finished (queued or running) |
| `ray_ditserve_requests_total` | counter | `outcome`: ok, cancelled, invalid, error | finished requests |
| `ray_ditserve_request_seconds` | histogram | `outcome` | engine time per finished request |
| `ray_ditserve_weights_version` | gauge | | fleet weights version this replica serves (0: the configured checkpoint) |
| `ray_ditserve_denoise_seconds_per_forward` | histogram | | a request's denoising loop / its transformer forwards |
| `ray_ditserve_stage_seconds` | histogram | `stage`: plan, encode, denoise, decode, mux | seconds per stage of a finished request, as the worker's engine timed it (a split app's worker runs plan and denoise only: its encode and decode run in the TextEncoder and Decoder) |
| `ray_ditserve_offload_copied_bytes_total` | counter | | block weight bytes layerwise offload copied host -> GPU |
| `ray_ditserve_compiles_after_warmup` | gauge | | graphs the compiled blocks compiled while serving, after the start-up warm-up, as of the replica's last successful request (`engine.compile.mode: blocks`; 0 from the start; the goal is to stay 0: a rise is a canvas, adapter set or weight tier the warm-up did not cover) |

Recorded by each ingress replica (where the worker handle and so the schedule-affinity router live); the
router's decisions from `deployments.routing.registry.schedule_affinity_stats`, cumulative since the replica
started:

| `ray_ditserve_router_requests` | gauge | `worker`: the routed Worker deployment (`Worker`, `Worker-ref2va`: one per partition), `route`: affinity_hit, spill, unkeyed | requests the router sent to the key's first choice, spilled, or routed without a key |
| `ray_ditserve_pending_generations` | gauge | | generations the replica holds against `http.max_pending_generations` (running or waiting for a worker) |
| `ray_ditserve_retry_after_responses_total` | counter | `route` (the route's path template), `status` | responses sent with a `Retry-After` header: 429 (a full job queue), 503 (the ingress full, the job database down) |

and by its `JobService` (`jobs.metrics.JobMetrics`), per served model:

| `ray_ditserve_video_jobs_created_total` | counter | `model` | video jobs queued |
| `ray_ditserve_video_jobs_finished_total` | counter | `model`, `outcome`: succeeded, failed, cancelled, expired | video jobs settled, each counted once by the replica that settled it |
| `ray_ditserve_video_jobs_queued` | gauge | `model` | jobs queued and not started, as the shared job store counts them (every replica reports the same number: `max`, not `sum`) |

Recorded here, in the Serve layer, from the engine's per-request stats and the job layer's reports: the engine
and jobs/ stay free of Ray.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.api import GenerationStats, GenerationTimings
from jobs.metrics import JobOutcome

OUTCOMES = ("ok", "cancelled", "invalid", "error")

_SECONDS_BOUNDARIES = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
#: One transformer forward: milliseconds on the tiny model, seconds for H3 at 768p (more with offload).
_FORWARD_BOUNDARIES = [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0]


class WorkerMetrics:
    """The worker deployment's metrics. Create inside a replica (Serve tags them with the replica)."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self.plans = metrics.Counter(
            "ditserve_plans", description="AdaLN plans found per tier (gpu, host, pool) or built.", tag_keys=("tier",)
        )
        self.warm_requests = metrics.Counter(
            "ditserve_plan_warm_requests",
            description="Requests whose AdaLN plans were all warm in the GPU slab (warm=true) or not.",
            tag_keys=("warm",),
        )
        self.rebuild_seconds = metrics.Histogram(
            "ditserve_rebuild_seconds", description="Seconds of one request's AdaLN plan rebuild.",
            boundaries=_SECONDS_BOUNDARIES,
        )
        self.rebuild_read_bytes = metrics.Counter(
            "ditserve_rebuild_read_bytes", description="Checkpoint bytes read by AdaLN plan rebuilds."
        )
        self.plan_copied_bytes = metrics.Counter(
            "ditserve_plan_copied_bytes", description="AdaLN plan bytes copied from the host tier to the GPU slab."
        )
        self.cached_steps = metrics.Counter(
            "ditserve_cache_dit_cached_steps", description="Denoising steps served from the Cache-DiT cache."
        )
        self.ongoing = metrics.Gauge(
            "ditserve_ongoing_requests", description="Requests accepted by this replica and not finished."
        )
        self.requests = metrics.Counter(
            "ditserve_requests", description="Finished requests by outcome.", tag_keys=("outcome",)
        )
        self.request_seconds = metrics.Histogram(
            "ditserve_request_seconds", description="Engine seconds per finished request.",
            boundaries=_SECONDS_BOUNDARIES, tag_keys=("outcome",),
        )
        self.weights_version = metrics.Gauge(
            "ditserve_weights_version", description="Fleet weights version served (0: the configured checkpoint)."
        )
        self.denoise_seconds_per_forward = metrics.Histogram(
            "ditserve_denoise_seconds_per_forward", description="A request's denoising loop seconds / its "
            "transformer forwards.", boundaries=_FORWARD_BOUNDARIES,
        )
        self.stage_seconds = metrics.Histogram(
            "ditserve_stage_seconds", description="Seconds per stage (plan, encode, denoise, decode, mux) of a "
            "finished request, as this replica's engine timed it.", boundaries=_SECONDS_BOUNDARIES,
            tag_keys=("stage",),
        )
        self.offload_copied_bytes = metrics.Counter(
            "ditserve_offload_copied_bytes", description="Block weight bytes layerwise offload copied host -> GPU."
        )
        # A gauge of the engine's own count, not a counter of its growth: a counter's series would appear at its
        # first compile, which Prometheus's increase() then takes for the baseline (and Ray refuses inc(0)).
        self.compiles_after_warmup = metrics.Gauge(
            "ditserve_compiles_after_warmup", description="Graphs the compiled blocks compiled while serving, "
            "after the start-up warm-up, as of the last successful request (goal: 0)."
        )
        self._offload_bytes_seen = 0  # the engine's offload counter is cumulative: the counter gets its growth
        self._compiles_seen = 0  # the engine's compiles since its warm-up, as last reported
        self._ongoing = 0
        self._lock = threading.Lock()  # started on the event loop, finished on the engine thread
        self.ongoing.set(0)
        self.weights_version.set(0)
        self.compiles_after_warmup.set(0)

    def request_started(self) -> None:
        with self._lock:
            self._ongoing += 1
            self.ongoing.set(self._ongoing)

    def request_finished(self, outcome: str, seconds: float, stats: GenerationStats | None,
                         timings: GenerationTimings | None = None) -> None:
        """One request left the engine (`stats`, `timings`: the `GenerationResult`'s when it succeeded)."""
        with self._lock:
            self._ongoing -= 1
            self.ongoing.set(self._ongoing)
        self.requests.inc(1, tags={"outcome": outcome})
        self.request_seconds.observe(seconds, tags={"outcome": outcome})
        if stats is not None:
            self._record_stats(stats)
        if timings is not None:
            self._record_timings(timings, stats)

    def _record_stats(self, stats: GenerationStats) -> None:
        adaln = stats.adaln
        if adaln is not None:  # resident AdaLN has no plans: nothing to be warm or cold
            tiers = {"gpu": adaln.gpu_hit_plans, "host": adaln.host_hit_plans, "pool": adaln.pool_hit_plans,
                     "built": adaln.built_plans}
            for tier, count in tiers.items():
                if count:
                    self.plans.inc(count, tags={"tier": tier})
            num_plans = sum(tiers.values())
            if num_plans:
                self.warm_requests.inc(1, tags={"warm": "true" if adaln.gpu_hit_plans == num_plans else "false"})
            if adaln.built_plans:
                self.rebuild_seconds.observe(adaln.rebuild_s)
            if adaln.rebuild_bytes_read:
                self.rebuild_read_bytes.inc(adaln.rebuild_bytes_read)
            if adaln.h2d_bytes:
                self.plan_copied_bytes.inc(adaln.h2d_bytes)
        if stats.cache_dit is not None and stats.cache_dit.cached_steps:
            self.cached_steps.inc(stats.cache_dit.num_cached_steps)
        if stats.offload is not None:
            with self._lock:
                total = stats.offload.h2d_bytes
                # Smaller than last time: the counter was reset (a weight update re-applies offload).
                grown = total - self._offload_bytes_seen if total >= self._offload_bytes_seen else total
                self._offload_bytes_seen = total
            if grown:
                self.offload_copied_bytes.inc(grown)
        if stats.compile is not None:  # the process's count since its warm-up (a failed request's compiles show
            with self._lock:             # with the next request that succeeds)
                self._compiles_seen = max(stats.compile.since_warmup, self._compiles_seen)
                self.compiles_after_warmup.set(self._compiles_seen)

    def _record_timings(self, timings: GenerationTimings, stats: GenerationStats | None) -> None:
        stages = {"plan": timings.plan_s, "encode": timings.encode_s, "denoise": timings.denoise_s,
                  "decode": timings.decode_s, "mux": timings.mux_s}
        for stage, value in stages.items():
            if value > 0:  # a stage this replica did not run (split: encode, decode) is not a 0 s sample
                self.stage_seconds.observe(value, tags={"stage": stage})
        if stats is not None and stats.forwards > 0 and timings.denoise_s > 0:
            self.denoise_seconds_per_forward.observe(timings.denoise_s / stats.forwards)


class RoutingMetrics:
    """The schedule-affinity routers' counters in this process (an ingress replica), as a gauge per routed Worker
    deployment (one per served partition: `Worker`, `Worker-ref2va`), so a dashboard tells the partitions apart."""

    def __init__(self, worker_deployments: Sequence[str] = ("Worker",)) -> None:
        from ray.serve import metrics

        self._worker_deployments = tuple(worker_deployments)
        # `worker`, not `deployment`: Serve reserves that tag for the emitting deployment (here the Ingress).
        self.requests = metrics.Gauge(
            "ditserve_router_requests", description="Schedule-affinity routing decisions in this process since it "
            "started, per routed Worker deployment: affinity_hit (first choice), spill, unkeyed.",
            tag_keys=("worker", "route"),
        )

    def update(self) -> None:
        try:
            from deployments.routing.registry import schedule_affinity_stats

            stats = {worker: schedule_affinity_stats(worker) for worker in self._worker_deployments}
        except Exception:  # noqa: BLE001 - another router (or none): nothing to report
            return
        for worker, counts in stats.items():
            for route, key in (("affinity_hit", "hits"), ("spill", "spills"), ("unkeyed", "unkeyed")):
                self.requests.set(float(counts.get(key, 0)), tags={"worker": worker, "route": route})


class PendingGenerationsGauge:
    """The ingress's `http.max_pending_generations` count (`deployments.ingress.PendingGenerations`)."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self.pending = metrics.Gauge(
            "ditserve_pending_generations", description="Generations this ingress replica holds (running or "
            "waiting for a worker), bounded by http.max_pending_generations.",
        )
        self.pending.set(0)

    def set(self, count: int) -> None:
        self.pending.set(float(count))


class VideoJobMetrics:
    """`jobs.metrics.JobMetrics` on Serve metrics: the ingress replica's `JobService` reports here."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self.created = metrics.Counter(
            "ditserve_video_jobs_created", description="Video jobs queued.", tag_keys=("model",)
        )
        self.finished = metrics.Counter(
            "ditserve_video_jobs_finished", description="Video jobs settled by this replica, by outcome "
            "(succeeded, failed, cancelled, expired).", tag_keys=("model", "outcome"),
        )
        self.queued = metrics.Gauge(
            "ditserve_video_jobs_queued", description="Video jobs queued and not started, as the job store counts "
            "them (the same on every replica).", tag_keys=("model",),
        )

    def job_created(self, model: str) -> None:
        self.created.inc(1, tags={"model": model})

    def job_finished(self, model: str, outcome: JobOutcome) -> None:
        self.finished.inc(1, tags={"model": model, "outcome": outcome.value})

    def queue_depth(self, model: str, num_queued: int) -> None:
        self.queued.set(float(num_queued), tags={"model": model})


class RetryAfterCounter:
    """Responses sent with a `Retry-After` header, by route and status."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self.responses = metrics.Counter(
            "ditserve_retry_after_responses", description="Responses sent with a Retry-After header (429: a full "
            "job queue; 503: the ingress or the job database), by route template and status.",
            tag_keys=("route", "status"),
        )

    def record(self, route: str, status: int) -> None:
        self.responses.inc(1, tags={"route": route, "status": str(status)})


#: The `route` tag of a response no route matched.
UNMATCHED_ROUTE = "unmatched"


class RetryAfterResponses:
    """ASGI middleware counting every response that carries `Retry-After` (`app.add_middleware`). A middleware,
    not the error handlers, because routes also answer refusals themselves (`RequestError.response()`); the
    route's path template (`/v1/videos/{video_id}`), not the path, keeps the tag's values few."""

    def __init__(self, app: ASGIApp, counter: RetryAfterCounter | None = None) -> None:
        self.app = app
        # Built with the middleware stack, on the app's first request: inside the replica, where Serve tags it.
        self.counter = counter or RetryAfterCounter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_counting(message: Message) -> None:
            if message["type"] == "http.response.start" and any(
                name.lower() == b"retry-after" for name, _ in message.get("headers", ())
            ):
                # The router wrote the matched route into this same scope before any response started.
                route = scope.get("route")
                self.counter.record(route.path if isinstance(route, Route) else UNMATCHED_ROUTE, message["status"])
            await send(message)

        await self.app(scope, receive, send_counting)
