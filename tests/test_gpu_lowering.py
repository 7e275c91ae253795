"""Our Triton-lowered Pallas kernels lower to Triton IR for a Hopper GPU, checked on the CPU.

Interpret mode (the other kernel tests) runs the kernels' math but not Pallas' Triton
lowering, which rejects some programs that interpret mode accepts (a scalar predicate in
`jnp.where` mixed i1 and f32 in the fused decode kernel: found on the GPU, now caught here).
`jax.export` lowers for the "cuda" platform without a GPU once Pallas is told which GPU to
target; that runs the whole Pallas -> Triton IR lowering (PTX compilation still needs a GPU).
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax import export

from scaling.kernels.decode_attention import decode_attention, decode_attention_fused
from scaling.kernels.flash_attention import flash_attention

gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.fixture
def as_h100(monkeypatch):
    """Lower as for an H100: Pallas reads the target from gpu_info, our kernels pick
    interpret mode from the default backend."""
    if not hasattr(gpu_info, "_get_gpu_info_impl") or not hasattr(gpu_info, "GpuVersion"):
        pytest.skip("this jax's Pallas Triton gpu_info has no target override")
    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H100))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def lower_for_cuda(fn, *args) -> str:
    exp = export.export(jax.jit(fn), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
    return exp.mlir_module()


def sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_decode_kernels_lower_for_hopper(as_h100):
    b, n, kh, h, s = 8, 32, 8, 64, 384
    text = lower_for_cuda(lambda q, k, v, lens: decode_attention(q, k, v, lens),
                          sds((b, n, h)), sds((b, s, kh, h)), sds((b, s, kh, h)), sds((b,), jnp.int32))
    assert text.count(TRITON_CALL) == 1
    text = lower_for_cuda(lambda *a: decode_attention_fused(*a, num_heads=n),
                          sds((b, n + 2 * kh, h)), sds((b,), jnp.int32), sds((b, h // 2), jnp.float32),
                          sds((b, h // 2), jnp.float32), sds((b, s, kh, h)), sds((b, s, kh, h)))
    assert text.count(TRITON_CALL) == 1


def test_rotated_decode_kernel_lowers_for_hopper(as_h100):
    """decode_attention_rotated at the 7b's heads (MHA, H = 128) and the 1b's (GQA 4, H = 64)."""
    from scaling.kernels.decode_attention import decode_attention_rotated

    for n, kh, h in ((32, 32, 128), (32, 8, 64)):
        fn = lambda qkv, pos, k, v, n=n: decode_attention_rotated(qkv, pos, k, v, num_heads=n)  # noqa: E731
        text = lower_for_cuda(fn, sds((1, n + 2 * kh, h)), sds((1,), jnp.int32), sds((1, 384, kh, h)), sds((1, 384, kh, h)))
        assert text.count(TRITON_CALL) == 1


def test_grid_barrier_kernels_lower_for_hopper(as_h100):
    """experiments/bench_grid_barrier.py: the spinning grid barrier (atomic arrive, a polling
    while loop, CTA barriers) and its prefetching variant lower as one Triton kernel for all
    phases; the baseline as one kernel per phase."""
    import functools
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import bench_grid_barrier as gb

    w = sds((4, 132, 4096))
    for prefetch in (False, True):
        fn = functools.partial(gb.run_phases, block=2048, barrier=True, prefetch=prefetch)
        assert lower_for_cuda(fn, w).count(TRITON_CALL) == 1
    fn = functools.partial(gb.run_phases, block=2048, barrier=True, prefetch=True, rows=8, num_warps=8)
    assert lower_for_cuda(fn, sds((4, 132 * 8, 4096))).count(TRITON_CALL) == 1
    assert lower_for_cuda(functools.partial(gb.run_kernels, block=2048), w).count(TRITON_CALL) == 4


@pytest.mark.parametrize("s, kh", [(384, 8), (192, 8), (2304, 32)])  # 1, 3 (not a power of two) and 36 splits
def test_decode_kernel_with_in_kernel_combine_lowers_for_hopper(as_h100, s, kh):
    """The combined flash-decoding kernel (atomic ticket, CTA barriers, volatile loads, the
    merge loop) through the Triton lowering: one kernel, no XLA combine after it."""
    from scaling.kernels.decode_attention import decode_attention_grouped

    n, h = 32, 64
    text = lower_for_cuda(lambda q, k, v, lens, t: decode_attention_grouped(q, k, v, lens, num_heads=n, tickets=t),
                          sds((1, kh, 16, h)), sds((1, s, kh, h)), sds((1, s, kh, h)), sds((1,), jnp.int32),
                          sds((1, kh, 1), jnp.int32))
    assert text.count(TRITON_CALL) == 1 and "stablehlo.exponential" not in text


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_forward_and_backward_lower_for_hopper(as_h100, causal):
    q, kv = sds((2, 256, 8, 64)), sds((2, 256, 2, 64))

    def loss(q, k, v):
        return flash_attention(q, k, v, causal=causal).astype(jnp.float32).sum()

    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
    assert text.count(TRITON_CALL) >= 3  # forward, dK/dV, dQ


@pytest.mark.parametrize("b", [16, 1, 8])
def test_decode_layer_kernels_lower_for_hopper(as_h100, b):
    """scaling.kernels.decode_gemv at the 1b shapes (head_dim 64, GQA 4): batch 16 on the
    tensor cores, 1 and 8 on the vector path with its default blocks."""
    from scaling.kernels import decode_gemv as g

    d, n, kv, h, f, s, v = 2048, 32, 8, 64, 8192, 384, 32000
    lb = g.default_blocks(b, h)
    text = lower_for_cuda(lambda *a: g.qkv_rope(*a, num_heads=n, eps=1e-5, blocks=lb.qkv),
                          sds((b, d)), sds(((n + 2 * kv) * h, d)), sds((h // 2,), jnp.float32), sds((b,), jnp.int32),
                          sds((b, s, kv, h)), sds((b, s, kv, h)))
    assert text.count(TRITON_CALL) == 1
    assert lower_for_cuda(lambda x, w: g.norm_matmul(x, w, eps=1e-5, blocks=lb.head),
                          sds((b, d)), sds((v, d))).count(TRITON_CALL) == 1
    prefetch = g.GemvBlocks(block_k=512, block_n=32, prefetch=1, num_stages=1)
    for blocks in ((lb.down, prefetch) if b >= 16 else (lb.down, dataclasses.replace(lb.down, prefetch=1))):
        assert lower_for_cuda(lambda a, w, r: g.matmul_residual(a, w, r, blocks=blocks),
                              sds((b, f)), sds((d, f)), sds((b, d))).count(TRITON_CALL) == 1
        assert lower_for_cuda(lambda x, w: g.gate_up_swiglu(x, w, eps=1e-5, blocks=blocks),
                              sds((b, d)), sds((2 * f, d))).count(TRITON_CALL) == 1
    # llama2_7b's down projection: a reduction of 11008 = 10 x 1024 + 512 + 256 (tail pieces)
    assert lower_for_cuda(lambda a, w, r: g.matmul_residual(a, w, r, blocks=lb.down),
                          sds((b, 11008)), sds((4096, 11008)), sds((b, 4096))).count(TRITON_CALL) == 1


def test_h200_vector_tiles_lower_for_hopper(as_h100):
    """The H200's vector-path tiles (16/256 head, the hidden-dependent gate/up and down
    projections) lower at the 1b and llama2_7b shapes, batch 1."""
    from scaling.kernels import decode_gemv as g

    for d, f, v in ((2048, 8192, 32000), (4096, 11008, 32000)):
        lb = g.default_blocks(1, 64, hidden=d, device_kind="NVIDIA H200")
        assert lower_for_cuda(lambda x, w: g.norm_matmul(x, w, eps=1e-5, blocks=lb.head),
                              sds((1, d)), sds((v, d))).count(TRITON_CALL) == 1
        assert lower_for_cuda(lambda x, w: g.gate_up_swiglu(x, w, eps=1e-5, blocks=lb.gate_up),
                              sds((1, d)), sds((2 * f, d))).count(TRITON_CALL) == 1
        assert lower_for_cuda(lambda a, w, r: g.matmul_residual(a, w, r, blocks=lb.down),
                              sds((1, f)), sds((d, f)), sds((1, d))).count(TRITON_CALL) == 1


MOSAIC_CALL = "mosaic_gpu_v2"


@pytest.mark.parametrize("causal, kv, variant", [(True, 8, {}), (False, 2, {"delta_in_dq": True}),
                                                  (True, 2, {"fused_dq": True}),
                                                  (True, 2, {"fused_dq": True, "dq_stage_buffers": 2}),
                                                  (True, 2, {"fused_dq": True, "dq_stage_swizzle": 0}),
                                                  (True, 8, {"persistent": True, "persistent_dq": True,
                                                             "persistent_ctas": 132}),
                                                  (True, 2, {"dq_from_ds": True, "ds_dq_tiles": 4, "stages_dq": 3}),
                                                  (False, 8, {"dq_from_ds": True, "ds_dq_head_major": True,
                                                              "dkv_head_major": True})])
def test_mosaic_flash_attention_forward_and_backward_lower_for_hopper(as_h100, causal, kv, variant):
    """backend="mosaic": the Mosaic GPU forward, dK/dV and dQ kernels go through Pallas' Mosaic
    GPU lowering (with the register-A wgmmas interpret mode cannot run) for the "cuda" platform;
    once with delta computed inside the dQ kernel (its WGMMA-layout loads of O and dO), once with
    dQ fused into the dK/dV kernel (the transposed shared-memory A operand, the f32 staging
    store and the TMA reduce-add, none of which interpret mode runs), once with dQ from the
    stored dSᵀ (its transposed shared-memory A operand, accumulated in place), there with the
    head-major launch orders."""
    from scaling.kernels.flash_attention_mgpu_bwd import MosaicBwdConfig

    q, kvs = sds((1, 256, 8, 128)), sds((1, 256, kv, 128))
    cfg = MosaicBwdConfig(**variant)

    def loss(q, k, v):
        return flash_attention(q, k, v, causal=causal, backend="mosaic",
                               mosaic_bwd_config=cfg).astype(jnp.float32).sum()

    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, kvs, kvs)
    kernels = 2 if cfg.fused_dq else 3  # forward, dK/dV, dQ
    assert text.count(MOSAIC_CALL) == kernels and TRITON_CALL not in text


@pytest.mark.parametrize("causal, kv", [(True, 8), (False, 2)])
def test_persistent_mosaic_forward_lowers_for_hopper(as_h100, causal, kv):
    """The persistent Mosaic forward (one CTA per SM looping over tiles, register-A P V wgmmas
    that interpret mode cannot run) through Pallas' Mosaic GPU lowering for the "cuda" platform."""
    from scaling.kernels.flash_attention_mgpu import MosaicConfig, mosaic_forward

    cfg = MosaicConfig(persistent=True, persistent_ctas=132)
    text = lower_for_cuda(lambda q, k, v: mosaic_forward(q, k, v, causal=causal, config=cfg),
                          sds((2, 512, 8, 128)), sds((2, 512, kv, 128)), sds((2, 512, kv, 128)))
    assert text.count(MOSAIC_CALL) == 1 and TRITON_CALL not in text


@pytest.mark.parametrize("b", [1, 2, 4])
def test_decode_kernels_on_a_padded_stream_lower_for_hopper(as_h100, b):
    """layers="pallas_tma" keeps the residual stream padded to 8 rows: matmul_residual(rows=B)
    passes rows [B, 8) through and qkv_rope reads the first B rows. Triton wants every tile's
    size a power of two, which a pass-through of 8 - B rows is not by itself (interpret mode
    accepts it; the first GPU run of the ninth session's version failed here)."""
    from scaling.kernels import decode_gemv as g

    d, n, kv, h, f, s = 2048, 32, 8, 64, 8192, 384
    lb = g.default_blocks(b, h)
    assert lower_for_cuda(lambda a, w, r: g.matmul_residual(a, w, r, blocks=lb.down, rows=b),
                          sds((8, f)), sds((d, f)), sds((8, d))).count(TRITON_CALL) == 1
    text = lower_for_cuda(lambda *a: g.qkv_rope(*a, num_heads=n, eps=1e-5, blocks=lb.qkv),
                          sds((8, d)), sds(((n + 2 * kv) * h, d)), sds((h // 2,), jnp.float32), sds((b,), jnp.int32),
                          sds((b, s, kv, h)), sds((b, s, kv, h)))
    assert text.count(TRITON_CALL) == 1


@pytest.mark.parametrize("b,tma,model", [(1, ("gate_up",), "1b"),
                                         (2, ("gate_up", "out", "down", "head"), "1b"),
                                         (1, ("gate_up", "out", "down", "head", "qkv"), "llama2_7b")])
def test_pallas_decode_step_lowers_for_hopper(as_h100, b, tma, model):
    """A whole decode step of the Pallas layers (one layer at the 1b's or the 7b's shapes) through Pallas'
    Triton and Mosaic GPU lowerings: the kernels as the decoder composes them (a padded residual
    stream with layers="pallas_tma"), where one kernel's lowering test alone can miss a shape."""
    from pathlib import Path

    from scaling import decode
    from scaling.config import load_config
    from scaling.kernels import decode_tma

    cfg = load_config(Path(__file__).parents[1] / "configs" / "models" / f"{model}.yaml").model
    cfg = dataclasses.replace(cfg, num_layers=1)
    d, n, kv, h, f, s = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim, 384
    layer = {"wqkv_xd": sds(((n + 2 * kv) * h, d)), "wo_dx": sds((d, n * h)), "wgu_xd": sds((2 * f, d)),
             "wdown_df": sds((d, f))}
    vocab_rows = -(-cfg.vocab_size // decode.HEAD_ROWS) * decode.HEAD_ROWS
    weights = {"layers": (layer,), "embed_vd": sds((cfg.vocab_size, d)), "head_xd": sds((vocab_rows, d))}
    cache = {"k": (sds((b, s, kv, h)),), "v": (sds((b, s, kv, h)),)}
    impl = decode.DecodeLayerImpl.pallas_tma if tma else decode.DecodeLayerImpl.pallas
    settings = decode_tma.TmaSettings(projections=tma) if tma else None

    def step(weights, cache, tokens_b, pos_b):
        return decode._step_forward(weights, cache, tokens_b, pos_b, cfg=cfg, attn_impl=decode.DecodeAttentionImpl.pallas,
                                    layer_impl=impl, tma=settings)

    text = lower_for_cuda(step, weights, cache, sds((b,), jnp.int32), sds((b,), jnp.int32))
    assert text.count(TRITON_CALL) >= 1 + (not tma or "qkv" not in tma)  # (qkv_rope and) the attention
    assert text.count(MOSAIC_CALL) == (len(tma) if tma else 0)



def test_sample_kernel_lowers_for_hopper(as_h100):
    """scaling.kernels.sample with each mask (its while loops, radix rounds and scalar stores), a row
    in one program and in 31 (their barriers: atomics, the spin loop, volatile loads); the atomic
    exchange; 8K chunks with 16 warps."""
    from scaling.kernels.sample import sample_rows

    for top_k, use_top_p in ((None, False), (50, False), (None, True), (50, True)):
        for splits in (1, 31):
            fn = lambda lg, g, t, p, k=top_k, u=use_top_p, s=splits: sample_rows(  # noqa: E731
                lg, g, t, p, top_k=k, use_top_p=u, splits=s)
            text = lower_for_cuda(fn, sds((3, 32000), jnp.float32), sds((3, 32000), jnp.float32),
                                  sds((), jnp.float32), sds((), jnp.float32))
            assert text.count(TRITON_CALL) == 1
    # the partials by atomics; 8K chunks with 16 warps
    for kw in (dict(exchange=0), dict(chunk=8192, num_warps=16, splits=4)):
        fn = lambda lg, g, t, p, kw=kw: sample_rows(lg, g, t, p, top_k=50, **{"splits": 31, **kw})  # noqa: E731
        text = lower_for_cuda(fn, sds((3, 32000), jnp.float32), sds((3, 32000), jnp.float32),
                              sds((), jnp.float32), sds((), jnp.float32))
        assert text.count(TRITON_CALL) == 1


@pytest.mark.parametrize("causal", [True, False])
def test_mosaic_flash_attention_lowers_under_x64(as_h100, causal):
    """With jax_enable_x64 every Mosaic call had failed while tracing (lax.div of an int32 index
    and a Python int, which x64 made int64): forward, dK/dV and dQ now lower. (On an H200 the same
    calls ran under x64 with the gradients of an f32 reference: docs/attention.md.)"""
    q, kvs = sds((1, 256, 8, 128)), sds((1, 256, 2, 128))

    def loss(q, k, v):
        return flash_attention(q, k, v, causal=causal, backend="mosaic").astype(jnp.float32).sum()

    with jax.enable_x64(True):
        text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, kvs, kvs)
    assert text.count(MOSAIC_CALL) == 3


def test_mosaic_attention_kernels_carry_their_names_in_the_op_name(as_h100):
    """Mosaic GPU names every kernel `anonymous_mosaic_gpu_kernel`; a profile tells attention
    from other hand-written kernels by the op's name stack (scaling.profile_summary), which the
    flash_attention_fwd / _bwd scopes put there, forward and backward."""
    q, kvs = sds((1, 256, 8, 128)), sds((1, 256, 2, 128))

    def loss(q, k, v):
        return flash_attention(q, k, v, causal=True, backend="mosaic").astype(jnp.float32).sum()

    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, kvs, kvs)
    assert text.count(MOSAIC_CALL) == 3
    locs = [line for line in text.splitlines() if line.startswith("#loc") and "flash_attention_" in line]
    assert any("flash_attention_fwd" in line for line in locs) and any("flash_attention_bwd" in line for line in locs)
