"""Sequence parallel with LoRA adapters (issue 24): two gloo ranks (spawned CPU processes, `parallel.launch`, no
Ray), each an `engine.Engine(config, group=...)` with the same adapters, against the one-process engine.

Ulysses keeps every weight whole on every rank and splits only the rows (`parallel.sequence`): the attention
processor calls the `to_q` / `to_k` / `to_v` / `to_out` modules and the MLP runs row-local, so a peft LoRA layer
wrapping a base linear applies its factors to the rank's rows as the base does. What SP needs is the factors on
every rank, activated (or fused) identically; each rank's `AdapterSet` is built from the same config and applied
at the same request. What is promised and asserted, bit for bit (CPU: sharding never reorders a reduction):
SP2 == SP1 with one adapter, two composed, none after them, a fused one, and a cold one read for the request.

The request: 64x64 px, 0.5 s, 5 sampling points = 4 forwards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.api import AdapterChoice, GenerationRequest
from engine.config import EngineConfig
from engine.engine import Engine
from model.tiny import make_tiny_checkpoint
from model.tiny_adapter import TURBO_TARGETS, save_adapter, tiny_lora_factors
from tests.ranks_support import rank_reports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # slow: spawns gloo rank processes (each imports torch + diffusers) for whole engines

WORLD_SIZE = 2
TIMEOUT_S = 30.0

#: The requests each engine runs in turn (adapter names, each at its configured scale).
RUNS = {
    "turbo": ("turbo",),
    "composed": ("turbo", "style"),
    "none": (),
    "fused": ("turbo-fused",),
    "cold": ("cold",),  # over adapters_cache_mb at start: read for this request
}


def request(adapters: tuple[str, ...]) -> GenerationRequest:
    return GenerationRequest(prompt="a red fox", steps=5, seconds=0.5, width=64, height=64, seed=11,
                             return_video=False, adapters=tuple(AdapterChoice(name=n) for n in adapters))


def engine_config(checkpoint: Path, adapter_dir: Path, sp: int) -> EngineConfig:
    turbo = str(adapter_dir / "turbo.safetensors")
    adapters = {"turbo": {"path": turbo}, "style": {"path": str(adapter_dir / "style.safetensors"), "scale": 0.5},
                "turbo-fused": {"path": turbo, "fuse": True}, "cold": {"path": str(adapter_dir / "cold.safetensors")}}
    return EngineConfig(
        checkpoint=str(checkpoint), device="cpu", geometry={"short_edge": None, "min_seconds": 0.1},
        adaln={"mode": "online", "gpu_plans": 16, "host_cache_gb": 0.01}, pool={"enabled": False},
        parallel={"sp": sp, "timeout_s": TIMEOUT_S, "text_encoder_tp": False}, adapters=adapters,
        # turbo, style and turbo-fused are preloaded; cold no longer fits (each tiny adapter is < 0.1 MB)
        adapters_cache_mb=float(sum((adapter_dir / f"{n}.safetensors").stat().st_size for n in ("turbo", "style",
                                    "turbo")) / 1e6),
    )


def run_all(engine: Engine) -> dict:
    out = {}
    for label, adapters in RUNS.items():
        result = engine.generate(request(adapters))
        stats = result.stats.adapters
        out[label] = {"video": result.video, "audio": result.audio,
                      "loaded": stats.loaded if stats is not None else None,
                      "fused": stats.fused if stats is not None else None}
    return out


def _rank_program(rank: int, world_size: int, init_method: str, checkpoint: Path, adapter_dir: Path,
                  out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    from parallel.group import init_group

    group = init_group(rank, world_size, init_method, "cpu", timeout_s=TIMEOUT_S)
    engine = Engine(engine_config(checkpoint, adapter_dir, world_size), group=group)
    torch.save(run_all(engine), out_dir / f"rank{rank}.pt")
    group.barrier()
    group.destroy()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("h3") / "tiny", "diffusers", seed=0)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    save_adapter(root / "turbo.safetensors", tiny_lora_factors(1, targets=TURBO_TARGETS, rank=4))
    save_adapter(root / "style.safetensors", tiny_lora_factors(2, targets=("attn.to_out.0", "ff.net.2"), rank=4))
    save_adapter(root / "cold.safetensors", tiny_lora_factors(3, targets=TURBO_TARGETS, rank=4))
    return root


@pytest.fixture(scope="module")
def ranks(checkpoint, adapter_dir, tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("sp-adapters")
    return rank_reports(_rank_program, WORLD_SIZE, out_dir, (checkpoint, adapter_dir, out_dir), deadline_s=420.0)


@pytest.fixture(scope="module")
def single(checkpoint, adapter_dir) -> dict:
    return run_all(Engine(engine_config(checkpoint, adapter_dir, 1)))


@pytest.mark.parametrize("label", list(RUNS))
def test_sp2_with_adapters_equals_one_device_bit_for_bit(ranks, single, label):
    for rank in ranks:
        assert torch.equal(rank[label]["video"], single[label]["video"]), label
        assert torch.equal(rank[label]["audio"], single[label]["audio"]), label
        assert (rank[label]["loaded"], rank[label]["fused"]) == (single[label]["loaded"], single[label]["fused"])


def test_the_runs_differ_so_the_comparison_means_something(single):
    videos = {label: run["video"] for label, run in single.items()}
    assert not torch.equal(videos["turbo"], videos["none"])
    assert not torch.equal(videos["turbo"], videos["composed"])
    assert not torch.equal(videos["turbo"], videos["cold"])
    assert single["cold"]["loaded"] == ["cold"] and single["fused"]["fused"] == "turbo-fused"
