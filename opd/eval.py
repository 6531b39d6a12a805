"""Success-rate eval: roll a model out on a dataset of tasks and check its final answers.

A task succeeds when the final assistant turn passes the answer checker, every tool call in the
conversation was valid and ran, and nothing was truncated. Works for any Hugging Face causal LM
directory (its tokenizer and chat template included), any JSONL dataset in the `opd.data` form
and any checker `check(final_text, record) -> bool`; the default is the toolcalc checker.

Greedy by default (top_k=1 at temperature 1): the reported figure is then a property of the model,
not of a sampling seed. `--temperature 1 --top-k 0` measures what OPD samples instead.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

DEFAULT_CHECKER = "recipes.toolcalc.tasks:check_answer"
DEFAULT_TOOLS = "opd.tools:builtin_registry"
GROUP_KEY = "family"
SAMPLES_KEPT = 10

Checker = Callable[[str, dict], bool]


class EvalError(ValueError):
    """A user error in eval arguments; the message names the argument and value."""


def greedy_rollout_config(**overrides):
    from opd.rollout import RolloutConfig

    return RolloutConfig(**{"temperature": 1.0, "top_k": 1, **overrides})


def final_text(trajectory, tokenizer) -> str:
    """The text of the conversation's last assistant turn ("" when it has none)."""
    spans = trajectory.assistant_spans()
    if not spans:
        return ""
    start, end = spans[-1]
    return tokenizer.decode(trajectory.input_ids[start:end], skip_special_tokens=True)


def evaluate(model, chat, executor, records: Sequence[dict], check: Checker, cfg, *,
             seed: int = 0, progress: str | None = None) -> dict:
    """Metrics of `model` on `records` (dataset lines with gold answers), plus a few samples."""
    from tqdm import tqdm

    from opd.data import prompt_record
    from opd.rollout import rollout

    outcomes = []
    chunks = range(0, len(records), cfg.batch_size)
    for chunk, start in enumerate(tqdm(chunks, desc=progress, disable=progress is None,
                                       unit="batch", leave=False)):
        batch = records[start:start + cfg.batch_size]
        trajectories = rollout(model, chat, executor, [prompt_record(r) for r in batch], cfg,
                               seed=seed + chunk)
        for record, trajectory in zip(batch, trajectories):
            outcomes.append(_outcome(record, trajectory, chat.tokenizer, check))
    return summarize(outcomes)


def _outcome(record: dict, trajectory, tokenizer, check: Checker) -> dict:
    text = final_text(trajectory, tokenizer)
    counts = trajectory.counts
    calls_ok = counts.invalid == 0 and counts.failed == 0
    correct = bool(check(text, record))
    return {
        "group": record.get(GROUP_KEY), "correct": correct, "calls_ok": calls_ok,
        "truncated": trajectory.truncated, "success": correct and calls_ok and not trajectory.truncated,
        "valid_calls": counts.valid, "all_calls": counts.valid + counts.invalid + counts.failed,
        "turns": trajectory.turns, "tokens": len(trajectory.input_ids),
        "generated_tokens": sum(trajectory.assistant_mask),
        "question": next((m["content"] for m in record["messages"] if m["role"] == "user"), ""),
        "final_text": text, "truncation_reason": trajectory.truncation_reason,
    }


def summarize(outcomes: list[dict]) -> dict:
    """Aggregate per-task outcomes: overall metrics, per group (task family), samples."""
    metrics = _rates(outcomes)
    groups = defaultdict(list)
    for outcome in outcomes:
        if outcome["group"] is not None:
            groups[outcome["group"]].append(outcome)
    if groups:
        metrics["per_group"] = {name: _rates(group) for name, group in sorted(groups.items())}
    metrics["samples"] = [{key: o[key] for key in ("question", "final_text", "success",
                                                    "truncation_reason")}
                          for o in outcomes[:SAMPLES_KEPT]]
    return metrics


def _rates(outcomes: list[dict]) -> dict:
    count = len(outcomes)
    all_calls = sum(o["all_calls"] for o in outcomes)

    def mean(key: str) -> float:
        return sum(float(o[key]) for o in outcomes) / count

    return {
        "num_tasks": count, "success_rate": mean("success"), "answer_accuracy": mean("correct"),
        "tool_call_validity": sum(o["valid_calls"] for o in outcomes) / all_calls
        if all_calls else None,
        "truncation_rate": mean("truncated"), "mean_turns": mean("turns"),
        "mean_tokens": mean("tokens"), "mean_generated_tokens": mean("generated_tokens"),
    }


def resolve(spec: str, argument: str):
    """`module:attribute` -> the object, or an EvalError naming the argument."""
    module_name, _, attribute = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError):
        raise EvalError(f"{argument} {spec!r} does not name an importable module:attribute.") \
            from None


def load_model(path: str | Path, device=None, key: str = "--model"):
    """A causal LM in eval mode on `device` (default: cuda when available), with the trainer's
    precision policy: bf16 and flash-attn where installed on GPU, fp32 and SDPA on CPU."""
    import torch

    from opd.backends import load_causal_lm, resolve_precision

    if not Path(path).is_dir():
        raise EvalError(f"Model path {path} is not a directory.")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    precision = resolve_precision("auto", "auto", device)
    model = load_causal_lm(str(path), precision.dtype, precision.attn_implementation, key)
    return model.to(device).eval()


def evaluate_path(model_path: str | Path, data_path: str | Path, out_dir: str | Path | None, *,
                  check: Checker | None = None, registry=None, cfg=None, seed: int = 0,
                  limit: int | None = None, progress: str | None = "eval") -> dict:
    """Evaluate a saved model on a JSONL dataset; writes `out_dir/eval.json` when out_dir is set."""
    from transformers import AutoTokenizer

    from opd.chat import ChatFormat
    from opd.data import load_jsonl
    from opd.tools import ToolExecutor

    records = load_jsonl(data_path)[:limit]
    check = check or resolve(DEFAULT_CHECKER, "--checker")
    registry = registry or resolve(DEFAULT_TOOLS, "--tools")()
    cfg = cfg or greedy_rollout_config()
    model = load_model(model_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    chat = ChatFormat(tokenizer, generation_config=model.generation_config)
    with ToolExecutor(registry) as executor:
        metrics = evaluate(model, chat, executor, records, check, cfg, seed=seed,
                           progress=progress)
    report = {"model": str(model_path), "data": str(data_path), "seed": seed,
              "rollout": asdict(cfg), "metrics": metrics}
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--data", required=True, help="JSONL dataset with gold answers")
    parser.add_argument("--out", help="directory for eval.json")
    parser.add_argument("--checker", default=DEFAULT_CHECKER, help="module:function(text, record)")
    parser.add_argument("--tools", default=DEFAULT_TOOLS, help="module:function() -> ToolRegistry")
    parser.add_argument("--limit", type=int, help="evaluate only the first N records")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-total-len", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=1, help="1 = greedy (default), 0 = off")
    parser.add_argument("--top-p", type=float, default=1.0)
    args = parser.parse_args(argv)
    from opd.chat import ChatTemplateError
    from opd.data import DatasetError
    from opd.rollout import RolloutConfig

    cfg = RolloutConfig(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                        max_total_len=args.max_total_len, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, batch_size=args.batch_size)
    try:
        cfg.validate()
    except ValueError as error:
        sys.exit(f"error: {error}")
    try:
        report = evaluate_path(args.model, args.data, args.out,
                               check=resolve(args.checker, "--checker"),
                               registry=resolve(args.tools, "--tools")(), cfg=cfg,
                               seed=args.seed, limit=args.limit)
    except (EvalError, DatasetError, ChatTemplateError) as error:
        sys.exit(f"error: {error}")
    metrics = {k: v for k, v in report["metrics"].items() if k not in ("samples", "per_group")}
    print(json.dumps(metrics))
    return report


if __name__ == "__main__":
    main()
