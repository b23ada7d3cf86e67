"""`compile.precompiled`: compiled block graphs kept whole in `compile.cache_dir` (engine.precompiled).

A restart is another `CompiledBlocks` on a freshly loaded model after `torch._dynamo.reset()` (dynamo's in-memory
caches emptied): it must run the saved graph without a trace, bit for bit what the first start's graph computed,
for every token count and timestep count the one dynamic graph serves. Inductor on CPU: each first start compiles
the tiny block (seconds), so these tests are slow."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("cache_dit")
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock  # noqa: E402

import engine.precompiled as precompiled_module  # noqa: E402
from engine.compiled import CompiledBlocks, CompileOptions, _frames_compiled  # noqa: E402
from engine.precompiled import FOLDER, SUFFIX, PrecompiledGraphs, generation  # noqa: E402
from model.adaln import ExternalModulation, adaln_input, resident_modulation  # noqa: E402
from model.loading import load_transformer  # noqa: E402
from model.weights import is_adaln_param  # noqa: E402
from tests.denoise_support import Run, assert_same_velocities, denoise, t2va_request  # noqa: E402
from tests.test_forward_kernels import longer_prompt  # noqa: E402

pytestmark = pytest.mark.slow  # inductor compiles the tiny block (CPU): seconds per first start

NUM_STEPS = 4  # 3 forwards: the first of one timestep row, the later ones of two


@pytest.fixture(scope="module")
def weights(tiny):
    return tiny.reader


@pytest.fixture(scope="module")
def resident(weights):
    return load_transformer(weights, "cpu")


@pytest.fixture(scope="module")
def requests():
    short = t2va_request(NUM_STEPS)
    return short, longer_prompt(short, 9)  # two packed sequence lengths


def start(weights, resident, cache_dir, **options) -> tuple[CompiledBlocks, object]:
    """A replica's start: the online-AdaLN model loaded, its blocks compiled with inductor, dynamo's memory empty."""
    torch._dynamo.reset()
    model = load_transformer(weights, "cpu", skip=is_adaln_param)
    modulation = ExternalModulation.install(model)
    compiled = CompiledBlocks(model.transformer_blocks, CompileOptions(backend="inductor", cache_dir=str(cache_dir),
                                                                       **options), modulation).apply()

    def serve(request) -> Run:
        return denoise(model, request, before_step=lambda timesteps: modulation.set(
            resident_modulation(resident, adaln_input(resident, timesteps))))

    return compiled, serve


def saved(cache_dir) -> list:
    return sorted((cache_dir / FOLDER).glob(f"*{SUFFIX}"))


@pytest.fixture(scope="module")
def first_start(weights, resident, requests, tmp_path_factory):
    """A cold start on an empty cache folder, serving both requests: its runs and the folder it filled."""
    cache_dir = tmp_path_factory.mktemp("compile-cache")
    compiled, serve = start(weights, resident, cache_dir)
    runs = [serve(request) for request in requests]
    return compiled.stats(), runs, cache_dir


def test_a_cold_start_compiles_one_whole_graph_for_every_length_and_saves_it(first_start):
    stats, _, cache_dir = first_start
    assert (stats.frames_compiled, stats.graphs_loaded, stats.graph_breaks) == (1, 0, 0)
    assert len(saved(cache_dir)) == 1


def test_a_restart_runs_the_saved_graph_without_a_trace_bit_for_bit(first_start, weights, resident, requests):
    _, want, cache_dir = first_start
    frames = _frames_compiled()
    compiled, serve = start(weights, resident, cache_dir)
    for run, expect in zip([serve(request) for request in requests], want):
        assert_same_velocities(run, expect)
    stats = compiled.stats()
    assert (stats.frames_compiled, stats.graphs_loaded) == (0, 1)
    assert stats.graphs_load_s > 0  # the load is timed: the part of a warm start's warm-up that replaced the trace
    assert _frames_compiled() == frames  # dynamo traced nothing
    assert len(saved(cache_dir)) == 1


def test_the_saved_graph_is_the_compiled_forward_within_the_stated_bound_of_eager(first_start, weights, resident,
                                                                                   requests):
    _, runs, _ = first_start
    torch._dynamo.reset()
    model = load_transformer(weights, "cpu", skip=is_adaln_param)
    modulation = ExternalModulation.install(model)
    eager = denoise(model, requests[0], before_step=lambda timesteps: modulation.set(
        resident_modulation(resident, adaln_input(resident, timesteps))))
    for got, want in zip(runs[0].video_velocity, eager.video_velocity):
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2  # bf16 reassociation


def test_a_call_no_saved_graph_accepts_compiles_one_more_and_the_next_start_loads_both(first_start, weights,
                                                                                      requests, tmp_path):
    _, _, first_dir = first_start
    cache_dir = tmp_path / "cache"
    (cache_dir / FOLDER).mkdir(parents=True)
    for path in saved(first_dir):
        (cache_dir / FOLDER / path.name).write_bytes(path.read_bytes())

    def resident_start():  # resident AdaLN: the blocks project temb themselves, another graph than the online one's
        torch._dynamo.reset()
        model = load_transformer(weights, "cpu")
        compiled = CompiledBlocks(model.transformer_blocks, CompileOptions(backend="inductor",
                                                                           cache_dir=str(cache_dir))).apply()
        return compiled, denoise(model, requests[0])

    compiled, want = resident_start()
    assert (compiled.stats().frames_compiled, compiled.stats().graphs_loaded) == (1, 1)
    assert len(saved(cache_dir)) == 2
    compiled, run = resident_start()
    assert (compiled.stats().frames_compiled, compiled.stats().graphs_loaded) == (0, 2)
    assert_same_velocities(run, want)


def test_a_saved_graph_computes_with_the_weights_it_is_called_on_not_those_it_was_saved_with(first_start, weights,
                                                                                               resident, requests,
                                                                                               tmp_path):
    """Two replicas of one architecture (the FL2VA and Ref2VA partitions, a fine-tune) share a cache folder, and a
    weight update changes the parameters in place under a loaded graph: the graph must read them as inputs."""
    _, want, first_dir = first_start

    def changed(model) -> None:  # another checkpoint of the same shapes, or an update applied in place
        with torch.no_grad():
            for block in model.transformer_blocks:
                block.attn.to_q.weight.mul_(1.5)
                block.ff.net[2].weight.add_(0.01)

    def other_weights_start(cache_dir, change_after_start: bool):
        torch._dynamo.reset()
        model = load_transformer(weights, "cpu", skip=is_adaln_param)
        if not change_after_start:
            changed(model)
        modulation = ExternalModulation.install(model)
        compiled = CompiledBlocks(model.transformer_blocks, CompileOptions(
            backend="inductor", cache_dir=str(cache_dir)), modulation).apply()

        def serve(request) -> Run:
            return denoise(model, request, before_step=lambda timesteps: modulation.set(
                resident_modulation(resident, adaln_input(resident, timesteps))))

        if change_after_start:
            assert_same_velocities(serve(requests[0]), want[0])  # the saved graph on the first start's weights
            changed(model)
        return compiled, serve(requests[0])

    cold, traced = other_weights_start(tmp_path / "cold", change_after_start=False)  # its own graph, traced
    assert cold.stats().graphs_loaded == 0
    assert not torch.equal(traced.video_velocity[-1], want[0].video_velocity[-1])  # the weights matter
    for change_after_start in (False, True):
        loaded, run = other_weights_start(first_dir, change_after_start)
        assert (loaded.stats().frames_compiled, loaded.stats().graphs_loaded) == (0, 1)
        assert_same_velocities(run, traced)


def test_precompiled_off_traces_at_every_start(first_start, weights, resident, requests, tmp_path):
    compiled, serve = start(weights, resident, tmp_path, precompiled=False)
    serve(requests[0])
    assert (compiled.stats().frames_compiled, compiled.stats().graphs_loaded) == (1, 0)
    assert compiled.stats().graphs_load_s == 0.0  # nothing opened
    assert saved(tmp_path) == []


def test_a_file_torch_cannot_load_or_a_graph_of_changed_sources_is_not_loaded(first_start, tmp_path, monkeypatch,
                                                                              caplog):
    _, _, first_dir = first_start
    folder = tmp_path / FOLDER
    folder.mkdir()
    whole = saved(first_dir)[0]
    prefix = generation(MiniMaxH3TransformerBlock.forward)
    assert whole.name.startswith(f"{prefix}-")
    (folder / f"{prefix}-cut-short{SUFFIX}").write_bytes(whole.read_bytes()[:100])
    (folder / whole.name).write_bytes(whole.read_bytes())
    with caplog.at_level(logging.INFO, logger="engine.precompiled"):
        graphs = PrecompiledGraphs.open(folder, MiniMaxH3TransformerBlock.forward)
    assert graphs.loaded == 1
    assert f"{prefix}-cut-short{SUFFIX} not loaded" in caplog.text

    # Every other module the graph inlined is checked whole (a changed constant would pass its guards): torch's
    # Linear here.
    real = precompiled_module.inspect.getsource

    def edited(module):
        source = real(module)
        return source + "\n# edited\n" if getattr(module, "__name__", "") == "torch.nn.modules.linear" else source

    monkeypatch.setattr(precompiled_module.inspect, "getsource", edited)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.precompiled"):
        assert PrecompiledGraphs.open(folder, MiniMaxH3TransformerBlock.forward).loaded == 0
    assert "the source of torch.nn.modules.linear changed" in caplog.text


def test_a_changed_forward_module_is_another_generation_whose_start_reads_none_of_the_old_files(monkeypatch):
    forward = MiniMaxH3TransformerBlock.forward
    before = generation(forward)
    real = precompiled_module.inspect.getsource
    monkeypatch.setattr(precompiled_module.inspect, "getsource", lambda module: real(module) + "\n# edited\n")
    assert generation(forward) != before


@torch.compiler.disable
def _outside_the_graph(hidden_states: torch.Tensor) -> torch.Tensor:
    return hidden_states.clone()  # a graph break, as the sequence-parallel exchange is


class BrokenBlock(MiniMaxH3TransformerBlock):
    """A block whose forward dynamo cannot capture whole."""

    def forward(self, hidden_states, temb, adaln_indices, rotary_emb):
        return super().forward(_outside_the_graph(hidden_states), temb, adaln_indices, rotary_emb)


def test_a_forward_that_cannot_be_kept_whole_compiles_the_regular_way(weights, requests, tmp_path, caplog):
    torch._dynamo.reset()
    model = load_transformer(weights, "cpu")
    want = denoise(model, requests[0])
    for block in model.transformer_blocks:
        block.__class__ = BrokenBlock
    compiled = CompiledBlocks(model.transformer_blocks, CompileOptions(backend="inductor",
                                                                       cache_dir=str(tmp_path))).apply()
    with caplog.at_level(logging.WARNING, logger="engine.precompiled"):
        run = denoise(model, requests[0])
    assert "cannot be kept whole" in caplog.text
    assert compiled.precompiled.off_reason is not None
    stats = compiled.stats()
    assert stats.frames_compiled >= 1 and stats.graph_breaks >= 1 and stats.graphs_loaded == 0
    assert saved(tmp_path) == []
    for got, expect in zip(run.video_velocity, want.video_velocity):
        assert ((got.float() - expect.float()).norm() / expect.float().norm()).item() < 1e-2


def test_an_engine_restart_with_an_adapter_warmed_loads_both_graphs_and_compiles_nothing(tiny_checkpoint, tmp_path):
    """The served path: online AdaLN rows, the warm-up's stand-in rows, LoRA layers on (another graph, its scale a
    float input). The restarted engine's warm-up and every request after it, at any adapter scale, trace nothing."""
    from engine.api import AdapterChoice, GenerationRequest
    from engine.config import EngineConfig
    from engine.engine import DenoiserEngine
    from model.tiny_adapter import save_adapter, tiny_lora_factors
    from tests.test_forward_kernels import prompt_of

    path = save_adapter(tmp_path / "turbo.safetensors", tiny_lora_factors(1))
    canvas = dict(width=64, height=64, seconds=5.0)

    def engine_start() -> DenoiserEngine:
        torch._dynamo.reset()
        return DenoiserEngine(EngineConfig(
            checkpoint=str(tiny_checkpoint), device="cpu", adapters={"turbo": {"path": str(path)}},
            compile={"mode": "blocks", "backend": "inductor", "cache_dir": str(tmp_path / "cache"),
                     "warmup": [canvas, dict(canvas, adapters=("turbo",))]}))

    def serve(engine: DenoiserEngine) -> list:
        runs = []
        for adapters in ((), (AdapterChoice(name="turbo"),), (AdapterChoice(name="turbo", scale=0.5),)):
            result = engine.denoise(GenerationRequest(prompt="a red fox", seed=3, steps=3, return_video=False,
                                                      adapters=adapters, **canvas), prompt_of(11, seed=1))
            runs.append(result)
        return runs

    first = engine_start()
    assert first.describe()["forward"]["compile"]["graphs_loaded"] == 0
    want = serve(first)
    assert want[-1].stats.compile.since_warmup == 0
    assert len(saved(tmp_path / "cache")) == 2  # without and with the LoRA layers

    again = engine_start()
    stats = again.describe()["forward"]["compile"]
    assert (stats["frames_compiled"], stats["graphs_loaded"]) == (0, 2)
    for run, expect in zip(serve(again), want):
        assert run.stats.compile.frames_compiled == 0
        assert torch.equal(run.video, expect.video) and torch.equal(run.audio, expect.audio)


def test_rows_the_plan_cache_hands_out_again_are_never_marked_by_a_trace(weights, resident, requests, tmp_path):
    """A loaded graph's guards refuse marked tensors: rows a trace marked and a slab hands to a later forward would
    make every loaded graph refuse that forward (and compile it again). The trace marks a copy of them instead."""
    torch._dynamo.reset()
    model = load_transformer(weights, "cpu", skip=is_adaln_param)
    modulation = ExternalModulation.install(model)
    CompiledBlocks(model.transformer_blocks, CompileOptions(backend="inductor", cache_dir=str(tmp_path)),
                   modulation).apply()
    slab = {}

    def set_rows(timesteps):
        key = tuple(timesteps.tolist())
        if key not in slab:
            slab[key] = resident_modulation(resident, adaln_input(resident, timesteps))
        modulation.set(slab[key])

    denoise(model, requests[0], before_step=set_rows)
    assert slab and len(saved(tmp_path)) == 1
    for rows in slab.values():
        assert not hasattr(rows.blocks, "_has_dynamo_dim_marking") and not hasattr(rows.final, "_has_dynamo_dim_marking")
