"""The demo's second task: a byte-level language model built on a long linear recurrence.

An LRU-style model (Orvieto et al. 2023, "Resurrecting Recurrent Neural Networks for Long
Sequences"), real-valued: each block is

    h = LayerNorm(x);  u = h @ W_in;  g = h @ W_gate
    s_t = a * s_{t-1} + sqrt(1 - a^2) * u_t          (a diagonal recurrence, `lax.scan` over t)
    x = x + (s * gelu(g)) @ W_out

with a per-channel decay ``a = exp(-exp(nu))`` in (0, 1). The recurrence runs sequentially over
the whole context (``lax.scan`` over time, carry ``[batch, d_state]`` in the compute dtype), as
an RNN or a Mamba-style selective scan does. Its backward is a reverse scan of the same length
whose carries include the cotangent of ``a``, summed over every time step: the long
accumulation a bf16 or fp16 backward holds in bf16 or fp16.

The interface is the one `model` (the GPT) has: float32 master parameters (the blocks' stacked
along axis 0), cast to the compute dtype where used; ``block(cfg, x, p)``;
``forward(cfg, params, tokens, dtype, run_blocks)``; ``loss_fn(...)``, so that every precision
mode of `modes` applies unchanged.

The decay's initial range, ``a`` in [0.9, 0.99] (LRU uses up to 0.999), keeps it representable
in bfloat16, whose spacing just below 1 is 2^-8 (0.999 would round to exactly 1).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .model import Params, RunBlocks, _cast, _layer_norm, lax_scan_blocks
from .model import n_params as n_params

__all__ = ["RecurrentConfig", "block", "forward", "init_params", "loss_fn", "n_params"]


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Shape of the recurrent model."""

    n_layers: int = 2
    d_model: int = 64
    d_state: int = 64
    seq_len: int = 1024
    vocab: int = 256
    r_min: float = 0.9
    r_max: float = 0.99
    # `lax.scan`'s unroll over time (speed only: the same arithmetic in the same order).
    unroll: int = 8


def init_params(seed: int, cfg: RecurrentConfig) -> Params:
    """Float32 master parameters (NumPy's generator, no compilation); blocks stacked on axis 0.

    The decay is drawn as LRU does: ``a = r`` with ``r^2`` uniform in ``[r_min^2, r_max^2]``,
    stored as ``nu = log(-log(a))``.
    """
    L, D, N = cfg.n_layers, cfg.d_model, cfg.d_state
    rng = np.random.default_rng(seed)
    std = 0.02

    def normal(shape, s):
        return jnp.asarray((s * rng.standard_normal(shape)).astype(np.float32))

    def const(shape, v):
        return jnp.asarray(np.full(shape, v, np.float32))

    u = rng.uniform(size=(L, N))
    r = np.sqrt(u * (cfg.r_max**2 - cfg.r_min**2) + cfg.r_min**2)
    nu = np.log(-np.log(r)).astype(np.float32)
    return {
        "tok_emb": normal((cfg.vocab, D), std),
        "blocks": {
            "ln_scale": const((L, D), 1.0),
            "ln_bias": const((L, D), 0.0),
            "in_proj": normal((L, D, N), 1.0 / math.sqrt(D)),
            "gate": normal((L, D, N), 1.0 / math.sqrt(D)),
            "nu": jnp.asarray(nu),
            "out_proj": normal((L, N, D), 1.0 / math.sqrt(N * 2 * L)),
        },
        "lnf_scale": const((D,), 1.0),
        "lnf_bias": const((D,), 0.0),
        "head": normal((D, cfg.vocab), std),
    }


def recurrence(a: jax.Array, u: jax.Array, unroll: int = 1) -> jax.Array:
    """``s_t = a * s_{t-1} + sqrt(1 - a^2) * u_t`` from ``s_{-1} = 0``, for ``u: [B, T, N]``
    (``lax.scan`` over T, in ``u.dtype``); returns ``s: [B, T, N]``."""
    gamma = jnp.sqrt(1 - a * a)
    inp = jnp.swapaxes(u, 0, 1) * gamma[None, None]  # [T, B, N]

    def step(s, v):
        s = a[None] * s + v
        return s, s

    _, s = lax.scan(step, jnp.zeros_like(inp[0]), inp, unroll=unroll)
    return jnp.swapaxes(s, 0, 1)


def block(cfg: RecurrentConfig, x: jax.Array, p: Params) -> jax.Array:
    """One recurrent block on ``x: [batch, seq, d_model]`` in ``x.dtype``; ``p`` holds this
    block's float32 master parameters, cast to ``x.dtype`` here."""
    p = _cast(p, x.dtype)
    h = _layer_norm(x, p["ln_scale"], p["ln_bias"])
    u = jnp.einsum("btd,dn->btn", h, p["in_proj"])
    g = jnp.einsum("btd,dn->btn", h, p["gate"])
    a = jnp.exp(-jnp.exp(p["nu"]))
    s = recurrence(a, u, cfg.unroll)
    y = s * jax.nn.gelu(g, approximate=True)
    return x + jnp.einsum("btn,nd->btd", y, p["out_proj"])


def forward(cfg: RecurrentConfig, params: Params, tokens: jax.Array, dtype,
            run_blocks: RunBlocks = lax_scan_blocks) -> jax.Array:
    """Logits ``[batch, seq, vocab]`` in ``dtype`` for int tokens ``[batch, seq]`` (any length:
    the model has no positional table)."""
    x = jnp.take(params["tok_emb"].astype(dtype), tokens, axis=0)
    x = run_blocks(lambda c, p: block(cfg, c, p), x, params["blocks"])
    x = _layer_norm(x, params["lnf_scale"].astype(dtype), params["lnf_bias"].astype(dtype))
    return jnp.einsum("btd,dv->btv", x, params["head"].astype(dtype))


def loss_fn(cfg: RecurrentConfig, params: Params, batch: jax.Array, dtype,
            run_blocks: RunBlocks = lax_scan_blocks) -> jax.Array:
    """Mean next-byte cross-entropy (float32) of ``batch: int32[batch, seq + 1]``."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = forward(cfg, params, inputs, dtype, run_blocks).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(nll)
