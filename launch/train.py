"""Train a student by on-policy distillation.

    deepspeed launch/train.py [--recipe R] [--cluster C] [section.key=value ...] [--dry-run]

The same command runs under `torchrun`, `srun` and plain `python` (one process); `opd-train` is
the installed name. With no arguments it runs the default recipe (recipes/toolcalc_tiny.yaml) on
the local CPU cluster file: prepare (cached) -> eval before -> OPD -> eval after -> the
teacher / before / after table. `--dry-run` prints the resolved config, the world layout and
per-rank memory, then exits. The stages, top-down: opd/pipeline.py; the loop: opd/trainer.py.
"""

import os
import sys

from opd.pipeline import main

if __name__ == "__main__":
    main()
    # Done: logs closed, wandb finished, process groups destroyed. Skip interpreter finalization,
    # where engine threads torn down by C++ static destructors aborted 2 of ~45 completed 2-rank
    # CPU runs here (SIGABRT, "terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
