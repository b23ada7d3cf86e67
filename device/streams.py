"""Streams, events, copies and host-page registration of one device: CUDA, or a CPU fake that defers copies.

Everything that overlaps copies with compute (the plan cache's host tier and rebuild, the layerwise offloader)
is written once against `Device`, `Stream` and `Event`:

- `CudaDevice`: `torch.cuda` streams and events, the caching allocator, `cudaHostRegister`.
- `FakeDevice`: the same code paths on a CPU, with the ordering CUDA guarantees and no more:
  - the compute stream runs everything at once; a side stream *defers* the copies queued on it (`copy_`)
    until something orders them: an event recorded after them is waited on or synchronized, or the stream
    is waited on or synchronized (`FakeDevice.synchronize` runs every stream);
  - a device tensor from `empty` holds NaN (or -1) until written;
  - waiting on an event that was never recorded raises (CUDA would silently wait for nothing).
  So on a CPU a missing wait reads stale bytes (or NaN), and a wait on the wrong event raises. Only `copy_`
  is deferred: other torch ops issued under `use_stream(side)` run at once, so side-stream work that a
  test must be able to catch goes through `copy_`. With `log` (a list) every fence is traced, e.g.
  `host.wait_stream(compute)`, `host.record(e1)`, `compute.wait_event(e1)`, `host.wait(e1)`.

One set of verbs. Device: `current_stream()`, `new_stream(name)`, `new_event()`, `use_stream(stream)`,
`empty(numel, dtype)`, `copy_(dst, src)`, `free_after_use_on(tensor, stream)`, `synchronize()`,
`register_host(tensor)` / `unregister_host(tensor)` (page-lock existing host memory; `pinned.PinnedMemory`
is the allocator on top). Stream: `wait_stream`, `wait_event`, `record_event`, `synchronize`. Event:
`record`, `synchronize`, `recorded`.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from typing import Callable, Iterator, Protocol

import torch


class Event(Protocol):
    """A point in a stream's work queue."""

    def record(self, stream: "Stream") -> None: ...

    def synchronize(self) -> None:
        """Block the host until the work queued before the recording point is done."""

    @property
    def recorded(self) -> bool: ...


class Stream(Protocol):
    """An ordered work queue on the device."""

    def wait_stream(self, stream: "Stream") -> None:
        """Work queued here after this call starts only once the work queued on `stream` so far is done."""

    def wait_event(self, event: Event) -> None:
        """Work queued here after this call starts only once `event` has completed."""

    def record_event(self) -> Event:
        """A new event recorded at this point of the stream."""

    def synchronize(self) -> None:
        """Block the host until everything queued on this stream is done."""


class Device(ABC):
    """Where the streams run: streams, events, device allocation, copies, host-page registration."""

    #: The torch device that device tensors live on.
    torch_device: torch.device
    #: True when host memory can be page-locked (for the fake device: simulated).
    pin_supported: bool

    @abstractmethod
    def current_stream(self) -> Stream:
        """The stream the model's kernels are queued on (the compute stream)."""

    @abstractmethod
    def new_stream(self, name: str) -> Stream:
        """A side stream; `name` appears in the fake's trace."""

    @abstractmethod
    def new_event(self) -> Event: ...

    @abstractmethod
    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager:
        """Context in which allocations and copies are queued on `stream`."""

    @abstractmethod
    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised 1-D device tensor, allocated for the stream currently in use."""

    @abstractmethod
    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue `dst.copy_(src)` on the stream in use (asynchronous where the memory allows it)."""

    @abstractmethod
    def free_after_use_on(self, tensor: torch.Tensor, stream: Stream) -> None:
        """Mark `tensor` as used by `stream`, so its memory is not reused before that work completes."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until every stream's queued work is done."""

    @abstractmethod
    def register_host(self, tensor: torch.Tensor) -> None:
        """Page-lock the host memory of `tensor` (contiguous); RuntimeError when the OS refuses."""

    @abstractmethod
    def unregister_host(self, tensor: torch.Tensor) -> None:
        """Undo `register_host`; no copy may still read or write the memory."""

    def placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        """An empty device tensor that stands in for an offloaded parameter."""
        return torch.empty(0, dtype=dtype, device=self.torch_device)


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------


class _CudaStream:
    def __init__(self, raw: torch.cuda.Stream):
        self.raw = raw

    def wait_stream(self, stream: Stream) -> None:
        assert isinstance(stream, _CudaStream)
        self.raw.wait_stream(stream.raw)

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, _CudaEvent)
        self.raw.wait_event(event.raw)

    def record_event(self) -> Event:
        event = _CudaEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.raw.synchronize()


class _CudaEvent:
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
    """A CUDA GPU: real side streams and events, the caching allocator, `cudaHostRegister`."""

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

    def new_stream(self, name: str) -> Stream:
        return _CudaStream(torch.cuda.Stream(self.torch_device))

    def new_event(self) -> Event:
        return _CudaEvent()

    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager:
        assert isinstance(stream, _CudaStream)
        return torch.cuda.stream(stream.raw)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # non_blocking is asynchronous only with pinned host memory; with pageable memory CUDA stages the
        # copy and returns once the host side has been read (or written), which is still correct.
        dst.copy_(src, non_blocking=True)

    def free_after_use_on(self, tensor: torch.Tensor, stream: Stream) -> None:
        assert isinstance(stream, _CudaStream)
        tensor.record_stream(stream.raw)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def register_host(self, tensor: torch.Tensor) -> None:
        try:
            rc = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)
        except AttributeError as e:  # a torch build without the cudart bindings
            raise RuntimeError(f"cudaHostRegister unavailable: {e}") from e
        torch.cuda.check_error(rc)  # CudaError (a RuntimeError) when the OS refuses to lock the pages

    def unregister_host(self, tensor: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


# ---------------------------------------------------------------------------------------------
# CPU stand-in
# ---------------------------------------------------------------------------------------------


class _FakeStream:
    """A queue of deferred copies; the compute stream (`immediate`) runs them at once."""

    def __init__(self, device: "FakeDevice", name: str, immediate: bool):
        self.device, self.name, self.immediate = device, name, immediate
        self._queue: list[tuple[int, Callable[[], None]]] = []
        self._enqueued = 0  # operations ever queued (the position an event records)
        self._lock = threading.RLock()  # a publisher thread may synchronize an event while the engine queues

    def _note(self, what: str) -> None:
        self.device.note(f"{self.name}.{what}")

    def enqueue(self, op: Callable[[], None]) -> None:
        with self._lock:
            self._enqueued += 1
            if not self.immediate:
                self._queue.append((self._enqueued, op))
                return
        op()

    def run_until(self, position: int) -> None:
        with self._lock:  # held while running, so two threads never run this queue's copies out of order
            while self._queue and self._queue[0][0] <= position:
                _, op = self._queue.pop(0)
                op()

    def wait_stream(self, stream: Stream) -> None:
        assert isinstance(stream, _FakeStream)
        self._note(f"wait_stream({stream.name})")
        # Running the other stream's queued copies now orders them before anything queued here later.
        stream.run_until(stream._enqueued)

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, _FakeEvent)
        if not event.recorded:
            raise RuntimeError("wait_event on an event that was never recorded (CUDA would not wait)")
        self._note(f"wait_event({event.name})")
        self.device.num_waits += 1
        event.complete()

    def record_event(self) -> Event:
        event = self.device.new_event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self._note("synchronize()")
        self.run_until(self._enqueued)


class _FakeEvent:
    def __init__(self, device: "FakeDevice", name: str) -> None:
        self.device, self.name = device, name
        self._stream: _FakeStream | None = None
        self._position = 0

    def record(self, stream: Stream) -> None:
        assert isinstance(stream, _FakeStream)
        self._stream, self._position = stream, stream._enqueued
        self.device.note(f"{stream.name}.record({self.name})")

    def complete(self) -> None:
        """Run the copies queued before the recording point (what a wait on this event orders)."""
        if self._stream is not None:
            self._stream.run_until(self._position)

    def synchronize(self) -> None:
        self.device.note(f"host.wait({self.name})")
        self.complete()

    @property
    def recorded(self) -> bool:
        return self._stream is not None


class FakeDevice(Device):
    """CPU stand-in for a GPU (see the module docstring). Counts what it was asked to do.

    `lockable_bytes` simulates the OS's limit on page-locked memory (None: no limit): a `register_host`
    beyond it raises as `cudaHostRegister` would. `log` collects the fence trace.
    """

    def __init__(self, *, lockable_bytes: int | None = None, log: list[str] | None = None):
        self.torch_device = torch.device("cpu")
        self.pin_supported = True
        self.lockable_bytes = lockable_bytes
        self.log = log
        self._compute = _FakeStream(self, "compute", immediate=True)
        self._in_use = threading.local()  # the stream in use is per thread, as CUDA's current stream is
        self._side_streams: list[_FakeStream] = []
        self._num_events = 0
        self.locked_bytes = 0
        self.num_waits = 0
        self.num_copies = 0

    def note(self, what: str) -> None:
        if self.log is not None:
            self.log.append(what)

    def current_stream(self) -> Stream:
        return self._compute

    def new_stream(self, name: str) -> Stream:
        stream = _FakeStream(self, name, immediate=False)
        self._side_streams.append(stream)
        return stream

    def new_event(self) -> Event:
        self._num_events += 1
        return _FakeEvent(self, f"e{self._num_events}")

    @property
    def _current(self) -> _FakeStream:
        return getattr(self._in_use, "stream", self._compute)

    @contextlib.contextmanager
    def use_stream(self, stream: Stream) -> Iterator[None]:
        assert isinstance(stream, _FakeStream)
        previous, self._in_use.stream = self._current, stream
        try:
            yield
        finally:
            self._in_use.stream = previous

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # Garbage that cannot go unnoticed: a kernel that reads before its copy landed yields NaN.
        fill = float("nan") if dtype.is_floating_point or dtype.is_complex else -1
        return torch.full((numel,), fill, dtype=dtype)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.num_copies += 1
        self._current.enqueue(lambda: dst.copy_(src))

    def free_after_use_on(self, tensor: torch.Tensor, stream: Stream) -> None:
        pass  # CPU tensors are freed by reference counting; nothing runs asynchronously on "compute"

    def synchronize(self) -> None:
        for stream in self._side_streams:
            stream.run_until(stream._enqueued)

    def register_host(self, tensor: torch.Tensor) -> None:
        if self.lockable_bytes is not None and self.locked_bytes + tensor.nbytes > self.lockable_bytes:
            raise RuntimeError(f"cudaHostRegister failed: locked memory limit ({self.lockable_bytes} bytes, "
                               f"{self.locked_bytes} locked, {tensor.nbytes} asked)")
        self.locked_bytes += tensor.nbytes

    def unregister_host(self, tensor: torch.Tensor) -> None:
        self.locked_bytes -= tensor.nbytes


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
    raise ValueError(f"unsupported device {dev}; use a CUDA device or 'cpu'")
