"""parallel.late_flag: rank 0's flag at each step boundary, agreed one boundary late, identical on every rank
(2 spawned CPU processes, gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallel.launch import RankExit, launch_local

WORLD_SIZE = 2
TIMEOUT_S = 20.0
BOUNDARIES = 8
#: Boundaries at which each rank's caller asks to stop: rank 0's (the source) decides; rank 1's is ignored.
ASKS = {0: {3}, 1: {1}}


def _rank_program(rank: int, world_size: int, init_method: str, out_dir: Path) -> None:
    from parallel.group import init_group
    from parallel.late_flag import LateFlag

    group = init_group(rank, world_size, init_method, "cpu", timeout_s=TIMEOUT_S)
    report: dict = {"never_exchanged": LateFlag(group).finish()}
    late = LateFlag(group)
    report["agreed"] = [late.exchange(i in ASKS[rank]) for i in range(BOUNDARIES)]
    report["finish"] = late.finish()

    # A loop as the engine runs it: stop at the first boundary the agreed flag says so, then finish.
    late = LateFlag(group)
    stopped_at = None
    for i in range(BOUNDARIES):
        if late.exchange(i in ASKS[rank]):
            stopped_at = i
            late.finish()
            break
    report["stopped_at"] = stopped_at

    # Asked at the last boundary: seen by `finish`, after the loop.
    late = LateFlag(group)
    report["asked_last"] = ([late.exchange(rank == 0 and i == BOUNDARIES - 1) for i in range(BOUNDARIES)],
                            late.finish())
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    group.destroy()


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("late_flag")
    exits = launch_local(_rank_program, WORLD_SIZE, out_dir, args=(out_dir,), deadline_s=120.0)
    assert exits == [RankExit(0, 0), RankExit(1, 0)]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


def test_every_rank_gets_rank_0s_flag_one_boundary_late(reports):
    # rank 0 asked at boundary 3: every rank sees it at boundary 4; rank 1's ask at 1 is not the source's
    want = [i == 4 for i in range(BOUNDARIES)]
    assert [report["agreed"] for report in reports] == [want, want]
    assert [report["finish"] for report in reports] == [False, False]


def test_every_rank_stops_at_the_same_boundary(reports):
    assert [report["stopped_at"] for report in reports] == [4, 4]


def test_an_ask_at_the_last_boundary_is_seen_by_finish(reports):
    for report in reports:
        assert report["asked_last"] == [[False] * BOUNDARIES, True]
        assert report["never_exchanged"] is False
