"""Locked model identity: `manifest.json` with size + sha256 of every file, one fingerprint.

The manifest also records the format of every weight in the IR (read from the XML, no
OpenVINO needed) and the runtime the model was locked with. Verifying rehashes files unless a
hash cache entry for the same path, size, mtime and inode says the content is known, so a
worker restart does not rehash a 19.7 GB model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from iq36 import paths

MANIFEST = "manifest.json"
FORMAT = "iq36-manifest/1"
_CHUNK = 8 << 20


class IdentityMode(StrEnum):
    FULL = "full"  # sizes and sha256 of every file (cached by path/size/mtime/inode)
    METADATA = "metadata"  # file set and sizes only
    OFF = "off"  # no check (development only)


class IdentityError(Exception):
    """The model on disk is not the one its manifest locks."""


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            if progress:
                progress(len(chunk))
    return digest.hexdigest()


class HashCache:
    """sha256 of files keyed by (realpath, size, mtime_ns, inode); a JSON file, written atomically."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or paths.hash_cache_file()
        try:
            self._entries: dict[str, str] = json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            self._entries = {}

    @staticmethod
    def _key(path: Path) -> str:
        st = path.stat()
        return f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"

    def sha256(self, path: Path) -> str:
        key = self._key(path)
        cached = self._entries.get(key)
        if cached is None:
            cached = self._entries[key] = sha256_file(path)
            self._save()
        return cached

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self._entries, indent=0, sort_keys=True))
        tmp.replace(self.path)


def model_files(model_dir: Path) -> list[str]:
    """Every regular file under the model dir except the manifest, as sorted posix paths."""
    out = []
    for path in model_dir.rglob("*"):
        if path.is_file() and path.name != MANIFEST:
            out.append(path.relative_to(model_dir).as_posix())
    return sorted(out)


def fingerprint(files: dict[str, dict[str, Any]]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{files[name]['size']}\0{files[name]['sha256']}\n".encode())
    return "sha256:" + digest.hexdigest()


def weight_formats(xml_path: Path) -> dict[str, Any]:
    """Element type and shape of every constant of rank >= 2 in an IR, plus a count per type."""
    tensors: dict[str, str] = {}
    for layer in ET.parse(xml_path).getroot().iter("layer"):
        if layer.get("type") != "Const":
            continue
        data = layer.find("data")
        if data is None:
            continue
        shape = [int(d) for d in (data.get("shape") or "").split(",") if d.strip()]
        if len(shape) < 2 or math.prod(shape) < 1024:  # weights, not scalars or masks
            continue
        tensors[layer.get("name", layer.get("id", "?"))] = f"{data.get('element_type')}{shape}"
    summary = Counter(v.split("[", 1)[0] for v in tensors.values())
    return {"summary": dict(sorted(summary.items())), "tensors": dict(sorted(tensors.items()))}


def build_manifest(
    model_dir: Path,
    runtime: dict[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    files = {}
    for name in model_files(model_dir):
        path = model_dir / name
        files[name] = {"size": path.stat().st_size, "sha256": sha256_file(path, progress)}
    manifest: dict[str, Any] = {"format": FORMAT, "fingerprint": fingerprint(files), "files": files}
    weights = {
        name: weight_formats(model_dir / name)
        for name in files
        if name.endswith(".xml") and name.startswith("openvino_model")
    }
    if weights:
        manifest["weights"] = weights
    if runtime is not None:
        manifest["runtime"] = runtime
    return manifest


def write_manifest(model_dir: Path, manifest: dict[str, Any]) -> Path:
    out = model_dir / MANIFEST
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    tmp.replace(out)
    return out


def read_manifest(model_dir: Path) -> dict[str, Any]:
    path = model_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise IdentityError(
            f"{path} is missing: lock the model first with `iq36 model lock {model_dir}`"
        ) from None
    except ValueError as exc:
        raise IdentityError(f"{path} is not valid JSON: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise IdentityError(f"{path}: unknown manifest format {manifest.get('format')!r}")
    return manifest


@dataclass(frozen=True)
class Verified:
    fingerprint: str
    mode: IdentityMode
    files: int


def verify(
    model_dir: Path, mode: IdentityMode = IdentityMode.FULL, cache: HashCache | None = None
) -> Verified:
    """Check the model dir against its manifest; raise IdentityError naming the first difference."""
    manifest = read_manifest(model_dir)
    locked: dict[str, dict[str, Any]] = manifest["files"]
    if fingerprint(locked) != manifest["fingerprint"]:
        raise IdentityError(f"{model_dir / MANIFEST}: fingerprint does not match its file list")
    if mode is IdentityMode.OFF:
        return Verified(manifest["fingerprint"], mode, len(locked))
    present = model_files(model_dir)
    for name in sorted(set(locked) - set(present)):
        raise IdentityError(f"{model_dir / name}: missing (locked sha256 {locked[name]['sha256']})")
    for name in sorted(set(present) - set(locked)):
        raise IdentityError(f"{model_dir / name}: not in the manifest (re-lock if intended)")
    cache = cache if cache is not None else HashCache()
    for name in present:
        path, want = model_dir / name, locked[name]
        size = path.stat().st_size
        if size != want["size"]:
            raise IdentityError(f"{path}: size {size} bytes, locked {want['size']} bytes")
        if mode is IdentityMode.FULL:
            got = cache.sha256(path)
            if got != want["sha256"]:
                raise IdentityError(f"{path}: sha256 {got}, locked {want['sha256']}")
    return Verified(manifest["fingerprint"], mode, len(locked))
