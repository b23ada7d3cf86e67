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
    """Which plan sits in which slot: ids, refcounts, the LRU list and the free list (no tensors).

    Verbs (vLLM-like): `lookup(key)` (no side effects), `touch(slot)` (take a reference: a hit), `allocate(key)`
    (a free slot, else the least recently used unreferenced plan's slot, in state BUILDING with one reference),
    `commit(slot)` (BUILDING -> READY, now visible), `abort(slot)` (a failed build gives its slot back, so a retry
    rebuilds), `free(slot)` (drop a reference; at zero a READY plan becomes evictable as the most recently used),
    `evict()`, `invalidate()`. Plain LRU: every decision is a function of the calls' order only (no clock, no
    randomness), so the ranks of a multi-device replica, which see the same requests in the same order, evict
    alike.

    Invariants (checked by `check()`, and on every state change that could break them):
    - free + used == capacity; a free slot has refcount 0 and no key;
    - a slot with refcount > 0 is never evicted (only READY slots with refcount 0 are on the LRU list);
    - a BUILDING slot is never returned by `lookup`;
    - every key maps to exactly one READY or BUILDING slot.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"slab capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._state = [SlotState.FREE] * capacity
        self._refcount = [0] * capacity
        self._key: list[Hashable | None] = [None] * capacity
        self._slot_of: dict[Hashable, int] = {}
        # Free slots, lowest id first (deterministic slot ids: a fresh slab hands out 0, 1, 2, ...).
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        # READY slots with refcount 0, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.num_evicted = 0

    # -- queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def refcount(self, slot: int) -> int:
        return self._refcount[slot]

    def state(self, slot: int) -> SlotState:
        return self._state[slot]

    def key(self, slot: int) -> Hashable | None:
        return self._key[slot]

    def lru_order(self) -> list[int]:
        """Evictable slots, next victim first."""
        return list(self._lru)

    def eviction_order(self) -> list[Hashable]:
        """Keys of the evictable plans, next victim first (referenced and building plans are not evictable).
        Read by the router's report from another thread: one pass over the list, no state change."""
        keys = self._key
        return [keys[s] for s in list(self._lru)]

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
        """Take a reference on a READY slot (a hit): it leaves the LRU list until its last `free`."""
        if self._state[slot] is not SlotState.READY:
            raise RuntimeError(f"touch of slot {slot} in state {self._state[slot].value}")
        self._refcount[slot] += 1
        self._lru.pop(slot, None)

    def allocate(self, key: Hashable) -> int:
        """A slot for `key` in state BUILDING with one reference (a free slot, else evict the next victim)."""
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
        """Drop one reference. At zero a READY slot becomes evictable (the most recently used)."""
        state = self._state[slot]
        if self._refcount[slot] <= 0 or state is SlotState.FREE:
            raise RuntimeError(f"free of slot {slot} with refcount {self._refcount[slot]} ({state.value})")
        if state is SlotState.BUILDING and self._refcount[slot] == 1:
            raise RuntimeError(f"slot {slot} is still building: commit or abort it, do not free it")
        self._refcount[slot] -= 1
        if self._refcount[slot] == 0:
            if state is SlotState.READY:
                self._lru[slot] = None
            elif state is SlotState.DETACHED:
                self._release_to_free(slot)

    def evict(self) -> int:
        """Forget the least recently used unreferenced plan; its slot goes to the free list (returned)."""
        if not self._lru:
            raise SlabFullError(
                f"all {self.capacity} slab slots are held by in-flight requests; retry when one finishes "
                "or raise adaln.gpu_plans"
            )
        slot, _ = self._lru.popitem(last=False)
        assert self._refcount[slot] == 0 and self._state[slot] is SlotState.READY, "evicting a referenced slot"
        del self._slot_of[self._key[slot]]
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
            if self._refcount[slot] == 0:
                self._state[slot] = SlotState.FREE
                self._free.append(slot)
            else:
                self._state[slot] = SlotState.DETACHED
        self._slot_of.clear()
        self._lru.clear()
        self._free.sort(reverse=True)
        self.check()

    def _release_to_free(self, slot: int) -> None:
        self._key[slot] = None
        self._refcount[slot] = 0
        self._state[slot] = SlotState.FREE
        self._lru.pop(slot, None)
        self._free.append(slot)

    def check(self) -> None:
        """Assert every invariant in the class docstring (cheap enough for tests and debug builds)."""
        free = set(self._free)
        assert len(free) == len(self._free), "slot on the free list twice"
        used = [s for s in range(self.capacity) if self._state[s] is not SlotState.FREE]
        assert len(free) + len(used) == self.capacity, "free + used != capacity"
        for slot in range(self.capacity):
            state, ref = self._state[slot], self._refcount[slot]
            if state is SlotState.FREE:
                assert slot in free and ref == 0 and self._key[slot] is None, f"bad free slot {slot}"
            if slot in self._lru:
                assert state is SlotState.READY and ref == 0, f"evictable slot {slot} is {state.value}/ref {ref}"
            if state is SlotState.READY and ref == 0:
                assert slot in self._lru, f"unreferenced READY slot {slot} not evictable"
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
    ):
        self.index = SlotIndex(num_plans)
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
