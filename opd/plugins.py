"""Plugins a recipe names as `module:attribute` strings, resolved once before any engine starts.

A recipe names its world through these keys; the library names none:
- `prepare`          `prepare(build: bool = True)` -> the directory "{prepared}" stands for
- `tools.registry`   `registry()` -> `opd.tool_schemas.ToolRegistry`
- `tools.environment` a class `Env(config)` with `call(name, arguments)`, `state()` and an
                     optional `close()` (the opd.environments.Environment protocol); exclusive
                     with `tools.registry`
- `tools.parser`     a registered parser name (`hermes`) or `module:function(text) -> [ToolCall]`
- `eval.checker`     `check(final_text, record) -> bool`, or `check(final_text, record, episode)`
                     to receive the episode's outcome (the opd.checker.Checker protocols)
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opd.checker import Checker
from opd.config import with_prepared
from opd.environments import Environment, check_environment
from opd.errors import ConfigError
from opd.tool_calls import get_parser
from opd.tool_schemas import ToolRegistry


def resolve(spec: str, key: str) -> Any:
    """`module:attribute` -> the object; `ConfigError` names the key when it cannot be imported."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ConfigError(f"{key} {spec!r} must look like module:attribute "
                          "(e.g. worlds.toolcalc.tools:registry).")
    if not all(part.isidentifier() for part in module_name.split(".")):
        raise ConfigError(f"{key} {spec!r} must name its module by an absolute dotted name "
                          "importable from PYTHONPATH (e.g. worlds.toolcalc.tools), not a "
                          "relative name or a file path.")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise ConfigError(f"{key} {spec!r}: there is no module {module_name!r}.") from None
        raise  # the plugin's own module failed to import one of its dependencies: a bug there
    if not hasattr(module, attribute):
        raise ConfigError(f"{key} {spec!r}: module {module_name!r} has no attribute "
                          f"{attribute!r}.")
    return getattr(module, attribute)


def resolve_callable(spec: str, key: str) -> Callable:
    value = resolve(spec, key)
    if not callable(value):
        raise ConfigError(f"{key} {spec!r} names a {type(value).__name__}, not a function.")
    return value


@dataclass(frozen=True)
class Plugins:
    """What a run's plugin keys name, resolved; None where the recipe names none."""

    prepare: Callable | None
    tool_registry: Any  # opd.tool_schemas.ToolRegistry
    parser: Callable
    checker: Checker | None
    environment: type[Environment] | None = None  # a stateful environment class
    # Top-level packages first imported while resolving (the standard library and opd aside):
    # the plugins' own and what they import; the module-level code of each ran.
    imported: tuple[str, ...] = ()

    @property
    def eval_checker(self) -> Checker:
        """The checker, to evaluate (the config requires one wherever data.eval is set)."""
        if self.checker is None:
            raise ConfigError("eval.checker must name a module:function(final_text, record) "
                              "-> bool to evaluate.")
        return self.checker


def resolve_plugins(config) -> Plugins:
    """Every plugin of `config`, resolved and called where cheap (the tool registry), so that a
    bad name stops the run in one sentence before any engine starts."""
    before = set(sys.modules)
    tool_registry = ToolRegistry([])
    if config.tools.registry:
        tool_registry = resolve_callable(config.tools.registry, "tools.registry")()
        if not isinstance(tool_registry, ToolRegistry):
            raise ConfigError(f"tools.registry {config.tools.registry!r} returned a "
                              f"{type(tool_registry).__name__}, not an "
                              "opd.tool_schemas.ToolRegistry.")
    environment = None
    if config.tools.environment:
        if config.tools.registry:
            raise ConfigError("tools.registry and tools.environment are exclusive: a stateful "
                              "environment answers every tool call itself; set one of them.")
        environment = resolve(config.tools.environment, "tools.environment")
        check_environment(environment, f"tools.environment {config.tools.environment!r}")
    parser = resolve_callable(config.tools.parser, "tools.parser") \
        if ":" in config.tools.parser else get_parser(config.tools.parser)
    prepare = resolve_callable(config.prepare, "prepare") if config.prepare else None
    checker = resolve_callable(config.eval.checker, "eval.checker") \
        if config.eval.checker else None
    imported = sorted({name.partition(".")[0] for name in set(sys.modules) - before}
                      - sys.stdlib_module_names - {"opd"})
    return Plugins(prepare=prepare, tool_registry=tool_registry, parser=parser,
                   environment=environment, checker=checker, imported=tuple(imported))


def code_keys(config) -> list[str]:
    """`key: value` of every plugin key the config sets: the code a run imports and runs."""
    keys = ("prepare", "tools.registry", "tools.environment", "tools.parser", "eval.checker")
    values = [(key, getattr(getattr(config, key.partition(".")[0]), key.partition(".")[2])
               if "." in key else getattr(config, key)) for key in keys]
    return [f"{key}: {value}" for key, value in values
            if value and (key != "tools.parser" or ":" in value)]


def prepared(config, plugins: Plugins, *, build: bool = True):
    """`config` with "{prepared}" resolved by the recipe's prepare step.

    The step returns a path (or any `os.PathLike`, such as toolcalc's `Prepared`).
    `build=False` asks the step for its cached output only (dry run, command-line eval); the
    config comes back unresolved when nothing is cached.
    """
    if plugins.prepare is None:
        return config
    root = plugins.prepare(build=build)
    if root is None:
        return config
    return with_prepared(config, os.fspath(root))
