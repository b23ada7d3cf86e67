"""The schedule-affinity routers living in this process and their counters, for the ingress's metrics.

A module of its own: Serve ships the router's module by value (cloudpickle), so globals there are copies in
every process; this one is imported by reference, so every router of a process registers in the same set.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol


@dataclass
class AffinityCounters:
    """Per-router counts of routed requests (this process only)."""

    hits: int = 0  # keyed request sent where its plans are expected warm (a slab holding it; else its first choice)
    spills: int = 0  # keyed request sent elsewhere (a replica not holding it, or its holder was over the bound)
    unkeyed: int = 0  # request without a schedule key

    def as_dict(self) -> Dict[str, int]:
        return {"hits": self.hits, "spills": self.spills, "unkeyed": self.unkeyed}


class CountingRouter(Protocol):
    """What the registry asks of a router."""

    counters: AffinityCounters

    @property
    def deployment_name(self) -> str: ...


_ROUTERS: "weakref.WeakSet[CountingRouter]" = weakref.WeakSet()
_LOCK = threading.Lock()


def register_router(router: CountingRouter) -> None:
    with _LOCK:
        _ROUTERS.add(router)


def affinity_routers(deployment_name: Optional[str] = None) -> List[CountingRouter]:
    """The schedule-affinity routers living in this process (optionally only those routing to a deployment)."""
    with _LOCK:
        routers = list(_ROUTERS)
    return [r for r in routers if deployment_name is None or r.deployment_name == deployment_name]


def schedule_affinity_stats(deployment_name: Optional[str] = None) -> Dict[str, int]:
    """Affinity hits/spills summed over the schedule-affinity routers living in *this* process.

    Call it where the handle lives (e.g. from an ingress replica's stats endpoint); filter by the routed
    deployment's name when given.
    """
    total = AffinityCounters().as_dict()
    for router in affinity_routers(deployment_name):
        for name, value in router.counters.as_dict().items():
            total[name] += value
    return total
