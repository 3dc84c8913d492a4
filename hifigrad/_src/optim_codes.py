"""Compact codes for `hifigrad.optim`: block-scaled Adam moments and counter-based random bits.

Adam's two moments are stored per parameter as the first moment ``m`` and the square root ``s``
of the second, each relative to one float32 scale per block (the block's largest magnitude),
rounded stochastically (unbiased):

* ``"fp16"``: ``m`` as a float16's bits, ``s`` as a float16's 15 magnitude bits (2 bytes
  each, uint16: a Pallas kernel takes no float16 operand, and a bitcast beside it is a copy), the
  scale at 2**15: 11 significant bits down to 2**-29 of the block's largest;
* ``"8bit"``: ``m`` as a sign and a 7-bit small float (4 exponent bits, 3 mantissa bits: 2**-14
  to 1, and 0), ``s`` as the same 7-bit code with its lowest binade 2**-15 instead of 0
  (1 byte each);
* ``"4bit"``: one byte for both: ``m`` as a sign and a 3-bit power of two (2**-6 to 1, and 0),
  ``s`` as one of 8 levels half a binary order of magnitude apart (2**-3.5 to 1).

``s`` is never stored as zero (a value below its code's lowest level is stored as that level):
a second moment rounded to zero would divide its first moment by nothing, one rounded up only
shortens that element's step.

**Blocks.** A leaf of at least 64 elements is cut into blocks of ``B`` consecutive elements
(row-major order) within its trailing axes: the fewest trailing axes holding 64 elements or
more (a last axis of 64 or more: that axis alone), ``B`` = 128 where it divides their size,
else the divisor of their size in [64, 256] nearest 128, else their whole size. A parameter
sharded along a leading axis keeps its blocks on one device. Smaller leaves, and by default
leaves of fewer than 4096 elements (`coded`), keep float32 moments.

**Scales in the sign bits.** ``s`` is never negative: its code's sign bit is free. In each
block, element ``j < 32`` holds bit ``j`` of the block's scale of ``m`` there, and element
``32 <= j < 64`` bit ``j - 32`` of the scale of ``s``; the state is then exactly 4, 2 or 1
bytes per parameter, with nothing beside it.

**No float32 moment is materialized.** A step reads a block's codes and gradient in two
passes: a reduction computes the new moments elementwise and keeps only each block's largest
magnitudes (the new scales); an elementwise pass computes them again and encodes them. XLA
fuses the elementwise work into each pass (on CPU a block is viewed as rows of at most 32
elements, the longest reduction XLA:CPU fuses with what it reads), so the update needs no
temporary of the moments' size.

**On a TPU** (one device) a leaf of blocks of 128 in its last axis is updated by a Pallas
kernel instead (`optim_pallas`, chosen in `leaf_step` by `lax.platform_dependent`): one pass
over each tile of blocks, which also writes the step's Adam direction, bit for bit the state
and direction of the XLA path (the algorithm here is written so that both compilers round
alike: divisions by a block's scale as multiplications by its reciprocal, as XLA rewrites
them, and the scales behind an optimization barrier, where XLA:TPU would take 1 / sqrt for its
rsqrt). With a split master (`split_leaf_step`: ``"split"`` or ``"split8"``) the kernel updates
the parameter and its master's low bits too, in the same pass. Measured on a TPU v5e at 115.4M
transformer-shaped parameters, the update takes 1.12x the float32 master's time with
`stochastic_rounding(adamw(moments="8bit"))` (1.78x on the XLA path), 1.31x with
`master_weights(adamw(moments="fp16"), master="split")` (2.30x) and 1.35x with
`master_weights(adamw(moments="4bit"), master="split8")` (2.34x;
benchmarks/results/optim_update_tpu_*_120m.md, docs/guides/training-state.md).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .codecs import _mix32

MIN_BLOCK = 64   # a block holds its two float32 scales' 64 bits
BLOCK = 128
MIN_CODED = 4096   # the default fewest elements of a leaf with coded moments (`coded`)
KINDS = ("fp16", "8bit", "4bit")


class Layout(NamedTuple):
    lead: tuple   # the leading axes, kept as they are
    nb: int       # blocks per row of the trailing axes
    block: int    # elements per block


def layout(shape) -> Layout | None:
    """The blocks of a leaf of this shape, or None (fewer than 64 elements: float32 moments)."""
    shape = tuple(int(d) for d in shape)
    if int(np.prod(shape, dtype=np.int64)) < MIN_BLOCK:
        return None
    k, size = 0, 1
    while size < MIN_BLOCK:
        k += 1
        size *= shape[-k]
    if size % BLOCK == 0:
        block = BLOCK
    else:
        divisors = [d for d in range(MIN_BLOCK, 2 * BLOCK + 1) if size % d == 0]
        block = min(divisors, key=lambda d: (abs(d - BLOCK), d)) if divisors else size
    return Layout(shape[:-k], size // block, block)


def coded(shape, min_size: int = MIN_CODED) -> bool:
    """Whether a fresh state codes the moments of a leaf of this shape: ``min_size`` elements
    or more (and 64 at least, `layout`). Smaller leaves keep float32 moments: a share of a
    model's bytes too small to matter, and each coded leaf is a program of its own for the
    compiler (about 650 operations after XLA's fusion, against about 80 for float32 moments),
    so a model of many biases and norm scales would compile several times slower."""
    return int(np.prod(shape, dtype=np.int64)) >= min_size and layout(shape) is not None


def is_coded_state(stored) -> bool:
    """Whether a state leaf holds block codes (uint8, uint16, or a float16 first moment saved
    by 0.1.0), not float32 or bf16 moments: a step codes a leaf as its state is stored."""
    return jnp.result_type(stored) in (jnp.uint8, jnp.uint16, jnp.float16)


def _view(lay: Layout, split: bool) -> tuple[int, int]:
    """A block as (rows, columns) of the blocked view: (1, B), or with ``split`` the most
    columns up to 32 (XLA:CPU rewrites a reduction over more than 32 elements into a
    reduce-window, which does not fuse with the elementwise decoding before it: that would
    be materialized, 4 bytes per element; two axes of at most 32 and the rest fuse)."""
    if not split:
        return 1, lay.block
    c = max(d for d in range(1, 33) if lay.block % d == 0)
    return lay.block // c, c


def to_blocks(x, lay: Layout, view=None):
    """``x`` (of the leaf's shape) as (*lead, nb, rows, columns)."""
    rows, cols = view or (1, lay.block)
    return jnp.reshape(x, (*lay.lead, lay.nb, rows, cols))


# ------------------------------------------------------------------ random bits

hash32 = _mix32  # Wellons' "lowbias32", as the codecs' dither: exact integer arithmetic


def step_keys(seed, count, n: int) -> tuple:
    """The keys of ``n`` leaves' random bits at step ``count`` (`leaf_bits32`'s ``key``):
    ``hash32(hash32(seed ^ golden) + step * c1 + leaf * c2)`` for leaves 0 .. n-1.

    They are taken out of the vector of all ``n`` by reductions, for the compiler's sake: XLA
    fuses a scalar computation into every elementwise kernel that reads it, so a leaf's
    index, a constant, would make each leaf's kernels distinct, and XLA:CPU compiles each
    kernel it has not seen (LLVM). A reduction is not fused into its readers: the kernels read
    the key as a value, and leaves of one shape share their compiled kernels, so that a model
    of repeated blocks compiles its update about as often as it has distinct shapes, not
    leaves (as an optax update of plain float32 arithmetic does). The reductions themselves
    are variadic reduces whose kernels do not depend on the leaf (`_pick`): the keys as a
    (rows, columns) matrix of about sqrt(n) columns, one reduce takes out its columns, then
    one reduce per column (the same kernel for all) its keys. (A reduction per leaf, masked
    by the leaf's index, was a distinct kernel per leaf: about 2 s of XLA:CPU compile for 99
    leaves, against 0.1 s.)"""
    if n == 0:
        return ()
    step = jnp.asarray(count).astype(jnp.uint32)
    # a Python int, or an array (optax.inject_hyperparams makes every number one)
    seed = jnp.uint32(seed & 0xFFFFFFFF) if isinstance(seed, int) else \
        jnp.asarray(seed).astype(jnp.uint32)
    base = hash32(seed ^ jnp.uint32(0x9E3779B9)) + step * jnp.uint32(0x85EBCA6B)
    cols = math.isqrt(n - 1) + 1
    rows = -(-n // cols)
    leaf = lax.iota(jnp.uint32, rows * cols).reshape(rows, cols)   # (padded past n)
    keys = hash32(base + leaf * jnp.uint32(0xC2B2AE35))
    out = [None] * (rows * cols)
    for i, column in enumerate(_pick(keys, 1)):
        for j, key in enumerate(_pick(column, 0)):
            out[j * cols + i] = key
    return tuple(out[:n])


def _pick(x, axis):
    """The slices of uint32 ``x`` along ``axis``, each taken out by one variadic reduce (its
    output ``i`` the bitwise or of ``x`` masked to position ``i``: exact): one kernel, the
    same for every ``x`` of one shape."""
    size = x.shape[axis]
    pos = lax.broadcasted_iota(jnp.uint32, x.shape, axis)
    masked = tuple(jnp.where(pos == i, x, jnp.uint32(0)) for i in range(size))
    return lax.reduce(masked, (np.uint32(0),) * size,
                      lambda a, b: tuple(u | v for u, v in zip(a, b)), (axis,))


def leaf_bits32(key, shape):
    """uint32 random bits for a leaf of this shape, from its key (`step_keys`): a
    counter-based hash of each element's position in the leaf, keyed by the seed, the step
    and the leaf (two rounds of `hash32`). Exact integer arithmetic: the same bits on every
    backend and under any sharding (the position is the element's in the whole array);
    elementwise, so it fuses with the rounding that uses it."""
    pos = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        pos = pos + lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= shape[d]
    return hash32(hash32(pos ^ key) + key)


# ------------------------------------------------------------------ magnitude codes

def f32_bits(x):
    """The bits of `x` as float32, as uint32."""
    return lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)


def _small_float(e_bits: int, m_bits: int, zero: bool):
    """(encode, decode) of a magnitude in [0, 1] as an unsigned small float of ``e_bits``
    exponent bits (the top exponent is 1's) and ``m_bits`` mantissa bits, rounded
    stochastically with 16 random bits (unbiased to 2**-16 of a step).

    With ``zero``, exponent code 0 is zero, and below the smallest normal value 2**(1 - top)
    a value rounds stochastically to 0 or that value (unbiased). Without, exponent code 0 is
    one more binade, 2**-top, and a value below it is stored as 2**-top: never zero, never
    less than a 2**-top-th of the block's largest. (The second moment's root is stored so:
    one stored as zero would divide its first moment by nothing; one stored too large only
    shortens that element's step.)"""
    top = (1 << e_bits) - 1
    bias = 127 - top                   # float32 exponent of 2**0 is 127; it is code `top`
    drop = 23 - m_bits                 # float32 mantissa bits below the kept ones
    smallest = 2.0 ** (1 - top) if zero else 2.0 ** -top

    def encode(y, r16):
        if not zero:
            y = jnp.maximum(y, smallest)
        u = f32_bits(y) + (r16 << (drop - 16))          # 16 random bits under the kept ones
        u = u & jnp.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
        e = (u >> 23).astype(jnp.int32) - bias
        code = (jnp.clip(e, 0, top) << m_bits) | ((u >> drop) & ((1 << m_bits) - 1)).astype(
            jnp.int32)
        if not zero:
            return code.astype(jnp.uint32)
        up = r16.astype(jnp.float32) * (2.0 ** -16) < y * (1.0 / smallest)
        tiny = jnp.where(up, 1 << m_bits, 0)
        return jnp.where(y < smallest, tiny, code).astype(jnp.uint32)

    def decode(code):
        code = code.astype(jnp.uint32)
        e = code >> m_bits
        bits = ((e + bias) << 23) | ((code & ((1 << m_bits) - 1)) << drop)
        value = lax.bitcast_convert_type(bits, jnp.float32)
        return jnp.where(e == 0, 0.0, value) if zero else value

    return encode, decode


def _half_octaves(n_bits: int):
    """(encode, decode) of a magnitude in [0, 1] as one of ``2**n_bits`` levels half a binary
    order of magnitude apart, ``2**(-k / 2)`` for ``k`` from ``2**n_bits - 1`` (code 0) down to
    0 (the top code): rounded stochastically between the two levels around it (unbiased to
    2**-16 of a step); below the lowest level, stored as the lowest (never zero)."""
    top = (1 << n_bits) - 1
    lowest = 2.0 ** (-top / 2)

    def encode(y, r16):
        y = jnp.maximum(y, lowest)
        u = f32_bits(y)
        e = (u >> 23).astype(jnp.int32) - 127                     # y = 2**e (1 + f)
        frac = lax.bitcast_convert_type((u & 0x7FFFFF) | 0x3F800000, jnp.float32)   # 1 + f
        upper_half = frac >= np.float32(np.sqrt(2))
        k = 2 * e + upper_half.astype(jnp.int32)                   # y in [L, L sqrt2)
        low = jnp.where(upper_half, np.float32(np.sqrt(2)), 1.0) * lax.bitcast_convert_type(
            ((e + 127) << 23).astype(jnp.uint32), jnp.float32)
        p_up = (y - low) / (low * np.float32(np.sqrt(2) - 1))
        up = r16.astype(jnp.float32) * (2.0 ** -16) < p_up
        return jnp.clip(k + top + up.astype(jnp.int32), 0, top).astype(jnp.uint32)

    def decode(code):
        j = top - code.astype(jnp.int32)                           # the value is 2**(-j/2)
        whole = lax.bitcast_convert_type(((127 - j // 2) << 23).astype(jnp.uint32), jnp.float32)
        return jnp.where(j % 2 == 1, np.float32(np.sqrt(0.5)), 1.0) * whole

    return encode, decode


_F16_UP = 2.0 ** 15   # a block's scale maps to 2**15: float16's normal range then spans 2**-29


def _encode_f16(y, r16):
    """The float16 bits (15, no sign) of ``y * 2**15`` for ``y`` in [0, 1], rounded
    stochastically: 11 significant bits down to 2**-29 of the scale, steps of 2**-39 below."""
    z = y * _F16_UP
    normal = lax.bitcast_convert_type((f32_bits(z) + (r16 >> 3)) & jnp.uint32(0xFFFFE000),
                                      jnp.float32)
    sub = jnp.floor(z * 2.0 ** 24 + r16.astype(jnp.float32) * 2.0 ** -16) * 2.0 ** -24
    q = jnp.where(z < 2.0 ** -14, sub, normal).astype(jnp.float16)   # exact: a float16 value
    return lax.bitcast_convert_type(q, jnp.uint16).astype(jnp.uint32)


def _decode_f16(code):
    f = lax.bitcast_convert_type(code.astype(jnp.uint16), jnp.float16)
    return f.astype(jnp.float32) * (1.0 / _F16_UP)


# kind: (bits of one code, sign included; the first moment's (encode, decode); the second
# moment root's (encode, decode))
_CODES = {"fp16": (16, (_encode_f16, _decode_f16), (_encode_f16, _decode_f16)),
          "8bit": (8, _small_float(4, 3, True), _small_float(4, 3, False)),
          "4bit": (4, _small_float(3, 0, True), _half_octaves(3))}


# ------------------------------------------------------------------ the scales' bits

def _scale_bits(scale_m, scale_s, view):
    """Per element of a block (the last two axes, a view of its B elements), the bit of the
    block's scales it holds: elements 0..31 the first moment's scale's bits, 32..63 the
    second's, the rest 0. ``scale_m``, ``scale_s``: float32 (*lead, nb, 1, 1)."""
    rows, cols = view
    sm, ss = f32_bits(scale_m), f32_bits(scale_s)
    lead = (1,) * (sm.ndim - 2)
    if cols == 32:  # each row of 32 holds one word: the word by row, a bit by column
        words = jnp.concatenate([sm, ss] + [jnp.zeros_like(sm)] * (rows - 2), axis=-2)
        return (words >> lax.broadcasted_iota(jnp.uint32, (*lead, 1, cols), sm.ndim - 1)) & 1
    j = (lax.broadcasted_iota(jnp.uint32, (*lead, *view), sm.ndim - 2) * cols
         + lax.broadcasted_iota(jnp.uint32, (*lead, *view), sm.ndim - 1))
    bit = jnp.where(j < 32, sm >> (j & 31), jnp.where(j < 64, ss >> (j & 31), jnp.uint32(0)))
    return bit & 1


def _read_scales(kind, mu, nu, lay):
    """The blocks' (scale of m, scale of s), each of shape (*lead, nb, 1, 1), from the sign
    bits of the second moment's codes in the first 64 elements of each block."""
    if kind == "4bit":
        words, shift = mu, 3
    else:
        words, shift = nu, (15 if kind == "fp16" else 7)
    first = to_blocks(words, lay)[..., 0, :MIN_BLOCK]
    first = first.reshape(*first.shape[:-1], 2, 32).astype(jnp.uint32)
    bits = ((first >> shift) & 1) << lax.broadcasted_iota(jnp.uint32, first.shape,
                                                          first.ndim - 1)
    words = lax.reduce(bits, np.uint32(0), lax.bitwise_or, (first.ndim - 1,))
    scales = lax.bitcast_convert_type(words, jnp.float32)[..., None, None]
    return scales[..., 0, :, :], scales[..., 1, :, :]


def _block_max(x):
    """The largest of each block (the last two axes, kept) of non-negative float32 ``x``: an
    integer maximum of its bits (their order is the values'; NaN's bits are above inf's).
    XLA:CPU hands a float reduction to a library kernel that reads a materialized operand;
    an integer one it fuses with the elementwise computation of ``x``."""
    bits = lax.reduce(f32_bits(x), np.uint32(0), lax.max, (x.ndim - 2, x.ndim - 1))
    return lax.bitcast_convert_type(bits, jnp.float32)[..., None, None]


def zeros(kind: str, shape):
    """The stored (m, s) of a fresh leaf: zero codes and zero scales."""
    if kind == "fp16":
        return jnp.zeros(shape, jnp.uint16), jnp.zeros(shape, jnp.uint16)
    if kind == "8bit":
        return jnp.zeros(shape, jnp.uint8), jnp.zeros(shape, jnp.uint8)
    return jnp.zeros(shape, jnp.uint8), ()


def _words(kind, mu, nu, lay, view):
    """(m words, s words) as blocked uint32."""
    if kind == "4bit":
        w = to_blocks(mu, lay, view).astype(jnp.uint32)
        return w >> 4, w & 15
    if mu.dtype == jnp.float16:   # a state saved by 0.1.0, whose m codes were float16
        mu = lax.bitcast_convert_type(mu, jnp.uint16)
    return (to_blocks(mu, lay, view).astype(jnp.uint32),
            to_blocks(nu, lay, view).astype(jnp.uint32))


def _stored(kind, mw, sw, shape):
    """The state leaves from blocked (m words, s words)."""
    if kind == "4bit":
        return jnp.reshape(((mw << 4) | sw).astype(jnp.uint8), shape), ()
    dtype = jnp.uint16 if kind == "fp16" else jnp.uint8
    return jnp.reshape(mw.astype(dtype), shape), jnp.reshape(sw.astype(dtype), shape)


def decode(kind: str, mu, nu, shape):
    """(m, s) as float32 arrays of the leaf's shape (for tests and inspection)."""
    lay = layout(shape)
    width, (_, dec), (_, sdec) = _CODES[kind]
    view = (1, lay.block)
    mw, sw = _words(kind, mu, nu, lay, view)
    sign, mag = jnp.uint32(1 << (width - 1)), jnp.uint32((1 << (width - 1)) - 1)
    sc_m, sc_s = _read_scales(kind, mu, nu, lay)
    m = jnp.where((mw & sign) != 0, -1.0, 1.0) * dec(mw & mag) * sc_m
    s = sdec(sw & mag) * sc_s
    return jnp.reshape(m, shape), jnp.reshape(s, shape)


# ------------------------------------------------------------------ the step of a leaf

_KERNEL = ["auto"]
_KERNELS = ("auto", "xla", "interpret")


@contextlib.contextmanager
def kernel(mode: str):
    """Which implementation `leaf_step` traces (read at trace time; internal, for tests and
    benchmarks): ``"auto"`` (the Pallas kernel of `optim_pallas` on a TPU for the leaves it
    takes, the XLA path elsewhere), ``"xla"`` (the XLA path everywhere) or ``"interpret"`` (the
    Pallas kernel in interpret mode, on any backend: the TPU path, checkable on a CPU)."""
    if mode not in _KERNELS:
        raise ValueError(f"kernel mode must be one of {_KERNELS}; got {mode!r}")
    prev, _KERNEL[0] = _KERNEL[0], mode
    try:
        yield
    finally:
        _KERNEL[0] = prev


def leaf_step(kind: str, g, mu, nu, key, b1, b2, c1, c2, eps):
    """One Adam step of a leaf's block-coded moments and its direction: ``(mu, nu, u)``, the
    new state leaves (`_update`'s) and ``u = (m / c1) / (sqrt(max(v, (1 - b2) g**2) / c2) +
    eps)`` from the new moments before their rounding (``v`` at least the step's own
    ``(1 - b2) g**2``: an element whose stored code was rounded to 0 in its block still
    divides by its own gradient's size). ``key``: the leaf's `step_keys` key; ``c1``, ``c2``:
    the bias corrections ``1 - b**count``.

    On a TPU (one device), a leaf that `optim_pallas.supported` takes is updated by its Pallas
    kernel, one pass over each tile of blocks, bit for bit the XLA path's state and direction;
    elsewhere (and for other leaves) by `_update`, a block viewed as rows of 32 on a CPU
    (`_view`), as one row elsewhere (`kernel` chooses otherwise). A nested
    ``jax.jit`` per leaf shape (XLA inlines it), so that a model of many leaves of a few
    shapes traces and lowers the coded update a few times, not once per leaf."""
    static, traced = _rates(b1, b2)
    return _leaf_step_fn(kind, static, _KERNEL[0])(g, mu, nu, key, c1, c2, eps, *traced)


def _rates(b1, b2):
    """``(static, traced)`` of the decay rates: ``((b1, b2), ())`` as Python floats, the
    jitted step's constants; traced (`optax.inject_hyperparams`): ``(None, (b1, b2))``, its
    arguments."""
    try:
        return (float(b1), float(b2)), ()
    except TypeError:
        return None, (b1, b2)


def _kernel_takes(kind, shape, mode) -> bool:
    """Whether the Pallas kernel updates a leaf of this shape in `kernel` mode ``mode``:
    ``"interpret"``, wherever `optim_pallas.supported` takes it; ``"auto"``, also only on one
    device (a pallas_call is not partitioned: under a sharded jit XLA would gather a sharded
    leaf and its state onto each device for it)."""
    from . import optim_pallas

    return optim_pallas.supported(kind, shape) and (
        mode == "interpret" or (mode == "auto" and jax.device_count() == 1))


def _xla_step(kind, g, mu, nu, key, c1, c2, eps, b1, b2, split):
    new_mu, new_nu, m, v = _update(kind, g, mu, nu, leaf_bits32(key, np.shape(g)), b1=b1,
                                   b2=b2, split=split)
    v = jnp.maximum(v, (1 - b2) * jnp.square(g))
    # (the divisions by c1 and c2 as XLA makes them in most programs, multiplications by their
    # reciprocals, written out so that every compiler, the Pallas kernel's too, computes them
    # alike; see `_update`)
    return new_mu, new_nu, (m * (1 / c1)) / (jnp.sqrt(v * (1 / c2)) + eps)


@functools.cache
def _leaf_step_fn(kind, static, mode):
    from . import optim_pallas

    def step(g, mu, nu, key, c1, c2, eps, *rates):
        b1, b2 = static if static is not None else rates
        kernel_ok = _kernel_takes(kind, np.shape(g), mode)

        def xla(split):
            return lambda *a: _xla_step(kind, *a, b1=b1, b2=b2, split=split)

        def pallas(interpret):
            def run(g, mu, nu, key, c1, c2, eps):
                return optim_pallas.leaf_step(kind, g, mu, nu, key, b1, b2, c1, c2, eps,
                                              interpret=interpret)
            return run

        args = (g, mu, nu, key, c1, c2, eps)
        if kernel_ok and mode == "interpret":
            return pallas(True)(*args)
        if kernel_ok:  # mode "auto"
            # The kernel is Mosaic's (TPU) only: a GPU takes the XLA path.
            return lax.platform_dependent(*args, cpu=xla(True), tpu=pallas(False),
                                          default=xla(False))
        return lax.platform_dependent(*args, cpu=xla(True), default=xla(False))

    return jax.jit(step)


def split_leaf_step(kind: str, g, mu, nu, key, b1, b2, c1, c2, eps, p, low, step, wd,
                    rounding: str, fallback, master_key=None):
    """`leaf_step` of a leaf whose parameter ``p`` (bf16) is kept by a split master (its
    master's low half ``low``, uint16: `hifigrad.optim.master_weights` with ``master="split"``
    over `hifigrad.optim.adamw`) and that master's update in the same step: ``(mu, nu, low,
    update)``, the new codes, the master's new low half and the parameter's update (float32,
    the new parameter less ``p``), where the master ``m`` becomes ``m + step * (u + wd * m)``
    (``wd`` None: no weight decay; ``step``: the learning rate's signed step, a float32
    scalar), as optax's chain computes it, split again with ``rounding``. With
    ``master_key`` (``master="split8"``): ``low`` is the top 8 bits of the master's low half
    (uint8), and the new master is rounded stochastically to its top 24 bits with the bits of
    ``leaf_bits32(master_key, ...)`` before it is split (`hifigrad.optim._round_to_24_bits`).

    ``fallback`` is that same result from the unfused update (`leaf_step` and the optax chain
    after it, in XLA): what this returns wherever the kernel does not run (a CPU, mode
    ``"xla"``, a leaf `optim_pallas.supported` does not take, several devices). On a TPU the
    kernel writes the new codes, low half and parameter in one pass, with no float32 direction
    between it and the master's update (which the unfused update writes and reads back, and
    XLA:TPU computes there in two fusions, one per output, each reading the direction, the
    parameter and the low half); the fallback is then unused (XLA removes it). Bit for bit the
    fallback's (tests/test_optim.py), but for subnormal parameters, which a TPU flushes to
    zero in the kernel (`optim_pallas`)."""

    mode = _KERNEL[0]
    if not _kernel_takes(kind, np.shape(g), mode):
        return tuple(fallback)
    wd_arg = jnp.zeros((), jnp.float32) if wd is None else jnp.asarray(wd, jnp.float32)
    split8 = master_key is not None
    args = (g, mu, nu, key, master_key if split8 else jnp.zeros((), jnp.uint32), c1, c2, eps,
            p, low, jnp.asarray(step, jnp.float32), wd_arg, *fallback)
    static, traced = _rates(b1, b2)
    return _split_step_fn(kind, static, mode, rounding, wd is not None, split8)(*args,
                                                                               *traced)


@functools.cache
def _split_step_fn(kind, static, mode, rounding, decay, split8):
    from . import optim_pallas

    def step(g, mu, nu, key, key8, c1, c2, eps, p, low, lr_step, wd, f_mu, f_nu, f_low,
             f_update, *rates):
        b1, b2 = static if static is not None else rates

        def pallas(interpret):
            def run(g, mu, nu, key, key8, c1, c2, eps, p, low, lr_step, wd, *_):
                new_mu, new_nu, new_low, new_p = optim_pallas.split_leaf_step(
                    kind, g, mu, nu, key, b1, b2, c1, c2, eps, p, low, lr_step,
                    wd if decay else None, rounding, master_key=key8 if split8 else None,
                    interpret=interpret)
                # the update `master_weights` returns: the new parameter less the old (exact)
                return (new_mu, new_nu, new_low,
                        new_p.astype(jnp.float32) - jnp.asarray(p, jnp.float32))
            return run

        args = (g, mu, nu, key, key8, c1, c2, eps, p, low, lr_step, wd, f_mu, f_nu, f_low,
                f_update)
        if mode == "interpret":
            return pallas(True)(*args)
        return lax.platform_dependent(*args, tpu=pallas(False),
                                      default=lambda *a: tuple(a[-4:]))

    return jax.jit(step)


def _update(kind, g, mu, nu, bits, *, b1, b2, split):
    """One Adam step of a leaf's block-coded moments (``kind``: ``"fp16"``, ``"8bit"`` or
    ``"4bit"``; ``g`` the float32 gradient; ``mu``, ``nu`` the stored state leaves, `zeros`'
    layout; ``bits`` uint32 random bits of ``g``'s shape, low half for m, high half for s;
    ``split``: a block viewed as rows of at most 32, as on a CPU). Returns ``(mu, nu, m, v)``:
    the new state leaves and the new moments before their rounding (float32, ``g``'s shape),
    from which the step's update is computed: only elementwise multiplications and additions
    of the stored values and ``g``, which XLA recomputes where they are used rather than
    keeping a float32 copy (an expensive operation, such as the square root that encoding the
    second moment takes, would be kept)."""
    shape = np.shape(g)
    lay = layout(shape)
    view = _view(lay, split)
    width, (enc, dec), (senc, sdec) = _CODES[kind]
    sign, mag = jnp.uint32(1 << (width - 1)), jnp.uint32((1 << (width - 1)) - 1)
    gb = to_blocks(g, lay, view)
    mw, sw = _words(kind, mu, nu, lay, view)
    sc_m, sc_s = _read_scales(kind, mu, nu, lay)
    m_old = jnp.where((mw & sign) != 0, -1.0, 1.0) * dec(mw & mag) * sc_m
    s_old = sdec(sw & mag) * sc_s
    m = b1 * m_old + (1 - b1) * gb
    v = b2 * jnp.square(s_old) + (1 - b2) * jnp.square(gb)
    # The new scales: the blocks' largest new magnitudes, reduced from the new moments as
    # they are computed (elementwise, fused into the reduction: nothing is materialized);
    # the encoding below computes them again.
    new_sc_m = _block_max(jnp.abs(m))
    new_sc_s = jnp.sqrt(_block_max(v))
    # XLA:TPU rewrites 1 / sqrt(x) into its rsqrt (rounded differently); the barrier keeps the
    # division as written, which the Pallas kernel (`optim_pallas`) computes too. Not on the
    # CPU's path (`split`): there XLA keeps the division, and jaxlib 0.11.2's XLA:CPU fused
    # around a barrier differently, keeping a float32 moment-sized temporary (4.2 bytes per
    # parameter of temporaries in test_update_materializes_no_float32_moment[fp16]).
    if not split:
        new_sc_m, new_sc_s = lax.optimization_barrier((new_sc_m, new_sc_s))
    # relative to the scales (clipped to 1: the pass may round the moments differently)
    # (a multiplication by the scale's reciprocal: XLA rewrites a division by a broadcast
    # value so; written out, every compiler, the Pallas kernel's included, computes the same)
    rel_m = jnp.clip(jnp.where(new_sc_m > 0, jnp.abs(m) * (1 / new_sc_m), 0.0), 0.0, 1.0)
    rel_s = jnp.clip(jnp.where(new_sc_s > 0, jnp.sqrt(v) * (1 / new_sc_s), 0.0), 0.0, 1.0)
    r = to_blocks(bits, lay, view)
    new_mw = jnp.where(m < 0, sign, jnp.uint32(0)) | enc(rel_m, r & 0xFFFF)
    new_sw = (_scale_bits(new_sc_m, new_sc_s, view) << (width - 1)) | senc(rel_s, r >> 16)
    new_mu, new_nu = _stored(kind, new_mw, new_sw, shape)
    return new_mu, new_nu, jnp.reshape(m, shape), jnp.reshape(v, shape)
