"""The tool call as read from the student's text, and the parsers (`tools.parser`) that read it.

Kept apart from the schemas (opd.tool_schemas) and the sandbox (opd.tools): reading a call is text
work that needs no tool. A parser never raises: a call that does not parse comes back with `error`
set, which the student sees as one `{"error": ...}` observation.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opd.errors import ConfigError


@dataclass
class ToolCall:
    """One call parsed from the student's text; `error` is set when it is malformed."""
    name: str | None
    arguments: dict | None
    error: str | None = None
    raw: str = ""


ToolCallParser = Callable[[str], list[ToolCall]]

# Same shape as vLLM's Hermes parser: a final <tool_call> without its closing tag still counts,
# because a student that stops right after the JSON meant the call.
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_THINK_TAG = re.compile(r"<think>|</think>")


def _outside_think(text: str) -> str:
    """`text` without its reasoning: `<think>...</think>` blocks, and everything after a `<think>`
    that is never closed. A `</think>` with no opening tag ends reasoning that the prompt opened
    (templates that end the generation prompt with `<think>`), so all before it is dropped too."""
    kept, start, thinking = [], 0, False
    for tag in _THINK_TAG.finditer(text):
        if tag.group() == "<think>" and not thinking:
            kept.append(text[start:tag.start()])
            thinking = True
        elif tag.group() == "</think>":
            if not thinking:
                kept = []
            thinking = False
            start = tag.end()
    if not thinking:
        kept.append(text[start:])
    return "".join(kept)


def parse_hermes_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in `text`, in order.

    Calls are read only outside `<think>` reasoning: a thought that mentions `<tool_call>` is not a
    call, and must not swallow the real call after it. Arguments may be an object or a JSON string
    holding one, and default to {} when absent (as in the seed). A malformed call comes back with
    `error` set; nothing raises.
    """
    calls = []
    for match in _HERMES_CALL.finditer(_outside_think(text)):
        closed = match.group(1) is not None
        call = _parse_call_json(match.group(1) if closed else match.group(2), match.group(0))
        if call.error and not closed:
            call.error += " (the <tool_call> is not closed)"
        calls.append(call)
    return calls


def _reject_constant(constant: str):
    raise ValueError(f"{constant} is not a JSON number")


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


def _parse_call_json(body: str, raw: str) -> ToolCall:
    try:
        payload = _loads(body)
    except (ValueError, RecursionError) as exc:
        return ToolCall(None, None, f"tool call is not valid JSON: {exc}", raw)
    if not isinstance(payload, dict):
        return ToolCall(None, None, 'tool call must be a JSON object with "name" and '
                                    f'"arguments", got {json_type(payload)}', raw)
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, 'tool call has no "name" string', raw)
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except (ValueError, RecursionError) as exc:
            return ToolCall(name, None, f"arguments of tool {name!r} are a string that is not "
                                        f"valid JSON: {exc}", raw)
    if not isinstance(arguments, dict):
        return ToolCall(name, None, f"arguments of tool {name!r} must be a JSON object, "
                                    f"got {json_type(arguments)}", raw)
    return ToolCall(name, arguments, None, raw)


_PARSERS: dict[str, ToolCallParser] = {"hermes": parse_hermes_tool_calls}


def register_parser(name: str, parser: ToolCallParser) -> None:
    if name in _PARSERS and _PARSERS[name] is not parser:
        raise ValueError(f"a tool-call parser named {name!r} is already registered")
    _PARSERS[name] = parser


def get_parser(name: str) -> ToolCallParser:
    if name not in _PARSERS:
        raise ConfigError(f"tools.parser {name!r} is not a registered tool-call parser (registered: "
                          f"{', '.join(_PARSERS)}) nor a module:function.")
    return _PARSERS[name]


def json_type(value: Any) -> str:
    """What an error message calls the JSON type of `value` ("a string", "null", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    names: dict[type, str] = {str: "a string", list: "an array", dict: "an object"}
    return names.get(type(value), type(value).__name__)
