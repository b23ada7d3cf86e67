"""The one AdaLN projection both modes use, so online plans equal resident ones bit for bit.

`match`: `F.linear(x, W, b)` in the model dtype with exactly M rows, the same call and shape as the transformer's
own `nn.Linear` in `model.adaln.resident_modulation` (cuBLAS picks kernels by shape: batching plans into one GEMM
changes the bits).
`fp32`: `F.linear(x.float(), W.float(), b.float()).to(dtype)` with TF32 off, so the result does not depend
on the process-wide `allow_tf32` flag. The model's own resident path is bf16, so with `fp32` resident mode
must also project through `project()` (`ResidentModulation` does) to stay equal to online mode.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Literal

import torch
import torch.nn.functional as F

Projection = Literal["match", "fp32"]


@contextlib.contextmanager
def projection_guard(projection: Projection) -> Iterator[None]:
    """Around a batch of `project` calls: for `fp32`, full fp32 GEMMs (TF32 off), restored on exit."""
    if projection != "fp32" or not torch.cuda.is_available():
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def prepare_weight(weight: torch.Tensor, bias: torch.Tensor, projection: Projection):
    """The (weight, bias) operands for `project`; for `fp32` cast once per block, not once per plan."""
    if projection == "fp32":
        return weight.float(), bias.float()
    return weight, bias


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, projection: Projection,
            out_dtype: torch.dtype) -> torch.Tensor:
    """One plan's modulation rows: x [M, in] -> [M, out] in `out_dtype` (operands from `prepare_weight`)."""
    if projection == "fp32":
        return F.linear(x.float(), weight, bias).to(out_dtype)
    return F.linear(x, weight, bias)
