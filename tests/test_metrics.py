"""Worker metrics are read from the engine's typed stats (`engine.api.GenerationStats`), attribute by attribute.

Ray's metric classes are replaced by recording fakes, so no cluster is needed; the stats come from the fake
engine (a schedule's first request builds its plans, later ones hit the GPU slab) or are built by hand.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import pytest
from ray.serve import metrics as serve_metrics

from deployments.metrics import WorkerMetrics
from engine.api import AdalnStats, CacheDitStats, GenerationRequest, GenerationStats, GenerationTimings
from engine.config import EngineConfig
from offload.layerwise import OffloadStats
from tests.fake_engine import FakeEngine

REQUEST = GenerationRequest(prompt="a cat", steps=5, seconds=5.0, width=96, height=64, seed=1)  # 4 forwards


class RecordedMetric:
    """Stands in for `ray.serve.metrics.Counter`/`Histogram`/`Gauge`: keeps every value by its tags."""

    def __init__(self, name: str, *, description: str, tag_keys: tuple[str, ...] = (),
                 boundaries: list[float] | None = None) -> None:
        self.name = name
        self.tag_keys = tag_keys
        self.values: dict[tuple[tuple[str, str], ...], list[float]] = defaultdict(list)

    def _record(self, value: float, tags: dict[str, str] | None) -> None:
        tags = tags or {}
        assert set(tags) == set(self.tag_keys), (self.name, tags)
        self.values[tuple(sorted(tags.items()))].append(value)

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self._record(value, tags)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._record(value, tags)

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._record(value, tags)

    def total(self, **tags: str) -> float:
        return sum(self.values.get(tuple(sorted(tags.items())), []))

    def count(self, **tags: str) -> int:
        return len(self.values.get(tuple(sorted(tags.items())), []))


@pytest.fixture
def worker_metrics(monkeypatch) -> WorkerMetrics:
    for kind in ("Counter", "Histogram", "Gauge"):
        monkeypatch.setattr(serve_metrics, kind, RecordedMetric)
    return WorkerMetrics()


def finish(metrics: WorkerMetrics, stats: GenerationStats | None, outcome: str = "ok") -> None:
    metrics.request_started()
    metrics.request_finished(outcome, 0.5, stats)


def test_plan_tiers_and_warmth_are_counted_from_the_fake_engines_typed_stats(worker_metrics):
    engine = FakeEngine(EngineConfig())
    cold, warm = engine.generate(REQUEST), engine.generate(REQUEST)
    assert isinstance(cold.stats, GenerationStats) and cold.stats.adaln.built_plans == 4
    for result in (cold, warm):
        finish(worker_metrics, result.stats)

    plans = worker_metrics.plans
    assert (plans.total(tier="built"), plans.total(tier="gpu")) == (4, 4)  # built once, then found in the slab
    assert plans.count(tier="host") == plans.count(tier="pool") == 0  # a tier with no plan records nothing
    assert (worker_metrics.warm_requests.total(warm="false"), worker_metrics.warm_requests.total(warm="true")) == (1, 1)
    assert worker_metrics.rebuild_seconds.count() == 1  # only the request that rebuilt
    assert worker_metrics.requests.total(outcome="ok") == 2 and worker_metrics.request_seconds.count(outcome="ok") == 2
    assert worker_metrics.ongoing.values[()][-1] == 0
    assert worker_metrics.cached_steps.count() == 0  # Cache-DiT off: no section, nothing recorded


def test_every_counter_reads_its_attribute(worker_metrics):
    adaln = AdalnStats(requests=1, gpu_hit_plans=1, host_hit_plans=2, pool_hit_plans=3, built_plans=4,
                       rebuild_s=1.5, rebuild_bytes_read=1000, h2d_bytes=200)
    stats = GenerationStats(steps=11, forwards=10, frames=124, tokens=1000, text_tokens=8, adaln_mode="online",
                            schedule_key="k", adaln=adaln,
                            cache_dit=CacheDitStats(config="F1B0 W4 R0.04 MC1", num_inference_steps=10,
                                                    cached_steps=[5, 7, 9]))
    finish(worker_metrics, stats)
    plans = worker_metrics.plans
    assert [plans.total(tier=t) for t in ("gpu", "host", "pool", "built")] == [1, 2, 3, 4]
    assert worker_metrics.warm_requests.total(warm="false") == 1 and worker_metrics.warm_requests.count(warm="true") == 0
    assert worker_metrics.rebuild_seconds.values[()] == [1.5]
    assert worker_metrics.rebuild_read_bytes.total() == 1000 and worker_metrics.plan_copied_bytes.total() == 200
    assert worker_metrics.cached_steps.total() == 3


def test_resident_adaln_and_failed_requests_record_no_plans(worker_metrics):
    resident = FakeEngine(EngineConfig.model_validate({"adaln": {"mode": "resident"}})).generate(REQUEST)
    assert resident.stats.adaln is None and resident.stats.model_dump()["adaln"] == {}
    finish(worker_metrics, resident.stats)
    finish(worker_metrics, None, outcome="error")
    assert worker_metrics.plans.values == {} and worker_metrics.warm_requests.values == {}
    assert (worker_metrics.requests.total(outcome="ok"), worker_metrics.requests.total(outcome="error")) == (1, 1)


def test_stage_times_and_seconds_per_forward_come_from_the_results_timings(worker_metrics):
    stats = GenerationStats(steps=11, forwards=10, frames=124, tokens=1000, text_tokens=8, adaln_mode="resident",
                            schedule_key="k")
    # A split app's worker: plan and denoise only (encode and decode ran in the other stages).
    worker_metrics.request_started()
    worker_metrics.request_finished("ok", 3.0, stats, GenerationTimings(plan_s=0.5, denoise_s=2.0, total_s=2.5))
    assert worker_metrics.denoise_seconds_per_forward.values[()] == [0.2]  # 2.0 s over 10 forwards
    stage = worker_metrics.stage_seconds
    assert (stage.values[(("stage", "plan"),)], stage.values[(("stage", "denoise"),)]) == ([0.5], [2.0])
    assert stage.count(stage="encode") == stage.count(stage="decode") == stage.count(stage="mux") == 0  # not 0 s


def test_offload_bytes_count_the_growth_of_the_engines_cumulative_counter(worker_metrics):
    def with_offload(h2d_bytes: int) -> GenerationStats:
        return GenerationStats(steps=2, forwards=1, frames=124, tokens=1000, text_tokens=8, adaln_mode="resident",
                               schedule_key="k", offload=OffloadStats(h2d_bytes=h2d_bytes))

    for cumulative in (100, 250, 40):  # 40: the engine's counter restarted (offload applied again)
        finish(worker_metrics, with_offload(cumulative))
    assert worker_metrics.offload_copied_bytes.values[()] == [100, 150, 40]


# --- The ingress: pending generations, Retry-After responses, video jobs --------------------------------


@pytest.fixture
def recorded_metrics(monkeypatch) -> None:
    """Serve's metric classes replaced by `RecordedMetric` for whatever the test builds next."""
    for kind in ("Counter", "Histogram", "Gauge"):
        monkeypatch.setattr(serve_metrics, kind, RecordedMetric)


def test_the_pending_generations_gauge_follows_admissions_and_refusals(recorded_metrics):
    from deployments.ingress import PendingGenerations
    from deployments.metrics import PendingGenerationsGauge
    from deployments.errors import RequestError

    gauge = PendingGenerationsGauge()
    pending = PendingGenerations(limit=2, on_count=gauge.set)
    with pending.admit(), pending.admit():
        with pytest.raises(RequestError), pending.admit():  # refused: the count does not move
            pass
    with pytest.raises(RuntimeError), pending.admit():  # a failed generation gives its slot back too
        raise RuntimeError("worker fault")
    assert gauge.pending.values[()] == [0, 1, 2, 1, 0, 1, 0]


def test_video_job_metrics_tag_each_report_with_its_model_and_outcome(recorded_metrics):
    from deployments.metrics import VideoJobMetrics
    from jobs.metrics import JobOutcome

    metrics = VideoJobMetrics()
    metrics.job_created("tiny")
    metrics.job_created("tiny-b")
    for outcome in JobOutcome:
        metrics.job_finished("tiny", outcome)
    metrics.queue_depth("tiny", 3)
    metrics.queue_depth("tiny", 2)
    assert (metrics.created.total(model="tiny"), metrics.created.total(model="tiny-b")) == (1, 1)
    assert dict(metrics.finished.values) == {
        (("model", "tiny"), ("outcome", outcome)): [1] for outcome in ("succeeded", "failed", "cancelled", "expired")
    }
    assert metrics.queued.values[(("model", "tiny"),)] == [3, 2]  # a gauge: the last value is the depth


def test_a_429_from_a_full_job_queue_is_counted_once_by_route_and_status(recorded_metrics, tmp_path):
    from fastapi.testclient import TestClient

    from deployments.metrics import RetryAfterCounter, RetryAfterResponses
    from deployments.videos import VideoApi, build_videos_app
    from jobs.config import AuthConfig, JobsConfig
    from jobs.outputs import OutputStore
    from jobs.service import JobService
    from jobs.sqlite_store import SqliteJobStore
    from tests.jobs_support import FakeVideoBackend
    from tests.test_videos_api import TINY, VALID, wait_for

    service = JobService(
        store=SqliteJobStore(tmp_path / "jobs.sqlite3"), outputs=OutputStore(str(tmp_path / "outputs")),
        backend=FakeVideoBackend(hold_before_step=1), models=[TINY],
        config=JobsConfig(state_dir=str(tmp_path), max_queued_per_model=1, poll_s=0.02, events_poll_s=0.05),
    )
    app = build_videos_app(VideoApi(service=service, auth=AuthConfig()))
    counter = RetryAfterCounter()
    app.add_middleware(RetryAfterResponses, counter=counter)
    with TestClient(app) as client:
        running = client.post("/v1/videos", json=VALID).json()["id"]
        wait_for(client, running, lambda j: j["status"] == "in_progress", "the first job to start")
        assert client.post("/v1/videos", json=VALID).status_code == 200  # queued: the queue is full now
        refused = client.post("/v1/videos", json=VALID)
        assert (refused.status_code, "retry-after" in refused.headers) == (429, True)
        assert client.get("/v1/videos/video_" + "A" * 22).status_code == 404  # no Retry-After: not counted
    assert counter.responses.values == {(("route", "/v1/videos"), ("status", "429")): [1]}


@pytest.mark.parametrize(("path", "route"), [
    ("/v1/videos", "/v1/videos"),
    ("/v1/videos/video_" + "A" * 22, "/v1/videos/{video_id}"),  # the template: ids do not become tag values
])
def test_the_ingress_app_counts_its_503s_with_retry_after_by_route_template(recorded_metrics, monkeypatch, path,
                                                                           route):
    """The ingress's own app, before its replica set the video API: every video route answers 503 with
    Retry-After, and the middleware installed on it counts each."""
    from fastapi.testclient import TestClient

    from deployments.ingress import api
    from deployments.metrics import RetryAfterResponses

    monkeypatch.setattr(api, "middleware_stack", None)  # rebuilt on the next request, with the recorded metrics
    with TestClient(api) as client:
        responses = [client.get(path) for _ in range(2)]
        built = api.middleware_stack
    assert [(r.status_code, r.headers["retry-after"]) for r in responses] == [(503, "5")] * 2
    while not isinstance(built, RetryAfterResponses):  # the user middleware sits under Starlette's error handling
        built = built.app
    assert built.counter.responses.values == {(("route", route), ("status", "503")): [1, 1]}


class CountedRouter:
    """Stands in for a `ScheduleAffinityRouter` in this process's registry (`routing.registry.CountingRouter`)."""

    def __init__(self, deployment_name: str, hits: int, spills: int, unkeyed: int) -> None:
        from deployments.routing.registry import AffinityCounters

        self.deployment_name = deployment_name
        self.counters = AffinityCounters(hits, spills, unkeyed)


def test_router_decisions_are_reported_for_every_partitions_worker(recorded_metrics, monkeypatch):
    """An app of both partitions routes to `Worker` and `Worker-ref2va`, each through its own router: the gauge
    carries each one's counts under its deployment's name (two routers of one deployment, e.g. two handles, sum)."""
    from deployments.metrics import RoutingMetrics
    from deployments.partitions import worker_deployment_name
    from deployments.routing import registry
    from deployments.routing.registry import register_router

    # Only this test's routers: an earlier test in this process may have left a live router registered.
    monkeypatch.setattr(registry, "_ROUTERS", weakref.WeakSet())
    names = [worker_deployment_name(index, partition) for index, partition in enumerate(("fl2va", "ref2va"))]
    routers = [CountedRouter(names[0], hits=5, spills=1, unkeyed=0), CountedRouter(names[0], hits=2, spills=0,
               unkeyed=1), CountedRouter(names[1], hits=3, spills=2, unkeyed=4), CountedRouter("Other", 9, 9, 9)]
    for router in routers:
        register_router(router)
    metrics = RoutingMetrics(names)
    metrics.update()
    reported = {tags: values[-1] for tags, values in metrics.requests.values.items()}
    assert names == ["Worker", "Worker-ref2va"]
    assert reported == {
        (("route", "affinity_hit"), ("worker", "Worker")): 7.0, (("route", "spill"), ("worker", "Worker")): 1.0,
        (("route", "unkeyed"), ("worker", "Worker")): 1.0,
        (("route", "affinity_hit"), ("worker", "Worker-ref2va")): 3.0,
        (("route", "spill"), ("worker", "Worker-ref2va")): 2.0, (("route", "unkeyed"), ("worker", "Worker-ref2va")): 4.0,
    }


def test_compiles_after_the_warm_up_are_the_engines_count_as_of_its_last_request(worker_metrics):
    from engine.compiled import CompileStats

    def stats(since_warmup: int | None) -> GenerationStats:
        compile_stats = None if since_warmup is None else CompileStats(
            frames_compiled=1 + since_warmup, since_warmup=since_warmup, graph_breaks=0, warmup_s=2.0,
            warmup_forwards=1)
        return GenerationStats(steps=3, forwards=2, frames=124, tokens=100, text_tokens=8, adaln_mode="online",
                               schedule_key="k", compile=compile_stats)

    gauge = worker_metrics.compiles_after_warmup
    assert gauge.values[()] == [0]  # from the replica's start: a series to see, before any compile
    for since in (0, 0, 1, 1, 3):  # warmed canvases; one not warmed (1 graph); one more shape (2 graphs)
        finish(worker_metrics, stats(since))
    assert gauge.values[()] == [0, 0, 0, 1, 1, 3]
    finish(worker_metrics, stats(None))  # compile off, or a request without stats: nothing recorded
    finish(worker_metrics, stats(2))  # a request reporting less than seen (never from one engine) lowers nothing
    assert gauge.values[()][-1] == 3
