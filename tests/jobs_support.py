"""Test doubles of the job layer (kept in tests/, out of the package): a scripted `VideoBackend`, a clock that
moves only when told, and a throwaway PostgreSQL server.

`FakeVideoBackend` runs `num_inference_steps` steps of `step_s` seconds each, reports progress, honours
`cancelled()` between steps, and returns deterministic bytes (`fake_mp4(spec)`, a real 1x1 `fake_png(spec)`).
A test can hold jobs before a given step (`hold_before_step`, then `release()`) and make a job fail through
its prompt: `fail:request`, `fail:server` or `fail:crash` (a plain RuntimeError), or lose its worker
(`VideoWorkerLost`) before step N with `fail:worker@N` on every run, `fail:worker-once@N` on its first run
only (N=1: before any step ran); `validate` refuses a prompt
starting with `invalid:`. After the last step it calls `denoised()`, then takes `decode_s` to "decode". `postgres_server()` runs a throwaway PostgreSQL server through scripts/postgres.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
import subprocess
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from jobs.backend import (
    CancelCheck,
    ProgressCallback,
    VideoCancelled,
    VideoOutput,
    VideoRequestError,
    VideoRun,
    VideoServerError,
    VideoSpec,
    VideoStats,
    VideoTimings,
    VideoWorkerLost,
)
from jobs.errors import InvalidVideoRequest

__all__ = ["FakeClock", "FakeVideoBackend", "fake_mp4", "fake_png", "postgres_server", "reset_postgres"]

FAKE_MP4_BYTES = 40_000
FAKE_FPS = 24


def fake_mp4(spec: VideoSpec) -> bytes:
    """FAKE_MP4_BYTES bytes: an MP4 `ftyp` box, then a pattern derived from the spec (so ranges differ)."""
    head = b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2"
    seed = hashlib.sha256(spec.model_dump_json().encode()).digest()
    body = bytearray()
    block = seed
    while len(head) + len(body) < FAKE_MP4_BYTES:
        block = hashlib.sha256(block).digest()
        body += block
    return (head + bytes(body))[:FAKE_MP4_BYTES]


def fake_png(spec: VideoSpec) -> bytes:
    """A valid 1x1 RGB PNG whose colour comes from the spec's seed."""
    colour = spec.seed.to_bytes(8, "big")[-3:]

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)  # 1x1, 8-bit, RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" + colour)) + chunk(
        b"IEND", b""
    )


class FakeVideoBackend:
    """A `VideoBackend` that runs no model. Thread-safe controls, so a test thread can steer a service
    running in another thread's event loop."""

    def __init__(self, step_s: float = 0.0, hold_before_step: int | None = None, decode_s: float = 0.0) -> None:
        self.step_s = step_s
        self.decode_s = decode_s
        self.hold_before_step = hold_before_step  # steps >= this wait until release()
        self._released = threading.Event()
        self._lock = threading.Lock()
        self.started: list[str] = []  # job ids, in the order their runs started
        self.steps_done: dict[str, int] = {}
        self.runs: list[tuple[str, str]] = []  # (job id, output key) of every run started
        self.specs: dict[str, VideoSpec] = {}  # job id -> the spec its (last) run got, media included
        #: (job id, event, time.monotonic()): "denoise_start", "denoise_end", "decode_end" of every run
        self.events: list[tuple[str, str, float]] = []

    def release(self) -> None:
        """Let held jobs run to the end (and every later job run without holding)."""
        self._released.set()

    async def validate(self, spec: VideoSpec) -> None:
        """Refuses a prompt starting with `invalid:` (as a backend refuses a prompt over its token limit)."""
        if spec.prompt.startswith("invalid:"):
            raise InvalidVideoRequest("prompt", f"{len(spec.prompt)} tokens exceed the text encoder's 8 (fake)")

    async def run(self, spec: VideoSpec, run: VideoRun) -> VideoOutput:
        job_id, on_progress, cancelled = run.job_id, run.on_progress, run.cancelled
        with self._lock:
            self.started.append(job_id)
            self.runs.append((job_id, run.output_key))
            self.specs[job_id] = spec
            self.steps_done[job_id] = 0
        if spec.prompt.startswith("fail:request"):
            raise VideoRequestError(f"prompt: {len(spec.prompt)} tokens exceed the text encoder's 8 (fake)")
        if spec.prompt.startswith("fail:server"):
            raise VideoServerError("the decoder could not read its weights (fake)")
        if spec.prompt.startswith("fail:crash"):
            raise RuntimeError("segfault in a fake kernel")
        lose_before = None
        first_run = self.started.count(job_id) == 1
        for prefix, every_run in (("fail:worker@", True), ("fail:worker-once@", False)):
            if spec.prompt.startswith(prefix) and (every_run or first_run):
                lose_before = int(spec.prompt.split()[0].removeprefix(prefix))
        num_steps = spec.num_inference_steps
        on_progress(0, num_steps)
        self._event(job_id, "denoise_start")
        for step in range(1, num_steps + 1):
            if step == lose_before:
                raise VideoWorkerLost(f"the worker replica died (fake, before step {step})")
            while self.hold_before_step is not None and step >= self.hold_before_step and not self._released.is_set():
                if cancelled():
                    raise VideoCancelled(f"cancelled while held before step {step}")
                await asyncio.sleep(0.005)
            if cancelled():
                raise VideoCancelled(f"cancelled before step {step}")
            await asyncio.sleep(self.step_s)
            with self._lock:
                self.steps_done[job_id] = step
            on_progress(step, num_steps)
        self._event(job_id, "denoise_end")
        run.denoised()
        await asyncio.sleep(self.decode_s)
        self._event(job_id, "decode_end")
        return VideoOutput(
            mp4=fake_mp4(spec),
            thumbnail_png=fake_png(spec),
            timings=VideoTimings(denoise_s=num_steps * self.step_s, decode_s=self.decode_s,
                                 total_s=num_steps * self.step_s + self.decode_s),
            stats=VideoStats(num_steps=num_steps, num_frames=round(spec.seconds * FAKE_FPS), fps=FAKE_FPS),
        )

    def _event(self, job_id: str, name: str) -> None:
        with self._lock:
            self.events.append((job_id, name, time.monotonic()))


class FakeClock:
    """A store clock for tests: `advance(s)` moves time, nothing else does."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


POSTGRES_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "postgres"


@contextmanager
def postgres_server() -> Iterator[str]:
    """A throwaway PostgreSQL server (scripts/postgres: installs Debian's package if missing, own cluster, free
    loopback port) for the duration; yields its URL. RuntimeError with the script's output when it cannot be
    started: tests that need it fail, they do not skip."""
    result = subprocess.run([str(POSTGRES_SCRIPT), "start"], capture_output=True, text=True, timeout=900, check=False)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or len(lines) < 2:
        raise RuntimeError(
            f"scripts/postgres start failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    url, cluster_dir = lines[-2], lines[-1]
    try:
        yield url
    finally:
        subprocess.run([str(POSTGRES_SCRIPT), "stop", cluster_dir], capture_output=True, timeout=120, check=False)


def reset_postgres(url: str) -> None:
    """Drop the job tables (the jobs and their uploads), so the next store starts from an empty database."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS video_job_media, video_jobs")
