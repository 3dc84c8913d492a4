"""hg.checkpoint and hg.scan: compressed saved activations with float32 backward passes.

Claims that a float32 program equals another float32 program to float32 rounding (uncompressed
codecs against `jax.checkpoint` / `jax.grad`, amax bookkeeping against a plain forward) run in
`platforms.highest_precision()`: on an NVIDIA GPU a float32 matmul at the default precision is
TF32, and the two programs' operands, equal to a few float32 ulps, can round to TF32 values
2**-10 apart (on CPU the context changes nothing). CPU-only claims (`platforms.cpu_only`):

| test | why only on XLA:CPU |
| --- | --- |
| `test_peak_temp_follows_saved_bytes` | temp bytes and their floor, measured on XLA:CPU |
| `test_peak_temp_is_saved_bytes_plus_one_block_on_every_release` | XLA:CPU's buffer sizes |
| `test_residuals_backward_needs_no_more_working_memory_than_inputs` | XLA:CPU's buffer sizes |
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from platforms import cpu_only, highest_precision, on_cpu

import hifigrad as hg

L, B, D = 8, 16, 64


def _setup(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.normal(size=(L, D, D)) / np.sqrt(D) * 1.2, dtype)
    x = jnp.asarray(rng.normal(size=(B, D)), dtype)
    return ws, x


def body(c, w):
    return jnp.tanh(c @ w), None


def loss(ws, x, codec):
    c = hg.scan(body, x, ws, codec=codec)[0]
    return jnp.sum(c.astype(jnp.float32) ** 2)


def loss_ref(ws, x):
    c = lax.scan(jax.checkpoint(body), x, ws)[0]
    return jnp.sum(c.astype(jnp.float32) ** 2)


def _sqnr(g, ref):
    g, ref = np.asarray(g, np.float64), np.asarray(ref, np.float64)
    return 10 * np.log10(np.sum(ref ** 2) / max(np.sum((g - ref) ** 2), 1e-300))


def test_uncompressed_equals_jax_remat(maybe_jit):
    ws, x = _setup()
    with highest_precision():  # f32 vs f32 through 8 matmuls: no TF32 (module docstring)
        g = maybe_jit(jax.grad(lambda w: loss(w, x, "none")))(ws)
        want = jax.grad(lambda w: loss_ref(w, x))(ws)
    # The same float32 program up to the derivative coefficients' source (under a TPU's
    # 'tangent' policy they are recomputed in the backward, `1 - y*y` from the saved tanh):
    # a few float32 roundings per layer of the largest entries, through L layers.
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=_f32_tol(want, L))


@pytest.mark.parametrize("codec,min_db", [("bf16", 40), ("fp8_e4m3", 20), ("fp8_e5m2", 15),
                                          ("int8", 25), ("int4", 10)])
def test_gradient_sqnr(codec, min_db, maybe_jit):
    """Floors from each format's resolution: bf16 8 bits, e4m3 4, e5m2 3, int8 ~8, int4 ~4
    significant bits (about 6 dB per bit, minus the amplification through L tanh layers)."""
    ws, x = _setup()
    want = jax.grad(lambda w: loss_ref(w, x))(ws)
    g = maybe_jit(jax.grad(lambda w: loss(w, x, codec)))(ws)
    assert g.dtype == jnp.float32
    assert _sqnr(g, want) >= min_db


def test_under_hg_grad_with_bf16_model(maybe_jit):
    ws, x = _setup(jnp.bfloat16)
    g = maybe_jit(hg.grad(lambda w: loss(w, x, "fp8_e4m3")))(ws)
    assert g.dtype == jnp.float32
    want = jax.grad(lambda w: loss_ref(w.astype(jnp.float32), x.astype(jnp.float32)))(ws)
    assert _sqnr(g, want) >= 15


def test_only_encoded_carries_are_saved():
    ws, x = _setup()
    _, f_vjp = jax.vjp(lambda w: loss(w, x, "int4"), ws)
    leaves = jax.tree_util.tree_leaves(f_vjp)
    carry_like = [l for l in leaves if l.shape == (L, B, D)]  # a stacked full-precision carry
    assert not carry_like, [(l.shape, l.dtype) for l in leaves]
    assert any(l.dtype == jnp.uint8 for l in leaves)


def test_checkpoint_function(maybe_jit):
    f = hg.checkpoint(lambda x, w: jnp.tanh(x @ w), codec="int8")
    ws, x = _setup()
    g = maybe_jit(jax.grad(lambda w: jnp.sum(f(x, w[0]) ** 2)))(ws)
    want = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w[0]) ** 2))(ws)
    assert _sqnr(g, want) >= 25


def test_checkpoint_takes_the_codec_positionally_as_compress_checkpoints_does(maybe_jit):
    ws, x = _setup()
    block = lambda x, w: jnp.tanh(x @ w)
    grads = []
    for f in (hg.checkpoint(block, "int8"), hg.checkpoint(block, codec="int8"),
              hg.checkpoint(block, hg.get_codec("int8"))):
        grads.append(maybe_jit(jax.grad(lambda w, f=f: jnp.sum(f(x, w[0]) ** 2)))(ws))
    # the same codec, however it is passed: the same gradient, bit for bit
    assert grads[0].dtype == jnp.float32
    np.testing.assert_array_equal(grads[0], grads[1])
    np.testing.assert_array_equal(grads[0], grads[2])
    # and it is the codec that is used, not ignored: int2 saves far coarser inputs
    g2 = jax.grad(lambda w: jnp.sum(hg.checkpoint(block, "int2")(x, w[0]) ** 2))(ws)
    assert not np.array_equal(np.asarray(g2), np.asarray(grads[0]))


@pytest.mark.parametrize("codec", ["int8", hg.get_codec("int8")])
def test_scan_names_the_keyword_when_the_codec_comes_positionally(codec):
    ws, x = _setup()
    body = lambda c, w: (jnp.tanh(c @ w), None)
    with pytest.raises(TypeError, match=r"pass the codec by keyword: .*codec=") as e:
        hg.scan(body, x, ws, codec)
    assert "length" in str(e.value)
    with pytest.raises(TypeError, match="no codec given"):
        hg.scan(body, x, ws)


def test_nan_is_not_hidden():
    ws, x = _setup()
    x = x.at[0, 0].set(jnp.nan)
    g = jax.grad(lambda w: loss(w, x, "int8"))(ws)
    assert np.isnan(np.asarray(g)).any()


def test_vmap_over_hg_scan():
    ws, x = _setup()
    xs = jnp.stack([x, 2 * x])
    g = jax.vmap(lambda x: jax.grad(lambda w: loss(w, x, "fp8_e4m3"))(ws))(xs)
    assert g.shape == (2,) + ws.shape and np.isfinite(np.asarray(g)).all()


def test_already_encoded_input_is_an_error():
    enc = hg.get_codec("int8").encode(jnp.ones((4, 8)))
    with pytest.raises(TypeError, match="already"):
        hg.checkpoint(lambda e: e, codec="int8")(enc)


# ------------------------------------------------------------------------------ save="residuals"

def relu_body(c, w):
    return jax.nn.relu(c @ w + 0.05), None


def relu_loss(ws, x, codec, save):
    c = hg.scan(relu_body, x, ws, codec=codec, save=save)[0]
    return jnp.sum(c.astype(jnp.float32) ** 2)


def relu_loss_ref(ws, x):
    return jnp.sum(lax.scan(relu_body, x, ws)[0].astype(jnp.float32) ** 2)


def _tangent_coefficients() -> bool:
    """Whether the default policy recomputes derivative coefficients in the backward (a TPU's
    choice, or ``HIFIGRAD_PLATFORM=tpu``): then a float32 program's backward is another
    program than `jax.grad`'s, equal to float32 rounding rather than bit for bit."""
    return hg.Policy().resolved_coefficients() == "tangent"


def _f32_tol(want, ops: int) -> float:
    """The float32 rounding two programs of `ops` chained ops may differ by, relative to the
    largest entry: a few roundings of 2**-24 per op."""
    return 8 * ops * float(np.finfo(np.float32).eps) * float(np.max(np.abs(want)))


@pytest.mark.parametrize("body_fn", [body, relu_body], ids=["tanh", "relu"])
def test_residuals_uncompressed_equal_jax_grad(body_fn, maybe_jit):
    """With codec "none" nothing is lost: the same gradient as plain `jax.grad`, bit for bit
    (the residuals are JAX's own; the backward runs at their dtype, float32); under a TPU's
    'tangent' coefficients (recomputed in the backward) to float32 rounding."""
    ws, x = _setup()
    f = lambda w: jnp.sum(hg.scan(body_fn, x, w, codec="none", save="residuals")[0] ** 2)
    with highest_precision():  # two f32 programs' matmuls: no TF32 (module docstring)
        g = maybe_jit(jax.grad(f))(ws)
        want = jax.grad(lambda w: jnp.sum(lax.scan(body_fn, x, w)[0] ** 2))(ws)
    if _tangent_coefficients():
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=_f32_tol(want, L))
    else:
        np.testing.assert_array_equal(g, want)


@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8", "int4"])
def test_residuals_keep_relu_gates_exact(codec, maybe_jit):
    """ReLU blocks: "residuals" saves the mask bit-packed, so the backward's gates are the
    forward's and only the kernels' gradients see the codec's rounding of the saved inputs;
    "inputs" recomputes the gates from decoded inputs. Residuals must be at least as close
    to the uncompressed gradient, and within the codec's resolution of it: its SQNR is at
    least that of one rounding of the saved inputs (e4m3: 3 mantissa bits, ~25 dB; int8 and
    int4 per-group absmax, 127 and 7 levels), less 6 dB for the sum over 8 blocks."""
    ws, x = _setup()
    want = jax.grad(lambda w: relu_loss_ref(w, x))(ws)
    g_res = maybe_jit(jax.grad(lambda w: relu_loss(w, x, codec, "residuals")))(ws)
    g_in = jax.grad(lambda w: relu_loss(w, x, codec, "inputs"))(ws)
    assert g_res.dtype == jnp.float32
    floor = {"fp8_e4m3": 25 - 6, "int8": 40 - 6, "int4": 15 - 6}[codec]
    assert _sqnr(g_res, want) >= max(floor, _sqnr(g_in, want)), (_sqnr(g_res, want),
                                                                 _sqnr(g_in, want))


def test_residuals_saves_encoded_activations_and_packed_masks():
    ws, x = _setup()
    _, f_vjp = jax.vjp(lambda w: relu_loss(w, x, "fp8_e4m3", "residuals"), ws)
    leaves = jax.tree_util.tree_leaves(f_vjp)
    kinds = sorted((l.dtype.name, l.shape) for l in leaves if l.shape[:1] == (L,))
    # Per block: the input in fp8 (its uint8 bit patterns) with its scale and the ReLU mask
    # (B*D bits in uint8); the weights are the scan's own argument, kept as they are (as plain
    # JAX keeps them). The pre-activation is not saved: the backward needs only its mask.
    assert kinds == [("float32", (L,)), ("float32", (L, D, D)), ("uint8", (L, B, D)),
                     ("uint8", (L, B * D // 8))], kinds
    # Not saved: the weights' own copies (recomputed from ws) and the select's zeros.
    assert not [l for l in leaves if l.shape == (L, B, D) and l.dtype == jnp.float32]


def test_residuals_of_parameters_are_recomputed_not_saved():
    """A bf16 cast of the float32 master weights is a residual of every block that depends on
    no encoded input: it is recomputed in the backward, so no bf16 copy of the stack is saved."""
    ws, x = _setup()
    f = lambda c, w: (jnp.tanh(c.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32),
                      None)
    loss = lambda w: jnp.sum(hg.scan(f, x, w, codec="int8", save="residuals")[0] ** 2)
    _, f_vjp = jax.vjp(loss, ws)
    leaves = jax.tree_util.tree_leaves(f_vjp)
    assert not [l for l in leaves if l.dtype == jnp.bfloat16 and l.shape == ws.shape]
    want = jax.grad(lambda w: jnp.sum(lax.scan(f, x, w)[0] ** 2))(ws)
    assert _sqnr(jax.grad(loss)(ws), want) >= 25


def test_residuals_under_hg_grad_with_bf16_model(maybe_jit):
    ws, x = _setup(jnp.bfloat16)
    g = maybe_jit(hg.grad(lambda w: relu_loss(w, x, "fp8_e4m3", "residuals")))(ws)
    assert g.dtype == jnp.float32
    want = jax.grad(lambda w: relu_loss_ref(w.astype(jnp.float32), x.astype(jnp.float32)))(ws)
    assert _sqnr(g, want) >= 15


def test_residuals_checkpoint_function_vmap_and_nan(maybe_jit):
    ws, x = _setup()
    f = hg.checkpoint(lambda x, w: jax.nn.gelu(x @ w), codec="int8", save="residuals")
    loss = lambda w, x: jnp.sum(f(x, w[0]) ** 2)
    g = maybe_jit(jax.grad(loss))(ws, x)
    want = jax.grad(lambda w: jnp.sum(jax.nn.gelu(x @ w[0]) ** 2))(ws)
    assert _sqnr(g, want) >= 25
    gv = jax.vmap(jax.grad(loss), in_axes=(None, 0))(ws, jnp.stack([x, -x]))
    # The saved pre-activation x @ w is int8-encoded; vmap's batched dot may round it 1 ulp
    # differently, which can move a code on a rounding boundary by one step (1/127 of the
    # group's absmax): a few elements may differ by up to that share of the gradient's scale.
    close = np.isclose(gv[0], g, rtol=1e-5, atol=1e-6)
    assert close.mean() >= 0.999, close.mean()
    assert np.max(np.abs(gv[0] - g)) <= np.max(np.abs(g)) / 127
    assert np.isnan(np.asarray(jax.grad(loss)(ws, x.at[0, 0].set(jnp.nan)))).any()


def test_bad_save_is_an_error():
    with pytest.raises(ValueError, match="save must be one of"):
        hg.checkpoint(lambda x: x, codec="int8", save="everything")
    with pytest.raises(ValueError, match="save must be one of"):
        hg.scan(body, jnp.ones((2, 2)), jnp.ones((1, 2, 2)), codec="int8", save="all")


# ------------------------------------------------------------------------------ delayed scaling

def test_delayed_scaling_through_hg_scan(maybe_jit):
    """`DelayedFP8Codec` with `codec_state`: hg.scan returns each step's carry amax; the
    state updated from them (max over steps and over vmapped microbatches) scales the next
    step, after which the gradient is as close as with current scaling (same e4m3 grid)."""
    ws, x = _setup()
    codec = hg.codecs.DelayedFP8Codec("e4m3", history_len=4)

    def loss(ws, x, state):
        c, ys, amaxes = hg.scan(body, x, ws, codec=codec, codec_state=state)
        assert ys is None
        return jnp.sum(c ** 2), amaxes

    grad = maybe_jit(jax.grad(loss, has_aux=True))
    state = codec.init_state()
    with highest_precision():  # two f32 forwards compared to 1e-6: no TF32 (module docstring)
        g0, amaxes = grad(ws, x, state)
        # amaxes[i] = max|carry| entering step i: the input, then each block's output.
        carries = [x] + list(lax.scan(lambda c, w: (body(c, w)[0],) * 2, x, ws)[1][:-1])
    np.testing.assert_allclose(amaxes, [float(jnp.max(jnp.abs(c))) for c in carries],
                               rtol=1e-6)
    xs = jnp.stack([x, 0.5 * x])  # two microbatches
    _, mb_amaxes = jax.vmap(lambda x: grad(ws, x, state))(xs)
    assert mb_amaxes.shape == (2, L)
    state = codec.update_state(state, mb_amaxes)
    np.testing.assert_allclose(state["scale"], float(jnp.max(mb_amaxes)) / 448, rtol=1e-6)
    g1, _ = grad(ws, x, state)
    want = jax.grad(lambda w: loss_ref(w, x))(ws)
    current = jax.grad(lambda w: jnp.sum(hg.scan(body, x, w, codec="fp8_e4m3")[0] ** 2))(ws)
    assert _sqnr(g1, want) >= 20
    assert abs(_sqnr(g1, want) - _sqnr(current, want)) <= 3  # 0.5 bit of e4m3's 3


def test_delayed_scaling_needs_its_state_and_save_inputs():
    ws, x = _setup()
    delayed = hg.codecs.DelayedFP8Codec()
    with pytest.raises(TypeError, match="codec_state=codec.init_state"):
        hg.scan(body, x, ws, codec=delayed)
    with pytest.raises(TypeError, match="keeps no state"):
        hg.scan(body, x, ws, codec="fp8_e4m3", codec_state=delayed.init_state())
    with pytest.raises(ValueError, match="save='inputs'"):
        hg.scan(body, x, ws, codec=delayed, codec_state=delayed.init_state(), save="residuals")


def test_residuals_forward_keeps_effects(capfd):
    """The forward of save="residuals" is evaluated from its traced program: an effect in the
    function (a debug print) runs once per forward, as with `jax.checkpoint`, not again when the
    backward recomputes parameter-only residuals."""
    def f(x, w):
        jax.debug.print("forward sees {s}", s=jnp.sum(x))
        return jnp.tanh(x @ w.astype(jnp.bfloat16)).astype(jnp.float32)

    ws, x = _setup()
    g = hg.checkpoint(f, codec="int8", save="residuals")
    jax.block_until_ready(jax.grad(lambda w: jnp.sum(g(x.astype(jnp.bfloat16), w)))(ws[0]))
    out = capfd.readouterr().out
    assert out.count("forward sees") == 1, out


# ------------------------------------------------------------ float codecs store bits (issue 12)

class _FloatStored:
    """Test-only codec: `inner`'s encoding with its data held as the float values themselves
    (bf16 / fp8 arrays), as the codecs stored it before issue 12."""

    def __init__(self, inner):
        self.inner, self.name, self.stochastic = inner, "float_stored", False

    def _fdt(self):
        return jnp.bfloat16 if isinstance(self.inner, hg.codecs.BF16Codec) else {
            "e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[self.inner.fmt]

    def encode(self, x, *, key=None, **kw):
        e = self.inner.encode(x, key=key, **kw)
        return hg.codecs.Encoded(lax.bitcast_convert_type(e.data, self._fdt()), e.scale, e.amax,
                                 e.shape, "float_stored")

    def decode(self, enc, dtype):
        bits = lax.bitcast_convert_type(enc.data, jnp.uint8 if self._fdt() != jnp.bfloat16
                                        else jnp.uint16)
        return self.inner.decode(hg.codecs.Encoded(bits, enc.scale, enc.amax, enc.shape,
                                                   self.inner.encode(jnp.ones(1)).layout), dtype)

    def nbytes(self, shape, dtype):
        return self.inner.nbytes(shape, dtype)


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "fp8_e5m2"])
def test_float_codec_gradients_bitwise_as_float_storage(name, maybe_jit):
    """Storing bit patterns changes storage only: gradients are bitwise those of the same codec
    storing bf16 / fp8 arrays (both save modes)."""
    ws, x = _setup()
    codec = hg.get_codec(name)
    for save in ("inputs", "residuals"):
        def grad(c, save=save):
            return maybe_jit(jax.grad(lambda w: jnp.sum(
                hg.scan(body, x, w, codec=c, save=save)[0] ** 2)))(ws)
        np.testing.assert_array_equal(grad(codec), grad(_FloatStored(codec)))


def mlp_body(c, p):
    """A pre-LN tanh-GELU MLP block with a residual connection."""
    mu = jnp.mean(c, -1, keepdims=True)
    z = (c - mu) * lax.rsqrt(jnp.mean((c - mu) ** 2, -1, keepdims=True) + 1e-5)
    return c + jax.nn.gelu(z @ p[0]) @ p[1], None


def _scan_temp(scan_fn, n=32, b=256, d=64, h=256):
    """Peak temp bytes of the compiled gradient of `mlp_body` scanned (compile only)."""
    ps = (jax.ShapeDtypeStruct((n, d, h), jnp.float32), jax.ShapeDtypeStruct((n, h, d),
                                                                               jnp.float32))
    xs = jax.ShapeDtypeStruct((b, d), jnp.float32)
    g = jax.jit(jax.grad(lambda p, x: jnp.mean(scan_fn(mlp_body, x, p) ** 2)))
    return g.lower(ps, xs).compile().memory_analysis().temp_size_in_bytes


@cpu_only("peak temp bytes, the 1 MiB floor and the 25% margin are XLA:CPU's buffer assignment")
def test_peak_temp_follows_saved_bytes():
    """The compiled step's peak temp shrinks with the codec's bytes, float codecs included: no
    backend-made wider copy of the stacked residual (bf16 -> f32, fp8 -> f16 on XLA:CPU, before
    issue 12). The carries stack holds n*b*d f32 = 2 MiB here; the rest of the f32 remat
    scan's temp (1 MiB, one block's recompute) is the floor. Bound: floor + what the codec saves,
    + 25% (the bf16 / fp8 stacks stored as floats gave 1.02x / 0.69x of f32 remat: they fail)."""
    ref = _scan_temp(lambda f, x, p: lax.scan(jax.checkpoint(f), x, p)[0])
    for name, ratio in [("bf16", 0.5), ("fp8_e4m3", 0.25), ("int8", 0.254)]:
        t = _scan_temp(lambda f, x, p, c=name: hg.scan(f, x, p, codec=c)[0])
        carries = 32 * 256 * 64 * 4
        assert t <= 1.25 * (ref - carries * (1 - ratio)), (name, t, ref)


@cpu_only("peak temp bytes are what XLA:CPU's scheduler and buffer assignment allocate")
def test_peak_temp_is_saved_bytes_plus_one_block_on_every_release():
    """hg.scan int8's peak temp is the saved bytes plus one block's backward working set, on
    whatever JAX release runs it (from 0.11.2 on, XLA:CPU could schedule the GELU backward
    with one more hidden-sized buffer live: +4 MiB on memory_bench's model, which took every
    codec over its peak-temp target).

    The model (`_scan_temp`'s pre-LN GELU MLP, n blocks, batch b, width d, hidden h): the forward
    saves the n encoded carries (`IntCodec.nbytes`, 0.254 of a b*d float32 carry each); the
    backward recomputes one block at a time, and the GELU backward needs three hidden-sized f32
    buffers at once (the recomputed pre-activation, its tanh, and the cotangent at the
    pre-activation), plus carry-sized ones: the cotangent carry in and out, the decoded carry,
    LayerNorm's centred input and output, the two parameter slices and their gradients (d*h =
    b*d here). Bound: saved + 3 hidden + 8 carries. Measured, in carries: 19.1 (0.10.2), 21.1
    (0.11.2, 0.12.0.1); 23.1 on 0.11.2 / 0.12.0.1 before `_freeing_first`, over 22.0.
    """
    n, b, d, h = 8, 256, 64, 256
    codec = hg.get_codec("int8")
    t = _scan_temp(lambda f, x, p: hg.scan(f, x, p, codec=codec)[0], n=n, b=b, d=d, h=h)
    carry, hidden = b * d * 4, b * h * 4
    saved = n * codec.nbytes((b, d), jnp.float32)
    bound = saved + 3 * hidden + 8 * carry
    assert t <= bound, (f"peak temp {t / carry:.2f} carries > bound {bound / carry:.2f} "
                        f"(saved {saved / carry:.2f} + 3 hidden + 8 carries)")


def _saved_scan_bytes(save, codec, n, b, d, h):
    """Bytes the forward of `_scan_temp`'s model saves for the backward, the arguments aside
    (the leaves of the vjp function that are not the parameters or the input)."""
    rng = np.random.default_rng(0)
    ps = (jnp.asarray(rng.normal(size=(n, d, h)), jnp.float32),
          jnp.asarray(rng.normal(size=(n, h, d)), jnp.float32))
    x = jnp.asarray(rng.normal(size=(b, d)), jnp.float32)
    _, f_vjp = jax.vjp(lambda p, x: hg.scan(mlp_body, x, p, codec=codec, save=save)[0], ps, x)
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(f_vjp)
               if not any(leaf is a for a in (*ps, x)))


@cpu_only("peak temp bytes are what XLA:CPU's scheduler and buffer assignment allocate")
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_residuals_backward_needs_no_more_working_memory_than_inputs(name):
    """save="residuals" recomputes a subset of what save="inputs" recomputes (the elementwise
    chains from their saved inputs, no matmul), so its backward's working set (peak temp less
    the saved bytes) is at most save="inputs"'s, on whatever JAX release runs it. Measured on
    `_scan_temp`'s model (n=8, b=256, d=64, h=256), in carries (int8: residuals / inputs):
    16.25 / 17.07 (0.10.2), 18.03 / 19.07 (0.11.2); 20.03 on 0.11.2 before the residuals
    backward ran its freeing contractions first (`_freeing_first`), over the bound."""
    n, b, d, h = 8, 256, 64, 256
    carry = b * d * 4
    work = {}
    for save in ("inputs", "residuals"):
        t = _scan_temp(lambda f, x, p, s=save: hg.scan(f, x, p, codec=name, save=s)[0],
                       n=n, b=b, d=d, h=h)
        work[save] = (t - _saved_scan_bytes(save, name, n, b, d, h)) / carry
    assert work["residuals"] <= work["inputs"], work


# ------------------------------------------- save="residuals": one tensor per chain (issue 12)

H = 4 * D


def _mlp_setup():
    rng = np.random.default_rng(1)
    p = (jnp.asarray(rng.normal(size=(L, D, H)) / np.sqrt(D), jnp.float32),
         jnp.asarray(rng.normal(size=(L, H, D)) / np.sqrt(H) / np.sqrt(L), jnp.float32))
    return p, jnp.asarray(rng.normal(size=(B, D)), jnp.float32)


def _mlp_loss(p, x, codec, save):
    return jnp.mean(hg.scan(mlp_body, x, p, codec=codec, save=save)[0] ** 2)


def test_residuals_gelu_block_saves_input_and_preactivation_only():
    """Per block: the carry and the first matmul's output, each encoded once (tanh-GELU's
    intermediates and LayerNorm's output are rebuilt elementwise), plus LayerNorm's two
    per-row sums, saved as they are. fp8: (D + H) bytes per row, 1.25x the f32 carry."""
    p, x = _mlp_setup()
    _, f_vjp = jax.vjp(lambda p: _mlp_loss(p, x, "fp8_e4m3", "residuals"), p)
    leaves = [l for l in jax.tree_util.tree_leaves(f_vjp) if l.shape[:1] == (L,)]
    big = sorted((l.dtype.name, l.shape) for l in leaves if l.size >= L * B * D)
    params = [("float32", (L, D, H)), ("float32", (L, H, D))]
    assert big == sorted([("uint8", (L, B, D)), ("uint8", (L, B, H))] + params), big
    small = sorted((l.dtype.name, l.shape) for l in leaves if l.size < L * B * D)
    # (under a TPU's 'tangent' coefficients, each LayerNorm's rsqrt saves its per-row input
    # for the coefficient the backward recomputes: two per-row values more)
    extra = [("float32", (L, B, 1))] * 2 if _tangent_coefficients() else []
    assert small == sorted([("float32", (L,))] * 2 + [("float32", (L, B))] * 2 + extra), small


def test_residuals_gelu_uncompressed_equal_jax_grad(maybe_jit):
    """Rebuilding the chains elementwise from exact values gives jax.grad's gradient."""
    p, x = _mlp_setup()
    with highest_precision():  # f32 vs f32 through 16 matmuls: no TF32 (module docstring)
        g = maybe_jit(jax.grad(lambda p: _mlp_loss(p, x, "none", "residuals")))(p)
        want = jax.grad(lambda p: jnp.mean(lax.scan(mlp_body, x, p)[0] ** 2))(p)
    for a, b in zip(g, want):
        # one f32 rounding per op, differently fused: a few ulps of the largest entry
        np.testing.assert_allclose(a, b, rtol=0, atol=2.0**-20 * float(jnp.max(jnp.abs(b))))


@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8"])
def test_residuals_sqnr_close_to_inputs(codec, maybe_jit):
    """save="residuals" rounds two tensors per block (the carry and the pre-activation), each
    with the same relative error as the carry that save="inputs" rounds: at most twice the
    error power, i.e. at most 3 dB less SQNR."""
    p, x = _mlp_setup()
    want = jax.grad(lambda p: jnp.mean(lax.scan(jax.checkpoint(mlp_body), x, p)[0] ** 2))(p)
    sq = {}
    for save in ("inputs", "residuals"):
        g = maybe_jit(jax.grad(lambda p, s=save: _mlp_loss(p, x, codec, s)))(p)
        sq[save] = _sqnr(jnp.concatenate([a.ravel() for a in g]),
                         jnp.concatenate([a.ravel() for a in want]))
    assert sq["residuals"] >= sq["inputs"] - 3.0, sq


def test_residuals_relu_gate_is_the_forwards_bit_for_bit(maybe_jit):
    """With int2 (3 levels) the decoded input is far from the forward's, yet the gradient of
    sum(relu(x) * w) w.r.t. x needs only the gate and w: save="residuals" gives
    ``where(x > 0, w, 0)`` exactly, while save="inputs" (gates recomputed from the decoded x)
    does not."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(16, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 64)), jnp.float32)
    want = jnp.where(x > 0, w, 0.0)
    for save in ("residuals", "inputs"):
        f = hg.checkpoint(lambda x: jax.nn.relu(x) * w, codec="int2", save=save)  # w: kept
        g = maybe_jit(jax.grad(lambda x, f=f: jnp.sum(f(x))))(x)
        assert np.array_equal(g, want) == (save == "residuals"), save


# ------------------------------------------------------------------ the backward in batch slices

def _attn_block(heads):
    """A bf16-friendly pre-LN transformer block: causal XLA attention and a GELU MLP 4x."""
    def block(x, p):
        b, t, d = x.shape
        dh = d // heads

        def ln(v):
            mu = jnp.mean(v, -1, keepdims=True)
            return (v - mu) * lax.rsqrt(jnp.mean((v - mu) ** 2, -1, keepdims=True) + 1e-5)

        q, k, v = jnp.split((ln(x) @ p["wqkv"]).reshape(b, t, 3, heads, dh), 3, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q[:, :, 0], k[:, :, 0]) * dh ** -0.5
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.asarray(-3e38, s.dtype))
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v[:, :, 0]).reshape(b, t, d)
        x = x + o @ p["wo"]
        return x + jax.nn.gelu(ln(x) @ p["w1"]) @ p["w2"], None
    return block


def _attn_params(n, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"wqkv": (d, 3 * d), "wo": (d, d), "w1": (d, 4 * d), "w2": (4 * d, d)}
    return {k: jnp.asarray(rng.normal(size=(n, *s)) / np.sqrt(s[0]), dtype)
            for k, s in shapes.items()}


def _count_scans(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("scan[")


def test_sliced_backward_equals_unsliced(maybe_jit):
    """A bf16 block's float32 backward in batch slices (the default) gives the unsliced
    backward's gradients, float32. Both recompute the same bf16 forward rows (bitwise, with
    excess precision off, as conftest sets); the cotangents differ only in the order the
    parameter cotangents' float32 sums over the 2048 rows are taken (per slice, then across
    the 4 slices): a few float32 eps of the largest entry (measured 2 eps; bound 16 eps).
    Under ``matmul='fast'`` (a TPU's or GPU's choice) each backward matmul rounds its float32
    cotangent to bf16, and where the two cotangents straddle a rounding boundary they differ
    by one bf16 step there: bound 2**-8 of the largest entry (measured 2**-17)."""
    n, b, t, d = 2, 16, 128, 32
    p = _attn_params(n, d, jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(b, t, d)), jnp.bfloat16)
    block = _attn_block(2)

    def loss(p, x, **kw):
        c = hg.scan(block, x, p, codec="int8", **kw)[0]
        return jnp.mean(c.astype(jnp.float32) ** 2)

    sliced = hg.grad(loss, argnums=(0, 1))
    whole = hg.grad(lambda p, x: loss(p, x, backward_slices=1), argnums=(0, 1))
    # The sliced backward is there: one more scan (the slices) than the unsliced one.
    assert _count_scans(sliced, p, x) > _count_scans(whole, p, x)
    g, want = maybe_jit(sliced)(p, x), maybe_jit(whole)(p, x)
    for a, w in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(want)):
        assert a.dtype == jnp.float32 and w.dtype == jnp.float32
        err = np.max(np.abs(np.asarray(a) - np.asarray(w)))
        rel = 2.0 ** -8 if hg.Policy().resolved_matmul() == "fast" else \
            16 * np.finfo(np.float32).eps
        assert err <= rel * np.max(np.abs(np.asarray(w))), err


def test_sliced_backward_equals_jax_grad_in_float32(maybe_jit):
    """Forced slices (``backward_slices=4``) on a float32 block give plain `jax.grad`'s
    gradients (no codec): the same float32 program, row sums reassociated (rtol 1e-5)."""
    n, b, t, d = 2, 16, 128, 32
    p = _attn_params(n, d, jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(b, t, d)), jnp.float32)
    block = _attn_block(2)

    def loss(p, x):
        return jnp.mean(hg.scan(block, x, p, codec="none", backward_slices=4)[0] ** 2)

    def loss_ref(p, x):
        return jnp.mean(lax.scan(block, x, p)[0] ** 2)

    assert _count_scans(jax.grad(loss), p, x) > _count_scans(
        jax.grad(lambda p, x: jnp.mean(hg.scan(block, x, p, codec="none")[0] ** 2)), p, x)
    with highest_precision():  # f32 vs f32 (module docstring)
        g = maybe_jit(jax.grad(loss, argnums=(0, 1)))(p, x)
        want = jax.grad(loss_ref, argnums=(0, 1))(p, x)
    for a, w in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5 * np.max(np.abs(w)))


def _batch_mixing(kind):
    def block(x, w):
        if kind == "batch_mean":  # BatchNorm-style statistics over the batch
            x = x - jnp.mean(x, axis=0, keepdims=True)
        elif kind == "row_position":  # depends on the row's index in the batch
            x = x * (1.0 + lax.broadcasted_iota(jnp.float32, x.shape, 0))
        elif kind == "batch_matmul":  # contracts over the batch
            x = x + x @ (jnp.einsum("bij,bik->jk", x, x) * 1e-4)
        return jnp.tanh(x @ w)
    return block


@pytest.mark.parametrize("kind", ["batch_mean", "row_position", "batch_matmul"])
def test_non_separable_block_falls_back(kind, maybe_jit):
    """A block that mixes rows along the batch axis is found so from its program and its
    backward runs at once, even when slices are asked for: the gradients are plain
    `jax.grad`'s (float32, rtol 1e-5), which a sliced backward would get wrong."""
    from hifigrad._src.separable import NotSeparable, batch_axes

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(32, 32)) / 6, jnp.float32)
    x = jnp.asarray(rng.normal(size=(64, 32, 32)), jnp.float32)
    block = _batch_mixing(kind)
    with pytest.raises(NotSeparable):
        batch_axes(jax.make_jaxpr(block)(x, w).jaxpr, [0, None], 64)
    f = hg.checkpoint(block, codec="none", backward_slices=4)
    loss = lambda w, x: jnp.mean(f(x, w) ** 2)  # noqa: E731
    assert _count_scans(jax.grad(loss), w, x) == 0
    with highest_precision():
        g = maybe_jit(jax.grad(loss, argnums=(0, 1)))(w, x)
        want = jax.grad(lambda w, x: jnp.mean(block(x, w) ** 2), argnums=(0, 1))(w, x)
    for a, b in zip(g, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.max(np.abs(b)))


def test_separable_block_is_found_separable():
    """The analysis accepts the transformer block (attention with a causal mask, LayerNorm,
    GELU MLP: each row from its own row) and reports the output's batch axis."""
    from hifigrad._src.separable import batch_axes

    p = jax.tree_util.tree_map(lambda a: a[0], _attn_params(1, 32, jnp.bfloat16))
    x = jnp.zeros((16, 128, 32), jnp.bfloat16)
    leaves, tree = jax.tree_util.tree_flatten(p)
    jaxpr = jax.make_jaxpr(lambda x, *l: _attn_block(2)(x, tree.unflatten(l))[0])(x, *leaves)
    assert batch_axes(jaxpr.jaxpr, [0] + [None] * len(leaves), 16) == [0]


def test_bad_backward_slices_is_an_error():
    with pytest.raises(ValueError, match="backward_slices must be None"):
        hg.checkpoint(jnp.tanh, codec="int8", backward_slices=0)(jnp.ones((4, 4)))
    with pytest.raises(ValueError, match="backward_slices must be None"):
        hg.scan(body, jnp.ones((2, 4)), jnp.ones((3, 4, 4)), codec="int8", backward_slices=1.5)


_MAKERS = {
    "hifigrad.checkpoint": lambda f, codec, **kw: hg.checkpoint(f, codec, **kw),
    "compress_checkpoints": lambda f, codec, **kw: hg.compress_checkpoints(f, codec, **kw),
}


@pytest.mark.parametrize("where", sorted(_MAKERS))
@pytest.mark.parametrize("bad, error, match", [
    (dict(f=None), TypeError, "expected a function to checkpoint; got None"),
    (dict(backward_slices=0), ValueError, "backward_slices must be None .* got 0"),
    (dict(backward_slices=-3), ValueError, "backward_slices must be None .* got -3"),
    (dict(codec=hg.codecs.DelayedFP8Codec()), TypeError,
     "codec .* uses delayed scaling.*codec_state"),
    (dict(policy=jax.checkpoint_policies.nothing_saveable), TypeError,
     "`policy` is a hifigrad.Policy"),
])
def test_checkpoints_check_their_arguments_where_they_are_made(where, bad, error, match):
    """`hg.checkpoint` and `compress_checkpoints` refuse a bad argument when they are made
    (not at the first call, from inside the library), with the same message naming it and
    what to pass (issue 49); `hg.scan` says the same at its call."""
    kw = dict(f=jnp.tanh, codec="int8")
    kw.update(bad)
    f, codec = kw.pop("f"), kw.pop("codec")
    with pytest.raises(error, match=f"{where}: {match}" if "slices" not in match else match):
        _MAKERS[where](f, codec, **kw)
    if "f" not in bad:
        with pytest.raises(error, match=match):
            hg.scan(lambda c, x: (f(c), None), jnp.ones((2, 4)), jnp.ones((3, 4)),
                    codec=codec, **{k: v for k, v in kw.items()})


def test_checkpoint_passes_keyword_arguments_as_jax_checkpoint_does(maybe_jit):
    """``hg.checkpoint(f)(x, scale=2.0)``: keyword arguments reach `fun` (and are
    differentiated), as with `jax.checkpoint`."""
    def f(x, scale=1.0):
        return jnp.tanh(x) * scale

    # (not symmetric about 0: the sum of tanh(x) that d/d scale is must not cancel to rounding
    # noise, which a relative tolerance cannot compare; it did on jax 0.11.1)
    x = jnp.linspace(-0.5, 1, 8).reshape(2, 4)
    for ck in (jax.checkpoint(f), hg.checkpoint(f, "none")):
        g = maybe_jit(jax.grad(lambda x, s, ck=ck: jnp.sum(ck(x, scale=s)), (0, 1)))(x, 2.0)
        np.testing.assert_allclose(g[0], 2.0 * (1 - jnp.tanh(x) ** 2), rtol=1e-6)
        np.testing.assert_allclose(g[1], jnp.sum(jnp.tanh(x)), rtol=1e-6)


@cpu_only("peak temp bytes are what XLA:CPU's scheduler and buffer assignment allocate")
@pytest.mark.no_slice_check
def test_float32_backward_peak_temp_within_bf16_backwards():
    """On a bf16 transformer stack (8 blocks, d=128, 16 x 128 tokens, 4 heads), `hg.grad`
    over `hg.scan` int8 (float32 backward, sliced by default) peaks at most 1.03x the same
    checkpoints' bf16 backward (`jax.grad` with ``tangent_dtype=bf16``), and below the bf16
    remat scan. Unsliced, the float32 backward's cotangents of the attention scores and the
    MLP hidden took it to 1.6x / 1.5x (jax 0.10.2)."""
    n, b, t, d = 8, 16, 128, 128
    p = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                               jax.eval_shape(lambda: _attn_params(n, d, jnp.bfloat16)))
    x = jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16)
    block = _attn_block(4)

    def temp(grad, scan_fn):
        step = grad(lambda p, x: jnp.mean(scan_fn(p, x).astype(jnp.float32) ** 2))
        return jax.jit(step).lower(p, x).compile().memory_analysis().temp_size_in_bytes

    f32 = temp(hg.grad, lambda p, x: hg.scan(block, x, p, codec="int8")[0])
    bf16 = temp(jax.grad, lambda p, x: hg.scan(block, x, p, codec="int8",
                                                tangent_dtype=jnp.bfloat16)[0])
    remat = temp(jax.grad, lambda p, x: lax.scan(jax.checkpoint(block), x, p)[0])
    assert f32 <= 1.03 * bf16, (f32 / bf16, f32, bf16)
    assert f32 <= remat, (f32 / remat, f32, remat)


# ------------------------------------------------------------------------------ typed PRNG keys

def _dropout_body(c, xs):
    """A layer with its own typed PRNG key in `xs` (dropout)."""
    w, key = xs
    h = jnp.tanh(c @ w)
    return jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h, jnp.zeros_like(h)), None


def _key_carry_body(c, w):
    """The key travels in the carry and is split every step."""
    h, key = c
    key, sub = jax.random.split(key)
    h = jnp.tanh(h @ w)
    return (jnp.where(jax.random.bernoulli(sub, 0.9, h.shape), h, jnp.zeros_like(h)), key), None


@pytest.mark.parametrize("where, save, outer", [
    ("xs", "inputs", "jax.grad"), ("xs", "residuals", "hg.grad"),
    ("carry", "inputs", "hg.grad"), ("carry", "residuals", "jax.grad")])
def test_typed_keys_through_scan(where, save, outer, maybe_jit):
    """Typed keys in `xs` or in the carry are saved as they are: with codec 'none' the float32
    gradients equal jax.grad's of the same remat scan to float32 rounding."""
    ws, x = _setup()
    keys = jax.random.split(jax.random.key(7), L)
    if where == "xs":
        def run(scan, ws, x):
            return scan(_dropout_body, x, (ws, keys))[0]
    else:
        def run(scan, ws, x):
            return scan(_key_carry_body, (x, jax.random.key(7)), ws)[0][0]
    grad = jax.grad if outer == "jax.grad" else hg.grad
    # Both under `highest`: at JAX's default precision a TPU multiplies float32 in one bf16
    # pass, and the two sides (different programs) round differently (5-20% apart there).
    with highest_precision():
        got = maybe_jit(grad(lambda ws, x: jnp.sum(run(
            lambda f, c, xs: hg.scan(f, c, xs, codec="none", save=save), ws, x) ** 2)))(ws, x)
        want = jax.grad(lambda ws, x: jnp.sum(run(
            lambda f, c, xs: lax.scan(jax.checkpoint(f), c, xs), ws, x) ** 2))(ws, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=_f32_tol(want, L))


@pytest.mark.parametrize("save", ["inputs", "residuals"])
def test_typed_key_argument_of_checkpoint(save, maybe_jit):
    f = hg.checkpoint(lambda x, key: jnp.tanh(x) * jax.random.normal(key, x.shape),
                      codec="int8", save=save)
    key = jax.random.key(0)
    x = jnp.linspace(-2, 2, 16, dtype=jnp.float32)
    for grad in (jax.grad, hg.grad):
        g = maybe_jit(grad(lambda x: jnp.sum(f(x, key))))(x)
        want = (1 - jnp.tanh(x) ** 2) * jax.random.normal(key, x.shape)
        np.testing.assert_allclose(g, want, rtol=2 ** -6, atol=2 ** -6)  # int8: 2**-7 of max


def test_block_that_bakes_its_batch_size_in_slices(maybe_jit):
    """A block that writes the full batch's shapes as Python ints (here a broadcast to 16
    rows, as hand-written transformers do with ``reshape(B, T, H, D)``) slices: its program,
    traced once at the full batch, is what is resized to a slice, not its Python. Its
    gradients are the unsliced backward's (float32 sums over slices reassociated: norm-wise
    within 2**-20, about 64 float32 eps)."""
    n, b, t, d = 2, 16, 128, 32
    p = _attn_params(n, d, jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(b, t, d)), jnp.bfloat16)
    block = _attn_block(2)

    def fixed(c, q):
        return block((c + jnp.zeros((16, t, d), c.dtype)).reshape(16, t, d), q)

    def loss(p, x, **kw):
        c = hg.scan(fixed, x, p, codec="int8", **kw)[0]
        return jnp.mean(c.astype(jnp.float32) ** 2)

    whole = hg.grad(lambda p, x: loss(p, x, backward_slices=1))
    assert hg.slice_report(hg.grad(loss), p, x) == ["sliced: 4 slices of 4 batch rows"]
    assert _count_scans(hg.grad(loss), p, x) == _count_scans(whole, p, x) + 1
    g, want = maybe_jit(hg.grad(loss))(p, x), maybe_jit(whole)(p, x)
    for a, w in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(want)):
        assert a.dtype == jnp.float32
        err = np.linalg.norm(np.asarray(a) - np.asarray(w)) / np.linalg.norm(np.asarray(w))
        assert err <= 2.0 ** -20, err


_SHARDED_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import hifigrad as hg
from test_checkpoint import _attn_block, _attn_params
mesh = Mesh(np.array(jax.devices()), ("d",))
rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
p = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep),
                           jax.eval_shape(lambda: _attn_params(2, 64, jnp.bfloat16)))
x = jax.ShapeDtypeStruct((64, 128, 64), jnp.bfloat16, sharding=rows)
block = _attn_block(2)
for k in (1, 4):
    loss = lambda p, x, k=k: jnp.mean(hg.scan(block, x, p, codec="int8", backward_slices=k)[0]
                                      .astype(jnp.float32) ** 2)
    c = jax.jit(hg.grad(loss)).lower(p, x).compile()
    print(k, c.as_text().count("all-gather("), c.memory_analysis().temp_size_in_bytes)
"""


@cpu_only("4 host devices made by --xla_force_host_platform_device_count, XLA:CPU's buffers")
@pytest.mark.no_slice_check
def test_sliced_backward_keeps_a_sharded_batch_sharded():
    """With the batch sharded over 4 devices, the sliced backward gathers nothing: each slice
    takes every k-th row, so each device slices its own rows (contiguous slices made XLA's SPMD
    partitioner all-gather the batch: 2 all-gathers, per-device temp 54.6 -> 62.6 MiB on the
    benchmark's small model), and its per-device peak temp is below the unsliced backward's."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
                   [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = {int(k): (int(g), int(t)) for k, g, t in
           (line.split() for line in out.stdout.strip().splitlines()[-2:])}
    assert res[4][0] == 0, res
    assert res[4][1] < res[1][1], res


# ------------------------------------------------------------------ checking the slices

def _check_slices_loss(policy):
    """A bf16 attention stack whose float32 backward runs in 4 slices, checked (`policy`)."""
    p = _attn_params(2, 32, jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 128, 32)), jnp.bfloat16)
    block = _attn_block(2)

    def loss(p, x):
        c = hg.scan(block, x, p, codec="int8", policy=policy, backward_slices=4)[0]
        return jnp.mean(c.astype(jnp.float32) ** 2)

    return loss, p, x


@pytest.mark.no_slice_check
def test_check_slices_passes_a_right_slicing(maybe_jit):
    """`Policy(check_slices=True)` runs the unsliced backward beside the sliced one and
    raises nothing where they agree; the gradients are the sliced ones."""
    loss, p, x = _check_slices_loss(hg.Policy(check_slices=True))
    plain, _, _ = _check_slices_loss(hg.Policy())
    assert hg.slice_report(hg.grad(loss), p, x) == ["sliced: 4 slices of 4 batch rows"]
    g, want = maybe_jit(hg.grad(loss))(p, x), maybe_jit(hg.grad(plain))(p, x)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.no_slice_check
@pytest.mark.parametrize("how", ["policy", "environment"])
def test_check_slices_names_a_wrong_slicing(how, maybe_jit, monkeypatch):
    """A wrong sliced backward (simulated: the slices' rows put back in reverse order) raises
    `SliceCheckError` naming the checkpoint's source line, under jit as eagerly (there JAX
    reports it as a runtime error of the callback, with the same message)."""
    from hifigrad._src import checkpoint as ck

    unsplit = ck._unsplit
    monkeypatch.setattr(ck, "_unsplit", lambda y, *a: unsplit(y[::-1], *a))
    if how == "environment":
        monkeypatch.setenv("HIFIGRAD_CHECK_SLICES", "1")
    loss, p, x = _check_slices_loss(hg.Policy(check_slices=how == "policy"))
    with pytest.raises(Exception, match=r"the checkpoint at .*test_checkpoint\.py:\d+") as e:
        jax.block_until_ready(maybe_jit(hg.grad(loss, argnums=1))(p, x))
    assert isinstance(e.value, (hg.SliceCheckError, RuntimeError))
    assert "ran its backward in 4 batch slices" in str(e.value)


def test_check_slices_is_a_bool():
    with pytest.raises(ValueError, match="check_slices must be True or False"):
        hg.Policy(check_slices="yes")


def test_slice_report_traces_a_scan_body_traced_before(caplog, monkeypatch):
    """`lax.scan` caches its body's trace by function: a report made after the step ran (or a
    second report) still sees the checkpoint (it was [] before), and the jitted step it
    followed is not compiled again (a step without host callbacks: the slice check's first
    run has one, and JAX dispatches such a step from Python, whose caches the report empties)."""
    monkeypatch.delenv("HIFIGRAD_CHECK_SLICES", raising=False)
    ck = hg.checkpoint(lambda c, w: (jnp.tanh(c @ w), None), "int8")

    def loss(ws, x):
        return jnp.mean(lax.scan(ck, x, ws)[0].astype(jnp.float32) ** 2)

    ws = jnp.full((3, 32, 32), 0.05, jnp.bfloat16)
    x = jnp.ones((1024, 32), jnp.bfloat16)        # 4 slices of 256 rows
    step = jax.jit(hg.grad(loss))
    step(ws, x)
    want = ["sliced: 4 slices of 256 batch rows"]
    assert hg.slice_report(hg.grad(loss), ws, x) == want
    assert hg.slice_report(hg.grad(loss), ws, x) == want
    assert hg.slice_report(loss, ws, x) == want
    with caplog.at_level("WARNING"), jax.log_compiles():
        step(ws, x)
    assert not [r for r in caplog.records if "ompil" in r.getMessage()], caplog.text


def _float64_grads(x, w, ct):
    """d(sum(ct * tanh(x @ w)))/d(x, w) in float64 (numpy)."""
    x, w, ct = (np.asarray(a, np.float64) for a in (x, w, ct))
    d = ct * (1 - np.tanh(x @ w) ** 2)
    return d @ w.T, x.T @ d


def test_encode_argnums_saves_the_parameters_exact(maybe_jit):
    """With ``encode_argnums=0`` only the activation is encoded: the weight's gradient is the
    float64 one at the decoded activation and the exact weight, to float32 rounding (2**-20
    of its norm: 64-term dot products of float32 values, eps 2**-24 each). Every float input
    encoded (the default) recomputes with the int8-rounded weight, which the same comparison
    rejects (int8's relative step, about 2**-8, is far above that tolerance)."""
    from hifigrad._src.codecs import get_codec

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(32, 32)) * 0.2, jnp.float32)
    ct = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
    codec = get_codec("int8")
    x_dec = codec.decode(codec.encode(x), jnp.float32)
    want_x, want_w = _float64_grads(x_dec, w, ct)

    def grads(**kw):
        f = hg.checkpoint(lambda x, w: jnp.tanh(x @ w), "int8", **kw)
        with highest_precision():
            return maybe_jit(jax.grad(lambda x, w: jnp.sum(ct * f(x, w)), (0, 1)))(x, w)

    def err(a, b):
        return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)

    gx, gw = grads(encode_argnums=0)
    # (a TPU's tanh is an approximation good to 4-5 digits: 2**-14 there, still far below
    # the int8-rounded weight's error)
    tol = 2.0 ** -20 if on_cpu() else 2.0 ** -14
    assert err(gw, want_w) <= tol and err(gx, want_x) <= tol
    assert hg.checkpoint(lambda x, w: x @ w, "int8", encode_argnums=(-2,))(x, w).shape == (64, 32)
    _, gw_all = grads()
    assert err(gw_all, want_w) > 2.0 ** -12


def test_encode_argnums_under_a_scan_slices():
    """Under `lax.scan` with the per-step weights as arguments, ``encode_argnums=0`` still
    slices the backward, and its gradient is the unsliced one's (float32 summation order:
    2**-20 of the norm)."""
    def loss(ws, x, **kw):
        ck = hg.checkpoint(lambda c, w: (jnp.tanh(c @ w), None), "int8", encode_argnums=0,
                           **kw)
        return jnp.mean(lax.scan(ck, x, ws)[0].astype(jnp.float32) ** 2)

    rng = np.random.default_rng(1)
    ws = jnp.asarray(rng.normal(size=(3, 64, 64)) * 0.1, jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(1024, 64)), jnp.bfloat16)
    assert hg.slice_report(hg.grad(loss), ws, x) == ["sliced: 4 slices of 256 batch rows"]
    g = jax.jit(hg.grad(loss))(ws, x)
    want = jax.jit(hg.grad(lambda ws, x: loss(ws, x, backward_slices=1)))(ws, x)
    assert g.dtype == jnp.float32
    assert np.linalg.norm(g - want) <= 2.0 ** -20 * np.linalg.norm(want)


def test_encode_argnums_bad_input():
    with pytest.raises(TypeError, match="encode_argnums takes an int"):
        hg.checkpoint(lambda x: x, "int8", encode_argnums="x")
    with pytest.raises(TypeError, match="encode_argnums takes an int"):
        hg.checkpoint(lambda x: x, "int8", encode_argnums=True)
    f = hg.checkpoint(lambda x, w: x @ w, "int8", encode_argnums=2)
    with pytest.raises(ValueError, match="called with 2 positional"):
        f(jnp.ones((4, 4)), jnp.ones((4, 4)))


# ------------------------------------------------------------------ choosers under XLA's fusion

def _chooser_block(h, w):
    """Issue 45's block: a saturating activation, a per-position scale, a table gathered by
    batch-shaped indices, and a min over an axis kept in the gradient."""
    B, T, D = h.shape
    x2 = (h @ w["W0"]) ** 3 * 0.1
    x4 = jnp.exp(-x2 * x2) * w["p1"].reshape(1, -1, 1)
    x5 = x4 + w["tab2"].at[jnp.broadcast_to(jnp.arange(T) % 32, (B, T))].get()
    x6 = jnp.swapaxes(x5, 1, 2)
    return jnp.swapaxes(x6 * jnp.min(x6, axis=1, keepdims=True), 1, 2)


def _chooser_args():
    k = jax.random.split(jax.random.key(0), 5)
    h = jax.random.normal(k[0], (16, 128, 4))
    w = {"W0": jax.random.normal(k[1], (4, 4)), "p1": jax.random.normal(k[2], (128,)),
         "tab2": jax.random.normal(k[3], (32, 4))}
    c = jnp.sin(jnp.arange(16 * 128 * 4.0)).reshape(16, 128, 4)
    return h, w, c


@pytest.mark.parametrize("entry", ["checkpoint-1", "checkpoint-4", "scan", "compress"])
def test_chooser_gradient_is_right_whatever_xla_fuses(entry, maybe_jit):
    """A min kept in the gradient: its JVP compares the operand with the minimum, and XLA:CPU
    (jax 0.12) computed the operand bitwise differently in the two fusions it duplicated it
    into once the checkpoint's backward reordered its matmuls: the comparison found no
    minimum and the gradient was off by 46% (issue 45). hifigrad pins a differentiated
    chooser's operand (`primitives.pin_p`), so every entry point equals the eager float64
    gradient to float32 rounding, jitted and not, on every release."""
    h, w, c = _chooser_args()

    def loss(f):
        return lambda h, w: jnp.sum(f(h, w) * c)

    if entry.startswith("checkpoint"):
        f = hg.checkpoint(_chooser_block, "none", backward_slices=int(entry[-1]))
        fn = jax.grad(loss(f), (0, 1))
    elif entry == "scan":
        def scanned(h, w):
            out, _ = hg.scan(lambda x, _: (_chooser_block(x, w), None), h, None, length=1,
                             codec="none")
            return jnp.sum(out * c)
        fn = jax.grad(scanned, (0, 1))
    else:
        def remat_loss(h, w):
            return jnp.sum(jax.checkpoint(_chooser_block)(h, w) * c)
        fn = jax.grad(hg.compress_checkpoints(remat_loss, "none"), (0, 1))
    with highest_precision():  # float32 matmuls (a TPU's default is one bf16 pass)
        got = maybe_jit(fn)(h, w)
    with jax.enable_x64():
        to64 = lambda t: jax.tree.map(lambda a: np.asarray(a, np.float64), t)  # noqa: E731
        want = jax.grad(lambda h, w: jnp.sum(_chooser_block(h, w) * jnp.asarray(c, jnp.float64)),
                        (0, 1))(*to64((h, w)))
        want = [np.asarray(r) for r in jax.tree.leaves(want)]
    # float32 rounding of a few ops per element, relative to the leaf's norm (a TPU's exp is
    # an approximation good to 4-5 digits: 2**-10 there; the wrong gradient was off by 0.46)
    tol = 1e-5 if on_cpu() else 2.0 ** -10
    for g, r in zip(jax.tree.leaves(got), want):
        err = np.linalg.norm(np.asarray(g, np.float64) - r) / np.linalg.norm(r)
        assert err < tol, (entry, err)


def test_only_differentiated_choosers_are_pinned():
    """Under a trace, the operand of a `reduce_max`/`reduce_min` whose result is differentiated
    is pinned (one `hifigrad_pin`); a max that only feeds `stop_gradient` (log_softmax's,
    logsumexp's) is not, so a model's softmaxes keep XLA's fusion."""
    x = jnp.linspace(-1.0, 1.0, 24).reshape(4, 6)

    def pins(f):
        text = str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(f(x))))(x))
        hg_text = str(jax.make_jaxpr(hg.grad(lambda x: jnp.sum(f(x))))(x))
        assert "hifigrad_pin" not in text  # plain JAX: untouched
        return hg_text.count("hifigrad_pin")

    assert pins(lambda x: x * jnp.max(x, axis=1, keepdims=True)) == 1
    assert pins(lambda x: jnp.min(jnp.tanh(x), axis=0)) == 1
    assert pins(lambda x: jax.nn.log_softmax(x) ** 2) == 0
    assert pins(lambda x: jax.nn.logsumexp(x, axis=1)) == 0
    assert pins(lambda x: jax.nn.softmax(x) * x) == 0
    assert pins(lambda x: jnp.argmax(x, axis=1).astype(x.dtype) * x[:, 0]) == 0
    # inside a scan and a jit: entered only because a chooser is inside
    assert pins(lambda x: lax.scan(lambda c, r: (c + jnp.max(r * c), None), 1.0, x)[0]) == 1
    assert pins(lambda x: jax.jit(lambda y: y * jnp.min(y))(x)) == 1


# ------------------------------------------------------------------ the policy inside checkpoints

def _fast_entry(entry):
    def body(c, w):
        return jnp.tanh(c @ w), None

    if entry == "checkpoint":
        def loss(ws, x):
            for w in ws:
                x = hg.checkpoint(lambda c, w: body(c, w)[0], "int8")(x, w)
            return jnp.sum(x.astype(jnp.float32) ** 2)
    elif entry == "scan":
        def loss(ws, x):
            return jnp.sum(hg.scan(body, x, ws, codec="int8")[0].astype(jnp.float32) ** 2)
    else:
        def loss(ws, x):
            return jnp.sum(lax.scan(jax.checkpoint(body), x, ws)[0].astype(jnp.float32) ** 2)
        loss = hg.compress_checkpoints(loss, "int8")
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.normal(size=(3, 64, 64)) / 8, jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(32, 64)), jnp.bfloat16)
    return loss, ws, x


@pytest.mark.parametrize("entry", ["checkpoint", "scan", "compress"])
def test_the_transforms_matmul_policy_reaches_checkpoints(entry):
    """``hg.grad(f, policy=Policy(matmul='fast'))`` runs the recomputed backward of every
    checkpoint in ``f`` made without a policy of its own with fast matmuls (issue 51: it ran
    them exact, and the checkpoint's backward was promoted again, undoing the rounding):
    lowered for a TPU (on this host) its backward dots take bf16 operands and accumulate in
    float32, as the unchecked `hg.grad`'s do; under 'exact' none does. On CPU the values
    differ from exact's by the cotangent's bf16 rounding."""
    import re

    from hifigrad._src import compat

    loss, ws, x = _fast_entry(entry)

    def lowered(mode):
        f = jax.jit(hg.grad(loss, policy=hg.Policy(matmul=mode)))
        text = compat.lower_for(f, (ws, x), "tpu")
        return re.findall(r"stablehlo.dot_general.*?: \(tensor<[^)]*xbf16>, tensor<[^)]*xbf16>\)"
                          r" -> tensor<[^>]*xf32>", text)

    fast, exact = lowered("fast"), lowered("exact")
    # two backward matmuls per block (a scan's body holds one block), but the first block's
    # input is not differentiated: 3 + 2 in the loop of three
    assert len(fast) == (5 if entry == "checkpoint" else 2) and not exact, (len(fast), exact)
    g = {m: jax.jit(hg.grad(loss, policy=hg.Policy(matmul=m)))(ws, x) for m in ("exact", "fast")}
    assert g["fast"].dtype == jnp.float32
    diff = float(jnp.max(jnp.abs(g["fast"] - g["exact"])))
    scale = float(jnp.max(jnp.abs(g["exact"])))
    # a cotangent rounded to bf16 (2**-8 relative) in each backward matmul, not more; on a
    # TPU a float32 matmul at the default precision is itself one bf16 pass: the same
    # products, so no difference there
    assert diff <= 3 * 2.0 ** -8 * scale * 4, (diff, scale)
    assert (diff > 0) == on_cpu(), diff


def test_a_checkpoints_own_policy_wins_over_the_transforms():
    """A checkpoint given its own policy keeps it under any transform; one made without takes
    the enclosing hifigrad transform's (`policy.INHERIT`), and the default under jax.grad."""
    from hifigrad._src import checkpoint as ck

    seen = []
    orig = ck._whole_backward

    def spy(fun_flat, policy, *a):
        seen.append(policy.matmul)
        return orig(fun_flat, policy, *a)

    x = jnp.ones((4, 8), jnp.bfloat16)
    w = jnp.ones((8, 8), jnp.bfloat16) * 0.1
    own = hg.checkpoint(lambda x, w: jnp.tanh(x @ w), "none", backward_slices=1,
                        policy=hg.Policy(matmul="exact"))
    inherits = hg.checkpoint(lambda x, w: jnp.tanh(x @ w), "none", backward_slices=1)
    try:
        ck._whole_backward = spy
        for f in (own, inherits):
            loss = lambda w, f=f: jnp.sum(f(x, w).astype(jnp.float32))  # noqa: E731
            jax.jit(hg.grad(loss, policy=hg.Policy(matmul="fast")))(w)
            jax.jit(jax.grad(loss))(w)
    finally:
        ck._whole_backward = orig
    assert seen == ["exact", "exact", "fast", "auto"], seen


# ------------------------------------------------------------------ what slicing refused wrongly

def _rows(seed=0, shape=(8, 8, 8)):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=shape[-1:] * 2) / 3, jnp.float32)
    return h, w


@pytest.fixture
def small_slices(monkeypatch):
    from hifigrad._src import checkpoint as ck

    monkeypatch.setattr(ck, "MIN_SLICE_ROWS", 1)


@pytest.mark.parametrize("case", ["int_output_first", "scan_step_carry", "scan_key_carry"])
def test_integer_outputs_and_carries_before_the_float_ones_slice(case, small_slices, maybe_jit):
    """An integer output or carry before the float ones (``(argmax, z)``, a scan carry of
    ``(step, h)`` or ``(key, h)``) no longer ends the slicing in a bare StopIteration (the
    float outputs' cotangents were paired with every output): it slices, and equals the
    unsliced backward."""
    h, w = _rows()

    def step_body(c, _):
        step, x = c
        return (step + 1, jnp.tanh(x @ w)), None

    def key_body(c, _):
        key, x = c
        return (jax.random.split(key)[0], jnp.tanh(x @ w)), None

    def loss(h, k):
        if case == "int_output_first":
            f = hg.checkpoint(lambda x, w: (jnp.argmax(x, -1), jnp.tanh(x @ w)), "none",
                              backward_slices=k)
            return jnp.sum(f(h, w)[1] ** 2)
        init = (0 if case == "scan_step_carry" else jax.random.key(0), h)
        body_ = step_body if case == "scan_step_carry" else key_body
        return jnp.sum(hg.scan(body_, init, None, length=2, codec="none",
                               backward_slices=k)[0][1] ** 2)

    assert hg.slice_report(lambda h: loss(h, 4), h) == ["sliced: 4 slices of 2 batch rows"] * (
        1 if case == "int_output_first" else hg.slice_report(lambda h: loss(h, 4), h).__len__())
    got = maybe_jit(jax.grad(lambda h: loss(h, 4)))(h)
    want = jax.grad(lambda h: loss(h, 1))(h)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(want))))


def test_check_slices_raises_no_false_alarm_on_a_zero_gradient(small_slices):
    """A block whose output is a softmax summed over its own axis has a zero gradient: the
    sliced and unsliced backwards are two float32 noises, which the check now measures
    against the output cotangents too (as the fuzzer's check does), not against each other."""
    h, w = _rows()
    pol = hg.Policy(check_slices=True)
    f = hg.checkpoint(lambda x: jax.nn.softmax(x @ w, axis=-1).sum(-1), "none",
                      backward_slices=4, policy=pol)
    g = jax.jit(jax.grad(lambda h: jnp.sum(f(h) * jnp.arange(8.0)[:, None])))(h)
    assert float(jnp.max(jnp.abs(g))) < 1e-5


@pytest.mark.parametrize("entry", ["checkpoint", "scan"])
def test_complex_inputs_get_their_cotangents_sliced(entry, small_slices, maybe_jit):
    """A complex input of a sliced block gets its cotangent (it was a silent float0 zero, and
    the slice check crashed casting it to float32): equal to `jax.grad`'s, with the check
    on."""
    h, w = _rows()
    hc = lax.complex(h, h[::-1])
    pol = hg.Policy(check_slices=True)

    def f(hr, hcx):
        return jnp.real(jnp.tanh(hr @ w).astype(hcx.dtype) * hcx)

    def step(c):
        return f(c[0], c[1]) + c[0], c[1] * 0.5

    def total(c):
        return jnp.sum(c[0] ** 2) + jnp.sum(jnp.abs(c[1]) ** 2)

    if entry == "checkpoint":
        ck = hg.checkpoint(f, "none", backward_slices=4, policy=pol)
        loss = lambda hr, hcx: jnp.sum(ck(hr, hcx) ** 2)  # noqa: E731
        ref = lambda hr, hcx: jnp.sum(f(hr, hcx) ** 2)  # noqa: E731
    else:
        def loss(hr, hcx):
            return total(hg.scan(lambda c, _: (step(c), None), (hr, hcx), None, length=2,
                                 codec="none", backward_slices=4, policy=pol)[0])

        def ref(hr, hcx):
            return total(step(step((hr, hcx))))
    assert hg.slice_report(loss, h, hc)[0].startswith("sliced")
    got = maybe_jit(jax.grad(loss, (0, 1)))(h, hc)
    want = jax.grad(ref, (0, 1))(h, hc)
    assert got[1].dtype == jnp.complex64
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))
