"""A profiled training step's memory-bound kernels by the accounting's traffic terms, with what a
remat policy recomputes singled out by its op names.

    python experiments/recompute_kernels.py docs/results/remat_session50/profile_1b-2048-8_auto-*-unrolled

Each argument is a stem `<dir>/profile_<model>-<seq>-<batch>_<attn>-<remat>-<layers>` that
`bench_train.py --profile-variant ... --keep-trace` wrote, profiled without command buffers
(`XLA_FLAGS=--xla_gpu_enable_command_buffer=`), so that every kernel carries its HLO op:
`<stem>.perfetto.json.gz` and either the step's HLO text `<stem>.hlo.txt.gz` or the op map this
script writes from it (`<stem>.ops.json.gz`: each launched op's result type and op name, a few
hundred KiB where the HLO text is megabytes; `--write-ops`).

JAX names what `jax.checkpoint` re-runs in the backward `.../rematted_computation/...`. A kernel
whose (root) op name says so is recomputed forward work; XLA may also fold a recomputed op into a
backward kernel (the SwiGLU product under `dots`), which then counts as backward. Groups, per step:
  matmul, attention (custom calls: our Pallas/Mosaic kernels), optimizer (outside autodiff),
  loss/head/embedding (a vocab-sized result or operand, the embedding's gather and scatter), weights
  (casts, slices and gradient conversions: no activation among the kernel's result and
  operands), scan stacks (zero-filling broadcasts, dynamic-update-slices), copies the trace
  names no op for (XLA's memcpys in a scanned step), memsets, layer forward, layer backward,
  recomputed forward.
Beside them, the accounting's terms at the hardware table's rates (--hardware).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"profile_(?P<model>.+?)-(?P<seq>\d+)-(?P<batch>\d+)_(?P<attn>\w+)-(?P<remat>\w+)-(?P<layers>scan|unrolled)$")
MATMUL = re.compile(r"^(nvjet|sm90_xmma|cutlass|gemm_fusion|.*cublas)", re.I)
INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(\(?[^\s]+)\s+([\w\-$]+)\(.*?(?:op_name=\"([^\"]*)\")?", re.M)

GROUPS = ("matmul", "attention", "layer forward", "layer backward", "recomputed forward", "weights",
          "loss/head/embedding", "optimizer", "scan stacks", "copies (no HLO op)", "memsets")
# accounting.training_time's traffic terms that each memory-bound group stands for
TERMS = {
    "layer forward": ("layer elementwise forward",),
    "layer backward": ("layer elementwise backward",),
    "recomputed forward": ("recomputed elementwise forward",),
    "weights": ("weight casts f32 -> c", "weight gradients c -> f32"),
    "loss/head/embedding": ("loss (f32 logits read twice, f32 gradient)", "final norm, embedding gather"),
    "optimizer": ("optimizer (grad norm + fused AdamW)",),
    "scan stacks": ("saved residuals copied into the scan stack", "scan stacks zero-filled before the loops"),
}


def gpu_kernels(trace_path: Path) -> list[dict]:
    events = json.loads(gzip.open(trace_path).read())["traceEvents"]
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "device:GPU" in e.get("args", {}).get("name", "")}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu]


def dims(t: str) -> list[list[int]]:
    """The shapes in an HLO type (a tuple has several)."""
    return [[int(x) for x in m.split(",") if x] for m in re.findall(r"\[([\d,]*)\]", t)]


def has_tokens(t: str, batch: int, seq: int) -> bool:
    """Does a type hold a [B, T, ...] or [B·T, ...] activation (or a [.., B, T, ..] stack slice)?"""
    return any(s[:2] == [batch, seq] or s[:1] == [batch * seq] or s[1:3] == [batch, seq] for s in dims(t))


def op_map_from_hlo(text: str, wanted: set[str]) -> dict[str, list]:
    """op -> [result type, opcode, op_name, operand types] for the ops the trace launched (a
    reduction over the tokens into a weight-shaped partial sum reads activations; the loss's
    log-sum-exp reads the logits)."""
    types, lines = {}, {}
    for line in text.splitlines():
        m = re.match(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(\([^)]*\)|[^\s]+)\s+([\w\-$]+)\((.*)$", line)
        if m:
            types[m.group(1)] = m.group(2)
            if m.group(1) in wanted:
                lines[m.group(1)] = m
    out = {}
    for op, m in lines.items():
        args = m.group(4)
        depth, end = 1, len(args)
        for i, ch in enumerate(args):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                end = i
                break
        operands = re.findall(r"%([\w.\-]+)", args[:end])
        name = re.search(r'op_name="([^"]*)"', args)
        out[op] = [m.group(2), m.group(3), name.group(1) if name else "", [types.get(o, "") for o in operands]]
    return out


def load_ops(stem: Path, kernels: list[dict]) -> dict[str, list]:
    ops_path, hlo_path = Path(f"{stem}.ops.json.gz"), Path(f"{stem}.hlo.txt.gz")
    if ops_path.exists():
        return json.loads(gzip.open(ops_path).read())
    if not hlo_path.exists():
        raise SystemExit(f"{stem}: neither {ops_path.name} nor {hlo_path.name}")
    wanted = {str(e.get("args", {}).get("hlo_op", "")) for e in kernels}
    return op_map_from_hlo(gzip.open(hlo_path, "rt").read(), wanted)


def group_of(kernel: str, op: list | None, batch: int, seq: int, vocab: int) -> str:
    rtype, opcode, name, operands = op if op else ("", "", "", [])
    types = [rtype, *operands]
    if kernel.startswith("Memset"):
        return "memsets"
    if op is None and kernel.lower().startswith("memcpy"):
        return "copies (no HLO op)"  # a scanned step's: 130 a step on the 1b, 5 ms
    if MATMUL.match(kernel) or "gemm" in opcode:
        return "matmul"
    if opcode == "custom-call" or "mosaic" in kernel:
        return "attention"
    if "broadcast_fusion" in kernel or "dynamic_update_slice" in kernel:
        return "scan stacks"
    if "jvp(" not in name and "transpose(" not in name:
        return "optimizer"
    if any(vocab in s for t in types for s in dims(t)) or "_take" in name:
        return "loss/head/embedding"
    if not any(has_tokens(t, batch, seq) for t in types):
        return "weights"
    if "rematted_computation" in name:
        return "recomputed forward"
    return "layer backward" if "transpose(" in name else "layer forward"


def measure(stem: Path, steps: int, vocab: int) -> dict[str, float]:
    m = NAME.match(stem.name)
    batch, seq = int(m["batch"]), int(m["seq"])
    kernels = gpu_kernels(Path(f"{stem}.perfetto.json.gz"))
    ops = load_ops(stem, kernels)
    out = collections.Counter()
    for e in kernels:
        op = ops.get(str(e.get("args", {}).get("hlo_op", "")))
        out[group_of(e["name"], op, batch, seq, vocab)] += e["dur"] / steps / 1e3
    return dict(out)


def predicted(model: str, seq: int, batch: int, remat: str, layers: str, hw_name: str) -> dict[str, float]:
    from scaling import accounting as acc
    from scaling.config import load_config
    from scaling.hardware import get_hardware

    cfg = load_config(ROOT / "configs" / "models" / f"{model}.yaml", [
        "--data.source=synthetic", f"--train.seq_len={seq}", f"--train.batch_size={batch}", f"--remat.policy={remat}",
        f"--model.scan_layers={'true' if layers == 'scan' else 'false'}"])
    st = acc.training_time(cfg, acc.MeshShape(), get_hardware(hw_name))
    return {g: sum(st.traffic.get(t, 0.0) for t in terms) / st.rates.hbm * 1e3 for g, terms in TERMS.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stems", nargs="+", help="<dir>/profile_<model>-<seq>-<batch>_<attn>-<remat>-<layers>")
    p.add_argument("--steps", type=int, default=3, help="steps in each trace (bench_train's --profile-steps)")
    p.add_argument("--hardware", default="h200")
    p.add_argument("--write-ops", action="store_true", help="write <stem>.ops.json.gz from <stem>.hlo.txt.gz")
    p.add_argument("--json", default=None, help="also write the table's numbers here")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    from scaling.config import load_config

    rows = []
    for s in args.stems:
        stem = Path(s.removesuffix(".perfetto.json.gz"))
        m = NAME.match(stem.name)
        if not m:
            print(f"{s}: not a profile_<model>-<seq>-<batch>_<attn>-<remat>-<layers> stem", file=sys.stderr)
            return 2
        vocab = load_config(ROOT / "configs" / "models" / f"{m['model']}.yaml", []).model.vocab_size
        if args.write_ops:
            kernels = gpu_kernels(Path(f"{stem}.perfetto.json.gz"))
            ops = load_ops(stem, kernels)
            with gzip.open(f"{stem}.ops.json.gz", "wt") as f:
                json.dump(ops, f, separators=(",", ":"))
        got = measure(stem, args.steps, vocab)
        pred = predicted(m["model"], int(m["seq"]), int(m["batch"]), m["remat"], m["layers"], args.hardware)
        rows.append({"profile": stem.name, "measured_ms": got, "predicted_ms": pred})
    print("| step | " + " | ".join(GROUPS) + " |\n|---|" + "---:|" * len(GROUPS))
    for r in rows:
        cells = []
        for g in GROUPS:
            ms = r["measured_ms"].get(g, 0.0)
            cells.append(f"{ms:.2f}" + (f" ({r['predicted_ms'][g]:.2f})" if g in r["predicted_ms"] else ""))
        print(f"| {r['profile'].removeprefix('profile_')} | " + " | ".join(cells) + " |")
    print("\n(measured ms a step; in brackets the accounting's terms at the table's copy rate)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
