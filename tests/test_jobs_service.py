"""The job service: order, replicas sharing one database, cancellation, failures, a replica killed mid-job,
graceful stop, restart, retention, Retry-After and progress watching, with the fake backend.

The multi-replica and crash cases run on SQLite and on a real PostgreSQL server (scripts/postgres; they fail,
not skip, when it cannot start). Waits are bounded polls, never wall-clock asserts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from jobs.backend import VideoSpec, VideoStats, VideoTimings
from jobs.config import JobsConfig
from jobs.errors import JobNotFound, OutputExpired, QueueFull, StoreUnavailable
from engine.limits import ModelLimits
from jobs.outputs import OutputStore, VideoVariant
from jobs.records import JobError, JobRecord, JobStatus
from jobs.service import JobService, open_job_service
from jobs.store import open_job_store
from tests.jobs_support import FakeClock, FakeVideoBackend, fake_mp4, fake_png

# 600: the first PostgreSQL test may install Debian's postgresql package (scripts/postgres) on a fresh machine.
pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[1]
TINY = ModelLimits(
    name="tiny", min_seconds=1, max_seconds=3, default_seconds=1, size_multiple=16, min_edge=32, max_edge=128,
    max_pixels=128 * 64, default_size="64x32", default_short_edge=32, max_steps=8, default_steps=4,
)
LEASE_S = 0.5
WAIT_S = 20.0
STALL_LIMIT_S = 300.0  # only so a broken test cannot hang the run; every test resumes its store


def fast_config(tmp_path: Path, **overrides: float) -> JobsConfig:
    base = {"state_dir": str(tmp_path), "lease_s": LEASE_S, "poll_s": 0.02, "reap_interval_s": 0.05,
            "events_poll_s": 0.05}
    return JobsConfig.model_validate({**base, **overrides})


def make_spec(prompt: str = "a lighthouse", steps: int = 4) -> VideoSpec:
    return VideoSpec(
        model="tiny", prompt=prompt, seconds=1.0, width=64, height=32, num_inference_steps=steps, seed=5,
        flow_shift=12.0, audio_flow_shift=3.0, quality="lossless",
    )


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'jobs.sqlite3'}"


def make_service(database_url: str, tmp_path: Path, backend: FakeVideoBackend, clock=None, store=None,
                 **config) -> JobService:
    """`store`: one made by the test (e.g. a StalledHeartbeat); else the database's own, on `clock` if given."""
    if store is None:
        store = open_job_store(database_url, clock=clock) if clock else open_job_store(database_url)
    return JobService(
        store=store, outputs=OutputStore(str(tmp_path / "outputs")), backend=backend, models=[TINY],
        config=fast_config(tmp_path, **config),
    )


async def wait_for_job(service: JobService, job_id: str, predicate, what: str) -> JobRecord:
    """Poll until predicate(record) holds; fail naming `what` after WAIT_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while True:
        record = await service.get(job_id, None)
        if predicate(record):
            return record
        assert loop.time() < deadline, f"gave up waiting for {what}; job is {record}"
        await asyncio.sleep(0.01)


async def wait_until(predicate, what: str) -> None:
    """Poll until predicate() holds; fail naming `what` after WAIT_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not predicate():
        assert loop.time() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.01)


def finished(record: JobRecord) -> bool:
    return record.status.is_finished


def output_files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "outputs").iterdir())


async def complete_jobs(service: JobService, count: int) -> list[JobRecord]:
    """Submit `count` jobs (prompts p0, p1, ...), start `service`, wait for every one to finish, stop it."""
    jobs = [await service.submit(make_spec(prompt=f"p{i}"), None) for i in range(count)]
    await service.start()
    try:
        return [await wait_for_job(service, j.id, finished, "completion") for j in jobs]
    finally:
        await service.stop()


# --- Running jobs --------------------------------------------------------------------------------------


def test_jobs_start_in_creation_order_and_complete_with_their_outputs(sqlite_url, tmp_path):
    async def scenario():
        backend = FakeVideoBackend()
        service = make_service(sqlite_url, tmp_path, backend)
        done = await complete_jobs(service, 4)
        assert backend.started == [record.id for record in done]
        for record in done:  # in creation order
            assert (record.status, record.progress, record.attempts, record.error) == (
                JobStatus.COMPLETED, 100, 1, None
            )
            assert record.stats == VideoStats(num_steps=4, num_frames=24, fps=24)
            # The fake's stages take no time; the service adds the queue wait and its own upload (to the total).
            timings = record.timings
            assert timings.model_copy(update={"queued_s": 0.0, "upload_s": 0.0, "total_s": 0.0}) == VideoTimings()
            assert timings.queued_s > 0 and timings.upload_s > 0 and timings.total_s == timings.upload_s
            blob = await service.open_output(record.id, None, VideoVariant.VIDEO)
            assert blob.read(0, blob.size) == fake_mp4(record.spec)
            thumb = await service.open_output(record.id, None, VideoVariant.THUMBNAIL)
            assert thumb.read(0, thumb.size) == fake_png(record.spec)

    asyncio.run(scenario())


def test_two_replicas_share_the_queue_and_run_each_job_once(database_url, tmp_path):
    async def scenario():
        backends = [FakeVideoBackend(step_s=0.002), FakeVideoBackend(step_s=0.002)]
        services = [make_service(database_url, tmp_path, b) for b in backends]
        jobs = [await services[i % 2].submit(make_spec(prompt=f"p{i}"), None) for i in range(10)]
        for service in services:
            await service.start()
        try:
            for job in jobs:
                record = await wait_for_job(services[0], job.id, finished, "completion")
                assert (record.status, record.attempts) == (JobStatus.COMPLETED, 1)
        finally:
            for service in services:
                await service.stop()
        assert sorted(backends[0].started + backends[1].started) == sorted(j.id for j in jobs)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("prompt", "error"),
    [
        ("fail:request", JobError("invalid_request", "prompt: 12 tokens exceed the text encoder's 8 (fake)")),
        ("fail:server", JobError("server_error", "the decoder could not read its weights (fake)")),
        ("fail:crash", JobError("server_error", "RuntimeError: segfault in a fake kernel")),
    ],
)
def test_backend_failures_become_job_errors(sqlite_url, tmp_path, prompt, error):
    async def scenario():
        service = make_service(sqlite_url, tmp_path, FakeVideoBackend())
        job = await service.submit(make_spec(prompt=prompt), None)
        await service.start()
        try:
            record = await wait_for_job(service, job.id, finished, "failure")
        finally:
            await service.stop()
        assert (record.status, record.error, record.output_key) == (JobStatus.FAILED, error, None)

    asyncio.run(scenario())


def test_a_run_longer_than_max_run_s_fails_as_timeout(sqlite_url, tmp_path):
    async def scenario():
        service = make_service(sqlite_url, tmp_path, FakeVideoBackend(hold_before_step=1), max_run_s=0.2)
        job = await service.submit(make_spec(), None)
        await service.start()
        try:
            record = await wait_for_job(service, job.id, finished, "timeout")
        finally:
            await service.stop()
        assert record.error == JobError("timeout", "the run took longer than max_run_s=0.2")

    asyncio.run(scenario())


class FlakyOutputs(OutputStore):
    """An output store whose puts fail while `full` is set (a full disk)."""

    full = True

    def put(self, key, variant, data):
        if self.full:
            raise OSError(28, "No space left on device")
        super().put(key, variant, data)


def test_a_failed_upload_fails_the_job_and_the_runner_goes_on(sqlite_url, tmp_path):
    async def scenario():
        outputs = FlakyOutputs(str(tmp_path / "outputs"))
        service = JobService(store=open_job_store(sqlite_url), outputs=outputs, backend=FakeVideoBackend(),
                             models=[TINY], config=fast_config(tmp_path))
        first = await service.submit(make_spec(), None)
        await service.start()
        try:
            failed = await wait_for_job(service, first.id, finished, "the failed upload")
            outputs.full = False
            second = await service.submit(make_spec(), None)
            done = await wait_for_job(service, second.id, finished, "the next job")
        finally:
            await service.stop()
        assert failed.error == JobError(
            "server_error", "storing the output failed: OSError: [Errno 28] No space left on device"
        )
        assert done.status is JobStatus.COMPLETED
        assert len(output_files(tmp_path)) == 2  # only the second job's MP4 and thumbnail

    asyncio.run(scenario())


class HungOutputs(OutputStore):
    """An output store whose puts block until `unblock()` (a hung network file system); `uploading` is set
    once a put is blocked."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.uploading, self._unblocked = threading.Event(), threading.Event()

    def put(self, key, variant, data):
        self.uploading.set()
        self._unblocked.wait(timeout=2 * WAIT_S)
        super().put(key, variant, data)

    def unblock(self) -> None:
        self._unblocked.set()


def test_a_hung_output_store_fails_the_job_at_max_run_s(sqlite_url, tmp_path):
    """max_run_s bounds the whole run, the upload included: its lease keeper would otherwise renew the lease of a
    job whose upload never returns, and the job would stay in_progress for good."""
    async def scenario():
        outputs = HungOutputs(str(tmp_path / "outputs"))
        service = JobService(store=open_job_store(sqlite_url), outputs=outputs, backend=FakeVideoBackend(),
                             models=[TINY], config=fast_config(tmp_path, max_run_s=1.0))
        job = await service.submit(make_spec(), None)
        await service.start()
        try:
            record = await wait_for_job(service, job.id, finished, "the job to end despite its hung upload")
        finally:
            outputs.unblock()
            await service.stop()
        assert (record.status, record.error) == (
            JobStatus.FAILED, JobError("timeout", "the run took longer than max_run_s=1 (storing its output)")
        )

    asyncio.run(scenario())


class UnansweredComplete:
    """A store whose `complete` raises StoreUnavailable, after committing (the connection dropped before the
    server's answer came back) or not (the server was down): either way the runner cannot tell."""

    def __init__(self, store, committed: bool) -> None:
        self._store, self._committed = store, committed

    def __getattr__(self, name):
        return getattr(self._store, name)

    def complete(self, *args):
        if self._committed:
            self._store.complete(*args)
        raise StoreUnavailable("server closed the connection unexpectedly")


@pytest.mark.parametrize("committed", [True, False])
def test_a_complete_without_an_answer_leaves_the_job_to_the_store(sqlite_url, tmp_path, committed):
    """A runner that does not know whether its complete landed keeps the outputs and writes nothing more. Landed:
    the job is completed with its MP4 (deleting it gave a completed job answering 410). Not landed: its lease
    expires and the reaper fails it with the cause (not "cancelled": nobody cancelled it)."""
    async def scenario():
        service = JobService(store=UnansweredComplete(open_job_store(sqlite_url), committed),
                             outputs=OutputStore(str(tmp_path / "outputs")), backend=FakeVideoBackend(),
                             models=[TINY], config=fast_config(tmp_path))
        job = await service.submit(make_spec(), None)
        await service.start()
        try:
            record = await wait_for_job(service, job.id, finished, "the job to settle")
            await wait_until(lambda: service.num_running == 0, "the run to end")
        finally:
            await service.stop()
        if committed:
            assert record.status is JobStatus.COMPLETED
            blob = await service.open_output(job.id, None, VideoVariant.VIDEO)
            assert blob.read(0, blob.size) == fake_mp4(job.spec)
        else:  # the message depends on whether the lease keeper wrote the last step before the run ended
            assert (record.status, record.error.code) == (JobStatus.FAILED, "worker_lost")
            assert "the replica running it stopped renewing its lease" in record.error.message

    asyncio.run(scenario())


# --- Cancel and delete ---------------------------------------------------------------------------------


def test_cancelling_a_running_job_stops_it_at_the_next_step(sqlite_url, tmp_path):
    async def scenario():
        backend = FakeVideoBackend(hold_before_step=3)
        service = make_service(sqlite_url, tmp_path, backend)
        job = await service.submit(make_spec(), None)
        await service.start()
        try:
            await wait_for_job(service, job.id, lambda r: r.step == 2, "step 2")
            flagged = await service.cancel(job.id, None)
            assert (flagged.status, flagged.cancel_requested) == (JobStatus.IN_PROGRESS, True)
            record = await wait_for_job(service, job.id, finished, "cancellation")
        finally:
            await service.stop()
        assert (record.status, record.step) == (JobStatus.CANCELLED, 2)
        assert backend.steps_done[job.id] == 2
        assert output_files(tmp_path) == []

    asyncio.run(scenario())


def test_a_cancel_on_another_replica_reaches_the_runner(database_url, tmp_path):
    async def scenario():
        backend = FakeVideoBackend(hold_before_step=2)
        runner = make_service(database_url, tmp_path, backend)
        other = make_service(database_url, tmp_path, FakeVideoBackend())  # never started: API only
        job = await other.submit(make_spec(), None)
        await runner.start()
        try:
            await wait_for_job(other, job.id, lambda r: r.step == 1, "step 1")
            await other.cancel(job.id, None)  # the runner learns it at its next lease renewal
            record = await wait_for_job(other, job.id, finished, "cancellation")
        finally:
            await runner.stop()
        assert (record.status, backend.steps_done[job.id]) == (JobStatus.CANCELLED, 1)

    asyncio.run(scenario())


def test_deleting_a_running_job_discards_its_output(sqlite_url, tmp_path):
    async def scenario():
        backend = FakeVideoBackend(hold_before_step=2)
        service = make_service(sqlite_url, tmp_path, backend)
        job = await service.submit(make_spec(), None)
        await service.start()
        try:
            await wait_for_job(service, job.id, lambda r: r.step == 1, "step 1")
            deleted = await service.delete(job.id, None)
            assert deleted.id == job.id
            backend.release()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + WAIT_S
            while service.num_running:
                assert loop.time() < deadline, "the deleted job kept running"
                await asyncio.sleep(0.01)
        finally:
            await service.stop()
        assert await asyncio.to_thread(service._store.get, job.id) is None
        assert backend.steps_done[job.id] == 1
        assert output_files(tmp_path) == []

    asyncio.run(scenario())


# --- Admission -----------------------------------------------------------------------------------------


def test_a_full_queue_refuses_with_a_retry_after_from_recent_runs(sqlite_url, tmp_path):
    async def scenario():
        clock = FakeClock()
        service = make_service(sqlite_url, tmp_path, FakeVideoBackend(), clock=clock, max_queued_per_model=1,
                               default_retry_after_s=30)
        store = service._store
        await service.submit(make_spec(), None)
        with pytest.raises(QueueFull) as full:
            await service.submit(make_spec(), None)
        assert full.value.retry_after_s == 30  # no run finished yet: the configured default

        for run_s in (12.0, 18.0):  # history: runs of 12 s and 18 s, mean 15 s
            job = store.claim(["tiny"], "r", 60)
            clock.advance(run_s)
            store.complete(job.id, "r", "k", VideoTimings(), VideoStats(), 100)
            await service.submit(make_spec(), None)
        store.claim(["tiny"], "r", 60)  # one running
        await service.submit(make_spec(), None)
        with pytest.raises(QueueFull) as full:
            await service.submit(make_spec(), None)
        assert full.value.retry_after_s == 15  # mean run / running jobs
        assert str(full.value) == "the queue of model 'tiny' is full (1 queued, max_queued_per_model=1); retry later"

    asyncio.run(scenario())


# --- Crashes, shutdown, restart ------------------------------------------------------------------------

KILLABLE_REPLICA = """
import asyncio, sys
from jobs.config import JobsConfig
from engine.limits import ModelLimits
from jobs.outputs import OutputStore
from jobs.service import JobService, open_job_service
from jobs.store import open_job_store
from tests.jobs_support import FakeVideoBackend

async def main():
    service = JobService(
        store=open_job_store(sys.argv[1]), outputs=OutputStore(sys.argv[2]),
        backend=FakeVideoBackend(hold_before_step=int(sys.argv[3])),
        models=[ModelLimits.model_validate_json(sys.argv[4])], config=JobsConfig.model_validate_json(sys.argv[5]),
    )
    await service.start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.parametrize(
    ("hold_before_step", "expected"),
    [
        (1, "retried"),  # killed before its first step: a second run completes it
        (3, "failed"),  # killed after step 2: failed with the cause
    ],
)
def test_a_replica_killed_mid_job(database_url, tmp_path, hold_before_step, expected):
    async def scenario():
        config = fast_config(tmp_path)
        survivor_backend = FakeVideoBackend()
        survivor = make_service(database_url, tmp_path, survivor_backend)
        job = await survivor.submit(make_spec(), None)
        doomed = subprocess.Popen(
            [sys.executable, "-c", KILLABLE_REPLICA, database_url, str(tmp_path / "outputs"), str(hold_before_step),
             TINY.model_dump_json(), config.model_dump_json()],
            cwd=REPO, stderr=subprocess.PIPE,
        )
        try:
            await wait_for_job(survivor, job.id, lambda r: r.status is JobStatus.IN_PROGRESS
                               and r.step == hold_before_step - 1, f"the doomed replica at step {hold_before_step - 1}")
        finally:
            os.kill(doomed.pid, signal.SIGKILL)
            doomed.wait(timeout=30)
        await survivor.start()  # its reaper finds the expired lease
        try:
            record = await wait_for_job(survivor, job.id, finished, "the reaper's verdict")
        finally:
            await survivor.stop()
        if expected == "retried":
            assert (record.status, record.attempts, survivor_backend.started) == (JobStatus.COMPLETED, 2, [job.id])
        else:
            assert (record.status, record.attempts, survivor_backend.started) == (JobStatus.FAILED, 1, [])
            assert record.error == JobError(
                "worker_lost", "lost at step 2/4 of run 1: the replica running it stopped renewing its lease"
            )

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("hold_before_step", "expected_status", "expected_error"),
    [
        (1, JobStatus.QUEUED, None),
        (3, JobStatus.FAILED, JobError("worker_lost", "lost at step 2/4 of run 1: the replica running it shut down")),
    ],
)
def test_stopping_a_replica_gives_its_running_job_back_at_once(
    sqlite_url, tmp_path, hold_before_step, expected_status, expected_error
):
    async def scenario():
        service = make_service(sqlite_url, tmp_path, FakeVideoBackend(hold_before_step=hold_before_step),
                               lease_s=600)  # no lease expiry: the release is what settles it
        job = await service.submit(make_spec(), None)
        await service.start()
        try:
            await wait_for_job(service, job.id, lambda r: r.status is JobStatus.IN_PROGRESS
                               and r.step == hold_before_step - 1, f"step {hold_before_step - 1}")
        finally:
            await service.stop()
        record = await service.get(job.id, None)
        assert (record.status, record.error, record.lease_owner) == (expected_status, expected_error, None)

    asyncio.run(scenario())


def test_stopping_a_replica_while_it_stores_an_output_gives_the_job_back_at_once(sqlite_url, tmp_path):
    """The denoising is over and the MP4 is being written when the replica stops: the job is released like one
    stopped mid-run (failed with the cause), not left in_progress under a lease nobody renews."""
    async def scenario():
        outputs = HungOutputs(str(tmp_path / "outputs"))
        service = JobService(store=open_job_store(sqlite_url), outputs=outputs, backend=FakeVideoBackend(),
                             models=[TINY], config=fast_config(tmp_path, lease_s=600))  # no lease expiry
        job = await service.submit(make_spec(), None)
        await service.start()
        try:
            await wait_until(outputs.uploading.is_set, "the upload")
            await wait_for_job(service, job.id, lambda r: r.step == 4, "the last step recorded")
        finally:
            await service.stop()
            outputs.unblock()
        record = await service.get(job.id, None)
        assert (record.status, record.error, record.lease_owner) == (
            JobStatus.FAILED, JobError("worker_lost", "lost at step 4/4 of run 1: the replica running it shut down"),
            None,
        )

    asyncio.run(scenario())


class StalledHeartbeat:
    """A store whose lease renewals and progress writes hang while `stalled` is set (a paused process, a
    heartbeat that cannot get through); every other operation goes through."""

    def __init__(self, store) -> None:
        self._store = store
        self.stalled, self._resumed = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._store, name)

    def _stall(self) -> None:
        if self.stalled.is_set():  # until resume(): a renewal that timed out would end the stall early
            self._resumed.wait(timeout=STALL_LIMIT_S)

    def renew_lease(self, *args):
        self._stall()
        return self._store.renew_lease(*args)

    def set_progress(self, *args):
        self._stall()
        return self._store.set_progress(*args)

    def resume(self) -> None:
        self._resumed.set()


async def run_then_lose_the_lease(service: JobService, store: StalledHeartbeat, backend: FakeVideoBackend,
                                  clock: FakeClock) -> JobRecord:
    """Submit a job to `service` and start it with its heartbeat stalled; once its first run began, let the
    lease expire. Stalled from the start: a renewal already past the stall check when it was set would still
    reach the store later, answer LOST and stop the run (under load, after the other replica's retry)."""
    job = await service.submit(make_spec(), None)
    store.stalled.set()
    await service.start()
    await wait_until(lambda: backend.started == [job.id], "the first run")
    clock.advance(LEASE_S + 1)
    return job


def test_a_runner_that_lost_its_lease_cannot_overwrite_the_retry(database_url, tmp_path):
    """Replica A's heartbeat stalls before the job's first step; its lease expires, the job is retried and completed
    by replica B; then A's run finishes after all. A's late complete is refused and only its own files are removed:
    the job keeps B's outcome and B's MP4."""
    async def scenario():
        clock = FakeClock()
        store_a = StalledHeartbeat(open_job_store(database_url, clock=clock))
        backend_a, backend_b = FakeVideoBackend(hold_before_step=1), FakeVideoBackend()
        a = make_service(database_url, tmp_path, backend_a, store=store_a)
        b = make_service(database_url, tmp_path, backend_b, clock=clock)
        try:
            job = await run_then_lose_the_lease(a, store_a, backend_a, clock)
            await b.start()
            done = await wait_for_job(b, job.id, finished, "B to complete the retry")
            backend_a.release()
            await wait_until(lambda: a.num_running == 0, "A's late run to end")
        finally:
            store_a.resume()
            await a.stop()
            await b.stop()
        (_, key_a), (_, key_b) = backend_a.runs[0], backend_b.runs[0]
        assert (done.status, done.attempts, done.output_key) == (JobStatus.COMPLETED, 2, key_b)
        assert backend_a.steps_done[job.id] == 4  # A did run to the end
        assert await b.get(job.id, None) == done
        assert output_files(tmp_path) == [f"{key_b}.mp4", f"{key_b}.png"] and key_a != key_b
        blob = await b.open_output(job.id, None, VideoVariant.VIDEO)
        assert blob.read(0, blob.size) == fake_mp4(job.spec)

    asyncio.run(scenario())


def test_a_replica_that_runs_the_retry_of_its_own_lost_run_keeps_track_of_it(sqlite_url, tmp_path, caplog):
    """A replica's heartbeat stalls, its own reaper retries the job and its second runner takes the retry; when
    the lost first run ends, the retry is still this replica's running job (cancel's fast path reaches it, and its
    own end is clean)."""
    async def scenario():
        clock = FakeClock()
        store = StalledHeartbeat(open_job_store(sqlite_url, clock=clock))
        backend = FakeVideoBackend(hold_before_step=1)
        service = make_service(sqlite_url, tmp_path, backend, store=store, concurrency=2)
        try:
            job = await run_then_lose_the_lease(service, store, backend, clock)
            await wait_until(lambda: backend.started == [job.id, job.id], "the retry on the second runner")
            store.resume()  # the first run learns it lost the job and stops
            await wait_until(lambda: len(service._runs) == 1, "the lost run to end")
            assert service.num_running == 1
            backend.release()
            done = await wait_for_job(service, job.id, finished, "the retry to complete")
            await wait_until(lambda: service.num_running == 0, "the retry to end")
        finally:
            store.resume()
            await service.stop()
        assert (done.status, done.attempts) == (JobStatus.COMPLETED, 2)
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []

    asyncio.run(scenario())


def test_a_restarted_service_sees_old_jobs_and_their_content(database_url, tmp_path):
    async def scenario():
        first = make_service(database_url, tmp_path, FakeVideoBackend())
        job = await first.submit(make_spec(), "owner-a")
        await first.start()
        try:
            await wait_for_job(first, job.id, finished, "completion")
        finally:
            await first.stop()
            first._store.close()

        second = make_service(database_url, tmp_path, FakeVideoBackend())
        record = await second.get(job.id, "owner-a")
        assert (record.status, record.owner) == (JobStatus.COMPLETED, "owner-a")
        blob = await second.open_output(job.id, "owner-a", VideoVariant.VIDEO)
        assert blob.read(0, blob.size) == fake_mp4(job.spec)
        assert [j.id for j in (await second.list_jobs("owner-a", limit=10)).jobs] == [job.id]

    asyncio.run(scenario())


# --- Retention and watching ----------------------------------------------------------------------------


def test_outputs_past_retention_are_deleted_and_answer_expired(sqlite_url, tmp_path):
    async def scenario():
        clock = FakeClock()
        service = make_service(sqlite_url, tmp_path, FakeVideoBackend(), clock=clock, retention_s=3600)
        job = await service.submit(make_spec(), None)
        await service.start()
        try:
            await wait_for_job(service, job.id, finished, "completion")
        finally:
            await service.stop()
        assert len(output_files(tmp_path)) == 2  # the MP4 and the thumbnail
        clock.advance(3600)
        await service.reap_once()
        assert output_files(tmp_path) == []
        with pytest.raises(OutputExpired):
            await service.open_output(job.id, None, VideoVariant.VIDEO)
        assert (await service.get(job.id, None)).status is JobStatus.COMPLETED  # the record stays

    asyncio.run(scenario())


class OneFailedDelete(OutputStore):
    """An output store whose first delete fails (an object store's transient error)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.failed: list[str] = []

    def delete(self, key):
        if not self.failed:
            self.failed.append(key)
            raise OSError(5, "Input/output error")
        super().delete(key)


def test_one_output_that_fails_to_delete_does_not_keep_the_others_past_retention(sqlite_url, tmp_path):
    """Retention forgets a batch of keys, then deletes their files: a failed delete is logged and the rest of the
    batch is still deleted (they would stay in the output store for good: no record names them any more)."""
    async def scenario():
        clock = FakeClock()
        outputs = OneFailedDelete(str(tmp_path / "outputs"))
        service = JobService(store=open_job_store(sqlite_url, clock=clock), outputs=outputs,
                             backend=FakeVideoBackend(), models=[TINY], config=fast_config(tmp_path, retention_s=3600))
        done = await complete_jobs(service, 3)
        clock.advance(3600)
        await service.reap_once()
        assert outputs.failed == [done[0].output_key]
        assert output_files(tmp_path) == [f"{done[0].output_key}.mp4", f"{done[0].output_key}.png"]

    asyncio.run(scenario())


@pytest.mark.parametrize("max_queued_s", [3600.0, None])
def test_a_job_no_replica_takes_fails_as_queue_timeout_after_max_queued_s(database_url, tmp_path, max_queued_s):
    """A job of a model the fleet no longer serves is never claimed: it fails as queue_timeout max_queued_s after
    it was created instead of staying queued for good; younger jobs wait on and run. null keeps it queued."""
    async def scenario():
        clock = FakeClock()
        store = open_job_store(database_url, clock=clock)
        orphan = store.create(make_spec().model_copy(update={"model": "retired-model"}), None, 16)
        clock.advance(1800)
        service = make_service(database_url, tmp_path, FakeVideoBackend(), clock=clock, max_queued_s=max_queued_s)
        young = await service.submit(make_spec(), None)
        clock.advance(1800 + 1)
        await service.reap_once()
        record = await service.get(orphan.id, None)
        if max_queued_s is None:
            assert record.status is JobStatus.QUEUED
        else:
            assert (record.status, record.error.code) == (JobStatus.FAILED, "queue_timeout")
            assert "jobs.max_queued_s=3600" in record.error.message and record.completed_at == clock.now
        assert (await service.get(young.id, None)).status is JobStatus.QUEUED  # 1801 s old: waits on
        await service.start()
        try:
            done = await wait_for_job(service, young.id, finished, "the younger job to run")
        finally:
            await service.stop()
        store.close()
        assert done.status is JobStatus.COMPLETED

    asyncio.run(scenario())


def test_watch_follows_a_job_to_its_end(sqlite_url, tmp_path):
    async def scenario():
        service = make_service(sqlite_url, tmp_path, FakeVideoBackend(step_s=0.02), heartbeat_s=0.1)
        job = await service.submit(make_spec(steps=5), None)
        await service.start()
        try:
            seen = [r async for r in service.watch(job.id, None)]
        finally:
            await service.stop()
        assert seen[0].status is JobStatus.QUEUED or seen[0].status is JobStatus.IN_PROGRESS
        assert seen[-1].status is JobStatus.COMPLETED and seen[-1].progress == 100
        progress = [r.progress for r in seen]
        assert progress == sorted(progress)  # never backwards
        assert len({r.step for r in seen}) >= 3  # intermediate steps were seen, not just start and end

    asyncio.run(scenario())


def test_other_owners_jobs_are_not_found(sqlite_url, tmp_path):
    async def scenario():
        service = make_service(sqlite_url, tmp_path, FakeVideoBackend())
        job = await service.submit(make_spec(), "owner-a")
        for operation in (service.get, service.cancel, service.delete):
            with pytest.raises(JobNotFound):
                await operation(job.id, "owner-b")
        assert (await service.get(job.id, None)).id == job.id  # auth off: everything visible

    asyncio.run(scenario())


def test_the_default_config_keeps_jobs_and_outputs_under_state_dir(tmp_path):
    async def scenario():
        service = open_job_service(fast_config(tmp_path / "state"), FakeVideoBackend(), [TINY])
        job = await service.submit(make_spec(), None)
        await service.start()
        try:
            done = await wait_for_job(service, job.id, finished, "completion")
        finally:
            await service.stop()
        assert (tmp_path / "state" / "jobs.sqlite3").is_file()
        assert sorted(p.name for p in (tmp_path / "state" / "outputs").iterdir()) == [
            f"{done.output_key}.mp4", f"{done.output_key}.png"
        ]

    asyncio.run(scenario())


# --- A worker that dies mid-job ------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, status, attempts, error", [
    # no denoising step had run: the job runs again (once) and completes
    ("fail:worker-once@1", JobStatus.COMPLETED, 2, None),
    # no step ran on either run: failed after max_attempts, with the cause
    ("fail:worker@1", JobStatus.FAILED, 2, JobError(
        "worker_lost", "lost before its first step on each of its 2 runs: the worker replica died (fake, before step 1)")),
    # steps had run: never retried (the work is not repeated silently), failed with the step and the cause
    ("fail:worker-once@3", JobStatus.FAILED, 1, JobError(
        "worker_lost", "lost at step 2/4 of run 1: the worker replica died (fake, before step 3)")),
])
def test_a_job_whose_worker_died_is_retried_only_when_no_step_had_run(sqlite_url, tmp_path, prompt, status, attempts,
                                                                        error):
    async def scenario():
        backend = FakeVideoBackend()
        service = make_service(sqlite_url, tmp_path, backend, max_attempts=2)
        job = await service.submit(make_spec(prompt=prompt), None)
        await service.start()
        try:
            record = await wait_for_job(service, job.id, finished, "the job to settle")
        finally:
            await service.stop()
        assert (record.status, record.attempts, record.error) == (status, attempts, error)
        assert backend.started == [job.id] * attempts
        assert (output_files(tmp_path) != []) == (status is JobStatus.COMPLETED)

    asyncio.run(scenario())


def test_a_runner_takes_the_next_job_while_the_previous_one_decodes(sqlite_url, tmp_path):
    """One runner (concurrency 1): job k+1 starts denoising as soon as job k's denoiser is free, while job k
    still decodes; job k+2 waits until job k has finished decoding (one job decoding per runner)."""
    async def scenario():
        backend = FakeVideoBackend(step_s=0.01, decode_s=1.0)
        service = make_service(sqlite_url, tmp_path, backend, concurrency=1)
        jobs = [await service.submit(make_spec(prompt=f"p{i}"), None) for i in range(3)]
        await service.start()
        try:
            done = [await wait_for_job(service, j.id, finished, "completion") for j in jobs]
        finally:
            await service.stop()
        assert [r.status for r in done] == [JobStatus.COMPLETED] * 3
        at = {(job_id, name): t for job_id, name, t in backend.events}
        first, second, third = (j.id for j in jobs)
        # overlap: the second job denoised while the first decoded
        assert at[(second, "denoise_start")] < at[(first, "decode_end")]
        # bound: the third waited for the first's decode
        assert at[(third, "denoise_start")] >= at[(first, "decode_end")]
        assert backend.started == [first, second, third]

    asyncio.run(scenario())
