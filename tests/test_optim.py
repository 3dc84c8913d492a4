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
