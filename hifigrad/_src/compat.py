"""Every touch of JAX internals (`jax._src`) and every JAX-version difference lives here.

The JAX releases hifigrad is tested with are `TESTED_JAX` (CI runs each of them); the package
metadata admits the same minor series. Each difference between those releases is named once, by the
feature JAX changed, and decided by evidence from the installed JAX (a probe of a signature, a
param or a registry), never by comparing version numbers:

- *Closed jaxprs* (jax 0.11): `ClosedJaxpr` merged into `Jaxpr`, which carries its own consts.
  `jaxpr_and_consts` reads either form.
- *Scan's flat-tree params* (jax 0.11): `num_consts` / `num_carry` became `ft_in` / `ft_out`.
  `scan_split` reads either.
- *Backward-pass logs* (jax 0.11.1, `custom_vjp.defvjp_with_logs`): a `custom_lin` equation's
  `bwd` returns `(cts_in, logs)`. `bwd_returns_logs` probes it; `custom_lin_call_bwd` and
  `wrap_bwd` speak the installed protocol.
- *Hi-primitives* (jax 0.12, `call_hi_primitive`): `hi_primitive_at` rebuilds them.

When one of these assumptions fails on a JAX release nobody tested (a param renamed, a rule's
result shaped differently), the code that relies on it runs inside `assumption(...)`, which turns
the bare error from deep inside JAX into a `JaxCompatibilityError` naming hifigrad, the installed
JAX, the tested releases and what failed. A JAX outside the tested range also gets one
`UntestedJaxWarning` at import (`check_jax_version`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend  # noqa: F401  (jax.extend must be imported explicitly)
import numpy as np
from jax._src import ad_util as _ad_util
from jax._src import core as _core
from jax._src import custom_derivatives as _custom_derivatives
from jax._src import linear_util as _lu
from jax._src import source_info_util as _source_info_util
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe


def _parse_version(v: str) -> tuple[int, ...]:
    import re

    out = []
    for p in v.split("."):
        m = re.match(r"\d+", p)
        if m is None:  # "dev20261201" ends the release number
            break
        out.append(int(m.group()))
        if m.end() != len(p):  # "0rc1" ends it too
            break
    return tuple(out)


JAX_VERSION: tuple[int, ...] = _parse_version(jax.__version__)

# The JAX releases CI tests (`.ci/run`, one constraints file each under `ci/`). Keep in step with
# `pyproject.toml`'s jax requirement and the README's support table.
TESTED_JAX: tuple[str, ...] = ("0.10.2", "0.11.0", "0.11.1", "0.11.2", "0.12.0", "0.12.0.1",
                               "0.12.1")


def tested_range() -> str:
    return f"jax {TESTED_JAX[0]} to {TESTED_JAX[-1]}"


class JaxCompatibilityError(RuntimeError):
    """An assumption hifigrad makes about JAX's internals does not hold for the installed JAX.

    The message names the installed JAX, the releases hifigrad is tested with and what failed.
    Installing a tested JAX release (``pip install 'jax==<release>'``) is the fix; please report
    the message if you need the installed one.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> try:
      ...     g = hg.grad(lambda x: (x * x).sum())(jnp.ones(2, jnp.bfloat16))
      ... except hg.JaxCompatibilityError as e:     # only where a JAX internal has changed
      ...     print(e)                              # hifigrad, the JAX, the tested releases
      >>> issubclass(hg.JaxCompatibilityError, RuntimeError)
      True
    """


class UntestedJaxWarning(UserWarning):
    """The installed JAX is outside the releases hifigrad is tested with.

    Warned once, when `hifigrad` is imported. hifigrad may still work; if one of its
    assumptions about JAX's internals fails, it raises `JaxCompatibilityError`.

    Examples:
      >>> import warnings, hifigrad as hg
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("ignore", hg.UntestedJaxWarning)
      ...     import hifigrad                       # only the first import warns
      >>> issubclass(hg.UntestedJaxWarning, UserWarning)
      True
    """


def _compat_message(what: str, cause: BaseException | None = None) -> str:
    msg = (f"hifigrad could not {what} with jax {jax.__version__} (jaxlib "
           f"{_jaxlib_version()}): an assumption about JAX internals failed. hifigrad is tested "
           f"with {tested_range()} ({', '.join(TESTED_JAX)}); install one of those, e.g. "
           f"pip install 'jax=={TESTED_JAX[-1]}'.")
    if cause is not None:
        msg += f" What failed: {type(cause).__name__}: {cause}"
    return msg


def _jaxlib_version() -> str:
    try:
        import jaxlib

        return jaxlib.__version__
    except Exception:  # noqa: BLE001
        return "unknown"


@contextlib.contextmanager
def assumption(what: str):
    """Runs code that relies on a JAX internal; an error inside becomes a JaxCompatibilityError.

    Only hifigrad's own reading of JAX internals goes inside: never a call into user code, whose
    errors must reach the user as they are.
    """
    try:
        yield
    except JaxCompatibilityError:
        raise
    except (AttributeError, AssertionError, IndexError, KeyError, TypeError, ValueError) as e:
        raise JaxCompatibilityError(_compat_message(what, e)) from e


def clear_tracing_caches() -> None:
    """Empties JAX's staging caches (traced jaxprs, lowered programs: `jax._src.util`'s
    caches), so that a function traced before is traced again and its Python runs. A scan body
    (`lax.scan`'s traced body is cached by function) would otherwise be reused without
    calling it. The compiled executables of jitted functions stay (their C++ caches are not
    touched): their next call with the same arguments does not compile again. Where the
    installed JAX has no such function, `jax.clear_caches()` (which also drops those)."""
    try:
        from jax._src import util as _util

        clear = _util.clear_all_caches
    except (ImportError, AttributeError):
        clear = jax.clear_caches
    clear()


def check_jax_version(warn: bool = True) -> bool:
    """Whether the installed JAX lies inside the tested range; warns once if not."""
    lo, hi = _parse_version(TESTED_JAX[0]), _parse_version(TESTED_JAX[-1])
    inside = lo <= JAX_VERSION <= hi
    if not inside and warn:
        warnings.warn(
            f"hifigrad is tested with {tested_range()} ({', '.join(TESTED_JAX)}); the installed "
            f"jax is {jax.__version__}. It may work; if an internal of JAX changed, hifigrad "
            f"raises hifigrad.JaxCompatibilityError naming what failed.",
            UntestedJaxWarning, stacklevel=3)
    return inside


Literal = _core.Literal
Var = _core.Var
DropVar = _core.DropVar
Primitive = _core.Primitive
ShapedArray = _core.ShapedArray


# --------------------------------------------------------------------------------------------
# Primitives, looked up once. A missing one (renamed in some JAX version) is None.
# --------------------------------------------------------------------------------------------

def _find(module_path: str, name: str):
    import importlib

    try:
        return getattr(importlib.import_module(module_path), name)
    except (ImportError, AttributeError):
        return None


scan_p = _find("jax._src.lax.control_flow.loops", "scan_p")
while_p = _find("jax._src.lax.control_flow.loops", "while_p")
cond_p = _find("jax._src.lax.control_flow.conditionals", "cond_p")
pjit_p = _find("jax._src.pjit", "jit_p") or _find("jax._src.pjit", "pjit_p")
remat_p = _find("jax._src.ad_checkpoint", "remat_p")
custom_jvp_call_p = _find("jax._src.custom_derivatives", "custom_jvp_call_p")
custom_vjp_call_p = _find("jax._src.custom_derivatives", "custom_vjp_call_p")
custom_lin_p = _ad.custom_lin_p
closed_call_p = _find("jax._src.core", "closed_call_p")
linear_call_p = _find("jax._src.custom_derivatives", "linear_call_p")
linear_solve_p = _find("jax._src.lax.control_flow.solves", "linear_solve_p")
shard_map_p = _find("jax._src.shard_map", "shard_map_p")
pure_callback_p = _find("jax._src.callback", "pure_callback_p")
io_callback_p = _find("jax._src.callback", "io_callback_p")
debug_callback_p = _find("jax._src.debugging", "debug_callback_p")
debug_print_p = _find("jax._src.debugging", "debug_print_p")  # jax.debug.print
add_jaxvals_p = _ad.add_jaxvals_p
sharding_constraint_p = _find("jax._src.pjit", "sharding_constraint_p")
mesh_cast_p = _find("jax._src.pjit", "mesh_cast_p")
reshard_p = _find("jax._src.pjit", "reshard_p")
device_put_p = _find("jax._src.dispatch", "device_put_p")
copy_p = _find("jax._src.lax.lax", "copy_p")
optimization_barrier_p = _find("jax._src.lax.lax", "optimization_barrier_p")
select_and_gather_add_p = _find("jax._src.lax.windowed_reductions", "select_and_gather_add_p")
select_and_scatter_add_p = _find("jax._src.lax.windowed_reductions", "select_and_scatter_add_p")
reduce_window_sum_p = _find("jax._src.lax.windowed_reductions", "reduce_window_sum_p")
cumsum_p = _find("jax._src.lax.control_flow.loops", "cumsum_p") or _find(
    "jax._src.lax.other", "cumsum_p")
psum_p = _find("jax._src.lax.parallel", "psum_p")
pvary_p = _find("jax._src.lax.parallel", "pvary_p") or _find("jax._src.core", "pvary_p")
pcast_p = _find("jax._src.lax.parallel", "pcast_p")
pbroadcast_p = _find("jax._src.lax.parallel", "pbroadcast_p")
call_hi_primitive_p = _find("jax._src.hijax", "call_hi_primitive_p")  # jax >= 0.12
name_p = _find("jax._src.ad_checkpoint", "name_p")  # jax.ad_checkpoint.checkpoint_name
stop_gradient_p = _find("jax._src.ad_util", "stop_gradient_p")
_REF_PRIMITIVES = frozenset(p for p in (
    _find("jax._src.core", "ref_p"), _find("jax._src.core", "empty_ref_p"),
    _find("jax._src.state.primitives", "get_p"), _find("jax._src.state.primitives", "swap_p"),
    _find("jax._src.state.primitives", "addupdate_p")) if p is not None)


def _uses_refs(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive in _REF_PRIMITIVES:
            return True
        if any(_uses_refs(jaxpr_and_consts(j)[0]) for j in jaxprs_in_params(eqn.params)):
            return True
    return False


from jax._src.shard_map import shard_map as _shard_map  # noqa: E402


def shard_map_call(fun: Callable, params: dict, args: Sequence[Any]) -> list[Any]:
    """Re-traces a shard_map equation's body `fun` with the equation's mesh and specs."""
    sm = _shard_map(fun, mesh=params["mesh"], in_specs=tuple(params["in_specs"]),
                    out_specs=tuple(params["out_specs"]),
                    axis_names=frozenset(params.get("newly_manual_axes", frozenset())),
                    check_vma=params.get("check_vma", True))
    return list(sm(*args))


def side_effects(eqn) -> list:
    """`eqn`'s effects less JAX's named-axis effects (a collective's record that it uses a
    mesh axis name, not an effect on the world)."""
    named = getattr(_core, "NamedAxisEffect", ())
    return [e for e in eqn.effects if not (named and isinstance(e, named))]


def varying_axes(aval) -> frozenset:
    """The manual mesh axes along which `aval` varies inside a `shard_map` (its type's
    ``{V:...}``; empty outside one, or on a JAX without varying types)."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def struct_like(x, dtype):
    """An abstract value of `x`'s shape in `dtype`, for `jax.make_jaxpr` to trace from: `x`'s
    own type (an aval) where `x` varies along manual mesh axes inside a `shard_map` with
    ``check_vma=True``, so that the program types its values as `x`'s are (from a
    `jax.ShapeDtypeStruct` they would be invariant, and jax 0.12.1 rejects a `max` of such a
    value with a varying one); else a `jax.ShapeDtypeStruct`."""
    aval = aval_of(x)
    if varying_axes(aval) and dtype != jax.dtypes.float0:
        return aval.update(dtype=np.dtype(dtype), weak_type=False)
    return jax.ShapeDtypeStruct(aval.shape, dtype)


def match_varying(x, aval):
    """`x` cast to vary along the manual axes `aval` varies along (`lax.pcast`): a cotangent
    traced from an aval without its varying type (`make_jaxpr` takes none) meets residuals
    that have one, inside a `shard_map` with ``check_vma=True``."""
    missing = varying_axes(aval) - varying_axes(aval_of(x))
    if not missing:
        return x
    return jax.lax.pcast(x, tuple(sorted(missing)), to="varying")


def batching_kind(prim) -> str | None:
    """How the installed JAX batches `prim`, read from its batching registry: ``"broadcast"``
    for n-ary elementwise primitives (`batching.defbroadcasting`: operands of one rank,
    size-1 axes and scalars broadcast, each output element from the operands' elements at
    the same position), ``"vectorized"`` for primitives that map over every axis of their
    operands (`batching.defvectorized`: unary elementwise ops, `random_bits` over its keys),
    else None. Evidence for `separable`'s row rules: a batch axis anywhere passes through."""
    registry = getattr(_batching, "fancy_primitive_batchers", None)
    rule = registry.get(prim) if isinstance(registry, dict) else None
    func = rule.func if isinstance(rule, functools.partial) else None
    if func is not None and func is getattr(_batching, "broadcast_batcher", object()):
        return "broadcast"
    if func is not None and func is getattr(_batching, "vectorized_batcher", object()):
        return "vectorized"
    return None


def _registered_primitives() -> dict[str, list[Primitive]]:
    """Every primitive the installed JAX has a rule for (its JVP, batching or lowering
    registries), by name: where a primitive is defined moves between releases (the PRNG's
    moved to `jax._src.random.prng`), its registration does not."""
    by_name: dict[str, list[Primitive]] = {}
    registries = [getattr(_ad, "primitive_jvps", {}), getattr(_ad, "primitive_transposes", {}),
                  getattr(_batching, "fancy_primitive_batchers", {}),
                  getattr(_batching, "primitive_batchers", {}), getattr(_mlir, "_lowerings", {})]
    for reg in registries:
        if not isinstance(reg, dict):
            continue
        for p in list(reg):
            if isinstance(p, Primitive) and p not in by_name.setdefault(p.name, []):
                by_name[p.name].append(p)
    return by_name


def primitives_named(names: Sequence[str]) -> list[Primitive]:
    """The installed JAX's primitives named `names` (a `jax.lax` ``<name>_p`` attribute, else
    any primitive JAX registers a rule for under that name); missing ones skipped."""
    out: list[Primitive] = []
    registered = None
    for n in names:
        p = getattr(jax.lax, n + "_p", None)
        if p is not None:
            out.append(p)
            continue
        if registered is None:
            registered = _registered_primitives()
        out.extend(q for q in registered.get(n, []) if q not in out)
    return out


# --------------------------------------------------------------------------------------------
# Jaxprs
# --------------------------------------------------------------------------------------------

def jaxpr_and_consts(j) -> tuple[Any, list]:
    """Splits a (closed) jaxpr as held in an equation's params into (jaxpr, consts).

    Works for 0.10's `ClosedJaxpr` and open `Jaxpr`, and for 0.11+'s `Jaxpr` with consts.
    """
    consts = getattr(j, "consts", None)
    if consts is None:
        return j, []
    return j.jaxpr, list(consts)


def is_jaxpr_like(v) -> bool:
    """A jaxpr as params hold them: 0.10's `Jaxpr` / `ClosedJaxpr`, 0.11+'s `Jaxpr`."""
    return isinstance(v, _JAXPR_TYPES)


def eval_closed_jaxpr(closed, args: Sequence[Any]) -> list[Any]:
    """Evaluates a closed jaxpr (what `jax.make_jaxpr` returns) on `args`, equation by
    equation (eagerly when `args` are arrays)."""
    from jax.extend.core import jaxpr_as_fun

    return list(jaxpr_as_fun(closed)(*args))


def is_literal(v) -> bool:
    return isinstance(v, Literal)


def is_dropvar(v) -> bool:
    return isinstance(v, DropVar)


def aval_of(x):
    return _core.typeof(x)


_HIFIGRAD_DIR = __import__("os").path.dirname(__import__("os").path.dirname(__file__))


def _user_source(traceback) -> str:
    """The innermost frame of `traceback` that is the user's ("model.py:12:8 (block)"): not
    JAX's (JAX's own heuristic, `source_info_util.user_frames`) nor hifigrad's; or ""."""
    try:
        for frame in _source_info_util.user_frames(traceback):
            if not frame.file_name.startswith(_HIFIGRAD_DIR):
                return (f"{frame.file_name}:{frame.start_line}:{frame.start_column} "
                        f"({frame.function_name})")
    except Exception:  # noqa: BLE001 - a best-effort label for messages
        pass
    return ""


def source_summary(eqn) -> str:
    """Where the user's code made `eqn` ("model.py:12:8 (block)"), or "" if JAX cannot say."""
    return _user_source(getattr(eqn.source_info, "traceback", None))


def current_source() -> str:
    """Where the user's code is being traced now ("model.py:12:8 (block)"), or "": JAX's
    current source info (the equation being re-bound, where hifigrad rewrites a program),
    else the innermost Python frame that is neither JAX's nor hifigrad's."""
    import sys

    try:
        found = _user_source(_source_info_util.current().traceback)
        frame = sys._getframe(1)
        while not found and frame is not None:
            name = frame.f_code.co_filename
            if not name.startswith(_HIFIGRAD_DIR) and _source_info_util.is_user_filename(name):
                found = f"{name}:{frame.f_lineno} ({frame.f_code.co_name})"
            frame = frame.f_back
        return found
    except Exception:  # noqa: BLE001 - a best-effort label for messages
        return ""


@contextlib.contextmanager
def eqn_context(eqn):
    """The context eval_jaxpr binds an equation in: its source info (for error messages and
    profiles) and its equation context (compute type, mesh, ...)."""
    name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
    with _source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), \
            eqn.ctx.manager:
        yield


def eqn_ctx(eqn):
    """The equation's context alone (compute type, mesh, ...), without its source info: what
    casts staged beside an equation must run in."""
    return eqn.ctx.manager


def custom_jvp_with_rule(params: dict, call_jaxpr, jvp_jaxpr) -> dict:
    """A `custom_jvp_call` equation's params with another primal program `call_jaxpr` (a
    closed jaxpr) and JVP program: ``jvp_jaxpr(jaxpr, consts, in_zeros, out_zeros)`` maps
    what the equation's own JVP rule gives for the tangents' symbolic zeros ``in_zeros``
    (its JVP jaxpr of the primals and non-zero tangents, its consts; ``out_zeros``, which
    output tangents are zero, kept) to the new (jaxpr, consts). The rule keeps its name (its
    debug info). Params: ``call_jaxpr``, ``jvp_jaxpr_fun`` (a `WrappedFun` of the zeros),
    ``num_consts``, ``symbolic_zeros`` on every release admitted."""
    old = params["jvp_jaxpr_fun"]
    cache: dict = {}

    def thunk(*in_zeros):
        key = tuple(bool(z) for z in in_zeros)
        if key not in cache:
            jaxpr, consts, out_zeros = old.call_wrapped(*in_zeros)
            new_jaxpr, new_consts = jvp_jaxpr(jaxpr, consts, key,
                                              tuple(bool(z) for z in out_zeros))
            cache[key] = (new_jaxpr, new_consts, out_zeros)
        return cache[key]

    return dict(params, call_jaxpr=call_jaxpr,
                jvp_jaxpr_fun=_lu.wrap_init(thunk, debug_info=old.debug_info))


def custom_vjp_with_fwd(params: dict, call_jaxpr, fwd_jaxpr) -> dict:
    """A `custom_vjp_call` equation's params with another primal program `call_jaxpr` (a
    closed jaxpr) and forward program: ``fwd_jaxpr(jaxpr, consts)`` maps the forward rule's
    program (the primals to the residuals and results, as the equation's ``fwd_jaxpr_thunk``
    traces it for the tangents' symbolic zeros) to the new (jaxpr, consts). The backward
    function (``bwd``) is kept. Params: ``call_jaxpr``, ``fwd_jaxpr_thunk`` (a `WrappedFun`
    of the zeros returning (jaxpr, consts)), ``num_consts``, ``bwd``, ``out_trees``,
    ``symbolic_zeros`` on every release admitted."""
    old = params["fwd_jaxpr_thunk"]
    cache: dict = {}

    def thunk(*zeros):
        key = tuple(bool(z) for z in zeros)
        if key not in cache:
            with assumption("read a custom_vjp forward rule's program"):
                jaxpr, consts = old.call_wrapped(*zeros)
            cache[key] = fwd_jaxpr(*jaxpr_and_consts_of(jaxpr, consts))
        return cache[key]

    return dict(params, call_jaxpr=call_jaxpr,
                fwd_jaxpr_thunk=_lu.wrap_init(thunk, debug_info=old.debug_info))


def jaxpr_and_consts_of(jaxpr, consts) -> tuple[Any, list]:
    """An open jaxpr and its constvars' values, from a (jaxpr, consts) pair JAX hands out
    (0.11+ may attach the consts to the jaxpr too)."""
    j, c = jaxpr_and_consts(jaxpr)
    return j, list(c) if c else list(consts)


def bind_eqn(eqn, invals: Sequence[Any], params: dict | None = None) -> list[Any]:
    """Binds `eqn`'s primitive on `invals` (params overridable) as `core.eval_jaxpr` does."""
    params = eqn.params if params is None else params
    bind_params = eqn.primitive.get_bind_params(params)
    with eqn_context(eqn):
        ans = eqn.primitive.bind(*invals, **bind_params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


_JAXPR_TYPES = tuple(t for t in (getattr(_core, "Jaxpr", None), getattr(_core, "ClosedJaxpr", None))
                     if isinstance(t, type))


def jaxprs_in_params(params: dict) -> list[Any]:
    """Every jaxpr an equation's params hold, searched through tuples, lists and dicts."""
    found: list = []
    for v in params.values():
        if isinstance(v, _JAXPR_TYPES):
            found.append(v)
        elif isinstance(v, (tuple, list, dict)):
            _find_jaxprs(v, found)
    return found


def _find_jaxprs(v, found: list) -> None:
    for x in (v.values() if isinstance(v, dict) else v):
        if isinstance(x, _JAXPR_TYPES):
            found.append(x)
        elif isinstance(x, (tuple, list, dict)):
            _find_jaxprs(x, found)


def abstract_eval(eqn, avals: Sequence[Any], params: dict) -> list[Any]:
    """The output avals of binding `eqn`'s primitive on `avals` with `params`, as the tracing
    machinery computes them (no equation is emitted). Raises what the primitive raises."""
    return abstract_eval_effects(eqn, avals, params)[0]


def abstract_eval_effects(eqn, avals: Sequence[Any], params: dict) -> tuple[list[Any], Any]:
    """`abstract_eval`, and the effects of the equation it describes."""
    out, effects = eqn.primitive.abstract_eval(*avals, **eqn.primitive.get_bind_params(params))
    return (list(out) if eqn.primitive.multiple_results else [out]), effects


def hi_primitive_at(eqn, aval_fn: Callable[[Any], Any]):
    """A `call_hi_primitive` equation's primitive object (`_prim`, a `HiPrim`) rebuilt with every
    aval in its params mapped by `aval_fn`, or None when it cannot be (its class does not take its
    params as keyword arguments, as JAX's own hi-primitives do)."""
    prim = eqn.params["_prim"]
    params = {k: aval_fn(v) if isinstance(v, ShapedArray) else v
              for k, v in getattr(prim, "params", {}).items()}
    try:
        return type(prim)(**params)
    except Exception:  # noqa: BLE001 - no evidence that the class can be rebuilt
        return None


def hi_primitive_expansion(eqn):
    """The program a `call_hi_primitive` equation's `HiPrim` expands to (its ``expand``: the
    lo-level JAX it stands for), traced at the equation's input avals; None when it cannot be
    read."""
    prim = eqn.params["_prim"]
    expand = getattr(prim, "expand", None)
    if expand is None:
        return None
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    try:
        return jax.make_jaxpr(lambda *a: expand(*a))(*avals)
    except Exception:  # noqa: BLE001 - no evidence of what it expands to
        return None


def hi_primitive_out_avals(prim) -> list[Any]:
    return list(prim.out_avals_flat)


def is_ref_or_extended(aval) -> bool:
    """Mutable refs and extended dtypes (PRNG keys): values that a cast cannot promote."""
    if type(aval).__name__ == "AbstractRef":
        return True
    dt = getattr(aval, "dtype", None)
    return dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.extended)


def scan_split(eqn) -> tuple[int, int]:
    """(num_consts, num_carry) of a scan equation."""
    p = eqn.params
    with assumption("read a scan equation's params (num_consts/num_carry or ft_in)"):
        if "num_consts" in p:
            return p["num_consts"], p["num_carry"]
        consts, carry, _ = p["ft_in"].unpack()
        return len(list(consts)), len(list(carry))


def scan_num_ys(eqn) -> int:
    _, num_carry = scan_split(eqn)
    return len(eqn.outvars) - num_carry


def make_jaxpr_closed(fun: Callable, *avals_or_args,
                      discharge_refs: bool = False) -> tuple[Any, list, Any]:
    """Traces `fun` to (jaxpr, consts, out_tree) with explicit consts, on any JAX version.

    With `discharge_refs`, mutable refs the program creates (`jax.new_ref`) are discharged
    into pure values (JAX's own state discharge), so that the program can be transposed.
    """
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*avals_or_args)
    if discharge_refs and _uses_refs(jaxpr_and_consts(closed)[0]):
        from jax._src.state import discharge as _discharge

        closed = _discharge.discharge_state(closed)
    jaxpr, consts = jaxpr_and_consts(closed)
    return jaxpr, consts, jax.tree_util.tree_structure(out_shape)


# --------------------------------------------------------------------------------------------
# custom_vjp backward rules seen at transpose time (custom_lin)
# --------------------------------------------------------------------------------------------
# JAX change: *backward-pass logs* (`jax.custom_vjp.defvjp_with_logs`, first released in jax
# 0.11.1). From that release on, the `bwd` param of a `custom_lin` equation returns
# `(cts_in, logs)` and JAX's custom_lin transpose unpacks such a pair; before it, `bwd` returns
# `cts_in` alone. Decided by calling the `bwd` JAX itself builds for a one-input custom_vjp, not by
# version number.


@functools.cache
def bwd_returns_logs() -> bool:
    """Whether the installed JAX's custom_lin `bwd` returns ``(cts_in, logs)``.

    Evidence: JAX linearizes a one-input identity `custom_vjp`; its `custom_lin` equation's `bwd`
    is called on a cotangent. A plain result is a one-element sequence of cotangents; a result with
    logs is a pair whose first element is that sequence.
    """
    with assumption("probe the protocol of a custom_vjp backward rule (custom_lin bwd)"):

        @jax.custom_vjp
        def ident(x):
            return x

        ident.defvjp(lambda x: (x, None), lambda _, g: (g,))
        x = np.float32(1.0)
        _, lin = jax.linearize(ident, x)
        res, tree = jax.tree_util.tree_flatten(lin)
        closed = jax.make_jaxpr(lambda r, t: jax.tree_util.tree_unflatten(tree, r)(t))(res, x)
        jaxpr, _ = jaxpr_and_consts(closed)
        eqns = [e for e in jaxpr.eqns if e.primitive is custom_lin_p]
        if len(eqns) != 1 or eqns[0].params["num_res"] != 0:
            raise AssertionError(f"expected one custom_lin equation without residuals, got "
                                 f"{[e.primitive.name for e in jaxpr.eqns]}")
        out = eqns[0].params["bwd"].call_wrapped(np.float32(2.0))
        if _is_ct_sequence(out, 1):
            return False
        if (isinstance(out, (tuple, list)) and len(out) == 2 and _is_ct_sequence(out[0], 1)
                and (out[1] is None or isinstance(out[1], dict))):
            return True
        raise AssertionError(f"the backward returned {out!r}, neither [ct] nor ([ct], logs)")


def _is_ct_sequence(out, n: int) -> bool:
    return (isinstance(out, (tuple, list)) and len(out) == n
            and not any(isinstance(c, (tuple, list, dict)) for c in out))


def custom_lin_call_bwd(bwd, res: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
    """Calls a custom_lin `bwd` param on (res, cts) and returns dense input cotangents.

    Symbolic zeros returned by the rule are instantiated (using `avals` is not needed: the rule's
    zeros carry their aval).
    """
    out = bwd.call_wrapped(*res, *cts)
    with assumption("read the result of a custom_vjp backward rule (custom_lin bwd)"):
        if bwd_returns_logs():
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise ValueError(f"expected a pair (cts_in, logs), got {type(out).__name__} "
                                 f"of length {len(out) if hasattr(out, '__len__') else '?'}")
            out, _logs = out
        if not _is_ct_sequence(out, len(out) if isinstance(out, (tuple, list)) else -1):
            raise ValueError(f"expected a sequence of cotangents, got {out!r:.200}")
        out = [_ad.replace_rule_output_symbolic_zeros(c) for c in out]
        return [_ad.instantiate_zeros(c) if isinstance(c, _ad.Zero) else c for c in out]


def wrap_bwd(fn: Callable, like) -> Any:
    """Wraps `fn(*res, *cts) -> cts_in` as a custom_lin `bwd` param (a WrappedFun), in the
    protocol the installed JAX expects (`bwd_returns_logs`). No logs are produced."""
    if bwd_returns_logs():
        inner = fn

        def fn(*args):  # noqa: F811
            return inner(*args), None

    return _lu.wrap_init(fn, debug_info=like.debug_info)


def is_symbolic_zero(ct) -> bool:
    """Whether a cotangent handed to a custom_lin `bwd` is a symbolic zero."""
    return isinstance(ct, (_ad_util.SymbolicZero, _ad.Zero))


def symbolic_zero(aval):
    """A symbolic zero cotangent of `aval`, as JAX hands one to a custom_lin `bwd`."""
    return _ad_util.SymbolicZero(aval)


def custom_lin_bind(invals: Sequence[Any], params: dict) -> list[Any]:
    return list(custom_lin_p.bind(*invals, **params))


def instantiate_zeros(x):
    return _ad.instantiate_zeros(x)


# --------------------------------------------------------------------------------------------
# Defining hifigrad's own primitives
# --------------------------------------------------------------------------------------------

# Every primitive made by `new_primitive`, with the module that made it: hifigrad's own
# (`hifigrad.*`) are checked by a test against every registry a primitive needs (and no module
# of the package calls `Primitive(...)` itself); tests make their own with it too.
CREATED: list = []


def new_primitive(name: str, multiple_results: bool = False) -> Primitive:
    p = jax.extend.core.Primitive(name)
    p.multiple_results = multiple_results
    CREATED.append((p, sys._getframe(1).f_globals.get("__name__", "")))  # noqa: SLF001
    return p


def register_impl_and_lowering(p: Primitive, impl: Callable, abstract_eval: Callable) -> None:
    """`impl` is a JAX-traceable function; it serves as both eager impl and MLIR lowering."""
    p.def_impl(impl)
    p.def_abstract_eval(abstract_eval)
    _mlir.register_lowering(p, _mlir.lower_fun(impl, multiple_results=p.multiple_results))


def register_jvp(p: Primitive, rule: Callable) -> None:
    _ad.primitive_jvps[p] = rule


def register_transpose(p: Primitive, rule: Callable) -> None:
    _ad.primitive_transposes[p] = rule


def register_batching(p: Primitive, rule: Callable) -> None:
    _batching.primitive_batchers[p] = rule


def lower_for(jitted, args: Sequence[Any], platform: str) -> str:
    """The StableHLO text of ``jitted(*args)`` (a `jax.jit` function) lowered for `platform`
    (``'cpu'``, ``'tpu'``, ``'cuda'``, ``'rocm'``) on whatever host this runs: each
    `lax.platform_dependent` takes that platform's branch, so a CPU can check the program a
    TPU or a GPU would compile. (`lowering_platforms` is the argument `jax.export` uses.)"""
    return jitted.trace(*args).lower(lowering_platforms=(platform,)).as_text()


def registered_rules(p: Primitive) -> dict[str, bool]:
    """Which of JAX's registries hold a rule for `p`: its MLIR lowering, JVP, transpose and
    batching rule. (JAX change: from 0.12 on `batching.primitive_batchers` is a write-only
    proxy that wraps each rule into `fancy_primitive_batchers`; both are read.)"""
    plain = getattr(_batching, "primitive_batchers", None)
    fancy = getattr(_batching, "fancy_primitive_batchers", None)
    batched = (isinstance(plain, dict) and p in plain) or (isinstance(fancy, dict) and p in fancy)
    return {"lowering": p in _mlir._lowerings, "jvp": p in _ad.primitive_jvps,
            "transpose": p in _ad.primitive_transposes, "batching": batched}


def is_undefined_primal(x) -> bool:
    return _ad.is_undefined_primal(x)


def register_staged_partial_eval(p: Primitive) -> None:
    """Makes `p` always land on the unknown (staged) side of partial evaluation.

    Used for the upcast of residuals: staging it keeps the low-precision residual as what is saved
    (and, inside a scan, what is stacked), with the cast recomputed where it is consumed.
    """

    def rule(trace, *tracers, **params):
        tracers = [trace.instantiate_const(t) for t in tracers]
        return trace.default_process_primitive(p, tracers, params)

    _pe.custom_partial_eval_rules[p] = rule

    def custom_rule(saveable, unks_in, inst_in, eqn):
        del saveable
        # Known inputs: the eqn still goes to the staged side, its inputs become residuals.
        res = [v for v, uk, inst in zip(eqn.invars, unks_in, inst_in)
               if not uk and not inst and not is_literal(v)]
        return None, eqn, [True] * len(eqn.outvars), [True] * len(eqn.outvars), res

    _pe.partial_eval_jaxpr_custom_rules[p] = custom_rule


def ensure_tuple(x):
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)


@functools.cache
def dtype_is_float0(dtype) -> bool:
    return np.dtype(dtype) == jax.dtypes.float0


CustomVJPException = _ad.CustomVJPException
custom_derivatives = _custom_derivatives


# ---- primitive registries (census)
# Used by tests/test_census.py to enumerate the primitives the installed JAX can differentiate.
# JAX keeps its differentiation rules in module-level dicts keyed by primitive: `primitive_jvps`,
# `primitive_transposes`, `primitive_linearizations`, `fancy_transposes` and (some versions)
# `reducing_transposes`, all in `jax._src.interpreters.ad` on 0.10.2 and 0.12.x. Libraries
# (equinox, hifigrad itself) register their own primitives into the same dicts; a rule's defining
# module tells them apart.

_AD_RULE_REGISTRIES = ("primitive_jvps", "primitive_transposes", "primitive_linearizations",
                       "fancy_transposes", "reducing_transposes")


def _rule_module(rule) -> str:
    while isinstance(rule, functools.partial):
        rule = rule.func
    return getattr(rule, "__module__", None) or type(rule).__module__ or ""


def ad_rule_registries() -> dict[str, dict]:
    """The differentiation-rule registries this JAX version has, by name."""
    return {n: getattr(_ad, n) for n in _AD_RULE_REGISTRIES if hasattr(_ad, n)}


def differentiable_primitives(defined_in: str | None = "jax") -> dict[str, Primitive]:
    """Every primitive registered with a JVP, linearization or transpose rule, by name.

    With ``defined_in`` (a top-level package name, default ``"jax"``), only primitives with a
    rule defined in that package's modules; ``None`` keeps every registered primitive (those of
    libraries such as equinox, and hifigrad's own, included). Only modules imported so far have
    registered their primitives: import the namespaces to survey first.
    """
    out: dict[str, Primitive] = {}
    for reg in ad_rule_registries().values():
        for prim, rule in list(reg.items()):
            mod = _rule_module(rule)
            if defined_in is None or mod == defined_in or mod.startswith(defined_in + "."):
                out.setdefault(prim.name, prim)
    return out


# --------------------------------------------------------------------------------------------
# The linear program `jax.linearize` built, and transposing a jaxpr without re-tracing it
# --------------------------------------------------------------------------------------------
# JAX internals: `jax.linearize` returns ``Partial(partial(api._lift_linearized, jaxpr, in_avals,
# out_avals, out_zeros), consts[, structured_residuals])`` (0.10 to 0.12), whose call evaluates
# ``jaxpr`` on ``consts`` (its constvars) and ``*tangents, *structured_residual_leaves`` (its
# invars). `jax.linear_transpose` traces its function to a jaxpr and calls
# ``ad.backward_pass(jaxpr, True, consts, [UndefinedPrimal(aval), ...], cts)``. Reading the
# first and calling the second directly saves re-tracing the linear program twice.

from jax._src import api as _api  # noqa: E402


def linearized_jaxpr(lin, tangent_avals: Sequence[Any]):
    """The linear program of ``jax.linearize``'s function `lin`, as an open jaxpr whose invars
    are ``[*tree_leaves(lin), *tangents]`` (the order of re-tracing it as ``lin_call(res, ts)``),
    read from `lin` without tracing; or None when `lin` is not in the form this JAX release is
    known to build (then the caller re-traces it). Also None when the program holds mutable
    refs (they must be discharged by a trace) or an output's tangent is a known zero."""
    func = getattr(lin, "func", None)
    func = getattr(func, "fun", func)  # `Partial` wraps a partial in a hashable shim
    lift = getattr(_api, "_lift_linearized", None)
    if not isinstance(func, functools.partial) or lift is None or func.func is not lift \
            or len(func.args) != 4 or func.keywords:
        return None
    jaxpr, _, _, out_zeros = func.args
    if not isinstance(jaxpr, _JAXPR_TYPES) or any(bool(z) for z in out_zeros):
        return None
    jaxpr, consts = jaxpr_and_consts(jaxpr)
    args = getattr(lin, "args", ())
    if consts or not args or getattr(lin, "keywords", None):
        return None
    const_vals, rest = list(args[0]), list(args[1:])
    rest_leaves = jax.tree_util.tree_leaves(rest)
    n_t, n_c = len(tangent_avals), len(const_vals)
    # 0.10's jaxpr declares the consts as constvars; 0.11+'s as leading invars (a jaxpr's
    # constvars are those with attached values, and this one has none).
    all_in = [*jaxpr.constvars, *jaxpr.invars]
    if (len(jax.tree_util.tree_leaves(const_vals)) != n_c
            or len(all_in) != n_c + n_t + len(rest_leaves)):
        return None
    tangents = all_in[n_c:n_c + n_t]
    for v, a in zip(tangents, tangent_avals):
        if tuple(v.aval.shape) != tuple(a.shape) or np.dtype(v.aval.dtype) != np.dtype(a.dtype):
            return None
    if _uses_refs(jaxpr):
        return None
    return jaxpr.replace(constvars=[], invars=[*all_in[:n_c], *all_in[n_c + n_t:], *tangents])


def dce(jaxpr, consts: Sequence[Any] = ()) -> tuple[Any, list]:
    """`jaxpr` (with constvars holding `consts`) without the equations no output needs,
    inside its calls too (JAX's own dead-code elimination); inputs are all kept."""
    # JAX's own pairing of constvars with inputs (jax 0.12's Jaxpr carries its consts, and
    # its `replace` drops constvars set without them).
    jaxpr, used_consts, _ = _pe.dce_jaxpr_consts(jaxpr, [True] * len(jaxpr.outvars), True)
    return jaxpr, [c for c, u in zip(consts, used_consts) if u]


def transpose_jaxpr(closed, known: Sequence[Any], cts: Sequence[Any]) -> list[Any]:
    """The transpose of the closed jaxpr `closed`, linear in its invars after the first
    ``len(known)`` (which take the values `known`), applied to the output cotangents `cts`:
    what `jax.linear_transpose` of ``jaxpr_as_fun(closed)`` computes, without tracing the
    jaxpr again. Returns the cotangents of the linear invars (zeros instantiated)."""
    jaxpr, consts = jaxpr_and_consts(closed)
    jaxpr, _ = _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), True)
    n = len(known)
    dummies = [_ad.UndefinedPrimal(v.aval.to_ct_aval()) for v in jaxpr.invars[n:]]
    in_cts = _ad.backward_pass(jaxpr, True, consts, [*known, *dummies], list(cts))
    return [_ad.instantiate_zeros(c) for c in in_cts[n:]]


# --------------------------------------------------------------------------------------------
# Writing a jaxpr directly (`build.py`)
# --------------------------------------------------------------------------------------------

def new_var(aval):
    """A fresh jaxpr variable of type `aval` (`jax.extend.core.Var`, one argument since 0.10)."""
    return jax.extend.core.Var(aval)


def new_literal(val):
    """A jaxpr literal holding the NumPy value `val`, typed as tracing would type it."""
    return jax.extend.core.Literal(val, aval_of(val))


def closed_jaxpr_from(template, constvars, consts, invars, outvars, eqns):
    """A closed jaxpr with these variables, equations and constants (`template`: an open
    jaxpr whose debug info is kept, its names dropped). 0.10 wraps an open jaxpr in a
    `ClosedJaxpr`; 0.11+ attaches the constants to the `Jaxpr`."""
    effects = _core.join_effects(*(e.effects for e in eqns))
    kw = dict(constvars=list(constvars), invars=list(invars), outvars=list(outvars),
              eqns=list(eqns), effects=effects)
    closed_type = getattr(_core, "ClosedJaxpr", None)
    if isinstance(closed_type, type) and not hasattr(template, "consts"):
        return closed_type(template.replace(**kw), list(consts))
    return template.replace(**kw, consts=list(consts))


def foreign_tracer(xs):
    """The first of `xs` that is a tracer of a trace other than the current one (a value a
    function closed over from an enclosing transformation, escaped into a result), or None."""
    current = jax.extend.core.find_top_trace(())
    for x in xs:
        if isinstance(x, jax.core.Tracer) and getattr(x, "_trace", current) is not current:
            return x
    return None


def tracing_eagerly() -> bool:
    """Whether the current trace evaluates eagerly (JAX's `EvalTrace`: no transformation or
    staging is active), where a tracer of any other trace in an operation is an error."""
    return isinstance(jax.extend.core.find_top_trace(()), _core.EvalTrace)


_DIFF_TRACES = tuple(t for t in (getattr(_ad, "JVPTrace", None),
                                 getattr(_ad, "LinearizeTrace", None)) if isinstance(t, type))


def eager_under_differentiation() -> bool:
    """Whether every active trace is a differentiation trace (JVP, linearize) over eager
    evaluation: nothing is being staged or batched, so a value of one of those traces used
    where another trace runs raises UnexpectedTracerError instead of being captured."""
    t = jax.extend.core.find_top_trace(())
    while isinstance(t, _DIFF_TRACES):
        t = getattr(t, "parent_trace", None)
    return isinstance(t, _core.EvalTrace)


def transposable_as_is(closed, n_known: int) -> bool:
    """Whether `transpose_jaxpr` can transpose `closed` (linear in its invars after the first
    `n_known`) without the partial evaluation `jax.linear_transpose`'s trace does first: no
    equation that takes a linear value holds a sub-program, except a jit (whose transpose
    rule evaluates the known part of its body itself). Loops, conditionals and checkpoints
    want their bodies split into known and linear parts."""
    jaxpr, _ = jaxpr_and_consts(closed)
    linear = set(jaxpr.invars[n_known:])
    for eqn in jaxpr.eqns:
        if not any(not is_literal(v) and v in linear for v in eqn.invars):
            continue
        if eqn.primitive is not pjit_p and jaxprs_in_params(eqn.params):
            return False
        linear.update(eqn.outvars)
    return True
