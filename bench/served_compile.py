"""Compiled blocks through the served app (`engine.compile`): what a client of `serve run` gets, beside what the
engine inside the replica reports.

Three starts of the real app (`deployments.app.build_app` from serve_config.yaml: `stages: split`, so the Worker
replica holds the denoiser alone, the case with no load to hide a warm-up behind), one after the other in one local
Ray cluster, each a fresh Worker replica process (dynamo's in-memory caches empty):

- `no compile`: `engine.compile.mode: off`: the replica's start as it is without the feature;
- `compile, cold cache`: `mode: blocks`, `compile.warmup` = the 4 canvases, `compile.cache_dir` an empty folder;
- `compile, warm cache`: the same config and folder again (a restarted or scaled-out replica).

Per start, from the Worker's `describe()` (`deployments.worker.Worker`): the replica's constructor -> ready seconds
(`replica_s`: imports of the model modules, the engine build, Serve's replica set-up) and the engine build's
(`engine_s`: `Engine.startup.total_s`), each over the no-compile start's (goal for the warm cache <= 1.2x); the
warm-up's seconds and forwards (`describe()["forward"]["compile"]`). Then, every start, through the deployment
handle as a client sends them: the first request after the start (canvas 0) and `--repeats` more (`x later`: ms per forward of
the first over the later ones' median, goal <= 1.05; ms per forward from the response's own `timings.denoise_s` and
`stats.forwards`, so Serve's overhead is not in it), and, compiled, the mixed stream (4 canvases x 3 step counts in a seeded
order) with the compiles after the warm-up each response reports (`stats.compile.since_warmup`, goal 0).

`replica_s - engine_s` is what Serve and the replica add around the engine; the engine's numbers are what
`python -m bench.compile` measures in a bare process (there: `start_s`), so the two benches side by side say what
serving adds.

    python -m bench.served_compile --smoke           # CPU: the tiny checkpoint, dynamo's eager backend (~2 min)
    python -m bench.served_compile --num-blocks 4    # one GPU: h3 width, inductor

Writes bench/results/served-compile-<device>.md and .json (commit, device, command).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray
import torch
import yaml
from ray import serve

from bench.app import PROMPT, ROOT, ensure_checkpoint, free_port
from bench.common import command_line, device_tag, write_results
from bench.compile import H3_CANVASES, H3_STEPS, SMOKE_CANVASES, SMOKE_STEPS, Canvas
from engine.startup import ReplicaStartup

APP_NAME = "bench_served_compile"
STARTS = ("no compile", "compile, cold cache", "compile, warm cache")
COLUMNS = ["start", "replica_s", "x no-compile replica", "engine_s", "x no-compile engine", "warmup_s",
           "warmup_forwards", "first_ms", "later_ms", "x later", "stream_requests", "stream_recompiles"]


def app_args(args: argparse.Namespace, checkpoint: Path, start: str, cache_dir: Path) -> dict[str, Any]:
    """serve_config.yaml's app with this bench's checkpoint, one Worker replica and `start`'s compile settings."""
    app = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    engine = app["engine"]
    engine.update(checkpoint=str(checkpoint), device="auto", geometry={"short_edge": None, "min_seconds": 0.1},
                  adapters={})  # (the shipped adapter fits only the auto-made checkpoint)
    if not args.smoke and not args.checkpoint:  # the made checkpoint's Qwen3-VL reads hidden_states[text_layers]
        engine["text_encoder"]["hidden_state_index"] = args.text_layers
    compiled = start != "no compile"
    engine["compile"].update(mode="blocks" if compiled else "off", backend=args.backend, cache_dir=str(cache_dir),
                             warmup=[asdict(c) for c in canvases(args)] if compiled else [])
    app["worker"].update(num_replicas=1)
    return app


def canvases(args: argparse.Namespace) -> tuple[Canvas, ...]:
    return SMOKE_CANVASES if args.smoke else H3_CANVASES


def steps(args: argparse.Namespace) -> tuple[int, ...]:
    return SMOKE_STEPS if args.smoke else H3_STEPS


async def serve_one(args: argparse.Namespace, checkpoint: Path, start: str, cache_dir: Path) -> dict[str, Any]:
    """One app start (a fresh Worker replica): its timings, the first request against later ones and, compiled,
    the stream, through the handle."""
    from deployments.app import build_app

    serve.run(build_app(app_args(args, checkpoint, start, cache_dir)), name=APP_NAME, route_prefix="/")
    try:
        card = await serve.get_deployment_handle("Worker", APP_NAME).describe.remote()
        startup = ReplicaStartup.from_dict(card["startup"])
        if startup.engine is None:
            raise RuntimeError(f"the Worker replica reports no engine start-up: {card['startup']}")
        row: dict[str, Any] = {"start": start, "replica_s": round(startup.constructor_s, 3),
                               "engine_s": round(startup.engine.total_s, 3)}
        compile_stats = card["forward"]["compile"]
        handle = serve.get_app_handle(APP_NAME)

        async def run(canvas: Canvas, num_steps: int, seed: int) -> tuple[float, int | None]:
            body = {"prompt": PROMPT, "steps": num_steps, "seed": seed, "return_video": False, **asdict(canvas)}
            out = await handle.generate.remote(body)
            per_forward_ms = 1e3 * out.timings.denoise_s / out.stats["forwards"]
            compiled = out.stats.get("compile")  # None (or left out) for an uncompiled replica
            return per_forward_ms, None if compiled is None else compiled["since_warmup"]

        # Every start, the no-compile one too: its x later is a first request's own cost at a canvas the start
        # never ran, which the compiled starts' include.
        first_ms, _ = await run(canvases(args)[0], steps(args)[0], 1)
        later_ms = statistics.median([(await run(canvases(args)[0], steps(args)[0], 2 + i))[0]
                                      for i in range(args.repeats)])
        row.update(first_ms=round(first_ms, 2), later_ms=round(later_ms, 2), **{"x later": round(first_ms / later_ms, 3)})
        if compile_stats is None:
            return row
        row.update(warmup_s=round(compile_stats["warmup_s"], 3), warmup_forwards=compile_stats["warmup_forwards"])
        stream = [(canvas, n) for canvas in canvases(args) for n in steps(args)]
        random.Random(0).shuffle(stream)
        recompiles = [(await run(canvas, n, 10 + i))[1] for i, (canvas, n) in enumerate(stream)]
        row.update(stream_requests=len(stream), stream_recompiles=max(recompiles))  # since_warmup: cumulative
        return row
    finally:
        serve.delete(APP_NAME)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny checkpoint (dynamo's eager backend unless "
                   "--backend)")
    p.add_argument("--backend", choices=("eager", "inductor"), default=None,
                   help="compile backend (default: eager on a CPU, inductor on a GPU)")
    p.add_argument("--checkpoint", default=None, help="checkpoint dir (made if absent)")
    p.add_argument("--num-blocks", type=int, default=4, help="blocks of a made h3-width checkpoint")
    p.add_argument("--text-layers", type=int, default=2, help="Qwen3-VL layers of a made checkpoint")
    p.add_argument("--repeats", type=int, default=3, help="later requests timed after the first")
    p.add_argument("--out", default=None, help="results folder (default: bench/results)")
    args = p.parse_args(argv)
    if args.backend is None:
        args.backend = "inductor" if torch.cuda.is_available() and not args.smoke else "eager"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    rows = []
    cuda = torch.cuda.is_available() and not args.smoke
    with tempfile.TemporaryDirectory(prefix="bench-served-compile-") as tmp:
        checkpoint = ensure_checkpoint(args).resolve()
        cache_dir = Path(tmp) / "inductor-cache"  # empty until the cold start fills it
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 **({} if cuda else {"num_cpus": 4}))
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})  # the handle drives it; no fixed port
        try:
            for start in STARTS:
                print(f"start: {start}", flush=True)
                rows.append(asyncio.run(serve_one(args, checkpoint, start, cache_dir)))
        finally:
            serve.shutdown()
            ray.shutdown()
    baseline = rows[0]
    for row in rows:
        row["x no-compile replica"] = round(row["replica_s"] / baseline["replica_s"], 3)
        row["x no-compile engine"] = round(row["engine_s"] / baseline["engine_s"], 3)
    notes = [
        f"checkpoint {checkpoint}; the app of serve_config.yaml (stages: split: the Worker holds the denoiser alone), "
        f"one Worker replica per start, engine.compile backend {args.backend}",
        "canvases: " + ", ".join(f"{c.width}x{c.height} {c.seconds:g} s" for c in canvases(args))
        + f"; stream: each x steps {', '.join(map(str, steps(args)))}, seeded order; first request: canvas 0",
        "replica_s: the Worker replica's constructor -> ready (ReplicaStartup.constructor_s); engine_s: its engine "
        "build (Engine.startup.total_s); x no-compile: over the no-compile start's (goal <= 1.2 with a warm cache)",
        "first_ms / later_ms: ms per forward from each response's timings.denoise_s / stats.forwards (no Serve "
        f"overhead), the first request after the start and the median of {args.repeats} later; x later goal <= 1.05",
        "stream_recompiles: compiles after the warm-up as the stream's last response reports them (stats.compile."
        "since_warmup, cumulative: the first and later requests' too; goal 0)",
        f"whole run {time.perf_counter() - began:.0f} s",
    ]
    default_backend = "inductor" if cuda else "eager"
    name = "-".join(["served-compile"] + ["smoke"] * args.smoke + [args.backend] * (args.backend != default_backend))
    write_results(name, rows, device_tag("cuda" if cuda else "cpu"), command_line(), columns=COLUMNS, notes=notes,
                  out_dir=Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
