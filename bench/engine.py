"""Engine benchmark: denoising step time and peak memory of `engine.Engine` on MiniMax-H3 checkpoints.

    python -m bench.engine                                             # CPU: the tiny checkpoint
    python -m bench.engine --device cuda --model h3 --num-blocks 4 --adaln resident online
    python -m bench.engine --smoke --out /tmp/x                        # seconds, CPU

Models: `tiny` is `model.tiny.make_tiny_checkpoint` (the real architecture at hidden 64, 4 blocks, tiny
components); `h3` is a random checkpoint of the real architecture at h3 width with `--num-blocks` blocks and
released-size components (`bench.checkpoints`: a Qwen3-VL of the real width with `--text-layers` layers, the
released video and audio VAEs). `--checkpoint DIR` uses any MiniMax-H3 checkpoint instead.

Each (model, adaln mode) runs in its own subprocess so peak memory is its own: on CUDA
`torch.cuda.max_memory_allocated` during generation (weights included), on CPU the process's peak RSS.
Requests are t2va in pixels and seconds (`--video WxHxSECONDS`), without decode (`return_video=False`):
the step time is the engine's denoise time / forwards. Checkpoints are made in a temporary directory (or
reused from `--checkpoint-root`). Prints a markdown table and writes bench/results/engine-<device>.md/.json
(commit, device, command).
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("bench.engine")

COLUMNS = ["model", "blocks", "hidden", "adaln", "video", "tokens", "steps", "step_ms", "step_ms_min", "denoise_s",
           "load_s", "peak_mem_gib", "weights_gib"]
PROMPT = "a lighthouse on a cliff at dusk, waves breaking below, gulls and wind"


def parse_size(text: str) -> tuple[int, int, float]:
    """'1344x768x5' -> (width 1344, height 768, seconds 5.0)."""
    width, height, seconds = text.lower().split("x")
    return int(width), int(height), float(seconds)


def ensure_checkpoint(args: argparse.Namespace, root: Path) -> Path:
    """The checkpoint of `args.model` under `root` (made on first use)."""
    if args.checkpoint:
        return Path(args.checkpoint)
    if args.model == "tiny":
        from model.tiny import make_tiny_checkpoint

        path = root / "tiny"
        if not (path / "model_index.json").exists():
            make_tiny_checkpoint(path, "diffusers", seed=0)
        return path
    from bench.checkpoints import PRESETS, make_random_checkpoint, write_h3_components

    path = root / f"h3-b{args.num_blocks}-t{args.text_layers}"
    if not (path / "model_index.json").exists():
        logger.info("making an h3-width checkpoint with %d blocks at %s", args.num_blocks, path)
        make_random_checkpoint(path, PRESETS["h3"], "diffusers", seed=0, num_blocks=args.num_blocks,
                               device=args.device)
        write_h3_components(path, "diffusers", 0, text_layers=args.text_layers + 1, device=args.device)
    return path


def run_one(args: argparse.Namespace) -> list[dict]:
    """One model and adaln mode in this process: load, then per video size warm up and time `repeats` requests."""
    import torch

    from engine.api import GenerationRequest
    from engine.config import EngineConfig
    from engine.engine import Engine

    (mode,) = args.adaln  # child mode: exactly one
    ckpt = ensure_checkpoint(args, Path(args.checkpoint_root))
    cuda = args.device == "cuda"
    text_encoder = {"hidden_state_index": args.text_layers} if args.model == "h3" and not args.checkpoint else {}
    start = time.perf_counter()
    engine = Engine(EngineConfig(checkpoint=str(ckpt), device=args.device, adaln={"mode": mode},
                                 text_encoder=text_encoder, geometry={"short_edge": None, "min_seconds": 0.5}))
    load_s = time.perf_counter() - start
    weights = sum(p.numel() * p.element_size() for p in engine.transformer.parameters() if not p.is_meta)
    config = engine.model_config

    rows = []
    for size in args.video:
        width, height, seconds = parse_size(size)
        request = GenerationRequest(prompt=PROMPT, steps=args.steps, seconds=seconds, width=width, height=height,
                                    seed=0, return_video=False)
        engine.generate(request.model_copy(update={"steps": 2}))  # warm-up (online: builds step 0's plan)
        engine.generate(request)  # online: every plan is in the slab from here on
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        step_ms, denoise = [], []
        for _ in range(args.repeats):
            result = engine.generate(request)
            denoise.append(result.timings.denoise_s)
            step_ms.append(1000 * result.timings.denoise_s / result.stats.forwards)
        if cuda:
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB; process-wide
        rows.append({
            "model": args.model if not args.checkpoint else str(ckpt), "blocks": config.num_blocks,
            "hidden": config.hidden_size, "adaln": mode, "video": size, "tokens": result.stats.tokens,
            "steps": args.steps, "step_ms": statistics.median(step_ms), "step_ms_min": min(step_ms),
            "denoise_s": statistics.median(denoise), "load_s": load_s,
            "peak_mem_gib": peak / 2**30, "weights_gib": weights / 2**30,
        })
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--smoke", action="store_true", help="tiny checkpoint, one small request, 3 steps, CPU")
    p.add_argument("--model", choices=["tiny", "h3"], default=None, help="default: tiny on CPU, h3 on CUDA")
    p.add_argument("--checkpoint", default=None, help="serve this MiniMax-H3 checkpoint instead of a made one")
    p.add_argument("--num-blocks", type=int, default=4, help="h3: transformer blocks of the made checkpoint")
    p.add_argument("--text-layers", type=int, default=2, help="h3: Qwen3-VL layers read (one more is written)")
    p.add_argument("--adaln", nargs="+", choices=["resident", "online"], default=["resident", "online"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--video", nargs="+", default=None,
                   help="requests WxHxSECONDS (default: tiny 64x64x5 128x64x5; h3 640x320x5 1344x768x5)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--checkpoint-root", default=None, help="where checkpoints are made/reused (default: a temp dir)")
    p.add_argument("--out", default=None, help="results folder (default: bench/results)")
    p.add_argument("--note", action="append", default=[], help="a line to add to the results' notes")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child mode: one adaln mode, JSON out
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.model = "cpu", "tiny"
        args.steps, args.repeats = min(args.steps, 3), min(args.repeats, 1)
        args.video = args.video or ["64x64x1"]
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.model = args.model or ("h3" if args.device == "cuda" else "tiny")
    args.video = args.video or (["640x320x5", "1344x768x5"] if args.model == "h3" else ["64x64x5", "128x64x5"])
    if args.one:
        print(json.dumps(run_one(args)))
        return 0

    from bench.common import command_line, markdown_table, write_results

    command = command_line()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        root = args.checkpoint_root or tmp
        ensure_checkpoint(args, Path(root))  # once, before the children
        for mode in args.adaln:
            child = [sys.executable, "-m", "bench.engine", "--one", "--device", args.device, "--model", args.model,
                     "--adaln", mode, "--steps", str(args.steps), "--video", *args.video, "--repeats",
                     str(args.repeats), "--checkpoint-root", root, "--num-blocks", str(args.num_blocks),
                     "--text-layers", str(args.text_layers)]
            if args.checkpoint:
                child += ["--checkpoint", args.checkpoint]
            logger.info("running %s", " ".join(child[3:]))
            out = subprocess.run(child, check=True, stdout=subprocess.PIPE, text=True).stdout
            rows += json.loads(out.strip().splitlines()[-1])
    print(markdown_table(rows, COLUMNS))
    notes = [
        "model: diffusers MiniMaxH3Transformer3DModel served by engine.Engine (random weights"
        + (f"; h3 width, {args.num_blocks} of 50 blocks, Qwen3-VL of the real width with {args.text_layers} "
           "layers read, released-size VAEs" if args.model == "h3" and not args.checkpoint else "; tiny checkpoint")
        + ").",
        "step_ms: median denoising time per transformer forward (steps - 1 per request) over the repeats, after "
        "two warm-up requests; AdaLN from the given mode; no VAE decode (return_video false).",
        "peak_mem_gib: CUDA max_memory_allocated during the timed requests of that size, or on CPU the process's "
        "peak RSS so far (one process per adaln mode); weights_gib: transformer parameters loaded.",
        *args.note,
    ]
    md, js = write_results("engine", rows, f"smoke-{args.device}" if args.smoke else args.device, command,
                           columns=COLUMNS, notes=notes, out_dir=args.out)
    logger.info("wrote %s and %s", md, js)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
