"""Teachers: score the student's trajectories and return a signal the loss understands.

`opd.teachers.base.Teacher` is the one interface the trainer sees; each engine is a class
registered here by its `teacher.engine` name. Adding one is one new file with a `Teacher`
subclass plus one line below (CONTRIBUTING.md). Entries are "module:Class" strings, so importing
this package imports no engine; the config layer reads the names,
`opd.teachers.base.teacher_class` loads one.
"""

TEACHERS = {
    "zero_inference": "opd.teachers.in_process:ZeroInferenceTeacher",
    "tensor_parallel": "opd.teachers.in_process:TensorParallelTeacher",
    "replicated": "opd.teachers.in_process:ReplicatedTeacher",
    "served": "opd.teachers.served:ServedTeacher",
}
