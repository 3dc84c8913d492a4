"""Tests for the activation codecs in `hifigrad._src.codecs`.

Error bounds are derived from the formats, not tuned:

* bf16 rounds to nearest with 8 significant bits: relative error <= 2**-8 (half a spacing).
* fp8 rounds ``y = x / scale`` to nearest: the error in ``y`` is at most half a spacing,
  ``2**-(nmant+1) * |y|`` in the normal range and ``2**(minexp-nmant-1)`` (half the subnormal
  spacing) below it; that is ``2**-4 |y|`` for e4m3 and ``2**-3 |y|`` for e5m2.
* int codes round ``y = x / scale`` to nearest (error <= scale / 2) or stochastically
  (error < scale), and the bfloat16 scale is ``absmax / qmax`` rounded up by less than 2**-7.

On top of that, each bound allows a few float32 roundings (``x / scale`` and ``q * scale``:
``2**-22 |x|`` covers them with margin) and ``2**-126`` absolute, because XLA on CPU flushes
subnormal results to zero.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hifigrad._src.codecs import (
    BF16Codec,
    Codec,
    DelayedFP8Codec,
    Encoded,
    FP8Codec,
    IntCodec,
    NoneCodec,
    get_codec,
)

TINY = float(np.finfo(np.float32).tiny)  # 2**-126
INV_448 = np.float32(1) / np.float32(448)  # scales are amax * (1 / fp8_max) in float32
F32_SLACK = 2.0**-22

NAMES = ["none", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2"]

CODECS = [
    NoneCodec(),
    BF16Codec(),
    FP8Codec("e4m3"),
    FP8Codec("e5m2"),
    FP8Codec("e4m3", scaling="row"),
    DelayedFP8Codec("e4m3"),
    IntCodec(8),
    IntCodec(4),
    IntCodec(2),
    IntCodec(4, group_size=128, stochastic=False),
    IntCodec(2, group_size=64, stochastic=False),
]
LOSSY = [c for c in CODECS if not isinstance(c, NoneCodec)]


def _id(c):
    return repr(c)


# ----------------------------------------------------------------------------------------------
# Helpers


def _encode(codec, x, **kw):
    """Encodes ``x``; a delayed codec gets the state it would have after seeing ``x``."""
    if isinstance(codec, DelayedFP8Codec):
        state = codec.init_state()
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
            amax = jnp.max(jnp.abs(x.astype(jnp.float32)), initial=np.float32(0))
            state = codec.update_state(state, amax)
        return codec.encode(x, state=state, **kw)
    return codec.encode(x, **kw)


@functools.cache
def _codec_fns(codec, transform, dtype):
    """``encode(x, key)`` and ``decode(enc)`` wrapped by ``transform`` (`maybe_jit`).

    Cached, so under jit each codec compiles once per input shape for the whole file.
    """
    encode = transform(lambda x, key: _encode(codec, x, key=key))
    decode = transform(lambda enc: codec.decode(enc, dtype))
    return encode, decode


def _roundtrip(codec, x, maybe_jit, dtype=jnp.float32, key=None):
    encode, decode = _codec_fns(codec, maybe_jit, dtype)
    enc = encode(x, key)
    return enc, decode(enc)


def _leaf_bytes(tree):
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def _fp8_dtype(codec):
    return {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[codec.fmt]


def _per_element_scale(codec, enc, x):
    """The scale each element of ``x`` was quantized with, as float64 of x's shape."""
    s = np.asarray(enc.scale.astype(jnp.float32), np.float64)
    if isinstance(codec, IntCodec):
        n, g = x.size, codec.group_size
        return np.repeat(s, g)[:n].reshape(x.shape)
    if isinstance(codec, FP8Codec) and codec.scaling == "row":
        return np.broadcast_to(s[..., None], x.shape)
    return np.broadcast_to(s, x.shape)


def _error_bound(codec, enc, x):
    """Per-element bound on |decode(encode(x)) - x| for finite x, derived from the format."""
    ax = np.abs(np.asarray(x, np.float64))
    floor = F32_SLACK * ax + TINY
    if isinstance(codec, NoneCodec):
        return np.zeros_like(ax)
    if isinstance(codec, BF16Codec):
        return 2.0**-8 * ax + floor
    s = _per_element_scale(codec, enc, x)
    if isinstance(codec, (FP8Codec, DelayedFP8Codec)):
        fi = jnp.finfo(_fp8_dtype(codec))
        m, emin = int(fi.nmant), int(fi.minexp)
        half_spacing = np.maximum(2.0 ** -(m + 1) * ax / s, 2.0 ** (emin - m - 1))
        return half_spacing * s * (1 + 2.0**-20) + floor
    assert isinstance(codec, IntCodec)
    step = 1.0 if codec.stochastic else 0.5
    return (step + 2.0**-16) * s + floor


# One shape for most cases (eager op-by-op execution compiles each op once per shape). 480
# elements: a padded tail for every default group size (128, 64 and 32 do not divide 120).
SHAPE = (4, 120)


def _normal(seed, shape=SHAPE, dtype=np.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _wide_range(seed, shape=SHAPE, lo=-3.0, hi=3.0):
    """Random signs and log-uniform magnitudes in [10**lo, 10**hi]."""
    rng = np.random.default_rng(seed)
    mag = 10.0 ** rng.uniform(lo, hi, shape)
    return jnp.asarray((mag * rng.choice([-1.0, 1.0], shape)).astype(np.float32))


# ----------------------------------------------------------------------------------------------
# Registry, attributes, memory


@pytest.mark.parametrize("name", NAMES)
def test_get_codec_names(name):
    codec = get_codec(name)
    assert isinstance(codec, Codec)
    assert codec.name == name
    assert get_codec(codec) is codec
    assert codec == get_codec(name)  # frozen dataclasses: equal and hashable
    hash(codec)


def test_get_codec_errors():
    with pytest.raises(ValueError, match="Valid names: 'none', 'bf16', 'fp8_e4m3'.*'int2'"):
        get_codec("int3")
    with pytest.raises(TypeError, match="codec name or a Codec instance"):
        get_codec(8)  # type: ignore[arg-type]


def test_attributes():
    assert [IntCodec(b).stochastic for b in (8, 4, 2)] == [False, True, True]
    assert [IntCodec(b).group_size for b in (8, 4, 2)] == [128, 64, 32]
    assert not any(c.stochastic for c in CODECS if not isinstance(c, IntCodec))
    assert IntCodec(4, group_size=128, stochastic=False).name == "int4_g128_rtn"
    assert FP8Codec("e5m2", "row").name == "fp8_e5m2_row"
    assert DelayedFP8Codec().name == "fp8_e4m3_delayed"
    assert len({c.name for c in CODECS}) == len(CODECS)


@pytest.mark.parametrize("codec", CODECS, ids=_id)
@pytest.mark.parametrize("shape", [(16, 64, 256), (3, 5, 7), (37,), ()], ids=str)
def test_nbytes_equals_stored_leaves(codec, shape):
    x = jnp.ones(shape, jnp.float32)
    enc = jax.eval_shape(lambda x: _encode(codec, x), x)
    assert _leaf_bytes(enc) == codec.nbytes(shape, jnp.float32)
    for dtype in (jnp.bfloat16, jnp.float16):
        enc = jax.eval_shape(lambda x: _encode(codec, x), x.astype(dtype))
        assert _leaf_bytes(enc) == codec.nbytes(shape, dtype)


# Exact bytes per element vs float32 for [16, 64, 256] (n = 262144 elements, 1024 rows):
#   fp8 tensor: (n + 4) / 4n; fp8 row: (n + 4*1024) / 4n; delayed: (n + 8) / 4n;
#   int: bits/32 + 2 / (4 * group_size)  (one bfloat16 scale per group).
MEMORY_RATIOS = {
    "none": 1.0,
    "bf16": 0.5,
    "fp8_e4m3": 0.25 + 1 / 262144,  # 0.2500038
    "fp8_e5m2": 0.25 + 1 / 262144,
    "fp8_e4m3_row": 0.25 + 1 / 256,  # 0.2539063
    "fp8_e4m3_delayed": 0.25 + 2 / 262144,  # 0.2500076
    "int8": 0.25 + 1 / 256,  # 0.2539063, limit 0.30
    "int4": 0.125 + 1 / 128,  # 0.1328125, limit 0.16
    "int2": 0.0625 + 1 / 64,  # 0.0781250, limit 0.09
}
MEMORY_LIMITS = {"int8": 0.30, "int4": 0.16, "int2": 0.09}


@pytest.mark.parametrize("name", sorted(MEMORY_RATIOS))
def test_memory_ratio(name):
    codec = {
        "fp8_e4m3_row": FP8Codec("e4m3", "row"),
        "fp8_e4m3_delayed": DelayedFP8Codec("e4m3"),
    }.get(name) or get_codec(name)
    shape = (16, 64, 256)
    ratio = codec.nbytes(shape, jnp.float32) / (math.prod(shape) * 4)
    assert ratio == MEMORY_RATIOS[name]
    assert ratio <= MEMORY_LIMITS.get(name, 1.0)


@pytest.mark.parametrize("codec", LOSSY, ids=_id)
def test_no_full_precision_copy(codec):
    x = jnp.ones((16, 256), jnp.float32)
    for leaf in jax.tree.leaves(jax.eval_shape(lambda x: _encode(codec, x), x)):
        assert leaf.size < x.size or leaf.dtype.itemsize <= 2


# ----------------------------------------------------------------------------------------------
# Round-trip accuracy


@pytest.mark.parametrize("codec", CODECS, ids=_id)
def test_roundtrip_error_bound(codec, maybe_jit):
    rows = np.array([1e-3, 1e-1, 1e1, 1e3], np.float32)[:, None]  # rows of different scales
    x = _wide_range(0) * jnp.asarray(rows)
    enc, dec = _roundtrip(codec, x, maybe_jit)
    assert dec.shape == x.shape and dec.dtype == jnp.float32
    err = np.abs(np.asarray(dec, np.float64) - np.asarray(x, np.float64))
    assert np.all(err <= _error_bound(codec, enc, x))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_fp8_scale_and_relative_error_near_amax(fmt, scaling, maybe_jit):
    codec = FP8Codec(fmt, scaling)
    x = _normal(1) * np.float32(3)
    enc, dec = _roundtrip(codec, x, maybe_jit)
    fi = jnp.finfo(_fp8_dtype(codec))
    axis = -1 if scaling == "row" else None
    amax = np.max(np.abs(np.asarray(x)), axis=axis)
    inv_max = np.float32(1) / np.float32(fi.max)
    np.testing.assert_array_equal(enc.scale, amax * inv_max)  # amax / fp8_max, as amax * (1/max)
    # Near amax (scaled values >= fp8_max / 2, normal range), the relative error is at most
    # half a spacing: 2**-(nmant + 1) = 2**-4 (e4m3) or 2**-3 (e5m2).
    near = np.abs(np.asarray(x)) >= 0.5 * np.max(np.abs(np.asarray(x)), axis=axis, keepdims=True)
    rel = np.abs(np.asarray(dec) - np.asarray(x))[near] / np.abs(np.asarray(x))[near]
    assert np.max(rel) <= 2.0 ** -(int(fi.nmant) + 1) * (1 + 2.0**-20)
    # The largest element maps to fp8_max: it round-trips to within float32 rounding.
    i = np.argmax(np.abs(np.asarray(x)))
    assert abs(float(dec.reshape(-1)[i]) / float(x.reshape(-1)[i]) - 1) <= 2.0**-21


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_int_scale_is_absmax_over_qmax_rounded_up(bits, maybe_jit):
    codec = IntCodec(bits)
    x = _wide_range(2, lo=-2.0, hi=2.0)
    enc, dec = _roundtrip(codec, x, maybe_jit)
    qmax = 2 ** (bits - 1) - 1
    g = codec.group_size
    flat = np.pad(np.abs(np.asarray(x, np.float64)).reshape(-1), (0, -x.size % g))
    ideal = flat.reshape(-1, g).max(axis=1) / qmax
    s = np.asarray(enc.scale.astype(jnp.float32), np.float64)
    assert enc.scale.dtype == jnp.bfloat16
    assert np.all(s >= ideal) and np.all(s <= ideal * (1 + 2.0**-7))
    assert enc.data.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    # Lane-dense rows of 128 bytes: 128 * 8 / bits codes a row, the last row zero-padded.
    assert enc.data.shape == (-(-(-(-x.size // g) * g) // (1024 // bits)), 128)


@pytest.mark.parametrize("bits", [4, 2])
def test_int_packing_is_planar_within_rows_of_128_bytes(bits):
    """Byte i of a row holds codes i, 128 + i (, 256 + i, 384 + i), low bits first: packing
    combines whole 128-wide slices and never interleaves neighbours (a relayout on a TPU)."""
    k, qmax = 8 // bits, 2 ** (bits - 1) - 1
    codec = IntCodec(bits, group_size=128 * k, stochastic=False)
    rng = np.random.default_rng(1)
    q = rng.integers(-qmax, qmax + 1, size=(3, 128 * k))
    q[:, 0] = qmax  # each group's absmax is qmax: scale 1, codes q exactly
    enc = codec.encode(jnp.asarray(q, jnp.float32))
    np.testing.assert_array_equal(np.asarray(enc.scale, np.float32), 1.0)
    codes = (q + qmax).astype(np.uint8).reshape(3, k, 128)
    want = sum(codes[:, j, :] << (bits * j) for j in range(k)).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(enc.data), want)


def test_int_packing_is_real(maybe_jit):
    # Every code of int4 and int2 appears and survives packing: exact for values on the grid.
    for bits in (4, 2):
        qmax = 2 ** (bits - 1) - 1
        codec = IntCodec(bits, group_size=120, stochastic=False)  # one group per row
        rng = np.random.default_rng(0)
        levels = np.arange(-qmax, qmax + 1, dtype=np.float32)
        q = np.stack([rng.permutation(np.resize(levels, 120)) for _ in range(4)])
        x = jnp.asarray(q * np.float32(0.25))
        _, dec = _roundtrip(codec, x, maybe_jit)
        np.testing.assert_array_equal(dec, x)


# ----------------------------------------------------------------------------------------------
# Special values

SPECIAL = {
    "zero": lambda: jnp.zeros(SHAPE, jnp.float32),
    "constant": lambda: jnp.full(SHAPE, -0.7, jnp.float32),
    "huge": lambda: _normal(3) * np.float32(1e30),
    "subnormal": lambda: jnp.asarray(np.asarray(_normal(3)) * np.float32(1e-40)),
}


@pytest.mark.parametrize("codec", CODECS, ids=_id)
@pytest.mark.parametrize("case", sorted(SPECIAL))
def test_special_groups(codec, case, maybe_jit):
    x = SPECIAL[case]()
    if case == "subnormal":
        assert 0 < np.max(np.abs(np.asarray(x))) < TINY
    enc, dec = _roundtrip(codec, x, maybe_jit)
    assert np.all(np.isfinite(np.asarray(dec)))
    err = np.abs(np.asarray(dec, np.float64) - np.asarray(x, np.float64))
    assert np.all(err <= _error_bound(codec, enc, x))
    if case == "zero":
        np.testing.assert_array_equal(dec, 0.0)
    if case == "subnormal":  # nothing blows up: the result is within 2**-126 of x
        assert np.all(err <= TINY)


@pytest.mark.parametrize("codec", CODECS, ids=_id)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_is_not_hidden(codec, bad, maybe_jit):
    x = np.array(_normal(4))
    x[0, 5] = bad
    x = jnp.asarray(x)
    if isinstance(codec, DelayedFP8Codec):  # a realistic state: scale from a previous step
        state = codec.update_state(codec.init_state(), jnp.float32(4.0))
        enc = maybe_jit(lambda x: codec.encode(x, state=state))(x)
        dec = maybe_jit(lambda e: codec.decode(e, jnp.float32))(enc)
        assert not np.isfinite(float(enc.amax))
    else:
        enc, dec = _roundtrip(codec, x, maybe_jit)
    dec = np.asarray(dec)
    if isinstance(codec, (NoneCodec, BF16Codec)):
        np.testing.assert_array_equal(dec[0, 5], bad)  # inf stays inf, NaN stays NaN
        return
    if isinstance(codec, IntCodec):  # the group holding x[0, 5] is NaN, the others are not
        group = np.arange(x.size).reshape(x.shape) // codec.group_size == 0
    elif isinstance(codec, FP8Codec) and codec.scaling == "row":
        group = np.broadcast_to(np.arange(4)[:, None] == 0, x.shape)
    else:
        group = np.ones(x.shape, bool)
    assert np.all(np.isnan(dec[group]))
    assert np.all(np.isfinite(dec[~group]))


# ----------------------------------------------------------------------------------------------
# Delayed scaling


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_delayed_saturates(fmt, maybe_jit):
    codec = DelayedFP8Codec(fmt)
    state = codec.init_state()
    state = {**state, "scale": jnp.float32(0.5)}  # representable range: +-fp8_max * 0.5
    top = codec.fp8_max * 0.5
    x = jnp.array([3 * top, -3 * top, top * 1.01, -1e30, top, 1.0], jnp.float32)
    enc = maybe_jit(lambda x: codec.encode(x, state=state))(x)
    dec = np.asarray(maybe_jit(lambda e: codec.decode(e, jnp.float32))(enc))
    np.testing.assert_array_equal(dec[:5], [top, -top, top, -top, top])
    assert float(enc.amax) == np.float32(1e30) and float(enc.scale) == 0.5
    assert abs(dec[5] - 1.0) <= 2.0 ** -(int(jnp.finfo(_fp8_dtype(codec)).nmant) + 1)


def test_delayed_update_max_accumulates():
    codec = DelayedFP8Codec("e4m3", history_len=4)
    state = codec.init_state()
    assert state["scale"].shape == () and state["amax_history"].shape == (4,)
    amaxes = jnp.array([[1.0, 8.0], [3.0, 2.0], [0.5, 4.0]], jnp.float32)  # [steps, micro]
    state = jax.jit(codec.update_state)(state, amaxes)
    np.testing.assert_array_equal(state["amax_history"], [8.0, 0.0, 0.0, 0.0])
    assert float(state["scale"]) == np.float32(8.0) * INV_448
    for a in (2.0, 1.0, 1.0):
        state = codec.update_state(state, jnp.float32(a))
    np.testing.assert_array_equal(state["amax_history"], [1.0, 1.0, 2.0, 8.0])
    state = codec.update_state(state, jnp.float32(1.0))  # 8 leaves the window
    assert float(state["scale"]) == np.float32(2.0) * INV_448


def test_delayed_update_guards():
    codec = DelayedFP8Codec("e5m2", history_len=3)
    state = codec.update_state(codec.init_state(), jnp.zeros((5,), jnp.float32))
    assert float(state["scale"]) == 1.0  # no amax seen yet: keep the previous scale
    state = codec.update_state(state, jnp.float32(57344.0 * 2))
    assert float(state["scale"]) == 2.0
    state = codec.update_state(state, jnp.array([np.nan, 1.0], jnp.float32))
    assert np.isnan(float(state["amax_history"][0]))  # recorded, visible
    assert float(state["scale"]) == 2.0  # but the scale ignores it
    state = codec.update_state(state, jnp.float32(np.inf))
    assert float(state["scale"]) == 2.0


def test_delayed_threaded_through_scan():
    codec = DelayedFP8Codec("e4m3")
    xs = _normal(5, (6, 32)) * jnp.arange(1, 7, dtype=jnp.float32)[:, None]

    @jax.jit
    def run(state, xs):
        def body(c, x):
            enc = codec.encode(x, state=state)
            return c, enc

        _, encs = jax.lax.scan(body, 0, xs)
        return codec.decode(encs, jnp.float32), codec.update_state(state, encs.amax)

    state = codec.update_state(codec.init_state(), jnp.float32(2.0))
    dec, new_state = run(state, xs)
    assert dec.shape == xs.shape
    amax = np.max(np.abs(np.asarray(xs)))
    np.testing.assert_array_equal(new_state["amax_history"][:2], [amax, 2.0])
    assert float(new_state["scale"]) == amax * INV_448
    # Steps whose values exceed the old range (2.0) saturated to 448 * scale.
    np.testing.assert_array_equal(np.max(np.abs(np.asarray(dec))), np.float32(448) * state["scale"])


# ----------------------------------------------------------------------------------------------
# Stochastic rounding


@pytest.mark.parametrize("bits", [4, 2])
def test_stochastic_rounding_is_unbiased(bits, maybe_jit):
    """The mean over K keys is within a Hoeffding bound of x, for every element.

    Each decode is ``s * (floor(y) + Bernoulli(frac(y)))``: a variable in a range of width
    ``s``, so ``P(|mean - x| >= t) <= 2 exp(-2 K t**2 / s**2)``. With a union bound over N
    elements, ``t = s * sqrt(log(2 N / delta) / (2 K))`` fails with probability < delta = 1e-6.
    Every element sits at ``0.3`` of a step, so rounding to nearest is off by 0.3 s > t.
    """
    qmax = 2 ** (bits - 1) - 1
    g, s = 32, 0.5  # absmax = qmax * s, and s is a bfloat16 value: the scale is exactly s
    k = np.arange(-qmax, qmax)  # y = k + 0.3 stays inside [-qmax, qmax]
    y = np.resize(k + 0.3, (8, g))
    y[:, 0] = qmax
    x = jnp.asarray(y * s, jnp.float32)
    K, N, delta = 1000, x.size, 1e-6
    t = s * math.sqrt(math.log(2 * N / delta) / (2 * K))

    def mean_decode(codec):
        keys = jax.random.split(jax.random.key(6), K)
        decode = lambda key: codec.decode(codec.encode(x, key=key), jnp.float32)
        return np.asarray(maybe_jit(jax.vmap(decode))(keys)).mean(axis=0)

    bias = np.abs(mean_decode(IntCodec(bits, group_size=g)) - np.asarray(x))
    assert np.max(bias) <= t
    rtn_bias = np.abs(mean_decode(IntCodec(bits, group_size=g, stochastic=False)) - np.asarray(x))
    assert np.min(rtn_bias[:, 1:]) >= 0.3 * s - 1e-6 > t  # the test can tell the difference


@pytest.mark.parametrize("bits", [8, 2])  # int4 shares the code path (see the unbiased test)
def test_stochastic_rounding_keys(bits, maybe_jit):
    codec = IntCodec(bits, stochastic=True)
    x = _normal(7)
    enc, _ = _codec_fns(codec, maybe_jit, jnp.float32)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    np.testing.assert_array_equal(enc(x, k1).data, enc(x, k1).data)
    assert not np.array_equal(enc(x, k1).data, enc(x, k2).data)
    # A legacy uint32 key works too and gives the same dither as the typed key with its bits.
    np.testing.assert_array_equal(enc(x, jax.random.key_data(k1)).data, enc(x, k1).data)
    # Without a key: deterministic, but the dither depends on x's bits and on the seed.
    auto = lambda x: enc(x, None)
    np.testing.assert_array_equal(auto(x).data, auto(x).data)
    x2 = x.at[0, 0].set(x[0, 0] + 1.0)  # changes group 0 only
    g = codec.group_size  # the codes of the groups other than group 0
    same = (np.asarray(codec.decode(auto(x), jnp.float32)).reshape(-1)[g:]
            == np.asarray(codec.decode(auto(x2), jnp.float32)).reshape(-1)[g:])
    assert not np.all(same)
    reseeded = dataclasses.replace(codec, seed=1).encode(x)
    assert not np.array_equal(reseeded.data, auto(x).data)


# ----------------------------------------------------------------------------------------------
# Transformations


@pytest.mark.parametrize("codec", CODECS, ids=_id)
def test_vmap_and_leading_axes(codec, maybe_jit):
    xs = _wide_range(8, (3,) + SHAPE, -1.0, 1.0)
    encs = maybe_jit(jax.vmap(lambda x: _encode(codec, x)))(xs)
    assert encs.shape == SHAPE
    decs = maybe_jit(jax.vmap(lambda e: codec.decode(e, jnp.float32)))(encs)
    for i in range(3):
        enc_i = _encode(codec, xs[i])
        for a, b in zip(jax.tree.leaves(enc_i), jax.tree.leaves(encs), strict=True):
            np.testing.assert_array_equal(a, b[i])
        np.testing.assert_array_equal(decs[i], codec.decode(enc_i, jnp.float32))
    # Encodings stacked along leading axes (vmap, scan) also decode outside the transform.
    np.testing.assert_array_equal(codec.decode(encs, jnp.float32), decs)


def test_residual_of_custom_vjp_in_scan(maybe_jit):
    """The intended use: a custom_vjp saves ``encode(x)`` and its bwd decodes it, in a scan."""
    codec = IntCodec(4)  # stochastic, default key: the dither is a pure function of x

    @jax.custom_vjp
    def square(x):
        return x * x

    def fwd(x):
        return x * x, codec.encode(x)

    def bwd(enc, g):
        return (np.float32(2) * codec.decode(enc, g.dtype) * g,)

    square.defvjp(fwd, bwd)

    def loss(xs):
        body = lambda c, x: (c + jnp.sum(square(x)), None)
        return jax.lax.scan(body, jnp.float32(0), xs)[0]

    xs = _normal(10, (3,) + SHAPE)
    grads = maybe_jit(jax.grad(loss))(xs)
    for i in range(3):  # d/dx sum(x**2) = 2 x, up to twice the codec's error on x
        err = np.abs(np.asarray(grads[i], np.float64) - 2 * np.asarray(xs[i], np.float64))
        assert np.all(err <= 2 * _error_bound(codec, codec.encode(xs[i]), xs[i]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("codec", [BF16Codec(), FP8Codec(), IntCodec(4)], ids=_id)
def test_low_precision_inputs(codec, dtype, maybe_jit):
    x = _normal(9).astype(dtype)
    enc, dec = _roundtrip(codec, x, maybe_jit, dtype=dtype)
    assert dec.dtype == dtype and dec.shape == x.shape
    x32 = x.astype(jnp.float32)
    err = np.abs(np.asarray(dec, np.float64) - np.asarray(x32, np.float64))
    eps = float(jnp.finfo(dtype).eps)  # the final cast to dtype rounds by half an ulp more
    assert np.all(err <= _error_bound(codec, enc, x32) * (1 + eps) + eps / 2 * np.abs(x32))


def test_empty_array():
    for codec in CODECS:
        x = jnp.zeros((0, 8), jnp.float32)
        enc = _encode(codec, x)
        assert codec.decode(enc, jnp.float32).shape == (0, 8)
        assert _leaf_bytes(enc) == codec.nbytes((0, 8), jnp.float32)


# ----------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("codec", CODECS, ids=_id)
def test_error_messages(codec):
    x = jnp.ones(SHAPE, jnp.float32)
    for bad in (jnp.ones((4,), jnp.int32), jnp.ones((4,), bool)):
        with pytest.raises(TypeError, match="floating-point activations.*leave them uncompressed"):
            _encode(codec, bad)
    enc = _encode(codec, x)
    with pytest.raises(TypeError, match="already compressed.*decode it first"):
        _encode(codec, enc)
    with pytest.raises(TypeError, match="single array.*jax.tree.map"):
        _encode(codec, {"a": x})
    with pytest.raises(ValueError, match="floating-point dtype.*got int32"):
        codec.decode(enc, jnp.int32)
    other = IntCodec(4, group_size=16)
    with pytest.raises(ValueError, match="different codec"):
        other.decode(enc, jnp.float32)


def test_constructor_errors():
    with pytest.raises(ValueError, match="bits must be 8, 4 or 2"):
        IntCodec(bits=3)
    with pytest.raises(ValueError, match="multiple of 4"):
        IntCodec(bits=2, group_size=30)
    with pytest.raises(ValueError, match="fmt must be one of"):
        FP8Codec("e3m4")
    with pytest.raises(ValueError, match="scaling must be one of"):
        FP8Codec("e4m3", scaling="block")
    with pytest.raises(ValueError, match="history_len"):
        DelayedFP8Codec(history_len=0)
    with pytest.raises(TypeError, match="needs the delayed-scaling state"):
        DelayedFP8Codec().encode(jnp.ones(3, jnp.float32))


def test_encoded_is_a_pytree():
    enc = IntCodec(4).encode(jnp.ones(SHAPE, jnp.float32))
    assert isinstance(enc, Encoded) and enc.shape == SHAPE
    leaves, treedef = jax.tree.flatten(enc)
    assert len(leaves) == 2  # data and scale; amax is None
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.data is enc.data and rebuilt.shape == enc.shape and rebuilt.layout == enc.layout


# ----------------------------------------------------------------------------------------------
# Float codecs store bit patterns (issue 12)

FLOAT_CODECS = [BF16Codec(), FP8Codec("e4m3"), FP8Codec("e5m2"), FP8Codec("e4m3", scaling="row"),
                DelayedFP8Codec("e5m2")]


def _float_storage_reference(codec, x):
    """What the codec stored before issue 12, computed independently: the float values."""
    x32 = np.asarray(x, np.float32)
    if isinstance(codec, BF16Codec):
        return jnp.asarray(x32).astype(jnp.bfloat16)
    fdt = _fp8_dtype(codec)
    fmax = np.float32(jnp.finfo(fdt).max)
    if isinstance(codec, FP8Codec) and codec.scaling == "row":
        amax = np.max(np.abs(x32), axis=-1, keepdims=True)
    else:
        amax = np.max(np.abs(x32))
    # the delayed codec's state was updated with this amax (see `_encode`): same scale
    scale = np.maximum(amax * (np.float32(1) / fmax), np.float32(TINY))
    return jnp.asarray(np.clip(x32 / scale, -fmax, fmax)).astype(fdt)


@pytest.mark.parametrize("codec", FLOAT_CODECS, ids=_id)
def test_float_codecs_store_bit_patterns(codec, maybe_jit):
    """bf16 / fp8 data is the uint16 / uint8 bit pattern of exactly the float values the codec
    stored before (an independent NumPy computation of them), and decodes to them."""
    x = jnp.asarray(np.random.default_rng(3).normal(size=(8, 48)) * 3, jnp.float32)
    enc, dec = _roundtrip(codec, x, maybe_jit)
    want = _float_storage_reference(codec, x)
    assert enc.data.dtype == (jnp.uint16 if isinstance(codec, BF16Codec) else jnp.uint8)
    np.testing.assert_array_equal(jax.lax.bitcast_convert_type(enc.data, want.dtype), want)
    scale = 1.0 if enc.scale is None else _per_element_scale(codec, enc, x)
    # The decode is exact given the stored values: fp8 * f32 scale rounds once in float32.
    np.testing.assert_allclose(dec, np.asarray(want, np.float64) * scale, rtol=2.0**-23, atol=0)


@pytest.mark.parametrize("codec", FLOAT_CODECS, ids=_id)
def test_float_codec_rejects_float_data(codec):
    """An encoding whose data is not the expected bit-pattern dtype is a clear error."""
    x = jnp.ones((4, 8), jnp.float32)
    enc = _encode(codec, x)
    bad = dataclasses.replace(enc, data=enc.data.astype(jnp.float32))
    with pytest.raises(ValueError, match="bit patterns"):
        codec.decode(bad, jnp.float32)
