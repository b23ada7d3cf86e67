"""Every stage of a 5 s 1344x768 fl2va and ref2va request on one GPU, beside t2va in the same run (issue 23).

    python -m bench.conditioning --smoke                                  # CPU: tiny width, every task (~1 min)
    python -m bench.conditioning --num-blocks 4 --workdir /dev/shm/h3c --out DIR --budget-s 420   # one H200

The checkpoint is random (`bench.checkpoints`) with the real architecture: both partitions' transformers at h3 width
with `--num-blocks` of the 50 blocks (FL2VA `transformer/`, Ref2VA `transformer_ref/`, another seed), a Qwen3-VL of
the real text width with `--text-layers` decoder layers read and Qwen3-VL-32B's vision tower at its released size, the
released-size VAEs, the tiny locally trained tokenizer, the released canvas rule (reference images at a 2048-px short
edge). Smoke: tiny width, a one-block vision tower, small VAEs and a tiny canvas rule.

Tasks, one request each (`--tasks`), through the engine's own stages: `engine.Engine` of the FL2VA partition (its prompt
stage with the vision tower, its VAEs, plan cache and transformer) serves t2va and fl2va; ref2va denoises on the
Ref2VA partition's transformer and plan cache (`DenoiserEngine(partition=ref2va)`) and is prepared and decoded
by the same prompt and decode stages, as an app serving both partitions does (`engine.conditioning.ConditioningStage`
over that checkpoint):
- `t2va`: the prompt alone;
- `fl2va`: first + last keyframes, two PNGs of the canvas size;
- `ref2va-images`: two PNG image references of the canvas size, each encoded at its own 2048-px short edge as the
  model does (3584x2048: ~7.2k vision tokens and as many VAE condition rows apiece);
- `ref2va-mixed`: one image, a short MP4 video (H.264, `--video-seconds`) and a WAV soundtrack (48 kHz stereo).

Per task and stage, measured, scaled to the release where this model is cut, and the floor where one exists:
upload decode + canvas (`ConditioningStage.check`: PNG / MP4 / WAV decode, CPU); prepare (the references normalized and
Qwen3-VL's processor, CPU: what the encode spends outside the models); video and audio VAE encode; the vision tower;
text encode (the language layers, x 50 / the layers loaded; floor max(FLOPs / GEMM rate, weights / device bandwidth));
rotary index + scatter (the rest of Qwen3-VL's multimodal forward); plan miss (the 49 plans rebuilt from the page
cache, x AdaLN bytes to 50 blocks; floor bytes / page-cache rate) and GPU hit; denoise per forward (`bench.h3.run_steps`
after one warm-up forward, x 50 / blocks; floor matmul FLOPs / GEMM rate, over the packed sequence whose token count is
reported); video and audio decode; the MP4 mux. The encode stages are timed on a second request with the same inputs
(the first warms the kernels up; its total is `first_encode_s`); the prompt-embedding cache is off. Peak memory: each
component's weights, and per stage the peak allocated and the peak over what was resident when it began.

Writes <out>/conditioning-<device>.md and .json after every task, so a run cut short keeps what it measured; what the
budget (`--budget-s`, counted from the start, checkpoint writing included) leaves no time for is listed as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import logging
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
from PIL import Image

from bench.checkpoints import (PRESETS, RELEASED_COMPONENTS, SMALL_COMPONENTS, make_random_checkpoint,
                               write_canvas_rule, write_h3_components)
from bench.common import device_description, device_tag, git_commit, write_sectioned_report
from bench.h3 import (PAGE_CACHE_GBPS, PROMPT, RELEASED_BLOCKS, RELEASED_STEPS, RELEASED_TEXT_LAYERS, SMOKE_PROMPT,
                      Deadline, Peak, Rig, forward_flops, measure_limits, param_bytes, run_steps, sync)
from engine.conditioning import ConditioningStage
from model.canvas import CanvasRule
from model.encode import AudioConditionEncoder, VisualConditionEncoder
from model.geometry import GeometryLimits
from model.layout import Partition
from model.packing import VIDEO_TAG
from model.tiny import TINY_CANVAS

logger = logging.getLogger("bench.conditioning")

GIB = 2**30


class Task(str, Enum):
    T2VA = "t2va"
    FL2VA = "fl2va"
    REF2VA_IMAGES = "ref2va-images"
    REF2VA_MIXED = "ref2va-mixed"

    @property
    def partition(self) -> Partition:
        return Partition.REF2VA if self in (Task.REF2VA_IMAGES, Task.REF2VA_MIXED) else Partition.FL2VA


class Stage(str, Enum):
    UPLOAD = "upload decode + canvas"
    PREPARE = "prepare: normalize + Qwen3-VL processor (CPU)"
    VIDEO_VAE = "video VAE encode"
    AUDIO_VAE = "audio VAE encode"
    VISION = "vision tower"
    TEXT = "text encode (language layers)"
    ROTARY = "rotary index + scatter"
    PLAN_MISS = "plan miss (page cache)"
    PLAN_HIT = "plan hit (GPU slab)"
    DENOISE = "denoise per forward"
    VIDEO_DECODE = "video decode"
    AUDIO_DECODE = "audio decode"
    MUX = "MP4 mux"


#: Qwen3-VL's multimodal forward, whole (vision tower + language layers + the rest): timed, not reported.
MULTIMODAL = "multimodal forward"
#: Stages that run once per request before the forwards (the end-to-end sum takes these, the forwards, the decode).
BEFORE_DENOISE = (Stage.UPLOAD, Stage.PREPARE, Stage.VIDEO_VAE, Stage.AUDIO_VAE, Stage.VISION, Stage.TEXT,
                  Stage.ROTARY, Stage.PLAN_MISS)
AFTER_DENOISE = (Stage.VIDEO_DECODE, Stage.AUDIO_DECODE, Stage.MUX)


@dataclass(frozen=True)
class Canvas:
    width: int
    height: int
    seconds: float


H3_CANVAS = Canvas(1344, 768, 5.0)
#: 1 s (the engine's smoke geometry allows it): the CPU decodes, muxes and encodes the soundtrack 5x faster.
SMOKE_CANVAS = Canvas(64, 32, 1.0)


# ---------------------------------------------------------------------------------------------------------
# Timing inside a call
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Span:
    """One stage inside a call: its seconds over every entry, and its memory."""

    seconds: float = 0.0
    calls: int = 0
    peak_bytes: int = 0    # the most allocated while it ran
    extra_bytes: int = 0   # the most over what was allocated when an entry began


class StageClock:
    """Seconds and peak device memory of named stages inside one call, reported by module hooks and wrappers.
    Every entry and exit synchronizes the device, so a stage's time is its own (a bench-only cost)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.spans: dict[str, Span] = {}
        self._begun: dict[str, tuple[float, int, bool]] = {}

    def begin(self, name: str, *, memory: bool = True) -> None:
        """`memory=False` for a stage that encloses others (their peak resets would cut its own)."""
        sync(self.device)
        base = 0
        if memory and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        self._begun[name] = (time.perf_counter(), base, memory)

    def end(self, name: str) -> None:
        sync(self.device)
        start, base, memory = self._begun.pop(name)
        span = self.spans.setdefault(name, Span())
        span.seconds += time.perf_counter() - start
        span.calls += 1
        if memory and self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            span.peak_bytes = max(span.peak_bytes, peak)
            span.extra_bytes = max(span.extra_bytes, peak - base)

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    def hook(self, module: torch.nn.Module, name: str, *, memory: bool = True) -> None:
        """Time every forward of `module` as stage `name` (hooks stay for the run)."""
        module.register_forward_pre_hook(lambda _module, _args: self.begin(name, memory=memory))
        module.register_forward_hook(lambda _module, _args, _output: self.end(name))

    def seconds(self, name: str) -> float:
        return self.spans[name].seconds if name in self.spans else 0.0

    def clear(self) -> None:
        self.spans.clear()


class TimedVisualEncoder(VisualConditionEncoder):
    """The video VAE's encoder side with every call timed as `Stage.VIDEO_VAE` (keyframes, images, video frames)."""

    def __init__(self, vae, clock: StageClock):
        super().__init__(vae)
        self.clock = clock

    def encode_image(self, image: Image.Image) -> torch.Tensor:
        with self.clock.span(Stage.VIDEO_VAE.value):
            return super().encode_image(image)

    def encode_frames(self, frames: np.ndarray) -> torch.Tensor:
        with self.clock.span(Stage.VIDEO_VAE.value):
            return super().encode_frames(frames)


class TimedAudioEncoder(AudioConditionEncoder):
    """The audio VAE's encoder side with every call timed as `Stage.AUDIO_VAE` (reference soundtracks)."""

    def __init__(self, vae, clock: StageClock):
        super().__init__(vae)
        self.clock = clock

    def encode(self, waveform: np.ndarray) -> torch.Tensor:
        with self.clock.span(Stage.AUDIO_VAE.value):
            return super().encode(waveform)


def timed_stage(stage: ConditioningStage, clock: StageClock) -> ConditioningStage:
    """`stage` preparing through timed VAE encoders (the same VAE modules)."""
    encoders = stage.encoders
    stage.encoders = dataclasses.replace(encoders, visual=TimedVisualEncoder(encoders.visual.vae, clock),
                                         audio=TimedAudioEncoder(encoders.audio.vae, clock))
    return stage


# ---------------------------------------------------------------------------------------------------------
# Floors
# ---------------------------------------------------------------------------------------------------------


def vision_flops(config: Any, grids: list[tuple[int, int, int]]) -> float:
    """Matmul FLOPs of Qwen3-VL's vision tower over items of patch grids (t, h, w): per block qkv, proj and the MLP
    over every patch and attention within each frame's h x w patches; the patch embedding; the merger and the
    deepstack mergers over the merged tokens. Norms, rotary and interpolated position embeddings are left out."""
    hidden, inner, out = config.hidden_size, config.intermediate_size, config.out_hidden_size
    merge = config.spatial_merge_size ** 2
    embed = 2 * config.in_channels * config.temporal_patch_size * config.patch_size ** 2 * hidden
    mergers = 1 + len(config.deepstack_visual_indexes)
    total = 0.0
    for t, h, w in grids:
        patches = t * h * w
        block = 2 * patches * (4 * hidden**2 + 2 * hidden * inner) + 4 * t * (h * w) ** 2 * hidden
        merged = mergers * 2 * (patches // merge) * ((merge * hidden) ** 2 + merge * hidden * out)
        total += config.depth * block + merged + patches * embed
    return total


def text_flops(config: Any, layer_params: int, num_layers: int, num_tokens: int) -> float:
    """Matmul FLOPs of `num_layers` Qwen3-VL decoder layers over `num_tokens`: the layer's weights once per token
    and causal attention (QK^T and PV over half the pairs)."""
    attention = 2 * num_tokens**2 * config.num_attention_heads * config.head_dim
    return num_layers * (2 * num_tokens * layer_params + attention)


# ---------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Media:
    """The conditioned tasks' uploads as a client sends them: file bytes."""

    first: bytes               # PNG keyframes
    last: bytes
    images: tuple[bytes, ...]  # PNG image references
    video: bytes               # MP4 (H.264), no soundtrack
    soundtrack: bytes          # WAV, 48 kHz stereo (the upload decode resamples it to 32 kHz)


def smooth_image(width: int, height: int, seed: int) -> Image.Image:
    """Smooth random RGB (what a PNG of a photo costs to decode, roughly; deterministic in `seed`)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def drifting_frames(num_frames: int, width: int, height: int, seed: int) -> np.ndarray:
    """uint8 [F, H, W, 3]: a smooth image whose colours drift frame to frame."""
    base = np.asarray(smooth_image(width, height, seed), dtype=np.int16)
    return np.stack([((base + 3 * i) % 256).astype(np.uint8) for i in range(num_frames)])


def wav(seconds: float, rate: int = 48000) -> bytes:
    """A stereo 16-bit WAV of two sines."""
    t = np.arange(int(seconds * rate)) / rate
    samples = np.stack([np.sin(2 * np.pi * 220 * t), np.sin(2 * np.pi * 330 * t)]) * 8000
    out = io.BytesIO()
    with av.open(out, "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=rate, layout="stereo")
        frame = av.AudioFrame.from_ndarray(samples.T.reshape(1, -1).astype(np.int16), format="s16", layout="stereo")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return out.getvalue()


def make_media(canvas: Canvas, video_seconds: float) -> Media:
    from model.mp4 import write_mp4

    video = io.BytesIO()
    write_mp4(video, drifting_frames(round(video_seconds * 24) + 1, canvas.width, canvas.height, seed=5), 24, None,
              32000)
    return Media(first=png(smooth_image(canvas.width, canvas.height, seed=1)),
                 last=png(smooth_image(canvas.width, canvas.height, seed=2)),
                 images=(png(smooth_image(canvas.width, canvas.height, seed=3)),
                         png(smooth_image(canvas.width, canvas.height, seed=4))),
                 video=video.getvalue(), soundtrack=wav(canvas.seconds))


def task_request(task: Task, media: Media, canvas: Canvas, prompt: str):
    from engine.api import GenerationRequest, KeyframeInput, ReferenceInput

    conditions: dict[str, Any] = {}
    if task is Task.FL2VA:
        conditions["keyframes"] = (KeyframeInput(image=media.first, anchor="first"),
                                   KeyframeInput(image=media.last, anchor="last"))
    elif task is Task.REF2VA_IMAGES:
        conditions["references"] = tuple(ReferenceInput(kind="image", data=image) for image in media.images)
    elif task is Task.REF2VA_MIXED:
        conditions["references"] = (ReferenceInput(kind="image", data=media.images[0]),
                                    ReferenceInput(kind="video", data=media.video),
                                    ReferenceInput(kind="audio", data=media.soundtrack))
    return GenerationRequest(prompt=prompt, seconds=canvas.seconds, width=canvas.width, height=canvas.height,
                             seed=0, return_video=False, **conditions)


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Report:
    """Everything measured so far; written after every task, so a cut-short run keeps what it measured."""

    meta: dict[str, Any]
    setup: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    stages: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def stage_matrix(self, column: str) -> list[dict[str, Any]]:
        """One row per stage, one column per task: `column` of that task's stage row ("" where it does not run)."""
        tasks = [row["task"] for row in self.requests]
        cells = {(row["task"], row["stage"]): row.get(column) for row in self.stages}
        return [{"stage": stage.value, **{task: cells.get((task, stage.value)) for task in tasks}} for stage in Stage
                if any((task, stage.value) in cells for task in tasks)]

    def end_to_end(self) -> list[dict[str, Any]]:
        """Per task: the stages before the forwards + 49 forwards + decode and mux, each at the release's size."""
        rows = []
        for request in self.requests:
            task = request["task"]
            scaled = {row["stage"]: row["scaled_s"] for row in self.stages if row["task"] == task}
            if Stage.DENOISE.value not in scaled:
                continue
            forwards = RELEASED_STEPS - 1
            parts = {"before_denoise_s": sum(scaled.get(s.value, 0.0) for s in BEFORE_DENOISE),
                     "denoise_s": forwards * scaled[Stage.DENOISE.value],
                     "decode_mux_s": sum(scaled.get(s.value, 0.0) for s in AFTER_DENOISE)}
            missing = [s.value for s in AFTER_DENOISE if s.value not in scaled]
            rows.append({"task": task, "total_s": round(sum(parts.values()), 1),
                         **{k: round(v, 2) for k, v in parts.items()},
                         "how": f"{RELEASED_STEPS} steps ({forwards} forwards), cold plans, every stage at the "
                                f"release's size" + (f"; not measured: {', '.join(missing)}" if missing else "")})
        t2va = next((row["total_s"] for row in rows if row["task"] == Task.T2VA.value), None)
        for row in rows:
            row["x_t2va"] = round(row["total_s"] / t2va, 2) if t2va else None
        return rows

    def write(self, out: Path, tag: str) -> Path:
        tables = (("Setup", self.setup), ("Requests (tokens of the packed sequence)", self.requests),
                  ("Seconds per stage at the release's size (scaled_s)", self.stage_matrix("scaled_s")),
                  ("Peak memory per stage, GiB over what was resident (extra_GiB)", self.stage_matrix("extra_GiB")),
                  ("End to end at the release's size", self.end_to_end()),
                  ("Memory per component (weights)", self.memory), ("Every stage", self.stages))
        sections = [(title, [row for row in rows if any(value is not None for key, value in row.items()
                                                        if key != "stage")]) for title, rows in tables]
        record = {**dataclasses.asdict(self), "seconds_per_stage": self.stage_matrix("scaled_s"),
                  "extra_GiB_per_stage": self.stage_matrix("extra_GiB"), "end_to_end": self.end_to_end()}
        return write_sectioned_report(out, f"conditioning-{tag}", "MiniMax-H3 fl2va and ref2va stages beside t2va",
                                      self.meta, self.notes, sections, self.skipped, record)


def gib(nbytes: int | None, device: torch.device) -> float | None:
    return round(nbytes / GIB, 3) if nbytes is not None and device.type == "cuda" else None


# ---------------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny width on CPU, every task (~1 min)")
    ap.add_argument("--tasks", default=",".join(t.value for t in Task), help="comma-separated, in this order")
    ap.add_argument("--num-blocks", type=int, default=None, help="transformer blocks of each partition (4; smoke 2)")
    ap.add_argument("--text-layers", type=int, default=None, help="Qwen3-VL decoder layers read (4; smoke 2)")
    ap.add_argument("--forwards", type=int, default=None, help="timed forwards per task after one warm-up (3; "
                    "smoke 1)")
    ap.add_argument("--ref2va-forwards", type=int, default=None, help="at most this many for ref2va, whose "
                    "sequences are ~2x t2va's (2; smoke 1)")
    ap.add_argument("--video-seconds", type=float, default=2.0, help="the ref2va-mixed reference video's length")
    ap.add_argument("--workdir", default=None, help="where the checkpoint is written (default: a temp dir)")
    ap.add_argument("--workers", type=int, default=8, help="checkpoint shards written at once")
    ap.add_argument("--budget-s", type=float, default=None, help="no task starts after this, counted from the start "
                    "(420; smoke 170)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    for noisy in ("cache_dit", "diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        tasks = tuple(Task(name.strip()) for name in args.tasks.split(",") if name.strip())
    except ValueError as exc:
        raise SystemExit(f"--tasks: {exc}; choose from {', '.join(t.value for t in Task)}") from None
    deadline = Deadline(args.budget_s or (170.0 if args.smoke else 420.0))
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.num_blocks = args.num_blocks or (2 if args.smoke else 4)
    args.text_layers = args.text_layers or (2 if args.smoke else 4)
    args.forwards = args.forwards or (1 if args.smoke else 3)
    args.ref2va_forwards = args.ref2va_forwards or (1 if args.smoke else 2)
    tag = device_tag(str(device))
    tag = f"smoke-{tag}" if args.smoke else tag
    command = "python -m bench.conditioning " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                 else sys.argv[1:]))
    report = Report(meta={"commit": git_commit(), "device": tag, "device_description": device_description(str(device)),
                          "command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                          "tasks": [t.value for t in tasks], "num_blocks": args.num_blocks,
                          "text_layers": args.text_layers, "forwards": args.forwards,
                          "ref2va_forwards": args.ref2va_forwards})
    out = Path(args.out)
    tmp = None
    workdir = Path(args.workdir) if args.workdir else Path(tmp := tempfile.mkdtemp(prefix="bench-conditioning-"))
    try:
        failed = Bench(args, report, out, tag, device, deadline, workdir).run(tasks)
    except Exception as exc:  # keep what was measured
        logger.exception("bench.conditioning failed")
        report.skipped.append(f"run stopped by {type(exc).__name__}: {exc}"[:400])
        report.write(out, tag)
        return 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    report.meta["finished_in_s"] = round(time.monotonic() - deadline.start, 1)
    path = report.write(out, tag)
    print(path.read_text())
    return 1 if failed else 0


@dataclass
class Served:
    """What one partition's requests run on: its engine (the Ref2VA one holds the denoiser alone) and the
    conditioning stage preparing them (the FL2VA engine's prompt and decode stages, timed encoders)."""

    engine: Any                           # engine.engine.Engine
    stage: ConditioningStage


class Bench:
    def __init__(self, args, report: Report, out: Path, tag: str, device: torch.device, deadline: Deadline,
                 workdir: Path):
        self.args, self.report, self.out, self.tag = args, report, out, tag
        self.device, self.deadline, self.workdir = device, deadline, workdir
        self.config = PRESETS["tiny" if args.smoke else "h3"].model_copy(update={"num_layers": args.num_blocks})
        self.canvas = SMOKE_CANVAS if args.smoke else H3_CANVAS
        self.prompt = SMOKE_PROMPT if args.smoke else PROMPT
        self.clock = StageClock(device)
        self.served: dict[Partition, Served] = {}
        self.vision_grids: list[tuple[int, int, int]] = []

    def write(self) -> None:
        self.report.write(self.out, self.tag)

    def margin_s(self, task: Task) -> float:
        """What a task needs at least before it starts (GPU: ref2va's two encodes and forwards at ~70k tokens)."""
        if self.args.smoke:
            return 10.0
        return 60.0 if task.partition is Partition.REF2VA else 35.0

    def run(self, tasks: tuple[Task, ...]) -> bool:
        """Every task in turn; True if one of them failed (the others still ran)."""
        self.limits = measure_limits(self.device, self.args.smoke)
        self.describe_run()
        self.make_files(tasks)
        failed = False
        for task in tasks:
            if self.deadline.left() < self.margin_s(task):
                self.report.skipped.append(f"{task.value}: out of time budget (--budget-s {self.deadline.budget_s:g}; "
                                           f"{self.deadline.left():.0f} s left, it needs ~{self.margin_s(task):.0f})")
                continue
            try:
                with torch.no_grad():
                    self.run_task(task)
            except Exception as exc:  # one task's failure (e.g. out of memory) leaves the others' numbers
                logger.exception("%s failed", task.value)
                self.report.skipped.append(f"{task.value} stopped by {type(exc).__name__}: {exc}"[:400])
                failed = True
            finally:
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            self.write()
        return failed

    def describe_run(self) -> None:
        args, limits = self.args, self.limits
        self.report.notes += [
            f"measured ceilings: bf16 GEMM {limits.gemm_tflops:.4g} TFLOP/s, pinned H2D {limits.h2d_gbps:.4g} GB/s, "
            f"device copy {limits.hbm_gbps:.4g} GB/s (read + write)",
            (f"model: MiniMax-H3 architecture at hidden {self.config.hidden_size}, {args.num_blocks} of "
             f"{RELEASED_BLOCKS} blocks per partition (FL2VA transformer/, Ref2VA transformer_ref/: another seed), "
             f"random bf16 weights; Qwen3-VL text width {RELEASED_COMPONENTS.text['hidden_size']}, {args.text_layers} "
             f"of {RELEASED_TEXT_LAYERS} layers read; Qwen3-VL-32B's vision tower at its released size (27 blocks, "
             "1152 wide), its processors' pixel bounds; released-size VAEs; tiny local tokenizer; the released "
             "canvas rule (reference images at a 2048-px short edge)") if not args.smoke else
            "smoke: tiny width, one-block vision tower, small VAEs, tiny canvas rule; timings are not meaningful",
            f"canvas {self.canvas.width}x{self.canvas.height}, {self.canvas.seconds:g} s, {RELEASED_STEPS} steps "
            f"({RELEASED_STEPS - 1} plans); t2va and fl2va on the FL2VA engine, ref2va on the Ref2VA partition's "
            "transformer and plan cache (Engine partition=ref2va, parts=DENOISER), prepared and decoded by the FL2VA "
            "engine's prompt and decode stages (one text encoder and one pair of VAEs, as an app serving both)",
            "encode stages: timed on a second request with the same inputs (first_encode_s: the first, warming the "
            "kernels up); every stage boundary synchronizes the device; the prompt-embedding cache is off",
            "the presentation's vision and label tokens are not checked against max_prompt_tokens (the engine "
            "checks the prompt's own tokens; vision blocks are bounded by the media limits), so ref2va's tens of "
            "thousands of text rows run as the model makes them; the bench drives the engine's stages, not the "
            "HTTP/jobs layer",
            f"denoise: forwards 1..n of the {RELEASED_STEPS}-step schedule after forward 0 (warm-up), "
            f"n = {args.forwards} (ref2va: {min(args.forwards, args.ref2va_forwards)}), on the task's transformer with "
            "plans from its slab; scaled_s x 50 / blocks (the non-block part scaled too: a slight overestimate); "
            "floor: block matmul FLOPs over the packed sequence / GEMM rate (the token refiner runs once per request: "
            "left out)",
            "text encode: the language layers' forward x 50 / layers loaded; floor max(FLOPs / GEMM rate, layer "
            "weights / device bandwidth), scaled alike; vision tower: as released, floor FLOPs / GEMM rate",
            f"plan miss: the 49 plans rebuilt (engine's plan cache invalidated first), x AdaLN bytes to 50 blocks; "
            f"floor AdaLN bytes / {PAGE_CACHE_GBPS} GB/s (the H200 machine's page-cache read rate, "
            "bench/results/adaln-nvidia-h200.md); plan hit: the same plans again, in the GPU slab",
            "decode: the task's geometry from seeded noise latents (a decode costs what its shape costs); every "
            f"task decodes the same {self.canvas.width}x{self.canvas.height} {self.canvas.seconds:g} s clip, so those "
            "rows repeat t2va's within noise",
            "peak_GiB: max allocated while the stage ran (everything resident counted: both transformers, the text "
            "encoder, the VAEs, the plan slabs); extra_GiB: over what was allocated when it began (its activations)",
        ]

    # --- files and engines -------------------------------------------------------------------------

    def make_files(self, tasks: tuple[Task, ...]) -> None:
        args, report = self.args, self.report
        self.root = self.workdir / f"h3c-b{args.num_blocks}-t{args.text_layers}" if not args.smoke \
            else self.workdir / f"h3c-smoke-b{args.num_blocks}"
        if not (self.root / "model_index.json").exists():
            t0 = time.perf_counter()
            make_random_checkpoint(self.root, self.config, "diffusers", seed=0, workers=args.workers,
                                   device=self.device, ref2va=True)
            transformers_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            component_bytes = write_h3_components(
                self.root, "diffusers", 0, text_layers=args.text_layers + 1, device=self.device,
                sizes=SMALL_COMPONENTS if args.smoke else RELEASED_COMPONENTS,
                vision="tiny" if args.smoke else "released")
            if args.smoke:
                write_canvas_rule(self.root, "diffusers", CanvasRule(
                    TINY_CANVAS["canvas_short_edge"], TINY_CANVAS["canvas_max_pixels"],
                    TINY_CANVAS["reference_image_short_edge"]))
            report.setup += [
                {"what": f"transformers FL2VA + Ref2VA, {args.num_blocks} blocks each",
                 "seconds": round(transformers_s, 2)},
                {"what": "components (text encoder with vision tower, tokenizer, processors, VAEs)",
                 "seconds": round(time.perf_counter() - t0, 2),
                 "GB": round(sum(component_bytes.values()) / 1e9, 2)}]
        t0 = time.perf_counter()
        self.media = make_media(self.canvas, args.video_seconds)
        report.setup.append({"what": "uploads: 4 PNGs, an MP4, a WAV", "seconds": round(time.perf_counter() - t0, 2),
                             "GB": round((len(self.media.first) + len(self.media.last) + sum(map(len, self.media.images))
                                          + len(self.media.video) + len(self.media.soundtrack)) / 1e9, 4)})
        self.write()
        self.load_fl2va()

    def engine_config(self, partition: Partition):
        from engine.config import EngineConfig

        page_bytes = (self.args.num_blocks * self.config.adaln_width + self.config.final_adaln_width) * 2
        return EngineConfig(
            checkpoint=str(self.root), device=self.device.type, partition=partition.value,
            text_encoder={"hidden_state_index": self.args.text_layers, "prompt_cache_mb": 0},
            # 49 plans of up to 4 rows (ref2va with a soundtrack), twice over
            adaln={"mode": "online", "gpu_plans": 64, "host_cache_gb": max(0.05, 2 * 49 * 4 * page_bytes / 1e9)},
            geometry={"short_edge": None, "min_seconds": 1.0} if self.args.smoke else None)

    def load_fl2va(self) -> None:
        from engine.engine import Engine
        from engine.model_limits import geometry_limits

        with Peak(self.device) as peak:
            t0 = time.perf_counter()
            engine = Engine(self.engine_config(Partition.FL2VA))
            load_s = time.perf_counter() - t0
        self.report.setup.append({"what": "FL2VA engine (transformer, online AdaLN; text encoder with vision; VAEs)",
                                  "seconds": round(load_s, 2), "GB": gib(peak.extra_bytes, self.device)})
        self.geometry_limits = geometry_limits(engine.limits)
        encoder = engine.prompt_encoder
        # The engine's Qwen3-VL modules, timed where they run inside its multimodal forward (bench.h3 reads the
        # encoder's layers the same way).
        multimodal, language = encoder._multimodal, encoder._model
        self.clock.hook(multimodal, MULTIMODAL, memory=False)
        self.clock.hook(multimodal.visual, Stage.VISION.value)
        self.clock.hook(language, Stage.TEXT.value)
        multimodal.visual.register_forward_pre_hook(self._record_grids, with_kwargs=True)
        self.vision_config = multimodal.visual.config
        self.text_config = language.config
        self.text_layer_params = sum(p.numel() for p in language.layers[0].parameters())
        stage = timed_stage(ConditioningStage(engine.checkpoint, engine.prompt_stage, engine.decode_stage.encoders(),
                                              self.geometry_limits), self.clock)
        self.served[Partition.FL2VA] = Served(engine, stage)
        self.warm_up_decoders(engine)
        self.component_memory(engine, Partition.FL2VA)
        self.write()

    def _record_grids(self, _module, _args, kwargs) -> None:
        self.vision_grids += [tuple(g) for g in kwargs["grid_thw"].tolist()]

    def served_for(self, partition: Partition) -> Served:
        if partition not in self.served:
            self.load_ref2va()
        return self.served[partition]

    def load_ref2va(self) -> None:
        from engine.engine import DenoiserEngine

        fl2va = self.served[Partition.FL2VA].engine
        with Peak(self.device) as peak:
            t0 = time.perf_counter()
            engine = DenoiserEngine(self.engine_config(Partition.REF2VA))
            load_s = time.perf_counter() - t0
        self.report.setup.append({"what": "Ref2VA engine (transformer_ref, online AdaLN; denoiser only)",
                                  "seconds": round(load_s, 2), "GB": gib(peak.extra_bytes, self.device)})
        stage = timed_stage(ConditioningStage(engine.checkpoint, fl2va.prompt_stage, fl2va.decode_stage.encoders(),
                                              self.geometry_limits), self.clock)
        self.served[Partition.REF2VA] = Served(engine, stage)
        self.component_memory(engine, Partition.REF2VA)

    def warm_up_decoders(self, engine) -> None:
        """One latent clip of the canvas through both decoders, so the first task's decode is not a cold one."""
        from model.geometry import VideoGeometry

        any_length = GeometryLimits(short_edge=None, max_pixels=self.canvas.width * self.canvas.height,
                                    min_seconds=0.1, max_seconds=60.0)
        geometry = VideoGeometry.from_frames(self.canvas.width, self.canvas.height, 22, any_length)
        t0 = time.perf_counter()
        engine.video_decoder.decode(torch.zeros(geometry.video_latent_shape, device=self.device))
        engine.audio_decoder.decode(torch.zeros(geometry.num_audio_rows, 32, device=self.device))
        sync(self.device)
        self.report.setup.append({"what": "decoder warm-up (one latent clip)",
                                  "seconds": round(time.perf_counter() - t0, 2)})

    def component_memory(self, engine, partition: Partition) -> None:
        config, blocks = self.config, self.args.num_blocks
        transformer = engine.transformer
        per_block = param_bytes(transformer.transformer_blocks[0])
        total = param_bytes(transformer)
        slab = engine.plan_cache.slab
        slab_bytes = (slab.blocks.numel() + slab.final.numel()) * slab.blocks.element_size()
        page_bytes = (blocks * config.adaln_width + config.final_adaln_width) * 2
        page_bytes_50 = (RELEASED_BLOCKS * config.adaln_width + config.final_adaln_width) * 2
        rows = self.report.memory
        rows += [
            {"component": f"transformer {partition.native_dir_name} ({engine.checkpoint.transformer_dir.name}/, "
                          "online AdaLN)",
             "measured_GiB": round(total / GIB, 2), "at_release_GiB": round((total + (RELEASED_BLOCKS - blocks)
                                                                             * per_block) / GIB, 2),
             "note": f"{per_block / 1e9:.3f} GB per block without adaln_proj; scaled to {RELEASED_BLOCKS} blocks"},
            {"component": f"AdaLN plan slab {partition.native_dir_name} (64 plans x 4 rows)",
             "measured_GiB": round(slab_bytes / GIB, 3), "at_release_GiB": round(slab_bytes / page_bytes
                                                                                 * page_bytes_50 / GIB, 2)}]
        if partition is not Partition.FL2VA:
            return
        encoder = engine.prompt_encoder
        language, visual = encoder._model, encoder._multimodal.visual
        layer = param_bytes(language.layers[0])
        language_bytes = param_bytes(language)
        rows += [
            {"component": f"text encoder: language model ({encoder.num_loaded_layers} layers + embedding)",
             "measured_GiB": round(language_bytes / GIB, 2),
             "at_release_GiB": round((language_bytes + (RELEASED_TEXT_LAYERS - encoder.num_loaded_layers) * layer)
                                     / GIB, 2),
             "note": f"{layer / 1e9:.3f} GB per layer; scaled to the {RELEASED_TEXT_LAYERS} layers H3 reads"},
            {"component": "text encoder: vision tower", "measured_GiB": round(param_bytes(visual) / GIB, 3),
             "at_release_GiB": None if self.args.smoke else round(param_bytes(visual) / GIB, 3),
             "note": f"{self.vision_config.depth} blocks, {self.vision_config.hidden_size} wide"},
            {"component": "video VAE (bf16 decoder blocks, fp32 rest)",
             "measured_GiB": round(param_bytes(engine.video_decoder.vae) / GIB, 2),
             "at_release_GiB": None if self.args.smoke else round(param_bytes(engine.video_decoder.vae) / GIB, 2)},
            {"component": "audio VAE (fp32)", "measured_GiB": round(param_bytes(engine.audio_decoder.vae) / GIB, 3),
             "at_release_GiB": None if self.args.smoke else round(param_bytes(engine.audio_decoder.vae) / GIB, 3)},
        ]

    # --- one task ----------------------------------------------------------------------------------

    def stage_row(self, task: Task, stage: Stage, seconds: float, *, scale: float = 1.0, scaled_to: str = "as released",
                  floor_s: float | None = None, floor: str = "", span: Span | None = None, note: str = "") -> None:
        row = {"task": task.value, "stage": stage.value, "measured_s": round(seconds, 6),
               "scaled_s": round(seconds * scale, 6), "scaled_to": scaled_to,
               "floor_s": round(floor_s * scale, 6) if floor_s else None,
               "x_floor": round(seconds / floor_s, 2) if floor_s else None, "floor": floor,
               "peak_GiB": gib(span.peak_bytes, self.device) if span else None,
               "extra_GiB": gib(span.extra_bytes, self.device) if span else None, "note": note}
        self.report.stages.append(row)
        logger.info("%s %s", task.value, row)

    def run_task(self, task: Task) -> None:
        from engine.engine import request_schedule
        from model.geometry import VideoGeometry

        served = self.served_for(task.partition)
        request = task_request(task, self.media, self.canvas, self.prompt)
        encoder = self.served[Partition.FL2VA].engine.prompt_encoder
        self.vision_grids = []
        if task is Task.T2VA:
            t0 = time.perf_counter()
            encoder.encode(request.prompt)
            sync(self.device)
            first_s = time.perf_counter() - t0
            self.clock.clear()
            t0 = time.perf_counter()
            embeds = encoder.encode(request.prompt)
            sync(self.device)
            encode_s = time.perf_counter() - t0
            upload_s, conditions = None, None
            geometry = VideoGeometry.from_seconds(request.width, request.height, request.seconds, self.geometry_limits)
            schedule = request_schedule(request.steps, request.flow_shift, request.audio_flow_shift)
        else:
            t0 = time.perf_counter()
            served.stage.check(request)
            served.stage.encode(request)
            first_s = time.perf_counter() - t0
            self.clock.clear()
            self.vision_grids = []
            again = request.model_copy()  # another request object: decoded, prepared and encoded anew
            t0 = time.perf_counter()
            geometry, schedule = served.stage.check(again)
            upload_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            embedding = served.stage.encode(again)
            sync(self.device)
            encode_s = time.perf_counter() - t0
            embeds, conditions = embedding.embeds, embedding.conditions.latents
        prompt_tokens = encoder.count_tokens(request.prompt)
        self.encode_rows(task, embeds.shape[0], encode_s, upload_s)
        self.write()

        engine = served.engine
        prepared = self.plan_rows(task, engine, schedule)
        try:
            denoiser = self.denoise_row(task, engine, geometry, schedule, embeds, conditions, prepared)
        finally:
            prepared.release()
            engine.modulation.clear()
        layout = denoiser.layout
        self.report.requests.append({
            "task": task.value, "transformer": f"{engine.checkpoint.transformer_dir.name}/",
            "prompt_tokens": prompt_tokens, "text_rows": layout.num_text_tokens,
            "vision_rows": int((conditions.text_token_tags == VIDEO_TAG).sum()) if conditions is not None else 0,
            "condition_video_rows": layout.num_condition_video_rows,
            "condition_audio_rows": layout.num_condition_audio_rows,
            "generated_rows": geometry.num_video_tokens + geometry.num_audio_rows, "packed_tokens": layout.num_tokens,
            "timesteps_per_plan": max(step.timesteps.numel() for step in schedule.steps),
            "first_encode_s": round(first_s, 3), "encode_s": round(encode_s, 3)})
        self.write()
        if self.deadline.left() < (5.0 if self.args.smoke else 25.0):
            self.report.skipped.append(f"{task.value}: decode and mux, out of time budget")
            return
        self.decode_rows(task, engine if task.partition is Partition.FL2VA
                         else self.served[Partition.FL2VA].engine, denoiser)

    def encode_rows(self, task: Task, text_rows: int, encode_s: float, upload_s: float | None) -> None:
        clock, limits = self.clock, self.limits
        layers = self.args.text_layers
        scale_text = RELEASED_TEXT_LAYERS / layers
        text_s = clock.seconds(Stage.TEXT.value)
        text_floor = max(text_flops(self.text_config, self.text_layer_params, layers, text_rows)
                         / (limits.gemm_tflops * 1e12),
                         layers * self.text_layer_params * 2 / (limits.hbm_gbps * 1e9))
        if upload_s is not None:
            self.stage_row(task, Stage.UPLOAD, upload_s, scaled_to="as released (CPU)",
                           note="ConditioningStage.check: media decode, canvas, schedule")
            vae_s = clock.seconds(Stage.VIDEO_VAE.value) + clock.seconds(Stage.AUDIO_VAE.value)
            multimodal_s = clock.seconds(MULTIMODAL)
            self.stage_row(task, Stage.PREPARE, encode_s - vae_s - multimodal_s, scaled_to="as released (CPU)",
                           note="ConditioningStage.encode outside the VAEs and Qwen3-VL's forward")
            for stage in (Stage.VIDEO_VAE, Stage.AUDIO_VAE):
                if stage.value in clock.spans:
                    span = clock.spans[stage.value]
                    self.stage_row(task, stage, span.seconds, span=span, note=f"{span.calls} call(s)")
            vision = clock.spans[Stage.VISION.value]
            vision_floor = vision_flops(self.vision_config, self.vision_grids) / (limits.gemm_tflops * 1e12)
            patches = sum(t * h * w for t, h, w in self.vision_grids)
            self.stage_row(task, Stage.VISION, vision.seconds, span=vision, floor_s=vision_floor,
                           floor="FLOPs / GEMM rate",
                           note=f"{patches} patches in {len(self.vision_grids)} grid(s) {self.vision_grids}")
            self.stage_row(task, Stage.ROTARY, multimodal_s - vision.seconds - text_s,
                           note="Qwen3-VL's multimodal forward outside the vision tower and the language layers")
        text = clock.spans[Stage.TEXT.value]
        self.stage_row(task, Stage.TEXT, text_s, scale=scale_text, span=text,
                       scaled_to=f"{RELEASED_TEXT_LAYERS} layers (x{scale_text:.1f})", floor_s=text_floor,
                       floor="max(FLOPs / GEMM rate, weights / device bandwidth)", note=f"{text_rows} rows")

    def plan_rows(self, task: Task, engine, schedule):
        """The task's plans missed (rebuilt) then hit; returns the prepared plans (held) for the forwards."""
        config, blocks = self.config, self.args.num_blocks
        per_block = config.adaln_width * (config.time_embed_dim + 1) * 2
        final = config.final_adaln_width * (config.time_embed_dim + 1) * 2
        adaln_bytes = blocks * per_block + final
        bytes_scale = (RELEASED_BLOCKS * per_block + final) / adaln_bytes
        cache = engine.plan_cache
        cache.invalidate()
        with Peak(self.device) as peak:
            t0 = time.perf_counter()
            prepared = cache.prepare(schedule.plans)
            sync(self.device)
            miss_s = time.perf_counter() - t0
        miss = Span(miss_s, 1, peak.peak_bytes, peak.extra_bytes)
        self.stage_row(task, Stage.PLAN_MISS, miss_s, scale=bytes_scale, span=miss,
                       scaled_to=f"{RELEASED_BLOCKS} blocks (x{bytes_scale:.2f} AdaLN bytes)",
                       floor_s=adaln_bytes / (PAGE_CACHE_GBPS * 1e9),
                       floor=f"{adaln_bytes / 1e9:.2f} GB / {PAGE_CACHE_GBPS} GB/s page-cache read",
                       note=f"{prepared.stats.built_plans} plans built, "
                            f"{sum(p.numel() for p in schedule.plans)} rows")
        t0 = time.perf_counter()
        hit = cache.prepare(schedule.plans)
        sync(self.device)
        hit_s = time.perf_counter() - t0
        hit.release()
        self.stage_row(task, Stage.PLAN_HIT, hit_s, scaled_to="(independent of blocks)",
                       note=f"{hit.stats.gpu_hit_plans} plans in the slab")
        return prepared

    def denoise_row(self, task: Task, engine, geometry, schedule, embeds, conditions, prepared):
        from model.denoise import Denoiser

        forwards = self.args.forwards if task.partition is Partition.FL2VA \
            else min(self.args.forwards, self.args.ref2va_forwards)
        text = embeds.to(self.device)
        denoiser = Denoiser(geometry, schedule, text.shape[0], self.device, conditions)
        rig = Rig(engine.transformer, modulation=engine.modulation)
        run_steps(rig, denoiser, text, prepared, range(0, 1), self.device)  # warm-up (and the refiner, once)
        with Peak(self.device) as peak:
            run = run_steps(rig, denoiser, text, prepared, range(1, 1 + forwards), self.device)
        tokens = denoiser.layout.num_tokens
        flops = forward_flops(self.config, self.args.num_blocks, tokens, 0)
        scale = RELEASED_BLOCKS / self.args.num_blocks
        self.stage_row(task, Stage.DENOISE, run.seconds_per_step, scale=scale, span=Span(
            run.seconds_per_step * forwards, forwards, peak.peak_bytes, peak.extra_bytes),
            scaled_to=f"{RELEASED_BLOCKS} blocks (x{scale:.1f})", floor_s=flops / (self.limits.gemm_tflops * 1e12),
            floor="block matmul FLOPs / GEMM rate",
            note=f"{tokens} packed tokens, {flops / 1e12:.1f} TFLOP per forward at {self.args.num_blocks} blocks, "
                 f"{forwards} timed on {engine.checkpoint.transformer_dir.name}/")
        return denoiser

    def decode_rows(self, task: Task, engine, denoiser) -> None:
        from model.mp4 import write_mp4

        video, audio = denoiser.finish(denoiser.initial_latents(0))
        with Peak(self.device) as peak:
            t0 = time.perf_counter()
            frames = engine.video_decoder.decode(video)
            sync(self.device)
            video_s = time.perf_counter() - t0
        self.stage_row(task, Stage.VIDEO_DECODE, video_s, span=Span(video_s, 1, peak.peak_bytes, peak.extra_bytes),
                       note=f"{frames.shape[0]} frames {frames.shape[2]}x{frames.shape[1]}")
        with Peak(self.device) as peak:
            t0 = time.perf_counter()
            waveform = engine.audio_decoder.decode(audio)
            sync(self.device)
            audio_s = time.perf_counter() - t0
        rate = engine.audio_decoder.sample_rate
        self.stage_row(task, Stage.AUDIO_DECODE, audio_s, span=Span(audio_s, 1, peak.peak_bytes, peak.extra_bytes),
                       note=f"{waveform.shape[1] / rate:.2f} s stereo")
        buffer = io.BytesIO()
        t0 = time.perf_counter()
        write_mp4(buffer, frames, 24, waveform, rate)
        mux_s = time.perf_counter() - t0
        self.stage_row(task, Stage.MUX, mux_s, scaled_to="as released (CPU, PyAV libx264)",
                       note=f"H.264 + AAC, {len(buffer.getvalue()) / 1e6:.1f} MB")


if __name__ == "__main__":
    raise SystemExit(main())
