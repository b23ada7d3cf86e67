"""bench.compile's 50-block estimate, on rows written by hand: what grows with the blocks (the transformer's block
bytes, the text encoder's layer bytes, the warm-up's forwards) scales, the rest stays as measured, and a start whose
loads ran beside the warm-up prices its extra bytes at the serial start's load rates."""

from __future__ import annotations

import pytest

from bench.compile import RELEASED_BLOCKS, RELEASED_TEXT_LAYERS, RequestTimes, estimate_at_50_blocks, x_later_at_scale

GB = 10**9


def row(**changes) -> dict:
    """A 5-block, 10-layer whole-engine start: 1 GB of non-block weights + 5 x 2 GB of blocks read in 2.2 s; 0.5 GB
    of non-layer text weights + 10 x 0.3 GB of layers in 1.75 s; two warm-up forwards of 0.1 s."""
    base = {"start_s": 20.0, "blocks": 5, "transformer_s": 2.2, "transformer_bytes": 11 * GB,
            "block_bytes": 10 * GB, "warmup_forward_s": 0.1, "text_encoder_s": 1.75, "text_bytes": 3.5 * GB,
            "text_layers": 10, "text_layer_bytes": 3 * GB}
    return {**base, **changes}


def test_what_grows_with_the_blocks_and_the_text_layers_scales_and_the_rest_stays():
    blocks_50 = 2.2 * (10 * GB * (RELEASED_BLOCKS / 5 - 1)) / (11 * GB)       # the extra block bytes at 0.2 s/GB
    layers_50 = 1.75 * (3 * GB * (RELEASED_TEXT_LAYERS / 10 - 1)) / (3.5 * GB)  # the extra layer bytes at 0.5 s/GB
    warm_up_50 = 0.1 * (RELEASED_BLOCKS / 5 - 1)
    assert estimate_at_50_blocks(row()) == pytest.approx(20.0 + blocks_50 + layers_50 + warm_up_50)


def test_a_denoiser_start_has_no_text_encoder_term():
    denoiser = {k: v for k, v in row().items() if not k.startswith("text_")}
    assert estimate_at_50_blocks(denoiser) == pytest.approx(20.0 + 2.2 * 90 / 11 + 0.1 * 9)


@pytest.mark.parametrize("slowed", [1.0, 3.0])
def test_loads_slowed_beside_the_warm_up_add_what_they_measured_once_and_scale_at_the_serial_rates(slowed):
    serial = row()
    overlapped = row(start_s=18.0, transformer_s=2.2 * slowed, text_encoder_s=1.75 * slowed)
    # However slow its own loads were, the extra bytes cost what the serial start's loads pay per byte.
    assert estimate_at_50_blocks(overlapped, serial) == pytest.approx(estimate_at_50_blocks(serial) - 2.0)
    if slowed > 1:  # priced at its own slowed rates (the old estimate), the overlap start would lose its lead
        assert estimate_at_50_blocks(overlapped) > estimate_at_50_blocks(serial)


@pytest.mark.parametrize("first, later, blocks, want", [
    # A first request slower only in its first forward (+300 ms once): 4 blocks, 5 steps reads 1.15x; the released
    # request spreads it over 49 forwards of 12.5x the work.
    ((560.0, 800.0, 500.0), (500.0, 500.0, 500.0), 4, 1 + 300.0 / (49 * 500.0 * 12.5)),
    # Every forward 10% slower: that stays at any scale (the first forward's 50 ms counted as once per canvas).
    ((550.0, 550.0, 550.0), (500.0, 500.0, 500.0), 4, 1.1 + 50.0 / (49 * 500.0 * 12.5)),
    # A first forward faster than the later requests' (noise): no negative extra.
    ((500.0, 450.0, 500.0), (500.0, 500.0, 500.0), 4, 1.0),
])
def test_the_released_requests_first_vs_later_spreads_a_once_per_canvas_cost_over_its_forwards(first, later, blocks,
                                                                                             want):
    def times(ms_per_forward, forward1_ms, rest_ms):
        return RequestTimes(ms_per_forward, forward1_ms, rest_ms, since_warmup=None)

    assert x_later_at_scale(times(*first), times(*later), blocks) == pytest.approx(want)
