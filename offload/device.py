"""Device, stream and event seams of the layerwise offloader.

The offloader is written once against `Device`, `Stream` and `Event`. `CudaDevice` maps them onto
`torch.cuda` streams, events, pinned host memory and the caching allocator. `FakeDevice` runs the very
same code paths on a CPU:

- "device" tensors are separate CPU tensors, filled with NaN (or -1) when allocated;
- the compute stream runs everything at once, a side stream *defers* its copies until an event
  recorded after them is waited on (or synchronized), exactly the ordering CUDA guarantees and no more;
- waiting on an event that was never recorded raises (on CUDA it silently waits for nothing).

So on a CPU a missing `wait_event` shows up as NaN in the output and a wait on the wrong event as an
error, which is what the CPU tests rely on.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Callable, Iterator

import torch


class Event(ABC):
    """A point in a stream's work queue."""

    @abstractmethod
    def record(self, stream: "Stream") -> None: ...

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the work before the recording point is done."""

    @property
    @abstractmethod
    def recorded(self) -> bool: ...


class Stream(ABC):
    """An ordered work queue on the device."""

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Work queued on this stream after this call starts only once `event` has completed."""

    @abstractmethod
    def synchronize(self) -> None: ...


class Device(ABC):
    """Where offloaded blocks run: streams, events, device and host allocation, copies."""

    #: The torch device that block weights live on while loaded (and placeholders always).
    torch_device: torch.device
    #: True when host memory can be page-locked (for the fake device: simulated).
    pin_supported: bool

    @abstractmethod
    def current_stream(self) -> Stream:
        """The stream the model's kernels are queued on (the compute stream)."""

    @abstractmethod
    def new_stream(self) -> Stream: ...

    @abstractmethod
    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager:
        """Context in which allocations and copies are queued on `stream`."""

    @abstractmethod
    def new_event(self) -> Event: ...

    @abstractmethod
    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised 1-D device tensor, allocated for the stream currently in use."""

    @abstractmethod
    def alloc_host(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """1-D host tensor; raises RuntimeError when pinned memory cannot be had."""

    @abstractmethod
    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue `dst.copy_(src)` on the stream currently in use (asynchronous where the source allows)."""

    @abstractmethod
    def free_after_use_on(self, tensor: torch.Tensor, stream: Stream) -> None:
        """Mark `tensor` as used by `stream`, so its memory is not reused before that work completes."""

    @abstractmethod
    def synchronize(self) -> None: ...

    def placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        """An empty device tensor that stands in for an offloaded parameter."""
        return torch.empty(0, dtype=dtype, device=self.torch_device)


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------


class _CudaStream(Stream):
    def __init__(self, stream: torch.cuda.Stream):
        self.raw = stream

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, _CudaEvent)
        self.raw.wait_event(event.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()


class _CudaEvent(Event):
    def __init__(self) -> None:
        self.raw = torch.cuda.Event()
        self._recorded = False

    def record(self, stream: Stream) -> None:
        assert isinstance(stream, _CudaStream)
        self.raw.record(stream.raw)
        self._recorded = True

    def synchronize(self) -> None:
        self.raw.synchronize()

    @property
    def recorded(self) -> bool:
        return self._recorded


class CudaDevice(Device):
    """A CUDA GPU: real side streams, events, pinned host memory, the caching allocator."""

    def __init__(self, device: torch.device | str | int = "cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDevice needs CUDA; use FakeDevice on a CPU")
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.torch_device = dev
        self.pin_supported = True

    def current_stream(self) -> Stream:
        return _CudaStream(torch.cuda.current_stream(self.torch_device))

    def new_stream(self) -> Stream:
        return _CudaStream(torch.cuda.Stream(self.torch_device))

    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager:
        assert isinstance(stream, _CudaStream)
        return torch.cuda.stream(stream.raw)

    def new_event(self) -> Event:
        return _CudaEvent()

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    def alloc_host(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # non_blocking is asynchronous only from pinned memory; from pageable memory CUDA stages the
        # copy and returns once the source has been read, which is still correct.
        dst.copy_(src, non_blocking=True)

    def free_after_use_on(self, tensor: torch.Tensor, stream: Stream) -> None:
        assert isinstance(stream, _CudaStream)
        tensor.record_stream(stream.raw)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)


# ---------------------------------------------------------------------------------------------
# CPU stand-in
# ---------------------------------------------------------------------------------------------


class _FakeStream(Stream):
    """A queue of deferred operations; the compute stream (`immediate`) runs them at once."""

    def __init__(self, device: "FakeDevice", immediate: bool):
        self.device = device
        self.immediate = immediate
        self._queue: list[tuple[int, Callable[[], None]]] = []
        self._enqueued = 0  # operations ever queued (the position an event records)
        self._done = 0  # operations executed

    def enqueue(self, op: Callable[[], None]) -> None:
        self._enqueued += 1
        if self.immediate:
            op()
            self._done = self._enqueued
        else:
            self._queue.append((self._enqueued, op))

    def run_until(self, position: int) -> None:
        while self._queue and self._queue[0][0] <= position:
            _, op = self._queue.pop(0)
            op()
            self._done += 1

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, _FakeEvent)
        if not event.recorded:
            raise RuntimeError("wait_event on an event that was never recorded (CUDA would not wait)")
        self.device.num_waits += 1
        event.synchronize()

    def synchronize(self) -> None:
        self.run_until(self._enqueued)


class _FakeEvent(Event):
    def __init__(self) -> None:
        self._stream: _FakeStream | None = None
        self._position = 0

    def record(self, stream: Stream) -> None:
        assert isinstance(stream, _FakeStream)
        self._stream, self._position = stream, stream._enqueued

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.run_until(self._position)

    @property
    def recorded(self) -> bool:
        return self._stream is not None


class FakeDevice(Device):
    """CPU stand-in for a GPU (see the module docstring). Counts what the offloader asked of it."""

    def __init__(self, *, pin_supported: bool = True):
        self.torch_device = torch.device("cpu")
        self.pin_supported = pin_supported
        self._compute = _FakeStream(self, immediate=True)
        self._current: _FakeStream = self._compute
        self._side_streams: list[_FakeStream] = []
        self.num_waits = 0
        self.num_copies = 0
        self.num_streams = 0

    def current_stream(self) -> Stream:
        return self._compute

    def new_stream(self) -> Stream:
        self.num_streams += 1
        stream = _FakeStream(self, immediate=False)
        self._side_streams.append(stream)
        return stream

    @contextlib.contextmanager
    def use_stream(self, stream: Stream) -> Iterator[None]:
        assert isinstance(stream, _FakeStream)
        prev, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = prev

    def new_event(self) -> Event:
        return _FakeEvent()

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # Garbage that cannot go unnoticed: a block that runs before its copy landed yields NaN.
        fill = float("nan") if dtype.is_floating_point or dtype.is_complex else -1
        return torch.full((numel,), fill, dtype=dtype)

    def alloc_host(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        if pinned and not self.pin_supported:
            raise RuntimeError("pinned memory not supported on this fake device")
        return torch.empty(numel, dtype=dtype)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.num_copies += 1
        self._current.enqueue(lambda: dst.copy_(src))

    def free_after_use_on(self, tensor: torch.Tensor, stream: Stream) -> None:
        pass  # CPU tensors are freed by reference counting; nothing runs asynchronously on "compute"

    def synchronize(self) -> None:
        for stream in self._side_streams:
            stream.synchronize()


def make_device(device: torch.device | str | Device | None) -> Device:
    """`Device` for a spec: a CUDA device gives `CudaDevice`, "cpu" (or None without CUDA) `FakeDevice`."""
    if isinstance(device, Device):
        return device
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaDevice(dev)
    if dev.type == "cpu":
        return FakeDevice()
    raise ValueError(f"unsupported offload device {dev}; use a CUDA device or 'cpu'")
