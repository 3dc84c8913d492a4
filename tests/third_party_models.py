"""Small models written the way each library's own docs write them, for tests/test_third_party.py.

Each builder takes the compute dtype and returns a `Case`: ``loss(params, *args)`` and the
arguments, with the parameters and inputs of a float32 build cast to that dtype (so the bf16 and
the f32 runs start from the same values). Libraries whose docs keep float32 master parameters
and cast inside (jmp, keras dtype policies) keep f32 parameters and compute in ``dtype``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax import lax

# keras picks its backend when first imported; this module only ever uses the JAX one.
os.environ.setdefault("KERAS_BACKEND", "jax")

F32 = jnp.float32


@dataclasses.dataclass
class Case:
    loss: Callable[..., Any]
    params: Any
    args: tuple
    has_aux: bool = False


def cast_floats(tree, dtype):
    """Every floating leaf of `tree` cast to `dtype` (ints, bools and keys untouched)."""
    def cast(x):
        if isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(x).astype(dtype)
        return x
    return jax.tree_util.tree_map(cast, tree)


def _mse(y):
    return jnp.mean(jnp.square(y.astype(F32)))


# ---------------------------------------------------------------------------------- equinox

def eqx_mlp(dtype) -> Case:
    import equinox as eqx

    model = eqx.nn.MLP(8, 4, 16, 2, activation=jax.nn.gelu, key=jr.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x = jr.normal(jr.PRNGKey(1), (4, 8))

    def loss(params, x):
        model = eqx.combine(params, static)
        return _mse(jax.vmap(model)(x))

    return Case(loss, cast_floats(params, dtype), (cast_floats(x, dtype),))


def eqx_transformer(dtype) -> Case:
    import equinox as eqx

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, d, heads, key):
            k1, k2 = jr.split(key)
            self.ln1 = eqx.nn.LayerNorm(d)
            self.attn = eqx.nn.MultiheadAttention(heads, d, key=k1)
            self.ln2 = eqx.nn.LayerNorm(d)
            self.mlp = eqx.nn.MLP(d, d, 2 * d, 1, activation=jax.nn.gelu, key=k2)

        def __call__(self, x):
            mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
            h = jax.vmap(self.ln1)(x)
            x = x + self.attn(h, h, h, mask=mask)
            return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))

    model = Block(16, 2, jr.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x = jr.normal(jr.PRNGKey(1), (2, 6, 16))

    def loss(params, x):
        model = eqx.combine(params, static)
        return _mse(jax.vmap(model)(x))

    return Case(loss, cast_floats(params, dtype), (cast_floats(x, dtype),))


def eqx_gru_scan(dtype) -> Case:
    import equinox as eqx

    cell = eqx.nn.GRUCell(4, 8, key=jr.PRNGKey(0))
    params, static = eqx.partition(cell, eqx.is_inexact_array)
    xs = jr.normal(jr.PRNGKey(1), (6, 4))

    def loss(params, xs):
        cell = eqx.combine(params, static)

        def step(h, x):
            h = cell(x, h)
            return h, h

        _, hs = lax.scan(step, jnp.zeros(8, xs.dtype), xs)
        return _mse(hs)

    return Case(loss, cast_floats(params, dtype), (cast_floats(xs, dtype),))


def eqx_filter_custom_vjp(dtype) -> Case:
    """`eqx.filter_custom_vjp` as its docs write it: the bwd reads the `perturbed` flags."""
    import equinox as eqx

    @eqx.filter_custom_vjp
    def layer(vjp_arg, x):
        w, b = vjp_arg
        return jnp.tanh(x @ w + b)

    def layer_fwd(perturbed, vjp_arg, x):
        w, b = vjp_arg
        y = jnp.tanh(x @ w + b)
        return y, y

    def layer_bwd(y, grad_obj, perturbed, vjp_arg, x):
        w, _ = vjp_arg
        pw, pb = perturbed
        dz = grad_obj * (1 - y * y)
        gw = x.T @ dz if pw else None
        gb = dz.sum(0) if pb else None
        return gw, gb

    layer.def_fwd(layer_fwd)
    layer.def_bwd(layer_bwd)
    params = (jr.normal(jr.PRNGKey(0), (8, 8)) / 3, jr.normal(jr.PRNGKey(1), (8,)) / 3)
    x = jr.normal(jr.PRNGKey(2), (4, 8))

    def loss(params, x):
        return _mse(layer(params, x))

    return Case(loss, cast_floats(params, dtype), (cast_floats(x, dtype),))


def eqx_checkpointed_while(dtype) -> Case:
    """`eqx.internal.while_loop(kind="checkpointed")`, as diffrax's default adjoint uses it."""
    import equinox as eqx

    params = {"w": jr.normal(jr.PRNGKey(0), (8, 8)) / 3, "b": jr.normal(jr.PRNGKey(1), (8,)) / 3}
    x = jr.normal(jr.PRNGKey(2), (4, 8))

    def loss(params, x):
        def body(carry):
            i, y = carry
            return i + 1, jnp.tanh(y @ params["w"] + params["b"])

        _, y = eqx.internal.while_loop(lambda c: c[0] < 6, body, (0, x), max_steps=6,
                                       kind="checkpointed", checkpoints=2)
        return _mse(y)

    return Case(loss, cast_floats(params, dtype), (cast_floats(x, dtype),))


# ---------------------------------------------------------------------------------- haiku + jmp

def _jmp_policy(dtype):
    import jmp

    name = jnp.dtype(dtype).name
    return jmp.get_policy(f"params=float32,compute={name},output={name}")


def haiku_resnet(dtype) -> Case:
    """A small ResNet with BatchNorm state (`hk.transform_with_state`), jmp mixed precision as
    haiku's docs set it up: f32 parameters, compute in `dtype`, BatchNorm kept in f32."""
    import haiku as hk
    import jmp

    class Block(hk.Module):
        def __call__(self, x, is_training):
            h = hk.Conv2D(8, 3, with_bias=False)(x)
            h = jax.nn.relu(hk.BatchNorm(True, True, 0.9)(h, is_training))
            h = hk.Conv2D(8, 3, with_bias=False)(h)
            h = hk.BatchNorm(True, True, 0.9)(h, is_training)
            return jax.nn.relu(x + h)

    class Net(hk.Module):
        def __call__(self, x, is_training):
            x = hk.Conv2D(8, 3)(x)
            x = Block()(x, is_training)
            return hk.Linear(3)(jnp.mean(x, axis=(1, 2)))

    policy = _jmp_policy(dtype)
    bn_policy = jmp.get_policy(f"params=float32,compute=float32,output={jnp.dtype(dtype).name}")

    def forward(x, is_training):
        with hk.mixed_precision.push_policy(Net, policy), \
                hk.mixed_precision.push_policy(hk.BatchNorm, bn_policy):
            return Net()(x, is_training)

    net = hk.transform_with_state(forward)
    x = jr.normal(jr.PRNGKey(1), (2, 6, 6, 3))
    labels = jnp.array([0, 2])
    params, state = net.init(jr.PRNGKey(0), x, True)

    def loss(params, state, x, labels):
        logits, state = net.apply(params, state, None, x, True)
        logp = jax.nn.log_softmax(logits.astype(F32))
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1)), state

    return Case(loss, params, (state, x, labels), has_aux=True)


def haiku_lstm(dtype) -> Case:
    """`hk.LSTM` unrolled with `hk.dynamic_unroll`, computed in `dtype` by a jmp policy."""
    import haiku as hk

    policy = _jmp_policy(dtype)
    T, B, F, H = 5, 2, 3, 8

    def forward(xs):
        with hk.mixed_precision.push_policy(hk.LSTM, policy), \
                hk.mixed_precision.push_policy(hk.Linear, policy):
            core = hk.LSTM(H)
            state = policy.cast_to_compute(core.initial_state(B))
            out, _ = hk.dynamic_unroll(core, xs, state)
            return hk.Linear(1)(out)

    net = hk.without_apply_rng(hk.transform(forward))
    xs = jr.normal(jr.PRNGKey(1), (T, B, F))
    params = net.init(jr.PRNGKey(0), xs)

    def loss(params, xs):
        return _mse(net.apply(params, xs) - 0.5)

    return Case(loss, params, (xs,))


# ---------------------------------------------------------------------------------- keras 3

def keras_mlp(dtype) -> Case:
    """A keras 3 (JAX backend) model trained through `stateless_call`, as keras's "writing a
    training loop from scratch in JAX" guide does; compute in `dtype` by a keras dtype policy,
    with the f32 model's weights."""
    import keras

    def build(policy):
        init = keras.initializers.GlorotUniform(seed=0)
        return keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="gelu", kernel_initializer=init, dtype=policy),
            keras.layers.LayerNormalization(dtype=policy),
            keras.layers.Dense(4, kernel_initializer=init, dtype=policy),
        ])

    ref = build("float32")
    name = jnp.dtype(dtype).name
    model = ref if name == "float32" else build(f"mixed_{name}")
    trainable = [jnp.asarray(v.value) for v in ref.trainable_variables]
    non_trainable = [jnp.asarray(v.value) for v in ref.non_trainable_variables]
    x = jr.normal(jr.PRNGKey(1), (4, 8))
    y = jr.normal(jr.PRNGKey(2), (4, 4))

    def loss(trainable, non_trainable, x, y):
        pred, _ = model.stateless_call(trainable, non_trainable, x, training=True)
        return jnp.mean(jnp.square(pred.astype(F32) - y))

    return Case(loss, trainable, (non_trainable, x, y))


# ---------------------------------------------------------------------------------- diffrax

def diffrax_node(dtype, adjoint: str) -> Case:
    """The neural ODE of diffrax's docs (an MLP vector field, `Tsit5`), vmapped over initial
    conditions, with fixed steps (tiny and deterministic)."""
    import diffrax
    import equinox as eqx

    class Func(eqx.Module):
        mlp: eqx.nn.MLP

        def __call__(self, t, y, args):
            return self.mlp(y)

    func = Func(eqx.nn.MLP(2, 2, 8, 1, activation=jnp.tanh, key=jr.PRNGKey(0)))
    params, static = eqx.partition(func, eqx.is_inexact_array)
    y0 = jr.normal(jr.PRNGKey(1), (3, 2))
    adj = {"recursive_checkpoint": diffrax.RecursiveCheckpointAdjoint,
           "direct": diffrax.DirectAdjoint, "backsolve": diffrax.BacksolveAdjoint}[adjoint]()

    def solve(params, y0):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(eqx.combine(params, static)), diffrax.Tsit5(), t0=0.0, t1=1.0,
            dt0=0.25, y0=y0, saveat=diffrax.SaveAt(ts=jnp.array([0.5, 1.0])), adjoint=adj,
            max_steps=8)
        return sol.ys

    def loss(params, y0):
        return _mse(jax.vmap(solve, in_axes=(None, 0))(params, y0))

    return Case(loss, cast_floats(params, dtype), (cast_floats(y0, dtype),))


# ---------------------------------------------------------------------------------- flax

def linen_batchnorm_axis(dtype) -> Case:
    """Linen BatchNorm with `axis_name`, its statistics averaged over a named `jax.vmap` axis
    (the Flax imagenet example does the same over `pmap`)."""
    import flax.linen as nn

    class Net(nn.Module):
        dtype: Any

        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Dense(16, dtype=self.dtype)(x)
            x = nn.BatchNorm(use_running_average=not train, axis_name="batch", momentum=0.9,
                             dtype=self.dtype)(x)
            return nn.Dense(4, dtype=self.dtype)(nn.relu(x))

    x = jr.normal(jr.PRNGKey(1), (4, 8))
    variables = jax.vmap(lambda x: Net(F32).init(jr.PRNGKey(0), x, False),
                         axis_name="batch", axis_size=4)(x)
    variables = jax.tree_util.tree_map(lambda v: v[0], variables)
    model = Net(dtype)

    def loss(params, batch_stats, x):
        def per_example(x):
            y, updates = model.apply({"params": params, "batch_stats": batch_stats}, x,
                                     train=True, mutable=["batch_stats"])
            return y, updates["batch_stats"]

        y, new_stats = jax.vmap(per_example, axis_name="batch")(x)
        return _mse(y), new_stats

    return Case(loss, cast_floats(variables["params"], dtype),
                (variables["batch_stats"], cast_floats(x, dtype)), has_aux=True)


def nnx_gemma_attention(dtype) -> Case:
    """A Gemma-style NNX attention block: RMSNorm, `q_einsum`, a stacked `kv_einsum` unpacked
    as ``k, v = ...`` (as gemma writes it), f32 softmax, `attn_vec_einsum`, residual."""
    from flax import nnx

    N, D, Hd = 2, 16, 8

    class Attention(nnx.Module):
        def __init__(self, *, rngs):
            self.norm = nnx.RMSNorm(D, rngs=rngs)
            self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (N, D, Hd), rngs=rngs)
            self.kv_einsum = nnx.Einsum("BSD,CKDH->CBSKH", (2, N, D, Hd), rngs=rngs)
            self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (N, Hd, D), rngs=rngs)

        def __call__(self, x):
            h = self.norm(x)
            q = self.q_einsum(h) * Hd ** -0.5
            k, v = self.kv_einsum(h)
            logits = jnp.einsum("BTNH,BSNH->BTNS", q, k)
            T = x.shape[1]
            logits = jnp.where(jnp.tril(jnp.ones((T, T), bool))[:, None, :], logits, -1e4)
            probs = jax.nn.softmax(logits.astype(F32), axis=-1).astype(x.dtype)
            enc = jnp.einsum("BTNS,BSNH->BTNH", probs, v)
            return x + self.attn_vec_einsum(enc)

    graphdef, state = nnx.split(Attention(rngs=nnx.Rngs(0)))
    x = jr.normal(jr.PRNGKey(1), (2, 5, D))

    def loss(state, x):
        return _mse(nnx.merge(graphdef, state)(x))

    return Case(loss, cast_floats(state, dtype), (cast_floats(x, dtype),))


def qwix_dense(dtype) -> Case:
    """A linen MLP quantized for training by qwix (int8 weights and activations, QtProvider)."""
    import flax.linen as nn
    import qwix

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.gelu(nn.Dense(16)(x))
            return nn.Dense(4)(x)

    rules = [qwix.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8")]
    model = qwix.quantize_model(Mlp(), qwix.QtProvider(rules))
    x = jr.normal(jr.PRNGKey(1), (4, 8))
    params = model.init(jr.PRNGKey(0), x)["params"]

    def loss(params, x):
        return _mse(model.apply({"params": params}, x))

    return Case(loss, cast_floats(params, dtype), (cast_floats(x, dtype),))
