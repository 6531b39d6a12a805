"""Submit a training run to Slurm: `python launch/submit.py --cluster C --recipe R [--dry-run]`.

The sbatch generator lives in opd/submit.py (installed as `opd-submit`).
"""

import sys

from opd.submit import main

if __name__ == "__main__":
    sys.exit(main())
