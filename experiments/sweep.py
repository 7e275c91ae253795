"""Run a scaling-law sweep: the same arguments as `python -m scaling sweep`.

    python experiments/sweep.py --config configs/sweeps/tiny_cpu.yaml --out sweeps/tiny --workers 2
    python experiments/sweep.py --config configs/sweeps/isoflop_gpu.yaml --dry-run --workers 4
"""

import os
import sys

# This tree's package first, as experiments/train.py does (else an installed `scaling`, e.g. another
# checkout's editable install, would run instead)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scaling.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["sweep", *sys.argv[1:]]))
