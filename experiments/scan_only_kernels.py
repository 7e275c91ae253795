"""What a scanned training step runs that the same step with unrolled layers does not, beside the
accounting's scan terms.

    python experiments/scan_only_kernels.py docs/results/scan_session49   # on the CPU

Reads pairs of Perfetto traces `profile_<model>-<seq>-<batch>_<attn>-<remat>-{scan,unrolled}.perfetto.json.gz`
(`bench_train.py --profile-variant ... --keep-trace`, one device). Per step, the GPU time of three
kernel groups that only the scan needs: the broadcast fusions that zero-fill the scan's stacks,
the dynamic-update-slice fusions and the memcpys; the scanned step's less the unrolled step's.
Beside it, at the hardware table's copy bandwidth: the stack copy alone (`2 S`, S the saved
residuals per micro-batch) and with the zero fill (`3 S + G`, G the layer gradients in the
param dtype), the two terms `accounting.training_time` adds for scanned layers.
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
NAME = re.compile(r"profile_(?P<model>.+?)-(?P<seq>\d+)-(?P<batch>\d+)_(?P<attn>\w+)-(?P<remat>\w+)-scan\.perfetto\.json\.gz$")


def group(kernel: str) -> str | None:
    if kernel.startswith("memcpy"):
        return "memcpy"
    if "dynamic_update_slice" in kernel:
        return "dynamic-update-slice"
    if "broadcast_fusion" in kernel:
        return "broadcast"
    return None


def scan_group_ms(trace: Path, steps: int) -> dict[str, float]:
    """Milliseconds per step of each scan-only group in a trace of `steps` steps (GPU events)."""
    events = json.loads(gzip.open(trace).read())["traceEvents"]
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "device:GPU" in e.get("args", {}).get("name", "")}
    out: dict[str, float] = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu and (g := group(e["name"])):
            out[g] += e["dur"] / steps / 1e3
    return dict(out)


def predicted_ms(model: str, seq: int, batch: int, remat: str, hw_name: str) -> tuple[float, float]:
    """(2 S, 3 S + G) at the table's copy bandwidth, milliseconds."""
    from scaling import accounting as acc
    from scaling.config import load_config
    from scaling.hardware import get_hardware

    cfg = load_config(ROOT / "configs" / "models" / f"{model}.yaml", [
        "--data.source=synthetic", f"--train.seq_len={seq}", f"--train.batch_size={batch}", f"--remat.policy={remat}"])
    st = acc.training_time(cfg, acc.MeshShape(), get_hardware(hw_name))
    copy = st.traffic["saved residuals copied into the scan stack"]
    fill = st.traffic["scan stacks zero-filled before the loops"]
    return copy / st.rates.hbm * 1e3, (copy + fill) / st.rates.hbm * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="holds the scan/unrolled trace pairs")
    p.add_argument("--steps", type=int, default=3, help="profiled steps per trace (bench_train's --profile-steps)")
    p.add_argument("--hardware", default="h200")
    args = p.parse_args(argv)
    scans = sorted(Path(args.folder).glob("profile_*-scan.perfetto.json.gz"))
    if not scans:
        print(f"error: no profile_*-scan.perfetto.json.gz in {args.folder}", file=sys.stderr)
        return 2
    print("| step | scan-only kernels ms (scanned - unrolled) | 2 S ms | 3 S + G ms | measured / (3 S + G) |\n"
          "|---|---:|---:|---:|---:|")
    for scan in scans:
        m = NAME.search(scan.name)
        unrolled = scan.with_name(scan.name.replace("-scan.perfetto", "-unrolled.perfetto"))
        if not m or not unrolled.exists():
            print(f"error: {scan}: no matching unrolled trace {unrolled.name}", file=sys.stderr)
            return 2
        measured = sum(scan_group_ms(scan, args.steps).values()) - sum(scan_group_ms(unrolled, args.steps).values())
        two_s, full = predicted_ms(m["model"], int(m["seq"]), int(m["batch"]), m["remat"], args.hardware)
        print(f"| {m['model']} {m['batch']}x{m['seq']} {m['remat']} | {measured:.2f} | {two_s:.2f} | {full:.2f} | "
              f"{measured / full:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
