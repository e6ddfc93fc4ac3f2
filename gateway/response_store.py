"""Stored Responses-API responses, in one embedded SQLite file that outlives the process.

A stored response is the response object the client saw plus the conversation context a later
`previous_response_id` chains from (the chat messages up to and including this response's
output, without the request's `instructions`). Rows belong to an owner (an opaque string derived
from the API key; "" when auth is off): a row of another owner is indistinguishable from a
missing one, so ids do not leak across keys.

The store is bounded by entries, bytes (the stored JSON blobs) and a TTL. Capacity is checked by
`reserve` **before** generating (SPEC §4: 507 `response_store_full`); a full store refuses rather
than evicting live data. The bound is soft by at most the requests admitted between a `reserve`
and their `put` (the admission queue's depth): refusing a finished generation would waste it.

One connection (`check_same_thread=False`) behind a lock: safe from one asyncio loop plus
`asyncio.to_thread`. WAL mode; the schema is versioned with `PRAGMA user_version`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    response BLOB NOT NULL,
    context BLOB NOT NULL,
    bytes INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_expires_at ON responses (expires_at);
"""


def owner_of(api_key: str | None) -> str:
    """The owner string of an API key: its SHA-256 (the key itself is never stored); "" without auth."""
    return "" if api_key is None else hashlib.sha256(api_key.encode()).hexdigest()


class StoreFull(Exception):
    """The store is at a limit; the caller answers 507 `response_store_full`."""


@dataclasses.dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    owner: str
    created_at: float
    expires_at: float
    response: dict[str, Any]
    context: list[dict[str, Any]]


class StoreStats(NamedTuple):
    entries: int
    bytes: int


class ResponseStore:
    def __init__(self, path: Path, *, max_entries: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        if max_entries < 1 or max_bytes < 1 or ttl_s <= 0:
            raise ValueError("max_entries, max_bytes and ttl_s must be positive")
        self.path = Path(path)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock  # wall time: expiry must survive a restart
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Created 0600 first: stored conversations are user data, and SQLite gives its -wal/-shm
        # files the database file's mode.
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        self._db: sqlite3.Connection | None = sqlite3.connect(self.path, check_same_thread=False, timeout=10.0)
        try:
            self._migrate(self._db)
        except BaseException:
            self._db.close()
            self._db = None
            raise

    @staticmethod
    def _migrate(db: sqlite3.Connection) -> None:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # with WAL: durable across a process crash
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"the response store schema is version {version}, newer than this server's "
                               f"{SCHEMA_VERSION}")
        if version < SCHEMA_VERSION:
            with db:
                db.executescript(_SCHEMA)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("the response store is closed")
        return self._db

    def _purge(self, db: sqlite3.Connection, now: float) -> int:
        with db:
            return db.execute("DELETE FROM responses WHERE expires_at <= ?", (now,)).rowcount

    def _stats(self, db: sqlite3.Connection) -> StoreStats:
        entries, size = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM responses").fetchone()
        return StoreStats(int(entries), int(size))

    def reserve(self, owner: str) -> None:
        """Refuse (StoreFull) when the store is at its entry or byte limit; called before generating.
        `owner` is accepted for per-owner quotas; today the limits are global."""
        del owner
        with self._lock:
            db = self._conn()
            self._purge(db, self._clock())
            stats = self._stats(db)
        if stats.entries >= self.max_entries:
            raise StoreFull(f"the response store holds {stats.entries} responses, its limit of "
                            f"{self.max_entries}; delete stored responses or send store=false")
        if stats.bytes >= self.max_bytes:
            raise StoreFull(f"the response store holds {stats.bytes} bytes, its limit of {self.max_bytes}; "
                            "delete stored responses or send store=false")

    def put(self, id: str, owner: str, response: dict[str, Any], context: list[dict[str, Any]]) -> None:
        """Store a finished response; raises ValueError if the id is already stored."""
        blob = msgspec.json.encode(response)
        ctx = msgspec.json.encode(context)
        with self._lock:
            db = self._conn()
            now = self._clock()
            self._purge(db, now)
            try:
                with db:
                    db.execute("INSERT INTO responses (id, owner, created_at, expires_at, response, context, bytes) "
                               "VALUES (?, ?, ?, ?, ?, ?, ?)",
                               (id, owner, now, now + self.ttl_s, blob, ctx, len(blob) + len(ctx)))
            except sqlite3.IntegrityError:
                raise ValueError(f"the response '{id}' is already stored") from None

    def get(self, id: str, owner: str) -> StoredResponse | None:
        """The stored response, or None when missing, expired or another owner's."""
        with self._lock:
            row = self._conn().execute(
                "SELECT created_at, expires_at, response, context FROM responses "
                "WHERE id = ? AND owner = ? AND expires_at > ?", (id, owner, self._clock())).fetchone()
        if row is None:
            return None
        created_at, expires_at, blob, ctx = row
        return StoredResponse(id, owner, created_at, expires_at, msgspec.json.decode(blob), msgspec.json.decode(ctx))

    def delete(self, id: str, owner: str) -> bool:
        """Delete a live response of this owner; False when there was none (missing, expired, other owner)."""
        with self._lock:
            db = self._conn()
            with db:
                n = db.execute("DELETE FROM responses WHERE id = ? AND owner = ? AND expires_at > ?",
                               (id, owner, self._clock())).rowcount
        return n > 0

    def purge_expired(self) -> int:
        """Delete expired rows now; the number deleted."""
        with self._lock:
            return self._purge(self._conn(), self._clock())

    def stats(self) -> StoreStats:
        """Live entries and their bytes (expired rows are purged first)."""
        with self._lock:
            db = self._conn()
            self._purge(db, self._clock())
            return self._stats(db)

    def close(self) -> None:
        """Checkpoint the WAL into the database file and close; idempotent."""
        with self._lock:
            if self._db is None:
                return
            db, self._db = self._db, None
            try:
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                db.close()
