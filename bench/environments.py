"""Stateful-episode throughput: BFCL multi-turn episodes through our environment against
bfcl-eval's own in-process execution of the same ground-truth calls.

Every episode replays one task's ground truth turn by turn (the calls a perfect student would
make). The baseline is bfcl-eval's executor as its inference loop runs it
(`execute_multi_turn_func_call` per step: `eval` of call strings on instances kept in its module
globals, in the calling process). Ours:

    inprocess   worlds.bfcl.environment.BFCLEnvironment called directly (the sandbox's payload)
    processes   N concurrent episodes in N long-lived spawned worker processes, each holding its
                environment for the episode's lifetime (what a sandboxed worker does, without
                opd's sandbox limits): pickling transport included, pool start included
    sandbox     through opd.environments (the project's sandboxed stateful workers): run when
                that interface is installed, else null

Prints one JSON line: episodes/s and tool calls/s of each, and each ratio to the baseline.

    python bench/environments.py [--episodes 200] [--concurrency 8] [--category base]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worlds.bfcl.convert import convert
from worlds.bfcl.environment import BFCLEnvironment


def bfcl_baseline(records: list[dict]) -> float:
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    started = time.perf_counter()
    for index, record in enumerate(records):
        name = f"bench_{index}"
        for calls in record["ground_truth"]:
            multi_turn_utils.execute_multi_turn_func_call(
                calls, record["environment"]["initial_config"],
                record["environment"]["involved_classes"], name, record["id"],
                long_context=record["environment"]["long_context"])
        for key in [k for k in vars(multi_turn_utils) if k.startswith(name + "_")]:
            del vars(multi_turn_utils)[key]
    return time.perf_counter() - started


def _episode(record: dict) -> int:
    env = BFCLEnvironment(record["environment"])
    calls = 0
    for turn in record["ground_truth_calls"]:
        for call in turn:
            try:
                env.call(call["name"], call["arguments"])
            except ValueError:
                pass  # an off-schema ground-truth call: refused, as in an episode
            calls += 1
    json.dumps(env.state())
    env.close()
    return calls


def inprocess(records: list[dict]) -> float:
    started = time.perf_counter()
    for record in records:
        _episode(record)
    return time.perf_counter() - started


def processes(records: list[dict], concurrency: int) -> float:
    context = multiprocessing.get_context("spawn")
    started = time.perf_counter()
    with context.Pool(concurrency) as pool:  # long-lived workers, a fresh environment each
        pool.map(_episode, records, chunksize=1)
    return time.perf_counter() - started


def sandbox(records: list[dict], concurrency: int) -> float | None:
    if importlib.util.find_spec("opd.environments") is None:
        return None
    # Wired once the environment interface is merged: N concurrent episodes through
    # opd.environments' sandboxed stateful workers, replaying the same calls.
    return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--category", default="base")
    args = parser.parse_args(argv)
    records = convert((args.category,))
    records = (records * (args.episodes // len(records) + 1))[:args.episodes]
    calls = sum(len(turn) for r in records for turn in r["ground_truth_calls"])
    inprocess(records[:5])  # warm imports and caches
    timings = {"bfcl_inprocess": bfcl_baseline(records), "ours_inprocess": inprocess(records),
               "ours_processes": processes(records, args.concurrency),
               "ours_sandbox": sandbox(records, args.concurrency)}
    result: dict = {"bench": "environments", "category": args.category,
                    "episodes": len(records), "tool_calls": calls,
                    "concurrency": args.concurrency}
    base = timings["bfcl_inprocess"]
    for name, seconds in timings.items():
        result[f"{name}_episodes_per_s"] = round(len(records) / seconds, 1) if seconds else None
        result[f"{name}_calls_per_s"] = round(calls / seconds, 1) if seconds else None
        if name != "bfcl_inprocess":
            result[f"{name}_ratio"] = round(base / seconds, 3) if seconds else None
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
