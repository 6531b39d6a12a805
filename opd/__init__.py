"""On-policy distillation of tool-using LLMs.

Importing `opd` is cheap: public names resolve lazily, and no backend (deepspeed, FSDP) is
imported until a trainer asks for it.
"""

import importlib

_PUBLIC = {
    "AgentTrajectory": "opd.trajectory",
    "collect_trajectory": "opd.rollout",
    "tool_observation": "opd.chat",
    "pack_trajectories": "opd.packing",
    "distillation_loss": "opd.loss",
    "fused_distillation_loss": "opd.loss",
    "TopKTeacher": "opd.loss",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'opd' has no attribute {name!r}")
