"""`stages: split` without a cluster: how the three stages share a device (Ray resource fractions) and which
errors of a stage call count as a lost worker for the job service's retry rule. Through Serve, split == fused:
tests/test_split_fused_serve.py.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("gpus_in_cluster, worker, stage, worker_max", [
    (0, 0.0, 0.0, 1),   # CPU: no GPU asked, one replica each
    (1, 0.6, 0.2, 1),   # one H200: the three stages share it, one worker
    (8, 0.6, 0.2, 8),   # a node: one worker per device (0.6 keeps a second one off), stages beside them
])
def test_split_stages_share_each_device_by_fractions(gpus_in_cluster, worker, stage, worker_max):
    from deployments.app import stage_deployment_options, worker_deployment_options
    from deployments.schemas import AppConfig

    config = AppConfig()
    worker_options = worker_deployment_options(config.worker, gpus_in_cluster, config.engine, split=True)
    stage_options = stage_deployment_options(config.text_encoder, gpus_in_cluster)
    assert worker_options["ray_actor_options"]["num_gpus"] == worker
    assert stage_options["ray_actor_options"]["num_gpus"] == stage
    assert worker + 2 * stage <= 1.0  # the default config fits one device
    assert worker_options["autoscaling_config"]["max_replicas"] == worker_max
    assert stage_options["autoscaling_config"]["max_replicas"] == max(1, gpus_in_cluster)


@pytest.mark.parametrize("make_error", [
    lambda: __import__("ray.exceptions", fromlist=["ActorDiedError"]).ActorDiedError(),
    lambda: __import__("ray.exceptions", fromlist=["ActorUnavailableError"]).ActorUnavailableError("gone", None),
    # a multi-GPU replica that lost a rank fails its running and queued jobs this way while Serve replaces it
    lambda: __import__("engine.errors", fromlist=["ServerFault"]).ServerFault(
        "parallel replica unusable: generate: rank 1 of 2 died",
        __import__("engine.errors", fromlist=["FaultCause"]).FaultCause.RANK_FAILURE),
])
def test_a_replica_that_died_is_a_lost_worker_for_the_retry_rule(make_error):
    from deployments.video_backend import backend_error
    from jobs.backend import VideoWorkerLost

    assert isinstance(backend_error(make_error(), cancel_asked=False), VideoWorkerLost)
