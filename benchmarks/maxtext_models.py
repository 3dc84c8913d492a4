"""Real MaxText decoders (PyPI ``maxtext``, 0.2.5), shrunk, with MaxText's own training loss.

``build(name, layers, batch, seq)`` returns ``(loss, args)``: ``loss(*args)`` is one training
step's loss exactly as MaxText 0.2.5's trainer computes it (``maxtext/trainers/pre_train/
train.py``: ``train_step`` splits the NNX model into ``nnx.Param`` and the rest, and its
``diff_wrapper`` merges them back and calls ``loss_fn``, which runs the model on the batch and
takes the cross-entropy of the logits against ``targets``, masked by ``targets_segmentation``,
over the target token count), under the logical axis rules the trainer sets. The trainer
also traces its step under ``jax.set_mesh(mesh)``, which cannot be entered inside a trace:
call or lower ``loss`` (or its gradient) under ``with jax.set_mesh(loss.mesh):`` for the
identical program (without it only the ``ctx_mesh`` / ``context_mesh`` metadata of some
equations differ; the mesh is one device).
``jax.grad(loss)`` (w.r.t. the first argument, the parameters) is therefore MaxText's own bf16
remat training step: the NNX decoder's ``jax.lax.scan`` over ``jax.checkpoint(layer_fn,
policy=<remat_policy>)`` (``maxtext/layers/nnx_decoders.py``, ``_apply_layers_sequentially``).

``args`` are ``(params, rest, data)``: the ``nnx.Param`` state (float32, ``weight_dtype``), the
rest of the model's state (NNX rng keys and counters, per scanned layer too), and the batch
(``inputs``, ``inputs_position``, ``inputs_segmentation``, ``targets``,
``targets_segmentation``, int32 ``[batch, seq]``); `jax.ShapeDtypeStruct`s by default,
concrete arrays with ``concrete=True``.

Needs ``maxtext`` (Python >= 3.12), which declares no base dependencies; what works, in a
fresh virtual environment with hifigrad installed (``pip install -e '.[flax]'``)::

    pip install --no-deps maxtext==0.2.5 tokamax xprof
    pip install omegaconf jinja2 huggingface_hub pathwaysutils transformers qwix grain aqtp \
        drjax jaxtyping einshape pydantic tqdm immutabledict tensorboardx pillow fire six \
        tiktoken sentencepiece sympy

Importing this module does not need it: `available()` says whether it can build.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import tempfile

BASE = dict(
    override_model_config=True,
    base_emb_dim=256,
    base_mlp_dim=1024,
    vocab_size=256,
    scan_layers=True,
    attention="dot_product",
    hardware="cpu",
    dtype="bfloat16",
    weight_dtype="float32",
    enable_checkpointing=False,
    skip_jax_distributed_system=True,
    dataset_type="synthetic",
    run_name="hifigrad_probe",
    # MaxText turns on JAX's persistent compilation cache (~/jax_cache) by default: off, so that
    # every program is compiled here (what XLA dumps is what was measured).
    jax_cache_dir="",
)

# Per config: MaxText's model_name, then the shrunk sizes that architecture needs.
CONFIGS = {
    "llama2-full": dict(model_name="llama2-7b", remat_policy="full",
                        base_num_query_heads=4, base_num_kv_heads=4, head_dim=64),
    "llama2-minimal": dict(model_name="llama2-7b", remat_policy="minimal",
                           base_num_query_heads=4, base_num_kv_heads=4, head_dim=64),
    "mistral": dict(model_name="mistral-7b", remat_policy="full",
                    base_num_query_heads=4, base_num_kv_heads=2, head_dim=64),
    # gemma2: one scanned layer is a (local, global) attention pair; a 128-token window so
    # that the local layer differs from the global one at seq 256.
    "gemma2": dict(model_name="gemma2-2b", remat_policy="full",
                   base_num_query_heads=4, base_num_kv_heads=2, head_dim=64,
                   sliding_window_size=128),
    # deepseek3-tiny: MLA (low-rank q and kv, YaRN RoPE on qk_rope_head_dim) and a sigmoid
    # routed MoE (4 experts, 2 per token, 1 shared) after first_num_dense_layers=1 dense
    # layer (two scans), routed dropless (capacity_factor=-1) by MaxText's dense path
    # (sparse_matmul=False: an einsum over every expert, weighted per token).
    "deepseek": dict(model_name="deepseek3-tiny", remat_policy="full",
                     base_num_query_heads=4, base_num_kv_heads=4,
                     q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=64,
                     qk_rope_head_dim=32, v_head_dim=64, base_moe_mlp_dim=128,
                     num_experts=4, num_experts_per_tok=2, first_num_dense_layers=1,
                     sparse_matmul=False, capacity_factor=-1),
}
# Not asked for by default: deepseek with MaxText's other MoE paths. MaxText's default
# (sparse_matmul=True, megablox=True) routes inside a jax.shard_map, sorting every token of the
# batch by expert, and runs megablox's Pallas grouped matmul; megablox=False runs
# jax.lax.ragged_dot in that shard_map instead.
CONFIGS["deepseek-sparse"] = dict(CONFIGS["deepseek"], sparse_matmul=True)
CONFIGS["deepseek-ragged"] = dict(CONFIGS["deepseek"], sparse_matmul=True, megablox=False)
# capacity-limited routing (MaxText's dense path computes each sequence's capacity: per row)
CONFIGS["deepseek-capacity"] = dict(CONFIGS["deepseek"], capacity_factor=1.0)
DEFAULT = ("llama2-full", "llama2-minimal", "mistral", "gemma2", "deepseek")


def version() -> str:
    """The installed maxtext's version."""
    from importlib import metadata

    return metadata.version("maxtext")


def available() -> bool:
    """Whether ``maxtext`` can be imported (it needs Python >= 3.12)."""
    try:
        return importlib.util.find_spec("maxtext") is not None
    except (ImportError, ValueError):
        return False


def overrides(name: str, layers: int = 8, batch: int = 8, seq: int = 256, **extra) -> dict:
    """The keyword overrides given to ``maxtext.configs.pyconfig.initialize`` for ``name``
    (``extra``: more of MaxText's config keys, e.g. ``num_vocab_tiling=4``)."""
    if name not in CONFIGS:
        raise KeyError(f"unknown MaxText config {name!r}; known: {sorted(CONFIGS)}")
    return dict(BASE, **CONFIGS[name], base_num_decoder_layers=layers,
                per_device_batch_size=batch, max_target_length=seq,
                base_output_directory=os.path.join(tempfile.gettempdir(), "maxtext_output"),
                **extra)


@functools.cache
def _config(name, layers, batch, seq, extra):
    from maxtext.configs import pyconfig

    base_yml = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    return pyconfig.initialize(["", base_yml], **overrides(name, layers, batch, seq,
                                                              **dict(extra)))


def config(name: str, layers: int = 8, batch: int = 8, seq: int = 256, **extra):
    """MaxText's config for ``name`` (``pyconfig.initialize`` over ``base.yml``)."""
    return _config(name, layers, batch, seq, tuple(sorted(extra.items())))


def build(name: str, layers: int = 8, batch: int = 8, seq: int = 256, *,
          concrete: bool = False, **extra):
    """``(loss, args)`` for MaxText config ``name`` (one of `CONFIGS`) with ``layers`` decoder
    layers, ``batch`` sequences of ``seq`` tokens: ``loss(params, rest, data)`` is MaxText's
    training loss (see the module docstring); ``args`` abstract, or concrete (initialized
    parameters, random tokens, one segment per row) with ``concrete=True``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.trainers.pre_train import train
    from maxtext.utils import maxtext_utils, model_creation_utils

    cfg = config(name, layers, batch, seq, **extra)
    if cfg.decoder_block.value == "deepseek" and layers <= cfg.first_num_dense_layers:
        raise ValueError(f"{name} needs more than first_num_dense_layers="
                         f"{cfg.first_num_dense_layers} layers (its MoE scan would be empty)")
    mesh = maxtext_utils.get_mesh_from_config(cfg)
    create = model_creation_utils.get_nnx_create_model_fn(cfg, mesh)
    with jax.set_mesh(mesh), logical_axis_rules(cfg.logical_axis_rules):
        model = create() if concrete else nnx.eval_shape(create)
    # train_step: nnx.split(state.model, Param, custom (_overwrite_with_gradient), ...);
    # these models have no custom-gradient state, so it is (params, rest).
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest, data):
        with logical_axis_rules(cfg.logical_axis_rules):
            local_model = nnx.merge(graphdef, params, rest, copy=True)
            value, _ = train.loss_fn(local_model, cfg, dict(data), None, None, is_train=True)
        return value

    loss.mesh = mesh  # MaxText's trainer traces its step under ``jax.set_mesh(mesh)``
    keys = ("inputs", "inputs_position", "inputs_segmentation", "targets",
            "targets_segmentation")
    if concrete:
        tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 1, cfg.vocab_size)
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        ones = jnp.ones((batch, seq), jnp.int32)
        data = dict(inputs=tokens[:, :-1], inputs_position=positions,
                    inputs_segmentation=ones, targets=tokens[:, 1:],
                    targets_segmentation=ones)
    else:
        data = {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32) for k in keys}
    return loss, (params, rest, data)
