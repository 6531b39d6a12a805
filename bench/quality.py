"""Quality study: does on-policy distillation beat the cheaper things a user tries?

    python bench/quality.py [--methods all] [--seeds 0,1,2] [--steps 300] [--eval-every 50]
                            [--lrs 2e-3,4e-3,8e-3] [--jobs 2] [--out runs/quality]
                            [section.key=value ...]
    python bench/quality.py --report-only [--out runs/quality]

The chain world (worlds/toolcalc/chain.py: long dependent chains, informative rejections, a
teacher trained on recoveries the distiller never sees) is its own recipe:

    python bench/quality.py --recipe recipes/toolcalc_chain.yaml --out runs/quality_chain \
        --seeds 0,1,2 --jobs 2

and so is its variant with a learnable recovery, recipes/toolcalc_confirm.yaml, whose checked
world is the override prepare=worlds.toolcalc.prepare:prepare_checked (BENCHMARKS.md).

The harder world (three_hop tasks too, four assistant turns) is the same recipe with its
prepare step and turn limit overridden:

    python bench/quality.py --out runs/quality_hard \
        prepare=worlds.toolcalc.prepare:prepare_hard rollout.max_turns=4

Every method starts from the recipe's warm student and runs the recipe's trainer
(`launch/train.py`, one process) for the same number of optimizer steps with the same prompts
(or conversations) per step; only the loss and where a step's conversations come from differ:

    opd_forward_kl  on-policy, forward KL
    opd_reverse_kl  on-policy, reverse KL
    opd_jsd         on-policy, generalised JSD, beta 0.5
    opd_hybrid_kl   on-policy, forward KL where the teacher's top token has probability >= 0.9,
                    reverse KL elsewhere
    kd_teacher      off-policy, forward KL on conversations the teacher wrote
    kd_oracle       off-policy, forward KL on the dataset's oracle conversations
    sft_teacher     cross-entropy (loss.direction=sft) on the teacher-written conversations
    sft_oracle      cross-entropy on the dataset's oracle conversations (more of the warm start)
    gkd_mix         half of the steps on-policy, half on the teacher-written conversations
    gkd_mix_oracle  half of the steps on-policy, half on the dataset's oracle conversations
                    (the default recipe)
    rl              the task reward alone (GRPO groups of 4, no teacher)
    opd_reward      the sampled-token reverse KL plus the task reward (groups of 4)
                    (train.prompts_per_step=N sets every method's episodes per step; these
                    two sample them as N/4 prompts, 4 times each)
    opd_sampled     the sampled-token reverse KL alone (the teacher read at sampled tokens)
    opd_topk20/64   forward KL against the teacher's top 20 / 64 with a tail bucket

The oracle arms ("if you also have demonstrations") train on the prepared world's clean
demonstrations (data/train.jsonl); every other method has prompts, environment and teacher only.

Teacher-written conversations are sampled once per sampling seed from the teacher on the
recipe's training prompts at the recipe's rollout temperature, tools executed in the sandbox,
and cached as a completions JSONL (`teacher_conversations_seed<S>.jsonl`): each trajectory's
assistant turns become assistant messages (their text, tool calls included, as sampled) and its
observations tool messages (Hermes `<tool_response>` blocks); a conversation is kept only if
`opd.data.completion_trajectory` renders it back to exactly the sampled IDs, and truncated ones
are dropped (counts in `teacher_conversations_seed<S>.json`).

`--start DIR` starts every method from another saved student (a `final/` directory of an
earlier run) instead of the recipe's warm student: the staged pipeline a user runs when the
student must succeed sometimes before RL can learn (off-policy distillation first, then RL or
OPD on top). The world's data, splits and oracle stay the prepared world's; the report names
that student as the start. The start's scores are cached in the --out directory
(references.json) with the teacher's: give each start its own --out.

Hyperparameters are never chosen on the held-out tasks: the curve of success against steps is
measured on a validation split of freshly generated toolcalc tasks (disjoint from held-out,
training and prompt tasks), and held-out greedy success is measured once, on the final student.

Learning rates picked on validation: `--lrs 2e-3,4e-3,8e-3` first runs every method at each
rate with the first seed and measures each final student on a selection split (`--select-tasks`
more new tasks, disjoint from everything above); each method's rate is the one whose student did
best there (the first listed on a tie), written to `selected_lr.json`, and the other seeds run at
it. The report's tables count only the picked rate's runs and list the sweep. Methods run
without `--lrs` keep their own rate (the recipe's, or the method's above).

Writes under --out: `results.jsonl` (one line per method and seed; rerunning skips pairs already
there), `quality.md` (the tables and the targets, bench/quality_report.py), `quality.png`
(validation success against steps and against student episodes, mean over seeds) and each
run's directory under `runs/`. Long (minutes per run): never part of
the test suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from quality_report import read_results, report  # bench/ is on sys.path when run as a script

# Before torch loads OpenMP: threads that spin while waiting for work steal the cores of other
# ranks and tool workers on a shared host (a CPU step measured 5x slower); sleeping costs little.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "toolcalc_tiny.yaml"
TEACHER_CONVERSATIONS = "{teacher_conversations}"
ORACLE = "{oracle}"  # the prepared world's clean demonstrations, data/train.jsonl
# Explicit: the recipe's own default is the GKD mix, which would silently turn OPD into it.
ON_POLICY = "loss.off_policy_fraction=0.0"
SAMPLES_PER_PROMPT = 4
GROUP_PROMPTS = "{group_prompts}"  # the recipe's prompts per step / SAMPLES_PER_PROMPT
GROUPS = (f"rollout.samples_per_prompt={SAMPLES_PER_PROMPT}",
          f"train.prompts_per_step={GROUP_PROMPTS}")
# method -> the config overrides that make it (on top of the recipe and the study's own)
METHODS = {
    "opd_forward_kl": ["loss.direction=forward_kl", ON_POLICY],
    "opd_reverse_kl": ["loss.direction=reverse_kl", ON_POLICY],
    "opd_jsd": ["loss.direction=jsd", "loss.beta=0.5", ON_POLICY],
    "opd_hybrid_kl": ["loss.direction=hybrid_kl", "loss.forward_kl_above=0.9", ON_POLICY],
    "kd_teacher": ["loss.off_policy_fraction=1.0", f"data.completions={TEACHER_CONVERSATIONS}"],
    "kd_oracle": ["loss.off_policy_fraction=1.0", f"data.completions={ORACLE}"],
    "sft_teacher": ["loss.direction=sft", "loss.off_policy_fraction=1.0",
                    f"data.completions={TEACHER_CONVERSATIONS}"],
    "sft_oracle": ["loss.direction=sft", "loss.off_policy_fraction=1.0",
                   f"data.completions={ORACLE}"],
    "gkd_mix": ["loss.off_policy_fraction=0.5", f"data.completions={TEACHER_CONVERSATIONS}"],
    "gkd_mix_oracle": ["loss.off_policy_fraction=0.5", f"data.completions={ORACLE}"],
    # Pure RL and OPD plus reward, as recipes/toolcalc_rl.yaml and toolcalc_opd_reward.yaml (their
    # learning rates were picked on toolcalc's validation split): groups of 4 samples of a quarter
    # of the prompts, so a step samples as many episodes as the others.
    "rl": ["loss.direction=sampled_reverse_kl", "loss.distill_weight=0.0",
           "loss.reward_weight=1.0", "loss.advantage_norm=mean_std", "loss.importance_cap=2.0",
           "optim.lr=2.0e-4", ON_POLICY, *GROUPS],
    "opd_reward": ["loss.direction=sampled_reverse_kl", "loss.kl_estimator=k1",
                   "loss.reward_weight=0.5", "loss.advantage_norm=mean_std",
                   "loss.importance_cap=2.0", "optim.lr=5.0e-4", ON_POLICY, *GROUPS],
    # The sampled-token estimator alone (the teacher read at the student's token only).
    "opd_sampled": ["loss.direction=sampled_reverse_kl", "loss.kl_estimator=k1",
                    "loss.importance_cap=2.0", "optim.lr=5.0e-4", ON_POLICY],
    # Forward KL against the teacher's top-k with a tail bucket: what a served teacher's top-k
    # payload gives (equal to the served scores to 1e-4, tests/test_served_teacher*.py).
    "opd_topk20": ["loss.direction=forward_kl", "teacher.signal=topk", "teacher.top_k=20",
                   ON_POLICY],
    "opd_topk64": ["loss.direction=forward_kl", "teacher.signal=topk", "teacher.top_k=64",
                   ON_POLICY],
}
# Seeds of generate_tasks that prepare does not use (it uses seed + 1..3 with seed 0).
VALIDATION_SEED = 1000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(RECIPE))
    parser.add_argument("--methods", default="all",
                        help=f"comma-separated, from {', '.join(METHODS)}; or all")
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the recipe's)")
    parser.add_argument("--eval-every", type=int, default=50,
                        help="steps between validation evals (0: none)")
    parser.add_argument("--val-tasks", type=int, default=100, help="validation split size")
    parser.add_argument("--lrs", help="comma-separated learning rates to pick each method's "
                                      "from, on the selection split (first seed)")
    parser.add_argument("--select-tasks", type=int, default=400,
                        help="selection split size (with --lrs)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, one thread each (each run's wall s then "
                             "counts the others' load)")
    parser.add_argument("--out", default=str(REPO / "runs" / "quality"))
    parser.add_argument("--start", help="a saved student (an earlier run's final/) every method "
                                        "starts from, instead of the recipe's warm student")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite quality.md and quality.png from results.jsonl")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="recipe overrides applied to every method")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        report(out)
        return
    methods = list(METHODS) if args.methods == "all" else args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        sys.exit(f"error: --methods: unknown method(s) {', '.join(unknown)}; "
                 f"choose from {', '.join(METHODS)}.")
    seeds = [int(seed) for seed in args.seeds.split(",")]

    import torch

    from opd.config import load_config
    from opd.errors import OPDError
    from opd.plugins import prepared, resolve_plugins

    try:
        config = load_config(args.recipe, None, args.overrides)
        grouped = [method for method in methods if set(GROUPS) & set(METHODS[method])]
        if grouped and config.train.prompts_per_step % SAMPLES_PER_PROMPT:  # before preparing
            sys.exit(f"error: train.prompts_per_step={config.train.prompts_per_step} is not a "
                     f"multiple of {SAMPLES_PER_PROMPT}: {', '.join(grouped)} sample each prompt "
                     f"{SAMPLES_PER_PROMPT} times, so their episodes per step would differ from "
                     "the other methods'.")
        plugins = resolve_plugins(config)
        config = prepared(config, plugins)
    except OPDError as error:
        sys.exit(f"error: {error}")
    world = Path(config.model.student).parent  # the prepared world: its data and prepare.json
    if args.start:
        start = Path(args.start).resolve()
        if not (start / "config.json").is_file():
            sys.exit(f"error: --start {args.start}: no saved model there (no config.json); "
                     "give a run's final/ directory.")
        config = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                       student=str(start)))
    torch.set_num_threads(1)  # one run at a time on a shared host; the runs get OMP 1 too
    steps = args.steps or config.train.steps
    validation = write_validation_split(config, world, out, args.val_tasks)
    references = reference_rows(config, plugins, out, validation)
    lrs = [float(lr) for lr in args.lrs.split(",")] if args.lrs else [None]
    selection = write_validation_split(config, world, out, args.select_tasks, validation) \
        if args.lrs else None
    # With --lrs: every rate at the first seed, then the other seeds at each method's pick.
    sweep = [(method, seeds[0], lr) for method in methods for lr in lrs]
    rest = [(method, seed) for seed in seeds[1:] for method in methods]
    # Sampled from the teacher once per seed, before any run that trains on them starts.
    teacher_data = {seed: teacher_conversations(config, plugins, out, seed)
                    for seed in sorted({seed for method, seed, *_ in [*sweep, *rest]
                                        if any(TEACHER_CONVERSATIONS in o
                                               for o in METHODS[method])})}
    written = threading.Lock()

    def one(method: str, seed: int, lr: float | None) -> None:
        if not done(out, method, seed, lr):
            result = run_method(args, config, plugins, world, out, method, seed, lr, steps,
                                validation, teacher_data.get(seed))
            result["references"] = references
            if selection is not None and seed == seeds[0]:  # what the pick reads
                final = out / "runs" / result["run"] / "final"
                result["selection_success"] = evaluate_on(config, plugins, final,
                                                          selection)["success_rate"]
            with written, (out / "results.jsonl").open("a") as results:
                results.write(json.dumps(result) + "\n")
            print(json.dumps({k: result.get(k) for k in ("method", "seed", "lr",
                                                         "selection_success", "heldout_success",
                                                         "wall_s")}), flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        for future in [pool.submit(one, *run) for run in sweep]:
            future.result()
        picked = pick_lrs(out, methods, seeds[0], lrs)
        for future in [pool.submit(one, method, seed, picked[method]) for method, seed in rest]:
            future.result()
    report(out)


def done(out: Path, method: str, seed: int, lr: float | None) -> bool:
    return any((r["method"], r["seed"], r.get("lr")) == (method, seed, lr)
               for r in read_results(out))


def pick_lrs(out: Path, methods: list[str], seed: int, lrs: list) -> dict:
    """Each method's learning rate: the only one, or the swept one whose first-seed student did
    best on the selection split (recorded in selected_lr.json with the scores)."""
    if lrs == [None]:
        return dict.fromkeys(methods)
    scores = {(r["method"], r["lr"]): r["selection_success"] for r in read_results(out)
              if r["seed"] == seed and r.get("selection_success") is not None}
    path = out / "selected_lr.json"
    selected = json.loads(path.read_text()) if path.is_file() else {}
    for method in methods:
        swept = {lr: scores[method, lr] for lr in lrs}
        selected[method] = {"lr": max(swept, key=lambda lr: swept[lr]),
                            "selection_success": {str(lr): score for lr, score in swept.items()}}
    path.write_text(json.dumps(selected, indent=2) + "\n")
    return {method: selected[method]["lr"] for method in methods}


def write_validation_split(config, world: Path, out: Path, count: int,
                           besides: Path | None = None) -> Path:
    """`count` new tasks of the prepared world, none of them a held-out, training or prompt
    question; `besides` (the validation split) given, the selection split, none of those either."""
    from opd.data import load_jsonl, write_jsonl
    from worlds.toolcalc.chain import chain_record, generate_chain_tasks
    from worlds.toolcalc.tasks import generate_tasks, task_record

    path = out / f"{'selection' if besides else 'validation'}_{count}.jsonl"
    seed = VALIDATION_SEED + (besides is not None)
    if not path.is_file():
        seen = frozenset(record["messages"][0]["content"]
                         for data in (config.data.eval, config.data.prompts,
                                      world / "data" / "train.jsonl", *filter(None, [besides]))
                         for record in load_jsonl(data))
        built = json.loads((world / "prepare.json").read_text())["config"]
        if built.get("world") == "chain":
            records = [chain_record(task, built.get("confirm", False),
                                    built.get("checked", False)) for task in
                       generate_chain_tasks(count, seed, exclude=seen)]
        else:  # the prepared world's families (the harder world adds three_hop)
            families = {"families": tuple(built["families"]),
                        "weights": tuple(built["family_weights"])}
            records = [task_record(task) for task in
                       generate_tasks(count, seed, exclude=seen, **families)]
        write_jsonl(path, records)
    return path


def evaluate_on(config, plugins, model_path: str | Path, data: str | Path) -> dict:
    """Greedy metrics of a saved model on a dataset, as the recipe's eval measures them."""
    from opd.eval import evaluate_model, spec_from_config
    from opd.inputs import chat_format, load_prompts

    chat = chat_format(config.tokenizer_path, config.model, str(model_path), "model.tokenizer")
    records = load_prompts(str(data), chat, config.rollout.max_total_len, "data.eval")
    metrics = evaluate_model(model_path, spec_from_config(config, plugins, records))
    metrics.pop("samples", None)
    return metrics


def reference_rows(config, plugins, out: Path, validation: Path) -> dict:
    """Teacher and warm student on held-out and validation tasks (cached)."""
    path = out / "references.json"
    if path.is_file():
        return json.loads(path.read_text())
    rows = {name: {"heldout": evaluate_on(config, plugins, model, config.data.eval),
                   "validation": evaluate_on(config, plugins, model, validation)}
            for name, model in (("teacher", config.model.teacher),
                                ("student", config.model.student))}
    path.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def teacher_conversations(config, plugins, out: Path, seed: int) -> Path:
    """The teacher's sampled conversations on the training prompts, as a completions JSONL
    (opd.teacher_data; kept across runs of the study)."""
    from opd.teacher_data import sample_teacher_data

    path = out / f"teacher_conversations_seed{seed}.jsonl"
    if not path.is_file():
        counts = sample_teacher_data(config, plugins, path, seed, device="cpu")
        print(json.dumps({"teacher_conversations": counts}), flush=True)
    return path


def run_overrides(args, config, world: Path, method: str, seed: int, lr: float | None,
                  steps: int, run_dir: Path, validation: Path, teacher_data: Path | None) -> list[str]:
    """The config overrides of one run, later ones winning: the method's, the study's, the
    user's, then what the study holds fixed (a grouped method's groups, the start, the swept
    rate, the validation split)."""
    def resolve(override: str) -> str:
        return (override.replace(TEACHER_CONVERSATIONS, str(teacher_data))
                .replace(GROUP_PROMPTS, str(config.train.prompts_per_step // SAMPLES_PER_PROMPT))
                .replace(ORACLE, str(world / "data" / "train.jsonl")))

    # A grouped method's split comes after the user's overrides: the user's
    # train.prompts_per_step is every method's episodes per step, which RL samples as groups.
    groups = [resolve(o) for o in METHODS[method] if o in GROUPS]
    overrides = [resolve(o) for o in METHODS[method] if o not in GROUPS] + [
        f"name=quality_{method}", f"seed={seed}", f"train.steps={steps}",
        f"logging.run_dir={run_dir}", "logging.wandb_mode=disabled", "logging.progress=false",
        "checkpoint.every=0", "checkpoint.resume=never",
        f"eval.every={args.eval_every}", "eval.before=false", "eval.after=false",
        "eval.baseline=none", "eval.teacher=false", *args.overrides, *groups,
        *([f"model.student={config.model.student}"] if args.start else []),
        *([] if lr is None else [f"optim.lr={lr}"]),
        # After the user's overrides: one naming data.eval (a world's held-out file) sets what
        # the final student is measured on, never the curve's tasks.
        f"data.eval={validation}"]
    if args.jobs > 1:  # the cores are shared: one thread per run, or they oversubscribe
        overrides.append("cluster.threads_per_rank=1")
    return overrides


def run_method(args, config, plugins, world: Path, out: Path, method: str, seed: int,
               lr: float | None, steps: int, validation: Path, teacher_data: Path | None) -> dict:
    """One training run through launch/train.py (at `lr`, or the method's own rate), then the
    final student on held-out tasks."""
    from opd.metrics import read_metrics

    run_dir = out / "runs" / (f"{method}-seed{seed}" if lr is None else
                              f"{method}-lr{lr:g}-seed{seed}")
    overrides = run_overrides(args, config, world, method, seed, lr, steps, run_dir, validation,
                              teacher_data)
    command = [sys.executable, str(REPO / "launch" / "train.py"), "--recipe", args.recipe,
               *overrides]
    print(f"{method} seed {seed}: {' '.join(command[2:])}", flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall_s = time.perf_counter() - started
    records = read_metrics(run_dir / "metrics.jsonl")
    heldout = evaluate_on(config, plugins, run_dir / "final", config.data.eval)
    curve = [(r["step"], r["eval_success_rate"]) for r in records if "eval_success_rate" in r]
    episodes, samples_curve = 0, []  # validation success against on-policy episodes sampled
    for r in records:
        episodes += 0 if r["off_policy"] else r["conversations"]
        if "eval_success_rate" in r:
            samples_curve.append((episodes, r["eval_success_rate"]))
    return {
        "method": method, "seed": seed, "lr": lr, "steps": steps, "overrides": overrides,
        "run": run_dir.name, "start": args.start,
        "heldout_success": heldout["success_rate"],
        "heldout_tool_call_validity": heldout["tool_call_validity"],
        "heldout_truncation_rate": heldout["truncation_rate"],
        "heldout_per_group": {group: rates["success_rate"]
                              for group, rates in heldout.get("per_group", {}).items()},
        "heldout_rejected_call_rate": heldout.get("rejected_call_rate"),
        "heldout_success_after_rejection": heldout.get("success_after_rejection"),
        "heldout": heldout, "validation_curve": curve, "samples_curve": samples_curve,
        "student_episodes": episodes,
        "student_tokens_trained": sum(r["target_tokens"] for r in records),
        "teacher_tokens_scored": sum(r["teacher_tokens"] for r in records),
        "rollout_s": round(sum(r["rollout_s"] for r in records), 1),
        "train_steps_s": round(sum(r["step_s"] for r in records), 1),
        "wall_s": round(wall_s, 1), "jobs": args.jobs,
    }


if __name__ == "__main__":
    main()
