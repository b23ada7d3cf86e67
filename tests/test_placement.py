"""plan_placement: which replica's plan slab should hold which schedule, from observed request rates.

Invariants over a matrix of rate distributions and replica counts: slabs never overfull, stable schedules are
the most requested ones, a schedule is replicated exactly when one replica may not carry it, the partition is
otherwise disjoint and balanced, re-planning with the same rates moves nothing, tail keys stick to one scratch
replica.
"""

import math

import numpy as np
import pytest

from deployments.placement import SCRATCH, Placement, copies_for, plan_placement

PLANS = 8


def zipf_rates(num_keys: int, alpha: float) -> dict:
    w = 1.0 / np.arange(1, num_keys + 1) ** alpha
    return {f"s{i}": float(x) for i, x in enumerate(1000 * w / w.sum())}


def replicas(n: int, slots: int = 4) -> dict:
    return {f"r{i}": slots * PLANS for i in range(n)}


def plans_of(key: str) -> int:
    return PLANS


MATRIX = [
    pytest.param(zipf_rates(32, 1.1), 4, id="zipf1.1-32keys-4replicas"),
    pytest.param(zipf_rates(32, 1.5), 4, id="zipf1.5-32keys-4replicas"),
    pytest.param(zipf_rates(64, 0.8), 8, id="zipf0.8-64keys-8replicas"),
    pytest.param(zipf_rates(32, 0.0), 4, id="uniform-32keys-4replicas"),
    pytest.param(zipf_rates(10, 1.1), 4, id="zipf-10keys-fit"),
    pytest.param(zipf_rates(32, 2.5), 3, id="zipf2.5-very-hot-3replicas"),
]


def placed_plans(placement: Placement, rid: str) -> int:
    stable = sum(PLANS for targets in placement.targets.values() if rid in targets)
    return stable + (PLANS if rid in placement.scratch else 0)


@pytest.mark.parametrize("rates, n", MATRIX)
def test_no_slab_is_planned_over_its_capacity(rates, n):
    caps = replicas(n)
    placement = plan_placement(rates, caps, plans_of)
    for rid, cap in caps.items():
        assert placed_plans(placement, rid) <= cap


@pytest.mark.parametrize("rates, n", MATRIX)
def test_stable_schedules_are_the_most_requested(rates, n):
    placement = plan_placement(rates, replicas(n), plans_of)
    stable = [k for k in rates if placement.is_stable(k)]
    tail = [k for k in rates if not placement.is_stable(k)]
    assert stable
    if tail:
        assert min(rates[k] for k in stable) >= max(rates[k] for k in tail)
    else:
        assert not placement.scratch  # everything fits: nothing to scratch


@pytest.mark.parametrize("rates, n", MATRIX)
@pytest.mark.parametrize("load_factor", [1.0, 1.25, 2.0])
def test_a_schedule_is_replicated_exactly_when_one_replica_may_not_carry_it(rates, n, load_factor):
    placement = plan_placement(rates, replicas(n), plans_of, load_factor=load_factor)
    share = sum(placement.loads.values()) / n
    for key, targets in placement.targets.items():
        assert len(set(targets)) == len(targets)  # copies on distinct replicas
        if rates[key] > load_factor * share:
            assert len(targets) == min(n, math.ceil(rates[key] / share)), key
        else:
            assert len(targets) == 1, key  # disjoint partition: one slab per schedule


def test_the_hottest_zipf_schedule_is_replicated_and_the_rest_partitioned():
    # zipf 1.1 over 32 keys: the hottest takes ~28% of requests, over a replica's share with load_factor 1.0
    rates = zipf_rates(32, 1.1)
    placement = plan_placement(rates, replicas(4), plans_of, load_factor=1.0)
    assert len(placement.targets["s0"]) == 2
    assert all(len(placement.targets[k]) == 1 for k in placement.targets if k != "s0")
    # every slot used: 16 slots = 2 copies of s0 + 13 other stable schedules + 1 scratch slot for the tail
    assert len(placement.targets) == 14 and len(placement.scratch) == 1


@pytest.mark.parametrize("rates, n", MATRIX)
def test_loads_are_balanced_within_load_factor_of_the_share_plus_one_copy(rates, n):
    load_factor = 1.25
    placement = plan_placement(rates, replicas(n), plans_of, load_factor=load_factor)
    share = sum(placement.loads.values()) / n
    largest_copy = max(rates[k] / len(t) for k, t in placement.targets.items())
    assert max(placement.loads.values()) <= load_factor * share + largest_copy


@pytest.mark.parametrize("rates, n", MATRIX)
def test_replanning_with_the_slabs_as_placed_moves_nothing(rates, n):
    first = plan_placement(rates, replicas(n), plans_of)
    holds = {rid: {k for k, t in first.targets.items() if rid in t} for rid in replicas(n)}
    again = plan_placement(rates, replicas(n), plans_of, holds=holds)
    assert {k: set(t) for k, t in again.targets.items()} == {k: set(t) for k, t in first.targets.items()}


def test_a_schedule_stays_where_it_is_held_while_the_balance_allows():
    rates = {f"s{i}": 10.0 for i in range(8)}  # 8 equal schedules, 4 replicas x 4 slots: all fit, 2 per replica
    placement = plan_placement(rates, replicas(4), plans_of, holds={"r3": {"s0", "s1"}})
    assert placement.targets["s0"] == ("r3",) and placement.targets["s1"] == ("r3",)
    # a replica holding more than its share keeps only what balance allows
    placement = plan_placement(rates, replicas(4), plans_of, holds={"r3": set(rates)})
    assert sum(t == ("r3",) for t in placement.targets.values()) == 2


@pytest.mark.parametrize("rates, n", MATRIX)
def test_tail_keys_go_to_one_scratch_replica_each_and_stable_keys_to_their_targets(rates, n):
    placement = plan_placement(rates, replicas(n), plans_of)
    for key in list(rates) + ["never-seen-1", "never-seen-2"]:
        where = placement.replicas_for(key)
        if placement.is_stable(key):
            assert where == placement.targets[key]
        elif placement.scratch:
            assert len(where) == 1 and where[0] in placement.scratch
            assert placement.replicas_for(key) == where  # deterministic
        else:
            assert where == ()


def test_no_scratch_slot_when_the_tail_is_worth_less_than_a_stable_slot():
    rates = {**{f"s{i}": 10.0 for i in range(16)}, "rare": 1.0}  # 16 fill the slots; the tail is one rare key
    placement = plan_placement(rates, replicas(4), plans_of)
    assert not placement.scratch and len(placement.targets) == 16 and placement.replicas_for("rare") == ()


def test_a_heavy_tail_gets_scratch_slots_on_several_replicas():
    rates = {f"s{i}": 1.0 for i in range(64)}  # uniform: 15 stable, the 49-key tail carries most requests
    placement = plan_placement(rates, replicas(4), plans_of, miss_cost=2.0)
    assert len(placement.scratch) == 4
    assert SCRATCH not in placement.targets


@pytest.mark.parametrize("load, share, n, load_factor, expected", [
    (10, 10, 4, 1.0, 1), (11, 10, 4, 1.0, 2), (12, 10, 4, 1.25, 1), (13, 10, 4, 1.25, 2), (35, 10, 4, 1.0, 4),
    (100, 10, 4, 1.0, 4), (5, 0, 4, 1.0, 1),
])
def test_copies_for(load, share, n, load_factor, expected):
    assert copies_for(load, share, n, load_factor) == expected


def test_no_rates_or_no_replicas_plan_nothing():
    assert plan_placement({}, replicas(4), plans_of) == Placement()
    assert plan_placement({"a": 0.0}, replicas(4), plans_of) == Placement()
    assert plan_placement({"a": 1.0}, {}, plans_of) == Placement()
