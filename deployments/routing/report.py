"""What a replica reports to the schedule-affinity routers, and how they read it back.

``record_routing_stats()`` returns ``{"ongoing": n, "warm_keys": [...]}``, plus ``"slab"`` (:func:`slab_stats`)
when the replica's GPU plan slab holds something: the schedules whose plans are all resident (most recently used
first, the next victims last), each one's plan count, the keys in flight, the capacity in plans, when, and the
replica's service costs once it has measured them. The router parses it with :meth:`SlabReport.parse`.
``"adapters"``: ``{"held": [...], "at": t}``, the LoRA adapters the replica holds or is loading and those of its
requests in flight (sorted names), and when (:func:`adapter_stats`, :meth:`AdapterReport.parse`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

from deployments.routing.policy import ServiceCosts, SlabView
from engine.api import SlabState

ROUTING_STATS_ONGOING = "ongoing"
ROUTING_STATS_WARM_KEYS = "warm_keys"
ROUTING_STATS_SLAB = "slab"
ROUTING_STATS_ADAPTERS = "adapters"


def adapter_stats(held: Iterable[str], now: float) -> Dict[str, Any]:
    """The wire form of a replica's adapter report (``record_routing_stats()["adapters"]``)."""
    return {"held": sorted(set(held)), "at": now}


@dataclass(frozen=True)
class AdapterReport:
    """A replica's parsed adapter report (see :func:`adapter_stats`)."""

    held: frozenset[str]
    at: float

    @staticmethod
    def parse(stats: Optional[Mapping[str, Any]]) -> Optional["AdapterReport"]:
        """None when absent or malformed: the router then counts the replica as holding only what it sent it
        lately (a replica that reports none is as good as one holding none: adapters load there on request)."""
        report = (stats or {}).get(ROUTING_STATS_ADAPTERS)
        if not isinstance(report, Mapping):
            return None
        held, at = report.get("held"), report.get("at")
        if not isinstance(held, (list, tuple)) or not all(isinstance(n, str) for n in held):
            return None
        if not isinstance(at, (int, float)) or not math.isfinite(at):
            return None
        return AdapterReport(frozenset(held), float(at))


def parse_costs(slab: Mapping[str, Any]) -> Optional[ServiceCosts]:
    """The costs in a slab report (:func:`slab_stats`); None when absent (not measured yet) or not two finite
    seconds >= 0. The adapter load seconds are optional (None unless one finite value >= 0)."""
    try:
        costs = ServiceCosts(float(slab["generation_s"]), float(slab["miss_s"]))
    except (KeyError, TypeError, ValueError):
        return None
    if not (math.isfinite(costs.generation_s + costs.miss_s) and min(costs.generation_s, costs.miss_s) >= 0):
        return None
    try:
        adapter_load_s = float(slab["adapter_load_s"])
    except (KeyError, TypeError, ValueError):
        return costs
    if not (math.isfinite(adapter_load_s) and adapter_load_s >= 0):
        return costs
    return dataclasses.replace(costs, adapter_load_s=adapter_load_s)


def slab_stats(state: SlabState, ongoing_keys: Sequence[str], now: float,
               costs: Optional[ServiceCosts] = None) -> Dict[str, Any]:
    """The wire form of a replica's slab report (``record_routing_stats()["slab"]``): ``keys`` in flight on the
    replica come first (they will be resident once their plans are prepared), then the resident ones; and the
    replica's service costs once it has measured both."""
    stats: Dict[str, Any] = {
        "keys": list(state.schedule_keys),
        "plans": list(state.schedule_plans),
        "ongoing": list(ongoing_keys),
        "capacity_plans": state.capacity_plans,
        "at": now,
    }
    if costs is not None:
        stats["generation_s"], stats["miss_s"] = costs.generation_s, costs.miss_s
        if costs.adapter_load_s is not None:
            stats["adapter_load_s"] = costs.adapter_load_s
    return stats


@dataclass(frozen=True)
class SlabReport:
    """A replica's parsed slab report (see :func:`slab_stats`)."""

    keys: Tuple[str, ...]
    plans: Tuple[int, ...]
    ongoing: Tuple[str, ...]
    capacity_plans: int
    at: float
    costs: Optional[ServiceCosts] = None

    @staticmethod
    def parse(stats: Optional[Mapping[str, Any]]) -> Optional["SlabReport"]:
        """None when the replica reports no slab (resident AdaLN, an empty slab) or something malformed: the router
        then ranks by rendezvous hashing, which needs no report."""
        slab = (stats or {}).get(ROUTING_STATS_SLAB)
        if not isinstance(slab, Mapping):
            return None
        try:
            report = SlabReport(
                keys=tuple(str(k) for k in slab["keys"]), plans=tuple(int(n) for n in slab["plans"]),
                ongoing=tuple(str(k) for k in slab["ongoing"]),
                capacity_plans=int(slab["capacity_plans"]), at=float(slab["at"]),
            )
        except (KeyError, TypeError, ValueError):
            return None
        if report.capacity_plans <= 0 or len(report.keys) != len(report.plans):
            return None
        return dataclasses.replace(report, costs=parse_costs(slab))

    def view(self, sent_since: Sequence[str], plans_of: Callable[[str], int]) -> SlabView:
        """The slab as it will be once the replica has prepared what it has in flight and what this router sent
        it since the report (``sent_since``), each in arrival order (oldest first: a replica serves them in turn)."""
        view = SlabView(self.keys, self.plans, self.capacity_plans)
        for key in (*self.ongoing, *sent_since):
            view = view.with_served(key, plans_of(key))
        return view
