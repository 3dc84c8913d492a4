"""Worker for tests/test_distributed.py: runs one distributed case in a process of its own.

Usage:
  python tests/distributed_worker.py CASE                 # 8 simulated CPU devices
  python tests/distributed_worker.py all                  # every CASE in one process, each
                                                          # reported on its own (the tests)
  python tests/distributed_worker.py mp PORT PROC_ID OUT  # one of 2 processes on 127.0.0.1
  python tests/distributed_worker.py mp_ref OUT           # the single-process reference run
                                                          # (2 simulated devices, one process)

The simulated device count (``XLA_FLAGS=--xla_force_host_platform_device_count=8``) must be set
before JAX initialises, which is why the cases run here and not in the pytest process. A run
prints one JSON line ``RESULT {...}`` on stdout (arrays as nested lists / floats), which the tests
compare: one case's findings (a failed check raises, so the process exits non-zero with a
traceback), or for ``all`` each case's findings or its traceback under the case's name.
"""

from __future__ import annotations

import functools
import json
import os
import sys

if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] != "mp":
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        # mp_ref: one process with as many devices as the two processes have together.
        flags += f" --xla_force_host_platform_device_count={2 if sys.argv[1] == 'mp_ref' else 8}"
    os.environ["XLA_FLAGS"] = flags.strip()
HLO_DUMP_DIR = None
if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] in ("hlo", "all"):
    # Dump each program right after XLA's SPMD partitioner, which is where the gradient
    # all-reduces are created: the CPU backend later up-casts a bf16 all-reduce to f32
    # (`to_apply=%add.clone_promoted`), which GPU and TPU backends do not, so the final CPU HLO
    # alone would hide jax.grad's bf16 reduction.
    import tempfile

    HLO_DUMP_DIR = tempfile.mkdtemp(prefix="hifigrad_hlo_")
    os.environ["XLA_FLAGS"] += (f" --xla_dump_to={HLO_DUMP_DIR}"
                                " --xla_dump_hlo_pass_re=spmd-partitioning"
                                " --xla_dump_hlo_module_re=.*grad_step.*")
if "--xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    # As tests/conftest.py: bf16 numerics on CPU must not depend on fusion.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_allow_excess_precision=false").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hifigrad as hg  # noqa: E402

RTOL = 1e-5


def _shard_map(f, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map  # pragma: no cover

    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)  # pragma: no cover


def _rng_params(seed, shapes, dtype, scale=0.3):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray((scale * rng.standard_normal(s)).astype(np.float32)).astype(dtype)
            for k, s in shapes.items()}


def _mlp_loss(params, x):
    """A bf16 two-layer MLP; the loss is reduced in float32."""
    h = jnp.tanh(x @ params["w1"] + params["b1"][None])
    y = h @ params["w2"]
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def _single_device(tree):
    d = jax.devices()[0]
    return jax.tree.map(lambda a: jax.device_put(np.asarray(a), d), tree)


def _compare(name, got, want, report, rtol=RTOL):
    """Elementwise rtol, with atol = rtol * max|want| (so entries near zero compare relative to
    the array's scale)."""
    got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_l) == len(want_l), name
    worst = 0.0
    for g, w in zip(got_l, want_l):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, (name, g.shape, w.shape)
        atol = rtol * float(np.max(np.abs(w))) if w.size else 0.0
        err = float(np.max(np.abs(g - w) / (atol + rtol * np.abs(w)))) if g.size else 0.0
        worst = max(worst, err)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=name)
    report[name + "_max_err_over_tol"] = worst


def _check_shardings(name, grads, params, report):
    """Each gradient keeps its parameter's sharding (same mesh, equivalent spec)."""
    specs = []
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params)):
        assert g.dtype == jnp.float32, (name, g.dtype)
        ok = g.sharding.is_equivalent_to(p.sharding, p.ndim)
        specs.append([str(getattr(g.sharding, "spec", g.sharding)),
                      str(getattr(p.sharding, "spec", p.sharding))])
        assert ok, (name, g.sharding, p.sharding)
    report[name + "_specs"] = specs


# ---------------------------------------------------------------------------------- SPMD cases

def case_data_parallel(report):
    """Batch sharded over 8 devices, parameters replicated."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params = _rng_params(0, {"w1": (16, 32), "b1": (32,), "w2": (32, 8)}, jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((64, 16)), jnp.bfloat16)
    rep = NamedSharding(mesh, P())
    p_sh = jax.device_put(params, rep)
    x_sh = jax.device_put(x, NamedSharding(mesh, P("data", None)))

    vg = jax.jit(hg.value_and_grad(_mlp_loss))
    v, g = vg(p_sh, x_sh)
    v1, g1 = vg(*_single_device((params, x)))
    _compare("dp_value", v, v1, report)
    _compare("dp_grad", g, g1, report)
    _check_shardings("dp", g, p_sh, report)
    # hg.grad with explicit out_shardings and donate-free in_shardings gives the same.
    g2 = jax.jit(hg.grad(_mlp_loss), in_shardings=(rep, x_sh.sharding),
                 out_shardings=rep)(p_sh, x_sh)
    _compare("dp_grad_in_out_shardings", g2, g1, report)


# In FSDP and tensor parallelism XLA may split a contraction over devices, so the *forward* of a
# bf16 model rounds differently from one device (partial sums rounded to bf16, then added): the
# gradients are compared at rtol 1e-5 for the float32 model, and within the bf16 forward's own
# rounding (BF16_FWD_RTOL) for the bf16 model.
BF16_FWD_RTOL = 2e-2


def case_fsdp(report):
    for dt, tag, rtol in ((jnp.float32, "f32", RTOL), (jnp.bfloat16, "bf16", BF16_FWD_RTOL)):
        _fsdp(report, dt, tag, rtol)


def _fsdp(report, dt, tag, rtol):
    """Parameters sharded over the 8 devices (FSDP / ZeRO-3) and the batch sharded too."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params = _rng_params(2, {"w1": (16, 64), "b1": (64,), "w2": (64, 16)}, dt)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((32, 16)), dt)
    specs = {"w1": P(None, "data"), "b1": P("data"), "w2": P("data", None)}
    p_sh = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    x_sh = jax.device_put(x, NamedSharding(mesh, P("data", None)))

    # XLA's SPMD partitioner gathers the weights for the compute and reduce-scatters their
    # gradients. (A with_sharding_constraint to P() on the weights would make jax.grad and
    # hg.grad alike return replicated gradients: the constraint's transpose.)
    v, g = jax.jit(hg.value_and_grad(_mlp_loss))(p_sh, x_sh)
    v1, g1 = jax.jit(hg.value_and_grad(_mlp_loss))(*_single_device((params, x)))
    _compare(f"fsdp_{tag}_value", v, v1, report, rtol)
    _compare(f"fsdp_{tag}_grad", g, g1, report, rtol)
    _check_shardings(f"fsdp_{tag}", g, p_sh, report)

    # The same with hg.checkpoint saving the activation int8-encoded (the weights, closed over,
    # are saved as they are); the codec's quantization scale is global, so the sharded result
    # matches one device.
    def loss_ck(params, x):
        f = hg.checkpoint(lambda x: jnp.tanh(x @ params["w1"] + params["b1"][None]), codec="int8")
        return jnp.mean(jnp.square((f(x) @ params["w2"]).astype(jnp.float32)))

    g = jax.jit(hg.grad(loss_ck))(p_sh, x_sh)
    g1 = jax.jit(hg.grad(loss_ck))(*_single_device((params, x)))
    _compare(f"fsdp_{tag}_checkpoint_int8_grad", g, g1, report, rtol)
    _check_shardings(f"fsdp_{tag}_checkpoint", g, p_sh, report)


def case_tensor_parallel(report):
    for dt, tag, rtol in ((jnp.float32, "f32", RTOL), (jnp.bfloat16, "bf16", BF16_FWD_RTOL)):
        _tensor_parallel(report, dt, tag, rtol)


def _tensor_parallel(report, dt, tag, rtol):
    """Megatron MLP on a (data=2, model=4) mesh: w1 column-, w2 row-sharded; plus an hg.scan
    over stacked layers whose weights are sharded on the model axis."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    params = _rng_params(4, {"w1": (16, 32), "b1": (32,), "w2": (32, 16)}, dt)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((16, 16)), dt)
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
    p_sh = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    x_sh = jax.device_put(x, NamedSharding(mesh, P("data", None)))

    def loss(params, x):
        h = jnp.tanh(x @ params["w1"] + params["b1"][None])
        h = lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", "model")))
        y = h @ params["w2"]
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    v, g = jax.jit(hg.value_and_grad(loss))(p_sh, x_sh)
    v1, g1 = jax.jit(hg.value_and_grad(_mlp_loss))(*_single_device((params, x)))
    _compare(f"tp_{tag}_value", v, v1, report, rtol)
    _compare(f"tp_{tag}_grad", g, g1, report, rtol)
    _check_shardings(f"tp_{tag}", g, p_sh, report)

    # hg.scan (bf16-encoded carries) over 3 tensor-parallel layers.
    ws = _rng_params(6, {"a": (3, 16, 32), "b": (3, 32, 16)}, dt)
    wspecs = {"a": P(None, None, "model"), "b": P(None, "model", None)}
    ws_sh = {k: jax.device_put(v, NamedSharding(mesh, wspecs[k])) for k, v in ws.items()}

    def body(c, w):
        return jnp.tanh(jnp.tanh(c @ w["a"]) @ w["b"]), None

    def loss_scan(ws, x):
        y, _ = hg.scan(body, x, ws, codec="bf16")
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    g = jax.jit(hg.grad(loss_scan))(ws_sh, x_sh)
    g1 = jax.jit(hg.grad(loss_scan))(*_single_device((ws, x)))
    _compare(f"tp_{tag}_scan_grad", g, g1, report, rtol)
    _check_shardings(f"tp_{tag}_scan", g, ws_sh, report)


def case_shard_map(report):
    """shard_map with psum, all_gather, ppermute and psum_scatter, with hg.grad around it and
    hg.grad inside it."""
    n = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()), ("d",))
    rng = np.random.default_rng(7)
    w = jnp.asarray(0.3 * rng.standard_normal((16, 16)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((n * 4, 16)), jnp.bfloat16)
    perm = [(i, (i + 1) % n) for i in range(n)]

    def local(w, x):  # w: [16/n... no: w is sharded on rows -> [16/n, 16]; x: [4, 16]
        w_full = lax.all_gather(w, "d", tiled=True)            # [16, 16]
        h = jnp.tanh(x @ w_full)                               # [4, 16]
        h = lax.ppermute(h, "d", perm)                         # shift rows between devices
        s = lax.psum_scatter(h.astype(jnp.float32), "d", scatter_dimension=1, tiled=True)
        return lax.psum(jnp.sum(jnp.square(s)), "d")[None]     # [1] per device

    sm = _shard_map(local, mesh, (P("d", None), P("d", None)), P("d"))

    def loss(w, x):
        return jnp.mean(sm(w, x))

    def ref_loss(w, x):  # the same computation without collectives
        h = jnp.tanh(x.reshape(n, 4, 16) @ w)                  # [n, 4, 16]
        h = jnp.roll(h, 1, axis=0).astype(jnp.float32)
        s = jnp.sum(h, axis=0)                                  # [4, 16] (psum over devices)
        return jnp.sum(jnp.square(s))

    w_sh = jax.device_put(w, NamedSharding(mesh, P("d", None)))
    x_sh = jax.device_put(x, NamedSharding(mesh, P("d", None)))
    v, g = jax.jit(hg.value_and_grad(loss, argnums=(0, 1)))(w_sh, x_sh)
    v1, g1 = jax.jit(hg.value_and_grad(ref_loss, argnums=(0, 1)))(*_single_device((w, x)))
    _compare("shard_map_around_value", v, v1, report)
    _compare("shard_map_around_grad", g, g1, report)
    _check_shardings("shard_map_around", g, (w_sh, x_sh), report)
    # Not jitted as well (shard_map runs eagerly).
    g_eager = hg.grad(loss, argnums=(0, 1))(w_sh, x_sh)
    _compare("shard_map_around_grad_eager", g_eager, g1, report)

    # hg.grad inside shard_map: per-device gradient of the local loss, then psum (the
    # hand-written data-parallel step).
    params = _rng_params(8, {"w1": (16, 32), "b1": (32,), "w2": (32, 8)}, jnp.bfloat16)
    xb = jnp.asarray(rng.standard_normal((n * 4, 16)), jnp.bfloat16)

    def dp_step(grad_fn, params, x):
        # The parameters are invariant over "d", so the gradient of the per-device loss comes
        # back already summed over devices (the transpose of the implicit pvary is a psum), as
        # with jax.grad; dividing by the device count gives the global-mean-loss gradient.
        v, g = grad_fn(_mlp_loss)(params, x)
        return lax.pmean(v, "d"), jax.tree.map(lambda t: t / n, g)

    def run(grad_fn, params, x):
        step = jax.jit(_shard_map(functools.partial(dp_step, grad_fn), mesh,
                                  (P(), P("d", None)), (P(), P())))
        p_rep = jax.device_put(params, NamedSharding(mesh, P()))
        return p_rep, step(p_rep, jax.device_put(x, NamedSharding(mesh, P("d", None))))

    p_rep, (v, g) = run(hg.value_and_grad, params, xb)
    v1, g1 = jax.jit(hg.value_and_grad(_mlp_loss))(*_single_device((params, xb)))
    for t in jax.tree.leaves(g):
        assert t.dtype == jnp.float32
    # Same semantics as jax.grad inside shard_map (checked on the float32 model).
    p32 = jax.tree.map(lambda t: t.astype(jnp.float32), params)
    _, (_, g_hg32) = run(hg.value_and_grad, p32, xb.astype(jnp.float32))
    _, (_, g_jax32) = run(jax.value_and_grad, p32, xb.astype(jnp.float32))
    _compare("shard_map_inside_f32_hg_vs_jax", g_hg32, g_jax32, report)
    _compare("shard_map_inside_value", v, v1, report)
    _compare("shard_map_inside_grad", g, g1, report)
    _check_shardings("shard_map_inside", g, p_rep, report)


# ---------------------------------------------------------------------------------- HLO

def _bf16_deep_loss(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.mean(jnp.square(x.astype(jnp.float32)))


def _reduction_lines(hlo_text):
    keys = ("all-reduce(", "all-reduce-start(", "reduce-scatter(")
    return [ln.strip() for ln in hlo_text.splitlines()
            if any(k in ln for k in keys) and "=" in ln]


def _result_types(lines):
    """The element types of the reduction results, e.g. {'f32', 'bf16'}."""
    import re

    types = set()
    for ln in lines:
        lhs_type = ln.split("=", 1)[1].split("all-reduce")[0].split("reduce-scatter")[0]
        types |= set(re.findall(r"\b(bf16|f16|f32|f64|s32|u32|pred|s8|u8)\[", lhs_type))
    return types


def _after_spmd_partitioning(module_name):
    import glob

    pattern = os.path.join(HLO_DUMP_DIR, f"*{module_name}*after_spmd-partitioning*")
    files = sorted(glob.glob(pattern))
    assert files, (module_name, os.listdir(HLO_DUMP_DIR))
    with open(files[-1]) as f:
        return f.read()


def case_hlo(report):
    """The data-parallel gradient reduction: f32 under hg.grad, bf16 under jax.grad."""
    assert HLO_DUMP_DIR is not None, "run the hlo case as its own process (see HLO_DUMP_DIR)"
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rng = np.random.default_rng(9)
    params = [jnp.asarray(0.2 * rng.standard_normal((32, 32)), jnp.bfloat16) for _ in range(3)]
    x = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
    p_sh = jax.device_put(params, NamedSharding(mesh, P()))
    x_sh = jax.device_put(x, NamedSharding(mesh, P("data", None)))

    def hifigrad_grad_step(params, x):
        return hg.grad(_bf16_deep_loss)(params, x)

    def jax_grad_step(params, x):
        return jax.grad(_bf16_deep_loss)(params, x)

    out = {}
    for name, fn in (("hifigrad", hifigrad_grad_step), ("jax", jax_grad_step)):
        compiled = jax.jit(fn).lower(p_sh, x_sh).compile()
        final = _reduction_lines(compiled.as_text())
        spmd = _reduction_lines(_after_spmd_partitioning(fn.__name__))
        out[name] = {"after_spmd_partitioning": spmd,
                     "after_spmd_partitioning_types": sorted(_result_types(spmd)),
                     "final": final, "final_types": sorted(_result_types(final))}
    report["hlo"] = out
    h, j = out["hifigrad"], out["jax"]
    assert len(h["after_spmd_partitioning"]) >= 1 and len(h["final"]) >= 1, h
    for key in ("after_spmd_partitioning_types", "final_types"):
        assert h[key] == ["f32"], (key, h)
    # jax issue 27496: plain jax.grad all-reduces the bf16 gradients in bf16.
    assert "bf16" in j["after_spmd_partitioning_types"], j


# ---------------------------------------------------------------------------------- multi-process

MP_STEPS = 5
MP_GLOBAL_BATCH = 8


def _mp_setup():
    from hifigrad.demo import model as M

    cfg = M.ModelConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16, vocab=64, mlp_ratio=2)
    params = M.init_params(0, cfg)
    rng = np.random.default_rng(11)
    batches = rng.integers(0, cfg.vocab, (MP_STEPS, MP_GLOBAL_BATCH, cfg.seq_len + 1),
                           dtype=np.int32)

    def loss(params, batch):
        return M.loss_fn(cfg, params, batch, jnp.bfloat16)

    import optax

    tx = optax.adamw(1e-2, weight_decay=0.01)

    def step(params, opt_state, batch):
        v, g = hg.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, v

    return params, batches, tx, step


def _train(mesh, params, batches, tx, step):
    rep = NamedSharding(mesh, P())
    data = NamedSharding(mesh, P("data", None))
    params = jax.device_put(params, rep)
    opt_state = jax.device_put(tx.init(params), rep)
    step = jax.jit(step, in_shardings=(rep, rep, data), out_shardings=(rep, rep, rep))
    losses = []
    for b in batches:
        # Every process holds the whole (deterministic) global batch and contributes its own
        # rows: make_array_from_callback builds the global array from the local shards.
        gb = jax.make_array_from_callback(b.shape, data, lambda idx, b=b: b[idx])
        params, opt_state, v = step(params, opt_state, gb)
        losses.append(float(v))
    return params, losses


def _params_out(params):
    from jax.experimental import multihost_utils

    if jax.process_count() > 1:
        params = multihost_utils.process_allgather(params, tiled=True)
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v).tolist()
            for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def main_mp(port, proc_id, out_path):
    # CPU collectives across processes: this is a standalone worker process, so setting the
    # implementation here is fine (never in library code).
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception as e:  # noqa: BLE001
        print("RESULT " + json.dumps({"skip": f"gloo CPU collectives unavailable: {e!r}"}))
        return
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=proc_id, initialization_timeout=60)
    assert jax.process_count() == 2, jax.process_count()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params, batches, tx, step = _mp_setup()
    params, losses = _train(mesh, params, batches, tx, step)
    res = {"process_index": jax.process_index(), "process_count": jax.process_count(),
           "n_devices": len(jax.devices()), "losses": losses, "params": _params_out(params)}
    with open(out_path, "w") as f:
        json.dump(res, f)
    print("RESULT " + json.dumps({"ok": True, "losses": losses}), flush=True)
    jax.distributed.shutdown()


def main_mp_ref(out_path):
    assert len(jax.devices()) == 2, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params, batches, tx, step = _mp_setup()
    params, losses = _train(mesh, params, batches, tx, step)
    with open(out_path, "w") as f:
        json.dump({"losses": losses, "params": _params_out(params)}, f)
    print("RESULT " + json.dumps({"ok": True, "losses": losses}), flush=True)


def case_explicit_auto_axes(report):
    """An Explicit mesh with `jax.sharding.auto_axes` inside: the casts a rule stages must run
    in the equation's mesh context. (Regression: `ValueError: For primitive
    convert_element_type, context mesh ... should match the aval mesh`.)"""
    from jax.sharding import AxisType

    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(11)
    w0 = rng.uniform(0.1, 1.0, 2 * n).astype(np.float32)
    x0 = rng.standard_normal(2 * n).astype(np.float32)

    def loss(w, x):
        y = jax.sharding.auto_axes(lambda w, x: jnp.tanh(x * w), out_sharding=P("x"))(w, x)
        return jnp.sum((y ** 2).astype(jnp.float32))

    def ref_loss(w, x):
        return jnp.sum((jnp.tanh(x * w) ** 2).astype(jnp.float32))

    # The same ops on one device, without meshes: f32 rounding apart, the same gradient.
    want = hg.grad(ref_loss)(*_single_device((jnp.asarray(w0, jnp.bfloat16),
                                             jnp.asarray(x0, jnp.bfloat16))))
    use_mesh = getattr(jax.sharding, "use_mesh", None) or jax.set_mesh
    with use_mesh(mesh):
        w = jax.device_put(jnp.asarray(w0, jnp.bfloat16), NamedSharding(mesh, P("x")))
        x = jax.device_put(jnp.asarray(x0, jnp.bfloat16), NamedSharding(mesh, P("x")))
        for tag, fn in (("eager", hg.grad(loss)), ("jit", jax.jit(hg.grad(loss)))):
            g = fn(w, x)
            _compare(f"auto_axes_{tag}", g, want, report)
            _check_shardings(f"auto_axes_{tag}", [g], [w], report)


def case_checkpoint_in_shard_map(report):
    """Compressed checkpoints inside `jax.shard_map`, with the default ``check_vma=True`` and
    without: a remat scan rewritten by `compress_checkpoints` and an `hg.scan`, under
    `hg.value_and_grad` around the shard_map and inside it (per-device gradients, then a
    psum). Float32 blocks, codec "none": the gradients are `jax.grad`'s of the same model
    (sums over slices reassociated: RTOL), and every checkpoint's backward runs in slices."""
    n = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()), ("data",))
    b, t, d = 8 * n, 128, 32
    rng = np.random.default_rng(5)
    ws = jnp.asarray(rng.normal(size=(2, d, d)) / np.sqrt(d), jnp.float32)
    x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)

    def block(c, w):
        s = jnp.einsum("btd,bsd->bts", c, c @ w) / np.sqrt(d)
        return c + jax.nn.softmax(s, -1) @ c, None

    def local(ws, x, how):
        if how == "hg.scan":
            y = hg.scan(block, x, ws, codec="none", backward_slices=4)[0]
        else:
            y = lax.scan(jax.checkpoint(block), x, ws)[0]
        return jnp.mean(y ** 2)

    def around(how, check_vma):
        sm = jax.shard_map(lambda ws, x: lax.psum(local(ws, x, how), "data") / n, mesh=mesh,
                           in_specs=(P(), P("data")), out_specs=P(), check_vma=check_vma)
        return hg.compress_checkpoints(sm, "none", backward_slices=4) if how == "cc" else sm

    want = jax.jit(jax.value_and_grad(around("remat", True)))(ws, x)
    for check_vma in (True, False):
        for how in ("cc", "hg.scan"):
            tag = f"ckpt_shard_map_{how}_{'vma' if check_vma else 'novma'}"
            f = around(how, check_vma)
            report[tag + "_slices"] = hg.slice_report(hg.value_and_grad(f), ws, x)
            assert all(r.startswith("sliced") for r in report[tag + "_slices"]), report
            _compare(tag + "_around", jax.jit(hg.value_and_grad(f))(ws, x), want, report)
            # placed on the mesh (parameters replicated, the batch sharded): the gradient
            # keeps the parameters' sharding
            ws_sh = jax.device_put(ws, NamedSharding(mesh, P()))
            x_sh = jax.device_put(x, NamedSharding(mesh, P("data")))
            _, g = jax.jit(hg.value_and_grad(f))(ws_sh, x_sh)
            _compare(tag + "_placed", g, want[1], report)
            _check_shardings(tag, g, ws_sh, report)

            # Inside the shard_map, per-device gradients: with check_vma, JAX reduces a
            # replicated parameter's gradient over the devices itself (jax.grad does too).
            def inside(ws, x, how=how, grad=hg.value_and_grad, check_vma=check_vma):
                loss = lambda ws, x: local(ws, x, how)  # noqa: E731
                if how == "cc":
                    loss = hg.compress_checkpoints(loss, "none", backward_slices=4)
                v, g = grad(loss)(ws, x)
                return lax.psum(v, "data") / n, (g if check_vma else lax.psum(g, "data")) / n

            def sm(grad, how=how, check_vma=check_vma):
                return jax.shard_map(functools.partial(inside, how=how, grad=grad), mesh=mesh,
                                     in_specs=(P(), P("data")), out_specs=(P(), P()),
                                     check_vma=check_vma)

            got = jax.jit(sm(hg.value_and_grad))(ws, x)
            _compare(tag + "_inside", got, jax.jit(sm(jax.value_and_grad, "remat"))(ws, x),
                     report)
            _compare(tag + "_inside_vs_around", got, want, report)


def case_optimizer_state(report):
    """hifigrad.optim's compact training state on FSDP-sharded bf16 parameters: three jitted
    steps on 8 devices give bitwise the parameters and state one device gives (the stochastic
    roundings' bits are a counter-based hash of each element's position in the whole array,
    the same however the step is partitioned; the compact moments' blocks lie within the
    trailing axes, unsharded here, including an attention kernel whose last axis is 32 wide and
    whose blocks span its last two axes), every per-parameter state leaf keeps its
    parameter's sharding, and the parameters and state are donated to the step."""
    import optax

    mesh = Mesh(np.array(jax.devices()), ("data",))
    params = _rng_params(4, {"w1": (64, 256), "b1": (256,), "w2": (256, 128),
                             "wq": (64, 4, 32)}, jnp.bfloat16)
    specs = {"w1": P("data", None), "b1": P(), "w2": P("data", None),
             "wq": P("data", None, None)}
    shard = {k: NamedSharding(mesh, specs[k]) for k in params}
    rng = np.random.default_rng(5)
    grads = [{k: jnp.asarray(rng.standard_normal(v.shape) * np.logspace(-6, -1, v.shape[-1]),
                             jnp.float32) for k, v in params.items()} for _ in range(3)]
    # coded from 64 elements, the replicated bias's moments too (the default: from 4096)
    adamw = functools.partial(hg.optim.adamw, min_coded_size=64)
    configs = {
        "split_fp16": hg.optim.master_weights(adamw(1e-3, moments="fp16"), master="split"),
        "split_8bit": hg.optim.master_weights(adamw(1e-3, moments="8bit"), master="split"),
        "split8_4bit": hg.optim.master_weights(adamw(1e-3, moments="4bit"), master="split8",
                                               seed=3),
        "kahan_bf16": hg.optim.kahan(adamw(1e-3, moments="bf16")),
        "sr_bf16": hg.optim.stochastic_rounding(adamw(1e-3, moments="bf16"), seed=7),
        "sr_8bit": hg.optim.stochastic_rounding(adamw(1e-3, moments="8bit"), seed=7),
        "f32_master": hg.optim.master_weights(optax.adamw(1e-3)),
    }
    for name, tx in configs.items():
        def step(p, s, g, tx=tx):
            # JAX's default promotion: optax's own adam and apply_updates mix dtypes
            with jax.numpy_dtype_promotion("standard"):
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s

        step = jax.jit(step, donate_argnums=(0, 1))

        def run(p, put, tx=tx, step=step):
            s = jax.jit(tx.init)(p)
            for g in grads:
                p, s = step(p, s, put(g))
            return p, s

        # (from host copies: a replicated device_put may share the original's buffer, which
        # the donated step would delete)
        p8, s8 = run({k: jax.device_put(np.asarray(v), shard[k]) for k, v in params.items()},
                     lambda g: {k: jax.device_put(v, shard[k]) for k, v in g.items()})
        p1, s1 = run(_single_device(params), _single_device)
        moved = all(bool(jnp.any(p8[k] != params[k])) for k in params)
        assert moved, name
        for a, b in zip(jax.tree.leaves((p8, s8)), jax.tree.leaves((p1, s1))):
            np.testing.assert_array_equal(np.atleast_1d(np.asarray(a)).view(np.uint8),
                                          np.atleast_1d(np.asarray(b)).view(np.uint8),
                                          err_msg=name)
        report[f"optim_{name}_max_err_over_tol"] = 0.0
        pairs = []
        for leaf in jax.tree.leaves(s8):
            for k, p in p8.items():
                if leaf.shape == p.shape and leaf.ndim:
                    assert leaf.sharding.is_equivalent_to(p.sharding, p.ndim), (name, k)
                    pairs.append([str(leaf.sharding.spec), str(p.sharding.spec)])
                    break
        assert pairs, name
        report[f"optim_{name}_specs"] = pairs


CASES = {"data_parallel": case_data_parallel, "fsdp": case_fsdp,
         "tensor_parallel": case_tensor_parallel, "shard_map": case_shard_map, "hlo": case_hlo,
         "explicit_auto_axes": case_explicit_auto_axes,
         "checkpoint_in_shard_map": case_checkpoint_in_shard_map,
         "optimizer_state": case_optimizer_state}


def main():
    case = sys.argv[1]
    if case == "mp":
        return main_mp(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    if case == "mp_ref":
        return main_mp_ref(sys.argv[2])
    assert len(jax.devices()) == 8, jax.devices()
    if case != "all" and "," not in case:  # one case: its findings, or a traceback and exit 1
        report = {}
        with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
            CASES[case](report)
        print("RESULT " + json.dumps(report), flush=True)
        return
    # Several cases in this one process (what the tests run: one start-up of JAX for all of
    # them): {case: its findings} or {case: {"error": its traceback}}, each case on its own.
    import traceback

    reports = {}
    for name in list(CASES) if case == "all" else case.split(","):
        report = {}
        try:
            with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
                CASES[name](report)
        except Exception:  # noqa: BLE001 - reported for the case's own test to fail on
            report = {"error": traceback.format_exc()}
        reports[name] = report
    print("RESULT " + json.dumps(reports), flush=True)


if __name__ == "__main__":
    main()
