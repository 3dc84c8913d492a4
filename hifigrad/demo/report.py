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

# Mean |Δloss| vs f32 (nats) above which a run's loss curves are said to separate.
LOSS_SEPARATION = 0.01

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


# ------------------------------------------------------------------------------ conclusions

def _num(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def conclusions(results: dict) -> list[str]:
    """Findings computed from the measurements, one sentence each."""
    out: list[str] = []
    ok = _ok(results)
    by = _by_name(results)
    others = [r for r in ok if r["name"] != "f32"]

    tracked = [r for r in others if _num(r.get("mean_abs_gap")) is not None]
    if tracked:
        tracked.sort(key=lambda r: r["mean_abs_gap"])
        best, worst = tracked[0], tracked[-1]
        out.append(
            f"Closest to the f32 loss curve: **{best['label']}** (mean |Δloss| "
            f"{best['mean_abs_gap']:.3g}, final-loss gap {_f(best['final_gap'], '+.3g')}); "
            f"furthest: **{worst['label']}** (mean |Δloss| {worst['mean_abs_gap']:.3g}, "
            f"final-loss gap {_f(worst['final_gap'], '+.3g')}).")
        order = ", ".join(f"{r['label']} {r['mean_abs_gap']:.3g}" for r in tracked)
        out.append(f"Mean |Δloss| vs f32, best to worst: {order}.")
    diverged = [r["label"] for r in others if r.get("final_loss") is None]
    if diverged:
        out.append(f"Training diverged (non-finite loss) for: {', '.join(diverged)}.")

    fid = [r for r in others if _num(r.get("sqnr_mean_db")) is not None]
    if fid:
        fid.sort(key=lambda r: -r["sqnr_mean_db"])
        out.append(
            f"Highest gradient SQNR vs f32 (mean over training): **{fid[0]['label']}** "
            f"({fid[0]['sqnr_mean_db']:.1f} dB); lowest: **{fid[-1]['label']}** "
            f"({fid[-1]['sqnr_mean_db']:.1f} dB).")

    for r in others:
        c = by.get(r.get("counterpart") or "")
        if c is None:
            continue
        a, b = _num(r.get("sqnr_mean_db")), _num(c.get("sqnr_mean_db"))
        a0, b0 = _num(r.get("sqnr_step0_db")), _num(c.get("sqnr_step0_db"))
        if a is None or b is None:
            continue
        verb = "higher" if a > b else "lower" if a < b else "equal"
        s = (f"{r['label']} vs {c['label']}: gradient SQNR {a:.1f} vs {b:.1f} dB "
             f"({a - b:+.1f} dB, {verb})")
        if a0 is not None and b0 is not None:
            s += f"; at step 0, same parameters: {a0:.1f} vs {b0:.1f} dB ({a0 - b0:+.1f} dB)"
        ga, gb = _num(r.get("final_gap")), _num(c.get("final_gap"))
        if ga is not None and gb is not None:
            closer = "closer to" if abs(ga) < abs(gb) else "further from" if abs(ga) > abs(gb) \
                else "as close to"
            s += f"; final loss {closer} f32 (gap {ga:+.3g} vs {gb:+.3g})"
        out.append(s + ".")

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
    mem = [r for r in ok if r.get("residual_bytes")]
    base = by.get("bf16")
    if mem:
        mem.sort(key=lambda r: r["residual_bytes"])
        s = (f"Smallest saved residuals: **{mem[0]['label']}** "
             f"({mem[0]['residual_bytes'] / 2**20:.2f} MB")
        if base is not None and base.get("residual_bytes"):
            s += f", {mem[0]['residual_bytes'] / base['residual_bytes']:.2f}x bf16 jax.grad's"
        s += f"); largest: **{mem[-1]['label']}** ({mem[-1]['residual_bytes'] / 2**20:.2f} MB)."
        out.append(s)
    remat = results.get("remat_bf16_block_residual_bytes")
    squeezed = [r for r in ok if r.get("block_residual_bytes") and r["saved"] != "all"]
    if remat and squeezed:
        s = ("Saved by the scan over blocks, relative to an uncompressed bf16 remat scan "
             f"(jax.checkpoint, {remat / 2**20:.3g} MB): " + ", ".join(
                 f"{r['label']} {r['block_residual_bytes'] / remat:.2f}x" for r in squeezed))
        plain = by.get("bf16")
        if plain is not None and plain.get("block_residual_bytes"):
            s += (f"; for scale, a plain lax.scan without jax.checkpoint ({plain['label']}) "
                  f"keeps {plain['block_residual_bytes'] / remat:.1f}x the remat scan's bytes "
                  "(every block's intermediates, not only its input)")
        out.append(s + ".")
    remat_temp = results.get("remat_bf16_temp_bytes")
    with_temp = [r for r in ok if r.get("temp_bytes")]
    if remat_temp and with_temp:
        out.append("Peak temp of one training step, relative to the bf16 jax.checkpoint scan's "
                   f"({remat_temp / 2**20:.3g} MB, bf16 backward): " + ", ".join(
                       f"{r['label']} {r['temp_bytes'] / remat_temp:.2f}x" for r in with_temp)
                   + ".")
        note = small_size_note(results)
        if note:
            out.append(note)
    timed = [r for r in ok if _num(r.get("step_ms")) is not None]
    if timed:
        timed.sort(key=lambda r: r["step_ms"])
        out.append(f"Fastest step: {timed[0]['label']} ({timed[0]['step_ms']:.1f} ms); slowest: "
                   f"{timed[-1]['label']} ({timed[-1]['step_ms']:.1f} ms), on "
                   f"{results['environment']['backend']}.")
    skipped = [r for r in results["modes"] if r["status"] != "ok"]
    for r in skipped:
        what = "failed" if r["status"] == "failed" else "was not run"
        out.append(f"{r['label']} {what}: {r['reason']}")
    return out


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
           f"({scale['remat_bf16_temp_bytes'] / 2**20:.3g} MB): "
           + ", ".join(f"{label} {x:.2f}x" for _, label, x in ratios) + "."]
    out += _split_conclusion(results)
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
    labels = {r["name"]: r["label"] for r in results["modes"]}
    codecs = [(n, t) for n, t in temps.items() if t and n.endswith("-hg")
              and n not in ("none-hg", "bf16-hg", "bf16-hg-fast", "fp16-hg")]
    s = (f"**Where it comes from**: the float32 backward run in batch slices, saving each "
         f"block's input as it is ({labels.get('none-hg', 'none-hg')}), takes "
         f"{none / ref:.2f}x of the bf16 jax.checkpoint scan's peak: that is the slicing's "
         f"share.")
    if codecs:
        s += (" Each codec then takes, of that: " + ", ".join(
            f"{labels.get(n, n)} {t / none:.2f}x" for n, t in codecs) + " (the codec's "
              "share, which grows with depth and batch: benchmarks/results/codec_share_*.md).")
    return [s]


def small_size_note(results: dict) -> str | None:
    """Why the compressed modes' step can need more temp than the bf16 jax.checkpoint scan's
    at the size this run trains, when it does (None otherwise)."""
    above = [(r, x) for r, x in _compressed_temp_ratios(results) if x > 1.0]
    if not above:
        return None
    cfg = results["config"]
    s = (f"At this run's size ({cfg['n_layers']} blocks, d_model {cfg['d_model']}, batch "
         f"{cfg['batch_size']} x {cfg['seq_len']}) the compressed modes' step needs more temp "
         f"than the bf16 jax.checkpoint scan's (up to {max(x for _, x in above):.2f}x): the "
         "block inputs a codec shrinks are a small part of it, smaller than its fixed costs "
         "(float32 gradients and backward buffers, the codec's scale and packing scratch)")
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
    gaps = [r for r in _ok(results) if _num(r.get("mean_abs_gap")) is not None]
    ref = _by_name(results).get("f32")
    if gaps and ref is not None and _num(ref.get("final_loss")) is not None:
        worst = max(gaps, key=lambda r: r["mean_abs_gap"])
        verb = "do not separate" if worst["mean_abs_gap"] < LOSS_SEPARATION else "separate"
        out.append(
            f"Loss curves at this size {verb}: the largest mean |Δloss| vs f32 is "
            f"{worst['mean_abs_gap']:.3g} ({worst['label']}, "
            f"{100 * worst['mean_abs_gap'] / ref['final_loss']:.2g}% of f32's final loss; "
            f"the threshold is {LOSS_SEPARATION} nats), so the gradient SQNR against the "
            f"sequence length shows the gap instead." if verb == "do not separate" else
            f"Loss curves at this size {verb}: the largest mean |Δloss| vs f32 is "
            f"{worst['mean_abs_gap']:.3g} ({worst['label']}; threshold {LOSS_SEPARATION} "
            f"nats).")
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
                       f"{labels[c]} {b:.1f} dB ({a - b:+.1f} dB).")
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
    if small_size_note(results):
        title += ("\nhere the compressed modes sit above the dashed line: the activations a "
                  "codec shrinks are\nsmaller than its fixed costs at this size (see the top "
                  "panel for a size where they dominate)")
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
    lines += ["", LEGEND]
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
    ratios = _scale_ratios(results)
    if ratios:
        lines += ["", "## Memory at scale (compile-only)", "",
                  f"The demo's model at {_scale_size(scale)}, each training step compiled "
                  "from shapes (nothing trained) and its `memory_analysis()` read, beside "
                  "the bf16 `jax.checkpoint` scan's step "
                  f"({scale['remat_bf16_temp_bytes'] / 2**20:.1f} MB temp). At the size this "
                  "run trains, the codecs' saving can be smaller than the step's fixed costs; "
                  "here the activations dominate:", "",
                  "| mode | temp MB | x bf16 remat |", "|---|---:|---:|"]
        lines += [f"| {_md_cell(label)} | {_mb(scale['temp_bytes'][n])} | {x:.2f} |"
                  for n, label, x in ratios]
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
