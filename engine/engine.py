"""The engine: MiniMax-H3 on one device, prompt to MP4, one generation at a time (plain torch, no Ray).

A request goes through named stages:

    validate -> plan (schedule + AdaLN plans) -> encode (prompt, seeded noise) -> denoise -> decode -> mux

The model is diffusers' own (`MiniMaxH3Transformer3DModel`, Qwen3-VL, the two VAEs), loaded from either
published layout by `model/`. Around the denoising loop hook ditserve's features:

- AdaLN (`engine.adaln.mode`): `resident` runs diffusers' forward as is; `online` loads the transformer
  without its `adaln_proj` / `norm_out.linear` weights (24.2 GiB of H3) and feeds every forward the step's
  rows from the plan cache (`cache.plan_cache.PlanCache`: GPU slab -> host tier -> node pool -> rebuild
  from the checkpoint's bytes) through `model.adaln.ExternalModulation`; both give the same bits.
- Layerwise offload (`offload.layerwise.LayerwiseOffloader` on `transformer_blocks`) and Cache-DiT
  (`cache.cache_dit.CacheDit`): refreshed per request, `predict_middle()` tells the offloader per forward
  whether the middle blocks will run, so a skipped block is never streamed.

Placement: on one H200 (141 GB) the default keeps everything resident: transformer ~36 GB with online AdaLN,
text encoder ~51.5 GB (the 50 layers that feed hidden_states[50]), video VAE 10.4 GB, audio VAE 0.6 GB.
On a smaller card: `offload.enabled` streams the blocks, `text_encoder.device: cpu` / `decode.device: cpu`
keep the encoder and decoders off the GPU.

Several devices (`engine.parallel.sp` > 1): one process per device, each holding an `Engine` built with its
rank's `parallel.group.SpGroup` (`actors.gpu_worker` starts them). Every rank runs every request whole (same
seed, the noise is drawn on the CPU, so the same latents), with `parallel.sequence.SequenceParallel` sharding
each forward over the group and `parallel.cache_decision` making Cache-DiT decide alike on every rank; only
rank 0 holds the VAEs, decodes and muxes. What must not differ between ranks is agreed on through the group:
cancellation (rank 0's answer, before the loop and at every step boundary, there one boundary late:
`parallel.late_flag`, so the host never waits for the GPU queue) and the AdaLN plan cache's admission and eviction (a
deterministic function of the request sequence, so identical when every rank sees the same requests in the
same order; checked per request by comparing a digest of the slab rows every rank prepared): `parallel.agreement`.

Errors: the public methods raise `engine.errors` types (the lower layers' errors are translated here, with
their messages, chained as `__cause__`), so the Serve layer sorts them without importing `cache/` or
`model/`. The constructor is the exception: a checkpoint that cannot be loaded at start raises the
loader's own error (`model.layout.CheckpointError`, a ValueError naming the file); no request is involved
and the replica does not start.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import torch

from cache.cache_dit import CacheDit, CacheDitConfig, CacheDitOverrides, find_block_stack
from cache.plan_cache import AdmissionError, PlanCache, RemoteTier, make_adaln_provider
from cache.rebuild import RebuildError
from engine.adapters import AdapterSet
from engine.api import field_error, request_size, with_adapter_defaults
from engine.api import (
    AdapterChoice, CancelledFn, GenerationRequest, GenerationResult, GenerationStats, GenerationTimings, ProgressFn,
    RankStats, SlabState,
)
from engine.config import AdapterConfig, EngineConfig, WarmupCanvas
from engine import forward
from engine.fp8 import requantized
from engine.errors import AdmissionRejected, ClientError, FaultCause, GenerationCancelled, ServerFault, WeightsRejected
from engine.limits import QUALITY_LINEARS, Linears, Quality
from engine.model_limits import geometry_limits, model_limits, served_model_name
from engine.pipeline import Pipeline, local_steps, run_local
from engine.served import ServedSchedules
from engine.startup import EngineStartup
from engine.conditioning import checked_conditioning, conditioned_plan, conditioning_stage, prepared_on_rank_0
from engine.stage_data import PromptEmbedding
from engine.stages import DecodeStage, PromptStage
from model.adapters import AdapterError
from model.adaln import ExternalModulation
from model.decode import AudioDecoder, VaeHalves, VideoDecoder
from model.denoise import ConditionLatents, Denoiser
from model.geometry import H3_LATENTS, GeometryError, VideoGeometry
from model.canvas import CanvasRule
from model.layout import CheckpointError, H3Checkpoint
from model.loading import DEFAULT_NUM_READERS, load_transformer
from model.provisioning import ensure_adapter, ensure_checkpoint, served_partition
from model.schedule import H3Schedule, ScheduleError, Task
from model.prompts import PromptCacheStats
from model.text_encoder import PromptEncoder
from model.text_memo import RefinedTextMemo
from model.weights import TransformerWeights, is_adaln_param
from offload.layerwise import LayerwiseOffloader
from offload.wrapped import is_wrapped
from parallel.agreement import RankAgreement, RankDivergence, RankFailure, RankShardedRebuild
from parallel.cache_decision import install_rank_consistent_similarity
from parallel.group import CollectiveError, SpGroup
from parallel.late_flag import LateFlag
from parallel.sequence import Exchange, SequenceParallel
from parallel.text_encoder import TextTensorParallel

logger = logging.getLogger(__name__)


def resolve_device(name: str, engine_device: torch.device | None = None) -> torch.device:
    if name == "engine":
        assert engine_device is not None
        return engine_device
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but this process sees no CUDA device; use device: auto or cpu")
    return torch.device(name)


def _checked_group(config: EngineConfig, group: SpGroup | None) -> SpGroup | None:
    """The group a multi-device engine runs in (None: one device). ValueError naming the mismatch."""
    sp = config.parallel.sp
    if group is None:
        if sp > 1:
            raise ValueError(f"engine.parallel.sp={sp} runs one process per device: start the replica through "
                             "actors.gpu_worker.ParallelEngine, which builds each rank's Engine with its group")
        return None
    if group.world_size != sp:
        raise ValueError(f"the group has {group.world_size} ranks but engine.parallel.sp={sp}")
    if group.device.type != resolve_device(config.device).type:
        raise ValueError(f"the group's device {group.device} is not engine.device={config.device!r}")
    return group if group.world_size > 1 else None


def _init_device(device: torch.device) -> None:
    """Create the device's context now (CUDA: ~1 s on first use), so the load timings do not include it."""
    if device.type == "cuda":
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)
        check_cuda_visibility(os.environ.get("CUDA_VISIBLE_DEVICES"), torch._C._cuda_getDeviceCount())


def check_cuda_visibility(visible: str | None, runtime_devices: int) -> None:
    """Refuse to run on devices this process was not given. Ray gives a GPU replica its devices by setting
    CUDA_VISIBLE_DEVICES when it places the replica in a worker process; CUDA reads the variable once, when the
    process first initializes it. A module imported into Ray's idle workers that initializes CUDA
    (RAY_preload_python_modules) would fix the process to every GPU of the node, and every replica would then run
    on device 0. `runtime_devices` is what the CUDA runtime enumerates (torch.cuda.device_count() reads the variable
    again through NVML and would agree with it)."""
    if not visible:  # unset: every device is this process's; "" means none and torch would not pick cuda
        return
    named = len(visible.split(","))
    if runtime_devices > named:  # fewer is CUDA dropping entries it cannot parse (it stops at the first)
        raise RuntimeError(
            f"CUDA_VISIBLE_DEVICES={visible} names {named} device(s) but CUDA enumerates {runtime_devices}: CUDA was "
            "initialized in this process before the variable was set, so it would not use the devices it was given "
            "(a module preloaded into Ray's workers must not initialize CUDA)")


#: Schedules kept built: a server sees a few distinct (steps, shifts); each is ~KBs of CPU tensors.
SCHEDULES_KEPT = 64


@functools.lru_cache(maxsize=SCHEDULES_KEPT)
def request_schedule(steps: int, flow_shift: float, audio_flow_shift: float) -> H3Schedule:
    """A request's schedule, built once per (steps, shifts): a build runs the diffusers scheduler twice (1-2 ms
    on the request path, outside every timed phase). Shared between requests and threads: `H3Schedule` is
    frozen and its tensors are only read. A bad value raises ScheduleError each time (errors are not kept)."""
    return H3Schedule.build(steps, flow_shift, audio_flow_shift, Task.T2VA)


def default_request_plans() -> list[torch.Tensor]:
    """The plans of a request that leaves steps and shifts at their defaults (what the plan cache's warm-up
    reserves publish staging for)."""
    fields = GenerationRequest.model_fields
    return list(request_schedule(fields["steps"].default, fields["flow_shift"].default,
                                 fields["audio_flow_shift"].default).plans)


class Engine:
    """MiniMax-H3 on one device (or one rank of a multi-device replica). Thread-safe: generations (and weight
    updates) are serialized by a lock."""

    def __init__(self, config: EngineConfig, remote: RemoteTier | None = None, *, group: SpGroup | None = None):
        """`remote`: optional node-shared plan pool (`cache.plan_cache.RemoteTier`, the pool client in
        `actors/`, built by the Serve worker); used in adaln.mode=online only. `group`: this process's rank of
        a replica of `config.parallel.sp` devices (`parallel.group.init_group`); None for one device. The
        transformer alone, without the text encoder and the VAEs: `DenoiserEngine`."""
        begin = time.perf_counter()
        self.config = config
        self.group = _checked_group(config, group)
        self.rank = self.group.rank if self.group is not None else 0
        #: What this rank agrees on with the others (None: one device).
        self.agreement = RankAgreement(self.group) if self.group is not None else None
        self.device = self.group.device if self.group is not None else resolve_device(config.device)
        forward.prepare_compile(config.compile, self.device)
        t = time.perf_counter()
        _init_device(self.device)
        device_init_s, t = time.perf_counter() - t, time.perf_counter()
        self.checkpoint = H3Checkpoint.open(ensure_checkpoint(config), served_partition(config),
                                            require_components=True)
        self.weights = TransformerWeights(self.checkpoint.transformer_dir, self.checkpoint.layout)
        self.model_config = self.weights.config
        self.model_name = f"{served_model_name(config)}@{self.weights.fingerprint}"  # reads ~3 pages per tensor
        checkpoint_s = time.perf_counter() - t
        online = config.adaln.mode == "online"
        offload = config.offload.enabled
        self.prompt_stage: PromptStage | None = None
        self.decode_stage: DecodeStage | None = None
        # One after the other: accelerate's `init_empty_weights` (diffusers' and transformers' loaders, ours)
        # patches `torch.nn.Module.register_parameter` process-wide, so a load on another thread would put this
        # one's parameters on meta.
        t = time.perf_counter()
        # With offload the blocks are loaded on the host and streamed; the offloader moves the rest.
        self.transformer = load_transformer(self.weights, "cpu" if offload else self.device,
                                            skip=is_adaln_param if online else None)
        # FP8 block linears (engine.quantization), quantized in place on the device right after the bf16 load
        # (with offload each linear visits the device and its FP8 weight streams from the host).
        quantized_linears, precision = forward.quantize(self.transformer, config.quantization, self.device)
        transformer_s = time.perf_counter() - t
        t = time.perf_counter()
        # Online: the AdaLN projections stay on disk; each forward reads its rows from the plan cache.
        self.modulation = ExternalModulation.install(self.transformer) if online else None
        # The token refiner (no timestep input) runs once per request instead of once per forward.
        self.refined_text = RefinedTextMemo.install(self.transformer)
        # Sequence parallel hooks the transformer's own forward and attention processors; installed before the
        # offloader and Cache-DiT wrap the blocks (so its input and output hooks stay outermost).
        self.sequence_parallel: SequenceParallel | None = None
        if self.group is not None:
            exchange = Exchange(overlap=config.parallel.a2a_overlap, head_chunks=config.parallel.a2a_head_chunks)
            self.sequence_parallel = SequenceParallel.install(self.transformer, self.group, exchange)
        self.offloader: LayerwiseOffloader | None = None
        if offload:
            self.offloader = LayerwiseOffloader(
                self.transformer.transformer_blocks, config.offload, self.device, root=self.transformer
            ).apply()
        self.cache_dit: CacheDit | None = None
        if config.cache_dit.enabled:
            self.cache_dit = CacheDit(self.transformer, config.cache_dit, stack=find_block_stack(self.transformer))
            if self.sequence_parallel is not None:  # a rank that skips while another computes would deadlock
                install_rank_consistent_similarity(self.transformer._context_manager, self.group,
                                                   self._num_local_real_rows)
        # LoRA adapters after the offloader: their factors are made on the device and stay resident
        # (engine.adapters); every configured file is checked here (AdapterError names it: no start).
        self.adapters = AdapterSet(served_adapter_files(config), int(config.adapters_cache_mb * 1e6),
                                   self.transformer, self.weights)
        # The attention backend and compiled blocks, once every hook is in place (the compiled forward runs
        # inside each block's own __call__, so the offloader's and Cache-DiT's hooks stay eager around it).
        # The SP exchange breaks the block's graph, so it cannot be kept whole (compile.precompiled): not tried,
        # which would trace the block once more at start only to find that out.
        compile_config = config.compile if self.sequence_parallel is None else \
            config.compile.model_copy(update={"precompiled": False})
        self.forward_kernels = forward.install(self.transformer, attention=config.attention,
                                               compile_config=compile_config, quantized_linears=quantized_linears,
                                               quantization=config.quantization, device=self.device,
                                               precision=precision, modulation=self.modulation,
                                               lora_active=self.adapters.lora_active)
        hooks_s = time.perf_counter() - t
        #: What this engine serves (`describe()["limits"]`); `_geometry_limits`: the same, as `model.geometry` checks.
        self.limits = model_limits(config, self.model_config.hidden_size,
                                   config.served_tasks(self.checkpoint.partition.value), CanvasRule.of(self.checkpoint))
        self._geometry_limits = geometry_limits(self.limits)
        self._lock = threading.RLock()  # generations and weight updates, one at a time
        #: Schedules served and the plan keys each needed: which of them the slab holds is the router's input.
        self.served_schedules = ServedSchedules()
        self._busy = False
        self._num_requests = 0
        self._num_failed = 0
        #: Why this rank can no longer serve (ranks diverged), beside the group's own failure; None: healthy.
        self._fault: str | None = None
        self.plan_cache: PlanCache | None = None
        #: With a group: how this rank's plan cache splits rebuilds with the other ranks' (None: one device).
        self.sharded_rebuild: RankShardedRebuild | None = None
        #: The node-shared plan pool (None without one): `update_weights` calls its
        #: `invalidate(old_weights_version)` so no tier keeps plans of the old weights.
        self.pool_tier = remote if online else None
        # The configured canvases' graphs, so no request pays the compile (a forward or two, not their schedules),
        # made after the plan cache's build and the text encoder's load, or beside them with
        # `compile.overlap_loads` (the warm-up's AdaLN rows are stand-ins: it needs neither; one device only:
        # `forward.warm_up` says why).
        plan_cache_s, warm_up_s, text_encoder_s = forward.warm_up(
            self.forward_kernels, config.served_warmup(), self._warm_up_tiers(), tokens=self._warm_up_tokens,
            run=self._warm_up_run, meanwhile=functools.partial(self._build_rest, online, remote),
            overlap=self.group is None and config.compile.overlap_loads, device=self.device)
        # After the warm-up: diffusers' `from_pretrained` sets torch's default dtype, process-wide, while it builds
        # a VAE (a warm-up beside it could trace a graph of other dtypes).
        vae_s = self._load_vaes()
        self.conditioning = conditioning_stage(self.checkpoint, self.prompt_stage, self.decode_stage,
                                               self._geometry_limits)
        #: The stages composed once (`engine.pipeline`): this engine's prompt, denoise and decode steps.
        self._pipeline = Pipeline(*local_steps(self))
        self._num_requests = 0
        self.startup = EngineStartup(
            device_init_s=device_init_s, checkpoint_s=checkpoint_s, transformer_s=transformer_s,
            transformer_bytes=sum(p.nbytes for p in self.transformer.parameters() if not p.is_meta),
            num_readers=DEFAULT_NUM_READERS, text_encoder_s=text_encoder_s, vae_s=vae_s,
            hooks_s=hooks_s, plan_cache_s=plan_cache_s, warm_up_s=warm_up_s,
            total_s=time.perf_counter() - begin)
        logger.info("engine ready: %s (%s layout) on %s (adaln %s, offload %s, cache-dit %s); start-up: %s",
                    self.model_name, self.checkpoint.layout.value, self.device, config.adaln.mode, offload,
                    config.cache_dit.enabled, self.startup.summary())
        logger.info("forward: %s", self.forward_kernels.summary())

    def _build_rest(self, online: bool, remote: RemoteTier | None) -> tuple[float, float, float]:
        """What the start builds before the compile warm-up (beside it with `compile.overlap_loads`): the AdaLN plan
        cache (online), its warm-up, the text encoder. Their seconds."""
        t = time.perf_counter()
        if online and self.group is None:
            provider = make_adaln_provider(self.config.adaln, self.transformer, self.weights, self.device,
                                           remote=remote)
            assert isinstance(provider, PlanCache)
            self.plan_cache = provider
        elif online:
            self.sharded_rebuild = RankShardedRebuild(self.group, self.model_config.num_blocks)
            self.plan_cache = PlanCache(self.config.adaln, self.weights, self.transformer, self.device, remote=remote,
                                        shards=self.sharded_rebuild)
        plan_cache_s, t = time.perf_counter() - t, time.perf_counter()
        if self.plan_cache is not None:
            # Staging buffers, reader threads, the cuBLAS handle and the projection kernels now, so the first
            # plan miss costs what later ones cost (on an H200 it took 0.80 s vs 0.165 s when set up lazily).
            self.plan_cache.warm_up(default_request_plans())
        warm_up_s = time.perf_counter() - t
        return plan_cache_s, warm_up_s, self._load_text_encoder()

    def _warm_up_tiers(self) -> list[Quality]:
        """The served weight sets, each its own graphs (bf16+fp8: both), as the tier a warm-up request names."""
        return [quality for quality in ("lossless", "fp8") if quality in self.limits.qualities]

    def _warm_up_request(self, canvas: WarmupCanvas, quality: Quality) -> GenerationRequest:
        """The request a warm-up of `canvas` runs: the schedule's first `forward.warmup_forwards` forwards (fewer
        when max_steps allows no more: then no request has more), with the canvas's adapters on, no decode."""
        forwards = forward.warmup_forwards(self.config.compile.dynamic)
        return GenerationRequest(prompt="warm-up", steps=min(forwards + 1, self.limits.max_steps),
                                 seconds=canvas.seconds, width=canvas.width, height=canvas.height, seed=0,
                                 return_video=False, quality=quality,
                                 adapters=tuple(AdapterChoice(name=name) for name in canvas.adapters))

    def _warm_up_tokens(self, canvas: WarmupCanvas) -> int:
        """Packed rows of a warm-up forward of `canvas` (ClientError, a ValueError, when this engine refuses it)."""
        request = with_adapter_defaults(self._warm_up_request(canvas, self.limits.default_quality), self.limits)
        geometry, _, _ = self._checked(request, warm_up=True)
        return geometry.num_tokens(forward.WARMUP_TEXT_TOKENS)

    def _warm_up_run(self, run: forward.WarmupRun) -> int:
        """One warm-up request through the denoiser on a stand-in prompt embedding (zeros); its forwards."""
        embeds = torch.zeros(forward.WARMUP_TEXT_TOKENS, self.model_config.text_dim,
                             dtype=self.model_config.torch_dtype)
        result = self._denoise_request(self._warm_up_request(run.canvas, run.quality),
                                       PromptEmbedding(embeds, 0.0, PromptCacheStats(0, 0, 0, 0, 0, 0)), None, None,
                                       warm_up=True)
        return result.stats.forwards

    def _load_text_encoder(self) -> float:
        """Build the prompt stage; its seconds."""
        start = time.perf_counter()
        config = self.config
        text_device = resolve_device(config.text_encoder.device, self.device)
        # Tensor parallel encoder: its all-reduces run on the group, so it lives on the rank's device.
        text_split = None
        if self.group is not None and config.parallel.text_encoder_tp:
            if text_device != self.device:
                raise ValueError(
                    f"engine.parallel.text_encoder_tp splits the text encoder over the ranks' devices; "
                    f"text_encoder.device={config.text_encoder.device!r} puts it on {text_device}: "
                    "use text_encoder.device: engine, or text_encoder_tp: false")
            text_split = TextTensorParallel(self.group)
        # The vision tower on rank 0 alone: it prepares keyframes and references for every rank (`encode`).
        self.prompt_stage = PromptStage(config.text_encoder, self.checkpoint, text_device, split=text_split,
                                        vision=config.text_encoder.vision and text_split is None and self.rank == 0)
        logger.info("text encoder: %s", self.prompt_stage.weights.summary())
        return time.perf_counter() - start

    def _load_vaes(self) -> float:
        """Build the decode stage on rank 0 (the other ranks do not hold the VAEs: 11 GB for H3); its seconds. The
        encoder halves too when this engine prepares keyframes and references (its prompt encoder has the vision
        tower: `engine.conditioning`), else the decoder halves alone."""
        start = time.perf_counter()
        if self.rank == 0:
            encodes = self.prompt_stage is not None and self.prompt_stage.encoder.has_vision
            self.decode_stage = DecodeStage(self.checkpoint, resolve_device(self.config.decode.device, self.device),
                                            VaeHalves.BOTH if encodes else VaeHalves.DECODER)
        return time.perf_counter() - start

    @property
    def prompt_encoder(self) -> PromptEncoder | None:
        """The Qwen3-VL encoder of the prompt stage (None when this engine is the denoiser alone)."""
        return self.prompt_stage.encoder if self.prompt_stage is not None else None

    @property
    def video_decoder(self) -> VideoDecoder | None:
        return self.decode_stage.video_decoder if self.decode_stage is not None else None

    @property
    def audio_decoder(self) -> AudioDecoder | None:
        return self.decode_stage.audio_decoder if self.decode_stage is not None else None

    # --- API ---------------------------------------------------------------------------------------

    def validate(self, request: GenerationRequest, embedding: PromptEmbedding | None = None) -> None:
        """ClientError (a ValueError) naming the field and the limit if the server cannot take `request`;
        `embedding`: a fl2va / ref2va request's, prepared elsewhere (its `Conditions`: a denoiser-only engine)."""
        self._checked(with_adapter_defaults(request, self.limits), embedding)

    def _checked(self, request: GenerationRequest, embedding: PromptEmbedding | None = None, *,
                 warm_up: bool = False) -> tuple[VideoGeometry, H3Schedule, CacheDitConfig]:
        """The request's geometry, schedule and Cache-DiT config; its prompt is checked by the prompt stage
        (here when this engine holds it, else in the TextEncoder deployment, before encoding). A fl2va / ref2va
        `embedding` carries its `Conditions` (canvas, reference soundtrack): the denoiser needs neither the media
        nor the encoders to plan it (`stages: split`, and the ranks of a sequence-parallel replica). A `warm_up`
        asks neither the plan cache (it runs on stand-in rows) nor the prompt stage (a stand-in embedding): they
        may still be being built beside it (`compile.overlap_loads`)."""
        self._check_task(request, warm_up=warm_up)
        try:
            if request.task is Task.T2VA:
                width, height = request_size(request, self.limits)
                geometry = VideoGeometry.from_seconds(width, height, request.seconds, self._geometry_limits, H3_LATENTS)
                schedule = request_schedule(request.steps, request.flow_shift, request.audio_flow_shift)
            elif embedding is not None and embedding.conditions is not None:
                if request.task.value not in self.checkpoint.tasks:
                    raise ClientError("keyframes" if request.keyframes else "references",
                                      f"{request.task.value} is not served by this model (the "
                                      f"{self.checkpoint.partition.native_dir_name} partition serves "
                                      f"{', '.join(self.checkpoint.tasks)})")
                geometry, schedule = conditioned_plan(request, embedding.conditions, self._geometry_limits)
            else:
                geometry, schedule = checked_conditioning(self.conditioning, request).check(request)
        except (GeometryError, ScheduleError) as exc:
            raise field_error(exc, request) from None
        if self.plan_cache is not None and not warm_up:  # more plans than the slab holds: refused here, not mid-run
            try:
                self.plan_cache.check_admission(schedule.plans)
            except AdmissionError as exc:
                raise AdmissionRejected(str(exc), f"adaln.gpu_plans={self.config.adaln.gpu_plans}") from exc
        if self.prompt_stage is not None and not warm_up:
            self.prompt_stage.check(request.prompt)
        return geometry, schedule, self._cache_dit_config(request, schedule.num_forwards)

    def _check_task(self, request: GenerationRequest, *, warm_up: bool = False) -> None:
        """The refusals that need neither the media nor the encoders (guidance, steps, a task this engine does not
        serve): made alike on every rank of a group, before any collective. A `warm_up` runs text-only on any
        partition: it makes graphs, no clip, and condition rows only lengthen the sequence, the graphs' one
        symbolic size, so the Ref2VA transformer's are made by a text-only run too."""
        if request.guidance_scale != 1.0:
            raise ClientError(
                "guidance_scale", f"{request.guidance_scale} is not served: MiniMax-H3 is CFG-distilled, guidance is "
                "fixed at 1; leave guidance_scale out or send 1", "guidance_scale=1")
        if request.steps > self.limits.max_steps:
            raise ClientError("steps", f"{request.steps} exceeds this server's max_steps={self.limits.max_steps}",
                              f"max_steps={self.limits.max_steps}")
        if request.task is Task.T2VA and Task.T2VA.value not in self.checkpoint.tasks and not warm_up:
            # The Ref2VA transformer is trained for references: a text-only request would run it silently.
            raise ClientError("references", f"t2va is not served by this model (the "
                              f"{self.checkpoint.partition.native_dir_name} partition serves "
                              f"{', '.join(self.checkpoint.tasks)}): send references", "engine.partition=fl2va")
        if request.task is not Task.T2VA and request.task.value in self.checkpoint.tasks \
                and request.task.value not in self.limits.tasks:
            # Refused alike on every rank of a group, before any collective (`EngineConfig.conditioning_refused`).
            raise ClientError("keyframes" if request.keyframes else "references",
                              f"{request.task.value} is not served by this engine: {self.config.conditioning_refused};"
                              f" it serves {', '.join(self.limits.tasks)}", "served: " + ", ".join(self.limits.tasks))

    def _linears(self, request: GenerationRequest) -> Linears:
        """The weights the request's tier runs the block linears with; ClientError on `quality` for a tier this
        server does not serve (naming the served ones)."""
        quality: Quality = request.quality if request.quality is not None else self.limits.default_quality
        if quality not in self.limits.qualities:
            raise ClientError("quality", self.limits.unserved_quality(quality),
                              "served: " + ", ".join(self.limits.qualities))
        return QUALITY_LINEARS[quality]

    def _cache_dit_config(self, request: GenerationRequest, num_forwards: int) -> CacheDitConfig:
        """The request's effective Cache-DiT config (server config + overrides, its tier's), checked once per
        request."""
        self._linears(request)
        if request.quality in ("lossless", "fp8"):  # these tiers are exact sampling of their weights
            if request.cache_dit is not None and request.cache_dit.enabled:
                raise ClientError("cache_dit", f"quality {request.quality!r} runs with Cache-DiT off; send quality "
                                  "'high' for Cache-DiT, or leave cache_dit out")
            return self.config.cache_dit.merged(CacheDitOverrides(enabled=False))
        if request.cache_dit is None:
            effective = self.config.cache_dit
        else:
            try:
                effective = self.config.cache_dit.merged(request.cache_dit)
            except ValueError as exc:
                raise ClientError("cache_dit", str(exc)) from None
        if not effective.enabled:
            return effective
        if self.cache_dit is None:
            raise ClientError("cache_dit", "Cache-DiT is off on this server (engine.cache_dit.enabled: false); leave "
                              "cache_dit out", "engine.cache_dit.enabled=false")
        try:
            effective.check_num_blocks(self.model_config.num_blocks)
            effective.resolve_mask(num_forwards)
        except ValueError as exc:
            raise ClientError("cache_dit", str(exc)) from None
        return effective

    @torch.no_grad()
    def generate(
        self, request: GenerationRequest, progress: ProgressFn | None = None, cancelled: CancelledFn | None = None
    ) -> GenerationResult:
        """Run one generation, every stage in this process (`engine.pipeline`: encode -> denoise -> decode +
        mux, rank 0 alone decoding). Raises ClientError (the request, before any work), AdmissionRejected (the
        plan cache can never serve it), ServerFault (e.g. a checkpoint shard unreadable while rebuilding plans)
        or GenerationCancelled (`cancelled()` turned true between two steps)."""
        with self._lock:  # the whole generation: a weight update waits for its decode too
            return run_local(self._pipeline, request, progress, cancelled).result

    @torch.no_grad()
    def encode(self, request: GenerationRequest, cancelled: CancelledFn | None = None) -> PromptEmbedding:
        """The prompt stage of `request` (its prompt, and for fl2va / ref2va the keyframes' and references'
        vision blocks), after the request's checks: nothing is encoded for a request the denoiser would refuse."""
        assert self.prompt_stage is not None
        self._check_cancelled(cancelled)
        request = with_adapter_defaults(request, self.limits)
        if self.group is not None and request.task is not Task.T2VA:
            # Rank 0 alone holds the VAE encoders and the vision tower: it checks and prepares the request, every
            # rank takes its embedding (a request rank 0 refuses is refused on every rank, the group intact).
            self._check_task(request)
            try:
                return prepared_on_rank_0(self.group, lambda: self._encode(request))
            except BaseException as exc:
                translated = _translated(exc)  # the broadcast's CollectiveError; rank 0's own are translated
                if translated is exc:
                    raise
                raise translated from exc
        return self._encode(request)

    def _encode(self, request: GenerationRequest) -> PromptEmbedding:
        self._checked(request)
        try:
            if request.task is Task.T2VA:
                return self.prompt_stage.encode(request.prompt)
            return checked_conditioning(self.conditioning, request).encode(request)
        except BaseException as exc:
            self._num_failed += 1
            translated = _translated(exc)
            if translated is exc:
                raise
            raise translated from exc

    def denoise(
        self, request: GenerationRequest, embedding: PromptEmbedding, progress: ProgressFn | None = None,
        cancelled: CancelledFn | None = None,
    ) -> GenerationResult:
        """The denoiser stage: AdaLN plans and the denoising loop for `request` conditioned on `embedding`
        (`encode` of it, in any process). Returns the latents (no MP4: the decode stage decodes them); timings
        `plan_s`, `denoise_s`. Errors as `generate`."""
        return self._denoise_request(request, embedding, progress, cancelled, warm_up=False)

    @torch.no_grad()
    def _denoise_request(self, request: GenerationRequest, embedding: PromptEmbedding, progress: ProgressFn | None,
                         cancelled: CancelledFn | None, *, warm_up: bool) -> GenerationResult:
        """`denoise`; a `warm_up` on stand-in AdaLN rows (`forward.StandInPlans`)."""
        request = with_adapter_defaults(request, self.limits)  # its adapters' steps and shifts, where it set none
        geometry, schedule, cache_dit = self._checked(request, embedding, warm_up=warm_up)
        if self.group is not None and request.seed is None:  # raised alike on every rank, before any collective
            raise ValueError("a multi-rank engine needs the request's seed set (every rank must draw the same "
                             "noise); the coordinator (actors.gpu_worker.ParallelEngine) draws it")
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        with self._lock:
            if (unusable := self._unusable_because()) is not None:
                raise ServerFault(f"engine unusable: {unusable}", FaultCause.ENGINE_UNUSABLE)
            self._busy = True
            try:
                result = self._denoise(request, geometry, schedule, cache_dit, seed, embedding, progress, cancelled,
                                       warm_up=warm_up)
            except BaseException as exc:
                self._num_failed += 1
                translated = _translated(exc)
                if translated is exc:
                    raise
                raise translated from exc
            finally:
                self._busy = False
                if self.modulation is not None:
                    self.modulation.clear()
                if self.offloader is not None:  # a forward that raised inside a block left it "running"
                    self.offloader.forward_ended()
            self._num_requests += 1
            return result

    @torch.no_grad()
    def update_weights(self, path: str | os.PathLike) -> dict[str, Any]:
        """Load the transformer's weights from the checkpoint at `path` (same architecture, either layout) in
        place, between requests. The text encoder and VAEs stay (fine-tunes and LoRA merges change the DiT).

        Everything is checked before anything is written (config, names, shapes, dtypes, and the plan
        cache's own check), so a rejected update (WeightsRejected, a ValueError) leaves the served model
        untouched. A read that fails after writing started (the disk changed since the check) is a
        ServerFault and leaves the engine unusable (it refuses generations, `health()` raises: Serve replaces
        the replica, which loads the fleet's target afresh). Afterwards AdaLN plans derived from the old
        weights are dropped. Returns `describe()`.
        """
        path = Path(path)
        with self._lock:
            weights = self._checked_weights(path)
            try:
                self._load_weights_(weights, path)
            except Exception as exc:  # e.g. CheckpointError: checked above, so the disk changed meanwhile
                # Some tensors may already be new: this engine must not serve again (health() tells Serve).
                self._fault = (f"weight update from {path} failed while writing ({type(exc).__name__}: {exc}); "
                               "the transformer may hold a mix of old and new weights")
                raise ServerFault(self._fault, FaultCause.WEIGHT_UPDATE_FAILED) from exc
            logger.info("weights updated from %s: now %s", path, self.model_name)
        return self.describe()

    def _load_weights_(self, weights: TransformerWeights, path: Path) -> None:
        """Write every transformer weight from `weights` (already checked), then drop plans derived from the
        old ones."""
        # Streamed block tensors go through the offloader (its host buffers are their source of truth);
        # every other parameter (device-resident ones included) is overwritten in place. Online AdaLN has
        # no projection parameters left in the model: their plans are rebuilt from the new files.
        # Under LoRA layers a base weight is `{module}.base_layer.weight`; the adapters' factors are not the
        # checkpoint's (a fused adapter's delta is overwritten here: `weights_updated`).
        precision = self.forward_kernels.precision
        if precision is not None:  # bf16+fp8: the bf16 weights are written, their float8 copies made again after
            precision.use("bf16")
        params = {name.replace(".base_layer.", "."): p for name, p in self.transformer.named_parameters()
                  if ".lora_" not in name}
        stored = set(weights.names())
        # An FP8 weight (engine.quantization) is written as the new bf16 tensor re-quantized on the device, one
        # at a time: its fp8 data and scales (streamed as `{name}.qdata` / `{name}.scale`).
        fp8 = {name for name, p in params.items() if is_wrapped(p)}

        def requantize(name: str) -> dict[str, torch.Tensor]:
            return requantized(weights.tensor(name, self.device), self.device)

        for index in range(self.model_config.num_blocks if self.offloader is not None else 0):
            prefix = f"transformer_blocks.{index}."
            streamed = list(self.offloader.block_state(index))
            new = {n: weights.tensor(prefix + n) for n in streamed if prefix + n in stored}
            for base in sorted({prefix + n.rpartition(".")[0] for n in streamed} & fp8):
                new.update({f"{base.removeprefix(prefix)}.{inner}": value.cpu()
                            for inner, value in requantize(base).items()})
            # Only checkpoint tensors: a streamed non-persistent buffer (ExternalModulation's dtype marker) keeps
            # its value.
            self.offloader.load_block_state_(index, new, strict=False)
            for n in streamed:
                params.pop(prefix + n, None)
                params.pop(prefix + n.rpartition(".")[0], None)
        for name, param in params.items():
            if name in fp8:
                for inner, value in requantize(name).items():
                    getattr(param, inner).copy_(value)
            else:
                param.copy_(weights.tensor(name, param.device))
        if precision is not None:
            precision.refresh()
        self.refined_text.clear()  # rows refined by the old weights
        self.adapters.weights_updated(weights)
        if self.plan_cache is not None:
            old_version = self.plan_cache.weights_version
            self.plan_cache.refresh_weight_derived_caches(path)
            if self.pool_tier is not None:  # the node-shared plan pool: drop plans of the old weights there too
                self.pool_tier.invalidate(old_version)
        self.weights = weights
        self.model_name = f"{served_model_name(self.config)}@{weights.fingerprint}"

    def validate_weight_update(self, path: str | os.PathLike) -> str:
        """Check the checkpoint at `path` against the served model without writing anything: config, names,
        every tensor's shape and dtype (shard headers), and the plan cache's own check. Returns its
        fingerprint; raises WeightsRejected (a ValueError) naming the problem. Read-only, so it may run on
        another thread while a generation runs."""
        return self._checked_weights(path).fingerprint

    def _checked_weights(self, path: str | os.PathLike) -> TransformerWeights:
        try:
            checkpoint = H3Checkpoint.open(path, served_partition(self.config))
            weights = TransformerWeights(checkpoint.transformer_dir, checkpoint.layout)
            weights.validate(expect=self.model_config, with_adaln=self.plan_cache is None)
            if self.plan_cache is not None:
                self.plan_cache.validate_weight_update_source(path)
        except (ValueError, OSError) as exc:  # CheckpointError, WeightUpdateError: the checkpoint does not fit
            raise WeightsRejected(str(exc)) from exc
        return weights

    def held_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters installed or being read now (for routing; safe beside a generation)."""
        return self.adapters.held_or_loading

    def prefetch_adapters(self, request: GenerationRequest) -> None:
        """Start reading `request`'s adapters that are not held, on the adapter loader thread (never waits)."""
        self.adapters.prefetch(request.adapter_names)

    def slab_state(self) -> SlabState:
        """The schedules whose AdaLN plans are all in the GPU slab now (for routing; safe beside a generation)."""
        return self.served_schedules.slab_state(self.plan_cache)

    def debug_stats(self) -> dict[str, Any]:
        """Plan bookkeeping for tests and operators: references held in the GPU slab (0 when idle), plans
        resident, and plans keyed by another weights version than the current one (0 after an update)."""
        held = used = stale = 0
        if self.plan_cache is not None:
            index, version = self.plan_cache.slab.index, self.plan_cache.weights_version
            for slot in range(index.capacity):
                held += index.refcount(slot)
                key = index.key(slot)
                if key is not None:
                    used += 1
                    stale += key[0] != version
        return {"busy": self._busy, "held_plan_refs": held, "resident_plans": used, "stale_plans": stale,
                "model": self.model_name, "fingerprint": self.weights.fingerprint}

    def health(self) -> dict[str, Any]:
        """Cheap, never waits for a generation. A rank whose group failed (or whose plan cache diverged from
        the other ranks'), or an engine a weight update failed in the middle of, raises ServerFault: it cannot
        serve again, its replica must be rebuilt."""
        if self.group is not None:
            failure = self.group.failure or self._unusable_because()
            if failure is not None:
                raise ServerFault(f"rank {self.rank} of {self.group.world_size} is unusable: {failure}",
                                  FaultCause.RANK_FAILURE)
        elif self._fault is not None:
            raise ServerFault(f"engine unusable: {self._fault}", FaultCause.ENGINE_UNUSABLE)
        return {"status": "ok", "device": str(self.device), "busy": self._busy,
                "requests": self._num_requests, "failed": self._num_failed}

    def _unusable_because(self) -> str | None:
        """Why this engine must not serve again (None: it may): a weight update failed while writing, or this
        rank's plan cache diverged from the other ranks' (`parallel.agreement`)."""
        divergences = (self.agreement.divergence if self.agreement is not None else None,
                       self.sharded_rebuild.divergence if self.sharded_rebuild is not None else None)
        return self._fault or next((d for d in divergences if d is not None), None)

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "device": str(self.device),
            "checkpoint": str(self.checkpoint.root),
            "layout": self.checkpoint.layout.value,
            "fingerprint": self.weights.fingerprint,
            "limits": self.limits.model_dump(mode="json"),
            # The adapters requests may name (also in limits), which of them are installed now, and the fused one.
            "adapters": {"served": [adapter.name for adapter in self.limits.adapters],
                         "held": list(self.adapters.held), "fused": self.adapters.fused},
            "model_config": self.model_config.model_dump(mode="json"),
            "engine_config": self.config.model_dump(mode="json"),
            "startup": dataclasses.asdict(self.startup),
            "forward": self.forward_kernels.describe(),
            # The prompt stage's weights (its tier and memory); None: the denoiser alone (the TextEncoder has it).
            "text_encoder": (dataclasses.asdict(self.prompt_stage.weights) if self.prompt_stage is not None
                             else None),
        }

    # --- Stages ------------------------------------------------------------------------------------

    def _check_cancelled(self, cancelled: CancelledFn | None, agreed: bool = True) -> None:
        stop = cancelled is not None and cancelled()
        if agreed and self.group is not None:
            stop = self.agreement.rank_0_says(stop)  # every rank stops at the same step boundary
        if stop:
            raise GenerationCancelled("generation cancelled by the caller")

    def _cancelled_at_step(self, cancelled: CancelledFn | None, late: LateFlag | None) -> None:
        """A step boundary's cancel check. With a group: rank 0's answer at the previous boundary (`late`), so
        every rank stops at the same boundary without the host waiting for the GPU queue; a cancel asked for
        at boundary i stops every rank at boundary i + 1 (or at the loop's end)."""
        local = cancelled is not None and cancelled()
        if late is not None:
            local = late.exchange(local)
        if local:
            self._end_loop(late)
            raise GenerationCancelled("generation cancelled by the caller")

    def _end_loop(self, late: LateFlag | None) -> bool:
        """After a loop's last forward (or at its cancel): the host checks of the last forward's output gathers
        (bounded; CollectiveError naming the forward) and the last boundary's cancel flag (True: rank 0 asked
        to cancel during the loop). Every rank calls it at the same point."""
        if self.sequence_parallel is not None:
            self.sequence_parallel.settle()
        return late.finish() if late is not None else False

    def _denoise(
        self, request: GenerationRequest, geometry: VideoGeometry, schedule: H3Schedule,
        cache_dit: CacheDitConfig, seed: int, embedding: PromptEmbedding, progress: ProgressFn | None,
        cancelled: CancelledFn | None, *, warm_up: bool,
    ) -> GenerationResult:
        """AdaLN plans and the denoising loop: latents on the CPU, timings plan_s and denoise_s. A `warm_up` runs
        on stand-in rows: a plan of its schedule would cost a rebuild from the checkpoint (at the released size it
        reads all 24.2 GiB of AdaLN projections), take slab rows and tell the router of a schedule no client sent."""
        self._check_cancelled(cancelled)
        num_forwards = schedule.num_forwards
        t0 = time.perf_counter()
        # plan first: the plan cache rejects requests it can never serve before the loop
        if warm_up:  # every rank alike: nothing to agree on
            prepared = forward.StandInPlans(self.modulation, schedule.plans, self.device) \
                if self.modulation is not None else None
        elif self.group is None:
            prepared = self.plan_cache.prepare(schedule.plans) if self.plan_cache is not None else None
        else:
            prepared = self.agreement.prepare(self.plan_cache, schedule.plans)
        if prepared is not None and not warm_up:  # the plans' own key (what the media made of the request)
            self.served_schedules.served(schedule.key, prepared.keys)
        try:
            self._begin_request(cache_dit, num_forwards)
            # This request's adapters, each at its scale (a cold one's read began on arrival: prefetch_adapters).
            # Ranks of a group wait for the read uncancelled: they must all reach the loop (cancel is agreed there).
            adapter_stats = self.adapters.apply(request.adapters, cancelled if self.group is None else None)
            linears = self._linears(request)
            if self.forward_kernels.precision is not None:  # bf16+fp8: the tier's weights, before the first forward
                self.forward_kernels.precision.use(linears)
            t1 = self._sync_time()
            text = embedding.embeds.to(self.device)  # [L, D]
            denoiser = Denoiser(geometry, schedule, text.shape[0], self.device, _condition_latents(request, embedding))
            latents = denoiser.initial_latents(seed)
            late = LateFlag(self.group) if self.group is not None else None
            if self.sequence_parallel is not None:
                self.sequence_parallel.begin_loop()
            for i in range(num_forwards):
                self._cancelled_at_step(cancelled, late)
                inputs = denoiser.transformer_inputs(i, latents, text)
                if prepared is not None:
                    self.modulation.set(prepared.modulation(i))
                self._begin_model_call()
                velocity_video, velocity_audio = inputs.run(self.transformer)
                latents = denoiser.step(i, latents, velocity_video, velocity_audio)
                if progress is not None:
                    progress(i + 1, num_forwards)
            if self._end_loop(late):  # before the host reads the latents: a dead peer raises, bounded
                raise GenerationCancelled("generation cancelled by the caller")
            video, audio = denoiser.finish(latents)
            video, audio = video.float().cpu(), audio.float().cpu()  # waits for the device
            # NaN latents decode to black frames (uint8 of NaN) and make the AAC encoder fail with EINVAL.
            if not (torch.isfinite(video).all() and torch.isfinite(audio).all()):
                raise ServerFault("the denoised latents hold NaN or inf: the transformer's weights or numerics are "
                                  "broken, no video was made", FaultCause.NON_FINITE_LATENTS)
            t2 = time.perf_counter()
            plan_stats = prepared.stats if prepared is not None else None
        finally:
            if prepared is not None:
                prepared.release()

        stats = GenerationStats(
            steps=request.steps, forwards=num_forwards, frames=geometry.num_frames,
            tokens=geometry.num_tokens(text.shape[0]), text_tokens=text.shape[0], adaln_mode=self.config.adaln.mode,
            linears=linears,
            schedule_key=schedule.key, adaln=plan_stats, prompt_cache=embedding.cache,
            cache_dit=self.cache_dit.stats() if self.cache_dit is not None else None,
            offload=self.offloader.stats.snapshot() if self.offloader is not None else None,
            parallel=RankStats(sp=self.group.world_size, rank=self.rank) if self.group is not None else None,
            adapters=adapter_stats,
            compile=self.forward_kernels.compile_stats(),
        )
        return GenerationResult(
            video=video, audio=audio, seed=seed, model=self.model_name,
            timings=GenerationTimings(plan_s=t1 - t0, denoise_s=t2 - t1, total_s=t2 - t0),
            stats=stats,
        )

    def _begin_request(self, cache_dit: CacheDitConfig, num_forwards: int) -> None:
        """Per-request state of the optional features: a fresh Cache-DiT context, the offloader's edges."""
        if self.cache_dit is None:
            return
        # A request with caching off still runs through cache-dit's wrapper, once per forward.
        self.cache_dit.refresh_resolved(num_forwards, cache_dit)
        if self.offloader is not None:
            if cache_dit.enabled:
                self.offloader.set_cache_blocks(cache_dit.Fn_compute_blocks, cache_dit.Bn_compute_blocks)
            else:
                self.offloader.clear_cache_blocks()

    def _begin_model_call(self) -> None:
        if self.offloader is not None:
            will = self.cache_dit.predict_middle() if self.cache_dit is not None else True
            self.offloader.begin_step(will)

    # --- What the ranks of a multi-device replica agree on -----------------------------------------------

    def _num_local_real_rows(self) -> int:
        assert self.sequence_parallel is not None
        return self.sequence_parallel.num_local_real_rows

    def _sync_time(self) -> float:
        """Now, once the compute stream's queued work is done. Only that stream: the plan cache's side streams
        (host-tier stores, pool publishes) run on past a stage boundary and must not be counted in it."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()


class DenoiserEngine(Engine):
    """The transformer alone, what a `stages: split` Worker holds: its AdaLN plans, adapters and denoising loop,
    neither the text encoder nor the VAEs (the app's TextEncoder and Decoder hold them: `engine.prepare`,
    `engine.stages`). `denoise` takes an embedding encoded elsewhere; `generate` and `encode` are refused. One
    device: under sequence parallel rank 0 decodes, so every rank runs a full `Engine`. A transformer whose latent
    widths are not the VAEs' is refused here too, at open (`model.weights`: CheckpointError), though no VAE is
    loaded to disagree with it."""

    def __init__(self, config: EngineConfig, remote: RemoteTier | None = None):
        super().__init__(config, remote)

    def _load_text_encoder(self) -> float:
        return 0.0

    def _load_vaes(self) -> float:
        return 0.0

    def generate(self, request: GenerationRequest, progress: ProgressFn | None = None,
                 cancelled: CancelledFn | None = None) -> GenerationResult:
        raise _stage_missing()

    def encode(self, request: GenerationRequest, cancelled: CancelledFn | None = None) -> PromptEmbedding:
        raise _stage_missing()


def _stage_missing() -> ServerFault:
    return ServerFault("this engine holds the denoiser only (stages: split): the prompt is encoded by the "
                       "TextEncoder deployment and passed to denoise()", FaultCause.STAGE_MISSING)


def _translated(exc: BaseException) -> BaseException:
    """A lower layer's error raised while generating, as the `engine.errors` type a caller sorts by.

    Messages are kept; anything not listed (GenerationCancelled, bugs) is returned unchanged.
    """
    if isinstance(exc, AdmissionError):  # e.g. more plans than adaln.gpu_plans: the request's size, not a fault
        return AdmissionRejected(str(exc))
    if isinstance(exc, (RebuildError, CheckpointError, AdapterError)):  # a server file broke, not the request
        return ServerFault(str(exc), FaultCause.CHECKPOINT_UNREADABLE)
    if isinstance(exc, RankFailure):  # a rank could not do its part of the request's plans
        return ServerFault(str(exc), FaultCause.RANK_FAILURE)
    if isinstance(exc, RankDivergence):  # the ranks' plan caches differ: the replica is unhealthy
        return ServerFault(str(exc), FaultCause.RANK_DIVERGENCE)
    if isinstance(exc, CollectiveError):  # a peer rank died or stopped answering: the replica is broken
        return ServerFault(str(exc), FaultCause.RANK_FAILURE)
    return exc


def _condition_latents(request: GenerationRequest, embedding: PromptEmbedding) -> ConditionLatents | None:
    """The VAE condition latents of a fl2va / ref2va request, made with its embedding (`engine.conditioning`: in
    this process, or in the prepare stage of a split app); None for t2va."""
    if request.task is Task.T2VA:
        return None
    if embedding.conditions is None:
        raise ServerFault(f"the {request.task.value} request's embedding holds no conditions: its prepare stage "
                          "did not encode the keyframes or references", FaultCause.STAGE_MISSING)
    return embedding.conditions.latents


def served_adapter_files(config: EngineConfig) -> dict[str, AdapterConfig]:
    """The adapters of `config`'s partition with every empty path made a file: the auto-made tiny adapter of that
    name (`model.provisioning.ensure_adapter`; the config allows one only beside an auto-made checkpoint)."""
    return {name: adapter if adapter.path else adapter.model_copy(update={"path": str(ensure_adapter(config, name))})
            for name, adapter in config.served_adapters().items()}


def decode_stage(config: EngineConfig) -> DecodeStage:
    """The decode stage `config` describes, on its own (the app's Decoder deployment): the VAEs' decoder halves
    alone (the app's prepare stage holds the encoder halves)."""
    checkpoint = H3Checkpoint.open(ensure_checkpoint(config), served_partition(config),
                                   require_components=True)
    return DecodeStage(checkpoint, resolve_device(config.decode.device, resolve_device(config.device)),
                       VaeHalves.DECODER)
