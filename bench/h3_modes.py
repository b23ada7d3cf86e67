"""A 5 s 1344x768 MiniMax-H3 request end to end per forward mode, and the same with a Turbo LoRA (8 forwards).

    python -m bench.h3_modes --smoke                              # CPU: tiny width, every mode (~1-2 min)
    python -m bench.h3_modes --num-blocks 8 --workdir /dev/shm/h3 # one H200: h3 width, 8 of the 50 blocks

Modes (`--modes`, comma-separated): `eager` (bf16, what serves by default), `compiled` (`engine.compile.mode:
blocks`, warmed up at start on the request's canvas: warm-up seconds reported apart), `fp8`
(`engine.quantization: fp8`, eager) and `fp8+compiled`. One `engine.Engine` per mode, built and freed in turn on
the same random checkpoint (`bench.checkpoints`, h3 width, `--num-blocks` blocks, `--text-layers` Qwen3-VL layers);
each has the same adapter configured (`engine.adapters.turbo`: a random rank-`--rank` LoRA on the six Turbo
targets of every block and refiner block, saved in the diffusers layout in the workdir, with the Turbo 768p
defaults: 9 points, flow_shift 6, audio_flow_shift 3).

Per mode, on the same prompt embedding and seed:
- `50 steps`: forwards 1..`--forwards` of the default 50-point schedule after forward 0 (`bench.h3.run_steps`: the
  engine's loop on its transformer and plan slab; the adapter installed, off), scaled to 49 forwards;
- `turbo` (`--turbo`, on by default): the whole 9-point request through `engine.denoise` naming the adapter
  (unfused, peft's layers), twice: the first pays its plan miss (and compiled, the graphs with the adapter on,
  which the start-up warm-up does not run), the second is the timed one.
The stages that do not depend on the mode are measured once, on the eager engine, and shared: prompt encode
(prompt cache off), plan miss (49 plans, page cache), video + audio decode and the MP4 mux (an `engine.generate`
of the Turbo request). End to end: those + 49 (or 8) forwards, every number scaled to 50 blocks / 50 text layers,
beside the goals (issue 25: 50 steps lossless <= 260 s, today ~335 s; issue 24: Turbo <= 60 s) and the floor
(matmul FLOPs / the measured bf16 GEMM rate; fp8 modes: projections at twice it).

On a CPU (`--smoke`) the fp8 modes run torchao's float8 tensors with the float8-hardware checks lifted (as
tests/test_fp8_adapters.py does: torch's `_scaled_mm` runs on a CPU) and compile uses dynamo's eager backend.
Writes <out>/h3-modes-<device>.md and .json (commit, device, command, notes, every table).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.adapters import build_model, lora_targets, random_factors
from bench.checkpoints import PRESETS, RELEASED_COMPONENTS, SMALL_COMPONENTS, make_random_checkpoint, write_h3_components
from bench.common import device_description, git_commit, write_sectioned_report
from bench.h3 import (H3_REQUEST, PAGE_CACHE_GBPS, PROMPT, RELEASED_BLOCKS, RELEASED_STEPS, RELEASED_TEXT_LAYERS,
                      SMOKE_PROMPT, SMOKE_REQUEST, BlockSpan, Deadline, Peak, Rig, at_blocks, forward_flops,
                      measure_limits, run_steps, sync)
from engine.fp8 import stored_bytes
from model.tiny_adapter import save_adapter

logger = logging.getLogger("bench.h3_modes")

MODES = ("eager", "compiled", "fp8", "fp8+compiled")
#: The H3 Turbo 768p 8-step files' defaults (issue 24): 9 sigma points, shifts 6 / 3.
TURBO_STEPS, TURBO_FLOW_SHIFT, TURBO_AUDIO_FLOW_SHIFT = 9, 6.0, 3.0
LOSSLESS_GOAL_S, TODAY_50_STEPS_S, TURBO_GOAL_S = 260.0, 335.0, 60.0


@dataclass
class Report:
    """Everything measured so far; written after every mode, so a cut-short run keeps what it measured."""

    meta: dict[str, Any]
    setup: list[dict[str, Any]] = field(default_factory=list)
    shared_stages: list[dict[str, Any]] = field(default_factory=list)
    modes: list[dict[str, Any]] = field(default_factory=list)
    turbo: list[dict[str, Any]] = field(default_factory=list)
    end_to_end: list[dict[str, Any]] = field(default_factory=list)
    text_encoder: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def write(self, out: Path, tag: str) -> Path:
        sections = (("Setup", self.setup), ("Stages shared by every mode (measured once, eager engine)",
                                            self.shared_stages),
                    ("Denoise per mode (50-step schedule)", self.modes),
                    ("Turbo request per mode (9 points, 8 forwards)", self.turbo),
                    ("End to end, scaled to 50 blocks", self.end_to_end),
                    ("Text encoder bf16 vs fp8 (text_encoder.quantization)", self.text_encoder))
        return write_sectioned_report(out, f"h3-modes-{tag}", "MiniMax-H3 request end to end per forward mode",
                                      self.meta, self.notes, [(t, [_flat(r) for r in rows]) for t, rows in sections],
                                      self.skipped, dataclasses.asdict(self))


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    """A row with its nested `scaled_from` as one readable cell."""
    scaled = row.get("scaled_from")
    if not isinstance(scaled, dict):
        return row
    return {**row, "scaled_from": ", ".join(f"{k} {v}" for k, v in scaled.items())}


def text_encoder_rows(config, prompt: str) -> list[dict[str, Any]]:
    """The prompt encoder of `config` (an `EngineConfig`) bf16 and fp8, one after the other: its bytes as stored
    and the fp8 prompt embedding's relative error ||fp8 - bf16|| / ||bf16|| (fp32 norms of [tokens, text_dim])."""
    from engine.prepare import prepare_stage

    rows, reference = [], None
    for quantization in ("none", "fp8"):
        text = config.text_encoder.model_copy(update={"quantization": quantization, "vision": False})
        t0 = time.perf_counter()
        stage = prepare_stage(config.model_copy(update={"text_encoder": text})).prompt
        load_s = time.perf_counter() - t0
        embeds = stage.encoder.encode(prompt).float().cpu()
        reference = embeds if reference is None else reference
        weights = stage.weights
        rows.append({"text_encoder": "bf16" if quantization == "none" else "fp8", "layers": weights.decoder_layers,
                     "quantized_linears": weights.quantized_linears, "GiB": round(weights.bytes / 2**30, 4),
                     "load_s": round(load_s, 2), "tokens": int(embeds.shape[0]),
                     "rel_error": float((embeds - reference).norm() / reference.norm())})
        del stage
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def cpu_float8() -> Iterator[None]:
    """On a CPU: the engine's and torchao's float8-hardware checks lifted (torch's `_scaled_mm` runs there), so
    `engine.quantization: fp8` builds the weights the GPU would hold. Smoke only: timings are not meaningful."""
    from unittest import mock

    with mock.patch("engine.fp8.check_fp8_device", lambda device, field="": None), \
            mock.patch("torchao.quantization.quant_api._check_hardware_support", lambda granularity: None):
        yield


def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise SystemExit(f"--modes: unknown {unknown or text!r}; choose from {', '.join(MODES)}")
    return modes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny width on CPU, every mode (~1-2 min)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--turbo", action=argparse.BooleanOptionalAction, default=True,
                    help="the 9-point Turbo-adapter request per mode (default on)")
    ap.add_argument("--num-blocks", type=int, default=None, help="transformer blocks (h3: 8; smoke: 2)")
    ap.add_argument("--text-layers", type=int, default=None, help="Qwen3-VL decoder layers read (h3: 4; smoke: 2)")
    ap.add_argument("--forwards", type=int, default=3, help="timed forwards of the 50-step schedule per mode, "
                    "after one warm-up forward (scaled to 49)")
    ap.add_argument("--rank", type=int, default=None, help="adapter rank (128; smoke: 4)")
    ap.add_argument("--compile-backend", default=None, choices=("inductor", "aot_eager", "eager"),
                    help="engine.compile.backend (inductor; smoke: eager)")
    ap.add_argument("--workdir", default=None, help="where the checkpoint and adapter are written (default: temp)")
    ap.add_argument("--workers", type=int, default=8, help="checkpoint shards written at once")
    ap.add_argument("--budget-s", type=float, default=480, help="stop starting modes after this")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    for noisy in ("cache_dit", "diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    modes = parse_modes(args.modes)
    if args.forwards < 1:
        raise SystemExit("--forwards must be >= 1")
    deadline = Deadline(args.budget_s)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.num_blocks = args.num_blocks or (2 if args.smoke else 8)
    args.text_layers = args.text_layers or (2 if args.smoke else 4)
    args.rank = args.rank or (4 if args.smoke else 128)
    args.compile_backend = args.compile_backend or ("eager" if device.type == "cpu" else "inductor")
    tag = "cpu" if device.type == "cpu" else "-".join(torch.cuda.get_device_name(device).lower().split())
    tag = f"smoke-{tag}" if args.smoke else tag
    command = "python -m bench.h3_modes " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                             else sys.argv[1:]))
    report = Report(meta={"commit": git_commit(), "device": tag, "device_description": device_description(str(device)),
                          "command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                          "num_blocks": args.num_blocks, "text_layers": args.text_layers, "modes": list(modes),
                          "turbo": args.turbo, "forwards_timed": args.forwards, "rank": args.rank,
                          "compile_backend": args.compile_backend})
    out = Path(args.out)
    tmp = None
    workdir = Path(args.workdir) if args.workdir else Path(tmp := tempfile.mkdtemp(prefix="bench-h3-modes-"))
    try:
        with cpu_float8() if device.type == "cpu" else contextlib.nullcontext():
            Bench(args, report, out, tag, device, deadline, workdir, modes).run()
    except Exception as exc:  # keep what was measured
        logger.exception("bench.h3_modes failed")
        report.skipped.append(f"run stopped by {type(exc).__name__}: {exc}"[:400])
        report.write(out, tag)
        return 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    report.meta["finished_in_s"] = round(time.monotonic() - deadline.start, 1)
    path = report.write(out, tag)
    print(path.read_text())
    return 0


@dataclass
class Shared:
    """What the eager engine measured for every mode: the prompt's embedding and the mode-independent stages."""

    embedding: Any  # engine.stage_data.PromptEmbedding, on the CPU
    encode_s: float
    plan_miss_s: float
    decode_s: float
    mux_s: float
    plan_bytes_scale: float  # AdaLN bytes at 50 blocks / at the measured blocks


class Bench:
    def __init__(self, args, report: Report, out: Path, tag: str, device: torch.device, deadline: Deadline,
                 workdir: Path, modes: tuple[str, ...]):
        self.args, self.report, self.out, self.tag = args, report, out, tag
        self.device, self.deadline, self.workdir, self.modes = device, deadline, workdir, modes
        self.config = PRESETS["tiny" if args.smoke else "h3"].model_copy(update={"num_layers": args.num_blocks})
        self.request_shape = SMOKE_REQUEST if args.smoke else H3_REQUEST
        self.prompt = SMOKE_PROMPT if args.smoke else PROMPT
        self.shared: Shared | None = None
        self.eager_forward_s: float | None = None

    def write(self) -> None:
        self.report.write(self.out, self.tag)

    # --- setup -------------------------------------------------------------------------------------

    def run(self) -> None:
        args, report = self.args, self.report
        self.limits = measure_limits(self.device, args.smoke)
        report.notes.append(f"measured ceilings: bf16 GEMM {self.limits.gemm_tflops:.4g} TFLOP/s, pinned H2D "
                            f"{self.limits.h2d_gbps:.4g} GB/s, device copy {self.limits.hbm_gbps:.4g} GB/s")
        report.notes.append(
            f"model: MiniMax-H3 architecture at hidden {self.config.hidden_size}, {args.num_blocks} of "
            f"{RELEASED_BLOCKS} blocks, random bf16 weights, {args.text_layers} of {RELEASED_TEXT_LAYERS} text layers"
            if not args.smoke else "smoke: tiny width, tiny components; timings are not meaningful")
        report.notes += [
            f"50-step rows: forwards 1..{args.forwards} of the 50-point schedule after forward 0 (warm-up), the "
            "engine's loop on each mode's engine (plans from its slab, adapter installed and off); one mode's "
            "forwards run on its own velocities (the same seed, prompt embedding and schedule for every mode)",
            "turbo rows: the whole 9-point request (8 forwards) through engine.denoise with the adapter unfused "
            "(peft layers) at scale 1; the first request after the start is reported apart (its plan miss; compiled "
            "modes warm the canvas with the adapter on too, so its compiles_in_first should be 0)",
            f"compiled modes: engine.compile.mode blocks, backend {args.compile_backend}, dynamic, warm-up on the "
            "request canvas, plain and with the adapter (engine.compile.warmup: the forwards that compile): reported "
            "as compile_warmup_s",
            "x_bf16_floor: the forward over matmul FLOPs / the measured bf16 GEMM rate (fp8 modes also against their "
            "own floor, projections at twice the rate); at_50_blocks: the blocks' share (first block's start to last "
            "block's end, CUDA events: bench.h3.BlockSpan) x 50 / blocks, the rest (embedders, heads) as measured",
            "transformer_GiB: the mode's transformer as stored (float8 weights: their fp8 data and scales; the "
            "adapter's factors included); peak_GiB: max allocated during the 50-step forwards, the engine alone on "
            "the device except for the eager one (it holds the text encoder and VAEs)",
        ]
        self.root = self.workdir / f"h3-b{args.num_blocks}-t{args.text_layers}"
        self.adapter_path = self.workdir / f"turbo-r{args.rank}-b{args.num_blocks}.safetensors"
        self.make_files()
        report.text_encoder = text_encoder_rows(self.engine_config("eager"), self.prompt)
        report.notes.append("text encoder rows: the checkpoint's Qwen3-VL layers read (--text-layers) bf16, then "
                            "text_encoder.quantization fp8 (decoder-layer linears float8), one at a time on the "
                            "engine's device; rel_error: the fp8 prompt embedding against the bf16 one")
        self.write()
        for mode in self.modes:
            if self.deadline.left() < (20 if args.smoke else 60):
                report.skipped.append(f"{mode}: out of time budget (--budget-s {args.budget_s:g})")
                continue
            self.run_mode(mode)
            self.write()
        self.end_to_end()

    def make_files(self) -> None:
        args, report = self.args, self.report
        if not (self.root / "model_index.json").exists():
            t0 = time.perf_counter()
            make_random_checkpoint(self.root, self.config, "diffusers", seed=0, workers=args.workers, device=self.device)
            write_h3_components(self.root, "diffusers", 0, text_layers=args.text_layers + 1, device=self.device,
                                sizes=SMALL_COMPONENTS if args.smoke else RELEASED_COMPONENTS)
            report.setup.append({"what": f"checkpoint, {args.num_blocks} blocks + components",
                                 "seconds": round(time.perf_counter() - t0, 2)})
        if not self.adapter_path.exists():
            t0 = time.perf_counter()
            targets = lora_targets(build_model(self.config, "meta"))
            save_adapter(self.adapter_path, random_factors(targets, args.rank, seed=1), alpha=float(args.rank))
            report.setup.append({"what": f"adapter file: rank {args.rank}, {len(targets)} modules (six targets x "
                                 f"{self.config.num_layers} blocks + {self.config.num_refiner_layers} refiner)",
                                 "seconds": round(time.perf_counter() - t0, 2),
                                 "GB": round(self.adapter_path.stat().st_size / 1e9, 3)})
        self.write()

    def engine_config(self, mode: str):
        from engine.config import EngineConfig

        plan_page_bytes = (self.args.num_blocks * self.config.adaln_width + self.config.final_adaln_width) * 2
        compiled = "compiled" in mode
        shape = self.request_shape
        canvas = {"width": shape.width, "height": shape.height, "seconds": (shape.frames - 1) / 24}
        # The canvas once plain and once with the adapter on (another graph of the compiled block).
        warmup = [canvas, {**canvas, "adapters": ["turbo"]}] if compiled else []
        return EngineConfig(
            checkpoint=str(self.root), device=self.device.type,
            text_encoder={"hidden_state_index": self.args.text_layers, "prompt_cache_mb": 0},
            adaln={"mode": "online", "gpu_plans": 64,
                   "host_cache_gb": max(0.05, 4 * RELEASED_STEPS * 2 * plan_page_bytes / 1e9)},
            geometry=None if not self.args.smoke else {"short_edge": None, "min_seconds": 1.0},
            adapters={"turbo": {"path": str(self.adapter_path), "steps": TURBO_STEPS, "flow_shift": TURBO_FLOW_SHIFT,
                                "audio_flow_shift": TURBO_AUDIO_FLOW_SHIFT}},
            compile={"mode": "blocks" if compiled else "off", "backend": self.args.compile_backend, "warmup": warmup},
            quantization="fp8" if "fp8" in mode else "none",
        )

    def request(self, *, turbo: bool, return_video: bool = False):
        from engine.api import AdapterChoice, GenerationRequest

        shape = self.request_shape
        return GenerationRequest(prompt=self.prompt, seconds=(shape.frames - 1) / 24, width=shape.width,
                                 height=shape.height, seed=0, return_video=return_video,
                                 adapters=(AdapterChoice(name="turbo"),) if turbo else ())

    # --- one mode --------------------------------------------------------------------------------------

    def run_mode(self, mode: str) -> None:
        from engine.engine import DenoiserEngine, Engine

        first = self.shared is None
        if "compiled" in mode:
            torch._dynamo.reset()  # the previous mode's graphs: one engine's compiles never count against another's
        t0 = time.perf_counter()
        engine = (Engine if first else DenoiserEngine)(self.engine_config(mode))
        load_s = time.perf_counter() - t0
        compile_stats = engine.forward_kernels.compile_stats()
        warmup_s = compile_stats.warmup_s if compile_stats is not None else None
        logger.info("%s engine: %.1f s (warm-up %s)", mode, load_s, warmup_s)
        try:
            if first:
                self.measure_shared(engine)
            self.denoise_50(engine, mode, load_s, warmup_s)
            self.write()
            if self.args.turbo:
                self.turbo(engine, mode)
        finally:
            engine.adapters.close()
            del engine
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def measure_shared(self, engine) -> None:
        """Prompt encode, plan miss, decode and mux on the eager engine: the stages no forward mode changes."""
        from engine.engine import request_schedule

        request = self.request(turbo=False)
        engine.encode(request)  # warm-up (the prompt cache is off: every encode runs the encoder)
        t0 = time.perf_counter()
        embedding = engine.encode(request)
        sync(self.device)
        encode_s = time.perf_counter() - t0
        scale_te = RELEASED_TEXT_LAYERS / self.args.text_layers
        rows = self.report.shared_stages
        rows.append({"stage": f"prompt encode ({embedding.num_tokens} tokens)", "measured_s": round(encode_s, 4),
                     "at_50_blocks_s": round(encode_s * scale_te, 4),
                     "scaled_from": {"text_layers": self.args.text_layers, "to_text_layers": RELEASED_TEXT_LAYERS}})
        schedule = request_schedule(request.steps, request.flow_shift, request.audio_flow_shift)
        cache = engine.plan_cache
        cache.invalidate()
        t0 = time.perf_counter()
        cache.prepare(schedule.plans).release()
        sync(self.device)
        miss_s = time.perf_counter() - t0
        per_block = self.config.adaln_width * (self.config.time_embed_dim + 1) * 2
        final = self.config.final_adaln_width * (self.config.time_embed_dim + 1) * 2
        bytes_scale = (RELEASED_BLOCKS * per_block + final) / (self.args.num_blocks * per_block + final)
        rows.append({"stage": f"plan miss ({schedule.num_forwards} plans, page cache)", "measured_s": round(miss_s, 4),
                     "at_50_blocks_s": round(miss_s * bytes_scale, 4),
                     "floor_s": round((RELEASED_BLOCKS * per_block + final) / (PAGE_CACHE_GBPS * 1e9), 4),
                     "scaled_from": {"blocks": self.args.num_blocks, "to_blocks": RELEASED_BLOCKS, "by": "AdaLN bytes"}})
        # The Turbo request, decoded and muxed (its denoise is timed per mode below; the decode is the mode's
        # latents' size, not the mode's).
        result = engine.generate(self.request(turbo=True, return_video=True))
        t = result.timings
        rows.append({"stage": "video + audio decode (engine.generate of the Turbo request)",
                     "measured_s": round(t.decode_s, 3), "at_50_blocks_s": round(t.decode_s, 3),
                     "scaled_from": "as released (VAEs of the released size)"})
        rows.append({"stage": f"MP4 mux (H.264 + AAC, {len(result.mp4 or b'') / 1e6:.1f} MB)",
                     "measured_s": round(t.mux_s, 3), "at_50_blocks_s": round(t.mux_s, 3),
                     "scaled_from": "as released (CPU, PyAV libx264)"})
        self.report.setup.append({"what": "engine.generate of the Turbo request, first call, eager (measured, "
                                  f"{self.args.num_blocks} blocks)", "seconds": round(t.total_s, 2),
                                  "note": ", ".join(f"{k} {v:.3f}" for k, v in t.model_dump().items())})
        self.shared = Shared(embedding.cpu(), encode_s * scale_te, miss_s * bytes_scale, t.decode_s, t.mux_s, bytes_scale)

    def floors(self, tokens: int, text_tokens: int) -> tuple[float, float]:
        """(bf16 floor, fp8 floor) seconds of one forward at `tokens`: FLOPs / the measured GEMM rate, the fp8
        one with the block projections at twice the rate."""
        config, blocks = self.config, self.args.num_blocks
        total = forward_flops(config, blocks, tokens, text_tokens)
        projections = blocks * tokens * 2 * (4 * config.hidden_size * config.inner_dim
                                             + 3 * config.hidden_size * config.ffn_dim)
        rate = self.limits.gemm_tflops * 1e12
        return total / rate, (total - projections / 2) / rate

    def denoise_50(self, engine, mode: str, load_s: float, warmup_s: float | None) -> None:
        from engine.engine import request_schedule
        from model.denoise import Denoiser
        from model.geometry import GeometryLimits, VideoGeometry

        request = self.request(turbo=False)
        schedule = request_schedule(request.steps, request.flow_shift, request.audio_flow_shift)
        engine.adapters.apply(())  # installed, off: what a request without an adapter runs
        text = self.shared.embedding.embeds.to(self.device)
        limits = GeometryLimits(short_edge=None, max_pixels=8192 * 8192, min_seconds=0.1, max_seconds=60.0)
        shape = self.request_shape
        geometry = VideoGeometry.from_frames(shape.width, shape.height, shape.frames, limits)
        denoiser = Denoiser(geometry, schedule, text.shape[0], self.device)
        prepared = engine.plan_cache.prepare(schedule.plans)
        rig = Rig(engine.transformer, modulation=engine.modulation)
        try:
            run_steps(rig, denoiser, text, prepared, range(0, 1), self.device)  # warm-up forward
            with Peak(self.device) as peak:
                run = run_steps(rig, denoiser, text, prepared, range(1, 1 + self.args.forwards), self.device)
        finally:
            prepared.release()
            engine.modulation.clear()
        tokens = geometry.num_tokens(text.shape[0])
        bf16_floor, fp8_floor = self.floors(tokens, text.shape[0])
        compile_stats = engine.forward_kernels.compile_stats()
        transformer_bytes = stored_bytes(engine.transformer)
        per_block = stored_bytes(engine.transformer.transformer_blocks[0])
        at_50 = transformer_bytes + (RELEASED_BLOCKS - self.args.num_blocks) * per_block
        if mode == "eager":
            self.eager_forward_s = run.seconds_per_step
        row = {"mode": mode, "attention": engine.forward_kernels.attention.backend, "tokens": tokens,
               "forwards_timed": run.num_forwards,
               "ms_per_forward": round(1e3 * run.seconds_per_step, 2),
               "ms_at_50_blocks": round(1e3 * at_blocks(run.seconds_per_step, run.block_seconds_per_step,
                                                        self.args.num_blocks, RELEASED_BLOCKS), 1),
               "x_eager": round(run.seconds_per_step / self.eager_forward_s, 3) if self.eager_forward_s else None,
               "x_bf16_floor": round(run.seconds_per_step / bf16_floor, 3),
               "x_own_floor": round(run.seconds_per_step / (fp8_floor if "fp8" in mode else bf16_floor), 3),
               "engine_load_s": round(load_s, 2), "compile_warmup_s": None if warmup_s is None else round(warmup_s, 2),
               "recompiles_after_warmup": compile_stats.since_warmup if compile_stats is not None else None,
               "transformer_GiB": round(transformer_bytes / 2**30, 2),
               "transformer_GiB_at_50_blocks": round(at_50 / 2**30, 2), "peak_GiB": peak.peak_gib,
               "quantized_linears": engine.forward_kernels.quantized_linears,
               "scaled_from": {"blocks": self.args.num_blocks, "to_blocks": RELEASED_BLOCKS,
                               "forwards_timed": run.num_forwards}}
        self.report.modes.append(row)
        logger.info("50 steps %s", row)

    def turbo(self, engine, mode: str) -> None:
        request = self.request(turbo=True)
        embedding = self.shared.embedding
        before = engine.forward_kernels.compile_stats()
        t0 = time.perf_counter()
        first = engine.denoise(request, embedding)
        first_s = time.perf_counter() - t0
        compiles_first = (first.stats.compile.since_warmup - before.since_warmup) if before is not None else None
        with Peak(self.device) as peak, BlockSpan(engine.transformer.transformer_blocks, self.device) as span:
            result = engine.denoise(request, embedding)
        after = result.stats.compile
        t = result.timings
        forwards = result.stats.forwards
        row = {"mode": mode, "steps": result.stats.steps, "forwards": forwards,
               "adapter": f"{', '.join(f'{k} x{v:g}' for k, v in result.stats.adapters.scales.items())} (unfused)",
               "first_request_s": round(first_s, 2), "first_plan_s": round(first.timings.plan_s, 3),
               "compiles_in_first": compiles_first,
               "plan_s": round(t.plan_s, 4), "denoise_s": round(t.denoise_s, 3),
               "ms_per_forward": round(1e3 * t.denoise_s / forwards, 2),
               "denoise_at_50_blocks_s": round(at_blocks(t.denoise_s, span.seconds(), self.args.num_blocks,
                                                         RELEASED_BLOCKS), 2),
               "recompiles_in_second": (after.since_warmup - first.stats.compile.since_warmup)
               if after is not None else None, "peak_GiB": peak.peak_gib,
               "scaled_from": {"blocks": self.args.num_blocks, "to_blocks": RELEASED_BLOCKS, "forwards": forwards}}
        self.report.turbo.append(row)
        logger.info("turbo %s", row)
        self.write()

    # --- end to end ------------------------------------------------------------------------------------

    def end_to_end(self) -> None:
        shared = self.shared
        if shared is None:
            return
        fixed = {"prompt encode": shared.encode_s, "decode": shared.decode_s, "mux": shared.mux_s}
        turbo = {row["mode"]: row for row in self.report.turbo}
        for row in self.report.modes:
            mode, forwards = row["mode"], RELEASED_STEPS - 1
            denoise = forwards * row["ms_at_50_blocks"] / 1e3
            total = sum(fixed.values()) + shared.plan_miss_s + denoise
            self.report.end_to_end.append({
                "request": f"50 steps ({forwards} forwards), cold plans", "mode": mode, "total_s": round(total, 1),
                "denoise_s": round(denoise, 1), "plan_s": round(shared.plan_miss_s, 2),
                **{f"{k}_s": round(v, 2) for k, v in fixed.items()},
                "goal": f"lossless <= {LOSSLESS_GOAL_S:g} s (today ~{TODAY_50_STEPS_S:g} s)",
                "meets_goal": total <= LOSSLESS_GOAL_S if "fp8" not in mode else None,
                "scaled_from": {"blocks": self.args.num_blocks, "to_blocks": RELEASED_BLOCKS,
                                "text_layers": self.args.text_layers, "forwards_timed": row["forwards_timed"],
                                "forwards": forwards}})
            if mode in turbo:
                t = turbo[mode]
                plan_s = t["first_plan_s"] * shared.plan_bytes_scale
                total = sum(fixed.values()) + plan_s + t["denoise_at_50_blocks_s"]
                self.report.end_to_end.append({
                    "request": f"Turbo, {t['steps']} points ({t['forwards']} forwards), cold plans", "mode": mode,
                    "total_s": round(total, 1), "denoise_s": round(t["denoise_at_50_blocks_s"], 1),
                    "plan_s": round(plan_s, 2), **{f"{k}_s": round(v, 2) for k, v in fixed.items()},
                    "goal": f"Turbo <= {TURBO_GOAL_S:g} s (50 steps today ~{TODAY_50_STEPS_S:g} s)",
                    "meets_goal": total <= TURBO_GOAL_S,
                    "scaled_from": {"blocks": self.args.num_blocks, "to_blocks": RELEASED_BLOCKS,
                                    "text_layers": self.args.text_layers, "forwards_timed": t["forwards"],
                                    "forwards": t["forwards"]}})
        self.report.notes.append(
            "end to end: shared stages (prompt encode x 50 / text layers, decode, mux) + plan miss (x AdaLN bytes "
            "to 50 blocks; Turbo: its first request's plan_s x the same factor) + forwards x ms_at_50_blocks; "
            "fp8 is not lossless: its goal is the Turbo / memory one, not the 260 s lossless one")


if __name__ == "__main__":
    raise SystemExit(main())
