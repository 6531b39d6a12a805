"""Per-call overhead of the tool sandbox: a stateless call (a fresh child forked per call)
against a call into a live episode of a stateful environment (one child per episode, no fork
per call). Trivial calls, so the figure is the sandbox's own cost. Prints one JSON line.

    python -m bench.tool_calls                 # 200 calls, 8 workers / 8 live episodes
    python -m bench.tool_calls --calls 1000 --workers 4

Run as a module from the checkout's root: the trivial tool and environment are the tests' own
(tests/tool_fixtures.py, tests/env_fixtures.py), imported by name in the workers.
"""

import argparse
import json
import time

from opd.tool_calls import ToolCall
from opd.tool_schemas import Tool, ToolRegistry
from opd.tools import ToolExecutor
from tests.env_fixtures import COUNTER_TOOLS, Counter
from tests.tool_fixtures import echo

GET = ToolCall("get", {})


def stateless(calls: int, workers: int) -> tuple[float, float]:
    """(ms per call with `workers` calls in flight, ms per call one at a time)."""
    schema = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
    with ToolExecutor(ToolRegistry([Tool(schema, echo)]), num_workers=workers) as pool:
        pool.run_batch([[GET]] * workers)  # start the workers
        started = time.perf_counter()
        for _ in range(calls // workers):
            pool.run_batch([[GET]] * workers)
        parallel = (time.perf_counter() - started) / calls
        started = time.perf_counter()
        for _ in range(calls):
            pool.run_batch([[GET]])
        return parallel * 1e3, (time.perf_counter() - started) / calls * 1e3


def episodes(calls: int, workers: int) -> tuple[float, float, float]:
    """(ms per call with `workers` live episodes, ms per call one at a time, ms to open and
    close an episode on a warm worker)."""
    with ToolExecutor(ToolRegistry([]), environment=Counter) as pool:
        live = pool.open_episodes([{}] * workers, [COUNTER_TOOLS] * workers)
        started = time.perf_counter()
        for _ in range(calls // workers):
            pool.run_episode_calls({episode: [GET] for episode in live})
        parallel = (time.perf_counter() - started) / calls
        started = time.perf_counter()
        for _ in range(calls):
            pool.run_episode_calls({live[0]: [GET]})
        sequential = (time.perf_counter() - started) / calls
        for episode in live:
            pool.close_episode(episode)
        started = time.perf_counter()
        for _ in range(20):
            (episode,) = pool.open_episodes([{}], [COUNTER_TOOLS])
            pool.close_episode(episode)
        lifecycle = (time.perf_counter() - started) / 20
        return parallel * 1e3, sequential * 1e3, lifecycle * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    stateless_ms, stateless_one_ms = stateless(args.calls, args.workers)
    episode_ms, episode_one_ms, lifecycle_ms = episodes(args.calls, args.workers)
    print(json.dumps({
        "calls": args.calls, "workers": args.workers,
        "stateless_ms_per_call": round(stateless_ms, 3),
        "episode_ms_per_call": round(episode_ms, 3),
        "stateless_ms_per_call_one_at_a_time": round(stateless_one_ms, 3),
        "episode_ms_per_call_one_at_a_time": round(episode_one_ms, 3),
        "episode_open_close_ms": round(lifecycle_ms, 3),
        "ratio_episode_vs_stateless": round(episode_ms / stateless_ms, 3),
    }))


if __name__ == "__main__":
    main()
