"""The engine's LoRA adapters: configured by name, checked at start, held in a bytes-bounded LRU, set per request.

`AdapterSet(configs, cache_bytes, transformer, weights)` opens and checks every configured file at construction
(`model.adapters.read_lora_file`; an `AdapterError` naming the file stops the engine's start) and installs them
into the transformer in config order while they fit `cache_bytes` (preloaded: a request for one loads nothing).
A request naming one that is not held starts its read on arrival (`prefetch`, from the worker's thread: the
`engine.adapter_loader` thread reads, converts and checks the file while the engine thread denoises the running
request). Per request, under the engine's lock, `apply(choices, cancelled)`:

- installs an adapter the request names that is not held (its file as the loader read it, waiting for a read in
  flight with cancellation still honoured; evicting the least recently used adapters the request does not name
  until it fits), so requests with different adapters, or none, alternate on one engine;
- with `fuse: true` (the first such adapter of the request) adds its delta at the request's scale into the base
  weights, and takes it back out before a request that does not run it at that scale by reading those base
  weights again from the checkpoint (`TransformerWeights.tensor`: the checkpoint's bits, never a subtraction);
- makes exactly the request's other adapters active at their scales (none: adapters off, the base forward).

Installed after the offloader is applied, a LoRA layer's factors are created on the device beside the
placeholders of its streamed base weights and stay there (the offloader streams only the tensors it saw at
`apply`): resident, never streamed, so never applied to the wrong block. The AdaLN plans are untouched (the
loader refuses adapters on their inputs), so plans built without an adapter serve requests with it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.adapter_loader import AdapterLoader
from engine.api import AdapterChoice, AdapterStats, CancelledFn
from engine.config import AdapterConfig
from model.adapters import (AdapterError, LoraFile, activate_layers, fuse_into_base_, install_adapter,
                            installed_adapters, lora_layers, read_lora_file, remove_adapter, tuner_layers)
from model.weights import TransformerWeights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Fused:
    name: str
    scale: float
    weights: tuple[str, ...]  # base weights written (diffusers names), restored from the checkpoint


class AdapterSet:
    """The configured adapters of one engine's transformer. Not thread-safe: the engine calls it under its lock.

    Invariants (`check`): held bytes <= capacity; every held adapter is installed in the transformer and no other;
    a fused adapter is held and never active as well (its delta would count twice)."""

    def __init__(self, configs: dict[str, AdapterConfig], cache_bytes: int, transformer: nn.Module,
                 weights: TransformerWeights):
        self.configs = dict(configs)
        self.capacity_bytes = cache_bytes
        self._transformer = transformer
        self._weights = weights
        self._held: OrderedDict[str, int] = OrderedDict()  # name -> installed bytes, least recently used first
        self._held_names: tuple[str, ...] = ()  # a copy of `_held`'s names, read by other threads
        self._fused: _Fused | None = None
        self._layers: tuple = ()  # the transformer's peft layers, found again after each install / eviction
        self._active: dict[str, float] | None = None  # what `activate_layers` last set; None: to be set again
        # The modules as named before any adapter: the loader thread checks files against this copy, never
        # walking the transformer while the engine thread installs or deletes peft layers in it.
        self._modules = dict(transformer.named_modules())
        self._loader = AdapterLoader(self._read)
        for name, config in self.configs.items():
            lora = read_lora_file(config.path, transformer)  # AdapterError naming the file: the engine does not start
            if lora.nbytes > cache_bytes:
                raise AdapterError(config.path, f"{lora.nbytes / 1e6:.1f} MB of factors exceed engine."
                                   f"adapters_cache_mb={cache_bytes / 1e6:g}: raise it to hold adapter {name!r}")
            if self.held_bytes + lora.nbytes <= cache_bytes:
                self._install(name, lora)
            logger.info("adapter %s: %s checked (%d modules, alpha %s from %s, %.1f MB)%s", name, config.path,
                        len(lora.ranks), lora.alpha, lora.alpha_source.value, lora.nbytes / 1e6,
                        "" if name in self._held else ", not held (over adapters_cache_mb): read when requested")

    @property
    def held(self) -> tuple[str, ...]:
        """Adapters installed now, least recently used first."""
        return tuple(self._held)

    @property
    def held_or_loading(self) -> tuple[str, ...]:
        """Adapters installed or being read (safe from any thread): what the replica reports to the router."""
        loading = self._loader.loading
        return self._held_names + tuple(n for n in loading if n not in self._held_names)

    def prefetch(self, names: Iterable[str]) -> None:
        """Start reading the configured adapters among `names` that are not held (any thread; never waits)."""
        for name in names:
            if name in self.configs and name not in self._held_names:
                self._loader.prefetch(name)

    def close(self) -> None:
        self._loader.close()

    @property
    def held_bytes(self) -> int:
        return sum(self._held.values())

    @property
    def fused(self) -> str | None:
        return self._fused.name if self._fused is not None else None

    def lora_active(self) -> bool:
        """An unfused adapter is on: its peft layers scale their output by a float the compiled blocks take as an
        input (`engine.compiled`)."""
        return bool(self._active)

    def scales(self, choices: tuple[AdapterChoice, ...]) -> dict[str, float]:
        """Each chosen adapter's scale: the request's, else its configured one."""
        return {c.name: c.scale if c.scale is not None else self.configs[c.name].scale for c in choices}

    @torch.no_grad()
    def apply(self, choices: tuple[AdapterChoice, ...], cancelled: CancelledFn | None = None) -> AdapterStats | None:
        """Set the transformer up for a request running `choices` (names already checked against the config:
        `engine.api.with_adapter_defaults`); None when it runs none. GenerationCancelled when `cancelled()` turns
        true while it waits for an adapter's read."""
        begin = time.perf_counter()
        scales = self.scales(choices)
        loaded = [name for name in scales if name not in self._held]
        for name in scales:
            self._hold(name, keep=set(scales), cancelled=cancelled)
        fuse = next(((n, s) for n, s in scales.items() if self.configs[n].fuse), None)
        if self._fused is not None and (self._fused.name, self._fused.scale) != fuse:
            self._restore_base()
        if fuse is not None and self._fused is None:
            name, scale = fuse
            # Recorded before writing: a fuse that fails half-way still has every weight it may have touched
            # restored by the next request (or `_restore_base`), never served as if it were the base.
            self._fused = _Fused(name, scale, tuple(f"{m}.weight" for m in lora_layers(self._transformer, name)))
            fuse_into_base_(self._transformer, name, scale)
        active = {n: s for n, s in scales.items() if self.fused != n}
        if active != self._active:  # a request like the last one switches nothing
            activate_layers(self._layers, active)
            self._active = active
        if not scales:
            return None
        return AdapterStats(scales=scales, fused=self.fused, loaded=loaded, load_s=time.perf_counter() - begin)

    def weights_updated(self, weights: TransformerWeights) -> None:
        """The engine wrote every base weight from `weights` (a weight update): nothing is fused any more. The
        held adapters stay installed, unchecked: the update's own check (`Engine._checked_weights`, before any
        write) held the new transformer to the served config, tensor names, shapes and dtypes, which is all a
        file's check reads (`read_lora_file`), and the weights were written into the same modules."""
        self._weights = weights
        self._fused = None
        self._active = None

    def check(self) -> None:
        problems = []
        if self.held_bytes > self.capacity_bytes:
            problems.append(f"{self.held_bytes} bytes held over a capacity of {self.capacity_bytes}")
        installed = installed_adapters(self._transformer)
        if installed != set(self._held):
            problems.append(f"installed {sorted(installed)} but held {sorted(self._held)}")
        if self._fused is not None and self._fused.name not in self._held:
            problems.append(f"{self._fused.name} is fused but not held")
        if problems:
            raise RuntimeError("; ".join(problems))

    # --- LRU ------------------------------------------------------------------------------------------

    def _read(self, name: str) -> LoraFile:
        """Adapter `name`'s file read and checked against the transformer (the loader thread: read-only)."""
        return read_lora_file(self.configs[name].path, self._modules)

    def _hold(self, name: str, keep: set[str], cancelled: CancelledFn | None = None) -> None:
        """`name` installed and most recently used; least recently used adapters not in `keep` evicted to fit."""
        if name in self._held:
            self._held.move_to_end(name)
            self._loader.discard(name)  # a read prefetched while it was held (or before it was installed)
            return
        lora = self._loader.take(name, cancelled)
        for victim in [n for n in self._held if n not in keep]:
            if self.held_bytes + lora.nbytes <= self.capacity_bytes:
                break
            self._evict(victim)
        if self.held_bytes + lora.nbytes > self.capacity_bytes:
            raise AdapterError(self.configs[name].path, f"adapters {sorted(keep)} together exceed engine."
                               f"adapters_cache_mb={self.capacity_bytes / 1e6:g}")
        self._install(name, lora)

    def _install(self, name: str, lora: LoraFile) -> None:
        install_adapter(self._transformer, name, lora)
        self._held[name] = sum(p.nbytes for layer in lora_layers(self._transformer, name).values()
                               for factors in (layer.lora_A, layer.lora_B) for p in factors[name].parameters())
        self._held_names = tuple(self._held)
        self._layers, self._active = tuner_layers(self._transformer), None

    def _evict(self, name: str) -> None:
        if self.fused == name:
            self._restore_base()
        remove_adapter(self._transformer, name)
        del self._held[name]
        self._held_names = tuple(self._held)
        self._layers, self._active = tuner_layers(self._transformer), None

    def _restore_base(self) -> None:
        """The fused adapter's base weights read again from the checkpoint: the served model's own bits."""
        assert self._fused is not None
        modules = dict(self._transformer.named_modules())
        for weight_name in self._fused.weights:
            module = modules[weight_name.removesuffix(".weight")]
            base = module.get_base_layer().weight
            base.data.copy_(self._weights.tensor(weight_name, base.device))
        self._fused = None
