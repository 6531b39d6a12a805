"""Several user turns per episode, with a stateful environment: masks, spans, limits, final
state, and completions rendered token for token as a scripted rollout holds them."""

from __future__ import annotations

import json

import pytest
from env_fixtures import COUNTER_TOOLS, Counter, EarlyCounter
from scripted_model import ScriptedEngine, ScriptedPolicy

from opd.chat import ChatFormat
from opd.data import completion_trajectory, prompt_record, user_turns
from opd.errors import OPDError
from opd.eval import evaluate
from opd.rollout import RolloutConfig, rollout
from opd.tool_schemas import ToolRegistry
from opd.tools import ToolExecutor


def call(name: str, **arguments) -> str:
    return "<tool_call>\n%s\n</tool_call>" % json.dumps({"name": name, "arguments": arguments})


ALPHA_USERS = ["Q-alpha: say hello", "now add two", "and the count?"]
SCRIPTS = {
    "Q-alpha": ["Hello.", call("add", by=2), "Added.", call("get"), "It is 7."],
    "Q-beta": [call("add", by=1), "Done."],
    "Q-gamma": [call("add"), call("crash"), "never written"],
    "Q-delta": ["unreachable"],
    "Q-later": [call("add"), "Not yet.", call("add", by=3), "Now."],
}
ALPHA = {"messages": [{"role": "system", "content": "Be brief."},
                      *({"role": "user", "content": text} for text in ALPHA_USERS)],
         "tools": COUNTER_TOOLS, "environment": {"start": 5}}
BETA = {"messages": [{"role": "user", "content": "Q-beta"}], "tools": COUNTER_TOOLS,
        "environment": {"start": 100}}
GAMMA = {"messages": [{"role": "user", "content": "Q-gamma"}], "tools": COUNTER_TOOLS}
DELTA = {"messages": [{"role": "user", "content": "Q-delta"}], "tools": COUNTER_TOOLS,
         "environment": {"start": "many"}}  # Counter's constructor raises
GET, ADD = COUNTER_TOOLS[1], COUNTER_TOOLS[0]
LATER = {"messages": [{"role": "user", "content": "Q-later"}, {"role": "user", "content": "go"}],
         "tools": [GET], "tools_by_turn": [None, [ADD]]}

TEMPLATES = {"qwen3": ({"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
             "compact": ({}, "<|im_start|>assistant\n")}


@pytest.fixture(scope="module")
def executor():
    with ToolExecutor(ToolRegistry([]), environment=Counter, timeout_s=5.0) as pool:
        yield pool


# phases: the HF engine's phase-synchronous batch; per_conversation: the vLLM engine's schedule
# (turns finish out of order, tools run on their lane while other turns generate).
@pytest.fixture(params=[(template, schedule) for template in sorted(TEMPLATES)
                        for schedule in ("phases", "per_conversation")],
                ids=lambda param: "-".join(param))
def scripted(request, qwen3_tokenizer, compact_tokenizer):
    template, schedule = request.param
    tokenizer = qwen3_tokenizer if template == "qwen3" else compact_tokenizer
    kwargs, prefix = TEMPLATES[template]
    chat = ChatFormat(tokenizer, kwargs)
    policy = ScriptedEngine if schedule == "per_conversation" else ScriptedPolicy
    return chat, policy(tokenizer, SCRIPTS, tokenizer.eos_token_id, prefix)


def run(scripted, executor, records, **limits):
    chat, policy = scripted
    cfg = RolloutConfig(**{"max_turns": 8, "max_new_tokens": 64, "max_total_len": 2048,
                           "batch_size": len(records), **limits})
    if isinstance(policy, ScriptedEngine):
        return rollout(None, chat, executor, records, cfg, engine=policy)
    return rollout(policy, chat, executor, records, cfg)


def test_the_prompt_and_further_user_turns_of_a_record():
    assert prompt_record(ALPHA)["messages"] == ALPHA["messages"][:2]
    assert [m["content"] for m in user_turns(ALPHA)] == ALPHA_USERS[1:]
    gold = {"messages": [*ALPHA["messages"][:2], {"role": "assistant", "content": "hi"},
                         ALPHA["messages"][2]]}
    assert prompt_record(gold)["messages"] == ALPHA["messages"][:2]
    assert user_turns(gold) == [ALPHA["messages"][2]]
    assert user_turns(BETA) == []


def test_user_turns_are_context_and_every_assistant_token_a_target(scripted, executor):
    chat, _ = scripted
    alpha, beta = run(scripted, executor, [ALPHA, BETA])
    kinds = [kind for _, _, kind in alpha.spans]
    assert kinds == ["prompt", "assistant", "user", "assistant", "observation", "assistant",
                     "user", "assistant", "observation", "assistant"]
    assert not alpha.truncated and alpha.turns == 5 and alpha.tool_calls == 2
    ids, mask = alpha.input_ids, alpha.assistant_mask
    assert mask == [kind == "assistant" for start, end, kind in alpha.spans
                    for _ in range(start, end)]
    assert len(alpha.logprobs) == sum(mask)
    for (start, end), text in zip(alpha.assistant_spans(), SCRIPTS["Q-alpha"]):
        assert ids[start:end] == chat.encode(text) + [chat.tokenizer.eos_token_id]
    users = [chat.tokenizer.decode(ids[s:e]) for s, e, kind in alpha.spans if kind == "user"]
    assert [ALPHA_USERS[1] in users[0], ALPHA_USERS[2] in users[1]] == [True, True]
    # the episode's state ran through all user turns; the other episode kept its own
    assert alpha.environment_state == {"count": 7, "log": [2]}
    assert beta.environment_state == {"count": 101, "log": [1]}
    assert (beta.turns, beta.truncated) == (2, False)
    # what a call-judging checker (BFCL's) sees: the calls that ran, per user turn and message
    assert alpha.calls_by_turn == [[[]], [[{"name": "add", "arguments": {"by": 2}}], []],
                                   [[{"name": "get", "arguments": {}}], []]]
    assert beta.calls_by_turn == [[[{"name": "add", "arguments": {"by": 1}}], []]]


def test_dying_and_unbuildable_environments_truncate_only_their_episode(scripted, executor):
    alpha, gamma, delta = run(scripted, executor, [ALPHA, GAMMA, DELTA])
    assert (gamma.truncated, gamma.truncation_reason) == (True, "environment_died")
    assert "crashed" in gamma.environment_error and gamma.environment_state is None
    assert gamma.turns == 2 and (gamma.counts.valid, gamma.counts.failed) == (1, 1)
    assert gamma.spans[-1][2] == "assistant"  # no observation after the fatal call
    assert (delta.truncation_reason, delta.turns, sum(delta.assistant_mask)) == \
        ("environment_start_failed", 0, 0)
    assert "constructor" in delta.environment_error
    assert not alpha.truncated and alpha.environment_state == {"count": 7, "log": [2]}


def test_eval_stops_when_no_episode_of_a_batch_can_start_its_environment(scripted, executor):
    chat, policy = scripted
    cfg = RolloutConfig(max_turns=8, max_new_tokens=64, max_total_len=2048, batch_size=2)
    metrics = evaluate(policy, chat, executor, [ALPHA, DELTA], lambda text, record: True, cfg)
    assert metrics["truncation_rate"] == 0.5  # one broken record is that task's failure
    with pytest.raises(OPDError, match=r"could start its environment.*constructor"):
        evaluate(policy, chat, executor, [DELTA, DELTA], lambda text, record: True, cfg)


def test_max_turns_counts_assistant_turns_over_the_whole_episode(scripted, executor):
    (after_hello,) = run(scripted, executor, [ALPHA], max_turns=1)
    assert (after_hello.truncation_reason, after_hello.turns) == ("max_turns", 1)
    assert [kind for _, _, kind in after_hello.spans] == ["prompt", "assistant"]
    assert after_hello.environment_state == {"count": 5, "log": []}
    (after_add,) = run(scripted, executor, [ALPHA], max_turns=2)
    assert (after_add.truncation_reason, after_add.turns, after_add.counts.valid) == \
        ("max_turns", 2, 1)
    assert after_add.environment_state == {"count": 5, "log": []}  # the cut call never ran
    prompt_and_hello = after_hello.spans[-1][1]
    (short,) = run(scripted, executor, [ALPHA], max_total_len=prompt_and_hello + 8)
    assert short.truncation_reason == "max_total_len"
    assert len(short.input_ids) <= prompt_and_hello + 8


def test_tools_by_turn_offers_tools_from_their_user_turn_on(scripted, executor):
    (later,) = run(scripted, executor, [LATER])
    assert [kind for _, _, kind in later.spans] == [
        "prompt", "assistant", "observation", "assistant", "user", "assistant", "observation",
        "assistant"]
    assert (later.counts.invalid, later.counts.valid) == (1, 1)
    assert later.environment_state == {"count": 3, "log": [3]}
    # the call refused before its tool was offered did not run, so it is not a call of the turn
    assert later.calls_by_turn == [[[], []], [[{"name": "add", "arguments": {"by": 3}}], []]]


def test_an_environment_that_runs_withheld_tools_runs_them_before_their_turn(scripted):
    """RUNS_WITHHELD_TOOLS (BFCL): the first turn's call to `add`, offered only at the second
    user turn, runs; the prompt still shows `add` only from its turn on."""
    chat, _ = scripted
    with ToolExecutor(ToolRegistry([]), environment=EarlyCounter, timeout_s=5.0) as pool:
        (later,) = run(scripted, pool, [LATER])
    assert (later.counts.invalid, later.counts.valid) == (0, 2)
    assert later.environment_state == {"count": 4, "log": [1, 3]}
    assert later.calls_by_turn == [[[{"name": "add", "arguments": {}}], []],
                                   [[{"name": "add", "arguments": {"by": 3}}], []]]
    start, end, kind = later.spans[0]
    assert kind == "prompt" and '"add"' not in chat.tokenizer.decode(later.input_ids[start:end])


def test_completion_of_a_multi_user_turn_conversation_equals_the_scripted_rollout(
        scripted, executor):
    chat, _ = scripted
    (rolled,) = run(scripted, executor, [ALPHA])
    alpha = SCRIPTS["Q-alpha"]
    messages = [*ALPHA["messages"][:2],
                {"role": "assistant", "content": alpha[0]}, ALPHA["messages"][2],
                {"role": "assistant", "content": alpha[1]},
                {"role": "tool", "content": json.dumps({"count": 7})},
                {"role": "assistant", "content": alpha[2]}, ALPHA["messages"][3],
                {"role": "assistant", "content": alpha[3]},
                {"role": "tool", "content": json.dumps({"count": 7})},
                {"role": "assistant", "content": alpha[4]}]
    completion = completion_trajectory(chat, messages, COUNTER_TOOLS)
    assert completion.input_ids == rolled.input_ids
    assert completion.assistant_mask == rolled.assistant_mask
    assert completion.spans == rolled.spans
    assert completion.turns == rolled.turns
    # and the rollout's own record (no gold turns) yields the same user turns
    assert user_turns({"messages": messages}) == user_turns(ALPHA)
