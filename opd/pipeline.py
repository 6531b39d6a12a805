"""The composition root of a run, top-down:

    config   recipe < cluster file < key=value overrides, every value checked (opd.config)
    plugins  prepare, tools, parser and checker resolved by name (opd.plugins)
    world    process group of the launcher's ranks (opd.dist)
    prepare  the recipe's world, built once per node and cached (its "{prepared}" paths)
    inputs   tokenizer, vocabularies and datasets checked against the budgets (opd.inputs)
    preflight  the run directory is this run's and writable, wandb can log (opd.preflight)
    engines  every engine's own checks of the config and files: the student backend's, the
             sampler's, the teacher's (DeepSpeed JSON, vLLM servability, tensor-parallel sizes)
    eval     teacher and student before training, on rank 0 (opd.eval)
    train    the OPD loop (opd.trainer)
    eval     the trained student
    baseline the control arm of eval.baseline (SFT or KD on data.completions), trained and
             evaluated the same way, then the teacher / before / after / baseline table and
             eval.json

Every user mistake is an `OPDError` and ends the run in one sentence; all of them that can be
known before an engine starts (everything up to `engines`) are found then, before any
evaluation.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: threads that spin while waiting for work steal the cores of other
# ranks and tool workers on a shared host (a CPU step measured 5x slower); sleeping costs little.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import faulthandler
import json
import signal
import sys
from pathlib import Path

from opd import preemption, preflight
from opd.backends import check_student
from opd.config import Config, LossConfig, load_config, to_yaml
from opd.dist import World, barrier, init_world, shutdown
from opd.errors import OPDError
from opd.eval import evaluate_model, improvement_line, results_table, spec_from_config
from opd.inputs import RunInputs, load_inputs
from opd.plugins import Plugins, prepared, resolve_plugins
from opd.sampling.base import sampler_class
from opd.teachers.base import teacher_class
from opd.trainer import train

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO / "recipes" / "toolcalc_tiny.yaml"
DEFAULT_CLUSTER = REPO / "configs" / "clusters" / "local-cpu.yaml"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        config = load_config(args.recipe, args.cluster, args.overrides)
        plugins = resolve_plugins(config)
        if args.dry_run:
            print(dry_run(config, plugins))
            return
        preemption.install()  # SIGUSR1 / SIGTERM: checkpoint at the next step boundary, requeue
        # A rank that hangs: `kill -QUIT PID` prints every thread's stack, and the rank goes on.
        faulthandler.register(signal.SIGQUIT, all_threads=True)
        world = init_world(config.cluster.device, config.cluster.dist_backend,
                           config.cluster.threads_per_rank)
        try:
            run(config, plugins, world)
        finally:
            shutdown()
    except OPDError as error:
        sys.exit(f"error: {error}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a student by on-policy distillation.")
    parser.add_argument("--recipe", default=str(DEFAULT_RECIPE), help="recipe YAML")
    parser.add_argument("--cluster", default=str(DEFAULT_CLUSTER), help="cluster YAML")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved config, world layout and memory estimate")
    # The deepspeed launcher appends --local_rank; the rank is read from the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser.parse_args(argv)


def run(config: Config, plugins: Plugins, world: World) -> dict[str, dict]:
    """prepare -> inputs -> eval teacher and student -> OPD -> eval the trained student -> table."""
    config = prepare(config, plugins, world)
    inputs = load_inputs(config)
    config = preflight.check(config, world)  # run dir, writability, wandb, before any engine
    check_engines(config, world)
    rows: dict[str, dict] = {}
    if config.eval.before:
        if evaluates_teacher(config, world):
            rows["teacher"] = evaluate(config, plugins, inputs, world, config.model.teacher,
                                       "model.teacher")
        rows["before"] = evaluate(config, plugins, inputs, world, config.model.student,
                                  "model.student")
    barrier()
    final = train(config, plugins, inputs, world)
    if final is None:  # stopped early to be requeued; the resumed run evaluates
        return rows
    if config.eval.after:
        rows["after"] = evaluate(config, plugins, inputs, world, final, "trained student")
    if config.eval.baseline != "none":
        control = baseline_config(config)
        final = train(control, plugins, inputs, world)
        if final is None:
            return rows
        rows[config.eval.baseline] = evaluate(control, plugins, inputs, world, final,
                                              f"{config.eval.baseline} baseline")
    rows = {label: metrics for label, metrics in rows.items() if metrics}
    if rows:  # rank 0 only: the others evaluate nothing
        (config.run_dir / "eval.json").write_text(json.dumps(rows, indent=2) + "\n")
        print(results_table(rows), flush=True)
        if "before" in rows and "after" in rows:
            print(improvement_line(rows["before"], rows["after"]), flush=True)
        if "after" in rows and config.eval.baseline in rows:
            print(improvement_line(rows[config.eval.baseline], rows["after"],
                                   config.eval.baseline), flush=True)
    barrier()
    return rows


def baseline_config(config: Config) -> Config:
    """eval.baseline's control arm: the run's warm student, steps, optimizer, batch and seed,
    trained on data.completions only (SFT on their tokens, or KD: forward KL to the teacher's
    distribution on them), in its own run directory under the run's, where it resumes too."""
    kind = config.eval.baseline
    loss = LossConfig(direction="sft" if kind == "sft" else "forward_kl",
                      off_policy_fraction=1.0, temperature=config.loss.temperature,
                      chunk_size=config.loss.chunk_size)
    return dataclasses.replace(
        config, name=f"{config.name}-{kind}", loss=loss,
        logging=dataclasses.replace(config.logging,
                                    run_dir=str(config.run_dir / f"baseline_{kind}")),
        # A resume path names the run's own checkpoint, never the control arm's.
        checkpoint=dataclasses.replace(
            config.checkpoint, resume="never" if config.checkpoint.resume == "never" else "auto"),
        eval=dataclasses.replace(config.eval, every=0))


def evaluates_teacher(config: Config, world: World) -> bool:
    """Whether the teacher gets its row of the results table. A served teacher's does not: its
    weights are on its servers because they do not fit beside the student, and the servers
    score, they do not generate (one sentence says so)."""
    if not (config.eval.teacher and config.model.teacher):
        return False
    if teacher_class(config.teacher.engine).in_trainer:
        return True
    if world.is_main:
        print(f"eval: no teacher row: teacher.engine={config.teacher.engine} keeps the teacher "
              "on its servers, which score and do not generate; evaluate it apart with "
              f"`python -m opd.eval --model {config.model.teacher} --recipe RECIPE` where it "
              "fits (eval.teacher=false silences this).", file=sys.stderr, flush=True)
    return False


def check_engines(config: Config, world: World) -> None:
    """The checks each engine makes of the config and files alone, before any engine starts."""
    check_student(config.student)
    sampler_class(config.rollout.engine).check(config, world)
    if config.loss.needs_teacher or config.eval.baseline == "kd":
        teacher_class(config.teacher.engine).check(config, world)


def prepare(config: Config, plugins: Plugins, world: World) -> Config:
    """The recipe's prepare step: one builder per node, the node's other ranks reuse its cache."""
    if world.local_rank == 0:
        config = prepared(config, plugins)
    barrier()
    return config if world.local_rank == 0 else prepared(config, plugins)


def evaluate(config: Config, plugins: Plugins, inputs: RunInputs, world: World,
             model_path: str | Path, key: str) -> dict:
    """Held-out metrics of a saved model on rank 0 ({} elsewhere or without data.eval)."""
    if not (world.is_main and inputs.eval_records):
        return {}
    metrics = evaluate_model(model_path, spec_from_config(config, plugins, inputs.eval_records),
                             device=world.device, key=key,
                             progress=f"eval {key}" if config.logging.progress else None)
    metrics.pop("samples", None)
    return metrics


def dry_run(config: Config, plugins: Plugins) -> str:
    """The resolved config, the world layout and per-rank memory; builds and starts nothing."""
    from opd.backends.memory import memory_estimate
    from opd.plugins import code_keys

    sampler_class(config.rollout.engine).check_installed()  # what a real run says first
    config = prepared(config, plugins, build=False)
    launched = "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if launched else \
        config.cluster.nodes * config.cluster.procs_per_node
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if launched else \
        config.cluster.procs_per_node
    device = config.cluster.device
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tp_size = config.teacher.tp_size or per_node
    teacher_layout = {"zero_inference": f"ZeRO-3 partitioned over {world} ranks",
                      "tensor_parallel": f"tensor parallel, tp_size {tp_size} "
                                         f"({max(1, world // tp_size)} copies)",
                      "replicated": "one full copy per rank",
                      "served": f"its own servers on {config.cluster.teacher_nodes} further "
                                "node(s) of the job" if config.cluster.teacher_nodes else
                                "its own servers at teacher.urls"}.get(config.teacher.engine,
                                                                       config.teacher.engine)
    return "\n".join([
        to_yaml(config).rstrip(),
        "",
        f"world: {world} ranks = {max(1, world // per_node)} node(s) x {per_node} per node, "
        f"device {device} ({'from the launcher' if launched else 'planned by the cluster file'})",
        f"student: {config.student.backend}, data parallel over {world} ranks, "
        f"{config.train.prompts_per_step} prompts per step "
        f"(~{-(-config.train.prompts_per_step // world)} per rank)",
        f"teacher: {config.teacher.engine}, {teacher_layout}" if config.loss.needs_teacher
        else "teacher: none started (the loss reads no teacher)",
        "memory per rank (estimate; terms in opd/backends/memory.py):",
        *(f"  {line}" for line in memory_estimate(config, world, device, tp_size)),
        "code this recipe names (recipes are code: --dry-run imported these modules, running "
        "their top-level code, and called prepare(build=False) and tools.registry):",
        *(f"  {line}" for line in code_keys(config) or ["none (no plugin keys set)"]),
        f"  packages first imported by them: {', '.join(plugins.imported) or 'none'}",
    ])
