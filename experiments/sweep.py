"""Run a scaling-law sweep: the same arguments as `python -m scaling sweep`.

    python experiments/sweep.py --config configs/sweeps/tiny_cpu.yaml --out sweeps/tiny --workers 2
    python experiments/sweep.py --config configs/sweeps/isoflop_gpu.yaml --dry-run --workers 4
"""

import sys

from scaling.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["sweep", *sys.argv[1:]]))
