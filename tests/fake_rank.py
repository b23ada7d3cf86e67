"""A stand-in for `actors.gpu_worker.GpuWorkerActor` in weight-update tests (tests/test_parallel_weights.py): its
own module, so that a rank actor's process imports this and `engine.config` (for the `start` argument), not the
test module's diffusers and transformers graph (~4 core-seconds per rank process)."""

from __future__ import annotations

from engine.config import EngineConfig

VALIDATED = "f00dfeedf00dfeed"  # what every rank's validation reads
CHANGED = "0badc0de0badc0de"  # what a rank reads when the directory changed after the validation


class FakeRank:
    """Stands in for `GpuWorkerActor` (same constructor and the calls a weight update makes): reports the
    fingerprint it ends on after `update_weights`: `set_ends_on`'s (the test's scenario)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.fingerprint = "0000000000000000"
        self.ends_on = VALIDATED

    def rendezvous_address(self) -> str:
        return "tcp://127.0.0.1:1"

    def start(self, init_method: str, config: EngineConfig) -> str:
        return f"minimax-h3@{self.fingerprint}"

    def set_ends_on(self, fingerprint: str) -> None:
        self.ends_on = fingerprint

    def describe(self) -> dict:
        return {"id": f"minimax-h3@{self.fingerprint}", "fingerprint": self.fingerprint}

    def startup(self) -> None:
        return None

    def validate_weight_update(self, path: str) -> str:
        return VALIDATED

    def update_weights(self, path: str) -> dict:
        self.fingerprint = self.ends_on
        return self.describe()

    def health(self) -> dict:
        return {"status": "ok"}
