"""A census of JAX's differentiable primitives, and the public-API program table under hg.grad.

1. **Census.** Every primitive the installed JAX registers with a JVP, linearization or transpose
   rule (`hifigrad._src.compat.differentiable_primitives`, over the namespaces in
   `CENSUS_MODULES`, enumerated in a fresh process so that what other tests imported does not
   matter) must be *covered* by a program of `tests/programs.py` or listed in `NOT_COVERED` with
   the reason it cannot carry a cotangent here. A primitive a new JAX adds fails the test and
   names itself; so does an entry of `NOT_COVERED` that a program covers, or that no longer
   exists on either supported JAX version.

   A program covers a primitive when differentiating it runs that primitive's JVP rule on a
   tangent, or its linear or transposed program binds it: the primitive is applied to a float
   value that depends on a differentiated input in the jaxpr of the program, of its JVP or of its
   VJP (a forward data-flow over each jaxpr; an equation with sub-jaxprs taints the float inputs
   of all of them when any of its inputs is tainted). Sub-jaxprs are found generically in
   equation params.

2. **Numerics.** Each public-API program runs through `hg.grad` with bf16 and fp16 inputs, eager
   and jitted. Its gradients must be float32 and finite, and match `jax.grad` of the same program
   in float32 at the same inputs (up-cast). The forward rounds to the low dtype in both (hg keeps
   the forward as written; the reference does not round at all), so the error is the forward's:
   each op rounds to eps/2 relative, and these programs chain a handful of ops on any path, so
   the normwise relative error of the gradient is bounded by ``8 * eps(dtype)`` (bf16: 0.0625,
   fp16: 0.0078). Programs conditioned worse than that declare a factor, with a reason, in
   `programs.TOLERANCE_FACTOR`. Known failures are listed in one place, `programs.XFAIL`
   (strict: a program that starts passing fails until its mark is dropped). The default run
   checks one combination per program (jitted; bf16 and fp16 alternate along the table); all four
   run in the `sweep` tier (``make test-all``). Both gradients are taken in
   `platforms.highest_precision()`: the bound is the forward's rounding, and on an NVIDIA GPU a
   default-precision float32 matmul is TF32 (10 mantissa bits, as coarse as fp16's), an error in
   the reference and in hg.grad's exact float32 matmuls that the bound does not budget (on CPU
   the context changes nothing). On a GPU the default policy's bf16 matmuls are 'fast' (the
   cotangent rounded to bf16, 2**-9 relative per matmul): within the bf16 bound, which is 8 such
   roundings.

The construct programs (control flow, custom rules, models) are checked by tests/test_rules.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lanes import in_turn
from platforms import highest_precision
from programs import (
    API,
    CONTEXT,
    EVERY,
    HEAVY,
    PROGRAMS,
    TOLERANCE_FACTOR,
    TRACE_ONLY,
    xfail_reason,
)

import hifigrad as hg
from hifigrad._src import compat

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VERSION = compat.JAX_VERSION

# The namespaces surveyed: JAX's public API that registers differentiable primitives.
CENSUS_MODULES = (
    "jax", "jax.numpy", "jax.nn", "jax.lax", "jax.lax.linalg", "jax.scipy.special",
    "jax.scipy.linalg", "jax.scipy.stats", "jax.image", "jax.random", "jax.ops",
    "jax.experimental.sparse", "jax.experimental.shard_map", "jax.experimental.layout",
    "jax.experimental.shard_alike", "jax.experimental.compute_on", "jax.experimental.pallas",
    "jax.experimental.multihost_utils", "jax.experimental.fused",
    "jax.experimental.scheduling_groups", "jax.experimental.buffer_callback",
    "jax.experimental.custom_partitioning", "jax.experimental.checkify",
    "jax.experimental.overlap",
)

_INTEGER = "integer/bool-only: its values have no tangent (float0), so no cotangent reaches it"
_KEYS = "PRNG key bits and key data: integer-valued, no tangent (float0)"
_PALLAS = ("only inside a Pallas kernel (jax.experimental.pallas), which is lowered for TPU/GPU;"
           " not reachable from a CPU program")
_HIJAX = ("jax.experimental.hijax internals (boxes, logs, hi primitives); exists only inside "
          "JAX's own transforms of hijax types")
_STATE_INTERNAL = ("internal to JAX's state discharge and ref AD (run_state); the public ref "
                   "API (jax.new_ref, get/swap/addupdate) is covered by 'mutable_refs'")
_VMA = ("internal varying-manual-axes cast of shard_map's type system, emitted only by JAX's own "
        "rewrites of unreduced/reduced shardings (not by public collectives on this JAX)")
_MULTIHOST = ("jax.experimental.multihost_utils: converts between host-local and global arrays "
              "across processes; needs a multi-process runtime (tests/test_distributed.py)")

# The one place for primitives no program covers: name -> why it cannot carry a cotangent here.
NOT_COVERED = {
    # integer / bool values
    "and": _INTEGER, "or": _INTEGER, "not": _INTEGER, "xor": _INTEGER,
    "shift_left": _INTEGER, "shift_right_arithmetic": _INTEGER,
    "shift_right_logical": _INTEGER, "mulhi": _INTEGER, "reduce_or": _INTEGER,
    "random_poisson": ("jax 0.12.1: jax.random.poisson's sampler; its samples are integers (no "
                       "cotangent)"),
    "eq_to": ("total-order equality used inside JAX's sort comparators and searchsorted; "
              "no program here reaches it on a float value"),
    # PRNG keys
    "random_bits": _KEYS, "raw_bits": _KEYS, "random_fold_in": _KEYS, "random_seed": _KEYS,
    "random_split": _KEYS, "random_unwrap": _KEYS, "random_wrap": _KEYS,
    "from_edtype": "extended-dtype (PRNG key) representation change; integer-valued",
    "to_edtype": "extended-dtype (PRNG key) representation change; integer-valued",
    # Pallas kernels
    "pallas_call": _PALLAS, "masked_load": _PALLAS, "masked_swap": _PALLAS, "check": _PALLAS,
    "mpmd_map": _PALLAS, "get_global": _PALLAS, "xla_metadata_value": _PALLAS,
    # hijax
    "box_get": _HIJAX, "box_set": _HIJAX, "new_box": _HIJAX, "log_extend": _HIJAX,
    "log_read": _HIJAX, "new_log": _HIJAX, "call_hi_primitive_linearized": _HIJAX,
    # state internals
    "run_state": _STATE_INTERNAL, "empty_ref": _STATE_INTERNAL, "free_ref": _STATE_INTERNAL,
    "accum_grad_in_ref": _STATE_INTERNAL,
    # shard_map type-system casts
    "reduced_vary_cast": _VMA, "reduced_vary_cast_p": _VMA, "vary_unreduced_cast": _VMA,
    "vary_unreduced_cast_p": _VMA, "unreduced_psum": _VMA, "unreduced_reduce_scatter": _VMA,
    "all_gather_reduced": _VMA, "preduced": _VMA, "pbroadcast_dynamic": _VMA,
    # multi-process
    "host_local_array_to_global_array": _MULTIHOST, "global_array_to_host_local_array": _MULTIHOST,
    "custom_vmap_call": ("jax.custom_batching.custom_vmap has a JVP but no reverse mode: jax.grad "
                         "raises 'Linearization failed to produce known values'"),
    "composite": ("lax.composite: JAX's JVP rule raises 'JVP rule for composite not "
                  "implemented' (jax.grad fails too; wrap it in a custom_jvp)"),
    "reduce_window": ("lax.reduce_window with a custom or variadic computation: JAX has a JVP but"
                      " no reverse mode ('Linearization failed'); the monoid ones (add, max, min)"
                      " are their own primitives, covered"),
    "fused_call": ("jax.experimental.fused (memory-space fusion): no lowering for CPU ('MLIR "
                   "translation rule for primitive fused_call not found for platform cpu')"),
    "tie": "internal ordering helper of JAX's lax (no public API emits it)",
    "stage": "internal: EvalTrace staging of a non-array value (no public API emits it)",
    "pbroadcast": ("lax.pbroadcast: JAX's own transpose rule raises ('full must be called with "
                   "scalar fill_value'): jax.grad fails too"),
    "bcoo_spdot_general": ("sparse @ sparse (BCOO): JAX has no transpose rule for it, jax.grad "
                           "raises NotImplementedError"),
    "relayout": "jax 0.12: internal (jax._src.pjit.relayout), not exported by the public API",
    "with_memory_space_constraint": _PALLAS,
    # version-specific (see ONLY_ON)
    "call": ("jax 0.10.2, 0.11.0: core.call_p, the untyped call of JAX's internal transforms; "
             "no public API binds it"),
    "closed_call": ("jax 0.10.2, 0.11.0: bound only by JAX's own partial evaluation (custom_vjp "
                    "dead-code elimination, hoisted scan residuals), not by a public API"),
    "eval_jaxpr": ("jax 0.10.2 to 0.11.1: bound only while JAX lowers scan and hijax types, "
                   "after differentiation (from 0.11.2 lax.custom_root binds it: covered there)"),
    "call_hi_primitive": ("jax 0.10.2 to 0.11.1: bound only by experimental hijax types; no "
                          "public jnp/lax function binds it (from 0.11.2 jnp.ldexp/frexp do: "
                          "covered there)"),
    "le_to": ("jax 0.12: a total-order comparison (zero tangent) that no float program here "
              "reaches on 0.12 (on 0.10.2 jnp.searchsorted binds it: covered there)"),
    "lt_to": ("jax 0.12: a total-order comparison (zero tangent) that no float program here "
              "reaches on 0.12 (on 0.10.2 jnp.searchsorted and expm bind it: covered there)"),
    # callbacks and foreign code
    "io_callback": ("JAX defines no JVP for io_callback (an effectful host call); "
                    "differentiating through it raises in jax.grad too"),
    "ffi_call": ("a foreign (XLA FFI) custom call: needs a compiled handler registered with "
                 "jax.ffi; JAX differentiates it only through a user's custom_jvp/vjp"),
    "buffer_callback": ("jax.experimental.buffer_callback: a host/device buffer callback with no "
                        "JVP in JAX (raises under jax.grad)"),
}

# NOT_COVERED entries that apply on some JAX releases only (a program covers them on the others),
# as release prefixes: (0, 10) is every 0.10.x, (0, 11, 0) only 0.11.0. Before jax 0.11.2
# `jnp.ldexp` is not a hi-primitive and `lax.custom_root` binds no `eval_jaxpr`; before 0.11.1 no
# public API binds `call` / `closed_call` either (measured by this census on each release).
_TO_0_11_0 = ((0, 10), (0, 11, 0))
_TO_0_11_1 = ((0, 10), (0, 11, 0), (0, 11, 1))
ONLY_ON = {"call": _TO_0_11_0, "closed_call": _TO_0_11_0, "eval_jaxpr": _TO_0_11_1,
           "call_hi_primitive": _TO_0_11_1, "le_to": ((0, 12),), "lt_to": ((0, 12),),
           # registered from jax 0.12.1 on (absent before)
           "random_poisson": ((0, 12, 1),), "raw_bits": ((0, 12, 1),)}


def _on(prefixes) -> bool:
    return any(VERSION[:len(v)] == v for v in prefixes)


def _excused(p) -> bool:
    return p in NOT_COVERED and (p not in ONLY_ON or _on(ONLY_ON[p]))


# ------------------------------------------------------------------------------ enumeration

_ENUMERATE = """
import importlib, json, sys
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception:  # a namespace this JAX version lacks or cannot import here
        pass
from hifigrad._src import compat
print("CENSUS " + json.dumps(sorted(compat.differentiable_primitives())))
"""


@pytest.fixture(scope="module")
def registered():
    """The differentiable primitives of JAX's surveyed namespaces (a fresh process)."""
    # CPU for the subprocess on every platform: it only lists the primitives JAX registers at
    # import (the same on every backend, cuDNN's included), and on a GPU it would otherwise
    # claim the device (75% of its memory by default) beside the test workers.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _ENUMERATE, *CENSUS_MODULES], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("CENSUS ")][-1]
    return set(json.loads(line[len("CENSUS "):]))


# ------------------------------------------------------------------------------ coverage

def _sub_jaxprs(params):
    """Every jaxpr held in an equation's params (generically: any value with `eqns`, or with a
    `jaxpr` that has them, also inside tuples, lists and dicts)."""
    stack = list(params.values())
    while stack:
        v = stack.pop()
        if isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif hasattr(v, "eqns"):
            yield v
        elif hasattr(getattr(v, "jaxpr", None), "eqns"):
            yield v.jaxpr


def _inexact(var) -> bool:
    aval = getattr(var, "aval", None)
    dt = getattr(getattr(aval, "inner_aval", aval), "dtype", None)  # refs: their contents
    try:
        return dt is not None and jnp.issubdtype(dt, jnp.inexact)
    except TypeError:
        return False


def _tainted_prims(jaxpr, out: set):
    """Primitives of `jaxpr` applied to a float value that depends on a float input."""
    tainted = {v for v in jaxpr.invars if _inexact(v)}
    for eqn in jaxpr.eqns:
        hit = any(not compat.is_literal(v) and v in tainted for v in eqn.invars)
        if not hit:
            continue
        out.add(eqn.primitive.name)
        for sub in _sub_jaxprs(eqn.params):
            _tainted_prims(sub, out)
        if eqn.primitive.name != "stop_gradient":
            tainted.update(v for v in eqn.outvars if _inexact(v))
            # a ref written with a tainted value holds one
            tainted.update(v for v in eqn.invars if not compat.is_literal(v)
                           and hasattr(v.aval, "inner_aval") and _inexact(v))
    return out


def _floating_leaf(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _diff_split(args):
    """(differentiated leaves, a function of them rebuilding all args)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    idx = [i for i, x in enumerate(leaves) if _floating_leaf(x)]

    def rebuild(diff):
        full = list(leaves)
        for i, d in zip(idx, diff):
            full[i] = d
        return jax.tree_util.tree_unflatten(tree, full)
    return [leaves[i] for i in idx], rebuild


def covered_by(name) -> set:
    """The primitives a program's differentiation exercises (see the module docstring)."""
    fun, make = PROGRAMS[name]
    diff, rebuild = _diff_split(make(jnp.float32))

    def g(*d):
        return fun(*rebuild(d))

    def jvp(primals, tangents):
        return jax.jvp(g, primals, tangents)

    prims: set = set()
    for fn, args in ((g, diff), (jvp, (diff, diff))):
        jaxpr, _ = compat.jaxpr_and_consts(jax.make_jaxpr(fn)(*args))
        _tainted_prims(jaxpr, prims)
    out = jax.eval_shape(g, *diff)

    def backward(d, ct):
        return jax.vjp(g, *d)[1](ct)

    closed = jax.make_jaxpr(backward)(diff, jnp.ones(out.shape, out.dtype))
    bwd, _ = compat.jaxpr_and_consts(closed)
    return _tainted_prims(bwd, prims)


@pytest.fixture(scope="module")
def coverage():
    cov = {}
    for name in EVERY:
        with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"), \
                _context(name):
            for p in covered_by(name):
                cov.setdefault(p, []).append(name)
    return cov


def test_every_registered_primitive_is_covered_or_excused(registered, coverage, capsys):
    uncovered = sorted(p for p in registered if p not in coverage and not _excused(p))
    excused_but_covered = sorted(p for p in registered if p in coverage and _excused(p))
    n_cov = len([p for p in registered if p in coverage])
    n_exc = len([p for p in registered if _excused(p) and p not in coverage])
    with capsys.disabled():
        print(f"\n[hifigrad census] jax {jax.__version__}: {len(registered)} differentiable "
              f"primitives; {n_cov} covered by {len(EVERY)} programs; {n_exc} listed in "
              f"NOT_COVERED; uncovered: {uncovered}")
    assert not uncovered, (
        f"primitives registered by jax {jax.__version__} that no program in tests/programs.py "
        f"exercises: {uncovered}. Add a program that differentiates through each, or list it in "
        f"NOT_COVERED (tests/test_census.py) with the reason it cannot carry a cotangent.")
    assert not excused_but_covered, (
        f"{excused_but_covered} are listed in NOT_COVERED but covered by "
        f"{ {p: coverage[p] for p in excused_but_covered} }: drop them from NOT_COVERED.")


def test_not_covered_names_exist(registered):
    """Every NOT_COVERED entry names a primitive of this JAX, or of the other supported one
    (the list is shared by both versions)."""
    other_version_only = {
        (0, 10): {"reduced_vary_cast", "vary_unreduced_cast", "pbroadcast_dynamic",
                  "get_global", "xla_metadata_value", "relayout", "with_memory_space_constraint"},
        (0, 12): {"box_get", "box_set", "new_box", "log_extend", "log_read", "new_log",
                  "reduced_vary_cast_p", "vary_unreduced_cast_p", "mpmd_map"},
    }[VERSION[:2]] if VERSION[:2] in ((0, 10), (0, 12)) else set(NOT_COVERED)
    other_version_only |= {p for p, v in ONLY_ON.items() if not _on(v)}
    stale = sorted(set(NOT_COVERED) - registered - other_version_only)
    assert not stale, f"NOT_COVERED lists primitives this JAX does not register: {stale}"


def test_table_is_large_enough():
    assert len(EVERY) >= 150, len(EVERY)


# ------------------------------------------------------------------------------ numerics

_DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def _params():
    """Every (program, dtype, eager/jit). Each program has one checked combination, jitted,
    in bf16 or fp16 (alternating along the table, so both dtypes run on half the programs).
    The default run checks half of the programs so, in pairs (a bf16 one and an fp16 one),
    which pairs depending on the lane (tests/lanes.py: each CI lane's are its own; issue 48);
    the `slow` tier checks the others. The
    three other combinations of each program, and all four of the few `programs.HEAVY` ones, are
    marked `sweep` (`make test-all`)."""
    out = []
    for i, name in enumerate(API):
        default = ("bf16", "fp16")[i % 2]
        for dname in _DTYPES:
            for jit in (True, False):
                reason = xfail_reason(name, VERSION, dname, jit)
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                if not (jit and dname == default) or name in HEAVY:
                    marks.append(pytest.mark.sweep)
                elif not in_turn(i // 2, 2):
                    marks.append(pytest.mark.slow)
                out.append(pytest.param(name, dname, jit, marks=marks,
                                        id=f"{name}-{dname}-{'jit' if jit else 'eager'}"))
    return out


_REFERENCE: dict = {}


def _context(name):
    return CONTEXT[name]() if name in CONTEXT else contextlib.nullcontext()


def _reference(name, dname, low_args):
    """jax.grad of the program in float32 at the low-precision inputs, up-cast (cached)."""
    key = (name, dname)
    if key not in _REFERENCE:
        fun, _ = PROGRAMS[name]
        diff, rebuild = _diff_split(low_args)
        up = [jnp.asarray(d, jnp.float32) for d in diff]
        ref = jax.jit(jax.grad(lambda *d: fun(*rebuild(d)), argnums=tuple(range(len(up)))))
        _REFERENCE[key] = [np.asarray(g, np.float64) for g in ref(*up)]
    return _REFERENCE[key]


@pytest.mark.parametrize(("name", "dname", "jit"), _params())
def test_api_program_low_precision(name, dname, jit):
    with _context(name), highest_precision():  # no TF32 (module docstring, 2.)
        _check_low_precision(name, dname, jit)


def _check_low_precision(name, dname, jit):
    fun, make = PROGRAMS[name]
    dtype = _DTYPES[dname]
    if "interp" in name:
        try:
            np.finfo(dtype)
        except ValueError:  # seen with the TPU machine's NumPy and ml_dtypes
            pytest.skip(f"this NumPy's finfo rejects {dname}, which jnp.interp calls: JAX's own "
                        "jnp.interp fails alike")
    args = make(dtype)
    diff, rebuild = _diff_split(args)
    grad = hg.grad(lambda *d: fun(*rebuild(d)), argnums=tuple(range(len(diff))))
    if name in TRACE_ONLY:  # traced, not run: the backward's gradients are float32
        for g in jax.eval_shape(jax.jit(grad) if jit else grad, *diff):
            assert g.dtype == jnp.float32, g.dtype
        return
    try:
        want = _reference(name, dname, args)
        got = (jax.jit(grad) if jit else grad)(*diff)
    except NotImplementedError as e:  # e.g. eig, spsolve: no TPU lowering in JAX itself
        if "MLIR translation rule for primitive" not in str(e):
            raise
        pytest.skip(f"JAX cannot lower this program here: {str(e).splitlines()[0]}")
    for g in got:
        assert g.dtype == jnp.float32, g.dtype
        assert np.all(np.isfinite(np.asarray(g)))
    g = np.concatenate([np.asarray(x, np.float64).ravel() for x in got])
    w = np.concatenate([x.ravel() for x in want])
    tol = TOLERANCE_FACTOR.get(name, 8) * float(jnp.finfo(dtype).eps)
    err = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
    assert err <= tol, f"normwise relative error {err:.3g} > {tol:.3g} vs f32 jax.grad"
