"""GPU plan slab: the device buffers plans live in (`PlanSlab`) and their bookkeeping (`SlotIndex`).

A slot holds one plan: `plan_width` rows of every block's modulation plus the final layer's. The buffers are
allocated once, so pointers never move (CUDA-graph safe); the forward reaches rows through a device int
tensor of row ids, never through Python ints.
"""

from __future__ import annotations

from collections import OrderedDict
from enum import Enum
from typing import Hashable, Iterable, Sequence

import torch


class SlabFullError(RuntimeError):
    """Every slot the request could use is held by in-flight requests (retry after they finish)."""


class SlotState(Enum):
    FREE = "free"            # no plan; on the free list
    BUILDING = "building"    # owns a key but is invisible to lookup until commit
    READY = "ready"          # visible; on the LRU list while refcount == 0
    DETACHED = "detached"    # invalidated while in use: no key; back to the free list on its last free


class SlotIndex:
    """Which plan sits in which slot: ids, refcounts, the eviction order and the free list (no tensors).

    Verbs (vLLM-like): `lookup(key)` (no side effects), `touch(slot)` (take a reference: a hit, which also
    promotes the plan, see below), `allocate(key)` (a free slot, else the next victim's slot, in state BUILDING
    with one reference), `commit(slot)` (BUILDING -> READY, now visible), `abort(slot)` (a failed build gives
    its slot back, so a retry rebuilds), `free(slot)` (drop a reference; at zero a READY plan becomes evictable
    at the most recently used end of its segment), `evict()`, `invalidate()`.

    Eviction is scan-resistant (segmented LRU, like SLRU / 2Q): a plan not known to be popular is admitted into
    the *probation* segment; a hit by a later request promotes it to the *protected* segment, which holds at
    most `protected_slots` plans (its least recently used ones are demoted to probation's most recent end).
    Victims come from probation first (least recently used first), protected only when probation has nothing
    unreferenced. So a schedule requested once evicts other one-off plans, not the plans requested again. A
    plan is known to be popular when it was evicted within the last `history` evictions (a ghost list of keys,
    no data): it is admitted straight into protected, as if it had been hit in probation. `protected_slots=0`
    is plain LRU. Every decision is a function of the calls' order only (no clock, no randomness), so the
    ranks of a multi-device replica, which see the same requests in the same order, evict alike.

    Invariants (checked by `check()`, and on every state change that could break them):
    - free + used == capacity; a free slot has refcount 0 and no key;
    - a slot with refcount > 0 is never evicted (only READY slots with refcount 0 are evictable, each in the
      list of its segment);
    - a BUILDING slot is never returned by `lookup`;
    - every key maps to exactly one READY or BUILDING slot;
    - protected plans exceed `protected_slots` only while the excess is referenced (demoted on its last free).
    """

    def __init__(self, capacity: int, protected_slots: int = 0, history: int | None = None):
        if capacity < 1:
            raise ValueError(f"slab capacity must be >= 1, got {capacity}")
        if not 0 <= protected_slots <= capacity:
            raise ValueError(f"protected_slots={protected_slots} must be within 0..{capacity}")
        self.capacity = capacity
        self.protected_slots = protected_slots
        # Evicted keys remembered (default: as many as the slab holds); none under plain LRU.
        self.history = (capacity if history is None else history) if protected_slots else 0
        self._state = [SlotState.FREE] * capacity
        self._refcount = [0] * capacity
        self._key: list[Hashable | None] = [None] * capacity
        self._protected = [False] * capacity  # segment of a READY/BUILDING/DETACHED slot
        self._num_protected = 0  # READY or BUILDING slots in the protected segment, referenced or not
        self._slot_of: dict[Hashable, int] = {}
        # Free slots, lowest id first (deterministic slot ids: a fresh slab hands out 0, 1, 2, ...).
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        # READY slots with refcount 0 per segment, least recently used first.
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected_lru: OrderedDict[int, None] = OrderedDict()
        self._ghosts: OrderedDict[Hashable, None] = OrderedDict()  # evicted keys, oldest first
        self.num_evicted = 0

    # -- queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._probation) + len(self._protected_lru)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def num_protected(self) -> int:
        return self._num_protected

    def refcount(self, slot: int) -> int:
        return self._refcount[slot]

    def state(self, slot: int) -> SlotState:
        return self._state[slot]

    def key(self, slot: int) -> Hashable | None:
        return self._key[slot]

    def is_protected(self, slot: int) -> bool:
        return self._state[slot] is not SlotState.FREE and self._protected[slot]

    def lru_order(self) -> list[int]:
        """Evictable slots, next victim first (probation, then protected)."""
        return [*self._probation, *self._protected_lru]

    def eviction_order(self) -> list[Hashable]:
        """Keys of the evictable plans, next victim first (referenced and building plans are not evictable).
        Read by the router's report from another thread: one pass over each list, no state change."""
        keys = self._key
        return [keys[s] for s in [*self._probation, *self._protected_lru]]

    def lookup(self, key: Hashable) -> int | None:
        """The READY slot holding `key`, or None (BUILDING slots are invisible)."""
        slot = self._slot_of.get(key)
        if slot is None or self._state[slot] is not SlotState.READY:
            return None
        return slot

    # -- the SlabHolder view (engine.served): what the router's report asks
    @property
    def capacity_plans(self) -> int:
        return self.capacity

    @property
    def num_free_plans(self) -> int:
        return len(self._free)

    def holds(self, keys: Sequence[Hashable]) -> bool:
        """Whether every plan in `keys` is READY now (a request for them would hit)."""
        return all(self.lookup(key) is not None for key in keys)

    # -- state changes
    def touch(self, slot: int) -> None:
        """Take a reference on a READY slot (a hit): it leaves the eviction lists until its last `free`, and a
        probation plan is promoted (this is a later request for it)."""
        if self._state[slot] is not SlotState.READY:
            raise RuntimeError(f"touch of slot {slot} in state {self._state[slot].value}")
        self._refcount[slot] += 1
        self._probation.pop(slot, None)
        self._protected_lru.pop(slot, None)
        if not self._protected[slot]:
            self._protected[slot] = True
            self._num_protected += 1
        self._demote_excess()

    def allocate(self, key: Hashable) -> int:
        """A slot for `key` in state BUILDING with one reference (a free slot, else evict the next victim); in
        probation unless `key` was evicted recently (then protected)."""
        if key in self._slot_of:
            raise RuntimeError(f"plan {key!r} already has slot {self._slot_of[key]}")
        if not self._free:
            self.evict()
        slot = self._free.pop()
        assert self._refcount[slot] == 0 and self._key[slot] is None, "free slot with a reference or key"
        self._state[slot] = SlotState.BUILDING
        self._refcount[slot] = 1
        self._key[slot] = key
        self._slot_of[key] = slot
        known = key in self._ghosts  # evicted lately and requested again: within the window
        if known:
            del self._ghosts[key]
        self._protected[slot] = known
        self._num_protected += known
        self._demote_excess()
        return slot

    def commit(self, slot: int) -> None:
        """Publish a fully written slot: lookups see it from now on."""
        if self._state[slot] is not SlotState.BUILDING:
            raise RuntimeError(f"commit of slot {slot} in state {self._state[slot].value}")
        self._state[slot] = SlotState.READY

    def abort(self, slot: int) -> None:
        """Give back a slot whose build failed; its key is forgotten so a retry rebuilds."""
        if self._state[slot] is not SlotState.BUILDING:
            raise RuntimeError(f"abort of slot {slot} in state {self._state[slot].value}")
        del self._slot_of[self._key[slot]]
        self._release_to_free(slot)

    def free(self, slot: int) -> None:
        """Drop one reference. At zero a READY slot becomes evictable (most recently used of its segment)."""
        state = self._state[slot]
        if self._refcount[slot] <= 0 or state is SlotState.FREE:
            raise RuntimeError(f"free of slot {slot} with refcount {self._refcount[slot]} ({state.value})")
        if state is SlotState.BUILDING and self._refcount[slot] == 1:
            raise RuntimeError(f"slot {slot} is still building: commit or abort it, do not free it")
        self._refcount[slot] -= 1
        if self._refcount[slot] == 0:
            if state is SlotState.READY:
                (self._protected_lru if self._protected[slot] else self._probation)[slot] = None
                self._demote_excess()
            elif state is SlotState.DETACHED:
                self._release_to_free(slot)

    def evict(self) -> int:
        """Forget the next victim (probation's least recently used unreferenced plan, else protected's); its
        slot goes to the free list (returned) and its key to the ghost list."""
        segment = self._probation or self._protected_lru
        if not segment:
            raise SlabFullError(
                f"all {self.capacity} slab slots are held by in-flight requests; retry when one finishes "
                "or raise adaln.gpu_plans"
            )
        slot, _ = segment.popitem(last=False)
        assert self._refcount[slot] == 0 and self._state[slot] is SlotState.READY, "evicting a referenced slot"
        key = self._key[slot]
        del self._slot_of[key]
        if self.history:
            self._ghosts[key] = None
            while len(self._ghosts) > self.history:
                self._ghosts.popitem(last=False)
        self._release_to_free(slot)
        self.num_evicted += 1
        return slot

    def invalidate(self) -> None:
        """Forget every plan. Slots still referenced become DETACHED (freed on their last `free`)."""
        for slot in range(self.capacity):
            state = self._state[slot]
            if state is SlotState.FREE or state is SlotState.DETACHED:
                continue
            self._key[slot] = None
            if self._protected[slot]:
                self._protected[slot] = False
                self._num_protected -= 1
            if self._refcount[slot] == 0:
                self._state[slot] = SlotState.FREE
                self._free.append(slot)
            else:
                self._state[slot] = SlotState.DETACHED
        self._slot_of.clear()
        self._probation.clear()
        self._protected_lru.clear()
        self._ghosts.clear()
        self._free.sort(reverse=True)
        self.check()

    def _demote_excess(self) -> None:
        """Protected over its size: its least recently used unreferenced plans go to probation's recent end."""
        while self._num_protected > self.protected_slots and self._protected_lru:
            slot, _ = self._protected_lru.popitem(last=False)
            self._protected[slot] = False
            self._num_protected -= 1
            self._probation[slot] = None

    def _release_to_free(self, slot: int) -> None:
        if self._protected[slot]:  # never set on a DETACHED slot (invalidate clears it)
            self._num_protected -= 1
        self._protected[slot] = False
        self._key[slot] = None
        self._refcount[slot] = 0
        self._state[slot] = SlotState.FREE
        self._probation.pop(slot, None)
        self._protected_lru.pop(slot, None)
        self._free.append(slot)

    def check(self) -> None:
        """Assert every invariant in the class docstring (cheap enough for tests and debug builds)."""
        free = set(self._free)
        assert len(free) == len(self._free), "slot on the free list twice"
        used = [s for s in range(self.capacity) if self._state[s] is not SlotState.FREE]
        assert len(free) + len(used) == self.capacity, "free + used != capacity"
        assert not set(self._probation) & set(self._protected_lru), "slot in both segments"
        live = [s for s in range(self.capacity) if self._state[s] in (SlotState.READY, SlotState.BUILDING)]
        assert self._num_protected == sum(self._protected[s] for s in live), "protected count drifted"
        for slot in range(self.capacity):
            state, ref = self._state[slot], self._refcount[slot]
            if state is SlotState.FREE:
                assert slot in free and ref == 0 and self._key[slot] is None, f"bad free slot {slot}"
                assert not self._protected[slot], f"free slot {slot} marked protected"
            evictable = self._protected_lru if self._protected[slot] else self._probation
            if slot in self._probation or slot in self._protected_lru:
                assert state is SlotState.READY and ref == 0, f"evictable slot {slot} is {state.value}/ref {ref}"
            if state is SlotState.READY and ref == 0:
                assert slot in evictable, f"unreferenced READY slot {slot} not evictable in its segment"
        if self._protected_lru:
            assert self._num_protected <= self.protected_slots, "unreferenced protected plans over the size"
        for key, slot in self._slot_of.items():
            assert self._key[slot] == key and self._state[slot] in (SlotState.READY, SlotState.BUILDING)


class PlanSlab:
    """Device buffers for `num_plans` plans of up to `plan_width` rows each, plus their `SlotIndex`.

    `blocks`: [num_blocks, num_plans * plan_width, adaln_width], `final`: [num_plans * plan_width,
    final_width], both in the model dtype, allocated once. Slot `s` owns rows `s*plan_width ..
    s*plan_width + plan_width - 1`; a plan of M timesteps uses the first M.
    """

    def __init__(
        self,
        *,
        num_plans: int,
        plan_width: int,
        num_blocks: int,
        adaln_width: int,
        final_width: int,
        dtype: torch.dtype,
        device: torch.device | str,
        protected_plans: int = 0,
    ):
        self.index = SlotIndex(num_plans, protected_slots=protected_plans)
        self.plan_width = plan_width
        self.device = torch.device(device)
        rows = num_plans * plan_width
        # Stored row-major ([rows, num_blocks, adaln_width]) and exposed as a [num_blocks, rows, adaln_width]
        # view: one (plan, timestep) row is then contiguous, so a host-tier page moves in one copy instead
        # of num_blocks strided pieces (44 -> ~55 GB/s on the H200), while per-block writes stay simple.
        self._row_major = torch.empty(rows, num_blocks, adaln_width, dtype=dtype, device=self.device)
        self.blocks = self._row_major.transpose(0, 1)
        self.final = torch.empty(rows, final_width, dtype=dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.final.nbytes

    def first_row(self, slot: int) -> int:
        return slot * self.plan_width

    def row_ids(self, slot_widths: Iterable[tuple[int, int]]) -> list[int]:
        """Slab rows of `(slot, M)` pairs, concatenated in order."""
        rows: list[int] = []
        for slot, width in slot_widths:
            if not 0 < width <= self.plan_width:
                raise ValueError(f"plan of {width} rows does not fit a slot of {self.plan_width}")
            start = self.first_row(slot)
            rows.extend(range(start, start + width))
        return rows
