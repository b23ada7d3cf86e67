"""A video job's stats (`jobs.backend.VideoStats`) say which weights its block linears ran with and which LoRA
adapters at which scale: carried from the engine's `GenerationStats` (`deployments.video_backend.video_stats`), in
a split app (prompt stage, denoiser-only engine, decode stage: each its own object, as the three deployments hold
them) and a fused one (one engine runs the pipeline). The engines are the real one on the tiny checkpoint on CPU,
`engine.quantization: bf16+fp8` with the float8 device checks lifted (torchao's float8 linears compute on a CPU
too: tests/test_forward_kernels.py), so a job's `quality` picks the weights."""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from deployments.video_backend import LOSSLESS_CACHE_DIT, ModelCard, PipelineVideoBackend, video_output
from engine.api import AdapterStats, ClipFacts, GenerationRequest, GenerationResult, GenerationStats, GenerationTimings
from engine.compiled import CompileStats
from engine.config import EngineConfig
from engine.engine import DenoiserEngine, Engine, decode_stage
from engine.pipeline import LocalDecode, LocalDenoise, Pipeline, PipelineResult, StageCallTimes, local_steps
from engine.prepare import PrepareStage, prepare_stage
from engine.stage_data import PromptEmbedding
from jobs.backend import VideoLora, VideoRun, VideoSpec, VideoStats
from model.mp4 import thumbnail_png, write_mp4
from model.tiny import make_tiny_checkpoint
from model.tiny_adapter import TURBO_TARGETS, save_adapter, tiny_lora_factors

pytest.importorskip("torchao")


def finished(stats: GenerationStats, calls: StageCallTimes) -> PipelineResult:
    frames = np.zeros((5, 32, 32, 3), dtype=np.uint8)
    mp4 = io.BytesIO()
    write_mp4(mp4, frames, 24, np.zeros((2, 3200), dtype=np.float32), 32000)
    result = GenerationResult(video=torch.zeros(1), audio=torch.zeros(1), seed=1, model="m",
                              timings=GenerationTimings(), stats=stats, mp4=mp4.getvalue(),
                              thumbnail_png=thumbnail_png(frames[0]),
                              clip=ClipFacts(num_frames=5, fps=24.0, sample_rate=32000))
    return PipelineResult(result, calls)


@pytest.mark.parametrize("calls", [StageCallTimes(1.0, 2.0, 3.0), StageCallTimes(None, 6.0, None)],
                         ids=["split", "fused"])
def test_the_jobs_stats_carry_the_engines_linears_and_adapters(calls):
    stats = GenerationStats(steps=3, forwards=2, frames=5, tokens=10, text_tokens=2, adaln_mode="online",
                            schedule_key="k", linears="fp8",
                            adapters=AdapterStats(scales={"turbo": 0.5, "style": 1.0}, loaded=["style"]))
    assert video_output(finished(stats, calls), 7.0).stats.model_dump(include={"linears", "adapters"}) == {
        "linears": "fp8", "adapters": {"turbo": 0.5, "style": 1.0}}
    plain = video_output(finished(stats.model_copy(update={"linears": "bf16", "adapters": None}), calls), 7.0).stats
    assert (plain.linears, plain.adapters) == ("bf16", {})
    assert (VideoStats().linears, VideoStats().adapters) == ("bf16", {})  # a record written before these fields


@pytest.mark.parametrize("compile_stats, reported", [
    (None, None),  # compile off
    (CompileStats(frames_compiled=1, since_warmup=0, graph_breaks=0, warmup_s=1.5, warmup_forwards=1), 0),
    (CompileStats(frames_compiled=3, since_warmup=2, graph_breaks=0, warmup_s=1.5, warmup_forwards=1), 2),
], ids=["off", "warmed", "compiled-after-warm-up"])
def test_the_jobs_stats_say_how_many_graphs_the_replica_compiled_after_its_warm_up(compile_stats, reported):
    stats = GenerationStats(steps=3, forwards=2, frames=5, tokens=10, text_tokens=2, adaln_mode="online",
                            schedule_key="k", compile=compile_stats)
    assert video_output(finished(stats, StageCallTimes(1.0, 2.0, 3.0)), 7.0).stats.compiles_since_warmup == reported
    assert VideoStats().compiles_since_warmup is None  # a record written before the field


@dataclass(frozen=True)
class PreparePrompt:
    """A split app's prompt step (the TextEncoder deployment's stage), in this process."""

    stage: PrepareStage

    async def encode(self, request: GenerationRequest, cancelled) -> PromptEmbedding:
        return self.stage.encode(request)


class LocalRunner:
    """`deployments.generation.GenerationRunner` over a pipeline of in-process steps."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    async def check(self, request: GenerationRequest) -> None:
        pass

    async def run(self, request, on_progress=None, cancelled=None, on_denoised=None) -> PipelineResult:
        return await self.pipeline.run(request, on_progress, cancelled, on_denoised)


@pytest.mark.slow  # two tiny engines, a prompt stage and a decode stage built, two jobs each on CPU
def test_fp8_and_adapter_jobs_say_so_in_split_and_fused_apps(tmp_path, monkeypatch):
    monkeypatch.setattr("engine.fp8.check_fp8_device", lambda device, field="engine.quantization": None)
    monkeypatch.setattr("torchao.quantization.quant_api._check_hardware_support", lambda granularity: None)
    turbo = save_adapter(tmp_path / "turbo.safetensors", tiny_lora_factors(1, targets=TURBO_TARGETS, rank=4))
    config = EngineConfig(checkpoint=str(make_tiny_checkpoint(tmp_path / "tiny", "diffusers", seed=0)), device="cpu",
                          quantization="bf16+fp8", adapters={"turbo": {"path": str(turbo), "scale": 0.75}},
                          adaln={"host_cache_gb": 0.01}, text_encoder={"vision": False},
                          geometry={"short_edge": None, "min_seconds": 0.1})
    fused = Engine(config)
    denoiser = DenoiserEngine(config)
    runners = {"fused": LocalRunner(Pipeline(*local_steps(fused))),
               "split": LocalRunner(Pipeline(PreparePrompt(prepare_stage(config)), LocalDenoise(denoiser),
                                             LocalDecode(decode_stage(config))))}
    card = ModelCard.from_describe(fused.describe())
    run = VideoRun(job_id="j", output_key="k", on_progress=lambda done, total: None, cancelled=lambda: False,
                   denoised=lambda: None)
    jobs = {"fused": ((("fp8", VideoLora(name="turbo"), ("fp8", {"turbo": 0.75})),
                       ("lossless", VideoLora(name="turbo", scale=0.5), ("bf16", {"turbo": 0.5})))),
            "split": (("fp8", VideoLora(name="turbo", scale=0.5), ("fp8", {"turbo": 0.5})),
                      ("fp8", None, ("fp8", {})))}
    for app, runner in runners.items():
        backend = PipelineVideoBackend(runner, card, LOSSLESS_CACHE_DIT, 5.0)
        for quality, lora, want in jobs[app]:
            spec = VideoSpec(model=card.limits.name, prompt="a red fox", seconds=0.5, width=32, height=32,
                             num_inference_steps=3, seed=3, flow_shift=5.0, audio_flow_shift=5.0, quality=quality,
                             lora=lora)
            stats = asyncio.run(backend.run(spec, run)).stats
            assert (stats.linears, stats.adapters) == want, (app, quality, lora)
            assert stats.num_steps == 2
