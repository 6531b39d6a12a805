"""What runs inside a tool worker process: call the tool, turn anything it does into JSON.

Kept apart from opd.tools so a worker imports only this (and the tools' own modules).
"""

import contextlib
import json
import multiprocessing.connection
import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any


def _dumps(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates would break the tokenizer: escape them
        text = json.dumps(value, ensure_ascii=True, allow_nan=False)
    return text


def _fit(key: str, text: str, limit: int) -> str:
    """{key: the longest prefix of text whose JSON fits in limit characters}; escapes make the
    JSON length uneven in the prefix length, so bisect."""
    low, high = 0, min(len(text), limit)
    while low < high:
        middle = (low + high + 1) // 2
        if len(_dumps({key: text[:middle]})) <= limit:
            low = middle
        else:
            high = middle - 1
    return _dumps({key: text[:low]})


def cap_result(text: str, limit: int) -> str:
    return text if len(text) <= limit else _fit("truncated", text, limit)


def error_content(message: str, limit: int) -> str:
    return _fit("error", message, limit)


def _describe_exception(exc: BaseException) -> str:
    try:
        message = str(exc)
    except Exception:
        message = ""
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _call_tool(fn: Callable, name: str, arguments: dict, limit: int,
               memory_mb: int) -> tuple[str, str]:
    """(status, content): whatever the tool does, one JSON text of at most `limit` characters."""
    try:
        value = fn(**arguments)
        try:
            return "ok", cap_result(_dumps(value), limit)
        except (TypeError, ValueError, RecursionError) as exc:
            return "failed", error_content(f"tool {name!r} returned a value that is not "
                                           f"JSON-serialisable: {exc}", limit)
    except MemoryError:
        return "failed", error_content(
            f"tool {name!r} ran out of memory (limit {memory_mb} MB)", limit)
    except BaseException as exc:  # a tool's SystemExit or KeyboardInterrupt is its own fault too
        return "failed", error_content(f"tool {name!r} raised {_describe_exception(exc)}", limit)


def _exit_with_parent() -> None:
    """A worker outlives a crashed trainer only as long as its tool runs: poll for reparenting."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _limit_address_space(memory_mb: int) -> None:
    """Allow memory_mb beyond what the worker maps after start-up (the tools' modules may import
    large libraries); allocations past it raise MemoryError."""
    try:
        import resource
        with open("/proc/self/status") as status:
            mapped_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
        limit = mapped_kb * 1024 + memory_mb * 2**20
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, StopIteration, ValueError):
        pass  # no /proc or rlimits here: the wall-clock timeout still bounds the tool


def serve(fd: int) -> None:
    """Worker entry point: take the setup, then answer (name, arguments) requests until EOF."""
    conn = multiprocessing.connection.Connection(fd)
    try:
        functions, max_result_chars, memory_mb = pickle.loads(conn.recv_bytes())
    except EOFError:
        return
    except BaseException as exc:  # unpickling imports the tools' modules: report why it failed
        with contextlib.suppress(OSError):
            conn.send(("error", f"cannot load the tool functions: {_describe_exception(exc)}"))
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    _exit_with_parent()
    _limit_address_space(memory_mb)
    conn.send(("ready", ""))
    while True:
        try:
            name, arguments = conn.recv()
        except EOFError:
            return
        conn.send(_call_tool(functions[name], name, arguments, max_result_chars, memory_mb))
