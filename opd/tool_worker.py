"""What runs inside a tool worker: a launcher, a zygote that holds the imported tools, and one
forked child per call.

The trainer starts the launcher as a fresh interpreter in its own session, with a scrubbed
environment and a fresh directory. The launcher moves what it forks into a new PID namespace
(and mount namespace; a user namespace too when not root) where the kernel allows it, forks the
zygote, and kills it when the trainer exits, however it exits. The zygote, PID 1 of that
namespace, imports the tools once; for each call it forks a child, waits for its result or its
timeout, then kills every other process of the namespace (kill(-1) from PID 1 reaches them all,
daemons included), reaps them and empties the directory: nothing a call starts, writes or keeps
in a global outlives it. The call child runs the tool as `run_as` (nobody) when the trainer is
root, with no new privileges, and dies with the zygote. When PID 1 dies the kernel kills the
whole namespace.

What a tool cannot do, by the isolation in force (reported as ToolExecutor.isolation):
- "pid-namespace...": see or signal any process outside its namespace (the trainer included);
  /proc shows only the namespace where it could be mounted afresh.
- "+uid:NAME" (the trainer is root): signal, ptrace or read the /proc files of the trainer's
  processes, or write files only root may write.
- a trainer that is not root runs calls as itself; in a user namespace, each call child enters
  a nested one, so it holds no capability over the worker's namespaces (cannot unmount /proc).
- without a PID namespace, the uid drop is the only signal barrier; processes a tool starts in a
  session of their own escape the per-call sweep, and, as the same user, it can signal the trainer.
An episode that keeps state across calls (issue 13) would fork its child once and send it each
call of the episode, sweeping at the episode's end: one worker per live episode.

Kept apart from opd.tools so a worker imports only this (and the tools' own modules).
"""

import contextlib
import ctypes
import json
import multiprocessing.connection
import os
import pickle
import select
import shutil
import signal
from collections.abc import Callable
from typing import Any

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID = 0x00020000, 0x10000000, 0x20000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38


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


def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # no C library to call: no namespaces, no parent-death signal
        return None


def _send(conn: multiprocessing.connection.Connection, *message: Any) -> None:
    conn.send_bytes(json.dumps(message).encode())


def launch(fd: int, trainer: int, namespaces: bool) -> None:
    """Launcher entry point: fork the zygote into new namespaces where asked and possible, then
    wait for it, killing it when the trainer exits first (a trainer killed outright never calls
    close)."""
    libc = _libc()
    uid, gid = os.geteuid(), os.getegid()
    flags = _CLONE_NEWPID | _CLONE_NEWNS | (0 if uid == 0 else _CLONE_NEWUSER)
    namespaced = namespaces and libc is not None and libc.unshare(flags) == 0
    if namespaced and uid != 0:  # keep our ids: unmapped ones could not nest a user namespace
        with contextlib.suppress(OSError):
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                               ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as handle:
                    handle.write(text)
    zygote = os.fork()
    if zygote == 0:
        try:
            if libc:
                libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the launcher has no threads
            serve(fd, namespaced, libc)
        finally:
            os._exit(0)
    os.close(fd)
    try:
        watched = [os.pidfd_open(zygote), os.pidfd_open(trainer)]
    except (AttributeError, OSError):  # no pidfds: poll for being reparented
        watched = []
    while not (ended := os.waitpid(zygote, os.WNOHANG))[0]:
        if os.getppid() != trainer:
            os.kill(zygote, signal.SIGKILL)
            ended = os.waitpid(zygote, 0)
            shutil.rmtree(os.getcwd(), ignore_errors=True)  # the trainer cannot any more
            break
        select.select(watched, [], [], 1.0)
    os._exit(min(abs(os.waitstatus_to_exitcode(ended[1])), 255))


def _mount_proc(libc: Any) -> bool:
    """A /proc of this PID namespace only, so the trainer's pid is not even visible."""
    return (libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) == 0
            and libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
                           None) == 0)


def serve(fd: int, namespaced: bool, libc: Any) -> None:
    """Zygote: take the setup, import the tools, then run each (name, arguments) request in a
    child of its own until EOF."""
    conn = multiprocessing.connection.Connection(fd)
    try:
        # drop: (name, uid, gid) to run calls as, when the trainer is root
        functions, max_result_chars, memory_mb, timeout_s, drop = pickle.loads(conn.recv_bytes())
    except EOFError:
        return
    except BaseException as exc:  # unpickling imports the tools' modules: report why it failed
        with contextlib.suppress(OSError):
            _send(conn, "error", f"cannot load the tool functions: {_describe_exception(exc)}")
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    pid1 = namespaced and os.getpid() == 1
    isolation = ["pid-namespace" + ("+proc" if pid1 and _mount_proc(libc) else "")] if pid1 else []
    if drop:
        isolation.append(f"uid:{drop[0]}")
    _limit_address_space(memory_mb)
    _send(conn, "ready", "+".join(isolation) or "none")
    workdir = os.getcwd()
    while True:
        try:
            name, arguments = json.loads(conn.recv_bytes())
        except EOFError:
            return
        _send(conn, *_run_call(functions[name], name, arguments, max_result_chars, memory_mb,
                               timeout_s, fd, drop, pid1, libc))
        _empty(workdir)


def _run_call(fn: Callable, name: str, arguments: dict, limit: int, memory_mb: int,
              timeout_s: float, trainer_fd: int, drop: tuple | None, pid1: bool,
              libc: Any) -> tuple[str, str]:
    reader, writer = multiprocessing.connection.Pipe(duplex=False)
    child = os.fork()
    if child == 0:
        try:
            reader.close()
            os.close(trainer_fd)  # the tool must not write to the trainer
            os.setsid()  # a process group of its own, for the sweep without a PID namespace
            if libc:
                libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
                libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no setuid binary gives root back
            if drop:
                os.setgroups([])
                os.setgid(drop[2])
                os.setuid(drop[1])
            elif pid1 and os.geteuid() != 0:  # in a user namespace: drop its capabilities
                libc.unshare(_CLONE_NEWUSER)
            writer.send_bytes(json.dumps(_call_tool(fn, name, arguments, limit, memory_mb))
                              .encode())
        finally:
            os._exit(0)
    writer.close()
    try:
        exited = os.pidfd_open(child)
    except (AttributeError, OSError):
        exited = None
    done = multiprocessing.connection.wait([reader] + ([exited] if exited else []), timeout_s)
    exit_code = _sweep(child, pid1)  # after it no writer is left, so reading cannot block
    try:  # the tool could have written here itself: take only a well-formed result
        status, content = json.loads(reader.recv_bytes(8 * limit + 64))
        if status in ("ok", "failed") and isinstance(content, str) and len(content) <= limit:
            return status, content
    except (EOFError, OSError, ValueError, TypeError):
        pass
    finally:
        reader.close()
        if exited is not None:
            os.close(exited)
    if not done:
        return "failed", error_content(f"tool {name!r} timed out after {timeout_s:g} s", limit)
    return "failed", error_content(
        f"tool {name!r} crashed its worker process (exit code {exit_code})", limit)


def _sweep(child: int, pid1: bool) -> int:
    """Kill the call's child and every process it started, reap them; the child's exit code."""
    exit_code = 0
    if not pid1:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child, signal.SIGKILL)
        return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    while True:  # orphans are ours to reap; one forked mid-kill is caught by the next kill
        try:
            os.kill(-1, signal.SIGKILL)
            pid, status = os.waitpid(-1, 0)
        except (ProcessLookupError, ChildProcessError):
            return exit_code
        if pid == child:
            exit_code = os.waitstatus_to_exitcode(status)


def _empty(directory: str) -> None:
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
