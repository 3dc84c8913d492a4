"""hifigrad.optim.master_weights: bf16 parameters trained through a float32 master copy equal
an independent float32 optax run on float32 parameters, rounded."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hifigrad as hg

optax = pytest.importorskip("optax")

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
    np.testing.assert_array_equal(back[~nan], bits[~nan])
    assert np.isnan(np.asarray(_join(param, low, rounding)))[nan].all()
    assert np.isnan(np.asarray(param, np.float32))[nan].all()
    if rounding == "nearest_away":  # round to nearest: it differs from ties-to-even at ties only
        rne = np.asarray(x.astype(jnp.bfloat16), np.float32)
        diff = (np.asarray(param, np.float32) != rne) & ~nan
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


def test_split_master_needs_a_rounding_its_16_bits_hold():
    with pytest.raises(ValueError, match="nearest_away"):
        hg.optim.master_weights(optax.sgd(1e-3), master="split", param_rounding="nearest_even")
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
    the exact value, to the compensation's bf16 rounding) and, on average, by stochastic
    rounding (each step's bits random: the mean of 512 parameters within 2e-3)."""
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


# ------------------------------------------------------------------ compact moments

def _adam_run(tx, steps=20):
    p = {"w": jnp.zeros((8, 256), jnp.float32)}
    state = tx.init(p)
    outs = []
    for i in range(steps):
        g = {"w": jnp.asarray(np.random.default_rng(i).normal(size=(8, 256)) *
                              np.logspace(-4, 0, 256), jnp.float32)}
        u, state = jax.jit(tx.update)(g, state, p)
        outs.append(np.asarray(u["w"]))
    return np.stack(outs), state


def test_float32_moments_are_optax_adam():
    got, _ = _adam_run(hg.optim.scale_by_adam(0.9, 0.999, 1e-8))
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes dtypes
        want, _ = _adam_run(optax.scale_by_adam(0.9, 0.999, 1e-8))
    # the updates are O(1) quotients; the two associate the bias correction differently, each
    # rounding 2**-24 of an O(1) term per step: over 20 steps at most ~20 ulps of 1 (2.4e-6),
    # which on an update that cancels to 0.03 is 1e-4 relative, hence an absolute bound
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=20 * 2.0 ** -23)


@pytest.mark.parametrize("moments, half_step", [("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8),
                                                 ("8bit", 2.0 ** -4)])
def test_compact_moments_stay_close_to_float32(moments, half_step):
    """Adam's updates with compact moments against float32 moments, over 20 steps of gradients
    spanning four decades within each block. Each store rounds stochastically, with a relative
    error of at most half the code's spacing (float16 2**-11, bf16 2**-8, the 8-bit code's 3
    mantissa bits 2**-4); unbiased, the errors add in quadrature over the moments' memory
    (about 1 / sqrt(1 - b1**2) = 2.3 stores for the first, sqrt(20) = 4.5 for the second,
    halved through its square root): norm-wise, within 5 half-spacings."""
    ref, _ = _adam_run(hg.optim.scale_by_adam())
    got, state = _adam_run(hg.optim.scale_by_adam(moments=moments, seed=3))
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 5 * half_step, err
    assert np.all(np.isfinite(got))
    if moments != "8bit":  # float32's updates stay within 1.004 here; 8-bit's elements wander
        assert np.max(np.abs(got)) <= np.max(np.abs(ref)) * (1 + 5 * half_step)
    if moments in ("8bit", "fp16"):
        code = jnp.uint8 if moments == "8bit" else jnp.float16
        assert state.mu["w"].dtype == code and state.nu["w"].dtype == code
        assert state.mu_scale["w"].shape == (8, 2)


def test_fp16_code_is_unbiased_and_exact_on_its_values():
    """The float16 code rounds stochastically: a value between two codes comes back as either,
    with mean the value; a block's largest element and any float16 multiple of the scale come
    back exactly."""
    from hifigrad.optim import _decode16, _encode16
    x = jnp.asarray([1.0, 0.5 + 2.0 ** -13, 16.25 * 2.0 ** -24, -0.25] + [0.0] * 124, jnp.float32)
    draws = []
    for s in range(400):
        bits = jax.random.bits(jax.random.key(s), x.shape, jnp.uint16)
        c, sc = _encode16(x, bits)
        assert c.dtype == jnp.float16
        draws.append(np.asarray(_decode16(c, sc)))
    draws = np.stack(draws)
    assert np.all(draws[:, 0] == 1.0) and np.all(draws[:, 3] == -0.25)
    assert set(np.unique(draws[:, 1])) == {0.5, 0.5 + 2.0 ** -11}
    assert set(np.unique(draws[:, 2])) == {16 * 2.0 ** -24, 17 * 2.0 ** -24}
    # the mean of 400 draws: within 4 standard errors (the spread is the gap times 1/2 at most)
    for k, gap in ((1, 2.0 ** -11), (2, 2.0 ** -24)):
        assert abs(draws[:, k].mean() - float(x[k])) < 4 * gap / 2 / np.sqrt(400)


def test_unknown_moments_is_an_error():
    with pytest.raises(ValueError, match="moments must be one of"):
        hg.optim.scale_by_adam(moments="fp8")


def test_state_bytes_per_parameter():
    """What each configuration keeps per bf16 parameter (the parameter itself included):
    float32 master 14, split master 12, split master with 8-bit moments about 6.06, Kahan
    with bf16 moments 8, with block-scaled float16 moments 8.06 (two float32 scales per 128)."""
    params = {"w": jnp.zeros((64, 256), jnp.bfloat16)}
    n = 64 * 256

    def per_param(tx):
        state = tx.init(params)
        return (sum(x.nbytes for x in jax.tree.leaves(state)) + 2 * n) / n

    assert per_param(hg.optim.master_weights(optax.adamw(1e-3))) == pytest.approx(14, abs=0.01)
    assert per_param(hg.optim.master_weights(optax.adamw(1e-3), master="split")) == \
        pytest.approx(12, abs=0.01)
    assert per_param(hg.optim.master_weights(hg.optim.adamw(1e-3, moments="8bit"),
                                             master="split")) == pytest.approx(6.06, abs=0.02)
    assert per_param(hg.optim.kahan(hg.optim.adamw(1e-3, moments="bf16"))) == \
        pytest.approx(8, abs=0.01)
    assert per_param(hg.optim.kahan(hg.optim.adamw(1e-3, moments="fp16"))) == \
        pytest.approx(8.06, abs=0.01)


def test_random_bits_are_uniform_and_keyed():
    """The stochastic roundings' bits (a counter-based hash): each of the 16 bits is set in
    half of 2**20 draws (to 5 standard errors: 5 * 0.5 / 2**10), their mean is the uniform's
    (2**15 - 0.5, to 5 standard errors of 2**16 / sqrt(12 * 2**20)), neighbouring elements are
    uncorrelated (|r| < 5 / 2**10), and another seed, step or leaf gives other bits; the same
    arguments give the same bits, jitted or not."""
    from hifigrad.optim import _leaf_bits

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
