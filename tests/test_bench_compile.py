"""bench.compile's smoke run on CPU writes the table its GPU run writes: four starts in fresh processes (no compile, a
cold and a warm compile cache, the warm one again with its warm-up beside the loads), the compiled ones'
first-vs-later request and the mixed stream's recompiles after the warm-up, each start beside the no-compile one,
measured and estimated at 50 blocks (the formula recomputed from the row's own fields)."""

from __future__ import annotations

import json

import pytest

from bench import compile as bench_compile
from engine.forward import warmup_forwards

pytestmark = pytest.mark.slow  # four engine starts in subprocesses, three of them tracing the blocks (dynamo)


def test_compile_smoke_writes_every_start_and_the_stream_compiles_nothing_after_the_warm_up(tmp_path):
    assert bench_compile.main(["--smoke", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "compile-smoke-cpu.json").read_text())
    assert report["commit"] and report["command"].startswith("python -m bench.compile --smoke")
    rows = {row["start"]: row for row in report["rows"]}
    assert list(rows) == list(bench_compile.STARTS)
    assert rows["no compile"]["x no-compile start"] == 1 and "frames_compiled" not in rows["no compile"]
    # Every start times its first request against later ones; only the compiled ones run the stream.
    for row in rows.values():
        assert row["x later"] == pytest.approx(row["first_ms"] / row["later_ms"], rel=0.01)
        # The released request's ratio from the row's own fields: the later forwards' ratio, and the first forward's
        # extra spread over 49 forwards at 50 blocks.
        released_ms = 49 * row["later_rest_ms"] * bench_compile.RELEASED_BLOCKS / row["blocks"]
        extra_ms = max(0.0, row["first_forward1_ms"] - row["later_forward1_ms"])
        want = row["first_rest_ms"] / row["later_rest_ms"] + extra_ms / released_ms
        assert row["x later, 50 steps at 50 blocks"] == pytest.approx(want, rel=0.01)
        assert 0 < row["later_rest_ms"] and 0 < row["later_forward1_ms"]
    assert "stream_requests" not in rows["no compile"]
    assert [row["overlap_loads"] for row in rows.values()] == [start == bench_compile.OVERLAP_START
                                                                for start in rows]
    for start in bench_compile.STARTS[1:]:
        row = rows[start]
        assert row["x no-compile start"] == pytest.approx(row["start_s"] / rows["no compile"]["start_s"], rel=0.01)
        assert row["frames_compiled"] == 1 and row["warmup_s"] > 0  # a fresh process compiles its warm-up's graph
        assert 0 < row["dynamo_s"] <= row["frame_s"] + 0.01  # the metrics were read (not a misspelled field: 0)
        assert row["stream_requests"] == len(bench_compile.SMOKE_CANVASES) * len(bench_compile.SMOKE_STEPS)
        assert row["stream_recompiles"] == 0
        assert row["warmup_forwards"] == warmup_forwards(True) == 1  # 4 canvases, one graph: one forward
        assert 0 < row["warmup_forward_s"] <= row["warmup_s"]
    # The 50-block estimate: the load's extra bytes at its seconds per byte, the warm-up's forwards by the blocks;
    # the start beside the loads prices its extra bytes at the serial warm start's rate (its own load was slowed by
    # the warm-up beside it, which is no longer at 50 blocks).
    for row in rows.values():
        scale = bench_compile.RELEASED_BLOCKS / row["blocks"]
        assert 0 < row["block_bytes"] < row["transformer_bytes"]
        rate_row = rows[bench_compile.WARM_START] if row["overlap_loads"] else row
        extra_50 = rate_row["transformer_s"] * (scale - 1) * row["block_bytes"] / row["transformer_bytes"]
        want = row["start_s"] + extra_50 + (scale - 1) * row["warmup_forward_s"]
        assert row["start_s_50"] == pytest.approx(want, abs=1e-3)
        baseline_50 = rows["no compile"]["start_s_50"]
        assert row["x no-compile start, 50 blocks"] == pytest.approx(row["start_s_50"] / baseline_50, rel=0.01)
    assert rows["no compile"]["warmup_forward_s"] == 0
