"""Discrete-event simulation of the routing benchmark: the router's policy functions without Ray, in seconds.

Same model as `bench.routing`: replicas serving one request at a time (FIFO), each with a slab of plans kept by
the engine's own eviction policy and report (`bench.routing.FakeSlab`: `cache.slab.SlotIndex`, `engine.served`);
a request for schedule ``s`` needs plans ``(s, 0..P-1)`` and costs ``warm_ms`` plus ``rebuild_ms_per_plan`` per
missing plan; closed-loop clients. The router is the real policy (`rank_for_slab_key`) fed with exact loads and
slab contents (the Serve bench sees reports up to a period old), so this isolates the policy from Serve's timing noise and the machine's load. Virtual time: the results
are deterministic for a seed.

    python -m bench.routing_sim                 # slab vs slab-hold vs Serve's default router per workload
    python -m bench.routing_sim --seeds 0 1 2   # several request draws
    python -m bench.routing_sim --seeds 0 1 2 --requests 3000 --warmup 500 --write-costs
                                                # bench/results/routing-sim-costs-cpu.md
"""

from __future__ import annotations

import argparse
import heapq
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional

import numpy as np

from bench.routing import NUM_REPLICAS, FakeSlab, belady_row, draw_schedules, schedule_key
from deployments.routing.policy import (
    DEFAULT_HOLD_FACTOR,
    DEFAULT_LOAD_FACTOR,
    KeyPopularity,
    ServiceCosts,
    SlabView,
    rank_for_slab_key,
)

ROUTERS = ("slab", "slab-hold", "default")
#: Serve's default router, as modelled here: two replicas drawn at random, the one with the shorter queue.
DEFAULT_ROUTER = "default"


@dataclass(frozen=True)
class SimConfig:
    requests: int = 1200
    warmup: int = 200
    clients: int = 6
    num_schedules: int = 32
    zipf_alpha: float = 1.1
    plans_per_schedule: int = 8
    slab_plans: int = 32
    warm_ms: float = 20.0
    rebuild_ms_per_plan: float = 10.0
    load_factor: float = DEFAULT_LOAD_FACTOR
    hold_factor: float = DEFAULT_HOLD_FACTOR


def simulate(workload: str, router: str, cfg: SimConfig = SimConfig(), seed: int = 0) -> Dict[str, float]:
    """One row: plan hit rate (after warm-up), its share of the Belady bound, latency percentiles (ms)."""
    if router not in ROUTERS:
        raise ValueError(f"router {router!r}: use one of {ROUTERS}")
    schedules = draw_schedules(workload, cfg.requests, cfg.num_schedules, cfg.zipf_alpha, seed)
    P = cfg.plans_per_schedule
    ids = [f"r{i}" for i in range(NUM_REPLICAS)]
    slabs = {rid: FakeSlab(cfg.slab_plans) for rid in ids}
    held: Dict[str, List[int]] = {}  # slots the running request of each replica holds
    queues: Dict[str, Deque[int]] = {rid: deque() for rid in ids}
    popularity = KeyPopularity()
    rng = np.random.default_rng(seed + 2)  # the default router's draws
    hits = [0] * cfg.requests
    started = [0.0] * cfg.requests
    latency = [0.0] * cfg.requests
    events: List[tuple] = []  # (finish time, replica id)

    def view(rid: str) -> SlabView:
        state = slabs[rid].state()  # the engine's report, exact and current
        v = SlabView(state.schedule_keys, state.schedule_plans, state.capacity_plans)
        for i in queues[rid]:  # queued requests will have their plans resident
            v = v.with_served(schedule_key(schedules[i]), P)
        return v

    def route(i: int) -> str:
        key = schedule_key(schedules[i])
        loads = {rid: len(queues[rid]) for rid in ids}
        if router == DEFAULT_ROUTER:
            a, b = (ids[j] for j in rng.choice(len(ids), size=2, replace=False))
            return a if loads[a] <= loads[b] else b
        views = {rid: view(rid) for rid in ids}
        # slab: the replicas report their service costs (as the Serve worker does once it has served a hit and
        # a miss); slab-hold: they do not (yet), so holders always come first (the order before the costs).
        costs = ServiceCosts(cfg.warm_ms / 1e3, P * cfg.rebuild_ms_per_plan / 1e3) if router == "slab" else None
        ranked = rank_for_slab_key(key, loads, views, P, popularity.count, cfg.load_factor, cfg.hold_factor, costs)
        popularity.record(key)
        return ranked[0]

    def start(rid: str, now: float) -> None:
        i = queues[rid][0]
        hits[i], held[rid] = slabs[rid].acquire(schedules[i], P)
        cost_ms = cfg.warm_ms + (P - hits[i]) * cfg.rebuild_ms_per_plan
        heapq.heappush(events, (now + cost_ms / 1e3, rid))

    next_request = 0

    def submit(now: float) -> None:
        nonlocal next_request
        if next_request >= cfg.requests:
            return
        i, next_request = next_request, next_request + 1
        started[i] = now
        rid = route(i)
        queues[rid].append(i)
        if len(queues[rid]) == 1:
            start(rid, now)

    for _ in range(cfg.clients):
        submit(0.0)
    now = 0.0
    while events:
        now, rid = heapq.heappop(events)
        i = queues[rid].popleft()
        slabs[rid].release(held.pop(rid))
        latency[i] = now - started[i]
        if queues[rid]:
            start(rid, now)
        submit(now)
    measured = range(cfg.warmup, cfg.requests)
    hit_rate = sum(hits[i] for i in measured) / (P * len(measured))
    bound = belady_row(workload, schedules, P, cfg.slab_plans, cfg.warmup)["plan_hit_rate"]
    lat_ms = 1e3 * np.asarray([latency[i] for i in measured])
    return {
        "workload": workload, "router": router, "seed": seed, "plan_hit_rate": round(hit_rate, 4),
        "belady": round(bound, 4), "of_belady": round(hit_rate / bound, 4),
        "p50_ms": float(np.percentile(lat_ms, 50)), "p99_ms": float(np.percentile(lat_ms, 99)),
        "req_per_s": round(cfg.requests / now, 1),
    }


#: (name, warm_ms, rebuild_ms_per_plan): the CPU bench's (a miss is 5 hits), an H3 20-step request at h3 width
#: (4.3 s; 19 plans rebuilt in ~0.25 s, bench/results/app-nvidia-h200.md), and one between.
COST_REGIMES = (("cpu-bench", 20.0, 10.0), ("h3-20-steps", 4300.0, 13.0), ("between", 2000.0, 60.0))


def write_costs_table(args: argparse.Namespace) -> None:
    """Whether routing by reported service costs pays, per cost regime: mean over --seeds."""
    from bench.common import command_line, markdown_table, write_results

    rows = []
    for regime, warm_ms, rebuild_ms in COST_REGIMES:
        cfg = SimConfig(requests=args.requests, warmup=args.warmup, load_factor=args.load_factor,
                        hold_factor=args.hold_factor, warm_ms=warm_ms, rebuild_ms_per_plan=rebuild_ms)
        for workload in args.workloads:
            for router in ("slab", "slab-hold", DEFAULT_ROUTER):
                runs = [simulate(workload, router, cfg, s) for s in args.seeds]
                row = {"costs": regime, "hit_ms": warm_ms, "miss_extra_ms": cfg.plans_per_schedule * rebuild_ms,
                       "workload": workload, "router": router}
                for k in ("plan_hit_rate", "of_belady", "p50_ms", "p99_ms", "req_per_s"):
                    row[k] = round(float(np.mean([r[k] for r in runs])), 4)
                rows.append(row)
    notes = [
        f"bench.routing_sim (virtual time): {NUM_REPLICAS} replicas, slab 32 plans, 8 plans per schedule, 32 schedules, "
        f"6 closed-loop clients, {args.requests} requests per run, first {args.warmup} left out; mean over seeds "
        f"{args.seeds}; load_factor {args.load_factor}, hold_factor {args.hold_factor}.",
        "slab: rank_for_slab_key with the replicas' service costs (candidates sorted by when the request would start "
        "there, ServiceCosts.expected_start_s: the wait behind the load, plus a miss where the slab lacks the key); slab-hold: the same without costs (the "
        "policy before them); default: Serve's default router modelled as power of two choices.",
    ]
    write_results("routing-sim-costs", rows, device="cpu", command=command_line(), notes=notes,
                  out_dir=args.out)
    print(markdown_table(rows))


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    parser.add_argument("--workloads", nargs="+", default=["zipf", "uniform"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--requests", type=int, default=SimConfig.requests)
    parser.add_argument("--warmup", type=int, default=SimConfig.warmup)
    parser.add_argument("--load-factor", type=float, default=SimConfig.load_factor)
    parser.add_argument("--hold-factor", type=float, default=SimConfig.hold_factor)
    parser.add_argument("--warm-ms", type=float, default=SimConfig.warm_ms, help="a request whose plans are resident")
    parser.add_argument("--rebuild-ms-per-plan", type=float, default=SimConfig.rebuild_ms_per_plan)
    parser.add_argument("--write-costs", action="store_true",
                        help="write bench/results/routing-sim-costs-cpu.md/json: slab (replicas report service costs) "
                             "vs slab-hold (they do not) vs Serve's default, at COST_REGIMES' hit/miss times")
    parser.add_argument("--out", default=None, help="results folder of --write-costs (default bench/results)")
    args = parser.parse_args(argv)
    from bench.common import markdown_table

    if args.write_costs:
        write_costs_table(args)
        return
    cfg = SimConfig(requests=args.requests, warmup=args.warmup, load_factor=args.load_factor,
                    hold_factor=args.hold_factor, warm_ms=args.warm_ms, rebuild_ms_per_plan=args.rebuild_ms_per_plan)
    rows = [simulate(w, r, cfg, s) for w in args.workloads for s in args.seeds for r in args.routers]
    columns = ["workload", "router", "seed", "plan_hit_rate", "belady", "of_belady", "p50_ms", "p99_ms", "req_per_s"]
    print(markdown_table(rows, columns))


if __name__ == "__main__":
    main()
