"""Routing benchmark against the real app: ScheduleAffinityRouter vs Ray's default router.

`bench/routing.py` models the plan slab with a fake worker; this one deploys the real app (`build_app`):
real Engine replicas (one per GPU), the real AdaLN plan cache and, in one mode, the node-shared
host-cache pool. Each mode deploys the app from scratch, warms every replica up, sends `--requests`
requests (Zipf-distributed schedules, seeded) from `--clients` closed-loop clients over the Python handle,
and reads each response's plan counters. Modes:

- `affinity`: router schedule_affinity, pool off;
- `default`: Serve's default (power-of-two-choices) router, pool off;
- `affinity+pool`: schedule_affinity with the node-shared pool on (plans built on one replica are copied,
  not rebuilt, on the other).

The router comparison runs with the pool and the host tier off (`--host-cache-gb 0`), so a plan is either
in the replica's GPU slab or rebuilt, and the GPU-tier hit rate shows affinity alone. Between modes the app
is deleted and the pool actors killed, so no mode starts warm (the OS page cache of the checkpoint stays
warm for all: rebuilds here are page-cache rebuilds).

Model: "thin h3" is diffusers' MiniMax-H3 transformer (random weights, `bench.checkpoints`) that keeps h3's
AdaLN size (50 blocks, hidden 5376, time_embed_dim 2688: a 520 MB adaln_proj.linear per block, 26 GB in all,
and a 9.25 MiB plan row) but makes everything else tiny (1 head of 32, ffn 64, no refiner, text_dim 32 with the
tiny Qwen3-VL and VAEs of `model.tiny_components`), so a rebuild streams what it streams on h3 while a step
stays cheap (still ~50 launch-bound block forwards). The slab (`--gpu-plans`, default 1.28 x steps: 64 for 50 steps) holds one schedule's plans but
not two (a second schedule adds steps-1 plans: the sigma=1 plan is shared by all).

Oracle: an upper bound on the GPU hit rate for this request order: Belady's rule over the plan accesses with
the replicas' slabs pooled into one cache (no router beats it; real ones also split schedules over replicas
and balance load).

    python -m bench.routing_app --smoke                                  # CPU: tiny model, 8 steps, < 1 min
    python -m bench.routing_app --checkpoint /tmp/thin-h3 --steps 20     # 2 GPUs: ~3.5 minutes

Time on 2x H200 (estimates): Ray start ~10 s while the 26 GB checkpoint is written (~30-60 s, 32 threads);
per mode: deploy ~15-20 s, warm-up ~3-5 s, load (requests/replicas) x (denoise ~70 ms/step + ~1 s per
rebuild from the page cache). `--budget-s` skips a mode that no longer fits, `--mode-timeout-s` cuts one
short; the results are written whatever happens (the rows measured so far, plus the error).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import ray
import yaml
from ray import serve

from bench.common import command_line, write_results
from bench.routing import draw_schedules, percentile
from cache.plan_key import plan_key
from bench.checkpoints import make_random_checkpoint
from model.layout import CheckpointError, H3Checkpoint
from model.schedule import H3Schedule
from model.tiny import TINY_TRANSFORMER
from model.weights import H3TransformerConfig, TransformerWeights

ROOT = Path(__file__).resolve().parents[1]
POOL_NAMESPACE = "ditserve"  # actors.host_cache_pool.POOL_NAMESPACE (not imported: it pulls in the pool actor)

# h3's AdaLN shapes (num_layers, hidden_size, time_embed_dim as released); everything else minimal. text_dim is
# the tiny components' Qwen3-VL width.
THIN_H3 = H3TransformerConfig(num_attention_heads=1, attention_head_dim=32, ffn_dim=64, num_refiner_layers=0,
                              text_dim=TINY_TRANSFORMER.text_dim, rope_freq_dim=4)

MODES = {
    "affinity": {"router": "schedule_affinity", "pool": False},
    "default": {"router": "default", "pool": False},
    "affinity+pool": {"router": "schedule_affinity", "pool": True},
}


# --------------------------------------------------------------------------------------------------
# Model, schedules, oracle
# --------------------------------------------------------------------------------------------------


def model_config(smoke: bool, num_blocks: Optional[int] = None) -> H3TransformerConfig:
    base = TINY_TRANSFORMER if smoke else THIN_H3
    return base.model_copy(update={"num_layers": num_blocks}) if num_blocks else base


def ensure_checkpoint(path: Path, config: H3TransformerConfig, workers: Optional[int]) -> str:
    """Make the checkpoint (transformer + tiny components) unless `path` already holds one of `config`."""
    with contextlib.suppress(CheckpointError, OSError):
        checkpoint = H3Checkpoint.open(path, require_components=True)
        if TransformerWeights(checkpoint.transformer_dir, checkpoint.layout).config == config:
            return "reused"
    import shutil

    import torch

    from model.tiny_components import write_tiny_components

    shutil.rmtree(path, ignore_errors=True)
    make_random_checkpoint(path, config, "diffusers", seed=0, workers=workers or 8,
                           device="cuda" if torch.cuda.is_available() else "cpu")
    write_tiny_components(path, "diffusers", 0)
    return "made"


def schedule_plans(steps: int, shift: float) -> List[Any]:
    """Distinct plan keys of one schedule (video and audio shift `shift`), in step order."""
    return list(dict.fromkeys(plan_key(p, 0) for p in H3Schedule.build(steps, shift, shift).plans))


def oracle_row(schedules: List[int], shifts: List[float], steps: int, gpu_plans: int, replicas: int) -> Dict[str, Any]:
    """Upper bound on the GPU hit rate: Belady's rule (evict the plan next used furthest ahead) over the
    request order's plan accesses, with the fleet's slabs pooled into one cache of replicas*gpu_plans plans
    (a real router also has to split schedules over replicas and balance load). The warm-up's plan is resident."""
    accesses = [(None, k) for k in schedule_plans(2, 20.0)]  # warm-up: not counted
    accesses += [(i, k) for i, s in enumerate(schedules) for k in schedule_plans(steps, shifts[s])]
    next_use, seen = [math.inf] * len(accesses), {}
    for pos in range(len(accesses) - 1, -1, -1):
        next_use[pos] = seen.get(accesses[pos][1], math.inf)
        seen[accesses[pos][1]] = pos
    cache: Dict[Any, float] = {}  # plan -> position of its next use
    hits, rebuilt = 0, set()
    for pos, (request, key) in enumerate(accesses):
        if key in cache:
            hits += request is not None
        else:
            rebuilt.add(request)
            if len(cache) >= replicas * gpu_plans:
                del cache[max(cache, key=cache.get)]
        cache[key] = next_use[pos]
    plans = len(accesses) - len(schedule_plans(2, 20.0))
    return {
        "mode": f"oracle bound (Belady over plans, {replicas}x{gpu_plans} slots pooled)",
        "requests": len(schedules),
        "gpu_hit_rate": hits / plans,
        "rebuilds_per_req": len(rebuilt - {None}) / len(schedules),
        "plans_per_req": plans / len(schedules),
    }


# --------------------------------------------------------------------------------------------------
# One mode: deploy, warm up, load, delete
# --------------------------------------------------------------------------------------------------


def app_args(args, mode: str, checkpoint: Path, replicas: int) -> Dict[str, Any]:
    """serve_config.yaml's args with this benchmark's engine and worker settings."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = config["applications"][0]["args"]
    # No adapters: the shipped auto-made one fits only an auto-made checkpoint.
    app["engine"].update(checkpoint=str(checkpoint), device="auto", adapters={})
    # thin-h3 has the released width, which gets the released size rules by default (short edge 768)
    app["engine"]["geometry"] = {"short_edge": None}
    app["engine"]["adaln"].update(mode="online", gpu_plans=args.gpu_plans, host_cache_gb=args.host_cache_gb)
    app["engine"]["pool"].update(enabled=MODES[mode]["pool"], capacity_gb=args.pool_gb)
    app["worker"].update(num_replicas=replicas, router=MODES[mode]["router"], num_gpus=None)
    return app


def request_body(steps: int, shift: float, seed: int) -> Dict[str, Any]:
    """One schedule per shift (video and audio shifts equal: one AdaLN plan row per forward); the smallest
    canvas and duration, no MP4 and no latents (the benchmark measures plans, not denoising or decode)."""
    return {"prompt": "a red fox in snow", "steps": steps, "seconds": 5.0, "width": 64, "height": 64,
            "flow_shift": shift, "audio_flow_shift": shift, "seed": seed, "return_video": False,
            "return_latents": False}


async def in_thread(fn, *args, **kwargs) -> Any:
    """`fn` on a daemon thread: unlike asyncio.to_thread, a timed-out call is left behind, not waited for."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(method, value) -> None:
        if not future.done():
            method(value)

    def run() -> None:
        try:
            result, method = fn(*args, **kwargs), future.set_result
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            result, method = exc, future.set_exception
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, method, result)

    threading.Thread(target=run, daemon=True).start()
    return await future


def first_choices(app_name: str, steps: int, shifts: List[float]) -> List[int]:
    """The replica (0..R-1, by id) each schedule's rendezvous hash ranks first: affinity keeps a schedule there
    unless it spills, so how the hot schedules split over replicas decides much of the affinity result."""
    from deployments.routing.policy import first_choice
    from engine.api import GenerationRequest

    prefix = f"SERVE_REPLICA::{app_name}#Worker#"
    ids = sorted(a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(prefix))
    keys = [GenerationRequest(**request_body(steps, shift, 0)).schedule_key for shift in shifts]
    return [ids.index(first_choice(key, ids)) for key in keys] if ids else []


async def run_mode(args, mode: str, checkpoint: Path, replicas: int, schedules: List[int],
                   records: List[Dict[str, Any]], phases: Dict[str, Any]) -> None:
    """Deploy `mode`, warm up, run the load; appends one record per finished request (partial on timeout)."""
    from deployments.app import build_app

    app_name = "routing_app_" + mode.replace("+", "_")
    t0 = time.perf_counter()
    await in_thread(serve.run, build_app(app_args(args, mode, checkpoint, replicas)), name=app_name, route_prefix=None)
    handle = serve.get_app_handle(app_name)
    phases["deploy_s"] = time.perf_counter() - t0
    if MODES[mode]["router"] == "schedule_affinity":
        with contextlib.suppress(Exception):
            phases["first_choice"] = first_choices(app_name, args.steps, args.shifts)

    # Warm-up: steps=2 requests (one forward: only the sigma=1 plan, shared by every schedule) with shifts outside the
    # workload, 2 per replica at once so both routers reach every replica; compiles kernels, primes rebuilds.
    t0 = time.perf_counter()
    await asyncio.gather(*(handle.generate.remote(request_body(2, 20.0 + i, i)) for i in range(2 * replicas)))
    phases["warmup_s"] = time.perf_counter() - t0

    queue = list(enumerate(schedules))[::-1]

    async def client() -> None:
        while queue:
            index, schedule = queue.pop()
            shift = args.shifts[schedule]
            t = time.perf_counter()
            out = await handle.generate.remote(request_body(args.steps, shift, 1000 + index))
            adaln = out.stats.get("adaln", {})
            records.append({
                "index": index, "shift": shift, "latency_s": time.perf_counter() - t,
                "plan_s": out.timings.plan_s, "denoise_s": out.timings.denoise_s,
                **{k: adaln.get(k, 0) for k in ("gpu_hit_plans", "host_hit_plans", "pool_hit_plans",
                                                 "built_plans", "rebuild_s")},
            })

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(client() for _ in range(args.clients)))
    finally:
        phases["load_s"] = time.perf_counter() - t0


def teardown(app_name: str) -> None:
    """Delete the app and kill the detached pool actors, so the next mode starts cold."""
    with contextlib.suppress(Exception):
        serve.delete(app_name)
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == POOL_NAMESPACE:
            with contextlib.suppress(Exception):
                ray.kill(ray.get_actor(actor["name"], namespace=POOL_NAMESPACE))


def summarize(mode: str, records: List[Dict[str, Any]], phases: Dict[str, float],
              error: Optional[str]) -> Dict[str, Any]:
    row: Dict[str, Any] = {"mode": mode, "requests": len(records)}
    if records:
        plans = sum(r["gpu_hit_plans"] + r["host_hit_plans"] + r["pool_hit_plans"] + r["built_plans"]
                    for r in records)
        latencies = [r["latency_s"] for r in records]
        row.update(
            gpu_hit_rate=sum(r["gpu_hit_plans"] for r in records) / max(1, plans),
            pool_hit_rate=sum(r["pool_hit_plans"] for r in records) / max(1, plans),
            rebuilds_per_req=sum(r["built_plans"] > 0 for r in records) / len(records),
            plans_per_req=plans / len(records),
            mean_plan_ms=1e3 * float(np.mean([r["plan_s"] for r in records])),
            mean_denoise_ms=1e3 * float(np.mean([r["denoise_s"] for r in records])),
            p50_ms=1e3 * percentile(latencies, 50),
            p99_ms=1e3 * percentile(latencies, 99),
            req_per_s=len(records) / phases["load_s"] if phases.get("load_s") else None,
        )
    row.update({k: round(v, 1) if isinstance(v, float) else v for k, v in phases.items()})
    row["error"] = error
    return row


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> None:
    start = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU smoke: tiny preset, 8 steps")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="checkpoint dir, made if absent (default: checkpoints/thin-h3 or checkpoints/tiny-bench)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--clients", type=int, default=4, help="concurrent closed-loop clients")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default 50; smoke 8)")
    parser.add_argument("--shifts", type=float, nargs="+", default=[3.0, 4.0, 5.0, 6.0],
                        help="one schedule per shift (audio_shift = shift)")
    parser.add_argument("--zipf-alpha", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-plans", type=int, default=None,
                        help="slab plans per replica (default 1.28*steps: one schedule and ~1/4 of another; "
                        "64 for 50 steps)")
    parser.add_argument("--host-cache-gb", type=float, default=0.0,
                        help="pinned host tier per replica; 0 (default): only the GPU slab can hit")
    parser.add_argument("--pool-gb", type=float, default=4.0, help="pool capacity (affinity+pool mode)")
    parser.add_argument("--replicas", type=int, default=None, help="default: number of GPUs (2 on CPU)")
    parser.add_argument("--mode-timeout-s", type=float, default=120.0)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="whole-run budget; a mode that no longer fits is skipped (default 210; smoke 170)")
    parser.add_argument("--num-blocks", type=int, default=None, help="override the model's blocks (a smaller rebuild)")
    parser.add_argument("--make-workers", type=int, default=None, help="checkpoint generator threads")
    args = parser.parse_args(argv)
    args.steps = args.steps or (8 if args.smoke else 50)
    args.gpu_plans = args.gpu_plans or round(1.28 * args.steps)  # one schedule and ~1/4 of another
    args.budget_s = args.budget_s or (170.0 if args.smoke else 210.0)
    checkpoint = (args.checkpoint or ROOT / "checkpoints" / ("tiny-bench" if args.smoke else "thin-h3")).resolve()
    config = model_config(args.smoke, args.num_blocks)

    rows: List[Dict[str, Any]] = []
    records: Dict[str, List[Dict[str, Any]]] = {}
    notes: List[str] = []
    device = "cpu"
    replicas = args.replicas or 2
    schedules = draw_schedules("zipf", args.requests, len(args.shifts), args.zipf_alpha, args.seed)
    try:
        # The checkpoint is written on a thread while Ray starts (both mostly wait on I/O and other processes).
        with ThreadPoolExecutor(1) as pool:
            t0 = time.perf_counter()
            made = pool.submit(ensure_checkpoint, checkpoint, config, args.make_workers)
            ray.init(address="local", include_dashboard=False, log_to_driver=False,
                     **({"num_cpus": max(4, os.cpu_count() or 1)} if args.smoke else {}))
            serve.start(proxy_location="Disabled")
            ray_s = time.perf_counter() - t0
            how = made.result()
            notes.append(f"startup: Ray + Serve {ray_s:.0f} s; checkpoint {how} at {checkpoint} "
                         f"({time.perf_counter() - t0:.0f} s since start)")
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if gpus:
            device, replicas = f"cuda-x{gpus}", args.replicas or gpus
        rows.append(oracle_row(schedules, args.shifts, args.steps, args.gpu_plans, replicas))
        counts = np.bincount(schedules, minlength=len(args.shifts))
        notes.append(f"workload: {args.requests} requests, {args.clients} clients, {args.steps} steps, shifts "
                     f"{args.shifts} drawn Zipf(alpha {args.zipf_alpha}, seed {args.seed}): counts {counts.tolist()}; "
                     f"model {'tiny' if args.smoke else 'thin-h3'} ({config.num_blocks} blocks, hidden {config.hidden_size}); "
                     f"{replicas} replicas, "
                     f"gpu_plans {args.gpu_plans}, host_cache_gb {args.host_cache_gb}, pool {args.pool_gb} GB in "
                     "the +pool mode")

        for mode in args.modes:
            left = args.budget_s - (time.monotonic() - start)
            done = [r for r in rows if "load_s" in r]  # the slowest finished mode estimates the next one
            needed = max((r["deploy_s"] + r.get("warmup_s", 0) + r["load_s"] for r in done), default=20.0)
            if left < needed:
                error = f"skipped: {left:.0f} s of budget left, ~{needed:.0f} s needed"
                rows.append({"mode": mode, "requests": 0, "error": error})
                continue
            records[mode], phases, error = [], {}, None
            try:
                run = run_mode(args, mode, checkpoint, replicas, schedules, records[mode], phases)
                asyncio.run(asyncio.wait_for(run, timeout=min(args.mode_timeout_s, left)))
            except asyncio.TimeoutError:
                error = f"timed out after {min(args.mode_timeout_s, left):.0f} s"
            except Exception as exc:  # noqa: BLE001 - recorded, the next mode still runs
                error = f"{type(exc).__name__}: {exc}"[:500]
                traceback.print_exc()
            teardown("routing_app_" + mode.replace("+", "_"))
            rows.append(summarize(mode, records[mode], phases, error))
            print(json.dumps(rows[-1]), flush=True)
    except BaseException as exc:  # noqa: BLE001 - write what was measured, then re-raise
        notes.append(f"run aborted: {type(exc).__name__}: {exc}"[:500])
        traceback.print_exc()
        raise
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        with contextlib.suppress(Exception):
            ray.shutdown()
        write(rows, records, notes, device, schedules, args, start)


def write(rows, records, notes, device: str, schedules, args, start: float) -> None:
    notes = [
        *notes,
        "gpu_hit_rate: plans found in the replica's GPU slab / plans needed; pool_hit_rate: plans copied from "
        "the node pool; rebuilds_per_req: requests that streamed the checkpoint (any built plan).",
        "first_choice: per shift (in --shifts order), the replica its rendezvous hash ranks first (affinity "
        "modes; replica ids are random per deployment, so the split of hot schedules varies run to run).",
        "mean_plan_ms: the engine's plan_s (slab lookup + copies + rebuild); latencies are client-side "
        "(handle call to response, queueing included).",
        f"total wall time {time.monotonic() - start:.0f} s.",
    ]
    columns = ["mode", "requests", "gpu_hit_rate", "pool_hit_rate", "rebuilds_per_req", "plans_per_req",
               "mean_plan_ms", "mean_denoise_ms", "p50_ms", "p99_ms", "req_per_s", "deploy_s", "warmup_s",
               "load_s", "first_choice", "error"]
    md_path, json_path = write_results("routing-app", rows, device=device, command=command_line(),
                                       columns=columns, notes=notes)
    data = json.loads(json_path.read_text())
    data.update(schedules=schedules, shifts=args.shifts, records=records)
    json_path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(md_path.read_text())
    print(f"wrote {md_path} and {json_path}")


if __name__ == "__main__":
    # Import ourselves under the package name so anything Serve pickles refers to `bench.routing_app`.
    from bench import routing_app

    routing_app.main()
