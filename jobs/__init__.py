"""Video jobs: durable records, outputs, admission, runners and reaping behind `/v1/videos`.

Plain Python (no Ray, no torch). The generation side plugs in through `jobs.backend.VideoBackend`;
deployments/videos.py puts the HTTP API on top.

- `backend.py`  the seam: VideoSpec in, VideoOutput (MP4 + thumbnail, timings, stats) out, typed errors
- `limits.py`   request -> VideoSpec against the served `engine.limits.ModelLimits`
- `schemas.py`  API bodies (request, job object, list)
- `records.py`  job records and the states they move through
- `store.py`    the JobStore protocol and its SQL; `sqlite_store.py`, `postgres_store.py`
- `outputs.py`  MP4s and thumbnails under a directory or fsspec URL, ranged reads
- `events.py`   in-process change notifications (SSE fast path)
- `service.py`  JobService: admission, runners, leases, cancellation, reaper, retention
- `metrics.py`  JobMetrics, what the service reports (jobs created, JobOutcome, queue depth); a no-op default
- `config.py`   JobsConfig, AuthConfig
"""
