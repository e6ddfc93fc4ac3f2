"""Prefix-state reuse (worker/prefix_cache.py and its use in the candidate engine).

The cache's bounds are checked with small numpy states and a fake clock. The engine tests run
the candidate on dev-tiny-f32 with the `cpu-f32` profile (the f32 reference mode, where a
restored state must give exactly the tokens of a full prefill) and a small prefill chunk, so
prompts span several chunks and a restore lands off the chunk grid.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

import profiles
from iq36.profile import PrefillSection, Profile, ProfileError, load
from tests.helpers import REFERENCE, final, tokens_of
from tests.helpers import run_engine as run
from worker.detok import OutputStream
from worker.engine import EngineRequest, FinishReason, SamplingParams, StepOutput, create
from worker.engine.candidate import CandidateEngine
from worker.prefix_cache import PrefixStateCache, restore, snapshot
from worker.tokenizer import ModelTokenizer

CHUNK = 8
FIRST = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs; "
    "how vexingly quick daft zebras jump!"
)
FOLLOW_UP = " Now tell me, in one sentence, why the sphinx of black quartz judged my vow."
OTHER = "An unrelated prompt about copper lattices, granite harbors and saffron orbits."


# -- the cache, without a model --------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _states(nbytes: int) -> dict[str, np.ndarray]:
    return {"ssm": np.zeros(nbytes // 2, dtype=np.uint8), "key": np.ones(nbytes - nbytes // 2, dtype=np.uint8)}


def _cost(tokens: list[int], nbytes: int) -> int:
    return 8 * len(tokens) + nbytes  # int64 token ids + the states


def test_lookup_returns_the_longest_proper_prefix() -> None:
    cache = PrefixStateCache(max_bytes=10_000, max_entries=8, idle_s=60)
    cache.put([1, 2], _states(10))
    cache.put([1, 2, 3, 4], _states(10))
    cache.put([1, 2, 3, 4, 5, 6, 7], _states(10))
    entry = cache.lookup([1, 2, 3, 4, 5, 9])
    assert entry is not None and entry.tokens.tolist() == [1, 2, 3, 4]


def test_an_exact_match_is_not_a_hit() -> None:
    """At least one prompt token must be fed: sampling needs its logits."""
    cache = PrefixStateCache(max_bytes=10_000, max_entries=8, idle_s=60)
    cache.put([1, 2, 3], _states(10))
    assert cache.lookup([1, 2, 3]) is None
    assert cache.lookup([1, 2, 3, 4]) is not None
    assert (cache.hits, cache.misses) == (1, 1)


def test_a_diverging_prompt_misses() -> None:
    cache = PrefixStateCache(max_bytes=10_000, max_entries=8, idle_s=60)
    cache.put([1, 2, 3], _states(10))
    assert cache.lookup([1, 2, 4, 5]) is None
    assert cache.lookup([2]) is None


def test_entry_count_evicts_the_least_recently_used() -> None:
    cache = PrefixStateCache(max_bytes=10_000, max_entries=2, idle_s=60)
    cache.put([1], _states(10))
    cache.put([2], _states(10))
    assert cache.lookup([1, 0]) is not None  # [1] is now the most recently used
    cache.put([3], _states(10))
    assert [e.tokens.tolist() for e in cache.entries()] == [[1], [3]]
    assert cache.evictions == 1


def test_byte_bound_evicts_until_the_new_entry_fits() -> None:
    budget = 3 * _cost([1], 100)
    cache = PrefixStateCache(max_bytes=budget, max_entries=100, idle_s=60)
    for t in range(5):
        cache.put([t], _states(100))
        assert cache.total_bytes <= budget
    assert [e.tokens.tolist() for e in cache.entries()] == [[2], [3], [4]]
    assert cache.put([9], _states(2 * _cost([1], 100) - 8))  # the room of exactly two small entries
    assert [e.tokens.tolist() for e in cache.entries()] == [[4], [9]]
    assert cache.total_bytes == sum(e.nbytes for e in cache.entries()) == budget


def test_an_entry_larger_than_the_budget_is_not_stored() -> None:
    cache = PrefixStateCache(max_bytes=1000, max_entries=8, idle_s=60)
    cache.put([1], _states(100))
    assert not cache.put([2], _states(2000))
    assert [e.tokens.tolist() for e in cache.entries()] == [[1]]  # nothing was evicted for it
    assert cache.stores == 1


def test_zero_entries_stores_nothing() -> None:
    cache = PrefixStateCache(max_bytes=1000, max_entries=0, idle_s=60)
    assert not cache.put([1], _states(10))
    assert len(cache) == 0


def test_idle_entries_expire() -> None:
    clock = FakeClock()
    cache = PrefixStateCache(max_bytes=10_000, max_entries=8, idle_s=10, clock=clock)
    cache.put([1], _states(10))
    clock.now = 5
    cache.put([2], _states(10))
    clock.now = 12
    assert cache.lookup([2, 0]) is not None  # [1] idled 12 s and is dropped; [2] is used again
    assert [e.tokens.tolist() for e in cache.entries()] == [[2]]
    clock.now = 21
    cache.prune()
    assert len(cache) == 1
    clock.now = 22.5
    cache.prune()
    assert len(cache) == 0 and cache.total_bytes == 0


def test_storing_the_same_tokens_replaces_the_entry() -> None:
    cache = PrefixStateCache(max_bytes=10_000, max_entries=8, idle_s=60)
    cache.put([1, 2], _states(100))
    cache.put([1, 2], _states(300))
    assert len(cache) == 1 and cache.total_bytes == _cost([1, 2], 300)


def test_the_key_is_a_copy_of_the_callers_tokens() -> None:
    cache = PrefixStateCache(max_bytes=10_000, max_entries=8, idle_s=60)
    tokens = np.array([1, 2, 3])
    cache.put(tokens, _states(10))
    tokens[0] = 7
    assert cache.lookup([1, 2, 3, 4]) is not None


class _FakeTensor:
    def __init__(self, data: np.ndarray, reads: list[str], name: str) -> None:
        self._data, self._reads, self._name = data, reads, name
        self.byte_size = data.nbytes

    @property
    def data(self) -> np.ndarray:
        self._reads.append(self._name)
        return self._data


class _FakeVariable:
    def __init__(self, name: str, data: np.ndarray, reads: list[str]) -> None:
        self.name = name
        self.state: Any = _FakeTensor(data, reads, name)


class _FakeRequest:
    def __init__(self, sizes: dict[str, int]) -> None:
        self.reads: list[str] = []
        self.variables = [_FakeVariable(n, np.zeros(s, dtype=np.uint8), self.reads) for n, s in sizes.items()]

    def query_state(self) -> list[_FakeVariable]:
        return self.variables


def test_snapshot_copies_every_variable() -> None:
    req = _FakeRequest({"a": 10, "b": 20})
    states = snapshot(req, max_bytes=30)
    assert states is not None and {k: v.nbytes for k, v in states.items()} == {"a": 10, "b": 20}
    req.variables[0].state.data[0] = 1  # the snapshot is a copy
    assert states["a"][0] == 0


def test_snapshot_without_copy_gives_views() -> None:
    """copy=False (the engine's move between its graphs): the state's own memory, not a copy."""
    req = _FakeRequest({"a": 10, "b": 20})
    states = snapshot(req, max_bytes=30, copy=False)
    assert states is not None and {k: v.nbytes for k, v in states.items()} == {"a": 10, "b": 20}
    req.variables[0].state.data[0] = 1
    assert states["a"][0] == 1
    assert snapshot(req, max_bytes=29, copy=False) is None


def test_snapshot_stops_copying_past_the_budget() -> None:
    req = _FakeRequest({"a": 10, "b": 1000, "c": 10})
    assert snapshot(req, max_bytes=500) is None
    assert req.reads == ["a"]  # "b" was never copied, "c" never reached


def test_restore_refuses_a_snapshot_of_other_variables() -> None:
    req = _FakeRequest({"a": 10, "b": 10})
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        restore(req, {"a": np.zeros(10, dtype=np.uint8)})
    assert all(isinstance(v.state, _FakeTensor) for v in req.variables)  # nothing was set


def test_cached_tokens_are_reported_from_the_first_token_on() -> None:
    stream = OutputStream(lambda ids, skip: "x" * len(ids), SamplingParams(max_tokens=4), eos_token_ids=())
    stream.cached_tokens = 7
    assert stream.step_output("r", 9, [], "").cached_tokens == 0
    stream.push(5)
    assert stream.step_output("r", 9, [5], "x").cached_tokens == 7


# -- the profile -----------------------------------------------------------------------------


def test_cache_and_store_bounds_are_service_settings_not_hashed(tmp_path: Path) -> None:
    base = (profiles.DIR / "cpu.toml").read_text()
    shipped = load("cpu")
    assert shipped.prefix_cache.enabled and shipped.prefix_cache.max_bytes == 2 * 1024**3
    assert (shipped.responses.max_entries, shipped.responses.max_bytes) == (10000, 256 * 1024**2)
    assert shipped.responses.ttl_s == 30 * 86400
    changed = tmp_path / "changed.toml"
    changed.write_text(base.replace("max_entries = 8", "max_entries = 2").replace("ttl_s = 2592000", "ttl_s = 60"))
    prof = load(str(changed))
    assert (prof.prefix_cache.max_entries, prof.responses.ttl_s) == (2, 60)
    assert prof.hash == shipped.hash


def test_a_negative_bound_is_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text((profiles.DIR / "cpu.toml").read_text().replace("idle_s = 600", "idle_s = -1"))
    with pytest.raises(ProfileError, match="prefix_cache.idle_s"):
        load(str(bad))


def test_restore_reproduces_the_logits_of_an_uninterrupted_run(tiny_f32_dir: Path) -> None:
    """Every variable kind (conv, ssm, key, value) is restored: another prompt ran in between,
    so a variable left out would hold that prompt's state and change the logits."""
    import openvino as ov

    from worker.reference import stateful_feed

    core = ov.Core()
    model = core.read_model(tiny_f32_dir / "openvino_model.xml")
    names = {p.get_any_name() for p in model.inputs}
    req = core.compile_model(model, "CPU", REFERENCE).create_infer_request()
    ids = np.arange(1000, 1040, dtype=np.int64)

    def feed(x: np.ndarray, past: int) -> np.ndarray:
        req.infer(stateful_feed(x, past, names))
        return np.array(req.get_tensor("logits").data[0, -1])

    req.reset_state()
    feed(ids[:30], 0)
    states = snapshot(req, max_bytes=1 << 30)
    assert states is not None
    assert {k.split(".")[2] for k in states} == {"conv", "ssm", "key", "value"}
    uninterrupted = feed(ids[30:], 30)
    req.reset_state()
    feed(np.arange(2000, 2035, dtype=np.int64), 0)
    restore(req, states)
    assert np.array_equal(feed(ids[30:], 30), uninterrupted)


# -- the candidate engine --------------------------------------------------------------------


def _greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def generate(engine: CandidateEngine, rid: str, prompt: tuple[int, ...], reuse: bool = True,
             max_tokens: int = 12) -> tuple[list[int], StepOutput]:
    outputs = run(engine, EngineRequest(rid, prompt, _greedy(max_tokens), reuse_prefix=reuse))
    return tokens_of(outputs, rid), final(outputs, rid)


@pytest.fixture(scope="module")
def tokenizer(tiny_f32_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(tiny_f32_dir)


@pytest.fixture(scope="module")
def first(tokenizer: ModelTokenizer) -> tuple[int, ...]:
    ids = tuple(tokenizer.encode(FIRST, add_special_tokens=False))
    assert len(ids) > 2 * CHUNK and len(ids) % CHUNK  # several chunks, the last one partial
    return ids


@pytest.fixture(scope="module")
def follow_up(tokenizer: ModelTokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.encode(FOLLOW_UP, add_special_tokens=False))


@pytest.fixture(scope="module")
def other(tokenizer: ModelTokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.encode(OTHER, add_special_tokens=False))


@pytest.fixture(scope="module")
def profile() -> Profile:
    return msgspec.structs.replace(load("cpu-f32"), prefill=PrefillSection(chunk_tokens=CHUNK))


@pytest.fixture(scope="module")
def module_engine(tiny_f32_dir: Path, profile: Profile) -> Iterator[CandidateEngine]:
    engine = create("candidate", tiny_f32_dir, profile)
    assert isinstance(engine, CandidateEngine)
    yield engine
    engine.close()


@pytest.fixture
def engine(module_engine: CandidateEngine, profile: Profile) -> CandidateEngine:
    """The module's engine with an empty cache of the profile's bounds."""
    pc = profile.prefix_cache
    module_engine.prefix_cache = PrefixStateCache(pc.max_bytes, pc.max_entries, pc.idle_s)
    assert not module_engine.has_work()
    return module_engine


@pytest.fixture(scope="module")
def conversation(module_engine: CandidateEngine, first: tuple[int, ...],
                 follow_up: tuple[int, ...]) -> tuple[list[int], tuple[int, ...], list[int]]:
    """Turn 1's greedy answer, turn 2's prompt and turn 2's greedy answer without any reuse."""
    answer, _ = generate(module_engine, "ref-1", first, reuse=False)
    second = first + tuple(answer) + follow_up
    reference, _ = generate(module_engine, "ref-2", second, reuse=False)
    return answer, second, reference


def test_second_turn_reuses_the_first_and_matches_a_full_prefill(
        engine: CandidateEngine, first: tuple[int, ...],
        conversation: tuple[list[int], tuple[int, ...], list[int]]) -> None:
    answer, second, reference = conversation
    turn1, out1 = generate(engine, "turn-1", first)
    assert turn1 == answer and out1.cached_tokens == 0
    outputs = run(engine, EngineRequest("turn-2", second, _greedy()))
    assert tokens_of(outputs, "turn-2") == reference
    # the state after turn 1 held its prompt and every answer token but the last
    served = len(first) + len(answer) - 1
    with_tokens = [o for o in outputs if o.token_ids]
    assert with_tokens and all(o.cached_tokens == served for o in with_tokens)
    assert final(outputs, "turn-2").prompt_tokens == len(second)


def test_prefill_after_a_restore_stays_on_the_chunk_grid(
        engine: CandidateEngine, first: tuple[int, ...],
        conversation: tuple[list[int], tuple[int, ...], list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    _, second, _ = conversation
    generate(engine, "turn-1", first)
    calls: list[tuple[int, int]] = []
    infer = engine._infer

    def spy(ids: np.ndarray, past: int) -> np.ndarray:
        calls.append((past, past + ids.size))
        return infer(ids, past)

    monkeypatch.setattr(engine, "_infer", spy)
    _, out = generate(engine, "turn-2", second, max_tokens=1)
    p = out.cached_tokens
    assert p % CHUNK  # the restore landed off the grid, so this checks something
    prefill = calls  # max_tokens=1: no decode step
    assert prefill[0] == (p, min(len(second), (p // CHUNK + 1) * CHUNK))
    assert all(start % CHUNK == 0 for start, _ in prefill[1:]) and prefill[-1][1] == len(second)


def test_a_prompt_that_is_no_extension_gets_no_reuse(
        engine: CandidateEngine, first: tuple[int, ...], other: tuple[int, ...]) -> None:
    reference, _ = generate(engine, "ref", other, reuse=False)
    generate(engine, "turn-1", first)
    tokens, out = generate(engine, "other", other)
    assert out.cached_tokens == 0 and tokens == reference


def test_a_different_continuation_reuses_the_common_prompt_snapshot(
        engine: CandidateEngine, first: tuple[int, ...], other: tuple[int, ...],
        conversation: tuple[list[int], tuple[int, ...], list[int]]) -> None:
    answer, _, _ = conversation
    branch = first + tuple(t for t in other if t != answer[0])[:20]  # diverges from the answer at once
    reference, _ = generate(engine, "ref", branch, reuse=False)
    generate(engine, "turn-1", first)
    tokens, out = generate(engine, "branch", branch)
    assert out.cached_tokens == len(first) and tokens == reference  # the end-of-prompt snapshot


def test_bypass_neither_reads_nor_fills_the_cache(
        engine: CandidateEngine, first: tuple[int, ...],
        conversation: tuple[list[int], tuple[int, ...], list[int]]) -> None:
    _, second, reference = conversation
    cache = engine.prefix_cache
    assert cache is not None
    generate(engine, "turn-1", first)
    before = (cache.hits, cache.misses, cache.stores, [e.tokens.tolist() for e in cache.entries()])
    tokens, out = generate(engine, "bypass", second, reuse=False)
    assert out.cached_tokens == 0 and tokens == reference
    assert (cache.hits, cache.misses, cache.stores, [e.tokens.tolist() for e in cache.entries()]) == before


def test_a_snapshot_restores_exactly_after_other_requests_ran(
        engine: CandidateEngine, first: tuple[int, ...], other: tuple[int, ...],
        conversation: tuple[list[int], tuple[int, ...], list[int]]) -> None:
    _, second, reference = conversation
    generate(engine, "turn-1", first)
    generate(engine, "between", other)
    tokens, out = generate(engine, "turn-2", second)
    assert out.cached_tokens >= len(first) and tokens == reference
    generate(engine, "between-again", other, reuse=False)
    again, out_again = generate(engine, "turn-2-again", second)  # the same entry, restored twice
    assert out_again.cached_tokens == out.cached_tokens and again == reference


def test_the_prompt_snapshot_is_taken_after_the_first_token(engine: CandidateEngine,
                                                            first: tuple[int, ...]) -> None:
    """Not on the time-to-first-token path: the next step() takes it, before any inference."""
    cache = engine.prefix_cache
    assert cache is not None
    engine.add(EngineRequest("r", first, _greedy(4)))
    outputs: list[StepOutput] = []
    while not tokens_of(outputs, "r"):
        outputs.extend(engine.step())
    assert cache.stores == 0
    engine.step()
    assert [e.tokens.tolist() for e in cache.entries()] == [list(first)]
    run(engine)


def test_an_aborted_request_keeps_only_its_prompt_snapshot(engine: CandidateEngine,
                                                           first: tuple[int, ...]) -> None:
    cache = engine.prefix_cache
    assert cache is not None
    engine.add(EngineRequest("r", first, _greedy(12)))
    outputs: list[StepOutput] = []
    while len(tokens_of(outputs, "r")) < 4:
        outputs.extend(engine.step())
    engine.abort("r")
    outputs.extend(run(engine))
    assert final(outputs, "r").finish_reason is FinishReason.ABORT
    assert [e.tokens.tolist() for e in cache.entries()] == [list(first)]


def test_a_small_byte_budget_evicts_and_output_stays_exact(
        engine: CandidateEngine, first: tuple[int, ...],
        conversation: tuple[list[int], tuple[int, ...], list[int]]) -> None:
    answer, second, reference = conversation
    assert engine.prefix_cache is not None
    generate(engine, "probe", first)
    one = max(e.nbytes for e in engine.prefix_cache.entries())
    engine.prefix_cache = cache = PrefixStateCache(max_bytes=one + one // 4, max_entries=8, idle_s=600)
    generate(engine, "turn-1", first)
    assert len(cache) == 1 and cache.evictions == 1 and cache.total_bytes <= cache.max_bytes
    (kept,) = cache.entries()
    assert kept.length == len(first) + len(answer) - 1  # the end-of-answer snapshot replaced the prompt's
    tokens, out = generate(engine, "turn-2", second)
    assert out.cached_tokens == kept.length and tokens == reference
    assert cache.total_bytes <= cache.max_bytes


def test_a_budget_below_one_snapshot_stores_nothing(
        engine: CandidateEngine, first: tuple[int, ...],
        conversation: tuple[list[int], tuple[int, ...], list[int]]) -> None:
    _, second, reference = conversation
    engine.prefix_cache = cache = PrefixStateCache(max_bytes=1024, max_entries=8, idle_s=600)
    generate(engine, "turn-1", first)
    tokens, out = generate(engine, "turn-2", second)
    assert len(cache) == 0 and out.cached_tokens == 0 and tokens == reference


def test_forced_logits_bypasses_the_cache(engine: CandidateEngine, first: tuple[int, ...]) -> None:
    cache = engine.prefix_cache
    assert cache is not None
    greedy, _ = generate(engine, "turn-1", first)
    counters = (cache.hits, cache.misses, cache.stores)
    rows = list(engine.forced_logits(list(first), greedy[:3]))
    assert [int(np.argmax(r)) for r in rows] == greedy[:3]
    assert (cache.hits, cache.misses, cache.stores) == counters


def test_a_disabled_cache_is_never_used(tiny_f32_dir: Path, profile: Profile, first: tuple[int, ...],
                                        conversation: tuple[list[int], tuple[int, ...], list[int]]) -> None:
    _, second, reference = conversation
    off = msgspec.structs.replace(profile, prefix_cache=msgspec.structs.replace(profile.prefix_cache, enabled=False))
    engine = create("candidate", tiny_f32_dir, off)
    try:
        assert isinstance(engine, CandidateEngine) and engine.prefix_cache is None
        generate(engine, "turn-1", first)
        tokens, out = generate(engine, "turn-2", second)
        assert out.cached_tokens == 0 and tokens == reference
    finally:
        engine.close()


def test_an_idle_worker_lets_the_cache_expire_idle_snapshots(monkeypatch: pytest.MonkeyPatch) -> None:
    import queue

    from ipc.messages import Ping
    from worker import process

    monkeypatch.setattr(process, "_IDLE_TICK_S", 0.001)
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    class Cache:
        pruned = 0

        def prune(self) -> None:
            self.pruned += 1
            if self.pruned == 3:  # a request arrives after three idle ticks
                inbox.put(Ping(seq=7))

    class Engine:
        prefix_cache = Cache()

    loop = process.EngineLoop(Engine(), io=None, inbox=inbox, generation=1)  # type: ignore[arg-type]
    assert loop._wait() == [Ping(seq=7)]
    assert Engine.prefix_cache.pruned == 3
