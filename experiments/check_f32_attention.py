"""f32 attention on the GPU: our Pallas kernel at the model's matmul precision vs XLA's core.

    PYTHONPATH=. python3 experiments/check_f32_attention.py        # GPU (CPU: a small smoke run)

With f32 compute every matmul of the model runs at jax's default matmul precision (TF32 on
the tensor cores when it is unset); the kernel's f32 dots follow that setting
(`flash_attention.f32_dot_precision`). This prints, for the 1b's attention shapes, the output
and gradient errors of the kernel and of XLA's core at the default precision against XLA's core
at "highest" (full f32), and the forward + backward time of each.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp


def main() -> int:
    from scaling.attention import pallas_attention, xla_attention

    gpu = jax.default_backend() == "gpu"
    b, t, n, k, d = (1, 2048, 32, 8, 64) if gpu else (1, 256, 4, 2, 64)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, d), jnp.float32)
    kk = jax.random.normal(keys[1], (b, t, k, d), jnp.float32)
    v = jax.random.normal(keys[2], (b, t, k, d), jnp.float32)
    do = jax.random.normal(keys[3], (b, t, n, d), jnp.float32)

    def fwd_bwd(core):
        def f(q, kk, v):
            out, vjp = jax.vjp(lambda *a: core(*a, causal=True), q, kk, v)
            return (out, *vjp(do))
        return jax.jit(f)

    with jax.default_matmul_precision("highest"):
        ref = jax.block_until_ready(fwd_bwd(xla_attention)(q, kk, v))
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, B={b} T={t} N={n} K={k} D={d}, causal, "
          f"jax_default_matmul_precision={jax.config.jax_default_matmul_precision}")
    print("| core | out rel. err | dq | dk | dv | fwd+bwd ms |")
    print("|---|---|---|---|---|---|")
    for name, core in (("pallas (ours)", pallas_attention), ("xla", xla_attention)):
        fn = fwd_bwd(core)
        got = jax.block_until_ready(fn(q, kk, v))
        errs = [float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) for g, r in zip(got, ref)]
        reps = 10 if gpu else 2
        t0 = time.perf_counter()
        outs = [fn(q, kk, v) for _ in range(reps)]
        jax.block_until_ready(outs)
        ms = (time.perf_counter() - t0) / reps * 1e3
        print(f"| {name} | " + " | ".join(f"{e:.1e}" for e in errs) + f" | {ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
