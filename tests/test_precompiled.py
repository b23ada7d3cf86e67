"""Precompiled blocks (`engine.compile.precompile`, `engine.precompiled`): the warm-up saves the block graph it
compiles whole, a later start loads it instead of tracing, and a saved graph serves only what a fresh compile would.

Inductor on CPU (the only backend whose graphs torch can save): each capture compiles C++ kernels, seconds each,
so the module is slow. A "start" here is a fresh model with dynamo's in-memory caches reset, as a new process
would have them; what carries over is only the folder on disk."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("cache_dit")

from engine import precompiled  # noqa: E402
from engine.compiled import CompiledBlocks, CompileOptions  # noqa: E402
from engine.precompiled import PrecompiledGraphs  # noqa: E402
from model.loading import load_transformer  # noqa: E402
from tests.denoise_support import assert_same_velocities, denoise, t2va_request  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not precompiled.available(), reason="this torch has no AOT precompile")]

NUM_STEPS = 4  # 3 forwards: the first of one timestep row, then two rows each


@pytest.fixture(scope="module")
def t2va():
    return t2va_request(NUM_STEPS)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("precompiled")


def options(folder, context: str = "attention=native quantization=none") -> CompileOptions:
    return CompileOptions(backend="inductor", precompile_dir=str(folder), precompile_context=context)


def start(tiny, opts: CompileOptions, t2va, *, warm_up: bool = True):
    """A fresh start: the model loaded, its blocks compiled, a warm-up of one forward (as the engine runs it)."""
    torch._dynamo.reset()
    model = load_transformer(tiny.reader, "cpu")
    compiled = CompiledBlocks(model.transformer_blocks, opts).apply()
    if warm_up:
        denoise(model, dataclasses.replace(t2va, schedule=type(t2va.schedule).build(2)))
    compiled.warmup_ended(0.0, 1 if warm_up else 0)
    return model, compiled


@pytest.fixture(scope="module")
def first_start(tiny, folder, t2va):
    """The first start on an empty folder: the warm-up captures and saves the graph; then a request."""
    model, compiled = start(tiny, options(folder), t2va)
    run = denoise(model, t2va)
    return compiled.stats(), run


def test_the_warm_up_saves_the_one_graph_it_compiled_and_the_request_runs_it(first_start, folder):
    stats, _ = first_start
    assert stats.precompiled.saved == 1 and stats.precompiled.loaded == 0 and stats.precompiled.refused == ()
    assert len(list(folder.glob("*/*.bin"))) == 1
    # The saved graph served the warm-up and every block call of the request (4 blocks x 3 forwards): dynamo
    # compiled nothing of its own.
    assert stats.precompiled.served_calls == 4 * 1 + 4 * (NUM_STEPS - 1)
    assert stats.frames_compiled == 0


def test_a_later_start_loads_it_traces_nothing_and_serves_the_same_bits(tiny, folder, t2va, first_start):
    _, first_run = first_start
    model, compiled = start(tiny, options(folder), t2va, warm_up=False)
    stats = compiled.stats()
    assert stats.precompiled.loaded == 1 and stats.precompiled.saved == 0
    run = denoise(model, t2va)
    assert_same_velocities(run, first_run)
    stats = compiled.stats()
    assert stats.frames_compiled == 0 and stats.precompiled.served_calls == 4 * (NUM_STEPS - 1)


def test_the_precompiled_graph_equals_the_ordinary_compile_bit_for_bit(tiny, t2va, first_start):
    _, first_run = first_start
    model, compiled = start(tiny, CompileOptions(backend="inductor"), t2va, warm_up=False)
    assert_same_velocities(denoise(model, t2va), first_run)
    assert compiled.stats().precompiled is None and compiled.stats().frames_compiled == 1


def test_another_context_has_its_own_key_and_loads_nothing(tiny, folder, t2va, first_start):
    _, compiled = start(tiny, options(folder, "attention=flash_4 quantization=none"), t2va, warm_up=False)
    assert compiled.stats().precompiled.loaded == 0


def test_a_call_its_guards_refuse_runs_the_ordinary_compile(tiny, folder, t2va, first_start):
    model, compiled = start(tiny, options(folder), t2va, warm_up=False)
    model.to(torch.float32)  # other weight dtypes: the saved graph's guards refuse them, dynamo compiles its own
    denoise(model, t2va)
    stats = compiled.stats()
    assert stats.frames_compiled == 1 and stats.since_warmup == 1 and stats.precompiled.served_calls == 0
    assert stats.precompiled.saved == 0  # after the warm-up nothing is captured


def test_a_changed_source_or_a_corrupt_file_is_refused_with_its_reason_and_the_start_goes_on(
        tiny, folder, t2va, first_start, monkeypatch, tmp_path):
    real = precompiled._inlined

    def edited(graph):
        for module, first, last, checksum in real(graph):
            yield module, first, last, "0" * 64 if module.endswith("transformer_minimax_h3") else checksum

    monkeypatch.setattr(precompiled, "_inlined", edited)
    _, compiled = start(tiny, options(folder), t2va, warm_up=False)
    (reason,) = compiled.stats().precompiled.refused
    assert "transformer_minimax_h3" in reason and "changed since it was traced" in reason
    monkeypatch.undo()

    key = PrecompiledGraphs.key_of(dataclasses.replace(options(tmp_path), precompile_dir=None),
                                   options(tmp_path).precompile_context, torch.device("cpu"))
    (tmp_path / key).mkdir()
    (tmp_path / key / "001-bad.bin").write_bytes(b"not a graph")
    model, compiled = start(tiny, options(tmp_path), t2va)
    stats = compiled.stats()
    assert stats.precompiled.loaded == 0 and len(stats.precompiled.refused) == 1
    assert stats.precompiled.refused[0].startswith("001-bad.bin: ")
    assert stats.precompiled.saved == 1  # the warm-up captured a good one beside it
