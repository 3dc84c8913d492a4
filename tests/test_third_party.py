"""Third-party models in bf16 under `hg.grad` with the default policy (issue 9, items 4 and 6).

Each model is built the way its library's docs write it (tests/third_party_models.py) and
differentiated three ways: `jax.grad` in float32 (the reference), `jax.grad` in bf16 and
`hg.grad` in bf16. A case passes when hifigrad's gradients are float32 and their SQNR against
the reference is no worse than bf16 `jax.grad`'s by more than 0.5 dB. The margin is not a
tolerance on hifigrad's own error: both runs share the same bf16 forward (same rounded
residuals), so hifigrad's float32 backward should be at least as close; 0.5 dB (12% more error
energy) only absorbs reductions that XLA orders differently in the two programs.
"""

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import third_party_models as tpm
from lanes import in_turn

import hifigrad as hg

BF16 = jnp.bfloat16


@pytest.fixture(autouse=True)
def _standard_promotion():
    # These libraries mix dtypes implicitly (a bf16 activation with an f32 constant or state)
    # and broadcast biases by rank promotion, as their users run them; conftest's strict modes
    # would reject their own code.
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


def _float_leaves(tree):
    return [x for x in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(jnp.result_type(x), jnp.floating)]


def _flat64(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in _float_leaves(tree)])


def sqnr_db(ref, x) -> float:
    """Signal-to-quantization-noise ratio of `x` against `ref` (pytrees), in dB."""
    r, e = _flat64(ref), _flat64(x) - _flat64(ref)
    noise = float(e @ e)
    return float("inf") if noise == 0 else 10 * np.log10(float(r @ r) / noise)


def _grad(grad_fn, case, wrap):
    g = wrap(grad_fn(case.loss, has_aux=case.has_aux))(case.params, *case.args)
    return g[0] if case.has_aux else g


@functools.cache
def _references(name):
    """The bf16 case and its two `jax.grad` gradients (f32 reference, bf16), shared by the eager
    and the jitted run of a case."""
    ref, lo = CASES[name](jnp.float32), CASES[name](BF16)
    return lo, _grad(jax.grad, ref, jax.jit), _grad(jax.grad, lo, jax.jit)


def check_case(name, maybe_jit, *, margin_db=0.5):
    lo, g_ref, g_jax = _references(name)
    g_hg = _grad(hg.grad, lo, maybe_jit)
    assert jax.tree_util.tree_structure(g_hg) == jax.tree_util.tree_structure(g_jax)
    dtypes = {np.dtype(x.dtype) for x in _float_leaves(g_hg)}
    assert dtypes == {np.dtype(np.float32)}, f"hg.grad gradients have dtypes {dtypes}"
    s_hg, s_jax = sqnr_db(g_ref, g_hg), sqnr_db(g_ref, g_jax)
    assert np.isfinite(s_jax), "the bf16 run should differ from the f32 reference"
    assert s_hg >= s_jax - margin_db, f"hg.grad SQNR {s_hg:.2f} dB < jax.grad bf16 {s_jax:.2f} dB"
    return s_hg, s_jax


# ----------------------------------------------------------------------------- the model cases

CASES = {
    "equinox_mlp": tpm.eqx_mlp,
    "equinox_transformer": tpm.eqx_transformer,
    "equinox_gru_scan": tpm.eqx_gru_scan,
    "equinox_filter_custom_vjp": tpm.eqx_filter_custom_vjp,
    "equinox_checkpointed_while": tpm.eqx_checkpointed_while,
    "haiku_resnet_batchnorm": tpm.haiku_resnet,
    "haiku_lstm": tpm.haiku_lstm,
    "keras_stateless_call": tpm.keras_mlp,
    "diffrax_recursive_checkpoint": lambda d: tpm.diffrax_node(d, "recursive_checkpoint"),
    "diffrax_direct": lambda d: tpm.diffrax_node(d, "direct"),
    "diffrax_backsolve": lambda d: tpm.diffrax_node(d, "backsolve"),
    "linen_batchnorm_axis_name": tpm.linen_batchnorm_axis,
    "nnx_gemma_attention": tpm.nnx_gemma_attention,
    "qwix_dense": tpm.qwix_dense,
}

# The libraries each case imports: a case whose library is not installed is skipped, naming it
# (the GPU machine, for one, has no dm-haiku, jmp, keras or qwix).
REQUIRES = {
    "haiku_resnet_batchnorm": ("haiku", "jmp"),
    "haiku_lstm": ("haiku", "jmp"),
    "keras_stateless_call": ("keras",),
    "diffrax_recursive_checkpoint": ("diffrax", "equinox"),
    "diffrax_direct": ("diffrax", "equinox"),
    "diffrax_backsolve": ("diffrax", "equinox"),
    "linen_batchnorm_axis_name": ("flax",),
    "nnx_gemma_attention": ("flax",),
    "qwix_dense": ("flax", "qwix"),
    **{name: ("equinox",) for name in CASES if name.startswith("equinox_")},
}


def require(*modules):
    """`pytest.importorskip` for each module, with the reason naming it."""
    for m in modules:
        pytest.importorskip(m, reason=f"{m} is not installed")


# qwix checks `isinstance(x, nnx.VariableState)`, which flax 0.12.8 deprecates on access.
FILTERS = {"qwix_dense": "ignore:'VariableState' was removed:DeprecationWarning"}


# A diffrax solve takes several seconds of compile time per gradient (three per case; the
# three adjoints were 51 s of a lane's default suite on jax 0.10.2): the default suite runs one
# adjoint jitted, in turn by lane (tests/lanes.py: each JAX release's full lane another), the
# `slow` tier every adjoint (issue 9) jitted and eagerly.
ROTATED = ["diffrax_recursive_checkpoint", "diffrax_direct", "diffrax_backsolve"]


def _params():
    for name in CASES:
        marks = []
        if name in FILTERS:
            marks.append(pytest.mark.filterwarnings(FILTERS[name]))
        if name in ROTATED and not in_turn(ROTATED.index(name), len(ROTATED)):
            marks.append(pytest.mark.slow)
        yield pytest.param(name, id=name, marks=marks)


# Eager `hg.grad` of a whole model dispatches (and compiles) op by op: about as long again as
# the jitted run, so the eager runs are in the slow suite.
@pytest.mark.parametrize("name", list(_params()))
@pytest.mark.parametrize("jit", [pytest.param(False, id="eager", marks=pytest.mark.slow),
                                 pytest.param(True, id="jit")])
def test_third_party_model(name, jit):
    require(*REQUIRES.get(name, ()))
    check_case(name, jax.jit if jit else (lambda f: f))


# ----------------------------------------------------------------------------- item 4

@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
def test_custom_vjp_unbatched_output_under_vmap(dtype, maybe_jit):
    """A `custom_vjp` under `jax.vmap` with an output that does not depend on the batch and
    whose cotangent is zero (diffrax's BacksolveAdjoint has such outputs)."""
    @jax.custom_vjp
    def f(w, x):
        return w * x, w

    def f_fwd(w, x):
        return f(w, x), (w, x)

    def f_bwd(res, cts):
        w, x = res
        gy, gw = cts
        return gy * x + gw, gy * w

    f.defvjp(f_fwd, f_bwd)

    def loss(w, xs):
        y, _ = jax.vmap(f, in_axes=(None, 0))(w, xs)
        return jnp.sum(y.astype(jnp.float32))

    w, xs = jnp.asarray(1.5, dtype), jnp.arange(4.0, dtype=dtype)
    g = maybe_jit(hg.grad(loss, argnums=(0, 1)))(w, xs)
    g_ref = jax.grad(loss, argnums=(0, 1))(w.astype(jnp.float32), xs.astype(jnp.float32))
    assert all(x.dtype == jnp.float32 for x in g)
    # w = 1.5 and xs = 0..3 are exact in bf16, and so are the gradients (sum(xs) = 6, w = 1.5).
    np.testing.assert_array_equal(g[0], g_ref[0])
    np.testing.assert_array_equal(g[1], g_ref[1])


# ----------------------------------------------------------------------------- keras import

def test_keras_import_leaves_jax_config_alone():
    """Importing keras (JAX backend) changes no global JAX config value."""
    require("keras")
    code = textwrap.dedent("""
        import os
        os.environ.setdefault("KERAS_BACKEND", "jax")
        import jax
        before = dict(jax.config.values)
        import keras
        assert keras.backend.backend() == "jax", keras.backend.backend()
        after = dict(jax.config.values)
        changed = {k: (before[k], after.get(k)) for k in before if before[k] != after.get(k)}
        assert not changed, changed
        print("ok")
    """)
    env = dict(os.environ, KERAS_BACKEND="jax")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# ----------------------------------------------------------------------------- the SQNR table

def main(names):
    """Prints each case's gradient SQNR against the f32 reference, jitted, as a markdown table:
    ``python tests/test_third_party.py [case ...]``."""
    # As conftest: bf16 numerics that do not depend on fusion (set before the backend starts).
    if "--xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_allow_excess_precision=false").strip()
    print(f"jax {jax.__version__}, Python {sys.version.split()[0]}\n")
    print("| case | jax.grad bf16 SQNR (dB) | hg.grad bf16 SQNR (dB) | hg - jax (dB) |")
    print("|---|---:|---:|---:|")
    for name in names or CASES:
        with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
            try:
                s_hg, s_jax = check_case(name, jax.jit, margin_db=float("inf"))
                print(f"| {name} | {s_jax:.1f} | {s_hg:.1f} | {s_hg - s_jax:+.1f} |", flush=True)
            except Exception as e:  # noqa: BLE001  (a table row per case, failures included)
                print(f"| {name} | fails: {type(e).__name__} | | |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
