"""A cold adapter never blocks a running request (issue 24): its file is read on the loader thread
(`engine.adapter_loader`) while the engine thread denoises, and the request that needs it waits for it with
progress and cancel still working.

The slow loader is a fake read that blocks until the test lets it go (`Gate`): a running request's steps
complete while it is blocked, so they cannot be waiting on it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine.adapter_loader import AdapterLoader
from engine.api import AdapterChoice, GenerationRequest
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import GenerationCancelled
from model.adapters import AdapterError, read_lora_file
from model.tiny import tiny_transformer
from model.tiny_adapter import TURBO_TARGETS, save_adapter, tiny_lora_factors

pytestmark = pytest.mark.timeout(300)


class Gate:
    """A read that blocks until `open()`: counts its calls, says when one is waiting."""

    def __init__(self, read):
        self._read = read
        self._open = threading.Event()
        self.waiting = threading.Event()
        self.calls = []

    def open(self):
        self._open.set()

    def is_open(self):
        return self._open.is_set()

    def __call__(self, *args):
        self.calls.append(args)
        self.waiting.set()
        assert self._open.wait(60), "the test never opened the gate"
        return self._read(*args)


# --- The loader alone ------------------------------------------------------------------------------------


def test_a_prefetch_returns_at_once_and_take_waits_for_the_read():
    gate = Gate(lambda name: f"file of {name}")
    loader = AdapterLoader(gate)
    loader.prefetch("style")
    loader.prefetch("style")  # already prefetched: one read
    assert gate.waiting.wait(10) and loader.loading == ("style",)
    taken = []
    taker = threading.Thread(target=lambda: taken.append(loader.take("style")))
    taker.start()
    taker.join(0.3)
    assert taker.is_alive() and not taken  # waiting for the read
    gate.open()
    taker.join(10)
    assert taken == ["file of style"] and len(gate.calls) == 1 and loader.loading == ()


def test_a_request_waiting_for_its_adapter_is_cancelled_and_the_read_stays_prefetched():
    gate = Gate(lambda name: f"file of {name}")
    loader = AdapterLoader(gate)
    seen_cancelled = []

    def cancelled() -> bool:  # the caller cancels once the read is under way (blocked in the gate)
        if gate.waiting.is_set():
            seen_cancelled.append(gate.is_open())
            return True
        return False

    with pytest.raises(GenerationCancelled, match="while its adapter was loading"):
        loader.take("style", cancelled)  # not prefetched: take starts the read itself
    # The first poll that saw the cancel ended the wait, while the read was still blocked: not after the read.
    assert seen_cancelled == [False] and not gate.is_open()
    assert loader.loading == ("style",)  # the next request naming it finds it read
    gate.open()
    assert loader.take("style") == "file of style" and len(gate.calls) == 1


def test_a_failed_read_is_raised_to_the_request_and_read_again_by_the_next():
    outcomes = iter([AdapterError("/x.safetensors", "holds no tensors"), "file"])

    def read(name):
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    loader = AdapterLoader(read)
    with pytest.raises(AdapterError, match="/x.safetensors: holds no tensors"):
        loader.take("style")
    assert loader.loading == () and loader.take("style") == "file"


# --- The engine: a running request's steps go on while another's adapter is read --------------------------


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    save_adapter(root / "turbo.safetensors", tiny_lora_factors(1, targets=TURBO_TARGETS, rank=4))
    save_adapter(root / "style.safetensors", tiny_lora_factors(2, targets=("attn.to_out.0", "ff.net.2"), rank=4))
    return root


@pytest.fixture(scope="module")
def engine(tmp_path_factory, adapter_dir) -> Engine:
    """Room for one adapter: turbo is preloaded at start (config order), style is cold."""
    turbo_mb = read_lora_file(adapter_dir / "turbo.safetensors", tiny_transformer(0)).nbytes / 1e6
    adapters = {"turbo": {"path": str(adapter_dir / "turbo.safetensors")},
                "style": {"path": str(adapter_dir / "style.safetensors")}}
    return Engine(EngineConfig(checkpoint_root=str(tmp_path_factory.mktemp("checkpoints")), device="cpu",
                               adaln={"mode": "resident"}, adapters=adapters, adapters_cache_mb=turbo_mb * 1.01))


def request(*adapters: str, **overrides) -> GenerationRequest:
    fields = dict(prompt="a red fox", steps=6, seconds=5.0, width=64, height=64, seed=11, return_video=False,
                  adapters=tuple(AdapterChoice(name=name) for name in adapters))
    return GenerationRequest(**{**fields, **overrides})


def run_in_thread(target, *args):
    out = {}

    def body():
        try:
            out["result"] = target(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    return thread, out


def test_a_running_request_finishes_while_a_cold_adapter_is_read_and_the_waiter_then_runs(engine, monkeypatch):
    assert engine.held_adapters() == ("turbo",)  # preloaded at start, within adapters_cache_mb
    gate = Gate(read_lora_file)
    monkeypatch.setattr("engine.adapters.read_lora_file", gate)
    engine.prefetch_adapters(request("style"))  # the Worker does this on arrival
    assert gate.waiting.wait(30)
    assert set(engine.held_adapters()) == {"turbo", "style"}  # reported to the router while being read

    steps = []
    running = engine.generate(request(), progress=lambda i, n: steps.append(i))  # the engine thread
    assert steps == list(range(1, 6)) and running.stats.adapters is None  # every step ran, the read still blocked
    assert not gate.is_open()

    waiter_steps = []
    waiter, out = run_in_thread(lambda: engine.generate(request("style"), progress=lambda i, n: waiter_steps.append(i)))
    waiter.join(0.5)
    assert waiter.is_alive() and waiter_steps == []  # it waits for its adapter, not a forward run
    gate.open()
    waiter.join(120)
    result = out["result"]
    assert waiter_steps == list(range(1, 6)) and result.stats.adapters.loaded == ["style"]
    assert len(gate.calls) == 1  # the prefetched read, not a second one
    again = engine.generate(request("style"))  # held now: the same bits, nothing read
    assert again.stats.adapters.loaded == [] and torch.equal(again.video, result.video)
    assert not torch.equal(result.video, running.video)  # the adapter changed the output


def test_a_request_waiting_for_its_adapter_can_be_cancelled_and_the_engine_serves_on(engine, monkeypatch):
    engine.generate(request("style"))  # style held: turbo (the LRU of one) is cold now
    assert engine.held_adapters() == ("style",)
    gate = Gate(read_lora_file)
    monkeypatch.setattr("engine.adapters.read_lora_file", gate)
    stop = threading.Event()
    waiter, out = run_in_thread(lambda: engine.generate(request("turbo"), cancelled=stop.is_set))
    assert gate.waiting.wait(30)
    stop.set()
    waiter.join(30)
    assert isinstance(out.get("error"), GenerationCancelled)
    assert engine.generate(request()).stats.forwards == 5  # the replica stays healthy
    gate.open()
    assert engine.generate(request("turbo")).stats.adapters.loaded == ["turbo"]
    assert len(gate.calls) == 1  # the cancelled request's read served the next one
    engine.adapters.check()
