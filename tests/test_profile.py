"""Profiles and the identity check at worker start."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import msgspec
import pytest

import profiles
from iq36 import manifest
from iq36.manifest import IdentityError, IdentityMode
from iq36.profile import PrefillSection, ProfileError, load
from worker.identity import check


def test_every_shipped_profile_loads() -> None:
    assert {"cpu", "cpu-f32"} <= set(profiles.available())
    for name in profiles.available():
        prof = load(name)
        assert prof.name == name and prof.hash.startswith("sha256:")


def test_hash_covers_numerics_not_service_settings(tmp_path: Path) -> None:
    base = (profiles.DIR / "cpu.toml").read_text()
    h = load("cpu").hash
    limits = tmp_path / "limits.toml"
    limits.write_text(base.replace("max_output_tokens = 512", "max_output_tokens = 256"))
    assert load(str(limits)).hash == h
    props = tmp_path / "props.toml"
    props.write_text(base.replace('PERFORMANCE_HINT = "LATENCY"', 'PERFORMANCE_HINT = "THROUGHPUT"'))
    assert load(str(props)).hash != h


def test_typo_in_profile_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text((profiles.DIR / "cpu.toml").read_text().replace("chunk_tokens", "chunk_tokenz"))
    with pytest.raises(ProfileError, match="chunk_tokenz"):
        load(str(bad))


def test_unknown_profile_lists_the_shipped_ones() -> None:
    with pytest.raises(ProfileError, match="cpu-f32"):
        load("gpu-fast")


def test_identity_check_returns_all_three(tiny_dir: Path) -> None:
    ident = check(tiny_dir, load("cpu"), IdentityMode.FULL)
    assert ident["model"]["fingerprint"] == manifest.read_manifest(tiny_dir)["fingerprint"]
    assert set(ident["runtime"]) == {"openvino", "openvino_genai", "openvino_tokenizers"}
    assert ident["profile"] == {"name": "cpu", "hash": load("cpu").hash}


def test_identity_check_refuses_another_runtime(tiny_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m"
    shutil.copytree(tiny_dir, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["runtime"]["openvino"] = "2025.0.0-old"
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IdentityError, match="2025.0.0-old"):
        check(copy, load("cpu"), IdentityMode.METADATA)


def test_identity_check_refuses_an_unexpected_profile(tiny_dir: Path) -> None:
    with pytest.raises(IdentityError, match="expected sha256:0000"):
        check(tiny_dir, load("cpu"), IdentityMode.METADATA, expect_profile_hash="sha256:0000")
    check(tiny_dir, load("cpu"), IdentityMode.METADATA, expect_profile_hash=load("cpu").hash)


def test_profile_roundtrips_to_builtins() -> None:
    data = msgspec.to_builtins(load("cpu-f32"))
    assert data["engine"]["properties"]["INFERENCE_PRECISION_HINT"] == "f32"


def test_context_profile_is_chosen_by_prompt_length() -> None:
    for name in ("cpu", "cpu-f32"):
        prefill = load(name).prefill
        assert prefill.long is not None
        b, short, long = prefill.long.from_tokens, prefill.chunk_tokens, prefill.long.chunk_tokens
        assert [prefill.context(n) for n in (1, b - 1, b, 131072)] == ["short", "short", "long", "long"]
        assert [prefill.chunk_for(n) for n in (b - 1, b, b + 1)] == [short, long, long]
    bare = msgspec.structs.replace(load("cpu"), prefill=PrefillSection(chunk_tokens=64))
    assert bare.prefill.context(131072) == "short" and bare.prefill.chunk_for(131072) == 64


def test_long_context_section_is_validated(tmp_path: Path) -> None:
    base = (profiles.DIR / "cpu.toml").read_text()
    path = tmp_path / "bad-long.toml"
    path.write_text(re.sub(r"(?m)^from_tokens = .*$", "from_tokens = 0", base))
    with pytest.raises(ProfileError, match="from_tokens > 1"):
        load(str(path))
    path.write_text(re.sub(r"(?m)^from_tokens = .*$\n", "", base))
    with pytest.raises(ProfileError, match="from_tokens"):
        load(str(path))
    assert load("cpu").hash != msgspec.structs.replace(load("cpu"), prefill=PrefillSection()).hash
