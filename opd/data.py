"""Datasets as JSONL, one conversation per line, in the OpenAI chat form users already have.

A line is `{"messages": [...], "tools": [...], "answer": ..., "environment": {...},
"tools_by_turn": [...]}`; only `messages` is required, other keys are kept untouched:

- `tools`: OpenAI function schemas the student may call from the start.
- `answer`: a gold answer for eval checkers.
- `environment`: a JSON object, the config a stateful environment of the recipe is constructed
  from for this conversation (opd.environments); {} when absent.
- `tools_by_turn`: a list whose entry k (a list of function schemas, or null) holds the tools
  that become available at user turn k (0 is the prompt's; BFCL's missing functions): from that
  turn on they are offered to the template and calls are validated against them.

A line may hold several user turns:

    {"messages": [{"role": "system", ...}, {"role": "user", "content": "turn 0"},
                  <assistant and tool messages of a gold conversation, optional>,
                  {"role": "user", "content": "turn 1"}, ..., <gold turns>, ...]}

The rollout's prompt (`prompt_record`) is the messages up to the first assistant message or the
second user message, whichever comes first (so a line of only system and user messages is one
prompt turn followed by further user turns); the further user turns (`user_turns`) are the user
messages after it, in order. When the student ends a turn without tool calls and user turns
remain, the next one is appended and the student continues; the gold assistant and tool
messages between them are never shown to the student. SFT and the trainer's off-policy (GKD)
batches read the whole conversation through `completion_trajectory`, which renders it into
exactly the IDs a rollout would hold had the student written those assistant turns itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from opd.chat import ChatFormat
from opd.errors import DatasetError
from opd.trajectory import AgentTrajectory

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
        problem = _schemas_problem(tools, "tools")
        if problem:
            return problem
    environment = record.get("environment")
    if environment is not None and not isinstance(environment, dict):
        return "\"environment\" must be a JSON object (the environment's config)"
    by_turn = record.get("tools_by_turn")
    if by_turn is not None:
        if not isinstance(by_turn, list):
            return "\"tools_by_turn\" must be a list (entry k: the tools added at user turn k)"
        for turn, extra in enumerate(by_turn):
            if extra is not None and not isinstance(extra, list):
                return f"tools_by_turn[{turn}] must be a list of OpenAI function schemas or null"
            problem = _schemas_problem(extra or [], f"tools_by_turn[{turn}]")
            if problem:
                return problem
    return None


def _schemas_problem(tools: list, where: str) -> str | None:
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return (f"{where}[{index}] must look like "
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


def prompt_end(messages: Sequence[dict]) -> int:
    """Where a line's prompt ends: at its first assistant message or its second user message."""
    users = 0
    for index, message in enumerate(messages):
        users += message["role"] == "user"
        if message["role"] == "assistant" or users == 2:
            return index
    return len(messages)


def prompt_record(record: dict) -> dict:
    """The rollout prompt of a dataset line (see the module docstring): its prompt messages,
    `tools`, and `environment` and `tools_by_turn` where it has them."""
    messages = record["messages"]
    prompt = {"messages": messages[:prompt_end(messages)], "tools": record.get("tools")}
    for key in ("environment", "tools_by_turn"):
        if key in record:
            prompt[key] = record[key]
    return prompt


def user_turns(record: dict) -> list[dict]:
    """The further user turns of a dataset line: its user messages after the prompt, in order."""
    messages = record["messages"]
    return [m for m in messages[prompt_end(messages):] if m["role"] == "user"]


def tools_at_turn(tools: Sequence[dict] | None, tools_by_turn: Sequence | None,
                  turn: int) -> list[dict]:
    """The tools offered at user turn `turn` (0: the prompt's): `tools` plus every
    `tools_by_turn` entry up to that turn."""
    offered = list(tools or [])
    for extra in list(tools_by_turn or [])[:turn + 1]:
        offered.extend(extra or [])
    return offered


def withheld_tools(tools_by_turn: Sequence | None, turn: int = 0) -> list[dict]:
    """The tools a record offers only after user turn `turn`: its later `tools_by_turn`."""
    return [schema for extra in list(tools_by_turn or [])[turn + 1:] for schema in extra or []]


class OverBudgetError(DatasetError):
    """A completion longer than the token budget it was rendered under."""


def completion_trajectory(chat_or_tokenizer, messages: Sequence[dict],
                          tools: Sequence[dict] | None = None,
                          tools_by_turn: Sequence | None = None, max_tokens: int | None = None):
    """A whole conversation as an `AgentTrajectory`: assistant turns are targets (but those with
    `"weight": 0`), the rest context.

    Built the way a rollout builds one, so SFT and off-policy batches train on the IDs the
    student would hold: the prompt from the template with the generation prompt; each assistant
    turn as the tokens of its text plus the stop token that closes it (targets); each following
    run of tool messages, or of user messages (a further user turn), by the rollout's own
    boundary rendering (`ChatFormat.observation_ids`, `ChatFormat.user_turn_ids`), with the
    tools offered at that user turn (`tools_by_turn`). Trailing messages after the last
    assistant turn carry nothing to learn and are dropped.

    Linear in turns: an assistant turn's text is rendered from a window of the history of
    constant size (`_assistant_window`), and with `max_tokens` the rendering stops with
    `OverBudgetError` at the first turn past it, not after the whole history.
    """
    chat = chat_or_tokenizer if isinstance(chat_or_tokenizer, ChatFormat) \
        else ChatFormat(chat_or_tokenizer)
    messages = [dict(m, content=m.get("content") or "") for m in messages]
    assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_at or assistant_at[0] == 0:
        raise DatasetError("A completion needs a prompt followed by at least one assistant "
                           "message.")
    user_turn = 0
    last_user = max([0, *(i for i in range(assistant_at[0]) if messages[i]["role"] == "user")])
    offered = tools_at_turn(tools, tools_by_turn, user_turn)
    ids = chat.prompt_ids(messages[:assistant_at[0]], offered)
    trajectory = AgentTrajectory.from_prompt(ids)
    for turn, index in enumerate(assistant_at):
        if turn > 0:
            between = messages[assistant_at[turn - 1] + 1:index]
            if any(m["role"] == "user" for m in between):
                last_user = max(i for i in range(assistant_at[turn - 1] + 1, index)
                                if messages[i]["role"] == "user")
                user_turn += 1
                offered = tools_at_turn(tools, tools_by_turn, user_turn)
            ids, kind = _context_ids(chat, between, offered, trajectory.input_ids[-1])
            trajectory.append(ids, kind)
        history = _assistant_window(messages, index, last_user) if turn > 0 \
            else messages[:index]
        text, stop_id = _assistant_text(chat, history, messages[index], offered)
        trajectory.append(chat.encode(text) + [stop_id], _assistant_kind(messages[index], turn))
        trajectory.turns += 1
        trajectory.tool_calls += len(messages[index].get("tool_calls") or [])
        if max_tokens is not None and len(trajectory.input_ids) > max_tokens:
            raise OverBudgetError(
                f"the conversation is already {len(trajectory.input_ids)} tokens at its "
                f"assistant turn {turn + 1} of {len(assistant_at)}")
    return trajectory


def _assistant_kind(message: dict, turn: int) -> str:
    """"assistant" (a target) unless the message says `"weight": 0` (OpenAI's fine-tuning
    convention): then the turn is context the model reads but is not trained to write, such as
    a demonstrated mistake that a correction follows."""
    weight = message.get("weight", 1)
    if weight not in (0, 1) or isinstance(weight, bool):
        raise DatasetError(f"assistant message {turn + 1} has weight {weight!r}; use 0 (context, "
                           "not trained on) or 1 (the default).")
    return "assistant" if weight == 1 else "assistant_context"


def _assistant_window(messages: list[dict], index: int, last_user: int) -> list[dict]:
    """The history `_assistant_text` renders assistant message `index` after: the system
    message, the last user message (at `last_user`) and what follows the previous assistant
    turn, that turn included. Templates write an assistant turn from the turn itself and its
    place after the last user query (Qwen3 keeps the reasoning of turns after it), so this
    window gives the text the whole history gives, at a cost that does not grow with the
    conversation."""
    system = messages[:1] if messages[0]["role"] == "system" and last_user > 0 else []
    previous = index - 1
    while messages[previous]["role"] != "assistant" and previous > last_user:
        previous -= 1  # back over the tool or user messages since the previous turn
    return [*system, messages[last_user], *messages[max(previous, last_user + 1):index]]


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


def _context_ids(chat, messages: list[dict], tools, last_token_id: int
                 ) -> tuple[list[int], str]:
    """The context between two assistant turns and its span kind: tool messages are an
    "observation", user messages a "user" turn (as the rollout appends them)."""
    roles = {m["role"] for m in messages}
    if roles == {"tool"}:
        return chat.observation_ids([m["content"] for m in messages], tools,
                                    last_token_id), "observation"
    if roles == {"user"}:
        return chat.user_turn_ids(messages, tools, last_token_id), "user"
    raise DatasetError(
        "Only tool messages, or only user messages, may sit between two assistant turns of a "
        f"completion (found roles {[m['role'] for m in messages]}).")
