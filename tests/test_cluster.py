"""A multi-node cluster on one machine (`ray.cluster_utils.Cluster`): a head without GPUs and two worker nodes,
each with one `fake_gpu` (a custom resource standing in for a GPU) and a `node<i>` marker.

- the AdaLN plan pool: one pool actor per node, and a node never reads another node's pool;
- Serve with the fake engine (one `fake_gpu` per replica): a second replica goes to the node with room,
  requests are routed to both nodes, and a node removed under load fails its in-flight requests fast (503
  naming the cause, or answered by the other replica) without hanging, while the service keeps answering on
  the remaining node.
"""

from __future__ import annotations

import dataclasses

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import ray
import requests
from ray.cluster_utils import Cluster

from actors.host_cache_pool import PoolClient, make_group_key
from deployments.schemas import AppConfig
from engine.api import GenerationRequest, GenerationResult
from tests.fake_engine import FakeEngine
from tests.serve_helpers import APP_NAME, free_port, own_cluster, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.ray(own_cluster=True)]  # slow: a three-node Ray cluster of its own with Serve

NUM_NODES = 2
#: A request that takes 20 x 0.1 s on the fake engine: long enough to be in flight when its node goes.
SLOW = {"prompt": "slow under load", "steps": 21, "seconds": 5.0, "width": 64, "height": 64, "return_video": False}


class NodeReportingEngine(FakeEngine):
    """The fake engine, telling in the result's model name which node served the request."""

    def generate(self, request: GenerationRequest, progress=None, cancelled=None) -> GenerationResult:
        result = super().generate(request, progress, cancelled)
        return dataclasses.replace(result, model=f"{result.model}@{ray.get_runtime_context().get_node_id()}")


@pytest.fixture(scope="module")
def cluster():
    own_cluster()  # several nodes with resources of their own: not the session's one-node cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1}})
    nodes = [cluster.add_node(num_cpus=2, resources={"fake_gpu": 1, f"node{i}": 1}) for i in range(NUM_NODES)]
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield cluster, nodes
    finally:
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


@ray.remote(num_cpus=0)
def pool_round_trip(publish: bool, key: tuple) -> tuple:
    """On this task's node: the node id, and whether this node's pool holds `key` (after publishing it first)."""
    client = PoolClient(1 << 20, detached=False, lookup_timeout_s=10.0)
    if publish:
        assert client.publish_arrays(make_group_key([key], "v1"), {key: np.arange(4, dtype=np.float32)})
    found = client.lookup_arrays([key], timeout_s=10.0)
    pool_node = ray.get(client.actor(0).__ray_call__.remote(lambda pool: ray.get_runtime_context().get_node_id()),
                        timeout=30)
    client.close()
    return client.node_id, pool_node, key in found


def test_each_node_has_its_own_pool_and_never_reads_another_nodes(cluster):
    key = (11,)
    on = [pool_round_trip.options(resources={f"node{i}": 0.01}) for i in range(NUM_NODES)]
    node0, pool0, found0 = ray.get(on[0].remote(True, key), timeout=60)
    node1, pool1, found1 = ray.get(on[1].remote(False, key), timeout=60)
    assert node0 != node1
    assert (pool0, pool1) == (node0, node1)  # each node's pool actor runs on that node
    assert found0 and not found1  # published on node 0: a hit there, a miss on node 1


def deploy(num_replicas: int, base_url: str) -> None:
    from ray import serve

    from deployments.app import build_application

    config = AppConfig.model_validate({
        "stages": "fused",  # the fake engine is the whole pipeline
        "worker": {"num_replicas": num_replicas, "num_cpus": 0.5, "resources": {"fake_gpu": 1},
                   "max_ongoing_requests": 4, "routing_stats_period_s": 0.5},
        # The HTTP layer lives on the head node, as on a real cluster's CPU node: the node removed below takes
        # a worker replica with it, never the ingress holding the requests.
        "http": {"request_timeout_s": 60.0, "resources": {"head": 0.5}},
        "engine": {"adaln": {"gpu_plans": 40}},
    })
    serve.run(build_application(config, NodeReportingEngine), name=APP_NAME, route_prefix="/")
    wait_healthy(base_url)


def post(base_url: str, body: dict, timeout_s: float = 60.0) -> requests.Response:
    return requests.post(f"{base_url}/v1/generations", json=body, timeout=timeout_s)


def served_node(response: requests.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["model"].rsplit("@", 1)[1]


def test_replicas_spread_over_nodes_and_a_removed_node_fails_fast(cluster):
    from ray import serve

    head_cluster, nodes = cluster
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"})
    base_url = f"http://127.0.0.1:{port}"

    # One replica, then a second: the new one can only go where a fake GPU is free, the other node.
    deploy(1, base_url)
    first = served_node(post(base_url, {**SLOW, "prompt": "one", "steps": 2}))
    deploy(2, base_url)
    bodies = [{**SLOW, "prompt": f"spread {i}", "steps": 2, "flow_shift": 1.0 + i} for i in range(12)]
    with ThreadPoolExecutor(6) as pool:
        used = {served_node(r) for r in pool.map(lambda b: post(base_url, b), bodies)}
    assert len(used) == NUM_NODES and first in used  # both nodes serve: routing crosses nodes

    # Under load, remove the node the second replica is on.
    victim = next(node for node in nodes if node.node_id != first)
    survivor = first
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post, base_url, {**SLOW, "flow_shift": 1.0 + i % 4}, 90.0) for i in range(8)]
        time.sleep(1.0)  # requests are in flight on both replicas
        head_cluster.remove_node(victim)
        # Each ends with an answer: one hanging on the lost node would raise the client's 90 s read timeout here.
        outcomes = [f.result(timeout=120) for f in futures]
    for response in outcomes:
        if response.status_code == 200:
            assert served_node(response) in (survivor, victim.node_id)
        else:
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["type"] == "unavailable" and "Error" in error["message"]  # names the cause's type

    # The service keeps answering, on the remaining node.
    deadline = time.monotonic() + 60
    while True:
        response = post(base_url, {**SLOW, "prompt": "after", "steps": 2})
        if response.status_code == 200:
            break
        assert response.status_code == 503 and time.monotonic() < deadline, response.text
        time.sleep(0.5)
    for i in range(4):
        assert served_node(post(base_url, {**SLOW, "prompt": f"after {i}", "steps": 2})) == survivor
    serve.delete(APP_NAME)
