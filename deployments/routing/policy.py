"""The schedule-affinity ranking, as pure functions (no Ray): identical in every process that holds a handle.

When every replica reports its GPU plan slab (:class:`SlabView`, see ``deployments.routing.report``):

- A replica whose slab holds the key (as reported, plus the keys in flight there and those this router sent it
  since its report) takes the request while its load stays within ``hold_factor`` x the mean; the least loaded
  holder first.
- Otherwise the key goes, among the replicas within the ``load_factor`` bound, to the one whose slab loses least
  by taking it: free room first, else the replica whose least recently used schedules (what its LRU slab evicts
  next) were requested least often lately. Ties go to the lower load, then to rendezvous order.
- Replicas over every bound come last (stale loads), least loaded first.
- Once the replicas report their service costs (a generation's seconds, a slab miss's plan seconds), that order is
  sorted by when the request would start (:meth:`ServiceCosts.expected_start_s`: the wait behind a replica's load,
  plus a miss where its slab lacks the key), ties keeping it: on H3 a miss is a few percent of a generation, so a
  hot schedule spreads over idle GPUs instead of queueing on its holder (bench/results/routing-sim-costs-cpu.md:
  p99 0.68x Serve's default router, against 1.32x holding). Before the first miss is measured, the order above
  stands alone.

Requests naming LoRA adapters (``engine.adapters``) also prefer replicas holding them all (reported, in flight, or
sent since the report): among a key's holders and among the others, those holding the adapters first; so a
replica holding both the plans and the adapters, then one holding the plans, then one holding the adapters, then
any. The schedule key stays the plans' key (plans do not depend on LoRA); the rendezvous order is that of
:func:`affinity_key` (schedule and adapters), so each (schedule, adapters) pair gets its own first home. With
costs, a replica lacking the adapters adds the replicas' mean adapter load seconds to the request's start.

When they do not (resident AdaLN: no slab), rendezvous hashing with bounded load:

- Every replica gets the weight ``H(schedule_key, replica_unique_id)``; replicas are tried in descending weight
  order. The order is a pure function of the key and the replica set, so every process agrees without shared
  state, and adding or removing a replica moves only the keys whose first choice it is / was.
- Bounded load: with ``n`` replicas and ``total`` requests in flight, a replica is within bound when its ongoing
  count plus this request stays ``<= ceil(load_factor * (total + 1) / n)``. A key whose first choice is over the
  bound spills to the next replica in its rendezvous order (replicas reporting the key warm first).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import AbstractSet, Callable, Deque, Iterable, List, Mapping, Optional, Sequence, Tuple

#: Spill a key beyond this many times the mean load (the router's ``load_factor``; the app's ``worker.load_factor``).
DEFAULT_LOAD_FACTOR = 1.25
#: A replica whose slab holds the key takes it up to this many times the mean load (``hold_factor``): 6 did better
#: in bench.routing_sim, not in the real bench.routing (bench/results/routing-sim-cpu.md, last table).
DEFAULT_HOLD_FACTOR = 3.0
#: Keyed requests a router remembers to weigh what an eviction costs (how often each schedule was asked lately).
POPULARITY_WINDOW = 1000


def affinity_key(schedule_key: str, adapters: Iterable[str] = ()) -> str:
    """The rendezvous key of a request: its schedule key, and its adapter names (sorted: composition order does not
    change which factors a replica must hold). Without adapters, the schedule key itself."""
    names = sorted(set(adapters))
    return schedule_key if not names else schedule_key + "\x00lora:" + "+".join(names)


def rendezvous_weight(key: str, replica_id: str) -> int:
    """64-bit highest-random-weight score of ``replica_id`` for ``key`` (stable across processes and hosts)."""
    digest = hashlib.blake2b(key.encode() + b"\x00" + replica_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, replica_ids: Iterable[str]) -> List[str]:
    """Replica ids ordered by preference for ``key``: highest weight first (ties broken by id)."""
    return sorted(replica_ids, key=lambda rid: (-rendezvous_weight(key, rid), rid))


def first_choice(key: str, replica_ids: Sequence[str]) -> Optional[str]:
    """The rendezvous first choice for ``key`` among ``replica_ids`` (None when empty)."""
    order = rendezvous_order(key, replica_ids)
    return order[0] if order else None


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
    adapter_holders: Optional[AbstractSet[str]] = None,
) -> List[str]:
    """Replica ids in the order to try for ``key`` when the replicas report no slab.

    ``loads`` maps every candidate replica id to its ongoing request count. The rendezvous first choice comes
    first if it is within the bounded-load limit; then the other replicas within the limit (those with
    ``warm[rid]`` true first, each group in rendezvous order); replicas over the limit come last, in
    rendezvous order, as a fallback for stale load information. ``adapter_holders`` (the request names adapters:
    the replicas holding them all): within the limit, those first (each group keeping the order above); ``key`` is
    then the request's :func:`affinity_key`.
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
    ranked = head + rest
    if adapter_holders is not None:
        ranked = ([rid for rid in ranked if rid in adapter_holders]
                  + [rid for rid in ranked if rid not in adapter_holders])
    return ranked + over


@dataclass(frozen=True)
class ServiceCosts:
    """The replicas' recent means: seconds one generation keeps a replica busy, and seconds a request that missed
    the GPU slab spent getting its plans (rebuild, pool or host tier)."""

    generation_s: float
    miss_s: float
    adapter_load_s: Optional[float] = None  # a request's wait for an adapter it found not held; None: unmeasured

    def expected_start_s(self, load: int, holds_key: bool, holds_adapters: bool = True) -> float:
        """When a request sent now would have its plans on a replica with ``load`` requests: behind them it waits
        about ``load - 1/2`` generations (the running one is half done on average), then a replica whose slab does
        not hold the key gets its plans (a miss). On H3 a 20-step generation is ~4.3 s and a miss ~0.25 s (a pool
        hit ~0.05 s), so an idle GPU beats any queue; where a miss costs several generations, holders win. A
        replica lacking the request's adapters adds the adapter load (when measured)."""
        adapters_s = 0.0 if holds_adapters or self.adapter_load_s is None else self.adapter_load_s
        return max(load - 0.5, 0.0) * self.generation_s + (0.0 if holds_key else self.miss_s) + adapters_s


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


class KeyPopularity:
    """How often each key was asked for among the last ``window`` keyed requests this router routed."""

    def __init__(self, window: int = POPULARITY_WINDOW):
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


def rank_for_slab_key(
    key: str,
    loads: Mapping[str, int],
    views: Mapping[str, SlabView],
    num_plans: int,
    popularity: Callable[[str], float],
    load_factor: float = DEFAULT_LOAD_FACTOR,
    hold_factor: float = DEFAULT_HOLD_FACTOR,
    costs: Optional[ServiceCosts] = None,
    adapter_holders: Optional[AbstractSet[str]] = None,
    rendezvous_key: Optional[str] = None,
) -> List[str]:
    """Replica ids in the order to try for ``key`` when every candidate reports its slab (``views``).

    Holders of ``key`` within ``hold_factor``'s bound first (least loaded first); then the other replicas within
    ``load_factor``'s bound by the harm of placing ``num_plans`` plans there (``SlabView.eviction_cost``), then
    load; the rest last, least loaded first. Ties keep rendezvous order, so every router agrees on a cold start.
    With ``costs`` (the replicas report them) that order is then sorted by when the request would start
    (``ServiceCosts.expected_start_s``), ties keeping it: a hot schedule spreads over idle GPUs where misses are
    cheap (H3), and stays on its holders where they are not.

    ``adapter_holders`` (the request names adapters: the replicas holding them all) go first among the key's holders
    and among the others within the bound: plans and adapters, plans, adapters, neither; ``rendezvous_key`` (the
    request's :func:`affinity_key`, default ``key``) orders ties.
    """
    order = rendezvous_order(rendezvous_key or key, loads)
    if not order:
        return []

    def lacks_adapters(rid: str) -> bool:
        return adapter_holders is not None and rid not in adapter_holders

    total = sum(loads.values())
    hold_limit = bounded_load_limit(total, len(order), max(hold_factor, load_factor))
    limit = bounded_load_limit(total, len(order), load_factor)
    holders = sorted((rid for rid in order if views[rid].holds(key) and loads[rid] + 1 <= hold_limit),
                     key=lambda rid: (lacks_adapters(rid), loads[rid]))
    taken = set(holders)
    within = sorted((rid for rid in order if rid not in taken and loads[rid] + 1 <= limit),
                    key=lambda rid: (lacks_adapters(rid), views[rid].eviction_cost(num_plans, popularity), loads[rid]))
    taken.update(within)
    rest = sorted((rid for rid in order if rid not in taken), key=loads.__getitem__)
    ranked = holders + within + rest
    if costs is not None:  # a stable sort: equal starts keep the order above (holders, eviction harm, load)
        ranked.sort(key=lambda rid: costs.expected_start_s(loads[rid], views[rid].holds(key), not lacks_adapters(rid)))
    return ranked
