"""experiments/bench_decode.py on the CPU: bench_ours times `reps` generate calls and reports the
median one, with the bytes a step reads; the CLI refuses bad flags by name (exit 2) before anything
runs, and a run without a GPU; the table's columns, units and ratio."""

import re
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


# ------------------------------------------------------------------ the command line, on the CPU

# A tiny run: valid everywhere (each case below spoils one flag), and quick even where a bad flag
# is not caught early.
TINY = ["--models", "tiny", "--batches", "1", "--prompts", "4", "--new-tokens", "2", "--hf", "", "--bw-gib", "0.01"]


@pytest.mark.parametrize("extra, message", [
    (["--models", "tiny,nosuch"], "--models: unknown nosuch; allowed: 125m, 1b, 25m"),
    (["--batches", "1,x"], "--batches: 'x' is not an integer"),
    (["--batches", "0"], "--batches: 0 must be >= 1"),
    (["--prompts", "4,-4"], "--prompts: -4 must be >= 1"),
    (["--new-tokens", "1"], "--new-tokens must be >= 2, got 1"),  # (one token: no decode step to time)
    (["--chunk", "0"], "--chunk must be >= 1, got 0"),
    (["--hf-eager-new", "0"], "--hf-eager-new must be >= 1, got 0"),
    (["--bw-gib", "0"], "--bw-gib must be a finite number > 0, got 0.0"),
    (["--attention", "bogus"], "attention 'bogus' is not one of ['xla', 'pallas', 'fused', 'pallas_combined', 'auto']"),
    (["--attention", "xla,xla:warp"], "layers 'warp' is not one of"),
    (["--attention", "xla:megakernel/qkv_ld=x"], "a megakernel option is FIELD=INT, got 'qkv_ld=x'"),
    (["--attention", "xla:megakernel/nosuch=1"], "'nosuch' is not one of the plan's options"),
    (["--attention", "xla:xla/qkv_ld=0"], "plan options need the megakernel layers"),
    (["--tag", "runs/a"], "--tag 'runs/a': a file name stem"),
    (["--gemv-blocks", "qkv=1/2"], "--gemv-blocks 'qkv=1/2'"),
    (["--sampling", "greedy,top_p=1.5"], "top_p must be in (0, 1], got 1.5"),
    (["--sampling", "top_k=0"], "top_k must be >= 1, got 0"),
    (["--sampling", "top_k=1025"], "top_k 1025 exceeds tiny's vocabulary (1024)"),
    (["--hf", "8"], "--hf: batches [8] not in --batches [1]"),  # (they would run, and show nowhere)
    (["--hf", "1"], "--hf: transformers runs at prompt 128 only"),
    (["--hf-models", "1b"], "--hf-models: 1b not in --models (tiny)"),
])
def test_cli_refuses_bad_flags_by_name_before_anything_runs(extra, message, capsys, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    with pytest.raises(SystemExit) as e:
        bd.main(TINY + extra)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_refuses_an_output_folder_it_cannot_write(tmp_path, capsys, monkeypatch):
    """$OUT is checked first, not at the end of a long run."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("OUT", str(tmp_path / "file"))
    with pytest.raises(SystemExit) as e:
        bd.main(TINY)
    assert e.value.code == 2 and f"$OUT={str(tmp_path / 'file')!r} is not a folder" in capsys.readouterr().err
    monkeypatch.setenv("OUT", str(tmp_path / "new" / "dir"))  # a missing one is made
    assert bd.parse_args(TINY).tag == "bench_decode" and (tmp_path / "new" / "dir").is_dir()


def test_cli_without_a_gpu_says_so_and_exits_2(capsys, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(bd, "measure_bandwidth", lambda *a: pytest.fail("measured without a GPU"))
    assert bd.main(TINY) == 2
    assert "bench_decode.py measures decode on a GPU; JAX's backend here is 'cpu'" in capsys.readouterr().err


def test_cli_lists_take_spaces_and_keep_repeats(capsys, monkeypatch):
    """A repeated variant or sampling spec runs again (A,B,A against drift: docs/benchmarks.md);
    transformers' batches are a set; --quick leaves explicit flags alone."""
    monkeypatch.delenv("OUT", raising=False)
    a = bd.parse_args(["--models", " 1b , tiny", "--batches", "1, 8", "--prompts", "128 ,4", "--attention",
                       "pallas, xla:xla ,pallas", "--sampling", "greedy, temperature=0.8 / top_p=0.9,greedy",
                       "--hf", "1,1", "--hf-models", "1b", "--new-tokens", "8"])
    assert (a.model_list, a.batch_list, a.prompt_list) == (["1b", "tiny"], [1, 8], [128, 4])
    assert a.impls == ["pallas", "xla:xla", "pallas"] and a.hf_batches == [1] and a.hf_model_list == ["1b"]
    assert a.specs == ["greedy", "temperature=0.8 / top_p=0.9", "greedy"]
    assert bd.parse_sampling(a.specs[1]) == {"temperature": 0.8, "top_p": 0.9}
    q = bd.parse_args(["--quick", "--models", "llama2_7b"])
    assert (q.model_list, q.batch_list, q.prompt_list, q.hf_model_list) == (["llama2_7b"], [1, 8], [128], ["llama2_7b"])
    assert bd.parse_args(["--quick", "--models", "tiny"]).hf_model_list == []  # (not a default transformers model)
    # defaults: transformers at batch 1 only where the run has batch 1 at prompt 128
    assert bd.parse_args(["--prompts", "2048"]).hf_batches == [] and bd.parse_args([]).hf_batches == [1]
    # a documented run (docs/benchmarks.md, thirtieth session) past tinyllama's 2048 positions: a note
    capsys.readouterr()
    bd.parse_args(["--models", "tinyllama_1.1b", "--batches", "1", "--prompts", "2048", "--hf", ""])
    assert "2304 positions run past tinyllama_1.1b's max_seq_len 2048" in capsys.readouterr().err


def test_parse_impl():
    assert bd.parse_impl("pallas") == ("pallas", "auto", {}, {})
    assert bd.parse_impl("pallas:megakernel/qkv_ld=0/short_reach=0") == (
        "pallas", "megakernel", {"qkv_ld": 0}, {"megakernel_short_reach": 0})
    with pytest.raises(ValueError, match="short_reach must be >= 0"):
        bd.parse_impl("pallas:auto/short_reach=-1")


def test_render_columns_units_and_ratio(tmp_path):
    """Every row has the header's 15 columns; units by hand; 'e2e vs HF static' is ours / theirs;
    the command quotes the flags given; the JSON is strict."""
    import json
    from types import SimpleNamespace

    args = SimpleNamespace(quick=False, new_tokens=256, argv=["--models", "1b", "--hf", ""])
    ok = {"model": "1b", "impl": "pallas", "batch": 2, "prompt": 128, "sampling": "greedy", "layers": "pallas",
          "step_ms": 2.0, "tok_s": 1000.0, "roofline_tok_s": 2500.0, "bytes_per_step": 3.2e9, "achieved_Bps": 1.6e12,
          "frac": 0.4, "prefill_ms": 12.34, "e2e_tok_s": 900.0, "hf_eager_tok_s": 50.0, "hf_static_tok_s": 300.0}
    skip = {"model": "1b", "impl": "pallas", "batch": 64, "prompt": 2048, "sampling": "greedy",
            "skip": "ValueError: a | b\nsecond line"}
    table = bd.render([ok, skip], {"device": "H200", "jax": "0.11"}, {"jax_copy": 4e12}, args)
    lines = table.splitlines()
    assert "`python experiments/bench_decode.py --models 1b --hf ''`" in lines[0]
    rows = [l for l in lines if l.startswith("|")]
    cells = lambda line: [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
    assert [len(cells(l)) for l in rows] == [15] * 4
    assert cells(rows[2]) == ["1b", "pallas (pallas)", "2", "128", "2.000", "1,000", "2,500", "3.20", "1.60", "40.0%",
                              "12.3", "900", "50.0", "300.0", "3.0x"]  # 900 / 300: ours three times theirs
    assert cells(rows[3])[4] == "skipped: ValueError: a \\| b second line" and cells(rows[3])[5:] == [""] * 10
    # transformers ran greedy: a sampled row's ratio is labelled as against HF's greedy run
    sampled = dict(ok, sampling="temperature=0.8/top_p=0.95", e2e_tok_s=600.0)
    row = [l for l in bd.render([sampled], {}, {"jax_copy": 4e12}, args).splitlines() if l.startswith("| 1b")][0]
    assert cells(row)[1] == "pallas, temperature=0.8/top_p=0.95 (pallas)" and cells(row)[-1] == "2.0x (HF greedy)"
    bd.write_results(str(tmp_path), "t", table, {}, {"jax_copy": float("inf")}, [dict(ok, frac=float("nan"))])
    data = json.loads((tmp_path / "t.json").read_text(), parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert data["bandwidth"]["jax_copy"] is None and data["rows"][0]["frac"] is None
