"""bench.h3_modes --smoke: every forward mode end to end on the CPU, the Turbo request beside the 50-step one.

Asserted on the JSON (not the markdown): every requested mode has a 50-step denoise row with a positive time and
an end-to-end row per request; Turbo rows ran 8 forwards through the adapter; every scaled number says what it
was scaled from; the compiled modes report their warm-up apart and compile nothing after it on the 50-step run.
"""

from __future__ import annotations

import json

import pytest

from bench import h3_modes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_h3_modes_smoke_times_every_mode_and_the_turbo_request(tmp_path):
    assert h3_modes.main(["--smoke", "--out", str(tmp_path), "--workdir", str(tmp_path / "w")]) == 0
    report = json.loads((tmp_path / "h3-modes-smoke-cpu.json").read_text())
    assert report["skipped"] == []
    assert report["meta"]["command"].startswith("python -m bench.h3_modes --smoke") and report["meta"]["commit"]
    blocks = report["meta"]["num_blocks"]

    modes = {row["mode"]: row for row in report["modes"]}
    assert list(modes) == list(h3_modes.MODES)
    for mode, row in modes.items():
        assert row["ms_per_forward"] > 0 and row["forwards_timed"] == 3, mode
        assert row["attention"] == "native", mode  # engine.attention auto on a CPU: diffusers' default, unmeasured
        assert row["scaled_from"] == {"blocks": blocks, "to_blocks": 50, "forwards_timed": 3}
        # Only the blocks' share scales: more than the forward measured, less than all of it x 50 / blocks.
        assert row["ms_per_forward"] < row["ms_at_50_blocks"] < row["ms_per_forward"] * 50 / blocks, mode
        compiled = "compiled" in mode
        assert (row["compile_warmup_s"] is not None and row["compile_warmup_s"] > 0) == compiled, mode
        assert row["recompiles_after_warmup"] == (0 if compiled else None), mode
        assert (row["quantized_linears"] > 0) == ("fp8" in mode), mode

    turbo = {row["mode"]: row for row in report["turbo"]}
    assert list(turbo) == list(h3_modes.MODES)
    for mode, row in turbo.items():
        assert (row["steps"], row["forwards"]) == (9, 8), mode
        assert row["adapter"].startswith("turbo x1") and row["denoise_s"] > 0
        # denoise_s to 3 decimals, the estimate to 2: compared at the estimate's precision.
        assert round(row["denoise_s"], 2) <= row["denoise_at_50_blocks_s"] < row["denoise_s"] * 50 / blocks, mode
        assert row["scaled_from"] == {"blocks": blocks, "to_blocks": 50, "forwards": 8}
        # A compiled engine warmed the canvas with the adapter on: neither request compiles.
        assert row["compiles_in_first"] == (0 if "compiled" in mode else None), mode
        assert row["recompiles_in_second"] == (0 if "compiled" in mode else None), mode

    stages = [row["stage"] for row in report["shared_stages"]]
    assert [s.split(" (")[0] for s in stages] == ["prompt encode", "plan miss", "video + audio decode", "MP4 mux"]
    assert all(row["scaled_from"] for row in report["shared_stages"])

    e2e = report["end_to_end"]
    assert len(e2e) == 2 * len(h3_modes.MODES)
    for row in e2e:
        parts = row["denoise_s"] + row["plan_s"] + row["prompt encode_s"] + row["decode_s"] + row["mux_s"]
        assert row["total_s"] == pytest.approx(parts, abs=0.2)
        turbo_row = row["request"].startswith("Turbo")
        assert row["scaled_from"]["forwards"] == (8 if turbo_row else 49)
        assert row["scaled_from"]["to_blocks"] == 50 and row["scaled_from"]["blocks"] == blocks
    markdown = (tmp_path / "h3-modes-smoke-cpu.md").read_text()
    assert "## Not measured" not in markdown and "## End to end, scaled to 50 blocks" in markdown


def test_unknown_mode_is_refused_naming_the_flag():
    with pytest.raises(SystemExit, match="--modes: unknown"):
        h3_modes.parse_modes("eager,int4")
