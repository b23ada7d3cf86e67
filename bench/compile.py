"""Compiled blocks in service (`engine.compile`): the first request after the start-up warm-up against later ones,
recompiles over a mixed stream after the warm-up, and the start-up time with a cold and a warm compile cache on
disk against a start without compile.

    python -m bench.compile                       # one GPU: h3 width, 4 blocks, inductor (~5 min on an H200)
    python -m bench.compile --smoke               # CPU: the tiny checkpoint, dynamo's eager backend (seconds)
    python -m bench.compile --smoke --backend inductor   # CPU, inductor's C++ kernels (~1 min)
    python -m bench.compile --stages --text-layers 12    # one GPU: the whole engine's start, 12 Qwen3-VL layers

Four starts, each in a fresh process (one engine per process: dynamo's and inductor's in-memory caches start
empty), on the same checkpoint (`engine.Engine`, denoiser only, the served defaults otherwise):

- `no compile`: `compile.mode: off`, no warm-up: the start-up as it is without this feature;
- `compile, cold cache`: `compile.mode: blocks` with `compile.warmup` = the 4 canvases, `compile.cache_dir` an
  empty folder: every kernel is generated (the warm-up runs what compiles: the canvas of fewest tokens, a
  schedule's first forward, `engine.forward.warm_up`), after the plan cache's build (and the text encoder's load);
- `compile, warm cache`: the same config and folder again: the engine loads the whole graphs the cold start kept
  (`compile.precompiled`, the default: no trace), or with `--traced` dynamo traces and inductor loads its kernels
  from what the cold start wrote;
- `compile, warm cache, beside the loads`: the same with `compile.overlap_loads`: the compiler imported on a
  thread during the checkpoint read, the warm-up on one beside the plan cache's build (and the text encoder's
  load), so the start pays the longer of the two where they do not contend, not their sum.

With `--stages` each start is the whole `engine.Engine` (its text encoder, `--text-layers` decoder layers, and its
VAEs load too).

Every start then serves, on a prompt embedding of `PROMPT_ROWS` random rows (no text encoder):
the first request (canvas 0) and `--repeats` more of it: `x later` is the first request's ms per forward over
the later ones' median (goal <= 1.05; the no-compile start's is a first request's own cost, without compile), its
first forward apart from the others (`bench.h3.ForwardClock`), and from them the same ratio for the released 50-step
request at 50 blocks (`x_later_at_scale`: the 5-step, 4-block request makes a once-per-canvas cost 60x larger);
then, compiled, the mixed stream, 4 canvases x 3 step counts in a seeded order,
each request's compiles after the warm-up summed (goal 0). `x no-compile start` is each start's seconds over the
no-compile one's (goal for the warm cache <= 1.2).

The checkpoint has `--num-blocks` of the released 50 blocks, so beside it stands a 50-block estimate of each start
(`start_s_50`, `x no-compile start, 50 blocks`), scaling what grows with the blocks and leaving the rest (device
init, headers, hooks, plan cache) as measured (the start beside the loads prices its extra bytes at the serial warm
start's rate: `ESTIMATE_OVERLAP`):

    start_s_50 = start_s + transformer_s x (bytes_50 / transformer_bytes - 1) + warmup_forward_s x (50 / blocks - 1)
    bytes_50   = (transformer_bytes - block_bytes) + block_bytes x 50 / blocks

`transformer_s` / `transformer_bytes`: the engine's load of the transformer and what it read (`Engine.startup`),
`block_bytes` the blocks' share; `warmup_forward_s`: the warm-up's forwards timed again after the start (the same
request, nothing left to compile), all of their work scaled by the blocks (the embedders and heads too: a slight
overestimate); 0 for the no-compile start. The compile itself (or the cache load) is one shared graph: unscaled.

Writes bench/results/compile-<device>.md and .json (commit, device, command).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch._dynamo.utils import CompilationMetrics

    from engine.engine import Engine

logger = logging.getLogger("bench.compile")

PROMPT_ROWS = 64


@dataclass(frozen=True)
class Canvas:
    width: int
    height: int
    seconds: float


#: 1344x768 5 s (37.7k tokens), its portrait twin (the same count, other positions), ~21.8k and ~8.6k tokens.
H3_CANVASES = (Canvas(1344, 768, 5.0), Canvas(768, 1344, 5.0), Canvas(1024, 576, 5.0), Canvas(640, 352, 5.0))
SMOKE_CANVASES = (Canvas(64, 64, 0.5), Canvas(128, 64, 0.5), Canvas(64, 128, 0.5), Canvas(96, 64, 0.5))
H3_STEPS = (5, 9, 3)  # the first is the warm-up's and the first request's
SMOKE_STEPS = (5, 4, 3)
STARTS = ("no compile", "compile, cold cache", "compile, warm cache", "compile, warm cache, beside the loads")
#: The start whose warm-up runs beside the plan cache's build and the text encoder's load (`compile.overlap_loads`).
OVERLAP_START = STARTS[3]
WARM_START = STARTS[2]
COLUMNS = ["start", "start_s", "x no-compile start", "start_s_50", "x no-compile start, 50 blocks", "warmup_s",
           "warmup_forwards", "warmup_forward_s", "frames_compiled", "graphs_loaded", "graphs_load_s",
           "graph_breaks", "first_ms", "later_ms", "x later",
           "first_forward1_ms", "later_forward1_ms", "first_rest_ms", "later_rest_ms", "x later, 50 steps at 50 blocks",
           "stream_requests", "stream_recompiles", "text_encoder_s", "vae_s"]
#: Where the warm-up's compile time went (dynamo's per-frame compilation metrics, summed over the warm-up's frames):
#: the whole frame, dynamo's own trace, AOTAutograd, inductor (a cache hit: the load), Triton's kernel compiles,
#: and the FX graph / AOTAutograd cache hits and misses.
PHASES = ["frame_s", "dynamo_s", "aot_s", "inductor_s", "triton_s", "fx_hits", "fx_misses", "aot_hits", "aot_misses",
          "restarts"]
RELEASED_BLOCKS = 50
RELEASED_STEPS = 50  # the recipe's request: 49 forwards
RELEASED_TEXT_LAYERS = 50  # the Qwen3-VL decoder layers H3 reads (hidden_states[50])
#: The 50-block estimate's formula, as the report states it.
ESTIMATE = ("start_s_50 = start_s + transformer_s x (bytes_50 / transformer_bytes - 1) + warmup_forward_s x "
            "(50 / blocks - 1), bytes_50 = non-block bytes + block_bytes x 50 / blocks")
#: For the start whose loads ran beside the warm-up: its extra bytes at the serial warm start's load rates.
ESTIMATE_OVERLAP = ("; for the start beside the loads, transformer_s and text_encoder_s are the serial warm start's: "
                    "what runs beside each load (the compiler's import beside the transformer read, the warm-up beside "
                    "the text encoder's) does not grow with the blocks, so the slowdown measured beside it stays as "
                    "measured and the extra bytes load at the rate a load gets alone (an upper bound: part of them "
                    "would load while the warm-up still runs)")
#: With --stages, the text encoder's share of it, scaled to the 50 decoder layers H3 reads.
ESTIMATE_STAGES = ("; with the stages start_s_50 adds text_encoder_s x (text_bytes_50 / text_bytes - 1), "
                   "text_bytes_50 = non-layer bytes + layer_bytes x 50 / layers")


def engine_config(args: argparse.Namespace, checkpoint: Path, start: str, cache_dir: Path):
    from engine.config import EngineConfig

    canvases, steps = _canvases(args)
    compiled = start != "no compile"
    warmup = [asdict(canvas) for canvas in canvases] if compiled else []
    text_encoder = {"hidden_state_index": args.text_layers} if args.model == "h3" else {}
    return EngineConfig(
        checkpoint=str(checkpoint), device=args.device, text_encoder=text_encoder,
        geometry={"short_edge": None, "min_seconds": 0.1},
        compile={"mode": "blocks" if compiled else "off", "backend": args.backend, "cache_dir": str(cache_dir),
                 "warmup": warmup, "overlap_loads": start == OVERLAP_START, "precompiled": not args.traced})


def serve_one(args: argparse.Namespace) -> dict:
    """Child: one start (`args.start`), then the first-vs-later requests and, compiled, the mixed stream."""
    import torch

    from bench.h3 import ForwardClock
    from engine.api import GenerationRequest
    from engine.engine import DenoiserEngine, Engine
    from engine.stage_data import PromptEmbedding
    from model.prompts import PromptCacheStats

    checkpoint, cache_dir = Path(args.checkpoint), Path(args.cache_dir)
    begin = time.perf_counter()
    engine = (Engine if args.stages else DenoiserEngine)(engine_config(args, checkpoint, args.start, cache_dir))
    start_s = time.perf_counter() - begin
    compile_stats = engine.describe()["forward"]["compile"]
    blocks = engine.transformer.transformer_blocks
    # start_s to 4 digits: the report's ratios of it hold to 1% even for a fast (~0.2 s) no-compile start.
    row: dict = {"start": args.start, "start_s": round(start_s, 4), "blocks": len(blocks),
                 "transformer_s": round(engine.startup.transformer_s, 4),
                 "transformer_bytes": engine.startup.transformer_bytes,
                 "block_bytes": sum(p.nbytes for p in blocks.parameters() if not p.is_meta), "warmup_forward_s": 0.0,
                 "overlap_loads": engine.config.compile.overlap_loads,
                 "text_encoder_s": round(engine.startup.text_encoder_s, 4), "vae_s": round(engine.startup.vae_s, 4)}
    if engine.prompt_stage is not None:
        encoder = engine.prompt_stage.encoder
        row.update(text_bytes=engine.prompt_stage.weights.bytes, text_layers=encoder.num_loaded_layers,
                   text_layer_bytes=sum(p.nbytes for name, p in encoder.module.named_parameters()
                                        if name.startswith("layers.") or ".layers." in name))
    phases = compile_phases() if compile_stats is not None else {}  # the start's alone, before any request
    canvases, steps = _canvases(args)
    embeds = torch.randn(PROMPT_ROWS, engine.model_config.text_dim, generator=torch.Generator().manual_seed(0))
    prompt = PromptEmbedding(embeds.to(engine.model_config.torch_dtype), 0.0, PromptCacheStats(0, 0, 0, 0, 0, 0))

    def run(canvas: Canvas, num_steps: int, seed: int) -> RequestTimes:
        request = GenerationRequest(prompt="bench", steps=num_steps, seed=seed, return_video=False, **asdict(canvas))
        clock = ForwardClock(engine.device)
        result = engine.denoise(request, prompt, progress=clock)
        compiled = result.stats.compile
        loop_ms, rest = 1e3 * result.timings.denoise_s, clock.rest_ms()
        return RequestTimes(loop_ms / result.stats.forwards, loop_ms - sum(rest),
                            statistics.median(rest) if rest else float("nan"),  # one forward: no other
                            None if compiled is None else compiled.since_warmup)

    # The first request after the start against later ones, with compile or without: without, what is left is a
    # first request's own cost at a canvas the start never ran (the allocator's growth, the attention kernel's
    # per-shape plan), which a compiled start's x later includes too.
    first = run(canvases[0], steps[0], 1)
    laters = [run(canvases[0], steps[0], 2 + i) for i in range(args.repeats)]
    later = RequestTimes(statistics.median(t.ms_per_forward for t in laters),
                         statistics.median(t.forward1_ms for t in laters), statistics.median(t.rest_ms for t in laters),
                         None)
    row.update(first_ms=round(first.ms_per_forward, 2), later_ms=round(later.ms_per_forward, 2),
               **{"x later": round(first.ms_per_forward / later.ms_per_forward, 3)},
               first_forward1_ms=round(first.forward1_ms, 2), later_forward1_ms=round(later.forward1_ms, 2),
               first_rest_ms=round(first.rest_ms, 2), later_rest_ms=round(later.rest_ms, 2),
               **{"x later, 50 steps at 50 blocks": round(x_later_at_scale(first, later, len(blocks)), 3)})
    if compile_stats is None:
        return row
    row.update(warmup_s=round(compile_stats["warmup_s"], 2), warmup_forwards=compile_stats["warmup_forwards"],
               frames_compiled=compile_stats["frames_compiled"], graphs_loaded=compile_stats["graphs_loaded"],
               graphs_load_s=round(compile_stats["graphs_load_s"], 3),
               graph_breaks=compile_stats["graph_breaks"], **phases)
    stream = [(canvas, n) for canvas in canvases for n in steps]
    random.Random(0).shuffle(stream)
    recompiles = max(run(canvas, n, 10 + i).since_warmup for i, (canvas, n) in enumerate(stream))  # cumulative
    # Last, so the first request above is the first after the start.
    row["warmup_forward_s"] = round(warmup_forwards_again(engine, canvases, compile_stats["warmup_forwards"]), 4)
    row.update(stream_requests=len(stream), stream_recompiles=recompiles)
    return row


@dataclass(frozen=True)
class RequestTimes:
    """One request's forwards: ms per forward over its denoise loop, its first forward (the loop's ms less the
    others: it also holds the loop's setup and end) and the median of the others."""

    ms_per_forward: float
    forward1_ms: float
    rest_ms: float
    since_warmup: int | None  # compiles after the warm-up, cumulative (None without compile)


def x_later_at_scale(first: RequestTimes, later: RequestTimes, blocks: int) -> float:
    """The first request's time over a later one's for the released request, 50 steps (49 forwards) at 50 blocks:
    its later forwards' slowdown (first_rest / later_rest) plus its first forward's extra (over a later request's
    first forward) spread over the released request's forwards at the later ones' rate. Assumes that extra is a cost
    once per canvas, the same at any block count (the allocator's growth, the attention kernel's plan for a shape:
    shared by the blocks); the rest ratio in the table tells whether the extra stayed in the first forward."""
    released_forwards_ms = (RELEASED_STEPS - 1) * later.rest_ms * RELEASED_BLOCKS / blocks
    return first.rest_ms / later.rest_ms + max(0.0, first.forward1_ms - later.forward1_ms) / released_forwards_ms


def compile_phases() -> dict[str, float | int]:
    """`PHASES` summed over the frames dynamo compiled so far in this process (called right after the start, these
    are the warm-up's)."""
    from torch._dynamo.utils import get_compilation_metrics

    metrics = get_compilation_metrics()

    def total(field: Callable[[CompilationMetrics], float | int | None], scale: float = 1.0) -> float:
        return sum((field(metric) or 0) * scale for metric in metrics)  # None: the phase did not run for that frame

    return {"frame_s": round(total(lambda m: m.entire_frame_compile_time_s), 2),
            "dynamo_s": round(total(lambda m: m.dynamo_cumulative_compile_time_us, 1e-6), 2),
            "aot_s": round(total(lambda m: m.aot_autograd_cumulative_compile_time_us, 1e-6), 2),
            "inductor_s": round(total(lambda m: m.inductor_cumulative_compile_time_us, 1e-6), 2),
            "triton_s": round(total(lambda m: m.triton_compile_time_us, 1e-6), 2),
            "fx_hits": int(total(lambda m: m.inductor_fx_local_cache_hit_count)),
            "fx_misses": int(total(lambda m: m.inductor_fx_local_cache_miss_count)),
            "aot_hits": int(total(lambda m: m.aotautograd_local_cache_hit_count)),
            "aot_misses": int(total(lambda m: m.aotautograd_local_cache_miss_count)),
            # A restart re-traces the frame from scratch (e.g. a float dynamo traced as an input that AOTAutograd
            # could not keep one): the same graph paid twice.
            "restarts": sum(len(m.restart_reasons or ()) for m in metrics)}


def warmup_forwards_again(engine: Engine, canvases: tuple[Canvas, ...], forwards: int) -> float:
    """Seconds of the warm-up's forwards run again after the start (its canvas of fewest tokens, as many forwards,
    the warm-up's stand-in prompt rows: nothing left to compile), the part of the warm-up that grows with the
    blocks."""
    import torch

    from engine.api import GenerationRequest
    from engine.forward import WARMUP_TEXT_TOKENS
    from engine.stage_data import PromptEmbedding
    from model.prompts import PromptCacheStats

    canvas = min(canvases, key=lambda c: c.width * c.height * c.seconds)  # no adapters, one tier: one run
    embeds = torch.zeros(WARMUP_TEXT_TOKENS, engine.model_config.text_dim, dtype=engine.model_config.torch_dtype)
    request = GenerationRequest(prompt="warm-up", steps=forwards + 1, seed=0, return_video=False, **asdict(canvas))
    before = engine.forward_kernels.compile_stats().since_warmup
    result = engine.denoise(request, PromptEmbedding(embeds, 0.0, PromptCacheStats(0, 0, 0, 0, 0, 0)))
    if (compiled := result.stats.compile.since_warmup - before) != 0:
        raise RuntimeError(f"the warm-up's forwards compiled again ({compiled} graphs): the warm-up did not run them")
    return result.timings.denoise_s


def estimate_at_50_blocks(row: dict, serial: dict | None = None) -> float:
    """The start's seconds with the released 50 blocks (`ESTIMATE`). `serial`: for a start whose loads ran beside
    the warm-up, the row whose loads ran alone; its seconds per byte price the extra bytes (`ESTIMATE_OVERLAP`)."""
    loads = serial or row
    scale = RELEASED_BLOCKS / row["blocks"]
    bytes_50 = row["transformer_bytes"] - row["block_bytes"] + row["block_bytes"] * scale
    seconds = (row["start_s"] + loads["transformer_s"] * (bytes_50 / row["transformer_bytes"] - 1)
               + row["warmup_forward_s"] * (scale - 1))
    if "text_bytes" in row:  # --stages (`ESTIMATE_STAGES`)
        layer_bytes = row["text_layer_bytes"]
        text_bytes_50 = row["text_bytes"] - layer_bytes + layer_bytes * RELEASED_TEXT_LAYERS / row["text_layers"]
        seconds += loads["text_encoder_s"] * (text_bytes_50 / row["text_bytes"] - 1)
    return seconds


def _canvases(args: argparse.Namespace) -> tuple[tuple[Canvas, ...], tuple[int, ...]]:
    return (SMOKE_CANVASES, SMOKE_STEPS) if args.model == "tiny" else (H3_CANVASES, H3_STEPS)


def ensure_checkpoint(args: argparse.Namespace, root: Path) -> Path:
    """The tiny checkpoint, or an h3-width random one with `--num-blocks` blocks (bench.engine's)."""
    from bench.engine import ensure_checkpoint as engine_checkpoint

    return engine_checkpoint(argparse.Namespace(checkpoint=None, model=args.model, num_blocks=args.num_blocks,
                                                text_layers=args.text_layers, device=args.device), root)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny checkpoint (dynamo's eager backend unless "
                   "--backend)")
    p.add_argument("--backend", choices=("eager", "inductor"), default=None,
                   help="compile backend (default: eager on a CPU, inductor on a GPU)")
    p.add_argument("--num-blocks", type=int, default=4, help="h3: transformer blocks of the made checkpoint")
    p.add_argument("--text-layers", type=int, default=2, help="h3: Qwen3-VL layers of the made checkpoint")
    p.add_argument("--stages", action="store_true", help="the whole engine: its text encoder (--text-layers "
                   "layers) and VAEs load at start too, the compile warm-up beside the text encoder's load")
    p.add_argument("--repeats", type=int, default=3, help="later requests timed after the first")
    p.add_argument("--checkpoint-root", default=None, help="where the checkpoint is made/reused (default: temp)")
    p.add_argument("--out", default=None, help="results folder (default: bench/results)")
    p.add_argument("--traced", action="store_true", help="compile.precompiled off: a warm start traces the block "
                   "and loads inductor's kernels (the regular path) instead of loading whole graphs")
    # child mode: one start in this process, its row as JSON on the last line
    p.add_argument("--start", choices=STARTS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--device", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    args.model = "tiny" if args.device == "cpu" else "h3"
    if args.backend is None:
        args.backend = "eager" if args.device == "cpu" else "inductor"
    if args.smoke:
        args.repeats = min(args.repeats, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.start is not None:
        print(json.dumps(serve_one(args)))
        return 0

    from bench.common import device_tag, markdown_table, write_results

    command = " ".join(["python -m bench.compile", *raw])
    began = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        checkpoint = ensure_checkpoint(args, Path(args.checkpoint_root or tmp))
        cache_dir = Path(tmp) / "inductor-cache"  # empty until the cold start fills it
        for start in STARTS:
            child = [sys.executable, "-m", "bench.compile", "--start", start, "--checkpoint", str(checkpoint),
                     "--cache-dir", str(cache_dir), "--device", args.device, "--repeats", str(args.repeats),
                     "--num-blocks", str(args.num_blocks), "--text-layers", str(args.text_layers),
                     "--backend", args.backend] + ["--stages"] * args.stages + ["--traced"] * args.traced
            logger.info("start: %s", start)
            out = subprocess.run(child, check=True, stdout=subprocess.PIPE, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    baseline, baseline_50 = rows[0]["start_s"], estimate_at_50_blocks(rows[0])
    by_start = {row["start"]: row for row in rows}
    for row in rows:
        row["x no-compile start"] = round(row["start_s"] / baseline, 3)
        # Both from the unrounded estimate, written at the precision of start_s, so the ratio can be checked from
        # the table's own columns.
        serial = by_start.get(WARM_START) if row["overlap_loads"] else None
        row["start_s_50"] = round(estimate_at_50_blocks(row, serial), 4)
        row["x no-compile start, 50 blocks"] = round(estimate_at_50_blocks(row, serial) / baseline_50, 3)
    canvases, steps = _canvases(args)
    print(markdown_table(rows, COLUMNS + PHASES))
    notes = [
        f"model: {'the tiny checkpoint' if args.model == 'tiny' else f'h3 width, {args.num_blocks} of 50 blocks, random weights'}"
        + ("; engine.Engine with its text encoder and VAEs" if args.stages
           else "; engine.DenoiserEngine (no text encoder, no VAEs)")
        + f", served defaults but engine.compile; backend {args.backend}",
        "canvases: " + ", ".join(f"{c.width}x{c.height} {c.seconds:g} s" for c in canvases)
        + "; warm-up: what compiles (the canvas of fewest tokens, a schedule's first forward: warmup_forwards); "
        f"stream: each x steps {', '.join(map(str, steps))}, seeded order",
        f"50-block estimate ({rows[0]['blocks']} blocks measured): {ESTIMATE}"
        + (f"{ESTIMATE_STAGES} ({rows[0].get('text_layers')} layers measured)" if args.stages else "")
        + ESTIMATE_OVERLAP
        + "; transformer_s and its bytes from Engine.startup, warmup_forward_s: the warm-up's forwards timed again "
        "after the start (0 without compile); other phases as measured",
        f"first_ms / later_ms: ms per forward of the first request after the start (canvas 0, {steps[0]} steps) "
        f"and the median of {args.repeats} later ones, every start (the no-compile one: a first request's own cost "
        "at a canvas the start never ran, in the compiled starts' too); x later goal <= 1.05",
        "forward1_ms / rest_ms: a request's first forward (its loop's time less the others: with the loop's setup) "
        "and the median of its others (device time between the ends of consecutive forwards); x later, 50 steps at "
        "50 blocks: first_rest / later_rest + (first_forward1 - later_forward1) / (49 x later_rest x 50 / blocks), "
        "the released request, assuming the first forward's extra is once per canvas at any block count (the "
        "allocator's growth, the attention kernel's plan for a shape); first_rest ~ later_rest says the extra stayed "
        "in the first forward",
        "stream_recompiles: graphs compiled after the warm-up over the stream (goal 0); x no-compile start: goal "
        "<= 1.2 for the warm cache",
        "graphs_loaded / graphs_load_s: whole graphs read from the cache folder at start (compile.precompiled) and "
        "the seconds that took, part of warmup_s (0 with --traced: dynamo traces instead)",
        "frame_s .. aot_misses: dynamo's compilation metrics summed over the warm-up's frames (the whole frame; "
        "dynamo's trace, AOTAutograd, inductor, Triton compiles, cumulative and nested: dynamo_s includes the "
        "others; fx/aot: local cache hits and misses)",
        f"prompt: {PROMPT_ROWS} random rows (the text encoder does not run); "
        f"whole run {time.perf_counter() - began:.0f} s",
    ]
    tag = device_tag(args.device)
    # The backend in the name where it is not the device's default, so such a run never overwrites the default's.
    default_backend = "eager" if args.device == "cpu" else "inductor"
    name = "-".join(["smoke"] * args.smoke + ["stages"] * args.stages
                    + [args.backend] * (args.backend != default_backend) + [tag])
    md, _ = write_results("compile", rows, name, command, columns=COLUMNS + PHASES,
                          notes=notes, out_dir=args.out)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
