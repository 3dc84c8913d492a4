"""`fidelity_report`: how much precision a user's low-precision backward loses, and where.

One call differentiates the user's loss three times, on the same parameters and inputs:

* the *reference*: every float leaf of ``params`` and ``args`` cast to float32, `jax.grad`;
* ``jax.grad`` at ``dtype``: the float leaves cast to ``dtype`` (bf16, fp16, ...), so the model
  computes at ``dtype`` and JAX runs its backward at ``dtype`` too;
* ``hg.grad`` at ``dtype``: the same forward, hifigrad's float32 backward.

and compares each low-precision gradient with the reference, leaf by leaf (named by pytree
path) and over all leaves together: SQNR, cosine similarity, normwise maximum relative error,
and the fractions of entries that are zero, and that underflowed (zero where the reference is
not). hifigrad's backward is exact over the forward's residuals, so the error left in the
``hg.grad`` column is the low-precision forward's own share, which no backward can remove; the
difference between the two columns is what the backward's precision costs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import (
    DictKey,
    FlattenedIndexKey,
    GetAttrKey,
    SequenceKey,
    tree_flatten_with_path,
    tree_unflatten,
)

from .api import value_and_grad as hg_value_and_grad
from .policy import Policy

__all__ = ["FidelityReport", "GradientFidelity", "LeafFidelity", "fidelity_report"]

# The two low-precision gradients a report compares with the float32 reference.
METHODS = ("jax", "hg")
_METHOD_LABEL = {"jax": "jax.grad", "hg": "hg.grad"}


@dataclasses.dataclass(frozen=True)
class GradientFidelity:
    """One gradient (a leaf, or all leaves together) compared with the float32 reference.

    Attributes:
      sqnr_db: ``10 log10(|ref|^2 / |g - ref|^2)`` in dB (``inf``: identical; ``nan``: ``g`` is
        not finite; ``-inf``: the reference is zero and ``g`` is not).
      cosine: cosine similarity of ``g`` and ``ref`` (``nan`` if either is zero or ``g`` is not
        finite).
      max_rel_err: ``max |g - ref| / max |ref|``, the normwise maximum relative error.
      zero_frac: fraction of entries of ``g`` that are exactly zero.
      underflow_frac: fraction of entries that are zero in ``g`` but not in the reference.
    """

    sqnr_db: float
    cosine: float
    max_rel_err: float
    zero_frac: float
    underflow_frac: float


@dataclasses.dataclass(frozen=True)
class LeafFidelity:
    """One parameter leaf: its path, shape, and each method's `GradientFidelity`."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    ref_zero_frac: float
    jax: GradientFidelity
    hg: GradientFidelity

    @property
    def gain_db(self) -> float:
        """``hg.sqnr_db - jax.sqnr_db``: what the float32 backward recovers on this leaf."""
        return _gain(self.hg.sqnr_db, self.jax.sqnr_db)


@dataclasses.dataclass(frozen=True)
class FidelityReport:
    """What `fidelity_report` returns.

    Attributes:
      dtype: the low-precision compute dtype (``"bfloat16"``, ...).
      leaves: one `LeafFidelity` per differentiated leaf, sorted worst first (lowest
        ``jax.grad`` SQNR; ties by path).
      total: all leaves concatenated (path ``"(all)"``).
      loss: the loss value of each run: ``{"f32": ..., "jax": ..., "hg": ...}``.
      verdict: one sentence summing up the report.
    """

    dtype: str
    leaves: tuple[LeafFidelity, ...]
    total: LeafFidelity
    loss: dict[str, float]
    verdict: str

    def to_dict(self) -> dict:
        """A plain dict (JSON-serialisable apart from non-finite floats)."""
        return dataclasses.asdict(self)

    def table(self, max_rows: int | None = 20):
        """The report as a `rich.table.Table`: the worst ``max_rows`` leaves, then the total."""
        from rich.table import Table

        t = Table(title=f"Gradient fidelity vs float32, {self.dtype} forward", title_justify="left",
                  caption=self.verdict, caption_justify="left")
        t.add_column("leaf", justify="left", overflow="fold")
        t.add_column("shape", justify="right")
        for m in METHODS:
            t.add_column(f"{_METHOD_LABEL[m]} SQNR dB", justify="right")
        t.add_column("gain dB", justify="right")
        for m in METHODS:
            t.add_column(f"{_METHOD_LABEL[m]} cos", justify="right")
        for m in METHODS:
            t.add_column(f"{_METHOD_LABEL[m]} max rel", justify="right")
        for m in METHODS:
            t.add_column(f"{_METHOD_LABEL[m]} underflow", justify="right")
        shown = self.leaves if max_rows is None else self.leaves[:max_rows]
        for leaf in shown:
            t.add_row(*_cells(leaf))
        if len(shown) < len(self.leaves):
            t.add_row(f"... {len(self.leaves) - len(shown)} more leaves", *[""] * 10)
        t.add_section()
        t.add_row(*_cells(self.total), style="bold")
        return t

    def print(self, console=None, max_rows: int | None = 20) -> None:
        """Prints `table` (which ends with the verdict) to ``console`` (a new `rich` console
        by default)."""
        if console is None:
            from rich.console import Console

            console = Console()
        console.print(self.table(max_rows))


def _gain(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b) or (math.isinf(a) and math.isinf(b) and a == b):
        return math.nan
    return a - b


def _fmt(x: float, fmt: str) -> str:
    if math.isnan(x):
        return "—"
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    return format(x, fmt)


def _cells(leaf: LeafFidelity) -> list[str]:
    shape = "×".join(map(str, leaf.shape)) or "scalar"
    fid = [getattr(leaf, m) for m in METHODS]
    sqnr = ["non-finite" if math.isnan(f.sqnr_db) and math.isnan(f.cosine) else
            _fmt(f.sqnr_db, ".1f") for f in fid]
    return ([leaf.path, shape, *sqnr, _fmt(leaf.gain_db, "+.1f")]
            + [_fmt(f.cosine, ".6f") for f in fid]
            + [_fmt(f.max_rel_err, ".2g") for f in fid]
            + [_fmt(f.underflow_frac, ".2%") for f in fid])


# ------------------------------------------------------------------------------ measuring

def gradient_fidelity(g: np.ndarray, ref: np.ndarray) -> GradientFidelity:
    """Compares gradient ``g`` with ``ref`` (any shapes of equal size), in float64."""
    g = np.asarray(g, np.float64).ravel()
    ref = np.asarray(ref, np.float64).ravel()
    finite = bool(np.all(np.isfinite(g)))
    zero = float(np.mean(g == 0)) if g.size else 0.0
    under = float(np.mean((g == 0) & (ref != 0))) if g.size else 0.0
    if not finite:
        return GradientFidelity(math.nan, math.nan, math.nan, zero, under)
    err = float(np.sum(np.square(g - ref)))
    sig = float(np.sum(np.square(ref)))
    if err == 0.0:
        sqnr = math.inf
    elif sig == 0.0:
        sqnr = -math.inf
    else:
        sqnr = 10.0 * math.log10(sig / err)
    norms = float(np.linalg.norm(g)) * math.sqrt(sig)
    cosine = float(np.dot(g, ref)) / norms if norms > 0 else math.nan
    ref_max = float(np.max(np.abs(ref))) if ref.size else 0.0
    err_max = float(np.max(np.abs(g - ref))) if g.size else 0.0
    if err_max == 0.0:
        rel = 0.0
    else:
        rel = err_max / ref_max if ref_max > 0 else math.inf
    return GradientFidelity(sqnr, cosine, rel, zero, under)


def _key_name(k) -> str:
    if isinstance(k, DictKey):
        return str(k.key)
    if isinstance(k, GetAttrKey):
        return k.name
    if isinstance(k, SequenceKey):
        return str(k.idx)
    if isinstance(k, FlattenedIndexKey):
        return str(k.key)
    return str(k)


def _path_name(path) -> str:
    names = [_key_name(k) for k in path]
    # Flax NNX keeps each array in a Variable whose own pytree key is ``value``: leave it off.
    if len(names) > 1 and names[-1] in ("value", "raw_value") and isinstance(path[-1],
                                                                             GetAttrKey):
        names = names[:-1]
    return "/".join(names) or "(root)"


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _check_dtype(dtype) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype must be a floating dtype less precise than float32, such as "
                         f"jnp.bfloat16 or jnp.float16; got {dtype!r}.") from None
    if not jnp.issubdtype(dt, jnp.floating) or jnp.finfo(dt).nmant >= jnp.finfo(jnp.float32).nmant:
        raise ValueError(
            f"dtype must be a floating dtype less precise than float32, such as jnp.bfloat16 or "
            f"jnp.float16; got {dt}. The reference is the float32 model, so dtype={dt} has "
            f"nothing to compare.")
    return dt


def _cast_floats(tree, dtype):
    """Casts every float array leaf of ``tree`` to ``dtype``; other leaves are kept."""
    def cast(x):
        if _is_array(x) and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(x).astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def _split_params(params):
    """(flat leaves with paths, treedef, indices of the differentiated leaves).

    Float arrays are differentiated; non-array leaves (an equinox module's functions and
    Python scalars, for example) are held fixed; a non-float array is an error.
    """
    flat, treedef = tree_flatten_with_path(params)
    diff = []
    for i, (path, x) in enumerate(flat):
        if not _is_array(x):
            continue
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"params leaf {_path_name(path)!r} has dtype {x.dtype}; fidelity_report "
                f"differentiates every array leaf of params, so they must be floating point. "
                f"Pass integer or boolean arrays through *args instead (for an equinox module, "
                f"split it with eqx.partition(model, eqx.is_inexact_array)).")
        diff.append(i)
    if not diff:
        raise ValueError("params has no floating-point array leaves: there is nothing to "
                         "differentiate (pass the parameters as the second argument).")
    return flat, treedef, diff


def _checked_loss(loss_fn, params, args, dt, where: str):
    """Runs ``jax.eval_shape`` of the loss and checks it returns a real scalar."""
    try:
        out = jax.eval_shape(loss_fn, params, *args)
    except (TypeError, jax.dtypes.TypePromotionError) as e:
        raise TypeError(
            f"loss_fn failed when run {where}: {str(e).splitlines()[0] if str(e) else e!r}. "
            f"fidelity_report casts every float leaf of params and args to that dtype; a model "
            f"that mixes them with arrays of another float dtype must cast those itself (or "
            f"pass cast_args=False to keep args as they are).") from e
    if not (hasattr(out, "shape") and hasattr(out, "dtype")):
        raise TypeError(
            f"loss_fn must return a scalar array; it returned {type(out).__name__} when run "
            f"{where}. (A loss with auxiliary outputs: wrap it, e.g. lambda *a: loss_fn(*a)[0].)")
    if out.shape != () or not jnp.issubdtype(out.dtype, jnp.floating):
        raise TypeError(
            f"loss_fn must return a real floating-point scalar; it returned "
            f"{out.dtype}{list(out.shape)} when run {where}. Reduce it to one number "
            f"(e.g. jnp.mean) before calling fidelity_report.")


def fidelity_report(loss_fn: Callable, params: Any, *args, dtype=jnp.bfloat16,
                    policy: Policy | None = None, cast_args: bool = True, jit: bool = True,
                    show: bool = True, console=None, max_rows: int | None = 20
                    ) -> FidelityReport:
    """How much precision the low-precision backward of ``loss_fn`` loses, per parameter leaf.

    Runs ``loss_fn(params, *args)`` three times: with every float leaf of ``params`` (and of
    ``args``, unless ``cast_args=False``) cast to float32 under `jax.grad` (the reference), and
    cast to ``dtype`` under `jax.grad` and under `hifigrad.grad`; then compares both
    low-precision gradients with the reference, leaf by leaf. ``loss_fn`` should compute in the
    dtype of its parameters (as Flax, equinox and plain JAX models do when their parameters are
    cast).

    Works with any pytree of parameters: Flax linen ``params``, an NNX ``State`` (from
    ``nnx.split``: ``loss_fn(state, ...)`` calls ``nnx.merge``), an equinox module (its float
    array leaves are differentiated, other leaves held fixed) or a dict of arrays.

    Args:
      loss_fn: ``loss_fn(params, *args) -> scalar``.
      params: the parameters; every array leaf must be floating point.
      *args: the other inputs (batches, targets); integer leaves are never cast.
      dtype: the low-precision compute dtype (bf16, fp16, an fp8 type).
      policy: the `hifigrad.Policy` of the ``hg.grad`` run (default ``Policy()``).
      cast_args: cast the float leaves of ``args`` too (default True).
      jit: compile each of the three gradients with `jax.jit` (default True).
      show: print the table and verdict (default True).
      console: the `rich.console.Console` to print to (a new one by default).
      max_rows: how many leaves the printed table shows (None: all).

    Returns:
      A `FidelityReport`.

    Raises:
      ValueError: ``dtype`` is not a float dtype narrower than float32; ``params`` has no float
        array leaves.
      TypeError: a non-float array leaf in ``params``; ``loss_fn`` does not return a real
        scalar, or fails when its inputs are cast.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> r = hg.fidelity_report(lambda p, x: jnp.sum(jnp.tanh(x @ p["w"])),
      ...                        {"w": jnp.ones((4, 2))}, jnp.ones((3, 4)), show=False)
      >>> [leaf.path for leaf in r.leaves], r.dtype
      (['w'], 'bfloat16')
    """
    dt = _check_dtype(dtype)
    flat, treedef, diff = _split_params(params)
    paths = [_path_name(flat[i][0]) for i in diff]
    leaves = [flat[i][1] for i in diff]

    def loss_of_leaves(diff_leaves, *a):
        full = [x for _, x in flat]
        for i, x in zip(diff, diff_leaves):
            full[i] = x
        return loss_fn(tree_unflatten(treedef, full), *a)

    def inputs(to):
        cast_leaves = [jnp.asarray(x).astype(to) for x in leaves]
        return cast_leaves, (_cast_floats(args, to) if cast_args else args)

    ref_leaves, ref_args = inputs(jnp.float32)
    low_leaves, low_args = inputs(dt)
    _checked_loss(loss_of_leaves, ref_leaves, ref_args, jnp.float32, "with float32 inputs")
    _checked_loss(loss_of_leaves, low_leaves, low_args, dt, f"with {dt} inputs")

    wrap = jax.jit if jit else (lambda f: f)
    ref_vg = wrap(jax.value_and_grad(loss_of_leaves))
    jax_vg = wrap(jax.value_and_grad(loss_of_leaves))
    hg_vg = wrap(hg_value_and_grad(loss_of_leaves, policy=policy))

    loss_ref, g_ref = ref_vg(ref_leaves, *ref_args)
    loss_jax, g_jax = jax_vg(low_leaves, *low_args)
    loss_hg, g_hg = hg_vg(low_leaves, *low_args)
    g_ref = [np.asarray(g, np.float64) for g in g_ref]
    grads = {"jax": [np.asarray(g.astype(jnp.float32), np.float64) for g in g_jax],
             "hg": [np.asarray(g, np.float64) for g in g_hg]}

    rows = []
    for k, (path, r) in enumerate(zip(paths, g_ref)):
        rows.append(LeafFidelity(
            path=path, shape=tuple(int(s) for s in r.shape), dtype=str(np.dtype(leaves[k].dtype)),
            ref_zero_frac=float(np.mean(r == 0)) if r.size else 0.0,
            jax=gradient_fidelity(grads["jax"][k], r), hg=gradient_fidelity(grads["hg"][k], r)))
    cat = np.concatenate([r.ravel() for r in g_ref])
    total = LeafFidelity(
        path="(all)", shape=(int(cat.size),), dtype="",
        ref_zero_frac=float(np.mean(cat == 0)) if cat.size else 0.0,
        **{m: gradient_fidelity(np.concatenate([g.ravel() for g in grads[m]]), cat)
           for m in METHODS})
    rows.sort(key=lambda r: (_sort_key(r.jax.sqnr_db), r.path))
    report = FidelityReport(
        dtype=str(dt), leaves=tuple(rows), total=total,
        loss={"f32": float(loss_ref), "jax": float(loss_jax), "hg": float(loss_hg)},
        verdict=_verdict(str(dt), rows, total))
    if show:
        report.print(console, max_rows)
    return report


def _sort_key(sqnr: float) -> float:
    return -math.inf if math.isnan(sqnr) else sqnr


def _verdict(dt: str, rows: list[LeafFidelity], total: LeafFidelity) -> str:
    """One sentence: where the low-precision backward loses most, and what hg.grad recovers."""
    j, h = total.jax.sqnr_db, total.hg.sqnr_db
    if math.isnan(j):
        bad = [r.path for r in rows if math.isnan(r.jax.sqnr_db)]
        tail = (f"hg.grad's is finite ({_fmt(h, '.1f')} dB over all leaves)"
                if not math.isnan(h) else "so is hg.grad's")
        return (f"{dt} jax.grad's gradient is not finite on {len(bad)} leaves (first: "
                f"{bad[0]}); {tail}.")
    gains = [r for r in rows if not math.isnan(r.gain_db)]
    worst = max(gains, key=lambda r: r.gain_db) if gains else None
    overall = (f"over all leaves jax.grad {_fmt(j, '.1f')} dB, hg.grad {_fmt(h, '.1f')} dB vs "
               f"the float32 model")
    if worst is None or worst.gain_db < 1.0:
        return (f"{dt} backward loses under 1 dB on every leaf ({overall}): the {dt} forward's "
                f"own rounding sets the limit here, and hg.grad changes little.")
    under = ""
    if worst.jax.underflow_frac > 0.01:
        under = f", {worst.jax.underflow_frac:.0%} of its entries underflowed to zero"
    return (f"{dt} backward loses {worst.gain_db:.1f} dB on {worst.path} (jax.grad "
            f"{_fmt(worst.jax.sqnr_db, '.1f')} dB vs hg.grad {_fmt(worst.hg.sqnr_db, '.1f')} dB"
            f"{under}); hg.grad's float32 backward recovers that, and what it leaves is the {dt} "
            f"forward's share ({overall}).")
