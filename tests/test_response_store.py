"""The stored-responses database: ownership, expiry, limits checked before generating, and data
that survives reopening the file (a restart of the service)."""

from __future__ import annotations

import sqlite3
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.response_store import SCHEMA_VERSION, ResponseStore, StoreFull, owner_of


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _response(id_: str, text: str = "hello") -> dict[str, Any]:
    return {"id": id_, "object": "response", "output": [{"type": "message", "content": [{"text": text}]}]}


_CONTEXT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[ResponseStore]:
    s = ResponseStore(tmp_path / "state" / "responses.sqlite3", max_entries=100, max_bytes=1 << 20, ttl_s=60,
                      clock=clock)
    yield s
    s.close()


def test_put_then_get_returns_the_response_and_its_context(store: ResponseStore, clock: Clock) -> None:
    store.put("resp_1", "alice", _response("resp_1"), _CONTEXT)
    got = store.get("resp_1", "alice")
    assert got is not None
    assert got.response == _response("resp_1") and got.context == _CONTEXT
    assert (got.id, got.owner, got.created_at, got.expires_at) == ("resp_1", "alice", clock.now, clock.now + 60)


def test_missing_id_is_none(store: ResponseStore) -> None:
    assert store.get("resp_nope", "alice") is None


def test_delete_removes_and_reports_whether_it_did(store: ResponseStore) -> None:
    store.put("resp_1", "alice", _response("resp_1"), _CONTEXT)
    assert store.delete("resp_1", "alice") is True
    assert store.get("resp_1", "alice") is None
    assert store.delete("resp_1", "alice") is False


def test_another_owner_sees_nothing_and_cannot_delete(store: ResponseStore) -> None:
    store.put("resp_1", "alice", _response("resp_1"), _CONTEXT)
    assert store.get("resp_1", "bob") is None
    assert store.get("resp_1", "") is None
    assert store.delete("resp_1", "bob") is False
    assert store.get("resp_1", "alice") is not None


def test_putting_an_existing_id_is_refused(store: ResponseStore) -> None:
    store.put("resp_1", "alice", _response("resp_1"), _CONTEXT)
    with pytest.raises(ValueError, match="already stored"):
        store.put("resp_1", "bob", _response("resp_1", "other"), [])
    got = store.get("resp_1", "alice")
    assert got is not None and got.response == _response("resp_1")


def test_expired_responses_are_gone_and_purged(store: ResponseStore, clock: Clock) -> None:
    store.put("resp_old", "alice", _response("resp_old"), _CONTEXT)
    clock.now += 30
    store.put("resp_new", "alice", _response("resp_new"), _CONTEXT)
    clock.now += 30  # resp_old is exactly at its expiry
    assert store.get("resp_old", "alice") is None
    assert store.delete("resp_old", "alice") is False
    assert store.get("resp_new", "alice") is not None
    assert store.stats().entries == 1
    clock.now += 30
    assert store.purge_expired() == 1
    assert store.stats() == (0, 0)


def test_stats_counts_entries_and_json_bytes(store: ResponseStore) -> None:
    import msgspec

    store.put("resp_1", "alice", _response("resp_1"), _CONTEXT)
    store.put("resp_2", "bob", _response("resp_2"), [])
    expected = sum(len(msgspec.json.encode(x)) for x in (_response("resp_1"), _CONTEXT, _response("resp_2"), []))
    assert store.stats() == (2, expected)


def test_reserve_refuses_at_the_entry_limit(tmp_path: Path, clock: Clock) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3", max_entries=2, max_bytes=1 << 20, ttl_s=60, clock=clock)
    store.reserve("alice")
    store.put("resp_1", "alice", _response("resp_1"), _CONTEXT)
    store.reserve("alice")
    store.put("resp_2", "alice", _response("resp_2"), _CONTEXT)
    with pytest.raises(StoreFull, match="2 responses"):
        store.reserve("bob")
    assert store.delete("resp_1", "alice")
    store.reserve("bob")
    store.close()


def test_reserve_refuses_at_the_byte_limit(tmp_path: Path, clock: Clock) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3", max_entries=100, max_bytes=200, ttl_s=60, clock=clock)
    store.reserve("alice")
    store.put("resp_1", "alice", _response("resp_1", "x" * 300), _CONTEXT)
    with pytest.raises(StoreFull, match="limit of 200"):
        store.reserve("alice")
    store.close()


def test_reserve_purges_expired_rows_before_checking(tmp_path: Path, clock: Clock) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3", max_entries=1, max_bytes=1 << 20, ttl_s=60, clock=clock)
    store.put("resp_1", "alice", _response("resp_1"), _CONTEXT)
    with pytest.raises(StoreFull):
        store.reserve("alice")
    clock.now += 61
    store.reserve("alice")
    store.close()


def test_data_survives_reopening_the_file(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "responses.sqlite3"
    first = ResponseStore(path, max_entries=10, max_bytes=1 << 20, ttl_s=60, clock=clock)
    first.put("resp_1", "alice", _response("resp_1"), _CONTEXT)
    first.close()
    second = ResponseStore(path, max_entries=10, max_bytes=1 << 20, ttl_s=60, clock=clock)
    got = second.get("resp_1", "alice")
    assert got is not None and got.context == _CONTEXT
    second.close()


def test_the_file_is_private_versioned_and_in_wal_mode(store: ResponseStore) -> None:
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    db = sqlite3.connect(store.path)
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        db.close()


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(RuntimeError, match="newer"):
        ResponseStore(path, max_entries=10, max_bytes=1000, ttl_s=60)


def test_use_after_close_raises_and_close_is_idempotent(store: ResponseStore) -> None:
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.get("resp_1", "alice")


def test_concurrent_threads_do_not_corrupt_the_store(store: ResponseStore) -> None:
    errors: list[BaseException] = []
    per_thread = 20

    def work(t: int) -> None:
        try:
            for i in range(per_thread):
                rid = f"resp_{t}_{i}"
                store.reserve(f"o{t}")
                store.put(rid, f"o{t}", _response(rid), _CONTEXT)
                got = store.get(rid, f"o{t}")
                assert got is not None and got.response["id"] == rid
                if i % 2:
                    assert store.delete(rid, f"o{t}")
                store.stats()
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,), name=f"store-{t}") for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert store.stats().entries == 4 * per_thread // 2
    db = sqlite3.connect(store.path)
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        db.close()


def test_owner_of_hashes_the_key_and_is_empty_without_auth() -> None:
    assert owner_of(None) == ""
    assert owner_of("sk-1") == owner_of("sk-1") != owner_of("sk-2")
    assert "sk-1" not in owner_of("sk-1") and len(owner_of("sk-1")) == 64
