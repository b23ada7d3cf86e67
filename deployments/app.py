"""The application builder: `serve run serve_config.yaml` calls `build_app(args)`.

This is the only place deployments are bound. The same config runs on a CPU laptop and on a GPU node:
the worker asks for one GPU per replica when the cluster has GPUs at build time, else for none.

`stages: split` (the default) binds three stage deployments, TextEncoder -> Worker (denoiser) -> Decoder,
each with its own resources and autoscaling; on a GPU cluster they share each device by fractions
(`schemas.SPLIT_WORKER_GPUS`, `SPLIT_STAGE_GPUS`). `stages: fused`, and any sequence-parallel engine, bind
the one Worker that runs every stage. Either way one Worker per served partition (`AppConfig.partitions`:
`Worker`, `Worker-ref2va`), each with the worker options; a split app's TextEncoder and Decoder serve them all, so
an app of more than one partition binds split even with `stages: fused` (`stages_split`): the partitions share the
text encoder and the VAEs, loaded once. Sequence parallel stays fused: each partition's replica holds its own.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import ray
import torch
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deployments.ingress import Ingress
from deployments.partitions import worker_deployment_name
from deployments.routing.router import ScheduleAffinityRouter
from deployments.schemas import (
    SPLIT_STAGE_GPUS, SPLIT_WORKER_GPUS, AppConfig, AutoscalingOptions, StageOptions, WorkerOptions,
)
from deployments.stages import Decoder, TextEncoder
from deployments.worker import EngineFactory, Worker, denoiser_engine_factory
from engine.config import EngineConfig
from jobs.config import JobsConfig

logger = logging.getLogger("ray.serve")

#: How often a stopping replica checks whether its requests are done (Serve's default: 2 s).
SHUTDOWN_POLL_S = 0.2
#: From a stopping stage replica's grace period to its callers hearing that it is gone (the controller's kill,
#: Ray's report of the dead actor): the ingress drains this much longer than the stages.
STAGE_STOP_REPORTED_S = 2.0


def cluster_num_gpus() -> float:
    """GPUs in the Ray cluster (or on this machine when Ray is not up yet: `serve.run` starts it here)."""
    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0.0))
    return float(torch.cuda.device_count())


def on_cpu(engine: EngineConfig, *devices: str) -> bool:
    """Whether a deployment whose models run on `devices` ("engine": engine.device) needs no GPU: a null
    num_gpus then asks for none, as a sequence-parallel rank pinned to the CPU does."""
    return all((engine.device if device == "engine" else device) == "cpu" for device in devices)


def worker_deployment_options(options: WorkerOptions, num_gpus_in_cluster: float,
                              engine: EngineConfig | None = None, split: bool = False) -> dict[str, Any]:
    default_gpus = SPLIT_WORKER_GPUS if split else 1.0
    if engine is not None:  # the denoiser, and unless split, the text encoder and the VAEs
        devices = (engine.device,) if split else (engine.device, engine.text_encoder.device, engine.decode.device)
        default_gpus = 0.0 if on_cpu(engine, *devices) else default_gpus
    num_gpus = options.num_gpus if options.num_gpus is not None else (default_gpus if num_gpus_in_cluster > 0 else 0.0)
    deployment: dict[str, Any] = {
        "ray_actor_options": {"num_gpus": num_gpus, "num_cpus": options.num_cpus,
                              **({"resources": dict(options.resources)} if options.resources else {})},
        "max_ongoing_requests": options.max_ongoing_requests,
        **shutdown_options(options.graceful_shutdown_timeout_s),
    }
    sp = engine.parallel.sp if engine is not None else 1
    if sp > 1:
        # The replica is a coordinator (CPU only) owning `sp` GPU worker actors, one per device, in its own
        # placement group (STRICT_PACK: one node); a bad degree or more GPUs than a node has fails the build.
        from actors.gpu_worker import largest_node_num_gpus, rank_num_gpus, replica_bundles
        from parallel.config_check import check_parallel_config

        gpus_per_rank = rank_num_gpus(engine, num_gpus_in_cluster)
        if options.num_gpus is not None and options.num_gpus != sp * gpus_per_rank:
            raise ValueError(f"worker.num_gpus={options.num_gpus:g} conflicts with engine.parallel.sp={sp}: a sequence-"
                             f"parallel replica takes one GPU per rank actor ({sp * gpus_per_rank} here); leave "
                             "worker.num_gpus null (engine.device: cpu runs the ranks on CPU)")
        if gpus_per_rank and engine.parallel.text_encoder_tp and engine.text_encoder.device == "cpu":
            raise ValueError("engine.parallel.text_encoder_tp splits the text encoder over the ranks' GPUs; "
                             "text_encoder.device: cpu would put it on the CPU: use text_encoder.device: engine, or "
                             "text_encoder_tp: false")
        node_gpus = (largest_node_num_gpus() if ray.is_initialized() else torch.cuda.device_count()) if gpus_per_rank else 0
        check_parallel_config(engine, node_gpus)
        deployment["ray_actor_options"] = {"num_gpus": 0, "num_cpus": options.num_cpus,
                                           **({"resources": dict(options.resources)} if options.resources else {})}
        if options.num_cpus <= 0 and not any(amount > 0 for amount in options.resources.values()):
            raise ValueError(f"worker.num_cpus=0 with engine.parallel.sp={sp}: the replica's bundle of its placement "
                             "group would be empty (Ray refuses one); give it a CPU share or a worker.resources tag")
        bundles = replica_bundles(sp, gpus_per_rank, options.num_cpus)
        bundles[0].update(options.resources)  # Serve puts the replica in bundle 0: it must hold what the replica asks
        deployment["placement_group_bundles"] = bundles
        deployment["placement_group_strategy"] = "STRICT_PACK"
        num_gpus = float(sp * gpus_per_rank)
    if options.router == "schedule_affinity":
        deployment["request_router_config"] = RequestRouterConfig(
            request_router_class=ScheduleAffinityRouter,
            request_router_kwargs={"load_factor": options.load_factor, "hold_factor": options.hold_factor},
            request_routing_stats_period_s=options.routing_stats_period_s,
        )
    if options.num_replicas is not None:
        deployment["num_replicas"] = options.num_replicas
    else:
        deployment["autoscaling_config"] = autoscaling_config(
            options.autoscaling, replicas_fit(num_gpus, num_gpus_in_cluster))
    return deployment


def autoscaling_config(options: AutoscalingOptions, fit: int) -> dict[str, Any]:
    """Serve's autoscaling_config with the nulls resolved to `fit` (how many replicas the cluster's GPUs hold at
    build time): both bounds, so a GPU node serves every GPU from the start instead of waiting for an upscale
    decision and a checkpoint load under load; an explicit max_replicas below it wins; 1 on CPU."""
    autoscaling = options.model_dump()
    fit = max(1, fit)
    if autoscaling["min_replicas"] is None:
        autoscaling["min_replicas"] = min(fit, autoscaling["max_replicas"] or fit)
    if autoscaling["max_replicas"] is None:
        autoscaling["max_replicas"] = max(fit, autoscaling["min_replicas"])
    return autoscaling


def replicas_fit(num_gpus: float, num_gpus_in_cluster: float) -> int:
    """Replicas of `num_gpus` each the cluster's devices hold: a fraction shares one device (0.6: one per device,
    0.2: five), never spans two. 1 without GPUs."""
    if num_gpus <= 0:
        return 1
    if num_gpus >= 1:
        return int(num_gpus_in_cluster // num_gpus)
    return int(1 / num_gpus + 1e-9) * int(num_gpus_in_cluster)  # 1 // 0.2 is 4.0 in floats


def stage_deployment_options(options: StageOptions, num_gpus_in_cluster: float, cpu_only: bool = False
                             ) -> dict[str, Any]:
    """Ray Serve options of a TextEncoder or Decoder deployment (stages: split); `cpu_only`: its device is the CPU."""
    num_gpus = options.num_gpus if options.num_gpus is not None else (
        SPLIT_STAGE_GPUS if num_gpus_in_cluster > 0 and not cpu_only else 0.0)
    deployment: dict[str, Any] = {
        "ray_actor_options": {"num_gpus": num_gpus, "num_cpus": options.num_cpus},
        "max_ongoing_requests": options.max_ongoing_requests,
        **shutdown_options(options.graceful_shutdown_timeout_s),
    }
    if options.num_replicas is not None:
        deployment["num_replicas"] = options.num_replicas
    else:  # one per device (beside each worker), or as many as the devices hold of a multi-GPU stage; 1 without GPUs
        deployment["autoscaling_config"] = autoscaling_config(
            options.autoscaling, min(int(num_gpus_in_cluster), replicas_fit(num_gpus, num_gpus_in_cluster))
            if num_gpus > 0 else 1)
    return deployment


def check_split_fits(stage_options: dict[str, dict[str, Any]], num_gpus_in_cluster: float) -> None:
    """Refuse split stages whose minimum replicas the cluster's devices cannot hold at build time (a replica no
    device has room for stays pending, and `serve run` waits in DEPLOYING for good). `stage_options`: Serve options
    by config section. First fit, largest share first; a share of 1 or more takes whole free devices. No GPUs at
    build time: nothing to check (a cluster that adds GPU nodes on demand sets the shares explicitly)."""
    if num_gpus_in_cluster <= 0:
        return
    used = [0.0] * int(num_gpus_in_cluster)  # GPU share taken on each device
    asked, replicas = [], []
    for section, options in stage_options.items():
        share = options["ray_actor_options"]["num_gpus"]
        count = options.get("num_replicas") or options["autoscaling_config"]["min_replicas"]
        asked.append(f"{section} {count} x {share:g}")
        replicas += [share] * count if share > 0 else []
    for share in sorted(replicas, reverse=True):
        if share >= 1:
            free = [device for device, taken in enumerate(used) if taken == 0][:math.ceil(share - 1e-9)]
            fits = len(free) == math.ceil(share - 1e-9)
        else:
            free = [device for device, taken in enumerate(used) if taken + share <= 1 + 1e-9][:1]
            fits = bool(free)
        if not fits:
            raise ValueError(
                f"stages: split: the minimum replicas ({', '.join(asked)} GPUs) do not fit the cluster's "
                f"{num_gpus_in_cluster:g} GPUs; lower worker.num_gpus, text_encoder.num_gpus or decoder.num_gpus, "
                "or their autoscaling.min_replicas / num_replicas")
        for device in free:
            used[device] += min(share, 1.0)


def shutdown_options(graceful_shutdown_timeout_s: float) -> dict[str, float]:
    """Serve's drain settings for a replica: drain at most this long, checking every SHUTDOWN_POLL_S (Serve's
    default polls every 2 s, so even an idle replica took 2 s to stop, and the app's two deployments stop one
    after the other)."""
    return {"graceful_shutdown_timeout_s": graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S}


def ingress_graceful_shutdown_s(config: AppConfig, split: bool) -> float:
    """The ingress's drain: `http.graceful_shutdown_timeout_s`, and past every bound stage's. Serve kills a
    replica whose requests outlast its grace period without calling `__del__`: an ingress cut before its
    workers left its HTTP callers the proxy's bare "500 Internal Server Error". Outliving them, it answers
    each open generation: its result, or a 503 naming the stopped worker."""
    stages = (config.worker, config.text_encoder, config.decoder) if split else (config.worker,)
    return max(config.http.graceful_shutdown_timeout_s,
               max(stage.graceful_shutdown_timeout_s for stage in stages) + STAGE_STOP_REPORTED_S)


def resolve_engine_config(engine: EngineConfig) -> EngineConfig:
    """Pin relative paths to the builder's working directory, so every replica reads the same place."""
    update = {"checkpoint_root": os.path.abspath(os.path.expanduser(engine.checkpoint_root))}
    if engine.checkpoint:
        update["checkpoint"] = os.path.abspath(os.path.expanduser(engine.checkpoint))
    return engine.model_copy(update=update)


def resolve_jobs_config(jobs: JobsConfig, checkpoint_root: str) -> JobsConfig:
    """Pin a relative `state_dir` next to the (absolute) checkpoint root, so every replica uses the same job
    database and outputs, and a test that puts its checkpoints in a temp dir gets its jobs there too."""
    state_dir = os.path.expanduser(jobs.state_dir)
    if not os.path.isabs(state_dir):
        state_dir = os.path.join(os.path.dirname(os.path.abspath(checkpoint_root)), state_dir)
    return jobs.model_copy(update={"state_dir": state_dir})


def stages_split(config: AppConfig) -> bool:
    """Whether the app binds the stages split: `stages: split`, and any app serving more than one partition (fused,
    each partition's Worker would load its own Qwen3-VL and VAEs: 67 + 11 GB at release, twice), unless its engine
    is sequence parallel (rank 0 runs every stage; each partition's replica then holds its own encoder and VAEs)."""
    if config.engine.parallel.sp > 1:
        return False
    return config.stages == "split" or len(config.served_partitions) > 1


def build_application(config: AppConfig, engine_factory: EngineFactory | None = None) -> Application:
    """Ingress bound to a Worker per served partition (`AppConfig.partitions`), and in a split app to the one
    TextEncoder and Decoder they share. `engine_factory` (default: the real `engine.engine.Engine`) lets tests
    pass a fake engine."""
    engine = resolve_engine_config(config.engine)
    jobs = resolve_jobs_config(config.jobs, engine.checkpoint_root)
    num_gpus = cluster_num_gpus()
    partitions = config.served_partitions
    split = stages_split(config)
    if config.stages == "split" and not split:
        logger.info("ditserve: engine.parallel.sp=%d runs the stages fused (rank 0 decodes)", engine.parallel.sp)
    if config.stages == "fused" and split:
        logger.info("ditserve: partitions %s run split although stages: fused (one TextEncoder and one Decoder "
                    "load the text encoder and the VAEs once for every partition)", list(partitions))
    # Each partition's engine: the same settings, its own transformer (and so its own plan cache and router).
    engines = [engine.model_copy(update={"partition": partition}) for partition in partitions]
    for engine_config in engines:  # model_copy does not validate: the check EngineConfig's own validator makes
        engine_config.check_serves_a_task("partitions")
    options = worker_deployment_options(config.worker, num_gpus, engine, split)
    logger.info("ditserve: stages %s, partitions %s, worker options %s, engine %s", "split" if split else "fused",
                list(partitions), options, engine.model_dump())
    text_encoder = decoder = None
    if split:
        text_encoder_options = stage_deployment_options(config.text_encoder, num_gpus,
                                                        on_cpu(engine, engine.text_encoder.device))
        decoder_options = stage_deployment_options(config.decoder, num_gpus, on_cpu(engine, engine.decode.device))
        check_split_fits({**{worker_deployment_name(i, p): options for i, p in enumerate(partitions)},
                          "text_encoder": text_encoder_options, "decoder": decoder_options}, num_gpus)
        # One prepare and one decode stage for every partition: they share the text encoder and the VAEs. The
        # first partition's checkpoint holds them; the prepare stage takes every served partition's tasks.
        text_encoder = TextEncoder.options(**text_encoder_options).bind(engines[0].model_dump(), list(partitions))
        decoder = Decoder.options(**decoder_options).bind(engines[0].model_dump())
    workers = [
        Worker.options(name=worker_deployment_name(index, partition), **options).bind(
            engine_config.model_dump(), engine_factory or (denoiser_engine_factory if split else None))
        for index, (partition, engine_config) in enumerate(zip(partitions, engines))
    ]
    admin = config.admin.model_copy(
        update={"weight_roots": [os.path.abspath(os.path.expanduser(r)) for r in config.admin.weight_roots]
                or [engine.checkpoint_root]}
    )
    ingress = Ingress.options(
        max_ongoing_requests=config.http.max_ongoing_requests,
        # The decorator's num_cpus 0, restated: options() replaces ray_actor_options whole.
        ray_actor_options={"num_cpus": 0, **({"resources": dict(config.http.resources)} if config.http.resources
                                             else {})},
        **shutdown_options(ingress_graceful_shutdown_s(config, split)),
    )
    return ingress.bind(
        workers[0], config.http.model_dump(), admin.model_dump(), jobs.model_dump(), config.auth.model_dump(),
        config.videos.model_dump(), text_encoder, decoder, list(partitions), workers[1:],
    )


def build_app(args: dict[str, Any]) -> Application:
    """The `import_path` of serve_config.yaml: `args` -> validated `AppConfig` -> application."""
    return build_application(AppConfig.model_validate(args or {}))
