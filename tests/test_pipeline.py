"""The composition root: every mistake that can be known before an engine starts is one
sentence then (plugins, bounds, renamed keys, tokenizers, prompts over the budget), the command
line evaluates as the trainer does, and a non-finite step never reaches the optimizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_scripts.world import build_world

from opd.config import ModelConfig, load_config
from opd.eval import final_text, strip_thinking
from opd.trajectory import AgentTrajectory

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("world")
    build_world(root)
    return root


def train(world_dir: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python launch/train.py` on the tiny world, one process."""
    return subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "--recipe",
                           str(world_dir / "recipe.yaml"), "cluster.device=cpu",
                           "cluster.dist_backend=gloo", "cluster.threads_per_rank=1",
                           *overrides], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def one_sentence(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ")
    return line


@pytest.mark.parametrize("override, message", [
    ("prepare=nope:x", "prepare 'nope:x': there is no module 'nope'."),
    ("tools.registry=worlds.toolcalc.tools:nothing",
     "tools.registry 'worlds.toolcalc.tools:nothing': module 'worlds.toolcalc.tools' has no "
     "attribute 'nothing'."),
    ("tools.parser=yaml", "tools.parser 'yaml' is not a registered tool-call parser"),
    ("eval.checker=worlds.toolcalc.tasks", "eval.checker 'worlds.toolcalc.tasks' must look like "
                                           "module:attribute"),
    ("tools.max_result_chars=32", "tools.max_result_chars must be at least 64"),
    ("tools.memory_limit_mb=0", "tools.memory_limit_mb must be at least 32"),
    ("loss.gkd_lambda=0.9", "loss.gkd_lambda was renamed loss.off_policy_fraction"),
    ("loss.mask_after_refused_call=true", "loss.mask_after_refused_call was replaced by "
                                          "loss.mask_after_refusals, a count: true is 1"),
    ("loss.mask_after_refusals=-1", "loss.mask_after_refusals must be at least 0"),
    ("eval.baseline=sft", "eval.baseline=sft trains a control arm on "
                          "data.completions and evaluates it beside the trained student on "
                          "data.eval, so eval.after must be set (or eval.baseline=none)."),
])
def test_plugins_and_bounds_fail_in_one_sentence_before_any_engine(world_dir, override,
                                                                   message):
    result = train(world_dir, override, "logging.run_dir=" + str(world_dir / "never"))
    assert message in one_sentence(result)
    assert not (world_dir / "never").exists()  # nothing started


@pytest.mark.parametrize("overrides, message", [
    (["student.deepspeed_config={tmp}/missing.json"],
     "student.deepspeed_config: DeepSpeed config {tmp}/missing.json does not exist."),
    (["teacher.deepspeed_config={tmp}/broken.json"], "{tmp}/broken.json line 2 is not valid JSON"),
    (["teacher.engine=tensor_parallel", "teacher.tp_size=3"],
     "teacher.tp_size=3 must divide the world size 1."),
    (["rollout.engine=sglang"], "rollout.engine must be one of hf, vllm"),
])
def test_engine_checks_refuse_before_any_evaluation(world_dir, tmp_path, overrides, message):
    (tmp_path / "broken.json").write_text('{\n  "zero_optimization": {,\n}')
    result = train(world_dir, *(o.format(tmp=tmp_path) for o in overrides),
                   "eval.before=true", "eval.teacher=true", "logging.progress=true",
                   "logging.run_dir=" + str(tmp_path / "run"))
    assert message.format(tmp=tmp_path) in one_sentence(result)
    assert "eval model." not in result.stderr  # refused before the teacher's evaluation began
    assert not (tmp_path / "run" / "eval.json").exists()


def test_a_prompt_over_the_budget_names_file_and_line_before_any_engine(world_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = (world_dir / "prompts.jsonl").read_text().splitlines()
    long = json.loads(lines[0])
    long["messages"][-1]["content"] += " and then" * 200
    prompts.write_text("\n".join([lines[0], json.dumps(long), *lines[1:]]) + "\n")
    result = train(world_dir, f"data.prompts={prompts}", f"logging.run_dir={tmp_path / 'run'}")
    line = one_sentence(result)
    assert f"{prompts} line 2 (data.prompts): the prompt is" in line
    assert "rollout.max_total_len=256" in line
    assert not (tmp_path / "run").exists()


def test_a_completion_over_the_micro_batch_names_file_and_line(world_dir, tmp_path):
    completions = tmp_path / "completions.jsonl"
    lines = (world_dir / "completions.jsonl").read_text().splitlines()
    long = json.loads(lines[2])
    long["messages"][-1]["content"] += " and then" * 300
    completions.write_text("\n".join([*lines[:2], json.dumps(long), *lines[3:]]) + "\n")
    result = train(world_dir, f"data.completions={completions}", "loss.off_policy_fraction=0.5",
                   f"logging.run_dir={tmp_path / 'run'}")
    assert f"{completions} line 3 (data.completions): the conversation is" in \
        one_sentence(result)


def test_overriding_the_models_drops_the_recipes_tokenizer(world_dir, tmp_path):
    recipe = world_dir / "recipe.yaml"
    config = load_config(recipe, None, [f"model.student={tmp_path}/s", f"model.teacher={tmp_path}/t"])
    assert config.model.tokenizer == "" and config.tokenizer_path == f"{tmp_path}/s"
    kept = load_config(recipe, None, [f"model.student={tmp_path}/s",
                                      f"model.tokenizer={tmp_path}/tok"])
    assert kept.model.tokenizer == f"{tmp_path}/tok"
    assert load_config(recipe).model.tokenizer == str(world_dir / "tokenizer")


def test_a_teacher_without_tokenizer_files_trains_on_the_students_tokenizer(world_dir, tmp_path):
    """The issue's defect: an overridden pair kept the recipe's tokenizer and exported it."""
    from transformers import AutoTokenizer

    from opd.inputs import check_vocabulary

    tokenizer = AutoTokenizer.from_pretrained(world_dir / "student")
    config = load_config(world_dir / "recipe.yaml", None,
                         [f"model.student={world_dir / 'student'}",
                          f"model.teacher={world_dir / 'teacher'}"])
    assert config.tokenizer_path == str(world_dir / "student")
    assert check_vocabulary(config.model, tokenizer) == len(tokenizer)
    with pytest.raises(Exception, match="model.student: the vocabulary of .* fewer than"):
        check_vocabulary(ModelConfig(student=str(world_dir / "student"),
                                     teacher=str(world_dir / "teacher")),
                         _bigger_tokenizer(tokenizer, tmp_path))


def _bigger_tokenizer(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path / "big")
    big = AutoTokenizer.from_pretrained(tmp_path / "big")
    big.add_tokens([f"<extra_{i}>" for i in range(5000)])
    return big


def test_the_checker_sees_the_answer_without_the_thinking():
    assert strip_thinking("<think>maybe 41</think>\n\nThe answer is 42.") == "The answer is 42."
    assert strip_thinking("<think>still thinking, 41") == ""
    assert strip_thinking("The answer is 42.") == "The answer is 42."

    class Decoder:
        def decode(self, ids, skip_special_tokens):
            return "<think>41?</think>The answer is 42."

    trajectory = AgentTrajectory(input_ids=[1, 2, 3], assistant_mask=[False, True, True],
                                 turns=1, tool_calls=0, truncated=False,
                                 spans=[(0, 1, "prompt"), (1, 3, "assistant")])
    assert final_text(trajectory, Decoder()) == "The answer is 42."


def test_command_line_eval_passes_template_arguments(tmp_path, qwen3_tokenizer):
    """Qwen3 from the command line: enable_thinking=false renders the empty think block into
    the prompt, as the trainer's eval does with the recipe's chat_template_kwargs."""
    from conftest import build_tiny_model

    from opd.eval import main
    from worlds.toolcalc.tasks import generate_tasks, task_record

    build_tiny_model(qwen3_tokenizer, tmp_path / "model")
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps(task_record(t)) + "\n" for t in generate_tasks(2, 1)))
    args = ["--model", str(tmp_path / "model"), "--data", str(data), "--tools",
            "worlds.toolcalc.tools:registry", "--checker", "worlds.toolcalc.tasks:check_answer",
            "--max-new-tokens", "1", "--max-turns", "1", "--max-total-len", "4096"]
    thinking = main(args)["metrics"]["mean_tokens"]
    plain = main([*args, "--chat-template-kwargs", '{"enable_thinking": false}'])
    think_block = len(qwen3_tokenizer.encode("<think>\n\n</think>\n\n"))
    assert plain["metrics"]["mean_tokens"] == thinking + think_block


@pytest.mark.parametrize("backend, teacher", [("deepspeed", "zero_inference"),
                                              ("fsdp", "replicated")])
def test_a_nan_teacher_never_reaches_the_optimizer_or_a_checkpoint(world_dir, tmp_path,
                                                                    backend, teacher):
    from transformers import AutoModelForCausalLM

    poisoned = tmp_path / "teacher"
    model = AutoModelForCausalLM.from_pretrained(world_dir / "teacher")
    with torch.no_grad():
        model.get_output_embeddings().weight[5, 3] = float("nan")
    model.save_pretrained(poisoned)
    run_dir = tmp_path / "run"
    common = [f"model.teacher={poisoned}", f"student.backend={backend}",
              f"teacher.engine={teacher}", f"logging.run_dir={run_dir}", "eval.every=0"]

    stopped = train(world_dir, *common, "train.nonfinite=stop")
    assert "step 1: loss nan" in one_sentence(stopped)
    assert "train.nonfinite=stop" in stopped.stderr
    assert not list(run_dir.glob("checkpoints/step-*")) and not (run_dir / "final").exists()

    skipped = train(world_dir, *common, "train.steps=3", "train.max_nonfinite_steps=10",
                    "checkpoint.resume=never")
    assert "no step of this run was finite" in one_sentence(skipped)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [True, True]
    assert records[-1]["nonfinite_steps"] == 2
    assert not (run_dir / "final").exists()


def test_a_served_teacher_is_not_loaded_for_its_eval_row(world_dir, tmp_path):
    """eval.teacher with teacher.engine=served: one sentence instead of loading the teacher on
    rank 0 (here a directory with its config.json alone, as a teacher too large to load would
    be). The student's row is evaluated; then the step waits for a server that never comes up."""
    import shutil

    from conftest import free_port

    teacher = tmp_path / "teacher"
    teacher.mkdir()
    shutil.copy(world_dir / "teacher" / "config.json", teacher / "config.json")
    url = f"http://127.0.0.1:{free_port()}"
    result = train(world_dir, "teacher.engine=served", f"teacher.urls=[{url}]",
                   "teacher.startup_timeout_s=1", "loss.direction=sampled_reverse_kl",
                   "eval.before=true", "eval.teacher=true", f"model.teacher={teacher}",
                   f"model.tokenizer={world_dir / 'tokenizer'}",
                   f"logging.run_dir={tmp_path / 'run'}")
    assert "eval: no teacher row: teacher.engine=served keeps the teacher on its servers" \
        in result.stderr
    assert f"teacher.urls: {url} did not answer GET /health" in one_sentence(result)


@pytest.mark.parametrize("kind, direction", [("sft", "sft"), ("kd", "forward_kl")])
def test_the_baseline_arm_is_the_same_run_on_the_completions_alone(world_dir, kind, direction):
    """eval.baseline's control arm keeps the warm student, steps, optimizer, batch and seed, and
    trains only on data.completions, in its own directory, never resuming from the run's path."""
    from opd.pipeline import baseline_config

    config = load_config(world_dir / "recipe.yaml", overrides=[
        f"eval.baseline={kind}", "eval.after=true", "eval.every=2", "loss.direction=reverse_kl",
        f"checkpoint.resume={world_dir / 'run' / 'checkpoints' / 'step-2'}"])
    control = baseline_config(config)
    assert (control.loss.direction, control.loss.off_policy_fraction) == (direction, 1.0)
    assert control.loss.needs_teacher == (kind == "kd")
    assert control.run_dir == config.run_dir / f"baseline_{kind}"
    assert control.checkpoint.resume == "auto" and control.eval.every == 0
    assert (control.model, control.data, control.optim, control.train, control.seed) == \
        (config.model, config.data, config.optim, config.train, config.seed)
