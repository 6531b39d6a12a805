"""What a run survives: a reused run directory, unwritable directories, wandb without a key or a
network, a busy rendezvous port, a binary dataset line, a launcher killed under its ranks, and a
rank that stops responding (docs/reliability.md)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from opd.data import DatasetError, load_jsonl

REPO = Path(__file__).resolve().parents[1]
LINE = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "answer": 4}


def test_a_binary_dataset_line_names_file_and_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(json.dumps(LINE).encode() + b"\n" + b"\x89PNG\r\n\x1a\n\xff\xfe\x00" + b"\n")
    with pytest.raises(DatasetError, match=rf"^{path} line 2 is not UTF-8 text"):
        load_jsonl(path)
    path.write_bytes("{\"messages\": [{\"role\": \"user\", \"content\": \"caf\u00e9\"}]}\n"
                     .encode("latin-1"))
    with pytest.raises(DatasetError, match=rf"^{path} line 1 is not UTF-8 text"):
        load_jsonl(path)


def test_runs_of_one_recipe_get_their_own_wandb_run_while_a_resume_keeps_its_id(tmp_path):
    from opd.metrics import MetricsLog

    def wandb_id(run_dir: Path, resume_step: int) -> str:
        log = MetricsLog(run_dir, enabled=True, resume_step=resume_step, wandb_mode="offline",
                         run_name="tiny/sweep", config={"optim": {"lr": 0.1}})
        run_id = log.wandb.id
        log.close()
        return run_id

    first = wandb_id(tmp_path / "a", 0)
    assert first.startswith("tiny-sweep-")
    assert wandb_id(tmp_path / "b", 0) != first  # another run of the same recipe
    assert wandb_id(tmp_path / "a", 2) == first  # resumed from its step-2 checkpoint
    assert wandb_id(tmp_path / "a", 0) != first  # started over from step 0: a new wandb run


# ---------------------------------------------------------------- pre-flight (opd.preflight)

def _config(tmp_path: Path, *overrides: str):
    from opd.config import load_config

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: tiny\nmodel: {student: s, teacher: t}\ndata: {prompts: p.jsonl}\n"
                      "optim: {lr: 0.1}\nlogging: {wandb_mode: disabled}\n")
    return load_config(recipe, None, [f"logging.run_dir={tmp_path / 'run'}", *overrides])


def _check(config):
    import torch

    from opd import preflight
    from opd.dist import World

    return preflight.check(config, World(0, 1, 0, 1, torch.device("cpu")))


def _ran(config) -> None:
    """What a run leaves in its directory: its config and a checkpoint."""
    from opd.config import to_yaml

    (config.run_dir / "checkpoints" / "step-00000002").mkdir(parents=True)
    (config.run_dir / "config.yaml").write_text(to_yaml(config))


def test_a_run_directory_holding_another_run_is_refused_naming_the_first_changed_key(tmp_path):
    from opd.config import ConfigError

    _ran(_config(tmp_path))
    with pytest.raises(ConfigError, match=r"^logging.run_dir .*/run holds another run \(optim.lr "
                       r"was 0.1, now 0.2\): run with its config to resume it, or set "
                       r"logging.run_dir to a new directory to start a new run.$"):
        _check(_config(tmp_path, "optim.lr=0.2"))
    with pytest.raises(ConfigError, match="checkpoint.resume=never would overwrite them"):
        _check(_config(tmp_path, "checkpoint.resume=never"))
    # A resume may run longer, log and evaluate differently, on another cluster.
    _check(_config(tmp_path, "train.steps=500", "logging.progress=false", "eval.every=5",
                   "cluster.threads_per_rank=3"))
    # Naming the checkpoint continues it on purpose with the changed config.
    _check(_config(tmp_path, "optim.lr=0.2",
                   f"checkpoint.resume={tmp_path / 'run/checkpoints/step-00000002'}"))


def test_a_run_directory_without_results_may_start_another_run(tmp_path):
    config = _config(tmp_path)
    _ran(config)
    (config.run_dir / "checkpoints" / "step-00000002").rmdir()  # failed before its first checkpoint
    _check(_config(tmp_path, "optim.lr=0.2"))


def test_an_unwritable_run_directory_is_named(tmp_path):
    from opd.config import ConfigError

    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=rf"^logging.run_dir: cannot write to {tmp_path}/file/run "
                       r"\(.+\)\.$"):
        _check(_config(tmp_path, f"logging.run_dir={tmp_path / 'file' / 'run'}"))


def test_wandb_online_needs_a_key_and_goes_offline_when_its_host_does_not_answer(
        tmp_path, monkeypatch, capsys):
    from opd.config import ConfigError

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="logging.wandb_mode=online needs a wandb API key"):
        _check(_config(tmp_path, "logging.wandb_mode=online"))
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    (tmp_path / ".netrc").write_text("machine 127.0.0.1 login user password secret\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert _check(_config(tmp_path, "logging.wandb_mode=online")).logging.wandb_mode == "offline"
    assert f"wandb host 127.0.0.1:{port} is unreachable" in capsys.readouterr().err
