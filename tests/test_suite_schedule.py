"""The suite's own schedule (tests/conftest.py) rests on two facts kept true here: every module that starts or
joins a Ray cluster is marked `ray` (else it would run among the modules after which a worker stopped its
cluster, and start one again), and `LONGEST_MODULES` names modules that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import LONGEST_MODULES

TESTS = Path(__file__).resolve().parent
#: What starts or joins a cluster in a test module (tests/serve_helpers.py's helpers, Ray's own call, the bench
#: fixture that makes room for bench.app's cluster).
STARTS_RAY = re.compile(r"\b(shared_ray|serve_cluster|own_cluster)\(|\bray\.init\(|\bbench_starts_its_own_ray\b")
MARKED = re.compile(r"^pytestmark = .*\bpytest\.mark\.ray\b", re.MULTILINE)
#: A cluster of the module's own: `own_cluster`, or `serve_cluster` given a `ray.init` keyword (any but num_cpus:
#: tests/serve_helpers.py starts its own cluster for those).
OWN_CLUSTER = re.compile(r"\bown_cluster\(\)|\bserve_cluster\((?:[^)]*,\s*)?(?!num_cpus\b)\w+=")


def modules() -> list[Path]:
    return sorted(TESTS.glob("test_*.py"))


@pytest.mark.parametrize("path", [p for p in modules() if STARTS_RAY.search(p.read_text())], ids=lambda p: p.stem)
def test_a_module_that_uses_ray_is_marked_ray_and_says_whether_the_cluster_is_its_own(path):
    text = path.read_text()
    assert MARKED.search(text), f"{path.name}: add pytest.mark.ray to its pytestmark"
    own = "pytest.mark.ray(own_cluster=True)" in text
    assert own == bool(OWN_CLUSTER.search(text)), f"{path.name}: pytest.mark.ray(own_cluster=...) is wrong"


def test_the_longest_modules_exist_once_each():
    names = {path.stem for path in modules()}
    assert len(set(LONGEST_MODULES)) == len(LONGEST_MODULES)
    assert set(LONGEST_MODULES) <= names, set(LONGEST_MODULES) - names
