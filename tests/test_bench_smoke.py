"""Every benchmark's `--smoke` mode runs on CPU and writes the tables its GPU run writes, with the numbers the
tables promise (bit-exactness flags, floors, stage and mode rows). Timings are not checked: CPU smoke timings
mean nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bench import adaln, engine, h3, offload, quality
from tests.serve_helpers import own_cluster

pytestmark = [pytest.mark.slow, pytest.mark.ray(own_cluster=True)]  # every benchmark's smoke run: seconds to a minute each


@pytest.fixture
def bench_starts_its_own_ray():
    """bench.app calls `ray.init` itself: the session's shared cluster must be down first."""
    own_cluster()


def load(path: Path) -> dict:
    assert path.is_file(), f"{path} was not written"
    return json.loads(path.read_text())


def test_h3_smoke_measures_every_mode_and_stage(tmp_path):
    assert h3.main(["--smoke", "--shapes", "s", "--out", str(tmp_path), "--workdir", str(tmp_path / "w")]) == 0
    report = load(tmp_path / "h3-smoke-cpu.json")
    assert report["meta"]["commit"] and report["meta"]["command"].startswith("python -m bench.h3 --smoke")
    assert report["skipped"] == []

    modes = {row["mode"]: row for row in report["denoise"]}
    cache = "(F1B0 W3 R0.24 MC2)"
    assert list(modes) == ["diffusers forward (resident AdaLN)", "ours: engine step (online AdaLN)",
                           "ours + offload", f"ours + offload + cache-dit {cache}", f"ours + cache-dit {cache}"]
    assert {row["shape"] for row in report["denoise"]} == {"s"}
    # Online AdaLN through ExternalModulation gives diffusers' bits.
    assert modes["ours: engine step (online AdaLN)"]["bit_exact_vs_diffusers"] is True
    assert all(row["floor_ms"] > 0 and row["x_floor"] > 0 for row in report["denoise"])
    offloaded = modes["ours + offload"]["H2D_GB_per_step"]
    assert offloaded > 0 and modes["ours: engine step (online AdaLN)"]["H2D_GB_per_step"] == 0
    # A cached step streams nothing: with cache-dit at most the uncached bytes per step move.
    assert modes[f"ours + offload + cache-dit {cache}"]["H2D_GB_per_step"] <= offloaded
    for mode in (f"ours + offload + cache-dit {cache}", f"ours + cache-dit {cache}"):
        assert modes[mode]["cached_steps"].endswith("/5")  # a 6-step schedule: 5 forwards

    stages = [row["stage"] for row in report["stages"]]
    for prefix in ("text encode", "plan miss (49 plans", "plan GPU hit (49 plans)", "plan host hit (49 plans)",
                   "engine.generate", "video decode (39 frames 64x64)", "audio decode", "MP4 mux",
                   "decode + mux as a request runs them"):
        assert sum(stage.startswith(prefix) for stage in stages) == 1, prefix
    components = [row["component"] for row in report["memory"]]
    assert len(components) == 6 and components[0] == "transformer, online AdaLN (ours)"
    # End to end: a cold request reported with each of its parts, and the same request with its plans in the
    # GPU slab, which skips the plan miss. (Their sizes are CPU timings: meaningless, not checked.)
    cold, warm = report["end_to_end"]
    parts = ("text encode", "plan miss", "denoise", "decode + mux")
    assert all(cold[part] >= 0 for part in parts) and cold["total_s"] >= 0
    assert warm["request"] == "same, plans in the GPU slab (a repeat schedule)" and "plan miss" not in warm
    markdown = (tmp_path / "h3-smoke-cpu.md").read_text()
    for section in ("Setup", "Denoise step per shape", "Stages of one request", "Memory per component", "End to end"):
        assert f"\n## {section}\n" in markdown, section
    assert "## Not measured" not in markdown  # nothing skipped
    assert all(row["mode"] in markdown for row in report["denoise"])


def test_adaln_smoke_is_bit_exact_in_every_tier(tmp_path):
    assert adaln.main(["--smoke", "--quick", "--out", str(tmp_path)]) == 0
    report = load(tmp_path / "adaln-smoke-cpu.json")
    assert report["bit_exact"] == {"online rebuild == resident": True, "host hit == resident": True,
                                   "cold (O_DIRECT) rebuild == resident": True}
    rows = {row["scenario"]: row for row in report["rows"]}
    assert report["num_plans"] == 48  # 50 steps: 49 forwards, the first (both sigmas 1) has one timestep
    for scenario in ("online miss, page cache (48 plans)", "host hit (H2D)", "online miss, cold disk, direct_io=auto"):
        # each tier's time with its floor and ratio beside it (the tiny smoke floor can round the ratio to 0.0)
        row = rows[scenario]
        assert row["seconds"] > 0 and row["floor_s"] >= 0 and row["x_floor"] >= 0, scenario
    assert "GPU hit" in rows and "resident: project 48 plans" in rows
    # 4 blocks [18 * 64, 32] + final [2 * 64, 32], weight and bias, bf16
    assert report["adaln_bytes"] == (4 * 18 * 64 + 2 * 64) * (32 + 1) * 2


def test_offload_smoke_streams_every_mode_exactly(tmp_path):
    assert offload.main(["--smoke", "--caches", "none;F1B0 W4 R0.24 MC3", "--out", str(tmp_path)]) == 0
    report = load(tmp_path / "offload-cpu.json")
    assert report["meta"]["failed_modes"] == [] and report["meta"]["git_commit"]
    runs = {(run["mode"], run["cache"]): run for run in report["runs"]}
    modes = ["resident", "stream (sglang rules)", "stream (ours)", "stream (ours, r=4 leading)",
             "diffusers group offload (no stream: CPU)"]
    assert sorted(runs) == sorted((m, c) for m in modes for c in ("off", "F1B0 W4 R0.24 MC3"))
    assert all(run["bit_exact_vs_resident"] for run in runs.values())
    assert runs["resident", "off"]["h2d_bytes_per_step"] == 0
    assert all(run["ratio_to_floor"] > 0 for run in runs.values())
    # Skip-aware streaming moves fewer bytes on a cached request than sglang's rules.
    cached = "F1B0 W4 R0.24 MC3"
    assert runs["stream (ours)", cached]["h2d_bytes_per_step"] < runs["stream (sglang rules)", cached]["h2d_bytes_per_step"]
    assert runs["stream (ours)", cached]["cached_steps"] == runs["resident", cached]["cached_steps"]


def test_engine_smoke_times_both_adaln_modes(tmp_path):
    assert engine.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = load(tmp_path / "engine-smoke-cpu.json")
    assert report["commit"] and report["command"].startswith("python")
    rows = {row["adaln"]: row for row in report["rows"]}
    assert set(rows) == {"resident", "online"}
    assert rows["resident"]["tokens"] == rows["online"]["tokens"]
    assert rows["online"]["weights_gib"] < rows["resident"]["weights_gib"]  # online loads no adaln_proj
    assert all(row["model"] == "tiny" and row["blocks"] == 4 and row["steps"] == 3 for row in rows.values())


def assert_tiers_land(tiers: dict) -> None:
    """bench.app's tier sequence (4 steps: 3 forwards, 3 distinct plans) lands on the tier each row names."""
    num_plans = tiers["first miss after start (page cache)"]["built_plans"]
    assert num_plans == 3
    shared = 1  # the first forward's plan (both sigmas 1) is every schedule's
    expect = {
        "miss, page cache": ("built_plans", num_plans - shared),
        "GPU-slab hit": ("gpu_hit_plans", num_plans),
        "miss, page cache (2nd)": ("built_plans", num_plans - shared),
        "host hit": ("host_hit_plans", num_plans - shared),
        "miss, cold (DONTNEED)": ("built_plans", num_plans - shared),
        "pool hit": ("pool_hit_plans", num_plans - shared),
    }
    for tier, (counter, value) in expect.items():
        assert tiers[tier][counter] == value, (tier, tiers[tier])
    for tier in ("first miss after start (page cache)", "miss, page cache", "miss, cold (DONTNEED)"):
        row = tiers[tier]
        assert row["page_cache_bytes"] + row["disk_bytes"] == row["rebuild_bytes_read"] > 0, tier
    assert tiers["first miss after start (page cache)"]["disk_bytes"] == 0  # the shards were just read


def test_app_smoke_measures_every_tier_through_the_served_app(tmp_path, bench_starts_its_own_ray):
    """bench.app on CPU: one replica of the real app on the tiny checkpoint. The tier sequence must land on the
    tier each row names (the plan counters come back through the app), beside bench.adaln's numbers."""
    from bench import app

    assert app.main(["--smoke", "--repeats", "2", "--clients", "2", "--load-requests", "4", "--replicas", "2",
                     "--checkpoint", str(tmp_path / "tiny"), "--out", str(tmp_path)]) == 0
    report = load(tmp_path / "app-cpu.json")
    assert report["commit"] and report["command"].startswith("python")
    assert_tiers_land(report["tiers"])
    tiers = report["tiers"]
    rows = {row["metric"]: row for row in report["rows"]}
    for tier in ("first miss after start (page cache)", "miss, cold (DONTNEED)", "GPU-slab hit", "host hit"):
        row = rows[f"plan_s: {tier}"]
        assert row["app_s"] > 0 and row["bench_s"] > 0 and row["bench_after_s"] > 0, tier
    assert rows["plan_s: miss, cold (DONTNEED)"]["floor_s"] > 0
    assert rows["denoise per forward"]["bench_s"] > 0 and rows["denoise per forward"]["app_s"] > 0
    overhead = [m for m in rows if m.startswith("Serve overhead")]
    assert len(overhead) == 3 and any("queueing" in m for m in overhead)
    assert len(report["overhead"]["HTTP, 1 client"]) == 2
    for records in report["overhead"].values():  # every request split by hop (split stages: the shipped default)
        for record in records:
            assert set(record["hops"]) == set(app.HOPS) and record["hops"]["TextEncoder round trip"] > 0
            assert sum(record["hops"].values()) == pytest.approx(record["latency_s"] - record["total_s"], abs=1e-9)
    assert all(f"  - {hop}" in rows for hop in app.HOPS)
    # Scale-up to a second replica in place: its timeline's parts add up to request -> RUNNING, it answers after.
    scaled = report["scale_up"]
    startup = scaled["startup"]
    assert scaled["asked_at"] <= startup["import_started_at"] and startup["ready_at"] <= scaled["running_at"]
    assert scaled["running_at"] < scaled["answered_at"]
    parts = [rows[f"scale-up 1 -> 2:   - {name}"]["app_s"] for name, *_ in app.SCALE_UP_PARTS]
    assert all(part >= 0 for part in parts)
    assert sum(parts) == pytest.approx(rows["scale-up 1 -> 2: scale request -> 2 replicas RUNNING"]["app_s"])
    assert rows["scale-up 1 -> 2: scale request -> first answer from a new replica"]["app_s"] > sum(parts)
    new = {m.removeprefix("scale-up 1 -> 2: new replica: "): row["app_s"] for m, row in rows.items()
           if m.startswith("scale-up 1 -> 2: new replica: ")}
    assert new["engine transformer_s"] > 0 and new["engine total_s"] <= new["engine build"]
    assert new["engine text_encoder_s"] == 0  # stages: split: the worker holds the denoiser alone
    assert "n/a" in rows["GPU utilization under the load"]["detail"]
    markdown = (tmp_path / "app-cpu.md").read_text()
    assert all(metric in markdown for metric in rows if metric.startswith("plan_s: "))  # every tier's row


def test_served_compile_smoke_warms_each_compiled_replica_so_its_requests_compile_nothing(tmp_path,
                                                                                          bench_starts_its_own_ray):
    """bench.served_compile on CPU: three app starts (no compile, a cold and a warm compile cache), each a fresh
    Worker replica; through the handle the compiled ones' first request and the mixed stream compile nothing
    after the warm-up (what every response reports), each start beside the no-compile one."""
    from bench import served_compile

    assert served_compile.main(["--smoke", "--repeats", "1", "--checkpoint", str(tmp_path / "tiny"),
                                "--out", str(tmp_path)]) == 0
    report = load(tmp_path / "served-compile-smoke-cpu.json")
    assert report["commit"] and report["command"].startswith("python")
    rows = {row["start"]: row for row in report["rows"]}
    assert list(rows) == list(served_compile.STARTS)
    assert "warmup_s" not in rows["no compile"] and rows["no compile"]["x no-compile replica"] == 1
    assert "stream_requests" not in rows["no compile"]
    for row in rows.values():  # every start times its first request against later ones
        assert row["x later"] == pytest.approx(row["first_ms"] / row["later_ms"], rel=0.01)
    for start in served_compile.STARTS[1:]:
        row = rows[start]
        assert 0 < row["engine_s"] < row["replica_s"]  # the engine's build is part of the replica's start
        assert row["x no-compile replica"] == pytest.approx(row["replica_s"] / rows["no compile"]["replica_s"],
                                                            rel=0.01)
        assert row["warmup_s"] > 0 and row["warmup_forwards"] == 1  # a fresh process: the warm-up compiled
        assert row["stream_requests"] == len(served_compile.SMOKE_CANVASES) * len(served_compile.SMOKE_STEPS)
        assert row["stream_recompiles"] == 0


def test_app_scale_up_parts_add_up_to_the_request_to_running_time():
    """bench.app's scale-up rows: consecutive parts of the new replica's wall-clock timeline, from the scale
    request to Serve reporting it RUNNING; a replica that did not answer describe() gets one n/a row."""
    from bench.app import SCALE_UP_PARTS, startup_rows

    asked = 1000.0
    startup = {"role": "worker", "process_started_at": asked - 120.0, "import_started_at": asked + 2.0,
               "imported_at": asked + 5.5, "constructor_at": asked + 5.75, "build_started_at": asked + 6.0,
               "build_ended_at": asked + 9.0, "ready_at": asked + 9.25, "imports_s": 0.125, "engine": None}
    scaled = {"asked_at": asked, "running_at": asked + 10.0, "answered_at": asked + 12.5, "first": None,
              "startup": startup}
    rows = {row["metric"]: row["app_s"] for row in startup_rows(2, scaled)}
    parts = [rows[f"scale-up 1 -> 2:   - {name}"] for name, *_ in SCALE_UP_PARTS]
    assert parts == [2.0, 3.5, 0.25, 3.5, 0.75]
    assert sum(parts) == rows["scale-up 1 -> 2: scale request -> 2 replicas RUNNING"] == 10.0
    assert rows["scale-up 1 -> 2: scale request -> first answer from a new replica"] == 12.5
    assert rows["scale-up 1 -> 2: new replica's process started (before the scale request: < 0)"] == -120.0
    assert rows["scale-up 1 -> 2: new replica: engine build"] == 3.0
    missing = {row["metric"]: row for row in startup_rows(2, {**scaled, "startup": None})}
    assert missing["scale-up 1 -> 2: new replica start-up"]["app_s"] is None
    assert not any("  - " in metric for metric in missing)
    # Preloaded (RAY_preload_python_modules): the imports ran before the request; the parts from the request on
    # still add up, and the imports are reported beside them.
    preloaded = {**startup, "import_started_at": asked - 100.0, "imported_at": asked - 96.5, "preloaded": True}
    rows = {row["metric"]: row["app_s"] for row in startup_rows(2, {**scaled, "startup": preloaded})}
    parts = [rows[f"scale-up 1 -> 2:   - {name}"] for name, *_ in SCALE_UP_PARTS]
    assert parts == [0.0, 0.0, 5.75, 3.5, 0.75] and sum(parts) == 10.0
    assert rows["scale-up 1 -> 2: module imports before the scale request (preloaded)"] == 3.5
    # No idle worker left: Ray started a process for the replica, which preloaded after the request (on the path).
    started_for_it = {**startup, "preloaded": True}
    for case in (scaled, {**scaled, "startup": started_for_it}):
        rows = {row["metric"]: row["app_s"] for row in startup_rows(2, case)}
        assert "scale-up 1 -> 2: module imports before the scale request (preloaded)" not in rows
        assert rows["scale-up 1 -> 2:   - module imports"] == 3.5


def test_app_smoke_at_sp2_serves_one_replica_of_two_gloo_ranks_beside_the_one_process_parts(tmp_path,
                                                                                            bench_starts_its_own_ray):
    """bench.app --sp 2 on CPU: the real app with engine.parallel.sp: 2 (one Worker replica coordinating two gloo
    rank actors in its placement group, stages fused). The tiers land as at SP1 (rank 0's counters), every rank
    ends every request with rank 0's latents, the ranks' rebuilds split the one-device rebuild's bytes between
    them, and the SP rows put the served numbers beside the direct SP1 engine call and bench.adaln's miss."""
    from bench import app

    assert app.main(["--smoke", "--sp", "2", "--repeats", "2", "--clients", "2", "--load-requests", "4",
                     "--checkpoint", str(tmp_path / "tiny"), "--out", str(tmp_path)]) == 0
    report = load(tmp_path / "app-cpu.json")
    assert report["command"].startswith("python")
    tiers = report["tiers"]
    assert_tiers_land(tiers)
    records = [r for r in tiers.values() if "latency_s" in r] + [r for rs in report["overhead"].values() for r in rs]
    assert len(records) == 7 + 2 * 2 + 4
    for record in records:
        parallel = record["parallel"]
        assert parallel["sp"] == 2 and parallel["ranks_agree"] is True and len(parallel["adaln_by_rank"]) == 2
        assert record["hops"]["TextEncoder round trip"] == record["hops"]["Decoder round trip"] == 0  # fused
        assert sum(record["hops"].values()) == pytest.approx(record["latency_s"] - record["total_s"], abs=1e-9)
    one_device = report["components"]["before"]["miss_page_cache"]["bytes"]
    for tier in ("miss, page cache", "miss, cold (DONTNEED)"):
        by_rank = [a["rebuild_bytes_read"] for a in tiers[tier]["parallel"]["adaln_by_rank"]]
        assert tiers[tier]["rebuild_bytes_read"] == by_rank[0] and all(b > 0 for b in by_rank)
        assert sum(by_rank) == one_device, tier  # each rank reads its own share of the AdaLN units
    rows = {row["metric"]: row for row in report["rows"]}
    step = rows["SP2: denoise per forward, served SP2 vs direct SP1"]
    assert step["app_s"] == rows["denoise per forward"]["app_s"] > 0 and step["bench_s"] > 0
    assert step["x_bench"] == round(step["app_s"] / step["bench_s"], 2)
    for tier, component in (("miss, page cache", "miss_page_cache"), ("miss, cold (DONTNEED)", "miss_cold")):
        row = rows[f"SP2: plan_s {tier}, served SP2 vs bench.adaln (one device)"]
        assert row["app_s"] == tiers[tier]["plan_s"] and row["bench_s"] == report["components"]["before"][component]["seconds"]
    for name in ("handle, 1 client", "HTTP, 1 client"):
        assert rows[f"SP2: coordinator <-> ranks ({name})"]["app_s"] > 0
    assert rows["SP2: every rank ended with rank 0's latents"]["detail"].startswith(f"{len(records)} of {len(records)}")
    assert rows["scale-up"]["detail"].startswith("n/a at sp 2: on CPU")
    notes = " ".join(report["notes"])
    assert "placement_group_bundles [{'CPU': 1.0}, {'CPU': 1.0}, {'CPU': 1.0}] (STRICT_PACK)" in notes


def test_psnr_is_inf_for_identical_outputs_and_uses_the_reference_range():
    reference = torch.tensor([0.0, 10.0])
    assert quality.psnr(reference, reference.clone()) == math.inf
    # MSE ((0)^2 + (10 - 9)^2) / 2 = 0.5; peak = 10 - 0: 10 log10(100 / 0.5)
    assert quality.psnr(reference, torch.tensor([0.0, 9.0])) == pytest.approx(10 * math.log10(200))
    assert quality.psnr(reference, torch.tensor([0.0, 9.0]), peak=255.0) == pytest.approx(10 * math.log10(255**2 / 0.5))


def test_quality_quick_compares_high_with_lossless_on_the_same_clips(tmp_path):
    """bench.quality on CPU: the lossless run runs every block of every forward, the high run skips exactly
    the middle blocks of its cached steps (counted, not derived), and the two differ exactly when a step was
    cached."""
    from deployments.schemas import AppConfig

    assert quality.main(["--quick", "--prompts", "1", "--seeds", "5", "--steps", "12",
                         "--checkpoint", str(tmp_path / "tiny"), "--out", str(tmp_path)]) == 0
    report = load(tmp_path / "quality-cpu.json")
    assert report["commit"] and report["command"].startswith("python")
    clip, total = report["rows"]
    assert (clip["seed"], clip["forwards"], total["prompt"]) == (5, 11, "all")
    profile = AppConfig().videos.high_quality
    num_blocks = clip["num_blocks"]
    cached = int(clip["cached_steps"].split("/")[0])
    assert clip["blocks_run_lossless"] == 11 * num_blocks
    skipped_per_step = num_blocks - profile.Fn_compute_blocks - profile.Bn_compute_blocks
    assert clip["blocks_run_high"] == clip["blocks_run_lossless"] - cached * skipped_per_step
    assert clip["skipped_frac"] == pytest.approx(cached * skipped_per_step / (11 * num_blocks))
    for key in ("psnr_frames_db", "psnr_video_latents_db", "psnr_audio_latents_db"):
        assert (clip[key] is None) == (cached == 0), key  # null: identical outputs
    assert clip["step_ms_lossless"] > 0 and clip["step_ms_high"] > 0
    assert "random weights, not the trained model" in (tmp_path / "quality-cpu.md").read_text()


@pytest.mark.parametrize("split, video", [(True, True), (True, False), (False, True), (False, False)])
def test_app_overhead_hops_sum_to_latency_minus_the_stages_work(split, video):
    """bench.app's overhead breakdown: the parts sum to latency - total_s; a stage's round trip is its call minus
    the work it reported, the worker call's part its wait minus the phases it ran (every stage when fused)."""
    from bench.app import HOPS, overhead_hops

    timings = {"encode_s": 0.3, "plan_s": 0.5, "denoise_s": 4.0, "decode_s": 0.7 if video else 0.0,
               "mux_s": 0.2 if video else 0.0}
    timings["total_s"] = sum(timings.values())
    engine_work = timings["plan_s"] + timings["denoise_s"] + (0.0 if split else timings["encode_s"] + timings["decode_s"]
                                                              + timings["mux_s"])
    serve = {"encode_call_s": 0.32 if split else None, "engine_call_s": engine_work + 0.004,
             "decode_call_s": 0.93 if split and video else None, "respond_s": 0.002}
    serve["ingress_s"] = serve["engine_call_s"] + (serve["encode_call_s"] or 0) + (serve["decode_call_s"] or 0) + 0.005
    serve["ingress_s"] += serve["respond_s"]
    latency = serve["ingress_s"] + 0.006
    hops = overhead_hops(latency, timings, serve)
    assert list(hops) == list(HOPS)
    assert sum(hops.values()) == pytest.approx(latency - timings["total_s"])
    assert hops["client <-> ingress"] == pytest.approx(0.006) and hops["ingress own work"] == pytest.approx(0.005)
    assert hops["response encoding"] == pytest.approx(0.002)
    assert hops["worker call outside its phases"] == pytest.approx(0.004)
    assert hops["TextEncoder round trip"] == pytest.approx(0.02 if split else 0.0)
    assert hops["Decoder round trip"] == pytest.approx(0.03 if split and video else 0.0)
    assert overhead_hops(latency, timings, {}) == {}  # a response without serve_timings (a streamed result)
