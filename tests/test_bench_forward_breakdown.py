"""bench.forward_breakdown: kernels sort into the groups whose floors the table prints beside them, and its
smoke run on CPU writes the eager and compiled rows against the block's bf16 floor and the block's attention
replayed alone against attention's floor (the kernel breakdown, the max-autotune row and the FP8 rows need a GPU:
skipped with the reason in the notes)."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
import torch

from bench import forward, forward_breakdown


@pytest.mark.parametrize("kernel, group", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_128x128x128", "attention"),
    ("flash_attn_fwd_kernel_sm90", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "gemm"),
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNN", "gemm"),
    ("void cutlass::device_kernel<torchao::scaled_mm_rowwise>", "gemm"),
    ("triton_per_fused__to_copy_add_mul_native_layer_norm_0", "fused elementwise (triton)"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "other"),
])
def test_a_kernel_lands_in_the_group_of_its_floor(kernel, group):
    assert forward_breakdown.kernel_group(kernel) == group


@pytest.mark.parametrize("spans, idle", [
    ([], 0.0),
    ([(0.0, 5.0)], 0.0),
    ([(0.0, 5.0), (7.0, 9.0)], 2.0),  # one gap
    ([(7.0, 9.0), (0.0, 5.0)], 2.0),  # profiler order is not time order
    ([(0.0, 5.0), (1.0, 8.0), (10.0, 11.0)], 2.0),  # overlapping kernels (two streams) leave no gap between them
    ([(0.0, 10.0), (2.0, 3.0), (12.0, 13.0)], 2.0),  # a kernel inside another does not end the busy span
])
def test_gpu_idle_is_the_time_no_kernel_covers(spans, idle):
    assert forward_breakdown.idle_between(spans) == idle


@pytest.mark.slow  # compiles a tiny block (dynamo, eager backend)
def test_breakdown_smoke_writes_eager_and_compiled_beside_the_block_floor(tmp_path):
    assert forward_breakdown.main(["--smoke", "--tokens", "61", "--repeats", "1", "--back-to-back", "2",
                                   "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "forward-breakdown-smoke-cpu.json").read_text())
    assert report["commit"] and report["command"].startswith("python -m bench.forward_breakdown --smoke")
    whats = [row["what"] for row in report["rows"]]
    assert whats == ["block eager native", "  2 back to back, per call",
                     "block compiled native (inductor default)", "  2 back to back, per call",
                     "attention alone on the bf16 block's q/k/v, 2 queued, per call",
                     "attention alone on fresh N(0, 1) q/k/v, 2 queued, per call"]
    rows = {row["what"]: row for row in report["rows"]}
    linear, attention = forward.block_flops(forward.SMOKE, 61)
    floor_ms = (linear + attention) / (forward.GEMM_TFLOPS * 1e12) * 1e3
    attention_floor_ms = attention / (forward.GEMM_TFLOPS * 1e12) * 1e3
    for row in report["rows"]:
        alone = row["what"].startswith("attention alone")
        assert row["floor ms"] == float(f"{attention_floor_ms if alone else floor_ms:.4g}")
        assert row["x bf16 block floor"] == pytest.approx(row["ms"] / floor_ms, rel=0.01)
    assert rows["block compiled native (inductor default)"]["rel. error"] == "0.00e+00"  # dynamo's eager backend
    assert any(note.startswith("fp8 rows skipped: engine.quantization: fp8 needs a CUDA GPU")
               for note in report["notes"])


def test_breakdown_static_adds_the_block_compiled_for_its_one_token_count(tmp_path, monkeypatch):
    compiled_with: list[bool] = []

    class Spy(forward_breakdown.CompiledBlocks):
        def apply(self):
            compiled_with.append(self.options.dynamic)
            return super().apply()

    monkeypatch.setattr(forward_breakdown, "CompiledBlocks", Spy)
    assert forward_breakdown.main(["--smoke", "--tokens", "61", "--repeats", "1", "--back-to-back", "2", "--static",
                                   "--fp8", "none", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "forward-breakdown-smoke-cpu.json").read_text())
    rows = {row["what"]: row for row in report["rows"]}
    static = rows["block compiled native (inductor default, static sizes)"]
    assert static["ms"] > 0 and static["rel. error"] == "0.00e+00"  # dynamo's eager backend: the eager block's bits
    assert any(note.startswith("block compiled native (inductor default, static sizes): dynamo CompileStats("
                               "frames_compiled=1") for note in report["notes"])
    assert compiled_with == [True, False]  # the served dynamic block, then the static one


def test_clock_samples_before_the_region_and_unreadable_lines_are_left_out():
    text = ("2026/12/06 22:52:00.900, 345, 70.1\n"      # before the region: the card still idle
            "2026/12/06 22:52:01.000, 1980, 690.0\n"
            "2026/12/06 22:52:01.050, [N/A], [N/A]\n"
            "2026/12/06 22:52:01.100, 1755, 700.0\n"
            "2026/12/06 22:52:01.1")                    # torn by the sampler's end
    reading = forward_breakdown.parse_clock_samples(text, since=datetime(2026, 12, 6, 22, 52, 1))
    assert reading == forward_breakdown.ClockReading(mean_mhz=1867.5, min_mhz=1755.0, mean_w=695.0, n=2)
    assert forward_breakdown.parse_clock_samples(text).n == 3
    assert forward_breakdown.parse_clock_samples("") is None


WRAPPER = """
def call(args):
    arg2_1, arg3_1 = args
    assert_size_stride(arg2_1, (1, s27, 7168), (7168*s27, 7168, 1), 'input')
    buf1 = empty_strided_cuda((1, 56, s27, 128), (7168*s27, 128, 7168, 1), torch.bfloat16)
    buf2 = empty_strided_cuda((1, 56, s27, 128), (7168*s27, 128*s27, 128, 1), torch.bfloat16)
    triton_poi_fused_attention_prep_0.run(buf1, buf2, s27)
    # Topologically Sorted Source Nodes: [scaled_dot_product_attention], Original ATen: [aten._scaled_dot_product_cudnn_attention]
    buf3 = torch.ops.aten._scaled_dot_product_cudnn_attention.default(buf1, buf2, reinterpret_tensor(arg2_1, (1, 56, s27, 128), (7168*s27, 128, 7168, 1), 0), None, False)
    buf4 = torch.ops.ditserve.flash_attention_4.default(buf2, buf1, arg2_1, 0.088)
    return (buf3, buf4)
"""


def test_attention_inputs_names_each_attention_calls_q_k_v_layouts_from_the_wrapper_code():
    calls = forward_breakdown.attention_inputs(WRAPPER)
    assert calls == [
        "aten._scaled_dot_product_cudnn_attention.default: buf1 (1, 56, s27, 128) strides (7168*s27, 128, 7168, 1); "
        "buf2 (1, 56, s27, 128) strides (7168*s27, 128*s27, 128, 1); "
        "arg2_1 viewed (1, 56, s27, 128) strides (7168*s27, 128, 7168, 1) offset 0",
        "ditserve.flash_attention_4.default: buf2 (1, 56, s27, 128) strides (7168*s27, 128*s27, 128, 1); "
        "buf1 (1, 56, s27, 128) strides (7168*s27, 128, 7168, 1); "
        "arg2_1 (1, s27, 7168) strides (7168*s27, 7168, 1)",
    ]
    assert forward_breakdown.attention_inputs("def call(args):\n    return (args[0],)\n") == []


@pytest.mark.slow
def test_output_code_keeps_inductors_wrapper_unprinted_and_its_attention_call_is_found(capsys):
    import torch.nn.functional as F

    def attend(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        q = (x @ w).view(1, -1, 4, 16).transpose(1, 2)
        return F.scaled_dot_product_attention(q.sin(), q.cos(), q)

    torch._dynamo.reset()
    with forward_breakdown.output_code() as codes:
        torch.compile(attend, dynamic=True)(torch.randn(1, 32, 64), torch.randn(64, 64))
    assert len(codes) == 1 and "def call(" in codes[0]
    (call,) = forward_breakdown.attention_inputs(codes[0])
    assert call.startswith("aten._scaled_dot_product_flash_attention_for_cpu.default: buf")
    assert "def call(" not in capsys.readouterr().err  # kept, not printed
    assert not torch._logging._internal.log_state.is_artifact_enabled("output_code")  # the setting put back
