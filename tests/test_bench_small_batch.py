"""experiments/bench_small_batch.py: its variants, checked before anything compiles, and its table's
ratios against XLA's layers, on hand-made rows."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_small_batch  # noqa: E402
from scaling.kernels import decode_tma  # noqa: E402


def test_variants_name_their_decoder_settings_and_refuse_unknown_ones():
    assert bench_small_batch.decoder_kwargs("xla") == {"layers": "xla"}
    every = bench_small_batch.decoder_kwargs("tma_all_qkv")
    assert every["layers"] == "pallas_tma"
    assert every["tma"].projections == (*decode_tma.PROJECTIONS, decode_tma.QKV)
    with pytest.raises(SystemExit, match="unknown 'tma_some'; allowed"):
        bench_small_batch.decoder_kwargs("tma_some")
    with pytest.raises(SystemExit, match="unknown"):
        bench_small_batch.main(["--variants", "xla,nope"])


def test_table_gives_each_variant_its_ratio_to_xla_at_the_same_case():
    rows = [{"model": "m", "prompt": 128, "batch": 8, "variant": "xla", "layers": "xla", "step_ms": 1.0,
             "tok_s": 8000.0, "frac": 0.5},
            {"model": "m", "prompt": 128, "batch": 8, "variant": "tma", "layers": "pallas_tma", "step_ms": 0.8,
             "tok_s": 10000.0, "frac": 0.625},
            {"model": "m", "prompt": 128, "batch": 4, "variant": "tma", "layers": "pallas_tma", "step_ms": 0.5,
             "tok_s": 8000.0, "frac": 0.3},
            {"model": "m", "prompt": "", "batch": "", "variant": "pallas", "skip": "cannot run"}]
    table = bench_small_batch.render(rows, {"torch_copy": 4.2e12, "jax_copy": 2.8e12}, {"jax": "x"})
    lines = table.splitlines()
    assert "torch_copy 4.20 TB/s, jax_copy 2.80 TB/s" in lines[1]
    assert lines[5].endswith("| xla | 1.000 | 8,000 | 50.0% | 1.000x |")
    assert lines[6].endswith("| pallas_tma | 0.800 | 10,000 | 62.5% | 1.250x |")
    assert lines[7].endswith("| 0.500 | 8,000 | 30.0% |  |")  # (no XLA row at batch 4)
    assert "cannot run" in lines[8]
