"""experiments/bench_decode.py on the CPU: bench_ours times `reps` generate calls and reports the
median one, with the bytes a step reads; the CLI refuses --reps below 1."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_decode as bd  # noqa: E402
from scaling import decode  # noqa: E402
from scaling.config import ModelConfig  # noqa: E402
from scaling.model import build_model  # noqa: E402

CFG = ModelConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128)


def test_bench_ours_reports_the_median_of_its_timed_runs():
    dec = decode.Decoder(build_model(CFG, seed=0), layers="xla", chunk=4)
    r = bd.bench_ours(dec, CFG, batch=2, prompt=5, new=6, rng=np.random.default_rng(0), reps=3)
    assert len(r["step_ms_runs"]) == 3
    assert r["step_ms"] == pytest.approx(sorted(r["step_ms_runs"])[1], abs=1e-3)
    # bytes: the weights once, and each row's bf16 cache over the mean attended length: 5 + (steps + 1) / 2
    steps = dec.generate([[1] * 5] * 2, 6, max_len=128).decode_steps
    kv = 2 * (5 + (steps + 1) / 2) * bd.kv_bytes_per_token(CFG)
    assert r["kv_bytes"] == pytest.approx(kv) and r["weight_bytes"] == decode.weight_bytes_per_step(dec.weights)
    assert r["tok_s"] == pytest.approx(2 / (r["step_ms"] / 1e3), rel=1e-9)


def test_end_to_end_is_the_whole_generate_call(monkeypatch):
    """Time the decoder spends outside its own prefill and step timers (here a 50 ms sleep before
    each call) counts end to end, as transformers' generate is timed by the wall clock."""
    import time

    dec = decode.Decoder(build_model(CFG, seed=0), layers="xla", chunk=4)
    generate = dec.generate
    monkeypatch.setattr(dec, "generate", lambda *a, **k: time.sleep(0.05) or generate(*a, **k))
    r = bd.bench_ours(dec, CFG, batch=1, prompt=5, new=6, rng=np.random.default_rng(0), reps=1)
    assert r["call_ms_beyond_prefill_and_steps"] >= 50
    assert r["e2e_tok_s"] <= 6 / 0.05


def test_cli_refuses_fewer_than_one_rep(capsys):
    with pytest.raises(SystemExit):
        bd.main(["--reps", "0"])
    assert "--reps must be >= 1, got 0" in capsys.readouterr().err


def test_sampling_specs_reach_generate(monkeypatch):
    assert bd.parse_sampling("greedy") == {}
    assert bd.parse_sampling("temperature=0.8/top_p=0.95/top_k=50") == {"temperature": 0.8, "top_p": 0.95, "top_k": 50}
    with pytest.raises(ValueError, match="'temp=1' is not key=value with a key in \\['sampler', 'temperature', 'top_k', 'top_p'\\]"):
        bd.parse_sampling("temp=1")
    with pytest.raises(ValueError, match="top_k must be a int, got '5.5'"):
        bd.parse_sampling("top_k=5.5")
    dec = decode.Decoder(build_model(CFG, seed=0), layers="xla", chunk=4)
    seen = []
    generate = dec.generate
    monkeypatch.setattr(dec, "generate", lambda *a, **k: seen.append(k) or generate(*a, **k))
    bd.bench_ours(dec, CFG, batch=1, prompt=5, new=6, rng=np.random.default_rng(0), reps=1,
                  sampling={"temperature": 0.8, "top_p": 0.9})
    assert seen and all(k["temperature"] == 0.8 and k["top_p"] == 0.9 for k in seen)
    assert bd.parse_sampling("temperature=1/sampler=pallas") == {"temperature": 1.0, "sampler": "pallas"}
    with pytest.raises(ValueError, match="sampler must be one of \\('auto', 'xla', 'pallas'\\), got 'sort'"):
        bd.parse_sampling("temperature=1/sampler=sort")
    samplers = []
    monkeypatch.setattr(dec, "generate", lambda *a, **k: samplers.append(dec.sampler) or generate(*a, **k))
    bd.bench_ours(dec, CFG, batch=1, prompt=5, new=6, rng=np.random.default_rng(0), reps=1,
                  sampling={"temperature": 0.8, "sampler": "pallas"})
    assert samplers == ["pallas"] * 2 and dec.sampler == "auto"
