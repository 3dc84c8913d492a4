"""The precision modes the demo compares, one row each.

A mode fixes the forward's compute dtype, how gradients are taken (`jax.grad` or hifigrad), what
the scan over blocks saves for the backward, and loss scaling. `build(mode, cfg)` turns one into
functions of ``(params, state, batch)``, where ``state`` is the mode's own non-trained state
(the dynamic loss scale, or the seed's fp8 scaling metadata; ``{}`` otherwise).

The hifigrad APIs a mode needs are imported when the mode is built, so that modes whose API is
missing in this installation can be reported as skipped (`MissingAPI`) while the others run.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import model as M

__all__ = ["MODES", "MODE_NAMES", "PRECISION_MODE_NAMES", "Mode", "ModeFns", "MissingAPI",
           "build", "get_mode", "model_module", "remat_blocks_vjp", "remat_value_and_grad"]

# Dynamic loss scaling, the standard scheme (as in NVIDIA Apex / torch.amp's GradScaler).
LOSS_SCALE_INIT = 2.0**15
LOSS_SCALE_GROWTH_INTERVAL = 200
# Length of the seed's amax history (AMAX_HIST_LENGTH in the seed issue's example).
SEED_AMAX_HISTORY = 128


@dataclasses.dataclass(frozen=True)
class Mode:
    """One row of the comparison.

    Attributes:
      name: the name ``--modes`` takes.
      label: a short human-readable label.
      dtype: the forward's compute dtype.
      grad: ``"jax"`` (`jax.value_and_grad`) or ``"hg"`` (`hifigrad.value_and_grad`).
      matmul: `hifigrad.Policy.matmul` for ``grad="hg"``.
      loss_scaling: dynamic loss scaling (fp16).
      saved: what the scan over blocks saves: ``"all"`` (a plain `lax.scan`: every residual of
        every block), ``"fp8-seed"`` (the seed issue's remat scan over fp8-quantized carries,
        fp8 gradients), or a codec name (`hifigrad.scan`: each block's input encoded with it,
        blocks recomputed in the backward).
      counterpart: the plain mode an ``hg`` row is compared with.
      description: one sentence for the report.
    """

    name: str
    label: str
    dtype: Any
    grad: str = "jax"
    matmul: str = "exact"
    loss_scaling: bool = False
    saved: str = "all"
    counterpart: str | None = None
    description: str = ""


MODES: tuple[Mode, ...] = (
    Mode("f32", "f32 reference", jnp.float32,
         description="float32 forward and backward with jax.grad: the reference."),
    Mode("bf16", "bf16 jax.grad", jnp.bfloat16,
         description="bf16 forward, f32 master weights; jax.grad runs the backward in bf16."),
    Mode("bf16-hg", "bf16 hg exact", jnp.bfloat16, grad="hg", counterpart="bf16",
         description="bf16 forward; hifigrad runs the backward in f32 (Policy(matmul='exact'))."),
    Mode("bf16-hg-fast", "bf16 hg fast", jnp.bfloat16, grad="hg", matmul="fast",
         counterpart="bf16",
         description="bf16 forward; hifigrad backward with bf16 matmul operands and f32 "
                     "accumulation (Policy(matmul='fast')), f32 elsewhere."),
    Mode("fp16", "fp16 jax.grad", jnp.float16,
         description="fp16 forward; jax.grad backward in fp16, no loss scaling."),
    Mode("fp16-ls", "fp16 jax.grad loss-scaled", jnp.float16, loss_scaling=True,
         description="fp16 forward; jax.grad backward in fp16 with dynamic loss scaling "
                     "(scale 2^15, halved and the step skipped on non-finite gradients, "
                     "doubled after 200 good steps)."),
    Mode("fp16-hg", "fp16 hg", jnp.float16, grad="hg", counterpart="fp16",
         description="fp16 forward; hifigrad backward in f32, no loss scaling."),
    Mode("fp8-seed", "fp8 act, fp8 grad (seed)", jnp.bfloat16, saved="fp8-seed",
         description="bf16 blocks in a remat scan whose carries are fp8 e4m3 (delayed scaling), "
                     "with the quantize/dequantize custom_vjp of the fp8 recipe hifigrad started "
                     "from ('seed' in the label), whose backward casts the gradient to fp8 e4m3 "
                     "too."),
    Mode("none-hg", "bf16 act, f32 grad (hg)", jnp.bfloat16, grad="hg", saved="none",
         counterpart="bf16",
         description="bf16 forward; hifigrad.scan saves each block's input as it is (codec "
                     "'none') and recomputes the block in an f32 backward run in batch slices: "
                     "what the sliced backward saves, before any codec."),
    Mode("fp8-hg", "fp8 act, f32 grad (hg)", jnp.bfloat16, grad="hg", saved="fp8_e4m3",
         counterpart="fp8-seed",
         description="bf16 forward; hifigrad.scan saves each block's input as fp8 e4m3 and "
                     "recomputes the block in an f32 backward."),
    Mode("int8-hg", "int8 act, f32 grad (hg)", jnp.bfloat16, grad="hg", saved="int8",
         counterpart="fp8-seed",
         description="as fp8-hg, saving int8 (per-group absmax) block inputs."),
    Mode("int4-hg", "int4 act, f32 grad (hg)", jnp.bfloat16, grad="hg", saved="int4",
         counterpart="fp8-seed",
         description="as fp8-hg, saving int4 (per-group, stochastic rounding) block inputs."),
    Mode("int2-hg", "int2 act, f32 grad (hg)", jnp.bfloat16, grad="hg", saved="int2",
         counterpart="fp8-seed",
         description="as fp8-hg, saving int2 (per-group, stochastic rounding) block inputs."),
)
MODE_NAMES: tuple[str, ...] = tuple(m.name for m in MODES)
# The modes that differ only in the forward's dtype and the backward (every residual saved as
# the forward made it): the recurrent task's default.
PRECISION_MODE_NAMES: tuple[str, ...] = tuple(m.name for m in MODES if m.saved == "all")
_BY_NAME = {m.name: m for m in MODES}


def get_mode(name: str) -> Mode:
    """The mode called ``name``; ValueError naming the valid ones otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"unknown mode {name!r}; valid modes: {', '.join(MODE_NAMES)}") from None


class MissingAPI(RuntimeError):
    """A mode needs a hifigrad API this installation does not have."""


@dataclasses.dataclass(frozen=True)
class ModeFns:
    """What training needs from a mode.

    Attributes:
      init_state: ``() -> state``.
      value_and_grad: ``(params, state, batch) -> (loss, grads, new_state, ok)``: float32 loss,
        float32 gradients of the parameters (unscaled), the next state, and whether the step
        should be applied (False only for a loss-scaled step with non-finite gradients).
      vjp_for_memory: ``(params, state, batch) -> vjp_fn``: the pullback the mode's backward
        uses, whose pytree leaves are the residuals saved for it.
      blocks_vjp_for_memory: ``(params, state, x) -> vjp_fn``: the same for the scan over
        blocks alone, from its input ``x`` (the embeddings, in the compute dtype).
    """

    init_state: Callable[[], Any]
    value_and_grad: Callable[..., tuple]
    vjp_for_memory: Callable[..., Any]
    blocks_vjp_for_memory: Callable[..., Any]


# ------------------------------------------------------------------------------ hifigrad APIs

def _hg():
    import hifigrad as hg

    return hg


def _policy(mode: Mode):
    hg = _hg()
    policy = hg.Policy(tangent_dtype=jnp.float32, matmul=mode.matmul)
    if mode.matmul == "fast":
        try:
            import hifigrad._src.fast  # noqa: F401
        except ImportError as e:
            raise MissingAPI(f"Policy(matmul='fast') is not available here ({e})") from e
    return policy


def _hg_scan():
    hg = _hg()
    scan = getattr(hg, "scan", None)
    if scan is None:
        raise MissingAPI("hifigrad.scan is not available in this installation")
    try:
        from hifigrad._src.codecs import get_codec
    except ImportError as e:  # pragma: no cover - codecs ship with hg.scan
        raise MissingAPI(f"hifigrad codecs are not available here ({e})") from e
    return scan, get_codec


# ------------------------------------------------------------------------------ the seed's fp8

def _seed_fp8_ops(primal_dtype, quantized_dtype, tangent_dtype):
    """The seed issue's ``quantize_fn`` / ``dequantize_fn``, reproduced as written there.

    Only the dtypes differ: the seed's blocks compute in float32, here they compute in bf16, so
    ``primal_dtype = tangent_dtype = bf16``. The dequantize backward casts the gradient to
    ``quantized_dtype`` (fp8 e4m3), which JAX requires because the carry is fp8: the workaround
    the seed issue is about.
    """
    import flax.linen as nn

    def quantize_fn(primal_dtype, quantized_primal_dtype, tangent_dtype):
        def quantize_fwd(x, scale, amax_history):
            new_scale, new_history = nn.fp8_ops.update_fp8_meta(
                x, quantized_primal_dtype, scale, amax_history
            )
            qx = nn.fp8_ops.quantize(
                x, quantized_primal_dtype, nn.fp8_ops._fm32_to_float32(new_scale), primal_dtype
            )
            return (qx, new_scale), (new_scale, new_history)

        def quantize_bwd(res, g):
            dqx, _ = g
            new_scale, new_history = res
            return dqx.astype(tangent_dtype), new_scale, new_history

        @jax.custom_vjp
        def quantize(x, scale, amax_history):
            (qx, new_scale), _ = quantize_fwd(x, scale, amax_history)
            return qx, new_scale

        quantize.defvjp(quantize_fwd, quantize_bwd)

        return quantize

    def dequantize_fn(primal_dtype, tangent_dtype):
        def dequantize_fwd(x, scale):
            dqx = nn.fp8_ops.dequantize(x, primal_dtype, nn.fp8_ops._fm32_to_float32(scale))
            return dqx, None

        def dequantize_bwd(_, g):
            return g.astype(tangent_dtype), None

        @jax.custom_vjp
        def dequantize(x, scale):
            dqx, _ = dequantize_fwd(x, scale)
            return dqx

        dequantize.defvjp(dequantize_fwd, dequantize_bwd)

        return dequantize

    return (quantize_fn(primal_dtype, quantized_dtype, tangent_dtype),
            dequantize_fn(primal_dtype, quantized_dtype))


def _seed_init_meta(n_layers: int) -> dict:
    """The seed's ``create_variables``: scale 1 and a zero amax history, for the input quantize
    and (stacked) for each block's output quantize."""
    h = SEED_AMAX_HISTORY
    return {"in_scale": jnp.ones((1,), jnp.float32), "in_hist": jnp.zeros((h,), jnp.float32),
            "scale": jnp.ones((n_layers, 1), jnp.float32),
            "hist": jnp.zeros((n_layers, h), jnp.float32)}


def _seed_run_blocks(meta, quantize, dequantize):
    """The seed's ``Model``: quantize, a remat scan of ``Block`` (dequantize, compute,
    quantize) with ``nothing_saveable``, then dequantize."""

    def run_blocks(block_fn, x, stacked):
        qx, scale = quantize(x, meta["in_scale"], meta["in_hist"])

        def body(carry, xs):
            qx, scale = carry
            p, out_scale, out_hist = xs
            h = block_fn(dequantize(qx, scale), p)
            return quantize(h, out_scale, out_hist), None

        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
        (qx, out_scale), _ = lax.scan(body, (qx, scale), (stacked, meta["scale"], meta["hist"]))
        return dequantize(qx, out_scale)

    return run_blocks


# ------------------------------------------------------------------------------ build

def _true():
    return jnp.asarray(True)


def model_module(cfg):
    """The module that defines the model of ``cfg``: `model` (the GPT, `model.ModelConfig`) or
    `recurrent` (`recurrent.RecurrentConfig`). Both have the same functions (``init_params``,
    ``block``, ``loss_fn``, ``n_params``)."""
    from . import recurrent

    return recurrent if isinstance(cfg, recurrent.RecurrentConfig) else M


def build(mode: Mode, cfg) -> ModeFns:
    """The functions training needs for ``mode``, on the model ``cfg`` describes (a
    `model.ModelConfig` or a `recurrent.RecurrentConfig`).

    Raises:
      MissingAPI: when the mode needs a hifigrad API this installation lacks.
    """
    dt = mode.dtype
    if mode.saved == "fp8-seed":
        return _build_seed(mode, cfg)
    model = model_module(cfg)

    if mode.saved == "all":
        run_blocks = M.lax_scan_blocks
    else:
        scan, get_codec = _hg_scan()
        codec = get_codec(mode.saved)
        policy = _policy(mode)

        def run_blocks(block_fn, x, stacked):
            out, _ = scan(lambda c, p: (block_fn(c, p), None), x, stacked,
                          codec=codec, policy=policy)
            return out

    def loss(params, batch):
        return model.loss_fn(cfg, params, batch, dt, run_blocks)

    def blocks(x, stacked):
        return run_blocks(functools.partial(model.block, cfg), x, stacked)

    if mode.grad == "hg":
        hg = _hg()
        policy = _policy(mode)
        vg = hg.value_and_grad(loss, policy=policy)
        vjp = functools.partial(hg.vjp, policy=policy)
    else:
        vg = jax.value_and_grad(loss)
        vjp = jax.vjp

    def vjp_for_memory(params, state, batch):
        return vjp(lambda p: loss(p, batch), params)[1]

    def blocks_vjp_for_memory(params, state, x):
        return vjp(blocks, x, params["blocks"])[1]

    if mode.loss_scaling:
        return ModeFns(init_state=_init_loss_scale,
                       value_and_grad=functools.partial(_loss_scaled_vg, loss),
                       vjp_for_memory=vjp_for_memory,
                       blocks_vjp_for_memory=blocks_vjp_for_memory)

    def value_and_grad(params, state, batch):
        value, grads = vg(params, batch)
        return value, grads, state, _true()

    return ModeFns(init_state=dict, value_and_grad=value_and_grad,
                   vjp_for_memory=vjp_for_memory, blocks_vjp_for_memory=blocks_vjp_for_memory)


def remat_blocks_vjp(cfg):
    """A memory reference that is not a mode: the pullback of a `jax.checkpoint` scan over the
    blocks (``nothing_saveable``: only each block's input carry is saved, uncompressed).
    ``(params, state, x) -> vjp_fn``, like `ModeFns.blocks_vjp_for_memory`."""

    block = model_module(cfg).block

    def run_blocks(x, stacked):
        body = jax.checkpoint(lambda c, p: (block(cfg, c, p), None),
                              policy=jax.checkpoint_policies.nothing_saveable)
        return lax.scan(body, x, stacked)[0]

    def blocks_vjp_for_memory(params, state, x):
        return jax.vjp(run_blocks, x, params["blocks"])[1]

    return blocks_vjp_for_memory


def remat_value_and_grad(cfg):
    """A memory reference that is not a mode: what a bf16 user runs today, `jax.value_and_grad`
    of the bf16 model with a `jax.checkpoint` scan over the blocks (bf16 carry, bf16
    backward). ``(params, batch) -> (loss, grads)``, for its compiled step's temp bytes."""
    model = model_module(cfg)

    def run_blocks(block_fn, x, stacked):
        body = jax.checkpoint(lambda c, p: (block_fn(c, p), None),
                              policy=jax.checkpoint_policies.nothing_saveable)
        return lax.scan(body, x, stacked)[0]

    return jax.value_and_grad(
        lambda params, batch: model.loss_fn(cfg, params, batch, jnp.bfloat16, run_blocks))


def _init_loss_scale() -> dict:
    return {"scale": jnp.asarray(LOSS_SCALE_INIT, jnp.float32),
            "good_steps": jnp.zeros((), jnp.int32)}


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _loss_scaled_vg(loss, params, state, batch):
    """Dynamic loss scaling: the gradient of ``scale * loss``, unscaled in float32; on
    non-finite gradients the step is skipped and the scale halved, and after
    `LOSS_SCALE_GROWTH_INTERVAL` good steps in a row it is doubled."""
    scale = state["scale"]
    scaled_loss, grads = jax.value_and_grad(lambda p: loss(p, batch) * scale)(params)
    grads = jax.tree.map(lambda g: g / scale, grads)
    ok = _all_finite(grads)
    good = jnp.where(ok, state["good_steps"] + 1, 0)
    grow = good >= LOSS_SCALE_GROWTH_INTERVAL
    new_scale = jnp.where(ok, jnp.where(grow, scale * 2.0, scale), scale * 0.5)
    new_state = {"scale": new_scale, "good_steps": jnp.where(grow, 0, good)}
    return scaled_loss / scale, grads, new_state, ok


def _build_seed(mode: Mode, cfg) -> ModeFns:
    dt = mode.dtype
    quantize, dequantize = _seed_fp8_ops(dt, jnp.float8_e4m3fn, dt)
    model = model_module(cfg)

    def loss(params, meta, batch):
        return model.loss_fn(cfg, params, batch, dt, _seed_run_blocks(meta, quantize, dequantize))

    vg = jax.value_and_grad(loss, argnums=(0, 1))

    def value_and_grad(params, meta, batch):
        # The seed's fp8 metadata lives in Flax's OVERWRITE_WITH_GRADIENT collection: its
        # "gradient" is its new value.
        value, (grads, new_meta) = vg(params, meta, batch)
        return value, grads, new_meta, _true()

    def vjp_for_memory(params, meta, batch):
        return jax.vjp(lambda p, m: loss(p, m, batch), params, meta)[1]

    def blocks_vjp_for_memory(params, meta, x):
        def blocks(x, stacked, meta):
            run = _seed_run_blocks(meta, quantize, dequantize)
            return run(functools.partial(model.block, cfg), x, stacked)

        return jax.vjp(blocks, x, params["blocks"], meta)[1]

    return ModeFns(init_state=lambda: _seed_init_meta(cfg.n_layers),
                   value_and_grad=value_and_grad, vjp_for_memory=vjp_for_memory,
                   blocks_vjp_for_memory=blocks_vjp_for_memory)
