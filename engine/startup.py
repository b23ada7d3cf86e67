"""Where a replica's start-up time goes: typed timings, filled by the engine and the Serve replicas.

`EngineStartup` is the engine constructor's breakdown (`Engine.startup`), phases in the order they run.
`ReplicaStartup` is a Serve replica's timeline in wall-clock seconds (`time.time()`, comparable across the
processes of one node, so a bench can set them beside the moment it asked Serve for the replica): when this
process first imported our `deployments` package and finished the deployment module's imports, the
constructor, the engine (or stage) build, ready. The process's own start is kept for what it is: Ray hands a
new actor a worker process it may have started long before (it keeps idle workers), so it says nothing about
when the replica was asked for. Both are reported in the replica's `describe()["startup"]` and logged once at
INFO.

Plain Python (no torch, no Ray), so the Serve layer and the benches read them without loading a model.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

__all__ = ["EngineStartup", "ReplicaStartup", "process_started_at"]


@dataclass(frozen=True)
class EngineStartup:
    """The engine constructor's phases, in seconds (0 for a part this engine does not hold)."""

    device_init_s: float  # the device's context (CUDA: the first allocation); a CPU: ~0
    checkpoint_s: float  # layout detection, transformer config, index, shard headers, fingerprint (3 pages a tensor)
    transformer_s: float  # transformer tensors read and on the device
    transformer_bytes: int  # bytes read for it (online AdaLN: without the AdaLN projections)
    num_readers: int  # reader threads of the transformer load
    text_encoder_s: float  # Qwen3-VL and its tokenizer
    vae_s: float  # video and audio VAEs
    hooks_s: float  # ExternalModulation, sequence parallel, offloader, Cache-DiT installed
    plan_cache_s: float  # the AdaLN plan cache built (slab, host tier), before its warm-up
    warm_up_s: float  # the plan cache's warm-up: units resolved, staging, threads, a scratch rebuild per width
    total_s: float  # the whole constructor

    @property
    def transformer_gbps(self) -> float:
        return self.transformer_bytes / self.transformer_s / 1e9 if self.transformer_s > 0 else 0.0

    def summary(self) -> str:
        return (f"device init {self.device_init_s:.2f} s, checkpoint headers + fingerprint {self.checkpoint_s:.2f} s, "
                f"transformer {self.transformer_s:.2f} s ({self.transformer_bytes / 1e9:.3f} GB at "
                f"{self.transformer_gbps:.2f} GB/s, {self.num_readers} readers), hooks {self.hooks_s:.2f} s, plan "
                f"cache {self.plan_cache_s:.2f} s + warm-up {self.warm_up_s:.2f} s, text encoder "
                f"{self.text_encoder_s:.2f} s, VAEs {self.vae_s:.2f} s; "
                f"engine {self.total_s:.2f} s")


@dataclass(frozen=True)
class ReplicaStartup:
    """A Serve replica's start, as wall-clock times (`time.time()`) in the order they happen, and `imports_s`,
    the model modules the constructor imported before the build (part of constructor -> build start). `engine`
    is the build's breakdown when the replica holds an `Engine`."""

    role: str  # "worker", "text_encoder", "decoder"
    process_started_at: float | None  # the OS process (None where the OS does not say); may predate the replica
    import_started_at: float  # this process first imported the `deployments` package (our code's first line)
    imported_at: float  # the deployment module's imports done (torch, Ray Serve, our modules)
    constructor_at: float  # the replica's constructor entered
    build_started_at: float  # the engine (or stage) build began (after `imports_s`)
    build_ended_at: float
    ready_at: float  # constructed (Serve calls it ready after its first health check)
    imports_s: float
    engine: EngineStartup | None = None
    # Our modules were imported while Ray started the process (RAY_preload_python_modules): in an idle worker, long
    # before the replica was asked for (then not part of its start); in a process Ray started for it, on its path.
    preloaded: bool = False

    @property
    def import_s(self) -> float:
        return self.imported_at - self.import_started_at

    @property
    def build_s(self) -> float:
        return self.build_ended_at - self.build_started_at

    @property
    def constructor_s(self) -> float:
        return self.ready_at - self.constructor_at

    def timeline(self) -> tuple[float, ...]:
        """The timestamps in the order they must hold (a test checks they never go backwards)."""
        return (self.import_started_at, self.imported_at, self.constructor_at, self.build_started_at,
                self.build_ended_at, self.ready_at)

    def summary(self) -> str:
        # Preloaded: the imports ran when Ray started the process; with an idle worker that was long before the
        # replica was asked for (a long wait to the constructor), else on its path (a short one).
        preload = " (preloaded as Ray started the process)" if self.preloaded else ""
        since_import = ("" if self.preloaded else
                        f" ({self.ready_at - self.import_started_at:.2f} s after our first import)")
        line = (f"{self.role} started: module imports {self.import_s:.2f} s{preload}, "
                f"{self.constructor_at - self.imported_at:.2f} s to the constructor, model imports "
                f"{self.imports_s:.2f} s, build {self.build_s:.2f} s, ready {self.constructor_s:.2f} s after the "
                f"constructor{since_import}")
        return line + (f" (engine: {self.engine.summary()})" if self.engine is not None else "")

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> "ReplicaStartup":
        """The inverse of `as_dict` (what `describe()` sends)."""
        engine = data.get("engine")
        return cls(**{**data, "engine": EngineStartup(**engine) if isinstance(engine, dict) else engine})


def process_started_at() -> float | None:
    """Wall-clock time this process started (Linux: /proc), or None where unknown."""
    try:
        with open("/proc/self/stat", "rb") as f:
            # Field 22 (starttime, clock ticks after boot); split after the command name, which may hold spaces.
            start_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
