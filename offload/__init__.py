"""Layerwise weight offload for DiT blocks (plain torch; never imports Ray or cache-dit).

`LayerwiseOffloader(blocks, OffloadConfig(...), device, root=model).apply()` streams any
`nn.ModuleList` of blocks through forward hooks; `set_cache_blocks(Fn, Bn)` and
`begin_step(will_compute_middle)` make it skip-predictive under cache-dit's DBCache. Streams, events and
pinned memory come from the device layer (`device/`: `make_device`, `FakeDevice` for CPU tests).
"""

from .layerwise import HOOK_NAME, LayerwiseOffloader, OffloadConfig, OffloadStats, plan_residency
from .pinned import BlockLayout, TensorSlot

__all__ = [
    "HOOK_NAME",
    "BlockLayout",
    "LayerwiseOffloader",
    "OffloadConfig",
    "OffloadStats",
    "TensorSlot",
    "plan_residency",
]
