"""The plain torch engine (engine.engine.Engine) on a tiny auto-made checkpoint, on CPU."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.api import GenerationRequest, check_limits
from engine.config import EngineConfig
from engine.engine import Engine, auto_checkpoint_dir, ensure_checkpoint
from engine.errors import GenerationCancelled
from model.checkpoint import CheckpointReader, make_checkpoint
from model.config import preset

TINY = preset("tiny")  # max_frames 8, max_height/width 32, patch (1, 2, 2), max_audio_len 64, 128 prompt bytes


def small_request(**overrides) -> GenerationRequest:
    fields = dict(prompt="a red fox", steps=3, frames=2, height=8, width=8, audio_len=4, seed=11)
    return GenerationRequest(**{**fields, **overrides})


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def engine(checkpoint_root):
    return Engine(EngineConfig(checkpoint_root=checkpoint_root, device="cpu", adaln={"mode": "resident"}))


# --- results -------------------------------------------------------------------------------------


def test_same_seed_gives_the_same_bits(engine):
    a, b = engine.generate(small_request()), engine.generate(small_request())
    assert torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio)


def test_different_seed_differs(engine):
    a, b = engine.generate(small_request(seed=1)), engine.generate(small_request(seed=2))
    assert not torch.equal(a.video, b.video) and not torch.equal(a.audio, b.audio)


def test_result_shapes_dtypes_timings_and_stats(engine):
    result = engine.generate(small_request(frames=3, height=6, width=10, audio_len=5))
    assert result.video.shape == (TINY.video_channels, 3, 6, 10) and result.video.dtype == torch.float32
    assert result.audio.shape == (5, TINY.audio_channels) and result.audio.dtype == torch.float32
    assert result.video.device.type == "cpu" and torch.isfinite(result.video).all()
    assert set(result.timings) == {"encode_s", "plan_s", "denoise_s", "total_s"}
    assert result.timings["total_s"] >= result.timings["denoise_s"] > 0
    # tokens: BOS + 9 prompt bytes, 5 audio frames, 3*(6/2)*(10/2) = 45 video patches
    assert result.stats["steps"] == 3 and result.stats["tokens"] == 10 + 5 + 45
    assert result.stats["model_calls"] == 3 and result.model.startswith("tiny@")
    assert result.seed == 11


def test_video_only_request_has_empty_audio(engine):
    result = engine.generate(small_request(audio_len=0))
    assert result.audio.shape == (0, TINY.audio_channels) and result.video.shape == (4, 2, 8, 8)


def test_guidance_adds_an_unconditional_pass(engine):
    plain = engine.generate(small_request())
    guided = engine.generate(small_request(guidance_scale=4.0))
    assert guided.stats["model_calls"] == 2 * plain.stats["model_calls"]
    assert not torch.equal(plain.video, guided.video)
    assert torch.equal(guided.video, engine.generate(small_request(guidance_scale=4.0)).video)


def test_unseeded_request_reports_a_seed_that_reproduces_it(engine):
    first = engine.generate(small_request(seed=None))
    again = engine.generate(small_request(seed=first.seed))
    assert torch.equal(first.video, again.video)


def test_progress_is_reported_after_every_step(engine):
    seen = []
    engine.generate(small_request(steps=4), progress=lambda i, n: seen.append((i, n)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_cancel_stops_between_steps_and_the_engine_still_works(engine):
    seen = []
    with pytest.raises(GenerationCancelled):
        engine.generate(small_request(steps=6), progress=lambda i, n: seen.append(i), cancelled=lambda: len(seen) >= 2)
    assert seen == [1, 2]
    assert engine.health()["busy"] is False
    assert engine.generate(small_request()).video.shape == (4, 2, 8, 8)


def test_online_adaln_plans_give_the_same_bits_as_resident(engine, checkpoint_root):
    online = Engine(EngineConfig(checkpoint_root=checkpoint_root, device="cpu",
                                    adaln={"mode": "online", "host_cache_gb": 0.01}))
    a, b = engine.generate(small_request()), online.generate(small_request())
    assert torch.equal(a.video, b.video) and torch.equal(a.audio, b.audio)
    assert b.stats["adaln"]["built_plans"] == 3
    assert online.generate(small_request()).stats["adaln"]["gpu_hit_plans"] == 3


def test_health_and_describe(engine):
    assert engine.health()["status"] == "ok"
    card = engine.describe()
    assert card["id"] == engine.model_name and card["device"] == "cpu"
    assert card["fingerprint"] == CheckpointReader(engine.checkpoint_dir).fingerprint
    assert card["limits"]["max_frames"] == 8 and card["limits"]["patch"] == [1, 2, 2]
    assert card["engine_config"]["adaln"]["mode"] == "resident"


# --- limits --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("prompt", "é" * 65, "prompt: 130 UTF-8 bytes exceeds the model's max_text_tokens=128"),
        ("frames", 9, "frames: 9 exceeds the model's max_frames=8"),
        ("height", 34, "height: 34 exceeds the model's max_height=32"),
        ("height", 7, "height: 7 is not a multiple of the model's patch size 2"),
        ("width", 64, "width: 64 exceeds the model's max_width=32"),
        ("width", 9, "width: 9 is not a multiple of the model's patch size 2"),
        ("audio_len", 65, "audio_len: 65 exceeds the model's max_audio_len=64"),
    ],
)
def test_request_over_a_model_limit_is_a_value_error_naming_field_and_limit(engine, field, value, message):
    with pytest.raises(ValueError) as info:
        engine.generate(small_request(**{field: value}))
    assert str(info.value).startswith(message)
    assert engine.health()["busy"] is False


def test_steps_over_the_server_limit():
    with pytest.raises(ValueError, match="steps: 12 exceeds this server's max_steps=10"):
        check_limits(small_request(steps=12), TINY, max_steps=10)


def test_cache_dit_override_needs_cache_dit_on_the_server(engine):
    with pytest.raises(ValueError, match="cache_dit.enabled"):
        engine.generate(small_request(cache_dit={"enabled": True}))


# --- checkpoint -------------------------------------------------------------------------------------


def test_auto_checkpoint_is_made_once_then_reused(tmp_path):
    config = EngineConfig(checkpoint_root=str(tmp_path), device="cpu")
    path = ensure_checkpoint(config)
    assert path == auto_checkpoint_dir(config) == tmp_path / "tiny"
    fingerprint = CheckpointReader(path).fingerprint
    mtime = (path / "config.json").stat().st_mtime_ns
    assert ensure_checkpoint(config) == path and (path / "config.json").stat().st_mtime_ns == mtime
    assert CheckpointReader(path).fingerprint == fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no temp dir left behind


def test_two_replicas_racing_to_make_the_checkpoint_both_get_a_valid_one(tmp_path):
    config = EngineConfig(checkpoint_root=str(tmp_path), device="cpu")
    barrier, results, errors = threading.Barrier(3), [], []

    def start():
        barrier.wait()
        try:
            results.append(ensure_checkpoint(config))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(results)) == 1
    CheckpointReader(results[0]).validate(deep=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_explicit_missing_checkpoint_fails_naming_the_path(tmp_path):
    with pytest.raises(ValueError, match="config.json is missing"):
        Engine(EngineConfig(checkpoint=str(tmp_path / "nope"), device="cpu"))


def test_initial_noise_is_the_same_bits_on_cuda(engine, checkpoint_root):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cuda = Engine(EngineConfig(checkpoint_root=checkpoint_root, device="cuda"))
    request = small_request()
    cpu_video, cpu_audio = engine._initial_noise(request, 5)
    cuda_video, cuda_audio = cuda._initial_noise(request, 5)
    assert torch.equal(cpu_video, cuda_video.cpu()) and torch.equal(cpu_audio, cuda_audio.cpu())


# --- optional features: Cache-DiT and layerwise offload -----------------------------------------------

# Random tiny weights give relative residual diffs ~0.9: a 0.95 threshold makes some steps cacheable.
CACHE_DIT = {"enabled": True, "Fn_compute_blocks": 1, "Bn_compute_blocks": 1, "max_warmup_steps": 2,
             "residual_diff_threshold": 0.95, "max_continuous_cached_steps": 2}


@pytest.fixture(scope="module")
def cache_dit_engine(checkpoint_root):
    return Engine(EngineConfig(checkpoint_root=checkpoint_root, device="cpu", adaln={"mode": "resident"},
                                  cache_dit=CACHE_DIT))


def test_cache_dit_skips_steps_and_a_request_can_turn_it_off(engine, cache_dit_engine):
    cached = cache_dit_engine.generate(small_request(steps=8))
    assert cached.stats["cache_dit"]["config"].startswith("F1B1 W2 R0.95")
    assert len(cached.stats["cache_dit"]["cached_steps"]) > 0
    off = cache_dit_engine.generate(small_request(steps=8, cache_dit={"enabled": False}))
    assert off.stats["cache_dit"] == {"config": "off", "cached_steps": []}
    plain = engine.generate(small_request(steps=8))
    assert torch.equal(off.video, plain.video) and not torch.equal(cached.video, plain.video)
    # Nothing leaks between requests: the same cached request again gives the same bits.
    assert torch.equal(cache_dit_engine.generate(small_request(steps=8)).video, cached.video)


def test_cache_dit_request_errors_name_the_field(engine, cache_dit_engine):
    with pytest.raises(ValueError, match="guidance_scale: classifier-free guidance"):
        cache_dit_engine.generate(small_request(guidance_scale=2.0))
    with pytest.raises(ValueError, match="cache_dit: Fn_compute_blocks \\+ Bn_compute_blocks = 4 \\+ 1 exceeds"):
        cache_dit_engine.generate(small_request(cache_dit={"Fn_compute_blocks": 4}))
    with pytest.raises(ValueError, match="cache_dit.enabled: Cache-DiT is off on this server"):
        engine.generate(small_request(cache_dit={"enabled": True}))
    guided = cache_dit_engine.generate(small_request(guidance_scale=2.0, cache_dit={"enabled": False}))
    assert torch.equal(guided.video, engine.generate(small_request(guidance_scale=2.0)).video)


@pytest.mark.parametrize("adaln_mode", ["resident", "online"])
def test_offload_with_cache_dit_gives_the_same_bits_as_without_offload(cache_dit_engine, checkpoint_root, adaln_mode):
    offloaded = Engine(EngineConfig(checkpoint_root=checkpoint_root, device="cpu", adaln={"mode": adaln_mode},
                                       cache_dit=CACHE_DIT, offload={"enabled": True}))
    ref, out = cache_dit_engine.generate(small_request(steps=8)), offloaded.generate(small_request(steps=8))
    assert torch.equal(ref.video, out.video) and torch.equal(ref.audio, out.audio)
    assert out.stats["cache_dit"]["cached_steps"] == ref.stats["cache_dit"]["cached_steps"]
    assert out.stats["offload"]["steps"] == 8 and out.stats["offload"]["h2d_bytes"] > 0


# --- weight updates ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seed1_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("seed1") / "tiny", TINY, seed=1)


@pytest.mark.parametrize("adaln_mode, offload", [("resident", False), ("online", False), ("resident", True)])
def test_update_weights_serves_the_new_checkpoint_exactly(checkpoint_root, seed1_checkpoint, adaln_mode, offload):
    def make(**kw):
        return Engine(EngineConfig(checkpoint_root=checkpoint_root, device="cpu", adaln={"mode": adaln_mode},
                                      offload={"enabled": offload}, **kw))

    engine = make()
    before = engine.generate(small_request())
    card = engine.update_weights(seed1_checkpoint)
    assert card["fingerprint"] == CheckpointReader(seed1_checkpoint).fingerprint
    after = engine.generate(small_request())
    fresh = make(checkpoint=str(seed1_checkpoint)).generate(small_request())
    assert torch.equal(after.video, fresh.video) and torch.equal(after.audio, fresh.audio)
    assert not torch.equal(after.video, before.video) and after.model == fresh.model != before.model
    if adaln_mode == "online":
        assert after.stats["adaln"]["built_plans"] == 3  # the old weights' plans were dropped


def test_rejected_weight_update_leaves_the_model_untouched(engine, tmp_path):
    before = engine.generate(small_request())
    other = make_checkpoint(tmp_path / "small-ish", preset("tiny", num_blocks=2), seed=1)
    with pytest.raises(ValueError, match="config mismatch"):
        engine.update_weights(other)
    assert torch.equal(engine.generate(small_request()).video, before.video)
