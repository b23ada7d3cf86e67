"""The node pool through Ray Serve: a freshly started worker replica's first request for a schedule the
pool already holds is a pool hit, not a rebuild.

One application built from serve_config.yaml's args (fused: the pool is the Worker's, split or not) with one
worker replica; after it published its plans the replica is killed, and the replica Serve starts in its place
(a fresh process, empty GPU and host tiers) finds them in the node's pool, which outlives replicas.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray
import torch
import yaml

from actors.host_cache_pool import POOL_NAMESPACE, pool_actor_name
from deployments.schemas import decode_latents
from tests.serve_helpers import serve_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400), pytest.mark.ray]  # slow: Ray + Serve: the pool under the app

ROOT = Path(__file__).resolve().parents[1]
#: 4 grid points: 3 forwards, one AdaLN plan each.
BODY = {"prompt": "shared plans", "steps": 4, "seconds": 5.0, "width": 64, "height": 64, "seed": 3,
        "flow_shift": 1.7, "return_video": False, "return_latents": True}


@pytest.fixture(scope="module")
def app_args(tmp_path_factory):
    args = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    args["engine"]["checkpoint_root"] = str(tmp_path_factory.mktemp("checkpoints"))
    args["stages"] = "fused"
    args["worker"] = {**args["worker"], "num_replicas": 1, "autoscaling": {"min_replicas": 1, "max_replicas": 1}}
    args["worker"].pop("autoscaling")
    return args


def generate(app: str, body: dict):
    from ray import serve

    return serve.get_app_handle(app).generate.remote(body).result(timeout_s=240)


def worker_replica() -> dict:
    """The Worker's one replica actor, once it is the only one alive."""
    deadline = time.monotonic() + 120
    while True:
        alive = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("SERVE_REPLICA::pool#Worker#")]
        if len(alive) == 1:
            return alive[0]
        assert time.monotonic() < deadline, f"expected one Worker replica, got {alive}"
        time.sleep(0.5)


def wait_replaced(old: dict) -> None:
    """Serve started a replica in place of the killed `old` and it serves."""
    from ray import serve

    deadline = time.monotonic() + 120
    while worker_replica()["name"] == old["name"] or serve.status().applications["pool"].status != "RUNNING":
        assert time.monotonic() < deadline, f"the killed replica {old['name']} was not replaced"
        time.sleep(0.5)


def wait_for_groups(n: int, timeout_s: float = 120.0) -> list:
    node_id = ray.get_runtime_context().get_node_id()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pool = ray.get_actor(pool_actor_name(node_id, 0), namespace=POOL_NAMESPACE)
            groups = ray.get(pool.group_keys.remote(), timeout=30)
            if len(groups) >= n:
                return groups
        except ValueError:  # not created yet
            pass
        assert time.monotonic() < deadline, f"the pool never held {n} group(s)"
        time.sleep(0.5)


def test_a_fresh_replica_gets_a_pool_hit_for_a_schedule_the_pool_holds(app_args):
    from ray import serve

    from deployments.app import build_app

    with serve_cluster():
        serve.run(build_app(app_args), name="pool", route_prefix="/")
        rebuilt = generate("pool", BODY)
        first_stats = rebuilt.stats["adaln"]
        num_plans = first_stats["built_plans"]
        assert num_plans == 3 and first_stats["pool_hit_plans"] == 0
        assert first_stats["pool_published_plans"] == num_plans
        wait_for_groups(1)  # published in the background, after the response

        first = worker_replica()
        ray.kill(ray.get_actor(first["name"], namespace=first["namespace"]), no_restart=True)
        wait_replaced(first)  # a fresh worker process: nothing in its GPU slab or host tier
        hit = generate("pool", BODY)
        hit_stats = hit.stats["adaln"]
        assert hit_stats["pool_hit_plans"] == num_plans and hit_stats["built_plans"] == 0
        assert hit_stats["gpu_hit_plans"] == hit_stats["host_hit_plans"] == 0
        assert hit.latents == rebuilt.latents and hit.model == rebuilt.model
        video = decode_latents(hit.latents)["video"]
        assert video.shape == (24, 37, 4, 4) and torch.isfinite(video).all()

        # The same replica rebuilding an unseen schedule (warm process), for comparison.
        other = generate("pool", {**BODY, "flow_shift": 2.9})
        # forward 0's plan (both sigmas 1: timestep 0.0) is every schedule's: a GPU hit; the other two are rebuilt.
        assert (other.stats["adaln"]["gpu_hit_plans"], other.stats["adaln"]["built_plans"]) == (1, 2)
        assert other.stats["adaln"]["pool_hit_plans"] == 0
        print(f"\nfirst-request plan_s: rebuild (first replica, cold) {rebuilt.timings.plan_s:.4f} s, "
              f"pool hit (its replacement) {hit.timings.plan_s:.4f} s "
              f"[pool lookup {hit_stats['pool_lookup_s']:.4f} s], "
              f"rebuild of a new schedule on the replacement (warm) {other.timings.plan_s:.4f} s")
