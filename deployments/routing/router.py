"""`ScheduleAffinityRouter`: the Serve `RequestRouter` of the GPU worker deployment (policy: ``policy``).

The router runs inside every process holding a handle to the worker; nothing here blocks the event loop. Serve
ships this module to those processes by value (cloudpickle), so module-level state here is a copy per process:
the per-process registry is ``deployments.routing.registry`` (imported by reference) and the options model is
``deployments.routing.options``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Set, Tuple

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from deployments.routing.options import AffinityRouterOptions
from deployments.routing.policy import (
    KeyPopularity,
    ServiceCosts,
    SlabView,
    affinity_key,
    first_choice,
    rank_for_key,
    rank_for_slab_key,
    rendezvous_weight,
)
from deployments.routing.registry import AffinityCounters, register_router
from deployments.routing.report import ROUTING_STATS_ONGOING, ROUTING_STATS_WARM_KEYS, AdapterReport, SlabReport

logger = logging.getLogger("ray.serve")

SCHEDULE_KEY_KWARG = "schedule_key"
"""Keyword argument of the handle call that carries the schedule key."""
ADAPTERS_KWARG = "adapters"
"""Keyword argument of the handle call that carries the request's LoRA adapter names (a tuple of str)."""

#: A key this router sent to a replica counts as resident there unless the replica's report is this much newer
#: (the report cannot show a request that had not reached the replica yet).
SENT_GRACE_S = 0.5
SENT_MEMORY_S = 60.0
MAX_SENT_REMEMBERED = 256


class ScheduleAffinityRouter(RequestRouter):
    """Slab-aware ranking of ``schedule_key`` (rendezvous hashing when replicas report no slab) with bounded
    load; least load for requests without a key. The policy is in ``deployments.routing.policy``;
    ``request_router_kwargs`` are an :class:`AffinityRouterOptions`.

    Load of a replica = Serve's queue-length cache for it (the replica's own count from its last reply, plus
    this process's sends, minus this process's completions) + requests this router chose for it that have not
    been sent yet. The second term matters in a burst: Serve's routing task assigns several queued requests
    in one pass of the event loop, before any send updates the cache, so without it they would all see the
    same loads and pile onto one replica. A replica without a cache entry (idle for ~10 s) is probed (one RPC,
    ``get_queue_len``); if that fails its ``record_routing_stats()["ongoing"]`` is used.

    The cache can run high: a completion reaches it a little after the caller got the result, and another
    process's finished requests stay in it until the next reply. A spill costs the target a plan rebuild, so
    before spilling away from a key's holders (or its first choice) the router waits ``spill_confirm_s`` and
    re-probes them: a back-to-back request for the same schedule stays on its warm replica. It can also run
    low (another process's sends), so the spill's target is probed with it.

    Each call returns exactly one replica (a single tier), so what Serve sends is what we counted; replicas
    Serve knows to be full are skipped, and when all are, every replica is offered in our order and Serve
    probes them. Deliberately no FIFOMixin: it hands the replica found for one request to the oldest pending
    request, which would break affinity.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.options = AffinityRouterOptions()
        self.counters = AffinityCounters()
        self.popularity = KeyPopularity()
        self.costs: Optional[ServiceCosts] = None  # the replicas' reported means, as of the last slab_views
        # replica unique_id -> (key, time.time()) of the keyed requests sent to it lately, oldest first.
        self._sent: Dict[str, Deque[Tuple[str, float]]] = {}
        # replica unique_id -> (adapter names, time.time()) of the requests naming adapters sent to it lately.
        self._sent_adapters: Dict[str, Deque[Tuple[Tuple[str, ...], float]]] = {}
        # schedule key -> its plan count, as last reported by any replica (for keys a slab does not hold).
        self._plans_of_key: Dict[str, int] = {}
        # replica unique_id -> requests chosen for it whose future is not resolved yet (not sent yet).
        self._unsent: Dict[str, int] = {}
        # id(pending_request) -> (its future when chosen, replica unique_id), until sent or undone.
        self._chosen: Dict[int, Any] = {}
        register_router(self)

    @property
    def deployment_name(self) -> str:
        return self._deployment_id.name

    def initialize_state(self, **request_router_kwargs: Any) -> None:
        """Serve passes ``request_router_kwargs`` here; a bad or unknown one raises pydantic's ValidationError (a
        ValueError) naming it."""
        self.options = AffinityRouterOptions.model_validate(request_router_kwargs)

    # -- load and key extraction ------------------------------------------------------------------------

    @staticmethod
    def schedule_key_of(pending_request: Optional[PendingRequest]) -> Optional[str]:
        if pending_request is None:
            return None
        key = pending_request.kwargs.get(SCHEDULE_KEY_KWARG)
        if key is None or key == "":
            return None
        return key if isinstance(key, str) else str(key)

    @staticmethod
    def adapters_of(pending_request: Optional[PendingRequest]) -> Tuple[str, ...]:
        """The request's adapter names (``adapters=`` of the handle call); () when it names none."""
        if pending_request is None:
            return ()
        names = pending_request.kwargs.get(ADAPTERS_KWARG) or ()
        if isinstance(names, str):  # one name given bare
            names = (names,)
        return tuple(sorted({str(n) for n in names}))

    def adapter_holders(self, candidate_replicas: List[RunningReplica],
                        adapters: Tuple[str, ...]) -> Optional[Set[str]]:
        """The candidates holding every one of ``adapters`` (reported, or sent there since their report: the
        replica loads them for that request); None when the request names none (every replica is as good)."""
        if not adapters:
            return None
        holders = set()
        for replica in candidate_replicas:
            rid = replica.replica_id.unique_id
            report = AdapterReport.parse(replica.routing_stats)
            held = set(report.held) if report is not None else set()
            since = report.at - SENT_GRACE_S if report is not None else -math.inf
            for names, at in self._sent_adapters.get(rid, ()):
                if at >= since:
                    held.update(names)
            if held.issuperset(adapters):
                holders.add(rid)
        return holders

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
        adapter_loads = [c.adapter_load_s for c in measured if c.adapter_load_s is not None]
        self.costs = ServiceCosts(statistics.fmean(c.generation_s for c in measured),
                                  statistics.fmean(c.miss_s for c in measured),
                                  statistics.fmean(adapter_loads) if adapter_loads else None) if measured else None
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
             views: Optional[Dict[str, SlabView]] = None, adapters: Tuple[str, ...] = ()) -> List[RunningReplica]:
        """Candidates in preference order for ``key`` (least loaded first when ``key`` is None). ``views``:
        the candidates' ``slab_views`` (None: no slab reports, rendezvous order). ``adapters``: the request's
        adapter names; replicas holding them go first within each tier (``policy``)."""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {rid: self.replica_load(r) for rid, r in by_id.items()}
        if key is None:
            ids = list(by_id)
            random.shuffle(ids)  # ties between equally loaded replicas go to a random one
            return [by_id[rid] for rid in sorted(ids, key=loads.__getitem__)]
        holders = self.adapter_holders(candidate_replicas, adapters)
        if views is not None:
            ranked = rank_for_slab_key(key, loads, views, self._plans_of(key), self.popularity.count,
                                       self.options.load_factor, self.options.hold_factor, self.costs,
                                       holders, affinity_key(key, adapters))
            return [by_id[rid] for rid in ranked]
        warm = {rid: self._reports_warm(r, key) for rid, r in by_id.items()}
        ranked = rank_for_key(affinity_key(key, adapters), loads, self.options.load_factor, warm, holders)
        return [by_id[rid] for rid in ranked]

    def preferred(self, candidate_replicas: List[RunningReplica], key: str,
                  views: Optional[Dict[str, SlabView]], adapters: Tuple[str, ...] = ()) -> List[RunningReplica]:
        """Where ``key`` goes when no replica is loaded: the holders of its plans (those of them holding its
        adapters, if any do), else (no slab reports) the holders of its adapters, else its rendezvous first choice
        (by the request's ``affinity_key``). Ranking anything else first is a spill, confirmed with a fresh probe
        of these."""
        holders = self.adapter_holders(candidate_replicas, adapters)
        if views is not None:  # nobody holds it: a new key's first home, not a spill
            plans = [r for r in candidate_replicas if views[r.replica_id.unique_id].holds(key)]
            both = [r for r in plans if holders is not None and r.replica_id.unique_id in holders]
            return both or plans
        if holders:
            return [r for r in candidate_replicas if r.replica_id.unique_id in holders]
        rendezvous = affinity_key(key, adapters)
        return [max(candidate_replicas, key=lambda r: rendezvous_weight(rendezvous, r.replica_id.unique_id))]

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
            ranked = await self._rank_fresh(candidate_replicas, self.schedule_key_of(pending_request),
                                            self.adapters_of(pending_request))
        except Exception:  # noqa: BLE001 - a bug here must not strand the request: fall back to least load
            logger.exception("ScheduleAffinityRouter: ranking failed; offering all replicas")
            return [list(candidate_replicas)]
        choice = next((r for r in ranked if not self._known_full(r)), None)
        if choice is None:
            return [[r] for r in ranked]
        if pending_request is not None:
            self._take(pending_request, choice.replica_id.unique_id)
        return [[choice]]

    async def _rank_fresh(self, candidate_replicas: List[RunningReplica], key: Optional[str],
                          adapters: Tuple[str, ...] = ()) -> List[RunningReplica]:
        unknown = [r for r in candidate_replicas if self.replica_queue_len_cache.get(r.replica_id) is None]
        if unknown:
            await self.probe(unknown)
        if key is None:
            return self.rank(candidate_replicas, key)
        views = self.slab_views(candidate_replicas)  # parsed once for the ranking and the spill check
        ranked = self.rank(candidate_replicas, key, views, adapters)
        if len(ranked) < 2:
            return ranked
        preferred = self.preferred(candidate_replicas, key, views, adapters)
        if preferred and ranked[0] not in preferred:
            # About to spill. The numbers may count a request that just finished (the caller can have its
            # result a few ms before the replica and this router stop counting it): give that a moment to
            # settle, ask the replica itself, and decide again (reports and sends may have changed meanwhile).
            # The target too: another process's sends reach this cache only when it next talks to that replica,
            # so one that looks idle (what puts it before a busy holder, ServiceCosts) can be busy.
            if self.options.spill_confirm_s > 0:
                await asyncio.sleep(self.options.spill_confirm_s)
            await asyncio.gather(self.probe(preferred), self.probe(ranked[:1], raise_only=True))
            ranked = self.rank(candidate_replicas, key, self.slab_views(candidate_replicas), adapters)
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
        now = time.time()
        adapters = self.adapters_of(pending_request)
        if adapters:
            sent_adapters = self._sent_adapters.setdefault(rid, deque())
            sent_adapters.append((adapters, now))
            while sent_adapters and (len(sent_adapters) > MAX_SENT_REMEMBERED
                                     or sent_adapters[0][1] < now - SENT_MEMORY_S):
                sent_adapters.popleft()
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
        for sent in (self._sent, self._sent_adapters):
            for rid in list(sent):
                if rid not in live:
                    sent.pop(rid, None)
