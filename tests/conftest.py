"""Shared fixtures: tiny configs, models and real checkpoints on disk."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from model.checkpoint import make_checkpoint
from model.config import DiTConfig, preset
from model.dit import DiT
from tests.adaln_support import Models, models_for


@pytest.fixture(scope="session")
def tiny_config() -> DiTConfig:
    """The tiny preset with 2 blocks: every structural feature, checkpoints of ~0.6 MB."""
    return preset("tiny", num_blocks=2)


@pytest.fixture(scope="session")
def tiny_model(tiny_config) -> DiT:
    """DiT(tiny_config, seed=0). Shared: tests must not modify it."""
    return DiT(tiny_config, seed=0)


@pytest.fixture(scope="session")
def _tiny_checkpoint_master(tmp_path_factory, tiny_config) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", tiny_config, seed=0)


@pytest.fixture
def tiny_checkpoint(_tiny_checkpoint_master, tmp_path) -> Path:
    """A private copy of a real seed-0 tiny checkpoint in tmp_path (safe to corrupt)."""
    return Path(shutil.copytree(_tiny_checkpoint_master, tmp_path / "tiny"))


@pytest.fixture
def tiny_inputs(tiny_config):
    """(video [C, 2, 8, 8], audio [6, Ca], text_states [5, text_dim]), seeded."""
    g = torch.Generator().manual_seed(1234)
    c = tiny_config
    video = torch.randn(c.video_channels, 2, 8, 8, generator=g)
    audio = torch.randn(6, c.audio_channels, generator=g)
    text = torch.randn(5, c.text_dim, generator=g)
    return video, audio, text


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Models:
    """The tiny preset (4 blocks) as a real checkpoint with its online and resident models (AdaLN plan
    cache tests; helpers in tests/adaln_support.py). Shared: tests must not modify it."""
    return models_for("tiny", tmp_path_factory)
