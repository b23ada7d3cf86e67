"""FlashAttention-4's Hopper forward at H3's shapes, per tile: does another (tile_m, tile_n) than the wheel's
default beat it, and what does the best one make of a compiled block?

    python -m bench.fa4_tiles            # one Hopper GPU, flash-attn-4 importable; writes $OUT/fa4_tiles.json
    BLOCK=1 python -m bench.fa4_tiles    # also the compiled released-width block at 37,774 tokens (needs diffusers)

Run it as a module: run as a file, bench/ is first on the path and bench/profile.py hides the standard `profile`.

The wheel picks 128 x 128 (register-held P, intra-warpgroup overlap) for head dim 128 on SM90; its C++ FA3
ancestor picks 128 x 176 for non-causal attention. Each candidate runs through the wheel's `_flash_attn_fwd`
(`tile_mn`, `mma_pv_is_rs`, `intra_wg_overlap`) on q/k/v [1, S, 56, 128] bf16 at 7,800 / 37,774 / 63,256 tokens,
median of 7 after warm-up, beside max |out - default tile's out| (the tile changes the reduction order over keys,
so the bits differ; a correct kernel stays within bf16 rounding). A candidate that does not compile is recorded with
its error. Floor: 4 S^2 56 128 FLOPs at 788 TFLOP/s.
"""
import json
import os
import statistics
import sys
import time

import torch

H, D = 56, 128
TOKENS = (7800, 37774, 63256)
# (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap); the first is the wheel's default for head dim 128.
CANDIDATES = ((128, 128, True, True), (128, 112, True, True), (128, 144, True, True), (128, 160, True, True),
              (128, 176, True, True), (128, 192, True, True), (128, 176, False, True), (192, 128, False, True),
              (192, 112, False, True), (192, 96, True, True))
dev = torch.device("cuda")
from flash_attn.cute.interface import _flash_attn_fwd  # noqa: E402


def timed_ms(fn, repeats=7, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def attend(q, k, v, tile):
    out = _flash_attn_fwd(q, k, v, tile_mn=tile[:2], mma_pv_is_rs=tile[2], intra_wg_overlap=tile[3])
    return out[0] if isinstance(out, tuple) else out


result = {"device": torch.cuda.get_device_name(), "rows": [], "best": {}}
for S in TOKENS:
    g = torch.Generator(device=dev).manual_seed(S)
    q, k, v = (torch.randn(1, S, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
    floor_ms = 4 * S * S * H * D / 788e12 * 1e3
    reference = None
    for tile in CANDIDATES:
        row = {"tokens": S, "tile": list(tile)}
        try:
            t = time.perf_counter()
            out = attend(q, k, v, tile)
            torch.cuda.synchronize()
            row["first_s"] = round(time.perf_counter() - t, 2)
            reference = out if reference is None else reference
            row["max_abs_diff_vs_default"] = (out.float() - reference.float()).abs().max().item()
            row["ms"] = round(timed_ms(lambda: attend(q, k, v, tile)), 3)
            row["tflops"] = round(4 * S * S * H * D / row["ms"] / 1e9, 1)
            row["x_floor"] = round(row["ms"] / floor_ms, 3)
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:300]
        result["rows"].append(row)
        print(row, flush=True)
    timed = [r for r in result["rows"] if r["tokens"] == S and "ms" in r]
    result["best"][S] = min(timed, key=lambda r: r["ms"])["tile"]
    del q, k, v, reference

if os.environ.get("BLOCK"):
    # The compiled block at 37,774 tokens with the default tile and with the best one found there.
    sys.path.insert(0, os.getcwd())
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    from bench.forward import RELEASED, block_flops, make_block, make_inputs, set_backend
    from engine.compiled import CompiledBlocks, CompileOptions

    S = 37774
    chosen = {"tile": tuple(CANDIDATES[0])}

    @torch.library.custom_op("probe::fa4_tiled", mutates_args=())
    def fa4_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, chosen["tile"]).contiguous()

    @fa4_tiled.register_fake
    def _(q, k, v):
        return torch.empty_like(q)

    _HUB_KERNELS_REGISTRY[AttentionBackendName.FLASH_4_HUB].kernel_fn = \
        lambda q, k, v, softmax_scale=None, causal=False: fa4_tiled(q, k, v)
    inputs = make_inputs(RELEASED, S, dev)
    lin, att = block_flops(RELEASED, S)
    floor_ms = (lin + att) / 788e12 * 1e3
    for tile in dict.fromkeys((tuple(CANDIDATES[0]), tuple(result["best"][S]))):
        chosen["tile"] = tile
        torch._dynamo.reset()
        b = torch.nn.ModuleList([make_block(RELEASED, dev)])
        set_backend(b[0], "flash_4_hub")
        CompiledBlocks(b, CompileOptions(backend="inductor")).apply()
        with torch.no_grad():
            inputs.call(b[0])
            ms = timed_ms(lambda: inputs.call(b[0]), 5)
        row = {"what": "block compiled fa4", "tokens": S, "tile": list(tile), "ms": round(ms, 2),
               "floor_ms": round(floor_ms, 2), "x_floor": round(ms / floor_ms, 3)}
        result["rows"].append(row)
        print(row, flush=True)
        del b

out = os.environ.get("OUT", "/tmp")
with open(os.path.join(out, "fa4_tiles.json"), "w") as f:
    json.dump(result, f, indent=1)
print(json.dumps(result["best"]))
