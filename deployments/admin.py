"""The admin side of the ingress: bearer-token check and the fleet weight update's orchestration.

`POST /admin/weights` (the ingress routes it here): confine the path to `admin.weight_roots`, have one
worker replica validate the directory (read-only), set the fleet target on the coordinator, then wait until
every live replica applied it or failed, and answer per replica. `GET /admin/weights`: the target and each
live replica's state. `deployments/weights.py` has the coordinator, the replica side and the safety
argument (no request mixes old and new weights).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray.serve.handle import DeploymentHandle

from deployments.errors import RequestError, unwrap, validation_error, worker_error
from deployments.schemas import AdminOptions, WeightUpdateRequest
from deployments.weights import confine_weights_path, env_admin_token, get_coordinator
from engine.errors import ClientError

logger = logging.getLogger("ray.serve")

#: Budget of the one read-only validation of a weights directory (reads every shard header).
VALIDATE_TIMEOUT_S = 120.0
#: How often the update polls the coordinator for the replicas' reports.
POLL_S = 0.2


class WeightAdmin:
    """Admin routes' logic for one ingress: token check, weight update, status (no HTTP routing here)."""

    def __init__(self, worker: DeploymentHandle, options: AdminOptions, app_name: str) -> None:
        self._worker = worker
        self._options = options
        self._token = options.token or env_admin_token()
        self._app_name = app_name
        self._coordinator: Any = None

    def authorize(self, authorization: str) -> None:
        """404 when no admin token is configured (routes off), 401 on a missing or wrong bearer token.
        `authorization`: the request's Authorization header ("" when absent)."""
        if not self._token:
            raise RequestError(404, "not_found", "admin routes are disabled: set admin.token or $DITSERVE_ADMIN_TOKEN")
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token.encode()):
            raise RequestError(401, "unauthorized", "admin routes need 'Authorization: Bearer <admin token>'")

    def _weights_coordinator(self) -> Any:
        if self._coordinator is None:
            self._coordinator = get_coordinator(self._app_name)
        return self._coordinator

    async def update(self, payload: Any) -> JSONResponse:
        """Load the checkpoint named by `payload` ({"path": ...}) on every live worker replica."""
        try:
            body = WeightUpdateRequest.model_validate(payload)
            path = str(confine_weights_path(body.path, self._options.weight_roots))
        except ValidationError as exc:
            raise validation_error(exc) from None
        except ValueError as exc:
            raise RequestError(400, "invalid_path", str(exc)) from None
        # 1. Validate once, read-only, on one replica: nothing anywhere changes if this fails.
        try:
            checked = await asyncio.wait_for(self._worker.validate_weights.remote(path), timeout=VALIDATE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - sorted below
            if isinstance(unwrap(exc), ClientError):
                raise RequestError(422, "invalid_weights", str(unwrap(exc))) from None
            raise worker_error(exc, "admin-weights") from None
        # 2. Set the fleet target; 3. wait until every live replica applied it (or failed).
        coordinator = self._weights_coordinator()
        version = await coordinator.set_target.remote(path)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._options.update_timeout_s
        while True:
            replicas = await coordinator.replicas.remote()
            done = [r for r in replicas if max(r["applied_version"], r["failed_version"]) >= version]
            if replicas and len(done) == len(replicas):
                break
            if loop.time() > deadline:
                body = {"version": version, "path": path, "status": "timeout", "replicas": _reports(replicas, version)}
                return JSONResponse(status_code=504, content=body)
            await asyncio.sleep(POLL_S)
        reports = _reports(replicas, version)
        # A later update set meanwhile: replicas may have gone straight to it, so this one is not what they serve.
        latest, _ = await coordinator.target.remote()
        ok = all(r["ok"] for r in reports)
        status, code = ("superseded", 409) if latest > version else ("ok", 200) if ok else ("failed", 500)
        body = {"version": version, "path": path, "fingerprint": checked.get("fingerprint"),
                "status": status, "replicas": reports}
        return JSONResponse(status_code=code, content=body)

    async def status(self) -> JSONResponse:
        """The fleet's weights target and each live worker replica's state."""
        coordinator = self._weights_coordinator()
        version, path = await coordinator.target.remote()
        replicas = await coordinator.replicas.remote()
        return JSONResponse(content={"version": version, "path": path, "replicas": replicas})


def _reports(replicas: list[dict[str, Any]], version: int) -> list[dict[str, Any]]:
    """Per replica: id, old/new weights version and model, ok/error (from its last apply)."""
    reports = []
    for r in sorted(replicas, key=lambda r: r["replica"]):
        last = r.get("last_apply") or {}
        applied = last.get("new_version", -1)
        if applied < version:  # still pending (timeout)
            last = {"ok": False, "error": "not applied yet"}
        elif applied > version:  # a later update's outcome, not this one's
            last = {"ok": False, "error": f"superseded by v{applied}", "old_version": last.get("old_version"),
                    "old_model": last.get("old_model"), "seconds": last.get("seconds")}
        reports.append({
            "replica": r["replica"], "old_version": last.get("old_version"), "new_version": r["applied_version"],
            "old_model": last.get("old_model"), "new_model": r.get("model"), "ok": bool(last.get("ok")),
            "error": last.get("error"), "seconds": last.get("seconds"),
        })
    return reports
