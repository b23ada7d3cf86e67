"""A multi-device replica: one Ray actor per device holding one rank's `Engine` (`GpuWorkerActor`), and the
coordinator that makes `engine.parallel.sp` of them one engine for the Serve worker (`ParallelEngine`, an
`engine.api.EngineProtocol`).

    engine = ParallelEngine(config, OwnPlacementGroup())          # tests, benchmarks: reserves its own bundles
    engine = ParallelEngine(config, ReplicaBundles.current())     # inside a Serve replica (its placement group)
    result = engine.generate(request, progress, cancelled)        # every rank runs it; rank 0 decodes

Start. The ranks are placed one per bundle of a STRICT_PACK placement group (one node, so NVLink): their own
(`OwnPlacementGroup`) or the Serve replica's (`ReplicaBundles`; Serve's `placement_group_bundles` =
`replica_bundles(...)`, bundle 0 for the replica itself). Rank 0 picks the rendezvous (`tcp://` its node's IP
and a free port); every rank joins the group (`parallel.group.init_group`, gloo on CPU, NCCL on GPUs) and
builds its `Engine` with it, all bounded by `engine.parallel.load_timeout_s`.

Generation. The coordinator fixes the seed (every rank must draw the same noise) and sends the request to every
rank. Rank 0 reports progress: the coordinator polls it and calls `progress` once per forward, in order.
Cancellation: `cancelled()` is polled too; when it turns true every rank's cancel flag is set, and the engines
stop at the same step boundary because each rank stops on rank 0's flag, broadcast at every boundary and read
one boundary later (`parallel.late_flag`: no host wait on the GPU queue; a rank deciding on its own flag could
stop a step before another and leave it waiting in a collective). The polls are rank-0-only host work (a
threaded actor call, ~10 per second); they stay off the step's critical path because under sequence parallelism
the host never waits for the GPU queue inside the loop (it runs up to a forward ahead), and progress then
counts forwards issued, at most one ahead of the GPU.

Faults. Every wait on a rank is bounded. A rank whose actor dies fails its call at once (Ray reports the death);
its peers fail their next collective within `timeout_s` (`parallel.group`); once one rank failed, the others get
`timeout_s` plus a grace to finish, then count as lost. A lost rank, ranks that disagree (one finished, one
failed) or a rank whose group failed make the replica unusable: the request fails with `ServerFault` naming the
first cause, the rank actors are killed, and from then on `health()` raises, so Serve replaces the replica. An
error every rank raised alike (a `ClientError`, `GenerationCancelled`, a plan the ranks agreed they could not
prepare) is the request's and is re-raised as it is; the replica stays healthy (after its ranks confirm it). So
is a cancel rank 0 alone saw before it decoded (its peers returned: every collective ran on every rank).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import (PlacementGroup, get_current_placement_group, placement_group,
                                      remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.host_cache_pool import make_pool_client
from engine.api import (NO_SLAB, CancelledFn, GenerationRequest, GenerationResult, GenerationStats, ParallelStats,
                        ProgressFn, SlabState)
from engine.config import EngineConfig
from engine.engine import Engine, resolve_device, served_adapter_files
from engine.errors import EngineError, FaultCause, GenerationCancelled, ServerFault, WeightsRejected
from engine.startup import EngineStartup
from model.provisioning import ensure_checkpoint
from parallel.config_check import check_parallel_config
from parallel.group import init_group

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankReport:
    """What a rank other than 0 answers a generation with: its latents' digest (compared with rank 0's) and
    its counters (Cache-DiT's cached steps, its plan cache's)."""

    latents_digest: str
    stats: GenerationStats


def latents_digest(result: GenerationResult) -> str:
    """A digest of the result's latents' bytes: equal digests, bit-identical latents (and shapes, dtypes)."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in (result.video, result.audio):
        digest.update(f"{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()

#: CPUs a rank actor reserves (its bundle holds this plus its GPU).
RANK_NUM_CPUS = 1.0
#: Threads of a rank actor: a generation, plus progress, cancel, health and read-only checks beside it.
RANK_CONCURRENCY = 8
#: How often the coordinator looks at a running generation (rank 0's progress, the caller's cancel).
POLL_S = 0.1
#: After one rank failed, the others get timeout_s (their next collective fails by then) plus this.
FAILURE_GRACE_S = 10.0


class ParallelStartError(RuntimeError):
    """The replica's ranks could not be placed or started; names the step and the bound."""


# ---------------------------------------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OwnPlacementGroup:
    """The coordinator reserves one bundle per rank (STRICT_PACK: one node) and removes it at `close()`."""


@dataclass(frozen=True)
class ReplicaBundles:
    """Rank r goes into bundle `first_bundle + r` of a placement group someone else reserved: a Serve replica's
    (`placement_group_bundles=replica_bundles(...)`, `placement_group_strategy="STRICT_PACK"`; Serve puts the
    replica itself in bundle 0)."""

    placement_group: PlacementGroup
    first_bundle: int = 1

    @classmethod
    def current(cls, first_bundle: int = 1) -> ReplicaBundles:
        """The placement group this process (a Serve replica) runs in."""
        group = get_current_placement_group()
        if group is None:
            raise ParallelStartError("ReplicaBundles.current(): this process is not in a placement group; give the "
                                     "Serve deployment placement_group_bundles=replica_bundles(...)")
        return cls(group, first_bundle)


RankPlacement = OwnPlacementGroup | ReplicaBundles


def rank_bundle(num_gpus_per_rank: int) -> dict[str, float]:
    """One rank's bundle: its CPU and its device."""
    return {"CPU": RANK_NUM_CPUS, "GPU": float(num_gpus_per_rank)} if num_gpus_per_rank else {"CPU": RANK_NUM_CPUS}


def replica_bundles(sp: int, num_gpus_per_rank: int, replica_num_cpus: float) -> list[dict[str, float]]:
    """Serve's `placement_group_bundles` for one replica of `sp` ranks (strategy STRICT_PACK): bundle 0 holds
    the replica (the coordinator, CPUs only: its `ray_actor_options` must fit it), bundles 1..sp one rank each."""
    return [{"CPU": replica_num_cpus}] + [rank_bundle(num_gpus_per_rank) for _ in range(sp)]


def rank_num_gpus(config: EngineConfig, cluster_num_gpus: float) -> int:
    """GPUs per rank: 1 unless the engine is pinned to the CPU or the cluster has no GPU (device auto)."""
    if config.device == "cpu" or (config.device == "auto" and cluster_num_gpus <= 0):
        return 0
    return 1


def largest_node_num_gpus() -> int:
    """GPUs of the Ray cluster's largest alive node."""
    return max((int(node["Resources"].get("GPU", 0)) for node in ray.nodes() if node["Alive"]), default=0)


# ---------------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------------


def rank_device(config: EngineConfig) -> torch.device:
    """This rank's device: the CPU, or the one GPU Ray gave the actor (CUDA_VISIBLE_DEVICES holds only it)."""
    device = resolve_device(config.device)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device


class GpuWorkerActor:
    """One rank of a replica: joins the replica's group and holds an `Engine` built with it (run as a threaded
    Ray actor: progress, cancel, health and the read-only checks answer while a generation runs).

    Requests carry increasing ids from the coordinator; `cancel(i)` cancels request i and every earlier one,
    so a cancel that arrives before (or after) its request started on this rank is never lost or misapplied."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._engine: Engine | None = None
        self._progress = (-1, 0, 0)  # (request id, forwards done, forwards)
        self._cancelled_through = -1

    def rendezvous_address(self) -> str:
        """`tcp://` this node's IP and a port free right now (rank 0's: the group's TCP store listens there)."""
        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        return f"tcp://{host}:{port}"

    def start(self, init_method: str, config: EngineConfig) -> str:
        """Join the group at `init_method` and build this rank's engine; returns the served model's id."""
        device = rank_device(config)
        group = init_group(self.rank, self.world_size, init_method, device, timeout_s=config.parallel.timeout_s)
        remote = make_pool_client(config.pool, device, config.adaln.mode)
        self._engine = Engine(config, remote=remote, group=group)
        return self._engine.model_name

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError(f"rank {self.rank}: start() has not run")
        return self._engine

    def generate(self, request_id: int, request: GenerationRequest) -> GenerationResult | RankReport:
        """Rank 0: the result (latents, the MP4). Another rank: a digest of its latents and its counters (its
        latents would cross to the coordinator only to be compared)."""
        def progress(done: int, total: int) -> None:
            self._progress = (request_id, done, total)

        def cancelled() -> bool:
            return request_id <= self._cancelled_through

        return self.answer(self.engine.generate(request, progress, cancelled))

    def answer(self, result: GenerationResult) -> GenerationResult | RankReport:
        """What this rank sends the coordinator for `result`: all of it from rank 0, a RankReport otherwise."""
        if self.rank == 0:
            return result
        return RankReport(latents_digest=latents_digest(result), stats=result.stats)

    def progress(self, request_id: int) -> tuple[int, int]:
        """(forwards done, forwards) of request `request_id` here; (0, 0) before it started."""
        current, done, total = self._progress
        return (done, total) if current == request_id else (0, 0)

    def cancel(self, request_id: int) -> None:
        self._cancelled_through = max(self._cancelled_through, request_id)

    def validate(self, request: GenerationRequest) -> None:
        self.engine.validate(request)

    def validate_weight_update(self, path: str) -> str:
        return self.engine.validate_weight_update(path)

    def update_weights(self, path: str) -> dict[str, Any]:
        return self.engine.update_weights(path)

    def debug_stats(self) -> dict[str, Any]:
        return self.engine.debug_stats()

    def slab_state(self) -> SlabState:
        return self.engine.slab_state()

    def held_adapters(self) -> tuple[str, ...]:
        return self.engine.held_adapters()

    def prefetch_adapters(self, request: GenerationRequest) -> None:
        self.engine.prefetch_adapters(request)

    def health(self) -> dict[str, Any]:
        return self.engine.health()

    def describe(self) -> dict[str, Any]:
        return self.engine.describe()

    def startup(self) -> EngineStartup:
        return self.engine.startup

    def placement_group_id(self) -> str | None:
        """Hex id of the placement group this rank runs in (operators, tests)."""
        return ray.get_runtime_context().get_placement_group_id()


# ---------------------------------------------------------------------------------------------------------
# The coordinator
# ---------------------------------------------------------------------------------------------------------


@dataclass
class RankOutcome:
    """What one rank's call came to: a value, an error the rank raised, or lost (died / did not answer)."""

    rank: int
    value: Any = None
    error: BaseException | None = None
    lost: str | None = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _outcome_of(rank: int, ref: ray.ObjectRef) -> RankOutcome:
    """The outcome of a finished call (`ref` is ready, so this does not wait)."""
    try:
        return RankOutcome(rank, value=ray.get(ref, timeout=0))
    except RayActorError as exc:  # ActorDiedError, ActorUnavailableError
        return RankOutcome(rank, lost=f"died ({_first_line(exc)})")
    except RayTaskError as exc:  # the rank's method raised: its own exception, as raised
        return RankOutcome(rank, error=exc.cause if isinstance(exc.cause, BaseException) else exc)


def _cancelled_while_rank_0_decoded(outcomes: list[RankOutcome]) -> bool:
    """Rank 0 alone decodes, after the loop's last collective, and checks for a cancel before it does (unagreed:
    its peers are done by then); only it raising GenerationCancelled there is the request's cancel, not ranks that
    disagreed."""
    rank_0, peers = outcomes[0], outcomes[1:]
    return isinstance(rank_0.error, GenerationCancelled) and all(
        peer.error is None and peer.lost is None for peer in peers)


@dataclass
class _HealthProbe:
    refs: list[ray.ObjectRef]
    started: float


class ParallelEngine:
    """`engine.parallel.sp` rank actors served as one engine (`engine.api.EngineProtocol`).

    Thread-safe: generations and weight updates are serialized by a lock; `validate_weight_update`,
    `debug_stats`, `health` and `describe` run beside them. `health()` and `describe()` never wait on a rank
    (`health` reads the answer to the probe it sent last time and sends the next one); every other call waits
    at most `timeout_s` for a rank (`load_timeout_s` for a weight update; a generation as long as its ranks
    make progress, or `request_timeout_s`)."""

    def __init__(self, config: EngineConfig, placement: RankPlacement, *, num_gpus_per_rank: int | None = None):
        """Place and start the ranks (bounded by `load_timeout_s`). Raises the config check's ValueError
        (`check_parallel_config`) before anything starts, ParallelStartError when the ranks cannot be placed
        or started in time, or a rank's own start error (e.g. the checkpoint's CheckpointError)."""
        parallel = config.parallel
        if num_gpus_per_rank is None:
            num_gpus_per_rank = rank_num_gpus(config, float(ray.cluster_resources().get("GPU", 0.0)))
        check_parallel_config(config, largest_node_num_gpus() if num_gpus_per_rank else 0)
        # The auto-made checkpoint and adapters, made here once before any rank joins its process group: a rank > 0
        # of an initialized group writes no transformers component (save_pretrained writes on rank 0 only), so a
        # rank that made the tiny checkpoint itself would have its text encoder missing. (Its maker refuses an
        # empty component rather than publish it: `model.layout`.)
        ensure_checkpoint(config)
        served_adapter_files(config)
        self.config = config
        self.sp = parallel.sp
        self.timeout_s = parallel.timeout_s
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._next_request_id = 0
        self._busy = False
        self._num_requests = 0
        self._num_failed = 0
        self._probe: _HealthProbe | None = None
        # Rank 0's slab state as last answered, and the question in flight (slab_state never waits on a rank).
        self._slab_state: SlabState = NO_SLAB
        # Rank 0's held adapters as last answered, and the question in flight (held_adapters never waits either).
        self._held_adapters: tuple[str, ...] = ()
        self._adapters_query: Any = None
        self._slab_query: ray.ObjectRef | None = None
        self._own_group: PlacementGroup | None = None
        self.ranks: list[ray.actor.ActorHandle] = []
        if isinstance(placement, OwnPlacementGroup):
            group = placement_group([rank_bundle(num_gpus_per_rank)] * self.sp, strategy="STRICT_PACK")
            self._own_group, first_bundle = group, 0
            ready, _ = ray.wait([group.ready()], timeout=parallel.load_timeout_s)
            if not ready:
                self.close()
                raise ParallelStartError(f"could not reserve {self.sp} bundles of {rank_bundle(num_gpus_per_rank)} "
                                         f"on one node within load_timeout_s={parallel.load_timeout_s:g}")
        else:
            group, first_bundle = placement.placement_group, placement.first_bundle
        actor = ray.remote(GpuWorkerActor)
        self.ranks = [
            actor.options(
                num_cpus=RANK_NUM_CPUS, num_gpus=num_gpus_per_rank, max_concurrency=RANK_CONCURRENCY,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=first_bundle + rank,
                    # the ranks' own children (the node's plan pool actors) live outside the replica's bundles
                    placement_group_capture_child_tasks=False),
            ).remote(rank, self.sp)
            for rank in range(self.sp)
        ]
        try:
            # Every rank's process up (its imports done) before any joins: the join waits only timeout_s for its
            # peers, and a rank process still starting on a busy host can take longer than that.
            address, *_ = self._started([rank.rendezvous_address.remote() for rank in self.ranks],
                                        "start its process and pick the rendezvous address")
            self._started([rank.start.remote(address, config) for rank in self.ranks],
                          f"join the group at {address} and load the engine")
            (description,) = self._started([self.ranks[0].describe.remote()], "describe the model")
            #: Rank 0's start-up (every rank loads the same parts at once, rank 0 also the VAEs).
            (self.startup,) = self._started([self.ranks[0].startup.remote()], "report its start-up")
        except BaseException:
            self.close()
            raise
        self._description = self._described(description)
        logger.info("parallel engine ready: %d ranks (sp=%d, %s GPU each), group at %s", self.sp, self.sp,
                    num_gpus_per_rank, address)

    # --- API -----------------------------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """ClientError if the model cannot take `request` (rank 0 checks; every rank holds the same model)."""
        self._check_usable()
        self._answers([self.ranks[0].validate.remote(request)], self.timeout_s, "validate")

    def generate(self, request: GenerationRequest, progress: ProgressFn | None = None,
                 cancelled: CancelledFn | None = None) -> GenerationResult:
        """Run `request` on every rank; rank 0's result (the MP4 when asked) with `stats.parallel`: `sp`,
        whether every rank ended with rank 0's latents (`ranks_agree`), every rank's cached steps
        (`cached_steps_by_rank`, with Cache-DiT) and plan cache counters (`adaln_by_rank`, online AdaLN).
        Raises what the ranks raised alike, or ServerFault (see the module)."""
        if request.seed is None:  # every rank must draw the same noise
            request = request.model_copy(update={"seed": secrets.randbits(63)})
        with self._lock:
            self._check_usable()
            request_id, self._next_request_id = self._next_request_id, self._next_request_id + 1
            self._busy = True
            try:
                refs = [rank.generate.remote(request_id, request) for rank in self.ranks]
                try:
                    outcomes, reported = self._await_generation(request_id, refs, progress, cancelled)
                except BaseException:  # the caller's progress or cancelled callback raised: stop the ranks too
                    for rank in self.ranks:
                        rank.cancel.remote(request_id)
                    raise
                if _cancelled_while_rank_0_decoded(outcomes):  # the request's cancel, every rank done alike
                    raise outcomes[0].error
                results = self._values(outcomes, "generate")
            except BaseException:
                self._num_failed += 1
                raise
            finally:
                self._busy = False
            self._num_requests += 1
            result = results[0]
            if progress is not None:  # forwards that finished after the last poll
                forwards = result.stats.forwards
                for done in range(reported + 1, forwards + 1):
                    progress(done, forwards)
        digest = latents_digest(result)
        ranks_agree = all(other.latents_digest == digest for other in results[1:])
        if not ranks_agree:
            logger.error("the ranks ended request %d with different latents (a bug: they run the same "
                         "computation on the same inputs)", request_id)
        parallel = ParallelStats(sp=self.sp, ranks_agree=ranks_agree)
        if result.stats.cache_dit is not None:
            parallel.cached_steps_by_rank = [other.stats.cache_dit.cached_steps for other in results]
        if result.stats.adaln is not None:  # online AdaLN: each rank's plan cache counters
            parallel.adaln_by_rank = [other.stats.adaln for other in results]
        result.stats.parallel = parallel
        return result

    def validate_weight_update(self, path: str) -> str:
        """The checkpoint's fingerprint as every rank sees it, or WeightsRejected; writes nothing."""
        self._check_usable()
        outcomes = self._collect([rank.validate_weight_update.remote(path) for rank in self.ranks],
                                 self.timeout_s, "validate_weight_update")
        if any(outcome.lost is not None for outcome in outcomes):
            self._fail(f"validate_weight_update: {self._cause(outcomes)}")
            self._check_usable()
        for outcome in outcomes:  # read-only: a rank rejecting it leaves every rank as it was
            if outcome.error is not None:
                raise outcome.error
        fingerprints = [outcome.value for outcome in outcomes]
        if len(set(fingerprints)) != 1:
            raise WeightsRejected(f"the ranks read different checkpoints at {path}: fingerprints {fingerprints}")
        return fingerprints[0]

    def update_weights(self, path: str) -> dict[str, Any]:
        """Load the checkpoint at `path` on every rank, between generations. Checked on every rank first
        (WeightsRejected: nothing written anywhere); a rank failing after that leaves the ranks on different
        weights (it raised, or it ended on another fingerprint than rank 0: the directory changed meanwhile):
        ServerFault, the replica unusable. Returns `describe()`."""
        with self._lock:
            self.validate_weight_update(path)
            outcomes = self._collect([rank.update_weights.remote(path) for rank in self.ranks],
                                     self.config.parallel.load_timeout_s, "update_weights")
            if any(outcome.error is not None or outcome.lost is not None for outcome in outcomes):
                cause = self._cause(outcomes)
                self._fail(f"weight update from {path} failed on a rank after every rank accepted it: {cause}")
                raise ServerFault(f"parallel replica unusable: {self._failure}", FaultCause.RANK_FAILURE)
            # Each rank re-read the directory: one that changed after the validation leaves ranks on other bytes.
            fingerprints = [outcome.value["fingerprint"] for outcome in outcomes]
            if len(set(fingerprints)) != 1:
                self._fail(f"weight update from {path} left the ranks on different weights: fingerprints "
                           f"{fingerprints}")
                raise ServerFault(f"parallel replica unusable: {self._failure}", FaultCause.RANK_FAILURE)
            self._description = self._described(outcomes[0].value)
        return self.describe()

    def debug_stats(self) -> dict[str, Any]:
        """Rank 0's plan bookkeeping (with `model`), `sp`, and every rank's under `ranks` (they must match)."""
        self._check_usable()
        stats = self._answers([rank.debug_stats.remote() for rank in self.ranks], self.timeout_s, "debug_stats")
        return {**stats[0], "busy": self._busy, "sp": self.sp, "ranks": stats}

    def slab_state(self) -> SlabState:
        """Rank 0's slab state (every rank's slab holds the same plans) as of its last answer; never waits:
        reads the answer to the question sent last time (if in) and sends the next one."""
        if self._failure is not None:
            return NO_SLAB
        query = self._slab_query
        if query is not None:
            ready, _ = ray.wait([query], timeout=0)
            if not ready:
                return self._slab_state
            outcome = _outcome_of(0, query)
            self._slab_state = outcome.value if isinstance(outcome.value, SlabState) else NO_SLAB
        self._slab_query = self.ranks[0].slab_state.remote()
        return self._slab_state

    def held_adapters(self) -> tuple[str, ...]:
        """Rank 0's held adapters (every rank installs the same ones) as of its last answer; never waits, as
        `slab_state`."""
        if self._failure is not None:
            return ()
        query = self._adapters_query
        if query is not None:
            ready, _ = ray.wait([query], timeout=0)
            if not ready:
                return self._held_adapters
            outcome = _outcome_of(0, query)
            self._held_adapters = tuple(outcome.value) if isinstance(outcome.value, tuple) else ()
        self._adapters_query = self.ranks[0].held_adapters.remote()
        return self._held_adapters

    def prefetch_adapters(self, request: GenerationRequest) -> None:
        """Every rank starts reading the request's cold adapters (fire and forget: a rank that cannot read one
        raises it from the generation)."""
        if self._failure is None and request.adapters:
            for rank in self.ranks:
                rank.prefetch_adapters.remote(request)

    def health(self) -> dict[str, Any]:
        """Never waits: raises ServerFault once the replica is unusable (a rank died, did not answer its last
        health probe within `timeout_s`, or reported its group failed), so Serve replaces the replica."""
        self._check_usable()
        now = time.monotonic()
        probe = self._probe
        if probe is not None:
            ready, pending = ray.wait(probe.refs, num_returns=len(probe.refs), timeout=0)
            outcomes = [_outcome_of(rank, ref) for rank, ref in enumerate(probe.refs) if ref in ready]
            failed = [outcome for outcome in outcomes if outcome.error is not None or outcome.lost is not None]
            if failed:
                self._fail(self._cause(failed))
            elif pending and now - probe.started > self.timeout_s:
                late = [rank for rank, ref in enumerate(probe.refs) if ref in pending]
                self._fail(f"rank(s) {late} did not answer a health check within timeout_s={self.timeout_s:g}")
            self._check_usable()
            if pending:
                return self._health()
        self._probe = _HealthProbe([rank.health.remote() for rank in self.ranks], now)
        return self._health()

    def describe(self) -> dict[str, Any]:
        """Rank 0's description (cached: updated by weight updates) with `parallel`."""
        return self._description

    def close(self) -> None:
        """Stop the ranks and give back this coordinator's own placement group (idempotent)."""
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)
        if self._own_group is not None:
            remove_placement_group(self._own_group)
            self._own_group = None

    # --- waiting on the ranks --------------------------------------------------------------------------

    def _await_generation(self, request_id: int, refs: list[ray.ObjectRef], progress: ProgressFn | None,
                          cancelled: CancelledFn | None) -> tuple[list[RankOutcome], int]:
        """Every rank's outcome of one generation and the forwards reported; meanwhile rank 0's progress goes
        to `progress` and the caller's cancel to every rank."""
        reported = 0
        parallel = self.config.parallel
        started = time.monotonic()
        outcomes: dict[int, RankOutcome] = {}
        pending = dict(zip(refs, range(self.sp)))
        first_failure: float | None = None
        cancel_sent = False
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
            for ref in ready:
                rank = pending.pop(ref)
                outcome = outcomes[rank] = _outcome_of(rank, ref)
                if first_failure is None and (outcome.error is not None or outcome.lost is not None):
                    first_failure = time.monotonic()
            now = time.monotonic()
            if first_failure is not None and now - first_failure > self.timeout_s + FAILURE_GRACE_S:
                reason = f"did not finish within timeout_s={self.timeout_s:g} (+{FAILURE_GRACE_S:g} s) of another " \
                         "rank failing"
            elif parallel.request_timeout_s is not None and now - started > parallel.request_timeout_s:
                reason = f"did not finish within request_timeout_s={parallel.request_timeout_s:g}"
            else:
                reason = None
            if reason is not None:
                for rank in pending.values():
                    outcomes[rank] = RankOutcome(rank, lost=reason)
                break
            if progress is not None and 0 not in outcomes:
                reported = self._report_progress(request_id, progress, reported)
            if cancelled is not None and not cancel_sent and pending and cancelled():
                for rank in self.ranks:  # rank 0's flag decides, at the next step boundary of every rank
                    rank.cancel.remote(request_id)
                cancel_sent = True
        return [outcomes[rank] for rank in range(self.sp)], reported

    def _report_progress(self, request_id: int, progress: ProgressFn, reported: int) -> int:
        """Call `progress` for every forward rank 0 finished since `reported`; returns the new count."""
        try:
            done, total = ray.get(self.ranks[0].progress.remote(request_id), timeout=self.timeout_s)
        except (RayActorError, GetTimeoutError):
            return reported  # rank 0 died or hangs: its generate call (or its peers' collectives) will tell
        for step in range(reported + 1, done + 1):
            progress(step, total)
        return max(reported, done)

    def _started(self, refs: list[ray.ObjectRef], what: str) -> list[Any]:
        """Every rank's answer to one start step within load_timeout_s; else ParallelStartError (a rank lost)
        or the error a rank raised (e.g. the checkpoint's CheckpointError), as raised."""
        outcomes = self._collect(refs, self.config.parallel.load_timeout_s, what)
        for outcome in outcomes:
            if outcome.lost is not None:
                raise ParallelStartError(f"start: rank {outcome.rank} of {self.sp} {outcome.lost}")
        for outcome in outcomes:
            if outcome.error is not None:
                raise outcome.error
        return [outcome.value for outcome in outcomes]

    def _collect(self, refs: list[ray.ObjectRef], timeout_s: float, what: str) -> list[RankOutcome]:
        """Every rank's outcome of one call, waiting at most `timeout_s` for all of them."""
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        ready_set = set(ready)
        return [_outcome_of(rank, ref) if ref in ready_set else
                RankOutcome(rank, lost=f"did not answer {what} within {timeout_s:g} s") for rank, ref in enumerate(refs)]

    def _answers(self, refs: list[ray.ObjectRef], timeout_s: float, what: str) -> list[Any]:
        """Every rank's answer to one call (see `_values`)."""
        return self._values(self._collect(refs, timeout_s, what), what)

    def _values(self, outcomes: list[RankOutcome], what: str) -> list[Any]:
        """The ranks' values, or: ServerFault (replica unusable) when a rank is lost or the ranks disagree (some
        answered, some raised) or a rank's group failed; else the error every rank raised (rank 0's)."""
        errors = [outcome for outcome in outcomes if outcome.error is not None]
        if not errors and all(outcome.lost is None for outcome in outcomes):
            return [outcome.value for outcome in outcomes]
        if any(outcome.lost is not None for outcome in outcomes) or len(errors) != len(outcomes):
            self._fail(f"{what}: {self._cause(outcomes)}")
        elif any(isinstance(outcome.error, ServerFault) or not isinstance(outcome.error, EngineError)
                 for outcome in errors):
            self._confirm_healthy(what)  # a fault may have broken the group; a client error or cancel cannot
        if self._failure is not None:
            raise ServerFault(f"parallel replica unusable: {self._failure}", FaultCause.RANK_FAILURE) from (
                errors[0].error if errors else None)
        raise errors[0].error

    def _confirm_healthy(self, what: str) -> None:
        """After every rank raised: the group survived unless a rank says otherwise (e.g. a collective failed)."""
        outcomes = self._collect([rank.health.remote() for rank in self.ranks], self.timeout_s, "health")
        failed = [outcome for outcome in outcomes if outcome.error is not None or outcome.lost is not None]
        if failed:
            self._fail(f"{what} failed on every rank and left a rank unusable: {self._cause(failed)}")

    def _cause(self, outcomes: list[RankOutcome]) -> str:
        """The first cause in `outcomes`: a lost rank before an error (a peer's CollectiveError is its echo)."""
        for outcome in outcomes:
            if outcome.lost is not None:
                return f"rank {outcome.rank} of {self.sp} {outcome.lost}"
        for outcome in outcomes:
            if outcome.error is not None:
                return f"rank {outcome.rank} of {self.sp} raised {_first_line(outcome.error)}"
        return "the ranks disagreed"

    def _fail(self, cause: str) -> None:
        """Mark the replica unusable (the first cause is kept) and stop its ranks."""
        if self._failure is None:
            self._failure = cause
            logger.error("parallel replica unusable: %s; stopping its %d ranks", cause, self.sp)
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise ServerFault(f"parallel replica unusable: {self._failure}", FaultCause.RANK_FAILURE)

    def _described(self, description: dict[str, Any]) -> dict[str, Any]:
        return {**description, "parallel": {"sp": self.sp}}

    def _health(self) -> dict[str, Any]:
        return {"status": "ok", "sp": self.sp, "busy": self._busy, "requests": self._num_requests,
                "failed": self._num_failed}
