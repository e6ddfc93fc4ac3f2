"""The gateway's one error tree: every failure a client sees is an `APIError` with an HTTP status,
an OpenAI error `type`, a stable `code` (SPEC §4) and optionally the offending `param`.

The code doubles as the `iq36_errors_total{code}` label, so it is drawn from a closed set.
Supervisor errors (`worker.errors.ServiceError`) and the worker's typed error strings
(`ipc.messages.split_error`) map onto the same tree here, in one table.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ipc.messages import split_error
from worker.errors import ServiceError

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
SERVER = "server_error"

# code -> (HTTP status, OpenAI type). The closed set of codes (bounded metrics labels).
CODES: dict[str, tuple[int, str]] = {
    "invalid_request": (400, INVALID_REQUEST),
    "unknown_parameter": (400, INVALID_REQUEST),
    "unsupported_parameter": (400, INVALID_REQUEST),
    "context_length_exceeded": (400, INVALID_REQUEST),
    "output_limit_exceeded": (400, INVALID_REQUEST),
    "unsupported_content_type": (400, INVALID_REQUEST),
    "invalid_api_key": (401, AUTHENTICATION),
    "model_not_found": (404, NOT_FOUND),
    "not_found": (404, NOT_FOUND),
    "response_not_found": (404, NOT_FOUND),
    "method_not_allowed": (405, INVALID_REQUEST),
    "request_too_large": (413, INVALID_REQUEST),
    "unsupported_media_type": (415, INVALID_REQUEST),
    "queue_full": (429, RATE_LIMIT),
    "internal_error": (500, SERVER),
    "worker_restarting": (503, SERVER),
    "worker_lost": (503, SERVER),
    "worker_failed": (503, SERVER),
    "draining": (503, SERVER),
    "shutting_down": (503, SERVER),
    "request_timeout": (504, SERVER),
    "response_store_full": (507, SERVER),
}


class APIError(Exception):
    """A request-level failure, rendered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, code: str, message: str, *, param: str | None = None,
                 retry_after: float | None = None) -> None:
        if code not in CODES:  # keep the label set closed: an unknown code is our bug
            message = f"{code}: {message}"
            code = "internal_error"
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = retry_after

    @property
    def status(self) -> int:
        return CODES[self.code][0]

    @property
    def type(self) -> str:
        return CODES[self.code][1]

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body_bytes(self) -> bytes:
        return msgspec.json.encode(self.body())

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}


def from_service_error(exc: ServiceError) -> APIError:
    """A supervisor refusal or loss (worker_restarting, worker_lost, draining, …)."""
    retry = exc.retry_after
    if retry is None and exc.code in ("worker_lost", "worker_restarting", "draining", "shutting_down",
                                      "worker_failed"):
        retry = 5.0  # every 503 carries Retry-After (SPEC §1)
    return APIError(exc.code, str(exc) or exc.code, retry_after=retry)


def from_worker_error(error: str) -> APIError:
    """The typed error string of a finished StepOutput (`"<code>: <message>"`)."""
    code, message = split_error(error)
    if code not in CODES:
        code, message = "internal_error", error
    return APIError(code, message)


def parameter(param: str, message: str | None = None) -> APIError:
    """400 unsupported_parameter naming the field."""
    return APIError("unsupported_parameter", message or f"'{param}' is not supported by this server",
                    param=param)
