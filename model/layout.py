"""Where the parts of a MiniMax-H3 checkpoint live, for either published layout.

Two layouts are published (the diffusers-format root and the native per-partition one):

    diffusers root                         native partition (FL2VA/ or Ref2VA/, both under one root)
    ---------------------------------      ----------------------------------------------------------
    model_index.json                       model_index.json        {"_minimax_h3": {partition, tasks,
    modular_model_index.json                                         sigma_shift_scales {video, audio}}}
    transformer/      (FL2VA: t2va, fl2va)  transformer/            native config and tensor names
    transformer_ref/  (Ref2VA: ref2va)
    text_encoder/ tokenizer/ processor/    text_encoder/ tokenizer/ processor/
    vae/ audio_vae/                        video_vae/ (config.json + source/) audio_vae/
    scheduler/ audio_scheduler/            (the shifts are in model_index.json)

`H3Checkpoint.open(path)` accepts a diffusers root, a native partition directory, or a native root holding
partition directories (FL2VA unless another partition is asked for), and resolves every component directory.
Only the layout markers and the transformer directory are checked unless `require_components` is set.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

MODEL_INDEX = "model_index.json"
MODULAR_MODEL_INDEX = "modular_model_index.json"
SCHEDULER_CONFIG = "scheduler_config.json"
NATIVE_BLOCK = "_minimax_h3"
#: The shifts MiniMax-H3 was released with; used where a checkpoint does not restate them.
RELEASED_VIDEO_SHIFT = 12.0
RELEASED_AUDIO_SHIFT = 3.0


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as is; the message names the path (and tensor) and what is wrong."""


class Layout(str, Enum):
    DIFFUSERS = "diffusers"
    NATIVE = "native"


class Partition(str, Enum):
    """A checkpoint partition: one transformer and the tasks it serves."""

    FL2VA = "fl2va"    # text-to-video+audio and first/last-keyframe conditioning
    REF2VA = "ref2va"  # omni-reference conditioning

    @property
    def native_dir_name(self) -> str:
        return {Partition.FL2VA: "FL2VA", Partition.REF2VA: "Ref2VA"}[self]

    @property
    def diffusers_transformer_name(self) -> str:
        return {Partition.FL2VA: "transformer", Partition.REF2VA: "transformer_ref"}[self]

    @property
    def tasks(self) -> tuple[str, ...]:
        return {Partition.FL2VA: ("t2va", "fl2va"), Partition.REF2VA: ("ref2va",)}[self]

    @classmethod
    def parse(cls, value: str, source: str) -> Partition:
        """From a partition name in any casing ("FL2VA", "fl2va", "Ref2VA"...); `source` names where it came from."""
        for partition in cls:
            if value.lower() == partition.value:
                return partition
        raise CheckpointError(f"unknown partition {value!r} in {source}: expected one of "
                              f"{[p.native_dir_name for p in cls]}")


@dataclass(frozen=True)
class H3Checkpoint:
    """A resolved MiniMax-H3 checkpoint: which layout, which partition, and where each component lives."""

    root: Path                  # the directory holding the component directories (a native partition dir)
    layout: Layout
    partition: Partition
    tasks: tuple[str, ...]
    transformer_dir: Path
    text_encoder_dir: Path
    tokenizer_dir: Path
    processor_dir: Path
    video_vae_dir: Path         # diffusers: vae/; native: video_vae/ (weights under its source/)
    audio_vae_dir: Path
    video_shift: float
    audio_shift: float

    @property
    def component_dirs(self) -> dict[str, Path]:
        return {"transformer": self.transformer_dir, "text_encoder": self.text_encoder_dir,
                "tokenizer": self.tokenizer_dir, "processor": self.processor_dir,
                "video_vae": self.video_vae_dir, "audio_vae": self.audio_vae_dir}

    @classmethod
    def open(cls, path: str | os.PathLike, partition: Partition | str | None = None, *,
             require_components: bool = False) -> H3Checkpoint:
        """Detect the layout of `path` and resolve its components.

        `partition` picks FL2VA or Ref2VA where the path holds both (a native root, a diffusers root with
        transformer_ref/); a native partition directory must match it when given. Raises CheckpointError
        naming the path and what is missing.
        """
        path = Path(path)
        wanted = partition if partition is None or isinstance(partition, Partition) \
            else Partition.parse(partition, "the partition argument")
        if not path.is_dir():
            raise CheckpointError(f"checkpoint path {path} is not a directory")
        index = _read_json(path / MODEL_INDEX) if (path / MODEL_INDEX).is_file() else None
        if index is not None and NATIVE_BLOCK in index:
            checkpoint = cls._open_native_partition(path, index, wanted)
        elif index is not None and (path / MODULAR_MODEL_INDEX).is_file():
            checkpoint = cls._open_diffusers_root(path, wanted)
        elif any((path / p.native_dir_name / MODEL_INDEX).is_file() for p in Partition):
            checkpoint = cls._open_native_root(path, wanted)
        else:
            found = f"{MODEL_INDEX} without a {NATIVE_BLOCK!r} block" if index is not None else f"no {MODEL_INDEX}"
            raise CheckpointError(
                f"{path} is not a MiniMax-H3 checkpoint ({found}): expected a diffusers root ({MODEL_INDEX} + "
                f"{MODULAR_MODEL_INDEX}), a native partition ({MODEL_INDEX} with a {NATIVE_BLOCK!r} block) or a "
                f"native root (FL2VA/ or Ref2VA/ holding one)")
        checkpoint._check(require_components)
        return checkpoint

    # --- Layouts ---------------------------------------------------------------------------------------

    @classmethod
    def _open_diffusers_root(cls, root: Path, wanted: Partition | None) -> H3Checkpoint:
        partition = wanted or Partition.FL2VA
        return cls(
            root=root, layout=Layout.DIFFUSERS, partition=partition, tasks=partition.tasks,
            transformer_dir=root / partition.diffusers_transformer_name,
            text_encoder_dir=root / "text_encoder", tokenizer_dir=root / "tokenizer",
            processor_dir=root / "processor", video_vae_dir=root / "vae", audio_vae_dir=root / "audio_vae",
            video_shift=_scheduler_shift(root / "scheduler", RELEASED_VIDEO_SHIFT),
            audio_shift=_scheduler_shift(root / "audio_scheduler", RELEASED_AUDIO_SHIFT),
        )

    @classmethod
    def _open_native_partition(cls, root: Path, index: dict, wanted: Partition | None) -> H3Checkpoint:
        index_path = root / MODEL_INDEX
        block = index[NATIVE_BLOCK]
        if not isinstance(block, dict):
            raise CheckpointError(f"{index_path}: {NATIVE_BLOCK!r} is not an object")
        named = block.get("partition")
        partition = Partition.parse(str(named), str(index_path)) if named is not None \
            else Partition.parse(root.name, f"the directory name of {root}")
        if wanted is not None and wanted != partition:
            raise CheckpointError(f"{root} is the {partition.native_dir_name} partition, "
                                  f"not the {wanted.native_dir_name} one asked for")
        tasks = block.get("tasks", list(partition.tasks))
        if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks):
            raise CheckpointError(f"{index_path}: {NATIVE_BLOCK}.tasks must be a list of task names, got {tasks!r}")
        shifts = block.get("sigma_shift_scales", {})
        if not isinstance(shifts, dict):
            raise CheckpointError(f"{index_path}: {NATIVE_BLOCK}.sigma_shift_scales must be an object, got {shifts!r}")
        return cls(
            root=root, layout=Layout.NATIVE, partition=partition, tasks=tuple(tasks),
            transformer_dir=root / "transformer", text_encoder_dir=root / "text_encoder",
            tokenizer_dir=root / "tokenizer", processor_dir=root / "processor",
            video_vae_dir=root / "video_vae", audio_vae_dir=root / "audio_vae",
            video_shift=_positive(shifts.get("video", RELEASED_VIDEO_SHIFT), f"{index_path} sigma_shift_scales.video"),
            audio_shift=_positive(shifts.get("audio", RELEASED_AUDIO_SHIFT), f"{index_path} sigma_shift_scales.audio"),
        )

    @classmethod
    def _open_native_root(cls, root: Path, wanted: Partition | None) -> H3Checkpoint:
        partition = wanted or Partition.FL2VA
        partition_dir = root / partition.native_dir_name
        present = [p.native_dir_name for p in Partition if (root / p.native_dir_name / MODEL_INDEX).is_file()]
        if partition.native_dir_name not in present:
            raise CheckpointError(f"native root {root} holds the partition(s) {present} but not "
                                  f"{partition.native_dir_name}/{MODEL_INDEX}")
        index = _read_json(partition_dir / MODEL_INDEX)
        if NATIVE_BLOCK not in index:
            raise CheckpointError(f"{partition_dir / MODEL_INDEX} has no {NATIVE_BLOCK!r} block")
        return cls._open_native_partition(partition_dir, index, partition)

    # --- Checks ----------------------------------------------------------------------------------------

    def _check(self, require_components: bool) -> None:
        required = self.component_dirs if require_components else {"transformer": self.transformer_dir}
        missing = [f"{name} ({directory})" for name, directory in required.items() if not directory.is_dir()]
        if missing:
            raise CheckpointError(f"{self.layout.value} checkpoint {self.root} ({self.partition.native_dir_name}) "
                                  f"lacks component directories: {', '.join(missing)}")
        if not (self.transformer_dir / "config.json").is_file():
            raise CheckpointError(f"{self.transformer_dir / 'config.json'} is missing")
        if require_components:
            # An empty one is what a writer that skipped it leaves (transformers' save_pretrained writes nothing
            # on a process of rank > 0 in a torch.distributed group).
            empty = [f"{name} ({directory})" for name, directory in required.items() if not any(directory.iterdir())]
            if empty:
                raise CheckpointError(f"{self.layout.value} checkpoint {self.root} has empty component directories: "
                                      f"{', '.join(empty)}")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return value


def _positive(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise CheckpointError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def _scheduler_shift(scheduler_dir: Path, released: float) -> float:
    """The `shift` of a saved MiniMaxH3Scheduler, or the released value where the checkpoint has no config."""
    config_path = scheduler_dir / SCHEDULER_CONFIG
    if not config_path.is_file():
        return released
    return _positive(_read_json(config_path).get("shift", released), f"{config_path} shift")
