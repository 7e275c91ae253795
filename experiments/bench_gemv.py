"""Tile sweep of the decode layer kernels (scaling.kernels.decode_gemv), timed from a profile.

    python experiments/bench_gemv.py --models 1b,llama2_7b --batches 1,8 --out DIR

For each model shape, batch and kernel (qkv_rope, the output projection, gate_up_swiglu, the
down projection, the output head), every tile choice runs over `layers` distinct weight
copies (together several times the 50 MB L2, so every call reads HBM) `--reps` times in one
jitted call under the profiler. A kernel's time is the median duration of its GPU kernel
events, found by name (the kernels' names carry their tiles), so dispatch and launch gaps
are not counted: this ranks tiles, the in-situ decode step (decode_variants.py) is the
number that counts. XLA's einsum on the same shapes runs beside it (all kernels of its
trace window per call). Bytes per call: weights + activations in + out; reported against
the device copy bandwidth (torch `copy_`, read + write) measured in the same run.

Writes DIR/bench_gemv.json, DIR/bench_gemv.md and DIR/best_<model>_b<batch>.txt, the best
tiles as a `--gemv-blocks` spec for bench_decode.py / decode_variants.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

# (block_n, block_k, num_warps, num_stages): output features per program (qkv: RoPE pairs),
# reduction tile, warps, pipeline stages. Small block_n = many programs.
VECTOR_TILES = [(1, 2048, 4, 1), (2, 1024, 4, 2), (2, 2048, 4, 1), (4, 512, 4, 2), (4, 1024, 4, 2),
                (4, 1024, 8, 2), (4, 2048, 8, 1), (8, 512, 4, 2), (8, 1024, 8, 2), (8, 256, 4, 3),
                (16, 256, 4, 3), (16, 512, 8, 2)]
# 4-8 rows: the [B, BN, BK] accumulator is B times larger, so smaller BN * BK
VECTOR_TILES_WIDE = [(1, 1024, 4, 1), (2, 512, 4, 2), (2, 1024, 8, 1), (4, 256, 4, 2), (4, 512, 8, 2),
                     (4, 256, 8, 3), (8, 128, 4, 2), (8, 256, 8, 2), (16, 128, 8, 2), (16, 64, 4, 3)]
TC_TILES = [(16, 256, 4, 4), (16, 512, 4, 3), (32, 512, 4, 3), (32, 256, 8, 4), (64, 512, 8, 3)]
KERNELS = ("qkv", "out", "gate_up", "down", "head")


def parse_tiles(spec: str) -> list[tuple[int, int, int, int]]:
    """'2/1024/4/3;4/512/4/4' -> [(2, 1024, 4, 3), (4, 512, 4, 4)] (block_n/block_k/warps/stages)."""
    tiles = []
    for item in filter(None, spec.split(";")):
        nums = item.split("/")
        if len(nums) != 4 or not all(x.isdigit() and int(x) > 0 for x in nums):
            raise SystemExit(f"--tiles: {item!r} is not block_n/block_k/warps/stages (four positive ints)")
        tiles.append(tuple(int(x) for x in nums))
    return tiles


def shapes(cfg) -> dict:
    """Per kernel: (output rows of W^T, reduction dim)."""
    d, n, kv, h, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim
    vocab = -(-cfg.vocab_size // 256) * 256
    return {"qkv": ((n + 2 * kv) * h, d), "out": (d, n * h), "gate_up": (2 * f, d), "down": (d, f), "head": (vocab, d)}


def blocks_for(kernel: str, tile, head_dim: int):
    from scaling.kernels.decode_gemv import GemvBlocks

    bn, bk, warps, stages = tile
    if kernel == "qkv":  # block_n = RoPE pairs per program
        parts = head_dim // 2 // bn
        return None if parts < 1 or head_dim // 2 % bn else GemvBlocks(bk, bn, parts, warps, stages)
    return GemvBlocks(bk, bn, 0, warps, stages)


def make_call(kernel: str, blocks, cfg, xla: bool = False):
    """f(weights list, state) -> state: the kernel once per weight copy, chained through state."""
    import jax.numpy as jnp

    from scaling import layers
    from scaling.kernels import decode_gemv as g

    eps, n = cfg.norm_eps, cfg.num_heads
    inv_freq = layers.rope_frequencies(cfg)

    def norm(x):
        x32 = x.astype(jnp.float32)
        return (x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps))).astype(x.dtype)

    def f(ws, st):
        for w in ws:
            if kernel == "qkv":
                if xla:
                    st = dict(st, q=jnp.einsum("bd,xd->bx", norm(st["x"]), w).astype(st["x"].dtype))
                else:
                    q, kc, vc = g.qkv_rope(st["x"], w, inv_freq, st["pos"], st["k"], st["v"], num_heads=n, eps=eps,
                                           blocks=blocks)
                    st = dict(st, q=q, k=kc, v=vc)
            elif kernel in ("out", "down"):
                if xla:
                    st = dict(st, r=st["r"] + jnp.einsum("bk,dk->bd", st["a"], w))
                else:
                    st = dict(st, r=g.matmul_residual(st["a"], w, st["r"], blocks=blocks))
            elif kernel == "gate_up":
                if xla:
                    gu = jnp.einsum("bd,xd->bx", norm(st["x"]), w)
                    half = gu.shape[1] // 2
                    h = (gu[:, :half] * jnp.reciprocal(1 + jnp.exp(-gu[:, :half])) * gu[:, half:]).astype(st["x"].dtype)
                else:
                    h = g.gate_up_swiglu(st["x"], w, eps=eps, blocks=blocks)
                st = dict(st, x=st["x"] + h[:, : st["x"].shape[1]], h=h)
            else:
                if xla:
                    lg = jnp.einsum("bd,vd->bv", norm(st["x"]), w, preferred_element_type=jnp.float32)
                else:
                    lg = g.norm_matmul(st["x"], w, eps=eps, blocks=blocks)
                st = dict(st, x=st["x"] + lg[:, : st["x"].shape[1]].astype(st["x"].dtype))
        return st

    return f


def kernel_durations(trace_dir: Path, name_part: str | None) -> tuple[list[float], float]:
    """(durations in µs of the device kernels whose name contains name_part, or of all device
    kernels when None; the summed time of all device kernels)."""
    from scaling.profile_summary import load_trace

    trace, _ = load_trace(trace_dir)
    events = trace["traceEvents"]
    device_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                   and str(e.get("args", {}).get("name", "")).startswith("/device:GPU")}
    streams = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
               and e["pid"] in device_pids and "Stream" in str(e.get("args", {}).get("name", ""))}
    kern = [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams]
    total = sum(e["dur"] for e in kern)
    if name_part is None:
        return [e["dur"] for e in kern], total
    return [e["dur"] for e in kern if name_part in e.get("name", "")], total


def time_one(kernel, blocks, cfg, ws, st0, reps, xla=False) -> dict:
    import jax

    f = jax.jit(make_call(kernel, blocks, cfg, xla=xla), donate_argnums=(1,))
    st = f(ws, st0())
    jax.block_until_ready(st)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(reps):
                st = f(ws, st)
            jax.block_until_ready(st)
        if xla:
            durs, total = kernel_durations(Path(tmp), None)
            return {"us": total / (reps * len(ws)), "kernels_per_call": len(durs) / (reps * len(ws))}
        name = {"qkv": "decode_qkv_rope", "out": "decode_matmul_residual", "down": "decode_matmul_residual",
                "gate_up": "decode_gate_up_swiglu", "head": "decode_norm_matmul"}[kernel]
        from scaling.kernels.decode_gemv import _name

        durs, _ = kernel_durations(Path(tmp), _name(name, blocks))
    if not durs:
        return {"error": "kernel not found in the trace"}
    return {"us": statistics.median(durs), "kernels_per_call": len(durs) / (reps * len(ws))}


def sweep(cfg, model: str, batch: int, args, bw: float) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rows = []
    key = jax.random.key(0)
    h, kv = cfg.resolved_head_dim, cfg.num_kv_heads
    tiles = TC_TILES if batch >= 16 else VECTOR_TILES if batch <= 2 else VECTOR_TILES_WIDE
    if args.tiles:  # an explicit list replaces the defaults
        tiles = parse_tiles(args.tiles)
    for kernel in args.kernels.split(","):
        x_out, k_in = shapes(cfg)[kernel]
        wbytes = x_out * k_in * 2
        n_copies = int(min(32, max(4, -(-args.min_mb * 2**20 // wbytes))))
        ws = [jax.random.normal(jax.random.fold_in(key, i), (x_out, k_in), jnp.bfloat16) * 0.02 for i in range(n_copies)]
        s_len = 512

        def st0():
            d = cfg.hidden_size
            st = {"x": jnp.ones((batch, d), jnp.bfloat16), "a": jnp.ones((batch, k_in), jnp.bfloat16) * 0.1,
                  "r": jnp.zeros((batch, x_out if kernel in ("out", "down") else d), jnp.bfloat16)}
            if kernel == "qkv":
                st.update(pos=jnp.asarray(np.arange(batch) % s_len, jnp.int32),
                          k=jnp.zeros((batch, s_len, kv, h), jnp.bfloat16), v=jnp.zeros((batch, s_len, kv, h), jnp.bfloat16))
            return st

        out_cols = x_out // 2 if kernel == "gate_up" else x_out
        io_bytes = wbytes + batch * (k_in * 2 + out_cols * (4 if kernel == "head" else 2))
        cands = [("xla", None)] + [(f"{t[0]}/{t[1]}/{t[2]}/{t[3]}", blocks_for(kernel, t, h)) for t in tiles]
        for label, blocks in cands:
            if label != "xla" and blocks is None:
                continue
            try:
                r = time_one(kernel, blocks, cfg, ws, st0, args.reps, xla=label == "xla")
            except Exception as e:  # a tile that does not compile (registers, shared memory) is a row, not a crash
                r = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
            row = {"model": model, "batch": batch, "kernel": kernel, "tiles": label, "copies": n_copies,
                   "MB": wbytes / 1e6, **r}
            if "us" in r:
                row["GB_s"] = io_bytes / r["us"] / 1e3
                row["pct_copy_bw"] = 100 * io_bytes / (r["us"] * 1e-6) / bw
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ws
    return rows


def best_spec(rows, cfg) -> str:
    """The fastest tiles per kernel as a LayerBlocks.parse spec."""
    parts = []
    for kernel in KERNELS:
        ok = [r for r in rows if r["kernel"] == kernel and r["tiles"] != "xla" and "us" in r]
        if not ok:
            continue
        bn, bk, warps, stages = (int(v) for v in min(ok, key=lambda r: r["us"])["tiles"].split("/"))
        b = blocks_for(kernel, (bn, bk, warps, stages), cfg.resolved_head_dim)
        parts.append(f"{kernel}={b.block_k}/{b.block_n}/{b.rope_parts}/{b.num_warps}/{b.num_stages}")
    return ",".join(parts)


def render(rows, bw, versions) -> str:
    lines = [f"copy bandwidth (torch copy_, read + write): {bw / 1e12:.2f} TB/s; {versions}", "",
             "| model | batch | kernel | tiles n/k/warps/stages | MB | µs | GB/s | % copy BW | kernels/call |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "us" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['kernel']} | {r['tiles']} | {r['MB']:.1f} | {r['us']:.2f} | "
                         f"{r['GB_s']:.0f} | {r['pct_copy_bw']:.1f}% | {r['kernels_per_call']:.2f} |")
        else:
            lines.append(f"| {r['model']} | {r['batch']} | {r['kernel']} | {r['tiles']} | {r['MB']:.1f} | {r['error']} ||||")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="1b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--tiles", default="", help="tiles to sweep instead of the defaults, "
                    "'block_n/block_k/warps/stages;...'")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-mb", type=int, default=200, help="weight copies per kernel: at least this many MB")
    ap.add_argument("--out", default="bench_gemv_out")
    args = ap.parse_args(argv)

    import jax

    from bench_decode import measure_bandwidth, preset

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw_all = measure_bandwidth()
    bw = max(bw_all.values())
    versions = f"jax {jax.__version__}, {jax.devices()[0].device_kind}"
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s ({versions})", flush=True)
    rows = []
    for model in args.models.split(","):
        cfg = preset(model)
        for batch in (int(b) for b in args.batches.split(",")):
            got = sweep(cfg, model, batch, args, bw)
            rows += got
            spec = best_spec(got, cfg)
            (out / f"best_{model}_b{batch}.txt").write_text(spec + "\n")
            print(f"best {model} b{batch}: {spec}", flush=True)
            (out / "bench_gemv.json").write_text(json.dumps({"bandwidth": bw_all, "versions": versions, "rows": rows}, indent=1))
            (out / "bench_gemv.md").write_text(render(rows, bw, versions) + "\n")
    print(render(rows, bw, versions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
