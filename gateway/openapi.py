"""`GET /openapi.json`: an OpenAPI 3.1 description of the served endpoints, with the request
bodies' JSON schemas generated from the same msgspec Structs that validate them."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.routing import BaseRoute, Route

from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.responses_request import ResponsesRequest

_BODIES: dict[str, type[msgspec.Struct]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
}
_ERROR = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": "string"}}}},
}


def document(routes: list[BaseRoute]) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(list(_BODIES.values()),
                                                   ref_template="#/components/schemas/{name}")
    components["Error"] = _ERROR_SCHEMA
    paths: dict[str, Any] = {}
    for route in routes:
        if not isinstance(route, Route):
            continue
        for method in sorted((route.methods or set()) - {"HEAD"}):
            op: dict[str, Any] = {
                "operationId": f"{method.lower()}_{route.name}",
                "responses": {"200": {"description": "success"}, "default": _ERROR},
            }
            for name in ("model_id", "response_id"):
                if "{" + name in route.path:
                    op["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]
            body = _BODIES.get(route.path)
            if body is not None:
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}
                op["responses"]["200"] = {"description": "JSON, or text/event-stream when stream is true"}
            paths.setdefault(route.path.replace(":path", ""), {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "iq36", "version": "1", "description": "OpenAI-compatible API of iq36"},
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": paths,
    }
