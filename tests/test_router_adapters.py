"""Adapter-aware routing: a request naming LoRA adapters goes to a replica holding both its adapters and its
schedule's plans, then one holding the plans, then one holding the adapters (``deployments.routing``).

The policy as pure functions first (a matrix of what each replica holds), then the reporter's wire form, then two
replicas behind Serve: adapter requests stay on the replica that holds their adapter, where rendezvous hashing
alone would send them elsewhere.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from deployments.routing.policy import (
    ServiceCosts,
    SlabView,
    affinity_key,
    first_choice,
    rank_for_key,
    rank_for_slab_key,
)
from deployments.routing.report import AdapterReport, SlabReport
from deployments.routing.reporter import ScheduleAffinityReporter
from engine.api import SlabState

pytestmark = pytest.mark.ray  # its slow tests run Serve on the session's cluster


def view(*keys: str, capacity: int = 32, plans: int = 8) -> SlabView:
    return SlabView(tuple(keys), tuple(plans for _ in keys), capacity)


def test_the_affinity_key_is_the_schedule_key_without_adapters_and_ignores_their_order():
    assert affinity_key("s9") == "s9"
    assert affinity_key("s9", ("turbo", "style")) == affinity_key("s9", ("style", "turbo", "style"))
    assert affinity_key("s9", ("turbo",)) != affinity_key("s9", ("style",)) != "s9"


# What each of four replicas holds for a request of schedule "s" naming adapter "a": plans (its slab holds "s"),
# adapters (it holds "a"). Equal loads: the order is the tier order, each tier one replica.
HOLDS = {"both": (True, True), "plans": (True, False), "adapters": (False, True), "neither": (False, False)}


@pytest.mark.parametrize("loads", [
    {"both": 0, "plans": 0, "adapters": 0, "neither": 0},
    {"both": 1, "plans": 1, "adapters": 1, "neither": 1},
    {"both": 1, "plans": 0, "adapters": 1, "neither": 0},  # within the bounds, holding beats a lower load
])
@pytest.mark.parametrize("costs", [None, ServiceCosts(generation_s=4.3, miss_s=0.25)])  # adapter load unmeasured
def test_slab_rank_tiers_both_then_plans_then_adapters_then_neither(loads, costs):
    views = {rid: view("s") if plans else view("other") for rid, (plans, _) in HOLDS.items()}
    holders = {rid for rid, (_, adapters) in HOLDS.items() if adapters}
    ranked = rank_for_slab_key("s", loads, views, 8, lambda k: 0, hold_factor=8.0, load_factor=8.0,
                               costs=costs if len(set(loads.values())) == 1 else None,
                               adapter_holders=holders, rendezvous_key=affinity_key("s", ("a",)))
    assert ranked == ["both", "plans", "adapters", "neither"]


@pytest.mark.parametrize("holders, expected_first", [
    (None, "plans-holder"),  # no adapters named: the plan holder, as before
    ({"idle"}, "plans-holder"),  # the plan holder first, even if another holds the adapters
    ({"plans-holder"}, "plans-holder"),
    ({"idle", "plans-holder"}, "plans-holder"),
])
def test_without_costs_the_plan_holder_comes_before_an_adapter_holder(holders, expected_first):
    views = {"plans-holder": view("s"), "idle": view()}
    ranked = rank_for_slab_key("s", {"plans-holder": 0, "idle": 0}, views, 8, lambda k: 0, adapter_holders=holders)
    assert ranked[0] == expected_first and sorted(ranked) == ["idle", "plans-holder"]


@pytest.mark.parametrize("adapter_load_s, holder_of_adapter_first", [
    (None, False),  # unmeasured: plans before adapters (a tie on expected start keeps the tier order)
    (0.1, False),  # an adapter read (0.1 s) costs less than a plan miss (0.25 s): the plan holder
    (2.0, True),  # a 2 s read costs more than the miss: the adapter holder
])
def test_with_costs_a_measured_adapter_load_weighs_against_a_plan_miss(adapter_load_s, holder_of_adapter_first):
    costs = ServiceCosts(generation_s=4.3, miss_s=0.25, adapter_load_s=adapter_load_s)
    views = {"plans": view("s"), "adapters": view()}
    ranked = rank_for_slab_key("s", {"plans": 0, "adapters": 0}, views, 8, lambda k: 0, costs=costs,
                               adapter_holders={"adapters"})
    assert ranked[0] == ("adapters" if holder_of_adapter_first else "plans")


def test_an_overloaded_adapter_holder_comes_after_every_replica_within_the_bound():
    views = {"busy": view("s"), "a": view(), "b": view()}
    loads = {"busy": 8, "a": 0, "b": 0}  # over ceil(1.25 x 9 / 3) = 4: it holds plans and adapter, and comes last
    ranked = rank_for_slab_key("s", loads, views, 8, lambda k: 0, hold_factor=1.25, adapter_holders={"busy"})
    assert ranked[-1] == "busy"


REPLICAS = [f"r{i}" for i in range(4)]


@pytest.mark.parametrize("holders", [set(), {"r2"}, {"r1", "r3"}, set(REPLICAS)])
@pytest.mark.parametrize("schedule", ["s5", "s9", "s50"])
def test_rendezvous_rank_puts_adapter_holders_within_the_bound_first(holders, schedule):
    key = affinity_key(schedule, ("a",))
    loads = {rid: 0 for rid in REPLICAS}
    ranked = rank_for_key(key, loads, adapter_holders=holders)
    assert set(ranked[:len(holders)]) == holders
    plain = rank_for_key(key, loads)
    # each group keeps the rendezvous order of the request's affinity key
    assert [r for r in ranked if r in holders] == [r for r in plain if r in holders]
    assert [r for r in ranked if r not in holders] == [r for r in plain if r not in holders]
    if not holders:
        assert ranked[0] == first_choice(key, REPLICAS)


def test_rendezvous_rank_leaves_an_adapter_holder_over_the_bound_last():
    loads = {"r0": 4, "r1": 0, "r2": 0, "r3": 0}
    assert rank_for_key(affinity_key("s", ("a",)), loads, adapter_holders={"r0"})[-1] == "r0"


def test_each_schedule_and_adapter_pair_has_its_own_rendezvous_home():
    homes = {first_choice(affinity_key("s9", (f"lora{i}",)), REPLICAS) for i in range(40)}
    assert homes == set(REPLICAS)  # pairs of one schedule spread over the replicas


# -- the reporter's wire form ------------------------------------------------------------------------------


class AdapterWorker(ScheduleAffinityReporter):
    def __init__(self, held=()):
        self.held = tuple(held)

    def held_adapters(self):
        return self.held

    def slab_state(self):
        return SlabState(("s",), (8,), capacity_plans=16, free_plans=8)


def test_the_reporter_reports_held_adapters_and_those_of_requests_in_flight():
    w = AdapterWorker(held=("turbo",))
    before = time.time()
    with w.track_schedule("s", ("style",)):
        report = AdapterReport.parse(w.record_routing_stats())
        assert report.held == {"turbo", "style"} and report.at >= before
    assert AdapterReport.parse(w.record_routing_stats()).held == {"turbo"}  # the request is done
    assert AdapterReport.parse(AdapterWorker().record_routing_stats()).held == frozenset()


@pytest.mark.parametrize("stats", [{}, {"adapters": ["a"]}, {"adapters": {"held": "a", "at": 0}},
                                   {"adapters": {"held": [1], "at": 0}}, {"adapters": {"held": ["a"]}},
                                   {"adapters": {"held": ["a"], "at": float("nan")}}])
def test_a_malformed_adapter_report_is_none(stats):
    assert AdapterReport.parse(stats) is None


def test_the_reporter_reports_a_moving_mean_of_adapter_load_seconds():
    w = AdapterWorker()
    w.record_service(4.0, 0.3, missed_slab=True)
    assert SlabReport.parse(w.record_routing_stats()).costs.adapter_load_s is None
    w.record_service(4.0, 0.3, missed_slab=True, adapter_load_s=1.5)
    assert SlabReport.parse(w.record_routing_stats()).costs.adapter_load_s == pytest.approx(1.5)


@pytest.mark.parametrize("value", ["x", float("nan"), float("inf"), -1.0])
def test_a_malformed_adapter_load_keeps_the_other_costs(value):
    slab = {"keys": ["a"], "plans": [8], "ongoing": [], "capacity_plans": 8, "at": 0,
            "generation_s": 4.0, "miss_s": 0.2, "adapter_load_s": value}
    assert SlabReport.parse({"slab": slab}).costs == ServiceCosts(4.0, 0.2, None)


# -- the router object, on fake replicas (no Ray cluster) ---------------------------------------------------


def adapter_replica(rid: str, held=(), *, cached_load: int = 0, actual_load: int = 0):
    from tests.test_router import FakeReplica

    replica = FakeReplica(rid, ["s"], actual_load)
    replica.routing_stats["adapters"] = {"held": list(held), "at": time.time()}
    return replica, cached_load


def choose_for(router, replicas, key: str, adapters) -> str:
    from types import SimpleNamespace

    async def one():
        request = SimpleNamespace(kwargs={"schedule_key": key, "adapters": adapters},
                                  routing_context=SimpleNamespace(should_backoff=False),
                                  future=asyncio.get_running_loop().create_future())
        (choice,), = await router.choose_replicas(replicas, request)
        return choice.replica_id.unique_id

    return asyncio.run(one())


def test_a_holder_of_plans_and_adapters_that_looks_busy_is_probed_before_the_request_goes_elsewhere():
    """A request that just finished can still count in the router's cache: the replica holding both the plans and
    the adapter looks busy, the other plan holder idle. Sending there would load the adapter; the router probes
    the holder first, finds it idle, and keeps the request there."""
    from tests.test_router import fake_router

    (holder, stale), (other, idle) = adapter_replica("A", ["a"], cached_load=1), adapter_replica("B")
    router = fake_router({holder: stale, other: idle})
    assert choose_for(router, [holder, other], "s", ("a",)) == "A" and holder.probes == 1
    holder.actual_load = 1  # really busy: the idle plan holder takes it (costs: a wait beats a read, unmeasured)
    router = fake_router({holder: 1, other: 0})
    assert choose_for(router, [holder, other], "s", ("a",)) == "B"


@pytest.mark.parametrize("kwarg, names", [(None, ()), ((), ()), (("b", "a", "b"), ("a", "b")), ("a", ("a",))])
def test_the_router_reads_the_adapter_names_of_the_handle_call(kwarg, names):
    from types import SimpleNamespace

    from deployments.routing.router import ScheduleAffinityRouter

    request = SimpleNamespace(kwargs={"schedule_key": "s", "adapters": kwarg})
    assert ScheduleAffinityRouter.adapters_of(request) == names


# -- two replicas behind Serve -----------------------------------------------------------------------------

APP = "adapter-affinity"


def adapter_app():
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from deployments.routing.router import ScheduleAffinityRouter

    @serve.deployment(
        name="AdapterEcho", num_replicas=2, max_ongoing_requests=8, ray_actor_options={"num_cpus": 0},
        request_router_config=RequestRouterConfig(
            request_router_class=ScheduleAffinityRouter,
            # load_factor 1: a second request in flight spills off a busy replica (how the test places "b")
            request_router_kwargs={"load_factor": 1.0, "hold_factor": 1.0},
            request_routing_stats_period_s=0.2,
        ),
    )
    class AdapterEcho(ScheduleAffinityReporter):
        """A replica holding at most one adapter (an LRU of one): a request for another one loads it."""

        def __init__(self):
            self.held: tuple[str, ...] = ()

        def held_adapters(self):
            return self.held

        async def generate(self, sleep_s: float, schedule_key: str, adapters: tuple[str, ...] = (),
                           started: str = ""):
            with self.track_schedule(schedule_key, adapters):
                loaded = tuple(adapters) != self.held
                self.held = tuple(adapters)
                if started:  # tells the test this request is running here (the replica counts it)
                    Path(started).touch()
                await asyncio.sleep(sleep_s)
                return serve.get_replica_context().replica_id.unique_id, loaded

    return AdapterEcho.bind()


def wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def pick_adapter_names(replicas):
    """Two adapter names whose (schedule, adapter) pairs both have the same rendezvous home: without the
    adapter reports both would be sent there and each request would load its adapter again."""
    home = first_choice(affinity_key("s", ("lora0",)), replicas)
    other = next(f"lora{i}" for i in range(1, 200) if first_choice(affinity_key("s", (f"lora{i}",)), replicas) == home)
    return "lora0", other, home


@pytest.mark.slow  # Ray + Serve (the session's cluster)
def test_adapter_requests_stay_on_the_replica_holding_their_adapter(tmp_path):
    from ray import serve

    from tests.serve_helpers import serve_cluster

    with serve_cluster():
        handle = serve.run(adapter_app(), name=APP, route_prefix=None)
        try:
            seen = set()
            deadline = time.monotonic() + 30
            while len(seen) < 2:  # unkeyed concurrent calls reach both replicas
                assert time.monotonic() < deadline
                calls = [handle.generate.remote(0.2, schedule_key="") for _ in range(4)]
                seen |= {call.result(timeout_s=30)[0] for call in calls}
            replicas = sorted(seen)
            a, b, home = pick_adapter_names(replicas)
            # Place them: a long "a" request on its home, then "b" while it runs: over the bound there, so it
            # spills to the other replica, which loads "b".
            started = tmp_path / "a-started"
            first = handle.generate.remote(1.5, schedule_key="s", adapters=(a,), started=str(started))
            wait_for(started.exists, 10.0)  # a fixed sleep loses on a loaded machine: "a" may not have arrived
            second = handle.generate.remote(0.0, schedule_key="s", adapters=(b,))
            where_a, _ = first.result(timeout_s=30)
            where_b, _ = second.result(timeout_s=30)
            assert where_a == home and where_b != home
            time.sleep(1.0)  # a few report periods: both replicas report what they hold
            # One at a time now, alternating: rendezvous alone would send both to `home`; each goes where its
            # adapter is held, and no request loads one.
            for _ in range(4):
                for name, expected in ((a, where_a), (b, where_b)):
                    where, loaded = handle.generate.remote(0.0, schedule_key="s", adapters=(name,)).result(timeout_s=30)
                    assert (where, loaded) == (expected, False), name
        finally:
            serve.delete(APP)


@pytest.mark.slow  # Ray + Serve (the session's cluster): the whole app on two fake-engine worker replicas
def test_through_the_app_alternating_adapters_each_stay_where_they_are_held(tmp_path):
    """The ingress passes each request's adapters to the Worker router; each replica (a fake engine holding the
    last request's adapters only) reports them. After one request of each adapter has placed it, alternating
    requests never load an adapter again (schedule affinity alone keeps them on one replica: a load every time)."""
    import requests
    from ray import serve

    from deployments.app import build_application
    from deployments.schemas import AppConfig
    from tests.fake_engine import FakeEngine
    from tests.serve_helpers import APP_NAME, serve_cluster, sse_events, wait_healthy

    adapters = {name: {"path": str(tmp_path / f"{name}.safetensors")} for name in ("a", "b")}
    config = AppConfig.model_validate({
        "stages": "fused", "engine": {"adapters": adapters},
        "worker": {"num_replicas": 2, "load_factor": 1.0, "hold_factor": 1.0, "routing_stats_period_s": 0.2},
    })
    with serve_cluster() as url:
        serve.run(build_application(config, FakeEngine), name=APP_NAME, route_prefix="/")
        try:
            wait_healthy(url)

            def generate(name: str, prompt: str = "a fox") -> list[str]:
                body = {"prompt": prompt, "steps": 11, "width": 64, "height": 64, "return_video": False,
                        "adapters": [{"name": name}]}
                r = requests.post(f"{url}/v1/generations", json=body, timeout=60)
                assert r.status_code == 200, r.text
                return r.json()["stats"]["adapters"]["loaded"]

            # Place them: a slow "a" request (10 forwards of 0.1 s), then "b" once "a" has taken a step on its
            # replica: over the load bound there, so "b" goes to the other; each loads its adapter once.
            body = {"prompt": "slow a fox", "steps": 11, "width": 64, "height": 64, "return_video": False,
                    "adapters": [{"name": "a"}]}
            with requests.post(f"{url}/v1/generations:stream", json=body, stream=True, timeout=60) as r:
                assert r.status_code == 200, r.text
                events = sse_events(r)
                while (event := next(events))[0] != "progress" or event[1]["step"] < 1:
                    pass
                assert generate("b") == ["b"]
                name, result = next(e for e in events if e[0] != "progress")
                assert name == "result" and result["stats"]["adapters"]["loaded"] == ["a"]
            time.sleep(1.0)  # a few report periods
            # Repeats too: a replica that just finished a request can still look busy to the router, which would
            # send the next one elsewhere (the ping-pong a strict alternation could not tell from affinity).
            sequence = ("a", "a", "b", "b", "a", "b", "b", "a", "a")
            assert [generate(name) for name in sequence] == [[]] * len(sequence)
        finally:
            serve.delete(APP_NAME)
