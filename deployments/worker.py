"""The worker deployment: a thin Serve shim over a plain engine (one replica per GPU, or on CPU).

All model work happens in `actors.gpu_worker.GpuWorker` (or whatever `engine_factory` builds, e.g. a
fake in tests). Generations run on one dedicated thread, so they are serialized per replica and the
replica's event loop stays free for health checks, `describe` and cancellations.

Routing: callers pass `schedule_key=` (the request's sampling schedule); with `ScheduleAffinityRouter`
(set by `build_app`) requests of one schedule go to the replica whose AdaLN plans are warm, and this
replica reports its ongoing count and recent schedules through `record_routing_stats()`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ray import serve

from actors.api import Engine, GenerationRequest, GenerationResult
from actors.config import EngineConfig
from deployments.router import ScheduleAffinityReporter

logger = logging.getLogger("ray.serve")

EngineFactory = Callable[[EngineConfig], Engine]


def default_engine_factory(config: EngineConfig) -> Engine:
    # Imported here so the Serve layer can be imported (and tested with a fake) without loading the model.
    from actors.gpu_worker import GpuWorker

    return GpuWorker(config)


@serve.deployment(name="Worker", ray_actor_options={"num_cpus": 1})
class Worker(ScheduleAffinityReporter):
    """Serve replica holding one engine. `build_app` sets `num_gpus` (1 on a GPU cluster, else 0)."""

    def __init__(self, engine_config: dict[str, Any], engine_factory: EngineFactory | None = None) -> None:
        config = EngineConfig.model_validate(engine_config)
        self._engine = (engine_factory or default_engine_factory)(config)
        # One thread: the engine owns one device and runs one generation at a time; later requests queue here.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def generate(self, request: GenerationRequest, schedule_key: str | None = None) -> GenerationResult:
        """Run one generation off the event loop. Raises ValueError for requests the model cannot take.
        `schedule_key` is read by the router (and recorded here as recently served)."""
        cancelled = threading.Event()
        loop = asyncio.get_running_loop()
        with self.track_schedule(schedule_key):
            future = loop.run_in_executor(self._executor, self._engine.generate, request, None, cancelled.is_set)
            try:
                # shield: a cancelled caller must not cancel the executor future (the thread runs on regardless);
                # the engine sees `cancelled` between steps and stops.
                return await asyncio.shield(future)
            except asyncio.CancelledError:
                cancelled.set()
                logger.info("generation cancelled by the caller; the engine stops after the current step")
                raise

    async def health(self) -> dict[str, Any]:
        return self._engine.health()

    async def describe(self) -> dict[str, Any]:
        return self._engine.describe()

    async def check_health(self) -> None:
        """Serve's periodic replica health check: an engine that raises here gets its replica restarted."""
        self._engine.health()
