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
