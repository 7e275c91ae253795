"""A memo for one pure check in Mosaic GPU's layout inference, for the test run only.

The Hopper lowering tests (a kernel exported for sm_90a on this CPU machine) spend most of their
time in Mosaic GPU's layout inference, and a third of that in
`IsTransferableSmemRegisters._is_supported_smem_transfer`: each time the constraint solver asks
whether a register layout can be stored to (or loaded from) a shared-memory ref of some tiling,
jax 0.11.2 builds a throwaway function and plans the whole transfer in MLIR to find out. The
answer depends only on the constraint's shape, strides, bit width and transfer kind and on the
two layouts, and the solver asks the same questions thousands of times per kernel: ~40
CPU-seconds of the suite, ~2% (py-spy over `./scripts/run test`, thirty-ninth session); the
suite's wall time went from 857 to 832 s with it (fortieth session).

`install()` wraps the method in a dictionary keyed on exactly those inputs. 8-bit transfers are
not memoized (their answer also depends on the target's architecture). Installed only for the jax
it was written against, with the method's signature checked; SCALING_TESTS_PLAIN_MOSAIC=1 turns
it off. `plain()` lowers without it for a while (tests/test_speedups.py compares the two).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os

import jax

_WRITTEN_FOR = "0.11.2"
MEMO: dict = {}  # (shape, strides, bitwidth, transfer kind, smem transforms, register layout) -> answer
_ORIGINAL = None


def install() -> bool:
    if os.environ.get("SCALING_TESTS_PLAIN_MOSAIC") == "1" or jax.__version__ != _WRITTEN_FOR:
        return False
    try:
        from jax.experimental.mosaic.gpu import constraints
    except ImportError:  # a jaxlib without Mosaic GPU: nothing to speed up
        return False
    global _ORIGINAL
    cls = constraints.IsTransferableSmemRegisters
    original = cls._is_supported_smem_transfer
    if list(inspect.signature(original).parameters) != ["self", "smem_layout", "reg_layout"]:
        return False
    memo = MEMO

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
    _ORIGINAL = original
    return True


@contextlib.contextmanager
def plain():
    """Mosaic GPU's own check, unmemoized, inside the block (a no-op where install() did nothing)."""
    if _ORIGINAL is None:
        yield
        return
    from jax.experimental.mosaic.gpu import constraints

    cls = constraints.IsTransferableSmemRegisters
    memoized = cls._is_supported_smem_transfer
    cls._is_supported_smem_transfer = _ORIGINAL
    try:
        yield
    finally:
        cls._is_supported_smem_transfer = memoized
