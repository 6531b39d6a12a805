"""The pipeline on the real Qwen3 tokenizer and template, with tiny random Qwen3 models.

Thinking on and off (`chat_template_kwargs: {enable_thinking: ...}`): boundary rendering equals
the template token for token, the rollout's target mask covers exactly the assistant's tokens,
the Hermes parser reads Qwen3's calls (and not the ones a thought mentions), packed equals
unpacked logits, and the eval harness scores Qwen3 conversations.
"""

from __future__ import annotations

import json

import pytest
import torch
from scripted_model import ScriptedPolicy

from opd.chat import ChatFormat
from opd.eval import evaluate, greedy
from opd.packing import pack_varlen
from opd.rollout import RolloutConfig, rollout
from opd.tool_calls import parse_hermes_tool_calls

EMPTY_THINK = "<think>\n\n</think>\n\n"
ASSISTANT = "<|im_start|>assistant\n"


def call(expression: str) -> str:
    arguments = json.dumps({"expression": expression})
    return f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call>'


def thought(text: str) -> str:
    return f"<think>\n{text}\n</think>\n\n"


def turns(thinking: bool) -> list[str]:
    """Two calculator hops and an answer; thoughts mention <tool_call> without making a call."""
    if not thinking:
        return [call("12 * 7"), call("84 + 1"), "The answer is 85."]
    return [thought("I should write <tool_call> for 12 * 7.") + call("12 * 7"),
            thought("Now add one; another <tool_call>.") + call("84 + 1"),
            thought("The answer is 84 + 1.") + "The answer is 85."]


SCRIPTS = {True: {"Q-two-hops": turns(True), "Q-direct": ["The answer is 4."],
                  "Q-unclosed-thought": ["<think>\nmaybe <tool_call>{\"name\": \"calculator\""]},
           False: {"Q-two-hops": turns(False), "Q-direct": ["The answer is 4."]}}


@pytest.fixture(scope="module")
def scripted(real_qwen3_tokenizer, tools, executor) -> dict:
    """{thinking: (chat, trajectories of SCRIPTS[thinking])}, rolled out once for the module."""
    return {thinking: scripted_rollout(real_qwen3_tokenizer, thinking, tools, executor,
                                       SCRIPTS[thinking]) for thinking in (True, False)}


def chat_for(tokenizer, thinking: bool) -> ChatFormat:
    return ChatFormat(tokenizer, {"enable_thinking": thinking})


def scripted_rollout(tokenizer, thinking, tools, executor, scripts, **cfg):
    chat = chat_for(tokenizer, thinking)
    policy = ScriptedPolicy(tokenizer, scripts, tokenizer.eos_token_id,
                            ASSISTANT if thinking else ASSISTANT + EMPTY_THINK)
    cfg = RolloutConfig(**{"max_turns": 3, "max_new_tokens": 96, "max_total_len": 4096, **cfg})
    prompts = [{"messages": [{"role": "user", "content": key}], "tools": tools} for key in scripts]
    return chat, rollout(policy, chat, executor, prompts, cfg)


@pytest.mark.parametrize("thinking", [True, False])
def test_appended_conversation_is_the_template_token_for_token(real_qwen3_tokenizer, tools,
                                                               thinking):
    tokenizer = real_qwen3_tokenizer
    chat = chat_for(tokenizer, thinking)
    user = [{"role": "user", "content": "What is 12 * 7 + 1?"}]
    first, second, answer = turns(thinking)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    appended = chat.prompt_ids(user, tools)
    for turn, result in ((first, '{"result": 84}'), (second, '{"result": 85}')):
        appended += chat.encode(turn) + [end]
        appended += chat.observation_ids([result], tools, end)
    appended += chat.encode(answer) + [end]

    def assistant(turn: str) -> dict:
        reasoning, _, rest = turn.rpartition("</think>\n\n")
        message = {"role": "assistant", "content": reasoning + "</think>\n\n" if reasoning else ""}
        calls = parse_hermes_tool_calls(rest)
        if calls:
            message["tool_calls"] = [{"type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in calls]
        else:
            message["content"] += rest
        return message

    messages = user + [assistant(first), {"role": "tool", "content": '{"result": 84}'},
                       assistant(second), {"role": "tool", "content": '{"result": 85}'},
                       assistant(answer)]
    rendered = chat.render(messages, tools, add_generation_prompt=False)
    if not thinking:
        # Qwen3's template drops empty think blocks from earlier turns when it re-renders
        # history; the student saw (and wrote after) them, and appending never re-renders.
        rendered = rendered.replace(ASSISTANT + "<tool_call>", ASSISTANT + EMPTY_THINK + "<tool_call>")
    # The student stops at <|im_end|>; the template then writes "\n" before the next turn.
    assert appended + chat.encode("\n") == chat.encode(rendered)
    assert tokenizer.decode(appended).count("<tool_response>") == 2


@pytest.mark.parametrize("thinking", [True, False])
def test_rollout_masks_exactly_the_assistant_tokens(real_qwen3_tokenizer, tools, scripted,
                                                    thinking):
    tokenizer = real_qwen3_tokenizer
    chat, (two_hops, direct, *unclosed) = scripted[thinking]
    stop = tokenizer.eos_token_id
    prompt = chat.prompt_ids([{"role": "user", "content": "Q-two-hops"}], tools)
    parts, mask = [prompt], [False] * len(prompt)
    for i, turn in enumerate(turns(thinking)):
        ids = chat.encode(turn) + [stop]
        parts.append(ids)
        mask += [True] * len(ids)
        if i < 2:
            observation = chat.observation_ids([f'{{"result": {84 + i}}}'], tools, stop)
            parts.append(observation)
            mask += [False] * len(observation)
    assert two_hops.input_ids == [t for part in parts for t in part]
    assert two_hops.assistant_mask == mask
    assert len(two_hops.logprobs) == sum(mask)
    # Both calls parsed and run; the thoughts' <tool_call> mentions were not calls.
    assert (two_hops.counts.valid, two_hops.counts.invalid, two_hops.tool_calls) == (2, 0, 2)
    assert (two_hops.turns, two_hops.truncated) == (3, False)
    assert (direct.turns, direct.tool_calls, direct.truncated) == (1, 0, False)
    for trajectory in unclosed:  # a call inside an unclosed thought is not a call
        assert (trajectory.turns, trajectory.tool_calls, trajectory.truncated) == (1, 0, False)


def test_sampling_a_tiny_qwen3_keeps_ids_and_masks_aligned(real_qwen3_tokenizer, tiny_qwen3_dir,
                                                           tools, executor):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    chat = ChatFormat(real_qwen3_tokenizer, {"enable_thinking": False}, model.generation_config)
    prompts = [{"messages": [{"role": "user", "content": q}], "tools": tools}
               for q in ("What is 12 * 7?", "Convert 3 km to m.")]
    cfg = RolloutConfig(max_turns=2, max_new_tokens=6, max_total_len=2048, batch_size=2)
    for trajectory in rollout(model, chat, executor, prompts, cfg, seed=3):
        prompt = chat.prompt_ids(prompts[0 if "12" in chat.tokenizer.decode(
            trajectory.input_ids) else 1]["messages"], tools)
        assert trajectory.input_ids[:len(prompt)] == prompt
        assert trajectory.assistant_mask == [False] * len(prompt) + [True] * 6
        assert len(trajectory.logprobs) == 6 and trajectory.truncation_reason == "max_new_tokens"


def test_packed_qwen3_forward_equals_unpacked(tiny_qwen3_dir, scripted):
    from transformers import AutoModelForCausalLM

    trajectories = [t for _, rolled in scripted.values() for t in rolled]
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    (batch,) = pack_varlen(trajectories, max_tokens=8192)
    targets = batch.target_mask[0]
    assert batch.input_ids[0, 1:][targets[:-1]].tolist() == [
        t for i in batch.trajectory_index
        for t, m in zip(trajectories[i].input_ids, trajectories[i].assistant_mask) if m]
    with torch.no_grad():
        # Logits are a per-token map of the decoder's output: compare that everywhere, and the
        # logits where the loss reads them (all 151,936 columns over every token would be slow).
        packed = model.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                             use_cache=False).last_hidden_state[0]
        starts = batch.cu_seqlens[:-1].tolist()
        for (index, hidden), start in zip(batch.unpack(packed).items(), starts):
            ids = torch.tensor([trajectories[index].input_ids])
            alone = model.model(input_ids=ids).last_hidden_state[0]
            torch.testing.assert_close(hidden, alone, atol=1e-5, rtol=1e-5)
            mask = targets[start:start + len(alone)]
            torch.testing.assert_close(model.lm_head(hidden[mask]), model.lm_head(alone[mask]),
                                       atol=1e-5, rtol=1e-5)


# Sampling over 151,669 columns costs ~50 ms a token on a busy CPU; the rollout test covers
# thinking off already.
@pytest.mark.parametrize("thinking", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_eval_scores_qwen3_conversations(real_qwen3_tokenizer, tools, executor, thinking):
    from worlds.toolcalc.tasks import answer_text, check_answer, generate_tasks, task_record

    tasks = [next(t for t in generate_tasks(80, 7) if t.family == "two_hop")]

    def oracle(task) -> list[str]:
        steps = [f"<tool_call>\n{json.dumps({'name': s.name, 'arguments': s.arguments})}"
                 "\n</tool_call>" for s in task.steps]
        if thinking:
            steps = [thought("A <tool_call> is needed.") + s for s in steps]
            return steps + [thought("Done; the answer is 0?") + answer_text(task.answer)]
        return steps + [answer_text(task.answer)]

    chat = chat_for(real_qwen3_tokenizer, thinking)
    policy = ScriptedPolicy(real_qwen3_tokenizer, {t.question: oracle(t) for t in tasks},
                            real_qwen3_tokenizer.eos_token_id,
                            ASSISTANT if thinking else ASSISTANT + EMPTY_THINK)
    cfg = greedy(RolloutConfig(max_new_tokens=96, max_total_len=4096, batch_size=1))
    metrics = evaluate(policy, chat, executor, [task_record(t) for t in tasks], check_answer, cfg)
    assert metrics["success_rate"] == 1.0 and metrics["tool_call_validity"] == 1.0
    assert metrics["truncation_rate"] == 0.0
