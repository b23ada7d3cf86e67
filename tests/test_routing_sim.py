"""bench.routing_sim: the routing policies in a discrete-event simulation (no Ray), small runs.

The Belady row is an upper bound on any router's plan hit rate for the same request order; the simulation is
deterministic for a seed (virtual time); every request is served.
"""

import asyncio

import pytest

from bench.routing import FakePlanWorker
from bench.routing_sim import ROUTERS, SimConfig, simulate

SMALL = SimConfig(requests=240, warmup=40)


@pytest.mark.parametrize("workload", ["zipf", "uniform"])
@pytest.mark.parametrize("router", ROUTERS)
def test_no_router_beats_the_belady_bound_and_runs_are_deterministic(workload, router):
    row = simulate(workload, router, SMALL, seed=3)
    assert 0.0 < row["plan_hit_rate"] <= row["belady"] <= 1.0
    assert row["p50_ms"] >= SMALL.warm_ms  # every request costs at least a warm generation
    assert simulate(workload, router, SMALL, seed=3) == row


def test_a_slab_big_enough_for_every_schedule_misses_only_first_uses():
    cfg = SimConfig(requests=240, warmup=120, num_schedules=8, slab_plans=64)  # each slab holds all 8 schedules
    for router in ROUTERS:
        assert simulate("uniform", router, cfg)["plan_hit_rate"] > 0.9


def test_unknown_router_is_rejected():
    with pytest.raises(ValueError, match="router"):
        simulate("zipf", "nope", SMALL)


@pytest.mark.parametrize("workload", ["zipf", "uniform"])
def test_with_h3_costs_reported_a_hot_schedule_spreads_instead_of_queueing(workload):
    """H3's costs: a generation of seconds, a plan miss a few percent of it. Replicas that report them get idle
    GPUs used before a busy holder's queue: higher throughput than holding, p99 within Serve's default bound."""
    cfg = SimConfig(requests=900, warmup=150, warm_ms=4300.0, rebuild_ms_per_plan=13.0)
    slab, hold, default = (simulate(workload, router, cfg, seed=0) for router in ("slab", "slab-hold", "default"))
    assert slab["req_per_s"] > hold["req_per_s"]
    assert slab["p99_ms"] < hold["p99_ms"] and slab["p99_ms"] <= 1.2 * default["p99_ms"]


@pytest.mark.parametrize("workload", ["zipf", "uniform"])
def test_where_a_miss_costs_several_hits_the_costs_keep_schedules_on_their_holders(workload):
    cfg = SimConfig(requests=900, warmup=150)  # the CPU bench: 20 ms hit, 80 ms more for a miss
    slab, hold = (simulate(workload, router, cfg, seed=1) for router in ("slab", "slab-hold"))
    assert slab["plan_hit_rate"] >= hold["plan_hit_rate"] - 0.02 and slab["req_per_s"] >= hold["req_per_s"]


def test_the_serve_benchs_fake_worker_reports_its_service_costs_as_the_worker_does():
    """bench.routing's replicas: without the costs its affinity router would run the policy before them."""
    from deployments.routing.policy import ServiceCosts
    from deployments.routing.report import SlabReport

    worker = FakePlanWorker(slab_plans=16, plans_per_schedule=4, warm_s=0.002, rebuild_s_per_plan=0.001)
    for _ in range(2):  # a miss (4 plans built), then a hit
        asyncio.run(worker.generate({"schedule": 3}, schedule_key="s3"))
    costs = SlabReport.parse(worker.record_routing_stats()).costs
    assert costs == ServiceCosts(generation_s=pytest.approx(0.006 + 0.2 * (0.002 - 0.006)), miss_s=pytest.approx(0.004))
