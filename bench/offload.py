"""Layerwise offload x cache-dit benchmark on MiniMax-H3's blocks: resident vs streamed (sglang's rules, ours,
ours with r resident) vs diffusers group offloading, each without cache and with DBCache configs.

    python -m bench.offload                 # H3 width, 16 blocks, 640x320 5 s (~7.8k tokens), 20 steps (GPU)
    python -m bench.offload --smoke         # tiny width on the CPU fake device, seconds

The model is diffusers' `MiniMaxH3Transformer3DModel` with random weights (`bench.checkpoints.random_transformer`)
at h3 width with `--blocks` blocks, served as the engine serves it: AdaLN from precomputed rows through
`model.adaln.ExternalModulation` (so a block streams 0.77 GB: no adaln_proj), the packed t2va sequence from
`model.denoise.Denoiser` (text | audio | video, random text embeddings of `--text-tokens` rows), DBCache via
`cache.cache_dit.CacheDit` on `transformer_blocks`. One request = the H3 schedule of `--steps` grid points
(steps - 1 forwards, video shift 12 / audio shift 3) from fixed noise.

Reported per (mode, cache): step time; H2D bytes per step; peak VRAM; ratio to the floor
max(compute, bytes / H2D bandwidth), compute = the resident step time with the same cache config and the
bandwidth measured with a pinned copy; cache speedup vs the ideal (block calls without / with cache); PSNR of the
final video latents vs the same mode without cache (peak = their value range); bit-exactness vs resident.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.checkpoints import PRESETS, random_transformer
from bench.common import device_description, git_commit
from cache.cache_dit import CacheDitConfig, CacheDitOverrides
from device.streams import FakeDevice, make_device
from model.adaln import ExternalModulation, Modulation, adaln_input, resident_modulation
from model.denoise import Denoiser
from model.geometry import GeometryLimits, VideoGeometry
from model.schedule import H3Schedule
from offload import LayerwiseOffloader, OffloadConfig

logger = logging.getLogger("bench.offload")

# ---------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    blocks: int = 16
    width: int = 640
    height: int = 320
    seconds: float = 5.0
    text_tokens: int = 256
    steps: int = 20  # grid points: steps - 1 forwards


SMOKE_SHAPE = Shape(blocks=4, width=64, height=64, seconds=1.0, text_tokens=16, steps=8)
ANY_SIZE = GeometryLimits(short_edge=None, max_pixels=4096 * 4096, min_seconds=0.1, max_seconds=60.0)


@dataclass
class BenchModel:
    """The transformer with external AdaLN rows, the request's denoiser, text rows and per-forward rows."""

    transformer: torch.nn.Module
    external: ExternalModulation
    modulations: list[Modulation]   # one per forward, on the device
    denoiser: Denoiser
    text: torch.Tensor              # [text_tokens, text_dim]

    @property
    def num_forwards(self) -> int:
        return len(self.modulations)


@torch.no_grad()
def build_model(s: Shape, smoke: bool, device: torch.device, seed: int) -> BenchModel:
    """Random H3-architecture transformer on `device`; every forward's AdaLN rows computed once from its own
    projections, which `ExternalModulation.install` then drops (the engine's online mode, minus the cache)."""
    config = PRESETS["tiny" if smoke else "h3"].model_copy(update={"num_layers": s.blocks})
    transformer = random_transformer(config, seed, device)
    schedule = H3Schedule.build(s.steps)
    modulations = [resident_modulation(transformer, adaln_input(transformer, plan.to(device)))
                   for plan in schedule.plans]
    external = ExternalModulation.install(transformer)
    geometry = VideoGeometry.from_seconds(s.width, s.height, s.seconds, ANY_SIZE)
    text = torch.randn(s.text_tokens, config.text_dim, generator=torch.Generator().manual_seed(seed))
    return BenchModel(transformer, external, modulations, Denoiser(geometry, schedule, s.text_tokens, device),
                      text.to(device, torch.bfloat16))


# ---------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------

CACHE_RE = re.compile(r"(?P<k>MC|M|TS|F|B|W|R)(?P<v>[0-9.]+)")


def parse_cache(spec: str) -> CacheDitConfig:
    """'none' or cache-dit shorthand such as 'F1B2 W8 R0.08 MC2' (spaces, '-' or '_' between tokens)."""
    if spec.strip().lower() in ("none", "off"):
        return CacheDitConfig(enabled=False)
    fields = {"F": "Fn_compute_blocks", "B": "Bn_compute_blocks", "W": "max_warmup_steps",
              "R": "residual_diff_threshold", "MC": "max_continuous_cached_steps", "M": "max_cached_steps",
              "TS": "taylorseer_order"}
    kw: dict = {"enabled": True}
    for m in CACHE_RE.finditer(spec.replace("-", " ").replace("_", " ")):
        key, val = m.group("k"), m.group("v")
        kw[fields[key]] = float(val) if key == "R" else int(val)
        if key == "TS":
            kw["enable_taylorseer"] = True
    return CacheDitConfig(**kw)


def overrides_for(cfg: CacheDitConfig) -> CacheDitOverrides:
    return CacheDitOverrides(**cfg.model_dump())


@dataclass
class Run:
    mode: str
    cache: str
    step_time_s: float
    h2d_bytes_per_step: float
    peak_gb: float | None
    block_calls: int
    cached_steps: list[int]
    sync_loads: int | None = None
    prefetches: int | None = None
    wasted_prefetches: int | None = None
    resident_blocks: int | None = None
    floor_s: float | None = None
    ratio_to_floor: float | None = None
    speedup: float | None = None
    ideal_speedup: float | None = None
    psnr_db: float | None = None
    bit_exact_vs_resident: bool | None = None
    output: torch.Tensor | None = field(default=None, repr=False)


class DiffusersBytes:
    """Counts bytes diffusers' group offloading copies to the device (patches ModuleGroup.onload_)."""

    def __init__(self):
        from diffusers.hooks import group_offloading as go

        self.nbytes = 0
        self.calls = 0
        original = go.ModuleGroup.onload_
        counter = self

        def onload_(group):
            tensors = list(group.cpu_param_dict.values()) if group.cpu_param_dict else [
                t for m in group.modules for t in list(m.parameters()) + list(m.buffers())]
            counter.nbytes += sum(t.numel() * t.element_size() for t in tensors)
            counter.calls += 1
            return original(group)

        go.ModuleGroup.onload_ = onload_


def request(bench: BenchModel, cache, cfg: CacheDitConfig, device, off=None,
            calls: list | None = None, num_forwards: int | None = None) -> tuple[torch.Tensor, float, list[int]]:
    """One request (the first `num_forwards` forwards); returns (final video rows on CPU, seconds, cached steps)."""
    num_forwards = num_forwards or bench.num_forwards
    effective = cache.refresh(num_forwards, overrides_for(cfg))
    if off is not None:
        if effective.enabled:
            off.set_cache_blocks(effective.Fn_compute_blocks, effective.Bn_compute_blocks)
        else:
            off.clear_cache_blocks()
        off.device.synchronize()  # replan loads land before the clock starts
        off.reset_stats()
    latents = bench.denoiser.initial_latents(0)
    sync(device)
    if calls is not None:
        calls.clear()
    t0 = time.perf_counter()
    for i in range(num_forwards):
        will = cache.predict_middle()
        if off is not None:
            off.begin_step(will)
        bench.external.set(bench.modulations[i])
        video, audio = bench.denoiser.transformer_inputs(i, latents, bench.text).run(bench.transformer)
        latents = bench.denoiser.step(i, latents, video, audio)
    sync(device)
    return latents.video.cpu(), time.perf_counter() - t0, cache.cached_steps()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def h2d_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a host -> device copy from pinned memory (a plain copy on the CPU)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(2):
        dst.copy_(src, non_blocking=True)
    sync(device)
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    sync(device)
    return reps * nbytes / (time.perf_counter() - t0)


def psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    mse = (x.double() - ref.double()).pow(2).mean().item()
    peak = (ref.max() - ref.min()).item()
    return float("inf") if mse == 0 else 10 * math.log10(peak * peak / mse)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = Shape()
    p.add_argument("--smoke", action="store_true", help="tiny width on the CPU fake device")
    for name in ("blocks", "width", "height", "text_tokens", "steps"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {getattr(d, name)}")
    p.add_argument("--seconds", type=float, default=None, help=f"default {d.seconds}")
    p.add_argument("--resident", type=int, default=4, help="r for the 'ours, r resident' mode")
    p.add_argument("--policy", default="leading", choices=("leading", "strided"))
    p.add_argument("--depth", type=int, default=1, help="prefetch depth")
    p.add_argument("--modes", default="resident,sglang,ours,ours-r,diffusers")
    p.add_argument("--caches", default="none;F1B2 W8 R0.08 MC2;F1B0 W4 R0.24 MC3", help="';'-separated")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results", help="folder for offload-<device>.md/.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("cache_dit", "diffusers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)

    base = SMOKE_SHAPE if args.smoke else d
    shape = Shape(**{k: getattr(args, k) if getattr(args, k) is not None else getattr(base, k)
                     for k in Shape.__dataclass_fields__})
    if args.device == "auto":
        device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    else:
        device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    caches = [parse_cache(c) for c in args.caches.split(";")]
    modes = args.modes.split(",")
    torch.manual_seed(args.seed)

    from cache.cache_dit import CacheDit  # imports cache_dit

    bench = build_model(shape, args.smoke, device, args.seed)
    model = bench.transformer
    blocks = model.transformer_blocks
    num_forwards = bench.num_forwards
    block_bytes = sum(t.numel() * t.element_size() for t in blocks[0].parameters())
    tokens = bench.denoiser.geometry.num_tokens(shape.text_tokens)
    calls: list[int] = []
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
    max_fn_bn = max(c.Fn_compute_blocks + c.Bn_compute_blocks for c in caches)
    if max_fn_bn > shape.blocks:
        raise SystemExit(f"a cache config needs Fn + Bn = {max_fn_bn} blocks; the model has {shape.blocks}")
    cache = CacheDit(model, CacheDitConfig(enabled=True, Fn_compute_blocks=1, Bn_compute_blocks=min(2, shape.blocks - 1)))
    bw = h2d_bandwidth(device, min(1 << 30, 64 * block_bytes))
    logger.info("shape %s (%d tokens), block %.3f GB, H2D %.1f GB/s, device %s", shape, tokens, block_bytes / 1e9,
                bw / 1e9, torch.cuda.get_device_name(device) if on_gpu else "cpu (fake device)")

    runs: list[Run] = []

    def measure(mode: str, off=None, diffusers_bytes: DiffusersBytes | None = None, resident_blocks=None):
        for cfg in caches:
            if on_gpu:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            before = diffusers_bytes.nbytes if diffusers_bytes else 0
            out, seconds, cached = request(bench, cache, cfg, device, off, calls)
            if on_gpu:
                peak = torch.cuda.max_memory_allocated(device) / 1e9
            elif off is not None:
                peak = off.stats.peak_device_bytes / 1e9  # block weights only (fake device)
            else:
                peak = shape.blocks * block_bytes / 1e9
            if off is not None:
                h2d = sum(off.stats.h2d_bytes_per_step) / num_forwards
            elif diffusers_bytes is not None:
                h2d = (diffusers_bytes.nbytes - before) / num_forwards
            else:
                h2d = 0.0
            run = Run(mode, cfg.label(), seconds / num_forwards, h2d, peak, len(calls), cached, output=out,
                      resident_blocks=resident_blocks() if callable(resident_blocks) else resident_blocks)
            if off is not None:
                run.sync_loads, run.prefetches, run.wasted_prefetches = (
                    off.stats.sync_loads, off.stats.prefetches, off.stats.wasted_prefetches)
            runs.append(run)
            logger.info("%-10s %-20s %.4f s/step  %.3f GB H2D/step  peak %s  calls %d  cached %s", mode, run.cache,
                        run.step_time_s, h2d / 1e9, f"{peak:.2f} GB" if peak is not None else "-", len(calls), cached)

    def warmup(off=None):
        request(bench, cache, CacheDitConfig(enabled=False), device, off, num_forwards=args.warmup_steps)

    failed: list[str] = []

    def run_mode(mode: str) -> None:
        if mode == "resident":
            warmup()
            measure("resident", resident_blocks=shape.blocks)
        elif mode in ("sglang", "ours", "ours-r"):
            cfg = OffloadConfig(
                enabled=True, prefetch_depth=args.depth,
                num_resident=args.resident if mode == "ours-r" else 0, residency_policy=args.policy,
                skip_predictive=mode != "sglang", resident_cache_edges=mode != "sglang",
            )
            off = LayerwiseOffloader(blocks, cfg, FakeDevice() if isinstance(dev, FakeDevice) else dev,
                                     root=model).apply()
            try:
                if on_gpu:
                    torch.cuda.empty_cache()
                warmup(off)
                label = {"sglang": "stream (sglang rules)", "ours": "stream (ours)",
                         "ours-r": f"stream (ours, r={args.resident} {args.policy})"}[mode]
                measure(label, off=off, resident_blocks=lambda: len(off.resident_indices))
            finally:
                off.remove()
        elif mode == "diffusers":
            import importlib.util

            # diffusers' group offloading moves hook inputs with accelerate's send_to_device.
            if importlib.util.find_spec("diffusers") is None or importlib.util.find_spec("accelerate") is None:
                logger.warning("diffusers or accelerate missing: skipping group offloading")
                return
            from diffusers.hooks import apply_group_offloading

            counter = DiffusersBytes()
            apply_group_offloading(model, onload_device=device, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1,
                                   use_stream=on_gpu, record_stream=on_gpu)
            if on_gpu:
                torch.cuda.empty_cache()
            warmup()
            measure("diffusers group offload" + ("" if on_gpu else " (no stream: CPU)"), diffusers_bytes=counter,
                    resident_blocks=0)
        else:
            raise SystemExit(f"unknown mode {mode!r}")

    dev = make_device(device)
    command = "python -m bench.offload " + " ".join(argv if argv is not None else sys.argv[1:])
    for mode in modes:
        t_mode = time.perf_counter()
        try:
            run_mode(mode)
        except Exception:  # keep the other modes' results
            logger.exception("mode %s failed", mode)
            failed.append(mode)
        logger.info("mode %s took %.1f s", mode, time.perf_counter() - t_mode)
        write_results(runs, failed, shape, tokens, model.config, block_bytes, bw, args, command, device,
                      Path(args.out), quiet=True)
    write_results(runs, failed, shape, tokens, model.config, block_bytes, bw, args, command, device, Path(args.out))
    return 1 if failed else 0


def write_results(runs, failed, shape, tokens, model_config, block_bytes, bw, args, command, device, out: Path,
                  quiet=False) -> None:
    on_gpu = device.type == "cuda"
    by = {(r.mode, r.cache): r for r in runs}
    for r in runs:
        res = by.get(("resident", r.cache))
        none = by.get((r.mode, "off"))
        if res is not None:
            r.floor_s = max(res.step_time_s, r.h2d_bytes_per_step / bw)
            r.ratio_to_floor = r.step_time_s / r.floor_s
            r.bit_exact_vs_resident = bool(torch.equal(r.output, res.output))
        if none is not None:
            r.speedup = none.step_time_s / r.step_time_s
            r.ideal_speedup = none.block_calls / r.block_calls
            r.psnr_db = psnr(r.output, none.output)
    meta = {
        "command": command,
        "git_commit": git_commit(),
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu (fake device)",
        "torch": torch.__version__,
        "device_description": device_description(str(device)),
        "shape": asdict(shape),
        "tokens": tokens,
        "hidden": model_config.hidden_size, "heads": model_config.num_attention_heads,
        "head_dim": model_config.attention_head_dim, "ffn": model_config.ffn_dim,
        "block_bytes": block_bytes,
        "h2d_bandwidth_gbps": bw / 1e9,
        "prefetch_depth": args.depth,
        "resident_r": args.resident,
        "policy": args.policy,
        "failed_modes": failed,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    table = markdown(runs, meta, on_gpu, unit=1e9 if on_gpu else 1e6)
    slug = "cpu" if not on_gpu else re.sub(r"[^a-z0-9]+", "-", meta["device"].lower()).strip("-")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"offload-{slug}.md").write_text(table)
    rows = [{k: v for k, v in asdict(r).items() if k != "output"} for r in runs]
    (out / f"offload-{slug}.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1, default=str))
    if not quiet:
        print(table)
        logger.info("wrote %s", out / f"offload-{slug}.md")


def markdown(runs: list[Run], meta: dict, on_gpu: bool, unit: float = 1e9) -> str:
    def f(v, fmt):
        return "-" if v is None else (("inf" if v == float("inf") else format(v, fmt)) if isinstance(v, float) else str(v))

    s = meta["shape"]
    u = "GB" if unit == 1e9 else "MB"
    lines = [
        f"# Layerwise offload x cache-dit ({meta['device']})",
        "",
        f"- command: `{meta['command']}`",
        f"- git commit: {meta['git_commit']}, torch {meta['torch']}, {meta['date']}",
        f"- device: {meta['device_description']}",
        f"- model: diffusers MiniMaxH3Transformer3DModel, random weights, {s['blocks']} blocks of hidden "
        f"{meta['hidden']} ({meta['heads']}x{meta['head_dim']} attention, SwiGLU {meta['ffn']}), AdaLN rows supplied "
        f"through ExternalModulation (no adaln_proj streamed); t2va {s['width']}x{s['height']} {s['seconds']:g} s + "
        f"{s['text_tokens']} text rows = {meta['tokens']} tokens; {s['steps']} steps ({s['steps'] - 1} forwards); "
        f"{meta['block_bytes'] / 1e9:.3f} GB per block",
        f"- H2D bandwidth (pinned copy): {meta['h2d_bandwidth_gbps']:.1f} GB/s; prefetch depth {meta['prefetch_depth']}",
        "- floor = max(resident step time with the same cache, H2D bytes per step / bandwidth); ideal speedup = block "
        "calls without cache / with cache; PSNR of the final latents vs the same mode without cache",
        "- peak: " + ("torch.cuda.max_memory_allocated over the request" if on_gpu else
                      "block-weight bytes on the fake device (CPU smoke: timings are not meaningful)"),
        "",
        f"| mode | cache | resident blocks | s/step | H2D {u}/step | peak {u} | x floor | block calls | cached steps "
        "| speedup (ideal) | PSNR dB | = resident | sync loads | wasted prefetches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r.mode} | {r.cache} | {f(r.resident_blocks, 'd')} | {r.step_time_s:.4f} | {r.h2d_bytes_per_step / unit:.3f} "
            f"| {f(None if r.peak_gb is None else r.peak_gb * 1e9 / unit, '.2f')} | {f(r.ratio_to_floor, '.2f')} | {r.block_calls} | {len(r.cached_steps)} "
            f"| {f(r.speedup, '.2f')} ({f(r.ideal_speedup, '.2f')}) | {f(r.psnr_db, '.1f')} "
            f"| {f(r.bit_exact_vs_resident, '')} | {f(r.sync_loads, 'd')} | {f(r.wasted_prefetches, 'd')} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
