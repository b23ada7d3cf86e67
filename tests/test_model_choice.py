"""The task picks the model (`jobs.model_choice`), as both APIs ask it: an app serving both MiniMax-H3 partitions
sends t2va and fl2va to `minimax-h3` (FL2VA) and ref2va to `minimax-h3-ref2va`; a `model` field must name a served
model that serves the task; a task nothing serves is a 422 naming the served tasks. And the ingress's side of it
(`deployments.partitions.ServedModels`): the partition chosen for a `GenerationRequest`, its refusals as 422s."""

from __future__ import annotations

import asyncio

import pytest

from deployments.errors import RequestError
from deployments.partitions import ServedModels, ServedPartition, task_field, worker_deployment_name
from engine.api import GenerationRequest, KeyframeInput, ReferenceInput
from engine.limits import ModelLimits
from jobs.errors import InvalidVideoRequest
from jobs.model_choice import choose_model, served_tasks

BASE = dict(min_seconds=1, max_seconds=3, default_seconds=1, size_multiple=16, min_edge=32, max_edge=128,
            max_pixels=128 * 64, default_size="64x32", default_short_edge=32, max_steps=8, default_steps=4)
FL2VA = ModelLimits(name="minimax-h3", tasks=("t2va", "fl2va"), **BASE)
REF2VA = ModelLimits(name="minimax-h3-ref2va", tasks=("ref2va",), **BASE)
BOTH = [FL2VA, REF2VA]


@pytest.mark.parametrize("models", [BOTH, BOTH[::-1]], ids=["fl2va-first", "ref2va-first"])
@pytest.mark.parametrize("task, expected", [("t2va", FL2VA), ("fl2va", FL2VA), ("ref2va", REF2VA)])
def test_the_task_picks_the_model_whatever_the_order(models, task, expected):
    assert choose_model(models, task, None) is expected
    assert choose_model(models, task, expected.name) is expected  # naming it is the same


@pytest.mark.parametrize("models, task, requested, field, message", [
    (BOTH, "t2va", "sora-2", "model", "'sora-2' is not served here; served: ['minimax-h3', 'minimax-h3-ref2va']"),
    (BOTH, "ref2va", "minimax-h3", "model",
     "minimax-h3 serves t2va, fl2va, not ref2va; ref2va is served by minimax-h3-ref2va"),
    (BOTH, "t2va", "minimax-h3-ref2va", "model", "minimax-h3-ref2va serves ref2va, not t2va; t2va is served by "
     "minimax-h3"),
    ([REF2VA], "t2va", "sora-2", "model", "'sora-2' is not served here; served: ['minimax-h3-ref2va']"),
    ([FL2VA, FL2VA.model_copy(update={"name": "other"})], "ref2va", None, "image_reference",
     "ref2va is not served here: the served tasks are t2va, fl2va (minimax-h3 serves t2va, fl2va; other serves "
     "t2va, fl2va)"),
])
def test_refusals_are_422s_naming_the_field_and_what_is_served(models, task, requested, field, message):
    with pytest.raises(InvalidVideoRequest) as error:
        choose_model(models, task, requested, task_field="image_reference")
    assert error.value.field == field and str(error.value) == f"{field}: {message}"


@pytest.mark.parametrize("task, requested", [("ref2va", None), ("ref2va", "minimax-h3")])
def test_one_served_model_takes_every_request_its_own_checks_refuse(task, requested):
    # jobs.limits.resolve_spec (and the engine) then name what it serves, as before apps served two partitions.
    assert choose_model([FL2VA], task, requested) is FL2VA


def test_served_tasks_lists_each_task_once_in_order():
    assert served_tasks(BOTH) == ("t2va", "fl2va", "ref2va")
    assert served_tasks([REF2VA, FL2VA, FL2VA]) == ("ref2va", "t2va", "fl2va")


def test_the_first_partition_is_the_worker_deployment():
    assert [worker_deployment_name(i, p) for i, p in enumerate(["fl2va", "ref2va"])] == ["Worker", "Worker-ref2va"]
    assert worker_deployment_name(0, "ref2va") == "Worker"  # an app of the Ref2VA partition alone


# --- The ingress's choice over its workers ----------------------------------------------------------------------

class Remote:
    def __init__(self, value, calls: list) -> None:
        self.value, self.calls = value, calls

    def remote(self):
        self.calls.append(self.value["limits"]["name"])
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.value)
        return future


class FakeWorker:
    """What `ServedModels` asks of a Worker handle: `describe.remote()`."""

    def __init__(self, limits: ModelLimits, calls: list) -> None:
        self.describe = Remote({"id": f"{limits.name}@0", "limits": limits.model_dump(mode="json")}, calls)


def served(calls: list) -> ServedModels:
    return ServedModels([ServedPartition("fl2va", FakeWorker(FL2VA, calls), runner=f"runner-{FL2VA.name}"),
                         ServedPartition("ref2va", FakeWorker(REF2VA, calls), runner=f"runner-{REF2VA.name}")],
                        describe_timeout_s=5.0)


KEYFRAME = KeyframeInput(image=b"png", anchor="first")
IMAGE = ReferenceInput(kind="image", data=b"png")


@pytest.mark.parametrize("fields, partition", [
    ({}, "fl2va"), ({"keyframes": (KEYFRAME,)}, "fl2va"), ({"references": (IMAGE,)}, "ref2va"),
    ({"references": (IMAGE,), "model": "minimax-h3-ref2va"}, "ref2va"),
])
def test_a_generation_goes_to_the_partition_of_its_task(fields, partition):
    calls: list = []
    models = served(calls)

    async def choose_twice():
        first = await models.choose(GenerationRequest(prompt="a fox", **fields))
        again = await models.choose(GenerationRequest(prompt="a fox", **fields))
        return first, again

    first, again = asyncio.run(choose_twice())
    assert models.partitions[first].partition == models.partitions[again].partition == partition
    assert sorted(calls) == ["minimax-h3", "minimax-h3-ref2va"]  # each worker described once


def test_one_partition_takes_a_request_without_a_model_unasked():
    calls: list = []
    one = ServedModels([ServedPartition("fl2va", FakeWorker(FL2VA, calls), runner="runner")], describe_timeout_s=5.0)
    assert asyncio.run(one.choose(GenerationRequest(prompt="a fox", references=(IMAGE,)))) == 0
    assert calls == []  # its engine refuses what it does not serve


@pytest.mark.parametrize("fields, field, message", [
    ({"model": "sora-2"}, "model", "'sora-2' is not served here"),
    ({"keyframes": (KEYFRAME,), "model": "minimax-h3-ref2va"}, "model", "minimax-h3-ref2va serves ref2va, not fl2va"),
])
def test_a_generation_no_partition_serves_is_a_422_naming_the_field(fields, field, message):
    request = GenerationRequest(prompt="a fox", **fields)
    with pytest.raises(RequestError) as error:
        asyncio.run(served([]).choose(request))
    assert error.value.status == 422 and error.value.errors[0].loc == [field] and message in error.value.message
    assert task_field(request) == ("keyframes" if request.keyframes else "prompt")
