"""HostCachePool / PoolClient: the node-wide host tier for AdaLN plans, on a local Ray cluster.

The actor-level tests publish and look up raw entries (`publish_arrays` / `lookup_arrays`); the plan-level
ones go through the client's `RemoteTier` side (`publish_group` / `lookup`) as the plan cache does."""

import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import ray
import torch

from actors.host_cache_pool import (
    PoolClient,
    make_group_key,
    numpy_to_tensor,
    pool_actor_name,
    pool_index,
    tensor_to_numpy,
)
from cache.plan_cache import PlanRows
from tests.serve_helpers import shared_ray

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # Ray: the node pool's actors

MiB = 1 << 20


@pytest.fixture(scope="module")
def ray_cluster():
    with shared_ray():  # the session's cluster (tests/serve_helpers.py), emptied after the module
        yield


def new_client(capacity_bytes: int = 8 * MiB, **options) -> PoolClient:
    # A fresh namespace per client: its own pool actors, nothing shared between tests.
    return PoolClient(capacity_bytes, namespace=f"test-{uuid.uuid4().hex[:8]}", detached=False, **options)


@pytest.fixture
def tier(ray_cluster):
    t = new_client()
    yield t
    t.close()


def page(seed: int, nbytes: int = MiB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def publish_and_wait(tier: PoolClient, group_key, entries) -> None:
    assert tier.publish_arrays(group_key, entries)


# -- keys and values (no Ray) ----------------------------------------------------------------------------------


def test_pool_index_is_stable_and_spreads_keys():
    keys = [(i, "blocks") for i in range(64)]
    assert [pool_index(k, 4) for k in keys] == [pool_index(k, 4) for k in keys]
    assert set(pool_index(k, 4) for k in keys) == {0, 1, 2, 3}


def test_bf16_roundtrip_through_uint16_keeps_bits():
    t = torch.randn(3, 5).to(torch.bfloat16)
    t[0, 0] = float("nan")
    a = tensor_to_numpy(t)
    assert a.dtype == np.uint16
    back = numpy_to_tensor(a, torch.bfloat16)
    assert torch.equal(back.view(torch.uint16), t.view(torch.uint16))


# -- the actor ---------------------------------------------------------------------------------------------


def test_publish_then_lookup_from_another_process_is_bit_identical(tier):
    bf16 = torch.randn(4, 2, 96).to(torch.bfloat16)
    f32 = np.random.default_rng(1).standard_normal((2, 300)).astype(np.float32)
    f32[0, 0] = np.float32("nan")
    gk = make_group_key([(11,), (12,)], "v1")
    publish_and_wait(tier, gk, {(11,): tensor_to_numpy(bf16), (12,): f32})

    @ray.remote(num_cpus=0)
    def read_elsewhere(namespace):
        other = PoolClient(8 * MiB, namespace=namespace, detached=False)
        found = other.lookup_arrays([(11,), (12,), (13,)], timeout_s=10)
        out = {k: (v.dtype.str, v.shape, v.tobytes(), v.flags.writeable) for k, v in found.items()}
        other.close()
        return out

    got = ray.get(read_elsewhere.remote(tier.namespace), timeout=60)
    assert set(got) == {(11,), (12,)}  # (13,) was never published: a partial answer
    dtype, shape, raw, writeable = got[(11,)]
    assert (dtype, shape, writeable) == ("<u2", (4, 2, 96), False)  # zero-copy views are read-only
    restored = numpy_to_tensor(np.frombuffer(raw, np.uint16).reshape(shape), torch.bfloat16)
    assert torch.equal(restored.view(torch.uint16), bf16.view(torch.uint16))
    assert got[(12,)][2] == f32.tobytes()


def test_lru_eviction_under_byte_capacity(ray_cluster):
    tier = new_client(3 * MiB)
    groups = {name: make_group_key([(name,)], "v1") for name in "abcd"}
    for name in "abc":
        publish_and_wait(tier, groups[name], {(name,): page(ord(name))})
    assert set(tier.lookup_arrays([("a",)], timeout_s=10)) == {("a",)}  # a is now the most recent group
    publish_and_wait(tier, groups["d"], {("d",): page(ord("d"))})

    found = tier.lookup_arrays([(n,) for n in "abcd"], timeout_s=10)
    assert set(found) == {("a",), ("c",), ("d",)}  # b was the least recently used group
    assert np.array_equal(found[("d",)], page(ord("d")))
    (stats,) = tier.pool_stats()
    assert stats["used_bytes"] == 3 * MiB <= stats["capacity_bytes"]
    assert stats["evicted_groups"] == 1 and stats["num_groups"] == 3

    # A group larger than the whole capacity is refused and evicts nothing.
    publish_and_wait(tier, make_group_key([("huge",)], "v1"), {("huge",): page(9, 4 * MiB)})
    assert set(tier.lookup_arrays([(n,) for n in "acd"], timeout_s=10)) == {("a",), ("c",), ("d",)}
    assert tier.pool_stats()[0]["rejected_groups"] == 1
    tier.close()


def test_invalidate_by_weights_version(tier):
    publish_and_wait(tier, make_group_key([("p", "v1")], "v1"), {("p", "v1"): page(1)})
    publish_and_wait(tier, make_group_key([("p", "v2")], "v2"), {("p", "v2"): page(2)})
    assert tier.invalidate("v1") == 1
    assert set(tier.lookup_arrays([("p", "v1"), ("p", "v2")], timeout_s=10)) == {("p", "v2")}
    assert tier.invalidate() == 1
    assert tier.lookup_arrays([("p", "v2")], timeout_s=10) == {}


def test_pinned_hits_stay_locked_until_the_next_lookup(ray_cluster):
    # On CPU the client pins through the fake device (the same path as cudaHostRegister on a GPU).
    tier = new_client(pin_memory=True)
    publish_and_wait(tier, make_group_key([("a",), ("b",)], "v1"), {("a",): page(1), ("b",): page(2, 2 * MiB)})
    found = tier.lookup_arrays([("a",), ("b",)], timeout_s=10)
    assert set(found) == {("a",), ("b",)} and tier.stats()["pinned_bytes"] == 3 * MiB
    assert np.array_equal(found[("b",)], page(2, 2 * MiB))  # locked in place: still the same bytes
    tier.unpin()  # what the next lookup does first
    assert tier.stats()["pinned_bytes"] == 0
    tier.close()


def test_keys_spread_over_several_pools_per_node(ray_cluster):
    tier = new_client(8 * MiB, pools_per_node=2)
    keys = [(i,) for i in range(8)]
    publish_and_wait(tier, make_group_key(keys, "v1"), {k: page(k[0], 4096) for k in keys})
    found = tier.lookup_arrays(keys, timeout_s=10)
    assert set(found) == set(keys) and all(np.array_equal(found[k], page(k[0], 4096)) for k in keys)
    assert sorted(s["num_objects"] for s in tier.pool_stats()) != [0, 8]  # both pools hold some keys
    assert sum(s["num_objects"] for s in tier.pool_stats()) == 8
    tier.close()


def wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the killed pool actor still answers"
        time.sleep(0.1)


def test_killed_pool_is_a_miss_then_recreated_on_next_use(tier):
    publish_and_wait(tier, make_group_key([("k",)], "v1"), {("k",): page(5)})
    old = ray.get_actor(pool_actor_name(tier.node_id, 0), namespace=tier.namespace)
    ray.kill(old, no_restart=True)
    wait_until_dead(old)  # the kill is asynchronous: a lookup racing it could still reach the old pool

    assert tier.lookup_arrays([("k",)], timeout_s=5) == {}  # speed only: a miss, no error
    assert tier.counts["lookup_failures"] >= 1

    deadline = time.monotonic() + 30
    while True:  # the dead actor's name is released asynchronously; the next use creates a new pool
        tier.publish_arrays(make_group_key([("k",)], "v1"), {("k",): page(5)})  # False while it is still dead
        if tier.lookup_arrays([("k",)], timeout_s=10):
            break
        assert time.monotonic() < deadline, "pool was not re-created"
    new = ray.get_actor(pool_actor_name(tier.node_id, 0), namespace=tier.namespace)
    assert new._actor_id != old._actor_id


def test_a_stalled_pool_is_a_miss_within_the_lookup_budget(tier):
    publish_and_wait(tier, make_group_key([("k",)], "v1"), {("k",): page(5)})
    assert set(tier.lookup_arrays([("k",)], timeout_s=30)) == {("k",)}  # published: a patient lookup hits
    pool = ray.get_actor(pool_actor_name(tier.node_id, 0), namespace=tier.namespace)
    pid = ray.get(pool.__ray_call__.remote(lambda _pool: os.getpid()), timeout=30)
    failures = tier.counts["lookup_failures"]

    os.kill(pid, signal.SIGSTOP)  # the pool's process stalls (swapped out, stuck): it answers nothing
    try:
        with ThreadPoolExecutor(1) as one:
            # A client that ignored its budget would wait until SIGCONT: result() would time out.
            found = one.submit(tier.lookup_arrays, [("k",)], timeout_s=0.5).result(timeout=30)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert found == {} and tier.counts["lookup_failures"] == failures + 1
    assert set(tier.lookup_arrays([("k",)], timeout_s=30)) == {("k",)}  # slow, not gone: the same entry hits again


# -- the plan cache's side: RemoteTier -----------------------------------------------------------------------


def plan_rows(seed: int, m: int = 2) -> PlanRows:
    """One plan's rows as the cache hands them over: bf16 blocks [num_blocks, M, width], final [M, width]."""
    g = torch.Generator().manual_seed(seed)
    return PlanRows(torch.randn(3, m, 96, generator=g).to(torch.bfloat16),
                    torch.randn(m, 32, generator=g).to(torch.bfloat16))


def key(version: str, *bits: int) -> tuple:
    return (version, tuple(bits))  # the shape of cache.plan_key.plan_key: M = len(bits) rows


class Gate:
    """Stands in for the compute stream's D2H event: the publisher thread waits on it (`ready.synchronize()`)."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def synchronize(self) -> None:
        assert self.opened.wait(60), "the test never opened the gate"


def test_published_plans_come_back_bit_identical_to_another_client(ray_cluster):
    publisher = new_client()
    reader = PoolClient(8 * MiB, namespace=publisher.namespace, detached=False, lookup_timeout_s=30)
    plans = {key("v1", 11, 12): plan_rows(1), key("v1", 13): plan_rows(2, m=1)}
    assert publisher.publish_group(plans, ready=None)
    publisher.flush()
    found = reader.lookup([*plans, key("v1", 99)])  # (v1, 99) was never published: a partial answer
    assert set(found) == set(plans)
    for k, rows in plans.items():
        assert torch.equal(found[k].blocks.view(torch.uint16), rows.blocks.view(torch.uint16))
        assert torch.equal(found[k].final.view(torch.uint16), rows.final.view(torch.uint16))
    assert (reader.counts["hit_plans"], reader.counts["miss_plans"]) == (2, 1)
    assert reader.lookup([key("v2", 11, 12)]) == {}  # other weights: never found
    assert publisher.counts["published_groups"] == 1
    (stats,) = publisher.pool_stats()
    assert stats["num_groups"] == 1 and stats["num_objects"] == 4  # blocks and final per plan
    publisher.close()
    reader.close()


def test_an_entry_with_the_wrong_shape_is_a_miss_not_a_bad_plan(tier):
    k = key("v1", 7, 8)  # M = 2 rows, but the stored rows have 3
    bad = plan_rows(3, m=3)
    assert tier.publish_arrays(make_group_key([k], "v1"), {(k, "blocks"): tensor_to_numpy(bad.blocks),
                                                            (k, "final"): tensor_to_numpy(bad.final)})
    assert tier.lookup([k]) == {} and tier.counts["bad_entries"] == 1


def test_a_busy_publisher_drops_groups_instead_of_queueing_them(tier):
    gate = Gate()  # holds the first group's send until opened, as a slow D2H copy would
    accepted = [tier.publish_group({key("v1", i): plan_rows(i, m=1)}, ready=gate) for i in range(4)]
    # One group in flight and one queued (max_pending_groups=2); the rest are dropped, not queued behind them.
    assert accepted == [True, True, False, False] and tier.counts["dropped_groups"] == 2
    gate.opened.set()
    tier.flush()
    assert tier.counts["published_groups"] == 2
    assert set(tier.lookup([key("v1", i) for i in range(4)])) == {key("v1", 0), key("v1", 1)}
    assert tier.publish_group({key("v1", 5): plan_rows(5, m=1)}, ready=None)  # free again once they were sent


def test_a_plan_whose_parts_landed_in_one_pool_only_is_a_miss_until_published_again(ray_cluster):
    """pools_per_node=2 spreads a plan's blocks and final over both pools; with one pool dead at publish time the
    other keeps its parts. A plan missing a part is a miss (rebuilt), the plans with both parts come back exact."""
    client = new_client(8 * MiB, pools_per_node=2, lookup_timeout_s=30)
    plans = {key("v1", i, i + 1): plan_rows(i) for i in range(16)}  # plan 11 has both parts in pool 0
    client.actor(1)  # both pools exist
    dead = ray.get_actor(pool_actor_name(client.node_id, 1), namespace=client.namespace)
    ray.kill(dead, no_restart=True)
    wait_until_dead(dead)
    assert client.publish_group(plans, ready=None)
    client.flush()
    assert client.counts["publish_failures"] == 1
    whole = {k for k in plans if {pool_index((k, part), 2) for part in ("blocks", "final")} == {0}}
    found = client.lookup(list(plans))
    assert set(found) == whole and 0 < len(whole) < len(plans)
    for k in found:
        assert torch.equal(found[k].blocks.view(torch.uint16), plans[k].blocks.view(torch.uint16))
        assert torch.equal(found[k].final.view(torch.uint16), plans[k].final.view(torch.uint16))
    deadline = time.monotonic() + 30
    while set(client.lookup(list(plans))) != set(plans):  # the next publish re-creates the dead pool
        assert time.monotonic() < deadline, "the dead pool was not re-created"
        client.publish_group(plans, ready=None)
        client.flush()
    client.close()


def test_two_clients_publishing_one_group_at_once_store_it_once(ray_cluster):
    first = new_client(8 * MiB, lookup_timeout_s=30)
    second = PoolClient(8 * MiB, namespace=first.namespace, detached=False, lookup_timeout_s=30)
    plans = {key("v1", i): plan_rows(i, m=1) for i in range(4)}
    entries = {(k, part): tensor_to_numpy(getattr(rows, part))
               for k, rows in plans.items() for part in ("blocks", "final")}
    group = make_group_key(list(plans), "v1")
    with ThreadPoolExecutor(2) as both:
        assert all(both.map(lambda c: c.publish_arrays(group, entries), (first, second)))
    (stats,) = first.pool_stats()
    assert (stats["num_groups"], stats["num_objects"]) == (1, 8)
    assert stats["used_bytes"] == sum(a.nbytes for a in entries.values())  # counted once
    found = second.lookup(list(plans))
    assert all(torch.equal(found[k].blocks.view(torch.uint16), plans[k].blocks.view(torch.uint16)) for k in plans)
    first.close()
    second.close()
