"""Codecs that compress the activations saved for the backward pass.

`hg.checkpoint` and `hg.scan` store ``enc = codec.encode(x)`` in the forward pass instead of
the activation ``x`` and call ``codec.decode(enc, x.dtype)`` when the backward pass needs it. A
codec is a small frozen dataclass (hashable, so it can be a static argument) with:

* ``encode(x, *, key=None) -> Encoded``: a pytree holding only the compressed data and its
  scales, never a full-precision copy of ``x``;
* ``decode(enc, dtype) -> Array``: ``x``'s shape, in ``dtype``;
* ``nbytes(shape, dtype) -> int``: the exact bytes ``encode`` stores for such an array;
* ``name`` and ``stochastic`` attributes.

Everything is pure JAX with static shapes: codecs work eagerly, under `jax.jit`, `jax.vmap`
and inside `jax.lax.scan`. `decode` also accepts encodings with extra leading axes (for example
the per-step encodings a scan stacks), and decodes them all at once.

Formats
-------
``none``
    Identity: stores ``x``.
``bf16``
    A cast to bfloat16 (8 significant bits, float32's exponent range: nothing overflows),
    stored as its bit pattern (``uint16``).
``fp8_e4m3`` / ``fp8_e5m2`` (`FP8Codec`)
    Current scaling: ``scale = amax(|x|) / fp8_max`` (448 for e4m3, 57344 for e5m2), computed
    per tensor or per row (rows of ``x`` flattened to ``[prod(shape[:-1]), shape[-1]]``), and
    ``x / scale`` clipped to ``[-fp8_max, fp8_max]`` (so rounding past the top saturates
    instead of becoming NaN or inf) and cast to ``float8_e4m3fn`` / ``float8_e5m2``. Round to
    nearest even: the relative error is at most ``2**-4`` (e4m3, 3 mantissa bits) or
    ``2**-3`` (e5m2, 2 mantissa bits) for scaled values in the normal range. The fp8 values
    are stored as their bit patterns (``uint8``).
`DelayedFP8Codec`
    Delayed scaling as in Flax's ``nn.fp8_ops``: the scale comes from a history of past amaxes
    held in a small state that the caller threads through training steps; values beyond the
    scaled range saturate to ``±fp8_max * scale``.
``int8`` / ``int4`` / ``int2`` (`IntCodec`)
    Symmetric absmax quantization over groups of ``group_size`` consecutive elements of the
    flattened array (the tail is zero-padded): ``scale = absmax / qmax`` with
    ``qmax = 2**(bits-1) - 1`` (127, 7, 1), stored as bfloat16 rounded *up* so that no value
    exceeds ``qmax`` after scaling, and integer codes in ``[-qmax, qmax]``, stored in rows of
    128 bytes (``[rows, 128]``, the last row zero-padded). int4 packs two codes per byte, int2
    four, planar within a row (byte ``i`` holds codes ``i`` and ``128 + i``, and for int2 also
    ``256 + i`` and ``384 + i``, low bits first), so that packing never interleaves neighbouring
    elements of the minor dimension (a costly relayout on a TPU). int8 rounds to nearest by
    default; int4 and int2 round stochastically by default, which is unbiased:
    ``E[decode(encode(x))] == x``.

Memory
------
Bytes stored per element, relative to float32 (4 bytes), for ``n`` elements:

=============  ===============================  =======================
codec          bytes                            ratio, ``[16, 64, 256]``
=============  ===============================  =======================
none (f32)     ``4 n``                          1.0
bf16           ``2 n``                          0.5
fp8 tensor     ``n + 4``                        0.2500038
fp8 row        ``n + 4 rows``                   0.25390625 (1024 rows)
fp8 delayed    ``n + 8`` (scale + amax)         0.2500076
int8, g=128    ``n + 2 n/128``                  0.25390625
int4, g=64     ``n/2 + 2 n/64``                 0.1328125
int2, g=32     ``n/4 + 2 n/32``                 0.078125
=============  ===============================  =======================

For `IntCodec` the ratio is ``bits/32 + 1/(2 * group_size)`` (one 2-byte scale per group, when
``group_size`` divides ``n``). The default group sizes keep it under 0.30 (int8), 0.16 (int4)
and 0.09 (int2) with room to spare; see `IntCodec`.

Non-finite values are never hidden: a NaN or inf in ``x`` makes the scale of its group (its
row, or the whole tensor, for fp8) NaN, so the whole group decodes to NaN (``none`` and
``bf16`` keep NaN and inf as they are).

Implementation notes: the fp8 and int kernels each run as one nested `jax.jit` keyed by the
(hashable) codec, so eager calls compile once per codec and shape rather than once per
operation. Divisions by constants are written as multiplications by the reciprocal (XLA
rewrites them so under jit anyway), which makes results bit-identical eagerly, under jit and
under vmap. Scales are floored at the smallest normal float32, because XLA on CPU flushes
subnormals to zero and ``x / 0`` would be inf. Every stored array has an integer dtype
(or is the ``none`` codec's input): storage is ours to choose, and a backend without native
narrow-float slicing (XLA:CPU) would otherwise convert a whole stacked bf16 / fp8 residual to a
wider float outside a scan's backward loop, so that peak memory would not follow the saved bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

__all__ = [
    "BF16Codec",
    "Codec",
    "DelayedFP8Codec",
    "Encoded",
    "FP8Codec",
    "IntCodec",
    "NoneCodec",
    "get_codec",
]

Array = jax.Array

# Smallest normal float32 (and bfloat16): scales never go below it, so no scale is subnormal
# (XLA on CPU flushes subnormals to zero, which would turn ``x / scale`` into inf).
_TINY = np.float32(np.finfo(np.float32).tiny)
_BF16_MAX = np.float32(jnp.finfo(jnp.bfloat16).max)
_NAN = np.float32(np.nan)

_FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
_SCALINGS = ("tensor", "row")
_INT_DEFAULT_GROUP_SIZE = {8: 128, 4: 64, 2: 32}
_INT_DEFAULT_STOCHASTIC = {8: False, 4: True, 2: True}


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A compressed activation: a pytree whose leaves are the stored arrays.

    Attributes:
      data: the compressed values: the original array (``none``), the bit patterns of bfloat16
        (``uint16``) or fp8 (``uint8``) values, int8 codes, or packed uint8 codes.
      scale: float32 or bfloat16 scales, or None.
      amax: the float32 ``amax(|x|)`` recorded by `DelayedFP8Codec`, or None.
      shape: static: the shape of the encoded array (without any leading axes added by
        `jax.vmap` or `jax.lax.scan`).
      layout: static: which codec layout produced ``data``; `decode` checks it.

    Examples:
      >>> import jax, jax.numpy as jnp, hifigrad as hg
      >>> enc = hg.get_codec("int8").encode(jnp.ones((4, 256)))
      >>> enc.shape, enc.data.dtype, enc.scale.shape
      ((4, 256), dtype('int8'), (8,))
      >>> len(jax.tree_util.tree_leaves(enc))      # a pytree of its stored arrays
      2
    """

    data: Any
    scale: Any = None
    amax: Any = None
    shape: tuple[int, ...] = ()
    layout: str = ""


jax.tree_util.register_dataclass(
    Encoded, data_fields=["data", "scale", "amax"], meta_fields=["shape", "layout"]
)


@runtime_checkable
class Codec(Protocol):
    """Interface of an activation codec.

    A codec is a hashable object (the built-in ones are frozen dataclasses) with a ``name``, a
    ``stochastic`` flag and ``encode`` / ``decode`` / ``nbytes`` methods; any object that has
    them can be passed as ``codec=`` (the check is structural, `typing.runtime_checkable`).

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> isinstance(hg.codecs.IntCodec(bits=4), hg.codecs.Codec)
      True
      >>> codec = hg.get_codec("bf16")
      >>> codec.decode(codec.encode(jnp.array([1.0, 3.0])), jnp.float32)
      Array([1., 3.], dtype=float32)
    """

    @property
    def name(self) -> str:
        """A short name for reports, e.g. ``"int4"``."""
        ...

    @property
    def stochastic(self) -> bool:
        """Whether `encode` rounds stochastically (and so uses a PRNG key)."""
        ...

    def encode(self, x: Array, *, key: Array | None = None) -> Encoded:
        """Compresses a floating-point array."""
        ...

    def decode(self, enc: Encoded, dtype: DTypeLike) -> Array:
        """Decompresses ``enc`` to an array of the original shape in ``dtype``."""
        ...

    def nbytes(self, shape: Sequence[int], dtype: DTypeLike) -> int:
        """Exact bytes `encode` stores for an array of this shape and dtype."""
        ...


# ----------------------------------------------------------------------------------------------
# Shared helpers


def _as_float_array(x: Any, codec_name: str) -> Array:
    """Checks that ``x`` is one floating-point array and returns it as a JAX array."""
    if isinstance(x, Encoded):
        raise TypeError(
            f"{codec_name}.encode got an Encoded value: it is already compressed. Pass the "
            "original floating-point array, or decode it first with codec.decode(enc, dtype)."
        )
    if isinstance(x, (dict, list, tuple)) or dataclasses.is_dataclass(x):
        raise TypeError(
            f"{codec_name}.encode takes a single array, got a {type(x).__name__}. Encode each "
            "leaf, e.g. jax.tree.map(codec.encode, tree)."
        )
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{codec_name}.encode compresses floating-point activations, got dtype {x.dtype}. "
            "Integer and boolean values are exact and usually small: leave them uncompressed "
            "(apply the codec to floating-point leaves only), or cast them with "
            "x.astype(jnp.float32) if you really mean to quantize them."
        )
    return x


def _check_float_dtype(dtype: DTypeLike, where: str) -> np.dtype:
    """Returns ``dtype`` as a NumPy dtype, raising ValueError unless it is floating-point."""
    if dtype is None:
        raise ValueError(f"{where}: dtype must be a floating-point dtype, got None.")
    dt = jnp.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(
            f"{where}: dtype must be a floating-point dtype (usually the original activation's "
            f"dtype), got {dt}."
        )
    return dt


def _check_encoded(enc: Any, layout: str, codec_name: str) -> Encoded:
    if not isinstance(enc, Encoded):
        raise TypeError(
            f"{codec_name}.decode expects the Encoded value returned by encode, got "
            f"{type(enc).__name__}."
        )
    if enc.layout != layout:
        raise ValueError(
            f"{codec_name}.decode got an encoding made by a different codec (layout "
            f"{enc.layout!r}, expected {layout!r}); decode with the codec that encoded it."
        )
    return enc


def _batch_shape(leaf: Array, trailing: tuple[int, ...], what: str) -> tuple[int, ...]:
    """The leading (vmap / scan) axes of ``leaf``, given its expected trailing shape."""
    nb = leaf.ndim - len(trailing)
    if nb < 0 or tuple(leaf.shape[nb:]) != tuple(trailing):
        raise ValueError(
            f"Encoded {what} has shape {leaf.shape}, expected any leading axes followed by "
            f"{tuple(trailing)}."
        )
    return tuple(leaf.shape[:nb])


def _fp8_max(dtype: Any) -> np.float32:
    return np.float32(jnp.finfo(dtype).max)


def _fp8_quantize(x32: Array, scale: Array, dtype: Any) -> Array:
    """``x32 / scale`` clipped to the fp8 range (saturating) and cast to ``dtype``."""
    fmax = _fp8_max(dtype)
    return jnp.clip(x32 / scale, -fmax, fmax).astype(dtype)


def _current_scale(amax: Array, fmax: np.float32) -> Array:
    """``amax / fmax``, floored at the smallest normal float32; NaN where amax is not finite.

    Computed as ``amax * (1 / fmax)``: XLA rewrites division by a constant into that under jit
    anyway, and writing it out gives the same bits eagerly, under jit and under vmap.
    """
    scale = jnp.maximum(amax * (np.float32(1) / fmax), _TINY)
    return jnp.where(jnp.isfinite(amax), scale, _NAN)


def _saturate(x: Array, dtype: DTypeLike, keep_inf: bool = False) -> Array:
    """``x`` cast to ``dtype``, finite values clipped to its finite range first.

    A finite activation close to the top of the range (float32's max, float16's 65504) can
    round past it when encoded or decoded (``scale`` is rounded up, ``bf16`` rounds to nearest);
    it must come back finite, never as inf. NaN stays NaN; with ``keep_inf`` inf stays inf.
    """
    y = x.astype(dtype)
    overflow = jnp.isinf(y) & (jnp.isfinite(x) if keep_inf else ~jnp.isnan(x))
    big = jnp.full_like(y, jnp.finfo(dtype).max)
    return jnp.where(overflow, jnp.where(x > 0, big, -big), y)


# Narrow floats are stored as their bit patterns (unsigned integers of the same width) and
# reinterpreted only when decoded. Integer storage keeps every backend's handling of the stored
# stack the same as for the integer codecs: XLA:CPU, which has no native bf16/fp8
# dynamic-slice, otherwise converts a whole stacked bf16 (fp8) residual to f32 (f16) outside a
# scan's backward loop, a copy 2x (4x) the size of what is saved. The bits are the float's, so
# values, SQNR and gradients are bitwise those of storing the float itself.
_BITS_DTYPE = {1: jnp.uint8, 2: jnp.uint16}


def _to_bits(x: Array) -> Array:
    """The bit pattern of a 1- or 2-byte float array, as uint8 / uint16 of the same shape."""
    return lax.bitcast_convert_type(x, _BITS_DTYPE[jnp.dtype(x.dtype).itemsize])


def _from_bits(bits: Array, dtype: Any) -> Array:
    """Inverse of `_to_bits`: reinterprets uint8 / uint16 ``bits`` as ``dtype``."""
    want = _BITS_DTYPE[jnp.dtype(dtype).itemsize]
    if bits.dtype != want:
        raise ValueError(
            f"Encoded data has dtype {bits.dtype}; this codec stores {jnp.dtype(dtype).name} "
            f"values as their {jnp.dtype(want).name} bit patterns. Decode with the codec that "
            "encoded it.")
    return lax.bitcast_convert_type(bits, dtype)


def _fp8_decode(enc: Encoded, dtype: DTypeLike, scale_trailing: tuple[int, ...],
                fp8_dtype: Any) -> Array:
    """``data * scale`` in ``dtype``; the scale broadcasts over the trailing axes it lacks."""
    shape = tuple(enc.shape)
    scale = enc.scale.astype(jnp.float32)
    scale = scale.reshape(scale.shape + (1,) * (len(shape) - len(scale_trailing)))
    return _saturate(_from_bits(enc.data, fp8_dtype).astype(jnp.float32) * scale, dtype)


def _bf16_scale(absmax: Array, qmax: int) -> Array:
    """The smallest bfloat16 ``s >= max(absmax / qmax, 2**-126)``, as float32.

    Guarantees ``absmax <= s * qmax`` exactly (the product of a bfloat16 and a 7-bit integer is
    exact in float32), so scaled values never exceed ``qmax``. Finite values that would round
    up to inf are clamped to the largest bfloat16; NaN and inf stay as they are.
    """
    q = np.float32(qmax)
    s = jnp.maximum(absmax * (np.float32(1) / q), _TINY)
    bits = lax.bitcast_convert_type(s, jnp.uint32)
    bits = (bits + np.uint32(0xFFFF)) & np.uint32(0xFFFF0000)  # round up to bfloat16
    # `absmax * (1 / qmax)` may round low by an ulp; if so, step to the next bfloat16.
    low = lax.bitcast_convert_type(bits, jnp.float32) * q < absmax
    bits = jnp.where(low, bits + np.uint32(0x10000), bits)
    s = lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(jnp.isfinite(absmax), jnp.minimum(s, _BF16_MAX), absmax)


_GOLDEN = np.uint32(0x9E3779B9)


def _mix32(v: Array) -> Array:
    """A bijective 32-bit integer hash with full avalanche (Wellons' "lowbias32")."""
    v = v ^ (v >> np.uint32(16))
    v = v * np.uint32(0x7FEB352D)
    v = v ^ (v >> np.uint32(15))
    v = v * np.uint32(0x846CA68B)
    return v ^ (v >> np.uint32(16))


def _content_hash(x: Array) -> Array:
    """A cheap 32-bit hash of the bits of ``x`` (position-dependent), as a uint32 scalar."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32).reshape(-1), jnp.uint32)
    idx = lax.iota(jnp.uint32, bits.size)
    return jnp.sum(_mix32(bits ^ (idx * _GOLDEN)), dtype=jnp.uint32)


def _key_words(key: Any) -> Array:
    """The uint32 words of a PRNG key (new-style typed key or legacy uint32 key)."""
    return jax.random.key_data(key).reshape(-1)


def _dither(words: Array, shape: tuple[int, ...]) -> Array:
    """Uniform float32 values in ``[0, 1)`` (multiples of 2**-24), one per element of ``shape``.

    A counter-based generator: element ``i`` gets ``mix(...mix(mix(i * golden ^ w0) ^ w1)...)``
    over the key words ``w``. Each key gives its own stream; it is much cheaper to run (and to
    compile) than `jax.random`'s threefry, and plenty for dithering.
    """
    h = lax.iota(jnp.uint32, _prod(shape)).reshape(shape) * _GOLDEN
    for i in range(words.shape[0]):
        h = _mix32(h ^ words[i])
    return (h >> np.uint32(8)).astype(jnp.float32) * np.float32(2.0**-24)


# Stored integer codes are lane-dense: rows of 128 bytes (the width of a TPU vector register
# and of its memory tiles), whatever the group size. A row of packed int4 (int2) bytes holds 256
# (512) consecutive codes, planar: byte ``i`` of the row holds codes ``i, 128 + i`` (and
# ``256 + i, 384 + i``), low bits first. Packing and unpacking so combine whole 128-wide slices
# with shifts and ors and never interleave neighbouring elements of the minor dimension. (An
# interleaved layout, codes ``2i, 2i + 1`` in byte ``i``, and a ``[groups, group_size / 2]``
# array were what XLA:TPU handled badly: a minor dimension of 32 or 8 bytes is padded to 128 in
# memory, and the interleave is a relayout of every element: int4 took 1.9x the memory and 2.8x
# the step time of a bf16 rematerialized scan, on a TPU v5e.)
_LANES = 128


def _code_rows(num_codes: int, bits: int) -> int:
    """Rows of `_LANES` bytes that hold ``num_codes`` codes of ``bits`` bits (zero-padded)."""
    per_row = _LANES * (8 // bits)
    return -(-num_codes // per_row)


def _pack(codes: Array, bits: int) -> Array:
    """Packs a flat array of ``bits``-bit codes into ``[rows, 128]`` bytes (planar, see above).

    ``codes`` (uint8 below ``2**bits``, or int8 for 8 bits) is zero-padded to whole rows."""
    k = 8 // bits
    rows = _code_rows(codes.shape[-1], bits)
    codes = jnp.pad(codes, (0, rows * k * _LANES - codes.shape[-1]))
    codes = codes.reshape(rows, k, _LANES)
    packed = codes[:, 0, :]
    for j in range(1, k):
        packed = packed | (codes[:, j, :] << np.uint8(bits * j))
    return packed


def _unpack(packed: Array, bits: int) -> Array:
    """Inverse of `_pack` (up to its padding): ``[..., rows, 128]`` bytes to
    ``[..., rows * 128 * (8 // bits)]`` codes; any leading axes are kept."""
    k = 8 // bits
    if k == 1:
        return packed.reshape(packed.shape[:-2] + (-1,))
    mask = np.uint8((1 << bits) - 1)
    parts = [(packed >> np.uint8(bits * j)) & mask for j in range(k)]
    codes = jnp.stack(parts, axis=-2)  # [..., rows, k, 128]
    return codes.reshape(packed.shape[:-2] + (-1,))


def _prod(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


# The quantizing codecs run their (validated) kernels as one jitted function each, keyed by the
# hashable codec: eagerly that is one compile per codec and shape instead of one per operation;
# inside an outer jit, vmap or scan it is inlined like any nested jit.
@functools.partial(jax.jit, static_argnums=0)
def _encode_kernel(codec: Any, x: Array, key: Any, state: Any) -> Encoded:
    return codec._encode(x, key, state)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _decode_kernel(codec: Any, enc: Encoded, dtype: np.dtype) -> Array:
    return codec._decode(enc, dtype)


# ----------------------------------------------------------------------------------------------
# Codecs


@dataclasses.dataclass(frozen=True)
class NoneCodec:
    """Identity codec: stores the activation unchanged (4 bytes per float32 element).

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> hg.codecs.NoneCodec().nbytes((2, 3), jnp.float32)
      24
    """

    @property
    def name(self) -> str:
        return "none"

    @property
    def stochastic(self) -> bool:
        return False

    def encode(self, x: Array, *, key: Array | None = None) -> Encoded:
        """Stores ``x`` as is (``key`` is ignored)."""
        del key
        x = _as_float_array(x, type(self).__name__)
        return Encoded(data=x, shape=tuple(x.shape), layout="none")

    def decode(self, enc: Encoded, dtype: DTypeLike) -> Array:
        """Returns the stored array cast to ``dtype``."""
        dtype = _check_float_dtype(dtype, f"{type(self).__name__}.decode")
        enc = _check_encoded(enc, "none", type(self).__name__)
        _batch_shape(enc.data, tuple(enc.shape), "data")
        return enc.data.astype(dtype)

    def nbytes(self, shape: Sequence[int], dtype: DTypeLike) -> int:
        """``prod(shape) * itemsize(dtype)``."""
        dt = _check_float_dtype(dtype, f"{type(self).__name__}.nbytes")
        return _prod(shape) * dt.itemsize


@dataclasses.dataclass(frozen=True)
class BF16Codec:
    """Casts to bfloat16 (2 bytes per element; relative error at most ``2**-8``).

    Values beyond bfloat16's finite range saturate; inf and NaN are kept.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> codec = hg.codecs.BF16Codec()
      >>> enc = codec.encode(jnp.array([1.0, 1.0 + 2.0**-10]))
      >>> enc.data.dtype, codec.decode(enc, jnp.float32)
      (dtype('uint16'), Array([1., 1.], dtype=float32))
    """

    @property
    def name(self) -> str:
        return "bf16"

    @property
    def stochastic(self) -> bool:
        return False

    def encode(self, x: Array, *, key: Array | None = None) -> Encoded:
        """Stores ``x.astype(bfloat16)`` (``key`` is ignored)."""
        del key
        x = _as_float_array(x, type(self).__name__)
        data = _to_bits(_saturate(x, jnp.bfloat16, keep_inf=True))
        return Encoded(data=data, shape=tuple(x.shape), layout="bf16")

    def decode(self, enc: Encoded, dtype: DTypeLike) -> Array:
        """Casts the stored bfloat16 values to ``dtype``."""
        dtype = _check_float_dtype(dtype, f"{type(self).__name__}.decode")
        enc = _check_encoded(enc, "bf16", type(self).__name__)
        _batch_shape(enc.data, tuple(enc.shape), "data")
        return _saturate(_from_bits(enc.data, jnp.bfloat16), dtype, keep_inf=True)

    def nbytes(self, shape: Sequence[int], dtype: DTypeLike) -> int:
        """``2 * prod(shape)``."""
        _check_float_dtype(dtype, f"{type(self).__name__}.nbytes")
        return 2 * _prod(shape)


@dataclasses.dataclass(frozen=True)
class FP8Codec:
    """fp8 with current scaling, per tensor or per row.

    ``scale = amax(|x|) / fp8_max`` is computed from the array being encoded (per tensor, or
    per row of ``x`` viewed as ``[prod(shape[:-1]), shape[-1]]``) and stored in float32;
    ``x / scale`` is clipped to ``±fp8_max`` and cast. Storage: 1 byte per element plus 4
    bytes per tensor (``scaling="tensor"``) or per row (``scaling="row"``).

    Per-row scaling costs ``4 / shape[-1]`` bytes per element more but keeps one outlier row
    (a token with a huge activation) from pushing the other rows' small values into fp8's
    subnormal range.

    Attributes:
      fmt: ``"e4m3"`` (float8_e4m3fn: 3 mantissa bits, max 448) or ``"e5m2"`` (float8_e5m2:
        2 mantissa bits, max 57344).
      scaling: ``"tensor"`` or ``"row"``.

    Raises:
      ValueError: an unknown ``fmt`` or ``scaling``.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> codec = hg.codecs.FP8Codec("e4m3", scaling="row")
      >>> x = jnp.array([[1.0, -448.0], [0.5, 0.25]])
      >>> codec.decode(codec.encode(x), jnp.float32)
      Array([[ 1.00e+00, -4.48e+02],
             [ 5.00e-01,  2.50e-01]], dtype=float32)
      >>> codec.name, codec.nbytes(x.shape, jnp.float32)
      ('fp8_e4m3_row', 12)
    """

    fmt: str = "e4m3"
    scaling: str = "tensor"

    def __post_init__(self):
        if self.fmt not in _FP8_DTYPES:
            raise ValueError(
                f"FP8Codec: fmt must be one of {sorted(_FP8_DTYPES)}, got {self.fmt!r}."
            )
        if self.scaling not in _SCALINGS:
            raise ValueError(f"FP8Codec: scaling must be one of {_SCALINGS}, got {self.scaling!r}.")

    @property
    def name(self) -> str:
        return f"fp8_{self.fmt}" + ("_row" if self.scaling == "row" else "")

    @property
    def stochastic(self) -> bool:
        return False

    @property
    def _layout(self) -> str:
        return f"fp8_{self.fmt}_{self.scaling}"

    def _scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[:-1] if self.scaling == "row" else ()

    def encode(self, x: Array, *, key: Array | None = None) -> Encoded:
        """Quantizes ``x`` to fp8 with a scale computed from ``x`` (``key`` is ignored)."""
        del key
        return _encode_kernel(self, _as_float_array(x, self.name), None, None)

    def _encode(self, x: Array, key: None, state: None) -> Encoded:
        del key, state
        dtype = _FP8_DTYPES[self.fmt]
        x32 = x.astype(jnp.float32)
        abs_x = jnp.abs(x32)
        if self.scaling == "row" and x.ndim > 0:
            amax = jnp.max(abs_x, axis=-1, initial=np.float32(0))
            scale = _current_scale(amax, _fp8_max(dtype))
            data = _fp8_quantize(x32, scale[..., None], dtype)
        else:
            amax = jnp.max(abs_x, initial=np.float32(0))
            scale = _current_scale(amax, _fp8_max(dtype))
            data = _fp8_quantize(x32, scale, dtype)
        return Encoded(data=_to_bits(data), scale=scale, shape=tuple(x.shape), layout=self._layout)

    def decode(self, enc: Encoded, dtype: DTypeLike) -> Array:
        """Returns ``data * scale`` in ``dtype``."""
        dtype = _check_float_dtype(dtype, f"{self.name}.decode")
        enc = _check_encoded(enc, self._layout, self.name)
        scale_shape = self._scale_shape(tuple(enc.shape))
        _batch_shape(enc.data, tuple(enc.shape), "data")
        _batch_shape(enc.scale, scale_shape, "scale")
        return _decode_kernel(self, enc, dtype)

    def _decode(self, enc: Encoded, dtype: np.dtype) -> Array:
        return _fp8_decode(enc, dtype, self._scale_shape(tuple(enc.shape)),
                           _FP8_DTYPES[self.fmt])

    def nbytes(self, shape: Sequence[int], dtype: DTypeLike) -> int:
        """``prod(shape)`` fp8 bytes plus 4 bytes per scale."""
        _check_float_dtype(dtype, f"{self.name}.nbytes")
        shape = tuple(shape)
        return _prod(shape) + 4 * _prod(self._scale_shape(shape))


@dataclasses.dataclass(frozen=True)
class DelayedFP8Codec:
    """fp8 with delayed scaling: the scale comes from a history of past amaxes.

    This is the scheme of Flax's ``nn.fp8_ops`` (and Transformer Engine): the array is
    quantized with a scale known before it is seen, ``x / scale`` is clipped to ``±fp8_max``
    (values beyond ``fp8_max * scale`` saturate), and ``amax(|x|)`` is recorded for later
    steps. Storage: 1 byte per element plus the float32 scale and amax (8 bytes).

    The state is a dict ``{"scale": f32[], "amax_history": f32[history_len]}`` that the caller
    owns and threads through training steps, like an optimizer state (it is not
    differentiated)::

        codec = DelayedFP8Codec("e4m3")
        state = codec.init_state()

        def loss_fn(params, state, batch):
            ...
            enc = codec.encode(x, state=state)  # inside a scan: enc.amax is stacked per step
            ...
            return loss, enc.amax               # return the amaxes as auxiliary output

        (loss, amaxes), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, batch)
        state = codec.update_state(state, amaxes)  # max over steps / microbatches, then roll

    `update_state` takes the max over all axes of ``amaxes``, so amaxes stacked by
    `jax.lax.scan`, `jax.vmap` or gradient-accumulation microbatches can be passed as is.

    Differences from Flax: the history is ordered newest first, and `update_state` computes the
    next scale from the history *including* the amax just recorded (Flax computes it before
    adding it). A non-finite amax is kept in the history (visible for debugging) but ignored
    when computing the scale; if no finite positive amax is left, the previous scale is kept.
    The encode of an array containing NaN or inf stores a NaN scale, so it decodes to NaN.

    Attributes:
      fmt: ``"e4m3"`` or ``"e5m2"``.
      history_len: the number of past amaxes the scale is computed from.

    Raises:
      ValueError: an unknown ``fmt``, or ``history_len`` not a positive int.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> codec = hg.codecs.DelayedFP8Codec("e4m3", history_len=4)
      >>> state = codec.init_state()
      >>> enc = codec.encode(jnp.array([2.0, -896.0]), state=state)   # scale 1: saturates
      >>> codec.decode(enc, jnp.float32), enc.amax
      (Array([   2., -448.], dtype=float32), Array(896., dtype=float32))
      >>> state = codec.update_state(state, enc.amax)                  # next scale: 896 / 448
      >>> codec.decode(codec.encode(jnp.array([2.0, -896.0]), state=state), jnp.float32)
      Array([   2., -896.], dtype=float32)
    """

    fmt: str = "e4m3"
    history_len: int = 16

    def __post_init__(self):
        if self.fmt not in _FP8_DTYPES:
            raise ValueError(
                f"DelayedFP8Codec: fmt must be one of {sorted(_FP8_DTYPES)}, got {self.fmt!r}."
            )
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(
                f"DelayedFP8Codec: history_len must be a positive int, got {self.history_len!r}."
            )

    @property
    def name(self) -> str:
        return f"fp8_{self.fmt}_delayed"

    @property
    def stochastic(self) -> bool:
        return False

    @property
    def _layout(self) -> str:
        return f"fp8_{self.fmt}_delayed"

    @property
    def fp8_max(self) -> float:
        """The largest finite value of the fp8 format (448 or 57344)."""
        return float(_fp8_max(_FP8_DTYPES[self.fmt]))

    def init_state(self) -> dict[str, Array]:
        """The initial state: scale 1 and an all-zero amax history."""
        return {
            "scale": jnp.ones((), jnp.float32),
            "amax_history": jnp.zeros((self.history_len,), jnp.float32),
        }

    def _state_scale(self, state: Mapping[str, Array]) -> Array:
        return jnp.reshape(jnp.asarray(state["scale"]).astype(jnp.float32), ())

    def encode(
        self,
        x: Array,
        *,
        key: Array | None = None,
        state: Mapping[str, Array] | None = None,
    ) -> Encoded:
        """Quantizes ``x`` with ``state["scale"]`` and records ``amax(|x|)`` in ``enc.amax``.

        Args:
          x: a floating-point array.
          key: ignored (the rounding is deterministic).
          state: the scaling state from `init_state` / `update_state`. Required.

        Returns:
          An `Encoded` with fp8 ``data``, the float32 ``scale`` used (NaN if ``x`` holds NaN or
          inf) and the float32 ``amax``.
        """
        del key
        if state is None:
            raise TypeError(
                f"{self.name}.encode needs the delayed-scaling state: call "
                "codec.encode(x, state=state) with state from codec.init_state() / "
                "codec.update_state(...). Use FP8Codec for stateless (current) scaling."
            )
        x = _as_float_array(x, self.name)
        return _encode_kernel(self, x, None, dict(state))

    def _encode(self, x: Array, key: None, state: Mapping[str, Array]) -> Encoded:
        del key
        x32 = x.astype(jnp.float32)
        amax = jnp.max(jnp.abs(x32), initial=np.float32(0))
        scale = jnp.where(jnp.isfinite(amax), self._state_scale(state), _NAN)
        data = _to_bits(_fp8_quantize(x32, scale, _FP8_DTYPES[self.fmt]))
        return Encoded(data=data, scale=scale, amax=amax, shape=tuple(x.shape), layout=self._layout)

    def decode(self, enc: Encoded, dtype: DTypeLike) -> Array:
        """Returns ``data * scale`` in ``dtype``."""
        dtype = _check_float_dtype(dtype, f"{self.name}.decode")
        enc = _check_encoded(enc, self._layout, self.name)
        _batch_shape(enc.data, tuple(enc.shape), "data")
        _batch_shape(enc.scale, (), "scale")
        return _decode_kernel(self, enc, dtype)

    def _decode(self, enc: Encoded, dtype: np.dtype) -> Array:
        return _fp8_decode(enc, dtype, (), _FP8_DTYPES[self.fmt])

    def update_state(self, state: Mapping[str, Array], amaxes: Array) -> dict[str, Array]:
        """Records new amaxes and computes the next scale.

        Args:
          state: the current state.
          amaxes: ``enc.amax`` of one encode, or many stacked along any leading axes (scan
            steps, microbatches); their max is recorded as one history entry.

        Returns:
          The new state: the history rolled by one with the new amax first, and
          ``scale = max(finite history) / fp8_max`` (the previous scale if that max is 0).
        """
        amax = jnp.max(jnp.asarray(amaxes).astype(jnp.float32), initial=np.float32(0))
        history = jnp.asarray(state["amax_history"]).astype(jnp.float32)
        history = jnp.roll(history, 1).at[0].set(amax)
        hmax = jnp.max(jnp.where(jnp.isfinite(history), history, np.float32(0)))
        new_scale = jnp.maximum(hmax * (np.float32(1) / np.float32(self.fp8_max)), _TINY)
        scale = jnp.where(hmax > 0, new_scale, self._state_scale(state))
        return {"scale": scale, "amax_history": history}

    def nbytes(self, shape: Sequence[int], dtype: DTypeLike) -> int:
        """``prod(shape)`` fp8 bytes plus the float32 scale and amax (8 bytes)."""
        _check_float_dtype(dtype, f"{self.name}.nbytes")
        return _prod(shape) + 8


@dataclasses.dataclass(frozen=True, init=False)
class IntCodec:
    """Symmetric absmax integer quantization per group, with bit packing.

    The array is flattened and cut into groups of ``group_size`` consecutive elements (the tail
    is zero-padded). Each group stores ``scale = absmax / qmax`` as bfloat16, rounded up (so
    ``|x| / scale <= qmax`` and nothing clips), and codes ``q = round(x / scale)`` in
    ``[-qmax, qmax]``, ``qmax = 2**(bits - 1) - 1``; decode is ``q * scale``. int4 stores
    ``q + 7`` in 4 bits, two per byte; int2 stores ``q + 1`` in 2 bits, four per byte.

    int2 uses the three levels ``{-1, 0, 1}`` (code 3 unused) rather than four: zero stays
    exact, so the many zeros of ReLU outputs, padding and masks decode to exact zeros with no
    dither noise, and int2 shares the symmetric scheme (and unbiasedness argument) of int8 and
    int4. A four-level grid would have a step 2/3 as large but no zero.

    Default group sizes, with the ratio vs float32 ``bits/32 + 2 / (4 * group_size)``:

    * int8: 128 -> 0.2539 (limit 0.30). The step ``absmax/127`` is already fine; a larger
      group keeps the scale overhead at 1.6%.
    * int4: 64 -> 0.1328 (limit 0.16). Smaller groups shrink ``absmax`` and so the step.
    * int2: 32 -> 0.0781 (limit 0.09). The step *is* the group's absmax, so the group is
      kept small; 16 would give 0.0938, over the limit.

    Rounding: int8 rounds to nearest by default (error at most half a step). int4 and int2
    round stochastically by default: ``q = floor(y) + 1`` with probability ``frac(y)``, where
    ``y = x / scale``, else ``floor(y)``. That is unbiased (``E[q] = y``, and nothing clips
    since ``|y| <= qmax``): the backward pass sees quantization noise rather than a systematic
    error. The uniform dither is a counter-based hash of the key's bits and the element index
    (cheaper than `jax.random`, and identical eagerly, under jit and under vmap). Without a
    ``key``, the key words are ``(seed, hash(x))``, a cheap 32-bit hash of x's bits, so
    different activations get different dither and encoding stays a pure function of ``x``.

    A group of zeros stores the smallest normal float32 as scale and decodes to exact zeros; a
    group holding NaN or inf stores a NaN scale and decodes to NaN.

    Attributes:
      bits: 8, 4 or 2.
      group_size: elements per scale; a multiple of ``8 // bits``. Default: 128, 64, 32.
      stochastic: stochastic rounding. Default: False for int8, True for int4 and int2.
      seed: seed of the default dither key (used when ``encode`` gets no ``key``).

    Raises:
      ValueError: ``bits`` not 8, 4 or 2; ``group_size`` not a positive multiple of
        ``8 // bits``; ``seed`` outside ``[0, 2**32)``.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> codec = hg.codecs.IntCodec(bits=8, group_size=4)
      >>> codec.decode(codec.encode(jnp.array([127.0, -63.5, 0.0, 1.0])), jnp.float32)
      Array([127., -64.,   0.,   1.], dtype=float32)
      >>> hg.codecs.IntCodec(bits=4).name, hg.codecs.IntCodec(bits=4, stochastic=False).name
      ('int4', 'int4_rtn')
    """

    bits: int
    group_size: int
    stochastic: bool
    seed: int

    def __init__(
        self,
        bits: int = 8,
        group_size: int | None = None,
        stochastic: bool | None = None,
        seed: int = 0,
    ):
        if bits not in _INT_DEFAULT_GROUP_SIZE:
            raise ValueError(f"IntCodec: bits must be 8, 4 or 2, got {bits!r}.")
        if group_size is None:
            group_size = _INT_DEFAULT_GROUP_SIZE[bits]
        per_byte = 8 // bits
        if not isinstance(group_size, int) or group_size < 1 or group_size % per_byte:
            raise ValueError(
                f"IntCodec: group_size must be a positive multiple of {per_byte} for "
                f"{bits}-bit codes ({per_byte} per byte), got {group_size!r}."
            )
        if stochastic is None:
            stochastic = _INT_DEFAULT_STOCHASTIC[bits]
        if not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"IntCodec: seed must be an int in [0, 2**32), got {seed!r}.")
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "group_size", group_size)
        object.__setattr__(self, "stochastic", bool(stochastic))
        object.__setattr__(self, "seed", seed)

    @property
    def name(self) -> str:
        name = f"int{self.bits}"
        if self.group_size != _INT_DEFAULT_GROUP_SIZE[self.bits]:
            name += f"_g{self.group_size}"
        if self.stochastic != _INT_DEFAULT_STOCHASTIC[self.bits]:
            name += "_sr" if self.stochastic else "_rtn"
        return name

    @property
    def _layout(self) -> str:
        return f"int{self.bits}_g{self.group_size}_rows128"

    @property
    def _qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def _num_groups(self, size: int) -> int:
        return -(-size // self.group_size)

    def encode(self, x: Array, *, key: Array | None = None) -> Encoded:
        """Quantizes ``x`` group by group.

        Args:
          x: a floating-point array.
          key: PRNG key (typed or legacy uint32) for stochastic rounding; ignored when
            ``stochastic`` is False. If None, one is derived from ``seed`` and a hash of ``x``.
            One key gives one dither pattern per shape (e.g. for every example under a vmap
            with an unbatched key); split keys for independent dither.

        Returns:
          An `Encoded` with ``data`` of shape ``[rows, 128]`` (int8 codes, or packed uint8
          codes: ``rows = ceil(groups * group_size * bits / 1024)``) and bfloat16 ``scale`` of
          shape ``[groups]``.
        """
        return _encode_kernel(self, _as_float_array(x, self.name), key, None)

    def _encode(self, x: Array, key: Any, state: None) -> Encoded:
        del state
        g, qmax = self.group_size, np.float32(self._qmax)
        n, ng = x.size, self._num_groups(x.size)
        flat = x.astype(jnp.float32).reshape(-1)
        groups = jnp.pad(flat, (0, ng * g - n)).reshape(ng, g)
        absmax = jnp.max(jnp.abs(groups), axis=1, initial=np.float32(0))
        finite = jnp.isfinite(absmax)
        scale = jnp.where(finite, _bf16_scale(absmax, self._qmax), _NAN)
        y = groups / scale[:, None]
        if self.stochastic:
            if key is None:
                words = jnp.stack([jnp.asarray(np.uint32(self.seed)), _content_hash(x)])
            else:
                words = _key_words(key)
            # floor(y) + 1 with probability frac(y) (to within 2**-24): E[q] = y. y - floor(y)
            # is exact in float32, so no rounding of y + u biases the result.
            floor = jnp.floor(y)
            q = floor + (_dither(words, y.shape) < y - floor).astype(jnp.float32)
        else:
            q = jnp.round(y)
        q = jnp.where(finite[:, None], jnp.clip(q, -qmax, qmax), np.float32(0)).reshape(-1)
        if self.bits == 8:
            data = _pack(q.astype(jnp.int8), 8)
        else:
            data = _pack((q + qmax).astype(jnp.uint8), self.bits)
        return Encoded(
            data=data, scale=scale.astype(jnp.bfloat16), shape=tuple(x.shape), layout=self._layout
        )

    def decode(self, enc: Encoded, dtype: DTypeLike) -> Array:
        """Returns ``codes * scale`` in ``dtype``, with the original shape."""
        dtype = _check_float_dtype(dtype, f"{self.name}.decode")
        enc = _check_encoded(enc, self._layout, self.name)
        ng = self._num_groups(_prod(enc.shape))
        rows = _code_rows(ng * self.group_size, self.bits)
        _batch_shape(enc.data, (rows, _LANES), "data")
        _batch_shape(enc.scale, (ng,), "scale")
        return _decode_kernel(self, enc, dtype)

    def _decode(self, enc: Encoded, dtype: np.dtype) -> Array:
        shape = tuple(enc.shape)
        n, ng = _prod(shape), self._num_groups(_prod(shape))
        batch = tuple(enc.data.shape[:-2])
        q = _unpack(enc.data, self.bits)[..., :ng * self.group_size].astype(jnp.float32)
        if self.bits != 8:
            q = q - np.float32(self._qmax)
        q = q.reshape(batch + (ng, self.group_size))
        out = q * enc.scale.astype(jnp.float32)[..., None]
        out = out.reshape(batch + (ng * self.group_size,))[..., :n]
        return _saturate(out.reshape(batch + shape), dtype)

    def nbytes(self, shape: Sequence[int], dtype: DTypeLike) -> int:
        """Packed codes, in whole rows of 128 bytes, plus one bfloat16 scale per group:
        ``128 * ceil(groups * group_size * bits / 1024) + 2 * groups`` (that is
        ``groups * (group_size * bits / 8 + 2)`` when the codes fill their last row)."""
        _check_float_dtype(dtype, f"{self.name}.nbytes")
        ng = self._num_groups(_prod(shape))
        return _LANES * _code_rows(ng * self.group_size, self.bits) + 2 * ng


_NAMED_CODECS = {
    "none": NoneCodec,
    "bf16": BF16Codec,
    "fp8_e4m3": lambda: FP8Codec("e4m3"),
    "fp8_e5m2": lambda: FP8Codec("e5m2"),
    "int8": lambda: IntCodec(bits=8),
    "int4": lambda: IntCodec(bits=4),
    "int2": lambda: IntCodec(bits=2),
}


def get_codec(spec: str | Codec) -> Codec:
    """Returns a codec from a name or passes a codec through.

    Args:
      spec: a `Codec` instance, or one of ``"none"``, ``"bf16"``, ``"fp8_e4m3"``,
        ``"fp8_e5m2"``, ``"int8"``, ``"int4"``, ``"int2"`` (default settings; construct the
        classes for others, e.g. ``IntCodec(bits=4, group_size=128)`` or `DelayedFP8Codec`).

    Returns:
      The codec.

    Raises:
      ValueError: for an unknown name.
      TypeError: for anything that is neither a string nor a codec.

    Examples:
      >>> import hifigrad as hg
      >>> hg.get_codec("int4")
      IntCodec(bits=4, group_size=64, stochastic=True, seed=0)
      >>> hg.get_codec("fp8_e4m3").nbytes((16, 64, 256), "float32") / (16 * 64 * 256 * 4)
      0.2500038146972656
    """
    if isinstance(spec, str):
        try:
            return _NAMED_CODECS[spec]()
        except KeyError:
            valid = ", ".join(repr(k) for k in _NAMED_CODECS)
            raise ValueError(
                f"Unknown codec {spec!r}. Valid names: {valid}; or pass a Codec instance "
                "(NoneCodec, BF16Codec, FP8Codec, DelayedFP8Codec, IntCodec)."
            ) from None
    if isinstance(spec, Codec):
        return spec
    raise TypeError(
        f"get_codec expects a codec name or a Codec instance, got {type(spec).__name__}."
    )
