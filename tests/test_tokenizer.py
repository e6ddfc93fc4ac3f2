"""Tokenizer of the dev models: HF fast tokenizer and openvino-tokenizers agree."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

TEXTS = {
    "chinese": "你好，世界！这是一个测试：长上下文、分词和解码。",
    "emoji_zwj": "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👩🏽‍💻 coder",
    "code": "def f(x: int) -> int:\n    return x ** 2  # square\n\tprint(f'{x!r}')\r\n",
    "special": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\n"
    "<tool_call>\n<function=get>\n<parameter=q>\n1\n</parameter>\n</function>\n</tool_call><|im_end|>",
    "digits_spaces": "   12345 numbers\n\n\nand    runs of spaces  ",
}


@pytest.fixture(scope="module")
def tokenizers(tiny_dir: Path):
    import openvino as ov
    import openvino_tokenizers  # noqa: F401  (registers the tokenizer ops)
    from transformers import AutoTokenizer

    core = ov.Core()
    return (
        AutoTokenizer.from_pretrained(tiny_dir),
        core.compile_model(tiny_dir / "openvino_tokenizer.xml"),
        core.compile_model(tiny_dir / "openvino_detokenizer.xml"),
    )


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_encode_parity(tokenizers, name: str) -> None:
    hf, ov_tok, _ = tokenizers
    text = TEXTS[name]
    want = hf(text, add_special_tokens=False)["input_ids"]
    got = ov_tok([text])["input_ids"][0].tolist()
    assert got == want
    assert hf.decode(want) == text  # byte-level BPE round-trips exactly


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_decode_parity(tokenizers, name: str) -> None:
    hf, _, ov_detok = tokenizers
    ids = hf(TEXTS[name], add_special_tokens=False)["input_ids"]
    got = str(ov_detok(np.array([ids], dtype=np.int64))["string_output"][0])
    assert got == hf.decode(ids, skip_special_tokens=True)


def test_qwen3_special_token_ids(tokenizers) -> None:
    hf, _, _ = tokenizers
    ids = {t: hf.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                                   "<tool_call>", "</tool_call>", "<think>", "</think>")}
    assert ids == {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                   "<tool_call>": 151657, "</tool_call>": 151658, "<think>": 151667, "</think>": 151668}
    # markup tokens are not "special": they survive decoding so tool calls and reasoning parse
    assert hf.decode([151657, 151667], skip_special_tokens=True) == "<tool_call><think>"


def test_chat_template_roles_tools_and_thinking(tokenizers) -> None:
    hf, _, _ = tokenizers
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "need a tool",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                           "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "-3 C"},
    ]
    text = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "get_weather"' in text
    assert "<think>\nneed a tool\n</think>\n\n<tool_call>\n<function=get_weather>\n" in text
    assert "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call><|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n-3 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    off = hf.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True,
                                 enable_thinking=False)
    assert off == (
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_genai_renders_the_same_chat_template(tiny_dir: Path, tokenizers) -> None:
    import openvino_genai

    hf, _, _ = tokenizers
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}]
    tok = openvino_genai.Tokenizer(str(tiny_dir))
    got = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert got == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _with_detokenizer(src: Path, dst: Path, xml: str) -> Path:
    """`src` linked file by file into `dst`, with openvino_detokenizer.xml replaced by `xml`."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "openvino_detokenizer.xml":
            (dst / f.name).symlink_to(f)
    (dst / "openvino_detokenizer.xml").write_text(xml)
    return dst


@pytest.fixture(scope="module")
def model_tokenizer(tiny_dir: Path):
    from worker.tokenizer import ModelTokenizer

    return ModelTokenizer(tiny_dir)


def test_model_tokenizer_decodes_as_genais_detokenizer(tiny_dir: Path, model_tokenizer) -> None:
    """The detokenizer IR's vocabulary is read on dev-tiny and `decode` gives genai's text for
    random id sequences over the whole logits range (ids past the vocabulary, the skip list's
    special tokens and the added markup tokens among them), both ways of skipping; most of them
    on the fast path (the rest are not valid UTF-8 and go to genai)."""
    from worker.tokenizer import read_vocab_size

    tok = model_tokenizer
    vocab = tok._vocab
    assert vocab is not None and 0 < vocab.size
    logits = read_vocab_size(tiny_dir)
    assert logits is not None and logits > vocab.size  # ids the vocabulary does not have exist
    specials = sorted(vocab._skip)
    assert 151645 in specials and 151667 not in specials  # <|im_end|> skipped, <think> kept
    rng = np.random.default_rng(7)
    fast = 0
    for i in range(400):
        ids = [int(t) for t in rng.integers(0, logits if i % 4 == 0 else vocab.size, 1 + i % 30)]
        ids += [specials[i % len(specials)], vocab.size - 1 - i % 12]
        rng.shuffle(ids)
        for skip in (True, False):
            fast += vocab.decode(ids, skip) is not None
            assert tok.decode(ids, skip) == str(tok._tok.decode(ids, skip_special_tokens=skip)), (ids, skip)
    assert fast > 400
    assert tok.decode([], True) == "" == vocab.decode([], False)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_model_tokenizer_round_trips_text_on_the_fast_path(model_tokenizer, name: str) -> None:
    tok = model_tokenizer
    ids = tok.encode(TEXTS[name], add_special_tokens=False)
    assert tok._vocab.decode(ids, False) == TEXTS[name] == tok.decode(ids, False)
    assert tok.decode(ids, True) == str(tok._tok.decode(ids, skip_special_tokens=True))


def test_model_tokenizer_leaves_a_split_character_to_genai(model_tokenizer) -> None:
    """A window ending inside a UTF-8 sequence: not on the fast path; genai's U+FFFD comes out
    (what `IncrementalDetokenizer` holds back)."""
    tok = model_tokenizer
    ids = tok.encode("ok 👨‍👩‍👧", add_special_tokens=False)
    cut = next(n for n in range(1, len(ids)) if tok._vocab.decode(ids[:n], True) is None)
    text = tok.decode(ids[:cut], True)
    assert text == str(tok._tok.decode(ids[:cut], skip_special_tokens=True)) and text.endswith("\ufffd")
    # ids outside the vocabulary are genai's too (a negative one must not index from the end)
    assert tok._vocab.decode([-1], True) is None and tok._vocab.decode([tok._vocab.size], False) is None


def test_model_tokenizer_keeps_genai_for_another_detokenizer_graph(tiny_dir: Path, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A detokenizer that drops invalid bytes instead of replacing them, or one with its skip list
    in an attribute: not the graph `IrVocabulary` mirrors, so genai decodes."""
    import logging

    from worker.tokenizer import IrVocabulary, ModelTokenizer

    xml = (tiny_dir / "openvino_detokenizer.xml").read_text()
    assert 'replace_mode="true"' in xml and 'skip_tokens=""' in xml
    caplog.set_level(logging.INFO, logger="worker.tokenizer")
    dropping = ModelTokenizer(_with_detokenizer(tiny_dir, tmp_path / "drop", xml.replace('replace_mode="true"',
                                                                                       'replace_mode="false"')))
    assert dropping._vocab is None and "not the graph IrVocabulary reads" in caplog.text
    attr = _with_detokenizer(tiny_dir, tmp_path / "attr", xml.replace('skip_tokens=""', 'skip_tokens="151645"'))
    assert IrVocabulary.load(attr / "openvino_detokenizer.xml") is None
    ids = list(range(1000, 1040))
    assert dropping.decode(ids) == str(dropping._tok.decode(ids, skip_special_tokens=True))


def test_model_tokenizer_keeps_genai_where_a_probe_differs(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    from worker import tokenizer

    monkeypatch.setattr(tokenizer.IrVocabulary, "decode", lambda self, ids, skip: "x")
    tok = tokenizer.ModelTokenizer(tiny_dir)
    assert tok._vocab is None and "unlike openvino-genai" in caplog.text
    assert tok.decode([1000, 1001]) == str(tok._tok.decode([1000, 1001], skip_special_tokens=True))
