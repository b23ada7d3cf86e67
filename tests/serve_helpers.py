"""Helpers for tests that run a local Ray cluster with Serve: one cluster for the session (`SESSION`), emptied
between modules; a module that needs a config of its own shuts it down and starts its own."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

import requests

# Serve/Ray on a 2-core CI machine: ray.init 3-5 s, serve.run ~3 s (shared/reference.md); be generous.
STARTUP_TIMEOUT_S = 120.0
APP_NAME = "ditserve"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: Logical CPUs of the session's shared cluster: the most any module's deployments ask for at once
#: (test_parallel_serve: an SP2 replica beside the ingress and stages). Logical only: Ray does not pin cores.
SESSION_NUM_CPUS = 8
#: Where Serve keeps its controller, proxies and replicas (ray.serve's SERVE_NAMESPACE).
SERVE_NAMESPACE = "serve"


class SessionCluster:
    """The test session's one local Ray cluster, with Serve on a free HTTP port, started on first use and shared
    by every module that needs no cluster config of its own (ray.init 3-5 s and serve.start ~3 s once, not per
    module).

    Between modules `clean()` empties it: deletes the module's Serve apps, kills its named actors (pools and the
    weight coordinator are detached: they would outlive the app and hand the next module its state) and removes
    its placement groups. `stop()` shuts it down, for a module that starts a cluster of its own (other
    `ray.init` arguments, several nodes, environment read by the raylet) and at session end; the next shared
    user starts it again."""

    def __init__(self) -> None:
        self._running = False
        self._base_url: str | None = None

    @property
    def started(self) -> bool:
        """Did anything start Ray in this process (the shared cluster or a module's own)?"""
        return self._running or "ray" in sys.modules

    def start_ray(self) -> None:
        import ray

        if self._running and ray.is_initialized():
            return
        if ray.is_initialized():  # a module's own cluster left up
            self._shutdown()
        # address="local": always a fresh cluster of our own, even if another one was `ray start`ed here.
        ray.init(address="local", num_cpus=SESSION_NUM_CPUS, include_dashboard=False, log_to_driver=False)
        self._running, self._base_url = True, None

    def start_serve(self) -> str:
        """Ray and Serve up; the HTTP base URL."""
        from ray import serve

        self.start_ray()
        if self._base_url is None:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            self._base_url = f"http://127.0.0.1:{port}"
        return self._base_url

    def clean(self) -> None:
        import ray
        from ray import serve
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        if not (self._running and ray.is_initialized()):
            return
        if self._base_url is not None:
            for name in serve.status().applications:
                serve.delete(name)  # blocks until its replicas are gone
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if actor["namespace"] != SERVE_NAMESPACE:
                with contextlib.suppress(ValueError):  # gone meanwhile
                    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
        for pg_id, pg in ray.util.placement_group_table().items():
            if pg["state"] != "REMOVED":
                with contextlib.suppress(Exception):
                    remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            self._shutdown()
        self._running, self._base_url = False, None

    @staticmethod
    def _shutdown() -> None:
        import ray
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


#: The session's cluster; tests/conftest.py stops it at session end.
SESSION = SessionCluster()


@contextlib.contextmanager
def shared_ray() -> Iterator[None]:
    """Ray up (the session's cluster) for the duration; emptied afterwards, left running for the next module."""
    SESSION.start_ray()
    try:
        yield
    finally:
        SESSION.clean()


def own_cluster() -> None:
    """Shut the session's cluster down before a module starts a cluster of its own (`ray.init` twice fails)."""
    SESSION.stop()


@contextlib.contextmanager
def serve_cluster(num_cpus: int = 4, **init_kwargs) -> Iterator[str]:
    """Ray + Serve on a free HTTP port; yield the base URL. Without `init_kwargs` (and num_cpus within the
    session's), the session's shared cluster, emptied afterwards; with them (e.g. `_metrics_export_port=`),
    a cluster of the module's own, shut down afterwards."""
    if not init_kwargs and num_cpus <= SESSION_NUM_CPUS:
        base_url = SESSION.start_serve()
        try:
            yield base_url
        finally:
            SESSION.clean()
        return

    import ray
    from ray import serve

    own_cluster()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, **init_kwargs)
    try:
        port = free_port()  # after ray.init: the cluster's processes bind ephemeral ports of their own as they start
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def wait_healthy(base_url: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = requests.get(f"{base_url}/healthz", timeout=10)
            if last.status_code == 200:
                return
        except requests.RequestException as exc:
            last = exc
        time.sleep(0.5)
    raise TimeoutError(f"{base_url}/healthz not healthy after {timeout_s}s: {last!r}")


def serve_config_args(checkpoint_root) -> dict:
    """The `args` of the shipped serve_config.yaml, with checkpoints made under `checkpoint_root`."""
    import yaml

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "serve_config.yaml").read_text())
    args = config["applications"][0]["args"]
    args["engine"]["checkpoint_root"] = str(checkpoint_root)
    return args


def run_app(base_url: str, args: dict, name: str = APP_NAME, route_prefix: str = "/") -> None:
    """Deploy the ditserve app built from `args` and wait until it answers /healthz."""
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(args), name=name, route_prefix=route_prefix)
    wait_healthy(base_url + route_prefix.rstrip("/"))


def sse_events(response: requests.Response):
    """(event name, parsed data) per server-sent event, read incrementally."""
    name = None
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            yield name, json.loads(line[len("data: "):])
