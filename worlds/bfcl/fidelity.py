"""Replay bfcl-eval's ground truth through the trainer's sandbox and compare with bfcl-eval.

For each task, the ground-truth calls run twice: through bfcl-eval's own executor
(`execute_multi_turn_func_call`, on its call strings) and as a rollout runs them (one episode
of `BFCLEnvironment` in a sandboxed `ToolExecutor` worker, each turn's calls as one assistant
step, miss_func's held-out functions offered at their turn, callable before it as in
bfcl-eval). Three things must agree:

- observations: every call's observation text, byte for byte, with bfcl-eval's result string;
- states: the final backend state (public attributes of every instance);
- verdicts: the project's checker on the calls the episode ran (what a rollout records: calls
  whose status is "ok") against bfcl-eval's `multi_turn_checker` on its ground truth.

    python -m worlds.bfcl.fidelity [--max-result-chars N] [--workers N] [--limit N]

prints how many of the tasks match on each, and the first differences.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
from collections.abc import Sequence

from worlds.bfcl.convert import CATEGORIES, convert
from worlds.bfcl.environment import CALLS_KEY, BFCLEnvironment, instance_state

_RUNS = itertools.count()


def bfcl_reference(record: dict) -> tuple[list[list[str]], dict, bool]:
    """(observations per turn, final state, verdict) as bfcl-eval's own executor and checker
    produce them on the task's ground truth."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    name = f"fidelity_{next(_RUNS)}"
    environment = record["environment"]
    observations, instances = [], {}
    try:
        for calls in record["ground_truth"]:
            results, instances = multi_turn_utils.execute_multi_turn_func_call(
                calls, environment["initial_config"], environment["involved_classes"], name,
                record["id"], long_context=environment["long_context"])
            observations.append(results)
        state = json.loads(json.dumps({k: instance_state(v) for k, v in instances.items()}))
        verdict = multi_turn_checker([[t] if t else [] for t in record["ground_truth"]],
                                     record["ground_truth"], {"id": record["id"], **environment},
                                     record["family"], name)["valid"]
    finally:
        for key in [k for k in vars(multi_turn_utils) if k.startswith(name)]:
            del vars(multi_turn_utils)[key]
    return observations, state, bool(verdict)


def sandbox_replay(pool, records: Sequence[dict]) -> list[tuple[list[list[str]], dict, list]]:
    """(observations per turn, final state without its call log, calls_by_turn) of each
    record's ground truth replayed as a rollout runs it, all records' episodes at once."""
    from opd.data import tools_at_turn, withheld_tools
    from opd.tool_calls import ToolCall

    episodes = pool.open_episodes([r["environment"] for r in records],
                                  [tools_at_turn(r["tools"], r.get("tools_by_turn"), 0)
                                   for r in records],
                                  [withheld_tools(r.get("tools_by_turn")) for r in records])
    observations: list[list[list[str]]] = [[] for _ in records]
    calls_by_turn: list[list] = [[] for _ in records]
    for turn in range(max(len(r["ground_truth_calls"]) for r in records)):
        batch = {}
        for index, (episode, record) in enumerate(zip(episodes, records)):
            if turn >= len(record["ground_truth_calls"]):
                continue
            extra = (record.get("tools_by_turn") or [[]] * (turn + 1))[turn] if turn else []
            if extra:
                episode.offer(extra)
            calls = [ToolCall(c["name"], copy.deepcopy(c["arguments"]))
                     for c in record["ground_truth_calls"][turn]]
            observations[index].append([])
            calls_by_turn[index].append([])
            if calls:
                batch[episode] = (index, calls)
        replies = pool.run_episode_calls({e: calls for e, (_, calls) in batch.items()})
        for episode, results in replies.items():
            index, calls = batch[episode]
            observations[index][-1] = [result.content for result in results]
            calls_by_turn[index][-1] = [[{"name": c.name, "arguments": c.arguments}
                                         for c, r in zip(calls, results) if r.status == "ok"]]
    out = []
    for index, episode in enumerate(episodes):
        state = pool.episode_state(episode) or {}
        state.pop(CALLS_KEY, None)
        pool.close_episode(episode)
        out.append((observations[index], state, calls_by_turn[index]))
    return out


def compare(records: Sequence[dict], *, max_result_chars: int = 1 << 16, workers: int = 8,
            memory_limit_mb: int = 4096) -> list[dict]:
    """Per record: {"id", "observations", "state", "verdict" (each True when it matches),
    "difference": the first differing observation, or None, "isolation": the sandbox's
    (ToolExecutor.isolation)}."""
    from opd.tool_schemas import ToolRegistry
    from opd.tools import ToolExecutor
    from worlds.bfcl.checker import score

    rows = []
    with ToolExecutor(ToolRegistry([]), environment=BFCLEnvironment, num_workers=workers,
                      max_result_chars=max_result_chars, memory_limit_mb=memory_limit_mb,
                      max_calls_per_turn=64, timeout_s=60.0) as pool:
        for start in range(0, len(records), workers):
            chunk = records[start:start + workers]
            for record, (seen, state, turns) in zip(chunk, sandbox_replay(pool, chunk)):
                expected, expected_state, expected_verdict = bfcl_reference(record)
                difference = next(
                    ((a, b) for a, b in zip(itertools.chain(*seen), itertools.chain(*expected))
                     if a != b), None)
                rows.append({
                    "id": record["id"], "observations": seen == expected,
                    "state": state == expected_state,
                    "verdict": score(record, turns)["valid"] == expected_verdict,
                    "difference": difference, "isolation": pool.isolation})
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-result-chars", type=int, default=1 << 16)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--limit", type=int, default=0, help="the first N tasks per category")
    args = parser.parse_args(argv)
    records = convert()
    if args.limit:
        records = [r for c in CATEGORIES
                   for r in [x for x in records if x["family"] == c][:args.limit]]
    rows = compare(records, max_result_chars=args.max_result_chars, workers=args.workers)
    print(f"trainer uid {os.geteuid()}, sandbox isolation {rows[0]['isolation'] if rows else None}")
    for key in ("observations", "state", "verdict"):
        print(f"{key}: {sum(r[key] for r in rows)} of {len(rows)} match")
    print(f"all three: {sum(r['observations'] and r['state'] and r['verdict'] for r in rows)} "
          f"of {len(rows)}")
    for row in [r for r in rows if r["difference"]][:5]:
        ours, theirs = row["difference"]
        print(f"{row['id']}: ours {ours[:120]!r} / bfcl-eval {theirs[:120]!r}")


if __name__ == "__main__":
    main()
