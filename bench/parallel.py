"""Sequence parallel on 1 vs 2 devices: the engine's transformer step, the plan miss and the all-to-all floor.

    python -m bench.parallel --smoke                               # CPU, gloo, tiny checkpoint: seconds
    python -m bench.parallel --num-blocks 8 --workdir /dev/shm/sp  # 2 GPUs (NCCL), h3 width, 8 of the 50 blocks

No Ray: `parallel.launch.launch_local` starts one process per rank; each builds `engine.Engine(config,
group=...)` exactly as a GPU worker actor does (online AdaLN through ExternalModulation + the plan cache,
Cache-DiT and offload off) and runs the engine's denoising loop (`bench.h3.run_steps`) on the same inputs.
Results come back through files in the work directory.

Per shape (about 7.8k, 37.7k = 5 s 1344x768, 62k tokens) and degree (SP1, SP2):
- step time (one warm-up forward, then `--repeats` timed), speedup over SP1, max |v_SP - v_SP1| of forward 0;
- peak VRAM per rank (torch.cuda.max_memory_allocated over the shape's runs);
- the communication floor: per block each rank sends (P-1)/P of its q, k, v (heads -> sequence) and of its
  attention output (sequence -> heads), i.e. 4 x rows/P x inner_dim x 2 bytes x (P-1)/P; per forward x blocks;
  divided by the all-to-all bandwidth measured in the same run (bytes leaving a rank per second, one 512 MiB
  all-to-all per rank).
Plan miss: a rebuild of every plan of a 50-step schedule (49), second rebuild timed (the first allocates the
staging buffers); SP2 streams 1/2 of the AdaLN units per rank and exchanges the rows.

The checkpoint is random bf16 (`bench.checkpoints`) at h3 width with `--num-blocks` blocks; the components
beside it (text encoder, VAEs) are the small CPU-test ones with the text width set to the transformer's
(prompt encoding and decoding are not measured here).
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

from bench.checkpoints import PRESETS, SMALL_COMPONENTS, ComponentSizes, make_random_checkpoint, write_h3_components
from bench.common import write_results
from bench.h3 import H3_SHAPES, PROMPT, RELEASED_BLOCKS, RELEASED_STEPS, SMOKE_PROMPT, SMOKE_SHAPES, Rig, Shape, \
    run_steps, sync

logger = logging.getLogger("bench.parallel")

#: Bytes per rank of the all-to-all whose bandwidth is the floor's denominator (smoke: 4 MiB).
A2A_BYTES = 512 << 20
SMOKE_A2A_BYTES = 4 << 20


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


def _allow_engine_import_without_av() -> None:
    """The engine imports PyAV (model.mp4) at module level for the MP4 mux, which this bench never runs; the GPU
    image has no PyAV (a 35 MB wheel), so an empty module stands in for it when it is missing."""
    try:
        import av  # noqa: F401
    except ImportError:
        sys.modules["av"] = types.ModuleType("av")


def _engine_config(spec: RunSpec, world_size: int):
    from engine.config import EngineConfig

    return EngineConfig(
        checkpoint=spec.checkpoint, device=spec.device_type, text_encoder={"hidden_state_index": 2},
        adaln={"mode": "online", "gpu_plans": 64, "host_cache_gb": 0.05 if spec.smoke else 2.0},
        offload={"enabled": False}, cache_dit={"enabled": False}, pool={"enabled": False},
        parallel={"sp": world_size, "timeout_s": 120.0},
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


def rank_main(rank: int, world_size: int, init_method: str, spec: RunSpec) -> None:
    """One rank: load the engine, time the plan miss, run every shape; write rank<r>-sp<P>.json (and rank 0 the
    first forward's velocity per shape)."""
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
    result: dict = {"rank": rank, "world_size": world_size, "shapes": []}

    def save() -> None:
        (out / f"rank{rank}-sp{world_size}.json").write_text(json.dumps(result, indent=1))

    t0 = time.perf_counter()
    engine = Engine(_engine_config(spec, world_size), group=group)
    result["load_s"] = round(time.perf_counter() - t0, 2)
    if group is not None:
        result["all_to_all_GBps"] = measure_all_to_all(group, spec.a2a_bytes) / 1e9

    # Plan miss: every plan of a 50-step schedule rebuilt (the first rebuild also allocates staging buffers).
    schedule = H3Schedule.build(RELEASED_STEPS)
    cache = engine.plan_cache
    cache.prepare(schedule.plans).release()
    cache.invalidate()
    sync(device)
    t0 = time.perf_counter()
    prepared = cache.prepare(schedule.plans)
    sync(device)
    result["plan_miss_s"] = time.perf_counter() - t0
    result["built_plans"] = prepared.stats.built_plans
    save()

    text = engine.prompt_encoder.encode(SMOKE_PROMPT if spec.smoke else PROMPT).to(device)
    limits = GeometryLimits(short_edge=None, max_pixels=4096 * 4096, min_seconds=0.1, max_seconds=60.0)
    rig = Rig(engine.transformer, modulation=engine.modulation)
    for shape in spec.shapes:
        if time.monotonic() - start > spec.budget_s:
            result["shapes"].append({"label": shape.label, "skipped": "out of time budget"})
            save()
            continue
        geometry = VideoGeometry.from_frames(shape.width, shape.height, shape.frames, limits)
        denoiser = Denoiser(geometry, schedule, text.shape[0], device)
        _reset_peak(device)
        first = run_steps(rig, denoiser, text, prepared, range(0, 1), device, keep_velocity=True)
        timed = run_steps(rig, denoiser, text, prepared, range(1, 1 + spec.repeats), device)
        if rank == 0:
            torch.save(first.velocity.float().cpu(), out / f"velocity-sp{world_size}-{shape.label}.pt")
        result["shapes"].append({"label": shape.label, "tokens": geometry.num_tokens(text.shape[0]),
                                 "seconds_per_step": timed.seconds_per_step, "peak_GiB": _peak_gib(device)})
        save()
    prepared.release()
    if group is not None:
        group.barrier()
        group.destroy()


def _components(config) -> ComponentSizes:
    """The small test components, with the text encoder as wide as the transformer's text input."""
    return ComponentSizes(text={**SMALL_COMPONENTS.text, "hidden_size": config.text_dim},
                          video_vae=SMALL_COMPONENTS.video_vae, audio_vae=SMALL_COMPONENTS.audio_vae)


def write_checkpoint(root: Path, smoke: bool, num_blocks: int, device: torch.device) -> tuple[Path, object]:
    if smoke:
        from model.tiny import TINY_TRANSFORMER, make_tiny_checkpoint

        if not (root / "model_index.json").exists():
            make_tiny_checkpoint(root, "diffusers", seed=0)
        return root, TINY_TRANSFORMER
    config = PRESETS["h3"].model_copy(update={"num_layers": num_blocks})
    if not (root / "model_index.json").exists():
        make_random_checkpoint(root, config, "diffusers", seed=0, workers=8, device=device)
        write_h3_components(root, "diffusers", 0, text_layers=3, device=device, sizes=_components(config))
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
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args(argv)
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
        root, config = write_checkpoint(workdir / "ckpt", smoke, args.num_blocks, torch.device("cuda:0" if on_gpu
                                                                                               else "cpu"))
        checkpoint_s = time.perf_counter() - t0
        num_blocks = config.num_layers
        spec = RunSpec(checkpoint=str(root), device_type="cuda" if on_gpu else "cpu", shapes=tuple(shapes),
                       repeats=args.repeats or (1 if smoke else 3), smoke=smoke, workdir=str(workdir),
                       a2a_bytes=SMOKE_A2A_BYTES if smoke else A2A_BYTES,
                       budget_s=args.budget_s or (120.0 if smoke else 150.0))
        from bench.parallel import rank_main as target  # by module name: spawned ranks import it again

        launches = {}
        for world_size in (1, 2):
            t0 = time.perf_counter()
            exits = launch_local(target, world_size, workdir, args=(spec,), deadline_s=600.0)
            launches[world_size] = {"seconds": round(time.perf_counter() - t0, 1),
                                    "exits": [e.exitcode for e in exits]}
            logger.info("sp%d launch: %s", world_size, launches[world_size])
        rows, notes = assemble(workdir, config, num_blocks, spec, launches, checkpoint_s)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    tag = "smoke-cpu" if smoke else f"nvidia-h200-x{torch.cuda.device_count()}" \
        if "H200" in torch.cuda.get_device_name(0) else "cuda-x2"
    md, _ = write_results("parallel", rows, device=tag, command=command, notes=notes, out_dir=args.out)
    print(md.read_text())
    return 0 if all(code == 0 for launch in launches.values() for code in launch["exits"]) else 1


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def assemble(workdir: Path, config, num_blocks: int, spec: RunSpec, launches: dict, checkpoint_s: float
             ) -> tuple[list[dict], list[str]]:
    """The table rows (per shape and degree, then the plan miss per degree) and notes, from the ranks' files."""
    ranks = {(p, r): _read(workdir / f"rank{r}-sp{p}.json") for p in (1, 2) for r in range(p)}
    bandwidth = (ranks[(2, 0)] or {}).get("all_to_all_GBps")
    inner, hidden = config.inner_dim, config.hidden_size
    notes = [
        f"model: MiniMax-H3 architecture (diffusers MiniMaxH3Transformer3DModel), hidden {hidden}, inner {inner}, "
        f"{num_blocks} of {RELEASED_BLOCKS} blocks, random bf16; small components (not measured)"
        if not spec.smoke else "smoke: tiny checkpoint on CPU with gloo; timings are not meaningful",
        "engine path: engine.Engine(config, group=SpGroup) per rank (online AdaLN through ExternalModulation + "
        f"plan cache, Cache-DiT and offload off), the engine's loop via bench.h3.run_steps; {spec.repeats} timed "
        "forwards after one warm-up; launched with parallel.launch (no Ray)",
        "max_abs_diff_vs_sp1: max |v - v_SP1| of forward 0's video velocity (seed 0, same text rows); "
        "max_abs_v: max |v_SP1| for scale",
        "comm floor: per block each rank sends 4 x rows/P x inner x 2 B x (P-1)/P (q, k, v heads->sequence, output "
        "sequence->heads); x blocks per forward; / the all-to-all bandwidth measured in the same run "
        f"({bandwidth:.4g} GB/s leaving a rank, one {spec.a2a_bytes >> 20} MiB all-to-all per rank)"
        if bandwidth else "comm floor: no all-to-all bandwidth measured (SP2 did not get that far)",
        "plan miss: rebuild of all 49 plans of a 50-step schedule, second rebuild timed; SP2: each rank streams "
        "1/2 of the AdaLN units, then the ranks exchange rows",
        f"checkpoint written in {checkpoint_s:.1f} s; launches: "
        + ", ".join(f"SP{p} {v['seconds']} s exits {v['exits']}" for p, v in launches.items()),
    ]
    for p in (1, 2):
        for r in range(p):
            info = ranks[(p, r)]
            if info is None:
                notes.append(f"SP{p} rank {r} wrote no results (exit codes {launches[p]['exits']})")
            else:
                notes.append(f"SP{p} rank {r}: engine load {info.get('load_s')} s")
    rows = []
    for shape in spec.shapes:
        per_degree = {}
        for p in (1, 2):
            entries = [next((s for s in (ranks[(p, r)] or {}).get("shapes", []) if s["label"] == shape.label), None)
                       for r in range(p)]
            per_degree[p] = entries
        reference_v = workdir / f"velocity-sp1-{shape.label}.pt"
        v1 = torch.load(reference_v) if reference_v.is_file() else None
        for p in (1, 2):
            entries = per_degree[p]
            if any(e is None or "skipped" in e for e in entries):
                why = next((e["skipped"] for e in entries if e is not None and "skipped" in e), "rank failed")
                rows.append({"what": f"step {shape.label}", "sp": p, "note": f"not measured: {why}"})
                continue
            tokens = entries[0]["tokens"]
            step_s = max(e["seconds_per_step"] for e in entries)
            row = {"what": f"step {shape.label}", "tokens": tokens, "sp": p, "ms_per_step": round(1e3 * step_s, 2),
                   "ms_at_50_blocks": round(1e3 * step_s * RELEASED_BLOCKS / num_blocks, 1)}
            one = per_degree[1][0]
            if one is not None and "skipped" not in one:
                row["speedup"] = round(one["seconds_per_step"] / step_s, 3)
            velocity = workdir / f"velocity-sp{p}-{shape.label}.pt"
            if v1 is not None and velocity.is_file():
                vp = torch.load(velocity)
                row["max_abs_diff_vs_sp1"] = float((vp - v1).abs().max())
                row["max_abs_v"] = round(float(v1.abs().max()), 3)
            row["peak_GiB_per_rank"] = "/".join(str(e["peak_GiB"]) for e in entries)
            if p > 1:
                comm = 4 * tokens / p * inner * 2 * (p - 1) / p * num_blocks
                row["a2a_MB_per_rank_per_forward"] = comm / 1e6
                if bandwidth:
                    row["comm_floor_ms"] = round(1e3 * comm / (bandwidth * 1e9), 2)
                    row["comm_share_of_step"] = round(comm / (bandwidth * 1e9) / step_s, 3)
            rows.append(row)
    miss1 = (ranks[(1, 0)] or {}).get("plan_miss_s")
    for p in (1, 2):
        misses = [(ranks[(p, r)] or {}).get("plan_miss_s") for r in range(p)]
        if any(m is None for m in misses):
            rows.append({"what": "plan miss (49 plans)", "sp": p, "note": "not measured: rank failed"})
            continue
        miss = max(misses)
        rows.append({"what": f"plan miss ({ranks[(p, 0)]['built_plans']} plans built)", "sp": p,
                     "ms_per_step": None, "miss_s": round(miss, 4),
                     "miss_vs_sp1": round(miss / miss1, 3) if miss1 else None,
                     "note": "per rank " + "/".join(f"{m:.4f}" for m in misses) + " s"})
    return rows, notes


if __name__ == "__main__":
    raise SystemExit(main())
