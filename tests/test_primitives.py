"""The staged up-cast: same values as convert_element_type, staged into the backward."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hifigrad._src.primitives import upcast, upcast_p


def test_values_and_transforms(maybe_jit):
    x = jnp.linspace(-3, 3, 7).astype(jnp.bfloat16)
    y = maybe_jit(lambda x: upcast(x, jnp.float32))(x)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, x.astype(jnp.float32))
    xs = jnp.stack([x, 2 * x])
    np.testing.assert_array_equal(jax.vmap(lambda x: upcast(x, jnp.float32))(xs),
                                  xs.astype(jnp.float32))
    g = jax.grad(lambda x: jnp.sum(upcast(x, jnp.float32) ** 2))(x.astype(jnp.float16))
    assert g.dtype == jnp.float16


def test_partial_eval_stages_the_cast_inside_scans():
    """Transposing a scan whose body up-casts a residual stacks the bf16 residual, not f32."""
    xs = jnp.ones((5, 8), jnp.bfloat16)

    def lin(t):
        def body(c, x):
            return c + t * upcast(x, jnp.float32), None
        return lax.scan(body, jnp.zeros(8, jnp.float32), xs)[0]

    jaxpr = jax.make_jaxpr(jax.linear_transpose(lin, jnp.zeros(8, jnp.float32)))(
        jnp.ones(8, jnp.float32))
    text = str(jaxpr)
    assert "f32[5,8]" not in text, text
    assert upcast_p.name in text


# ------------------------------------------------------------------ every primitive's rules

def _package_modules():
    """Every module of the package, imported (so that every primitive it defines exists)."""
    import importlib
    import pkgutil

    import hifigrad

    names = [m.name for m in pkgutil.walk_packages(hifigrad.__path__, "hifigrad.")]
    skip = ("hifigrad.__main__", "hifigrad.demo.")  # the CLI: imports rich/matplotlib
    mods = []
    for name in names:
        if name.startswith(skip):
            continue
        try:
            mods.append(importlib.import_module(name))
        except ImportError as e:  # an optional framework (flax, equinox) not installed
            assert "optional dependency" in str(e) or not (e.name or "").startswith(
                "hifigrad"), e
    return mods


def test_every_primitive_the_package_creates_has_every_rule():
    """A primitive hifigrad binds can reach every transform: each one the package creates
    (`compat.new_primitive` records them) has its impl, abstract evaluation, lowering, JVP,
    batching rule, batch-slicing rule (`separable.rule_for`) and promotion rule
    (`rules.PROMOTE`), and a transpose rule for the operands it declares itself linear in."""
    from hifigrad._src import compat, separable
    from hifigrad._src.primitives import PRIMITIVES
    from hifigrad._src.rules import PROMOTE

    _package_modules()
    created = [p for p, module in compat.CREATED if module.split(".")[0] == "hifigrad"]
    assert {p.name for p in created} >= {"hifigrad_upcast", "hifigrad_coef_mul", "hifigrad_pin"}
    missing = []
    for p in created:
        declared = PRIMITIVES.get(p)
        jax_rules = compat.registered_rules(p)
        checks = {
            "declared in primitives.PRIMITIVES": declared is not None,
            "impl": p.impl is not None and type(p).impl is not p.impl,
            "abstract eval": p.abstract_eval is not None,
            "lowering": jax_rules["lowering"],
            "jvp": jax_rules["jvp"],
            "batching": jax_rules["batching"],
            "batch-slicing rule": separable.rule_for(p) is not None,
            "promotion rule": p in PROMOTE.rules,
            "transpose (declared linear)": (declared is None or not declared.linear
                                            or jax_rules["transpose"]),
        }
        missing += [f"{p.name}: {what}" for what, ok in checks.items() if not ok]
    assert not missing, missing


def test_no_primitive_is_created_outside_new_primitive():
    """`compat.new_primitive` is the one constructor (it records what the package creates):
    no other function of the package calls `Primitive(...)`."""
    import ast
    import pathlib

    import hifigrad

    root = pathlib.Path(hifigrad.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))]:
            if getattr(fn, "name", None) == "new_primitive":
                continue
            body = fn.body if isinstance(fn, ast.Module) else fn.body
            for node in (n for stmt in body for n in ast.walk(stmt)):
                f = node.func if isinstance(node, ast.Call) else None
                name = getattr(f, "attr", None) or getattr(f, "id", None)
                if name == "Primitive" and not _inside(tree, node, "new_primitive"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found


def _inside(tree, node, fn_name) -> bool:
    import ast

    return any(isinstance(f, ast.FunctionDef) and f.name == fn_name and node in ast.walk(f)
               for f in ast.walk(tree))


def test_pin_is_the_identity_under_every_transform(maybe_jit):
    from hifigrad._src.primitives import pin

    x = jnp.linspace(-2, 2, 12).reshape(3, 4)
    np.testing.assert_array_equal(maybe_jit(pin)(x), x)
    np.testing.assert_array_equal(jax.vmap(pin)(x), x)
    g = maybe_jit(jax.grad(lambda x: jnp.sum(jnp.sin(pin(x)))))(x)
    np.testing.assert_allclose(g, jnp.cos(x), rtol=1e-6)
    t = jax.linear_transpose(pin, x)(x)[0]
    np.testing.assert_array_equal(t, x)
    assert "optimization_barrier" in jax.jit(pin).lower(x).as_text()


def test_registered_rules_reads_every_jax_registry():
    """`compat.registered_rules` sees JAX's own rules for a JAX primitive (on every release:
    0.12's batching registry is a proxy) and none for a fresh one."""
    from hifigrad._src import compat

    assert compat.registered_rules(lax.sin_p) == {
        "lowering": True, "jvp": True, "transpose": False, "batching": True}
    assert compat.registered_rules(lax.neg_p)["transpose"]
    fresh = jax.extend.core.Primitive("fresh_for_the_test")
    assert not any(compat.registered_rules(fresh).values())
