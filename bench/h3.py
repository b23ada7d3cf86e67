"""MiniMax-H3 on one GPU: our denoise step vs diffusers' own forward, and every stage of a 5 s 1344x768 request.

    python -m bench.h3 --smoke                                   # CPU: tiny width, seconds
    python -m bench.h3 --num-blocks 12 --workdir /tmp/h3         # H200: h3 width, 12 of the 50 blocks

The checkpoint is random (`bench.checkpoints`) with the real architecture: the transformer at h3 width with
`--num-blocks` blocks (the 50-block one is 66 GB, more than the disk), a Qwen3-VL of the real width with
`--text-layers` decoder layers, the released-size video VAE (2.6 B parameters) and audio VAE, the tiny
locally trained tokenizer. Results with fewer blocks / layers / steps than the release are scaled, and every
scaled number says so next to the measured one.

1. Denoise step per shape (about 7.8k, 37.7k and 62k tokens), each mode on the same inputs:
   - `diffusers`: diffusers' `MiniMaxH3Transformer3DModel` forward with its own resident AdaLN weights;
   - `ours`: the engine's path (`engine.Engine.transformer`: built without AdaLN weights, rows from the plan
     cache served through `ExternalModulation`) plus the scheduler update, i.e. one engine step;
   - `ours + offload`: `LayerwiseOffloader` on `transformer_blocks` (skip-aware, prefetch depth 1);
   - `ours + cache-dit` and `ours + offload + cache-dit`: `CacheDit` (DBCache) over a short schedule, per step
     averaged over the request (cached steps listed).
   Floors: FLOPs / measured bf16 GEMM rate, and for offload H2D bytes / measured pinned H2D bandwidth.
2. Stages of a 5 s 1344x768 request through `engine.Engine`: prompt encode, plan miss / GPU hit / host hit
   (50 steps = 49 plans), denoise per step, video decode, audio decode, MP4 mux, and the decode stage as a
   request runs it (the mux under the decode); memory of each component.
3. End to end, scaled to 50 blocks, 50 text layers and 50 steps (49 forwards).

Writes <out>/h3-<device>.md and .json (commit, device, command, notes, every table).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import io
import logging
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from bench.checkpoints import (PRESETS, RELEASED_COMPONENTS, SMALL_COMPONENTS, ComponentSizes, checkpoint_nbytes,
                               make_random_checkpoint, write_h3_components)
from bench.common import device_description, git_commit, write_sectioned_report

logger = logging.getLogger("bench.h3")

#: A prompt in MiniMax's Context-IR style (h3.md section 3).
PROMPT = (
    "integrated_multimodal_description: At dusk a lighthouse stands on a black basalt cliff above a restless sea. "
    "The camera starts wide, low over the water, and glides toward the cliff as waves break white against the "
    "rocks; spray drifts through the last orange light while the lamp turns and its beam sweeps across low "
    "clouds. Gulls wheel around the tower, a small fishing boat with a green hull rounds the headland, and its "
    "crew coil ropes on the wet deck. overall_soundscape: wind gusting over the cliff, surf booming and hissing on "
    "gravel, gulls calling, the boat's diesel engine thudding in the distance, rope creaking against a cleat. "
    "non_diegetic_music: a slow piano melody over soft low strings, rising as the beam passes the camera."
)


@dataclass(frozen=True)
class Shape:
    label: str
    width: int
    height: int
    frames: int


H3_SHAPES = (Shape("7.8k", 640, 320, 121), Shape("37.7k", 1344, 768, 121), Shape("62k", 1344, 768, 209))
SMOKE_SHAPES = (Shape("s", 64, 64, 25), Shape("m", 96, 64, 25), Shape("l", 128, 64, 25))
#: The request whose stages are timed (issue 10 and vllm-omni's recipe: 1344x768, 5 s = 124 frames).
H3_REQUEST = Shape("5 s 1344x768", 1344, 768, 121)
SMOKE_REQUEST = Shape("1 s 64x64", 64, 64, 25)
SMOKE_PROMPT = "a lighthouse on a cliff at dusk, waves below"
RELEASED_BLOCKS = 50
RELEASED_TEXT_LAYERS = 50
RELEASED_STEPS = 50
#: vllm-omni's recipe on 4 H200s (sequence parallel 4, text encoder TP4): 1344x768, 124 frames, 50 steps.
ANCHOR = "vllm-omni recipe: 85.5 s on 4x H200 (SP4) for 1344x768, 124 frames, 50 steps; Cache-DiT high 63.4 s"
#: Page-cache read bandwidth of the H200 machine, 16 readers (bench/results/adaln-nvidia-h200.md).
PAGE_CACHE_GBPS = 39.3


# ---------------------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_mark(device: torch.device) -> float | torch.cuda.Event:
    """A point on `device`'s timeline: a CUDA event recorded on its current stream (the one the model's kernels queue
    on; read after a sync, `seconds_between`), the host clock elsewhere (a CPU's ops are synchronous)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def seconds_between(begin: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
    """Seconds from one `device_mark` to a later one (CUDA events: once the device has passed `end`)."""
    if isinstance(begin, float):
        return end - begin
    return begin.elapsed_time(end) / 1e3


class ForwardClock:
    """An engine progress callback (`Engine.denoise(..., progress=)`) marking the end of each forward of one request
    (`device_mark`: no sync in the loop). `rest_ms()`: forwards 2..N, the first having no mark before it."""

    def __init__(self, device: torch.device):
        self.device = device
        self._marks: list[float | torch.cuda.Event] = []

    def __call__(self, step: int, steps: int) -> None:
        self._marks.append(device_mark(self.device))

    def rest_ms(self) -> list[float]:
        sync(self.device)
        return [1e3 * seconds_between(a, b) for a, b in zip(self._marks, self._marks[1:])]


class BlockSpan:
    """Seconds inside the block stack: per transformer forward, from the first block's start to the last block's
    end. A run on `n` of the released blocks then scales to 50 by its blocks alone (`at_blocks`): the embedders,
    refiner and heads run once per forward whatever the block count. CUDA events on a GPU (device time; no sync in
    the loop), the host clock on a CPU. `seconds()` is None where some forward did not run both ends (a cached
    Cache-DiT step may skip the last block): callers then scale the whole step, as before. A cached step that runs
    both ends spans only the blocks it ran: `run_steps` drops the span of a run with cached steps."""

    def __init__(self, blocks: torch.nn.ModuleList, device: torch.device):
        self.blocks = blocks
        self.device = device
        self._begins: list[float | torch.cuda.Event] = []
        self._ends: list[float | torch.cuda.Event] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> BlockSpan:
        begin = lambda module, args: self._begins.append(device_mark(self.device))  # noqa: E731
        end = lambda module, args, out: self._ends.append(device_mark(self.device))  # noqa: E731
        self._handles = [self.blocks[0].register_forward_pre_hook(begin), self.blocks[-1].register_forward_hook(end)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def seconds(self) -> float | None:
        """The total over the forwards run inside the `with` (after a device sync)."""
        if not self._begins or len(self._begins) != len(self._ends):
            return None
        sync(self.device)
        return sum(seconds_between(begin, end) for begin, end in zip(self._begins, self._ends))


def at_blocks(seconds: float, block_seconds: float | None, measured_blocks: int, blocks: int) -> float:
    """`seconds` of a run on `measured_blocks` blocks, estimated at `blocks`: its blocks' share scaled
    (`BlockSpan`), or, unknown, all of it (a slight overestimate)."""
    scaled = seconds if block_seconds is None else block_seconds
    return seconds + scaled * (blocks / measured_blocks - 1)


@dataclass
class Limits:
    """The device's measured ceilings (floors are computed against these)."""

    gemm_tflops: float
    h2d_gbps: float
    hbm_gbps: float


def measure_limits(device: torch.device, smoke: bool) -> Limits:
    """bf16 GEMM rate, pinned host -> device copy, device -> device copy (read + write bytes)."""
    n = 1024 if smoke else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    reps = 2 if smoke else 10
    for _ in range(2):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    gemm = reps * 2 * n**3 / (time.perf_counter() - t0) / 1e12
    nbytes = (64 if smoke else 2048) << 20
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    other = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def rate(fn: Callable[[], object], moved: int) -> float:
        fn()
        sync(device)
        t = time.perf_counter()
        for _ in range(3):
            fn()
        sync(device)
        return 3 * moved / (time.perf_counter() - t) / 1e9

    h2d = rate(lambda: dev.copy_(host, non_blocking=True), nbytes)
    hbm = rate(lambda: other.copy_(dev), 2 * nbytes)
    del a, b, host, dev, other
    return Limits(gemm, h2d, hbm)


def forward_flops(config: Any, num_blocks: int, num_tokens: int, num_text_tokens: int) -> float:
    """Matmul FLOPs of one transformer forward: per block the q/k/v/o and SwiGLU projections over every
    token and the attention (QK^T and PV) over the full packed sequence; the token refiner over the text rows.
    Elementwise work, norms, embedders and heads are left out (a few percent at these sizes)."""
    hidden, inner, ffn = config.hidden_size, config.inner_dim, config.ffn_dim
    linear = 2 * (4 * hidden * inner + 3 * hidden * ffn)            # per token
    block = num_tokens * linear + 4 * num_tokens * num_tokens * inner
    refiner = num_text_tokens * linear + 4 * num_text_tokens**2 * inner
    return num_blocks * block + config.num_refiner_layers * refiner


class Peak:
    """Peak device memory allocated during a `with` block, over what was allocated before it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = 0
        self.peak_bytes = 0
        self.extra_bytes = 0

    def __enter__(self) -> "Peak":
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            sync(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self.extra_bytes = self.peak_bytes - self.base

    @property
    def peak_gib(self) -> float | None:
        return round(self.peak_bytes / 2**30, 2) if self.device.type == "cuda" else None

    @property
    def extra_gib(self) -> float | None:
        return round(self.extra_bytes / 2**30, 2) if self.device.type == "cuda" else None


def param_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()] if not t.is_meta)


# ---------------------------------------------------------------------------------------------------------
# Denoise runs
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Rig:
    """A transformer and what drives it per forward: external modulation rows (ours) or none (diffusers),
    an offloader and a Cache-DiT wrapper when on."""

    transformer: torch.nn.Module
    modulation: Any = None          # model.adaln.ExternalModulation
    offloader: Any = None           # offload.layerwise.LayerwiseOffloader
    cache: Any = None               # cache.cache_dit.CacheDit
    sequence_parallel: Any = None   # parallel.sequence.SequenceParallel: settled after each run, as the engine does


@dataclass
class StepRun:
    seconds_per_step: float
    num_forwards: int
    cached_steps: list[int] = field(default_factory=list)
    h2d_bytes_per_step: float = 0.0
    block_seconds_per_step: float | None = None  # inside the block stack (`BlockSpan`): what scales with blocks
    peak_gib: float | None = None
    velocity: torch.Tensor | None = None   # first forward's video velocity (bit-exactness checks)


@torch.no_grad()
def run_steps(rig: Rig, denoiser: Any, text: torch.Tensor, prepared: Any, forwards: range, device: torch.device,
              *, keep_velocity: bool = False) -> StepRun:
    """Forwards `forwards` of the denoiser's schedule from its initial noise, as the engine runs them."""
    latents = denoiser.initial_latents(0)
    if rig.offloader is not None:
        sync(device)
        rig.offloader.reset_stats()
    first_velocity = None
    with Peak(device) as peak, BlockSpan(rig.transformer.transformer_blocks, device) as span:
        start = time.perf_counter()
        if rig.sequence_parallel is not None:
            rig.sequence_parallel.begin_loop()
        for i in forwards:
            inputs = denoiser.transformer_inputs(i, latents, text)
            if rig.modulation is not None:
                rig.modulation.set(prepared.modulation(i))
            if rig.offloader is not None:
                rig.offloader.begin_step(rig.cache.predict_middle() if rig.cache is not None else True)
            video, audio = inputs.run(rig.transformer)
            if keep_velocity and first_velocity is None:
                first_velocity = video.clone()
            latents = denoiser.step(i, latents, video, audio)
        if rig.sequence_parallel is not None:  # the last forward's host check, before the host waits unbounded
            rig.sequence_parallel.settle()
        sync(device)
        seconds = time.perf_counter() - start
    # A cached Cache-DiT step skips middle blocks: its span is no sample of a whole stack.
    block_seconds = span.seconds() if rig.cache is None or not rig.cache.cached_steps() else None
    run = StepRun(seconds / len(forwards), len(forwards), peak_gib=peak.peak_gib, velocity=first_velocity,
                  block_seconds_per_step=None if block_seconds is None else block_seconds / len(forwards))
    if rig.offloader is not None:
        run.h2d_bytes_per_step = sum(rig.offloader.stats.h2d_bytes_per_step) / len(forwards)
    if rig.cache is not None:
        run.cached_steps = rig.cache.cached_steps()
    return run


# ---------------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Report:
    """Everything measured so far; written after every section, so a cut-short run keeps what it measured."""

    meta: dict[str, Any]
    setup: list[dict[str, Any]] = field(default_factory=list)
    denoise: list[dict[str, Any]] = field(default_factory=list)
    stages: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    end_to_end: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def write(self, out: Path, tag: str) -> Path:
        sections = (("Setup", self.setup), ("Denoise step per shape", self.denoise),
                    ("Stages of one request", self.stages), ("Memory per component", self.memory),
                    ("End to end", self.end_to_end))
        return write_sectioned_report(out, f"h3-{tag}", "MiniMax-H3 denoise and request stages", self.meta,
                                      self.notes, sections, self.skipped, dataclasses.asdict(self))


class Deadline:
    def __init__(self, budget_s: float):
        self.start = time.monotonic()
        self.budget_s = budget_s

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny width on CPU, seconds")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-blocks", type=int, default=None, help="transformer blocks (h3: 12; smoke: 2)")
    ap.add_argument("--text-layers", type=int, default=None,
                    help="Qwen3-VL decoder layers loaded for the prompt (h3: 4; one more is written)")
    ap.add_argument("--workdir", default=None, help="where the checkpoint is written (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=None, help="timed forwards per shape and mode, after one "
                    "warm-up (default 2; smoke 1)")
    ap.add_argument("--cache-steps", type=int, default=None, help="steps of the Cache-DiT runs' schedule (10; smoke 6)")
    ap.add_argument("--cache", default="F1B0 W3 R0.24 MC2", help="DBCache config (bench.offload shorthand)")
    ap.add_argument("--shapes", default=None, help="comma-separated shape labels to run (default: all)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting sections after this (default 420)")
    ap.add_argument("--workers", type=int, default=8, help="checkpoint shards written at once")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    for noisy in ("cache_dit", "diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)

    device = torch.device(("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
                          if args.device == "auto" else args.device)
    deadline = Deadline(args.budget_s or (120.0 if args.smoke else 420.0))
    num_blocks = args.num_blocks or (2 if args.smoke else 12)
    args.repeats = args.repeats or (1 if args.smoke else 2)
    args.cache_steps = args.cache_steps or (6 if args.smoke else 10)
    text_layers = args.text_layers or (2 if args.smoke else 4)
    base_config = PRESETS["tiny" if args.smoke else "h3"]
    config = base_config.model_copy(update={"num_layers": num_blocks})
    shapes = SMOKE_SHAPES if args.smoke else H3_SHAPES
    if args.shapes:
        shapes = tuple(s for s in shapes if s.label in args.shapes.split(","))
    request_shape = SMOKE_REQUEST if args.smoke else H3_REQUEST
    sizes = SMALL_COMPONENTS if args.smoke else RELEASED_COMPONENTS
    tag = "cpu" if device.type == "cpu" else "-".join(torch.cuda.get_device_name(device).lower().split())
    tag = f"smoke-{tag}" if args.smoke else tag
    command = "python -m bench.h3 " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    report = Report(meta={"commit": git_commit(), "device": tag, "device_description": device_description(str(device)),
                          "command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                          "num_blocks": num_blocks, "text_layers": text_layers})
    out = Path(args.out)
    log = logger.info

    tmp = None
    workdir = Path(args.workdir) if args.workdir else Path(tmp := tempfile.mkdtemp(prefix="bench-h3-"))
    try:
        run(args, report, out, tag, device, deadline, config, num_blocks, text_layers, shapes, request_shape,
            sizes, workdir, log)
    except Exception as exc:  # keep what was measured
        logger.exception("bench.h3 failed")
        report.skipped.append(f"run stopped by {type(exc).__name__}: {exc}"[:400])
        report.write(out, tag)
        return 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    path = report.write(out, tag)
    print(path.read_text())
    return 0


def run(args, report: Report, out: Path, tag: str, device: torch.device, deadline: Deadline, config, num_blocks: int,
        text_layers: int, shapes, request_shape: Shape, sizes: ComponentSizes, workdir: Path, log) -> None:
    from engine.api import GenerationRequest
    from engine.config import EngineConfig
    from engine.engine import Engine
    from model.denoise import Denoiser
    from model.geometry import GeometryLimits, VideoGeometry
    from model.loading import load_transformer
    from model.mp4 import write_mp4
    from model.schedule import H3Schedule

    smoke = args.smoke
    limits = measure_limits(device, smoke)
    report.notes.append(f"measured ceilings: bf16 GEMM {limits.gemm_tflops:.4g} TFLOP/s, pinned H2D "
                        f"{limits.h2d_gbps:.4g} GB/s, device copy {limits.hbm_gbps:.4g} GB/s (read + write)")
    report.notes.append(f"model: MiniMax-H3 architecture (diffusers MiniMaxH3Transformer3DModel) at hidden "
                        f"{config.hidden_size}, {num_blocks} of {RELEASED_BLOCKS} blocks, random bf16 weights; "
                        f"Qwen3-VL text width {sizes.text['hidden_size']}, {text_layers} of {RELEASED_TEXT_LAYERS} "
                        "layers read, tiny local tokenizer, one-block vision tower; released-size video and audio VAEs"
                        if not smoke else "smoke: tiny width, tiny components; timings are not meaningful")
    report.notes.append(ANCHOR)
    report.notes += [
        "denoise rows: the engine's loop (Denoiser inputs, transformer forward, scheduler update) around diffusers' "
        "forward with its own resident AdaLN weights, or around ours (the engine's transformer without AdaLN "
        "weights, the step's rows gathered from the plan slab and set through ExternalModulation); "
        f"{args.repeats} timed forwards after one warm-up per shape and mode; cache-dit rows: mean over a "
        f"{args.cache_steps}-step schedule ({args.cache_steps - 1} forwards), the cached ones listed",
        "floor: matmul FLOPs (projections over every token, attention over the packed sequence, refiner over the "
        "text) / the measured GEMM rate; offload: max(the resident step, H2D bytes / measured pinned bandwidth)",
        "ms_at_50_blocks: the step with its blocks' share (first block's start to last block's end, CUDA "
        "events) x 50 / blocks and the rest (embedders, refiner, heads) as measured; the whole step x 50 / blocks "
        "where a forward skipped an end block (a cached Cache-DiT step)",
        "peak_GiB: torch.cuda.max_memory_allocated during that run, with everything then resident counted: the "
        "engine's text encoder, VAEs and plan slab, and in the diffusers / ours rows also the diffusers model "
        "loaded beside the engine's transformer",
    ]

    # --- checkpoint -----------------------------------------------------------------------------
    root = workdir / f"h3-b{num_blocks}-t{text_layers}"
    if not (root / "model_index.json").exists():
        t0 = time.perf_counter()
        make_random_checkpoint(root, config, "diffusers", seed=0, workers=args.workers, device=device)
        write_s = time.perf_counter() - t0
        nbytes = checkpoint_nbytes(config)
        report.setup.append({"what": f"transformer checkpoint, {num_blocks} blocks", "seconds": round(write_s, 2),
                             "GB": round(nbytes / 1e9, 2), "GB/s": round(nbytes / 1e9 / write_s, 2)})
        t0 = time.perf_counter()
        component_bytes = write_h3_components(root, "diffusers", 0, text_layers=text_layers + 1, device=device,
                                              sizes=sizes)
        write_s = time.perf_counter() - t0
        report.setup.append({"what": "components (text encoder, tokenizer, VAEs)", "seconds": round(write_s, 2),
                             "GB": round(sum(component_bytes.values()) / 1e9, 2)})
        log("checkpoint written: %s", report.setup)
        report.write(out, tag)
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # --- the engine (online AdaLN, everything resident) ------------------------------------------------
    plan_page_bytes = (num_blocks * config.adaln_width + config.final_adaln_width) * 2
    host_gb = max(0.05, 4 * RELEASED_STEPS * 2 * plan_page_bytes / 1e9)  # two 50-step schedules, 2 rows each
    engine_config = EngineConfig(
        checkpoint=str(root), device="cuda" if device.type == "cuda" else "cpu",
        text_encoder={"hidden_state_index": text_layers},
        adaln={"mode": "online", "gpu_plans": 64, "host_cache_gb": host_gb},
        geometry=None if not smoke else {"short_edge": None, "min_seconds": 1.0},
    )
    with Peak(device) as load_peak:
        t0 = time.perf_counter()
        engine = Engine(engine_config)
        load_s = time.perf_counter() - t0
    report.setup.append({"what": "engine load (online AdaLN; text encoder, VAEs resident)", "seconds": round(load_s, 2),
                         "GB": round(load_peak.extra_bytes / 1e9, 2) if device.type == "cuda" else None})
    transformer = engine.transformer
    weights_per_block = param_bytes(transformer.transformer_blocks[0])
    non_block = param_bytes(transformer) - num_blocks * weights_per_block
    adaln_per_block = config.adaln_width * (config.time_embed_dim + 1) * 2
    final_adaln = config.final_adaln_width * (config.time_embed_dim + 1) * 2
    te_layer = param_bytes(engine.prompt_encoder._model.layers[0])
    te_total = param_bytes(engine.prompt_encoder._model)
    te_other = te_total - text_layers * te_layer
    slab_bytes = engine.plan_cache.slab.blocks.numel() * 2 + engine.plan_cache.slab.final.numel() * 2
    gib = 2**30
    report.memory += [
        {"component": "transformer, online AdaLN (ours)", "measured_GiB": round(param_bytes(transformer) / gib, 2),
         "at_50_blocks_GiB": round((non_block + RELEASED_BLOCKS * weights_per_block) / gib, 2),
         "note": f"{weights_per_block / 1e9:.3f} GB per block without adaln_proj; refiner, embedders, heads "
                 f"{non_block / 1e9:.2f} GB"},
        {"component": "transformer, resident AdaLN (diffusers)",
         "measured_GiB": round((param_bytes(transformer) + num_blocks * adaln_per_block + final_adaln) / gib, 2),
         "at_50_blocks_GiB": round((non_block + RELEASED_BLOCKS * (weights_per_block + adaln_per_block) + final_adaln)
                                   / gib, 2),
         "note": f"adaln_proj {adaln_per_block / 1e9:.3f} GB per block"},
        {"component": f"text encoder ({text_layers} layers loaded)", "measured_GiB": round(te_total / gib, 2),
         "at_50_blocks_GiB": round((te_other + RELEASED_TEXT_LAYERS * te_layer) / gib, 2),
         "note": f"{te_layer / 1e9:.3f} GB per layer; embedding {te_other / 1e9:.2f} GB; scaled column: 50 layers"},
        {"component": "video VAE (bf16 decoder blocks, fp32 rest)",
         "measured_GiB": round(param_bytes(engine.video_decoder.vae) / gib, 2), "at_50_blocks_GiB": None,
         "note": "released architecture"},
        {"component": "audio VAE (fp32)", "measured_GiB": round(param_bytes(engine.audio_decoder.vae) / gib, 2),
         "at_50_blocks_GiB": None, "note": "released architecture"},
        {"component": "AdaLN plan slab (64 plans x 4 rows)", "measured_GiB": round(slab_bytes / gib, 3),
         "at_50_blocks_GiB": round(slab_bytes / plan_page_bytes * (RELEASED_BLOCKS * config.adaln_width
                                                                   + config.final_adaln_width) * 2 / gib, 2),
         "note": "adaln.gpu_plans=64, plan_width=4"},
    ]
    report.write(out, tag)

    # --- stages of one request ------------------------------------------------------------------------
    prompt = SMOKE_PROMPT if smoke else PROMPT
    prompt_tokens = engine.prompt_encoder.count_tokens(prompt)
    engine.prompt_encoder.encode(prompt)  # warm-up
    with Peak(device) as peak:
        t0 = time.perf_counter()
        text = engine.prompt_encoder.encode(prompt)
        sync(device)
        encode_s = time.perf_counter() - t0
    te_flops = 2 * prompt_tokens * text_layers * te_layer / 2
    te_floor = max(te_flops / (limits.gemm_tflops * 1e12), text_layers * te_layer / (limits.hbm_gbps * 1e9))
    scale_te = RELEASED_TEXT_LAYERS / text_layers
    report.stages.append({
        "stage": f"text encode ({prompt_tokens} tokens)", "measured_s": round(encode_s, 4),
        "scaled_s": round(encode_s * scale_te, 4), "scaled_to": f"{RELEASED_TEXT_LAYERS} layers (x{scale_te:.1f})",
        "floor_s": round(te_floor, 4), "x_floor": round(encode_s / te_floor, 2),
        "floor": "max(FLOPs / GEMM rate, layer bytes / device read bandwidth)", "peak_GiB": peak.peak_gib})

    schedule = H3Schedule.build(RELEASED_STEPS)
    cache = engine.plan_cache
    adaln_bytes = num_blocks * adaln_per_block + final_adaln
    adaln_bytes_50 = RELEASED_BLOCKS * adaln_per_block + final_adaln
    t0 = time.perf_counter()
    cache.prepare(schedule.plans).release()  # the first rebuild also allocates the pinned staging buffers
    sync(device)
    first_miss_s = time.perf_counter() - t0
    cache.invalidate()
    with Peak(device) as peak:
        t0 = time.perf_counter()
        prepared = cache.prepare(schedule.plans)
        sync(device)
        miss_s = time.perf_counter() - t0
    plan_floor = adaln_bytes / (PAGE_CACHE_GBPS * 1e9)
    report.stages.append({
        "stage": f"plan miss ({prepared.stats.built_plans} plans, page cache)", "measured_s": round(miss_s, 4),
        "scaled_s": round(miss_s * adaln_bytes_50 / adaln_bytes, 4),
        "scaled_to": f"50 blocks (x{adaln_bytes_50 / adaln_bytes:.2f} bytes)", "floor_s": round(plan_floor, 4),
        "x_floor": round(miss_s / plan_floor, 2),
        "floor": f"{adaln_bytes / 1e9:.2f} GB / {PAGE_CACHE_GBPS} GB/s page-cache read", "peak_GiB": peak.peak_gib,
        "note": f"second rebuild; the engine's first took {first_miss_s:.3f} s (staging buffers allocated)"})
    t0 = time.perf_counter()
    hit = cache.prepare(schedule.plans)
    sync(device)
    hit_s = time.perf_counter() - t0
    hit.release()
    report.stages.append({"stage": f"plan GPU hit ({hit.stats.gpu_hit_plans} plans)", "measured_s": round(hit_s, 4),
                          "scaled_s": round(hit_s, 4), "scaled_to": "(independent of blocks)"})
    prepared.release()
    cache.host.synchronize()
    cache.slab.index.invalidate()
    t0 = time.perf_counter()
    host_hit = cache.prepare(schedule.plans)
    sync(device)
    host_s = time.perf_counter() - t0
    host_floor = max(host_hit.stats.h2d_bytes, 1) / (limits.h2d_gbps * 1e9)
    report.stages.append({
        "stage": f"plan host hit ({host_hit.stats.host_hit_plans} plans)", "measured_s": round(host_s, 4),
        "scaled_s": round(host_s * adaln_bytes_50 / adaln_bytes, 4), "scaled_to": "50 blocks (bytes)",
        "floor_s": round(host_floor, 4), "x_floor": round(host_s / host_floor, 2),
        "floor": f"{host_hit.stats.h2d_bytes / 1e9:.2f} GB / pinned H2D"})
    host_hit.release()
    report.write(out, tag)

    # The request through the engine (2 forwards), then the decoders and the mux timed on their own.
    limits_any = GeometryLimits(short_edge=None, max_pixels=4096 * 4096, min_seconds=0.1, max_seconds=60.0)
    request = GenerationRequest(prompt=prompt, steps=3, seconds=(request_shape.frames - 1) / 24,
                                width=request_shape.width,
                                height=request_shape.height, seed=0, return_video=True)
    with Peak(device) as generate_peak:
        result = engine.generate(request)
    report.stages.append({"stage": "engine.generate, 2 forwards (first call; decode + mux included)",
                          "measured_s": round(result.timings.total_s, 3),
                          "note": ", ".join(f"{k} {v:.3f}" for k, v in result.timings.model_dump().items()),
                          "peak_GiB": generate_peak.peak_gib})
    video_latents, audio_latents = result.video, result.audio
    with Peak(device) as peak:
        t0 = time.perf_counter()
        frames = engine.video_decoder.decode(video_latents)
        sync(device)
        video_s = time.perf_counter() - t0
    report.stages.append({"stage": f"video decode ({frames.shape[0]} frames {frames.shape[2]}x{frames.shape[1]})",
                          "measured_s": round(video_s, 3), "scaled_s": round(video_s, 3), "scaled_to": "(as released)",
                          "peak_GiB": peak.peak_gib, "extra_GiB": peak.extra_gib})
    with Peak(device) as peak:
        t0 = time.perf_counter()
        waveform = engine.audio_decoder.decode(audio_latents)
        sync(device)
        audio_s = time.perf_counter() - t0
    report.stages.append({"stage": f"audio decode ({waveform.shape[1] / engine.audio_decoder.sample_rate:.2f} s stereo)",
                          "measured_s": round(audio_s, 3), "scaled_s": round(audio_s, 3), "scaled_to": "(as released)",
                          "peak_GiB": peak.peak_gib, "extra_GiB": peak.extra_gib})
    t0 = time.perf_counter()
    buffer = io.BytesIO()
    write_mp4(buffer, frames, 24, waveform, engine.audio_decoder.sample_rate)
    mux_s = time.perf_counter() - t0
    report.stages.append({"stage": f"MP4 mux (H.264 + AAC, {len(buffer.getvalue()) / 1e6:.1f} MB)",
                          "measured_s": round(mux_s, 3), "scaled_s": round(mux_s, 3), "scaled_to": "(as released)",
                          "note": "CPU (PyAV libx264)"})
    serial_s = video_s + audio_s + mux_s
    with Peak(device) as peak:
        t0 = time.perf_counter()
        decoded = engine.decode_stage.decode(video_latents, audio_latents)
        stage_s = time.perf_counter() - t0
    if decoded.mp4 != buffer.getvalue():
        raise RuntimeError("the decode stage's clip-by-clip MP4 differs from decoding all, then muxing")
    report.stages.append({"stage": "decode + mux as a request runs them (DecodeStage: each clip H.264-encoded on a "
                          "thread while the next decodes; the same MP4 bytes)",
                          "measured_s": round(stage_s, 3), "scaled_s": round(stage_s, 3), "scaled_to": "(as released)",
                          "peak_GiB": peak.peak_gib, "extra_GiB": peak.extra_gib,
                          "note": f"x{stage_s / serial_s:.2f} the three above run one after another ({serial_s:.3f} s); "
                                  f"mux_s (the mux the decode did not hide) {decoded.mux_s:.3f} s; cuDNN's "
                                  "autotuner on the VAE: python -m bench.decode --cudnn-benchmark"})
    del frames, waveform, buffer, decoded
    report.write(out, tag)

    # --- denoise step per shape -----------------------------------------------------------------------
    ours = Rig(transformer, modulation=engine.modulation)
    prepared = cache.prepare(schedule.plans)  # GPU hits from here on
    timed = range(0, 1 + args.repeats)  # forward 0 warms up; 1.. are timed
    per_shape: dict[str, dict[str, Any]] = {}
    geometries = {s.label: VideoGeometry.from_frames(s.width, s.height, s.frames, limits_any) for s in shapes}
    text_rows = text.to(device)

    def denoise_row(shape: Shape, mode: str, run: StepRun, tokens: int, *, floor_s: float, note: str = "",
                    exact: bool | None = None) -> None:
        row = {"shape": shape.label, "tokens": tokens, "mode": mode, "ms_per_step": round(1e3 * run.seconds_per_step, 2),
               "ms_at_50_blocks": round(1e3 * at_blocks(run.seconds_per_step, run.block_seconds_per_step, num_blocks,
                                                        RELEASED_BLOCKS), 1),
               "floor_ms": round(1e3 * floor_s, 2), "x_floor": round(run.seconds_per_step / floor_s, 2),
               "H2D_GB_per_step": run.h2d_bytes_per_step / 1e9, "peak_GiB": run.peak_gib,
               "cached_steps": f"{len(run.cached_steps)}/{run.num_forwards}" if run.cached_steps or "cache" in mode
               else None, "bit_exact_vs_diffusers": exact, "note": note}
        report.denoise.append(row)
        log("denoise %s", row)

    def timed_run(rig: Rig, geometry, steps_schedule, plans, forwards: range, **kw) -> StepRun:
        denoiser = Denoiser(geometry, steps_schedule, text_rows.shape[0], device)
        warm = run_steps(rig, denoiser, text_rows, plans, range(forwards.start, forwards.start + 1), device)
        del warm
        return run_steps(rig, denoiser, text_rows, plans, range(forwards.start + 1, forwards.stop), device, **kw)

    # diffusers' own forward on its own resident weights (loaded from the same checkpoint)
    from model.weights import TransformerWeights

    with Peak(device) as peak:
        diffusers_model = load_transformer(TransformerWeights(engine.checkpoint.transformer_dir, "diffusers"), device)
    report.setup.append({"what": "diffusers transformer load (resident AdaLN)", "GB": round(peak.extra_bytes / 1e9, 2)
                         if device.type == "cuda" else None})
    reference = Rig(diffusers_model)
    for shape in shapes:
        if deadline.left() < 30:
            report.skipped.append(f"denoise {shape.label}: out of time budget")
            continue
        geometry = geometries[shape.label]
        tokens = geometry.num_tokens(text_rows.shape[0])
        flops = forward_flops(config, num_blocks, tokens, text_rows.shape[0])
        floor = flops / (limits.gemm_tflops * 1e12)
        runs = {}
        for mode, rig in (("diffusers forward (resident AdaLN)", reference), ("ours: engine step (online AdaLN)", ours)):
            runs[mode] = timed_run(rig, geometry, schedule, prepared, timed, keep_velocity=True)
        exact = bool(torch.equal(runs["ours: engine step (online AdaLN)"].velocity,
                                 runs["diffusers forward (resident AdaLN)"].velocity))
        for mode, run in runs.items():
            denoise_row(shape, mode, run, tokens, floor_s=floor, exact=exact if mode.startswith("ours") else None,
                        note=f"{flops / 1e12:.1f} TFLOP per forward" + ("; diffusers step = forward + "
                                                                        "scheduler update" if "diffusers" in mode else ""))
        per_shape[shape.label] = {"tokens": tokens, "resident_s": runs["ours: engine step (online AdaLN)"].seconds_per_step,
                                  "floor": floor}
        report.write(out, tag)
    del reference, diffusers_model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # offload, then offload + Cache-DiT, then Cache-DiT alone (the offloader removed)
    from bench.offload import parse_cache
    from cache.cache_dit import CacheDit, find_block_stack
    from device.streams import FakeDevice
    from offload import LayerwiseOffloader, OffloadConfig

    cache_config = parse_cache(args.cache)
    cache_schedule = H3Schedule.build(args.cache_steps)
    cache_prepared = cache.prepare(cache_schedule.plans)
    offload_device = FakeDevice() if device.type == "cpu" else device
    offloader = LayerwiseOffloader(transformer.transformer_blocks, OffloadConfig(enabled=True), offload_device,
                                   root=transformer).apply()
    with_offload = Rig(transformer, modulation=engine.modulation, offloader=offloader)
    for shape in shapes:
        if shape.label not in per_shape or deadline.left() < 30:
            report.skipped.append(f"offload {shape.label}: out of time budget or no resident run")
            continue
        tokens, resident_s = per_shape[shape.label]["tokens"], per_shape[shape.label]["resident_s"]
        run_ = timed_run(with_offload, geometries[shape.label], schedule, prepared, timed)
        floor = max(resident_s, run_.h2d_bytes_per_step / (limits.h2d_gbps * 1e9))
        denoise_row(shape, "ours + offload", run_, tokens, floor_s=floor,
                    note="floor: max(ours resident step, H2D bytes / pinned bandwidth)")
        report.write(out, tag)
    cache_dit = CacheDit(transformer, cache_config.model_copy(update={"enabled": True}),
                         stack=find_block_stack(transformer))
    with_offload.cache = cache_dit
    cache_forwards = range(0, cache_schedule.num_forwards)

    def cache_run(rig: Rig, geometry) -> StepRun:
        denoiser = Denoiser(geometry, cache_schedule, text_rows.shape[0], device)
        cache_dit.refresh_resolved(cache_schedule.num_forwards, cache_config)
        if rig.offloader is not None:
            rig.offloader.set_cache_blocks(cache_config.Fn_compute_blocks, cache_config.Bn_compute_blocks)
        return run_steps(rig, denoiser, text_rows, cache_prepared, cache_forwards, device)

    for shape in shapes:
        if shape.label not in per_shape or deadline.left() < 40:
            report.skipped.append(f"offload + cache-dit {shape.label}: out of time budget")
            continue
        run_ = cache_run(with_offload, geometries[shape.label])
        resident_s = per_shape[shape.label]["resident_s"]
        computed = run_.num_forwards - len(run_.cached_steps)
        floor = max(resident_s * computed / run_.num_forwards, run_.h2d_bytes_per_step / (limits.h2d_gbps * 1e9))
        denoise_row(shape, f"ours + offload + cache-dit ({cache_config.label()})", run_,
                    per_shape[shape.label]["tokens"], floor_s=floor,
                    note=f"{args.cache_steps}-step schedule; floor: max(resident step x computed fraction, H2D / bw)")
        report.write(out, tag)
    offloader.remove()
    with_cache = Rig(transformer, modulation=engine.modulation, cache=cache_dit)
    for shape in shapes:
        if shape.label not in per_shape or deadline.left() < 40:
            report.skipped.append(f"cache-dit {shape.label}: out of time budget")
            continue
        run_ = cache_run(with_cache, geometries[shape.label])
        computed = run_.num_forwards - len(run_.cached_steps)
        floor = per_shape[shape.label]["floor"] * max(computed, 1) / run_.num_forwards
        denoise_row(shape, f"ours + cache-dit ({cache_config.label()})", run_, per_shape[shape.label]["tokens"],
                    floor_s=floor, note=f"{args.cache_steps}-step schedule; floor: FLOP floor x computed fraction "
                    "(cached steps still run the Fn blocks)")
        report.write(out, tag)
    cache_prepared.release()
    prepared.release()
    report.notes.append(f"offload: {weights_per_block / 1e9:.3f} GB streamed per block (no adaln_proj: online AdaLN), "
                        "prefetch depth 1, skip-aware (DBCache edges resident)")

    # --- end to end, scaled -----------------------------------------------------------------------------
    request_label = "37.7k" if not smoke else "s"
    step = per_shape.get(request_label, {}).get("resident_s")
    if step is not None:
        scale_blocks = RELEASED_BLOCKS / num_blocks
        forwards = RELEASED_STEPS - 1
        parts = {"text encode": encode_s * scale_te, "plan miss": miss_s * adaln_bytes_50 / adaln_bytes,
                 "denoise": forwards * step * scale_blocks, "decode + mux": stage_s}
        total = sum(parts.values())
        report.end_to_end.append({
            "request": f"{request_shape.label}, {RELEASED_STEPS} steps ({forwards} forwards), cold plans",
            "total_s": round(total, 1), **{k: round(v, 2) for k, v in parts.items()},
            "how": f"measured with {num_blocks} blocks / {text_layers} text layers; denoise = {forwards} x step x "
                   f"{scale_blocks:.2f} (blocks), text encode x {scale_te:.1f}, plan miss x bytes"})
        warm = total - parts["plan miss"]
        report.end_to_end.append({"request": "same, plans in the GPU slab (a repeat schedule)", "total_s": round(warm, 1),
                                  "how": "minus the plan miss (GPU hit ~ms)"})
    report.meta["finished_in_s"] = round(time.monotonic() - deadline.start, 1)


if __name__ == "__main__":
    raise SystemExit(main())
