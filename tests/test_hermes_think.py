"""The Hermes parser reads tool calls only outside `<think>` reasoning (Qwen3 thinking mode)."""

from opd.tool_calls import parse_hermes_tool_calls

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'


def _calls(text: str) -> list[tuple]:
    return [(c.name, c.arguments, c.error) for c in parse_hermes_tool_calls(text)]


def test_a_thought_that_mentions_tool_call_does_not_swallow_the_real_call():
    text = ("<think>\nI should emit <tool_call> with the calculator, not guess.\n</think>\n\n"
            + CALL)
    assert _calls(text) == [("calculator", {"expression": "12 * 7"}, None)]
    assert parse_hermes_tool_calls(text)[0].raw == CALL


def test_a_whole_call_written_inside_a_thought_is_not_a_call():
    text = f"<think>\nDraft: {CALL}\nNo, compute it in my head.\n</think>\n\nThe answer is 84."
    assert _calls(text) == []


def test_an_unclosed_thought_holds_no_calls():
    assert _calls(f"<think>\nmaybe {CALL} then") == []
    assert _calls("<think>\nmaybe <tool_call>{\"name\": \"calculator\"") == []


def test_an_empty_thought_before_a_call_and_calls_between_thoughts():
    # enable_thinking=False renders an empty block; the student may think again between calls.
    text = f"<think>\n\n</think>\n\n{CALL}\n<think>x <tool_call></think>{CALL.replace('12', '3')}"
    assert _calls(text) == [("calculator", {"expression": "12 * 7"}, None),
                            ("calculator", {"expression": "3 * 7"}, None)]


def test_a_closing_tag_alone_ends_reasoning_opened_by_the_prompt():
    # Templates whose generation prompt ends with "<think>\n": the student writes only "</think>".
    assert _calls(f"plan: <tool_call> maybe\n</think>\n\n{CALL}") == [
        ("calculator", {"expression": "12 * 7"}, None)]
