"""experiments/bench_gemv.py's pure parts on the CPU (the sweep itself needs a GPU profile):
the kernel shapes, tile -> GemvBlocks, and the best-tiles spec the decoder parses back."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_gemv as bg  # noqa: E402
import pytest  # noqa: E402

from scaling.config import ModelConfig  # noqa: E402
from scaling.kernels.decode_gemv import GemvBlocks, LayerBlocks  # noqa: E402


def test_shapes_blocks_and_best_spec_round_trip():
    cfg = ModelConfig(vocab_size=32000, hidden_size=2048, num_layers=1, num_heads=32, num_kv_heads=8, mlp_dim=8192)
    s = bg.shapes(cfg)
    assert s["qkv"] == (48 * 64, 2048) and s["out"] == (2048, 2048) and s["gate_up"] == (16384, 2048)
    assert s["down"] == (2048, 8192) and s["head"] == (32000, 2048)  # 32000 is whole 256-row blocks
    # qkv: block_n is RoPE pairs per program -> rope_parts = head_dim / 2 / block_n
    assert bg.blocks_for("qkv", (2, 1024, 4, 2), 64) == GemvBlocks(1024, 2, 16, 4, 2)
    assert bg.blocks_for("qkv", (64, 1024, 4, 2), 64) is None  # more pairs than half a head
    assert bg.blocks_for("down", (4, 512, 8, 3), 64) == GemvBlocks(512, 4, 0, 8, 3)
    rows = [{"kernel": "down", "tiles": "xla", "us": 1.0},  # the peer never wins the spec
            {"kernel": "down", "tiles": "4/512/8/3", "us": 9.0},
            {"kernel": "down", "tiles": "2/1024/4/2", "us": 8.0},
            {"kernel": "qkv", "tiles": "2/1024/4/2", "us": 5.0},
            {"kernel": "head", "tiles": "4/2048/8/1", "error": "did not compile"}]
    spec = bg.best_spec(rows, cfg)
    assert spec == "qkv=1024/2/16/4/2,down=1024/2/0/4/2"
    parsed = LayerBlocks.parse(spec)
    assert parsed.down == GemvBlocks(1024, 2, 0, 4, 2) and parsed.qkv.rope_parts == 16


def test_parse_tiles_names_the_bad_item():
    assert bg.parse_tiles("2/1024/4/3;4/512/4/4;") == [(2, 1024, 4, 3), (4, 512, 4, 4)]
    with pytest.raises(SystemExit, match="'2/1024/4'"):
        bg.parse_tiles("2/1024/4")
    with pytest.raises(SystemExit, match="'2/0/4/3'"):
        bg.parse_tiles("2/0/4/3")
