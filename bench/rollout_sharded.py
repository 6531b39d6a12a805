"""Rollout under a sharded student: gathering per forward vs gathering once per rollout phase.

    python bench/rollout_sharded.py [--backend deepspeed|fsdp|both] [--prompts 16] [--repeats 2]

Starts itself on 2 CPU ranks (gloo) unless already launched. For each backend, the same prompts
and seed are rolled out twice on each rank: with the student gathered layer by layer inside
every forward (ranks in lockstep) and with it gathered once for the whole phase. Prints one JSON
line per backend: decoded tokens/s of each mode, the ratio, and the all-gather calls one rollout
made (rank 0, counted by the profiler) against its number of forward calls.

Per-forward gathering is measured as it behaves for a model larger than ZeRO-3's reuse window:
the benchmark's DeepSpeed config persists nothing and reuses nothing across forwards
(`stage3_param_persistence_threshold` and `stage3_max_reuse_distance` 0). With the shipped
defaults a model this small would simply stay gathered and the comparison would say nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

# Before torch loads OpenMP: threads that spin while waiting for work steal the cores of other
# ranks and tool workers on a shared host (a CPU step measured 5x slower); sleeping costs little.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]

STUDENT = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=768)
UNCACHED_ZERO3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0,
                                        "stage3_max_reuse_distance": 0,
                                        "stage3_prefetch_bucket_size": 0}}


def build_world(root: Path, prompts: int) -> None:
    import torch

    from opd.data import write_jsonl
    from worlds.toolcalc.models import ModelShape, build_model, save_model
    from worlds.toolcalc.tasks import generate_tasks, task_record
    from worlds.toolcalc.tokenizer import TOKENIZER_DIR, load_tokenizer

    torch.manual_seed(0)
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    save_model(build_model(ModelShape(**STUDENT), tokenizer, seed=0), tokenizer, root / "student")
    write_jsonl(root / "prompts.jsonl", [task_record(t) for t in generate_tasks(2 * prompts, 11)])
    (root / "zero3.json").write_text(json.dumps(UNCACHED_ZERO3))


def all_gathers(fn) -> tuple[object, int]:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        result = fn()
    calls = Counter(event.name for event in profile.events())
    return result, sum(n for name, n in calls.items() if name.startswith("gloo:all_gather"))


def measure(backend: str, root: Path, args) -> dict | None:
    import torch
    from transformers import AutoTokenizer

    from opd.backends import build_student
    from opd.chat import ChatFormat
    from opd.config import load_config
    from opd.data import load_jsonl
    from opd.dist import World, barrier, lockstep
    from opd.rollout import RolloutConfig, rollout
    from opd.tools import ToolExecutor
    from worlds.toolcalc.tokenizer import TOKENIZER_DIR
    from worlds.toolcalc.tools import registry as toolcalc_registry

    config = load_config(overrides=[
        f"model.student={root / 'student'}", f"model.teacher={root / 'student'}",
        f"data.prompts={root / 'prompts.jsonl'}", f"student.backend={backend}",
        f"student.deepspeed_config={root / 'zero3.json'}"])
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    world = World(rank, size, int(os.environ["LOCAL_RANK"]), size, torch.device("cpu"))
    student = build_student(config, world)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    chat = ChatFormat(tokenizer, generation_config=student.hf_model.generation_config)
    prompts = load_jsonl(root / "prompts.jsonl")[rank::size][:args.prompts]
    cfg = RolloutConfig(max_turns=1, max_new_tokens=args.new_tokens, max_total_len=512,
                        batch_size=args.prompts, temperature=1.0)
    figures = {}
    with ToolExecutor(toolcalc_registry(), num_workers=1) as executor:
        def run(gather: bool):
            with student.generation_context(gather) as model:
                return rollout(model, chat, executor, prompts, cfg, seed=rank,
                               sync=None if gather else lockstep())

        for gather, name in ((False, "per_forward"), (True, "gather_once")):
            run(gather)  # warm-up
            barrier()
            started = time.perf_counter()
            for _ in range(args.repeats):
                trajectories = run(gather)
            barrier()
            seconds = time.perf_counter() - started
            tokens = sum(sum(t.assistant_mask) for t in trajectories) * args.repeats
            _, gathers = all_gathers(lambda: run(gather))
            figures[name] = {"tokens_per_s": tokens * size / seconds, "seconds": seconds,
                             "all_gathers": gathers,
                             "forwards": max(sum(t.assistant_mask) for t in trajectories)}
    if rank != 0:
        return None
    return {"bench": "rollout_sharded", "backend": backend, "ranks": size, "student": STUDENT,
            "prompts_per_rank": len(prompts), "max_new_tokens": args.new_tokens, **figures,
            "ratio": (figures["gather_once"]["tokens_per_s"]
                      / figures["per_forward"]["tokens_per_s"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("deepspeed", "fsdp", "both"), default="both")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rank")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--world", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "WORLD_SIZE" not in os.environ:
        with tempfile.TemporaryDirectory() as scratch:
            build_world(Path(scratch), args.prompts)
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                       __file__, "--world", scratch, *sys.argv[1:]]
            sys.exit(subprocess.call(command, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    from opd.dist import init_world, shutdown

    init_world("cpu", "gloo", 1)
    for backend in (("deepspeed", "fsdp") if args.backend == "both" else (args.backend,)):
        line = measure(backend, Path(args.world), args)
        if line is not None:
            print(json.dumps(line), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
