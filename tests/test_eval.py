"""The eval harness: success needs a correct answer, valid tool calls and no truncation;
metrics aggregate as documented; the CLI writes eval.json and names user errors."""

from __future__ import annotations

import importlib.util
import json

import pytest
from scripted_model import ScriptedPolicy, call_text

from opd.chat import ChatFormat
from opd.config import RolloutConfig
from opd.eval import evaluate, greedy, improvement_line, main, summarize
from worlds.toolcalc.tasks import answer_text, check_answer, generate_tasks, task_record
from worlds.toolcalc.tokenizer import load_tokenizer

PREFIX = "<|im_start|>assistant\n"
WORLD = ("--tools", "worlds.toolcalc.tools:registry", "--checker", "worlds.toolcalc.tasks:check_answer")


@pytest.fixture(scope="module")
def chat():
    return ChatFormat(load_tokenizer())


@pytest.fixture(scope="module")
def tasks():
    return [next(t for t in generate_tasks(80, 7) if t.family == family)
            for family in ("arithmetic", "lookup", "two_hop", "direct")]


def run(chat, executor, tasks, scripts, **cfg):
    policy = ScriptedPolicy(chat.tokenizer, scripts, chat.tokenizer.eos_token_id, PREFIX)
    cfg = greedy(RolloutConfig(max_new_tokens=64, max_total_len=1024, batch_size=3, **cfg))
    return evaluate(policy, chat, executor, [task_record(t) for t in tasks], check_answer, cfg)


def test_a_student_writing_the_oracle_turns_succeeds_everywhere(chat, executor, tasks):
    scripts = {t.question: [*(call_text(s.name, s.arguments) for s in t.steps),
                            answer_text(t.answer)] for t in tasks}
    metrics = run(chat, executor, tasks, scripts)
    assert metrics["success_rate"] == metrics["answer_accuracy"] == 1.0
    assert metrics["tool_call_validity"] == 1.0 and metrics["truncation_rate"] == 0.0
    assert metrics["mean_turns"] == sum(len(t.steps) + 1 for t in tasks) / len(tasks)
    assert set(metrics["per_group"]) == {"arithmetic", "lookup", "two_hop", "direct"}
    assert all(group["success_rate"] == 1.0 for group in metrics["per_group"].values())
    assert [s["final_text"] for s in metrics["samples"]] == [answer_text(t.answer) for t in tasks]


def test_wrong_answers_invalid_calls_and_truncation_each_fail_a_task(chat, executor, tasks):
    arithmetic, lookup, two_hop, direct = tasks
    scripts = {
        # Right answer, but only after a call to a tool that does not exist.
        arithmetic.question: [call_text("abacus", {"x": 1}), answer_text(arithmetic.answer)],
        lookup.question: [call_text("lookup", lookup.steps[0].arguments), "The answer is 7."],
        # Still calling tools when max_turns (2) runs out.
        two_hop.question: [call_text(s.name, s.arguments) for s in two_hop.steps] + ["x"],
        direct.question: [answer_text(direct.answer)],
    }
    metrics = run(chat, executor, tasks, scripts, max_turns=2)
    groups = metrics["per_group"]
    assert groups["arithmetic"]["answer_accuracy"] == 1.0
    assert groups["arithmetic"]["success_rate"] == 0.0
    assert groups["lookup"]["answer_accuracy"] == groups["lookup"]["success_rate"] == 0.0
    assert groups["two_hop"]["truncation_rate"] == 1.0 and groups["two_hop"]["success_rate"] == 0
    assert groups["direct"]["success_rate"] == 1.0
    assert groups["direct"]["tool_call_validity"] is None
    assert metrics["success_rate"] == 0.25
    # Calls: abacus (invalid), lookup (valid), two_hop's first (valid) and unexecuted second.
    assert metrics["tool_call_validity"] == pytest.approx(3 / 4)


def test_summarize_aggregates_like_a_naive_reference():
    outcomes = [
        {"group": "a", "correct": True, "calls_ok": True, "truncated": False, "success": True,
         "valid_calls": 2, "all_calls": 2, "turns": 3, "tokens": 100, "generated_tokens": 30,
         "question": "q1", "final_text": "t1", "truncation_reason": None},
        {"group": "b", "correct": True, "calls_ok": False, "truncated": False, "success": False,
         "valid_calls": 0, "all_calls": 1, "turns": 2, "tokens": 80, "generated_tokens": 20,
         "question": "q2", "final_text": "t2", "truncation_reason": None},
        {"group": "b", "correct": False, "calls_ok": True, "truncated": True, "success": False,
         "valid_calls": 1, "all_calls": 1, "turns": 1, "tokens": 60, "generated_tokens": 64,
         "question": "q3", "final_text": "t3", "truncation_reason": "max_new_tokens"},
    ]
    metrics = summarize(outcomes)
    assert metrics["num_tasks"] == 3
    assert metrics["success_rate"] == pytest.approx(1 / 3)
    assert metrics["answer_accuracy"] == pytest.approx(2 / 3)
    assert metrics["tool_call_validity"] == pytest.approx(3 / 4)
    assert metrics["truncation_rate"] == pytest.approx(1 / 3)
    assert metrics["mean_turns"] == pytest.approx(2.0)
    assert metrics["mean_tokens"] == pytest.approx(80.0)
    assert metrics["mean_generated_tokens"] == pytest.approx(38.0)
    assert metrics["per_group"]["b"]["success_rate"] == 0.0
    assert metrics["per_group"]["a"]["num_tasks"] == 1
    assert [s["question"] for s in metrics["samples"]] == ["q1", "q2", "q3"]
    assert metrics["rejected_call_rate"] == pytest.approx(1 / 3)  # only q2 had a rejected call
    assert metrics["success_after_rejection"] == 0.0
    assert metrics["per_group"]["a"]["success_after_rejection"] is None


def test_the_improvement_line_counts_standard_errors_of_the_difference():
    before = {"success_rate": 0.5, "num_tasks": 400}
    after = {"success_rate": 0.6, "num_tasks": 400}
    # sqrt(.25/400 + .24/400) = 0.035: a +0.100 change is 2.9 standard errors.
    assert improvement_line(before, after) == \
        "after - before: +0.100 success on 400 held-out tasks (+2.9 standard errors)"
    assert "no spread" in improvement_line({"success_rate": 1.0, "num_tasks": 10},
                                           {"success_rate": 1.0, "num_tasks": 10})


def test_a_checkers_accuracy_is_reported_under_its_name_beside_success():
    """bfcl_accuracy is the checker's verdict alone (a refused call or a truncation does not
    fail an accepted task), averaged over the groups unweighted, as BFCL averages categories."""
    def outcome(group, correct, calls_ok=True, truncated=False):
        return {"group": group, "correct": correct, "calls_ok": calls_ok, "truncated": truncated,
                "success": correct and calls_ok and not truncated, "valid_calls": 1,
                "all_calls": 1, "turns": 1, "tokens": 1, "generated_tokens": 1, "question": "q",
                "final_text": "", "truncation_reason": None}

    outcomes = [outcome("a", True, calls_ok=False), outcome("a", True, truncated=True),
                outcome("a", False), outcome("b", True)]
    metrics = summarize(outcomes, "bfcl_accuracy")
    assert metrics["success_rate"] == 0.25
    assert metrics["bfcl_accuracy"] == pytest.approx((2 / 3 + 1) / 2)
    assert metrics["per_group"]["a"]["bfcl_accuracy"] == pytest.approx(2 / 3)
    assert "bfcl_accuracy" not in summarize(outcomes)
    if importlib.util.find_spec("bfcl_eval") is not None:
        from worlds.bfcl.checker import check
        assert check.accuracy_name == "bfcl_accuracy"  # what opd.eval passes to summarize


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from worlds.toolcalc.models import TEST_SHAPE, build_model, save_model

    tokenizer = load_tokenizer()
    return save_model(build_model(TEST_SHAPE, tokenizer, seed=0), tokenizer,
                      tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "heldout.jsonl"
    path.write_text("".join(json.dumps(task_record(t)) + "\n" for t in generate_tasks(5, 3)))
    return path


def test_cli_evaluates_a_saved_model_and_writes_eval_json(saved_model, data_file, tmp_path,
                                                          capsys):
    report = main(["--model", str(saved_model), "--data", str(data_file), *WORLD, "--out",
                   str(tmp_path), "--limit", "4", "--max-new-tokens", "6", "--batch-size", "2"])
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written == json.loads(json.dumps(report))
    assert written["metrics"]["num_tasks"] == 4
    assert written["rollout"]["top_k"] == 1 and written["rollout"]["max_new_tokens"] == 6
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["success_rate"] == written["metrics"]["success_rate"]


def test_cli_greedy_eval_does_not_depend_on_the_seed(saved_model, data_file, tmp_path):
    args = ["--model", str(saved_model), "--data", str(data_file), *WORLD, "--max-new-tokens", "6"]
    first = main([*args, "--seed", "1"])["metrics"]
    second = main([*args, "--seed", "2"])["metrics"]
    assert first == second


@pytest.mark.parametrize("change, message", [
    ({"--model": "/nonexistent/model"}, "--model: /nonexistent/model is not a directory."),
    ({"--checker": "worlds.toolcalc.tasks:nope"}, "eval.checker 'worlds.toolcalc.tasks:nope'"),
    ({"--max-turns": "0"}, "rollout.max_turns"),
])
def test_cli_user_errors_are_one_sentence(saved_model, data_file, change, message):
    args = {"--model": str(saved_model), "--data": str(data_file), "--tools": WORLD[1],
            "--checker": WORLD[3], **change}
    with pytest.raises(SystemExit) as exit_info:
        main([item for pair in args.items() for item in pair])
    assert message in str(exit_info.value) and "\n" not in str(exit_info.value)


def test_cli_names_the_bad_dataset_line(saved_model, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(task_record(generate_tasks(1, 0)[0])) + "\n{oops\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(saved_model), "--data", str(path), *WORLD])
    assert f"{path} line 2 is not valid JSON" in str(exit_info.value)
