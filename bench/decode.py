"""The decode stage of one request: the VAEs, then the MP4 mux, one after the other against overlapped.

`DecodeStage.decode` H.264-encodes each clip of frames on a host thread while the video VAE decodes the next
(`model.mp4.write_mp4_clips`). Measured side by side on one device, alternating, `--repeats` times each:

- serial: the video decode, the audio decode, then `write_mp4` of all the frames (the stage before the overlap);
- overlapped: `DecodeStage.decode` as a request runs it (the same MP4 bytes, checked);
- with `--cudnn-benchmark` (CUDA), the overlapped stage again with cuDNN's autotuner on the VAE's 3D convolutions
  (its first call, which tunes, reported apart; frames compared with the default's).

Floor of the overlap: the longer of its two halves run alone, max(VAE decodes, mux): what a perfect overlap
would take. A 1344x768 5 s request on a GPU uses the released VAE geometry (random weights; a 1-block h3-width
checkpoint is written once under `--workdir`); `--smoke` runs the tiny checkpoint's VAEs on the CPU at 640x384
(there the VAE and x264 share the host's cores, which a GPU host's VAE does not).

    python -m bench.decode --workdir /dev/shm/decode        # one GPU: ~2 min, the checkpoint written once
    python -m bench.decode --smoke                          # CPU, tiny VAEs

Writes bench/results/decode-<device>.md and .json (`decode-smoke-cpu` with `--smoke`).
"""

from __future__ import annotations

import argparse
import io
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.checkpoints import ensure_bench_checkpoint
from bench.common import write_run_results
from engine.stages import DecodeStage
from model.geometry import H3_LATENTS, GeometryLimits, VideoGeometry
from model.layout import H3Checkpoint
from model.mp4 import write_mp4

ROOT = Path(__file__).resolve().parents[1]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_latents(stage: DecodeStage, geometry: VideoGeometry, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised video [C, F, H, W] and audio [2A, Ca] latents of `geometry`, N(0, 1) as a denoise ends near."""
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(stage.video_decoder.latent_channels, geometry.num_latent_frames, geometry.latent_height,
                        geometry.latent_width, generator=g)
    audio = torch.randn(2 * geometry.num_audio_latents, stage.audio_decoder.latent_channels, generator=g)
    return video, audio


def serial(stage: DecodeStage, video: torch.Tensor, audio: torch.Tensor, device: torch.device
           ) -> tuple[float, float, bytes]:
    """(VAE decodes s, mux s, MP4 bytes): the stage as it ran before the overlap."""
    start = time.perf_counter()
    frames = stage.video_decoder.decode(video)
    waveform = stage.audio_decoder.decode(audio)
    sync(device)
    decoded = time.perf_counter()
    buffer = io.BytesIO()
    write_mp4(buffer, frames, H3_LATENTS.fps, waveform, stage.audio_decoder.sample_rate)
    return decoded - start, time.perf_counter() - decoded, buffer.getvalue()


def overlapped(stage: DecodeStage, video: torch.Tensor, audio: torch.Tensor, device: torch.device
               ) -> tuple[float, float, float, bytes]:
    """(wall s, decode_s, mux_s, MP4 bytes) of `DecodeStage.decode`."""
    start = time.perf_counter()
    out = stage.decode(video, audio)
    sync(device)
    return time.perf_counter() - start, out.decode_s, out.mux_s, out.mp4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, the tiny checkpoint's VAEs at 640x384")
    parser.add_argument("--size", default=None, help="WIDTHxHEIGHT (default 1344x768; --smoke 640x384)")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cudnn-benchmark", action="store_true", help="also with cuDNN's autotuner (CUDA)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench" / "state-decode",
                        help="where the benchmark checkpoint is written once")
    parser.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = parser.parse_args(argv)
    command = " ".join(["python -m bench.decode", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    width, height = map(int, (args.size or ("640x384" if args.smoke else "1344x768")).split("x"))

    started = time.perf_counter()
    root = ensure_bench_checkpoint(args.workdir / ("tiny" if args.smoke else "h3-1block"), tiny=args.smoke,
                                   num_blocks=1, text_layers=1)
    stage = DecodeStage(H3Checkpoint.open(root), device)
    limits = GeometryLimits(short_edge=None, max_pixels=4096 * 4096, min_seconds=0.1, max_seconds=60.0)
    geometry = VideoGeometry.from_seconds(width, height, args.seconds, limits, H3_LATENTS)
    video, audio = random_latents(stage, geometry)
    notes = [f"{width}x{height}, {geometry.num_frames} frames ({geometry.num_latent_frames} latent), "
             f"{2 * geometry.num_audio_latents} audio rows; VAEs of {root.name}; median of {args.repeats}, "
             "serial and overlapped alternating after one call of each",
             "floor of the overlap: max(VAE decodes, mux) as the serial runs measured them"]

    serial(stage, video, audio, device)  # warm-up: allocator, kernels' first launch, x264's init
    overlapped(stage, video, audio, device)
    serial_runs, overlapped_runs = [], []
    for _ in range(args.repeats):
        serial_runs.append(serial(stage, video, audio, device))
        overlapped_runs.append(overlapped(stage, video, audio, device))
    if any(o[3] != s[2] for o, s in zip(overlapped_runs, serial_runs)):
        raise RuntimeError("the overlapped stage's MP4 differs from decoding all, then muxing")

    decode_s = statistics.median(r[0] for r in serial_runs)
    mux_s = statistics.median(r[1] for r in serial_runs)
    floor_s = max(decode_s, mux_s)
    rows = []

    def row(what: str, seconds: float, stage_decode_s: float | None = None, stage_mux_s: float | None = None,
            note: str = "") -> None:
        rows.append({"what": what, "s": round(seconds, 3), "floor s": round(floor_s, 3),
                     "x floor": round(seconds / floor_s, 3), "x serial": round(seconds / (decode_s + mux_s), 3),
                     "decode_s": None if stage_decode_s is None else round(stage_decode_s, 3),
                     "mux_s": None if stage_mux_s is None else round(stage_mux_s, 3), "note": note})
        print(rows[-1], flush=True)

    row("serial: VAE decodes, then mux", decode_s + mux_s, decode_s, mux_s, "the stage before the overlap")
    wall = statistics.median(r[0] for r in overlapped_runs)
    row("overlapped: DecodeStage.decode", wall, statistics.median(r[1] for r in overlapped_runs),
        statistics.median(r[2] for r in overlapped_runs), "each clip encoded while the next decodes; same bytes")

    if args.cudnn_benchmark and device.type == "cuda":
        before = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True
        try:
            tuning = overlapped(stage, video, audio, device)
            tuned = [overlapped(stage, video, audio, device) for _ in range(args.repeats)]
            tuned_frames = stage.video_decoder.decode(video)
        finally:
            torch.backends.cudnn.benchmark = before
        frames = stage.video_decoder.decode(video)
        differs = int(np.abs(tuned_frames.astype(np.int16) - frames.astype(np.int16)).max())
        row("overlapped, cudnn.benchmark", statistics.median(r[0] for r in tuned),
            statistics.median(r[1] for r in tuned), statistics.median(r[2] for r in tuned),
            f"tuning call {tuning[0]:.2f} s; frames differ from the default's by at most {differs} of 255")
    write_run_results("decode", rows, str(device), args.smoke, command, notes, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
