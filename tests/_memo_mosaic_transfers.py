"""A memo for one pure check in Mosaic GPU's layout inference, for the test run only.

The Hopper lowering tests (a kernel exported for sm_90a on this CPU machine) spend most of their
time in Mosaic GPU's layout inference, and a third of that in
`IsTransferableSmemRegisters._is_supported_smem_transfer`: each time the constraint solver asks
whether a register layout can be stored to (or loaded from) a shared-memory ref of some tiling,
jax 0.11.2 builds a throwaway function and plans the whole transfer in MLIR to find out. The
answer depends only on the constraint's shape, strides, bit width and transfer kind and on the
two layouts, and the solver asks the same questions thousands of times per kernel: ~40 of the
suite's ~1,700 CPU-seconds (py-spy over `./scripts/run test`, fortieth session).

`install()` wraps the method in a dictionary keyed on exactly those inputs. 8-bit transfers are
not memoized (their answer also depends on the target's architecture). Installed only for the jax
it was written against, with the method's signature checked; SCALING_TESTS_PLAIN_MOSAIC=1 turns
it off.
"""

from __future__ import annotations

import functools
import inspect
import os

import jax

_WRITTEN_FOR = "0.11.2"


def install() -> bool:
    if os.environ.get("SCALING_TESTS_PLAIN_MOSAIC") == "1" or jax.__version__ != _WRITTEN_FOR:
        return False
    try:
        from jax.experimental.mosaic.gpu import constraints
    except ImportError:  # a jaxlib without Mosaic GPU: nothing to speed up
        return False
    cls = constraints.IsTransferableSmemRegisters
    original = cls._is_supported_smem_transfer
    if list(inspect.signature(original).parameters) != ["self", "smem_layout", "reg_layout"]:
        return False
    memo: dict = {}

    @functools.wraps(original)
    def memoized(self, smem_layout, reg_layout):
        if self.bitwidth == 8:
            return original(self, smem_layout, reg_layout)
        key = (self.shape, self.strides, self.bitwidth, self.optimized, smem_layout, reg_layout)
        try:
            return memo[key]
        except KeyError:
            pass
        except TypeError:  # something unhashable: ask every time
            return original(self, smem_layout, reg_layout)
        memo[key] = answer = original(self, smem_layout, reg_layout)
        return answer

    cls._is_supported_smem_transfer = memoized
    return True
