"""The models one ingress serves: one per MiniMax-H3 partition the app lists (`AppConfig.partitions`).

Each partition is a Worker (denoiser) deployment of its own, with its own AdaLN plan cache and router, and a
`GenerationRunner` over it (split: sharing the app's TextEncoder and Decoder; fused: the worker alone). The
ingress describes each worker once (its model card: name, tasks, limits) and picks the partition of a request by
its task and its `model` field (`jobs.model_choice.choose_model`, which the video jobs use too), so
`/v1/generations` and `/v1/videos` send a request to the same model. The first partition is the app's default
(`Worker`): an admin weight update is validated on it, then every Worker of the app (both partitions') applies the
fleet target, each loading its own partition's transformer from the path (a released root holds both; a path
holding one partition leaves the other's Workers on their weights, reported as failed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ray.serve.handle import DeploymentHandle

from deployments.errors import invalid_field
from deployments.generation import GenerationRunner
from engine.api import GenerationRequest
from engine.limits import ModelLimits
from jobs.errors import InvalidVideoRequest
from jobs.model_choice import choose_model

__all__ = ["PartitionName", "ServedPartition", "ServedModels", "task_field", "worker_deployment_name"]

#: A MiniMax-H3 partition as the config names it (`engine.partition`, `AppConfig.partitions`).
PartitionName = Literal["fl2va", "ref2va"]


def worker_deployment_name(index: int, partition: PartitionName) -> str:
    """The Worker deployment of the app's `index`-th partition: `Worker` for the first (the default model, the name
    single-partition apps always had), `Worker-<partition>` for the others."""
    return "Worker" if index == 0 else f"Worker-{partition}"


def task_field(request: GenerationRequest) -> str:
    """The field that made `request` its task: what a refusal of the task names."""
    return "keyframes" if request.keyframes else "references" if request.references else "prompt"


@dataclass(frozen=True)
class ServedPartition:
    """One partition behind the ingress: its Worker deployment and how a generation runs on it."""

    partition: PartitionName
    worker: DeploymentHandle
    runner: GenerationRunner


class ServedModels:
    """The app's partitions and their model cards, each asked of its worker once per ingress replica."""

    def __init__(self, partitions: Sequence[ServedPartition], describe_timeout_s: float) -> None:
        if not partitions:
            raise ValueError("an app serves at least one partition")
        self.partitions = tuple(partitions)
        self._describe_timeout_s = describe_timeout_s
        self._cards: dict[int, dict[str, Any]] = {}
        self._limits: dict[int, ModelLimits] = {}

    @property
    def default(self) -> ServedPartition:
        return self.partitions[0]

    async def card(self, index: int) -> dict[str, Any]:
        """The `index`-th partition's worker `describe()` (asked once; a failure is asked again next time)."""
        if index not in self._cards:
            worker = self.partitions[index].worker
            self._cards[index] = await asyncio.wait_for(worker.describe.remote(), timeout=self._describe_timeout_s)
        return self._cards[index]

    async def cards(self) -> list[dict[str, Any]]:
        return [await self.card(index) for index in range(len(self.partitions))]

    async def limits(self, index: int) -> ModelLimits:
        """The `index`-th partition's served limits, parsed once."""
        if index not in self._limits:
            self._limits[index] = ModelLimits.model_validate((await self.card(index))["limits"])
        return self._limits[index]

    async def choose(self, request: GenerationRequest) -> int:
        """The index of the partition that serves `request` (its task; its `model` when given); RequestError 422
        naming the field when none does. One partition and no `model`: it, without asking its worker (its engine
        refuses what it does not serve, naming its tasks)."""
        if len(self.partitions) == 1 and request.model is None:
            return 0
        models = [await self.limits(index) for index in range(len(self.partitions))]
        try:
            chosen = choose_model(models, request.task.value, request.model, task_field(request))
        except InvalidVideoRequest as exc:
            raise invalid_field(exc.field, str(exc)) from None
        return models.index(chosen)
