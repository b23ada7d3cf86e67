"""parallel.text_encoder: the Qwen3-VL prompt encoder tensor parallel over 2 ranks (gloo, 2 spawned CPU processes)
against the one-process encoder (`model.text_encoder.PromptEncoder`) on the same files.

Encoders, written with transformers' own classes (`model.tiny_components.tiny_text_encoder`, 51 layers, the
conditioning read at hidden_states[50]):
  bf16: the tiny checkpoint's encoder (4 heads of 16 over 2 kv heads, MLP 64): 2 heads, 1 kv head, MLP 32 per rank
  fp32: the same shapes in float32 (the tolerance's control, below)
  odd:  6 heads over 2 kv heads, MLP 96: 3 heads (one group of the kv head), 1 kv head, MLP 48 per rank

Tolerance: max |TP2 - one process| <= 16 x eps(dtype) x max |one process|, per prompt.
Why not exact: o_proj and down_proj are row parallel: each rank's GEMM sums K/2 of the products and rounds to the
model dtype, and the all-reduce adds the two partials (in fp32, rounded once), where one process sums all K
products and rounds once. That is a different rounding of the same sum, in each of the 100 reductions of the 50
layers, carried along the residual stream. Why this bound: it is a rounding error, so it scales with the dtype's
epsilon. Measured while writing this (3 prompts of 1, 31 and 169 tokens): max diff / (eps x max |ref|) was
1.8-3.5 in bf16 (max diff 0.0088 on values up to 0.32; eps 2^-7), 3.6-6.8 in fp32 (max diff 2.4e-7; eps 2^-23)
and 3.2-4.3 for the odd shape: the same few epsilons in both dtypes, 65536x apart in absolute terms, which is
what rounding does and what a wrong slice or a missing reduction (an O(1) relative error) cannot do. 16 leaves
room above the 6.8 seen.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.text_encoder import PromptEncoder
from model.tiny import make_tiny_checkpoint
from model.tiny_components import tiny_text_encoder, tiny_tokenizer
from parallel.launch import launch_local
from parallel.text_encoder import TextEncoderSplitError, check_text_degree, valid_text_degrees

pytestmark = pytest.mark.slow  # spawns gloo rank processes (the inner loop keeps test_parallel_adaln's)

WORLD_SIZE = 2
TIMEOUT_S = 30.0
ENCODERS = {
    "bf16": dict(),
    "fp32": dict(dtype=torch.float32),
    "odd": dict(num_heads=6, num_kv_heads=2, intermediate_size=96),
}
PROMPTS = (
    "a",
    "A red fox runs across a snowy field at dawn, its breath steaming in the cold air.",
    "overall_soundscape: wind, distant gulls and the hiss of surf on gravel. " * 6,
)
TOLERANCE_EPS = 16
#: Per decoder layer: split tensor -> the dimension cut (0: output rows, column parallel; 1: input columns, row
#: parallel). Everything else is replicated.
SPLIT_DIMS = {"self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0, "self_attn.v_proj.weight": 0,
              "self_attn.o_proj.weight": 1, "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0,
              "mlp.down_proj.weight": 1}


def split_dim(name: str) -> int | None:
    parts = name.split(".", 2)
    return SPLIT_DIMS.get(parts[2]) if parts[0] == "layers" else None


# ------------------------------------------------------------------------------------------- the ranks


def _rank_program(rank: int, world_size: int, init_method: str, root: Path, out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    from parallel.group import init_group
    from parallel.text_encoder import TextTensorParallel

    group = init_group(rank, world_size, init_method, "cpu", timeout_s=TIMEOUT_S)
    report: dict = {}
    for name in ENCODERS:
        split = TextTensorParallel(group)
        encoder = PromptEncoder(root / name, root / "tokenizer", "cpu", split=split)
        report[name] = [encoder.encode(prompt) for prompt in PROMPTS]
        report[f"{name}/state"] = encoder._model.state_dict()
        report[f"{name}/identity"] = encoder.identity
        if name == "bf16":
            with pytest.raises(RuntimeError, match="already installed"):
                split.install(encoder._model)
    torch.save(report, out_dir / f"rank{rank}.pt")
    group.barrier()
    group.destroy()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("text-encoders")
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    for name, shape in ENCODERS.items():
        tiny_text_encoder(tokenizer, seed=0, **shape).save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def ranks(root, tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("tp-ranks")
    exits = launch_local(_rank_program, WORLD_SIZE, out_dir, args=(root, out_dir), deadline_s=300.0)
    assert [e.exitcode for e in exits] == [0, 0]
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def one_process(root) -> dict[str, PromptEncoder]:
    return {name: PromptEncoder(root / name, root / "tokenizer", "cpu") for name in ENCODERS}


# --------------------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("name", ENCODERS)
def test_tp2_hidden_state_equals_one_process_to_within_rounding(ranks, one_process, name):
    for prompt, got in zip(PROMPTS, ranks[0][name]):
        want = one_process[name].encode(prompt)
        assert got.dtype == want.dtype and got.shape == want.shape
        scale = want.float().abs().max()
        bound = TOLERANCE_EPS * torch.finfo(want.dtype).eps * scale
        assert (got.float() - want.float()).abs().max() <= bound, (name, prompt[:20])


@pytest.mark.parametrize("name", ENCODERS)
def test_every_rank_encodes_the_same_bits(ranks, name):
    for on_rank_0, on_rank_1 in zip(ranks[0][name], ranks[1][name]):
        assert torch.equal(on_rank_0, on_rank_1)


def test_the_difference_is_rounding_it_shrinks_with_the_dtypes_epsilon(ranks, one_process):
    """bf16 and fp32 encoders of one shape: the error relative to each dtype's epsilon is of one order, so in
    absolute terms fp32's is thousands of times smaller (a wrong shard would be equally wrong in both)."""
    def worst(name: str) -> float:
        return max(float((got.float() - one_process[name].encode(p).float()).abs().max())
                   for p, got in zip(PROMPTS, ranks[0][name]))

    assert worst("bf16") > 0  # the split really changed the summation order (else the test shows nothing)
    assert worst("fp32") * 1000 < worst("bf16")


# --------------------------------------------------------------------------------------------- memory


@pytest.mark.parametrize("name", ENCODERS)
def test_each_rank_holds_its_slice_of_the_split_weights_and_all_of_the_rest(ranks, one_process, name):
    full = one_process[name]._model.state_dict()
    states = [ranks[r][f"{name}/state"] for r in range(WORLD_SIZE)]
    assert all(set(state) == set(full) for state in states)
    split_numel = sum(full[k].numel() for k in full if split_dim(k) is not None)
    assert split_numel > 0
    for state in states:
        assert sum(state[k].numel() for k in state if split_dim(k) is not None) * WORLD_SIZE == split_numel
    for key, tensor in full.items():
        dim = split_dim(key)
        if dim is None:
            assert all(torch.equal(state[key], tensor) for state in states), key
        else:  # rank 0's slice, then rank 1's: exactly the stored tensor
            assert torch.equal(torch.cat([state[key] for state in states], dim=dim), tensor), key


def test_a_split_encoder_has_its_own_identity_the_same_on_every_rank(ranks, one_process):
    assert ranks[0]["bf16/identity"] == ranks[1]["bf16/identity"] != one_process["bf16"].identity


# --------------------------------------------------------------------------------------------- degrees


def test_valid_degrees_divide_heads_kv_heads_and_mlp_width():
    assert valid_text_degrees(64, 8, 25600) == [1, 2, 4, 8]  # MiniMax-H3's Qwen3-VL (h3.md section 3)
    assert valid_text_degrees(4, 2, 64) == [1, 2]  # the tiny checkpoint's
    assert valid_text_degrees(6, 2, 90) == [1, 2]
    assert valid_text_degrees(6, 3, 90) == [1, 3]


@pytest.mark.parametrize("degree, shape, message", [
    (4, (4, 2, 64), r"degree 4 does not divide its 4 attention heads, 2 kv heads and MLP width 64; valid "
                    r"degrees: \[1, 2\]"),
    (3, (64, 8, 25600), r"valid degrees: \[1, 2, 4, 8\]"),
    (16, (64, 8, 25600), r"16 does not divide its 64 attention heads, 8 kv heads"),
    (2, (6, 2, 45), r"MLP width 45; valid degrees: \[1\]"),
])
def test_a_degree_that_does_not_divide_is_refused_naming_the_valid_ones(degree, shape, message):
    with pytest.raises(TextEncoderSplitError, match=message):
        check_text_degree(degree, *shape)


@pytest.mark.parametrize("degree", [1, 2, 4, 8])
def test_every_valid_degree_of_h3s_encoder_is_accepted(degree):
    check_text_degree(degree, 64, 8, 25600)


def test_the_engine_refuses_sp_its_text_encoder_cannot_split_unless_tp_is_off(tmp_path):
    """Before any rank starts: sp=2 over a text encoder with one kv head."""
    from engine.config import EngineConfig
    from parallel.config_check import check_parallel_config

    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", "diffusers", seed=0)
    tiny_text_encoder(tiny_tokenizer(), seed=0, num_heads=2, num_kv_heads=1).save_pretrained(
        checkpoint / "text_encoder")
    config = EngineConfig(checkpoint=str(checkpoint), parallel={"sp": 2})
    with pytest.raises(TextEncoderSplitError, match=r"does not divide its 2 attention heads, 1 kv heads.*"
                                                     r"text_encoder_tp: false"):
        check_parallel_config(config, 0)
    check_parallel_config(config.model_copy(update={"parallel": config.parallel.model_copy(
        update={"text_encoder_tp": False})}), 0)
