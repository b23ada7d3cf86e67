"""DiT architecture config and presets.

`h3` reproduces MiniMax-H3's DiT shapes (see shared/reference.md); `tiny` and `small` keep the
same structure at CPU-friendly sizes. Every dimension is a field so benchmarks can pick sizes in
between (e.g. `h3` width with 12 blocks: `preset("h3", num_blocks=12)`).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Token tags of the packed sequence. Padding is tagged -1 and treated as video (0).
TAG_VIDEO, TAG_TEXT, TAG_AUDIO, TAG_PAD = 0, 1, 2, -1
NUM_MODALITIES = 3
#: AdaLN chunks per block and modality: shift/scale/gate for attention, then for the MLP.
NUM_BLOCK_CHUNKS = 6
#: Final layer chunks: shift, scale (one modality).
NUM_FINAL_CHUNKS = 2

DTypeName = Literal["bfloat16", "float16", "float32"]


class DiTConfig(BaseModel):
    """Shapes of the DiT. Field names are also the keys of the checkpoint's config.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("custom", description="Preset name this config came from (informational).")
    num_blocks: int = Field(50, ge=1, description="Number of DiT blocks (AdaLN-modulated).")
    hidden: int = Field(5376, ge=8, description="Residual stream width.")
    num_heads: int = Field(56, ge=1, description="Attention heads.")
    head_dim: int = Field(128, ge=4, description="Width of one head; q/k/v are hidden -> heads*head_dim.")
    ffn: int = Field(14336, ge=8, description="SwiGLU inner width (gate and up are fused: hidden -> 2*ffn).")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    freq_dim: int = Field(256, ge=4, description="Sinusoidal timestep embedding width (cos before sin).")
    time_embed_dim: int = Field(2688, ge=4, description="AdaLN input width (output of the time embedder).")
    text_dim: int = Field(5120, ge=4, description="Width of text encoder states fed to condition_proj.")
    num_refiner_blocks: int = Field(2, ge=0, description="Plain pre-norm text refiner blocks (no AdaLN).")
    video_channels: int = Field(24, ge=1, description="Video latent channels.")
    patch: tuple[int, int, int] = Field((1, 2, 2), description="Video patch size (t, h, w).")
    audio_channels: int = Field(32, ge=1, description="Audio latent channels (one token per audio frame).")
    rope_axes_dims: tuple[int, int, int] = Field(
        (32, 32, 32), description="Head dims rotated by 3-D RoPE per axis (t, h, w); the rest are not rotated."
    )
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base.")
    dtype: DTypeName = Field("bfloat16", description="Dtype of blocks, refiner and AdaLN projections.")
    # Text embedder shipped inside the checkpoint (byte-level; see model/text.py).
    text_embedder_width: int = Field(256, ge=8, description="Inner width of the byte-level text embedder.")
    text_embedder_layers: int = Field(2, ge=0, description="Residual MLP layers of the byte-level text embedder.")
    # Request limits the model accepts (latent units).
    max_frames: int = Field(32, ge=1, description="Max latent video frames.")
    max_height: int = Field(96, ge=1, description="Max latent video height.")
    max_width: int = Field(160, ge=1, description="Max latent video width.")
    max_audio_len: int = Field(512, ge=0, description="Max audio latent frames.")
    max_text_tokens: int = Field(512, ge=1, description="Max prompt length in bytes (one token per byte).")

    @model_validator(mode="after")
    def _check_shapes(self) -> "DiTConfig":
        if any(d % 2 for d in self.rope_axes_dims):
            raise ValueError(f"rope_axes_dims {self.rope_axes_dims} must all be even")
        if sum(self.rope_axes_dims) > self.head_dim:
            raise ValueError(f"sum(rope_axes_dims)={sum(self.rope_axes_dims)} exceeds head_dim={self.head_dim}")
        if self.max_height % self.patch[1] or self.max_width % self.patch[2] or self.max_frames % self.patch[0]:
            raise ValueError("max_frames/max_height/max_width must be multiples of the patch size")
        return self

    # Derived widths (properties, not fields, so config.json stays minimal).
    @property
    def attn_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def adaln_width(self) -> int:
        """Output width of one block's adaln_proj: 3 modalities x 6 chunks x hidden."""
        return NUM_MODALITIES * NUM_BLOCK_CHUNKS * self.hidden

    @property
    def final_adaln_width(self) -> int:
        """Output width of the final layer's adaln: shift and scale."""
        return NUM_FINAL_CHUNKS * self.hidden

    @property
    def patch_dim(self) -> int:
        return self.video_channels * self.patch[0] * self.patch[1] * self.patch[2]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


_PRESETS: dict[str, dict] = {
    "h3": dict(name="h3"),
    "small": dict(
        name="small", num_blocks=8, hidden=512, num_heads=8, head_dim=80, ffn=1408,
        time_embed_dim=256, text_dim=512, num_refiner_blocks=2, rope_axes_dims=(16, 24, 24),
        text_embedder_width=128, max_frames=16, max_height=64, max_width=64, max_audio_len=256,
        max_text_tokens=256,
    ),
    "tiny": dict(
        name="tiny", num_blocks=4, hidden=64, num_heads=4, head_dim=24, ffn=128,
        freq_dim=64, time_embed_dim=32, text_dim=48, num_refiner_blocks=1,
        video_channels=4, audio_channels=8, rope_axes_dims=(4, 8, 8),
        text_embedder_width=32, text_embedder_layers=1,
        max_frames=8, max_height=32, max_width=32, max_audio_len=64, max_text_tokens=128,
    ),
}

PRESET_NAMES = tuple(_PRESETS)


def preset(name: str, **overrides) -> DiTConfig:
    """A preset config, optionally with fields overridden (`preset("h3", num_blocks=12)`)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")
    return DiTConfig(**{**_PRESETS[name], **overrides})
