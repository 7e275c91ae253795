"""accounting.training_comms against what XLA:GPU compiled on 2 H200s, and training_time against
the multi-GPU steps measured there.

docs/results/hlo_collectives_session47/ holds `experiments/hlo_collectives.py`'s output for 15
configurations (1b and 350m; bf16 and f32 compute, bf16 params; remat none and full; the
chunked loss, tied embeddings, grad accumulation; the default, `fsdp` and `dp` rule sets). Each
file gives, per mesh and collective kind, the bytes per step XLA's optimized HLO moves (loop
bodies times their trip counts). The accounting is recomputed here, on the CPU, for the same
configuration and must give the same bytes: the recorded "predicted" column is not read.
"""

import ast
import json
import re
from pathlib import Path

import pytest

from scaling import accounting as acc
from scaling.config import load_config
from scaling.hardware import get_hardware

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "hlo_collectives_session47"
HEADER = re.compile(r"^# collectives in the compiled train step: `(\w+)`, (\w+), batch (\d+) x (\d+), remat (\w+), "
                    r"2 x NVIDIA H200")


def recorded() -> list[tuple[str, list[str], dict[str, int], dict[str, float]]]:
    """(file, overrides, mesh sizes, {kind: XLA MiB without integer arrays}) per recorded mesh."""
    out = []
    for path in sorted(RESULTS.glob("*.md")):
        lines = path.read_text().splitlines()
        model, dtype, batch, seq, remat = HEADER.match(lines[0]).groups()
        sets = next((ln.split(": ", 1)[1].split() for ln in lines if ln.startswith("overrides: ")), [])
        overrides = [f"--model.compute_dtype={dtype}", f"--train.batch_size={batch}", f"--train.seq_len={seq}",
                     f"--remat.policy={remat}"] + [f"--{kv}" for kv in sets]
        sizes, table = None, False
        for ln in lines:
            if ln.startswith("## mesh "):
                sizes, xla = ast.literal_eval(ln[len("## mesh "):]), {}
                out.append((f"{path.stem} {sizes}", [f"configs/models/{model}.yaml", *overrides], sizes, xla))
            elif ln.startswith("| collective | XLA MiB by dtype"):
                table = True
            elif table and ln.startswith("| ") and not ln.startswith("|---"):
                kind, by_dtype = [c.strip() for c in ln.strip("|").split("|")][:2]
                floats = [(d, float(v.replace(",", ""))) for d, v in (x.split() for x in by_dtype.split(", ") if x != "-")]
                xla[kind] = sum(v for d, v in floats if d in ("bf16", "f32"))  # s32: token ids, not priced
            elif not ln.startswith("|"):
                table = False
    return out


CASES = recorded()


def test_the_recorded_runs_are_all_there():
    assert len({c[0].split()[0] for c in CASES}) == 15 and len(CASES) == 32


@pytest.mark.parametrize("name, args, sizes, xla", CASES, ids=[c[0] for c in CASES])
def test_predicted_bytes_per_kind_are_xlas(name, args, sizes, xla):
    cfg = load_config(args[0], args[1:] + [f"--mesh.{a}={s}" for a, s in sizes.items()])
    comms = acc.training_comms(cfg, acc.MeshShape(**sizes, rules=cfg.mesh.rules), get_hardware("h200"))
    predicted = {}
    for x in comms:
        predicted[x.kind] = predicted.get(x.kind, 0.0) + x.bytes / 2**20
    for kind in set(xla) | set(predicted):
        # XLA's files round to 0.1 MiB; the accounting leaves out the loss's [B, T] statistics
        # and scalars (at most 0.1 MiB here).
        assert predicted.get(kind, 0.0) == pytest.approx(xla.get(kind, 0.0), abs=0.15), (kind, predicted, xla)


# ------------------------------------------------------------ multi-GPU step times

MULTIGPU = ROOT / "docs" / "results" / "multigpu_session47"


def multigpu_runs():
    out = []
    for path in sorted(MULTIGPU.glob("bench_multigpu_*.json")):
        rec = json.loads(path.read_text())
        args, results = rec["args"], rec["results"]
        assert rec["device"] == "NVIDIA H200" and results[0]["mesh"] == "single"
        for r in results[1:]:
            out.append((f"{path.stem} {r['mesh']}", args, results[0], r))
    return out


def predicted_step(args, run):
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    if run["mesh"] != "single":
        axis, size = run["mesh"].split("=")
        sizes[axis] = int(size)
    cfg = load_config(f"configs/models/{args['model']}.yaml", [
        "--data.source=synthetic", f"--model.compute_dtype={args['dtype']}", f"--train.seq_len={run['seq_len']}",
        f"--train.batch_size={run['batch']}", f"--remat.policy={args['remat']}", f"--attention.impl={args['attention']}",
        *[f"--mesh.{a}={s}" for a, s in sizes.items()], *[f"--{o}" for o in args["override"]]])
    return acc.training_time(cfg, acc.MeshShape(**sizes), get_hardware("h200")).seconds


@pytest.mark.parametrize("name, args, single, run", multigpu_runs(), ids=[r[0] for r in multigpu_runs()])
def test_multi_gpu_steps_keep_the_single_devices_prediction_ratio(name, args, single, run):
    """2 H200s (experiments/bench_multigpu.py): the step time predicted at the hardware table's
    rates over the measured one, for data=2, fsdp=2 and tensor=2, against the same ratio for
    one device in the same run (the default rates' own bias: 0.94-1.05 since the forty-ninth
    session's attention rate and scan zero-fill): what the collectives add is priced. The 1b
    lands at 0.956-1.047 (batch 8 and 2 per device, scanned; batch 2 unrolled; a second batch-2
    run; fsdp=2 with grad_accum=2, batch 4 per device): its fsdp=2 runs 0.956-0.98 since the
    forty-eighth session (0.97-0.98 before the forty-ninth's changes), which prices the weight casts on the stored
    shard as XLA:GPU runs them (they had been priced on the gathered weights, which happened to
    fill this gap at fsdp=2 and overpriced fsdp=8 eightfold), and tensor=2 at batch 8 4.3% high
    (2.8% at the 631 TFLOP/s matmul rate of before: cheaper compute leaves the collectives a
    larger share; 4.7% since the forty-ninth). The 350m (batch 4; run after the model was set) lands at
    0.92-1.01, fsdp=2
    lowest: its layers' collectives move ~22 MiB, where the link may run below the 128 MiB rate
    the table holds (not measured: bench_collectives' 16 MiB wall times were the host's
    dispatch; not modeled).
    With FSDP's and data parallelism's collectives overlapped at the datasheet's 450 GB/s (the
    model before the forty-seventh session) the 1b's fsdp=2 came out at 0.82-0.83 (batch 2,
    scanned and unrolled)."""
    base = predicted_step(args, single) / single["step_time"]
    ratio = predicted_step(args, run) / run["step_time"]
    assert ratio / base == pytest.approx(1.0, abs=0.05 if args["model"] == "1b" else 0.08), (ratio, base)
