"""A multi-device replica through Ray Serve on CPU: `engine.parallel.sp: 2` in serve_config.yaml's args makes the
Worker replica a coordinator of two gloo rank actors in its own placement group, and HTTP answers carry the same
latents as a one-device replica of the same checkpoint.
"""

from __future__ import annotations

import copy

import pytest
import requests
import torch

from deployments.schemas import decode_latents
from tests.serve_helpers import run_app, serve_cluster, serve_config_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # slow: Ray + Serve: an SP2 replica

BODY = {"prompt": "two ranks", "steps": 4, "seconds": 5.0, "width": 64, "height": 64, "seed": 11,
        "return_video": True, "return_latents": True}


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    # coordinator (1 CPU) + 2 ranks (1 CPU each) for sp=2, 1 for the sp=1 replica, 1 per ingress
    with serve_cluster(num_cpus=8) as base_url:
        args = serve_config_args(tmp_path_factory.mktemp("checkpoints"))
        args["worker"] = {**args["worker"], "num_replicas": 1}
        args["worker"].pop("autoscaling", None)
        args["engine"]["pool"] = {**args["engine"]["pool"], "enabled": False}
        one = copy.deepcopy(args)
        two = copy.deepcopy(args)
        # text_encoder_tp off: the one-device embedding bits, so the latents can be compared exactly (the tensor
        # parallel encoder rounds differently: tests/test_parallel_text_encoder.py)
        two["engine"]["parallel"] = {**two["engine"]["parallel"], "sp": 2, "text_encoder_tp": False}
        run_app(base_url, one, name="sp1", route_prefix="/sp1")
        run_app(base_url, two, name="sp2", route_prefix="/sp2")
        yield base_url


def post(base_url: str, prefix: str, body: dict) -> requests.Response:
    return requests.post(f"{base_url}{prefix}/v1/generations", json=body, timeout=300)


def test_sp2_replica_answers_with_the_one_device_latents_and_an_mp4(apps):
    one, two = post(apps, "/sp1", BODY), post(apps, "/sp2", BODY)
    assert one.status_code == 200, one.text
    assert two.status_code == 200, two.text
    a, b = decode_latents(one.json()["latents"]), decode_latents(two.json()["latents"])
    assert torch.equal(a["video"], b["video"]) and torch.equal(a["audio"], b["audio"])
    assert two.json()["video_mp4"] and two.json()["stats"]["parallel"]["ranks_agree"] is True


def test_sp2_replica_refuses_bad_input_and_keeps_serving(apps):
    bad = post(apps, "/sp2", {**BODY, "width": 65})
    assert bad.status_code == 422 and "width" in bad.json()["error"]["message"]
    assert post(apps, "/sp2", {**BODY, "return_video": False}).status_code == 200
