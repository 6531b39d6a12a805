"""Chat rendering: template kwargs, observation boundary, stop tokens, template errors."""

import json

import pytest
from conftest import build_tokenizer
from transformers import GenerationConfig

from opd.chat import ChatFormat, ChatTemplateError, stop_token_ids, tool_observation

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 12 * 7?"}]


def test_prompt_uses_template_and_passes_template_kwargs(qwen3_tokenizer):
    thinking = ChatFormat(qwen3_tokenizer).prompt_ids(MESSAGES, TOOLS)
    plain = ChatFormat(qwen3_tokenizer, {"enable_thinking": False}).prompt_ids(MESSAGES, TOOLS)
    text = qwen3_tokenizer.decode(plain)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "calculator"' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen3_tokenizer.decode(thinking).endswith("<|im_start|>assistant\n")


def test_observation_is_exactly_what_the_template_appends(qwen3_tokenizer):
    """Appending the observation to the sampled turn == rendering the whole conversation."""
    chat = ChatFormat(qwen3_tokenizer, {"enable_thinking": False})
    prompt = chat.prompt_ids(MESSAGES, TOOLS)
    turn_text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'
    turn = chat.encode(turn_text) + [qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    observation = chat.observation_ids(['{"result": 84}'], TOOLS, turn[-1])
    appended = qwen3_tokenizer.decode(prompt + turn + observation)
    assert appended.endswith(
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"result\": 84}\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert appended.count("<|im_end|>") == 4  # system, user, assistant, tool: none duplicated


def test_several_tool_responses_share_one_user_turn(qwen3_tokenizer):
    chat = ChatFormat(qwen3_tokenizer)
    text = chat.observation_text(['{"result": 1}', '{"result": 2}'], TOOLS)
    assert text.count("<tool_response>") == 2 and text.count("<|im_start|>user") == 1


def test_stop_tokens_include_generation_config_ids(qwen3_tokenizer):
    config = GenerationConfig(eos_token_id=[qwen3_tokenizer.eos_token_id, 0])
    assert stop_token_ids(qwen3_tokenizer, config) == {qwen3_tokenizer.eos_token_id, 0}
    assert stop_token_ids(qwen3_tokenizer) == {qwen3_tokenizer.eos_token_id}


def test_other_stop_token_at_boundary_is_not_followed_by_a_second_one(qwen3_tokenizer):
    """A turn ended by <|endoftext|> (a generation-config stop) is closed: no <|im_end|> added."""
    config = GenerationConfig(eos_token_id=[qwen3_tokenizer.eos_token_id, 0])
    chat = ChatFormat(qwen3_tokenizer, generation_config=config)
    observation = chat.observation_ids(['{"result": 84}'], TOOLS, last_token_id=0)
    assert observation[0] not in chat.stop_token_ids
    assert qwen3_tokenizer.decode(observation).startswith("\n<|im_start|>user")


def test_template_that_drops_assistant_content_is_named(qwen3_tokenizer):
    tokenizer = build_tokenizer("{% for m in messages %}{% if m.role != 'assistant' %}"
                                "{{ m.content }}{% endif %}{% endfor %}")
    tokenizer.name_or_path = "drops-assistant"
    with pytest.raises(ChatTemplateError, match="'drops-assistant' drops the assistant content"):
        ChatFormat(tokenizer).observation_ids(["{}"], None, tokenizer.eos_token_id)


def test_boundary_unsafe_template_is_named():
    """A template that separates turns with plain text lets BPE merge across the boundary."""
    template = ("{% for m in messages %}{{ m.content }}{% if m.role == 'assistant' %}answer{% endif %}"
                "{% endfor %}")
    tokenizer = build_tokenizer(template)
    tokenizer.name_or_path = "plain-text-turns"
    chat = ChatFormat(tokenizer)
    last = tokenizer.convert_tokens_to_ids("Ġ")  # a turn ending in a space: " answer" merges
    with pytest.raises(ChatTemplateError, match="'plain-text-turns' is not boundary-safe"):
        chat.observation_ids(["{}"], None, last_token_id=last)


def test_missing_template_is_a_clear_error(qwen3_tokenizer):
    tokenizer = build_tokenizer("")
    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="has no chat_template"):
        ChatFormat(tokenizer)


def test_seed_tool_observation_executes_and_renders(qwen3_tokenizer):
    calls = [{"name": "calculator", "arguments": {"expression": "12 * 7"}},
             {"name": "calculator", "arguments": "{not json"},
             {"name": "lookup", "arguments": {"entity": "x", "attribute": "y"}}]
    text = qwen3_tokenizer.decode(tool_observation(qwen3_tokenizer, calls, TOOLS))
    responses = [json.loads(part.split("\n</tool_response>")[0])
                 for part in text.split("<tool_response>\n")[1:]]
    assert responses[0] == {"result": 84}
    assert set(responses[1]) == {"error"} and set(responses[2]) == {"error"}
    assert "unknown tool 'lookup'" in responses[2]["error"]  # not offered in this conversation
    assert text.startswith("<|im_end|>")  # seed semantics: the rollout drops it
