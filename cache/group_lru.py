"""Group LRU: objects shared by groups, evicted a whole group at a time, least recently used first.

Both plan tiers keep a request's plans as one group: the pinned host tier (`cache.host_tier`, sizes in pages)
and the node pool actor (`actors.host_cache_pool`, sizes in bytes). Eviction is by group, all or nothing,
because a request that misses one plan pays a full rebuild pass anyway: keeping half a group saves nothing.
An object listed by several groups is stored and counted once, and lives while any group lists it.

Bookkeeping only (no tensors, no Ray): values are whatever the tier stores (page numbers, ObjectRefs);
`on_drop(key, value)` hands a dropped object's value back (the host tier returns its pages to the free list).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, Iterable, Mapping, TypeVar

K = TypeVar("K", bound=Hashable)
G = TypeVar("G", bound=Hashable)
V = TypeVar("V")


@dataclass
class _Object(Generic[G, V]):
    value: V
    size: int
    groups: dict[G, None] = field(default_factory=dict)  # insertion-ordered set of the groups listing it


class GroupLRU(Generic[K, G, V]):
    """Objects by key, held by groups; whole groups are evicted, least recently used first.

    Verbs: `lookup(keys)` (stored values; touches their groups), `touch(group)`, `admit(group, sizes, make,
    shared)` (add or extend a group, evicting LRU groups first), `evict()` (the LRU group), `invalidate(where)`.

    Invariants (`check()`):
    - `used == sum(size of stored objects) <= capacity`; an object shared by several groups counts once;
    - every stored object is listed by at least one group, and its `groups` are exactly the groups listing it;
    - every object a group lists is stored (a group is all or nothing);
    - a lookup hit or an admission makes the touched groups the most recently used.
    """

    def __init__(self, capacity: int, on_drop: Callable[[K, V], None] | None = None):
        if capacity < 0:
            raise ValueError(f"capacity={capacity} must be >= 0")
        self.capacity = int(capacity)
        self.used = 0
        self.num_evicted_groups = 0
        self._on_drop = on_drop
        self._objects: dict[K, _Object[G, V]] = {}
        self._groups: OrderedDict[G, dict[K, None]] = OrderedDict()  # LRU first; members in admission order

    def __contains__(self, key: K) -> bool:
        return key in self._objects

    @property
    def num_objects(self) -> int:
        return len(self._objects)

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def group_keys(self) -> list[G]:
        """Stored groups, next victim first."""
        return list(self._groups)

    def keys(self) -> list[K]:
        """The stored objects' keys, in admission order (recency is unchanged)."""
        return list(self._objects)

    def get(self, key: K) -> V:
        """The value of a stored object (KeyError if absent); recency is unchanged."""
        return self._objects[key].value

    def lookup(self, keys: Iterable[K]) -> dict[K, V]:
        """The stored objects among `keys`, in order; a hit makes the groups listing it the most recent."""
        found: dict[K, V] = {}
        for key in keys:
            obj = self._objects.get(key)
            if obj is not None:
                found[key] = obj.value
                for group in obj.groups:
                    self._groups.move_to_end(group)
        return found

    def touch(self, group: G) -> bool:
        """Make a stored group the most recently used; False if it is not stored."""
        if group not in self._groups:
            return False
        self._groups.move_to_end(group)
        return True

    def admit(self, group: G, sizes: Mapping[K, int], make: Callable[[K], V], shared: Iterable[K] = ()) -> bool:
        """Add (or extend) `group` with the objects `sizes` names and with the already stored `shared` keys
        (a `shared` key no longer stored is left out). A key already stored is shared, never replaced; each new
        key's value is `make(key)`, called once room is made (in `sizes` order).

        The group must fit whole: when its members (already stored ones counted once) exceed the capacity,
        nothing changes and False is returned. Otherwise its stored members are referenced first, so making
        room never evicts them, then other groups are evicted, least recently used first, until the new
        objects fit."""
        new = {key: int(size) for key, size in sizes.items() if key not in self._objects}
        kept = dict.fromkeys([*self._groups.get(group, ()), *(k for k in sizes if k not in new),
                              *(k for k in shared if k in self._objects)])
        if sum(self._objects[k].size for k in kept) + sum(new.values()) > self.capacity:
            return False
        members = self._groups.setdefault(group, {})
        self._groups.move_to_end(group)
        for key in kept:
            self._objects[key].groups[group] = None
            members[key] = None
        need = sum(new.values())
        while self.used + need > self.capacity:
            # Terminates: the group fits whole and its stored members are referenced by it.
            self.evict(keep=group)
        for key, size in new.items():
            self._objects[key] = _Object(make(key), size, {group: None})
            self.used += size
            members[key] = None
        return True

    def evict(self, keep: G | None = None) -> G:
        """Drop the least recently used group (other than `keep`); objects no other group lists go."""
        victim = next(g for g in self._groups if g != keep)
        self._drop(victim)
        self.num_evicted_groups += 1
        return victim

    def invalidate(self, where: Callable[[G], bool] | None = None) -> int:
        """Drop every group for which `where(group)` holds (every group when None); returns how many."""
        victims = [g for g in self._groups if where is None or where(g)]
        for group in victims:
            self._drop(group)
        return len(victims)

    def _drop(self, group: G) -> None:
        for key in self._groups.pop(group):
            obj = self._objects[key]
            del obj.groups[group]
            if not obj.groups:
                del self._objects[key]
                self.used -= obj.size
                if self._on_drop is not None:
                    self._on_drop(key, obj.value)

    def check(self) -> None:
        """Assert the invariants in the class docstring."""
        assert self.used == sum(o.size for o in self._objects.values()), "used != sum of sizes"
        assert self.used <= self.capacity, f"used {self.used} > capacity {self.capacity}"
        for group, members in self._groups.items():
            for key in members:
                assert key in self._objects, f"group {group!r} lists missing object {key!r}"
        for key, obj in self._objects.items():
            assert obj.groups, f"object {key!r} belongs to no group"
            assert set(obj.groups) == {g for g, members in self._groups.items() if key in members}, key
