"""How much of the H200's bandwidth can a decode projection reach when its weights stream by TMA?

    PYTHONPATH=.:experiments python3 experiments/bench_tma_gemv.py [--models 1b,llama2_7b] [--reps 20]

The question behind it (docs/decoding.md, "Where the 1b's H200 step goes now"): the decoder's
Pallas Triton GEMV kernels (scaling/kernels/decode_gemv.py) plateau at 71-84% of the copy
bandwidth on an H200 whatever their tiles, where XLA's gate/up GEMM reached 89-90% for the 7b.
This is the other design, written in Mosaic GPU: per CTA a producer warpgroup streams
[block_n, block_k] tiles of W^T [N, K] through a shared-memory ring by TMA, and a consumer
warpgroup multiplies each with x (up to 8 rows, kept in shared memory) on the tensor cores:
acc[block_n, 8] += W_tile @ x_tileᵀ, a wgmma of N = 8, so the arithmetic stays negligible.
Short projections split K over `splits` CTAs per output block (f32 partials that XLA adds), to
give the grid enough CTAs.

Bare projections only (no norm, RoPE, SwiGLU or residual): this measures the read, not a
replacement kernel. Timed from a profile over several weight copies (more than the L2), as in
bench_gemv.py, against XLA's einsum on the same weights and the copy bandwidth of the same run.
Checked against jnp before timing. CPU: runs in Pallas' GPU interpret mode (tests only).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

ROOT = Path(__file__).resolve().parents[1]
ROWS = 8  # x rows the kernel carries (wgmma N); decoding batches 1-8 fit


@dataclasses.dataclass(frozen=True)
class TmaGemvConfig:
    block_n: int = 128  # output features per CTA (wgmma M: a multiple of 64)
    block_k: int = 128  # reduction tile per ring slot (a multiple of 64)
    stages: int = 4  # ring depth
    splits: int = 1  # CTAs per output block along K


def _kernel(x_ref, w_ref, o_ref, x_smem, w_ring, acc_smem, x_full, w_full, w_free, *, cfg: TmaGemvConfig,
            k_steps: int, interpret: bool):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n_blk, split = lax.axis_index("n"), lax.axis_index("s")
    wg = lax.axis_index("wg")
    bn, bk, stages = cfg.block_n, cfg.block_k, cfg.stages

    @pl.when(wg == 0)
    def _consumer():
        plgpu.barrier_wait(x_full)

        def step(j, acc):
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(w_full.at[slot])

            if interpret:  # the interpreter has no wgmma: a plain dot of the same operands
                acc = acc + jnp.dot(w_ring.at[slot][...], x_smem.at[j][...].T, preferred_element_type=jnp.float32)
            else:
                def issue(acc_ref):
                    plgpu.wgmma(acc_ref, w_ring.at[slot], x_smem.at[j].T)

                acc = pl.run_state(issue)(plgpu.ACC.init(acc))  # waits for the product
            plgpu.barrier_arrive(w_free.at[slot])
            return acc

        acc0 = jnp.zeros((bn, ROWS), jnp.float32)
        if not interpret:
            acc0 = plgpu.layout_cast(acc0, plgpu.Layout.WGMMA)
        acc = lax.fori_loop(0, k_steps, step, acc0)
        acc_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(acc_smem, o_ref.at[split, pl.ds(n_blk * bn, bn)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
        k0 = split * k_steps  # first K tile of this CTA
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(k0, k_steps)], x_smem, x_full)

        @pl.loop(0, k_steps)
        def _fetch(j):
            slot = lax.rem(j, stages)

            @pl.when(j >= stages)
            def _():
                plgpu.barrier_wait(w_free.at[slot])
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(n_blk * bn, bn), pl.ds((k0 + j) * bk, bk)], w_ring.at[slot],
                                    w_full.at[slot])

        @pl.loop(max(k_steps - stages, 0), k_steps)
        def _drain(j):  # observe the last releases: every barrier phase is waited on once
            plgpu.barrier_wait(w_free.at[lax.rem(j, stages)])


def check_config(n: int, k: int, cfg: TmaGemvConfig) -> str | None:
    if cfg.block_n % 64 or cfg.block_k % 64:
        return f"block_n={cfg.block_n} and block_k={cfg.block_k} must be multiples of 64"
    if n % cfg.block_n:
        return f"N={n} is not a multiple of block_n={cfg.block_n}"
    if k % (cfg.block_k * cfg.splits):
        return f"K={k} is not a multiple of block_k * splits = {cfg.block_k * cfg.splits}"
    k_steps = k // cfg.block_k // cfg.splits
    smem = cfg.stages * cfg.block_n * cfg.block_k * 2 + k_steps * ROWS * cfg.block_k * 2 + cfg.block_n * ROWS * 4
    if smem > 227 * 1024:
        return f"needs {smem} bytes of shared memory (x slice {k_steps * ROWS * cfg.block_k * 2}); raise splits"
    return None


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def tma_gemv(x, wt, cfg: TmaGemvConfig = TmaGemvConfig(), interpret: bool = False):
    """x [B <= 8, K] bf16, W^T [N, K] bf16 -> x W [B, N] f32."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, k = x.shape
    n = wt.shape[0]
    reason = check_config(n, k, cfg) if b <= ROWS else f"batch {b} > {ROWS}"
    if reason:
        raise ValueError(f"tma_gemv: {reason}")
    bk = cfg.block_k
    k_steps = k // bk // cfg.splits
    # x as [K tiles, 8, block_k]: a CTA's slice is one TMA copy, and tile j is x_smem.at[j].
    x3 = jnp.pad(x, ((0, ROWS - b), (0, 0))).reshape(ROWS, k // bk, bk).transpose(1, 0, 2)
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    out = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg, k_steps=k_steps, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((cfg.splits, n, ROWS), jnp.float32),
        scratch_types=(
            plgpu.SMEM((k_steps, ROWS, bk), x.dtype, transforms=tiled),
            plgpu.SMEM((cfg.stages, cfg.block_n, bk), wt.dtype, transforms=tiled),
            plgpu.SMEM((cfg.block_n, ROWS), jnp.float32),
            plgpu.Barrier(),
            plgpu.Barrier(num_barriers=cfg.stages),
            plgpu.Barrier(num_barriers=cfg.stages),
        ),
        grid=(n // cfg.block_n, cfg.splits),
        grid_names=("n", "s"),
        num_threads=2,
        thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(x3, wt)
    return out.sum(0)[:, :b].T


def candidates(n: int, k: int, sms: int = 132) -> list[TmaGemvConfig]:
    """A few tilings, each with K split until the grid has about `ctas_per_sm` CTAs per SM
    (resident at once where shared memory allows: one wave, no tail of a second)."""
    out = []
    for bn, bk, stages, ctas_per_sm in ((128, 128, 4, 1), (64, 128, 4, 3), (128, 256, 3, 1), (64, 256, 2, 2),
                                         (64, 64, 4, 6)):
        if n % bn:
            continue
        if k % bk:
            continue
        tiles = k // bk  # splits: the smallest divisor of the K tiles that fills the grid
        splits = next((d for d in range(1, tiles + 1) if tiles % d == 0 and n // bn * d >= ctas_per_sm * sms), tiles)
        cfg = TmaGemvConfig(block_n=bn, block_k=bk, stages=stages, splits=splits)
        if check_config(n, k, cfg) is None and cfg not in out:
            out.append(cfg)
    return out


def head_dim(model: str) -> int:
    from scaling.config import load_config

    return load_config(ROOT / "configs" / "models" / f"{model}.yaml", []).model.resolved_head_dim


def shapes(model: str) -> dict[str, tuple[int, int]]:
    from scaling.config import load_config

    m = load_config(ROOT / "configs" / "models" / f"{model}.yaml", []).model
    d, n, kv, h, f = m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.mlp_dim
    vocab = -(-m.vocab_size // 256) * 256
    return {"qkv": ((n + 2 * kv) * h, d), "out": (d, n * h), "gate_up": (2 * f, d), "down": (d, f), "head": (vocab, d)}


def profile(fn, args, reps: int, calls_per_rep: int) -> tuple[float, str, float]:
    """(summed device-kernel time per weight read, the name of the kernel that took most of it,
    that kernel's median duration), from a profile of `reps` calls."""
    from scaling.profile_summary import load_trace

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(reps):
                jax.block_until_ready(fn(*args))
        trace, _ = load_trace(Path(tmp))
    events = trace["traceEvents"]
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and str(e.get("args", {}).get("name", "")).startswith("/device:GPU")}
    streams = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
               and e["pid"] in gpu and "Stream" in str(e.get("args", {}).get("name", ""))}
    by_name: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams:
            by_name.setdefault(e.get("name", "?"), []).append(e["dur"])
    if not by_name:
        raise RuntimeError("no GPU kernels in the profile (this script times GPUs only)")
    total = sum(sum(d) for d in by_name.values())
    main_name = max(by_name, key=lambda n: sum(by_name[n]))
    return total / (reps * calls_per_rep), main_name, statistics.median(by_name[main_name])


def qkv_rope_row(row: dict, model: str, x, ws, args) -> None:
    """The q/k/v projection as the decoder's layers run it: decode_gemv.qkv_rope (Triton, norm,
    RoPE and the cache write) against decode_tma.qkv_rope_tma (TMA, norm and RoPE; no cache
    write). Adds their kernel-only µs and the TMA kernel's error against
    the reference's q to `row`."""
    from scaling import layers
    from scaling.config import load_config
    from scaling.kernels import decode_gemv as dg
    from scaling.kernels import decode_tma

    m = load_config(ROOT / "configs" / "models" / f"{model}.yaml", []).model
    n, kv, h = m.num_heads, m.num_kv_heads, m.resolved_head_dim
    b = x.shape[0]
    inv = layers.rope_frequencies(m)
    pos = jnp.arange(b, dtype=jnp.int32) * 37 + 100
    cache = jnp.zeros((b, 512, kv, h), jnp.bfloat16)
    blocks = dg.default_blocks(b, h, hidden=m.hidden_size, device_kind=jax.devices()[0].device_kind).qkv
    tri = jax.jit(lambda x, ws, kc, vc: [dg.qkv_rope(x, w, inv, pos, kc, vc, num_heads=n, eps=1e-5, blocks=blocks)[0]
                                         for w in ws])
    _, _, row["triton_qkv_rope_us"] = profile(tri, (x, ws, cache, cache), args.reps, len(ws))
    x8 = jnp.pad(x, ((0, decode_tma.ROWS - b), (0, 0)))
    cs = decode_tma.rope_tables(jnp.pad(pos, (0, decode_tma.ROWS - b)), inv, h)
    order = decode_tma.rope_row_order(ws[0].shape[0], h)
    ws_r = [w[order] for w in ws]  # the kernel's row order (a decoder would store its weights so)
    fn = jax.jit(lambda x8, ws: [decode_tma.qkv_rope_tma(x8, w, cs, num_heads=n, num_kv_heads=kv, head_dim=h,
                                                         norm_eps=1e-5) for w in ws])
    got = np.asarray(decode_tma.from_rope_order(fn(x8, ws_r[:1])[0], h), np.float32)[:b, : n * h]
    want = np.asarray(dg.qkv_rope_reference(x, ws[0], inv, pos, cache, cache, num_heads=n, eps=1e-5)[0],
                      np.float32).reshape(b, -1)
    row["tma_qkv_rope_err"] = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-9))
    _, _, row["tma_qkv_rope_us"] = profile(fn, (x8, ws_r), args.reps, len(ws))


def decoder_kernel_row(row: dict, name: str, x, ws, args) -> None:
    """The decoder's own TMA kernel for this projection (scaling.kernels.decode_tma at its default
    tiles, one CTA per 64 outputs, no K split): the output and down projections with their
    residual add on the 8-row stream, the head with its in-kernel norm statistic and f32 logits.
    Adds tma_decode_tma_us (kernel alone) and its error against jnp to `row`."""
    from scaling.kernels import decode_tma

    n, k = ws[0].shape
    x8 = jnp.pad(x, ((0, decode_tma.ROWS - x.shape[0]), (0, 0)))
    if name == "head":
        kw = dict(in_kernel_norm=True, halves=1, out_itemsize=4)
        fn = jax.jit(lambda x8, ws: [decode_tma.norm_matmul_tma(x8, w, eps=1e-5) for w in ws])
        xf = x.astype(jnp.float32)
        want = np.asarray(jnp.einsum("bk,nk->bn", xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5),
                                     ws[0].astype(jnp.float32)))
    else:
        kw = dict(halves=1, residual=True)
        r8 = jnp.zeros((decode_tma.ROWS, n), jnp.bfloat16)
        fn = jax.jit(lambda x8, ws: [decode_tma.matmul_residual_tma(x8, w, r8) for w in ws])
        want = np.asarray(jnp.einsum("bk,nk->bn", x, ws[0], preferred_element_type=jnp.float32))
    if reason := decode_tma.unsupported_reason(k, n, **kw):
        row["tma_decode_tma_error"] = reason
        return
    got = np.asarray(fn(x8, ws[:1])[0], np.float32)[: x.shape[0]]
    row["tma_decode_tma_err"] = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-9))
    _, _, row["tma_decode_tma_us"] = profile(fn, (x8, ws), args.reps, len(ws))


def gate_up_row(model: str, args, bw: float) -> dict:
    """Kernel-only µs of decode_gemv.gate_up_swiglu (this GPU's tiles) and decode_tma.gate_up_swiglu_tma."""
    from scaling.config import load_config
    from scaling.kernels import decode_gemv as dg
    from scaling.kernels import decode_tma

    m = load_config(ROOT / "configs" / "models" / f"{model}.yaml", []).model
    d, f = m.hidden_size, m.mlp_dim
    copies = max(2, -(-args.min_mb * 2**20 // (2 * f * d * 2)))
    ws = [jax.random.normal(jax.random.key(i), (2 * f, d), jnp.bfloat16) * 0.02 for i in range(copies)]
    x = jax.random.normal(jax.random.key(99), (args.batch, d), jnp.bfloat16)
    x8 = jnp.pad(x, ((0, decode_tma.ROWS - args.batch), (0, 0)))
    r8 = decode_tma.row_rsqrt(x8, 1e-5)
    blocks = dg.default_blocks(args.batch, m.resolved_head_dim, hidden=d,
                               device_kind=jax.devices()[0].device_kind).gate_up
    tri = jax.jit(lambda x, ws: [dg.gate_up_swiglu(x, w, eps=1e-5, blocks=blocks) for w in ws])
    tma = jax.jit(lambda x8, r8, ws: [decode_tma.gate_up_swiglu_tma(x8, r8, w) for w in ws])
    # the statistic taken in the kernel (layers="pallas_tma" since the tenth session): r8 unused
    tma_norm = jax.jit(lambda x8, r8, ws: [decode_tma.gate_up_swiglu_tma(x8, None, w, norm_eps=1e-5) for w in ws])
    want = np.asarray(dg.gate_up_swiglu_reference(x, ws[0], eps=1e-5), np.float32)
    row = dict(model=model, kernel="gate_up_swiglu", MB=2 * f * d * 2 / 1e6, copies=copies,
               tma_blocks=str(decode_tma.DEFAULT_BLOCKS))
    for key, fn in (("tma", tma), ("tma_norm", tma_norm)):
        got = np.asarray(fn(x8, r8, ws[:1])[0], np.float32)[:args.batch]
        row[f"{key}_err"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    _, _, row["triton_us"] = profile(tri, (x, ws), args.reps, copies)
    _, _, row["tma_us"] = profile(tma, (x8, r8, ws), args.reps, copies)
    _, _, row["tma_norm_us"] = profile(tma_norm, (x8, r8, ws), args.reps, copies)
    for key in ("triton", "tma", "tma_norm"):
        row[f"{key}_pct_bw"] = 100 * 2 * f * d * 2 / (row[f"{key}_us"] * 1e-6) / bw
    return row


def main():
    from bench_attention import header
    from bench_decode import measure_bandwidth

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="1b,llama2_7b")
    p.add_argument("--kernels", default="qkv,out,gate_up,down,head")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--min-mb", type=int, default=200, help="weight copies per kernel: at least this many MB")
    p.add_argument("--configs", default="auto", help="'auto' (`candidates`) or block_n/block_k/stages/splits;...")
    args = p.parse_args()
    bw = max(measure_bandwidth().values())  # the faster of torch's and JAX's copy
    print(header(), f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for model in args.models.split(","):
        for name, (n, k) in shapes(model).items():
            if name not in args.kernels.split(","):
                continue
            copies = max(2, -(-args.min_mb * 2**20 // (n * k * 2)))
            ws = [jax.random.normal(jax.random.key(i), (n, k), jnp.bfloat16) * 0.02 for i in range(copies)]
            x = jax.random.normal(jax.random.key(99), (args.batch, k), jnp.bfloat16)
            cands = candidates(n, k)
            if args.configs != "auto":
                cands = [TmaGemvConfig(*map(int, c.split("/"))) for c in args.configs.split(";")]
            want = np.asarray(jnp.einsum("bk,nk->bn", x, ws[0], preferred_element_type=jnp.float32))
            xla = jax.jit(lambda x, ws: [jnp.einsum("bk,nk->bn", x, w, preferred_element_type=jnp.float32) for w in ws])
            wbytes = n * k * 2
            row = dict(model=model, kernel=name, N=n, K=k, MB=wbytes / 1e6, copies=copies)
            row["xla_us"], _, _ = profile(xla, (x, ws), args.reps, copies)
            # The decoder's Triton kernel for a plain projection (matmul_residual, r = 0) with this
            # GPU's tiles for the layer kernel of the same weight shape (qkv: the output projection's).
            from scaling.kernels import decode_gemv as dg

            layer = dg.default_blocks(args.batch, head_dim(model), hidden=k if name != "down" else n,
                                      device_kind=jax.devices()[0].device_kind)
            blocks = getattr(layer, {"qkv": "out"}.get(name, name))
            r = jnp.zeros((args.batch, n), jnp.bfloat16)
            try:
                tri = jax.jit(lambda x, ws, r: [dg.matmul_residual(x, w, r, blocks=blocks) for w in ws])
                row["triton_total_us"], _, row["triton_us"] = profile(tri, (x, ws, r), args.reps, copies)
                row["triton_tiles"] = f"{blocks.block_n}/{blocks.block_k}/{blocks.num_warps}/{blocks.num_stages}"
            except Exception as e:  # noqa: BLE001
                row["triton_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            for cfg in cands:
                label = f"{cfg.block_n}/{cfg.block_k}/{cfg.stages}/{cfg.splits}"
                try:
                    got = np.asarray(tma_gemv(x, ws[0], cfg))
                    err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-9))
                    ours = jax.jit(lambda x, ws, cfg=cfg: [tma_gemv(x, w, cfg) for w in ws])
                    total, kname, kernel_us = profile(ours, (x, ws), args.reps, copies)
                    row[f"tma_{label}_us"] = kernel_us  # the Mosaic kernel alone
                    row[f"tma_{label}_total_us"] = total  # with x's padding and the sum over splits
                    row["tma_kernel_name"] = kname
                    row[f"tma_{label}_err"] = err
                except Exception as e:  # noqa: BLE001 - a config that does not compile is a row, not a crash
                    row[f"tma_{label}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if name == "qkv":
                try:
                    qkv_rope_row(row, model, x, ws, args)
                except Exception as e:  # noqa: BLE001 - a row, not a crash
                    row["tma_qkv_rope_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if name in ("out", "down", "head"):
                try:
                    decoder_kernel_row(row, name, x, ws, args)
                except Exception as e:  # noqa: BLE001 - a row, not a crash
                    row["tma_decode_tma_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            for key in [kk for kk in row if kk.endswith("_us")]:
                row[key[:-3] + "_pct_bw"] = 100 * wbytes / (row[key] * 1e-6) / bw
            print(json.dumps(row), flush=True)
            rows.append(row)
            del ws
    for model in args.models.split(","):  # the decoder's gate/up kernels: Triton (in use) and decode_tma's
        rows.append(gate_up_row(model, args, bw))
        print(json.dumps(rows[-1]), flush=True)
    print("| model | kernel | MB | XLA, all kernels µs (% copy BW) | Triton kernel (tiles) | TMA kernel, per tiling "
          "n/k/stages/splits | best TMA with its glue kernels |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kernel"] == "gate_up_swiglu":
            print(f"| {r['model']} | gate/up + SwiGLU kernels | {r['MB']:.1f} | - | {r['triton_us']:.1f} "
                  f"({r['triton_pct_bw']:.0f}%) | decode_tma: {r['tma_us']:.1f} ({r['tma_pct_bw']:.0f}%); with the "
                  f"statistic in the kernel: {r['tma_norm_us']:.1f} ({r['tma_norm_pct_bw']:.0f}%) | - |")
            continue
        tma = [kk[4:-3] for kk in r if kk.startswith("tma_") and kk.endswith("_us") and not kk.endswith("total_us")]
        cells = "; ".join(f"{t}: {r[f'tma_{t}_us']:.1f} ({r[f'tma_{t}_pct_bw']:.0f}%)" for t in tma) or "error"
        glued = [t for t in tma if f"tma_{t}_total_us" in r]  # the experiment's tilings (decode_tma needs no glue)
        best = min(glued, key=lambda t: r[f"tma_{t}_us"]) if glued else None
        glue = f"{r[f'tma_{best}_total_us']:.1f} ({r[f'tma_{best}_total_pct_bw']:.0f}%)" if best else "-"
        tri = (f"{r['triton_us']:.1f} ({r['triton_pct_bw']:.0f}%, {r['triton_tiles']})" if "triton_us" in r
               else r.get("triton_error", "-"))
        print(f"| {r['model']} | {r['kernel']} | {r['MB']:.1f} | {r['xla_us']:.1f} ({r['xla_pct_bw']:.0f}%) | {tri} "
              f"| {cells} | {glue} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_tma_gemv.json"), "w") as fh:
            json.dump(dict(header=header(), copy_bw=bw, rows=rows), fh, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "experiments"))
    main()
