"""Sequence parallel on 1 vs 2 devices: the engine's transformer step (ours and diffusers' own context parallel),
the plan miss, the all-to-all floor and the prompt encode (tensor parallel vs whole).

    python -m bench.parallel --smoke                               # CPU, gloo, tiny checkpoint: seconds
    python -m bench.parallel --num-blocks 8 --workdir /dev/shm/sp  # 2 GPUs (NCCL), h3 width, 8 of the 50 blocks
    python -m bench.parallel ... --profile   # + per rank, ms per step by kernel category (bench.profile)

No Ray: `parallel.launch.launch_local` starts one process per rank; each builds `engine.Engine(config,
group=...)` exactly as a GPU worker actor does (online AdaLN through ExternalModulation + the plan cache,
Cache-DiT and offload off) and runs the engine's denoising loop (`bench.h3.run_steps`) on the same inputs.
Results come back through files in the work directory.

Runs (`RUNS`), one launch each: `sp1` (one device), `sp2` (ours: `parallel.sequence` + the tensor parallel text
encoder, all-to-alls overlapped in `--head-chunks` chunks) and, on GPUs only, `sp2-serial` (ours, every
all-to-all waited at once: what the overlap buys) and `diffusers-sp2`: the one-device engine on each rank with diffusers' own context
parallel applied to its transformer (`enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))`, its
`_cp_plan` for MiniMaxH3Transformer3DModel; `ulysses_anything=True` when a shape's packed length is odd, which
plain Ulysses refuses). diffusers' path has no CPU/gloo support (it takes the rank modulo the accelerator count),
so the smoke run leaves it out.

Per shape (about 7.8k, 37.7k = 5 s 1344x768, 62k tokens) and run:
- step time (one warm-up forward, then `--repeats` timed), speedup over SP1, max |v_SP - v_SP1| of forward 0;
- peak VRAM per rank (torch.cuda.max_memory_allocated over the shape's runs);
- the communication floor: per block each rank sends (P-1)/P of its q, k, v (heads -> sequence) and of its
  attention output (sequence -> heads), i.e. 4 x rows/P x inner_dim x 2 bytes x (P-1)/P; per forward x blocks;
  divided by the all-to-all bandwidth measured in the same run (bytes leaving a rank per second, one 512 MiB
  all-to-all per rank).
Plan miss (ours): a rebuild of every plan of a 50-step schedule (49), second rebuild timed (the first allocates
the staging buffers); SP2 streams 1/2 of the AdaLN units per rank and exchanges the rows.
Text encode: the bench prompt through `engine.prompt_encoder` (one warm-up, then `--repeats` timed): whole on one
device (sp1) vs tensor parallel over 2 (sp2, `parallel.text_encoder`); its parameter bytes per rank and max
|e_TP - e_whole|.

The checkpoint is random bf16 (`bench.checkpoints`) at h3 width with `--num-blocks` blocks; beside it the text
encoder is Qwen3-VL's language model at its released sizes (hidden 5120, 64 / 8 heads, MLP 25600) with
`--text-layers` layers (conditioning read after the last of them), the VAEs the small CPU-test ones (decode is
not measured). The smoke run uses the tiny checkpoint (its text encoder read at hidden_states[2]).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.checkpoints import PRESETS, QWEN3_VL_TEXT, SMALL_COMPONENTS, ComponentSizes, make_random_checkpoint, \
    write_h3_components
from bench.common import write_results
from bench.profile import CATEGORIES, StepProfile
from bench.h3 import H3_SHAPES, PROMPT, RELEASED_BLOCKS, RELEASED_STEPS, SMOKE_PROMPT, SMOKE_SHAPES, Rig, Shape, \
    run_steps, sync

logger = logging.getLogger("bench.parallel")

#: Bytes per rank of the all-to-all whose bandwidth is the floor's denominator (smoke: 4 MiB).
A2A_BYTES = 512 << 20
SMOKE_A2A_BYTES = 4 << 20


@dataclass(frozen=True)
class Run:
    """One launch: `world_size` ranks running `impl`'s sequence parallel ("ours" or "diffusers")."""

    label: str
    world_size: int
    impl: str
    serial: bool = False  # ours: every all-to-all waited at once, one head chunk (no overlap)

    @property
    def gpu_only(self) -> bool:
        return self.impl == "diffusers" or self.serial


RUNS = (Run("sp1", 1, "ours"), Run("sp2", 2, "ours"), Run("sp2-serial", 2, "ours", serial=True),
        Run("diffusers-sp2", 2, "diffusers"))
#: Text encoder layers written for the GPU run (released sizes: ~1 GB each in bf16); smoke reads 2 of the tiny's.
TEXT_LAYERS = 8
SMOKE_TEXT_LAYERS = 2


@dataclass(frozen=True)
class RunSpec:
    """What every rank of one launch does (pickled to the spawned ranks)."""

    checkpoint: str
    device_type: str                 # "cuda" or "cpu"
    shapes: tuple[Shape, ...]
    repeats: int
    smoke: bool
    workdir: str
    a2a_bytes: int
    budget_s: float                  # no new shape is started past this many seconds into the rank's run
    text_layers: int                 # text encoder layers loaded (hidden_states[text_layers] is read)
    head_chunks: int = 2             # ours, overlapped: parallel.a2a_head_chunks
    profile_steps: int = 0           # > 0: after the timed forwards, this many more under torch.profiler


def _allow_engine_import_without_av() -> None:
    """The engine imports PyAV (model.mp4) at module level for the MP4 mux, which this bench never runs; the GPU
    image has no PyAV (a 35 MB wheel), so an empty module stands in for it when it is missing."""
    try:
        import av  # noqa: F401
    except ImportError:
        sys.modules["av"] = types.ModuleType("av")


def _engine_config(spec: RunSpec, world_size: int, run: Run):
    from engine.config import EngineConfig

    return EngineConfig(
        checkpoint=spec.checkpoint, device=spec.device_type, text_encoder={"hidden_state_index": spec.text_layers},
        adaln={"mode": "online", "gpu_plans": 64, "host_cache_gb": 0.05 if spec.smoke else 2.0},
        offload={"enabled": False}, cache_dit={"enabled": False}, pool={"enabled": False},
        parallel={"sp": world_size, "timeout_s": 120.0, "a2a_overlap": not run.serial,
                  "a2a_head_chunks": 1 if run.serial else spec.head_chunks},
        geometry={"short_edge": None, "min_seconds": 0.1} if spec.smoke else None,
    )


def _peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)


def measure_all_to_all(group, nbytes: int) -> float:
    """Bytes leaving this rank per second in one all-to-all of `nbytes` per rank (3 timed after 1 warm-up)."""
    send = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=group.device)
    receive = torch.empty_like(send)
    group.all_to_all(receive, send, host_wait=True)
    sync(group.device)
    reps = 3
    t0 = time.perf_counter()
    for _ in range(reps):
        group.all_to_all(receive, send)
    sync(group.device)
    seconds = (time.perf_counter() - t0) / reps
    return nbytes * (group.world_size - 1) / group.world_size / seconds


def time_text_encode(engine, prompt: str, repeats: int, device: torch.device) -> dict:
    """Seconds per encode of `prompt` (one warm-up), the encoder's parameter bytes on this rank, the embedding."""
    encoder = engine.prompt_encoder
    embedding = encoder.encode(prompt)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        encoder.encode(prompt)
    sync(device)
    param_bytes = sum(p.numel() * p.element_size() for p in encoder._model.parameters())
    return {"seconds": (time.perf_counter() - t0) / repeats, "tokens": embedding.shape[0],
            "layers": encoder.num_loaded_layers, "param_bytes": param_bytes,
            "split": encoder.split.label if encoder.split is not None else "whole", "embedding": embedding}


def enable_diffusers_context_parallel(transformer, world_size: int, tokens: list[int]) -> bool:
    """diffusers' own Ulysses on `transformer` (its `_cp_plan`); True when `ulysses_anything` was needed (a packed
    length not divisible by the degree)."""
    from diffusers import ContextParallelConfig

    anything = any(n % world_size for n in tokens)
    transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world_size, ulysses_anything=anything))
    return anything


def rank_main(rank: int, world_size: int, init_method: str, spec: RunSpec, run: Run) -> None:
    """One rank of `run`: load the engine, time the plan miss (ours) and the text encode, run every shape; write
    rank<r>-<run.label>.json (and rank 0 the first forward's velocity per shape and the text embedding)."""
    _allow_engine_import_without_av()
    from engine.engine import Engine
    from model.denoise import Denoiser
    from model.geometry import GeometryLimits, VideoGeometry
    from model.schedule import H3Schedule
    from parallel.group import init_group

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s sp{world_size} r{rank} %(message)s")
    for noisy in ("cache_dit", "diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    start = time.monotonic()
    device = torch.device(f"cuda:{rank}") if spec.device_type == "cuda" else torch.device("cpu")
    group = None
    if world_size > 1:
        group = init_group(rank, world_size, init_method, device, timeout_s=120.0)
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    out = Path(spec.workdir)
    result: dict = {"rank": rank, "world_size": world_size, "impl": run.impl, "shapes": []}

    def save() -> None:
        (out / f"rank{rank}-{run.label}.json").write_text(json.dumps(result, indent=1))

    ours = run.impl == "ours"
    t0 = time.perf_counter()
    # diffusers' context parallel wraps a one-device engine's transformer; its group is only torch's default one.
    engine = Engine(_engine_config(spec, world_size if ours else 1, run), group=group if ours else None)
    result["load_s"] = round(time.perf_counter() - t0, 2)
    if group is not None and ours:
        result["all_to_all_GBps"] = measure_all_to_all(group, spec.a2a_bytes) / 1e9

    schedule = H3Schedule.build(RELEASED_STEPS)
    cache = engine.plan_cache
    cache.prepare(schedule.plans).release()
    if ours:  # Plan miss: every plan of a 50-step schedule rebuilt (the first rebuild also allocated buffers).
        cache.invalidate()
        sync(device)
        t0 = time.perf_counter()
    prepared = cache.prepare(schedule.plans)
    if ours:
        sync(device)
        result["plan_miss_s"] = time.perf_counter() - t0
        result["built_plans"] = prepared.stats.built_plans
    save()

    encoded = time_text_encode(engine, SMOKE_PROMPT if spec.smoke else PROMPT, spec.repeats, device)
    text = encoded.pop("embedding").to(device)
    result["text_encode"] = encoded
    if rank == 0:
        torch.save(text.cpu(), out / f"text-{run.label}.pt")
    reference_text = out / "text-sp1.pt"
    if run.label != "sp1" and reference_text.is_file():  # the steps of every run see SP1's text rows
        text = torch.load(reference_text).to(device)
    limits = GeometryLimits(short_edge=None, max_pixels=4096 * 4096, min_seconds=0.1, max_seconds=60.0)
    geometries = {shape.label: VideoGeometry.from_frames(shape.width, shape.height, shape.frames, limits)
                  for shape in spec.shapes}
    if not ours:
        try:
            result["ulysses_anything"] = enable_diffusers_context_parallel(
                engine.transformer, world_size, [g.num_tokens(text.shape[0]) for g in geometries.values()])
        except Exception as exc:  # noqa: BLE001 - recorded in the table; our runs stand on their own
            result["error"] = f"enable_parallelism: {type(exc).__name__}: {exc}"
            save()
            prepared.release()
            group.destroy()
            return
    save()
    rig = Rig(engine.transformer, modulation=engine.modulation, sequence_parallel=engine.sequence_parallel)
    for shape in spec.shapes:
        if time.monotonic() - start > spec.budget_s:
            result["shapes"].append({"label": shape.label, "skipped": "out of time budget"})
            save()
            continue
        geometry = geometries[shape.label]
        denoiser = Denoiser(geometry, schedule, text.shape[0], device)
        _reset_peak(device)
        try:
            first = run_steps(rig, denoiser, text, prepared, range(0, 1), device, keep_velocity=True)
            timed = run_steps(rig, denoiser, text, prepared, range(1, 1 + spec.repeats), device)
        except Exception as exc:  # noqa: BLE001 - diffusers' path only: recorded, the other runs stand
            if ours:
                raise
            result["shapes"].append({"label": shape.label, "skipped": f"{type(exc).__name__}: {exc}"[:300]})
            save()
            break  # a rank that failed mid-collective leaves the group unusable
        if rank == 0:
            torch.save(first.velocity.float().cpu(), out / f"velocity-{run.label}-{shape.label}.pt")
        entry = {"label": shape.label, "tokens": geometry.num_tokens(text.shape[0]),
                 "seconds_per_step": timed.seconds_per_step, "peak_GiB": _peak_gib(device)}
        if spec.profile_steps and ours:  # the next forwards of the same schedule, profiled
            after = 1 + spec.repeats
            with StepProfile(device) as profile:
                run_steps(rig, denoiser, text, prepared, range(after, after + spec.profile_steps), device)
            entry["profile"] = profile.breakdown(spec.profile_steps)
        result["shapes"].append(entry)
        save()
    prepared.release()
    if group is not None:
        if not any("skipped" in entry for entry in result["shapes"]):  # after a failed collective: no barrier
            group.barrier()
        group.destroy()


def _components(config) -> ComponentSizes:
    """Qwen3-VL's language model at its released sizes (as wide as the transformer's text input), the small test
    VAEs."""
    return ComponentSizes(text={**QWEN3_VL_TEXT, "hidden_size": config.text_dim},
                          video_vae=SMALL_COMPONENTS.video_vae, audio_vae=SMALL_COMPONENTS.audio_vae)


def write_checkpoint(root: Path, smoke: bool, num_blocks: int, text_layers: int, device: torch.device
                     ) -> tuple[Path, object]:
    if smoke:
        from model.tiny import TINY_TRANSFORMER, make_tiny_checkpoint

        if not (root / "model_index.json").exists():
            make_tiny_checkpoint(root, "diffusers", seed=0)
        return root, TINY_TRANSFORMER
    config = PRESETS["h3"].model_copy(update={"num_layers": num_blocks})
    if not (root / "model_index.json").exists():
        make_random_checkpoint(root, config, "diffusers", seed=0, workers=8, device=device)
        # one layer more than is read: hidden_states[text_layers] must be a layer output, not the final norm's
        write_h3_components(root, "diffusers", 0, text_layers=text_layers + 1, device=device,
                            sizes=_components(config))
    return root, config


def main(argv: list[str] | None = None) -> int:
    from parallel.launch import launch_local

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny checkpoint: seconds")
    ap.add_argument("--num-blocks", type=int, default=8, help="transformer blocks at h3 width (ignored by --smoke)")
    ap.add_argument("--shapes", default=None, help="comma-separated shape labels (default: all)")
    ap.add_argument("--repeats", type=int, default=None, help="timed forwards after one warm-up (default 3; smoke 1)")
    ap.add_argument("--workdir", default=None, help="checkpoint and rank results (default: a temp dir; GPU: /dev/shm)")
    ap.add_argument("--budget-s", type=float, default=None, help="per launch: no shape is started after this")
    ap.add_argument("--text-layers", type=int, default=TEXT_LAYERS,
                    help="text encoder layers at released size (ignored by --smoke)")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    ap.add_argument("--head-chunks", type=int, default=2,
                    help="sp2 (overlapped): head chunks per rank (engine parallel.a2a_head_chunks)")
    ap.add_argument("--profile", action="store_true",
                    help="after each shape's timed forwards, profile --profile-steps more per rank (ours) and "
                    "write parallel-profile-<device> (ms per step by category: gemm, attention, comm, other, idle)")
    ap.add_argument("--runs", type=lambda text: tuple(text.split(",")), default=None,
                    help=f"comma-separated runs of {','.join(run.label for run in RUNS)} (default: all; sp1 is "
                         "every speedup's baseline)")
    ap.add_argument("--profile-steps", type=int, default=2, help="forwards profiled per shape with --profile")
    args = ap.parse_args(argv)
    labels = {run.label for run in RUNS}
    if args.runs is not None and (not set(args.runs) <= labels or "sp1" not in args.runs):
        ap.error(f"--runs {','.join(args.runs)}: choose from {sorted(labels)}, sp1 included (the baseline)")
    command = "python -m bench.parallel " + shlex.join(argv if argv is not None else sys.argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    _allow_engine_import_without_av()

    smoke = args.smoke
    on_gpu = torch.cuda.is_available() and not smoke
    if not smoke and torch.cuda.device_count() < 2:
        raise SystemExit(f"bench.parallel needs 2 CUDA devices (found {torch.cuda.device_count()}); use --smoke on CPU")
    shapes = SMOKE_SHAPES[:2] if smoke else H3_SHAPES
    if args.shapes:
        shapes = tuple(s for s in shapes if s.label in args.shapes.split(","))
    tmp = None
    base = "/dev/shm" if on_gpu and Path("/dev/shm").is_dir() else None
    workdir = Path(args.workdir) if args.workdir else Path(tmp := tempfile.mkdtemp(prefix="bench-parallel-", dir=base))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        text_layers = SMOKE_TEXT_LAYERS if smoke else args.text_layers
        # named by what it holds: a work directory reused with other sizes gets a checkpoint of its own
        name = "ckpt-tiny" if smoke else f"ckpt-h3-{args.num_blocks}blocks-{text_layers}text"
        root, config = write_checkpoint(workdir / name, smoke, args.num_blocks, text_layers,
                                        torch.device("cuda:0" if on_gpu else "cpu"))
        checkpoint_s = time.perf_counter() - t0
        num_blocks = config.num_layers
        spec = RunSpec(checkpoint=str(root), device_type="cuda" if on_gpu else "cpu", shapes=tuple(shapes),
                       repeats=args.repeats or (1 if smoke else 3), smoke=smoke, workdir=str(workdir),
                       a2a_bytes=SMOKE_A2A_BYTES if smoke else A2A_BYTES,
                       budget_s=args.budget_s or (120.0 if smoke else 150.0), text_layers=text_layers,
                       head_chunks=args.head_chunks, profile_steps=args.profile_steps if args.profile else 0)
        from bench.parallel import rank_main as target  # by module name: spawned ranks import it again

        runs = tuple(run for run in RUNS if (on_gpu or not run.gpu_only)  # diffusers' CP: accelerators only
                     and (args.runs is None or run.label in args.runs))
        launches = {}
        for run in runs:
            t0 = time.perf_counter()
            exits = launch_local(target, run.world_size, workdir, args=(spec, run), deadline_s=600.0)
            launches[run.label] = {"seconds": round(time.perf_counter() - t0, 1), "exits": [e.exitcode for e in exits]}
            logger.info("%s launch: %s", run.label, launches[run.label])
        rows, notes = assemble(workdir, config, num_blocks, spec, runs, launches, checkpoint_s)
        profile_rows = assemble_profiles(workdir, spec, runs)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    tag = "smoke-cpu" if smoke else f"nvidia-h200-x{torch.cuda.device_count()}" \
        if "H200" in torch.cuda.get_device_name(0) else "cuda-x2"
    md, _ = write_results("parallel", rows, device=tag, command=command, notes=notes, out_dir=args.out)
    print(md.read_text())
    if spec.profile_steps:
        md, _ = write_results("parallel-profile", profile_rows, device=tag, command=command,
                              notes=profile_notes(spec), out_dir=args.out)
        print(md.read_text())
    return 0 if all(code == 0 for launch in launches.values() for code in launch["exits"]) else 1


def profile_notes(spec: RunSpec) -> list[str]:
    return [
        f"{spec.profile_steps} forwards per shape and run under torch.profiler, after the timed ones; ms per step, "
        "one row per rank",
        "cuda: the rank's kernels by name (bench.profile.category_of): gemm, attention, comm (nccl), other "
        "(elementwise, norms, copies, index ops); categories can overlap (an all-to-all beside a GEMM), so "
        "busy = time any kernel ran, idle = window - busy (host-bound gaps, waits on the peer), comm_exposed = "
        "time only communication ran (what overlap did not hide); window = first kernel start to last kernel end"
        if spec.device_type == "cuda" else
        "cpu (degraded): host leaf ops on every thread by their nearest categorised ancestor; idle = host time "
        "in no op (Python); gloo's threads count as comm",
        "runs: sp2 = overlapped exchange in --head-chunks chunks; sp2-serial (GPU only) = every all-to-all "
        "waited at once, one chunk",
        "ours: no host wait per forward (the output gathers are checked on the host one forward late, "
        "SequenceParallel.settle at the end of each timed run); every run (sp1 too) refines the prompt once per "
        "shape (model.text_memo), so the timed forwards do not run the token refiner",
    ]


def assemble_profiles(workdir: Path, spec: RunSpec, runs: tuple[Run, ...]) -> list[dict]:
    """One row per shape, profiled run and rank (ms per step by category), from the ranks' files."""
    rows = []
    for shape in spec.shapes:
        for run in runs:
            for rank in range(run.world_size):
                info = _read(workdir / f"rank{rank}-{run.label}.json") or {}
                entry = next((s for s in info.get("shapes", []) if s["label"] == shape.label), None)
                if entry is None or "profile" not in entry:
                    continue
                profile = entry["profile"]
                row = {"shape": shape.label, "run": run.label, "rank": rank, "tokens": entry["tokens"],
                       "ms_per_step": profile["window_ms"]}
                row.update({f"{c}_ms": profile[f"{c}_ms"] for c in CATEGORIES})
                row.update({key: profile[key] for key in ("busy_ms", "idle_ms", "comm_exposed_ms")})
                rows.append(row)
    return rows


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def assemble(workdir: Path, config, num_blocks: int, spec: RunSpec, runs: tuple[Run, ...], launches: dict,
             checkpoint_s: float) -> tuple[list[dict], list[str]]:
    """The table rows (per shape and run, then the plan miss and the text encode per run) and notes, from the
    ranks' files."""
    ranks = {(run.label, r): _read(workdir / f"rank{r}-{run.label}.json") for run in runs for r in range(run.world_size)}
    bandwidth = (ranks.get(("sp2", 0)) or {}).get("all_to_all_GBps")
    inner, hidden = config.inner_dim, config.hidden_size
    notes = [
        f"model: MiniMax-H3 architecture (diffusers MiniMaxH3Transformer3DModel), hidden {hidden}, inner {inner}, "
        f"{num_blocks} of {RELEASED_BLOCKS} blocks, random bf16; text encoder: Qwen3-VL language model at released "
        f"sizes, {spec.text_layers} layers (hidden_states[{spec.text_layers}] read); small VAEs (not measured)"
        if not spec.smoke else "smoke: tiny checkpoint on CPU with gloo; timings are not meaningful",
        "runs: sp1 = one device; sp2 = ours (engine.Engine(config, group=SpGroup) per rank: parallel.sequence, text "
        f"encoder tensor parallel; attention all-to-alls overlapped with compute, {spec.head_chunks} head chunks "
        "per rank); sp2-serial = ours with every all-to-all waited at once, one chunk; diffusers-sp2 = the "
        "one-device engine per rank with diffusers' enable_parallelism(ContextParallelConfig(ulysses_degree=2)) "
        "on its transformer"
        + ("" if any(run.impl == "diffusers" for run in runs)
           else " (not run: diffusers' CP needs accelerators; sp2-serial is GPU-only too)"),
        "engine path: online AdaLN through ExternalModulation + plan cache, Cache-DiT and offload off, the engine's "
        f"loop via bench.h3.run_steps; {spec.repeats} timed forwards after one warm-up; launched with "
        "parallel.launch (no Ray)",
        "max_abs_diff_vs_sp1: max |v - v_SP1| of forward 0's video velocity (seed 0, every run fed SP1's text rows, "
        "so only the transformer's parallelism differs); max_abs_v: max |v_SP1| for scale",
        "comm floor (ours): per block each rank sends 4 x rows/P x inner x 2 B x (P-1)/P (q, k, v heads->sequence, "
        "output sequence->heads); x blocks per forward; / the all-to-all bandwidth measured in the same run "
        f"({bandwidth:.4g} GB/s leaving a rank, one {spec.a2a_bytes >> 20} MiB all-to-all per rank)"
        if bandwidth else "comm floor: no all-to-all bandwidth measured (SP2 did not get that far)",
        "plan miss: rebuild of all 49 plans of a 50-step schedule, second rebuild timed; SP2: each rank streams "
        "1/2 of the AdaLN units, then the ranks exchange rows",
        "text encode: the bench prompt, one warm-up then the timed encodes; split tp2 = parallel.text_encoder over "
        "the 2 ranks (2 all-reduces per layer), whole = every layer on the device; param_MiB per rank; "
        "max_abs_diff_vs_sp1 of the embedding (bf16 rounding of the reordered sums)",
        "peak_GiB_per_rank includes the text encoder's layers (sp2: 1/2 of them per rank)",
        f"checkpoint written in {checkpoint_s:.1f} s; launches: "
        + ", ".join(f"{label} {v['seconds']} s exits {v['exits']}" for label, v in launches.items()),
    ]
    for run in runs:
        for r in range(run.world_size):
            info = ranks[(run.label, r)]
            if info is None:
                notes.append(f"{run.label} rank {r} wrote no results (exit codes {launches[run.label]['exits']})")
            else:
                notes.append(f"{run.label} rank {r}: engine load {info.get('load_s')} s"
                             + (f", ulysses_anything {info['ulysses_anything']}" if "ulysses_anything" in info else "")
                             + (f", error: {info['error']}" if "error" in info else ""))
    one = {run.label: [(ranks[(run.label, r)] or {}) for r in range(run.world_size)] for run in runs}
    rows = []
    for shape in spec.shapes:
        reference_v = workdir / f"velocity-sp1-{shape.label}.pt"
        v1 = torch.load(reference_v) if reference_v.is_file() else None
        sp1_entry = next((s for s in one["sp1"][0].get("shapes", []) if s["label"] == shape.label), None)
        for run in runs:
            p = run.world_size
            entries = [next((s for s in info.get("shapes", []) if s["label"] == shape.label), None)
                       for info in one[run.label]]
            base = {"what": f"step {shape.label}", "run": run.label, "impl": run.impl, "sp": p}
            if any(e is None or "skipped" in e for e in entries):
                why = next((e["skipped"] for e in entries if e is not None and "skipped" in e), None)
                why = why or next((info["error"] for info in one[run.label] if "error" in info), "rank failed")
                rows.append({**base, "note": f"not measured: {why}"})
                continue
            tokens = entries[0]["tokens"]
            step_s = max(e["seconds_per_step"] for e in entries)
            row = {**base, "tokens": tokens, "ms_per_step": round(1e3 * step_s, 2),
                   "ms_at_50_blocks": round(1e3 * step_s * RELEASED_BLOCKS / num_blocks, 1)}
            if sp1_entry is not None and "skipped" not in sp1_entry:
                row["speedup"] = round(sp1_entry["seconds_per_step"] / step_s, 3)
            velocity = workdir / f"velocity-{run.label}-{shape.label}.pt"
            if v1 is not None and velocity.is_file():
                vp = torch.load(velocity)
                row["max_abs_diff_vs_sp1"] = float((vp - v1).abs().max())
                row["max_abs_v"] = round(float(v1.abs().max()), 3)
            row["peak_GiB_per_rank"] = "/".join(str(e["peak_GiB"]) for e in entries)
            if p > 1 and run.impl == "ours":
                comm = 4 * tokens / p * inner * 2 * (p - 1) / p * num_blocks
                row["a2a_MB_per_rank_per_forward"] = comm / 1e6
                if bandwidth:
                    row["comm_floor_ms"] = round(1e3 * comm / (bandwidth * 1e9), 2)
                    row["comm_share_of_step"] = round(comm / (bandwidth * 1e9) / step_s, 3)
            rows.append(row)
    ours = [run for run in runs if run.impl == "ours" and not run.serial]  # serial: same miss and encode
    miss1 = one["sp1"][0].get("plan_miss_s")
    for run in ours:
        misses = [info.get("plan_miss_s") for info in one[run.label]]
        base = {"what": "plan miss (49 plans)", "impl": run.impl, "sp": run.world_size}
        if any(m is None for m in misses):
            rows.append({**base, "note": "not measured: rank failed"})
            continue
        miss = max(misses)
        rows.append({**base, "what": f"plan miss ({one[run.label][0]['built_plans']} plans built)",
                     "miss_s": round(miss, 4), "miss_vs_sp1": round(miss / miss1, 3) if miss1 else None,
                     "note": "per rank " + "/".join(f"{m:.4f}" for m in misses) + " s"})
    text1 = workdir / "text-sp1.pt"
    e1 = torch.load(text1).float() if text1.is_file() else None
    encode1 = one["sp1"][0].get("text_encode")
    for run in ours:
        encodes = [info.get("text_encode") for info in one[run.label]]
        base = {"what": "text encode", "impl": run.impl, "sp": run.world_size}
        if any(e is None for e in encodes):
            rows.append({**base, "note": "not measured: rank failed"})
            continue
        seconds = max(e["seconds"] for e in encodes)
        row = {**base, "tokens": encodes[0]["tokens"], "split": encodes[0]["split"],
               "encode_ms": round(1e3 * seconds, 2),
               "param_MiB_per_rank": "/".join(f"{e['param_bytes'] / 2**20:.4g}" for e in encodes),
               "note": f"{encodes[0]['layers']} layers"}
        if encode1 is not None:
            row["speedup"] = round(encode1["seconds"] / seconds, 3)
        embedding = workdir / f"text-{run.label}.pt"
        if e1 is not None and embedding.is_file():
            row["max_abs_diff_vs_sp1"] = float((torch.load(embedding).float() - e1).abs().max())
            row["max_abs_v"] = round(float(e1.abs().max()), 3)
        rows.append(row)
    return rows, notes


if __name__ == "__main__":
    raise SystemExit(main())
