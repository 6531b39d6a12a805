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
    sandbox     through opd's sandboxed stateful workers (ToolExecutor episodes, what a rollout
                uses): `concurrency` live episodes, each in its own sandboxed worker, fed one
                user turn's calls per request; episode open and close included

Prints one JSON line: episodes/s and tool calls/s of each, and each ratio to the baseline.

    python bench/environments.py [--episodes 200] [--concurrency 8] [--category base]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time

from opd.data import tools_at_turn
from opd.tool_calls import ToolCall
from opd.tool_schemas import ToolRegistry
from opd.tools import ToolExecutor
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


def sandbox(records: list[dict], concurrency: int) -> tuple[float, float]:
    """(seconds in all, seconds inside run_episode_calls): the rest is opening episodes
    (a fork and the backends' construction) and reading and closing them."""
    calling = 0.0
    started = time.perf_counter()
    with ToolExecutor(ToolRegistry([]), environment=BFCLEnvironment, num_workers=concurrency,
                      max_calls_per_turn=64, max_result_chars=1 << 20) as pool:
        for first in range(0, len(records), concurrency):
            batch = records[first:first + concurrency]
            live = pool.open_episodes(
                [r["environment"] for r in batch],
                [tools_at_turn(r["tools"], r.get("tools_by_turn"), len(r["ground_truth_calls"]))
                 for r in batch])
            broken = [episode.error for episode in live if not episode.alive]
            if broken:
                raise SystemExit(f"an episode could not start in the sandbox: {broken[0]}")
            for turn in range(max(len(r["ground_truth_calls"]) for r in batch)):
                turn_started = time.perf_counter()
                pool.run_episode_calls({
                    episode: [ToolCall(c["name"], c["arguments"])
                              for c in record["ground_truth_calls"][turn]]
                    for episode, record in zip(live, batch)
                    if turn < len(record["ground_truth_calls"])})
                calling += time.perf_counter() - turn_started
            for episode in live:
                pool.episode_state(episode)
                pool.close_episode(episode)
    return time.perf_counter() - started, calling


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
    sandbox_s, sandbox_calls_s = sandbox(records, args.concurrency)
    timings = {"bfcl_inprocess": bfcl_baseline(records), "ours_inprocess": inprocess(records),
               "ours_processes": processes(records, args.concurrency), "ours_sandbox": sandbox_s}
    result: dict = {"bench": "environments", "category": args.category,
                    "episodes": len(records), "tool_calls": calls,
                    "concurrency": args.concurrency}
    base = timings["bfcl_inprocess"]
    for name, seconds in timings.items():
        result[f"{name}_episodes_per_s"] = round(len(records) / seconds, 1)
        result[f"{name}_calls_per_s"] = round(calls / seconds, 1)
        if name != "bfcl_inprocess":
            result[f"{name}_ratio"] = round(base / seconds, 3)
    # The sandbox's cost per call, an upper bound: wall time inside run_episode_calls per call
    # with `concurrency` episodes in flight, the call's own work included; and per episode,
    # open (fork, the backends' construction) + state() + close.
    result["sandbox_ms_per_call"] = round(sandbox_calls_s / calls * 1e3, 3)
    result["sandbox_episode_open_close_ms"] = round(
        (sandbox_s - sandbox_calls_s) / len(records) * 1e3, 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
