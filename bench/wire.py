"""One Serve hop carrying a tensor: as torch pickles it, and as `engine.wire` sends it (numpy bytes, out of band).

    python -m bench.wire [--sizes-mib 1,4,16] [--calls 40] [--out DIR]

A caller replica times handle calls to a callee replica on the same node, both ways: `get` (the callee returns
the payload: a TextEncoder answering, a Worker's latents) and `put` (the caller sends it: embeddings to the
Worker, latents to the Decoder). Both payloads are the same frozen dataclass holding one bf16 tensor; `wire`
adds the `TensorsAsArrays` mixin, as `PromptEmbedding`, `Latents` and `GenerationResult` do. Sizes: 4 MiB is
a ~500-token prompt's embedding (4096 bf16 per token), 16 MiB the longest prompt (2048 tokens). The floor beside
each number: the bytes copied once at this process's memcpy rate (the object store writes the payload once and
the receiver copies it out), plus the empty hop.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from bench.common import command_line, write_results
from engine.wire import TensorsAsArrays


@dataclass(frozen=True)
class TorchPayload:
    tensor: torch.Tensor


@dataclass(frozen=True)
class WirePayload(TensorsAsArrays):
    tensor: torch.Tensor


def payload(kind: str, nbytes: int) -> TorchPayload | WirePayload:
    tensor = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    return WirePayload(tensor) if kind == "wire" else TorchPayload(tensor)


def memcpy_gbps(nbytes: int = 64 << 20) -> float:
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return nbytes / min(times) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", default="1,4,16")
    parser.add_argument("--calls", type=int, default=40, help="timed calls per cell (after 3 warm-up calls)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    sizes = [int(float(size) * 2**20) for size in args.sizes_mib.split(",")]

    import ray
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Callee:
        def __init__(self, sizes: list[int]) -> None:
            self.payloads = {(kind, n): payload(kind, n) for kind in ("torch", "wire") for n in sizes}

        async def get(self, kind: str, nbytes: int) -> TorchPayload | WirePayload | None:
            return self.payloads[kind, nbytes] if nbytes else None

        async def put(self, value: TorchPayload | WirePayload) -> int:
            return value.tensor.numel()

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Caller:
        def __init__(self, callee) -> None:
            self.callee = callee

        async def run(self, kind: str, nbytes: int, direction: str, calls: int) -> list[float]:
            sent = payload(kind, nbytes)
            times = []
            for _ in range(calls + 3):
                start = time.perf_counter()
                if direction == "get":
                    await self.callee.get.remote(kind, nbytes)
                else:
                    await self.callee.put.remote(sent)
                times.append(time.perf_counter() - start)
            return times[3:]

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        handle = serve.run(Caller.bind(Callee.bind(sizes)), name="wire", route_prefix=None)
        empty = handle.run.remote("torch", 0, "get", args.calls).result()
        empty_ms = statistics.median(empty) * 1e3
        gbps = memcpy_gbps()
        rows = [{"direction": "get", "MiB": 0, "torch_p50_ms": round(empty_ms, 2), "wire_p50_ms": "",
                 "torch_p90_ms": "", "wire_p90_ms": "", "torch_over_wire": "", "floor_ms": round(empty_ms, 2)}]
        for nbytes in sizes:
            for direction in ("get", "put"):
                cells = {}
                for kind in ("torch", "wire"):
                    times = sorted(handle.run.remote(kind, nbytes, direction, args.calls).result())
                    cells[kind] = (statistics.median(times) * 1e3, times[int(0.9 * (len(times) - 1))] * 1e3)
                rows.append({
                    "direction": direction, "MiB": nbytes / 2**20,
                    "torch_p50_ms": round(cells["torch"][0], 2), "wire_p50_ms": round(cells["wire"][0], 2),
                    "torch_p90_ms": round(cells["torch"][1], 2), "wire_p90_ms": round(cells["wire"][1], 2),
                    "torch_over_wire": round(cells["torch"][0] / cells["wire"][0], 2),
                    "floor_ms": round(empty_ms + 2 * nbytes / (gbps * 1e9) * 1e3, 2),
                })
        serve.shutdown()
    finally:
        ray.shutdown()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    notes = [f"one Serve hop, caller replica -> callee replica (local Ray, 2 CPUs); {args.calls} timed calls per cell",
             f"floor: the empty hop ({empty_ms:.2f} ms) + the bytes copied twice at this process's memcpy rate "
             f"({gbps:.1f} GB/s): into the object store, out of it"]
    md, _ = write_results("wire", rows, device, command_line(), notes=notes, out_dir=args.out)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
