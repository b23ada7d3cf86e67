"""Security defaults that need no cluster: where the service listens, where weights may come from, limits.

The behavioral checks over HTTP (admin token, confined weight paths, pickled / `__class__` bodies, body and
output size limits) run against a live deployment in tests/test_reliability_http.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from deployments.schemas import AdminOptions, AppConfig, HttpOptions
from deployments.weights import confine_weights_path

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def serve_config() -> dict:
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())


def test_serve_config_listens_on_loopback_only(serve_config):
    assert serve_config["http_options"]["host"] == "127.0.0.1"


def test_without_http_options_serve_listens_on_loopback_only():
    # The app config has no host of its own: a bare `serve.start()` / `serve run` falls back to Serve's default.
    from ray.serve.config import HTTPOptions

    assert HTTPOptions().host == "127.0.0.1"
    assert "host" not in AppConfig.model_fields and "host" not in HttpOptions.model_fields


def test_scripts_do_not_widen_the_listen_address():
    for script in (ROOT / "scripts").iterdir():
        if script.is_file():
            assert "0.0.0.0" not in script.read_text(), f"{script.name} listens beyond loopback"


def test_serve_config_carries_no_admin_token_and_a_body_limit(serve_config):
    args = serve_config["applications"][0]["args"]
    assert (args.get("admin") or {}).get("token") is None  # from $DITSERVE_ADMIN_TOKEN, never from the file
    config = AppConfig.model_validate(args)
    assert 0 < config.http.max_body_bytes <= HttpOptions().max_body_bytes == 64 * 1024


def test_admin_routes_are_off_by_default(monkeypatch):
    monkeypatch.delenv("DITSERVE_ADMIN_TOKEN", raising=False)
    assert AdminOptions().token is None and AppConfig().admin.token is None


@pytest.fixture
def roots(tmp_path):
    inside, outside = tmp_path / "weights", tmp_path / "elsewhere"
    (inside / "ckpt").mkdir(parents=True)
    outside.mkdir()
    (inside / "link-out").symlink_to(outside, target_is_directory=True)
    (inside / "link-in").symlink_to(inside / "ckpt", target_is_directory=True)
    return inside, outside


def test_weight_paths_inside_the_roots_resolve(roots):
    inside, _ = roots
    assert confine_weights_path(str(inside / "ckpt"), [str(inside)]) == (inside / "ckpt").resolve()
    assert confine_weights_path("ckpt", [str(inside)]) == (inside / "ckpt").resolve()  # relative: first root
    assert confine_weights_path(str(inside / "link-in"), [str(inside)]) == (inside / "ckpt").resolve()


@pytest.mark.parametrize("make_path, message", [
    (lambda inside, outside: str(outside), "outside admin.weight_roots"),
    (lambda inside, outside: str(inside / "link-out"), "outside admin.weight_roots"),
    (lambda inside, outside: f"{inside}/../elsewhere", "path traversal"),
    (lambda inside, outside: "../elsewhere", "path traversal"),
    (lambda inside, outside: "/", "outside admin.weight_roots"),
    (lambda inside, outside: f"{inside}/ckpt\x00", "NUL"),
    (lambda inside, outside: "   ", "non-empty string"),
    (lambda inside, outside: os.path.expanduser("~"), "outside admin.weight_roots"),
], ids=["outside", "symlink-out", "dot-dot", "relative-dot-dot", "filesystem-root", "nul", "blank", "home"])
def test_weight_paths_outside_the_roots_are_refused(roots, make_path, message):
    inside, outside = roots
    with pytest.raises(ValueError, match=message):
        confine_weights_path(make_path(inside, outside), [str(inside)])


def test_no_roots_means_no_weight_updates(roots):
    inside, _ = roots
    with pytest.raises(ValueError, match="no admin.weight_roots"):
        confine_weights_path(str(inside / "ckpt"), [])
