"""hifigrad.optim.master_weights: bf16 parameters trained through a float32 master copy equal
an independent float32 optax run on float32 parameters, rounded."""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lanes import in_turn
from platforms import on_cpu

import hifigrad as hg

optax = pytest.importorskip("optax")

# The codes' tests use leaves of a few hundred elements: coded from 64 elements here (by
# default leaves of fewer than 4096 keep float32 moments: test_min_coded_size_*).
_adamw = functools.partial(hg.optim.adamw, min_coded_size=64)
_scale_by_adam = functools.partial(hg.optim.scale_by_adam, min_coded_size=64)

STEPS = 12


def _params():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(16, 8)) * 0.3, jnp.bfloat16),
            "b": jnp.asarray(rng.normal(size=(8,)) * 1e-3, jnp.bfloat16),
            "scale": jnp.ones((8,), jnp.float32)}           # a float32 leaf stays float32


def _grads(i):
    """Float32 gradients of step ``i`` (fixed, so that both runs see the same ones); small
    enough that most steps move a bf16 parameter by less than half its ulp."""
    rng = np.random.default_rng(100 + i)
    return {"w": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(8,)), jnp.float32),
            "scale": jnp.asarray(rng.normal(size=(8,)), jnp.float32)}


def _tx():
    mask = {"w": True, "b": True, "scale": False}  # weight decay on the matrices only
    return optax.chain(optax.clip_by_global_norm(5.0),
                       optax.adamw(3e-4, weight_decay=0.1, mask=mask))


def _run(tx, params, wrap):
    state = tx.init(params)

    def step(params, state, grads):
        with jax.numpy_dtype_promotion("standard"):  # optax needs JAX's default promotion
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

    step = wrap(step)
    for i in range(STEPS):
        params, state = step(params, state, _grads(i))
    return params, state


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_bf16_params_are_the_rounded_float32_reference(jit):
    wrap = jax.jit if jit else (lambda f: f)
    p0 = _params()
    # the independent reference: plain optax on float32 copies of the parameters
    p32 = jax.tree.map(lambda p: p.astype(jnp.float32) if p.dtype == jnp.bfloat16 else p, p0)
    ref, ref_state = _run(_tx(), p32, wrap)
    got, state = _run(hg.optim.master_weights(_tx()), p0, wrap)

    assert isinstance(state, hg.optim.MasterWeightsState)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in p0.items()}
    assert {k: v.dtype for k, v in state.master.items()} == {
        "w": jnp.float32, "b": jnp.float32, "scale": jnp.float32}
    for k in ("w", "b", "scale"):
        # the master copy is the float32 run
        np.testing.assert_allclose(state.master[k], ref[k], rtol=1e-6, atol=1e-9, err_msg=k)
    for k in ("w", "b"):
        # the bf16 parameters are exactly the master copy rounded, and so the reference rounded
        np.testing.assert_array_equal(np.asarray(got[k]),
                                      np.asarray(state.master[k].astype(jnp.bfloat16)))
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(ref[k].astype(jnp.bfloat16)))
    np.testing.assert_allclose(got["scale"], ref["scale"], rtol=1e-6)
    # the optimizer's moments are float32, as the reference's
    moments = [x for x in jax.tree.leaves(state.inner) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert moments and all(x.dtype == jnp.float32 for x in moments)
    assert len(jax.tree.leaves(state.inner)) == len(jax.tree.leaves(ref_state))


def test_master_copy_keeps_steps_a_bf16_parameter_cannot():
    """The failure the helper exists for: updated in bf16, the parameters do not move at all;
    through the master copy they move as in float32."""
    p0 = {"w": jnp.ones((4,), jnp.bfloat16)}
    grads = {"w": jnp.ones((4,), jnp.float32)}
    sgd = optax.sgd(1e-3)
    plain, s = p0, sgd.init(p0)
    wrapped = hg.optim.master_weights(sgd)
    master, ms = p0, wrapped.init(p0)
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(10):
            u, s = sgd.update(grads, s, plain)
            plain = optax.apply_updates(plain, u)
            u, ms = wrapped.update(grads, ms, master)
            master = optax.apply_updates(master, u)
    assert float(plain["w"][0]) == 1.0                    # every 1e-3 step rounded away
    assert float(master["w"][0]) == float(jnp.bfloat16(0.99))
    np.testing.assert_allclose(ms.master["w"], 0.99, rtol=1e-6)


def test_hifigrad_gradients_train_bf16_params_through_the_helper():
    params = {"w": jnp.full((8, 4), 0.1, jnp.bfloat16)}
    x = jnp.linspace(-1.0, 1.0, 16, dtype=jnp.bfloat16).reshape(2, 8)

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"]).astype(jnp.float32) ** 2)

    tx = hg.optim.master_weights(optax.adam(1e-2))
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        l, grads = hg.value_and_grad(loss)(params, x)
        assert grads["w"].dtype == jnp.float32
        with jax.numpy_dtype_promotion("standard"):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, l

    losses = []
    for _ in range(5):
        params, state, l = step(params, state)
        losses.append(float(l))
    assert losses[-1] < losses[0]
    assert params["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(params["w"]),
                                  np.asarray(state.master["w"].astype(jnp.bfloat16)))


def test_non_float_leaves_are_kept_as_they_are():
    params = {"w": jnp.ones((3,), jnp.float16), "step": jnp.zeros((), jnp.int32)}
    state = hg.optim.master_weights(optax.set_to_zero()).init(params)
    assert state.master["w"].dtype == jnp.float32 and state.master["step"].dtype == jnp.int32


def test_low_precision_gradients_are_taken_in_float32():
    params = {"w": jnp.ones((3,), jnp.bfloat16)}
    tx = hg.optim.master_weights(optax.sgd(1.0))
    state = tx.init(params)
    with jax.numpy_dtype_promotion("standard"):
        _, state = tx.update({"w": jnp.full((3,), 0.5, jnp.bfloat16)}, state, params)
    assert state.master["w"].dtype == jnp.float32
    np.testing.assert_array_equal(state.master["w"], np.full(3, 0.5, np.float32))


def test_update_without_params_is_a_clear_error():
    tx = hg.optim.master_weights(optax.sgd(1e-3))
    params = {"w": jnp.ones((3,), jnp.bfloat16)}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"needs the current parameters.*tx.update\(grads, "
                                         r"state, params\)"):
        tx.update({"w": jnp.ones((3,), jnp.float32)}, state)


def test_not_a_transformation_is_a_clear_error():
    with pytest.raises(TypeError, match=r"expected an optax GradientTransformation.*adamw"):
        hg.optim.master_weights(optax.adamw)  # the factory, not the transformation


def test_missing_optax_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "optax", None)  # `import optax` raises ImportError
    with pytest.raises(ImportError, match=r"needs optax.*pip install optax"):
        hg.optim.master_weights(object())


def test_importing_hifigrad_does_not_import_optax():
    import subprocess

    code = ("import sys; sys.modules['optax'] = None; import hifigrad as hg; "
            "assert callable(hg.optim.master_weights); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ------------------------------------------------------------------ the split master

def _bits(x):
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32))


def _sample_bits():
    """Float32 bit patterns: random ones, and the edges (zeros, infinities, NaNs, the largest
    finite bf16 and the ties around it, exact ties)."""
    rng = np.random.default_rng(0)
    edges = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
                      0x7F808000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000, 0x00008000,
                      0x3F808000, 0x3F818000, 0x80008000], np.uint32)
    return np.concatenate([rng.integers(0, 2 ** 32, size=100_000, dtype=np.uint64)
                           .astype(np.uint32), edges])


@pytest.mark.parametrize("rounding", ["nearest_away", "truncate"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_split_master_is_the_float32_master_exactly(rounding, jit):
    """Every float32 is its bf16 (rounded as asked) and its 16-bit low half, exactly; a NaN
    stays a NaN, in the parameter too (never read as inf)."""
    from hifigrad.optim import _join, _split

    wrap = jax.jit if jit else (lambda f: f)
    bits = _sample_bits()
    x = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.float32)
    param, low = wrap(lambda x: _split(x, rounding))(x)
    assert param.dtype == jnp.bfloat16 and low.dtype == jnp.uint16
    back = _bits(wrap(lambda p, lo: _join(p, lo, rounding))(param, low))
    nan = np.isnan(np.asarray(x))
    # Off XLA:CPU (a TPU) a bf16 subnormal parameter reads as zero: the chip flushes
    # denormals, as its float32 arithmetic does, so a master updated there never holds one.
    # Measured on a TPU v5e: every subnormal master came back wrong, every other one exact.
    subnormal = ((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFFFF) != 0)
    kept = ~nan & (~subnormal if not on_cpu() else True)
    np.testing.assert_array_equal(back[kept], bits[kept])
    assert np.isnan(np.asarray(_join(param, low, rounding)))[nan].all()
    assert np.isnan(np.asarray(param, np.float32))[nan].all()
    if rounding == "nearest_away":  # round to nearest: it differs from ties-to-even at ties only
        rne = np.asarray(x.astype(jnp.bfloat16), np.float32)
        diff = (np.asarray(param, np.float32) != rne) & kept
        assert diff.any() and ((bits[diff] & 0xFFFF) == 0x8000).all()


@pytest.mark.parametrize("rounding", ["nearest_away", "truncate"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_split_master_trains_bitwise_as_the_float32_master(rounding, jit):
    """Step by step, the split master's parameters and master are the float32 master's, with
    the same parameter rounding (the test's chain: clipping, AdamW with a mask, a float32 leaf).

    Eagerly, bit for bit. Under jit the two steps are different XLA programs, and XLA may fuse
    (contract) a multiply-add in one and not in the other: the float32 run jitted and the same
    run eager differ alike (by an ulp on jax 0.10.2 and 0.12.0.1). So there a master may differ
    by an ulp per step: at most ``i + 1`` float32 ulps after step ``i`` (a difference feeds back
    only through weight decay, lr * wd = 3e-5 of it), and each parameter is bitwise the
    float32 run's wherever the masters are equal (rounding a master is integer arithmetic on
    its bits). The storage itself is lossless under jit too (the test above)."""
    wrap = jax.jit if jit else (lambda f: f)
    p0 = _params()
    full = hg.optim.master_weights(_tx(), param_rounding=rounding)
    split = hg.optim.master_weights(_tx(), master="split", param_rounding=rounding)
    pa, sa = p0, full.init(p0)
    pb, sb = p0, split.init(p0)
    assert sb.master["w"].dtype == jnp.uint16 and sb.master["scale"].dtype == jnp.float32

    def step(tx):
        def f(params, state, grads):
            with jax.numpy_dtype_promotion("standard"):
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state
        return wrap(f)

    fa, fb = step(full), step(split)
    for i in range(STEPS):
        pa, sa = fa(pa, sa, _grads(i))
        pb, sb = fb(pb, sb, _grads(i))
        master = split.master_params(pb, sb)
        for k in pa:
            ma, mb = np.asarray(sa.master[k]), np.asarray(master[k])
            if jit:
                np.testing.assert_array_max_ulp(ma, mb, maxulp=i + 1)
                same = ma == mb
            else:
                np.testing.assert_array_equal(_bits(ma), _bits(mb), err_msg=f"step {i} {k}")
                same = np.ones(ma.shape, bool)
            np.testing.assert_array_equal(_bits(pa[k])[same], _bits(pb[k])[same],
                                          err_msg=f"step {i} {k}")


def test_24_bit_master_rounds_stochastically():
    """``master="split8"``'s rounding: to the float32's top 24 bits (the low byte 0), to one of
    the two 24-bit values around it, with mean the value (800 draws, 4 standard errors);
    a 24-bit value, inf and NaN kept."""
    from hifigrad.optim import _round_to_24_bits
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=64) * 10.0 ** rng.integers(-6, 3, 64),
                        [1.0, -2.5, np.inf, -np.inf, np.nan]]).astype(np.float32)
    bits = jax.random.bits(jax.random.key(1), (800, x.size), jnp.uint32)
    r = np.asarray(jax.jit(_round_to_24_bits)(jnp.broadcast_to(jnp.asarray(x), bits.shape),
                                              bits))
    assert np.all((_bits(r[:, :-3]) & 0xFF) == 0)
    lo = (_bits(x) & 0xFFFFFF00).view(np.float32)
    hi = ((_bits(x) & 0xFFFFFF00) + 0x100).view(np.float32)
    finite = r[:, :-3]
    assert np.all((finite == lo[:-3]) | (finite == hi[:-3]))
    gap = np.abs(hi[:-3] - lo[:-3])
    assert np.all(np.abs(finite.astype(np.float64).mean(0) - x[:-3]) <= 4 * gap / 2 / np.sqrt(800))
    np.testing.assert_array_equal(r[:, 64:66], np.broadcast_to(x[64:66], (800, 2)))
    assert np.all(r[:, 66:68] == x[66:68]) and np.all(np.isnan(r[:, 68]))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_24_bit_master_tracks_the_float32_reference(jit):
    """``master="split8"`` against plain optax on float32 parameters (the test's chain): each
    step rounds the master to 24 bits (16 significant), an error of at most one 24-bit step,
    2**-15 of the value's binade, which the next steps carry (weight decay feeds it back by
    3e-5 only): after 12 steps within 12 such steps of the largest the value was. Each bf16
    parameter is its master rounded to nearest (ties away) exactly; a float32 leaf is
    optax's own."""
    wrap = jax.jit if jit else (lambda f: f)
    p0 = _params()
    p32 = jax.tree.map(lambda p: p.astype(jnp.float32) if p.dtype == jnp.bfloat16 else p, p0)
    ref, _ = _run(_tx(), p32, wrap)
    tx = hg.optim.master_weights(_tx(), master="split8", seed=4)
    got, state = _run(tx, p0, wrap)
    assert state.master["w"].dtype == jnp.uint8 and state.master["scale"].dtype == jnp.float32
    master = tx.master_params(got, state)
    for k in ("w", "b"):
        # the largest a value was on its way: its start and 12 of Adam's steps (each under
        # 3 learning rates: the first steps' bias-corrected ratio), then 12 roundings of it
        largest = np.abs(np.asarray(p32[k])) + STEPS * 3 * 3e-4
        np.testing.assert_array_less(np.abs(np.asarray(master[k]) - np.asarray(ref[k])),
                                     STEPS * 2.0 ** -15 * largest)
        assert np.all((_bits(master[k]) & 0xFF) == 0)
        np.testing.assert_array_equal(
            np.asarray(got[k]), np.asarray(hg.optim.round_to_bf16(master[k], "nearest_away")))
    np.testing.assert_allclose(got["scale"], ref["scale"], rtol=1e-6)


def test_split_master_needs_a_rounding_its_16_bits_hold():
    for master in ("split", "split8"):
        with pytest.raises(ValueError, match="nearest_away"):
            hg.optim.master_weights(optax.sgd(1e-3), master=master, param_rounding="nearest_even")
    with pytest.raises(ValueError, match="master must be one of"):
        hg.optim.master_weights(optax.sgd(1e-3), master="bf16")


# ------------------------------------------------------------------ rounding

def test_round_to_bf16_modes():
    x = jnp.asarray([1 + 2 ** -8, -(1 + 2 ** -8), 1 + 3 * 2 ** -9, np.inf, -np.inf, np.nan],
                    jnp.float32)
    even = np.asarray(hg.optim.round_to_bf16(x, "nearest_even"), np.float32)
    away = np.asarray(hg.optim.round_to_bf16(x, "nearest_away"), np.float32)
    trunc = np.asarray(hg.optim.round_to_bf16(x, "truncate"), np.float32)
    assert list(even[:3]) == [1.0, -1.0, 1 + 2 ** -7]
    assert list(away[:3]) == [1 + 2 ** -7, -(1 + 2 ** -7), 1 + 2 ** -7]
    assert list(trunc[:3]) == [1.0, -1.0, 1.0]
    for r in (even, away, trunc):
        assert list(r[3:5]) == [np.inf, -np.inf] and np.isnan(r[5])
    with pytest.raises(ValueError, match="needs `bits`"):
        hg.optim.round_to_bf16(x, "stochastic")


def test_stochastic_rounding_is_unbiased_and_reproducible():
    """Rounded stochastically, 1 + u/4 of an ulp averages to itself (4096 draws: the standard
    error is under 1% of an ulp); the same bits give the same result; NaN and inf stay."""
    ulp = 2.0 ** -7
    x = jnp.full((4096,), 1 + ulp / 4, jnp.float32)
    bits = jax.random.bits(jax.random.key(0), x.shape, jnp.uint16)
    r = hg.optim.round_to_bf16(x, "stochastic", bits)
    mean = float(np.asarray(r, np.float64).mean())
    assert abs(mean - (1 + ulp / 4)) < 0.03 * ulp, mean
    np.testing.assert_array_equal(np.asarray(r), np.asarray(hg.optim.round_to_bf16(
        x, "stochastic", bits)))
    y = hg.optim.round_to_bf16(jnp.asarray([np.inf, np.nan], jnp.float32), "stochastic",
                               jnp.full((2,), 0xFFFF, jnp.uint16))
    assert float(y[0]) == np.inf and np.isnan(float(y[1]))


def _sub_ulp_run(tx, steps=50):
    """SGD steps of 2e-4 on parameters at 1.0, whose bf16 half ulp is 2**-8 (3.9e-3): each
    update alone is rounded away."""
    p = {"w": jnp.ones((512,), jnp.bfloat16)}
    state = tx.init(p)
    g = {"w": jnp.ones((512,), jnp.float32)}

    @jax.jit
    def step(p, state):
        with jax.numpy_dtype_promotion("standard"):
            u, state = tx.update(g, state, p)
            return optax.apply_updates(p, u), state

    for _ in range(steps):
        p, state = step(p, state)
    return p, state


def test_kahan_and_stochastic_rounding_keep_updates_under_half_an_ulp():
    """50 steps of 2e-4 move a bf16 parameter at 1.0 by 1e-2 in exact arithmetic: lost
    entirely by plain bf16 updates; kept by Kahan's compensation (parameter + compensation =
    the exact value, to the compensation's bf16 rounding), on average by stochastic rounding
    (each step's bits random: the mean of 512 parameters within 2e-3), and by the 24-bit
    master of ``master="split8"`` (to its rounding)."""
    want = 1.0 - 50 * 2e-4
    plain, _ = _sub_ulp_run(optax.sgd(2e-4))
    assert float(plain["w"][0]) == 1.0
    kp, ks = _sub_ulp_run(hg.optim.kahan(optax.sgd(2e-4)))
    total = np.asarray(kp["w"], np.float64) + np.asarray(ks.compensation["w"], np.float64)
    # each step rounds the compensation (at most half an ulp of the parameter, 2**-8) to
    # bf16: 2**-17 at most, 50 times
    np.testing.assert_allclose(total, want, atol=50 * 2 ** -17)
    sp, _ = _sub_ulp_run(hg.optim.stochastic_rounding(optax.sgd(2e-4), seed=1))
    assert abs(float(np.asarray(sp["w"], np.float64).mean()) - want) < 2e-3
    # the 24-bit master: each step's rounding at most 2**-16 of 1 away (a 24-bit step below
    # 1.0), unbiased: every element within 50 such, the mean of 512 within one; the
    # parameter is the master rounded to nearest bf16
    tx = hg.optim.master_weights(optax.sgd(2e-4), master="split8", seed=1)
    mp, ms = _sub_ulp_run(tx)
    master = np.asarray(tx.master_params(mp, ms)["w"], np.float64)
    np.testing.assert_allclose(master, want, atol=50 * 2.0 ** -16)
    assert abs(master.mean() - want) < 2.0 ** -16
    assert np.all(np.asarray(mp["w"], np.float32) == np.float32(jnp.bfloat16(want)))


# ------------------------------------------------------------------ compact moments

def _adam_run(tx, steps=20, jit=True):
    p = {"w": jnp.zeros((8, 256), jnp.float32)}
    state = tx.init(p)
    outs = []
    update = jax.jit(tx.update) if jit else tx.update
    for i in range(steps):
        g = {"w": jnp.asarray(np.random.default_rng(i).normal(size=(8, 256)) *
                              np.logspace(-4, 0, 256), jnp.float32)}
        u, state = update(g, state, p)
        outs.append(np.asarray(u["w"]))
    return np.stack(outs), state


def test_float32_moments_are_optax_adam():
    got, _ = _adam_run(_scale_by_adam(0.9, 0.999, 1e-8))
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes dtypes
        want, _ = _adam_run(optax.scale_by_adam(0.9, 0.999, 1e-8))
    # the updates are O(1) quotients; the two associate the bias correction differently, each
    # rounding 2**-24 of an O(1) term per step: over 20 steps at most ~20 ulps of 1 (2.4e-6),
    # which on an update that cancels to 0.03 is 1e-4 relative, hence an absolute bound
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=20 * 2.0 ** -23)


# The relative half-spacing of each code's stored values, and the bound on the update's error
# it gives (see the test below). 4bit: the first moment's code is a power of two, so a value
# is rounded to the binade's ends, L or 2L: a stochastic rounding error of standard deviation
# sqrt(p (1 - p)) L, sqrt(1/6) L ~ 0.41 |m| on average over p; it reaches this step's update
# through b1 m (decaying by b1 per step): sqrt(1/6) b1 / sqrt(1 - b1**2) = 0.84 of the first
# moment's norm, the bound.
_HALF_STEP = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8, "8bit": 2.0 ** -4}
_CODED = ("fp16", "8bit", "4bit")


def _update_error_bound(moments):
    if moments == "4bit":
        return np.sqrt(1 / 6) * 0.9 / np.sqrt(1 - 0.81)
    return 5 * _HALF_STEP[moments]


@pytest.mark.parametrize("moments, jit", [("fp16", True), ("bf16", True), ("8bit", True),
                                          ("4bit", True), ("bf16", False), ("8bit", False)],
                         ids=["fp16-jit", "bf16-jit", "8bit-jit", "4bit-jit", "bf16-eager",
                              "8bit-eager"])
def test_compact_moments_stay_close_to_float32(moments, jit):
    """Adam's updates with compact moments against float32 moments (themselves optax's, the
    test above), over 20 steps of gradients spanning four decades within each block. Each
    store rounds stochastically, with a relative error of at most half the code's spacing
    (float16 2**-11, bf16 2**-8, the 8-bit code's 3 mantissa bits 2**-4); unbiased, the
    errors add in quadrature over the moments' memory (about 1 / sqrt(1 - b1**2) = 2.3 stores
    for the first, sqrt(20) = 4.5 for the second, halved through its square root):
    norm-wise, within 5 half-spacings. The 4-bit code: see `_HALF_STEP`. (Eagerly for one
    block code and bf16: the block codes share their code path.)"""
    ref, _ = _adam_run(_scale_by_adam())
    got, state = _adam_run(_scale_by_adam(moments=moments, seed=3), jit=jit)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"{moments}: the update's error is {err:.4f} of its norm")   # (the guide's figures)
    assert err < _update_error_bound(moments), err
    assert np.all(np.isfinite(got))
    if moments in ("fp16", "bf16"):  # float32's updates stay within 1.004 here
        assert np.max(np.abs(got)) <= np.max(np.abs(ref)) * (1 + 5 * _HALF_STEP[moments])
    code = {"fp16": (jnp.uint16, jnp.uint16), "8bit": (jnp.uint8, jnp.uint8),
            "4bit": (jnp.uint8, None), "bf16": (jnp.bfloat16, jnp.bfloat16)}[moments]
    assert state.mu["w"].dtype == code[0]
    assert (state.nu["w"] == ()) if code[1] is None else state.nu["w"].dtype == code[1]


def _code_pairs():
    """(name, encode, decode, zero) of every moment code: the first moment's (with zero) and
    the second moment root's (never zero) of each kind."""
    from hifigrad._src.optim_codes import _CODES
    for kind, (_, first, second) in _CODES.items():
        yield f"{kind}-m", *first, True
        yield f"{kind}-s", *second, kind == "fp16"


@pytest.mark.parametrize("name, encode, decode, zero", list(_code_pairs()),
                         ids=[c[0] for c in _code_pairs()])
def test_moment_codes_round_stochastically_between_neighbours(name, encode, decode, zero):
    """Each code, on values in [0, 1] (relative to the block's scale): a value between two of
    its levels comes back as one of them, with mean the value (within 4 standard errors of
    800 draws; unbiased); every level comes back exactly; 0 and 1 exactly; a second moment's
    root is never zero (below the lowest level it is stored as the lowest)."""
    levels = np.unique(np.asarray(decode(jnp.arange(1 << 15, dtype=jnp.uint32)
                                         if name.startswith("fp16") else
                                         jnp.arange(256, dtype=jnp.uint32))))
    levels = levels[(levels >= 0) & (levels <= 1)]
    assert levels[-1] == 1.0 and (levels[0] == 0.0) == zero
    rng = np.random.default_rng(0)
    picks = levels[rng.integers(0, len(levels) - 1, size=32)]
    upper = levels[np.searchsorted(levels, picks) + 1]
    y = np.concatenate([picks + (upper - picks) * rng.uniform(0.05, 0.95, 32), picks,
                        [0.0, 1.0]]).astype(np.float32)
    bits = jax.random.bits(jax.random.key(0), (800, y.size), jnp.uint16).astype(jnp.uint32)
    draws = np.asarray(jax.jit(lambda y, r: decode(encode(y, r)))(
        jnp.broadcast_to(jnp.asarray(y), (800, y.size)), bits))
    lo, hi = picks, upper
    mid = draws[:, :32]
    assert np.all((mid == lo) | (mid == hi)), name
    assert np.all(np.abs(mid.mean(0) - y[:32]) < 4 * (hi - lo) / 2 / np.sqrt(800)), name
    np.testing.assert_array_equal(draws[:, 32:64], np.broadcast_to(picks, (800, 32)))
    assert np.all(draws[:, -1] == 1.0)
    assert np.all(draws[:, -2] == (0.0 if zero else levels[0])), name


@pytest.mark.parametrize("shape, block", [((8, 256), 128), ((128, 4, 32), 128), ((30000,), 125),
                                          ((3, 257), 257), ((4, 20), 80), ((7, 10), 70),
                                          ((7, 9), None), ((), None)])
def test_block_layout(shape, block):
    """Blocks of 128 consecutive elements of the trailing axes (a 32-wide last axis is not a
    32-element block), else of a divisor near 128, else a whole row; fewer than 64 elements:
    float32 moments."""
    from hifigrad._src.optim_codes import layout
    lay = layout(shape)
    if block is None:
        assert lay is None
        state = _scale_by_adam(moments="8bit").init({"w": jnp.zeros(shape)})
        assert state.mu["w"].dtype == jnp.float32
    else:
        assert lay.block == block and lay.nb * block * int(np.prod(lay.lead)) == np.prod(shape)


@pytest.mark.parametrize("moments", _CODED)
def test_min_coded_size_keeps_small_leaves_float32(moments):
    """Issue 49, item 6: by default a leaf of fewer than 4096 elements keeps float32 moments
    (bitsandbytes' ``min_8bit_size``, torchao's threshold): each coded leaf is a program of its
    own for XLA, and a model's biases and norm scales made its step compile about 3x slower
    than optax's. Those leaves step as ``moments="float32"`` does, bit for bit; 4096 elements
    and more are coded; ``min_coded_size`` moves the threshold (not below 64)."""
    shapes = {"b": (4095,), "n": (15, 256), "w": (16, 256), "v": (4096,)}
    tx = hg.optim.scale_by_adam(moments=moments)
    state = tx.init({k: jnp.zeros(s) for k, s in shapes.items()})
    coded = {k: state.mu[k].dtype != jnp.float32 for k in shapes}
    assert coded == {"b": False, "n": False, "w": True, "v": True}, coded
    small = hg.optim.scale_by_adam(moments=moments, min_coded_size=256).init(
        {"b": jnp.zeros(256), "c": jnp.zeros(255), "t": jnp.zeros(8)})
    assert small.mu["b"].dtype != jnp.float32 and small.mu["c"].dtype == jnp.float32
    assert hg.optim.scale_by_adam(moments=moments, min_coded_size=0).init(
        {"t": jnp.zeros(63)}).mu["t"].dtype == jnp.float32          # no block of 64 there
    # the float32 leaves' updates and moments: float32 moments' own
    p = {"b": jnp.zeros((15, 256))}
    ref, got = hg.optim.scale_by_adam(), tx
    s_ref, s_got = ref.init(p), got.init(p)
    for i in range(3):
        g = {"b": jnp.asarray(np.random.default_rng(i).normal(size=(15, 256)), jnp.float32)}
        u_ref, s_ref = jax.jit(ref.update)(g, s_ref, p)
        u_got, s_got = jax.jit(got.update)(g, s_got, p)
        np.testing.assert_array_equal(np.asarray(u_got["b"]), np.asarray(u_ref["b"]))
        np.testing.assert_array_equal(np.asarray(s_got.nu["b"]), np.asarray(s_ref.nu["b"]))


@pytest.mark.parametrize("master", ["sr", "split"])
def test_a_state_coded_below_min_coded_size_steps_as_stored(master):
    """A state whose small leaves were coded (``min_coded_size=64``, or version 0.1's default)
    steps under a default-built optimizer as under the one that made it, bit for bit: each
    leaf is coded or not as its state is stored."""
    def make(**kw):
        inner = hg.optim.adamw(1e-3, moments="8bit", **kw)
        if master == "sr":
            return hg.optim.stochastic_rounding(inner, seed=2)
        return hg.optim.master_weights(inner, master="split")
    rng = np.random.default_rng(0)
    p0 = {"b": jnp.asarray(rng.normal(size=256) * 0.1, jnp.bfloat16),
          "w": jnp.asarray(rng.normal(size=(16, 256)) * 0.1, jnp.bfloat16)}
    made, default = make(min_coded_size=64), make()
    outs = []
    for tx in (made, default):
        p, state = p0, made.init(p0)
        step = jax.jit(_step(tx))
        for i in range(3):
            g = jax.tree.map(lambda x, i=i: jnp.asarray(
                np.random.default_rng(i).normal(size=x.shape), jnp.float32), p0)
            p, state = step(p, state, g)
        outs.append((p, state))
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))
    assert outs[1][1].inner[0].mu["b"].dtype == jnp.uint8       # still codes
    assert default.init(p0).inner[0].mu["b"].dtype == jnp.float32   # a fresh state: float32


@pytest.mark.parametrize("bad", [-1, 2.5, True, "4096"])
def test_min_coded_size_is_checked(bad):
    for make in (hg.optim.adamw, hg.optim.scale_by_adam):
        kw = {"learning_rate": 1e-3} if make is hg.optim.adamw else {}
        with pytest.raises(ValueError, match="min_coded_size must be a non-negative integer"):
            make(moments="8bit", min_coded_size=bad, **kw)


@pytest.mark.parametrize("moments", _CODED)
def test_stored_moments_are_the_new_moments_rounded(moments):
    """One step from a fresh state: the stored first moment is (1 - b1) g and the second's root
    sqrt(1 - b2) |g|, each element within one of its code's steps (the neighbours it was
    rounded between), each block's largest exactly (its scale, held in the sign bits, is
    the block's largest magnitude)."""
    from hifigrad._src.optim_codes import decode, layout
    shape = (16, 4, 32)          # blocks of 128 across the last two axes
    g = jnp.asarray(np.random.default_rng(1).normal(size=shape) *
                    np.logspace(-2, 0, 32), jnp.float32)
    tx = _scale_by_adam(moments=moments)
    _, state = jax.jit(tx.update)({"w": g}, tx.init({"w": g}))
    m, s = (np.asarray(a) for a in decode(moments, state.mu["w"], state.nu["w"], shape))
    g32 = np.asarray(g)   # the reference in float32, as the step computes it
    want_m = np.float32(1 - 0.9) * g32
    want_s = np.sqrt(np.float32(1 - 0.999) * np.square(g32))
    lay = layout(shape)
    for got, want in ((np.abs(m), np.abs(want_m)), (s, want_s)):
        gb, wb = got.reshape(16, lay.block), want.reshape(16, lay.block)
        # Exact on XLA:CPU; a TPU's float32 multiply and square root are a few ulps from
        # correctly rounded (measured: 1 ulp), the reference's are correctly rounded.
        np.testing.assert_array_max_ulp(gb.max(1), wb.max(1).astype(np.float32),
                                        maxulp=0 if on_cpu() else 2)
        rel = gb / gb.max(1, keepdims=True)    # no element above its block's scale
        step = {"fp16": 2.0 ** -10, "8bit": 2.0 ** -3, "4bit": 1.0}[moments]
        tiny = {"fp16": 2.0 ** -29, "8bit": 2.0 ** -14, "4bit": 2.0 ** -3.5}[moments]
        np.testing.assert_array_less(np.abs(gb - wb), (step * np.maximum(wb, 0) + tiny *
                                                       wb.max(1, keepdims=True)) + 1e-30)
        assert np.all(rel <= 1)
    np.testing.assert_array_equal(np.sign(m)[np.abs(m) > 0], np.sign(want_m)[np.abs(m) > 0])


def _compiled_memory(tx, params, grads, step=True):
    """memory_analysis() of `tx`'s update (and, with `step`, optax.apply_updates), jitted,
    the parameters and the state donated: (arguments, temporaries) per parameter."""
    n = sum(p.size for p in jax.tree.leaves(params))
    if step:
        f, donate = _step(tx), (0, 1)
    else:
        def f(params, state, grads):
            return tx.update(grads, state, params)
        donate = (1,)
    mem = jax.jit(f, donate_argnums=donate).lower(params, tx.init(params),
                                                   grads).compile().memory_analysis()
    return mem.argument_size_in_bytes / n, mem.temp_size_in_bytes / n


# (XLA:CPU of jax 0.12.1 held one float32 moment-sized temporary more in two of these updates,
# fp16 moments 4.125 B/param and the split master with 8-bit moments 18.125 against 18.0,
# strict xfails until the coded update took its present form (its direction computed in the
# same nested program, the blocks' scales multiplied by their reciprocals: issue 50's Pallas
# kernel); they pass on jax 0.10.2, 0.11.2 and 0.12.1 since; which change did it was not
# isolated.)


@pytest.mark.parametrize("moments", _CODED)
def test_update_materializes_no_float32_moment(moments):
    """Issue 50: the compiled update of block-coded moments needs less than 4 bytes of
    temporaries per parameter (a float32 copy of either moment would be 4): each pass
    recomputes the moments elementwise where it needs them (memory_analysis, compile only)."""
    params = {"w": jnp.zeros((256, 1024), jnp.float32)}
    grads = {"w": jnp.zeros((256, 1024), jnp.float32)}
    _, temp = _compiled_memory(_scale_by_adam(moments=moments), params, grads,
                               step=False)
    assert temp < 4, temp


@pytest.mark.parametrize("name", ["sr+8bit", "sr+4bit", "split8+4bit", "split8+8bit"])
def test_update_peak_is_at_most_the_float32_masters(name):
    """Issue 50: the update step's memory (its arguments, parameters, state and float32
    gradients, and its temporaries) is at most the float32 master's update's (18 bytes per
    parameter: 2 + 12 + 4, no temporaries), for the configurations of 4 or 5 bytes per
    parameter (memory_analysis, compile only)."""
    params = {"w": jnp.zeros((256, 1024), jnp.bfloat16)}
    grads = {"w": jnp.zeros((256, 1024), jnp.float32)}
    ref = sum(_compiled_memory(CONFIGS["f32-master"][0](), params, grads))
    args, temp = _compiled_memory(CONFIGS[name][0](), params, grads)
    assert args + temp <= ref, (args, temp, ref)


@pytest.mark.parametrize("moments", _CODED)
def test_both_block_views_give_the_same_moments(moments):
    """The update views a block as rows of 32 on CPU (`lax.platform_dependent`) and as one row
    elsewhere: only XLA's fusion differs (maxima are exact, the rest elementwise), so both
    views, run on this host, give the same moments (bit for bit here; allowed an ulp, as XLA
    may contract a multiply-add in one program and not the other) and the same codes (but
    where such an ulp moved a value across its random rounding threshold: at most 1 in
    1000); the leaf's step lowers for a TPU too."""
    from hifigrad._src import compat
    from hifigrad._src import optim_codes as codes
    shape = (16, 4, 32)
    rng = np.random.default_rng(2)
    mu, nu = codes.zeros(moments, shape)
    for step in range(3):
        g = jnp.asarray(rng.normal(size=shape) * np.logspace(-3, 0, 32), jnp.float32)
        bits = codes.leaf_bits32(codes.step_keys(0, step, 1)[0], shape)
        outs = [jax.jit(lambda g, mu, nu, b, split=split: codes._update(
            moments, g, mu, nu, b, b1=0.9, b2=0.999, split=split))(g, mu, nu, bits)
            for split in (True, False)]
        for a, b in zip(jax.tree.leaves(outs[0][:2]), jax.tree.leaves(outs[1][:2])):
            assert np.mean(np.asarray(a) != np.asarray(b)) <= 1e-3
        for a, b in zip(outs[0][2:], outs[1][2:]):
            np.testing.assert_array_max_ulp(np.asarray(a), np.asarray(b), maxulp=1)
        mu, nu = outs[0][:2]
    key = codes.step_keys(0, 3, 1)[0]
    step = jax.jit(lambda g, mu, nu, k: codes.leaf_step(moments, g, mu, nu, k, 0.9, 0.999,
                                                        0.5, 0.5, 1e-8))
    assert "stablehlo" in compat.lower_for(step, (g, mu, nu, key), "tpu")


@pytest.mark.parametrize("moments", ["fp16", "8bit"])
def test_a_kernel_leaf_lowers_to_the_kernel_on_a_tpu_only(moments):
    """A leaf the Pallas kernel takes (blocks of 128 in its last axis) lowers to the kernel
    (a Mosaic custom call) for a TPU, and to XLA's path for a CPU and for a GPU, where a TPU
    kernel does not run."""
    from hifigrad._src import compat
    from hifigrad._src import optim_codes as codes
    shape = (8, 256)
    g = jnp.ones(shape, jnp.float32)
    mu, nu = codes.zeros(moments, shape)
    key = codes.step_keys(0, 1, 1)[0]
    step = jax.jit(lambda g, mu, nu, k: codes.leaf_step(moments, g, mu, nu, k, 0.9, 0.999,
                                                        0.5, 0.5, 1e-8))
    assert "tpu_custom_call" in compat.lower_for(step, (g, mu, nu, key), "tpu")
    for platform in ("cpu", "cuda"):
        text = compat.lower_for(step, (g, mu, nu, key), platform)
        assert "stablehlo" in text and "tpu_custom_call" not in text, platform


def test_unknown_moments_is_an_error():
    with pytest.raises(ValueError, match="moments must be one of"):
        _scale_by_adam(moments="fp8")


_A = _adamw
CONFIGS = {  # name: (transformation, bytes per bf16 parameter, the parameter included)
    "f32-master": (lambda: hg.optim.master_weights(optax.adamw(1e-3)), 14),
    "split": (lambda: hg.optim.master_weights(optax.adamw(1e-3), master="split"), 12),
    "split+fp16": (lambda: hg.optim.master_weights(_A(1e-3, moments="fp16"), master="split"), 8),
    "split+8bit": (lambda: hg.optim.master_weights(_A(1e-3, moments="8bit"), master="split"), 6),
    "split8+8bit": (lambda: hg.optim.master_weights(_A(1e-3, moments="8bit"), master="split8"),
                    5),
    "split8+4bit": (lambda: hg.optim.master_weights(_A(1e-3, moments="4bit"), master="split8"),
                    4),
    "kahan+fp16": (lambda: hg.optim.kahan(_A(1e-3, moments="fp16")), 8),
    "kahan+bf16": (lambda: hg.optim.kahan(_A(1e-3, moments="bf16")), 8),
    "sr+bf16": (lambda: hg.optim.stochastic_rounding(_A(1e-3, moments="bf16")), 6),
    "sr+8bit": (lambda: hg.optim.stochastic_rounding(_A(1e-3, moments="8bit")), 4),
    "sr+4bit": (lambda: hg.optim.stochastic_rounding(_A(1e-3, moments="4bit")), 3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_bytes_per_parameter(name):
    """What each configuration keeps per bf16 parameter, the parameter included, exactly (the
    block scales live in the codes' sign bits), on a 256-wide leaf and on an attention kernel
    whose last axis is 32 wide: step counts aside (a few bytes in all), 14, 12, 8, 6, 5, 4,
    8, 8, 6, 4 and 3."""
    make, want = CONFIGS[name]
    params = {"w": jnp.zeros((64, 256), jnp.bfloat16), "q": jnp.zeros((128, 4, 32), jnp.bfloat16)}
    n = 64 * 256 + 128 * 4 * 32
    leaves = jax.tree.leaves(make().init(params))
    counts = sum(x.nbytes for x in leaves if x.ndim == 0)
    assert counts <= 16
    assert (sum(x.nbytes for x in leaves) - counts + 2 * n) / n == want


def _step(tx):
    def step(params, state, grads):
        with jax.numpy_dtype_promotion("standard"):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state
    return step


def _train(tx, p0, steps, seed):
    """`steps` jitted steps of `tx` from `p0` and a fresh state, float32 gradients of standard
    normals (``default_rng(seed + i)`` at step i): the parameters and the state."""
    step = jax.jit(_step(tx))
    p, state = p0, tx.init(p0)
    for i in range(steps):
        g = jax.tree.map(lambda x, i=i: jnp.asarray(
            np.random.default_rng(seed + i).normal(size=x.shape), jnp.float32), p0)
        p, state = step(p, state, g)
    return p, state


def _storing(tx):
    """`tx` whose state also holds the parameters it was initialized with (as optax's
    lookahead or an EMA does): a state leaf that is a parameter itself."""
    def init(params):
        return (tx.init(params), params)

    def update(grads, state, params=None):
        u, inner = tx.update(grads, state[0], params)
        return u, (inner, state[1])

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("name", [*CONFIGS, "storing"])
def test_fresh_and_stepped_state_can_be_donated(name):
    """Issue 50: a training step that donates the parameters and the optimizer state (as large
    models are trained) runs from a fresh state (initialized eagerly or jitted) and from a
    stepped one: no leaf of the state is another leaf's buffer or a parameter's (a float32
    parameter, kept as its own master, included; and a wrapped transformation that stores
    the parameters), and the caller's parameters survive only as the step's inputs."""
    make = (lambda: hg.optim.master_weights(_storing(optax.adamw(1e-3)))) if name == "storing" \
        else CONFIGS[name][0]
    tx = make()
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 256)) * 0.02, jnp.bfloat16),
              "q": jnp.asarray(rng.normal(size=(8, 4, 32)) * 0.02, jnp.bfloat16),
              "b": jnp.zeros((8,), jnp.bfloat16), "scale": jnp.ones((256,), jnp.float32)}
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, jnp.float32), params)
    step = jax.jit(_step(tx), donate_argnums=(0, 1))
    for init in (tx.init, jax.jit(tx.init)):
        p = jax.tree.map(jnp.copy, params)
        state = init(p)
        for _ in range(2):
            p, state = step(p, state, grads)   # fresh, then stepped
        assert jax.tree.map(lambda a: a.dtype, p) == jax.tree.map(lambda a: a.dtype, params)
        assert np.any(np.asarray(p["w"]) != np.asarray(params["w"]))


def test_random_bits_are_uniform_and_keyed():
    """The stochastic roundings' bits (a counter-based hash): each of the 16 bits is set in
    half of 2**20 draws (to 5 standard errors: 5 * 0.5 / 2**10), their mean is the uniform's
    (2**15 - 0.5, to 5 standard errors of 2**16 / sqrt(12 * 2**20)), neighbouring elements are
    uncorrelated (|r| < 5 / 2**10), and another seed, step or leaf gives other bits; the same
    arguments give the same bits, jitted or not."""
    from hifigrad._src import optim_codes as codes
    from hifigrad.optim import _leaf_bits as leaf_bits

    def _leaf_bits(seed, step, leaf, shape):
        return leaf_bits(codes.step_keys(seed, step, leaf + 1)[leaf], shape)

    shape = (1024, 1024)
    b = np.asarray(_leaf_bits(0, 3, 1, shape)).astype(np.int64)
    for k in range(16):
        assert abs(((b >> k) & 1).mean() - 0.5) < 5 * 0.5 / 2 ** 10, k
    assert abs(b.mean() - (2 ** 15 - 0.5)) < 5 * 2 ** 16 / np.sqrt(12 * 2 ** 20)
    flat = b.ravel().astype(np.float64)
    assert abs(np.corrcoef(flat[:-1], flat[1:])[0, 1]) < 5 / 2 ** 10
    assert abs(np.corrcoef(b[:-1].ravel(), b[1:].ravel())[0, 1]) < 5 / 2 ** 10
    for other in (_leaf_bits(1, 3, 1, shape), _leaf_bits(0, 4, 1, shape),
                  _leaf_bits(0, 3, 2, shape)):
        assert np.mean(np.asarray(other) == b) < 0.01
    again = jax.jit(lambda c: _leaf_bits(0, c, 1, shape))(jnp.int32(3))
    np.testing.assert_array_equal(np.asarray(again), b)


def test_step_keys_are_the_documented_hash():
    """`step_keys` computes, each key taken out of one vector by a reduction, the keys the
    random bits always had: hash32(hash32(seed ^ 0x9E3779B9) + step * 0x85EBCA6B + leaf *
    0xC2B2AE35), checked against the same hash in NumPy's uint32 arithmetic (so the bits, and
    every trained figure drawn from them, are those of before the keys became reductions)."""
    from hifigrad._src import optim_codes as codes

    def mix(v):  # Wellons' lowbias32 in NumPy
        v = np.uint32(v)
        with np.errstate(over="ignore"):
            v ^= v >> np.uint32(16)
            v = v * np.uint32(0x7FEB352D)
            v ^= v >> np.uint32(15)
            v = v * np.uint32(0x846CA68B)
            return v ^ (v >> np.uint32(16))

    for seed, step in ((0, 0), (0, 7), (123456789, 2 ** 31 + 5)):
        keys = jax.jit(lambda c, seed=seed: codes.step_keys(seed, c, 5))(jnp.uint32(step))
        eager = codes.step_keys(seed, jnp.uint32(step), 5)
        with np.errstate(over="ignore"):
            base = mix(np.uint32(seed) ^ np.uint32(0x9E3779B9)) + np.uint32(step) * np.uint32(
                0x85EBCA6B)
            want = [mix(base + np.uint32((i * 0xC2B2AE35) & 0xFFFFFFFF)) for i in range(5)]
        assert [int(k) for k in keys] == [int(w) for w in want]
        assert [int(k) for k in eager] == [int(w) for w in want]
    assert codes.step_keys(0, 3, 0) == ()


@pytest.mark.parametrize("moments", ["bf16", "8bit"])
def test_leaves_of_one_shape_share_their_compiled_kernels(moments):
    """A model of repeated blocks has many leaves of a few shapes. Each leaf's random bits are
    keyed by its index; were that index a constant inside the kernels, every leaf's kernels
    would differ and XLA would compile each (a coded update compiled several times slower than
    optax's on such a model). Counted on the compiled program: the update of six leaves of one
    shape has the distinct large kernels of one or two leaves, not of six."""
    import re

    tx = hg.optim.stochastic_rounding(_adamw(1e-3, moments=moments))

    def kernels(n):
        params = {f"p{i}": jnp.zeros((64, 256), jnp.bfloat16) for i in range(n)}
        grads = {k: jnp.ones((64, 256), jnp.float32) for k in params}

        def step(p, s, g):
            with jax.numpy_dtype_promotion("standard"):
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s

        hlo = jax.jit(step).lower(params, tx.init(params), grads).compile().as_text()
        bodies = set()
        for block in hlo.split("\n\n"):
            lines = block.strip().split("\n")
            # the leaves' elementwise kernels (the keys' own reductions are a dozen lines
            # each and one per leaf by design)
            if not lines[0].lstrip("%").startswith("fused_computation") or len(lines) < 40:
                continue
            body = "\n".join(re.sub(r"%[\w.\-]+", "%v", ln.split(", metadata")[0])
                             for ln in lines[1:])
            bodies.add(body)
        return len(bodies)

    one, six = kernels(1), kernels(6)
    assert one >= 1
    assert six <= 2 * one, (one, six)


@pytest.mark.parametrize("moments", ["float32", "bf16", "8bit", "4bit"])
def test_inject_hyperparams_equals_the_plain_optimizer(moments):
    """`optax.inject_hyperparams(hg.optim.adamw)` makes every number an array, the seed and
    Adam's rates included (the seed failed there: "An overflow was encountered while parsing
    an argument"): it trains as the plain optimizer does, bit for bit, with rates whose float32
    arithmetic is exact (1 - b1 and 1 - b2 computed in float32 or in Python give one value)."""
    hyper = dict(learning_rate=2.0 ** -10, b1=0.875, b2=1 - 2.0 ** -7, eps=2.0 ** -20,
                 weight_decay=2.0 ** -4, moments=moments, seed=3)
    plain = hg.optim.stochastic_rounding(_adamw(**hyper), seed=5)
    injected = hg.optim.stochastic_rounding(
        optax.inject_hyperparams(hg.optim.adamw, static_args=("moments",))(**hyper), seed=5)
    rng = np.random.default_rng(4)
    p0 = {"w": jnp.asarray(rng.normal(size=(32, 128)) * 0.1, jnp.bfloat16),
          "b": jnp.asarray(rng.normal(size=(16,)) * 0.1, jnp.bfloat16)}
    out = [_train(tx, p0, 4, 10)[0] for tx in (plain, injected)]
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))
    assert not np.array_equal(np.asarray(out[0]["w"], np.float32), np.asarray(p0["w"], np.float32))


# ------------------------------------------------------------------ the Pallas kernel (issue 50)

# the kernel takes blocks of 128 in the last axis: a wide last axis, a 1-D leaf, leading axes,
# and a leaf of more rows than a tile (`_TILE_ELEMENTS` is made small: the last tile is partial)
_KERNEL_SHAPES = [(8, 512), (1024,), (2, 3, 384), (80, 256)]


def _kernel_steps(kind, shape, rates, run, steps=3):
    """``steps`` steps of `run` (a leaf step: (mu, nu, u)) from a fresh state, gradients of
    four decades in each row with zeros and a sign mix; the states and directions."""
    from hifigrad._src import optim_codes as codes
    mu, nu = codes.zeros(kind, shape)
    out = []
    for step in range(1, steps + 1):
        rng = np.random.default_rng(step)
        g = rng.normal(size=shape) * np.logspace(-4, 0, shape[-1])
        g[..., ::17] = 0.0
        g = jnp.asarray(g, jnp.float32)
        key = codes.step_keys(7, step, 3)[2]
        c1 = 1 - jnp.float32(rates[0]) ** step
        c2 = 1 - jnp.float32(rates[1]) ** step
        mu, nu, u = run(g, mu, nu, key, c1, c2)
        out.append((mu, nu, u))
    return out


def _bits_of(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 1: np.uint8, 4: np.uint32}[x.dtype.itemsize])


# (the traced rates in the `slow` tier: in interpret mode on CPU each case takes about 9 s)
@pytest.mark.parametrize("kind", _CODED)
@pytest.mark.parametrize("traced", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["static", "traced"])
def test_pallas_kernel_is_the_xla_update_bit_for_bit(kind, traced, monkeypatch):
    """Issue 50: the Pallas kernel (`optim_pallas`: one pass per tile of blocks) gives the new
    state of the XLA path (`optim_codes._update`) bit for bit, and the same direction, for
    each kind, over three steps, on leaves of several layouts (leading axes, partial tiles);
    the rates static (Python floats) or traced (inject_hyperparams). Jitted; on a CPU the
    kernel runs in interpret mode, on a TPU compiled (the path it takes there)."""
    from hifigrad._src import optim_codes as codes
    from hifigrad._src import optim_pallas
    if not optim_pallas.AVAILABLE:
        pytest.skip("Pallas is not available in this jax")
    monkeypatch.setattr(optim_pallas, "_TILE_ELEMENTS", 64 * 256)   # (80, 256): 2 tiles
    interpret = jax.default_backend() != "tpu"
    b1, b2, eps = 0.9, 0.999, 1e-8

    def xla(g, mu, nu, k, c1, c2, b1, b2):
        return codes._xla_step(kind, g, mu, nu, k, c1, c2, eps, b1=b1, b2=b2,
                               split=interpret)

    def kernel(g, mu, nu, k, c1, c2, b1, b2):
        return optim_pallas.leaf_step(kind, g, mu, nu, k, b1, b2, c1, c2, eps,
                                      interpret=interpret)

    def jitted(f):
        if traced:   # the rates as arguments (float32 arrays)
            fn = jax.jit(f)
            return lambda *a: fn(*a, jnp.float32(b1), jnp.float32(b2))
        return jax.jit(lambda *a: f(*a, b1, b2))

    for shape in _KERNEL_SHAPES:
        assert optim_pallas.supported(kind, shape), shape
        ref, got = (_kernel_steps(kind, shape, (b1, b2), jitted(f)) for f in (xla, kernel))
        for step, (want, have) in enumerate(zip(ref, got)):
            for x, y in zip(jax.tree.leaves(want[:2]), jax.tree.leaves(have[:2])):
                assert x.dtype == y.dtype and x.shape == y.shape == shape
                np.testing.assert_array_equal(_bits_of(x), _bits_of(y),
                                              err_msg=f"{shape} step {step}")
            np.testing.assert_array_equal(_bits_of(want[2]), _bits_of(have[2]),
                                          err_msg=f"{shape} step {step}: direction")


@pytest.mark.parametrize("mode", ["xla", "interpret"])
def test_fp16_state_saved_as_float16_steps_as_uint16(mode):
    """0.1.0 stored the fp16 first moment's codes as float16; they are now their bits, uint16
    (a Pallas kernel takes no float16 operand, and the bitcast beside it was a copy of the
    leaf each way on a TPU). A state saved as float16 still steps, bit for bit as the same
    state in uint16, on the XLA path and the kernel's (interpret mode here: a TPU's path), and
    its new codes are uint16."""
    from hifigrad._src import optim_codes as codes
    from hifigrad._src import optim_pallas
    if mode == "interpret" and not optim_pallas.AVAILABLE:
        pytest.skip("Pallas is not available in this jax")
    rng = np.random.default_rng(2)
    p0 = {"w": jnp.asarray(rng.normal(size=(8, 256)) * 0.1, jnp.float32)}
    tx = _adamw(1e-2, moments="fp16")
    g = {"w": jnp.asarray(rng.normal(size=(8, 256)) * 1e-2, jnp.float32)}
    with codes.kernel(mode):
        state = jax.jit(tx.update)(g, tx.init(p0), p0)[1]   # nonzero codes
        assert state[0].mu["w"].dtype == jnp.uint16
        old = (state[0]._replace(mu={"w": jax.lax.bitcast_convert_type(state[0].mu["w"],
                                                                         jnp.float16)}),
               *state[1:])
        new = [jax.jit(tx.update)(g, s, p0) for s in (state, old)]
    for a, b in zip(jax.tree.leaves(new[0]), jax.tree.leaves(new[1])):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(_bits_of(a), _bits_of(b))
    assert new[1][1][0].mu["w"].dtype == jnp.uint16


def test_pallas_path_trains_as_the_xla_path():
    """`scale_by_adam` with the kernel (`optim_codes.kernel("interpret")` on a CPU: the path a
    TPU takes) trains bit for bit as with the XLA path, on a tree of leaves the kernel takes and
    leaves it does not (the XLA path: (16, 4, 32), blocks across two axes; (6, 4, 64) and
    (3, 96), blocks of 64 and 96, half-empty lanes; (8,): float32 moments)."""
    from hifigrad._src import optim_codes as codes
    from hifigrad._src import optim_pallas
    if not optim_pallas.AVAILABLE:
        pytest.skip("Pallas is not available in this jax")
    for shape in [(16, 4, 32), (6, 4, 64), (3, 96)]:
        assert not optim_pallas.supported("8bit", shape)
    rng = np.random.default_rng(5)
    p0 = {"w": jnp.asarray(rng.normal(size=(16, 256)) * 0.1, jnp.bfloat16),
          "h": jnp.asarray(rng.normal(size=(16, 4, 32)) * 0.1, jnp.bfloat16),
          "k": jnp.asarray(rng.normal(size=(6, 4, 64)) * 0.1, jnp.bfloat16),
          "e": jnp.asarray(rng.normal(size=(3, 96)) * 0.1, jnp.bfloat16),
          "b": jnp.asarray(rng.normal(size=(8,)) * 0.1, jnp.bfloat16)}
    mode = "auto" if jax.default_backend() == "tpu" else "interpret"
    for moments in _CODED:
        out = []
        for m in ("xla", mode):
            tx = hg.optim.stochastic_rounding(_adamw(1e-2, moments=moments), seed=1)
            with codes.kernel(m):   # read when the step is traced, in `_train`
                out.append(_train(tx, p0, 3, 20))
        for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
            np.testing.assert_array_equal(_bits_of(a), _bits_of(b), err_msg=moments)


@pytest.mark.parametrize("rounding", ["nearest_away", "truncate"])
def test_pallas_split_master_bits_are_the_optimizers(rounding):
    """The kernel's split master (`optim_pallas._join_bits`, `_bf16_bits`,
    `_round_to_24_bits`, on int32 lanes) is `hifigrad.optim._join`, `round_to_bf16` and
    `_round_to_24_bits` bit for bit, on random bit patterns and the
    edges (zeros, infinities, NaNs, ties, the largest finite bf16). Off XLA:CPU the float
    arrays of the reference need not keep a NaN's payload or a subnormal (on a TPU v5e 0.7% of
    the patterns differed, those listed NaNs made canonical and subnormals flushed; as in
    `test_split_master_is_the_float32_master_exactly`): there those are left out."""
    from hifigrad._src import optim_pallas
    from hifigrad.optim import _join, _round_to_24_bits, _split, round_to_bf16
    bits = _sample_bits()
    x = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.float32)
    special = ((bits & 0x7F800000) == 0x7F800000) & ((bits & 0x7FFFFF) != 0)
    subnormal = ((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFFFF) != 0)
    kept = ~special & ~subnormal if not on_cpu() else np.ones(bits.shape, bool)
    param, low = _split(x, rounding)
    hi = jax.lax.bitcast_convert_type(param, jnp.uint16).astype(jnp.int32)
    lo = low.astype(jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(optim_pallas._join_bits(hi, lo, rounding)).view(np.uint32)[kept],
        _bits(_join(param, low, rounding))[kept])
    np.testing.assert_array_equal(
        np.asarray(optim_pallas._bf16_bits(jnp.asarray(bits.view(np.int32)), rounding))[kept],
        _bits_of(round_to_bf16(x, rounding)).astype(np.int32)[kept])
    # the 24-bit master's stochastic rounding (master="split8"), with random bits
    r = np.random.default_rng(1).integers(0, 2 ** 32, size=bits.shape, dtype=np.uint64)
    r = r.astype(np.uint32)
    np.testing.assert_array_equal(
        np.asarray(optim_pallas._round_to_24_bits(jnp.asarray(bits.view(np.int32)),
                                                  jnp.asarray(r.view(np.int32)))
                   ).view(np.uint32)[kept],
        _bits(_round_to_24_bits(x, jnp.asarray(r)))[kept])


# About 7-10 s each on CPU (interpret mode): the default suite runs one kind per lane, in turn
# (tests/lanes.py), with a schedule, a mask and nearest_away; the `slow` tier every kind, and
# truncation with a constant learning rate.
@pytest.mark.parametrize("master, kind, variant", [
    pytest.param(master, kind, variant,
                 marks=() if variant == "away-schedule-mask" and in_turn(i, 3)
                 else pytest.mark.slow)
    for master in ("split", "split8")
    for variant in ("away-schedule-mask", "truncate-constant")
    for i, kind in enumerate(_CODED)])
def test_pallas_split_master_trains_as_the_unfused_update(master, kind, variant, monkeypatch):
    """Issue 50: `master_weights(adamw(moments=...), master="split")` (and ``"split8"``, the
    24-bit master, rounded stochastically in the kernel) updates each bf16 leaf
    the kernel takes in one kernel, the moments and the split master together
    (`optim_codes.split_leaf_step`: no float32 direction between them), bit for bit the
    unfused update (the XLA path: `optim_codes.kernel("xla")`), parameters and state, over
    three steps: weight decay (masked off one leaf), a learning-rate schedule or a constant,
    both parameter roundings; leaves of the kernel (several tiles, the last partial; 1-D;
    leading axes) and of the XLA path, a float32 parameter. On a CPU the kernel runs in
    interpret mode; on a TPU compiled (`"auto"`), where the unfused update's kernels are
    removed (one Pallas call per leaf the kernel takes)."""
    from hifigrad._src import optim_codes as codes
    from hifigrad._src import optim_pallas
    if not optim_pallas.AVAILABLE:
        pytest.skip("Pallas is not available in this jax")
    monkeypatch.setattr(optim_pallas, "_TILE_ELEMENTS", 64 * 256)   # (80, 256): 2 tiles
    fused = []
    real = optim_pallas.split_leaf_step
    monkeypatch.setattr(optim_pallas, "split_leaf_step",
                        lambda *a, **k: fused.append(np.shape(a[1])) or real(*a, **k))
    rng = np.random.default_rng(9)
    p0 = {"w": jnp.asarray(rng.normal(size=(80, 256)) * 0.1, jnp.bfloat16),
          "v": jnp.asarray(rng.normal(size=(1024,)) * 0.1, jnp.bfloat16),
          "t": jnp.asarray(rng.normal(size=(2, 3, 384)) * 0.1, jnp.bfloat16),
          "h": jnp.asarray(rng.normal(size=(16, 4, 32)) * 0.1, jnp.bfloat16),
          "f": jnp.asarray(rng.normal(size=(8, 128)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(8,)) * 0.1, jnp.bfloat16)}
    taken = [(80, 256), (1024,), (2, 3, 384)]
    if variant == "away-schedule-mask":
        lr, rounding = optax.linear_schedule(3e-2, 1e-3, 3), "nearest_away"
        mask = {k: k != "t" for k in p0}
    else:
        lr, rounding, mask = 3e-2, "truncate", None

    def make():
        return hg.optim.master_weights(_adamw(lr, weight_decay=0.1, mask=mask,
                                                      moments=kind),
                                       master=master, param_rounding=rounding, seed=4)

    mode = "auto" if jax.default_backend() == "tpu" else "interpret"
    out = []
    for m in ("xla", mode):
        fused.clear()
        with codes.kernel(m):   # read when the step is traced, in `_train`
            out.append(_train(make(), p0, 3, 30))
    assert sorted(fused) == sorted(taken), fused
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(_bits_of(a), _bits_of(b),
                                      err_msg=f"{master} {kind} {variant}")
    assert not np.array_equal(_bits_of(out[1][0]["w"]), _bits_of(p0["w"]))
    if jax.default_backend() == "tpu":
        tx = make()
        with codes.kernel("auto"):
            hlo = jax.jit(_step(tx)).lower(p0, tx.init(p0), p0).compile().as_text()
        # the fused leaves' kernels, and the float32 parameter's moments' (`leaf_step`)
        assert hlo.count('custom_call_target="tpu_custom_call"') == len(taken) + 1
