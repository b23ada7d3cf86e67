"""FlashAttention-4 from the `flash-attn-4` wheel against PyTorch's SDPA kernels at H3's shapes, and where a compiled
released-width block's time goes: the probe that measured `engine.attention: flash_4` (engine/flash4.py) on a GPU.

    python bench/fa4_probe.py     # one Hopper GPU with the flash-attn-4 wheel importable; writes $OUT/probe.json

Rows: one attention call of q/k/v [1, S, 56, 128] bf16 at 7,800 / 37,774 / 63,256 tokens through SDPA forced to
cuDNN, SDPA forced to FlashAttention-2, and the wheel's `flash_attn.cute.flash_attn_func` (first call: its JIT
compile; max |out - cuDNN's|); then one `MiniMaxH3TransformerBlock` at 37,774 tokens compiled as `engine.compile`
does (cuDNN attention) with torch.profiler's top kernels (set SKIP_DEFAULT=1 to leave it out), and the block with
FA4 in diffusers' `flash_4_hub` slot as a custom op, eager and compiled (what `engine.flash4` installs; the op is
this file's own copy so the probe runs without ditserve's engine config). Floors at 788 TFLOP/s
(`bench.forward.block_flops`). Results: bench/results/attention-fa4-nvidia-h100.md.
"""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.getcwd())
from bench.forward import RELEASED, block_flops, make_block, make_inputs, set_backend, timed_ms  # noqa: E402

dev = torch.device("cuda")
H, D = 56, 128
result = {"device": torch.cuda.get_device_name(), "attention": [], "notes": []}
try:
    from flash_attn.cute import flash_attn_func as fa4
except Exception as exc:  # noqa: BLE001
    fa4 = None
    result["notes"].append(f"fa4 import failed: {exc!r}")
    print(result["notes"][-1], flush=True)


def fa4_out(q, k, v):
    out = fa4(q, k, v)
    return out[0] if isinstance(out, tuple) else out


for S in (7800, 37774, 63256):
    g = torch.Generator(device=dev).manual_seed(S)
    q, k, v = (torch.randn(1, S, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
    flops = 4 * S * S * H * D
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    row = {"tokens": S}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)
        row["cudnn_ms"] = timed_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt), dev, 7)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        row["sdpa_flash2_ms"] = timed_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt), dev, 5)
    if fa4 is not None:
        try:
            t = time.perf_counter()
            o = fa4_out(q, k, v)
            torch.cuda.synchronize()
            row["fa4_first_s"] = round(time.perf_counter() - t, 2)
            row["fa4_max_abs_err_vs_cudnn"] = (o.float() - ref.float()).abs().max().item()
            row["fa4_ms"] = timed_ms(lambda: fa4_out(q, k, v), dev, 7)
        except Exception as exc:  # noqa: BLE001
            row["fa4_error"] = repr(exc)[:500]
    for key in [k_ for k_ in row if k_.endswith("_ms")]:
        row[key.replace("_ms", "_tflops")] = round(flops / row[key] / 1e9, 1)
    result["attention"].append(row)
    print(row, flush=True)
    del q, k, v, qt, kt, vt, ref

# The compiled block at 37,774 tokens: where the time goes.
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from engine.compiled import CompiledBlocks, CompileOptions  # noqa: E402

S = 37774
block = make_block(RELEASED, dev)
inputs = make_inputs(RELEASED, S, dev)
lin, att = block_flops(RELEASED, S)
result["floor_ms"] = {"linear": lin / 788e12 * 1e3, "attention": att / 788e12 * 1e3}
blocks = torch.nn.ModuleList([block])
for mode in (() if os.environ.get("SKIP_DEFAULT") else ("default",)):
    try:
        b = torch.nn.ModuleList([make_block(RELEASED, dev)])
        CompiledBlocks(b, CompileOptions(backend="inductor", inductor_mode=mode)).apply()
        with torch.no_grad():
            t = time.perf_counter()
            inputs.call(b[0])
            torch.cuda.synchronize()
            first = time.perf_counter() - t
            ms = timed_ms(lambda: inputs.call(b[0]), dev, 5)
        result[f"compiled_{mode}_ms"] = ms
        result["notes"].append(f"compiled {mode}: first call {first:.1f} s, {ms:.1f} ms")
        print(result["notes"][-1], flush=True)
        if mode == "default":
            with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    inputs.call(b[0])
                torch.cuda.synchronize()
            events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
            result["top_kernels"] = [{"name": e.key[:160], "ms_per_call_of_block": round(e.device_time_total / 3 / 1e3, 3),
                                      "count_per_block": e.count // 3} for e in events[:30]]
            for e in result["top_kernels"]:
                print(e, flush=True)
        del b
    except Exception as exc:  # noqa: BLE001
        result["notes"].append(f"compiled {mode} failed: {exc!r}"[:600])
        print(result["notes"][-1], flush=True)

if fa4 is not None:
    # FA4 inside the block: as a custom op so the compiled block stays one graph.
    @torch.library.custom_op("probe::fa4", mutates_args=())
    def fa4_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return fa4_out(q, k, v)

    @fa4_op.register_fake
    def _(q, k, v):
        return torch.empty_like(q)

    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    _HUB_KERNELS_REGISTRY[AttentionBackendName.FLASH_4_HUB].kernel_fn = \
        lambda q, k, v, softmax_scale=None, causal=False: fa4_op(q, k, v)
    for compiled in (False, True):
        try:
            b = torch.nn.ModuleList([make_block(RELEASED, dev)])
            set_backend(b[0], "flash_4_hub")
            if compiled:
                CompiledBlocks(b, CompileOptions(backend="inductor")).apply()
            with torch.no_grad():
                ref_block = make_block(RELEASED, dev)
                reference = inputs.call(ref_block)
                out = inputs.call(b[0])
                err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
                ms = timed_ms(lambda: inputs.call(b[0]), dev, 5)
            key = f"block_fa4_{'compiled' if compiled else 'eager'}"
            result[key + "_ms"] = ms
            result[key + "_rel_err"] = err
            print(key, ms, err, flush=True)
            del b, ref_block
        except Exception as exc:  # noqa: BLE001
            result["notes"].append(f"fa4 block compiled={compiled} failed: {exc!r}"[:600])
            print(result["notes"][-1], flush=True)

out = os.environ.get("OUT", "/tmp")
with open(os.path.join(out, "probe.json"), "w") as f:
    json.dump(result, f, indent=1)
print(json.dumps({k: v for k, v in result.items() if k != "top_kernels"}, indent=1))
