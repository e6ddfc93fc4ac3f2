"""Incremental detokenizing, stop strings and the per-request output logic (worker/detok.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from worker.detok import WINDOW, IncrementalDetokenizer, OutputStream, StopStringMatcher
from worker.engine.types import FinishReason, SamplingParams

EOS = 99
SPECIAL = {EOS: b"<eos>"}


class FakeVocab:
    """Byte-level toy tokenizer: token i decodes to PIECES[i]; records every decoded window."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = list(pieces)
        self.windows: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.windows.append(len(ids))
        raw = b"".join(
            (b"" if skip_special_tokens else SPECIAL[i]) if i in SPECIAL else self.pieces[i] for i in ids
        )
        return raw.decode("utf-8", errors="replace")


def _split_bytes(text: str) -> list[bytes]:
    """One token per byte: the worst case for UTF-8 boundaries."""
    return [bytes([b]) for b in text.encode()]


def _run(detok: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    return [detok.push(i) for i in ids]


def test_multibyte_characters_are_never_split() -> None:
    text = "a😀 👨‍👩‍👧 é中"
    vocab = FakeVocab(_split_bytes(text))
    deltas = _run(IncrementalDetokenizer(vocab.decode), range(len(vocab.pieces)))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_decode_windows_stay_short() -> None:
    vocab = FakeVocab([b"word "])
    deltas = _run(IncrementalDetokenizer(vocab.decode), [0] * 300)
    assert "".join(deltas) == "word " * 300 and all(deltas)
    assert max(vocab.windows) <= WINDOW  # a sliding window, not the whole output
    # one decode per token, and one more each time the window's start moves
    assert len(vocab.windows) <= 300 + 300 // (WINDOW // 2), len(vocab.windows)


def test_held_back_tokens_keep_the_window_and_its_text() -> None:
    """A character split over tokens is held, then emitted whole, with every window's start
    moves in between (the emitted text is the full decode's, in order)."""
    text = "ab😀cd" * 10 + "中"  # 83 byte tokens: ids below EOS (99)
    vocab = FakeVocab(_split_bytes(text))
    deltas = _run(IncrementalDetokenizer(vocab.decode), range(len(vocab.pieces)))
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
    assert max(vocab.windows) <= WINDOW + 3  # a window can outgrow WINDOW only while a character is held


def test_flush_releases_a_trailing_incomplete_sequence() -> None:
    vocab = FakeVocab([b"ok", "😀".encode()[:2]])
    detok = IncrementalDetokenizer(vocab.decode)
    assert _run(detok, [0, 1]) == ["ok", ""]
    assert detok.flush() == "\ufffd"


def test_stop_string_split_across_deltas_never_leaks() -> None:
    matcher = StopStringMatcher(["lo w"])
    out = [matcher.feed(t) for t in ("Hel", "lo", " wo", "rld")]
    assert out == ["He", "l", "", ""]  # "l" could have started "lo w": held one delta
    assert matcher.matched == "lo w"


def test_partial_stop_prefix_is_released_when_it_diverges() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("xxST") == "xx"
    assert matcher.feed("OR") == "STOR"
    assert matcher.matched is None


def test_earliest_of_several_stop_strings_wins() -> None:
    matcher = StopStringMatcher(["world", "lo"])
    assert matcher.feed("hello world") == "hel"
    assert matcher.matched == "lo"


def test_held_suffix_is_emitted_at_finish_without_a_match() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("the E") == "the "
    assert matcher.flush() == "E"


def _stream(pieces: Sequence[bytes], **params: object) -> tuple[FakeVocab, OutputStream]:
    vocab = FakeVocab(pieces)
    return vocab, OutputStream(vocab.decode, SamplingParams(**params), eos_token_ids=[EOS])


def test_stop_string_split_across_tokens_ends_with_stop() -> None:
    _, stream = _stream([b"Hel", b"lo", b" wo", b"rld"], stop=("lo w",))
    text = "".join(stream.push(t) for t in (0, 1, 2))
    assert text == "Hel"
    assert stream.finish_reason is FinishReason.STOP
    assert stream.token_ids == [0, 1, 2]


def test_stop_string_in_text_flushed_at_finish_is_cut() -> None:
    # the stop string completes inside a held-back partial character: only the flush reveals it
    emoji = "😀".encode()
    _, stream = _stream([b"ab", emoji[:2]], stop=("b\ufffd",), max_tokens=2)
    text = stream.push(0) + stream.push(1)
    assert text == "a"
    assert stream.finish_reason is FinishReason.STOP


def test_eos_stops_counts_the_token_and_adds_no_text() -> None:
    _, stream = _stream([b"hi"], skip_special_tokens=False)
    assert stream.push(0) == "hi"
    assert stream.push(EOS) == ""
    assert stream.finish_reason is FinishReason.STOP
    assert stream.token_ids == [0, EOS]


def test_ignore_eos_keeps_generating_past_eos() -> None:
    _, stream = _stream([b"hi"], ignore_eos=True)
    stream.push(EOS)
    assert not stream.finished


def test_stop_token_ids_apply_even_with_ignore_eos() -> None:
    _, stream = _stream([b"a", b"b"], ignore_eos=True, stop_token_ids=(1,))
    stream.push(0)
    stream.push(1)
    assert stream.finish_reason is FinishReason.STOP


def test_max_tokens_finishes_with_length_and_flushes() -> None:
    _, stream = _stream([b"a", b"END"], max_tokens=2, stop=("ENDX",))
    assert stream.push(0) + stream.push(1) == "aEND"
    assert stream.finish_reason is FinishReason.LENGTH


def test_abort_drops_held_text() -> None:
    _, stream = _stream([b"a", b"EN"], stop=("END",))
    stream.push(0)
    stream.push(1)
    assert stream.finish(FinishReason.ABORT) == ""
    assert stream.finish_reason is FinishReason.ABORT


def test_real_tokenizer_emoji_never_broken(tiny_dir: Path) -> None:
    from worker.tokenizer import ModelTokenizer

    tok = ModelTokenizer(tiny_dir)
    text = "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👩🏽‍💻 coder 你好"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # several tokens per emoji: the case under test
    deltas = _run(IncrementalDetokenizer(tok.decode), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
