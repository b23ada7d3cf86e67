"""A seeded random LoRA adapter of the tiny transformer, as a peft/diffusers trainer writes one.

peft injects random factors (`inject_adapter_in_model` with `init_lora_weights=False`: peft's default B = 0 would
change nothing) into `model.tiny.tiny_transformer` and dumps them (`get_peft_model_state_dict`); the file holds
them under diffusers' `transformer.` prefix with the alpha in its `__metadata__`, as the H3 Turbo files do.

CLI:  python -m model.tiny_adapter --out FILE [--seed N] [--rank R] [--alpha A] [--targets attn.to_q ...]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from safetensors.torch import save_file

from model.tiny import TINY_TRANSFORMER, tiny_transformer
from model.weights import H3TransformerConfig

#: The H3 Turbo files' targets (h3.md section 9), in every block and refiner block.
TURBO_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")


def tiny_lora_factors(seed: int, *, targets: tuple[str, ...] = TURBO_TARGETS, rank: int = 4,
                      config: H3TransformerConfig = TINY_TRANSFORMER) -> dict[str, torch.Tensor]:
    """Random factors of a rank-`rank` LoRA on `targets` of the transformer of `config`, diffusers module names
    (`transformer_blocks.0.attn.to_q.lora_A.weight`), in the base layers' dtype. Draws from its own RNG state."""
    model = tiny_transformer(0, config)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets),
                                           init_lora_weights=False), model, adapter_name="trained")
    return {k: v.contiguous() for k, v in get_peft_model_state_dict(model, adapter_name="trained").items()}


def save_adapter(path: str | os.PathLike, factors: dict[str, torch.Tensor], *, alpha: float | None = 8.0,
                 prefix: str = "transformer.") -> Path:
    """Write `factors` as a LoRA file: keys under `prefix`, `alpha` in the metadata (None: declares none)."""
    path = Path(path)
    save_file({prefix + k: v for k, v in factors.items()}, str(path),
              metadata={"alpha": str(alpha)} if alpha is not None else None)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.tiny_adapter", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the .safetensors file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=8.0)
    parser.add_argument("--targets", nargs="+", default=list(TURBO_TARGETS))
    args = parser.parse_args(argv)
    factors = tiny_lora_factors(args.seed, targets=tuple(args.targets), rank=args.rank)
    out = save_adapter(args.out, factors, alpha=args.alpha)
    print(f"wrote {out} ({len(factors) // 2} modules, rank {args.rank}, alpha {args.alpha:g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
