"""Fleet-wide weight updates: one target, applied by every worker replica between requests.

Pieces:

- `WeightCoordinator`: a detached Ray actor named `ditserve-weights:<app>` in namespace `ditserve` (made by
  whoever needs it first, `get_if_exists`). It holds the fleet's target `(version, path)` (version 0: the
  configured checkpoint; every `set_target` adds 1) and what each replica last reported (applied version,
  model, plan bookkeeping, the result of its last apply, when it was last heard from).
- `WeightFollower`: the replica side. A daemon thread heartbeats to the coordinator every
  `HEARTBEAT_S` (the answer is the target); when the target is newer than what the replica applied, it
  submits one apply job to the replica's engine executor, the same single thread that runs generations.
- The admin route (`deployments/ingress.py`): confines the path (`confine_weights_path`), has one replica
  validate the directory (read-only: shapes and dtypes against the served model, the AdaLN provider's
  check), sets the target, then waits until every live replica reported the new version (or an error).

Why no request ever mixes old and new weights (the safety argument):

1. A request runs on one replica from start to finish, and within a replica every generation and every
   weight apply is a job on the same single-thread executor (and the engine additionally holds its
   generation lock for each). So an apply happens strictly between two generations: a generation reads
   only the weights present when it started, and they cannot change until it returned (or stopped at a
   step boundary on cancel). Requests queued before the apply run on the old weights, those after on the
   new ones; nothing runs mid-apply.
2. Derived state follows in the same job: `Engine.update_weights` validates everything before writing
   (a rejected update leaves the replica untouched), then refreshes the AdaLN provider, which drops every
   tier (GPU slab, host tier) and bumps the weights version that is part of every plan key, and calls the
   node pool's `invalidate()` (`Engine.pool_tier`) once the plan cache's publish thread has handed over the
   old plans it still held (so none lands in the pool after the invalidation). A plan built from the old
   weights therefore can neither be found nor be left resident; slots still referenced by a finished request
   are detached.
3. The directory is validated once by one replica before the target is set, so a bad directory changes
   nothing anywhere. Each replica still re-validates before writing (the disk may change in between); if
   that fails, that replica keeps its old weights and reports the error. A read failing after writing began
   leaves that engine unusable (it refuses requests, its health check fails, Serve replaces it), and a
   multi-GPU replica whose ranks end on different fingerprints is unusable too: never a mix served.
4. A replica that starts later reads the target in its constructor and applies it before it takes a
   request (and a newer one its first heartbeat answers with: until the coordinator has heard from it, an
   update's route does not wait for it); one that misses heartbeats is not counted as live (and catches up when it comes back).

Across replicas the fleet is briefly mixed (some replicas already new, some still finishing old requests):
each response names its `model` (`<preset>@<fingerprint>`), and the admin route returns only once every
live replica is on the new version.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, Callable

import ray

logger = logging.getLogger("ray.serve")

NAMESPACE = "ditserve"
HEARTBEAT_S = 0.5
#: A replica not heard from for this long is not waited for (it applies the target when it comes back).
LIVE_WITHIN_S = 5.0


def coordinator_name(app_name: str) -> str:
    return f"ditserve-weights:{app_name}"


class WeightCoordinator:
    """The fleet's weights target and per-replica reports (plain class; `get_coordinator` makes the actor)."""

    def __init__(self) -> None:
        self._version = 0
        self._path: str | None = None
        self._replicas: dict[str, dict[str, Any]] = {}
        # The actor is threaded (max_concurrency > 1): without it a heartbeat could read a new version with the
        # old path, or add a replica while a poll iterates the table.
        self._lock = threading.Lock()

    def set_target(self, path: str) -> int:
        with self._lock:
            self._version += 1
            self._path = path
            version = self._version
        logger.info("weights target v%d: %s", version, path)
        return version

    def target(self) -> tuple[int, str | None]:
        with self._lock:
            return self._version, self._path

    def heartbeat(self, replica_id: str, state: dict[str, Any]) -> tuple[int, str | None]:
        """A replica reports its state; the answer is the target."""
        with self._lock:
            self._replicas[replica_id] = {**state, "replica": replica_id, "last_seen": time.time()}
            return self._version, self._path

    def replicas(self, live_within_s: float = LIVE_WITHIN_S) -> list[dict[str, Any]]:
        """Replicas heard from within `live_within_s` seconds (older ones are forgotten)."""
        now = time.time()
        with self._lock:
            for rid in [r for r, s in self._replicas.items() if now - s["last_seen"] > 10 * live_within_s]:
                del self._replicas[rid]
            return [dict(s) for s in self._replicas.values() if now - s["last_seen"] <= live_within_s]


def get_coordinator(app_name: str) -> Any:
    """The app's coordinator actor, created on first use (detached: it outlives any replica)."""
    actor = ray.remote(WeightCoordinator).options(
        name=coordinator_name(app_name), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_concurrency=64,
    )
    return actor.remote()


def confine_weights_path(raw: Any, roots: list[str]) -> Path:
    """The resolved directory for an admin weight update, or ValueError (HTTP 400) saying why not.

    Relative paths are taken relative to the first root. `..` components are refused outright; symlinks are
    resolved before the check, so a link inside a root that points outside it is refused too.
    """
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError("path: a non-empty string is required")
    if "\x00" in raw:
        raise ValueError("path: NUL bytes are not allowed")
    if not roots:
        raise ValueError("path: no admin.weight_roots are configured")
    path = Path(raw)
    if ".." in path.parts:
        raise ValueError("path: '..' components (path traversal) are not allowed")
    resolved_roots = [Path(r).resolve() for r in roots]
    resolved = (path if path.is_absolute() else resolved_roots[0] / path).resolve()
    if not any(resolved == r or resolved.is_relative_to(r) for r in resolved_roots):
        raise ValueError(f"path: {raw!r} is outside admin.weight_roots ({', '.join(map(str, resolved_roots))})")
    return resolved


class WeightFollower:
    """Replica side: heartbeats, and applies a newer target on the engine's own executor (between requests).

    `apply(path) -> dict` runs on `executor` (the single engine thread) and raises on failure; `describe()`
    gives the replica's state for the coordinator (cheap, any thread); `on_applied(version)` runs after a
    successful apply (on the engine thread).
    """

    def __init__(self, app_name: str, replica_id: str, executor: Executor,
                 apply: Callable[[str], dict[str, Any]] | None, describe: Callable[[], dict[str, Any]],
                 on_applied: Callable[[int], None] | None = None) -> None:
        self.app_name, self.replica_id = app_name, replica_id
        self._executor, self._apply_fn, self._describe, self._on_applied = executor, apply, describe, on_applied
        self.applied_version = 0
        self.failed_version = 0
        self.last_apply: dict[str, Any] | None = None
        self._pending: Future | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._coordinator: Any = None
        self._thread: threading.Thread | None = None

    # -- startup
    def start(self, timeout_s: float = 30.0) -> None:
        """Apply the fleet target now (constructor: no request yet), then heartbeat in the background."""
        try:
            # Read the target without a heartbeat: a replica is listed (GET /admin/weights) only once it has
            # applied it, never with the version it had before.
            if self._coordinator is None:
                self._coordinator = get_coordinator(self.app_name)
            version, path = ray.get(self._coordinator.target.remote(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - no coordinator yet: the thread retries
            logger.warning("weights coordinator unreachable at startup; retrying in the background", exc_info=True)
            self._coordinator = None
            version, path = 0, None
        if version > 0 and path is not None:
            self._apply(version, path)
        # First heartbeat, with the state after the startup apply. An update may have set a newer target since
        # it was read, and its route waits only for replicas the coordinator has heard from: apply what the
        # answer names before the first request, until the coordinator has seen this replica on the target.
        while self._coordinator is not None:
            try:
                version, path = ray.get(self._heartbeat_ref(), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - the thread retries
                self._coordinator = None
                break
            if version <= max(self.applied_version, self.failed_version) or path is None:
                break
            self._apply(version, path)
        self._thread = threading.Thread(target=self._loop, name="weights-follower", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    # -- state
    def state(self) -> dict[str, Any]:
        with self._lock:
            pending = self._pending is not None
        return {"applied_version": self.applied_version, "failed_version": self.failed_version,
                "pending": pending, "last_apply": self.last_apply, **self._describe()}

    def _heartbeat_ref(self) -> Any:
        if self._coordinator is None:
            self._coordinator = get_coordinator(self.app_name)
        return self._coordinator.heartbeat.remote(self.replica_id, self.state())

    def _loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                version, path = ray.get(self._heartbeat_ref(), timeout=10)
            except Exception:  # noqa: BLE001 - coordinator restarting or gone: find/create it again next time
                self._coordinator = None
                continue
            with self._lock:
                due = (version > max(self.applied_version, self.failed_version) and path is not None
                       and self._pending is None)
                if due:
                    self._pending = self._executor.submit(self._apply, version, path)
                    self._pending.add_done_callback(self._applied)

    def _applied(self, _future: Future) -> None:
        with self._lock:
            self._pending = None
        try:  # report at once rather than at the next beat
            self._heartbeat_ref()
        except Exception:  # noqa: BLE001
            self._coordinator = None

    # -- the apply job (engine thread)
    def _apply(self, version: int, path: str) -> None:
        before = self._describe()
        report: dict[str, Any] = {"old_version": self.applied_version, "new_version": version, "path": path,
                                  "old_model": before.get("model")}
        start = time.perf_counter()
        try:
            if self._apply_fn is None:
                raise ValueError("this engine does not support weight updates")
            self._apply_fn(path)
        except Exception as exc:  # noqa: BLE001 - reported per replica; the replica keeps its old weights
            self.failed_version = version
            report.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            logger.error("weights v%d from %s not applied: %s", version, path, exc)
        else:
            self.applied_version = version
            report.update(ok=True, error=None)
            if self._on_applied is not None:
                self._on_applied(version)
            logger.info("weights v%d applied from %s", version, path)
        report["new_model"] = self._describe().get("model")
        report["seconds"] = time.perf_counter() - start
        self.last_apply = report


def env_admin_token() -> str | None:
    return os.environ.get("DITSERVE_ADMIN_TOKEN") or None
