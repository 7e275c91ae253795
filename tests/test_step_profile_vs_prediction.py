"""experiments/step_profile_vs_prediction.py: the measured terms are the profile's kernels regrouped
(f32 head kernels out of the matmuls, Mosaic attention kernels out of "other"), the predicted ones
accounting.training_time's, and a file it cannot place exits 2."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import step_profile_vs_prediction as S  # noqa: E402

from scaling import accounting as acc  # noqa: E402
from scaling.config import load_config  # noqa: E402
from scaling.hardware import get_hardware  # noqa: E402


def summary():
    cats = {c: {"us": 0.0, "count": 0} for c in ("matmul", "attention", "elementwise/reduction fusions",
                                                  "copy/dynamic-update-slice", "collectives", "other")}
    cats["matmul"]["us"], cats["other"]["us"] = 2 * 900.0, 2 * 150.0
    cats["elementwise/reduction fusions"]["us"], cats["copy/dynamic-update-slice"]["us"] = 2 * 300.0, 2 * 50.0
    kernels = [{"name": "sm90_xmma_gemm_f32f32_tf32f32_f32_nt", "category": "matmul", "us": 2 * 100.0},
               {"name": "anonymous_mosaic_gpu_kernel", "category": "other", "us": 2 * 120.0},
               {"name": "nvjet_sm90_tst", "category": "matmul", "us": 2 * 800.0}]
    return {"steps": 2, "categories": cats, "top_kernels": kernels, "window_us": 2 * 1500.0}


def test_measured_terms_regroup_the_kernels():
    m = S.measured(summary())
    assert m == pytest.approx({"bf16 matmul": 800e-6, "f32 matmul": 100e-6, "attention": 120e-6,
                               "memory-bound": 350e-6, "window": 1500e-6})


def test_the_optimizer_category_is_memory_bound():
    """A profile taken without command buffers files the optimizer's kernels under their own
    category: they had dropped out of the measured memory-bound term (12 ms of the 1b's step)."""
    s = summary()
    s["categories"]["optimizer update (outside autodiff)"] = {"us": 2 * 70.0, "count": 2}
    s["window_us"] += 2 * 70.0
    m = S.measured(s)
    assert m["memory-bound"] == pytest.approx(420e-6) and m["window"] == pytest.approx(1570e-6)


def test_predicted_terms_are_training_times(tmp_path, capsys):
    terms, flops = S.predicted("tiny", 64, 2, "unrolled", "h200")
    cfg = load_config(ROOT / "configs" / "models" / "tiny.yaml", [
        "--data.source=synthetic", "--train.seq_len=64", "--train.batch_size=2", "--remat.policy=none",
        "--model.scan_layers=false"])
    st = acc.training_time(cfg, acc.MeshShape(), get_hardware("h200"))
    assert flops == st.matmul_flops and terms["window"] == st.seconds
    assert sum(terms[k] for k in ("bf16 matmul", "f32 matmul", "attention", "memory-bound")) == pytest.approx(st.seconds)
    path = tmp_path / "profile_tiny-64-2_xla-none-unrolled.json"
    path.write_text(json.dumps(summary()))
    assert S.main([str(path)]) == 0
    assert "| tiny 64x2 unrolled | memory-bound | 0.3 |" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["profile_tiny-64-2_xla-names-scan.json", "summary.json"])
def test_a_file_it_cannot_place_exits_2(tmp_path, name):
    path = tmp_path / name
    path.write_text(json.dumps(summary()))
    assert S.main([str(path)]) == 2
