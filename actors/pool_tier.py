"""The node-shared host-cache pool as the plan cache's remote tier (`cache.plan_cache.RemoteTier`).

`PoolRemoteTier(pool: PoolTier, lookup_timeout_s, pin_memory)` adapts `actors.host_cache_pool.PoolTier`:

- keys: per plan key `(plan_key, "blocks")` and `(plan_key, "final")`; the plan key carries the weights
  version (checkpoint fingerprint, refresh generation), so plans of other weights are never found. A
  request's built plans are published as one group `make_group_key(plan_keys, weights_version)`, which is
  what `invalidate(weights_version)` drops.
- values: numpy arrays with the slab's bits (bf16 as uint16 views, `tensor_to_numpy`), so a hit restores
  the rows bit-identically (`numpy_to_tensor`, read-only zero-copy views of the object store).
- lookup: one `PoolTier.lookup` within `lookup_timeout_s`; a timeout, a dead pool or a malformed entry is a
  miss (the cache rebuilds). With `pin_memory` (CUDA) the hit's pages are registered (cudaHostRegister)
  so the cache's copy into the slab runs at pinned speed; they are unregistered at the next lookup.
- publish: `publish_group(plans, ready)` only queues (bounded; dropped when busy). A background thread
  waits for the D2H event, converts and hands the group to the pool, so the response never waits.

`make_pool_remote(config, device)` builds one from `actors.config.PoolConfig` (None when the pool is off or
the process is not inside Ray). Lives in actors/ (imports Ray); `actors/gpu_worker.py` only receives it.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Hashable, Sequence

import numpy as np
import torch

from actors.config import PoolConfig
from actors.host_cache_pool import PoolTier, make_group_key, numpy_to_tensor, tensor_to_numpy
from cache.config import GB
from cache.plan_cache import PlanRows

logger = logging.getLogger(__name__)

BLOCKS, FINAL = "blocks", "final"


def _to_tensor(array: np.ndarray) -> torch.Tensor:
    # tensor_to_numpy turns only bf16 into uint16; nothing else in a plan is uint16.
    return numpy_to_tensor(array, torch.bfloat16 if array.dtype == np.uint16 else None)


class PoolRemoteTier:
    """`RemoteTier` over a node's `PoolTier`. Never raises on pool trouble; see the module docstring."""

    def __init__(self, pool: PoolTier, *, lookup_timeout_s: float = 2.0, pin_memory: bool = False,
                 max_pending_groups: int = 2, flush_timeout_s: float = 30.0):
        self.pool = pool
        self.lookup_timeout_s = float(lookup_timeout_s)
        self.pin_memory = bool(pin_memory)
        self.max_pending_groups = max_pending_groups
        self.flush_timeout_s = flush_timeout_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pool-remote")
        self._lock = threading.Lock()
        self._pending = 0
        self._pinned_keys: list[Hashable] = []
        self.counts = {"lookups": 0, "hit_plans": 0, "miss_plans": 0, "bad_entries": 0,
                       "published_groups": 0, "dropped_groups": 0, "publish_errors": 0, "invalidate_errors": 0}

    # -- lookup -----------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[Hashable]) -> dict[Hashable, PlanRows]:
        keys = list(keys)
        if not keys:
            return {}
        self._unpin()  # the previous hit was copied into the slab synchronously: its pages are free to go
        wanted = [(key, part) for key in keys for part in (BLOCKS, FINAL)]
        try:
            found = self.pool.lookup(wanted, timeout_s=self.lookup_timeout_s, pin_memory=self.pin_memory)
        except Exception as e:  # noqa: BLE001 - PoolTier does not raise; belt and braces: a miss
            logger.debug("pool lookup failed: %r", e)
            found = {}
        if self.pin_memory:
            self._pinned_keys = list(found)
        out: dict[Hashable, PlanRows] = {}
        for key in keys:
            blocks, final = found.get((key, BLOCKS)), found.get((key, FINAL))
            if blocks is None or final is None:
                continue
            m = len(key[1])
            if blocks.ndim != 3 or blocks.shape[1] != m or final.ndim != 2 or final.shape[0] != m:
                self.counts["bad_entries"] += 1
                continue
            out[key] = PlanRows(_to_tensor(blocks), _to_tensor(final))
        self.counts["lookups"] += 1
        self.counts["hit_plans"] += len(out)
        self.counts["miss_plans"] += len(keys) - len(out)
        return out

    def _unpin(self) -> None:
        if self._pinned_keys:
            keys, self._pinned_keys = self._pinned_keys, []
            try:
                self.pool.unpin(keys)
            except Exception as e:  # noqa: BLE001
                logger.debug("pool unpin failed: %r", e)

    # -- publish ----------------------------------------------------------------------------------------

    def publish(self, key: Hashable, rows: PlanRows) -> None:
        self.publish_group({key: rows}, None)

    def publish_group(self, plans: dict[Hashable, PlanRows], ready: Any = None) -> bool:
        """Queue a request's built plans (host tensors, complete once `ready` happened); never blocks.
        False when dropped because earlier groups are still being sent."""
        if not plans:
            return True
        with self._lock:
            if self._pending >= self.max_pending_groups:
                self.counts["dropped_groups"] += 1
                return False
            self._pending += 1
        try:
            self._executor.submit(self._send, dict(plans), ready)
        except RuntimeError:  # executor shut down
            with self._lock:
                self._pending -= 1
            return False
        return True

    def _send(self, plans: dict[Hashable, PlanRows], ready: Any) -> None:
        try:
            if ready is not None:
                ready.synchronize()  # the D2H copies queued on the compute stream have landed
            by_version: dict[Hashable, dict[Hashable, np.ndarray]] = {}
            for key, rows in plans.items():
                entries = by_version.setdefault(key[0], {})
                entries[(key, BLOCKS)] = tensor_to_numpy(rows.blocks)
                entries[(key, FINAL)] = tensor_to_numpy(rows.final)
            for version, entries in by_version.items():
                plan_keys = [k for k, part in entries if part == BLOCKS]
                # Already on our own background thread: send directly (one group in flight at a time).
                if self.pool.publish_now(make_group_key(plan_keys, version), entries):
                    self.counts["published_groups"] += 1
                else:
                    self.counts["dropped_groups"] += 1
        except Exception:  # noqa: BLE001 - background thread: log, never propagate
            self.counts["publish_errors"] += 1
            logger.exception("publishing plans to the node pool failed")
        finally:
            with self._lock:
                self._pending -= 1

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until the groups queued so far reached the pool (tests, weight updates, shutdown)."""
        self._executor.submit(lambda: None).result(timeout=timeout_s or self.flush_timeout_s)

    # -- admin ------------------------------------------------------------------------------------------

    def invalidate(self, weights_version: Hashable = None) -> int:
        """Drop the pool's groups of `weights_version` (all when None), after this worker's queued publishes
        landed (so none of them re-adds an old plan afterwards). Never raises: plans of other weights are
        unreachable anyway (the version is in every key)."""
        try:
            self.flush()
            return self.pool.invalidate(weights_version)
        except Exception as e:  # noqa: BLE001
            self.counts["invalidate_errors"] += 1
            logger.warning("node pool invalidate(%r) failed: %r (old plans stay unreachable)", weights_version, e)
            return 0

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "lookup_timeout_s": self.lookup_timeout_s, "pin_memory": self.pin_memory,
                "pool": dict(self.pool.counts)}

    def close(self) -> None:
        self._unpin()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.pool.close()


def pool_enabled(config: PoolConfig, adaln_mode: str) -> bool:
    """Whether an engine with this config gets a pool: not in resident mode (no plans), only inside Ray."""
    import ray

    if adaln_mode != "online" or config.enabled is False:
        return False
    return ray.is_initialized()


def make_pool_remote(config: PoolConfig, device: torch.device | str, adaln_mode: str = "online",
                     *, namespace: str | None = None) -> PoolRemoteTier | None:
    """The node pool adapter for a worker on `device`, or None when the pool is off (see `pool_enabled`)."""
    if not pool_enabled(config, adaln_mode):
        if config.enabled:
            logger.warning("pool.enabled=true but this process is not inside Ray (or adaln.mode=resident): no pool")
        return None
    kwargs = {"namespace": namespace} if namespace else {}
    pool = PoolTier(int(round(config.capacity_gb * GB)), pools_per_node=config.pools_per_node, **kwargs)
    try:  # start the node's pool actors now (found by name if another worker made them), not on the first lookup
        for index in range(config.pools_per_node):
            pool.actor(index)
    except Exception as e:  # noqa: BLE001 - retried on first use; a missing pool is only a miss
        logger.warning("could not start the node pool yet: %r", e)
    pin = config.pin_memory if config.pin_memory is not None else torch.device(device).type == "cuda"
    logger.info("AdaLN node pool: %s GB over %d pool(s) on node %s, lookup budget %.1f s, pin %s",
                config.capacity_gb, config.pools_per_node, pool.node_id, config.lookup_timeout_s, pin)
    return PoolRemoteTier(pool, lookup_timeout_s=config.lookup_timeout_s, pin_memory=pin)
