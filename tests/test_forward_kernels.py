"""The forward's kernels (issue 25): the attention backend choice, compiled blocks, the FP8 tier, and the
engine serving them (config, start-up warm-up, `describe()["forward"]`, per-request compile counters).

Compiled blocks are tested on CPU with dynamo's `eager` backend: the capture, the guards, the shared graph and
the recompiles are dynamo's and the same as under inductor, and the outputs are bit for bit eager's, so every
within-mode invariant (online AdaLN == resident, offload == resident) is checked exactly. Inductor's numerics
(fusion reassociates bf16 math) are bounded in the slow test at the end and measured at the released width in
bench/results/forward-nvidia-h200.md (relative error 2.7e-3 per block)."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import json

import pytest
import torch
from pydantic import ValidationError
from torch import nn

pytest.importorskip("cache_dit")
from diffusers.models.attention_dispatch import AttentionBackendName  # noqa: E402

from engine.attention import (AUTO, DEFAULT_BACKEND, AttentionBackendError, AttentionChoice,  # noqa: E402
                              choose_attention)
from engine import engine as engine_module  # noqa: E402
from engine.compiled import (CompileCacheError, CompiledBlocks, CompileOptions, compiler_modules,  # noqa: E402
                             import_in_background)
from engine.config import EngineConfig  # noqa: E402
from engine.fp8 import QuantizationError, fp8_targets, quantize_blocks_fp8, quantize_linears_fp8  # noqa: E402
from model.adaln import ExternalModulation, adaln_input, resident_modulation  # noqa: E402
from model.geometry import GeometryLimits, VideoGeometry  # noqa: E402
from model.loading import load_transformer  # noqa: E402
from model.packing import PackedLayout  # noqa: E402
from model.weights import is_adaln_param  # noqa: E402
from offload.wrapped import inner_tensors, is_wrapped  # noqa: E402
from tests.denoise_support import Request, assert_same_velocities, denoise, offload, t2va_request  # noqa: E402

EAGER = CompileOptions(backend="eager")
NUM_STEPS = 4  # 3 forwards: the first of one timestep, then two each (one graph serves both)


@pytest.fixture(scope="module")
def weights(tiny):
    return tiny.reader


@pytest.fixture
def model(weights):
    return load_transformer(weights, "cpu")


@pytest.fixture(scope="module")
def t2va() -> Request:
    return t2va_request(NUM_STEPS)


@pytest.fixture(scope="module")
def eager_run(weights, t2va):
    return denoise(load_transformer(weights, "cpu"), t2va)


def processors_backends(model) -> set:
    return {block.attn.processor._attention_backend for block in model.transformer_blocks}


def longer_prompt(request: Request, num_text_tokens: int) -> Request:
    """The same canvas with another prompt length: another packed sequence length."""
    geometry = VideoGeometry.from_frames(64, 64, 5, limits=GeometryLimits(short_edge=None, min_seconds=0.0))
    text = torch.randn(num_text_tokens, request.text.shape[1], generator=torch.Generator().manual_seed(7))
    return Request(PackedLayout.build(geometry, num_text_tokens), request.schedule, request.video, request.audio,
                   text)


# --- engine.attention --------------------------------------------------------------------------------------


class FakeCudaTimeline:
    """torch.cuda's spin, events and their timing over a fake device clock (ms): a call takes `kernel_ms` of device
    time, and the host queues each call `host_gap_ms` after the last. Queued behind a spin still running, a call
    starts when the one before it ends; otherwise when the host launches it (the gap is on the device's timeline).
    The spin lasts `ms_per_cycle` a cycle."""

    def __init__(self, monkeypatch, kernel_ms: float, host_gap_ms: float, ms_per_cycle: float):
        self.kernel_ms, self.host_gap_ms, self.ms_per_cycle = kernel_ms, host_gap_ms, ms_per_cycle
        self.host = 0.0  # host clock
        self.device = 0.0  # when the device's queue is done
        self.spins: list[int] = []
        timeline = self

        class Event:
            def __init__(self, enable_timing: bool = False):
                self.at: float | None = None

            def record(self) -> None:
                self.at = timeline.device = max(timeline.device, timeline.host)

            def query(self) -> bool:
                return self.at <= timeline.host

            def synchronize(self) -> None:
                timeline.host = max(timeline.host, self.at)

            def elapsed_time(self, end: "Event") -> float:
                return end.at - self.at

        def sleep(cycles: int) -> None:
            self.spins.append(cycles)
            self.device = max(self.device, self.host) + cycles * self.ms_per_cycle

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "_sleep", sleep)

    def call(self) -> None:
        self.host += self.host_gap_ms
        self.device = max(self.device, self.host) + self.kernel_ms


@pytest.mark.parametrize("host_gap_ms, spin_ms, spins", [
    (0.1, 30.0, [1000]),  # the launches queue behind the first spin
    (5.0, 10.0, [1000, 2000, 4000]),  # 5 launches take 25 ms: the spin is doubled until it outlasts them
])
def test_the_attention_probe_times_the_kernels_alone_however_slow_the_host_launches_them(monkeypatch, host_gap_ms,
                                                                                         spin_ms, spins):
    from engine.attention import queued_ms

    timeline = FakeCudaTimeline(monkeypatch, kernel_ms=2.9, host_gap_ms=host_gap_ms, ms_per_cycle=spin_ms / 1000)
    times = queued_ms(timeline.call, 5, spin_cycles=1000, attempts=3)
    assert times == pytest.approx([2.9] * 5) and timeline.spins == spins


def test_a_host_slower_than_every_spin_gets_the_last_attempts_times_with_its_gaps(monkeypatch):
    from engine.attention import queued_ms

    timeline = FakeCudaTimeline(monkeypatch, kernel_ms=2.9, host_gap_ms=50.0, ms_per_cycle=0.01)
    times = queued_ms(timeline.call, 3, spin_cycles=1000, attempts=2)
    assert timeline.spins == [1000, 2000] and max(times) > 2.9  # the gaps show (nothing better was possible)


def test_auto_on_cpu_keeps_the_default_and_measures_nothing(model):
    def timer(name: str) -> float:
        raise AssertionError(f"auto measured {name} on a CPU")

    choice = choose_attention(model, AUTO, torch.device("cpu"), timer=timer)
    assert choice == AttentionChoice(DEFAULT_BACKEND, "default")
    assert processors_backends(model) == {None}  # diffusers' default left in place


def test_auto_keeps_the_fastest_backend_that_runs_and_says_why_the_others_did_not(model):
    # Timings of a device, as a fake: cuDNN fastest, the math kernel never a candidate, flash-attn not installed.
    fake_ms = {"_native_cudnn": 3.1, "native": 3.3, "_native_flash": 5.3, "_native_efficient": 11.2}

    def timer(name: str) -> float:
        if name not in fake_ms:
            raise RuntimeError(f"{name} cannot run here")
        return fake_ms[name]

    choice = choose_attention(model, AUTO, torch.device("cuda"), timer=timer)
    assert choice.backend == "_native_cudnn" and choice.reason == "measured" and choice.ms == 3.1
    heads, head_dim = model.config.num_attention_heads, model.config.attention_head_dim
    assert choice.tflops == pytest.approx(4 * 8192**2 * heads * head_dim / 3.1e-3 / 1e12)  # the probe's rate
    assert "TFLOP/s" in choice.summary()
    assert list(choice.measured_ms) == ["_native_cudnn", "native", "_native_flash", "_native_efficient"]
    assert {"flash", "_flash_3"} <= set(choice.unavailable)  # packages this venv lacks
    assert "_native_math" not in choice.measured_ms and "_native_math" not in choice.unavailable
    assert processors_backends(model) == {AttentionBackendName._NATIVE_CUDNN}


def test_a_named_backend_is_set_on_every_attention_processor(model):
    choice = choose_attention(model, "_native_math", torch.device("cpu"))
    assert choice == AttentionChoice("_native_math", "configured")
    assert processors_backends(model) == {AttentionBackendName._NATIVE_MATH}


def test_a_named_backend_is_this_models_alone_not_the_process_default(model):
    """diffusers' seam also sets its process-wide default; a second model in the process (another engine, a
    test's oracle) must keep running diffusers' default."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = _AttentionBackendRegistry.get_active_backend()[0]
    choose_attention(model, "_native_math", torch.device("cpu"))
    assert _AttentionBackendRegistry.get_active_backend()[0] == before


def test_a_named_backend_this_process_cannot_run_fails_naming_the_field(model):
    with pytest.raises(AttentionBackendError, match="engine.attention: 'flash' cannot run here"):
        choose_attention(model, "flash", torch.device("cpu"))


@pytest.mark.parametrize("backend, package", [("_flash_3", "flash_attn_interface"), ("flash_4_hub", "kernels"),
                                              ("flash", "flash_attn"), ("sage", "sageattention")])
def test_a_requested_backend_whose_package_is_missing_fails_naming_the_package_and_its_install(model, monkeypatch,
                                                                                               backend, package):
    from engine import attention

    monkeypatch.setattr(attention, "_importable", lambda module: False)  # as on a replica without the extra
    with pytest.raises(AttentionBackendError, match=f"engine.attention: '{backend}' cannot run here: its kernels "
                                                    f"are the optional package '{package}'") as info:
        choose_attention(model, backend, torch.device("cuda"))
    assert "install: " in str(info.value)
    assert processors_backends(model) == {None}  # nothing was set


def test_an_installed_optional_package_goes_on_to_diffusers_own_check(model, monkeypatch):
    from engine import attention

    monkeypatch.setattr(attention, "_importable", lambda module: True)  # importable, but diffusers found no FA3
    with pytest.raises(AttentionBackendError, match="'_flash_3' cannot run here: Flash Attention 3 backend"):
        choose_attention(model, "_flash_3", torch.device("cuda"))


def test_auto_says_which_package_each_missing_candidate_needs(model):
    choice = choose_attention(model, AUTO, torch.device("cuda"), timer=lambda name: 1.0)
    assert "optional package 'flash_attn_interface'" in choice.unavailable["_flash_3"]


@pytest.fixture
def fake_fa4_wheel(monkeypatch):
    """`flash_attn.cute` as the flash-attn-4 wheel exposes it, computing exact attention with torch (the wheel's
    kernels need a Hopper or Blackwell GPU); counts its calls."""
    import sys
    import types

    calls = []

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
        calls.append(tuple(q.shape))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=softmax_scale, is_causal=causal)
        return out.transpose(1, 2), None  # (out, lse), as the wheel returns

    package, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func
    package.cute = cute
    package.__path__ = []  # a package: find_spec("flash_attn.cute") looks inside it
    cute.__spec__ = importlib.machinery.ModuleSpec("flash_attn.cute", None)
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return calls


@pytest.mark.slow
def test_flash_4_runs_the_wheels_kernel_through_diffusers_fa4_backend_in_eager_and_compiled_blocks(
        model, weights, t2va, eager_run, fake_fa4_wheel):
    choice = choose_attention(model, "flash_4", torch.device("cuda"))
    assert choice == AttentionChoice("flash_4", "configured")
    assert processors_backends(model) == {AttentionBackendName.FLASH_4_HUB}
    assert_same_velocities(denoise(model, t2va), eager_run)  # the fake runs SDPA as native does
    eager_calls = len(fake_fa4_wheel)
    from diffusers.models.attention import AttentionModuleMixin

    attentions = sum(isinstance(module, AttentionModuleMixin) for module in model.modules())  # blocks + refiner
    assert eager_calls == attentions * (NUM_STEPS - 1)

    torch._dynamo.reset()
    compiled_model = load_transformer(weights, "cpu")
    choose_attention(compiled_model, "flash_4", torch.device("cuda"))
    compiled = CompiledBlocks(compiled_model.transformer_blocks, EAGER).apply()
    assert_same_velocities(denoise(compiled_model, t2va), eager_run)
    assert len(fake_fa4_wheel) > eager_calls
    # The custom op keeps the block one graph: no break at the attention call.
    assert compiled.stats().graph_breaks == 0 and compiled.stats().frames_compiled == 1


def test_flash_4_without_the_wheel_fails_naming_it_and_on_a_cpu_naming_the_device(model, monkeypatch):
    from engine import attention

    with pytest.raises(AttentionBackendError, match="'flash_4' cannot run here: FlashAttention-4 needs a CUDA GPU"):
        choose_attention(model, "flash_4", torch.device("cpu"))
    monkeypatch.setattr(attention, "_importable", lambda module: False)
    with pytest.raises(AttentionBackendError, match="optional package 'flash_attn.cute'.*flash-attn-4"):
        choose_attention(model, "flash_4", torch.device("cuda"))
    assert processors_backends(model) == {None}


CUDNN_FASTEST = {"_native_cudnn": 3.1, "native": 3.3, "_native_flash": 5.3, "_native_efficient": 11.2}


def fake_timer(ms: dict[str, float]):
    def timer(name: str) -> float:
        if name not in ms:
            raise RuntimeError(f"{name} cannot run here")
        return ms[name]

    return timer


def never_timed(name: str) -> float:
    raise AssertionError(f"auto measured {name} though a choice for this key was kept")


def test_auto_keeps_its_choice_beside_the_compile_cache_and_a_restart_recalls_it_without_measuring(model, weights,
                                                                                                  tmp_path):
    from engine.attention import ChoiceMemo

    memo = ChoiceMemo(tmp_path / "cache" / "attention-auto.json")
    first = choose_attention(model, AUTO, torch.device("cuda"), timer=fake_timer(CUDNN_FASTEST), memo=memo)
    assert first.backend == "_native_cudnn" and first.reason == "measured" and memo.path.is_file()
    fresh = load_transformer(weights, "cpu")  # a restarted replica's
    again = choose_attention(fresh, AUTO, torch.device("cuda"), timer=never_timed, memo=memo)
    assert again == dataclasses.replace(first, reason="remembered")
    assert processors_backends(fresh) == {AttentionBackendName._NATIVE_CUDNN} and "remembered" in again.summary()


@pytest.mark.parametrize("foreign", ["another GPU", "another model shape", "other kernels installed", "torn file",
                                     "not a record"])
def test_a_kept_choice_for_another_probe_key_is_measured_over_and_replaced(model, tmp_path, foreign):
    from engine.attention import ChoiceMemo

    memo = ChoiceMemo(tmp_path / "attention-auto.json")
    choose_attention(model, AUTO, torch.device("cuda"), timer=fake_timer({"native": 1.0, "_native_cudnn": 2.0}),
                     memo=memo)
    record = json.loads(memo.path.read_text())
    if foreign == "torn file":
        memo.path.write_text(memo.path.read_text()[:40])
    elif foreign == "not a record":
        memo.path.write_text("[]")
    else:
        field_name = {"another GPU": "device", "another model shape": "heads",
                      "other kernels installed": "candidates"}[foreign]
        record["key"][field_name] = {"device": "NVIDIA B200", "heads": 7, "candidates": ["native"]}[field_name]
        memo.path.write_text(json.dumps(record))
    choice = choose_attention(model, AUTO, torch.device("cuda"), timer=fake_timer(CUDNN_FASTEST), memo=memo)
    assert choice.reason == "measured" and choice.backend == "_native_cudnn"
    assert json.loads(memo.path.read_text())["choice"]["backend"] == "_native_cudnn"  # replaced


def test_a_folder_that_cannot_keep_the_choice_costs_the_start_nothing(model, tmp_path):
    from engine.attention import ChoiceMemo

    (tmp_path / "file").write_text("")  # a file where the memo's folder should be: mkdir fails
    memo = ChoiceMemo(tmp_path / "file" / "attention-auto.json")
    choice = choose_attention(model, AUTO, torch.device("cuda"), timer=fake_timer(CUDNN_FASTEST), memo=memo)
    assert choice.backend == "_native_cudnn" and choice.reason == "measured" and not memo.path.exists()


def test_the_engine_keeps_auto_s_choice_only_beside_a_compile_cache_it_names(tmp_path):
    from engine.config import CompileConfig
    from engine.forward import ATTENTION_MEMO, attention_memo

    assert attention_memo(CompileConfig()) is None  # compile off: no graph depends on it
    assert attention_memo(CompileConfig(mode="blocks")) is None  # inductor's default cache: nothing of ours in it
    memo = attention_memo(CompileConfig(mode="blocks", cache_dir=str(tmp_path)))
    assert memo is not None and memo.path == tmp_path / ATTENTION_MEMO


def test_auto_times_flash_4_where_the_wheel_imports(model, fake_fa4_wheel):
    fake_ms = {"flash_4": 2.5, "_native_cudnn": 3.1, "native": 3.3}
    choice = choose_attention(model, AUTO, torch.device("cuda"), timer=lambda name: fake_ms[name])
    assert choice.backend == "flash_4" and list(choice.measured_ms)[:2] == ["flash_4", "_native_cudnn"]
    assert processors_backends(model) == {AttentionBackendName.FLASH_4_HUB}


def test_sequence_parallel_attention_runs_the_chosen_backend_set_before_or_after_it(model, tmp_path, t2va, eager_run,
                                                                                    fake_fa4_wheel):
    from parallel.group import init_group
    from parallel.sequence import SequenceParallel, UlyssesAttnProcessor

    group = init_group(0, 1, f"file://{tmp_path / 'rendezvous'}", "cpu", timeout_s=30)  # one rank: no peers
    try:
        choose_attention(model, "_native_math", torch.device("cpu"))
        sp = SequenceParallel.install(model, group)
        assert all(isinstance(block.attn.processor, UlyssesAttnProcessor) for block in model.transformer_blocks)
        assert processors_backends(model) == {AttentionBackendName._NATIVE_MATH}  # kept from before
        choose_attention(model, "native", torch.device("cpu"))
        assert processors_backends(model) == {AttentionBackendName.NATIVE}  # and set on the SP processors after
        choose_attention(model, "flash_4", torch.device("cuda"))
        assert_same_velocities(denoise(model, t2va), eager_run)
        assert len(fake_fa4_wheel) >= len(model.transformer_blocks) * (NUM_STEPS - 1)  # the SP processors called it
        sp.remove()
    finally:
        group.destroy()


def test_the_config_refuses_an_unknown_backend_naming_the_field():
    with pytest.raises(ValidationError, match="attention") as info:
        EngineConfig(attention="fastest")
    assert "unknown attention backend 'fastest'" in str(info.value)


# --- engine.compile ----------------------------------------------------------------------------------------


def test_compiled_blocks_equal_eager_bit_for_bit_and_share_one_graph(model, t2va, eager_run):
    compiled = CompiledBlocks(model.transformer_blocks, EAGER).apply()
    assert_same_velocities(denoise(model, t2va), eager_run)
    # 4 blocks, 3 forwards (of one timestep, then two): one graph, not one per block or per timestep count.
    assert compiled.stats().frames_compiled == 1
    compiled.warmup_ended(0.0, 3)
    longer = longer_prompt(t2va, 9)
    denoise(model, longer)  # another sequence length: the dynamic graph serves it
    assert compiled.stats().since_warmup == 0
    compiled.remove()
    assert all("forward" not in vars(block) for block in model.transformer_blocks)


def test_the_block_traces_without_the_fake_tensor_dispatch_cache_and_leaves_the_setting_as_it_was(model, t2va):
    """On a block of symbolic sizes the cache cost a warm start more than it saved (`CompiledBlocks.apply`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch._dynamo.reset()  # a graph another test traced for this forward would be reused untraced
    FakeTensorMode.cache_clear()
    compiled = CompiledBlocks(model.transformer_blocks, EAGER).apply()
    denoise(model, t2va)
    assert compiled.stats().frames_compiled == 1
    info = FakeTensorMode.cache_info()
    assert (info.hits, info.misses, info.size) == (0, 0, 0)
    assert torch._dynamo.config.fake_tensor_cache_enabled  # the process's own setting, outside the trace
    compiled.remove()


def test_hooks_on_a_block_stay_outside_the_compiled_graph(model, t2va):
    CompiledBlocks(model.transformer_blocks, EAGER).apply()
    run = denoise(model, t2va)  # records every block's pre-hook per forward
    assert run.ran == [[0, 1, 2, 3]] * (NUM_STEPS - 1)


def test_online_adaln_equals_resident_under_compile_bit_for_bit_with_one_graph_for_every_block(weights, t2va):
    resident = load_transformer(weights, "cpu")
    CompiledBlocks(resident.transformer_blocks, EAGER).apply()
    want = denoise(resident, t2va)

    torch._dynamo.reset()  # count this model's graphs, not reuse the resident one's
    online = load_transformer(weights, "cpu", skip=is_adaln_param)
    modulation = ExternalModulation.install(online)
    compiled = CompiledBlocks(online.transformer_blocks, EAGER, modulation).apply()

    def set_rows(timesteps):
        modulation.set(resident_modulation(resident, adaln_input(resident, timesteps)))

    assert_same_velocities(denoise(online, t2va, before_step=set_rows), want)
    # Each block reads its own row block (`_BlockRows.row_index`, an input): still one graph, not one per block (8 blocks'
    # worth of graphs would hit dynamo's recompile limit and leave the rest eager at 50 blocks), and one for the
    # first forward's one row and the later ones' two (the rows' count is unbacked as temb's is).
    assert compiled.stats().frames_compiled == 1
    compiled.remove()
    assert modulation.on_set is None


def test_the_graph_is_symbolic_in_the_sequence_and_the_timestep_rows_only(weights, t2va, monkeypatch):
    """Every other size of the graph is the model's: the heads, the head dim, the rotary and hidden widths are
    constants of its kernels (a head dim traced as a symbol made a norm kernel for any width), and the row block's
    index is a tensor input, so the blocks share the graph without module ints traced as symbols."""
    import engine.compiled as compiled_module

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real_compile = torch.compile
    monkeypatch.setattr(compiled_module.torch, "compile", lambda fn, **options: real_compile(
        fn, **{**options, "backend": capture}))
    torch._dynamo.reset()
    model = load_transformer(weights, "cpu", skip=is_adaln_param)
    resident = load_transformer(weights, "cpu")
    modulation = ExternalModulation.install(model)
    compiled = CompiledBlocks(model.transformer_blocks, EAGER, modulation).apply()
    denoise(model, t2va, before_step=lambda timesteps: modulation.set(
        resident_modulation(resident, adaln_input(resident, timesteps))))
    assert compiled.stats().frames_compiled == len(graphs) == 1

    backed, unbacked, static_dims = set(), set(), []
    for node in graphs[0].graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        sizes = (value,) if isinstance(value, torch.SymInt) else value.shape if isinstance(value, torch.Tensor) else ()
        for size in sizes:
            if isinstance(size, torch.SymInt):
                (unbacked if str(size).startswith("u") else backed).add(str(size))
            else:
                static_dims.append(size)
    assert len(backed) == 1, backed  # the packed sequence: hidden states, AdaLN indices, rotary tables
    assert 1 <= len(unbacked) <= 2, unbacked  # the timestep rows of temb and of the modulation's rows
    config = model.config
    assert config.hidden_size in static_dims and config.attention_head_dim in static_dims
    compiled.remove()


def test_blocks_without_a_temb_parameter_are_refused_when_dynamic():
    class Block(nn.Module):
        def forward(self, hidden_states, timestep_rows):
            return hidden_states

    blocks = nn.ModuleList([Block(), Block()])
    with pytest.raises(ValueError, match="takes no `temb`"):
        CompiledBlocks(blocks, EAGER).apply()
    CompiledBlocks(blocks, CompileOptions(backend="eager", dynamic=False)).apply()  # static: nothing to mark


def test_offload_equals_resident_under_compile_bit_for_bit(weights, t2va, eager_run):
    streamed = load_transformer(weights, "cpu")
    off = offload(streamed, prefetch_depth=1)  # the deferring fake device: a missing wait reads NaN weights
    CompiledBlocks(streamed.transformer_blocks, EAGER).apply()
    assert_same_velocities(denoise(streamed, t2va, off=off), eager_run)


def test_the_inductor_cache_dir_is_the_configured_local_one(model, tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    CompiledBlocks(model.transformer_blocks, CompileOptions(backend="eager", cache_dir=str(tmp_path))).apply()
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)


def test_a_missing_cache_dir_is_made_and_one_that_cannot_be_written_fails_naming_the_field(model, tmp_path,
                                                                                             monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    made = tmp_path / "compile" / "cache"
    CompiledBlocks(model.transformer_blocks, CompileOptions(backend="eager", cache_dir=str(made))).apply().remove()
    assert made.is_dir() and list(made.iterdir()) == []  # the write probe is gone
    (tmp_path / "a-file").write_text("not a folder")
    blocked = str(tmp_path / "a-file" / "cache")
    with pytest.raises(CompileCacheError, match=r"engine\.compile\.cache_dir: '.*a-file/cache' is not a folder"):
        CompiledBlocks(model.transformer_blocks, CompileOptions(backend="eager", cache_dir=blocked)).apply()
    assert all("forward" not in vars(block) for block in model.transformer_blocks)  # nothing half-applied


@pytest.mark.parametrize("backend, device, wanted, not_wanted", [
    ("inductor", "cpu", "torch._inductor.compile_fx", "triton"),
    ("inductor", "cuda", "triton", None),
    ("aot_eager", "cuda", "torch._functorch.aot_autograd", "torch._inductor.compile_fx"),
    ("eager", "cpu", "torch._dynamo.repro.after_dynamo", "torch._functorch.aot_autograd"),
])
def test_the_compiler_modules_are_what_the_backend_imports_on_that_device(backend, device, wanted, not_wanted):
    modules = compiler_modules(backend, torch.device(device))
    assert wanted in modules and not_wanted not in modules


def test_the_compiler_imports_on_a_thread_and_a_module_that_fails_stops_it_quietly(tmp_path, monkeypatch):
    import sys

    (tmp_path / "bg_first.py").write_text("LOADED = True\n")
    (tmp_path / "bg_broken.py").write_text("raise ImportError('no such kernel library')\n")
    (tmp_path / "bg_after.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("bg_first", "bg_broken", "bg_after"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    thread = import_in_background(("bg_first", "bg_broken", "bg_after"))
    thread.join(timeout=30)
    assert not thread.is_alive() and thread.daemon
    assert sys.modules["bg_first"].LOADED
    assert "bg_broken" not in sys.modules and "bg_after" not in sys.modules


def test_an_engine_compiling_beside_its_loads_imports_the_compiler_before_its_load(tiny_checkpoint, monkeypatch):
    from engine import forward
    from engine.engine import DenoiserEngine

    events: list[str] = []
    monkeypatch.setattr(forward, "import_in_background", lambda modules: events.append(f"import {modules[-1]}"))
    monkeypatch.setattr(engine_module, "load_transformer",
                        lambda *args, **kwargs: events.append("load") or load_transformer(*args, **kwargs))
    DenoiserEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", compile={"backend": "eager"}))
    DenoiserEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", compile={"mode": "blocks",
                                                                                       "backend": "eager"}))
    DenoiserEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", compile={
        "mode": "blocks", "backend": "eager", "overlap_loads": True}))
    assert events == ["load", "load", "import torch._dynamo.repro.after_dynamo", "load"]


# --- engine.quantization: fp8 ------------------------------------------------------------------------------


def test_fp8_targets_are_the_block_attention_and_feed_forward_linears_only(model):
    per_block = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2"]
    assert fp8_targets(model.transformer_blocks) == [f"{i}.{name}" for i in range(4) for name in per_block]


def test_fp8_on_a_cpu_is_refused_with_a_clear_error_and_leaves_the_weights(model):
    before = model.transformer_blocks[0].attn.to_q.weight.clone()
    with pytest.raises(QuantizationError, match="engine.quantization: fp8 needs a CUDA GPU .* runs on cpu"):
        quantize_blocks_fp8(model.transformer_blocks, torch.device("cpu"))
    assert torch.equal(model.transformer_blocks[0].attn.to_q.weight, before)


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """torchao's float8 linears compute on a CPU too (a reference GEMM); only its machine check refuses one. With
    the check faked away, what the FP8 tier does to the weights and to the offloader is tested here bit for bit."""
    monkeypatch.setattr("torchao.quantization.quant_api._check_hardware_support", lambda granularity: None)


def fp8_model(weights):
    model = load_transformer(weights, "cpu")
    quantize_linears_fp8(model.transformer_blocks, torch.device("cpu"))
    return model


def test_fp8_weights_are_float8_data_with_row_scales_and_change_the_output_a_little(weights, t2va, eager_run,
                                                                                    fp8_on_cpu):
    model = fp8_model(weights)
    for name in fp8_targets(model.transformer_blocks):
        weight = model.transformer_blocks.get_submodule(name).weight
        assert {n: t.dtype for n, t in inner_tensors(weight).items()} == {"qdata": torch.float8_e4m3fn,
                                                                          "scale": torch.float32}
        assert weight.scale.shape == (weight.shape[0], 1)  # one scale per output row
    assert model.transformer_blocks[0].adaln_proj.linear.weight.dtype == torch.bfloat16  # AdaLN stays bf16
    run = denoise(model, t2va)
    for got, want in zip(run.video_velocity, eager_run.video_velocity):
        error = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert 0 < error < 0.1, error  # quantized, and still the same model


def test_fp8_quantized_on_another_device_than_the_weights_comes_back_to_them_with_the_same_bytes(weights,
                                                                                                 fp8_on_cpu):
    """With offload the blocks load on the host and each linear is quantized on the GPU, then sent back. `cpu:0`
    stands in for the other device here (another torch.device than the weights' `cpu`: the same path, no GPU)."""
    in_place = fp8_model(weights)
    moved = load_transformer(weights, "cpu")
    quantize_linears_fp8(moved.transformer_blocks, torch.device("cpu", 0))
    for name in fp8_targets(moved.transformer_blocks):
        got, want = (m.transformer_blocks.get_submodule(name) for m in (moved, in_place))
        assert is_wrapped(got.weight) and isinstance(got.weight, nn.Parameter) and not got.weight.requires_grad
        assert all(torch.equal(getattr(got.weight, n).view(torch.uint8), t.view(torch.uint8))
                   for n, t in inner_tensors(want.weight).items())
        assert got.bias is None or torch.equal(got.bias, want.bias)


@pytest.mark.parametrize("prefetch_depth", [0, 1, 2])
def test_fp8_streamed_equals_fp8_resident_bit_for_bit(weights, t2va, fp8_on_cpu, prefetch_depth):
    want = denoise(fp8_model(weights), t2va)
    streamed = fp8_model(weights)
    off = offload(streamed, prefetch_depth=prefetch_depth)  # the deferring fake device: a missing wait reads NaN
    assert_same_velocities(denoise(streamed, t2va, off=off), want)
    off.check_invariants()


@pytest.mark.slow  # compiles several graphs (inductor CPU): over ~5 s
def test_fp8_streamed_equals_fp8_resident_under_compile_bit_for_bit(weights, t2va, fp8_on_cpu):
    """The offloader swaps the fp8 data and scales inside each FP8 weight: the compiled graph (its guards on the
    wrapper's inner tensors included) serves the streamed blocks as it serves resident ones."""
    resident = fp8_model(weights)
    CompiledBlocks(resident.transformer_blocks, EAGER).apply()
    want = denoise(resident, t2va)
    streamed = fp8_model(weights)
    off = offload(streamed, prefetch_depth=1)
    compiled = CompiledBlocks(streamed.transformer_blocks, EAGER).apply()
    assert_same_velocities(denoise(streamed, t2va, off=off), want)
    assert compiled.stats().graph_breaks == 0


def block_bytes(model, exclude: str) -> tuple[float, float]:
    """Block 0's bytes outside `exclude` in bf16, and after the FP8 tier (each target weight's N x K bf16 becomes
    N x K fp8 + N fp32 scales), computed from the model itself."""
    block = model.transformer_blocks[0]
    bf16 = sum(t.nbytes for name, t in block.state_dict().items() if not name.startswith(exclude))
    targets = [model.transformer_blocks.get_submodule(name).weight for name in fp8_targets(model.transformer_blocks)
               if name.startswith("0.")]
    return bf16, bf16 - sum(w.nbytes / 2 - w.shape[0] * 4 for w in targets)


@pytest.mark.parametrize("resident_tensors, at_most", [
    ((), 0.8),  # resident AdaLN: the bf16 adaln_proj (18 x hidden wide) streams too; ~0.8 at the released width
    (("adaln_proj",), 0.6),  # online AdaLN (no projection in the blocks): ~0.5 at the released width
])
def test_fp8_blocks_stream_their_fp8_bytes(weights, t2va, fp8_on_cpu, resident_tensors, at_most):
    bf16 = load_transformer(weights, "cpu")
    bf16_bytes, fp8_bytes = block_bytes(bf16, resident_tensors[0] if resident_tensors else "-")
    runs = {}
    for name, model in (("bf16", bf16), ("fp8", fp8_model(weights))):
        off = offload(model, prefetch_depth=1, resident_tensors=resident_tensors)
        denoise(model, t2va, off=off)
        runs[name] = off.stats
    ratio = runs["fp8"].h2d_bytes / runs["bf16"].h2d_bytes
    assert runs["fp8"].block_calls == runs["bf16"].block_calls > 0
    assert ratio == pytest.approx(fp8_bytes / bf16_bytes, abs=0.03)  # alignment padding aside
    assert ratio < at_most


def test_an_offloaded_fp8_block_comes_back_as_the_fp8_weight_it_was(weights, fp8_on_cpu):
    model = fp8_model(weights)
    before = {name: {n: t.clone() for n, t in inner_tensors(model.transformer_blocks.get_submodule(name).weight).items()}
              for name in fp8_targets(model.transformer_blocks)}
    off = offload(model, prefetch_depth=1)
    assert off.holds_placeholders(0)
    off.remove()
    for name, inner in before.items():
        weight = model.transformer_blocks.get_submodule(name).weight
        assert is_wrapped(weight) and weight.device == torch.device("cpu")
        assert all(torch.equal(getattr(weight, n).view(torch.uint8), t.view(torch.uint8)) for n, t in inner.items())


def test_fp8_with_offload_is_a_served_config():
    config = EngineConfig(quantization="fp8", offload={"enabled": True})
    assert config.quantization == "fp8" and config.offload.enabled


# --- the engine --------------------------------------------------------------------------------------------


class ForwardRows:
    """Every transformer forward of this process from now on, as its video rows (`TransformerInputs.run` spied on:
    an independent count of what the engine's stats report)."""

    def __init__(self, monkeypatch):
        from model.denoise import TransformerInputs

        self.rows: list[int] = []
        run = TransformerInputs.run

        def counted(inputs, transformer):
            self.rows.append(inputs.hidden_states.shape[1])
            return run(inputs, transformer)

        monkeypatch.setattr(TransformerInputs, "run", counted)

    def since(self, start: int) -> list[int]:
        return self.rows[start:]


def prompt_of(rows: int, seed: int = 0):
    from engine.stage_data import PromptEmbedding
    from model.prompts import PromptCacheStats

    embeds = torch.randn(rows, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.bfloat16)
    return PromptEmbedding(embeds, 0.0, PromptCacheStats(0, 0, 0, 0, 0, 0))


@pytest.mark.slow  # compiles several graphs (inductor CPU): over ~5 s
def test_engine_warms_its_canvases_at_start_so_a_request_of_them_compiles_nothing(tiny_checkpoint, monkeypatch):
    from engine.api import GenerationRequest
    from engine.engine import DenoiserEngine
    torch._dynamo.reset()  # the graphs of earlier tests in this process would serve the warm-up from the cache
    forwards = ForwardRows(monkeypatch)
    canvas = dict(width=64, height=64, seconds=5.0)
    engine = DenoiserEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu",
                                         compile={"mode": "blocks", "backend": "eager", "warmup": [canvas]}))
    described = engine.describe()["forward"]
    assert described["attention"]["backend"] == DEFAULT_BACKEND and described["attention"]["reason"] == "default"
    assert described["quantization"] == "none" and described["quantized_linears"] == 0
    assert described["compile"]["frames_compiled"] == 1 and described["compile"]["since_warmup"] == 0
    assert described["compile"]["warmup_s"] > 0
    # One canvas, one weight tier: a schedule's first forward (its one graph serves the later ones), not the whole
    # schedule.
    assert described["compile"]["warmup_forwards"] == len(forwards.rows) == 1
    assert engine.health()["requests"] == 0  # the warm-up is no request

    # 11 prompt rows (the warm-up ran 64) and 9 steps: another sequence length and step count, same graphs.
    result = engine.denoise(GenerationRequest(prompt="a red fox", seed=3, steps=9, return_video=False, **canvas),
                            prompt_of(11))
    assert result.stats.compile is not None and result.stats.compile.since_warmup == 0
    assert result.stats.model_dump()["compile"]["since_warmup"] == 0


def test_the_warm_up_runs_on_stand_in_adaln_rows_so_it_builds_no_plan_and_tells_the_router_of_none(
        tiny_checkpoint, monkeypatch):
    """A plan of the warm-up's schedule would be a rebuild from the checkpoint (at the released size all 24.2 GiB
    of AdaLN projections read, on every compiled start), slab rows taken and a schedule no client sent offered to
    the router. The warm-up's rows are zeros shaped as a plan's: its graph is the requests' (they compile nothing)."""
    from engine.api import GenerationRequest
    from engine.engine import DenoiserEngine

    torch._dynamo.reset()
    forwards = ForwardRows(monkeypatch)
    canvas = dict(width=64, height=64, seconds=5.0)
    engine = DenoiserEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu",
                                         compile={"mode": "blocks", "backend": "eager", "warmup": [canvas]}))
    assert engine.config.adaln.mode == "online" and len(forwards.rows) == 1  # the warm-up ran, on online AdaLN
    stats = engine.plan_cache.stats
    assert (stats.requests, stats.built_plans, stats.rebuild_bytes_read) == (0, 0, 0)
    state = engine.slab_state()
    assert state.schedule_keys == () and state.free_plans == state.capacity_plans > 0

    result = engine.denoise(GenerationRequest(prompt="a red fox", seed=3, steps=3, return_video=False, **canvas),
                            prompt_of(11))
    assert result.stats.compile.since_warmup == 0
    assert result.stats.adaln.built_plans > 0 and engine.slab_state().schedule_keys == (result.stats.schedule_key,)


def test_stand_in_rows_are_shaped_typed_and_placed_as_a_plans_and_set_like_one(model):
    from engine.forward import StandInPlans

    modulation = ExternalModulation.install(model)
    plans = [torch.tensor([1.0]), torch.tensor([0.9, 0.8])]
    stand_in = StandInPlans(modulation, plans, torch.device("cpu"))
    for step, timesteps in enumerate(plans):
        rows = stand_in.modulation(step)
        assert rows.blocks.shape == (modulation.num_blocks, timesteps.numel(), modulation.adaln_width)
        assert rows.final.shape == (timesteps.numel(), modulation.final_adaln_width)
        assert rows.blocks.dtype == rows.final.dtype == modulation.dtype
        assert not rows.blocks.any() and not rows.final.any()
        modulation.set(rows)  # ExternalModulation checks shape and dtype
    assert stand_in.keys == () and stand_in.stats is None


#: The mixed stream: 4 canvases (3 token counts, one of them in two orientations) x 3 step counts.
STREAM_CANVASES = [dict(width=64, height=64, seconds=0.5), dict(width=128, height=64, seconds=0.5),
                   dict(width=64, height=128, seconds=0.5), dict(width=96, height=64, seconds=1.0)]
STREAM_STEPS = (2, 3, 4)  # 1 to 3 forwards: a forward of one timestep, then of two


@pytest.mark.slow  # compiles several graphs (inductor CPU): over ~5 s
def test_after_the_warm_up_a_mixed_stream_of_canvases_and_step_counts_compiles_nothing(tiny_checkpoint,
                                                                                         monkeypatch):
    """With a symbolic sequence length the canvases share their graphs: the warm-up runs the one of fewest tokens,
    once (its first forward), and every canvas and step count of the stream, larger ones included, compiles
    nothing."""
    from engine.api import GenerationRequest
    from engine.engine import DenoiserEngine

    torch._dynamo.reset()  # the graphs of earlier tests in this process would serve the warm-up from the cache
    forwards = ForwardRows(monkeypatch)
    warmup = [dict(canvas, steps=9) for canvas in reversed(STREAM_CANVASES)]  # steps: accepted, not read
    engine = DenoiserEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu",
                                         geometry={"short_edge": None, "min_seconds": 0.1},
                                         compile={"mode": "blocks", "backend": "eager", "warmup": warmup}))
    warmed = engine.describe()["forward"]["compile"]
    assert warmed["frames_compiled"] == 1  # one graph for the first forward (one timestep) and the others
    assert warmed["warmup_forwards"] == len(forwards.rows) == 1
    warm_up_rows = set(forwards.rows)
    stream_start = len(forwards.rows)
    rows_of: dict[int, int] = {}
    for i, (canvas, steps) in enumerate((c, n) for n in STREAM_STEPS for c in reversed(STREAM_CANVASES)):
        result = engine.denoise(GenerationRequest(prompt="p", seed=i, steps=steps, return_video=False, **canvas),
                                prompt_of(23))
        assert result.stats.compile.since_warmup == 0, (canvas, steps)
        rows_of[result.stats.tokens] = forwards.rows[-1]
    assert len(rows_of) == 3  # the stream did change the sequence length
    assert warm_up_rows == {rows_of[min(rows_of)]}  # the warm-up ran the smallest canvas only
    assert len(forwards.since(stream_start)) == sum(len(STREAM_CANVASES) * (n - 1) for n in STREAM_STEPS)
    assert engine.describe()["forward"]["compile"]["frames_compiled"] == warmed["frames_compiled"]


@pytest.mark.slow  # a whole engine (prompt stage, VAEs) built; the block compiled once (dynamo, eager backend)
def test_a_keyframe_request_after_a_text_only_warm_up_compiles_nothing(tiny_checkpoint):
    """The warm-up canvases are t2va requests; an fl2va request of a warmed canvas adds its keyframes' condition
    rows to the packed sequence, the one symbolic size, so the same graph serves it."""
    import io

    from engine.api import GenerationRequest, KeyframeInput
    from engine.engine import Engine
    from tests.conditioning_support import random_image

    def png(seed: int) -> bytes:
        buffer = io.BytesIO()
        random_image(48, 48, seed).save(buffer, format="PNG")
        return buffer.getvalue()

    torch._dynamo.reset()  # the graphs of earlier tests in this process would serve the warm-up from the cache
    canvas = dict(width=64, height=64, seconds=5.0)
    engine = Engine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu",
                                 compile={"mode": "blocks", "backend": "eager", "warmup": [canvas]}))
    text_only = engine.generate(GenerationRequest(prompt="a red fox", seed=1, steps=3, return_video=False, **canvas))
    keyframes = engine.generate(GenerationRequest(
        prompt="a red fox", seed=1, steps=3, return_video=False, **canvas,
        keyframes=(KeyframeInput(image=png(1), anchor="first"), KeyframeInput(image=png(2), frame_index=-1))))
    assert keyframes.stats.tokens > text_only.stats.tokens  # the condition rows are in the sequence
    assert text_only.stats.compile.since_warmup == keyframes.stats.compile.since_warmup == 0
    assert engine.describe()["forward"]["compile"]["frames_compiled"] == 1


@pytest.mark.slow  # a checkpoint of both partitions made, an engine of the Ref2VA one built and warmed
def test_a_ref2va_replica_warms_its_canvases_and_its_reference_requests_compile_nothing(tmp_path):
    """The Ref2VA partition serves no text-only request, but its warm-up is one (stand-in rows, no clip): it
    starts, and a request with references, whose rows lengthen the sequence, uses the graph the warm-up made."""
    import io

    from engine.api import GenerationRequest, ReferenceInput
    from engine.engine import Engine
    from engine.errors import ClientError
    from model.tiny import make_tiny_checkpoint
    from tests.conditioning_support import random_image

    def png(seed: int) -> bytes:
        buffer = io.BytesIO()
        random_image(48, 48, seed).save(buffer, format="PNG")
        return buffer.getvalue()

    torch._dynamo.reset()
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", "diffusers", seed=0, ref2va=True)
    canvas = dict(width=64, height=64, seconds=5.0)
    engine = Engine(EngineConfig(checkpoint=str(checkpoint), device="cpu", partition="ref2va",
                                 compile={"mode": "blocks", "backend": "eager", "warmup": [canvas]}))
    warmed = engine.describe()["forward"]["compile"]
    assert warmed["warmup_forwards"] == 1 and warmed["frames_compiled"] == 1
    with pytest.raises(ClientError, match="t2va is not served by this model"):  # a client still cannot ask one
        engine.generate(GenerationRequest(prompt="a red fox", seed=1, steps=3, return_video=False, **canvas))
    result = engine.generate(GenerationRequest(
        prompt="a red fox", seed=1, steps=3, return_video=False, **canvas,
        references=(ReferenceInput(kind="image", data=png(1)), ReferenceInput(kind="image", data=png(2)))))
    assert result.stats.compile.since_warmup == 0
    assert engine.describe()["forward"]["compile"]["frames_compiled"] == 1


@pytest.mark.slow
def test_without_a_symbolic_length_the_warm_up_runs_each_token_count_once(tiny_checkpoint, monkeypatch):
    """dynamic: false makes a graph per token count: the warm-up runs each distinct count (the two orientations of
    one count once), and then requests of those counts (the warm-up's prompt length) compile nothing, at every step
    count: the blocks share each graph (their AdaLN row index is an input, not a constant of the graph)."""
    from engine.engine import DenoiserEngine
    from engine.forward import warmup_forwards

    torch._dynamo.reset()
    forwards = ForwardRows(monkeypatch)
    canvases = STREAM_CANVASES[:3]  # 2 token counts
    engine = DenoiserEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu",
                                         geometry={"short_edge": None, "min_seconds": 0.1},
                                         compile={"mode": "blocks", "backend": "eager", "dynamic": False,
                                                  "warmup": canvases}))
    assert engine.describe()["forward"]["compile"]["warmup_forwards"] == len(forwards.rows) == 2 * warmup_forwards(False) == 4
    assert len(set(forwards.rows)) == 2
    from engine.api import GenerationRequest
    from engine.forward import WARMUP_TEXT_TOKENS

    for canvas in canvases:
        for steps in STREAM_STEPS:
            result = engine.denoise(GenerationRequest(prompt="a red fox", seed=3, steps=steps, return_video=False,
                                                      **canvas), prompt_of(WARMUP_TEXT_TOKENS))
            assert result.stats.compile.since_warmup == 0, (canvas, steps)
    # 2 token counts x (one timestep row, two), each graph shared by the 4 blocks (with a graph per block, dynamo's
    # recompile limit would have left blocks eager, uncounted by since_warmup).
    assert result.stats.compile.frames_compiled == 4


@pytest.mark.slow  # compiles two graphs through AOTAutograd: ~10 s
@pytest.mark.parametrize("warm_adapters", [(), ("turbo",)])
def test_a_warmup_canvas_naming_an_adapter_leaves_its_requests_nothing_to_compile_at_any_scale(tiny_checkpoint,
                                                                                              tmp_path, warm_adapters):
    """LoRA layers on are another graph of the compiled block: a canvas warmed without the adapter leaves its first
    adapter request compiling (the case the warm-up's `adapters` field exists for), one warmed with it does not, and
    a request's scale (a float input of that graph) never compiles. The base graph takes its floats as constants: it
    is traced once, without the restart dynamo's float inputs cost (AOTAutograd's pass that turns them into tensors
    fails on the norms' eps and restarts the trace; aot_eager runs that pass as inductor does)."""
    from torch._dynamo.utils import get_compilation_metrics

    from engine.api import AdapterChoice, GenerationRequest
    from engine.engine import DenoiserEngine
    from model.tiny_adapter import save_adapter, tiny_lora_factors

    torch._dynamo.reset()
    path = save_adapter(tmp_path / "turbo.safetensors", tiny_lora_factors(1))
    canvas = dict(width=64, height=64, seconds=5.0)
    engine = DenoiserEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu",
                                         adapters={"turbo": {"path": str(path)}},
                                         compile={"mode": "blocks", "backend": "aot_eager",
                                                  "warmup": [canvas, dict(canvas, adapters=warm_adapters)]}))
    adapter_sets = 2 if warm_adapters else 1
    assert engine.describe()["forward"]["compile"]["warmup_forwards"] == adapter_sets
    assert not get_compilation_metrics()[0].restart_reasons  # the base graph: the warm-up's first frame
    before = 0
    for adapters in ((AdapterChoice(name="turbo"),), (), (AdapterChoice(name="turbo", scale=0.5),),
                     (AdapterChoice(name="turbo", scale=0.25),)):
        result = engine.denoise(GenerationRequest(prompt="a red fox", seed=3, steps=3, return_video=False,
                                                  adapters=adapters, **canvas), prompt_of(11, seed=1))
        compiled_by_this_request, before = result.stats.compile.since_warmup - before, result.stats.compile.since_warmup
        if adapters == (AdapterChoice(name="turbo"),) and not warm_adapters:
            assert compiled_by_this_request > 0
        else:
            assert compiled_by_this_request == 0, adapters


def test_the_warm_up_runs_each_graph_key_once_at_its_fewest_tokens_on_every_tier():
    from engine.config import WarmupCanvas
    from engine.forward import warmup_runs

    def canvas(width: int, *adapters: str) -> WarmupCanvas:
        return WarmupCanvas(width=width, height=64, seconds=1.0, adapters=adapters)

    canvases = [canvas(128), canvas(64), canvas(96, "turbo"), canvas(64, "turbo"), canvas(32), canvas(96)]
    tokens = [c.width for c in canvases[:5]] + [64]  # the last: another canvas of the second one's count
    dynamic = warmup_runs(canvases, tokens, ("lossless", "fp8"), dynamic=True)
    assert [(run.index, run.quality) for run in dynamic] == [(3, "lossless"), (4, "lossless"), (3, "fp8"), (4, "fp8")]
    assert all(run.canvas is canvases[run.index] and run.tokens == tokens[run.index] for run in dynamic)
    static = warmup_runs(canvases, tokens, ("lossless",), dynamic=False)
    assert [run.index for run in static] == [0, 1, 2, 3, 4]  # 64 tokens without adapters: once
    assert warmup_runs([], [], ("lossless",), dynamic=True) == ()


class FakeCompiled:
    """What `forward.warm_up` reads of compiled blocks: whether sizes are dynamic, and the warm-up's end."""

    def __init__(self):
        self.options = CompileOptions(backend="eager")
        self.ended: tuple[float, int] | None = None

    def warmup_ended(self, seconds: float, forwards: int) -> None:
        self.ended = (seconds, forwards)


class WarmupLog:
    """A warm-up's runs and the engine's load, as (what, thread) in the order they began; the load waits (up to
    `wait_s`) for the first run beside it to begin, so a warm-up that does not overlap the load shows as late."""

    def __init__(self, wait_s: float = 0.0):
        import threading

        self.events: list[tuple[str, str]] = []
        self.run_began = threading.Event()
        self.wait_s = wait_s

    def run(self, one) -> int:
        import threading

        self.events.append((f"run {one.index}", threading.current_thread().name))
        self.run_began.set()
        return 1

    def load(self) -> str:
        import threading

        self.events.append(("load", threading.current_thread().name))
        if self.wait_s:
            self.run_began.wait(self.wait_s)
        self.events.append(("loaded", threading.current_thread().name))
        return "stages"


def _warm_up(log: WarmupLog, *, overlap: bool, run=None, load=None, compiled: FakeCompiled | None = None,
             device: torch.device = torch.device("cpu")):
    from engine.config import WarmupCanvas
    from engine.forward import ForwardKernels, warm_up

    canvases = (WarmupCanvas(width=64, height=64, seconds=1.0), WarmupCanvas(width=32, height=64, seconds=1.0),
                WarmupCanvas(width=64, height=64, seconds=1.0, adapters=("turbo",)))
    kernels = ForwardKernels(AttentionChoice(DEFAULT_BACKEND, "default", {}), "none", 0,
                             compiled if compiled is not None else FakeCompiled(), None)
    return warm_up(kernels, canvases, ("lossless",), tokens=lambda canvas: canvas.width, run=run or log.run,
                   meanwhile=load or log.load, overlap=overlap, device=device)


@pytest.mark.parametrize("name, expected", [("cuda", 3), ("cuda:1", 1)])
def test_the_warm_up_runs_on_the_starting_threads_cuda_device_named_with_or_without_an_index(monkeypatch, name,
                                                                                            expected):
    """A new thread starts on CUDA device 0: the warm-up's thread is set to the engine's device first, and an
    engine on `cuda` (no index) means the starting thread's current device (3 here)."""
    import threading

    set_on: list[tuple[int, str]] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: set_on.append((index, threading.current_thread().name)))
    log = WarmupLog(wait_s=30)
    assert _warm_up(log, overlap=True, device=torch.device(name)) == "stages"
    assert set_on == [(expected, "compile-warm-up"), (expected, threading.current_thread().name)]


def test_a_warm_up_thread_that_cannot_take_its_device_fails_the_start_after_the_load(monkeypatch):
    def refuse(index: int) -> None:  # on the warm-up's thread only: the starting thread holds its device
        if current_thread_name() == "compile-warm-up":
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")

    log = WarmupLog()
    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    with pytest.raises(RuntimeError, match="invalid device ordinal 7"):
        _warm_up(log, overlap=True, device=torch.device("cuda:7"))
    assert ("loaded", current_thread_name()) in log.events and not any(what.startswith("run") for what, _ in log.events)
    # (the runs naming adapters, after the load, never began: the start failed first)


def current_thread_name() -> str:
    import threading

    return threading.current_thread().name


def test_the_warm_up_runs_without_adapters_beside_the_load_and_those_with_adapters_after_it():
    import threading

    log, compiled = WarmupLog(wait_s=30), FakeCompiled()
    assert _warm_up(log, overlap=True, compiled=compiled) == "stages"
    main = threading.current_thread().name
    # The run began on the other thread before the load (which waited for it) ended: they overlapped.
    assert sorted(log.events) == [("load", main), ("loaded", main), ("run 1", "compile-warm-up"), ("run 2", main)]
    order = [what for what, _ in log.events]
    assert order.index("run 1") < order.index("loaded") < order.index("run 2")
    assert compiled.ended is not None and compiled.ended[1] == 2


def test_without_overlap_every_warm_up_run_follows_the_load_on_its_thread():
    import threading

    log = WarmupLog()
    _warm_up(log, overlap=False)
    main = threading.current_thread().name
    assert log.events == [("load", main), ("loaded", main), ("run 1", main), ("run 2", main)]


def test_a_warm_up_run_that_fails_beside_the_load_fails_the_start_naming_its_canvas_after_the_load():
    log = WarmupLog()

    def failing(one) -> int:
        raise ValueError("no graph")

    with pytest.raises(ValueError, match=r"engine.compile.warmup\[1\] \(32x64, 1 s\): no graph"):
        _warm_up(log, overlap=True, run=failing)
    assert [what for what, _ in log.events] == ["load", "loaded"]  # the load ran to its end; no later run


def test_a_load_that_fails_fails_the_start_once_the_warm_up_beside_it_ended():
    import threading

    ended = threading.Event()
    log = WarmupLog()

    def slow(one) -> int:
        ended.wait(0.2)
        ended.set()
        return 1

    def load() -> str:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        _warm_up(log, overlap=True, run=slow, load=load)
    assert ended.is_set()  # joined before the error left


def test_an_engine_compiles_its_warm_up_beside_its_text_encoder_load_and_its_requests_compile_nothing(
        tiny_checkpoint, monkeypatch):
    import threading

    from engine.api import GenerationRequest
    from engine.engine import Engine

    torch._dynamo.reset()
    seen: dict[str, str] = {}
    load_text_encoder, load_vaes, warm_up_run = Engine._load_text_encoder, Engine._load_vaes, Engine._warm_up_run
    began, ended = threading.Event(), threading.Event()

    def loading(self) -> float:
        seen["load"] = threading.current_thread().name
        assert began.wait(30), "the warm-up did not run while the text encoder loaded"
        return load_text_encoder(self)

    def loading_vaes(self) -> float:
        # diffusers' from_pretrained sets the process's default dtype while it builds a VAE: never beside a warm-up
        assert ended.is_set(), "the VAEs loaded beside the warm-up"
        return load_vaes(self)

    def warming(self, run) -> int:
        seen["warm-up"] = threading.current_thread().name
        began.set()
        forwards = warm_up_run(self, run)
        ended.set()
        return forwards

    monkeypatch.setattr(Engine, "_load_text_encoder", loading)
    monkeypatch.setattr(Engine, "_load_vaes", loading_vaes)
    monkeypatch.setattr(Engine, "_warm_up_run", warming)
    canvas = dict(width=64, height=64, seconds=5.0)
    engine = Engine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu",
                                 compile={"mode": "blocks", "backend": "eager", "warmup": [canvas],
                                          "overlap_loads": True}))
    assert seen == {"load": threading.current_thread().name, "warm-up": "compile-warm-up"}
    assert engine.prompt_stage is not None and engine.decode_stage is not None
    assert torch.get_default_dtype() == torch.float32
    result = engine.generate(GenerationRequest(prompt="a red fox", seed=3, steps=3, **canvas))
    assert result.stats.compile.since_warmup == 0 and result.video is not None


def test_a_denoiser_engine_compiles_its_warm_up_beside_its_plan_cache_build(tiny_checkpoint, monkeypatch):
    """A denoiser-only replica (`stages: split`) loads no text encoder: its warm-up overlaps the plan cache's build
    (pinned host tier, slab, a probe rebuild), which the stand-in rows let it skip."""
    import threading

    from engine.api import GenerationRequest
    from engine.engine import DenoiserEngine, Engine

    torch._dynamo.reset()
    began = threading.Event()
    make_provider, warm_up_run = engine_module.make_adaln_provider, Engine._warm_up_run

    def building(*args, **kwargs):
        assert began.wait(30), "the warm-up did not run while the plan cache was built"
        return make_provider(*args, **kwargs)

    def warming(self, run) -> int:
        began.set()
        return warm_up_run(self, run)

    monkeypatch.setattr(engine_module, "make_adaln_provider", building)
    monkeypatch.setattr(Engine, "_warm_up_run", warming)
    canvas = dict(width=64, height=64, seconds=5.0)
    engine = DenoiserEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu",
                                         compile={"mode": "blocks", "backend": "eager", "warmup": [canvas],
                                                  "overlap_loads": True}))
    assert engine.plan_cache is not None and engine.startup.plan_cache_s > 0
    result = engine.denoise(GenerationRequest(prompt="a red fox", seed=3, steps=3, return_video=False, **canvas),
                            prompt_of(11))
    assert result.stats.compile.since_warmup == 0 and result.stats.adaln.built_plans > 0


def test_by_default_the_warm_up_runs_on_the_starting_thread_once_the_plan_cache_and_text_encoder_are_built(
        tiny_checkpoint, monkeypatch):
    import threading

    from engine.engine import Engine

    torch._dynamo.reset()
    seen: list[tuple[str, bool, bool]] = []
    warm_up_run = Engine._warm_up_run

    def warming(self, run) -> int:
        seen.append((threading.current_thread().name, self.plan_cache is not None, self.prompt_stage is not None))
        return warm_up_run(self, run)

    monkeypatch.setattr(Engine, "_warm_up_run", warming)
    config = EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu",
                          compile={"mode": "blocks", "backend": "eager", "warmup": [dict(width=64, height=64,
                                                                                          seconds=5.0)]})
    assert config.compile.overlap_loads is False
    Engine(config)
    assert seen == [(threading.current_thread().name, True, True)]


def test_a_warmup_adapter_must_be_configured_naming_the_field():
    with pytest.raises(ValueError, match=r"compile.warmup\[0\].adapters: \['turbo'\] are not configured"):
        EngineConfig(compile={"warmup": [dict(width=64, height=64, seconds=5.0, steps=3, adapters=["turbo"])]})


def test_a_warmup_canvas_the_engine_refuses_fails_the_start_naming_it(tiny_checkpoint):
    from engine.engine import DenoiserEngine

    with pytest.raises(ValueError, match=r"engine.compile.warmup\[0\] \(63x64"):
        DenoiserEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu",
                                    compile={"warmup": [dict(width=63, height=64, seconds=5.0, steps=3)]}))


def test_an_engine_whose_compile_cache_dir_cannot_be_written_fails_before_it_reads_the_checkpoint(tiny_checkpoint,
                                                                                                    tmp_path,
                                                                                                    monkeypatch):
    from engine import engine as engine_module

    (tmp_path / "a-file").write_text("not a folder")
    opened: list[object] = []
    monkeypatch.setattr(engine_module.H3Checkpoint, "open", lambda *args, **kwargs: opened.append(args[0]))
    with pytest.raises(CompileCacheError, match=r"engine\.compile\.cache_dir"):
        engine_module.DenoiserEngine(EngineConfig(
            checkpoint=str(tiny_checkpoint), device="cpu",
            compile={"mode": "blocks", "backend": "eager", "cache_dir": str(tmp_path / "a-file" / "cache")}))
    assert opened == []


# --- inductor ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_inductor_compiled_blocks_match_eager_within_the_stated_bound(model, t2va, eager_run):
    CompiledBlocks(model.transformer_blocks, CompileOptions(backend="inductor")).apply()
    run = denoise(model, t2va)
    for got, want in zip(run.video_velocity, eager_run.video_velocity):
        error = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert error < 1e-2, error  # bf16 reassociation; 2.7e-3 per block measured at the released width
