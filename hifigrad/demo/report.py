"""Writes a demo run's results: ``report.md``, ``results.json`` and PNG plots (with a length
sweep, as the recurrent task has, also ``sqnr_vs_length.png``).

Every conclusion in the report is computed here from the measured numbers; none is written in
advance. Plots use Matplotlib's Agg canvas directly (no pyplot, no global backend switch).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["TABLE_COLUMNS", "conclusions", "small_size_note", "table_rows", "write_report"]

TABLE_COLUMNS = (
    "mode", "SQNR@0 dB", "SQNR dB", "final loss", "Δfinal", "mean|Δ|", "val loss",
    "saved MB", "blocks MB", "temp MB", "step ms", "compile s",
)
LEGEND = (
    "*SQNR@0*: gradient SQNR vs the f32 gradient at step 0 (same parameters for every mode); "
    "*SQNR*: its mean over training, each mode at its own parameters; *final loss*: mean "
    "training loss over the last 10% of steps; *Δfinal*: minus f32's; *mean|Δ|*: mean absolute "
    "gap between the mode's and f32's loss curves; *val loss*: held-out loss of the final "
    "parameters (f32 forward); *saved MB*: residuals one step saves for its backward; "
    "*blocks MB*: those of the scan over blocks alone; *temp MB*: XLA's temporary buffers of "
    "the compiled gradient program; *step ms*: median step time; *compile s*: trace and "
    "compile time of the gradient program."
)
# What "(seed)" in a mode's label means: printed under the results table, in the report and
# in the terminal.
SEED_NOTE = ("*(seed)*: the fp8 recipe hifigrad started from, as a user wrote it (a remat "
             "scan whose carries are quantized to fp8 e4m3 with delayed scaling, and whose "
             "backward casts the gradient to fp8 too); not the random seed, which the run "
             "states with its training settings.")

PLOTS = {"loss": "loss_curves.png", "sqnr": "grad_sqnr.png", "memory": "memory.png",
         "length": "sqnr_vs_length.png"}


# ------------------------------------------------------------------------------ formatting

def _f(x, fmt: str, none: str = "—") -> str:
    if x is None:
        return none
    if isinstance(x, str):
        return x
    if math.isinf(x):
        return "∞"
    return format(x, fmt)


def _mb(b) -> str:
    if b is None:
        return "—"
    mb = b / 2**20
    return f"{mb:.2f}" if mb >= 1 else f"{mb:.3g}"


def _ok(results: dict) -> list[dict]:
    return [r for r in results["modes"] if r["status"] == "ok"]


def _by_name(results: dict) -> dict[str, dict]:
    return {r["name"]: r for r in _ok(results)}


def table_rows(results: dict) -> list[list[str]]:
    """One list of strings per mode, in `TABLE_COLUMNS` order."""
    rows = []
    for r in results["modes"]:
        if r["status"] != "ok":
            rows.append([r["label"], r["status"]] + [""] * (len(TABLE_COLUMNS) - 2))
            continue
        is_ref = r["name"] == "f32"
        rows.append([
            r["label"],
            "ref" if is_ref else _f(r["sqnr_step0_db"], ".1f", "non-finite"),
            "ref" if is_ref else _f(r["sqnr_mean_db"], ".1f", "non-finite"),
            _f(r["final_loss"], ".3f", "nan"),
            "ref" if is_ref else _f(r["final_gap"], "+.2g"),
            "ref" if is_ref else _f(r["mean_abs_gap"], ".2g"),
            _f(r["val_loss"], ".3f", "nan"),
            _mb(r["residual_bytes"]),
            _mb(r.get("block_residual_bytes")),
            _mb(r["temp_bytes"]),
            _f(r["step_ms"], ".1f"),
            _f(r["compile_s"], ".1f"),
        ])
    return rows


# ------------------------------------------------------------------------------ noise

# The demo trains every mode once, from one seed: a difference between two rows is claimed only
# where it is larger than what another seed moves a row by. SEED_SPREAD, per configuration:
# twice the largest standard deviation over seeds 0 to 4 of any mode's final-loss gap or mean
# |Δloss| to f32 ("loss", nats), its gradient SQNR at step 0 ("sqnr_step0", dB) and its mean
# SQNR over training ("sqnr_mean", dB), measured by `train.run(dataclasses.replace(config,
# seed=s, modes=SPREAD_MODES))` for s in 0..4 (JAX 0.10.2, CPU; the largest came from int2-hg,
# int4-hg, bf16 and fp16 jax.grad). SPREAD_CONFIGS: those configurations' sizes
# (`DemoConfig()` and `QUICK`; a test checks them). Any other configuration gets the larger of
# the two, and says so.
SPREAD_MODES = ("f32", "bf16", "bf16-hg", "bf16-hg-fast", "fp16", "fp16-hg", "none-hg",
                "int8-hg", "int4-hg", "int2-hg")
SPREAD_CONFIGS = {
    "default": {"task": "gpt", "steps": 200, "n_layers": 4, "d_model": 64, "n_heads": 4,
                "seq_len": 64, "batch_size": 8},
    "--quick": {"task": "gpt", "steps": 30, "n_layers": 2, "d_model": 32, "n_heads": 2,
                "seq_len": 32, "batch_size": 8},
}
SEED_SPREAD = {
    "default": {"loss": 0.039, "sqnr_step0": 2.3, "sqnr_mean": 4.8},
    "--quick": {"loss": 0.011, "sqnr_step0": 3.3, "sqnr_mean": 3.8},
}


def noise(results: dict) -> dict:
    """The thresholds under which the conclusions claim no difference: ``loss`` (nats),
    ``sqnr_step0`` and ``sqnr_mean`` (dB), and ``source``, the configuration they were
    measured on (None where this run's was not measured: the larger of the measured ones)."""
    cfg = results["config"]
    for name, sizes in SPREAD_CONFIGS.items():
        if all(cfg.get(k, "gpt" if k == "task" else None) == v for k, v in sizes.items()):
            return {**SEED_SPREAD[name], "source": name}
    return {k: max(t[k] for t in SEED_SPREAD.values()) for k in ("loss", "sqnr_step0",
                                                                    "sqnr_mean")} | {
        "source": None}


def noise_note(results: dict) -> str:
    """The noise thresholds every comparison of the conclusions uses, and where they come
    from."""
    n = noise(results)
    where = (f"twice the largest standard deviation of one mode's value over seeds 0 to 4 of "
             f"the {n['source']} configuration (the run-to-run spread)"
             if n["source"] else
             "this configuration's spread between seeds was not measured: these are the "
             "larger of the default's and --quick's, twice the largest standard deviation of "
             "one mode's value over seeds 0 to 4")
    return (f"**Noise threshold**: this run trained each mode once (seed "
            f"{results['config']['seed']}), so differences under {n['loss']:g} nats in loss "
            f"(final-loss gap, mean |Δloss|), {n['sqnr_step0']:g} dB in gradient SQNR at step "
            f"0 and {n['sqnr_mean']:g} dB in its mean over training are not claimed below: "
            f"{where}.")


# ------------------------------------------------------------------------------ the codec's share

# The rows of `benchmarks/results/codec_share_jax0.10.2.md` (`PYTHONPATH=. python
# benchmarks/transformer_memory_bench.py --codec-share`), sorted by the checkpoints' share F of
# `checkpoint_estimate`: where F < SHARE_LITTLE, int8 took CODEC_LITTLE (as 1 - its peak / codec
# none's peak) off codec none's peak; where F >= SHARE_MATTERS, CODEC_MATTERS. A test checks
# these against that file.
CODEC_SHARE_FILE = "benchmarks/results/codec_share_jax0.10.2.md"
SHARE_LITTLE, SHARE_MATTERS = 0.15, 0.25
CODEC_LITTLE, CODEC_MATTERS = (0.05, 0.19), (0.20, 0.42)


def gpt_params(model: dict) -> int:
    """Parameters of the demo's GPT (`model.init_params`) of shape ``model`` (a
    `model.ModelConfig` as a dict)."""
    v, d, t, n = model.get("vocab", 256), model["d_model"], model["seq_len"], model["n_layers"]
    h = d * model.get("mlp_ratio", 4)
    block = 4 * d + 3 * d * d + d * d + d * h + h + h * d + d
    return v * d + t * d + n * block + 2 * d + d * v


def checkpoint_estimate(n_layers: int, batch: int, seq_len: int, d_model: int, n_heads: int,
                        n_params: int, mlp_ratio: int = 4) -> dict:
    """What a codec can shrink in a bf16 transformer's training step, against what it cannot.

    ``checkpoints``: one bf16 block input per block, ``n_layers * batch * seq_len * d_model * 2``
    bytes: all a codec shrinks. ``grads``: the float32 parameter gradients, ``4 * n_params``.
    ``work``: one block's float32 backward working set, one copy each of the attention scores
    ``batch * n_heads * seq_len**2`` and the MLP hidden ``batch * seq_len * mlp_ratio *
    d_model``, 4 bytes an element (the sliced backward shrinks it, a codec does not).
    ``share``: ``checkpoints / (checkpoints + grads + work)``.
    """
    ckpt = n_layers * batch * seq_len * d_model * 2
    grads = 4 * n_params
    work = 4 * (batch * n_heads * seq_len**2 + batch * seq_len * mlp_ratio * d_model)
    return {"checkpoints": ckpt, "grads": grads, "work": work,
            "share": ckpt / (ckpt + grads + work)}


def _estimate_of_run(results: dict) -> dict | None:
    cfg = results["config"]
    if cfg.get("task", "gpt") != "gpt":
        return None
    return checkpoint_estimate(cfg["n_layers"], cfg["batch_size"], cfg["seq_len"],
                               cfg["d_model"], cfg["n_heads"], results["n_params"])


def _estimate_at_scale(results: dict) -> dict | None:
    scale = results.get("memory_at_scale")
    if not scale:
        return None
    m = scale["model"]
    return checkpoint_estimate(m["n_layers"], scale["batch_size"], m["seq_len"], m["d_model"],
                               m["n_heads"], gpt_params(m), m.get("mlp_ratio", 4))


def _expectation(share: float) -> str:
    lo, hi = CODEC_LITTLE if share < SHARE_LITTLE else CODEC_MATTERS
    if share < SHARE_LITTLE:
        return (f"under {SHARE_LITTLE:g}, where the measured rows ({CODEC_SHARE_FILE}) had int8 "
                f"take {lo:.0%} to {hi:.0%} off codec none's peak: expect the sliced backward "
                "to be the saving and a codec's bits to add little")
    if share >= SHARE_MATTERS:
        return (f"{SHARE_MATTERS:g} or more, where the measured rows ({CODEC_SHARE_FILE}) had "
                f"int8 take {lo:.0%} to {hi:.0%} off codec none's peak: expect the codec's bits "
                "to matter")
    return (f"between {SHARE_LITTLE:g} and {SHARE_MATTERS:g}, where the measured rows "
            f"({CODEC_SHARE_FILE}) hold none: no expectation either way")


def _estimate_sentence(where: str, est: dict) -> str:
    return (f"Codec's share, estimated from the sizes ({where}): the checkpoints a codec "
            f"shrinks (layers x batch x tokens x d_model in bf16, {_mb(est['checkpoints'])} MB) "
            f"against the float32 parameter gradients ({_mb(est['grads'])} MB) and one block's "
            f"float32 attention scores and MLP hidden ({_mb(est['work'])} MB) are "
            f"{est['share']:.2f} of the three, {_expectation(est['share'])}")


def _codec_vs_none(temps: dict[str, int | None], labels: dict[str, str]) -> str | None:
    """'<codec> 0.90x, ...' of each codec mode's temp over codec none's (None without it)."""
    none = temps.get("none-hg")
    codecs = [(n, t) for n, t in temps.items() if t and n in CODEC_MODES]
    if not none or not codecs:
        return None
    return ", ".join(f"{labels.get(n, n)} {t / none:.2f}x" for n, t in codecs)


# The modes whose scan over blocks saves its carry with a hifigrad codec other than "none",
# with the bits per element the codec stores.
CODEC_MODES = {"fp8-hg": 8, "int8-hg": 8, "int4-hg": 4, "int2-hg": 2}


def codec_share_conclusions(results: dict) -> list[str]:
    """The estimate of `checkpoint_estimate` for the model this run trained, beside what the
    run measured there (each codec's step temp over codec none's)."""
    est = _estimate_of_run(results)
    if est is None:
        return []
    cfg = results["config"]
    s = _estimate_sentence(f"this run's {cfg['n_layers']} blocks, batch {cfg['batch_size']} x "
                           f"{cfg['seq_len']} tokens", est)
    labels = {r["name"]: r["label"] for r in results["modes"]}
    measured = _codec_vs_none({r["name"]: r.get("temp_bytes") for r in _ok(results)}, labels)
    if measured:
        s += (f". Measured at this size, each codec's step temp over codec none's "
              f"({labels['none-hg']}): {measured}")
    return [s + "."]


# ------------------------------------------------------------------------------ conclusions

def _num(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def _gap(x) -> str:
    return _f(x, "+.2g")


def conclusions(results: dict) -> list[str]:
    """Findings computed from the measurements, one sentence each. A difference between two
    rows is claimed only beyond the noise threshold (`noise_note`); memory comparisons name
    the row they are relative to, which the report's memory tables show."""
    ok = _ok(results)
    by = _by_name(results)
    others = [r for r in ok if r["name"] != "f32"]
    nz = noise(results)
    out = [noise_note(results)]
    out += _loss_conclusions(others, nz["loss"])
    diverged = [r["label"] for r in others if r.get("final_loss") is None]
    if diverged:
        out.append(f"Training diverged (non-finite loss) for: {', '.join(diverged)}.")
    out += _sqnr_conclusions(others, nz["sqnr_mean"])

    for r in others:
        c = by.get(r.get("counterpart") or "")
        if c is not None:
            line = _counterpart_conclusion(r, c, nz)
            if line:
                out.append(line)

    out += _sweep_conclusions(results)

    for r in others:
        frac = r.get("lost_grad_frac_step0")
        if frac is not None and frac >= 0.01:
            out.append(f"{r['label']}: {100 * frac:.1f}% of the gradient entries that are "
                       f"nonzero in f32 came out exactly zero at step 0 (underflow).")
    ls = by.get("fp16-ls")
    if ls is not None:
        out.append(f"{ls['label']}: {ls['skipped_steps']} of {len(ls['losses'])} steps skipped "
                   f"for non-finite gradients; final loss scale "
                   f"{ls.get('final_loss_scale', float('nan')):g}.")

    out += _scale_conclusions(results)
    out += _memory_conclusions(results)
    out += _timing_conclusions(results)
    skipped = [r for r in results["modes"] if r["status"] != "ok"]
    for r in skipped:
        what = "failed" if r["status"] == "failed" else "was not run"
        out.append(f"{r['label']} {what}: {r['reason']}")
    return out


def _loss_conclusions(others: list[dict], threshold: float) -> list[str]:
    """Which modes' loss curves stay within the noise threshold of f32's, and which leave it
    (mean |Δloss| and final-loss gap as the table prints them)."""
    tracked = sorted((r for r in others if _num(r.get("mean_abs_gap")) is not None),
                     key=lambda r: r["mean_abs_gap"])
    if not tracked:
        return []
    near = [r for r in tracked if r["mean_abs_gap"] < threshold]
    far = [r for r in tracked if r["mean_abs_gap"] >= threshold]
    out = []
    if near:
        out.append(
            f"Within the noise threshold of the f32 loss curve (mean |Δloss| under "
            f"{threshold:g} nats): " + ", ".join(
                f"{r['label']} {r['mean_abs_gap']:.2g}" for r in near)
            + ("; no order among these is claimed." if len(near) > 1 else "."))
    if far:
        out.append("Further from the f32 loss curve than the noise threshold: " + ", ".join(
            f"**{r['label']}** (mean |Δloss| {r['mean_abs_gap']:.2g}, final-loss gap "
            f"{_gap(r.get('final_gap'))})" for r in far) + ".")
    moved = [r for r in near if _num(r.get("final_gap")) is not None
             and abs(r["final_gap"]) >= threshold]
    if moved:
        out.append("Final loss beyond the noise threshold from f32's, though the curve stayed "
                   "within it on average: " + ", ".join(
                       f"{r['label']} {_gap(r['final_gap'])}" for r in moved) + ".")
    return out


def _sqnr_conclusions(others: list[dict], threshold: float) -> list[str]:
    """The highest and lowest mean gradient SQNR, with every mode within the noise threshold
    of either named alongside."""
    fid = sorted((r for r in others if _num(r.get("sqnr_mean_db")) is not None),
                 key=lambda r: -r["sqnr_mean_db"])
    if len(fid) < 2:
        return []
    hi, lo = fid[0]["sqnr_mean_db"], fid[-1]["sqnr_mean_db"]
    if hi - lo < threshold:
        return [f"Gradient SQNR vs f32 (mean over training): every mode within {threshold:g} "
                f"dB of the others ({lo:.1f} to {hi:.1f} dB), inside the noise threshold."]

    def group(rows, ref, which):
        if len(rows) == 1:
            r = rows[0]
            return f"{which}: **{r['label']}** ({r['sqnr_mean_db']:.1f} dB)"
        return (f"{which}, within {threshold:g} dB of each other: " + ", ".join(
            f"**{r['label']}** {r['sqnr_mean_db']:.1f}" for r in rows) + " dB")

    top = [r for r in fid if hi - r["sqnr_mean_db"] < threshold]
    bottom = [r for r in fid if r["sqnr_mean_db"] - lo < threshold]
    return [f"Gradient SQNR vs f32 (mean over training). {group(top, hi, 'Highest')}; "
            f"{group(bottom, lo, 'lowest')}."]


def _sqnr_verdict(diff: float, threshold: float) -> str:
    if diff >= threshold:
        return "higher"
    if diff <= -threshold:
        return "lower"
    return "within the noise threshold"


def _counterpart_conclusion(r: dict, c: dict, nz: dict) -> str | None:
    """A hifigrad row beside the plain row it replaces: SQNR (mean, and at step 0) and final
    loss, each difference named only beyond the noise threshold."""
    a, b = _num(r.get("sqnr_mean_db")), _num(c.get("sqnr_mean_db"))
    if a is None or b is None:
        return None
    s = (f"{r['label']} vs {c['label']}: gradient SQNR {a:.1f} vs {b:.1f} dB ({a - b:+.1f} dB, "
         f"{_sqnr_verdict(a - b, nz['sqnr_mean'])})")
    a0, b0 = _num(r.get("sqnr_step0_db")), _num(c.get("sqnr_step0_db"))
    if a0 is not None and b0 is not None:
        s += (f"; at step 0, same parameters: {a0:.1f} vs {b0:.1f} dB ({a0 - b0:+.1f} dB, "
              f"{_sqnr_verdict(a0 - b0, nz['sqnr_step0'])})")
    ga, gb = _num(r.get("final_gap")), _num(c.get("final_gap"))
    if ga is not None and gb is not None:
        closer = abs(gb) - abs(ga)
        if closer >= nz["loss"]:
            s += f"; final loss closer to f32's (gap {_gap(ga)} vs {_gap(gb)})"
        elif closer <= -nz["loss"]:
            s += f"; final loss further from f32's (gap {_gap(ga)} vs {_gap(gb)})"
        else:
            s += (f"; final-loss gaps to f32 {_gap(ga)} vs {_gap(gb)}, within the noise "
                  "threshold: neither is claimed closer")
    return s + "."


MEMORY_BASELINE = "bf16 jax.checkpoint scan"


def memory_table(results: dict) -> tuple[list[str], list[list[str]]]:
    """The memory table at this run's size: its first row is the baseline, `jax.grad` over the
    bf16 `lax.scan(jax.checkpoint(block))` (compiled, not trained); every mode's saved bytes of
    the scan over blocks and step temp, each beside its ratio to the baseline's."""
    remat, remat_temp = (results.get("remat_bf16_block_residual_bytes"),
                         results.get("remat_bf16_temp_bytes"))

    def ratio(x, ref):
        return f"{x / ref:.2f}" if x is not None and ref else "—"

    header = ["mode", "blocks MB", "x baseline", "temp MB", "x baseline"]
    rows = [[f"{MEMORY_BASELINE} (baseline)", _mb(remat), "1.00" if remat else "—",
             _mb(remat_temp), "1.00" if remat_temp else "—"]]
    rows += [[r["label"], _mb(r.get("block_residual_bytes")),
              ratio(r.get("block_residual_bytes"), remat), _mb(r.get("temp_bytes")),
              ratio(r.get("temp_bytes"), remat_temp)] for r in _ok(results)]
    return header, rows


def scale_table(results: dict) -> tuple[list[str], list[list[str]]] | None:
    """The table of the comparison at scale: the baseline row first, then each mode's step temp
    over the baseline's and over codec none's."""
    ratios = _scale_ratios(results)
    if not ratios:
        return None
    scale = results["memory_at_scale"]
    none = scale["temp_bytes"].get("none-hg")
    header = ["mode", "temp MB", "x baseline", "x codec none"]
    rows = [[f"{MEMORY_BASELINE} (baseline)", _mb(scale["remat_bf16_temp_bytes"]), "1.00", "—"]]
    rows += [[label, _mb(scale["temp_bytes"][n]), f"{x:.2f}",
              f"{scale['temp_bytes'][n] / none:.2f}" if none else "—"]
             for n, label, x in ratios]
    return header, rows


def _memory_conclusions(results: dict) -> list[str]:
    out = []
    ok = _ok(results)
    by = _by_name(results)
    mem = sorted((r for r in ok if r.get("residual_bytes")), key=lambda r: r["residual_bytes"])
    base = by.get("bf16")
    if mem:
        s = (f"Smallest saved residuals: **{mem[0]['label']}** "
             f"({mem[0]['residual_bytes'] / 2**20:.2f} MB")
        if base is not None and base.get("residual_bytes"):
            s += (f", {mem[0]['residual_bytes'] / base['residual_bytes']:.2f}x the "
                  f"{base['label']} row's")
        s += f"); largest: **{mem[-1]['label']}** ({mem[-1]['residual_bytes'] / 2**20:.2f} MB)."
        out.append(s)
    remat = results.get("remat_bf16_block_residual_bytes")
    squeezed = [r for r in ok if r.get("block_residual_bytes") and r["saved"] != "all"]
    if remat and squeezed:
        s = ("Saved by the scan over blocks, relative to the memory table's baseline row (the "
             f"{MEMORY_BASELINE}, uncompressed, {remat / 2**20:.3g} MB): " + ", ".join(
                 f"{r['label']} {r['block_residual_bytes'] / remat:.2f}x" for r in squeezed))
        plain = by.get("bf16")
        if plain is not None and plain.get("block_residual_bytes"):
            s += (f"; for scale, a plain lax.scan without jax.checkpoint ({plain['label']}) "
                  f"keeps {plain['block_residual_bytes'] / remat:.2f}x the baseline's bytes "
                  "(every block's intermediates, not only its input)")
        out.append(s + ".")
    remat_temp = results.get("remat_bf16_temp_bytes")
    with_temp = [r for r in ok if r.get("temp_bytes")]
    if remat_temp and with_temp:
        out.append("Peak temp of one training step, relative to the bf16 jax.checkpoint scan's "
                   f"({remat_temp / 2**20:.3g} MB, the memory table's baseline row; bf16 "
                   "backward): " + ", ".join(
                       f"{r['label']} {r['temp_bytes'] / remat_temp:.2f}x" for r in with_temp)
                   + ".")
        note = small_size_note(results)
        if note:
            out.append(note)
    out += codec_share_conclusions(results)
    return out


def _timing_conclusions(results: dict) -> list[str]:
    """The fastest and slowest step (medians), and the modes whose median falls inside the
    fastest one's step-to-step spread (the middle half of its steps), which are not ranked."""
    timed = sorted((r for r in _ok(results) if _num(r.get("step_ms")) is not None),
                   key=lambda r: r["step_ms"])
    if not timed:
        return []
    fast, slow = timed[0], timed[-1]
    s = f"Fastest step: {fast['label']} ({fast['step_ms']:.1f} ms"
    spread = fast.get("step_ms_quartiles")
    if spread:
        q1, q3 = spread
        ties = [r for r in timed[1:] if r["step_ms"] <= q3]
        s += f"; the middle half of its steps took {q1:.1f} to {q3:.1f} ms)"
        if ties:
            s += (", with " + ", ".join(f"{r['label']} ({r['step_ms']:.1f} ms)" for r in ties)
                  + " inside that spread, not ranked against it")
    else:
        s += ")"
    return [s + f"; slowest: {slow['label']} ({slow['step_ms']:.1f} ms), on "
            f"{results['environment']['backend']}."]


def _compressed_temp_ratios(results: dict) -> list[tuple[dict, float]]:
    """(row, its step's temp / the bf16 jax.checkpoint scan's) of each compressed mode trained
    in this run."""
    remat = results.get("remat_bf16_temp_bytes")
    if not remat:
        return []
    return [(r, r["temp_bytes"] / remat) for r in _ok(results)
            if r.get("temp_bytes") and r["saved"] not in ("all", "fp8-seed")]


def _scale_ratios(results: dict) -> list[tuple[str, str, float]]:
    """(name, label, temp / the bf16 jax.checkpoint scan's) of each mode of the comparison at
    scale."""
    scale = results.get("memory_at_scale") or {}
    ref = scale.get("remat_bf16_temp_bytes")
    if not ref:
        return []
    labels = {r["name"]: r["label"] for r in results["modes"]}
    return [(n, labels.get(n, n), t / ref) for n, t in scale["temp_bytes"].items() if t]


def _scale_size(scale: dict) -> str:
    m = scale["model"]
    return (f"{m['n_layers']} blocks, d_model {m['d_model']}, batch {scale['batch_size']} x "
            f"{m['seq_len']} tokens")


def _scale_conclusions(results: dict) -> list[str]:
    ratios = _scale_ratios(results)
    if not ratios:
        return []
    scale = results["memory_at_scale"]
    out = [f"**At scale** ({_scale_size(scale)}; compiled, not trained), one training step's "
           f"peak temp relative to the bf16 jax.checkpoint scan's "
           f"({scale['remat_bf16_temp_bytes'] / 2**20:.3g} MB, the baseline row of the table "
           "at scale): " + ", ".join(f"{label} {x:.2f}x" for _, label, x in ratios) + "."]
    out += _split_conclusion(results)
    out += _bits_conclusion(results)
    est = _estimate_at_scale(results)
    if est is not None:
        out.append(_estimate_sentence("at scale", est) + ".")
    return out


def _split_conclusion(results: dict) -> list[str]:
    """Where the saving at scale comes from: the sliced float32 backward alone (the 'none-hg'
    row: hg.scan saving each block's input as it is) against the bf16 jax.checkpoint scan,
    then each codec against that."""
    scale = results.get("memory_at_scale") or {}
    temps, ref = scale.get("temp_bytes", {}), scale.get("remat_bf16_temp_bytes")
    none = temps.get("none-hg")
    if not (ref and none):
        return []
    labels = {r["name"]: r["label"] for r in results.get("modes", [])}
    s = (f"**Where it comes from**: the float32 backward run in batch slices, saving each "
         f"block's input as it is ({labels.get('none-hg', 'none-hg')}), takes "
         f"{none / ref:.2f}x of the bf16 jax.checkpoint scan's peak: that is the slicing's "
         f"share.")
    codecs = _codec_vs_none(temps, labels)
    if codecs:
        s += (" Each codec then takes, of that: " + codecs + " (the codec's share; "
              f"{CODEC_SHARE_FILE} has it at other depths and batches).")
    return [s]


def _bits_conclusion(results: dict) -> list[str]:
    """Whether fewer bits per saved element gave a lower peak at scale, as the table prints the
    ratios (two decimals): what would show that the checkpoints a codec shrinks set the peak."""
    scale = results.get("memory_at_scale") or {}
    temps, ref = scale.get("temp_bytes", {}), scale.get("remat_bf16_temp_bytes")
    labels = {r["name"]: r["label"] for r in results.get("modes", [])}
    ints = [(n, round(temps[n] / ref, 2)) for n in ("int8-hg", "int4-hg", "int2-hg")
            if ref and temps.get(n)]
    if len(ints) < 2:
        return []
    shown = ", ".join(f"{labels.get(n, n)} {x:.2f}x" for n, x in ints)
    if all(b < a for (_, a), (_, b) in zip(ints, ints[1:])):
        return [f"At scale, fewer bits per saved element give a lower peak ({shown}): each "
                "halving of the saved checkpoints' bytes shows in the peak there."]
    return [f"At scale, fewer bits per saved element do not give a lower peak ({shown}): "
            "halving the saved checkpoints' bytes again past int8 buys nothing there."]


def small_size_note(results: dict) -> str | None:
    """Why the compressed modes' step can need more temp than the bf16 jax.checkpoint scan's
    at the size this run trains, when it does (None otherwise)."""
    above = [(r, x) for r, x in _compressed_temp_ratios(results) if x > 1.0]
    if not above:
        return None
    cfg = results["config"]
    s = (f"At this run's size ({cfg['n_layers']} blocks, d_model {cfg['d_model']}, batch "
         f"{cfg['batch_size']} x {cfg['seq_len']}) the compressed modes' step needs more temp "
         f"than the bf16 jax.checkpoint scan's (up to {max(x for _, x in above):.2f}x)")
    est = _estimate_of_run(results)
    if est is not None and est["checkpoints"] < est["grads"] + est["work"]:
        s += (f": the block inputs a codec shrinks ({_mb(est['checkpoints'])} MB in bf16) are "
              f"smaller than its fixed costs (float32 parameter gradients "
              f"{_mb(est['grads'])} MB, one block's float32 backward working set "
              f"{_mb(est['work'])} MB, the codec's scale and packing scratch)")
    ratios = _scale_ratios(results)
    if ratios:
        s += (f"; at scale ({_scale_size(results['memory_at_scale'])}) the same modes need "
              f"{min(x for *_, x in ratios):.2f}-{max(x for *_, x in ratios):.2f}x")
    return s + " (the transformer memory benchmark, docs/benchmarks.md, sweeps the depth)."


def _sweep_conclusions(results: dict) -> list[str]:
    """The length sweep's findings: each mode's SQNR from the shortest to the longest length,
    and each hifigrad row beside its plain counterpart at the longest length."""
    sweep = results.get("length_sweep")
    if not sweep:
        return []
    lengths = sweep["lengths"]
    labels = {r["name"]: r["label"] for r in results["modes"]}
    out = []
    nz = noise(results)
    gaps = [r for r in _ok(results) if _num(r.get("mean_abs_gap")) is not None]
    ref = _by_name(results).get("f32")
    if gaps and ref is not None and _num(ref.get("final_loss")) is not None:
        worst = max(gaps, key=lambda r: r["mean_abs_gap"])
        if worst["mean_abs_gap"] < nz["loss"]:
            out.append(
                f"Loss curves at this size do not separate: the largest mean |Δloss| vs f32 is "
                f"{worst['mean_abs_gap']:.3g} ({worst['label']}, "
                f"{100 * worst['mean_abs_gap'] / ref['final_loss']:.2g}% of f32's final loss), "
                f"under the noise threshold of {nz['loss']:g} nats, so the gradient SQNR "
                "against the sequence length shows the gap instead.")
        else:
            out.append(
                f"Loss curves at this size separate: the largest mean |Δloss| vs f32 is "
                f"{worst['mean_abs_gap']:.3g} ({worst['label']}; noise threshold "
                f"{nz['loss']:g} nats).")
    trend = []
    for name, ys in sweep["sqnr_db"].items():
        pts = [(n, y) for n, y in zip(lengths, ys) if _num(y) is not None]
        if len(pts) >= 2:
            (_, y0), (_, y1) = pts[0], pts[-1]
            trend.append(f"{labels.get(name, name)} {y0:.1f} → {y1:.1f} dB ({y1 - y0:+.1f})")
    if trend:
        out.append(f"Gradient SQNR vs f32 at the initial parameters, sequence length "
                   f"{lengths[0]} → {lengths[-1]}: " + "; ".join(trend) + ".")
    by = {r["name"]: r for r in results["modes"]}
    for name, ys in sweep["sqnr_db"].items():
        c = by.get(name, {}).get("counterpart")
        if c not in sweep["sqnr_db"]:
            continue
        a, b = _num(ys[-1]), _num(sweep["sqnr_db"][c][-1])
        if a is not None and b is not None:
            out.append(f"At length {lengths[-1]}: {labels[name]} {a:.1f} dB vs "
                       f"{labels[c]} {b:.1f} dB ({a - b:+.1f} dB, "
                       f"{_sqnr_verdict(a - b, nz['sqnr_step0'])}).")
    return out


# ------------------------------------------------------------------------------ plots

def _figure(w=7.5, h=4.5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _smooth(xs: Sequence[float | None], k: int) -> list[float]:
    vals = [math.nan if x is None else x for x in xs]
    if k <= 1:
        return vals
    out, acc = [], []
    for v in vals:
        acc.append(v)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


# One colour and one marker per mode, never shared; the line style names the backward: solid
# for hifigrad, dashed for plain jax.grad, dotted for the seed issue's fp8-gradient workaround.
MODE_STYLES = {
    "f32": ("black", "o"),
    "bf16": ("tab:blue", "v"),
    "bf16-hg": ("tab:orange", "^"),
    "bf16-hg-fast": ("tab:green", "<"),
    "fp16": ("tab:red", ">"),
    "fp16-ls": ("tab:purple", "s"),
    "fp16-hg": ("tab:brown", "p"),
    "fp8-seed": ("tab:pink", "*"),
    "none-hg": ("teal", "d"),
    "fp8-hg": ("tab:gray", "h"),
    "int8-hg": ("tab:olive", "D"),
    "int4-hg": ("tab:cyan", "X"),
    "int2-hg": ("gold", "P"),
}


def _style(name: str) -> dict:
    """Line style of a mode in every plot: distinct for each of the demo's modes."""
    if name == "f32":
        return {"color": "black", "linewidth": 2.2, "zorder": 5, "linestyle": "-"}
    color, marker = MODE_STYLES.get(name, (None, None))
    style = {"linewidth": 1.3,
             "linestyle": ":" if name.endswith("-seed") else "-" if "hg" in name else "--"}
    if color is not None:
        style["color"] = color
    return style


def _marker(name: str) -> str:
    return MODE_STYLES.get(name, (None, "o"))[1]


def plot_losses(results: dict, path: Path) -> None:
    fig = _figure(7.5, 7)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    rows = _ok(results)
    k = max(1, results["config"]["steps"] // 30)
    ref = next((r for r in rows if r["name"] == "f32"), None)
    for r in rows:
        top.plot(_smooth(r["losses"], k), label=r["label"], **_style(r["name"]))
        if ref is not None and r is not ref:
            gap = [None if a is None or b is None else a - b
                   for a, b in zip(r["losses"], ref["losses"])]
            bottom.plot(_smooth(gap, k), label=r["label"], **_style(r["name"]))
    smooth = f" (moving average of {k})" if k > 1 else ""
    top.set_ylabel("training loss" + smooth)
    top.set_title("Loss curves: every mode from the same init on the same batches")
    top.legend(fontsize=7, ncol=2)
    bottom.axhline(0.0, color="black", linewidth=1.5)
    bottom.set_yscale("symlog", linthresh=1e-3)
    bottom.set_ylabel("loss − f32 loss" + smooth)
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def plot_sqnr(results: dict, path: Path) -> None:
    fig = _figure(9.5, 4.5)
    ax = fig.add_subplot()
    steps = results["eval_steps"]
    for r in _ok(results):
        if r["name"] == "f32":
            continue
        ys = [math.nan if not isinstance(s, (int, float)) else s for s in r["sqnr_db"]]
        ax.plot(steps[:len(ys)], ys, marker=_marker(r["name"]), markersize=4, label=r["label"],
                **_style(r["name"]))
    ax.set_xlabel("step")
    ax.set_ylabel("gradient SQNR vs f32 gradient (dB)")
    ax.set_title("Gradient fidelity, measured at each mode's own parameters")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)


def plot_memory(results: dict, path: Path) -> None:
    """Two panels, each with its own rows. Top: the bytes the scan over blocks saves, per mode,
    beside the uncompressed bf16 ``jax.checkpoint`` scan they are compared with (a reference,
    not a mode: it is never trained, so it has no step or temp figures). Bottom: per mode, the
    whole step's saved residuals and XLA's temp of the compiled gradient, side by side."""
    ratios = _scale_ratios(results)
    fig = _figure(8, 11.5 if ratios else 8)
    if ratios:
        first, top, bottom = fig.subplots(3, 1, height_ratios=[2.5, 3, 3])
        _plot_scale(first, results, ratios)
    else:
        top, bottom = fig.subplots(2, 1)
    rows = _ok(results)
    mb = 2.0**20
    remat = results.get("remat_bf16_block_residual_bytes")
    ref_label = "bf16 jax.checkpoint scan (reference)"
    labels = ([ref_label] if remat else []) + [r["label"] for r in rows]
    values = ([remat] if remat else []) + [r.get("block_residual_bytes") or 0 for r in rows]
    colors = (["lightgray"] if remat else []) + ["tab:green"] * len(rows)
    xs = list(range(len(labels)))
    bars = top.bar(xs, [v / mb for v in values], 0.6, color=colors, edgecolor="black",
                   linewidth=0.5)
    if remat:
        bars[0].set_hatch("//")
        top.axhline(remat / mb, color="black", linestyle="--", linewidth=1)
    top.set_yscale("log")
    top.set_ylabel("MB (log scale)")
    top.set_title("Saved by the scan over blocks (the dashed line: the bf16 jax.checkpoint scan)",
                  fontsize=9)
    top.set_xticks(xs)
    top.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)

    xs = list(range(len(rows)))
    w = 0.4
    saved = [(r["residual_bytes"] or 0) / mb for r in rows]
    temp = [None if r["temp_bytes"] is None else r["temp_bytes"] / mb for r in rows]
    bottom.bar([x - w / 2 for x in xs], saved, w, label="saved for the backward, whole model")
    bottom.bar([x + w / 2 for x in xs], [t or 0 for t in temp], w,
               label=f"XLA temp, compiled gradient ({results['environment']['backend']})")
    for x, t in zip(xs, temp):
        if t is None:  # the backend reported no memory analysis: say so rather than a gap
            bottom.text(x + w / 2, 0, "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
    remat_temp = results.get("remat_bf16_temp_bytes")
    if remat_temp:  # what a bf16 user runs today: the bf16 jax.checkpoint scan's step
        bottom.axhline(remat_temp / mb, color="black", linestyle="--", linewidth=1,
                       label="XLA temp, bf16 jax.checkpoint scan (reference)")
    bottom.set_ylabel("MB")
    cfg = results["config"]
    title = (f"Memory of one training step, per mode, at this run's size ({cfg['n_layers']} "
             f"blocks, d_model {cfg['d_model']})")
    note = small_size_note(results)
    if note:
        title += "\nhere the compressed modes sit above the dashed line"
        if "fixed costs" in note:
            title += (": the activations a codec shrinks are\nsmaller than its fixed costs at "
                      "this size (the top panel: a larger size)")
    bottom.set_title(title, fontsize=8)
    bottom.set_xticks(xs)
    bottom.set_xticklabels([r["label"] for r in rows], rotation=35, ha="right", fontsize=7)
    bottom.legend(fontsize=8)
    for ax in (top, bottom):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)


def _plot_scale(ax, results: dict, ratios: list[tuple[str, str, float]]) -> None:
    """The fair comparison, first: each compressed mode's training-step temp as a ratio to the
    bf16 jax.checkpoint scan's, at a size where a codec's saving shows."""
    scale = results["memory_at_scale"]
    xs = list(range(len(ratios)))
    bars = ax.bar(xs, [x for *_, x in ratios], 0.6, color="tab:green", edgecolor="black",
                  linewidth=0.5)
    for b, (*_, x) in zip(bars, ratios):
        ax.text(b.get_x() + b.get_width() / 2, x, f"{x:.2f}x", ha="center", va="bottom",
                fontsize=7)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_ylim(0, max(1.15, max(x for *_, x in ratios) * 1.15))
    ax.set_ylabel("x the bf16 remat step")
    ax.set_title(f"At scale: {_scale_size(scale)} (compiled, not trained)\npeak temp of "
                 f"one training step relative to the bf16 jax.checkpoint scan's "
                 f"({scale['remat_bf16_temp_bytes'] / 2**20:.0f} MB, the dashed line)",
                 fontsize=9)
    ax.set_xticks(xs)
    ax.set_xticklabels([label for _, label, _ in ratios], rotation=20, ha="right", fontsize=7)
    ax.grid(alpha=0.3, axis="y")


def plot_length_sweep(results: dict, path: Path) -> None:
    sweep = results["length_sweep"]
    labels = {r["name"]: r["label"] for r in results["modes"]}
    fig = _figure(8, 4.5)
    ax = fig.add_subplot()
    for name, ys in sweep["sqnr_db"].items():
        ax.plot(sweep["lengths"], [math.nan if y is None else y for y in ys],
                marker=_marker(name), label=labels.get(name, name), **_style(name))
    ax.set_xscale("log", base=2)
    ax.set_xticks(sweep["lengths"])
    ax.set_xticklabels([str(n) for n in sweep["lengths"]])
    ax.set_xlabel("sequence length T (steps of the recurrence)")
    ax.set_ylabel("gradient SQNR vs f32 gradient (dB)")
    ax.set_title("Gradient fidelity vs sequence length, at the initial parameters")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)


# ------------------------------------------------------------------------------ files

def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    return "\n".join(["| " + " | ".join(_md_cell(c) for c in header) + " |",
                      "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
                     + ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows])


def _label(results: dict, name: str) -> str:
    return next((r["label"] for r in results["modes"] if r["name"] == name), name)


def _markdown(results: dict, command: str | None) -> str:
    cfg, env = results["config"], results["environment"]
    lines = ["# hifigrad demo: precision modes side by side", ""]
    if command:
        lines += [f"Made with `{command}`.", ""]
    if cfg.get("task", "gpt") == "recurrent":
        model = (f"LRU-style linear recurrence (`lax.scan` over the {cfg['seq_len']}-byte "
                 f"context in the compute dtype), {cfg['n_layers']} scanned blocks, d_model "
                 f"{cfg['d_model']}, state {cfg['d_state']}")
    else:
        model = (f"GPT-style byte-level decoder, {cfg['n_layers']} scanned blocks, d_model "
                 f"{cfg['d_model']}, {cfg['n_heads']} heads, context {cfg['seq_len']}")
    lines += [
        f"- Model: {model}, {results['n_params']:,} parameters (float32 masters), AdamW.",
        f"- Data: {results['corpus']}.",
        f"- Training: {cfg['steps']} steps of batch {cfg['batch_size']}, seed {cfg['seed']}"
        + (f", data-parallel over {cfg['devices']} devices" if cfg.get("devices", 1) > 1 else "")
        + "; "
        f"gradient SQNR vs the f32 gradient at the same parameters every {cfg['eval_every']} "
        f"steps.",
        f"- Platform: JAX {env['jax']}, {env['backend']} ({env['device']}), Python "
        f"{env['python']}; run took {results['wall_s']:.0f} s.",
        "",
        "## Results",
        "",
        "| " + " | ".join(_md_cell(c) for c in TABLE_COLUMNS) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(TABLE_COLUMNS) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in table_rows(results)]
    lines += ["", LEGEND + (" " + SEED_NOTE if any(r["name"] == "fp8-seed"
                                                   for r in results["modes"]) else "")]
    header, rows = memory_table(results)
    lines += ["", "## Memory against the bf16 remat scan", "",
              "The first row is the baseline every ratio here and in the memory conclusions is "
              "relative to: `jax.grad` over the bf16 `lax.scan(jax.checkpoint(block))` at this "
              "run's size, what a bf16 user runs to save memory today (compiled, not trained). "
              "*blocks MB*: what the scan over blocks saves for the backward; *temp MB*: XLA's "
              "temporary buffers of the compiled gradient; *x baseline*: over the first row's.",
              "", _md_table(header, rows)]
    sweep = results.get("length_sweep")
    if sweep:
        labels = {r["name"]: r["label"] for r in results["modes"]}
        lines += ["", "## Gradient SQNR vs sequence length", "",
                  f"Each mode's gradient vs the f32 gradient at the shared initial parameters, on "
                  f"one batch of {sweep['batch_size']} sequences of each length (dB):", "",
                  "| mode | " + " | ".join(f"T={n}" for n in sweep["lengths"]) + " |",
                  "|---|" + "---:|" * len(sweep["lengths"])]
        lines += ["| " + _md_cell(labels.get(name, name)) + " | "
                  + " | ".join(_f(y, ".1f", "non-finite") for y in ys) + " |"
                  for name, ys in sweep["sqnr_db"].items()]
    scale = results.get("memory_at_scale")
    at_scale = scale_table(results)
    if at_scale:
        lines += ["", "## Memory at scale (compile-only)", "",
                  f"The demo's model at {_scale_size(scale)}, each training step compiled "
                  "from shapes (nothing trained) and its `memory_analysis()` read. The first "
                  "row is the baseline, the bf16 `jax.checkpoint` scan's step; *x codec none*: "
                  f"over the {_label(results, 'none-hg')} row's, the float32 backward in batch "
                  "slices with each block's input saved as it is (what a codec adds to the "
                  "slicing).", "", _md_table(*at_scale)]
    lines += ["", "## Conclusions (computed from the numbers above)", ""]
    lines += [f"- {c}" for c in results["conclusions"]]
    lines += [
        "", "## Plots", "",
        f"![loss curves]({PLOTS['loss']})", "",
        f"![gradient SQNR]({PLOTS['sqnr']})", "",
        f"![memory]({PLOTS['memory']})", "",
    ]
    if sweep:
        lines += [f"![gradient SQNR vs sequence length]({PLOTS['length']})", ""]
    lines += ["## Modes", ""]
    lines += [f"- **{r['label']}** (`{r['name']}`): {r['description']}"
              for r in results["modes"]]
    lines += [
        "", "## How the figures are measured", "",
        "- *grad SQNR*: `10 log10(|g_f32|² / |g - g_f32|²)` over all parameters, where `g` is "
        "the mode's gradient and `g_f32` the float32 `jax.grad` gradient at the same parameters "
        "on the same batch. *Step 0* is at the shared initial parameters; *mean* averages the "
        "evaluations along the mode's own trajectory.",
        "- *final loss*: mean training loss of the last 10% of steps; *Δ final* its difference "
        "to f32's; *mean |Δ|*: mean absolute difference of the two loss curves over all steps.",
        "- *val loss*: the final parameters' loss on held-out files, with a float32 forward.",
        "- *saved residuals*: bytes of the values the traced pullback keeps for the backward "
        "(each counted once, arguments excluded). *peak temp*: "
        "`jax.jit(grad_fn).lower(...).compile().memory_analysis().temp_size_in_bytes` of the "
        "mode's gradient program (the optimizer update is one program shared by all modes: "
        f"{_mb(results.get('optimizer_temp_bytes'))} MB temp).",
        "- *step*: median wall time of a training step (gradient and optimizer update, "
        "compiled ahead of time); *compile*: trace, lower and compile time of the mode's "
        "gradient program (programs are compiled a few at a time, in parallel).",
    ]
    if env["backend"] == "cpu" and cfg.get("cpu_opt_level", 1) < 1:
        lines += [
            f"- Compiled with XLA backend optimization level {cfg['cpu_opt_level']} to keep "
            "this short run short: step times are not representative."]
    if env["backend"] == "cpu":
        lines += [
            "- Measured on CPU, where XLA emulates bf16/fp16/fp8 arithmetic with conversions: "
            "low-precision steps are not faster than f32 there, and temporary buffers include "
            "conversion copies. Judge memory by the saved residuals and speed on a GPU."]
    return "\n".join(lines) + "\n"


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_report(results: dict, out_dir: str | os.PathLike, command: str | None = None
                 ) -> list[Path]:
    """Writes ``report.md``, ``results.json`` and the plots to ``out_dir``; returns the paths.

    Adds ``results["conclusions"]`` (computed by `conclusions`) if missing.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results.setdefault("conclusions", conclusions(results))
    paths = []
    plots = [("loss", plot_losses), ("sqnr", plot_sqnr), ("memory", plot_memory)]
    if results.get("length_sweep"):
        plots.append(("length", plot_length_sweep))
    for key, fn in plots:
        p = out / PLOTS[key]
        fn(results, p)
        paths.append(p)
    p = out / "results.json"
    p.write_text(json.dumps(_json_safe(results), indent=1, allow_nan=False) + "\n")
    paths.append(p)
    p = out / "report.md"
    p.write_text(_markdown(results, command), encoding="utf-8")
    paths.append(p)
    return paths
