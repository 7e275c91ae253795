"""Decode throughput against the memory-bandwidth roofline, and against transformers, on one GPU.

    python experiments/bench_decode.py            # 1b and llama2_7b shapes, batch 1/8/64, prompt 128/2048
    python experiments/bench_decode.py --quick    # 1b, batch 1 and 8, prompt 128

Random bf16 weights of the preset shapes (configs/models/*.yaml). For each (model, batch, prompt):
prefill, then `--new-tokens` greedy decode steps; a warm-up call of the same steps compiles first.
`--sampling greedy,temperature=0.8/top_p=0.95` adds the first case again with each other sampling
(seed 0), to show what sampling costs beside greedy steps.

Roofline: a decode step must read every weight once (the embedding table only for the tied
head) plus, per row, the K/V cache it attends to. bytes/step over the bandwidth of a large
device-to-device copy measured in the same run (bytes read + bytes written, torch
`Tensor.copy_`, the faster of torch and JAX here) gives the fastest possible step. We report
achieved bytes/s (bytes/step over measured step time) and its fraction of that bandwidth.

transformers, side by side on the same weights (written by scaling.interop.hf.save, loaded
in bf16): `generate` eager (dynamic cache) and with `cache_implementation="static"`, which
transformers >= 4.48 compiles automatically (torch.compile, mode reduce-overhead).

Prints a markdown table; writes it (and a JSON of every number, non-finite ones as null) to $OUT
when set. The flags are checked before anything runs (exit 2 naming a bad one); without a GPU the
script says so and exits 2 (tests/test_bench_decode.py runs its parts on the CPU).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU in this process
# Without preallocation JAX still caps its allocator at 75% of the GPU; the 7b at batch 64 and
# prompt 2048 needs ~118 GB (three copies of its weights, 77 GB of cache). torch frees its
# memory before our cases run, so JAX may take nearly all of it.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import argparse
import dataclasses
import datetime
import functools
import gc
import itertools
import json
import math
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaling import decode, strict_json  # noqa: E402
from scaling.config import DType, ModelConfig, load_config  # noqa: E402
from scaling.model import build_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _option(spec: str) -> tuple[str, int]:
    """--attention's megakernel/FIELD=INT: (field, value)."""
    name, _, value = spec.partition("=")
    try:
        return name, int(value)
    except ValueError:
        raise ValueError(f"--attention: a megakernel option is FIELD=INT, got {spec!r}") from None


def presets() -> list[str]:
    """The model presets --models may name: configs/models/*.yaml."""
    return sorted(p.stem for p in (ROOT / "configs" / "models").glob("*.yaml"))


def preset(name: str) -> ModelConfig:
    cfg = load_config(ROOT / "configs" / "models" / f"{name}.yaml").model
    return dataclasses.replace(cfg, param_dtype=DType.bfloat16, compute_dtype=DType.bfloat16)


def _items(text: str) -> list[str]:
    """A comma list's entries, stripped, empty ones dropped. A repeat stays: it runs again (A,B,A
    against drift, docs/benchmarks.md)."""
    return [s.strip() for s in text.split(",") if s.strip()]


def _ints(flag: str, text: str) -> list[int]:
    """A comma list of integers >= 1."""
    out = []
    for s in _items(text):
        try:
            n = int(s)
        except ValueError:
            raise ValueError(f"{flag}: {s!r} is not an integer; want a comma list of integers >= 1, e.g. 1,8") \
                from None
        if n < 1:
            raise ValueError(f"{flag}: {n} must be >= 1")
        out.append(n)
    return out


def parse_impl(impl: str) -> tuple[str, str, dict, dict]:
    """--attention's ATTN[:LAYERS[/FIELD=INT...]] -> (attention, layers, megakernel plan options,
    other Decoder keywords: megakernel_short_reach). ValueError naming the allowed values."""
    attn, _, rest = impl.partition(":")
    layers, *spec = rest.split("/")
    layers = layers or "auto"
    attns = [x.value for x in decode.DecodeAttentionImpl]
    if attn not in attns:
        raise ValueError(f"--attention {impl!r}: attention {attn!r} is not one of {attns}")
    all_layers = [x.value for x in decode.DecodeLayerImpl]
    if layers not in all_layers:
        raise ValueError(f"--attention {impl!r}: layers {layers!r} is not one of {all_layers}")
    options = dict(_option(o) for o in spec)
    # (short_reach: the decoder's megakernel_short_reach, not a plan field)
    reach = options.pop("short_reach", None)
    if reach is not None and reach < 0:
        raise ValueError(f"--attention {impl!r}: short_reach must be >= 0 (0: off), got {reach}")
    if options and layers != "megakernel":
        raise ValueError(f"--attention {impl!r}: plan options need the megakernel layers "
                         f"(ATTN:megakernel/FIELD=INT/...), got layers {layers!r}")
    try:
        decode.parse_megakernel_options(options)
    except ValueError as e:
        raise ValueError(f"--attention {impl!r}: {e}") from None
    return attn, layers, options, ({} if reach is None else {"megakernel_short_reach": reach})


# ------------------------------------------------------------------------ bandwidth


def measure_bandwidth(nbytes: int = 4 << 30) -> dict:
    """Copy bandwidth (read + write) of one large buffer, median of 20: torch and JAX."""
    out = {}
    try:
        import torch

        x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
        y = torch.empty_like(x)
        for _ in range(3):
            y.copy_(x)
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            y.copy_(x)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out["torch_copy"] = 2 * nbytes / statistics.median(times)
        del x, y
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        print(f"torch bandwidth: {e}")
    x = jax.random.normal(jax.random.key(0), (nbytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda v: v * 2)  # one read, one write; x * 1 would be simplified away
    copy(x).block_until_ready()
    times = []
    for _ in range(20):
        t = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - t)
    out["jax_copy"] = 2 * nbytes / statistics.median(times)
    del x
    gc.collect()
    return out


# ------------------------------------------------------------------------------ ours


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int = 2) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.resolved_head_dim * itemsize


SAMPLING_KEYS = {"temperature": float, "top_k": int, "top_p": float, "sampler": str}  # (sampler: the Decoder's)


def parse_sampling(spec: str) -> dict:
    """'greedy' -> {}; 'temperature=0.8/top_p=0.95' -> generate's keyword arguments."""
    if spec == "greedy":
        return {}
    out = {}
    for part in spec.split("/"):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in SAMPLING_KEYS:
            raise ValueError(f"--sampling {spec!r}: {part!r} is not key=value with a key in {sorted(SAMPLING_KEYS)} "
                             f"(or the whole spec 'greedy')")
        try:
            out[key] = SAMPLING_KEYS[key](value)
        except ValueError:
            raise ValueError(f"--sampling {spec!r}: {key} must be a {SAMPLING_KEYS[key].__name__}, got {value!r}") \
                from None
    if out.get("sampler", decode.SAMPLERS[0]) not in decode.SAMPLERS:
        raise ValueError(f"--sampling {spec!r}: sampler must be one of {decode.SAMPLERS}, got {out['sampler']!r}")
    if "temperature" in out and not (math.isfinite(out["temperature"]) and out["temperature"] >= 0):
        raise ValueError(f"--sampling {spec!r}: temperature must be a finite number >= 0, got {out['temperature']}")
    if "top_k" in out and out["top_k"] < 1:
        raise ValueError(f"--sampling {spec!r}: top_k must be >= 1, got {out['top_k']}")
    if "top_p" in out and not 0 < out["top_p"] <= 1:
        raise ValueError(f"--sampling {spec!r}: top_p must be in (0, 1], got {out['top_p']}")
    return out


def bench_ours(dec: decode.Decoder, cfg: ModelConfig, batch: int, prompt: int, new: int, rng, reps: int = 3,
               sampling: dict | None = None) -> dict:
    """One warm-up generate, then `reps` timed ones: their median step time (one timed call in a few
    ran up to 8% slower than the rest, docs/benchmarks.md, thirtieth session). sampling: generate's
    temperature / top_k / top_p (seed 0), greedy without; and sampler (parse_sampling's), the
    Decoder's for these calls."""
    sampling = dict(sampling or {})
    before = dec.sampler
    dec.sampler = sampling.pop("sampler", before)  # (a Decoder setting, read at each generate call)
    try:
        return _bench_ours(dec, cfg, batch, prompt, new, rng, reps, sampling)
    finally:
        dec.sampler = before


def _bench_ours(dec, cfg, batch, prompt, new, rng, reps, sampling) -> dict:
    prompts = rng.integers(0, cfg.vocab_size, (batch, prompt)).tolist()
    max_len = -(-(prompt + new) // 128) * 128  # the same cache shape for warm-up and timed call
    # (warm-up over the same steps: a long cache's first chunks run on another plan, which compiles
    # apart, Decoder.megakernel_short_reach)
    dec.generate(prompts, new, max_len=max_len, **sampling)
    runs, walls = [], []
    for _ in range(reps):
        # End to end: the whole call, as transformers' generate is timed (bench_hf). Until the
        # thirty-fifth session this was prefill_s + decode_s, which left out the cache's allocation
        # and the arguments' transfers before the prefill (2.3-3.1 ms for the 1b on the H200 then).
        t = time.perf_counter()
        runs.append(dec.generate(prompts, new, max_len=max_len, **sampling))
        walls.append(time.perf_counter() - t)
    assert all(len(t) == new for g in runs for t in g.tokens), [[len(t) for t in g.tokens] for g in runs]
    steps_ms = [g.decode_s / g.decode_steps * 1e3 for g in runs]
    median = sorted(range(reps), key=steps_ms.__getitem__)[reps // 2]
    g, wall = runs[median], walls[median]  # (the median run)
    step_s = g.decode_s / g.decode_steps
    # Rows attend to prompt + 1 .. prompt + steps positions; mean prompt + (steps + 1) / 2.
    mean_len = prompt + (g.decode_steps + 1) / 2
    wbytes = decode.weight_bytes_per_step(dec.weights)
    kvbytes = batch * mean_len * kv_bytes_per_token(cfg)
    return {
        "step_ms": step_s * 1e3,
        "step_ms_runs": [round(t, 4) for t in steps_ms],
        "tok_s": batch / step_s,
        "prefill_ms": g.prefill_s * 1e3,
        "e2e_tok_s": batch * new / wall,
        "call_ms_beyond_prefill_and_steps": (wall - g.prefill_s - g.decode_s) * 1e3,
        "bytes_per_step": wbytes + kvbytes,
        "weight_bytes": wbytes,
        "kv_bytes": kvbytes,
        "achieved_Bps": (wbytes + kvbytes) / step_s,
        "first_tokens": g.tokens[0][:8],
    }


# ------------------------------------------------------------------------ transformers


def bench_hf(hf_dir: str, cfg: ModelConfig, cases: list[tuple[int, int]], new: int, rng, static: bool, eager_new: int) -> dict:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to(device).eval()
    results = {}
    for batch, prompt in cases:
        ids = torch.tensor(rng.integers(0, cfg.vocab_size, (batch, prompt)), device=device)
        n = new if static else eager_new
        kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        if static:
            kw["cache_implementation"] = "static"

        def run(k):
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            sync()
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, **kw)
            sync()
            return time.perf_counter() - t, out

        try:
            t_c = time.perf_counter()
            run(n)  # warm-up; for the static cache this compiles and records the CUDA graphs
            warm = time.perf_counter() - t_c
            tn, out = run(n)
            # End to end (prefill included), as generate is used; ours is compared the same way.
            results[(batch, prompt)] = {"tok_s": batch * n / tn, "ms_per_token": tn / n * 1e3, "warmup_s": warm,
                                        "first_tokens": out[0, prompt : prompt + 8].tolist()}
        except Exception as e:  # noqa: BLE001
            results[(batch, prompt)] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(f"  hf {'static' if static else 'eager'} b{batch} p{prompt}: {results[(batch, prompt)]}", flush=True)
    model = None  # free the weights before the next model loads (the closure above reads it)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return results


# ---------------------------------------------------------------------------- checks


def check_on_gpu() -> list[str]:
    """The kernel against its reference (bf16 and f32, ragged lengths, GQA and MHA), and a
    small f32 model decoded with the kernel against the XLA path. Returns failure messages."""
    from scaling.kernels.decode_attention import decode_attention, decode_attention_reference

    fails = []
    for dt, tol in ((jnp.bfloat16, 2e-2), (jnp.float32, 2e-3)):
        for b, n, kh, h, s, lens in ((3, 32, 8, 64, 2304, (1, 1000, 2304)), (2, 32, 32, 128, 384, (129, 300)),
                                     (64, 32, 8, 64, 384, None)):
            ks = jax.random.split(jax.random.key(b * h), 3)
            q = jax.random.normal(ks[0], (b, n, h), dt)
            k = jax.random.normal(ks[1], (b, s, kh, h), dt)
            v = jax.random.normal(ks[2], (b, s, kh, h), dt)
            lengths = jnp.asarray(lens if lens else np.random.default_rng(0).integers(1, s + 1, b), jnp.int32)
            out = decode_attention(q, k, v, lengths).astype(jnp.float32)
            ref = decode_attention_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), lengths)
            err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            msg = f"kernel {jnp.dtype(dt).name} b{b} n{n} k{kh} h{h} s{s}: rel err {err:.2e}"
            print(msg, flush=True)
            if not err < tol:
                fails.append(msg)
    cfg = ModelConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2, mlp_dim=512,
                      init_std=0.1, compute_dtype=DType.float32)
    model = build_model(cfg)
    prompts = [list(range(1, 40)), list(range(7, 300)), [5]]
    outs = {impl: decode.Decoder(model, attention=impl, chunk=8, layers="xla").generate(prompts, 20)
            for impl in ("xla", "pallas")}
    fails += _compare("decode f32 attention pallas vs xla", outs["pallas"], outs["xla"])
    fails += check_combined_on_gpu()
    fails += check_layers_on_gpu(prompts)
    return fails


def check_combined_on_gpu(repeats: int = 20) -> list[str]:
    """The flash-decoding kernel with its in-kernel combine (the last split program merges;
    `tickets`) against the reference, and `repeats` more calls that must give the same bits:
    a missing fence between the partial stores and the merge would show as a wrong or a
    varying result."""
    from scaling.kernels.decode_attention import decode_attention_grouped, decode_attention_reference

    fails = []
    for b, n, kh, h, s, lens in ((1, 32, 8, 64, 2304, (1500,)), (3, 32, 8, 64, 2304, (1, 1000, 2304)),
                                 (2, 32, 32, 128, 384, (129, 300)), (1, 32, 8, 64, 384, (200,))):
        ks = jax.random.split(jax.random.key(b * h + s), 3)
        q = jax.random.normal(ks[0], (b, n, h), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, s, kh, h), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, s, kh, h), jnp.bfloat16)
        lengths = jnp.asarray(lens, jnp.int32)
        g = n // kh
        qg = jnp.zeros((b, kh, 16, h), jnp.bfloat16).at[:, :, :g].set(q.reshape(b, kh, g, h))
        call = jax.jit(lambda qg, k, v, lengths, t: decode_attention_grouped(qg, k, v, lengths, num_heads=n, tickets=t))
        tickets = jnp.zeros((b, kh, 1), jnp.int32)
        first, tickets = call(qg, k, v, lengths, tickets)
        ref = decode_attention_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), lengths)
        err = float(jnp.linalg.norm(first.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        differing = 0
        for _ in range(repeats):
            again, tickets = call(qg, k, v, lengths, tickets)
            differing += int(not bool(jnp.array_equal(again, first)))
        msg = (f"combined kernel bf16 b{b} n{n} k{kh} h{h} s{s}: rel err {err:.2e}, "
               f"{differing}/{repeats} repeats differed")
        print(msg, flush=True)
        if not (err < 2e-2 and differing == 0):
            fails.append(msg)
    return fails


def _compare(what, out, ref, tol=1e-2) -> list[str]:
    same = out.tokens == ref.tokens
    lp = max(abs(a - b) for ra, rb in zip(out.logprobs, ref.logprobs) for a, b in zip(ra, rb))
    msg = f"{what}: tokens equal {same}, max |dlogprob| {lp:.2e}"
    print(msg, flush=True)
    return [] if same and lp <= tol else [msg]


def check_layers_on_gpu(prompts) -> list[str]:
    """The Pallas layer kernels against their f32 references at the 1b shapes (bf16), and a
    small f32 model decoded on them against the XLA layers."""
    from scaling import layers
    from scaling.kernels import decode_gemv as g
    from scaling.kernels import decode_tma

    fails = []
    cfg = preset("1b")
    d, n, kv, h, f, s = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim, 384
    ks = iter(jax.random.split(jax.random.key(7), 64))

    def rnd(shape, scale=1.0):
        return (jax.random.normal(next(ks), shape, jnp.float32) * scale).astype(jnp.bfloat16)

    def rel(a, r):
        a, r = jnp.asarray(a, jnp.float32), jnp.asarray(r, jnp.float32)
        return float(jnp.linalg.norm(a - r) / jnp.linalg.norm(r))

    errs = {}
    for b in (16, 1):  # 16 rows: tensor-core dots; 1 row: the vector path (CUDA-core products)
        lb = g.default_blocks(b, h, hidden=d)
        x, pos = rnd((b, d), 3.0), jnp.arange(b, dtype=jnp.int32) * 20
        w = rnd(((n + 2 * kv) * h, d), d ** -0.5)
        kc, vc = rnd((b, s, kv, h)), rnd((b, s, kv, h))
        inv = layers.rope_frequencies(cfg)
        ref = g.qkv_rope_reference(x, w, inv, pos, kc, vc, num_heads=n, eps=cfg.norm_eps)
        out = g.qkv_rope(x, w, inv, pos, kc.copy(), vc.copy(), num_heads=n, eps=cfg.norm_eps, blocks=lb.qkv)
        errs.update({f"b{b} qkv_rope q": rel(out[0], ref[0]), f"b{b} qkv_rope k": rel(out[1], ref[1]),
                     f"b{b} qkv_rope v": rel(out[2], ref[2])})
        a, wo = rnd((b, n * h)), rnd((d, n * h), (n * h) ** -0.5)
        errs[f"b{b} matmul_residual"] = rel(g.matmul_residual(a, wo, x, blocks=lb.out), g.matmul_residual_reference(a, wo, x))
        wgu = rnd((2 * f, d), d ** -0.5)
        errs[f"b{b} gate_up_swiglu"] = rel(g.gate_up_swiglu(x, wgu, eps=cfg.norm_eps, blocks=lb.gate_up),
                                           g.gate_up_swiglu_reference(x, wgu, eps=cfg.norm_eps))
        wh = rnd((cfg.vocab_size, d), d ** -0.5)
        errs[f"b{b} norm_matmul (head)"] = rel(g.norm_matmul(x, wh, eps=cfg.norm_eps, blocks=lb.head),
                                               g.norm_matmul_reference(x, wh, eps=cfg.norm_eps))
        a7, wd7 = rnd((b, 11008)), rnd((d, 11008), 11008 ** -0.5)  # a reduction with a tail (llama2_7b's mlp dim)
        errs[f"b{b} matmul_residual k=11008"] = rel(g.matmul_residual(a7, wd7, x, blocks=lb.down),
                                                    g.matmul_residual_reference(a7, wd7, x))
        if b <= decode_tma.ROWS and decode_tma.unsupported_reason(d, f) is None:  # layers="pallas_tma"'s gate/up
            x8 = jnp.concatenate([x, jnp.full((decode_tma.ROWS - b, d), jnp.nan, x.dtype)])  # padding rows: anything
            h8 = decode_tma.gate_up_swiglu_tma(x8, decode_tma.row_rsqrt(x8, cfg.norm_eps), wgu)  # [8, F]
            errs[f"b{b} gate_up_swiglu_tma"] = rel(h8[:b], g.gate_up_swiglu_reference(x, wgu, eps=cfg.norm_eps))
            wd = rnd((d, f), f ** -0.5)  # h8's rows past the batch are NaN
            errs[f"b{b} matmul_residual, padded input"] = rel(g.matmul_residual(h8, wd, x, blocks=lb.down),
                                                               g.matmul_residual_reference(h8[:b], wd, x))
            # the statistic taken in the kernel, on the residual stream padded with zeros (the decoder's)
            x8z = jnp.pad(x, ((0, decode_tma.ROWS - b), (0, 0)))
            h8n = decode_tma.gate_up_swiglu_tma(x8z, None, wgu, norm_eps=cfg.norm_eps)
            errs[f"b{b} gate_up_swiglu_tma, in-kernel norm"] = rel(
                h8n[:b], g.gate_up_swiglu_reference(x, wgu, eps=cfg.norm_eps))
            out8 = g.matmul_residual(h8n, wd, x8z, blocks=lb.down, rows=b)  # padding rows pass through
            errs[f"b{b} matmul_residual, padded stream"] = rel(out8[:b], g.matmul_residual_reference(h8n[:b], wd, x))
            errs[f"b{b} matmul_residual, padding rows kept (|out - 0|)"] = float(jnp.abs(out8[b:]).max())
            # the experiment's other TMA projections: residual epilogue, and the head
            a8 = jnp.pad(a, ((0, decode_tma.ROWS - b), (0, 0)))
            errs[f"b{b} matmul_residual_tma"] = rel(decode_tma.matmul_residual_tma(a8, wo, x8z)[:b],
                                                    g.matmul_residual_reference(a, wo, x))
            errs[f"b{b} norm_matmul_tma (head)"] = rel(decode_tma.norm_matmul_tma(x8z, wh, eps=cfg.norm_eps)[:b],
                                                       g.norm_matmul_reference(x, wh, eps=cfg.norm_eps))
    for k, e in errs.items():
        msg = f"{k} bf16 1b shapes: rel err {e:.2e}"
        print(msg, flush=True)
        if not e < 1e-2:
            fails.append(msg)
    small = ModelConfig(vocab_size=512, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
                        mlp_dim=512, init_std=0.1, compute_dtype=DType.float32)
    model = build_model(small)
    # Full f32 matmuls in XLA too (its GPU default for f32 is TF32, the kernels' is IEEE): a
    # random model's near-tied logits otherwise flip on rounding alone.
    with jax.default_matmul_precision("highest"):
        outs = {li: decode.Decoder(model, attention="pallas", chunk=8, layers=li).generate(prompts, 20)
                for li in ("xla", "pallas")}
        one = {li: decode.Decoder(model, attention="pallas", chunk=8, layers=li).generate(prompts[:1], 20)
               for li in ("xla", "pallas")}
        combined = decode.Decoder(model, attention="pallas_combined", chunk=8, layers="pallas").generate(prompts, 20)
    fails += (_compare("decode f32 layers pallas vs xla", outs["pallas"], outs["xla"])
              + _compare("decode f32 layers pallas vs xla, batch 1", one["pallas"], one["xla"])
              + _compare("decode f32 layers pallas + in-kernel combine vs xla", combined, outs["xla"]))
    if decode.is_hopper():  # the TMA kernels take 16-bit inputs: bf16 against the Pallas layers
        # (log-probs within bf16 rounding, as tests/test_decode_gemv.py asks on the CPU)
        bf16 = build_model(dataclasses.replace(small, compute_dtype=DType.bfloat16, init_std=0.3))
        tma = {li: decode.Decoder(bf16, attention="pallas", chunk=8, layers=li).generate(prompts, 20)
               for li in ("pallas", "pallas_tma")}
        fails += _compare("decode bf16 layers pallas_tma vs pallas", tma["pallas_tma"], tma["pallas"], tol=0.05)
        from scaling.kernels import decode_tma

        every = decode.Decoder(bf16, attention="pallas", chunk=8, layers="pallas_tma",  # output, down, head too
                               tma=decode_tma.TmaSettings(projections=decode_tma.PROJECTIONS)).generate(prompts, 20)
        fails += _compare("decode bf16 layers pallas_tma (every projection) vs pallas", every, tma["pallas"], tol=0.05)
        # q/k/v by TMA (qkv_rope_tma, head_dim 128) with the cache written by the fused attention
        # kernel. One step's logits and cache rows, not a free-running decode: in bf16 this random
        # model's tokens already part at the first step between any two summation orders (XLA's
        # layers against the Pallas ones too).
        wide = build_model(dataclasses.replace(small, num_heads=4, num_kv_heads=4, head_dim=128,
                                               compute_dtype=DType.bfloat16, init_std=0.3))
        every = decode_tma.TmaSettings(projections=(*decode_tma.PROJECTIONS, decode_tma.QKV))
        errs = step_errors(wide, decode.DecodeLayerImpl.pallas_tma, every)
        msg = "one step bf16, pallas_tma (every projection and q/k/v) vs pallas: " + ", ".join(
            f"{k} rel err {v:.2e}" for k, v in errs.items())
        print(msg, flush=True)
        fails += [msg] if not max(errs.values()) < 2e-2 else []
    return fails


def step_errors(model, layer_impl, tma, batch: int = 2, cache_len: int = 256) -> dict[str, float]:
    """One decode step of `layer_impl` (with `tma`) against layers="pallas" on the same random
    cache, tokens and positions: relative errors of the logits and of the K/V rows it writes."""
    cfg = model.cfg
    weights = decode.prepare_weights(model, model.compute_dtype, rows=True)
    ks = iter(jax.random.split(jax.random.key(3), 4 * cfg.num_layers + 2))
    shape = (batch, cache_len, cfg.num_kv_heads, cfg.resolved_head_dim)
    cache = {name: tuple(jax.random.normal(next(ks), shape, model.compute_dtype) for _ in range(cfg.num_layers))
             for name in ("k", "v")}
    tokens = jax.random.randint(next(ks), (batch,), 0, cfg.vocab_size)
    pos = jnp.arange(batch, dtype=jnp.int32) * 97 % cache_len + 5
    out = {}
    for name, impl, settings in (("ref", decode.DecodeLayerImpl.pallas, None), ("got", layer_impl, tma)):
        step = jax.jit(functools.partial(decode._step_forward, cfg=cfg, attn_impl=decode.DecodeAttentionImpl.pallas,
                                         layer_impl=impl, tma=settings))  # as the decoder runs it: compiled
        logits, new = step(weights, jax.tree.map(jnp.copy, cache), tokens, pos)
        rows = jnp.arange(batch)
        out[name] = (logits, [c[rows, pos] for c in new["k"]], [c[rows, pos] for c in new["v"]])

    def rel(a, r):
        a, r = jnp.asarray(a, jnp.float32), jnp.asarray(r, jnp.float32)
        return float(jnp.linalg.norm(a - r) / jnp.linalg.norm(r))

    (lg, kg, vg), (lr, kr, vr) = out["got"], out["ref"]
    return {"logits": rel(lg, lr), "k rows": max(rel(a, r) for a, r in zip(kg, kr)),
            "v rows": max(rel(a, r) for a, r in zip(vg, vr))}


# ----------------------------------------------------------------------------- main


DEFAULT_MODELS = "1b,llama2_7b"
DEFAULT_HF_MODELS = "1b,llama2_7b"
HF_PROMPT = 128  # transformers runs at this prompt length only


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked before anything runs: a bad flag exits 2 with a message naming it
    and the allowed values. Adds the parsed lists (model_list, batch_list, prompt_list, impls,
    specs, hf_batches, hf_model_list, blocks) and argv (the arguments given, for the report)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="1b only, batch 1 and 8, prompt 128 (an explicit --models/--batches/--prompts wins)")
    ap.add_argument("--models", default=None, help=f"model presets (configs/models/), comma-separated "
                                                   f"(default {DEFAULT_MODELS})")
    ap.add_argument("--batches", default=None, help="comma-separated (default 1,8,64)")
    ap.add_argument("--prompts", default=None, help="prompt lengths, comma-separated (default 128,2048)")
    ap.add_argument("--new-tokens", type=int, default=256, help="decode steps per case (>= 2: the first token "
                                                                "comes from the prefill)")
    ap.add_argument("--attention", default="pallas",
                    help="decode variants, comma-separated: ATTN or ATTN:LAYERS, ATTN in pallas/xla/fused, "
                         "LAYERS in auto/xla/pallas/pallas_tma/megakernel (default auto); megakernel may take plan "
                         "options as megakernel/FIELD=INT/... (decode.parse_megakernel_options; booleans 0/1), "
                         "e.g. pallas:megakernel/qkv_ld=0/norm_in_qkv=0; short_reach=N sets the decoder's "
                         "megakernel_short_reach (0: off); a repeated variant runs again (A,B,A,B against drift)")
    ap.add_argument("--gemv-blocks", default="", help="tiles of the Pallas layer kernels, a decode_gemv.LayerBlocks.parse spec")
    ap.add_argument("--chunk", type=int, default=64, help="decode steps per compiled call")
    ap.add_argument("--reps", type=int, default=3, help="timed generate calls per case (their median step)")
    ap.add_argument("--hf-models", default=None, help="models of --models to run transformers on "
                                                      f"(default those of {DEFAULT_HF_MODELS} in --models)")
    ap.add_argument("--hf", default=None, help=f"batches of --batches to run transformers at (prompt {HF_PROMPT} "
                                               "only), comma-separated; '' for none (default 1 where --batches has "
                                               f"it and --prompts has {HF_PROMPT})")
    ap.add_argument("--hf-eager-new", type=int, default=64, help="new tokens for the (slow) eager transformers runs")
    ap.add_argument("--mem-budget-gb", type=float, default=70.0, help="skip cases whose weights + KV cache exceed this")
    ap.add_argument("--bw-gib", type=float, default=4.0, help="buffer size of the bandwidth measurement")
    ap.add_argument("--tag", default="bench_decode", help="file name stem of the outputs under $OUT")
    ap.add_argument("--sampling", default="greedy",
                    help="comma-separated sampling specs, 'greedy' or key=value pairs joined by '/' (keys "
                         "temperature, top_k, top_p, and sampler: the Decoder's, xla or pallas), e.g. "
                         "greedy,temperature=0.8/top_p=0.95; specs after the first run the first case of the first "
                         "attention only")
    ap.add_argument("--check", action="store_true", help="first check the kernel and the decoder on the GPU")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _check_args(args)
    except ValueError as e:
        ap.error(str(e))
    return args


def _check_args(args) -> None:
    for flag in ("new_tokens", "reps", "chunk", "hf_eager_new"):
        least = 2 if flag == "new_tokens" else 1
        if getattr(args, flag) < least:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    for flag in ("mem_budget_gb", "bw_gib"):
        if not (math.isfinite(getattr(args, flag)) and getattr(args, flag) > 0):
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number > 0, got {getattr(args, flag)}")
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", args.tag):
        raise ValueError(f"--tag {args.tag!r}: a file name stem, of letters, digits, '.', '_' and '-' (no '/')")
    quick = dict(models="1b", batches="1,8", prompts="128") if args.quick else {}
    args.model_list = _items(args.models if args.models is not None else quick.get("models", DEFAULT_MODELS))
    known = presets()
    if not args.model_list:
        raise ValueError(f"--models: none given; allowed: {', '.join(known)}")
    if unknown := [m for m in args.model_list if m not in known]:
        raise ValueError(f"--models: unknown {', '.join(unknown)}; allowed: {', '.join(known)}")
    args.batch_list = _ints("--batches", args.batches if args.batches is not None else quick.get("batches", "1,8,64"))
    args.prompt_list = _ints("--prompts", args.prompts if args.prompts is not None else quick.get("prompts", "128,2048"))
    for flag, values in (("--batches", args.batch_list), ("--prompts", args.prompt_list)):
        if not values:
            raise ValueError(f"{flag}: none given")
    cfgs = {m: load_config(ROOT / "configs" / "models" / f"{m}.yaml").model for m in args.model_list}
    for m, cfg in cfgs.items():  # (the decoder runs past it, RoPE has no table: the timing stands, say so)
        if (longest := max(args.prompt_list)) + args.new_tokens > cfg.max_seq_len:
            print(f"note: --prompts {longest} + --new-tokens {args.new_tokens} = {longest + args.new_tokens} positions "
                  f"run past {m}'s max_seq_len {cfg.max_seq_len}", file=sys.stderr)
    args.impls = _items(args.attention)
    if not args.impls:
        raise ValueError("--attention: none given")
    for impl in args.impls:
        attn = parse_impl(impl)[0]
        for m, cfg in cfgs.items():  # (e.g. fused's group size)
            try:
                decode.resolve_decode_impl(attn, cfg)
            except ValueError as e:
                raise ValueError(f"--attention {impl!r} on {m}: {e}") from None
    args.specs = _items(args.sampling)
    if not args.specs:
        raise ValueError("--sampling: none given ('greedy' for greedy steps)")
    for spec in args.specs:
        top_k = parse_sampling(spec).get("top_k")  # (a bad spec fails here, before anything runs)
        for m, cfg in cfgs.items():
            if top_k is not None and top_k > cfg.vocab_size:
                raise ValueError(f"--sampling {spec!r}: top_k {top_k} exceeds {m}'s vocabulary ({cfg.vocab_size})")
    from scaling.kernels.decode_gemv import LayerBlocks

    try:
        args.blocks = LayerBlocks.parse(args.gemv_blocks) if args.gemv_blocks.strip() else None
    except (ValueError, TypeError) as e:
        raise ValueError(f"--gemv-blocks {args.gemv_blocks!r}: {e}") from None
    # transformers: explicit names and batches must be among those benchmarked (else nothing would
    # show them); the defaults are cut to those
    if args.hf_models is None:
        args.hf_model_list = [m for m in _items(DEFAULT_HF_MODELS) if m in args.model_list]
    else:
        args.hf_model_list = list(dict.fromkeys(_items(args.hf_models)))
        if stray := [m for m in args.hf_model_list if m not in args.model_list]:
            raise ValueError(f"--hf-models: {', '.join(stray)} not in --models ({', '.join(args.model_list)})")
    if args.hf is None:
        args.hf_batches = [b for b in (1,) if b in args.batch_list and HF_PROMPT in args.prompt_list]
    else:
        args.hf_batches = list(dict.fromkeys(_ints("--hf", args.hf)))
        if stray := [b for b in args.hf_batches if b not in args.batch_list]:
            raise ValueError(f"--hf: batches {stray} not in --batches {args.batch_list}")
        if args.hf_batches and HF_PROMPT not in args.prompt_list:
            raise ValueError(f"--hf: transformers runs at prompt {HF_PROMPT} only, which --prompts "
                             f"{args.prompt_list} lacks (--hf '' for none)")
    out = os.environ.get("OUT")
    if out:
        if Path(out).exists() and not Path(out).is_dir():
            raise ValueError(f"$OUT={out!r} is not a folder")
        try:
            Path(out).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"$OUT={out!r}: cannot make the output folder ({e.strerror or e})") from None
        if not os.access(out, os.W_OK | os.X_OK):
            raise ValueError(f"$OUT={out!r}: the output folder is not writable")


def require_gpu() -> str | None:
    """Why this process cannot measure (None: a GPU is there)."""
    backend = jax.default_backend()
    if backend != "gpu":
        return (f"bench_decode.py measures decode on a GPU; JAX's backend here is {backend!r} "
                "(tests/test_bench_decode.py covers its CPU parts)")
    return None


def write_results(out: str, tag: str, table: str, versions: dict, bw: dict, rows: list[dict]) -> None:
    Path(out, f"{tag}.md").write_text(table)
    Path(out, f"{tag}.json").write_text(json.dumps(strict_json.strict({"versions": versions, "bandwidth": bw, "rows": rows}),
                                                   indent=1, default=str, allow_nan=False))


def main(argv=None) -> int:
    args = parse_args(argv)
    if why := require_gpu():
        print(f"error: {why}", file=sys.stderr)
        return 2
    batches, prompts, impls, specs = args.batch_list, args.prompt_list, args.impls, args.specs
    hf_batches = args.hf_batches

    dev = jax.devices()[0]
    versions = {"jax": jax.__version__, "device": dev.device_kind}
    try:
        import torch
        import transformers

        versions.update(torch=torch.__version__, transformers=transformers.__version__)
    except ImportError:
        hf_batches = []
    print(versions, flush=True)
    fails = []
    if args.check:
        try:
            fails = check_on_gpu()
        except Exception as e:  # noqa: BLE001
            fails = [f"check raised {type(e).__name__}: {str(e)[:500]}"]
            print(fails[0], flush=True)
    bw = measure_bandwidth(int(args.bw_gib * (1 << 30)))
    peak = max(bw.values())
    print({k: f"{v / 1e12:.2f} TB/s" for k, v in bw.items()}, flush=True)

    rng = np.random.default_rng(0)
    rows = []
    for name in args.model_list:
        cfg = preset(name)
        t = time.perf_counter()
        model = build_model(cfg, seed=0)
        jax.block_until_ready(jax.tree.leaves(model))
        print(f"{name}: built in {time.perf_counter() - t:.1f}s", flush=True)
        hf_res: dict = {}
        if hf_batches and name in args.hf_model_list:
            from scaling.interop import hf

            with tempfile.TemporaryDirectory() as d:
                t = time.perf_counter()
                hf.save(cfg, model, d)
                print(f"{name}: saved HF checkpoint in {time.perf_counter() - t:.1f}s", flush=True)
                cases = [(b, HF_PROMPT) for b in hf_batches]
                hf_res["eager"] = bench_hf(d, cfg, cases, args.new_tokens, rng, False, args.hf_eager_new)
                hf_res["static"] = bench_hf(d, cfg, cases, args.new_tokens, rng, True, args.hf_eager_new)
        for impl in impls:
            attn, layer_impl, options, reach = parse_impl(impl)
            try:
                dec = decode.Decoder(model, attention=attn, chunk=args.chunk, layers=layer_impl,
                                     gemv_blocks=args.blocks, megakernel_options=options or None, **reach)
            except ValueError as e:  # (this model or this GPU: the other variants still run)
                row = {"model": name, "impl": impl, "batch": batches[0], "prompt": prompts[0], "sampling": specs[0],
                       "skip": f"ValueError: {str(e)[:300]}"}
                rows.append(row)
                print(row, flush=True)
                continue
            if dec.auto_megakernel_reason:
                print(f"{name} {impl}: auto runs no megakernel: {dec.auto_megakernel_reason}", flush=True)
            wbytes = decode.weight_bytes_per_step(dec.weights)
            for prompt, batch, spec in itertools.product(prompts, batches, specs):
                first_case = (batch, prompt) == (batches[0], prompts[0])
                if impl != impls[0] and not first_case:
                    continue  # other impls: the first case only, for comparison
                if spec != specs[0] and not (impl == impls[0] and first_case):
                    continue  # other sampling: the first case of the first impl only
                max_len = -(-(prompt + args.new_tokens) // 128) * 128
                # the model's parameters, the decoder's copy, and the megakernel's once made
                need = (2 + dec.megakernel) * wbytes + batch * max_len * kv_bytes_per_token(cfg)
                row = {"model": name, "impl": impl, "batch": batch, "prompt": prompt, "sampling": spec,
                       "layers": dec._step_layers(dec.bucket(batch)).value}  # (what the steps ran)
                if need > args.mem_budget_gb * 1e9:
                    row["skip"] = f"needs {need / 1e9:.0f} GB > budget"
                    rows.append(row)
                    print(row, flush=True)
                    continue
                t = time.perf_counter()
                try:
                    r = bench_ours(dec, cfg, batch, prompt, args.new_tokens, rng, args.reps, parse_sampling(spec))
                except Exception as e:  # noqa: BLE001
                    row["skip"] = f"{type(e).__name__}: {str(e)[:300]}"
                    rows.append(row)
                    print(row, flush=True)
                    continue
                r["roofline_tok_s"] = batch * peak / r["bytes_per_step"]
                r["frac"] = r["achieved_Bps"] / peak
                for kind in ("eager", "static"):
                    h = hf_res.get(kind, {}).get((batch, prompt))
                    if h and "tok_s" in h:
                        r[f"hf_{kind}_tok_s"] = h["tok_s"]
                row.update(r, wall_s=time.perf_counter() - t)
                rows.append(row)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                out = os.environ.get("OUT")
                if out:  # the table so far, in case the run is cut off
                    Path(out, f"{args.tag}.partial.md").write_text(render(rows, versions, bw, args))
            del dec
            gc.collect()
        del model
        gc.collect()

    table = render(rows, versions, bw, args)
    print(table)
    out = os.environ.get("OUT")
    if out:
        write_results(out, args.tag, table, versions, bw, rows)
    if fails:
        print("CHECK FAILURES:\n" + "\n".join(fails))
        return 1
    return 0


def render(rows, versions, bw, args) -> str:
    when = datetime.date.today().isoformat()
    peak = max(bw.values())
    # the command as given (parse_args' argv), so the table can be reproduced
    flags = getattr(args, "argv", ["--quick"] if args.quick else [])
    lines = [
        f"Decode benchmark, {when}, {versions.get('device')}, jax {versions.get('jax')}, "
        f"torch {versions.get('torch', '-')}, transformers {versions.get('transformers', '-')}; "
        f"`{shlex.join(['python', 'experiments/bench_decode.py', *flags])}`; "
        f"{args.new_tokens} new tokens, greedy unless the row says otherwise, bf16 weights and KV cache.",
        "",
        "Measured copy bandwidth (read + write): " + ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in bw.items())
        + f"; roofline uses {peak / 1e12:.2f} TB/s.",
        "",
        "| model | attn (layers the steps ran) | batch | prompt | ms/step | decode tok/s | roofline tok/s | GB/step | achieved TB/s | % of copy BW | prefill ms | e2e tok/s | HF eager e2e tok/s | HF static e2e tok/s | e2e vs HF static |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        impl = r["impl"] + (f", {r['sampling']}" if r.get("sampling", "greedy") != "greedy" else "")
        if "skip" in r:
            # (15 columns: the skip's reason in the fifth, ten empty ones after it)
            skip = " ".join(str(r["skip"]).split()).replace("|", "\\|")  # (one line, no column breaks)
            lines.append(f"| {r['model']} | {impl} | {r['batch']} | {r['prompt']} | skipped: {skip} |" + " |" * 10)
            continue
        he, hs = r.get("hf_eager_tok_s"), r.get("hf_static_tok_s")
        # transformers runs greedy only: a sampled row's ratio says so
        vs = "" if r.get("sampling", "greedy") == "greedy" else " (HF greedy)"
        lines.append(
            f"| {r['model']} | {impl} ({r.get('layers', '?')}) | {r['batch']} | {r['prompt']} | {r['step_ms']:.3f} | {r['tok_s']:,.0f} | "
            f"{r['roofline_tok_s']:,.0f} | {r['bytes_per_step'] / 1e9:.2f} | {r['achieved_Bps'] / 1e12:.2f} | "
            f"{100 * r['frac']:.1f}% | {r['prefill_ms']:.1f} | {r['e2e_tok_s']:,.0f} | {f'{he:,.1f}' if he else '-'} | "
            f"{f'{hs:,.1f}' if hs else '-'} | {f'{r['e2e_tok_s'] / hs:.1f}x{vs}' if hs else '-'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
