"""What the gateway knows about the served model without loading it: its id, identity
(fingerprint, profile hash, runtime — refreshed from each worker's READY), the profile's limits,
and the sampling defaults of its `generation_config.json` (read as plain JSON: no OpenVINO here).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from iq36.profile import Profile

log = logging.getLogger(__name__)

# Sampling parameters an engine cannot honour (400 unsupported_parameter up front rather than a
# worker-side ValueError): genai's penalties differ from OpenAI's semantics, so `stock` refuses them.
ENGINE_UNSUPPORTED: dict[str, tuple[str, ...]] = {
    "stock": ("presence_penalty", "frequency_penalty"),
}


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    """Used where the client omits a value: the model's generation_config.json, else OpenAI's."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def read(cls, model_dir: Path) -> SamplingDefaults:
        try:
            cfg = json.loads((model_dir / "generation_config.json").read_text())
        except (OSError, ValueError):
            return cls()
        if not isinstance(cfg, dict):
            return cls()
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            v = cfg.get(field.name)
            if isinstance(v, int | float) and not isinstance(v, bool):
                values[field.name] = int(v) if field.name == "top_k" else float(v)
        if cfg.get("do_sample") is False:
            values["temperature"] = 0.0  # transformers: do_sample false = greedy
        return cls(**values)


@dataclasses.dataclass
class ModelInfo:
    id: str
    model_dir: Path
    engine: str
    profile: Profile
    defaults: SamplingDefaults
    fingerprint: str | None = None
    runtime: dict[str, Any] = dataclasses.field(default_factory=dict)
    graph: str | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def max_output_tokens(self) -> int:
        return self.profile.limits.max_output_tokens

    @property
    def max_prompt_tokens(self) -> int:
        return self.profile.limits.max_prompt_tokens

    @property
    def unsupported_params(self) -> tuple[str, ...]:
        return ENGINE_UNSUPPORTED.get(self.engine, ())

    def on_ready(self, identity: dict[str, Any]) -> None:
        """Take the identity a worker reported at READY (what it verified and runs)."""
        fingerprint = (identity.get("model") or {}).get("fingerprint")
        if fingerprint:
            self.fingerprint = fingerprint
        runtime = identity.get("runtime")
        if isinstance(runtime, dict):
            self.runtime = runtime
        resolved = identity.get("resolved")
        if isinstance(resolved, dict) and isinstance(resolved.get("graph"), str):
            self.graph = resolved["graph"]  # the candidate's specialised graph (kernels/graph_hash.py)

    def card(self) -> dict[str, Any]:
        """The OpenAI model object, with the locked identity as extra fields."""
        return {
            "id": self.id,
            "object": "model",
            "created": self.created,
            "owned_by": "iq36",
            "engine": self.engine,
            "fingerprint": self.fingerprint,
            "profile": {"name": self.profile.name, "hash": self.profile.hash},
            "graph": self.graph,
            "runtime": self.runtime,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_output_tokens": self.max_output_tokens,
        }
