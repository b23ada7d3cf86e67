"""Shared fixtures: the tiny MiniMax-H3 (`model.tiny`) as real checkpoints on disk and as loaded transformers."""

from __future__ import annotations

import enum
import os
import shutil
from pathlib import Path

import pytest
import torch

from model.layout import Layout
from model.tiny import TINY_TRANSFORMER, make_tiny_checkpoint
from model.weights import H3TransformerConfig
from tests.adaln_support import Models, models_for
from tests.serve_helpers import SESSION


#: The modules that take longest (seconds of a worker in a full `-n 2 --dist loadfile` run on the 2-core box,
#: 2026-12-07), longest first. `--dist loadfile` hands each free worker the next module in order, so the longest
#: go first and the short ones fill in at the end (longest-processing-time first): in the order xdist picks
#: itself (most tests first) a 30-45 s module of one or two tests came last and one worker sat idle ~45 s.
LONGEST_MODULES = (
    "test_parallel_faults",  # 107
    "test_bench_smoke",  # 105
    "test_split_fused_serve",  # 83
    "test_forward_kernels",  # 75
    "test_reliability_http",  # 55
    "test_parallel_engine",  # 48
    "test_admin_weights",  # 47
    "test_cluster",  # 41
    "test_videos_serve",  # 41
    "test_videos_worker_lost",  # 37
    "test_lifecycle",  # 36
    "test_parallel_serve",  # 35
    "test_streaming",  # 34
    "test_playground_browser",  # 33
    "test_pool_serve",  # 32
    "test_engine",  # 30
    "test_bench_compile",  # 23
    "test_bench_h3_modes",  # 21
    "test_router_adapters",  # 20
    "test_engine_conditioning",  # 19
    "test_http",  # 19
    "test_router",  # 18
)


def pytest_configure(config):
    """Under pytest-xdist, each worker's torch gets its share of the cores: two workers of two threads each on two
    cores oversubscribe them (OpenMP threads spin while the other worker's hold the cores; tests ran 2-4x slower
    than alone). Processes the tests start (the forkserver's ranks, `serve run`) inherit the same share.
    xdist's own module order (most tests first) is turned off: `pytest_collection_modifyitems` orders them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist installed
        config.option.loadscopereorder = False


class RayGroup(enum.IntEnum):
    """What a test's module needs of Ray, in the order the groups run."""

    SESSION_CLUSTER = 0  # pytest.mark.ray: joins the session's cluster
    OWN_CLUSTER = 1  # pytest.mark.ray(own_cluster=True): shuts the session's down and starts its own
    NONE = 2


def ray_group(item: pytest.Item) -> RayGroup:
    marker = item.get_closest_marker("ray")
    if marker is None:
        return RayGroup.NONE
    return RayGroup.OWN_CLUSTER if marker.kwargs.get("own_cluster") else RayGroup.SESSION_CLUSTER


def uses_ray(item: pytest.Item) -> bool:
    return ray_group(item) is not RayGroup.NONE


def pytest_collection_modifyitems(items):
    """The modules on the session's Ray cluster first, then those with a cluster of their own, then the others;
    within each group `LONGEST_MODULES` first, longest first, and the rest in collection order (a stable sort).
    A module with a cluster of its own shuts the session's down, and the next one on it started it again (~5
    core-seconds); after the Ray modules a worker stops its cluster (`pytest_runtest_teardown`) instead of
    keeping it up (~0.07 core/s idle, Serve included) under the modules that need none."""
    rank = {name: position for position, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: (ray_group(item), rank.get(item.path.stem, len(rank))))


@pytest.hookimpl(trylast=True)  # after the item's own teardown (its module's fixtures included)
def pytest_runtest_teardown(item, nextitem):
    """A worker's session cluster stops when the next test is not marked `ray` (the last of Ray's modules went);
    a marked module after it would start it again."""
    if uses_ray(item) and (nextitem is None or not uses_ray(nextitem)) and SESSION.started:
        SESSION.stop()


@pytest.fixture(scope="session", autouse=True)
def _session_cluster():
    """The one Ray cluster Ray modules share (tests/serve_helpers.py `SESSION`, started on first use): stopped
    at session end. Ray is imported only if a module started it."""
    yield
    if SESSION.started:
        SESSION.stop()


@pytest.fixture(scope="session")
def tiny_config() -> H3TransformerConfig:
    """The tiny transformer's config: 4 blocks, hidden 64, time_embed_dim 32 (adaln_width 1152, final 128)."""
    return TINY_TRANSFORMER


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Models:
    """The seed-0 tiny transformer checkpoint (diffusers layout) with its online and resident transformers
    (AdaLN plan cache tests; helpers in tests/adaln_support.py). Shared: tests must not modify it."""
    return models_for(Layout.DIFFUSERS, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_native(tmp_path_factory) -> Models:
    """`tiny` in the native layout (FL2VA/transformer under native names): the same model."""
    return models_for(Layout.NATIVE, tmp_path_factory)


@pytest.fixture(scope="session")
def _tiny_checkpoint_master(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", Layout.DIFFUSERS, seed=0)


@pytest.fixture(scope="session")
def two_partition_roots(tmp_path_factory) -> dict[str, Path]:
    """The seed-0 tiny checkpoint with both partitions (FL2VA and Ref2VA), in each layout: the fl2va and ref2va
    oracle tests read the same files (tests/conditioning_support.py). Shared: tests must not modify them."""
    base = tmp_path_factory.mktemp("two-partitions")
    return {layout: make_tiny_checkpoint(base / layout, layout, seed=0, ref2va=True)
            for layout in ("diffusers", "native")}


@pytest.fixture
def tiny_checkpoint(_tiny_checkpoint_master, tmp_path) -> Path:
    """A private copy of the complete seed-0 tiny checkpoint (diffusers layout: transformer, text encoder,
    tokenizer, VAEs) in tmp_path, safe to corrupt."""
    return Path(shutil.copytree(_tiny_checkpoint_master, tmp_path / "tiny"))


# --- job store databases (tests/test_jobs_*.py) --------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_url():
    """A throwaway PostgreSQL server for the session (scripts/postgres; installs the Debian package if missing)."""
    from tests.jobs_support import postgres_server

    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def database_url(request, tmp_path) -> str:
    """Each job-store test on SQLite and on PostgreSQL (emptied before the test)."""
    from tests.jobs_support import reset_postgres

    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'jobs.sqlite3'}"
    url = request.getfixturevalue("postgres_url")  # "postgres": marked slow (a server start, SQL over TCP)
    reset_postgres(url)
    return url
