"""What the ranks of a multi-device replica agree on, outside the denoising loop (collectives over `SpGroup`).

Every rank runs every request whole; what must not differ between them is agreed on here:

- `RankAgreement.rank_0_says(local)`: rank 0's answer on every rank (cancellation before the loop; inside it the
  engine uses `parallel.late_flag`, one boundary late, so the host never waits for the GPU queue).
- `RankAgreement.prepare(plan_cache, plans)`: a request's AdaLN plans prepared on every rank, then one all-gather
  of (prepared?, digest of the slab rows) checks that every rank could and that they admitted and evicted alike
  (a deterministic function of the request sequence, the same on every rank fed the same requests in order).
- `RankShardedRebuild`: the plan cache's `RebuildShards` over the group: rank r rebuilds only its
  `parallel.adaln.AdalnShard` of the AdaLN units, then every rank gets every row.

Failures are typed here and sorted by the engine: `RankFailure` (a rank could not do its part; the group is
intact, the request fails on every rank) and `RankDivergence` (the ranks' caches differ: a bug, or ranks fed
different requests; the rank is unusable from then on, `divergence` says why).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from cache.plan_cache import PlanCache, PreparedPlans
from cache.plan_key import PlanKey
from cache.rebuild import AdalnUnit
from model.adaln import Modulation
from parallel.adaln import AdalnShard, exchange_modulation_
from parallel.group import SpGroup


class RankFailure(RuntimeError):
    """A rank could not do its part of a request (see its log); no rank ran it, the group is intact."""


class RankDivergence(RuntimeError):
    """The ranks' plan caches no longer agree; this rank cannot serve again."""


def digest(text: str) -> int:
    """A 63-bit digest of `text` (non-negative, so it fits an int64 tensor)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


class RankAgreement:
    """The engine's agreements with the other ranks of its group; `divergence`: why this rank's plan cache no
    longer matches the others' (None while they agree)."""

    def __init__(self, group: SpGroup):
        self.group = group
        self.divergence: str | None = None

    def rank_0_says(self, local: bool) -> bool:
        """Rank 0's `local` on every rank (a collective: every rank calls it at the same point). The host waits
        for the queue: used outside the denoising loop only (the loop agrees one boundary late, `LateFlag`)."""
        flag = torch.tensor([int(local)], dtype=torch.int32, device=self.group.device)
        self.group.broadcast(flag, src=0, host_wait=True)
        return bool(flag.item())

    def prepare(self, plan_cache: PlanCache | None, plans: Sequence[torch.Tensor]) -> PreparedPlans | None:
        """The request's plans, prepared on every rank, and the ranks' agreement that it worked and that they
        admitted and evicted alike (a collective). A rank that could not prepare (an unreadable shard) fails the
        request on every rank with the group intact (its own error here, `RankFailure` on the others); differing
        slab rows raise `RankDivergence` and set `divergence`."""
        prepared, error = None, None
        try:
            prepared = plan_cache.prepare(plans) if plan_cache is not None else None
        except Exception as exc:  # noqa: BLE001 - re-raised below, once the other ranks know
            error = exc
        local_digest = digest(repr(prepared.row_index.tolist())) if prepared is not None else 0
        world_size, device = self.group.world_size, self.group.device
        local = torch.tensor([int(error is None), local_digest], dtype=torch.int64, device=device)
        gathered = torch.empty(2 * world_size, dtype=torch.int64, device=device)
        try:
            self.group.all_gather(gathered, local, host_wait=True)
        except BaseException:
            if prepared is not None:
                prepared.release()
            raise
        if error is not None:
            raise error
        ok, digests = (list(column) for column in zip(*gathered.view(world_size, 2).tolist()))
        if all(ok) and len(set(digests)) == 1:
            return prepared
        if prepared is not None:
            prepared.release()
        if not all(ok):
            failed = [rank for rank, flag in enumerate(ok) if not flag]
            raise RankFailure(f"rank(s) {failed} of {world_size} could not prepare the request's AdaLN plans "
                              "(see their log); no rank ran it")
        self.divergence = f"the AdaLN plan caches of the ranks diverged: slab row digests {digests}"
        raise RankDivergence(f"rank {self.group.rank}: {self.divergence}")


class RankShardedRebuild:
    """`cache.plan_cache.RebuildShards` over this replica's group: rank r streams and projects only its
    `parallel.adaln.AdalnShard` of the AdaLN units (a contiguous run of blocks; the last rank also the final
    layer), then `exchange_modulation_` gives every rank every row, bit-identical to one rank projecting all
    of them. Before that, once per request, the ranks check that their plan caches missed the same plans
    (a digest of the keys): caches that diverged fail the request on every rank (`RankDivergence`) instead of
    pairing mismatched collectives, and leave `divergence` set (the engine then reports unhealthy). A share that
    failed on one rank (its shard unreadable) fails the rebuild on every rank before the exchange (`failed_ranks`),
    the group intact."""

    def __init__(self, group: SpGroup, num_blocks: int):
        self.group = group
        self.shard = AdalnShard.of(num_blocks, group.rank, group.world_size)
        self.divergence: str | None = None

    def agree(self, rest: Sequence[PlanKey], missed: Sequence[bool]) -> list[bool]:
        world_size, device = self.group.world_size, self.group.device
        local = torch.tensor([len(rest), digest(repr(list(rest)))], dtype=torch.int64, device=device)
        gathered = torch.empty(2 * world_size, dtype=torch.int64, device=device)
        self.group.all_gather(gathered, local, host_wait=True)
        if len({tuple(row) for row in gathered.view(world_size, 2).tolist()}) > 1:
            counts = gathered.view(world_size, 2)[:, 0].tolist()
            self.divergence = f"the AdaLN plan caches of the ranks diverged: plans to rebuild per rank {counts}"
            raise RankDivergence(f"rank {self.group.rank}: {self.divergence}")
        if not rest:
            return []
        flags = torch.tensor(list(missed), dtype=torch.int32, device=device)
        every_ranks = torch.empty(world_size * len(rest), dtype=torch.int32, device=device)
        self.group.all_gather(every_ranks, flags, host_wait=True)
        return every_ranks.view(world_size, len(rest)).amax(dim=0).bool().tolist()

    def select(self, units: Sequence[AdalnUnit]) -> list[AdalnUnit]:
        return self.shard.select(units)

    def failed_ranks(self, failed: bool) -> list[int]:
        flags = torch.empty(self.group.world_size, dtype=torch.int32, device=self.group.device)
        local = torch.tensor([int(failed)], dtype=torch.int32, device=self.group.device)
        self.group.all_gather(flags, local, host_wait=True)
        return [rank for rank, flag in enumerate(flags.tolist()) if flag]

    def exchange_(self, blocks: torch.Tensor, final: torch.Tensor) -> None:
        exchange_modulation_(Modulation(blocks=blocks, final=final), self.shard, self.group)
