"""launch/submit.py: the sbatch file it writes, and real jobs on the local Slurm (.ci/slurm.sh).

The job tests submit the project's own sbatch file with `sbatch --wait`: one node, one launcher
(torchrun) starting 2 CPU ranks of the tiny recipe. The second one sends the job USR1 mid-run
and checks that it checkpoints, requeues itself and completes from that checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SUBMIT = REPO / "launch" / "submit.py"
MULTINODE = REPO / "configs" / "clusters" / "slurm-multinode.yaml"
SINGLE_NODE = REPO / "configs" / "clusters" / "single-node-8gpu.yaml"
RECIPE = REPO / "recipes" / "toolcalc_tiny.yaml"

needs_slurm = pytest.mark.skipif(
    shutil.which("sbatch") is None,
    reason="Slurm binaries (sbatch) are not installed; `bash .ci/slurm.sh` installs and starts "
           "a one-node Slurm on localhost")


def submit(*args: str, cwd: Path = REPO, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SUBMIT), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, **kwargs)


def sbatch_options(script: str) -> list[str]:
    return [line.split(None, 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_dry_run_prints_a_multinode_sbatch_file():
    result = submit("--cluster", str(MULTINODE), "--recipe", str(RECIPE), "--dry-run",
                    "train.steps=7", "logging.run_dir=/shared/runs/exp 1")
    assert result.returncode == 0, result.stderr
    cluster = yaml.safe_load(MULTINODE.read_text())["cluster"]
    options = sbatch_options(result.stdout)
    assert f"--nodes={cluster['nodes']}" in options
    assert "--ntasks-per-node=1" in options  # one launcher per node
    assert f"--gpus-per-node={cluster['slurm']['gpus_per_node']}" in options
    assert f"--partition={cluster['slurm']['partition']}" in options
    assert f"--signal=USR1@{cluster['slurm']['signal_seconds']}" in options
    assert "--requeue" in options
    assert '--output="/shared/runs/exp 1/slurm-%j.out"' in options  # sbatch splits at spaces
    exports = "\n".join(line for line in result.stdout.splitlines() if line.startswith("export "))
    shown = subprocess.run(["bash", "-c", f"{exports}\nenv"], capture_output=True, text=True,
                           env={}).stdout.splitlines()
    for name, value in cluster["slurm"]["env"].items():
        assert f"{name}={value}" in shown
    srun = result.stdout[result.stdout.index("\nsrun "):]
    assert f"node.sh {cluster['procs_per_node']} " in srun
    assert f"launch/train.py --recipe {RECIPE} --cluster {MULTINODE} train.steps=7 " \
           "'logging.run_dir=/shared/runs/exp 1'" in srun
    assert subprocess.run(["bash", "-n"], input=result.stdout, text=True).returncode == 0


def test_dry_run_of_the_single_node_cluster_asks_for_one_node():
    result = submit("--cluster", str(SINGLE_NODE), "--recipe", str(RECIPE), "--dry-run")
    assert result.returncode == 0, result.stderr
    options = sbatch_options(result.stdout)
    assert "--nodes=1" in options and "--gpus-per-node=8" in options
    assert "node.sh 8 " in result.stdout


@pytest.mark.parametrize("override, message", [
    ("cluster.slurm.partion=gpu", "unknown key 'cluster.slurm.partion' (did you mean "
                                  "'cluster.slurm.partition'?)"),
    ("cluster.slurm.signal_seconds=-5", "cluster.slurm.signal_seconds must be at least 0"),
    ("checkpoint.resume=never", "checkpoint.resume=never would restart a requeued job"),
    ("cluster.slurm.env={1X: 2}", "command line: cluster.slurm.env must be a mapping of "
                                  "environment variable names to strings or numbers"),
])
def test_bad_slurm_settings_stop_with_one_sentence_naming_the_key(override, message):
    result = submit("--cluster", str(MULTINODE), "--recipe", str(RECIPE), "--dry-run", override)
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


# --- real jobs on the local Slurm ---------------------------------------------------------------

def _tiny_run(root: Path, steps: int) -> tuple[Path, Path, list[str]]:
    """The tiny recipe, a one-node cluster file for the local Slurm, and the overrides."""
    from dist_scripts.world import build_world

    recipe = build_world(root / "world")
    cluster = root / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"cluster": {
        "name": "local-slurm", "device": "cpu", "dist_backend": "gloo", "threads_per_rank": 1,
        "nodes": 1, "procs_per_node": 2,
        "slurm": {"time": "00:20:00", "cpus_per_node": 2}}}))
    return recipe, cluster, [f"train.steps={steps}", "checkpoint.keep=5"]


def _start(recipe: Path, cluster: Path, overrides: list[str], cwd: Path):
    """`submit.py --wait` running in the background, and the job id it printed."""
    proc = subprocess.Popen([sys.executable, str(SUBMIT), "--cluster", str(cluster), "--recipe",
                             str(recipe), "--wait", *overrides], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    match = re.search(r" as job (\d+)\.", line)
    if match is None:
        proc.kill()
        raise AssertionError(f"submit.py did not submit: {line}{proc.communicate()[1]}")
    return proc, match.group(1)


def _job_field(job: str, name: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    match = re.search(rf"\b{name}=(\S+)", shown)
    return match.group(1) if match else ""


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _finish(proc, job: str, limit_s: float = 600) -> str:
    """Wait for `submit.py --wait`, then for the job to leave COMPLETING (its processes gone,
    its log whole: sbatch --wait may return before)."""
    try:
        proc.wait(timeout=limit_s)
    finally:
        if proc.poll() is None:
            subprocess.run(["scancel", job])
            proc.kill()
    deadline = time.monotonic() + 120
    while _job_field(job, "JobState") == "COMPLETING" and time.monotonic() < deadline:
        time.sleep(1)
    return proc.stderr.read()


@needs_slurm
def test_sbatch_job_trains_the_tiny_recipe_on_two_ranks(tmp_path):
    recipe, cluster, overrides = _tiny_run(tmp_path, steps=2)
    proc, job = _start(recipe, cluster, overrides, cwd=tmp_path)
    stderr = _finish(proc, job)
    run_dir = tmp_path / "world" / "run"
    log = (run_dir / f"slurm-{job}.out").read_text()
    assert proc.returncode == 0, stderr + log
    assert _job_field(job, "JobState") == "COMPLETED"
    assert _steps(run_dir) == [1, 2]
    state = json.loads((run_dir / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert state["world_size"] == 2
    assert (run_dir / "final" / "config.json").is_file()
    assert f"opd: job {job} start 1 on " in log


@needs_slurm
def test_usr1_mid_run_checkpoints_requeues_and_resumes(tmp_path):
    steps = 60  # 0.2-1 s each: the signal lands well before the end
    recipe, cluster, overrides = _tiny_run(tmp_path, steps=steps)
    run_dir = tmp_path / "world" / "run"
    proc, job = _start(recipe, cluster, overrides, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not _steps(run_dir) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _steps(run_dir), "the job logged no step"
        subprocess.run(["scancel", "--signal=USR1", job], check=True)
        while _job_field(job, "Restarts") in ("", "0") and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        before_restart = (run_dir / "metrics.jsonl").read_text()
    finally:
        stderr = _finish(proc, job)
    log = (run_dir / f"slurm-{job}.out").read_text()
    assert proc.returncode == 0, stderr + log
    assert _job_field(job, "Restarts") == "1" and _job_field(job, "JobState") == "COMPLETED"
    assert f"Slurm job {job} requeued to resume from it" in log
    assert f"opd: job {job} start 2 on " in log

    stopped_at = len(before_restart.splitlines())
    assert 1 <= stopped_at < steps  # stopped early, at a step boundary
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step-{stopped_at:08d}", f"step-{steps:08d}"]
    # The second start resumed: the first run's records are kept as they were, not rerun.
    assert _steps(run_dir) == list(range(1, steps + 1))
    assert (run_dir / "metrics.jsonl").read_text().startswith(before_restart)
    assert (run_dir / "final" / "config.json").is_file()


@needs_slurm
@pytest.mark.slow
def test_time_limit_warning_signal_requeues_and_resumes(tmp_path):
    """Slurm's own USR1 before the time limit (--signal=USR1@N), not a hand-sent one.

    Slurm checks for due signals about once a minute, so it may come up to a minute early: the
    run is made too long to finish in one start, and the test ends it (scancel) once the second
    start has resumed from the checkpoint the first one wrote."""
    recipe, cluster, overrides = _tiny_run(tmp_path, steps=100_000)
    settings = yaml.safe_load(cluster.read_text())
    settings["cluster"]["slurm"].update(time="00:03:00", signal_seconds=120)
    cluster.write_text(yaml.safe_dump(settings))
    run_dir = tmp_path / "world" / "run"
    proc, job = _start(recipe, cluster, overrides, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 900
        stopped_at = None
        while proc.poll() is None and time.monotonic() < deadline:
            if stopped_at is None and _job_field(job, "Restarts") == "1":
                stopped_at = len(_steps(run_dir))  # the requeued start has not logged yet
            if stopped_at is not None and len(_steps(run_dir)) > stopped_at:
                break  # the second start trained a step after the checkpoint
            time.sleep(1)
    finally:
        subprocess.run(["scancel", job])
        stderr = _finish(proc, job, limit_s=120)
    log = (run_dir / f"slurm-{job}.out").read_text()
    assert stopped_at is not None and len(_steps(run_dir)) > stopped_at, stderr + log
    assert f"Slurm job {job} requeued to resume from it" in log
    assert f"opd: job {job} start 2 on " in log
    assert "DUE TO TIME LIMIT" not in log
    # scancel's SIGTERM: a last checkpoint, and the job ends for good (it does not requeue).
    assert ("Stopped by SIGTERM (or the launcher's exit) after a checkpoint; the job is not "
            "requeued") in log
    assert _job_field(job, "Restarts") == "1" and _job_field(job, "JobState") == "CANCELLED"
    # The second start resumed after the checkpoint: no step was run twice.
    steps = _steps(run_dir)
    assert steps == list(range(1, len(steps) + 1))
