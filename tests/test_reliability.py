"""What a run survives: a reused run directory, unwritable directories, wandb without a key or a
network, a busy rendezvous port, a binary dataset line, a launcher killed under its ranks, and a
rank that stops responding (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
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
