"""Success-rate eval: roll a model out on a dataset of tasks and check its final answers.

A task succeeds when the final assistant turn passes the answer checker, every tool call in the
conversation was valid and ran (unless the checker has `forgives_failed_calls = True`: a world
whose tools reject calls informatively, where recovering is part of the task), and nothing was
truncated. Works for any Hugging Face causal LM
directory (its tokenizer and chat template included), any JSONL dataset in the `opd.data` form
and any checker `check(final_text, record) -> bool`.

The checker contract, compatibly extended for stateful environments (opd.environments), is
opd.checker: a checker whose signature takes a third positional argument (or *args) is called
as `check(final_text, record, episode)` with the episode's `EpisodeOutcome` (its final
environment state and the calls it ran). A two-argument checker is called as before.

The trainer's evals and `python -m opd.eval` are one path (`evaluate_model` under an `EvalSpec`):
with `--recipe`, the command line evaluates exactly as the recipe's run does (its data, tools,
checker, template arguments and rollout limits); flags override single keys.

    python -m opd.eval --model runs/toolcalc_tiny/final --recipe recipes/toolcalc_tiny.yaml
    python -m opd.eval --model DIR --data held.jsonl --tools pkg.mod:registry \\
        --checker pkg.mod:check --chat-template-kwargs '{"enable_thinking": false}'

Greedy by default (top_k=1 at temperature 1): the reported figure is then a property of the model,
not of a sampling seed. `--temperature 1 --top-k 0` measures what OPD samples instead.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from opd.backends import check_model_dir, load_causal_lm, resolve_precision
from opd.chat import ChatFormat
from opd.checker import Checker, EpisodeOutcome, call_checker
from opd.config import RolloutConfig, ToolsConfig, load_config
from opd.errors import ConfigError, MissingFileError, OPDError
from opd.inputs import chat_format, load_prompts
from opd.plugins import Plugins, prepared, resolve_plugins
from opd.rollout import rollout
from opd.tool_schemas import ToolRegistry
from opd.tools import ENVIRONMENT_START_FAILED, ToolExecutor

GROUP_KEY = "family"
SAMPLES_KEPT = 10

def greedy(cfg: RolloutConfig) -> RolloutConfig:
    """The rollout's limits with greedy decoding (top_k=1 at temperature 1)."""
    return replace(cfg, temperature=1.0, top_k=1, top_p=1.0)


def final_text(trajectory, tokenizer) -> str:
    """The text of the conversation's last assistant turn ("" when it has none), without its
    `<think>...</think>` block: the checker judges the answer, not the reasoning."""
    spans = trajectory.assistant_spans()
    if not spans:
        return ""
    start, end = spans[-1]
    text = tokenizer.decode(trajectory.input_ids[start:end], skip_special_tokens=True)
    return strip_thinking(text)


def strip_thinking(text: str) -> str:
    """`text` after its reasoning: past the last `</think>`; "" while a `<think>` is open."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1].strip()
    return "" if "<think>" in text else text


@dataclass(frozen=True)
class EvalSpec:
    """Everything an evaluation needs but the model: the same for the trainer and the CLI."""

    records: list[dict]
    checker: Checker
    tool_registry: ToolRegistry
    parser: Callable
    rollout: RolloutConfig  # greedy by default (see `greedy`)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    chat_template_kwargs: dict = field(default_factory=dict)
    environment: type | None = None  # a stateful environment class (opd.environments)
    tokenizer: str = ""  # empty: the model's own directory
    seed: int = 0


def spec_from_config(config, plugins: Plugins, records: list[dict]) -> EvalSpec:
    """The evaluation a recipe describes, on `records` (its checked data.eval)."""
    return EvalSpec(records=records, checker=plugins.eval_checker, tool_registry=plugins.tool_registry,
                    parser=plugins.parser, rollout=greedy(config.rollout), tools=config.tools,
                    chat_template_kwargs=config.model.chat_template_kwargs,
                    tokenizer=config.model.tokenizer, seed=config.seed,
                    environment=plugins.environment)


def evaluate(model, chat, executor, records: Sequence[dict], check: Checker, cfg, *,
             seed: int = 0, parser: Callable | None = None, progress: str | None = None) -> dict:
    """Metrics of `model` on `records` (dataset lines with gold answers), plus a few samples."""
    outcomes = []
    chunks = range(0, len(records), cfg.batch_size)
    for chunk, start in enumerate(tqdm(chunks, desc=progress, disable=progress is None,
                                       unit="batch", leave=False)):
        batch = records[start:start + cfg.batch_size]
        trajectories = rollout(model, chat, executor, batch, cfg, seed=seed + chunk,
                               parser=parser)
        for record, trajectory in zip(batch, trajectories):
            outcomes.append(_outcome(record, trajectory, chat.tokenizer, check))
        _refuse_environments_that_never_start(trajectories)
    return summarize(outcomes, getattr(check, "accuracy_name", None))


def _refuse_environments_that_never_start(trajectories: Sequence) -> None:
    """A batch where no episode could construct its environment is a broken setup (the
    environment cannot run in the sandbox), not a model scoring 0: stop with the reason."""
    if trajectories and all(t.truncation_reason == ENVIRONMENT_START_FAILED
                            for t in trajectories):
        raise OPDError(f"no episode of an eval batch could start its environment "
                       f"(tools.environment): {trajectories[0].environment_error}")


def tool_executor(registry: ToolRegistry, tools: ToolsConfig,
                  environment: type | None = None) -> ToolExecutor:
    """The sandbox for `registry` (or a stateful `environment`) with the recipe's `tools.*`
    bounds."""
    return ToolExecutor(registry, timeout_s=tools.timeout_s,
                        max_result_chars=tools.max_result_chars, num_workers=tools.num_workers,
                        memory_limit_mb=tools.memory_limit_mb,
                        max_calls_per_turn=tools.max_calls_per_turn, pass_env=tools.pass_env,
                        environment=environment)


def evaluate_model(model_path: str | Path, spec: EvalSpec, *, device=None,
                   key: str = "--model", progress: str | None = None) -> dict:
    """Metrics of a saved Hugging Face model under `spec` (samples included)."""
    from transformers import AutoTokenizer

    model = load_model(model_path, device, key)
    tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer or str(model_path),
                                              local_files_only=True)
    chat = ChatFormat(tokenizer, spec.chat_template_kwargs, model.generation_config)
    with tool_executor(spec.tool_registry, spec.tools, spec.environment) as executor:
        return evaluate(model, chat, executor, spec.records, spec.checker, spec.rollout,
                        seed=spec.seed, parser=spec.parser, progress=progress)


def _outcome(record: dict, trajectory, tokenizer, check: Checker) -> dict:
    text = final_text(trajectory, tokenizer)
    counts = trajectory.counts
    calls_ok = counts.invalid == 0 and counts.failed == 0
    episode = EpisodeOutcome(trajectory.environment_state, trajectory.calls_by_turn)
    correct = bool(call_checker(check, text, record, episode))
    return {
        "group": record.get(GROUP_KEY), "correct": correct, "calls_ok": calls_ok,
        "truncated": trajectory.truncated,
        "success": correct and not trajectory.truncated
        and (calls_ok or getattr(check, "forgives_failed_calls", False)),
        "valid_calls": counts.valid, "all_calls": counts.valid + counts.invalid + counts.failed,
        "turns": trajectory.turns, "tokens": len(trajectory.input_ids),
        "generated_tokens": sum(trajectory.assistant_mask),
        "question": next((m["content"] for m in record["messages"] if m["role"] == "user"), ""),
        "final_text": text, "truncation_reason": trajectory.truncation_reason,
    }


def episode_reward(record: dict, trajectory, tokenizer, check: Checker) -> float:
    """An on-policy episode's task reward: 1 when it succeeds as the eval counts success (the
    checker accepts the final answer, every call was valid and ran, nothing was truncated),
    else 0. A refused call, a tool failure or a truncation scores 0, as in the eval."""
    return float(_outcome(record, trajectory, tokenizer, check)["success"])


def summarize(outcomes: list[dict], accuracy_name: str | None = None) -> dict:
    """Aggregate per-task outcomes: overall metrics, per group (task family), samples.

    `accuracy_name` (a checker's `accuracy_name` attribute, e.g. "bfcl_accuracy"): the
    benchmark's own figure under that name, beside the stricter success_rate: the checker's
    verdict alone (a refused or failed call, or a cut observation, does not fail a task the
    checker accepts), per group, and overall as the unweighted mean of the groups' figures (as
    BFCL averages its categories; the mean over tasks when there are no groups)."""
    metrics = _rates(outcomes)
    groups = defaultdict(list)
    for outcome in outcomes:
        if outcome["group"] is not None:
            groups[outcome["group"]].append(outcome)
    if groups:
        metrics["per_group"] = {name: _rates(group) for name, group in sorted(groups.items())}
    if accuracy_name:
        metrics[accuracy_name] = metrics["answer_accuracy"]
        if groups:
            for rates in metrics["per_group"].values():
                rates[accuracy_name] = rates["answer_accuracy"]
            metrics[accuracy_name] = sum(rates["answer_accuracy"] for rates in
                                         metrics["per_group"].values()) / len(groups)
    metrics["samples"] = [{key: o[key] for key in ("question", "final_text", "success",
                                                    "truncation_reason")}
                          for o in outcomes[:SAMPLES_KEPT]]
    return metrics


def _rates(outcomes: list[dict]) -> dict:
    count = len(outcomes)
    all_calls = sum(o["all_calls"] for o in outcomes)

    def mean(key: str) -> float:
        return sum(float(o[key]) for o in outcomes) / count

    rejected = [o for o in outcomes if o["all_calls"] > o["valid_calls"]]
    return {
        "num_tasks": count, "success_rate": mean("success"), "answer_accuracy": mean("correct"),
        # Tasks with at least one refused or failed call, and how many of those still succeeded
        # (a recovery, where the checker forgives rejected calls).
        "rejected_call_rate": len(rejected) / count,
        "success_after_rejection": sum(o["success"] for o in rejected) / len(rejected)
        if rejected else None,
        "tool_call_validity": sum(o["valid_calls"] for o in outcomes) / all_calls
        if all_calls else None,
        "truncation_rate": mean("truncated"), "mean_turns": mean("turns"),
        "mean_tokens": mean("tokens"), "mean_generated_tokens": mean("generated_tokens"),
    }


def load_model(path: str | Path, device=None, key: str = "--model"):
    """A causal LM in eval mode on `device` (default: cuda when available), with the trainer's
    precision policy: bf16 and flash-attn where installed on GPU, fp32 and SDPA on CPU."""
    import torch

    if not Path(path).is_dir():
        raise MissingFileError(f"{key}: {path} is not a directory.")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    precision = resolve_precision("auto", "auto", device)
    model = load_causal_lm(str(path), precision.dtype, precision.attn_implementation, key)
    return model.to(device).eval()


TABLE_COLUMNS = ("success_rate", "answer_accuracy", "tool_call_validity", "truncation_rate",
                 "mean_turns")


def results_table(rows: dict[str, dict]) -> str:
    """A fixed-width table: one row per evaluated model."""
    def cell(value) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["model    " + "  ".join(f"{c:>18}" for c in TABLE_COLUMNS)]
    for label, metrics in rows.items():
        cells = (f"{cell(metrics.get(c)):>18}" for c in TABLE_COLUMNS)
        lines.append(f"{label:<9}" + "  ".join(cells))
    return "\n".join(lines)


def improvement_line(before: dict, after: dict, label: str = "before") -> str:
    """The trained student's success minus another row's (`label`) and how many standard errors
    it is (the two evals' binomial errors combined as if independent: conservative, they share
    their tasks)."""
    p_before, p_after = before["success_rate"], after["success_rate"]
    se = math.sqrt(p_before * (1 - p_before) / before["num_tasks"]
                   + p_after * (1 - p_after) / after["num_tasks"])
    change = p_after - p_before
    sigmas = f"{change / se:+.1f} standard errors" if se > 0 else "no spread to compare"
    return (f"after - {label}: {change:+.3f} success on {after['num_tasks']} held-out tasks "
            f"({sigmas})")


# Command-line flags that set a config key; None (the default) keeps the recipe's value.
FLAG_KEYS = {"data": "data.eval", "tools": "tools.registry",
             "environment": "tools.environment", "checker": "eval.checker",
             "parser": "tools.parser", "tokenizer": "model.tokenizer",
             "chat_template_kwargs": "model.chat_template_kwargs", "limit": "eval.limit",
             "seed": "seed", "batch_size": "rollout.batch_size", "max_turns": "rollout.max_turns",
             "max_new_tokens": "rollout.max_new_tokens",
             "max_total_len": "rollout.max_total_len", "temperature": "rollout.temperature",
             "top_k": "rollout.top_k", "top_p": "rollout.top_p"}


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--recipe", help="take data, tools, checker, template arguments and "
                                         "limits from this recipe (flags still win)")
    parser.add_argument("--data", help="JSONL dataset with gold answers (data.eval)")
    parser.add_argument("--out", help="directory for eval.json")
    parser.add_argument("--tools", help="module:function() -> ToolRegistry (tools.registry)")
    parser.add_argument("--environment",
                        help="module:Class, a stateful environment (tools.environment)")
    parser.add_argument("--checker", help="module:function(text, record) (eval.checker)")
    parser.add_argument("--parser", help="tool-call parser (tools.parser)")
    parser.add_argument("--tokenizer", help="tokenizer directory; default: the model's")
    parser.add_argument("--chat-template-kwargs", metavar="JSON",
                        help='template arguments, e.g. \'{"enable_thinking": false}\'')
    parser.add_argument("--limit", type=int, help="evaluate only the first N records")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--max-turns", type=int)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--max-total-len", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-k", type=int, help="1 = greedy (the default), 0 = off")
    parser.add_argument("--top-p", type=float)
    return parser.parse_args(argv)


def eval_config(args):
    """The config an evaluation runs under: the recipe's (if any), then the flags; with no
    recipe, the library's rollout limits, greedy."""
    overrides = []
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    greedy_decoding = args.temperature is None and args.top_k is None and args.top_p is None
    if args.recipe is None:
        return load_config(None, None, overrides, complete=False), greedy_decoding
    config = load_config(args.recipe, None, overrides)
    return prepared(config, resolve_plugins(config), build=False), greedy_decoding


def main(argv: list[str] | None = None) -> dict:
    """`python -m opd.eval --model DIR (--recipe R | --data D --tools T --checker C)`."""
    args = parse_args(argv)
    try:
        config, greedy_decoding = eval_config(args)
        plugins = resolve_plugins(config)
        for key, flag, value in (("data.eval", "--data", config.data.eval),
                                 ("eval.checker", "--checker", plugins.checker),
                                 ("tools.registry", "--tools",
                                  config.tools.registry or config.tools.environment)):
            if not value:
                raise ConfigError(f"{flag} (or a --recipe that sets {key}) is needed.")
        if not Path(args.model).is_dir():
            raise MissingFileError(f"--model: {args.model} is not a directory.")
        check_model_dir(args.model, "--model")
        if args.out is not None:  # before evaluating: a late failure would lose the results
            out_dir_ready(Path(args.out))
        chat = chat_format(config.model.tokenizer or args.model, config.model, args.model,
                           "--tokenizer" if config.model.tokenizer else "--model")
        rollout_cfg = greedy(config.rollout) if greedy_decoding else config.rollout
        records = load_prompts(config.data.eval, chat, rollout_cfg.max_total_len, "--data")
        spec = replace(spec_from_config(config, plugins, records[:config.eval.limit or None]),
                       rollout=rollout_cfg)
        metrics = evaluate_model(args.model, spec, progress="eval")
    except OPDError as error:
        sys.exit(f"error: {error}")
    report = {"model": str(args.model), "data": config.data.eval, "seed": spec.seed,
              "rollout": asdict(spec.rollout), "metrics": metrics}
    if args.out is not None:
        (Path(args.out) / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    print(results_table({"model": metrics}))
    if metrics.get("per_group"):  # per task family (record["family"]), e.g. BFCL's categories
        print(results_table(metrics["per_group"]))
    print(json.dumps({k: v for k, v in metrics.items() if k not in ("samples", "per_group")}))
    return report


def out_dir_ready(out: Path) -> None:
    """Create `--out` (the directory eval.json goes into), or say in one sentence why not."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; --out names the directory eval.json is "
                          "written into (nothing was evaluated).")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-check-"):
            pass
    except OSError as error:
        raise ConfigError(f"--out: cannot write to {out} ({error.strerror or error}); nothing "
                          "was evaluated.") from None


if __name__ == "__main__":
    main()
