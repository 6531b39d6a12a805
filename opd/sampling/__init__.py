"""Samplers: turn prompts into finished multi-turn trajectories with the current student weights.

`opd.sampling.base.Sampler` is the one interface the trainer sees; each engine is a class in its
own module, registered here by its `rollout.engine` name. Adding an engine is one new file with a
`Sampler` subclass plus one line below (CONTRIBUTING.md shows it). Entries are "module:Class"
strings, so importing this package imports no engine (vLLM loads only when chosen).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opd.sampling.base import Sampler

SAMPLERS = {
    "hf": "opd.sampling.hf:HFSampler",
    "vllm": "opd.sampling.vllm:VLLMSampler",
}


def sampler_class(engine: str) -> type[Sampler]:
    """The Sampler registered as `rollout.engine: <engine>` (the config checked the name)."""
    module, _, name = SAMPLERS[engine].partition(":")
    return getattr(importlib.import_module(module), name)
