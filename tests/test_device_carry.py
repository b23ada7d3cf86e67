"""scripts/device_carry.py: what the GPU machines get carried is this venv's requirement tree, less what their
image has, what the benches never import, and torch (the image's own build). No downloads here."""

from __future__ import annotations

import importlib.util
import tarfile
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_carry.py"


@pytest.fixture(scope="module")
def carry():
    spec = importlib.util.spec_from_file_location("device_carry", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_image_package_list_is_read_from_kinds_md(carry, tmp_path):
    kinds = tmp_path / "KINDS.md"
    kinds.write_text("# kinds\n\n## Python packages already there\n\nsome words. Packages: absl-py, Jinja2, "
                     "typing_extensions, zipp.\n")
    assert carry.device_packages(kinds) == {"absl-py", "jinja2", "typing-extensions", "zipp"}
    kinds.write_text("no list here\n")
    with pytest.raises(SystemExit, match="no 'Packages"):
        carry.device_packages(kinds)


def test_the_walk_follows_extras_and_leaves_out_the_image_torch_and_what_is_never_imported(carry):
    serve = carry.needed(("ray[serve]",), on_device=set())
    plain = carry.needed(("ray",), on_device=set())
    assert {"ray", "fastapi", "starlette", "uvicorn"} <= serve.keys()
    assert "fastapi" not in plain  # only the serve extra asks for it
    assert not serve.keys() & set(carry.NOT_IMPORTED)
    assert "fastapi" not in carry.needed(("ray[serve]",), on_device={"fastapi"})
    stack = carry.needed(("cache-dit",), on_device=set())
    assert "diffusers" in stack and "torch" not in stack
    assert all(version for version in stack.values())  # this venv's versions, pinned


def test_ray_is_repacked_without_the_unused_libraries_and_keeps_its_executables(carry, tmp_path):
    wheel = tmp_path / "ray-0-cp312-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, mode in (("ray/core/src/ray/gcs/gcs_server", 0o755), ("ray/serve/api.py", 0o644),
                           ("ray/rllib/algo.py", 0o644)):
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            archive.writestr(info, b"x")
    carry.pack_ray(wheel, tmp_path / "ray_site.tar.xz")
    with tarfile.open(tmp_path / "ray_site.tar.xz") as tar:
        modes = {member.name: member.mode for member in tar.getmembers() if member.isfile()}
    assert modes == {"ray/core/src/ray/gcs/gcs_server": 0o755, "ray/serve/api.py": 0o644}
