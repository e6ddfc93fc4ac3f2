"""Gate prompts: exact lengths, deterministic, distinct per salt, sentinel planted mid-prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from iq36.gate.prompts import CLASSES, build, near_boundary_lengths, sentinel_found


@pytest.fixture(scope="module")
def encode(tiny_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("length", [64, 511, 512, 4096])
def test_exact_token_count(encode, cls: str, length: int) -> None:
    assert len(build(encode, 512, cls, length=length, salt="run-3").ids) == length


@pytest.mark.parametrize("cls", CLASSES)
def test_deterministic_and_salted(encode, cls: str) -> None:
    a = build(encode, 1024, cls, salt="a")
    assert a == build(encode, 1024, cls, salt="a")
    b = build(encode, 1024, cls, salt="b")
    assert a.ids[:4] != b.ids[:4]  # distinct from the first tokens: no shared prefix to cache


def test_sentinel_is_planted_in_the_middle_and_asked_at_the_end(encode, tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    p = build(encode, 2048, "sentinel", salt="x")
    text = tok.decode(list(p.ids))
    assert p.sentinel_value is not None and text.count(p.sentinel_value) == 1
    where = text.index(p.sentinel_value) / len(text)
    assert 0.3 < where < 0.7
    assert text.rstrip().endswith("Answer:")
    assert sentinel_found(f"It is {p.sentinel_value}.", p.sentinel_value) is True
    assert sentinel_found("no idea", p.sentinel_value) is False


def test_prefill_shape_is_varied(encode) -> None:
    ids = build(encode, 2048, "prefill-shape").ids
    assert len(set(ids)) > 250  # many distinct tokens, unlike filler
    assert len(set(build(encode, 2048, "filler").ids)) < len(set(ids)) / 3


def test_near_boundary_lengths() -> None:
    assert near_boundary_lengths(1024) == [513, 1017, 1023]


def test_unknown_class_and_too_short_are_refused(encode) -> None:
    with pytest.raises(ValueError, match="unknown prompt class"):
        build(encode, 512, "lorem")
    with pytest.raises(ValueError, match="sentinel"):
        build(encode, 16, "sentinel")
