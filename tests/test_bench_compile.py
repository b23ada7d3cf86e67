"""bench.compile's smoke run on CPU writes the table its GPU run writes: three starts in fresh processes (no
compile, a cold and a warm compile cache), the compiled ones' first-vs-later request and the mixed stream's
recompiles after the warm-up, each start beside the no-compile one."""

from __future__ import annotations

import json

import pytest

from bench import compile as bench_compile

pytestmark = pytest.mark.slow  # three engine starts in subprocesses, two of them tracing the blocks (dynamo)


def test_compile_smoke_writes_every_start_and_the_stream_compiles_nothing_after_the_warm_up(tmp_path):
    assert bench_compile.main(["--smoke", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "compile-smoke-cpu.json").read_text())
    assert report["commit"] and report["command"].startswith("python -m bench.compile --smoke")
    rows = {row["start"]: row for row in report["rows"]}
    assert list(rows) == list(bench_compile.STARTS)
    assert rows["no compile"]["x no-compile start"] == 1 and "frames_compiled" not in rows["no compile"]
    for start in bench_compile.STARTS[1:]:
        row = rows[start]
        assert row["x no-compile start"] == pytest.approx(row["start_s"] / rows["no compile"]["start_s"], rel=0.01)
        assert row["frames_compiled"] >= 2 and row["warmup_s"] > 0  # a fresh process compiles its warm-up
        assert row["stream_requests"] == len(bench_compile.SMOKE_CANVASES) * len(bench_compile.SMOKE_STEPS)
        assert row["stream_recompiles"] == 0
        assert row["x later"] == pytest.approx(row["first_ms"] / row["later_ms"], rel=0.01)
