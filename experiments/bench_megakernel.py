"""The whole batch-1 decode step as one kernel (scaling/kernels/decode_megakernel.py) on the GPU:
checked against its pure-jnp reference, then timed as a greedy decode loop against the copy
bandwidth measured in the same run.

    PYTHONPATH=.:experiments python3 experiments/bench_megakernel.py --models llama2_7b,1b --check

Per model (random bf16 weights of the preset's shape, a random cache): the kernel's logits and
its new cache rows against `megakernel_reference` (f32 on the GPU) at a few positions, first on a
2-layer model of the preset's width, then on the whole model; then `--steps` greedy steps per
call (a lax.fori_loop: the kernel, which reads the token's embedding row and RoPE row itself, then
argmax; the cache donated), the
median of `--reps` calls. Bytes per step = every weight but the embedding table + the K/V
cache positions read (the mean over the timed steps). `--variants`: MegaPlan options, each timed
in turn. `--profile DIR`: one step per model and variant under Mosaic GPU's on-device profiler,
summarised by `phase_walls` (each phase's wall time per layer). Writes
$OUT/bench_megakernel.json after every variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from scaling.kernels import decode_megakernel as mk

from bench_decode import measure_bandwidth, preset  # (experiments/ is on the path)


def random_weights(plan: mk.MegaPlan, seed: int = 0) -> dict:
    """Row-major bf16 weights of the plan's shapes, N(0, 1/K)."""
    shapes = {name: ((plan.layers,) if name != "head" else ()) + nk for name, nk in plan.gemvs().items()}
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {name: (jax.random.normal(k, s, jnp.float32) * s[-1] ** -0.5).astype(jnp.bfloat16)
            for k, (name, s) in zip(keys, shapes.items())}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# the first position, tiles of 64 positions (and of 128, paired) started, filled, crossed
CHECK_POSITIONS = (0, 1, 63, 64, 129, 200)


def check(plan: mk.MegaPlan, positions, inv_freq, seed: int = 0, cpu_reference: bool = True) -> list[dict]:
    rows = random_weights(plan, seed)
    units = mk.to_units(rows, plan.block_k, plan.fuse_mlp)
    k1, k2 = jax.random.split(jax.random.key(seed + 1))
    cache = (jax.random.normal(k1, (plan.layers, plan.max_len, plan.kv_heads, 2 * plan.head_dim)) * 0.5
             ).astype(jnp.bfloat16)
    x = jax.random.normal(k2, (plan.hidden,))

    def step(x, rope, pos, w, c):  # (the kernel's cache layout: pack_cache)
        logits, _, c = mk.megakernel_step(x, rope, pos, w, mk.pack_cache(c, plan.ppr), plan=plan)
        return logits, None, mk.unpack_cache(c, plan.ppr)

    step = jax.jit(step)
    ref = jax.jit(lambda x, rope, pos, w, c: mk.megakernel_reference(x, rope, pos, w, c, plan=plan))
    out = []
    for pos in positions:
        pos = jnp.int32(pos)
        rope = mk.rope_table(pos, inv_freq)
        logits, _, c2 = step(x, rope, pos, units, cache)
        if cpu_reference:  # (XLA's f32 GEMVs on the GPU are off by ~1e-3 even at HIGHEST)
            cpu = jax.devices("cpu")[0]
            lr, cr = ref(*jax.device_put((x, rope, pos, rows, cache), cpu))
        else:
            lr, cr = ref(x, rope, pos, rows, cache)
        rows_new = c2[:, int(pos)].astype(jnp.float32)
        row = {"layers": plan.layers, "pos": int(pos), "logits_rel": _rel(logits, lr),
               "cache_row_rel": _rel(rows_new, cr[:, int(pos)].astype(jnp.float32)),
               "cache_rest_equal": bool(jnp.array_equal(jnp.delete(c2, int(pos), axis=1),
                                                        jnp.delete(cache, int(pos), axis=1))),
               "argmax_equal": int(jnp.argmax(logits)) == int(jnp.argmax(lr))}
        print(row, flush=True)
        out.append(row)
    return out


def random_inputs(plan: mk.MegaPlan, seed: int = 0):
    """(unit-major weights, a bf16 embedding table, a bf16 cache) of the plan's shapes."""
    units = mk.to_units(random_weights(plan, seed), plan.block_k, plan.fuse_mlp)
    embed = (jax.random.normal(jax.random.key(seed + 2), (plan.vocab_rows, plan.hidden)) * 0.02).astype(jnp.bfloat16)
    cache = (jax.random.normal(jax.random.key(seed + 3), plan.cache_shape) * 0.5).astype(jnp.bfloat16)
    return units, embed, cache


def timed_steps(call, plan: mk.MegaPlan, units, start: int, steps: int, reps: int) -> dict:
    """The median of `reps` calls of call() (the first one compiles; each runs `steps` steps and
    returns an array to wait for) per step, and the bytes a step reads: every weight but the
    embedding table, and the K/V cache at the mean position of the steps."""
    t = time.perf_counter()
    jax.block_until_ready(call())
    compile_s = time.perf_counter() - t
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times) / steps
    wbytes = sum(int(v.nbytes) for v in units.values())
    mean_len = start + (steps + 1) / 2
    kvbytes = int(mean_len * plan.layers * plan.kv_heads * 2 * plan.head_dim * 2)
    return {"step_ms": step_s * 1e3, "tok_s": 1 / step_s, "weight_bytes": wbytes, "kv_bytes": kvbytes,
            "achieved_Bps": (wbytes + kvbytes) / step_s, "compile_s": compile_s, "times_s": times}


def time_decode(plan: mk.MegaPlan, inv_freq, start: int, steps: int, reps: int, seed: int = 0) -> dict:
    units, embed, cache = random_inputs(plan, seed)

    def run(cache, token, units, embed):  # (weights as arguments: closed over, they become constants)
        rope_all = mk.rope_tables(plan.max_len, inv_freq)

        def body(i, carry):  # (the kernel reads the token's embedding row and pos's RoPE row itself)
            cache, token = carry
            pos = jnp.int32(start) + i
            logits, _, cache = mk.megakernel_token_step(token, pos, embed, rope_all, units, cache, plan=plan)
            return cache, jnp.argmax(logits).astype(jnp.int32)

        return jax.lax.fori_loop(0, steps, body, (cache, token))

    run = jax.jit(run, donate_argnums=0)
    state = {"cache": cache, "tok": jnp.int32(1)}

    def call():
        state["cache"], state["tok"] = run(state["cache"], state["tok"], units, embed)
        return state["tok"]

    return timed_steps(call, plan, units, start, steps, reps)


def time_loop(plan: mk.MegaPlan, inv_freq, start: int, steps: int, reps: int, seed: int = 0) -> dict:
    """time_decode's greedy steps as one megakernel_loop launch per call (the argmax on the GPU);
    and its tokens against time_decode's step-by-step chain from the same token (greedy on random
    weights: a near-tie may flip where the f32 reduce-adds land in another order)."""
    units, embed, cache = random_inputs(plan, seed)
    rope_all = mk.rope_tables(plan.max_len, inv_freq)

    def run(cache, token, units, embed):
        toks, _, _, cache = mk.megakernel_loop(token, jnp.int32(start), steps, embed, rope_all, units, cache,
                                               plan=plan, vocab=plan.vocab_rows)
        return cache, toks

    def chain(cache, token, units, embed):
        def body(i, carry):
            cache, token, out = carry
            logits, _, cache = mk.megakernel_token_step(token, jnp.int32(start) + i, embed, rope_all, units, cache,
                                                        plan=plan)
            token = jnp.argmax(logits).astype(jnp.int32)
            return cache, token, out.at[i].set(token)

        return jax.lax.fori_loop(0, steps, body, (cache, token, jnp.zeros((steps,), jnp.int32)))[2]

    want = np.asarray(jax.jit(chain)(cache, jnp.int32(1), units, embed))
    run = jax.jit(run, donate_argnums=0)
    state = {"cache": cache}
    outs = []

    def call():
        state["cache"], toks = run(state["cache"], jnp.int32(1), units, embed)
        outs.append(toks)
        return toks

    out = timed_steps(call, plan, units, start, steps, reps)
    got = np.asarray(outs[0])  # (the first call's: from the same token and cache as the chain)
    same = int(np.argmax(got != want)) if np.any(got != want) else steps
    return {**out, "tokens_as_chain": same, "first_tokens": got[:8].tolist(), "chain_first_tokens": want[:8].tolist()}


# (combine: only with attn_splits > 1; mlp: gate/up and down as one phase, fuse_mlp)
def step_logits(plan: mk.MegaPlan, inv_freq, start: int, steps: int, seed: int = 0, tokens=None):
    """The logits of `steps` steps from position `start`, the tokens given (by default random, the
    same for every plan: no greedy feedback, so plans that round differently still see the same
    inputs)."""
    units, embed, cache = random_inputs(plan, seed)
    if tokens is None:
        tokens = jax.random.randint(jax.random.key(seed + 4), (steps,), 0, plan.vocab_rows)

    def run(cache, units, embed):
        def body(cache, i):
            pos = jnp.int32(start) + i
            logits, _, cache = mk.megakernel_step(embed[tokens[i]].astype(jnp.float32), mk.rope_table(pos, inv_freq),
                                                  pos, units, cache, plan=plan)
            return cache, logits

        return jax.lax.scan(body, cache, jnp.arange(steps))[1]

    return np.asarray(jax.jit(run, donate_argnums=0)(cache, units, embed))


def race_check(plan: mk.MegaPlan, other: mk.MegaPlan, inv_freq, start: int, steps: int) -> dict:
    """A plan whose synchronisation may race against one that computes the same and does not (e.g.
    hold_slots against none), over `steps` steps: each step's logits relative to the other plan's,
    beside the other plan run twice (the floor: f32 reduce-adds land in a different order every
    run). A read of a partial activation shows as an outlier far above the floor (a relaxed
    grid-barrier signal gave 14-36% against a floor of 1.4%; docs/decoding.md, nineteenth
    session)."""
    a1, a2 = step_logits(other, inv_freq, start, steps), step_logits(other, inv_freq, start, steps)
    b1, b2 = step_logits(plan, inv_freq, start, steps), step_logits(plan, inv_freq, start, steps)

    def rel(x, y):
        return np.linalg.norm(x - y, axis=1) / np.linalg.norm(y, axis=1)

    floor, diff = rel(a2, a1), np.concatenate([rel(b1, a1), rel(b2, a1)])
    return {"steps": steps, "floor_max": float(floor.max()), "floor_median": float(np.median(floor)),
            "max": float(diff.max()), "median": float(np.median(diff)),
            "argmax_equal": float(np.mean(np.concatenate([b.argmax(1) == a1.argmax(1) for b in (b1, b2)])))}


def loop_race_check(plan: mk.MegaPlan, inv_freq, start: int, steps: int, seed: int = 0) -> dict:
    """megakernel_loop's synchronisation between steps (the head's signal, the pick, the two
    buffers) over `steps` greedy steps: each step's logits (raw x r) against the step-by-step
    kernel fed the loop's own tokens, beside two step-by-step runs (the floor), and how often the
    loop's token is that run's argmax. A read of a partial or stale activation shows as an outlier
    far above the floor."""
    units, embed, cache = random_inputs(plan, seed)
    # (the weights as arguments: closed over, they become constants of the program, and the
    # llama2_7b's 13.5 GB of them crashed the compiler, twentieth and twenty-first sessions)
    run = jax.jit(lambda c, units, embed: mk.megakernel_loop(1, start, steps, embed,
                                                             mk.rope_tables(plan.max_len, inv_freq), units, c,
                                                             plan=plan, vocab=plan.vocab_rows), donate_argnums=0)
    toks, raw, r, _ = run(cache, units, embed)
    got = np.asarray(raw * r[:, None])
    inputs = jnp.concatenate([jnp.ones((1,), jnp.int32), toks[:-1]])
    a1, a2 = (step_logits(plan, inv_freq, start, steps, seed, tokens=inputs) for _ in range(2))

    def rel(x, y):
        return np.linalg.norm(x - y, axis=1) / np.linalg.norm(y, axis=1)

    floor, diff = rel(a2, a1), rel(got, a1)
    return {"steps": steps, "floor_max": float(floor.max()), "floor_median": float(np.median(floor)),
            "max": float(diff.max()), "median": float(np.median(diff)),
            "tokens_are_argmax": float(np.mean(np.asarray(toks) == a1.argmax(1)))}


LAYER_PHASES = ("qkv", "attn", "combine", "out", "gate_up", "down", "mlp")
# an attention unit's parts: q/k/v loaded, RoPE and the operands, the cache tiles, the new
# position, (group_splits) its partial written, the wait for its group and the group's partials
# read, (fuse_out) the streams merged and the output projection
ATTN_PARTS = ("a_qkv", "a_prep", "p_norm", "p_snew", "a_tiles", "a_new", "a_part", "wait_group", "a_gather",
              "a_merge", "a_out")
# (fuse_mlp) a slice's gate/up products, its down products
MLP_PARTS = ("m_gate_up", "m_down")
# --variants: MegaPlan fields; a variant may join several with "+" (pairs+norm_prefetch)
VARIANTS = {"base": {}, "norm_prefetch": {"norm_prefetch": True}, "splits2": {"attn_splits": 2},
            "splits4": {"attn_splits": 4}, "splits8": {"attn_splits": 8},
            "pairs": {"block_k": 256},  # (head_dim 64: two positions per cache row, MegaPlan.ppr)
            "k128": {"block_k": 128},  # (head_dim 64: one position per cache row, the default before pairs)
            "stages4": {"stages": 4}, "stages5": {"stages": 5}, "stages6": {"stages": 6},
            "out_skips_attn": {"out_skips_attn": True},
            "fuse": {"fuse_out": True},  # (attention and the output projection as one phase)
            "mlp": {"fuse_mlp": True},  # (gate/up and down as one phase)
            # (ring slots freed only after the signal: its fence then waits for fewer TMA loads)
            **{f"hold{n}": {"hold_slots": n} for n in (1, 2, 3, 4, 5)},
            "qnorm": {"norm_in_qkv": True},  # (the attention norm's statistic at the q/k/v phase's end)
            # (one operand slot, each unit's chunk rounded into it: room for a sixth ring slot on the 1b)
            "oneop": {"one_operand": True},
            # (each slice's down units rotated, so the CTAs' reduce-adds spread over h2's chunks)
            "rot": {"down_rotate": True},
            # (attention's q/k/v by the consumer's own loads, not TMA copies behind the weight tiles)
            "qld": {"qkv_ld": True},
            # (fuse_out with a KV head's positions split over up to n of its group's CTAs, which
            # exchange their partials behind a group semaphore: long caches without attn_splits' combine)
            **{f"group{n}": {"fuse_out": True, "attn_splits": 1, "group_splits": n} for n in (4, 8, 16)},
            # (attention and W_o as separate phases again: for models whose KV head's q heads span
            # several K steps of W_o, fused since the thirty-sixth session, what they ran before)
            "unfused": {"fuse_out": False, "group_splits": 0},
            # (128 CTAs on 132 SMs: 16 per KV head's group, none spare; what a cluster of 8 would need)
            "ctas128": {"ctas": 128},
            # (--decoder-plan: the plan the decoder runs a long cache's first steps on, those that attend
            # at most decode.MEGAKERNEL_SHORT_REACH positions; no fields of its own, see `variant_base`)
            "short": {}}


def variant_base(plan: mk.MegaPlan, variant: str, short: mk.MegaPlan | None) -> mk.MegaPlan:
    """The plan a variant's fields replace: `short` for a variant with "short" in it, else plan."""
    if "short" in variant.split("+"):
        if short is None:
            raise ValueError("the variant 'short' needs --decoder-plan (the decoder's plan for a long cache's first steps)")
        return short
    return plan


def race_other(plan: mk.MegaPlan, variant: str, against_base: bool,
               short: mk.MegaPlan | None = None) -> mk.MegaPlan | None:
    """The plan a variant's race check compares with (None: no check): the same variant without
    held ring slots (where it holds some), or, against_base, the base plan (for every variant but
    base itself). short: the "short" variant's plan (variant_base)."""
    vplan = dataclasses.replace(variant_base(plan, variant, short), **variant_fields(variant))
    if against_base:
        return None if variant == "base" else plan
    return dataclasses.replace(vplan, hold_slots=0) if vplan.hold_slots else None


def variant_fields(variant: str) -> dict:
    """The MegaPlan fields of a --variants entry ("a+b": both)."""
    fields: dict = {}
    for part in variant.split("+"):
        fields.update(VARIANTS[part])
    return fields


def phase_walls(trace: dict) -> dict[str, float]:
    """Where a profiled step's time goes (µs, medians over layers): each phase's wall time, from
    the last CTA to finish the phase before (the previous layer's down for q/k/v) to the last CTA
    to finish this one; also the median CTA's own time in each region (`cta_<name>`, its mean per
    occurrence), each phase's signal (`signal_<name>`) and the longest CTA's attention.
    (The walls compare CTAs' clocks, which drift apart by up to ~1 kcycle per layer on some SMs:
    the `cta_` and `signal_` numbers, each within one CTA, are the firmer ones.)"""
    import numpy as np

    from bench_streamk_chain import regions

    seqs = [seq for seq in regions(trace).values() if any(n == "qkv" for n, _, _ in seq)]  # consumers
    if not seqs:
        raise ValueError("no consumer regions in the trace (was it profiled with named scopes?)")

    def table(name, present=False):  # [CTA, occurrence, (start, end)]; present: only the CTAs that have it
        rows = [[(a, b) for n, a, b in seq if n == name] for seq in seqs]
        rows = [r for r in rows if r] if present else rows
        k = min(map(len, rows), default=0)
        return np.asarray([r[:k] for r in rows], dtype=np.float64).reshape(len(rows), k, 2)

    phases = [n for n in LAYER_PHASES if table(n).shape[1]]
    ends = {name: table(name)[:, :, 1].max(axis=0) for name in phases}  # [layers]
    layers = min(len(e) for e in ends.values())
    out: dict[str, float] = {"layers": layers}
    for i, name in enumerate(phases):
        before = ends[phases[i - 1]][:layers]
        if name == "qkv":  # the previous layer's down (none before layer 0)
            walls = ends["qkv"][1:layers] - before[: layers - 1]
        else:
            walls = ends[name][:layers] - before
        out[f"wall_{name}_us"] = float(np.median(walls)) if len(walls) else float("nan")
    out["wall_layer_us"] = float(sum(out[f"wall_{n}_us"] for n in phases))
    for name in (*phases, "norm", *ATTN_PARTS, *MLP_PARTS, *(f"wait_{n}" for n in phases)):
        t = table(name, present=name in ATTN_PARTS + MLP_PARTS)  # (an attention part: the CTAs that run a unit)
        if t.shape[1]:
            out[f"cta_{name}_us"] = float(np.median((t[:, :, 1] - t[:, :, 0]).mean(axis=1)))
    # the signal after each phase: from the phase's end to the CTA's next wait (its release fence
    # waits for the CTA's TMA loads in flight; MegaPlan.hold_slots)
    tops = [[r for r in seq if r[0] in phases or (r[0].startswith("wait_") and r[0] not in ATTN_PARTS)]
            for seq in seqs]  # (not nested)
    for name in phases:
        gaps = [b[1] - a[2] for seq in tops for a, b in zip(seq, seq[1:]) if a[0] == name and b[0].startswith("wait_")]
        if gaps:
            out[f"signal_{name}_us"] = float(np.median(gaps))
    attn = table("attn")
    out["cta_attn_max_us"] = float((attn[:, :, 1] - attn[:, :, 0]).mean(axis=1).max())
    out.update(cta_drift(table))
    return out


def cta_drift(table) -> dict[str, float]:
    """How far the CTAs of each phase drift apart, and whether it is the same CTAs every layer
    (`phase_walls`' table; the CTAs that run the phase, those idle in it left out): per phase, the
    median CTA's mean time and the slowest CTA's (`drift_<name>_p50_us`, `_max_us`), and the
    correlation over CTAs of their times in even and odd layers (`_layer_corr`: near 1, some CTAs
    are slower every layer, as where their SMs draw less bandwidth; near 0, noise). Each within
    one CTA's clock."""
    import numpy as np

    out = {}
    for name in ("qkv", "attn", "mlp"):
        t = table(name)
        if t.shape[1] < 2:
            continue
        d = t[:, :, 1] - t[:, :, 0]
        mean = d.mean(axis=1)
        d = d[mean > 0.5 * np.median(mean)]  # (CTAs with no unit of the phase)
        dev = d - d.mean(axis=0)
        mean = d.mean(axis=1)
        out[f"drift_{name}_p50_us"] = float(np.median(mean))
        out[f"drift_{name}_max_us"] = float(mean.max())
        out[f"drift_{name}_layer_corr"] = float(np.corrcoef(dev[:, ::2].mean(axis=1), dev[:, 1::2].mean(axis=1))[0, 1])
    return out


def profile_plan(plan: mk.MegaPlan) -> mk.MegaPlan:
    """The plan to profile: the timed plan with as many of its x stages as fit beside the
    profiler's buffer (the 1b keeps all 8; the 7b at 3 ring stages keeps 6)."""
    plan.check()
    for x_stages in range(plan.x_stages, 0, -1):
        p = dataclasses.replace(plan, x_stages=x_stages)
        try:
            p.check()
        except ValueError:
            continue  # (too few stages for the q heads per KV head, or for attn_splits)
        if p.smem_bytes(profile=True) <= mk.SMEM_BYTES:
            return p
    raise ValueError(f"no x_stages <= {plan.x_stages} leaves room for the profiler "
                     f"({mk.PROFILE_BYTES} bytes): fewer ring stages (stages={plan.stages})")


def profile_step(plan: mk.MegaPlan, inv_freq, pos: int, out_dir: str, seed: int = 0) -> dict:
    """One profiled step (random weights and cache): phase_walls of its trace."""
    units = mk.to_units(random_weights(plan, seed), plan.block_k, plan.fuse_mlp)
    cache = jnp.zeros(plan.cache_shape, jnp.bfloat16)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fn = jax.jit(lambda x, r, p, w, c: mk.megakernel_step(x, r, p, w, c, plan=plan, profile_dir=out_dir))
    pos = jnp.int32(pos)
    jax.block_until_ready(fn(jnp.ones((plan.hidden,)), mk.rope_table(pos, inv_freq), pos, units, cache))
    jax.effects_barrier()
    trace = json.loads(sorted(Path(out_dir).glob("*-trace.json"))[-1].read_text())
    return phase_walls(trace)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama2_7b,1b")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--start", type=int, default=128, help="position of the first timed step (the prompt length)")
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--stages", type=int, default=3, help="weight ring stages")
    ap.add_argument("--x-stages", type=int, default=8)
    ap.add_argument("--decoder-plan", action="store_true", help="each model's plan as the decoder picks it on this GPU "
                    "(decode.megakernel_plan at --max-len; --stages and --x-stages unused)")
    ap.add_argument("--variants", default="base", help=f"timed one after another, comma-separated: {list(VARIANTS)}")
    ap.add_argument("--check", action="store_true", help="check a 2-layer model of each preset's width")
    ap.add_argument("--check-full", action="store_true", help="also the whole model (slow: the f32 reference)")
    ap.add_argument("--bw-gib", type=float, default=4.0)
    ap.add_argument("--loop", action="store_true", help="also time each variant as one megakernel_loop launch per "
                    "call (the greedy steps with the argmax on the GPU), beside the step-by-step loop")
    ap.add_argument("--loop-race-steps", type=int, default=0, help="each variant: megakernel_loop over this many "
                    "steps against the step-by-step kernel fed its tokens (loop_race_check)")
    ap.add_argument("--race-steps", type=int, default=0, help="each variant with hold_slots: its logits over this many "
                    "steps against the same plan without (race_check)")
    ap.add_argument("--race-base", action="store_true", help="--race-steps: each variant but base against the "
                    "base plan instead (a variant that changes how activations are read)")
    ap.add_argument("--profile", default="", help="also profile one step per model and variant into "
                    "DIR/<model>_<variant> (fewer x stages where the profiler's 16 KiB need them)")
    args = ap.parse_args(argv)
    if unknown := {p for v in args.variants.split(",") for p in v.split("+")} - set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(unknown)}; allowed {list(VARIANTS)}")
    longest = max(args.steps, args.race_steps, args.loop_race_steps)
    if args.start + longest > args.max_len or args.max_len % 128:
        ap.error(f"--max-len must be a multiple of 128 holding --start + the most steps (--steps, --race-steps, "
                 f"--loop-race-steps) = {args.start + longest} positions, got {args.max_len}")
    dev = jax.devices()[0]
    versions = {"jax": jax.__version__, "device": dev.device_kind, "sms": getattr(dev, "core_count", None)}
    print(versions, flush=True)
    bw = measure_bandwidth(int(args.bw_gib * (1 << 30)))
    copy = max(bw.values())
    print({k: f"{v / 1e12:.3f} TB/s" for k, v in bw.items()}, flush=True)
    result = {"versions": versions, "bandwidth": bw, "args": vars(args), "models": {}}
    out = Path(os.environ.get("OUT", "."))

    def save():
        (out / "bench_megakernel.json").write_text(json.dumps(result, indent=1, default=str))

    # (and the timed steps' first position, where it is past them: a long cache's splits)
    check_positions = CHECK_POSITIONS + ((args.start,) if args.start > max(CHECK_POSITIONS) else ())
    for name in args.models.split(","):
        cfg = preset(name)
        from scaling import layers

        inv_freq = layers.rope_frequencies(cfg)
        if args.decoder_plan:
            from scaling import decode

            plan = decode.megakernel_plan(cfg, args.max_len)
            short = decode.megakernel_plan(cfg, args.max_len, reach=decode.MEGAKERNEL_SHORT_REACH)
        else:
            short = None
            plan = mk.plan_for(cfg, args.max_len, ctas=versions["sms"] or 132,
                               stages=args.stages, x_stages=args.x_stages)
        res: dict = {"plan": dataclasses.asdict(plan)}
        if args.check:
            try:
                res["check_2_layers"] = check(dataclasses.replace(plan, layers=2), check_positions, inv_freq)
                if args.check_full:
                    res["check"] = check(plan, [args.start], inv_freq, cpu_reference=False)
            except Exception as e:  # noqa: BLE001
                res["check_error"] = f"{type(e).__name__}: {str(e)[:800]}"
                print(res["check_error"], flush=True)
        result["models"][name] = res
        for variant in args.variants.split(","):
            key = "decode" if variant == "base" else f"decode_{variant}"
            if key in res:  # (a variant timed again: its own key, so every run is kept)
                key += f"#{sum(k.split('#')[0] == key for k in res) + 1}"
            try:
                vplan = dataclasses.replace(variant_base(plan, variant, short), **variant_fields(variant))
            except ValueError as e:
                ap.error(str(e))
            if args.check and variant != "base":  # (every variant's own check: a layout or a split may differ)
                try:
                    res[f"check_2_layers_{variant}"] = check(dataclasses.replace(vplan, layers=2), check_positions,
                                                             inv_freq)
                except Exception as e:  # noqa: BLE001
                    res[f"check_{variant}_error"] = f"{type(e).__name__}: {str(e)[:800]}"
                    print(res[f"check_{variant}_error"], flush=True)
            if args.race_steps and (other := race_other(plan, variant, args.race_base, short)) is not None:
                try:
                    res[f"race_{variant}"] = race_check(vplan, other, inv_freq, args.start, args.race_steps)
                    print(name, variant, "race check", res[f"race_{variant}"], flush=True)
                except Exception as e:  # noqa: BLE001
                    res[f"race_{variant}_error"] = f"{type(e).__name__}: {str(e)[:800]}"
                    print(res[f"race_{variant}_error"], flush=True)
            try:
                t = time_decode(vplan, inv_freq, args.start, args.steps, args.reps)
                t["pct_of_copy"] = 100 * t["achieved_Bps"] / copy
                res[key] = t
                print(f"{name} {variant}: {t['step_ms']:.3f} ms/step, {t['tok_s']:.0f} tokens/s, "
                      f"{t['achieved_Bps'] / 1e12:.3f} TB/s = {t['pct_of_copy']:.1f}% of copy "
                      f"(compile {t['compile_s']:.0f}s)", flush=True)
            except Exception as e:  # noqa: BLE001
                res[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:800]}"
                print(res[f"{key}_error"], flush=True)
            def attempt(key, measure):  # (a failure is recorded, and the next measurement runs)
                try:
                    res[key] = measure()
                    print(name, variant, key, res[key] if "loop_race" in key else {
                        k: v for k, v in res[key].items() if k != "times_s"}, flush=True)
                except Exception as e:  # noqa: BLE001
                    res[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:800]}"
                    print(res[f"{key}_error"], flush=True)

            if args.loop_race_steps:
                attempt(f"loop_race_{variant}", lambda: loop_race_check(vplan, inv_freq, args.start,
                                                                         args.loop_race_steps))
            if args.loop:
                def loop_timing():
                    t = time_loop(vplan, inv_freq, args.start, args.steps, args.reps)
                    return dict(t, pct_of_copy=100 * t["achieved_Bps"] / copy)

                attempt(f"loop_{variant}", loop_timing)
            if args.profile:  # every variant's own profile: where its time goes, beside its timing
                pkey = "profile" if variant == "base" else f"profile_{variant}"
                try:
                    pplan = profile_plan(vplan)
                    res[pkey] = profile_step(pplan, inv_freq, args.start, str(Path(args.profile) / f"{name}_{variant}"))
                    res[pkey]["x_stages"] = pplan.x_stages
                    print(name, variant, "profile", json.dumps(res[pkey]), flush=True)
                except Exception as e:  # noqa: BLE001
                    res[f"{pkey}_error"] = f"{type(e).__name__}: {str(e)[:800]}"
                    print(res[f"{pkey}_error"], flush=True)
            save()  # (after every variant: a call cut off by its time limit keeps what it measured)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
