"""Per-step metrics: `metrics.jsonl` (one JSON object per optimizer step), wandb, and a plot.

Only rank 0 writes. wandb runs offline unless the recipe says `logging.wandb_mode: online`, so a
run never reaches for the network or a login by default; `disabled` skips it entirely. Each run
gets its own wandb run id, kept in the run directory (`wandb_run_id`), so that a resumed run goes
on logging to the same wandb run while another run of the same recipe starts its own.

    python -m opd.metrics plot runs/<name>/metrics.jsonl [--out metrics.png]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import secrets
import sys
from pathlib import Path

from opd.config import WandbMode
from opd.errors import MetricsError

PLOTTED = ("loss", "kl_per_token", "grad_norm", "lr", "target_tokens", "tokens_per_s",
           "valid_tool_calls", "invalid_tool_calls", "truncation_rate", "rollout_s",
           "teacher_s", "train_s")
WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(run_dir: Path, run_name: str, resuming: bool) -> str:
    """The stored id when resuming, else a new one (`<name>-<8 hex>`), stored for the resume."""
    path = run_dir / WANDB_ID_FILE
    if resuming and path.is_file():
        return path.read_text().strip()
    run_id = f"{re.sub(r'[^A-Za-z0-9_-]', '-', run_name)}-{secrets.token_hex(4)}"
    path.write_text(run_id + "\n")
    return run_id


class MetricsLog:
    """Appends step records to `metrics.jsonl` (rank 0) and mirrors them to wandb."""

    def __init__(self, run_dir: Path, *, enabled: bool, resume_step: int = 0,
                 wandb_mode: WandbMode = "disabled", wandb_project: str = "opd-recipes",
                 run_name: str = "run", config: dict | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.wandb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        # Steps after the checkpoint being resumed are rerun: drop their old records.
        kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step] \
            if self.path.exists() else []
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        if wandb_mode != "disabled":
            import wandb

            self.wandb = wandb.init(project=wandb_project, name=run_name, dir=str(run_dir),
                                    mode=wandb_mode, config=config, resume="allow",
                                    id=wandb_run_id(run_dir, run_name, resume_step > 0))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step" and v is not None},
                           step=record["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def read_metrics(path: str | Path) -> list[dict]:
    """The step records of a metrics file. A last line that is not valid JSON is what a run
    killed mid-write leaves: it is skipped with a warning; anything else wrong is one sentence."""
    path = Path(path)
    if not path.is_file():
        raise MetricsError(f"Metrics file {path} does not exist.")
    try:
        lines = [(number, line) for number, line in
                 enumerate(path.read_text(encoding="utf-8").splitlines(), start=1) if line.strip()]
    except UnicodeDecodeError:
        raise MetricsError(f"{path} is not UTF-8 text (not a metrics.jsonl?).") from None
    records = []
    for number, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == lines[-1][0]:
                print(f"warning: {path} line {number} is cut short (a run killed while writing "
                      "it?); skipped.", file=sys.stderr)
                continue
            raise MetricsError(f"{path} line {number} is not valid JSON.") from None
        if not isinstance(record, dict):
            raise MetricsError(f"{path} line {number} is not a JSON object (a step record).")
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise MetricsError(f"{path} line {number} has no integer \"step\".")
        records.append(record)
    return records


def plot(metrics_path: str | Path, out_path: str | Path) -> Path:
    """One small panel per metric against the optimizer step, written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    if not records:
        raise MetricsError(f"{metrics_path} has no records to plot.")
    keys = [k for k in PLOTTED if any(_number(r.get(k)) for r in records)]
    columns = 3
    rows = math.ceil(len(keys) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 2.6 * rows), squeeze=False)
    for axis, key in zip(axes.flat, keys):
        points = [(r["step"], r[key]) for r in records if _number(r.get(key))]
        axis.plot([p[0] for p in points], [p[1] for p in points],
                  marker="." if len(points) < 50 else None)
        axis.set_title(key, fontsize=9)
        axis.set_xlabel("step", fontsize=8)
        axis.tick_params(labelsize=7)
    for axis in list(axes.flat)[len(keys):]:
        axis.axis("off")
    figure.tight_layout()
    out_path = Path(out_path)
    figure.savefig(out_path, dpi=100)
    plt.close(figure)
    return out_path


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m opd.metrics")
    commands = parser.add_subparsers(dest="command", required=True)
    draw = commands.add_parser("plot", help="draw metrics.jsonl as a PNG")
    draw.add_argument("metrics", help="path to metrics.jsonl")
    draw.add_argument("--out", help="PNG path (default: metrics.png beside the input)")
    args = parser.parse_args(argv)
    try:
        out = plot(args.metrics, args.out or Path(args.metrics).with_suffix(".png"))
    except (OSError, ValueError) as error:
        sys.exit(f"error: {error}")
    print(out)


if __name__ == "__main__":
    main()
