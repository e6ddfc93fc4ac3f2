"""Locked identity: manifest, fingerprint, verify (CLI and API), hash cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from iq36 import manifest
from iq36.manifest import HashCache, IdentityError, IdentityMode
from tests.helpers import run_cli


def _model(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    (d / "sub").mkdir(parents=True)
    (d / "openvino_model.bin").write_bytes(bytes(range(256)) * 64)
    (d / "config.json").write_text('{"a": 1}')
    (d / "sub" / "x.txt").write_text("x")
    manifest.write_manifest(d, manifest.build_manifest(d))
    return d


def test_fingerprint_covers_every_file(tmp_path: Path) -> None:
    d = _model(tmp_path)
    m = manifest.read_manifest(d)
    assert sorted(m["files"]) == ["config.json", "openvino_model.bin", "sub/x.txt"]
    assert m["fingerprint"] == manifest.fingerprint(m["files"])
    assert manifest.verify(d, cache=HashCache(tmp_path / "c.json")).fingerprint == m["fingerprint"]


def test_flipped_byte_is_named_with_both_hashes(tmp_path: Path) -> None:
    d = _model(tmp_path)
    want = manifest.read_manifest(d)["files"]["openvino_model.bin"]["sha256"]
    blob = bytearray((d / "openvino_model.bin").read_bytes())
    blob[1000] ^= 0x01
    (d / "openvino_model.bin").write_bytes(blob)
    got = manifest.sha256_file(d / "openvino_model.bin")
    with pytest.raises(IdentityError) as err:
        manifest.verify(d, cache=HashCache(tmp_path / "c.json"))
    assert "openvino_model.bin" in str(err.value) and want in str(err.value) and got in str(err.value)
    # metadata mode only compares sizes: the same-size flip passes it, by design.
    manifest.verify(d, IdentityMode.METADATA)


@pytest.mark.parametrize("change", ["missing", "extra", "size"])
def test_file_set_and_size_changes_fail_even_in_metadata_mode(tmp_path: Path, change: str) -> None:
    d = _model(tmp_path)
    if change == "missing":
        (d / "sub" / "x.txt").unlink()
    elif change == "extra":
        (d / "generation_config.json").write_text("{}")
    else:
        (d / "config.json").write_text('{"a": 12}')
    with pytest.raises(IdentityError):
        manifest.verify(d, IdentityMode.METADATA)


def test_edited_manifest_is_caught(tmp_path: Path) -> None:
    d = _model(tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["files"]["config.json"]["sha256"] = "0" * 64
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IdentityError, match="fingerprint does not match"):
        manifest.verify(d, IdentityMode.OFF)


def test_hash_cache_reuses_unchanged_files_and_rehashes_touched_ones(tmp_path: Path, monkeypatch) -> None:
    d = _model(tmp_path)
    cache_file = tmp_path / "c.json"
    manifest.verify(d, cache=HashCache(cache_file))
    calls: list[Path] = []
    real = manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda p, progress=None: calls.append(p) or real(p))
    manifest.verify(d, cache=HashCache(cache_file))
    assert calls == []  # a restart does not rehash
    (d / "config.json").write_text('{"a": 2}')  # same size, new mtime
    with pytest.raises(IdentityError):
        manifest.verify(d, cache=HashCache(cache_file))
    assert [p.name for p in calls] == ["config.json"]


def test_missing_manifest_names_the_lock_command(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="iq36 model lock"):
        manifest.verify(tmp_path)


def test_dev_tiny_manifest_records_weight_formats(tiny_dir: Path) -> None:
    m = manifest.read_manifest(tiny_dir)
    summary = m["weights"]["openvino_model.xml"]["summary"]
    assert summary.get("u4", 0) > 0, summary  # int4 really applied
    tensors = m["weights"]["openvino_model.xml"]["tensors"]
    assert tensors["self.model.lm_head.weight"].startswith("u8")  # LM head int8 (FACTS.md)
    assert set(m["runtime"]) == {"openvino", "openvino_genai", "openvino_tokenizers"}


def test_cli_verify_catches_one_flipped_byte(tiny_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "dev-tiny"
    shutil.copytree(tiny_dir, copy)
    ok = run_cli("model", "verify", str(copy), env={"IQ36_HOME": str(tmp_path / "home")})
    assert ok.returncode == 0 and ok.stdout.startswith("ok sha256:"), ok.stderr
    bin_path = copy / "openvino_model.bin"
    with bin_path.open("r+b") as fh:
        fh.seek(bin_path.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x10]))
    bad = run_cli("model", "verify", str(copy), env={"IQ36_HOME": str(tmp_path / "home")})
    assert bad.returncode == 1
    locked = manifest.read_manifest(copy)["files"]["openvino_model.bin"]["sha256"]
    assert "openvino_model.bin" in bad.stderr and locked in bad.stderr
    assert manifest.sha256_file(bin_path) in bad.stderr


def test_cli_lock_writes_a_manifest_that_verifies(tiny_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "brought"
    shutil.copytree(tiny_dir, copy)
    (copy / "manifest.json").unlink()
    proc = run_cli("model", "lock", str(copy), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == manifest.read_manifest(tiny_dir)["fingerprint"]
    again = run_cli("model", "lock", str(copy))
    assert again.returncode == 1 and "--force" in again.stderr
