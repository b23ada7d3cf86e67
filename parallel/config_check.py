"""The app builder's check of a parallel config, before any process starts (plain Python).

A sequence-parallel degree must divide the served transformer's attention heads and fit one node's GPUs; with
`text_encoder_tp` it must also split the text encoder (heads, kv heads, MLP width). Both sizes are read from the
checkpoint's config.json files alone (`model.provisioning`), so a bad degree is refused at build time, naming the
valid ones, instead of in every rank's constructor.
"""

from __future__ import annotations

from typing import Protocol

from model.provisioning import CheckpointSettings, checkpoint_num_heads, text_encoder_shape
from parallel.sequence import check_degree
from parallel.text_encoder import check_text_degree


class ParallelDegrees(Protocol):
    """The fields of `engine.config.ParallelConfig` this check reads."""

    @property
    def sp(self) -> int: ...

    @property
    def text_encoder_tp(self) -> bool: ...


class ParallelServing(CheckpointSettings, Protocol):
    """A served config: its checkpoint and its parallel degrees (`engine.config.EngineConfig`)."""

    @property
    def parallel(self) -> ParallelDegrees: ...


def check_parallel_config(config: ParallelServing, num_gpus_on_node: int) -> None:
    """Refuse a parallel config before anything starts (the app builder calls it): a degree that does not
    divide the checkpoint's attention heads (`parallel.sequence.SequenceParallelError`, a ValueError naming the
    valid degrees), more GPUs than one node has, or, with `text_encoder_tp`, a degree the text encoder cannot
    be split by (`parallel.text_encoder.TextEncoderSplitError`). `num_gpus_on_node`: GPUs of the largest node;
    0 when the ranks run on CPU (gloo), where any number of rank processes share the node's cores."""
    check_degree(config.parallel.sp, checkpoint_num_heads(config), num_gpus_on_node or None)
    if config.parallel.sp > 1 and config.parallel.text_encoder_tp:
        check_text_degree(config.parallel.sp, *text_encoder_shape(config))
