"""The sandbox around tool calls: process trees die with their call, the worker sees a scrubbed
environment and a fresh directory, cannot signal the trainer, keeps no state between calls, and
no call a student can write raises out of run_batch."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import sandbox_fixtures
import tool_fixtures

from opd.tool_calls import ToolCall, parse_hermes_tool_calls
from opd.tool_schemas import MAX_ARGUMENT_DEPTH, Tool, ToolRegistry
from opd.tools import ToolExecutor
from opd.trajectory import ToolCallCounts

TIMEOUT_S = 3.0
WAIT_S = 60.0  # generous: the machine may be loaded; only a broken sandbox waits this long


def _registry() -> ToolRegistry:
    return ToolRegistry([Tool(schema, fn) for schema, fn in
                         sandbox_fixtures.SANDBOX_TOOLS + tool_fixtures.TEST_TOOLS])


@pytest.fixture(scope="module")
def executor():
    with ToolExecutor(_registry(), timeout_s=TIMEOUT_S, num_workers=2) as pool:
        yield pool


def _run_one(executor, tool, **arguments):
    return executor.run_batch([[ToolCall(tool, arguments)]])[0][0]


def _with_token(token: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                pids.append(int(entry))
        except OSError:
            pass
    return pids


def _wait_until_gone(token: str) -> list[int]:
    """Pids still carrying `token` after WAIT_S (empty when all died)."""
    deadline = time.monotonic() + WAIT_S
    while (alive := _with_token(token)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


# ---------------------------------------------------------------- process trees


def test_processes_a_call_spawns_die_with_the_call(executor):
    token = f"opd-test-{uuid.uuid4()}"
    assert _run_one(executor, "spawn", token=token, wait=False).content == '"spawned"'
    assert _wait_until_gone(token) == []


def test_a_timed_out_call_takes_its_whole_tree_with_it(executor):
    token = f"opd-test-{uuid.uuid4()}"
    result = _run_one(executor, "spawn", token=token, wait=True)
    assert result.status == "failed" and "timed out" in json.loads(result.content)["error"]
    assert _wait_until_gone(token) == []
    assert _run_one(executor, "count_calls").status == "ok"


def test_close_and_trainer_death_end_every_worker_process(tmp_path):
    """A trainer killed mid-call (no close, no finalizer) leaves no tool process behind."""
    token = f"opd-test-{uuid.uuid4()}"
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        import test_sandbox
        from opd.tool_calls import ToolCall
        from opd.tools import ToolExecutor
        pool = ToolExecutor(test_sandbox._registry(), timeout_s=3600, num_workers=1)
        pool.run_batch([[ToolCall("spawn", {{"token": {token!r}, "wait": True}})]])
    """))
    tests_dir = str(Path(__file__).parent)
    trainer = subprocess.Popen([sys.executable, str(script)], env={
        **os.environ, "PYTHONPATH": os.pathsep.join([tests_dir, os.environ["PYTHONPATH"]])})
    try:
        deadline = time.monotonic() + WAIT_S
        while len(_with_token(token)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        # At least: a process the tool forks shows the token until it execs (a third, briefly).
        assert len(_with_token(token)) >= 2, "the tool never spawned its processes"
    finally:
        trainer.kill()
        trainer.wait()
    assert _wait_until_gone(token) == []


def test_close_removes_the_workers_directories():
    pool = ToolExecutor(_registry(), timeout_s=TIMEOUT_S, num_workers=2)
    cwd = json.loads(_run_one(pool, "environment").content)["cwd"]
    assert Path(cwd).is_dir()
    pool.close()
    assert not Path(cwd).exists()


# ---------------------------------------------------------------- environment and state


def test_worker_gets_a_scrubbed_environment_and_its_own_directory(monkeypatch):
    for secret in ("WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(secret, "hunter2")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    with ToolExecutor(_registry(), timeout_s=TIMEOUT_S, num_workers=1) as pool:
        seen = json.loads(_run_one(pool, "environment").content)
    env, cwd = seen["env"], seen["cwd"]
    assert "hunter2" not in json.dumps(env)
    assert env["PATH"] == os.environ["PATH"] and env["LC_ALL"] == "C.UTF-8"
    assert env["HOME"] == env["TMPDIR"] == cwd and cwd != os.getcwd()
    assert seen["files"] == []


def test_no_state_survives_a_call(executor):
    results = executor.run_batch([[ToolCall("count_calls", {})] * 6])[0]
    assert [r.content for r in results] == ["1"] * 6
    first = _run_one(executor, "write_file", name="state.txt")
    assert first.content == '["state.txt"]'
    assert json.loads(_run_one(executor, "environment").content)["files"] == []


def _signals_reaching_this_process(executor, tmp_path) -> list[int]:
    """Run a tool that signals its parent and whatever a /proc scan finds holding the trainer's
    marker file open; return the signals this process got."""
    received = []
    handlers = {signum: signal.signal(signum, lambda signum, frame: received.append(signum))
                for signum in (signal.SIGUSR1, signal.SIGTERM)}
    marker = f"opd-trainer-{uuid.uuid4()}"
    try:
        with open(tmp_path / marker, "w"):
            result = _run_one(executor, "signal_trainer", marker=marker)
            time.sleep(0.5)  # a signal sent would have arrived; none may
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    sent = {target.split("/")[0] for target, outcome in json.loads(result.content).items()
            if outcome == "sent"}
    # A call that runs as its worker's own user (the trainer is not root) may signal the
    # zygote, PID 1 of its namespace, which ignores it (see the test below); nothing else.
    assert result.status == "ok" and sent <= (set() if "uid:" in executor.isolation else {"1"})
    return received


def test_a_tool_cannot_signal_the_trainer(executor, tmp_path):
    assert _signals_reaching_this_process(executor, tmp_path) == []
    assert executor.isolation.startswith("pid-namespace")


def test_a_call_as_the_workers_own_user_cannot_end_its_worker():
    """A trainer that is not root runs calls as itself (`run_as=None` does so for root): a call
    may then signal its zygote, PID 1 of the namespace. The kernel drops such a signal unless
    the zygote handles it, and Python's SIGINT handler would raise KeyboardInterrupt there."""
    with ToolExecutor(_registry(), timeout_s=TIMEOUT_S, num_workers=1, run_as=None) as pool:
        assert _run_one(pool, "count_calls").content == "1"
        workers = pool.pids()
        if not pool.isolation.startswith("pid-namespace"):
            pytest.skip("without a PID namespace a call can signal its worker as its user")
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
            result = _run_one(pool, "signal_worker", signum=int(signum))
            assert (result.status, result.content) == ("ok", '"sent"'), signum
        assert pool.pids() == workers and _run_one(pool, "count_calls").content == "1"


@pytest.mark.skipif(os.geteuid() != 0, reason="without namespaces only root can change uid")
def test_without_namespaces_root_still_drops_to_nobody(tmp_path):
    with ToolExecutor(_registry(), timeout_s=TIMEOUT_S, num_workers=1, namespaces=False) as pool:
        with pytest.warns(RuntimeWarning, match="without a PID namespace.*cannot signal"):
            counts = pool.run_batch([[ToolCall("count_calls", {})] * 3])[0]
        assert pool.isolation == "uid:nobody" and [r.content for r in counts] == ["1"] * 3
        assert _signals_reaching_this_process(pool, tmp_path) == []
        timed_out = _run_one(pool, "sleep", seconds=600)
        assert "timed out" in json.loads(timed_out.content)["error"]
        assert _run_one(pool, "count_calls").content == "1"


# ---------------------------------------------------------------- student text


def _nested_call(depth: int) -> str:
    return ('<tool_call>{"name": "depth", "arguments": {"value": ' + "[" * depth + "]" * depth
            + "}}</tool_call>")


@pytest.mark.parametrize("depth", [100, 600, 999, 5000])
def test_deep_nesting_is_one_error_observation(executor, depth):
    calls = parse_hermes_tool_calls(_nested_call(depth))
    results = executor.run_batch([calls, [ToolCall("count_calls", {})]])
    assert [len(row) for row in results] == [1, 1] and results[1][0].content == "1"
    (result,) = results[0]
    if depth + 1 <= MAX_ARGUMENT_DEPTH:
        assert result.status == "ok" and result.content == str(depth)
    else:
        assert result.status == "invalid"  # too deep for the parser, or for the validator


def test_deep_arguments_built_in_code_are_invalid_too(executor):
    value: list = []
    for _ in range(20000):
        value = [value]
    (result,) = executor.run_batch([[ToolCall("depth", {"value": value})]])[0]
    assert result.status == "invalid"
    assert f"nested deeper than {MAX_ARGUMENT_DEPTH}" in json.loads(result.content)["error"]


def test_calls_over_the_per_turn_cap_are_not_run():
    with ToolExecutor(_registry(), timeout_s=TIMEOUT_S, num_workers=2,
                      max_calls_per_turn=2) as pool:
        rows = pool.run_batch([[ToolCall("sleep", {"seconds": 600})] * 5,
                               [ToolCall("count_calls", {})] * 3])
    assert [r.status for r in rows[0]] == ["failed"] * 2 + ["invalid"] * 3
    assert [r.status for r in rows[1]] == ["ok", "ok", "invalid"]
    assert "at most 2 tool calls per turn" in json.loads(rows[1][2].content)["error"]
    counts = ToolCallCounts()
    for row in rows:
        counts.add(row)
    assert (counts.valid, counts.invalid, counts.failed) == (2, 4, 2)


def test_scratch_directories_are_private_to_a_call(executor):
    """/tmp, /var/tmp and /dev/shm: what a call writes there is gone for the next call (of any
    episode) and never reaches the host's."""
    token = f"opd-scratch-{uuid.uuid4().hex}"
    written = _run_one(executor, "write_scratch", token=token)
    assert written.status == "ok", written.content
    if not (executor.isolation or "").startswith("pid-namespace"):
        pytest.skip(f"no mount namespace here ({executor.isolation}): scratch directories are "
                    "the host's (README: What a run survives)")
    assert json.loads(written.content) == ["/tmp", "/var/tmp", "/dev/shm"]
    for _ in range(2):  # both pool workers
        assert json.loads(_run_one(executor, "find_scratch", token=token).content) == []
    assert not any(os.path.exists(os.path.join(d, token)) for d in sandbox_fixtures.SCRATCH_DIRS)


def test_shared_memory_counts_against_the_memory_limit():
    token = f"opd-shm-{uuid.uuid4().hex}"
    with ToolExecutor(_registry(), timeout_s=30.0, num_workers=1, memory_limit_mb=64) as pool:
        result = _run_one(pool, "fill_shm", token=token, mb=256)
        assert result.status == "failed", result.content
        assert "No space left" in result.content or "File too large" in result.content
        assert json.loads(_run_one(pool, "find_scratch", token=token).content) == []
    assert not os.path.exists(os.path.join("/dev/shm", token))


def test_lazily_imported_standard_library_works_after_the_privilege_drop(executor):
    """datetime.strptime imports _strptime on first use; a call run as `nobody` may not read
    the interpreter's files (a Python under a 0700 home): the worker imports it beforehand."""
    result = _run_one(executor, "parse_date", text="2024-03-01")
    assert (result.status, result.content) == ("ok", '"2024-03-01T00:00:00"')
    if "uid:" in (executor.isolation or "") and "imports" not in executor.isolation:
        pytest.skip(f"no mount namespace here ({executor.isolation}): only the standard "
                    "library's own lazy imports are preloaded")
    # any module on the import path, not only those the standard library imports lazily
    result = _run_one(executor, "lazy_import", module="statistics")
    assert (result.status, result.content) == ("ok", '"statistics"')


def test_an_import_path_under_tmp_stays_importable_at_call_time(tmp_path, monkeypatch):
    """A project cloned under /tmp (or pytest's 0700 tmp_path) is on the worker's sys.path: the
    private /tmp keeps it reachable for the call's user, and remaking /tmp never touches it."""
    package = tmp_path / "late_imports"
    package.mkdir()
    (package / "late_module_for_sandbox.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(package))
    with ToolExecutor(_registry(), timeout_s=30.0, num_workers=1) as pool:
        for _ in range(2):  # the second call runs in a remade /tmp
            result = _run_one(pool, "lazy_import", module="late_module_for_sandbox")
            assert (result.status, result.content) == ("ok", '"late_module_for_sandbox"')
            # a token no checkout path under /tmp is named (a clone at /tmp/x is bound there)
            assert _run_one(pool, "write_scratch", token="opd-scratch-probe").status == "ok"
    assert (package / "late_module_for_sandbox.py").read_text() == "VALUE = 42\n"
