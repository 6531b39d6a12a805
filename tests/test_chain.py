"""The chain world (worlds.toolcalc.chain): gold answers, the environment's rejections, the
teacher's recovery demonstrations through the real sandbox, weight-0 turns, and success that
forgives a recovered call."""

from __future__ import annotations

import json
import random
import re

import pytest

from opd.chat import ChatFormat
from opd.data import completion_trajectory
from opd.errors import DatasetError
from opd.eval import _outcome
from opd.tool_calls import ToolCall
from opd.tools import ToolExecutor
from opd.trajectory import AgentTrajectory
from worlds.toolcalc.chain import (
    CALLS,
    ChainEnvironment,
    chain_oracle_record,
    chain_record,
    check_chain_answer,
    generate_chain_tasks,
)
from worlds.toolcalc.tasks import check_answer
from worlds.toolcalc.tokenizer import TOKENIZER_DIR, load_tokenizer
from worlds.toolcalc.tools import LOOKUP_TABLE
from worlds.toolcalc.tools import registry as toolcalc_registry

ATTRIBUTES = {"height of": "height_m", "founding year of": "founded_year",
              "population of": "population"}


def naive_answer(question: str) -> int:
    """The gold answer recomputed from the question text alone."""
    sentences = re.findall(r"[^.?]+[.?]", question)
    start = re.fullmatch(r"Start from the (height of|founding year of|population of) (.+?)"
                         r"(?: in meters)?\.", sentences[0].strip())
    value = LOOKUP_TABLE[start.group(2)][ATTRIBUTES[start.group(1)]]
    for sentence in sentences[1:-1]:
        verb, rest = sentence.strip().rstrip(".").split(" ", 1)
        if verb == "Multiply":
            value *= int(rest.removeprefix("by "))
            continue
        if rest.isdigit():
            operand = int(rest)
        else:
            place = re.fullmatch(r"the (height of|founding year of) (.+?)(?: in meters)?", rest)
            operand = LOOKUP_TABLE[place.group(2)][ATTRIBUTES[place.group(1)]]
        value = value + operand if verb == "Add" else value - operand
    return value


def test_gold_answers_follow_from_the_question_and_every_horizon_occurs():
    tasks = generate_chain_tasks(300, seed=7)
    assert {task.calls for task in tasks} == set(CALLS)
    for task in tasks:
        assert len(task.steps) == task.calls and task.family == f"chain_{task.calls}"
        assert task.answer == naive_answer(task.question), task.question
    assert generate_chain_tasks(20, seed=7) == tasks[:20]


def test_environment_rejects_numbers_it_never_showed_and_names_the_nearest():
    environment = ChainEnvironment({"stated": [37, 3]})
    assert environment.call("lookup", {"entity": "Veltrane", "attribute": "height_m"}) \
        == {"result": 2984}
    with pytest.raises(ValueError, match=r"^unknown number 2948; did you mean 2984\?$"):
        environment.call("calculator", {"expression": "2948 + 37"})
    with pytest.raises(ValueError, match=r"^unknown number 38; did you mean 37\?$"):
        environment.call("calculator", {"expression": "2984 + 38"})
    assert environment.call("calculator", {"expression": "2984 + 37"}) == {"result": 3021}
    assert environment.call("calculator", {"expression": "3021 * 3"}) == {"result": 9063}
    with pytest.raises(ValueError, match=r"^unknown place Veltrene; did you mean Veltrane\?$"):
        environment.call("lookup", {"entity": "Veltrene", "attribute": "height_m"})
    with pytest.raises(ValueError, match="stated"):
        ChainEnvironment({})


def _calls(message: dict) -> list[ToolCall]:
    return [ToolCall(call["function"]["name"], call["function"]["arguments"])
            for call in message["tool_calls"]]


def test_confirm_runs_the_call_the_last_rejection_suggested_and_nothing_else():
    environment = ChainEnvironment({"stated": [37, 3], "confirm": True})
    with pytest.raises(ValueError, match="^nothing to confirm"):
        environment.call("confirm", {})
    environment.call("lookup", {"entity": "Veltrane", "attribute": "height_m"})
    with pytest.raises(ValueError, match=r"^unknown number 2948; did you mean 2984\? confirm "
                                         r"runs it$"):
        environment.call("calculator", {"expression": "2948 + 37"})
    assert environment.call("confirm", {}) == {"result": 3021}
    with pytest.raises(ValueError, match="^nothing to confirm"):  # it ran once; it is spent
        environment.call("confirm", {})
    with pytest.raises(ValueError, match="did you mean 3021"):  # 38 stays wrong after the fix
        environment.call("calculator", {"expression": "3012 + 38"})
    with pytest.raises(ValueError, match=r"^unknown number 38; did you mean 37\?"):
        environment.call("confirm", {})
    assert environment.call("confirm", {}) == {"result": 3058}
    with pytest.raises(ValueError, match="did you mean Veltrane"):
        environment.call("lookup", {"entity": "Veltrene", "attribute": "founded_year"})
    environment.call("calculator", {"expression": "3058 * 3"})  # another call drops the offer
    with pytest.raises(ValueError, match="^nothing to confirm"):
        environment.call("confirm", {})
    with pytest.raises(ValueError, match="did you mean Veltrane"):
        environment.call("lookup", {"entity": "Veltrene", "attribute": "founded_year"})
    assert environment.call("confirm", {}) == {"result": 1712}


def test_a_checked_episode_suggests_the_tasks_next_call_only_for_a_close_miss():
    task = next(t for t in generate_chain_tasks(50, seed=3)
                if t.steps[1].name == "calculator" and " * " not in t.steps[1].arguments["expression"])
    environment = ChainEnvironment(chain_record(task, confirm=True, checked=True)["environment"])
    first, second = task.steps[0], task.steps[1]
    assert environment.call(first.name, first.arguments) == json.loads(first.content)
    left, sign, right = second.arguments["expression"].split(" ")
    wrong_operation = f"{left} * {right}"  # every number known: only the plan rejects it
    expected = (f"^step 2 of the question is not {re.escape(wrong_operation)}; did you mean "
                f"{re.escape(second.arguments['expression'])}\\? confirm runs it$")
    with pytest.raises(ValueError, match=expected):
        environment.call("calculator", {"expression": wrong_operation})
    assert environment.call("confirm", {}) == json.loads(second.content)
    with pytest.raises(ValueError, match=r"^step 3 of the question is not 1 \+ 1$"):
        environment.call("calculator", {"expression": "1 + 1"})  # far off: nothing to confirm
    with pytest.raises(ValueError, match="^nothing to confirm"):
        environment.call("confirm", {})
    for step in task.steps[2:]:
        environment.call(step.name, step.arguments)
    with pytest.raises(ValueError, match="no more steps; give the answer"):
        environment.call(first.name, first.arguments)


def test_a_record_without_confirm_neither_offers_nor_runs_it():
    task = generate_chain_tasks(1, seed=2)[0]
    plain, confirming = chain_record(task), chain_record(task, confirm=True)
    assert [t["function"]["name"] for t in confirming["tools"]] \
        == [t["function"]["name"] for t in plain["tools"]] + ["confirm"]
    with ToolExecutor(toolcalc_registry(), environment=ChainEnvironment) as executor:
        [episode] = executor.open_episodes([plain["environment"]], [plain["tools"]])
        [result] = executor.run_episode_calls({episode: [ToolCall("confirm", {})]})[episode]
        assert result.status == "invalid" and "unknown tool 'confirm'" in result.content


@pytest.mark.parametrize("confirm, checked", [(False, False), (True, False), (True, True)])
def test_recovery_demonstrations_replay_byte_for_byte_in_the_sandbox(confirm, checked):
    """The teacher's demonstrations hold exactly what the sandboxed environment answers, slips
    and their rejections included, so it learns the rejections students will see; with confirm,
    its recoveries are mostly one confirm call."""
    rng = random.Random(3)
    records = [chain_oracle_record(task, rng, slip_rate=0.5, confirm=confirm, checked=checked)
               for task in generate_chain_tasks(6, seed=11)]
    assert any(m.get("weight") == 0 for record in records for m in record["messages"])
    confirms = sum(call["function"]["name"] == "confirm" for record in records
                   for m in record["messages"] for call in m.get("tool_calls", []))
    slips = sum(m.get("weight") == 0 for record in records for m in record["messages"])
    assert (confirms > slips / 2) if confirm else confirms == 0
    with ToolExecutor(toolcalc_registry(), environment=ChainEnvironment) as executor:
        episodes = executor.open_episodes([r["environment"] for r in records],
                                          [r["tools"] for r in records])
        for episode, record in zip(episodes, records):
            messages = record["messages"]
            for at, message in enumerate(messages):
                if message["role"] != "assistant" or "tool_calls" not in message:
                    continue
                [result] = executor.run_episode_calls({episode: _calls(message)})[episode]
                assert result.content == messages[at + 1]["content"]
                assert result.status == ("failed" if message.get("weight") == 0 else "ok")
            executor.close_episode(episode)
    assert all(check_chain_answer(r["messages"][-1]["content"], r) for r in records)


def test_weight_zero_turns_are_read_but_never_trained_on():
    record = chain_oracle_record(generate_chain_tasks(1, seed=5)[0], random.Random(0), 1.0)
    chat = ChatFormat(load_tokenizer(TOKENIZER_DIR))
    trajectory = completion_trajectory(chat, record["messages"], record["tools"])
    kinds = [kind for _, _, kind in trajectory.spans if kind.startswith("assistant")]
    weights = [m.get("weight", 1) for m in record["messages"] if m["role"] == "assistant"]
    assert kinds == ["assistant" if w else "assistant_context" for w in weights]
    assert "assistant_context" in kinds
    for start, end, kind in trajectory.spans:
        assert all(trajectory.assistant_mask[start:end]) == (kind == "assistant")
    slipped = [dict(m, weight=2) if m.get("weight") == 0 else m for m in record["messages"]]
    with pytest.raises(DatasetError, match="assistant message 1 has weight 2; use 0"):
        completion_trajectory(chat, slipped, record["tools"])


def test_success_forgives_a_recovered_call_only_where_the_checker_says_so():
    record = {"messages": [{"role": "user", "content": "q"}], "answer": 12}
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    trajectory = AgentTrajectory.from_prompt(tokenizer.encode("q"))
    trajectory.append(tokenizer.encode("The answer is 12."), "assistant")
    trajectory.counts.valid, trajectory.counts.failed = 3, 1
    assert _outcome(record, trajectory, tokenizer, check_chain_answer)["success"]
    assert not _outcome(record, trajectory, tokenizer, check_answer)["success"]
    trajectory.append(tokenizer.encode("The answer is 13."), "assistant")
    assert not _outcome(record, trajectory, tokenizer, check_chain_answer)["success"]


def test_chain_records_are_plain_dataset_lines():
    record = chain_oracle_record(generate_chain_tasks(1, seed=2)[0])
    assert json.loads(json.dumps(record)) == record
    assert record["family"].startswith("chain_") and "stated" in record["environment"]


class _Reader:
    """A stand-in language model whose greedy choice is the conversation's next token, except
    where told to pick another: the exactness probe's bookkeeping alone is under test."""

    def __init__(self, ids: list[int], wrong_at: set[int], vocab: int):
        self.ids, self.wrong_at, self.vocab = ids, wrong_at, vocab

    def eval(self):
        return self

    def __call__(self, input_ids_BT):
        import torch

        logits_TV = torch.zeros(len(self.ids), self.vocab)
        for position, token in enumerate(self.ids[1:]):
            logits_TV[position, (token + 1) % self.vocab if position in self.wrong_at
                      else token] = 1.0
        return type("Output", (), {"logits": logits_TV[None]})


def test_next_call_exactness_tells_recovery_turns_from_the_others():
    from worlds.toolcalc.prepare import next_call_exactness

    chat = ChatFormat(load_tokenizer(TOKENIZER_DIR))
    record = chain_oracle_record(generate_chain_tasks(1, seed=5)[0], random.Random(0), 1.0)
    trajectory = completion_trajectory(chat, record["messages"], record["tools"])
    vocab = len(chat.tokenizer)
    spans = trajectory.spans
    # An observation span sits between: the turn after a rejection is two spans on.
    recoveries = [spans[i] for i in range(2, len(spans))
                  if spans[i][2] == "assistant" and spans[i - 2][2] == "assistant_context"]
    assert len(recoveries) >= 2  # every call slipped: each correction follows a rejection
    exact = next_call_exactness(_Reader(trajectory.input_ids, set(), vocab), [trajectory])
    assert exact == {"after_rejection": 1.0, "elsewhere": 1.0}
    start, end, _ = recoveries[0]
    one_token_off = _Reader(trajectory.input_ids, {end - 2}, vocab)
    exact = next_call_exactness(one_token_off, [trajectory])
    assert exact["elsewhere"] == 1.0
    assert exact["after_rejection"] == pytest.approx(1 - 1 / len(recoveries), abs=1e-3)


@pytest.mark.parametrize("confirm, checked, prior", [(False, False, 0), (True, False, 0),
                                                     (True, True, 8)])
def test_chain_prepare_trains_the_teacher_on_recoveries_the_distiller_never_gets(
        tmp_path, confirm, checked, prior):
    """And, with a student recovery prior, the student on a few recoveries of its own tasks."""
    from dataclasses import replace

    from opd.data import load_jsonl
    from worlds.toolcalc.prepare import TEST_CONFIG, prepare

    cfg = replace(TEST_CONFIG, world="chain", max_turns=4, teacher_recovery_steps=2,
                  confirm=confirm, checked=checked, student_recovery_demos=prior,
                  student_recovery_steps=2 if prior else 0)
    prepared = prepare(cfg, tmp_path)
    report = prepared.report
    assert report["teacher"]["steps"] == cfg.teacher_steps + cfg.teacher_recovery_steps
    assert report["student"]["steps"] == cfg.student_steps + cfg.student_recovery_steps
    assert prepared.student_recovery_data.exists() == bool(prior)
    if prior:
        own = load_jsonl(prepared.student_recovery_data)
        assert len(own) == prior and any(m.get("weight") == 0 for r in own
                                         for m in r["messages"])
        assert not {r["messages"][0]["content"] for r in load_jsonl(prepared.heldout_data)} & \
            {r["messages"][0]["content"] for r in own}
    for role in ("teacher", "student"):
        assert set(report[role]["next_call_exact"]) == {"after_rejection", "elsewhere"}
    recovery = load_jsonl(prepared.teacher_recovery_data)
    clean = load_jsonl(prepared.teacher_train_data)
    assert [r["messages"][0] for r in recovery] == [r["messages"][0] for r in clean]
    assert any(m.get("weight") == 0 for r in recovery for m in r["messages"])
    for data in (prepared.train_data, prepared.prompts_data, prepared.heldout_data):
        assert not any(m.get("weight") == 0 for r in load_jsonl(data) for m in r["messages"])
    held = {r["messages"][0]["content"] for r in load_jsonl(prepared.heldout_data)}
    assert not held & {r["messages"][0]["content"] for r in clean}

    def confirms(path) -> int:
        return sum(call["function"]["name"] == "confirm" for r in load_jsonl(path)
                   for m in r["messages"] for call in m.get("tool_calls", []))

    assert (confirms(prepared.teacher_recovery_data) > 0) == confirm
    assert confirms(prepared.train_data) == confirms(prepared.teacher_train_data) == 0
    for data in (prepared.train_data, prepared.prompts_data, prepared.heldout_data):
        assert all(r["environment"].get("confirm", False) == confirm
                   and ("confirm" in json.dumps(r["tools"])) == confirm
                   and ("plan" in r["environment"]) == checked for r in load_jsonl(data))


def test_takeover_probe_resumes_the_students_own_state_and_scores_who_recovers():
    """bench/chain_takeover.py: the student's first refused call ends its part; student and
    teacher each go on from exactly that state (its tokens; the environment replayed, so the
    result the student already got is known). A teacher that writes the corrected call
    recovers, a student that repeats its slip runs out of turns."""
    import importlib.util
    from pathlib import Path

    import torch
    from scripted_model import ScriptedPolicy, call_text

    from worlds.toolcalc.chain import _slip
    from worlds.toolcalc.tasks import answer_text

    path = Path(__file__).resolve().parents[1] / "bench" / "chain_takeover.py"
    spec = importlib.util.spec_from_file_location("chain_takeover", path)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)

    slipping, clean = [task for task in generate_chain_tasks(60, seed=11)
                       if task.calls == 3 and task.steps[1].name == "calculator"][:2]
    first, second, third = slipping.steps
    slipped = call_text("calculator", _slip(second, random.Random(0)))
    oracle = {task.question: [*(call_text(s.name, s.arguments) for s in task.steps),
                              answer_text(task.answer)] for task in (slipping, clean)}
    student_turns = dict(oracle, **{slipping.question: [
        call_text(first.name, first.arguments), *[slipped] * probe.MAX_TURNS]})
    teacher_turns = dict(oracle, **{slipping.question: [
        call_text(first.name, first.arguments), slipped, call_text(second.name, second.arguments),
        call_text(third.name, third.arguments), answer_text(slipping.answer)]})
    chat = ChatFormat(load_tokenizer(TOKENIZER_DIR))
    eos, prefix = chat.tokenizer.eos_token_id, "<|im_start|>assistant\n"
    student = ScriptedPolicy(chat.tokenizer, student_turns, eos, prefix)
    teacher = ScriptedPolicy(chat.tokenizer, teacher_turns, eos, prefix)
    records = [chain_record(slipping), chain_record(clean)]
    with ToolExecutor(toolcalc_registry(), environment=ChainEnvironment) as executor:
        player = probe.Player(chat, executor, torch.Generator().manual_seed(0))
        result = probe.takeover(player, student, teacher, records, sample=True)
        # Without the replay, the corrected call names a result the new episode never returned.
        bare = player.open(records[0], [])
        [refused] = executor.run_episode_calls(
            {bare: [ToolCall(second.name, second.arguments)]})[bare]
        executor.close_episode(bare)
    assert refused.status == "failed" and "unknown number" in refused.content
    assert result == {"success_without_refusal": 0.5, "refused_rate": 0.5,
                      "first_refusal": {"unknown number": 1},
                      "success_after_first_refusal": {"student": 0.0, "teacher_greedy": 1.0,
                                                      "teacher_sampled": 1.0},
                      # turns 3 .. 11 refused; the 12th ends the episode unrun, as in rollout
                      "refused_calls_after_takeover": {"student": probe.MAX_TURNS - 3,
                                                       "teacher_greedy": 0, "teacher_sampled": 0}}


def test_the_rollout_marks_each_refusal_and_masking_keeps_log_probs_aligned():
    """loss.mask_after_refusals: after N refused calls the student's tokens stop being targets
    (2 keeps the turn after the first refusal, its recovery), those before stay, and the
    sampler's log-probs keep one per target."""
    from scripted_model import ScriptedPolicy, call_text

    from opd.config import RolloutConfig
    from opd.rollout import rollout
    from worlds.toolcalc.chain import _slip
    from worlds.toolcalc.tasks import answer_text

    task = next(task for task in generate_chain_tasks(60, seed=11)
                if task.calls == 3 and task.steps[1].name == "calculator")
    first, second, third = task.steps
    slipped = call_text("calculator", _slip(second, random.Random(0)))
    turns = [call_text(first.name, first.arguments), slipped, slipped,
             call_text(second.name, second.arguments), call_text(third.name, third.arguments),
             answer_text(task.answer)]
    chat = ChatFormat(load_tokenizer(TOKENIZER_DIR))
    policy = ScriptedPolicy(chat.tokenizer, {task.question: turns}, chat.tokenizer.eos_token_id,
                            "<|im_start|>assistant\n")
    with ToolExecutor(toolcalc_registry(), environment=ChainEnvironment) as executor:
        [trajectory] = rollout(policy, chat, executor, [chain_record(task)],
                               RolloutConfig(max_turns=7, max_new_tokens=64, max_total_len=768))
    observations = [(start, end) for start, end, kind in trajectory.spans if kind == "observation"]
    refusals = observations[1:3]
    assert all('"error"' in chat.tokenizer.decode(trajectory.input_ids[slice(*r)])
               for r in refusals)
    assert '"error"' not in chat.tokenizer.decode(trajectory.input_ids[slice(*observations[0])])
    assert trajectory.refusal_ends == [end for _, end in refusals]
    assert len(trajectory.logprobs) == sum(trajectory.assistant_mask)
    spans = trajectory.assistant_spans()
    second_slip, recovered = spans[2], spans[3]  # the slip repeated, then the corrected call
    mask, logprobs = list(trajectory.assistant_mask), list(trajectory.logprobs)

    trajectory.mask_after_refusals(3)  # only two refusals: nothing changes
    trajectory.mask_after_refusals(0)
    assert trajectory.assistant_mask == mask
    trajectory.mask_after_refusals(2)
    kept = sum(mask[:refusals[1][1]])
    assert all(trajectory.assistant_mask[second_slip[0]:second_slip[1]])
    assert not any(trajectory.assistant_mask[recovered[0]:])
    assert trajectory.logprobs == logprobs[:kept]
    trajectory.mask_after_refusals(1)
    trajectory.mask_after_refusals(1)  # idempotent
    before = mask[:refusals[0][1]]
    assert trajectory.assistant_mask[:refusals[0][1]] == before and any(before)
    assert not any(trajectory.assistant_mask[second_slip[0]:])
    assert trajectory.logprobs == logprobs[:sum(before)]
