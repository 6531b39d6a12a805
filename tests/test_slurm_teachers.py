"""A served teacher on its own Slurm nodes (cluster.teacher_nodes, opd/slurm_teachers.py): the
sbatch file launch/submit.py writes splits the job's nodes, starts the teacher servers on the
first ones and hands their URLs to the trainer on the others.

The batch script runs here under bash with the real `scontrol show hostnames` (it parses a node
list without a controller) and an `srun` on PATH that records each step's nodes and command
line: the 4-node GPU layout of the shipped cluster file. launch/slurm/teachers.sh runs for real,
with an interpreter that records its servers. And a real job on the two-node Slurm of
.ci/slurm_two_nodes.sh (marked vllm: the server needs vLLM, `.venv-vllm/bin/python -m pytest -m
vllm`) serves the tiny teacher on one node and trains a 2-rank ZeRO-3 student on the other.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opd.config import load_config

REPO = Path(__file__).resolve().parents[1]
SUBMIT = REPO / "launch" / "submit.py"
RECIPE = REPO / "recipes" / "qwen3_32b_to_8b_served.yaml"
CLUSTER = REPO / "configs" / "clusters" / "qwen3-served-4x8xh100.yaml"

TWO_NODES = Path(os.environ.get("OPD_SLURM_TWO_NODES", "/var/lib/opd-slurm-2nodes")) / "slurm.conf"
needs_scontrol = pytest.mark.skipif(shutil.which("scontrol") is None,
                                    reason="Slurm's scontrol is not installed (.ci/slurm.sh)")


def submit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SUBMIT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def recording_srun(root: Path) -> Path:
    """A directory holding an `srun` that writes its arguments to $SRUN_LOG.teacher (the
    teacher step, which then runs until it is killed, as servers do) or $SRUN_LOG.trainer (the
    trainer step, written once the teacher step's is: the trainer waits for the servers)."""
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        '#!/usr/bin/env bash\n'
        'if [[ "$*" == *teachers.sh* ]]; then\n'
        '    printf "%q " "$@" > "$SRUN_LOG.teacher"; exec sleep 120\n'
        'fi\n'
        'for _ in $(seq 100); do [[ -s "$SRUN_LOG.teacher" ]] && break; sleep 0.1; done\n'
        'printf "%q " "$@" > "$SRUN_LOG.trainer"\n')
    (bin_dir / "srun").chmod(0o755)
    return bin_dir


@needs_scontrol
def test_the_job_serves_the_teacher_on_its_first_node_and_hands_the_urls_to_the_trainer(
        tmp_path):
    result = submit("--cluster", str(CLUSTER), "--recipe", str(RECIPE), "--dry-run")
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert "#SBATCH --nodes=4" in script  # 3 trainer nodes + 1 teacher node
    # The setup line would source a venv of the real cluster; everything else runs as written.
    script = script.replace("source /shared/envs/opd/bin/activate", ":")
    log = tmp_path / "srun.log"
    env = {**os.environ, "PATH": f"{recording_srun(tmp_path)}:{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "gpu-t1,gpu-s[1-3]", "SLURM_JOB_ID": "4242",
           "SRUN_LOG": str(log)}
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env,
                         timeout=60)  # < the teacher step's 120 s: the script stopped it
    assert run.returncode == 0, run.stderr
    port = 9000 + 4242 % 375 * 16
    urls = f"[http://gpu-t1:{port},http://gpu-t1:{port + 1}]"
    assert f"opd: teacher servers {urls} on gpu-t1, trainer on gpu-s1,gpu-s2,gpu-s3" in run.stdout
    assert f"rendezvous gpu-s1:{15000 + 4242 % 15000}" in run.stdout

    # The script ended without waiting out the teacher step: it killed it.
    teacher_step, train_step = [shlex.split(Path(f"{log}.{step}").read_text())
                                for step in ("teacher", "trainer")]
    assert teacher_step[:5] == ["--nodes=1", "--ntasks=1", "--ntasks-per-node=1",
                                "--cpus-per-task=96", "--nodelist=gpu-t1"]
    launcher = teacher_step[5:]
    assert launcher[:5] == [str(REPO / "launch" / "slurm" / "teachers.sh"), "2", "4", str(port),
                            "python"]  # 2 servers of tp 4 on the 8-GPU node, ports port, +1
    server = launcher[5:]
    config = load_config(RECIPE, CLUSTER)
    assert server[server.index("--model") + 1] == config.model.teacher
    assert server[server.index("--tokenizer") + 1] == config.tokenizer_path
    assert server[server.index("--max-model-len") + 1] == str(config.rollout.max_total_len + 1)
    assert server[server.index("--host") + 1] == "0.0.0.0"

    assert train_step[:6] == ["--nodes=3", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                              "--cpus-per-task=96", "--ntasks=3", "--nodelist=gpu-s1,gpu-s2,gpu-s3"]
    assert train_step[-1] == f"teacher.urls={urls}"
    # The trainer's own command line: the recipe, the cluster file and the URLs, last.
    recipe_at = train_step.index("--recipe")
    trainer = load_config(train_step[recipe_at + 1], train_step[recipe_at + 3],
                          train_step[recipe_at + 4:])
    assert trainer.teacher.urls == [f"http://gpu-t1:{port}", f"http://gpu-t1:{port + 1}"]
    assert trainer.cluster.nodes * trainer.cluster.procs_per_node == 24


def test_teachers_sh_gives_each_server_its_own_gpus_and_port(tmp_path):
    """launch/slurm/teachers.sh for real; its interpreter records what each server would get."""
    record = tmp_path / "servers"
    fake_python = tmp_path / "python"
    # Each records itself, then runs until both have (servers run until stopped; the first to
    # end stops the node's others).
    fake_python.write_text('#!/usr/bin/env bash\n'
                           'echo "$CUDA_VISIBLE_DEVICES $*" >> "$RECORD"\n'
                           'for _ in $(seq 100); do (( $(wc -l < "$RECORD") == 2 )) && break; '
                           'sleep 0.1; done\n')
    fake_python.chmod(0o755)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "RECORD": str(record)}
    run = subprocess.run(["bash", str(REPO / "launch" / "slurm" / "teachers.sh"), "2", "4",
                          "9100", str(fake_python), "--model", "/m"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = sorted(record.read_text().splitlines())
    assert lines == [
        "0,1,2,3 -m opd.teachers.server --port 9100 --tensor-parallel-size 4 --model /m",
        "4,5,6,7 -m opd.teachers.server --port 9101 --tensor-parallel-size 4 --model /m"]


def _cluster(tmp_path: Path, **cluster) -> Path:
    base = yaml.safe_load(CLUSTER.read_text())
    base["cluster"].update(cluster)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


@pytest.mark.parametrize("cluster, overrides, message", [
    ({}, ["teacher.tp_size=3"], "teacher.tp_size=3 must divide cluster.slurm.gpus_per_node=8"),
    ({}, ["teacher.urls=[http://x:1]"], "teacher.urls must be empty with cluster.teacher_nodes"),
    ({}, ["teacher.engine=tensor_parallel", "teacher.signal=auto"],
     "cluster.teacher_nodes configures teacher servers and needs teacher.engine=served, not "
     "tensor_parallel."),
])
def test_a_node_split_that_cannot_start_is_refused_in_one_sentence(tmp_path, cluster, overrides,
                                                                   message):
    result = submit("--cluster", str(_cluster(tmp_path, **cluster)), "--recipe", str(RECIPE),
                    "--dry-run", *overrides)
    assert result.returncode == 1
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("overrides, payload, temperature", [
    ([], "logprobs", 1.0),
    (["loss.temperature=1.5"], "logprobs", 1.5),
    (["teacher.signal=distribution", "loss.temperature=1.5"], "hidden", 1.0),
])
def test_the_job_starts_servers_with_the_payload_and_temperature_its_loss_reads(
        overrides, payload, temperature):
    """The servers the job starts answer what the trainer will ask for (it refuses others):
    log-probs at loss.temperature, or hidden states, to which the trainer applies its head at
    any temperature."""
    from opd.slurm_teachers import server_args
    from opd.teachers.server import parse_args

    args = parse_args(server_args(load_config(RECIPE, CLUSTER, overrides)))
    assert (args.payload, args.temperature) == (payload, temperature)


def test_without_teacher_nodes_the_job_is_unchanged():
    """An in-process recipe's job: one srun over every node, no teacher step."""
    result = submit("--cluster", str(REPO / "configs" / "clusters" / "qwen3-4x8xh100.yaml"),
                    "--recipe", str(REPO / "recipes" / "qwen3_32b_to_4b.yaml"), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --nodes=4" in result.stdout and "teachers.sh" not in result.stdout
    assert "TEACHER_URLS" not in result.stdout and result.stdout.count("\nsrun ") == 1


def test_a_requeued_job_whose_teacher_moved_to_other_nodes_resumes(tmp_path):
    """A requeued job may get other nodes, so other teacher URLs: its checkpoint still resumes.
    What the teacher computes (its engine, signal, top-k, quantization) may not change."""
    from test_reliability import _check, _config, _ran

    from opd.errors import ConfigError

    served = ["teacher.engine=served", "loss.direction=sampled_reverse_kl"]
    _ran(_config(tmp_path, *served, "teacher.urls=[http://gpu-t1:9000]"))
    _check(_config(tmp_path, *served, "teacher.urls=[http://gpu-t7:9000,http://gpu-t8:9000]",
                   "teacher.in_flight=8", "teacher.timeout_s=300"))
    with pytest.raises(ConfigError, match=r"holds another run \(teacher.quantization was "
                                          r"'none', now 'fp8'\)"):
        _check(_config(tmp_path, *served, "teacher.urls=[http://gpu-t1:9000]",
                       "teacher.quantization=fp8"))


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed (bash .ci/vllm.sh; .venv-vllm/bin/python -m "
                           "pytest -m vllm)")
@pytest.mark.skipif(not TWO_NODES.is_file() or shutil.which("sbatch") is None,
                    reason="no two-node Slurm: bash .ci/slurm.sh && bash .ci/slurm_two_nodes.sh")
def test_a_real_two_node_job_serves_the_teacher_on_one_node_and_trains_on_the_other(tmp_path):
    from dist_scripts.world import VLLM_STUDENT_SHAPE, build_world

    recipe = build_world(tmp_path / "world", student_shape=VLLM_STUDENT_SHAPE,
                         teacher_shape=VLLM_STUDENT_SHAPE)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"cluster": {
        "name": "two-nodes", "device": "cpu", "dist_backend": "gloo", "threads_per_rank": 1,
        "nodes": 1, "procs_per_node": 2, "teacher_nodes": 1,
        "slurm": {"time": "00:20:00", "requeue": False, "python": sys.executable,
                  "env": {"VLLM_CPU_KVCACHE_SPACE": 1}}}}))
    env = {**os.environ, "SLURM_CONF": str(TWO_NODES), "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(SUBMIT), "--cluster", str(cluster), "--recipe", str(recipe), "--wait",
         "teacher.engine=served", "loss.direction=sampled_reverse_kl",
         "teacher.gpu_memory_utilization=0.3", "train.steps=3", "checkpoint.every=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=1200, env=env)
    job = re.search(r" as job (\d+)\.", result.stdout)
    assert job, result.stdout + result.stderr
    run_dir = tmp_path / "world" / "run"
    log = (run_dir / f"slurm-{job.group(1)}.out").read_text()
    assert result.returncode == 0, result.stderr + log[-6000:]
    layout = re.search(r"opd: teacher servers \[http://([^:]+):(\d+)\] on (\S+), trainer on (\S+)",
                       log)
    assert layout, log[-6000:]
    assert layout.group(1) == layout.group(3) != layout.group(4)  # its own node
    assert f"rendezvous {layout.group(4)}:" in log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["teacher_tokens"] > 0 and r["teacher_collect_s"] > 0 for r in records)
    assert (run_dir / "final" / "config.json").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1] == "step-00000003"
