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
