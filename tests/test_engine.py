"""The engine (engine.engine.Engine) serving the real MiniMax-H3 classes on the tiny random checkpoint, on CPU.

One module-scoped engine per configuration; every engine reads the same auto-made seed-0 checkpoint (both
layouts), so features can be compared bit for bit: online AdaLN, offload, both layouts and Cache-DiT turned
off per request must all give the resident engine's bits.

The request is the smallest the tiny model serves: 64x64 px for 5 s, i.e. 124 frames -> 37 latent frames of
4x4 (148 video tokens) and 2 x 207 audio rows. `return_video` is off unless a test reads the MP4.
"""

from __future__ import annotations

import copy
import io
import json
import os
import re
import shutil
import time
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from cache.rebuild import RebuildError
from engine.api import GenerationRequest, request_size
from engine.config import EngineConfig
from engine.engine import Engine, decode_stage
from engine.prepare import prepare_stage
from engine.errors import ClientError, FaultCause, GenerationCancelled, ServerFault, WeightsRejected
from model.decode import DecoderLoadError
from model.layout import CheckpointError, H3Checkpoint
from model.mp4 import write_mp4
from model.provisioning import auto_checkpoint_dir, ensure_checkpoint
from model.text_encoder import TextEncoderLoadError
from model.tiny import make_tiny_checkpoint
from model.weights import TransformerWeights
from parallel.launch import launch_local
from tests.weights_support import WRONG_SHAPE_TENSOR, finetune_of, with_wrong_shape

pytestmark = pytest.mark.timeout(300)

FPS = 24
NUM_FRAMES = 124  # 5 s -> round(5 * 24) + 1 = 121, snapped up to 17 n + 5
VIDEO_LATENTS = (24, 37, 4, 4)  # [C, 5 n + 2, 64 / 16, 64 / 16]
AUDIO_ROWS = (414, 32)  # 2 channels x round(124 / 24 * 40) = 207 latents, 32 channels
SAMPLE_RATE = 32000
MAX_STEPS = 12
MAX_PROMPT_TOKENS = 16
# Cache-DiT on this request (steps=9: 8 forwards), seed-0 tiny checkpoint: Fn=1, Bn=1, one warmup forward,
# at most two cached forwards in a row. Forwards 1, 2 and 4 stay under the 0.15 residual threshold.
CACHE_DIT = {"enabled": True, "Fn_compute_blocks": 1, "Bn_compute_blocks": 1, "max_warmup_steps": 1,
             "residual_diff_threshold": 0.15, "max_continuous_cached_steps": 2}
CACHED_STEPS = [1, 2, 4]


def small_request(**overrides) -> GenerationRequest:
    fields = dict(prompt="a red fox", steps=3, seconds=5.0, width=64, height=64, seed=11, return_video=False)
    return GenerationRequest(**{**fields, **overrides})


def same_bits(a, b) -> bool:
    return torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio)


# --- engines -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


def make_engine(root: Path, **config) -> Engine:
    adaln = {"host_cache_gb": 0.01, **config.pop("adaln", {})}
    return Engine(EngineConfig(checkpoint_root=str(root), device="cpu", adaln=adaln, **config))


@pytest.fixture(scope="module")
def engine(checkpoint_root) -> Engine:
    """The shipped default (online AdaLN) with small server limits."""
    return make_engine(checkpoint_root, max_steps=MAX_STEPS, text_encoder={"max_prompt_tokens": MAX_PROMPT_TOKENS})


@pytest.fixture(scope="module")
def resident(checkpoint_root) -> Engine:
    return make_engine(checkpoint_root, adaln={"mode": "resident"})


@pytest.fixture(scope="module")
def offloaded(checkpoint_root) -> Engine:
    return make_engine(checkpoint_root, offload={"enabled": True})


@pytest.fixture(scope="module")
def cached(checkpoint_root) -> Engine:
    return make_engine(checkpoint_root, adaln={"mode": "resident"}, cache_dit=CACHE_DIT)


@pytest.fixture(scope="module")
def native(checkpoint_root) -> Engine:
    return make_engine(checkpoint_root, adaln={"mode": "resident"}, checkpoint_layout="native")


@pytest.fixture(scope="module")
def seed1_checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("seed1") / "tiny", "diffusers", seed=1)


@pytest.fixture(scope="module")
def finetune_checkpoint(tmp_path_factory, engine) -> Path:
    """What an engine updated to `seed1_checkpoint` serves: the seed-1 transformer with the seed-0 text encoder
    and VAEs (an update loads the transformer only)."""
    return finetune_of(engine.checkpoint.root, tmp_path_factory.mktemp("finetune") / "tiny")


# --- prompt -> MP4 -------------------------------------------------------------------------------------


def mean_abs_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(int) - b.astype(int)).mean())


def test_prompt_becomes_an_mp4_of_the_requested_frames_size_and_stereo_audio(engine):
    result = engine.generate(small_request(return_video=True))
    with av.open(io.BytesIO(result.mp4)) as container:
        (video,) = container.streams.video
        (sound,) = container.streams.audio
        assert (video.codec_context.name, video.width, video.height) == ("h264", 64, 64)
        assert video.average_rate == FPS
        assert (sound.codec_context.name, sound.channels, sound.sample_rate) == ("aac", 2, SAMPLE_RATE)
        video_s, audio_s = float(video.duration * video.time_base), float(sound.duration * sound.time_base)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(frames) == NUM_FRAMES
    # 124 frames = 5.167 s; the audio VAE's 207 latents x 800 samples = 5.175 s
    assert abs(video_s - NUM_FRAMES / FPS) <= 1 / FPS and abs(audio_s - video_s) <= 1 / FPS
    decoded = engine.video_decoder.decode(result.video)  # uint8 [124, 64, 64, 3]
    # The thumbnail is the first decoded frame, losslessly.
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(result.thumbnail_png))), decoded[0])
    # The MP4 holds the decoded frames in order (H.264 at 64x64 blurs the random VAE's near-noise output, so:
    # each is nearer to its own decoded frame than to another one).
    for i in (0, 61, NUM_FRAMES - 1):
        other = decoded[(i + 40) % NUM_FRAMES]
        assert mean_abs_difference(frames[i], decoded[i]) < mean_abs_difference(frames[i], other)
    assert result.timings.decode_s > 0 and result.timings.mux_s > 0


def test_the_mp4_muxed_clip_by_clip_during_the_decode_is_the_one_of_decoding_all_then_muxing(engine):
    result = engine.generate(small_request(return_video=True))
    whole = io.BytesIO()
    write_mp4(whole, engine.video_decoder.decode(result.video), FPS, engine.audio_decoder.decode(result.audio),
              SAMPLE_RATE)
    assert result.mp4 == whole.getvalue()


def test_same_seed_gives_the_same_bits_and_the_same_mp4(engine):
    a, b = engine.generate(small_request(return_video=True)), engine.generate(small_request(return_video=True))
    assert same_bits(a, b) and a.mp4 == b.mp4 and a.thumbnail_png == b.thumbnail_png


def test_different_seed_differs(engine):
    a, b = engine.generate(small_request(seed=1)), engine.generate(small_request(seed=2))
    assert not torch.equal(a.video, b.video) and not torch.equal(a.audio, b.audio)


def test_result_shapes_dtypes_timings_and_stats(engine):
    result = engine.generate(small_request(steps=4))
    assert tuple(result.video.shape) == VIDEO_LATENTS and tuple(result.audio.shape) == AUDIO_ROWS
    assert result.video.dtype == result.audio.dtype == torch.float32 and result.video.device.type == "cpu"
    assert torch.isfinite(result.video).all() and torch.isfinite(result.audio).all()
    assert result.mp4 is None and result.thumbnail_png is None  # return_video=False: no decode
    assert result.timings.decode_s == result.timings.mux_s == 0.0
    assert result.timings.total_s >= result.timings.denoise_s > 0
    stats = result.stats
    assert stats.text_tokens == engine.prompt_encoder.count_tokens("a red fox")
    assert stats.tokens == stats.text_tokens + 414 + 37 * 2 * 2  # [text | audio rows | video patches]
    assert (stats.steps, stats.forwards, stats.frames) == (4, 3, NUM_FRAMES)
    assert stats.schedule_key == small_request(steps=4).schedule_key
    assert (stats.adaln_mode, stats.adaln.requests, stats.prompt_cache) == ("online", 1, engine.prompt_stage.cache.stats())
    # Serialized, it is the response's `stats` object: features that are off are absent.
    assert list(stats.model_dump(mode="json")) == [
        "steps", "forwards", "frames", "tokens", "text_tokens", "adaln_mode", "linears", "schedule_key", "adaln",
        "prompt_cache"]
    assert result.model == engine.model_name and result.model.startswith("minimax-h3@") and result.seed == 11


def test_unseeded_request_reports_a_seed_that_reproduces_it(engine):
    first = engine.generate(small_request(seed=None))
    assert same_bits(first, engine.generate(small_request(seed=first.seed)))


def test_progress_is_reported_after_every_forward(engine):
    seen = []
    engine.generate(small_request(steps=5), progress=lambda i, n: seen.append((i, n)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]  # 5 grid points: 4 forwards


def test_cancel_stops_between_steps_releases_the_plans_and_the_engine_still_works(engine):
    seen = []
    with pytest.raises(GenerationCancelled):
        engine.generate(small_request(steps=7), progress=lambda i, n: seen.append(i), cancelled=lambda: len(seen) >= 2)
    assert seen == [1, 2]
    stats = engine.debug_stats()
    assert stats["busy"] is False and stats["held_plan_refs"] == 0
    assert engine.generate(small_request()).video.shape == VIDEO_LATENTS


def test_the_second_request_of_a_schedule_finds_every_plan_in_the_gpu_slab(engine):
    engine.generate(small_request(steps=2))  # one forward: the plan of timestep 0.0 (both sigmas 1)
    request = small_request(steps=6, flow_shift=7.5)  # a schedule no other test uses
    first, second = engine.generate(request), engine.generate(request)
    # Forward 0's plan is every schedule's: warm; the other 4 are built once, then found in the slab.
    assert (first.stats.adaln.built_plans, first.stats.adaln.gpu_hit_plans) == (4, 1)
    assert (second.stats.adaln.built_plans, second.stats.adaln.gpu_hit_plans) == (0, 5)
    assert same_bits(first, second)


def test_the_plan_rebuild_is_set_up_at_start_so_the_first_miss_allocates_no_staging(checkpoint_root):
    fresh = make_engine(checkpoint_root)
    rebuilder = fresh.plan_cache.rebuilder
    assert rebuilder.num_staging_allocations == 1 and rebuilder.staging_nbytes > 0  # at start, sized to the units
    assert fresh.plan_cache.slab.index.num_free == fresh.plan_cache.slab.index.capacity  # warm-up used scratch rows
    result = fresh.generate(small_request(steps=4, flow_shift=9.5))
    adaln = result.stats.adaln
    assert adaln.built_plans == 3 and rebuilder.num_staging_allocations == 1
    # The checkpoint was just read at start: the rebuild's bytes split into page cache + disk adds up.
    assert adaln.page_cache_bytes + adaln.disk_bytes == adaln.rebuild_bytes_read > 0


def test_health_and_describe(engine, checkpoint_root):
    assert engine.health()["status"] == "ok" and engine.health()["device"] == "cpu"
    card = engine.describe()
    assert card["id"] == engine.model_name and card["device"] == "cpu" and card["layout"] == "diffusers"
    assert card["checkpoint"] == str(checkpoint_root / "tiny-diffusers")
    assert card["fingerprint"] == engine.model_name.removeprefix("minimax-h3@")
    limits = card["limits"]  # engine.limits.ModelLimits, as served by GET /v1/models
    assert {k: limits[k] for k in ("max_steps", "short_edge", "max_pixels", "min_seconds", "max_seconds",
                                   "size_multiple", "fps", "max_prompt_tokens")} == {
        "max_steps": MAX_STEPS, "short_edge": None, "max_pixels": 768 * 1344, "min_seconds": 5.0,
        "max_seconds": 15.0, "size_multiple": 32, "fps": FPS, "max_prompt_tokens": MAX_PROMPT_TOKENS}
    # The tiny checkpoint's canvas rule (its model index, as diffusers reads it), not the release's 1344x768.
    assert (limits["default_size"], limits["default_seconds"], limits["default_steps"]) == ("64x32", 5.0, min(50, MAX_STEPS))
    assert card["model_config"]["num_layers"] == 4 and card["engine_config"]["adaln"]["mode"] == "online"


def test_a_request_without_a_size_gets_the_checkpoints_default_canvas(engine):
    bare = GenerationRequest(prompt="a red fox", steps=3, seed=11, return_video=False)
    result = engine.generate(bare)
    sized = engine.generate(bare.model_copy(update={"width": 64, "height": 32}))
    assert (bare.width, bare.height, bare.size_given) == (None, None, False)
    assert result.video.shape[-2:] == (2, 4)  # 64x32 px: 4x2 latent pixels (x16)
    assert same_bits(result, sized)


def test_a_lone_width_or_height_takes_the_other_edge_from_the_default_canvas(engine):
    default = tuple(int(edge) for edge in engine.limits.default_size.split("x"))  # the tiny model's 64x32
    for lone, want in (({"width": 96}, (96, default[1])), ({"height": 64}, (default[0], 64))):
        request = GenerationRequest(prompt="a red fox", **lone)
        assert request.size_given and request_size(request, engine.limits) == want


# --- features: each one on gives the resident bits -----------------------------------------------------


def test_online_adaln_gives_the_same_bits_as_resident(engine, resident):
    assert same_bits(engine.generate(small_request(steps=5)), resident.generate(small_request(steps=5)))


def test_offload_gives_the_same_bits_as_resident(offloaded, resident):
    out = offloaded.generate(small_request(steps=4))
    assert same_bits(out, resident.generate(small_request(steps=4)))
    assert out.stats.offload.steps == 3 and out.stats.offload.h2d_bytes > 0
    assert "h2d_bytes_per_step" not in out.stats.model_dump()["offload"]  # one number per forward: left out


def test_both_checkpoint_layouts_give_the_same_bits(native, resident):
    assert native.describe()["layout"] == "native"
    assert same_bits(native.generate(small_request()), resident.generate(small_request()))


def test_cache_dit_caches_exactly_the_expected_forwards(cached, resident):
    out = cached.generate(small_request(steps=9))
    assert (out.stats.cache_dit.config, out.stats.cache_dit.cached_steps) == ("F1B1 W1 R0.15 MC2", CACHED_STEPS)
    assert out.stats.model_dump()["cache_dit"] == {"config": "F1B1 W1 R0.15 MC2", "cached_steps": CACHED_STEPS}
    assert not torch.equal(out.video, resident.generate(small_request(steps=9)).video)
    # Nothing leaks between requests: the same request again caches the same forwards, same bits.
    again = cached.generate(small_request(steps=9))
    assert again.stats.cache_dit.cached_steps == CACHED_STEPS and same_bits(again, out)


def test_a_request_turning_cache_dit_off_gets_the_resident_bits(cached, resident):
    off = cached.generate(small_request(steps=9, cache_dit={"enabled": False}))
    assert (off.stats.cache_dit.config, off.stats.cache_dit.cached_steps) == ("off", [])
    assert same_bits(off, resident.generate(small_request(steps=9)))


def test_offload_with_cache_dit_gives_the_bits_of_cache_dit_alone(checkpoint_root, cached):
    both = make_engine(checkpoint_root, cache_dit=CACHE_DIT, offload={"enabled": True})
    out = both.generate(small_request(steps=9))
    assert out.stats.cache_dit.cached_steps == CACHED_STEPS
    assert same_bits(out, cached.generate(small_request(steps=9)))


@pytest.mark.slow  # the blocks compiled (dynamo, eager backend) and warmed
@pytest.mark.parametrize("offload", [False, True])
def test_compiled_blocks_with_cache_dit_give_the_bits_of_cache_dit_alone_and_compile_nothing_more(checkpoint_root,
                                                                                                 cached, offload):
    """Cache-DiT wraps the block stack and skips the middle blocks on cached forwards; the offloader's hooks and
    the compiled graph are the block's own: composed, the same forwards are cached, the bits are Cache-DiT's, the
    skipped blocks stream nothing, and the blocks that do run (every one on computed forwards, Fn and Bn on cached
    ones) share the warm-up's graph."""
    torch._dynamo.reset()
    both = make_engine(checkpoint_root, cache_dit=CACHE_DIT,  # online AdaLN, as served; `cached` is resident
                       offload={"enabled": offload},
                       compile={"mode": "blocks", "backend": "eager",
                                "warmup": [dict(width=64, height=64, seconds=5.0)]})
    out = both.generate(small_request(steps=9))
    assert out.stats.cache_dit.cached_steps == CACHED_STEPS
    assert same_bits(out, cached.generate(small_request(steps=9)))
    assert out.stats.compile.since_warmup == 0 and out.stats.compile.frames_compiled == 1
    if offload:  # the counters are cumulative: the same request again ran 8 forwards of 4 blocks, 3 of them
        # cached (Fn=1, Bn=1: 2 middle blocks skipped each), and streamed no block it skipped
        again = both.generate(small_request(steps=9)).stats.offload
        assert again.block_calls - out.stats.offload.block_calls == 8 * 4 - 3 * 2
        assert again.wasted_prefetches == out.stats.offload.wasted_prefetches


# --- limits: ClientError naming the field and the limit ------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"guidance_scale": 2.0}, "guidance_scale: 2.0 is not served: MiniMax-H3 is CFG-distilled, guidance is fixed at 1"),
    ({"guidance_scale": 0.5}, "guidance_scale: 0.5 is not served"),
    ({"width": 65}, "width: 65 is out of range: must be a multiple of 32 px"),
    ({"height": 48}, "height: 48 is out of range: must be a multiple of 32 px"),
    ({"width": 4096, "height": 4096}, "width: 4096x4096 = 16777216 px is out of range: must be <= 1032192 px"),
    ({"seconds": 4.0}, "snaps to 107 frames = 4.45833 s at 24 fps; must be between 5 and 15 s"),
    ({"seconds": 16.0}, "snaps to 396 frames = 16.5 s at 24 fps; must be between 5 and 15 s"),
    # 15 s snaps up to 362 frames = 15.08 s: over the limit, as in the diffusers pipeline.
    ({"seconds": 15.0}, "snaps to 362 frames = 15.0833 s at 24 fps; must be between 5 and 15 s"),
    ({"steps": MAX_STEPS + 1}, f"steps: {MAX_STEPS + 1} exceeds this server's max_steps={MAX_STEPS}"),
    ({"prompt": "a red fox " * 4}, f"prompt: 21 tokens exceeds this server's max_prompt_tokens={MAX_PROMPT_TOKENS}"),
    ({"cache_dit": {"enabled": True}}, "cache_dit: Cache-DiT is off on this server"),
], ids=["guidance-2", "guidance-0.5", "width-65", "height-48", "too-many-pixels", "seconds-4", "seconds-16",
        "seconds-15", "steps-over-max", "prompt-over-max-tokens", "cache-dit-off-on-the-server"])
def test_a_request_over_a_limit_is_a_client_error_naming_field_and_limit(engine, overrides, message):
    for call in (engine.validate, engine.generate):
        with pytest.raises(ClientError) as info:
            call(small_request(**overrides))
        assert message in str(info.value)
        assert info.value.field == next(iter(overrides))  # typed: the request field at fault
    assert engine.health()["busy"] is False and engine.debug_stats()["held_plan_refs"] == 0


@pytest.mark.parametrize("seconds", [4.0, 16.0])
def test_a_duration_out_of_range_names_the_seconds_field(engine, seconds):
    with pytest.raises(ClientError, match=rf"^seconds[=:] ?{seconds}"):
        engine.validate(small_request(seconds=seconds))


def test_the_longest_and_shortest_accepted_durations(engine):
    # 4.9 s -> 119 -> 124 frames (5.17 s); 14.3 s -> 344 -> 345 frames (14.375 s, the longest).
    for seconds in (4.9, 14.3):
        engine.validate(small_request(seconds=seconds))


@pytest.mark.parametrize("geometry, message", [
    ({"short_edge": 780}, "short_edge=780 must be a multiple of 32 px"),
    ({"min_seconds": 10, "max_seconds": 5}, "min_seconds=10 exceeds max_seconds=5"),
    ({"min_seconds": 5.5, "max_seconds": 5.6}, r"shortest clip of at least min_seconds lasts 5.875 s"),  # 141 frames
])
def test_geometry_limits_no_request_can_meet_are_refused_in_the_config(geometry, message):
    """Else the server starts and refuses every request as the client's fault."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(geometry=geometry)
    EngineConfig(geometry={"min_seconds": 5.875, "max_seconds": 5.875})  # exactly one clip length: 141 frames


def test_cache_dit_settings_past_the_model_are_a_client_error(cached):
    with pytest.raises(ClientError, match=r"cache_dit: Fn_compute_blocks \+ Bn_compute_blocks = 4 \+ 1 exceeds"):
        cached.generate(small_request(cache_dit={"Fn_compute_blocks": 4}))


def test_cache_dit_settings_cache_dit_cannot_run_are_refused_before_the_run(cached):
    # cache-dit asserts Fn >= 1 at the first forward: the request is refused when parsed, naming the field.
    with pytest.raises(ValueError, match="Fn_compute_blocks"):
        small_request(cache_dit={"Fn_compute_blocks": 0})
    # steps=3 is 2 forwards; cache-dit's named masks exist for 4, 6 or >= 8 (its assertion, at the first forward).
    with pytest.raises(ClientError, match=r"^cache_dit: steps_computation_mask='fast' does not fit 2 steps"):
        cached.validate(small_request(cache_dit={"steps_computation_mask": "fast"}))


# --- weight updates ------------------------------------------------------------------------------------


UPDATE_CONFIGS = [
    pytest.param({"adaln": {"mode": "online"}}, id="online"),
    pytest.param({"adaln": {"mode": "resident"}}, id="resident", marks=pytest.mark.slow),
    pytest.param({"adaln": {"mode": "resident"}, "offload": {"enabled": True}}, id="resident-offload", marks=pytest.mark.slow),
    pytest.param({"adaln": {"mode": "online"}, "offload": {"enabled": True}}, id="online-offload", marks=pytest.mark.slow),
    # Compiled blocks take the weights as graph inputs: the update compiles nothing and serves the new weights.
    pytest.param({"adaln": {"mode": "online"}, "compile": {"mode": "blocks", "backend": "eager", "warmup": [
        {"width": 64, "height": 64, "seconds": 5.0}]}}, id="online-compiled", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("config", UPDATE_CONFIGS)
def test_update_to_a_seed1_checkpoint_serves_exactly_a_fresh_engine_on_its_transformer(
        checkpoint_root, seed1_checkpoint, finetune_checkpoint, config):
    engine = make_engine(checkpoint_root, **copy.deepcopy(config))
    before = engine.generate(small_request())
    card = engine.update_weights(seed1_checkpoint)
    after = engine.generate(small_request())  # before another engine's warm-up adds to dynamo's counters
    if "compile" in config:
        assert after.stats.compile.since_warmup == 0
    fresh = make_engine(checkpoint_root, checkpoint=str(finetune_checkpoint), **copy.deepcopy(config))
    assert card["id"] == engine.model_name == fresh.model_name != before.model
    assert after.model == fresh.model_name and same_bits(after, fresh.generate(small_request()))
    assert not torch.equal(after.video, before.video)
    if engine.plan_cache is not None:
        assert after.stats.adaln.built_plans == 2  # the old weights' plans were dropped
        assert engine.debug_stats()["stale_plans"] == 0


def test_a_rejected_update_names_the_tensor_and_writes_nothing(resident, engine, seed1_checkpoint, tmp_path):
    wrong = with_wrong_shape(seed1_checkpoint, tmp_path / "wrong")
    for target in (resident, engine):
        before, model = target.generate(small_request()), target.model_name
        for call in (target.validate_weight_update, target.update_weights):
            with pytest.raises(WeightsRejected, match=re.escape(WRONG_SHAPE_TENSOR)):
                call(wrong)
        assert target.model_name == model and same_bits(target.generate(small_request()), before)


def _shard_holding(root: Path, name: str) -> Path:
    h3 = H3Checkpoint.open(root)
    return TransformerWeights(h3.transformer_dir, h3.layout).location(name).path


def _retyped(root: Path) -> None:  # proj_in.weight stored as bf16 (the model holds it in fp32)
    shard = _shard_holding(root, "proj_in.weight")
    tensors = load_file(shard)
    tensors["proj_in.weight"] = tensors["proj_in.weight"].to(torch.bfloat16)
    save_file(tensors, shard, metadata={"format": "pt"})


def _other_architecture(root: Path) -> None:  # one block more than the served model
    config = H3Checkpoint.open(root).transformer_dir / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_layers": 5}))


def _truncated(root: Path) -> None:  # a copy cut short: the shard holding block 3's AdaLN loses its tail
    shard = _shard_holding(root, "transformer_blocks.3.adaln_proj.linear.weight")
    os.truncate(shard, shard.stat().st_size - 100)


def _partial(root: Path) -> None:  # a copy still in progress: one shard the index names is not there yet
    _shard_holding(root, "transformer_blocks.1.attn.to_q.weight").unlink()


def _unreadable(root: Path) -> None:  # a shard that cannot be read as a file
    shard = _shard_holding(root, "proj_in.weight")
    shard.unlink()
    shard.mkdir()


BAD_UPDATES = [
    pytest.param(None, "no-such-dir", id="missing-path"),
    pytest.param(_retyped, "dtype mismatch for tensor 'proj_in.weight'", id="wrong-dtype"),
    pytest.param(_other_architecture, r"num_layers=5 \(expected 4\)", id="other-architecture"),
    pytest.param(_truncated, "truncated shard", id="truncated-shard"),
    pytest.param(_partial, "is missing", id="partial-directory"),
    pytest.param(_unreadable, "diffusion_pytorch_model-", id="unreadable-shard"),
]


@pytest.mark.parametrize("breakage, message", BAD_UPDATES)
def test_a_bad_update_is_refused_before_anything_changes(engine, seed1_checkpoint, tmp_path, breakage, message):
    target = tmp_path / "no-such-dir"
    if breakage is not None:
        target = Path(shutil.copytree(seed1_checkpoint, tmp_path / "broken"))
        breakage(target)
    before = engine.generate(small_request())
    version, stats = engine.plan_cache.weights_version, engine.debug_stats()
    for call in (engine.validate_weight_update, engine.update_weights):
        with pytest.raises(WeightsRejected, match=message):
            call(target)
    # Same weights, same plans (still resident: the next request hits the slab), same bits.
    assert (engine.plan_cache.weights_version, engine.debug_stats()) == (version, stats)
    after = engine.generate(small_request())
    assert same_bits(after, before) and after.model == before.model
    assert after.stats.adaln.built_plans == 0 and after.stats.adaln.gpu_hit_plans > 0


# --- a checkpoint that breaks while serving ------------------------------------------------------------


@pytest.mark.slow
def test_a_shard_deleted_after_start_is_a_server_fault_then_a_retry_succeeds(tmp_path, resident):
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", "diffusers", seed=0)
    engine = make_engine(tmp_path, checkpoint=str(checkpoint), adaln={"host_cache_gb": 0.0})
    h3 = H3Checkpoint.open(checkpoint)
    shard = TransformerWeights(h3.transformer_dir, h3.layout).location(
        "transformer_blocks.1.adaln_proj.linear.weight").path
    saved = Path(shard).read_bytes()
    Path(shard).unlink()
    request = small_request(flow_shift=5.5)  # a schedule whose plans must be rebuilt from the checkpoint
    with pytest.raises(ServerFault, match=Path(shard).name) as info:
        engine.generate(request)
    assert info.value.cause is FaultCause.CHECKPOINT_UNREADABLE and isinstance(info.value.__cause__, RebuildError)
    stats = engine.debug_stats()
    assert stats["held_plan_refs"] == 0 and stats["resident_plans"] == 0  # no half-built plan was committed
    assert engine.health()["failed"] == 1

    Path(shard).write_bytes(saved)  # the file is back
    after = engine.generate(request)
    assert after.stats.adaln.built_plans == 2
    assert same_bits(after, resident.generate(request))


@pytest.mark.slow
def test_a_transformer_that_outputs_nan_is_a_server_fault_not_a_black_video(tmp_path):
    """NaN latents (NaN spreads from the video head to every row through joint attention) are the server's
    fault, said before decoding: NaN frames decode to black uint8 and NaN audio fails the AAC encoder (EINVAL)."""
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", "diffusers", seed=0)
    shard = _shard_holding(checkpoint, "proj_out.weight")  # the video output head: video rows only
    tensors = load_file(shard)
    tensors["proj_out.weight"] = torch.full_like(tensors["proj_out.weight"], float("nan"))
    save_file(tensors, shard, metadata={"format": "pt"})
    engine = make_engine(tmp_path, checkpoint=str(checkpoint), adaln={"mode": "resident"})
    with pytest.raises(ServerFault, match="latents hold NaN or inf") as info:
        engine.generate(small_request(return_video=True))
    assert info.value.cause is FaultCause.NON_FINITE_LATENTS and engine.health()["failed"] == 1


# --- the auto-made checkpoint --------------------------------------------------------------------------


def test_auto_checkpoint_is_made_once_then_reused(checkpoint_root, engine):
    config = EngineConfig(checkpoint_root=str(checkpoint_root), device="cpu")
    path = ensure_checkpoint(config)  # the engine fixture made it
    assert path == auto_checkpoint_dir(config) == checkpoint_root / "tiny-diffusers"
    mtime = (path / "model_index.json").stat().st_mtime_ns
    assert ensure_checkpoint(config) == path and (path / "model_index.json").stat().st_mtime_ns == mtime
    assert auto_checkpoint_dir(EngineConfig(checkpoint_root="r", checkpoint_layout="native",
                                            checkpoint_seed=3)) == Path("r/tiny-native-seed3")
    # One serving ref2va holds both partitions, apart from the FL2VA-only one.
    assert auto_checkpoint_dir(EngineConfig(checkpoint_root="r", partition="ref2va")) == Path("r/tiny-diffusers-ref2va")


def _race_to_make_the_checkpoint(rank: int, world_size: int, init_method: str, config: EngineConfig,
                                 workdir: str) -> None:
    """One replica's start: wait until every one is up (a file each), then make or find the checkpoint."""
    workdir_ = Path(workdir)
    (workdir_ / f"up-{rank}").touch()
    deadline = time.monotonic() + 60
    while not all((workdir_ / f"up-{peer}").exists() for peer in range(world_size)):
        assert time.monotonic() < deadline, "the other replica never started"
        time.sleep(0.001)
    (workdir_ / f"made-{rank}").write_text(str(ensure_checkpoint(config)))


@pytest.mark.slow  # two processes making a checkpoint
def test_two_replicas_racing_to_make_the_checkpoint_both_get_a_complete_one(tmp_path):
    # Replicas are processes: two start at once and both find no checkpoint (the tiny model's meta-device
    # init is process-global, so the race is run in processes, as Serve runs it; forked from parallel.launch's
    # forkserver, which imported torch and diffusers once).
    root, workdir = tmp_path / "root", tmp_path / "race"
    config = EngineConfig(checkpoint_root=str(root), device="cpu", checkpoint_layout="native")
    exits = launch_local(_race_to_make_the_checkpoint, 2, workdir, args=(config, str(workdir)), deadline_s=120)
    assert all(exit_.ok for exit_ in exits), exits
    results = [(workdir / f"made-{rank}").read_text() for rank in range(2)]
    assert results == [str(root / "tiny-native")] * 2
    assert H3Checkpoint.open(results[0], require_components=True).layout.value == "native"
    assert sorted(p.name for p in root.iterdir()) == ["tiny-native"]  # no temporary directory left behind


def test_explicit_missing_checkpoint_fails_naming_the_path(tmp_path):
    with pytest.raises(CheckpointError, match="nope"):
        Engine(EngineConfig(checkpoint=str(tmp_path / "nope"), device="cpu"))


# --- checkpoints that are not the one served --------------------------------------------------------------


def ref2va_partition(tmp_path: Path) -> Path:
    """A native Ref2VA partition directory: the FL2VA one's files (same shapes) under the Ref2VA marker."""
    native = make_tiny_checkpoint(tmp_path / "native", "native", seed=1)
    ref = Path(shutil.copytree(native / "FL2VA", tmp_path / "root" / "Ref2VA"))
    (ref / "model_index.json").write_text(json.dumps({"_minimax_h3": {"partition": "ref2va", "tasks": ["ref2va"]}}))
    return ref


def test_a_ref2va_partition_is_served_neither_at_start_nor_as_a_weight_update(engine, tmp_path):
    """The engine serves t2va, which only the FL2VA transformer does; Ref2VA's has the same shapes."""
    ref = ref2va_partition(tmp_path)
    with pytest.raises(CheckpointError, match="is the Ref2VA partition, not the FL2VA one"):
        Engine(EngineConfig(checkpoint=str(ref), device="cpu"))
    model = engine.model_name
    for call in (engine.validate_weight_update, engine.update_weights):
        with pytest.raises(WeightsRejected, match="is the Ref2VA partition, not the FL2VA one"):
            call(ref)
    assert engine.model_name == model


def _wider_text_encoder(root: Path, monkeypatch) -> None:  # another Qwen3-VL: 48 wide, the transformer takes 32
    from model import tiny_components

    monkeypatch.setattr(tiny_components, "TINY_TEXT_DIM", 48)
    shutil.rmtree(root / "text_encoder")
    encoder = tiny_components.tiny_text_encoder(tiny_components.tiny_tokenizer(), seed=0)
    encoder.save_pretrained(root / "text_encoder")


def _edit_config(path: Path, **values) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


MISFITS = [  # (break the copy, which stage refuses it, error, message)
    pytest.param(_wider_text_encoder, prepare_stage, TextEncoderLoadError, "encodes prompts 48 wide, but the "
                 r"transformer \(.*config.json\) takes text_dim=32", id="text-encoder-width"),
    pytest.param(lambda root, _: _edit_config(root / "audio_vae" / "config.json", sampling_rate=16000), decode_stage,
                 DecoderLoadError, r"audio_vae does not decode MiniMax-H3 latents: latents per second 20 "
                 r"\(expected 40\)", id="audio-sample-rate", marks=pytest.mark.slow),
    pytest.param(lambda root, _: _edit_config(root / "vae" / "config.json", clip_length=13), decode_stage,
                 DecoderLoadError, r"vae does not decode MiniMax-H3 latents: clip_length 13 \(expected 17\), latent "
                 r"frames per clip 4 \(expected 5\)", id="video-clip-length", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("breakage, stage, error, message", MISFITS)
def test_components_that_do_not_fit_the_transformer_are_refused_at_start(engine, tmp_path, monkeypatch, breakage,
                                                                         stage, error, message):
    """Each loads on its own; served together they would fail every request (text width) or mux a soundtrack or
    a video that does not last the requested time (a 16 kHz VAE decodes 40 latents/s into 10.35 s for 5.17 s)."""
    root = Path(shutil.copytree(engine.checkpoint.root, tmp_path / "misfit"))
    breakage(root, monkeypatch)
    config = EngineConfig(checkpoint=str(root), device="cpu")
    with pytest.raises(error, match=message):
        stage(config)
    with pytest.raises(error, match=message):
        Engine(config)


def test_online_adaln_gives_the_resident_bits_on_cuda(checkpoint_root):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    online = Engine(EngineConfig(checkpoint_root=str(checkpoint_root), device="cuda"))
    resident = Engine(EngineConfig(checkpoint_root=str(checkpoint_root), device="cuda", adaln={"mode": "resident"}))
    assert same_bits(online.generate(small_request(steps=5)), resident.generate(small_request(steps=5)))


def test_a_schedule_is_built_once_per_steps_and_shifts_and_a_bad_one_is_refused_every_time():
    """Requests of one schedule share its build (read-only tensors); the build is the scheduler's, bit for bit."""
    from engine.engine import request_schedule
    from model.schedule import H3Schedule, ScheduleError

    first = request_schedule(5, 2.25, 3.0)
    assert request_schedule(5, 2.25, 3.0) is first
    assert request_schedule(5, 2.5, 3.0) is not first
    fresh = H3Schedule.build(5, 2.25, 3.0)
    assert first.key == fresh.key
    assert all(a.equal(b) for a, b in zip(first.plans, fresh.plans))
    assert first.video_sigmas.equal(fresh.video_sigmas) and first.audio_sigmas.equal(fresh.audio_sigmas)
    for _ in range(2):
        with pytest.raises(ScheduleError, match="num_steps"):
            request_schedule(1, 2.25, 3.0)
