"""Pinned host tier: built plans kept in host memory, evicted a request's group at a time.

A page is one (plan, timestep) row: `num_blocks * adaln_width` block params followed by `final_width` final
params (9.25 MiB bf16 for H3). A plan of M timesteps holds M pages. A group is one request's plans; eviction
is by group, least recently used first, all or nothing, because a rebuild streams every block anyway: a
request that misses one plan pays a full checkpoint pass, so keeping half a group saves nothing.

Copies between the slab and the pages run on the tier's own stream. Fences, both ways:
- before a D2H (slab -> page) the tier stream waits for the compute stream, which wrote the rows;
- before an H2D (page -> slab) the tier stream waits for the compute stream, whose queued forwards may still
  read the slot's previous rows; after it the compute stream waits for the H2D's event;
- slab writers on the compute stream (a rebuild) wait for the last D2H, which may still read a slot that
  was released and is about to be rebuilt (`fence_slab_writes`).
Page reuse needs no host sync: every copy touching a page runs on the one tier stream, in order, and the
CPU never reads or writes page contents.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

from cache.group_lru import GroupLRU
from cache.slab import PlanSlab
from device.pinned import PinnedMemory
from device.streams import Device, Event, Stream

logger = logging.getLogger(__name__)

#: `(shape, dtype, pin) -> Tensor`, raising RuntimeError when pinned memory cannot be had.
PageAllocator = Callable[[tuple[int, int], torch.dtype, bool], torch.Tensor]


def allocate_pages(num_pages: int, page_numel: int, dtype: torch.dtype, pin: bool,
                   allocator: PageAllocator) -> tuple[torch.Tensor, bool]:
    """`[n, page_numel]` host pages and whether they are pinned.

    Pinned allocation can fail (locked-memory limits, a host short of RAM): then try half as many pinned
    pages, then fall back to pageable memory at that size (H2D at ~8 GB/s instead of ~55), with one warning.
    """
    if num_pages == 0 or not pin:
        return allocator((num_pages, page_numel), dtype, False), False
    errors = []
    for n in (num_pages, num_pages // 2):
        if n == 0:
            break
        try:
            pages = allocator((n, page_numel), dtype, True)
        except RuntimeError as e:  # PinError (over budget, cudaHostRegister refused) or CUDA out of memory
            errors.append(f"{n} pages: {e}".splitlines()[0])
            continue
        if n != num_pages:
            logger.warning("AdaLN host tier: pinned allocation of %d pages failed (%s); using %d pinned pages",
                           num_pages, errors[0], n)
        return pages, True
    n = max(num_pages // 2, 1)
    logger.warning("AdaLN host tier: pinned allocation failed (%s); using %d pageable pages (slower H2D); "
                   "lower adaln.host_cache_gb to stay pinned", "; ".join(errors), n)
    return allocator((n, page_numel), dtype, False), False


@dataclass
class StoreResult:
    stored_plans: int = 0      # plans copied D2H by this store
    evicted_groups: int = 0    # groups evicted to make room
    skipped: bool = False      # the group is larger than the whole tier


class HostTier:
    """Pinned pages of built plans; group LRU (`cache.group_lru.GroupLRU`, sizes in pages); plans shared by
    groups are stored once and live while any group lists them.

    Verbs: `lookup(keys)` (present plans; touches their groups), `touch(group)`, `store_group(...)` (D2H the
    group's plans not yet stored, evicting LRU groups first; a group that cannot fit even in an empty tier
    is skipped and counted), `load(...)` (H2D into slab rows), `evict()` (the LRU group), `invalidate()`.

    Invariants (`check()`): free pages + pages held by plans == num_pages; the group LRU's own (a plan lives
    while a stored group lists it; a stored group's plans are all present: all or nothing).
    """

    def __init__(self, *, capacity_bytes: int, num_blocks: int, adaln_width: int, final_width: int,
                 dtype: torch.dtype, gpu: Device):
        self.num_blocks, self.adaln_width, self.final_width = num_blocks, adaln_width, final_width
        self.block_numel = num_blocks * adaln_width
        self.page_numel = self.block_numel + final_width
        self.page_bytes = self.page_numel * torch.empty((), dtype=dtype).element_size()
        wanted = max(int(capacity_bytes), 0) // self.page_bytes
        # Exact-size pinned pages (FakeDevice(lockable_bytes=...) simulates a host short of lockable memory).
        self._memory = PinnedMemory(gpu, owner="AdaLN host tier")

        def allocator(shape: tuple[int, int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
            return self._memory.pinned(shape, dtype) if pin else torch.empty(shape, dtype=dtype)

        self.pages, self.pinned = allocate_pages(wanted, self.page_numel, dtype, self._memory.pin, allocator)
        self.num_pages = self.pages.shape[0]
        self._gpu = gpu
        self._stream: Stream | None = gpu.new_stream("host") if self.num_pages else None
        self._last_d2h: Event | None = None
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        # Plan key -> its pages (one per timestep row, in row order); dropped plans give their pages back.
        self._lru: GroupLRU[Hashable, Hashable, tuple[int, ...]] = GroupLRU(
            self.num_pages, on_drop=lambda key, pages: self._free.extend(pages))
        self.num_pressure_skips = 0

    @property
    def enabled(self) -> bool:
        return self.num_pages > 0

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_evicted_groups(self) -> int:
        return self._lru.num_evicted_groups

    def group_order(self) -> list[Hashable]:
        """Stored groups, next victim first."""
        return self._lru.group_keys()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._lru

    # -- bookkeeping verbs
    def lookup(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """The subset of `keys` stored here, in order; a hit refreshes the recency of its groups."""
        return list(self._lru.lookup(keys))

    def touch(self, group_key: Hashable) -> bool:
        """Refresh a stored group's recency; False if it is not stored."""
        return self._lru.touch(group_key)

    def evict(self) -> Hashable:
        """Drop the least recently used group; plans no other group lists give their pages back."""
        return self._lru.evict()

    def invalidate(self) -> None:
        """Forget every plan. Copies already queued on the tier stream finish into pages nobody reads."""
        self._lru.invalidate()

    # -- copies
    def store_group(self, group_key: Hashable, plans: Sequence[tuple[Hashable, Sequence[int]]],
                    slab: PlanSlab, compute: Stream) -> StoreResult:
        """Make `group_key` (the request's distinct plans as `(key, slab rows)`) resident here.

        Plans already stored only gain a reference; the rest are copied D2H from their slab rows, which must
        be fully written (the rows' writers were issued on `compute` before this call).
        """
        result = StoreResult()
        if not self.enabled:
            return result
        if self.touch(group_key):
            return result
        rows_of = dict(plans)
        new = {key: len(rows) for key, rows in plans if key not in self._lru}
        evicted_before = self.num_evicted_groups
        # Plans the group shares with stored groups only gain a reference (taken before anything is evicted);
        # the new ones get pages from the free list once room is made.
        if not self._lru.admit(group_key, {key: len(rows) for key, rows in plans},
                               lambda key: tuple(self._free.pop() for _ in rows_of[key])):
            self.num_pressure_skips += 1
            result.skipped = True
            return result
        result.evicted_groups = self.num_evicted_groups - evicted_before
        if new:
            # The D2H reads slab rows the compute stream wrote (rebuild GEMMs or an earlier H2D's fence);
            # without this wait it could copy stale rows into the pages.
            self._stream.wait_stream(compute)
            with self._gpu.use_stream(self._stream):
                for key in new:
                    for page, row in zip(self._lru.get(key), rows_of[key]):
                        self._gpu.copy_(self._page_blocks(page), slab.blocks[:, row])
                        self._gpu.copy_(self.pages[page, self.block_numel:], slab.final[row])
                self._last_d2h = self._stream.record_event()
        result.stored_plans = len(new)
        return result

    def load(self, plans: Sequence[tuple[Hashable, Sequence[int]]], slab: PlanSlab, compute: Stream) -> int:
        """H2D stored plans into their slab rows; `compute` waits for the copies. Returns bytes copied."""
        if not plans:
            return 0
        # The slots being filled may have held other plans whose forwards are still queued on the compute
        # stream (released requests); without this wait the H2D overwrites rows those kernels still read.
        self._stream.wait_stream(compute)
        num_pages = 0
        with self._gpu.use_stream(self._stream):
            for key, rows in plans:
                pages = self._lru.get(key)
                if len(pages) != len(rows):
                    raise RuntimeError(f"plan {key!r} has {len(pages)} pages but {len(rows)} slab rows")
                for page, row in zip(pages, rows):
                    self._gpu.copy_(slab.blocks[:, row], self._page_blocks(page))
                    self._gpu.copy_(slab.final[row], self.pages[page, self.block_numel:])
                num_pages += len(pages)
            loaded = self._stream.record_event()
        # The forward reads these rows on the compute stream; without this wait it could read them
        # before the H2D lands (stale or half-copied modulation).
        compute.wait_event(loaded)
        return num_pages * self.page_bytes

    def fence_slab_writes(self, compute: Stream) -> None:
        """Make later slab writes on `compute` wait for the last D2H: it may still be reading a slot that
        was released since and is about to be overwritten by a rebuild (the pages would get new rows)."""
        if self._last_d2h is not None:
            compute.wait_event(self._last_d2h)

    def synchronize(self) -> None:
        """Block until every queued copy finished (before freeing the pages or timing)."""
        if self._stream is not None:
            self._stream.synchronize()

    def _page_blocks(self, page: int) -> torch.Tensor:
        return self.pages[page, : self.block_numel].view(self.num_blocks, self.adaln_width)

    def check(self) -> None:
        """Assert the invariants in the class docstring."""
        self._lru.check()
        held = [page for key in self._lru.keys() for page in self._lru.get(key)]
        assert len(self._free) + len(held) == self.num_pages, "free + held pages != num_pages"
        assert len(set(self._free) | set(held)) == self.num_pages, "a page is free twice, or free and held"
