"""The GPU goal of the stage split, measured from a job stream (issue 11, item 4).

Starts its own local Ray cluster and the app from serve_config.yaml (`--stages split|fused`), then:

1. idle: `--idle-jobs` video jobs one after another (each waits for the previous), and per job the ratio of
   its end-to-end time (the client's submit -> the poll that saw it completed, every `POLL_S`) to its stage
   times added up
   (`encode_s + plan_s + denoise_s + decode_s + mux_s + upload_s`). Goal: <= 1.05.
2. stream: `--jobs` video jobs submitted at once (a saturating stream for one worker), and the denoiser's busy
   fraction: the jobs' `plan_s + denoise_s` added up over the window from the first job's denoising start to
   the last job's denoising end (one worker replica: its denoising is serial, so the sum is its busy time;
   the window leaves out the pipeline's fill, the first encode, and drain, the last decode). Goal: >= 0.95.
   Also the per-stage means and the waits the job objects record.

Every job has its own prompt and seed (a repeated prompt would be a prompt-cache hit). On CPU with the tiny
checkpoint the stages take milliseconds, so fixed per-call costs (Ray round trips, job-store writes, polling)
dominate both numbers; the goal is for the real model on a GPU:

    python -m bench.stages --checkpoint /path/to/MiniMax-H3 --device cuda --size 1344x768 --seconds 5 \
        --steps 50 --jobs 8 --idle-jobs 2 --json bench/results/stages-nvidia-h200.json

    python -m bench.stages --quick          # CPU, tiny checkpoint (bench/results/stages-cpu.json)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import requests
import yaml

ROOT = Path(__file__).resolve().parents[1]
STAGE_KEYS = ("encode_s", "plan_s", "denoise_s", "decode_s", "mux_s", "upload_s")
WAIT_KEYS = ("queued_s", "encode_wait_s", "denoise_wait_s", "decode_wait_s")
POLL_S = 0.02
TINY_GEOMETRY = {"short_edge": None, "max_pixels": 128 * 128, "min_seconds": 0.2, "max_seconds": 5.0}


def app_args(args: argparse.Namespace) -> dict[str, Any]:
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    config["stages"] = args.stages
    engine = config["engine"]
    engine["device"] = args.device
    engine["checkpoint_root"] = str(args.checkpoint_root.resolve())
    if args.checkpoint:
        engine["checkpoint"] = str(args.checkpoint)
        engine["adapters"] = {}  # the shipped auto-made adapter fits only an auto-made checkpoint
        engine["text_encoder"]["hidden_state_index"] = hidden_state_index(args.checkpoint, engine)
    else:
        engine["geometry"] = TINY_GEOMETRY
    config["worker"]["num_replicas"] = 1  # one denoiser: its busy fraction is the question
    config["worker"].pop("autoscaling", None)
    config["jobs"].update({"state_dir": str(args.state_dir.resolve()), "max_queued_per_model": max(16, args.jobs),
                           "poll_s": 0.05, "events_poll_s": 0.1})
    return config


def hidden_state_index(checkpoint: Path, engine: dict[str, Any]) -> int:
    """The configured index, or one below the text encoder's depth for a bench checkpoint with fewer layers
    (bench.checkpoints writes `--text-layers` of them, as bench.app: the last one feeds nothing)."""
    text_config = json.loads((checkpoint / "text_encoder" / "config.json").read_text())
    layers = text_config.get("text_config", text_config)["num_hidden_layers"]
    return min(engine["text_encoder"]["hidden_state_index"], layers - 1)


def job_body(args: argparse.Namespace, k: int) -> dict[str, Any]:
    return {"prompt": f"job {k}: a lighthouse at dusk, waves {k} metres high", "seconds": args.seconds,
            "size": args.size, "num_inference_steps": args.steps, "seed": 1000 + k}


def submit(url: str, body: dict[str, Any]) -> tuple[str, float]:
    """The job id and the client's clock when it was submitted (the job object's times are whole seconds)."""
    submitted = time.time()
    r = requests.post(f"{url}/v1/videos", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["id"], submitted


def wait_all(url: str, submitted: list[tuple[str, float]], timeout_s: float) -> list[dict[str, Any]]:
    """Every job once completed, with `submitted_at` and `seen_at` (client clock) added; polls them all."""
    deadline = time.monotonic() + timeout_s
    pending = dict(submitted)
    done: dict[str, dict[str, Any]] = {}
    while pending:
        for job_id in list(pending):
            job = requests.get(f"{url}/v1/videos/{job_id}", timeout=30).json()
            if job["status"] in ("failed", "cancelled"):
                raise RuntimeError(f"job {job_id} {job['status']}: {job.get('error')}")
            if job["status"] == "completed":
                done[job_id] = {**job, "submitted_at": pending.pop(job_id), "seen_at": time.time()}
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs {sorted(pending)} not finished after {timeout_s} s")
        time.sleep(POLL_S)
    return [done[job_id] for job_id, _ in submitted]


def stage_sum(job: dict[str, Any]) -> float:
    return sum(job["timings"][k] for k in STAGE_KEYS)


def idle_report(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    e2e = [job["seen_at"] - job["submitted_at"] for job in jobs]
    ratios = [t / stage_sum(job) for t, job in zip(e2e, jobs)]
    return {"jobs": len(jobs), "e2e_over_stage_sum": ratios, "e2e_over_stage_sum_max": max(ratios), "e2e_s": e2e,
            "poll_s": POLL_S,
            "stage_sum_s": [stage_sum(job) for job in jobs],
            "mean_s": {k: statistics.fmean(job["timings"][k] for job in jobs) for k in STAGE_KEYS + WAIT_KEYS}}


def sharing_report(idle: dict[str, Any], stream: dict[str, Any]) -> dict[str, Any]:
    """What overlapping bought: jobs per second of the stream over one-at-a-time jobs, and how much slower a step
    ran while other stages (decode) shared its GPU; a busy denoiser can still be a slowed one."""
    serial_job_s = statistics.fmean(idle["e2e_s"])
    return {"throughput_over_serial": serial_job_s * stream["jobs_per_s"],
            "denoise_s_stream_over_idle": stream["mean_s"]["denoise_s"] / idle["mean_s"]["denoise_s"]}


def markdown(summary: dict[str, Any]) -> str:
    idle, stream, sharing = summary["idle"], summary["stream"], summary["sharing"]
    lines = [f"# stages ({summary['stages']})", "", f"- commit: `{summary['commit']}`", f"- device: {summary['device']}",
             f"- command: `{summary['command']}`", f"- checkpoint {summary['checkpoint']}; job {summary['size']}, "
             f"{summary['seconds']} s, {summary['steps']} steps", "",
             "| metric | value | goal |", "|---|---|---|",
             f"| denoiser busy fraction (stream of {stream['jobs']}) | {stream['denoiser_busy_fraction']:.3f} | >= 0.95 |",
             f"| idle e2e / stage sum, max of {idle['jobs']} | {idle['e2e_over_stage_sum_max']:.3f} | <= 1.05 |",
             f"| stream throughput / one-at-a-time | {sharing['throughput_over_serial']:.2f} | |",
             f"| denoise_s in the stream / idle | {sharing['denoise_s_stream_over_idle']:.2f} | |", "",
             "| stage | idle mean s | stream mean s |", "|---|---|---|"]
    lines += [f"| {k} | {idle['mean_s'][k]:.3f} | {stream['mean_s'][k]:.3f} |" for k in STAGE_KEYS + WAIT_KEYS]
    return "\n".join(lines) + "\n"


def stream_report(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Denoiser busy fraction from the job objects (one worker replica)."""
    def denoise_start(job: dict[str, Any]) -> float:
        t = job["timings"]
        return job["submitted_at"] + t["queued_s"] + t["encode_s"] + t["encode_wait_s"]

    def denoise_end(job: dict[str, Any]) -> float:
        t = job["timings"]
        return denoise_start(job) + t["denoise_wait_s"] + t["plan_s"] + t["denoise_s"]

    # The window is from the first job's denoising start to the last one's end, both on the client's clock.

    window = max(map(denoise_end, jobs)) - min(map(denoise_start, jobs))
    busy = sum(job["timings"]["plan_s"] + job["timings"]["denoise_s"] for job in jobs)
    loop_only = sum(job["timings"]["denoise_s"] for job in jobs)
    first_created = min(job["submitted_at"] for job in jobs)
    last_completed = max(job["seen_at"] for job in jobs)
    return {
        "jobs": len(jobs),
        "denoiser_busy_fraction": busy / window,
        "denoise_loop_fraction": loop_only / window,
        "window_s": window,
        "stream_wall_s": last_completed - first_created,
        "jobs_per_s": len(jobs) / (last_completed - first_created),
        "mean_s": {k: statistics.fmean(job["timings"][k] for job in jobs) for k in (*STAGE_KEYS, *WAIT_KEYS)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", choices=("split", "fused"), default="split")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a MiniMax-H3 checkpoint (default: tiny)")
    parser.add_argument("--checkpoint-root", type=Path, default=ROOT / "checkpoints")
    parser.add_argument("--state-dir", type=Path, default=ROOT / "bench" / "state-stages")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu")
    parser.add_argument("--size", default="96x64")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=8, help="jobs of the saturating stream")
    parser.add_argument("--idle-jobs", type=int, default=3, help="jobs run one at a time")
    parser.add_argument("--num-cpus", type=int, default=6, help="CPUs of the local Ray cluster")
    parser.add_argument("--num-gpus", type=int, default=None, help="GPUs of the local Ray cluster (default: all)")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--quick", action="store_true", help="CPU smoke: 4 stream jobs, 2 idle jobs, 8 steps")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.jobs, args.idle_jobs, args.steps = 4, 2, 8

    from bench.common import command_line, device_description, git_commit
    from tests.serve_helpers import run_app, serve_cluster

    init = {} if args.num_gpus is None else {"num_gpus": args.num_gpus}
    with serve_cluster(num_cpus=args.num_cpus, **init) as url:
        run_app(url, app_args(args))
        while requests.get(f"{url}/v1/videos?limit=1", timeout=30).status_code != 200:  # job service starting
            time.sleep(0.2)
        wait_all(url, [submit(url, job_body(args, -1))], args.timeout_s)  # warm-up: first-call costs
        idle = [wait_all(url, [submit(url, job_body(args, k))], args.timeout_s)[0] for k in range(args.idle_jobs)]
        stream = wait_all(url, [submit(url, job_body(args, 100 + k)) for k in range(args.jobs)], args.timeout_s)
    summary = {
        "command": command_line(), "commit": git_commit(), "device": device_description(args.device),
        "stages": args.stages, "size": args.size, "seconds": args.seconds, "steps": args.steps,
        "checkpoint": str(args.checkpoint) if args.checkpoint else "tiny",
        "idle": idle_report(idle), "stream": stream_report(stream),
        "goals": {"denoiser_busy_fraction": ">= 0.95", "e2e_over_stage_sum": "<= 1.05 (idle)"},
    }
    summary["sharing"] = sharing_report(summary["idle"], summary["stream"])
    print(json.dumps(summary, indent=2))
    out = args.json or ROOT / "bench" / "results" / f"stages-{args.device}-{args.stages}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(summary))
    print(f"denoiser busy {summary['stream']['denoiser_busy_fraction']:.3f} of the window, idle e2e / stage sum "
          f"max {summary['idle']['e2e_over_stage_sum_max']:.3f}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
