"""engine.served.ServedSchedules: which schedules the slab holds whole, the slab's next victims last."""

from __future__ import annotations

import pytest

from engine.api import NO_SLAB, SlabState
from engine.served import ServedSchedules


class FakeSlab:
    """A SlabHolder: the plan keys resident; `evictable` in eviction order (the rest are in use)."""

    def __init__(self, resident, capacity_plans=8, num_free_plans=2, evictable=()):
        self.resident = set(resident)
        self.evictable = list(evictable)
        self.capacity_plans = capacity_plans
        self.num_free_plans = num_free_plans

    def holds(self, keys):
        return all(key in self.resident for key in keys)

    def eviction_order(self):
        return self.evictable


def test_reports_schedules_with_every_plan_resident_most_recent_first():
    served = ServedSchedules()
    served.served("s1", ["p0", "p1"])
    served.served("s2", ["p0", "p2", "p3"])  # shares p0 with s1
    served.served("s3", ["p4"])
    served.served("s1", ["p0", "p1"])  # served again: most recent
    slab = FakeSlab({"p0", "p1", "p2", "p3"})  # p4 was evicted: s3 is not whole
    assert served.slab_state(slab) == SlabState(("s1", "s2"), (2, 3), capacity_plans=8, free_plans=2)


def test_a_weight_update_leaves_nothing_resident_until_served_again():
    served = ServedSchedules()
    served.served("s1", [("p0", "v1")])
    slab = FakeSlab({("p0", "v2")})  # plan keys carry the weights version
    assert served.slab_state(slab).schedule_keys == ()
    served.served("s1", [("p0", "v2")])
    assert served.slab_state(slab).schedule_keys == ("s1",)


def test_remembers_a_bounded_number_of_schedules_and_no_cache_means_no_slab():
    served = ServedSchedules(capacity=2)
    for key in ("a", "b", "c"):
        served.served(key, [key])
    assert served.slab_state(FakeSlab({"a", "b", "c"})).schedule_keys == ("c", "b")
    assert served.slab_state(None) is NO_SLAB
    with pytest.raises(ValueError, match="capacity"):
        ServedSchedules(capacity=0)
    with pytest.raises(ValueError, match="one plan count per schedule key"):
        SlabState(("a",), ())


def test_schedules_are_ordered_by_the_slab_eviction_order_next_victims_last():
    served = ServedSchedules()
    served.served("hot", ["h0", "h1"])
    served.served("once", ["o0", "o1"])
    served.served("busy", ["b0"])
    # The slab evicts "once" first (probation), then "hot"; "busy" is in use. "hot" goes with h1, its plan
    # nearest the eviction end, even though "once" was served after it.
    slab = FakeSlab({"h0", "h1", "o0", "o1", "b0"}, evictable=["o1", "h1", "o0", "h0"])
    assert served.slab_state(slab).schedule_keys == ("busy", "hot", "once")
