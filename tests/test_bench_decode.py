"""bench.decode --smoke: the decode stage serial against overlapped on the tiny VAEs (CPU), each beside the
overlap's floor, the longer of the serial halves; the two give the same MP4 (the bench checks and would fail)."""

from __future__ import annotations

import json

import pytest

from bench import decode


@pytest.mark.slow  # a tiny checkpoint written, its VAEs decoding twice per variant
def test_decode_smoke_times_the_serial_and_the_overlapped_stage_beside_the_overlaps_floor(tmp_path):
    assert decode.main(["--smoke", "--size", "128x64", "--seconds", "2", "--repeats", "1",
                        "--workdir", str(tmp_path / "w"), "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode-smoke-cpu.json").read_text())
    assert report["command"].startswith("python -m bench.decode --smoke") and report["commit"]
    serial, overlapped = report["rows"]
    assert serial["what"].startswith("serial") and overlapped["what"].startswith("overlapped")
    assert serial["floor s"] == overlapped["floor s"] == round(max(serial["decode_s"], serial["mux_s"]), 3)
    assert serial["x serial"] == 1 and overlapped["s"] > 0 and overlapped["mux_s"] >= 0
    assert report["notes"][0].startswith("128x64, 56 frames")
