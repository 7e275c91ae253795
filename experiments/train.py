"""Train a model: the same arguments as `python -m scaling train`.

    python experiments/train.py --config configs/tiny_corpus.yaml --train.steps=100
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scaling.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
