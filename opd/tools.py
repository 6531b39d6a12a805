"""Student tool calls: parse them, validate them against their schema, run them in a sandbox.

A tool call must never cost the rank. A call that does not parse, does not match its tool's
schema, nests deeper than MAX_ARGUMENT_DEPTH or is over the turn's `max_calls_per_turn` is
"invalid"; a call that hangs, raises, kills its process, prints without end, allocates
wildly or returns something JSON cannot hold is "failed". Either way the student sees one
`{"error": "..."}` observation. Every result content is a JSON text of at most
`max_result_chars` characters: an over-long result becomes `{"truncated": "<prefix of its JSON>"}`
(the seed cut the JSON text mid-token instead). How a call is sandboxed, and what a tool can
still do, is told in opd.tool_worker.
"""

import json
import multiprocessing.connection
import os
import pickle
import pwd
import re
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from opd import tool_worker
from opd.errors import ConfigError

# Bounds the executor enforces; the config's `tools.*` rules use the same numbers.
MIN_RESULT_CHARS = 64  # an {"error": ...} observation must fit
MIN_MEMORY_LIMIT_MB = 32  # below this a worker cannot unpickle a call


@dataclass
class ToolCall:
    """One call parsed from the student's text; `error` is set when it is malformed."""
    name: str | None
    arguments: dict | None
    error: str | None = None
    raw: str = ""


ToolCallParser = Callable[[str], list[ToolCall]]

# Same shape as vLLM's Hermes parser: a final <tool_call> without its closing tag still counts,
# because a student that stops right after the JSON meant the call.
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_THINK_TAG = re.compile(r"<think>|</think>")


def _outside_think(text: str) -> str:
    """`text` without its reasoning: `<think>...</think>` blocks, and everything after a `<think>`
    that is never closed. A `</think>` with no opening tag ends reasoning that the prompt opened
    (templates that end the generation prompt with `<think>`), so all before it is dropped too."""
    kept, start, thinking = [], 0, False
    for tag in _THINK_TAG.finditer(text):
        if tag.group() == "<think>" and not thinking:
            kept.append(text[start:tag.start()])
            thinking = True
        elif tag.group() == "</think>":
            if not thinking:
                kept = []
            thinking = False
            start = tag.end()
    if not thinking:
        kept.append(text[start:])
    return "".join(kept)


def parse_hermes_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in `text`, in order.

    Calls are read only outside `<think>` reasoning: a thought that mentions `<tool_call>` is not a
    call, and must not swallow the real call after it. Arguments may be an object or a JSON string
    holding one, and default to {} when absent (as in the seed). A malformed call comes back with
    `error` set; nothing raises.
    """
    calls = []
    for match in _HERMES_CALL.finditer(_outside_think(text)):
        closed = match.group(1) is not None
        call = _parse_call_json(match.group(1) if closed else match.group(2), match.group(0))
        if call.error and not closed:
            call.error += " (the <tool_call> is not closed)"
        calls.append(call)
    return calls


def _reject_constant(constant: str):
    raise ValueError(f"{constant} is not a JSON number")


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


def _parse_call_json(body: str, raw: str) -> ToolCall:
    try:
        payload = _loads(body)
    except (ValueError, RecursionError) as exc:
        return ToolCall(None, None, f"tool call is not valid JSON: {exc}", raw)
    if not isinstance(payload, dict):
        return ToolCall(None, None, 'tool call must be a JSON object with "name" and '
                                    f'"arguments", got {_json_type(payload)}', raw)
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, 'tool call has no "name" string', raw)
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except (ValueError, RecursionError) as exc:
            return ToolCall(name, None, f"arguments of tool {name!r} are a string that is not "
                                        f"valid JSON: {exc}", raw)
    if not isinstance(arguments, dict):
        return ToolCall(name, None, f"arguments of tool {name!r} must be a JSON object, "
                                    f"got {_json_type(arguments)}", raw)
    return ToolCall(name, arguments, None, raw)


_PARSERS: dict[str, ToolCallParser] = {"hermes": parse_hermes_tool_calls}


def register_parser(name: str, parser: ToolCallParser) -> None:
    if name in _PARSERS and _PARSERS[name] is not parser:
        raise ValueError(f"a tool-call parser named {name!r} is already registered")
    _PARSERS[name] = parser


def get_parser(name: str) -> ToolCallParser:
    if name not in _PARSERS:
        raise ConfigError(f"tools.parser {name!r} is not a registered tool-call parser (registered: "
                          f"{', '.join(_PARSERS)}) nor a module:function.")
    return _PARSERS[name]


@dataclass(frozen=True)
class Tool:
    """An OpenAI-style function schema and the module-level function it calls as fn(**arguments)."""
    schema: dict
    fn: Callable[..., Any]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


# Deeper values would exhaust the recursion limit while validated, encoded or decoded; the
# parser's own limit (Python's recursion limit) depends on the caller's stack.
MAX_ARGUMENT_DEPTH = 128


def _too_deep(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest deeper than `limit` (the arguments object is level 1);
    iterative, as the value may be too deep for recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1)
                         for child in (item.values() if isinstance(item, dict) else item))
    return False


_JSON_TYPES = {"string", "number", "integer", "boolean", "array", "object", "null"}


class ToolRegistry:
    """Tools by name, and argument validation against a JSON-schema subset: type (one or a list),
    enum, properties, required, additionalProperties (default false: extra keys would reach
    fn(**arguments)), items. Other keywords (minimum, pattern, ...) are not checked."""

    def __init__(self, tools: Sequence[Tool]):
        self.tools = tuple(tools)
        self._by_name: dict[str, Tool] = {}
        for tool in self.tools:
            _check_tool(tool)
            if tool.name in self._by_name:
                raise ValueError(f"two tools are named {tool.name!r}")
            self._by_name[tool.name] = tool
        self.schemas: list[dict] = [tool.schema for tool in self.tools]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def validate(self, call: ToolCall) -> str | None:
        """The sentence the student sees for an invalid call, or None when the call is valid."""
        if call.error is not None:
            return call.error
        tool = self._by_name.get(call.name)
        if tool is None:
            return f"unknown tool {call.name!r}; available tools: {', '.join(self._by_name)}"
        if not isinstance(call.arguments, dict):
            return (f"arguments of tool {tool.name!r} must be a JSON object, "
                    f"got {_json_type(call.arguments)}")
        if _too_deep(call.arguments, MAX_ARGUMENT_DEPTH):
            return (f"arguments of tool {tool.name!r} are nested deeper than "
                    f"{MAX_ARGUMENT_DEPTH} levels")
        parameters = {"properties": {}, **tool.schema["function"].get("parameters", {})}
        return _schema_error(call.arguments, parameters, tool.name, ())


def _check_tool(tool: Tool) -> None:
    schema = tool.schema if isinstance(tool.schema, dict) else {}
    function = schema.get("function")
    if schema.get("type") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str):
        raise ValueError(f'a tool schema must look like {{"type": "function", "function": '
                         f'{{"name": ..., "parameters": {{...}}}}}}, got {tool.schema!r}')
    parameters = function.get("parameters", {"type": "object"})
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ValueError(f"parameters of tool {tool.name!r} must have type 'object'")
    _check_schema_types(parameters, tool.name)
    if not callable(tool.fn):
        raise ValueError(f"the function of tool {tool.name!r} is not callable: {tool.fn!r}")
    try:
        pickle.dumps(tool.fn)
        importable = getattr(tool.fn, "__module__", None) != "__main__"
    except Exception:
        importable = False
    if not importable:
        raise ValueError(f"the function of tool {tool.name!r} ({tool.fn!r}) cannot be sent to a "
                         "worker process: define it at module level in an importable module, "
                         "not in the main script")


def _check_schema_types(schema: dict, tool_name: str) -> None:
    types = schema.get("type", [])
    for type_name in [types] if isinstance(types, str) else types:
        if type_name not in _JSON_TYPES:
            raise ValueError(f"tool {tool_name!r} uses unsupported schema type {type_name!r}; "
                             f"use one of {', '.join(sorted(_JSON_TYPES))}")
    children = list(schema.get("properties", {}).values())
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            children.append(schema[key])
    for child in children:
        _check_schema_types(child, tool_name)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    names = {str: "a string", list: "an array", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _is_type(value: Any, type_name: str) -> bool:
    if type_name == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or \
            (isinstance(value, float) and value.is_integer())
    if type_name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python_types = {"string": str, "boolean": bool, "array": list, "object": dict,
                    "null": type(None)}
    return isinstance(value, python_types[type_name])


def _same_json_value(a: Any, b: Any) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _schema_error(value: Any, schema: dict, tool: str, path: tuple) -> str | None:
    where = f"tool {tool!r}: argument {''.join(path).lstrip('.')!r}" if path else f"tool {tool!r}"
    types = schema.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else types
        if not any(_is_type(value, type_name) for type_name in allowed):
            shown = json.dumps(value, ensure_ascii=False)[:60]
            return (f"{where} must be of type {' or '.join(allowed)}, "
                    f"got {_json_type(value)} ({shown})")
    if "enum" in schema and not any(_same_json_value(value, option) for option in schema["enum"]):
        options = ", ".join(json.dumps(option, ensure_ascii=False) for option in schema["enum"])
        return f"{where} must be one of {options}, got {json.dumps(value, ensure_ascii=False)[:60]}"
    if isinstance(value, dict) and "properties" in schema:
        properties = schema["properties"]
        for key in schema.get("required", []):
            if key not in value:
                missing = "".join(path + ("." + key,)).lstrip(".")
                return f"{where} is missing required argument {missing!r}"
        extra = schema.get("additionalProperties", False)
        for key, item in value.items():
            child = properties.get(key, extra if isinstance(extra, dict) else None)
            if child is not None:
                error = _schema_error(item, child, tool, path + ("." + key,))
                if error:
                    return error
            elif extra is not True:
                return (f"{where} got unexpected argument {key!r}; "
                        f"it takes: {', '.join(properties)}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            error = _schema_error(item, schema["items"], tool, path + (f"[{index}]",))
            if error:
                return error
    return None


@dataclass
class ToolResult:
    content: str   # JSON text shown to the student, at most max_result_chars characters
    status: str    # "ok" | "invalid" | "failed"


@dataclass
class ToolCallCounts:
    """Per trajectory; each call counts once: ok -> valid, else invalid or failed."""
    valid: int = 0
    invalid: int = 0
    failed: int = 0

    def add(self, results: Iterable[ToolResult]) -> None:
        for result in results:
            field = {"ok": "valid", "invalid": "invalid", "failed": "failed"}[result.status]
            setattr(self, field, getattr(self, field) + 1)


# The launcher is a fresh interpreter, not a fork (the parent may be a trainer rank with threads)
# nor a multiprocessing spawn (which would re-import the trainer script, torch included).
_WORKER_BOOTSTRAP = ("import sys; sys.path[:] = sys.argv[4:]; from opd.tool_worker import launch; "
                     "launch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == 'namespaces')")

# The only variables a worker inherits (and LC_*); HOME and TMPDIR are its own directory.
SANDBOX_ENV = ("PATH", "LD_LIBRARY_PATH", "LANG", "LANGUAGE", "TZ", "PYTHONHASHSEED",
               "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE")
MAX_CALLS_PER_TURN = 8
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
        self.job: tuple[int, str] | None = None  # (index in the flat batch, tool name)
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


def _stop_workers(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop()
    workers.clear()


class ToolExecutor:
    """A pool of sandboxed workers (see opd.tool_worker) with a wall-clock timeout per call;
    never raises for a tool's or a student's fault. Workers start on first use and are reused;
    each call runs in a fresh child whose process tree, files and globals die with it. A worker
    that dies is replaced. Each call has `memory_limit_mb` of address space beyond the worker's
    start-up footprint, no stdout/stderr, only the SANDBOX_ENV variables (and `pass_env`), and
    runs as `run_as` when the trainer is root (None: stay root), in PID and mount namespaces of
    its worker where the kernel allows them and `namespaces` is set; `isolation` says what is in
    force. At most `max_calls_per_turn` calls of one row run; the others are invalid. Safe to
    call from any thread; concurrent calls are serialised."""

    def __init__(self, registry: ToolRegistry, *, timeout_s: float = 10.0,
                 max_result_chars: int = 2048, num_workers: int = 2, memory_limit_mb: int = 1024,
                 start_timeout_s: float = 60.0, max_calls_per_turn: int = MAX_CALLS_PER_TURN,
                 run_as: str | None = "nobody", pass_env: Sequence[str] = (),
                 namespaces: bool = True):
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
        self.registry = registry
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
        self._setup = pickle.dumps((functions, max_result_chars, memory_limit_mb, timeout_s,
                                    user))
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    def __enter__(self) -> "ToolExecutor":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._finalizer()

    def pids(self) -> list[int]:
        """The workers' launcher processes: each the root of its worker's process tree."""
        with self._lock:
            return [worker.process.pid for worker in self._workers]

    def run_batch(self, calls_per_row: list[list[ToolCall]]) -> list[list[ToolResult]]:
        """Results in the same nesting and order; all valid calls of all rows run concurrently."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this ToolExecutor is closed")
            flat = [(call, position) for row in calls_per_row
                    for position, call in enumerate(row)]
            results: list[ToolResult | None] = [None] * len(flat)
            pending: deque[tuple[int, str, bytes]] = deque()
            for index, (call, position) in enumerate(flat):
                if position >= self.max_calls_per_turn:
                    error = (f"tool call {position + 1} of this turn was not run: at most "
                             f"{self.max_calls_per_turn} tool calls per turn")
                else:
                    error = self.registry.validate(call)
                if error is None:
                    try:
                        pending.append((index, call.name,
                                        json.dumps([call.name, call.arguments]).encode()))
                    except (TypeError, ValueError, RecursionError) as exc:
                        error = f"arguments of tool {call.name!r} are not JSON values: {exc}"
                if error is not None:
                    results[index] = self._error(error, "invalid")
            try:
                if pending:
                    self._run(pending, results)
            except BaseException:  # e.g. Ctrl-C: replies in flight would land in the next batch
                _stop_workers(self._workers)
                raise
        rows, start = [], 0
        for row in calls_per_row:
            rows.append(results[start:start + len(row)])
            start += len(row)
        return rows

    def _error(self, message: str, status: str) -> ToolResult:
        return ToolResult(tool_worker.error_content(message, self.max_result_chars), status)

    def _new_worker(self) -> _Worker:
        return _Worker(self._setup, self.start_timeout_s, self.pass_env, self._owner,
                       self.namespaces)

    def _run(self, pending: deque, results: list) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(self._new_worker())
        while pending or any(worker.job for worker in self._workers):
            for position, worker in enumerate(self._workers):
                if worker.isolation and worker.job is None and pending:
                    index, name, request = pending.popleft()
                    try:
                        worker.conn.send_bytes(request)
                    except OSError:  # died while idle: the call never ran, so it waits for another
                        pending.appendleft((index, name, request))
                        worker.stop()
                        self._workers[position] = self._new_worker()
                        continue
                    worker.job = (index, name)
                    worker.deadline = time.monotonic() + self.timeout_s + _REPLY_GRACE_S
            waiting = [worker for worker in self._workers if worker.job or not worker.isolation]
            ready = multiprocessing.connection.wait(
                [worker.conn for worker in waiting],
                timeout=max(min(worker.deadline for worker in waiting) - time.monotonic(), 0.0))
            for position, worker in enumerate(self._workers):
                if worker in waiting:
                    self._workers[position] = self._settle(worker, worker.conn in ready, results)

    def _settle(self, worker: _Worker, readable: bool, results: list) -> _Worker:
        """Take the worker's message, or handle its death or timeout; return who takes its place."""
        if readable:
            try:
                status, content = json.loads(worker.conn.recv_bytes())
            except (EOFError, OSError, ValueError):
                status, content = "died", ""
            if status == "ready":
                worker.isolation = content
                self._note_isolation(content)
                return worker
            if status in ("ok", "failed") and worker.job is not None:
                results[worker.job[0]] = ToolResult(content, status)
                worker.job = None
                return worker
            exit_code = worker.stop()
            if worker.job is None:
                _stop_workers(self._workers)
                raise RuntimeError(f"a tool worker exited with code {exit_code} before it was "
                                   f"ready: {content or 'see its traceback on stderr'}")
            results[worker.job[0]] = self._error(
                f"tool {worker.job[1]!r} crashed its worker process (exit code {exit_code})",
                "failed")
        elif time.monotonic() < worker.deadline:
            return worker
        else:
            worker.stop()
            if worker.job is None:
                _stop_workers(self._workers)
                raise RuntimeError(
                    f"a tool worker did not start within {self.start_timeout_s:g} s")
            results[worker.job[0]] = self._error(
                f"tool {worker.job[1]!r} timed out after {self.timeout_s:g} s", "failed")
        return self._new_worker()

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

