"""The trainer: schedule, data order, checkpoints; real DeepSpeed ZeRO-3 and FSDP2 on 2 gloo ranks.

The 2-rank tests launch `tests/dist_scripts/check_step.py` or `launch/train.py` with torchrun or
the deepspeed launcher, on a tiny toolcalc world (tests/dist_scripts/world.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from opd import checkpoint
from opd.config import load_config
from opd.dist import World
from opd.metrics import read_metrics
from opd.steps import learning_rate, off_policy, step_records
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
from dist_scripts.world import build_world  # noqa: E402

TIMEOUT_S = 600


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("world")
    build_world(root)
    return root


def config_with(world_dir: Path, *overrides: str):
    return load_config(world_dir / "recipe.yaml", None, list(overrides))


# ---------------------------------------------------------------- single process, no engines

def test_learning_rate_warms_up_then_decays_to_the_floor(world_dir):
    config = config_with(world_dir, "optim.lr=1.0", "optim.warmup_steps=4", "train.steps=20",
                         "optim.min_lr_ratio=0.1")
    lrs = [learning_rate(step, config.optim, config.train.steps) for step in range(1, 21)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))  # monotone decay after warmup
    assert lrs[-1] == pytest.approx(0.1)
    middle = 4 + 8  # half way through the decay: cosine is at the mean of peak and floor
    assert lrs[middle - 1] == pytest.approx(0.55)
    linear = replace(config, optim=replace(config.optim, schedule="linear"))
    assert learning_rate(12, linear.optim, 20) == pytest.approx(0.1 + 0.9 * 0.5)
    constant = replace(config, optim=replace(config.optim, schedule="constant"))
    assert learning_rate(20, constant.optim, 20) == 1.0


def test_prompts_are_dealt_to_ranks_without_overlap_in_a_seeded_epoch_order(world_dir):
    config = config_with(world_dir, "train.prompts_per_step=5")
    records = [{"id": i} for i in range(10)]
    worlds = [World(rank, 2, rank, 2, None) for rank in range(2)]

    def dealt(step, cfg=config):
        shares = [[r["id"] for r in step_records(records, step, cfg, w.rank, w.world_size, {})]
                  for w in worlds]
        assert [len(s) for s in shares] == [3, 2]  # round-robin: rank 0 gets the odd one
        assert not set(shares[0]) & set(shares[1])
        return shares[0] + shares[1]

    first_epoch, second_epoch = dealt(1) + dealt(2), dealt(3) + dealt(4)
    assert sorted(first_epoch) == sorted(second_epoch) == list(range(10))  # each prompt once
    assert first_epoch != second_epoch  # reshuffled every epoch
    assert dealt(3) == dealt(3)  # the same order on a rerun (what resume relies on)
    assert dealt(1, replace(config, seed=1)) != dealt(1)


def test_off_policy_fraction_is_the_fraction_of_off_policy_steps(world_dir):
    config = config_with(world_dir, "loss.off_policy_fraction=0.25", "train.steps=2000")
    fraction = sum(off_policy(config, step) for step in range(1, 2001)) / 2000
    assert abs(fraction - 0.25) < 0.04
    assert not any(off_policy(config_with(world_dir), step) for step in range(1, 100))


class FakeEngine:
    """Stands in for a student engine: checkpoint tests are about the directory protocol."""

    def __init__(self, value: str = ""):
        self.value = value

    def save(self, directory: Path) -> None:
        (directory / "engine.txt").write_text(self.value)

    def load(self, directory: Path) -> None:
        self.value = (directory / "engine.txt").read_text()


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    world = World(0, 1, 0, 1, None)
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        checkpoint.save(root, step, FakeEngine(f"s{step}"), {"name": "x"}, world, keep=2)
    assert [step for step, _ in checkpoint.checkpoints(root)] == [4, 6]
    # A save killed before its rename leaves only a staging directory: never picked up.
    staging = root / ".tmp-step-00000008"
    staging.mkdir()
    (staging / "engine.txt").write_text("half")
    assert checkpoint.latest(root).name == "step-00000006"
    engine = FakeEngine()
    state = checkpoint.load(checkpoint.latest(root), engine, world)
    assert engine.value == "s6" and state["step"] == 6 and state["name"] == "x"
    checkpoint.save(root, 8, FakeEngine("s8"), {}, world, keep=2)
    assert not staging.exists() and checkpoint.latest(root).name == "step-00000008"
    with pytest.raises(ValueError, match="written by 1 ranks"):
        checkpoint.load(root / "step-00000008", FakeEngine(), World(0, 2, 0, 2, None))


def test_plot_writes_a_png(tmp_path):
    from opd.metrics import plot

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1 / s, "lr": 0.1, "grad_norm": None})
                               + "\n" for s in range(1, 6)))
    out = plot(metrics, tmp_path / "m.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- 2 ranks, real engines

def launch(launcher: str, script: str, *args: str,
           env: dict | None = None) -> subprocess.CompletedProcess:
    port = str(free_port())
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--master_port", port, script, *args]
    elif launcher == "deepspeed":
        command = ["deepspeed", "--num_gpus", "2", "--master_port", port, script, *args]
    else:
        command = [sys.executable, script, *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    # DeepSpeed's CPU all-reduce buffers (66 MiB per rank, in RAM) must not outlive the run.
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    return result



@pytest.mark.parametrize("backend,teacher,tp_size", [("deepspeed", "zero_inference", 0),
                                                     ("deepspeed", "tensor_parallel", 0),
                                                     ("deepspeed", "tensor_parallel", 1),
                                                     ("fsdp", "replicated", 0)])
def test_two_rank_engines_match_one_process_then_train(world_dir, tmp_path, backend, teacher,
                                                       tp_size):
    """tp_size 0: AutoTP over the node's 2 ranks; 1: a tensor-parallel group per rank."""
    out = tmp_path / "figures.json"
    launch("torchrun", "tests/dist_scripts/check_step.py", str(world_dir), str(out),
           f"student.backend={backend}", f"teacher.engine={teacher}",
           f"teacher.tp_size={tp_size}", f"logging.run_dir={tmp_path / 'run'}")
    figures = json.loads(out.read_text())
    assert figures["same_rollouts"]  # gathered once == gathered per forward, token for token
    assert figures["micro_batches"] >= 2  # rank 1 ran empty micro-batches to keep in step
    assert figures["loss"] == pytest.approx(figures["ref_loss"], rel=1e-5)
    assert figures["grad_norm"] == pytest.approx(figures["ref_grad_norm"], rel=1e-5)
    assert figures["max_weight_update"] > 1e-6  # parameters changed ...
    assert figures["max_weight_error"] < 1e-3 * figures["max_weight_update"]  # ... as expected
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["target_tokens"] > 0 for r in records)
    assert records[1]["eval_num_tasks"] == 4  # eval.every=2: rank 0 evaluated the gathered student
    assert (tmp_path / "run" / "checkpoints" / "step-00000002").is_dir()
    exported_loads_and_generates(Path(figures["final"]), world_dir)


def exported_loads_and_generates(final: Path, world_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(world_dir / "student", dtype=torch.float32)
    changed = [name for name, p in model.named_parameters()
               if not torch.equal(p, dict(initial.named_parameters())[name])]
    assert changed, "the exported student equals the initial one"
    tokenizer = AutoTokenizer.from_pretrained(world_dir / "tokenizer")
    ids = torch.tensor([tokenizer("What is 2 + 3?")["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1]


COMPARED = ("loss", "grad_norm", "lr", "target_tokens", "tokens", "conversations",
            "valid_tool_calls", "invalid_tool_calls", "truncation_rate", "off_policy")


SAMPLED_WITH_REWARD = ("loss.direction=sampled_reverse_kl", "loss.off_policy_fraction=0",
                      "loss.reward_weight=0.5", "loss.importance_cap=2",
                      "rollout.samples_per_prompt=2")


@pytest.mark.parametrize("backend,launcher,loss", [
    ("deepspeed", "deepspeed", ("loss.off_policy_fraction=0.5",)),
    ("fsdp", "torchrun", ("loss.off_policy_fraction=0.5",)),
    ("deepspeed", "deepspeed", SAMPLED_WITH_REWARD)])
def test_resumed_run_repeats_the_uninterrupted_one(world_dir, tmp_path, backend, launcher, loss):
    """4 steps straight vs 2 steps + resume (torchrun) for 2 more: the same metrics to 1e-6;
    also for the sampled-token estimator with task rewards over groups of samples."""
    common = ["--recipe", str(world_dir / "recipe.yaml"), "train.steps=4", "checkpoint.every=2",
              "checkpoint.keep=3", "rollout.temperature=2.0", *loss,
              f"student.backend={backend}", "teacher.engine=replicated", "eval.every=0"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    launch(launcher, "launch/train.py", *common, f"logging.run_dir={straight}")
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000004")
    shutil.rmtree(resumed / "final")
    # Mark the records of the steps before the checkpoint: a resumed run keeps them, a run that
    # started over would rewrite them.
    marked = [dict(r, before_checkpoint=True) for r in read_metrics(resumed / "metrics.jsonl")]
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in marked))
    launch("torchrun", "launch/train.py", *common, f"logging.run_dir={resumed}")
    expected = read_metrics(straight / "metrics.jsonl")
    got = read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r.get("before_checkpoint", False) for r in got] == [True, True, False, False]
    compared = COMPARED
    if loss == SAMPLED_WITH_REWARD:
        compared += ("reward_mean", "reward_std", "kl_k1", "kl_k3", "importance_ratio_mean",
                     "advantage_mean", "advantage_std", "truncated_fraction")
        # two samples of each of 4 prompts, each rank sampling whole groups
        assert all(r["conversations"] == 8 and not r["off_policy"] for r in expected)
        # rollout.temperature=2 samples from another distribution than the loss's (T=1): the
        # importance weights see it, and the cap truncates them
        assert all(r["logprob_gap_max"] > 1e-3 for r in expected)
    else:
        assert {r["off_policy"] for r in expected} == {True, False}  # both kinds of step ran
    for want, have in zip(expected[2:], got[2:]):
        for key in compared:
            assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (want["step"], key)


def test_a_teacher_that_scores_conversations_trains_like_one_inside_the_step(world_dir, tmp_path):
    """Two ZeRO-Inference ranks with unequal conversation counts: scoring each finished
    conversation at collect time (hidden states, or top-k of the whole vocabulary) trains
    exactly like scoring the packed micro-batches inside the step."""
    common = ["--recipe", str(world_dir / "recipe.yaml"), "train.steps=2", "eval.every=0",
              "loss.off_policy_fraction=0.5", "teacher.engine=zero_inference",
              "train.prompts_per_step=3"]
    runs = {"micro_batch": [], "conversation": [],
            "topk": ["teacher.signal=topk", "teacher.top_k=1000000"]}
    for name, extra in runs.items():
        scoring = "micro_batch" if name == "micro_batch" else "conversation"
        launch("deepspeed", "launch/train.py", *common, f"teacher.scoring={scoring}", *extra,
               f"logging.run_dir={tmp_path / name}")
    expected = read_metrics(tmp_path / "micro_batch" / "metrics.jsonl")
    for name in ("conversation", "topk"):
        got = read_metrics(tmp_path / name / "metrics.jsonl")
        assert [r["step"] for r in got] == [1, 2]
        for want, have in zip(expected, got):
            for key in COMPARED:
                assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9), (name, key)
        assert all("teacher_collect_s" in r for r in got)


def test_pure_rl_trains_on_fsdp_without_ever_building_a_teacher(world_dir, tmp_path):
    """loss.distill_weight=0: no teacher is named, loaded or started; the reward's advantage
    alone trains the student (FSDP2 on 2 ranks)."""
    launch("torchrun", "launch/train.py", "--recipe", str(world_dir / "recipe.yaml"),
           "student.backend=fsdp", "model.teacher=", "loss.direction=sampled_reverse_kl",
           "loss.distill_weight=0", "loss.reward_weight=1", "rollout.samples_per_prompt=2",
           "loss.advantage_norm=none", "eval.every=0", f"logging.run_dir={tmp_path / 'run'}")
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["teacher_tokens"] == 0 and record["teacher_s"] == 0
        assert record["reward_mean"] == pytest.approx(record["advantage_mean"], abs=1e-6) \
            or record["target_tokens"] == 0  # advantage_norm=none: the raw reward
        assert record["kl_k1"] == 0  # no teacher, no KL estimate
        # the sampler's recorded log-probs are the learner's (same weights and temperature)
        assert record["logprob_gap_max"] < 1e-4
    assert (tmp_path / "run" / "final").is_dir()


def test_plain_python_is_a_world_of_one(world_dir, tmp_path):
    launch("python", "launch/train.py", "--recipe", str(world_dir / "recipe.yaml"),
           "train.steps=1", "student.backend=fsdp", "teacher.engine=replicated",
           f"logging.run_dir={tmp_path / 'run'}")
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(records) == 1 and records[0]["conversations"] == 4


def step_one_completion_targets(world_dir: Path, model: str):
    """Per completion of step 1's off-policy batch: `model`'s logits (plain transformers) at the
    completion's target tokens and those tokens, each [targets, ...]."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.data import completion_trajectory, load_jsonl

    config = config_with(world_dir)
    tokenizer = AutoTokenizer.from_pretrained(world_dir / "tokenizer")
    network = AutoModelForCausalLM.from_pretrained(world_dir / model, dtype=torch.float32)
    for line in step_records(load_jsonl(world_dir / "completions.jsonl"), 1, config, 0, 1, {}):
        trajectory = completion_trajectory(tokenizer, line["messages"], line.get("tools"))
        ids = torch.tensor([trajectory.input_ids])
        with torch.no_grad():
            logits = network(ids).logits[0, :-1]
        mask = torch.tensor(trajectory.assistant_mask[1:])
        yield logits[mask], ids[0, 1:][mask]


def test_sft_trains_on_the_completions_cross_entropy_without_the_teacher(world_dir, tmp_path):
    """loss.direction=sft: step 1's loss is the warm student's mean negative log-likelihood of
    the step's completion tokens (plain transformers), and the teacher scores nothing."""
    import torch.nn.functional as F

    launch("python", "launch/train.py", "--recipe", str(world_dir / "recipe.yaml"),
           "train.steps=1", "loss.direction=sft", "loss.off_policy_fraction=1",
           "eval.every=0", f"logging.run_dir={tmp_path / 'run'}")
    record, = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert record["teacher_tokens"] == 0 and record["kl_per_token"] is None
    nll, targets = 0.0, 0
    for logits, labels in step_one_completion_targets(world_dir, "student"):
        nll += F.cross_entropy(logits, labels, reduction="sum").item()
        targets += labels.numel()
    assert record["target_tokens"] == targets
    assert record["loss"] == pytest.approx(nll / targets, rel=1e-4)


def test_hybrid_kl_logs_the_fraction_of_target_tokens_on_forward_kl(world_dir, tmp_path):
    """loss.direction=hybrid_kl: metrics' forward_kl_fraction is the share of the step's target
    tokens whose teacher gives its top token at least loss.forward_kl_above (plain transformers),
    with the threshold at the median so that both sides hold tokens."""
    import torch

    top_q = torch.cat([torch.softmax(logits, -1).amax(-1)
                       for logits, _ in step_one_completion_targets(world_dir, "teacher")])
    above = round(top_q.median().item(), 6)
    expected = (top_q >= above).double().mean().item()
    assert 0 < expected < 1

    launch("python", "launch/train.py", "--recipe", str(world_dir / "recipe.yaml"),
           "train.steps=1", "loss.direction=hybrid_kl", f"loss.forward_kl_above={above}",
           "loss.off_policy_fraction=1", "eval.every=0", f"logging.run_dir={tmp_path / 'run'}")
    record, = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert record["target_tokens"] == top_q.numel()
    assert record["forward_kl_fraction"] == pytest.approx(expected, abs=1e-9)


def test_recipe_pipeline_prepares_evaluates_trains_and_prints_the_table(tmp_path):
    """The default recipe's stages on 2 ranks, with toolcalc's test-sized prepare step, and
    eval.baseline's SFT control arm: the same warm student on the dataset's completions only,
    its own row and its difference to the trained student."""
    run_dir = tmp_path / "run"
    result = launch("torchrun", "launch/train.py", "prepare=tests.dist_scripts.world:prepare_tiny",
                    "train.steps=2", "train.prompts_per_step=4", "rollout.max_new_tokens=16",
                    "rollout.batch_size=8", "train.micro_batch_tokens=1024",
                    "logging.wandb_mode=disabled", f"logging.run_dir={run_dir}",
                    "eval.baseline=sft", env={"OPD_CACHE_DIR": str(tmp_path / "cache")})
    rows = json.loads((run_dir / "eval.json").read_text())
    assert list(rows) == ["teacher", "before", "after", "sft"]
    assert all(row["num_tasks"] == 8 for row in rows.values())
    table = result.stdout[result.stdout.index("model "):].splitlines()
    assert [line.split()[0] for line in table[:5]] == ["model", "teacher", "before", "after",
                                                       "sft"]
    assert table[5].startswith("after - before: ") and table[6].startswith("after - sft: ")
    config = load_config(run_dir / "config.yaml")
    assert str(tmp_path / "cache") in config.model.student  # "{prepared}" was resolved
    control = load_config(run_dir / "baseline_sft" / "config.yaml")
    assert control.model.student == config.model.student  # the warm start, not the trained one
    assert (control.optim, control.train.steps) == (config.optim, config.train.steps)
    records = read_metrics(run_dir / "baseline_sft" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["off_policy"] and r["teacher_tokens"] == 0 for r in records)
    assert (run_dir / "baseline_sft" / "final" / "config.json").is_file()


@pytest.mark.slow
def test_default_command_runs_the_recipe_and_the_student_improves(tmp_path):
    """README's main command, as is: `deepspeed launch/train.py` (prepare cached or built)."""
    result = subprocess.run(["deepspeed", "launch/train.py", f"logging.run_dir={tmp_path / 'run'}"],
                            cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-8000:]
    rows = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert list(rows) == ["teacher", "before", "after", "sft"]
    # The README's promise: a change of at least three standard errors of the held-out eval.
    before, after = rows["before"], rows["after"]
    se = math.sqrt(sum(r["success_rate"] * (1 - r["success_rate"]) / r["num_tasks"]
                       for r in (before, after)))
    assert after["success_rate"] - before["success_rate"] >= 3 * se, rows
