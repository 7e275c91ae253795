"""A whole batch-1 decode step of a Llama model as one persistent Mosaic GPU kernel (Hopper).

Why (docs/decoding.md, "Fifteenth session" and "Sixteenth session"): at batch 1 a step's time
should be its bytes (weights + KV cache) over the memory bandwidth. The decoder's layers are
separate kernels, each paying a start and a tail, and the narrow projections leave SMs idle. The
fifteenth session streamed a model's whole GEMV chain at 94-97% of the copy bandwidth (7b) as one
kernel whose phases are spread evenly over all SMs and meet at a global-semaphore grid barrier.
This kernel is that chain with the rest of the step added, so a step is one launch.

The step, per layer, as five phases (each waits until every CTA has finished the one before):
  qkv      y = W_qkv x, x = the layer's input h (RMSNorm's scale folded into W_qkv's columns,
           decode_gemv.fold_norm; its statistic r = rsqrt(mean(h²) + eps) is applied later: W (r h)
           = r (W h), so no CTA waits for it before its products; each attention unit computes it)
  attn     one unit per KV head: RoPE on the head's q and k, the new k/v row (scaled by r, which
           the unit computes meanwhile) written into the cache (for the next steps), then
           softmax(r q Kᵀ / √H) V (r applied to the scores): the positions
           before pos from the cache in [64, 2H] tiles holding K and V (streamed by the producer
           before the phase starts: they do not depend on this step), two tiles per step of an
           online softmax on the tensor cores (scores over K's columns, outputs over V's); then
           the new position from registers. RoPE's rotate-half partners need no exchange between
           threads: the q/k/v phase stores each q and k head twice over, [v | v], and a load of H
           values from H / 2 on is [x2, x1].
           (block_k = 4 H, `MegaPlan.ppr` 2: a cache row holds two positions, a tile 128, the
           even and odd ones as two softmax streams in the q operand's columns 0..G-1 and G..2G-1,
           merged per head; the 1b's head_dim 64 then streams its weights at block_k 256)
           (attn_splits > 1: each KV head's positions split over several units, whose partials
           [m | l | o] a `combine` phase merges; one more barrier)
  out      h1 = h + W_o attn
           (fuse_out: attention and out as one phase: one group of CTAs per KV head, each computing
           its head's attention, then its share of the row tiles of W_o's K step for that head;
           group_splits: the head's positions split over the group's members, whose partials each
           member merges behind a semaphore of the group's own, for long caches)
  gate_up  y = W_gu h1 (the MLP norm's scale folded, its statistic applied by the next phase)
  down     h2 = h1 + W_down (silu(r g) * (r u))
           (fuse_mlp: gate/up and down as one phase: the MLP's hidden units in slices of 64, one CTA
           per slice, which computes all of its gate and up, the SwiGLU, and its product with W_down's
           columns for the slice, reduce-added into h2; W_down stored slice-major, `down_slices`)
then the head: logits = W_head h2, unscaled (the final norm's statistic is written beside them;
the caller multiplies, which leaves argmax unchanged anyway).

The GEMV phases are bench_streamk_chain.py's: one unit = one [64, block_k] weight tile (row tile
t, K step j, numbered g = t * steps + j, weights stored unit-major so a unit is contiguous); CTA c
takes units [c G / C, (c + 1) G / C) of the phase's G ("stream-K", Osama et al., PPoPP 2023) and
adds its f32 partial of each row tile into the phase's output by a TMA reduce-add; the CTA whose
share holds a tile's first K step also adds the residual. A producer warpgroup streams every
weight tile (and, in the attention phase, every cache tile) of the CTA's whole step through a
TMA ring and never waits at a grid barrier, only for ring slots. x chunks (f32, from the flat
activation buffer) arrive by TMA into a small ring of stages and are rounded to bf16 into column 0
of the wgmma operand just before their first product (`lazy_x`; with `one_operand`, before every
product, into one slot, which leaves the shared memory for a deeper ring).

Activations live in one flat f32 buffer the kernel returns (`MegaPlan` gives the offsets):
the final norm's statistic, the step's input h, then per layer q/k/v (q and k twice), the attention output, h1,
gate/up (not with fuse_mlp) and h2, then the logits. Every region except the input is zeroed by
the kernel at its start; each is written in one phase and only read after, so the statistics'
reads can run while a CTA waits at a barrier.

Interpret mode (CPU tests): Pallas' GPU interpreter with one CTA (which then runs every unit in
order; the global semaphores have no interpret mode and are left out), the wgmma replaced by a dot
of the same operands and the TMA reduce-add by a read, add and write. The reference is
`megakernel_reference` (pure jnp, same rounding points); tests/test_decode_megakernel.py also
checks it against the decoder's XLA step.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scaling.kernels.flash_attention_mgpu import interpret_params

ROWS = 8  # wgmma's N: batch 1 is column 0 of the activation operand (or heads 0..G-1 in attention)
BLOCK_F = 64  # weight rows per unit (wgmma's M); also cache positions per attention tile
PAD = 256  # regions of the flat buffer start at multiples of this many f32 (a TMA box's longest side)
NO_ROW = 2.0**30  # (loop's argmax) no row: larger than every row number, exact in f32
SMEM_BYTES = 232448  # shared memory per CTA on sm_90 (227 KiB)
MOSAIC_RESERVED = 2048  # Mosaic GPU's own reduction scratch, beyond the kernel's buffers (MegaPlan.smem_bytes)
MAX_GATHERED = 16  # (grouped) partials a member gathers: their m and l, 2 * ROWS floats each, in one TMA copy of <= 256
NEG = -1e30  # a masked score: exp(NEG - m) is 0 for any real m, and NEG - NEG is no NaN
PROFILE_EVENTS = 512  # profiled regions per warpgroup (a 32-layer step records ~390 per consumer)
PROFILE_BYTES = 2 * 16 * PROFILE_EVENTS  # the profiler's buffer: 4 i32 per region, two warpgroups


def _pad(n: int) -> int:
    return -(-n // PAD) * PAD


@dataclasses.dataclass(frozen=True)
class MegaPlan:
    """The static shape of one step: the model's sizes, the tiling and the flat buffer's layout."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab_rows: int  # the head's rows (the vocabulary, padded to a multiple of 64)
    max_len: int
    eps: float
    block_k: int = 256
    stages: int = 3
    x_stages: int = 8
    ctas: int = 132
    # the MLP norm's statistic read issued before a CTA signals its gate/up units and summed
    # after the barrier, instead of read between the signal and the wait (with the attention
    # norm's too: +2-3% on the 1b at block_k 128, level with paired positions and on the 7b,
    # docs/benchmarks.md, seventeenth session; the attention units now compute theirs themselves)
    norm_prefetch: bool = False
    # attention units per KV head: the positions before pos split into this many contiguous runs
    # of 64-position blocks, one unit each, combined by a phase of their own (one more barrier);
    # for long caches, where one CTA per KV head reads them one tile after another (at 2048
    # positions 83% -> 92% of the copy bandwidth on the 7b; <1% slower at 128)
    attn_splits: int = 1
    # the output projection's units spread over the CTAs that run no attention (or combine) unit:
    # those are the last to reach the phase, and its weights are already in the others' rings
    # (measured: level on the 1b, 0.7% slower on the 7b)
    out_skips_attn: bool = False
    # attention and the output projection as one phase (one barrier and the attention output's
    # round trip through global memory fewer per layer): the CTAs form one group per KV head
    # (`out_group` each); every CTA of a group computes its head's attention and multiplies it by
    # its share of the head's W_o columns, one K step of block_k = G H (the 1b at block_k 256) or
    # several (`out_ksteps`: tinyllama_1.1b's G H = 512 at block_k 128)
    fuse_out: bool = False
    # gate/up and down as one phase (one barrier fewer per layer): the MLP's hidden units in
    # slices of 64, one CTA per slice, which computes the slice's gate and up over all of h1,
    # its SwiGLU, and its product with W_down's 64 columns for the slice, reduce-added into h2
    # (W_down stored slice-major, `down_slices`); for models whose slices spread evenly over the
    # CTAs (the 1b: 128 slices on 132 SMs)
    fuse_mlp: bool = False
    # ring slots a CTA frees only after it signals the phase they end: the signal's release fence
    # waits for the CTA's TMA loads in flight (the producer refills freed slots at once): 1.7-2.4
    # kcycles per signal at 2 stages, 2.9-3.7 at 3-4 (the 1b on the H200; docs/decoding.md,
    # nineteenth session); held, those loads are issued after the signal, while the CTA waits
    hold_slots: int = 0
    # the attention norm's statistic computed by every CTA after it signals its q/k/v units, from
    # all of h's chunks in the x stages (the gemv's own and the rest, loaded from the phase's start),
    # instead of by each attention unit on its critical path; where the chunks fit the stages
    norm_in_qkv: bool = False
    # one operand slot: every unit rounds its x chunk from the x stages into it just before its
    # product, instead of each chunk's operand kept from its first use (9 slots of 4 KiB for the
    # 1b): the shared memory of one more ring slot. Needs every x the GEMVs read to fit the x
    # stages whole (K / block_k <= x_stages; the MLP fused, whose down projection's K does not)
    one_operand: bool = False
    # (fuse_mlp) slice i's down units in the order i, i + 1, ... (mod K steps) instead of 0, 1, ...:
    # every CTA reduce-adds its down units into h2 at about the same moment, so in that order all
    # 128 of the 1b's add into the same 256 floats at once; rotated, each chunk of h2 takes a
    # sixteenth of them. Measured within the runs' spread on the H100 and the H200
    # (docs/benchmarks.md, twenty-second session): contention in L2's adds is not what the MLP's
    # signal waits for
    down_rotate: bool = False
    # attention's q/k/v read by the consumer warpgroup's own loads instead of TMA copies: they come
    # from L2 right after the q/k/v barrier, on attention's critical path, where TMA copies queue in
    # the SM's TMA unit behind the producer's weight tiles (with norm_in_qkv, the 1b on the H200:
    # 1.005-1.03x in two runs, attention's median CTA 8.9 -> 6.8 kcycles; docs/benchmarks.md,
    # twenty-second session)
    qkv_ld: bool = False
    # (fuse_out) CTAs per KV head's group; 0: as many as the CTAs give every KV head (ctas // kv_heads).
    # More than that runs several units on a CTA (the interpreter's one CTA runs them all)
    group_ctas: int = 0
    # (fuse_out) a KV head's positions before pos split over up to this many members of its group
    # (0 or 1: none; each member then reads them all): member j < S = min(group_splits, tiles) reads
    # the j-th run of S, writes its partial (m, l, o) to the exchange buffer and signals its group's
    # semaphore; every member waits for its group and merges the S partials itself. For long
    # caches, where each member would otherwise read all of its head's tiles one after another,
    # without the two extra grid barriers of attn_splits' combine phase
    group_splits: int = 0

    @property
    def out_group(self) -> int:
        """(fuse_out) CTAs per KV head: each computes the head's attention, then its share of
        the row tiles of W_o's K step for that head."""
        return self.group_ctas or max(1, self.ctas // self.kv_heads)

    @property
    def out_ksteps(self) -> int:
        """(fuse_out) W_o's K steps per KV head: its G q heads' G H values over block_k (1 for the
        1b; tinyllama_1.1b's 8 heads of 64 at block_k 128: 4, each row tile of W_o then takes four
        ring slots and the heads' outputs four operand slots)."""
        return max(1, self.groups * self.head_dim // self.block_k) if self.fuse_out else 1

    @property
    def grouped(self) -> bool:
        """(fuse_out with group_splits > 1) a group's members split its positions and exchange partials."""
        return self.fuse_out and self.group_splits > 1

    @property
    def gathered(self) -> int:
        """(grouped) Partials a member reads at once: group_splits (1 otherwise: a placeholder)."""
        return self.group_splits if self.grouped else 1

    @property
    def xchg_entries(self) -> int:
        """(grouped) The exchange buffers' partials, one per (KV head, member) in that order, then
        at least gathered - 1 more (a whole number of `gathered`, which the kernel zeroes at its
        start): a member that reads only its own (the cache holds one tile) copies `gathered` from
        its own on, which stays inside, and every one it copies is finite."""
        n = self.gathered
        return -(-(self.kv_heads * self.out_group + n - 1) // n) * n if self.grouped else 1

    def out_tiles(self, member):
        """(fuse_out) [a, b): the row tiles of W_o that member m of a KV head's group takes."""
        t, n = self.hidden // BLOCK_F, self.out_group
        return member * t // n, (member + 1) * t // n

    @property
    def res_tiles(self) -> int:
        """Residual tiles a CTA holds at once: one, or (fuse_out) a member's row tiles."""
        return -(-(self.hidden // BLOCK_F) // self.out_group) if self.fuse_out else 1

    @property
    def attn_ctas(self) -> int:
        """CTAs 0.. that run an attention unit (and, with attn_splits > 1, a combine)."""
        units = self.kv_heads * self.attn_splits
        return min(self.ctas, max(units, self.heads) if self.attn_splits > 1 else units)

    @property
    def out_first_cta(self) -> int:
        return self.attn_ctas if self.out_skips_attn else 0

    @property
    def ppr(self) -> int:
        """Cache positions per cache row: one [64, block_k] ring slot holds 64 rows of [K | V]
        (2 H values) per position, so block_k = 4 H pairs positions 2R and 2R + 1 in row R (the 1b's
        head_dim 64 at block_k 256). Its attention then reads 128 positions per tile: the even and
        odd positions as two softmax streams in the operand's columns G.. (merged per head)."""
        return self.block_k // (2 * self.head_dim)

    @property
    def tile_positions(self) -> int:  # cache positions per attention tile
        return BLOCK_F * self.ppr

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        """The kernel's cache, `pack_cache` of [L, S, KV heads, 2H]."""
        return self.layers, self.max_len // self.ppr, self.kv_heads, 2 * self.head_dim * self.ppr

    @property
    def phases_per_layer(self) -> int:
        return (4 if self.fuse_out else 5 + (self.attn_splits > 1)) - self.fuse_mlp

    @property
    def groups(self) -> int:  # q heads per KV head
        return self.heads // self.kv_heads

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def qkv_stored(self) -> int:
        """The q/k/v region's floats: each q and k head stored twice over, [v | v], so that a load
        of H values from H / 2 on is RoPE's rotate-half partner of v; v once."""
        return self.qkv_rows + (self.heads + self.kv_heads) * self.head_dim

    def qkv_at(self, row):
        """Where q/k/v's output row `row` (its first copy) sits in the q/k/v region (a traced row too)."""
        hd, qk = self.head_dim, (self.heads + self.kv_heads) * self.head_dim
        return jnp.where(row < qk, row // hd * 2 * hd + row % hd, row + qk)

    # flat buffer: [r_final, then zeros | h_in | layer 0 | layer 1 | ... | logits]; per layer
    # [qkv | parts (attn_splits > 1) | attn | h1 | gate_up (not with fuse_mlp) | h2], so layer l's input is the region
    # just before its block
    r_off = 0
    zero_off = 64  # 64 zeros (the residual of a partial that is not a tile's first K step)

    @property
    def x_off(self) -> int:
        return PAD

    def _layer_regions(self) -> dict[str, int]:
        off, regions = 0, {}
        parts = self.attn_splits * self.heads * self.block_k if self.attn_splits > 1 else 0
        gate_up = 0 if self.fuse_mlp else 2 * self.mlp  # (fuse_mlp keeps gate/up in registers: nothing to zero)
        for name, n in (("qkv", self.qkv_stored), ("parts", parts), ("attn", self.heads * self.head_dim),
                        ("h1", self.hidden), ("gate_up", gate_up), ("h2", self.hidden)):
            regions[name] = off
            off += _pad(n)
        regions["stride"] = off
        return regions

    @property
    def layer0(self) -> int:
        return self.x_off + _pad(self.hidden)

    @property
    def stride(self) -> int:
        return self._layer_regions()["stride"]

    def region(self, name: str, layer) -> int:
        """Offset of a layer's region ("in": its input h, the previous layer's h2 or the step's x)."""
        if name == "in":
            return self.layer0 + layer * self.stride - _pad(self.hidden)
        return self.layer0 + layer * self.stride + self._layer_regions()[name]

    @property
    def logits_off(self) -> int:
        return self.layer0 + self.layers * self.stride

    @property
    def total(self) -> int:
        return self.logits_off + _pad(self.vocab_rows)

    def gemvs(self) -> dict[str, tuple[int, int]]:
        """(rows, K) of each projection."""
        d, f = self.hidden, self.mlp
        return dict(qkv=(self.qkv_rows, d), out=(d, self.heads * self.head_dim), gate_up=(2 * f, d), down=(d, f),
                    head=(self.vocab_rows, d))

    def units(self, name: str) -> int:
        n, k = self.gemvs()[name]
        return n // BLOCK_F * (k // self.block_k)

    @property
    def up_stages(self) -> int:
        """Stages of the unfused down phase's up chunks (and norm_prefetch's second half); fuse_mlp
        needs none (one is kept: a scratch shape)."""
        return 1 if self.fuse_mlp and not self.norm_prefetch else self.x_stages

    def x_slots(self) -> int:
        """Operand slots a CTA holds at once: the K chunks its units of one phase touch, at most."""
        if self.one_operand:  # (fuse_out: the heads' outputs, one slot per K step of W_o)
            return self.out_ksteps
        n = max(min(k // self.block_k, -(-self.units(name) // self.ctas) + 1)
                for name, (_, k) in self.gemvs().items())
        n = max(n, self.out_ksteps)
        return max(n, self.hidden // self.block_k) if self.fuse_mlp else n  # (fuse_mlp: all of h1)

    def smem_bytes(self, profile: bool = False) -> int:
        """Shared memory per CTA as Mosaic GPU (jax 0.11.2) lays it out: `_launch`'s scratch buffers
        each at a 1 KiB boundary, then its barriers (8 bytes each), then 2 KiB of its own reduction
        scratch. Exact on nine plans of five presets, grouped or not (lowered past the limit, whose
        error names the size; docs/decoding.md, thirtieth session). profile: with the on-device
        profiler's buffer."""
        total = MOSAIC_RESERVED + (PROFILE_BYTES if profile else 0)
        for kind, shape, dtype, _ in scratch_buffers(self):  # (the input's row: f32, its widest)
            if kind == "smem":
                total += -(-math.prod(shape) * jnp.dtype(dtype).itemsize // 1024) * 1024
            else:
                total += 8 * shape
        return total

    def check(self) -> None:
        """Raise ValueError naming what this kernel cannot run."""
        bk, hd = self.block_k, self.head_dim
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.groups > ROWS:  # (its q heads are the q operand's columns)
            raise ValueError(f"at most {ROWS} q heads per KV head (wgmma's N), got {self.groups}")
        if hd % 64:  # (its vectors: whole 64-row tiles of the wgmma register layout)
            raise ValueError(f"head_dim must be a multiple of 64, got {hd}")
        if bk not in (2 * hd, 4 * hd):
            raise ValueError(f"a cache tile of 64 rows of 1 or 2 positions' [K | V] is one ring slot: block_k must be "
                             f"2 * head_dim = {2 * hd} or 4 * head_dim = {4 * hd}, got {bk}")
        if self.ppr == 2 and 2 * self.groups > min(ROWS, self.x_stages):
            raise ValueError(f"block_k = 4 * head_dim puts the even and odd positions' q heads in separate operand "
                             f"columns: at most {min(ROWS, self.x_stages) // 2} q heads per KV head (wgmma's N; "
                             f"x_stages / 2), got {self.groups}")
        for name, (n, k) in self.gemvs().items():
            if n % BLOCK_F or k % bk:
                raise ValueError(f"{name}: W {n}x{k} needs rows a multiple of {BLOCK_F} and K of block_k={bk}")
        if self.norm_prefetch and self.hidden // bk > 2 * self.x_stages:
            raise ValueError(f"norm_prefetch holds all of h in the x and up stages: hidden / block_k = "
                             f"{self.hidden // bk} must be <= 2 * x_stages = {2 * self.x_stages}")
        if self.fuse_out and (self.attn_splits > 1 or self.out_skips_attn or self.groups * hd % bk):
            raise ValueError(f"fuse_out needs attn_splits=1, out_skips_attn off and a KV head's q heads to be whole K "
                             f"steps of W_o: groups * head_dim = {self.groups * hd} a multiple of block_k = {bk}")
        if self.group_ctas < 0 or self.group_splits < 0:
            raise ValueError(f"group_ctas and group_splits must be >= 0, got {self.group_ctas}, {self.group_splits}")
        if self.group_splits > 1 and not self.fuse_out:
            raise ValueError("group_splits splits the positions within fuse_out's groups: it needs fuse_out")
        if self.group_splits > MAX_GATHERED:
            raise ValueError(f"group_splits={self.group_splits}: at most {MAX_GATHERED} (a member reads the partials' "
                             f"m and l, 2 x 8 floats each, in one TMA copy of at most 256)")
        if self.group_splits > self.out_group:
            raise ValueError(f"group_splits={self.group_splits} must be at most the group's {self.out_group} CTAs "
                             f"(group_ctas, or ctas // kv_heads)")
        if self.fuse_out and self.res_tiles > 32:
            raise ValueError(f"fuse_out: {self.res_tiles} residual tiles per CTA, at most 32: more CTAs")
        if self.fuse_mlp and self.hidden // bk > self.x_stages:
            raise ValueError(f"fuse_mlp holds all of h1 in the x stages: hidden / block_k = {self.hidden // bk} must "
                             f"be <= x_stages = {self.x_stages}")
        if self.fuse_mlp and bk // BLOCK_F > ROWS:
            raise ValueError(f"fuse_mlp puts a down unit's {bk // BLOCK_F} row tiles in the operand's {ROWS} columns: "
                             f"block_k must be <= {ROWS * BLOCK_F}, got {bk}")
        if self.norm_in_qkv and self.hidden // bk > self.x_stages:
            raise ValueError(f"norm_in_qkv holds all of h in the x stages: hidden / block_k = {self.hidden // bk} must "
                             f"be <= x_stages = {self.x_stages}")
        # (the K of every GEMV phase it runs: h for q/k/v and the head; unfused, W_o's attention output)
        k_most = max(self.hidden, 0 if self.fuse_out else self.heads * self.head_dim)
        if self.one_operand and (not self.fuse_mlp or k_most // bk > self.x_stages):
            raise ValueError(f"one_operand rounds each unit's x chunk from the x stages: it needs fuse_mlp and the "
                             f"GEMVs' K / block_k = {k_most // bk} <= x_stages = {self.x_stages}")
        if self.down_rotate and not self.fuse_mlp:
            raise ValueError("down_rotate orders the fused MLP's down units: it needs fuse_mlp")
        if not 0 <= self.hold_slots <= self.stages:
            raise ValueError(f"hold_slots must be 0..stages={self.stages}, got {self.hold_slots}")
        if self.out_skips_attn and self.attn_ctas >= self.ctas:
            raise ValueError(f"out_skips_attn needs CTAs beyond the {self.attn_ctas} that run attention, got "
                             f"ctas={self.ctas}")
        if not 1 <= self.attn_splits <= self.x_stages:
            raise ValueError(f"attn_splits must be 1..x_stages={self.x_stages} (the combine holds one partial per "
                             f"split in the x stages), got {self.attn_splits}")
        if self.max_len % self.tile_positions:
            raise ValueError(f"max_len={self.max_len} must be a multiple of {self.tile_positions} (an attention tile's "
                             f"positions)")
        if self.x_slots() > 32 or max(self.stages, self.x_stages) > 32:
            raise ValueError("at most 32 barriers per group: more CTAs, or fewer stages")
        if (need := self.smem_bytes()) > SMEM_BYTES:
            raise ValueError(f"needs {need} bytes of shared memory, more than {SMEM_BYTES}: fewer stages "
                             f"(stages={self.stages}, x_stages={self.x_stages}) or more CTAs")


def loop_check(plan: MegaPlan) -> None:
    """What megakernel_loop needs beyond the plan's own check: x stages for the pick
    (loop_layout)."""
    plan.check()
    loop_layout(plan, 1)


def loop_layout(plan: MegaPlan, steps: int) -> dict:
    """megakernel_loop's flat buffer: two copies of the step's buffer (plan.total each), then per
    step its logits, the final norm's statistic r, its token (as f32), and each CTA's best logit
    and row in 4-float slots (every CTA writes slots c, c + ctas, ...: the pick reads whole
    chunks). Offsets in f32; "view": the length of a step's view from its copy's start."""
    bk = plan.block_k
    slots = -(-plan.ctas * 4 // bk) * bk // 4
    if 2 * (slots * 4 // bk) > plan.x_stages:
        raise ValueError(f"megakernel_loop: {plan.ctas} CTAs' best logits and rows need "
                         f"{2 * (slots * 4 // bk)} x stages, the plan has x_stages={plan.x_stages}")
    out, off = {"slots": slots}, 2 * plan.total
    for name, stride in (("logits", _pad(plan.vocab_rows)), ("r", 16), ("token", 16), ("best", slots * 4),
                         ("row", slots * 4)):
        out[name], out[name + "_stride"] = off, stride
        off += steps * stride
    out["view"] = off
    out["size"] = off + plan.total  # (the second copy's view reaches one copy past the end)
    return out


def cta_span(c, units: int, ctas: int, first: int = 0):
    """[a, b): the stream-K share of CTA c of a phase's units, spread evenly over CTAs first..C-1
    (empty for the CTAs before first)."""
    n = ctas - first
    k = c - first
    a, b = k * units // n, (k + 1) * units // n
    if isinstance(c, int):
        return (a, b) if k >= 0 else (0, 0)
    return jnp.where(k >= 0, a, 0), jnp.where(k >= 0, b, 0)


def default_block_k(cfg, x_stages: int) -> int:
    """2 head_dim (a cache tile is 64 positions), or 256 where head_dim is 64 and the q heads fit
    the paired positions' columns: the GEMVs' tiles then carry twice the bytes per unit (the 7b's
    block_k), which the 1b's steps need (docs/decoding.md, "Seventeenth session")."""
    hd, groups = cfg.resolved_head_dim, cfg.num_heads // cfg.num_kv_heads
    ks = (cfg.hidden_size, cfg.mlp_dim, cfg.num_heads * hd)
    if 4 * hd == 256 and 2 * groups <= min(ROWS, x_stages) and all(k % 256 == 0 for k in ks):
        return 256
    return 2 * hd


def plan_for(cfg, max_len: int, *, vocab_rows: int | None = None, **kw) -> MegaPlan:
    """The plan of a ModelConfig's step with a cache of max_len positions."""
    hd = cfg.resolved_head_dim
    if "block_k" not in kw:
        kw["block_k"] = default_block_k(cfg, kw.get("x_stages", MegaPlan.x_stages))
    return MegaPlan(layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                    head_dim=hd, mlp=cfg.mlp_dim, vocab_rows=vocab_rows or -(-cfg.vocab_size // BLOCK_F) * BLOCK_F,
                    max_len=max_len, eps=cfg.norm_eps, **kw)


def unit_major(w, block_k: int):
    """W [..., N, K] as [..., G, 64, block_k]: unit g = t * (K / block_k) + j one contiguous tile."""
    *lead, n, k = w.shape
    t = w.reshape(*lead, n // BLOCK_F, BLOCK_F, k // block_k, block_k)
    return jnp.swapaxes(t, -3, -2).reshape(*lead, n // BLOCK_F * (k // block_k), BLOCK_F, block_k)


def down_slices(w, block_k: int):
    """(fuse_mlp) W_down [..., D, F] as [..., F / 64 * D / block_k, 64, block_k]: unit
    i * (D / block_k) + u holds the 64 columns of slice i for rows u block_k .. (u + 1) block_k, row
    tile c of them in columns 64 c .. 64 c + 63 (one product puts the row tiles in the operand's
    columns c: `MegaPlan.fuse_mlp`)."""
    *lead, d, f = w.shape
    t = w.reshape(*lead, d // block_k, block_k // BLOCK_F, BLOCK_F, f // BLOCK_F, BLOCK_F)  # [u, c, row, i, k]
    t = jnp.swapaxes(jnp.moveaxis(t, -2, -5), -3, -2)  # [i, u, row, c, k]
    return t.reshape(*lead, f // BLOCK_F * (d // block_k), BLOCK_F, block_k)


def to_units(rows: dict, block_k: int, fuse_mlp: bool = False) -> dict:
    """Row-major {qkv, out, gate_up, down: [L, N, K], head: [V, D]} as megakernel_step's
    unit-major weights (fuse_mlp: W_down as `down_slices`)."""
    units = {name: unit_major(w, block_k) for name, w in rows.items()}
    if fuse_mlp:
        units["down"] = down_slices(rows["down"], block_k)
    return units


def pack_cache(kv, ppr: int):
    """[L, S, K, 2H] (K then V per position) as the kernel's [L, S / ppr, K, ppr 2H]: row R holds
    positions ppr R .. ppr R + ppr - 1 side by side."""
    l_, s_, k_, row = kv.shape
    return jnp.swapaxes(kv.reshape(l_, s_ // ppr, ppr, k_, row), 2, 3).reshape(l_, s_ // ppr, k_, ppr * row)


def unpack_cache(packed, ppr: int):
    """pack_cache's inverse."""
    l_, r_, k_, row = packed.shape
    return jnp.swapaxes(packed.reshape(l_, r_, k_, ppr, row // ppr), 2, 3).reshape(l_, r_ * ppr, k_, row // ppr)


def rope_table(pos, inv_freq):
    """[2, H] f32: [cos, cos] and [-sin, sin] at pos: RoPE (half-split pairs) of v is
    v * t[0] + swap_halves(v) * t[1]."""
    ang = pos.astype(jnp.float32) * inv_freq
    c, s = jnp.cos(ang), jnp.sin(ang)
    return jnp.stack([jnp.concatenate([c, c]), jnp.concatenate([-s, s])])


# ------------------------------------------------------------------------------------ the kernel


def _body(x_ref, rope_ref, pos_ref, wqkv, wo, wgu, wd, wh, cache, buf_all, xchg_o, xchg_ml, x_smem, stage, ustage,
          ring, part, res, obuf, qkv_a, rope_s, kv_row, p_smem, zeros, pos_s, x_full, u_full, w_full, free, a_full,
          misc, res_full, ml_smem, x_row, rmw, gather_o, gather_ml, gather_full, *,
          plan: MegaPlan, interpret: bool, steps: int = 0, vocab: int = 0):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    L = plgpu.Layout
    c = lax.axis_index("c")
    wg = lax.axis_index("wg")
    bk, hd, g_heads, ctas, ppr = plan.block_k, plan.head_dim, plan.groups, plan.ctas, plan.ppr
    P = plan.x_stages
    weights = dict(qkv=wqkv, out=wo, gate_up=wgu, down=wd, head=wh)
    # misc barriers: 0 pos (consumer), 1 pos (producer), 2 rope, 3 residual tile, 4 (unused),
    # 5 interpret's read-add-write and the input's copy. Semaphore 0: the buffer is initialised;
    # then one per phase of every layer (n_ph per layer), in order
    sync = not interpret
    n_ph = plan.phases_per_layer
    # steps > 0 (megakernel_loop): that many greedy steps in one launch, each on its own copy of
    # the flat buffer (two, alternating: a step zeroes the other while nobody reads it); the
    # phases address `vbuf()`, the current copy, and wait for the current step's count
    loop = steps > 0
    view, expect = [buf_all], [plan.ctas]
    expect_group = [plan.out_group]  # (grouped) a group semaphore's count once the current step's members signalled

    def vbuf():
        return view[0]

    splits = plan.attn_splits
    fused, gs = plan.fuse_out, plan.out_group
    head_sem = 1 + n_ph * plan.layers  # (loop) the head's logits are written: the next token can be picked
    group_sem0 = head_sem + loop  # (grouped) then one per (layer, KV head): its members' partials are written
    n_sems = group_sem0 + (plan.layers * plan.kv_heads if plan.grouped else 0)
    done = pl.get_global(plgpu.SemaphoreType.REGULAR((n_sems,))) if sync else None

    def wait(index, before: str = "", count=None):  # before: the phase it opens (the profile's region name)
        if sync:  # (count: the signals to wait for, by default every CTA's of the current step)
            with jax.named_scope(f"wait_{before}" if before else "wait"):
                plgpu.semaphore_wait(done.at[index], expect[0] if count is None else count, decrement=False,
                                     memory_scope="gpu")

    def signal(index):
        if sync:  # (a release: a relaxed one races, docs/decoding.md, nineteenth session)
            plgpu.semaphore_signal(done.at[index], 1, memory_scope="gpu")

    def release(r, m):
        """Free the ring slots of the m units before count r (those a phase held: hold_slots)."""
        @pl.loop(0, m)
        def _(i):
            plgpu.barrier_arrive(free.at[lax.rem(r - m + i, plan.stages)])

    def free_unless(slot, held):
        @pl.when(jnp.logical_not(held))
        def _():
            plgpu.barrier_arrive(free.at[slot])

    # register layouts (interpret mode has none)
    def vec(ref):
        return ref[...] if interpret else plgpu.load(ref, layout=L.WGMMA.reduce(1))

    def cast(x, layout):
        return x if interpret else plgpu.layout_cast(x, layout)

    def iota(shape, dim):
        if interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=L.WGMMA)

    def zero_acc(rows):
        return cast(jnp.zeros((rows, ROWS), jnp.float32), L.WGMMA)

    def product(acc, a_ref, b_ref, a_t=False):
        """acc + A Bᵀ (A [M, K] or, a_t, Aᵀ of a [K, M] tile; B [8, K]) on the tensor cores."""
        if interpret:
            a = a_ref[...].T if a_t else a_ref[...]
            return acc + jnp.dot(a, b_ref[...].T, preferred_element_type=jnp.float32)

        def issue(acc_ref):
            plgpu.wgmma(acc_ref, a_ref.T if a_t else a_ref, b_ref.T)

        return pl.run_state(issue)(plgpu.ACC.init(acc))

    def products(accs, pairs, a_t=False):
        """Each accs[i] + sum_j A_ij B_ijᵀ (pairs[i]: a list of (A ref, B ref)), as product's: every
        wgmma issued before any is waited for."""
        if interpret:
            return [acc + sum(jnp.dot(a[...].T if a_t else a[...], b[...].T, preferred_element_type=jnp.float32)
                              for a, b in ab) for acc, ab in zip(accs, pairs)]

        def issue(acc_refs):
            for acc_ref, ab in zip(acc_refs, pairs):
                for a, b in ab:
                    plgpu.wgmma(acc_ref, a.T if a_t else a, b.T)

        return list(pl.run_state(issue)([plgpu.ACC.init(acc) for acc in accs]))

    def to_operand(slot, v):
        """An f32 [bk] vector -> bf16 column 0 of x_smem[slot] (the other columns zero)."""
        v = lax.broadcast_in_dim(v, (bk, ROWS), [0])
        x_smem.at[slot].T[...] = jnp.where(iota((bk, ROWS), 1) == 0, v, 0.0).astype(x_smem.dtype)

    def reduce_add(src, dst):
        if interpret:  # no TMA reduction in the interpreter: read, add, write (one CTA: no race)
            old = rmw.at[pl.ds(0, src.shape[0])]  # (its own scratch: `zeros` must stay zeros)
            plgpu.copy_gmem_to_smem(dst, old, misc.at[5])
            plgpu.barrier_wait(misc.at[5])
            src[...] = src[...] + old[...]
            plgpu.copy_smem_to_gmem(src, dst)
        else:
            plgpu.copy_smem_to_gmem(src, dst, reduction_op="add")

    def span(name):
        if loop and name == "head":  # whole row tiles: a CTA's logits are final, and so is its argmax
            a, b = cta_span(c, plan.vocab_rows // BLOCK_F, ctas)
            return a * (plan.hidden // bk), b * (plan.hidden // bk)
        return cta_span(c, plan.units(name), ctas, plan.out_first_cta if name == "out" else 0)

    def down_unit(i, k):  # (fuse_mlp) slice i's k-th down unit, in the consumer's and producer's order
        return lax.rem(k + i, plan.hidden // bk) if plan.down_rotate else k

    # ---------------------------------------------------------------- the consumer's phases

    def norm_issue(base):
        """norm_rsqrt's first loads (as many chunks as the x stages hold), to be finished later."""
        @pl.loop(0, min(P, plan.hidden // bk))
        def _(i):
            plgpu.copy_gmem_to_smem(vbuf().at[pl.ds(base + i * bk, bk)], stage.at[i], x_full.at[i])

    def norm_rsqrt(base, issued=False):
        """rsqrt(mean(h²) + eps) of the hidden-wide region at base, through the x stages
        (issued: norm_issue(base) ran already)."""
        n = plan.hidden // bk

        def issue(i):
            plgpu.copy_gmem_to_smem(vbuf().at[pl.ds(base + i * bk, bk)], stage.at[lax.rem(i, P)],
                                    x_full.at[lax.rem(i, P)])

        if not issued:
            norm_issue(base)

        def body(i, ss):
            plgpu.barrier_wait(x_full.at[lax.rem(i, P)])
            v = vec(stage.at[lax.rem(i, P)])
            ss = ss + v * v

            @pl.when(i + P < n)
            def _():
                plgpu.commit_smem()  # every thread has read the stage before it is refilled
                issue(i + P)

            return ss

        ss = lax.fori_loop(0, n, body, cast(jnp.zeros((bk,), jnp.float32), L.WGMMA.reduce(1)))
        plgpu.commit_smem()  # (and before the stages' next use; one fence, not one per chunk)
        return lax.rsqrt(jnp.sum(ss) / plan.hidden + plan.eps)

    def norm_prefetch(base):
        """(plan.norm_prefetch) The hidden-wide region at base into the x and up stages, issued
        before the CTA signals its phase: the copies land while it waits at the barrier."""
        for i in range(plan.hidden // bk):
            dst, bar = (stage, x_full) if i < P else (ustage, u_full)
            plgpu.copy_gmem_to_smem(vbuf().at[pl.ds(base + i * bk, bk)], dst.at[i % P], bar.at[i % P])

    def norm_sum():
        """rsqrt(mean(h²) + eps) of what norm_prefetch copied."""
        ss = cast(jnp.zeros((bk,), jnp.float32), L.WGMMA.reduce(1))
        for i in range(plan.hidden // bk):
            dst, bar = (stage, x_full) if i < P else (ustage, u_full)
            plgpu.barrier_wait(bar.at[i % P])
            v = vec(dst.at[i % P])
            ss = ss + v * v
        plgpu.commit_smem()  # every thread has read the stages before the next phase refills them
        return lax.rsqrt(jnp.sum(ss) / plan.hidden + plan.eps)

    def statistic(base, sem, before, held):
        """Signal phase `sem` (then free the held slots: held = (ring count, slots)), wait for it
        (the next phase is `before`), and return the RMSNorm statistic of the region at base: read
        after the signal (in the time the CTA would wait anyway; the last CTA to signal then starts
        the next phase that much later), or with plan.norm_prefetch copied before the signal and
        summed after the wait."""
        if plan.norm_prefetch:
            norm_prefetch(base)
            signal(sem)
            release(*held)
            wait(sem, before)
            with jax.named_scope("norm"):
                return norm_sum()
        signal(sem)
        release(*held)
        with jax.named_scope("norm"):
            r = norm_rsqrt(base)
        wait(sem, before)
        return r

    def gemv(name, layer, r, *, x_base, y_base, res_base=None, up_base=None, scale=None, hold=0, all_x=False,
             pick=False):
        """This CTA's units of one projection; r: the ring's running count. Returns it advanced,
        and how many of the last units' slots it holds (hold at most; `release` frees them).
        x chunk j from buf[x_base + j bk] (with up_base: silu(s g) * (s u), g from x_base, u
        from up_base, s = scale); partials reduce-added at buf[y_base + row]; res_base: plus the
        residual buf[res_base + row], added by the CTA holding the tile's first K step. all_x: also
        the chunks its units do not use, into the stages after its own (`held_norm` reads them).
        pick (whole row tiles, loop's head): each tile stored, not added, and the largest of its
        rows below `vocab` kept: also returns that value and its row (f32; the first on ties)."""
        _, k = plan.gemvs()[name]
        steps = k // bk
        a, b = span(name)
        n_x = jnp.minimum(b - a, steps)

        def issue(i):  # x chunk i (= K step (a + i) mod steps) into stage i mod P
            j = lax.rem(a + i, steps)
            plgpu.copy_gmem_to_smem(vbuf().at[pl.ds(x_base + j * bk, bk)], stage.at[lax.rem(i, P)],
                                    x_full.at[lax.rem(i, P)])
            if up_base is not None:
                plgpu.copy_gmem_to_smem(vbuf().at[pl.ds(up_base + j * bk, bk)], ustage.at[lax.rem(i, P)],
                                        u_full.at[lax.rem(i, P)])

        @pl.loop(0, jnp.minimum(n_x, P))
        def _(i):
            issue(i)

        if all_x:  # stage i: chunk (a + i) mod steps, for every chunk (steps <= P: no refills)
            @pl.loop(n_x, steps)
            def _(i):
                issue(i)

        def round_x(i):  # chunk i, at its first use, into operand slot i
            s = lax.rem(i, P)
            plgpu.barrier_wait(x_full.at[s])
            v = vec(stage.at[s])
            if up_base is not None:
                plgpu.barrier_wait(u_full.at[s])
                gate, up = v * scale, vec(ustage.at[s]) * scale
                v = gate / (1.0 + jnp.exp(-gate)) * up
            to_operand(i, v)
            plgpu.commit_smem()  # visible to wgmma; the stage is read before it is refilled

            @pl.when(i + P < n_x)
            def _():
                issue(i + P)

        def segment(carry):
            g, r, best, best_row = carry
            t, j0 = g // steps, lax.rem(g, steps)
            n = jnp.minimum(steps - j0, b - g)
            if res_base is not None:  # the residual tile, or (not the tile's first K step) zeros
                src = jnp.where(j0 == 0, res_base + t * BLOCK_F, plan.zero_off)
                plgpu.copy_gmem_to_smem(vbuf().at[pl.ds(src, BLOCK_F)], res.at[pl.ds(0, BLOCK_F)], misc.at[3])

            def step(jj, acc):
                slot = lax.rem(r + jj, plan.stages)
                i = g + jj - a

                if plan.one_operand:  # (every chunk stays in its stage: steps <= P, no refills)
                    pl.when(i < n_x)(lambda: plgpu.barrier_wait(x_full.at[i]))  # (its first use)
                    to_operand(0, vec(stage.at[lax.rem(i, steps)]))
                    plgpu.commit_smem()
                else:
                    @pl.when(i < n_x)
                    def _():
                        round_x(i)

                plgpu.barrier_wait(w_full.at[slot])
                acc = product(acc, ring.at[slot], x_smem.at[lax.rem(i, 1 if plan.one_operand else steps)])
                free_unless(slot, g + jj >= b - hold)
                return acc

            acc = lax.fori_loop(0, n, step, zero_acc(BLOCK_F))
            y = jnp.sum(acc, axis=1)  # column 0 (the others are 0 x W)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous reduce has read `part`
            if res_base is not None:
                plgpu.barrier_wait(misc.at[3])
                y = y + vec(res.at[pl.ds(0, BLOCK_F)])
            part[...] = y
            plgpu.commit_smem()
            if pick:  # (per element of y's layout: no reduction across threads until the phase's end)
                plgpu.copy_smem_to_gmem(part, vbuf().at[pl.ds(y_base + t * BLOCK_F, BLOCK_F)])
                # (row numbers in y's layout: column 0 of a [64, 8] iota, summed over the columns)
                rows = jnp.sum(jnp.where(iota((BLOCK_F, ROWS), 1) == 0, iota((BLOCK_F, ROWS), 0), 0), axis=1)
                rows = (rows + t * BLOCK_F).astype(jnp.float32)
                y = jnp.where(rows < float(vocab), y, -jnp.inf)
                better = y > best  # (tiles in increasing order: the first row wins a tie)
                best, best_row = jnp.where(better, y, best), jnp.where(better, rows, best_row)
            elif name == "qkv":  # (q and k rows twice: `MegaPlan.qkv_stored`)
                dst = y_base + plan.qkv_at(t * BLOCK_F)
                reduce_add(part, vbuf().at[pl.ds(dst, BLOCK_F)])
                pl.when(t * BLOCK_F < (plan.heads + plan.kv_heads) * hd)(
                    lambda: reduce_add(part, vbuf().at[pl.ds(dst + hd, BLOCK_F)]))
            else:
                reduce_add(part, vbuf().at[pl.ds(y_base + t * BLOCK_F, BLOCK_F)])
            return g + n, r + n, best, best_row

        vec0 = cast(jnp.zeros((BLOCK_F,), jnp.float32), L.WGMMA.reduce(1))
        _, r, best, best_row = lax.while_loop(lambda carry: carry[0] < b, segment,
                                              (a, r, vec0 - jnp.inf, vec0 + NO_ROW))
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # written, before the phase is signalled
        if pick:
            top = jnp.max(best)
            return r, jnp.minimum(hold, b - a), top, jnp.min(jnp.where(best == top, best_row, NO_ROW))
        return r, jnp.minimum(hold, b - a)

    def held_norm(name):
        """(norm_in_qkv) rsqrt(mean(h²) + eps) of gemv(name, all_x=True)'s x: every chunk in its
        stage (those its units did not use, waited for here)."""
        a, b = span(name)
        n_x = jnp.minimum(b - a, plan.hidden // bk)
        ss = cast(jnp.zeros((bk,), jnp.float32), L.WGMMA.reduce(1))
        for i in range(plan.hidden // bk):
            pl.when(i >= n_x)(functools.partial(lambda i: plgpu.barrier_wait(x_full.at[i]), i))
            v = vec(stage.at[i])
            ss = ss + v * v
        plgpu.commit_smem()  # every thread has read the stages before they are refilled
        return lax.rsqrt(jnp.sum(ss) / plan.hidden + plan.eps)

    def split_blocks(j, pos):
        """[lo, hi): the cache tiles (64 rows, plan.tile_positions positions) before pos that
        split j of a KV head reads."""
        n = (pos + plan.tile_positions - 1) // plan.tile_positions
        return j * n // splits, (j + 1) * n // splits

    def flat_o(ref, n):
        """(grouped) n partials' o as [n, H 8 / 256, 256]: TMA moves them in rows of 1 KiB (as
        [n, H, 8], rows of 32 bytes: 5 µs for 16 of them on the H100). (The interpreter's copies
        take no reshaped ref: there the exchange buffer is [entries, H, 8], the same bytes.)"""
        return ref if interpret else ref.reshape(n, hd * ROWS // PAD, PAD)

    def member_blocks(member, pos):
        """(fuse_out) [lo, hi): the cache tiles before pos that a member of a KV head's group reads,
        and whether it takes the new position: all of them, or (plan.grouped, once the cache holds
        more than one tile) its run of S = min(group_splits, tiles), none past the S-th member."""
        n = (pos + plan.tile_positions - 1) // plan.tile_positions
        if not plan.grouped:
            return 0, n, True
        ns = group_count(pos)
        j = jnp.where(ns > 1, member, 0)
        inside = j < ns
        return jnp.where(inside, j * n // ns, 0), jnp.where(inside, (j + 1) * n // ns, 0), j == ns - 1

    def group_count(pos):
        """(plan.grouped) S: the runs a KV head's positions before pos are split into (1: none)."""
        n = (pos + plan.tile_positions - 1) // plan.tile_positions
        return jnp.maximum(jnp.minimum(plan.group_splits, n), 1)

    def attention(layer, r, h_in, pos, r_norm=None):
        """Units c, c + C, ... of KV heads x splits (unit u: KV head u mod K, split u div K): see
        the module docstring. Each unit computes the RMSNorm statistic of h_in itself, while its
        q/k/v loads land (a CTA without a unit needs none), or takes it (r_norm: norm_in_qkv).
        Returns the ring count and the slots held (fuse_out: its last unit's last W_o tiles)."""
        base = plan.region("qkv", layer)
        n_q, n_kv = plan.heads, plan.kv_heads
        cs, sn = vec(rope_s.at[0]), vec(rope_s.at[1])

        def rope(vs, rolls):
            """Each v * [cos, cos] + [x2, x1] * [-sin, sin], with rolls: each v's [x2, x1] (read as
            such from the q/k/v region, `MegaPlan.qkv_stored`: no exchange between threads)."""
            return [v * cs + rv * sn for v, rv in zip(vs, rolls)]

        def merge_streams(m, l, o):
            """(ppr 2) Head i's even positions' stream (column i: m, l, o at rows H..2H) and odd
            ones' (column G + i: o at rows 3H..4H) merged: per q head (max, sum, o unnormalised)."""
            col, row = iota((bk, ROWS), 1), iota((bk, ROWS), 0)
            packed = jnp.where(row < hd // 2, lax.broadcast_in_dim(m, (bk, ROWS), [1]),
                               jnp.where(row < hd, lax.broadcast_in_dim(l, (bk, ROWS), [1]), o))
            for i in range(2 * g_heads):  # column i -> stage row i: [m | l | o (even) | . | o (odd)]
                stage.at[i][...] = jnp.sum(jnp.where(col == i, packed, 0.0), axis=1)
            plgpu.commit_smem()
            heads = []
            for i in range(g_heads):
                m_e, l_e, m_o, l_o = (stage[i, 0], stage[i, hd // 2], stage[g_heads + i, 0],
                                      stage[g_heads + i, hd // 2])
                top = jnp.maximum(m_e, m_o)
                w_e, w_o = jnp.exp(m_e - top), jnp.exp(m_o - top)
                total = w_e * l_e + w_o * l_o
                heads.append((top, total, w_e * vec(stage.at[i, pl.ds(hd, hd)])
                              + w_o * vec(stage.at[g_heads + i, pl.ds(3 * hd, hd)])))
            plgpu.commit_smem()  # (every thread has read the stages before they are refilled)
            return heads

        def write_heads(layer, kvh, j, heads):
            """(ppr 2) merge_streams' heads as the heads' outputs or (attn_splits > 1) the split's
            partials [m | l | o | 0] (H values each) for `combine`."""
            zero_h = cast(jnp.zeros((hd,), jnp.float32), L.WGMMA.reduce(1))
            for i, (top, total, o_i) in enumerate(heads):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                if splits == 1:
                    obuf.at[pl.ds(0, hd)][...] = o_i * (1.0 / total)
                    plgpu.commit_smem()
                    dst = plan.region("attn", layer) + (kvh * g_heads + i) * hd
                    plgpu.copy_smem_to_gmem(obuf.at[pl.ds(0, hd)], vbuf().at[pl.ds(dst, hd)])
                else:
                    for n_, v in enumerate((zero_h + top, zero_h + total, o_i, zero_h)):
                        obuf.at[pl.ds(n_ * hd, hd)][...] = v
                    plgpu.commit_smem()
                    dst = plan.region("parts", layer) + (j * n_q + kvh * g_heads + i) * bk
                    plgpu.copy_smem_to_gmem(obuf.at[pl.ds(0, bk)], vbuf().at[pl.ds(dst, bk)])

        def compact(os_):
            """The streams' V products [H, 8] each (ppr of them) -> [H, 8]: each stream in its own
            columns (with ppr 2 the odd positions' from column G on)."""
            if ppr == 1:
                return os_[0]
            return jnp.where(iota((hd, ROWS), 1) < g_heads, os_[0], os_[1])

        def full_o(os_):
            """The streams' V products as [bk, 8], in the cache row's places of V (K's rows 0)."""
            zero = zero_acc(hd)
            return jnp.concatenate([t for o_ in os_ for t in (zero, o_)], axis=0)

        def fused_operand(m, l, o):
            """(fuse_out) The G heads' outputs as the output projection's operand (block_k rows
            per operand slot, `out_ksteps` slots): head i's rows i H.. (i + 1) H hold its stream's o
            (`compact`), normalised (with ppr 2,
            the even positions' stream in column i and the odd ones' in column G + i, each weighted
            for the merge: the product's columns are summed, so no stream is added to another).
            Only 64-row tiles move, which in registers is a renaming; the per-column weights come
            from m and l through shared memory as scalars."""
            col = iota((BLOCK_F, ROWS), 1)
            if ppr == 1:
                scale = lax.broadcast_in_dim(1.0 / l, (BLOCK_F, ROWS), [1])
            else:
                row = iota((BLOCK_F, ROWS), 0)
                ml_smem[...] = jnp.where(row < BLOCK_F // 2, lax.broadcast_in_dim(m, (BLOCK_F, ROWS), [1]),
                                         lax.broadcast_in_dim(l, (BLOCK_F, ROWS), [1]))
                plgpu.commit_smem()
                scale = cast(jnp.zeros((BLOCK_F, ROWS), jnp.float32), L.WGMMA)
                for i in range(g_heads):
                    m_e, l_e = ml_smem[0, i], ml_smem[BLOCK_F // 2, i]
                    m_o, l_o = ml_smem[0, g_heads + i], ml_smem[BLOCK_F // 2, g_heads + i]
                    top = jnp.maximum(m_e, m_o)
                    w_e, w_o = jnp.exp(m_e - top), jnp.exp(m_o - top)
                    inv = 1.0 / (w_e * l_e + w_o * l_o)
                    scale = jnp.where(col == i, w_e * inv, jnp.where(col == g_heads + i, w_o * inv, scale))
            tiles = []
            for i in range(g_heads):
                for k in range(hd // BLOCK_F):
                    t = cast(jnp.zeros((BLOCK_F, ROWS), jnp.float32), L.WGMMA)
                    for par in range(ppr):
                        t = jnp.where(col == i + g_heads * par, o[k * BLOCK_F: (k + 1) * BLOCK_F] * scale, t)
                    tiles.append(t)
            per_slot = bk // BLOCK_F  # (out_ksteps > 1: K step s of the head's rows into operand slot s)
            for s_ in range(plan.out_ksteps):
                x_smem.at[s_].T[...] = jnp.concatenate(tiles[s_ * per_slot: (s_ + 1) * per_slot],
                                                       axis=0).astype(x_smem.dtype)
            plgpu.commit_smem()

        def residual_tiles(layer, kvh, member):
            """(fuse_out) The residual tiles fused_out adds (or zeros: the other KV heads' groups),
            issued early: they land while the unit computes."""
            t_lo, t_hi = plan.out_tiles(member)
            for k in range(plan.res_tiles):
                src = jnp.where(kvh == 0, plan.region("in", layer) + (t_lo + k) * BLOCK_F, plan.zero_off)
                pl.when(t_lo + k < t_hi)(functools.partial(
                    lambda k, src: plgpu.copy_gmem_to_smem(vbuf().at[pl.ds(src, BLOCK_F)],
                                                           res.at[pl.ds(k * BLOCK_F, BLOCK_F)], res_full.at[k]),
                    k, src))

        def fused_out(layer, kvh, member, r, last):
            """(fuse_out) fused_operand's operand times the member's row tiles of W_o's K step kvh,
            each reduce-added into h1 (plus the residual: the group of KV head 0); last: the CTA's
            last unit, whose last hold_slots ring slots are held."""
            t_lo, t_hi = plan.out_tiles(member)
            h1 = plan.region("h1", layer)
            n_k = plan.out_ksteps  # (ring slots per row tile: W_o's K steps for this KV head)

            def tile(t, r):
                slots = [lax.rem(r + s_, plan.stages) for s_ in range(n_k)]
                for slot in slots:
                    plgpu.barrier_wait(w_full.at[slot])
                # (a computed index: a constant one reaches run_state's discharge as a bare literal)
                y = jnp.sum(products([zero_acc(BLOCK_F)], [[(ring.at[slot], x_smem.at[lax.rem(t, 1) + s_])
                                                             for s_, slot in enumerate(slots)]])[0], axis=1)
                for s_, slot in enumerate(slots):  # (held: the unit's last hold_slots slots)
                    free_unless(slot, last & ((t - t_lo) * n_k + s_ >= (t_hi - t_lo) * n_k - plan.hold_slots))
                plgpu.barrier_wait(res_full.at[t - t_lo])
                y = y + vec(res.at[pl.ds((t - t_lo) * BLOCK_F, BLOCK_F)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous reduce has read `part`
                part[...] = y
                plgpu.commit_smem()
                reduce_add(part, vbuf().at[pl.ds(h1 + t * BLOCK_F, BLOCK_F)])
                return r + n_k

            return lax.fori_loop(t_lo, t_hi, tile, r)

        def unit(u, r):
            if fused:  # member `member` of KV head kvh's group
                kvh, j, member = u // gs, 0, lax.rem(u, gs)
                writes_row = member == 0
                lo, hi, takes_new = member_blocks(member, pos)
                # (grouped: the CTA's last unit holds its last tiles' slots until its first gather: merged_out)
                held_from = jnp.where(u + ctas >= n_kv * gs, hi - plan.hold_slots, hi) if plan.grouped else hi
            else:
                kvh, j = lax.rem(u, n_kv), u // n_kv
                writes_row = takes_new = j == splits - 1  # the split that adds the new position and writes its row
                lo, hi = split_blocks(j, pos)
                held_from = hi
            with jax.named_scope("a_qkv"):
                srcs = [base + plan.qkv_at((kvh * g_heads + i) * hd) for i in range(g_heads)]
                srcs += [base + plan.qkv_at((n_q + kvh) * hd), base + plan.qkv_at((n_q + n_kv + kvh) * hd)]
                # the q heads' and k's rotate-half partners: H values from H / 2 on (stored twice)
                n_rot = g_heads + 1
                if plan.qkv_ld:  # (issued first: their registers are waited for only where used)
                    loaded = [vbuf().at[pl.ds(src, hd)][...] if interpret else
                              plgpu.load(vbuf().at[pl.ds(src, hd)], layout=L.WGMMA.reduce(1), optimized=False)
                              for src in srcs + [src + hd // 2 for src in srcs[:n_rot]]]
                else:
                    for i, src in enumerate(srcs):
                        n = 2 * hd if i < n_rot else hd
                        plgpu.copy_gmem_to_smem(vbuf().at[pl.ds(src, n)], qkv_a.at[i, pl.ds(0, n)], a_full.at[i])
                if fused and not plan.grouped:  # (grouped: in merged_out, whose unit's they are)
                    residual_tiles(layer, kvh, member)
                # the RMSNorm statistic r's loads: it is applied late (RoPE and the scores are
                # linear in it), so only the new cache row waits for it, not the q operand
                if r_norm is None:
                    norm_issue(h_in)
                if not plan.qkv_ld:
                    for i in range(len(srcs)):
                        plgpu.barrier_wait(a_full.at[i])

            def qkv_vec(i):  # q head i (i < G), k (G) or v (G + 1)
                return loaded[i] if plan.qkv_ld else vec(qkv_a.at[i, pl.ds(0, hd)])

            def rolled(i):  # q head i's or k's rotate-half partner
                return loaded[g_heads + 2 + i] if plan.qkv_ld else vec(qkv_a.at[i, pl.ds(hd // 2, hd)])

            with jax.named_scope("a_prep"):
                # RoPE of the G q heads (scaled by 1 / sqrt(H), not yet by r) and of k, in one pass
                q_scale = 1.0 / math.sqrt(hd)
                *qs, k_rot = rope([qkv_vec(i) * q_scale for i in range(g_heads)] + [qkv_vec(g_heads)],
                                  [rolled(i) * q_scale for i in range(g_heads)] + [rolled(g_heads)])
                # the q operand [bk, 8] as row tiles built in registers: q head i as column i over
                # the even positions' K (rows 0..H-1) and, with ppr 2, as column G + i over the odd
                # ones' (rows 2H..3H-1); zeros under V
                col = iota((hd, ROWS), 1)
                zero_t = cast(jnp.zeros((hd, ROWS), jnp.float32), L.WGMMA)
                tiles = []
                for par in range(ppr):
                    t = zero_t
                    for i, q in enumerate(qs):
                        t = jnp.where(col == i + g_heads * par, lax.broadcast_in_dim(q, (hd, ROWS), [0]), t)
                    tiles += [t.astype(x_smem.dtype), zero_t.astype(x_smem.dtype)]
                x_smem.at[0].T[...] = jnp.concatenate(tiles, axis=0)
                with jax.named_scope("p_norm"):
                    scale = norm_rsqrt(h_in, issued=True) if r_norm is None else r_norm
                k_new, v_new = k_rot * scale, qkv_vec(g_heads + 1) * scale
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # kv_row's previous write has read it
                kv_row.at[pl.ds(0, hd)][...] = k_new.astype(kv_row.dtype)
                kv_row.at[pl.ds(hd, hd)][...] = v_new.astype(kv_row.dtype)
                plgpu.commit_smem()
                # the new row, for the next steps: nothing in this one reads it back from the cache
                if ppr == 1:
                    pl.when(writes_row)(lambda: plgpu.copy_smem_to_gmem(kv_row, cache.at[layer, pos, kvh]))
                else:  # (a static column offset per parity)
                    for par in range(ppr):
                        pl.when(writes_row & (lax.rem(pos, ppr) == par))(functools.partial(
                            lambda par: plgpu.copy_smem_to_gmem(
                                kv_row, cache.at[layer, pos // ppr, kvh, pl.ds(par * 2 * hd, 2 * hd)]), par))
                # the new position: V in o's rows (H..2H-1, the even stream's), and its scores
                # q_i . k, as the tensor cores see them (bf16), one sum for all columns; those
                # that do not take it (odd positions, unused, not the last split) get NEG in row 0
                with jax.named_scope("p_snew"):
                    k_b = lax.broadcast_in_dim(k_new.astype(kv_row.dtype).astype(jnp.float32), (hd, ROWS), [0])
                    v_b = lax.broadcast_in_dim(v_new.astype(kv_row.dtype).astype(jnp.float32), (hd, ROWS), [0])
                    skip = g_heads if takes_new is True else g_heads * takes_new.astype(jnp.int32)
                    s2 = tiles[0].astype(jnp.float32) * k_b
                    s_new = jnp.sum(jnp.where((iota((hd, ROWS), 0) == 0) & (col >= skip), NEG, s2 * scale),
                                    axis=0)
                    plgpu.commit_smem()

            # a cache row holds [K | V] for each of its ppr positions: the scores read only the K
            # columns and the outputs only the V ones, half the tile's shared-memory reads of
            # products with whole rows
            k_cols = [pl.ds(2 * hd * par, hd) for par in range(ppr)]
            v_cols = [pl.ds(2 * hd * par + hd, hd) for par in range(ppr)]

            def block(blk, carry, w=1):
                """Cache tiles blk .. blk + w - 1 (positions [64 ppr blk, 64 ppr (blk + w)) of those
                before pos) as one online-softmax step: their products issued together, one max, one
                sum and one fence for all (a member with two tiles then takes little longer than one
                with one)."""
                m, l, o, r = carry
                slots = [lax.rem(r + k, plan.stages) for k in range(w)]
                # (a computed index: a constant one reaches run_state's discharge as a bare literal)
                q_op = x_smem.at[lax.rem(blk, 1)]
                for slot in slots:
                    plgpu.barrier_wait(w_full.at[slot])
                ss = products([zero_acc(BLOCK_F)] * w,
                              [[(ring.at[slot, :, kc], q_op.at[:, kc]) for kc in k_cols] for slot in slots])
                for k in range(w):
                    at = (iota((BLOCK_F, ROWS), 0) + (blk + k) * BLOCK_F) * ppr  # the positions of the scores
                    if ppr == 2:
                        at = jnp.where(iota((BLOCK_F, ROWS), 1) >= g_heads, at + 1, at)
                    ss[k] = jnp.where(at >= pos, NEG, ss[k] * scale)  # (the statistic r, applied late)
                m_new = jnp.maximum(m, jnp.max(functools.reduce(jnp.maximum, ss), axis=0))
                alpha = jnp.exp(m - m_new)
                ps = [jnp.exp(s_ - lax.broadcast_in_dim(m_new, (BLOCK_F, ROWS), [1])) for s_ in ss]
                l = l * alpha + jnp.sum(functools.reduce(jnp.add, ps), axis=0)
                p_ops = [p_smem.at[lax.rem(blk, 1) + k] for k in range(w)]  # (computed indices, as q_op's)
                for p_op, p in zip(p_ops, ps):
                    p_op.T[...] = p.astype(p_smem.dtype)
                plgpu.commit_smem()
                o = [o_ * lax.broadcast_in_dim(alpha, (hd, ROWS), [1]) for o_ in o]
                o = products(o, [[(ring.at[slot, :, vc], p_op) for p_op, slot in zip(p_ops, slots)]
                                 for vc in v_cols], a_t=True)  # each stream's Vᵀ p
                for k, slot in enumerate(slots):
                    free_unless(slot, blk + k >= held_from)
                return m_new, l, o, r + w

            row0 = cast(jnp.full((ROWS,), NEG, jnp.float32), L.WGMMA.reduce(0))
            l0 = cast(jnp.zeros((ROWS,), jnp.float32), L.WGMMA.reduce(0))
            with jax.named_scope("a_tiles"):
                pairs = (hi - lo) // 2
                carry = lax.fori_loop(0, pairs, lambda i, carry: block(lo + 2 * i, carry, 2),
                                      (row0, l0, [zero_acc(hd)] * ppr, r))
                m, l, o, r = lax.fori_loop(lo + 2 * pairs, hi, block, carry)
            # then (the last split) the new position itself, one more online-softmax step (its p
            # stays f32); elsewhere a score of NEG, whose weight at the combine is 0
            with jax.named_scope("a_new"):
                m_new = jnp.maximum(m, s_new)
                alpha = jnp.exp(m - m_new)
                p_new = jnp.exp(s_new - m_new)
                l, m = l * alpha + p_new, m_new
                # (its V in the even stream's: the odd columns' p_new is 0)
                o = [o_ * lax.broadcast_in_dim(alpha, (hd, ROWS), [1]) for o_ in o]
                o[0] = o[0] + lax.broadcast_in_dim(p_new, (hd, ROWS), [1]) * v_b
            if plan.grouped:  # the partial, for every member of the group (`merged_out`)
                with jax.named_scope("a_part"):
                    # (by TMA from the gather buffer's first entry, free until merged_out: the same
                    # path as every other exchange between CTAs, ordered by the group's signal)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # (the previous unit's are read)
                    at = kvh * gs + member
                    gather_o.at[0][...] = compact(o).astype(gather_o.dtype)
                    gather_ml.at[pl.ds(0, ROWS)][...] = m
                    gather_ml.at[pl.ds(ROWS, ROWS)][...] = l
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(flat_o(gather_o.at[pl.ds(0, 1)], 1), xchg_o.at[pl.ds(at, 1)])
                    plgpu.copy_smem_to_gmem(gather_ml.at[pl.ds(0, 2 * ROWS)],
                                            xchg_ml.at[pl.ds(at * 2 * ROWS, 2 * ROWS)])
                return r
            if fused:
                with jax.named_scope("a_merge"):
                    fused_operand(m, l, compact(o))
                with jax.named_scope("a_out"):
                    return fused_out(layer, kvh, member, r, u + ctas >= n_kv * gs)
            o = full_o(o)
            if ppr == 2:
                write_heads(layer, kvh, j, merge_streams(m, l, o))
                return r
            col = iota((bk, ROWS), 1)
            if splits == 1:  # the head's output, normalised
                o = o / lax.broadcast_in_dim(l, (bk, ROWS), [1])
            else:  # the split's partial [m | l | o] (H/2, H/2, H values) for `combine`
                row = iota((bk, ROWS), 0)
                o = jnp.where(row < hd // 2, lax.broadcast_in_dim(m, (bk, ROWS), [1]),
                              jnp.where(row < hd, lax.broadcast_in_dim(l, (bk, ROWS), [1]), o))
            for i in range(g_heads):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                obuf.at[pl.ds(0, bk)][...] = jnp.sum(jnp.where(col == i, o, 0.0), axis=1)
                plgpu.commit_smem()
                if splits == 1:
                    dst = plan.region("attn", layer) + (kvh * g_heads + i) * hd
                    plgpu.copy_smem_to_gmem(obuf.at[pl.ds(hd, hd)], vbuf().at[pl.ds(dst, hd)])
                else:
                    dst = plan.region("parts", layer) + (j * n_q + kvh * g_heads + i) * bk
                    plgpu.copy_smem_to_gmem(obuf.at[pl.ds(0, bk)], vbuf().at[pl.ds(dst, bk)])
            return r

        def chain_merge(first, ns, r, held):
            """The S partials from `first` on, merged per column in two passes: the largest m,
            then every partial weighted by exp(m_k - top), each weight independent of the others
            (merged online, each partial's rescale waited for the one before). Partial 0 always
            counts; the others only for S > 1 (S = 1: m_k -> m_0, and its weight 0). Pass 2 reloads
            each m from shared memory rather than holding 16 in registers (the kernel is at 251).
            Two TMA copies into shared memory: plain loads from global memory waited on each other
            (0.15 µs a partial on the H200, twenty-third session). Returns (top, total, o)."""
            n_g = plan.gathered
            plgpu.copy_gmem_to_smem(xchg_o.at[pl.ds(first, n_g)], flat_o(gather_o, n_g), gather_full.at[0])
            plgpu.copy_gmem_to_smem(xchg_ml.at[pl.ds(first * 2 * ROWS, n_g * 2 * ROWS)], gather_ml,
                                    gather_full.at[1])
            plgpu.barrier_wait(gather_full.at[0])
            plgpu.barrier_wait(gather_full.at[1])
            release(r, held)

            def ml(k, at):  # partial k's m (at 0) or l (at ROWS)
                ref = gather_ml.at[pl.ds(2 * ROWS * k + at, ROWS)]
                return ref[...] if interpret else plgpu.load(ref, layout=L.WGMMA.reduce(0), optimized=False)

            counted = jnp.where(ns > 1, 1.0, 0.0)
            m_0 = ml(0, 0)
            top = m_0
            for k in range(1, n_g):
                top = jnp.maximum(top, ml(k, 0) * counted + m_0 * (1.0 - counted))
            total = o = None
            for k in range(n_g):
                o_k = (gather_o[k] if interpret else
                       plgpu.load(gather_o.at[k], layout=L.WGMMA, optimized=False)).astype(jnp.float32)
                if k == 0:
                    w = jnp.exp(m_0 - top)
                else:
                    w = jnp.exp(ml(k, 0) * counted + m_0 * (1.0 - counted) - top) * counted
                term = o_k * lax.broadcast_in_dim(w, (hd, ROWS), [1])
                total, o = (ml(k, ROWS) * w, term) if k == 0 else (total + ml(k, ROWS) * w, o + term)
            return top, total, o

        def merged_out(u, r, held=0):
            """(plan.grouped) Unit u's output projection from its group's S partials (S = 1: its
            own), once every member has signalled: their online-softmax states merged per column.
            held: the ring slots its cache tiles held, freed once the partials have landed (so no
            weight tile the producer loads into them queues ahead of the copies; measured level on
            the H100, where the copies' row width was what cost, twenty-third session)."""
            kvh, member = u // gs, lax.rem(u, gs)
            residual_tiles(layer, kvh, member)
            ns = group_count(pos)
            pl.when(ns > 1)(lambda: wait(group_sem0 + layer * n_kv + kvh, "group", count=expect_group[0]))
            with jax.named_scope("a_gather"):
                # S > 1: partials 0..group_splits-1, every one written this step (those past S empty:
                # m NEG, l and o 0); S = 1: its own, the first of those copied from its own on (the
                # rest counted 0 by arithmetic, which needs them finite: the buffers are zeroed at
                # the kernel's start)
                first = kvh * gs + jnp.where(ns > 1, 0, member)
                top, total, o = chain_merge(first, ns, r, held)
                plgpu.commit_smem()  # (every thread has read the partials before the buffer is reused)
            with jax.named_scope("a_merge"):
                fused_operand(top, total, o)
            with jax.named_scope("a_out"):
                return fused_out(layer, kvh, member, r, u + ctas >= n_kv * gs)

        units = n_kv * gs if fused else n_kv * splits
        n_mine = pl.cdiv(units - c, ctas)
        r = lax.fori_loop(0, n_mine, lambda i, r: unit(c + i * ctas, r), r)
        if plan.grouped:  # every unit's partial is written: signal, then merge
            @pl.loop(0, n_mine)
            def _(i):
                signal(group_sem0 + layer * n_kv + (c + i * ctas) // gs)

            lo, hi, _ = member_blocks(lax.rem(c + (n_mine - 1) * ctas, gs), pos)
            held = jnp.where(n_mine > 0, jnp.clip(hi - lo, 0, plan.hold_slots), 0)  # (freed by the first merge)
            r = lax.fori_loop(0, n_mine, lambda i, r: merged_out(c + i * ctas, r, jnp.where(i == 0, held, 0)), r)
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        if not fused:
            return r, 0
        t_lo, t_hi = plan.out_tiles(lax.rem(c + (n_mine - 1) * ctas, gs))  # (the last unit's W_o tiles, held)
        return r, jnp.where(n_mine > 0, jnp.minimum(plan.hold_slots, (t_hi - t_lo) * plan.out_ksteps), 0)

    def combine(layer):
        """(attn_splits > 1) q heads c, c + C, ...: the splits' partials into the head's output,
        o = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s with M = max_s m_s."""
        base, n_q = plan.region("parts", layer), plan.heads

        @pl.loop(c, n_q, step=ctas)
        def _(n):
            for s_ in range(splits):
                plgpu.copy_gmem_to_smem(vbuf().at[pl.ds(base + (s_ * n_q + n) * bk, bk)], stage.at[s_], x_full.at[s_])
            ms, ls = [], []
            l_at, o_at = (hd // 2, hd) if plan.ppr == 1 else (hd, 2 * hd)  # (the partial's layout)
            for s_ in range(splits):
                plgpu.barrier_wait(x_full.at[s_])
                ms.append(stage[s_, 0])
                ls.append(stage[s_, l_at])
            top = functools.reduce(jnp.maximum, ms)
            ws = [jnp.exp(m_ - top) for m_ in ms]
            total = functools.reduce(lambda a, b: a + b, [w * l_ for w, l_ in zip(ws, ls)])
            o = functools.reduce(lambda a, b: a + b,
                                 [w * vec(stage.at[s_, pl.ds(o_at, hd)]) for s_, w in enumerate(ws)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            obuf.at[pl.ds(0, hd)][...] = o * (1.0 / total)
            plgpu.commit_smem()  # (and every thread has read the stages before they are refilled)
            plgpu.copy_smem_to_gmem(obuf.at[pl.ds(0, hd)], vbuf().at[pl.ds(plan.region("attn", layer) + n * hd, hd)])

        plgpu.wait_smem_to_gmem(0, wait_read_only=False)

    def mlp(layer, r):
        """(fuse_mlp) Slices c, c + C, ...: h1's chunks (all held in the x stages) give the slice's
        gate and up (all K steps, two accumulators), the RMSNorm statistic (applied to both) and,
        for the CTA of slice 0, the residual; then silu(gate) up, rounded to bf16, goes into the
        operand's columns 0.. (column c in rows 64 c..), so each down unit's product holds its
        row tiles in those columns; each unit's rows are reduce-added into h2. Returns the ring
        count and the slots held."""
        h1, h2 = plan.region("h1", layer), plan.region("h2", layer)
        steps = plan.hidden // bk  # gate/up's K steps, and the down units of a slice
        held = min(plan.hold_slots, steps)
        n_f = plan.mlp // BLOCK_F
        col = iota((BLOCK_F, ROWS), 1)

        def slice_(i, r):
            for j in range(steps):
                plgpu.copy_gmem_to_smem(vbuf().at[pl.ds(h1 + j * bk, bk)], stage.at[j], x_full.at[j])

            def kstep(j, carry):  # gate and up tiles of K step j
                ss, acc_g, acc_u, r = carry
                plgpu.barrier_wait(x_full.at[j])
                v = vec(stage.at[j])
                o = lax.rem(j, 1 if plan.one_operand else steps)  # (one_operand: the products before have read it)
                to_operand(o, v)
                plgpu.commit_smem()
                for n in range(2):
                    slot = lax.rem(r + n, plan.stages)
                    plgpu.barrier_wait(w_full.at[slot])
                    if n == 0:
                        acc_g = product(acc_g, ring.at[slot], x_smem.at[o])
                    else:
                        acc_u = product(acc_u, ring.at[slot], x_smem.at[o])
                    plgpu.barrier_arrive(free.at[slot])
                return ss + v * v, acc_g, acc_u, r + 2

            ss0 = cast(jnp.zeros((bk,), jnp.float32), L.WGMMA.reduce(1))
            with jax.named_scope("m_gate_up"):
                ss, acc_g, acc_u, r = lax.fori_loop(0, steps, kstep, (ss0, zero_acc(BLOCK_F), zero_acc(BLOCK_F), r))
            scale = lax.rsqrt(jnp.sum(ss) / plan.hidden + plan.eps)
            gate, up = jnp.sum(acc_g, axis=1) * scale, jnp.sum(acc_u, axis=1) * scale
            act = lax.broadcast_in_dim(gate / (1.0 + jnp.exp(-gate)) * up, (BLOCK_F, ROWS), [0])
            x_smem.at[0].T[...] = jnp.concatenate([jnp.where(col == n, act, 0.0) for n in range(bk // BLOCK_F)],
                                                  axis=0).astype(x_smem.dtype)
            plgpu.commit_smem()
            res_on = (i == 0).astype(jnp.float32)  # (slice 0 adds h1, still in the stages)

            def down(k, r):  # rows u bk.. of h2: row tile n of them in column n
                u = down_unit(i, k)
                slot = lax.rem(r, plan.stages)
                plgpu.barrier_wait(w_full.at[slot])
                acc = product(zero_acc(BLOCK_F), ring.at[slot], x_smem.at[lax.rem(u, 1)])
                free_unless(slot, (i + ctas >= n_f) & (k >= steps - held))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous reduce has read obuf
                for n in range(bk // BLOCK_F):
                    res = vec(stage.at[u, pl.ds(n * BLOCK_F, BLOCK_F)])
                    y = jnp.sum(jnp.where(col == n, acc, 0.0), axis=1)
                    obuf.at[pl.ds(n * BLOCK_F, BLOCK_F)][...] = y + res * res_on
                plgpu.commit_smem()  # (and every thread has read the stages before they are refilled)
                reduce_add(obuf.at[pl.ds(0, bk)], vbuf().at[pl.ds(h2 + u * bk, bk)])
                return r + 1

            with jax.named_scope("m_down"):
                return lax.fori_loop(0, steps, down, r)

        mine = pl.cdiv(n_f - c, ctas)
        r = lax.fori_loop(0, mine, lambda k, r: slice_(c + k * ctas, r), r)
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # written, before the phase is signalled
        return r, jnp.where(mine > 0, held, 0)  # (the last slice's last down units, held)

    T = plan.total
    tails = loop_layout(plan, steps) if loop else {}

    def tail(name, s):  # (loop) offset of step s's entry of a tail region, within the current view
        return tails[name] + s * tails[name + "_stride"] - cur[0]

    cur = [0]  # (loop) the current buffer's offset in buf_all

    def use_buffer(s):
        cur[0] = lax.rem(s, 2) * T
        view[0] = buf_all.at[pl.ds(cur[0], tails["view"])]
        expect[0] = ctas * (s + 1)
        expect_group[0] = plan.out_group * (s + 1)

    def store_scalar(v, dst):
        """v (an f32 scalar) into the 16 floats at dst (a region of the view) from obuf."""
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        obuf.at[pl.ds(0, bk)][...] = cast(jnp.ones((bk,), jnp.float32), L.WGMMA.reduce(1)) * v
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(obuf.at[pl.ds(0, 16)], vbuf().at[pl.ds(dst, 16)])

    @pl.when(wg == 0)
    def _consumer():
        # ids: [pos, the input's row of x_ref, rope_ref's row, 0] (x_ref: the embedding table, or one row)
        plgpu.copy_gmem_to_smem(pos_ref, pos_s.at[0, pl.ds(0, 4)], misc.at[0])
        zeros[...] = cast(jnp.zeros((PAD,), jnp.float32), L.WG_STRIDED((PAD,), vec_size=2))
        plgpu.commit_smem()
        plgpu.barrier_wait(misc.at[0])
        pos0, token0, rope_row = pos_s[0, 0], pos_s[0, 1], pos_s[0, 2]
        # the input row moves in chunks of PAD floats; a width that is no multiple of PAD ends in a
        # shorter one (its chunk's tail in the buffer is padding, which no phase reads)
        first_x, x_chunks = plan.x_off // PAD, -(-plan.hidden // PAD)
        last_n = plan.hidden - (x_chunks - 1) * PAD

        def x_chunk(token, i, n):
            """Chunk i of the buffer (the x region's) from the first n values of its share of the row."""
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.copy_gmem_to_smem(x_ref.at[token, pl.ds((i - first_x) * PAD, n)], x_row.at[pl.ds(0, n)], misc.at[5])
            plgpu.barrier_wait(misc.at[5])
            if x_ref.dtype == jnp.float32:
                plgpu.copy_smem_to_gmem(x_row.at[pl.ds(0, n)], vbuf().at[pl.ds(i * PAD, n)])
            else:  # (a 16-bit table: its row in f32)
                strided = L.WG_STRIDED((PAD,), vec_size=2)
                row = x_row[...] if interpret else plgpu.load(x_row, layout=strided)
                obuf.at[pl.ds(0, PAD)][...] = cast(row.astype(jnp.float32), strided)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(obuf.at[pl.ds(0, n)], vbuf().at[pl.ds(i * PAD, n)])

        def init(token, first):
            """The step's input (the token's row) into the current buffer; zeros into the rest of
            it (the first step) or (loop) the other buffer, which the next step uses. A CTA's share."""
            @pl.loop(c, T // PAD, step=ctas)
            def _init(i):
                inside = (i >= first_x) & (i < first_x + x_chunks)
                if last_n == PAD:
                    pl.when(inside)(lambda: x_chunk(token, i, PAD))
                else:
                    last = i == first_x + x_chunks - 1
                    pl.when(inside & jnp.logical_not(last))(lambda: x_chunk(token, i, PAD))
                    pl.when(last)(lambda: x_chunk(token, i, last_n))

                if first:
                    @pl.when(jnp.logical_not(inside))
                    def _():
                        plgpu.copy_smem_to_gmem(zeros, vbuf().at[pl.ds(i * PAD, PAD)])

            if loop and first:
                zero_other("all")
            if plan.grouped and first:
                zero_exchange()
            plgpu.wait_smem_to_gmem(0, wait_read_only=False)
            signal(0)

        def zero_exchange():
            """(grouped) Zeros into the CTA's share of the exchange buffers, from the gather buffers."""
            for k in range(plan.gathered):
                gather_o.at[k][...] = zero_acc(hd).astype(gather_o.dtype)
                for at in (0, ROWS):
                    gather_ml.at[pl.ds(2 * ROWS * k + at, ROWS)][...] = cast(jnp.zeros((ROWS,), jnp.float32),
                                                                             L.WGMMA.reduce(0))
            plgpu.commit_smem()

            @pl.loop(c, plan.xchg_entries // plan.gathered, step=ctas)
            def _(i):
                n_g = plan.gathered
                plgpu.copy_smem_to_gmem(flat_o(gather_o, n_g), xchg_o.at[pl.ds(i * n_g, n_g)])
                plgpu.copy_smem_to_gmem(gather_ml, xchg_ml.at[pl.ds(i * n_g * 2 * ROWS, n_g * 2 * ROWS)])

        parts_at, parts_n = (plan.region("parts", 0) - plan.layer0) // PAD, _pad(splits * plan.heads * bk) // PAD
        last_in = plan.region("in", plan.layers) // PAD  # (the last h: the head's input)
        last_in_chunks = _pad(plan.hidden) // PAD

        def zero_other(part):
            """(loop) Zeros into the CTA's share of the other buffer, the previous step's, which the
            next step uses. part "all" (the first step); "early": all but the last h, which the
            previous step's head may still read on a slower CTA (every CTA has passed that step's
            last layer); "last_h": the rest, once every CTA has signalled its head."""
            lo, hi = (last_in, last_in + last_in_chunks) if part == "last_h" else (0, T // PAD)

            @pl.loop(lo + c, hi, step=ctas)
            def _(i):
                skip = (part == "early") & (i >= last_in) & (i < last_in + last_in_chunks)
                if splits > 1:  # (the splits' partials: every unit writes all of its own each step)
                    k = lax.rem(i - plan.layer0 // PAD, plan.stride // PAD) - parts_at
                    skip = skip | ((i >= plan.layer0 // PAD) & (i < plan.logits_off // PAD) & (k >= 0) & (k < parts_n))

                @pl.when(jnp.logical_not(skip))
                def _():
                    plgpu.copy_smem_to_gmem(zeros, buf_all.at[pl.ds(T - cur[0] + i * PAD, PAD)])

        # (named scopes: the regions of the on-device profile, `profile_dir`; no code without it)
        def layers_and_head(r, pos, s):
            """The step's layers, then its head. Returns r (and, loop, the CTA's best logit and row)."""
            def layer(l, r):
                sem = 1 + n_ph * l  # this layer's phases signal sem, sem + 1, ...

                @pl.when(l > 0)
                def _():
                    wait(sem - 1, "qkv")

                h_in = plan.region("in", l)
                hold = plan.hold_slots
                with jax.named_scope("qkv"):
                    r, m = gemv("qkv", l, r, x_base=h_in, y_base=plan.region("qkv", l), hold=hold,
                                all_x=plan.norm_in_qkv)
                signal(sem)
                release(r, m)  # (every signal is followed by freeing the slots its phase held)
                r_norm = None
                if plan.norm_in_qkv:
                    with jax.named_scope("norm"):
                        r_norm = held_norm("qkv")
                wait(sem, "attn")
                h1 = plan.region("h1", l)
                with jax.named_scope("attn"):  # (fuse_out: and the output projection)
                    r, m = attention(l, r, h_in, pos, r_norm)
                if not fused:
                    sem += 1
                    if splits > 1:
                        signal(sem)
                        wait(sem, "combine")
                        with jax.named_scope("combine"):
                            combine(l)
                        sem += 1
                    signal(sem)
                    wait(sem, "out")
                    with jax.named_scope("out"):
                        r, m = gemv("out", l, r, x_base=plan.region("attn", l), y_base=h1, res_base=h_in,
                                    hold=hold)
                signal(sem + 1)
                release(r, m)
                if plan.fuse_mlp:
                    wait(sem + 1, "mlp")
                    with jax.named_scope("mlp"):
                        r, m = mlp(l, r)
                    signal(sem + 2)
                    release(r, m)
                    return r
                wait(sem + 1, "gate_up")
                gu = plan.region("gate_up", l)
                with jax.named_scope("gate_up"):
                    r, m = gemv("gate_up", l, r, x_base=h1, y_base=gu, hold=hold)
                r_mlp = statistic(h1, sem + 2, "down", (r, m))
                with jax.named_scope("down"):
                    r, m = gemv("down", l, r, x_base=gu, up_base=gu + plan.mlp, scale=r_mlp,
                                y_base=plan.region("h2", l), res_base=h1, hold=hold)
                signal(sem + 3)
                release(r, m)
                return r

            r = lax.fori_loop(0, plan.layers, layer, r)
            wait(n_ph * plan.layers, "head")
            h_last = plan.region("in", plan.layers)
            if not loop:
                with jax.named_scope("head"):
                    gemv("head", 0, r, x_base=h_last, y_base=plan.logits_off)  # (holds nothing: no signal follows)

                @pl.when(c == 0)
                def _():  # the final norm's statistic, for the caller to scale the logits by
                    store_scalar(norm_rsqrt(h_last), plan.r_off)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

                return r
            with jax.named_scope("head"):
                r, _, best, best_row = gemv("head", 0, r, x_base=h_last, y_base=tail("logits", s), pick=True)
            # the CTA's best logit and its row into its slots (and the spare slots c + ctas, ...: the
            # pick reads whole chunks, and a copy of a candidate changes nothing)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            ones = cast(jnp.ones((bk,), jnp.float32), L.WGMMA.reduce(1))
            obuf.at[pl.ds(0, bk)][...] = ones * best
            stage.at[0][...] = ones * best_row
            plgpu.commit_smem()

            @pl.loop(c, tails["slots"], step=ctas)
            def _(k):
                plgpu.copy_smem_to_gmem(obuf.at[pl.ds(0, 4)], vbuf().at[pl.ds(tail("best", s) + 4 * k, 4)])
                plgpu.copy_smem_to_gmem(stage.at[0, pl.ds(0, 4)], vbuf().at[pl.ds(tail("row", s) + 4 * k, 4)])

            @pl.when(c == 0)
            def _():  # (before the signal: the next step zeroes this buffer once every CTA has signalled)
                store_scalar(norm_rsqrt(h_last), tail("r", s))

            plgpu.wait_smem_to_gmem(0, wait_read_only=False)
            signal(head_sem)
            return r

        if not loop:
            plgpu.copy_gmem_to_smem(rope_ref.at[rope_row], rope_s, misc.at[2])
            init(token0, first=True)
            plgpu.barrier_wait(misc.at[2])
            wait(0, "qkv")
            layers_and_head(jnp.int32(0), pos0, 0)
            return

        def pick(s):
            """(loop) The token step s chose: the largest of its CTAs' best logits (the first row on
            ties), once every CTA has written its slots."""
            wait(head_sem, "pick", count=ctas * (s + 1))
            n = tails["slots"] * 4 // bk
            for i in range(2 * n):  # the best logits in stages 0..n-1, their rows in n..2n-1
                src = tail("best", s) if i < n else tail("row", s)
                plgpu.copy_gmem_to_smem(vbuf().at[pl.ds(src + (i % n) * bk, bk)], stage.at[i], x_full.at[i])
            vals = []
            for i in range(2 * n):
                plgpu.barrier_wait(x_full.at[i])
                vals.append(vec(stage.at[i]))
            plgpu.commit_smem()
            best, row = vals[0], vals[n]  # (per element first, then one reduction across threads)
            for v, w in zip(vals[1:n], vals[n + 1:]):
                row = jnp.where(v > best, w, jnp.where(v == best, jnp.minimum(w, row), row))
                best = jnp.maximum(v, best)
            top = jnp.max(best)
            return jnp.min(jnp.where(best == top, row, NO_ROW)).astype(jnp.int32)

        def step(s, carry, first=False):
            r, token = carry
            use_buffer(s)
            pos = jnp.minimum(pos0 + s, plan.max_len - 1)
            plgpu.copy_gmem_to_smem(rope_ref.at[pos], rope_s, misc.at[2])
            if not first:  # (most of the other buffer zeroed first: that does not wait for the token)
                zero_other("early")
                token = pick(s - 1)
                zero_other("last_h")

                @pl.when(c == 0)
                def _():
                    store_scalar(token.astype(jnp.float32), tail("token", s - 1))

            init(token, first)
            plgpu.barrier_wait(misc.at[2])
            wait(0, "qkv")
            return layers_and_head(r, pos, s), token

        carry = step(jnp.int32(0), (jnp.int32(0), token0), first=True)
        carry = lax.fori_loop(1, steps, step, carry)
        use_buffer(jnp.int32(steps))  # (the last step's pick and token: one buffer on)

        @pl.when(c == 0)
        def _():
            store_scalar(pick(steps - 1).astype(jnp.float32), tail("token", steps - 1))
            plgpu.wait_smem_to_gmem(0, wait_read_only=False)

    @pl.when(wg == 1)
    def _producer():  # the CTA's weight and cache tiles in the consumer's order
        plgpu.copy_gmem_to_smem(pos_ref, pos_s.at[1, pl.ds(0, 4)], misc.at[1])
        plgpu.barrier_wait(misc.at[1])
        pos0 = pos_s[1, 0]

        def fetch(src, r):
            slot = lax.rem(r, plan.stages)

            @pl.when(r >= plan.stages)
            def _():
                plgpu.barrier_wait(free.at[slot])

            plgpu.copy_gmem_to_smem(src, ring.at[slot], w_full.at[slot])
            return r + 1

        def stream(name, layer, r):
            w = weights[name]
            a, b = span(name)
            return lax.fori_loop(a, b, lambda g, r: fetch(w.at[g] if name == "head" else w.at[layer, g], r), r)

        def heads(layer, r, pos):
            def unit(u, r):  # its split's tiles of the positions before pos (this step's row comes in registers)
                kvh, j = lax.rem(u, plan.kv_heads), u // plan.kv_heads
                lo, hi = split_blocks(j, pos)
                return lax.fori_loop(lo, hi,
                                     lambda blk, r: fetch(cache.at[layer, pl.ds(blk * BLOCK_F, BLOCK_F), kvh], r), r)

            def member_tiles(u, r):  # (fuse_out) its run of its KV head's tiles
                kvh, member = u // plan.out_group, lax.rem(u, plan.out_group)
                lo, hi, _ = member_blocks(member, pos)
                return lax.fori_loop(lo, hi,
                                     lambda blk, r: fetch(cache.at[layer, pl.ds(blk * BLOCK_F, BLOCK_F), kvh], r), r)

            def out_tiles(u, r):  # (fuse_out) its row tiles of W_o's K step for its KV head
                kvh, member = u // plan.out_group, lax.rem(u, plan.out_group)
                t_lo, t_hi = plan.out_tiles(member)
                steps, n_k = plan.gemvs()["out"][1] // bk, plan.out_ksteps

                def tile(t, r):  # (its n_k K steps: the KV head's q heads' columns of W_o)
                    for s_ in range(n_k):
                        r = fetch(wo.at[layer, t * steps + kvh * n_k + s_], r)
                    return r

                return lax.fori_loop(t_lo, t_hi, tile, r)

            units = plan.kv_heads * (plan.out_group if plan.fuse_out else splits)
            n_mine = pl.cdiv(units - c, ctas)
            if plan.grouped:  # (every unit's partial before any unit's merge)
                r = lax.fori_loop(0, n_mine, lambda i, r: member_tiles(c + i * ctas, r), r)
                return lax.fori_loop(0, n_mine, lambda i, r: out_tiles(c + i * ctas, r), r)
            if plan.fuse_out:
                return lax.fori_loop(0, n_mine, lambda i, r: out_tiles(c + i * ctas, member_tiles(c + i * ctas, r)),
                                     r)
            return lax.fori_loop(0, n_mine, lambda i, r: unit(c + i * ctas, r), r)

        def mlp_slices(layer, r):  # (fuse_mlp) per slice: its gate and up tiles by K step, then its down units
            steps, n_f = plan.hidden // bk, plan.mlp // BLOCK_F

            def slice_(i, r):
                def kstep(j, r):
                    r = fetch(wgu.at[layer, i * steps + j], r)
                    return fetch(wgu.at[layer, (n_f + i) * steps + j], r)

                r = lax.fori_loop(0, steps, kstep, r)
                return lax.fori_loop(0, steps, lambda k, r: fetch(wd.at[layer, i * steps + down_unit(i, k)], r), r)

            return lax.fori_loop(0, pl.cdiv(n_f - c, ctas), lambda k, r: slice_(c + k * ctas, r), r)

        def step(s, r):
            pos = jnp.minimum(pos0 + s, plan.max_len - 1) if loop else pos0

            def layer(l, r):
                r = stream("qkv", l, r)
                r = heads(l, r, pos)
                if not plan.fuse_out:
                    r = stream("out", l, r)
                if plan.fuse_mlp:
                    return mlp_slices(l, r)
                for name in ("gate_up", "down"):
                    r = stream(name, l, r)
                return r

            r = lax.fori_loop(0, plan.layers, layer, r)
            return stream("head", 0, r)

        r = lax.fori_loop(0, max(steps, 1), step, jnp.int32(0))

        @pl.loop(0, plan.stages)
        def _drain(i):  # the last releases
            @pl.when(r - plan.stages + i >= 0)
            def _():
                plgpu.barrier_wait(free.at[lax.rem(r - plan.stages + i, plan.stages)])


def megakernel_step(x, rope, pos, weights: dict, cache, *, plan: MegaPlan, interpret: bool = False,
                    profile_dir: str = ""):
    """One batch-1 decode step. x: f32 [D] (the token's embedding row); rope: rope_table(pos);
    pos: int32 scalar (the new token's position; positions 0..pos-1 are in the cache);
    weights: unit-major bf16 {qkv, out, gate_up, down: [L, G, 64, block_k], head: [G, 64,
    block_k]} (`prepare`), norm scales folded; cache: bf16 plan.cache_shape, `pack_cache` of
    [L, S, KV heads, 2H] (K then V per row), written in place when the caller donates it.
    profile_dir: record the consumer's regions (wait_<phase>, qkv, norm, attn, out, gate_up,
    down, head) with Mosaic GPU's on-device profiler
    and write them there as a Perfetto trace (16 KiB more shared memory). Returns (logits f32
    [vocab_rows], the flat buffer, the cache). (`megakernel_token_step`: the same from a token id.)"""
    if x.shape != (plan.hidden,) or x.dtype != jnp.float32:
        raise ValueError(f"x must be float32 [{plan.hidden}] (batch 1), got {x.dtype} {x.shape}")
    ids = jnp.stack([jnp.asarray(pos, jnp.int32), jnp.int32(0), jnp.int32(0), jnp.int32(0)])
    return _launch(ids, x[None], rope.astype(jnp.float32)[None], weights, cache, plan=plan, interpret=interpret,
                   profile_dir=profile_dir)


def rope_tables(positions: int, inv_freq):
    """rope_table of every position 0..positions-1: f32 [positions, 2, H]."""
    return jax.vmap(lambda p: rope_table(p, inv_freq))(jnp.arange(positions, dtype=jnp.int32))


def megakernel_token_step(token, pos, embed, rope_all, weights: dict, cache, *, plan: MegaPlan,
                          interpret: bool = False, profile_dir: str = ""):
    """megakernel_step from a token id: the kernel reads the token's row of the embedding table
    embed (bf16, f16 or f32 [V, D]) and pos's row of rope_all (`rope_tables`, f32 [S, 2, H]) itself,
    so a decode loop runs nothing else before the kernel. token, pos: int32 scalars."""
    if embed.ndim != 2 or embed.shape[1] != plan.hidden or embed.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"embed must be a bf16, f16 or f32 [V, {plan.hidden}] table, got {embed.dtype} {embed.shape}")
    if rope_all.shape != (plan.max_len, 2, plan.head_dim):
        raise ValueError(f"rope_all must be rope_tables({plan.max_len}) [{plan.max_len}, 2, {plan.head_dim}], "
                         f"got {rope_all.shape}")
    pos = jnp.asarray(pos, jnp.int32)
    ids = jnp.stack([pos, jnp.asarray(token, jnp.int32), pos, jnp.int32(0)])
    return _launch(ids, embed, rope_all.astype(jnp.float32), weights, cache, plan=plan, interpret=interpret,
                   profile_dir=profile_dir)


def megakernel_loop(token, pos, steps: int, embed, rope_all, weights: dict, cache, *, plan: MegaPlan, vocab: int,
                    interpret: bool = False):
    """`steps` greedy decode steps in one launch, from token at position pos: each step's argmax
    over the logits of rows < vocab (the first on ties) is the next step's token, picked on the
    GPU (every CTA's best logit of its whole row tiles, then the best of those). No kernel
    boundary, and nothing else runs between steps. Positions past the cache's end write its last
    row (as the decoder clamps them). embed, rope_all, weights, cache: as megakernel_token_step.
    Returns (tokens int32 [steps], the raw logits f32 [steps, vocab_rows], the final norm's
    statistic r f32 [steps] (the logits are raw * r), the cache)."""
    if not 1 <= steps <= 4096:
        raise ValueError(f"steps must be 1..4096, got {steps}")
    if not 1 <= vocab <= plan.vocab_rows:
        raise ValueError(f"vocab must be 1..vocab_rows={plan.vocab_rows}, got {vocab}")
    if embed.ndim != 2 or embed.shape[1] != plan.hidden or embed.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"embed must be a bf16, f16 or f32 [V, {plan.hidden}] table, got {embed.dtype} {embed.shape}")
    if rope_all.shape != (plan.max_len, 2, plan.head_dim):
        raise ValueError(f"rope_all must be rope_tables({plan.max_len}) [{plan.max_len}, 2, {plan.head_dim}], "
                         f"got {rope_all.shape}")
    loop_check(plan)
    lay = loop_layout(plan, steps)
    pos = jnp.asarray(pos, jnp.int32)
    ids = jnp.stack([pos, jnp.asarray(token, jnp.int32), pos, jnp.int32(0)])
    buf, cache = _launch(ids, embed, rope_all.astype(jnp.float32), weights, cache, plan=plan, interpret=interpret,
                         profile_dir="", steps=steps, vocab=vocab)

    def part(name, n):
        return buf[lay[name]: lay[name] + steps * lay[name + "_stride"]].reshape(steps, -1)[:, :n]

    return part("token", 1)[:, 0].astype(jnp.int32), part("logits", plan.vocab_rows), part("r", 1)[:, 0], cache


def scratch_buffers(plan: MegaPlan, dtype=jnp.bfloat16, x_dtype=jnp.float32, interpret: bool = False) -> list:
    """`_launch`'s scratch in `_body`'s argument order: ("smem", shape, dtype, tiled) for a buffer
    (tiled: the wgmma operands' tiling and swizzle) and ("barriers", n, None, None). dtype: the
    weights' and cache's; x_dtype: the input row's table. MegaPlan.smem_bytes counts the same list."""
    bk, hd, P, f32 = plan.block_k, plan.head_dim, plan.x_stages, jnp.float32

    def smem(shape, dt=f32, tiled=False):
        return ("smem", shape, dt, tiled)

    def barriers(n):
        return ("barriers", n, None, None)

    return [
        smem((plan.x_slots(), ROWS, bk), dtype, True),  # x operands
        smem((P, bk)), smem((plan.up_stages, bk)),  # x stages, up stages
        smem((plan.stages, BLOCK_F, bk), dtype, True),  # the weight / cache ring
        smem((BLOCK_F,)),  # a partial
        smem((BLOCK_F * plan.res_tiles,)),  # its residual (fuse_out: each row tile's)
        smem((max(bk, PAD),)),  # an attention output, the input's copy, r_final
        smem((plan.groups + 2, 2 * hd)),  # q heads, k (each [v | v]), v of a KV head
        smem((2, hd)),  # rope table
        smem((2 * hd,), dtype),  # the new cache row
        smem((2, ROWS, BLOCK_F), dtype, True),  # softmax p of two tiles (operands)
        smem((PAD,)),  # zeros
        smem((2, 32), jnp.int32),  # pos, one copy per warpgroup (rows 128-byte aligned for TMA)
        barriers(P), barriers(P), barriers(plan.stages), barriers(plan.stages), barriers(plan.groups + 2),
        barriers(6), barriers(plan.res_tiles),
        smem((BLOCK_F, ROWS)),  # (fuse_out, ppr 2) the streams' m and l
        smem((PAD,), x_dtype),  # a chunk of the input's row
        smem((max(bk, PAD) if interpret else 16,)),  # (interpret) reduce_add's read-add-write
        # (grouped) the group's partials: o [H, 8] and [m; l] [2, 8] each (else 64-byte placeholders)
        smem((plan.gathered, hd if plan.grouped else 1, ROWS)),
        smem((plan.gathered * 2 * ROWS,)),  # ([m | l] per partial: 1D, so no tiling is inferred)
        barriers(2),
    ]


def _launch(ids, x_table, rope_rows, weights: dict, cache, *, plan: MegaPlan, interpret: bool, profile_dir: str,
            steps: int = 0, vocab: int = 0):
    """The kernel on ids [pos, the row of x_table, the row of rope_rows, 0]: one step (returns
    (logits, the flat buffer, the cache)), or (steps > 0) megakernel_loop's (the flat buffer, the cache)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plan.check()
    if profile_dir and (need := plan.smem_bytes(profile=True)) > SMEM_BYTES:
        raise ValueError(f"profiling needs {need} bytes of shared memory, more than {SMEM_BYTES}: fewer stages "
                         f"or x_stages")
    if interpret and plan.ctas != 1:
        raise ValueError("interpret mode has no global semaphores: it runs with ctas=1")
    if cache.shape != plan.cache_shape:
        raise ValueError(f"cache must be {list(plan.cache_shape)} (pack_cache of [L, S, KV heads, 2H] with ppr="
                         f"{plan.ppr}), got {list(cache.shape)}")
    if cache.dtype != weights["qkv"].dtype:  # (its tiles go through the weights' ring)
        raise ValueError(f"cache must be {weights['qkv'].dtype} as the weights, got {cache.dtype}")
    bk = plan.block_k
    for name, (n, k) in plan.gemvs().items():
        lead = () if name == "head" else (plan.layers,)
        want = (*lead, n // BLOCK_F * (k // bk), BLOCK_F, bk)
        if weights[name].shape != want:
            raise ValueError(f"weights[{name!r}] must be unit-major {want}, got {weights[name].shape}")
    ref = jax.new_ref(cache)
    dtype = weights["qkv"].dtype
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = tuple(plgpu.SMEM(shape, dt, **({"transforms": tiled} if is_tiled else {})) if kind == "smem"
                    else plgpu.Barrier(num_barriers=shape)
                    for kind, shape, dt, is_tiled in scratch_buffers(plan, dtype, x_table.dtype, interpret))
    buf, *_ = plgpu.kernel(
        functools.partial(_body, plan=plan, interpret=interpret, steps=steps, vocab=vocab),
        out_type=(jax.ShapeDtypeStruct((loop_layout(plan, steps)["size"] if steps else plan.total,), jnp.float32),
                  # (grouped) the partials' o, and their m and l
                  jax.ShapeDtypeStruct((plan.xchg_entries, *(((plan.head_dim, ROWS) if interpret else
                                                              (plan.head_dim * ROWS // PAD, PAD)) if plan.grouped
                                                             else (1, 16))), jnp.float32),
                  jax.ShapeDtypeStruct((plan.xchg_entries * 2 * ROWS,), jnp.float32)),
        scratch_types=scratch, grid=(plan.ctas,), grid_names=("c",), num_threads=2, thread_name="wg",
        interpret=interpret_params(interpret),
        compiler_params=plgpu.CompilerParams(profile_space=PROFILE_EVENTS, profile_dir=profile_dir)
        if profile_dir else None,
    )(x_table, rope_rows, ids, weights["qkv"], weights["out"], weights["gate_up"], weights["down"],
      weights["head"], ref)
    if steps:
        return buf, ref[...]
    logits = buf[plan.logits_off: plan.logits_off + plan.vocab_rows] * buf[plan.r_off]
    return logits, buf, ref[...]


# ----------------------------------------------------------------------------------- reference


@functools.partial(jax.jit, static_argnames=("plan", "hidden"))
def megakernel_reference(x, rope, pos, rows: dict, cache, *, plan: MegaPlan, hidden: bool = False):
    """megakernel_step in pure jnp with the kernel's rounding points: x of every projection
    rounded to bf16, f32 products and sums, q (scaled) and p rounded to bf16 for the tensor cores.
    rows: the row-major weights {qkv, out, gate_up, down: [L, N, K], head: [V, D]}. Returns
    (logits, the cache with the new rows), and (hidden) every layer's output h."""
    bf = jnp.bfloat16
    f32 = jnp.float32
    hd, g, nq, nkv = plan.head_dim, plan.groups, plan.heads, plan.kv_heads

    def mm(w, v):
        return jnp.dot(w.astype(f32), v.astype(bf).astype(f32), precision=lax.Precision.HIGHEST)

    def rms(v):
        return lax.rsqrt(jnp.mean(v * v) + plan.eps)

    def rope_(v):
        return v * rope[0] + jnp.concatenate([v[hd // 2:], v[: hd // 2]]) * rope[1]

    h, outs = x, []
    for l in range(plan.layers):
        r = rms(h)
        y = mm(rows["qkv"][l], h)
        q = y[: nq * hd].reshape(nq, hd)  # (r is applied to the scores: q rounds to bf16 without it)
        k = y[nq * hd: (nq + nkv) * hd].reshape(nkv, hd) * r
        v = y[(nq + nkv) * hd:].reshape(nkv, hd) * r
        k_new = jax.vmap(rope_)(k).astype(bf)
        q = jax.vmap(rope_)(q / math.sqrt(hd)).astype(bf).astype(f32).reshape(nkv, g, hd)
        cache = cache.at[l, pos].set(jnp.concatenate([k_new, v.astype(bf)], axis=-1))
        kc, vc = cache[l, :, :, :hd].astype(f32), cache[l, :, :, hd:].astype(f32)  # [S, KV, H]
        s = jnp.einsum("kgh,skh->kgs", q, kc, precision=lax.Precision.HIGHEST) * r
        s = jnp.where(jnp.arange(plan.max_len) < pos, s, NEG)
        # per run of cache tiles (attn_splits, or the grouped split's S runs; one by default): an
        # online softmax over its tiles before pos, two tiles a step, as the kernel (p rounded to
        # bf16 relative to the running max), per stream: with ppr 2 a tile's even and odd positions are separate streams,
        # each with its own running max; the last run's first stream then adds the new position with
        # its p in f32; each stream is merged over the runs, then the streams by their running maxima
        s_new = jnp.einsum("kgh,kh->kg", q, k_new.astype(f32), precision=lax.Precision.HIGHEST)[..., None] * r
        ppr, tile = plan.ppr, plan.tile_positions
        n_blk = (pos + tile - 1) // tile
        runs = plan.group_splits if plan.grouped else plan.attn_splits
        ns = jnp.maximum(jnp.minimum(runs, n_blk), 1) if plan.grouped else runs
        n_tiles = plan.max_len // tile
        # per tile and stream: the scores [tiles, KV, G, tile / ppr] and V [tiles, tile / ppr, KV, H]
        s_t = jnp.moveaxis(s.reshape(nkv, g, n_tiles, tile // ppr, ppr), 2, 0)
        v_t = vc.reshape(n_tiles, tile // ppr, ppr, nkv, hd)
        streams = []
        for par in range(ppr):
            parts = []
            for j in range(runs):
                inside = j < ns
                lo, hi = jnp.where(inside, j * n_blk // ns, 0), jnp.where(inside, (j + 1) * n_blk // ns, 0)

                def tile_step(carry, t, par=par, lo=lo, hi=hi):
                    """The run's tiles lo + 2 t and lo + 2 t + 1 (where before hi) as one step."""
                    m, lsum, o = carry
                    blks = [lo + 2 * t, lo + 2 * t + 1]
                    takes = [blk < hi for blk in blks]
                    sbs = [s_t[jnp.minimum(blk, n_tiles - 1), ..., par] for blk in blks]
                    tops = [jnp.where(take, jnp.max(sb, axis=-1, keepdims=True), NEG) for take, sb in zip(takes, sbs)]
                    m_new = jnp.maximum(m, functools.reduce(jnp.maximum, tops))
                    alpha = jnp.exp(m - m_new)
                    ps = [jnp.where(take, jnp.exp(sb - m_new), 0.0) for take, sb in zip(takes, sbs)]
                    pv = sum(jnp.einsum("kgs,skh->kgh", p.astype(bf).astype(f32),
                                        v_t[jnp.minimum(blk, n_tiles - 1), :, par], precision=lax.Precision.HIGHEST)
                             for p, blk in zip(ps, blks))
                    take = takes[0]
                    # (the two tiles' p added before the sum over positions, as the kernel)
                    return (jnp.where(take, m_new, m), jnp.where(take, lsum * alpha + (ps[0] + ps[1]).sum(-1, keepdims=True),
                                                                 lsum),
                            jnp.where(take, o * alpha + pv, o)), None

                init = (jnp.full((nkv, g, 1), NEG), jnp.zeros((nkv, g, 1)), jnp.zeros((nkv, g, hd)))
                (m, lsum, o), _ = lax.scan(tile_step, init, jnp.arange((n_tiles + 1) // 2))
                if par == 0:
                    m_new = jnp.maximum(m, s_new)
                    alpha, p_new = jnp.exp(m - m_new), jnp.exp(s_new - m_new)
                    takes_new = j == ns - 1
                    m, lsum, o = (jnp.where(takes_new, m_new, m), jnp.where(takes_new, lsum * alpha + p_new, lsum),
                                  jnp.where(takes_new, o * alpha + p_new * v.astype(bf).astype(f32)[:, None, :], o))
                parts.append((m, lsum, o))
            top = functools.reduce(jnp.maximum, [m for m, _, _ in parts])
            weights = [jnp.exp(m - top) for m, _, _ in parts]
            streams.append((top, sum(w * l_ for w, (_, l_, _) in zip(weights, parts)),
                            sum(w * o_ for w, (_, _, o_) in zip(weights, parts))))
        top = functools.reduce(jnp.maximum, [m for m, _, _ in streams])
        weights = [jnp.exp(m - top) for m, _, _ in streams]
        total = sum(w * l_ for w, (_, l_, _) in zip(weights, streams))
        if plan.fuse_out:  # each stream's share rounded to bf16 on its own (its own operand column)
            o = sum((w * o_ / total).astype(bf).astype(f32) for w, (_, _, o_) in zip(weights, streams))
            h1 = h + jnp.dot(rows["out"][l].astype(f32), o.reshape(-1), precision=lax.Precision.HIGHEST)
        else:
            o = sum(w * o_ for w, (_, _, o_) in zip(weights, streams)) / total
            h1 = h + mm(rows["out"][l], o.reshape(-1))
        gu = mm(rows["gate_up"][l], h1) * rms(h1)
        gate, up = gu[: plan.mlp], gu[plan.mlp:]
        h = h1 + mm(rows["down"][l], gate / (1 + jnp.exp(-gate)) * up)
        outs.append(h)
    if hidden:
        return mm(rows["head"], h) * rms(h), cache, outs
    return mm(rows["head"], h) * rms(h), cache


@functools.partial(jax.jit, static_argnames=("block_k", "fuse_mlp"))
def prepare(rows: dict, block_k: int, fuse_mlp: bool = False) -> dict:
    """decode.prepare_weights(model, dtype, rows=True)'s output-major weights (norm scales folded)
    as megakernel_step's unit-major stacks (one jitted copy: no stacked intermediate stays alive)."""
    return to_units(row_weights(rows), block_k, fuse_mlp)


def row_weights(rows: dict) -> dict:
    """The same stacks row-major (megakernel_reference's form)."""
    stack = lambda key: jnp.stack([layer[key] for layer in rows["layers"]])  # noqa: E731
    return dict(qkv=stack("wqkv_xd"), out=stack("wo_dx"), gate_up=stack("wgu_xd"), down=stack("wdown_df"),
                head=rows["head_xd"])
