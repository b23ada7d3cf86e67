"""A multi-device replica through Ray Serve on CPU: `engine.parallel.sp: 2` in serve_config.yaml's args makes the
Worker replica a coordinator of two gloo rank actors in its own placement group, and HTTP answers carry the same
latents as the one-device engine of the same config and checkpoint (built in this process: a served one-device
replica answers with that engine's bits, tests/test_http.py, so a second app would only cost a start).
"""

from __future__ import annotations

import pytest
import requests
import torch

from deployments.schemas import decode_latents
from engine.api import GenerationRequest
from engine.config import EngineConfig
from engine.engine import Engine
from tests.serve_helpers import run_app, serve_cluster, serve_config_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.ray]  # slow: Ray + Serve: an SP2 replica

BODY = {"prompt": "two ranks", "steps": 4, "seconds": 5.0, "width": 64, "height": 64, "seed": 11,
        "return_video": True, "return_latents": True}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """(the app's base URL, its args)."""
    # coordinator (1 CPU) + 2 ranks (1 CPU each), 1 per stage and the ingress
    with serve_cluster(num_cpus=8) as base_url:
        args = serve_config_args(tmp_path_factory.mktemp("checkpoints"))
        args["worker"] = {**args["worker"], "num_replicas": 1}
        args["worker"].pop("autoscaling", None)
        args["engine"]["pool"] = {**args["engine"]["pool"], "enabled": False}
        # text_encoder_tp off: the one-device embedding bits, so the latents can be compared exactly (the tensor
        # parallel encoder rounds differently: tests/test_parallel_text_encoder.py)
        args["engine"]["parallel"] = {**args["engine"]["parallel"], "sp": 2, "text_encoder_tp": False}
        run_app(base_url, args, name="sp2", route_prefix="/sp2")
        yield base_url, args


@pytest.fixture(scope="module")
def one_device_engine(app) -> Engine:
    """The app's engine config at sp 1 in this process (the replica made the checkpoint on first start)."""
    _, args = app
    parallel = {**args["engine"]["parallel"], "sp": 1}
    return Engine(EngineConfig.model_validate({**args["engine"], "parallel": parallel, "device": "cpu"}))


def post(base_url: str, prefix: str, body: dict) -> requests.Response:
    return requests.post(f"{base_url}{prefix}/v1/generations", json=body, timeout=300)


def test_sp2_replica_answers_with_the_one_device_latents_and_an_mp4(app, one_device_engine):
    base_url, _ = app
    two = post(base_url, "/sp2", BODY)
    assert two.status_code == 200, two.text
    one = one_device_engine.generate(GenerationRequest(**BODY))
    latents = decode_latents(two.json()["latents"])
    assert torch.equal(latents["video"], one.video) and torch.equal(latents["audio"], one.audio)
    assert two.json()["model"] == one.model
    assert two.json()["video_mp4"] and two.json()["stats"]["parallel"]["ranks_agree"] is True


def test_sp2_replica_refuses_bad_input_and_keeps_serving(app):
    base_url, _ = app
    bad = post(base_url, "/sp2", {**BODY, "width": 65})
    assert bad.status_code == 422 and "width" in bad.json()["error"]["message"]
    assert post(base_url, "/sp2", {**BODY, "return_video": False}).status_code == 200
