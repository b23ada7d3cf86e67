"""A multi-device replica's weight update (`actors.gpu_worker.ParallelEngine.update_weights`) when its ranks do not
end on the same weights: the coordinator over fake rank actors (a local Ray cluster, no engine, no torch work).

Every rank re-reads the directory when it applies it (the disk may change after the one validation), so rank 1 can
end on other bytes than rank 0 without raising. The replica must then report unhealthy (Serve replaces it) rather
than serve with ranks on different weights.
"""

from __future__ import annotations

import pytest
import ray

import actors.gpu_worker as gpu_worker
from actors.gpu_worker import OwnPlacementGroup, ParallelEngine
from engine.config import EngineConfig
from engine.errors import ServerFault
from tests.fake_rank import CHANGED, VALIDATED, FakeRank
from tests.serve_helpers import shared_ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.ray]  # slow: Ray: weight updates over SP2 ranks


@pytest.fixture(scope="module")
def ray_cluster():
    with shared_ray():  # the session's cluster (tests/serve_helpers.py), emptied after the module
        yield


@pytest.mark.parametrize("rank1_ends_on, healthy", [(VALIDATED, True), (CHANGED, False)])
def test_ranks_that_end_on_different_weights_leave_the_replica_unhealthy(ray_cluster, monkeypatch, rank1_ends_on,
                                                                         healthy):
    monkeypatch.setattr(gpu_worker, "GpuWorkerActor", FakeRank)
    config = EngineConfig(device="cpu", pool={"enabled": False}, parallel={"sp": 2, "timeout_s": 20.0})
    engine = ParallelEngine(config, OwnPlacementGroup(), num_gpus_per_rank=0)
    try:
        ray.get(engine.ranks[1].set_ends_on.remote(rank1_ends_on), timeout=30)
        if healthy:
            assert engine.update_weights("/checkpoints/new")["fingerprint"] == VALIDATED
            assert engine.health()["status"] == "ok"
        else:
            with pytest.raises(ServerFault, match=f"{VALIDATED}.*{CHANGED}"):
                engine.update_weights("/checkpoints/new")
            with pytest.raises(ServerFault, match="unusable"):
                engine.health()
    finally:
        engine.close()
