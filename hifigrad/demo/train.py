"""`run(config) -> results`: trains the demo model once per mode and measures each.

Every mode starts from the same initial parameters and sees the same batches in the same order.
For each mode it records:

* the training loss at every step, and the validation loss of the final parameters (always
  evaluated with a float32 forward, so it measures the parameters, not the forward's dtype);
* gradient fidelity: every ``eval_every`` steps (and at the last step), the mode's gradient and
  the float32 reference gradient ``jax.grad`` computes *at the same parameters on the same
  batch*, compared by SQNR = ``10 log10(|g_ref|^2 / |g - g_ref|^2)`` over all parameters;
* the step time (median over the steps of the gradient plus the optimizer update, compiled
  ahead of time, and its quartiles: the step-to-step spread) and the time to trace and
  compile the mode's gradient program;
* memory: the bytes of the residuals one training step saves for its backward (the leaves of
  the mode's pullback, counted once each, leaving out the arguments it keeps a reference to),
  for the whole model and for the scan over blocks alone (beside an uncompressed bf16
  `jax.checkpoint` scan as a reference), and XLA's temporary bytes for the compiled gradient
  program (``memory_analysis()``; the optimizer update is the same program for every mode and
  is reported once).

Every GPT run also compares, compile-only, the compressed modes' training step with the bf16
`jax.checkpoint` scan's at a size where a codec's saving shows (`memory_at_scale`, `SCALE`).

`run` is pure apart from what its optional `Reporter` prints.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import data as D
from . import model as M
from . import modes as MD

__all__ = ["DemoConfig", "QUICK", "RECURRENT", "RECURRENT_QUICK", "SCALE", "SCALE_BATCH", "TASKS",
           "Reporter", "memory_at_scale", "run", "saved_residual_bytes"]


TASKS = ("gpt", "recurrent")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run depends on.

    ``task`` picks the model: ``"gpt"`` (`model`, the default) or ``"recurrent"`` (`recurrent`,
    an LRU-style linear recurrence over the whole context; ``n_heads`` is unused there and
    ``d_state`` is its state width). ``sweep_lengths``: sequence lengths at which every mode's
    gradient SQNR vs f32 is also measured at the initial parameters (empty: no sweep).
    """

    modes: tuple[str, ...] = MD.MODE_NAMES
    steps: int = 200
    n_layers: int = 4
    d_model: int = 64
    n_heads: int = 4
    seq_len: int = 64
    batch_size: int = 8
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    eval_every: int = 20
    val_batches: int = 8
    corpus_bytes: int = 4_000_000
    seed: int = 0
    devices: int = 1
    # XLA's backend (LLVM) optimisation level on CPU: compile time is most of a short run there.
    cpu_opt_level: int = 1
    task: str = "gpt"
    d_state: int = 64
    sweep_lengths: tuple[int, ...] = ()

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; valid tasks: {', '.join(TASKS)}")
        for name in ("steps", "n_layers", "d_model", "n_heads", "seq_len", "batch_size",
                     "eval_every", "val_batches", "corpus_bytes", "d_state"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for n in self.sweep_lengths:
            if int(n) < 1:
                raise ValueError(f"sweep lengths must be at least 1, got {n}")
        if not self.modes:
            raise ValueError("at least one mode is needed")
        for m in self.modes:
            MD.get_mode(m)
        if self.devices < 1 or self.batch_size % self.devices:
            raise ValueError(f"batch_size={self.batch_size} is not divisible by "
                             f"devices={self.devices}")
        if self.sweep_lengths and self.task != "recurrent":
            raise ValueError("sweep_lengths needs task='recurrent' (the GPT's positional table "
                             "fixes its sequence length)")
        if self.task == "gpt" and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")

    @property
    def model(self):
        """The model's shape: a `model.ModelConfig` or a `recurrent.RecurrentConfig`."""
        if self.task == "recurrent":
            from .recurrent import RecurrentConfig

            return RecurrentConfig(n_layers=self.n_layers, d_model=self.d_model,
                                   d_state=self.d_state, seq_len=self.seq_len)
        return M.ModelConfig(n_layers=self.n_layers, d_model=self.d_model,
                             n_heads=self.n_heads, seq_len=self.seq_len)


# A tiny configuration for tests and a first look: the whole run within a minute on 2 CPU cores.
QUICK = DemoConfig(steps=30, n_layers=2, d_model=32, n_heads=2, seq_len=32, batch_size=8,
                   learning_rate=3e-3, warmup_steps=5, eval_every=10, val_batches=2,
                   corpus_bytes=1_000_000, cpu_opt_level=0)

# The recurrent task (`hifigrad demo --task recurrent`): a context of 1024 bytes, the precision
# modes (f32, bf16 and fp16, with jax.grad and with hifigrad), and the gradient SQNR at the
# initial parameters against the sequence length.
RECURRENT = DemoConfig(task="recurrent", modes=MD.PRECISION_MODE_NAMES, steps=100, n_layers=2,
                       d_model=64, d_state=64, seq_len=1024, batch_size=4, warmup_steps=10,
                       eval_every=20, val_batches=4, sweep_lengths=(128, 512, 2048))
# Its quick version: context 256, 20 steps, the sweep at lengths 256 and 1024 only, and XLA's
# CPU backend at optimisation level 0 (compiles are most of a short run).
RECURRENT_QUICK = dataclasses.replace(
    RECURRENT, steps=20, seq_len=256, eval_every=5, val_batches=2, warmup_steps=5,
    corpus_bytes=1_000_000, sweep_lengths=(1024,), cpu_opt_level=0)


# The size of the compile-only memory comparison every GPT run also makes (`memory_at_scale`):
# the demo's model at 12 blocks, d_model 256, 4 heads, a batch of 32 x 128 tokens (3.4M
# parameters). At the size a run trains (--quick: 2 blocks, d_model 32) a codec's saving is
# smaller than the step's fixed costs (float32 gradient buffers, the backward's working set);
# here the activations the checkpoints hold dominate, as in a real model. Nothing is trained
# or allocated: each step is compiled from shapes and its memory_analysis() read.
SCALE = M.ModelConfig(n_layers=12, d_model=256, n_heads=4, seq_len=128)
SCALE_BATCH = 32


class Reporter:
    """Progress callbacks of `run`; this base class prints nothing."""

    def stage(self, text: str) -> None:
        """A setup stage begins (loading data, compiling the reference)."""

    def mode_start(self, mode: MD.Mode, steps: int) -> None:
        """``mode`` starts compiling."""

    def mode_compiled(self, mode: MD.Mode, seconds: float) -> None:
        """``mode``'s step is compiled; training starts."""

    def mode_step(self, mode: MD.Mode, step: int) -> None:
        """``mode`` finished training step ``step`` (0-based)."""

    def mode_end(self, mode: MD.Mode, row: dict) -> None:
        """``mode`` is done (``row["status"]`` is ``"ok"`` or ``"skipped"``)."""


# ------------------------------------------------------------------------------ measurements

def saved_residual_bytes(vjp_fn_of, *args) -> int:
    """Bytes of the residuals a pullback saves, measured by tracing, without running anything.

    ``vjp_fn_of(*args)`` must return a pullback (from `jax.vjp` or `hifigrad.vjp`); its pytree
    leaves are what the backward keeps alive. Each distinct value is counted once; values that
    are simply the arguments themselves are left out (they are alive anyway).
    """
    from hifigrad._src import compat

    closed = jax.make_jaxpr(lambda *a: jax.tree.leaves(vjp_fn_of(*a)))(*args)
    jaxpr, _ = compat.jaxpr_and_consts(closed)
    invars = set(jaxpr.invars)
    seen: set = set()
    total = 0
    for v in jaxpr.outvars:
        if compat.is_literal(v) or v in invars or v in seen:
            continue
        seen.add(v)
        total += int(math.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize
    return total


def _flat64(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def gradient_sqnr_db(g: np.ndarray, g_ref: np.ndarray) -> float | None:
    """``10 log10(|g_ref|^2 / |g - g_ref|^2)`` in dB: inf if equal, None if ``g`` isn't finite."""
    if not np.all(np.isfinite(g)):
        return None
    err = float(np.sum(np.square(g - g_ref)))
    sig = float(np.sum(np.square(g_ref)))
    if err == 0.0:
        return math.inf
    return 10.0 * math.log10(sig / err)


def _optimizer(cfg: DemoConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, min(cfg.warmup_steps, max(cfg.steps - 1, 1)),
        max(cfg.steps, 2), end_value=cfg.learning_rate / 10)
    decay = {"tok_emb", "head", "qkv", "proj", "fc1", "fc2", "in_proj", "gate", "out_proj"}

    def mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: getattr(path[-1], "key", None) in decay, params)

    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                                   mask=mask))


def _make_update(tx: optax.GradientTransformation):
    """The optimizer half of a training step, shared by every mode (compiled once)."""

    def update(params, opt_state, grads, ok):
        # optax's AdamW mixes Python floats with its int32 step count, which strict dtype
        # promotion (as the test suite sets) rejects; the optimizer is traced with the standard
        # rules, the model and its gradients with whatever the caller set.
        with jax.numpy_dtype_promotion("standard"):
            updates, new_opt_state = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)

        def keep(new, old):  # a skipped (loss-scaled, non-finite) step changes nothing
            return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)

        return keep(new_params, params), keep(new_opt_state, opt_state)

    return update


def _environment() -> dict:
    dev = jax.devices()[0]
    import hifigrad

    return {"jax": jax.__version__, "python": platform.python_version(),
            "hifigrad": hifigrad.__version__, "backend": jax.default_backend(),
            "device": getattr(dev, "device_kind", str(dev)), "device_count": jax.device_count(),
            "platform": platform.platform(terse=True)}


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


# ------------------------------------------------------------------------------ run

def run(config: DemoConfig, reporter: Reporter | None = None) -> dict:
    """Trains every mode of ``config`` and returns the measurements (JSON-serialisable).

    A training step is the mode's compiled gradient function (``(params, state, batch) ->
    (loss, grads, state, ok)``) followed by the optimizer update, which is the same program for
    every mode and is compiled once. All programs are traced first, then compiled in parallel
    threads, then each mode is trained in turn (so step times are measured on a quiet machine).

    A mode whose hifigrad API is missing from this installation gets a row with
    ``status="skipped"`` and the reason; one that fails to trace, compile or run gets
    ``status="failed"`` and the error's first line, and the other modes still run.
    """
    rep = reporter or Reporter()
    cfg = config
    mcfg = cfg.model
    t_start = time.perf_counter()

    rep.stage("reading the standard library's source")
    corpus = D.load_corpus(cfg.corpus_bytes)
    train_np = D.sample_batches(corpus.train, cfg.steps, cfg.batch_size, cfg.seq_len, cfg.seed)
    val_np = D.sample_batches(corpus.val, cfg.val_batches, cfg.batch_size, cfg.seq_len,
                              cfg.seed + 1)
    model = MD.model_module(mcfg)
    params0 = model.init_params(cfg.seed, mcfg)
    put_batch = jnp.asarray
    if cfg.devices > 1:  # data parallel: batches split over a 1-D mesh, parameters replicated
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        mesh = Mesh(np.array(jax.devices()[:cfg.devices]), ("data",))
        params0 = jax.device_put(params0, NamedSharding(mesh, PartitionSpec()))

        def put_batch(b):
            return jax.device_put(b, NamedSharding(mesh, PartitionSpec("data")))

    train_batches = [put_batch(b) for b in train_np]
    val_batches = [put_batch(b) for b in val_np]
    tx = _optimizer(cfg)
    opt_state0 = jax.jit(tx.init)(params0)
    eval_steps = sorted({*range(0, cfg.steps, cfg.eval_every), cfg.steps - 1})
    batch0 = train_batches[0]

    rep.stage("tracing every mode")
    compiles = _Compiler(cfg.cpu_opt_level)
    update_job = compiles.submit(_make_update(tx), params0, opt_state0, params0,
                                 jnp.asarray(True))
    rows, jobs, built = [], {}, {}
    for name in dict.fromkeys(("f32", *cfg.modes)):
        mode = MD.get_mode(name)
        row = _base_row(mode)
        if name in cfg.modes:
            rep.mode_start(mode, cfg.steps)
            rows.append(row)
        try:
            fns = MD.build(mode, mcfg)
        except MD.MissingAPI as e:
            _stop(row, "skipped", e, rep)
            continue
        try:
            state0 = fns.init_state()
            if name in cfg.modes:
                row["residual_bytes"] = saved_residual_bytes(fns.vjp_for_memory, params0,
                                                             state0, batch0)
                row["block_residual_bytes"] = saved_residual_bytes(
                    fns.blocks_vjp_for_memory, params0, state0, _block_input(cfg, mode))
            job = compiles.submit(fns.value_and_grad, params0, state0, batch0)
        except Exception as e:  # a mode that cannot be traced is reported, the others run
            if name == "f32":
                raise
            _stop(row, "failed", e, rep)
            continue
        jobs[name] = (state0, job)
        built[name] = fns

    rep.stage("compiling")
    update = compiles.result(update_job)[0]
    ref_vg = compiles.result(jobs["f32"][1])[0]  # the f32 reference: gradients and val loss
    compiled = {}
    for row in rows:
        if row["status"] != "ok":
            continue
        try:
            compiled[row["name"]] = compiles.result(jobs[row["name"]][1])
        except Exception as e:
            _stop(row, "failed", e, rep)
            continue
        rep.mode_compiled(MD.get_mode(row["name"]), compiled[row["name"]][1])
    compiles.close()

    for row in rows:
        if row["status"] != "ok":
            continue
        mode = MD.get_mode(row["name"])
        vg, compile_s = compiled[mode.name]
        try:
            row.update(_train_mode(cfg, mode, vg, compile_s, update, jobs[mode.name][0],
                                   params0, opt_state0, train_batches, val_batches,
                                   eval_steps, ref_vg, rep))
        except Exception as e:  # e.g. a program XLA compiles but cannot run on this backend
            _stop(row, "failed", e, rep)
            continue
        rep.mode_end(mode, row)

    _add_gaps(rows, cfg.steps)
    sweep = None
    if cfg.sweep_lengths:
        rep.stage("gradient SQNR vs sequence length at the initial parameters (lengths "
                  f"{', '.join(map(str, cfg.sweep_lengths))})")
        at_seq_len = {name: vg for name, (vg, _) in compiled.items()}
        at_seq_len["f32"] = ref_vg
        sweep = _length_sweep(cfg, corpus, params0, rows, built,
                              {name: state0 for name, (state0, _) in jobs.items()}, put_batch,
                              at_seq_len, batch0)
    scale = None
    if cfg.task == "gpt" and any(_at_scale(n) for n in cfg.modes):
        rep.stage(f"compiling the compressed modes at scale ({SCALE.n_layers} blocks, d_model "
                  f"{SCALE.d_model}, batch {SCALE_BATCH} x {SCALE.seq_len}; compile-only)")
        scale = memory_at_scale([n for n in cfg.modes if _at_scale(n)
                                 and next(r for r in rows if r["name"] == n)["status"] == "ok"],
                                cfg.cpu_opt_level)
    update_mem = update.memory_analysis()
    remat_bf16 = saved_residual_bytes(MD.remat_blocks_vjp(mcfg), params0, {},
                                      _block_input(cfg, MD.get_mode("bf16")))
    remat_mem = jax.jit(MD.remat_value_and_grad(mcfg)).lower(
        params0, batch0).compile().memory_analysis()
    return {
        "config": dataclasses.asdict(cfg),
        "environment": _environment(),
        "corpus": corpus.describe(),
        "n_params": model.n_params(params0),
        "eval_steps": eval_steps,
        "modes": rows,
        "optimizer_temp_bytes": None if update_mem is None else int(
            update_mem.temp_size_in_bytes),
        "remat_bf16_block_residual_bytes": remat_bf16,
        "remat_bf16_temp_bytes": None if remat_mem is None else int(
            remat_mem.temp_size_in_bytes),
        "length_sweep": sweep,
        "memory_at_scale": scale,
        "wall_s": time.perf_counter() - t_start,
    }


def _at_scale(name: str) -> bool:
    """Whether mode ``name`` is in the comparison at scale: the modes whose scan over blocks
    saves its carry with a hifigrad codec (what `memory_at_scale` compares with the bf16
    jax.checkpoint scan)."""
    saved = MD.get_mode(name).saved
    return saved not in ("all", "fp8-seed")


def memory_at_scale(modes: Sequence[str], cpu_opt_level: int = 1,
                    model: M.ModelConfig = SCALE, batch_size: int = SCALE_BATCH) -> dict:
    """Peak temp of one training step of each mode in ``modes`` and of the bf16
    `jax.checkpoint` scan (`modes.remat_value_and_grad`), on the GPT ``model`` with a batch of
    ``batch_size``: ``jax.jit(step).lower(shapes).compile().memory_analysis()``, from shapes
    only (nothing is trained or allocated), compiled in parallel.

    Returns ``{"model", "batch_size", "remat_bf16_temp_bytes", "temp_bytes": {mode: bytes},
    "compile_s"}``; a byte count is None where the backend reports no memory analysis.
    """
    t0 = time.perf_counter()
    params = jax.eval_shape(lambda: M.init_params(0, model))
    batch = jax.ShapeDtypeStruct((batch_size, model.seq_len + 1), jnp.int32)
    compiles = _Compiler(cpu_opt_level)
    ref_job = compiles.submit(MD.remat_value_and_grad(model), params, batch)
    jobs = {}
    for name in modes:
        fns = MD.build(MD.get_mode(name), model)
        jobs[name] = compiles.submit(fns.value_and_grad, params, fns.init_state(), batch)

    def temp(job):
        mem = compiles.result(job)[0].memory_analysis()
        return None if mem is None else int(mem.temp_size_in_bytes)

    out = {"model": dataclasses.asdict(model), "batch_size": batch_size,
           "remat_bf16_temp_bytes": temp(ref_job),
           "temp_bytes": {name: temp(job) for name, job in jobs.items()}}
    compiles.close()
    out["compile_s"] = time.perf_counter() - t0
    return out


def _length_sweep(cfg: DemoConfig, corpus, params0, rows, built, states, put_batch,
                  at_seq_len, batch0) -> dict:
    """Gradient SQNR vs f32 of every trained mode at the initial parameters, on one batch of
    each length in ``cfg.sweep_lengths`` and of the training length (the recurrent model takes
    any length).

    At the training length the sweep reuses the compiled training programs (``at_seq_len``)
    and the first training batch; other lengths get their own programs and one batch from the
    training split with their own seed (``seed + 2``). A mode whose gradient is not finite (for
    example a loss-scaled fp16 step that overflowed) gets None at that length.
    """
    names = [r["name"] for r in rows if r["status"] == "ok" and r["name"] != "f32"]
    lengths = sorted({*cfg.sweep_lengths, cfg.seq_len})
    compiles = _Compiler(cfg.cpu_opt_level)
    jobs = {}
    batches = {cfg.seq_len: batch0}
    for n in lengths:
        if n == cfg.seq_len:
            continue
        batches[n] = put_batch(D.sample_batches(corpus.train, 1, cfg.batch_size, n,
                                                cfg.seed + 2)[0])
        for name in ("f32", *names):
            jobs[name, n] = compiles.submit(built[name].value_and_grad, params0, states[name],
                                            batches[n])

    def program(name, n):
        return at_seq_len[name] if n == cfg.seq_len else compiles.result(jobs[name, n])[0]

    out = {"lengths": lengths, "batch_size": cfg.batch_size,
           "sqnr_db": {name: [] for name in names},
           "lost_grad_frac": {name: [] for name in names}}
    for n in lengths:
        g_ref = _flat64(program("f32", n)(params0, states["f32"], batches[n])[1])
        for name in names:
            try:
                vg = program(name, n)
                _, grads, _, ok = vg(params0, states[name], batches[n])
            except Exception:  # as in training: a failure is that mode's, not the run's
                out["sqnr_db"][name].append(None)
                out["lost_grad_frac"][name].append(None)
                continue
            g = _flat64(grads)
            s = gradient_sqnr_db(g, g_ref) if bool(ok) else None
            out["sqnr_db"][name].append(_finite_or_none(s))
            out["lost_grad_frac"][name].append(float(np.mean((g == 0) & (g_ref != 0))))
    compiles.close()
    return out


class _Compiler:
    """Traces and lowers in the calling thread, compiles in a small thread pool (XLA releases
    the GIL while compiling). ``result(job)`` is ``(compiled, seconds)``, where seconds covers
    tracing, lowering and compiling (compiles overlap, so they can read a little long)."""

    def __init__(self, cpu_opt_level: int):
        workers = max(1, min(4, os.cpu_count() or 1))
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, "hifigrad-demo-compile")
        self.options = None
        if jax.default_backend() == "cpu":
            self.options = {"xla_backend_optimization_level": cpu_opt_level}

    def submit(self, fun, *args):
        t = time.perf_counter()
        lowered = jax.jit(fun).lower(*args)
        trace_s = time.perf_counter() - t

        def compile_():
            t = time.perf_counter()
            return lowered.compile(compiler_options=self.options), \
                trace_s + time.perf_counter() - t

        return self.pool.submit(compile_)

    @staticmethod
    def result(job):
        return job.result()

    def close(self):
        self.pool.shutdown()


def _stop(row: dict, status: str, err: Exception, rep: Reporter) -> None:
    """Marks a mode as skipped or failed, with a one-line reason."""
    lines = str(err).strip().splitlines()
    reason = lines[0] if lines else ""
    if status == "failed":
        reason = f"{type(err).__name__}: {reason}"
    row.update(status=status, reason=reason)
    rep.mode_end(MD.get_mode(row["name"]), row)


def _block_input(cfg: DemoConfig, mode: MD.Mode) -> jax.Array:
    return jnp.zeros((cfg.batch_size, cfg.seq_len, cfg.d_model), mode.dtype)


def _base_row(mode: MD.Mode) -> dict:
    return {"name": mode.name, "label": mode.label, "description": mode.description,
            "dtype": np.dtype(mode.dtype).name, "grad": mode.grad, "saved": mode.saved,
            "counterpart": mode.counterpart, "status": "ok", "reason": None}


def _train_mode(cfg, mode, vg, compile_s, update, state0, params0, opt_state0, train_batches,
                val_batches, eval_steps, ref_vg, rep) -> dict:
    mem = vg.memory_analysis()
    temp_bytes = int(mem.temp_size_in_bytes) if mem is not None else None
    params, opt_state, state = params0, opt_state0, state0
    losses, times, sqnr, zero_frac, skipped = [], [], [], [], 0
    for i, batch in enumerate(train_batches):
        t = time.perf_counter()
        loss, grads, state, ok = vg(params, state, batch)
        new_params, opt_state = jax.block_until_ready(update(params, opt_state, grads, ok))
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
        skipped += not bool(ok)
        if i in eval_steps:
            g, g_ref = _flat64(grads), _flat64(ref_vg(params, {}, batch)[1])
            sqnr.append(gradient_sqnr_db(g, g_ref))
            zero_frac.append(float(np.mean((g == 0) & (g_ref != 0))))
        params = new_params
        rep.mode_step(mode, i)

    val = float(np.mean([float(ref_vg(params, {}, b)[0]) for b in val_batches]))
    timed = times[1:] if len(times) > 1 else times  # the first step's time includes warm-up
    finite_sqnr = [s for s in sqnr if s is not None and math.isfinite(s)]
    out = {
        "losses": [_finite_or_none(x) for x in losses],
        "val_loss": _finite_or_none(val),
        "sqnr_db": [None if s is None else (s if math.isfinite(s) else "inf") for s in sqnr],
        "sqnr_step0_db": _finite_or_none(sqnr[0]),
        "sqnr_mean_db": _finite_or_none(statistics.fmean(finite_sqnr)) if finite_sqnr else None,
        "lost_grad_frac_step0": zero_frac[0],
        "step_ms": 1e3 * statistics.median(timed),
        "step_ms_quartiles": [1e3 * float(q) for q in np.percentile(timed, [25, 75])],
        "compile_s": compile_s,
        "temp_bytes": temp_bytes,
        "skipped_steps": skipped,
    }
    if mode.loss_scaling:
        out["final_loss_scale"] = float(state["scale"])
    return out


def _tail_mean(losses: Sequence[float | None], n: int) -> float | None:
    tail = losses[-n:]
    if any(x is None for x in tail):
        return None
    return statistics.fmean(tail)


def _add_gaps(rows: list[dict], steps: int) -> None:
    """Final loss (mean of the last 10% of steps) and its gap to the f32 reference; mean
    absolute gap of the loss curves over all steps."""
    n = max(1, steps // 10)
    ref = next((r for r in rows if r["name"] == "f32" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] != "ok":
            continue
        r["final_loss"] = _tail_mean(r["losses"], n)
        r["final_gap"] = r["mean_abs_gap"] = None
        if ref is None or r is ref:
            continue
        ref_final = _tail_mean(ref["losses"], n)
        if r["final_loss"] is not None and ref_final is not None:
            r["final_gap"] = r["final_loss"] - ref_final
        pairs = list(zip(r["losses"], ref["losses"]))
        if all(a is not None and b is not None for a, b in pairs):
            r["mean_abs_gap"] = statistics.fmean(abs(a - b) for a, b in pairs)


def describe_platform() -> str:
    """One line naming the JAX backend and device."""
    env = _environment()
    return (f"JAX {env['jax']} on {env['backend']} ({env['device']}, {env['device_count']} "
            f"device{'s' if env['device_count'] > 1 else ''}), Python {sys.version.split()[0]}")
