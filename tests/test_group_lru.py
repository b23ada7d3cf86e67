"""The group LRU both plan tiers keep (the pinned host tier in pages, the node pool actor in bytes):
whole groups evicted least recently used first, shared objects stored once, a group all or nothing."""

import pytest

from cache.group_lru import GroupLRU


def lru_of(capacity: int) -> tuple[GroupLRU, list]:
    dropped: list = []
    return GroupLRU(capacity, on_drop=lambda key, value: dropped.append((key, value))), dropped


def admit(lru: GroupLRU, group, sizes: dict, shared=()) -> bool:
    """Admit with each new object's value = its key upper-cased (what `make` returns)."""
    return lru.admit(group, sizes, lambda key: key.upper(), shared)


def test_evicts_the_least_recently_used_group():
    lru, dropped = lru_of(300)
    for name in "abc":
        assert admit(lru, ((name,), 0), {name: 100})
    assert lru.lookup(["a"]) == {"a": "A"}  # a becomes most recent: order is b, c, a
    assert admit(lru, (("d",), 0), {"d": 100})
    assert lru.group_keys() == [(("c",), 0), (("a",), 0), (("d",), 0)]  # b was least recently used
    assert "b" not in lru and lru.used == 300 and lru.num_evicted_groups == 1
    assert dropped == [("b", "B")]  # the dropped object's value is handed back (the host tier's pages)
    lru.check()


def test_shares_objects_between_groups_and_counts_them_once():
    lru, dropped = lru_of(300)
    assert admit(lru, (("x", "y"), 0), {"x": 100, "y": 100})
    assert admit(lru, (("y", "z"), 0), {"z": 100}, shared=["y"])
    assert lru.used == 300
    lru.evict()  # the first group goes; y is still listed by the second
    assert "x" not in lru and "y" in lru and dropped == [("x", "X")]
    lru.check()
    assert lru.invalidate() == 1 and lru.used == 0 and lru.num_objects == 0


def test_a_key_already_stored_is_shared_not_replaced():
    lru, _ = lru_of(300)
    assert admit(lru, "g1", {"a": 100})
    assert lru.admit("g2", {"a": 100, "b": 100}, lambda key: "new " + key)
    assert lru.get("a") == "A" and lru.get("b") == "new b" and lru.used == 200
    lru.check()


def test_rejects_a_group_larger_than_the_capacity():
    lru, _ = lru_of(100)
    assert admit(lru, (("a",), 0), {"a": 60})
    assert not admit(lru, (("big",), 0), {"big": 101})
    assert lru.group_keys() == [(("a",), 0)]  # nothing evicted for a group that can never fit
    lru.check()


def test_a_group_counts_its_shared_members_when_checking_that_it_fits():
    lru, _ = lru_of(300)
    assert admit(lru, "g1", {"a": 200})
    # 150 new bytes fit alone, but the group also lists a (200): 350 > 300, it could never be whole.
    assert not admit(lru, "g2", {"b": 150}, shared=["a"])
    assert lru.group_keys() == ["g1"] and "b" not in lru
    lru.check()


def test_making_room_never_evicts_the_groups_own_shared_members():
    lru, _ = lru_of(300)
    assert admit(lru, "g1", {"a": 100, "b": 100})
    assert admit(lru, "g2", {"c": 100})
    # g3 = {b, d, e} needs 200 new: evict g1 (LRU) then g2; b survives because g3 references it first.
    assert admit(lru, "g3", {"d": 100, "e": 100}, shared=["b"])
    assert lru.group_keys() == ["g3"] and lru.num_evicted_groups == 2
    assert "b" in lru and "a" not in lru and "c" not in lru
    lru.check()


def test_a_group_can_be_extended_and_is_never_its_own_victim():
    lru, _ = lru_of(300)
    assert admit(lru, "g1", {"a": 100})
    assert admit(lru, "g2", {"b": 100})
    assert admit(lru, "g1", {"c": 100})  # extends g1 (now the most recent)
    assert admit(lru, "g1", {"d": 100})  # room comes from g2, never from g1's own members
    assert lru.group_keys() == ["g1"] and {k for k in "acd" if k in lru} == set("acd")
    assert not admit(lru, "g1", {"e": 1})  # g1 whole would be 301 > 300
    lru.check()


def test_lookup_touches_the_groups_of_its_hits_in_key_order():
    lru, _ = lru_of(1000)
    for group, key in [("g1", "a"), ("g2", "b"), ("g3", "c")]:
        admit(lru, group, {key: 10})
    assert lru.lookup(["b", "x", "a"]) == {"b": "B", "a": "A"}
    assert lru.group_keys() == ["g3", "g2", "g1"]
    assert lru.touch("g3") and not lru.touch("nope")
    assert lru.group_keys() == ["g2", "g1", "g3"]


def test_invalidates_the_groups_a_predicate_selects():
    lru, dropped = lru_of(1000)
    admit(lru, (("a",), "v1"), {"a": 10})
    admit(lru, (("b",), "v2"), {"b": 10})
    assert lru.invalidate(lambda group: group[1] == "v1") == 1
    assert lru.group_keys() == [(("b",), "v2")] and dropped == [("a", "A")]
    assert lru.num_evicted_groups == 0  # invalidation is not eviction
    lru.check()


def test_zero_capacity_stores_nothing_and_negative_is_an_error():
    lru, _ = lru_of(0)
    assert not admit(lru, "g", {"a": 1}) and lru.num_groups == 0
    with pytest.raises(ValueError, match="capacity=-1"):
        GroupLRU(-1)
