"""The node-shared plan pool: AdaLN plans in Ray's object store, shared by the GPU workers of one node.

Layout:

- bookkeeping is ``cache.group_lru.GroupLRU`` (the host tier's too; pure python): objects keyed by entry key,
  grouped by request, evicted a whole group at a time, least recently used first, under a byte capacity.
- :class:`HostCachePool` - the Ray actor (``num_cpus=0``; ``pools_per_node`` of them per node, named
  ``ditserve-host-cache-pool:<node id>:<index>`` in namespace ``ditserve``). It owns every stored object
  (it ``ray.put``s the arrays itself), so entries outlive the worker that published them, and hands out
  ObjectRefs: a worker on the same node ``ray.get``s them zero-copy (read-only views of shared memory).
- :class:`PoolClient` - the one client, a worker's plan cache's remote tier (``cache.plan_cache.RemoteTier``):
  ``lookup(plan_keys)`` never raises and answers within ``lookup_timeout_s`` (a dead, slow or missing pool
  is a miss); ``publish_group(plans, ready)`` never blocks (one bounded queue, one background thread; when
  it is busy the group is dropped); with ``pin_memory`` a hit's pages are page-locked in place
  (``device.pinned.PinnedMemory.lock``: cudaHostRegister) until the next lookup.

Keys: per plan key (``cache.plan_key.plan_key(timesteps, weights_version)``; hashable, with a ``repr`` stable
across processes) two entries, ``(plan_key, "blocks")`` and ``(plan_key, "final")``. A request's built plans
are one group ``(tuple_of_plan_keys, weights_version)`` (:func:`make_group_key`), which is what
``invalidate(weights_version)`` drops (``invalidate(None)`` drops everything). Values are numpy arrays;
bf16 tensors travel as their uint16 bit patterns (:func:`tensor_to_numpy` / :func:`numpy_to_tensor`), so a
hit restores the slab rows bit-identically.

:func:`make_pool_client` builds the client from ``engine.config.PoolConfig`` (None when the pool is off or
the process is not inside Ray); the Serve worker builds it and hands it to the engine, which never imports
this module.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cache.group_lru import GroupLRU  # pure python: no torch in the pool actor's process

if TYPE_CHECKING:  # torch, the plan cache and the engine config stay out of the pool actor's process
    from cache.plan_cache import PlanRows
    from device.pinned import PinnedMemory
    from engine.config import PoolConfig

logger = logging.getLogger(__name__)

POOL_NAMESPACE = "ditserve"
POOL_NAME_PREFIX = "ditserve-host-cache-pool"

Key = Hashable
GroupKey = Tuple[Tuple[Hashable, ...], Hashable]

def make_group_key(plan_keys: Iterable[Hashable], weights_version: Hashable) -> GroupKey:
    """The group key of one request's plans: (tuple of plan keys, weights version)."""
    return (tuple(plan_keys), weights_version)


def _check_group_key(group_key: Any) -> GroupKey:
    if not (isinstance(group_key, tuple) and len(group_key) == 2 and isinstance(group_key[0], tuple)):
        raise ValueError(
            f"group_key={group_key!r} must be (tuple_of_plan_keys, weights_version); "
            "build it with make_group_key(plan_keys, weights_version)."
        )
    return group_key


def pool_actor_name(node_id: str, index: int) -> str:
    return f"{POOL_NAME_PREFIX}:{node_id}:{index}"


def pool_index(key: Hashable, num_pools: int) -> int:
    """Which of the node's pool actors holds ``key``: a hash of ``repr(key)``, the same in every process."""
    if num_pools <= 1:
        return 0
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % num_pools


# ---------------------------------------------------------------------------------------------------------
# bf16 <-> numpy without losing bits
# ---------------------------------------------------------------------------------------------------------


def tensor_to_numpy(tensor: Any) -> np.ndarray:
    """A CPU tensor as a numpy array with the same bits; bf16 becomes a uint16 view (no copy)."""
    import torch

    if tensor.device.type != "cpu":
        raise ValueError(
            f"tensor on {tensor.device} must be copied to host memory first (tensor.cpu()) before publishing."
        )
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.uint16)
    return tensor.numpy()


def numpy_to_tensor(array: np.ndarray, dtype: Any = None) -> Any:
    """A tensor sharing ``array``'s memory, reinterpreted as ``dtype`` (e.g. torch.bfloat16 for uint16 data).

    Arrays from :meth:`PoolClient.lookup_arrays` are read-only views of shared memory: never write to the tensor.
    """
    import torch

    with warnings.catch_warnings():
        # torch warns that the array is not writable; the tensor is only ever read (copied to the device).
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(array)
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.view(dtype)
    return tensor


# ---------------------------------------------------------------------------------------------------------
# The pool actor
# ---------------------------------------------------------------------------------------------------------


@ray.remote(num_cpus=0)
class HostCachePool:
    """One node-local shard of the host plan tier. See the module docstring.

    The pool owns every object it hands out (it ``ray.put``s published arrays itself), so a published plan
    stays valid when the publishing worker dies; when the pool dies its objects go with it and clients see
    misses. A worker still reading an evicted object keeps it alive through its own reference; the byte
    count covers only what the pool holds.
    """

    def __init__(self, capacity_bytes: int):
        self._lru: GroupLRU[Key, GroupKey, ray.ObjectRef] = GroupLRU(capacity_bytes)
        self._counts = {
            "lookups": 0,
            "hits": 0,
            "misses": 0,
            "publishes": 0,
            "published_bytes": 0,
            "rejected_groups": 0,
            "invalidated_groups": 0,
        }

    async def lookup(self, keys: List[Key]) -> Dict[Key, ray.ObjectRef]:
        """ObjectRefs of the stored keys among ``keys`` (possibly fewer, possibly none)."""
        found = self._lru.lookup(keys)
        self._counts["lookups"] += 1
        self._counts["hits"] += len(found)
        self._counts["misses"] += len(keys) - len(found)
        return found

    async def publish(self, group_key: GroupKey, entries: Dict[Key, Any]) -> bool:
        """Store ``{key: numpy array or ObjectRef of one}`` as (part of) group ``group_key``.

        Returns False when the group is larger than the whole capacity.
        """
        _check_group_key(group_key)
        todo = {k: v for k, v in entries.items() if k not in self._lru}
        arrays: Dict[Key, np.ndarray] = {}
        for key, value in todo.items():
            if isinstance(value, ray.ObjectRef):
                value = await value
            if not isinstance(value, np.ndarray):
                raise ValueError(
                    f"value for {key!r} is a {type(value).__name__}; publish numpy arrays "
                    "(tensor_to_numpy(t) for torch tensors)."
                )
            arrays[key] = value
        if sum(a.nbytes for a in arrays.values()) > self._lru.capacity:  # refused before any ray.put
            self._counts["rejected_groups"] += 1
            return False
        # ray.put copies into memory this actor owns; off the event loop so lookups are not held up.
        loop = asyncio.get_running_loop()
        refs = await loop.run_in_executor(None, _put_all, arrays)
        shared = [k for k in entries if k not in arrays]
        admitted = self._lru.admit(group_key, {k: a.nbytes for k, a in arrays.items()}, refs.__getitem__, shared)
        if admitted:
            self._counts["publishes"] += 1
            self._counts["published_bytes"] += sum(a.nbytes for a in arrays.values())
        else:
            self._counts["rejected_groups"] += 1
        return admitted

    async def invalidate(self, weights_version: Any = None) -> int:
        """Drop the groups of ``weights_version`` (every group when None); returns how many."""
        dropped = self._lru.invalidate(None if weights_version is None else lambda g: g[1] == weights_version)
        self._counts["invalidated_groups"] += dropped
        return dropped

    async def stats(self) -> Dict[str, Any]:
        return {
            "capacity_bytes": self._lru.capacity,
            "used_bytes": self._lru.used,
            "num_groups": self._lru.num_groups,
            "num_objects": self._lru.num_objects,
            "evicted_groups": self._lru.num_evicted_groups,
            **self._counts,
        }

    async def group_keys(self) -> List[GroupKey]:
        """Groups from least to most recently used (for tests and debugging)."""
        return self._lru.group_keys()


def _put_all(arrays: Dict[Key, np.ndarray]) -> Dict[Key, ray.ObjectRef]:
    return {key: ray.put(array) for key, array in arrays.items()}


# ---------------------------------------------------------------------------------------------------------
# Client: the plan cache's remote tier
# ---------------------------------------------------------------------------------------------------------

BLOCKS, FINAL = "blocks", "final"


class PoolClient:
    """A worker's view of its node's pools, as the plan cache's ``RemoteTier``. See the module docstring.

    ``capacity_bytes`` is per node, split evenly over ``pools_per_node`` actors; each entry lives in actor
    ``pool_index(entry_key, pools_per_node)``. Actors are found or created by name on first use and re-created
    after they die. Nothing here raises on pool trouble: lookups miss, publishes are dropped (and counted).

    Threads: ``lookup`` runs on the caller's thread (the engine's); publishes run on one background thread,
    at most ``max_pending_groups`` groups queued or in flight.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        pools_per_node: int = 1,
        node_id: Optional[str] = None,
        namespace: str = POOL_NAMESPACE,
        detached: bool = True,
        lookup_timeout_s: float = 2.0,
        pin_memory: bool = False,
        max_pending_groups: int = 2,
        publish_timeout_s: float = 60.0,
    ):
        if pools_per_node < 1:
            raise ValueError(f"pools_per_node={pools_per_node} must be >= 1.")
        self.capacity_bytes = int(capacity_bytes)
        self.pools_per_node = pools_per_node
        self.node_id = node_id or ray.get_runtime_context().get_node_id()
        self.namespace = namespace
        self.detached = detached
        self.lookup_timeout_s = float(lookup_timeout_s)
        self.pin_memory = bool(pin_memory)
        self.max_pending_groups = max_pending_groups
        self.publish_timeout_s = publish_timeout_s
        self._actors: Dict[int, Any] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pool-publish")
        self._pending = 0
        self._pins: Optional[PinnedMemory] = None  # made on the first pinned lookup (torch stays lazy)
        self._pinned: Dict[Key, Any] = {}  # entry key -> locked tensor (a view keeping its array alive)
        self.counts = {
            "lookups": 0, "hit_plans": 0, "miss_plans": 0, "bad_entries": 0, "lookup_failures": 0,
            "published_groups": 0, "dropped_groups": 0, "publish_failures": 0, "invalidate_errors": 0,
            "actors_created": 0,
        }

    # -- actors ---------------------------------------------------------------------------------------------

    def actor(self, index: int) -> Any:
        """The pool actor ``index`` of this node, found by name or created."""
        with self._lock:
            handle = self._actors.get(index)
            if handle is None:
                options: Dict[str, Any] = dict(
                    name=pool_actor_name(self.node_id, index),
                    namespace=self.namespace,
                    get_if_exists=True,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=False),
                )
                if self.detached:
                    options["lifetime"] = "detached"
                per_pool = self.capacity_bytes // self.pools_per_node
                handle = HostCachePool.options(**options).remote(per_pool)
                self._actors[index] = handle
                self.counts["actors_created"] += 1
            return handle

    def _forget_actor(self, index: int, handle: Any) -> None:
        with self._lock:
            if self._actors.get(index) is handle:
                del self._actors[index]

    def _by_pool(self, keys: Iterable[Key]) -> Dict[int, List[Key]]:
        shards: Dict[int, List[Key]] = {}
        for key in keys:
            shards.setdefault(pool_index(key, self.pools_per_node), []).append(key)
        return shards

    # -- lookup (RemoteTier) ----------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[Hashable]) -> Dict[Hashable, PlanRows]:
        """``{plan_key: PlanRows}`` for the plans the pool holds among ``keys``; never raises. The rows are
        read-only views of shared memory (pinned with ``pin_memory`` until the next lookup): copy, never write."""
        from cache.plan_cache import PlanRows  # here, not at the top: the pool actor's process loads this module

        keys = list(keys)
        if not keys:
            return {}
        self.unpin()  # the previous hit was copied into the slab synchronously: its pages are free to go
        wanted = [(key, part) for key in keys for part in (BLOCKS, FINAL)]
        try:
            found = self.lookup_arrays(wanted, self.lookup_timeout_s)
        except Exception as e:  # noqa: BLE001 - lookup_arrays does not raise; belt and braces: a miss
            self.counts["lookup_failures"] += 1
            logger.debug("pool lookup failed: %r", e)
            found = {}
        out: Dict[Hashable, PlanRows] = {}
        for key in keys:
            blocks, final = found.get((key, BLOCKS)), found.get((key, FINAL))
            if blocks is None or final is None:
                continue
            m = len(key[1])  # a plan key is (weights_version, fp32 bits of its M timesteps): M rows
            if blocks.ndim != 3 or blocks.shape[1] != m or final.ndim != 2 or final.shape[0] != m:
                self.counts["bad_entries"] += 1
                continue
            out[key] = PlanRows(_plan_tensor(blocks), _plan_tensor(final))
        self.counts["lookups"] += 1
        self.counts["hit_plans"] += len(out)
        self.counts["miss_plans"] += len(keys) - len(out)
        return out

    def lookup_arrays(self, keys: Iterable[Key], timeout_s: float) -> Dict[Key, np.ndarray]:
        """Arrays for the stored entries among ``keys``; {} for those the pool lacks, is too slow to return
        (``timeout_s`` for the whole call) or cannot reach. Blocking: call from sync code (not an event loop).
        With ``pin_memory`` the arrays' pages are registered with CUDA until :meth:`unpin`."""
        deadline = time.monotonic() + timeout_s
        calls = []
        for index, shard in self._by_pool(keys).items():
            try:
                handle = self.actor(index)
                calls.append((index, handle, handle.lookup.remote(shard)))
            except Exception:  # noqa: BLE001 - a pool that cannot be created is a miss
                self.counts["lookup_failures"] += 1
        refs: Dict[Key, ray.ObjectRef] = {}
        for index, handle, call in calls:
            try:
                refs.update(ray.get(call, timeout=max(0.0, deadline - time.monotonic())))
            except Exception as e:  # noqa: BLE001
                self._note_failure(index, handle, e)
        if not refs:
            return {}
        try:
            values = ray.get(list(refs.values()), timeout=max(0.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - e.g. the owning pool died after answering
            self.counts["lookup_failures"] += 1
            logger.debug("pool lookup: fetching objects failed: %r", e)
            return {}
        found = dict(zip(refs.keys(), values))
        return self._pin(found) if self.pin_memory else found

    def _note_failure(self, index: int, handle: Any, error: BaseException) -> None:
        self.counts["lookup_failures"] += 1
        if isinstance(error, RayActorError):
            # The pool died: forget the handle so the next use finds or creates a live one.
            self._forget_actor(index, handle)
        elif not isinstance(error, GetTimeoutError):
            logger.debug("pool %d lookup failed: %r", index, error)

    # -- publish (RemoteTier) ---------------------------------------------------------------------------------

    def publish_group(self, plans: Mapping[Hashable, PlanRows], ready: Any = None) -> bool:
        """Queue a request's built plans (``{plan_key: PlanRows}`` of host tensors, complete once the event
        ``ready`` happened); never blocks. False when dropped because earlier groups are still being sent."""
        if not plans:
            return True
        with self._lock:
            if self._pending >= self.max_pending_groups:
                self.counts["dropped_groups"] += 1
                return False
            self._pending += 1
        try:
            self._executor.submit(self._send_group, dict(plans), ready)
        except RuntimeError:  # executor shut down (closed)
            with self._lock:
                self._pending -= 1
            return False
        return True

    def _send_group(self, plans: Dict[Hashable, PlanRows], ready: Any) -> None:
        try:
            if ready is not None:
                ready.synchronize()  # the D2H copies queued on the compute stream have landed
            by_version: Dict[Hashable, Dict[Key, np.ndarray]] = {}
            for key, rows in plans.items():
                entries = by_version.setdefault(key[0], {})
                entries[(key, BLOCKS)] = tensor_to_numpy(rows.blocks)
                entries[(key, FINAL)] = tensor_to_numpy(rows.final)
            for version, entries in by_version.items():
                plan_keys = [k for k, part in entries if part == BLOCKS]
                if self.publish_arrays(make_group_key(plan_keys, version), entries):
                    self.counts["published_groups"] += 1
                else:
                    self.counts["dropped_groups"] += 1
        except Exception:  # noqa: BLE001 - background thread: log, never propagate
            self.counts["publish_failures"] += 1
            logger.exception("publishing plans to the node pool failed")
        finally:
            with self._lock:
                self._pending -= 1

    def publish_arrays(self, group_key: GroupKey, entries: Mapping[Key, np.ndarray]) -> bool:
        """Send ``{entry_key: numpy array}`` to the pool as (part of) ``group_key`` and wait. True when every
        pool actor took its share; a dead actor is forgotten and recreated on next use. The background thread
        calls it; tests may call it directly."""
        _check_group_key(group_key)
        ok = True
        for index, shard in self._by_pool(entries).items():
            handle = self.actor(index)
            try:
                ray.get(handle.publish.remote(group_key, {k: entries[k] for k in shard}),
                        timeout=self.publish_timeout_s)
            except RayActorError:
                ok = False
                self.counts["publish_failures"] += 1
                self._forget_actor(index, handle)
            except RayError as e:
                ok = False
                self.counts["publish_failures"] += 1
                logger.debug("pool %d publish failed: %r", index, e)
        return ok

    def flush(self, timeout_s: Optional[float] = None) -> None:
        """Wait until the groups queued so far reached the pool (tests, weight updates)."""
        self._executor.submit(lambda: None).result(timeout=timeout_s or self.publish_timeout_s)

    # -- admin ----------------------------------------------------------------------------------------------

    def invalidate(self, weights_version: Any = None, timeout_s: float = 10.0) -> int:
        """Drop the groups of ``weights_version`` (all when None) on every pool of this node, after this
        client's queued publishes landed (so none re-adds an old plan afterwards). Never raises: plans of other
        weights are unreachable anyway (the version is in every key)."""
        dropped = 0
        try:
            self.flush()
            for index in range(self.pools_per_node):
                handle = self.actor(index)
                try:
                    dropped += ray.get(handle.invalidate.remote(weights_version), timeout=timeout_s)
                except RayActorError:
                    self._forget_actor(index, handle)
        except Exception as e:  # noqa: BLE001
            self.counts["invalidate_errors"] += 1
            logger.warning("node pool invalidate(%r) failed: %r (old plans stay unreachable)", weights_version, e)
        return dropped

    def pool_stats(self, timeout_s: float = 5.0) -> List[Dict[str, Any]]:
        """Per-pool stats of this node (an empty dict for a pool that does not answer)."""
        out = []
        for index in range(self.pools_per_node):
            handle = self.actor(index)
            try:
                out.append(ray.get(handle.stats.remote(), timeout=timeout_s))
            except RayActorError:
                self._forget_actor(index, handle)
                out.append({})
            except GetTimeoutError:
                out.append({})
        return out

    def stats(self) -> Dict[str, Any]:
        """This client's counters (no pool round trip)."""
        pinned_bytes = self._pins.pinned_bytes if self._pins is not None else 0
        return {**self.counts, "lookup_timeout_s": self.lookup_timeout_s, "pin_memory": self.pin_memory,
                "pinned_bytes": pinned_bytes}

    # -- pinned pages: page-locked in place through the device layer --------------------------------------

    def _pin(self, found: Dict[Key, np.ndarray]) -> Dict[Key, np.ndarray]:
        if self._pins is None:
            from device.pinned import PinnedMemory
            from device.streams import make_device

            self._pins = PinnedMemory(make_device(None), owner="node pool hits")
        for key, array in found.items():
            if key in self._pinned or array.nbytes == 0:
                continue
            tensor = numpy_to_tensor(array)  # shares the array's memory and keeps its mapping alive
            try:
                self._pins.lock(tensor)
            except RuntimeError as e:  # PinError: refused; the hit is still good, copied at pageable speed
                logger.debug("pool hit %r not pinned: %s", key, e)
                continue
            self._pinned[key] = tensor
        return found

    def unpin(self) -> None:
        """Unlock every page pinned by the last lookup (its rows were copied into the slab synchronously)."""
        pinned, self._pinned = self._pinned, {}
        for tensor in pinned.values():
            self._pins.unlock(tensor)

    def close(self) -> None:
        self.unpin()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _plan_tensor(array: np.ndarray) -> Any:
    # tensor_to_numpy turns only bf16 into uint16; nothing else in a plan is uint16.
    import torch

    return numpy_to_tensor(array, torch.bfloat16 if array.dtype == np.uint16 else None)


def pool_enabled(config: PoolConfig, adaln_mode: str) -> bool:
    """Whether an engine with this config gets a pool: not in resident mode (no plans), not when disabled,
    only inside Ray (there is no object store without it)."""
    if adaln_mode != "online" or config.enabled is False:
        return False
    return ray.is_initialized()


def make_pool_client(config: PoolConfig, device: Any, adaln_mode: str = "online", *,
                     namespace: str = POOL_NAMESPACE) -> Optional[PoolClient]:
    """The node pool client for a worker on ``device`` (a torch device or its name), or None when the pool is
    off (see :func:`pool_enabled`)."""
    import torch

    from cache.config import GB

    if not pool_enabled(config, adaln_mode):
        if config.enabled:
            logger.warning("pool.enabled=true but this process is not inside Ray (or adaln.mode=resident): no pool")
        return None
    pin = config.pin_memory if config.pin_memory is not None else torch.device(device).type == "cuda"
    client = PoolClient(int(round(config.capacity_gb * GB)), pools_per_node=config.pools_per_node,
                        namespace=namespace, lookup_timeout_s=config.lookup_timeout_s, pin_memory=pin)
    try:  # start the node's pool actors now (found by name if another worker made them), not on the first lookup
        for index in range(config.pools_per_node):
            client.actor(index)
    except Exception as e:  # noqa: BLE001 - retried on first use; a missing pool is only a miss
        logger.warning("could not start the node pool yet: %r", e)
    logger.info("AdaLN node pool: %s GB over %d pool(s) on node %s, lookup budget %.1f s, pin %s",
                config.capacity_gb, config.pools_per_node, client.node_id, config.lookup_timeout_s, pin)
    return client
