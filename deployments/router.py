"""Schedule-affinity request routing for the GPU worker deployment.

A request's AdaLN plans depend only on its sampling schedule, so sending every request with the same
schedule to the same replica keeps that replica's plan slab warm. The caller names the schedule with a
keyword argument on the handle call::

    worker.generate.remote(request, request_id, schedule_key=request.schedule_key)

and the worker deployment opts in with::

    @serve.deployment(request_router_config=RequestRouterConfig(
        request_router_class=ScheduleAffinityRouter,
        request_router_kwargs={"load_factor": 1.25}))
    class Worker(ScheduleAffinityReporter): ...

Policy when the replicas report their GPU plan slab (``record_routing_stats()["slab"]``: the schedules whose
plans are all resident, each one's plan count, the slab's capacity in plans; see :class:`SlabView`):

- A replica whose slab holds the key (as reported, plus the keys it has in flight and those this router sent it
  since its report) takes the request while its load stays within ``hold_factor`` x the mean (a hit costs
  far less than a rebuild, so a warm replica may queue more than a cold one); the least loaded holder first.
- Otherwise the key is *placed*: among the replicas within the ``load_factor`` bound, the one whose slab loses
  least by taking it: free room first, else the replica whose least recently used schedules (the ones its LRU
  slab would evict) were requested least often lately (this router's window of recent keyed requests). Ties go
  to the lower load, then to rendezvous order. So hot schedules end up spread over the replicas' slabs
  together, cold ones churn where they hurt least, and a hot schedule is copied to a second replica only when
  its holder is over the bound.
- Replicas over every bound come last (stale loads), least loaded first.
- Once replicas report their service costs (a generation's seconds, a slab miss's plan seconds), that order is
  sorted by when the request would start (``ServiceCosts.expected_start_s``: the wait behind a replica's load,
  plus a miss where its slab lacks the key), ties keeping it: on H3 a miss is a few percent of a generation, so a
  hot schedule spreads over idle GPUs instead of queueing on its holder.

With ``placement=True`` (opt-in) a placement computed from the observed request rates comes first
(``deployments.placement``: a disjoint partition of the most requested schedules over the slabs, a schedule
hotter than ``load_factor`` x a replica's share replicated, the tail sent to scratch slots): a request goes to
the replicas the placement names for its key while within ``hold_factor``'s bound, then as above. It is off by
default: in ``bench.routing_sim`` it raised the Zipf hit rate by at most ~0.02 while doubling p99 (the scratch
replica queues rebuilds), and lowered both under uniform load; it still does with the segmented slab
(bench/results/routing-sim-cpu.md: +0.005..0.02 of Belady, uniform p99 1.8x Serve's default router).

The slab report lists a replica's schedules in its eviction order, the next victims last (``engine.served``):
with the segmented slab (``cache.slab.SlotIndex``) those are the schedules on probation, so the eviction cost
of a new key is what it would really displace. ``hold_factor`` defaults to 3: 6 (and the segmented slab) did
better in ``bench.routing_sim`` but not in the real ``bench.routing`` (bench/results/routing-sim-cpu.md, last table).

Policy when they do not (rendezvous hashing with bounded load):

- Every replica gets the weight ``H(schedule_key, replica_unique_id)``; replicas are tried in descending
  weight order. The order is a pure function of the key and the replica set, so every process that holds a
  handle (ingress replicas, proxy, driver) agrees without shared state, and adding or removing a replica moves
  only the keys whose first choice it is / was.
- Bounded load: with ``n`` replicas and ``total`` requests in flight, a replica is within bound when its
  ongoing count plus this request stays ``<= ceil(load_factor * (total + 1) / n)``. A key whose first choice
  is over the bound spills to the next replica in its rendezvous order (replicas reporting the key warm first),
  so a hot schedule spreads over a stable, small set of replicas.
- Requests without ``schedule_key`` go to the least-loaded replica.

Ongoing counts come from Serve's queue-length cache (the replica's own count in its last reply, plus this
process's sends, minus its completions), plus the choices this router made that Serve has not sent yet; a
replica without a cache entry is probed, and ``record_routing_stats()["ongoing"]`` is the last resort. A spill
away from a key's first choice is confirmed with a fresh probe of both first (see :class:`ScheduleAffinityRouter`).

The router runs inside every process holding a handle to the worker; nothing here blocks the event loop.
Serve ships the router class to those processes by value (cloudpickle), so module-level state is not shared
with them: see ``_register_router``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import random
import statistics
import threading
import weakref
import time
from collections import Counter, OrderedDict, deque
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from deployments.placement import Placement, plan_placement, rendezvous_weight
from engine.api import SlabState

logger = logging.getLogger("ray.serve")

SCHEDULE_KEY_KWARG = "schedule_key"
"""Keyword argument of the handle call that carries the schedule key."""

DEFAULT_LOAD_FACTOR = 1.25
DEFAULT_HOLD_FACTOR = 3.0
DEFAULT_SPILL_CONFIRM_S = 0.01
DEFAULT_POPULARITY_WINDOW = 1000
DEFAULT_MISS_COST = 1.5
#: Keyed requests routed between two placements (a placement costs ~0.1 ms for tens of schedules).
REPLAN_EVERY = 20
ROUTING_STATS_ONGOING = "ongoing"
ROUTING_STATS_WARM_KEYS = "warm_keys"
ROUTING_STATS_SLAB = "slab"
#: A key this router sent to a replica counts as resident there unless the replica's report is this much newer
#: (the report cannot show a request that had not reached the replica yet).
SENT_GRACE_S = 0.5
SENT_MEMORY_S = 60.0
MAX_SENT_REMEMBERED = 256


# ---------------------------------------------------------------------------------------------------------
# Pure policy functions (no Ray): unit-testable, identical in every process.
# ---------------------------------------------------------------------------------------------------------


def rendezvous_order(key: str, replica_ids: Iterable[str]) -> List[str]:
    """Replica ids ordered by preference for ``key``: highest weight first (ties broken by id)."""
    return sorted(replica_ids, key=lambda rid: (-rendezvous_weight(key, rid), rid))


def bounded_load_limit(total_ongoing: int, num_replicas: int, load_factor: float) -> int:
    """Most requests one replica may hold after taking a new one: ceil(load_factor * mean incl. the new one)."""
    if num_replicas <= 0:
        return 0
    return math.ceil(load_factor * (total_ongoing + 1) / num_replicas)


def rank_for_key(
    key: str,
    loads: Mapping[str, int],
    load_factor: float = DEFAULT_LOAD_FACTOR,
    warm: Optional[Mapping[str, bool]] = None,
) -> List[str]:
    """Replica ids in the order to try for ``key``.

    ``loads`` maps every candidate replica id to its ongoing request count. The rendezvous first choice comes
    first if it is within the bounded-load limit; then the other replicas within the limit (those with
    ``warm[rid]`` true first, each group in rendezvous order); replicas over the limit come last, in
    rendezvous order, as a fallback for stale load information.
    """
    order = rendezvous_order(key, loads)
    if not order:
        return []
    limit = bounded_load_limit(sum(loads.values()), len(order), load_factor)
    within = [rid for rid in order if loads[rid] + 1 <= limit]
    over = [rid for rid in order if loads[rid] + 1 > limit]
    if within and within[0] == order[0]:
        head, rest = within[:1], within[1:]
    else:
        head, rest = [], within
    if warm:
        rest = [rid for rid in rest if warm.get(rid)] + [rid for rid in rest if not warm.get(rid)]
    return head + rest + over


@dataclass(frozen=True)
class ServiceCosts:
    """The replicas' recent means: seconds one generation keeps a replica busy, and seconds a request that missed
    the GPU slab spent getting its plans (rebuild, pool or host tier)."""

    generation_s: float
    miss_s: float

    @staticmethod
    def parse(slab: Mapping[str, Any]) -> Optional["ServiceCosts"]:
        """The costs in a slab report (:func:`slab_stats`); None when absent or not two finite seconds >= 0."""
        try:
            costs = ServiceCosts(float(slab["generation_s"]), float(slab["miss_s"]))
        except (KeyError, TypeError, ValueError):
            return None
        if not (math.isfinite(costs.generation_s + costs.miss_s) and min(costs.generation_s, costs.miss_s) >= 0):
            return None
        return costs

    def expected_start_s(self, load: int, holds_key: bool) -> float:
        """When a request sent now would have its plans on a replica with ``load`` requests: behind them it waits
        about ``load - 1/2`` generations (the running one is half done on average), then a replica whose slab does
        not hold the key gets its plans (a miss). On H3 a 20-step generation is ~4.3 s and a miss ~0.25 s (a pool
        hit ~0.05 s), so an idle GPU beats any queue; where a miss costs several generations, holders win."""
        return max(load - 0.5, 0.0) * self.generation_s + (0.0 if holds_key else self.miss_s)


@dataclass(frozen=True)
class SlabView:
    """What one replica's GPU plan slab holds, as the router sees it: schedule keys, most recently used first
    (the last ones are what its LRU slab evicts next), each one's plan count, and the capacity in plans."""

    keys: Tuple[str, ...]
    plans: Tuple[int, ...]
    capacity_plans: int

    def holds(self, key: str) -> bool:
        return key in self.keys

    @property
    def free_plans(self) -> int:
        return self.capacity_plans - sum(self.plans)

    def with_served(self, key: str, num_plans: int) -> "SlabView":
        """The view after serving ``key``: it becomes the most recent; least recent keys go until it fits."""
        keys, plans = [key], [num_plans]
        used = num_plans
        for k, n in zip(self.keys, self.plans):
            if k != key and used + n <= self.capacity_plans:
                keys.append(k)
                plans.append(n)
                used += n
            elif k != key:
                break  # LRU order: everything after the first key that no longer fits is evicted too
        return SlabView(tuple(keys), tuple(plans), self.capacity_plans)

    def eviction_cost(self, num_plans: int, popularity: Callable[[str], float]) -> float:
        """How much taking a new schedule of ``num_plans`` plans hurts: 0 with room to spare, else the summed
        popularity of the least recently used schedules that would be evicted to make room."""
        missing = num_plans - self.free_plans
        cost = 0.0
        for k, n in zip(reversed(self.keys), reversed(self.plans)):
            if missing <= 0:
                break
            cost += popularity(k)
            missing -= n
        return cost


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
        """None when the replica reports no slab (an older worker, resident AdaLN) or something malformed."""
        slab = (stats or {}).get(ROUTING_STATS_SLAB)
        if not isinstance(slab, Mapping):
            return None
        try:
            report = SlabReport(
                keys=tuple(str(k) for k in slab["keys"]), plans=tuple(int(n) for n in slab["plans"]),
                ongoing=tuple(str(k) for k in slab.get("ongoing", ())),
                capacity_plans=int(slab["capacity_plans"]), at=float(slab["at"]),
            )
        except (KeyError, TypeError, ValueError):
            return None
        if report.capacity_plans <= 0 or len(report.keys) != len(report.plans):
            return None
        return dataclasses.replace(report, costs=ServiceCosts.parse(slab))

    def view(self, sent_since: Sequence[str], plans_of: Callable[[str], int]) -> SlabView:
        """The slab as it will be once the replica has prepared what it has in flight and what this router sent
        it since the report (``sent_since``), each in arrival order (oldest first: a replica serves them in turn)."""
        view = SlabView(self.keys, self.plans, self.capacity_plans)
        for key in (*self.ongoing, *sent_since):
            view = view.with_served(key, plans_of(key))
        return view


class KeyPopularity:
    """How often each key was asked for among the last ``window`` keyed requests this router routed."""

    def __init__(self, window: int = DEFAULT_POPULARITY_WINDOW):
        self.window = window
        self._recent: Deque[str] = deque()
        self._counts: Counter = Counter()

    def record(self, key: str) -> None:
        self._recent.append(key)
        self._counts[key] += 1
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]

    def count(self, key: str) -> int:
        return self._counts.get(key, 0)

    def counts(self) -> Dict[str, int]:
        """Every key's count in the window (a copy)."""
        return dict(self._counts)


def rank_for_slab_key(
    key: str,
    loads: Mapping[str, int],
    views: Mapping[str, SlabView],
    num_plans: int,
    popularity: Callable[[str], float],
    load_factor: float = DEFAULT_LOAD_FACTOR,
    hold_factor: float = DEFAULT_HOLD_FACTOR,
    costs: Optional[ServiceCosts] = None,
) -> List[str]:
    """Replica ids in the order to try for ``key`` when every candidate reports its slab (``views``).

    Holders of ``key`` within ``hold_factor``'s bound first (least loaded first); then the other replicas within
    ``load_factor``'s bound by the harm of placing ``num_plans`` plans there (``SlabView.eviction_cost``), then
    load; the rest last, least loaded first. Ties keep rendezvous order, so every router agrees on a cold start.
    With ``costs`` (the replicas report them) that order is then sorted by when the request would start
    (``ServiceCosts.expected_start_s``: the wait behind the replica's load, plus a miss where its slab lacks the
    key), ties keeping it: a hot schedule spreads over idle GPUs instead of queueing where misses are cheap (H3),
    and stays on its holders where they are not.
    """
    order = rendezvous_order(key, loads)
    if not order:
        return []
    total = sum(loads.values())
    hold_limit = bounded_load_limit(total, len(order), max(hold_factor, load_factor))
    limit = bounded_load_limit(total, len(order), load_factor)
    holders = sorted((rid for rid in order if views[rid].holds(key) and loads[rid] + 1 <= hold_limit),
                     key=loads.__getitem__)
    taken = set(holders)
    within = sorted((rid for rid in order if rid not in taken and loads[rid] + 1 <= limit),
                    key=lambda rid: (views[rid].eviction_cost(num_plans, popularity), loads[rid]))
    taken.update(within)
    rest = sorted((rid for rid in order if rid not in taken), key=loads.__getitem__)
    ranked = holders + within + rest
    if costs is not None:  # a stable sort: equal starts keep the order above (holders, eviction harm, load)
        ranked.sort(key=lambda rid: costs.expected_start_s(loads[rid], views[rid].holds(key)))
    return ranked


def rank_for_placed_key(
    key: str,
    loads: Mapping[str, int],
    views: Mapping[str, SlabView],
    placement: Placement,
    num_plans: int,
    popularity: Callable[[str], float],
    load_factor: float = DEFAULT_LOAD_FACTOR,
    hold_factor: float = DEFAULT_HOLD_FACTOR,
) -> List[str]:
    """Replica ids in the order to try for ``key`` under ``placement`` (see ``deployments.placement``).

    The replicas the placement names for ``key`` come first while within ``hold_factor``'s bound (least loaded
    first, a holder before a replica still to build the plans); then other replicas whose slab holds ``key``,
    within the same bound (a hit while the placement moves); the rest as :func:`rank_for_slab_key` orders them
    (within ``load_factor``'s bound by the harm of placing it, then least loaded). A key the placement names
    nobody for is ranked by :func:`rank_for_slab_key` alone.
    """
    targets = [rid for rid in placement.replicas_for(key) if rid in loads]
    fallback = rank_for_slab_key(key, loads, views, num_plans, popularity, load_factor, hold_factor)
    if not targets:
        return fallback
    hold_limit = bounded_load_limit(sum(loads.values()), len(loads), max(hold_factor, load_factor))
    head = sorted((rid for rid in targets if loads[rid] + 1 <= hold_limit),
                  key=lambda rid: (loads[rid], not views[rid].holds(key)))
    warm = [rid for rid in fallback if rid not in head and views[rid].holds(key) and loads[rid] + 1 <= hold_limit]
    first = head + warm
    return first + [rid for rid in fallback if rid not in first]


# ---------------------------------------------------------------------------------------------------------
# Replica side: what the worker deployment reports through record_routing_stats().
# ---------------------------------------------------------------------------------------------------------


class ScheduleAffinityReporter:
    """Mixin for a deployment routed by :class:`ScheduleAffinityRouter`.

    Wrap each request in ``with self.track_schedule(schedule_key):``; the mixin counts ongoing requests and
    remembers recently served keys (most recent first). Serve calls :meth:`record_routing_stats` every
    ``request_routing_stats_period_s``; the router reads ``{"ongoing": n, "warm_keys": [...]}`` from it, and
    ``"slab"`` (:func:`slab_stats`) when :meth:`slab_state` says what the replica's GPU plan slab holds:
    override it (the Serve worker returns its engine's) and the router places schedules by slab contents.
    No ``__init__`` needed: state is created lazily.
    """

    max_reported_warm_keys: int = 256

    def _affinity_state(self) -> "_ReporterState":
        state = self.__dict__.get("_schedule_affinity_state")
        if state is None:
            state = _ReporterState()
            self.__dict__["_schedule_affinity_state"] = state
        return state

    @contextlib.contextmanager
    def track_schedule(self, schedule_key: Optional[str]) -> Iterator[None]:
        """Count one ongoing request for the duration of the block; mark ``schedule_key`` recently served."""
        state = self._affinity_state()
        with state.lock:
            state.ongoing += 1
            if schedule_key:
                state.ongoing_keys[schedule_key] += 1
        try:
            yield
        finally:
            with state.lock:
                state.ongoing -= 1
                if schedule_key:
                    state.ongoing_keys[schedule_key] -= 1
                    if not state.ongoing_keys[schedule_key]:
                        del state.ongoing_keys[schedule_key]
                    state.recent[schedule_key] = None
                    state.recent.move_to_end(schedule_key, last=False)
                    while len(state.recent) > self.max_reported_warm_keys:
                        state.recent.popitem(last=True)

    def record_service(self, generation_s: float, plans_s: float, missed_slab: bool) -> None:
        """One finished generation: the seconds it kept this replica busy and, when its plans were not all in the
        GPU slab, the seconds it spent getting them. The slab report carries their recent means
        (:class:`ServiceCosts`) once both are known."""
        state = self._affinity_state()
        with state.lock:
            state.generation_s = moving_mean(state.generation_s, generation_s)
            if missed_slab:
                state.miss_s = moving_mean(state.miss_s, plans_s)

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

    def slab_state(self) -> Optional[SlabState]:
        """What this replica's GPU plan slab holds; None (the default): no slab report, rendezvous routing."""
        return None

    def record_routing_stats(self) -> Dict[str, Any]:
        state = self._affinity_state()
        with state.lock:
            ongoing = state.ongoing
            ongoing_keys = list(state.ongoing_keys)
            costs = None
            if state.generation_s is not None and state.miss_s is not None:
                costs = ServiceCosts(state.generation_s, state.miss_s)
        stats: Dict[str, Any] = {
            ROUTING_STATS_ONGOING: ongoing,
            ROUTING_STATS_WARM_KEYS: self.warm_schedule_keys()[: self.max_reported_warm_keys],
        }
        slab = self.slab_state()
        if slab is not None and slab.capacity_plans > 0:
            stats[ROUTING_STATS_SLAB] = slab_stats(slab, ongoing_keys, time.time(), costs)
        return stats


@dataclass
class _ReporterState:
    lock: threading.Lock = field(default_factory=threading.Lock)
    ongoing: int = 0
    ongoing_keys: Counter = field(default_factory=Counter)  # schedule key -> requests in flight
    recent: "OrderedDict[str, None]" = field(default_factory=OrderedDict)
    generation_s: Optional[float] = None  # moving means of record_service
    miss_s: Optional[float] = None


#: Weight of the newest sample in a running mean of generation times (about the last ten count).
MOVING_MEAN_WEIGHT = 0.2


def moving_mean(mean: Optional[float], sample: float) -> float:
    """The running mean after `sample` (the first sample starts it): service costs here, Retry-After in the
    ingress."""
    return sample if mean is None else mean + MOVING_MEAN_WEIGHT * (sample - mean)


# ---------------------------------------------------------------------------------------------------------
# The router.
# ---------------------------------------------------------------------------------------------------------


@dataclass
class AffinityCounters:
    """Per-router counts of routed requests (this process only)."""

    hits: int = 0  # keyed request sent where its plans are expected warm (a slab holding it; else its rendezvous first choice)
    spills: int = 0  # keyed request sent elsewhere (placed on a new replica, or its holder was over the bound)
    unkeyed: int = 0  # request without a schedule key

    def as_dict(self) -> Dict[str, int]:
        return {"hits": self.hits, "spills": self.spills, "unkeyed": self.unkeyed}


# Routers living in this process, for schedule_affinity_stats(). Serve pickles the router class *by value*
# (it registers this module with cloudpickle.register_pickle_by_value), so the class's methods see copies of
# this module's globals; they reach the real registry through importlib (_register_router) instead.
_MODULE_NAME = __name__
_ROUTER_REGISTRY: "weakref.WeakSet[Any]" = weakref.WeakSet()
_ROUTER_REGISTRY_LOCK = threading.Lock()


def _register_router(router: Any) -> None:
    try:
        module = importlib.import_module(_MODULE_NAME)
    except ImportError:  # router shipped by value to a process that cannot import ditserve: no stats
        return
    with module._ROUTER_REGISTRY_LOCK:
        module._ROUTER_REGISTRY.add(router)


def affinity_routers(deployment_name: Optional[str] = None) -> List[Any]:
    """The ScheduleAffinityRouters living in this process (optionally only those routing to a deployment)."""
    with _ROUTER_REGISTRY_LOCK:
        routers = list(_ROUTER_REGISTRY)
    return [r for r in routers if deployment_name is None or r.deployment_name == deployment_name]


def schedule_affinity_stats(deployment_name: Optional[str] = None) -> Dict[str, int]:
    """Affinity hits/spills summed over the ScheduleAffinityRouters living in *this* process.

    Call it where the handle lives (e.g. from an ingress replica's stats endpoint); filter by the routed
    deployment's name when given.
    """
    total = {"hits": 0, "spills": 0, "unkeyed": 0}
    for router in affinity_routers(deployment_name):
        for name, value in router.counters.as_dict().items():
            total[name] += value
    return total


class ScheduleAffinityRouter(RequestRouter):
    """Slab-aware placement of ``schedule_key`` (rendezvous hashing when replicas report no slab) with
    bounded load; least load for requests without a key. The policy is in the module docstring.

    ``request_router_kwargs``: ``load_factor`` (float >= 1, default 1.25; larger keeps affinity longer under
    skew, smaller balances sooner), ``hold_factor`` (float >= 1, default 3; the bound for a replica whose slab
    holds the key), ``spill_confirm_s`` (default 0.01), ``popularity_window`` (keyed requests remembered to
    rank evictions, and the rates placements are computed from; default 1000), ``placement`` (default False:
    see the module docstring), ``miss_cost`` (placement only: a rebuilding request's load in warm requests,
    default 1.5) and ``key_kwarg`` (default ``"schedule_key"``).

    Load of a replica = Serve's queue-length cache for it (the replica's own count from its last reply, plus
    this process's sends, minus this process's completions) + requests this router chose for it that have not
    been sent yet. The second term matters in a burst: Serve's routing task assigns several queued requests
    in one pass of the event loop, before any send updates the cache, so without it they would all see the
    same loads and pile onto one replica. A replica without a cache entry (idle for ~10 s) is probed (one RPC,
    ``get_queue_len``); if that fails its ``record_routing_stats()["ongoing"]`` is used.

    The cache can run high: a completion reaches it a little after the caller got the result, and another
    process's finished requests stay in it until the next reply. A spill costs the target a plan rebuild, so
    before spilling away from a key's first choice the router waits ``spill_confirm_s`` (default 10 ms) and
    re-probes that replica: a back-to-back request for the same schedule stays on its warm replica. It can also run
    low (another process's sends), so the spill's target is probed with it.

    Each call returns exactly one replica (a single tier), so what Serve sends is what we counted; replicas
    Serve knows to be full are skipped, and when all are, every replica is offered in our order and Serve
    probes them. Deliberately no FIFOMixin: it hands the replica found for one request to the oldest pending
    request, which would break affinity.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.load_factor = DEFAULT_LOAD_FACTOR
        self.hold_factor = DEFAULT_HOLD_FACTOR
        self.key_kwarg = SCHEDULE_KEY_KWARG
        self.spill_confirm_s = DEFAULT_SPILL_CONFIRM_S
        self.counters = AffinityCounters()
        self.popularity = KeyPopularity()
        self.miss_cost = DEFAULT_MISS_COST
        self.costs: Optional[ServiceCosts] = None  # the replicas' reported means, as of the last slab_views
        self.use_placement = False
        self._placement: Optional[Placement] = None
        self._placement_replicas: frozenset = frozenset()
        self._routed_since_placement = 0
        # replica unique_id -> (key, time.time()) of the keyed requests sent to it lately, oldest first.
        self._sent: Dict[str, Deque[Tuple[str, float]]] = {}
        # schedule key -> its plan count, as last reported by any replica (for keys a slab does not hold).
        self._plans_of_key: Dict[str, int] = {}
        # replica unique_id -> requests chosen for it whose future is not resolved yet (not sent yet).
        self._unsent: Dict[str, int] = {}
        # id(pending_request) -> (its future when chosen, replica unique_id), until sent or undone.
        self._chosen: Dict[int, Any] = {}
        _register_router(self)

    @property
    def deployment_name(self) -> str:
        return self._deployment_id.name

    def initialize_state(
        self,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        key_kwarg: str = SCHEDULE_KEY_KWARG,
        spill_confirm_s: float = DEFAULT_SPILL_CONFIRM_S,
        hold_factor: float = DEFAULT_HOLD_FACTOR,
        popularity_window: int = DEFAULT_POPULARITY_WINDOW,
        miss_cost: float = DEFAULT_MISS_COST,
        placement: bool = False,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ValueError(
                f"ScheduleAffinityRouter got unknown request_router_kwargs {sorted(unknown)}; "
                "accepted: load_factor, hold_factor, key_kwarg, spill_confirm_s, popularity_window, miss_cost, "
                "placement."
            )
        if not isinstance(miss_cost, (int, float)) or miss_cost < 1.0:
            raise ValueError(f"miss_cost={miss_cost!r} must be a number >= 1.0 (a rebuild costs at least a hit).")
        self.miss_cost = float(miss_cost)
        if not isinstance(placement, bool):
            raise ValueError(f"placement={placement!r} must be true or false.")
        self.use_placement = placement
        if not isinstance(hold_factor, (int, float)) or hold_factor < 1.0:
            raise ValueError(f"hold_factor={hold_factor!r} must be a number >= 1.0 (3.0 is a good default).")
        self.hold_factor = float(hold_factor)
        if not isinstance(popularity_window, int) or popularity_window < 1:
            raise ValueError(f"popularity_window={popularity_window!r} must be an integer >= 1.")
        self.popularity = KeyPopularity(popularity_window)
        if not isinstance(spill_confirm_s, (int, float)) or not 0 <= spill_confirm_s <= 1:
            raise ValueError(f"spill_confirm_s={spill_confirm_s!r} must be between 0 and 1 second.")
        self.spill_confirm_s = float(spill_confirm_s)
        if not isinstance(load_factor, (int, float)) or load_factor < 1.0:
            raise ValueError(
                f"load_factor={load_factor!r} must be a number >= 1.0 (1.25 is a good default)."
            )
        self.load_factor = float(load_factor)
        self.key_kwarg = key_kwarg

    # -- load and key extraction ------------------------------------------------------------------------

    def schedule_key_of(self, pending_request: Optional[PendingRequest]) -> Optional[str]:
        if pending_request is None:
            return None
        key = pending_request.kwargs.get(self.key_kwarg)
        if key is None or key == "":
            return None
        return key if isinstance(key, str) else str(key)

    def replica_load(self, replica: RunningReplica) -> int:
        """Best estimate of the replica's ongoing requests, across all processes routing to it."""
        unsent = self._unsent.get(replica.replica_id.unique_id, 0)
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        if cached is not None:
            return cached + unsent
        stats = replica.routing_stats or {}
        reported = stats.get(ROUTING_STATS_ONGOING, 0)
        return (reported if isinstance(reported, int) else 0) + unsent

    async def probe(self, replicas: List[RunningReplica], raise_only: bool = False) -> None:
        """Refresh the queue-length cache of ``replicas`` from the replicas themselves (concurrently).
        ``raise_only``: keep the cached count where it is higher (it has this process's sends that have not reached
        the replica yet)."""
        deadline_s = self.queue_len_response_deadline_s

        async def one(replica: RunningReplica) -> None:
            try:
                queue_len = await asyncio.wait_for(replica.get_queue_len(deadline_s=deadline_s), deadline_s)
            except Exception:  # noqa: BLE001 - no answer: keep the previous estimate
                return
            if raise_only:
                queue_len = max(queue_len, self.replica_queue_len_cache.get(replica.replica_id) or 0)
            self.replica_queue_len_cache.update(replica.replica_id, queue_len)

        await asyncio.gather(*(one(r) for r in replicas))

    def _known_full(self, replica: RunningReplica) -> bool:
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        return cached is not None and cached >= replica.max_ongoing_requests

    @staticmethod
    def _reports_warm(replica: RunningReplica, key: str) -> bool:
        stats = replica.routing_stats or {}
        warm = stats.get(ROUTING_STATS_WARM_KEYS) or ()
        return key in warm

    def slab_views(self, candidate_replicas: List[RunningReplica]) -> Optional[Dict[str, SlabView]]:
        """Every candidate's slab as this router expects it now; None unless every candidate reports one."""
        reports = {r.replica_id.unique_id: SlabReport.parse(r.routing_stats) for r in candidate_replicas}
        if not reports or any(report is None for report in reports.values()):
            return None
        measured = [report.costs for report in reports.values() if report.costs is not None]
        self.costs = ServiceCosts(statistics.fmean(c.generation_s for c in measured),
                                  statistics.fmean(c.miss_s for c in measured)) if measured else None
        views = {}
        for rid, report in reports.items():
            for key, n in zip(report.keys, report.plans):
                self._plans_of_key[key] = n
            since = report.at - SENT_GRACE_S
            sent = [key for key, at in self._sent.get(rid, ()) if at >= since]
            views[rid] = report.view(sent, self._plans_of)
        return views

    def _plans_of(self, key: str) -> int:
        """A key's plan count as last reported; for a key never reported, the largest known (or 1)."""
        known = self._plans_of_key.get(key)
        if known is not None:
            return known
        return max(self._plans_of_key.values(), default=1)

    def rank(self, candidate_replicas: List[RunningReplica], key: Optional[str],
             views: Optional[Dict[str, SlabView]] = None) -> List[RunningReplica]:
        """Candidates in preference order for ``key`` (least loaded first when ``key`` is None). ``views``:
        the candidates' ``slab_views`` (None: no slab reports, rendezvous order)."""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {rid: self.replica_load(r) for rid, r in by_id.items()}
        if key is None:
            ids = list(by_id)
            random.shuffle(ids)  # ties between equally loaded replicas go to a random one
            return [by_id[rid] for rid in sorted(ids, key=loads.__getitem__)]
        if views is not None and self.use_placement:
            ranked = rank_for_placed_key(key, loads, views, self.placement(views), self._plans_of(key),
                                         self.popularity.count, self.load_factor, self.hold_factor)
            return [by_id[rid] for rid in ranked]
        if views is not None:
            ranked = rank_for_slab_key(key, loads, views, self._plans_of(key), self.popularity.count,
                                       self.load_factor, self.hold_factor, self.costs)
            return [by_id[rid] for rid in ranked]
        warm = {rid: self._reports_warm(r, key) for rid, r in by_id.items()}
        return [by_id[rid] for rid in rank_for_key(key, loads, self.load_factor, warm)]

    def placement(self, views: Mapping[str, SlabView]) -> Placement:
        """The current placement over the replicas in ``views``, recomputed every REPLAN_EVERY keyed requests
        and whenever the replica set changes (not per request: the hot path only looks it up)."""
        replicas = frozenset(views)
        if (self._placement is None or replicas != self._placement_replicas
                or self._routed_since_placement >= REPLAN_EVERY):
            self._placement = plan_placement(
                self.popularity.counts(), {rid: v.capacity_plans for rid, v in views.items()}, self._plans_of,
                {rid: set(v.keys) for rid, v in views.items()}, self.load_factor, self.miss_cost)
            self._placement_replicas = replicas
            self._routed_since_placement = 0
        return self._placement

    def preferred(self, candidate_replicas: List[RunningReplica], key: str,
                  views: Optional[Dict[str, SlabView]]) -> List[RunningReplica]:
        """Where ``key`` goes when no replica is loaded: the holders of its plans, else its rendezvous first
        choice. Ranking anything else first is a spill, confirmed with a fresh probe of these."""
        if views is not None:
            # the placement's targets (if placing), else the holders; nobody holds it: a placement, not a spill
            targets = set(self.placement(views).replicas_for(key)) if self.use_placement else set()
            return [r for r in candidate_replicas if r.replica_id.unique_id in targets
                    or views[r.replica_id.unique_id].holds(key)]
        return [max(candidate_replicas, key=lambda r: rendezvous_weight(key, r.replica_id.unique_id))]

    # -- RequestRouter API ---------------------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if pending_request is not None:
            # What we return is all there is; without backoff the retry loop would spin at full speed
            # while every replica is at max_ongoing_requests.
            pending_request.routing_context.should_backoff = True
            self._undo_unused_choice(pending_request)
        if not candidate_replicas:
            return []
        try:
            ranked = await self._rank_fresh(candidate_replicas, self.schedule_key_of(pending_request))
        except Exception:  # noqa: BLE001 - a bug here must not strand the request: fall back to least load
            logger.exception("ScheduleAffinityRouter: ranking failed; offering all replicas")
            return [list(candidate_replicas)]
        choice = next((r for r in ranked if not self._known_full(r)), None)
        if choice is None:
            return [[r] for r in ranked]
        if pending_request is not None:
            self._take(pending_request, choice.replica_id.unique_id)
        return [[choice]]

    async def _rank_fresh(self, candidate_replicas: List[RunningReplica], key: Optional[str]) -> List[RunningReplica]:
        unknown = [r for r in candidate_replicas if self.replica_queue_len_cache.get(r.replica_id) is None]
        if unknown:
            await self.probe(unknown)
        if key is None:
            return self.rank(candidate_replicas, key)
        views = self.slab_views(candidate_replicas)  # parsed once for the ranking and the spill check
        ranked = self.rank(candidate_replicas, key, views)
        if len(ranked) < 2:
            return ranked
        preferred = self.preferred(candidate_replicas, key, views)
        if preferred and ranked[0] not in preferred:
            # About to spill. The numbers may count a request that just finished (the caller can have its
            # result a few ms before the replica and this router stop counting it): give that a moment to
            # settle, ask the replica itself, and decide again (reports and sends may have changed meanwhile).
            # The target too: another process's sends reach this cache only when it next talks to that replica,
            # so one that looks idle (what puts it before a busy holder, ServiceCosts) can be busy.
            if self.spill_confirm_s > 0:
                await asyncio.sleep(self.spill_confirm_s)
            await asyncio.gather(self.probe(preferred), self.probe(ranked[:1], raise_only=True))
            ranked = self.rank(candidate_replicas, key, self.slab_views(candidate_replicas))
        return ranked

    def _take(self, pending_request: PendingRequest, rid: str) -> None:
        self._unsent[rid] = self._unsent.get(rid, 0) + 1
        future = pending_request.future
        self._chosen[id(pending_request)] = (future, rid)
        # Serve's request task wakes on this future first (it awaited it earlier) and sends synchronously,
        # bumping the queue-length cache; this callback runs right after and stops counting the choice.
        future.add_done_callback(lambda f: self._on_resolved(pending_request, f))

    def _on_resolved(self, pending_request: PendingRequest, future: Any) -> None:
        entry = self._chosen.get(id(pending_request))
        if entry is None or entry[0] is not future:
            return  # this choice was undone already
        del self._chosen[id(pending_request)]
        self._release(entry[1])

    def _undo_unused_choice(self, pending_request: PendingRequest) -> None:
        """A second call for the same unsent request: Serve could not use our previous choice."""
        entry = self._chosen.get(id(pending_request))
        if entry is not None and entry[0] is pending_request.future and not entry[0].done():
            del self._chosen[id(pending_request)]
            self._release(entry[1])

    def _release(self, rid: str) -> None:
        left = self._unsent.get(rid, 0) - 1
        if left > 0:
            self._unsent[rid] = left
        else:
            self._unsent.pop(rid, None)

    def on_request_routed(
        self,
        pending_request: PendingRequest,
        replica_id: ReplicaID,
        result: ReplicaResult,
    ) -> None:
        key = self.schedule_key_of(pending_request)
        if key is None:
            self.counters.unkeyed += 1
            return
        rid = replica_id.unique_id
        replicas = list(self.curr_replicas.values())
        views = self.slab_views(replicas)
        if views is not None and rid in views:
            warm = views[rid].holds(key)
        else:
            warm = first_choice(key, [r.unique_id for r in self._replica_id_set]) == rid
        if warm:
            self.counters.hits += 1
        else:
            self.counters.spills += 1
        self.popularity.record(key)
        self._routed_since_placement += 1
        now = time.time()
        sent = self._sent.setdefault(rid, deque())
        sent.append((key, now))
        while sent and (len(sent) > MAX_SENT_REMEMBERED or sent[0][1] < now - SENT_MEMORY_S):
            sent.popleft()

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live: Set[str] = {r.replica_id.unique_id for r in replicas}
        for rid in list(self._unsent):
            if rid not in live:
                self._unsent.pop(rid, None)
        for rid in list(self._sent):
            if rid not in live:
                self._sent.pop(rid, None)


def first_choice(key: str, replica_ids: Sequence[str]) -> Optional[str]:
    """The rendezvous first choice for ``key`` among ``replica_ids`` (None when empty)."""
    order = rendezvous_order(key, replica_ids)
    return order[0] if order else None
