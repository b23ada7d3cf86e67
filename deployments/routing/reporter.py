"""Replica side of schedule-affinity routing: what the worker deployment reports through
``record_routing_stats()`` (wire form: ``deployments.routing.report``)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional

from deployments.moving_mean import moving_mean
from deployments.routing.policy import ServiceCosts
from deployments.routing.report import (
    ROUTING_STATS_ADAPTERS,
    ROUTING_STATS_ONGOING,
    ROUTING_STATS_SLAB,
    ROUTING_STATS_WARM_KEYS,
    adapter_stats,
    slab_stats,
)
from engine.api import SlabState


@dataclass
class _ReporterState:
    lock: threading.Lock = field(default_factory=threading.Lock)
    ongoing: int = 0
    ongoing_keys: Counter = field(default_factory=Counter)  # schedule key -> requests in flight
    ongoing_adapters: Counter = field(default_factory=Counter)  # adapter name -> requests in flight naming it
    recent: "OrderedDict[str, None]" = field(default_factory=OrderedDict)
    generation_s: Optional[float] = None  # moving means of record_service
    miss_s: Optional[float] = None
    adapter_load_s: Optional[float] = None


class ScheduleAffinityReporter:
    """Mixin for a deployment routed by ``ScheduleAffinityRouter``.

    Wrap each request in ``with self.track_schedule(schedule_key):``; the mixin counts ongoing requests and
    remembers recently served keys (most recent first). Serve calls :meth:`record_routing_stats` every
    ``request_routing_stats_period_s``; the router reads ``{"ongoing": n, "warm_keys": [...]}`` from it, and
    ``"slab"`` when :meth:`slab_state` says what the replica's GPU plan slab holds: override it (the Serve worker
    returns its engine's) and the router ranks replicas by slab contents. ``"adapters"``: what
    :meth:`held_adapters` says (override it: the worker returns its engine's) and the adapters of the requests in
    flight (``track_schedule(key, adapters)``). No ``__init__`` needed: state is created lazily.
    """

    max_reported_warm_keys: int = 256

    def _affinity_state(self) -> _ReporterState:
        state = self.__dict__.get("_schedule_affinity_state")
        if state is None:
            state = _ReporterState()
            self.__dict__["_schedule_affinity_state"] = state
        return state

    @contextlib.contextmanager
    def track_schedule(self, schedule_key: Optional[str], adapters: Iterable[str] = ()) -> Iterator[None]:
        """Count one ongoing request for the duration of the block; mark ``schedule_key`` recently served;
        report ``adapters`` (the request's) held meanwhile (the engine installs them before its first forward)."""
        state = self._affinity_state()
        adapters = tuple(adapters)
        with state.lock:
            state.ongoing += 1
            state.ongoing_adapters.update(adapters)
            if schedule_key:
                state.ongoing_keys[schedule_key] += 1
        try:
            yield
        finally:
            with state.lock:
                state.ongoing -= 1
                state.ongoing_adapters.subtract(adapters)
                state.ongoing_adapters += Counter()  # drops the names no request in flight names
                if schedule_key:
                    state.ongoing_keys[schedule_key] -= 1
                    if not state.ongoing_keys[schedule_key]:
                        del state.ongoing_keys[schedule_key]
                    state.recent[schedule_key] = None
                    state.recent.move_to_end(schedule_key, last=False)
                    while len(state.recent) > self.max_reported_warm_keys:
                        state.recent.popitem(last=True)

    def record_service(self, generation_s: float, plans_s: float, missed_slab: bool,
                       adapter_load_s: Optional[float] = None) -> None:
        """One finished generation: the seconds it kept this replica busy and, when its plans were not all in the
        GPU slab, the seconds it spent getting them; ``adapter_load_s``: the seconds it waited for adapters it
        found not held (None: it found them held, or named none). The slab report carries their recent means
        (:class:`ServiceCosts`) once generation and miss are known."""
        state = self._affinity_state()
        with state.lock:
            state.generation_s = moving_mean(state.generation_s, generation_s)
            if missed_slab:
                state.miss_s = moving_mean(state.miss_s, plans_s)
            if adapter_load_s is not None:
                state.adapter_load_s = moving_mean(state.adapter_load_s, adapter_load_s)

    def forget_schedules(self, keys: Optional[Iterable[str]] = None) -> None:
        """Drop keys (all when None) from the recently-served list, e.g. after a weight update."""
        state = self._affinity_state()
        with state.lock:
            if keys is None:
                state.recent.clear()
            else:
                for key in keys:
                    state.recent.pop(key, None)

    def warm_schedule_keys(self) -> List[str]:
        """Keys this replica serves without rebuilding plans, most valuable first. Override for exactness."""
        state = self._affinity_state()
        with state.lock:
            return list(state.recent)

    def held_adapters(self) -> Iterable[str]:
        """The LoRA adapters this replica holds (installed or loading); none by default."""
        return ()

    def slab_state(self) -> Optional[SlabState]:
        """What this replica's GPU plan slab holds; None (the default): no slab report, rendezvous routing."""
        return None

    def record_routing_stats(self) -> Dict[str, Any]:
        state = self._affinity_state()
        with state.lock:
            ongoing = state.ongoing
            ongoing_keys = list(state.ongoing_keys)
            ongoing_adapters = set(state.ongoing_adapters)
            costs = None
            if state.generation_s is not None and state.miss_s is not None:
                costs = ServiceCosts(state.generation_s, state.miss_s, state.adapter_load_s)
        stats: Dict[str, Any] = {
            ROUTING_STATS_ONGOING: ongoing,
            ROUTING_STATS_WARM_KEYS: self.warm_schedule_keys()[: self.max_reported_warm_keys],
            ROUTING_STATS_ADAPTERS: adapter_stats(ongoing_adapters.union(self.held_adapters()), time.time()),
        }
        slab = self.slab_state()
        if slab is not None and slab.capacity_plans > 0:
            stats[ROUTING_STATS_SLAB] = slab_stats(slab, ongoing_keys, time.time(), costs)
        return stats
