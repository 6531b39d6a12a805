"""The sandboxed executor: runs the student's tool calls (opd.tool_calls, opd.tool_schemas).

A tool call must never cost the rank. A call that does not parse, does not match its tool's
schema, nests deeper than MAX_ARGUMENT_DEPTH (opd.tool_schemas) or is over the turn's
`max_calls_per_turn` is "invalid"; a call that hangs, raises, kills its process, prints without
end, allocates wildly or returns something JSON cannot hold is "failed". Either way the student
sees one `{"error": "..."}` observation. Every result content is a JSON text of at most
`max_result_chars` characters: an over-long result becomes `{"truncated": "<prefix of its JSON>"}`
(the seed cut the JSON text mid-token instead). How a call is sandboxed, and what a tool can
still do, is told in opd.tool_worker.

Every conversation is an *episode* (`open_episodes` ... `close_episode`). With stateless tools
(a `ToolRegistry`, `environment=None`) an episode is trivial: each call runs in a fresh child of
its own, so no call, let alone another episode, ever sees what an earlier call left (fresh state
per episode holds a fortiori), and calls run through `run_batch` exactly as before. With a
stateful environment (opd.environments) each episode owns one sandboxed process for its whole
life; see `ToolExecutor.open_episodes`.
"""

import json
import multiprocessing.connection
import os
import pickle
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opd import tool_worker
from opd.config import MAX_CALLS_PER_TURN, MIN_MEMORY_LIMIT_MB, MIN_RESULT_CHARS
from opd.environments import Environment, check_environment
from opd.tool_calls import ToolCall
from opd.tool_schemas import ToolRegistry, validate_call


@dataclass
class ToolResult:
    content: str   # JSON text shown to the student (or an environment's TEXT_OBSERVATIONS
    #                text as it is), at most max_result_chars characters
    status: str    # "ok" | "invalid" | "failed"


# The launcher is a fresh interpreter, not a fork (the parent may be a trainer rank with threads)
# nor a multiprocessing spawn (which would re-import the trainer script, torch included).
_WORKER_BOOTSTRAP = ("import sys; sys.path[:] = sys.argv[4:]; from opd.tool_worker import launch; "
                     "launch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == 'namespaces')")

# The only variables a worker inherits (and LC_*); HOME and TMPDIR are its own directory.
SANDBOX_ENV = ("PATH", "LD_LIBRARY_PATH", "LANG", "LANGUAGE", "TZ", "PYTHONHASHSEED",
               "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE")
# A worker enforces each call's timeout itself; the trainer gives up on it only this much later.
_REPLY_GRACE_S = 10.0

_warned_isolation: set[str] = set()


def _sandbox_env(workdir: str, pass_env: Sequence[str]) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key in SANDBOX_ENV or key.startswith("LC_") or key in pass_env}
    env.update(HOME=workdir, TMPDIR=workdir, PWD=workdir)
    return env


class _Worker:
    """Parent-side handle of one worker process tree; its socket reaches EOF when it dies."""

    def __init__(self, setup: bytes, start_timeout_s: float, pass_env: Sequence[str],
                 owner: tuple[int, int] | None, namespaces: bool):
        self.workdir = tempfile.mkdtemp(prefix="opd-tool-worker-")
        if owner:  # tool calls run as this user and write here
            os.chown(self.workdir, *owner)
        parent_socket, child_socket = socket.socketpair()
        # Slurm's warning signal (USR1) reaches every process of a job step and would kill a
        # worker mid-call; the worker inherits it blocked (the mask survives fork and exec).
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        try:
            with child_socket:
                self.process = subprocess.Popen(
                    [sys.executable, "-c", _WORKER_BOOTSTRAP, str(child_socket.fileno()),
                     str(os.getpid()), "namespaces" if namespaces else "-",
                     *map(os.path.abspath, sys.path)],  # its cwd is not ours
                    pass_fds=(child_socket.fileno(),), stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, cwd=self.workdir,
                    env=_sandbox_env(self.workdir, pass_env),
                    start_new_session=True)  # Ctrl-C is for the parent; killed as a group
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self.conn = multiprocessing.connection.Connection(parent_socket.detach())
        self.conn.send_bytes(setup)
        self.isolation: str | None = None  # set by its ready message
        # The request in flight: (index in the flat batch, tool name) of a pool worker's call,
        # the Episode of an episode worker's; None when idle.
        self.job: Any = None
        self.deadline = time.monotonic() + start_timeout_s

    def stop(self) -> int:
        """Kill its process group (a no-op when it already exited), reap, remove its directory;
        returns the exit code. Its PID namespace, if any, dies with the zygote."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.conn.close()
        exit_code = self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
        return exit_code


def _answered(results: list[ToolResult | None]) -> list[ToolResult]:
    """Results once every placeholder of a batch is filled in."""
    assert all(result is not None for result in results), "a call got no result"
    return [result for result in results if result is not None]


def _stop_workers(*pools: list[_Worker]) -> None:
    for workers in pools:
        for worker in workers:
            worker.stop()
        workers.clear()


# Truncation reasons of an episode whose environment is gone (AgentTrajectory.truncation_reason).
ENVIRONMENT_START_FAILED = "environment_start_failed"  # its constructor raised or hung
ENVIRONMENT_DIED = "environment_died"  # its process hung past a call's timeout or crashed


class Episode:
    """Handle of one conversation's environment (see ToolExecutor.open_episodes).

    `tools`: the schemas offered so far (grown by `offer`); `withheld`: those its record offers
    only at a later user turn, which calls may already name when the environment has
    RUNS_WITHHELD_TOOLS (opd.environments).
    `end_reason` / `error`: None while the environment lives; else ENVIRONMENT_START_FAILED or
    ENVIRONMENT_DIED and the sentence saying why. Hashable by identity."""

    def __init__(self, tools: Sequence[dict] | None, worker: _Worker | None = None):
        self.tools: list[dict] = list(tools or [])
        self.withheld: list[dict] = []
        self.worker = worker
        self.end_reason: str | None = None
        self.error: str | None = None
        self.closed = False

    @property
    def stateful(self) -> bool:
        return self.worker is not None or self.end_reason is not None

    @property
    def alive(self) -> bool:
        return self.end_reason is None and not self.closed

    @property
    def worker_pid(self) -> int | None:
        """The launcher process at the root of the episode's worker tree (None when trivial)."""
        return self.worker.process.pid if self.worker is not None else None

    def schemas_for(self, call: ToolCall) -> dict[str, dict]:
        """The schemas by name `call` is validated against: those offered, or only its own
        when it names a withheld tool (an error never names a tool not offered yet)."""
        offered = {schema["function"]["name"]: schema for schema in self.tools}
        if call.name not in offered:
            for schema in self.withheld:
                if schema["function"]["name"] == call.name:
                    return {call.name: schema}
        return offered

    def offer(self, schemas: Sequence[dict]) -> None:
        """Make more tools available from now on (a record's `tools_by_turn`)."""
        self.tools.extend(schemas)

    def _end(self, reason: str, error: str) -> None:
        if self.end_reason is None:
            self.end_reason, self.error = reason, error


class ToolExecutor:
    """A pool of sandboxed workers (see opd.tool_worker) with a wall-clock timeout per call;
    never raises for a tool's or a student's fault. Workers start on first use and are reused;
    each call runs in a fresh child whose process tree, files and globals die with it. A worker
    that dies is replaced. Each call has `memory_limit_mb` of address space beyond the worker's
    start-up footprint, no stdout/stderr, only the SANDBOX_ENV variables (and `pass_env`), and
    runs as `run_as` when the trainer is root (None: stay root), in PID and mount namespaces of
    its worker where the kernel allows them and `namespaces` is set; `isolation` says what is in
    force. At most `max_calls_per_turn` calls of one row run; the others are invalid. Safe to
    call from any thread, and calls from several threads run at once: `run_batch` on the pool
    workers it claims (waiting for one when all are busy), `run_episode_calls` on its episodes'
    own workers."""

    def __init__(self, registry: ToolRegistry, *, timeout_s: float = 10.0,
                 max_result_chars: int = 2048, num_workers: int = 2, memory_limit_mb: int = 1024,
                 start_timeout_s: float = 60.0, max_calls_per_turn: int = MAX_CALLS_PER_TURN,
                 run_as: str | None = "nobody", pass_env: Sequence[str] = (),
                 namespaces: bool = True, environment: type[Environment] | None = None):
        if min(timeout_s, num_workers, start_timeout_s, max_calls_per_turn) <= 0:
            raise ValueError("ToolExecutor timeout_s, num_workers, start_timeout_s and "
                             "max_calls_per_turn must be positive")
        if memory_limit_mb < MIN_MEMORY_LIMIT_MB or max_result_chars < MIN_RESULT_CHARS:
            raise ValueError(f"ToolExecutor memory_limit_mb must be at least "
                             f"{MIN_MEMORY_LIMIT_MB} and max_result_chars at least "
                             f"{MIN_RESULT_CHARS} (got {memory_limit_mb}, {max_result_chars})")
        user = None
        if run_as is not None and os.geteuid() == 0:
            try:
                entry = pwd.getpwnam(run_as)
            except KeyError:
                raise ValueError(f"ToolExecutor run_as: no user named {run_as!r}") from None
            user = (run_as, entry.pw_uid, entry.pw_gid)
        if environment is not None:
            check_environment(environment)
        self.registry = registry
        self.environment = environment
        self.timeout_s = timeout_s
        self.max_result_chars = max_result_chars
        self.num_workers = num_workers
        self.start_timeout_s = start_timeout_s
        self.max_calls_per_turn = max_calls_per_turn
        self.pass_env = tuple(pass_env)
        self.namespaces = namespaces
        self.isolation: str | None = None  # what the workers could set up; known once started
        self._owner = user[1:] if user else None
        functions = {tool.name: tool.fn for tool in registry.tools}
        self._setup = pickle.dumps((functions, environment, max_result_chars, memory_limit_mb,
                                    timeout_s, user))
        self._workers: list[_Worker] = []  # the pool of stateless calls
        self._free: list[_Worker] = []  # pool workers no call in flight has claimed
        self._episode_workers: list[_Worker] = []  # one per live episode, plus idle ones
        self._idle: list[_Worker] = []
        # Guards the lists above and `_closed`; worker I/O of a call runs outside it.
        self._lock = threading.RLock()
        self._pool_changed = threading.Condition(self._lock)
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers,
                                           self._episode_workers)

    def __enter__(self) -> "ToolExecutor":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._finalizer()
            self._free.clear()
            self._pool_changed.notify_all()

    def pids(self) -> list[int]:
        """The workers' launcher processes: each the root of its worker's process tree."""
        with self._lock:
            return [worker.process.pid for worker in self._workers + self._episode_workers]

    # ------------------------------------------------------------------------------ episodes

    def open_episodes(self, configs: Sequence[Any], tools: Sequence[Sequence[dict] | None],
                      withheld: Sequence[Sequence[dict]] = ()) -> list[Episode]:
        """One episode per conversation: `configs[i]` is its record's "environment" value ({}
        when absent), `tools[i]` the schemas it offers at its start, `withheld[i]` those it
        offers only at later user turns (callable from the start when the environment has
        RUNS_WITHHELD_TOOLS, else ignored).

        Stateless tools: trivial handles, nothing starts. An environment: each episode gets a
        worker of its own (idle ones are reused), whose zygote forks one child that constructs
        `environment(config)` and keeps it until `close_episode`. An episode whose constructor
        raises or hangs past `timeout_s` comes back ended (ENVIRONMENT_START_FAILED, `error`
        says why); the others are unaffected. Raises only when a worker cannot start at all
        (the environment's module does not import), as `run_batch` does."""
        episodes = [Episode(schemas) for schemas in tools]
        if self.environment is None:
            return episodes
        if getattr(self.environment, "RUNS_WITHHELD_TOOLS", False):
            for episode, later in zip(episodes, withheld):
                episode.withheld = list(later)
        requests = {}
        with self._lock:
            self._check_open()
            for episode, config in zip(episodes, configs):
                episode.worker = self._idle.pop() if self._idle else self._new_episode_worker()
                requests[episode] = deque([json.dumps({"op": "open",
                                                       "config": config or {}}).encode()])
            replies = self._exchange(requests, "the environment's constructor")
        for episode, reply in replies.items():
            status, content = reply[0]
            if status != "ok" and episode.alive:
                episode._end(ENVIRONMENT_START_FAILED, json.loads(content)["error"])
        for episode in episodes:
            if episode.end_reason == ENVIRONMENT_DIED:  # hung or crashed while constructing
                episode.end_reason = ENVIRONMENT_START_FAILED
        return episodes

    def validate_call(self, episode: Episode, call: ToolCall) -> str | None:
        """Why `call` is invalid in `episode` (None: valid): the registry's check for stateless
        tools, else the episode's (Episode.schemas_for)."""
        if episode.stateful:
            return validate_call(call, episode.schemas_for(call),
                                 getattr(self.environment, "CHECK_ARGUMENT_TYPES", True))
        return self.registry.validate(call)

    def run_episode_calls(self, calls: dict[Episode, list[ToolCall]]
                          ) -> dict[Episode, list[ToolResult]]:
        """Each episode's calls, in order, in its own environment; episodes run concurrently.

        Validation, `max_calls_per_turn` and result caps as in `run_batch` (stateless episodes
        go through it unchanged). A call that hangs past `timeout_s` or crashes its episode's
        process gets a "failed" result, and the episode ends (ENVIRONMENT_DIED): its state is
        gone, its later calls of the turn are not run (failed), and other episodes go on."""
        trivial = [episode for episode in calls if not episode.stateful]
        results: dict[Episode, list[ToolResult | None]] = {}
        if trivial:
            results.update(zip(trivial, map(list, self.run_batch([calls[e] for e in trivial]))))
        stateful = [episode for episode in calls if episode.stateful]
        if not stateful:
            return {episode: _answered(row) for episode, row in results.items()}
        requests: dict[Episode, deque[bytes]] = {}
        for episode in stateful:
            row: list[ToolResult | None] = []
            requests[episode] = deque()
            for position, call in enumerate(calls[episode]):
                if not episode.alive:
                    row.append(self._error(f"tool {call.name!r} was not run: the environment "
                                           f"of this episode is gone ({episode.error})",
                                           "failed"))
                    continue
                error = self._call_error(call, position, episode)
                if error is None:
                    try:
                        requests[episode].append(json.dumps(
                            {"op": "call", "name": call.name, "arguments": call.arguments}
                        ).encode())
                        row.append(None)
                        continue
                    except (TypeError, ValueError, RecursionError) as exc:
                        error = f"arguments of tool {call.name!r} are not JSON values: {exc}"
                row.append(self._error(error, "invalid"))
            results[episode] = row
        with self._lock:
            self._check_open()
        replies = self._exchange({e: q for e, q in requests.items() if q}, "a tool call")
        for episode, reply in replies.items():
            row, answers = results[episode], iter(reply)
            for index, result in enumerate(row):
                if result is None:
                    status, content = next(answers, ("died", ""))
                    if status == "died":
                        content = content or self._error(
                            f"tool {calls[episode][index].name!r} was not run: the environment "
                            f"of this episode is gone ({episode.error})", "failed").content
                        status = "failed"
                    row[index] = ToolResult(content, status)
        return {episode: _answered(row) for episode, row in results.items()}

    def episode_state(self, episode: Episode) -> Any:
        """The environment's final `state()` as JSON values (for the checker); None for a
        trivial episode, one whose environment is gone, or whose state() raised or is not JSON."""
        if not episode.stateful or not episode.alive:
            return None
        with self._lock:
            self._check_open()
            replies = self._exchange({episode: deque([json.dumps({"op": "state"}).encode()])},
                                     "the environment's state()")
        status, content = replies[episode][0]
        return json.loads(content) if status == "ok" else None

    def close_episode(self, episode: Episode) -> None:
        """End the episode: its environment's close() runs (if it has one), then everything its
        process started is killed and its directory emptied; the worker serves a later episode.
        Idempotent."""
        if episode.closed:
            return
        episode.closed = True
        worker, episode.worker = episode.worker, None
        if worker is None:
            return
        with self._lock:
            if self._closed or worker not in self._episode_workers:
                return
            if worker.process.poll() is None:
                probe = Episode(None, worker)
                replies = self._exchange({probe: deque([json.dumps({"op": "close"}).encode()])},
                                         "closing the environment")
                if replies[probe] and replies[probe][0][0] == "closed":
                    self._idle.append(worker)
                    return
            self._retire(worker)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ToolExecutor is closed")

    def _call_error(self, call: ToolCall, position: int, episode: Episode | None = None
                    ) -> str | None:
        """Why the call at `position` of its turn is not run (None: it runs); without an
        episode, against the registry."""
        if position >= self.max_calls_per_turn:
            return (f"tool call {position + 1} of this turn was not run: at most "
                    f"{self.max_calls_per_turn} tool calls per turn")
        return self.registry.validate(call) if episode is None else self.validate_call(episode, call)

    def _new_episode_worker(self) -> _Worker:
        worker = self._new_worker()
        self._episode_workers.append(worker)
        return worker

    def _retire(self, worker: _Worker) -> None:
        worker.stop()
        with self._lock:
            if worker in self._episode_workers:
                self._episode_workers.remove(worker)
            if worker in self._idle:
                self._idle.remove(worker)

    def _exchange(self, requests: dict[Episode, deque[bytes]], what: str
                  ) -> dict[Episode, list[tuple[str, str]]]:
        """Send each episode's requests to its worker one at a time, in order, all episodes
        concurrently; the (status, content) replies per episode. A worker that dies or passes
        its deadline is retired and its episode ended (ENVIRONMENT_DIED); its remaining
        requests get no reply."""
        replies: dict[Episode, list[tuple[str, str]]] = {episode: [] for episode in requests}
        try:
            while True:
                for episode, queue in requests.items():
                    worker = episode.worker
                    if worker is None or worker.job is not None or not queue \
                            or not worker.isolation:
                        continue
                    if not self._send(worker, episode, queue.popleft()):
                        self._worker_died(episode, what, queue)
                waiting = [episode.worker for episode in requests if episode.worker is not None
                           and (episode.worker.job is not None or not episode.worker.isolation)]
                if not waiting:
                    return replies
                for _, episode, status, content in self._receive(waiting):
                    if status in ("crashed", "timed_out"):
                        self._worker_died(episode, what, requests[episode],
                                          timed_out=status == "timed_out")
                        continue
                    replies[episode].append((status, content))
                    if status == "died":
                        episode._end(ENVIRONMENT_DIED, json.loads(content)["error"])
                        requests[episode].clear()
        except BaseException:  # e.g. Ctrl-C: replies in flight would land in a later exchange
            for episode in requests:
                worker = episode.worker
                if worker is not None and (worker.job is not None or requests[episode]):
                    self._retire(worker)
                    episode.worker = None
                    episode._end(ENVIRONMENT_DIED, f"interrupted during {what}")
            raise

    def _worker_died(self, episode: Episode, what: str, queue: deque, *,
                     timed_out: bool = False) -> None:
        worker = episode.worker
        assert worker is not None
        exit_code = worker.process.poll()
        self._retire(worker)
        episode.worker = None
        queue.clear()
        episode._end(ENVIRONMENT_DIED,
                     f"the episode's worker did not answer {what} within "
                     f"{self.timeout_s + _REPLY_GRACE_S:g} s" if timed_out else
                     f"the episode's worker process died during {what} (exit code {exit_code})")

    def run_batch(self, calls_per_row: list[list[ToolCall]]) -> list[list[ToolResult]]:
        """Results in the same nesting and order; all valid calls of all rows run concurrently."""
        with self._lock:
            self._check_open()
        flat = [(call, position) for row in calls_per_row
                for position, call in enumerate(row)]
        results: list[ToolResult | None] = [None] * len(flat)
        pending: deque[tuple[int, str, bytes]] = deque()
        for index, (call, position) in enumerate(flat):
            error = self._call_error(call, position)
            if error is None and call.name is not None:  # a valid call has a name
                try:
                    pending.append((index, call.name,
                                    json.dumps([call.name, call.arguments]).encode()))
                except (TypeError, ValueError, RecursionError) as exc:
                    error = f"arguments of tool {call.name!r} are not JSON values: {exc}"
            if error is not None:
                results[index] = self._error(error, "invalid")
        if pending:
            self._run(pending, results)
        rows, start = [], 0
        for row in calls_per_row:
            rows.append(_answered(results[start:start + len(row)]))
            start += len(row)
        return rows

    def _error(self, message: str, status: str) -> ToolResult:
        return ToolResult(tool_worker.error_content(message, self.max_result_chars), status)

    def _new_worker(self) -> _Worker:
        return _Worker(self._setup, self.start_timeout_s, self.pass_env, self._owner,
                       self.namespaces)

    def _run(self, pending: deque, results: list) -> None:
        """Run `pending` on pool workers claimed for this call, releasing each once no call is
        left for it; a worker with a call in flight when this raises (e.g. Ctrl-C) is stopped,
        as its reply would land in a later call."""
        mine: list[_Worker] = []
        try:
            while pending or any(worker.job for worker in mine):
                idle = sum(1 for worker in mine if worker.job is None)
                if len(pending) > idle:
                    mine += self._claim(len(pending) - idle, wait=not mine)
                for position, worker in enumerate(mine):
                    if worker.isolation and worker.job is None and pending:
                        index, name, request = pending.popleft()
                        if not self._send(worker, (index, name), request):
                            # died while idle: the call never ran; it waits for another
                            pending.appendleft((index, name, request))
                            worker.stop()
                            mine[position] = self._replace(worker)
                if not pending:
                    self._release([worker for worker in mine
                                   if worker.job is None and worker.isolation])
                    mine = [worker for worker in mine if worker.job or not worker.isolation]
                waiting = [worker for worker in mine if worker.job or not worker.isolation]
                if not waiting:
                    continue
                for worker, (index, name), status, content in self._receive(waiting):
                    if status in ("ok", "failed"):
                        results[index] = ToolResult(content, status)
                        continue
                    exit_code = worker.stop()
                    results[index] = self._error(
                        f"tool {name!r} timed out after {self.timeout_s:g} s"
                        if status == "timed_out" else
                        f"tool {name!r} crashed its worker process (exit code {exit_code})",
                        "failed")
                    mine[mine.index(worker)] = self._replace(worker)
        except BaseException:
            busy = [worker for worker in mine if worker.job is not None]
            for worker in busy:
                worker.stop()
            with self._lock:
                for worker in busy:
                    if worker in self._workers:
                        self._workers.remove(worker)
                mine = [worker for worker in mine if worker.job is None]
                self._pool_changed.notify_all()
            raise
        finally:
            self._release(mine)

    def _claim(self, wanted: int, wait: bool) -> list[_Worker]:
        """Up to `wanted` pool workers for one call (the pool is filled to `num_workers` on
        first use); with `wait`, at least one, waiting while other calls hold them all."""
        with self._lock:
            while True:
                self._check_open()
                while len(self._workers) < self.num_workers:
                    worker = self._new_worker()
                    self._workers.append(worker)
                    self._free.append(worker)
                claimed = [self._free.pop(0) for _ in range(min(wanted, len(self._free)))]
                if claimed or not wait:
                    return claimed
                self._pool_changed.wait()

    def _release(self, workers: list[_Worker]) -> None:
        with self._lock:
            self._free.extend(worker for worker in workers if worker in self._workers)
            self._pool_changed.notify_all()

    def _replace(self, worker: _Worker) -> _Worker:
        """A new pool worker in the place of `worker` (stopped), claimed by the same call."""
        with self._lock:
            self._check_open()
            new = self._new_worker()
            if worker in self._workers:
                self._workers[self._workers.index(worker)] = new
            else:
                self._workers.append(new)
            return new

    def _stop_all(self) -> None:
        """A worker could not start (its tools' or environment's module does not import): none
        will."""
        with self._lock:
            _stop_workers(self._workers, self._episode_workers)
            self._free.clear()
            self._pool_changed.notify_all()

    # ------------------------------------------------------------------ the worker protocol

    def _send(self, worker: _Worker, job: Any, request: bytes) -> bool:
        """Send `request` to an idle worker that is ready; `job` (what the caller needs to file
        the reply) is in flight until the reply or the worker's loss. False: its process is
        gone and nothing was sent."""
        try:
            worker.conn.send_bytes(request)
        except OSError:
            return False
        worker.job = job
        worker.deadline = time.monotonic() + self.timeout_s + _REPLY_GRACE_S
        return True

    def _receive(self, workers: list[_Worker]) -> list[tuple[_Worker, Any, str, str]]:
        """Wait until one of `workers` (each with a job in flight or not yet ready) speaks or
        passes its deadline; (worker, job, status, content) of each job settled: a reply as the
        worker sent it ("ok", "failed", or an episode's "died" or "closed"), or "crashed" (its
        process exited or sent nonsense) or "timed_out" with content "". Ready messages are
        taken here. A worker that exits or hangs before it is ready means its tools' or
        environment's module does not import: every worker is stopped and this raises."""
        ready = multiprocessing.connection.wait(
            [worker.conn for worker in workers],
            timeout=max(min(worker.deadline for worker in workers) - time.monotonic(), 0.0))
        settled = []
        for worker in workers:
            if worker.conn in ready:
                try:
                    status, content = json.loads(worker.conn.recv_bytes())
                except (EOFError, OSError, ValueError):
                    status, content = "exited", ""
                if status == "ready":
                    worker.isolation = content
                    self._note_isolation(content)
                    continue
                if not worker.isolation:
                    exit_code = worker.stop()
                    self._stop_all()
                    raise RuntimeError(f"a tool worker exited with code {exit_code} before it "
                                       f"was ready: {content or 'see its traceback on stderr'}")
                if status not in ("ok", "failed", "died", "closed"):
                    status, content = "crashed", ""
            elif time.monotonic() < worker.deadline:
                continue
            elif not worker.isolation:
                message = self._start_timeout_message(worker)  # before its directory goes
                self._stop_all()
                raise RuntimeError(message)
            else:
                status, content = "timed_out", ""
            settled.append((worker, worker.job, status, content))
            worker.job = None
        return settled

    def _start_timeout_message(self, worker: _Worker) -> str:
        if os.path.exists(os.path.join(worker.workdir, tool_worker.PRELOAD_MARKER)):
            name = getattr(self.environment, "__qualname__", "the environment")
            return (f"a tool worker did not start within {self.start_timeout_s:g} s: "
                    f"{name}.preload() (tools.environment) had not returned")
        return f"a tool worker did not start within {self.start_timeout_s:g} s"

    def _note_isolation(self, isolation: str) -> None:
        self.isolation = isolation
        if not isolation.startswith("pid-namespace") and isolation not in _warned_isolation:
            _warned_isolation.add(isolation)
            warnings.warn(
                f"tool workers run without a PID namespace (isolation: {isolation}): "
                + ("a tool cannot signal the trainer (another uid), but " if "uid:" in isolation
                   else "a tool can signal the trainer and ")
                + "processes a tool starts in a session of their own outlive its call",
                RuntimeWarning, stacklevel=2)

