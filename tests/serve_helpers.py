"""Helpers for tests that run a local Ray cluster with Serve (one cluster per test module)."""

from __future__ import annotations

import contextlib
import json
import socket
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


@contextlib.contextmanager
def serve_cluster(num_cpus: int = 4, **init_kwargs) -> Iterator[str]:
    """Start Ray + Serve on a free HTTP port; yield the base URL; shut everything down afterwards.
    `init_kwargs` go to `ray.init` (e.g. `_metrics_export_port=free_port()`)."""
    import ray
    from ray import serve

    port = free_port()
    # address="local": always a fresh cluster of our own, even if another one was `ray start`ed on this machine.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, **init_kwargs)
    try:
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
