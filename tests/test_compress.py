"""hg.compress_checkpoints: the checkpoints a model already has, compressed, on every framework.

References: with ``codec="none"`` the gradients equal `hg.grad` of the unmodified function (the
same float32 backward, recomputed from the same bf16/f32 values: equal to float32 rounding of a
reordered sum, so rtol 1e-6 ~ 8 float32 ulps); with a codec they equal `hg.scan`'s with that
codec on the same model (the same encoded carries, the same recomputation: bitwise on CPU,
rtol 1e-6 elsewhere). Each case runs jitted and not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from platforms import cpu_only, highest_precision
from test_checkpoint import _attn_block, _attn_params  # a pre-LN transformer block

import hifigrad as hg

RTOL = 1e-6


def _close(a, b, rtol=RTOL):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert x.dtype == y.dtype, (x.dtype, y.dtype)
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * np.abs(y).max())


# ------------------------------------------------------------------ a trainer's remat scan

def _layer(c, xs):
    """A layer as trainers write it: per-layer weights and a typed PRNG key in `xs`, a named
    intermediate, dropout."""
    w, key = xs
    h = checkpoint_name(jnp.tanh(c @ w), "h")
    keep = jax.random.bernoulli(key, 0.9, h.shape)
    return jnp.where(keep, h, jnp.zeros_like(h)).astype(c.dtype), None


def _trainer_loss(ws, x, keys):
    layer = jax.checkpoint(_layer, policy=jax.checkpoint_policies.save_only_these_names("h"))
    y = jax.lax.scan(layer, x, (ws, keys))[0]
    return jnp.sum(y.astype(jnp.float32) ** 2)


def _hg_scan_loss(codec):
    def loss(ws, x, keys):
        y = hg.scan(_layer, x, (ws, keys), codec=codec)[0]
        return jnp.sum(y.astype(jnp.float32) ** 2)
    return loss


def _trainer_args(dtype):
    ws = (jax.random.normal(jax.random.key(0), (4, 16, 16)) * 0.3).astype(dtype)
    x = jax.random.normal(jax.random.key(1), (8, 16)).astype(dtype)
    return ws, x, jax.random.split(jax.random.key(2), 4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_codec_none_equals_hg_grad_of_the_unmodified_function(maybe_jit, dtype):
    args = _trainer_args(dtype)
    with highest_precision():
        got = maybe_jit(hg.grad(hg.compress_checkpoints(_trainer_loss, "none"),
                                argnums=(0, 1)))(*args)
        want = maybe_jit(hg.grad(_trainer_loss, argnums=(0, 1)))(*args)
    assert all(g.dtype == jnp.float32 for g in got)
    _close(got, want)


@pytest.mark.parametrize("codec, outer", [("int8", "jax.grad"), ("fp8_e4m3", "hg.grad"),
                                          ("int4", "jax.grad")])
def test_codec_equals_hg_scan_with_that_codec(maybe_jit, codec, outer):
    args = _trainer_args(jnp.bfloat16)
    grad = jax.grad if outer == "jax.grad" else hg.grad
    with highest_precision():
        got = maybe_jit(grad(hg.compress_checkpoints(_trainer_loss, codec), argnums=(0, 1)))(
            *args)
        want = maybe_jit(grad(_hg_scan_loss(codec), argnums=(0, 1)))(*args)
    _close(got, want)


def test_forward_is_the_function_s_own():
    args = _trainer_args(jnp.bfloat16)
    f = hg.compress_checkpoints(_trainer_loss, "int4")
    assert np.asarray(f(*args)) == np.asarray(_trainer_loss(*args))
    assert np.asarray(jax.jit(f)(*args)) == np.asarray(jax.jit(_trainer_loss)(*args))


def _saved(f, *args):
    """(dtype name, shape) of every residual the forward saves for the backward (the leaves of
    the `jax.vjp` function, a pytree of them)."""
    def describe(r):
        if jax.dtypes.issubdtype(r.dtype, jax.dtypes.extended):
            return "key", tuple(r.shape)
        return np.dtype(r.dtype).name, tuple(r.shape)
    return [describe(r) for r in jax.tree_util.tree_leaves(jax.vjp(f, *args)[1])]


def test_saves_the_carry_encoded_and_the_parameters_as_they_are():
    ws, x, keys = _trainer_args(jnp.bfloat16)
    plain = _saved(_trainer_loss, ws, x, keys)
    comp = _saved(hg.compress_checkpoints(_trainer_loss, "int8"), ws, x, keys)
    # jax.checkpoint with save_only_these_names('h') saves the bf16 carries and the named h
    assert ("bfloat16", (4, 8, 16)) in plain
    # compressed: no bf16 carry-sized array per layer, an int8 encoding instead; the per-layer
    # weights (xs) and keys are saved as they are (not encoded)
    assert ("bfloat16", (4, 8, 16)) not in comp
    assert any(d == "int8" and s[0] == 4 for d, s in comp), comp
    assert ("bfloat16", (4, 16, 16)) in comp
    assert ("key", (4,)) in comp
    enc = sum(np.prod(s) * np.dtype(d).itemsize for d, s in comp if d == "int8")
    assert enc < 4 * 8 * 16 * 2  # less than the bf16 carries


def test_unrolled_layers_encode_activations_not_parameter_casts():
    """An unrolled model: the checkpoint's inputs are a previous layer's output (encoded) and a
    cast of a float32 master weight (a parameter: saved as it is)."""
    block = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))

    def loss(ws, x):
        h = x
        for w in ws:
            h = block(h, w.astype(jnp.bfloat16))
        return jnp.sum(h.astype(jnp.float32))

    ws = [jax.random.normal(jax.random.key(i), (16, 16)) * 0.3 for i in range(3)]
    x = jax.random.normal(jax.random.key(9), (8, 16)).astype(jnp.bfloat16)
    comp = _saved(hg.compress_checkpoints(loss, "int8"), ws, x)
    assert ("bfloat16", (16, 16)) in comp  # the parameter casts, as they are
    assert ("bfloat16", (8, 16)) in comp  # the first block's input is the function's input x
    assert sum(d == "int8" for d, _ in comp) == 2  # the two later blocks' inputs are encoded
    with highest_precision():
        _close(hg.grad(hg.compress_checkpoints(loss, "none"))(ws, x), hg.grad(loss)(ws, x))


def test_checkpoints_in_loops_branches_and_jit(maybe_jit):
    block = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))

    def loss(w, x):
        h = jax.lax.fori_loop(0, 3, lambda i, h: block(h, w), x)  # a while loop
        h = jax.lax.cond(h.sum() > 0, lambda h: block(h, w), lambda h: -block(h, w), h)
        h = jax.jit(lambda h: block(h, w))(h)
        return jnp.sum(h ** 2)

    w = jax.random.normal(jax.random.key(0), (16, 16)) * 0.3
    x = jax.random.normal(jax.random.key(1), (8, 16))
    with highest_precision():
        _close(maybe_jit(jax.grad(hg.compress_checkpoints(loss, "none")))(w, x),
               maybe_jit(jax.grad(loss))(w, x))
    # with a codec, every one of the 5 checkpoints saves its input encoded
    # (fori_loop with a constant trip count lowers to a scan under reverse-mode AD)
    assert sum(d == "int8" for d, _ in _saved(hg.compress_checkpoints(loss, "int8"), w, x)) >= 3


def test_vmap_and_save_residuals(maybe_jit):
    args = _trainer_args(jnp.float32)
    f = hg.compress_checkpoints(_trainer_loss, "int8", save="residuals")
    g = maybe_jit(jax.vmap(jax.grad(f), in_axes=(None, 0, None)))(
        args[0], jnp.stack([args[1], -args[1]]), args[2])
    want = _hg_scan_loss_save(codec="int8", save="residuals")
    w = jax.grad(want)(args[0], -args[1], args[2])
    with highest_precision():
        _close(g[1], w)


def _hg_scan_loss_save(codec, save):
    def loss(ws, x, keys):
        y = hg.scan(_layer, x, (ws, keys), codec=codec, save=save)[0]
        return jnp.sum(y.astype(jnp.float32) ** 2)
    return loss


def test_non_array_leaves_and_outputs_pass_through():
    """Non-array leaves of the arguments (a float, a string, a function) are static, and
    non-array outputs come back as they are."""
    def loss(w, x, config):
        y = jax.checkpoint(lambda x, w: config["act"](x @ w))(x, w)
        return jnp.sum(y) * config["scale"], {"name": config["name"], "n": 3}

    config = {"scale": 2.0, "name": "layer", "act": jnp.tanh}
    w, x = jnp.ones((4, 4)) * 0.1, jnp.ones((2, 4))
    (v, aux), g = jax.value_and_grad(hg.compress_checkpoints(loss, "int8"), has_aux=True)(
        w, x, config)
    (v0, _), g0 = jax.value_and_grad(loss, has_aux=True)(w, x, config)
    assert aux == {"name": "layer", "n": 3}
    assert v == v0
    np.testing.assert_allclose(g, g0, rtol=2 ** -6)  # int8 carries: 2**-7 relative error


@pytest.mark.parametrize("bad, error, match", [
    (dict(codec="nope"), ValueError, "codec"),
    (dict(codec="int8", save="everything"), ValueError, "save"),
    (dict(codec="int8", policy=jax.checkpoint_policies.nothing_saveable), TypeError,
     "hifigrad.Policy"),
    (dict(codec=hg.codecs.DelayedFP8Codec()), TypeError, "codec_state"),
])
def test_bad_arguments_name_the_fix(bad, error, match):
    with pytest.raises(error, match=match):
        hg.compress_checkpoints(_trainer_loss, **bad)


def test_not_callable():
    with pytest.raises(TypeError, match="expected a function"):
        hg.compress_checkpoints(3, "int8")


# ------------------------------------------------------------------ frameworks

def test_flax_linen_scan_of_remat():
    import flax.linen as nn

    class Body(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.tanh(nn.Dense(16, dtype=jnp.bfloat16)(x))

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return Body(name="body")(x), None

    Stack = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                    length=4)
    x = jax.random.normal(jax.random.key(1), (8, 16)).astype(jnp.bfloat16)
    params = Stack().init(jax.random.key(0), x, None)

    def loss(p, x):
        return jnp.sum(Stack().apply(p, x, None)[0].astype(jnp.float32) ** 2)

    with highest_precision():
        _close(hg.grad(hg.compress_checkpoints(loss, "none"))(params, x), hg.grad(loss)(params, x))
        # the same blocks through hifigrad's own linen remat_scan with the codec: the same
        # gradients
        ref = hg.flax.remat_scan(Body, lengths=(4,), codec="int8",
                                 variable_axes={"params": 0}, split_rngs={"params": True})
        ref_params = ref().init(jax.random.key(0), x)
        ref_params = jax.tree_util.tree_unflatten(  # the same weights
            jax.tree_util.tree_structure(ref_params),
            jax.tree_util.tree_leaves(params["params"]["body"]))
        want = jax.grad(lambda p: jnp.sum(ref().apply(p, x).astype(jnp.float32) ** 2))(
            ref_params)
        got = jax.grad(hg.compress_checkpoints(loss, "int8"))(params, x)
    _close(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))


def _nnx_model(with_counter=False, dtype=jnp.bfloat16):
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(16, 16, param_dtype=dtype, dtype=dtype, rngs=rngs)
            if with_counter:
                self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            if with_counter:
                self.calls[...] += 1
            return jnp.tanh(self.lin(x))

    return _nnx_scan_stack(Block, 4)


def _nnx_scan_stack(block_cls, n):
    """`n` blocks made with ``nnx.vmap`` and run by ``nnx.scan(nnx.remat(...))``, as the
    Flax NNX guide stacks layers."""
    from flax import nnx

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return block_cls(nnx.Rngs(key))

    class Model(nnx.Module):
        def __init__(self):
            self.blocks = make(jax.random.split(jax.random.key(0), n))

        def __call__(self, x):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            @nnx.remat
            def step(block, x):
                return block(x)

            return step(self.blocks, x)

    return Model()


def _nnx_loss(model, x):
    return jnp.sum(model(x).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("outer, dtype", [("nnx.grad", jnp.float32),
                                          ("hg.flax.grad", jnp.bfloat16)])
def test_flax_nnx_scan_of_remat(outer, dtype):
    """nnx.grad of a float32 model (a bf16 one's cotangents would be rounded to bf16 at each
    checkpoint's boundary, a float32 one's are not) and hg.flax.grad of a bf16 one."""
    from flax import nnx

    grad = nnx.grad if outer == "nnx.grad" else hg.flax.grad
    x = jax.random.normal(jax.random.key(1), (8, 16)).astype(dtype)
    model = _nnx_model(dtype=dtype)
    with highest_precision():
        got = grad(hg.compress_checkpoints(_nnx_loss, "none"))(model, x)
        want = grad(_nnx_loss)(model, x)
        _close(nnx.state(got), nnx.state(want))
        # with a codec: the same blocks through hg.scan
        got = grad(hg.compress_checkpoints(_nnx_loss, "int8"))(model, x)
        want = grad(_nnx_scan_loss)(model, x)
    _close(nnx.state(got), nnx.state(want))


def _nnx_scan_loss(model, x):
    from flax import nnx

    graphdef, state = nnx.split(model.blocks)

    def body(c, s):
        return nnx.merge(graphdef, s)(c), None

    y = hg.scan(body, x, state, codec="int8")[0]
    return jnp.sum(y.astype(jnp.float32) ** 2)


def test_flax_nnx_variable_updates_reach_the_caller():
    from flax import nnx

    x = jnp.ones((8, 16), jnp.bfloat16)
    model = _nnx_model(with_counter=True)
    ref = _nnx_model(with_counter=True)
    nnx.grad(hg.compress_checkpoints(_nnx_loss, "int8"))(model, x)
    nnx.grad(_nnx_loss)(ref, x)
    assert np.array_equal(np.asarray(model.blocks.calls[...]), np.asarray(ref.blocks.calls[...]))
    assert int(model.blocks.calls[...].sum()) == 4


def _eqx_mlp(dtype):
    eqx = pytest.importorskip("equinox")

    class MLP(eqx.Module):
        layers: list
        act: object

        def __init__(self, key):
            keys = jax.random.split(key, 4)
            self.layers = [eqx.nn.Linear(16, 16, key=k, dtype=dtype) for k in keys]
            self.act = jax.nn.gelu

        def __call__(self, x):
            for layer in self.layers:
                x = eqx.filter_checkpoint(lambda l, x: self.act(jax.vmap(l)(x)))(layer, x)
            return x

    return MLP(jax.random.key(0))


def _eqx_loss(m, x):
    return jnp.sum(m(x).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("outer, dtype", [("eqx.filter_grad", jnp.float32),
                                          ("hg.equinox.filter_grad", jnp.bfloat16)])
def test_equinox_filter_checkpoint(outer, dtype):
    eqx = pytest.importorskip("equinox")

    grad = eqx.filter_grad if outer == "eqx.filter_grad" else hg.equinox.filter_grad
    model = _eqx_mlp(dtype)
    x = jax.random.normal(jax.random.key(1), (8, 16)).astype(dtype)
    with highest_precision():
        got = eqx.filter_jit(grad(hg.compress_checkpoints(_eqx_loss, "none")))(model, x)
        want = eqx.filter_jit(grad(_eqx_loss))(model, x)
    _close(eqx.filter(got, eqx.is_array), eqx.filter(want, eqx.is_array))
    got = grad(hg.compress_checkpoints(_eqx_loss, "fp8_e4m3"))(model, x)
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(
        eqx.filter(got, eqx.is_array)))
    params, static = eqx.partition(model, eqx.is_array)
    comp = _saved(lambda p, x: hg.compress_checkpoints(_eqx_loss, "fp8_e4m3")(
        eqx.combine(p, static), x), params, x)
    # layers 2-4's inputs, one byte an element (fp8 bits); layer 1's is the function's input
    assert sum(np.dtype(d).itemsize == 1 and s == (8, 16) for d, s in comp) == 3


# ----------------------------------------------- every style x every outer transform

def _style(name):
    """(loss, differentiated argument, x) of one framework style, float32 (so that every outer
    transform's gradients of the unmodified loss are float32 too, and equal to rounding)."""
    x = jax.random.normal(jax.random.key(1), (8, 16))
    if name == "remat scan":
        ws, _, keys = _trainer_args(jnp.float32)
        return (lambda ws, x: _trainer_loss(ws, x, keys)), ws, x
    if name == "linen":
        import flax.linen as nn

        class Block(nn.Module):
            @nn.compact
            def __call__(self, h, _):
                return jnp.tanh(nn.Dense(16)(h)), None

        stack = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                        split_rngs={"params": True}, length=4)
        params = stack().init(jax.random.key(0), x, None)
        return (lambda p, x: jnp.sum(stack().apply(p, x, None)[0] ** 2)), params, x
    if name == "nnx":
        return _nnx_loss, _nnx_model(dtype=jnp.float32), x
    model = _eqx_mlp(jnp.float32)
    return _eqx_loss, model, x


def _outer(name):
    if name == "nnx.grad":
        from flax import nnx
        return nnx.grad
    if name == "eqx.filter_grad":
        import equinox as eqx
        return eqx.filter_grad
    return {"jax.grad": jax.grad, "hg.grad": hg.grad}[name]


def _arrays_of(tree):
    return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


@pytest.mark.parametrize("outer", ["jax.grad", "hg.grad", "nnx.grad", "eqx.filter_grad"])
@pytest.mark.parametrize("style", ["remat scan", "linen", "nnx", "equinox"])
def test_every_style_under_every_outer_transform(style, outer):
    """codec 'none' gives the unmodified loss's gradients under the same transform; int8 gives
    float32 gradients within int8's error of them (2**-7 relative per saved carry)."""
    if "equinox" in (style, outer) or outer == "eqx.filter_grad":
        pytest.importorskip("equinox")
    if style == "equinox" and outer in ("jax.grad", "hg.grad", "nnx.grad"):
        import equinox as eqx
        loss, model, x = _style(style)
        params, static = eqx.partition(model, eqx.is_array)
        loss = (lambda loss: lambda p, x: loss(eqx.combine(p, static), x))(loss)
        arg = params
    elif style == "nnx" and outer in ("jax.grad", "hg.grad", "eqx.filter_grad"):
        from flax import nnx
        loss, model, x = _style(style)
        graphdef, state = nnx.split(model)
        loss = (lambda loss: lambda s, x: loss(nnx.merge(graphdef, s), x))(loss)
        arg = state
    else:
        loss, arg, x = _style(style)
    grad = _outer(outer)
    with highest_precision():
        want = _arrays_of(grad(loss)(arg, x))
        got = _arrays_of(grad(hg.compress_checkpoints(loss, "none"))(arg, x))
        lossy = _arrays_of(grad(hg.compress_checkpoints(loss, "int8"))(arg, x))
    _close(got, want)
    assert all(g.dtype == jnp.float32 for g in lossy)
    num = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(lossy, want))
    den = sum(float(jnp.sum(b ** 2)) for b in want)
    assert 0 < num / den < 1e-3  # the codec's error, and only that: SQNR > 30 dB


def test_a_function_without_checkpoints_warns():
    f = hg.compress_checkpoints(lambda w, x: jnp.sum(jnp.tanh(x @ w)), "int8")
    with pytest.warns(UserWarning, match="has no checkpoint"):
        g = jax.grad(f)(jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert g.shape == (4, 4)


# ------------------------------------------------------------------ the sliced backward

@jax.custom_vjp
def _clipped(x):
    return x


_clipped.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))


def test_a_block_with_a_custom_vjp_slices_as_hg_scans_does():
    """A block with a custom_vjp function (a user's clipped gradient) under
    compress_checkpoints: its forward and backward rules are resized with the block, so it
    slices as hg.scan's does, with the same gradients to float32 rounding of the parameter
    cotangents' sums, taken in another order (16 eps of the largest entry)."""
    n, b, t, d = 2, 16, 64, 64
    p = _attn_params(n, d, jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(b, t, d)), jnp.float32)

    def block(h, p):
        return h + jnp.tanh(_clipped(h @ p["w1"])) @ p["w2"], None

    def remat(p, x):
        return jnp.mean(jax.lax.scan(jax.checkpoint(block), x, p)[0] ** 2)

    def scanned(p, x):
        return jnp.mean(hg.scan(block, x, p, codec="int8", backward_slices=4)[0] ** 2)

    cc = hg.compress_checkpoints(remat, "int8", backward_slices=4)
    assert hg.slice_report(hg.grad(cc), p, x) == ["sliced: 4 slices of 4 batch rows"]
    assert hg.slice_report(hg.grad(scanned), p, x) == ["sliced: 4 slices of 4 batch rows"]
    with highest_precision():
        got = jax.jit(hg.grad(cc))(p, x)
        want = jax.jit(hg.grad(scanned))(p, x)
    for k in got:
        scale = float(jnp.abs(want[k]).max())
        np.testing.assert_allclose(got[k], want[k], rtol=0,
                                   atol=16 * np.finfo(np.float32).eps * scale)


@cpu_only(reason="XLA:CPU's buffer sizes")
@pytest.mark.no_slice_check
def test_sliced_backward_memory_and_gradients_equal_hg_scans():
    """On a bf16 transformer stack, hg.grad over compress_checkpoints of the plain remat scan
    runs the same sliced float32 backward as hg.scan: the same peak temp (below the bf16 remat
    scan's) and the same gradients."""
    n, b, t, d = 4, 16, 128, 64
    p = _attn_params(n, d, jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(b, t, d)), jnp.bfloat16)
    block = _attn_block(2)

    def loss(scan):
        return lambda p, x: jnp.mean(scan(p, x).astype(jnp.float32) ** 2)

    remat = loss(lambda p, x: jax.lax.scan(jax.checkpoint(block), x, p)[0])
    scanned = loss(lambda p, x: hg.scan(block, x, p, codec="int8")[0])
    steps = {"cc": hg.grad(hg.compress_checkpoints(remat, "int8")), "hg.scan": hg.grad(scanned),
             "remat": jax.grad(remat)}
    temp = {k: jax.jit(f).lower(p, x).compile().memory_analysis().temp_size_in_bytes
            for k, f in steps.items()}
    assert temp["cc"] == temp["hg.scan"], temp
    assert temp["cc"] < temp["remat"], temp
    _close(jax.jit(steps["cc"])(p, x), jax.jit(steps["hg.scan"])(p, x), rtol=0)


def _llama_style_block(heads):
    """A block written as MaxText writes its llama decoder layer: RMSNorm, RoPE from integer
    `positions` [B, T], a causal mask combined with integer `segment_ids` [B, T], named
    activations (`checkpoint_name`), sharding constraints on a one-device mesh, the
    (B, T, D) -> (B*T, D) -> (B, T, D) reshape around the MLP, a float `tril` mask."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))

    def constrain(v):
        spec = P("data", *([None] * (v.ndim - 1)))
        return jax.lax.with_sharding_constraint(v, NamedSharding(mesh, spec))

    def block(carry, p):
        x, positions, segment_ids = carry
        b, t, d = x.shape
        dh = d // heads

        def rms(v):
            v32 = v.astype(jnp.float32)
            return (v32 * jax.lax.rsqrt(jnp.mean(v32 * v32, -1, keepdims=True) + 1e-6)
                    ).astype(v.dtype)

        def rope(v):  # v: [b, t, heads, dh]
            freq = 1.0 / (10000.0 ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
            ang = positions.astype(jnp.float32)[:, :, None, None] * freq[None, None, None]
            v1, v2 = jnp.split(v.astype(jnp.float32), 2, axis=-1)
            c, s = jnp.cos(ang), jnp.sin(ang)
            return jnp.concatenate([v1 * c - v2 * s, v2 * c + v1 * s], -1).astype(v.dtype)

        h = constrain(rms(x))
        q = checkpoint_name(rope((h @ p["wq"]).reshape(b, t, heads, dh)), "query")
        k = checkpoint_name(rope((h @ p["wk"]).reshape(b, t, heads, dh)), "key")
        v = checkpoint_name((h @ p["wv"]).reshape(b, t, heads, dh), "value")
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(dh ** -0.5, x.dtype)
        causal = jnp.tril(jnp.ones((t, t), x.dtype))
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = jnp.logical_and(causal[None] > 0, same)[:, None]
        s = jnp.where(mask, s, jnp.asarray(-1e9 if x.dtype == jnp.float32 else -3e38, s.dtype))
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, d)
        x = constrain(x + checkpoint_name(o @ p["wo"], "attn_out"))
        h = rms(x).reshape(b * t, d)
        m = jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])
        x = constrain(x + checkpoint_name(m @ p["w2"], "mlp").reshape(b, t, d))
        return (x, positions, segment_ids), None
    return block


def _llama_params(n, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    f = 2 * d
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, f),
              "w3": (d, f), "w2": (f, d)}
    return {k: jnp.asarray(rng.normal(size=(n, *s)) / np.sqrt(s[0]), dtype)
            for k, s in shapes.items()}


def _llama_loss(block):
    def loss(p, x, positions, segment_ids):
        layer = jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable)
        y = jax.lax.scan(layer, (x, positions, segment_ids), p)[0][0]
        return jnp.mean(y.astype(jnp.float32) ** 2)
    return loss


def _llama_args(dtype, b=16, t=128, d=64, n=2):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(b, t, d)), dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    segment_ids = jnp.asarray(np.repeat(np.arange(b * 2) % 3, t // 2).reshape(b, t), jnp.int32)
    return _llama_params(n, d, dtype), x, positions, segment_ids


def test_maxtext_style_blocks_slice_and_equal_the_unsliced_backward(maybe_jit):
    """Names, sharding constraints, integer positions and segment ids (sliced with the
    batch), a reshape that merges the batch axis and a float tril mask: the compressed
    checkpoints' float32 backward runs in slices, and with ``codec="none"`` its gradients
    are `jax.grad`'s of the same float32 model (float32 rounding of sums reordered: RTOL)."""
    loss = _llama_loss(_llama_style_block(2))
    args = _llama_args(jnp.float32)
    cc = hg.compress_checkpoints(loss, "none", backward_slices=4)
    report = hg.slice_report(jax.grad(cc), *args)
    assert report == ["sliced: 4 slices of 4 batch rows"] * len(report) and report, report
    with highest_precision():
        got = maybe_jit(hg.grad(cc))(*args)
        want = maybe_jit(jax.grad(loss))(*args)
    _close(got, want, rtol=1e-5)


@pytest.mark.parametrize("act", ["relu", "relu6", "silu"])
def test_custom_jvp_activations_slice_with_their_own_rule(maybe_jit, act):
    """A custom_jvp activation (ReLU: its JVP rule is JAX's, 0 at 0; relu6) in a compressed
    block is resized with its rule: the backward slices, and with ``codec="none"`` the
    gradients are `jax.grad`'s of the same float32 model (RTOL 1e-5: float32 sums
    reordered). The input has exact zeros, where the rule and max(x, 0)'s derivative
    differ."""
    fn = getattr(jax.nn, act)
    n, b, t, d = 2, 16, 128, 32
    p = _attn_params(n, d, jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(b, t, d)), jnp.float32)
    x = x.at[:, :, :4].set(0.0)

    def block(h, p):
        return h + fn(h @ p["w1"]) @ p["w2"] + fn(h) * 0.5, None

    def remat(p, x):
        return jnp.mean(jax.lax.scan(jax.checkpoint(block), x, p)[0] ** 2)

    cc = hg.compress_checkpoints(remat, "none", backward_slices=4)
    assert hg.slice_report(jax.grad(cc), p, x) == ["sliced: 4 slices of 4 batch rows"]
    with highest_precision():
        _close(maybe_jit(hg.grad(cc))(p, x), maybe_jit(jax.grad(remat))(p, x), rtol=1e-5)


def test_flax_nnx_attention_blocks_slice(maybe_jit):
    """`nnx.scan(nnx.remat(Block))` with nnx.MultiHeadAttention and a causal mask from
    `nnx.make_causal_mask(ones((B, T)))` (batch-sized, built from iotas, broadcast with
    size-1 axes): the float32 backward slices (NNX's remat passes the module's state through
    as outputs independent of the batch), and with ``codec="none"`` the gradients are
    nnx.grad's of the same float32 model (RTOL 1e-5: float32 sums reordered)."""
    nnx = pytest.importorskip("flax.nnx")
    d = 32

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln = nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=d, qkv_features=d,
                                               decode=False, rngs=rngs)
            self.lin = nnx.Linear(d, d, rngs=rngs)

        def __call__(self, x):
            mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + self.attn(self.ln(x), mask=mask)
            return x + jax.nn.gelu(self.lin(x))

    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    model = _nnx_scan_stack(Block, 2)
    x = jax.random.normal(jax.random.key(1), (16, 128, d))
    cc = hg.compress_checkpoints(loss, "none", backward_slices=4)
    assert hg.slice_report(nnx.grad(cc), model, x) == ["sliced: 4 slices of 4 batch rows"]
    graphdef, state = nnx.split(model)

    def on_state(grad):
        return lambda s, x: nnx.state(grad(nnx.merge(graphdef, s), x))

    with highest_precision():
        got = maybe_jit(on_state(hg.flax.grad(cc)))(state, x)
        want = maybe_jit(on_state(nnx.grad(loss)))(state, x)
    _close_to_largest(got, want, rtol=1e-5)


def _close_to_largest(got, want, rtol):
    """`_close` with the tolerance scaled by the largest entry of all of `want`: the key
    bias's gradient is zero up to rounding (softmax ignores a shift per query), its entries
    1e-10 of noise either way."""
    scale = max(float(jnp.abs(g).max()) for g in jax.tree_util.tree_leaves(want))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


def test_fewer_larger_slices_when_a_one_row_slice_is_another_program(maybe_jit):
    """4 sequences of 256 tokens ask for 4 slices of one row, where JAX traces the block as
    another program (it specializes length-1 axes): 2 slices of 2 batch rows are taken instead,
    and the gradients are the unsliced backward's (float32 sums reordered: RTOL)."""
    block = _attn_block(2)
    p = _attn_params(2, 32, jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 256, 32)), jnp.float32)

    def remat(p, x):
        return jnp.mean(jax.lax.scan(jax.checkpoint(block), x, p)[0] ** 2)

    cc = hg.compress_checkpoints(remat, "none", backward_slices=4)
    assert hg.slice_report(jax.grad(cc), p, x) == ["sliced: 2 slices of 2 batch rows"]
    with highest_precision():
        _close(maybe_jit(hg.grad(cc))(p, x), maybe_jit(jax.grad(remat))(p, x), rtol=1e-5)


def test_equinox_scan_of_filter_checkpoint_slices(maybe_jit):
    """Equinox blocks (eqx.nn.LayerNorm, eqx.nn.MultiheadAttention with a causal mask,
    eqx.nn.MLP with its default ReLU, a custom_jvp), stacked with eqx.filter_vmap and run by
    lax.scan over eqx.filter_checkpoint: the float32 backward slices, and with
    ``codec="none"`` the gradients are jax.grad's of the same float32 model (tolerance
    against the largest entry, as for NNX: 1e-5, float32 sums reordered)."""
    eqx = pytest.importorskip("equinox")
    d = 32

    class Block(eqx.Module):
        ln: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.ln = eqx.nn.LayerNorm(d)
            self.attn = eqx.nn.MultiheadAttention(2, d, key=k1)
            self.mlp = eqx.nn.MLP(d, d, 2 * d, 1, key=k2)

        def __call__(self, x):
            h = jax.vmap(self.ln)(x)
            x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((x.shape[0],) * 2, bool)))
            return x + jax.vmap(self.mlp)(x)

    stack = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), 2))
    params, static = eqx.partition(stack, eqx.is_array)

    def loss(params, x):
        @eqx.filter_checkpoint
        def step(h, p):
            return jax.vmap(eqx.combine(p, static))(h), None
        return jnp.mean(jax.lax.scan(step, x, params)[0] ** 2)

    x = jax.random.normal(jax.random.key(1), (16, 64, d))
    cc = hg.compress_checkpoints(loss, "none", backward_slices=4)
    assert hg.slice_report(jax.grad(cc), params, x) == ["sliced: 4 slices of 4 batch rows"]
    with highest_precision():
        got = maybe_jit(hg.grad(cc))(params, x)
        want = maybe_jit(jax.grad(loss))(params, x)
    _close_to_largest(got, want, rtol=1e-5)


def test_maxtext_causes_as_small_programs(maybe_jit):
    """What stopped real MaxText's scanned layers from slicing, as two small programs: a
    uint32 counter scanned per layer (NNX's rng counter, passed through the checkpoint and
    incremented: its cotangent is a float0 literal) and RoPE frequencies gathered from a
    table by per-row positions (deepseek's YaRN RoPE, ``freqs_cis.at[position].get()``).
    Both slice, and with ``codec="none"`` the gradients are `jax.grad`'s (RTOL 1e-5)."""
    n, b, t, d = 2, 16, 128, 32
    p = _attn_params(n, d, jnp.float32)
    counters = jnp.arange(n, dtype=jnp.uint32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(b, t, d)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    table = jnp.outer(jnp.arange(2 * t, dtype=jnp.float32),
                      1.0 / 10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))

    def block(carry, xs):
        h, pos = carry
        w, counter = xs
        ang = table.at[pos].get()  # [b, t, d/2]
        u = h @ w["w1"][:, :d]
        u1, u2 = jnp.split(u, 2, axis=-1)
        u = jnp.concatenate([u1 * jnp.cos(ang) - u2 * jnp.sin(ang),
                             u2 * jnp.cos(ang) + u1 * jnp.sin(ang)], -1)
        return (h + jnp.tanh(u), pos), counter + 1

    def remat(p, x, positions):
        (y, _), new_counters = jax.lax.scan(jax.checkpoint(block), (x, positions),
                                            (p, counters))
        return jnp.mean(y ** 2) + 0 * new_counters.sum().astype(jnp.float32)

    cc = hg.compress_checkpoints(remat, "none", backward_slices=4)
    assert hg.slice_report(jax.grad(cc), p, x, positions) == [
        "sliced: 4 slices of 4 batch rows"]
    with highest_precision():
        _close(maybe_jit(hg.grad(cc))(p, x, positions),
               maybe_jit(jax.grad(remat))(p, x, positions), rtol=1e-5)


def test_the_three_entry_points_share_one_signature_shape():
    """`checkpoint` and `compress_checkpoints` take ``(fun, codec, *, policy, tangent_dtype,
    save, backward_slices)``; `scan` keeps `lax.scan`'s positions and takes the same options
    by keyword, the codec too. `checkpoint` alone adds ``encode_argnums`` (which arguments
    are activations: `scan` encodes its carry, `compress_checkpoints` finds them itself)."""
    import inspect

    options = ["policy", "tangent_dtype", "save", "backward_slices"]
    for fn, own in ((hg.checkpoint, ["encode_argnums"]), (hg.compress_checkpoints, [])):
        params = inspect.signature(fn).parameters
        assert list(params)[:2] == ["fun", "codec"]
        keyword = [p for p in params if params[p].kind is inspect.Parameter.KEYWORD_ONLY]
        assert keyword == options + own
    params = inspect.signature(hg.scan).parameters
    keyword = [p for p in params if params[p].kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword[0] == "codec" and all(o in keyword for o in options)


def test_compress_checkpoints_tangent_dtype_is_policys_shorthand():
    def loss(ws, x):
        return jax.lax.scan(jax.checkpoint(lambda c, w: (jnp.tanh(c @ w), None)), x, ws)[0].sum()

    ws, x = jnp.ones((2, 8, 8), jnp.bfloat16) * 0.1, jnp.ones((4, 8), jnp.bfloat16)
    a = hg.grad(hg.compress_checkpoints(loss, "int8", tangent_dtype=jnp.bfloat16))(ws, x)
    b = hg.grad(hg.compress_checkpoints(
        loss, "int8", policy=hg.Policy(tangent_dtype=jnp.bfloat16)))(ws, x)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="conflicts with policy.tangent_dtype"):
        hg.compress_checkpoints(loss, "int8", tangent_dtype=jnp.float32,
                                policy=hg.Policy(tangent_dtype=jnp.bfloat16))


# ------------------------------------------------------------------ masks passed in, any dtype

def _mask(kind, b, t):
    """Masks as users make them, with their libraries' default dtypes."""
    if kind == "nnx.make_causal_mask":
        from flax import nnx
        return nnx.make_causal_mask(jnp.ones((b, t)))  # float32 [B, 1, T, T]
    if kind == "linen.make_causal_mask":
        import flax.linen as nn
        return nn.make_causal_mask(jnp.ones((b, t)))
    if kind == "linen.make_attention_mask":  # a padding mask: the last 3 tokens of odd rows
        import flax.linen as nn
        valid = (jnp.arange(t)[None, :] < t - 3 * (jnp.arange(b)[:, None] % 2)).astype(
            jnp.float32)
        return nn.make_attention_mask(valid, valid)
    if kind == "additive_b11t":
        return jnp.where(jnp.arange(t)[None, None, None, :] < t - 2, 0.0, -1e9) * jnp.ones(
            (b, 1, 1, t))
    if kind == "bool":
        return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, 1, t, t))
    raise KeyError(kind)


@pytest.mark.parametrize("kind", ["nnx.make_causal_mask", "linen.make_causal_mask",
                                  "linen.make_attention_mask", "additive_b11t", "bool"])
def test_a_mask_passed_in_any_dtype_keeps_the_slicing(kind, monkeypatch):
    """A bf16 block that takes its attention mask as an argument, made as the libraries' docs
    make it (float32 by default): the slice count is the block's own (its bf16 scores and
    hidden), not the mask's dtype, so the float32 backward slices by itself, and equals the
    one at once. It did not: a float32 mask made the widest input float32 (issue 49)."""
    pytest.importorskip("flax")
    from hifigrad._src import checkpoint as ck

    monkeypatch.setattr(ck, "MIN_SLICE_ROWS", 64)
    b, t, d = 8, 32, 32
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(2, d, d)) / np.sqrt(d), jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.bfloat16)
    mask = _mask(kind, b, t)

    def block(c, w, m):
        s = jnp.einsum("btd,bsd->bts", c, c @ w)[:, None].astype(jnp.float32)
        keep = m if m.dtype == jnp.bool_ else m > 0
        s = s + m if kind == "additive_b11t" else jnp.where(keep, s, -1e9)
        p = jax.nn.softmax(s, -1)[:, 0].astype(c.dtype)
        return c + jnp.einsum("bts,bsd->btd", p, jnp.tanh(c @ w)), None

    def loss(w, x, m):  # the mask reaches each remat'd block
        body = jax.checkpoint(lambda c, wi: block(c, wi, m))
        return jnp.mean(jax.lax.scan(body, x, w)[0].astype(jnp.float32) ** 2)

    cc = hg.compress_checkpoints(loss, "int8")
    report = hg.slice_report(hg.grad(cc), w, x, mask)
    assert report and all(r.startswith("sliced") for r in report), report
    # Sliced against at once in float32 matmuls ('exact'): the TPU's default 'fast' rounds each
    # cotangent to bf16, where the slices' reassociated float32 sums can round the other way
    # (seen under HIFIGRAD_PLATFORM=tpu: 77 of 2048 entries a bf16 rounding apart).
    exact = hg.Policy(matmul="exact")
    sliced = hg.compress_checkpoints(loss, "int8", policy=exact)
    whole = hg.compress_checkpoints(loss, "int8", backward_slices=1, policy=exact)
    _close_to_largest(jax.jit(hg.grad(sliced, policy=exact))(w, x, mask),
                      jax.jit(hg.grad(whole, policy=exact))(w, x, mask), rtol=1e-5)


def test_the_first_block_of_an_unrolled_stack_slices(monkeypatch):
    """Unrolled remat'd blocks: the first one's input is the function's own (it stays alive,
    so it is saved as it is, not encoded), and still its float32 backward slices (it ran at
    once: a bf16 NNX decoder's step then took 2x plain jax.grad's memory)."""
    from hifigrad._src import checkpoint as ck

    monkeypatch.setattr(ck, "MIN_SLICE_ROWS", 64)
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.normal(size=(32, 32)) / 6, jnp.bfloat16) for _ in range(3)]
    x = jnp.asarray(rng.normal(size=(8, 64, 32)), jnp.bfloat16)

    def loss(ws, x):
        for w in ws:
            x = jax.checkpoint(lambda c, w: c + jnp.tanh(c @ w))(x, w)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    cc = hg.compress_checkpoints(loss, "int8")
    assert hg.slice_report(hg.grad(cc), ws, x) == ["sliced: 4 slices of 2 batch rows"] * 3
    whole = hg.compress_checkpoints(loss, "int8", backward_slices=1)
    _close_to_largest(jax.jit(hg.grad(cc))(ws, x), jax.jit(hg.grad(whole))(ws, x), rtol=1e-5)


# ------------------------------------------------ a scan over a transposed stack of weights

def _stacked_on_axis_1(n=4, d=32, f=64, seed=0):
    """MLP weights stacked on axis 1, as ``nnx.scan(in_axes=1)`` and MaxText's
    ``param_scan_axis=1`` keep them: ``wi`` [d, n, f], ``wo`` [f, n, d], ``scale`` [d, n]."""
    k = jax.random.split(jax.random.key(seed), 3)
    return dict(wi=jax.random.normal(k[0], (d, n, f)) * 0.2,
                wo=jax.random.normal(k[1], (f, n, d)) * 0.2,
                scale=1.0 + 0.1 * jax.random.normal(k[2], (d, n)))


def _mlp_layer(h, w):
    h32 = h.astype(jnp.float32)
    n = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + 1e-6) * w["scale"][None]
    a = n.astype(h.dtype) @ w["wi"].astype(h.dtype)
    return h + jax.nn.gelu(a) @ w["wo"].astype(h.dtype), None


def _on_axis(axis, reverse=False, used_outside=False, inner=False):
    """The loss of a remat scan over the stack, its layers on ``axis`` (moved to the front
    before the scan, as the frameworks do, when it is 1); ``inner``: each step runs a
    checkpointed scan of its own before the layer's checkpoint."""
    def loss(p, x):
        xs = p if axis == 0 else jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, 1, 0), p)

        def step(h, w):
            if inner:
                h = jax.lax.scan(jax.checkpoint(lambda c, _: (jnp.tanh(c), None)), h, None,
                                 length=2)[0]
            h, _ = jax.checkpoint(_mlp_layer)(h, w)
            if used_outside:  # the slice is used outside the checkpoint too
                h = h * (1 + jnp.mean(w["scale"])).astype(h.dtype)
            return h, None

        h = jax.lax.scan(step, x, xs, reverse=reverse)[0]
        return jnp.mean(h.astype(jnp.float32) ** 2)
    return loss


def _to_axis_0(p):
    return jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, 1, 0), p)


@pytest.fixture(params=["cpu", pytest.param("tpu", marks=pytest.mark.slow)])
def stacks_platform(request, monkeypatch):
    """Both ways a platform's choice runs a scan over a transposed stack (`auto_choices`'
    'stacks'): 'slices' (CPU, GPU) and 'as written' (TPU: the scan as before; the slow tier,
    which CI runs in full on one lane)."""
    monkeypatch.setenv("HIFIGRAD_PLATFORM", request.param)
    return request.param


@pytest.mark.parametrize("reverse, stacks_platform", [
    (False, "cpu"), (True, "cpu"), pytest.param(False, "tpu", marks=pytest.mark.slow)],
    indirect=["stacks_platform"])
def test_a_scan_over_a_transposed_stack_equals_the_untransposed_one(maybe_jit, reverse,
                                                                    stacks_platform):
    """Each step's weights are read from the untransposed stack (`checkpoint.Derived`): the
    gradients are those of the same model with its stack on axis 0 (the same float32
    arithmetic; XLA may fuse the strided slice into a matmul and sum its products in another
    order: a few float32 ulps, RTOL), and the forward is the function's own, bit for bit."""
    p = _stacked_on_axis_1()
    x = jax.random.normal(jax.random.key(1), (16, 32)).astype(jnp.bfloat16)
    got = maybe_jit(hg.grad(hg.compress_checkpoints(_on_axis(1, reverse), "int8")))(p, x)
    want = maybe_jit(hg.grad(hg.compress_checkpoints(_on_axis(0, reverse), "int8")))(
        _to_axis_0(p), x)
    _close(_to_axis_0(got), want)
    assert maybe_jit(hg.compress_checkpoints(_on_axis(1, reverse), "int8"))(p, x) == \
        maybe_jit(_on_axis(1, reverse))(p, x)


@pytest.mark.parametrize("used_outside", [False, True])
def test_a_scan_over_a_transposed_stack_against_jax_grad(maybe_jit, used_outside, monkeypatch):
    """float32 and codec 'none', the CPU's choice: hg.grad equals jax.grad of the function as
    written (a slice used outside the checkpoint too is left to the scan, as before)."""
    monkeypatch.setenv("HIFIGRAD_PLATFORM", "cpu")
    p = _stacked_on_axis_1()
    x = jax.random.normal(jax.random.key(1), (16, 32))
    loss = _on_axis(1, used_outside=used_outside)
    with highest_precision():
        got = maybe_jit(hg.grad(hg.compress_checkpoints(loss, "none")))(p, x)
        want = maybe_jit(jax.grad(loss))(p, x)
    _close(got, want, rtol=1e-5)


@cpu_only(reason="XLA:CPU's buffer sizes (a TPU reports temp as 0)")
@pytest.mark.parametrize("inner", [False, True])
def test_a_scan_over_a_transposed_stack_holds_no_transposed_copy(stacks_platform, inner):
    """With the CPU's choice, the compiled step over the stack on axis 1 needs the temp of the
    step over the stack on axis 0: no transposed copy of the weights, and their gradients go
    to one buffer of the parameters' shape. With the TPU's (whose compiler makes no copy), the
    scan runs as written: on XLA:CPU, with the copy. ``inner``: a checkpointed scan inside
    each step, rewritten before the layer's checkpoint, keeps the step's slices known."""
    p = _stacked_on_axis_1(n=4, d=64, f=256)
    x = jax.random.normal(jax.random.key(1), (64, 64)).astype(jnp.bfloat16)

    def temp(axis, outer=hg.grad):
        step = outer(hg.compress_checkpoints(_on_axis(axis, inner=inner), "int8"))
        args = (p if axis == 1 else _to_axis_0(p), x)
        return jax.jit(step).lower(*args).compile().memory_analysis().temp_size_in_bytes

    # A transposed copy adds the weights' bytes (513 KiB), under either outer transform; with
    # the slices read, the loop's step index and a few scalars are all that may differ.
    weights = sum(a.nbytes for a in jax.tree_util.tree_leaves(p))
    for outer in (hg.grad, jax.grad) if not inner else (hg.grad,):
        t1, t0 = temp(1, outer), temp(0, outer)
        if stacks_platform == "tpu":
            assert t1 >= t0 + weights, (t1, t0)
        else:
            assert t1 <= t0 + 4096, (t1, t0)


def _linen_on_axis_1():
    """Flax's own scan over layers stacked on axis 1 (``nn.scan(variable_axes={"params":
    1})``, as MaxText's ``param_scan_axis=1``) and the same weights on axis 0: the jitted
    steps {axis: step} and their arguments."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.Dense(64, dtype=jnp.bfloat16, name="up")(x)
            return x + nn.Dense(32, dtype=jnp.bfloat16, name="down")(jax.nn.gelu(h)), None

    def stack(axis):
        return nn.scan(nn.remat(Block), variable_axes={"params": axis},
                       split_rngs={"params": True}, length=4)

    x = jax.random.normal(jax.random.key(1), (16, 32)).astype(jnp.bfloat16)
    p1 = stack(1)().init(jax.random.key(0), x, None)
    p0 = jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, 1, 0), p1)

    def loss(axis):
        return lambda p, x: jnp.mean(stack(axis)().apply(p, x, None)[0].astype(jnp.float32)
                                     ** 2)

    steps = {a: jax.jit(hg.grad(hg.compress_checkpoints(loss(a), "int8"))) for a in (0, 1)}
    return steps, {0: (p0, x), 1: (p1, x)}


def test_flax_linen_scan_with_params_on_axis_1(monkeypatch):
    """The same gradients as the stack on axis 0 (the CPU's choice: the slices read)."""
    monkeypatch.setenv("HIFIGRAD_PLATFORM", "cpu")
    steps, args = _linen_on_axis_1()
    got, want = steps[1](*args[1]), steps[0](*args[0])
    _close(jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, 1, 0), got), want)


@cpu_only(reason="XLA:CPU's buffer sizes (a TPU reports temp as 0)")
def test_flax_linen_scan_with_params_on_axis_1_holds_no_copy(stacks_platform):
    """With the CPU's choice, the temp of the stack on axis 0: no transposed copy."""
    steps, args = _linen_on_axis_1()
    temp = {a: steps[a].lower(*args[a]).compile().memory_analysis().temp_size_in_bytes
            for a in (0, 1)}
    weights = sum(a.nbytes for a in jax.tree_util.tree_leaves(args[1][0]))
    if stacks_platform == "tpu":  # scanned as written: XLA:CPU copies the stack
        assert temp[1] >= temp[0] + weights, (temp, weights)
    else:  # a copy adds the weights' 66 KiB; XLA packs these small steps a few KiB apart
        assert temp[1] <= temp[0] + weights // 4, (temp, weights)


@cpu_only(reason="XLA:CPU's buffer sizes (a TPU reports temp as 0)")
def test_flax_nnx_scan_with_in_axes_1(monkeypatch):
    """``nnx.scan(in_axes=1)`` over blocks made by ``nnx.vmap(out_axes=1)``, the CPU's choice:
    the gradients of the same blocks stacked on axis 0, and the temp of that model."""
    from flax import nnx

    monkeypatch.setenv("HIFIGRAD_PLATFORM", "cpu")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(32, 64, dtype=jnp.bfloat16, rngs=rngs)
            self.down = nnx.Linear(64, 32, dtype=jnp.bfloat16, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jax.nn.gelu(self.up(x)))

    def model(axis):
        @nnx.vmap(in_axes=0, out_axes=axis)
        def make(key):
            return Block(nnx.Rngs(key))

        class Model(nnx.Module):
            def __init__(self):
                self.blocks = make(jax.random.split(jax.random.key(0), 4))

            def __call__(self, x):
                @nnx.scan(in_axes=(axis, nnx.Carry), out_axes=nnx.Carry)
                @nnx.remat
                def step(block, x):
                    return block(x)

                return step(self.blocks, x)

        graph, state = nnx.split(Model())
        return (lambda s, x: jnp.mean(nnx.merge(graph, s)(x).astype(jnp.float32) ** 2)), state

    x = jax.random.normal(jax.random.key(1), (16, 32)).astype(jnp.bfloat16)
    (loss0, s0), (loss1, s1) = model(0), model(1)
    steps = {a: jax.jit(hg.grad(hg.compress_checkpoints(f, "int8")))
             for a, f in ((0, loss0), (1, loss1))}
    got, want = steps[1](s1, x), steps[0](s0, x)
    _close(jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, 1, 0) if a.ndim > 1 else a, got),
           want)
    temp = {a: steps[a].lower(s, x).compile().memory_analysis().temp_size_in_bytes
            for a, s in ((0, s0), (1, s1))}
    weights = sum(a.nbytes for a in jax.tree_util.tree_leaves(s1))
    assert temp[1] <= temp[0] + weights // 4, (temp, weights)  # a copy adds `weights`
