"""JSONL datasets and `completion_trajectory`: validation errors, and dataset conversations
rendered into exactly the IDs and masks a rollout holds."""

from __future__ import annotations

import json

import pytest
from scripted_model import ScriptedPolicy

from opd.chat import ChatFormat
from opd.data import DatasetError, completion_trajectory, load_jsonl, prompt_record, write_jsonl
from opd.rollout import RolloutConfig, rollout
from worlds.toolcalc.tasks import (
    HARD_FAMILIES,
    HARD_FAMILY_WEIGHTS,
    answer_text,
    generate_tasks,
    oracle_record,
)
from worlds.toolcalc.tokenizer import load_tokenizer
from worlds.toolcalc.tools import registry as toolcalc_registry

TOOLS = toolcalc_registry().schemas
GOOD = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "tools": TOOLS, "answer": 4}


@pytest.fixture(scope="module")
def toolcalc_chat():
    return ChatFormat(load_tokenizer())


def write_lines(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_jsonl_reads_records_and_skips_blank_lines(tmp_path):
    records = [GOOD, oracle_record(generate_tasks(1, 0)[0])]
    write_jsonl(tmp_path / "d.jsonl", records)
    path = write_lines(tmp_path / "blank.jsonl", [json.dumps(GOOD), "", json.dumps(records[1])])
    assert load_jsonl(tmp_path / "d.jsonl") == records
    assert load_jsonl(path) == records


@pytest.mark.parametrize("line, problem", [
    ('{"messages": [', "is not valid JSON"),
    ('[1, 2]', "must be a JSON object"),
    ('{"prompt": "hi"}', '"messages" must be a non-empty list'),
    ('{"messages": []}', '"messages" must be a non-empty list'),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "messages[0] has role 'robot'"),
    ('{"messages": [{"role": "user", "content": 3}]}', 'messages[0] must have a string "content"'),
    ('{"messages": [{"role": "assistant", "content": "hi"}]}', "the first message must have"),
    ('{"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}',
     "only an assistant message may have"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", '
     '"tool_calls": [{"function": {"name": "lookup"}}]}]}', "tool call without"),
    ('{"messages": [{"role": "user", "content": "hi"}], "tools": {"name": "x"}}', '"tools" must'),
    ('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "x"}]}', "tools[0]"),
])
def test_a_bad_line_stops_with_one_sentence_naming_file_and_line(tmp_path, line, problem):
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps(GOOD), line])
    with pytest.raises(DatasetError) as error:
        load_jsonl(path)
    message = str(error.value)
    assert message.startswith(f"{path} line 2") and problem in message
    assert "\n" not in message and message.endswith(".")


def test_missing_and_empty_files_are_named(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="has no records"):
        load_jsonl(write_lines(tmp_path / "empty.jsonl", [""]))


def test_prompt_record_keeps_messages_before_the_first_assistant_turn():
    record = oracle_record(generate_tasks(1, 0)[0])
    prompt = prompt_record(record)
    assert prompt == {"messages": record["messages"][:1], "tools": record["tools"]}
    assert prompt_record(GOOD)["messages"] == GOOD["messages"]


def test_completion_matches_the_tokenised_full_conversation(toolcalc_chat):
    """Our template appends strictly, so the naive reference is the whole rendered text."""
    tokenizer = toolcalc_chat.tokenizer
    for task in generate_tasks(40, 3):
        record = oracle_record(task)
        trajectory = completion_trajectory(toolcalc_chat, record["messages"], record["tools"])
        full = tokenizer.apply_chat_template(record["messages"], tools=record["tools"],
                                             tokenize=False)
        assert full.endswith("<|im_end|>\n")
        assert trajectory.input_ids == tokenizer(full[:-1], add_special_tokens=False)["input_ids"]


def test_completion_mask_marks_exactly_each_assistant_turn_and_its_stop_token(toolcalc_chat):
    tokenizer = toolcalc_chat.tokenizer
    task = next(t for t in generate_tasks(50, 4) if t.family == "two_hop")
    record = oracle_record(task)
    trajectory = completion_trajectory(toolcalc_chat, record["messages"], record["tools"])
    ids, mask = trajectory.input_ids, trajectory.assistant_mask
    assert len(ids) == len(mask)
    runs, start = [], None
    for i, flag in enumerate(mask + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    assert runs == trajectory.assistant_spans()
    calls = [json.dumps({"name": step.name, "arguments": step.arguments}) for step in task.steps]
    expected = [f"<tool_call>\n{call}\n</tool_call><|im_end|>" for call in calls]
    assert [tokenizer.decode(ids[s:e]) for s, e in runs] == [
        *expected, answer_text(task.answer) + "<|im_end|>"]
    assert all(ids[e - 1] == tokenizer.eos_token_id for _, e in runs)
    assert tokenizer.decode(ids[:runs[0][0]]).endswith("<|im_start|>assistant\n")
    observations = [(s, e) for s, e, kind in trajectory.spans if kind == "observation"]
    for (s, e), step in zip(observations, task.steps):
        assert ids[s:e] == toolcalc_chat.observation_ids([step.content], record["tools"],
                                                         tokenizer.eos_token_id)
    assert (trajectory.turns, trajectory.tool_calls, trajectory.truncated) == (3, 2, False)


def scripted_policy(tokenizer, tasks, assistant_prefix):
    """A policy that writes each task's oracle turns, found by the task's question."""
    scripts = {}
    for task in tasks:
        turns = [f"<tool_call>\n{json.dumps({'name': s.name, 'arguments': s.arguments})}\n"
                 "</tool_call>" for s in task.steps]
        scripts[task.question] = [*turns, answer_text(task.answer)]
    return ScriptedPolicy(tokenizer, scripts, tokenizer.eos_token_id, assistant_prefix)


@pytest.mark.parametrize("template", ["toolcalc", "qwen3"])
def test_completion_equals_the_rollout_of_a_student_writing_the_same_turns(
        template, toolcalc_chat, qwen3_tokenizer, executor):
    """SFT and off-policy batches must train on the very IDs and mask a rollout would hold."""
    if template == "toolcalc":
        chat, prefix = toolcalc_chat, "<|im_start|>assistant\n"
    else:
        chat = ChatFormat(qwen3_tokenizer, {"enable_thinking": False})
        prefix = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    tasks = [next(t for t in generate_tasks(60, 5) if t.family == family)
             for family in ("arithmetic", "two_hop", "direct", "conversion")]
    tasks.append(next(t for t in generate_tasks(20, 5, families=HARD_FAMILIES,
                                                weights=HARD_FAMILY_WEIGHTS)
                      if t.family == "three_hop"))
    records = [oracle_record(task) for task in tasks]
    policy = scripted_policy(chat.tokenizer, tasks, prefix)
    cfg = RolloutConfig(max_turns=4, max_new_tokens=64, max_total_len=1024, batch_size=5)
    rolled = rollout(policy, chat, executor, [prompt_record(r) for r in records], cfg)
    for record, trajectory in zip(records, rolled):
        completion = completion_trajectory(chat, record["messages"], record["tools"])
        assert completion.input_ids == trajectory.input_ids
        assert completion.assistant_mask == trajectory.assistant_mask
        assert completion.spans == trajectory.spans
        assert (completion.turns, completion.tool_calls) == (trajectory.turns,
                                                             trajectory.tool_calls)


def test_completion_rejects_what_a_rollout_could_not_hold(toolcalc_chat):
    with pytest.raises(DatasetError, match="at least one assistant message"):
        completion_trajectory(toolcalc_chat, GOOD["messages"], TOOLS)
    # a rollout appends tool observations after a turn with calls, a user turn after one
    # without: never both in one run of context
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "tool", "content": "{}"}, {"role": "user", "content": "again"},
                {"role": "assistant", "content": "hi"}]
    with pytest.raises(DatasetError, match="Only tool messages, or only user messages, may sit"):
        completion_trajectory(toolcalc_chat, messages, None)


def test_completion_accepts_a_plain_tokenizer_and_string_arguments(toolcalc_chat):
    record = oracle_record(next(t for t in generate_tasks(20, 6) if t.steps))
    as_strings = json.loads(json.dumps(record))
    for message in as_strings["messages"]:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    expected = completion_trajectory(toolcalc_chat, record["messages"], record["tools"])
    actual = completion_trajectory(toolcalc_chat.tokenizer, as_strings["messages"],
                                   record["tools"])
    assert actual.input_ids == expected.input_ids
    assert actual.assistant_mask == expected.assistant_mask


class CountingChat(ChatFormat):
    """A chat format that counts the messages it renders (the cost of rendering a history)."""

    rendered = 0

    def render(self, messages, tools, add_generation_prompt=True):
        self.rendered += len(messages)
        return super().render(messages, tools, add_generation_prompt)


def _long_conversation(turns: int) -> list[dict]:
    """`turns` user questions, each answered by a tool call, its result and a final answer."""
    messages = [{"role": "system", "content": "Be brief."}]
    for turn in range(turns):
        call = {"function": {"name": "calculator", "arguments": {"expression": f"{turn} * 7"}}}
        messages += [{"role": "user", "content": f"What is {turn} * 7?"},
                     {"role": "assistant", "content": "", "tool_calls": [call],
                      "reasoning_content": f"multiply {turn}"},
                     {"role": "tool", "content": json.dumps({"result": turn * 7})},
                     {"role": "assistant", "content": f"{turn * 7}"}]
    return messages


def test_a_long_completion_renders_a_bounded_history_per_turn(qwen3_tokenizer):
    """Each assistant turn used to re-render the whole history before it (57 s for 2,000 turns,
    quadratic): the messages rendered now grow linearly with the turns."""
    per_turn = []
    for turns in (20, 40):
        chat = CountingChat(qwen3_tokenizer)
        completion_trajectory(chat, _long_conversation(turns), TOOLS)
        per_turn.append(chat.rendered / (2 * turns))
    assert per_turn[1] <= per_turn[0] <= 12, per_turn


def test_an_over_budget_completion_is_refused_before_rendering_all_its_turns(qwen3_tokenizer):
    chat = CountingChat(qwen3_tokenizer)
    messages = _long_conversation(1000)
    with pytest.raises(DatasetError, match=r"^the conversation is already \d+ tokens at its "
                                           r"assistant turn \d of 2000$"):
        completion_trajectory(chat, messages, TOOLS, max_tokens=600)
    assert chat.rendered < 100


@pytest.mark.parametrize("thinking", [True, False])
def test_an_assistant_turn_renders_after_its_window_as_after_the_whole_history(
        qwen3_tokenizer, thinking):
    """Qwen3 drops the reasoning of turns before the last user query and keeps it after: the
    window a turn is rendered after must give the whole history's text for every turn."""
    from opd.data import _assistant_text, _assistant_window

    chat = ChatFormat(qwen3_tokenizer, {"enable_thinking": thinking})
    messages = _long_conversation(3)
    if not thinking:  # Qwen3's generation prompt then holds an empty think block
        messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
    messages[5:5] = [{"role": "user", "content": "And a second question in a row?"}]
    last_user = 0
    for index, message in enumerate(messages):
        if message["role"] == "user":
            last_user = index
        if message["role"] != "assistant" or index == 2:
            continue
        window = _assistant_window(messages, index, last_user)
        assert len(window) <= 5
        assert _assistant_text(chat, window, message, TOOLS) == \
            _assistant_text(chat, messages[:index], message, TOOLS), index
