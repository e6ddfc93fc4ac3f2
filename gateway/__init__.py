"""HTTP front end (Starlette served by Hypercorn, in the supervisor's process and event loop).

Modules: `protocol` (OpenAI request Structs + field policy), `responses` (response shapes),
`errors` (one error tree: status, type, code), `handlers` (chat/completions, JSON and SSE),
`sse` (framing), `admission` (bounded FIFO, deadlines), `auth` (bearer keys, bind rule),
`metrics` (Prometheus), `logging` (request ids, access lines), `model` (identity, limits,
sampling defaults), `openapi`, `app` (assembly), `server` (Hypercorn). Never imports OpenVINO.
"""

from __future__ import annotations

from gateway.app import Service, build_app

__all__ = ["Service", "build_app"]
