"""parallel.sequence: Ulysses sequence parallel (degree 2, gloo, 2 spawned CPU processes) against the one-process
forward of diffusers' MiniMax-H3 transformer on the same inputs.

Models: the tiny seed-0 transformer (`model.tiny.tiny_transformer`: 2 heads of 32, 4 blocks, bf16 blocks and the
published fp32 tensors) and an odd-shaped one (6 heads of 32, so 3 heads per rank, 3 blocks). Inputs: t2va
requests built by `model.denoise.Denoiser` for tiny geometries, with even and odd packed lengths (an odd one
needs a pad row on the last rank).

Tolerance: none; SP2 must equal the one-process forward bit for bit on CPU, and that is what is asserted.
Why exact is the right expectation here: sharding changes which rows and heads one kernel call holds, never the
order of any reduction. Row-local ops (norms, modulation, rotary, MLP, the projections' GEMMs, which reduce
over K per output element) do not depend on how many rows the call has; torch's CPU attention kernel reduces
each (query row, head) over the keys in fixed-size key blocks from the first key, whatever the number of
query rows and heads in the call; the key cut gives attention exactly the S real keys of the one-process run;
the all-to-alls and the gather only move bytes. Measured while writing this: max abs diff 0.0 on every case
below and also at S = 814 rows. On GPUs exactness is not promised (cuBLAS picks GEMM kernels by row count).
Measured with this code on 2 H200s (NCCL) against one H200, random weights, 4 blocks at H3 width (56 heads of
128): outputs bit-identical at 37,811 rows; at 9,839 rows video bit-identical and audio off by 3.2e-6 on
values of magnitude ~2 (fp32 rounding in the fp32 output heads; a bf16 difference in the blocks would show
as ~1e-2); an 8-forward tiny loop off by at most 4.8e-7.

The one-process reference runs in the pytest process (no process group at all); the SP2 runs in the ranks.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor

from model.adaln import ExternalModulation, adaln_input, resident_modulation
from model.denoise import Denoiser, TransformerInputs, denoise
from model.geometry import GeometryLimits, VideoGeometry
from model.schedule import H3Schedule
from model.text_memo import RefinedTextMemo
from model.tiny import TINY_TRANSFORMER, tiny_transformer
from parallel.launch import RankExit, launch_local
from parallel.group import CollectiveError
from parallel.sequence import Exchange, OutputChecks, SequenceParallelError, check_degree, valid_degrees

pytestmark = pytest.mark.slow  # spawns gloo rank processes (the inner loop keeps test_parallel_adaln's)

WORLD_SIZE = 2
TIMEOUT_S = 20.0
ANY_CANVAS = GeometryLimits(short_edge=None, min_seconds=0.0)

#: (name, heads, blocks, num_text_tokens, frames, width, height) -> packed rows
#:   tiny-even: 6 text + 16 audio + 8 video = 30 rows: 15 per rank, no pad
#:   tiny-odd:  7 text + 16 audio + 8 video = 31 rows: 16 per rank, 1 pad row on rank 1
#:   wide-odd:  41 text + 74 audio + 84 video = 199 rows on 6 heads (3 per rank): 100 per rank, 1 pad
CASES = {
    "tiny-even": (2, 4, 6, 5, 64, 64),
    "tiny-odd": (2, 4, 7, 5, 64, 64),
    "wide-odd": (6, 3, 41, 22, 128, 96),
}
#: Exchanges run on a model of 12 heads (6 per rank: head chunks of 6, 3, 2 or 1 heads), 2 blocks, on
#: wide-odd's inputs. (overlap, head_chunks asked) -> chunks used: the largest divisor of 6 not above the ask.
EXCHANGES = [(False, 1), (True, 1), (True, 2), (True, 3), (False, 3), (True, 4), (True, 6), (True, 64)]
EXCHANGE_HEADS, EXCHANGE_BLOCKS = 12, 2
DENOISE_STEPS = 5  # sigma grid points: 4 forwards
DENOISE_SEED = 7


def build_transformer(heads: int, blocks: int):
    config = TINY_TRANSFORMER.model_copy(update={"num_attention_heads": heads, "num_layers": blocks})
    return tiny_transformer(seed=0, config=config)


def geometry_of(frames: int, width: int, height: int) -> VideoGeometry:
    return VideoGeometry.from_frames(width, height, frames, limits=ANY_CANVAS)


def text_embeds(num_text_tokens: int) -> Tensor:
    return torch.randn(num_text_tokens, 32, generator=torch.Generator().manual_seed(num_text_tokens)).bfloat16()


def request(case: str, step: int = 1) -> TransformerInputs:
    """Forward `step` (two distinct timesteps) of a seeded t2va request of `case`."""
    _, _, num_text_tokens, frames, width, height = CASES[case]
    denoiser = Denoiser(geometry_of(frames, width, height), H3Schedule.build(DENOISE_STEPS), num_text_tokens)
    return denoiser.transformer_inputs(step, denoiser.initial_latents(3), text_embeds(num_text_tokens))


def positional_call(transformer, inputs: TransformerInputs) -> tuple[Tensor, Tensor]:
    """The transformer called with positional arguments (as tests/test_h3_offload_cachedit.py calls it)."""
    video, audio = transformer(
        inputs.hidden_states, inputs.audio_hidden_states, inputs.encoder_hidden_states, inputs.timestep,
        inputs.timestep_indices, inputs.token_tags, inputs.position_ids, inputs.video_indices,
        inputs.audio_indices, inputs.text_indices, return_dict=False)
    return video[0], audio[0]


# ------------------------------------------------------------------------------------------- the ranks


def _rank_program(rank: int, world_size: int, init_method: str, out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    from parallel.group import CollectiveError, init_group
    from parallel.sequence import SequenceParallel

    group = init_group(rank, world_size, init_method, "cpu", timeout_s=TIMEOUT_S)
    report: dict = {}
    with torch.no_grad():
        for case, (heads, blocks, *_) in CASES.items():
            transformer = build_transformer(heads, blocks)
            sp = SequenceParallel.install(transformer, group)
            block_rows: list[tuple[int, int]] = []  # (rows a block sees, real rows among them)
            probe = transformer.transformer_blocks[0].register_forward_pre_hook(
                lambda module, args: block_rows.append((args[0].shape[1], sp.num_local_real_rows)))
            report[case] = request(case).run(transformer)
            report[f"{case}/block_rows"] = block_rows
            if case == "tiny-odd":
                report[f"{case}/positional"] = positional_call(transformer, request(case))
                with pytest.raises(RuntimeError, match="already installed"):
                    SequenceParallel.install(transformer, group)
                probe.remove()
                sp.remove()
                if rank == 0:  # alone: a forward still sharded would wait for rank 1 and fail
                    report[f"{case}/removed"] = request(case).run(transformer)

        # Every way of running the exchange: the same bits (only when the all-to-alls run changes).
        for overlap, head_chunks in EXCHANGES:
            transformer = build_transformer(EXCHANGE_HEADS, EXCHANGE_BLOCKS)
            sp = SequenceParallel.install(transformer, group, Exchange(overlap=overlap, head_chunks=head_chunks))
            report[f"exchange/{overlap}/{head_chunks}"] = request("wide-odd").run(transformer)
            report[f"exchange/{overlap}/{head_chunks}/chunks"] = sp.chunks_for(EXCHANGE_HEADS)

        # The AdaLN seam under SP: blocks fed precomputed rows (model.adaln) instead of their projections.
        resident = build_transformer(2, 4)
        external_model = build_transformer(2, 4)
        external = ExternalModulation.install(external_model)
        SequenceParallel.install(external_model, group)
        inputs = request("tiny-odd")
        external.set(resident_modulation(resident, adaln_input(resident, inputs.timestep)))
        report["external"] = inputs.run(external_model)

        # The whole denoising loop, unchanged, on a sharded transformer.
        transformer = build_transformer(2, 4)
        sp = SequenceParallel.install(transformer, group)
        _, _, num_text_tokens, frames, width, height = CASES["tiny-odd"]
        report["denoise"] = denoise(transformer, text_embeds(num_text_tokens), geometry_of(frames, width, height),
                                    H3Schedule.build(DENOISE_STEPS), DENOISE_SEED)
        report["denoise/splits_built"] = sp.num_splits_built
        # Each forward's output gathers are checked on the host one forward late; `settle` checks the last one.
        report["denoise/unsettled_forwards"] = sp.output_checks.num_forwards
        sp.settle()
        report["denoise/settled_forwards"] = sp.output_checks.num_forwards

        # The same loop with the token refiner run once per request (model.text_memo): the same bits.
        transformer = build_transformer(2, 4)
        SequenceParallel.install(transformer, group)
        memo = RefinedTextMemo.install(transformer)
        report["denoise/memo"] = denoise(transformer, text_embeds(num_text_tokens),
                                         geometry_of(frames, width, height), H3Schedule.build(DENOISE_STEPS),
                                         DENOISE_SEED)
        report["denoise/memo/refined"] = memo.num_refined

        # Degrees must divide the head count: 3 heads on 2 ranks.
        try:
            SequenceParallel.install(build_transformer(3, 1), group)
        except SequenceParallelError as exc:
            report["refused"] = str(exc)

        # Rank 1 dies between two forwards; rank 0's next forward must fail, not hang.
        group.barrier()
        if rank == 1:
            torch.save(report, out_dir / f"rank{rank}.pt")
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            request("tiny-odd").run(transformer)
        except CollectiveError as exc:
            report["peer_killed"] = str(exc)
    torch.save(report, out_dir / f"rank{rank}.pt")
    group.destroy()


@dataclass(frozen=True)
class Ranks:
    exits: list[RankExit]
    reports: list[dict]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Ranks:
    out_dir = tmp_path_factory.mktemp("sp2")
    exits = launch_local(_rank_program, WORLD_SIZE, out_dir, args=(out_dir,), deadline_s=240.0)
    return Ranks(exits, [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD_SIZE)])


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The same computations in this process, unsharded."""
    reference = {}
    with torch.no_grad():
        for case, (heads, blocks, *_) in CASES.items():
            reference[case] = request(case).run(build_transformer(heads, blocks))
        reference["exchange"] = request("wide-odd").run(build_transformer(EXCHANGE_HEADS, EXCHANGE_BLOCKS))
        _, _, num_text_tokens, frames, width, height = CASES["tiny-odd"]
        reference["denoise"] = denoise(build_transformer(2, 4), text_embeds(num_text_tokens),
                                       geometry_of(frames, width, height), H3Schedule.build(DENOISE_STEPS),
                                       DENOISE_SEED)
    return reference


def assert_bitwise(got: tuple[Tensor, ...], want: tuple[Tensor, ...]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w), f"max abs diff {(g.float() - w.float()).abs().max().item()}"


# ------------------------------------------------------------------------------------------- tests


def test_rank_0_survives_rank_1_being_killed(ranks):
    assert ranks.exits == [RankExit(0, 0), RankExit(1, -signal.SIGKILL)]  # rank 0 ended by itself: no hang


def test_a_killed_peer_fails_the_next_sp_forward_with_a_collective_error(ranks):
    # the first block's all-to-all is the first collective of the forward
    assert "all_to_all on rank 0/2 (gloo, timeout 20 s) failed: a peer died or stopped answering" in \
        ranks.reports[0]["peer_killed"]


def test_packed_lengths_of_the_cases():
    lengths = {case: request(case).position_ids.shape[0] for case in CASES}
    assert lengths == {"tiny-even": 30, "tiny-odd": 31, "wide-odd": 199}


@pytest.mark.parametrize("case", list(CASES))
def test_sp2_forward_equals_the_one_process_forward_bit_for_bit(ranks, one_process, case):
    for report in ranks.reports:
        assert_bitwise(report[case], one_process[case])


@pytest.mark.parametrize("case, rows_per_rank, real_rows", [
    ("tiny-even", 15, [15, 15]),
    ("tiny-odd", 16, [16, 15]),  # rank 1 holds the pad row
    ("wide-odd", 100, [100, 99]),
])
def test_each_rank_runs_its_padded_half_of_the_sequence(ranks, case, rows_per_rank, real_rows):
    # (rows block 0 received, real rows among them) in the first forward of `case`, rank by rank
    assert [report[f"{case}/block_rows"][0] for report in ranks.reports] == \
        [(rows_per_rank, real) for real in real_rows]


@pytest.mark.parametrize("overlap, head_chunks", EXCHANGES)
def test_every_exchange_gives_the_one_process_forward_bit_for_bit(ranks, one_process, overlap, head_chunks):
    # overlapped or waited at once, in 1 to 6 head chunks: the same bytes reach the same kernels
    for report in ranks.reports:
        assert_bitwise(report[f"exchange/{overlap}/{head_chunks}"], one_process["exchange"])


def test_head_chunks_are_the_largest_divisor_of_the_rank_heads_not_above_the_ask(ranks):
    chunks = {ask: ranks.reports[0][f"exchange/{overlap}/{ask}/chunks"] for overlap, ask in EXCHANGES}
    assert chunks == {1: 1, 2: 2, 3: 3, 4: 3, 6: 6, 64: 6}  # 6 heads per rank


@pytest.mark.parametrize("head_chunks", [0, -1, True, 1.5])
def test_bad_head_chunks_are_refused(head_chunks):
    with pytest.raises(SequenceParallelError, match="head_chunks=.* must be an integer >= 1"):
        Exchange(head_chunks=head_chunks)


def test_positional_and_keyword_calls_are_sharded_alike(ranks, one_process):
    for report in ranks.reports:
        assert_bitwise(report["tiny-odd/positional"], one_process["tiny-odd"])


def test_removed_sequence_parallel_runs_the_plain_forward_alone(ranks, one_process):
    assert_bitwise(ranks.reports[0]["tiny-odd/removed"], one_process["tiny-odd"])


def test_external_adaln_modulation_keeps_working_under_sp(ranks, one_process):
    for report in ranks.reports:
        assert_bitwise(report["external"], one_process["tiny-odd"])


def test_denoise_loop_under_sp2_equals_the_one_process_loop(ranks, one_process):
    for report in ranks.reports:
        assert_bitwise(report["denoise"], one_process["denoise"])


def test_the_last_forwards_gather_waits_for_settle_which_starts_the_count_afresh(ranks):
    for report in ranks.reports:
        assert (report["denoise/unsettled_forwards"], report["denoise/settled_forwards"]) == (DENOISE_STEPS - 1, 0)


def test_refining_the_text_once_per_request_under_sp2_keeps_the_one_process_bits(ranks, one_process):
    for report in ranks.reports:
        assert_bitwise(report["denoise/memo"], one_process["denoise"])
        assert report["denoise/memo/refined"] == 1


class _Check:
    """A gather's host check: fails like a gather whose peer died (CollectiveError), or passes."""

    def __init__(self, log: list[str], name: str, fails: bool = False):
        self.log, self.name, self.fails = log, name, fails

    def wait(self) -> None:
        self.log.append(self.name)
        if self.fails:
            raise CollectiveError("all_gather on rank 0/2 (nccl, timeout 60 s) failed: a peer died")


def test_a_forwards_gather_is_checked_by_the_next_forward_naming_it():
    log: list[str] = []
    checks = OutputChecks()
    checks.defer([_Check(log, "0v"), _Check(log, "0a")])
    assert log == []  # the host does not wait on a forward's own gathers
    checks.defer([_Check(log, "1v", fails=True), _Check(log, "1a")])
    assert log == ["0v", "0a"]
    with pytest.raises(CollectiveError, match=r"forward 1 of the loop \(its output gather, checked by forward 2\)"):
        checks.defer([_Check(log, "2v")])


def test_the_last_forwards_gather_is_checked_at_the_end_of_the_loop():
    log: list[str] = []
    checks = OutputChecks()
    checks.settle()  # nothing outstanding: nothing to wait for
    checks.defer([_Check(log, "0v")])
    checks.defer([_Check(log, "1v", fails=True)])
    with pytest.raises(CollectiveError, match=r"forward 1 of the loop \(its output gather, checked at the end"):
        checks.settle()
    assert log == ["0v", "1v"]
    checks.defer([_Check(log, "next loop")])
    checks.settle()
    assert checks.num_forwards == 0 and log[-1] == "next loop"


def test_a_request_layout_is_split_once_not_per_forward(ranks):
    # DENOISE_STEPS - 1 forwards share the Denoiser's index tensors: one split (host reads) for all of them.
    assert DENOISE_STEPS - 1 > 1
    assert [report["denoise/splits_built"] for report in ranks.reports] == [1, 1]


def test_degree_not_dividing_the_heads_is_refused_at_install(ranks):
    for report in ranks.reports:
        assert report["refused"] == ("sequence parallel degree 2 does not divide the model's 3 attention heads; "
                                     "valid degrees: [1, 3]")


def test_valid_degrees_of_h3_are_the_divisors_of_56():
    assert valid_degrees(56) == [1, 2, 4, 7, 8, 14, 28, 56]


@pytest.mark.parametrize("degree, num_devices, message", [
    (3, None, r"degree 3 does not divide the model's 56 attention heads; valid degrees: \[1, 2, 4, 7, 8, 14, 28, 56\]"),
    (0, None, "degree 0 must be an integer >= 1"),
    (8, 4, "degree 8 needs 8 devices on one node; this node has 4"),
])
def test_bad_degrees_are_refused_with_the_valid_ones(degree, num_devices, message):
    with pytest.raises(SequenceParallelError, match=message):
        check_degree(degree, 56, num_devices)


@pytest.mark.parametrize("degree", [1, 2, 4, 7, 8, 14, 28, 56])
def test_every_divisor_of_56_is_accepted(degree):
    check_degree(degree, 56, num_devices=56)
