"""bench.adapters' smoke run on CPU writes the table its GPU run writes: the block's per-forward rows (none,
installed-off, unfused, fused; eager and compiled) at each token count, load, install and switch, each with the
issue's goal beside it."""

from __future__ import annotations

import json

import pytest

from bench import adapters

pytestmark = pytest.mark.slow  # builds and compiles tiny models (dynamo, eager backend): tens of seconds


def test_adapters_smoke_writes_every_row_beside_its_goal(tmp_path):
    assert adapters.main(["--smoke", "--tokens", "61", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "adapters-smoke-cpu.json").read_text())
    assert report["commit"] and report["command"].startswith("python -m bench.adapters --smoke")
    whats = [row["what"] for row in report["rows"]]
    modes = ["none", "installed, off", "unfused", "fused"]
    assert whats[:8] == [f"block {mode} {kind}" for kind in ("eager", "compiled") for mode in modes]
    assert whats[8].startswith("load: read + convert + check, 30 modules")  # 4 blocks + 1 refiner, 6 targets
    assert whats[9].startswith("install: one block's factors") and whats[10].startswith("switch: between two")
    blocks = report["rows"][:8]
    assert all(row["tokens"] == 61 and row["ms"] > 0 for row in blocks)
    assert [row["x none"] for row in blocks if row["what"].startswith("block none")] == [1.0, 1.0]
    fused = [row for row in blocks if row["what"].startswith("block fused")]
    assert all(0 < float(row["rel. error"]) < 0.05 for row in fused)  # fused == unfused within bf16 rounding
    assert report["rows"][8]["goal"].startswith("<= 1 s") and report["rows"][10]["goal"] == "<= 10 ms"
    assert "(30 LoRA layers)" in whats[10]
