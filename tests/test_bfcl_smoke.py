"""recipes/bfcl_smoke.yaml end to end: a few real BFCL episodes (bfcl-eval's backends in the
sandbox, its checker in the eval) with tiny random models, ZeRO-3 student on 2 gloo ranks.

Runs once the environment interface (opd.environments, `tools.environment`) is present."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, free_port

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("bfcl_eval") is None,
                       reason="the BFCL extra: pip install --no-deps -r requirements-bfcl.txt"),
    pytest.mark.skipif(importlib.util.find_spec("opd.environments") is None,
                       reason="needs the environment interface (opd.environments)"),
]


def test_bfcl_smoke_recipe_runs_episodes_end_to_end(tmp_path):
    env = {**os.environ, "OPD_CACHE_DIR": str(tmp_path / "cache")}
    run_dir = tmp_path / "run"
    command = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "launch/train.py",
               "--recipe", "recipes/bfcl_smoke.yaml", f"logging.run_dir={run_dir}",
               "logging.progress=false"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    report = json.loads((run_dir / "eval.json").read_text())
    after = report.get("after", report)
    text = json.dumps(after)
    assert "per_group" in text and "base" in text  # scored per BFCL category
    assert 0.0 <= after["bfcl_accuracy"] <= 1.0  # BFCL's own figure beside success_rate
    # the episodes really ran in the sandbox (as the unprivileged user when root): an episode
    # whose environment cannot start has no turn
    assert after["mean_turns"] >= 1 and after["mean_generated_tokens"] > 0, after
    assert (run_dir / "final" / "config.json").is_file()
    sys.stdout.write(text[:2000])
