"""bf16 transformer stacks written the way four code bases write them, for the drop-in memory
benchmark (`transformer_memory_bench.py --models`).

Each builder returns ``(loss, args)``: ``loss(*args)`` is the model's own training loss over
its own bf16 remat scan (the program its users differentiate with ``jax.grad``), ``args``
abstract (`jax.ShapeDtypeStruct`) or concrete. Its first argument holds the parameters.

* ``maxtext``: a llama2 decoder layer as MaxText writes it (``layers.py``/``llama2.py``):
  RMSNorm with a scale, RoPE from integer ``positions`` [B, T], a causal mask combined with
  integer ``segment_ids`` [B, T], ``checkpoint_name`` on the query, key, value, attention
  output and MLP activations, ``with_sharding_constraint`` on the activations (a one-device
  ``('data', 'model')`` mesh), a SwiGLU MLP (hidden 8/3 d), scanned with
  ``jax.checkpoint(policy=nothing_saveable)`` (MaxText's ``remat_policy='full'``).
* ``nnx``: Flax NNX blocks (``nnx.LayerNorm``, ``nnx.MultiHeadAttention`` with
  ``nnx.make_causal_mask``, an ``nnx.Linear`` GELU MLP) made with ``nnx.vmap`` and run with
  ``nnx.scan(nnx.remat(...))``, as the Flax NNX guide on scan-over-layers does; the loss takes
  the model's state (what ``nnx.jit`` traces).
* ``equinox``: an ``eqx.Module`` block (``eqx.nn.LayerNorm`` and ``eqx.nn.MLP``, ReLU by
  default, vmapped over tokens; ``eqx.nn.MultiheadAttention`` with a causal mask), stacked
  with ``eqx.filter_vmap`` and run with ``lax.scan`` over ``eqx.filter_checkpoint``, as
  Equinox's docs recommend for deep stacks.
* ``tril``: a plain JAX pre-LN block whose causal mask is a float ``jnp.tril(jnp.ones((T,
  T)))`` used with ``jnp.where(mask == 0, -big, scores)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BF16 = jnp.bfloat16


def _loss(y):
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def _normal(key, shape, fan_in, dtype=BF16):
    return (jax.random.normal(key, shape) * fan_in ** -0.5).astype(dtype)


# ---------------------------------------------------------------------------------- MaxText

def maxtext(batch, seq, d, blocks, heads=4):
    from jax.ad_checkpoint import checkpoint_name
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    dh, mlp = d // heads, 64 * round(8 * d / 3 / 64)

    def constrain(v, *spec):
        return lax.with_sharding_constraint(v, NamedSharding(mesh, P(*spec)))

    def rms_norm(v, scale):
        v32 = v.astype(jnp.float32)
        v32 = v32 * lax.rsqrt(jnp.mean(v32 * v32, -1, keepdims=True) + 1e-6)
        return v32.astype(v.dtype) * scale

    def rope(v, positions):  # [b, t, heads, dh]
        freq = 1.0 / (10000.0 ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
        ang = positions.astype(jnp.float32)[:, :, None, None] * freq[None, None, None]
        v1, v2 = jnp.split(v.astype(jnp.float32), 2, axis=-1)
        c, s = jnp.cos(ang), jnp.sin(ang)
        return jnp.concatenate([v1 * c - v2 * s, v2 * c + v1 * s], -1).astype(v.dtype)

    def layer(carry, p):
        x, positions, segment_ids = carry
        b, t, _ = x.shape
        h = constrain(rms_norm(x, p["pre_norm"]), "data", None, "model")
        q = checkpoint_name(rope(jnp.einsum("btd,dhk->bthk", h, p["wq"]), positions), "query")
        k = checkpoint_name(rope(jnp.einsum("btd,dhk->bthk", h, p["wk"]), positions), "key")
        v = checkpoint_name(jnp.einsum("btd,dhk->bthk", h, p["wv"]), "value")
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(dh ** -0.5, x.dtype)
        causal = lax.broadcasted_iota(jnp.int32, (t, t), 0) >= lax.broadcasted_iota(
            jnp.int32, (t, t), 1)
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = jnp.logical_and(causal[None], same)[:, None]
        s = jnp.where(mask, s, jnp.asarray(-0.7 * float(jnp.finfo(BF16).max), s.dtype))
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s.astype(jnp.float32), -1)
                       .astype(x.dtype), v)
        o = checkpoint_name(jnp.einsum("bthk,hkd->btd", o, p["wo"]), "out_proj")
        x = constrain(x + o, "data", None, "model")
        h = rms_norm(x, p["post_norm"])
        gate = checkpoint_name(h @ p["wi_0"], "mlpwi_0")
        up = checkpoint_name(h @ p["wi_1"], "mlpwi_1")
        m = checkpoint_name((jax.nn.silu(gate) * up) @ p["wo_mlp"], "mlpwo")
        x = constrain(x + m, "data", None, "model")
        return (x, positions, segment_ids), None

    def loss(params, x, positions, segment_ids):
        step = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable,
                              prevent_cse=False)
        y = lax.scan(step, (x, positions, segment_ids), params)[0][0]
        return _loss(y)

    def init():
        ks = jax.random.split(jax.random.PRNGKey(0), 7)
        L = blocks
        return {"pre_norm": jnp.ones((L, d), BF16), "post_norm": jnp.ones((L, d), BF16),
                "wq": _normal(ks[0], (L, d, heads, dh), d),
                "wk": _normal(ks[1], (L, d, heads, dh), d),
                "wv": _normal(ks[2], (L, d, heads, dh), d),
                "wo": _normal(ks[3], (L, heads, dh, d), d * L),
                "wi_0": _normal(ks[4], (L, d, mlp), d), "wi_1": _normal(ks[5], (L, d, mlp), d),
                "wo_mlp": _normal(ks[6], (L, mlp, d), mlp * L)}

    def args():
        params = init()
        x = _normal(jax.random.PRNGKey(1), (batch, seq, d), 1)
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        segment_ids = jnp.asarray(np.repeat(np.arange(2 * batch) % 3 + 1, seq // 2)
                                  .reshape(batch, seq), jnp.int32)
        return params, x, positions, segment_ids

    return loss, args


# ---------------------------------------------------------------------------------- Flax NNX

def nnx(batch, seq, d, blocks, heads=4):
    from flax import nnx as fnnx

    class Block(fnnx.Module):
        def __init__(self, rngs):
            kw = dict(dtype=BF16, param_dtype=BF16, rngs=rngs)
            self.ln1 = fnnx.LayerNorm(d, **kw)
            self.attn = fnnx.MultiHeadAttention(num_heads=heads, in_features=d,
                                                qkv_features=d, decode=False, **kw)
            self.ln2 = fnnx.LayerNorm(d, **kw)
            self.up = fnnx.Linear(d, 4 * d, **kw)
            self.down = fnnx.Linear(4 * d, d, **kw)

        def __call__(self, x):
            mask = fnnx.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + self.attn(self.ln1(x), mask=mask)
            return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

    @fnnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return Block(fnnx.Rngs(key))

    class Model(fnnx.Module):
        def __init__(self):
            self.blocks = make(jax.random.split(jax.random.PRNGKey(0), blocks))

        def __call__(self, x):
            @fnnx.scan(in_axes=(0, fnnx.Carry), out_axes=fnnx.Carry)
            @fnnx.remat
            def step(block, x):
                return block(x)
            return step(self.blocks, x)

    graphdef, state = fnnx.split(Model())

    def loss(state, x):
        return _loss(fnnx.merge(graphdef, state)(x))

    def args():
        return state, _normal(jax.random.PRNGKey(1), (batch, seq, d), 1)

    return loss, args


# ---------------------------------------------------------------------------------- Equinox

def equinox(batch, seq, d, blocks, heads=4):
    import equinox as eqx

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
            self.attn = eqx.nn.MultiheadAttention(heads, d, key=k1)
            self.mlp = eqx.nn.MLP(d, d, 4 * d, 1, key=k2)

        def __call__(self, x):  # one sequence: [T, D]
            h = jax.vmap(self.ln1)(x)
            mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
            x = x + self.attn(h, h, h, mask=mask)
            return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))

    stack = eqx.filter_vmap(Block)(jax.random.split(jax.random.PRNGKey(0), blocks))
    stack = jax.tree_util.tree_map(
        lambda a: a.astype(BF16) if eqx.is_inexact_array(a) else a, stack)
    params, static = eqx.partition(stack, eqx.is_array)

    def loss(params, x):
        @eqx.filter_checkpoint
        def step(x, p):
            return jax.vmap(eqx.combine(p, static))(x), None
        return _loss(lax.scan(step, x, params)[0])

    def args():
        return params, _normal(jax.random.PRNGKey(1), (batch, seq, d), 1)

    return loss, args


# ---------------------------------------------------------------------------------- tril mask

def tril(batch, seq, d, blocks, heads=4):
    dh = d // heads

    def layer_norm(x):
        mu = jnp.mean(x, -1, keepdims=True)
        return (x - mu) * lax.rsqrt(jnp.mean(jnp.square(x - mu), -1, keepdims=True) + 1e-5)

    def block(x, p):
        b, t, _ = x.shape
        q, k, v = jnp.split((layer_norm(x) @ p["wqkv"]).reshape(b, t, 3, heads, dh), 3, 2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q[:, :, 0], k[:, :, 0]) * jnp.asarray(dh ** -0.5,
                                                                                x.dtype)
        mask = jnp.tril(jnp.ones((t, t)))
        s = jnp.where(mask == 0, jnp.asarray(-3e38, s.dtype), s)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v[:, :, 0]).reshape(b, t, d)
        x = x + o @ p["wo"]
        return x + jax.nn.gelu(layer_norm(x) @ p["w1"]) @ p["w2"], None

    def loss(params, x):
        return _loss(lax.scan(jax.checkpoint(block), x, params)[0])

    def args():
        ks = jax.random.split(jax.random.PRNGKey(0), 4)
        L = blocks
        params = {"wqkv": _normal(ks[0], (L, d, 3 * d), d), "wo": _normal(ks[1], (L, d, d), d * L),
                  "w1": _normal(ks[2], (L, d, 4 * d), d),
                  "w2": _normal(ks[3], (L, 4 * d, d), 4 * d * L)}
        return params, _normal(jax.random.PRNGKey(1), (batch, seq, d), 1)

    return loss, args


MODELS = {"maxtext": maxtext, "nnx": nnx, "equinox": equinox, "tril": tril}
