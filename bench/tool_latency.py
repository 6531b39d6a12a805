"""Tools that answer `latency_s` later, as an API round trip would (bench/rollout_vllm.py).

Sent to the sandbox workers by reference, so this module imports nothing heavy.
"""

from __future__ import annotations

import functools
import time


def _delayed(fn, latency_s: float, **arguments):
    time.sleep(latency_s)
    return fn(**arguments)


def with_latency(registry, latency_s: float):
    """`registry` (an opd.tool_schemas.ToolRegistry) with every tool `latency_s` slower."""
    from opd.tool_schemas import Tool, ToolRegistry

    return ToolRegistry([Tool(tool.schema, functools.partial(_delayed, tool.fn, latency_s))
                         for tool in registry.tools])
