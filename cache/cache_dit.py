"""cache-dit's DBCache on a DiT's block stack, through the real library. The only module that imports
cache_dit (lazily: `CacheDitConfig` is importable without cache-dit, diffusers or transformers installed).

What the model must provide (diffusers' `MiniMaxH3Transformer3DModel` does):

- its block stack as a direct child `nn.ModuleList` named `transformer_blocks` (H3 and most diffusers
  transformers) or `blocks` (diffusers' Wan) (`find_block_stack`; pass a `BlockStack` to `CacheDit` to name
  another).
- blocks of cache-dit's `ForwardPattern.Pattern_3`: `forward(hidden_states, ...) -> hidden_states`, any
  other arguments positional (H3: `temb, adaln_indices, rotary_emb`) or keyword; cache-dit passes them
  through untouched. The pattern is read from the block's signature and return
  annotation, never assumed. No op may write into `hidden_states` in place: DBCache diffs a block's input
  against its output, an in-place write makes the residual 0/0 and silently disables caching.
- a forward that runs the blocks as `for block in self.<attr>: h = block(h, ...)`. During forward cache-dit
  temporarily replaces that attribute by a one-element ModuleList holding its `CachedBlocks`, so the loop
  must read the attribute (no `self.blocks[i]`, no `len(self.blocks)`, no list kept from `__init__`).
- any forward signature: cache-dit wraps `forward(*args, **kwargs)` as is.

cache-dit 1.5.3's registry of predefined block adapters has no entry for MiniMax-H3, so the adapter is
built here from the `BlockStack`.

Per request: `CacheDit.refresh(num_inference_steps, overrides)` rebuilds cache-dit's context (buffers,
step counters, cached steps, TaylorSeer state), so nothing leaks from one request into the next; per
step, `predict_middle()` tells the offloader whether the middle blocks will surely run.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)


# --- the versions this module is written against ----------------------------------------------------


@dataclass(frozen=True)
class SupportedRange:
    """`lowest <= version < below` of one distribution, compared on the release numbers (1.5.3 -> (1, 5, 3))."""

    package: str
    lowest: tuple[int, ...]
    below: tuple[int, ...]

    @property
    def requirement(self) -> str:
        return f"{self.package}>={'.'.join(map(str, self.lowest))},<{'.'.join(map(str, self.below))}"

    def admits(self, version: str) -> bool:
        return self.lowest <= release_numbers(version) < self.below


#: Kept equal to pyproject.toml's pins. `CacheDit.predict_middle` mirrors cache-dit 1.5's private
#: `CachedContextManager.can_cache` and `_context` reads the wrapped model's private `_context_manager`;
#: cache-dit 1.5 itself reads diffusers 0.42's internals. Another minor version may move any of them, and a
#: wrong `predict_middle` would only cost time, silently: so another version is refused, by name.
SUPPORTED_VERSIONS: tuple[SupportedRange, ...] = (
    SupportedRange("cache-dit", (1, 5), (1, 6)),
    SupportedRange("diffusers", (0, 42, 1), (0, 43)),
)


class UnsupportedVersion(ImportError):
    """An installed cache-dit or diffusers outside the range whose private names this module reads."""


def release_numbers(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: "1.5.3" -> (1, 5, 3), "0.43.0.dev0" -> (0, 43, 0)."""
    release = re.match(r"\d+(?:\.\d+)*", version)
    if release is None:
        raise UnsupportedVersion(f"cannot read a release number from version {version!r}")
    return tuple(int(n) for n in release.group().split("."))


def check_versions(installed: Mapping[str, str | None]) -> None:
    """Raise `UnsupportedVersion` naming the package, its version and the supported range when an installed
    distribution is outside `SUPPORTED_VERSIONS`; a missing one (None) is left to the lazy import to report."""
    for supported in SUPPORTED_VERSIONS:
        version = installed.get(supported.package)
        if version is not None and not supported.admits(version):
            raise UnsupportedVersion(
                f"{supported.package} {version} is installed; cache/cache_dit.py reads private names of "
                f"{supported.requirement} (pyproject.toml pins it): install that range"
            )


def installed_versions() -> dict[str, str | None]:
    """The installed version of each distribution in `SUPPORTED_VERSIONS` (None: not installed)."""
    versions: dict[str, str | None] = {}
    for supported in SUPPORTED_VERSIONS:
        try:
            versions[supported.package] = importlib.metadata.version(supported.package)
        except importlib.metadata.PackageNotFoundError:
            versions[supported.package] = None
    return versions


# At import, before anything reads a private name: on another version this module fails loudly, at once.
check_versions(installed_versions())

#: Where a model keeps its block stack, in lookup order (diffusers' names: H3 and most, then Wan).
BLOCK_STACK_ATTRS: tuple[str, ...] = ("transformer_blocks", "blocks")

#: cache-dit forward patterns this adapter serves (hidden states in, hidden states out).
ForwardPatternName = Literal["Pattern_3"]

StepsMaskPolicy = Literal["slow", "medium", "fast", "ultra"]

_DESCRIPTIONS = {
    "enabled": "Apply DBCache (cache-dit) to the DiT blocks.",
    "Fn_compute_blocks": "Leading blocks always computed (at least 1); their residual decides whether the step "
    "is cached.",
    "Bn_compute_blocks": "Trailing blocks always computed, also in cached steps.",
    "max_warmup_steps": "First steps always computed.",
    "warmup_interval": "Compute every n-th step within the warmup.",
    "residual_diff_threshold": "Cache the step when the relative L1 change of the Fn residual is below this (0: never).",
    "max_cached_steps": "Most cached steps per request (-1: no limit).",
    "max_continuous_cached_steps": "Most cached steps in a row (-1: no limit).",
    "enable_taylorseer": "Extrapolate the cached residual with TaylorSeer.",
    "taylorseer_order": "TaylorSeer order.",
    "steps_computation_mask": "Per-step mask (1 compute, 0 cache allowed) or a cache-dit policy name "
    "(slow | medium | fast | ultra) resolved for the request's step count; None/[]: no mask.",
    "steps_computation_policy": "dynamic: masked-0 steps still check the residual; static: they are always cached.",
}


def _check_mask(v):
    if isinstance(v, list) and any(m not in (0, 1) for m in v):
        raise ValueError(f"steps_computation_mask entries must be 0 or 1, got {v}")
    return v


class CacheDitConfig(BaseModel):
    """DBCache settings under cache-dit's own names (`cache_dit:` in serve_config.yaml)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    enabled: bool = Field(False, description=_DESCRIPTIONS["enabled"])
    Fn_compute_blocks: int = Field(1, ge=1, description=_DESCRIPTIONS["Fn_compute_blocks"])
    Bn_compute_blocks: int = Field(0, ge=0, description=_DESCRIPTIONS["Bn_compute_blocks"])
    max_warmup_steps: int = Field(8, ge=0, description=_DESCRIPTIONS["max_warmup_steps"])
    warmup_interval: int = Field(1, ge=1, description=_DESCRIPTIONS["warmup_interval"])
    residual_diff_threshold: float = Field(0.08, ge=0.0, description=_DESCRIPTIONS["residual_diff_threshold"])
    max_cached_steps: int = Field(-1, ge=-1, description=_DESCRIPTIONS["max_cached_steps"])
    max_continuous_cached_steps: int = Field(-1, ge=-1, description=_DESCRIPTIONS["max_continuous_cached_steps"])
    enable_taylorseer: bool = Field(False, description=_DESCRIPTIONS["enable_taylorseer"])
    taylorseer_order: int = Field(1, ge=1, le=4, description=_DESCRIPTIONS["taylorseer_order"])
    steps_computation_mask: list[int] | StepsMaskPolicy | None = Field(
        None, description=_DESCRIPTIONS["steps_computation_mask"]
    )
    steps_computation_policy: Literal["dynamic", "static"] = Field(
        "dynamic", description=_DESCRIPTIONS["steps_computation_policy"]
    )

    @field_validator("steps_computation_mask")
    @classmethod
    def _mask_bits(cls, v):
        return _check_mask(v)

    @model_validator(mode="after")
    def _static_needs_mask(self) -> "CacheDitConfig":
        if self.steps_computation_policy == "static" and not self.steps_computation_mask:
            raise ValueError("steps_computation_policy='static' needs a steps_computation_mask")
        return self

    def check_num_blocks(self, num_blocks: int) -> None:
        """ValueError unless Fn_compute_blocks + Bn_compute_blocks fit in `num_blocks`."""
        if self.Fn_compute_blocks + self.Bn_compute_blocks > num_blocks:
            raise ValueError(
                f"Fn_compute_blocks + Bn_compute_blocks = {self.Fn_compute_blocks} + {self.Bn_compute_blocks} "
                f"exceeds the model's {num_blocks} blocks"
            )

    def resolve_mask(self, num_inference_steps: int) -> list[int] | None:
        """The 0/1 mask for a request of `num_inference_steps` steps (None: no mask)."""
        mask = self.steps_computation_mask
        if not mask:
            return None
        if isinstance(mask, str):
            import cache_dit

            try:
                return list(cache_dit.steps_mask(total_steps=num_inference_steps, mask_policy=mask))
            except AssertionError as exc:  # e.g. under 8 steps only 4 or 6 have a named mask
                raise ValueError(
                    f"steps_computation_mask={mask!r} does not fit {num_inference_steps} steps: {exc}") from None
        if len(mask) < num_inference_steps:
            raise ValueError(
                f"steps_computation_mask has {len(mask)} entries, the request has {num_inference_steps} steps"
            )
        return list(mask)

    def merged(self, overrides: "CacheDitOverrides | None") -> "CacheDitConfig":
        """This config with a request's overrides applied (validated again; errors name the field)."""
        if overrides is None:
            return self
        changes = overrides.model_dump(exclude_none=True)
        return CacheDitConfig.model_validate({**self.model_dump(), **changes})

    def label(self) -> str:
        """Shorthand such as 'F1B2 W8 R0.08 MC2' (no-cache: 'off')."""
        if not self.enabled:
            return "off"
        parts = [f"F{self.Fn_compute_blocks}B{self.Bn_compute_blocks}", f"W{self.max_warmup_steps}",
                 f"R{self.residual_diff_threshold:g}"]
        if self.max_continuous_cached_steps >= 0:
            parts.append(f"MC{self.max_continuous_cached_steps}")
        if self.max_cached_steps >= 0:
            parts.append(f"M{self.max_cached_steps}")
        if self.enable_taylorseer:
            parts.append(f"TS{self.taylorseer_order}")
        if self.steps_computation_mask:
            mask = self.steps_computation_mask
            parts.append(f"SCM-{mask if isinstance(mask, str) else ''.join(map(str, mask))}-{self.steps_computation_policy}")
        return " ".join(parts)


class CacheDitOverrides(BaseModel):
    """A request's changes to the server's `CacheDitConfig`; None keeps the server's value
    (an empty steps_computation_mask removes the server's mask)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool | None = Field(None, description=_DESCRIPTIONS["enabled"])
    Fn_compute_blocks: int | None = Field(None, ge=1, description=_DESCRIPTIONS["Fn_compute_blocks"])
    Bn_compute_blocks: int | None = Field(None, ge=0, description=_DESCRIPTIONS["Bn_compute_blocks"])
    max_warmup_steps: int | None = Field(None, ge=0, description=_DESCRIPTIONS["max_warmup_steps"])
    warmup_interval: int | None = Field(None, ge=1, description=_DESCRIPTIONS["warmup_interval"])
    residual_diff_threshold: float | None = Field(
        None, ge=0.0, allow_inf_nan=False, description=_DESCRIPTIONS["residual_diff_threshold"])
    max_cached_steps: int | None = Field(None, ge=-1, description=_DESCRIPTIONS["max_cached_steps"])
    max_continuous_cached_steps: int | None = Field(None, ge=-1, description=_DESCRIPTIONS["max_continuous_cached_steps"])
    enable_taylorseer: bool | None = Field(None, description=_DESCRIPTIONS["enable_taylorseer"])
    taylorseer_order: int | None = Field(None, ge=1, le=4, description=_DESCRIPTIONS["taylorseer_order"])
    steps_computation_mask: list[int] | StepsMaskPolicy | None = Field(
        None, description=_DESCRIPTIONS["steps_computation_mask"]
    )
    steps_computation_policy: Literal["dynamic", "static"] | None = Field(
        None, description=_DESCRIPTIONS["steps_computation_policy"]
    )

    @field_validator("steps_computation_mask")
    @classmethod
    def _mask_bits(cls, v):
        return _check_mask(v)


@dataclass
class CacheDitStats:
    """One request's caching, read from cache-dit's context."""

    config: str  # label of the effective config
    num_inference_steps: int
    cached_steps: list[int] = field(default_factory=list)
    residual_diffs: dict[str, float] = field(default_factory=dict)

    @property
    def num_cached_steps(self) -> int:
        return len(self.cached_steps)


class BlockStackError(ValueError):
    """The model has no block stack DBCache can wrap (the message names the model, block and reason)."""


@dataclass(frozen=True)
class BlockStack:
    """The block list DBCache wraps, the model attribute holding it and how its blocks are called."""

    attr: str  # cache-dit swaps `model.<attr>` for its CachedBlocks during forward
    blocks: "nn.ModuleList"
    forward_pattern: ForwardPatternName


def block_forward_pattern(block: "nn.Module") -> ForwardPatternName:
    """cache-dit's forward pattern of `block`, read from its forward's signature and return annotation.

    Pattern_3: the first parameter is `hidden_states`, there is no `encoder_hidden_states` (a dual-stream
    block, Patterns 0-2), and the return annotation is a single tensor (a tuple would be Pattern 4/5).
    """
    import torch

    forward = type(block).forward
    name = type(block).__name__
    params = list(inspect.signature(forward).parameters.values())[1:]  # drop self
    if not params or params[0].name != "hidden_states" or params[0].kind not in (
            inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        raise BlockStackError(f"{name}.forward must take hidden_states as its first positional argument, "
                              f"got {[p.name for p in params]}")
    if any(p.name == "encoder_hidden_states" for p in params):
        raise BlockStackError(f"{name}.forward takes encoder_hidden_states (a dual-stream block); "
                              "only hidden-states-only blocks (cache-dit Pattern_3) are served")
    try:
        returns = typing.get_type_hints(forward).get("return")
    except (NameError, TypeError) as exc:  # an annotation naming something the block's module cannot resolve
        raise BlockStackError(f"{name}.forward's annotations do not resolve ({exc}); "
                              "cannot tell its forward pattern") from None
    if returns is not torch.Tensor:
        raise BlockStackError(f"{name}.forward must be annotated to return torch.Tensor (hidden_states only, "
                              f"cache-dit Pattern_3), got {returns!r}")
    return "Pattern_3"


def find_block_stack(model: "nn.Module") -> BlockStack:
    """The model's block stack: its first direct child named in `BLOCK_STACK_ATTRS` that is a non-empty
    `nn.ModuleList` of blocks of one class, with their forward pattern."""
    from torch import nn

    for attr in BLOCK_STACK_ATTRS:
        blocks = model._modules.get(attr)
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            break
    else:
        raise BlockStackError(f"{type(model).__name__} has no block stack: expected a non-empty nn.ModuleList "
                              f"child named one of {BLOCK_STACK_ATTRS}")
    classes = sorted({type(b).__name__ for b in blocks})
    if len(classes) != 1:
        raise BlockStackError(f"{type(model).__name__}.{attr} mixes block classes {classes}; DBCache needs one")
    return BlockStack(attr=attr, blocks=blocks, forward_pattern=block_forward_pattern(blocks[0]))


class CacheDit:
    """DBCache applied to the model's block stack (`find_block_stack(model)` unless `stack` is given)
    with cache-dit's BlockAdapter and the stack's forward pattern.

    The server config is applied at construction (validated against the block count); `refresh` must be
    called before every request. A request may switch caching off (`enabled=False`): cache-dit then
    stays wrapped but computes every step (threshold 0, no warmup, no mask).
    """

    def __init__(self, model: "nn.Module", config: CacheDitConfig, *, stack: BlockStack | None = None):
        import cache_dit

        stack = stack if stack is not None else find_block_stack(model)
        if model._modules.get(stack.attr) is not stack.blocks:
            raise BlockStackError(f"{type(model).__name__}.{stack.attr} is not the stack's block list; "
                                  "cache-dit swaps that attribute during forward")
        config.check_num_blocks(len(stack.blocks))
        self.model = model
        self.config = config
        self.stack = stack
        self.num_blocks = len(stack.blocks)
        self.effective = config
        self.num_inference_steps = 0
        adapter = cache_dit.BlockAdapter(
            transformer=model,
            blocks=stack.blocks,
            blocks_name=stack.attr,
            forward_pattern=cache_dit.ForwardPattern[stack.forward_pattern],
            check_forward_pattern=True,
        )
        cache_config, calibrator = self._cache_dit_configs(config, None)
        cache_dit.enable_cache(adapter, cache_config=cache_config, calibrator_config=calibrator)
        self._names: list[str] = list(getattr(model, "_context_names", []))
        if len(self._names) != 1:
            raise RuntimeError(f"expected one cache-dit context on the model, found {self._names}")

    # --- per request ------------------------------------------------------------------------------

    def refresh(self, num_inference_steps: int, overrides: CacheDitOverrides | None = None) -> CacheDitConfig:
        """Fresh cache-dit context for a request of `num_inference_steps` steps; returns the effective config."""
        return self.refresh_resolved(num_inference_steps, self.config.merged(overrides))

    def refresh_resolved(self, num_inference_steps: int, cfg: CacheDitConfig) -> CacheDitConfig:
        """`refresh` with the request's effective config already merged and checked (the engine resolves it
        once per request and passes it on)."""
        import cache_dit

        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        cfg.check_num_blocks(self.num_blocks)
        cache_config, calibrator = self._cache_dit_configs(cfg, num_inference_steps)
        ctx = self._context()
        # cache-dit merges refresh arguments into the context's stored init kwargs and skips None
        # fields, so a value this request clears (no mask, no TaylorSeer after a request that had them)
        # would leak from the previous one: start the merge from nothing but the context's name.
        ctx._init_kwargs = {k: v for k, v in ctx._init_kwargs.items() if k not in ("cache_config", "calibrator_config")}
        kwargs = {"cache_config": cache_config}
        if calibrator is not None:
            kwargs["calibrator_config"] = calibrator
        cache_dit.refresh_context(self.model, **kwargs)
        ctx = self._context()
        got = ctx.cache_config
        if (got.num_inference_steps != num_inference_steps or got.steps_computation_mask != cache_config.steps_computation_mask
                or got.residual_diff_threshold != cache_config.residual_diff_threshold
                or (ctx.calibrator_config is not None) != (calibrator is not None) or ctx.executed_steps != 0):
            raise RuntimeError(f"cache-dit refresh_context did not install the request's config: {got}")
        self.effective, self.num_inference_steps = cfg, num_inference_steps
        return cfg

    @staticmethod
    def _cache_dit_configs(cfg: CacheDitConfig, num_inference_steps: int | None):
        import cache_dit

        if not cfg.enabled:
            return cache_dit.DBCacheConfig(
                Fn_compute_blocks=cfg.Fn_compute_blocks, Bn_compute_blocks=cfg.Bn_compute_blocks,
                residual_diff_threshold=0.0, max_warmup_steps=0, enable_separate_cfg=False,
                num_inference_steps=num_inference_steps,
            ), None
        mask = cfg.resolve_mask(num_inference_steps) if num_inference_steps is not None else None
        cache_config = cache_dit.DBCacheConfig(
            Fn_compute_blocks=cfg.Fn_compute_blocks,
            Bn_compute_blocks=cfg.Bn_compute_blocks,
            max_warmup_steps=cfg.max_warmup_steps,
            warmup_interval=cfg.warmup_interval,
            residual_diff_threshold=cfg.residual_diff_threshold,
            max_cached_steps=cfg.max_cached_steps,
            max_continuous_cached_steps=cfg.max_continuous_cached_steps,
            enable_separate_cfg=False,  # one model call per step (no separate CFG branch)
            num_inference_steps=num_inference_steps,
            steps_computation_mask=mask,
            steps_computation_policy=cfg.steps_computation_policy if mask is not None else "dynamic",
        )
        calibrator = None
        if cfg.enable_taylorseer:
            calibrator = cache_dit.TaylorSeerCalibratorConfig(
                enable_calibrator=True, enable_encoder_calibrator=False, taylorseer_order=cfg.taylorseer_order
            )
        return cache_config, calibrator

    # --- per step ---------------------------------------------------------------------------------

    def predict_middle(self) -> bool | None:
        """Will the coming step compute the middle blocks? Call before the model forward of each step.

        True when cache-dit will compute them whatever the residual (warmup, a steps-mask 1, max cached
        or max continuous cached steps reached, no reference residual yet, threshold 0); False when it will
        surely cache (static steps mask); None when the Fn residual check decides. Mirrors the order of
        cache-dit 1.5's `CachedContextManager.can_cache`; a wrong guess costs time, never correctness
        (the offloader loads a block synchronously if it runs unannounced).
        """
        ctx = self._context()
        cfg = ctx.cache_config
        step = ctx.executed_steps  # cache-dit counts the step in mark_step_begin, after the Fn blocks
        if cfg.num_inference_steps is not None and step >= cfg.num_inference_steps:
            return True  # cache-dit starts a fresh context: nothing to compare against
        if step in ctx.warmup_steps:
            return True
        mask = cfg.steps_computation_mask
        if mask is not None:
            if step < len(mask) and mask[step] == 1:
                return True
            if cfg.steps_computation_policy == "static":
                return False
        if step == 0:
            return True  # no reference residual yet
        cached = ctx.cached_steps
        if cfg.max_cached_steps >= 0 and len(cached) >= cfg.max_cached_steps:
            return True
        streak = ctx.continuous_cached_steps if cached and cached[-1] == step - 1 else 0
        if cfg.max_continuous_cached_steps >= 0 and streak >= cfg.max_continuous_cached_steps:
            return True
        acc = cfg.max_accumulated_residual_diff_threshold
        if acc is not None and acc > 0.0 and ctx.accumulated_residual_diff >= acc:
            return True
        threshold = ctx.get_residual_diff_threshold()
        if threshold <= 0.0:
            return True
        if threshold >= 1.0:
            return False
        return None

    # --- stats ------------------------------------------------------------------------------------

    def cached_steps(self) -> list[int]:
        """Steps of the current request that reused the cache (their middle blocks did not run)."""
        return list(self._context().get_cached_steps())

    def stats(self) -> CacheDitStats:
        ctx = self._context()
        return CacheDitStats(
            config=self.effective.label(),
            num_inference_steps=self.num_inference_steps,
            cached_steps=list(ctx.get_cached_steps()),
            residual_diffs={k: float(v) for k, v in ctx.get_residual_diffs().items()},
        )

    def disable(self) -> None:
        """Unwrap the model (its forward runs every block again)."""
        import cache_dit

        cache_dit.disable_cache(self.model)

    def _context(self):
        return self.model._context_manager.get_context(self._names[0])


__all__ = [
    "BLOCK_STACK_ATTRS",
    "SUPPORTED_VERSIONS",
    "SupportedRange",
    "UnsupportedVersion",
    "check_versions",
    "BlockStack",
    "BlockStackError",
    "CacheDit",
    "CacheDitConfig",
    "CacheDitOverrides",
    "CacheDitStats",
    "block_forward_pattern",
    "find_block_stack",
]
