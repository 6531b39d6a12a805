"""2 nodes x 1 rank on one machine: two per-node launchers rendezvous on loopback.

Each "node" is launch/slurm/node.sh (torchrun with a static rendezvous) given the environment
srun gives it on a real cluster (SLURM_NNODES, SLURM_NODEID) plus the sbatch file's MASTER_ADDR
and MASTER_PORT; both run the unchanged launch/train.py on the tiny recipe, end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
NODE_LAUNCHER = REPO / "launch" / "slurm" / "node.sh"
TRAIN_SCRIPT = REPO / "launch" / "train.py"



def test_two_nodes_of_one_rank_train_the_tiny_recipe(tmp_path):
    from dist_scripts.world import build_world

    recipe = build_world(tmp_path / "world")
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"cluster": {
        "name": "two-nodes", "device": "cpu", "dist_backend": "gloo", "threads_per_rank": 1,
        "nodes": 2, "procs_per_node": 1}}))
    port = str(free_port())
    nodes = []
    for node_rank in range(2):
        env = dict(os.environ, SLURM_NNODES="2", SLURM_NODEID=str(node_rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        nodes.append(subprocess.Popen(
            [str(NODE_LAUNCHER), "1", sys.executable, str(TRAIN_SCRIPT), "--recipe", str(recipe),
             "--cluster", str(cluster), "train.steps=2"],
            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [node.communicate(timeout=600)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output

    run_dir = tmp_path / "world" / "run"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in checkpoint.glob("rng-rank*.pt")) == ["rng-rank0.pt", "rng-rank1.pt"]
    assert (run_dir / "final" / "config.json").is_file()
