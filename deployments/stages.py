"""The stage deployments of `stages: split`: `TextEncoder` (the prepare side: prompt -> embedding, with the
prompt-embedding cache; for fl2va / ref2va also Qwen3-VL's vision tower and the VAE encodes of the keyframes and
references, whose latents travel to the Worker in the embedding: `engine.prepare`) and `Decoder` (video + audio VAE
decode, MP4 mux). One of each serves every partition of the app (they share the text encoder and the VAEs).

With them the `Worker` holds the denoiser alone (`engine.engine.DenoiserEngine`) and is free for the next
request the moment its denoising loop ends; the ingress runs the pipeline over the three
(`deployments/generation.py`). Each holds one stage object of `engine.stages` and runs it on one
thread (one device, one call at a time; later calls queue). Errors are the engine's types (`ClientError` for a
prompt the encoder refuses), so callers sort them as they sort the worker's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray import serve

from deployments import IMPORT_STARTED_AT, PRELOADED
from deployments.errors import install_client_error_log_filter
from engine.api import GenerationRequest, Latents
from engine.config import EngineConfig
from engine.stage_data import DecodedVideo, PromptEmbedding
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


@serve.deployment(name="TextEncoder", ray_actor_options={"num_cpus": 0.5})
class TextEncoder:
    """Qwen3-VL on its device (`engine.text_encoder.device`), the LRU prompt-embedding cache and, when the app
    serves keyframes or references, the vision tower and the VAEs' encoder halves."""

    def __init__(self, engine_config: dict[str, Any], partitions: list[str] | None = None) -> None:
        """`partitions`: every partition the app serves (default: engine.partition): their tasks are prepared."""
        constructor_at = time.time()
        from engine.prepare import prepare_stage  # loads the models: not at import time

        build_started_at = time.time()
        install_client_error_log_filter()
        self._stage = prepare_stage(EngineConfig.model_validate(engine_config), partitions)
        self._startup = replica_startup("text_encoder", constructor_at, build_started_at)
        logger.info("%s; text encoder: %s", self._startup.summary(), self._stage.prompt.weights.summary())
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="text-encoder")

    async def validate(self, request: GenerationRequest) -> int:
        """The prompt's tokens; ClientError naming the field when the encoder cannot take the prompt, or a keyframe
        or reference is bad (decoded and checked, not encoded). Cheap."""
        return await asyncio.to_thread(self._stage.check, request)

    async def describe(self) -> dict[str, Any]:
        """This replica's start-up timings and the encoder's weights (its tier and memory)."""
        return {"startup": self._startup.as_dict(), "text_encoder": dataclasses.asdict(self._stage.prompt.weights)}

    async def encode(self, request: GenerationRequest) -> PromptEmbedding:
        """`request`'s prompt embedding on the CPU, for fl2va / ref2va with its `Conditions` (the canvas and the
        VAE condition latents); ClientError naming the field for what the encoders refuse."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._stage.encode, request)

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
