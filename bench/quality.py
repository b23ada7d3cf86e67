"""`quality: high` against `quality: lossless`: what the Cache-DiT profile of video jobs costs and saves.

For the same prompts and seeds, one `engine.Engine` (Cache-DiT on, as a server serving `quality: high` runs it)
generates each clip twice, through the engine directly (no Serve): with the request's Cache-DiT off (what
`quality: lossless` sends, `deployments.video_backend.LOSSLESS_CACHE_DIT`) and with `videos.high_quality` of
serve_config.yaml (what `quality: high` sends). Per clip:

- PSNR of high against lossless: the video frames (both latents decoded by the engine's own video VAE, uint8,
  peak 255; before the H.264 encode, so codec loss does not blur the comparison), the video latents and the
  audio latents (peak: the lossless tensor's max - min);
- the fraction of transformer block computations skipped: block forwards counted by a pre-hook on every
  block (`transformer.transformer_blocks`) in the high run against the lossless run (which runs every block of
  every forward), beside cache-dit's cached steps;
- the step-time speedup: lossless denoise seconds / high denoise seconds (the engine's `timings.denoise_s`;
  one warm-up pair first, so plan rebuilds and first-call setup are not in it).
- SSIM of the decoded frames (luma, 7x7 uniform windows, the mean over frames).

The `fp8` rows (`--fp8`; `auto`: where the device runs float8 GEMMs): a second engine of the same config with
`engine.quantization: fp8` generates the same clips with Cache-DiT off, against the bf16 lossless clips: the same
PSNRs and SSIM, and the step-time speedup bf16 / fp8.

    python -m bench.quality --quick                                  # CPU: the tiny checkpoint, ~1 min
    python -m bench.quality --num-blocks 4 --text-layers 2 --video 768x448x2 --steps 30   # GPU: h3 width

Checkpoints: `--checkpoint DIR` (any MiniMax-H3 checkpoint), else made once under checkpoints/ by
`bench.checkpoints.ensure_bench_checkpoint` (`--quick`: the tiny one; else h3 width, `--num-blocks` blocks).
Random weights are not the trained model: cache-dit's decisions follow the residual changes of the first
block, which a random model does not share with the trained one, so the PSNR and the skipped fraction
measured here describe the mechanism, not H3's quality (the trained-model figure, 1.40x at 28.16 dB on
4 H200, is in shared/reference.md).

Writes bench/results/quality-<device>.md and .json (commit, device, command).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from bench.common import command_line, write_results

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = (
    "a lighthouse on a cliff at dusk, waves breaking below, gulls and wind",
    "a red fox trotting through fresh snow in a birch forest, soft morning light",
    "a street market in the rain at night, neon signs reflected in puddles, people with umbrellas",
    "a close-up of a violinist's hands playing a fast passage, warm stage light",
)
COLUMNS = ["tier", "prompt", "seed", "forwards", "cached_steps", "blocks_run_high", "blocks_run_lossless", "skipped_frac",
           "psnr_frames_db", "psnr_video_latents_db", "psnr_audio_latents_db", "step_ms_lossless", "step_ms_high",
           "step_ms_fp8", "speedup", "ssim_frames", "residual_diff_median"]
HIGH, FP8 = "high", "fp8"


@dataclass(frozen=True)
class Run:
    """One generation: latents, denoise seconds, block forwards counted, cache-dit's cached steps."""

    video: torch.Tensor
    audio: torch.Tensor
    denoise_s: float
    forwards: int
    block_calls: int
    cached_steps: tuple[int, ...]
    residual_diffs: tuple[float, ...]


class BlockCounter:
    """Counts forwards of every transformer block (a pre-hook each): cache-dit's skipped blocks never run."""

    def __init__(self, blocks: torch.nn.ModuleList) -> None:
        self.calls = 0
        self._handles = [block.register_forward_pre_hook(self._count) for block in blocks]

    def _count(self, module: torch.nn.Module, args: Any) -> None:
        self.calls += 1

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def psnr(reference: np.ndarray | torch.Tensor, other: np.ndarray | torch.Tensor, peak: float | None = None) -> float:
    """10 log10(peak^2 / MSE) in dB; `peak` None: the reference's max - min. inf when identical."""
    ref = torch.as_tensor(np.asarray(reference) if isinstance(reference, np.ndarray) else reference).double()
    oth = torch.as_tensor(np.asarray(other) if isinstance(other, np.ndarray) else other).double()
    if ref.shape != oth.shape:
        raise ValueError(f"shapes differ: {tuple(ref.shape)} vs {tuple(oth.shape)}")
    mse = float(((ref - oth) ** 2).mean())
    if mse == 0.0:
        return math.inf
    peak = float(ref.max() - ref.min()) if peak is None else peak
    return 10.0 * math.log10(peak * peak / mse)


def ssim(reference: np.ndarray, other: np.ndarray, window: int = 7) -> float:
    """Mean SSIM of uint8 RGB frames [F, H, W, 3] on their luma (BT.601), `window` x `window` uniform windows
    (Wang et al. 2004's constants for peak 255); 1.0 when identical."""
    if reference.shape != other.shape:
        raise ValueError(f"shapes differ: {reference.shape} vs {other.shape}")
    luma = torch.tensor([0.299, 0.587, 0.114], dtype=torch.float64)
    x, y = (torch.as_tensor(np.asarray(frames)).double() @ luma for frames in (reference, other))  # [F, H, W]
    x, y = x[:, None], y[:, None]
    size = min(window, x.shape[-1], x.shape[-2])

    def mean(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.avg_pool2d(t, size, stride=1)

    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = mean(x), mean(y)
    vx, vy, cov = mean(x * x) - mx * mx, mean(y * y) - my * my, mean(x * y) - mx * my
    value = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return float(value.mean())


def served_configs(args: argparse.Namespace, checkpoint: Path) -> tuple[dict[str, Any], Any, Any]:
    """serve_config.yaml's engine section (this checkpoint, Cache-DiT on, no pool), and the two Cache-DiT
    overrides a video job sends: `quality: lossless` and the served `videos.high_quality`."""
    from deployments.schemas import AppConfig
    from deployments.video_backend import LOSSLESS_CACHE_DIT

    app = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    high = AppConfig.model_validate(app).videos.high_quality  # exactly what the shipped config serves
    engine = app["engine"]
    engine.update(checkpoint=str(checkpoint), device=args.device,
                  geometry={"short_edge": None, "max_pixels": 768 * 1344, "min_seconds": 0.2, "max_seconds": 15.0})
    engine["adapters"] = {}  # the shipped auto-made adapter fits only an auto-made checkpoint
    engine["cache_dit"] = {**engine["cache_dit"], "enabled": True}
    engine["pool"] = {**engine["pool"], "enabled": False}  # no Ray here
    if not args.quick and not args.checkpoint:  # a made h3 checkpoint holds text_layers + 1 Qwen3-VL layers
        engine["text_encoder"]["hidden_state_index"] = args.text_layers
    return engine, LOSSLESS_CACHE_DIT, high


def generate(engine: Any, counter: BlockCounter, request: Any) -> Run:
    counter.take()
    result = engine.generate(request)
    cache = result.stats.cache_dit
    return Run(video=result.video, audio=result.audio, denoise_s=result.timings.denoise_s,
               forwards=result.stats.forwards, block_calls=counter.take(),
               cached_steps=tuple(cache.cached_steps) if cache is not None else (),
               residual_diffs=tuple(cache.residual_diffs.values()) if cache is not None else ())


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    from bench.checkpoints import ensure_bench_checkpoint
    from engine.api import GenerationRequest
    from engine.config import EngineConfig
    from engine.engine import Engine

    default = "tiny-diffusers" if args.quick else f"h3-b{args.num_blocks}-t{args.text_layers}"
    start = time.perf_counter()
    checkpoint = ensure_bench_checkpoint(Path(args.checkpoint or ROOT / "checkpoints" / default).resolve(),
                                         tiny=args.quick, num_blocks=args.num_blocks, text_layers=args.text_layers)
    made_s = time.perf_counter() - start
    engine_config, lossless, high = served_configs(args, checkpoint)
    start = time.perf_counter()
    engine = Engine(EngineConfig.model_validate(engine_config))
    load_s = time.perf_counter() - start
    assert engine.decode_stage is not None  # a whole engine (parts FULL) on one device decodes
    decoder = engine.decode_stage.video_decoder
    blocks = engine.transformer.transformer_blocks
    num_blocks = len(blocks)
    counter = BlockCounter(blocks)
    width, height, seconds = args.video

    def request(prompt: str, seed: int, cache_dit: Any) -> GenerationRequest:
        return GenerationRequest(prompt=prompt, steps=args.steps, seconds=seconds, width=width, height=height,
                                 seed=seed, return_video=False, cache_dit=cache_dit)

    try:
        for cache_dit in (lossless, high):  # warm-up: plans built, first-call setup done, prompt cached
            generate(engine, counter, request(PROMPTS[0], args.seeds[0], cache_dit))
        rows = []
        references: dict[tuple[str, int], list[Run]] = {}
        for prompt in PROMPTS[:args.prompts]:
            for seed in args.seeds:
                exact = [generate(engine, counter, request(prompt, seed, lossless)) for _ in range(args.repeats)]
                fast = [generate(engine, counter, request(prompt, seed, high)) for _ in range(args.repeats)]
                rows.append(compare(prompt, seed, exact, fast, num_blocks, decoder))
                references[prompt, seed] = exact
                print(rows[-1], flush=True)
    finally:
        counter.remove()
    fp8_note = fp8_refusal(args, engine.device)
    if fp8_note is None:
        fp8 = Engine(EngineConfig.model_validate({**engine_config, "quantization": "fp8"}))
        fp8_counter = BlockCounter(fp8.transformer.transformer_blocks)
        try:
            generate(fp8, fp8_counter, request(PROMPTS[0], args.seeds[0], lossless))  # warm-up, as above
            for (prompt, seed), exact in references.items():
                quantized = [generate(fp8, fp8_counter, request(prompt, seed, lossless)) for _ in range(args.repeats)]
                rows.append(compare_fp8(prompt, seed, exact, quantized, decoder))
                print(rows[-1], flush=True)
        finally:
            fp8_counter.remove()
        fp8_note = (f"fp8: engine.quantization fp8 ({fp8.forward_kernels.quantized_linears} block linears, torchao "
                    "float8 rowwise), Cache-DiT off, against the bf16 lossless clips; speedup = bf16 / fp8 step_ms")
    notes = [
        f"checkpoint {checkpoint} ({num_blocks} blocks, hidden {engine.model_config.hidden_size}); random weights, "
        "not the trained model: cache-dit caches a step when block 0's residual changed little since the last "
        "computed step, and a random model's residuals need not change as the trained model's do, so these "
        "PSNRs and skipped fractions describe the mechanism, not H3's quality (trained H3, 4 H200: 1.40x at "
        "28.16 dB, shared/reference.md)",
        f"request {width}x{height}, {seconds:g} s, {args.steps} steps ({args.steps - 1} forwards), "
        f"{engine_config['adaln']['mode']} AdaLN, device {engine.device}; checkpoint made in {made_s:.1f} s, "
        f"engine loaded in {load_s:.1f} s",
        f"lossless: Cache-DiT off per request ({lossless.model_dump(exclude_none=True)}); high: "
        f"videos.high_quality of serve_config.yaml ({high.model_dump(exclude_none=True)})",
        "psnr_frames_db: both clips' latents decoded by the engine's video VAE (uint8 frames, peak 255, before "
        "H.264); psnr_*_latents_db: peak = the lossless tensor's max - min; inf (null in JSON): identical",
        "blocks_run_*: transformer block forwards counted by a pre-hook on every block; skipped_frac = 1 - "
        "high / lossless (a cached step still runs the Fn leading blocks)",
        f"step_ms: the engine's denoise_s / forwards, median of {args.repeats} run(s) after one warm-up pair; "
        "speedup = lossless / high",
        "ssim_frames: luma SSIM of the decoded frames (7x7 uniform windows), mean over frames; 1: identical",
        fp8_note,
    ]
    return rows, notes


def compare(prompt: str, seed: int, exact: list[Run], fast: list[Run], num_blocks: int, decoder: Any) -> dict:
    """One clip's row: high (`fast`) against lossless (`exact`)."""
    reference, cached = exact[0], fast[0]
    # Same request, same bits: the repeats of each quality must agree, or the comparison means nothing.
    for runs in (exact, fast):
        if any(not run.video.equal(runs[0].video) for run in runs[1:]):
            raise RuntimeError(f"{prompt!r} seed {seed}: a repeat gave other latents")
    if reference.cached_steps:
        raise RuntimeError(f"lossless cached steps {reference.cached_steps}: Cache-DiT was not off")
    frames_exact, frames_fast = decoder.decode(reference.video), decoder.decode(cached.video)
    step_exact = statistics.median(r.denoise_s for r in exact) / reference.forwards
    step_fast = statistics.median(r.denoise_s for r in fast) / cached.forwards
    return {
        "prompt": prompt[:40], "seed": seed, "forwards": reference.forwards,
        "cached_steps": f"{len(cached.cached_steps)}/{cached.forwards} {list(cached.cached_steps)}",
        "blocks_run_high": cached.block_calls, "blocks_run_lossless": reference.block_calls,
        "skipped_frac": 1.0 - cached.block_calls / reference.block_calls,
        "psnr_frames_db": finite(psnr(frames_exact, frames_fast, peak=255.0)),
        "psnr_video_latents_db": finite(psnr(reference.video, cached.video)),
        "psnr_audio_latents_db": finite(psnr(reference.audio, cached.audio)),
        "step_ms_lossless": 1000 * step_exact, "step_ms_high": 1000 * step_fast, "speedup": step_exact / step_fast,
        "ssim_frames": ssim(frames_exact, frames_fast),
        "residual_diff_median": statistics.median(cached.residual_diffs) if cached.residual_diffs else None,
        "num_blocks": num_blocks, "tier": HIGH,
    }


def compare_fp8(prompt: str, seed: int, exact: list[Run], quantized: list[Run], decoder: Any) -> dict:
    """One clip's fp8 row: the FP8 engine's clip (Cache-DiT off) against the bf16 lossless one."""
    reference, fp8 = exact[0], quantized[0]
    if any(not run.video.equal(fp8.video) for run in quantized[1:]):
        raise RuntimeError(f"{prompt!r} seed {seed}: an fp8 repeat gave other latents")
    if fp8.cached_steps:
        raise RuntimeError(f"fp8 cached steps {fp8.cached_steps}: Cache-DiT was not off")
    frames_exact, frames_fp8 = decoder.decode(reference.video), decoder.decode(fp8.video)
    step_exact = statistics.median(r.denoise_s for r in exact) / reference.forwards
    step_fp8 = statistics.median(r.denoise_s for r in quantized) / fp8.forwards
    return {
        "tier": FP8, "prompt": prompt[:40], "seed": seed, "forwards": fp8.forwards,
        "psnr_frames_db": finite(psnr(frames_exact, frames_fp8, peak=255.0)),
        "psnr_video_latents_db": finite(psnr(reference.video, fp8.video)),
        "psnr_audio_latents_db": finite(psnr(reference.audio, fp8.audio)),
        "step_ms_lossless": 1000 * step_exact, "step_ms_fp8": 1000 * step_fp8, "speedup": step_exact / step_fp8,
        "ssim_frames": ssim(frames_exact, frames_fp8),
    }


def fp8_refusal(args: argparse.Namespace, device: torch.device) -> str | None:
    """Why the fp8 rows are not measured (None: they are)."""
    from engine.fp8 import QuantizationError, check_fp8_device

    if args.fp8 == "off":
        return "fp8 rows off (--fp8 off)"
    try:
        check_fp8_device(device)
    except QuantizationError as exc:
        if args.fp8 == "on":
            raise
        return f"fp8 rows skipped: {exc}"
    return None


def finite(value: float) -> float | None:
    """JSON has no inf: identical outputs are null (the notes say so)."""
    return None if math.isinf(value) else value


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The high profile over every clip: total blocks skipped, mean step-time speedup, worst PSNRs and SSIM."""
    def psnrs(key: str) -> list[float]:
        return [math.inf if r[key] is None else r[key] for r in rows]

    frames = psnrs("psnr_frames_db")
    return {
        "tier": HIGH, "prompt": "all", "seed": "", "ssim_frames": min(r["ssim_frames"] for r in rows),
        "forwards": sum(r["forwards"] for r in rows),
        "blocks_run_high": sum(r["blocks_run_high"] for r in rows),
        "blocks_run_lossless": sum(r["blocks_run_lossless"] for r in rows),
        "skipped_frac": 1.0 - sum(r["blocks_run_high"] for r in rows) / sum(r["blocks_run_lossless"] for r in rows),
        "psnr_frames_db": finite(min(frames)),  # the worst clip
        "psnr_video_latents_db": finite(min(psnrs("psnr_video_latents_db"))),
        "psnr_audio_latents_db": finite(min(psnrs("psnr_audio_latents_db"))),
        "step_ms_lossless": statistics.mean(r["step_ms_lossless"] for r in rows),
        "step_ms_high": statistics.mean(r["step_ms_high"] for r in rows),
        "speedup": statistics.mean(r["step_ms_lossless"] for r in rows) / statistics.mean(r["step_ms_high"] for r in rows),
    }


def fp8_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The fp8 tier over every clip: worst PSNRs and SSIM, mean step-time speedup."""
    def worst(key: str) -> float | None:
        return finite(min(math.inf if r[key] is None else r[key] for r in rows))

    return {
        "tier": FP8, "prompt": "all", "seed": "", "forwards": sum(r["forwards"] for r in rows),
        **{key: worst(key) for key in ("psnr_frames_db", "psnr_video_latents_db", "psnr_audio_latents_db")},
        "ssim_frames": min(r["ssim_frames"] for r in rows),
        "step_ms_lossless": statistics.mean(r["step_ms_lossless"] for r in rows),
        "step_ms_fp8": statistics.mean(r["step_ms_fp8"] for r in rows),
        "speedup": statistics.mean(r["step_ms_lossless"] for r in rows) / statistics.mean(r["step_ms_fp8"] for r in rows),
    }


def parse_video(text: str) -> tuple[int, int, float]:
    """'768x448x2' -> (width 768, height 448, seconds 2.0)."""
    width, height, seconds = text.lower().split("x")
    return int(width), int(height), float(seconds)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU: tiny checkpoint, 96x64 1 s clips, 2 prompts x 2 seeds")
    p.add_argument("--checkpoint", default=None, help="any MiniMax-H3 checkpoint (default: made under checkpoints/)")
    p.add_argument("--num-blocks", type=int, default=4, help="blocks of a made h3-width checkpoint")
    p.add_argument("--text-layers", type=int, default=2, help="Qwen3-VL layers read of a made checkpoint")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="default: cpu with --quick, else auto")
    p.add_argument("--video", type=parse_video, default=None, help="WxHxSECONDS (default 768x448x2; quick 96x64x1)")
    p.add_argument("--steps", type=int, default=None, help="grid points (default 30; quick 20)")
    p.add_argument("--prompts", type=int, default=None, help=f"how many of the {len(PROMPTS)} prompts (default 2)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=1, help="timed runs per quality and clip (median)")
    p.add_argument("--fp8", choices=["auto", "on", "off"], default="auto",
                   help="fp8 rows: auto where the device runs float8 GEMMs; on: fail where it does not")
    p.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.quick else "auto")
    args.video = args.video or ((96, 64, 1.0) if args.quick else (768, 448, 2.0))
    args.steps = args.steps or (20 if args.quick else 30)
    args.prompts = min(args.prompts or 2, len(PROMPTS))
    return args


def device_tag(device: str) -> str:
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    return "-".join(torch.cuda.get_device_name(0).lower().split())  # e.g. nvidia-h200


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    rows, notes = measure(args)
    high = [row for row in rows if row["tier"] == HIGH]
    fp8 = [row for row in rows if row["tier"] == FP8]
    rows = [*high, summary(high), *fp8, *([fp8_summary(fp8)] if fp8 else [])]
    notes.append(f"total wall time {time.perf_counter() - start:.0f} s (checkpoint making and loading included); "
                 f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (step times of a "
                 "shared machine carry its other work)")
    md, js = write_results("quality", rows, device=device_tag(args.device), command=command_line(),
                           columns=COLUMNS, notes=notes, out_dir=args.out)
    print(md.read_text())
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
