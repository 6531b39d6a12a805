"""A BFCL multi-turn episode as a stateful environment, on bfcl-eval's own backend classes.

`BFCLEnvironment(config)` takes a record's "environment" field ({"involved_classes",
"initial_config", "long_context"}) and builds the involved classes exactly as BFCL's executor
does (`bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils.execute_multi_turn_func_call`):
one instance per class, `_load_scenario(deepcopy(initial_config[class]), long_context=...)`
for every class but the stateless ones. It lives in the episode's sandboxed worker.

`call(name, arguments)` runs one method on its owning instance with the parsed JSON arguments,
through getattr: nothing is ever evaluated. A name that is not one of the task's documented
functions, a missing required argument or an unknown one raise ValueError, which the worker
turns into that call's {"error": ...} observation. Argument *types* are not checked
(CHECK_ARGUMENT_TYPES): bfcl-eval's executor passes whatever the call says to the Python method
(its ground truth calls `close_ticket(ticket_id='ticket_001')` where the doc says integer), so
refusing such a call would change the episode. The observation is bfcl-eval's, byte for byte
(TEXT_OBSERVATIONS: the worker shows the returned text as it is, not JSON-quoted): a string as
is, a dict as `json.dumps(dict)` (str() when that fails), anything else as str(result), and an
exception raised by the method as "Error during execution: <message>", as an "ok" call, the
way bfcl-eval's executor (and so its checker, which re-runs the call) sees it. A call to a
miss_func function before the turn that offers it runs (RUNS_WITHHELD_TOOLS): bfcl-eval's
executor runs any method of the instances, whatever the model was shown.

`state()` is what BFCL's state checker compares: per class, the instance's public attributes
(`vars`, names not starting with "_"), made JSON-able (objects as their public attributes
without back references, datetimes as ISO text). It also carries "calls": every call this
episode made, in order, as {"name", "arguments", "ok"}.
"""

from __future__ import annotations

import copy
import datetime
import json
from typing import Any

from opd.tool_calls import ToolCall
from opd.tool_schemas import Tool, ToolRegistry
from worlds.bfcl.convert import (
    MULTI_TURN_CLASSES,
    backend_class,
    stateless,
    task_functions,
    task_schemas,
)

CALLS_KEY = "calls"


def _not_called(**_arguments):  # the registry validates only; calls go to the backends
    raise RuntimeError("BFCL schemas are validated here, not called")


class BFCLEnvironment:
    """One episode of a BFCL multi-turn task (see the module docstring)."""

    TEXT_OBSERVATIONS = True  # call() returns the observation text itself
    CHECK_ARGUMENT_TYPES = False  # the executor checks names only, as bfcl-eval does
    RUNS_WITHHELD_TOOLS = True  # bfcl-eval runs a miss_func function before its turn too

    def __init__(self, config: dict):
        if not isinstance(config, dict) or not isinstance(config.get("involved_classes"), list):
            raise ValueError('a BFCL environment needs {"involved_classes": [...], '
                             '"initial_config": {...}}')
        self.classes = list(config["involved_classes"])
        initial_config = config.get("initial_config") or {}
        long_context = bool(config.get("long_context", False))
        self.instances: dict[str, Any] = {}
        for class_name in self.classes:
            instance = backend_class(class_name)()
            if not stateless(class_name):
                instance._load_scenario(copy.deepcopy(initial_config.get(class_name, {})),
                                        long_context=long_context)
            self.instances[class_name] = instance
        self.owners = task_functions(self.classes)
        self.registry = ToolRegistry([Tool(schema, _not_called)
                                      for schema in task_schemas(self.classes)])
        self.calls: list[dict] = []

    @classmethod
    def preload(cls) -> None:
        """Import every backend and read every function doc in the worker, before episodes
        fork and drop to an unprivileged user that may not read bfcl-eval's install."""
        for class_name in MULTI_TURN_CLASSES:
            backend_class(class_name)
            stateless(class_name)
            task_schemas([class_name])

    def call(self, name: str, arguments: dict) -> Any:
        if name not in self.owners:
            self.calls.append({"name": str(name), "arguments": arguments, "ok": False})
            raise ValueError(f"unknown function {name!r}; this task's functions: "
                             f"{', '.join(self.owners)}")
        error = self.registry.validate(ToolCall(name, arguments), self.CHECK_ARGUMENT_TYPES)
        if error is not None:
            self.calls.append({"name": name, "arguments": arguments, "ok": False})
            raise ValueError(error)
        method = getattr(self.instances[self.owners[name]], name)
        self.calls.append({"name": name, "arguments": copy.deepcopy(arguments), "ok": True})
        try:
            result = method(**arguments)
        except Exception as exc:  # bfcl-eval's executor catches exactly these
            return f"Error during execution: {exc}"
        return shown_result(result)

    def state(self) -> dict:
        state: dict[str, Any] = {name: instance_state(instance)
                                 for name, instance in self.instances.items()}
        state[CALLS_KEY] = jsonable(self.calls)
        return state

    def close(self) -> None:
        self.instances.clear()


def shown_result(result: Any) -> str:
    """The result's text as bfcl-eval's executor makes it (execute_multi_turn_func_call): a str
    as is, a dict as json.dumps (ASCII escapes, default separators), else str()."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except Exception:  # bfcl-eval's bare except, less KeyboardInterrupt and SystemExit
            return str(result)
    return str(result)


def instance_state(instance: Any) -> dict:
    """What BFCL's state checker compares of one instance (its public attributes), JSON-able."""
    return {key: jsonable(value, (id(instance),)) for key, value in vars(instance).items()
            if not key.startswith("_")}


def jsonable(value: Any, ancestors: tuple = ()) -> Any:
    """`value` as JSON: containers recursively, objects as their public attributes (a back
    reference to an enclosing object, like a directory's parent, is left out)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if id(value) in ancestors:
        return None
    inner = (*ancestors, id(value))
    if isinstance(value, dict):
        return {str(k): jsonable(v, inner) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, inner) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable(v, inner) for v in value), key=repr)
    if hasattr(value, "__dict__"):
        return {"__class__": type(value).__name__,
                **{k: jsonable(v, inner) for k, v in vars(value).items()
                   if not k.startswith("_") and id(v) not in ancestors}}
    return str(value)
