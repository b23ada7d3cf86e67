"""ScheduleAffinityRouter: ranking by reported GPU-slab contents (rendezvous hashing when replicas report no
slab) with bounded load.

Pure policy tests first (no Ray), then a small Serve app on a local cluster: a dummy worker whose
generate(payload, schedule_key) sleeps and returns its replica id, and a 2-replica ingress holding a handle;
then the same worker reporting a slab.
"""

import asyncio
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import ray
from ray import serve
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve.config import RequestRouterConfig

from deployments.routing.policy import (
    KeyPopularity,
    ServiceCosts,
    SlabView,
    bounded_load_limit,
    first_choice,
    rank_for_key,
    rank_for_slab_key,
    rendezvous_order,
)
from deployments.routing.registry import affinity_routers, schedule_affinity_stats
from deployments.routing.report import SlabReport
from deployments.routing.reporter import ScheduleAffinityReporter
from deployments.routing.router import ScheduleAffinityRouter
from engine.api import SlabState
from tests.serve_helpers import serve_cluster

pytestmark = pytest.mark.ray  # its slow tests run Serve on the session's cluster

KEYS = [f"steps=50/shift={s}" for s in range(200)]
FAKE_DEPLOYMENT = DeploymentID(name="Worker", app_name="fake")

# -- pure policy ---------------------------------------------------------------------------------------


def test_rendezvous_order_is_deterministic_and_independent_of_input_order():
    replicas = ["a1b2", "c3d4", "e5f6", "g7h8"]
    for key in KEYS[:20]:
        order = rendezvous_order(key, replicas)
        assert sorted(order) == sorted(replicas)
        assert rendezvous_order(key, list(reversed(replicas))) == order


def test_keys_spread_over_replicas():
    replicas = ["r0", "r1", "r2", "r3"]
    counts = Counter(first_choice(k, replicas) for k in KEYS)
    assert set(counts) == set(replicas)
    assert min(counts.values()) >= 30  # 200 keys over 4 replicas: ~50 each


def test_scaling_up_moves_only_keys_that_now_prefer_the_new_replica():
    before = ["r0", "r1", "r2"]
    after = before + ["r3"]
    moved = [k for k in KEYS if first_choice(k, before) != first_choice(k, after)]
    assert all(first_choice(k, after) == "r3" for k in moved)
    assert 30 <= len(moved) <= 75  # about a quarter of the keys


def test_scaling_down_moves_only_keys_of_the_removed_replica():
    before = ["r0", "r1", "r2", "r3"]
    after = ["r0", "r1", "r3"]
    for k in KEYS:
        if first_choice(k, before) != "r2":
            assert first_choice(k, after) == first_choice(k, before)
        else:
            # The removed replica's keys go to their second choice.
            assert first_choice(k, after) == rendezvous_order(k, before)[1]


def test_bounded_load_limit():
    assert bounded_load_limit(total_ongoing=0, num_replicas=4, load_factor=1.25) == 1
    assert bounded_load_limit(total_ongoing=7, num_replicas=4, load_factor=1.25) == 3  # ceil(1.25 * 8 / 4)
    assert bounded_load_limit(total_ongoing=3, num_replicas=1, load_factor=1.25) == 5


def test_rank_keeps_first_choice_while_within_bound():
    key = KEYS[0]
    order = rendezvous_order(key, ["r0", "r1", "r2", "r3"])
    loads = {rid: 1 for rid in order}  # balanced: limit ceil(1.25 * 5 / 4) = 2, everyone may take one
    assert rank_for_key(key, loads) == order


def test_rank_spills_to_next_rendezvous_choice_when_first_is_over_bound():
    key = KEYS[0]
    order = rendezvous_order(key, ["r0", "r1", "r2", "r3"])
    loads = {rid: 0 for rid in order}
    loads[order[0]] = 2  # limit ceil(1.25 * 3 / 4) = 1: the first choice is full, spill in rendezvous order
    assert rank_for_key(key, loads) == order[1:] + order[:1]


def test_rank_prefers_replicas_reporting_the_key_warm_when_spilling():
    key = KEYS[0]
    order = rendezvous_order(key, ["r0", "r1", "r2", "r3"])
    loads = {rid: 0 for rid in order}
    loads[order[0]] = 2
    warm = {order[3]: True}
    assert rank_for_key(key, loads, warm=warm) == [order[3], order[1], order[2], order[0]]


def test_reporter_counts_ongoing_and_recent_keys():
    class Worker(ScheduleAffinityReporter):
        max_reported_warm_keys = 2

    w = Worker()
    with w.track_schedule("a"):
        assert w.record_routing_stats()["ongoing"] == 1
    with w.track_schedule("b"), w.track_schedule(None):
        pass
    with w.track_schedule("c"):
        pass
    stats = w.record_routing_stats()
    assert stats == {"ongoing": 0, "warm_keys": ["c", "b"], "adapters": {"held": [], "at": stats["adapters"]["at"]}}
    w.forget_schedules(["c"])
    assert w.warm_schedule_keys() == ["b"]



# -- slab-aware ranking (pure) --------------------------------------------------------------------------


def view(*keys: str, capacity: int = 32, plans: int = 8) -> SlabView:
    return SlabView(tuple(keys), (plans,) * len(keys), capacity)


def test_slab_view_serving_a_key_makes_it_most_recent_and_evicts_from_the_lru_end():
    v = view("a", "b", "c", "d")  # full: 4 x 8 of 32 plans
    assert v.free_plans == 0
    assert v.with_served("c", 8).keys == ("c", "a", "b", "d")  # a hit evicts nothing
    assert v.with_served("e", 8).keys == ("e", "a", "b", "c")  # d was least recently used
    assert v.with_served("big", 20).keys == ("big", "a")       # 20 plans push out d, c and b
    assert view("a", capacity=32).with_served("b", 8).keys == ("b", "a")  # room to spare: nothing goes


def test_eviction_cost_is_zero_with_room_else_the_popularity_of_what_lru_evicts():
    popularity = {"a": 9, "b": 5, "c": 1, "d": 3}.get
    assert view("a", "b").eviction_cost(8, popularity) == 0
    full = view("a", "b", "c", "d")
    assert full.eviction_cost(8, popularity) == 3            # d goes
    assert full.eviction_cost(16, popularity) == 3 + 1       # d and c go
    assert view("a", "b", "c", capacity=28).eviction_cost(8, popularity) == 1  # 4 free: c goes


def test_key_popularity_counts_the_last_window_of_requests():
    popularity = KeyPopularity(window=3)
    for key in "aabc":
        popularity.record(key)
    assert (popularity.count("a"), popularity.count("b"), popularity.count("c"), popularity.count("z")) == (1, 1, 1, 0)


def test_slab_rank_sends_a_key_to_the_replica_whose_slab_holds_it():
    ids = ["r0", "r1", "r2", "r3"]
    views = {rid: view() for rid in ids}
    views["r2"] = view("hot")
    loads = {rid: 0 for rid in ids}
    assert rank_for_slab_key("hot", loads, views, 8, lambda k: 0)[0] == "r2"
    loads["r2"] = 2  # busier than the others, still within hold_factor x the mean: a hit beats a rebuild
    assert rank_for_slab_key("hot", loads, views, 8, lambda k: 0, hold_factor=3.0)[0] == "r2"
    # over the hold bound (ceil(1.0 * 3 / 4) = 1 < 3): placed elsewhere, the holder goes last
    assert rank_for_slab_key("hot", loads, views, 8, lambda k: 0, load_factor=1.0, hold_factor=1.0)[-1] == "r2"


def test_slab_rank_prefers_the_least_loaded_of_several_holders():
    views = {"r0": view("k"), "r1": view("k"), "r2": view()}
    loads = {"r0": 1, "r1": 0, "r2": 0}
    assert rank_for_slab_key("k", loads, views, 8, lambda k: 0)[:2] == ["r1", "r0"]


def test_slab_rank_places_a_new_key_where_eviction_hurts_least():
    popularity = {"hot1": 50, "hot2": 40, "cold1": 1, "cold2": 2, "warm": 10}.get
    views = {
        "r0": view("hot1", "hot2", "warm", "cold1"),   # would evict cold1 (1)
        "r1": view("cold2", "hot1", "hot2", "warm"),   # would evict warm (10)
        "r2": view("hot2", "hot1", "cold1", "cold2"),  # would evict cold2 (2)
    }
    loads = {"r0": 0, "r1": 0, "r2": 0}
    assert rank_for_slab_key("new", loads, views, 8, lambda k: popularity(k, 0)) == ["r0", "r2", "r1"]
    views["r1"] = view("hot1", capacity=32)  # room to spare beats evicting anything
    assert rank_for_slab_key("new", loads, views, 8, lambda k: popularity(k, 0))[0] == "r1"


def test_slab_rank_placement_stays_within_the_load_bound():
    views = {"r0": view(), "r1": view("a", "b", "c", "d"), "r2": view("a", "b", "c", "d")}
    loads = {"r0": 3, "r1": 0, "r2": 0}  # r0 has room but is over ceil(1.25 * 4 / 3) = 2
    ranked = rank_for_slab_key("new", loads, views, 8, lambda k: 1)
    assert ranked[-1] == "r0" and set(ranked[:2]) == {"r1", "r2"}


def test_slab_rank_ties_keep_rendezvous_order_so_routers_agree_on_a_cold_start():
    ids = [f"r{i}" for i in range(4)]
    views = {rid: view() for rid in ids}
    for key in KEYS[:20]:
        assert rank_for_slab_key(key, {rid: 0 for rid in ids}, views, 8, lambda k: 0) == rendezvous_order(key, ids)


def test_slab_report_round_trip_and_view_with_in_flight_and_sent_keys():
    class Worker(ScheduleAffinityReporter):
        def slab_state(self):
            return SlabState(("b", "a"), (8, 8), capacity_plans=24, free_plans=8)

    w = Worker()
    with w.track_schedule("c"):
        stats = w.record_routing_stats()
    report = SlabReport.parse(stats)
    assert (report.keys, report.plans, report.ongoing, report.capacity_plans) == (("b", "a"), (8, 8), ("c",), 24)
    # in flight c, then sent d: a (least recent) is evicted by the time d's plans are prepared
    assert report.view(["d"], lambda k: 8).keys == ("d", "c", "b")
    assert SlabReport.parse({"ongoing": 0}) is None
    assert SlabReport.parse({"slab": {"keys": ["a"], "plans": [], "capacity_plans": 8, "at": 0}}) is None
    assert SlabReport.parse({"slab": {"keys": [], "plans": [], "capacity_plans": 0, "at": 0}}) is None


def test_slab_view_prepares_in_flight_keys_in_arrival_order():
    """The replica runs its requests one at a time in arrival order (reported oldest first), so the newest in-flight
    schedule is the most recently used once they are done, and the oldest the first evicted."""

    class Worker(ScheduleAffinityReporter):
        def slab_state(self):
            return SlabState(("a", "x"), (8, 8), capacity_plans=16, free_plans=0)  # a's request is running

    w = Worker()
    with w.track_schedule("a"), w.track_schedule("b"), w.track_schedule("c"):
        report = SlabReport.parse(w.record_routing_stats())
    assert report.ongoing == ("a", "b", "c")
    assert report.view([], lambda k: 8).keys == ("c", "b")  # b then c prepared: a and x evicted
    assert report.view(["d"], lambda k: 8).keys == ("d", "c")


# Service costs: a 20-step H3 generation ~4.3 s against a ~0.25 s plan miss; the CPU bench's 20 ms hit against an
# 80 ms rebuild.
H3_COSTS = ServiceCosts(generation_s=4.3, miss_s=0.25)
REBUILD_BOUND = ServiceCosts(generation_s=0.02, miss_s=0.08)


@pytest.mark.parametrize("costs, holder_load, idle_wins", [
    (H3_COSTS, 0, False),  # an idle holder: a hit at once beats anything
    (H3_COSTS, 1, True),  # half a generation's wait (2.15 s) > one miss (0.25 s)
    (REBUILD_BOUND, 1, False), (REBUILD_BOUND, 4, False),  # waiting 3.5 hits (70 ms) < one rebuild (80 ms)
    (REBUILD_BOUND, 5, True),  # 4.5 hits (90 ms) > 80 ms
])
def test_an_idle_replica_beats_a_busy_holder_only_when_a_miss_costs_less_than_the_wait(costs, holder_load, idle_wins):
    assert (costs.expected_start_s(0, holds_key=False) < costs.expected_start_s(holder_load, holds_key=True)) is idle_wins
    views = {"holder": view("hot"), "idle": view("other"), "busy": view()}
    loads = {"holder": holder_load, "idle": 0, "busy": 1}
    ranked = rank_for_slab_key("hot", loads, views, 8, lambda k: 0, hold_factor=8.0, costs=costs)
    assert ranked[0] == ("idle" if idle_wins else "holder")
    assert sorted(ranked) == sorted(views)  # a reordering: every replica stays a candidate
    # without reported costs the holder always comes first while within the hold bound
    assert rank_for_slab_key("hot", loads, views, 8, lambda k: 0, hold_factor=8.0)[0] == "holder"


def test_idle_replicas_take_a_busy_holders_key_where_eviction_hurts_least():
    popularity = {"keep": 50, "spare": 1}.get
    views = {"holder": view("hot"), "a": view("keep", capacity=8), "b": view("spare", capacity=8)}
    loads = {"holder": 2, "a": 0, "b": 0}
    ranked = rank_for_slab_key("hot", loads, views, 8, lambda k: popularity(k, 0), costs=H3_COSTS)
    assert ranked == ["b", "a", "holder"]


@pytest.mark.parametrize("costs, first", [(H3_COSTS, "light"), (REBUILD_BOUND, "holder")])
def test_with_costs_the_replica_where_the_request_starts_first_comes_first(costs, first):
    # H3: behind the holder's 3 requests ~10.8 s, behind the other's 1 plus a miss ~2.4 s; where a miss costs 4
    # hits, 2.5 hits behind the holder (50 ms) beat half a hit plus a miss (90 ms).
    views = {"holder": view("hot"), "light": view("other"), "heavy": view()}
    loads = {"holder": 3, "light": 1, "heavy": 4}
    ranked = rank_for_slab_key("hot", loads, views, 8, lambda k: 0, hold_factor=8.0, costs=costs)
    assert ranked[0] == first and ranked[-1] == "heavy"
    starts = [costs.expected_start_s(loads[rid], views[rid].holds("hot")) for rid in ranked]
    assert starts == sorted(starts)


def test_the_reporter_reports_moving_means_of_its_service_costs_once_it_has_both():
    class Worker(ScheduleAffinityReporter):
        def slab_state(self):
            return SlabState(("a",), (8,), capacity_plans=16, free_plans=8)

    w = Worker()
    w.record_service(4.0, 0.001, missed_slab=False)
    assert SlabReport.parse(w.record_routing_stats()).costs is None  # no miss measured yet
    w.record_service(5.0, 0.3, missed_slab=True)
    costs = SlabReport.parse(w.record_routing_stats()).costs
    assert costs == ServiceCosts(generation_s=pytest.approx(4.2), miss_s=pytest.approx(0.3))
    for _ in range(50):
        w.record_service(2.0, 0.1, missed_slab=True)
    assert SlabReport.parse(w.record_routing_stats()).costs == ServiceCosts(pytest.approx(2.0, rel=1e-3),
                                                                           pytest.approx(0.1, rel=1e-3))


@pytest.mark.parametrize("generation_s, miss_s", [("x", 0.1), (float("nan"), 0.1), (1.0, float("inf")), (-1.0, 0.1)])
def test_malformed_service_costs_are_ignored_and_the_slab_report_kept(generation_s, miss_s):
    slab = {"keys": ["a"], "plans": [8], "ongoing": [], "capacity_plans": 8, "at": 0,
            "generation_s": generation_s, "miss_s": miss_s}
    report = SlabReport.parse({"slab": slab})
    assert report is not None and report.keys == ("a",) and report.costs is None


def test_reporter_without_a_slab_reports_none():
    class Worker(ScheduleAffinityReporter):
        pass

    assert "slab" not in Worker().record_routing_stats()

    class Resident(ScheduleAffinityReporter):
        def slab_state(self):
            return SlabState()  # resident AdaLN: no slab, every replica is as good

    assert "slab" not in Resident().record_routing_stats()


# -- the router object, on fake replicas (no Ray cluster) ----------------------------------------------------


class FakeReplica:
    """A RunningReplica as the router uses it: an id, its routing stats, and its own queue length on probe."""

    def __init__(self, rid: str, slab_keys=(), actual_load: int = 0, costs=(4.3, 0.25)):
        self.replica_id = ReplicaID(rid, FAKE_DEPLOYMENT)
        slab = {"keys": list(slab_keys), "plans": [8] * len(slab_keys), "ongoing": [], "capacity_plans": 32,
                "at": time.time(), "generation_s": costs[0], "miss_s": costs[1]}
        self.routing_stats = {"ongoing": actual_load, "slab": slab}
        self.actual_load = actual_load
        self.max_ongoing_requests = 8
        self.probes = 0

    async def get_queue_len(self, deadline_s: float) -> int:
        self.probes += 1
        return self.actual_load


def fake_router(cached_loads, **kwargs) -> ScheduleAffinityRouter:
    router = ScheduleAffinityRouter(deployment_id=FAKE_DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)
    for replica, load in cached_loads.items():
        router.replica_queue_len_cache.update(replica.replica_id, load)
    return router


def choose(router, replicas, key: str) -> str:
    async def one():
        request = SimpleNamespace(kwargs={"schedule_key": key}, routing_context=SimpleNamespace(should_backoff=False),
                                  future=asyncio.get_running_loop().create_future())
        (choice,), = await router.choose_replicas(replicas, request)
        return choice.replica_id.unique_id

    return asyncio.run(one())


def test_an_idle_looking_replica_is_probed_before_a_busy_holders_key_spills_to_it():
    """Another process's sends reach this router's cache only when it next talks to that replica: an "idle" replica
    can be busy. The spill to it is confirmed like the holder's load, so the key goes to one really idle."""
    holder, stale, idle = FakeReplica("H", ["hot"], 2), FakeReplica("B", [], 1), FakeReplica("C", ["x"], 0)
    replicas = [holder, stale, idle]
    assert rank_for_slab_key("hot", {"H": 2, "B": 0, "C": 0}, {"H": view("hot"), "B": view(), "C": view("x")},
                             8, lambda k: 1, costs=H3_COSTS)[0] == "B"  # as the cache has it, B goes first
    router = fake_router({holder: 2, stale: 0, idle: 0})
    assert choose(router, replicas, "hot") == "C"
    assert stale.probes == 1
    stale.actual_load = 0  # really idle: still the first choice
    assert choose(fake_router({holder: 2, stale: 0, idle: 0}), replicas, "hot") == "B"


def test_the_spill_targets_probe_keeps_what_this_router_sent_it_meanwhile():
    """A send lands in the cache at once but reaches the replica later: its own count, probed meanwhile, misses it."""
    holder, target, idle = FakeReplica("H", ["hot"], 2), FakeReplica("B", [], 0), FakeReplica("C", ["x"], 0)
    router = fake_router({holder: 2, target: 0, idle: 0})

    def answer_after_a_send(replica):
        async def get_queue_len(deadline_s: float) -> int:
            # another routing task's request goes to B while the probes are out (Serve's on_send_request) ...
            router.replica_queue_len_cache.update(target.replica_id, 1)
            await asyncio.sleep(0)
            return 0 if replica is target else replica.actual_load  # ... and has not reached B yet

        return get_queue_len

    holder.get_queue_len, target.get_queue_len = answer_after_a_send(holder), answer_after_a_send(target)
    assert choose(router, [holder, target, idle], "hot") == "C"


# -- on Serve ------------------------------------------------------------------------------------------

APP = "router_test"
NUM_WORKERS = 3


@serve.deployment(
    num_replicas=NUM_WORKERS,
    max_ongoing_requests=16,
    ray_actor_options={"num_cpus": 0},
    request_router_config=RequestRouterConfig(
        request_router_class=ScheduleAffinityRouter,
        request_router_kwargs={"load_factor": 1.25},
        request_routing_stats_period_s=0.5,
    ),
)
class EchoWorker(ScheduleAffinityReporter):
    async def generate(self, payload: dict, schedule_key: str = None) -> str:
        with self.track_schedule(schedule_key):
            await asyncio.sleep(payload.get("sleep_s", 0.0))
            return serve.get_replica_context().replica_id.unique_id


@serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 0})
class EchoIngress:
    def __init__(self, worker):
        self.worker = worker

    async def call(self, key: str):
        me = serve.get_replica_context().replica_id.unique_id
        return me, await self.worker.generate.remote({}, schedule_key=key)

    async def stats(self):
        return schedule_affinity_stats("EchoWorker")


@pytest.fixture(scope="module")
def app():
    with serve_cluster():  # the session's cluster and Serve (its HTTP proxy unused: handles only)
        ingress = serve.run(EchoIngress.bind(EchoWorker.bind()), name=APP, route_prefix=None)
        worker = serve.get_deployment_handle("EchoWorker", app_name=APP)
        yield ingress, worker


def call(handle_method, *args, timeout_s=30, **kwargs):
    return handle_method.remote(*args, **kwargs).result(timeout_s=timeout_s)


def wait_until_router_sees_idle_replicas(timeout_s=10.0):
    """Completions reach the driver's router a few ms after the results; wait for them before a burst."""
    deadline = time.monotonic() + timeout_s
    for router in affinity_routers("EchoWorker"):
        while any(router.replica_queue_len_cache.get(r.replica_id) for r in router.curr_replicas.values()):
            assert time.monotonic() < deadline
            time.sleep(0.005)


def worker_replica_ids(worker) -> list:
    seen = set()
    deadline = time.monotonic() + 30
    while len(seen) < NUM_WORKERS:  # concurrent unkeyed requests reach every replica
        assert time.monotonic() < deadline
        responses = [worker.generate.remote({"sleep_s": 0.2}) for _ in range(2 * NUM_WORKERS)]
        seen |= {r.result(timeout_s=30) for r in responses}
    return sorted(seen)


@pytest.mark.slow  # Ray + Serve (the session's cluster)
def test_same_key_goes_to_its_rendezvous_replica(app):
    _, worker = app
    replicas = worker_replica_ids(worker)
    for key in KEYS[:12]:
        got = {call(worker.generate, {}, schedule_key=key) for _ in range(4)}
        assert got == {first_choice(key, replicas)}, key


@pytest.mark.slow  # Ray + Serve (the session's cluster)
def test_all_handles_agree_without_shared_state(app):
    ingress, worker = app
    replicas = worker_replica_ids(worker)
    by_ingress = {}
    for key in KEYS[20:32]:
        for _ in range(3):
            ingress_id, worker_id = call(ingress.call, key)
            by_ingress.setdefault(ingress_id, set()).add((key, worker_id))
            assert worker_id == first_choice(key, replicas)
    assert len(by_ingress) == 2, "both ingress replicas should have routed requests"


@pytest.mark.slow  # Ray + Serve (the session's cluster)
def test_hot_key_spills_over_bounded_load_to_next_choice(app):
    _, worker = app
    replicas = worker_replica_ids(worker)
    key = KEYS[40]
    order = rendezvous_order(key, replicas)
    before = schedule_affinity_stats("EchoWorker")
    wait_until_router_sees_idle_replicas()
    # 2 s each: the six must overlap at the home replica even when a loaded machine sends them slowly
    responses = [worker.generate.remote({"sleep_s": 2.0}, schedule_key=key) for _ in range(6)]
    used = Counter(r.result(timeout_s=30) for r in responses)
    assert len(used) >= 2, used
    assert used[order[0]] >= used[order[-1]]
    assert used[order[1]] >= 1  # the first spill goes to the key's second choice
    after = schedule_affinity_stats("EchoWorker")
    assert after["spills"] > before["spills"]
    assert after["hits"] > before["hits"]


@pytest.mark.slow  # Ray + Serve (the session's cluster)
def test_requests_without_key_route_by_least_load(app):
    _, worker = app
    wait_until_router_sees_idle_replicas()
    responses = [worker.generate.remote({"sleep_s": 0.5}) for _ in range(6)]
    used = Counter(r.result(timeout_s=30) for r in responses)
    assert sum(used.values()) == 6
    assert len(used) == NUM_WORKERS  # 6 concurrent requests over 3 idle replicas: 2 each
    assert max(used.values()) == 2


@pytest.mark.slow  # Ray + Serve (the session's cluster)
def test_replicas_report_warm_keys_to_the_router(app):
    _, worker = app
    key = KEYS[60]
    call(worker.generate, {}, schedule_key=key)
    (router,) = affinity_routers("EchoWorker")  # the driver's handle
    deadline = time.monotonic() + 20
    while not any(key in (r.routing_stats or {}).get("warm_keys", ()) for r in router.curr_replicas.values()):
        assert time.monotonic() < deadline, "routing stats never arrived"
        time.sleep(0.25)


@pytest.mark.slow  # Ray + Serve (the session's cluster)
def test_ingress_reports_affinity_stats(app):
    ingress, _ = app
    stats = call(ingress.stats)
    assert set(stats) == {"hits", "spills", "unkeyed"}


def test_router_kwargs_are_validated_naming_the_key():
    state = type("State", (), {})()
    with pytest.raises(ValueError, match="load_factor"):
        ScheduleAffinityRouter.initialize_state(state, load_factor=0.9)
    with pytest.raises(ValueError, match=r"load_fator\n  Extra inputs are not permitted"):
        ScheduleAffinityRouter.initialize_state(state, load_fator=1.5)
    with pytest.raises(ValueError, match="hold_factor"):
        ScheduleAffinityRouter.initialize_state(state, hold_factor=0.5)
    with pytest.raises(ValueError, match="spill_confirm_s"):
        ScheduleAffinityRouter.initialize_state(state, spill_confirm_s=float("nan"))
    ScheduleAffinityRouter.initialize_state(state, load_factor=2, spill_confirm_s=0.0)
    assert (state.options.load_factor, state.options.hold_factor, state.options.spill_confirm_s) == (2.0, 3.0, 0.0)
