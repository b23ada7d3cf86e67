"""Fleet-wide weight update (`POST /admin/weights`) on a local cluster with 2 worker replicas (real engine,
tiny MiniMax-H3 checkpoints on CPU).

The update must reach both replicas, drop every plan built from the old weights, and make the served
latents bit-identical to a fresh engine on the new checkpoint (a fine-tune: the seed-1 transformer with the
served text encoder and VAEs, since an update loads the transformer only). Refused updates (token, path,
bad checkpoint) must change nothing on any replica.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import requests
import torch

from deployments.schemas import decode_latents
from deployments.weights import confine_weights_path
from engine.api import GenerationRequest
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ServerFault
from model.weights import is_adaln_param
from model.tiny import make_tiny_checkpoint
from tests.serve_helpers import APP_NAME, run_app, serve_cluster, serve_config_args
from tests.weights_support import WRONG_SHAPE_TENSOR, finetune_of, with_wrong_shape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400), pytest.mark.ray]  # slow: Ray + Serve: the app, weight updates across replicas

TOKEN = "test-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
# Different step counts: different schedules, so the affinity router spreads them over both replicas.
BODIES = [{"prompt": "a red fox", "steps": s, "seconds": 5.0, "width": 64, "height": 64, "seed": 3,
           "return_video": False, "return_latents": True} for s in (2, 3, 4, 5, 6, 7)]


#: The shipped config's auto-made adapter needs an auto-made checkpoint (engine.config); these comparisons name the
#: update's directory and run no adapter (a request without one runs the base forward on the served replica too).
NO_AUTO_ADAPTERS = {"adapters": {}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    # The checkpoint the replicas would make on first start (same seed, same bytes), made here first so the
    # fine-tune can share its text encoder and VAEs.
    served = make_tiny_checkpoint(root / "tiny-diffusers", "diffusers", seed=0)
    new = finetune_of(served, root / "tiny-seed1")
    args = serve_config_args(root)
    args["stages"] = "fused"  # an update loads the transformer: the Worker's either way (split: test_reliability_http)
    args["worker"]["num_replicas"] = 2
    args["admin"] = {"token": TOKEN, "update_timeout_s": 120}
    with serve_cluster() as url:
        run_app(url, args)
        yield {"url": url, "root": root, "new": new, "engine": args["engine"], "args": args}


def weights_status(url) -> dict:
    r = requests.get(f"{url}/admin/weights", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def live_replicas(url, count: int = 2, timeout_s: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = weights_status(url)["replicas"]
        if len(replicas) == count:
            return sorted(replicas, key=lambda r: r["replica"])
        assert time.monotonic() < deadline, f"expected {count} live replicas, got {replicas}"
        time.sleep(0.5)


def generate(url, body) -> dict:
    r = requests.post(f"{url}/v1/generations", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def update(url, path, headers=AUTH):
    return requests.post(f"{url}/admin/weights", json={"path": str(path)}, headers=headers, timeout=180)


def test_confine_weights_path_rules(tmp_path):
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", root / "link-out")
    assert confine_weights_path(str(root / "a"), [str(root)]) == (root / "a").resolve()
    assert confine_weights_path("a", [str(root)]) == (root / "a").resolve()
    for bad, why in [(str(root / ".." / "outside"), "traversal"), ("../outside", "traversal"),
                     (str(tmp_path / "outside"), "outside admin.weight_roots"),
                     (str(root / "link-out"), "outside admin.weight_roots"), ("", "non-empty")]:
        with pytest.raises(ValueError, match=why):
            confine_weights_path(bad, [str(root)])


def test_admin_routes_need_the_bearer_token(cluster):
    url = cluster["url"]
    assert update(url, cluster["new"], headers={}).status_code == 401
    r = update(url, cluster["new"], headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert requests.get(f"{url}/admin/weights", timeout=30).status_code == 401
    assert all(r["applied_version"] == 0 for r in live_replicas(url))


@pytest.mark.parametrize("path, message", [
    ("{root}/../elsewhere", "path traversal"),
    ("/etc", "outside admin.weight_roots"),
    ("{root}/no-such-dir", "no-such-dir"),
    ("{root}/wrong-shape", WRONG_SHAPE_TENSOR),
])
def test_refused_updates_are_4xx_and_touch_no_replica(cluster, path, message):
    url, root = cluster["url"], cluster["root"]
    if "wrong-shape" in path and not (root / "wrong-shape").exists():
        with_wrong_shape(cluster["new"], root / "wrong-shape")
    before = generate(url, BODIES[0])
    r = update(url, path.format(root=root))
    assert r.status_code in (400, 422), r.text
    assert message in r.json()["error"]["message"]
    status = weights_status(url)
    assert status["version"] == 0 and status["path"] is None
    replicas = live_replicas(url)
    assert [r["applied_version"] for r in replicas] == [0, 0]
    assert {r["model"] for r in replicas} == {before["model"]}
    assert generate(url, BODIES[0])["latents"] == before["latents"]


def test_update_applies_on_every_replica_and_serves_exactly_the_new_weights(cluster):
    url, new = cluster["url"], cluster["new"]
    old = [generate(url, body) for body in BODIES]  # warms plans of the old weights (on both replicas, likely)
    time.sleep(1.0)  # a heartbeat (every 0.5 s) carries the replicas' plan counts
    old_models = {r["model"] for r in live_replicas(url)}
    assert len(old_models) == 1 and sum(r["resident_plans"] for r in live_replicas(url)) > 0

    r = update(url, new)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ok" and body["version"] == 1 and body["path"] == str(new.resolve())
    reports = body["replicas"]
    assert len({rep["replica"] for rep in reports}) == 2
    for rep in reports:
        assert rep["ok"] and rep["error"] is None
        assert (rep["old_version"], rep["new_version"]) == (0, 1)
        assert rep["old_model"] in old_models and rep["new_model"] not in old_models

    # No replica keeps a plan of the old weights, or a reference.
    for replica in live_replicas(url):
        assert replica["applied_version"] == 1 and replica["fingerprint"] == body["fingerprint"]
        assert replica["stale_plans"] == 0 and replica["resident_plans"] == 0 and replica["held_plan_refs"] == 0

    fresh = Engine(EngineConfig.model_validate({**cluster["engine"], "checkpoint": str(new), "device": "cpu",
                                                **NO_AUTO_ADAPTERS}))
    for i, (body_, before) in enumerate(zip(BODIES, old)):
        after = generate(url, body_)
        assert after["model"] == fresh.model_name != before["model"]
        if i == 0:  # old plans are gone from every tier: the first request rebuilds all of its plans
            adaln = after["stats"]["adaln"]
            assert adaln["gpu_hit_plans"] == adaln["host_hit_plans"] == 0 and adaln["built_plans"] > 0
        local = fresh.generate(GenerationRequest(**body_))
        latents = decode_latents(after["latents"])
        assert torch.equal(latents["video"], local.video) and torch.equal(latents["audio"], local.audio)
    assert {r["model"] for r in live_replicas(url)} == {fresh.model_name}


def test_a_replica_that_replaces_a_dead_one_loads_the_new_weights_before_serving(cluster):
    """Serve replaces a worker replica that died (a crash, a lost node): its fresh process must apply the update
    before it serves, not the configured checkpoint."""
    import ray

    url, new = cluster["url"], cluster["new"]
    assert weights_status(url)["version"] == 1  # set by the test above
    before = {r["replica"] for r in live_replicas(url)}
    victim = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::") and f"{APP_NAME}#Worker#" in a["name"])
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    deadline = time.monotonic() + 120
    # the killed one's entry ages out; its replacement reports once it has applied the update and serves
    while len(replicas := weights_status(url)["replicas"]) != 2 or {r["replica"] for r in replicas} <= before:
        assert time.monotonic() < deadline, f"the killed replica was not replaced: {replicas}"
        time.sleep(0.5)
    assert len({r["replica"] for r in replicas} - before) == 1
    assert [r["applied_version"] for r in replicas] == [1, 1]
    assert len({r["fingerprint"] for r in replicas}) == 1
    fresh = Engine(EngineConfig.model_validate({**cluster["engine"], "checkpoint": str(new), "device": "cpu",
                                                **NO_AUTO_ADAPTERS}))
    assert {r["model"] for r in replicas} == {fresh.model_name}


class RecordingPool:
    """Stands in for `actors.host_cache_pool.PoolClient`: records invalidations."""

    def __init__(self) -> None:
        self.invalidated: list = []

    def invalidate(self, weights_version=None, timeout_s: float = 10.0) -> int:
        self.invalidated.append(weights_version)
        return 0


def test_engine_update_invalidates_the_pool_hook_and_a_rejected_one_writes_nothing(tmp_path):
    engine = Engine(EngineConfig(checkpoint_root=str(tmp_path), device="cpu", adaln={"mode": "online"}))
    engine.pool_tier = pool = RecordingPool()
    request = GenerationRequest(**{**BODIES[0], "return_latents": False})
    before = engine.generate(request)
    wrong = with_wrong_shape(engine.checkpoint.root, tmp_path / "wrong")
    with pytest.raises(ValueError, match=WRONG_SHAPE_TENSOR):
        engine.validate_weight_update(wrong)
    with pytest.raises(ValueError, match=WRONG_SHAPE_TENSOR):
        engine.update_weights(wrong)
    assert pool.invalidated == [] and torch.equal(engine.generate(request).video, before.video)
    old_version = engine.plan_cache.weights_version
    engine.update_weights(finetune_of(engine.checkpoint.root, tmp_path / "seed1"))
    assert pool.invalidated == [old_version]
    stats = engine.debug_stats()
    assert stats["resident_plans"] == stats["stale_plans"] == stats["held_plan_refs"] == 0
    assert not torch.equal(engine.generate(request).video, before.video)


class GatedPool:
    """Stands in for the node pool (`cache.plan_cache.RemoteTier` + `invalidate`): `publish_group` blocks until
    `gate` is set, so a publish of the old weights' plans is still in flight when the update starts; the store
    keeps what landed, `invalidate(version)` drops that version's plans as they are at the call."""

    def __init__(self) -> None:
        self.store: dict = {}  # weights version -> plan keys stored
        self.entered, self.gate, self.landed = threading.Event(), threading.Event(), threading.Event()
        self.invalidated: list = []

    def lookup(self, keys) -> dict:
        return {}

    def publish_group(self, plans, ready=None) -> bool:
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        for key in plans:
            self.store.setdefault(key[0], set()).add(key)
        self.landed.set()
        return True

    def invalidate(self, weights_version=None, timeout_s: float = 10.0) -> int:
        self.invalidated.append(weights_version)
        return len(self.store.pop(weights_version, ()))


def test_a_publish_of_old_plans_in_flight_during_an_update_is_dropped_not_landed_after(tmp_path):
    pool = GatedPool()
    engine = Engine(EngineConfig(checkpoint_root=str(tmp_path), device="cpu", adaln={"mode": "online"}), remote=pool)
    new = finetune_of(engine.checkpoint.root, tmp_path / "seed1")
    old_version = engine.plan_cache.weights_version
    engine.generate(GenerationRequest(**{**BODIES[0], "return_latents": False}))  # builds plans: one publish
    assert pool.entered.wait(60) and not pool.landed.is_set()  # the request is done, its publish is not

    # The update either waits for the publisher (it drains it before the pool's invalidation) or reaches the
    # pool's invalidation first; each is the signal to let the publish land.
    progressed = threading.Event()
    publisher = engine.plan_cache._publisher
    drain = publisher.drain

    def signalled_drain() -> None:
        progressed.set()
        drain()

    publisher.drain = signalled_drain
    invalidate = pool.invalidate
    pool.invalidate = lambda version=None, timeout_s=10.0: (invalidate(version, timeout_s), progressed.set())[0]
    update = threading.Thread(target=engine.update_weights, args=(new,))
    update.start()
    assert progressed.wait(60)
    pool.gate.set()
    update.join(60)
    assert not update.is_alive() and pool.landed.is_set()
    assert pool.invalidated == [old_version]
    assert old_version not in pool.store, "old plans landed in the pool after its invalidation"


def test_an_update_that_fails_while_writing_leaves_the_engine_unusable_not_serving_a_mix(tmp_path, monkeypatch):
    engine = Engine(EngineConfig(checkpoint_root=str(tmp_path), device="cpu", adaln={"mode": "online"}))
    request = GenerationRequest(**{**BODIES[0], "return_latents": False})
    engine.generate(request)
    new = finetune_of(engine.checkpoint.root, tmp_path / "seed1")
    checked = engine._checked_weights

    def the_disk_changes_after_the_check(path):
        weights = checked(path)
        # The transformer tensor stored last (not an AdaLN one: online mode reads those only to rebuild plans)
        # loses its second half; the tensors stored before it read fine.
        last = max((weights.location(name) for name in weights.names() if not is_adaln_param(name)),
                   key=lambda loc: (str(loc.path), loc.offset))
        os.truncate(last.path, last.offset + last.nbytes // 2)
        return weights

    monkeypatch.setattr(engine, "_checked_weights", the_disk_changes_after_the_check)
    with pytest.raises(ServerFault, match="failed while writing"):
        engine.update_weights(new)
    # Some tensors may be new, the rest old: the engine must not serve (Serve's health check replaces it).
    with pytest.raises(ServerFault, match="mix of old and new weights"):
        engine.health()
    with pytest.raises(ServerFault, match="mix of old and new weights"):
        engine.generate(request)


def test_an_update_after_a_forward_that_raised_inside_an_offloaded_block_applies(tmp_path, monkeypatch):
    # e.g. out of memory inside a block: its post-forward hook never ran, so the offloader still had it
    # running, and the next update refused to write (ServerFault: engine unusable, replica replaced).
    engine = Engine(EngineConfig(checkpoint_root=str(tmp_path), device="cpu", adaln={"mode": "resident"},
                                 offload={"enabled": True}))
    request = GenerationRequest(**{**BODIES[0], "return_latents": False})
    block = engine.transformer.transformer_blocks[2]

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory (simulated inside a block)")

    monkeypatch.setattr(block, "forward", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        engine.generate(request)
    monkeypatch.undo()
    new = finetune_of(engine.checkpoint.root, tmp_path / "seed1")
    engine.update_weights(new)
    assert engine.health()["status"] == "ok"
    fresh = Engine(EngineConfig(checkpoint_root=str(tmp_path), checkpoint=str(new), device="cpu",
                                adaln={"mode": "resident"}))
    assert engine.model_name == fresh.model_name
    assert torch.equal(engine.generate(request).video, fresh.generate(request).video)
