"""Engine configuration (pydantic, no I/O, no Ray).

`EngineConfig` is what `serve_config.yaml` passes under `args.engine` (same names, see DESIGN.md).
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cache.cache_dit import CacheDitConfig
from cache.config import AdalnConfig
from engine.limits import ADAPTER_NAME_PATTERN, ServedAdapter
from engine.compiled import CompileBackend, CompileOptions, InductorMode
from engine.limits import Quantization
from model.geometry import H3_LATENTS, snap_num_frames
from model.layout import Partition
from offload.layerwise import OffloadConfig

#: Hard cap on sampling steps: the AdaLN plan slab admits up to 65 plans per request (H3 takes <= 65 steps).
MAX_STEPS = 65

DeviceName = Literal["auto", "cpu", "cuda"]
#: `text_encoder.quantization` (`engine.text_fp8`).
TextEncoderQuantization = Literal["none", "fp8"]

class PoolConfig(BaseModel):
    """The node-shared host-cache pool (`actors.host_cache_pool`): a tier between a worker's own pinned
    host tier and the rebuild, shared by every GPU worker of a node through Ray's object store."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    enabled: bool | None = Field(
        None,
        description="null (auto): on when the engine runs inside Ray (a Serve replica) with adaln.mode=online; "
        "true/false force it (true without Ray is ignored: there is no object store).",
    )
    pools_per_node: int = Field(1, ge=1, description="Pool actors per node; keys are spread over them by hash.")
    capacity_gb: float = Field(
        16.0, ge=0,
        description="Bytes (GB, 10^9) the pools of one node hold in the object store, evicting whole request "
        "groups LRU. Size the Ray object store to fit it.",
    )
    lookup_timeout_s: float = Field(
        2.0, gt=0,
        description="Budget of one pool lookup; a slower, dead or missing pool is a miss (the plan is rebuilt).",
    )
    pin_memory: bool | None = Field(
        None,
        description="Register the zero-copy object-store pages of a hit with CUDA (cudaHostRegister) so the "
        "copy into the slab runs at pinned speed. null: on when the engine runs on CUDA.",
    )


#: `engine.attention: auto` (engine.attention.AUTO). Spelled here so that parsing a config imports no diffusers:
#: the ingress validates configs and requests and runs no model.
ATTENTION_AUTO = "auto"


class TextEncoderConfig(BaseModel):
    """The Qwen3-VL prompt encoder (`model.text_encoder`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    device: DeviceName | Literal["engine"] = Field(
        "engine", description="engine: the engine's device; cpu keeps the ~51.5 GB encoder off a small GPU."
    )
    hidden_state_index: int = Field(
        50, ge=1, description="Conditioning = hidden_states[index] (the output of decoder layer index-1, before "
        "the final norm); only the layers that feed it are loaded. MiniMax-H3: 50."
    )
    max_prompt_tokens: int = Field(2048, ge=1, description="Longest prompt accepted, in tokens (a 422 beyond).")
    prompt_cache_mb: float = Field(
        256.0, ge=0, description="Prompt-embedding cache (LRU by prompt, bounded in MB; 0 turns it off)."
    )
    vision: bool = Field(
        True, description="Load Qwen3-VL's vision tower, so keyframe (fl2va) and image-reference (ref2va) prompts "
        "are served; false: a t2va-only process keeps the text layers' memory and answers those requests with a 422."
    )
    quantization: TextEncoderQuantization = Field(
        "none", description="fp8: the language model's decoder-layer linears in torchao float8 (dynamic activations "
        "x rowwise weights, engine.quantization's recipe), quantized layer by layer at load (never a second copy): "
        "about half the encoder's memory; the embedding, norms and vision tower stay bf16. Needs the encoder on a GPU "
        "of compute capability >= 8.9. Embeddings differ from bf16 by rounding (README: the measured bound).",
    )

    @model_validator(mode="after")
    def _fp8_on_a_gpu(self) -> TextEncoderConfig:
        if self.quantization == "fp8" and self.device == "cpu":
            raise ValueError("text_encoder.quantization: fp8 runs float8 GEMMs on a GPU (compute capability >= 8.9); "
                             "text_encoder.device: cpu cannot: use quantization: none, or device: engine / cuda")
        return self


class DecodeConfig(BaseModel):
    """Video + audio VAE decode and MP4 mux (`model.decode`, `model.mp4`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    device: DeviceName | Literal["engine"] = Field("engine", description="engine: the engine's device.")


class GeometryConfig(BaseModel):
    """Request sizes the server accepts (`model.geometry.GeometryLimits`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    short_edge: int | None = Field(
        768, ge=32, description="Required short edge in pixels (MiniMax-H3 is trained at 768); null: any."
    )
    max_pixels: int = Field(768 * 1344, ge=32 * 32, description="Largest width x height in pixels.")
    min_seconds: float = Field(5.0, gt=0, description="Shortest clip (the diffusers pipeline's bound: 5 s).")
    max_seconds: float = Field(15.0, gt=0, description="Longest clip, checked on the snapped frame count.")

    @model_validator(mode="after")
    def _satisfiable(self) -> GeometryConfig:
        # Otherwise the server starts and refuses every request as the client's fault.
        if self.min_seconds > self.max_seconds:
            raise ValueError(f"min_seconds={self.min_seconds:g} exceeds max_seconds={self.max_seconds:g}")
        if self.short_edge is not None:
            multiple = H3_LATENTS.pixel_multiple
            if self.short_edge % multiple:
                raise ValueError(f"short_edge={self.short_edge} must be a multiple of {multiple} px (pixels per patch): "
                                 "no request size could have it")
            if self.short_edge**2 > self.max_pixels:
                raise ValueError(f"short_edge={self.short_edge} needs max_pixels >= {self.short_edge**2}")
        fps = H3_LATENTS.fps
        shortest = snap_num_frames(max(1, math.ceil(self.min_seconds * fps))) / fps
        if shortest > self.max_seconds:
            raise ValueError(f"no clip fits min_seconds={self.min_seconds:g} and max_seconds={self.max_seconds:g}: "
                             f"the shortest clip of at least min_seconds lasts {shortest:g} s (17n+5 frames at "
                             f"{fps} fps)")
        return self


class ParallelConfig(BaseModel):
    """One replica over several devices: `sp` GPU worker actors (`actors.gpu_worker`), one per device, in one
    torch.distributed group, denoising each request together with Ulysses sequence parallelism
    (`parallel.sequence`). GPUs per replica = `sp`; the replica's ranks share a node."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    sp: int = Field(
        1, ge=1,
        description="Sequence-parallel degree: rank actors (one device each) per replica. 1: the engine runs "
        "inside the Serve replica on one device, no actors, no process group. Must divide the model's attention "
        "heads (MiniMax-H3's 56: 1, 2, 4, 7, 8, 14, 28, 56) and fit on one node.",
    )
    text_encoder_tp: bool = Field(
        True,
        description="With sp > 1: split the Qwen3-VL prompt encoder tensor parallel over the replica's ranks "
        "(`parallel.text_encoder`: each rank holds and runs 1/sp of every decoder layer, two all-reduces per "
        "layer), so encode memory and time divide by sp. sp must then divide the encoder's attention heads, kv "
        "heads and MLP width (MiniMax-H3's 64 / 8 / 25600: 1, 2, 4, 8), and the encoder runs on the rank's "
        "device (text_encoder.device: engine). Serves t2va only (the split encoder holds no vision tower: "
        "`EngineConfig.conditioning_refused`). false: every rank loads and runs the whole encoder (rank 0 alone its "
        "vision tower: it prepares keyframes and references for every rank). Ignored at "
        "sp: 1.",
    )
    a2a_overlap: bool = Field(
        True,
        description="With sp > 1: run the attention's all-to-alls beside compute (q's exchange while k is "
        "projected, one head chunk's exchanges while another is attended: `parallel.sequence.Exchange`); false: "
        "wait for each exchange at once. The outputs are the same bits either way.",
    )
    a2a_head_chunks: int = Field(
        2, ge=1,
        description="With sp > 1: each rank's attention heads (heads / sp) are exchanged and attended in this "
        "many chunks (the largest divisor of heads / sp not above it), so that the exchange of one chunk "
        "overlaps the attention of another; more chunks hide more of the exchange but make smaller attention "
        "calls. 1: one exchange per tensor.",
    )
    timeout_s: float = Field(
        120.0, gt=0, allow_inf_nan=False,
        description="Bound on the ranks' rendezvous, on every collective between them, and on every coordinator "
        "call to a rank that is not a load or a generation: a dead or stuck rank fails the request within it "
        "(and the replica reports unhealthy).",
    )
    load_timeout_s: float = Field(
        1800.0, gt=0, allow_inf_nan=False,
        description="Bound on starting the rank actors (placement, checkpoint load) and on a weight update.",
    )
    request_timeout_s: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="Longest one generation may run before it fails as a server fault and the replica reports "
        "unhealthy; null: no limit (a dead or stuck rank is still caught within timeout_s by the collectives).",
    )


class AdapterConfig(BaseModel):
    """One LoRA adapter the engine serves (`engine.adapters.<name>`): its file and what a request naming it gets
    by default. The file is opened and checked at engine start (`model.adapters.read_lora_file`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    path: str = Field("", description="A .safetensors LoRA file (diffusers/peft layout, or the native layout "
                      "without fused QKV) for the served transformer. Empty: a seeded tiny random adapter made "
                      "under checkpoint_root on first start (`model.provisioning.ensure_adapter`), only with an "
                      "auto-made checkpoint (engine.checkpoint empty): the quick start's.")
    steps: int | None = Field(None, ge=2, le=MAX_STEPS, description="Grid points a request naming it gets when it "
                              "sets none (H3 Turbo 4-step files: 5; 8-step: 9). null: the model's default.")
    flow_shift: float | None = Field(None, gt=0, le=1e4, description="Video shift by default (Turbo 768p: 6).")
    audio_flow_shift: float | None = Field(None, gt=0, le=1e4, description="Audio shift by default (Turbo: 3).")
    scale: float = Field(1.0, ge=-8, le=8, description="Strength when a request gives none: a multiplier of the "
                         "file's alpha / rank (alpha from its metadata, else 8).")
    fuse: bool = Field(False, description="Add it into the base weights while consecutive requests use it at one "
                       "scale (no per-forward cost); a request without it first gets the checkpoint's own weights "
                       "back (read again from the checkpoint). Not with offload.")
    partition: Literal["fl2va", "ref2va"] = Field(
        "fl2va", description="The partition whose transformer the file adapts (the H3 Turbo files: FL2VA, which "
        "serves t2va and fl2va). An app serving both partitions installs it on that partition's Worker alone; the "
        "two transformers have the same shapes, so a file of one would load into the other silently.")

    def served(self, name: str) -> ServedAdapter:
        return ServedAdapter(name=name, steps=self.steps, flow_shift=self.flow_shift,
                             audio_flow_shift=self.audio_flow_shift, scale=self.scale, fuse=self.fuse)


class WarmupCanvas(BaseModel):
    """One request shape whose compiled graphs the engine makes at start so no request pays the compile (what runs
    for it: `engine.forward.warm_up`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    width: int = Field(..., ge=32, description="Pixels.")
    height: int = Field(..., ge=32, description="Pixels.")
    seconds: float = Field(..., gt=0, description="Clip length (snapped as a request's is).")
    steps: int | None = Field(
        None, ge=2, description="Not read: accepted for configs written when the warm-up ran whole schedules. The "
        "warm-up runs a schedule's first forward (with dynamic: true one graph serves every forward of a schedule; "
        "static, its first two: a forward of one timestep, then of several), so one canvas serves every step "
        "count.")
    adapters: tuple[str, ...] = Field(
        (), max_length=2, description="Configured adapters (engine.adapters names) active in this warm-up request: "
        "a compiled block with LoRA layers on is another graph, so warm the adapters requests will name (a Turbo "
        "adapter at its own steps); loaded at start as a side effect.")


class CompileConfig(BaseModel):
    """`engine.compile`: regional `torch.compile` of the transformer blocks."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    mode: Literal["off", "blocks"] = Field(
        "off", description="blocks: compile each repeated transformer block (one shared graph); off: eager.")
    backend: CompileBackend = Field(
        "inductor", description="torch.compile backend: inductor (fused kernels, what serves); aot_eager / "
        "eager trace without generating kernels (CPU tests of the capture, guards and recompiles).")
    dynamic: bool = Field(
        True, description="A symbolic sequence length and timestep count (every other size the model's own): one "
        "graph for every canvas, prompt length and timestep count (a schedule's first forward and the later ones), "
        "warmed by one forward. false: a graph per token count (each new prompt length recompiles) and the first "
        "forward's apart, warmed by two.")
    inductor_mode: InductorMode = Field(
        "default", description="Inductor's mode (max-autotune-no-cudagraphs: longer compile, tuned GEMMs; "
        "CUDA graphs stay off: the offloader and the SP exchange run between blocks).")
    cache_dir: str | None = Field(
        None, description="Inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR) on local disk, so a restarted or "
        "scaled-out replica loads its kernels instead of compiling them, and `attention: auto`'s choice, which "
        "decides the graphs (engine.attention.ChoiceMemo); null: inductor's default (/tmp/...), no choice kept. Made if "
        "missing; one this process cannot write fails the start before the checkpoint loads.")
    warmup: tuple[WarmupCanvas, ...] = Field(
        (), description="Canvases whose graphs the engine compiles at start (a stand-in prompt embedding, seed 0), "
        "so the first request of these shapes pays no compile. Each graph is made once: with dynamic: true the "
        "canvases of one adapter set share a graph and only the one of fewest tokens runs, with dynamic: false each "
        "distinct token count does; each run is one forward (dynamic: false: two) per served weight tier. Checked "
        "but not run with mode: off.")
    precompiled: bool = Field(
        True, description="With inductor and a cache_dir: keep each compiled block graph whole in "
        "cache_dir/precompiled (torch's aot_compile: the graph, its kernels and its guards), so a restarted or "
        "scaled-out replica loads it instead of tracing the block again (engine.precompiled). Off on sequence-"
        "parallel ranks (the exchange breaks the graph); any other forward that cannot be kept whole compiles the "
        "regular way.")
    overlap_loads: bool = Field(
        False, description="Compile beside the loads: import the compiler on a thread while the checkpoint reads, "
        "and run the warm-up on one beside the plan cache's build and the text encoder's load (one device). Off: on "
        "an H100 both slowed what they ran beside more than they hid (the threads share Python's lock: the "
        "transformer's load 0.6-0.7 s -> 1.0-2.2 s beside the import; a cold warm-up 17.2 s beside a 3.9 s plan "
        "cache build vs 11.4 s after it at the commit before, which paid a trace restart more); `bench.compile` "
        "times both.")


    @property
    def options(self) -> CompileOptions:
        return CompileOptions(self.backend, self.dynamic, self.inductor_mode, self.cache_dir, self.precompiled)


class EngineConfig(BaseModel):
    """One GPU worker's engine: which checkpoint, which device, which memory/caching features."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    checkpoint: str = Field(
        "",
        description="A MiniMax-H3 checkpoint: a diffusers-layout root (model_index.json), a native root holding "
        "FL2VA/ (or the FL2VA/ directory itself). Empty: make a seeded tiny random one (both layouts are "
        "supported: `checkpoint_layout`) under `checkpoint_root` on first start and reuse it afterwards.",
    )
    checkpoint_root: str = Field(
        "checkpoints",
        description="Where auto-made checkpoints go; relative paths are resolved against the working directory "
        "of the process that builds the app.",
    )
    preset: Literal["tiny"] = Field(
        "tiny", description="The auto-made checkpoint: `tiny` (a random H3 of the real architecture, 4 blocks, "
        "hidden 64, with a tiny Qwen3-VL and VAEs). The real model is a downloaded `checkpoint`."
    )
    checkpoint_layout: Literal["diffusers", "native"] = Field(
        "diffusers", description="Layout of the auto-made checkpoint."
    )
    checkpoint_seed: int = Field(0, ge=0, description="Seed of the auto-made checkpoint's random weights.")
    partition: Literal["fl2va", "ref2va"] = Field(
        "fl2va", description="The checkpoint partition this engine serves: fl2va (the FL2VA transformer: t2va and "
        "keyframes) or ref2va (the Ref2VA transformer, `transformer_ref/` in the diffusers layout: references). "
        "Both share the text encoder and VAEs; an app serving both lists them in `partitions` (README).")
    device: DeviceName = Field("auto", description="auto: cuda when this process sees a GPU, else cpu.")
    max_steps: int = Field(MAX_STEPS, ge=2, le=MAX_STEPS, description="Most sampling steps one request may ask for.")
    geometry: GeometryConfig | None = Field(
        None, description="Accepted sizes. null: the model's (short edge 768, <= 768x1344, 5-15 s) for a "
        "full-width checkpoint; any multiple of 32 px for a smaller (test) one."
    )
    text_encoder: TextEncoderConfig = Field(default_factory=TextEncoderConfig, description="Prompt encoder.")
    decode: DecodeConfig = Field(default_factory=DecodeConfig, description="VAE decode and MP4 mux.")
    adaln: AdalnConfig = Field(default_factory=AdalnConfig, description="AdaLN modulation source and plan cache.")
    offload: OffloadConfig = Field(default_factory=OffloadConfig, description="Layerwise block offload.")
    cache_dit: CacheDitConfig = Field(
        default_factory=CacheDitConfig, description="Cache-DiT (DBCache) block skipping; requests may override it."
    )
    pool: PoolConfig = Field(
        default_factory=PoolConfig,
        description="Node-shared AdaLN plan pool (Ray object store) between the host tier and the rebuild.",
    )
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig,
        description="Devices per replica (sequence parallel); sp: 1 is one device inside the Serve replica.",
    )
    adapters: dict[str, AdapterConfig] = Field(
        default_factory=dict, description="LoRA adapters requests may name (name -> file and defaults); every file "
        "is checked at start. Empty: none.")
    adapters_cache_mb: float = Field(
        4096.0, ge=0, description="Adapter factors held installed in the transformer (MB, LRU by bytes); an adapter "
        "outside it is read from its file again when a request names it. Each file must fit on its own.")

    @model_validator(mode="after")
    def _adapters_servable(self) -> EngineConfig:
        bad = [name for name in self.adapters if not re.match(ADAPTER_NAME_PATTERN, name)]
        if bad:
            raise ValueError(f"adapters: names {bad} must match {ADAPTER_NAME_PATTERN} (what requests send)")
        fused = [name for name, adapter in self.adapters.items() if adapter.fuse]
        # A fused delta would have to be written into the offloader's host buffers and read back from the checkpoint
        # on every switch. (Under sp > 1 every rank holds whole weights and fuses alike: test_parallel_adapters.py.)
        if fused and self.offload.enabled:
            raise ValueError(f"adapters {fused}: fuse: true is not served with offload.enabled (the streamed blocks' "
                             "weights live in the offloader's host buffers); set fuse: false")
        for name, adapter in self.adapters.items():
            if not adapter.path and self.checkpoint:  # a random tiny adapter fits no real transformer
                raise ValueError(f"engine.adapters.{name}.path is empty, which means an auto-made tiny adapter and "
                                 "needs an auto-made checkpoint (engine.checkpoint empty); with engine.checkpoint "
                                 f"{self.checkpoint!r} name the adapter's .safetensors file")
            if adapter.steps is not None and adapter.steps > self.max_steps:
                raise ValueError(f"adapters.{name}.steps={adapter.steps} exceeds max_steps={self.max_steps}")
        return self

    attention: str = Field(
        ATTENTION_AUTO, description="Attention kernel: a diffusers backend name (`diffusers.models.attention_dispatch."
        "AttentionBackendName`: native, _native_cudnn, _native_flash, _native_efficient, flash, _flash_3, ...) or "
        "auto: the fastest exact backend measured once at start on the engine's device (on a CPU: native, "
        "unmeasured). FlashAttention-3 is a candidate where its package is installed.",
    )
    compile: CompileConfig = Field(
        default_factory=CompileConfig, description="Regional torch.compile of the transformer blocks and the "
        "start-up warm-up of configured canvases.",
    )
    quantization: Quantization = Field(
        "none", description="fp8: torchao float8 dynamic activations x rowwise float8 weights on the blocks' "
        "attention and feed-forward linears (AdaLN, heads and refiner stay bf16/fp32); needs a GPU of compute "
        "capability >= 8.9. With offload the FP8 weights are what streams (about half the bytes). bf16+fp8: both "
        "(the bf16 linears and a float8 copy of each), chosen per request by its quality (lossless/high: bf16, fp8); "
        "not with offload.",
    )

    @field_validator("attention")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        if value == ATTENTION_AUTO:
            return value
        from engine.attention import backend_names  # diffusers' names: imported only for a name to check

        if value not in backend_names():
            raise ValueError(f"unknown attention backend {value!r}; one of: {', '.join(backend_names())}")
        return value

    @model_validator(mode="after")
    def _warmup_adapters_configured(self) -> EngineConfig:
        for index, canvas in enumerate(self.compile.warmup):
            unknown = sorted(set(canvas.adapters) - set(self.adapters))
            if unknown:
                raise ValueError(f"compile.warmup[{index}].adapters: {unknown} are not configured "
                                 f"(engine.adapters: {sorted(self.adapters)})")
        return self

    @model_validator(mode="after")
    def _fp8_adapters_unfused(self) -> EngineConfig:
        # peft wraps torchao's float8 linears and adds the low-rank product outside the quantized GEMM
        # (tests/test_fp8_adapters.py); a fused delta would have to be re-quantized into the float8 weights.
        fused = [name for name, adapter in self.adapters.items() if adapter.fuse]
        if self.quantization != "none" and fused:
            raise ValueError(f"adapters {fused}: fuse: true is not served with quantization: {self.quantization} (the "
                             "delta would be re-quantized into the float8 weights); set fuse: false")
        # bf16+fp8 holds both weights of every block linear resident: the offloader streams one set of bytes.
        if self.quantization == "bf16+fp8" and self.offload.enabled:
            raise ValueError("quantization: bf16+fp8 is not served with offload.enabled (the blocks hold bf16 and "
                             "float8 weights resident); use quantization: fp8 with offload")
        return self

    def served_tasks(self, partition: str | None = None) -> tuple[str, ...]:
        """The tasks of `partition` (default: engine.partition) this config serves. fl2va and ref2va need
        Qwen3-VL's vision tower (text_encoder.vision) beside the VAE encoders: a sequence-parallel replica prepares
        them on rank 0 and hands the embedding to its other ranks (`engine.conditioning.prepared_on_rank_0`), which
        a tensor-parallel text encoder (parallel.text_encoder_tp) cannot: its split Qwen3-VL holds no vision tower,
        so such a replica serves t2va alone (`conditioning_refused` says why to a request)."""
        tasks = Partition(partition or self.partition).tasks
        return tuple(task for task in tasks if task == "t2va" or self.conditioning_refused is None)

    @property
    def conditioning_refused(self) -> str | None:
        """Why this config serves no keyframe or reference task (None: it serves its partition's)."""
        if not self.text_encoder.vision:
            return "they need Qwen3-VL's vision tower (engine.text_encoder.vision: false here)"
        if self.parallel.sp > 1 and self.parallel.text_encoder_tp:
            return (f"a sequence-parallel replica with a tensor-parallel text encoder (engine.parallel.sp="
                    f"{self.parallel.sp}, engine.parallel.text_encoder_tp: true) serves t2va only: the split "
                    "Qwen3-VL holds no vision tower; set engine.parallel.text_encoder_tp: false for keyframes and "
                    "references")
        return None

    def served_adapters(self) -> dict[str, AdapterConfig]:
        """The configured adapters of the partition this engine serves (`AdapterConfig.partition`)."""
        return {name: adapter for name, adapter in self.adapters.items() if adapter.partition == self.partition}

    def served_warmup(self) -> tuple[WarmupCanvas, ...]:
        """The warm-up canvases this engine runs: those whose adapters it serves (a canvas naming another
        partition's adapter warms that partition's Worker)."""
        served = self.served_adapters()
        return tuple(canvas for canvas in self.compile.warmup if set(canvas.adapters) <= set(served))

    def check_serves_a_task(self, field: str = "partition") -> None:
        """ValueError naming `field` when this config serves none of its partition's tasks (the Ref2VA partition
        serves ref2va alone: without it the replica would start and refuse every request)."""
        if not self.served_tasks():
            raise ValueError(f"{field}: {self.partition} serves {', '.join(Partition(self.partition).tasks)} "
                             f"only, which this config cannot: {self.conditioning_refused}")

    @model_validator(mode="after")
    def _serves_a_task(self) -> EngineConfig:
        self.check_serves_a_task()
        return self

    @model_validator(mode="after")
    def _resident_projects_as_diffusers(self) -> EngineConfig:
        # The engine's resident mode is diffusers' forward as is (the reference every feature is compared to),
        # whose AdaLN projection is the model dtype's nn.Linear; the fp32 projection is the plan cache's.
        if self.adaln.mode == "resident" and self.adaln.projection == "fp32":
            raise ValueError("adaln.projection: fp32 is served by the plan cache (adaln.mode: online); "
                             "adaln.mode: resident runs diffusers' own forward, whose projection is the model "
                             "dtype's (projection: match). Use mode: online for the fp32 projection")
        return self
