"""Recipes of the dev models and the content keys their cache entries are named by.

A recipe is data: the transformers config of a `qwen3_5_moe_text` model, the seed of its
random init, and how it is exported. Its key hashes the recipe, the builder's own source and
the installed toolchain versions, so a changed builder or pin never reuses a stale model.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Versions that change what the builder produces; part of every key.
TOOLCHAIN = (
    "torch",
    "transformers",
    "optimum",
    "optimum-intel",
    "nncf",
    "openvino",
    "openvino-tokenizers",
    "tokenizers",
    "dashscope",
)

# Qwen3.6-35B-A3B per-layer dims (FACTS.md); dev models change only depth, experts, vocab.
_REAL_DIMS: dict[str, Any] = {
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}

# Shared by every dev model: the real model's context and rope base, Qwen3's padded vocab.
_COMMON: dict[str, Any] = {
    "vocab_size": 151936,
    "max_position_embeddings": 262144,
    "rope_theta": 10_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class Recipe:
    name: str
    config: dict[str, Any]
    seed: int = 0
    # dtype the random checkpoint is materialised in (bf16 halves the bench models' build RAM).
    torch_dtype: str = "float32"
    weight_format: str = "int4"
    export_args: tuple[str, ...] = ("--group-size-fallback", "ignore")
    description: str = ""
    generation_config: dict[str, Any] = field(
        default_factory=lambda: {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    )

    def checkpoint_part(self) -> dict[str, Any]:
        """What determines the Hugging Face checkpoint (shared by int4 and f32 exports)."""
        data = asdict(self)
        for key in ("name", "weight_format", "export_args", "description"):
            data.pop(key)
        return data


def _layers(pattern: list[str], repeat: int) -> dict[str, Any]:
    types = pattern * repeat
    return {"num_hidden_layers": len(types), "layer_types": types}


_LINEAR, _FULL = "linear_attention", "full_attention"

_DEV_TINY = {
    **_COMMON,
    # Every matmul's input dim is a multiple of 128, so int4 group-128 really applies.
    "hidden_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    **_layers([_LINEAR, _LINEAR, _LINEAR, _FULL], 1),
}

RECIPES: dict[str, Recipe] = {
    "dev-tiny": Recipe(
        "dev-tiny",
        _DEV_TINY,
        description="tiny dims, 4 layers, 16 experts top-4; tests and `make serve`",
    ),
    "dev-tiny-f32": Recipe(
        "dev-tiny-f32",
        _DEV_TINY,
        weight_format="fp32",
        export_args=(),
        description="dev-tiny exported without weight compression; f32 reference parity",
    ),
    "dev-bench": Recipe(
        "dev-bench",
        {**_COMMON, **_REAL_DIMS, "num_experts": 64, **_layers([_LINEAR] * 3 + [_FULL], 2)},
        torch_dtype="bfloat16",
        description="real per-layer dims, 8 layers, 64 experts top-8; performance work",
    ),
    "dev-bench-256": Recipe(
        "dev-bench-256",
        {**_COMMON, **_REAL_DIMS, "num_experts": 256, **_layers([_LINEAR, _FULL], 1)},
        torch_dtype="bfloat16",
        description="real per-layer dims, 2 layers, the real 256 experts top-8",
    ),
}


def toolchain_versions() -> dict[str, str]:
    out = {}
    for dist in TOOLCHAIN:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def _builder_source_digest() -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(here.iterdir()):
        if path.suffix in (".py", ".jinja"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _key(payload: dict[str, Any]) -> str:
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def checkpoint_key(recipe: Recipe) -> str:
    return _key(
        {
            "checkpoint": recipe.checkpoint_part(),
            "builder": _builder_source_digest(),
            "toolchain": toolchain_versions(),
        }
    )


def model_key(recipe: Recipe) -> str:
    return _key(
        {
            "checkpoint": checkpoint_key(recipe),
            "weight_format": recipe.weight_format,
            "export_args": list(recipe.export_args),
        }
    )


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise KeyError(f"unknown dev model {name!r}; choose one of: {', '.join(RECIPES)}") from None
