"""Engine configuration (pydantic, no I/O, no Ray).

`EngineConfig` is what `serve_config.yaml` passes under `args.engine` (same names, see DESIGN.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cache.cache_dit import CacheDitConfig
from cache.config import AdalnConfig
from model.config import PRESET_NAMES
from offload.layerwise import OffloadConfig

#: Hard cap on denoising steps: the AdaLN plan slab admits up to 65 plans per request (H3 takes <= 65 steps).
MAX_STEPS = 65


# --------------------------------------------------------------------------------------------------
# Node-shared plan pool
# --------------------------------------------------------------------------------------------------


class PoolConfig(BaseModel):
    """The node-shared host-cache pool (`actors.host_cache_pool`): a tier between a worker's own pinned
    host tier and the rebuild, shared by every GPU worker of a node through Ray's object store."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool | None = Field(
        None,
        description="null (auto): on when the engine runs inside Ray (a Serve replica) with adaln.mode=online; "
        "true/false force it (true without Ray is ignored: there is no object store).",
    )
    pools_per_node: int = Field(1, ge=1, description="Pool actors per node; keys are spread over them by hash.")
    capacity_gb: float = Field(
        16.0, ge=0,
        description="Bytes (GB, 10^9) the pools of one node hold in the object store, evicting whole request "
        "groups LRU. Size the Ray object store to fit it.",
    )
    lookup_timeout_s: float = Field(
        2.0, gt=0,
        description="Budget of one pool lookup; a slower, dead or missing pool is a miss (the plan is rebuilt).",
    )
    pin_memory: bool | None = Field(
        None,
        description="Register the zero-copy object-store pages of a hit with CUDA (cudaHostRegister) so the "
        "copy into the slab runs at pinned speed. null: on when the engine runs on CUDA.",
    )


# --------------------------------------------------------------------------------------------------
# Engine config
# --------------------------------------------------------------------------------------------------


class EngineConfig(BaseModel):
    """One GPU worker's engine: which checkpoint, which device, which memory/caching features."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str = Field(
        "",
        description="Checkpoint directory (model.checkpoint format). Empty: make a seeded `preset` checkpoint "
        "under `checkpoint_root/<preset>` on first start and reuse it afterwards.",
    )
    checkpoint_root: str = Field(
        "checkpoints",
        description="Where auto-made checkpoints go; relative paths are resolved against the working directory "
        "of the process that builds the app.",
    )
    preset: str = Field("tiny", description=f"Preset of the auto-made checkpoint: one of {', '.join(PRESET_NAMES)}.")
    checkpoint_seed: int = Field(0, ge=0, description="Seed of the auto-made checkpoint's random weights.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: cuda when this process sees a GPU, else cpu."
    )
    max_steps: int = Field(MAX_STEPS, ge=1, le=MAX_STEPS, description="Most denoising steps one request may ask for.")
    adaln: AdalnConfig = Field(default_factory=AdalnConfig, description="AdaLN modulation source and plan cache.")
    offload: OffloadConfig = Field(default_factory=OffloadConfig, description="Layerwise block offload.")
    cache_dit: CacheDitConfig = Field(
        default_factory=CacheDitConfig, description="Cache-DiT (DBCache) block skipping; requests may override it."
    )
    pool: PoolConfig = Field(
        default_factory=PoolConfig,
        description="Node-shared AdaLN plan pool (Ray object store) between the host tier and the rebuild.",
    )

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        if value not in PRESET_NAMES:
            raise ValueError(f"unknown preset {value!r}; choose one of {', '.join(PRESET_NAMES)}")
        return value
