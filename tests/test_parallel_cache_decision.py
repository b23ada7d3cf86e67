"""parallel.cache_decision: cache-dit's DBCache decides compute-or-skip identically on every rank (gloo, 2 spawned
CPU processes), through the real cache-dit context manager the model's cached blocks call.

Two programs per rank:
- fake Fn residuals at the hook point (`CachedContextManager.can_cache` -> `similarity`) whose per-rank relative
  L1 changes straddle the threshold (rank 0 alone would cache, rank 1 alone would compute), with a garbage pad
  row on rank 1 that must not count;
- a whole sequence-parallel denoising loop of the tiny transformer with DBCache on, against the same loop in
  one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor

pytest.importorskip("cache_dit")

from cache.cache_dit import CacheDit, CacheDitConfig  # noqa: E402
from model.denoise import denoise  # noqa: E402
from model.geometry import GeometryLimits, VideoGeometry  # noqa: E402
from model.schedule import H3Schedule  # noqa: E402
from model.tiny import tiny_transformer  # noqa: E402
from parallel.cache_decision import local_l1_sums  # noqa: E402
from parallel.launch import RankExit, launch_local  # noqa: E402

WORLD_SIZE = 2
TIMEOUT_S = 20.0
THRESHOLD = 0.08
CHANNELS = 8

# --- the fake residuals: [1, rows, 8], prev and curr, rank by rank ---------------------------------------
# rank 0: |prev| = 1, curr = prev * (1 - 1/32): Σ|prev - curr| = 32/32 = 1, Σ|prev| = 32 -> alone 0.03125 (cache)
# rank 1: |prev| = s, curr = prev * (1 - 1/8), 4 real rows + 1 pad row of garbage: alone 0.125 (compute)
#   s = 2: global (1 + 8) / (32 + 64) = 0.09375 >= 0.08 -> every rank computes
#   s = 1: global (1 + 4) / (32 + 32) = 0.078125 < 0.08 -> every rank caches
# (exact in fp32 and fp64: every value is a dyadic fraction)
REAL_ROWS = {0: 4, 1: 4}
SCALES = (2.0, 1.0)
GLOBAL_DIFFS = [0.09375, 0.078125]


# --- cache-dit's "important condition" variant: only rows whose own relative change exceeds 0.2 count ---------
# rank 0: 3 rows of ones changed by 0, 1/2, 1/8 -> row 1 selected: Σ|change| 4 over Σ|prev| 8
# rank 1: 2 rows of ones changed by 3/4, 0        -> row 0 selected: 6 over 8
# global over the selected rows: (4 + 6) / (8 + 8) = 0.625; with no row above 0.2 anywhere, the plain diff.
CONDITION = 0.2
CONDITION_CHANGES = {0: (0.0, 0.5, 0.125), 1: (0.75, 0.0)}
CONDITION_GLOBAL = 0.625
UNSELECTED_GLOBAL = 0.125  # every row of both ranks changed by 1/8


def changed_rows(changes: tuple[float, ...]) -> tuple[Tensor, Tensor]:
    prev = torch.ones(1, len(changes), CHANNELS)
    return prev, prev * (1 - torch.tensor(changes))[None, :, None]


def fake_residuals(rank: int, scale: float) -> tuple[Tensor, Tensor]:
    if rank == 0:
        prev = torch.ones(1, 4, CHANNELS)
        return prev.bfloat16(), (prev * (1 - 1 / 32)).bfloat16()
    prev = torch.full((1, 5, CHANNELS), scale)
    curr = prev * (1 - 1 / 8)
    prev[:, 4], curr[:, 4] = 1000.0, -1000.0  # the pad row: its "change" would dominate if it counted
    return prev.bfloat16(), curr.bfloat16()


# --- the denoising loop ----------------------------------------------------------------------------------
# DBCache Fn=1, Bn=1, 1 warmup step, at most 2 cached steps in a row, threshold 0.15, on 8 forwards of a
# 31-row request (1 pad row on rank 1). One process: relative changes 0.049, 0.100, (step 3 forced: two cached
# in a row), 0.085, 0.187, 0.139, 0.346 -> cached steps 1, 2, 4, 6; the residual is checked on 6 steps.
DBCACHE = CacheDitConfig(enabled=True, Fn_compute_blocks=1, Bn_compute_blocks=1, max_warmup_steps=1,
                         residual_diff_threshold=0.15, max_continuous_cached_steps=2)
CACHED_STEPS = [1, 2, 4, 6]
NUM_CHECKS = 6
NUM_STEPS = 9
SEED = 7
NUM_TEXT_TOKENS = 7
#: bf16 means and quotient (cache-dit, one process) vs fp32 sums and an fp64 quotient (here): 3 bf16 roundings of
#: relative error <= 2^-9 each.
DIFF_RTOL = 3 * 2**-9


def geometry() -> VideoGeometry:
    return VideoGeometry.from_frames(64, 64, 5, limits=GeometryLimits(short_edge=None, min_seconds=0.0))


def text_embeds() -> Tensor:
    return torch.randn(NUM_TEXT_TOKENS, 32, generator=torch.Generator().manual_seed(NUM_TEXT_TOKENS)).bfloat16()


@dataclass
class LoopResult:
    cached_steps: list[int]
    residual_diffs: dict[str, float]
    latents: tuple[Tensor, Tensor]


def run_loop(transformer, cache: CacheDit) -> LoopResult:
    schedule = H3Schedule.build(NUM_STEPS)
    cache.refresh(schedule.num_forwards)
    latents = denoise(transformer, text_embeds(), geometry(), schedule, SEED)
    stats = cache.stats()
    return LoopResult(stats.cached_steps, stats.residual_diffs, latents)


# ------------------------------------------------------------------------------------------- the ranks


def _rank_program(rank: int, world_size: int, init_method: str, out_dir: Path) -> None:
    torch.set_num_threads(1)
    from parallel.cache_decision import global_relative_l1, install_rank_consistent_similarity
    from parallel.group import init_group
    from parallel.sequence import SequenceParallel

    group = init_group(rank, world_size, init_method, "cpu", timeout_s=TIMEOUT_S)
    report: dict = {}

    # Fake residuals through the real context manager: can_cache -> similarity.
    config = CacheDitConfig(enabled=True, Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=0,
                            residual_diff_threshold=THRESHOLD)
    transformer = tiny_transformer(0)
    cache = CacheDit(transformer, config)
    cache.refresh(10)
    manager = transformer._context_manager
    similarity = install_rank_consistent_similarity(manager, group, lambda: REAL_ROWS[rank])
    manager.set_context(transformer._context_names[0])  # cache-dit's cached blocks do this in each forward
    decisions = []
    for scale in SCALES:
        prev, curr = fake_residuals(rank, scale)
        manager.mark_step_begin()
        manager.set_Fn_buffer(prev, prefix="Fn")
        decisions.append(manager.can_cache(curr, parallelized=True, prefix="Fn"))
    report["decisions"] = decisions
    report["recorded"] = list(manager.get_residual_diffs().values())
    report["checks"] = similarity.num_checks
    with pytest.raises(RuntimeError, match="already installed"):
        install_rank_consistent_similarity(manager, group)
    changes = CONDITION_CHANGES[rank]
    report["condition"] = global_relative_l1(*changed_rows(changes), group, None, CONDITION)
    report["unselected"] = global_relative_l1(*changed_rows((0.125,) * len(changes)), group, None, CONDITION)

    # The whole loop: sequence parallel + DBCache + the rank-consistent decision.
    transformer = tiny_transformer(0)
    sp = SequenceParallel.install(transformer, group)
    cache = CacheDit(transformer, DBCACHE)
    similarity = install_rank_consistent_similarity(transformer._context_manager, group,
                                                    lambda: sp.num_local_real_rows)
    with torch.no_grad():
        report["loop"] = run_loop(transformer, cache)
    report["loop_checks"] = similarity.num_checks
    torch.save(report, out_dir / f"rank{rank}.pt")
    group.destroy()


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("cache_decision")
    exits = launch_local(_rank_program, WORLD_SIZE, out_dir, args=(out_dir,), deadline_s=240.0)
    assert exits == [RankExit(0, 0), RankExit(1, 0)]
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def one_process() -> LoopResult:
    transformer = tiny_transformer(0)
    cache = CacheDit(transformer, DBCACHE)
    with torch.no_grad():
        return run_loop(transformer, cache)


# ------------------------------------------------------------------------------------------- tests


def test_the_fake_residuals_straddle_the_threshold_rank_by_rank():
    alone = []
    for rank in range(WORLD_SIZE):
        sums = local_l1_sums(*fake_residuals(rank, SCALES[0]), REAL_ROWS[rank]).tolist()
        alone.append(sums[1] / sums[2])
    assert alone == [0.03125, 0.125]  # rank 0 alone would cache, rank 1 alone would compute
    assert alone[0] < THRESHOLD <= alone[1]


def test_every_rank_takes_the_decision_of_the_whole_sequence(reports):
    # s = 2: global 0.09375 -> compute; s = 1: global 0.078125 -> cache; on both ranks
    assert [report["decisions"] for report in reports] == [[False, True], [False, True]]


def test_every_rank_records_the_same_global_diff(reports):
    assert [report["recorded"] for report in reports] == [GLOBAL_DIFFS, GLOBAL_DIFFS]
    assert [report["checks"] for report in reports] == [2, 2]


def test_pad_rows_are_left_out_of_the_diff():
    prev, curr = fake_residuals(1, SCALES[0])
    with_pad = local_l1_sums(prev, curr, num_real_rows=None).tolist()
    without = local_l1_sums(prev, curr, num_real_rows=4).tolist()
    assert without[1:3] == [8.0, 64.0]
    assert with_pad[1:3] == [8.0 + 2000.0 * CHANNELS, 64.0 + 1000.0 * CHANNELS]


def test_mismatched_shapes_are_a_flag_not_a_diff():
    assert local_l1_sums(torch.ones(1, 4, 8), torch.ones(1, 5, 8), 4).tolist() == [1.0, 0, 0, 0, 0, 0]


def test_condition_sums_count_only_the_selected_rows():
    # rows changed by 0, 1/2, 1/8: only row 1 (1/2 > 0.2) is selected
    assert local_l1_sums(*changed_rows(CONDITION_CHANGES[0]), None, CONDITION).tolist() == \
        [0.0, 5.0, 24.0, 4.0, 8.0, CHANNELS]


def test_condition_variant_is_decided_over_every_ranks_selected_rows(reports):
    assert [report["condition"] for report in reports] == [CONDITION_GLOBAL, CONDITION_GLOBAL]


def test_condition_variant_without_selected_rows_falls_back_to_the_plain_diff(reports):
    assert [report["unselected"] for report in reports] == [UNSELECTED_GLOBAL, UNSELECTED_GLOBAL]


def test_one_process_loop_caches_the_documented_steps(one_process):
    assert one_process.cached_steps == CACHED_STEPS


def test_sp2_loop_caches_the_same_steps_on_every_rank(reports):
    assert [report["loop"].cached_steps for report in reports] == [CACHED_STEPS, CACHED_STEPS]
    assert [report["loop_checks"] for report in reports] == [NUM_CHECKS, NUM_CHECKS]


def test_sp2_loop_ranks_record_identical_diffs(reports):
    assert reports[0]["loop"].residual_diffs == reports[1]["loop"].residual_diffs


def test_sp2_loop_diffs_match_one_process_within_bf16_rounding(reports, one_process):
    got = reports[0]["loop"].residual_diffs
    assert got.keys() == one_process.residual_diffs.keys()
    for step, want in one_process.residual_diffs.items():
        assert got[step] == pytest.approx(want, rel=DIFF_RTOL), step


def test_sp2_loop_latents_equal_the_one_process_loop(reports, one_process):
    for report in reports:
        for got, want in zip(report["loop"].latents, one_process.latents, strict=True):
            assert torch.equal(got, want)
