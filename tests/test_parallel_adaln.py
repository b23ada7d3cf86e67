"""parallel.adaln: a plan miss is projected 1/N per rank and exchanged, and every rank ends with the rows one rank
computing all of them would have (gloo, 2 spawned CPU processes).

Two ways in, both on the tiny H3 transformer (AdaLN widths 3*6*64 = 1152 per block and 2*64 = 128 final, bf16):
- `sharded_modulation` over a projection callable per unit (each block's and norm_out's own `linear`), on the
  4-block seed-0 model and a 5-block one (blocks do not split evenly: 3 + 2);
- the engine's online path: each rank streams only its units from a real tiny checkpoint through
  `cache.rebuild.AdalnRebuilder` into its rows of a Modulation, then `exchange_modulation_`.
Bit-identical is the promise (every row is computed by one rank with the call one rank would make, then moved),
so every comparison is `torch.equal`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.adaln import Modulation, adaln_input, resident_modulation
from model.layout import H3Checkpoint, Layout
from model.loading import load_transformer
from model.tiny import TINY_TRANSFORMER, make_tiny_checkpoint, tiny_transformer
from model.weights import TransformerWeights, adaln_unit_names
from parallel.adaln import AdalnShard
from parallel.launch import RankExit, launch_local

WORLD_SIZE = 2
TIMEOUT_S = 20.0
TIMESTEPS = {1: [0.0], 2: [0.25, 0.5]}  # forward 0 has one plan row, the later ones two
NUM_BLOCKS = (4, 5)
#: Bytes of one block's adaln_proj.linear (weight [1152, 32] + bias [1152], bf16) and of norm_out.linear
#: ([128, 32] + [128]).
BLOCK_UNIT_BYTES = (1152 * 32 + 1152) * 2
FINAL_UNIT_BYTES = (128 * 32 + 128) * 2
SLAB_ROWS, FIRST_ROW = 4, 1  # the online miss writes its 2 plan rows into rows 1-2 of a 4-row slab


def model_of(num_blocks: int):
    return tiny_transformer(seed=0, config=TINY_TRANSFORMER.model_copy(update={"num_layers": num_blocks}))


def open_weights(root: Path) -> TransformerWeights:
    checkpoint = H3Checkpoint.open(root)
    return TransformerWeights(checkpoint.transformer_dir, checkpoint.layout)


# ------------------------------------------------------------------------------------------- the ranks


def _rank_program(rank: int, world_size: int, init_method: str, out_dir: Path, checkpoint: Path) -> None:
    torch.set_num_threads(1)
    from cache.rebuild import AdalnRebuilder, RebuildTarget, resolve_adaln_units
    from device.streams import FakeDevice
    from model.adaln import H3Adaln
    from model.weights import is_adaln_param
    from parallel.adaln import exchange_modulation_, sharded_modulation
    from parallel.group import init_group

    group = init_group(rank, world_size, init_method, "cpu", timeout_s=TIMEOUT_S)
    report: dict = {}
    with torch.no_grad():
        for num_blocks in NUM_BLOCKS:
            transformer = model_of(num_blocks)
            blocks = transformer.transformer_blocks
            for num_rows, timesteps in TIMESTEPS.items():
                x = adaln_input(transformer, torch.tensor(timesteps))
                projected: list[int | None] = []

                def project(block: int | None) -> torch.Tensor:
                    projected.append(block)
                    linear = blocks[block].adaln_proj.linear if block is not None else transformer.norm_out.linear
                    return linear(x)

                report[(num_blocks, num_rows)] = sharded_modulation(project, H3Adaln(transformer), num_rows, group)
                report[(num_blocks, num_rows, "projected")] = projected

        # The engine's online miss: this rank's units streamed from the checkpoint, then exchanged.
        weights = open_weights(checkpoint)
        online = load_transformer(weights, "cpu", skip=is_adaln_param)  # no AdaLN weights on this rank
        dims = H3Adaln(online)
        shard = AdalnShard.of(dims.num_blocks, rank, world_size)
        units = shard.select(resolve_adaln_units(weights, dims, adaln_unit_names(dims.num_blocks)))
        x = adaln_input(online, torch.tensor(TIMESTEPS[2]))
        # A slab of SLAB_ROWS plan rows, NaN everywhere (a row nobody wrote shows); the plan goes to rows 1-2.
        nan = float("nan")
        slab = Modulation(torch.full((dims.num_blocks, SLAB_ROWS, dims.adaln_width), nan, dtype=dims.torch_dtype),
                          torch.full((SLAB_ROWS, dims.final_adaln_width), nan, dtype=dims.torch_dtype))
        rebuilder = AdalnRebuilder(gpu=FakeDevice())
        rebuilt = rebuilder.rebuild(units, [RebuildTarget(x, FIRST_ROW)], slab.blocks, slab.final)
        rebuilder.close()
        report["online/units"] = [unit.block for unit in units]
        report["online/bytes_read"] = rebuilt.bytes_read
        rows = slice(FIRST_ROW, FIRST_ROW + 2)
        exchange_modulation_(Modulation(slab.blocks[:, rows], slab.final[rows]), shard, group)  # views of the slab
        report["online"] = slab
    torch.save(report, out_dir / f"rank{rank}.pt")
    group.destroy()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("h3") / "tiny", Layout.DIFFUSERS, seed=0, components=False)


@pytest.fixture(scope="module")
def reports(tmp_path_factory, checkpoint) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("adaln")
    exits = launch_local(_rank_program, WORLD_SIZE, out_dir, args=(out_dir, checkpoint), deadline_s=240.0)
    assert exits == [RankExit(0, 0), RankExit(1, 0)]
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


def assert_same_rows(got: Modulation, want: Modulation) -> None:
    assert got.blocks.dtype == want.blocks.dtype == torch.bfloat16
    assert torch.equal(got.blocks, want.blocks) and torch.equal(got.final, want.final)


# ------------------------------------------------------------------------------------------- the split


@pytest.mark.parametrize("num_blocks, world_size, runs", [
    # (blocks of each rank); the last rank has the fewest blocks and also the final layer
    (4, 2, [(0, 2), (2, 4)]),
    (5, 2, [(0, 3), (3, 5)]),
    (50, 4, [(0, 13), (13, 26), (26, 39), (39, 50)]),
    (50, 8, [(0, 7), (7, 14), (14, 21), (21, 28), (28, 35), (35, 42), (42, 49), (49, 50)]),
    (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),
])
def test_blocks_are_dealt_in_contiguous_runs(num_blocks, world_size, runs):
    shards = [AdalnShard.of(num_blocks, rank, world_size) for rank in range(world_size)]
    assert [(s.start, s.stop) for s in shards] == runs
    assert [s.owns_final for s in shards] == [False] * (world_size - 1) + [True]


@pytest.mark.parametrize("num_blocks, world_size", [(4, 2), (5, 2), (50, 4), (50, 8), (7, 3)])
def test_every_unit_is_selected_by_exactly_one_rank(num_blocks, world_size):
    units = adaln_unit_names(num_blocks)
    selected = [u for rank in range(world_size) for u in AdalnShard.of(num_blocks, rank, world_size).select(units)]
    assert sorted(selected, key=str) == sorted(units, key=str) and len(selected) == len(units)


def test_select_picks_this_ranks_checkpoint_tensors():
    assert AdalnShard.of(4, 1, 2).select(adaln_unit_names(4)) == [
        ("transformer_blocks.2.adaln_proj.linear", 2), ("transformer_blocks.3.adaln_proj.linear", 3),
        ("norm_out.linear", None)]


def test_select_refuses_a_list_of_another_model():
    with pytest.raises(ValueError, match="expected 5 units"):
        AdalnShard.of(4, 0, 2).select(adaln_unit_names(5))


# ------------------------------------------------------------------------------------------- the exchange


@pytest.mark.parametrize("num_blocks", NUM_BLOCKS)
@pytest.mark.parametrize("num_rows", list(TIMESTEPS))
def test_sharded_modulation_equals_one_rank_projecting_everything(reports, num_blocks, num_rows):
    transformer = model_of(num_blocks)
    want = resident_modulation(transformer, adaln_input(transformer, torch.tensor(TIMESTEPS[num_rows])))
    for report in reports:
        assert_same_rows(report[(num_blocks, num_rows)], want)


@pytest.mark.parametrize("num_blocks, projected", [
    (4, [[0, 1], [2, 3, None]]),
    (5, [[0, 1, 2], [3, 4, None]]),
])
def test_each_rank_projects_only_its_share(reports, num_blocks, projected):
    for num_rows in TIMESTEPS:
        assert [report[(num_blocks, num_rows, "projected")] for report in reports] == projected


def test_online_miss_reads_each_unit_once_across_the_ranks(reports):
    assert [report["online/units"] for report in reports] == [[0, 1], [2, 3, None]]
    assert [report["online/bytes_read"] for report in reports] == [
        2 * BLOCK_UNIT_BYTES, 2 * BLOCK_UNIT_BYTES + FINAL_UNIT_BYTES]


def test_online_miss_gives_every_rank_the_resident_rows_in_its_slab(reports, checkpoint):
    resident = load_transformer(open_weights(checkpoint), "cpu")
    want = resident_modulation(resident, adaln_input(resident, torch.tensor(TIMESTEPS[2])))
    rows = slice(FIRST_ROW, FIRST_ROW + 2)
    for report in reports:
        slab = report["online"]
        assert_same_rows(Modulation(slab.blocks[:, rows], slab.final[rows]), want)
        others = [0, 3]  # rows of other plans: never touched by this plan's exchange
        assert slab.blocks[:, others].isnan().all() and slab.final[others].isnan().all()
