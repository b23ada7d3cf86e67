"""Engine benchmark: denoising step time and peak memory of `Engine` per preset.

    python -m bench.engine                                   # CPU: tiny and small
    python -m bench.engine --device cuda --preset h3 --num-blocks 4 --adaln resident online
    python -m bench.engine --preset tiny --steps 4 --repeats 2 --out /tmp/x   # quick check

Each (preset, adaln mode) runs in its own subprocess so peak memory is its own: on CUDA
`torch.cuda.max_memory_allocated` during generation (weights included), on CPU the process's peak RSS.
A seeded checkpoint is made per preset in a temporary directory (or reused from `--checkpoint-root`).
Prints a markdown table and writes bench/results/engine-<device>.md/.json (commit, device, command).
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

COLUMNS = ["preset", "blocks", "hidden", "adaln", "video", "tokens", "steps", "step_ms", "step_ms_min", "denoise_s",
           "load_s", "peak_mem_gib", "weights_gib"]


def parse_size(text: str) -> tuple[int, int, int]:
    frames, height, width = (int(v) for v in text.lower().split("x"))
    return frames, height, width


def run_one(args: argparse.Namespace) -> list[dict]:
    """One preset and adaln mode in this process: load, then per video size warm up and time `repeats` requests."""
    import torch

    from engine.api import GenerationRequest
    from engine.config import EngineConfig
    from engine.engine import Engine
    from model.checkpoint import make_checkpoint
    from model.config import preset

    (name,), (mode,) = args.preset, args.adaln  # child mode: exactly one of each
    overrides = {"num_blocks": args.num_blocks} if args.num_blocks else {}
    config = preset(name, **overrides)
    ckpt = Path(args.checkpoint_root) / f"{name}-b{config.num_blocks}"
    if not (ckpt / "model.safetensors.index.json").exists():
        logger.info("making %s checkpoint at %s", name, ckpt)
        make_checkpoint(ckpt, config, seed=0)

    cuda = args.device == "cuda"
    start = time.perf_counter()
    engine = Engine(EngineConfig(checkpoint=str(ckpt), device=args.device, adaln={"mode": mode}))
    load_s = time.perf_counter() - start
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())

    rows = []
    for size in args.video:
        frames, height, width = parse_size(size)
        request = GenerationRequest(prompt="a lighthouse on a cliff at dusk, waves below", steps=args.steps,
                                    frames=frames, height=height, width=width, audio_len=args.audio_len, seed=0)
        engine.generate(request.model_copy(update={"steps": 1}))  # warm-up (online: builds step 0's plan)
        engine.generate(request)  # online: every plan is in the slab from here on
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        step_ms, denoise = [], []
        for _ in range(args.repeats):
            result = engine.generate(request)
            denoise.append(result.timings["denoise_s"])
            step_ms.append(1000 * result.timings["denoise_s"] / args.steps)
        if cuda:
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB; process-wide
        rows.append({
            "preset": name, "blocks": config.num_blocks, "hidden": config.hidden, "adaln": mode,
            "video": size, "tokens": result.stats["tokens"], "steps": args.steps,
            "step_ms": statistics.median(step_ms), "step_ms_min": min(step_ms),
            "denoise_s": statistics.median(denoise), "load_s": load_s,
            "peak_mem_gib": peak / 2**30, "weights_gib": weights / 2**30,
        })
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--preset", nargs="+", default=None,
                   help="presets to run (default: tiny small on CPU, h3 on CUDA)")
    p.add_argument("--num-blocks", type=int, default=None, help="override the presets' block count (h3: e.g. 4)")
    p.add_argument("--adaln", nargs="+", choices=["resident", "online"], default=["resident"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--video", nargs="+", default=["2x16x16", "2x32x32"],
                   help="latent video sizes FxHxW (video tokens = F*H*W/4)")
    p.add_argument("--audio-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--checkpoint-root", default=None, help="where checkpoints are made/reused (default: a temp dir)")
    p.add_argument("--out", default=None, help="results folder (default: bench/results)")
    p.add_argument("--note", action="append", default=[], help="a line to add to the results' notes")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child mode: one preset, JSON on stdout
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.one:
        print(json.dumps(run_one(args)))
        return 0

    from bench.common import command_line, markdown_table, write_results

    presets = args.preset or (["h3"] if args.device == "cuda" else ["tiny", "small"])
    command = command_line()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        root = args.checkpoint_root or tmp
        for name in presets:
            for mode in args.adaln:
                child = [sys.executable, "-m", "bench.engine", "--one", "--device", args.device, "--preset", name,
                         "--adaln", mode, "--steps", str(args.steps), "--video", *args.video,
                         "--audio-len", str(args.audio_len), "--repeats", str(args.repeats),
                         "--checkpoint-root", root]
                if args.num_blocks:
                    child += ["--num-blocks", str(args.num_blocks)]
                logger.info("running %s", " ".join(child[3:]))
                out = subprocess.run(child, check=True, stdout=subprocess.PIPE, text=True).stdout
                rows += json.loads(out.strip().splitlines()[-1])
    print(markdown_table(rows, COLUMNS))
    notes = [
        "step_ms: median denoising time per step over the repeats (after two warm-up requests); one model call "
        "per step (guidance_scale 1), AdaLN from the given mode.",
        "peak_mem_gib: CUDA max_memory_allocated during the timed requests of that size, or on CPU the process's "
        "peak RSS so far (one process per preset and mode); "
        "weights_gib: parameters of the loaded model.",
        *args.note,
    ]
    md, js = write_results("engine", rows, args.device, command, columns=COLUMNS, notes=notes, out_dir=args.out)
    logger.info("wrote %s and %s", md, js)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
