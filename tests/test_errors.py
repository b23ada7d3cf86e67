"""Errors across the engine boundary: the engine's typed errors, how the Serve layer turns them into HTTP
statuses, and which of them the logs treat as server failures."""

from __future__ import annotations

import contextlib
import logging
import pickle
import re

import pytest
from ray.exceptions import RayActorError, RayTaskError

from cache.plan_cache import AdmissionError
from deployments.errors import ClientErrorLogFilter, RequestError, engine_error, http_error, worker_error
from engine.api import GenerationRequest
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import (
    AdmissionRejected,
    ClientError,
    EngineError,
    ErrorKind,
    FaultCause,
    GenerationCancelled,
    ServerFault,
    Unavailable,
    WeightsRejected,
)
from model.layout import CheckpointError
from tests.weights_support import with_wrong_shape


def request(**overrides) -> GenerationRequest:
    """64x64 px, 5 s; steps=2: one forward, one AdaLN plan."""
    fields = dict(prompt="a fox", steps=2, seconds=5.0, width=64, height=64, seed=3, return_video=False)
    return GenerationRequest(**{**fields, **overrides})


def from_replica(exc: BaseException) -> BaseException:
    """`exc` as a caller of a Serve replica sees it: wrapped by Ray in a RayTaskError of its type."""
    return RayTaskError("generate", "Traceback (most recent call last): ...", exc).as_instanceof_cause()


# --- the types -----------------------------------------------------------------------------------


def test_client_errors_are_value_errors_and_server_faults_are_not():
    for client in (ClientError("steps", "x"), AdmissionRejected("x"), WeightsRejected("x")):
        assert isinstance(client, (ValueError, EngineError))
    fault = ServerFault("shard diffusion_pytorch_model-00003-of-00005.safetensors is truncated",
                        FaultCause.CHECKPOINT_UNREADABLE)
    assert isinstance(fault, EngineError) and not isinstance(fault, ValueError)
    assert isinstance(GenerationCancelled("x"), EngineError) and not isinstance(GenerationCancelled("x"), ValueError)


def test_every_error_has_its_kind_and_a_field_error_names_its_field_and_limit():
    assert [e.kind for e in (ClientError("seconds", "x"), AdmissionRejected("x"), WeightsRejected("x"),
                             ServerFault("x", FaultCause.RANK_FAILURE), Unavailable("x"), GenerationCancelled("x"))] == [
        ErrorKind.INVALID_REQUEST, ErrorKind.ADMISSION, ErrorKind.INVALID_REQUEST, ErrorKind.SERVER_FAULT,
        ErrorKind.UNAVAILABLE, ErrorKind.CANCELLED]
    error = ClientError("steps", "70 exceeds this server's max_steps=65", "max_steps=65")
    assert (str(error), error.field, error.detail, error.limit) == (
        "steps: 70 exceeds this server's max_steps=65", "steps", "70 exceeds this server's max_steps=65",
        "max_steps=65")
    assert (AdmissionRejected("too many plans").field, WeightsRejected("no such dir").field) == ("steps", "path")


@pytest.mark.parametrize("error", [
    ClientError("width", "65 is out of range: must be a multiple of 32 px", "must be a multiple of 32 px"),
    AdmissionRejected("request needs 3 distinct AdaLN plans", "adaln.gpu_plans=2"),
    WeightsRejected("/ckpt: missing config.json"),
    ServerFault("shard x is truncated", FaultCause.CHECKPOINT_UNREADABLE),
    Unavailable("no worker could take the request: RayActorError", replica_lost=True),
    GenerationCancelled("generation cancelled by the caller"),
])
def test_an_error_crosses_processes_as_data(error):  # Ray pickles it from the replica to the caller
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.kind, vars(copy)) == (type(error), str(error), error.kind, vars(error))


# --- the engine translates at its boundary -------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    return Engine(EngineConfig(checkpoint_root=str(tmp_path_factory.mktemp("errors")), device="cpu",
                               adaln={"mode": "online", "gpu_plans": 2, "host_cache_gb": 0.0}))


@pytest.mark.parametrize("overrides, field, message", [
    ({"width": 65}, "width", "width: 65 is out of range: must be a multiple of 32 px"),
    ({"guidance_scale": 3.0}, "guidance_scale", "guidance_scale: 3.0 is not served: MiniMax-H3 is CFG-distilled"),
    ({"seconds": 16.0}, "seconds", "must be between 5 and 15 s"),
    ({"width": 1536, "height": 768}, "width", "width: 1536x768 = 1179648 px is out of range: must be <= 1032192 px"),
    ({"height": 1536, "width": 768}, "height", "height: 768x1536 = 1179648 px is out of range"),
    ({"prompt": "a lighthouse at dusk " * 200}, "prompt", "tokens exceeds this server's max_prompt_tokens="),
    ({"cache_dit": {"enabled": True}}, "cache_dit", "cache_dit: Cache-DiT is off on this server"),
])
def test_a_request_over_a_model_limit_is_a_client_error_naming_its_field(engine, overrides, field, message):
    for call in (engine.validate, engine.generate):
        with pytest.raises(ClientError, match=re.escape(message)) as info:
            call(request(**overrides))
        assert info.value.field == field  # typed: the HTTP layers map it, never parse the message
        assert info.value.__cause__ is None  # the message is the whole story; no lower-layer type leaks


def test_the_engine_describes_the_limits_it_checks(engine):
    from engine.limits import ModelLimits

    described = ModelLimits.model_validate(engine.describe()["limits"])
    assert described == engine.limits and described.short_edge is None  # a tiny checkpoint: any 32-px multiple


def test_a_request_the_plan_cache_can_never_admit_is_admission_rejected_with_the_cache_message(engine, monkeypatch):
    # steps=4: 3 forwards with 3 distinct plans, the slab holds adaln.gpu_plans=2. Refused by `validate` (the
    # video API's check before it queues a job) and by `generate` before any stage ran, not mid-run.
    def encode(prompt):
        raise AssertionError("the prompt was encoded for a request the plan cache can never admit")

    with monkeypatch.context() as patch:
        patch.setattr(engine.prompt_stage, "encode", encode)
        for call in (engine.validate, engine.generate):
            with pytest.raises(AdmissionRejected) as info:
                call(request(steps=4))
            assert isinstance(info.value.__cause__, AdmissionError)
            assert (str(info.value), info.value.limit) == (f"steps: {info.value.__cause__}", "adaln.gpu_plans=2")
            assert "request needs 3 distinct AdaLN plans but the GPU slab holds adaln.gpu_plans=2" in str(info.value)
        engine.validate(request(steps=3))  # exactly the slab's plans: admitted
    assert engine.generate(request(steps=3)).video.shape == (24, 37, 4, 4)  # the engine serves on


def test_a_weight_update_the_model_cannot_take_is_weights_rejected(engine, tmp_path):
    wrong = with_wrong_shape(engine.checkpoint.root, tmp_path / "wrong")
    for call in (engine.validate_weight_update, engine.update_weights):
        with pytest.raises(WeightsRejected) as info:
            call(str(wrong))
        assert isinstance(info.value.__cause__, CheckpointError) and str(info.value) == f"path: {info.value.__cause__}"
    with pytest.raises(WeightsRejected, match="no-such-dir"):
        engine.validate_weight_update(str(tmp_path / "no-such-dir"))


def test_a_cancelled_generation_stays_generation_cancelled(engine):
    with pytest.raises(GenerationCancelled) as info:
        engine.generate(request(), cancelled=lambda: True)
    assert info.value.__cause__ is None  # not re-wrapped, not chained to itself


# --- HTTP statuses -------------------------------------------------------------------------------


@pytest.mark.parametrize("exc, status, kind, message", [
    (ClientError("width", "65 is out of range: must be a multiple of 32 px"), 422, "invalid_request",
     "width: 65 is out of range: must be a multiple of 32 px"),
    (AdmissionRejected("request needs 3 distinct AdaLN plans"), 422, "invalid_request",
     "steps: request needs 3 distinct AdaLN plans"),
    (ServerFault("/srv/ckpt/transformer/diffusion_pytorch_model-00003-of-00005.safetensors is truncated",
                 FaultCause.CHECKPOINT_UNREADABLE), 500, "server_error",
     "generation failed: checkpoint_unreadable (the server could not read its checkpoint; retry later)"),
    # A multi-GPU replica that lost a rank: no checkpoint was involved, the replica is being replaced.
    (ServerFault("parallel replica unusable: generate: rank 1 of 2 died", FaultCause.RANK_FAILURE), 500,
     "server_error", "generation failed: rank_failure (a server fault; retry later)"),
    (GenerationCancelled("stopped"), 499, "cancelled", "the request was cancelled"),
    # Anything else is a bug: 500 naming the type (a stray ValueError too: only ClientError is a 4xx).
    (RuntimeError("a bug"), 500, "server_error", "generation failed: RuntimeError"),
    (ValueError("a bug"), 500, "server_error", "generation failed: ValueError"),
])
def test_worker_errors_map_to_statuses(exc, status, kind, message):
    error = worker_error(exc, "gen-test")
    assert (error.status, error.kind, error.message) == (status, kind, message)
    assert "/srv/ckpt" not in error.message  # paths stay in the server log


@pytest.mark.parametrize("exc, status, message", [
    (ClientError("guidance_scale", "2.0 is not served"), 422, "guidance_scale: 2.0 is not served"),
    (ServerFault("/srv/ckpt/x is truncated", FaultCause.CHECKPOINT_UNREADABLE), 500,
     "generation failed: checkpoint_unreadable (the server could not read its checkpoint; retry later)"),
    (GenerationCancelled("stopped"), 499, "the request was cancelled"),
    # The replica's type, as for a local one: not Ray's wrapper ("RayTaskError(RuntimeError)").
    (RuntimeError("a bug"), 500, "generation failed: RuntimeError"),
    (KeyError("a bug"), 500, "generation failed: KeyError"),
])
def test_worker_errors_from_a_replica_are_sorted_by_what_the_replica_raised(exc, status, message):
    error = worker_error(from_replica(exc), "gen-test")
    assert (error.status, error.message) == (status, message)


def test_a_dead_replica_is_503():
    error = worker_error(RayActorError(), "gen-test")
    assert (error.status, error.kind) == (503, "unavailable")
    lost = engine_error(RayActorError())
    assert isinstance(lost, Unavailable) and lost.replica_lost


def test_a_field_error_names_its_field_in_the_body():
    body = http_error(ClientError("seconds", "16.0 is out of range: ...")).response_body()
    assert body == {"error": {"type": "invalid_request", "message": "seconds: 16.0 is out of range: ...", "errors": [
        {"loc": ["seconds"], "msg": "seconds: 16.0 is out of range: ...", "type": "value_error"}]}}


def test_handle_callers_get_a_client_error_for_4xx_and_a_runtime_error_otherwise():
    from deployments.errors import invalid_field

    refused = invalid_field("steps", "steps: x").for_handle_caller()
    assert type(refused) is ClientError and (refused.field, str(refused)) == ("steps", "steps: x")
    assert type(RequestError(413, "payload_too_large", "big").for_handle_caller()) is ClientError
    assert type(RequestError(504, "timeout", "slow").for_handle_caller()) is RuntimeError


# --- log levels ----------------------------------------------------------------------------------


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def log_failed_request(exc: BaseException) -> logging.LogRecord:
    """What Serve's replica does when a method raises: logger.exception("Request failed.")."""
    logger = logging.getLogger(f"test-errors-{id(exc)}")
    logger.propagate = False
    logger.addFilter(ClientErrorLogFilter())
    records = Records()
    logger.addHandler(records)
    try:
        raise exc
    except Exception:  # noqa: BLE001
        logger.exception("Request failed.")
    (record,) = records.records
    return record


@pytest.mark.parametrize("exc", [ClientError("steps", "Input should be a valid integer"),
                                 AdmissionRejected("too many\nplans")])
def test_a_client_error_is_logged_as_one_info_line_without_a_traceback(exc):
    record = log_failed_request(exc)
    assert (record.levelno, record.exc_info, record.exc_text) == (logging.INFO, None, None)
    assert record.getMessage() == f"request refused (client error): {str(exc).replace(chr(10), ' ')}"
    assert "\n" not in logging.Formatter().format(record)


@pytest.mark.parametrize("exc", [ServerFault("shard x is truncated", FaultCause.CHECKPOINT_UNREADABLE), RuntimeError("a bug")])
def test_a_server_fault_keeps_error_level_and_its_traceback(exc):
    record = log_failed_request(exc)
    assert record.levelno == logging.ERROR and record.exc_info[1] is exc
    assert record.getMessage() == "Request failed."
    assert "Traceback" in logging.Formatter().format(record)



def test_pending_generations_bound_counts_holders_and_suggests_the_recent_pace(monkeypatch):
    """http.max_pending_generations: one over the bound is a 503 with Retry-After (the mean time of recent
    completed generations, at least 1 s); a slot comes back however its generation ended."""
    import deployments.ingress as ingress

    now = [0.0]
    monkeypatch.setattr(ingress.time, "perf_counter", lambda: now[0])
    pending = ingress.PendingGenerations(limit=2)
    with pending.admit(), pending.admit():
        with pytest.raises(RequestError) as refused, pending.admit():
            pass
        assert (refused.value.status, refused.value.kind, refused.value.retry_after_s) == (503, "overloaded", 1)
        assert refused.value.response().headers["retry-after"] == "1"
        assert pending.count == 2
    with pytest.raises(RuntimeError), pending.admit():  # a failed generation frees its slot, says nothing of pace
        raise RuntimeError("worker fault")
    assert (pending.count, pending.retry_after_s()) == (0, 1)  # the two above took no time
    paced = ingress.PendingGenerations(limit=1)
    for seconds, retry_after_s in ((9.5, 10), (4.5, 9)):  # the first sets the mean, the next moves it by 1/5
        with paced.admit():
            now[0] += seconds
        assert paced.retry_after_s() == retry_after_s
    unbounded = ingress.PendingGenerations(limit=None)
    with contextlib.ExitStack() as stack:
        for _ in range(100):
            stack.enter_context(unbounded.admit())
        assert unbounded.count == 100


# --- routing refusals --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    """name -> TestClient: the ingress's FastAPI app (its routes need no replica to be refused) and the
    standalone video app."""
    from fastapi.testclient import TestClient

    from deployments.ingress import api
    from deployments.videos import VideoApi, build_videos_app
    from jobs.config import AuthConfig, JobsConfig
    from jobs.outputs import OutputStore
    from jobs.service import JobService
    from jobs.sqlite_store import SqliteJobStore
    from tests.jobs_support import FakeVideoBackend
    from tests.test_videos_api import TINY

    state = tmp_path_factory.mktemp("state")
    service = JobService(
        store=SqliteJobStore(state / "jobs.sqlite3"), outputs=OutputStore(str(state / "outputs")),
        backend=FakeVideoBackend(), models=[TINY], config=JobsConfig(state_dir=str(state)),
    )
    with TestClient(build_videos_app(VideoApi(service=service, auth=AuthConfig()))) as videos:
        yield {"ingress": TestClient(api), "videos": videos}


@pytest.mark.parametrize(
    ("app", "method", "path", "status", "kind", "allow"),
    [
        ("ingress", "GET", "/v1/generations", 405, "method_not_allowed", "POST"),
        ("ingress", "PUT", "/v1/generations:stream", 405, "method_not_allowed", "POST"),
        ("ingress", "POST", "/healthz", 405, "method_not_allowed", "GET"),
        ("ingress", "GET", "/v2/generations", 404, "not_found", None),
        ("ingress", "PUT", "/v1/videos", 405, "method_not_allowed", None),  # Allow: Starlette names one route's
        ("videos", "PUT", "/v1/videos", 405, "method_not_allowed", None),
        ("videos", "PATCH", "/v1/videos/video_" + "A" * 22, 405, "method_not_allowed", None),
        ("videos", "GET", "/v1/nothing", 404, "not_found", None),
    ],
)
def test_routing_refusals_have_the_error_shape(apps, app, method, path, status, kind, allow):
    """README: every error body is {"error": {"type", "message", "errors"}}, Starlette's own 404 / 405 too."""
    response = apps[app].request(method, path)
    assert response.status_code == status
    assert response.json() == {"error": {"type": kind, "message": f"{method} {path}: {response.reason_phrase}",
                                         "errors": None}}
    if allow is not None:
        assert response.headers["allow"] == allow
