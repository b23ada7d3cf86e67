"""Ray's worker preload (README, "Deploying on a cluster"): with `RAY_preload_python_modules` naming our package
when Ray starts, a replica's process has imported our code before the replica is asked for, and knows it
(`deployments.PRELOADED`, reported as `ReplicaStartup.preloaded`). One local Ray, started with the variable."""

from __future__ import annotations

import os
import time

import pytest

from tests.serve_helpers import own_cluster

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.ray(own_cluster=True)]  # a Ray cluster of its own (RAY_preload_python_modules)


@pytest.fixture(scope="module")
def preloading_ray():
    # The raylet reads the variable when it starts and passes it to every worker process it starts.
    previous = os.environ.get("RAY_preload_python_modules")
    os.environ["RAY_preload_python_modules"] = "deployments"
    own_cluster()  # the variable must reach a raylet of its own: the session's one was started without it
    try:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    finally:
        if previous is None:
            del os.environ["RAY_preload_python_modules"]
        else:
            os.environ["RAY_preload_python_modules"] = previous
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Probe:
    def __init__(self) -> None:
        import sys

        self.already_imported = "deployments" in sys.modules  # before this actor imported anything of ours
        self.constructed_at = time.time()

    def report(self) -> tuple[bool, bool, float, float]:
        import deployments

        return self.already_imported, deployments.PRELOADED, deployments.IMPORT_STARTED_AT, self.constructed_at


def test_a_preloaded_worker_imported_our_code_before_the_actor_and_says_so(preloading_ray):
    asked_at = time.time()
    already_imported, preloaded, import_started_at, constructed_at = ray.get(Probe.remote().report.remote())
    assert already_imported and preloaded
    assert import_started_at < constructed_at and asked_at < constructed_at


def test_the_driver_did_not_preload():
    import deployments

    assert not deployments.PRELOADED


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA: what Ray does to a GPU replica")
def test_importing_the_worker_module_leaves_cuda_to_the_replica():
    """A preloaded process imports our code before Ray sets its CUDA_VISIBLE_DEVICES: the import must not
    initialize CUDA (diffusers' import asks torch.cuda.is_available()), or the replica would not get its device."""
    import subprocess
    import sys

    code = ("import os, deployments.worker, torch\n"
            "os.environ['CUDA_VISIBLE_DEVICES'] = '0'\n"  # what Ray sets when it places a 1-GPU replica
            "print(torch._C._cuda_getDeviceCount())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "PYTORCH_NVML_BASED_CUDA_CHECK")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) == 1
