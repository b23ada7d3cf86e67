"""ScheduleAffinityRouter: rendezvous hashing on schedule_key with bounded load.

Pure policy tests first (no Ray), then a small Serve app on a local cluster: a dummy worker whose
generate(payload, schedule_key) sleeps and returns its replica id, and a 2-replica ingress holding a handle.
"""

import asyncio
import time
from collections import Counter

import pytest
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from deployments.router import (
    affinity_routers,
    ScheduleAffinityReporter,
    ScheduleAffinityRouter,
    bounded_load_limit,
    first_choice,
    rank_for_key,
    rendezvous_order,
    schedule_affinity_stats,
)

KEYS = [f"steps=50/shift={s}" for s in range(200)]

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
    assert w.record_routing_stats() == {"ongoing": 0, "warm_keys": ["c", "b"]}
    w.forget_schedules(["c"])
    assert w.warm_schedule_keys() == ["b"]


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
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")
    ingress = serve.run(EchoIngress.bind(EchoWorker.bind()), name=APP, route_prefix=None)
    worker = serve.get_deployment_handle("EchoWorker", app_name=APP)
    yield ingress, worker
    serve.shutdown()
    ray.shutdown()


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


def test_same_key_goes_to_its_rendezvous_replica(app):
    _, worker = app
    replicas = worker_replica_ids(worker)
    for key in KEYS[:12]:
        got = {call(worker.generate, {}, schedule_key=key) for _ in range(4)}
        assert got == {first_choice(key, replicas)}, key


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


def test_hot_key_spills_over_bounded_load_to_next_choice(app):
    _, worker = app
    replicas = worker_replica_ids(worker)
    key = KEYS[40]
    order = rendezvous_order(key, replicas)
    before = schedule_affinity_stats("EchoWorker")
    responses = [worker.generate.remote({"sleep_s": 1.0}, schedule_key=key) for _ in range(6)]
    used = Counter(r.result(timeout_s=30) for r in responses)
    assert len(used) >= 2, used
    assert used[order[0]] >= used[order[-1]]
    assert used[order[1]] >= 1  # the first spill goes to the key's second choice
    after = schedule_affinity_stats("EchoWorker")
    assert after["spills"] > before["spills"]
    assert after["hits"] > before["hits"]


def test_requests_without_key_route_by_least_load(app):
    _, worker = app
    wait_until_router_sees_idle_replicas()
    responses = [worker.generate.remote({"sleep_s": 0.5}) for _ in range(6)]
    used = Counter(r.result(timeout_s=30) for r in responses)
    assert sum(used.values()) == 6
    assert len(used) == NUM_WORKERS  # 6 concurrent requests over 3 idle replicas: 2 each
    assert max(used.values()) == 2


def test_replicas_report_warm_keys_to_the_router(app):
    _, worker = app
    key = KEYS[60]
    call(worker.generate, {}, schedule_key=key)
    (router,) = affinity_routers("EchoWorker")  # the driver's handle
    deadline = time.monotonic() + 20
    while not any(key in (r.routing_stats or {}).get("warm_keys", ()) for r in router.curr_replicas.values()):
        assert time.monotonic() < deadline, "routing stats never arrived"
        time.sleep(0.25)


def test_ingress_reports_affinity_stats(app):
    ingress, _ = app
    stats = call(ingress.stats)
    assert set(stats) == {"hits", "spills", "unkeyed"}



def test_router_kwargs_are_validated():
    state = type("State", (), {})()
    with pytest.raises(ValueError, match="load_factor"):
        ScheduleAffinityRouter.initialize_state(state, load_factor=0.9)
    with pytest.raises(ValueError, match="unknown request_router_kwargs"):
        ScheduleAffinityRouter.initialize_state(state, load_fator=1.5)
    ScheduleAffinityRouter.initialize_state(state, load_factor=2, spill_confirm_s=0.0)
    assert (state.load_factor, state.spill_confirm_s, state.key_kwarg) == (2.0, 0.0, "schedule_key")
