"""The quality study's report: quality.md and quality.png from results.jsonl (bench/quality.py).

    python bench/quality.py --report-only --out runs/quality_chain
    python bench/quality_report.py --out runs/confirm --studies runs/a,runs/b --seeds 3,4,5

The second form reports several studies of one world together (each method from one of them,
at its own picked rate), restricted to the given seeds: a confirmation on fresh seeds reads
only those.

Standard errors: a method's held-out success is the mean over its seeds; its standard error
combines the tasks' binomial noise and the seeds' spread (the larger of the pooled binomial SE,
sqrt(p(1-p)/(tasks x seeds)), and the seeds' SE, stdev/sqrt(seeds)), so one seed still gets an
honest error bar. A difference's SE is sqrt(SE_a^2 + SE_b^2).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

# Families of methods, for the targets (issue 24): what a distiller without demonstrations can
# run off-policy (teacher-written conversations), and on-policy distillation.
TEACHER_OFF_POLICY = ("sft_teacher", "kd_teacher")
# Half its steps on-policy, half on the teacher's conversations: neither family, reported apart.
MIXED = ("gkd_mix",)
OPD = ("opd_forward_kl", "opd_reverse_kl", "opd_jsd", "opd_hybrid_kl", "opd_sampled",
       "opd_reward", "opd_topk20", "opd_topk64")
RL = "rl"


def read_results(out: Path) -> list[dict]:
    path = out / "results.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_dir(result: dict) -> Path:
    """A counted result's run directory (results from before learning-rate sweeps name no
    `run`)."""
    return Path(result["study"]) / "runs" / result.get("run",
                                                        f"{result['method']}-seed{result['seed']}")


def counted(out: Path, results: list[dict]) -> list[dict]:
    """The results the tables count: of a method whose learning rate was swept, only the runs
    at its picked rate (selected_lr.json)."""
    path = out / "selected_lr.json"
    selected = json.loads(path.read_text()) if path.is_file() else {}
    return [r for r in results
            if r["method"] not in selected or r.get("lr") == selected[r["method"]]["lr"]]


def success_se(runs: list[dict]) -> tuple[float, float]:
    """(mean held-out success over seeds, its standard error; see the module docstring)."""
    rates = [r["heldout_success"] for r in runs]
    mean = statistics.mean(rates)
    tasks = runs[0]["heldout"]["num_tasks"] * len(runs)
    binomial = math.sqrt(max(mean * (1 - mean), 1e-12) / tasks)
    seeds = statistics.stdev(rates) / math.sqrt(len(rates)) if len(rates) > 1 else 0.0
    return mean, max(binomial, seeds)


def _cell(value: float | None, digits: int = 3) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _mean(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.mean(present) if present else None


def load(studies: list[Path], seeds: set[int] | None = None) -> list[dict]:
    """The counted results of one or more studies of one world (of `seeds` only, if given),
    each tagged with its study; a study without results, a method in two studies or studies
    of different worlds exit with the reason."""
    rows: list[dict] = []
    owner: dict[str, Path] = {}
    for study in studies:
        results = read_results(study)
        if not results:
            sys.exit(f"error: {study / 'results.jsonl'} holds no results yet.")
        for result in counted(study, results):
            if seeds is not None and result["seed"] not in seeds:
                continue
            if owner.setdefault(result["method"], study) != study:
                sys.exit(f"error: {result['method']} has results in both {owner[result['method']]} "
                         f"and {study}; report each study on its own.")
            rows.append(dict(result, study=str(study)))
    settings = {(json.dumps(r["references"]["teacher"]["heldout"], sort_keys=True), r["steps"])
                for r in rows}
    if len(settings) > 1:
        sys.exit(f"error: {', '.join(map(str, studies))} differ in teacher, held-out tasks or "
                 "optimizer steps; only studies of one setting can be reported together.")
    if not rows:
        sys.exit(f"error: no results of seeds {sorted(seeds or [])} in {', '.join(map(str, studies))}.")
    return rows


def report(out: Path, studies: list[Path] | None = None, seeds: set[int] | None = None) -> None:
    """quality.md and quality.png in `out` from the results of `studies` (default: `out`)."""
    studies = studies or [out]
    by_method: dict[str, list[dict]] = {}
    for result in load(studies, seeds):
        by_method.setdefault(result["method"], []).append(result)
    first = next(iter(by_method.values()))[-1]
    references = first["references"]
    # bench/quality.py --start: every method began from an earlier run's student, not the warm one.
    start = f"student of {first['start']}" if first.get("start") else "warm student"
    lines = [
        f"Held-out greedy success on {references['teacher']['heldout']['num_tasks']} tasks after "
        f"{first['steps']} optimizer steps (mean over seeds ± standard error).", "",
        "| method | seeds | held-out success | tasks with a rejected call | success after one "
        "| truncation | student episodes | student tokens trained | teacher tokens scored | "
        "wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in ("teacher", "student"):
        held = references[name]["heldout"]
        label = "teacher" if name == "teacher" else f"{start} (start)"
        lines.append(f"| {label} | | {held['success_rate']:.3f} | "
                     f"{_cell(held.get('rejected_call_rate'))} | "
                     f"{_cell(held.get('success_after_rejection'))} | "
                     f"{held['truncation_rate']:.3f} | | | | |")
    for method, runs in by_method.items():
        mean, se = success_se(runs)
        lines.append(
            f"| {method} | {len(runs)} | {mean:.3f} ± {se:.3f} | "
            f"{_cell(_mean([r.get('heldout_rejected_call_rate') for r in runs]))} | "
            f"{_cell(_mean([r.get('heldout_success_after_rejection') for r in runs]))} | "
            f"{statistics.mean(r['heldout_truncation_rate'] for r in runs):.3f} | "
            f"{statistics.mean(r.get('student_episodes', 0) for r in runs):,.0f} | "
            f"{statistics.mean(r['student_tokens_trained'] for r in runs):,.0f} | "
            f"{statistics.mean(r['teacher_tokens_scored'] for r in runs):,.0f} | "
            f"{statistics.mean(r['wall_s'] for r in runs):.0f} |")
    lines += _group_table(by_method, references) + _targets(by_method, references, start)
    lines += _sweep_table(studies)
    lines += _on_policy_table(by_method)
    if seeds is not None:
        lines += ["", f"Seeds counted: {', '.join(map(str, sorted(seeds)))}; studies: "
                  f"{', '.join(map(str, studies))}."]
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(by_method, references, out / "quality.png")


def _group_table(by_method: dict[str, list[dict]], references: dict) -> list[str]:
    groups = sorted(references["teacher"]["heldout"].get("per_group", {}))
    lines = ["", "Held-out success per task group (for the chain world: per horizon, the number "
             "of tool calls; mean over seeds):", "",
             "| method | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
    for name in ("teacher", "student"):
        per_group = references[name]["heldout"]["per_group"]
        lines.append(f"| {name} | " + " | ".join(f"{per_group[g]['success_rate']:.3f}"
                                                  for g in groups) + " |")
    for method, runs in by_method.items():
        lines.append(f"| {method} | " + " | ".join(
            f"{statistics.mean(r['heldout_per_group'].get(g, 0.0) for r in runs):.3f}"
            for g in groups) + " |")
    return lines


def _targets(by_method: dict[str, list[dict]], references: dict, start_name: str) -> list[str]:
    """The issue's two targets, read off the results: best OPD (and, apart, the on-policy /
    teacher-data mix) against the best teacher-only off-policy method (in SEs of the difference),
    and OPD's student episodes to reach RL's final validation success (the start's
    validation success is the curves' point at 0)."""
    def best(names: tuple[str, ...]) -> str | None:
        present = [n for n in names if n in by_method]
        return max(present, key=lambda n: success_se(by_method[n])[0]) if present else None

    opd, off = best(OPD), best(TEACHER_OFF_POLICY)
    lines = []
    for arm, label in ((opd, "best OPD"), (best(MIXED), "on-policy steps mixed into the teacher's "
                                                        "conversations")):
        if arm and off:
            (a, se_a), (b, se_b) = success_se(by_method[arm]), success_se(by_method[off])
            z = (a - b) / math.sqrt(se_a ** 2 + se_b ** 2)
            lines.append(f"- {label} ({arm}) {a:.3f} against the best teacher-data off-policy "
                         f"method ({off}) {b:.3f}: difference {a - b:+.3f}, {z:+.1f} standard "
                         "errors (target: at least +2).")
    if opd and RL in by_method:
        rl_final = statistics.mean(r["samples_curve"][-1][1] for r in by_method[RL]
                                   if r.get("samples_curve"))
        rl_episodes = statistics.mean(r["student_episodes"] for r in by_method[RL])
        validation = references["student"]["validation"]
        start, tasks = validation["success_rate"], validation["num_tasks"]
        # Two binomial SEs of the difference between the start and RL's mean over its seeds.
        noise = 2 * math.sqrt(start * (1 - start) / tasks
                              + rl_final * (1 - rl_final) / (tasks * len(by_method[RL])))
        reached = _episodes_to_reach(by_method[opd], rl_final)
        line = (f"- RL's final validation success {rl_final:.3f} after {rl_episodes:,.0f} "
                f"student episodes")
        if rl_final - start <= noise:
            # Reaching the start is no achievement: say RL did not learn instead of a ratio.
            line += (f" is within two standard errors of the {start_name}'s {start:.3f}: RL "
                     "did not learn, so the samples target cannot be read off this study")
            line += f" ({opd} passes it after {reached:,.0f})." if reached else "."
        else:
            line += "; " + (f"{opd} reaches it after {reached:,.0f} "
                            f"({rl_episodes / reached:.1f}x fewer; target: at least 5x)."
                            if reached else f"{opd} never reaches it in its run.")
        lines.append(line + _reward_signal(by_method[RL]))
    return ["", "Targets:", "", *lines] if lines else []


def _sweep_table(studies: list[Path]) -> list[str]:
    selected = {method: pick for study in studies if (study / "selected_lr.json").is_file()
                for method, pick in json.loads((study / "selected_lr.json").read_text()).items()}
    if not selected:
        return []
    lrs = sorted({lr for pick in selected.values() for lr in pick["selection_success"]},
                 key=float)
    lines = ["", "Learning rates: each method's first-seed student on the selection split "
             "(greedy success), the picked rate in bold:", "",
             "| method | " + " | ".join(lrs) + " |", "|---|" + "---|" * len(lrs)]
    for method, pick in selected.items():
        cells = [pick["selection_success"].get(lr) for lr in lrs]
        lines.append(f"| {method} | " + " | ".join(
            "" if score is None else f"**{score:.3f}**" if float(lr) == pick["lr"]
            else f"{score:.3f}" for lr, score in zip(lrs, cells)) + " |")
    return lines


def _episodes_to_reach(runs: list[dict], level: float) -> float | None:
    """The first evaluated point of the seeds' mean validation curve at or above `level`."""
    curves = [r["samples_curve"] for r in runs if r.get("samples_curve")]
    if not curves:
        return None
    for points in zip(*curves):
        if statistics.mean(p[1] for p in points) >= level:
            return statistics.mean(p[0] for p in points)
    return None


def _reward_signal(runs: list[dict]) -> str:
    """How often RL's groups carried any signal: a step whose groups all got the same reward
    has zero advantage everywhere, so RL takes no gradient from it."""
    paths = [run_dir(run) / "metrics.jsonl" for run in runs]
    steps = [r for path in paths for r in _read_metrics(path) if "advantage_std" in r]
    if not steps:
        return ""
    signal = sum(r["advantage_std"] > 0 for r in steps) / len(steps)
    return f" Steps with any reward signal (advantage std > 0): {signal:.0%}."


def _on_policy_table(by_method: dict[str, list[dict]]) -> list[str]:
    lines = ["", "The student's own rollouts during on-policy steps (from the metrics.jsonl of "
             "each run whose directory is in its study; mean over those runs): tool calls that "
             "were invalid or failed per conversation, and the truncation rate, over the first "
             "and the last 50 steps:", "",
             "| method | runs | bad calls / conv., first 50 | last 50 | truncated, first 50 | "
             "last 50 |", "|---|---|---|---|---|---|"]
    for method, runs in by_method.items():
        phases = [on_policy_errors(run_dir(r) / "metrics.jsonl") for r in runs]
        measured = [phase for phase in phases if phase is not None]
        if measured:
            lines.append(f"| {method} | {len(measured)} | " + " | ".join(
                f"{statistics.mean(phase[i] for phase in measured):.3f}" for i in range(4)) + " |")
    return lines


def on_policy_errors(metrics: Path, window: int = 50) -> tuple[float, ...] | None:
    """(bad calls per conversation, truncation rate) of the on-policy steps among the first and
    the last `window` steps: (bad first, bad last, truncated first, truncated last)."""
    records = _read_metrics(metrics)
    first = [r for r in records[:window] if not r["off_policy"]]
    last = [r for r in records[-window:] if not r["off_policy"]]
    if not first or not last:
        return None

    def bad(steps: list[dict]) -> float:
        return sum(r["invalid_tool_calls"] + r["failed_tool_calls"] for r in steps) \
            / sum(r["conversations"] for r in steps)

    def truncated(steps: list[dict]) -> float:
        return statistics.mean(r["truncation_rate"] for r in steps)

    return bad(first), bad(last), truncated(first), truncated(last)


def _read_metrics(path: Path) -> list[dict]:
    """A run's step records, or [] where the run left no metrics file."""
    from opd.metrics import read_metrics

    return read_metrics(path) if path.is_file() else []


def plot(by_method: dict[str, list[dict]], references: dict, path: Path) -> None:
    """Validation success against optimizer steps and against on-policy student episodes,
    mean over seeds, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_samples) = plt.subplots(1, 2, figsize=(13, 4.8))
    start = references["student"]["validation"]["success_rate"]
    teacher = references["teacher"]["validation"]["success_rate"]
    for method, runs in by_method.items():
        curves = [dict(r["validation_curve"]) for r in runs if r["validation_curve"]]
        if curves:
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            by_step.plot([0, *steps], [start, *(statistics.mean(c[s] for c in curves)
                                                for s in steps)],
                         marker="o", label=f"{method} (n={len(curves)})")
        samples = [r["samples_curve"] for r in runs if r.get("samples_curve")]
        if samples and any(p[0] for p in samples[0]):
            points = list(zip(*samples))
            by_samples.plot([0, *(statistics.mean(p[0] for p in ps) for ps in points)],
                            [start, *(statistics.mean(p[1] for p in ps) for ps in points)],
                            marker="o", label=method)
    for axes, label in ((by_step, "optimizer step"), (by_samples, "on-policy student episodes")):
        axes.axhline(teacher, color="k", linestyle="--", label="teacher")
        axes.set_xlabel(label)
        axes.set_ylabel("validation greedy success")
        axes.legend(fontsize=7)
    by_step.set_title("success against steps (mean over seeds)")
    by_samples.set_title("success against student samples (on-policy methods)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Report several studies of one world together.")
    parser.add_argument("--out", required=True, help="where quality.md and quality.png go")
    parser.add_argument("--studies", required=True, help="comma-separated study directories "
                                                         "(bench/quality.py --out)")
    parser.add_argument("--seeds", help="comma-separated seeds to count (default: all)")
    args = parser.parse_args(argv)
    report(Path(args.out), [Path(study) for study in args.studies.split(",")],
           {int(seed) for seed in args.seeds.split(",")} if args.seeds else None)


if __name__ == "__main__":
    main()
