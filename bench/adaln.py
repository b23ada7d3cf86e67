"""AdaLN plan cache benchmark: resident vs online (miss from page cache / cold disk, host hit, GPU hit) and
two alternating schedules, side by side in one run, with bit-exactness checked against resident.

    python -m bench.adaln                      # H200: h3 AdaLN scale (50 blocks + final, 49 plans of width 2)
    python -m bench.adaln --smoke              # CPU or GPU, tiny width, seconds
    python -m bench.adaln --checkpoint DIR     # reuse an AdaLN checkpoint (else one is made with --only adaln)

The model is diffusers' `MiniMaxH3Transformer3DModel` (seen by the cache as `model.adaln.H3Adaln`) built on the
meta device with only what the AdaLN path needs made real: the timestep MLP (its input) and, for resident mode,
every `transformer_blocks.{i}.adaln_proj.linear` and `norm_out.linear`. The checkpoint is a random one of the
real architecture holding just those tensors (`bench.checkpoints.make_random_checkpoint(..., only="adaln")`:
26.1 GB at h3 scale), read by `model.weights.TransformerWeights` exactly as a full checkpoint is. Plans are
the H3 scheduler's (t2va: video shift 12 / audio shift 3, and 6 / 3 for the second schedule).

Writes bench/results/adaln-<device>.md and .json (git commit, device, command, table). The limits the
ratios refer to (shared/reference.md, H200): pinned H2D 54.9 GB/s, 16-thread page-cache read 39.3 GB/s,
cold disk 1.96 GB/s; sglang's measured online rebuild 8.46 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from accelerate import init_empty_weights
from diffusers import MiniMaxH3Transformer3DModel

from bench.checkpoints import ADALN_INPUT_PREFIX, PRESETS, make_random_checkpoint
from bench.common import git_commit
from cache.config import AdalnConfig
from cache.plan_cache import PlanCache, ResidentModulation
from cache.rebuild import AdalnRebuilder, _Files, resolve_adaln_units
from model.layout import H3Checkpoint
from model.schedule import H3Schedule
from model.weights import TransformerWeights, adaln_unit_names, is_adaln_param

LIMITS = {"h2d_gbps": 54.9, "page_cache_read_gbps": 39.3, "cold_disk_gbps": 1.96, "sglang_rebuild_s": 8.46,
          "target_page_cache_s": 1.0, "target_cold_ratio": 1.1}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def adaln_model(weights: TransformerWeights, device: torch.device, with_adaln: bool) -> MiniMaxH3Transformer3DModel:
    """diffusers' H3 transformer with only the AdaLN path real: the timestep MLP (fp32) and, `with_adaln`,
    the projections (bf16). Everything else stays on the meta device (h3's 33 B parameters are never
    allocated), in the blocks' dtype, so the cache sees the published AdaLN dtype."""
    with init_empty_weights(include_buffers=False):
        model = MiniMaxH3Transformer3DModel.from_config(weights.config.model_dump())
    model.transformer_blocks.to(weights.config.torch_dtype)  # adaln_dtype() asks the (meta) blocks
    modules = dict(model.named_modules())
    for name in weights.names():
        if name.startswith(ADALN_INPUT_PREFIX) or (with_adaln and is_adaln_param(name)):
            module_name, _, leaf = name.rpartition(".")
            modules[module_name].register_parameter(
                leaf, torch.nn.Parameter(weights.tensor(name, device), requires_grad=False))
    return model.eval()


def two_schedules(steps: int, width: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two H3 schedules' `width`-wide plans (dropping step 0, where video and audio sigma are both 1.0)."""
    out = []
    for video_shift in (12.0, 6.0):
        plans = H3Schedule.build(steps, video_shift, 3.0).plans
        out.append([p for p in plans if p.numel() == width])
    return out[0], out[1]


def drop_page_cache(paths: list[str], system_wide: bool) -> str:
    """Evict the checkpoint from the page cache: posix_fadvise(DONTNEED) on its shards, then (full runs on a
    dedicated machine only) `echo 3 > /proc/sys/vm/drop_caches`. Returns what worked."""
    os.sync()  # dirty pages cannot be dropped
    done = []
    try:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        done.append("posix_fadvise(DONTNEED)")
    except OSError as e:
        done.append(f"fadvise failed ({e.strerror})")
    if system_wide:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            done.append("drop_caches")
        except OSError as e:
            done.append(f"drop_caches refused ({e.strerror})")
    return "; ".join(done)


def read_only_pass(rebuilder: AdalnRebuilder, units) -> float:
    """Seconds for the rebuild's readers alone to pull every unit into staging (no H2D, no GEMM), with the
    next units queued as in the rebuild."""
    rebuilder.reserve(max(u.staging_bytes for u in units))
    files = _Files(rebuilder.direct_io)
    S = rebuilder.num_buffers
    start = time.perf_counter()
    pending = {i: rebuilder._submit_read(units[i], i % S, files) for i in range(min(S, len(units)))}
    for i in range(len(units)):
        for f in pending.pop(i):
            f.result()
        if i + S < len(units):
            pending[i + S] = rebuilder._submit_read(units[i + S], i % S, files)
    seconds = time.perf_counter() - start
    files.close()
    return seconds


def check_equal(prepared, reference: ResidentModulation, plans: list[torch.Tensor]) -> bool:
    expected = reference.prepare(plans)
    for i in range(len(plans)):
        got, want = prepared.modulation(i), expected.modulation(i)
        if not (torch.equal(got.blocks, want.blocks) and torch.equal(got.final, want.final)):
            return False
    return True


def timed_prepare(cache: PlanCache, plans, device) -> tuple[float, object]:
    sync(device)
    start = time.perf_counter()
    prepared = cache.prepare(plans)
    sync(device)  # host-tier H2D and GEMMs are async: count them
    return time.perf_counter() - start, prepared


def component_tiers(reader: TransformerWeights, plans: list[torch.Tensor], device: torch.device, config: AdalnConfig,
                    shards: list[str], *, cold: bool = True) -> dict[str, dict]:
    """This benchmark's tier measurements for one schedule's `plans` on `reader`'s checkpoint, with `config`'s
    rebuild settings (the served engine's): `miss_page_cache` (after an untimed miss that warms the page cache
    and the cache's buffers), `gpu_hit`, `host_hit` (slab emptied, every plan from the pinned tier),
    `miss_cold` (after POSIX_FADV_DONTNEED on `shards`). Each: {"seconds", "bytes", "plans", ...}. What
    `bench.app` puts beside the served numbers, in the same process."""
    model = adaln_model(reader, device, with_adaln=False)
    num_plans = len({p.numpy().tobytes() for p in plans})
    dims = reader.config
    rows = sum(p.numel() for p in {p.numpy().tobytes(): p for p in plans}.values())
    host_gb = rows * (dims.num_blocks * dims.adaln_width + dims.final_adaln_width) * 2 / 1e9 * 1.05
    cache = PlanCache(config.model_copy(update={"gpu_plans": max(config.gpu_plans, num_plans), "host_cache_gb": host_gb}),
                      reader, model, device)
    cache.warm_up()
    out: dict[str, dict] = {}
    try:
        _, prepared = timed_prepare(cache, plans, device)  # untimed: page cache and buffers warm
        prepared.release()
        cache.invalidate()
        seconds, prepared = timed_prepare(cache, plans, device)
        stats = prepared.stats
        out["miss_page_cache"] = {"seconds": seconds, "bytes": stats.rebuild_bytes_read, "plans": stats.built_plans,
                                  "page_cache_bytes": stats.page_cache_bytes, "disk_bytes": stats.disk_bytes}
        prepared.release()
        seconds, prepared = timed_prepare(cache, plans, device)
        out["gpu_hit"] = {"seconds": seconds, "bytes": 0, "plans": prepared.stats.gpu_hit_plans}
        prepared.release()
        cache.host.synchronize()
        cache.slab.index.invalidate()
        seconds, prepared = timed_prepare(cache, plans, device)
        out["host_hit"] = {"seconds": seconds, "bytes": prepared.stats.h2d_bytes, "plans": prepared.stats.host_hit_plans}
        prepared.release()
        if cold:
            cache.invalidate()
            how = drop_page_cache(shards, system_wide=False)
            seconds, prepared = timed_prepare(cache, plans, device)
            stats = prepared.stats
            out["miss_cold"] = {"seconds": seconds, "bytes": stats.rebuild_bytes_read, "plans": stats.built_plans,
                                "page_cache_bytes": stats.page_cache_bytes, "disk_bytes": stats.disk_bytes,
                                "dropped": how}
            prepared.release()
    finally:
        cache.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny width, a few seconds, CPU is fine")
    ap.add_argument("--num-blocks", type=int, default=None, help="blocks of the AdaLN checkpoint (h3: 50, smoke: 4)")
    ap.add_argument("--layout", choices=["diffusers", "native"], default="diffusers")
    ap.add_argument("--make-device", default=None, help="where a new checkpoint's values are drawn (default: --device)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--checkpoint", default=None, help="AdaLN checkpoint dir (made with --only adaln if absent)")
    ap.add_argument("--steps", type=int, default=50, help="steps per schedule (plans = steps-1 of width 2)")
    ap.add_argument("--readers", type=int, default=16)
    ap.add_argument("--read-chunk-mb", type=int, default=AdalnConfig().read_chunk_mb)
    ap.add_argument("--repeats", type=int, default=2, help="timed repeats of the page-cache rebuild")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-disk rebuild")
    ap.add_argument("--quick", action="store_true",
                    help="no reader / chunk / buffer sweeps and only the direct_io=auto cold rebuild (a short GPU run)")
    ap.add_argument("--out", default="bench/results", help="folder for adaln-<device>.md/.json")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    name = "tiny" if args.smoke else "h3"
    config = PRESETS[name].model_copy(update={"num_layers": args.num_blocks or (4 if args.smoke else 50)})
    log = lambda *a: print(*a, flush=True)  # noqa: E731

    tmp = None
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    made_s = None
    if ckpt is None or not (ckpt / "model_index.json").exists() and not (ckpt / "FL2VA").is_dir():
        if ckpt is None:
            tmp = tempfile.TemporaryDirectory(prefix="adaln-bench-")
            ckpt = Path(tmp.name) / "ckpt"
        log(f"making {name} AdaLN checkpoint in {ckpt} ...")
        start = time.perf_counter()
        make_random_checkpoint(ckpt, config, args.layout, seed=0, only="adaln", workers=args.readers,
                               device=args.make_device or device)
        made_s = time.perf_counter() - start
    checkpoint = H3Checkpoint.open(ckpt)
    reader = TransformerWeights(checkpoint.transformer_dir, checkpoint.layout)
    config = reader.config
    units = resolve_adaln_units(reader, config, adaln_unit_names(config.num_blocks))
    adaln_bytes = sum(u.nbytes for u in units)
    shards = sorted({u.weight.path for u in units})
    log(f"checkpoint {ckpt}: {adaln_bytes / 1e9:.2f} GB of adaln_proj in {len(units)} units"
        + (f" (made in {made_s:.1f} s)" if made_s else ""))

    plans_a, plans_b = two_schedules(args.steps, 2)
    n_plans = len(plans_a)
    base = dict(readers=args.readers, read_chunk_mb=args.read_chunk_mb, plan_width=2)
    online_model = adaln_model(reader, device, with_adaln=False)
    rows: list[dict] = []
    exact: dict[str, bool] = {}

    def add(scenario: str, seconds: float, gbytes: float | None = None, limit_gbps: float | None = None,
            note: str = "") -> None:
        row = {"scenario": scenario, "seconds": round(seconds, 4)}
        if gbytes is not None and seconds > 0:
            row["GB"] = round(gbytes, 3)
            row["GB/s"] = round(gbytes / seconds, 2)
            if limit_gbps:
                floor = gbytes / limit_gbps
                row["floor_s"] = round(floor, 4)
                row["x_floor"] = round(seconds / floor, 2)
        row["note"] = note
        rows.append(row)
        log(f"  {scenario}: {seconds:.4f} s {note}")

    # 1. Online miss from the page cache (make_checkpoint just wrote it; a read pass keeps it warm).
    cache = PlanCache(AdalnConfig(**base, gpu_plans=64, host_cache_gb=0), reader, online_model, device)
    sweep = [(args.readers, args.read_chunk_mb)]
    if not (args.smoke or args.quick):
        sweep += [(r, c) for r in (8, 16, 32) for c in (4, 8, 32) if (r, c) != sweep[0]]
    for readers, chunk_mb in sweep:
        rb = AdalnRebuilder(gpu=cache.gpu, readers=readers, chunk_bytes=chunk_mb << 20, direct_io="never")
        add(f"readers only: {readers} x {chunk_mb} MiB chunks", read_only_pass(rb, units), adaln_bytes / 1e9,
            LIMITS["page_cache_read_gbps"], "page cache -> pinned staging, no H2D/GEMM")
        rb.close()
    # O_DIRECT always reads the disk, page cache or not: a cold-read sweep without dropping caches.
    some = units[: min(8, len(units))]
    some_bytes = sum(u.nbytes for u in some)
    for readers, chunk_mb in ([(16, 32)] if args.smoke or args.quick else [(16, 8), (16, 32), (16, 128), (4, 32)]):
        rb = AdalnRebuilder(gpu=cache.gpu, readers=readers, direct_chunk_bytes=chunk_mb << 20,
                            direct_io="always")
        add(f"readers only, O_DIRECT: {readers} x {chunk_mb} MiB ({len(some)} units)", read_only_pass(rb, some),
            some_bytes / 1e9, LIMITS["cold_disk_gbps"], "disk -> pinned staging")
        rb.close()
    if not (args.smoke or args.quick):  # the whole pipeline under other chunk / buffer settings
        for chunk_mb, buffers in ((32, 2), (8, 3), (32, 3)):
            other = PlanCache(AdalnConfig(**{**base, "read_chunk_mb": chunk_mb}, staging_buffers=buffers,
                                          gpu_plans=64, host_cache_gb=0), reader, online_model, device)
            times = []
            for _ in range(args.repeats + 1):  # the first includes buffer allocation
                seconds, p = timed_prepare(other, plans_a, device)
                times.append(seconds)
                p.release()
                other.invalidate()
            add(f"online miss, page cache, {chunk_mb} MiB chunks, {buffers} buffers", min(times[1:]),
                adaln_bytes / 1e9, LIMITS["page_cache_read_gbps"], f"best of {args.repeats}")
            other.close()
            del other
    first_s, prepared = timed_prepare(cache, plans_a, device)  # includes staging allocation
    prepared.release()
    cache.invalidate()
    best = None
    for _ in range(args.repeats):
        seconds, prepared = timed_prepare(cache, plans_a, device)
        best = seconds if best is None else min(best, seconds)
        assert prepared.stats.built_plans == n_plans
        prepared.release()
        cache.invalidate()
    add(f"online miss, page cache ({n_plans} plans)", best, adaln_bytes / 1e9, LIMITS["page_cache_read_gbps"],
        f"best of {args.repeats}; first call {first_s:.3f} s incl. buffer allocation; target <= "
        f"{LIMITS['target_page_cache_s']} s, sglang {LIMITS['sglang_rebuild_s']} s")
    rebuild_prepared = cache.prepare(plans_a)  # kept for the exactness check
    # 2. GPU hit.
    seconds, hit = timed_prepare(cache, plans_a, device)
    assert hit.stats.gpu_hit_plans == n_plans
    add("GPU hit", seconds, note=f"{n_plans} plans")
    hit.release()

    # 3. Host hit (tier sized for both schedules; the GPU slab is emptied so every plan comes from host).
    host_gb = 2 * n_plans * 2 * (config.num_blocks * config.adaln_width + config.final_adaln_width) * 2 / 1e9
    start = time.perf_counter()
    hcache = PlanCache(AdalnConfig(**base, gpu_plans=64, host_cache_gb=host_gb * 1.01), reader, online_model,
                       device)
    alloc_s = time.perf_counter() - start
    hcache.prepare(plans_a).release()
    hcache.host.synchronize()
    hcache.slab.index.invalidate()
    seconds, host_hit = timed_prepare(hcache, plans_a, device)
    assert host_hit.stats.host_hit_plans == n_plans, host_hit.stats
    add("host hit (H2D)", seconds, host_hit.stats.h2d_bytes / 1e9, LIMITS["h2d_gbps"],
        f"pinned={hcache.host.pinned}; tier of {hcache.host.num_pages} pages allocated in {alloc_s:.2f} s")

    # 4. Two alternating schedules, host tier off: default slab (64 plans < 2 x 49) and one that holds both.
    for gpu_plans in (64, 2 * n_plans):
        alt = PlanCache(AdalnConfig(**base, gpu_plans=gpu_plans, host_cache_gb=0), reader, online_model, device)
        times, built = [], 0
        for plans in (plans_a, plans_b, plans_a, plans_b, plans_a, plans_b):
            seconds, p = timed_prepare(alt, plans, device)
            times.append(seconds)
            built += p.stats.built_plans
            p.release()
        steady = times[2:]
        add(f"alternating A/B, host off, gpu_plans={gpu_plans}", sum(steady) / len(steady),
            note=f"mean of requests 3-6; {built} plans built over 6 requests; per request "
            + ", ".join(f"{t:.3f}" for t in times))
        alt.close()
        del alt

    # 5. Cold disk: direct_io=auto (probes each unit, reads cold ones with O_DIRECT), then buffered only.
    cold_prepared = None
    if not args.no_cold:
        for direct_io in ("auto",) if args.quick else ("auto", "never"):
            cold = PlanCache(AdalnConfig(**base, gpu_plans=64, host_cache_gb=0, direct_io=direct_io), reader,
                             online_model, device)
            how = drop_page_cache(shards, system_wide=not args.smoke)
            seconds, prepared = timed_prepare(cold, plans_b, device)
            assert prepared.stats.built_plans == n_plans
            if direct_io == "auto":
                cold_prepared = prepared  # checked against resident below
            else:
                prepared.release()
            cold.close()
            add(f"online miss, cold disk, direct_io={direct_io}", seconds, adaln_bytes / 1e9,
                LIMITS["cold_disk_gbps"], f"{how}; {cold.rebuilder.num_direct_units} of {len(units)} units "
                f"O_DIRECT; target <= {LIMITS['target_cold_ratio']} x floor")
    # 6. Resident: all adaln_proj on the device, project every plan (what each request's steps cost).
    resident_model = adaln_model(reader, device, with_adaln=True)
    reference = ResidentModulation(AdalnConfig(mode="resident"), resident_model, device)
    resident_plans = reference.prepare(plans_a)
    for _ in range(2):  # warm-up, then timed
        sync(device)
        start = time.perf_counter()
        for i in range(n_plans):
            resident_plans.modulation(i)
        sync(device)
    add(f"resident: project {n_plans} plans", time.perf_counter() - start,
        note=f"adaln_proj resident on device: {adaln_bytes / 2**30:.1f} GiB")
    exact["online rebuild == resident"] = check_equal(rebuild_prepared, reference, plans_a)
    exact["host hit == resident"] = check_equal(host_hit, reference, plans_a)
    if cold_prepared is not None:
        exact["cold (O_DIRECT) rebuild == resident"] = check_equal(cold_prepared, reference, plans_b)
        cold_prepared.release()
    rebuild_prepared.release()
    host_hit.release()
    del resident_model, reference, resident_plans
    hcache.close()
    del hcache
    if device.type == "cuda":
        torch.cuda.empty_cache()

    cache.close()

    # Report.
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    tag = "cpu" if device.type == "cpu" else "-".join(dev_name.lower().split())  # e.g. nvidia-h200
    tag = f"smoke-{tag}" if args.smoke else tag
    command = "python -m bench.adaln " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    cols = ["scenario", "seconds", "GB", "GB/s", "floor_s", "x_floor", "note"]
    lines = [
        f"# AdaLN plan cache benchmark ({name}, {device.type})", "",
        f"- commit: `{git_commit()}`", f"- device: {dev_name}; torch {torch.__version__}; {os.cpu_count()} CPUs",
        f"- command: `{command}`",
        f"- scale: MiniMax-H3 AdaLN (diffusers MiniMaxH3Transformer3DModel, hidden {config.hidden_size}), "
        f"{config.num_blocks} blocks + final, {n_plans} plans of width 2 (t2va, shifts 12/3 and 6/3), "
        f"{adaln_bytes / 1e9:.2f} GB of adaln_proj ({checkpoint.layout.value} layout); readers={args.readers}, "
        f"read_chunk_mb={args.read_chunk_mb}",
        "- limits: " + ", ".join(f"{k}={v}" for k, v in LIMITS.items()), "",
        "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
    ]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
    lines += ["", "Bit-exact on " + device.type + ": "
              + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in exact.items())]
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"adaln-{tag}.md").write_text(table)
    (out / f"adaln-{tag}.json").write_text(json.dumps({
        "commit": git_commit(), "device": dev_name, "command": command, "preset": name,
        "num_plans": n_plans, "adaln_bytes": adaln_bytes, "limits": LIMITS, "rows": rows, "bit_exact": exact,
    }, indent=2) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0 if all(exact.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
