"""Service settings: how the supervisor runs the worker (timeouts, backoff, guard polling, paths)
and how the gateway admits requests (queue size, deadline, drain grace, body limit).

These never change what the model computes, so they are not part of the profile hash; the
memory-guard thresholds themselves live in the profile (`[memory_guard]`, also unhashed).
Built once from CLI arguments and `IQ36_*` environment variables; nothing reads them at import.
Also owns the JSON-lines log format both processes use.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec

DEFAULT_STATE_DIR = Path("~/.local/state/iq36")


class ServiceSettings(msgspec.Struct, frozen=True, kw_only=True):
    # Liveness: the worker's IO thread answers a Ping every interval; no frame for `deadline`
    # seconds while the process is alive = hung (killed and replaced).
    heartbeat_interval_s: float = 0.5
    heartbeat_deadline_s: float = 5.0
    # From spawn to READY (identity check + compile + warm-up). The real model compiles in minutes.
    startup_timeout_s: float = 900.0
    # Restart backoff after a crash / hang / guard trip: initial * 2^(n-1), capped; n resets once
    # a worker has stayed up `backoff_reset_s`; after `max_consecutive_restarts` short-lived
    # workers in a row the state becomes `failed` instead of looping.
    restart_backoff_initial_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    backoff_reset_s: float = 60.0
    max_consecutive_restarts: int = 5
    # Retry-After hint for requests refused while a worker is (re)starting.
    retry_after_s: float = 5.0
    memory_poll_interval_s: float = 1.0
    # After a Shutdown frame, how long the worker gets before SIGKILL.
    shutdown_grace_s: float = 5.0
    # Before READY the worker runs one untimed request of this many prompt tokens (and two
    # generated): the plugin's one-off work on the first long prefill (e.g. converting its
    # compressed weights for the larger matmul kernels: ~0.7 s on dev-bench) and the first decode
    # steps then happen at startup, not in the first user's request. 0 disables it.
    warmup_tokens: Annotated[int, msgspec.Meta(ge=0)] = 128
    # --- the HTTP gateway (admission, deadlines, shutdown) ---
    # Requests waiting behind the one running; one more is refused with 429 queue_full.
    max_queue: int = 8
    # Per-request deadline from admission (queue wait included): then 504 and the generation
    # is aborted. 0 disables it.
    request_timeout_s: float = 600.0
    # On SIGTERM: how long admitted requests may still run before they are aborted.
    drain_grace_s: float = 30.0
    # Request bodies above this are refused with 413 (a 131k-token prompt fits in 4 MiB).
    max_body_bytes: int = 4 << 20
    state_dir: Path = DEFAULT_STATE_DIR  # `build` expands `~`
    control_socket: Path | None = None  # None = <state_dir>/control.sock

    @property
    def control_socket_path(self) -> Path:
        return self.control_socket or self.state_dir / "control.sock"

    @classmethod
    def build(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> ServiceSettings:
        """Defaults < `IQ36_<FIELD>` environment variables < explicit overrides (CLI)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for field in msgspec.structs.fields(cls):
            raw = env.get(f"IQ36_{field.name.upper()}")
            if raw is not None and raw != "":
                values[field.name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        # msgspec does not convert str -> Path; paths are taken as given, `~` expanded.
        values.setdefault("state_dir", DEFAULT_STATE_DIR)
        paths = {k: Path(v).expanduser() for k in ("state_dir", "control_socket")
                 if (v := values.pop(k, None)) is not None}
        try:
            settings = msgspec.convert(values, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid service setting: {exc}") from None
        return msgspec.structs.replace(settings, **paths)


# `extra=` keys written when present: ids, and the gateway's per-request numbers (never text).
_EXTRA_KEYS = ("request_id", "generation", "pid", "status", "duration_s", "endpoint", "code",
               "prompt_tokens", "completion_tokens", "finish_reason", "engine_request_id")


class _JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in _EXTRA_KEYS:
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: int = logging.INFO) -> None:
    """JSON lines on stderr (stdout carries the service's own event lines)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonLines())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
