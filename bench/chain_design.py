"""Design probes of the chain world: what does a shape learn by SFT on a mix of clean and
slipped demonstrations, and does it recover after a rejection?

    python bench/chain_design.py --name NAME [--shape student|teacher|chain_student|HxL]
        [--init MODEL_DIR] [--clean N] [--slipped N] [--slip-rate 0.3] --steps N [--lr 5e-3]
        [--val-tasks 200] [--out runs/chain_design]

The chain world's shapes and its teacher's two phases were chosen with these commands
(BENCHMARKS.md, "The chain world"): a shape that learns the clean chains almost perfectly is the
teacher's, one that stays well below after a long warm start is the student's, and the teacher
learns recoveries after the clean chains (`--init` the clean model), not from scratch. Clean
demonstrations are of generate_chain_tasks seed 2 (prepare's training tasks), slipped ones of
seed 4 (the teacher's tasks), validation tasks of seed 3 (never held-out); held-out tasks are
never used. One JSON line: validation greedy success, rejected-call rate, success after a
rejection, truncation, per horizon, and the model's next-call exactness after a rejection
(prepare's probe); the model is saved under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from capacity import shape_named  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--shape", default="student")
    parser.add_argument("--init", help="a saved model to continue from (instead of --shape)")
    parser.add_argument("--clean", type=int, default=0, help="clean demonstrations")
    parser.add_argument("--slipped", type=int, default=0, help="demonstrations with slips")
    parser.add_argument("--slip-rate", type=float, default=0.3)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--val-tasks", type=int, default=200)
    parser.add_argument("--out", default=str(REPO / "runs" / "chain_design"))
    args = parser.parse_args(argv)
    if not args.clean + args.slipped:
        sys.exit("error: --clean and --slipped are both 0: no demonstrations to train on.")

    import torch

    from opd.chat import ChatFormat
    from opd.data import completion_trajectory
    from opd.eval import load_model
    from worlds.toolcalc.chain import chain_oracle_record, chain_record, generate_chain_tasks
    from worlds.toolcalc.models import build_model, count_parameters, save_model
    from worlds.toolcalc.prepare import (
        CHAIN_CONFIG,
        Evaluator,
        next_call_exactness,
        recovery_probes,
    )
    from worlds.toolcalc.sft import sft
    from worlds.toolcalc.tokenizer import TOKENIZER_DIR, load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    chat = ChatFormat(tokenizer)
    heldout = frozenset(task.question for task in
                        generate_chain_tasks(CHAIN_CONFIG.heldout_tasks, CHAIN_CONFIG.seed + 1))
    records = [chain_oracle_record(task) for task in
               generate_chain_tasks(args.clean, 2, exclude=heldout)] if args.clean else []
    slips = random.Random(5)
    records += [chain_oracle_record(task, slips, args.slip_rate) for task in
                generate_chain_tasks(args.slipped, 4, exclude=heldout)] if args.slipped else []
    conversations = [completion_trajectory(chat, r["messages"], r["tools"]) for r in records]
    model = load_model(args.init, "cpu", "--init").train() if args.init else \
        build_model(shape_named(args.shape), tokenizer, 0)
    started = time.perf_counter()
    losses = sft(model, conversations, steps=args.steps, batch_size=CHAIN_CONFIG.batch_size,
                 lr=args.lr, warmup_steps=CHAIN_CONFIG.warmup_steps, seed=0, desc=args.name,
                 pad_token_id=tokenizer.pad_token_id)
    train_s = time.perf_counter() - started
    validation = [chain_record(task) for task in
                  generate_chain_tasks(args.val_tasks, 3, exclude=heldout)]
    with Evaluator(tokenizer, validation, CHAIN_CONFIG) as evaluator:
        metrics = evaluator(model, f"{args.name} validation")
    probes = [completion_trajectory(chat, r["messages"], r["tools"])
              for r in recovery_probes(CHAIN_CONFIG)]
    out = Path(args.out)
    save_model(model, tokenizer, out / "models" / args.name)
    result = {
        "name": args.name, "shape": None if args.init else args.shape, "init": args.init,
        "parameters": count_parameters(model), "clean": args.clean, "slipped": args.slipped,
        "slip_rate": args.slip_rate, "steps": args.steps, "lr": args.lr,
        "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
        "validation_success": metrics["success_rate"],
        "rejected_call_rate": metrics["rejected_call_rate"],
        "success_after_rejection": metrics["success_after_rejection"],
        "truncation_rate": metrics["truncation_rate"],
        "per_horizon": {group: (round(rates["success_rate"], 3),
                                round(rates["rejected_call_rate"], 3))
                        for group, rates in metrics.get("per_group", {}).items()},
        "next_call_exact": next_call_exactness(model, probes),
        "train_s": round(train_s, 1),
    }
    with (out / "results.jsonl").open("a") as results:
        results.write(json.dumps(result) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
