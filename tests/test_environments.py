"""Stateful environments through the sandboxed executor: each episode owns one process for its
whole conversation, never sees another's state, and loses only itself when it dies."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid

import pytest
from env_fixtures import (
    COUNTER_TOOLS,
    SCRATCH_TOOLS,
    BrokenConstructor,
    Counter,
    EarlyCounter,
    FailingPreload,
    HangingConstructor,
    HangingPreload,
    Preloaded,
    Scratch,
    schema,
)
from sandbox_fixtures import SANDBOX_TOOLS

from opd.checker import EpisodeOutcome, call_checker
from opd.config import load_config
from opd.errors import ConfigError
from opd.plugins import resolve_plugins
from opd.tool_calls import ToolCall
from opd.tool_schemas import Tool, ToolRegistry
from opd.tools import ENVIRONMENT_DIED, ENVIRONMENT_START_FAILED, ToolExecutor


@pytest.fixture(scope="module")
def executor():
    with ToolExecutor(ToolRegistry([]), environment=Counter, timeout_s=2.0) as pool:
        yield pool


def add(by=1) -> ToolCall:
    return ToolCall("add", {"by": by})


def contents(results) -> list:
    return [json.loads(result.content) for result in results]


def test_interleaved_episodes_see_only_their_own_state(executor):
    first, second = executor.open_episodes([{}, {"start": 100}], [COUNTER_TOOLS] * 2)
    try:
        for _ in range(3):  # both episodes' calls run in the same exchanges, interleaved
            results = executor.run_episode_calls({first: [add(1), add(1)], second: [add(10)]})
            assert [r.status for r in results[first] + results[second]] == ["ok"] * 3
        assert contents(results[first]) == [{"count": 5}, {"count": 6}]
        assert contents(results[second]) == [{"count": 130}]
        assert executor.episode_state(first) == {"count": 6, "log": [1] * 6}
        assert executor.episode_state(second) == {"count": 130, "log": [10] * 3}
    finally:
        executor.close_episode(first)
        executor.close_episode(second)
    # a later episode starts from its own config, whatever worker it reuses
    (third,) = executor.open_episodes([{}], [COUNTER_TOOLS])
    assert contents(executor.run_episode_calls({third: [ToolCall("get", {})]})[third]) == \
        [{"count": 0}]
    executor.close_episode(third)


def test_episodes_called_from_two_threads_run_at_once(executor):
    """The rollout's tool lane calls from several threads: one episode's slow call does not hold
    up another's (completion order, not a duration, is what is checked)."""
    nap = schema("nap", seconds={"type": "number"})
    slow, quick = executor.open_episodes([{}, {}], [[*COUNTER_TOOLS, nap]] * 2)
    finished = []

    def run(episode, call):
        executor.run_episode_calls({episode: [call]})
        finished.append(episode)

    try:
        napping = threading.Thread(target=run, args=(slow, ToolCall("nap", {"seconds": 1.5})))
        napping.start()
        time.sleep(0.3)  # the nap is under way
        run(quick, add(1))
        napping.join()
        assert finished == [quick, slow]
        assert executor.episode_state(quick) == {"count": 1, "log": [1]}
    finally:
        executor.close_episode(slow)
        executor.close_episode(quick)


def test_a_worker_killed_mid_episode_ends_only_that_episode(executor):
    doomed, other = executor.open_episodes([{}, {}], [COUNTER_TOOLS] * 2)
    executor.run_episode_calls({doomed: [add()], other: [add()]})
    os.killpg(doomed.worker_pid, signal.SIGKILL)  # the whole worker tree, from outside
    results = executor.run_episode_calls({doomed: [add(), add()], other: [add()]})
    assert [r.status for r in results[doomed]] == ["failed", "failed"]
    assert "error" in json.loads(results[doomed][0].content)
    assert doomed.end_reason == ENVIRONMENT_DIED and "died" in doomed.error
    assert executor.episode_state(doomed) is None
    assert contents(results[other]) == [{"count": 2}]
    assert other.alive and executor.episode_state(other) == {"count": 2, "log": [1, 1]}
    for episode in (doomed, other):
        executor.close_episode(episode)


def test_a_call_that_crashes_or_hangs_ends_its_episode(executor):
    crashing, hanging, fine = executor.open_episodes([{}, {}, {}], [COUNTER_TOOLS] * 3)
    started = time.monotonic()
    results = executor.run_episode_calls({crashing: [add(), ToolCall("crash", {}), add()],
                                          hanging: [ToolCall("hang", {})], fine: [add()]})
    assert time.monotonic() - started < 2.0 + 5.0  # the call's timeout, not the hang
    assert [r.status for r in results[crashing]] == ["ok", "failed", "failed"]
    assert "crashed" in json.loads(results[crashing][1].content)["error"]
    assert "timed out after 2 s" in json.loads(results[hanging][0].content)["error"]
    assert crashing.end_reason == hanging.end_reason == ENVIRONMENT_DIED
    assert contents(results[fine]) == [{"count": 1}] and fine.alive
    for episode in (crashing, hanging, fine):
        executor.close_episode(episode)
    # the workers whose episode child died serve the next episodes, from a clean state
    episodes = executor.open_episodes([{}, {}, {}], [COUNTER_TOOLS] * 3)
    results = executor.run_episode_calls({e: [ToolCall("get", {})] for e in episodes})
    assert [contents(results[e]) for e in episodes] == [[{"count": 0}]] * 3
    for episode in episodes:
        executor.close_episode(episode)


def test_a_raising_tool_is_an_error_observation_and_the_state_lives_on(executor):
    (episode,) = executor.open_episodes([{}], [COUNTER_TOOLS])
    results = executor.run_episode_calls({episode: [add(), ToolCall("fail", {}), add()]})[episode]
    assert [r.status for r in results] == ["ok", "failed", "ok"]
    assert json.loads(results[1].content) == {"error": "tool 'fail' raised ValueError: "
                                                       "asked to fail"}
    assert episode.alive and executor.episode_state(episode)["count"] == 2
    executor.close_episode(episode)


def test_wrong_argument_types_are_invalid_and_never_reach_the_environment(executor):
    (episode,) = executor.open_episodes([{}], [COUNTER_TOOLS])
    calls = [ToolCall("add", {"by": "two"}), ToolCall("add", {"times": 2}),
             ToolCall("reset", {}), add(3)]
    results = executor.run_episode_calls({episode: calls})[episode]
    assert [r.status for r in results] == ["invalid", "invalid", "invalid", "ok"]
    assert "argument 'by' must be of type integer" in json.loads(results[0].content)["error"]
    assert "unknown tool 'reset'" in json.loads(results[2].content)["error"]
    assert executor.episode_state(episode) == {"count": 3, "log": [3]}
    executor.close_episode(episode)


def test_tools_offered_later_become_callable_from_then_on(executor):
    get_only = [s for s in COUNTER_TOOLS if s["function"]["name"] == "get"]
    (episode,) = executor.open_episodes([{}], [get_only])
    assert executor.run_episode_calls({episode: [add()]})[episode][0].status == "invalid"
    episode.offer([s for s in COUNTER_TOOLS if s["function"]["name"] == "add"])
    assert executor.run_episode_calls({episode: [add()]})[episode][0].status == "ok"
    executor.close_episode(episode)


def test_withheld_tools_run_before_their_turn_only_where_the_environment_says_so(executor):
    """BFCL's executor runs a miss_func function before the turn that offers it; an environment
    says so with RUNS_WITHHELD_TOOLS. Elsewhere a tool runs only once offered."""
    get_only = [s for s in COUNTER_TOOLS if s["function"]["name"] == "get"]
    later = [s for s in COUNTER_TOOLS if s["function"]["name"] == "add"]
    (refused,) = executor.open_episodes([{}], [get_only], [later])
    assert executor.run_episode_calls({refused: [add()]})[refused][0].status == "invalid"
    executor.close_episode(refused)
    with ToolExecutor(ToolRegistry([]), environment=EarlyCounter, timeout_s=2.0) as pool:
        (early,) = pool.open_episodes([{}], [get_only], [later])
        results = pool.run_episode_calls({early: [add(2), add("two"), ToolCall("fail", {})]})
        assert [r.status for r in results[early]] == ["ok", "invalid", "invalid"]
        assert "must be of type integer" in json.loads(results[early][1].content)["error"]
        # an error never names a tool the conversation has not offered yet
        assert "'add'" not in json.loads(results[early][2].content)["error"]
        assert pool.episode_state(early) == {"count": 2, "log": [2]}
        pool.close_episode(early)


@pytest.mark.parametrize("environment, words", [(BrokenConstructor, "raised RuntimeError"),
                                                (HangingConstructor, "timed out")])
def test_a_constructor_that_raises_or_hangs_ends_only_its_episode(environment, words):
    with ToolExecutor(ToolRegistry([]), environment=environment, timeout_s=1.0) as pool:
        episodes = pool.open_episodes([{"seed": 1}, {"seed": 2}], [[], []])
        assert [e.end_reason for e in episodes] == [ENVIRONMENT_START_FAILED] * 2
        assert words in episodes[0].error and "constructor" in episodes[0].error
    with ToolExecutor(ToolRegistry([]), environment=Counter) as pool:
        bad, good = pool.open_episodes([{"start": "many"}, {}], [COUNTER_TOOLS] * 2)
        assert bad.end_reason == ENVIRONMENT_START_FAILED
        assert "Counter raised ValueError" in bad.error
        assert good.alive and pool.run_episode_calls({good: [add()]})[good][0].status == "ok"


def test_preload_runs_once_per_worker_before_its_episodes_fork():
    with ToolExecutor(ToolRegistry([]), environment=Preloaded, num_workers=2) as pool:
        first, second = pool.open_episodes([{}, {}], [COUNTER_TOOLS] * 2)
        seen = pool.run_episode_calls({first: [ToolCall("get", {})],
                                       second: [ToolCall("get", {})]})
    for episode in (first, second):
        (reply,) = contents(seen[episode])
        # loaded by the worker's zygote (not this process, not the episode's own child)
        assert reply["loaded_in_pid"] not in (None, os.getpid(), reply["episode_pid"])


def test_a_failing_preload_stops_before_any_episode_with_its_reason():
    with ToolExecutor(ToolRegistry([]), environment=FailingPreload) as pool, \
            pytest.raises(RuntimeError, match=r"FailingPreload.preload\(\) raised "
                                               r"FileNotFoundError.*scenarios.json"):
        pool.open_episodes([{}], [COUNTER_TOOLS])


def test_stateless_tools_are_trivial_episodes_with_fresh_state():
    registry = ToolRegistry([Tool(schema, fn) for schema, fn in SANDBOX_TOOLS])
    with ToolExecutor(registry, num_workers=1) as pool:
        episodes = pool.open_episodes([{}, {}], [registry.schemas] * 2)
        assert not any(e.stateful for e in episodes) and pool.pids() == []
        for _ in range(2):  # a module global never survives a call, let alone an episode
            results = pool.run_episode_calls({e: [ToolCall("count_calls", {})] * 2
                                              for e in episodes})
            assert [r.content for e in episodes for r in results[e]] == ["1"] * 4
        assert pool.episode_state(episodes[0]) is None
        for episode in episodes:
            pool.close_episode(episode)


def test_the_recipe_names_an_environment_class(tmp_path):
    def plugins(**tools):
        return resolve_plugins(load_config(None, None, [f"tools.{k}={v}"
                                                        for k, v in tools.items()],
                                           complete=False))

    assert plugins(environment="env_fixtures:Counter").environment is Counter
    with pytest.raises(ConfigError, match="tools.environment .*not a class"):
        plugins(environment="env_fixtures:schema")
    with pytest.raises(ConfigError, match="exclusive"):
        plugins(environment="env_fixtures:Counter",
                registry="worlds.toolcalc.tools:registry")
    with pytest.raises(ConfigError, match="no module"):
        plugins(environment="no_such_module:Env")


def test_checkers_may_take_the_final_state():
    episode = EpisodeOutcome({"n": 1}, [[[{"name": "add", "arguments": {"k": 1}}]]])
    assert call_checker(lambda text, record: text == "a", "a", {}, episode)
    assert call_checker(lambda text, record, ep: ep.state == {"n": 1}, "", {}, episode)
    assert call_checker(lambda *args: len(args) == 3, "", {}, episode)


def test_a_hanging_preload_is_reported_naming_the_environment():
    with ToolExecutor(ToolRegistry([]), environment=HangingPreload, start_timeout_s=10.0) as pool, \
            pytest.raises(RuntimeError, match=r"HangingPreload.preload\(\) \(tools.environment\) "
                                               r"had not returned"):
        pool.open_episodes([{}], [COUNTER_TOOLS])


def test_an_episodes_scratch_files_die_with_it():
    """/tmp, /var/tmp and /dev/shm are the episode's own: kept across its calls, gone for the
    next episode on the same worker, never on the host; strptime works as the sandbox user."""
    token = f"opd-episode-scratch-{uuid.uuid4().hex}"
    with ToolExecutor(ToolRegistry([]), environment=Scratch, num_workers=1) as pool:
        first = pool.open_episodes([{}], [SCRATCH_TOOLS])[0]
        replies = pool.run_episode_calls({first: [ToolCall("write", {"token": token}),
                                                  ToolCall("find", {"token": token}),
                                                  ToolCall("date", {"text": "2024-03-01"})]})
        written, found, date = contents(replies[first])
        assert date == "2024-03-01T00:00:00"
        if not pool.isolation.startswith("pid-namespace"):
            pytest.skip(f"no mount namespace here ({pool.isolation})")
        assert written == found == ["/tmp", "/var/tmp", "/dev/shm"]
        worker = first.worker_pid
        pool.close_episode(first)
        second = pool.open_episodes([{}], [SCRATCH_TOOLS])[0]
        assert second.worker_pid == worker  # the same worker serves the next episode
        (found,) = contents(pool.run_episode_calls({second: [ToolCall("find",
                                                                      {"token": token})]})[second])
        assert found == []
        pool.close_episode(second)
    assert not any(os.path.exists(os.path.join(d, token)) for d in ("/tmp", "/var/tmp", "/dev/shm"))
