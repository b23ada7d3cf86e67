"""The served app measured against its parts: plan tiers, denoise, Serve overhead, scale-up, GPU utilization.

Starts the real app (`deployments.app.build_app` from serve_config.yaml, HTTP on a local port) in a local Ray
cluster and drives it over HTTP and through the Python handle; every number in the report comes back through
the app (the engine's `timings` and `stats` in each response), next to what the component benches measure for
the same bytes in the same process:

- plan_s per tier, served: the first miss after start, later misses from the page cache, a miss from a cold disk
  (POSIX_FADV_DONTNEED on the transformer's shards first), a GPU-slab hit, a host-tier hit and a node-pool hit,
  each beside `bench.adaln.component_tiers` for the same checkpoint and schedule (run before Serve starts and
  again after the load, in this process), and beside its floor (bytes / bandwidth);
- denoise time per forward, served vs a direct `engine.Engine` call in this process (before Serve starts);
- Serve overhead (client latency minus the engine's total_s, the stages' own work) at p50/p99: one client (no
  queueing) over the handle and over HTTP, then `--clients` concurrent clients (queueing), each split by hop from
  the response's `serve_timings` (`overhead_hops`: client <-> ingress, the ingress's own work, the TextEncoder and
  Decoder round trips, the worker call beyond the phases it ran, the response's encoding);
- scale-up: the Worker scaled in place to one replica per GPU (Serve's external scaler; the transformer shards read
  into the page cache first, as a replica that starts later finds them); the new replica's timeline in wall-clock
  parts that add up (scale request -> its first import of our code -> module imported -> constructor -> ready ->
  RUNNING) and until it first answers (its first requests for served schedules find their plans in the pool);
- GPU utilization per device under the concurrent load (pynvml, else nvidia-smi; "n/a" without either).

The tier sequence runs on one replica (so the tiers are what they say): with the slab sized to one request's
plans (`gpu_plans` = distinct plans per request) and the host tier to two requests' rows, the schedules
W, A, A, B, A, (drop page cache) C, B give: W first miss, A miss, A GPU hit, B miss, A host hit, C cold miss,
B pool hit (B's group left the host tier when C was stored; the pool kept it).

    python -m bench.app --smoke                          # CPU: the tiny checkpoint, 1 replica, < 1 min
    python -m bench.app --num-blocks 12 --steps 20       # GPUs: h3 width (made under checkpoints/ if absent)
    python -m bench.app --sp 2 ...                       # one replica over 2 GPUs (engine.parallel.sp; CPU: gloo)

With `--sp N` the app serves engine.parallel.sp = N (one Worker replica coordinating N rank actors in its
placement group, stages fused) and an SP section compares it with the one-process parts of the same run: denoise
per forward vs the direct SP1 engine call, the plan miss vs bench.adaln's, the coordinator's share of the
Serve overhead; the scale-up is skipped with its reason when the node holds one such replica.

Writes bench/results/app-<device>.md and .json (commit, device, command). Floors use the H200 limits in
shared/reference.md (`bench.adaln.LIMITS`); on a CPU they are only a scale.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import ray
import torch
import yaml
from ray import serve

from bench.adaln import LIMITS, component_tiers, drop_page_cache
from bench.common import command_line, write_results
from bench.routing import percentile
from cache.config import AdalnConfig
from engine.startup import ReplicaStartup
from model.layout import H3Checkpoint
from model.schedule import H3Schedule
from model.weights import TransformerWeights

ROOT = Path(__file__).resolve().parents[1]
POOL_NAMESPACE = "ditserve"  # actors.host_cache_pool.POOL_NAMESPACE (not imported: it pulls in the pool actor)
APP_NAME = "bench_app"
PROMPT = "a lighthouse on a cliff at dusk, waves breaking below"
#: One schedule per tier role (video flow shift; audio shift 3): W first miss, A/B page-cache misses, C cold.
SHIFTS = {"W": 1.5, "A": 2.0, "B": 2.5, "C": 3.5}


# --------------------------------------------------------------------------------------------------
# Checkpoint, config, requests
# --------------------------------------------------------------------------------------------------


def ensure_checkpoint(args) -> Path:
    """`--checkpoint`, else made once: the tiny one (`model.tiny`) for --smoke, else a random h3-width one with
    `--num-blocks` blocks and released-size components (`bench.checkpoints`)."""
    from bench.checkpoints import ensure_bench_checkpoint

    default = "tiny-diffusers" if args.smoke else f"h3-b{args.num_blocks}-t{args.text_layers}"
    return ensure_bench_checkpoint(args.checkpoint or ROOT / "checkpoints" / default, tiny=args.smoke,
                                   num_blocks=args.num_blocks, text_layers=args.text_layers)


def transformer_shards(checkpoint: Path) -> List[str]:
    return sorted(str(p) for p in H3Checkpoint.open(checkpoint).transformer_dir.glob("*.safetensors"))


def warm_page_cache(paths: List[str]) -> None:
    """Read every file once so its pages are cached (the 'page cache' tiers)."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def engine_args(args, checkpoint: Path, num_plans: int, group_rows: int, page_bytes: int) -> Dict[str, Any]:
    """serve_config.yaml's `engine` with this benchmark's checkpoint and tier sizes (see the module docstring)."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    engine = config["applications"][0]["args"]["engine"]
    engine.update(checkpoint=str(checkpoint), device="auto", geometry={"short_edge": None}, adapters={})
    # (no adapters: the shipped auto-made one fits only an auto-made checkpoint)
    if args.text_layers and not args.smoke and not args.checkpoint:
        engine["text_encoder"]["hidden_state_index"] = args.text_layers
    engine["adaln"].update(mode="online", gpu_plans=num_plans,
                           host_cache_gb=2 * group_rows * page_bytes * 1.02 / 1e9)
    engine["pool"].update(enabled=True, capacity_gb=max(1.0, 8 * group_rows * page_bytes / 1e9))
    # --sp N: one replica of N rank actors, one device each (gloo ranks on CPU); the builder then runs the stages
    # fused and reserves the replica's placement group from these names alone, as `serve run` would.
    engine["parallel"].update(sp=args.sp)
    return engine


def app_args(args, engine: Dict[str, Any], replicas: int) -> Dict[str, Any]:
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = config["applications"][0]["args"]
    app["engine"] = engine
    app["worker"].update(num_replicas=replicas, max_ongoing_requests=args.max_ongoing)
    return app


def request_body(args, shift: float, seed: int) -> Dict[str, Any]:
    return {"prompt": PROMPT, "steps": args.steps, "seconds": args.seconds, "width": args.width,
            "height": args.height, "flow_shift": shift, "seed": seed, "return_video": False}


def schedule_plans(args, shift: float) -> List[torch.Tensor]:
    """The request's distinct plans (fp32 timesteps), as the engine asks the plan cache for them."""
    distinct = {p.numpy().tobytes(): p for p in H3Schedule.build(args.steps, shift, 3.0).plans}
    return list(distinct.values())


# --------------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------------


def direct_engine(args, engine_config: Dict[str, Any]) -> Dict[str, float]:
    """Denoise seconds per forward of a direct `Engine.generate` in this process (second of two calls)."""
    from engine.api import GenerationRequest
    from engine.config import EngineConfig
    from engine.engine import Engine

    # One process, one device: at --sp N this is the SP1 engine the served SP N replica is compared with.
    config = dict(engine_config, pool={**engine_config["pool"], "enabled": False},
                  parallel={**engine_config["parallel"], "sp": 1})
    engine = Engine(EngineConfig(**config))
    request = GenerationRequest(**request_body(args, SHIFTS["A"], 7))
    try:
        engine.generate(request)
        result = engine.generate(request)
        return {"denoise_s": result.timings.denoise_s, "forwards": result.stats.forwards,
                "total_s": result.timings.total_s}
    finally:
        if engine.plan_cache is not None:
            engine.plan_cache.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class GpuSampler:
    """Mean utilization per GPU while running, sampled every `period_s` (pynvml, else nvidia-smi)."""

    def __init__(self, period_s: float = 0.25):
        self.period_s = period_s
        self.samples: Dict[int, List[float]] = {}
        self.source = "n/a"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._read: Optional[Callable[[], List[float]]] = self._reader()

    def _reader(self) -> Optional[Callable[[], List[float]]]:
        if not torch.cuda.is_available():
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.source = "pynvml"
            return lambda: [float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in handles]
        except Exception:  # noqa: BLE001 - not installed or no driver: try the CLI
            pass
        if shutil.which("nvidia-smi") is None:
            return None
        self.source = "nvidia-smi"

        def smi() -> List[float]:
            out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5).stdout
            return [float(line) for line in out.split()]
        return smi

    def __enter__(self) -> "GpuSampler":
        if self._read is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with contextlib.suppress(Exception):
                for i, value in enumerate(self._read()):
                    self.samples.setdefault(i, []).append(value)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def summary(self) -> str:
        if not self.samples:
            return "n/a"
        return ", ".join(f"gpu{i} {np.mean(v):.0f}%" for i, v in sorted(self.samples.items()))


def http_generate(url: str, body: Dict[str, Any], timeout_s: float) -> Dict[str, Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/v1/generations", data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def record(kind: str, latency_s: float, timings: Dict[str, float], stats: Dict[str, Any],
           serve_timings: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    adaln = stats.get("adaln", {})
    return {"kind": kind, "latency_s": latency_s, **timings, "forwards": stats.get("forwards"),
            **{k: adaln.get(k, 0) for k in ("gpu_hit_plans", "host_hit_plans", "pool_hit_plans", "built_plans",
                                             "rebuild_s", "rebuild_bytes_read", "page_cache_bytes", "disk_bytes",
                                             "h2d_bytes", "pool_lookup_s", "prepare_s")},
            "hops": overhead_hops(latency_s, timings, serve_timings or {}),
            "parallel": stats.get("parallel")}  # sp > 1: sp, ranks_agree, every rank's plan counters


#: The parts of the serving overhead (client latency - the engine's total_s), in request order.
HOPS = ("client <-> ingress", "ingress own work", "TextEncoder round trip", "worker call outside its phases",
        "Decoder round trip", "response encoding")


def overhead_hops(latency_s: float, timings: Dict[str, float], serve: Dict[str, Any]) -> Dict[str, float]:
    """latency - total_s split by the response's `serve_timings` (deployments.schemas.ServeTimings); the parts
    sum to it. Stage round trips are their calls minus the work the stage reported (encode_s, decode_s + mux_s);
    the worker call's part is its wait minus the phases it ran (plan + denoise; every stage when fused)."""
    if not serve:
        return {}
    encode_call, decode_call = serve.get("encode_call_s"), serve.get("decode_call_s")
    engine_work = timings["plan_s"] + timings["denoise_s"]
    engine_work += timings["encode_s"] if encode_call is None else 0.0
    engine_work += timings["decode_s"] + timings["mux_s"] if decode_call is None else 0.0
    calls = serve["engine_call_s"] + (encode_call or 0.0) + (decode_call or 0.0)
    return {
        "client <-> ingress": latency_s - serve["ingress_s"],
        "ingress own work": serve["ingress_s"] - calls - serve["respond_s"],
        "TextEncoder round trip": encode_call - timings["encode_s"] if encode_call is not None else 0.0,
        "worker call outside its phases": serve["engine_call_s"] - engine_work,
        "Decoder round trip": decode_call - timings["decode_s"] - timings["mux_s"] if decode_call is not None else 0.0,
        "response encoding": serve["respond_s"],
    }


async def via_handle(handle, body: Dict[str, Any], kind: str) -> Dict[str, Any]:
    start = time.perf_counter()
    out = await handle.generate.remote(body)
    return record(kind, time.perf_counter() - start, out.timings.model_dump(), out.stats,
                  out.serve_timings.model_dump() if out.serve_timings is not None else None)


async def via_http(url: str, body: Dict[str, Any], kind: str, timeout_s: float) -> Dict[str, Any]:
    start = time.perf_counter()
    out = await asyncio.to_thread(http_generate, url, body, timeout_s)
    return record(kind, time.perf_counter() - start, out["timings"], out["stats"], out.get("serve_timings"))


async def tier_sequence(args, handle, shards: List[str]) -> Dict[str, Dict[str, Any]]:
    """W, A, A, B, A, (cold) C, B on one replica: see the module docstring."""
    out: Dict[str, Dict[str, Any]] = {}
    warm_page_cache(shards)
    steps = [("first miss after start (page cache)", "W"), ("miss, page cache", "A"), ("GPU-slab hit", "A"),
             ("miss, page cache (2nd)", "B"), ("host hit", "A"), ("miss, cold (DONTNEED)", "C"), ("pool hit", "B")]
    for i, (tier, schedule) in enumerate(steps):
        if schedule == "C":
            out["_dropped"] = {"how": drop_page_cache(shards, system_wide=False)}
        out[tier] = await via_handle(handle, request_body(args, SHIFTS[schedule], i), tier)
    return out


async def overhead_runs(args, handle, url: str) -> Dict[str, List[Dict[str, Any]]]:
    """One client over the handle, one over HTTP (no queueing), then `--clients` at once (queueing)."""
    body = lambda i: request_body(args, SHIFTS["A"], 100 + i)  # noqa: E731 - a warm schedule: GPU-slab hits
    runs: Dict[str, List[Dict[str, Any]]] = {"handle, 1 client": [], "HTTP, 1 client": []}
    for i in range(args.repeats):
        runs["handle, 1 client"].append(await via_handle(handle, body(i), "handle"))
        runs["HTTP, 1 client"].append(await via_http(url, body(i), "http", args.timeout_s))
    return runs


async def concurrent_load(args, handle, clients: int, requests: int) -> List[Dict[str, Any]]:
    """`clients` closed-loop clients over the handle, `requests` in all, cycling over the served schedules."""
    queue = list(range(requests))[::-1]
    names = list(SHIFTS)
    records: List[Dict[str, Any]] = []

    async def client() -> None:
        while queue:
            i = queue.pop()
            records.append(await via_handle(handle, request_body(args, SHIFTS[names[i % len(names)]], 200 + i),
                                            "queued"))

    await asyncio.gather(*(client() for _ in range(clients)))
    return records


async def worker_cards(seen: set, want_new: bool, tries: int = 40) -> List[Dict[str, Any]]:
    """`describe()` of Worker replicas (replica id + start-up timings) by asking until one outside `seen`
    answers (`want_new`) or `tries` calls; calls without a schedule key go to a random idle replica."""
    worker = serve.get_deployment_handle("Worker", APP_NAME)
    cards: Dict[str, Dict[str, Any]] = {}
    for _ in range(tries):
        card = await worker.describe.remote()
        cards[card["replica"]] = card
        if want_new and set(cards) - seen:
            break
    return list(cards.values())


def scale_worker(replicas: int) -> None:
    """Ask Serve for `replicas` Worker replicas in place: the running ones stay. (`serve.run` with a new
    num_replicas is no scale-up: an imperative deploy gets a fresh code version, so Serve replaces every replica
    of every deployment in a rolling update.) Serve's external-scaler call, as its dashboard's scale route makes
    it; the app is deployed with `external_scaler_enabled=True`."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    ray.get(controller.update_deployment_replicas.remote(DeploymentID(name="Worker", app_name=APP_NAME), replicas))


async def running_at(replicas: int, timeout_s: float, period_s: float = 0.05) -> float:
    """Wall-clock time at which Serve first reports `replicas` Worker replicas RUNNING (polled every period_s)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        states = serve.status().applications[APP_NAME].deployments["Worker"].replica_states
        if states.get("RUNNING", 0) >= replicas:
            return time.time()
        await asyncio.sleep(period_s)
    raise TimeoutError(f"the Worker did not reach {replicas} RUNNING replicas within {timeout_s} s")


async def scale_up(args, replicas: int, shards: List[str]) -> Dict[str, Any]:
    """Scale the Worker from 1 to `replicas` in place (`scale_worker`); wall-clock times of the request, of Serve
    reporting every replica RUNNING, and of the first answer that came from a new replica (plans from the pool
    or rebuilt: the old replica holds every served schedule), each request's own completion time (not the end of
    its batch); then the new replica's start-up timeline (`describe()`). The transformer shards are read into
    the page cache first: the cold tier dropped them, and a replica that starts later finds them cached (the
    first replica's load read them so), so the new replica's load is not a cold-disk read."""
    old = {card["replica"] for card in await worker_cards(set(), want_new=False, tries=4)}
    warm_page_cache(shards)
    handle = serve.get_app_handle(APP_NAME)
    asked_at = time.time()
    await asyncio.to_thread(scale_worker, replicas)
    running = await running_at(replicas, args.timeout_s)

    async def timed(body: Dict[str, Any]) -> Dict[str, Any]:
        out = await via_handle(handle, body, "scale")
        return {**out, "answered_at": time.time()}

    first_new: Optional[Dict[str, Any]] = None
    deadline = time.time() + args.timeout_s
    i = 0
    while first_new is None and time.time() < deadline:
        batch = await asyncio.gather(*(timed(request_body(args, SHIFTS[s], 300 + i + j)) for j, s in enumerate(SHIFTS)))
        i += len(SHIFTS)
        news = [r for r in batch if r["pool_hit_plans"] or r["built_plans"]]
        if news:
            first_new = dict(min(news, key=lambda r: r["answered_at"]))
    new_cards = [card for card in await worker_cards(old, want_new=True) if card["replica"] not in old]
    return {"asked_at": asked_at, "running_at": running,
            "answered_at": first_new["answered_at"] if first_new else None, "first": first_new,
            "startup": new_cards[0]["startup"] if new_cards else None}


#: What `--preload` has Ray import into its worker processes as they start: the Worker deployment's module.
PRELOAD_MODULE = "deployments.worker"

#: The scale-up's timeline, consecutive parts from the scale request to Serve reporting the replica RUNNING:
#: (row name, from, to, what the part holds); `startup` fields, or "asked_at" / "running_at" of `scale_up`.
SCALE_UP_PARTS = (
    ("scale request -> replica's first import of our code", "asked_at", "import_started_at",
     "Serve's controller, Ray's actor (worker process, possibly started in advance), Serve's replica set-up"),
    ("module imports", "import_started_at", "imported_at", "the deployment module: torch, Ray Serve, our modules"),
    ("module imported -> constructor", "imported_at", "constructor_at", "Serve's replica set-up after the import"),
    ("constructor -> ready", "constructor_at", "ready_at", "model imports, engine build, weights follower"),
    ("ready -> Serve reports it RUNNING", "ready_at", "running_at",
     "Serve's first health check and its controller's loop (polled every 50 ms)"),
)


def startup_rows(replicas: int, scaled: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The scale-up as consecutive parts (they add up to request -> RUNNING), the first new answer, and the new
    replica's constructor and engine breakdown (`engine.startup.ReplicaStartup` / `EngineStartup`)."""
    prefix = f"scale-up 1 -> {replicas}"
    first = scaled.get("first") or {}
    answered = scaled["answered_at"] - scaled["asked_at"] if scaled.get("answered_at") else None
    rows = [{"metric": f"{prefix}: scale request -> {replicas} replicas RUNNING",
             "app_s": scaled["running_at"] - scaled["asked_at"],
             "detail": "Serve's external scaler: the running replica stays; the page cache holds the shards"}]
    startup = scaled.get("startup")
    if startup is None:
        rows.append({"metric": f"{prefix}: new replica start-up", "app_s": None,
                     "detail": "n/a: no new replica answered describe()"})
    else:
        asked = scaled["asked_at"]
        times = {**startup, "asked_at": asked, "running_at": scaled["running_at"]}
        # Each part from the scale request on: a part before it (imports Ray preloaded into its idle worker
        # process) is 0 here and reported on its own below, so the parts still add up to request -> RUNNING.
        rows += [{"metric": f"{prefix}:   - {name}", "app_s": max(times[end], asked) - max(times[begin], asked),
                  "detail": detail} for name, begin, end, detail in SCALE_UP_PARTS]
        if startup.get("preloaded") and startup["imported_at"] <= asked:  # else Ray started the process for it
            rows.append({"metric": f"{prefix}: module imports before the scale request (preloaded)",
                         "app_s": startup["imported_at"] - startup["import_started_at"],
                         "detail": "RAY_preload_python_modules: Ray's worker process imported the deployment module "
                                   "when it started, before the replica was asked for"})
        process = startup.get("process_started_at")
        rows.append({"metric": f"{prefix}: new replica's process started (before the scale request: < 0)",
                     "app_s": None if process is None else process - scaled["asked_at"],
                     "detail": "Ray keeps worker processes started in advance; not the replica's start"})
    rows.append({"metric": f"{prefix}: scale request -> first answer from a new replica", "app_s": answered,
                 "detail": f"that request's own completion; its latency {first.get('latency_s')}, plan_s "
                           f"{first.get('plan_s')}, pool_hit_plans {first.get('pool_hit_plans')}, "
                           f"built_plans {first.get('built_plans')}"})
    if startup is None:
        return rows
    rows += [{"metric": f"{prefix}: new replica: {name}", "app_s": value, "detail": detail} for name, value, detail in (
        ("model imports in the constructor", startup["imports_s"], "what the replica's module imports had not pulled in"),
        ("engine build", startup["build_ended_at"] - startup["build_started_at"],
         "pool client + Engine constructor, on the engine thread"))]
    engine = startup.get("engine")
    if engine:
        gbps = engine["transformer_bytes"] / engine["transformer_s"] / 1e9 if engine["transformer_s"] else 0.0
        for key, detail in (
                ("device_init_s", "CUDA context"), ("checkpoint_s", "layout, config, index, shard headers, fingerprint"),
                ("transformer_s", f"{engine['transformer_bytes'] / 1e9:.2f} GB at {gbps:.1f} GB/s, "
                                  f"{engine['num_readers']} readers"),
                ("hooks_s", "ExternalModulation, offload, Cache-DiT"), ("plan_cache_s", "slab + host tier"),
                ("warm_up_s", "plan cache warm-up"), ("text_encoder_s", "Qwen3-VL (fused engines)"),
                ("vae_s", "VAEs (fused engines)"),
                ("total_s", "the Engine constructor")):
            rows.append({"metric": f"{prefix}: new replica: engine {key}", "app_s": engine[key], "detail": detail})
    return rows


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 2) if a is not None and b else None


def plan_rows(tiers: Dict[str, Dict[str, Any]], before: Dict[str, dict], after: Dict[str, dict]) -> List[Dict]:
    component = {"first miss after start (page cache)": "miss_page_cache", "miss, page cache": "miss_page_cache",
                 "miss, page cache (2nd)": "miss_page_cache", "miss, cold (DONTNEED)": "miss_cold",
                 "GPU-slab hit": "gpu_hit", "host hit": "host_hit", "pool hit": None}
    limits = {"miss_page_cache": LIMITS["page_cache_read_gbps"], "miss_cold": LIMITS["cold_disk_gbps"],
              "host_hit": LIMITS["h2d_gbps"]}
    rows = []
    for tier, name in component.items():
        served = tiers.get(tier)
        if served is None:
            continue
        bench = before.get(name, {}) if name else {}
        bench_after = after.get(name, {}) if name else {}
        nbytes = served["rebuild_bytes_read"] or served["h2d_bytes"]
        floor = nbytes / (limits[name] * 1e9) if name in limits and nbytes else None
        plans = {k: served[k] for k in ("built_plans", "gpu_hit_plans", "host_hit_plans", "pool_hit_plans") if served[k]}
        rows.append({
            "metric": f"plan_s: {tier}", "app_s": served["plan_s"],
            "bench_s": bench.get("seconds"), "bench_after_s": bench_after.get("seconds"),
            "x_bench": ratio(served["plan_s"], bench.get("seconds")),
            "floor_s": floor, "x_floor": ratio(served["plan_s"], floor),
            "detail": f"{plans}; prepare_s {served['prepare_s']:.4f}, rebuild_s {served['rebuild_s']:.4f}; bytes {nbytes}"
                      + (f" (page cache {served['page_cache_bytes']}, disk {served['disk_bytes']})"
                         if served["rebuild_bytes_read"] else "")
                      + (f"; pool_lookup_s {served['pool_lookup_s']:.4f}" if served["pool_lookup_s"] else ""),
        })
    return rows


def overhead_rows(metric: str, records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The overhead's p50/p99, then one row per hop (p50 of each part; the parts' p50s need not sum exactly)."""
    over = [r["latency_s"] - r["total_s"] for r in records]
    rows = [{"metric": metric, "app_s": percentile(over, 50), "bench_s": None,
             "detail": f"p50 {1e3 * percentile(over, 50):.1f} ms, p99 {1e3 * percentile(over, 99):.1f} ms over "
                       f"{len(over)} requests; latency p50 {percentile([r['latency_s'] for r in records], 50):.3f} s"}]
    with_hops = [r["hops"] for r in records if r.get("hops")]
    for hop in HOPS if with_hops else ():
        values = [h[hop] for h in with_hops]
        rows.append({"metric": f"  - {hop}", "app_s": percentile(values, 50),
                     "detail": f"p50 {1e3 * percentile(values, 50):.2f} ms, p99 {1e3 * percentile(values, 99):.2f} ms"})
    return rows


# --------------------------------------------------------------------------------------------------
# Sequence parallel (--sp N): one replica over N devices
# --------------------------------------------------------------------------------------------------


def replicas_at(args, gpus: int) -> Tuple[int, Optional[str]]:
    """Replicas after the tier sequence, and why the scale-up is skipped (None: it runs or is not asked for).
    SP1: one per GPU (or --replicas). SP N: a replica takes N GPUs, so a node of N GPUs holds one; on CPU the
    smoke keeps the one replica of N gloo ranks (each rank reserves a CPU of the local cluster)."""
    if args.sp == 1:
        return args.replicas or max(1, gpus), None
    fit = gpus // args.sp if gpus else 1
    want = args.replicas or max(1, fit)
    if 1 < want <= fit:
        return want, None
    if not gpus:
        why = f"on CPU the bench keeps one replica of {args.sp} gloo ranks"
    elif want == 1 and fit > 1:
        why = "--replicas 1"
    else:
        why = f"{max(want, 2)} replicas x {args.sp} GPUs need {max(want, 2) * args.sp}, this node has {gpus}"
    return 1, f"n/a at sp {args.sp}: {why}"


def sp_placement_note(args, engine: Dict[str, Any]) -> str:
    """What the builder reserved for the SP replica from serve_config's names (the same call `build_app` made)."""
    from deployments.app import cluster_num_gpus, resolve_engine_config, worker_deployment_options
    from deployments.schemas import AppConfig

    config = AppConfig.model_validate(app_args(args, engine, 1))
    options = worker_deployment_options(config.worker, cluster_num_gpus(), resolve_engine_config(config.engine))
    return (f"sp {args.sp}: stages fused (rank 0 encodes and decodes); Worker replica ray_actor_options "
            f"{options['ray_actor_options']}, placement_group_bundles {options['placement_group_bundles']} "
            f"({options['placement_group_strategy']}): bundle 0 the coordinator, one bundle per rank actor")


def sp_rows(sp: int, tiers: Dict[str, Dict[str, Any]], before: Dict[str, dict],
            runs: Dict[str, List[Dict[str, Any]]], direct: Optional[Dict[str, float]]) -> List[Dict[str, Any]]:
    """At --sp N: the served SP N replica against the one-process parts measured in this run. Denoise per forward
    vs the direct SP1 `Engine.generate` (bench.parallel's SP1 runs this same engine loop; it is not re-run here);
    the served plan miss (rank 0's plan_s: each rank rebuilds 1/N of the AdaLN units, then the ranks exchange
    rows) vs bench.adaln's one-device miss; the coordinator's part of the Serve overhead (the engine call beyond
    rank 0's phases: Ray calls to the ranks, progress polls, every rank's result back); and whether every rank
    ended every request with rank 0's latents."""
    every = [r for r in tiers.values() if "latency_s" in r] + [r for records in runs.values() for r in records]
    parallel = [r["parallel"] for r in every if r.get("parallel")]
    rows: List[Dict[str, Any]] = []
    served_step = float(np.median([r["denoise_s"] / r["forwards"] for r in runs["handle, 1 client"]]))
    direct_step = direct["denoise_s"] / direct["forwards"] if direct else None
    rows.append({"metric": f"SP{sp}: denoise per forward, served SP{sp} vs direct SP1", "app_s": served_step,
                 "bench_s": direct_step, "x_bench": ratio(served_step, direct_step),
                 "detail": (f"speedup {direct_step / served_step:.3f}x over the one-process engine (ideal {sp}x)"
                            if direct_step else "no direct call (--no-direct)")})
    for tier, component in (("miss, page cache", "miss_page_cache"), ("miss, cold (DONTNEED)", "miss_cold")):
        served, bench = tiers.get(tier), before.get(component, {})
        if served is None:
            continue
        by_rank = (served.get("parallel") or {}).get("adaln_by_rank") or []
        rows.append({"metric": f"SP{sp}: plan_s {tier}, served SP{sp} vs bench.adaln (one device)",
                     "app_s": served["plan_s"], "bench_s": bench.get("seconds"),
                     "x_bench": ratio(served["plan_s"], bench.get("seconds")),
                     "detail": "bytes read per rank " + "/".join(str(a["rebuild_bytes_read"]) for a in by_rank)
                               + f", one device {bench.get('bytes', 'n/a')}; rebuild_s per rank "
                               + "/".join(f"{a['rebuild_s']:.4f}" for a in by_rank)})
    for name in ("handle, 1 client", "HTTP, 1 client"):
        hops = [r["hops"]["worker call outside its phases"] for r in runs[name] if r.get("hops")]
        if hops:
            rows.append({"metric": f"SP{sp}: coordinator <-> ranks ({name})", "app_s": percentile(hops, 50),
                         "detail": f"the engine call beyond rank 0's phases: p50 {1e3 * percentile(hops, 50):.1f} "
                                   f"ms, p99 {1e3 * percentile(hops, 99):.1f} ms; part of the Serve overhead rows"})
    agree = [p["ranks_agree"] for p in parallel]
    rows.append({"metric": f"SP{sp}: every rank ended with rank 0's latents", "app_s": None,
                 "detail": f"{sum(agree)} of {len(agree)} requests (stats.parallel.ranks_agree); "
                           f"{len(every) - len(parallel)} responses without stats.parallel"})
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    start = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny checkpoint, 4 steps, a few requests")
    parser.add_argument("--checkpoint", default=None, help="checkpoint dir (made if absent)")
    parser.add_argument("--num-blocks", type=int, default=12, help="blocks of a made h3-width checkpoint")
    parser.add_argument("--text-layers", type=int, default=5, help="Qwen3-VL layers of a made checkpoint")
    parser.add_argument("--steps", type=int, default=None, help="default 20; smoke 4")
    parser.add_argument("--width", type=int, default=None, help="default 1280; smoke 64")
    parser.add_argument("--height", type=int, default=None, help="default 768; smoke 64")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=None, help="requests per no-queueing overhead run (8; smoke 3)")
    parser.add_argument("--clients", type=int, default=None, help="concurrent clients of the load (default 3 x replicas)")
    parser.add_argument("--load-requests", type=int, default=None, help="requests of the load (default 4 x clients)")
    parser.add_argument("--max-ongoing", type=int, default=4, help="worker max_ongoing_requests")
    parser.add_argument("--replicas", type=int, default=None, help="after the tier sequence (default: GPUs, 1 on CPU; "
                        "GPUs / sp with --sp)")
    parser.add_argument("--sp", type=int, default=1, help="engine.parallel.sp: one replica over N GPUs (N gloo "
                        "ranks on CPU), stages fused; compared with the direct one-process engine call")
    parser.add_argument("--no-direct", action="store_true", help="skip the direct engine call")
    parser.add_argument("--preload", action="store_true", help="start Ray with RAY_preload_python_modules="
                        f"{PRELOAD_MODULE}: its worker processes import the deployment module when they start, before "
                        "a replica is placed in one (README, 'Deploying on a cluster')")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = parser.parse_args(argv)
    if args.sp < 1:
        parser.error(f"--sp {args.sp}: the sequence-parallel degree is at least 1")
    args.steps = args.steps or (4 if args.smoke else 20)
    args.width = args.width or (64 if args.smoke else 1280)
    args.height = args.height or (64 if args.smoke else 768)
    args.repeats = args.repeats or (3 if args.smoke else 8)

    rows: List[Dict[str, Any]] = []
    notes: List[str] = []
    data: Dict[str, Any] = {}
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    device = f"cuda-x{gpus}" if gpus else "cpu"
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    if not cuda:
        # This process's component runs get the replica's torch threads (Ray sets OMP_NUM_THREADS to its num_cpus):
        # on a loaded 2-core box 2 OpenMP threads beside 16 reader threads made a tiny miss 0.4-0.8 s instead of
        # 0.012 s and a forward ~30x slower, so like is compared with like.
        worker = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]["worker"]
        torch.set_num_threads(max(1, int(worker["num_cpus"])))
        notes.append(f"CPU: this process runs with {torch.get_num_threads()} torch thread(s), as the replica does")
    try:
        checkpoint = ensure_checkpoint(args).resolve()
        shards = transformer_shards(checkpoint)
        checkpoint_view = H3Checkpoint.open(checkpoint)
        reader = TransformerWeights(checkpoint_view.transformer_dir, checkpoint_view.layout)
        dims = reader.config
        plans = schedule_plans(args, SHIFTS["A"])
        num_plans, group_rows = len(plans), sum(p.numel() for p in plans)
        page_bytes = (dims.num_blocks * dims.adaln_width + dims.final_adaln_width) * 2
        engine = engine_args(args, checkpoint, num_plans, group_rows, page_bytes)
        notes.append(f"checkpoint {checkpoint} ({dims.num_blocks} blocks, hidden {dims.hidden_size}); request "
                     f"{args.width}x{args.height} {args.seconds} s, {args.steps} steps ({num_plans} distinct plans, "
                     f"{group_rows} rows); slab gpu_plans={num_plans}, host tier {engine['adaln']['host_cache_gb']:.4f} GB "
                     "(two requests' rows), pool on")

        # 1. Components, before Serve: bench.adaln's tiers for schedule A, and a direct engine call.
        adaln_config = AdalnConfig(**engine["adaln"])
        torch_device = torch.device("cuda" if cuda else "cpu")
        warm_page_cache(shards)
        log("bench.adaln tiers (before Serve) ...")
        before = component_tiers(reader, plans, torch_device, adaln_config, shards)
        direct = None
        if not args.no_direct:
            log("direct engine call ...")
            direct = direct_engine(args, engine)

        # 2. The app: one replica for the tier sequence.
        t0 = time.perf_counter()
        if args.preload:  # the raylet reads it when it starts and passes it to every worker process
            os.environ["RAY_preload_python_modules"] = PRELOAD_MODULE
            notes.append(f"Ray started with RAY_preload_python_modules={PRELOAD_MODULE}")
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 **({"num_cpus": max(4, os.cpu_count() or 1, 1 + args.sp)} if not cuda else {}))  # sp: coordinator + ranks
        port = free_port()  # after ray.init: the cluster's processes bind ephemeral ports of their own as they start
        url = f"http://127.0.0.1:{port}"
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        from deployments.app import build_app

        # external_scaler_enabled: the scale-up below asks Serve for more Worker replicas in place.
        serve.run(build_app(app_args(args, engine, 1)), name=APP_NAME, route_prefix="/", external_scaler_enabled=True)
        handle = serve.get_app_handle(APP_NAME)
        if args.sp > 1:
            notes.append(sp_placement_note(args, engine))
        notes.append(f"Ray + Serve + first replica ready in {time.perf_counter() - t0:.1f} s")
        first = asyncio.run(worker_cards(set(), want_new=False, tries=1))[0]["startup"]
        notes.append("first replica: " + ReplicaStartup.from_dict(first).summary())
        log("tier sequence ...")
        tiers = asyncio.run(tier_sequence(args, handle, shards))
        data["tiers"] = tiers
        log("overhead without queueing ...")
        runs = asyncio.run(overhead_runs(args, handle, url))

        # 3. Scale up to one replica per GPU, then the concurrent load with the GPU sampler.
        replicas, scale_skipped = replicas_at(args, gpus)
        scaled = None
        if replicas > 1:
            log(f"scale-up to {replicas} replicas ...")
            scaled = asyncio.run(scale_up(args, replicas, shards))
            notes.append("scale-up: the transformer shards were read into the page cache again first (the cold "
                         "tier had dropped them); the Worker scaled in place (Serve's external scaler)")
        clients = args.clients or 3 * replicas
        load_requests = args.load_requests or 4 * clients
        log(f"load: {clients} clients, {load_requests} requests ...")
        with GpuSampler() as sampler:
            queued = asyncio.run(concurrent_load(args, handle, clients, load_requests))
        runs[f"handle, {clients} clients (queueing)"] = queued
        data["overhead"] = runs
        log("bench.adaln tiers (after the load, Serve up) ...")
        after = component_tiers(reader, plans, torch_device, adaln_config, shards)
        data["components"] = {"before": before, "after": after}

        rows += plan_rows(tiers, before, after)
        served_step = [r["denoise_s"] / r["forwards"] for r in runs["handle, 1 client"]]
        row = {"metric": "denoise per forward", "app_s": float(np.median(served_step))}
        if direct is not None:
            row.update(bench_s=direct["denoise_s"] / direct["forwards"],
                       x_bench=ratio(row["app_s"], direct["denoise_s"] / direct["forwards"]),
                       detail=f"served median of {len(served_step)}; bench = direct Engine.generate in this process")
        rows.append(row)
        for name, records in runs.items():
            rows += overhead_rows(f"Serve overhead (latency - engine total_s): {name}", records)
        if scaled is not None:
            rows += startup_rows(replicas, scaled)
            data["scale_up"] = scaled
        else:
            rows.append({"metric": "scale-up", "app_s": None,
                         "detail": scale_skipped or "n/a: one replica (no second GPU)"})
        rows.append({"metric": "GPU utilization under the load", "app_s": None,
                     "detail": f"{sampler.summary()} ({sampler.source}); {clients} clients, {len(queued)} requests"})
        # 4. Sequence parallel: the SP N replica against the one-process parts of this run.
        if args.sp > 1:
            rows += sp_rows(args.sp, tiers, before, runs, direct)
    except BaseException as exc:  # noqa: BLE001 - write what was measured, then re-raise
        notes.append(f"run aborted: {type(exc).__name__}: {exc}"[:500])
        traceback.print_exc()
        raise
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        with contextlib.suppress(Exception):
            ray.shutdown()
        notes += [
            "app_s: served (engine timings through the app); bench_s: bench.adaln.component_tiers for the same "
            "checkpoint and schedule A before Serve started (bench_after_s: after the load), or the direct engine "
            "call; floor_s: bytes / bandwidth with " + ", ".join(f"{k}={v}" for k, v in LIMITS.items()
                                                                  if k.endswith("gbps")) + " GB/s (H200 figures).",
            f"total wall time {time.monotonic() - start:.0f} s",
        ]
        columns = ["metric", "app_s", "bench_s", "bench_after_s", "x_bench", "floor_s", "x_floor", "detail"]
        md, js = write_results("app", rows, device=device, command=command_line(), columns=columns, notes=notes,
                               out_dir=args.out)
        report = json.loads(js.read_text())
        report.update(data)
        js.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(md.read_text())
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    # Import ourselves under the package name so anything Serve pickles refers to `bench.app`.
    from bench import app

    raise SystemExit(app.main())
