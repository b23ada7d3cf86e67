"""bench.forward's smoke run on CPU writes the table its GPU run writes: every attention backend's row, the
eager, compiled and (refused on a CPU, with the reason in the notes) FP8 rows, each beside its floor."""

from __future__ import annotations

import json

import pytest

from bench import forward

pytestmark = pytest.mark.slow  # compiles a tiny block (dynamo, eager backend): tens of seconds on a busy CPU


def test_forward_smoke_writes_every_mode_beside_its_floor(tmp_path):
    assert forward.main(["--smoke", "--tokens", "61", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "forward-smoke-cpu.json").read_text())
    assert report["commit"] and report["command"].startswith("python -m bench.forward --smoke")
    whats = [row["what"] for row in report["rows"]]
    assert whats == ["attention native", "attention _native_math", "block eager native", "block eager _native_math",
                     "block compiled native"]
    linear, attention = forward.block_flops(forward.SMOKE, 61)
    floor_ms = (linear + attention) / (forward.GEMM_TFLOPS * 1e12) * 1e3
    block_rows = [row for row in report["rows"] if row["what"].startswith("block")]
    assert all(row["floor ms"] == float(f"{floor_ms:.4g}") for row in block_rows)
    compiled = next(row for row in block_rows if row["what"] == "block compiled native")
    assert compiled["rel. error"] == "0.00e+00"  # dynamo's eager backend runs the same kernels
    assert any(note.startswith("fp8 rows skipped: engine.quantization: fp8 needs a CUDA GPU") for note in report["notes"])
