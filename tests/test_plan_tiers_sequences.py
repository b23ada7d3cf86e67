"""Long seeded request sequences over many overlapping schedules against the GPU slab, the host tier and a remote
tier, requests held across others as the engine's queue and the split app do: every answer equals the resident
projection (a fresh rebuild for the current weights) when prepared and again before release, slab refcounts return
to zero, the host tier stays within `host_cache_gb` (zero, smaller than one group, larger than the working set) and
the page-locked memory never grows."""

from __future__ import annotations

import random

import pytest
import torch

from cache.plan_cache import SlabFullError
from device.streams import FakeDevice
from tests.adaln_support import (DictRemote, MemoResident, assert_equal_to_resident, host_gb, online_cache, plan,
                                 resident)


def random_schedules(rng: random.Random, count: int) -> list[list[torch.Tensor]]:
    """`count` schedules of 1-5 plans of 1-2 timesteps drawn from a small grid, so schedules share plans."""
    schedules = []
    for _ in range(count):
        width = rng.randint(1, 2)
        schedules.append([plan(*sorted({rng.randint(0, 12) / 12 + 0.001 * j for j in range(width)}))
                          for _ in range(rng.randint(1, 5))])
    return schedules


@pytest.mark.parametrize("with_remote", [False, True], ids=["no-remote", "remote"])
@pytest.mark.parametrize("host_pages", [0, 1, 3, 9, 40])
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])  # seed 1: the full suite
def test_every_answer_is_exact_and_every_bound_holds_over_long_sequences(tiny, seed, host_pages, with_remote):
    rng = random.Random(f"{seed}-{host_pages}-{with_remote}")
    gpu = FakeDevice()  # side-stream copies land only once fenced: a missing fence reads NaN or stale rows
    cache = online_cache(tiny, gpu=gpu, gpu_plans=rng.choice([5, 6, 8]), host_cache_gb=host_gb(host_pages))
    if with_remote:
        cache.remote = DictRemote()
    reference = MemoResident(resident(tiny))
    schedules = random_schedules(rng, 14)
    locked = None  # page-locked bytes once the first miss set up the rebuild's staging
    held = []
    for _ in range(300):
        if held and (len(held) == 2 or rng.random() < 0.5):
            prepared, plans = held.pop(rng.randrange(len(held)))
            assert_equal_to_resident(prepared, reference, plans)  # untouched while other requests ran
            prepared.release()
            continue
        plans = rng.choice(schedules)
        try:
            prepared = cache.prepare(plans)
        except SlabFullError:  # the held requests leave too few slots: typed, nothing taken
            continue
        assert_equal_to_resident(prepared, reference, plans)
        held.append((prepared, plans))
        cache.slab.index.check()
        cache.host.check()
        assert cache.host.num_pages * cache.host.page_bytes <= cache.config.host_cache_bytes
        locked = gpu.locked_bytes if locked is None else locked
        assert gpu.locked_bytes == locked
    for prepared, plans in held:
        assert_equal_to_resident(prepared, reference, plans)
        prepared.release()
    index = cache.slab.index
    index.check()
    assert all(index.refcount(slot) == 0 for slot in range(index.capacity))
    stats = cache.stats
    assert stats.gpu_evicted_plans > 0 and stats.built_plans > 0  # the slab overflowed and recycled slots
    if host_pages == 40:
        assert stats.host_hit_plans > 0 and stats.host_pressure_skips == 0
    if with_remote and host_pages < 40:  # (a tier holding the working set leaves the remote nothing to do)
        assert stats.pool_hit_plans > 0
    cache.close()
