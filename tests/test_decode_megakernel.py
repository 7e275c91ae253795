"""scaling/kernels/decode_megakernel.py: the whole batch-1 decode step as one Mosaic GPU kernel.

- It lowers for sm_90 on the CPU as one kernel, with several CTAs (the grid barrier's global
  semaphores only exist there).
- Pallas' GPU interpreter runs it with one CTA against `megakernel_reference` (pure jnp, the
  kernel's rounding points), at positions that start, fill and cross 64-position cache tiles.
- The reference itself against the decoder's XLA step (an independent implementation: the model's
  own layers, RoPE and attention) on the same weights.
- The decoder with layers="megakernel" generates the same greedy tokens as with layers="xla".
"""

import dataclasses
import functools
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from scaling import decode, layers
from scaling.config import DType, ModelConfig
from scaling.kernels import decode_megakernel as mk
from scaling.model import build_model

# the smallest shape the kernel takes: head_dim 128 (a [64, 2H] cache tile is one [64, 256] ring
# slot), hidden and mlp multiples of 256; 2 q heads per KV head
CFG = ModelConfig(vocab_size=200, hidden_size=256, num_layers=2, num_heads=2, num_kv_heads=1, mlp_dim=512,
                  init_std=0.05, compute_dtype=DType.float32)
MAX_LEN = 128


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _assert_cache(got, want, pos):
    """The cache [L, S, KV, 2H]: every row but pos untouched; the new rows as the reference's, to
    within one bf16 step (a later layer's row follows f32 sums taken in another order, whose last
    bit can move its rounding)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    rest = np.arange(got.shape[1]) != pos
    np.testing.assert_array_equal(got[:, rest], want[:, rest])
    np.testing.assert_allclose(got[:, pos], want[:, pos], rtol=2.0**-7, atol=1e-6)


@pytest.fixture(scope="module")
def setup():
    model = build_model(dataclasses.replace(CFG, param_dtype=DType.bfloat16), seed=3)
    rows = decode.prepare_weights(model, jnp.bfloat16, rows=True)
    plan = mk.plan_for(CFG, MAX_LEN, vocab_rows=rows["head_xd"].shape[0], ctas=1, x_stages=4)
    key = jax.random.key(4)
    cache = (jax.random.normal(key, (CFG.num_layers, MAX_LEN, CFG.num_kv_heads, 2 * plan.head_dim)) * 0.5
             ).astype(jnp.bfloat16)
    x = rows["embed_vd"][7].astype(jnp.float32)
    return model, rows, plan, cache, x


def test_plan_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="block_k must be 2 \\* head_dim"):
        mk.plan_for(CFG, MAX_LEN, block_k=128).check()
    with pytest.raises(ValueError, match="norm_prefetch holds all of h"):
        mk.plan_for(dataclasses.replace(CFG, hidden_size=4096, num_heads=32, num_kv_heads=16), MAX_LEN, x_stages=4,
                    norm_prefetch=True).check()
    with pytest.raises(ValueError, match="attn_splits must be 1..x_stages=4"):
        mk.plan_for(CFG, MAX_LEN, x_stages=4, attn_splits=5).check()
    with pytest.raises(ValueError, match="max_len=100"):
        mk.plan_for(CFG, 100).check()
    with pytest.raises(ValueError, match="shared memory"):
        mk.plan_for(dataclasses.replace(CFG, hidden_size=4096, mlp_dim=11008, num_heads=32, num_kv_heads=32),
                    MAX_LEN, stages=4).check()
    with pytest.raises(ValueError, match="q heads per KV head"):
        mk.plan_for(dataclasses.replace(CFG, num_heads=16, num_kv_heads=1, hidden_size=2048), MAX_LEN).check()


def test_lowers_for_hopper_with_several_ctas(setup):
    _, rows, plan, cache, x = setup
    units = mk.prepare(rows, plan.block_k)
    for prefetch, splits, skip in ((False, 1, True), (True, 3, False)):
        p4 = dataclasses.replace(plan, ctas=4, norm_prefetch=prefetch, attn_splits=splits, out_skips_attn=skip)
        fn = jax.jit(lambda x, r, p, w, c, p4=p4: mk.megakernel_step(x, r, p, w, c, plan=p4))
        module = export.export(fn, platforms=["cuda"])(x, jnp.zeros((2, plan.head_dim)), jnp.int32(5), units,
                                                        cache).mlir_module()
        assert module.count("mosaic_gpu_v2") == 1


@pytest.mark.parametrize("preset,block_k,fuse", [("1b", 256, False), ("llama2_7b", 256, False),
                                                ("1b", 256, 384), ("1b", 256, 2304), ("tinyllama_1.1b", 128, 2304),
                                                ("350m", 256, 2304), ("125m", 256, 384)])
def test_lowers_at_the_benchmarked_shapes_with_every_option(preset, block_k, fuse, monkeypatch):
    """The presets bench_megakernel.py times (the 1b: head_dim 64, block_k 256 with paired
    positions, 4 q heads per KV head; the 7b: head_dim 128, one q head per KV head) with
    norm_prefetch and attn_splits on, and (fuse: a max_len) the decoder's own plans for the 1b on
    132 SMs: fuse_out and fuse_mlp with six ring slots at 384 positions, the grouped split at 2304.
    As abstract shapes (nothing allocated); lowering checks the shared memory against 227 KiB, so
    this also holds MegaPlan.smem_bytes to what Mosaic GPU allocates."""
    from scaling.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "models" / f"{preset}.yaml").model
    if fuse:
        monkeypatch.setattr(decode.jax, "default_backend", lambda: "gpu")
        monkeypatch.setattr(decode.jax, "devices", lambda *a: [type("H200", (), {"core_count": 132})()])
        plan = decode.megakernel_plan(cfg, fuse)
        monkeypatch.undo()
        if preset == "1b":
            assert plan.fuse_mlp and plan.stages == (6 if fuse == 384 else 5) and plan.grouped == (fuse == 2304)
        # (tinyllama: 16 x stages, attention fused with W_o over 4 of its K steps, the positions split
        # within its groups of 33; the 350m: 33 CTAs per KV head's group, of which
        # 16 split its positions, as many partials as one TMA copy of their m and l holds; the 125m's
        # plan is 1.7 KiB below the shared-memory limit)
        assert plan.block_k == block_k and (preset != "350m" or (plan.out_group, plan.group_splits) == (33, 16))
        assert preset != "tinyllama_1.1b" or (plan.out_ksteps, plan.out_group, plan.group_splits) == (4, 33, 16)
    else:
        plan = mk.plan_for(cfg, 384, ctas=132, norm_prefetch=True, block_k=block_k, attn_splits=2, hold_slots=1)
    plan.check()
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    weights = {name: bf16(*(() if name == "head" else (plan.layers,)), plan.units(name), mk.BLOCK_F, plan.block_k)
               for name in plan.gemvs()}
    abstract = jax.ShapeDtypeStruct
    fn = jax.jit(lambda x, r, p, w, c: mk.megakernel_step(x, r, p, w, c, plan=plan))
    module = export.export(fn, platforms=["cuda"])(
        abstract((plan.hidden,), jnp.float32), abstract((2, plan.head_dim), jnp.float32), abstract((), jnp.int32),
        weights,
        bf16(*plan.cache_shape)).mlir_module()
    assert module.count("mosaic_gpu_v2") == 1
    if fuse != 384:  # (the entry's path is the same for every plan: one is enough)
        return
    # the decoder's entry: the token's bf16 embedding row and pos's RoPE row read by the kernel
    token_fn = jax.jit(lambda t, p, e, r, w, c: mk.megakernel_token_step(t, p, e, r, w, c, plan=plan))
    module = export.export(token_fn, platforms=["cuda"])(
        abstract((), jnp.int32), abstract((), jnp.int32), bf16(cfg.vocab_size, plan.hidden),
        abstract((plan.max_len, 2, plan.head_dim), jnp.float32), weights, bf16(*plan.cache_shape)).mlir_module()
    assert module.count("mosaic_gpu_v2") == 1


@pytest.mark.parametrize("preset,max_len,stages", [("1b", 2304, 6), ("tinyllama_1.1b", 384, 13)])
def test_shared_memory_estimate_is_what_mosaic_allocates(preset, max_len, stages, monkeypatch):
    """MegaPlan.smem_bytes against Mosaic GPU's own count: a decoder plan (the 1b's grouped long plan,
    tinyllama's) pushed one ring slot or more past the limit, lowered with the plan's check relaxed, so
    Mosaic's error names the bytes it needs."""
    import re

    from scaling.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "models" / f"{preset}.yaml").model
    monkeypatch.setattr(decode.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(decode.jax, "devices", lambda *a: [type("H200", (), {"core_count": 132})()])
    plan = dataclasses.replace(decode.megakernel_plan(cfg, max_len), stages=stages)
    monkeypatch.undo()
    assert plan.smem_bytes() > mk.SMEM_BYTES
    monkeypatch.setattr(mk, "SMEM_BYTES", 10**7)
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    weights = {name: bf16(*(() if name == "head" else (plan.layers,)), plan.units(name), mk.BLOCK_F, plan.block_k)
               for name in plan.gemvs()}
    abstract = jax.ShapeDtypeStruct
    fn = jax.jit(lambda x, r, p, w, c: mk.megakernel_step(x, r, p, w, c, plan=plan))
    with pytest.raises(Exception, match="exceeds available shared memory") as err:
        export.export(fn, platforms=["cuda"])(
            abstract((plan.hidden,), jnp.float32), abstract((2, plan.head_dim), jnp.float32),
            abstract((), jnp.int32), weights, bf16(*plan.cache_shape))
    assert int(re.search(r"smem_bytes=(\d+)", str(err.value)).group(1)) == plan.smem_bytes()


# pos 64: a tile holding one position; 100: a partly masked one. 3 splits of 2 tiles: one empty
# (hold_slots: ring slots freed after the signal; a slot freed twice or never would hang the producer)
@pytest.mark.parametrize("pos,norm_prefetch,splits,hold", [(64, False, 1, 0), (100, True, 3, 3)])
def test_one_cta_step_matches_reference_in_interpret_mode(setup, pos, norm_prefetch, splits, hold):
    """Logits and the whole cache (the new row at pos, the rest untouched) against the reference."""
    _, rows, plan, cache, x = setup
    plan = dataclasses.replace(plan, norm_prefetch=norm_prefetch, attn_splits=splits, hold_slots=hold)
    units, ref_w = mk.prepare(rows, plan.block_k), mk.row_weights(rows)
    rope = mk.rope_table(jnp.int32(pos), layers.rope_frequencies(CFG))
    logits, buf, new_cache = jax.jit(lambda *a: mk.megakernel_step(*a, plan=plan, interpret=True))(
        x, rope, jnp.int32(pos), units, cache)
    want, want_cache = mk.megakernel_reference(x, rope, jnp.int32(pos), ref_w, cache, plan=plan)
    # f32 sums in another order can round an activation to the neighbouring bf16 value: one such
    # flip moves the logits by ~4e-3 / sqrt(D) (~2e-4 here); a wrong tile or chunk moves them by O(1)
    assert _rel(logits, want) < 2e-3
    assert _rel(new_cache.astype(jnp.float32), want_cache.astype(jnp.float32)) < 2e-3
    assert not np.array_equal(np.asarray(new_cache[:, pos]), np.asarray(cache[:, pos]))  # the row was written
    # the step's input is where MegaPlan says
    np.testing.assert_array_equal(np.asarray(buf[plan.x_off: plan.x_off + plan.hidden]), np.asarray(x))


def test_token_step_reads_the_embedding_row_and_rope_row_itself(setup):
    """megakernel_token_step (the decoder's: the kernel gathers the token's bf16 embedding row and
    pos's RoPE row) against megakernel_step given them in f32: the same input region, the same
    logits and cache; and the table of every position against rope_table at each."""
    _, rows, plan, cache, _ = setup
    token, pos = 11, 70
    inv_freq = layers.rope_frequencies(CFG)
    rope_all = mk.rope_tables(MAX_LEN, inv_freq)
    for p in (0, 1, pos, MAX_LEN - 1):
        np.testing.assert_allclose(rope_all[p], mk.rope_table(jnp.int32(p), inv_freq), rtol=1e-6, atol=1e-6)
    units, embed = mk.prepare(rows, plan.block_k), rows["embed_vd"]
    assert embed.dtype == jnp.bfloat16
    got = jax.jit(lambda *a: mk.megakernel_token_step(*a, plan=plan, interpret=True))(
        jnp.int32(token), jnp.int32(pos), embed, rope_all, units, cache)
    want = jax.jit(lambda *a: mk.megakernel_step(*a, plan=plan, interpret=True))(
        embed[token].astype(jnp.float32), rope_all[pos], jnp.int32(pos), units, cache)
    np.testing.assert_array_equal(np.asarray(got[1][plan.x_off: plan.x_off + plan.hidden]),
                                  np.asarray(embed[token].astype(jnp.float32)))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="embed must be a bf16, f16 or f32"):
        mk.megakernel_token_step(0, 0, embed.astype(jnp.int32), rope_all, units, cache, plan=plan)
    with pytest.raises(ValueError, match=f"rope_all must be rope_tables\\({MAX_LEN}\\)"):
        mk.megakernel_token_step(0, 0, embed, rope_all[:5], units, cache, plan=plan)


def test_token_step_takes_a_width_that_is_no_multiple_of_256():
    """The 25m preset's width, 384: the input row moves in chunks of 256 floats, the last one
    shorter (its last 128 values were left 0 before; found on the GPU, docs/benchmarks.md,
    twenty-fourth session). The decoder's step against the f32 reference."""
    cfg = dataclasses.replace(CFG, hidden_size=384, num_layers=1, num_heads=6, num_kv_heads=2, head_dim=64,
                              mlp_dim=256, param_dtype=DType.bfloat16)
    rows = decode.prepare_weights(build_model(cfg, seed=2), jnp.bfloat16, rows=True)
    plan = mk.plan_for(cfg, MAX_LEN, vocab_rows=rows["head_xd"].shape[0], ctas=1, x_stages=4)
    assert plan.block_k == 128 and plan.hidden % 256
    cache = (jax.random.normal(jax.random.key(5), (1, MAX_LEN, 2, 128)) * 0.5).astype(jnp.bfloat16)
    token, pos = 11, 70
    rope_all = mk.rope_tables(MAX_LEN, layers.rope_frequencies(cfg))
    units, embed = mk.prepare(rows, plan.block_k), rows["embed_vd"]
    logits, buf, _ = jax.jit(lambda *a: mk.megakernel_token_step(*a, plan=plan, interpret=True))(
        jnp.int32(token), jnp.int32(pos), embed, rope_all, units, cache)
    np.testing.assert_array_equal(np.asarray(buf[plan.x_off: plan.x_off + plan.hidden]),
                                  np.asarray(embed[token].astype(jnp.float32)))
    want, _ = mk.megakernel_reference(embed[token].astype(jnp.float32), rope_all[pos], jnp.int32(pos),
                                      mk.row_weights(rows), cache, plan=plan)
    assert _rel(logits, want) < 2e-3


# the default plan (one position per cache row); and the 1b's kind at 2048 positions: paired
# positions, the fused MLP (its reduce-adds land on partials), 3 attention splits, held slots, one
# operand slot (the head's whole tiles reuse their chunks from the x stages)
@pytest.mark.parametrize("kind", ["default", "pairs_mlp_splits"])
def test_loop_picks_each_token_as_the_step_by_step_chain(setup, kind):
    """megakernel_loop (greedy steps in one launch, the argmax on the GPU) against
    megakernel_token_step run step by step, each fed the previous step's argmax (np): the same
    tokens, raw logits x r equal to the step's logits, the same cache, over 3 steps (the third
    reuses the first one's buffer). Its vocab (200 of the head's 256 rows) keeps the padding rows'
    zero logits out of the argmax."""
    _, rows, plan, cache, _ = setup
    cfg, pos, max_len = CFG, 63, MAX_LEN
    if kind != "default":
        cfg, pos, max_len = CFG2, 129, MAX_LEN2
        rows = decode.prepare_weights(build_model(dataclasses.replace(CFG2, param_dtype=DType.bfloat16), seed=5),
                                      jnp.bfloat16, rows=True)
        plan = mk.plan_for(CFG2, max_len, vocab_rows=256, ctas=1, x_stages=8, block_k=256, attn_splits=3,
                           fuse_mlp=True, hold_slots=2, one_operand=True)
        cache = mk.pack_cache((jax.random.normal(jax.random.key(6), (2, max_len, 2, 128)) * 0.5).astype(jnp.bfloat16),
                              2)
    assert plan.vocab_rows == 256 and cfg.vocab_size == 200
    rope_all = mk.rope_tables(max_len, layers.rope_frequencies(cfg))
    units, embed = mk.prepare(rows, plan.block_k, plan.fuse_mlp), rows["embed_vd"]
    toks, raw, r, got_cache = jax.jit(lambda *a: mk.megakernel_loop(a[0], a[1], 3, *a[2:], plan=plan, vocab=200,
                                                                    interpret=True))(
        jnp.int32(7), jnp.int32(pos), embed, rope_all, units, cache)
    step = jax.jit(lambda *a: mk.megakernel_token_step(*a, plan=plan, interpret=True))
    tok, want_cache = 7, cache
    for s in range(3):
        logits, _, want_cache = step(jnp.int32(tok), jnp.int32(pos + s), embed, rope_all, units, want_cache)
        tok = int(np.argmax(np.asarray(logits)[:200]))
        assert int(toks[s]) == tok
        np.testing.assert_allclose(np.asarray(raw[s] * r[s]), np.asarray(logits), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))
    if kind == "default":
        with pytest.raises(ValueError, match="vocab must be 1..vocab_rows=256"):
            mk.megakernel_loop(0, 0, 2, embed, rope_all, units, cache, plan=plan, vocab=300)
        with pytest.raises(ValueError, match="steps must be 1..4096"):
            mk.megakernel_loop(0, 0, 0, embed, rope_all, units, cache, plan=plan, vocab=200)


# head_dim 64 at block_k 256: two positions per cache row (plan.ppr 2), 128 per attention tile;
# 2 q heads per KV head, so the even and odd positions' columns fill x_stages 4
CFG2 = dataclasses.replace(CFG, num_heads=4, num_kv_heads=2)
MAX_LEN2 = 256


@pytest.fixture(scope="module")
def setup_pairs():
    model = build_model(dataclasses.replace(CFG2, param_dtype=DType.bfloat16), seed=5)
    rows = decode.prepare_weights(model, jnp.bfloat16, rows=True)
    plan = mk.plan_for(CFG2, MAX_LEN2, vocab_rows=rows["head_xd"].shape[0], ctas=1, x_stages=4, block_k=256)
    assert plan.ppr == 2
    cache = (jax.random.normal(jax.random.key(6), (CFG2.num_layers, MAX_LEN2, CFG2.num_kv_heads, 2 * plan.head_dim))
             * 0.5).astype(jnp.bfloat16)
    return rows, plan, cache, rows["embed_vd"][11].astype(jnp.float32)


@pytest.mark.parametrize("units,ctas,first", [(512, 132, 0), (256, 132, 8), (5, 4, 1), (3, 8, 2)])
def test_cta_spans_cover_every_unit_once(units, ctas, first):
    spans = [mk.cta_span(c, units, ctas, first) for c in range(ctas)]
    assert all(spans[c] == (0, 0) for c in range(first))
    assert [u for a, b in spans for u in range(a, b)] == list(range(units))
    sizes = [b - a for a, b in spans[first:]]
    assert max(sizes) - min(sizes) <= 1
    # the kernel's traced form agrees
    assert [tuple(map(int, mk.cta_span(jnp.int32(c), units, ctas, first))) for c in range(ctas)] == spans


def test_out_skips_attn_needs_ctas_beyond_attention():
    plan = mk.plan_for(CFG, MAX_LEN, ctas=1, x_stages=4, out_skips_attn=True)
    with pytest.raises(ValueError, match="out_skips_attn needs CTAs"):
        plan.check()
    assert dataclasses.replace(plan, ctas=4).out_first_cta == 1


def test_pack_cache_pairs_positions():
    kv = jnp.arange(2 * 8 * 3 * 4).reshape(2, 8, 3, 4)
    packed = mk.pack_cache(kv, 2)
    assert packed.shape == (2, 4, 3, 8)
    np.testing.assert_array_equal(packed[1, 2, 0], np.concatenate([kv[1, 4, 0], kv[1, 5, 0]]))
    np.testing.assert_array_equal(mk.unpack_cache(packed, 2), kv)


# pos 1: the odd positions' stream has nothing yet; 129: the second tile holds one (even)
# position; 130 with 3 splits of 2 tiles: one split empty, one partial odd stream
@pytest.mark.parametrize("pos,splits", [(1, 1), (129, 1), (130, 3)])
def test_paired_positions_match_reference_in_interpret_mode(setup_pairs, pos, splits):
    rows, plan, cache, x = setup_pairs
    plan = dataclasses.replace(plan, attn_splits=splits)
    units, ref_w = mk.prepare(rows, plan.block_k), mk.row_weights(rows)
    rope = mk.rope_table(jnp.int32(pos), layers.rope_frequencies(CFG2))
    logits, _, packed = jax.jit(lambda *a: mk.megakernel_step(*a, plan=plan, interpret=True))(
        x, rope, jnp.int32(pos), units, mk.pack_cache(cache, 2))
    want, want_cache = mk.megakernel_reference(x, rope, jnp.int32(pos), ref_w, cache, plan=plan)
    new_cache = mk.unpack_cache(packed, 2)
    assert _rel(logits, want) < 2e-3
    assert _rel(new_cache.astype(jnp.float32), want_cache.astype(jnp.float32)) < 2e-3
    np.testing.assert_array_equal(np.delete(np.asarray(new_cache), pos, axis=1),
                                  np.delete(np.asarray(cache), pos, axis=1))
    # and the reference's paired streams are still attention: against the one-stream reference
    want1, _ = mk.megakernel_reference(x, rope, jnp.int32(pos), ref_w, cache,
                                       plan=dataclasses.replace(plan, block_k=128, attn_splits=1))
    assert _rel(want, want1) < 2e-2


# 8 q heads per KV head (tinyllama_1.1b's GQA): the q operand's 8 columns all taken, one position
# per cache row (head_dim 64 at block_k 128); 100: no split, 200: 3 splits and their combine;
# "mlp": the decoder's plan for tinyllama (the MLP fused, one operand slot over x stages for W_o's 8
# K steps, attention's statistic during the q/k/v barrier and its q/k/v by plain loads)
CFG8 = ModelConfig(vocab_size=200, hidden_size=256, num_layers=2, num_heads=16, num_kv_heads=2, head_dim=64,
                   mlp_dim=512, init_std=0.05, compute_dtype=DType.float32)


# "out": attention fused with W_o, whose K steps (block_k 128) each hold 2 of a KV head's 8 q heads:
# 4 ring slots per row tile and 4 operand slots for the heads' outputs; "grouped": as the decoder's
# long caches, the positions split over 3 of the group's 4 members, which merge their partials
@pytest.mark.parametrize("pos,splits,mlp", [(100, 1, False), (200, 3, "mlp"), (100, 1, "out"), (200, 1, "grouped")])
def test_eight_q_heads_per_kv_head_match_reference_in_interpret_mode(pos, splits, mlp):
    model = build_model(dataclasses.replace(CFG8, param_dtype=DType.bfloat16), seed=3)
    rows = decode.prepare_weights(model, jnp.bfloat16, rows=True)
    fused = bool(mlp)
    out = mlp in ("out", "grouped")
    plan = mk.plan_for(CFG8, 256, vocab_rows=rows["head_xd"].shape[0], ctas=1, x_stages=8 if fused else 4, attn_splits=splits,
                       fuse_mlp=fused, one_operand=fused, norm_in_qkv=fused, qkv_ld=fused, hold_slots=2 * fused,
                       stages=6 if fused else 3, fuse_out=out, group_ctas=4 if mlp == "grouped" else 0,
                       group_splits=3 if mlp == "grouped" else 0)
    plan.check()
    assert (plan.groups, plan.ppr, plan.phases_per_layer) == (8, 1, 5 - fused - out + (splits > 1))
    assert (plan.out_ksteps, plan.grouped) == ((4, mlp == "grouped") if out else (1, False))
    assert plan.x_slots() == 4 or not out  # (one operand slot, but the heads' outputs take 4)
    cache = (jax.random.normal(jax.random.key(4), (CFG8.num_layers, 256, CFG8.num_kv_heads, 2 * plan.head_dim))
             * 0.5).astype(jnp.bfloat16)
    x = rows["embed_vd"][7].astype(jnp.float32)
    rope = mk.rope_table(jnp.int32(pos), layers.rope_frequencies(CFG8))
    logits, _, new_cache = jax.jit(lambda *a: mk.megakernel_step(*a, plan=plan, interpret=True))(
        x, rope, jnp.int32(pos), mk.prepare(rows, plan.block_k, plan.fuse_mlp), cache)
    want, want_cache = mk.megakernel_reference(x, rope, jnp.int32(pos), mk.row_weights(rows), cache, plan=plan)
    assert _rel(logits, want) < 2e-3
    _assert_cache(new_cache, want_cache, pos)


# fuse_out: a KV head's q heads are one K step of W_o. CFG: head_dim 128, 2 q heads (one position
# per cache row); CFG3: head_dim 64, 4 q heads at block_k 256 (paired positions, as the 1b)
CFG3 = dataclasses.replace(CFG, hidden_size=512, num_heads=8, num_kv_heads=2, mlp_dim=512)


# (the third case: fuse_mlp, gate/up and down as one phase with W_down slice-major, with hold_slots,
# norm_in_qkv, one operand slot, the down units rotated per slice and q/k/v by plain loads)
# group (group_ctas, group_splits): a KV head's members split its tiles and merge their partials.
# At pos 1 the cache holds one tile: every member reads it (its own partial, through the exchange
# buffer); at 450, 4 tiles in 3 runs (1, 1, 2), the fourth member reads none; 3 members share W_o's
# 8 row tiles 2, 3, 3. "hold1": one slot held per phase (the decoder's long plan)
@pytest.mark.parametrize("cfg,max_len,pos,fuse_mlp,group", [(CFG, MAX_LEN, 100, False, (0, 0)),
                                                            (CFG3, 256, 1, False, (3, 2)),
                                                            (CFG3, 256, 129, True, (0, 0)),
                                                            (CFG3, 512, 450, True, (4, 3)),
                                                            (CFG3, 512, 450, True, (4, 3, "hold1"))])
def test_fused_output_projection_matches_reference_in_interpret_mode(cfg, max_len, pos, fuse_mlp, group):
    model = build_model(dataclasses.replace(cfg, param_dtype=DType.bfloat16), seed=3)
    rows = decode.prepare_weights(model, jnp.bfloat16, rows=True)
    hold = (1 if "hold1" in group else 2) if fuse_mlp else 0
    plan = mk.plan_for(cfg, max_len, vocab_rows=rows["head_xd"].shape[0], ctas=1, x_stages=8, fuse_out=True,
                       fuse_mlp=fuse_mlp, hold_slots=hold, norm_in_qkv=fuse_mlp, one_operand=fuse_mlp,
                       down_rotate=fuse_mlp, qkv_ld=fuse_mlp, group_ctas=group[0], group_splits=group[1])
    plan.check()
    assert plan.grouped == (group[1] > 1)
    assert plan.phases_per_layer == 4 - fuse_mlp and plan.ppr == (1 if cfg is CFG else 2)
    cache = (jax.random.normal(jax.random.key(4), (cfg.num_layers, max_len, cfg.num_kv_heads, 2 * plan.head_dim))
             * 0.5).astype(jnp.bfloat16)
    x = rows["embed_vd"][7].astype(jnp.float32)
    units, ref_w = mk.prepare(rows, plan.block_k, fuse_mlp), mk.row_weights(rows)
    rope = mk.rope_table(jnp.int32(pos), layers.rope_frequencies(cfg))
    logits, buf, packed = jax.jit(lambda *a: mk.megakernel_step(*a, plan=plan, interpret=True))(
        x, rope, jnp.int32(pos), units, mk.pack_cache(cache, plan.ppr))
    want, want_cache, want_h = mk.megakernel_reference(x, rope, jnp.int32(pos), ref_w, cache, plan=plan, hidden=True)
    # the first layer's output as the reference's (CFG at pos 100: 8e-6; p rounded to bf16 against
    # each tile's own running max instead of the pair's: 3.7e-3); the second layer starts from
    # activations rounded to bf16, where those last bits can flip a value to its neighbour, and each
    # flip moves the logits by ~2e-4 here (CFG at pos 100: 2.4e-3 with two cache tiles a step)
    h0 = buf[plan.region("in", 1): plan.region("in", 1) + plan.hidden]
    assert _rel(h0, want_h[0]) < 1e-4
    assert _rel(logits, want) < 4e-3
    _assert_cache(mk.unpack_cache(packed, plan.ppr), want_cache, pos)
    # the fused reference's rounding (each stream's share on its own) is still the same attention
    unfused, _ = mk.megakernel_reference(x, rope, jnp.int32(pos), ref_w, cache,
                                         plan=dataclasses.replace(plan, fuse_out=False, group_splits=0))
    assert _rel(want, unfused) < 2e-2


@pytest.mark.parametrize("ctas,kv_heads", [(132, 8), (1, 2), (40, 8), (264, 8)])
def test_fused_groups_cover_every_output_row_tile_once(ctas, kv_heads):
    plan = mk.plan_for(dataclasses.replace(CFG3, num_heads=4 * kv_heads, num_kv_heads=kv_heads, hidden_size=2048),
                       256, ctas=ctas, fuse_out=True)
    tiles = [t for m in range(plan.out_group) for t in range(*plan.out_tiles(m))]
    assert tiles == list(range(plan.hidden // mk.BLOCK_F))
    assert plan.out_group == max(1, ctas // kv_heads)
    assert plan.res_tiles == max(b - a for a, b in map(plan.out_tiles, range(plan.out_group)))


def test_fused_output_projection_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="fuse_out needs attn_splits=1"):
        mk.plan_for(CFG3, 256, x_stages=8, fuse_out=True, attn_splits=2).check()
    with pytest.raises(ValueError, match="group_splits splits the positions within fuse_out's groups"):
        mk.plan_for(CFG3, 256, x_stages=8, group_splits=2).check()
    with pytest.raises(ValueError, match="group_splits=5 must be at most the group's 4 CTAs"):
        mk.plan_for(CFG3, 256, x_stages=8, fuse_out=True, ctas=8, group_splits=5).check()
    with pytest.raises(ValueError, match="group_splits=17: at most 16"):
        mk.plan_for(CFG3, 256, x_stages=8, fuse_out=True, ctas=72, group_splits=17).check()
    with pytest.raises(ValueError, match="group_ctas and group_splits must be >= 0"):
        mk.plan_for(CFG3, 256, x_stages=8, fuse_out=True, group_ctas=-1).check()
    with pytest.raises(ValueError, match="groups \\* head_dim = 128 a multiple of block_k = 256"):
        mk.plan_for(dataclasses.replace(CFG3, num_kv_heads=4), 256, x_stages=8, block_k=256, fuse_out=True).check()


@pytest.mark.parametrize("block_k", [128, 256])
def test_down_slices_hold_each_slices_columns_by_row_tile(block_k):
    """fuse_mlp's W_down layout: unit i * (D / block_k) + u times the operand with the slice's
    activations in column c of rows 64 c.. gives rows u block_k + 64 c.. of W_down[:, slice i] a,
    against the row-major product in float64."""
    d, f = 512, 384
    w = jax.random.normal(jax.random.key(0), (2, d, f))
    a = np.asarray(jax.random.normal(jax.random.key(1), (f,)), np.float64)
    units = np.asarray(mk.down_slices(w, block_k), np.float64)  # [L, F/64 * D/bk, 64, bk]
    assert units.shape == (2, f // 64 * (d // block_k), 64, block_k)
    n_c = block_k // 64
    for layer in range(2):
        got = np.zeros(d)
        for i in range(f // 64):
            operand = np.zeros((block_k, n_c))  # [K, columns]
            for c in range(n_c):
                operand[64 * c: 64 * c + 64, c] = a[64 * i: 64 * i + 64]
            for u in range(d // block_k):
                got[u * block_k: (u + 1) * block_k] += (units[layer, i * (d // block_k) + u] @ operand).T.reshape(-1)
        np.testing.assert_allclose(got, np.asarray(w[layer], np.float64) @ a, rtol=1e-12, atol=1e-9)


def test_decoder_megakernel_options_are_checked():
    model = build_model(dataclasses.replace(CFG2, param_dtype=DType.bfloat16, compute_dtype=DType.bfloat16), seed=5)

    def dec(options, layers="megakernel"):
        return decode.Decoder(model, max_len=MAX_LEN, attention="xla", layers=layers, megakernel_options=options)

    with pytest.raises(ValueError, match="'stage' is not one of the plan's options; allowed .*'stages'"):
        dec({"stage": 4})
    with pytest.raises(ValueError, match="'max_len' is not one of the plan's options"):
        dec({"max_len": 512})
    with pytest.raises(ValueError, match="qkv_ld must be a bool \\(or 0/1\\), got 'yes'"):
        dec({"qkv_ld": "yes"})
    with pytest.raises(ValueError, match="stages must be an int, got 4.0"):
        dec({"stages": 4.0})
    with pytest.raises(ValueError, match="hold_slots must be 0..stages=6, got 9"):
        dec({"hold_slots": 9})
    with pytest.raises(ValueError, match="need layers='megakernel', got layers='xla'"):
        dec({"qkv_ld": False}, layers="xla")
    assert decode.parse_megakernel_options({"stages": 5, "qkv_ld": 0}) == (("qkv_ld", False), ("stages", 5))
    with pytest.raises(ValueError, match="this decoder runs no megakernel \\(layers='xla'"):
        dec(None, layers="xla").megakernel_weights


def test_fused_mlp_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="fuse_mlp holds all of h1 in the x stages: hidden / block_k = 8"):
        mk.plan_for(dataclasses.replace(CFG, hidden_size=2048, num_heads=16, num_kv_heads=8), 256, x_stages=4,
                    fuse_mlp=True).check()
    with pytest.raises(ValueError, match="norm_in_qkv holds all of h in the x stages: hidden / block_k = 8"):
        mk.plan_for(dataclasses.replace(CFG, hidden_size=2048, num_heads=16, num_kv_heads=8), 256, x_stages=4,
                    norm_in_qkv=True).check()
    with pytest.raises(ValueError, match="one_operand rounds each unit's x chunk from the x stages: it needs fuse_mlp"):
        mk.plan_for(CFG3, 256, x_stages=8, one_operand=True).check()
    with pytest.raises(ValueError, match="the GEMVs' K / block_k = 10 <= x_stages = 8"):  # (W_o's K: 40 heads of 64)
        mk.plan_for(dataclasses.replace(CFG3, hidden_size=256, num_heads=40, num_kv_heads=10, head_dim=64), 256,
                    x_stages=8, fuse_mlp=True, one_operand=True).check()
    with pytest.raises(ValueError, match="down_rotate orders the fused MLP's down units: it needs fuse_mlp"):
        mk.plan_for(CFG3, 256, x_stages=8, down_rotate=True).check()
    with pytest.raises(ValueError, match="hold_slots must be 0..stages=3, got 4"):
        mk.plan_for(CFG3, 256, x_stages=8, hold_slots=4).check()
    plan = mk.plan_for(CFG3, 256, x_stages=8, fuse_mlp=True)
    assert plan.up_stages == 1 and plan.x_slots() >= plan.hidden // plan.block_k


def test_reference_matches_the_decoders_xla_step(setup):
    """megakernel_reference (norms folded, deferred statistics, online softmax over 64-position
    blocks, bf16 at the kernel's points) against the decoder's XLA layers on the same weights."""
    model, rows, plan, cache, x = setup
    pos = 70
    xla_w = decode.prepare_weights(model, jnp.float32)
    k = tuple(cache[l, None, :, :, : plan.head_dim].astype(jnp.float32) for l in range(CFG.num_layers))
    v = tuple(cache[l, None, :, :, plan.head_dim:].astype(jnp.float32) for l in range(CFG.num_layers))
    logits, _ = decode._step_forward(xla_w, {"k": k, "v": v}, jnp.array([7]), jnp.array([pos]), cfg=CFG,
                                     attn_impl=decode.DecodeAttentionImpl.xla)
    rope = mk.rope_table(jnp.int32(pos), layers.rope_frequencies(CFG))
    want, _ = mk.megakernel_reference(x, rope, jnp.int32(pos), mk.row_weights(rows), cache, plan=plan)
    # bf16 weights (folded norm scales) and bf16 activations at every projection vs f32 throughout
    assert _rel(want[: CFG.vocab_size], logits[0]) < 3e-2


# With plan options over the measured plan, which every compiled step must take. CFG: a KV head's
# two members split the cache (group_splits) once the prompt fills its first 64-position tile
@pytest.mark.parametrize("cfg,ppr,options", [(CFG, 1, {"group_ctas": 2, "group_splits": 2}),
                                             (CFG2, 2, {"norm_in_qkv": False, "qkv_ld": 0, "down_rotate": True})])
def test_decoder_megakernel_generates_as_xla(cfg, ppr, options, monkeypatch):
    plan = decode.megakernel_plan(cfg, MAX_LEN)
    assert plan.ppr == ppr  # (head_dim 64: paired positions by default)
    assert plan.fuse_out == (cfg is CFG)  # (CFG: its 2 q heads of 128 are one K step of W_o)
    assert plan.fuse_mlp and plan.hold_slots == 2  # (one CTA in the interpreter: every slice of the MLP on it)
    assert plan.one_operand and plan.stages == 6  # (the fused MLP's plan: one operand slot, a sixth ring slot)
    assert plan.norm_in_qkv and plan.qkv_ld  # (and attention's critical path shortened)
    model = build_model(dataclasses.replace(cfg, param_dtype=DType.bfloat16, compute_dtype=DType.bfloat16), seed=5)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * (9 if cfg is CFG else 1)]
    want = decode.Decoder(model, max_len=MAX_LEN, attention="xla", layers="xla", chunk=2).generate(prompts, 5)
    dec = decode.Decoder(model, max_len=MAX_LEN, attention="xla", layers="megakernel", chunk=2,
                         megakernel_options=options)
    assert dec._step_layers(1) == decode.DecodeLayerImpl.megakernel
    assert dec._megakernel_weights is None  # (its copy of the weights: made at the first batch-1 call)
    seen, plan_of = [], decode.megakernel_plan
    monkeypatch.setattr(decode, "megakernel_plan", lambda *a: seen.append(plan_of(*a)) or seen[-1])
    got = dec.generate(prompts, 5)
    assert dec._megakernel_weights is not None
    assert seen and all(all(getattr(p, k) == v for k, v in options.items()) for p in seen)
    assert all(p.grouped for p in seen) == (cfg is CFG)
    # (the partials' shared memory: the deepest ring that fits, as options do not set stages)
    assert all(p.stages == (5 if cfg is CFG else 6) for p in seen)
    # Every step against the model's own forward over the generated sequence (teacher-forced):
    # its log-probs, and greedy up to near-ties. The bf16 steps round ~0.5% apart, so where two
    # logits are that close (CFG2's second token: 2.086 against 2.079) either may win.
    seq, n = prompts[0] + got.tokens[0], len(got.tokens[0])
    logp = np.asarray(jax.nn.log_softmax(model(jnp.array([seq[:-1]]))[0].astype(jnp.float32)))
    rows = logp[len(prompts[0]) - 1: len(prompts[0]) - 1 + n]
    chosen = rows[np.arange(n), got.tokens[0]]
    np.testing.assert_allclose(got.logprobs[0], chosen, atol=3e-2)
    assert np.all(rows.max(axis=-1) - chosen < 2e-2), rows.max(axis=-1) - chosen
    # and the XLA decoder's tokens up to the first near-tie
    k = next((i for i, (a, b) in enumerate(zip(got.tokens[0], want.tokens[0])) if a != b), n)
    assert k == n or abs(rows[k, got.tokens[0][k]] - rows[k, want.tokens[0][k]]) < 2e-2
    np.testing.assert_allclose(got.logprobs[0][:k], want.logprobs[0][:k], atol=3e-2)


@pytest.mark.parametrize("count,pos,done,stop_at", [(0, 20, False, 2), (3, 20, False, None), (0, 124, False, None),
                                                 (0, 20, True, None), (5, 20, False, 0)])
def test_greedy_chunk_book_keeping_matches_advance_step_by_step(monkeypatch, count, pos, done, stop_at):
    """_megakernel_greedy_chunk's book-keeping at once against `sample` and `_advance` step by step
    on the same logits (megakernel_loop replaced by fixed logits: its own test is above): a stop
    token inside the chunk, max_new_tokens reached, the cache's end (max_len 128), a row already
    done, and a stop at the first step."""
    n, vocab = 5, CFG.vocab_size
    raw = jax.random.normal(jax.random.key(2), (n, 256)) * 3
    r = jnp.linspace(0.5, 1.5, n)
    toks = jnp.argmax(raw[:, :vocab], axis=-1).astype(jnp.int32)
    stop = int(toks[stop_at]) if stop_at is not None else -7
    monkeypatch.setattr(mk, "megakernel_loop", lambda *a, **k: (toks, raw, r, a[6]))
    params = {"stop_ids": jnp.asarray([stop, -5]), "max_new": jnp.int32(8), "max_len": jnp.int32(128)}
    state = {"cache": {"kv": jnp.zeros(decode.megakernel_plan(CFG, MAX_LEN).cache_shape, jnp.bfloat16)},
             "token": jnp.asarray([9]), "pos": jnp.asarray([pos]), "count": jnp.asarray([count]),
             "done": jnp.asarray([done])}
    weights = {"embed_vd": jnp.zeros((vocab, CFG.hidden_size), jnp.bfloat16), "units": None}
    got_state, got_toks, got_lps = decode._megakernel_greedy_chunk(weights, state, params, cfg=CFG, n_steps=n)
    want_state, want_toks, want_lps = dict(state), [], []
    for i in range(n):
        tok, lp = decode.sample((raw[i, :vocab] * r[i])[None], None, 1.0, 1.0, decode.Sampling())
        want_state, tok, lp = decode._advance(want_state, tok, lp, params)
        want_toks.append(int(tok[0]))
        want_lps.append(float(lp[0]))
    assert got_toks[0].tolist() == want_toks
    np.testing.assert_allclose(np.asarray(got_lps[0]), want_lps, atol=1e-5)
    for key in ("token", "pos", "count", "done"):
        assert got_state[key].tolist() == want_state[key].tolist(), key


def test_decoder_runs_a_long_caches_first_chunks_on_the_short_plan(monkeypatch):
    """The chunks whose steps attend at most megakernel_short_reach positions run megakernel_plan's
    reach plan, the later ones the cache's own, with the same tokens and log-probs as every chunk on
    the cache's own plan. (One CTA in the interpreter splits no cache, so here the plans are grouped by
    options, and the reach plan differs by its held slots, which change when slots are freed, not
    what is computed.)"""
    measured = decode._measured_plan

    def differing(cfg, max_len, reach=None):
        plan = measured(cfg, max_len, reach)
        return dataclasses.replace(plan, hold_slots=0) if reach and reach < max_len else plan

    monkeypatch.setattr(decode, "_measured_plan", differing)
    model = build_model(dataclasses.replace(CFG, param_dtype=DType.bfloat16, compute_dtype=DType.bfloat16), seed=5)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6]]

    def run(short_reach):
        dec = decode.Decoder(model, max_len=MAX_LEN, attention="xla", layers="megakernel", chunk=2,
                             megakernel_options={"group_ctas": 2, "group_splits": 2},
                             megakernel_short_reach=short_reach)
        reaches, chunk = [], decode._decode_chunk
        monkeypatch.setattr(decode, "_decode_chunk", lambda *a, **k: reaches.append(k["mk_reach"]) or chunk(*a, **k))
        try:
            return dec.generate(prompts, 7), reaches
        finally:
            monkeypatch.setattr(decode, "_decode_chunk", chunk)

    (got, reaches), (want, own) = run(12), run(0)
    # after the prompt's 8 positions, chunks of 2 steps attend at most 10, 12, 14 positions
    assert reaches == [12, 12, None] and own == [None] * 3
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-6)
    with pytest.raises(ValueError, match="megakernel_short_reach must be an int >= 0"):
        decode.Decoder(model, max_len=MAX_LEN, attention="xla", layers="megakernel", megakernel_short_reach=-1)


def test_measured_plans_split_long_caches_within_the_groups(monkeypatch):
    """The decoder's plans on an H100/H200 (132 SMs), without compiling: the 1b's long cache is
    split within fuse_out's groups (docs/benchmarks.md, twenty-third session), its short one is not,
    and the 7b, whose q heads are no K step of W_o, keeps attn_splits; llama3_8b's ring falls back
    to 2 slots."""
    from scaling.config import load_config

    monkeypatch.setattr(decode.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(decode.jax, "devices", lambda *a: [type("H200", (), {"core_count": 132})()])
    presets = Path(__file__).resolve().parents[1] / "configs" / "models"
    one_b, seven_b = (load_config(presets / f"{name}.yaml").model for name in ("1b", "llama2_7b"))
    long_1b, short_1b = decode.megakernel_plan(one_b, 2304), decode.megakernel_plan(one_b, 384)
    assert long_1b.grouped and long_1b.group_splits == long_1b.out_group == 16 and long_1b.attn_splits == 1
    assert long_1b.hold_slots == 1 and short_1b.hold_slots == 2
    assert short_1b.fuse_out and not short_1b.grouped
    long_7b = decode.megakernel_plan(seven_b, 2304)
    assert not long_7b.fuse_out and long_7b.attn_splits == 4
    # a long cache's first steps (reach: the positions they attend) on the short cache's plan
    # below GROUPS_FROM positions the 1b's groups split nothing (each member reads them all)
    assert not decode.megakernel_plan(one_b, 640).grouped and decode.megakernel_plan(one_b, 768).grouped
    assert decode.megakernel_plan(seven_b, 640).attn_splits == 2  # (no fuse_out: its splits from 512)
    # a long cache's first steps (reach: the positions they attend) on the short cache's plan
    reach = decode.MEGAKERNEL_SHORT_REACH
    early = decode.megakernel_plan(one_b, 2304, reach=reach)
    assert early == dataclasses.replace(decode.megakernel_plan(one_b, 640), max_len=2304) != long_1b
    assert early.cache_shape == long_1b.cache_shape  # (the same cache, read by either plan)
    assert decode.megakernel_plan(one_b, 2304, reach=2304) == long_1b
    # which the decoder takes for the grouped plans only (the 7b's splits are faster by 448)
    for cfg, want in ((one_b, reach), (seven_b, None)):
        dec = types.SimpleNamespace(cfg=cfg, mk_options=(), short_reach=reach)
        assert decode.Decoder._chunk_reach(dec, 2304, 700) == want
        assert decode.Decoder._chunk_reach(dec, 2304, reach + 1) is None
        assert decode.Decoder._chunk_reach(dec, 640, 600) is None  # (its own plan is the short one)
    # llama3_8b: 29 operand slots (its down projection's K steps per CTA) leave room for 2 ring slots
    eight_b = load_config(presets / "llama3_8b.yaml").model
    short_8b = decode.megakernel_plan(eight_b, 384)
    short_8b.check()
    assert short_8b.stages == 2 and decode.megakernel_plan(seven_b, 384).stages == 3


def test_decoder_megakernel_refuses_a_model_it_cannot_run():
    bf16 = dict(param_dtype=DType.bfloat16, compute_dtype=DType.bfloat16)
    model = build_model(dataclasses.replace(CFG, mlp_dim=320, **bf16), seed=0)
    with pytest.raises(ValueError, match="layers='megakernel' cannot run this model: down: W 256x320"):
        decode.Decoder(model, layers="megakernel")
    with pytest.raises(ValueError, match="16-bit models"):
        decode.Decoder(build_model(CFG, seed=0), layers="megakernel")
    with pytest.raises(ValueError, match="cache_dtype must be bfloat16, got float32"):
        decode.Decoder(build_model(dataclasses.replace(CFG, **bf16), seed=0), layers="megakernel",
                       cache_dtype=jnp.float32)


def test_auto_takes_the_megakernel_where_it_runs_and_its_copy_fits(setup, monkeypatch):
    """layers="auto"'s choice, without a GPU: the copy's size is the unit-major weights' own (made
    here), and each reason against the megakernel is named."""
    from scaling.config import load_config

    model, rows, plan, _, _ = setup
    units = mk.prepare(rows, plan.block_k, plan.fuse_mlp)
    copy = decode.megakernel_copy_bytes(rows)
    assert copy == sum(x.nbytes for x in jax.tree.leaves(units))
    monkeypatch.setattr(decode.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(decode.jax, "devices", lambda *a: [type("H100", (), {"core_count": 132})()])
    one_b = load_config(Path(__file__).resolve().parents[1] / "configs" / "models" / "1b.yaml").model
    gib = 2**30
    reason = functools.partial(decode.auto_megakernel_reason, one_b, jnp.bfloat16, hopper=True, copy_bytes=2 * gib)
    assert reason(free_bytes=60 * gib) is None
    assert reason(free_bytes=None) is None  # (an allocator that does not say: not checked)
    assert "2.0 GiB) would take more than 50% of the 3.0 GiB" in reason(free_bytes=3 * gib)
    assert "Hopper" in decode.auto_megakernel_reason(one_b, jnp.bfloat16, hopper=False, copy_bytes=1,
                                                     free_bytes=None)
    assert "not float32" in decode.auto_megakernel_reason(one_b, jnp.float32, hopper=True, copy_bytes=1,
                                                          free_bytes=None)
    assert "the cache must be bfloat16, not float32" in reason(free_bytes=None, cache_dtype=jnp.float32)
    assert reason(free_bytes=None, cache_dtype=jnp.bfloat16) is None
    tiny = dataclasses.replace(one_b, num_heads=4, num_kv_heads=4, head_dim=32)
    assert "head_dim must be a multiple of 64" in decode.auto_megakernel_reason(
        tiny, jnp.bfloat16, hopper=True, copy_bytes=1, free_bytes=None)
    # tinyllama_1.1b: 8 q heads per KV head fill the q operand's 8 columns (one position per cache
    # row); its 88 MLP slices take one wave of the 132 CTAs, so the MLP is fused, with x stages
    # for all 16 of h1's chunks; attention is fused with W_o, its 8 q heads over 4 of W_o's K steps
    # (its long caches split within the groups)
    tl = load_config(Path(__file__).resolve().parents[1] / "configs" / "models" / "tinyllama_1.1b.yaml").model
    assert decode.auto_megakernel_reason(tl, jnp.bfloat16, hopper=True, copy_bytes=1, free_bytes=None) is None
    tl_plan = decode.megakernel_plan(tl, 384)
    assert (tl_plan.groups, tl_plan.ppr, tl_plan.fuse_out, tl_plan.out_ksteps, tl_plan.fuse_mlp, tl_plan.x_stages,
            tl_plan.stages, tl_plan.one_operand) == (8, 1, True, 4, True, 16, 6, True)
    tl_long = decode.megakernel_plan(tl, 2304)
    assert tl_long.grouped and tl_long.group_splits == 16 and tl_long.attn_splits == 1
    # llama3_8b's q heads span 2 K steps too, but its MLP is not fused: measured level, so not fused
    eight_b = load_config(Path(__file__).resolve().parents[1] / "configs" / "models" / "llama3_8b.yaml").model
    assert not decode.megakernel_plan(eight_b, 384).fuse_out
    assert decode.megakernel_plan(eight_b, 384, (("fuse_out", True),)).out_ksteps == 2
    # the 7b's 172 slices take two uneven waves: not fused, its ring what fits (3 slots of 32 KiB)
    seven_b = load_config(Path(__file__).resolve().parents[1] / "configs" / "models" / "llama2_7b.yaml").model
    assert (decode.megakernel_plan(seven_b, 384).fuse_mlp, decode.megakernel_plan(seven_b, 384).stages) == (False, 3)
    assert "at most 8 q heads per KV head" in decode.auto_megakernel_reason(
        dataclasses.replace(tl, num_heads=64), jnp.bfloat16, hopper=True, copy_bytes=1, free_bytes=None)
