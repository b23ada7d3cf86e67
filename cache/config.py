"""`AdalnConfig`: how AdaLN modulation is produced and cached (the `adaln:` section of serve_config.yaml)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: Bytes per "GB" in `host_cache_gb` (decimal, like the GB/s figures in shared/reference.md).
GB = 10**9


class AdalnConfig(BaseModel):
    """AdaLN plan cache settings.

    `mode=resident` keeps every block's `adaln_proj` on the GPU and projects each step (no cache).
    `mode=online` loads the model without `adaln_proj` and serves plans from the GPU slab, then the
    pinned host tier, then a streaming rebuild from the checkpoint; bit-exact with `resident` when both use
    the same `projection`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    mode: Literal["resident", "online"] = Field(
        "online",
        description="resident: adaln_proj weights stay on the GPU and every step projects them. "
        "online: adaln_proj stays on disk; plans are cached (GPU slab -> pinned host tier) and rebuilt by "
        "streaming the checkpoint on a miss.",
    )
    gpu_plans: int = Field(
        64, ge=1,
        description="Plans the GPU slab holds (online mode). A request needing more distinct plans (steps) is "
        "rejected; H3 at the default accepts up to 64 distinct plans (65 steps).",
    )
    plan_width: int = Field(
        4, ge=1,
        description="Max distinct timesteps per step (rows per plan): 2 for text->video+audio, 3 with a "
        "first-frame condition, 4 with references. A wider plan is rejected.",
    )
    host_cache_gb: float = Field(
        8.0, ge=0,
        description="Pinned host tier size in GB (10^9 bytes); 0 turns the tier off. Pages are one "
        "(plan, timestep) row: num_blocks*adaln_width + final_adaln_width params (9.25 MiB bf16 for H3). "
        "Ignored in resident mode.",
    )
    projection: Literal["match", "fp32"] = Field(
        "match",
        description="match: F.linear in the model dtype, exactly like the model's resident path. "
        "fp32: project in fp32 and cast to the model dtype (more accurate, not equal to the model's own "
        "bf16 path); `cache.plan_cache.ResidentModulation` then uses the same fp32 projection so resident == "
        "online still holds. The engine's adaln.mode: resident runs diffusers' own forward and refuses fp32.",
    )
    readers: int = Field(
        16, ge=1, le=256,
        description="Parallel checkpoint reader threads (os.preadv into pinned staging buffers) for rebuilds.",
    )
    read_chunk_mb: int = Field(
        8, ge=1,
        description="Size in MiB of one reader's preadv request; one block's adaln_proj is split into chunks "
        "spread over the readers.",
    )
    direct_io: Literal["auto", "always", "never"] = Field(
        "auto",
        description="O_DIRECT for rebuild reads. auto: per unit, only when its pages are not in the page cache "
        "(probed with RWF_NOWAIT). On the H200 machine a cold H3 rebuild took 13.5 s with O_DIRECT vs 16.6 s "
        "buffered, while cached units read at ~45 GB/s buffered. always/never force one path (always: tests "
        "and benchmarks).",
    )
    direct_chunk_mb: int = Field(
        32, ge=1,
        description="Size in MiB of one O_DIRECT read request (cold units); fewer, larger requests keep the "
        "disk sequential.",
    )
    staging_buffers: int = Field(
        2, ge=2, le=4,
        description="Pinned staging buffers (and device weight buffers) in the rebuild pipeline, each one "
        "block's adaln_proj (weight + bias, 520 MB for H3): readers fill one while the previous is copied and "
        "projected. 3 shaved ~0.1 s off an H3 page-cache rebuild (0.85 -> 0.74 s with 32 MiB chunks).",
    )

    @property
    def host_cache_bytes(self) -> int:
        return int(round(self.host_cache_gb * GB))
