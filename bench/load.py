"""Sustained load against a local deployment on CPU: nothing lost, nothing wrong, memory flat.

Starts its own local Ray cluster and the app from serve_config.yaml (tiny model; a small AdaLN slab so plans
are evicted, restored from the host tier and rebuilt all the time), then runs `--clients` closed-loop HTTP
clients for `--duration` seconds over a mix of requests with different schedules (steps, video and audio
shifts), sizes, durations and seeds, some with the MP4. Checks:

- lost: every request sent gets a 200 (a non-200, a timeout or a connection error counts as lost);
- wrong: every response's latents equal, bit for bit, a reference computed once per distinct request by an
  engine built in this process from the same checkpoint and engine config;
- memory: resident set (VmRSS) and pinned/locked memory (VmPin + VmLck) of the Serve replica processes
  (worker and ingress, found by process title in /proc), sampled every `--sample-s`; after `--warmup-s` the
  mean of the first quartile of samples is compared with the last (flat: growth <= max(5%, 64 MiB));
- latency: p50 / p99 of the client-side request time, overall and per quartile.

    python -m bench.load --quick            # ~60 s of load (CI-sized smoke; ~2 min with start-up)
    python -m bench.load --duration 240     # the sustained run (not in CI)

Prints a summary and writes it as JSON (`--json`, default bench/results/load-cpu-<quick|full>.json).
Exit status 1 when anything was lost or wrong, or memory grew.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
APP_NAME = "ditserve"
MiB = 1 << 20


# --------------------------------------------------------------------------------------------------
# Request mix and references
# --------------------------------------------------------------------------------------------------


def request_mix(num: int, seed: int = 0) -> list[dict[str, Any]]:
    """`num` distinct request bodies: schedules (steps x video/audio shifts), sizes, durations, seeds; latents
    always (they are checked), the MP4 for about a quarter of them (decode and mux under load)."""
    rng = random.Random(seed)
    bodies, seen = [], set()
    while len(bodies) < num:
        body = {
            "prompt": rng.choice(("a red fox in snow", "waves at night", "城市的夜晚", "a slow train")),
            "steps": rng.choice((2, 3, 4, 5, 7)),
            "seconds": rng.choice((5.0, 6.0)),
            "width": rng.choice((64, 96)),
            "height": rng.choice((64, 128)),
            "flow_shift": rng.choice((3.0, 7.0, 12.0)),
            "audio_flow_shift": rng.choice((2.0, 3.0)),
            "seed": rng.randrange(2**31),
            "return_latents": True,
            "return_video": rng.random() < 0.25,
        }
        key = json.dumps(body, sort_keys=True)
        if key not in seen:
            seen.add(key)
            bodies.append(body)
    return bodies


def references(engine_args: dict[str, Any], bodies: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
    """Latents of every body from an engine built here (same checkpoint and engine config, CPU)."""
    from engine.api import GenerationRequest
    from engine.config import EngineConfig
    from engine.engine import Engine

    engine = Engine(EngineConfig.model_validate({**engine_args, "device": "cpu"}))
    out = []
    for body in bodies:
        result = engine.generate(GenerationRequest(**body))
        out.append({"video": result.video, "audio": result.audio, "model": result.model})
    return out


# --------------------------------------------------------------------------------------------------
# Replica processes and their memory
# --------------------------------------------------------------------------------------------------


def parent_pid(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    return 0


def descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        pid = parent_pid(pid)
        if pid == ancestor:
            return True
    return False


def replica_pids(app: str = APP_NAME) -> dict[str, list[int]]:
    """{"Worker": [pid...], "Ingress": [pid...]}: this cluster's replica processes (titles Ray gives them;
    only descendants of this process, whose `ray.init` started the raylet: other clusters on the machine
    may serve an app of the same name)."""
    found: dict[str, list[int]] = {"Worker": [], "Ingress": []}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not descends_from(int(entry), me):
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for role in found:
            if f"ServeReplica:{app}:{role}" in cmdline:
                found[role].append(int(entry))
    return found


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS, VmPin, VmLck of `pid` in KiB (psutil would give RSS too; /proc also has the pinned pages)."""
    values = {"VmRSS": 0, "VmPin": 0, "VmLck": 0}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in values:
                values[name] = int(rest.split()[0])
    return values


@dataclass
class Sample:
    t: float
    worker_rss: int   # bytes, summed over worker replicas
    ingress_rss: int
    pinned: int       # VmPin + VmLck of every replica
    pids: tuple[int, ...]


class MemorySampler(threading.Thread):
    def __init__(self, period_s: float):
        super().__init__(daemon=True)
        self.period_s, self.samples, self._done = period_s, [], threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            pids = replica_pids()
            mem = {role: [memory_kib(p) for p in ps] for role, ps in pids.items()}
            self.samples.append(Sample(
                t=time.monotonic(),
                worker_rss=sum(m["VmRSS"] for m in mem["Worker"]) * 1024,
                ingress_rss=sum(m["VmRSS"] for m in mem["Ingress"]) * 1024,
                pinned=sum(m["VmPin"] + m["VmLck"] for ms in mem.values() for m in ms) * 1024,
                pids=tuple(p for ps in pids.values() for p in ps),
            ))
            self._done.wait(self.period_s)

    def stop(self) -> None:
        self._done.set()
        self.join()


# --------------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    t_start: float
    latency_s: float
    index: int           # which body
    status: int | None   # None: no HTTP answer
    wrong: bool = False
    error: str = ""
    adaln: dict[str, Any] | None = None  # the response's AdaLN plan counters


def check(body: dict[str, Any], reference: dict[str, Any]) -> bool:
    """True when the response body carries exactly the reference latents and model."""
    from deployments.schemas import decode_latents

    latents = decode_latents(body["latents"])
    return (body["model"] == reference["model"] and torch.equal(latents["video"], reference["video"])
            and torch.equal(latents["audio"], reference["audio"]))


def client(url: str, bodies, refs, deadline: float, rng: random.Random, out: list[Outcome], timeout_s: float):
    session = requests.Session()
    while time.monotonic() < deadline:
        i = rng.randrange(len(bodies))
        start = time.monotonic()
        try:
            r = session.post(f"{url}/v1/generations", json=bodies[i], timeout=timeout_s)
        except requests.RequestException as exc:
            out.append(Outcome(start, time.monotonic() - start, i, None, error=type(exc).__name__))
            continue
        latency = time.monotonic() - start
        if r.status_code != 200:
            out.append(Outcome(start, latency, i, r.status_code, error=r.text[:200]))
            continue
        body = r.json()
        out.append(Outcome(start, latency, i, 200, wrong=not check(body, refs[i]), adaln=body["stats"].get("adaln")))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def quartiles(items: list) -> list[list]:
    """Split time-ordered `items` into 4 consecutive quarters."""
    n = len(items)
    return [items[n * k // 4: n * (k + 1) // 4] for k in range(4)]


def summarize(outcomes: list[Outcome], samples: list[Sample], load_start: float, warmup_s: float,
              duration_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == 200 and not o.wrong]
    lost = [o for o in outcomes if o.status != 200]
    wrong = [o for o in outcomes if o.wrong]
    latencies = [o.latency_s for o in outcomes if o.status == 200]
    by_time = sorted((o for o in outcomes if o.status == 200), key=lambda o: o.t_start)
    steady = [s for s in samples if s.t >= load_start + warmup_s]
    mem_q = quartiles(steady)

    def mean(xs):
        return statistics.fmean(xs) if xs else float("nan")

    first, last = mem_q[0], mem_q[3]
    worker_first, worker_last = mean([s.worker_rss for s in first]), mean([s.worker_rss for s in last])
    ingress_first, ingress_last = mean([s.ingress_rss for s in first]), mean([s.ingress_rss for s in last])
    pinned_first, pinned_last = mean([s.pinned for s in first]), mean([s.pinned for s in last])

    def flat(a: float, b: float) -> bool:
        return b - a <= max(0.05 * a, 64 * MiB)

    return {
        "duration_s": duration_s,
        "sent": len(outcomes),
        "ok": len(ok),
        "lost": len(lost),
        "wrong": len(wrong),
        "lost_examples": [(o.status, o.error) for o in lost[:5]],
        "throughput_rps": len(ok) / duration_s if duration_s else 0.0,
        "distinct_requests_served": len({o.index for o in ok}),
        "adaln_plans": {k: sum((o.adaln or {}).get(k, 0) for o in ok) for k in
                        ("gpu_hit_plans", "host_hit_plans", "built_plans", "gpu_evicted_plans",
                         "host_evicted_groups")},
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "latency_max_s": max(latencies, default=float("nan")),
        "latency_p50_by_quartile_s": [percentile([o.latency_s for o in q], 50) for q in quartiles(by_time)],
        "memory_samples": len(steady),
        "worker_rss_mib_first_last_quartile": [worker_first / MiB, worker_last / MiB],
        "ingress_rss_mib_first_last_quartile": [ingress_first / MiB, ingress_last / MiB],
        "pinned_mib_first_last_quartile": [pinned_first / MiB, pinned_last / MiB],
        "replica_pids_seen": sorted({p for s in samples for p in s.pids}),
        "worker_rss_mib_samples": [round(s.worker_rss / MiB) for s in steady],
        "memory_flat": flat(worker_first, worker_last) and flat(ingress_first, ingress_last)
        and flat(pinned_first, pinned_last),
    }


def app_args(checkpoint_root: Path, gpu_plans: int, max_ongoing: int) -> dict[str, Any]:
    args = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    args["engine"]["checkpoint_root"] = str(checkpoint_root)
    args["engine"]["device"] = "cpu"
    args["engine"]["adaln"]["gpu_plans"] = gpu_plans
    args["worker"]["max_ongoing_requests"] = max_ongoing
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 s of load (overrides --duration)")
    parser.add_argument("--duration", type=float, default=240.0, help="seconds of load")
    parser.add_argument("--warmup-s", type=float, default=None, help="memory baseline starts after (default 10%%)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent closed-loop clients")
    parser.add_argument("--requests", type=int, default=24, help="distinct request bodies in the mix")
    parser.add_argument("--gpu-plans", type=int, default=16, help="adaln.gpu_plans (small: plans churn)")
    parser.add_argument("--max-ongoing", type=int, default=8, help="worker.max_ongoing_requests")
    parser.add_argument("--checkpoint-root", type=Path, default=ROOT / "checkpoints")
    parser.add_argument("--sample-s", type=float, default=2.0, help="memory sampling period")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="client timeout per request")
    parser.add_argument("--json", type=Path, default=None, help="where to write the summary")
    args = parser.parse_args(argv)
    duration = 60.0 if args.quick else args.duration
    warmup = args.warmup_s if args.warmup_s is not None else max(5.0, 0.1 * duration)

    from ray import serve

    from bench.common import command_line, device_description, git_commit
    from deployments.app import build_app
    from tests.serve_helpers import serve_cluster, wait_healthy

    config = app_args(args.checkpoint_root.resolve(), args.gpu_plans, args.max_ongoing)
    bodies = request_mix(args.requests)
    with serve_cluster() as url:
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        wait_healthy(url)  # the replica has made (or found) the checkpoint the references read
        t0 = time.monotonic()
        refs = references(config["engine"], bodies)
        print(f"{len(bodies)} references computed in {time.monotonic() - t0:.1f} s; "
              f"load: {args.clients} clients for {duration:.0f} s", flush=True)
        sampler = MemorySampler(args.sample_s)
        sampler.start()
        outcomes: list[Outcome] = []
        load_start = time.monotonic()
        deadline = load_start + duration
        with ThreadPoolExecutor(args.clients) as pool:
            for k in range(args.clients):
                pool.submit(client, url, bodies, refs, deadline, random.Random(1000 + k), outcomes, args.timeout_s)
        elapsed = time.monotonic() - load_start
        sampler.stop()
        health = requests.get(f"{url}/healthz", timeout=30).json()
    summary = summarize(outcomes, sampler.samples, load_start, warmup, elapsed)
    summary.update(
        command=command_line(), commit=git_commit(), device=device_description("cpu"), clients=args.clients,
        distinct_requests=len(bodies), gpu_plans=args.gpu_plans, warmup_s=warmup,
        worker_health_after=health.get("worker"),
    )
    print(json.dumps(summary, indent=2))
    out = args.json or ROOT / "bench" / "results" / f"load-cpu-{'quick' if args.quick else 'full'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    good = summary["lost"] == 0 and summary["wrong"] == 0 and summary["memory_flat"]
    print(f"{'PASS' if good else 'FAIL'}: {summary['ok']}/{summary['sent']} ok, {summary['lost']} lost, "
          f"{summary['wrong']} wrong, p50 {summary['latency_p50_s']:.3f} s, p99 {summary['latency_p99_s']:.3f} s, "
          f"worker RSS {summary['worker_rss_mib_first_last_quartile'][0]:.0f} -> "
          f"{summary['worker_rss_mib_first_last_quartile'][1]:.0f} MiB; wrote {out}")
    return 0 if good else 1


if __name__ == "__main__":
    raise SystemExit(main())
