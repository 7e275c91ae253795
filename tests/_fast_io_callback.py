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

The interpreter's own callbacks (functions of jax._src.pallas.mosaic_gpu.interpret and of the
shared thread_map) get more: numpy copies of XLA's host arrays, with no jax Array made at all.
Their code is numpy already (it reads indices with int(), keys with np.asarray, stores values
through np.array), except `shared_memory._to_int`, which accepts a jax Array or a Python int
and is widened here to numpy integers (int() of them, the value .item() gives). A copy, not a view:
the callback may keep what it is handed (a stored value, a thread's constants), and XLA may reuse
its buffer once the callback returns. That took the callbacks' argument handling (the transfer,
.item() and indexing of jax Arrays) out of the run: test_decode_megakernel.py alone from 198 to
172 s in one pytest process (-n0; forty-second session).
`plain()` runs jax's own io_callback_impl for a while (tests/test_speedups.py compares the two).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os

import jax
import numpy as np

_WRITTEN_FOR = "0.11.2"
_ORIGINAL = None
NUMPY_CALLS = [0]  # callbacks handed numpy arrays so far (tests/test_speedups.py looks)
# where the functions live whose arguments may be numpy arrays (see the module's docstring)
_NUMPY_MODULES = ("jax._src.pallas.mosaic_gpu.interpret.", "jax._src.pallas.mosaic.interpret.thread_map")


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

    def takes_numpy(callback):
        f = callback.callback_func
        while isinstance(f, functools.partial):
            f = f.func
        return getattr(f, "__module__", "").startswith(_NUMPY_MODULES)

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        del result_avals, sharding, ordered
        if numpy_ok and takes_numpy(callback):
            NUMPY_CALLS[0] += 1
            args = tuple(np.array(x) if isinstance(x, np.ndarray) and x.dtype in small else to_cpu(x)
                         for x in args)
        else:
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
    if [f.name for f in dataclasses.fields(cb._FlatCallback)] != ["callback_func", "in_tree"]:
        return False
    try:
        from jax._src.pallas.mosaic_gpu.interpret import shared_memory
    except ImportError:  # no GPU interpreter: its callbacks never run
        shared_memory = None
    numpy_ok = shared_memory is not None and callable(getattr(shared_memory, "_to_int", None))
    if numpy_ok:
        to_int = shared_memory._to_int

        @functools.wraps(to_int)
        def to_int_or_numpy(x):
            if isinstance(x, (np.ndarray, np.integer)) and np.ndim(x) == 0 and np.issubdtype(x.dtype, np.integer):
                return int(x)
            return to_int(x)

        shared_memory._to_int = to_int_or_numpy
    global _ORIGINAL
    _ORIGINAL = original
    cb.io_callback_impl = io_callback_impl
    return True


@contextlib.contextmanager
def plain():
    """jax's own io_callback_impl inside the block (a no-op where install() did nothing)."""
    if _ORIGINAL is None:
        yield
        return
    from jax._src import callback as cb

    fast = cb.io_callback_impl
    cb.io_callback_impl = _ORIGINAL
    try:
        yield
    finally:
        cb.io_callback_impl = fast
