"""Deterministic gate prompts with an exact token count (SPEC §5).

Three classes: `filler` (one natural paragraph, repeated), `prefill-shape` (deterministic
varied lines: numbers, words and punctuation in changing mixes, so tokens and expert routing
vary as in real text), and `sentinel` (a key/value planted mid-prompt, asked for at the end).
Prompts are assembled in token space from separately tokenized pieces, so the count is exact
for any tokenizer. A `salt` opens every prompt: timed runs use distinct salts, so neither
engine can serve a run from a prefix cache filled by an earlier one.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

CLASSES = ("filler", "prefill-shape", "sentinel")

Encode = Callable[[str], list[int]]

_FILLER = (
    "The river town woke slowly in the grey light of early spring. Fishermen checked their nets "
    "along the quay while the baker's oven sent warm air into the narrow street, and children ran "
    "past the old stone bridge on their way to school. Nobody hurried; the tide would turn at noon "
    "as it always did, and the ferry would wait for the last passenger before leaving. "
)
_WORDS = (
    "alpha", "quartz", "meridian", "copper", "lattice", "harbor", "vector", "saffron", "delta",
    "orbit", "granite", "cipher", "willow", "plasma", "ember", "tundra", "falcon", "mosaic",
)

_SYLLABLES = (
    "ka", "lo", "mir", "tes", "van", "dor", "pel", "qui", "rst", "ben", "ulo", "gra", "shi", "ton",
    "ept", "zar", "nol", "fyr", "ach", "ism", "ent", "ous", "wick", "bly", "ter", "ang", "oph",
)
_HAN = "山水日月风雨花草人心天地时光书文学海云星火木金土石道路城市年春秋冬夏"


def _word(rng: random.Random) -> str:
    kind = rng.randrange(10)
    if kind < 5:
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randrange(1, 4)))
    if kind < 7:
        return rng.choice(_WORDS)
    if kind < 8:
        return "".join(rng.choice(_HAN) for _ in range(rng.randrange(1, 4)))
    return rng.choice(_WORDS).upper() if kind < 9 else str(rng.randrange(10**rng.randrange(1, 6)))


@dataclass(frozen=True)
class GatePrompt:
    bucket: int
    prompt_class: str
    ids: tuple[int, ...]
    sentinel_value: str | None = None  # what a model that read the prompt should answer


def _shape_text(rng: random.Random, lines: int) -> str:
    out = []
    for i in range(lines):
        kind = rng.randrange(4)
        if kind == 0:
            out.append(f"record {i:05d}: {_word(rng)}={rng.randrange(10**6)} "
                       f"ratio={rng.uniform(-1, 1):.4f}")
        elif kind == 1:
            out.append(" ".join(_word(rng) for _ in range(rng.randrange(3, 12))).capitalize() + ".")
        elif kind == 2:
            out.append(f"def {_word(rng)}_{i}(x):\n    return x * {rng.randrange(2, 99)} + {_word(rng)!r}")
        else:
            out.append(f"- [{rng.choice('xo ')}] {_word(rng)} #{rng.randrange(1000)} "
                       f"({rng.randrange(24):02d}:{rng.randrange(60):02d})")
    return "\n".join(out) + "\n"


def _stream(encode: Encode, text_for: Callable[[int], str], need: int) -> list[int]:
    """At least `need` token ids from ever longer texts (token counts per char vary)."""
    size = max(64, need)
    while True:
        ids = encode(text_for(size))
        if len(ids) >= need:
            return ids[:need]
        size *= 2


def build(encode: Encode, bucket: int, prompt_class: str, length: int | None = None,
          salt: str = "") -> GatePrompt:
    """A prompt of exactly `length` (default: `bucket`) tokens of one class."""
    if prompt_class not in CLASSES:
        raise ValueError(f"unknown prompt class {prompt_class!r}; choose from {', '.join(CLASSES)}")
    total = bucket if length is None else length
    head = encode(f"[{salt}] " if salt else "")
    rng = random.Random(f"{prompt_class}:{bucket}:{salt}")
    if prompt_class == "filler":
        body_len = total - len(head)
        body = _stream(encode, lambda n: _FILLER * (n // 60 + 1), body_len)
        ids, value = head + body, None
    elif prompt_class == "prefill-shape":
        body_len = total - len(head)
        body = _stream(encode, lambda n: _shape_text(rng, n // 8 + 1), body_len)
        ids, value = head + body, None
    else:
        name = rng.choice(_WORDS)
        value = f"{rng.randrange(10**7):07d}"
        plant = encode(f"\nImportant: the access code for vault {name} is {value}. Remember it.\n")
        question = encode(f"\nQuestion: what is the access code for vault {name}?\nAnswer: ")
        room = total - len(head) - len(plant) - len(question)
        if room < 2:
            raise ValueError(f"a sentinel prompt needs more than {total - room} tokens, got {total}")
        filler = _stream(encode, lambda n: _FILLER * (n // 60 + 1), room)
        half = room // 2
        ids = head + filler[:half] + plant + filler[half:] + question
    if len(ids) != total:
        raise ValueError(f"{prompt_class} prompt needs at least {len(head) + 1} tokens, got {total}")
    return GatePrompt(bucket=bucket, prompt_class=prompt_class, ids=tuple(ids), sentinel_value=value)


def near_boundary_lengths(bucket: int) -> list[int]:
    """The lengths checked for prefill cliffs around a bucket (SPEC §5)."""
    return sorted({bucket - 1, bucket - 7, bucket // 2 + 1})


def sentinel_found(answer: str, value: str | None) -> bool | None:
    return None if value is None else value in answer
