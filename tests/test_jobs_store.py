"""The job store's contract, on SQLite and on a real PostgreSQL server (started by scripts/postgres).

Time is a FakeClock: leases expire because the test moves time, never because it slept. The PostgreSQL
tests fail (not skip) when the server cannot be started.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest

from jobs.backend import VideoSpec, VideoStats, VideoTimings
from jobs.errors import JobConflict, JobNotFound, QueueFull
from jobs.media import KeyframeMedia, ReferenceMedia, VideoMedia
from jobs.postgres_store import PostgresJobStore
from jobs.records import JobError, JobStatus, LeaseStatus
from jobs.sqlite_store import SqliteJobStore
from jobs.store import open_job_store
from tests.jobs_support import FakeClock, reset_postgres

# 600: the first PostgreSQL test may install Debian's postgresql package (scripts/postgres) on a fresh machine.
pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[1]
LEASE_S = 30.0
RETENTION_S = 100.0
BIG_QUEUE = 1000


def make_spec(model: str = "m1", prompt: str = "a lighthouse", steps: int = 4) -> VideoSpec:
    return VideoSpec(
        model=model, prompt=prompt, seconds=5.0, width=64, height=32, num_inference_steps=steps, seed=7,
        flow_shift=12.0, audio_flow_shift=3.0, quality="lossless",
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def open_store(database_url, clock):
    """open_store() -> a new store (own connection) on the test's database; all closed at the end."""
    stores = []

    def open_store():
        store = open_job_store(database_url, clock=clock)
        stores.append(store)
        return store

    yield open_store
    for store in stores:
        store.close()


@pytest.fixture
def store(open_store):
    return open_store()


def test_open_job_store_picks_the_implementation(database_url, store):
    expected = SqliteJobStore if database_url.startswith("sqlite") else PostgresJobStore
    assert type(store) is expected


def test_open_job_store_rejects_other_urls():
    with pytest.raises(ValueError, match="expected sqlite:///PATH or postgresql://"):
        open_job_store("mysql://localhost/jobs")


# --- Uploads (keyframes, references) -------------------------------------------------------------------

MEDIA = VideoMedia(keyframes=(KeyframeMedia(field="input_references[0]", image=b"\x89PNG first", frame_index=0),
                              KeyframeMedia(field="input_references[1]", image=bytes(range(256)), frame_index=-1)))


def media_spec(media: VideoMedia = MEDIA, **fields) -> VideoSpec:
    return make_spec(**fields).model_copy(update={"media": media, "task": media.task, "size_given": False})


def test_a_jobs_uploads_are_kept_apart_and_only_its_claim_reads_them(store):
    job = store.create(media_spec(), None, BIG_QUEUE)
    assert job.spec.media is None and store.get(job.id).spec.media is None  # reads and lists stay small
    assert store.list_jobs(None, 10).jobs[0].spec.media is None
    claimed = store.claim(["m1"], "runner-a", LEASE_S)
    assert claimed.spec.media == MEDIA and claimed.spec.task == "fl2va" and claimed.spec.size == "auto"


def test_uploads_survive_a_restart_and_a_retry(open_store, clock):
    """Accepted is never lost: a new store on the same database claims the job with its bytes, and a job whose
    replica died before its first step runs again from them."""
    job = open_store().create(media_spec(), None, BIG_QUEUE)
    restarted = open_store()
    assert restarted.claim(["m1"], "runner-a", LEASE_S).spec.media == MEDIA
    clock.advance(LEASE_S + 1)
    assert restarted.reap(max_attempts=2).retried == [job.id]
    assert restarted.purge_media() == 0  # queued again: it keeps its uploads
    assert restarted.claim(["m1"], "runner-b", LEASE_S).spec.media == MEDIA


def test_finished_and_deleted_jobs_drop_their_uploads(store):
    references = VideoMedia(references=(ReferenceMedia(field="image_reference", kind="image", data=b"img"),))
    done, waiting, deleted = (store.create(media_spec(m), None, BIG_QUEUE) for m in (MEDIA, references, MEDIA))
    running = store.claim(["m1"], "runner-a", LEASE_S)
    assert running.id == done.id
    assert store.purge_media() == 0  # one running, two queued
    store.fail(done.id, "runner-a", JobError("server_error", "boom"))
    store.delete(deleted.id)
    assert store.purge_media() == 1  # the failed job's (the deleted one's went with its record)
    assert store.claim(["m1"], "runner-b", LEASE_S).spec.media == references  # the queued one kept its own
    assert waiting.id != done.id


# --- Creation, admission, queue position -------------------------------------------------------------


def test_created_jobs_are_queued_with_unguessable_ids(store, clock):
    records = [store.create(make_spec(), owner=None, max_queued=BIG_QUEUE) for _ in range(50)]
    assert all(re.fullmatch(r"video_[A-Za-z0-9_-]{22}", r.id) for r in records)
    assert len({r.id for r in records}) == 50
    first = records[0]
    assert (first.status, first.progress, first.attempts, first.created_at) == (JobStatus.QUEUED, 0, 0, clock.now)
    assert (first.started_at, first.completed_at, first.error, first.output_key) == (None, None, None, None)
    assert first.spec == make_spec()
    assert store.get(first.id) == first


def test_get_unknown_id_is_none(store):
    assert store.get("video_" + "A" * 22) is None


def test_queue_position_counts_earlier_queued_jobs_of_the_same_model(store):
    a1, b1, a2, a3 = (store.create(make_spec(m), None, BIG_QUEUE) for m in ("m1", "m2", "m1", "m1"))
    assert [store.get(j.id).jobs_ahead for j in (a1, b1, a2, a3)] == [0, 0, 1, 2]
    running = store.claim(["m1"], "runner", LEASE_S)
    assert running.id == a1.id and running.jobs_ahead is None  # not queued: no position
    assert [store.get(j.id).jobs_ahead for j in (a2, a3)] == [0, 1]


def test_queue_is_bounded_per_model(store):
    for _ in range(2):
        store.create(make_spec("m1"), None, max_queued=2)
    with pytest.raises(QueueFull) as full:
        store.create(make_spec("m1"), None, max_queued=2)
    assert (full.value.model, full.value.num_queued, full.value.limit) == ("m1", 2, 2)
    store.create(make_spec("m2"), None, max_queued=2)  # another model's queue is its own
    store.claim(["m1"], "runner", LEASE_S)  # a running job no longer counts
    store.create(make_spec("m1"), None, max_queued=2)


def test_admission_is_exact_under_concurrent_creates(open_store):
    """16 threads on 4 connections race to create; exactly max_queued get in."""
    stores = [open_store() for _ in range(4)]
    admitted, refused = [], []
    lock = threading.Lock()

    def create(store):
        try:
            record = store.create(make_spec(), None, max_queued=5)
            with lock:
                admitted.append(record.id)
        except QueueFull:
            with lock:
                refused.append(1)

    threads = [threading.Thread(target=create, args=(stores[i % 4],)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (len(admitted), len(refused)) == (5, 11)


# --- Claims and leases ---------------------------------------------------------------------------------


def test_claim_takes_the_oldest_queued_job_of_the_served_models(store, clock):
    jobs = [store.create(make_spec(m), None, BIG_QUEUE) for m in ("m1", "m2", "m1", "m3")]
    assert store.claim(["m2", "m3"], "r1", LEASE_S).id == jobs[1].id
    assert store.claim(["m1", "m3"], "r1", LEASE_S).id == jobs[0].id
    assert store.claim(["m1", "m3"], "r1", LEASE_S).id == jobs[2].id
    assert store.claim(["m1", "m3"], "r1", LEASE_S).id == jobs[3].id
    assert store.claim(["m1", "m2", "m3"], "r1", LEASE_S) is None
    assert store.claim([], "r1", LEASE_S) is None


def test_claim_starts_a_run_under_a_lease(store, clock):
    job = store.create(make_spec(), None, BIG_QUEUE)
    clock.advance(5)
    claimed = store.claim(["m1"], "r1", LEASE_S)
    assert claimed.status is JobStatus.IN_PROGRESS
    assert (claimed.started_at, claimed.lease_owner, claimed.lease_expires_at) == (clock.now, "r1", clock.now + LEASE_S)
    assert (claimed.attempts, claimed.step, claimed.progress) == (1, 0, 0)
    assert claimed.created_at == job.created_at


def test_progress_renews_the_lease_and_stays_below_100(store, clock):
    job = store.create(make_spec(), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    clock.advance(10)
    assert store.set_progress(job.id, "r1", 3, 4, LEASE_S) is LeaseStatus.HELD
    record = store.get(job.id)
    assert (record.step, record.num_steps, record.progress, record.lease_expires_at) == (3, 4, 75, clock.now + LEASE_S)
    store.set_progress(job.id, "r1", 4, 4, LEASE_S)
    assert store.get(job.id).progress == 99  # 100 means the MP4 is ready
    clock.advance(10)
    assert store.renew_lease(job.id, "r1", LEASE_S) is LeaseStatus.HELD
    assert store.get(job.id).lease_expires_at == clock.now + LEASE_S


def test_progress_outside_the_step_range_is_refused(store):
    job = store.create(make_spec(), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    with pytest.raises(ValueError, match="step=5 must be within 0..num_steps=4"):
        store.set_progress(job.id, "r1", 5, 4, LEASE_S)


def test_only_the_lease_holder_writes(store):
    job = store.create(make_spec(), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    before = store.get(job.id)
    assert store.renew_lease(job.id, "r2", LEASE_S) is LeaseStatus.LOST
    assert store.set_progress(job.id, "r2", 2, 4, LEASE_S) is LeaseStatus.LOST
    assert not store.complete(job.id, "r2", "key", VideoTimings(), VideoStats(), RETENTION_S)
    assert not store.fail(job.id, "r2", JobError("server_error", "x"))
    assert not store.finish_cancelled(job.id, "r2")
    assert store.release(job.id, "r2", max_attempts=2) is None
    assert store.get(job.id) == before


def test_complete_records_output_timings_stats_and_retention(store, clock):
    job = store.create(make_spec(), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    clock.advance(12)
    timings = VideoTimings(encode_s=0.5, denoise_s=10.0, decode_s=1.0, mux_s=0.25, total_s=11.75)
    stats = VideoStats(num_steps=4, num_frames=120, fps=24, audio_sample_rate=32000, plan_cache_hits=3)
    assert store.complete(job.id, "r1", f"{job.id}-abcd", timings, stats, RETENTION_S)
    done = store.get(job.id)
    assert (done.status, done.progress, done.completed_at) == (JobStatus.COMPLETED, 100, clock.now)
    assert (done.output_key, done.output_expires_at) == (f"{job.id}-abcd", clock.now + RETENTION_S)
    assert (done.timings, done.stats) == (timings, stats)
    assert (done.lease_owner, done.lease_expires_at) == (None, None)
    assert store.renew_lease(job.id, "r1", LEASE_S) is LeaseStatus.LOST  # finished: nobody holds it


class NewerStats(VideoStats):
    """The stats a newer ditserve writes: a counter this code has no field for."""

    future_counter: int = 7


class NewerTimings(VideoTimings):
    future_s: float = 1.5


def test_a_job_a_newer_replica_finished_reads_with_the_fields_this_code_knows(store, clock):
    """A rolling update or a rollback shares the store between versions: their extra report fields are left out
    (the API's models forbid unknown fields), not a failed read of the job."""
    job = store.create(make_spec(), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    stats, timings = NewerStats(num_steps=4, plan_cache_hits=3), NewerTimings(denoise_s=10.0, total_s=10.0)
    assert store.complete(job.id, "r1", "key", timings, stats, RETENTION_S)
    done = store.get(job.id)
    assert done.stats == VideoStats(num_steps=4, plan_cache_hits=3)
    assert done.timings == VideoTimings(denoise_s=10.0, total_s=10.0)


def test_fail_records_the_error(store, clock):
    job = store.create(make_spec(), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    assert store.fail(job.id, "r1", JobError("invalid_request", "prompt: too long"))
    failed = store.get(job.id)
    assert (failed.status, failed.error, failed.completed_at) == (
        JobStatus.FAILED, JobError("invalid_request", "prompt: too long"), clock.now
    )


# --- Cancel and delete ---------------------------------------------------------------------------------


def test_cancel_of_a_queued_job_is_immediate(store, clock):
    job = store.create(make_spec(), None, BIG_QUEUE)
    cancelled = store.cancel(job.id)
    assert (cancelled.status, cancelled.completed_at) == (JobStatus.CANCELLED, clock.now)
    assert store.claim(["m1"], "r1", LEASE_S) is None


def test_cancel_of_a_running_job_flags_it_for_its_runner(store):
    job = store.create(make_spec(), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    flagged = store.cancel(job.id)
    assert (flagged.status, flagged.cancel_requested) == (JobStatus.IN_PROGRESS, True)
    assert store.set_progress(job.id, "r1", 1, 4, LEASE_S) is LeaseStatus.CANCEL_REQUESTED
    assert store.renew_lease(job.id, "r1", LEASE_S) is LeaseStatus.CANCEL_REQUESTED
    # A run that finished anyway may not complete: the cancel wins.
    assert not store.complete(job.id, "r1", "key", VideoTimings(), VideoStats(), RETENTION_S)
    assert store.finish_cancelled(job.id, "r1")
    assert store.get(job.id).status is JobStatus.CANCELLED


@pytest.mark.parametrize("finish", ["complete", "fail", "cancel"])
def test_cancel_of_a_finished_job_is_a_conflict(store, finish):
    job = store.create(make_spec(), None, BIG_QUEUE)
    if finish == "cancel":
        store.cancel(job.id)
    else:
        store.claim(["m1"], "r1", LEASE_S)
        if finish == "complete":
            store.complete(job.id, "r1", "key", VideoTimings(), VideoStats(), RETENTION_S)
        else:
            store.fail(job.id, "r1", JobError("server_error", "boom"))
    with pytest.raises(JobConflict, match="is already"):
        store.cancel(job.id)


def test_cancel_of_an_unknown_job_is_not_found(store):
    with pytest.raises(JobNotFound):
        store.cancel("video_" + "B" * 22)


def test_delete_removes_the_record_and_its_runner_loses_the_lease(store):
    job = store.create(make_spec(), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    deleted = store.delete(job.id)
    assert deleted.id == job.id and deleted.status is JobStatus.IN_PROGRESS
    assert store.get(job.id) is None
    assert store.set_progress(job.id, "r1", 1, 4, LEASE_S) is LeaseStatus.LOST
    assert not store.complete(job.id, "r1", "key", VideoTimings(), VideoStats(), RETENTION_S)
    assert store.delete(job.id) is None


# --- Listing -------------------------------------------------------------------------------------------


def test_list_is_newest_first_with_a_cursor(store, clock):
    ids = []
    for i in range(5):
        ids.append(store.create(make_spec(prompt=f"p{i}"), None, BIG_QUEUE).id)
        clock.advance(1)
    page = store.list_jobs(None, limit=2)
    assert ([j.id for j in page.jobs], page.has_more) == ([ids[4], ids[3]], True)
    page = store.list_jobs(None, limit=2, after=ids[3])
    assert ([j.id for j in page.jobs], page.has_more) == ([ids[2], ids[1]], True)
    page = store.list_jobs(None, limit=2, after=ids[1])
    assert ([j.id for j in page.jobs], page.has_more) == ([ids[0]], False)
    assert store.list_jobs(None, limit=10).jobs[0].jobs_ahead == 4  # positions in listings too


def test_list_shows_an_owner_only_its_own_jobs(store):
    mine = [store.create(make_spec(), "owner-a", BIG_QUEUE).id for _ in range(2)]
    theirs = store.create(make_spec(), "owner-b", BIG_QUEUE).id
    assert [j.id for j in store.list_jobs("owner-a", limit=10).jobs] == mine[::-1]
    assert [j.id for j in store.list_jobs("owner-b", limit=10).jobs] == [theirs]
    assert len(store.list_jobs(None, limit=10).jobs) == 3  # no owner filter: auth is off
    with pytest.raises(JobNotFound):
        store.list_jobs("owner-a", limit=10, after=theirs)  # another owner's id is no cursor
    with pytest.raises(JobNotFound):
        store.list_jobs(None, limit=10, after="video_" + "C" * 22)


# --- Reaping expired leases ----------------------------------------------------------------------------


def test_an_unexpired_lease_is_not_reaped(store, clock):
    job = store.create(make_spec(), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    clock.advance(LEASE_S - 1)
    report = store.reap(max_attempts=2)
    assert report.job_ids == []
    assert store.get(job.id).status is JobStatus.IN_PROGRESS


def test_a_job_lost_before_its_first_step_is_retried_once_at_its_place_in_line(store, clock):
    job = store.create(make_spec(), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    later = store.create(make_spec(), None, BIG_QUEUE)
    clock.advance(LEASE_S + 1)
    assert store.reap(max_attempts=2).retried == [job.id]
    requeued = store.get(job.id)
    assert (requeued.status, requeued.jobs_ahead, requeued.attempts, requeued.lease_owner) == (
        JobStatus.QUEUED, 0, 1, None
    )
    assert store.get(later.id).jobs_ahead == 1  # the retried job runs first
    assert store.renew_lease(job.id, "r1", LEASE_S) is LeaseStatus.LOST  # the lost runner cannot write

    assert store.claim(["m1"], "r2", LEASE_S).id == job.id
    clock.advance(LEASE_S + 1)
    report = store.reap(max_attempts=2)
    assert (report.retried, report.failed) == ([], [job.id])
    failed = store.get(job.id)
    assert (failed.status, failed.attempts) == (JobStatus.FAILED, 2)
    assert failed.error == JobError(
        "worker_lost", "lost before its first step on each of its 2 runs: the replica running it stopped renewing "
        "its lease",
    )


def test_a_job_lost_after_a_step_fails_with_the_cause(store, clock):
    job = store.create(make_spec(steps=5), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    store.set_progress(job.id, "r1", 3, 5, LEASE_S)
    clock.advance(LEASE_S + 1)
    assert store.reap(max_attempts=2).failed == [job.id]
    failed = store.get(job.id)
    assert (failed.status, failed.completed_at) == (JobStatus.FAILED, clock.now)
    assert failed.error == JobError(
        "worker_lost", "lost at step 3/5 of run 1: the replica running it stopped renewing its lease"
    )


def test_a_lost_job_with_a_cancel_requested_ends_cancelled(store, clock):
    job = store.create(make_spec(), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    store.cancel(job.id)
    clock.advance(LEASE_S + 1)
    assert store.reap(max_attempts=2).cancelled == [job.id]
    assert store.get(job.id).status is JobStatus.CANCELLED


@pytest.mark.parametrize(
    ("step", "expected_status", "expected_error"),
    [
        (0, JobStatus.QUEUED, None),
        (2, JobStatus.FAILED, JobError("worker_lost", "lost at step 2/4 of run 1: the replica running it shut down")),
    ],
)
def test_release_on_shutdown_retries_or_fails_like_the_reaper(store, step, expected_status, expected_error):
    job = store.create(make_spec(), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    store.set_progress(job.id, "r1", step, 4, LEASE_S)
    assert store.release(job.id, "r1", max_attempts=2) is expected_status
    released = store.get(job.id)
    assert (released.status, released.error) == (expected_status, expected_error)


# --- Retention, stats, durability ----------------------------------------------------------------------


def test_outputs_expire_after_retention(store, clock):
    job = store.create(make_spec(), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    store.complete(job.id, "r1", "key-1", VideoTimings(), VideoStats(), RETENTION_S)
    clock.advance(RETENTION_S - 1)
    assert store.expire_outputs() == []
    clock.advance(1)
    assert store.expire_outputs() == ["key-1"]
    expired = store.get(job.id)
    assert (expired.status, expired.output_key) == (JobStatus.COMPLETED, None)  # the record stays
    assert store.expire_outputs() == []


def test_queue_stats_average_recent_runs(store, clock):
    for run_s in (10.0, 20.0):
        job = store.create(make_spec(), None, BIG_QUEUE)
        store.claim(["m1"], "r1", LEASE_S)
        clock.advance(run_s)
        store.complete(job.id, "r1", "k", VideoTimings(), VideoStats(), RETENTION_S)
    store.create(make_spec(), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    store.create(make_spec(), None, BIG_QUEUE)
    stats = store.queue_stats("m1")
    assert (stats.num_queued, stats.num_running, stats.mean_run_s) == (1, 1, 15.0)
    empty = store.queue_stats("m2")
    assert (empty.num_queued, empty.num_running, empty.mean_run_s) == (0, 0, None)


def test_records_survive_reopening_the_database(open_store):
    first = open_store()
    job = first.create(make_spec(), "owner-a", BIG_QUEUE)
    first.close()
    assert open_store().get(job.id) == job


def test_a_postgres_claim_skips_a_row_another_claimer_holds(postgres_url, clock):
    """Two replicas claiming at once: the second gets the next job at once, it neither waits for the first's
    row lock nor answers "empty"."""
    reset_postgres(postgres_url)
    store = PostgresJobStore(postgres_url, clock=clock)
    first, second = (store.create(make_spec(), None, BIG_QUEUE) for _ in range(2))
    claimed = []
    with psycopg.connect(postgres_url) as other:  # not autocommit: its transaction holds the row lock
        other.execute("SELECT seq FROM video_jobs WHERE id = %s FOR UPDATE", (first.id,))
        claimer = threading.Thread(target=lambda: claimed.append(store.claim(["m1"], "r2", LEASE_S)))
        claimer.start()
        claimer.join(timeout=10)
        assert not claimer.is_alive(), "the claim waited for the locked row instead of skipping it"
        other.rollback()
    store.close()
    assert claimed[0].id == second.id


def test_a_postgres_delete_answers_the_row_a_concurrent_complete_committed(postgres_url, clock):
    """A delete racing the runner's complete (whose transaction holds the row): the delete waits for it and answers
    the completed record with its output key, so the service deletes the MP4 too. An answer read before the wait
    (still in_progress, no key) would leave the deleted job's MP4 in the output store for good."""
    reset_postgres(postgres_url)
    store = PostgresJobStore(postgres_url, clock=clock)
    job = store.create(make_spec(), None, BIG_QUEUE)
    store.claim(["m1"], "r1", LEASE_S)
    deleted = []
    with psycopg.connect(postgres_url) as runner, psycopg.connect(postgres_url, autocommit=True) as monitor:
        # The runner's complete, caught between its UPDATE and its COMMIT.
        runner.execute(
            "UPDATE video_jobs SET status = 'completed', output_key = 'key-1', lease_owner = NULL WHERE id = %s",
            (job.id,),
        )
        deleter = threading.Thread(target=lambda: deleted.append(store.delete(job.id)))
        deleter.start()
        deadline = time.monotonic() + 10
        while not monitor.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'").fetchone()[0]:
            assert time.monotonic() < deadline, "the delete never waited for the runner's row lock"
            time.sleep(0.01)
        runner.commit()
        deleter.join(timeout=10)
    store.close()
    assert (deleted[0].status, deleted[0].output_key) == (JobStatus.COMPLETED, "key-1")


CLAIM_SCRIPT = """
import os, sys, time
from jobs.store import open_job_store
store = open_job_store(sys.argv[1])
open(sys.argv[3] + "." + sys.argv[2], "w").close()  # ready
while not os.path.exists(sys.argv[3]):  # start together
    time.sleep(0.0005)
while (job := store.claim(["m1"], sys.argv[2], 60.0)) is not None:
    print(job.id, flush=True)
"""


def test_claims_are_exclusive_across_processes(store, database_url, tmp_path):
    """Three processes drain one queue at once: every job is claimed by exactly one of them, and none stops
    early while jobs are left (a claim never answers "empty" because another process holds a row)."""
    ids = {store.create(make_spec(), None, BIG_QUEUE).id for _ in range(300)}
    go = tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, "-c", CLAIM_SCRIPT, database_url, f"proc-{i}", str(go)], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(3)
    ]
    deadline = time.monotonic() + 60
    while not all(go.with_name(f"go.proc-{i}").exists() for i in range(3)):
        assert time.monotonic() < deadline, "the claiming processes did not start"
        time.sleep(0.01)
    go.touch()
    claimed: list[str] = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        claimed += out.split()
    assert sorted(claimed) == sorted(ids)  # each once: no duplicates, none missed
