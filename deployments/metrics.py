"""Worker replica metrics through `ray.serve.metrics` (exported on each node's Prometheus port).

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

Recorded by each ingress replica (where the worker handle and so the schedule-affinity router live), from
`deployments.routing.registry.schedule_affinity_stats`, cumulative since the replica started:

| `ray_ditserve_router_requests` | gauge | `route`: affinity_hit, spill, unkeyed | requests the router sent to the key's first choice, spilled, or routed without a key |

Recorded here, in the Serve layer, from the engine's per-request stats: the engine stays free of Ray.
"""

from __future__ import annotations

import threading

from engine.api import GenerationStats, GenerationTimings

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
        self._offload_bytes_seen = 0  # the engine's offload counter is cumulative: the counter gets its growth
        self._ongoing = 0
        self._lock = threading.Lock()  # started on the event loop, finished on the engine thread
        self.ongoing.set(0)
        self.weights_version.set(0)

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

    def _record_timings(self, timings: GenerationTimings, stats: GenerationStats | None) -> None:
        stages = {"plan": timings.plan_s, "encode": timings.encode_s, "denoise": timings.denoise_s,
                  "decode": timings.decode_s, "mux": timings.mux_s}
        for stage, value in stages.items():
            if value > 0:  # a stage this replica did not run (split: encode, decode) is not a 0 s sample
                self.stage_seconds.observe(value, tags={"stage": stage})
        if stats is not None and stats.forwards > 0 and timings.denoise_s > 0:
            self.denoise_seconds_per_forward.observe(timings.denoise_s / stats.forwards)


class RoutingMetrics:
    """The schedule-affinity router's counters in this process (an ingress replica), as a gauge."""

    def __init__(self, deployment_name: str = "Worker") -> None:
        from ray.serve import metrics

        self._deployment_name = deployment_name
        self.requests = metrics.Gauge(
            "ditserve_router_requests", description="Schedule-affinity routing decisions in this process since it "
            "started: affinity_hit (first choice), spill, unkeyed.", tag_keys=("route",),
        )

    def update(self) -> None:
        try:
            from deployments.routing.registry import schedule_affinity_stats

            stats = schedule_affinity_stats(self._deployment_name)
        except Exception:  # noqa: BLE001 - another router (or none): nothing to report
            return
        for route, key in (("affinity_hit", "hits"), ("spill", "spills"), ("unkeyed", "unkeyed")):
            self.requests.set(float(stats.get(key, 0)), tags={"route": route})
