"""In-process change notifications, so a watcher (SSE, a sync request) on the replica that runs a job hears
of each step at once. Changes made on another replica are found by the watcher's periodic re-read; this is
only the fast path, never the source of truth."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ChangeFeed"]


class ChangeFeed:
    """`notify(job_id)` sets every event subscribed to that job. Use from the event loop's thread only."""

    def __init__(self) -> None:
        self._subscribers: dict[str, set[asyncio.Event]] = {}

    @contextmanager
    def subscribe(self, job_id: str) -> Iterator[asyncio.Event]:
        """An event set on each change of `job_id`. Clear it before reading the job, then wait on it: a
        change between the read and the wait is not lost."""
        event = asyncio.Event()
        self._subscribers.setdefault(job_id, set()).add(event)
        try:
            yield event
        finally:
            subscribers = self._subscribers[job_id]
            subscribers.discard(event)
            if not subscribers:
                del self._subscribers[job_id]

    def notify(self, job_id: str) -> None:
        for event in self._subscribers.get(job_id, ()):
            event.set()

    @property
    def num_subscribed_jobs(self) -> int:
        return len(self._subscribers)
