"""The BFCL multi-turn world: conversion, the environment on bfcl-eval's backends, and scoring
through bfcl-eval's own checker, replayed on BFCL's ground truth for all 800 tasks (~20 s), and
through the trainer's sandbox against bfcl-eval's own execution (a stratified subset here, all
800 under -m slow)."""

from __future__ import annotations

import builtins
import copy
import json
import re
from collections import Counter

import pytest

pytest.importorskip("bfcl_eval", reason="the BFCL extra: pip install --no-deps -r "
                                        "requirements-bfcl.txt")

import yaml
from bfcl_eval.constants.default_prompts import (
    DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING,
)
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
    multi_turn_checker,
)

from opd.tool_calls import ToolCall
from opd.tool_schemas import Tool, ToolRegistry
from worlds.bfcl.checker import calls_from_messages, check, score
from worlds.bfcl.convert import CATEGORIES, MULTI_TURN_CLASSES, call_string, convert, split_of
from worlds.bfcl.environment import (
    CALLS_KEY,
    BFCLEnvironment,
    _not_called,
    instance_state,
)

# The one ground truth that calls a function before bfcl-eval offers it: miss_func_49 calls
# tail(...) in turn 1, its doc arrives in turn 3. bfcl-eval's executor runs any method of the
# instances, and so does a BFCL episode (BFCLEnvironment.RUNS_WITHHELD_TOOLS).
CALLS_A_HELD_OUT_FUNCTION_EARLY = "multi_turn_miss_func_49"
RECIPE = "recipes/bfcl_qwen3_8b_to_1.7b.yaml"
# Tasks where the test's corruption (the last string argument + "_x") is neutral for BFCL's own
# backend: scenario 139's add_to_watchlist(stock='ZETA_x') leaves the same watchlist and result
# (in miss_func the corrupted call lands in another turn, and fails).
NEUTRAL_CORRUPTION = {f"multi_turn_{c}_139" for c in ("base", "miss_param", "long_context")}


def number(record: dict) -> int:
    return int(record["id"].rsplit("_", 1)[1])


@pytest.fixture(scope="module")
def records():
    return convert()


def replay(record: dict) -> tuple[list[list[list[dict]]], BFCLEnvironment]:
    """A scripted student: each turn, one assistant step with the turn's ground-truth calls,
    run through the environment in-process; returns what the checker receives."""
    env = BFCLEnvironment(copy.deepcopy(record["environment"]))
    turns = []
    for calls in record["ground_truth_calls"]:
        for call in calls:
            env.call(call["name"], copy.deepcopy(call["arguments"]))
        turns.append([calls] if calls else [])
    return turns, env


def bfcl_ground_truth_state(record: dict) -> dict:
    """The instances after BFCL's own executor runs the ground truth (its strings, verbatim)."""
    name = f"gt_state_{record['id']}"
    instances = {}
    try:
        for calls in record["ground_truth"]:
            _, instances = multi_turn_utils.execute_multi_turn_func_call(
                calls, record["environment"]["initial_config"],
                record["environment"]["involved_classes"], name, record["id"],
                long_context=record["environment"]["long_context"])
        return {k: instance_state(v) for k, v in instances.items()}
    finally:
        for key in [k for k in vars(multi_turn_utils) if k.startswith(name)]:
            del vars(multi_turn_utils)[key]


def test_converted_records(records):
    assert Counter(r["family"] for r in records) == {c: 200 for c in CATEGORIES}
    assert {c for r in records for c in r["environment"]["involved_classes"]} \
        == set(MULTI_TURN_CLASSES)  # what BFCLEnvironment.preload loads
    for record in records:
        entry_turns = len(record["ground_truth"])
        assert [m["role"] for m in record["messages"]] == ["user"] * entry_turns
        assert record["environment"]["long_context"] == (record["family"] == "long_context")
        assert ("tools_by_turn" in record) == (record["family"] == "miss_func")
        json.dumps(record)


def test_schemas_validate_through_the_tool_registry(records):
    types = Counter()
    for record in records:
        schemas = record["tools"] + [s for turn in record.get("tools_by_turn", []) for s in turn]
        registry = ToolRegistry([Tool(s, _not_called) for s in schemas])
        for schema in schemas:
            for spec in schema["function"]["parameters"]["properties"].values():
                types[spec["type"]] += 1
        for calls in record["ground_truth_calls"]:
            for call in calls:
                error = registry.validate(ToolCall(call["name"], call["arguments"]),
                                          check_types=False)
                assert error is None, call
                strict = registry.validate(ToolCall(call["name"], call["arguments"]))
                assert (strict is None) == (call != {"name": "close_ticket",
                                                     "arguments": {"ticket_id": "ticket_001"}})
    assert set(types) <= {"string", "number", "integer", "boolean", "array", "object"}
    assert types["number"] and types["object"]  # BFCL's "float" and "dict"


def test_miss_func_adds_the_held_out_function_at_its_turn(records):
    record = next(r for r in records if r["id"] == "multi_turn_miss_func_0")
    assert [[s["function"]["name"] for s in turn] for turn in record["tools_by_turn"]] \
        == [[], [], [], ["sort"], []]
    assert "sort" not in {s["function"]["name"] for s in record["tools"]}
    assert "'name': 'sort'" in record["messages"][3]["content"]


def test_miss_func_messages_are_what_bfcl_evals_local_model_prompting_sends(records):
    """The held-out functions' docs reach the model in the appended user message, exactly as
    bfcl-eval's prompting path for local models (base_handler.inference_multi_turn_prompting)
    writes that message: a chat template lists tools only in its opening system block."""
    from bfcl_eval.utils import populate_test_cases_with_predefined_functions

    from worlds.bfcl.convert import load_entries

    ours = {r["id"]: r for r in records if r["family"] == "miss_func"}
    entries = [copy.deepcopy(entry) for entry, _ in load_entries("miss_func")]
    populate_test_cases_with_predefined_functions(entries)
    assert len(entries) == len(ours) == 200
    for entry in entries:
        for turn, docs in entry["missed_function"].items():
            expected = DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(functions=docs)
            assert ours[entry["id"]]["messages"][int(turn)]["content"] == expected, entry["id"]
            assert all(f"'name': '{doc['name']}'" in expected for doc in docs)


def test_split_is_by_scenario_and_the_same_for_every_category(records):
    held = {c: {number(r) for r in records if r["family"] == c and r["split"] == "heldout"}
            for c in CATEGORIES}
    assert len({frozenset(v) for v in held.values()}) == 1
    assert 30 <= len(held["base"]) <= 50
    assert all(r["split"] == split_of(r["id"]) for r in records)
    # the four variants of a scenario share their functions and start state
    by_number = {}
    for record in records:
        by_number.setdefault(number(record), set()).add(
            json.dumps(record["environment"]["involved_classes"]))
    assert all(len(v) == 1 for v in by_number.values())


def test_replayed_ground_truth_scores_as_bfcl_does(records):
    """Every task bfcl-eval's own checker accepts its ground truth on (all 800) scores 100%
    through the environment and the project's checker (argument types are not checked, as
    bfcl-eval does not: scenario 173's close_ticket(ticket_id='ticket_001') runs); the
    environment's final state is what BFCL's executor leaves."""
    passed = Counter()
    for index, record in enumerate(records):
        raw = multi_turn_checker([[t] if t else [] for t in record["ground_truth"]],
                                 record["ground_truth"],
                                 {"id": record["id"], **record["environment"]},
                                 record["family"], f"raw_{index}")
        assert raw["valid"], record["id"]
        turns, env = replay(record)
        verdict = score(record, turns)
        assert verdict == {"valid": True, "dropped_calls": 0}, (record["id"], verdict)
        state = env.state()
        assert len(state.pop(CALLS_KEY)) == sum(map(len, record["ground_truth_calls"]))
        assert state == bfcl_ground_truth_state(record), record["id"]
        passed[record["family"]] += 1
    assert passed == {c: 200 for c in CATEGORIES}
    assert not [k for k in vars(multi_turn_utils) if k.startswith("opd_")]  # no leaked state


def _corrupted(calls: list) -> list:
    calls = copy.deepcopy(calls)
    for turn in reversed(calls):
        for call in reversed(turn):
            for key, value in call["arguments"].items():
                if isinstance(value, str):
                    call["arguments"][key] = value + "_x"
                    return calls
    raise AssertionError("no string argument")


def test_one_corrupted_call_fails_the_task(records):
    for record in records:
        calls = _corrupted(record["ground_truth_calls"])
        verdict = score(record, [[turn] if turn else [] for turn in calls])
        assert verdict["valid"] == (record["id"] in NEUTRAL_CORRUPTION), record["id"]
        # a turn left without its calls fails it too
        dropped = [[t] if t else [] for t in record["ground_truth_calls"]]
        last = max(i for i, t in enumerate(dropped) if t)
        dropped[last] = []
        assert not score(record, dropped)["valid"]
        # and so does an episode that stopped a turn early
        assert not score(record, dropped[:-1])["valid"]


def test_environment_refuses_unknown_names_and_arguments_and_never_evaluates(
        records, monkeypatch, tmp_path):
    record = next(r for r in records if r["id"] == "multi_turn_base_0")
    env = BFCLEnvironment(record["environment"])

    def no_eval(*args, **kwargs):
        raise AssertionError("eval called")

    monkeypatch.setattr(builtins, "eval", no_eval)
    monkeypatch.setattr(builtins, "exec", no_eval)
    for name in ("_load_scenario", "__init__", "eval", "print", "cd; import os",
                 "close_ticket", "post_tweet(content='x')"):
        if name == "post_tweet(content='x')" or name not in env.owners:
            with pytest.raises(ValueError, match="unknown function"):
                env.call(name, {})
    # types are bfcl-eval's business: the method runs, and what it raises is its observation
    assert env.call("cd", {"folder": 3}).startswith("Error during execution: ")
    with pytest.raises(ValueError, match="missing required argument"):
        env.call("cd", {})
    with pytest.raises(ValueError, match="unexpected argument"):
        env.call("cd", {"folder": "document", "shell": True})
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    assert payload in json.dumps(env.call("echo", {"content": payload}))
    assert not marker.exists()
    assert env.call("cd", {"folder": "document"}) == '{"current_working_directory": "document"}'
    assert [c["ok"] for c in env.state()[CALLS_KEY]][-6:] \
        == [False, True, False, False, True, True]


def recipe_max_result_chars() -> int:
    with open(RECIPE) as handle:
        return yaml.safe_load(handle)["tools"]["max_result_chars"]


def stratified(records: list[dict]) -> list[dict]:
    """Per category: its first task, its first TravelAPI and first TradingBot tasks (their
    backends call datetime.strptime, which imports _strptime lazily), and its task with the
    longest observation (long_context's reach 31,706 characters); miss_func_49 too."""
    longest = {"base": 12, "miss_func": 12, "miss_param": 12, "long_context": 100}
    chosen = {}
    for family in CATEGORIES:
        mine = [r for r in records if r["family"] == family]
        for pick in (mine[0],
                     next(r for r in mine if "TravelAPI" in r["environment"]["involved_classes"]),
                     next(r for r in mine if "TradingBot" in r["environment"]["involved_classes"]),
                     next(r for r in mine if number(r) == longest[family])):
            chosen[pick["id"]] = pick
    chosen[CALLS_A_HELD_OUT_FUNCTION_EARLY] = next(
        r for r in records if r["id"] == CALLS_A_HELD_OUT_FUNCTION_EARLY)
    return list(chosen.values())


def assert_as_bfcl_eval(rows: list[dict]) -> None:
    """Observations byte for byte, final states and checker verdicts as bfcl-eval's own,
    miss_func_49's early call to a function not yet offered included."""
    for row in rows:
        assert row["observations"] and row["state"] and row["verdict"], row


def test_sandboxed_episodes_replay_ground_truth_as_bfcl_eval_does(records):
    """What a rollout runs (each episode in its sandboxed worker, as the unprivileged user when
    the trainer is root, under the BFCL recipe's max_result_chars) against bfcl-eval's own
    executor and checker, on a stratified subset: travel and trading tasks (strptime after the
    privilege drop), long_context's longest results, string and dict observations."""
    from worlds.bfcl.fidelity import compare

    chosen = stratified(records)
    assert {"TravelAPI", "TradingBot"} <= {c for r in chosen
                                           for c in r["environment"]["involved_classes"]}
    assert_as_bfcl_eval(compare(chosen, max_result_chars=recipe_max_result_chars(), workers=4))


@pytest.mark.slow
def test_all_800_sandboxed_episodes_replay_ground_truth_as_bfcl_eval_does(records):
    from worlds.bfcl.fidelity import compare

    rows = compare(records, max_result_chars=recipe_max_result_chars(), workers=4)
    assert len(rows) == 800
    assert_as_bfcl_eval(rows)


def test_checker_plugin_takes_calls_from_the_state_or_a_conversation(records):
    record = next(r for r in records if r["id"] == "multi_turn_miss_func_0")
    turns, env = replay(record)
    state = env.state()
    assert check("", record, calls_by_turn=turns)
    assert check("any final text", record, {**state, "calls_by_turn": turns})
    tagged = [{**c, "turn": t} for t, calls in enumerate(record["ground_truth_calls"])
              for c in calls]
    assert check("", record, {CALLS_KEY: tagged})
    assert not check("", record, {CALLS_KEY: tagged[:-1]})
    with pytest.raises(ValueError, match="calls per user turn"):
        check("", record, state)
    messages = []
    for user, calls in zip(record["messages"], record["ground_truth_calls"]):
        messages.append(user)
        if calls:
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": c["name"],
                                                  "arguments": json.dumps(c["arguments"])}}
                for c in calls]})
            messages.append({"role": "tool", "content": "..."})
        messages.append({"role": "assistant", "content": "done"})
    assert check("", record, calls_by_turn=calls_from_messages(messages))


def test_call_strings_are_only_ever_one_literal_call():
    assert call_string("cd", {"folder": "a'b"}) == "cd(folder=\"a'b\")"
    assert call_string("f", {"x": [1, 2.5, None, True, {"k": "v"}]}) \
        == "f(x=[1, 2.5, None, True, {'k': 'v'}])"
    for name, arguments in (("os.system", {}), ("__import__", {}), ("f", {"a b": 1}),
                            ("f", {"x": float("nan")}), ("f", {"x": object()}),
                            ("f", {"_x": 1}), ("f); g(", {})):
        with pytest.raises(ValueError):
            call_string(name, arguments)
    assert re.fullmatch(r"\w+\(.*\)", call_string("f", {"x": ")\nimport os"}))
