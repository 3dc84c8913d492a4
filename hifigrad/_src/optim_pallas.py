"""A Pallas TPU kernel for one Adam step of a leaf's block-coded moments (`optim_codes`): ONE
pass over each tile of blocks, where the XLA version (`optim_codes._update`) takes two (a
reduction for the blocks' new scales, then the moments computed again and encoded).

Per tile of blocks the kernel reads the gradient and the stored codes (the blocks' scales in
the codes' sign bits), computes the new moments, the blocks' largest magnitudes (the new
scales), encodes the moments with stochastic rounding (the random bits of `leaf_bits32`,
hashed in the kernel from each element's position in the leaf and the leaf's key), writes the
new codes in place of the old (aliased buffers), and writes this step's Adam direction
``(m / c1) / (sqrt(max(v, (1 - b2) g**2) / c2) + eps)`` (what `hifigrad.optim.scale_by_adam`
returns), so that no float32 moment of the leaf's size exists.

It computes exactly what `optim_codes._update` does (the same float32 operations in the same
order; the codes' integer arithmetic written on int32 lanes: Mosaic has no float16 and few
unsigned operations), so that the new state is bit for bit the XLA path's
(tests/test_optim.py runs the kernel in interpret mode on CPU against it).

The gradient and the codes are (rows, last axis) views of the leaf (its leading axes merged:
no relayout on a TPU); a grid step takes a tile of rows x up to 1024 columns (about 2**17
elements) and works through it 32 rows x one block (128 lanes) at a time. The blocks' old
scales are read on the MXU (their 64 sign bits times powers of two, summed exactly in float32);
the new ones are Mosaic's lane reductions of the moments' bits.

Layouts: the kernel takes a leaf whose blocks are 128 elements of a last axis of a multiple of
128 (dense lanes). Other leaves take the XLA path (`supported` says which): blocks across
several trailing axes (a last axis under 64), and blocks of 64 to 256 elements other than 128
(a last axis of 64 or 96, say): those fill a 128-lane vector register half or three quarters
and Mosaic pads them; measured on a TPU v5e, a (16384, 16, 64) leaf took 5.1 ms in the kernel
against 1.9 ms on the XLA path.

**The split master's step** (`split_leaf_step`, for `hifigrad.optim.master_weights` with
``master="split"`` or ``"split8"`` over `hifigrad.optim.adamw`): the same kernel also reads
the leaf's bf16 parameter and its master's low half (with ``"split8"``, that half's top 8
bits), applies the direction to the master as optax's chain does (weight decay, learning rate,
the update), rounds a 24-bit master stochastically (the bits of `leaf_bits32` of the master's
own key, hashed in the kernel), and writes the new low half in place and the new parameter,
instead of the direction: the unfused update writes that float32 direction and reads it back
in XLA, where XLA:TPU computes the new parameter and the new low half in two fusions, each
reading the direction, the parameter and the low half again (and, for ``"split8"``, hashing
again). The bf16 parameter goes in and out as bf16, converted to float32 in the kernel: as its
uint16 bits, the bitcast beside the kernel was a copy of the leaf each way (split+8bit's
update took 1.60x the float32 master's at 115.4M parameters; 1.18-1.22x without). A TPU
flushes subnormal floats in that conversion, as in its arithmetic: a parameter below 2**-126
in magnitude is read and written as zero (the XLA path keeps its bits), and a NaN becomes the
canonical NaN.

Measured on a TPU v5e (jax 0.10.2), one (4096, 4096) leaf: 1.8 ms ("8bit", "4bit") to 2.0
ms ("fp16") against 4.0-4.5 ms on the XLA path and 1.5 ms for float32 Adam moments. The
kernel moves its bytes far below the chip's memory bandwidth (1.6 ms for the 12 bytes per
element of "8bit" codes: about 120 GB/s), so its arithmetic, more likely than its memory
traffic, sets its time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import optim_codes as _codes

try:  # Pallas is optional: without it every leaf takes the XLA path
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
except Exception:  # pragma: no cover - depends on the jax build
    pl = pltpu = None

AVAILABLE = pl is not None and pltpu is not None

_TILE_ELEMENTS = 1 << 17   # elements per grid step (512 KiB of float32 gradient)
_SUB_ROWS = 32             # rows per inner iteration (a multiple of uint8's 32-row tile)


def _i32(c: int):
    """A 32-bit pattern as an int32 constant."""
    return np.uint32(c & 0xFFFFFFFF).view(np.int32)


def _srl(x, n):
    """Logical right shift of int32 lanes (by a constant or per lane)."""
    return lax.shift_right_logical(x, jnp.asarray(n, jnp.int32))


def _bits(x):
    return lax.bitcast_convert_type(x, jnp.int32)


def _float(b):
    return lax.bitcast_convert_type(b, jnp.float32)


def _mix(v):
    """`codecs._mix32` (Wellons' lowbias32) on int32 lanes (wrapping products)."""
    v = v ^ _srl(v, 16)
    v = v * _i32(0x7FEB352D)
    v = v ^ _srl(v, 15)
    v = v * _i32(0x846CA68B)
    return v ^ _srl(v, 16)


def _leaf_bits32(pos, key):
    """`optim_codes.leaf_bits32` of the elements at positions ``pos`` of a leaf (int32)."""
    return _mix(_mix(pos ^ key) + key)


# ------------------------------------------------------------------ codes on int32 lanes
# Each mirrors the function of optim_codes named in its docstring, operation for operation.

def _dec_f16(c):
    """`optim_codes._decode_f16` of 15-bit float16 magnitudes: the value / 2**15 (exact)."""
    e, man = _srl(c, 10), c & 0x3FF
    normal = _float(((e + (127 - 15 - 15)) << 23) | (man << 13))
    special = _float(jnp.int32(0x7F800000) | (man << 13))    # inf, NaN
    sub = man.astype(jnp.float32) * np.float32(2.0 ** -39)
    return jnp.where(e == 0, sub, jnp.where(e == 31, special, normal))


def _enc_f16(y, r16):
    """`optim_codes._encode_f16`: the float16 bits of the rounded ``y * 2**15``."""
    z = y * _codes._F16_UP
    nb = (_bits(z) + _srl(r16, 3)) & _i32(0xFFFFE000)
    e32 = _srl(nb, 23) & 0xFF
    sign = _srl(nb, 16) & 0x8000
    man = _srl(nb, 13) & 0x3FF
    normal = sign | jnp.where(e32 == 255, 0x7C00 | man, ((e32 - 112) << 10) | man)
    sub = jnp.floor(z * 2.0 ** 24 + r16.astype(jnp.float32) * 2.0 ** -16).astype(jnp.int32)
    return jnp.where(z < 2.0 ** -14, sub, normal)


def _small_float(e_bits: int, m_bits: int, zero: bool):
    """`optim_codes._small_float`'s (encode, decode) on int32 lanes."""
    top = (1 << e_bits) - 1
    bias = 127 - top
    drop = 23 - m_bits
    smallest = 2.0 ** (1 - top) if zero else 2.0 ** -top
    keep = _i32(0xFFFFFFFF << drop)

    def encode(y, r16):
        if not zero:
            y = jnp.maximum(y, smallest)
        u = (_bits(y) + (r16 << (drop - 16))) & keep
        e = _srl(u, 23) - bias
        code = (jnp.clip(e, 0, top) << m_bits) | (_srl(u, drop) & ((1 << m_bits) - 1))
        if not zero:
            return code
        up = r16.astype(jnp.float32) * (2.0 ** -16) < y * (1.0 / smallest)
        tiny = jnp.where(up, 1 << m_bits, 0)
        return jnp.where(y < smallest, tiny, code)

    def decode(code):
        e = _srl(code, m_bits)
        value = _float(((e + bias) << 23) | ((code & ((1 << m_bits) - 1)) << drop))
        return jnp.where(e == 0, 0.0, value) if zero else value

    return encode, decode


def _half_octaves(n_bits: int):
    """`optim_codes._half_octaves`' (encode, decode) on int32 lanes."""
    top = (1 << n_bits) - 1
    lowest = 2.0 ** (-top / 2)
    r2 = np.float32(np.sqrt(2))

    def encode(y, r16):
        y = jnp.maximum(y, lowest)
        u = _bits(y)
        e = _srl(u, 23) - 127
        frac = _float((u & 0x7FFFFF) | 0x3F800000)
        upper_half = frac >= r2
        k = 2 * e + upper_half.astype(jnp.int32)
        low = jnp.where(upper_half, r2, np.float32(1.0)) * _float((e + 127) << 23)
        p_up = (y - low) / (low * np.float32(np.sqrt(2) - 1))
        up = r16.astype(jnp.float32) * (2.0 ** -16) < p_up
        return jnp.clip(k + top + up.astype(jnp.int32), 0, top)

    def decode(code):
        j = top - code
        whole = _float((127 - _srl(j, 1)) << 23)
        return jnp.where((j & 1) == 1, np.float32(np.sqrt(0.5)), np.float32(1.0)) * whole

    return encode, decode


def _codes_of(kind):
    """(width, (enc, dec) of m, (enc, dec) of s) as `optim_codes._CODES`."""
    if kind == "fp16":
        f16 = (_enc_f16, _dec_f16)
        return 16, f16, f16
    if kind == "8bit":
        return 8, _small_float(4, 3, True), _small_float(4, 3, False)
    return 4, _small_float(3, 0, True), _half_octaves(3)


# ------------------------------------------------------------------ which leaves

def _plan(shape):
    """(rows, last axis, column tile, row tile) of the kernel's view, or None: the kernel
    takes blocks of 128 in the last axis (a last axis of a multiple of 128: dense lanes)."""
    lay = _codes.layout(shape)
    if lay is None or len(shape) == 0:
        return None
    last = int(shape[-1])
    if lay.block != 128 or last % 128:
        return None
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    cols = 128
    while last % (2 * cols) == 0 and 2 * cols <= 1024:
        cols *= 2
    tr = max(_SUB_ROWS, (_TILE_ELEMENTS // cols) // _SUB_ROWS * _SUB_ROWS)
    if rows <= tr:
        tr = rows
    return rows, last, cols, tr


def supported(kind: str, shape) -> bool:
    """Whether the kernel takes a leaf of this shape (else: the XLA path)."""
    return AVAILABLE and kind in _codes.KINDS and _plan(tuple(shape)) is not None


# ------------------------------------------------------------------ the kernel

_SIGN = _i32(0x80000000)


def _scale_weights():
    """(128, 512) bfloat16: column block k (128 columns) sums the 16 bits 16k .. 16k + 15 of
    a block's first 64 elements' held bits (0 or 1) into an integer below 2**16 (exact:
    powers of two, float32 sums), in every column of the block."""
    # (computed, not a NumPy constant: JAX 0.12 passes a large constant to the compiled program
    # as an argument, one per use, even in a branch a CPU never takes)
    j = lax.broadcasted_iota(jnp.int32, (128, 512), 0)
    n = lax.broadcasted_iota(jnp.int32, (128, 512), 1)
    power = lax.shift_left(jnp.int32(1), j % 16).astype(jnp.float32)   # 2**(j % 16), exact
    return jnp.where((j < 64) & (j // 16 == n // 128), power, 0.0).astype(jnp.bfloat16)


def _special(hi):
    """`hifigrad.optim._special` on int32 lanes: whether a bf16's bits ``hi`` (a float32's
    top half) are inf or NaN."""
    return (hi & 0x7F80) == 0x7F80


def _join_bits(hi, lo, rounding):
    """`hifigrad.optim._join` on int32 lanes: the float32 master's bits from its bf16
    parameter's bits ``hi`` and its low half ``lo`` (each in [0, 2**16))."""
    plain = (hi << 16) | lo
    if rounding == "truncate":
        return plain
    special = _special(hi)
    inf = special & ((hi & 0x7F) == 0)
    rounded_up = (lo >= 0x8000) & (jnp.logical_not(special) | inf)
    return jnp.where(rounded_up, (hi << 16) - (0x10000 - lo), plain)


def _round_to_24_bits(u, bits):
    """`hifigrad.optim._round_to_24_bits` on int32 lanes: the float32 bits ``u`` rounded
    stochastically to their top 24 with the low 8 of ``bits``; inf and NaN kept."""
    return jnp.where(_special(_srl(u, 16)), u, (u + (bits & 0xFF)) & _i32(0xFFFFFF00))


def _bf16_bits(u, rounding):
    """`hifigrad.optim.round_to_bf16` (``"nearest_away"`` or ``"truncate"``) of the float32
    bits ``u`` on int32 lanes: the bf16's bits."""
    hi, lo = _srl(u, 16), u & 0xFFFF
    special = _special(hi)
    nan_kept = jnp.where(special & ((hi & 0x7F) == 0) & (lo != 0), hi | 0x40, hi)
    if rounding == "truncate":
        return nan_kept
    up = ((lo >= 0x8000) & jnp.logical_not(special)).astype(jnp.int32)
    return jnp.where(special, nan_kept, hi + up)


def _kernel(kind, plan, split, key_ref, f_ref, w_ref, *refs):
    rows, last, cols, tr = plan
    width, (enc, dec), (senc, sdec) = _codes_of(kind)
    sign, mag = 1 << (width - 1), (1 << (width - 1)) - 1
    four = kind == "4bit"
    n_in = 2 if four else 3
    ins, outs = refs[:n_in + (2 if split else 0)], refs[n_in + (2 if split else 0):]
    g_ref, mu_ref = ins[0], ins[1]
    nu_ref = None if four else ins[2]
    new_mu_ref = outs[0]
    new_nu_ref = None if four else outs[1]
    if split:   # the split master's parameter and low half in, both updated (no direction)
        p_ref, low_ref = ins[n_in], ins[n_in + 1]
        new_low_ref, new_p_ref = outs[-2], outs[-1]
        rounding, decay, split8 = split
    else:
        u_ref = outs[-1]
    key = key_ref[0]
    b1, nb1, b2, nb2, r1, r2, eps, wd, step = (f_ref[i] for i in range(9))
    row0 = pl.program_id(0) * tr
    col0 = pl.program_id(1) * cols
    sub = _SUB_ROWS if tr % _SUB_ROWS == 0 else tr
    shape = (sub, 128)

    def chunk(r, c):
        rs, cs = pl.ds(r, sub), pl.ds(c * 128, 128)
        g = g_ref[rs, cs]
        if four:
            w = mu_ref[rs, cs].astype(jnp.int32) & 0xFF
            mw, sw, scale_words = _srl(w, 4), w & 15, w
            shift = 3
        else:
            mask = 0xFFFF if kind == "fp16" else 0xFF
            mw = mu_ref[rs, cs].astype(jnp.int32) & mask
            sw = nu_ref[rs, cs].astype(jnp.int32) & mask
            scale_words, shift = sw, width - 1
        j = lax.broadcasted_iota(jnp.int32, shape, 1)
        # the blocks' scales from the sign bits of their first 64 elements, on the MXU (idle
        # otherwise): bits (0 or 1) times powers of two, summed in float32 to the scales'
        # four 16-bit halves (exact), each in every lane of its block (a lane reduction and
        # its broadcast on the vector unit took a quarter of the kernel's time)
        bit = _srl(scale_words, shift) & 1
        z = jnp.dot(bit.astype(jnp.float32).astype(jnp.bfloat16), w_ref[...],
                    preferred_element_type=jnp.float32).astype(jnp.int32)
        sc_m = _float((z[:, 128:256] << 16) | z[:, 0:128])
        sc_s = _float((z[:, 384:512] << 16) | z[:, 256:384])
        m_old = jnp.where((mw & sign) != 0, -1.0, 1.0) * dec(mw & mag) * sc_m
        s_old = sdec(sw & mag) * sc_s
        m = b1 * m_old + nb1 * g
        v = b2 * jnp.square(s_old) + nb2 * jnp.square(g)
        am = jnp.abs(m)
        # the new scales: maxima of the bits as unsigned integers (`optim_codes._block_max`;
        # |m|'s sign bit is clear; v's is flipped for a signed maximum)
        # (a butterfly of lane rotations, in every lane, took longer than Mosaic's reduction)
        new_sc_m = _float(jnp.max(_bits(am), axis=1, keepdims=True))
        new_sc_s = jnp.sqrt(_float(jnp.max(_bits(v) ^ _SIGN, axis=1, keepdims=True) ^ _SIGN))
        # (1 / sqrt: Mosaic divides as written; XLA:TPU would compute its rsqrt, rounded
        # differently, but for `_update`'s optimization barrier on the scales)
        rel_m = jnp.clip(jnp.where(new_sc_m > 0, am * (1 / new_sc_m), 0.0), 0.0, 1.0)
        rel_s = jnp.clip(jnp.where(new_sc_s > 0, jnp.sqrt(v) * (1 / new_sc_s), 0.0), 0.0,
                         1.0)
        # `leaf_bits32` of each element's position in the leaf (row-major, wrapping)
        pos = ((row0 + r + lax.broadcasted_iota(jnp.int32, shape, 0)) * last
               + col0 + c * 128 + j)
        bits = _leaf_bits32(pos, key)
        new_mw = jnp.where(m < 0, sign, 0) | enc(rel_m, bits & 0xFFFF)
        sbit = jnp.where(j < 32, _srl(_bits(new_sc_m), j & 31),
                         jnp.where(j < 64, _srl(_bits(new_sc_s), j & 31), 0)) & 1
        new_sw = (sbit << (width - 1)) | senc(rel_s, _srl(bits, 16))
        # this step's direction (hifigrad.optim.scale_by_adam), from the unrounded moments
        vv = jnp.maximum(v, nb2 * jnp.square(g))
        u = (m * r1) / (jnp.sqrt(vv * r2) + eps)
        if not split:
            u_ref[rs, cs] = u
        else:
            # the split master's update (`hifigrad.optim.master_weights` over `adamw`, as
            # optax computes it: weight decay ``u + wd * master`` where the mask takes the
            # leaf, the learning rate ``step * u``, then ``master + u``), its new low half and
            # its parameter rounded (`hifigrad.optim._split`)
            # (the bf16 parameter read as itself: a bf16 operand needs no bitcast outside the
            # kernel; converted to float32, its bits are the top half, exact but for a
            # subnormal, which a TPU flushes to zero)
            hi = _srl(_bits(p_ref[rs, cs].astype(jnp.float32)), 16)
            if split8:   # the 24-bit master: its low half's top 8 bits
                lo = (low_ref[rs, cs].astype(jnp.int32) & 0xFF) << 8
            else:
                lo = low_ref[rs, cs].astype(jnp.int32) & 0xFFFF
            full = _float(_join_bits(hi, lo, rounding))
            x = u + wd * full if decay else u
            new = _bits(full + step * x)
            if split8:   # rounded with the bits of the master's own key
                new = _round_to_24_bits(new, _leaf_bits32(pos, key_ref[1]))
                new_low_ref[rs, cs] = (_srl(new, 8) & 0xFF).astype(new_low_ref.dtype)
            else:
                new_low_ref[rs, cs] = (new & 0xFFFF).astype(new_low_ref.dtype)
            new_p_ref[rs, cs] = _float(_bf16_bits(new, rounding) << 16).astype(jnp.bfloat16)
        if four:
            new_mu_ref[rs, cs] = ((new_mw << 4) | new_sw).astype(new_mu_ref.dtype)
        else:
            new_mu_ref[rs, cs] = new_mw.astype(new_mu_ref.dtype)
            new_nu_ref[rs, cs] = new_sw.astype(new_nu_ref.dtype)

    def body(i, carry):
        r = pl.multiple_of(i * sub, sub) if sub % 8 == 0 else i * sub
        for c in range(cols // 128):
            chunk(r, c)
        return carry

    lax.fori_loop(0, tr // sub, body, 0)


# 16-bit operands. Mosaic takes no float16 operand ("Only arguments with ... bfloat16 or 32-bit
# element types are supported"), and a bitcast beside a custom call is a pass over the leaf on
# a TPU (XLA:TPU fuses a bitcast into an XLA consumer, not into a custom call): the fp16 first
# moment's codes are therefore stored as their bits, uint16 (a float16 state, as 0.1.0 saved
# it, is bitcast here, and its new codes come back as uint16), and the split master's bf16
# parameter goes in and out as bf16, converted to and from float32 in the kernel. Measured on a
# TPU v5e (jax 0.10.2, 115.4M parameters, the update's time against the float32 master's):
# split+fp16 1.98x with both bitcasts, 1.71x with the codes stored as uint16, 1.31x with the
# parameter as bf16 too. (Before: a bf16 parameter viewed as its bits in the kernel, a ref
# bitcast, was no faster than its bitcast outside; XLA's fusion of the bitcasts into the
# kernel's inputs, Pallas's allow_input_fusion, failed to compile: an internal RET_CHECK in
# XLA:TPU's rematerialization.)


def _call(kind, g, codes, extra, scal, key, split, interpret):
    """The kernel on a leaf's (rows, last axis) views: ``codes`` (the stored moments), with
    ``split`` also ``extra`` (the bf16 parameter, its master's low half). Returns the outputs
    of the leaf's shape: the new codes, then the direction (float32) or the new low half and
    the new parameter's bits (uint16)."""
    shape = np.shape(g)
    plan = _plan(shape)
    rows, last, cols, tr = plan

    def view(x):
        if x.dtype == jnp.float16:
            x = lax.bitcast_convert_type(x, jnp.uint16)
        return jnp.reshape(x, (rows, last))

    ins = [view(x) for x in (*codes, *extra)]   # (a float16 code: a state saved by 0.1.0)
    n = len(codes)
    grid = (pl.cdiv(rows, tr), last // cols)
    tile = pl.BlockSpec((tr, cols), lambda i, k: (i, k))
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    out_shape = [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in ins[:n]]
    if split:
        out_shape += [jax.ShapeDtypeStruct((rows, last), ins[n + 1].dtype),   # the low half
                      jax.ShapeDtypeStruct((rows, last), jnp.bfloat16)]
        aliases = {4 + i: i for i in range(n)} | {4 + n + 1: n}   # the codes, the low half
    else:
        out_shape += [jax.ShapeDtypeStruct((rows, last), jnp.float32)]
        aliases = {4 + i: i for i in range(n)}
    outs = pl.pallas_call(
        functools.partial(_kernel, kind, plan, split),
        grid=grid,
        in_specs=[smem, smem, pl.BlockSpec((128, 512), lambda i, k: (0, 0)), tile]
        + [tile] * len(ins),
        out_specs=[tile] * len(out_shape),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(key, scal, _scale_weights(), jnp.reshape(g, (rows, last)), *ins)
    return [jnp.reshape(o, shape) for o in outs]


def _scalars(b1, b2, c1, c2, eps, wd=0.0, step=0.0):
    """The kernel's float32 scalars, as `optim_codes._update` rounds them: b1 and 1 - b1 (a
    Python float's in double precision, then float32; a traced one's in float32); the bias
    corrections' reciprocals (`optim_codes._xla_step`); eps; the split master's weight decay
    and learning-rate step."""
    c1, c2 = (jnp.asarray(c, jnp.float32) for c in (c1, c2))
    return jnp.stack([jnp.asarray(x, jnp.float32) for x in
                      (b1, 1 - b1, b2, 1 - b2, 1 / c1, 1 / c2, eps, wd, step)]
                     + [jnp.zeros((), jnp.float32)] * 7)


def _key(*keys):
    return lax.bitcast_convert_type(jnp.stack([jnp.asarray(k, jnp.uint32) for k in keys]),
                                    jnp.int32)


def leaf_step(kind: str, g, mu, nu, key, b1, b2, c1, c2, eps, *, interpret: bool = False):
    """One Adam step of a leaf (`optim_codes.leaf_step`'s contract): ``(mu, nu, u)``, the new
    stored state and this step's direction ``(m / c1) / (sqrt(max(v, (1 - b2) g**2) / c2) +
    eps)``, in one Pallas kernel. ``key``: the leaf's `step_keys` key; ``b1``, ``b2``, ``eps``:
    Python floats or float32 scalars; ``c1``, ``c2``: the bias corrections (float32 scalars).
    Only for a leaf that `supported` takes."""
    codes = [mu] if kind == "4bit" else [mu, nu]
    outs = _call(kind, g, codes, (), _scalars(b1, b2, c1, c2, eps), _key(key), None, interpret)
    return outs[0], (() if kind == "4bit" else outs[1]), outs[-1]


def split_leaf_step(kind: str, g, mu, nu, key, b1, b2, c1, c2, eps, p, low, step, wd,
                    rounding: str, *, master_key=None, interpret: bool = False):
    """`leaf_step` and the split master's update of its parameter in the same kernel
    (`optim_codes.split_leaf_step`'s contract): ``(mu, nu, low, p)``, the new codes, the
    master's new low half and the new bf16 parameter, from the bf16 parameter ``p`` and its
    master's low half ``low`` (uint16): the master ``m`` (`hifigrad.optim._join`) becomes ``m
    + step * (u + wd * m)`` (``wd`` None: ``m + step * u``), split again with ``rounding``
    (``"nearest_away"`` or ``"truncate"``). With ``master_key`` (``master="split8"``: ``low``
    is the low half's top 8 bits, uint8) the new master is first rounded stochastically to
    24 bits with that key's `leaf_bits32`. No float32 direction is written."""
    codes = [mu] if kind == "4bit" else [mu, nu]
    scal = _scalars(b1, b2, c1, c2, eps, 0.0 if wd is None else wd, step)
    split8 = master_key is not None
    keys = _key(key, master_key) if split8 else _key(key)
    outs = _call(kind, g, codes, (p, low), scal, keys, (rounding, wd is not None, split8),
                 interpret)
    return outs[0], (() if kind == "4bit" else outs[1]), outs[-2], outs[-1]
