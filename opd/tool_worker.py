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
- "+imports", "+tmp" (a mount namespace, opd.sandbox_fs): the interpreter and import path are
  readable to the call's user, and /tmp, /var/tmp, /dev/shm are one private tmpfs of
  memory_limit_mb, emptied after every call and episode.
- "+uid:NAME" (the trainer is root): signal, ptrace or read the /proc files of the trainer's
  processes, or write files only root may write.
- a trainer that is not root runs calls as itself; in a user namespace, each call child enters
  a nested one, so it holds no capability over the worker's namespaces (cannot unmount /proc).
  It may signal the zygote, PID 1 of the namespace, which holds no signal handler, so the
  kernel drops every such signal.
- without a PID namespace, the uid drop is the only signal barrier; processes a tool starts in a
  session of their own escape the per-call sweep, and, as the same user, it can signal the trainer.

Episodes of a stateful environment (opd.environments) use the same zygote differently: an
"open" request forks one *episode child* that constructs the environment from the record's
config and keeps it for the whole conversation; each "call" (and the final "state") is relayed
to it, and the zygote enforces the per-call timeout exactly as for a stateless call. At "close"
the environment's own close() runs, then the zygote sweeps the namespace and empties the
directory as after a stateless call. A zygote holds at most one live episode (the sweep kills
every process of its namespace), so there is one worker per live episode. An episode child that
hangs past the timeout, crashes or sends a malformed reply is swept at once and its episode is
over ("died" reply); the zygote is clean again and serves the next episode.

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

from opd import sandbox_fs

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


def _call_tool(call: Callable[[], Any], name: str, limit: int, memory_mb: int,
               text: bool = False) -> tuple[str, str]:
    """(status, content): whatever `call()` (tool `name`) does, one JSON text of at most `limit`
    characters; with `text` (an environment's TEXT_OBSERVATIONS), a str result is the content
    as it is."""
    try:
        value = call()
        try:
            if text and isinstance(value, str):
                return "ok", cap_result(value, limit)
            return "ok", cap_result(_dumps(value), limit)
        except (TypeError, ValueError, RecursionError) as exc:
            return "failed", error_content(f"tool {name!r} returned a value that is not "
                                           f"JSON-serialisable: {exc}", limit)
    except MemoryError:
        return "failed", error_content(
            f"tool {name!r} ran out of memory (limit {memory_mb} MB)", limit)
    except BaseException as exc:  # a tool's SystemExit or KeyboardInterrupt is its own fault too
        return "failed", raised_content(name, exc, limit)


def raised_content(name: str, exc: BaseException, limit: int) -> str:
    """The observation of a call of tool `name` that raised `exc`: what the student reads (a
    world writing demonstrations of rejected calls uses it to show the same text)."""
    return error_content(f"tool {name!r} raised {_describe_exception(exc)}", limit)


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


# The signal handlers the zygote held (Python's SIGINT handler, any a tool module installed),
# given back to each call and episode child (see _disarm_signals).
_ZYGOTE_HANDLERS: dict[int, Any] = {}


def _disarm_signals() -> None:
    """The zygote keeps no signal handler. As PID 1 of its namespace it then never sees a
    signal sent from inside it: a call that runs as the zygote's own user (a trainer that is
    not root) could otherwise end the worker (Python's SIGINT handler raises
    KeyboardInterrupt). Its children get the handlers back (_enter_call_child)."""
    for signum in signal.valid_signals():
        handler = signal.getsignal(signum)
        if callable(handler):
            _ZYGOTE_HANDLERS[signum] = handler
            signal.signal(signum, signal.SIG_DFL)


# Written in the worker's directory while the environment's preload() runs.
PRELOAD_MARKER = ".opd-preloading"


def serve(fd: int, namespaced: bool, libc: Any) -> None:
    """Zygote: take the setup, import the tools, then run each (name, arguments) request in a
    child of its own until EOF."""
    conn = multiprocessing.connection.Connection(fd)
    try:
        # drop: (name, uid, gid) to run calls as, when the trainer is root
        # environment: the world's environment class, or None for stateless tools
        functions, environment, max_result_chars, memory_mb, timeout_s, drop = \
            pickle.loads(conn.recv_bytes())
    except EOFError:
        return
    except BaseException as exc:  # unpickling imports the tools' modules: report why it failed
        with contextlib.suppress(OSError):
            _send(conn, "error", f"cannot load the tool functions: {_describe_exception(exc)}")
        return
    try:  # while still the trainer's user: episode children may not read its files
        if environment is not None and hasattr(environment, "preload"):
            with open(PRELOAD_MARKER, "w"):  # the trainer names the environment if it hangs
                pass
            environment.preload()
            os.unlink(PRELOAD_MARKER)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            _send(conn, "error", f"{getattr(environment, '__name__', 'the environment')}."
                                 f"preload() raised {_describe_exception(exc)}")
        return
    _disarm_signals()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    pid1 = namespaced and os.getpid() == 1
    isolation = ["pid-namespace" + ("+proc" if pid1 and _mount_proc(libc) else "")] if pid1 else []
    workdir = os.getcwd()
    mounted, private_tmp = sandbox_fs.private_filesystem(libc, memory_mb, drop, workdir) \
        if pid1 else ([], None)
    isolation += mounted
    if drop and "imports" not in mounted:  # the sandbox user may not read the interpreter
        sandbox_fs.preload_lazy_imports()
    if "tmp" not in mounted:  # the host's /tmp, /var/tmp and /dev/shm: no file over the limit
        sandbox_fs.limit_file_size(memory_mb)
    if drop:
        isolation.append(f"uid:{drop[0]}")
    _limit_address_space(memory_mb)
    _send(conn, "ready", "+".join(isolation) or "none")

    def clean() -> None:  # what a call or an episode wrote dies with it
        if private_tmp is None:
            sandbox_fs.empty(workdir)
        elif not private_tmp.fresh():
            raise OSError("cannot remake the private /tmp")  # the trainer replaces the worker

    episode: _Episode | None = None
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:
            if episode is not None:
                episode.sweep()
            return
        if isinstance(request, list):  # a stateless call: [name, arguments]
            name, arguments = request
            _send(conn, *_run_call(functions[name], name, arguments, max_result_chars,
                                   memory_mb, timeout_s, fd, drop, pid1, libc))
            clean()
            continue
        op = request["op"]
        if op == "open":
            if episode is not None:  # the trainer never opens two; keep the namespace clean
                episode.sweep()
            episode = _Episode(environment, request["config"], max_result_chars, memory_mb,
                               timeout_s, fd, drop, pid1, libc)
            reply = episode.ask({"op": "open"}, "the environment's constructor")
        elif op == "close":
            if episode is not None:
                episode.close()
            episode = None
            clean()
            reply = ("closed", "")
        elif episode is None or episode.dead:
            reply = ("died", error_content("the environment of this episode is gone",
                                           max_result_chars))
        else:
            what = f"environment call {request['name']!r}" if op == "call" \
                else "the environment's state()"
            reply = episode.ask(request, what)
        _send(conn, *reply)


# A final state is read once per episode, for the checker: it may be larger than a result.
MAX_STATE_CHARS = 1 << 24


class _Episode:
    """Zygote side of one live episode: its child process and the pipe to it."""

    def __init__(self, environment: Any, config: Any, limit: int, memory_mb: int,
                 timeout_s: float, trainer_fd: int, drop: tuple | None, pid1: bool, libc: Any):
        self.limit, self.timeout_s, self.pid1, self.dead = limit, timeout_s, pid1, False
        self.conn, child_conn = multiprocessing.connection.Pipe(duplex=True)
        self.child = os.fork()
        if self.child == 0:
            try:
                self.conn.close()
                _enter_call_child(trainer_fd, drop, pid1, libc)
                _episode_main(child_conn, environment, config, limit, memory_mb)
            finally:
                os._exit(0)
        child_conn.close()
        try:
            self.exited: int | None = os.pidfd_open(self.child)
        except (AttributeError, OSError):
            self.exited = None

    def ask(self, request: dict, what: str) -> tuple[str, str]:
        """The child's (status, content) for `request` (an "open" only awaits the constructor);
        ("died", why) when it hangs past the timeout, crashes or answers out of protocol, after
        which it is swept."""
        limit = MAX_STATE_CHARS if request["op"] == "state" else self.limit
        crashed = False
        try:
            if request["op"] != "open":
                self.conn.send_bytes(json.dumps(request).encode())
            if self.conn.poll(self.timeout_s):
                status, content = json.loads(self.conn.recv_bytes(8 * limit + 64))
                if status in ("ok", "failed") and isinstance(content, str) \
                        and len(content) <= limit:
                    return status, content
                why = f"{what} answered out of protocol"
            else:
                why = f"{what} timed out after {self.timeout_s:g} s"
        except (EOFError, OSError, ValueError, TypeError):
            crashed, why = True, f"{what} crashed the environment's process"
        exit_code = self.sweep()
        if crashed:
            why += f" (exit code {exit_code})"
        return "died", error_content(why + "; the episode's state is lost", self.limit)

    def close(self) -> None:
        """Let the environment close itself (within the timeout), then sweep."""
        if not self.dead:
            with contextlib.suppress(OSError, EOFError, ValueError):
                self.conn.send_bytes(json.dumps({"op": "close"}).encode())
                self.conn.poll(self.timeout_s)
        self.sweep()

    def sweep(self) -> int:
        if self.dead:
            return 0
        self.dead = True
        exit_code = _sweep(self.child, self.pid1)
        self.conn.close()
        if self.exited is not None:
            os.close(self.exited)
        return exit_code


def _episode_main(conn: multiprocessing.connection.Connection, environment: Any, config: Any,
                  limit: int, memory_mb: int) -> None:
    """Episode child: construct the environment, then answer the zygote's requests in order."""
    label = getattr(environment, "__name__", "environment")
    try:
        env = environment(config)
        conn.send_bytes(json.dumps(["ok", ""]).encode())
    except BaseException as exc:
        why = f"ran out of memory (limit {memory_mb} MB)" if isinstance(exc, MemoryError) \
            else f"raised {_describe_exception(exc)}"
        conn.send_bytes(json.dumps(["failed", error_content(
            f"environment {label} {why} in its constructor", limit)]).encode())
        return
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if request["op"] == "call":
            name, arguments = request["name"], request["arguments"]
            reply = _call_tool(lambda: env.call(name, arguments), name, limit, memory_mb,
                               text=bool(getattr(environment, "TEXT_OBSERVATIONS", False)))
        elif request["op"] == "state":
            reply = _final_state(env, limit, memory_mb)
        else:  # close
            closer = getattr(env, "close", None)
            if callable(closer):
                with contextlib.suppress(BaseException):
                    closer()
            conn.send_bytes(json.dumps(["ok", ""]).encode())
            return
        conn.send_bytes(json.dumps(reply).encode())


def _final_state(env: Any, limit: int, memory_mb: int) -> tuple[str, str]:
    """("ok", the JSON of env.state(), uncut) or ("failed", why)."""
    try:
        value = env.state()
        try:
            text = _dumps(value)
        except (TypeError, ValueError, RecursionError) as exc:
            return "failed", error_content(f"the environment's state() returned a value that is "
                                           f"not JSON-serialisable: {exc}", limit)
    except MemoryError:
        return "failed", error_content(
            f"the environment's state() ran out of memory (limit {memory_mb} MB)", limit)
    except BaseException as exc:
        return "failed", error_content(
            f"the environment's state() raised {_describe_exception(exc)}", limit)
    if len(text) > MAX_STATE_CHARS:
        return "failed", error_content(
            f"the environment's state is over {MAX_STATE_CHARS} characters of JSON", limit)
    return "ok", text


def _enter_call_child(trainer_fd: int, drop: tuple | None, pid1: bool, libc: Any) -> None:
    """What a call child (or an episode child) does first: no way to the trainer, a process
    group of its own, death with the zygote, no new privileges, the unprivileged user."""
    os.close(trainer_fd)  # the tool must not write to the trainer
    for signum, handler in _ZYGOTE_HANDLERS.items():
        signal.signal(signum, handler)
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


def _run_call(fn: Callable, name: str, arguments: dict, limit: int, memory_mb: int,
              timeout_s: float, trainer_fd: int, drop: tuple | None, pid1: bool,
              libc: Any) -> tuple[str, str]:
    reader, writer = multiprocessing.connection.Pipe(duplex=False)
    child = os.fork()
    if child == 0:
        try:
            reader.close()
            _enter_call_child(trainer_fd, drop, pid1, libc)
            writer.send_bytes(json.dumps(_call_tool(lambda: fn(**arguments), name, limit,
                                                    memory_mb)).encode())
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
