"""Which schedules the GPU plan slab holds whole: the engine's report to the router.

The plan cache knows plans, not schedules. `ServedSchedules` remembers, for the schedules this engine served
most recently, which plan keys each one needed; `slab_state` asks the plan cache which of those schedules
still have every plan resident, and orders them by the slab's eviction order (the schedules it would evict
next come last: the router reads the tail of the list as what a new schedule would cost). Plan keys carry the
weights version, so after a weight update no remembered schedule is resident until it is served again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Hashable, Protocol, Sequence

from engine.api import NO_SLAB, SlabState

#: Schedules remembered; a slab holds a few (adaln.gpu_plans / plans per schedule), so this is plenty.
MAX_REMEMBERED_SCHEDULES = 256


class SlabHolder(Protocol):
    """What `slab_state` asks of the plan cache (`cache.plan_cache.PlanCache`)."""

    @property
    def capacity_plans(self) -> int: ...

    @property
    def num_free_plans(self) -> int: ...

    def holds(self, keys: Sequence[Hashable]) -> bool: ...

    def eviction_order(self) -> list[Hashable]:
        """Keys of the evictable plans, next victim first (plans in use are not evictable)."""


class ServedSchedules:
    """Bounded LRU of schedule key -> the plan keys it needed (thread-safe: written by the engine thread, read
    by the replica's routing-stats report)."""

    def __init__(self, capacity: int = MAX_REMEMBERED_SCHEDULES):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._plans: OrderedDict[str, tuple[Hashable, ...]] = OrderedDict()  # least recently served first

    def served(self, schedule_key: str, plan_keys: Sequence[Hashable]) -> None:
        """Record that a request of `schedule_key` had `plan_keys` resident (after its prepare)."""
        with self._lock:
            self._plans[schedule_key] = tuple(plan_keys)
            self._plans.move_to_end(schedule_key)
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)

    def slab_state(self, cache: SlabHolder | None) -> SlabState:
        """The remembered schedules whose plans are all in `cache`'s slab now, the slab's next victims last: a
        schedule goes when its first plan does, so schedules are ordered by their plan nearest the eviction end
        (plans in use last of all), ties most recently served first."""
        if cache is None:
            return NO_SLAB
        with self._lock:
            remembered = list(reversed(self._plans.items()))
        order = cache.eviction_order()
        rank = {key: i for i, key in enumerate(order)}  # position from the eviction end; in use: len(order)
        resident = [(key, len(plans), min(rank.get(p, len(order)) for p in plans))
                    for key, plans in remembered if plans and cache.holds(plans)]
        resident.sort(key=lambda entry: -entry[2])  # stable: ties keep the most recently served first
        return SlabState(
            schedule_keys=tuple(key for key, _, _ in resident),
            schedule_plans=tuple(n for _, n, _ in resident),
            capacity_plans=cache.capacity_plans,
            free_plans=cache.num_free_plans,
        )
