"""Stateful environments: what a world implements so that an episode keeps state across calls.

A recipe names its environment class with `tools.environment: module:Class` (instead of a
stateless `tools.registry`). One *episode* is one conversation: it is created from its record,
receives the parsed tool calls of each assistant turn in order, answers each with an
observation, exposes its final state to the checker, and is closed at the end. The class
conforms to the `Environment` protocol below:

    class MyEnvironment:
        def __init__(self, config: dict): ...        # the record's "environment" value ({})
        def call(self, name: str, arguments: dict) -> Any: ...   # a JSON-able result
        def state(self) -> dict: ...                 # JSON-able final state, for the checker
        def close(self) -> None: ...                 # optional
        @classmethod
        def preload(cls) -> None: ...                # optional, see below
        TEXT_OBSERVATIONS = False                    # optional: a str result is shown as is
        CHECK_ARGUMENT_TYPES = True                  # optional: False checks names only
        RUNS_WITHHELD_TOOLS = False                  # optional: later turns' tools run now

- The tools the student may call, and their argument schemas, are the record's "tools" (OpenAI
  function schemas), plus its "tools_by_turn" entries as user turns reach them (opd.data).
  Every call is validated against those schemas before it is sent: a call to a tool not
  offered, or with arguments of the wrong type, never reaches `call` and is answered by an
  `{"error": ...}` observation (status "invalid"). With `RUNS_WITHHELD_TOOLS = True` a call
  to a tool the record offers only at a later user turn is validated against its schema and
  runs before that turn (a benchmark whose executor runs any function of its backends, as
  BFCL's does); the prompt still shows it only from its turn on, and no error names it.
- `call` returns the observation value; its JSON (capped at `tools.max_result_chars`) is what
  the student sees, or, with `TEXT_OBSERVATIONS = True`, a returned str as it is (a benchmark
  whose observations are text, such as BFCL's). With `CHECK_ARGUMENT_TYPES = False` the
  executor checks only a call's tool and argument names (required present, none unknown), not
  the values' types or enums: for a benchmark that passes any value to its functions. An
  exception raised by `call` becomes that call's `{"error": ...}`
  observation (status "failed"); the environment and its state live on.
- The environment lives in one sandboxed process for the episode's lifetime (opd.tool_worker):
  the sandbox of stateless tools (scrubbed environment, own directory, unprivileged user, PID
  namespace, memory cap, `tools.timeout_s` wall-clock per call, output cap) holds for every
  call. Two episodes never share a process, so they never see each other's state.
- A call that hangs past the timeout or crashes the process loses the episode's state: the call
  counts as failed and the episode ends, truncated with reason "environment_died". A
  constructor that raises or hangs ends its episode before the first turn, truncated with
  reason "environment_start_failed"; `AgentTrajectory.environment_error` says why. Other
  episodes, the batch and the run go on.
- At the episode's end (finished or truncated, while the environment lives) `state()` is read
  once into `AgentTrajectory.environment_state` (None when the environment is gone or state()
  fails), which eval passes to a checker that takes it (opd.eval); then `close()` runs and
  everything the episode's process started is killed and its directory emptied.

The class must be importable by name from a module (not defined in `__main__`): the worker
imports it there. When the trainer runs as root, episodes run as an unprivileged user that may
not read the trainer's files (data under a private home). The interpreter and the import path
are made readable to it where the worker has a mount namespace (opd.sandbox_fs), so a module
imported lazily still loads; a data file read lazily in `__init__` would fail. `preload()`, when
the class has it, runs once in each worker before any episode, still as the trainer's user:
import and read there what every episode needs (episodes are forked from it and inherit it).
If it raises, the worker does not start and the run stops with the reason; if it hangs, the
run stops after the worker start timeout with a sentence naming it.
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol, runtime_checkable

from opd.errors import ConfigError


@runtime_checkable
class Environment(Protocol):
    """What every environment class has (constructed as `cls(config)`); `close()` and the
    class method `preload()` are optional (see the module docstring)."""

    def call(self, name: str, arguments: dict) -> Any: ...

    def state(self) -> dict: ...


ENVIRONMENT_METHODS = ("call", "state")  # the protocol's methods, named in errors


def check_environment(environment: Any, key: str = "tools.environment") -> None:
    """`ConfigError` (naming `key`) unless `environment` is a class a worker can construct."""
    if not isinstance(environment, type):
        raise ConfigError(f"{key} names a {type(environment).__name__}, not a class with "
                          "__init__(config), call(name, arguments) and state().")
    missing = [name for name in ENVIRONMENT_METHODS
               if not callable(getattr(environment, name, None))]
    if missing:
        raise ConfigError(f"{key}: class {environment.__qualname__} has no "
                          f"{' or '.join(missing)} method; an environment needs "
                          "call(name, arguments) and state().")
    try:
        pickle.dumps(environment)
        importable = environment.__module__ != "__main__"
    except Exception:
        importable = False
    if not importable:
        raise ConfigError(f"{key}: class {environment.__qualname__} cannot be sent to a worker "
                          "process; define it at module level in an importable module.")
