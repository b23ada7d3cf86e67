"""Errors across the engine boundary: the engine's typed errors, how the Serve layer turns them into HTTP
statuses, and which of them the logs treat as server failures."""

from __future__ import annotations

import logging
import pickle

import pytest
from ray.exceptions import RayActorError, RayTaskError

from cache.plan_cache import AdmissionError
from deployments.errors import ClientErrorLogFilter, RequestError, worker_error
from engine.api import GenerationRequest
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import (
    AdmissionRejected,
    ClientError,
    EngineError,
    GenerationCancelled,
    ServerFault,
    WeightsRejected,
)
from model.checkpoint import CheckpointError, make_checkpoint
from model.config import preset


def request(**overrides) -> GenerationRequest:
    fields = dict(prompt="a fox", steps=2, frames=2, height=8, width=8, audio_len=4, seed=3)
    return GenerationRequest(**{**fields, **overrides})


def from_replica(exc: BaseException) -> BaseException:
    """`exc` as a caller of a Serve replica sees it: wrapped by Ray in a RayTaskError of its type."""
    return RayTaskError("generate", "Traceback (most recent call last): ...", exc).as_instanceof_cause()


# --- the types -----------------------------------------------------------------------------------


def test_client_errors_are_value_errors_and_server_faults_are_not():
    for client in (ClientError("x"), AdmissionRejected("x"), WeightsRejected("x")):
        assert isinstance(client, (ValueError, EngineError))
    fault = ServerFault("shard blocks-00002.safetensors is truncated", kind="RebuildError")
    assert isinstance(fault, EngineError) and not isinstance(fault, ValueError)
    assert isinstance(GenerationCancelled("x"), EngineError) and not isinstance(GenerationCancelled("x"), ValueError)


def test_a_server_fault_survives_pickling_with_its_kind():  # Ray pickles it from the replica to the caller
    copy = pickle.loads(pickle.dumps(ServerFault("shard x is truncated", "RebuildError")))
    assert (type(copy), str(copy), copy.kind) == (ServerFault, "shard x is truncated", "RebuildError")


# --- the engine translates at its boundary -------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("errors") / "tiny", preset("tiny"), seed=0)
    return Engine(EngineConfig(checkpoint=str(checkpoint), device="cpu",
                               adaln={"mode": "online", "gpu_plans": 2, "host_cache_gb": 0.0}))


def test_a_request_over_a_model_limit_is_a_client_error(engine):
    with pytest.raises(ClientError, match="frames: 9 exceeds the model's max_frames=8"):
        engine.validate(request(frames=9))
    with pytest.raises(ClientError, match="frames: 9 exceeds the model's max_frames=8"):
        engine.generate(request(frames=9))


def test_a_request_the_plan_cache_can_never_admit_is_admission_rejected_with_the_cache_message(engine):
    # steps=3: 3 distinct plans, the slab holds adaln.gpu_plans=2
    with pytest.raises(AdmissionRejected) as info:
        engine.generate(request(steps=3))
    assert isinstance(info.value.__cause__, AdmissionError)
    assert str(info.value) == str(info.value.__cause__)
    assert "adaln.gpu_plans=2" in str(info.value)
    assert engine.generate(request(steps=2)).video.shape == (4, 2, 8, 8)  # the engine serves on


def test_a_weight_update_the_model_cannot_take_is_weights_rejected(engine, tmp_path):
    wrong = make_checkpoint(tmp_path / "wrong", preset("tiny", num_blocks=2), seed=1)
    for call in (engine.validate_weight_update, engine.update_weights):
        with pytest.raises(WeightsRejected) as info:
            call(str(wrong))
        assert isinstance(info.value.__cause__, CheckpointError) and str(info.value) == str(info.value.__cause__)
    with pytest.raises(WeightsRejected, match="config.json"):
        engine.validate_weight_update(str(tmp_path / "no-such-dir"))


def test_a_cancelled_generation_stays_generation_cancelled(engine):
    with pytest.raises(GenerationCancelled) as info:
        engine.generate(request(), cancelled=lambda: True)
    assert info.value.__cause__ is None  # not re-wrapped, not chained to itself


# --- HTTP statuses -------------------------------------------------------------------------------


@pytest.mark.parametrize("exc, status, kind, message", [
    (ClientError("frames: 9 exceeds the model's max_frames=8"), 422, "invalid_request",
     "frames: 9 exceeds the model's max_frames=8"),
    (AdmissionRejected("request needs 3 distinct AdaLN plans"), 422, "invalid_request",
     "request needs 3 distinct AdaLN plans"),
    (ServerFault("/srv/ckpt/blocks-00002.safetensors is truncated", "RebuildError"), 500, "server_error",
     "generation failed: RebuildError (the server could not read its checkpoint; retry later)"),
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
    (ClientError("frames: 9 exceeds the model's max_frames=8"), 422, "frames: 9 exceeds the model's max_frames=8"),
    (ServerFault("/srv/ckpt/x is truncated", "RebuildError"), 500,
     "generation failed: RebuildError (the server could not read its checkpoint; retry later)"),
    (GenerationCancelled("stopped"), 499, "the request was cancelled"),
    (RuntimeError("a bug"), 500, "generation failed: RayTaskError(RuntimeError)"),
])
def test_worker_errors_from_a_replica_are_sorted_by_what_the_replica_raised(exc, status, message):
    error = worker_error(from_replica(exc), "gen-test")
    assert (error.status, error.message) == (status, message)


def test_a_dead_replica_is_503():
    error = worker_error(RayActorError(), "gen-test")
    assert (error.status, error.kind) == (503, "unavailable")


def test_handle_callers_get_a_client_error_for_4xx_and_a_runtime_error_otherwise():
    assert type(RequestError(422, "invalid_request", "steps: x").for_handle_caller()) is ClientError
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


@pytest.mark.parametrize("exc", [ClientError("steps: Input should be a valid integer"),
                                 AdmissionRejected("steps: too many\nplans")])
def test_a_client_error_is_logged_as_one_info_line_without_a_traceback(exc):
    record = log_failed_request(exc)
    assert (record.levelno, record.exc_info, record.exc_text) == (logging.INFO, None, None)
    assert record.getMessage() == f"request refused (client error): {str(exc).replace(chr(10), ' ')}"
    assert "\n" not in logging.Formatter().format(record)


@pytest.mark.parametrize("exc", [ServerFault("shard x is truncated", "RebuildError"), RuntimeError("a bug")])
def test_a_server_fault_keeps_error_level_and_its_traceback(exc):
    record = log_failed_request(exc)
    assert record.levelno == logging.ERROR and record.exc_info[1] is exc
    assert record.getMessage() == "Request failed."
    assert "Traceback" in logging.Formatter().format(record)

