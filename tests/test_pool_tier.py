"""The node pool as the plan cache's remote tier (`actors.host_cache_pool.PoolClient`), engine level, on a
local Ray cluster.

Workers here are plain Engines on CPU, each with its own PoolClient (as separate replicas would have) over
one pool namespace per test.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
import ray
import torch

from actors.host_cache_pool import PoolClient, make_pool_client, pool_actor_name, pool_enabled
from engine.api import GenerationRequest
from engine.config import EngineConfig, PoolConfig
from engine.engine import Engine
from model.tiny import make_tiny_checkpoint
from tests.serve_helpers import shared_ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.ray]  # slow: Ray: engines on the node pool

MiB = 1 << 20
#: The smallest request the tiny checkpoint serves (64x64 px, 5 s), latents only: 4 grid points = 3 forwards.
REQUEST = dict(prompt="a pool of plans", steps=4, seconds=5.0, width=64, height=64, seed=7, return_video=False)
NUM_PLANS = 3  # forward 0 (timestep 0.0 for both modalities) and two more with 2 distinct timesteps each


@pytest.fixture(scope="module")
def ray_cluster():
    with shared_ray():  # the session's cluster (tests/serve_helpers.py), emptied after the module
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The seed-0 tiny checkpoint, and a fine-tune of it: the same text encoder and VAEs, a seed-1 transformer
    (a weight update replaces the transformer only)."""
    root = tmp_path_factory.mktemp("pool-ckpt")
    seed0 = make_tiny_checkpoint(root / "seed0", "diffusers", seed=0)
    tuned = Path(shutil.copytree(seed0, root / "tuned"))
    shutil.rmtree(tuned / "transformer")
    seed1 = make_tiny_checkpoint(root / "seed1", "diffusers", seed=1, components=False)
    shutil.copytree(seed1 / "transformer", tuned / "transformer")
    return seed0, tuned


@pytest.fixture
def namespace(ray_cluster):
    return f"test-pool-{uuid.uuid4().hex[:8]}"


def client(namespace: str, timeout_s: float = 30.0) -> PoolClient:
    """One worker's pool client (generous lookup budget: the test machine is loaded)."""
    return PoolClient(64 * MiB, namespace=namespace, detached=False, lookup_timeout_s=timeout_s)


def worker(checkpoint, remote=None) -> Engine:
    config = EngineConfig(checkpoint=str(checkpoint), device="cpu", adaln={"mode": "online", "host_cache_gb": 0.01})
    return Engine(config, remote=remote)


def same_bits(a, b) -> bool:
    return torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio)


def pool_groups(namespace: str) -> list:
    handle = ray.get_actor(pool_actor_name(ray.get_runtime_context().get_node_id(), 0), namespace=namespace)
    return ray.get(handle.group_keys.remote(), timeout=60)


def test_config_defaults_and_auto_enable(ray_cluster):
    config = PoolConfig()
    assert (config.enabled, config.pools_per_node, config.capacity_gb, config.lookup_timeout_s) == (None, 1, 16.0, 2.0)
    assert EngineConfig().pool == config
    assert pool_enabled(config, "online") and not pool_enabled(config, "resident")
    assert not pool_enabled(PoolConfig(enabled=False), "online")
    assert make_pool_client(config, "cpu", "resident") is None
    remote = make_pool_client(PoolConfig(capacity_gb=0.01), "cpu", namespace=f"test-{uuid.uuid4().hex[:8]}")
    try:
        assert remote is not None and remote.pin_memory is False and remote.lookup_timeout_s == 2.0
    finally:
        remote.close()


def test_a_fresh_worker_gets_pool_hits_with_the_same_bits(checkpoints, namespace):
    a_remote, b_remote = client(namespace), client(namespace)
    a = worker(checkpoints[0], a_remote)
    first = a.generate(GenerationRequest(**REQUEST))
    stats = first.stats.adaln
    assert stats.built_plans == NUM_PLANS and stats.pool_hit_plans == 0
    assert stats.pool_published_plans == NUM_PLANS
    a_remote.flush()
    assert len(pool_groups(namespace)) == 1 and a_remote.counts["published_groups"] == 1

    b = worker(checkpoints[0], b_remote)  # fresh: empty slab and host tier
    second = b.generate(GenerationRequest(**REQUEST))
    stats = second.stats.adaln
    assert stats.pool_hit_plans == NUM_PLANS
    assert stats.built_plans == 0 and stats.pool_published_plans == 0
    assert same_bits(first, second)
    # ... and both equal a worker without any pool.
    assert same_bits(first, worker(checkpoints[0]).generate(GenerationRequest(**REQUEST)))
    print(f"\nplan_s rebuild {first.timings.plan_s:.4f} s vs pool hit {second.timings.plan_s:.4f} s "
          f"(pool lookup {stats.pool_lookup_s:.4f} s)")
    for r in (a_remote, b_remote):
        r.close()


def test_a_killed_pool_costs_speed_only(checkpoints, namespace):
    a_remote = client(namespace)
    first = worker(checkpoints[0], a_remote).generate(GenerationRequest(**REQUEST))
    a_remote.flush()
    ray.kill(ray.get_actor(pool_actor_name(a_remote.node_id, 0), namespace=namespace), no_restart=True)

    b_remote = client(namespace, timeout_s=5.0)
    second = worker(checkpoints[0], b_remote).generate(GenerationRequest(**REQUEST))  # no error: rebuilt plans
    stats = second.stats.adaln
    assert stats.pool_hit_plans == 0 and stats.built_plans == NUM_PLANS
    assert same_bits(first, second)
    for r in (a_remote, b_remote):
        r.close()


def test_an_unreachable_pool_is_a_miss_within_the_budget(checkpoints, namespace):
    class Unreachable(PoolClient):
        def actor(self, index):  # the pool can be neither found nor created
            raise RuntimeError("pool gone")

    remote = Unreachable(MiB, namespace=namespace, detached=False, lookup_timeout_s=0.5)
    engine = worker(checkpoints[0], remote)
    # the engine's warm-up asked the pool once (to set up its connections): a failure, counted, not raised
    assert (remote.counts["lookup_failures"], remote.counts["publish_failures"]) == (1, 0)
    result = engine.generate(GenerationRequest(**REQUEST))
    assert result.stats.adaln.built_plans == NUM_PLANS and result.stats.adaln.pool_hit_plans == 0
    remote.flush()
    # One lookup (all three plans at once) and one publish (the request's group), both counted, neither raised.
    assert (remote.counts["lookup_failures"], remote.counts["publish_failures"]) == (2, 1)
    remote.close()


def test_a_weight_update_leaves_no_stale_plan_in_the_pool(checkpoints, namespace):
    a_remote = client(namespace)
    a = worker(checkpoints[0], a_remote)
    a.generate(GenerationRequest(**REQUEST))
    a_remote.flush()
    old_version = a.plan_cache.weights_version
    assert [g[1] for g in pool_groups(namespace)] == [old_version]

    a.update_weights(checkpoints[1])
    assert pool_groups(namespace) == []  # dropped, not just unreachable
    after = a.generate(GenerationRequest(**REQUEST))
    assert after.stats.adaln.built_plans == NUM_PLANS and after.stats.adaln.pool_hit_plans == 0
    a_remote.flush()
    new_version = a.plan_cache.weights_version
    assert new_version != old_version and [g[1] for g in pool_groups(namespace)] == [new_version]

    # A worker still on the old weights never sees the new plans (the version is in every key) ...
    old_remote = client(namespace)
    old = worker(checkpoints[0], old_remote).generate(GenerationRequest(**REQUEST))
    assert old.stats.adaln.pool_hit_plans == 0 and not same_bits(old, after)
    # ... and the updated worker's outputs are exactly the new checkpoint's.
    assert same_bits(after, worker(checkpoints[1]).generate(GenerationRequest(**REQUEST)))
    for r in (a_remote, old_remote):
        r.close()
