"""How evenly do the SMs of a GPU stream HBM when all of them stream at once, and is a slow SM
slow every time? (The megakernel gives every CTA an equal share of each phase and meets at a
grid barrier, so its phases end with the slowest CTA: docs/decoding.md, twenty-sixth session.)

One persistent program per SM reads an equal contiguous share of a large buffer; each records the
SM it ran on (%smid) and its start and end (%globaltimer). Repeated launches tell whether the
slow ones are the same SMs (then a plan could weight its shares per SM) or the same program ids,
or neither (noise).

    python3 experiments/sm_stream_skew.py --gib 2 --launches 20

Needs torch and triton (the GPU machine has both; not a dependency of the package). Prints and
writes $OUT/sm_stream_skew.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def skew_summary(dur, sm) -> dict:
    """dur [launches, programs] (µs) and sm [launches, programs] (the SM each ran on): how far the
    slowest program is over its launch's median; each SM's time relative to its launch's median,
    averaged over launches; and whether the same SMs (or program ids) are slow in the first and the
    second half of the launches (the correlation of their mean relative times: near 1, fixed; near 0,
    noise)."""
    import numpy as np

    dur, sm = np.asarray(dur, dtype=np.float64), np.asarray(sm)
    launches, progs = dur.shape
    over = dur.max(axis=1) / np.median(dur, axis=1) - 1
    rel = dur / np.median(dur, axis=1, keepdims=True)
    half = launches // 2

    def means(key_of, ks):
        out: dict = {}
        for k in ks:
            for p in range(progs):
                out.setdefault(key_of(k, p), []).append(rel[k, p])
        return {q: float(np.mean(v)) for q, v in out.items()}

    def corr(key_of):
        a, b = means(key_of, range(half)), means(key_of, range(half, launches))
        keys = sorted(set(a) & set(b))
        return float(np.corrcoef([a[q] for q in keys], [b[q] for q in keys])[0, 1])

    by_sm = means(lambda k, p: int(sm[k, p]), range(launches))
    order = sorted(by_sm, key=by_sm.get)
    return {"slowest_over_median": {"median": float(np.median(over)), "max": float(over.max())},
            "programs_on_distinct_sms": float(np.mean([len(set(s)) == progs for s in sm])),
            "same_sm_each_launch_for_a_program": float(np.mean(sm == sm[0])),
            "corr_halves_by_sm": corr(lambda k, p: int(sm[k, p])),
            "corr_halves_by_program": corr(lambda k, p: p),
            "sm_relative_time": {str(q): by_sm[q] for q in sorted(by_sm)},
            "slowest_sms": order[-8:], "fastest_sms": order[:8]}


def main(argv=None) -> int:
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def stream(x_ptr, out_ptr, smid_ptr, t_ptr, n_per, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        acc = tl.zeros((BLOCK,), tl.float32)
        base = pid.to(tl.int64) * n_per
        for i in range(0, n_per, BLOCK):
            acc += tl.load(x_ptr + base + i + tl.arange(0, BLOCK)).to(tl.float32)
        t1 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + pid, tl.sum(acc))
        tl.store(smid_ptr + pid, sm)
        tl.store(t_ptr + 2 * pid, t0)
        tl.store(t_ptr + 2 * pid + 1, t1)

    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0, help="buffer read per launch")
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--block", type=int, default=16384, help="bf16 elements per load step")
    ap.add_argument("--programs", type=int, default=0, help="0: one per SM")
    args = ap.parse_args(argv)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    progs = args.programs or sms
    n_per = int(args.gib * (1 << 30)) // 2 // progs // args.block * args.block
    x = torch.randn(progs * n_per, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(progs, device="cuda", dtype=torch.float32)
    smid = torch.empty(progs, device="cuda", dtype=torch.int32)
    ts = torch.empty(2 * progs, device="cuda", dtype=torch.int64)
    launches = []
    for k in range(args.launches + 2):  # (the first two: compile and warm)
        stream[(progs,)](x, out, smid, ts, n_per, BLOCK=args.block, num_warps=8)
        torch.cuda.synchronize()
        if k >= 2:
            t = ts.view(progs, 2).cpu().numpy()
            launches.append({"smid": smid.cpu().numpy().tolist(), "start": t[:, 0].tolist(), "end": t[:, 1].tolist()})
    dur = np.array([np.array(l["end"]) - np.array(l["start"]) for l in launches], dtype=np.float64) / 1e3  # µs
    sm = np.array([l["smid"] for l in launches])
    result = {"device": props.name, "sms": sms, "programs": progs, "bytes_per_program": 2 * n_per,
              "launch_bandwidth_TBps": float(np.median(2 * n_per * progs / (dur.max(axis=1) * 1e-6) / 1e12)),
              **skew_summary(dur, sm)}
    sm_means = result["sm_relative_time"]
    print(json.dumps({k: v for k, v in result.items() if k != "sm_relative_time"}, indent=1))
    print("per-SM relative time (mean over launches), by SM id:")
    print(" ".join(f"{s}:{v:.3f}" for s, v in sm_means.items()))
    Path(os.environ.get("OUT", ".")).joinpath("sm_stream_skew.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
