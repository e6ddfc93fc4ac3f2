"""Engine profiles: typed, validated TOML with a hash of what changes numerics or speed.

A profile names the device, the OpenVINO properties, prefill chunking, which kernels apply,
limits, memory-guard thresholds, the prefix-state cache's bounds and the Responses store's
bounds. Only the `engine`, `prefill` and `kernels` tables enter the profile hash (SPEC §2):
queue sizes, limits, guard thresholds and cache/store bounds are service settings and do not
change what the model computes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec

import profiles

PropertyValue = str | int | float | bool


class EngineSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    device: str = "CPU"
    properties: dict[str, PropertyValue] = {}
    # genai LLMPipeline attention backend for the stock engine ("PA" or "SDPA"); None = default.
    attention_backend: str | None = None


class LongContextSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Prefill settings for prompts of at least `from_tokens` tokens (the long-context profile)."""

    from_tokens: int
    chunk_tokens: int


class PrefillSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    chunk_tokens: int = 1024  # the short-context profile (every prompt when `long` is absent)
    long: LongContextSection | None = None

    def context(self, prompt_tokens: int) -> str:
        """Which context profile a prompt of this length runs under: "short" or "long"."""
        return "long" if self.long is not None and prompt_tokens >= self.long.from_tokens else "short"

    def chunk_for(self, prompt_tokens: int) -> int:
        """Tokens per prefill call for a prompt of this length (chosen here, never by the caller)."""
        return self.long.chunk_tokens if self.context(prompt_tokens) == "long" else self.chunk_tokens  # type: ignore[union-attr]


class LimitsSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    max_prompt_tokens: int = 131072
    max_output_tokens: int = 512


class MemoryGuardSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    max_worker_rss_bytes: int = 0
    min_available_bytes: int = 0


class PrefixCacheSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Bounds of the candidate engine's prefix-state snapshots (worker/prefix_cache.py)."""

    enabled: bool = True
    max_bytes: int = 2 * 1024**3
    max_entries: int = 8
    idle_s: float = 600.0


class ResponsesSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Bounds of the Responses API store (stored responses, SPEC §4)."""

    max_entries: int = 10000
    max_bytes: int = 256 * 1024**2
    ttl_s: float = 30 * 24 * 3600.0


class Profile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    description: str = ""
    engine: EngineSection = EngineSection()
    prefill: PrefillSection = PrefillSection()
    kernels: dict[str, bool] = {}
    limits: LimitsSection = LimitsSection()
    memory_guard: MemoryGuardSection = MemoryGuardSection()
    prefix_cache: PrefixCacheSection = PrefixCacheSection()
    responses: ResponsesSection = ResponsesSection()
    source: str = ""  # where it was loaded from; not part of the file format

    def engine_part(self) -> dict[str, Any]:
        """The part that changes numerics or speed, as plain data."""
        return {
            "engine": msgspec.to_builtins(self.engine),
            "prefill": msgspec.to_builtins(self.prefill),
            "kernels": dict(sorted(self.kernels.items())),
        }

    @property
    def hash(self) -> str:
        blob = json.dumps(self.engine_part(), sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()


class ProfileError(Exception):
    pass


def resolve(name_or_path: str) -> Path:
    """A shipped profile's name (`cpu`) or a path to a TOML file."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        return path
    shipped = profiles.DIR / f"{name_or_path}.toml"
    if shipped.is_file():
        return shipped
    raise ProfileError(
        f"unknown profile {name_or_path!r}: pass a TOML path or one of {', '.join(profiles.available())}"
    )


def load(name_or_path: str) -> Profile:
    path = resolve(name_or_path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from None
    try:
        prof = msgspec.toml.decode(raw, type=Profile)
    except msgspec.ValidationError as exc:
        raise ProfileError(f"invalid profile {path}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProfileError(f"profile {path} is not valid TOML: {exc}") from None
    if prof.prefill.chunk_tokens <= 0:
        raise ProfileError(f"invalid profile {path}: prefill.chunk_tokens must be positive")
    long = prof.prefill.long
    if long is not None and (long.from_tokens <= 1 or long.chunk_tokens <= 0):
        raise ProfileError(f"invalid profile {path}: prefill.long needs from_tokens > 1 and chunk_tokens > 0, "
                           f"got {long.from_tokens} and {long.chunk_tokens}")
    bounds = {
        "prefix_cache.max_bytes": prof.prefix_cache.max_bytes,
        "prefix_cache.max_entries": prof.prefix_cache.max_entries,
        "prefix_cache.idle_s": prof.prefix_cache.idle_s,
        "responses.max_entries": prof.responses.max_entries,
        "responses.max_bytes": prof.responses.max_bytes,
        "responses.ttl_s": prof.responses.ttl_s,
    }
    for key, value in bounds.items():
        if value < 0:
            raise ProfileError(f"invalid profile {path}: {key} must not be negative, got {value}")
    return msgspec.structs.replace(prof, source=str(path))
