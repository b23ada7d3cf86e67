"""The tier walk a request sees: GPU slab -> pinned host tier -> (remote pool seam) -> streaming rebuild.

The engine calls, per request (both modes have the same interface, so it treats them alike):

    provider = make_adaln_provider(config, model, reader, device)    # PlanCache or ResidentModulation
    prepared = provider.prepare(schedule.plans)                      # admission, lookup, rebuild; refcounts
    try:
        for i in range(steps): model(..., modulation=prepared.modulation(i))
    finally:
        prepared.release()                                           # idempotent; also on cancel
    prepared.stats / provider.stats                                  # per request / cumulative

and around a weight update: `provider.validate_weight_update_source(path)` before writing any weight,
`provider.refresh_weight_derived_caches(path)` after.

In a multi-device replica every rank holds a `PlanCache` and sees the same requests in the same order; with
`shards` (`RebuildShards`) a miss is rebuilt 1/N per rank (each rank streams and projects only its share of the
AdaLN units, then the rows are exchanged), so the ranks together read the checkpoint once.

`model` is what the cache asks about the AdaLN projections (`model.adaln.AdalnModel`: shapes, unit names
`transformer_blocks.{i}.adaln_proj.linear` and `norm_out.linear`, the projection input, the resident projection):
diffusers' `MiniMaxH3Transformer3DModel`, seen through `model.adaln.H3Adaln`. `reader` locates the projections'
bytes (`AdalnWeights`: a `model.weights.TransformerWeights` of either checkpoint layout).

Not thread-safe: one engine thread drives a provider.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Hashable, Protocol, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from cache.config import AdalnConfig
from cache.host_tier import HostTier
from cache.plan_key import PlanKey, check_plan, plan_key
from cache.projection import prepare_weight, project, projection_guard
from cache.rebuild import (
    AdalnRebuilder, AdalnUnit, RebuildError, RebuildReport, RebuildTarget, TensorLocator, resolve_adaln_units,
)
from cache.slab import PlanSlab, SlabFullError
from device.pinned import PinnedMemory
from device.streams import Device, Event, make_device
from model.adaln import AdalnModel, H3Adaln, Modulation

logger = logging.getLogger(__name__)

__all__ = [
    "AdalnStats", "AdalnWeights", "AdmissionError", "WeightUpdateError", "SlabFullError", "RemoteTier", "PlanRows",
    "PlanCache", "PreparedPlans", "RebuildShards", "ResidentModulation", "ResidentPlans", "make_adaln_provider",
]


class AdmissionError(ValueError):
    """A request the cache can never serve as configured; the message names the setting to raise."""


class WeightUpdateError(ValueError):
    """A weight update the AdaLN cache cannot stay coherent under; raised before anything is written."""


class AdalnStats(BaseModel):
    """Plan cache counters, per request (`PreparedPlans.stats`) or cumulative (`provider.stats`)."""

    model_config = ConfigDict(validate_assignment=False)

    requests: int = Field(0, description="Requests prepared.")
    gpu_hit_plans: int = Field(0, description="Distinct plans found ready in the GPU slab.")
    host_hit_plans: int = Field(0, description="Plans restored from the pinned host tier (H2D).")
    pool_hit_plans: int = Field(
        0, description="Plans restored from the remote tier: the node-shared host-cache pool when serving.")
    pool_published_plans: int = Field(0, description="Built plans offered to the remote tier/pool (background).")
    pool_lookup_s: float = Field(0.0, description="Wall seconds spent asking the remote tier/pool.")
    built_plans: int = Field(0, description="Plans projected by a streaming rebuild from the checkpoint.")
    gpu_evicted_plans: int = Field(0, description="Plans evicted from the GPU slab (LRU) to make room.")
    host_stored_plans: int = Field(0, description="Plans copied D2H into the host tier.")
    host_evicted_groups: int = Field(0, description="Host tier groups evicted (LRU) to make room.")
    host_pressure_skips: int = Field(0, description="Groups not stored: larger than the whole host tier.")
    rebuild_s: float = Field(0.0, description="Wall seconds spent in rebuilds (checkpoint -> slab).")
    rebuild_bytes_read: int = Field(0, description="Checkpoint bytes read by rebuilds.")
    page_cache_bytes: int = Field(
        0, description="Of rebuild_bytes_read, bytes that were in the OS page cache when their read was queued "
        "(mincore). page_cache_bytes + disk_bytes == rebuild_bytes_read where the split is known (Linux); both "
        "0 with rebuild_bytes_read > 0 where it is not.")
    disk_bytes: int = Field(
        0, description="Of rebuild_bytes_read, bytes read from the disk (not in the page cache, or O_DIRECT).")
    h2d_bytes: int = Field(0, description="Bytes copied host tier -> slab.")
    prepare_s: float = Field(
        0.0, description="Host wall seconds in `prepare` (every stage; the request's plan_s adds the compute "
        "stream's wait for the queued copies and projections).")

    def add_(self, other: "AdalnStats") -> None:
        for name in type(self).model_fields:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclasses.dataclass
class PlanRows:
    """A plan's content on the host: blocks [num_blocks, M, adaln_width], final [M, final_adaln_width]."""

    blocks: torch.Tensor
    final: torch.Tensor


class RemoteTier(Protocol):
    """Seam for a shared pool between the host tier and the rebuild (`actors.host_cache_pool.PoolClient`:
    one pool per node). `lookup` returns the plans it has (host tensors, copied into the slab by the cache); it
    must answer within its own budget and never raise (a miss is rebuilt). `publish_group` offers all of a
    request's built plans at once: their host tensors are filled by D2H copies still queued, complete once
    `ready` has happened; it may wait for `ready` and must not raise. It is called from the cache's publish
    thread, never on the request path (`_Publisher`)."""

    def lookup(self, keys: Sequence[PlanKey]) -> dict[PlanKey, PlanRows]: ...

    def publish_group(self, plans: dict[PlanKey, PlanRows], ready: Event) -> object: ...


class RebuildShards(Protocol):
    """Splits rebuilds over the ranks of a multi-device replica (`parallel.agreement.RankShardedRebuild`, over
    `parallel.adaln`). Its methods are collectives: every rank's cache calls them at the same points, which
    holds while every rank sees the same requests in the same order (the caches then decide alike)."""

    def agree(self, rest: Sequence[PlanKey], missed: Sequence[bool]) -> list[bool]:
        """Called once per `prepare`. `rest`: the plans neither the slab nor the host tier had (the same on
        every rank, or this raises); `missed[i]`: this rank's remote tier lacks `rest[i]`. Returns, per plan of
        `rest`, whether any rank lacks it (then every rank rebuilds it)."""

    def select(self, units: Sequence[AdalnUnit]) -> list[AdalnUnit]:
        """This rank's share of the units (every block, then the final layer)."""

    def failed_ranks(self, failed: bool) -> list[int]:
        """Called once per rebuild, after this rank rebuilt its share (`failed`: it raised) and before any
        `exchange_`: the ranks whose share failed, the same list on every rank."""

    def exchange_(self, blocks: torch.Tensor, final: torch.Tensor) -> None:
        """In place, one plan's slab rows (blocks [num_blocks, M, adaln_width], final [M, final_width]): from
        this rank's units' rows to every unit's rows."""


class AdalnWeights(TensorLocator, Protocol):
    """The checkpoint a `PlanCache` rebuilds plans from (`model.weights.TransformerWeights`): where each AdaLN
    tensor's bytes are, and a fingerprint that changes with the weights (part of every plan key)."""

    @property
    def fingerprint(self) -> str: ...


def as_adaln_model(model: AdalnModel | nn.Module) -> AdalnModel:
    """The cache's view of `model`: a `MiniMaxH3Transformer3DModel` (as `H3Adaln`), or something that already
    is an `AdalnModel`."""
    if isinstance(model, nn.Module):
        return H3Adaln(model)  # TypeError unless it is the H3 transformer
    return model


def open_h3_transformer(path: str) -> AdalnWeights:
    """The FL2VA transformer of the H3 checkpoint at `path` (any layout `model.layout.H3Checkpoint` opens): how
    a weight update's directory is opened by default. Serving another partition: pass `reader_factory`."""
    from model.layout import H3Checkpoint, Partition  # lazy: only weight updates open new checkpoints
    from model.weights import TransformerWeights

    checkpoint = H3Checkpoint.open(path, Partition.FL2VA)
    return TransformerWeights(checkpoint.transformer_dir, checkpoint.layout)


def _check_update_source(path: str | os.PathLike, model: AdalnModel,
                         reader_factory: Callable[[str], AdalnWeights]) -> AdalnWeights:
    """Open `path` and check its adaln tensors against `model`'s; the reader, or WeightUpdateError."""
    try:
        reader = reader_factory(os.fspath(path))
        resolve_adaln_units(reader, model, model.unit_names())
    except (RebuildError, ValueError, OSError, KeyError) as e:
        raise WeightUpdateError(f"rejected weight update from {os.fspath(path)!r}: {e}") from e
    return reader


# ---------------------------------------------------------------------------------------------------------
# Online mode
# ---------------------------------------------------------------------------------------------------------


class PreparedPlans:
    """One request's plans, held in the slab until `release()`.

    `modulation(step)` gathers the step's rows with a device int64 index (`row_index`), so the forward
    never sees slot numbers as Python ints (CUDA-graph safe: the slab never moves, the index is fixed).
    """

    def __init__(self, cache: "PlanCache", slots: list[int], row_index: torch.Tensor,
                 spans: list[tuple[int, int]], stats: AdalnStats, keys: tuple[PlanKey, ...] = ()):
        self._cache = cache
        self._slots = slots
        self.keys = keys            # the request's distinct plan keys (first-appearance order)
        self.row_index = row_index  # int64 [sum of M over steps] on the device
        self._spans = spans         # per step: (offset into row_index, M)
        self.stats = stats
        self.released = False
        #: The background publish of this request's built plans (`_Publisher`): its result is the event the
        #: copies out of the slab rows complete at; `release` orders later slab writes after it.
        self.published: Future | None = None

    @property
    def num_steps(self) -> int:
        return len(self._spans)

    def step_rows(self, step_index: int) -> torch.Tensor:
        """Device int64 [M]: slab rows of step `step_index` (a view of `row_index`)."""
        offset, m = self._spans[step_index]
        return self.row_index[offset: offset + m]

    @torch.no_grad()
    def modulation(self, step_index: int) -> Modulation:
        if self.released:
            raise RuntimeError("modulation() after release()")
        rows = self.step_rows(step_index)
        slab = self._cache.slab
        # [num_blocks, M, adaln_width] and [M, final_adaln_width], gathered on the device.
        return Modulation(blocks=slab.blocks.index_select(1, rows), final=slab.final.index_select(0, rows))

    def release(self) -> None:
        """Drop this request's references (idempotent; call on completion, error or cancel)."""
        if self.released:
            return
        self.released = True
        if self.published is not None:
            # The publisher copies out of this request's slab rows; once freed they may be rebuilt or restored
            # into. Wait until its copies are queued (long done after a denoise), then make the compute stream,
            # which every later slab write follows, wait for them; without this a new plan could land in the rows
            # mid-copy and the pool would get a torn plan.
            done = self.published.result()
            if done is not None:
                self._cache.gpu.current_stream().wait_event(done)
        for slot in self._slots:
            self._cache.slab.index.free(slot)

    def __enter__(self) -> "PreparedPlans":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclasses.dataclass
class _Request:
    """One `PlanCache.prepare` in progress: its distinct plans, the slab slots it holds and its counters."""

    distinct: dict[PlanKey, torch.Tensor]  # plan key -> fp32 [M] timesteps, in first-appearance order
    stats: AdalnStats
    slot_of: dict[PlanKey, int] = dataclasses.field(default_factory=dict)
    held: list[int] = dataclasses.field(default_factory=list)  # references taken (hits and allocations)
    building: list[int] = dataclasses.field(default_factory=list)  # allocated, not yet committed
    published: Future | None = None  # the background publish of the plans it built (`_Publisher`)

    def wait_published(self, compute: Any) -> None:
        """Before a failed request gives its slots back: the publisher's copies read those rows, so `compute`,
        which every later slab write follows, waits for them (as `PreparedPlans.release` does); without this a
        rebuild into the freed rows could land mid-copy and the remote tier would get a torn plan."""
        if self.published is not None:
            with contextlib.suppress(Exception):
                done = self.published.result()
                if done is not None:
                    compute.wait_event(done)


@dataclasses.dataclass
class _Found:
    """Where the plans the slab lacked were found: the host tier, the remote tier, or nowhere (to rebuild)."""

    host: list[PlanKey]
    remote: dict[PlanKey, PlanRows]
    to_build: list[PlanKey]


class PlanCache:
    """Online AdaLN: plans from the GPU slab, else the pinned host tier, else the remote seam, else one
    streaming rebuild pass over the checkpoint for all of the request's missing plans.

    `PlanCache(config, checkpoint_reader, model, device)`: `checkpoint_reader` (`AdalnWeights`: a
    `model.weights.TransformerWeights`) has `.location(name)` and `.fingerprint`; `model` (see `as_adaln_model`;
    built with or without its AdaLN weights) gives the slab's shapes, the unit names and
    `adaln_input(timesteps fp32 [M]) -> [M, time_embed_dim]`. `reader_factory(path)` opens a weight update's
    directory (default: `open_h3_transformer`).

    Invariants: a plan is visible only after every block and the final layer were written (slots commit
    after the rebuild/H2D); a plan held by an in-flight request is never evicted (slot refcounts); a failed
    prepare leaves no reference and no half-built plan behind; plan keys carry `weights_version`, which a
    weight refresh bumps, so no request can see a plan built from old weights.
    """

    def __init__(self, config: AdalnConfig, checkpoint_reader: AdalnWeights, model: AdalnModel | nn.Module,
                 device: torch.device | str, *, remote: RemoteTier | None = None,
                 reader_factory: Callable[[str], AdalnWeights] | None = None,
                 gpu: Device | None = None, shards: RebuildShards | None = None):
        if config.mode != "online":
            raise ValueError("PlanCache serves adaln.mode=online; use ResidentModulation for resident")
        self.config = config
        self.device = torch.device(device)
        self.reader = checkpoint_reader
        self.model = as_adaln_model(model)
        self._adaln_input = self.model.adaln_input
        self._reader_factory = reader_factory or open_h3_transformer
        self.remote = remote
        self.shards = shards
        self.gpu = gpu if gpu is not None else make_device(self.device)  # streams, events, pinned memory
        dims = self.model  # the slab and host pages are shaped like the served model's projections
        self.slab = PlanSlab(
            num_plans=config.gpu_plans, plan_width=config.plan_width, num_blocks=dims.num_blocks,
            adaln_width=dims.adaln_width, final_width=dims.final_adaln_width, dtype=dims.torch_dtype,
            device=self.device,
        )
        self.host = HostTier(
            capacity_bytes=config.host_cache_bytes, num_blocks=dims.num_blocks, adaln_width=dims.adaln_width,
            final_width=dims.final_adaln_width, dtype=dims.torch_dtype, gpu=self.gpu,
        )
        self.rebuilder = AdalnRebuilder(
            gpu=self.gpu, readers=config.readers, chunk_bytes=config.read_chunk_mb << 20,
            direct_chunk_bytes=config.direct_chunk_mb << 20, num_buffers=config.staging_buffers,
            projection=config.projection, direct_io=config.direct_io,
        )
        # Its thread starts with the first publish (or warm_up).
        self._publisher = _Publisher(self.gpu, PinnedMemory(self.gpu, owner="AdaLN pool publish"))
        self._units: list[AdalnUnit] | None = None
        self._generation = 0
        self.stats = AdalnStats()

    @torch.no_grad()
    def warm_up(self, expected_plans: Sequence[torch.Tensor] = ()) -> None:
        """Set up now what the first miss would otherwise set up on the request path (the engine calls it at
        start): every unit located and checked, the rebuild's pinned host staging and device buffers sized for
        the largest unit, its reader threads and the publish thread started (with the pinned staging a miss of
        `expected_plans` would publish: the engine passes its default request's plans) and the pool asked once
        (its connections set up), and one small rebuild (the first
        block and the final layer, once per plan width M) into scratch rows, which creates the cuBLAS handle
        and loads the projection kernels of every M, and uses the copy stream. Reads one block's bytes; leaves
        the slab and the tiers alone. Idempotent."""
        units = self._resolved_units()
        self.rebuilder.reserve(max(u.staging_bytes for u in units))
        self.rebuilder.warm_up_readers()
        if self.remote is not None:
            dims = self.model
            version = self.weights_version
            distinct = {plan_key(timesteps, version): timesteps.numel() for timesteps in expected_plans}
            rows = list(distinct.values())[: self.config.gpu_plans]  # what one miss can publish at most
            self._publisher.start([shape for m in rows for shape in (
                ((dims.num_blocks, m, dims.adaln_width), dims.torch_dtype),
                ((m, dims.final_adaln_width), dims.torch_dtype))])
            # the first lookup sets up the pool actors' connections: here, not on the first miss
            self.remote.lookup([(("warm-up",), ())])
        probe = [dataclasses.replace(units[0], block=0 if units[0].block is not None else None)]
        if len(units) > 1:
            probe.append(units[-1])
        width, dims = self.config.plan_width, self.model
        blocks = torch.empty(1, width, dims.adaln_width, dtype=dims.torch_dtype, device=self.device)
        final = torch.empty(width, dims.final_adaln_width, dtype=dims.torch_dtype, device=self.device)
        targets = [RebuildTarget(self._adaln_input(torch.linspace(999.0, 1.0, m).to(self.device)).to(self.device), 0)
                   for m in range(1, width + 1)]
        self.rebuilder.rebuild(probe, targets, blocks, final)

    def _resolved_units(self) -> list[AdalnUnit]:
        if self._units is None:
            # Checks every tensor before any GPU work.
            self._units = resolve_adaln_units(self.reader, self.model, self.model.unit_names())
        return self._units

    # -- weights
    @property
    def weights_version(self) -> tuple[Hashable, str, int]:
        """(checkpoint fingerprint, projection, refresh generation): part of every plan key. The projection
        setting is in it because it changes the plans' bits, and the node pool is shared by replicas that may
        be configured differently."""
        return (self.reader.fingerprint, self.config.projection, self._generation)

    def validate_weight_update_source(self, path: str | os.PathLike | None) -> None:
        """Reject (WeightUpdateError, nothing written) an update this cache cannot follow: no source path
        (tensor updates: plans are rebuilt from disk, which would still hold the old weights), or a
        directory whose adaln tensors are missing or mis-shaped."""
        if path is None:
            raise WeightUpdateError(
                "adaln.mode=online rebuilds AdaLN plans from the checkpoint on disk, so a weight update "
                "without a source path would pair new weights with old plans; update from a checkpoint "
                "directory or serve with adaln.mode=resident"
            )
        _check_update_source(path, self.model, self._reader_factory)

    def refresh_weight_derived_caches(self, path: str | os.PathLike | None) -> None:
        """After an update from `path`: read plans from there, drop every tier, bump `weights_version`."""
        if path is None:
            self.validate_weight_update_source(path)  # raises: the cache would serve stale plans
        self.reader = _check_update_source(path, self.model, self._reader_factory)
        # Built plans of the old weights still on their way to the remote tier reach it now, so the remote's
        # invalidation that follows (`Engine.update_weights`) drops them instead of seeing them land after.
        self._publisher.drain()
        self.invalidate()
        self._generation += 1

    def invalidate(self) -> None:
        """Forget every plan in every tier (slots in use stay valid for their request, then free)."""
        self.slab.index.invalidate()
        self.host.invalidate()
        self._units = None

    # -- what the slab holds (read by the router's report from another thread: lookups only, no state change)
    @property
    def capacity_plans(self) -> int:
        return self.slab.index.capacity

    @property
    def num_free_plans(self) -> int:
        return self.slab.index.num_free

    def holds(self, keys: Sequence[PlanKey]) -> bool:
        """Whether every plan in `keys` is READY in the GPU slab now (a request for them would hit)."""
        return self.slab.index.holds(keys)

    def eviction_order(self) -> list[PlanKey]:
        """Keys of the evictable plans, next victim first (`SlotIndex.eviction_order`)."""
        return self.slab.index.eviction_order()

    def close(self) -> None:
        self.rebuilder.close()
        self._publisher.close()
        self.host.synchronize()

    # -- the walk
    def check_admission(self, plans: Sequence[torch.Tensor]) -> None:
        """AdmissionError (or ValueError for a malformed plan) if `prepare(plans)` would be refused whatever the
        slab holds: the engine's validation asks before the request is queued or any stage runs. Read-only, so it
        may run beside a generation."""
        if len(plans) <= self.config.gpu_plans and all(p.numel() <= self.config.plan_width for p in plans):
            return  # no more plans than slab rows, whatever their keys: skip the keys (prepare computes them)
        self._admit(plans)

    def _admit(self, plans: Sequence[torch.Tensor]) -> tuple[list[PlanKey], dict[PlanKey, torch.Tensor]]:
        """Keys per step and distinct plans (first-appearance order); AdmissionError before any GPU work."""
        if not plans:
            raise ValueError("a request needs at least one plan (one per step)")
        version = self.weights_version
        step_keys, distinct = [], {}
        for i, timesteps in enumerate(plans):
            key = plan_key(timesteps, version)  # also checks the plan: 1-D fp32, finite
            if timesteps.numel() > self.config.plan_width:
                raise AdmissionError(
                    f"step {i} has {timesteps.numel()} distinct timesteps but adaln.plan_width is "
                    f"{self.config.plan_width}; raise adaln.plan_width"
                )
            step_keys.append(key)
            distinct.setdefault(key, timesteps)
        if len(distinct) > self.config.gpu_plans:
            raise AdmissionError(
                f"request needs {len(distinct)} distinct AdaLN plans but the GPU slab holds "
                f"adaln.gpu_plans={self.config.gpu_plans}; raise adaln.gpu_plans or use fewer steps"
            )
        return step_keys, distinct

    @torch.no_grad()
    def prepare(self, plans: Sequence[torch.Tensor], weights_version: Hashable | None = None) -> PreparedPlans:
        """Make every plan of a request resident in the slab and take a reference on each.

        `plans`: one fp32 [M] tensor per forward (`model.schedule.H3Schedule.plans`). `weights_version`, if
        given, must be the current one (an engine that loaded weights under another version would get stale
        plans).

        Stages: admit -> lookup (slab) -> lookup_tiers (host, remote) -> allocate -> restore -> rebuild ->
        commit -> store (host tier) -> index. Until `commit` a failure aborts the request's new slots and drops
        its hits' references; after it (plans visible) a failure drops every reference it took.
        """
        if weights_version is not None and weights_version != self.weights_version:
            raise WeightUpdateError(
                f"weights_version {weights_version!r} is not the cache's {self.weights_version!r}; "
                "call refresh_weight_derived_caches after a weight update"
            )
        t_prepare = time.perf_counter()
        step_keys, distinct = self._admit(plans)
        request = _Request(distinct, AdalnStats(requests=1))
        compute = self.gpu.current_stream()
        evicted_before = self.slab.index.num_evicted
        try:
            missing = self._lookup(request)
            found = self._lookup_tiers(request, missing)
            self._allocate(request, missing)
            self._restore(request, found, compute)
            self._rebuild_missing(request, found.to_build, compute)
            self._commit(request)
        except BaseException:
            self._abort(request, compute)
            raise
        request.stats.gpu_evicted_plans = self.slab.index.num_evicted - evicted_before
        try:
            self._store(request, compute)
            row_index, spans = self._index(request, step_keys)
        except BaseException:
            request.wait_published(compute)
            self._free(request.held)
            raise
        request.stats.prepare_s = time.perf_counter() - t_prepare
        self.stats.add_(request.stats)
        prepared = PreparedPlans(self, request.held, row_index, spans, request.stats, tuple(request.distinct))
        prepared.published = request.published
        return prepared

    def _rows_of(self, request: _Request, key: PlanKey) -> list[int]:
        """Slab rows of `key`'s slot in `request`."""
        return self.slab.row_ids([(request.slot_of[key], len(key[1]))])

    def _lookup(self, request: _Request) -> list[PlanKey]:
        """GPU slab: a hit takes a reference (refreshing its recency on release). Returns the plans it lacks;
        SlabFullError if in-flight requests hold too many slots to make room for them."""
        index = self.slab.index
        missing = []
        for key in request.distinct:
            slot = index.lookup(key)
            if slot is None:
                missing.append(key)
            else:
                index.touch(slot)
                request.held.append(slot)
                request.slot_of[key] = slot
        request.stats.gpu_hit_plans = len(request.distinct) - len(missing)
        if len(missing) > index.num_free + index.num_evictable:
            raise SlabFullError(
                f"request needs {len(missing)} new slab slots but only "
                f"{index.num_free + index.num_evictable} of adaln.gpu_plans={self.config.gpu_plans} are "
                "not held by in-flight requests; retry when they finish"
            )
        return missing

    def _lookup_tiers(self, request: _Request, missing: list[PlanKey]) -> _Found:
        """Host tier, then the remote seam, for the plans the slab lacks; the rest is to be rebuilt."""
        host_hits = self.host.lookup(missing)
        host_hit_set = set(host_hits)
        rest = [k for k in missing if k not in host_hit_set]
        remote_hits: dict[PlanKey, PlanRows] = {}
        if self.remote is not None and rest:
            t_remote = time.perf_counter()
            remote_hits = self.remote.lookup(rest)
            request.stats.pool_lookup_s = time.perf_counter() - t_remote
        to_build = [k for k in rest if k not in remote_hits]
        if self.shards is not None:
            # Every rank rebuilds the same plans (the rebuild's exchange is a collective): those any rank's
            # remote tier lacked; a remote hit here is then rebuilt like the others.
            must_build = self.shards.agree(rest, [k not in remote_hits for k in rest])
            to_build = [k for k, build in zip(rest, must_build) if build]
            rebuilt = frozenset(to_build)
            remote_hits = {k: v for k, v in remote_hits.items() if k not in rebuilt}
        return _Found(host=host_hits, remote=remote_hits, to_build=to_build)

    def _allocate(self, request: _Request, missing: list[PlanKey]) -> None:
        """Slots for every missing plan (evicting LRU plans), invisible until committed."""
        index = self.slab.index
        for key in missing:
            slot = index.allocate(key)
            request.held.append(slot)
            request.building.append(slot)
            request.slot_of[key] = slot

    def _restore(self, request: _Request, found: _Found, compute: Any) -> None:
        """Copy the host tier's and the remote tier's hits into their new slots."""
        stats = request.stats
        # Slab writes below must not overtake a D2H still reading a recycled slot.
        self.host.fence_slab_writes(compute)
        stats.h2d_bytes = self.host.load([(k, self._rows_of(request, k)) for k in found.host], self.slab, compute)
        stats.host_hit_plans = len(found.host)
        for key, rows in found.remote.items():
            first = self.slab.first_row(request.slot_of[key])
            m = len(key[1])
            self.slab.blocks[:, first: first + m].copy_(rows.blocks)
            self.slab.final[first: first + m].copy_(rows.final)
        stats.pool_hit_plans = len(found.remote)

    def _rebuild_missing(self, request: _Request, to_build: list[PlanKey], compute: Any) -> None:
        """One streaming rebuild pass for every plan no tier had, then offer them to the remote tier."""
        if not to_build:
            return
        stats = request.stats
        report = self._rebuild([(k, request.distinct[k], self.slab.first_row(request.slot_of[k])) for k in to_build])
        stats.built_plans = len(to_build)
        stats.rebuild_s = report.seconds
        stats.rebuild_bytes_read = report.bytes_read
        stats.page_cache_bytes = report.page_cache_bytes or 0
        stats.disk_bytes = report.disk_bytes or 0
        if self.remote is not None:
            request.published = self._publish_built(to_build, request.slot_of, compute)
            stats.pool_published_plans = len(to_build)

    def _commit(self, request: _Request) -> None:
        """Every row is written (or queued before the forward on the compute stream): make the plans visible."""
        for slot in request.building:
            self.slab.index.commit(slot)
        request.building.clear()

    def _abort(self, request: _Request, compute: Any) -> None:
        """Undo a request that failed before `_commit`: its new slots stay invisible and free, its hits'
        references are dropped."""
        request.wait_published(compute)
        index = self.slab.index
        for slot in request.building:
            index.abort(slot)
        building = set(request.building)
        self._free([slot for slot in request.held if slot not in building])

    def _free(self, slots: list[int]) -> None:
        for slot in slots:
            self.slab.index.free(slot)

    def _store(self, request: _Request, compute: Any) -> None:
        """Keep the request's group in the host tier (D2H only for plans it does not have yet)."""
        distinct = request.distinct
        stored = self.host.store_group(tuple(distinct), [(k, self._rows_of(request, k)) for k in distinct],
                                       self.slab, compute)
        request.stats.host_stored_plans = stored.stored_plans
        request.stats.host_evicted_groups = stored.evicted_groups
        request.stats.host_pressure_skips = int(stored.skipped)

    def _index(self, request: _Request, step_keys: list[PlanKey]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Per-step slab rows as one device index tensor (one small H2D per request), and each step's span."""
        rows, spans = [], []
        for key in step_keys:
            spans.append((len(rows), len(key[1])))
            rows.extend(self._rows_of(request, key))
        return torch.tensor(rows, dtype=torch.int64).to(self.device), spans

    def _publish_built(self, keys: list[PlanKey], slot_of: dict[PlanKey, int], compute: Any) -> Future:
        """Offer the plans just built to the remote tier without holding up the request: the publish thread
        (`_Publisher`) allocates their host tensors, copies the rows D2H on its own stream (after `written`,
        the compute stream's point past the rebuild's writes) and hands them over. The request holds its slots
        until `release()`, which orders later slab writes after those copies."""
        sources = {}
        for key in keys:
            first, m = self.slab.first_row(slot_of[key]), len(key[1])
            sources[key] = PlanRows(self.slab.blocks[:, first: first + m], self.slab.final[first: first + m])
        return self._publisher.submit(self.remote, sources, compute.record_event())

    def _rebuild(self, jobs: list[tuple[PlanKey, torch.Tensor, int]]):
        self._resolved_units()
        targets = []
        for _, timesteps, first_row in jobs:
            # [M, time_embed_dim] with the same M as resident (the model may live elsewhere under offload).
            x = self._adaln_input(timesteps.to(self.device)).to(self.device)
            targets.append(RebuildTarget(x, first_row))
        if self.shards is None:
            return self.rebuilder.rebuild(self._units, targets, self.slab.blocks, self.slab.final)
        start = time.perf_counter()
        units = self.shards.select(self._units)
        # A rank may own no unit (more ranks than blocks): it only receives.
        report, error = RebuildReport(bytes_read=0, seconds=0.0, num_units=0, num_plans=len(targets)), None
        try:
            if units:
                report = self.rebuilder.rebuild(units, targets, self.slab.blocks, self.slab.final)
        except Exception as exc:  # noqa: BLE001 - re-raised below, once the other ranks know
            error = exc
        # A share that failed (e.g. its shard unreadable: each rank reads only its own) fails the rebuild on every
        # rank before the exchanges: a rank leaving here alone would pair its next collective with their exchange.
        failed = self.shards.failed_ranks(error is not None)
        if error is not None:
            raise error
        if failed:
            raise RebuildError(f"rank(s) {failed} could not rebuild their share of the AdaLN units (see their log); "
                               "no rank used the plans")
        for target in targets:  # every rank ends with every unit's rows
            rows = slice(target.first_row, target.first_row + target.adaln_input.shape[0])
            self.shards.exchange_(self.slab.blocks[:, rows], self.slab.final[rows])
        report.seconds = time.perf_counter() - start
        return report


class _Publisher:
    """Offers built plans to a `RemoteTier` from one background thread, so that nothing of a publish sits on
    the request path: not the host tensors' allocation (pinned on CUDA: cudaHostAlloc the first times), not the
    D2H copies (on the publisher's own stream, so the forwards on the compute stream never queue behind them),
    not a remote whose `publish_group` blocks. The remote gets the tensors and the copies' event.

    `submit` returns a Future of the copies' event, resolved once the copies are queued, before the remote is
    called; the caller keeps the source rows unchanged until then and orders later writes after the event."""

    def __init__(self, gpu: Device, memory: PinnedMemory):
        self.gpu = gpu
        self._memory = memory  # short-lived staging (pinned on CUDA)
        self._stream = gpu.new_stream("publish")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adaln-publish")

    def start(self, reserve: Sequence[tuple[tuple[int, ...], torch.dtype]] = ()) -> None:
        """Start the thread now (warm-up), not on the first publish, and have PyTorch's caching host allocator
        hold a staging buffer of each (shape, dtype) in `reserve` (the tensors one publish will stage): the first
        publishes would otherwise cudaHostAlloc them, and those calls stall the request thread's CUDA calls
        (the part of the first miss outside the rebuild took ~47 ms vs ~20 ms later on an H200)."""
        self.drain()  # the thread exists once it ran something
        if self._memory.pins_staging:
            reserved = [self._memory.staging(shape, dtype) for shape, dtype in reserve]
            del reserved  # back to the allocator's free lists, pinned, for the publishes to reuse

    def submit(self, remote: RemoteTier, sources: dict[PlanKey, PlanRows], written: Event) -> Future:
        copied: Future = Future()
        self._executor.submit(self._run, remote, sources, written, copied)
        return copied

    def drain(self) -> None:
        """Return once every publish submitted so far has been handed to its remote (or given up)."""
        self._executor.submit(lambda: None).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def _run(self, remote: RemoteTier, sources: dict[PlanKey, PlanRows], written: Event, copied: Future) -> None:
        """Never raises (a publish is best effort: a lost plan is rebuilt elsewhere); `copied` gets the event
        every copy issued here completes at before the remote is called."""
        plans: dict[PlanKey, PlanRows] = {}
        done = None
        try:
            plans = self._copy(sources, written)
        except Exception:  # noqa: BLE001
            logger.exception("copying built AdaLN plans for the remote tier failed")
            plans = {}
        finally:
            done = self._stream.record_event()  # covers every copy issued, even before a failure
            copied.set_result(done)
        if not plans:
            return
        try:
            remote.publish_group(plans, done)
        except Exception:  # noqa: BLE001
            logger.exception("offering built AdaLN plans to the remote tier failed")

    def _copy(self, sources: dict[PlanKey, PlanRows], written: Event) -> dict[PlanKey, PlanRows]:
        plans: dict[PlanKey, PlanRows] = {}
        with self.gpu.use_stream(self._stream), torch.no_grad():
            self._stream.wait_event(written)  # the rows are read only after the rebuild wrote them
            for key, rows in sources.items():
                blocks = self._memory.staging(tuple(rows.blocks.shape), rows.blocks.dtype)
                final = self._memory.staging(tuple(rows.final.shape), rows.final.dtype)
                self.gpu.copy_(blocks, rows.blocks)
                self.gpu.copy_(final, rows.final)
                plans[key] = PlanRows(blocks, final)
        return plans


# ---------------------------------------------------------------------------------------------------------
# Resident mode
# ---------------------------------------------------------------------------------------------------------


class ResidentPlans:
    """Resident-mode counterpart of `PreparedPlans`: projects each step from the model's adaln_proj."""

    def __init__(self, owner: "ResidentModulation", timesteps: list[torch.Tensor], stats: AdalnStats):
        self._owner = owner
        self._timesteps = timesteps  # per step, fp32 [M] on the device
        self.stats = stats
        self.released = False

    @property
    def num_steps(self) -> int:
        return len(self._timesteps)

    def modulation(self, step_index: int) -> Modulation:
        if self.released:
            raise RuntimeError("modulation() after release()")
        return self._owner.modulation_for(self._timesteps[step_index])

    def release(self) -> None:
        self.released = True

    def __enter__(self) -> "ResidentPlans":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ResidentModulation:
    """adaln.mode=resident with the `PlanCache` interface: every step projects through the model's own
    AdaLN weights (nothing cached). `projection=match` calls the model's `resident_modulation`;
    `projection=fp32` projects through `cache.projection.project` in fp32, exactly as the online rebuild
    does with that setting, so the two modes stay bit-equal under either setting."""

    def __init__(self, config: AdalnConfig, model: AdalnModel | nn.Module, device: torch.device | str | None = None,
                 *, reader_factory: Callable[[str], AdalnWeights] | None = None):
        self.model = as_adaln_model(model)
        try:
            projections = self.model.resident_projections()
        except RuntimeError as e:
            raise ValueError(f"adaln.mode=resident needs the model's AdaLN weights: {e}") from e
        if any(weight.is_meta or bias.is_meta for weight, bias in projections):
            raise ValueError("adaln.mode=resident needs the model's AdaLN weights: they are on meta")
        self.config = config
        self.device = torch.device(device) if device is not None else self.model.device
        self._reader_factory = reader_factory or open_h3_transformer
        self._generation = 0
        self.stats = AdalnStats()

    @property
    def weights_version(self) -> int:
        return self._generation

    def prepare(self, plans: Sequence[torch.Tensor], weights_version: Hashable | None = None) -> ResidentPlans:
        if not plans:
            raise ValueError("a request needs at least one plan (one per step)")
        for timesteps in plans:
            check_plan(timesteps)
        stats = AdalnStats(requests=1)
        self.stats.add_(stats)
        return ResidentPlans(self, [t.to(self.device) for t in plans], stats)

    @torch.no_grad()
    def modulation_for(self, timesteps: torch.Tensor) -> Modulation:
        adaln_input = self.model.adaln_input(timesteps)  # [M, time_embed_dim]
        projection = self.config.projection
        if projection == "match":
            return self.model.resident_modulation(adaln_input)
        dtype = self.model.torch_dtype
        with projection_guard(projection):
            rows = []
            for weight, bias in self.model.resident_projections():  # blocks, then the final layer
                w, b = prepare_weight(weight, bias, projection)
                rows.append(project(adaln_input, w, b, projection, dtype))
            return Modulation(blocks=torch.stack(rows[:-1]), final=rows[-1])

    def validate_weight_update_source(self, path: str | os.PathLike | None) -> None:
        """Resident weights are read from the model itself, so tensor updates (path None) are fine; a
        directory must still carry well-shaped adaln tensors."""
        if path is not None:
            _check_update_source(path, self.model, self._reader_factory)

    def refresh_weight_derived_caches(self, path: str | os.PathLike | None) -> None:
        self.invalidate()
        self._generation += 1

    def invalidate(self) -> None:
        """Nothing is cached in resident mode."""

    def close(self) -> None:
        pass


def make_adaln_provider(config: AdalnConfig, model: AdalnModel | nn.Module, checkpoint_reader: AdalnWeights,
                        device: torch.device | str, **kwargs) -> PlanCache | ResidentModulation:
    """The provider for `config.mode`: the engine loads the model's AdaLN weights only for resident mode."""
    if config.mode == "resident":
        return ResidentModulation(config, model, device, **kwargs)
    return PlanCache(config, checkpoint_reader, model, device, **kwargs)
