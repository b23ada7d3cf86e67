"""`AffinityRouterOptions`: the schedule-affinity router's `request_router_kwargs`, validated by pydantic.

Its own module (not the router's): Serve ships the router's module by value (cloudpickle) to every process that
holds a handle, and a pydantic model is better imported there than rebuilt from a pickle.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from deployments.routing.policy import DEFAULT_HOLD_FACTOR, DEFAULT_LOAD_FACTOR


class AffinityRouterOptions(BaseModel):
    """`RequestRouterConfig(request_router_kwargs=...)` of `ScheduleAffinityRouter`; unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    load_factor: float = Field(
        DEFAULT_LOAD_FACTOR, ge=1.0,
        description="A replica takes a key's request while its load stays within load_factor x the mean (incl. "
        "the new request); larger keeps affinity longer under skew, smaller balances sooner.",
    )
    hold_factor: float = Field(
        DEFAULT_HOLD_FACTOR, ge=1.0,
        description="The bound for a replica whose GPU plan slab holds the key: a hit costs far less than a "
        "rebuild, so a warm replica may queue more than a cold one.",
    )
    spill_confirm_s: float = Field(
        0.01, ge=0.0, le=1.0,
        description="Before spilling away from a key's holders, wait this long and probe them (and the target) "
        "afresh: a request that just finished may still be counted.",
    )
