"""The device layer, at the bottom of the dependency graph: streams, events, copies and pinned host memory.

`streams.py`: `Device` (`CudaDevice`, or `FakeDevice`, a CPU stand-in that defers side-stream copies so a
missing wait reads stale bytes) with its `Stream` and `Event`; `make_device(spec)`.
`pinned.py`: `PinnedMemory`, host buffers page-locked at their exact size under one budget, pageable after.

Plain torch: imports nothing of ours, never torch.distributed or Ray.
"""

from .pinned import PinnedMemory
from .streams import CudaDevice, Device, Event, FakeDevice, Stream, make_device

__all__ = ["CudaDevice", "Device", "Event", "FakeDevice", "PinnedMemory", "Stream", "make_device"]
