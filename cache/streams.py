"""Streams and events that also run on CPU.

The cache tiers copy on side streams and fence with events. On CUDA these are `torch.cuda.Stream` /
`torch.cuda.Event`; on CPU every operation is already synchronous, so `FakeStream` / `FakeEvent` run the
same code paths with no-op fences. The fakes append what they were asked to do to `Streams.log` (when
given one), so CPU tests can check that a fence is issued before a copy.

Only the subset the cache needs: `Streams.current()`, `.new_stream(name)`, `.new_event()`, `.use(stream)`;
streams `wait_stream`, `wait_event`, `record_event`, `synchronize`; events `record`, `synchronize`, `query`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import torch


class Event(Protocol):
    def record(self, stream: "Stream | None" = None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...


class Stream(Protocol):
    def wait_stream(self, stream: "Stream") -> None: ...
    def wait_event(self, event: Event) -> None: ...
    def record_event(self, event: Event | None = None) -> Event: ...
    def synchronize(self) -> None: ...


class FakeEvent:
    """A CPU event: work before it is already done, so every fence is a no-op."""

    def __init__(self, log: list[str] | None, name: str):
        self._log, self.name = log, name

    def record(self, stream: "FakeStream | None" = None) -> None:
        if self._log is not None:
            self._log.append(f"{stream.name if stream else 'current'}.record({self.name})")

    def synchronize(self) -> None:
        if self._log is not None:
            self._log.append(f"host.wait({self.name})")

    def query(self) -> bool:
        return True


class FakeStream:
    """A CPU stream: operations run inline, in program order."""

    def __init__(self, log: list[str] | None, name: str, new_event):
        self._log, self.name, self._new_event = log, name, new_event

    def _note(self, what: str) -> None:
        if self._log is not None:
            self._log.append(f"{self.name}.{what}")

    def wait_stream(self, stream: "FakeStream") -> None:
        self._note(f"wait_stream({stream.name})")

    def wait_event(self, event: FakeEvent) -> None:
        self._note(f"wait_event({event.name})")

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event if event is not None else self._new_event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self._note("synchronize()")


class Streams:
    """Stream/event factory for one device. `Streams(device)`; CUDA devices get real streams.

    `log` (CPU only) collects a trace of fences for tests, e.g. `["host.wait_stream(compute)", ...]`.
    """

    def __init__(self, device: torch.device | str, log: list[str] | None = None):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.log = log
        self._num_events = 0
        self._current = FakeStream(log, "compute", self.new_event) if not self.is_cuda else None

    def current(self) -> Stream:
        """The stream the engine runs the forward on (the CUDA current stream)."""
        if self.is_cuda:
            return torch.cuda.current_stream(self.device)
        return self._current

    def new_stream(self, name: str) -> Stream:
        if self.is_cuda:
            return torch.cuda.Stream(device=self.device)
        return FakeStream(self.log, name, self.new_event)

    def new_event(self) -> Event:
        if self.is_cuda:
            return torch.cuda.Event()
        self._num_events += 1
        return FakeEvent(self.log, f"e{self._num_events}")

    @contextlib.contextmanager
    def use(self, stream: Stream) -> Iterator[None]:
        """Make `stream` current for the ops issued inside the block."""
        if self.is_cuda:
            with torch.cuda.stream(stream):
                yield
            return
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous

    @property
    def can_pin(self) -> bool:
        """Whether pinned host memory helps (and exists): only with a CUDA device."""
        return self.is_cuda
