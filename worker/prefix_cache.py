"""Prefix-state reuse: exact token-prefix snapshots of the model's whole state (SPEC §4).

The IR is stateful and hybrid: Gated-DeltaNet layers carry a conv and an ssm state (fixed
size), full-attention layers carry KV (grows with the tokens). A snapshot is a copy of every
state variable after the model has consumed exactly `tokens`; restoring it and feeding the
rest of a prompt continues as if the whole prompt had been fed (FACTS.md: a restored state
reproduces later logits). Unlike a KV cache, a recurrent state cannot be cut back to a shorter
prefix, so an entry serves only prompts that extend its tokens exactly.

`PrefixStateCache` owns the entries and their bounds (count, bytes, idle time; LRU order);
`snapshot` / `restore` move states between an OpenVINO InferRequest and numpy arrays. The
cache is not thread-safe: the engine loop is its only user. Expiry is lazy (checked on every
call), because the worker sleeps on its inbox while idle and runs no timers.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

States = dict[str, np.ndarray]  # state variable name -> copy of its value


@dataclass(eq=False)
class PrefixEntry:
    tokens: np.ndarray  # int64: exactly the tokens whose state this is, in order
    states: States
    nbytes: int  # states + tokens
    last_used: float = field(default=0.0)

    @property
    def length(self) -> int:
        return int(self.tokens.size)


class PrefixStateCache:
    """Snapshots keyed by their exact token sequence, bounded by entries, bytes and idle time.

    `lookup` returns the longest entry whose tokens are a proper prefix of the prompt: at least
    one prompt token must remain to be fed, because sampling needs that position's logits and a
    snapshot holds no logits. Eviction is least-recently-used (a hit or a store counts as a use).
    The bounds hold for what is kept; while `snapshot` copies a new state, that copy (at most
    `max_bytes`) exists beside the entries until `put` makes room for it.
    """

    def __init__(self, max_bytes: int, max_entries: int, idle_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 0 or max_entries < 0 or idle_s < 0:
            raise ValueError("prefix cache bounds must be non-negative")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.idle_s = idle_s
        self._clock = clock
        self._entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()  # LRU first
        self.total_bytes = 0
        # counters for logs, metrics and tests
        self.hits = 0
        self.misses = 0
        self.stores = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[PrefixEntry]:
        """The entries, least recently used first (a copy of the list; the entries are shared)."""
        return list(self._entries.values())

    def lookup(self, prompt: Sequence[int] | np.ndarray) -> PrefixEntry | None:
        """The longest entry whose tokens are a proper prefix of `prompt`, marked as used."""
        now = self._clock()
        self._expire(now)
        ids = np.asarray(prompt, dtype=np.int64)
        best: PrefixEntry | None = None
        for entry in self._entries.values():
            n = entry.length
            if n < ids.size and (best is None or n > best.length) and np.array_equal(ids[:n], entry.tokens):
                best = entry
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self._touch(best, now)
        return best

    def put(self, tokens: Sequence[int] | np.ndarray, states: States) -> bool:
        """Keep `states` as the snapshot after `tokens`; False when it cannot fit at all.

        An entry for the same tokens is replaced. Least recently used entries are evicted
        until the new one fits both the entry and the byte bound.
        """
        now = self._clock()
        self._expire(now)
        key_tokens = np.array(tokens, dtype=np.int64)  # our own copy: the caller's may change
        if key_tokens.size == 0:
            raise ValueError("a snapshot needs at least one token")
        nbytes = key_tokens.nbytes + sum(int(a.nbytes) for a in states.values())
        if self.max_entries == 0 or nbytes > self.max_bytes:
            return False
        key = key_tokens.tobytes()
        old = self._entries.pop(key, None)
        if old is not None:
            self.total_bytes -= old.nbytes
        while self._entries and (len(self._entries) >= self.max_entries
                                 or self.total_bytes + nbytes > self.max_bytes):
            self._evict_oldest()
        entry = PrefixEntry(tokens=key_tokens, states=states, nbytes=nbytes, last_used=now)
        self._entries[key] = entry
        self.total_bytes += nbytes
        self.stores += 1
        return True

    def prune(self) -> None:
        """Drop entries idle for longer than `idle_s`."""
        self._expire(self._clock())

    def clear(self) -> None:
        self._entries.clear()
        self.total_bytes = 0

    def _touch(self, entry: PrefixEntry, now: float) -> None:
        entry.last_used = now
        self._entries.move_to_end(entry.tokens.tobytes())

    def _expire(self, now: float) -> None:
        # LRU order is last-use order, so the idle entries are at the front.
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if now - oldest.last_used <= self.idle_s:
                return
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.total_bytes -= entry.nbytes
        self.evictions += 1


def snapshot(request: Any, max_bytes: int, copy: bool = True) -> States | None:
    """Copies of every state variable of an OpenVINO InferRequest, or None past `max_bytes`.

    Variables are copied one at a time and the copy stops as soon as the total would exceed
    `max_bytes`, so a state too large to keep (a 131k-token KV of the real model is GBs) is
    never copied whole only to be dropped. `copy=False`: views of the request's state tensors
    instead (each keeps its tensor alive), valid until the request runs or resets: for moving a
    state straight into another request, whose restore copies it.
    """
    states: States = {}
    total = 0
    for variable in request.query_state():
        tensor = variable.state
        total += int(tensor.byte_size)
        if total > max_bytes:
            return None
        states[variable.name] = np.array(tensor.data, copy=copy)
    return states


def restore(request: Any, states: Mapping[str, np.ndarray]) -> None:
    """Set every state variable of `request` from a snapshot of the same compiled model.

    Raises ValueError, before touching anything, unless the snapshot names exactly the
    request's variables: a partly restored state would silently compute garbage.
    """
    import openvino as ov

    variables = list(request.query_state())
    names = {v.name for v in variables}
    if names != set(states):
        missing, extra = sorted(names - set(states)), sorted(set(states) - names)
        raise ValueError(f"snapshot does not match the model's state: missing {missing}, unexpected {extra}")
    for variable in variables:
        # shared_memory: no extra copy on the TTFT path. Setting a state copies the tensor into
        # the plugin's own memory, so inference never writes into the cached array (tested).
        variable.state = ov.Tensor(states[variable.name], shared_memory=True)
