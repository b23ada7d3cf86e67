"""Layerwise weight offload for DiT blocks (plain torch; never imports Ray or cache-dit).

`LayerwiseOffloader(blocks, OffloadConfig(...), device, root=model).apply()` streams any
`nn.ModuleList` of blocks through forward hooks; `set_cache_blocks(Fn, Bn)` and
`begin_step(will_compute_middle)` make it skip-predictive under cache-dit's DBCache.
"""

from .device import CudaDevice, Device, Event, FakeDevice, Stream, make_device
from .layerwise import HOOK_NAME, LayerwiseOffloader, OffloadConfig, OffloadStats, plan_residency
from .pinned import BlockLayout, HostMemory, TensorSlot

__all__ = [
    "HOOK_NAME",
    "BlockLayout",
    "CudaDevice",
    "Device",
    "Event",
    "FakeDevice",
    "HostMemory",
    "LayerwiseOffloader",
    "OffloadConfig",
    "OffloadStats",
    "Stream",
    "TensorSlot",
    "make_device",
    "plan_residency",
]
