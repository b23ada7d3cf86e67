"""Which schedules the GPU plan slab holds whole: the engine's report to the router.

The plan cache knows plans, not schedules. `ServedSchedules` remembers, for the schedules this engine served
most recently, which plan keys each one needed; `slab_state` asks the plan cache which of those schedules
still have every plan resident. Plan keys carry the weights version, so after a weight update no remembered
schedule is resident until it is served again.
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
        """The remembered schedules whose plans are all in `cache`'s slab now, most recently served first."""
        if cache is None:
            return NO_SLAB
        with self._lock:
            remembered = list(reversed(self._plans.items()))
        resident = [(key, len(plans)) for key, plans in remembered if plans and cache.holds(plans)]
        return SlabState(
            schedule_keys=tuple(key for key, _ in resident),
            schedule_plans=tuple(n for _, n in resident),
            capacity_plans=cache.capacity_plans,
            free_plans=cache.num_free_plans,
        )
