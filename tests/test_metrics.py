"""Worker metrics are read from the engine's typed stats (`engine.api.GenerationStats`), attribute by attribute.

Ray's metric classes are replaced by recording fakes, so no cluster is needed; the stats come from the fake
engine (a schedule's first request builds its plans, later ones hit the GPU slab) or are built by hand.
"""

from __future__ import annotations

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
