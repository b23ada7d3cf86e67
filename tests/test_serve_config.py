"""serve_config.yaml, AppConfig, worker placement and response encoding (no Ray cluster)."""

from __future__ import annotations

import base64
import io
import re
import types
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from pydantic import BaseModel, ValidationError
from ray.serve.schema import ServeDeploySchema

from deployments.app import resolve_engine_config, resolve_jobs_config, worker_deployment_options
from deployments.schemas import AppConfig, GenerationResponse, WorkerOptions, decode_latents, preview_png
from engine.api import GenerationResult, GenerationStats, GenerationTimings
from engine.config import EngineConfig
from model.mp4 import thumbnail_png

ROOT = Path(__file__).resolve().parents[1]
#: A resident-AdaLN result's counters: no plan cache, no optional feature.
STATS = GenerationStats(steps=2, forwards=1, frames=124, tokens=1000, text_tokens=8, adaln_mode="resident",
                        schedule_key="t2va:2")


def serve_config() -> dict:
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())


def test_serve_config_is_a_valid_serve_deploy_config_and_app_config():
    config = serve_config()
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8000}
    args = AppConfig.model_validate(app["args"])
    assert args.engine.checkpoint == "" and args.engine.device == "auto" and args.engine.preset == "tiny"
    assert args.engine.checkpoint_layout == "diffusers" and args.engine.adaln.mode == "online"
    # The quick start's adapter: auto-made beside the auto-made checkpoint (path ""), 5 grid points by default.
    (name, adapter), = args.engine.adapters.items()
    assert (name, adapter.path, adapter.steps) == ("turbo-tiny", "", 5)


def test_the_partitions_config_serves_both_partitions_behind_one_ingress():
    config = yaml.safe_load((ROOT / "serve_config.partitions.yaml").read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    args = AppConfig.model_validate(app["args"])
    assert (app["route_prefix"], args.served_partitions, args.stages) == ("/", ("fl2va", "ref2va"), "split")


@pytest.mark.parametrize("args, partitions", [
    ({}, ("fl2va",)),  # today's serve_config.yaml: the FL2VA partition alone
    ({"engine": {"partition": "ref2va"}}, ("ref2va",)),  # split serves references too
    ({"partitions": ["ref2va", "fl2va"]}, ("ref2va", "fl2va")),
    ({"partitions": ["fl2va", "ref2va"], "engine": {"partition": "fl2va"}, "stages": "fused"}, ("fl2va", "ref2va")),
])
def test_the_served_partitions(args, partitions):
    assert AppConfig.model_validate(args).served_partitions == partitions


@pytest.mark.parametrize("args, message", [
    ({"partitions": ["fl2va", "fl2va"]}, "lists a partition twice"),
    ({"partitions": []}, "at least 1 item"),
    ({"partitions": ["t2va"]}, "'fl2va' or 'ref2va'"),
    ({"partitions": ["fl2va"], "engine": {"partition": "ref2va"}}, "engine.partition: ref2va is not in partitions"),
    ({"engine": {"partition": "ref2va", "adapters": {"turbo": {}}}},
     r"engine.adapters.turbo.partition: fl2va is not served by this app \(partitions: \['ref2va'\]\)"),
])
def test_bad_partitions_are_refused_naming_the_field(args, message):
    with pytest.raises(ValueError, match=message):
        AppConfig.model_validate(args)


#: Sections the shipped yaml spells out whole; the plan cache's reader tuning, `offload` and `cache_dit` are
#: left to their model's field docs (README: "reader settings", "...").
COMPLETE_SECTIONS = [(), ("engine",), ("engine", "text_encoder"), ("engine", "decode"), ("engine", "parallel"),
                     ("engine", "pool"), ("worker",), ("worker", "autoscaling"), ("text_encoder",), ("decoder",),
                     ("http",), ("admin",), ("jobs",), ("auth",), ("videos",)]
#: Settings the shipped yaml sets to other than the code default, on purpose (each is commented there).
SHIPPED_OVERRIDES = {("engine", "pool"): ("capacity_gb",), ("engine",): ("adapters",)}


@pytest.mark.parametrize("section", COMPLETE_SECTIONS, ids=lambda section: ".".join(section) or "args")
def test_shipped_config_names_every_setting_of_its_sections(section):
    """An operator finds every setting in serve_config.yaml (with its default): a code option missing from the
    file (http.max_ongoing_requests, the stages' graceful_shutdown_timeout_s, ...) was a knob nobody saw."""
    values = serve_config()["applications"][0]["args"]
    model = AppConfig
    for name in section:
        values = values[name]
        model = model.model_fields[name].annotation
    assert set(values) == set(model.model_fields)
    defaults = model()
    for name, value in values.items():
        default = getattr(defaults, name)
        if not isinstance(default, BaseModel) and name not in SHIPPED_OVERRIDES.get(section, ()):
            assert value == default, f"{'.'.join(section + (name,))}: yaml {value!r}, code default {default!r}"


def test_app_config_rejects_unknown_names_with_the_field():
    with pytest.raises(ValidationError, match="engine.checkpoints"):
        AppConfig.model_validate({"engine": {"checkpoints": "x"}})
    with pytest.raises(ValidationError, match=r"engine.preset\n  Input should be 'tiny'"):
        AppConfig.model_validate({"engine": {"preset": "huge"}})
    with pytest.raises(ValidationError, match="engine.checkpoint_layout"):
        AppConfig.model_validate({"engine": {"checkpoint_layout": "safetensors"}})
    with pytest.raises(ValidationError, match="min_replicas=3 exceeds max_replicas=2"):
        AppConfig.model_validate({"worker": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}})


def test_a_jobs_section_without_state_dir_keeps_the_documented_default(tmp_path):
    """README: `jobs.state_dir` defaults to `state`, next to engine.checkpoint_root, whether or not the yaml has a
    `jobs:` section (one that set only `concurrency` put the job database under ~/.local/state/ditserve)."""
    for args in ({}, {"jobs": {}}, {"jobs": {"concurrency": 2}}):
        jobs = resolve_jobs_config(AppConfig.model_validate(args).jobs, str(tmp_path / "checkpoints"))
        assert jobs.state_dir == str(tmp_path / "state"), args


@pytest.mark.parametrize(("geometry", "message"), [
    ({"min_seconds": 10, "max_seconds": 5}, "min_seconds=10 exceeds max_seconds=5"),
    ({"short_edge": 100}, "short_edge=100 must be a multiple of 32 px"),
    ({"short_edge": 768, "max_pixels": 512 * 512}, "short_edge=768 needs max_pixels >= 589824"),
])
def test_a_geometry_no_request_can_meet_is_refused(geometry, message):
    """Each of these passed validation and then refused every request with a 422."""
    with pytest.raises(ValidationError, match=rf"engine.geometry\n.*{message}"):
        AppConfig.model_validate({"engine": {"geometry": geometry}})
    # 5.875 s is one clip length (141 = 17 x 8 + 5 frames at 24 fps); 5 s snaps up to 124 frames (5.17 s)
    AppConfig.model_validate({"engine": {"geometry": {"short_edge": 512, "max_pixels": 512 * 512,
                                                      "min_seconds": 5.875, "max_seconds": 5.875}}})


def test_resident_adaln_with_the_fp32_projection_is_refused_naming_both_fields():
    """The engine's resident mode runs diffusers' own forward (the bf16 projection): an fp32 projection asked for
    there was silently ignored."""
    with pytest.raises(ValidationError, match=r"adaln.projection: fp32 .*adaln.mode: resident"):
        AppConfig.model_validate({"engine": {"adaln": {"mode": "resident", "projection": "fp32"}}})
    for mode, projection in (("online", "fp32"), ("resident", "match"), ("online", "match")):
        AppConfig.model_validate({"engine": {"adaln": {"mode": mode, "projection": projection}}})


@pytest.mark.parametrize("section", ["worker", "text_encoder", "decoder"])
@pytest.mark.parametrize(("num_gpus", "accepted"), [(0, True), (0.2, True), (1, True), (2, True), (1.5, False),
                                                    (2.25, False)])
def test_a_replica_takes_a_share_of_one_gpu_or_whole_gpus(section, num_gpus, accepted):
    """1.5 GPUs (one device and half of another) is no placement a replica can use: refused, naming the key."""
    args = {section: {"num_gpus": num_gpus}}
    if accepted:
        assert getattr(AppConfig.model_validate(args), section).num_gpus == num_gpus
    else:
        with pytest.raises(ValidationError, match=rf"{section}.num_gpus\n.*a share of one GPU \(< 1\) or whole GPUs"):
            AppConfig.model_validate(args)


@pytest.mark.parametrize(("url", "accepted"), [("sqlite:////srv/jobs.db", True), ("postgresql://u@h:5432/db", True),
                                             ("postgres://u@h/db", True), ("mysql://u@h/db", False),
                                             ("/srv/jobs.db", False), ("sqlite://jobs.db", False)])
def test_the_job_database_url_is_checked_when_the_app_is_built(url, accepted):
    """An unsupported database_url passed the build, then every ingress replica failed to start."""
    if accepted:
        assert AppConfig.model_validate({"jobs": {"database_url": url}}).jobs.database_url == url
    else:
        with pytest.raises(ValidationError, match=r"jobs.database_url\n.*expected sqlite:///PATH or postgresql://"):
            AppConfig.model_validate({"jobs": {"database_url": url}})


def test_worker_takes_one_gpu_per_replica_on_a_gpu_cluster_and_none_on_cpu():
    cpu = worker_deployment_options(WorkerOptions(), num_gpus_in_cluster=0)
    assert cpu["ray_actor_options"] == {"num_gpus": 0.0, "num_cpus": 1.0}
    assert cpu["autoscaling_config"]["max_replicas"] == 1
    gpu = worker_deployment_options(WorkerOptions(), num_gpus_in_cluster=8)
    assert gpu["ray_actor_options"]["num_gpus"] == 1.0
    assert gpu["autoscaling_config"] == {"min_replicas": 8, "max_replicas": 8, "target_ongoing_requests": 1.0}
    fixed = worker_deployment_options(WorkerOptions(num_replicas=2, num_gpus=0.5), num_gpus_in_cluster=1)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"]["num_gpus"] == 0.5


@pytest.mark.parametrize(
    ("gpus_in_cluster", "worker", "expect_min", "expect_max"),
    [
        (0, {}, 1, 1),                                                      # CPU: one replica
        (1, {}, 1, 1),
        (2, {}, 2, 2),                                                      # every GPU serves from the start
        (8, {"num_gpus": 2}, 4, 4),                                         # GPUs / GPUs per replica
        (7, {"num_gpus": 2}, 3, 3),                                         # a partial replica does not count
        (0.5, {}, 1, 1),                                                    # fewer GPUs than a replica: still one
        (8, {"autoscaling": {"max_replicas": 3}}, 3, 3),                    # an explicit ceiling wins
        (8, {"autoscaling": {"min_replicas": 2}}, 2, 8),                    # an explicit floor is kept
        (8, {"autoscaling": {"min_replicas": 0, "max_replicas": 4}}, 0, 4),  # scale to zero stays possible
        (2, {"autoscaling": {"min_replicas": 5}}, 5, 5),                    # a floor above the GPUs raises the ceiling
    ],
)
def test_default_replicas_serve_every_gpu_from_the_start(gpus_in_cluster, worker, expect_min, expect_max):
    options = worker_deployment_options(WorkerOptions.model_validate(worker), num_gpus_in_cluster=gpus_in_cluster)
    autoscaling = options["autoscaling_config"]
    assert (autoscaling["min_replicas"], autoscaling["max_replicas"]) == (expect_min, expect_max)


@pytest.mark.parametrize(("num_gpus", "gpus_in_cluster", "replicas"), [
    (0.6, 2, 2), (0.5, 2, 4), (0.25, 1, 4), (0.2, 1, 5), (0.2, 3, 15), (0.1, 1, 10), (1 / 3, 1, 3), (0.3, 1, 3),
])
def test_fractional_replicas_fill_each_device(num_gpus, gpus_in_cluster, replicas):
    """A replica of a device's fraction f: floor(1 / f) of them share each device (five of 0.2, as documented)."""
    options = worker_deployment_options(WorkerOptions(num_gpus=num_gpus), num_gpus_in_cluster=gpus_in_cluster)
    assert options["autoscaling_config"]["min_replicas"] == replicas == options["autoscaling_config"]["max_replicas"]


def test_shipped_config_leaves_the_replica_count_to_the_gpu_count():
    (app,) = serve_config()["applications"]
    worker = AppConfig.model_validate(app["args"]).worker
    assert worker.autoscaling.min_replicas is None and worker.autoscaling.max_replicas is None
    assert worker_deployment_options(worker, num_gpus_in_cluster=4)["autoscaling_config"]["min_replicas"] == 4


def sp_app_config(sp: int, **worker) -> AppConfig:
    """The shipped serve_config.yaml's args with `engine.parallel.sp` set, as a user edits the file."""
    (app,) = serve_config()["applications"]
    args = app["args"]
    args["engine"]["parallel"]["sp"] = sp
    args["worker"].update(worker)
    return AppConfig.model_validate(args)


@pytest.mark.parametrize(("gpus", "sp", "replicas"), [(0, 2, 1), (2, 2, 1), (3, 2, 1), (8, 2, 4)])
def test_sp_replica_reserves_one_bundle_per_rank_on_one_node_from_the_shipped_config(monkeypatch, gpus, sp, replicas):
    """engine.parallel.sp: N in serve_config.yaml: the replica is a CPU coordinator in bundle 0 of its own STRICT_PACK
    placement group, one bundle (a CPU and, on a GPU cluster, a GPU) per rank actor, and as many replicas as the
    cluster's GPUs hold whole (one on CPU: gloo ranks)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)  # the node the builder checks the degree against
    config = sp_app_config(sp)
    options = worker_deployment_options(config.worker, gpus, config.engine, split=config.stages == "split")
    rank = {"CPU": 1.0, "GPU": 1.0} if gpus else {"CPU": 1.0}
    assert options["ray_actor_options"] == {"num_gpus": 0, "num_cpus": config.worker.num_cpus}
    assert options["placement_group_bundles"] == [{"CPU": config.worker.num_cpus}] + [rank] * sp
    assert options["placement_group_strategy"] == "STRICT_PACK"
    autoscaling = options["autoscaling_config"]
    assert (autoscaling["min_replicas"], autoscaling["max_replicas"]) == (replicas, replicas)


def test_sp_replica_keeps_the_workers_custom_resources_in_the_replicas_bundle(monkeypatch):
    """A node tag in worker.resources pins the SP replica too: the coordinator asks for it and its bundle holds it
    (STRICT_PACK puts the ranks' bundles on the same node)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = sp_app_config(2, resources={"h200": 0.01})
    options = worker_deployment_options(config.worker, 2, config.engine)
    assert options["ray_actor_options"]["resources"] == {"h200": 0.01}
    assert options["placement_group_bundles"][0] == {"CPU": 1.0, "h200": 0.01}


@pytest.mark.parametrize("field", ["timeout_s", "load_timeout_s", "request_timeout_s"])
@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan")])
def test_parallel_bounds_must_be_positive_and_finite(field, value):
    """Every wait on a rank is bounded by these; YAML's .inf would leave it unbounded (or, for timeout_s, fail every
    replica start in the rank's timedelta)."""
    args = serve_config()["applications"][0]["args"]
    args["engine"]["parallel"] = {**args["engine"]["parallel"], "sp": 2, field: value}
    with pytest.raises(ValidationError, match=rf"engine.parallel.{field}\n.*(greater than 0|finite number)"):
        AppConfig.model_validate(args)


def float_settings(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The yaml path of every float setting under `model` (nested sections included, null-able ones too)."""
    paths = []
    for name, field in model.model_fields.items():
        union = typing.get_origin(field.annotation) in (typing.Union, types.UnionType)
        kinds = typing.get_args(field.annotation) if union else (field.annotation,)
        sections = [kind for kind in kinds if isinstance(kind, type) and issubclass(kind, BaseModel)]
        if sections:
            paths += float_settings(sections[0], prefix + (name,))
        elif float in kinds:
            paths.append(prefix + (name,))
    return paths


@pytest.mark.parametrize("path", float_settings(AppConfig), ids=".".join)
def test_every_float_setting_refuses_infinity(path):
    """YAML's .inf passed every `ge=0` / `gt=0` bound: num_gpus .inf failed the build in Ray with an OverflowError
    naming no setting, host_cache_gb .inf every replica's start, a timeout of .inf waited for good."""
    args: dict = {}
    section = args
    for name in path[:-1]:
        section = section.setdefault(name, {})
    section[path[-1]] = float("inf")
    with pytest.raises(ValidationError, match=rf"{re.escape('.'.join(path))}\n.*finite number"):
        AppConfig.model_validate(args)


def config_sections(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The yaml path of every section (nested model) of `model`, itself included."""
    paths = [prefix]
    for name, field in model.model_fields.items():
        union = typing.get_origin(field.annotation) in (typing.Union, types.UnionType)
        kinds = typing.get_args(field.annotation) if union else (field.annotation,)
        paths += [path for kind in kinds if isinstance(kind, type) and issubclass(kind, BaseModel)
                  for path in config_sections(kind, prefix + (name,))]
    return paths


@pytest.mark.parametrize("path", config_sections(AppConfig), ids=lambda path: ".".join(path) or "args")
def test_a_misspelled_key_is_refused_in_every_section(path):
    args: dict = {}
    section = args
    for name in path:
        section = section.setdefault(name, {})
    section["num_gpu"] = 1
    with pytest.raises(ValidationError, match=rf"{re.escape('.'.join(path + ('num_gpu',)))}\n.*Extra inputs"):
        AppConfig.model_validate(args)


def test_float_settings_reach_every_section():
    sections = {path[:-1] for path in float_settings(AppConfig)}
    assert {("worker",), ("worker", "autoscaling"), ("text_encoder",), ("http",), ("admin",), ("jobs",), ("videos",),
            ("videos", "high_quality"), ("engine", "adaln"), ("engine", "pool"), ("engine", "offload"),
            ("engine", "text_encoder"), ("engine", "geometry"), ("engine", "parallel"),
            ("engine", "cache_dit")} <= sections


@pytest.mark.parametrize(("gpus", "num_gpus"), [(2, 1), (2, 0), (0, 2)])
def test_sp_replica_refuses_a_gpu_count_other_than_one_per_rank(monkeypatch, gpus, num_gpus):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    config = sp_app_config(2, num_gpus=num_gpus)
    with pytest.raises(ValueError, match=rf"worker.num_gpus={num_gpus} conflicts with engine.parallel.sp=2"):
        worker_deployment_options(config.worker, gpus, config.engine)
    matching = sp_app_config(2, num_gpus=2 if gpus else 0)  # what the replica takes anyway is accepted
    assert worker_deployment_options(matching.worker, gpus, matching.engine)["ray_actor_options"]["num_gpus"] == 0


@pytest.mark.parametrize(("gpus", "text_encoder_tp", "refused"), [(2, True, True), (2, False, False), (0, True, False)])
def test_sp_replica_with_a_split_text_encoder_on_the_cpu_is_refused_at_build(monkeypatch, gpus, text_encoder_tp,
                                                                              refused):
    """text_encoder_tp runs the encoder's shards on the ranks' GPUs: text_encoder.device: cpu beside it passed the
    build, then every rank refused to start and Serve restarted the replica over and over."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    config = sp_app_config(2)
    engine = config.engine.model_copy(update={
        "text_encoder": config.engine.text_encoder.model_copy(update={"device": "cpu"}),
        "parallel": config.engine.parallel.model_copy(update={"text_encoder_tp": text_encoder_tp})})
    if refused:
        with pytest.raises(ValueError, match="text_encoder_tp splits the text encoder over the ranks' GPUs"):
            worker_deployment_options(config.worker, gpus, engine)
    else:
        worker_deployment_options(config.worker, gpus, engine)


def test_sp_replica_without_cpus_or_resources_is_refused_naming_the_setting(monkeypatch):
    """The replica's bundle of its placement group holds what the replica asks; an empty one failed the build in
    Ray ("Bundles cannot be an empty dictionary") naming no setting."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = sp_app_config(2, num_cpus=0)
    with pytest.raises(ValueError, match="worker.num_cpus=0 with engine.parallel.sp=2"):
        worker_deployment_options(config.worker, 2, config.engine)
    tagged = sp_app_config(2, num_cpus=0, resources={"h200": 0.01})  # a node tag fills the bundle
    assert worker_deployment_options(tagged.worker, 2, tagged.engine)["placement_group_bundles"][0] == {
        "CPU": 0.0, "h200": 0.01}


def test_replicas_drain_briefly_so_serve_run_stops_within_seconds():
    # Serve's defaults (20 s per deployment, polled every 2 s) kept Ctrl-C on `serve run` waiting ~26 s under load.
    options = worker_deployment_options(WorkerOptions(), num_gpus_in_cluster=0)
    assert (options["graceful_shutdown_timeout_s"], options["graceful_shutdown_wait_loop_s"]) == (5.0, 0.2)
    custom = worker_deployment_options(WorkerOptions(graceful_shutdown_timeout_s=60), num_gpus_in_cluster=0)
    assert custom["graceful_shutdown_timeout_s"] == 60
    assert AppConfig().http.graceful_shutdown_timeout_s == 2.0
    with pytest.raises(ValidationError, match="graceful_shutdown_timeout_s"):
        AppConfig.model_validate({"worker": {"graceful_shutdown_timeout_s": -1}})


def test_worker_is_routed_by_schedule_affinity_unless_asked_otherwise():
    routed = worker_deployment_options(WorkerOptions(load_factor=1.5), num_gpus_in_cluster=0)
    assert routed["request_router_config"].request_router_class == "deployments.routing.router.ScheduleAffinityRouter"
    assert routed["request_router_config"].request_router_kwargs == {"load_factor": 1.5, "hold_factor": 3.0}
    assert routed["request_router_config"].request_routing_stats_period_s == 1.0
    assert "request_router_config" not in worker_deployment_options(WorkerOptions(router="default"), 0)


def test_relative_checkpoint_paths_are_pinned_to_the_builder_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = resolve_engine_config(AppConfig.model_validate({"engine": {"checkpoint": "ckpt/a"}}).engine)
    assert engine.checkpoint == str(tmp_path / "ckpt/a") and engine.checkpoint_root == str(tmp_path / "checkpoints")
    assert resolve_engine_config(AppConfig().engine).checkpoint == ""


def test_a_home_relative_checkpoint_root_is_expanded_like_every_other_path(tmp_path, monkeypatch):
    """`~` in checkpoint_root made a directory literally named `~` in the builder's cwd (checkpoint, weight_roots
    and jobs.state_dir expand it)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    engine = resolve_engine_config(AppConfig.model_validate({"engine": {"checkpoint_root": "~/ckpts"}}).engine)
    assert engine.checkpoint_root == str(tmp_path / "home" / "ckpts")


def test_response_latents_round_trip_through_safetensors_and_without_video_the_preview_is_latent():
    # 96x64 px for 5 s: video latents [24, 37, 4, 6], audio rows [414, 32]
    video, audio = torch.randn(24, 37, 4, 6), torch.randn(414, 32)
    result = GenerationResult(video=video, audio=audio, seed=1, model="m",
                              timings=GenerationTimings(encode_s=0.1, total_s=0.2), stats=STATS)
    response = GenerationResponse.from_result(result, request_id="gen-1", return_latents=True)
    latents = decode_latents(response.latents)
    assert torch.equal(latents["video"], video) and torch.equal(latents["audio"], audio)
    assert response.video_shape == [24, 37, 4, 6] and response.audio_shape == [414, 32]
    assert response.video_mp4 is None
    assert response.timings.encode_s == 0.1 and response.timings.denoise_s == response.timings.decode_s == 0.0
    assert response.stats == {"steps": 2, "forwards": 1, "frames": 124, "tokens": 1000, "text_tokens": 8,
                              "adaln_mode": "resident", "linears": "bf16", "schedule_key": "t2va:2", "adaln": {}}
    image = Image.open(io.BytesIO(base64.b64decode(response.preview_png)))
    assert image.size == (126, 84) and image.mode == "RGB"  # latent channels 0-2, nearest upscale x21 (128 // 6)
    assert GenerationResponse.from_result(result, request_id="gen-1", return_latents=False).latents is None


def test_response_with_video_carries_the_mp4_and_the_first_frame_as_preview():
    frame = np.arange(64 * 96 * 3, dtype=np.uint8).reshape(64, 96, 3)
    result = GenerationResult(video=torch.randn(24, 37, 4, 6), audio=torch.randn(414, 32), seed=1, model="m",
                              mp4=b"\x00\x00\x00\x18ftypmp42", thumbnail_png=thumbnail_png(frame),
                              timings=GenerationTimings(decode_s=0.5, mux_s=0.25, total_s=1.0), stats=STATS)
    response = GenerationResponse.from_result(result, request_id="gen-1", return_latents=False)
    assert base64.b64decode(response.video_mp4) == result.mp4
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(base64.b64decode(response.preview_png)))), frame)
    assert (response.timings.decode_s, response.timings.mux_s, response.timings.total_s) == (0.5, 0.25, 1.0)


def test_preview_of_a_constant_frame_is_black_not_nan():
    image = Image.open(io.BytesIO(base64.b64decode(preview_png(torch.ones(2, 1, 4, 4)))))
    assert image.size == (128, 128) and set(image.getdata()) == {(0, 0, 0)}


def bound_deployments(app) -> dict:
    """name -> Deployment of every deployment an Application binds (the ingress and those in its init args)."""
    from ray.serve.deployment import Application

    ingress = app._bound_deployment
    found = {ingress.name: ingress}
    for arg in ingress.init_args:
        for item in arg if isinstance(arg, list) else [arg]:  # the Workers of the other partitions: a list
            if isinstance(item, Application):
                found.update(bound_deployments(item))
    return found


@pytest.mark.parametrize("stages", ["split", "fused"])
def test_an_app_of_both_partitions_binds_a_worker_each_behind_one_ingress(stages):
    """partitions: [fl2va, ref2va]: `Worker` (FL2VA) and `Worker-ref2va` (Ref2VA), each its engine's partition and
    the worker options (its own router); one TextEncoder prepares both partitions' tasks and one Decoder decodes
    for both, even with stages: fused (fused, each Worker would load its own text encoder and VAEs)."""
    from deployments.app import build_application
    from tests.fake_engine import FakeEngine

    config = AppConfig.model_validate({"stages": stages, "partitions": ["fl2va", "ref2va"]})
    deployments = bound_deployments(build_application(config, FakeEngine))
    assert set(deployments) == {"Ingress", "Worker", "Worker-ref2va", "TextEncoder", "Decoder"}
    for name, partition in (("Worker", "fl2va"), ("Worker-ref2va", "ref2va")):
        worker = deployments[name]
        assert worker.init_args[0]["partition"] == partition
        assert worker._deployment_config.request_router_config.request_router_class.endswith("ScheduleAffinityRouter")
    ingress_args = deployments["Ingress"].init_args
    assert ingress_args[-2] == ["fl2va", "ref2va"] and len(ingress_args[-1]) == 1  # the partitions, more_workers
    assert deployments["TextEncoder"].init_args[1] == ["fl2va", "ref2va"]
    assert deployments["TextEncoder"].init_args[0]["partition"] == "fl2va"  # the first's checkpoint components


@pytest.mark.parametrize("stages, names", [("split", {"Ingress", "Worker", "TextEncoder", "Decoder"}),
                                           ("fused", {"Ingress", "Worker"})])
def test_ingress_keeps_zero_cpus_beside_its_http_resources(stages, names):
    """options() replaces ray_actor_options whole: the ingress restates its decorator's num_cpus 0 when
    http.resources pins it to a node (it took a whole CPU there before)."""
    from deployments.app import build_application
    from tests.fake_engine import FakeEngine

    config = AppConfig.model_validate({"stages": stages, "http": {"resources": {"head": 0.01}}})
    deployments = bound_deployments(build_application(config, FakeEngine))
    assert set(deployments) == names
    assert deployments["Ingress"].ray_actor_options["num_cpus"] == 0
    assert deployments["Ingress"].ray_actor_options["resources"] == {"head": 0.01}
    assert deployments["Worker"].ray_actor_options["num_cpus"] == 1.0


@pytest.mark.parametrize(("engine", "stages", "expected"), [
    ({}, "split", {"Worker": 0.6, "TextEncoder": 0.2, "Decoder": 0.2}),
    ({"device": "cpu"}, "split", {"Worker": 0, "TextEncoder": 0, "Decoder": 0}),
    ({"device": "cpu", "text_encoder": {"device": "cuda"}}, "split", {"Worker": 0, "TextEncoder": 0.2, "Decoder": 0}),
    ({"text_encoder": {"device": "cpu"}, "decode": {"device": "cpu"}}, "split",
     {"Worker": 0.6, "TextEncoder": 0, "Decoder": 0}),                   # the yaml's "keep the encoder off the GPU"
    ({}, "fused", {"Worker": 1.0}),
    ({"device": "cpu"}, "fused", {"Worker": 0}),
    ({"device": "cpu", "decode": {"device": "auto"}}, "fused", {"Worker": 1.0}),  # its VAEs may use the GPU
])
def test_a_stage_pinned_to_the_cpu_takes_no_gpu_by_default(monkeypatch, engine, stages, expected):
    """num_gpus null follows the stage's device, as the sequence-parallel ranks' GPUs do: engine.device: cpu on a
    GPU node held a GPU per worker replica it never used (and capped the replicas at the GPU count)."""
    from deployments import app
    from tests.fake_engine import FakeEngine

    monkeypatch.setattr(app, "cluster_num_gpus", lambda: 2.0)
    deployments = bound_deployments(app.build_application(
        AppConfig.model_validate({"engine": engine, "stages": stages}), FakeEngine))
    assert {name: deployments[name].ray_actor_options["num_gpus"] for name in expected} == expected


@pytest.mark.parametrize(("num_gpus", "gpus_in_cluster", "replicas"), [
    (None, 8, 8), (0.5, 8, 8), (1, 8, 8), (2, 8, 4), (4, 8, 2), (2, 3, 1), (None, 0, 1),
])
def test_stage_replicas_default_to_one_per_gpu_or_as_many_as_the_gpus_hold(num_gpus, gpus_in_cluster, replicas):
    """A stage of 2 GPUs per replica defaulted to one replica per GPU: 8 replicas wanting 16 of 8 GPUs."""
    from deployments.app import stage_deployment_options
    from deployments.schemas import StageOptions

    options = stage_deployment_options(StageOptions(num_gpus=num_gpus), gpus_in_cluster)
    assert options["autoscaling_config"]["max_replicas"] == replicas == options["autoscaling_config"]["min_replicas"]


@pytest.mark.parametrize(("gpus", "args", "fits"), [
    (0, {}, True), (1, {}, True), (2, {}, True), (8, {}, True),              # the shipped shares: 0.6 + 0.2 + 0.2
    (1, {"worker": {"num_gpus": 1}}, False),                                  # a whole GPU per worker: no room
    (2, {"worker": {"num_gpus": 1, "autoscaling": {"min_replicas": 1}}}, True),  # ... unless a device is left
    (1, {"text_encoder": {"num_gpus": 0.5}}, False),                          # 0.6 + 0.5 > 1
    (2, {"text_encoder": {"num_gpus": 0.5}}, False),                          # 0.4 left on each device
    (1, {"worker": {"num_gpus": 0.4}, "text_encoder": {"num_gpus": 0.2}}, False),  # two workers fill it
    (1, {"worker": {"num_gpus": 0.5, "num_replicas": 1}, "text_encoder": {"num_gpus": 0.3}}, True),
    (1, {"stages": "fused", "worker": {"num_gpus": 1}}, True),                # no stage beside the worker
    (0, {"worker": {"num_gpus": 1}, "text_encoder": {"num_gpus": 0.5}}, True),  # GPU nodes come later
])
def test_split_stages_whose_minimum_replicas_do_not_fit_the_gpus_are_refused(monkeypatch, gpus, args, fits):
    """A TextEncoder or Decoder replica that no device has room for stayed pending: `serve run` hung in DEPLOYING."""
    from deployments import app
    from tests.fake_engine import FakeEngine

    monkeypatch.setattr(app, "cluster_num_gpus", lambda: float(gpus))
    config = AppConfig.model_validate(args)
    if fits:
        app.build_application(config, FakeEngine)
    else:
        with pytest.raises(ValueError, match=rf"do not fit the cluster's {gpus} GPUs.*worker.num_gpus"):
            app.build_application(config, FakeEngine)


@pytest.mark.parametrize("stages, http_s, worker_s, decoder_s, ingress_s", [
    ("split", 2.0, 5.0, 5.0, 7.0),  # the shipped defaults: the ingress outlives the stages by STAGE_STOP_REPORTED_S
    ("fused", 2.0, 5.0, 5.0, 7.0),
    ("split", 1.0, 1.0, 1.0, 3.0),
    ("fused", 1.0, 1.0, 9.0, 3.0),  # no Decoder bound: its setting does not count
    ("split", 2.0, 1.0, 8.0, 10.0),  # the slowest stage counts
    ("split", 30.0, 5.0, 5.0, 30.0),  # a longer http grace period stays
])
def test_the_ingress_drains_past_every_stage_so_a_stopping_app_answers_its_requests(stages, http_s, worker_s,
                                                                                    decoder_s, ingress_s):
    from deployments.app import build_application
    from tests.fake_engine import FakeEngine

    config = AppConfig.model_validate({"stages": stages, "http": {"graceful_shutdown_timeout_s": http_s},
                                       "worker": {"graceful_shutdown_timeout_s": worker_s},
                                       "text_encoder": {"graceful_shutdown_timeout_s": 1.0},
                                       "decoder": {"graceful_shutdown_timeout_s": decoder_s}})
    deployments = bound_deployments(build_application(config, FakeEngine))
    assert deployments["Ingress"]._deployment_config.graceful_shutdown_timeout_s == ingress_s
    assert deployments["Worker"]._deployment_config.graceful_shutdown_timeout_s == worker_s


def test_each_partition_serves_its_own_adapters_and_warms_only_those():
    engine = EngineConfig(adapters={"turbo": {"steps": 5}, "ref-style": {"partition": "ref2va"}},
                          compile={"warmup": [{"width": 64, "height": 32, "seconds": 5, "adapters": ["turbo"]},
                                              {"width": 64, "height": 32, "seconds": 5, "adapters": ["ref-style"]},
                                              {"width": 64, "height": 32, "seconds": 5}]})
    fl2va, ref2va = (engine.model_copy(update={"partition": partition}) for partition in ("fl2va", "ref2va"))
    assert list(fl2va.served_adapters()) == ["turbo"] and list(ref2va.served_adapters()) == ["ref-style"]
    assert [canvas.adapters for canvas in fl2va.served_warmup()] == [("turbo",), ()]
    assert [canvas.adapters for canvas in ref2va.served_warmup()] == [("ref-style",), ()]
    AppConfig.model_validate({"partitions": ["fl2va", "ref2va"], "engine": engine.model_dump()})  # both served
