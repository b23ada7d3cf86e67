"""bench.profile: the per-category reduction of a profiled step (synthetic kernel timelines, exact values)."""

from __future__ import annotations

import pytest

from bench.profile import Interval, breakdown, category_of


@pytest.mark.parametrize("name, category", [
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "comm"),
    ("gloo:all_to_all", "comm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
    ("aten::addmm", "gemm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", None),
    ("Memcpy DtoD (Device -> Device)", None),
])
def test_kernel_names_map_to_categories(name, category):
    assert category_of(name) == category


def test_overlapped_comm_is_counted_in_its_category_but_only_the_open_part_is_exposed():
    # one step: gemm 0-10, nccl 5-14 (under the gemm until 10, alone 10-12), attention 12-20,
    # nothing 20-23, elementwise 23-25
    intervals = [Interval("gemm", 0, 10_000), Interval("comm", 5_000, 14_000), Interval("attention", 12_000, 20_000),
                 Interval("other", 23_000, 25_000)]
    got = breakdown(intervals, num_steps=1)
    assert got == {"window_ms": 25.0, "gemm_ms": 10.0, "attention_ms": 8.0, "comm_ms": 9.0, "other_ms": 2.0,
                   "busy_ms": 22.0, "idle_ms": 3.0, "comm_exposed_ms": 2.0}


def test_values_are_per_step():
    intervals = [Interval("gemm", 0, 4_000), Interval("other", 6_000, 8_000)]
    assert breakdown(intervals, num_steps=2) == {"window_ms": 4.0, "gemm_ms": 2.0, "attention_ms": 0.0,
                                                "comm_ms": 0.0, "other_ms": 1.0, "busy_ms": 3.0, "idle_ms": 1.0,
                                                "comm_exposed_ms": 0.0}


def test_no_kernels_no_breakdown():
    assert breakdown([], num_steps=2) == {}
