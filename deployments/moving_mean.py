"""One running mean of generation times: the router's service costs (replica side) and the ingress's Retry-After."""

from __future__ import annotations

from typing import Optional

#: Weight of the newest sample in a running mean of generation times (about the last ten count).
MOVING_MEAN_WEIGHT = 0.2


def moving_mean(mean: Optional[float], sample: float) -> float:
    """The running mean after `sample` (the first sample starts it)."""
    return sample if mean is None else mean + MOVING_MEAN_WEIGHT * (sample - mean)
