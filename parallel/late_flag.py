"""One rank's yes/no at every step boundary, agreed on by every rank one boundary late (the engine's cancel flag).

Agreeing at once means the host waits for a broadcast queued behind the whole previous forward: on NCCL that
drains the GPU queue every step (and building the flag from a host int, `torch.tensor(..., device=cuda)`, is a
blocking copy that drains it too). Here boundary i starts broadcasting rank `src`'s flag of boundary i and
returns the flag broadcast at boundary i - 1: by then that broadcast is one forward old, so the host waits for
nothing but it. Every rank reads the same broadcast at the same boundary, so every rank stops at the same one.

    late = LateFlag(group)                        # per loop, on every rank
    for i in range(n):
        if late.exchange(rank_0_wants_to_stop()): # boundary i: rank 0's answer at boundary i - 1
            late.finish(); stop
        ...forward i...
    if late.finish(): ...                         # the last boundary's answer (a stop asked for during the loop)

A flag raised at boundary i therefore takes effect at boundary i + 1 (or at `finish`): one more forward runs.
The host waits are bounded by the group's timeout (a dead peer raises `CollectiveError`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from parallel.group import HostCheck, SpGroup


@dataclass(eq=False)
class _InFlight:
    check: HostCheck  # the broadcast's host wait
    host: Tensor  # int32 [1]: the broadcast flag on the host (pinned copy on CUDA, the flag itself on CPU)
    copied: torch.cuda.Event | None  # recorded after the device -> host copy (CUDA only)


class LateFlag:
    """Rank `src`'s flag, the same on every rank, one `exchange` late. Every rank of `group` calls `exchange`
    the same number of times, then `finish` once (each is a collective)."""

    def __init__(self, group: SpGroup, src: int = 0):
        self.group = group
        self.src = src
        self._in_flight: _InFlight | None = None

    def exchange(self, local: bool) -> bool:
        """Start agreeing on this boundary's flag (rank `src`'s `local`); return the previous boundary's agreed
        flag (False at the first boundary)."""
        previous, self._in_flight = self._in_flight, self._start(local)
        return self._read(previous) if previous is not None else False

    def finish(self) -> bool:
        """The last boundary's agreed flag (False if `exchange` was never called); the flag is then done."""
        last, self._in_flight = self._in_flight, None
        return self._read(last) if last is not None else False

    def _start(self, local: bool) -> _InFlight:
        device = self.group.device
        # A fill kernel, not a host -> device copy: a pageable copy would wait for the whole queue.
        flag = torch.full((1,), int(local), dtype=torch.int32, device=device)
        check = self.group.start_broadcast(flag, self.src).wait_stream()
        if device.type != "cuda":
            return _InFlight(check, flag, None)
        host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        host.copy_(flag, non_blocking=True)  # queued behind the broadcast (the stream waits for it)
        copied = torch.cuda.Event()
        copied.record()
        return _InFlight(check, host, copied)

    @staticmethod
    def _read(flag: _InFlight) -> bool:
        flag.check.wait()  # bounded: the broadcast done (or CollectiveError)
        if flag.copied is not None:
            # Only the copy behind the broadcast, not the forward queued after it; without this the host
            # could read the pinned bytes before the copy lands.
            flag.copied.synchronize()
        return bool(flag.host.item())
