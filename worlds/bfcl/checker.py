"""Score a BFCL multi-turn episode as BFCL does: through bfcl-eval's own `multi_turn_checker`.

BFCL's checker does not read a final answer. It re-executes the model's calls, turn by turn and
step by step, on fresh backend instances, and the ground truth's calls on others, and after each
turn with ground truth requires (1) every instance's public attributes to equal the ground
truth's (state check) and (2) every ground-truth call's result to be among the results of the
model's calls so far (response check). A turn whose ground truth is empty (miss_func's and
miss_param's "cannot do it yet" turns) is not checked, but its calls still run. An episode with
fewer turns than the task (truncated, stopped) fails, as BFCL's "force-terminated" does.

So the checker needs the calls the student made, per user turn, as it emitted them:

    calls_by_turn = [                        # one entry per user turn of the record
        [                                    # the turn's assistant steps (messages) ...
            [{"name": "cd", "arguments": {"folder": "document"}}, ...],   # ... each a list
        ], ...]

(a turn may also be a flat list of calls: one step). Calls are turned into BFCL's call strings
by `worlds.bfcl.convert.call_string` (identifier names, JSON literal values: the only strings
BFCL's checker will `eval`); calls the environment would refuse (not a function of the task,
a required argument missing or an unknown one) are left out, exactly as the environment never
ran them.

Plugin form (eval.checker): `check(final_text, record, state=None, calls_by_turn=None)`. The
calls come from `calls_by_turn`, else from `state["calls_by_turn"]`, else from `state["calls"]`
when every call there carries its user-turn index as "turn". See worlds/bfcl/README.md.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Sequence
from typing import Any

from opd.tool_calls import ToolCall
from opd.tool_schemas import Tool, ToolRegistry
from worlds.bfcl.convert import bfcl, call_string, task_schemas
from worlds.bfcl.environment import _not_called

_RUNS = itertools.count()


def _registry(classes: Sequence[str]) -> ToolRegistry:
    return ToolRegistry([Tool(schema, _not_called) for schema in task_schemas(list(classes))])


def decoded_turns(record: dict, calls_by_turn: Sequence) -> tuple[list[list[list[str]]], int]:
    """BFCL's decoded model result (turn -> step -> call strings) and how many calls were left
    out because the environment would refuse them."""
    registry = _registry(record["environment"]["involved_classes"])
    decoded, dropped = [], 0
    for turn in calls_by_turn:
        steps = [turn] if turn and isinstance(turn[0], dict) else list(turn)
        turn_steps = []
        for step in steps:
            strings = []
            for call in step:
                name, arguments = call.get("name"), call.get("arguments")
                if not isinstance(name, str) or registry.validate(
                        ToolCall(name, arguments), check_types=False):  # as the environment
                    dropped += 1
                    continue
                strings.append(call_string(name, arguments))
            if strings:  # BFCL skips steps that decode to no call
                turn_steps.append(strings)
        decoded.append(turn_steps)
    return decoded, dropped


def score(record: dict, calls_by_turn: Sequence) -> dict:
    """BFCL's verdict on one episode: {"valid": bool, ...BFCL's error fields, "dropped_calls"}."""
    bfcl()
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    ground_truth = record["ground_truth"]
    decoded, dropped = decoded_turns(record, calls_by_turn)
    if len(decoded) != len(ground_truth):
        return {"valid": False, "error_type": "multi_turn:force_terminated",
                "error_message": f"the episode has {len(decoded)} turns, the task "
                                 f"{len(ground_truth)}", "dropped_calls": dropped}
    # BFCL keeps instances in its module's globals under the model name and task id: a fresh
    # name per check (so no state leaks between checks), removed afterwards.
    model_name = f"opd_{os.getpid()}_{next(_RUNS)}"
    entry = {"id": record["id"], "involved_classes": record["environment"]["involved_classes"],
             "initial_config": record["environment"]["initial_config"]}
    try:
        result = multi_turn_checker(decoded, ground_truth, entry, record["family"], model_name)
    finally:
        prefix = re.sub(r"[-./:]", "_", model_name) + "_"
        for key in [k for k in vars(multi_turn_utils) if k.startswith(prefix)]:
            del vars(multi_turn_utils)[key]
    return {"valid": bool(result["valid"]),
            **{k: result[k] for k in ("error_type", "error_message") if k in result},
            "dropped_calls": dropped}


def calls_from_state(state: dict | None, turns: int) -> list | None:
    """calls_by_turn from an environment's final state, where it carries them (see module)."""
    if not state:
        return None
    if "calls_by_turn" in state:
        return state["calls_by_turn"]
    calls = state.get("calls")
    if calls and all(isinstance(c.get("turn"), int) for c in calls):
        by_turn: list[list[dict]] = [[] for _ in range(max(turns, 1 + max(c["turn"]
                                                                             for c in calls)))]
        for c in calls:
            by_turn[c["turn"]].append({"name": c["name"], "arguments": c["arguments"]})
        return by_turn
    return None


def check(final_text: str, record: dict, episode=None,
          calls_by_turn: Sequence | None = None) -> bool:
    """eval.checker: whether BFCL's multi-turn checker accepts the episode (`final_text` is not
    used: BFCL judges calls and states, not a final answer). `episode` is opd.eval's
    EpisodeOutcome (its calls_by_turn), or an environment state that carries the calls."""
    turns = len(record["ground_truth"])
    if calls_by_turn is None:
        calls_by_turn = getattr(episode, "calls_by_turn", None) \
            or calls_from_state(episode if isinstance(episode, dict) else None, turns)
    if calls_by_turn is None:
        raise ValueError(
            f"{record.get('id')}: the BFCL checker needs the student's calls per user turn "
            "(calls_by_turn, or an environment state with calls_by_turn or turn-tagged calls)")
    return score(record, calls_by_turn)["valid"]


# opd.eval reports the checker's verdicts under this name, averaged over the categories as BFCL
# does, beside its stricter success_rate.
check.accuracy_name = "bfcl_accuracy"  # type: ignore[attr-defined]


def calls_from_messages(messages: Sequence[dict], parser=None) -> list[list[list[dict]]]:
    """calls_by_turn from an OpenAI-style conversation: each assistant message is a step of the
    turn its last user message opened; its calls are its "tool_calls" (arguments as an object
    or JSON text) or, with `parser` (text -> [opd.tool_calls.ToolCall]), parsed from its content."""
    import json

    turns: list[list[list[dict]]] = []
    for message in messages:
        if message["role"] == "user":
            turns.append([])
        elif message["role"] == "assistant" and turns:
            step: list[dict[str, Any]] = []
            for call in message.get("tool_calls") or []:
                function = call.get("function", call)
                arguments = function.get("arguments", {})
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except ValueError:
                        arguments = None
                step.append({"name": function.get("name"), "arguments": arguments})
            if not step and parser is not None:
                step = [{"name": c.name, "arguments": c.arguments}
                        for c in parser(message.get("content") or "") if c.error is None]
            turns[-1].append(step)
    return turns
