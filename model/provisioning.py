"""Which checkpoint a server loads, and what it can tell before loading it (plain Python over `model/`).

`ensure_checkpoint(settings)` is the configured `checkpoint`, or a seeded tiny random MiniMax-H3 made on first
start under `checkpoint_root` (`model.tiny.make_tiny_checkpoint`) and reused afterwards. `checkpoint_num_heads` and
`text_encoder_shape` read the served (`served_partition`) transformer's and text encoder's sizes from their
config.json alone (no
weights), which the app builder needs to check a parallel degree before any process starts; an auto-made checkpoint
answers with the tiny model's constants without being made. `ensure_adapter(settings, name)` is the seeded tiny
random LoRA adapter an empty `engine.adapters.<name>.path` stands for, made beside the auto-made checkpoint.

`settings` is anything with the checkpoint fields of `engine.config.EngineConfig` (`CheckpointSettings`): `model/`
imports nothing above it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Literal, Protocol

from model.layout import H3Checkpoint, Partition
from model.text_encoder import language_model_config
from model.tiny import TINY_TRANSFORMER, make_tiny_checkpoint
from model.tiny_components import TINY_TEXT_HEADS, TINY_TEXT_KV_HEADS, TINY_TEXT_MLP
from model.weights import CONFIG_FILE, H3TransformerConfig

logger = logging.getLogger(__name__)



class CheckpointSettings(Protocol):
    """The checkpoint fields of `engine.config.EngineConfig` (see its field descriptions)."""

    @property
    def checkpoint(self) -> str: ...  # empty: auto-made

    @property
    def checkpoint_root(self) -> str: ...

    @property
    def preset(self) -> Literal["tiny"]: ...

    @property
    def checkpoint_layout(self) -> Literal["diffusers", "native"]: ...

    @property
    def checkpoint_seed(self) -> int: ...

    @property
    def partition(self) -> Literal["fl2va", "ref2va"]: ...


def served_partition(settings: CheckpointSettings) -> Partition:
    """The partition `settings` serves: FL2VA (t2va, fl2va) or Ref2VA (ref2va). Named, never guessed: the two
    transformers have the same shapes, so the wrong one would load silently."""
    return Partition(settings.partition)


def auto_checkpoint_dir(settings: CheckpointSettings) -> Path:
    """Where the auto-made checkpoint of `settings` lives: `{root}/{preset}-{layout}[-seed{n}][-ref2va]`. One
    serving ref2va holds both partitions (as released); its FL2VA transformer has the same bytes as the
    FL2VA-only one's."""
    name = f"{settings.preset}-{settings.checkpoint_layout}"
    if settings.checkpoint_seed:
        name += f"-seed{settings.checkpoint_seed}"
    if served_partition(settings) is Partition.REF2VA:
        name += "-ref2va"
    return Path(settings.checkpoint_root) / name


def _is_made(target: Path) -> bool:
    return (target / "model_index.json").exists() or (target / "FL2VA").is_dir()


def ensure_checkpoint(settings: CheckpointSettings) -> Path:
    """The checkpoint to load: `settings.checkpoint`, or an auto-made seeded tiny checkpoint.

    Auto-made ones are written to a temporary directory next to the target and renamed into place
    (`model.tiny.make_tiny_checkpoint`), so a reader never sees a half-written checkpoint and two replicas
    starting together both end up with the one that won the rename (same seed -> identical bytes anyway).
    """
    if settings.checkpoint:
        return Path(settings.checkpoint)
    target = auto_checkpoint_dir(settings)
    if _is_made(target):
        return target
    logger.info("making a tiny %s-layout MiniMax-H3 checkpoint (seed %d) at %s", settings.checkpoint_layout,
                settings.checkpoint_seed, target)
    try:
        make_tiny_checkpoint(target, settings.checkpoint_layout, seed=settings.checkpoint_seed,
                             ref2va=served_partition(settings) is Partition.REF2VA)
    except (FileExistsError, OSError):
        if not _is_made(target):
            raise  # not a lost race: a real error
        logger.info("another process made %s first; using it", target)
    return target


def auto_adapter_path(settings: CheckpointSettings, name: str) -> Path:
    """Where the auto-made adapter `name` of `settings` lives: `{root}/adapters/{preset}-{name}.safetensors` (its
    shapes are the preset's whatever the checkpoint's seed, layout or partition)."""
    return Path(settings.checkpoint_root) / "adapters" / f"{settings.preset}-{name}.safetensors"


def adapter_seed(name: str) -> int:
    """The seed of the auto-made adapter `name`: from its name alone (sha256, not `hash`, which varies per
    process), so every replica and every restart makes the same bytes and two names differ."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")


def ensure_adapter(settings: CheckpointSettings, name: str) -> Path:
    """The seeded tiny random LoRA adapter (rank 4 on the H3 Turbo targets, alpha 8: `model.tiny_adapter`) that
    an empty `engine.adapters.<name>.path` stands for, made on first start under `checkpoint_root` and reused.

    Only beside an auto-made checkpoint: a random adapter of the tiny transformer fits no real one, so with
    `settings.checkpoint` set this is a ValueError naming the setting. Written to a temporary file next to the
    target and renamed into place, as `ensure_checkpoint` does (same name -> identical bytes, so a lost race
    replaces the file with itself)."""
    if settings.checkpoint:
        raise ValueError(f"engine.adapters.{name}.path is empty: an auto-made adapter serves only an auto-made "
                         f"checkpoint (engine.checkpoint empty), not {settings.checkpoint}; name the adapter's "
                         ".safetensors file")
    target = auto_adapter_path(settings, name)
    if target.exists():
        return target
    # peft is imported only by a process that makes one (the app builder reads this module too).
    from model.tiny_adapter import save_adapter, tiny_lora_factors

    logger.info("making a tiny random LoRA adapter %r (seed %d) at %s", name, adapter_seed(name), target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        save_adapter(tmp, tiny_lora_factors(adapter_seed(name)))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def checkpoint_num_heads(settings: CheckpointSettings) -> int:
    """Attention heads of the transformer `settings` serves, from its config.json alone (no weights are read);
    an auto-made checkpoint has its preset's."""
    if not settings.checkpoint:
        return TINY_TRANSFORMER.num_attention_heads
    checkpoint = H3Checkpoint.open(settings.checkpoint, served_partition(settings))
    path = checkpoint.transformer_dir / CONFIG_FILE
    return H3TransformerConfig.from_json(path.read_bytes(), checkpoint.layout, path).num_attention_heads


def text_encoder_shape(settings: CheckpointSettings) -> tuple[int, int, int]:
    """(attention heads, kv heads, MLP width) of the text encoder `settings` serves, from its config.json alone;
    an auto-made checkpoint has the tiny components'."""
    if not settings.checkpoint:
        return TINY_TEXT_HEADS, TINY_TEXT_KV_HEADS, TINY_TEXT_MLP
    text = language_model_config(H3Checkpoint.open(settings.checkpoint, served_partition(settings)).text_encoder_dir)
    return text.num_attention_heads, text.num_key_value_heads, text.intermediate_size
