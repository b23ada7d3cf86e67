"""HostCachePool / PoolTier: the node-wide host tier for AdaLN plans, on a local Ray cluster."""

import time
import uuid

import numpy as np
import pytest
import ray
import torch

from actors.host_cache_pool import (
    GroupLRU,
    PoolTier,
    make_group_key,
    numpy_to_tensor,
    pool_actor_name,
    pool_index,
    tensor_to_numpy,
)

MiB = 1 << 20


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def tier(ray_cluster):
    # A fresh namespace per test: its own pool actors, nothing shared between tests.
    t = PoolTier(8 * MiB, namespace=f"test-{uuid.uuid4().hex[:8]}", detached=False)
    yield t
    t.close()


def page(seed: int, nbytes: int = MiB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def publish_and_wait(tier: PoolTier, group_key, entries) -> None:
    assert tier.publish_async(group_key, entries)
    tier.flush()


# -- bookkeeping (no Ray) ----------------------------------------------------------------------------------


def test_group_lru_evicts_least_recently_used_group():
    lru = GroupLRU(capacity_bytes=300)
    for name in "abc":
        assert lru.admit(((name,), 0), {name: (name.upper(), 100)})
    assert lru.lookup(["a"]) == {"a": "A"}  # a becomes most recent: order is b, c, a
    assert lru.admit((("d",), 0), {"d": ("D", 100)})
    assert lru.group_keys() == [(("c",), 0), (("a",), 0), (("d",), 0)]  # b was least recently used
    assert "b" not in lru and lru.used_bytes == 300 and lru.evicted_groups == 1
    lru.check()


def test_group_lru_shares_objects_between_groups_and_counts_them_once():
    lru = GroupLRU(capacity_bytes=300)
    assert lru.admit((("x", "y"), 0), {"x": (1, 100), "y": (2, 100)})
    assert lru.admit((("y", "z"), 0), {"z": (3, 100)}, shared=["y"])
    assert lru.used_bytes == 300
    lru.check()
    assert lru.invalidate() == 2 and lru.used_bytes == 0 and lru.num_objects == 0


def test_group_lru_rejects_group_larger_than_capacity():
    lru = GroupLRU(capacity_bytes=100)
    assert lru.admit((("a",), 0), {"a": (1, 60)})
    assert not lru.admit((("big",), 0), {"big": (2, 101)})
    assert lru.group_keys() == [(("a",), 0)]  # nothing evicted for a group that can never fit
    lru.check()


def test_group_lru_invalidates_one_weights_version():
    lru = GroupLRU(capacity_bytes=1000)
    lru.admit((("a",), "v1"), {"a": (1, 10)})
    lru.admit((("b",), "v2"), {"b": (2, 10)})
    assert lru.invalidate("v1") == 1
    assert lru.group_keys() == [(("b",), "v2")]
    lru.check()


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
    publish_and_wait(tier, gk, {(11,): bf16, (12,): f32})

    @ray.remote(num_cpus=0)
    def read_elsewhere(namespace):
        other = PoolTier(8 * MiB, namespace=namespace, detached=False)
        found = other.lookup([(11,), (12,), (13,)], timeout_s=10)
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
    tier = PoolTier(3 * MiB, namespace=f"test-{uuid.uuid4().hex[:8]}", detached=False)
    groups = {name: make_group_key([(name,)], "v1") for name in "abcd"}
    for name in "abc":
        publish_and_wait(tier, groups[name], {(name,): page(ord(name))})
    assert set(tier.lookup([("a",)], timeout_s=10)) == {("a",)}  # a is now the most recent group
    publish_and_wait(tier, groups["d"], {("d",): page(ord("d"))})

    found = tier.lookup([(n,) for n in "abcd"], timeout_s=10)
    assert set(found) == {("a",), ("c",), ("d",)}  # b was the least recently used group
    assert np.array_equal(found[("d",)], page(ord("d")))
    (stats,) = tier.stats()
    assert stats["used_bytes"] == 3 * MiB <= stats["capacity_bytes"]
    assert stats["evicted_groups"] == 1 and stats["num_groups"] == 3

    # A group larger than the whole capacity is refused and evicts nothing.
    publish_and_wait(tier, make_group_key([("huge",)], "v1"), {("huge",): page(9, 4 * MiB)})
    assert set(tier.lookup([(n,) for n in "acd"], timeout_s=10)) == {("a",), ("c",), ("d",)}
    assert tier.stats()[0]["rejected_groups"] == 1
    tier.close()


def test_invalidate_by_weights_version(tier):
    publish_and_wait(tier, make_group_key([("p", "v1")], "v1"), {("p", "v1"): page(1)})
    publish_and_wait(tier, make_group_key([("p", "v2")], "v2"), {("p", "v2"): page(2)})
    assert tier.invalidate("v1") == 1
    assert set(tier.lookup([("p", "v1"), ("p", "v2")], timeout_s=10)) == {("p", "v2")}
    assert tier.invalidate() == 1
    assert tier.lookup([("p", "v2")], timeout_s=10) == {}


def test_keys_spread_over_several_pools_per_node(ray_cluster):
    tier = PoolTier(8 * MiB, pools_per_node=2, namespace=f"test-{uuid.uuid4().hex[:8]}", detached=False)
    keys = [(i,) for i in range(8)]
    publish_and_wait(tier, make_group_key(keys, "v1"), {k: page(k[0], 4096) for k in keys})
    found = tier.lookup(keys, timeout_s=10)
    assert set(found) == set(keys) and all(np.array_equal(found[k], page(k[0], 4096)) for k in keys)
    assert sorted(s["num_objects"] for s in tier.stats()) != [0, 8]  # both pools hold some keys
    assert sum(s["num_objects"] for s in tier.stats()) == 8
    tier.close()


def test_killed_pool_is_a_miss_then_recreated_on_next_use(tier):
    publish_and_wait(tier, make_group_key([("k",)], "v1"), {("k",): page(5)})
    old = ray.get_actor(pool_actor_name(tier.node_id, 0), namespace=tier.namespace)
    ray.kill(old, no_restart=True)

    t0 = time.monotonic()
    assert tier.lookup([("k",)], timeout_s=5) == {}  # speed only: no error
    assert time.monotonic() - t0 < 5
    assert tier.counts["lookup_failures"] >= 1

    deadline = time.monotonic() + 30
    while True:  # the dead actor's name is released asynchronously; the next use creates a new pool
        publish_and_wait(tier, make_group_key([("k",)], "v1"), {("k",): page(5)})
        if tier.lookup([("k",)], timeout_s=10):
            break
        assert time.monotonic() < deadline, "pool was not re-created"
    new = ray.get_actor(pool_actor_name(tier.node_id, 0), namespace=tier.namespace)
    assert new._actor_id != old._actor_id


def test_lookup_times_out_to_a_miss(tier):
    # A fresh pool answers its first call only after its process started; a tiny budget is a plain miss.
    assert tier.lookup([("never",)], timeout_s=0.001) == {}


def test_publish_async_does_not_wait_for_the_pool(tier):
    big = page(3, 64 * MiB)
    tier.lookup([("warmup",)], timeout_s=30)  # actor started
    t0 = time.perf_counter()
    accepted = [tier.publish_async(make_group_key([("big", i)], "v1"), {("big", i): big}) for i in range(4)]
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.05, f"publish_async took {elapsed:.3f}s"
    # Two may be in flight at once; the rest are dropped rather than queued behind them.
    assert accepted[:2] == [True, True] and tier.counts["publish_dropped"] == accepted.count(False) >= 1
    tier.flush()
