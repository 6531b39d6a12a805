"""Build a student engine in a world of one and export it untrained, as `train` exports `final/`.

    python tests/dist_scripts/export_dtype.py STUDENT_DIR OUT_DIR BACKEND PRECISION
"""

from __future__ import annotations

import sys
from pathlib import Path

from opd.backends import build_student
from opd.config import OptimConfig, StudentConfig
from opd.dist import init_world, shutdown

REPO = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    student_dir, out_dir, backend, precision = sys.argv[1:]
    student = StudentConfig(backend=backend, precision=precision,
                            deepspeed_config=str(REPO / "configs" / "deepspeed" / "zero3.json"))
    world = init_world("cpu", threads=1)
    try:
        build_student(student_dir, student, OptimConfig(), world).export_hf(Path(out_dir))
    finally:
        shutdown()
