"""The Starlette application, assembled declaratively: routes, middleware, exception table.

`Service` bundles what the endpoints share (the embedded supervisor, settings, model info,
admission queue, metrics); `build_app` wires it into `Starlette(routes=…, middleware=…,
exception_handlers=…)`. Every error leaves as `{"error": {"message", "type", "param", "code"}}`
(never 422), via the one table `_EXCEPTION_HANDLERS`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway import openapi
from gateway.admission import AdmissionQueue
from gateway.auth import BearerAuthMiddleware
from gateway.errors import APIError
from gateway.handlers import chat_completions, completions, json_response
from gateway.logging import RequestContextMiddleware, record_error
from gateway.metrics import CONTENT_TYPE, Metrics
from gateway.model import ModelInfo
from gateway.response_store import ResponseStore
from gateway.responses import model_list
from gateway.responses_endpoint import create_response, delete_response, get_response
from worker.settings import ServiceSettings
from worker.supervisor import Supervisor, WorkerState

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Service:
    supervisor: Supervisor
    settings: ServiceSettings
    model: ModelInfo
    metrics: Metrics
    admission: AdmissionQueue
    responses: ResponseStore
    keys: tuple[bytes, ...] = ()

    @classmethod
    def create(cls, supervisor: Supervisor, settings: ServiceSettings, model: ModelInfo,
               keys: tuple[bytes, ...] = ()) -> Service:
        metrics = Metrics(supervisor.status)
        bounds = model.profile.responses
        store = ResponseStore(settings.state_dir / "responses.sqlite3", max_entries=bounds.max_entries,
                              max_bytes=bounds.max_bytes, ttl_s=bounds.ttl_s)
        return cls(supervisor, settings, model, metrics, AdmissionQueue(supervisor, settings, metrics), store, keys)

    def close(self) -> None:
        """Flush and close what the service owns (the response store)."""
        self.responses.close()


def _service(request: Request) -> Service:
    return request.app.state.service  # type: ignore[no-any-return]


# --- endpoints -----------------------------------------------------------------------------------

async def list_models(request: Request) -> Response:
    return json_response(model_list([_service(request).model.card()]))


async def get_model(request: Request) -> Response:
    model = _service(request).model
    model_id = request.path_params["model_id"]
    if model_id != model.id:
        raise APIError("model_not_found", f"the model '{model_id}' does not exist", param="model")
    return json_response(model.card())


async def live(request: Request) -> Response:
    return json_response({"status": "ok"})


async def ready(request: Request) -> Response:
    service = _service(request)
    status = service.supervisor.status()
    worker = status["worker"]
    body: dict[str, Any] = {
        "status": "ready",
        "worker": {k: worker[k] for k in ("state", "generation", "pid")},
        "model": {"id": service.model.id, "fingerprint": service.model.fingerprint},
        "profile": {"name": service.model.profile.name, "hash": service.model.profile.hash},
        "runtime": service.model.runtime,
        "queue": {"depth": status["queue"]["depth"], "in_flight": service.admission.in_flight()},
    }
    if service.admission.closed:
        body.update(status="shutting_down", reason="the service is shutting down")
    elif service.supervisor.draining:
        body.update(status="draining", reason="draining: not admitting new requests")
    elif worker["state"] != WorkerState.READY.value:
        body.update(status=worker["state"], reason=worker["reason"] or f"the worker is {worker['state']}")
    else:
        return json_response(body)
    return json_response(body, status=503, headers={"Retry-After": str(round(service.settings.retry_after_s))})


async def metrics(request: Request) -> Response:
    return Response(_service(request).metrics.render(), media_type=CONTENT_TYPE)


async def openapi_json(request: Request) -> Response:
    return json_response(openapi.document(ROUTES))


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/health/live", live, methods=["GET"]),
    Route("/health/ready", ready, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/openapi.json", openapi_json, methods=["GET"]),
]


# --- errors ----------------------------------------------------------------------------------------

def _error_response(error: APIError) -> Response:
    record_error(error.code)
    if error.status >= 500:
        log.warning("request failed: %s", error.code)
    return Response(error.body_bytes(), status_code=error.status, headers=error.headers(),
                    media_type="application/json")


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return _error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        return _error_response(APIError("method_not_allowed", f"{request.method} is not allowed on {request.url.path}"))
    return _error_response(APIError("not_found", f"no such endpoint: {request.method} {request.url.path}"))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error", exc_info=exc)
    return _error_response(APIError("internal_error", "internal server error"))


_EXCEPTION_HANDLERS = {APIError: _api_error, HTTPException: _http_error, Exception: _internal_error}


def build_app(service: Service) -> Starlette:
    app = Starlette(
        routes=ROUTES,
        middleware=[
            Middleware(RequestContextMiddleware, metrics=service.metrics),
            Middleware(BearerAuthMiddleware, keys=service.keys),
        ],
        exception_handlers=_EXCEPTION_HANDLERS,  # type: ignore[arg-type]
    )
    app.state.service = service
    return app
