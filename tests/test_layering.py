"""The folder tree is the dependency picture: who may import whom, checked on every .py file's imports.

    deployments/  Serve: ingress, worker shim, router          engine, actors (not cache/model/offload); Ray
    actors/       Ray actors (the node's plan pool)            engine, cache, model, offload; Ray
    engine/       plain torch: one device, one model           parallel, cache, offload, model; no Ray
    parallel/     sequence parallel over one replica's ranks   cache, offload, model, device; no Ray
    cache/, offload/  plan cache, layerwise offload            model, device (and each other); no Ray
    model/        the model                                    nothing of ours; no Ray
    device/       streams, events, pinned memory               nothing of ours; no Ray, no torch.distributed
    jobs/         video jobs behind /v1/videos                 only the standard library, pydantic, psycopg,
                                                               fsspec and `engine.limits`; no torch, no Ray

Nothing imports `deployments/` except `deployments/` itself, `tests/` and `bench/` (they drive the app);
`tests/` and `bench/` may import Ray. Any other top-level folder (a new one included) gets the strict
default: no Ray, no `deployments/`. Imports are read with `ast` (lazy imports inside functions count too;
relative imports are resolved), so nothing is executed.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: What each library package must not import (first component of the module name).
FORBIDDEN: dict[str, frozenset[str]] = {
    # The bottom of the graph: streams, events and pinned memory for every package above it.
    "device": frozenset({"model", "cache", "offload", "engine", "parallel", "jobs", "actors", "deployments",
                         "bench", "tests"}),
    "model": frozenset({"cache", "offload", "engine", "actors", "deployments", "bench", "tests"}),
    "cache": frozenset({"engine", "actors", "deployments", "bench", "tests"}),
    "offload": frozenset({"engine", "actors", "deployments", "bench", "tests"}),
    "engine": frozenset({"actors", "deployments", "bench", "tests"}),
    "actors": frozenset({"deployments", "bench", "tests"}),
    # Plain torch.distributed over the ranks of one replica: the actors that host the ranks sit above it.
    "parallel": frozenset({"engine", "actors", "jobs", "deployments", "bench", "tests"}),
    # The Serve layer talks to the engine (its types and errors) and to actors, never to the layers below.
    "deployments": frozenset({"cache", "model", "offload", "bench", "tests"}),
    # The job layer is plain Python: no torch, no Ray, nothing of the engine but its served limits (below).
}
#: Modules (and their submodules) a package must not import, beyond the first-component rules above.
FORBIDDEN_MODULES: dict[str, tuple[str, ...]] = {"device": ("torch.distributed",)}
#: Packages held to a list of what they may import (module names and their submodules), instead of a list of
#: what they must not: jobs/ runs inside the ingress and in tests without torch, so nothing may pull it in.
ONLY_ALLOWED: dict[str, frozenset[str]] = {
    "jobs": frozenset({
        *sys.stdlib_module_names, "jobs", "pydantic", "psycopg", "fsspec",
        # The served model's limits, shared with the engine so a job is checked by the engine's own rules.
        # Exactly this module, which imports no torch; the rest of engine/ is torch.
        "engine.limits",
    }),
}
#: Top-level folders whose files may import Ray.
RAY_ALLOWED = frozenset({"actors", "deployments", "tests", "bench"})
#: Top-level folders whose files may import `deployments`.
DEPLOYMENTS_ALLOWED = frozenset({"deployments", "tests", "bench"})
#: Not our source: virtual environments, build metadata, caches.
SKIPPED_PARTS = ("__pycache__", "build", "dist")


def source_files(root: Path) -> list[Path]:
    """Every .py file of ours under `root` (hidden folders, *.egg-info and caches left out)."""
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p.startswith(".") or p.endswith(".egg-info") or p in SKIPPED_PARTS for p in parts[:-1]):
            continue
        files.append(path)
    return files


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, relative imports resolved against its package."""
    package = list(path.relative_to(root).parts[:-1])
    modules = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                modules.append((node.lineno, node.module or ""))
                continue
            base = package[: len(package) - (node.level - 1)] if node.level - 1 <= len(package) else []
            if node.module:
                modules.append((node.lineno, ".".join([*base, node.module])))
            else:  # `from . import x`: each name may be a submodule
                modules += [(node.lineno, ".".join([*base, alias.name])) for alias in node.names]
    return modules


def layering_violations(root: Path) -> list[str]:
    """One line per import that breaks the rules in this module's docstring ("path:line: why")."""
    violations = []
    for path in source_files(root):
        rel = path.relative_to(root)
        top = rel.parts[0] if len(rel.parts) > 1 else ""  # "" for a file at the repository root
        forbidden = FORBIDDEN.get(top, frozenset())
        only = ONLY_ALLOWED.get(top)
        for line, module in imported_modules(path, root):
            first = module.split(".")[0]
            if first == "ray" and top not in RAY_ALLOWED:
                violations.append(f"{rel}:{line}: imports {module} (Ray belongs in actors/ and deployments/)")
            elif first == "deployments" and top not in DEPLOYMENTS_ALLOWED:
                violations.append(f"{rel}:{line}: imports {module} (nothing imports the Serve layer)")
            elif only is not None and not any(module == m or module.startswith(m + ".") for m in only):
                violations.append(f"{rel}:{line}: imports {module} ({top}/ imports only the standard library, "
                                  f"its own modules and {', '.join(sorted(only - sys.stdlib_module_names - {top}))})")
            elif first in forbidden:
                violations.append(f"{rel}:{line}: imports {module} ({top}/ must not import {first}/)")
            elif any(module == m or module.startswith(m + ".") for m in FORBIDDEN_MODULES.get(top, ())):
                violations.append(f"{rel}:{line}: imports {module} ({top}/ must not need it)")
    return violations


def test_the_tree_follows_the_layering_rules():
    assert layering_violations(REPO) == []


def test_the_checker_reads_the_real_tree():
    # Guards against a checker that passes because it looks at nothing.
    tops = {path.relative_to(REPO).parts[0] for path in source_files(REPO)}
    assert {"device", "model", "cache", "offload", "engine", "parallel", "jobs", "actors", "deployments",
            "tests"} <= tops
    assert not any(".venv" in path.parts for path in source_files(REPO))
    modules = {m for m in (module for p in source_files(REPO) for _, module in imported_modules(p, REPO))}
    assert {"ray", "engine.engine", "cache.plan_cache", "device.streams", "device.pinned"} <= modules


# --- the checker itself, on synthetic trees ------------------------------------------------------


def write(root: Path, relpath: str, source: str) -> None:
    path = root / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)


@pytest.mark.parametrize("relpath, source, expected", [
    ("device/streams.py", "import ray\n", "device/streams.py:1: imports ray (Ray belongs"),
    ("cache/slab.py", "from ray.util import get_node_ip_address\n", "cache/slab.py:1: imports ray.util"),
    ("cache/slab.py", "def f():\n    import ray\n", "cache/slab.py:2: imports ray"),  # lazy imports count
    ("device/pinned.py", "from cache.slab import PlanSlab\n", "(device/ must not import cache/)"),
    ("device/streams.py", "from offload.pinned import BlockLayout\n", "(device/ must not import offload/)"),
    ("device/streams.py", "from model.adaln import Modulation\n", "(device/ must not import model/)"),
    ("device/streams.py", "from ..engine import errors\n", "(device/ must not import engine/)"),
    ("device/pinned.py", "import torch.distributed as dist\n", "imports torch.distributed (device/ must not"),
    ("device/pinned.py", "from torch.distributed import ProcessGroup\n", "imports torch.distributed (device/"),
    ("offload/pinned.py", "import ray.serve\n", "offload/pinned.py:1: imports ray.serve"),
    ("engine/engine.py", "import ray\n", "engine/engine.py:1: imports ray"),
    ("model/dit.py", "from cache.plan_key import plan_key\n", "model/dit.py:1: imports cache.plan_key (model/ must"),
    ("model/sub/x.py", "from ...cache import plan_key\n", "model/sub/x.py:1: imports cache (model/ must not"),
    ("model/dit.py", "import engine.errors\n", "model/dit.py:1: imports engine.errors (model/ must not import engine/)"),
    ("cache/rebuild.py", "from engine.errors import ServerFault\n", "(cache/ must not import engine/)"),
    ("offload/layerwise.py", "from actors import host_cache_pool\n", "(offload/ must not import actors/)"),
    ("engine/engine.py", "from actors.host_cache_pool import make_pool_client\n", "(engine/ must not import actors/)"),
    ("engine/engine.py", "from deployments.schemas import AppConfig\n", "(nothing imports the Serve layer)"),
    ("actors/host_cache_pool.py", "from deployments import worker\n", "(nothing imports the Serve layer)"),
    ("deployments/ingress.py", "from cache.rebuild import RebuildError\n", "(deployments/ must not import cache/)"),
    ("deployments/ingress.py", "def f():\n    from model.checkpoint import CheckpointError\n", "(deployments/ must not import model/)"),
    ("jobs/service.py", "from engine.errors import ClientError\n", "imports engine.errors (jobs/ imports only"),
    ("video/mux.py", "import ray\n", "video/mux.py:1: imports ray"),  # a new folder gets the strict default
    ("parallel/group.py", "import ray\n", "parallel/group.py:1: imports ray (Ray belongs"),
    ("parallel/sequence.py", "from actors.gpu_worker import RankActor\n", "(parallel/ must not import actors/)"),
    ("parallel/sequence.py", "from deployments.worker import Worker\n", "(nothing imports the Serve layer)"),
    ("parallel/adaln.py", "from engine.engine import Engine\n", "(parallel/ must not import engine/)"),
    ("jobs/service.py", "import torch\n", "jobs/service.py:1: imports torch (jobs/ imports only the standard"),
    ("jobs/service.py", "def f():\n    from diffusers import MiniMaxH3Scheduler\n", "jobs/service.py:2: imports diffusers"),
    ("jobs/service.py", "import ray\n", "jobs/service.py:1: imports ray (Ray belongs"),
    ("jobs/service.py", "from engine.engine import Engine\n", "imports engine.engine (jobs/ imports only"),
    ("jobs/service.py", "from engine import limits\n", "imports engine (jobs/ imports only"),  # all of engine/
    ("jobs/limits.py", "from model.tiny import TINY_TRANSFORMER\n", "imports model.tiny (jobs/ imports only"),
    ("jobs/limits.py", "import engine.limitsx\n", "imports engine.limitsx (jobs/"),  # a prefix is not the module
])
def test_checker_reports_a_forbidden_import(tmp_path, relpath, source, expected):
    write(tmp_path, relpath, source)
    violations = layering_violations(tmp_path)
    assert len(violations) == 1 and expected in violations[0], violations


@pytest.mark.parametrize("relpath, source", [
    ("actors/host_cache_pool.py", "import ray\nfrom engine.config import PoolConfig\nfrom cache.plan_cache import PlanRows\n"),
    ("deployments/worker.py", "import ray\nfrom actors.host_cache_pool import make_pool_client\nfrom engine.engine import Engine\n"),
    ("engine/engine.py", "from cache.plan_cache import make_adaln_provider\nfrom model.checkpoint import load_model\n"),
    ("jobs/limits.py", "from engine.limits import ModelLimits\n"),
    ("cache/plan_cache.py", "from model.sampler import FlowMatchSchedule\nfrom offload.pinned import BlockLayout\n"),
    ("cache/host_tier.py", "from device.streams import Device\nfrom device.pinned import PinnedMemory\n"),
    ("offload/layerwise.py", "from device.streams import make_device\n"),
    ("device/pinned.py", "import torch\nfrom .streams import Device\n"),
    ("tests/test_x.py", "import ray\nfrom deployments.app import build_app\n"),
    ("bench/app.py", "import ray\nfrom deployments.app import build_app\n"),
    ("model/sub/x.py", "from .. import config\nfrom ..sampler import euler_step\n"),  # relative, inside model/
    ("parallel/adaln.py", "import torch.distributed as dist\nfrom cache.plan_cache import PlanRows\n"
                          "from model.adaln import Modulation\nfrom .group import SpGroup\n"),
    ("jobs/service.py", "import asyncio\nimport sqlite3\nfrom pydantic import BaseModel\nimport psycopg\n"
                        "import fsspec.core\nfrom engine.limits import ModelLimits\nfrom .store import JobStore\n"
                        "from jobs.records import JobRecord\n"),
    (".venv/lib/cache/x.py", "import ray\n"),  # not ours
])
def test_checker_accepts_an_allowed_import(tmp_path, relpath, source):
    write(tmp_path, relpath, source)
    assert layering_violations(tmp_path) == []


#: Model libraries the ingress never needs: it validates, routes and serves; the stages run the model.
MODEL_LIBRARIES = ("diffusers", "transformers", "torchao", "peft", "cache_dit")


#: Modules whose import graphs hold no model library, and who imports them.
NO_MODEL_LIBRARY = {
    "deployments.ingress": "a Serve ingress replica",
    "engine.model_limits": "what only needs an engine's limits",
    "tests.fake_engine": "a fake-engine worker replica of the Serve tests",
}


def test_what_needs_no_model_imports_no_model_library():
    """The ingress (and anything that only parses a config or carries stage data) starts without diffusers or
    transformers: ~4 core-seconds of imports and their memory per replica. A module-level import of one,
    anywhere on one of these modules' import graphs, fails this (one interpreter imports them in turn, each
    charged with the libraries that appeared on its import)."""
    import subprocess

    probe = (f"import importlib, sys\n"
             f"for name in {list(NO_MODEL_LIBRARY)!r}:\n"
             f"    importlib.import_module(name)\n"
             f"    print(name, sorted({{m.split('.')[0] for m in sys.modules}} & set({MODEL_LIBRARIES!r})))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[1], check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()
    imported = dict(line.split(" ", 1) for line in out if line.split(" ", 1)[0] in NO_MODEL_LIBRARY)
    assert imported == {name: "[]" for name in NO_MODEL_LIBRARY}, {
        f"{NO_MODEL_LIBRARY[name]} ({name})": libraries for name, libraries in imported.items() if libraries != "[]"}
