"""Every shipped recipe loads and validates; the reward recipes say what their modes promise
(OPD + reward: a teacher and groups; pure RL: no teacher engine, in the dry run too)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from opd.config import load_config
from opd.pipeline import dry_run
from opd.plugins import resolve_plugins
from tests.test_memory_estimate import config_only

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
OPD_REWARD = ("toolcalc_opd_reward", "bfcl_qwen3_8b_to_1.7b_opd_reward")
PURE_RL = ("toolcalc_rl", "bfcl_qwen3_1.7b_rl")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_every_recipe_loads_and_validates(recipe):
    config = load_config(recipe)
    assert config.name == recipe.stem  # the run directory runs/<name> is the recipe's own


@pytest.mark.parametrize("name", OPD_REWARD)
def test_opd_reward_recipes_distil_and_reward_over_groups(name):
    config = load_config(REPO / "recipes" / f"{name}.yaml")
    loss = config.loss
    assert loss.direction == "sampled_reverse_kl" and loss.needs_teacher
    assert loss.distill_weight == 1 and loss.reward_weight > 0 and loss.importance_cap >= 1
    assert config.rollout.samples_per_prompt >= 2


@pytest.mark.parametrize("name", PURE_RL)
def test_pure_rl_recipes_start_no_teacher_but_evaluate_one(name):
    config = load_config(REPO / "recipes" / f"{name}.yaml")
    assert config.loss.distill_weight == 0 and config.loss.reward_weight == 1
    assert not config.loss.needs_teacher and config.rollout.samples_per_prompt >= 2
    assert config.model.teacher and config.eval.teacher  # the table keeps the teacher's row


def test_pure_rl_dry_run_says_no_teacher_is_started(tmp_path):
    """The launcher's dry run of the toolcalc RL recipe (nothing prepared, nothing built)."""
    result = subprocess.run(
        [sys.executable, str(REPO / "launch" / "train.py"), "--recipe",
         str(REPO / "recipes" / "toolcalc_rl.yaml"), "--dry-run"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "OPD_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    layout = result.stdout[result.stdout.index("\nworld: "):]
    assert "\nteacher: none started" in layout and "zero_inference" not in layout
    assert "  teacher: none started (loss.direction=sampled_reverse_kl, " \
           "loss.distill_weight=0)" in layout


def test_pure_rl_dry_run_without_a_teacher_still_prints_the_student_peak(tmp_path, monkeypatch):
    """Pure RL needs no model.teacher: the per-rank peak is the student's alone."""
    pytest.importorskip("bfcl_eval", reason="the BFCL extra (requirements-bfcl.txt)")
    monkeypatch.setenv("OPD_CACHE_DIR", str(tmp_path / "cache"))  # a dry run prepares nothing
    config = load_config(REPO / "recipes" / "bfcl_qwen3_1.7b_rl.yaml",
                         REPO / "configs" / "clusters" / "bfcl-8gpu.yaml",
                         [f"model.student={config_only(tmp_path, 'Qwen3-1.7B')}",
                          "model.teacher="])
    out = dry_run(config, resolve_plugins(config))
    assert "teacher: none started (the loss reads no teacher)" in out
    # Student states 4.36 GiB + gathered student 3.2 GiB + KV cache 42 GiB (docs/qwen3.md).
    assert "  device peak per rank: training 11.2 GiB, rollout 49.6 GiB" in out
