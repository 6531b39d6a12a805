"""Build a student engine in a world of one and export it untrained, as `train` exports `final/`.

    python tests/dist_scripts/export_dtype.py STUDENT_DIR OUT_DIR BACKEND PRECISION
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from opd.backends import build_student  # noqa: E402
from opd.config import Config  # noqa: E402
from opd.dist import init_world, shutdown  # noqa: E402

if __name__ == "__main__":
    student_dir, out_dir, backend, precision = sys.argv[1:]
    config = Config()  # the engines read model.student and student.* only
    config.model.student = student_dir
    config.student.backend, config.student.precision = backend, precision
    config.student.deepspeed_config = str(REPO / "configs" / "deepspeed" / "zero3.json")
    world = init_world("cpu", threads=1)
    try:
        build_student(config, world).export_hf(Path(out_dir))
    finally:
        shutdown()
