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

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        if value not in PRESET_NAMES:
            raise ValueError(f"unknown preset {value!r}; choose one of {', '.join(PRESET_NAMES)}")
        return value
