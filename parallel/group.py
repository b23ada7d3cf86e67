"""One replica's torch.distributed process group, every collective bounded by a timeout.

A multi-GPU replica is N processes (one per device) that run the same denoising loop; `init_group` joins this
process to its replica's group and returns the `SpGroup` the sequence-parallel attention, the Cache-DiT decision
and the AdaLN exchange talk through. The backend follows the device: NCCL for CUDA tensors, gloo for CPU tensors
(so CI runs the same code on CPU).

How "a dead rank is an error, never a hang" is achieved, and what each piece covers:

1. `init_process_group(timeout=...)`: the rendezvous fails after `timeout` when a rank never shows up, and the
   timeout becomes the process group's. Any subgroup made later with `dist.new_group` must get `timeout=` too:
   it does not inherit this one (it gets torch's default, 10 min for NCCL and 30 min for gloo).
2. gloo applies that timeout to every operation itself: a peer that is gone makes the op fail at once
   ("Connection reset by peer"), a peer that is alive but never joins makes it fail after `timeout`.
3. NCCL runs collectives asynchronously on the GPU stream; the host thread returns at once. A stuck NCCL
   collective is seen by the process group's watchdog thread after `timeout`, which then aborts the communicator
   and (TORCH_NCCL_ASYNC_ERROR_HANDLING's default) ends the process: the actor dies and Ray reports it. To get a
   Python exception in the calling thread instead, a collective issued with `host_wait=True` blocks the host on
   `Work.wait(timeout)`, which raises after `timeout`. The sequence-parallel forward checks its output gather
   that way, but one forward late (`PendingCollective.wait_stream` now, `HostCheck.wait` when the next forward's
   gather is issued, and once more at the end of the loop): collectives are stream-ordered, so a hang in any
   collective of forward i surfaces there, raised by forward i + 1 or the loop's end, while the host never drains
   the GPU queue in between. The hot-path collectives (attention all-to-alls) never block the host.
   Seen on 2 H200s: with the peer killed, the survivor's forward raised CollectiveError after the 15 s timeout,
   and the watchdog then logged that it takes the process down. A GPU worker that must live on to report the
   error sets TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (abort the communicator, keep the process: torch's documented
   mode, not tried here) before `init_group`; otherwise its death is the report (Ray raises ActorDiedError in
   the coordinator).
4. After a failed collective the group is unusable (an NCCL communicator is left in an undefined state, the
   ranks disagree on what ran): `SpGroup` remembers the failure and refuses every later collective with it, so
   a caught error cannot turn into a hang at the next collective. The replica must be torn down and rebuilt.
   No group is ever torn down in-process: a rank's process leaves with `os._exit` (`parallel.launch`) or is
   killed by its coordinator (the GPU worker actors). Seen on CPU, on a loaded 2-core machine, in about one
   full-suite run in three: a rank whose gloo peer had exited (or been SIGKILLed) died of SIGABRT in
   `destroy_process_group` or interpreter exit, after its work was done and reported.
5. Not covered here: a rank stuck outside any collective (in host code or a kernel that never ends) makes its
   peers fail at their next collective, but it stays stuck itself. The coordinator that owns the rank actors
   must bound its own wait (`ray.get(..., timeout=)`) and kill such an actor.

Every rank must issue the same collectives in the same order. Data-dependent branches that contain collectives
(Cache-DiT's compute-or-skip decision) must therefore decide identically on every rank: `parallel.cache_decision`.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

#: Default bound on the rendezvous and on every collective. A forward's largest collective on the real model
#: (the q, k, v all-to-all at 62k tokens, under 2 GB per rank) takes milliseconds over NVLink.
DEFAULT_TIMEOUT_S = 60.0

BACKEND_FOR_DEVICE_TYPE = {"cpu": "gloo", "cuda": "nccl"}

T = TypeVar("T")

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); older torch has the old one.
_all_gather_single = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor


class GroupConfigError(ValueError):
    """A rank, world size, device or timeout that cannot form a group; names the value and the rule."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer died or stopped answering). The group is unusable afterwards."""


def backend_for(device: torch.device | str) -> str:
    """The process group backend for tensors on `device`: gloo for cpu, nccl for cuda."""
    device = torch.device(device)
    try:
        return BACKEND_FOR_DEVICE_TYPE[device.type]
    except KeyError:
        raise GroupConfigError(
            f"device={str(device)!r}: sequence parallel runs on {sorted(BACKEND_FOR_DEVICE_TYPE)} devices"
        ) from None


@dataclass(eq=False)
class SpGroup:
    """This process's place in its replica's group, and the collectives the parallel code uses.

    Tensors passed to collectives must be on `device`. Collectives of this class are synchronous from the
    caller's view: on gloo the host waits; on NCCL the current stream waits (and the host too with
    `host_wait=True`, bounded by `timeout`).
    """

    rank: int
    world_size: int
    device: torch.device
    backend: str
    timeout: datetime.timedelta
    process_group: dist.ProcessGroup
    _failure: str | None = field(default=None, repr=False)

    @property
    def failure(self) -> str | None:
        """Why the group is unusable (the first failed collective), or None while it is healthy."""
        return self._failure

    # --- collectives ----------------------------------------------------------------------------------

    def all_to_all(self, output: Tensor, input: Tensor, *, host_wait: bool = False) -> None:
        """Equal split along dim 0: chunk j of `input` goes to rank j; chunk i of `output` comes from rank i."""
        self.start_all_to_all(output, input).wait(host_wait=host_wait)

    def start_all_to_all(self, output: Tensor, input: Tensor) -> PendingCollective:
        """`all_to_all`, returned before it is done: the caller computes on, then calls `wait()` before it
        reads `output` (or writes `input`). On NCCL the exchange runs on the communicator's stream beside the
        caller's kernels; on gloo on gloo's threads beside the caller's host code."""
        if input.shape != output.shape or input.shape[0] % self.world_size:
            raise ValueError(f"all_to_all: input {list(input.shape)} and output {list(output.shape)} must have "
                             f"one shape whose dim 0 divides by the world size {self.world_size}")
        self._check_tensors("all_to_all", input, output)
        return self._start("all_to_all", lambda: dist.all_to_all_single(
            output, input, group=self.process_group, async_op=True), (output, input))

    def all_gather(self, output: Tensor, input: Tensor, *, host_wait: bool = False) -> None:
        """`output` ([world_size * n, ...]) receives every rank's `input` ([n, ...]) in rank order."""
        self.start_all_gather(output, input).wait(host_wait=host_wait)

    def start_all_gather(self, output: Tensor, input: Tensor) -> PendingCollective:
        """`all_gather`, returned before it is done (`wait()` or `wait_stream()` before `output` is read)."""
        if output.shape[0] != self.world_size * input.shape[0] or output.shape[1:] != input.shape[1:]:
            raise ValueError(f"all_gather: output {list(output.shape)} must be input {list(input.shape)} "
                             f"stacked {self.world_size} times along dim 0")
        self._check_tensors("all_gather", input, output)
        return self._start("all_gather", lambda: _all_gather_single(
            output, input, group=self.process_group, async_op=True), (output, input))

    def start_broadcast(self, tensor: Tensor, src: int) -> PendingCollective:
        """`broadcast`, returned before it is done (`wait()` or `wait_stream()` before `tensor` is read)."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src={src} is not a rank of this group (world size {self.world_size})")
        self._check_tensors("broadcast", tensor, tensor)
        return self._start("broadcast", lambda: dist.broadcast(
            tensor, group=self.process_group, group_src=src, async_op=True), (tensor,))

    def all_reduce(self, tensor: Tensor, *, host_wait: bool = False) -> None:
        """Every rank's `tensor` becomes the sum of every rank's `tensor` (in place; the same bits on every rank)."""
        self._check_tensors("all_reduce", tensor, tensor)
        self._run("all_reduce", lambda: dist.all_reduce(
            tensor, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True), host_wait)

    def broadcast(self, tensor: Tensor, src: int, *, host_wait: bool = False) -> None:
        """Every rank's `tensor` becomes rank `src`'s (a rank of this group)."""
        self.start_broadcast(tensor, src).wait(host_wait=host_wait)

    def broadcast_object(self, value: T | None, src: int, kind: type[T]) -> T:
        """Rank `src`'s `value` (an instance of `kind`, pickled) on every rank; the other ranks pass None. Two
        bounded broadcasts (the length, then the bytes) with the host waiting: outside the denoising loop only
        (a request's preparation made on rank 0). TypeError on `src` when `value` is not a `kind`."""
        if self.rank == src:
            if not isinstance(value, kind):
                raise TypeError(f"broadcast_object: rank {src} sends a {type(value).__name__}, not a {kind.__name__}")
            payload = torch.frombuffer(bytearray(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)),
                                       dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        else:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(length, src, host_wait=True)
        data = (payload.to(self.device) if self.rank == src
                else torch.empty(int(length.item()), dtype=torch.uint8, device=self.device))
        self.broadcast(data, src, host_wait=True)
        if self.rank == src:
            return value
        received = pickle.loads(data.cpu().numpy().tobytes())  # the ranks of one replica: one trusted program
        if not isinstance(received, kind):
            raise TypeError(f"broadcast_object: rank {src} sent a {type(received).__name__}, not a {kind.__name__}")
        return received

    def barrier(self) -> None:
        """Return once every rank got here (host-blocking, bounded by `timeout`)."""
        token = torch.zeros(self.world_size, device=self.device)
        self.all_to_all(torch.empty_like(token), token, host_wait=True)

    def destroy(self) -> None:
        """Leave the group: wait until every rank got here (a healthy group), then refuse every later
        collective. The process group itself is not torn down (gloo's teardown aborted processes whose peer
        closed first, point 4): the process then exits with `os._exit` (`parallel.launch` does) or is killed
        by its coordinator."""
        if self._failure is None:
            self.barrier()
        self._failure = self._failure or "the group was destroyed"

    # --- plumbing ---------------------------------------------------------------------------------------

    def _check_tensors(self, op: str, input: Tensor, output: Tensor) -> None:
        for name, tensor in (("input", input), ("output", output)):
            if tensor.device != self.device:
                raise ValueError(f"{op}: {name} is on {tensor.device}, this group's device is {self.device}")
            if not tensor.is_contiguous():
                raise ValueError(f"{op}: {name} must be contiguous")
        if input.dtype != output.dtype:
            raise ValueError(f"{op}: input is {input.dtype}, output is {output.dtype}")

    def _run(self, op: str, launch: Callable[[], dist.Work], host_wait: bool) -> None:
        self._start(op, launch, ()).wait(host_wait=host_wait)

    def _start(self, op: str, launch: Callable[[], dist.Work], tensors: tuple[Tensor, ...]) -> PendingCollective:
        if self._failure is not None:
            raise CollectiveError(f"{op} on rank {self.rank}/{self.world_size}: the group failed earlier "
                                  f"({self._failure}); rebuild the replica")
        try:
            work = launch()
        except RuntimeError as exc:
            raise self._failed(op, exc) from exc
        return PendingCollective(self, op, work, tensors)

    def _failed(self, op: str, exc: RuntimeError) -> CollectiveError:
        """Remember the first failure (the group is unusable after it) and the error to raise."""
        self._failure = self._failure or f"{op} failed: {exc}"
        return CollectiveError(
            f"{op} on rank {self.rank}/{self.world_size} ({self.backend}, timeout "
            f"{self.timeout.total_seconds():g} s) failed: a peer died or stopped answering: {exc}")


@dataclass(eq=False)
class PendingCollective:
    """A collective started by `SpGroup.start_*`; `wait` once before its output is read. It holds its tensors,
    so their memory cannot be handed to another tensor while the exchange still reads or writes it."""

    group: SpGroup
    op: str
    work: dist.Work | None
    tensors: tuple[Tensor, ...]

    def wait(self, *, host_wait: bool = False) -> None:
        """Order the caller after the collective: on NCCL the current stream waits for it (and the host too,
        bounded by the group's timeout, with `host_wait`); gloo always waits on the host. A failure raises
        CollectiveError and leaves the group unusable."""
        if self.work is None:
            raise RuntimeError(f"{self.op}: waited on twice")
        work, self.work, self.tensors = self.work, None, ()
        try:
            # wait(timeout) blocks the host until the op is done or raises after `timeout`; wait() with no
            # timeout only orders the current stream after it on NCCL (gloo always waits on the host).
            if host_wait:
                work.wait(self.group.timeout)
            else:
                work.wait()
        except RuntimeError as exc:  # DistBackendError, DistNetworkError, gloo/NCCL timeouts
            raise self.group._failed(self.op, exc) from exc

    def wait_stream(self) -> HostCheck:
        """`wait()` without the host wait, and that host wait handed back for later: from here on the caller's
        stream may read the output (as after `wait()`), and `HostCheck.wait()` later blocks the host until the
        collective is done (bounded by the group's timeout), raising CollectiveError if it failed. On NCCL the
        host thus never waits here, so it does not drain the GPU queue; gloo has already waited on the host
        (and raised), so the check then returns at once."""
        work, tensors = self.work, self.tensors
        self.wait()
        return HostCheck(self.group, self.op, work, tensors)


@dataclass(eq=False)
class HostCheck:
    """The host-side wait of a collective whose stream wait was already made (`PendingCollective.wait_stream`).
    `wait` once; it holds the collective's tensors until then."""

    group: SpGroup
    op: str
    work: dist.Work | None
    tensors: tuple[Tensor, ...]

    def wait(self) -> None:
        """Block the host until the collective is done, at most the group's timeout; CollectiveError if it failed
        or timed out (the group is unusable afterwards)."""
        if self.work is None:
            raise RuntimeError(f"{self.op}: host check made twice")
        work, self.work, self.tensors = self.work, None, ()
        try:
            work.wait(self.group.timeout)
        except RuntimeError as exc:
            raise self.group._failed(self.op, exc) from exc


def init_group(rank: int, world_size: int, init_method: str, device: torch.device | str, *,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> SpGroup:
    """Join this process to its replica's group (the process's default torch.distributed group).

    `init_method`: a `file://` path (fresh per group) or `tcp://host:port` every rank passes identically.
    `device`: this rank's device (`cuda:i` must name its index; it becomes the current CUDA device).
    Raises GroupConfigError for bad arguments, CollectiveError when the rendezvous fails or times out.
    """
    for name, value, low in (("world_size", world_size, 1), ("rank", rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise GroupConfigError(f"{name}={value!r} must be an integer >= {low}")
    if rank >= world_size:
        raise GroupConfigError(f"rank={rank} must be < world_size={world_size}")
    if not timeout_s > 0:
        raise GroupConfigError(f"timeout_s={timeout_s!r} must be > 0")
    device = torch.device(device)
    backend = backend_for(device)
    if device.type == "cuda":
        if device.index is None:
            raise GroupConfigError(f"device={str(device)!r} must name its index (cuda:i)")
        torch.cuda.set_device(device)
    if dist.is_initialized():
        raise GroupConfigError("this process already belongs to a process group: one replica group per process")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(
            backend=backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout,
            # NCCL: bind the communicator to this device now (eager init) instead of at the first collective.
            device_id=device if device.type == "cuda" else None,
        )
    except (RuntimeError, ValueError) as exc:  # DistStoreError (rendezvous timeout) is a RuntimeError
        raise CollectiveError(f"rank {rank}/{world_size} could not join the group at {init_method} within "
                              f"{timeout_s:g} s: {exc}") from exc
    return SpGroup(rank=rank, world_size=world_size, device=device, backend=backend, timeout=timeout,
                   process_group=dist.group.WORLD)
