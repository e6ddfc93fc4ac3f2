"""Dev-model builds are deterministic and keyed by their recipe and toolchain."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from iq36 import manifest
from iq36.devmodels import recipes


@pytest.mark.slow
def test_rebuilding_dev_tiny_from_scratch_gives_the_same_fingerprint(tiny_dir: Path, tmp_path: Path,
                                                                     monkeypatch) -> None:
    from iq36.devmodels.build import build

    monkeypatch.setenv("IQ36_HOME", str(tmp_path))  # no cached checkpoint: everything rebuilt
    again = build("dev-tiny", progress=False)
    assert again.parent == tmp_path / "models"
    assert again.name == tiny_dir.name  # same content key
    assert manifest.read_manifest(again)["fingerprint"] == manifest.read_manifest(tiny_dir)["fingerprint"]


def test_key_changes_with_the_recipe_and_the_toolchain(monkeypatch) -> None:
    base = recipes.get_recipe("dev-tiny")
    key = recipes.model_key(base)
    assert recipes.model_key(dataclasses.replace(base, seed=1)) != key
    assert recipes.model_key(dataclasses.replace(base, weight_format="int8")) != key
    assert recipes.model_key(dataclasses.replace(base, config={**base.config, "num_experts": 8})) != key
    versions = recipes.toolchain_versions()
    monkeypatch.setattr(recipes, "toolchain_versions", lambda: {**versions, "nncf": "9.9.9"})
    assert recipes.model_key(base) != key


def test_int4_and_f32_exports_share_one_checkpoint() -> None:
    tiny, f32 = recipes.get_recipe("dev-tiny"), recipes.get_recipe("dev-tiny-f32")
    assert recipes.checkpoint_key(tiny) == recipes.checkpoint_key(f32)
    assert recipes.model_key(tiny) != recipes.model_key(f32)


def test_recipes_have_the_documented_shapes() -> None:
    bench = recipes.get_recipe("dev-bench").config
    assert bench["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3 + ["full_attention"]
    assert (bench["hidden_size"], bench["num_experts"], bench["num_experts_per_tok"]) == (2048, 64, 8)
    assert (bench["linear_num_key_heads"], bench["linear_num_value_heads"]) == (16, 32)
    b256 = recipes.get_recipe("dev-bench-256").config
    assert b256["layer_types"] == ["linear_attention", "full_attention"] and b256["num_experts"] == 256
    tiny = recipes.get_recipe("dev-tiny").config
    # int4 group 128 applies only where a matmul's input dim is a multiple of 128
    for dim in (tiny["hidden_size"], tiny["num_attention_heads"] * tiny["head_dim"],
                tiny["linear_num_value_heads"] * tiny["linear_value_head_dim"],
                tiny["moe_intermediate_size"], tiny["shared_expert_intermediate_size"]):
        assert dim % 128 == 0
    assert tiny["max_position_embeddings"] >= 131072 + 512
