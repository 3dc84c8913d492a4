import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hifigrad as hg
from hifigrad._src import compat
from hifigrad._src.policy import resolve_policy


def test_defaults_and_frozen():
    p = hg.Policy()
    assert p.tangent_dtype == np.dtype(jnp.float32) and p.matmul == "auto"
    assert p.unsupported == "fallback" and p.coefficients == "auto"
    assert p.matmul_precision is None and p.lax_precision() is None
    with pytest.raises(AttributeError):
        p.matmul = "fast"  # type: ignore[misc]


@pytest.mark.parametrize("field,value", [("matmul", "tf32"), ("unsupported", "ignore"),
                                         ("coefficients", "exact"),
                                         ("matmul_precision", "tf32")])
def test_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        hg.Policy(**{field: value})


def test_bad_tangent_dtype():
    with pytest.raises(ValueError, match="real floating"):
        hg.Policy(tangent_dtype=jnp.int8)
    with pytest.raises(ValueError, match="real floating"):
        hg.Policy(tangent_dtype="not a dtype")


def test_resolve_policy():
    assert resolve_policy(None, None) == hg.Policy()
    assert resolve_policy(None, jnp.float64).tangent_dtype == np.dtype(jnp.float64)
    with pytest.raises(TypeError, match="hifigrad.Policy"):
        resolve_policy({"matmul": "fast"})


@pytest.mark.parametrize("platform,mode", [("cpu", "exact"), ("gpu", "fast"), ("cuda", "fast"),
                                           ("rocm", "fast"), ("tpu", "fast")])
def test_auto_matmul_resolves_by_platform(platform, mode):
    assert hg.Policy().resolved_matmul(platform) == mode
    for explicit in ("exact", "fast"):
        assert hg.Policy(matmul=explicit).resolved_matmul(platform) == explicit


@pytest.mark.parametrize("platform,mode", [("cpu", "forward"), ("gpu", "forward"),
                                           ("cuda", "forward"), ("tpu", "tangent")])
def test_auto_coefficients_resolve_by_platform(platform, mode):
    assert hg.Policy().resolved_coefficients(platform) == mode
    for explicit in ("forward", "tangent"):
        assert hg.Policy(coefficients=explicit).resolved_coefficients(platform) == explicit


def test_auto_coefficients_as_on_a_tpu_fall_back_for_python_control_flow(monkeypatch):
    """'auto' resolved as on a TPU ('tangent') runs a function that branches in Python on an
    array value (it cannot be traced abstractly) with the forward's coefficients, as
    'forward' would; 'tangent' asked for explicitly says why it cannot."""
    monkeypatch.setenv("HIFIGRAD_PLATFORM", "tpu")
    assert hg.Policy().resolved_coefficients() == "tangent"
    x = jnp.linspace(-1, 1, 8, dtype=jnp.bfloat16)

    def f(x):
        y = jnp.tanh(x)
        # a stopped value is concrete when run eagerly under jax.grad (and hg.grad)
        power = 2 if float(lax.stop_gradient(y)[0]) < 0 else 3
        return jnp.sum(y.astype(jnp.float32) ** power)

    g = hg.grad(f)(x)
    np.testing.assert_array_equal(g, hg.grad(f, policy=hg.Policy(coefficients="forward"))(x))
    with pytest.raises(TypeError, match="coefficients='tangent'"):
        hg.grad(f, policy=hg.Policy(coefficients="tangent"))(x)
    # a function that traces gets the tangent coefficients
    h = lambda x: jnp.sum(jnp.tanh(x).astype(jnp.float32) ** 2)  # noqa: E731
    np.testing.assert_array_equal(hg.grad(h)(x),
                                  hg.grad(h, policy=hg.Policy(coefficients="tangent"))(x))


def test_auto_matmul_resolves_from_default_backend(monkeypatch):
    monkeypatch.delenv("HIFIGRAD_PLATFORM", raising=False)
    expected = "exact" if jax.default_backend() == "cpu" else "fast"
    assert hg.Policy().resolved_matmul() == expected


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu", "TPU "])
def test_hifigrad_platform_makes_another_platforms_choices(platform, monkeypatch):
    """``HIFIGRAD_PLATFORM`` makes 'auto' resolve as on that platform (so that a CPU runs a
    TPU's or a GPU's choices): the one function `auto_choices` decides, for every field."""
    from hifigrad._src.policy import auto_choices, current_platform

    monkeypatch.setenv("HIFIGRAD_PLATFORM", platform)
    name = platform.strip().lower()
    assert current_platform() == name
    choices = auto_choices(name)
    assert hg.Policy().resolved_matmul() == choices["matmul"]
    assert hg.Policy().resolved_coefficients() == choices["coefficients"]
    assert hg.Policy(matmul="exact", coefficients="forward").resolved_matmul() == "exact"
    assert auto_choices("tpu") == {"matmul": "fast", "coefficients": "tangent",
                                   "stacks": "as written"}
    assert auto_choices("gpu") == {"matmul": "fast", "coefficients": "forward",
                                   "stacks": "slices"}
    assert auto_choices("cpu") == {"matmul": "exact", "coefficients": "forward",
                                   "stacks": "slices"}


def test_hifigrad_platform_must_name_a_platform(monkeypatch):
    monkeypatch.setenv("HIFIGRAD_PLATFORM", "cuda12")
    with pytest.raises(ValueError, match="HIFIGRAD_PLATFORM='cuda12'.*'cpu', 'gpu', 'tpu'"):
        hg.Policy().resolved_matmul()


def test_tpu_choices_trace_the_tpu_program_on_any_host(monkeypatch):
    """The backward traced under HIFIGRAD_PLATFORM=tpu is the one a TPU traces for the default
    policy: the same jaxpr as the explicit policy the TPU resolves to."""
    loss, ws, x = _bf16_mlp()
    monkeypatch.setenv("HIFIGRAD_PLATFORM", "tpu")
    as_tpu = str(jax.make_jaxpr(hg.grad(loss))(ws, x))
    explicit = str(jax.make_jaxpr(hg.grad(loss, policy=hg.Policy(
        matmul="fast", coefficients="tangent")))(ws, x))
    assert as_tpu == explicit and "hifigrad_coef_mul" in as_tpu


def _bf16_mlp():
    ws = [jnp.full((16, 16), 0.05, jnp.bfloat16) * (i + 1) for i in range(2)]
    x = jnp.linspace(-1, 1, 64, dtype=jnp.bfloat16).reshape(4, 16)

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x.astype(jnp.float32) ** 2)

    return loss, ws, x


def test_default_policy_is_its_resolved_mode():
    """The default policy traces the same backward as the mode it resolves to."""
    loss, ws, x = _bf16_mlp()
    mode = hg.Policy().resolved_matmul()
    default = jax.make_jaxpr(hg.grad(loss))(ws, x)
    explicit = jax.make_jaxpr(hg.grad(loss, policy=hg.Policy(matmul=mode)))(ws, x)
    assert str(default) == str(explicit)


def test_matmul_precision_highest_reaches_backward_matmuls():
    loss, ws, x = _bf16_mlp()
    policy = hg.Policy(matmul="exact", matmul_precision="highest")
    closed = jax.make_jaxpr(hg.grad(loss, policy=policy))(ws, x)
    dots = [e for e in _eqns(closed) if e.primitive is lax.dot_general_p]
    backward = [e for e in dots if e.outvars[0].aval.dtype == jnp.float32]
    forward = [e for e in dots if e.outvars[0].aval.dtype == jnp.bfloat16]
    assert len(backward) == 3 and len(forward) == 2
    assert all(e.params["precision"] == (lax.Precision.HIGHEST,) * 2 for e in backward)
    assert all(e.params["precision"] != (lax.Precision.HIGHEST,) * 2 for e in forward), \
        "the forward's matmuls keep their own precision"
    g = hg.grad(loss, policy=policy)(ws, x)
    ref = hg.grad(loss, policy=hg.Policy(matmul="exact"))(ws, x)
    for a, b in zip(g, ref):  # on CPU an f32 matmul is float32 at every precision
        assert a.dtype == jnp.float32
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(a, b)


def test_default_matmul_precision_context_is_honoured():
    """With matmul_precision=None the backward's matmuls follow jax.default_matmul_precision,
    as jax.grad's do: the lowered program says so."""
    loss, ws, x = _bf16_mlp()
    f = jax.jit(hg.grad(loss, policy=hg.Policy(matmul="exact")))
    plain = f.lower(ws, x).as_text()
    with jax.default_matmul_precision("highest"):
        highest = jax.jit(hg.grad(loss, policy=hg.Policy(matmul="exact"))).lower(ws, x).as_text()
    assert "HIGHEST" not in plain and "HIGHEST" in highest


def test_matmul_precision_accepts_lax_precision():
    assert hg.Policy(matmul_precision=lax.Precision.HIGHEST).matmul_precision == "highest"
    assert hg.Policy(matmul_precision="high").lax_precision() == lax.Precision.HIGH


def _eqns(closed):
    jaxpr, _ = compat.jaxpr_and_consts(closed)
    for e in jaxpr.eqns:
        yield e
        for sub in compat.jaxprs_in_params(e.params):
            yield from _eqns(sub)
