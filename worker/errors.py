"""Errors a caller of the supervisor sees. `code` is the stable API error code (SPEC §4), which
the gateway maps to an HTTP status and also uses as the metrics label; `retry_after` (seconds)
becomes the Retry-After header where set."""

from __future__ import annotations

from typing import ClassVar


class ServiceError(Exception):
    code: ClassVar[str] = "internal_error"

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class WorkerLost(ServiceError):
    """The worker died or was replaced while this request was running."""

    code = "worker_lost"


class WorkerRestarting(ServiceError):
    """No worker is ready yet; one is starting."""

    code = "worker_restarting"


class WorkerFailed(ServiceError):
    """No worker can start; an operator must act (the message says why)."""

    code = "worker_failed"


class Draining(ServiceError):
    code = "draining"


class ShuttingDown(ServiceError):
    code = "shutting_down"
