"""Datasets as JSONL, one conversation per line, in the OpenAI chat form users already have.

A line is `{"messages": [...], "tools": [...], "answer": ...}`: `tools` (OpenAI function schemas)
and `answer` (a gold answer for eval checkers) are optional, other keys are kept untouched.
The rollout reads a line's prompt (the messages before the first assistant turn); SFT and the
trainer's off-policy (GKD) batches read the whole conversation through `completion_trajectory`,
which renders it into exactly the IDs a rollout would hold had the student written those
assistant turns itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from opd.errors import DatasetError

ROLES = ("system", "user", "assistant", "tool")
ANSWER_KEY = "answer"



def load_jsonl(path: str | Path) -> list[dict]:
    """All records of a JSONL dataset, validated; blank lines are skipped."""
    return [record for _, record in numbered_records(path)]


def numbered_records(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, record) of every record of a JSONL dataset, validated."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"Dataset file {path} does not exist.")
    records = []
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DatasetError(f"{path} line {number} is not UTF-8 text (a binary or "
                                   "differently encoded file?).") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DatasetError(f"{path} line {number} is not valid JSON ({error.msg}, "
                                   f"column {error.colno}).") from None
            problem = record_problem(record)
            if problem:
                raise DatasetError(f"{path} line {number}: {problem}.")
            records.append((number, record))
    if not records:
        raise DatasetError(f"Dataset file {path} has no records.")
    return records


def write_jsonl(path: str | Path, records: Sequence[dict]) -> None:
    with Path(path).open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")


def record_problem(record) -> str | None:
    """What makes `record` unusable as a dataset line, or None."""
    if not isinstance(record, dict):
        return "a line must be a JSON object with a \"messages\" list"
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        return "\"messages\" must be a non-empty list"
    for index, message in enumerate(messages):
        problem = _message_problem(message)
        if problem:
            return f"messages[{index}] {problem}"
    if messages[0].get("role") not in ("system", "user"):
        return "the first message must have role \"system\" or \"user\""
    tools = record.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            return "\"tools\" must be a list of OpenAI function schemas"
        for index, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                return (f"tools[{index}] must look like "
                        '{"type": "function", "function": {"name": ...}}')
    return None


def _message_problem(message) -> str | None:
    if not isinstance(message, dict):
        return "must be an object with \"role\" and \"content\""
    role = message.get("role")
    if role not in ROLES:
        return f"has role {role!r}; expected one of {', '.join(ROLES)}"
    content = message.get("content")
    tool_calls = message.get("tool_calls")
    if role == "assistant" and content is None and tool_calls:
        content = ""
    if not isinstance(content, str):
        return "must have a string \"content\""
    if tool_calls is not None:
        if role != "assistant" or not isinstance(tool_calls, list):
            return "has \"tool_calls\", which only an assistant message may have, as a list"
        for call in tool_calls:
            function = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                    or not isinstance(function.get("arguments"), (dict, str)):
                return "has a tool call without a string \"name\" and object \"arguments\""
    return None


def prompt_record(record: dict) -> dict:
    """The rollout prompt of a dataset line: the messages before its first assistant turn."""
    messages = record["messages"]
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return {"messages": messages[:first], "tools": record.get("tools")}


def completion_trajectory(chat_or_tokenizer, messages: Sequence[dict],
                          tools: Sequence[dict] | None = None):
    """A whole conversation as an `AgentTrajectory`: assistant turns are targets, the rest context.

    Built the way a rollout builds one, so SFT and off-policy batches train on the IDs the
    student would hold: the prompt from the template with the generation prompt; each assistant
    turn as the tokens of its text plus the stop token that closes it (targets); each following
    run of tool messages by the rollout's own boundary rendering (`ChatFormat.observation_ids`).
    Trailing messages after the last assistant turn carry nothing to learn and are dropped.
    """
    from opd.chat import ChatFormat
    from opd.rollout import AgentTrajectory

    chat = chat_or_tokenizer if isinstance(chat_or_tokenizer, ChatFormat) \
        else ChatFormat(chat_or_tokenizer)
    messages = [dict(m, content=m.get("content") or "") for m in messages]
    assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_at or assistant_at[0] == 0:
        raise DatasetError("A completion needs a prompt followed by at least one assistant "
                           "message.")
    ids = chat.prompt_ids(messages[:assistant_at[0]], tools)
    trajectory = AgentTrajectory(input_ids=list(ids), assistant_mask=[False] * len(ids), turns=0,
                                 tool_calls=0, truncated=False, spans=[(0, len(ids), "prompt")])
    for turn, index in enumerate(assistant_at):
        if turn > 0:
            _append(trajectory, _context_ids(chat, messages[assistant_at[turn - 1] + 1:index],
                                             tools, trajectory.input_ids[-1]), "observation")
        text, stop_id = _assistant_text(chat, messages[:index], messages[index], tools)
        _append(trajectory, chat.encode(text) + [stop_id], "assistant")
        trajectory.turns += 1
        trajectory.tool_calls += len(messages[index].get("tool_calls") or [])
    return trajectory


def _append(trajectory, ids: list[int], kind: str) -> None:
    start = len(trajectory.input_ids)
    trajectory.input_ids.extend(ids)
    trajectory.assistant_mask.extend([kind == "assistant"] * len(ids))
    trajectory.spans.append((start, len(trajectory.input_ids), kind))


def _assistant_text(chat, history: list[dict], message: dict, tools) -> tuple[str, int]:
    """The text the template writes for `message` after the generation prompt, and its stop id."""
    prompt = chat.render(history, tools, add_generation_prompt=True)
    full = chat.render([*history, message], tools, add_generation_prompt=False)
    if not full.startswith(prompt):
        raise DatasetError(
            f"Chat template of {chat.name} renders an assistant turn that does not extend its "
            "generation prompt, so dataset completions cannot be rendered by appending.")
    rest = full[len(prompt):]
    ends = [(rest.find(text), stop_id) for stop_id in chat.stop_token_ids
            if (text := chat.tokenizer.decode([stop_id], skip_special_tokens=False))
            and text in rest]
    if not ends:
        raise DatasetError(f"Chat template of {chat.name} does not close an assistant turn "
                           "with a stop token of the tokenizer or generation config.")
    end, stop_id = min(ends)
    return rest[:end], stop_id


def _context_ids(chat, messages: list[dict], tools, last_token_id: int) -> list[int]:
    if any(m["role"] != "tool" for m in messages):
        raise DatasetError(
            "Only tool messages may sit between two assistant turns of a completion "
            f"(found roles {[m['role'] for m in messages]}).")
    return chat.observation_ids([m["content"] for m in messages], tools, last_token_id)
