"""Config of the video job layer: where jobs and outputs live, queue bounds, leases, retention, API keys.

Plain pydantic, no I/O: `jobs.store.open_job_store` and `jobs.outputs.OutputStore` act on it.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["AuthConfig", "JobsConfig"]

#: What `jobs.store.open_job_store` opens.
DATABASE_SCHEMES = ("sqlite:///", "postgresql://", "postgres://")


class JobsConfig(BaseModel):
    """`jobs` of the app config. The defaults serve one node: SQLite and MP4s under `state_dir`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    state_dir: str = Field(
        "state", min_length=1,
        description="Directory of the SQLite job database and (by default) the outputs; `~` is expanded. The app "
        "puts a relative one next to engine.checkpoint_root (`deployments.app.resolve_jobs_config`).",
    )
    database_url: str | None = Field(
        None, description="Job database: `sqlite:///ABS/PATH.db` or `postgresql://user@host:port/db` (shared "
        "by every ingress replica of a cluster). null: SQLite at `<state_dir>/jobs.sqlite3`.",
    )
    output_url: str | None = Field(
        None, description="Where MP4s and thumbnails go: a directory or any fsspec URL (`file://`, `s3://`, "
        "`memory://` in tests). Shared storage on a cluster. null: `<state_dir>/outputs`.",
    )
    max_queued_per_model: int = Field(
        16, ge=1, description="Queued (not yet started) jobs per model; beyond it POST answers 429 with Retry-After."
    )
    concurrency: int = Field(
        1, ge=1, description="Jobs one ingress replica runs at once (match the denoising replicas it feeds).",
    )
    lease_s: float = Field(
        30.0, gt=0, description="A running job's lease: a replica that stops renewing it for this long has lost "
        "the job, and the reaper retries it (no step had run) or fails it with the cause.",
    )
    heartbeat_s: float | None = Field(
        None, gt=0, description="How often a running job renews its lease and writes progress; null: lease_s / 3.",
    )
    max_attempts: int = Field(
        2, ge=1, description="Runs of one job: a job lost before its first step is retried until this many runs.",
    )
    max_run_s: float = Field(
        3600.0, gt=0, description="Longest one run (generation and storing its MP4) may take before it fails as "
        "`timeout`.",
    )
    max_queued_s: float | None = Field(
        24 * 3600.0, gt=0, description="A job still queued this long after it was created fails as "
        "`queue_timeout` (no replica serving its model took it: the model was renamed or removed from the fleet, or "
        "the fleet serves far less than the queue holds). null: a queued job waits for good.",
    )
    poll_s: float = Field(
        1.0, gt=0, description="An idle runner looks for queued jobs this often (jobs created on this replica wake "
        "it at once; this bounds the delay for jobs created on another replica).",
    )
    reap_interval_s: float = Field(10.0, gt=0, description="How often expired leases and outputs are reaped.")
    retention_s: float = Field(
        7 * 24 * 3600.0, gt=0, description="Completed outputs are deleted this long after completion (the job "
        "record stays, its content answers 410).",
    )
    default_retry_after_s: int = Field(
        30, ge=1, description="Retry-After of a 429 while no job of the model has completed yet (afterwards it is "
        "estimated from recent run times).",
    )
    sync_timeout_s: float = Field(
        900.0, gt=0, description="Longest POST /v1/videos/sync waits before it cancels the job and answers 504.",
    )
    events_poll_s: float = Field(
        0.5, gt=0, description="SSE: how often the store is re-read for a job running on another replica.",
    )
    events_keepalive_s: float = Field(
        15.0, gt=0, description="SSE: a comment line is sent after this long without an event, so proxies keep a "
        "quiet stream (a job waiting in the queue) open.",
    )
    max_body_bytes: int = Field(64 * 1024, ge=1024, description="POST bodies without uploads above this get 413.")
    max_upload_bytes: int = Field(
        48 * 2**20, ge=1024, description="POST bodies carrying keyframes or references (multipart files, data: "
        "URLs) above this get 413; read whole before parsing, so keep it what an ingress may hold per request.")
    max_file_bytes: int = Field(
        16 * 2**20, ge=1024, description="One uploaded file above this gets 413 naming its field, before any "
        "decode (a job stores its uploads with its record until it finishes).")
    max_list_limit: int = Field(100, ge=1, description="Largest `limit` GET /v1/videos accepts (more: 422).")

    @field_validator("database_url")
    @classmethod
    def _supported_database(cls, url: str | None) -> str | None:
        # The schemes jobs.store.open_job_store opens: refused here, not in every ingress replica's start.
        if url is not None and not url.startswith(DATABASE_SCHEMES):
            raise ValueError(f"database_url={url!r}: expected sqlite:///PATH or postgresql://...")
        return url

    @model_validator(mode="after")
    def _heartbeat_within_lease(self) -> JobsConfig:
        if self.heartbeat_s is not None and self.heartbeat_s >= self.lease_s:
            raise ValueError(f"heartbeat_s={self.heartbeat_s} must be below lease_s={self.lease_s}")
        if self.max_upload_bytes < self.max_body_bytes:
            raise ValueError(f"max_upload_bytes={self.max_upload_bytes} must be at least "
                             f"max_body_bytes={self.max_body_bytes}")
        return self

    @property
    def heartbeat_interval_s(self) -> float:
        return self.heartbeat_s if self.heartbeat_s is not None else self.lease_s / 3

    @property
    def state_path(self) -> Path:
        return Path(os.path.expanduser(self.state_dir))

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.state_path / 'jobs.sqlite3'}"

    @property
    def resolved_output_url(self) -> str:
        return self.output_url or str(self.state_path / "outputs")


class AuthConfig(BaseModel):
    """`auth` of the app config: optional API keys for the video routes."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    api_keys: list[str] = Field(
        default_factory=list, description="Accepted keys (`Authorization: Bearer <key>`). Empty: no auth, every "
        "client sees every job. Set: a request without a listed key gets 401, and a client sees only the jobs "
        "created with its own key.",
    )

    @field_validator("api_keys")
    @classmethod
    def _keys_long_enough(cls, keys: list[str]) -> list[str]:
        for index, key in enumerate(keys):
            if len(key) < 16 or key != key.strip():
                raise ValueError(f"api_keys[{index}] must be at least 16 characters without surrounding spaces")
        return keys
