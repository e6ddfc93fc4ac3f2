"""worker/resident.py: a mapped weights file's pages brought into the process (RESIDENT_WEIGHTS)."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from pathlib import Path

import msgspec
import numpy as np
import pytest

from iq36.profile import load
from worker import resident

PAGE = mmap.PAGESIZE


def _resident_bytes(start: int, end: int) -> int:
    """Rss of the mapping [start, end) as /proc/self/smaps reports it, in bytes."""
    kb = resident.mapping_field(start, "Rss")
    assert kb is not None, f"no mapping {start:x}-{end:x} in /proc/self/smaps"
    return kb * 1024


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
    # without its own copy of the weights (`anonymous_weights`, on in `cpu`), which maps no file
    profile = msgspec.structs.replace(profile, kernels={**profile.kernels, "resident_weights": on,
                                                        "anonymous_weights": False})
    engine = create("candidate", tiny_dir, profile)
    try:
        ranges = resident.mappings(tiny_dir / "openvino_model.bin")
        assert ranges  # the plugin reads the weights where the file is mapped
        assert ("resident_weights" in engine.describe()["kernels"]) == on
        if on:
            assert all(_resident_bytes(a, b) == b - a for a, b in ranges)
    finally:
        engine.close()


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "absent"


def test_private_copy_holds_the_file_in_anonymous_memory(tmp_path: Path) -> None:
    """The copy is the file's bytes in an anonymous mapping (the file itself is not mapped),
    advised onto huge pages where the kernel has them, and one copy serves every caller until
    the file changes."""
    path = tmp_path / "openvino_model.bin"
    data = os.urandom(3 * resident.HUGE_PAGE + 12345)  # past a huge page, not a whole number of them
    path.write_bytes(data)
    copy = resident.private_copy(path)
    assert copy is not None and copy.dtype == np.uint8 and copy.tobytes() == data
    assert resident.mappings(path) == []
    address = copy.__array_interface__["data"][0]
    if _thp_mode() in ("always", "madvise"):
        assert resident.mapping_field(address, "THPeligible") == 1
    assert 0 <= resident.huge_page_bytes(copy) <= 4 * resident.HUGE_PAGE
    assert resident.private_copy(path) is copy
    path.write_bytes(data[::-1])  # another file now: another copy
    again = resident.private_copy(path)
    assert again is not None and again is not copy and again.tobytes() == data[::-1]


def test_a_copy_that_cannot_be_had_is_logged_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "openvino_model.bin"
    path.write_bytes(b"\1" * PAGE)

    def no_memory(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    with caplog.at_level(logging.WARNING, logger="worker.resident"):
        assert resident.private_copy(tmp_path / "absent.bin") is None
        monkeypatch.setattr(resident.mmap, "mmap", no_memory)
        assert resident.private_copy(path) is None
    assert "No such file" in caplog.text and "could not be mapped" in caplog.text


@pytest.mark.parametrize("on", [True, False])
def test_the_candidate_engine_reads_its_weights_from_its_own_copy(tiny_dir: Path, on: bool) -> None:
    """With `anonymous_weights` (on in `cpu`) the engine reads the IR's constants from the
    process's copy of the weights file (one copy for every engine of the file) and reports it,
    in place of `resident_weights`; its logits are the file mapping's, bit for bit."""
    from worker.engine import create

    base = load("cpu")
    assert base.kernels["anonymous_weights"] and base.kernels["resident_weights"]
    engines = {flag: create("candidate", tiny_dir, msgspec.structs.replace(
        base, kernels={**base.kernels, "anonymous_weights": flag})) for flag in (on, not on)}
    try:
        kernels = engines[on].describe()["kernels"]
        assert ("anonymous_weights" in kernels) == on and ("resident_weights" in kernels) == (not on)
        if on:  # the engine's copy, kept by `resident`; the rewritten graphs' weights lie in it
            import openvino as ov

            from worker.engine.candidate import specialised_model

            held = {id(c) for c in resident._copies.values()}
            copy = resident.private_copy(tiny_dir / "openvino_model.bin")
            assert copy is not None and id(copy) in held
            start = copy.__array_interface__["data"][0]
            graphs = specialised_model(ov.Core(), tiny_dir, base, ov.Tensor(copy, shared_memory=True))
            big = [op for graph in (graphs[0], graphs[2]) for op in graph.get_ordered_ops()
                   if op.get_type_name() == "Constant" and op.get_byte_size() > 4096]
            assert big and all(start <= op.get_data().__array_interface__["data"][0] < start + copy.nbytes
                               for op in big)
        prompt = list(range(100, 400))
        rows = {flag: list(engine.forced_logits(prompt, [5, 6, 7])) for flag, engine in engines.items()}
        assert all(np.array_equal(a, b) for a, b in zip(rows[True], rows[False], strict=True))
    finally:
        for engine in engines.values():
            engine.close()
