"""The offline Qwen3 tokenizer encodes exactly as Qwen's own tiktoken encoder does."""

from __future__ import annotations

import json
import random
import unicodedata

import pytest
from qwen3_tokenizer import ADDED_TOKENS, FIRST_ADDED_ID, qwen3_tokenizer_dir, reference_encoder

SAMPLES = [
    "Hello world", "  leading spaces", "trailing spaces   ", "tabs\tand\t\ttabs", "\n\n\n",
    "a\r\nb\rc\n", "     \n    \n", "I'm sure they'll say we've DON'T can't", "don’t (curly)",
    'def f(x: int) -> int:\n    """Doc."""\n    return x ** 2  # square\n',
    "for (int i = 0; i < n; ++i) { sum += a[i]; }\n\tif (x) {\n\t\treturn;\n\t}",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;",
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>',
    '{"name": "lookup", "arguments": "{\\"entity\\": \\"Veltrane\\"}"}',
    '{"result": 84}', '{"error": "unknown tool \'abacus\'"}', "[1, 2.5, -3e-7, null, true]",
    "3.14159265358979 1,234,567.89 -0.001 1e10 0x1F 007 2024-12-03T08:24:04Z",
    "12345678901234567890", "½ ¾ ² ³ Ⅻ ٣ ৩ ４５６",
    "你好，世界！今天天气怎么样？", "日本語のテキストとカタカナ、ひらがな。", "한국어 문장입니다.",
    "Привет, мир! Ёжик.", "مرحبا بالعالم", "नमस्ते दुनिया", "Γειά σου Κόσμε", "ไทย ภาษา",
    "emoji 🤖🚀 👩‍👩‍👧‍👦 👍🏽 🇫🇷 ❤️ ✨", "café naïve résumé", "cafe\u0301 (decomposed)",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nLet me think about <tool_call> tags.\n</think>\n\nThe answer is 4.",
    "<tool_response>\n{\"result\": 4}\n</tool_response>", "<|endoftext|><|endoftext|>",
    "x<|im_end|>y", "<|fim_prefix|>def<|fim_suffix|>return<|fim_middle|>", "<|vision_start|>",
    "a  b   c    d", "!!!??? ... --- ___ *** ### @@@", "https://example.com/path?q=1&r=2#frag",
    "user@example.com", "C:\\Users\\name\\file.txt", "$HOME/.cache/opd-recipes", "",
]
FRAGMENTS = SAMPLES + [" ", "\n", "\t", "  ", "\n\n", "'s", "'LL", "0", "42", "-", "，", "🙂",
                       "<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>"]


def varied_strings(count: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    strings = list(SAMPLES)
    while len(strings) < count:
        parts = rng.choices(FRAGMENTS, k=rng.randint(1, 6))
        strings.append(rng.choice(["", " ", "\n", "  "]).join(parts))
    return strings


def test_added_tokens_ids_and_roles(real_qwen3_tokenizer):
    tokenizer = real_qwen3_tokenizer
    assert len(tokenizer) == FIRST_ADDED_ID + 26
    assert tokenizer.convert_ids_to_tokens(list(range(FIRST_ADDED_ID, FIRST_ADDED_ID + 26))) \
        == [token for token, _ in ADDED_TOKENS]
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 151645)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 151643)
    assert tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>", "<think>", "</think>"]) \
        == [151657, 151658, 151667, 151668]
    # As in Qwen3: think and tool tags are not special, so skipping special tokens keeps them.
    ids = tokenizer("<|im_start|><think>x</think><|im_end|>")["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_encodes_like_qwens_own_encoder(real_qwen3_tokenizer):
    reference = reference_encoder()
    strings = varied_strings()
    assert len(strings) >= 300
    mismatches = [text for text in strings
                  if real_qwen3_tokenizer(text, add_special_tokens=False)["input_ids"]
                  != reference.encode(text)]
    assert not mismatches, mismatches[:5]
    for text in strings:
        ids = real_qwen3_tokenizer(text)["input_ids"]
        assert real_qwen3_tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_known_ids_and_the_cache_is_reused(real_qwen3_tokenizer, tmp_path):
    assert real_qwen3_tokenizer("Hello world")["input_ids"] == [9707, 1879]
    first = qwen3_tokenizer_dir()
    assert qwen3_tokenizer_dir() == first and (first / "tokenizer.json").is_file()
    assert not list(first.parent.glob("*.tmp-*"))  # no half-built directory left behind


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_chat_template_renders_qwen3_prompts(real_qwen3_tokenizer, enable_thinking):
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}]
    text = real_qwen3_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 * 7?"}], tools=tools, tokenize=False,
        add_generation_prompt=True, enable_thinking=enable_thinking)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(tools[0]) in text
    assert text.endswith("<|im_start|>assistant\n" if enable_thinking
                         else "<|im_start|>assistant\n<think>\n\n</think>\n\n")
