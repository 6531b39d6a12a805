"""Tools that try to escape the sandbox, for tests/test_sandbox.py (module-level: workers import
them). A spawned process carries `token` in its command line so the test can find it in /proc."""

import os
import signal
import subprocess
import time

_calls = 0


def count_calls():
    global _calls
    _calls += 1
    return _calls


def environment():
    return {"env": dict(os.environ), "cwd": os.getcwd(), "files": sorted(os.listdir("."))}


def write_file(name):
    with open(name, "w") as handle:
        handle.write("left behind")
    return sorted(os.listdir("."))


def _sleeper(token):
    # A shell, not sys.executable: a tool may run as nobody, who cannot reach every interpreter.
    return ["/bin/sh", "-c", "while :; do sleep 1; done", token]


def spawn(token, wait):
    """A child in its own session and a double-forked daemon, then return or hang."""
    subprocess.Popen(_sleeper(token), start_new_session=True, stdin=subprocess.DEVNULL)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv("/bin/sh", _sleeper(token))
        os._exit(0)
    os.wait()
    if wait:
        while True:  # spin like a runaway code interpreter
            pass
    return "spawned"


def _trainer_pids(marker):
    """Processes that hold a file whose path has `marker`: how a tool would find its trainer."""
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and any(marker in os.readlink(f"/proc/{entry}/fd/{fd}")
                                       for fd in os.listdir(f"/proc/{entry}/fd")):
                pids.add(int(entry))
        except OSError:
            pass
    return sorted(pids)


def signal_trainer(marker):
    outcomes = {}
    for target in [os.getppid(), *_trainer_pids(marker)]:
        for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            try:
                os.kill(target, signum)
                outcomes[f"{target}/{signum}"] = "sent"
            except OSError as exc:
                outcomes[f"{target}/{signum}"] = type(exc).__name__
    return outcomes


def signal_worker(signum):
    """Signal the zygote (this call's parent); wait long enough for it to act on the signal."""
    os.kill(os.getppid(), signum)
    time.sleep(0.2)
    return "sent"


def depth(value):
    levels = 0
    while isinstance(value, list):
        value, levels = (value[0] if value else None), levels + 1
    return levels


SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


def write_scratch(token):
    """A file named `token` in each shared scratch directory; what this call can see of them."""
    for directory in SCRATCH_DIRS:
        with open(os.path.join(directory, token), "w") as handle:
            handle.write("left behind")
    return find_scratch(token)


def find_scratch(token):
    return [d for d in SCRATCH_DIRS if os.path.exists(os.path.join(d, token))]


def fill_shm(token, mb):
    """Write `mb` MiB to /dev/shm/<token> (shared memory is memory)."""
    with open(os.path.join("/dev/shm", token), "wb") as handle:
        for _ in range(mb):
            handle.write(b"\0" * 2**20)
    return mb


def parse_date(text):
    """datetime.strptime imports the standard library's _strptime on first use."""
    import datetime
    return datetime.datetime.strptime(text, "%Y-%m-%d").isoformat()


def lazy_import(module):
    """Import a standard-library module only now, at call time (as the sandbox user)."""
    import importlib
    return importlib.import_module(module).__name__


def _schema(name, properties=None):
    properties = properties or {}
    return {"type": "function", "function": {
        "name": name, "parameters": {"type": "object", "properties": properties,
                                     "required": list(properties)}}}


SANDBOX_TOOLS = [
    (_schema("count_calls"), count_calls),
    (_schema("environment"), environment),
    (_schema("write_file", {"name": {"type": "string"}}), write_file),
    (_schema("spawn", {"token": {"type": "string"}, "wait": {"type": "boolean"}}), spawn),
    (_schema("signal_trainer", {"marker": {"type": "string"}}), signal_trainer),
    (_schema("signal_worker", {"signum": {"type": "integer"}}), signal_worker),
    (_schema("depth", {"value": {}}), depth),
    (_schema("write_scratch", {"token": {"type": "string"}}), write_scratch),
    (_schema("find_scratch", {"token": {"type": "string"}}), find_scratch),
    (_schema("fill_shm", {"token": {"type": "string"}, "mb": {"type": "integer"}}), fill_shm),
    (_schema("parse_date", {"text": {"type": "string"}}), parse_date),
    (_schema("lazy_import", {"module": {"type": "string"}}), lazy_import),
]
