"""The Pallas decode-layer kernels (scaling.kernels.decode_gemv) against their pure-jnp f32
references, in Pallas interpret mode, and the decoder built on them against the XLA path.

Fresh random shapes and inputs each run: the batch rows, positions and weights are drawn
from an unseeded generator (the seed is printed on failure through the test id's `rng`)."""

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from scaling import decode, layers
from scaling.config import DType, ModelConfig
from scaling.kernels import decode_gemv as g
from scaling.kernels import decode_tma
from scaling.model import build_model

SEED = int(np.random.SeedSequence().entropy % 2**31)
# f32 inputs: the kernels and the references differ only in summation order.
# bf16 inputs: the kernels keep f32 accumulators where the reference rounds nothing; the
# outputs are rounded to bf16 once (relative 2^-8).
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2}


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture
def rng(request):
    seed = SEED + abs(hash(request.node.name)) % 1000
    print(f"seed {seed}")
    return np.random.default_rng(seed)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("b,n,kv,h,parts", [(16, 4, 2, 64, 2), (16, 2, 2, 32, 1), (16, 8, 1, 64, 1),
                                            (1, 4, 2, 64, 8)])
def test_qkv_rope_matches_reference(rng, dtype, b, n, kv, h, parts):
    """b >= 16: tensor-core dots; b < 16: the vector path (CUDA-core products, small blocks)."""
    d, s = int(rng.choice([64, 128, 192])), int(rng.choice([8, 24]))
    x = jnp.asarray(rng.normal(size=(b, d)) * 3, dtype)
    w = jnp.asarray(rng.normal(size=((n + 2 * kv) * h, d)) / np.sqrt(d), dtype)
    cfg = ModelConfig(vocab_size=8, hidden_size=n * h, num_layers=1, num_heads=n, num_kv_heads=kv,
                      rope_theta=float(rng.choice([1e4, 5e5])))
    inv_freq = layers.rope_frequencies(cfg)
    pos = jnp.asarray(rng.integers(0, s, size=b), jnp.int32)
    kc = jnp.asarray(rng.normal(size=(b, s, kv, h)), dtype)
    vc = jnp.asarray(rng.normal(size=(b, s, kv, h)), dtype)
    ref_q, ref_k, ref_v = g.qkv_rope_reference(x, w, inv_freq, pos, kc, vc, num_heads=n, eps=1e-5)
    blocks = g.GemvBlocks(block_k=64, rope_parts=parts, prefetch=int(parts == 1))
    q, k_out, v_out = g.qkv_rope(x, w, inv_freq, pos, kc.copy(), vc.copy(), num_heads=n, eps=1e-5, blocks=blocks)
    tol = TOL[dtype]
    assert q.shape == (b, n, h) and q.dtype == x.dtype
    assert rel(q, ref_q) < tol
    assert rel(k_out, ref_k) < tol and rel(v_out, ref_v) < tol
    if n % kv == 0:  # the flash-decoding kernel's tile layout: rows [0, G) of [B, K, 16, H]
        qg, _, _ = g.qkv_rope(x, w, inv_freq, pos, kc.copy(), vc.copy(), num_heads=n, eps=1e-5, blocks=blocks,
                              q_layout="groups")
        assert qg.shape == (b, kv, 16, h)
        np.testing.assert_array_equal(np.asarray(qg[:, :, : n // kv], np.float32),
                                      np.asarray(q, np.float32).reshape(b, kv, n // kv, h))
    # Everything but the written slots is untouched, bit for bit.
    untouched = np.ones((b, s), bool)
    untouched[np.arange(b), np.asarray(pos)] = False
    np.testing.assert_array_equal(np.asarray(k_out, np.float32)[untouched], np.asarray(kc, np.float32)[untouched])
    np.testing.assert_array_equal(np.asarray(v_out, np.float32)[untouched], np.asarray(vc, np.float32)[untouched])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("path", ["tensor_cores", "vector"])
def test_matmul_residual_swiglu_and_head_match_reference(rng, dtype, path):
    if path == "tensor_cores":
        b, bn = int(rng.choice([16, 32])), 16
    else:
        b, bn = int(rng.choice([1, 2, 8])), int(rng.choice([1, 4, 8]))
    d, k = int(rng.choice([32, 96])), int(rng.choice([48, 256, 176]))
    a = jnp.asarray(rng.normal(size=(b, k)), dtype)
    w = jnp.asarray(rng.normal(size=(d, k)) / np.sqrt(k), dtype)
    r = jnp.asarray(rng.normal(size=(b, d)), dtype)
    blocks = g.GemvBlocks(block_k=int(rng.choice([32, 64])), block_n=bn, prefetch=int(rng.integers(0, 2)))
    assert rel(g.matmul_residual(a, w, r, blocks=blocks), g.matmul_residual_reference(a, w, r)) < TOL[dtype]
    f = int(rng.choice([32, 80]))
    x = jnp.asarray(rng.normal(size=(b, d)) * 2, dtype)
    wgu = jnp.asarray(rng.normal(size=(2 * f, d)) / np.sqrt(d), dtype)
    out = g.gate_up_swiglu(x, wgu, eps=1e-6, blocks=blocks)
    assert out.shape == (b, f)
    assert rel(out, g.gate_up_swiglu_reference(x, wgu, eps=1e-6)) < TOL[dtype]
    logits = g.norm_matmul(x, wgu, eps=1e-6, blocks=blocks)  # the output head: f32 logits
    assert logits.shape == (b, 2 * f) and logits.dtype == jnp.float32
    assert rel(logits, g.norm_matmul_reference(x, wgu, eps=1e-6)) < TOL[dtype]


@pytest.mark.parametrize("b", [1, 2])
def test_matmul_residual_reads_the_batch_rows_of_a_padded_input(rng, b):
    """a padded to 8 rows with NaN padding: only r's B rows count."""
    k, d = 128, 32
    a = jnp.asarray(rng.normal(size=(b, k)), jnp.float32)
    a8 = jnp.concatenate([a, jnp.full((8 - b, k), jnp.nan, jnp.float32)])
    w = jnp.asarray(rng.normal(size=(d, k)) / np.sqrt(k), jnp.float32)
    r = jnp.asarray(rng.normal(size=(b, d)), jnp.float32)
    blocks = g.GemvBlocks(block_k=64, block_n=4)
    got = g.matmul_residual(a8, w, r, blocks=blocks)
    assert got.shape == (b, d)
    assert rel(got, g.matmul_residual_reference(a, w, r)) < TOL[jnp.float32]
    with pytest.raises(ValueError, match=r"want \[>= 2, K\]"):
        g.matmul_residual(a8[:1], w, jnp.zeros((2, d)))


@pytest.mark.parametrize("b", [1, 4])  # the Pallas layers take power-of-two batches (the decoder's buckets)
def test_padded_residual_stream_passes_its_padding_rows_through(rng, b):
    """layers="pallas_tma"'s residual stream, padded to 8 rows once per step: matmul_residual
    with rows=B computes the batch rows and copies r's padding rows (here NaN: copied, never
    computed on); qkv_rope takes the first B rows of a padded x (B from the caches)."""
    k, d = 128, 32
    a8 = jnp.asarray(rng.normal(size=(8, k)), jnp.float32)  # a's padding rows are not read either
    w = jnp.asarray(rng.normal(size=(d, k)) / np.sqrt(k), jnp.float32)
    r8 = jnp.concatenate([jnp.asarray(rng.normal(size=(b, d)), jnp.float32), jnp.full((8 - b, d), jnp.nan)])
    got = g.matmul_residual(a8, w, r8, blocks=g.GemvBlocks(block_k=64, block_n=4), rows=b)
    assert got.shape == (8, d)
    assert rel(got[:b], g.matmul_residual_reference(a8[:b], w, r8[:b])) < TOL[jnp.float32]
    assert np.isnan(np.asarray(got[b:])).all()
    with pytest.raises(ValueError, match="rows=9"):
        g.matmul_residual(a8, w, r8, rows=9)
    n, kv, h, s = 4, 2, 16, 8
    x = jnp.asarray(rng.normal(size=(b, d)), jnp.float32)
    x8 = jnp.concatenate([x, jnp.full((8 - b, d), jnp.nan)])
    wqkv = jnp.asarray(rng.normal(size=((n + 2 * kv) * h, d)) / np.sqrt(d), jnp.float32)
    inv_freq = layers.rope_frequencies(ModelConfig(vocab_size=8, hidden_size=n * h, num_layers=1, num_heads=n,
                                                   num_kv_heads=kv))
    pos = jnp.asarray(rng.integers(0, s, size=b), jnp.int32)
    kc, vc = jnp.zeros((b, s, kv, h)), jnp.zeros((b, s, kv, h))
    want = g.qkv_rope_reference(x, wqkv, inv_freq, pos, kc, vc, num_heads=n, eps=1e-5)
    blocks = g.GemvBlocks(block_k=32, rope_parts=1)
    got = g.qkv_rope(x8, wqkv, inv_freq, pos, kc.copy(), vc.copy(), num_heads=n, eps=1e-5, blocks=blocks)
    for a, r in zip(got, want):
        assert a.shape == r.shape and rel(a, r) < TOL[jnp.float32]
    with pytest.raises(ValueError, match=r"want \[B\]"):
        g.qkv_rope(x8, wqkv, inv_freq, pos[:1].repeat(2) if b == 1 else pos[:1], kc, vc, num_heads=n, eps=1e-5)



def test_fold_norm_is_rmsnorm_then_matmul(rng):
    """(x * r * s) W = r * (x diag(s) W): the folded layout gives the model's RMSNorm."""
    d, x_dim = 64, 48
    x = jnp.asarray(rng.normal(size=(16, d)), jnp.float32)
    scale = jnp.asarray(rng.normal(size=(d,)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, x_dim)), jnp.float32)
    x32 = np.asarray(x, np.float64)
    want = (x32 / np.sqrt((x32 ** 2).mean(-1, keepdims=True) + 1e-5) * np.asarray(scale)) @ np.asarray(w)
    got = g.matmul_residual_reference(g._norm_ref(x, 1e-5), g.fold_norm(w, scale), jnp.zeros((16, x_dim)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_k_plan_keeps_wide_tiles_with_a_power_of_two_tail():
    assert g._k_plan(11008, 1024) == (1024, 10, ((10240, 512), (10752, 256)))  # llama2_7b's mlp dim
    assert g._k_plan(2048, 1024) == (1024, 2, ())
    assert g._k_plan(48, 256) == (32, 1, ((32, 16),))
    for k, want in [(176, 64), (4096 + 48, 512), (16, 16)]:
        bk, full, tail = g._k_plan(k, want)
        assert full * bk + sum(w for _, w in tail) == k and all(w >= 16 and w & (w - 1) == 0 for _, w in tail)
    with pytest.raises(ValueError, match="reduction dim 40 must be a multiple of 16"):
        g._k_plan(40, 16)


def test_errors_name_the_shape():
    x = jnp.zeros((12, 64), jnp.float32)
    with pytest.raises(ValueError, match="batch 12 must be a power of two"):
        g.gate_up_swiglu(x, jnp.zeros((64, 64)), eps=1e-5)
    with pytest.raises(ValueError, match="multiple of block_n=16, a power of two >= 16 at batch 16"):
        g.matmul_residual(jnp.zeros((16, 64)), jnp.zeros((40, 64)), jnp.zeros((16, 40)))
    with pytest.raises(ValueError, match="block_n=4, a power of two >= 16 at batch 16"):  # too small for a dot
        g.matmul_residual(jnp.zeros((16, 64)), jnp.zeros((32, 64)), jnp.zeros((16, 32)), blocks=g.GemvBlocks(block_n=4))
    with pytest.raises(ValueError, match=r"q_layout='bhsd': allowed \('heads', 'groups'\)"):
        g.qkv_rope(jnp.zeros((1, 64)), jnp.zeros((6 * 16, 64)), jnp.zeros((8,)), jnp.zeros((1,), jnp.int32),
                   jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 2, 16)), num_heads=2, eps=1e-5, q_layout="bhsd")
    with pytest.raises(ValueError, match="rope_parts"):
        g.qkv_rope(jnp.zeros((16, 64)), jnp.zeros((6 * 16, 64)), jnp.zeros((8,)), jnp.zeros((16,), jnp.int32),
                   jnp.zeros((16, 8, 2, 16)), jnp.zeros((16, 8, 2, 16)), num_heads=2, eps=1e-5)


@pytest.mark.parametrize("attention", ["xla", "pallas_combined"])
def test_decoder_with_pallas_layers_equals_xla(attention):
    """The whole decode loop on the Pallas layers (f32, interpret mode): same tokens and
    log-probs as the XLA layers, ragged prompts, GQA 2, head_dim 64; the vector path (3 rows,
    no padding rows). With attention="pallas_combined" also the flash-decoding kernel with its
    in-kernel combine, its counters carried from layer to layer. (q in the flash-decoding
    kernel's layout is checked by the qkv_rope test and test_decode.py's kernel test;
    bench_decode.py --check decodes with both on the GPU.)"""
    cfg = ModelConfig(vocab_size=97, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                      mlp_dim=96, init_std=0.3, compute_dtype=DType.float32)
    model = build_model(cfg, seed=3)
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [40]]
    ref = decode.Decoder(model, max_len=32, attention="xla", chunk=4, layers="xla").generate(prompts, 6)
    dec = decode.Decoder(model, max_len=32, attention=attention, chunk=4, layers="pallas")
    assert dec.bucket(3) == 4 and dec._step_layers(4) == decode.DecodeLayerImpl.pallas
    out = dec.generate(prompts, 6)
    assert out.tokens == ref.tokens
    np.testing.assert_allclose(np.concatenate(out.logprobs), np.concatenate(ref.logprobs), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match=r"layers='gpu': allowed \['xla', 'pallas', 'pallas_tma', 'auto', 'megakernel'\]"):
        decode.Decoder(model, layers="gpu")
    with pytest.raises(ValueError, match="unknown kernel 'mlp'"):
        g.LayerBlocks.parse("mlp=256/16/1/4/4")
    assert g.LayerBlocks.parse("down=512/32/1/8/3/1").down == g.GemvBlocks(512, 32, 1, 8, 3, 1)
    small_heads = build_model(dataclasses.replace(cfg, head_dim=32))
    # 16 rows take the tensor cores: 32 / 2 / 2 default rope_parts = 8 < 16 columns per dot
    with pytest.raises(ValueError, match="layers='pallas' cannot run this model at batch 16: head_dim 32"):
        decode.Decoder(small_heads, layers="pallas", min_batch=16)
    one_part = g.LayerBlocks(qkv=g.GemvBlocks(rope_parts=1))
    assert decode.Decoder(small_heads, layers="pallas", min_batch=16, gemv_blocks=one_part).layer_impl == "pallas"
    assert decode.Decoder(small_heads, layers="pallas").layer_impl == "pallas"  # the vector path at batch 1-8


def test_auto_layers_on_gpu_pick_pallas_for_small_batches(monkeypatch):
    """layers="auto" on a GPU backend: unpadded Pallas steps up to AUTO_PALLAS_MAX_BATCH rows,
    XLA steps padded to GPU_MIN_BATCH above; on the CPU, XLA everywhere (nothing runs here)."""
    cfg = ModelConfig(vocab_size=97, hidden_size=128, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64,
                      mlp_dim=96, compute_dtype=DType.float32)
    model = build_model(cfg, seed=0)
    cpu = decode.Decoder(model, attention="xla")
    assert cpu.layer_impl == decode.DecodeLayerImpl.xla and cpu.bucket(1) == 1
    monkeypatch.setattr(decode.jax, "default_backend", lambda: "gpu")
    dec = decode.Decoder(model, attention="xla")
    top = decode.AUTO_PALLAS_MAX_BATCH
    assert dec.bucket(1) == 1 and dec._step_layers(1) == decode.DecodeLayerImpl.pallas
    assert dec.bucket(top) == top and dec._step_layers(top) == decode.DecodeLayerImpl.pallas
    assert dec.bucket(top + 1) == max(2 * top, decode.GPU_MIN_BATCH)
    assert dec._step_layers(dec.bucket(top + 1)) == decode.DecodeLayerImpl.xla
    assert "head_xd" in dec.weights and "final_norm" not in dec.weights  # one (row) layout for both paths
    xla = decode.Decoder(model, attention="xla", layers="xla")
    assert xla.bucket(1) == decode.GPU_MIN_BATCH and "head_xd" not in xla.weights


def test_auto_layers_take_the_tma_kernels_on_hopper_for_wide_models(monkeypatch):
    """layers="auto" on a Hopper GPU: batch-1 steps on the megakernel where it takes the model;
    where it declines, on the TMA kernels for 16-bit models from AUTO_TMA_MIN_HIDDEN wide, with the
    projections whose grid is wide enough (the 4096-wide output and down projections; not this toy
    vocabulary's head); the Triton kernels below that width and on other GPUs. Nothing runs here:
    the choice is made at construction."""
    monkeypatch.setattr(decode.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(decode, "is_hopper", lambda: True)
    wide = ModelConfig(vocab_size=97, hidden_size=decode.AUTO_TMA_MIN_HIDDEN, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=64, mlp_dim=256, compute_dtype=DType.bfloat16)
    wide_model = build_model(wide, seed=0)
    dec = decode.Decoder(wide_model, attention="xla")
    assert dec.megakernel and dec.auto_megakernel_reason is None
    assert dec._step_layers(1) == decode.DecodeLayerImpl.megakernel and dec._step_layers(8) == decode.DecodeLayerImpl.xla
    monkeypatch.setattr(decode, "auto_megakernel_reason", lambda *a, **k: "declined")
    dec = decode.Decoder(wide_model, attention="xla")
    assert not dec.megakernel and dec.auto_megakernel_reason == "declined"
    assert dec._step_layers(1) == decode.DecodeLayerImpl.pallas_tma and dec._step_layers(8) == decode.DecodeLayerImpl.xla
    assert dec.tma.projections == ("gate_up", "out", "down")  # the head: 256 padded rows, 4 CTAs
    narrow = dataclasses.replace(wide, hidden_size=decode.AUTO_TMA_MIN_HIDDEN // 2)
    assert decode.Decoder(build_model(narrow, seed=0), attention="xla")._step_layers(1) == decode.DecodeLayerImpl.pallas
    monkeypatch.setattr(decode, "is_hopper", lambda: False)
    assert decode.Decoder(wide_model, attention="xla")._step_layers(1) == decode.DecodeLayerImpl.pallas


def test_vector_tiles_per_device():
    """H100 (and any GPU but the H200): the H100-tuned table. H200: its own table, and a down
    projection with ~1024 programs at any hidden size (the same bytes per program step)."""
    h100 = g.default_blocks(1, 64, hidden=4096, device_kind="NVIDIA H100 80GB HBM3")
    assert (h100.head, h100.gate_up, h100.down) == (g.VECTOR_GEMV.head, g.VECTOR_GEMV.gate_up, g.VECTOR_GEMV.down)
    for hidden, n, k in ((2048, 2, 1024), (4096, 4, 512), (8192, 8, 256)):
        lb = g.default_blocks(1, 64, hidden=hidden, device_kind="NVIDIA H200")
        assert (lb.down.block_n, lb.down.block_k) == (n, k) and hidden // lb.down.block_n == 1024
        assert lb.head == g.VECTOR_GEMV_H200.head
        # gate/up: one tile spans a reduction of up to 2048 (the 1b), the table's tiles beyond
        want = (2048, 1) if hidden <= 2048 else (g.VECTOR_GEMV_H200.gate_up.block_k, g.VECTOR_GEMV_H200.gate_up.num_stages)
        assert (lb.gate_up.block_k, lb.gate_up.num_stages) == want and lb.gate_up.block_n == 2
    # both presets tile with the H200 table
    for hidden, mlp, heads, vocab in ((2048, 8192, 32, 32000), (4096, 11008, 32, 32000)):
        lb = g.default_blocks(1, hidden // heads, hidden=hidden, device_kind="NVIDIA H200")
        assert g.unsupported_reason(hidden, mlp, heads, hidden // heads, vocab, 1, lb) is None
    # batch 2 still shrinks the reduction tile (registers), never below 128
    assert g.default_blocks(4, 64, hidden=4096, device_kind="NVIDIA H200").down.block_k == 256


TMA_CFG = ModelConfig(vocab_size=97, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                      mlp_dim=256, init_std=0.3, compute_dtype=DType.bfloat16)
TMA_PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [40]]


@pytest.fixture(scope="module")
def tma_reference():
    """A bf16 model and its decode on layers="pallas" (interpret mode), shared by the TMA tests."""
    model = build_model(TMA_CFG, seed=5)
    return model, decode.Decoder(model, max_len=32, attention="xla", chunk=4, layers="pallas").generate(TMA_PROMPTS, 4)


def test_decoder_with_the_tma_gate_up_equals_the_pallas_layers(tma_reference):
    """layers="pallas_tma" (the gate/up + SwiGLU by decode_tma with the norm statistic taken in the
    kernel, interpret mode; the residual stream padded to 8 rows once per step and passed through
    the other kernels) decodes a bf16 model like layers="pallas": same tokens, log-probs within
    bf16 rounding; 3 ragged prompts."""
    model, ref = tma_reference
    dec = decode.Decoder(model, max_len=32, attention="xla", chunk=4, layers="pallas_tma")
    assert dec.bucket(3) == 4 and dec._step_layers(4) == decode.DecodeLayerImpl.pallas_tma
    assert dec._step_layers(16) == decode.DecodeLayerImpl.xla  # the TMA kernel carries 8 rows at most
    out = dec.generate(TMA_PROMPTS, 4)
    assert out.tokens == ref.tokens
    np.testing.assert_allclose(np.concatenate(out.logprobs), np.concatenate(ref.logprobs), atol=0.05, rtol=0)
    with pytest.raises(ValueError, match=r"layers='pallas_tma' cannot run this model: gate_up projection: the outputs \(96\)"):
        decode.Decoder(build_model(dataclasses.replace(TMA_CFG, mlp_dim=96)), layers="pallas_tma")


def test_decoder_with_every_tma_projection_equals_the_pallas_layers(tma_reference, monkeypatch):
    """Every projection but q/k/v by TMA: the output and down projections (residual epilogue on the
    8-row stream) and the head (in-kernel statistic, f32 logits) too; as above. Set through the
    module's knob, which a Decoder snapshots (a step traced before the change is not reused)."""
    model, ref = tma_reference
    monkeypatch.setattr(decode_tma, "TMA_PROJECTIONS", decode_tma.PROJECTIONS)
    traced = []  # the TMA kernels really run (not a step traced before the switch)
    for name in ("matmul_residual_tma", "norm_matmul_tma"):
        real = getattr(decode_tma, name)
        monkeypatch.setattr(decode_tma, name, lambda *a, real=real, name=name, **kw: traced.append(name) or real(*a, **kw))
    out = decode.Decoder(model, max_len=32, attention="xla", chunk=4, layers="pallas_tma").generate(TMA_PROMPTS, 4)
    per_trace = 2 * TMA_CFG.num_layers  # the output and the down projection of each layer
    assert traced.count("matmul_residual_tma") in (per_trace, 2 * per_trace) and "norm_matmul_tma" in traced
    assert out.tokens == ref.tokens
    np.testing.assert_allclose(np.concatenate(out.logprobs), np.concatenate(ref.logprobs), atol=0.05, rtol=0)
    with pytest.raises(ValueError, match=r"unknown TMA projections \['mlp'\]"):
        decode.Decoder(model, layers="pallas_tma", tma=decode_tma.TmaSettings(projections=("gate_up", "mlp")))
    with pytest.raises(ValueError, match=r"gate_up projection: the reduction \(256\) is not a multiple of block_k 512"):
        decode.Decoder(model, layers="pallas_tma", tma=decode_tma.TmaSettings(blocks=decode_tma.TmaBlocks(block_k=512)))
    with pytest.raises(TypeError, match="tma must be a decode_tma.TmaSettings"):
        decode.Decoder(model, layers="pallas_tma", tma=("head",))


def test_tma_qkv_step_matches_the_pallas_layers():
    """q/k/v by decode_tma.qkv_rope_tma (norm and RoPE in the TMA kernel) and the cache written by
    the attention kernel (interpret mode), one compiled decode step against layers="pallas" on
    the same random cache: logits and the written K/V rows within bf16 rounding (XLA's layers
    differ from the Pallas ones by 2e-2 here). Head dim 128 (the natural rope row order), 8 heads:
    decode_attention_rotated (its 16-row q tiles need that many; fewer take the fused kernel with
    its rotation off, tested in test_decode.py). A free-running bf16 decode is no test: its tokens
    part on rounding alone."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import bench_decode

    cfg = dataclasses.replace(TMA_CFG, num_heads=8, num_kv_heads=8, head_dim=128)
    tma = decode_tma.TmaSettings(projections=("gate_up", decode_tma.QKV))
    errs = bench_decode.step_errors(build_model(cfg, seed=6), decode.DecodeLayerImpl.pallas_tma, tma)
    assert max(errs.values()) < 1.5e-2, errs
    with pytest.raises(ValueError, match=r"qkv projection: head_dim 64 must be 2 \* block_f = 128"):
        decode.Decoder(build_model(TMA_CFG), layers="pallas_tma", tma=tma)  # the rope order needs H = 128


def test_tma_layers_refuse_a_gpu_other_than_hopper(monkeypatch):
    cfg = ModelConfig(vocab_size=97, hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64,
                      mlp_dim=128, compute_dtype=DType.bfloat16)
    monkeypatch.setattr(decode.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(decode, "is_hopper", lambda: False)
    with pytest.raises(ValueError, match="the TMA kernels need a Hopper GPU"):
        decode.resolve_layer_impl("pallas_tma", cfg, decode.DecodeAttentionImpl.pallas)
    monkeypatch.setattr(decode, "is_hopper", lambda: True)
    assert decode.resolve_layer_impl("pallas_tma", cfg, decode.DecodeAttentionImpl.pallas) == "pallas_tma"

