"""Text conditioning: the encoder interface and a byte-level embedder shipped inside the checkpoint.

The real H3 uses a large LLM encoder (text_dim 5120). ditserve stands in a tiny byte-level embedder with
the same output contract, so serving code never depends on which encoder produced the states.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import DiTConfig
from model.init import init_parameters

#: Vocabulary: the 256 byte values, then BOS (prepended to every prompt, so even "" has one token).
BOS_ID = 256
VOCAB_SIZE = 257


@runtime_checkable
class TextEncoder(Protocol):
    """Turns a prompt into text states for `DiT.prepare` / `DiT.forward`."""

    text_dim: int

    def encode(self, prompt: str) -> Tensor:
        """prompt -> [L, text_dim] (L >= 1)."""
        ...


class ResidualMLP(nn.Module):
    """x + fc2(silu(fc1(x))), width -> width -> width."""

    def __init__(self, width: int, *, device=None):
        super().__init__()
        self.fc1 = nn.Linear(width, width, device=device, dtype=torch.float32)
        self.fc2 = nn.Linear(width, width, device=device, dtype=torch.float32)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.silu(self.fc1(x)))


class ByteTextEmbedder(nn.Module):
    """UTF-8 bytes (+BOS) -> byte and position embeddings -> residual MLPs -> Linear to text_dim (fp32).

    It is the `text_embedder` submodule of `DiT`, so its weights live in the checkpoint under
    `text_embedder.*` and load with the rest of the model.
    """

    def __init__(self, config: DiTConfig, *, device=None, seed: int = 0):
        super().__init__()
        self.max_text_tokens = config.max_text_tokens
        self.text_dim = config.text_dim
        width, meta = config.text_embedder_width, torch.device("meta")
        # _weight: skip nn.Embedding's default normal_ init (slow on meta; we initialise below).
        self.embed = nn.Embedding(VOCAB_SIZE, width, _weight=torch.empty(VOCAB_SIZE, width, device=meta))
        # Learned positions: the DiT leaves text tokens unrotated, so word order enters here.
        self.pos_embed = nn.Parameter(torch.empty(config.max_text_tokens + 1, width, device=meta))
        self.layers = nn.ModuleList(ResidualMLP(width, device=meta) for _ in range(config.text_embedder_layers))
        self.out = nn.Linear(width, config.text_dim, device=meta, dtype=torch.float32)
        target = torch.device(device) if device is not None else torch.get_default_device()
        if target.type != "meta":
            # Standalone: the same values as DiT(config, seed=seed).text_embedder.
            self.to_empty(device=target)
            init_parameters(self, config, seed, prefix="text_embedder")
        self.requires_grad_(False)

    def tokenize(self, prompt: str) -> Tensor:
        """prompt -> int64 [1 + len(utf8 bytes)]: BOS then one token per byte."""
        data = prompt.encode("utf-8")
        if len(data) > self.max_text_tokens:
            raise ValueError(
                f"prompt is {len(data)} UTF-8 bytes; the limit is max_text_tokens={self.max_text_tokens} "
                f"(one token per byte): shorten the prompt"
            )
        return torch.tensor([BOS_ID, *data], dtype=torch.long, device=self.embed.weight.device)

    def forward(self, ids: Tensor) -> Tensor:
        """ids int64 [L] -> fp32 [L, text_dim]."""
        x = self.embed(ids) + self.pos_embed[: ids.shape[0]]  # [L, width]
        for layer in self.layers:
            x = layer(x)
        return self.out(x)

    @torch.no_grad()
    def encode(self, prompt: str) -> Tensor:
        return self(self.tokenize(prompt))
