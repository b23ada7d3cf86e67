"""bench.h3.BlockSpan / at_blocks: a run on some of the released blocks scales to 50 by its blocks' time alone.

On a CPU the span is the host clock from the first block's start to the last block's end; the work before and
after the stack (embedders, heads) is measured once and never scaled.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from bench.h3 import BlockSpan, at_blocks

CPU = torch.device("cpu")


class Sleep(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


class Stack(nn.Module):
    """0.05 s outside the blocks (before and after), 3 blocks of 0.02 s."""

    def __init__(self):
        super().__init__()
        self.head = Sleep(0.025)
        self.transformer_blocks = nn.ModuleList(Sleep(0.02) for _ in range(3))

    def forward(self, x: torch.Tensor, skip_last: bool = False) -> torch.Tensor:
        x = self.head(x)
        for block in self.transformer_blocks[:-1] if skip_last else self.transformer_blocks:
            x = block(x)
        return self.head(x)


def test_the_span_is_the_block_stack_alone_summed_over_forwards_and_its_hooks_go_with_the_with():
    stack = Stack()
    with BlockSpan(stack.transformer_blocks, CPU) as span:
        for _ in range(2):
            stack(torch.zeros(1))
    assert 2 * 0.06 <= span.seconds() < 2 * 0.06 + 2 * 0.05  # the blocks' 2 x 0.06 s, not the heads' 2 x 0.05 s
    assert all(not block._forward_hooks and not block._forward_pre_hooks for block in stack.transformer_blocks)


def test_a_forward_that_raises_inside_the_span_leaves_no_hook_behind():
    stack = Stack()
    with pytest.raises(RuntimeError, match="a block failed"):
        with BlockSpan(stack.transformer_blocks, CPU):
            stack.transformer_blocks[1].register_forward_hook(lambda *_: (_ for _ in ()).throw(
                RuntimeError("a block failed")))
            stack(torch.zeros(1))
    assert not stack.transformer_blocks[0]._forward_pre_hooks and not stack.transformer_blocks[-1]._forward_hooks


def test_a_forward_that_skips_the_last_block_leaves_the_span_unknown():
    stack = Stack()
    with BlockSpan(stack.transformer_blocks, CPU) as span:
        stack(torch.zeros(1))
        stack(torch.zeros(1), skip_last=True)
    assert span.seconds() is None
    with BlockSpan(stack.transformer_blocks, CPU) as nothing_ran:
        pass
    assert nothing_ran.seconds() is None


@pytest.mark.parametrize("seconds, block_seconds, measured, blocks, want", [
    (1.0, 0.8, 8, 50, 1.0 + 0.8 * (50 / 8 - 1)),   # only the blocks' share scales
    (1.0, None, 8, 50, 50 / 8),                     # unknown share: all of it (the old estimate, an upper bound)
    (1.0, 0.8, 50, 50, 1.0),                        # measured at the released count: as measured
])
def test_at_blocks_scales_the_blocks_share_and_keeps_the_rest(seconds, block_seconds, measured, blocks, want):
    assert at_blocks(seconds, block_seconds, measured, blocks) == pytest.approx(want)
