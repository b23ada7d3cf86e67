"""`python -m bench.parallel --smoke`: SP1 and SP2 (gloo, two spawned ranks, the tiny checkpoint) through the engine
path write the table the GPU run writes. Timings are not checked (CPU smoke timings mean nothing); what is
deterministic is: SP2's velocity equals SP1's bit for bit on CPU, both degrees rebuild all 49 plans of a 50-step
schedule, the all-to-all bytes follow from the shape (4 x rows/2 x inner x 2 B x 1/2 per block), and the text encode
is tensor parallel under SP2 (less than the whole encoder per rank, the embedding within bf16 rounding of SP1's).
diffusers' own context parallel is a GPU-only run (it has no CPU path), so the smoke table has no row of it."""

from __future__ import annotations

import json

import pytest

from bench import parallel
from model.tiny import TINY_TRANSFORMER

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # slow: bench.parallel's smoke: spawned gloo ranks


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("out")
    code = parallel.main(["--smoke", "--shapes", "s", "--profile", "--out", str(out),
                          "--workdir", str(tmp_path_factory.mktemp("work"))])
    assert code == 0
    report = json.loads((out / "parallel-smoke-cpu.json").read_text())
    report["profile"] = json.loads((out / "parallel-profile-smoke-cpu.json").read_text())
    return report


def test_profile_has_a_row_per_rank_with_every_category(report):
    rows = report["profile"]["rows"]
    assert [(row["run"], row["rank"]) for row in rows] == [("sp1", 0), ("sp2", 0), ("sp2", 1)]
    for row in rows:
        parts = [row[f"{c}_ms"] for c in ("gemm", "attention", "comm", "other")]
        assert all(part >= 0 for part in parts) and row["ms_per_step"] > 0
        assert row["busy_ms"] + row["idle_ms"] == pytest.approx(row["ms_per_step"], abs=2e-3)
    assert rows[0]["comm_ms"] == 0 and all(row["comm_ms"] > 0 for row in rows[1:])  # sp2's gloo all-to-alls


def test_provenance_is_recorded(report):
    assert report["commit"] and report["device"] == "smoke-cpu"
    assert report["command"].startswith("python -m bench.parallel --smoke")


def test_sp2_step_matches_sp1_bit_for_bit_with_speedup_and_comm_floor(report):
    steps = {row["sp"]: row for row in report["rows"] if row["what"] == "step s"}
    assert sorted(steps) == [1, 2]
    one, two = steps[1], steps[2]
    assert one["tokens"] == two["tokens"] > 0
    assert one["max_abs_diff_vs_sp1"] == 0.0 and two["max_abs_diff_vs_sp1"] == 0.0
    assert one["max_abs_v"] > 0
    assert one["speedup"] == 1.0 and two["speedup"] > 0
    blocks = TINY_TRANSFORMER.num_layers
    expected_mb = 4 * two["tokens"] / 2 * TINY_TRANSFORMER.inner_dim * 2 * 0.5 * blocks / 1e6
    assert two["a2a_MB_per_rank_per_forward"] == pytest.approx(expected_mb)
    assert two["comm_floor_ms"] > 0 and "a2a_MB_per_rank_per_forward" not in one


def test_plan_miss_rebuilds_every_plan_of_a_50_step_schedule_on_both_degrees(report):
    misses = {row["sp"]: row for row in report["rows"] if row["what"].startswith("plan miss")}
    assert sorted(misses) == [1, 2]
    assert all(row["what"] == "plan miss (49 plans built)" for row in misses.values())
    assert misses[1]["miss_vs_sp1"] == 1.0 and misses[2]["miss_s"] > 0
    assert len(misses[2]["note"].split("/")) == 2  # one time per rank


def test_no_diffusers_run_on_cpu(report):
    assert {row["impl"] for row in report["rows"]} == {"ours"}
    assert any("not run: diffusers' CP needs accelerators" in note for note in report["notes"])


def test_sp2_encodes_the_prompt_tensor_parallel_with_less_of_the_encoder_per_rank(report):
    encodes = {row["sp"]: row for row in report["rows"] if row["what"] == "text encode"}
    assert sorted(encodes) == [1, 2]
    one, two = encodes[1], encodes[2]
    assert (one["split"], two["split"]) == ("whole", "tp2")
    assert one["tokens"] == two["tokens"] > 0 and one["max_abs_diff_vs_sp1"] == 0.0
    whole = float(one["param_MiB_per_rank"])
    per_rank = [float(x) for x in two["param_MiB_per_rank"].split("/")]
    # the embedding is replicated, the layers halved: between half and all of the whole encoder per rank
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1] and whole / 2 < per_rank[0] < whole
    # tests/test_parallel_text_encoder.py derives the bound: 16 bf16 epsilons of the largest value
    assert 0 < two["max_abs_diff_vs_sp1"] <= 16 * 2**-7 * one["max_abs_v"]
