"""The engine: one device, one model, one generation at a time (plain torch, no Ray).

A request goes through named stages:
    validate -> plan (schedule + AdaLN plans) -> encode (prompt, "" for CFG, seeded noise) -> denoise (Euler)

AdaLN modulation comes from one provider object (`cache.plan_cache.make_adaln_provider`): `prepare(plans)`
before the loop, `prepared.modulation(i)` per step, `prepared.release()` after. Resident and online
(plan cache) modes differ only in which provider that one call builds.

Optional per-request features hook in around the same loop: Cache-DiT (`cache.cache_dit.CacheDit`: refresh
per request, `predict_middle()` per step) and layerwise offload (`offload.layerwise.LayerwiseOffloader`:
`set_cache_blocks` per request, `begin_step(will_compute_middle)` per step).

Errors: the public methods raise `engine.errors` types (the lower layers' errors are translated here, with
their messages, chained as `__cause__`), so the Serve layer sorts them without importing `cache/` or
`model/`. The constructor is the exception: a checkpoint that cannot be loaded at start raises the
loader's own error (`model.checkpoint.CheckpointError`, a ValueError naming the file); no request is
involved and the replica does not start.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from cache.cache_dit import CacheDit, CacheDitConfig
from cache.plan_cache import AdmissionError, make_adaln_provider
from cache.rebuild import RebuildError
from engine.api import CancelledFn, GenerationRequest, GenerationResult, ProgressFn, check_limits, schedule_for
from engine.config import EngineConfig
from engine.errors import (
    AdmissionRejected,
    ClientError,
    GenerationCancelled,
    ServerFault,
    WeightsRejected,
)
from model.checkpoint import CheckpointError, CheckpointReader, load_model, make_checkpoint
from model.config import preset
from model.sampler import euler_step, guided
from model.text import TextEncoder
from offload.layerwise import LayerwiseOffloader

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("engine.device=cuda but this process sees no CUDA device; use device: auto or cpu")
    return torch.device(name)


def auto_checkpoint_dir(config: EngineConfig) -> Path:
    name = config.preset if config.checkpoint_seed == 0 else f"{config.preset}-seed{config.checkpoint_seed}"
    return Path(config.checkpoint_root) / name


def ensure_checkpoint(config: EngineConfig) -> Path:
    """The checkpoint to load: `config.checkpoint`, or an auto-made seeded preset checkpoint.

    Auto-made ones are written to a temporary directory next to the target and renamed into place, so a
    reader never sees a half-written checkpoint and two replicas starting together both end up with the
    one that won the rename (same seed and preset -> identical bytes anyway).
    """
    if config.checkpoint:
        return Path(config.checkpoint)
    target = auto_checkpoint_dir(config)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        logger.info("making a %s checkpoint (seed %d) at %s", config.preset, config.checkpoint_seed, target)
        make_checkpoint(tmp, preset(config.preset), seed=config.checkpoint_seed)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # not a lost race: a real error
                raise
            logger.info("another process made %s first; using it", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class Engine:
    """Plain torch engine on one device. Thread-safe: generations are serialized by a lock."""

    def __init__(self, config: EngineConfig, remote: Any = None):
        """`remote`: optional node-shared plan pool (`cache.plan_cache.RemoteTier`, e.g. the pool client in
        `actors/`, built by the Serve worker); used in adaln.mode=online only."""
        self.config = config
        self.device = resolve_device(config.device)
        self.checkpoint_dir = ensure_checkpoint(config)
        self.reader = CheckpointReader(self.checkpoint_dir)
        self.dit_config = self.reader.config
        resident = config.adaln.mode == "resident"
        offload = config.offload.enabled
        # With offload the blocks are loaded on the host and streamed; the offloader moves the rest.
        self.model = load_model(self.checkpoint_dir, "cpu" if offload else self.device, with_adaln=resident)
        self.offloader: LayerwiseOffloader | None = None
        if offload:
            offload_config = config.offload
            if resident and "adaln_proj" not in offload_config.resident_tensors:
                # resident modulation reads every block's adaln_proj outside the blocks' forward: keep it on the device
                offload_config = offload_config.model_copy(
                    update={"resident_tensors": (*offload_config.resident_tensors, "adaln_proj")}
                )
            self.offloader = LayerwiseOffloader(self.model.blocks, offload_config, self.device, root=self.model).apply()
        self.cache_dit: CacheDit | None = None
        if config.cache_dit.enabled:
            self.cache_dit = CacheDit(self.model, config.cache_dit)
        self.text_encoder: TextEncoder = self.model.text_embedder
        online_remote = remote if config.adaln.mode == "online" else None
        self.adaln = make_adaln_provider(config.adaln, self.model, self.reader, self.device,
                                         **({"remote": online_remote} if online_remote is not None else {}))
        self.model_name = f"{self.dit_config.name}@{self.reader.fingerprint}"
        #: The node-shared plan pool (`remote`; None without one):
        #: `update_weights` calls its `invalidate(old_weights_version)` so no tier keeps plans of the old weights.
        self.pool_tier: Any = online_remote
        self._lock = threading.Lock()
        self._busy = False
        self._num_requests = 0
        self._num_failed = 0
        logger.info("engine ready: %s on %s (adaln %s, offload %s)", self.model_name, self.device,
                    config.adaln.mode, offload)

    # --- API ---------------------------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """ClientError (a ValueError) naming the field and the limit if the loaded model cannot take
        `request`."""
        check_limits(request, self.dit_config, self.config.max_steps)
        self._cache_dit_config(request)

    def _cache_dit_config(self, request: GenerationRequest) -> CacheDitConfig:
        """The request's effective Cache-DiT config (server config + overrides), checked."""
        if request.cache_dit is None:
            effective = self.config.cache_dit
        else:
            try:
                effective = self.config.cache_dit.merged(request.cache_dit)
            except ValueError as exc:
                raise ClientError(f"cache_dit: {exc}") from None
        if not effective.enabled:
            return effective
        if self.cache_dit is None:
            raise ClientError("cache_dit.enabled: Cache-DiT is off on this server (engine.cache_dit.enabled: false)")
        if request.guidance_scale > 1.0:
            raise ClientError(
                "guidance_scale: classifier-free guidance (> 1) cannot be combined with Cache-DiT; "
                "send guidance_scale 1 or cache_dit: {enabled: false}"
            )
        try:
            effective.check_num_blocks(self.dit_config.num_blocks)
            effective.resolve_mask(request.steps)
        except ValueError as exc:
            raise ClientError(f"cache_dit: {exc}") from None
        return effective

    @torch.no_grad()
    def generate(
        self, request: GenerationRequest, progress: ProgressFn | None = None, cancelled: CancelledFn | None = None
    ) -> GenerationResult:
        """Run one generation. Raises ClientError (the request, before any work), AdmissionRejected (the plan
        cache can never serve it), ServerFault (e.g. a checkpoint shard unreadable while rebuilding plans)
        or GenerationCancelled (`cancelled()` turned true between two steps)."""
        self.validate(request)
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        with self._lock:
            self._busy = True
            try:
                result = self._generate(request, seed, progress, cancelled)
            except BaseException as exc:
                self._num_failed += 1
                translated = _translated(exc)
                if translated is exc:
                    raise
                raise translated from exc
            finally:
                self._busy = False
            self._num_requests += 1
            return result

    @torch.no_grad()
    def update_weights(self, path: str | os.PathLike) -> dict[str, Any]:
        """Load every weight from the checkpoint at `path` (same DiTConfig) in place, between requests.

        Everything is checked before anything is written (config, keys, shapes, dtypes, and the AdaLN
        provider's own check), so a rejected update (WeightsRejected, a ValueError) leaves the served model
        untouched. A read that fails after writing started (the disk changed since the check) is a
        ServerFault. Afterwards AdaLN plans derived from the old weights are dropped. Returns `describe()`.
        """
        path = Path(path)
        with self._lock:
            reader = self._checked_weights(path)
            try:
                self._load_weights_(reader, path)
            except ValueError as exc:  # e.g. CheckpointError: checked above, so the disk changed meanwhile
                raise ServerFault(f"weight update from {path} failed while writing: {exc}",
                                  type(exc).__name__) from exc
            logger.info("weights updated from %s: now %s", path, self.model_name)
        return self.describe()

    def _load_weights_(self, reader: CheckpointReader, path: Path) -> None:
        """Write every weight from `reader` (already checked), then drop plans derived from the old ones."""
        # Streamed block tensors go through the offloader (its host buffers are their source of truth);
        # every other parameter (device-resident ones included) is overwritten in place.
        params = dict(self.model.named_parameters())
        for index in range(self.dit_config.num_blocks if self.offloader is not None else 0):
            prefix = f"blocks.{index}."
            streamed = list(self.offloader.block_state(index))
            self.offloader.load_block_state_(index, {n: reader.tensor(prefix + n) for n in streamed})
            for n in streamed:
                del params[prefix + n]
        for name, param in params.items():
            param.copy_(reader.tensor(name, param.device))
        old_version = self.adaln.weights_version
        self.adaln.refresh_weight_derived_caches(path)
        if self.pool_tier is not None:  # the node-shared plan pool: drop plans of the old weights there too
            self.pool_tier.invalidate(old_version)
        self.reader, self.checkpoint_dir = reader, path
        self.model_name = f"{self.dit_config.name}@{reader.fingerprint}"

    def validate_weight_update(self, path: str | os.PathLike) -> str:
        """Check the checkpoint at `path` against the served model without writing anything: config, keys,
        every tensor's shape and dtype (shard headers), and the AdaLN provider's own check. Returns its
        fingerprint; raises WeightsRejected (a ValueError) naming the problem. Read-only, so it may run on
        another thread while a generation runs."""
        return self._checked_weights(path).fingerprint

    def _checked_weights(self, path: str | os.PathLike) -> CheckpointReader:
        try:
            reader = CheckpointReader(path)
            reader.validate(expect=self.dit_config, with_adaln=self.config.adaln.mode == "resident")
            self.adaln.validate_weight_update_source(path)
        except ValueError as exc:  # CheckpointError, WeightUpdateError: the named checkpoint does not fit
            raise WeightsRejected(str(exc)) from exc
        return reader

    def debug_stats(self) -> dict[str, Any]:
        """Plan bookkeeping for tests and operators: references held in the GPU slab (0 when idle), plans
        resident, and plans keyed by another weights version than the current one (0 after an update)."""
        slab = getattr(self.adaln, "slab", None)
        held = used = stale = 0
        if slab is not None:
            index, version = slab.index, self.adaln.weights_version
            for slot in range(index.capacity):
                held += index.refcount(slot)
                key = index.key(slot)
                if key is not None:
                    used += 1
                    stale += key[0] != version
        return {"busy": self._busy, "held_plan_refs": held, "resident_plans": used, "stale_plans": stale,
                "model": self.model_name, "fingerprint": self.reader.fingerprint}

    def health(self) -> dict[str, Any]:
        """Cheap, never waits for a generation."""
        return {"status": "ok", "device": str(self.device), "busy": self._busy,
                "requests": self._num_requests, "failed": self._num_failed}

    def describe(self) -> dict[str, Any]:
        cfg = self.dit_config
        return {
            "id": self.model_name,
            "object": "model",
            "preset": cfg.name,
            "device": str(self.device),
            "checkpoint": str(self.checkpoint_dir),
            "fingerprint": self.reader.fingerprint,
            "limits": {
                "max_steps": self.config.max_steps, "max_frames": cfg.max_frames, "max_height": cfg.max_height,
                "max_width": cfg.max_width, "max_audio_len": cfg.max_audio_len,
                "max_text_tokens": cfg.max_text_tokens, "patch": list(cfg.patch),
            },
            "model_config": cfg.model_dump(mode="json"),
            "engine_config": self.config.model_dump(mode="json"),
        }

    # --- Stages ------------------------------------------------------------------------------------

    def _generate(
        self, request: GenerationRequest, seed: int, progress: ProgressFn | None, cancelled: CancelledFn | None
    ) -> GenerationResult:
        def check_cancelled() -> None:
            if cancelled is not None and cancelled():
                raise GenerationCancelled("generation cancelled by the caller")

        check_cancelled()
        t0 = time.perf_counter()
        # plan first: the plan cache rejects requests it can never serve before any other work
        schedule = schedule_for(request)
        guided_steps = request.guidance_scale > 1.0
        model_calls = request.steps * (2 if guided_steps else 1)
        self._begin_request(request, model_calls)
        prepared = self.adaln.prepare(schedule.plans)
        try:
            t1 = self._sync_time()
            text = self.text_encoder.encode(request.prompt).to(self.device)  # [Lt, text_dim]
            uncond = self.text_encoder.encode("").to(self.device) if guided_steps else None
            video, audio = self._initial_noise(request, seed)
            t2 = self._sync_time()
            for i in range(request.steps):
                check_cancelled()
                video, audio = self._step(schedule, i, prepared.modulation(i), video, audio, text, uncond,
                                          request.guidance_scale)
                if progress is not None:
                    progress(i + 1, request.steps)
            video, audio = video.float().cpu(), audio.float().cpu()  # waits for the device
            t3 = time.perf_counter()
            plan_stats = prepared.stats.model_dump()
        finally:
            prepared.release()

        stats: dict[str, Any] = {
            "steps": request.steps,
            "tokens": text.shape[0] + request.audio_len + video.numel() // self.dit_config.patch_dim,
            "text_tokens": text.shape[0],
            "model_calls": model_calls,
            "adaln_mode": self.config.adaln.mode,
            "schedule_key": schedule.schedule_key,
            "adaln": plan_stats,
        }
        if self.cache_dit is not None:
            cache_stats = self.cache_dit.stats()
            stats["cache_dit"] = {"config": cache_stats.config, "cached_steps": cache_stats.cached_steps}
        if self.offloader is not None:
            stats["offload"] = {k: v for k, v in self.offloader.stats.as_dict().items() if k != "h2d_bytes_per_step"}
        return GenerationResult(
            video=video, audio=audio, seed=seed, model=self.model_name,
            timings={"plan_s": t1 - t0, "encode_s": t2 - t1, "denoise_s": t3 - t2, "total_s": t3 - t0},
            stats=stats,
        )

    def _begin_request(self, request: GenerationRequest, model_calls: int) -> None:
        """Per-request state of the optional features: a fresh Cache-DiT context, the offloader's edges."""
        if self.cache_dit is None:
            return
        # A request with caching off still runs through cache-dit's wrapper, once per model call.
        effective = self.cache_dit.refresh(model_calls, request.cache_dit)
        if self.offloader is not None:
            if effective.enabled:
                self.offloader.set_cache_blocks(effective.Fn_compute_blocks, effective.Bn_compute_blocks)
            else:
                self.offloader.clear_cache_blocks()

    def _begin_model_call(self) -> None:
        if self.offloader is not None:
            will = self.cache_dit.predict_middle() if self.cache_dit is not None else True
            self.offloader.begin_step(will)

    def _initial_noise(self, request: GenerationRequest, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 noise drawn on the CPU from `seed` (same bits on any device), then moved."""
        cfg = self.dit_config
        generator = torch.Generator(device="cpu").manual_seed(seed)
        video = torch.randn(cfg.video_channels, request.frames, request.height, request.width,
                            generator=generator, dtype=torch.float32)  # [C, F, H, W]
        audio = torch.randn(request.audio_len, cfg.audio_channels, generator=generator, dtype=torch.float32)  # [T, Ca]
        return video.to(self.device), audio.to(self.device)

    def _step(self, schedule, i, modulation, video, audio, text, uncond, guidance_scale):
        step = schedule.step(i)
        self._begin_model_call()
        v_video, v_audio = self.model(video, audio, text, step, modulation)
        if uncond is not None:
            self._begin_model_call()
            u_video, u_audio = self.model(video, audio, uncond, step, modulation)
            v_video, v_audio = guided(v_video, u_video, guidance_scale), guided(v_audio, u_audio, guidance_scale)
        sv, sa = schedule.sigmas_video, schedule.sigmas_audio
        video = euler_step(video, v_video, sv[i], sv[i + 1])
        audio = euler_step(audio, v_audio, sa[i], sa[i + 1])
        return video, audio

    def _sync_time(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def _translated(exc: BaseException) -> BaseException:
    """A lower layer's error raised while generating, as the `engine.errors` type a caller sorts by.

    Messages are kept; anything not listed (GenerationCancelled, bugs) is returned unchanged.
    """
    if isinstance(exc, AdmissionError):  # e.g. more plans than adaln.gpu_plans: the request's size, not a fault
        return AdmissionRejected(str(exc))
    if isinstance(exc, (RebuildError, CheckpointError)):  # the server's checkpoint broke, not the request
        return ServerFault(str(exc), type(exc).__name__)
    return exc
