"""parallel.group: a replica's process group on gloo (2 spawned CPU processes), and what a dead or silent rank does.

Ranks run in processes started by `parallel.launch.launch_local`; each writes what it saw to a file the tests read.
The launcher's deadline kills a rank that is still running and reports it as hung, so "no hang" is checked as
"the surviving rank exited by itself" (`RankExit.exitcode == 0`), never by timing a call.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from parallel.group import CollectiveError, GroupConfigError, backend_for, init_group
from parallel.launch import RankExit, launch_local

WORLD_SIZE = 2
TIMEOUT_S = 2.0
DEADLINE_S = 60.0  # far above TIMEOUT_S: reaching it means a collective hung


def _report(out_dir: Path, rank: int, report: dict) -> None:
    torch.save(report, out_dir / f"rank{rank}.pt")


def _load(out_dir: Path, rank: int) -> dict:
    return torch.load(out_dir / f"rank{rank}.pt")


# ------------------------------------------------------------------------------------------- rank programs


def _collectives_then_kill(rank: int, world_size: int, init_method: str, out_dir: Path) -> None:
    """Exact collectives, then rank 1 is SIGKILLed and rank 0 tries two more collectives."""
    torch.set_num_threads(1)
    group = init_group(rank, world_size, init_method, "cpu", timeout_s=TIMEOUT_S)
    report: dict = {"backend": group.backend, "rank": group.rank, "world_size": group.world_size}

    sent = torch.tensor([10.0 * rank + j for j in range(4)])  # chunk j (2 values) goes to rank j
    received = torch.empty(4)
    group.all_to_all(received, sent)
    report["all_to_all"] = received.tolist()

    # Two exchanges in flight at once, waited in the other order: each gets its own bytes.
    first, second = torch.empty(4), torch.empty(4)
    pending = [group.start_all_to_all(first, sent), group.start_all_to_all(second, sent + 100.0)]
    for one in reversed(pending):
        one.wait()
    report["started"] = (first.tolist(), second.tolist())
    try:
        pending[0].wait()
    except RuntimeError as exc:
        report["waited_twice"] = str(exc)

    gathered = torch.empty(4, 2, dtype=torch.bfloat16)
    group.all_gather(gathered, torch.full((2, 2), rank + 0.5, dtype=torch.bfloat16), host_wait=True)
    report["all_gather"] = gathered[:, 0].tolist()

    token = torch.tensor([float(rank)])
    group.broadcast(token, src=1)
    report["broadcast"] = token.item()

    # The stream wait now, the host check later (the SP output gather, the late cancel flag): same values.
    gathered_later = torch.empty(4)
    check = group.start_all_gather(gathered_later, torch.full((2,), rank + 7.0)).wait_stream()
    flag = torch.tensor([float(rank + 3)])
    flag_check = group.start_broadcast(flag, src=0).wait_stream()
    check.wait()
    flag_check.wait()
    report["checked_later"] = (gathered_later.tolist(), flag.item())
    try:
        check.wait()
    except RuntimeError as exc:
        report["checked_twice"] = str(exc)

    with pytest.raises(ValueError, match="stacked 2 times"):
        group.all_gather(torch.empty(3), torch.empty(2))  # refused before any communication

    group.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        group.all_gather(torch.empty(4), torch.ones(2))
    except CollectiveError as exc:
        report["after_kill"] = str(exc)
    report["failure"] = group.failure
    try:
        group.broadcast(torch.ones(1), src=0)
    except CollectiveError as exc:
        report["again"] = str(exc)
    _report(out_dir, rank, report)
    group.destroy()


def _silent_peer(rank: int, world_size: int, init_method: str, out_dir: Path) -> None:
    """Rank 1 stays alive but never joins rank 0's collective."""
    group = init_group(rank, world_size, init_method, "cpu", timeout_s=TIMEOUT_S)
    if rank == 1:
        time.sleep(TIMEOUT_S + 2.0)
        os._exit(0)
    try:
        group.all_gather(torch.empty(4), torch.ones(2))
    except CollectiveError as exc:
        _report(out_dir, rank, {"error": str(exc)})
    group.destroy()


def _alone(rank: int, world_size: int, init_method: str, out_dir: Path) -> None:
    """The only process of a 2-rank group: the rendezvous never completes."""
    try:
        init_group(0, 2, init_method, "cpu", timeout_s=TIMEOUT_S)
    except CollectiveError as exc:
        _report(out_dir, rank, {"error": str(exc)})


# ------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple[list[RankExit], Path]:
    out_dir = tmp_path_factory.mktemp("killed")
    return launch_local(_collectives_then_kill, WORLD_SIZE, out_dir, args=(out_dir,), deadline_s=DEADLINE_S), out_dir


# ------------------------------------------------------------------------------------------- tests


def test_backend_follows_the_device():
    assert backend_for("cpu") == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"  # a device object only: no GPU needed


def test_backend_refuses_other_devices():
    with pytest.raises(GroupConfigError, match="device='meta'"):
        backend_for("meta")


@pytest.mark.parametrize("rank, world_size, device, timeout_s, message", [
    (2, 2, "cpu", 1.0, "rank=2 must be < world_size=2"),
    (-1, 2, "cpu", 1.0, "rank=-1 must be an integer >= 0"),
    (0, 0, "cpu", 1.0, "world_size=0 must be an integer >= 1"),
    (0, 2, "cpu", 0.0, "timeout_s=0.0 must be > 0"),
    (0, 2, "cuda", 1.0, "device='cuda' must name its index"),
])
def test_init_group_refuses_bad_arguments_before_any_rendezvous(rank, world_size, device, timeout_s, message,
                                                                tmp_path):
    with pytest.raises(GroupConfigError, match=message):
        init_group(rank, world_size, f"file://{tmp_path}/rendezvous", device, timeout_s=timeout_s)


def test_cpu_group_runs_on_gloo(killed):
    _, out_dir = killed
    report = _load(out_dir, 0)
    assert (report["backend"], report["rank"], report["world_size"]) == ("gloo", 0, 2)


def test_collectives_move_exact_values(killed):
    _, out_dir = killed
    report = _load(out_dir, 0)
    assert report["all_to_all"] == [0.0, 1.0, 10.0, 11.0]  # rank 0's chunk 0, then rank 1's chunk 0
    assert report["all_gather"] == [0.5, 0.5, 1.5, 1.5]  # bf16 rows of rank 0, then of rank 1
    assert report["broadcast"] == 1.0  # rank 1's value


def test_host_checks_made_after_the_stream_wait_see_the_same_values_once(killed):
    _, out_dir = killed
    report = _load(out_dir, 0)  # rank 1 is killed before it reports
    assert report["checked_later"] == ([7.0, 7.0, 8.0, 8.0], 3.0)  # rank 0's rows, then rank 1's; rank 0's flag
    assert report["checked_twice"] == "all_gather: host check made twice"


def test_started_all_to_alls_run_side_by_side_and_are_waited_once(killed):
    _, out_dir = killed
    report = _load(out_dir, 0)  # rank 1 is killed before it reports
    first, second = report["started"]
    assert first == report["all_to_all"] == [0.0, 1.0, 10.0, 11.0]
    assert second == [100.0, 101.0, 110.0, 111.0]
    assert report["waited_twice"] == "all_to_all: waited on twice"


def test_killed_rank_fails_the_survivor_instead_of_hanging(killed):
    exits, out_dir = killed
    assert exits[0] == RankExit(0, 0)  # the survivor returned by itself (no hang)
    assert exits[1].exitcode == -signal.SIGKILL
    error = _load(out_dir, 0)["after_kill"]
    assert "all_gather on rank 0/2 (gloo, timeout 2 s) failed: a peer died or stopped answering" in error


def test_failed_group_refuses_every_later_collective(killed):
    _, out_dir = killed
    report = _load(out_dir, 0)
    assert report["failure"].startswith("all_gather failed:")
    assert "broadcast on rank 0/2: the group failed earlier (all_gather failed:" in report["again"]


@pytest.mark.slow  # waits out a 2 s group timeout in fresh rank processes
def test_silent_rank_times_out_the_collective(tmp_path):
    exits = launch_local(_silent_peer, WORLD_SIZE, tmp_path, args=(tmp_path,), deadline_s=DEADLINE_S)
    assert exits == [RankExit(0, 0), RankExit(1, 0)]
    error = _load(tmp_path, 0)["error"]
    assert "all_gather on rank 0/2 (gloo, timeout 2 s) failed" in error
    assert "Timed out waiting 2000ms" in error  # gloo's own timeout, i.e. the group's


@pytest.mark.slow  # waits out a 2 s group timeout in fresh rank processes
def test_rendezvous_times_out_when_a_rank_never_joins(tmp_path):
    exits = launch_local(_alone, 1, tmp_path, args=(tmp_path,), deadline_s=DEADLINE_S)
    assert exits == [RankExit(0, 0)]
    assert "rank 0/2 could not join the group" in _load(tmp_path, 0)["error"]
    assert "within 2 s" in _load(tmp_path, 0)["error"]
