"""Config: recipe + cluster file + dotted overrides; every user error names its key and source."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opd.config import Config, ConfigError, load_config, parse_override, to_yaml, with_prepared

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO / "recipes" / "toolcalc_tiny.yaml"
LOCAL_CPU = REPO / "configs" / "clusters" / "local-cpu.yaml"


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def recipe(tmp_path) -> Path:
    return write(tmp_path / "recipe.yaml", {
        "name": "r", "model": {"student": "s", "teacher": "t"}, "data": {"prompts": "p.jsonl"},
        "loss": {"direction": "forward_kl"}, "optim": {"lr": 1e-4}})


def test_default_recipe_and_local_cluster_load():
    config = load_config(DEFAULT_RECIPE, LOCAL_CPU)
    assert config.name == "toolcalc_tiny"
    assert config.cluster.device == "cpu" and config.cluster.dist_backend == "gloo"
    assert config.student.backend == "deepspeed" and config.teacher.engine == "zero_inference"


def test_later_sources_win(recipe, tmp_path):
    cluster = write(tmp_path / "cluster.yaml", {"cluster": {"name": "big"},
                                                "optim": {"lr": 2e-4, "warmup_steps": 3}})
    config = load_config(recipe, cluster, ["optim.lr=3e-4", "loss.direction=reverse_kl"])
    assert config.optim.lr == 3e-4  # command line over cluster over recipe
    assert config.optim.warmup_steps == 3  # cluster over defaults
    assert config.loss.direction == "reverse_kl"
    assert config.cluster.name == "big"
    assert config.model.student == "s"  # recipe kept where nothing overrides it
    assert config.rollout.max_turns == Config().rollout.max_turns  # defaults fill the rest


def test_override_values_are_yaml_typed():
    assert parse_override("train.steps=5") == {"train": {"steps": 5}}
    assert parse_override("optim.betas=[0.9, 0.99]") == {"optim": {"betas": [0.9, 0.99]}}
    assert parse_override("logging.progress=false") == {"logging": {"progress": False}}
    assert parse_override("model.student=/a/b") == {"model": {"student": "/a/b"}}


@pytest.mark.parametrize("text", ["loss.direction", "=3", "loss..direction=x"])
def test_malformed_override_names_itself(text):
    with pytest.raises(ConfigError, match="command line"):
        parse_override(text)


def test_unknown_key_names_key_file_and_suggestion(recipe, tmp_path):
    bad = write(tmp_path / "bad.yaml", {"loss": {"dirction": "reverse_kl"}})
    with pytest.raises(ConfigError) as error:
        load_config(recipe, bad)
    message = str(error.value)
    assert str(bad) in message and "'loss.dirction'" in message and "'loss.direction'" in message


def test_unknown_section_names_it(recipe):
    with pytest.raises(ConfigError, match=r"command line: unknown key 'optimizer'"):
        load_config(recipe, None, ["optimizer.lr=1"])


def test_bad_value_names_key_and_source(recipe):
    with pytest.raises(ConfigError, match=r"command line: optim.lr must be a finite number, got 'fast'"):
        load_config(recipe, None, ["optim.lr=fast"])
    with pytest.raises(ConfigError,
                       match=r"loss.direction must be one of forward_kl, reverse_kl, jsd"):
        load_config(recipe, None, ["loss.direction=kl"])
    with pytest.raises(ConfigError, match=r"train.steps must be an integer, got 2.5"):
        load_config(recipe, None, ["train.steps=2.5"])
    with pytest.raises(ConfigError, match=r"logging.progress must be true or false"):
        load_config(recipe, None, ["logging.progress=maybe"])


def test_bad_value_from_recipe_names_the_recipe(tmp_path, recipe):
    data = yaml.safe_load(recipe.read_text())
    data["optim"]["lr"] = -1.0
    bad = write(tmp_path / "negative.yaml", data)
    with pytest.raises(ConfigError) as error:
        load_config(bad)
    assert str(error.value) == f"{bad}: optim.lr must be positive, got -1.0."


def test_cross_field_rules(recipe):
    with pytest.raises(ConfigError, match="train.micro_batch_tokens=100 must be at least "
                                          "rollout.max_total_len=2048"):
        load_config(recipe, None, ["train.micro_batch_tokens=100"])
    with pytest.raises(ConfigError, match="data.completions"):
        load_config(recipe, None, ["loss.off_policy_fraction=0.5"])
    with pytest.raises(ConfigError, match="loss.direction=sft trains on data.completions only, "
                                          "so loss.off_policy_fraction must be 1"):
        load_config(recipe, None, ["loss.direction=sft"])
    with pytest.raises(ConfigError, match="teacher.offload_param only applies"):
        load_config(recipe, None, ["teacher.engine=replicated", "teacher.offload_param=cpu"])
    with pytest.raises(ConfigError, match="eval.every needs student.generation_gather=once"):
        load_config(recipe, None, ["eval.every=5", "student.generation_gather=per_step"])


def test_missing_required_path_is_named(tmp_path):
    bare = write(tmp_path / "bare.yaml", {"model": {"student": "s"}})
    with pytest.raises(ConfigError, match=rf"{bare}: model.teacher is not set"):
        load_config(bare)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=rf"{broken} line \d+ is not valid YAML"):
        load_config(broken)


def test_prepared_placeholder_and_round_trip(recipe, tmp_path):
    config = load_config(recipe, None, ["model.student={prepared}/student"])
    resolved = with_prepared(config, "/cache/abc")
    assert resolved.model.student == "/cache/abc/student"
    assert resolved.model.teacher == "t"
    dumped = write(tmp_path / "resolved.yaml", yaml.safe_load(to_yaml(resolved)))
    assert load_config(dumped) == resolved  # the run directory's config.yaml reloads as-is


def run_launcher(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, **(env or {})})


def test_launcher_config_error_is_one_sentence_without_traceback():
    result = run_launcher("loss.dirction=reverse_kl")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: command line: unknown key 'loss.dirction' (did you mean 'loss.direction'?).")


def test_dry_run_prints_config_layout_and_memory(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "m")
    parameters = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    result = run_launcher("--dry-run", f"model.student={tmp_path / 'm'}",
                          f"model.teacher={tmp_path / 'm'}", "cluster.procs_per_node=4",
                          "student.offload_optimizer=cpu")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "loss:\n  direction: forward_kl" in out  # the resolved config
    assert "world: 4 ranks = 1 node(s) x 4 per node" in out
    assert f"student: {parameters / 1e6:.1f}M parameters, deepspeed sharded over 4 ranks" in out
    assert "optimizer offload cpu (chosen)" in out and "optimizer offload none:" in out
    assert "teacher: " in out and "zero_inference" in out


def test_dry_run_sizes_the_prepared_models_once_cached_and_never_builds(tmp_path, monkeypatch):
    from tests.dist_scripts.world import prepare_tiny

    env = {"OPD_CACHE_DIR": str(tmp_path / "cache")}
    args = ("--dry-run", "prepare=tests.dist_scripts.world:prepare_tiny")
    before = run_launcher(*args, env=env)
    assert before.returncode == 0, before.stderr
    assert "student: {prepared}/student not found (the recipe's prepare step has not built it " \
           "yet)" in before.stdout
    assert not (tmp_path / "cache" / "toolcalc").exists()  # a dry run builds nothing

    monkeypatch.setenv("OPD_CACHE_DIR", env["OPD_CACHE_DIR"])
    prepare_tiny()
    after = run_launcher(*args, env=env)
    assert after.returncode == 0, after.stderr
    assert "student: 0.1M parameters, deepspeed sharded over 1 ranks, fp32" in after.stdout
    assert "teacher: 0.1M parameters, zero_inference: " in after.stdout
