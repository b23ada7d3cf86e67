"""Routing benchmark on CPU: schedule-affinity router vs Ray's default router vs an oracle.

A fake worker models the GPU plan slab: each replica keeps ``--slab-plans`` plans under the engine's own
eviction policy (`FakeSlab`: `cache.slab.SlotIndex`, LRU) and reports it as the engine does (`engine.served`); it serves one request at a
time (like one GPU). A request for schedule ``s`` needs plans ``(s, 0..P-1)``; every plan not
in the slab costs ``--rebuild-ms-per-plan`` on top of ``--warm-ms``. Clients (closed loop, ``--clients``
at a time) draw schedules from a Zipf or a uniform distribution. Reported per router and workload: plan
hit rate and request latency (p50/p99) after a warm-up. The replicas report their slab (`slab_state()`:
schedules whose plans are all resident, capacity) to the affinity router, as the real worker does. Two
references: the `oracle` router knows every replica's slab and queue exactly (it simulates them at routing
time) and sends each request where it finishes earliest; the `belady` row is an upper bound on the hit rate of
any router for the same request order: Belady's rule (evict the plan next used furthest ahead) over the
replicas' slabs pooled into one cache (no load balancing, no split over replicas).

A second table measures Serve's own cost per request: the same fake with zero work called through a
DeploymentHandle (our router and the default one) vs a direct in-process call and a plain Ray actor call.

    python -m bench.routing --quick      # ~2 minutes on 2 cores
    python -m bench.routing              # longer runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import time
import uuid
from typing import Any, Dict, List, Optional

import numpy as np
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cache.slab import SlotIndex
from deployments.routing.policy import DEFAULT_HOLD_FACTOR, DEFAULT_LOAD_FACTOR
from deployments.routing.registry import schedule_affinity_stats
from deployments.routing.reporter import ScheduleAffinityReporter
from deployments.routing.router import ScheduleAffinityRouter
from engine.api import SlabState
from engine.served import ServedSchedules

NUM_REPLICAS = 4


def schedule_key(schedule: int) -> str:
    return f"sched-{schedule}"


def schedule_of(key: str) -> int:
    return int(key.split("-", 1)[1])


class FakeSlab:
    """One replica's GPU plan slab, kept by the engine's own code: the bookkeeping and eviction policy
    (`cache.slab.SlotIndex`) over plan keys ``(schedule, i)``, and the report the router reads
    (`engine.served.ServedSchedules`). The fake worker, the oracle and `bench.routing_sim` all hold one."""

    def __init__(self, slab_plans: int):
        self.index = SlotIndex(slab_plans)
        self.served = ServedSchedules()

    def misses(self, schedule: int, plans_per_schedule: int) -> int:
        """Plans a request for ``schedule`` would rebuild now (no state change)."""
        return sum(self.index.lookup((schedule, i)) is None for i in range(plans_per_schedule))

    def acquire(self, schedule: int, plans_per_schedule: int) -> tuple[int, List[int]]:
        """What `PlanCache.prepare` does to the slab: a reference on every hit, then a slot for every missing
        plan (evicting), committed once "built". Returns the hits and the slots held until `release`."""
        keys = [(schedule, i) for i in range(plans_per_schedule)]
        held, missing = [], []
        for key in keys:
            slot = self.index.lookup(key)
            if slot is None:
                missing.append(key)
            else:
                self.index.touch(slot)
                held.append(slot)
        built = [self.index.allocate(key) for key in missing]
        for slot in built:
            self.index.commit(slot)
        self.served.served(schedule_key(schedule), keys)
        return len(keys) - len(missing), held + built

    def release(self, slots: List[int]) -> None:
        for slot in slots:
            self.index.free(slot)

    def state(self) -> SlabState:
        return self.served.slab_state(self.index)


class FakePlanWorker(ScheduleAffinityReporter):
    """One 'GPU': a plan slab (`FakeSlab`) and one request at a time."""

    def __init__(self, slab_plans: int, plans_per_schedule: int, warm_s: float, rebuild_s_per_plan: float):
        self.plans_per_schedule = plans_per_schedule
        self.warm_s = warm_s
        self.rebuild_s_per_plan = rebuild_s_per_plan
        self.slab = FakeSlab(slab_plans)
        self.lock = asyncio.Lock()
        self.replica = uuid.uuid4().hex[:8]

    async def generate(self, payload: Dict[str, Any], schedule_key: Optional[str] = None) -> Dict[str, Any]:
        with self.track_schedule(schedule_key):
            async with self.lock:
                hits, slots = self.slab.acquire(payload["schedule"], self.plans_per_schedule)
                try:
                    plans_s = (self.plans_per_schedule - hits) * self.rebuild_s_per_plan
                    if self.warm_s + plans_s > 0:
                        await asyncio.sleep(self.warm_s + plans_s)
                finally:
                    self.slab.release(slots)
                # as the Serve worker does: the router weighs a miss against the wait behind a holder with these
                self.record_service(self.warm_s + plans_s, plans_s, missed_slab=hits < self.plans_per_schedule)
                return {"replica": self.replica, "plan_hits": hits, "plans": self.plans_per_schedule}

    def warm_schedule_keys(self) -> List[str]:
        return list(self.slab.state().schedule_keys)

    def slab_state(self) -> SlabState:
        return self.slab.state()


def belady_row(workload: str, schedules: List[int], plans_per_schedule: int, slab_plans: int, warmup: int) -> Dict[str, Any]:
    """Upper bound on the plan hit rate for this request order: Belady's rule over the plan accesses, the
    replicas' slabs pooled into one cache of NUM_REPLICAS * slab_plans plans. Requests before `warmup` warm the
    cache but are not counted (as in the measured rows)."""
    accesses = [(i, (s, j)) for i, s in enumerate(schedules) for j in range(plans_per_schedule)]
    next_use: List[float] = [math.inf] * len(accesses)
    seen: Dict[tuple, int] = {}
    for pos in range(len(accesses) - 1, -1, -1):
        next_use[pos] = seen.get(accesses[pos][1], math.inf)
        seen[accesses[pos][1]] = pos
    cache: Dict[tuple, float] = {}  # plan -> position of its next use
    hits = counted = 0
    for pos, (request, plan) in enumerate(accesses):
        if plan in cache:
            hits += request >= warmup
        elif len(cache) >= NUM_REPLICAS * slab_plans:
            del cache[max(cache, key=cache.get)]
        cache[plan] = next_use[pos]
        counted += request >= warmup
    return {"workload": workload, "router": f"belady bound ({NUM_REPLICAS}x{slab_plans} plans pooled)",
            "plan_hit_rate": hits / counted}


class OracleRouter(RequestRouter):
    """Knows every replica's slab and queue: simulates both at routing time (exact while this one handle is
    the only client) and picks the replica where the request would finish first."""

    def initialize_state(self, slab_plans: int, plans_per_schedule: int, warm_s: float, rebuild_s_per_plan: float):
        self.slab_plans = slab_plans
        self.plans_per_schedule = plans_per_schedule
        self.warm_s = warm_s
        self.rebuild_s_per_plan = rebuild_s_per_plan
        self.slabs: Dict[str, FakeSlab] = {}
        self.busy_until: Dict[str, float] = {}

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True
        schedule = schedule_of(pending_request.kwargs["schedule_key"])
        now = time.monotonic()
        best, best_finish = None, math.inf
        for replica in candidate_replicas:
            rid = replica.replica_id.unique_id
            slab = self.slabs.setdefault(rid, FakeSlab(self.slab_plans))
            misses = slab.misses(schedule, self.plans_per_schedule)
            finish = max(now, self.busy_until.get(rid, now)) + self.warm_s + misses * self.rebuild_s_per_plan
            if finish < best_finish:
                best, best_finish = replica, finish
        rid = best.replica_id.unique_id
        slab = self.slabs[rid]
        slab.release(slab.acquire(schedule, self.plans_per_schedule)[1])
        self.busy_until[rid] = best_finish
        return [[best]]


def zipf_weights(num_schedules: int, alpha: float) -> np.ndarray:
    w = 1.0 / np.arange(1, num_schedules + 1) ** alpha
    return w / w.sum()


def draw_schedules(workload: str, num_requests: int, num_schedules: int, alpha: float, seed: int) -> List[int]:
    rng = np.random.default_rng(seed)
    if workload == "zipf":
        p = zipf_weights(num_schedules, alpha)
    else:
        p = np.full(num_schedules, 1.0 / num_schedules)
    ranks = rng.choice(num_schedules, size=num_requests, p=p)
    perm = np.random.default_rng(seed + 1).permutation(num_schedules)  # hot schedules are not 0, 1, 2...
    return [int(perm[r]) for r in ranks]


def percentile(values: List[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


async def run_load(handle, schedules: List[int], num_clients: int, warmup: int) -> Dict[str, Any]:
    queue = list(enumerate(schedules))
    queue.reverse()
    records: List[Optional[tuple]] = [None] * len(schedules)

    async def client():
        while queue:
            index, schedule = queue.pop()
            t0 = time.perf_counter()
            out = await handle.generate.remote({"schedule": schedule}, schedule_key=schedule_key(schedule))
            records[index] = (time.perf_counter() - t0, out["plan_hits"], out["plans"], out["replica"])

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(num_clients)))
    wall_s = time.perf_counter() - t0
    measured = [r for r in records[warmup:] if r is not None]
    latencies = [r[0] for r in measured]
    return {
        "plan_hit_rate": sum(r[1] for r in measured) / max(1, sum(r[2] for r in measured)),
        "p50_ms": 1e3 * percentile(latencies, 50),
        "p99_ms": 1e3 * percentile(latencies, 99),
        "mean_ms": 1e3 * statistics.fmean(latencies),
        "req_per_s": len(schedules) / wall_s,
        "replicas_used": len({r[3] for r in measured}),
    }


def parse_router(spec: str) -> tuple:
    """`affinity`, `affinity:2.0` (another load_factor), `default` or `oracle`."""
    name, _, load_factor = spec.partition(":")
    if name not in ("affinity", "default", "oracle") or (load_factor and name != "affinity"):
        raise ValueError(f"router {spec!r}: use affinity[:<load_factor>], default or oracle.")
    return name, float(load_factor) if load_factor else None


def worker_deployment(router: str, args, name: str, load_factor: Optional[float] = None):
    options: Dict[str, Any] = dict(
        name=name,
        num_replicas=NUM_REPLICAS,
        max_ongoing_requests=32,
        ray_actor_options={"num_cpus": 0},
    )
    fake_kwargs = dict(
        slab_plans=args.slab_plans,
        plans_per_schedule=args.plans_per_schedule,
        warm_s=args.warm_ms / 1e3,
        rebuild_s_per_plan=args.rebuild_ms_per_plan / 1e3,
    )
    if router == "affinity":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ScheduleAffinityRouter,
            request_router_kwargs={"load_factor": load_factor or args.load_factor, "hold_factor": args.hold_factor,
                                   "spill_confirm_s": args.spill_confirm_s},
            request_routing_stats_period_s=args.stats_period_s,
        )
    elif router == "oracle":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=OracleRouter, request_router_kwargs=fake_kwargs
        )
    return serve.deployment(FakePlanWorker).options(**options).bind(**fake_kwargs)


async def measure_overhead(num_calls: int) -> List[Dict[str, Any]]:
    """Per-request cost of routing through Serve, with a worker that does no work."""
    zero = dict(slab_plans=1 << 10, plans_per_schedule=1, warm_s=0.0, rebuild_s_per_plan=0.0)

    async def timed(call, n) -> List[float]:
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            await call(i)
            out.append(time.perf_counter() - t0)
        return out

    rows = []
    direct = FakePlanWorker(**zero)
    lat = await timed(lambda i: direct.generate({"schedule": i % 8}, schedule_key=schedule_key(i % 8)), num_calls)
    rows.append({"path": "direct in-process call", "p50_ms": 1e3 * percentile(lat, 50), "p99_ms": 1e3 * percentile(lat, 99)})

    actor = ray.remote(num_cpus=0)(FakePlanWorker).remote(**zero)
    await actor.generate.remote({"schedule": 0})
    lat = await timed(lambda i: actor.generate.remote({"schedule": i % 8}, schedule_key=schedule_key(i % 8)), num_calls)
    rows.append({"path": "plain Ray actor call", "p50_ms": 1e3 * percentile(lat, 50), "p99_ms": 1e3 * percentile(lat, 99)})
    ray.kill(actor)

    for label, router in (("Serve handle, default router", None), ("Serve handle, ScheduleAffinityRouter", ScheduleAffinityRouter)):
        options: Dict[str, Any] = dict(name="overhead", num_replicas=1, ray_actor_options={"num_cpus": 0})
        if router is not None:
            options["request_router_config"] = RequestRouterConfig(request_router_class=router)
        app = f"overhead_{'affinity' if router else 'default'}"
        handle = serve.run(serve.deployment(FakePlanWorker).options(**options).bind(**zero), name=app, route_prefix=None)
        for i in range(20):
            await handle.generate.remote({"schedule": i % 8}, schedule_key=schedule_key(i % 8))
        lat = await timed(
            lambda i: handle.generate.remote({"schedule": i % 8}, schedule_key=schedule_key(i % 8)), num_calls
        )
        rows.append({"path": label, "p50_ms": 1e3 * percentile(lat, 50), "p99_ms": 1e3 * percentile(lat, 99)})
        serve.delete(app)
    base = rows[0]["p50_ms"]
    for row in rows:
        row["overhead_p50_ms"] = row["p50_ms"] - base
    return rows


async def run_all(args) -> Dict[str, Any]:
    loadavg_start = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = []
    for workload in args.workloads:
        schedules = draw_schedules(workload, args.requests, args.num_schedules, args.zipf_alpha, args.seed)
        bound = belady_row(workload, schedules, args.plans_per_schedule, args.slab_plans, args.warmup)
        rows.append(bound)
        print(json.dumps(bound), flush=True)
        for spec in args.routers:
            router, load_factor = parse_router(spec)
            tag = spec.replace(":", "_").replace(".", "_")
            app, name = f"routing_{tag}_{workload}", f"FakeWorker_{tag}"
            handle = serve.run(worker_deployment(router, args, name, load_factor), name=app, route_prefix=None)
            before = schedule_affinity_stats(name)
            result = await run_load(handle, schedules, args.clients, args.warmup)
            after = schedule_affinity_stats(name)
            spilled = after["spills"] - before["spills"]
            routed = spilled + after["hits"] - before["hits"]
            affinity = router == "affinity"
            label = f"{router} (load_factor {load_factor or args.load_factor})" if affinity else router
            row = {"workload": workload, "router": label, **result}
            row["spill_rate"] = (spilled / routed) if affinity and routed else None
            row["of_belady"] = row["plan_hit_rate"] / bound["plan_hit_rate"] if bound["plan_hit_rate"] else None
            rows.append(row)
            print(json.dumps(row), flush=True)
            serve.delete(app)
    overhead = await measure_overhead(args.overhead_calls)
    for row in overhead:
        print(json.dumps(row), flush=True)
    loadavg = f"{loadavg_start} at the start, " + ", ".join(f"{x:.1f}" for x in os.getloadavg()) + " at the end"
    return {"rows": rows, "overhead": overhead, "loadavg": loadavg}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short runs (~2 minutes on 2 cores)")
    parser.add_argument("--requests", type=int, default=1200, help="requests per router and workload")
    parser.add_argument("--warmup", type=int, default=200, help="first requests left out of the statistics")
    parser.add_argument("--clients", type=int, default=6, help="concurrent closed-loop clients")
    parser.add_argument("--num-schedules", type=int, default=32)
    parser.add_argument("--zipf-alpha", type=float, default=1.1)
    parser.add_argument("--plans-per-schedule", type=int, default=8)
    parser.add_argument("--slab-plans", type=int, default=32, help="plans one replica keeps (4 schedules)")
    parser.add_argument("--warm-ms", type=float, default=20.0, help="cost of a request with all plans warm")
    parser.add_argument("--rebuild-ms-per-plan", type=float, default=10.0, help="extra cost per missing plan")
    parser.add_argument("--load-factor", type=float, default=DEFAULT_LOAD_FACTOR)
    parser.add_argument("--hold-factor", type=float, default=DEFAULT_HOLD_FACTOR)
    parser.add_argument("--spill-confirm-s", type=float, default=0.01)
    parser.add_argument("--stats-period-s", type=float, default=1.0,
                        help="how often replicas report ongoing count and warm schedules to the routers")
    parser.add_argument("--overhead-calls", type=int, default=500)
    parser.add_argument("--routers", nargs="+", default=None,
                        help="affinity[:load_factor] | default | oracle (default: affinity affinity:2.0 default "
                             "oracle; --quick: affinity default oracle)")
    parser.add_argument("--workloads", nargs="+", default=["zipf", "uniform"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print only; do not write bench/results")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.warmup, args.overhead_calls = 240, 40, 150
    if args.routers is None:
        args.routers = (["affinity", "default", "oracle"] if args.quick
                        else ["affinity", "affinity:2.0", "default", "oracle"])

    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")
    try:
        results = asyncio.run(run_all(args))
    finally:
        serve.shutdown()
        ray.shutdown()

    from bench.common import command_line, markdown_table, write_results

    columns = ["workload", "router", "plan_hit_rate", "of_belady", "p50_ms", "p99_ms", "mean_ms", "req_per_s", "spill_rate", "replicas_used"]
    routing_md = markdown_table(results["rows"], columns)
    overhead_md = markdown_table(results["overhead"], ["path", "p50_ms", "p99_ms", "overhead_p50_ms"])
    print("\n" + routing_md + "\n\n" + overhead_md)
    if args.no_write:
        return
    notes = [
        f"{NUM_REPLICAS} replicas of a fake worker, one request at a time each; slab {args.slab_plans} plans, "
        f"{args.plans_per_schedule} plans per schedule, {args.num_schedules} schedules "
        f"(zipf alpha {args.zipf_alpha} | uniform); warm request {args.warm_ms} ms, "
        f"+{args.rebuild_ms_per_plan} ms per missing plan; {args.clients} closed-loop clients, "
        f"{args.requests} requests per row, first {args.warmup} left out; load_factor {args.load_factor}, "
        f"hold_factor {args.hold_factor}, "
        f"spill_confirm_s {args.spill_confirm_s}, routing stats every {args.stats_period_s} s.",
        "oracle: knows every slab and queue exactly, sends each request where it finishes first.",
        "belady bound: Belady's rule over the same request order with the 4 slabs pooled into one cache (an upper "
        "bound for any router: it needs no load balance and no split of schedules over replicas).",
        "affinity: the replicas report which schedules their slab holds (and its capacity); the router sends a "
        "schedule to a holder within hold_factor x the mean load, else places it where eviction hurts least; once "
        "the replicas report their service costs, to the replica where the request starts first.",
        "spill_rate: share of keyed requests the affinity router sent to a replica not expected to hold their plans.",
        f"load average while running: {results['loadavg']} (other work on this machine inflates latencies).",
    ]
    md_path, json_path = write_results(
        "routing", results["rows"], device="cpu", command=command_line(), columns=columns, notes=notes
    )
    md_path.write_text(
        md_path.read_text() + "\n## Serve overhead per request (zero-work worker, sequential calls)\n\n" + overhead_md + "\n"
    )
    data = json.loads(json_path.read_text())
    data["overhead"] = results["overhead"]
    json_path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"wrote {md_path} and {json_path}")


if __name__ == "__main__":
    # Import ourselves under the package name so Serve ships `bench.routing.*` classes, not `__main__.*`.
    from bench import routing

    routing.main()
