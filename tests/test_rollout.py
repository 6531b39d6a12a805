"""Batched multi-turn rollouts: masks, spans, truncation, determinism, padding independence."""

from __future__ import annotations

import pytest
import torch
from scripted_model import ScriptedPolicy

from opd.chat import ChatFormat, tool_observation
from opd.packing import pack_varlen
from opd.rollout import RolloutConfig, collect_trajectory, rollout
from opd.tool_calls import parse_hermes_tool_calls
from worlds.toolcalc.tools import registry as toolcalc_registry

TEMPLATE_KWARGS = {"enable_thinking": False}


def call(expression: str) -> str:
    return ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
            % expression)


SCRIPTS = {
    "Q-two-hops": [call("12 * 7"), call("84 + 1"), "The answer is 85."],
    "Q-malformed": ['<tool_call>{"name": "calculator", "arguments": </tool_call>', "Sorry."],
    "Q-direct": ["The answer is 4."],
    "Q-long-turn": ["x" * 200],
}


@pytest.fixture()
def scripted(qwen3_tokenizer):
    chat = ChatFormat(qwen3_tokenizer, TEMPLATE_KWARGS)
    policy = ScriptedPolicy(qwen3_tokenizer, SCRIPTS, qwen3_tokenizer.eos_token_id,
                            assistant_prefix="<|im_start|>assistant\n<think>\n\n</think>\n\n")
    return chat, policy


def prompt(key: str, tools) -> dict:
    return {"messages": [{"role": "user", "content": key}], "tools": tools}


def check_invariants(trajectory, chat, tools, executor) -> None:
    """What every trajectory must satisfy, scripted or sampled."""
    ids, mask = trajectory.input_ids, trajectory.assistant_mask
    assert len(ids) == len(mask)
    assert trajectory.spans[0][0] == 0 and trajectory.spans[-1][1] == len(ids)
    for (_, end, _), (start, _, _) in zip(trajectory.spans, trajectory.spans[1:]):
        assert end == start
    assistant = trajectory.assistant_spans()
    assert [m for s, e in assistant for m in mask[s:e]] == [True] * sum(mask)
    assert len(trajectory.logprobs) == sum(mask)
    assert all(lp <= 0 for lp in trajectory.logprobs)
    for index, (start, end) in enumerate(assistant):
        ends_with_stop = ids[end - 1] in chat.stop_token_ids
        last_cut = trajectory.truncation_reason in {"max_new_tokens", "max_total_len"}
        assert ends_with_stop or (last_cut and index == len(assistant) - 1)
        assert ids[start:end - 1] == [t for t in ids[start:end - 1]
                                       if t not in chat.stop_token_ids]  # first stop ends a turn
    kinds = [kind for _, _, kind in trajectory.spans]
    for i, (start, end, kind) in enumerate(trajectory.spans):
        if kind != "observation":
            continue
        assert kinds[i - 1] == "assistant"
        turn_start, turn_end, _ = trajectory.spans[i - 1]
        text = chat.tokenizer.decode(ids[turn_start:turn_end], skip_special_tokens=False)
        calls = parse_hermes_tool_calls(text)
        rendered = tool_observation(chat.tokenizer, calls, tools, executor=executor,
                                    **TEMPLATE_KWARGS)
        assert ids[start:end] == rendered[1:] and rendered[0] == ids[turn_end - 1]


def test_scripted_conversations_batched_with_per_row_state(scripted, tools, executor):
    chat, policy = scripted
    keys = ["Q-two-hops", "Q-malformed", "Q-direct", "Q-long-turn"]
    cfg = RolloutConfig(max_turns=3, max_new_tokens=64, max_total_len=1024, batch_size=4)
    two_hops, malformed, direct, long_turn = rollout(
        policy, chat, executor, [prompt(k, tools) for k in keys], cfg)
    for trajectory in (two_hops, malformed, direct, long_turn):
        check_invariants(trajectory, chat, tools, executor)

    stop = chat.tokenizer.eos_token_id
    prompt_ids = chat.prompt_ids(prompt("Q-two-hops", tools)["messages"], tools)
    turn1, turn2, turn3 = (chat.encode(text) + [stop] for text in SCRIPTS["Q-two-hops"])
    obs1 = chat.observation_ids(['{"result": 84}'], tools, stop)
    obs2 = chat.observation_ids(['{"result": 85}'], tools, stop)
    assert two_hops.input_ids == prompt_ids + turn1 + obs1 + turn2 + obs2 + turn3
    expected_mask = ([False] * len(prompt_ids) + [True] * len(turn1) + [False] * len(obs1)
                     + [True] * len(turn2) + [False] * len(obs2) + [True] * len(turn3))
    assert two_hops.assistant_mask == expected_mask
    assert (two_hops.turns, two_hops.tool_calls, two_hops.truncated) == (3, 2, False)
    assert (two_hops.counts.valid, two_hops.counts.invalid, two_hops.counts.failed) == (2, 0, 0)
    assert [kind for _, _, kind in two_hops.spans] == [
        "prompt", "assistant", "observation", "assistant", "observation", "assistant"]

    assert (malformed.turns, malformed.counts.invalid, malformed.truncated) == (2, 1, False)
    observation = chat.tokenizer.decode(malformed.input_ids[malformed.spans[2][0]:])
    assert '{"error": ' in observation

    assert (direct.turns, direct.tool_calls, direct.truncated) == (1, 0, False)
    assert direct.input_ids[-1] == stop
    assert (long_turn.truncated, long_turn.truncation_reason) == (True, "max_new_tokens")
    assert sum(long_turn.assistant_mask) == 64


def test_each_conversation_is_reported_once_as_soon_as_it_is_final(scripted, tools, executor):
    """`on_finished` (what a served teacher scores from) hears of the one-turn conversation
    while the three-turn one still samples, and of each exactly once, in its final state."""
    chat, policy = scripted
    forwards: list[int] = []
    policy.register_forward_hook(lambda *_: forwards.append(1))
    reports: dict[int, tuple[int, list[int]]] = {}

    def on_finished(index, trajectory):
        assert index not in reports
        reports[index] = (len(forwards), list(trajectory.input_ids))

    cfg = RolloutConfig(max_turns=3, max_new_tokens=64, max_total_len=1024, batch_size=2)
    two_hops, direct = rollout(policy, chat, executor,
                               [prompt(k, tools) for k in ("Q-two-hops", "Q-direct")], cfg,
                               on_finished=on_finished)
    assert reports[0][1] == two_hops.input_ids and reports[1][1] == direct.input_ids
    assert reports[1][0] < reports[0][0] == len(forwards)


def test_max_turns_truncates_and_counts_the_unexecuted_calls(scripted, tools, executor):
    chat, policy = scripted
    cfg = RolloutConfig(max_turns=2, max_new_tokens=64, max_total_len=1024)
    (trajectory,) = rollout(policy, chat, executor, [prompt("Q-two-hops", tools)], cfg)
    assert (trajectory.truncated, trajectory.truncation_reason) == (True, "max_turns")
    assert (trajectory.turns, trajectory.tool_calls, trajectory.counts.valid) == (2, 2, 2)
    assert [kind for _, _, kind in trajectory.spans][-1] == "assistant"


def test_max_total_len_stops_before_an_observation_that_does_not_fit(scripted, tools, executor):
    chat, policy = scripted
    prompt_len = len(chat.prompt_ids(prompt("Q-two-hops", tools)["messages"], tools))
    turn_len = len(chat.encode(SCRIPTS["Q-two-hops"][0])) + 1
    cfg = RolloutConfig(max_turns=3, max_new_tokens=64, max_total_len=prompt_len + turn_len + 5)
    (trajectory,) = rollout(policy, chat, executor, [prompt("Q-two-hops", tools)], cfg)
    assert (trajectory.truncated, trajectory.truncation_reason) == (True, "max_total_len")
    assert len(trajectory.input_ids) == prompt_len + turn_len
    assert trajectory.counts.valid == 1  # the call ran; its observation did not fit


def test_max_total_len_caps_the_turn_itself(scripted, tools, executor):
    chat, policy = scripted
    prompt_len = len(chat.prompt_ids(prompt("Q-long-turn", tools)["messages"], tools))
    cfg = RolloutConfig(max_turns=3, max_new_tokens=64, max_total_len=prompt_len + 10)
    (trajectory,) = rollout(policy, chat, executor, [prompt("Q-long-turn", tools)], cfg)
    assert (trajectory.truncation_reason, len(trajectory.input_ids)) == ("max_total_len",
                                                                         prompt_len + 10)


def test_prompt_longer_than_budget_is_a_clear_error(scripted, tools, executor):
    chat, policy = scripted
    with pytest.raises(ValueError, match="Prompt 0 has .* rollout.max_total_len=8"):
        rollout(policy, chat, executor, [prompt("Q-direct", tools)],
                RolloutConfig(max_total_len=8))


def test_bad_limits_raise_like_the_seed(scripted, tools, executor):
    chat, policy = scripted
    for cfg in (RolloutConfig(max_turns=0), RolloutConfig(temperature=0.0)):
        with pytest.raises(ValueError, match="must be positive"):
            rollout(policy, chat, executor, [prompt("Q-direct", tools)], cfg)


@pytest.fixture(scope="module")
def tool_calling_model(compact_tokenizer, tmp_path_factory):
    return train_tool_caller(compact_tokenizer, tmp_path_factory.mktemp("caller"), hidden_size=48)


def train_tool_caller(compact_tokenizer, directory, hidden_size: int):
    """A tiny real model, briefly trained to emit calculator calls, so rollouts use tools;
    saved (trained) to `directory`."""
    from conftest import build_tiny_model

    from opd.trajectory import AgentTrajectory
    model = build_tiny_model(compact_tokenizer, directory, hidden_size=hidden_size)
    chat = ChatFormat(compact_tokenizer, TEMPLATE_KWARGS)
    tools = toolcalc_registry().schemas
    stop = compact_tokenizer.eos_token_id
    examples = []
    for a in range(2, 10):
        ids = chat.prompt_ids([{"role": "user", "content": f"What is {a} * 7?"}], tools)
        turn = chat.encode(call(f"{a} * 7")) + [stop]
        examples.append(AgentTrajectory(ids + turn, [False] * len(ids) + [True] * len(turn),
                                        1, 1, False))
    (batch,) = pack_varlen(examples, max_tokens=100_000)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(80):
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                       use_cache=False).logits[0]
        targets = batch.input_ids[0, 1:][batch.target_mask[0, :-1]]
        loss = torch.nn.functional.cross_entropy(logits[:-1][batch.target_mask[0, :-1]], targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(directory)
    return model.eval()


def sampled_prompts(tools, n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i % 9 + 1} * 7?" + "?" * (i % 5)}],
             "tools": tools} for i in range(n)]


def test_sampled_rollouts_of_a_real_model_hold_the_invariants(
        tool_calling_model, compact_tokenizer, tools, executor):
    chat = ChatFormat(compact_tokenizer, TEMPLATE_KWARGS, tool_calling_model.generation_config)
    cfg = RolloutConfig(max_turns=3, max_new_tokens=40, max_total_len=700, batch_size=8)
    trajectories = rollout(tool_calling_model, chat, executor, sampled_prompts(tools, 24), cfg,
                           seed=3)
    for trajectory in trajectories:
        check_invariants(trajectory, chat, tools, executor)
    assert sum(t.counts.valid for t in trajectories) > 0  # tools really ran
    assert any(kind == "observation" for t in trajectories for _, _, kind in t.spans)


def test_rollout_is_deterministic_under_a_seed(tool_calling_model, compact_tokenizer, tools,
                                               executor):
    chat = ChatFormat(compact_tokenizer, TEMPLATE_KWARGS, tool_calling_model.generation_config)
    cfg = RolloutConfig(max_turns=2, max_new_tokens=24, max_total_len=600, batch_size=4,
                        top_k=50, top_p=0.9)
    run = lambda seed: [t.input_ids for t in rollout(  # noqa: E731
        tool_calling_model, chat, executor, sampled_prompts(tools, 6), cfg, seed=seed)]
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_recorded_logprobs_match_an_unpadded_forward(tool_calling_model, compact_tokenizer,
                                                     tools, executor):
    """Left padding and batching change nothing: each row's log-probs equal a solo forward."""
    chat = ChatFormat(compact_tokenizer, TEMPLATE_KWARGS, tool_calling_model.generation_config)
    cfg = RolloutConfig(max_turns=2, max_new_tokens=24, max_total_len=600, batch_size=6,
                        temperature=0.7)
    for trajectory in rollout(tool_calling_model, chat, executor, sampled_prompts(tools, 6), cfg):
        ids = torch.tensor([trajectory.input_ids])
        with torch.no_grad():
            logits = tool_calling_model(input_ids=ids).logits[0, :-1].float() / cfg.temperature
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        targets = torch.tensor(trajectory.assistant_mask[1:])
        torch.testing.assert_close(logprobs[targets], torch.tensor(trajectory.logprobs),
                                   atol=1e-4, rtol=1e-4)


def test_lockstep_sync_runs_dummy_forwards_until_every_rank_is_done(
        tool_calling_model, compact_tokenizer, tools, executor):
    """A rank with less work keeps calling forward while another rank still decodes."""
    chat = ChatFormat(compact_tokenizer, TEMPLATE_KWARGS, tool_calling_model.generation_config)
    cfg = RolloutConfig(max_turns=1, max_new_tokens=8, max_total_len=600)
    forwards = []
    hook = tool_calling_model.register_forward_hook(lambda *_: forwards.append(1))
    other_rank_steps = iter([True] * 30 + [False])
    try:
        rollout(tool_calling_model, chat, executor, sampled_prompts(tools, 1), cfg,
                sync=lambda has_work: next(other_rank_steps) or has_work)
    finally:
        hook.remove()
    assert len(forwards) == 30


def test_seed_compatible_collect_trajectory(tool_calling_model, compact_tokenizer, tools):
    trajectory = collect_trajectory(tool_calling_model, compact_tokenizer,
                                    [{"role": "user", "content": "What is 3 * 7?"}], tools,
                                    max_turns=2, max_new_tokens=32, max_total_len=600,
                                    enable_thinking=False)
    assert len(trajectory.input_ids) == len(trajectory.assistant_mask)
    assert trajectory.turns >= 1
    with pytest.raises(ValueError, match="must be positive"):
        collect_trajectory(tool_calling_model, compact_tokenizer, [], max_turns=0)
