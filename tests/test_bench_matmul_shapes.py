"""experiments/bench_matmul_shapes.py on the CPU: its shapes are the accounting's layer matmuls,
its rates are its FLOPs over its own timings, and bad arguments exit 2."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import bench_matmul_shapes as B  # noqa: E402

from scaling import accounting as acc  # noqa: E402
from scaling.config import load_config  # noqa: E402


@pytest.mark.parametrize("preset", ["tiny", "350m", "llama3_8b", "tinyllama_1.1b"])
def test_layer_shapes_hold_the_accountings_layer_weights(preset):
    m = load_config(ROOT / "configs" / "models" / f"{preset}.yaml").model
    assert sum(i * o for i, o in B.layer_shapes(m)) == acc.layer_matmul_params(m)


def test_rates_are_flops_over_the_timed_seconds(monkeypatch):
    monkeypatch.setattr(B, "seconds_per_call", lambda fn, reps: 2e-3)
    shapes = [(8, 16), (16, 8)]
    assert B.fwd_bwd_rate(shapes, 32, 1) == pytest.approx(6 * 32 * (8 * 16 + 16 * 8) / 2e-3)
    assert B.square_rate(16, 1) == pytest.approx(2 * 16**3 / 2e-3)
    # the f32 head backward: dx and dW, 2 x 2 x tokens x D x V
    assert B.head_f32_backward_rate(8, 40, 32, 1) == pytest.approx(4 * 32 * 8 * 40 / 2e-3)


def test_cpu_run_writes_a_row_per_model(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert B.main(["--models", "tiny", "--tokens", "64", "--square", "64", "--reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"] for r in rows] == ["tiny"] and rows[0]["layer"] > 0 and rows[0]["head"] > 0
    assert rows[0]["head_f32_bwd"] > 0
    assert "| tiny | 128 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--models", "nope"], ["--tokens", "0"], ["--models", ","]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        B.main(argv)
    assert e.value.code == 2
