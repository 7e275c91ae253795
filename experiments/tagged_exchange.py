"""Values that carry their own validity tag: an exchange between CTAs with no fence and no semaphore
(experiments/bench_group_exchange.py's `tagged` mode; measured, not used by the megakernel).

Why it was tried (docs/decoding.md, twenty-eighth session): the megakernel's long-cache plan has a
KV head's 16 CTAs exchange their softmax partials every layer. Behind a semaphore that round is a
chain of trips through L2: the partial's TMA store and its completion, the signal's release fence
and atomic, the wait, then the copy back.

Here every 32-bit word a writer stores carries the exchange's parity in its lowest bit; the reader
clears it again, so a value arrives with its last mantissa bit 0 (one unit in the last place at
most; a value whose last bit is 0 arrives exact). A reader polls the words themselves with
volatile loads until every one it holds shows the parity it expects. This is the idea of NCCL's
low-latency protocol (a flag beside the data in every 8 bytes), with the flag folded into each
word, which a 32-bit access always moves whole.

Why one bit is enough: a slot is written once per round, and a reader reads it once per round.
Before round r's write the slot holds round r - 1's value (parity differs) or, at the start,
zeros, which the caller makes the parity of "round -1" by starting at parity 1. A slot cannot still
hold round r - 2's value for a reader of round r: that reader already read round r - 1's there,
and a location's values are seen in one order (coherence). The caller zeroes the slots and orders
that before the first round.

Measured on an H200 (docs/benchmarks.md, twenty-eighth session): no faster than the semaphore's
round (2.9 against 2.4 µs with one CTA per SM, 1.56 against 1.63 µs with several). A round is bound
by how long a store takes to reach another SM's load, which both ways pay once. Polling one 16-byte
register at a time cost a trip per late partial (~10 µs a round); all of a thread's words are
re-read together. Built into the megakernel's grouped exchange (commit fbb2033, `xchg_tagged`), it was
level with the semaphore's too.

GPU only (inline PTX through `plgpu.inline_mgpu`); tests lower it for sm_90 on the CPU.
"""

from __future__ import annotations

import numpy as np


def _lin(idx, strides, i64):
    """An element's offset in elements from a memref's per-dimension indices (index type)."""
    from jax._src.lib.mlir.dialects import arith

    from jax.experimental.mosaic.gpu import utils

    off = None
    for i, s in zip(idx, strides):
        term = arith.muli(arith.index_cast(i64, i), utils.c(s, i64))
        off = term if off is None else arith.addi(off, term)
    return off


def _elements(reg):
    """A register (vector<n x f32>) as its n elements, bitcast to i32."""
    from jax._src.lib import mlir
    from jax._src.lib.mlir.dialects import arith, vector

    ir = mlir.ir
    i32 = ir.IntegerType.get_signless(32)
    n = ir.VectorType(reg.type).shape[0]
    as_int = vector.bitcast(ir.VectorType.get((n,), i32), reg)
    return [vector.extract(as_int, [], [k]) for k in range(n)]


def _ptrs(ref, layout, shape, lead=()):
    """(pointer, vector width) per register of an array of `shape` in `layout`, stored at ref[lead]."""
    from jax._src.lib import mlir

    from jax.experimental.mosaic.gpu import utils

    ir = mlir.ir
    i64, f32 = ir.IntegerType.get_signless(64), ir.F32Type.get()
    ty = ir.MemRefType(ref.type)
    strides, _ = ty.get_strides_and_offset()
    base = utils.memref_ptr(ref)
    lead_off = sum(i * s for i, s in zip(lead, strides))
    width = ir.VectorType(layout.registers_element_type(f32)).shape[0]
    out = []
    for idx in layout.thread_idxs(shape):
        off = _lin(idx, strides[len(lead):], i64)
        if lead_off:
            from jax._src.lib.mlir.dialects import arith

            off = arith.addi(off, utils.c(lead_off, i64))
        out.append(utils.getelementptr(base, [off], f32))
    return out, width


def _parity(par):
    from jax._src.lib.mlir.dialects import vector

    return vector.extract(par.registers.flat[0], [], [0])


def _load_ptx(regs, addr):
    """PTX reading len(regs) consecutive words at addr (a .b64 register) into regs, volatile (past L1;
    a weak load's poll never saw the store in 100 s, twenty-eighth session)."""
    if len(regs) == 1:
        return [f"ld.volatile.global.b32 {regs[0]}, [{addr}];"]
    return [f"ld.volatile.global.v{len(regs)}.b32 {{{', '.join(regs)}}}, [{addr}];"]


def _load_words(ptr, width, i32, utils):
    """One register's `width` words at ptr, by one volatile (vector) load: a list of i32 values."""
    lines = ["{", ".reg .b64 a;", f"mov.b64 a, ${width};"] + _load_ptx([f"${k}" for k in range(width)], "a") + ["}"]
    out = utils.inline_ptx("\n".join(lines), ptr, result_types=[i32] * width, has_side_effects=True)
    return list(out) if isinstance(out, tuple) else [out]


def _store_ptx(words, addr):
    if len(words) == 1:
        return [f"st.volatile.global.b32 [{addr}], {words[0]};"]
    return [f"st.volatile.global.v{len(words)}.b32 [{addr}], {{{', '.join(words)}}};"]


def store_fn(layout, shape):
    """inline_mgpu body: store x (f32, `shape` in `layout`) into ref, every word's lowest bit set to
    the parity (par: an i32 array, WG_STRIDED((128,), 1), the same value in every thread)."""

    def fn(ctx, ref, x, par):
        from jax._src.lib.mlir.dialects import arith

        from jax.experimental.mosaic.gpu import utils

        del ctx
        p = _parity(par)
        keep = utils.c(-2, p.type)  # (every bit but the lowest)
        ptrs, width = _ptrs(ref, x.layout, shape)
        for ptr, reg in zip(ptrs, x.registers.flat):
            words = [arith.ori(arith.andi(w, keep), p) for w in _elements(reg)]
            lines = ["{", ".reg .b64 a;", "mov.b64 a, $0;"]
            lines += _store_ptx([f"${k + 1}" for k in range(width)], "a") + ["}"]
            utils.inline_ptx("\n".join(lines), ptr, *words, has_side_effects=True)

    return fn


def load_fn(layout, shape, count):
    """inline_mgpu body: the `count` arrays ref[0..count) (f32, each `shape` in `layout`), polled until
    every word this thread holds shows the parity. All loads are issued before the first check, so
    the round costs one trip through L2 when the writers are done."""

    def fn(ctx, ref, par):
        from jax._src.lib import mlir
        from jax._src.lib.mlir.dialects import arith, vector

        from jax.experimental.mosaic import gpu as mgpu
        from jax.experimental.mosaic.gpu import utils

        del ctx
        ir = mlir.ir
        i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
        p = _parity(par)
        loads = []
        for k in range(count):
            ptrs, width = _ptrs(ref, layout, shape, lead=(k,))
            loads += [(ptr, width, _load_words(ptr, width, i32, utils)) for ptr in ptrs]
        # then all words checked at once, and all re-read while any lacks the parity (the re-reads of
        # one try in flight together: a register at a time would cost a trip per late partial)
        flat = [w for _, _, words in loads for w in words]
        flat = _poll(flat, [(ptr, width) for ptr, width, _ in loads], p, i32, utils, arith, ir)
        keep = utils.c(-2, i32)
        arrays, per, at = [], len(loads) // count, 0
        for k in range(count):
            regs = []
            for _, width, _ in loads[k * per:(k + 1) * per]:
                words = [arith.andi(w, keep) for w in flat[at:at + width]]  # (the tag cleared: last bit 0)
                at += width
                vec_i = vector.from_elements(ir.VectorType.get((width,), i32), words)
                regs.append(vector.bitcast(ir.VectorType.get((width,), f32), vec_i))
            arrays.append(mgpu.FragmentedArray(
                _registers=np.array(regs, dtype=object).reshape(layout.registers_shape(shape)),
                _layout=layout, _is_signed=None))
        return tuple(arrays)

    return fn


def _poll(words, regs, p, i32, utils, arith, ir):
    """The words, all re-read while any lacks the parity p in its lowest bit (a loop per thread)."""
    from jax._src.lib.mlir.dialects import scf

    types = [i32] * len(words)
    loop = scf.WhileOp(types, words)
    before = loop.before.blocks.append(*types)
    with ir.InsertionPoint(before):
        acc = None
        for w in before.arguments:
            x = arith.xori(w, p)
            acc = x if acc is None else arith.ori(acc, x)
        late = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(acc, utils.c(1, i32)), utils.c(0, i32))
        scf.condition(late, list(before.arguments))
    after = loop.after.blocks.append(*types)
    with ir.InsertionPoint(after):
        scf.yield_([w for ptr, width in regs for w in _load_words(ptr, width, i32, utils)])
    return list(loop.results)


def parity_array(parity):
    """The parity (a traced i32 scalar, 0 or 1) in the layout the store and load take."""
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.layout_cast(jnp.full((128,), parity, jnp.int32), plgpu.Layout.WG_STRIDED((128,), vec_size=1))


def tagged_store(ref, x, parity, layout):
    """Store x (f32, in the Pallas layout `layout`) into the global ref (of x's shape), tagged with
    `parity` (0 or 1, traced)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    fn = store_fn(layout.to_mgpu(), tuple(x.shape))
    plgpu.inline_mgpu(arg_types=(plgpu.RefType(), layout, plgpu.Layout.WG_STRIDED((128,), vec_size=1)))(fn)(
        ref, x, parity_array(parity))


def tagged_load(ref, parity, layout, shape, count):
    """The `count` arrays ref[0..count) (each f32 of `shape`, returned in `layout`), once every word
    shows `parity`: a tuple of arrays."""
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    fn = load_fn(layout.to_mgpu(), tuple(shape), count)
    ret = tuple(plgpu.ShapeDtypeStruct(tuple(shape), jnp.float32, layout=layout) for _ in range(count))
    return plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_STRIDED((128,), vec_size=1)),
                             return_type=ret)(fn)(ref, parity_array(parity))
