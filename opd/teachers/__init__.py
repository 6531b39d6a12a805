"""Teachers: score the student's trajectories and return a signal the loss understands.

`opd.teachers.base.Teacher` is the one interface the trainer sees; each engine is a class
registered here by its `teacher.engine` name. Adding one is one new file with a `Teacher`
subclass plus one line below (CONTRIBUTING.md). Entries are "module:Class" strings, so importing
this package imports no engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opd.teachers.base import Teacher

TEACHERS = {
    "zero_inference": "opd.teachers.in_process:ZeroInferenceTeacher",
    "tensor_parallel": "opd.teachers.in_process:TensorParallelTeacher",
    "replicated": "opd.teachers.in_process:ReplicatedTeacher",
}


def teacher_class(engine: str) -> type[Teacher]:
    """The Teacher registered as `teacher.engine: <engine>` (the config checked the name)."""
    module, _, name = TEACHERS[engine].partition(":")
    return getattr(importlib.import_module(module), name)
