"""LoRA adapters of the MiniMax-H3 transformer, read from files and applied with diffusers' and peft's own code.

A file is read and converted by diffusers (`MiniMaxH3LoraLoaderMixin.lora_state_dict`: the diffusers/peft layout
as is; the native layout's `blocks.{i}.mlp.fc1` / `attn.out_proj` / `mlp.fc2` renamed, `fc1`'s lora_B rows
half-swapped from native [gate; value] to diffusers [value; gate], as `model.weights` maps the base `mlp.fc1`;
kohya `.alpha` scalars folded) and installed by diffusers (`load_lora_adapter` -> peft's
`inject_adapter_in_model` + `set_peft_model_state_dict`). Ours is only what the libraries leave out:

- alpha: a file's `__metadata__` `alpha` (what the H3 Turbo files carry), else `FALLBACK_ALPHA` = 8 (the v0.1
  Turbo files declare none and were trained at 8; diffusers would take alpha = rank, 16x too strong at rank 128);
  scale = alpha / rank per module;
- refusals, each naming the file (`AdapterError`): fused QKV exports (ComfyUI, DiffSynth: whether the rows are
  interleaved per head, as the checkpoint stores `qkv_proj`, or `[q; k; v]` cannot be told from the file);
  keys naming no Linear of the model; factors touching what the AdaLN plans are computed from (`adaln_proj`,
  `norm_out`, `time_embedder`: plans built without the adapter would be stale; norms hold no Linear at all);
  shapes that do not fit the module; non-float dtypes;
- `fuse_into_base_`: adds an adapter's delta into the base weights with peft's `get_delta_weight`, leaving
  peft's layer unmerged (peft's forward applies no unmerged adapter once one is merged, so a fused adapter could
  not be composed with an unfused one; and peft's unmerge subtracts, which does not give the base bits back:
  the caller restores the base from the checkpoint instead).

Names are diffusers' module names without a component prefix (`transformer_blocks.0.attn.to_q`).
"""

from __future__ import annotations

import enum
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers.loaders import MiniMaxH3LoraLoaderMixin
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import SafetensorError, safe_open
from torch import nn

#: alpha of a file that declares none (scale = alpha / rank): what the H3 Turbo v0.1 files were trained with.
FALLBACK_ALPHA = 8.0
#: Float dtypes a factor may be stored in (peft casts factors to the base layer's dtype when installed).
FACTOR_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Modules whose output feeds the AdaLN plans (`model.adaln.adaln_input`, the projections): an adapter here would
#: change every plan, so a plan cache built without it would serve stale rows.
_ADALN_INPUTS = re.compile(r"(^|\.)(adaln_proj|norm_out|time_embedder)(\.|$)")
_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
#: Diffusers' component prefixes: `transformer.` (FL2VA, the served partition) and `transformer_ref.` (Ref2VA).
_SERVED_PREFIX, _REF_PREFIX = "transformer.", "transformer_ref."


class AdapterError(ValueError):
    """An adapter file that cannot be served: `path` and what is wrong (and what was expected)."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"LoRA adapter {path}: {reason}")
        self.path = str(path)
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.path, self.reason)


class AlphaSource(str, enum.Enum):
    METADATA = "metadata"  # the file's `__metadata__` (`alpha`, or diffusers' own `lora_adapter_metadata`)
    MODULE_ALPHAS = "module_alphas"  # per-module `.alpha` tensors, folded into the factors by diffusers
    FALLBACK = "fallback"  # none declared: FALLBACK_ALPHA


@dataclass(frozen=True)
class LoraFile:
    """An adapter file read, converted to diffusers' names and checked against one transformer."""

    path: Path
    factors: dict[str, torch.Tensor]  # "{module}.lora_A.weight" [r, in] / "{module}.lora_B.weight" [out, r]
    ranks: dict[str, int]  # module -> rank
    alpha: float | None  # None: MODULE_ALPHAS (already folded: alpha = rank per module)
    alpha_source: AlphaSource
    peft_metadata: dict[str, object] | None  # diffusers' LoraConfig kwargs read from the file, when it had them

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(self.ranks)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.factors.values())

    def lora_config_kwargs(self) -> dict[str, object] | None:
        """What diffusers' `load_lora_adapter(metadata=...)` builds peft's `LoraConfig` from; None: let diffusers
        derive it (per-module alphas already folded: alpha = rank)."""
        if self.peft_metadata is not None:
            return self.peft_metadata
        if self.alpha is None:
            return None
        rank = Counter(self.ranks.values()).most_common(1)[0][0]
        # `^...$`: a module name never matches a longer one sharing its prefix (peft's pattern keys are regexes).
        rank_pattern = {f"^{re.escape(m)}$": r for m, r in self.ranks.items() if r != rank}
        return {"r": rank, "lora_alpha": self.alpha, "rank_pattern": rank_pattern, "alpha_pattern": {},
                "target_modules": list(self.ranks), "use_dora": False, "lora_bias": False}


def read_lora_file(path: str | os.PathLike, model: nn.Module | Mapping[str, nn.Module]) -> LoraFile:
    """Read the adapter file at `path` (diffusers/peft or native layout) for `model` (a
    `MiniMaxH3Transformer3DModel`, with or without adapters already installed; or its `dict(named_modules())`
    taken earlier, so a thread can check a file while another installs adapters). AdapterError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise AdapterError(path, "no such file (expected a .safetensors LoRA file readable by this process)")
    try:
        with safe_open(str(path), framework="pt") as handle:
            raw_keys = list(handle.keys())
    except (SafetensorError, OSError) as exc:
        raise AdapterError(path, f"not a readable safetensors file ({exc})") from None
    if not raw_keys:
        raise AdapterError(path, "holds no tensors")
    fused = [k for k in raw_keys if "qkv" in k.split(".lora")[0]]
    if fused:
        raise AdapterError(path, f"holds fused QKV factors ({fused[0]!r}, {len(fused)} keys): a ComfyUI-style "
                           "export whose rows may be interleaved per head or [q; k; v], which a file cannot tell. "
                           "Expected separate attn.to_q / attn.to_k / attn.to_v factors in the diffusers layout "
                           "('transformer.transformer_blocks.0.attn.to_q.lora_A.weight' ...)")
    has_module_alphas = any(k.endswith(".alpha") for k in raw_keys)
    try:
        converted, metadata = MiniMaxH3LoraLoaderMixin.lora_state_dict(str(path), return_lora_metadata=True)
    except (ValueError, KeyError) as exc:  # diffusers' conversion refuses a layout it does not know
        raise AdapterError(path, f"not a MiniMax-H3 LoRA layout diffusers converts ({exc})") from None
    factors = _served_factors(path, converted)
    ranks = _checked_against(path, factors, model)
    peft_metadata = None
    if metadata:  # diffusers read the alpha (or its own LoraConfig) from the file: theirs, prefix dropped
        peft_metadata = {k.removeprefix(_SERVED_PREFIX): v for k, v in metadata.items()
                         if k.startswith(_SERVED_PREFIX)} or None
    if peft_metadata is not None:
        source, alpha = AlphaSource.METADATA, float(peft_metadata.get("lora_alpha", 0) or 0) or None
    elif has_module_alphas:
        source, alpha = AlphaSource.MODULE_ALPHAS, None
    else:
        source, alpha = AlphaSource.FALLBACK, FALLBACK_ALPHA
    return LoraFile(path=path, factors=factors, ranks=ranks, alpha=alpha, alpha_source=source,
                    peft_metadata=peft_metadata)


def _served_factors(path: Path, converted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The converted state dict's factors for the served (FL2VA) transformer, prefix dropped."""
    ref = [k for k in converted if k.startswith(_REF_PREFIX)]
    if ref:
        raise AdapterError(path, f"targets transformer_ref (the Ref2VA partition, e.g. {ref[0]!r}), which this "
                           "server does not serve; expected 'transformer.'-prefixed or unprefixed diffusers names")
    return {k.removeprefix(_SERVED_PREFIX): v for k, v in converted.items()}


def _linear_of(module: nn.Module) -> nn.Linear | None:
    """The nn.Linear a LoRA factor of `module` adapts (a peft layer's base layer once adapters are installed)."""
    if isinstance(module, LoraLayer):
        module = module.get_base_layer()
    return module if isinstance(module, nn.Linear) else None


def _checked_against(path: Path, factors: dict[str, torch.Tensor],
                     model: nn.Module | Mapping[str, nn.Module]) -> dict[str, int]:
    """Every key a factor of a Linear of `model`, each module with A [r, in] and B [out, r]; module -> rank."""
    modules = dict(model) if isinstance(model, Mapping) else dict(model.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in factors.items():
        match = _FACTOR.match(key)
        if match is None:
            raise AdapterError(path, f"key {key!r} is not a LoRA factor ('<module>.lora_A.weight' / "
                               "'<module>.lora_B.weight'); DoRA magnitudes and LoRA biases are not served")
        module = match["module"]
        if _ADALN_INPUTS.search(module):
            raise AdapterError(path, f"adapts {module!r}, an input of the AdaLN modulation (adaln_proj, norm_out, "
                               "time_embedder): plans built without it would be stale. Served adapters target the "
                               "blocks' attention and MLP projections (a full-rank delta such as FastH3's is a "
                               "weight update: /admin/weights)")
        if module not in modules:
            raise AdapterError(path, f"key {key!r} names no module of the MiniMax-H3 transformer ({module!r})")
        if _linear_of(modules[module]) is None:
            raise AdapterError(path, f"key {key!r}: {module!r} is a {type(modules[module]).__name__}, not a Linear "
                               "layer LoRA can adapt")
        if tensor.dtype not in FACTOR_DTYPES:
            raise AdapterError(path, f"{key!r} is {tensor.dtype}; expected one of bf16, fp16, fp32")
        pairs.setdefault(module, {})[match["which"]] = tensor
    ranks: dict[str, int] = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise AdapterError(path, f"{module!r} has no lora_{missing} factor")
        linear = _linear_of(modules[module])
        a, b = pair["A"], pair["B"]
        rank = a.shape[0] if a.ndim == 2 else -1
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != linear.in_features or b.shape != (linear.out_features, rank):
            raise AdapterError(path, f"{module!r}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} do not fit the "
                               f"layer ({linear.out_features} x {linear.in_features}): expected lora_A [r, "
                               f"{linear.in_features}] and lora_B [{linear.out_features}, r] (an adapter for "
                               "another model width, or a pruned checkpoint's)")
        ranks[module] = rank
    return ranks


# --- Installed adapters (diffusers' PeftAdapterMixin on the transformer) -----------------------------------


def install_adapter(model: nn.Module, name: str, lora: LoraFile) -> None:
    """Inject `lora` into `model` as adapter `name` (diffusers' `load_lora_adapter`: peft layers on the factors'
    modules, the factors cast to each base layer's dtype and device). The model's active set is left to
    `activate`.

    `low_cpu_mem_usage`: peft makes the layers on the meta device and takes the file's factors as they are (then
    moved to the base layer's device and dtype), instead of initializing random factors that the file's then
    overwrite: the initialization was ~70% of an install (a rank-128 block on the CPU: 111 ms -> 11 ms)."""
    model.load_lora_adapter(dict(lora.factors), prefix=None, adapter_name=name, metadata=lora.lora_config_kwargs(),
                            low_cpu_mem_usage=True)


def remove_adapter(model: nn.Module, name: str) -> None:
    """Delete adapter `name`'s layers and factors from `model` (diffusers' `delete_adapters`)."""
    model.delete_adapters(name)


def activate(model: nn.Module, scales: dict[str, float]) -> None:
    """Make exactly the adapters in `scales` active, each at its scale (a multiplier of alpha / rank); none:
    adapters off, the base model's forward (what diffusers' `set_adapters` / `disable_lora` do)."""
    activate_layers(tuner_layers(model), scales)


def tuner_layers(model: nn.Module) -> tuple[BaseTunerLayer, ...]:
    """Every peft layer of `model` (what diffusers' adapter calls walk the whole model for, every time)."""
    return tuple(m for m in model.modules() if isinstance(m, BaseTunerLayer))


def activate_layers(layers: Sequence[BaseTunerLayer], scales: dict[str, float]) -> None:
    """`activate` on the model's `tuner_layers`, found once: the calls diffusers' `enable_lora` + `set_adapters`
    (float weights: one scale per adapter) or `disable_lora` make on each peft layer, without walking the ~15k
    modules of H3 twice per switch."""
    names = list(scales)
    for layer in layers:
        if not scales:
            layer.enable_adapters(False)
            continue
        # enable_adapters(True) re-sets the layer's previous adapters (a walk of its parameters) before
        # set_adapter sets the new ones: only needed to leave the disabled state, and the end state is the same.
        if layer.disable_adapters:
            layer.enable_adapters(True)
        layer.set_adapter(names)
        for name, scale in scales.items():
            layer.set_scale(name, scale)


def installed_adapters(model: nn.Module) -> set[str]:
    """Names of the adapters whose factors `model` holds."""
    return {name for m in model.modules() if isinstance(m, LoraLayer) for name in m.lora_A}


def lora_layers(model: nn.Module, name: str) -> dict[str, LoraLayer]:
    """The peft layers holding adapter `name`, by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer) and name in m.lora_A}


@torch.no_grad()
def fuse_into_base_(model: nn.Module, name: str, scale: float) -> list[str]:
    """Add adapter `name`'s delta at `scale` into its modules' base weights (peft's `get_delta_weight`, in the
    base dtype); returns the base weight names written (`{module}.weight`, diffusers' names) so the caller can
    restore them. The adapter must then stay inactive while fused (else it would count twice)."""
    written = []
    for module, layer in lora_layers(model, name).items():
        layer.set_scale(name, scale)
        base = layer.get_base_layer()
        base.weight.data += layer.get_delta_weight(name).to(base.weight.dtype)
        written.append(f"{module}.weight")
    return written
