"""Tools (an OpenAI function schema and its function) and the check of a call against them.

Kept apart from the sandbox (opd.tools): checking needs no process. A call that fails it is
"invalid" and never reaches a worker, and the BFCL world checks calls with no executor at all. A
registry checks its tools when built, so a bad one fails before any engine starts.
"""

import json
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opd.tool_calls import ToolCall, json_type


@dataclass(frozen=True)
class Tool:
    """An OpenAI-style function schema and the module-level function it calls as fn(**arguments)."""
    schema: dict
    fn: Callable[..., Any]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


# Deeper values would exhaust the recursion limit while validated, encoded or decoded; the
# parser's own limit (Python's recursion limit) depends on the caller's stack.
MAX_ARGUMENT_DEPTH = 128


def _too_deep(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest deeper than `limit` (the arguments object is level 1);
    iterative, as the value may be too deep for recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1)
                         for child in (item.values() if isinstance(item, dict) else item))
    return False


_JSON_TYPES = {"string", "number", "integer", "boolean", "array", "object", "null"}


class ToolRegistry:
    """Tools by name, and argument validation against a JSON-schema subset: type (one or a list),
    enum, properties, required, additionalProperties (default false: extra keys would reach
    fn(**arguments)), items. Other keywords (minimum, pattern, ...) are not checked."""

    def __init__(self, tools: Sequence[Tool]):
        self.tools = tuple(tools)
        self._by_name: dict[str, Tool] = {}
        for tool in self.tools:
            _check_tool(tool)
            if tool.name in self._by_name:
                raise ValueError(f"two tools are named {tool.name!r}")
            self._by_name[tool.name] = tool
        self.schemas: list[dict] = [tool.schema for tool in self.tools]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def validate(self, call: ToolCall, check_types: bool = True) -> str | None:
        """The sentence the student sees for an invalid call, or None when the call is valid
        (`check_types`: see validate_call)."""
        return validate_call(call, {name: tool.schema for name, tool in self._by_name.items()},
                             check_types)


def validate_call(call: ToolCall, schemas: dict[str, dict], check_types: bool = True
                  ) -> str | None:
    """The sentence the student sees when `call` does not match its tool among `schemas` (OpenAI
    function schemas by name), or None when it is valid. Without `check_types` only the names
    are checked (a known tool, its required arguments present, no unknown argument): the values
    go to the function as they are, as a benchmark that calls Python methods directly does."""
    if call.error is not None:
        return call.error
    schema = schemas.get(call.name) if call.name is not None else None
    if call.name is None or schema is None:
        return f"unknown tool {call.name!r}; available tools: {', '.join(schemas)}"
    if not isinstance(call.arguments, dict):
        return (f"arguments of tool {call.name!r} must be a JSON object, "
                f"got {json_type(call.arguments)}")
    if _too_deep(call.arguments, MAX_ARGUMENT_DEPTH):
        return (f"arguments of tool {call.name!r} are nested deeper than "
                f"{MAX_ARGUMENT_DEPTH} levels")
    parameters = {"properties": {}, **schema["function"].get("parameters", {})}
    if not check_types:
        parameters = {key: parameters[key] for key in ("properties", "required",
                                                       "additionalProperties")
                      if key in parameters}
        parameters["properties"] = {key: {} for key in parameters["properties"]}
        if isinstance(parameters.get("additionalProperties"), dict):
            parameters["additionalProperties"] = True
    try:
        return _schema_error(call.arguments, parameters, call.name, ())
    except (AttributeError, KeyError, TypeError, ValueError):  # a record's own malformed schema
        return f"the schema of tool {call.name!r} cannot be checked; the call was not run"


def _check_tool(tool: Tool) -> None:
    schema = tool.schema if isinstance(tool.schema, dict) else {}
    function = schema.get("function")
    if schema.get("type") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str):
        raise ValueError(f'a tool schema must look like {{"type": "function", "function": '
                         f'{{"name": ..., "parameters": {{...}}}}}}, got {tool.schema!r}')
    parameters = function.get("parameters", {"type": "object"})
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ValueError(f"parameters of tool {tool.name!r} must have type 'object'")
    _check_schema_types(parameters, tool.name)
    if not callable(tool.fn):
        raise ValueError(f"the function of tool {tool.name!r} is not callable: {tool.fn!r}")
    try:
        pickle.dumps(tool.fn)
        importable = getattr(tool.fn, "__module__", None) != "__main__"
    except Exception:
        importable = False
    if not importable:
        raise ValueError(f"the function of tool {tool.name!r} ({tool.fn!r}) cannot be sent to a "
                         "worker process: define it at module level in an importable module, "
                         "not in the main script")


def _check_schema_types(schema: dict, tool_name: str) -> None:
    types = schema.get("type", [])
    for type_name in [types] if isinstance(types, str) else types:
        if type_name not in _JSON_TYPES:
            raise ValueError(f"tool {tool_name!r} uses unsupported schema type {type_name!r}; "
                             f"use one of {', '.join(sorted(_JSON_TYPES))}")
    children = list(schema.get("properties", {}).values())
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            children.append(schema[key])
    for child in children:
        _check_schema_types(child, tool_name)


def _is_type(value: Any, type_name: str) -> bool:
    if type_name == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or \
            (isinstance(value, float) and value.is_integer())
    if type_name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python_types = {"string": str, "boolean": bool, "array": list, "object": dict,
                    "null": type(None)}
    return isinstance(value, python_types[type_name])


def _same_json_value(a: Any, b: Any) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _schema_error(value: Any, schema: dict, tool: str, path: tuple) -> str | None:
    where = f"tool {tool!r}: argument {''.join(path).lstrip('.')!r}" if path else f"tool {tool!r}"
    types = schema.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else types
        if not any(_is_type(value, type_name) for type_name in allowed):
            shown = json.dumps(value, ensure_ascii=False)[:60]
            return (f"{where} must be of type {' or '.join(allowed)}, "
                    f"got {json_type(value)} ({shown})")
    if "enum" in schema and not any(_same_json_value(value, option) for option in schema["enum"]):
        options = ", ".join(json.dumps(option, ensure_ascii=False) for option in schema["enum"])
        return f"{where} must be one of {options}, got {json.dumps(value, ensure_ascii=False)[:60]}"
    if isinstance(value, dict) and "properties" in schema:
        properties = schema["properties"]
        for key in schema.get("required", []):
            if key not in value:
                missing = "".join(path + ("." + key,)).lstrip(".")
                return f"{where} is missing required argument {missing!r}"
        extra = schema.get("additionalProperties", False)
        for key, item in value.items():
            child = properties.get(key, extra if isinstance(extra, dict) else None)
            if child is not None:
                error = _schema_error(item, child, tool, path + ("." + key,))
                if error:
                    return error
            elif extra is not True:
                return (f"{where} got unexpected argument {key!r}; "
                        f"it takes: {', '.join(properties)}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            error = _schema_error(item, schema["items"], tool, path + (f"[{index}]",))
            if error:
                return error
    return None
