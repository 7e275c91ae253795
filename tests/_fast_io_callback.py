"""A cheaper argument transfer for jax's io_callback, for the test run only.

Pallas' GPU interpreter (interpret mode of every Mosaic GPU kernel here) turns each load, store,
copy and barrier of a kernel into an io_callback. jax 0.11.2's io_callback_impl hands every
argument, which XLA already passes as a host numpy array, through `api.device_put` to make it a
jax Array on the CPU device: ~90 µs an argument, a third of the interpreter's own time and ~9%
of the whole suite's CPU time (py-spy over `./scripts/run test`, thirty-ninth session).

`install()` swaps in the same function with that transfer done by the call device_put ends in
(`xla_client.batched_device_put` on a single-device sharding, ~30 µs): the callback still gets
committed jax Arrays on the CPU device, of the same shapes, dtypes and values. Anything else
(a 64-bit array, which device_put would canonicalize; a non-array argument) goes through
device_put as before. The swap is made only for the jax it was written against and only once a
self-check has shown both paths give equal arrays; SCALING_TESTS_PLAIN_IO_CALLBACK=1 turns it off.
"""

from __future__ import annotations

import inspect
import logging
import os

import jax
import numpy as np

_WRITTEN_FOR = "0.11.2"


def install() -> bool:
    if os.environ.get("SCALING_TESTS_PLAIN_IO_CALLBACK") == "1" or jax.__version__ != _WRITTEN_FOR:
        return False
    from jax._src import api, config, core, tree_util
    from jax._src import callback as cb
    from jax._src import xla_bridge as xb
    from jax._src.lib import xla_client as xc
    from jax._src.sharding_impls import SingleDeviceSharding

    original = cb.io_callback_impl
    cpu = xb.local_devices(backend="cpu")[0]
    on_cpu = SingleDeviceSharding(cpu)
    small = {np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32,
                                   np.float16, np.float32, jax.numpy.bfloat16)}

    def to_cpu(x):
        if isinstance(x, np.ndarray) and x.dtype in small:
            return xc.batched_device_put(core.ShapedArray(x.shape, x.dtype), on_cpu, [x], [cpu], True)
        return api.device_put(x, cpu)

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        del result_avals, sharding, ordered
        args = tuple(to_cpu(x) for x in args)
        with config.default_device(cpu):
            try:
                return tree_util.tree_map(np.asarray, callback(*args))
            except BaseException:
                logging.getLogger(cb.__name__).exception("jax.io_callback failed")
                raise

    # the self-check: the same arrays as device_put for every dtype the fast path takes
    for dtype in small:
        for x in (np.asarray(3).astype(dtype), np.arange(6).reshape(2, 3).astype(dtype)):
            want, got = api.device_put(x, cpu), to_cpu(x)
            if (type(got) is not type(want) or got.dtype != want.dtype or got.shape != want.shape
                    or got.sharding != want.sharding or got._committed != want._committed
                    or not np.array_equal(np.asarray(got), np.asarray(want))):
                return False
    if list(inspect.signature(original).parameters) != ["args", "result_avals", "callback", "sharding", "ordered"]:
        return False
    cb.io_callback_impl = io_callback_impl
    return True
