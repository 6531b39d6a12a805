"""Submit a training run to Slurm.

    python launch/submit.py --cluster C --recipe R [section.key=value ...] [--dry-run] [--wait]
    opd-submit ...          (the installed name)

Writes `<run_dir>/submit.sbatch` from the resolved config (the cluster file's `cluster.slurm`
section holds the sbatch options) and submits it with `sbatch`; `--dry-run` prints it instead.
The job starts one launcher per node with `srun` (launch/slurm/node.sh: torchrun with a static
rendezvous on the first node); every node runs the same `launch/train.py` with the same
arguments. Slurm sends USR1 `cluster.slurm.signal_seconds` before the time limit: the ranks
checkpoint at the next step boundary and requeue the job, which resumes from that checkpoint.

A served teacher with `cluster.teacher_nodes: T` gets the job's first T nodes
(opd.slurm_teachers): each runs `gpus_per_node / teacher.tp_size` teacher servers
(launch/slurm/teachers.sh), the trainer runs on the other `cluster.nodes` with their URLs as
`teacher.urls`, and waits for them to answer /health (opd.teachers.served).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from opd.config import load_config
from opd.errors import ConfigError, OPDError
from opd.slurm_teachers import check_teacher_nodes, teacher_lines

REPO = Path(__file__).resolve().parents[1]

TRAIN_SCRIPT = REPO / "launch" / "train.py"
NODE_LAUNCHER = REPO / "launch" / "slurm" / "node.sh"
SBATCH_FILE = "submit.sbatch"


def _directives(config, workdir: Path) -> list[str]:
    slurm = config.cluster.slurm
    run_dir = workdir / config.run_dir
    nodes = config.cluster.nodes + config.cluster.teacher_nodes
    options = [f"--job-name={config.name}", f"--nodes={nodes}",
               "--ntasks-per-node=1", f"--time={slurm.time}",
               f"--output={run_dir / 'slurm-%j.out'}", "--open-mode=append",  # one log per job id
               f"--chdir={workdir}", "--requeue" if slurm.requeue else "--no-requeue"]
    named = {"partition": slurm.partition, "account": slurm.account, "qos": slurm.qos,
             "constraint": slurm.constraint, "mem": slurm.mem}
    options += [f"--{name}={value}" for name, value in named.items() if value]
    if slurm.cpus_per_node:
        options.append(f"--cpus-per-task={slurm.cpus_per_node}")
    if slurm.gpus_per_node:
        options.append(f"--gpus-per-node={slurm.gpus_per_node}")
    if slurm.exclusive:
        options.append("--exclusive")
    if slurm.signal_seconds:
        options.append(f"--signal=USR1@{slurm.signal_seconds}")
    return [f"#SBATCH {_quoted(option)}" for option in options] + \
        [f"#SBATCH {option}" for option in slurm.sbatch_args]


def _quoted(option: str) -> str:
    """sbatch splits #SBATCH lines at whitespace unless the value is in double quotes."""
    name, _, value = option.partition("=")
    return f'{name}="{value}"' if any(c.isspace() for c in value) else option


def _exports(env: dict) -> list[str]:
    """`export` lines; opd.config has checked the names and that the values are scalars."""
    return [f"export {name}={shlex.quote(str(value))}" for name, value in env.items()]


def sbatch_script(config, recipe: Path, cluster: Path, overrides: list[str], *,
                  workdir: Path, python: str) -> str:
    """The sbatch file of a run: `config` resolved from `recipe`, `cluster` and `overrides`."""
    slurm = config.cluster.slurm
    train = [str(NODE_LAUNCHER), str(config.cluster.procs_per_node), slurm.python or python,
             str(TRAIN_SCRIPT), "--recipe", str(recipe), "--cluster", str(cluster), *overrides]
    srun = ["srun", f"--nodes={config.cluster.nodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1"]
    if slurm.cpus_per_node:  # srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05)
        srun.append(f"--cpus-per-task={slurm.cpus_per_node}")
    served = config.cluster.teacher_nodes > 0
    if served:
        layout = teacher_lines(config, slurm.python or python)  # sets TRAINER_NODES, TEACHER_URLS
        first_node = 'MASTER_ADDR=${TRAINER_NODES%%,*}'
        # --ntasks: a step inherits the job's task count (every node's), which is more than the
        # trainer's nodes alone would take.
        srun_line = shlex.join([*srun, f"--ntasks={config.cluster.nodes}"]) + \
            ' --nodelist="$TRAINER_NODES" \\'
        train_line = "    " + shlex.join(train) + ' "teacher.urls=$TEACHER_URLS" || status=$?'
        ending = ["# The trainer is done (or failed): srun passes TERM on to the teacher servers.",
                  'kill "$teachers" 2>/dev/null || true', 'wait "$teachers" || true',
                  'exit "$status"']
    else:
        layout, ending = [], []
        first_node = 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
        srun_line, train_line = shlex.join(srun) + " \\", "    " + shlex.join(train)
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# Written by launch/submit.py for run '{config.name}'; submit it again with sbatch.",
        *_directives(config, workdir),
        "set -eo pipefail",  # not -u: module and venv scripts may read unset variables
        *slurm.setup,
        *_exports(slurm.env),
        *layout,
        "# Rendezvous on the trainer's first node; the port follows the job id, so concurrent jobs",
        "# sharing a node differ and a requeued job keeps its own.",
        first_node,
        "MASTER_PORT=$((15000 + SLURM_JOB_ID % 15000))  # below the ephemeral range",
        "export MASTER_ADDR MASTER_PORT",
        'echo "opd: job $SLURM_JOB_ID start $((${SLURM_RESTART_COUNT:-0} + 1)) on '
        '$SLURM_JOB_NODELIST, rendezvous $MASTER_ADDR:$MASTER_PORT"',
        *(["status=0"] if served else []),
        srun_line,
        train_line,
        *ending,
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", required=True, help="cluster YAML with a cluster.slurm section")
    parser.add_argument("--recipe", required=True, help="recipe YAML")
    parser.add_argument("--dry-run", action="store_true", help="print the sbatch file, submit nothing")
    parser.add_argument("--wait", action="store_true",
                        help="return when the job ends (requeues included), with its exit status")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)

    recipe, cluster = Path(args.recipe).resolve(), Path(args.cluster).resolve()
    workdir = Path.cwd()
    try:
        config = load_config(recipe, cluster, args.overrides)
        check_teacher_nodes(config)
        if config.cluster.slurm.requeue and config.checkpoint.resume == "never":
            raise ConfigError("checkpoint.resume=never would restart a requeued job from step 0; "
                              "use auto, or set cluster.slurm.requeue: false.")
        script = sbatch_script(config, recipe, cluster, args.overrides, workdir=workdir,
                               python=sys.executable)
    except OPDError as error:
        sys.exit(f"error: {error}")
    if args.dry_run:
        print(script, end="")
        return 0

    run_dir = workdir / config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)  # sbatch needs the log's directory to exist
    path = run_dir / SBATCH_FILE
    path.write_text(script)
    command = ["sbatch", "--parsable", *(["--wait"] if args.wait else []), str(path)]
    try:
        submitted = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    except FileNotFoundError:
        sys.exit(f"error: sbatch is not on PATH; {path} is written, submit it from a Slurm "
                 "login node.")
    assert submitted.stdout is not None  # stdout=PIPE
    job = submitted.stdout.readline().strip().split(";")[0]
    if job:
        print(f"Submitted {path} as job {job}. Watch: squeue -j {job}; "
              f"log: {run_dir / f'slurm-{job}.out'}; stop: scancel {job}.", flush=True)
    return submitted.wait()


if __name__ == "__main__":
    sys.exit(main())
