"""worker/resident.py: a mapped weights file's pages brought into the process (RESIDENT_WEIGHTS)."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from pathlib import Path

import msgspec
import pytest

from iq36.profile import load
from worker import resident

PAGE = mmap.PAGESIZE


def _resident_bytes(start: int, end: int) -> int:
    """Rss of the mapping [start, end) as /proc/self/smaps reports it, in bytes."""
    inside = False
    with open("/proc/self/smaps", encoding="utf-8") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = (a, b) == (start, end)
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping {start:x}-{end:x} in /proc/self/smaps")


def _address(m: mmap.mmap) -> int:
    """Where `m` starts (a copy-on-write mapping: ctypes takes writable buffers only; its pages
    stay the file's until written)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    path = tmp_path / "openvino_model.bin"
    path.write_bytes(os.urandom(256 * PAGE))
    return path


@pytest.fixture(scope="module")
def populates(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skips where the kernel has no MADV_POPULATE_READ (before Linux 5.14): there the engine
    logs why and leaves the pages to come in as read (`test_a_refused_madvise_is_logged_not_raised`)."""
    import platform

    path = tmp_path_factory.mktemp("populate") / "probe.bin"
    path.write_bytes(b"\1" * PAGE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY):
        if resident.populate(path) != PAGE:
            pytest.skip(f"this kernel ({platform.release()}) has no madvise(MADV_POPULATE_READ) (Linux 5.14+)")


@pytest.mark.usefixtures("populates")
def test_populate_maps_every_page_of_the_files_mappings(weights: Path) -> None:
    with open(weights, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
        start = _address(m)
        end = start + 256 * PAGE
        assert resident.mappings(weights) == [(start, end)]
        assert _resident_bytes(start, end) == 0  # nothing read yet
        assert resident.populate(weights) == 256 * PAGE
        assert _resident_bytes(start, end) == 256 * PAGE


def test_mappings_match_the_file_under_any_name(weights: Path, tmp_path: Path) -> None:
    link = tmp_path / "link.bin"
    link.symlink_to(weights)
    other = tmp_path / "other.bin"
    other.write_bytes(b"\0" * PAGE)
    with open(link, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
        start = _address(m)
        assert resident.mappings(weights) == resident.mappings(link) == [(start, start + 256 * PAGE)]
        assert resident.mappings(other) == []


def test_an_unmapped_file_populates_nothing(weights: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="worker.resident"):
        assert resident.populate(weights) == 0
    assert "is not mapped" in caplog.text


def test_a_refused_madvise_is_logged_not_raised(weights: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(resident, "MADV_POPULATE_READ", 12345)  # no such advice: EINVAL
    with open(weights, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
        start = _address(m)
        with caplog.at_level(logging.WARNING, logger="worker.resident"):
            assert resident.populate(weights) == 0
        assert _resident_bytes(start, start + 256 * PAGE) == 0
    assert "MADV_POPULATE_READ" in caplog.text and "Linux 5.14" in caplog.text


def test_a_missing_file_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="worker.resident"):
        assert resident.populate(tmp_path / "absent.bin") == 0
    assert "cannot list" in caplog.text


@pytest.mark.usefixtures("populates")
@pytest.mark.parametrize("on", [True, False])
def test_the_candidate_engine_makes_its_weights_file_resident(tiny_dir: Path, on: bool) -> None:
    """With the switch (on in `cpu`) every page of the engine's mappings of the IR's weights file
    is in the process after load, and the engine reports it; without it, it does not."""
    from worker.engine import create

    profile = load("cpu")
    assert profile.kernels["resident_weights"]
    profile = msgspec.structs.replace(profile, kernels={**profile.kernels, "resident_weights": on})
    engine = create("candidate", tiny_dir, profile)
    try:
        ranges = resident.mappings(tiny_dir / "openvino_model.bin")
        assert ranges  # the plugin reads the weights where the file is mapped
        assert ("resident_weights" in engine.describe()["kernels"]) == on
        if on:
            assert all(_resident_bytes(a, b) == b - a for a, b in ranges)
    finally:
        engine.close()
