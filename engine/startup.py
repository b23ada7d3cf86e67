"""Where a replica's start-up time goes: typed timings, filled by the engine and the Serve replicas.

`EngineStartup` is the engine constructor's breakdown (`Engine.startup`), phases in the order they run.
`ReplicaStartup` is a Serve
replica's: how long its process existed before the constructor ran (Ray's worker start, Serve's replica set-up
and the deployment module's imports), the deferred model imports, the build, and the age at which it was ready.
Both are reported in the replica's `describe()["startup"]` and logged once at INFO.

Plain Python (no torch, no Ray), so the Serve layer and the benches read them without loading a model.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

__all__ = ["EngineStartup", "ReplicaStartup", "process_age_s"]


@dataclass(frozen=True)
class EngineStartup:
    """The engine constructor's phases, in seconds (0 for a part this engine does not hold)."""

    device_init_s: float  # the device's context (CUDA: the first allocation); a CPU: ~0
    checkpoint_s: float  # layout detection, transformer config, index and shard headers (no tensor data)
    transformer_s: float  # transformer tensors read and on the device
    transformer_bytes: int  # bytes read for it (online AdaLN: without the AdaLN projections)
    num_readers: int  # reader threads of the transformer load
    text_encoder_s: float  # Qwen3-VL and its tokenizer
    vae_s: float  # video and audio VAEs
    hooks_s: float  # ExternalModulation, sequence parallel, offloader, Cache-DiT installed
    plan_cache_s: float  # the AdaLN plan cache built (slab, host tier), before its warm-up
    warm_up_s: float  # the plan cache's warm-up: units resolved, staging, threads, a scratch rebuild per width
    fingerprint_s: float  # the weights' fingerprint (headers and 3 x 64-byte samples per tensor)
    total_s: float  # the whole constructor

    @property
    def transformer_gbps(self) -> float:
        return self.transformer_bytes / self.transformer_s / 1e9 if self.transformer_s > 0 else 0.0

    def summary(self) -> str:
        return (f"device init {self.device_init_s:.2f} s, checkpoint headers {self.checkpoint_s:.2f} s, "
                f"transformer {self.transformer_s:.2f} s ({self.transformer_bytes / 1e9:.3f} GB at "
                f"{self.transformer_gbps:.2f} GB/s, {self.num_readers} readers), hooks {self.hooks_s:.2f} s, plan "
                f"cache {self.plan_cache_s:.2f} s + warm-up {self.warm_up_s:.2f} s, text encoder "
                f"{self.text_encoder_s:.2f} s, VAEs {self.vae_s:.2f} s, fingerprint {self.fingerprint_s:.2f} s; "
                f"engine {self.total_s:.2f} s")


@dataclass(frozen=True)
class ReplicaStartup:
    """A Serve replica's start, in seconds. `process_s` / `ready_s` are the process's age (None where the OS
    does not say); `imports_s` the model modules imported in the constructor; `build_s` the engine (or stage)
    build, `engine` its breakdown when the replica holds an `Engine`."""

    role: str  # "worker", "text_encoder", "decoder"
    process_s: float | None  # process start -> the replica's constructor
    imports_s: float
    build_s: float
    ready_s: float | None  # process start -> constructed (Serve calls it ready after its first health check)
    engine: EngineStartup | None = None

    def summary(self) -> str:
        age = lambda s: "n/a" if s is None else f"{s:.2f} s"  # noqa: E731
        line = (f"{self.role} started: process {age(self.process_s)} before the constructor, imports "
                f"{self.imports_s:.2f} s, build {self.build_s:.2f} s, ready at {age(self.ready_s)}")
        return line + (f" (engine: {self.engine.summary()})" if self.engine is not None else "")

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), or None where unknown."""
    try:
        with open("/proc/self/stat", "rb") as f:
            # Field 22 (starttime, clock ticks after boot); split after the command name, which may hold spaces.
            start_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
