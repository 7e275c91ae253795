"""Does `attention.cudnn_unsupported` name exactly the calls cuDNN's flash attention refuses?

    python experiments/check_cudnn_limits.py [--head-dims 8,16,...] [--dtypes bfloat16,float16,float32]

`auto` attention leaves to XLA's core what cudnn_unsupported says cuDNN cannot take, and
`impl=cudnn` refuses it by name. Its limits were read from jax's source (check_is_flash_attention).
This runs jax.nn.dot_product_attention(implementation="cudnn"), forward and backward, causal, for
each dtype and head dim on this GPU, and sets the outcome beside the prediction. Exit 1 if any
disagree: a call predicted to run that fails, or one predicted refused that runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

DEFAULT_DIMS = "8,16,32,40,64,72,80,96,100,120,128,136,144,160,192,200,256,264"
DEFAULT_DTYPES = "bfloat16,float16,float32"


def run_cudnn(dtype: str, head_dim: int) -> str | None:
    """None if cuDNN ran forward + backward on (B 1, T 128, 2 heads, head_dim), else the error."""
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.key(0), 4)
    shape = (1, 128, 2, head_dim)
    q, k, v, do = (jax.random.normal(key, shape, jnp.dtype(dtype)) for key in ks)

    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    try:
        out, vjp = jax.vjp(f, q, k, v)
        jax.block_until_ready((out, vjp(do)))
    except Exception as e:  # noqa: BLE001 - the outcome is what we record
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return None


def compare(dtypes: list[str], dims: list[int], run: Callable[[str, int], str | None],
            predict: Callable[[str, int], str | None]) -> list[dict]:
    """One row per (dtype, head dim): what cuDNN did, what cudnn_unsupported said, and whether they agree."""
    rows = []
    for dtype in dtypes:
        for d in dims:
            error, reason = run(dtype, d), predict(dtype, d)
            rows.append({"dtype": dtype, "head_dim": d, "runs": error is None, "predicted_runs": reason is None,
                         "agree": (error is None) == (reason is None), "error": error, "reason": reason})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dims", default=DEFAULT_DIMS)
    p.add_argument("--dtypes", default=DEFAULT_DTYPES)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    try:
        dims = [int(x) for x in args.head_dims.split(",") if x.strip()]
    except ValueError:
        p.error(f"--head-dims {args.head_dims!r}: comma-separated integers")
    if not dims or min(dims) < 1:
        p.error(f"--head-dims {args.head_dims!r}: integers >= 1")
    dtypes = [x.strip() for x in args.dtypes.split(",") if x.strip()]
    if bad := [x for x in dtypes if x not in ("bfloat16", "float16", "float32")]:
        p.error(f"--dtypes: {bad} not among bfloat16, float16, float32")

    import jax
    import jax.numpy as jnp

    from scaling.attention import cudnn_unsupported

    if jax.default_backend() != "gpu":
        print("error: needs a GPU (cuDNN)", file=sys.stderr)
        return 2
    rows = compare(dtypes, dims, run_cudnn, lambda dt, d: cudnn_unsupported(jnp.dtype(dt), d))
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| dtype | head dim | cuDNN ran | predicted | agree | cuDNN's error |\n|---|---:|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['head_dim']} | {'yes' if r['runs'] else 'no'} | "
              f"{'yes' if r['predicted_runs'] else 'no'} | {'yes' if r['agree'] else '**NO**'} | {r['error'] or ''} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)
    bad = [r for r in rows if not r["agree"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} agree")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
