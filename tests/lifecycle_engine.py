"""A fake engine that records what each request did on the engine thread and fails on cue (lifecycle tests).

Requests are told apart by their seed. Per seed it records the forwards run (`steps`) and how the request
ended (`ends`: ok, cancelled, or the error's type); `held_plan_refs` counts requests inside the denoising
loop, as the real engine's plan references (0 when idle). The prompt picks the behaviour: "slow ..." sleeps
0.1 s per forward; "fault ...", "boom ..." and "refuse ..." raise a ServerFault, a RuntimeError and a
ClientError after the second forward (mid-run, after validation). Importable by Ray workers.
"""

from __future__ import annotations

import threading
from typing import Any

from engine.api import GenerationRequest, GenerationResult
from engine.errors import ClientError, FaultCause, GenerationCancelled, ServerFault
from tests.fake_engine import FakeEngine

#: After this many forwards a "fault" / "boom" / "refuse" prompt raises.
FAIL_AFTER_FORWARDS = 2


def mid_run_failure(prompt: str) -> Exception | None:
    if prompt.startswith("fault"):
        return ServerFault("shard /secret/path/model-00002.safetensors is truncated", FaultCause.CHECKPOINT_UNREADABLE)
    if prompt.startswith("boom"):
        return RuntimeError("an unexpected bug at /secret/path/engine.py")
    if prompt.startswith("refuse"):
        return ClientError("prompt", "refuse: this request cannot be served past its second forward")
    return None


class LifecycleEngine(FakeEngine):
    def __init__(self, config) -> None:
        super().__init__(config)
        self._lock = threading.Lock()
        self.held_plan_refs = 0
        self.steps: dict[int, int] = {}
        self.ends: dict[int, str] = {}

    def generate(self, request: GenerationRequest, progress=None, cancelled=None) -> GenerationResult:
        seed = request.seed
        failure = mid_run_failure(request.prompt)

        def step(i: int, n: int) -> None:
            with self._lock:
                self.steps[seed] = i
            if failure is not None and i == FAIL_AFTER_FORWARDS:
                raise failure
            if progress is not None:
                progress(i, n)

        with self._lock:
            self.held_plan_refs += 1
            self.steps.setdefault(seed, 0)
        end = "error"
        try:
            result = super().generate(request, step, cancelled)
            end = "ok"
            return result
        except GenerationCancelled:
            end = "cancelled"
            raise
        except Exception as exc:
            end = type(exc).__name__
            raise
        finally:
            with self._lock:
                self.held_plan_refs -= 1
                self.ends[seed] = end

    def debug_stats(self) -> dict[str, Any]:
        with self._lock:
            return {**super().debug_stats(), "held_plan_refs": self.held_plan_refs, "steps": dict(self.steps),
                    "ends": dict(self.ends)}
