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
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

from cache.host_memory import PinOwner, pinned_empty
from cache.slab import PlanSlab
from cache.streams import Event, Stream, Streams

logger = logging.getLogger(__name__)

#: `(shape, dtype, pin_memory) -> Tensor`; tests inject failing allocators to exercise the fallback.
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
        except RuntimeError as e:  # CUDA raises RuntimeError ("out of memory" / "cudaHostAlloc failed")
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
class _HostPlan:
    pages: tuple[int, ...]   # one page per timestep row, in row order
    refcount: int            # number of stored groups listing this plan


@dataclass
class StoreResult:
    stored_plans: int = 0      # plans copied D2H by this store
    evicted_groups: int = 0    # groups evicted to make room
    skipped: bool = False      # the group is larger than the whole tier


class HostTier:
    """Pinned pages of built plans; group LRU; plans shared by groups are refcounted.

    Verbs: `lookup(keys)` (present plans; touches their groups), `touch(group)`, `store_group(...)` (D2H the
    group's plans not yet stored, evicting LRU groups first; a group that cannot fit even in an empty tier
    is skipped and counted), `load(...)` (H2D into slab rows), `evict()` (the LRU group), `invalidate()`.

    Invariants (`check()`): free pages + pages held by plans == num_pages; a plan's refcount equals the
    number of stored groups listing it and is > 0 (a plan no group lists is freed at once); a stored group's
    plans are all present (all or nothing).
    """

    def __init__(self, *, capacity_bytes: int, num_blocks: int, adaln_width: int, final_width: int,
                 dtype: torch.dtype, streams: Streams, allocator: PageAllocator | None = None):
        self.num_blocks, self.adaln_width, self.final_width = num_blocks, adaln_width, final_width
        self.block_numel = num_blocks * adaln_width
        self.page_numel = self.block_numel + final_width
        self.page_bytes = self.page_numel * torch.empty((), dtype=dtype).element_size()
        wanted = max(int(capacity_bytes), 0) // self.page_bytes
        if allocator is None:
            self._pins = PinOwner()

            def allocator(shape, dtype, pin):
                return pinned_empty(shape, dtype, self._pins) if pin else torch.empty(shape, dtype=dtype)
        self.pages, self.pinned = allocate_pages(wanted, self.page_numel, dtype, streams.can_pin, allocator)
        self.num_pages = self.pages.shape[0]
        self._streams = streams
        self._stream: Stream | None = streams.new_stream("host") if self.num_pages else None
        self._last_d2h: Event | None = None
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._plans: dict[Hashable, _HostPlan] = {}
        self._groups: OrderedDict[Hashable, tuple[Hashable, ...]] = OrderedDict()  # LRU first
        self._groups_of: dict[Hashable, set[Hashable]] = {}
        self.num_evicted_groups = 0
        self.num_pressure_skips = 0

    @property
    def enabled(self) -> bool:
        return self.num_pages > 0

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def group_order(self) -> list[Hashable]:
        """Stored groups, next victim first."""
        return list(self._groups)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._plans

    # -- bookkeeping verbs
    def lookup(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """The subset of `keys` stored here, in order; a hit refreshes the recency of its groups."""
        hits = [k for k in keys if k in self._plans]
        for key in hits:
            for group in self._groups_of[key]:
                self._groups.move_to_end(group)
        return hits

    def touch(self, group_key: Hashable) -> bool:
        """Refresh a stored group's recency; False if it is not stored."""
        if group_key not in self._groups:
            return False
        self._groups.move_to_end(group_key)
        return True

    def evict(self) -> Hashable:
        """Drop the least recently used group; plans no other group lists give their pages back."""
        group_key, keys = self._groups.popitem(last=False)
        for key in keys:
            self._groups_of[key].discard(group_key)
            plan = self._plans[key]
            plan.refcount -= 1
            if plan.refcount == 0:
                del self._plans[key], self._groups_of[key]
                self._free.extend(plan.pages)
        self.num_evicted_groups += 1
        return group_key

    def invalidate(self) -> None:
        """Forget every plan. Copies already queued on the tier stream finish into pages nobody reads."""
        self._plans.clear()
        self._groups.clear()
        self._groups_of.clear()
        self._free = list(range(self.num_pages - 1, -1, -1))

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
        if sum(len(rows) for _, rows in plans) > self.num_pages:
            self.num_pressure_skips += 1
            result.skipped = True
            return result
        # Reference the plans this group shares first, so evicting other groups cannot free them.
        new = []
        for key, rows in plans:
            if key in self._plans:
                self._plans[key].refcount += 1
            else:
                new.append((key, rows))
        need = sum(len(rows) for _, rows in new)
        evicted_before = self.num_evicted_groups
        while len(self._free) < need:
            self.evict()  # terminates: the group fits an empty tier, and its shared plans are referenced
        result.evicted_groups = self.num_evicted_groups - evicted_before
        if new:
            # The D2H reads slab rows the compute stream wrote (rebuild GEMMs or an earlier H2D's fence);
            # without this wait it could copy stale rows into the pages.
            self._stream.wait_stream(compute)
            with self._streams.use(self._stream):
                for key, rows in new:
                    pages = tuple(self._free.pop() for _ in rows)
                    for page, row in zip(pages, rows):
                        self._page_blocks(page).copy_(slab.blocks[:, row], non_blocking=True)
                        self.pages[page, self.block_numel:].copy_(slab.final[row], non_blocking=True)
                    self._plans[key] = _HostPlan(pages=pages, refcount=1)
                    self._groups_of[key] = set()
                self._last_d2h = self._stream.record_event()
        for key, _ in plans:
            self._groups_of[key].add(group_key)
        self._groups[group_key] = tuple(key for key, _ in plans)
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
        with self._streams.use(self._stream):
            for key, rows in plans:
                pages = self._plans[key].pages
                if len(pages) != len(rows):
                    raise RuntimeError(f"plan {key!r} has {len(pages)} pages but {len(rows)} slab rows")
                for page, row in zip(pages, rows):
                    slab.blocks[:, row].copy_(self._page_blocks(page), non_blocking=True)
                    slab.final[row].copy_(self.pages[page, self.block_numel:], non_blocking=True)
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
        held = sum(len(p.pages) for p in self._plans.values())
        assert len(self._free) + held == self.num_pages, "free + held pages != num_pages"
        assert len(set(self._free)) == len(self._free), "page on the free list twice"
        counts: dict[Hashable, int] = {}
        for group, keys in self._groups.items():
            for key in keys:
                assert key in self._plans, f"group {group!r} lists missing plan {key!r}"
                assert group in self._groups_of[key]
                counts[key] = counts.get(key, 0) + 1
        for key, plan in self._plans.items():
            assert plan.refcount == counts.get(key, 0) > 0, f"plan {key!r} refcount {plan.refcount}"
