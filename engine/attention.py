"""The attention kernel the transformer runs (`engine.attention`): a diffusers backend name, or `auto`.

`auto` measures the exact backends this process can run, once at start on the engine's device (or recalls what a
replica before it measured, beside the compile cache: `ChoiceMemo`), and keeps the fastest (on Hopper today cuDNN;
FlashAttention-3 where `flash_attn_interface` is installed, FlashAttention-4 where the `flash-attn-4` wheel is:
`engine.flash4`). On a CPU it keeps diffusers' default and measures nothing (no kernel choice there is worth a
start-up cost). A named backend is set as is; one this process cannot run fails the start with the field named, and
one whose kernels come from an optional package (FlashAttention 2/3/4, SageAttention, xformers: `OPTIONAL_KERNELS`)
that is not importable fails naming the package and how to install it.

The choice goes through diffusers' own seam (`ModelMixin.set_attention_backend`), which sets every attention
processor's `_attention_backend` and the registry's active backend; our sequence-parallel processor
(`parallel.sequence.UlyssesAttnProcessor`) carries the same attribute and calls `dispatch_attention_fn` with it,
so it honours the choice whether installed before or after.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers import ModelMixin
from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

from engine import flash4
from engine.config import ATTENTION_AUTO as AUTO

logger = logging.getLogger(__name__)


#: diffusers' default when none is set: torch's scaled_dot_product_attention, which picks its own kernel.
DEFAULT_BACKEND = AttentionBackendName.NATIVE.value
#: What `auto` tries, fastest-first as measured on an H200 (issue 25): exact kernels only (no int8/fp8 Sage),
#: none that downloads a kernel (`*_hub`: a replica has no network), not the math kernel (it materializes the
#: S x S scores: 320 GB at 38k tokens).
EXACT_CANDIDATES = (
    flash4.FLASH_4,
    AttentionBackendName._FLASH_3.value,
    AttentionBackendName._NATIVE_CUDNN.value,
    AttentionBackendName.FLASH.value,
    AttentionBackendName._NATIVE_FLASH.value,
    AttentionBackendName._NATIVE_EFFICIENT.value,
    AttentionBackendName.NATIVE.value,
)
#: Tokens of the probe `auto` times (one attention call, the model's heads and head dim): long enough that
#: kernels rank as at the served sizes (8k-62k tokens), short enough to cost well under a second in all.
PROBE_TOKENS = 8192
#: GPU clock cycles of the spin the probe's calls queue behind (~30 ms at Hopper's clocks: `queued_ms`), and how
#: many spins a probe tries, each twice as long as the one before, before it takes the times as they are.
SPIN_CYCLES = 50_000_000
QUEUE_ATTEMPTS = 3
#: A backend whose probe output differs from the default's by more than this (bf16 inputs, |out| ~ 1) is
#: refused as broken rather than chosen: exact kernels differ by reassociation only (~1e-2 at most).
EXACT_TOLERANCE = 5e-2


@dataclass(frozen=True)
class OptionalKernel:
    """The package a backend's kernels come from: the module that must import, and how to install it."""

    module: str
    install: str


_FA2 = OptionalKernel("flash_attn", "pip install 'flash-attn>=2.6.3' (FlashAttention-2; CUDA build, no network "
                                    "at serve time)")
_FA3 = OptionalKernel("flash_attn_interface", "the FlashAttention-3 beta, built from FlashAttention's hopper/ "
                                              "folder into the venv (distribution flash_attn_3, Hopper GPUs)")
_FA4 = OptionalKernel("kernels", "pip install 'ditserve[flash-attn-4-hub]' (kernels >= 0.12.3; diffusers loads "
                                 "kernels-community/flash-attn4 through it: put it in the Hugging Face cache "
                                 "before start, a replica has no network)")
_SAGE = OptionalKernel("sageattention", "pip install 'sageattention>=2.1.1'")
#: Backends whose kernels are an optional package; the others are PyTorch's own.
OPTIONAL_KERNELS: dict[str, OptionalKernel] = {
    flash4.FLASH_4: OptionalKernel(flash4.MODULE, flash4.INSTALL),
    AttentionBackendName.FLASH.value: _FA2,
    AttentionBackendName.FLASH_VARLEN.value: _FA2,
    AttentionBackendName._FLASH_3.value: _FA3,
    AttentionBackendName._FLASH_VARLEN_3.value: _FA3,
    AttentionBackendName.FLASH_4_HUB.value: _FA4,
    AttentionBackendName.SAGE.value: _SAGE,
    AttentionBackendName.SAGE_VARLEN.value: _SAGE,
    AttentionBackendName.XFORMERS.value: OptionalKernel("xformers", "pip install xformers"),
}


def backend_names() -> tuple[str, ...]:
    """Every value `engine.attention` accepts."""
    return (AUTO, flash4.FLASH_4, *(name.value for name in AttentionBackendName))


class AttentionBackendError(ValueError):
    """`engine.attention` names a backend this process cannot run."""

    def __init__(self, backend: str, reason: str):
        super().__init__(f"engine.attention: {backend!r} cannot run here: {reason}")
        self.backend = backend


@dataclass(frozen=True)
class AttentionChoice:
    """What the engine runs and why (`describe()["forward"]["attention"]`, the start-up log)."""

    backend: str
    reason: str  # "configured", "measured" (auto on an accelerator), "remembered" (auto: `ChoiceMemo`), "default"
    # (auto on a CPU)
    #: ms of one probe call per backend that ran (auto on an accelerator only), fastest first.
    measured_ms: dict[str, float] = field(default_factory=dict)
    #: Backends auto tried that could not run here, each with why.
    unavailable: dict[str, str] = field(default_factory=dict)
    probe_tokens: int | None = None
    #: Matmul FLOPs of one probe call (QK^T and PV: 4 x tokens^2 x heads x head_dim), for the rates.
    probe_flops: float | None = None

    @property
    def ms(self) -> float | None:
        return self.measured_ms.get(self.backend)

    @property
    def tflops(self) -> float | None:
        """The chosen kernel's measured rate on the probe (TFLOP/s), beside the GEMM rate it is judged by."""
        if self.ms is None or not self.probe_flops:
            return None
        return self.probe_flops / (self.ms * 1e-3) / 1e12

    def summary(self) -> str:
        if not self.measured_ms:
            return f"{self.backend} ({self.reason})"
        ranked = ", ".join(f"{name} {ms:.2f} ms" for name, ms in self.measured_ms.items())
        rate = f", {self.tflops:.0f} TFLOP/s" if self.tflops is not None else ""
        return f"{self.backend} ({self.reason} at {self.probe_tokens} tokens{rate}: {ranked})"


#: Times one backend on the probe (ms), or raises if it cannot run it; a seam so CPU tests can rank fakes.
BackendTimer = Callable[[str], float]


def choose_attention(transformer: ModelMixin, setting: str, device: torch.device, *,
                     timer: BackendTimer | None = None, memo: ChoiceMemo | None = None) -> AttentionChoice:
    """Set `setting` (a backend name or `auto`) on `transformer` and say what runs. `timer`: how `auto` times a
    backend (default: `probe_timer` on `device` with the transformer's heads and head dim). `memo`: where `auto`
    recalls a choice made for the same `ProbeKey` instead of measuring, and keeps the one it measured."""
    if setting != AUTO:
        if setting == flash4.FLASH_4 and device.type != "cuda":
            raise AttentionBackendError(setting, f"FlashAttention-4 needs a CUDA GPU, not {device.type}")
        _set(transformer, setting)
        return AttentionChoice(setting, "configured")
    if device.type == "cpu":
        return AttentionChoice(DEFAULT_BACKEND, "default")
    config = transformer.config
    unavailable: dict[str, str] = {}
    candidates = []
    for name in EXACT_CANDIDATES:
        try:
            _requirements(name)
            candidates.append(name)
        except Exception as exc:  # a missing package, an unsupported device: not a candidate here
            unavailable[name] = _why(exc)
    key = ProbeKey.of(device, config.num_attention_heads, config.attention_head_dim, tuple(candidates))
    if memo is not None and (recalled := memo.recall(key)) is not None:
        _set(transformer, recalled.backend)
        return recalled
    if timer is None:
        timer = probe_timer(device, config.num_attention_heads, config.attention_head_dim)
    measured: dict[str, float] = {}
    for name in candidates:
        try:
            measured[name] = timer(name)
        except Exception as exc:  # an unsupported shape or dtype, a wrong output: not a candidate here
            unavailable[name] = _why(exc)
    if not measured:
        raise AttentionBackendError(AUTO, f"no exact backend ran: {unavailable}")
    ranked = dict(sorted(measured.items(), key=lambda item: item[1]))
    best = next(iter(ranked))
    _set(transformer, best)
    flops = 4.0 * PROBE_TOKENS**2 * config.num_attention_heads * config.attention_head_dim
    choice = AttentionChoice(best, "measured", ranked, unavailable, PROBE_TOKENS, flops)
    if memo is not None:
        memo.keep(key, choice)
    return choice


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


@dataclass(frozen=True)
class ProbeKey:
    """What an `auto` measurement holds for: the device model, the kernels' software, the probe's shape and the
    backends this process can run (`_requirements` passed: an installed or removed FlashAttention changes it)."""

    device: str
    torch: str
    diffusers: str
    heads: int
    head_dim: int
    tokens: int
    candidates: tuple[str, ...]

    @classmethod
    def of(cls, device: torch.device, heads: int, head_dim: int, candidates: tuple[str, ...]) -> ProbeKey:
        import diffusers

        name = torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available() \
            else device.type
        return cls(name, torch.__version__, diffusers.__version__, heads, head_dim, PROBE_TOKENS, candidates)


class ChoiceMemo:
    """`auto`'s choice kept in a JSON file beside the compile cache (`compile.cache_dir`), so a restarted or scaled-out
    replica on the same machine type runs the kernel its predecessor measured fastest, without measuring again.
    That is what makes the compile cache serve it: another backend is another graph, and a near tie (or a
    disturbed probe: on an H100 one start ranked `_native_flash` first) decided anew at each start would send a
    warm start to a full compile (a 15 s warm-up instead of 6.7 s on a 4-block H100 run). A record of another
    `ProbeKey` (another GPU, torch, diffusers, model shape or set of installed kernels), or one that does not
    parse, is measured over and replaced. Replicas starting together on one node may each measure and write (the
    file is replaced whole, the last one stays). A choice is kept until its key changes: delete the file to
    measure again."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def recall(self, key: ProbeKey) -> AttentionChoice | None:
        try:
            record = json.loads(self.path.read_text())
            if not isinstance(record, dict) or record.get("key") != _jsonable(dataclasses.asdict(key)):
                return None
            choice = AttentionChoice(**{**record["choice"], "reason": "remembered"})
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as exc:  # a torn or foreign file: measure again
            logger.warning("engine.attention: ignoring %s (%s); measuring again", self.path, exc)
            return None
        return choice

    def keep(self, key: ProbeKey, choice: AttentionChoice) -> None:
        """Write the record; a folder that takes none (read-only, full) costs the next start a measurement, not
        this one its start."""
        record = {"key": _jsonable(dataclasses.asdict(key)), "choice": dataclasses.asdict(choice)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            partial.write_text(json.dumps(record, indent=1))
            partial.replace(self.path)  # atomic: a reader sees the old record or the new one
        except OSError as exc:
            logger.warning("engine.attention: could not keep the choice in %s (%s)", self.path, exc)


def _jsonable(value: object) -> object:
    """`value` as it reads back from JSON (tuples become lists), so a recalled key compares equal."""
    return json.loads(json.dumps(value))


def probe_timer(device: torch.device, heads: int, head_dim: int, *, tokens: int = PROBE_TOKENS,
                repeats: int = 5) -> BackendTimer:
    """Median ms of `repeats` attention calls on random bf16 [1, tokens, heads, head_dim] after two warm-ups,
    each backend checked against the default's output first (a kernel that is fast but wrong is refused)."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, tokens, heads, head_dim, device=device, dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    reference = dispatch_attention_fn(q, k, v, backend=AttentionBackendName(DEFAULT_BACKEND))

    def time_ms(name: str) -> float:
        with torch.cuda.device(device):  # the spin and the events on the engine's device, not the thread's current
            return _time_ms(name)

    def _time_ms(name: str) -> float:
        backend = dispatch_name(name)
        out = dispatch_attention_fn(q, k, v, backend=backend)
        error = (out.float() - reference.float()).abs().max().item()
        if not error <= EXACT_TOLERANCE:
            raise AttentionBackendError(name, f"output differs from {DEFAULT_BACKEND}'s by {error:.3g}")
        dispatch_attention_fn(q, k, v, backend=backend)
        return statistics.median(queued_ms(lambda: dispatch_attention_fn(q, k, v, backend=backend), repeats))

    return time_ms


def queued_ms(call: Callable[[], object], repeats: int, *, spin_cycles: int = SPIN_CYCLES,
              attempts: int = QUEUE_ATTEMPTS) -> list[float]:
    """Device ms of each of `repeats` calls of `call` (CUDA), launched behind a spin kernel so the device runs them
    back to back: events recorded around a call launched at once time the host's gaps too, and another thread
    holding the GIL makes those gaps milliseconds (the compiler's import beside the start took a probe from 2.9 to
    9 ms and once ranked a 1.9x slower backend first). When the spin ended before the last call was queued, the
    host was slower than it: tried again with a spin twice as long, up to `attempts` times, then the last times
    are returned as they are."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    for attempt in range(attempts):
        torch.cuda._sleep(spin_cycles << attempt)
        spun = torch.cuda.Event()
        spun.record()
        events = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            events.append((start, end))
        queued_in_time = not spun.query()
        events[-1][1].synchronize()
        if queued_in_time:
            break
    return [start.elapsed_time(end) for start, end in events]


def _requirements(name: str) -> None:
    """AttentionBackendError naming the package when `name`'s optional kernels do not import; then diffusers' own
    check (a RuntimeError naming what it misses: a version, a device)."""
    from diffusers.models.attention_dispatch import _check_attention_backend_requirements

    kernel = OPTIONAL_KERNELS.get(name)
    if kernel is not None and not _importable(kernel.module):
        raise AttentionBackendError(name, f"its kernels are the optional package {kernel.module!r}, not "
                                          f"importable in this environment; install: {kernel.install}")
    if name != flash4.FLASH_4:  # ours: diffusers' check of its hub name would ask for `kernels`
        _check_attention_backend_requirements(AttentionBackendName(name))


def dispatch_name(name: str) -> AttentionBackendName:
    """The diffusers backend that runs `name` (`flash_4` runs diffusers' FA4 function on the wheel's kernel)."""
    return flash4.install() if name == flash4.FLASH_4 else AttentionBackendName(name)


def _importable(module: str) -> bool:
    """`module` is installed (found without importing it: a CUDA extension's import can take seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing or broken
        return False


def _set(transformer: ModelMixin, name: str) -> None:
    """`name` on every attention processor of `transformer`, and nowhere else: diffusers' seam also makes it the
    process-wide default (its registry's active backend), which every other model in the process (another engine,
    a test's oracle) would then run with; that default is put back."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    default = _AttentionBackendRegistry._active_backend
    try:
        _requirements(name)
        if name == flash4.FLASH_4:
            flash4.set_on(transformer)
        else:
            transformer.set_attention_backend(name)
    except AttentionBackendError:
        raise
    except (RuntimeError, ValueError, ImportError) as exc:
        raise AttentionBackendError(name, str(exc).splitlines()[0]) from None
    finally:
        _AttentionBackendRegistry.set_active_backend(default)
