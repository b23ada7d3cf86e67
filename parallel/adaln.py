"""Rank-sharded AdaLN plan rebuild: each rank projects 1/N of the blocks, then every rank holds all the rows.

A plan miss on one GPU streams every block's `adaln_proj.linear` from the checkpoint and projects the step's
timestep rows through it (cache/rebuild.py). With N ranks in a replica, each rank streams and projects only its
`AdalnShard` of the units (a contiguous run of blocks; the last rank, which has the fewest blocks, also the
final layer's `norm_out.linear`), and `exchange_modulation_` all-gathers the block rows and broadcasts the final
rows, so every rank ends with the full `model.adaln.Modulation`. Every row is produced by exactly one rank with
the same projection call a single rank would make and then only moved, so the result is bit-identical to one
rank computing all of it.

    shard = AdalnShard.of(dims.num_blocks, group.rank, group.world_size)
    units = shard.select(resolve_adaln_units(...))        # this rank's checkpoint tensors only
    ...fill modulation.blocks[shard.blocks] / modulation.final (if shard.owns_final)...
    exchange_modulation_(modulation, shard, group)

or, for a projection callable per unit, `sharded_modulation(project, dims, num_rows, group)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from model.adaln import AdalnDims, Modulation
from parallel.group import SpGroup

Unit = TypeVar("Unit")

#: A unit's projection: block index (None: the final layer) -> its rows for this step, [M, width].
UnitProjection = Callable[[int | None], Tensor]


@dataclass(frozen=True)
class AdalnShard:
    """The AdaLN units one rank projects: blocks [start, stop) and, on the last rank, the final layer.

    Blocks are dealt in contiguous runs of ceil(num_blocks / N) (a rank reads a contiguous part of the
    checkpoint); the last rank gets the remainder, which is the smallest run, and the final layer."""

    num_blocks: int
    rank: int
    world_size: int

    @classmethod
    def of(cls, num_blocks: int, rank: int, world_size: int) -> AdalnShard:
        if num_blocks < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"AdalnShard needs num_blocks >= 1 and 0 <= rank < world_size, got "
                             f"num_blocks={num_blocks}, rank={rank}, world_size={world_size}")
        return cls(num_blocks, rank, world_size)

    @property
    def blocks_per_rank(self) -> int:
        return math.ceil(self.num_blocks / self.world_size)

    @property
    def start(self) -> int:
        return min(self.rank * self.blocks_per_rank, self.num_blocks)

    @property
    def stop(self) -> int:
        return min(self.start + self.blocks_per_rank, self.num_blocks)

    @property
    def blocks(self) -> range:
        return range(self.start, self.stop)

    @property
    def final_owner(self) -> int:
        return self.world_size - 1

    @property
    def owns_final(self) -> bool:
        return self.rank == self.final_owner

    def select(self, units: Sequence[Unit]) -> list[Unit]:
        """This rank's entries of a per-unit list in streaming order (every block, then the final layer:
        `model.weights.adaln_unit_names`, `cache.rebuild.resolve_adaln_units`)."""
        if len(units) != self.num_blocks + 1:
            raise ValueError(f"expected {self.num_blocks + 1} units (blocks, then the final layer), got {len(units)}")
        return list(units[self.start: self.stop]) + ([units[-1]] if self.owns_final else [])


def exchange_modulation_(modulation: Modulation, shard: AdalnShard, group: SpGroup) -> None:
    """In place: from each rank's own rows (`blocks[shard.blocks]`, and `final` on the final layer's owner) to
    all rows on every rank. `modulation` may be views of one plan's rows in a larger slab
    (`blocks[:, first_row:first_row + M]`, `final[first_row:first_row + M]`); other rows are not touched.
    A collective: every rank of `group` calls it with same-shaped tensors on its device."""
    blocks = modulation.blocks  # [num_blocks, M, adaln_width]
    if blocks.shape[0] != shard.num_blocks or shard.world_size != group.world_size or shard.rank != group.rank:
        raise ValueError(f"modulation of {blocks.shape[0]} blocks / {shard} does not match this group "
                         f"(rank {group.rank} of {group.world_size})")
    per_rank = shard.blocks_per_rank
    send = blocks.new_zeros((per_rank, *blocks.shape[1:]))  # the last rank's run may be short: zero-padded
    send[: len(shard.blocks)] = blocks[shard.start: shard.stop]
    received = blocks.new_empty((group.world_size * per_rank, *blocks.shape[1:]))
    group.all_gather(received, send)
    blocks.copy_(received[: shard.num_blocks])  # rank r's run landed at r * per_rank == its start
    group.broadcast(modulation.final, src=shard.final_owner, host_wait=True)


def sharded_modulation(project: UnitProjection, dims: AdalnDims, num_rows: int, group: SpGroup) -> Modulation:
    """The full Modulation of one step's `num_rows` timesteps on every rank, each rank calling `project` only
    for its `AdalnShard` (bit-identical to calling it for every unit on one rank)."""
    shard = AdalnShard.of(dims.num_blocks, group.rank, group.world_size)
    modulation = Modulation(
        blocks=torch.empty((dims.num_blocks, num_rows, dims.adaln_width), dtype=dims.torch_dtype, device=group.device),
        final=torch.empty((num_rows, dims.final_adaln_width), dtype=dims.torch_dtype, device=group.device),
    )
    for block in shard.blocks:
        modulation.blocks[block] = _checked(project(block), modulation.blocks[block], f"block {block}")
    if shard.owns_final:
        modulation.final.copy_(_checked(project(None), modulation.final, "the final layer"))
    exchange_modulation_(modulation, shard, group)
    return modulation


def _checked(rows: Tensor, slot: Tensor, unit: str) -> Tensor:
    if rows.shape != slot.shape or rows.dtype != slot.dtype:
        raise ValueError(f"the projection of {unit} returned {rows.dtype} {list(rows.shape)}, expected "
                         f"{slot.dtype} {list(slot.shape)}")
    return rows
