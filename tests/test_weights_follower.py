"""The fleet weight update's bookkeeping without a cluster: the replica side (`WeightFollower`) and the admin
route (`WeightAdmin`) against a `WeightCoordinator` called in process (its methods stand in for the actor's).

Races the end-to-end tests cannot pin down: a replica that starts while an update is being set (it must
come up on the target, not serve the old weights after the route answered), two updates racing (the first
must not be reported as applied when the fleet ended on the second), and the threaded coordinator actor taking
a heartbeat while it answers a poll.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from deployments import admin as admin_module
from deployments import weights as weights_module
from deployments.admin import WeightAdmin
from deployments.schemas import AdminOptions
from deployments.weights import WeightCoordinator, WeightFollower

pytestmark = pytest.mark.timeout(60)


class Done:
    """An object ref that is already resolved: `ray.get` (patched to `resolve`) gives its value back."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        return self.value


def resolve(ref: Done, timeout: float | None = None) -> Any:
    return ref.value


class InProcessActor:
    """`actor.method.remote(...)` on a plain object: runs the method now, returns a resolved `Done`."""

    def __init__(self, target: Any, before: dict[str, Any] | None = None) -> None:
        self._target = target
        self._before = before or {}  # method name -> callable run first (what happens meanwhile elsewhere)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._target, name)
        before = self._before.get(name)

        class Remote:
            @staticmethod
            def remote(*args: Any) -> Done:
                if before is not None:
                    before()
                return Done(method(*args))

        return Remote


class Model:
    """The replica's served weights: what `apply` loaded last."""

    def __init__(self) -> None:
        self.path = "configured"
        self.applied: list[str] = []

    def apply(self, path: str) -> dict[str, Any]:
        self.path = path
        self.applied.append(path)
        return {}

    def describe(self) -> dict[str, Any]:
        return {"model": f"h3@{self.path}"}


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setattr(weights_module.ray, "get", resolve)
    monkeypatch.setattr(weights_module, "HEARTBEAT_S", 3600.0)  # no background beat during the test


def test_a_replica_starting_while_an_update_is_set_comes_up_on_the_target(no_ray):
    coordinator = WeightCoordinator()
    model = Model()
    # The update's set_target lands between the replica's read of the target (v0) and its first heartbeat.
    actor = InProcessActor(coordinator, before={"heartbeat": lambda: coordinator.target()[0] or
                                                coordinator.set_target("/w/new")})
    with concurrent.futures.ThreadPoolExecutor(1) as engine_thread:
        follower = WeightFollower("app", "r1", engine_thread, model.apply, model.describe)
        follower._coordinator = actor
        follower.start()
        follower.stop()
        # Constructor done: the next thing this replica does is take a request. The route may already have
        # answered (it waits only for replicas the coordinator has heard from), so the replica must be on v1.
        assert (follower.applied_version, model.path) == (1, "/w/new")
        assert model.applied == ["/w/new"]
        assert [r["applied_version"] for r in coordinator.replicas()] == [1]


class Validator:
    """The Worker handle's `validate_weights` (every directory fits)."""

    class validate_weights:  # noqa: N801 - mirrors `handle.validate_weights.remote`
        @staticmethod
        def remote(path: str) -> Done:
            return Done({"path": path, "fingerprint": Path(path).name})


def test_of_two_racing_updates_the_first_is_reported_superseded_not_applied(tmp_path, no_ray, monkeypatch):
    monkeypatch.setattr(admin_module, "POLL_S", 0.01)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    coordinator = WeightCoordinator()
    model = Model()
    replica = WeightFollower("app", "r1", concurrent.futures.ThreadPoolExecutor(1), model.apply, model.describe)
    replica._executor.shutdown()  # the test runs its apply itself, between two beats
    coordinator.heartbeat("r1", replica.state())
    admin = WeightAdmin(Validator(), AdminOptions(token="t", weight_roots=[str(tmp_path)]), "app")
    admin._coordinator = InProcessActor(coordinator)

    async def race() -> tuple[Any, Any]:
        first = asyncio.ensure_future(admin.update({"path": "a"}))
        second = asyncio.ensure_future(admin.update({"path": "b"}))
        while coordinator.target()[0] < 2:
            await asyncio.sleep(0.01)
        # The replica's next beat sees v2 only: it loads b and never a.
        version, path = coordinator.heartbeat("r1", replica.state())
        replica._apply(version, path)
        coordinator.heartbeat("r1", replica.state())
        return await asyncio.wait_for(first, 30), await asyncio.wait_for(second, 30)

    first, second = asyncio.run(race())
    assert model.applied == [str((tmp_path / "b").resolve())]
    assert second.status_code == 200
    body = json.loads(first.body)
    assert first.status_code == 409, body
    assert body["status"] == "superseded" and body["version"] == 1
    assert [(r["ok"], r["new_version"], r["error"]) for r in body["replicas"]] == [(False, 2, "superseded by v2")]


class BeatDuringIteration(dict):
    """The coordinator's replica table; iterating it lets another thread's heartbeat in (what a thread switch
    of the threaded actor, max_concurrency > 1, does) and waits a little for it to land."""

    coordinator: WeightCoordinator

    def items(self):
        for n, item in enumerate(super().items()):
            if n == 0:
                beat = threading.Thread(target=self.coordinator.heartbeat, args=("r-new", {}))
                beat.start()
                beat.join(0.5)  # lands at once unless the coordinator serializes its methods
            yield item


def test_the_coordinator_answers_a_poll_while_a_new_replica_beats():
    coordinator = WeightCoordinator()
    coordinator.heartbeat("r1", {})
    table = BeatDuringIteration(coordinator._replicas)
    table.coordinator = coordinator
    coordinator._replicas = table
    assert [r["replica"] for r in coordinator.replicas()] == ["r1"]  # old code: dictionary changed size
    deadline = time.monotonic() + 30
    while len(coordinator._replicas) < 2:
        assert time.monotonic() < deadline, "the new replica's heartbeat never landed"
        time.sleep(0.01)
    assert sorted(r["replica"] for r in coordinator.replicas()) == ["r-new", "r1"]
