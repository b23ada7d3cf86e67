"""Start-up: the parallel transformer loader gives exactly the serial reader's tensors (both layouts, in place on
the CPU and through staging buffers on a deferring fake device), a reader's error reaches the caller, and the
start-up timings are filled in by the engine and reported by `describe()`; either engine, the denoiser alone too,
refuses at start a transformer whose latent widths are not the VAEs'."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from device.streams import FakeDevice
from engine.api import GenerationRequest
from engine.config import EngineConfig
from engine.engine import DenoiserEngine, Engine
from engine.errors import FaultCause, ServerFault
from engine.startup import EngineStartup, ReplicaStartup, process_started_at
from model.layout import CheckpointError, H3Checkpoint, Layout
from model.loading import load_transformer, read_tensors
from model.weights import TransformerWeights, is_adaln_param
from tests.adaln_support import Models, open_weights

#: (readers, chunk bytes, staged): the serial reader; many readers on ranges that cut tensors (and the native
#: layout's per-head q/k/v pieces) mid-way; the staged path, whose copies the fake device defers until waited
#: for, so a staging buffer refilled before its copy ran shows as wrong bytes.
LOADERS = {"serial": (1, 32 << 20, False), "parallel": (4, 1000, False), "staged": (3, 1000, True)}


@pytest.fixture(params=list(Layout), ids=lambda layout: layout.value)
def models(request) -> Models:
    return request.getfixturevalue("tiny" if request.param is Layout.DIFFUSERS else "tiny_native")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("online", [False, True], ids=["resident", "online"])
def test_loaded_parameters_are_the_serial_readers_bit_for_bit(models, loader, online):
    readers, chunk_bytes, staged = LOADERS[loader]
    weights = models.reader
    model = load_transformer(weights, "cpu", skip=is_adaln_param if online else None, num_readers=readers,
                             chunk_bytes=chunk_bytes, staging=FakeDevice() if staged else None)
    params = dict(model.named_parameters())
    assert set(params) == set(weights.names())
    for name in weights.names():
        if online and is_adaln_param(name):
            assert params[name].is_meta, name  # left for the plan cache
        else:
            assert same_bits(params[name].contiguous(), weights.tensor(name)), name


def test_staged_reader_waits_for_each_copy_before_refilling_its_buffer(tiny):
    """Each reader's copies are deferred by the fake device until waited for; with one reader and a chunk
    smaller than most tensors, every buffer is refilled many times, so a missing wait would show."""
    weights = tiny.reader
    reads = [weights.read_plan(name) for name in weights.names()]
    device = FakeDevice()
    tensors = read_tensors(reads, num_readers=1, chunk_bytes=512, staging=device)
    assert device.num_copies == sum(-(-read.nbytes // 512) for read in reads)
    for read, tensor in zip(reads, tensors):
        assert same_bits(tensor, weights.tensor(read.name)), read.name


def test_a_truncated_shard_fails_the_load_naming_the_shard(tiny, tmp_path):
    root = shutil.copytree(tiny.path, tmp_path / "tiny")
    weights = open_weights(root)  # headers read while the shard was whole
    reads = [weights.read_plan(name) for name in weights.names()]
    shard = max({read.location.path for read in reads}, key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"truncated shard {shard}"):
        read_tensors(reads, num_readers=4, chunk_bytes=4096)


def test_process_start_is_a_wall_clock_time_before_now():
    mine = process_started_at()
    before = time.time()
    child = subprocess.run([sys.executable, "-c", "from engine.startup import process_started_at as p; print(p())"],
                           capture_output=True, text=True, check=True)
    assert mine is not None and mine < before
    assert mine < float(child.stdout) <= time.time() + 0.05  # the child started after this process (clock ticks)


@pytest.mark.parametrize("field,value", [("in_channels", 16), ("audio_in_channels", 8)])
@pytest.mark.parametrize("kind", [DenoiserEngine, Engine], ids=lambda kind: kind.__name__)
def test_an_engine_refuses_a_transformer_whose_latent_widths_are_not_the_vaes_at_start(tiny_checkpoint, kind,
                                                                                        field, value):
    # The denoiser alone holds no VAE to disagree with: it used to start, validate requests and fail every one
    # with "mat1 and mat2 shapes cannot be multiplied" inside the patch embedding.
    config_file = H3Checkpoint.open(tiny_checkpoint).transformer_dir / "config.json"
    data = json.loads(config_file.read_text())
    assert data[field] != value
    config_file.write_text(json.dumps(dict(data, **{field: value})))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(config_file))}: {field} is {value}, but the served "
                                              r"VAEs' latent spec"):
        kind(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu"))


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[type[Engine], Engine]:
    root = tmp_path_factory.mktemp("checkpoints")
    config = EngineConfig(checkpoint_root=str(root), device="cpu", adaln={"host_cache_gb": 0.01})
    return {kind: kind(config) for kind in (Engine, DenoiserEngine)}


@pytest.mark.parametrize("kind", [Engine, DenoiserEngine], ids=lambda kind: kind.__name__)
def test_engine_startup_is_filled_and_described(engines, kind):
    engine = engines[kind]
    startup = engine.startup
    phases = (startup.device_init_s, startup.checkpoint_s, startup.transformer_s, startup.hooks_s,
              startup.plan_cache_s, startup.warm_up_s, startup.text_encoder_s, startup.vae_s)
    assert all(phase >= 0 for phase in phases)
    assert startup.total_s >= sum(phases)  # disjoint parts of the constructor
    assert startup.transformer_s > 0 and startup.warm_up_s > 0  # online AdaLN: the plan cache warms up
    # Online AdaLN: every tensor but the AdaLN projections, as the checkpoint's headers size them.
    weights = TransformerWeights(engine.checkpoint.transformer_dir, engine.checkpoint.layout)
    assert startup.transformer_bytes == sum(weights.read_plan(name).nbytes for name in weights.names()
                                            if not is_adaln_param(name))
    held = kind is Engine  # the denoiser alone loads neither the text encoder nor the VAEs
    assert (startup.text_encoder_s > 0, startup.vae_s > 0) == (held, held)
    assert EngineStartup(**engine.describe()["startup"]) == startup


def test_the_denoiser_alone_refuses_the_stages_it_does_not_hold(engines):
    denoiser = engines[DenoiserEngine]
    assert denoiser.prompt_stage is None and denoiser.decode_stage is None
    assert denoiser.describe()["text_encoder"] is None
    request = GenerationRequest(prompt="a red fox", seed=0, steps=2)
    for call in (lambda: denoiser.generate(request), lambda: denoiser.encode(request)):
        with pytest.raises(ServerFault, match="holds the denoiser only") as raised:
            call()
        assert raised.value.cause is FaultCause.STAGE_MISSING


def test_replica_startup_summary_names_every_phase(engines):
    replica = ReplicaStartup(role="worker", process_started_at=90.0, import_started_at=100.0, imported_at=103.5,
                             constructor_at=103.75, build_started_at=104.0, build_ended_at=106.0, ready_at=106.25,
                             imports_s=0.25, engine=engines[Engine].startup)
    line = replica.summary()
    for part in ("module imports 3.50 s", "0.25 s to the constructor", "model imports 0.25 s", "build 2.00 s",
                 "ready 2.50 s after the constructor", "6.25 s after our first import", "transformer", "warm-up",
                 "text encoder", "VAEs"):
        assert part in line
    assert replica.as_dict()["engine"] == dataclasses.asdict(replica.engine)
    assert ReplicaStartup.from_dict(replica.as_dict()) == replica
    assert list(replica.timeline()) == sorted(replica.timeline())


def test_preloaded_replica_summary_leaves_the_imports_out_of_its_start(engines):
    replica = ReplicaStartup(role="worker", process_started_at=10.0, import_started_at=11.0, imported_at=14.0,
                             constructor_at=100.0, build_started_at=100.25, build_ended_at=102.0, ready_at=102.5,
                             imports_s=0.25, preloaded=True)
    line = replica.summary()
    assert "module imports 3.00 s (preloaded as Ray started the process), 86.00 s to the constructor" in line
    assert "after our first import" not in line  # the 86 s idle worker is not the replica's start-up
    assert "ready 2.50 s after the constructor" in line
    assert ReplicaStartup.from_dict(replica.as_dict()) == replica


@pytest.mark.parametrize(("argv", "preloaded"), [
    (["default_worker.py", "--worker-preload-modules=deployments.worker", "--node-ip-address=1"], True),
    (["default_worker.py", "--worker-preload-modules=json,deployments"], True),
    (["default_worker.py", "--worker-preload-modules=torch,diffusers"], False),  # ours imported later
    (["default_worker.py", "--worker-preload-modules=deployments_extra"], False),  # a prefix is not our package
    (["default_worker.py"], False),
    (["pytest", "tests"], False),
])
def test_ray_preload_is_read_from_the_worker_command_line(argv, preloaded):
    from deployments import _imported_by_ray_preload

    assert _imported_by_ray_preload(argv) is preloaded


@pytest.mark.parametrize(("visible", "runtime_devices", "refused"), [
    (None, 8, False),  # no variable: the process owns every device
    ("", 0, False),
    ("1", 1, False),  # Ray gave one GPU and CUDA was initialized after it set the variable
    ("0,1", 2, False),
    ("GPU-5e1f3c2a", 1, False),  # UUIDs count the same
    ("1", 2, True),  # initialized before the variable: the process would run on device 0 of 2
    ("2,3", 4, True),
    ("0,1,7", 2, False),  # CUDA drops entries it cannot use: fewer is not a stale initialization
])
def test_cuda_initialized_before_ray_set_the_visible_devices_is_refused(visible, runtime_devices, refused):
    from engine.engine import check_cuda_visibility

    if refused:
        with pytest.raises(RuntimeError, match="initialized in this process before the variable was set"):
            check_cuda_visibility(visible, runtime_devices)
    else:
        check_cuda_visibility(visible, runtime_devices)
