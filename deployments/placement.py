"""Which replica's GPU plan slab should hold which schedule: a placement computed from observed request rates.

The replicas' slabs together hold a few schedules (sum of capacities / plans per schedule). The router sends a
schedule to the replicas its placement names, so the slabs hold what is worth holding:

- The most requested schedules are *stable*: each goes to one replica (a disjoint partition), in decreasing
  rate order, to the replica with the least assigned load (longest-processing-time first), so each slab's
  request mass is about a replica's share. A replica that holds the schedule already keeps it while that stays
  within ``load_factor`` x the share, so a new placement moves few schedules.
- A schedule whose rate exceeds what one replica may carry (``load_factor`` x the share) is *replicated* over
  ``ceil(rate / share)`` replicas; each copy carries its part of the rate.
- The rest (the *tail*, requested too rarely to earn a slot) share a *scratch* slot: its keys go to the replicas
  holding the scratch copies (each key to one of them, by rendezvous hash, so a key that comes back soon finds
  its plans), where they evict each other rather than stable schedules elsewhere. A tail request rebuilds its
  plans, so its load counts ``miss_cost`` times a warm request's. No scratch when the tail's rate is below the
  least stable schedule's (then that slot is worth more as a stable one, and tail keys are placed where eviction
  hurts least, see ``rank_for_slab_key``).

Pure functions of the rates, capacities and current slab contents: every router with similar counts computes
about the same placement. Ties go by rendezvous weight, never by process-local order.

The router uses it only with ``placement=True`` (off by default). Measured (bench/results/routing-sim-cpu.md,
routing-cpu.md): against the slab policy it gains at most ~0.02 of Zipf plan hit rate and doubles p99:
concentrating rebuilds on the scratch replicas queues them. With LRU slabs a tail request also evicted the least
recent schedule of the scratch replica (often a stable one); the segmented slab (probation first) removed that
loss for the slab policy too in the sim (0.89 -> 0.91 of Belady at hold_factor 6), short of the 0.95 goal, but not
in the real bench, so the LRU slab stays the default. The sim's best with placement (true rates, segmented slab)
is ~0.93 of the pooled Belady bound.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

#: Name of the scratch item in a placement (not a schedule key: schedule keys never start with a NUL).
SCRATCH = "\x00scratch"


def rendezvous_weight(key: str, replica_id: str) -> int:
    """64-bit highest-random-weight score of ``replica_id`` for ``key`` (stable across processes/hosts)."""
    digest = hashlib.blake2b(key.encode() + b"\x00" + replica_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(frozen=True)
class Placement:
    """Replica ids per stable schedule (more than one: replicated), and the replicas holding a scratch slot."""

    targets: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)
    scratch: Tuple[str, ...] = ()
    #: Assigned load per replica, in the placement's load units (requests, tail ones weighted by miss_cost).
    loads: Mapping[str, float] = field(default_factory=dict)

    def replicas_for(self, key: str) -> Tuple[str, ...]:
        """Where ``key`` should go: its targets; a tail key: the scratch replica it hashes to; else ()."""
        targets = self.targets.get(key)
        if targets:
            return targets
        if self.scratch:
            return (max(self.scratch, key=lambda rid: (rendezvous_weight(key, rid), rid)),)
        return ()

    def is_stable(self, key: str) -> bool:
        return key in self.targets


@dataclass(frozen=True)
class _Item:
    key: str  # a schedule key, or SCRATCH
    load: float  # per copy
    copies: int
    plans: int  # per copy


def copies_for(load: float, share: float, num_replicas: int, load_factor: float) -> int:
    """Copies an item of ``load`` needs: one while one replica may carry it (``load_factor`` x ``share``), else
    enough that each carries at most a share."""
    if share <= 0 or load <= load_factor * share:
        return 1
    return min(num_replicas, math.ceil(load / share))


def _items(stable: Sequence[str], tail: Sequence[str], rates: Mapping[str, float], plans_of: Callable[[str], int],
           num_replicas: int, load_factor: float, miss_cost: float) -> List[_Item]:
    tail_rate = sum(rates[k] for k in tail)
    scratch = bool(tail) and (not stable or tail_rate >= rates[stable[-1]])
    total = sum(rates[k] for k in stable) + tail_rate * (miss_cost if scratch else 1.0)
    share = total / num_replicas
    items = []
    for key in stable:
        copies = copies_for(rates[key], share, num_replicas, load_factor)
        items.append(_Item(key, rates[key] / copies, copies, plans_of(key)))
    if scratch:
        load = tail_rate * miss_cost
        copies = copies_for(load, share, num_replicas, load_factor)
        items.append(_Item(SCRATCH, load / copies, copies, max(plans_of(k) for k in tail)))
    return items


def plan_placement(
    rates: Mapping[str, float],
    capacities: Mapping[str, int],
    plans_of: Callable[[str], int],
    holds: Optional[Mapping[str, Set[str]]] = None,
    load_factor: float = 1.25,
    miss_cost: float = 1.0,
) -> Placement:
    """The placement for schedules requested at ``rates`` (any unit; keys with rate 0 are ignored) over replicas
    with ``capacities`` (plans per replica id). ``holds[rid]``: the keys that replica's slab holds now (kept there
    when the balance allows). See the module docstring for the policy."""
    replicas = sorted(capacities)
    n = len(replicas)
    keys = sorted((k for k, r in rates.items() if r > 0), key=lambda k: (-rates[k], k))
    if not n or not keys:
        return Placement()
    holds = holds or {}
    total_capacity = sum(capacities.values())
    # The most stable schedules whose copies (and the scratch slot) fit in all the slabs together.
    num_stable = len(keys)
    while True:
        stable, tail = keys[:num_stable], keys[num_stable:]
        items = _items(stable, tail, rates, plans_of, n, load_factor, miss_cost)
        if num_stable == 0 or sum(i.copies * i.plans for i in items) <= total_capacity:
            break
        num_stable -= 1
    share = sum(i.load * i.copies for i in items) / n
    free = dict(capacities)
    assigned: Dict[str, float] = {rid: 0.0 for rid in replicas}
    targets: Dict[str, List[str]] = {}
    # Longest processing time first: the heaviest copies first, each to the least loaded replica with room.
    for item in sorted(items, key=lambda i: (-i.load, i.key)):
        chosen: List[str] = []
        for _ in range(item.copies):
            room = [rid for rid in replicas if rid not in chosen and free[rid] >= item.plans]
            if not room:
                break

            def preference(rid: str) -> tuple:
                within = assigned[rid] + item.load <= load_factor * share
                sticky = item.key in holds.get(rid, ())
                return (not within, not (within and sticky), assigned[rid], -rendezvous_weight(item.key, rid))

            rid = min(room, key=preference)
            chosen.append(rid)
            free[rid] -= item.plans
            assigned[rid] += item.load
        if chosen:
            targets[item.key] = chosen
    scratch = tuple(targets.pop(SCRATCH, ()))
    return Placement({k: tuple(v) for k, v in targets.items()}, scratch, assigned)
