"""Train a student by on-policy distillation.

    deepspeed launch/train.py [--recipe R] [--cluster C] [section.key=value ...] [--dry-run]

The same command runs under `torchrun`, `srun` and plain `python` (one process). With no
arguments it runs the default recipe (recipes/toolcalc_tiny.yaml) on the local CPU cluster file:
prepare (cached) -> eval before -> OPD -> eval after -> the teacher / before / after table.
`--dry-run` prints the resolved config, the world layout and per-rank memory, then exits.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Before torch loads OpenMP: threads that spin while waiting for work steal the cores of other
# ranks and tool workers on a shared host (a CPU step measured 5x slower); sleeping costs little.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `opd` and `recipes` import from a plain checkout

DEFAULT_RECIPE = REPO / "recipes" / "toolcalc_tiny.yaml"
DEFAULT_CLUSTER = REPO / "configs" / "clusters" / "local-cpu.yaml"


def cached_prepare(config):
    """`config` with "{prepared}" resolved when the prepare step's output is cached already."""
    from opd.config import with_prepared
    from opd.eval import resolve

    if not config.prepare:
        return config
    prepared = resolve(config.prepare, "prepare")(build=False)
    return config if prepared is None else with_prepared(config, getattr(prepared, "root", prepared))


def dry_run(config) -> str:
    from opd.backends.memory import memory_estimate
    from opd.config import to_yaml

    config = cached_prepare(config)

    launched = "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if launched else \
        config.cluster.nodes * config.cluster.procs_per_node
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if launched else \
        config.cluster.procs_per_node
    device = config.cluster.device
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    teacher_layout = {"zero_inference": f"ZeRO-3 partitioned over {world} ranks",
                      "tensor_parallel": f"tensor parallel, tp_size {world}",
                      "replicated": "one full copy per rank"}[config.teacher.engine]
    return "\n".join([
        to_yaml(config).rstrip(),
        "",
        f"world: {world} ranks = {max(1, world // per_node)} node(s) x {per_node} per node, "
        f"device {device} ({'from the launcher' if launched else 'planned by the cluster file'})",
        f"student: {config.student.backend}, data parallel over {world} ranks, "
        f"{config.train.prompts_per_step} prompts per step "
        f"(~{-(-config.train.prompts_per_step // world)} per rank)",
        f"teacher: {config.teacher.engine}, {teacher_layout}",
        "memory per rank (model states, estimate):",
        *(f"  {line}" for line in memory_estimate(config, world, device)),
    ])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(DEFAULT_RECIPE), help="recipe YAML")
    parser.add_argument("--cluster", default=str(DEFAULT_CLUSTER), help="cluster YAML")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved config, world layout and memory estimate")
    # The deepspeed launcher appends --local_rank; the rank is read from the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)

    from opd.checkpoint import CheckpointError
    from opd.config import ConfigError, load_config
    from opd.data import DatasetError
    from opd.teacher import VocabularyError

    try:
        config = load_config(args.recipe, args.cluster, args.overrides)
        if args.dry_run:
            print(dry_run(config))
            return
        from opd import preemption
        from opd.dist import init_world, shutdown
        from opd.trainer import run_recipe

        preemption.install()  # SIGUSR1 / SIGTERM: checkpoint at the next step boundary, requeue
        world = init_world(config.cluster.device, config.cluster.dist_backend,
                           config.cluster.threads_per_rank)
        try:
            run_recipe(config, world)
        finally:
            shutdown()
    except (ConfigError, DatasetError, VocabularyError, CheckpointError,
            FileNotFoundError) as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
    # Done: logs closed, wandb finished, process groups destroyed. Skip interpreter finalization,
    # where engine threads torn down by C++ static destructors aborted 2 of ~45 completed 2-rank
    # CPU runs here (SIGABRT, "terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
