"""How far can a student of a given shape go on toolcalc at all? SFT from scratch, long.

    python bench/capacity.py [--shapes student,teacher,...] [--steps 3000] [--eval-every 500]
                             [--data oracle|PATH] [--out runs/capacity]

The quality study (bench/quality.py) compares methods at the default recipe's budget; this
script asks what bounds all of them: each shape is trained by plain supervised fine-tuning on
the prepared world's oracle conversations (the data the teacher learned from, the same
`worlds.toolcalc.sft` loop and batch size as prepare) for far more steps than the recipe gives,
with greedy success on the study's validation split along the way and on the held-out tasks
once, at the end. A shape whose long SFT stays below a target success cannot reach it by any
distillation at a shorter budget from the same data either, unless the teacher's distribution
carries more than the data does (which the study measures).

One JSON line per shape: parameters, the validation curve, held-out success and per-group
success, seconds. Shapes are `worlds.toolcalc.models` names or `H x L` (hidden size x layers,
head dim 16, MLP 3x), e.g. `96x2`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from quality import RECIPE, write_validation_split  # noqa: E402


def shape_named(name: str):
    from worlds.toolcalc import models

    if name.upper() in ("STUDENT", "TEACHER", "CHAIN_STUDENT"):
        return getattr(models, name.upper())
    hidden, _, layers = name.partition("x")
    if not (hidden.isdigit() and layers.isdigit()) or int(hidden) % 16:
        sys.exit(f"error: --shapes: {name!r} is neither student, teacher, chain_student nor "
                 "HxL with H a multiple of 16 (e.g. 96x2).")
    heads = int(hidden) // 16
    return models.ModelShape(hidden_size=int(hidden), num_hidden_layers=int(layers),
                             num_attention_heads=heads, num_key_value_heads=heads,
                             intermediate_size=3 * int(hidden))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="student")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--lr", type=float, help="default: prepare's student_lr")
    parser.add_argument("--data", default="oracle", help="oracle, or a completions JSONL path "
                                                          "(e.g. the study's teacher conversations)")
    parser.add_argument("--val-tasks", type=int, default=100)
    parser.add_argument("--out", default=str(REPO / "runs" / "capacity"))
    args = parser.parse_args(argv)
    shapes = [(name, shape_named(name)) for name in args.shapes.split(",")]

    import torch

    from opd.chat import ChatFormat
    from opd.config import load_config
    from opd.data import completion_trajectory, load_jsonl
    from opd.plugins import prepared, resolve_plugins
    from worlds.toolcalc.models import build_model, count_parameters
    from worlds.toolcalc.prepare import Evaluator, PrepareConfig
    from worlds.toolcalc.sft import sft
    from worlds.toolcalc.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = load_config(str(RECIPE), None, [])
    config = prepared(config, resolve_plugins(config))
    validation = load_jsonl(write_validation_split(config, out, args.val_tasks))
    heldout = load_jsonl(config.data.eval)
    prepare_cfg = PrepareConfig()
    tokenizer = load_tokenizer(config.tokenizer_path)
    chat = ChatFormat(tokenizer)
    data = config.data.completions if args.data == "oracle" else args.data
    conversations = [completion_trajectory(chat, r["messages"], r.get("tools"))
                     for r in load_jsonl(data)]
    lr = args.lr or prepare_cfg.student_lr
    # Prepare's own eval: the same greedy rollout limits and checker as the world's figures.
    with Evaluator(tokenizer, heldout, prepare_cfg) as evaluator:
        for name, shape in shapes:
            started = time.perf_counter()
            model = build_model(shape, tokenizer, prepare_cfg.seed + 100)
            curve = []

            def validate(step: int) -> None:
                metrics = evaluator(model, f"{name} validation", records=validation)
                curve.append((step, metrics["success_rate"]))
                print(json.dumps({"shape": name, "step": step,
                                  "validation_success": metrics["success_rate"]}), flush=True)

            # One cosine schedule over all steps, evaluated along the way: the points before the
            # end are what a longer schedule passes through, not what a shorter one would reach.
            sft(model, conversations, steps=args.steps, batch_size=prepare_cfg.batch_size, lr=lr,
                warmup_steps=prepare_cfg.warmup_steps, seed=prepare_cfg.seed + 100,
                desc=f"{name} SFT", pad_token_id=tokenizer.pad_token_id,
                every=args.eval_every, on_every=validate)
            final = evaluator(model, f"{name} held-out")
            result = {"shape": name, "hidden_x_layers": f"{shape.hidden_size}x"
                      f"{shape.num_hidden_layers}", "parameters": count_parameters(model),
                      "steps": args.steps, "batch_size": prepare_cfg.batch_size, "lr": lr,
                      "data": args.data, "validation_curve": curve,
                      "heldout_success": final["success_rate"],
                      "heldout_per_group": {g: r["success_rate"]
                                            for g, r in final.get("per_group", {}).items()},
                      "seconds": round(time.perf_counter() - started, 1)}
            with (out / "results.jsonl").open("a") as results:
                results.write(json.dumps(result) + "\n")
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
