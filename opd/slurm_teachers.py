"""The served teacher's nodes in a Slurm job (`cluster.teacher_nodes`), for opd.submit.

The job's first `cluster.teacher_nodes` nodes run the teacher servers, the next `cluster.nodes`
the trainer. Each teacher node starts `replicas_per_node` servers (launch/slurm/teachers.sh),
each on `teacher.tp_size` of its GPUs and its own port; the batch script collects their URLs
into `TEACHER_URLS`, which the trainer gets as its last override, `teacher.urls=[...]`, and
polls until every server answers /health (opd.teachers.served).

The servers' engine options come from the recipe: the teacher's directory and the run's
tokenizer (the trainer checks the served vocabulary against it), the longest conversation
(`rollout.max_total_len` + 1), the largest top-k, the dtype (`teacher.precision`), the payload
the loss reads (hidden states for `distribution`, else log-probs at `loss.temperature`), and
`teacher.quantization`, `teacher.expert_parallel`, `teacher.gpu_memory_utilization`.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from opd.config import Config
from opd.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
TEACHER_LAUNCHER = REPO / "launch" / "slurm" / "teachers.sh"
MIN_TOP_K = 64  # the server's default --max-top-k: a recipe's teacher.top_k may grow up to it
DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp32": "float32"}
# 9000..14999: below the rendezvous ports (15000..29999), 16 per job for its replicas.
PORT_LINE = "TEACHER_PORT=$((9000 + SLURM_JOB_ID % 375 * 16))"
MAX_REPLICAS_PER_NODE = 16


def server_tp_size(config: Config) -> int:
    """GPUs per teacher server: teacher.tp_size, or all of a node's (1 without GPUs)."""
    return config.teacher.tp_size or max(1, config.cluster.slurm.gpus_per_node)


def replicas_per_node(config: Config) -> int:
    gpus = config.cluster.slurm.gpus_per_node
    return gpus // server_tp_size(config) if gpus else 1


def check_teacher_nodes(config: Config) -> None:
    """Refuse, in one sentence, a node split that cannot start (before anything is submitted)."""
    if not config.cluster.teacher_nodes:
        return
    gpus, tp = config.cluster.slurm.gpus_per_node, server_tp_size(config)
    if gpus and (tp > gpus or gpus % tp):
        raise ConfigError(f"teacher.tp_size={tp} must divide cluster.slurm.gpus_per_node={gpus}: "
                          "each teacher server takes tp_size GPUs of one node.")
    if replicas_per_node(config) > MAX_REPLICAS_PER_NODE:
        raise ConfigError(f"teacher.tp_size={tp} gives {replicas_per_node(config)} teacher "
                          f"servers per node, more than {MAX_REPLICAS_PER_NODE} (one port each); "
                          "raise teacher.tp_size.")
    if config.teacher.urls:
        raise ConfigError("teacher.urls must be empty with cluster.teacher_nodes: the job starts "
                          "the teacher servers and passes their URLs to the trainer.")
    if not config.model.teacher:
        raise ConfigError("model.teacher must name the teacher's directory: the job's teacher "
                          "nodes serve it.")


def server_args(config: Config) -> list[str]:
    """`python -m opd.teachers.server` options of every server (port and tp size aside)."""
    teacher = config.teacher
    args = ["--model", config.model.teacher, "--tokenizer", config.tokenizer_path,
            "--host", "0.0.0.0", "--max-model-len", str(config.rollout.max_total_len + 1),
            "--max-top-k", str(max(MIN_TOP_K, teacher.top_k)),
            "--dtype", DTYPES[teacher.precision],
            "--gpu-memory-utilization", f"{teacher.gpu_memory_utilization:g}"]
    if config.teacher_signal == "distribution":
        args += ["--payload", "hidden"]
    elif config.loss.temperature != 1.0:
        args += ["--temperature", f"{config.loss.temperature:g}"]
    if teacher.quantization != "none":
        args += ["--quantization", teacher.quantization]
    if teacher.expert_parallel:
        args.append("--enable-expert-parallel")
    return args


def teacher_lines(config: Config, python: str) -> list[str]:
    """Batch-script lines that split the nodes, start the teacher servers in the background
    (`$teachers`, the srun's pid) and set TRAINER_NODES and TEACHER_URLS."""
    nodes, replicas = config.cluster.teacher_nodes, replicas_per_node(config)
    # --ntasks: a step inherits the job's task count, one per node of the whole job.
    srun = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1"]
    if config.cluster.slurm.cpus_per_node:
        srun.append(f"--cpus-per-task={config.cluster.slurm.cpus_per_node}")
    launcher = [str(TEACHER_LAUNCHER), str(replicas), str(server_tp_size(config))]
    return [
        f"# The first {nodes} node(s) serve the teacher, {replicas} server(s) each; the trainer "
        "runs on the others.",
        'mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f'TEACHER_NODES=$(IFS=,; echo "${{hosts[*]:0:{nodes}}}")',
        f'TRAINER_NODES=$(IFS=,; echo "${{hosts[*]:{nodes}}}")',
        PORT_LINE,
        "urls=()",
        f'for host in "${{hosts[@]:0:{nodes}}}"; do',
        f"    for ((i = 0; i < {replicas}; i++)); do "
        'urls+=("http://$host:$((TEACHER_PORT + i))"); done',
        "done",
        'TEACHER_URLS="[$(IFS=,; echo "${urls[*]}")]"',
        'echo "opd: teacher servers $TEACHER_URLS on $TEACHER_NODES, trainer on $TRAINER_NODES"',
        shlex.join(srun) + ' --nodelist="$TEACHER_NODES" \\',
        f'    {shlex.join(launcher)} "$TEACHER_PORT" {shlex.join([python, *server_args(config)])} &',
        "teachers=$!",
    ]
