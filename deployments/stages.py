"""The stage deployments of `stages: split`: `TextEncoder` (prompt -> embedding, with the prompt-embedding
cache) and `Decoder` (video + audio VAE decode, MP4 mux).

With them the `Worker` holds the denoiser alone (`engine.engine.EngineParts.DENOISER`) and is free for the next
request the moment its denoising loop ends; the ingress runs the pipeline over the three
(`deployments/generation.py`). Each holds one stage object of `engine.stages` and runs it on one
thread (one device, one call at a time; later calls queue). Errors are the engine's types (`ClientError` for a
prompt the encoder refuses), so callers sort them as they sort the worker's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray import serve

from deployments import IMPORT_STARTED_AT, PRELOADED
from deployments.errors import install_client_error_log_filter
from engine.api import GenerationRequest, Latents, Task
from engine.config import EngineConfig
from engine.errors import ClientError
from engine.stages import DecodedVideo, PromptEmbedding
from engine.startup import ReplicaStartup, process_started_at

#: This module's imports done (with `deployments.IMPORT_STARTED_AT`: the replica's module-import time).
IMPORTED_AT = time.time()

__all__ = ["Decoder", "TextEncoder"]

logger = logging.getLogger("ray.serve")


def replica_startup(role: str, constructor_at: float, build_started_at: float) -> ReplicaStartup:
    """A stage replica's timeline, its build ending now (a stage's build is all of its constructor's work). A
    module-level function, so it reads this process's import times (Serve pickles the deployment classes by value,
    with the driver's values of the globals they name)."""
    now = time.time()
    return ReplicaStartup(role=role, process_started_at=process_started_at(), import_started_at=IMPORT_STARTED_AT,
                          imported_at=IMPORTED_AT, constructor_at=constructor_at, build_started_at=build_started_at,
                          build_ended_at=now, ready_at=now, imports_s=build_started_at - constructor_at,
                          preloaded=PRELOADED)


def _check_task(request: GenerationRequest) -> None:
    """A split app serves t2va: the keyframes' and references' VAE encodes run beside a fused engine's denoiser."""
    if request.task is not Task.T2VA:
        raise ClientError("keyframes" if request.keyframes else "references",
                          f"{request.task.value} requests are served with stages: fused; this app runs stages: split",
                          "stages=fused")


@serve.deployment(name="TextEncoder", ray_actor_options={"num_cpus": 0.5})
class TextEncoder:
    """Qwen3-VL on its device (`engine.text_encoder.device`) and the LRU prompt-embedding cache."""

    def __init__(self, engine_config: dict[str, Any]) -> None:
        constructor_at = time.time()
        from engine.engine import prompt_stage  # loads the model: not at import time

        build_started_at = time.time()
        install_client_error_log_filter()
        self._stage = prompt_stage(EngineConfig.model_validate(engine_config))
        self._startup = replica_startup("text_encoder", constructor_at, build_started_at)
        logger.info("%s", self._startup.summary())
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="text-encoder")

    async def validate(self, request: GenerationRequest) -> int:
        """The prompt's tokens; ClientError (message `prompt: ...`) when the encoder cannot take it. Cheap."""
        _check_task(request)
        return await asyncio.to_thread(self._stage.check, request.prompt)

    async def describe(self) -> dict[str, Any]:
        """This replica's start-up timings."""
        return {"startup": self._startup.as_dict()}

    async def encode(self, request: GenerationRequest) -> PromptEmbedding:
        """`request`'s prompt embedding on the CPU (ClientError for a prompt the encoder refuses, or a request
        with keyframes or references: their vision and VAE encodes run in a fused engine)."""
        _check_task(request)
        loop = asyncio.get_running_loop()
        embedding = await loop.run_in_executor(self._executor, self._stage.encode, request.prompt)
        return embedding.cpu()

    async def check_health(self) -> None:
        pass


@serve.deployment(name="Decoder", ray_actor_options={"num_cpus": 0.5})
class Decoder:
    """The video and audio VAEs on their device (`engine.decode.device`) and the MP4 mux."""

    def __init__(self, engine_config: dict[str, Any]) -> None:
        constructor_at = time.time()
        from engine.engine import decode_stage  # loads the VAEs: not at import time

        build_started_at = time.time()
        self._stage = decode_stage(EngineConfig.model_validate(engine_config))
        self._startup = replica_startup("decoder", constructor_at, build_started_at)
        logger.info("%s", self._startup.summary())
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decoder")

    async def decode(self, latents: Latents) -> DecodedVideo:
        """Latents -> the MP4, its thumbnail and the clip's facts (the pipeline's decode step of a split app)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._stage.decode, latents.video, latents.audio)

    async def describe(self) -> dict[str, Any]:
        """This replica's start-up timings."""
        return {"startup": self._startup.as_dict()}

    async def check_health(self) -> None:
        pass
