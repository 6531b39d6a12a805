"""Environments for tests/test_environments.py and tests/test_multiturn.py: module-level, so
worker processes can import them."""

import os
import signal
import time

from sandbox_fixtures import find_scratch, parse_date, write_scratch


class Counter:
    """Counts its own calls; `config` may start it elsewhere than 0."""

    def __init__(self, config):
        self.count = int(config.get("start", 0))
        self.log = []

    def call(self, name, arguments):
        if name == "add":
            self.count += arguments.get("by", 1)
            self.log.append(arguments.get("by", 1))
            return {"count": self.count}
        if name == "get":
            return {"count": self.count}
        if name == "fail":
            raise ValueError("asked to fail")
        if name == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if name == "hang":
            time.sleep(3600)
        if name == "nap":
            time.sleep(arguments["seconds"])
            return {"count": self.count}
        if name == "pid":
            return os.getpid()
        raise KeyError(name)

    def state(self):
        return {"count": self.count, "log": self.log}


class BrokenConstructor:
    def __init__(self, config):
        raise RuntimeError(f"cannot build from {config}")

    def call(self, name, arguments):
        return None

    def state(self):
        return {}


class HangingConstructor:
    def __init__(self, config):
        time.sleep(3600)

    def call(self, name, arguments):
        return None

    def state(self):
        return {}


def schema(name, **properties):
    return {"type": "function", "function": {
        "name": name, "description": name,
        "parameters": {"type": "object", "properties": properties}}}


COUNTER_TOOLS = [schema("add", by={"type": "integer"}), schema("get"), schema("fail"),
                 schema("crash"), schema("hang"), schema("pid")]


class EarlyCounter(Counter):
    """Runs a record's later turns' tools before they are offered, as BFCL's executor does."""

    RUNS_WITHHELD_TOOLS = True


class Preloaded(Counter):
    """Reads what its episodes need in preload() (in the worker, before episodes fork)."""

    loaded_in_pid = None

    @classmethod
    def preload(cls):
        cls.loaded_in_pid = os.getpid()

    def call(self, name, arguments):
        if name == "get":
            return {"loaded_in_pid": type(self).loaded_in_pid, "episode_pid": os.getpid()}
        return super().call(name, arguments)


class FailingPreload(Counter):
    @classmethod
    def preload(cls):
        raise FileNotFoundError("no such file: scenarios.json")


class HangingPreload(Counter):
    @classmethod
    def preload(cls):
        while True:
            time.sleep(1)


class Scratch(Counter):
    """Writes to and looks at the shared scratch directories across an episode's calls."""

    def call(self, name, arguments):
        if name == "write":
            return write_scratch(arguments["token"])
        if name == "find":
            return find_scratch(arguments["token"])
        if name == "date":
            return parse_date(arguments["text"])
        return super().call(name, arguments)


SCRATCH_TOOLS = [schema("write", token={"type": "string"}), schema("find", token={"type": "string"}),
                 schema("date", text={"type": "string"})]
