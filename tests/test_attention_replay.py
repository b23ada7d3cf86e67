"""bench.attention_replay: the attention call an eager block makes is caught with the tensors it was handed and,
replayed alone, returns the block's own bits; the control keeps the layout and changes the values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench import forward
from bench.attention_replay import caught_attention, fresh_like


@pytest.fixture(scope="module")
def block_and_inputs():
    block = forward.make_block(forward.SMOKE, torch.device("cpu"))
    forward.set_backend(block, "native")
    return block, forward.make_inputs(forward.SMOKE, 61, torch.device("cpu"))


def quantized(block):
    pytest.importorskip("torchao")
    from bench.forward_breakdown import fp8_block

    with pytest.MonkeyPatch.context() as patch:  # torchao's float8 linears compute on a CPU too
        patch.setattr("torchao.quantization.quant_api._check_hardware_support", lambda granularity: None)
        return fp8_block(block, "row")[0]


@pytest.mark.parametrize("variant", ["bf16", "fp8 rowwise"])
def test_a_caught_call_replays_to_the_bits_it_returned_inside_the_block(block_and_inputs, variant):
    block, inputs = block_and_inputs
    module = block if variant == "bf16" else quantized(block)
    call, inside = caught_attention(lambda: inputs.call(module))
    q, k, v = call.tensors()[:3]
    assert q.shape == (1, forward.SMOKE.heads, 61, forward.SMOKE.head_dim) and k.shape == v.shape == q.shape
    def first(out):  # SDPA's kernels return (out, logsumexp, ...); FA4's op the output alone
        return out[0] if isinstance(out, tuple) else out

    assert torch.equal(first(call()), first(inside))
    assert call.describe().startswith(f"{call.op.name()}: (1, 4, 61, 16) strides {q.stride()} std ")


def test_the_fp8_block_hands_its_attention_other_values_in_the_same_layout(block_and_inputs):
    block, inputs = block_and_inputs
    bf16, _ = caught_attention(lambda: inputs.call(block))
    fp8, _ = caught_attention(lambda: inputs.call(quantized(block)))
    assert fp8.op == bf16.op
    for a, b in zip(bf16.tensors(), fp8.tensors(), strict=True):
        assert a.stride() == b.stride() and not torch.equal(a, b)


def test_the_control_keeps_shapes_strides_and_dtypes_and_draws_new_values(block_and_inputs):
    block, inputs = block_and_inputs
    call, _ = caught_attention(lambda: inputs.call(block))
    control = fresh_like(call)
    for a, b in zip(call.tensors(), control.tensors(), strict=True):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype) and not torch.equal(a, b)
        assert b.float().std().item() == pytest.approx(1.0, abs=0.1)
    assert fresh_like(call).tensors()[0].equal(control.tensors()[0])  # seeded: side-by-side runs replay the same
    control()  # the op accepts them


@pytest.mark.parametrize("calls", [0, 2])
def test_a_run_without_exactly_one_attention_call_is_refused(calls):
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=f"expected one attention call, caught {calls}"):
        caught_attention(lambda: [F.scaled_dot_product_attention(q, q, q) for _ in range(calls)])
