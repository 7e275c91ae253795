"""`python -m scaling plan` at its edges: meshes the trainer refuses, what --search says it
searched and why nothing came back, and output whose rows add up to their totals.

References are independent of scaling/plan.py: mesh shapes by brute force from the published
Llama 3 8B dimensions and the rule set's mapping, the step's terms read back from the printed
text, memory from scaling.accounting directly."""

import math
import re

import pytest

from scaling import accounting as acc
from scaling import plan
from scaling.__main__ import main
from scaling.config import RematPolicyName as R
from scaling.config import load_config
from scaling.hardware import HARDWARE, get_hardware

PRESETS = "configs/models"
LLAMA3_8B = f"{PRESETS}/llama3_8b.yaml"
# Llama 3 8B (HF config.json): D, query heads, kv heads, F, V.
D8B, N8B, K8B, F8B, V8B = 4096, 32, 8, 14336, 128256
UNITS = {"ms": 1e-3, "us": 1e-6, "GB": 1e9, "MB": 1e6, "GiB": 2**30, "MiB": 2**20, "KiB": 2**10}


def _num(value: str, unit: str) -> float:
    return float(value.replace(",", "")) * UNITS[unit]


def _shapes(n):
    """Every (data, fsdp, tensor) with product n, by brute force."""
    return [(d, f, n // (d * f)) for d in range(1, n + 1) for f in range(1, n + 1) if n % (d * f) == 0]


def _llama3_8b_runs(shape, batch, accum=1):
    """Default rules: embed over fsdp; heads, kv heads, MLP and vocab over tensor; the batch
    over data x fsdp, whole rows of every micro-batch on each device."""
    d, f, t = shape
    tensor_ok = all(x % t == 0 for x in (N8B, K8B, F8B, V8B))
    return tensor_ok and D8B % f == 0 and (batch // accum) % (d * f) == 0


# ------------------------------------------------------------------ meshes the trainer refuses


def test_mesh_that_cannot_split_the_kv_heads_exits_2_and_lists_the_shapes_that_can(capsys):
    rc = main(["plan", "--config", LLAMA3_8B, "--devices", "16", "--mesh.fsdp=1", "--mesh.tensor=16"])
    out = capsys.readouterr()
    assert rc == 2 and not out.out  # was a warning, exit 0 and a report priced on half a kv head
    assert "kv_heads=8 not divisible by 16" in out.err
    listed = re.search(r"mesh.data x mesh.fsdp x mesh.tensor that run on 16 devices: ([\dx, ]+);", out.err).group(1)
    expected = {s for s in _shapes(16) if _llama3_8b_runs(s, batch=16)}
    assert {tuple(map(int, s.split("x"))) for s in listed.split(", ")} == expected


def test_batch_not_divisible_by_the_batch_axes_exits_2(capsys):
    # 16 sequences over fsdp=64: a quarter of a sequence per device, which the trainer refuses.
    assert plan.main(["--config", f"{PRESETS}/tiny.yaml", "--devices", "64"]) == 2
    out = capsys.readouterr()
    assert not out.out
    assert "train.batch_size=16 is not divisible by the 64 devices the batch is split over (mesh.fsdp=64)" in out.err


def test_micro_batch_not_divisible_by_the_batch_axes_exits_2(capsys):
    # 4 sequences / grad_accum 2 = 2 rows a micro-batch over data 2 x fsdp 2.
    assert plan.main(["--config", LLAMA3_8B, "--devices", "8", "--mesh.data=2", "--mesh.fsdp=2", "--mesh.tensor=2",
                      "--train.batch_size=4", "--train.grad_accum=2"]) == 2
    err = capsys.readouterr().err
    assert "train.batch_size=4 / train.grad_accum=2 = 2 rows a micro-batch" in err
    listed = re.search(r"that run on 8 devices: ([\dx, ]+);", err).group(1)
    expected = {s for s in _shapes(8) if _llama3_8b_runs(s, batch=4, accum=2)}
    assert {tuple(map(int, s.split("x"))) for s in listed.split(", ")} == expected


def test_search_still_runs_when_the_configs_own_mesh_cannot(capsys):
    """The config's mesh only seeds --search: its errors become a note, the search answers."""
    assert plan.main(["--config", LLAMA3_8B, "--devices", "64", "--search", "--top", "3"]) == 0
    out = capsys.readouterr()
    assert out.err.startswith("note: mesh {'data': 1, 'fsdp': 64, 'tensor': 1}")
    assert "roofline per step" not in out.out and "| data | fsdp |" in out.out


# ------------------------------------------------------------------ what --search says


def test_search_says_what_it_searched_and_why_shapes_were_skipped(capsys):
    hw = get_hardware("h100")
    assert plan.main(["--config", LLAMA3_8B, "--hardware", "h100", "--devices", "64", "--search"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("searched "))
    shapes = _shapes(64)
    beyond = [s for s in shapes if s[2] > hw.devices_per_node]
    batch = [s for s in shapes if s[2] <= hw.devices_per_node and 16 % (s[0] * s[1])]
    kept = len(shapes) - len(beyond) - len(batch)
    assert (len(shapes), len(beyond), len(batch), kept) == (28, 6, 13, 9)  # C(8, 2) ordered triples of 2^6
    assert f"searched 28 data x fsdp x tensor shapes of 64 devices ({kept} kept:" in line
    assert f"{len(batch)} with train.batch_size=16 not split evenly over the batch axes" in line
    assert f"{len(beyond)} with tensor beyond a node of 8" in line


def test_search_table_shows_policies_that_price_the_same_once(capsys):
    """dots and selective save the same tensors (accounting.layer_residuals): one row, both named,
    so the top N are N different candidates."""
    assert plan.main(["--config", LLAMA3_8B, "--hardware", "a100_40gb", "--devices", "8", "--search"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if re.match(r"\| \d", r)]
    assert len(rows) == 10
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    distinct = {(c[0], c[1], c[2], c[4], c[5], c[6], c[9]) for c in cells}
    assert len(distinct) == len(rows)  # twin rows had filled 3 of the 10
    assert any(c[3] == "dots = selective" for c in cells)
    assert not any(c[3] in ("dots", "selective") for c in cells)


def test_search_with_nothing_that_fits_exits_2_and_names_the_smallest_candidate(capsys):
    """Llama 3 8B on one 40 GB A100: f32 params, grads and two moments are 16 bytes a parameter,
    119.66 GiB before any activation: no remat or grad_accum helps, only devices."""
    hw = get_hardware("a100_40gb")
    cfg = load_config(LLAMA3_8B, ["--train.batch_size=2", "--train.seq_len=1024"])
    rc = plan.main(["--config", LLAMA3_8B, "--hardware", "a100_40gb", "--devices", "1", "--search",
                    "--train.batch_size=2", "--train.seq_len=1024"])
    out = capsys.readouterr().out
    assert rc == 2
    state = 8_030_261_248 * 16
    least = min(acc.training_memory(cfg, acc.MeshShape(), hw=hw, policy=p, grad_accum=a).total
                for p in plan.SEARCH_POLICIES for a in (1, 2))
    m = re.search(r"nothing fits: the least memory, .* needs ([\d.,]+) (GiB) per device "
                  r"\(params \+ grads \+ moments ([\d.,]+) (GiB)\)", out)
    assert _num(*m.group(1, 2)) == pytest.approx(least, abs=0.006 * 2**30)
    assert _num(*m.group(3, 4)) == pytest.approx(state, abs=0.006 * 2**30)
    assert "add devices" in out and "batch_size" not in out.split("nothing fits")[1]  # (grad_accum is searched)


def test_nothing_fits_because_of_activations_points_at_seq_len(capsys):
    """A device just above the states but below states + one sequence's activations: the hint
    is the sequence, not more devices for the states."""
    import dataclasses

    cfg = load_config(f"{PRESETS}/tiny.yaml", ["--train.batch_size=1", "--train.seq_len=512"])
    h100 = get_hardware("h100")
    mem = acc.training_memory(cfg, acc.MeshShape(), hw=h100, policy=R.full, grad_accum=1)
    small = dataclasses.replace(h100, hbm_bytes=mem.params + mem.grads + mem.optimizer + 1, usable_fraction=1.0)
    HARDWARE["test_small"] = small
    try:
        rc = plan.main(["--config", f"{PRESETS}/tiny.yaml", "--hardware", "test_small", "--devices", "1",
                        "--search", "--train.batch_size=1", "--train.seq_len=512"])
    finally:
        del HARDWARE["test_small"]
    out = capsys.readouterr().out
    assert rc == 2 and "lower train.seq_len" in out


# ------------------------------------------------------------------ rows that add up


def _calibrated_terms(out):
    line = next(x for x in out.splitlines() if x.startswith("  matmuls "))
    lhs, rhs = line.split(" = ")
    terms = dict((k.strip(" +"), _num(v, u)) for k, v, u in re.findall(r"([a-z -]+?)(?: \([^)]*\))? ([\d.,]+) (ms|us)",
                                                                       lhs))
    step = re.search(r"^  step: ([\d.,]+) (ms|us);", out, re.M)
    return terms, _num(*rhs.split()), _num(*step.group(1, 2))


def test_calibrated_terms_add_up_to_the_step(capsys):
    """8 H100s under FSDP: the collectives are a term of the sum, not hidden 'inside' a total
    that the printed terms fell 180 ms short of."""
    assert plan.main(["--config", LLAMA3_8B, "--hardware", "h100", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    terms, total, step = _calibrated_terms(out)
    cfg = load_config(LLAMA3_8B)
    st = acc.training_time(cfg, acc.MeshShape(1, 8, 1), get_hardware("h100"))
    assert terms["collectives"] == pytest.approx(st.serial_comm_seconds, abs=5e-6)
    assert sum(terms.values()) == pytest.approx(total, abs=2e-5) and total == step


def test_small_model_rows_add_up_and_none_reads_zero(capsys):
    """tiny on 8 devices: every row had read 0.00 GB and times to 0.01 ms; printed at a scale
    that keeps their digits, the traffic rows add up to the memory-bound term."""
    assert plan.main(["--config", f"{PRESETS}/tiny.yaml", "--hardware", "h100", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^    .{44} +([\d.,]+) (GB|MB) +([\d.,]+) (ms|us)$", out, re.M)
    assert len(rows) >= 6 and {u for _, u, _, _ in rows} == {"MB"}
    terms, _, _ = _calibrated_terms(out)
    assert sum(_num(t, u) for _, _, t, u in rows) == pytest.approx(terms["memory-bound"], rel=0.01)
    comm = re.findall(r"^  fsdp .* ([\d.,]+) (GiB|MiB|KiB) +([\d.,]+) (ms|us)$", out, re.M)
    assert comm and all(float(b) > 0 and float(t) > 0 for b, _, t, _ in comm)
    # the norm scales' f32 grads: (2 per layer + final) x D x 4 bytes
    assert f"{(2 * 4 + 1) * 128 * 4 / 1024:.2f} KiB" in out


# ------------------------------------------------------------------ argument handling


@pytest.mark.parametrize("name, key", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA_H200", "h200"),
                                       ("NVIDIA A100-SXM4-40GB", "a100_40gb"), ("TPU v5 lite", "tpu_v5e")])
def test_hardware_by_the_name_the_device_reports(name, key):
    assert get_hardware(name) is HARDWARE[key]


def test_hardware_variants_with_other_rates_stay_unknown(capsys):
    assert plan.main(["--config", f"{PRESETS}/tiny.yaml", "--hardware", "NVIDIA H100 NVL"]) == 2
    assert f"unknown hardware 'NVIDIA H100 NVL'; allowed: {', '.join(HARDWARE)}" in capsys.readouterr().err


@pytest.mark.timeout(20)
def test_factorizations_of_a_large_device_count_are_quick():
    """2^40 devices: C(42, 2) ordered triples; the loop over 1..n never finished."""
    got = list(plan._factorizations(2**40))
    assert len(got) == len(set(got)) == math.comb(42, 2)
    assert all(d * f * t == 2**40 for d, f, t in got)
    n = 360  # and every triple of a composite count, against brute force
    assert sorted(plan._factorizations(n)) == sorted(_shapes(n))
