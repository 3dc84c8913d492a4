"""A small GPT-style byte-level language model in plain JAX.

Parameters are a dict pytree of float32 *master* weights. The forward casts them to the compute
dtype (bf16, fp16 or f32) where they are used, so every gradient a mode produces is a float32
array of the same structure, whatever the compute dtype.

The ``N`` pre-LayerNorm decoder blocks (causal self-attention, then a GELU MLP) have their
parameters stacked along a leading axis and are applied by a *block runner*, a function
``run_blocks(block_fn, x, stacked_params) -> x``: `lax_scan_blocks` (a plain `jax.lax.scan`) by
default; the demo's modes substitute `hifigrad.scan` with an activation codec, or the seed
issue's fp8 quantize/dequantize scan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["ModelConfig", "block", "forward", "init_params", "lax_scan_blocks", "loss_fn",
           "n_params"]

Params = dict[str, Any]
BlockFn = Callable[[jax.Array, Params], jax.Array]
RunBlocks = Callable[[BlockFn, jax.Array, Params], jax.Array]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of the model."""

    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    seq_len: int = 128
    vocab: int = 256
    mlp_ratio: int = 4

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def init_params(seed: int, cfg: ModelConfig) -> Params:
    """Float32 master parameters; the blocks' parameters are stacked along axis 0.

    Drawn with NumPy's generator (no compilation, same values on every backend).
    """
    if cfg.d_model % cfg.n_heads:
        raise ValueError(f"d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}")
    L, D, H = cfg.n_layers, cfg.d_model, cfg.d_model * cfg.mlp_ratio
    rng = np.random.default_rng(seed)
    std = 0.02
    out_std = std / math.sqrt(2 * L)  # GPT-2's scaled init of the residual projections

    def normal(shape, s):
        return jnp.asarray((s * rng.standard_normal(shape)).astype(np.float32))

    def const(shape, v):
        return jnp.asarray(np.full(shape, v, np.float32))

    return {
        "tok_emb": normal((cfg.vocab, D), std),
        "pos_emb": normal((cfg.seq_len, D), std / 2),
        "blocks": {
            "ln1_scale": const((L, D), 1.0),
            "ln1_bias": const((L, D), 0.0),
            "qkv": normal((L, D, 3 * D), std),
            "proj": normal((L, D, D), out_std),
            "ln2_scale": const((L, D), 1.0),
            "ln2_bias": const((L, D), 0.0),
            "fc1": normal((L, D, H), std),
            "fc1_bias": const((L, H), 0.0),
            "fc2": normal((L, H, D), out_std),
            "fc2_bias": const((L, D), 0.0),
        },
        "lnf_scale": const((D,), 1.0),
        "lnf_bias": const((D,), 0.0),
        "head": normal((D, cfg.vocab), std),
    }


def n_params(params: Params) -> int:
    """Number of scalar parameters."""
    return sum(int(x.size) for x in jax.tree.leaves(params))


def _cast(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype), tree)


def _layer_norm(x, scale, bias, eps=1e-5):
    """LayerNorm with float32 statistics (as Flax and mixed-precision practice do: in fp16,
    ``rsqrt``'s derivative overflows for the small variances of a freshly initialised model),
    returned in ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = ((x32 - mean) * lax.rsqrt(var + eps)).astype(x.dtype)
    return y * scale[None, None] + bias[None, None]


def block(cfg: ModelConfig, x: jax.Array, p: Params) -> jax.Array:
    """One pre-LayerNorm decoder block on ``x: [batch, seq, d_model]`` in ``x.dtype``.

    ``p`` holds this block's float32 master parameters (one slice of the stack); they are cast
    to ``x.dtype`` here.
    """
    dt = x.dtype
    p = _cast(p, dt)
    B, T, D = x.shape
    nh, hd = cfg.n_heads, cfg.head_dim

    h = _layer_norm(x, p["ln1_scale"], p["ln1_bias"])
    qkv = jnp.einsum("btd,de->bte", h, p["qkv"]).reshape(B, T, 3, nh, hd)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(hd))
    causal = jnp.tril(jnp.ones((T, T), jnp.bool_))
    scores = jnp.where(causal[None, None], scores, jnp.asarray(jnp.finfo(dt).min, dt))
    attn = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(B, T, D)
    x = x + jnp.einsum("btd,de->bte", o, p["proj"])

    h = _layer_norm(x, p["ln2_scale"], p["ln2_bias"])
    h = jnp.einsum("btd,dh->bth", h, p["fc1"]) + p["fc1_bias"][None, None]
    h = jax.nn.gelu(h, approximate=True)
    return x + (jnp.einsum("bth,hd->btd", h, p["fc2"]) + p["fc2_bias"][None, None])


def lax_scan_blocks(block_fn: BlockFn, x: jax.Array, stacked: Params) -> jax.Array:
    """The default block runner: `jax.lax.scan` over the stacked block parameters."""
    x, _ = lax.scan(lambda c, p: (block_fn(c, p), None), x, stacked)
    return x


def forward(cfg: ModelConfig, params: Params, tokens: jax.Array, dtype,
            run_blocks: RunBlocks = lax_scan_blocks) -> jax.Array:
    """Logits ``[batch, seq, vocab]`` in ``dtype`` for int tokens ``[batch, seq]``."""
    T = tokens.shape[-1]
    x = jnp.take(params["tok_emb"].astype(dtype), tokens, axis=0)
    x = x + params["pos_emb"][None, :T].astype(dtype)
    x = run_blocks(lambda c, p: block(cfg, c, p), x, params["blocks"])
    x = _layer_norm(x, params["lnf_scale"].astype(dtype), params["lnf_bias"].astype(dtype))
    return jnp.einsum("btd,dv->btv", x, params["head"].astype(dtype))


def loss_fn(cfg: ModelConfig, params: Params, batch: jax.Array, dtype,
            run_blocks: RunBlocks = lax_scan_blocks) -> jax.Array:
    """Mean next-byte cross-entropy (float32) of ``batch: int32[batch, seq + 1]``.

    The softmax cross-entropy is computed in float32 from the logits, as mixed-precision training
    usually does.
    """
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = forward(cfg, params, inputs, dtype, run_blocks).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(nll)
