"""The `hifigrad demo` command: one quick run shared by the tests, and the flag errors.

Claims about the --quick run's temp bytes hold on XLA:CPU only (`cpu_only`): XLA:TPU reports
0 temp bytes for some of its tiny steps (the bf16 remat scan's among them; measured on a TPU
v5e), so there the temp bars, the ratio to the remat scan and the small-size note have
nothing to compare. The at-scale comparison, which leads the report, is checked everywhere.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest
from platforms import cpu_only, on_cpu

import hifigrad
from hifigrad.__main__ import main
from hifigrad.demo import MODE_NAMES, cli
from hifigrad.demo.data import load_corpus, sample_batches
from hifigrad.demo.train import gradient_sqnr_db

# The demo needs its extra (flax, optax, rich, matplotlib); where it is missing (a TPU host's
# own Python, say), the module is skipped with the names, as `hifigrad demo` says them.
pytestmark = pytest.mark.skipif(bool(cli.missing_demo_packages()),
                                reason=f"the demo extra is missing here: "
                                       f"{', '.join(cli.missing_demo_packages())}")

_QUICK_TEMP = cpu_only("XLA:TPU reports 0 temp bytes for some of --quick's tiny steps (measured)")

# Each hifigrad row and the plain row it must beat on gradient SQNR (mean over training).
HG_VS_PLAIN = [
    ("bf16-hg", "bf16"),
    ("none-hg", "bf16"),
    ("bf16-hg-fast", "bf16"),
    ("fp16-hg", "fp16"),
    ("fp8-hg", "fp8-seed"),
    ("int8-hg", "fp8-seed"),
    ("int4-hg", "fp8-seed"),
    ("int2-hg", "fp8-seed"),
]
FILES = ["report.md", "results.json", "loss_curves.png", "grad_sqnr.png", "memory.png"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """Runs ``hifigrad demo --quick`` once, under the suite's strict promotion rules."""
    out = tmp_path_factory.mktemp("demo")
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        rc = main(["demo", "--quick", "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    return rc, out, results, {r["name"]: r for r in results["modes"]}


def test_quick_run_succeeds_and_writes_every_file(quick):
    rc, out, results, _ = quick
    failed = {r["name"]: r["reason"] for r in results["modes"] if r["status"] != "ok"}
    assert failed == {}
    assert rc == 0
    for name in FILES:
        assert (out / name).stat().st_size > 0, name
    for name in FILES[2:]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_quick_run_has_a_row_per_mode_with_finite_figures(quick):
    _, out, results, rows = quick
    assert [r["name"] for r in results["modes"]] == list(MODE_NAMES)
    report = (out / "report.md").read_text()
    for name, r in rows.items():
        assert f"| {r['label']} |" in report, name
        assert len(r["losses"]) == results["config"]["steps"]
        figures = [*r["losses"], r["val_loss"], r["final_loss"], r["step_ms"], r["compile_s"]]
        if name != "f32":
            figures += [r["sqnr_step0_db"], r["sqnr_mean_db"], r["final_gap"], r["mean_abs_gap"]]
        assert all(isinstance(x, (int, float)) and math.isfinite(x) for x in figures), name
        assert r["residual_bytes"] > 0 and r["block_residual_bytes"] > 0, name
        assert r["temp_bytes"] is None or r["temp_bytes"] >= 0, name
    header = next(line for line in report.splitlines() if line.startswith("| mode |"))
    assert header.count(" | ") == 11  # every column, none split by a stray "|"
    assert "## Conclusions" in report


@pytest.mark.parametrize("hg_mode, plain_mode", HG_VS_PLAIN)
def test_hg_rows_beat_their_plain_counterpart_on_gradient_sqnr(quick, hg_mode, plain_mode):
    rows = quick[3]
    hg_row, plain = rows[hg_mode], rows[plain_mode]
    assert hg_row["status"] == "ok" and plain["status"] == "ok", (hg_row["reason"], plain["reason"])
    assert hg_row["counterpart"] == plain_mode
    assert hg_row["sqnr_mean_db"] > plain["sqnr_mean_db"]


def test_compressed_modes_save_less_for_the_blocks(quick):
    rows, remat = quick[3], quick[2]["remat_bf16_block_residual_bytes"]
    plain_scan = rows["bf16"]["block_residual_bytes"]
    for name in ("fp8-seed", "fp8-hg", "int8-hg"):
        assert rows[name]["block_residual_bytes"] < 0.6 * remat < plain_scan, name
    assert rows["int4-hg"]["block_residual_bytes"] < rows["fp8-hg"]["block_residual_bytes"]
    assert rows["int2-hg"]["block_residual_bytes"] < rows["int4-hg"]["block_residual_bytes"]


# ------------------------------------------------------------------------------ recurrent task

RECURRENT_MODES = ("f32", "bf16", "bf16-hg")


@pytest.fixture(scope="module")
def recurrent(tmp_path_factory):
    """A tiny ``--task recurrent --quick`` run: 1 block, 3 steps, 3 modes, lengths 64 and 256
    (the quick training length)."""
    out = tmp_path_factory.mktemp("recurrent")
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        rc = main(["demo", "--task", "recurrent", "--quick", "--modes", ",".join(RECURRENT_MODES),
                   "--steps", "3", "--layers", "1", "--lengths", "64", "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    return rc, out, results


def test_recurrent_quick_run_writes_report_results_and_plots(recurrent):
    rc, out, results = recurrent
    assert rc == 0
    assert [r["name"] for r in results["modes"]] == list(RECURRENT_MODES)
    assert all(r["status"] == "ok" for r in results["modes"])
    cfg = results["config"]
    assert cfg["task"] == "recurrent" and cfg["seq_len"] == 256 and cfg["n_layers"] == 1
    for name in [*FILES, "sqnr_vs_length.png"]:
        assert (out / name).stat().st_size > 0, name
    assert (out / "sqnr_vs_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert "LRU-style linear recurrence" in report
    assert "## Gradient SQNR vs sequence length" in report and "| T=64 | T=256 |" in report
    assert any(c.startswith("Gradient SQNR vs f32 at the initial parameters")
               for c in results["conclusions"])
    assert sum(c.startswith("Loss curves at this size") for c in results["conclusions"]) == 1


def test_recurrent_length_sweep_is_measured_against_f32(recurrent):
    _, _, results = recurrent
    sweep = results["length_sweep"]
    assert sweep["lengths"] == [64, 256] and set(sweep["sqnr_db"]) == {"bf16", "bf16-hg"}
    rows = {r["name"]: r for r in results["modes"]}
    for name, ys in sweep["sqnr_db"].items():
        assert all(isinstance(y, float) and math.isfinite(y) for y in ys), name
        # At the training length the sweep is the training run's step-0 measurement (same
        # parameters, same batch, same compiled program). Off CPU the program's second run may
        # differ in the last float32 bits (a GPU's scatter-add of the embedding gradient may
        # use atomics, summing in another order): a normwise change of the gradient of 1e-7
        # (a few float32 roundings) moves an SQNR of at most 60 dB by under 1e-3 dB (20 log10(1
        # + 1e-7 / 1e-3)); another batch or program moves it by far more.
        assert ys[-1] == pytest.approx(rows[name]["sqnr_step0_db"],
                                       abs=1e-9 if on_cpu() else 1e-3), name
    # The claim the task exists to show, at the longest length measured here.
    assert sweep["sqnr_db"]["bf16-hg"][-1] > sweep["sqnr_db"]["bf16"][-1]


def test_default_task_is_the_gpt():
    from hifigrad.demo.cli import _config, _parser
    from hifigrad.demo.train import RECURRENT, DemoConfig

    args = _parser().parse_args(["demo"])
    assert _config(args) == DemoConfig()
    cfg = _config(_parser().parse_args(["demo", "--task", "recurrent"]))
    assert cfg == RECURRENT and cfg.seq_len >= 1024 and cfg.model.seq_len == cfg.seq_len


# ------------------------------------------------------------------------------ flag errors

def _one_line_error(capsys, argv) -> str:
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    prefix = "hifigrad demo: error:" if argv[0] == "demo" else "hifigrad: error:"
    assert lines[0].startswith(prefix) and "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize("argv, expected", [
    (["demo", "--modes", "bf16,nope"], "unknown mode 'nope'"),
    (["demo", "--modes", ","], "no mode given"),
    (["demo", "--steps", "0"], "must be at least 1"),
    (["demo", "--steps", "many"], "expected a positive integer"),
    (["demo", "--layers", "-2"], "must be at least 1"),
    (["demo", "--seed", "-1"], "must be non-negative"),
    (["demo", "--frobnicate"], "unrecognized arguments"),
    (["demo", "--devices", "8"], "--devices 8: JAX sees only"),
    (["frobnicate"], "invalid choice"),
    (["demo", "--task", "lstm"], "invalid choice"),
    (["demo", "--task", "recurrent", "--lengths", "64,0"], "lengths must be at least 1"),
    (["demo", "--task", "recurrent", "--lengths", ","], "no length given"),
    (["demo", "--lengths", "64"], "only the recurrent task"),
])
def test_bad_flags_get_a_one_line_error(capsys, tmp_path, argv, expected):
    line = _one_line_error(capsys, [*argv, "--out", str(tmp_path)] if argv[0] == "demo"
                           else argv)
    assert expected in line


def test_unwritable_out_gets_a_one_line_error(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    line = _one_line_error(capsys, ["demo", "--quick", "--out", str(blocker / "sub")])
    assert "--out" in line and "cannot write" in line


def test_python_m_hifigrad_reports_bad_flags_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "hifigrad", "demo", "--modes", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown mode" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_main_is_the_console_script():
    assert hifigrad.__main__.main is main


# The demo extra hidden from a fresh interpreter, as on a plain `pip install .` of hifigrad: each
# named module is set to None in sys.modules, so importing it raises ModuleNotFoundError.
_WITHOUT = ("import sys; hidden = sys.argv[1].split(','); del sys.argv[1]; "
            "sys.modules.update(dict.fromkeys(hidden)); "
            "from hifigrad.__main__ import main; sys.argv[0] = 'hifigrad'; rc = main(); "
            "assert not [m for m in hidden if sys.modules.get(m) is not None]; sys.exit(rc)")


def _run_without(hidden, *argv):
    return subprocess.run([sys.executable, "-c", _WITHOUT, ",".join(hidden), *argv],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"]])
def test_help_works_without_the_demo_extra(argv):
    proc = _run_without(cli.DEMO_EXTRA, *argv)
    assert proc.returncode == 0, proc.stderr
    assert "demo" in proc.stdout and proc.stderr == ""
    if argv[0] == "demo":
        assert "--quick" in proc.stdout and "int2-hg" in proc.stdout


@pytest.mark.parametrize("hidden", [("optax",), cli.DEMO_EXTRA])
def test_demo_without_its_extra_prints_one_line_naming_the_extra(hidden):
    proc = _run_without(hidden, "demo", "--quick", "--out", "unused-demo-out")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "pip install -e '.[demo]'" in lines[0] and "pip install flax optax rich " \
        "matplotlib" in lines[0] and "optax" in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_cli_lists_what_the_demo_imports():
    """The CLI's copies agree with their sources: the tasks with the training code's, the
    packages it checks with pyproject.toml's `demo` extra (what `make demo` installs)."""
    import pathlib
    import re
    import tomllib

    from hifigrad.demo import train

    assert cli.TASKS == train.TASKS
    pyproject = pathlib.Path(__file__).parent.parent / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["demo"]
    assert sorted(re.match(r"[A-Za-z0-9_.-]+", r).group() for r in extra) == \
        sorted(cli.DEMO_EXTRA)


@pytest.mark.parametrize("width", [200, 150, 100])
def test_terminal_table_never_wraps_a_mode_label(quick, width):
    """Each mode is one line of each table, whatever the terminal's width: a wrapped label
    would read as a row of its own."""
    import io

    from rich.console import Console

    _, _, results, _ = quick
    console = Console(width=width, file=io.StringIO(), color_system=None)
    tables = cli._rich_tables(results, width)
    for t in tables:
        console.print(t)
    lines = console.file.getvalue().splitlines()
    body = [line for line in lines if line.startswith("│")]
    labels = [r["label"] for r in results["modes"]]
    assert [line.split("│")[1].strip() for line in body] == labels * len(tables)
    assert max(len(line) for line in lines) <= width
    assert len(tables) == (1 if width >= 200 else 2)


def test_progress_shows_each_modes_own_training_time(monkeypatch):
    """The modes compile together, then train one after the other: each bar's time runs from
    the end of the previous mode (or of compiling) to its own end, not from its creation."""
    import io
    import types

    from rich.console import Console

    now = [0.0]  # the clock the reporter reads (the progress display reads it too)
    monkeypatch.setattr(cli, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    a, b = (types.SimpleNamespace(name=n, label=n) for n in ("a", "b"))
    ok = {"status": "ok", "step_ms": 1.0}

    def at(t, event, *args):
        now[0] = t
        event(*args)

    with cli._RichReporter(Console(file=io.StringIO(), width=120)) as rep:
        at(1.0, rep.stage, "tracing")               # the order of hifigrad.demo.train.run
        at(2.0, rep.mode_start, a, 2)
        at(2.0, rep.mode_start, b, 2)
        at(3.0, rep.stage, "compiling")
        at(5.0, rep.mode_compiled, a, 3.0)
        at(6.0, rep.mode_compiled, b, 4.0)          # a starts training
        at(8.0, rep.mode_step, a, 0)
        at(9.0, rep.mode_step, a, 1)
        at(10.0, rep.mode_end, a, ok)               # b starts training
        at(12.0, rep.mode_step, b, 0)
        at(12.5, rep.mode_step, b, 1)
        at(13.0, rep.mode_end, b, ok)
        tasks = {t.description.split(":")[0]: t.fields for t in rep.progress.tasks}
    assert (tasks["tracing"]["t0"], tasks["tracing"]["t1"]) == (1.0, 2.0)
    assert (tasks["compiling"]["t0"], tasks["compiling"]["t1"]) == (3.0, 6.0)
    assert (tasks["a"]["t0"], tasks["a"]["t1"]) == (6.0, 10.0)
    assert (tasks["b"]["t0"], tasks["b"]["t1"]) == (10.0, 13.0)


def test_version_flag_prints_the_package_version(capsys):
    import platform

    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == (f"hifigrad {hifigrad.__version__} (jax {jax.__version__}, Python "
                   f"{platform.python_version()})")
    assert hifigrad.__version__ != "0.0.0+unknown"  # read from the installed metadata


def test_demo_help_shows_every_default(capsys):
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    sub = next(a for a in cli._parser()._actions if a.dest == "command").choices["demo"]
    flags = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 8
    for a in flags:
        assert "(default:" in a.help or "default: " in a.help, a.option_strings
    # what the help shows is what a run without the flag gets
    assert "(default: 200; with --quick 30;" in " ".join(out.split())
    assert "(default: 0)" in out


def test_help_defaults_agree_with_the_demo_configurations():
    from hifigrad.demo.train import QUICK, RECURRENT, RECURRENT_QUICK, DemoConfig

    configs = {("gpt", False): DemoConfig(), ("gpt", True): QUICK,
               ("recurrent", False): RECURRENT, ("recurrent", True): RECURRENT_QUICK}
    assert cli.CONFIG_DEFAULTS == {k: (c.steps, c.n_layers) for k, c in configs.items()}
    for (task, quick), cfg in configs.items():
        argv = ["demo", "--task", task] + (["--quick"] if quick else [])
        assert cli._config(cli._parser().parse_args(argv)) == cfg


class _Stream:
    """A text stream recording what was written before each flush."""

    def __init__(self):
        self.buffer, self.flushed = "", []

    def write(self, text):
        self.buffer += text

    def flush(self):
        self.flushed.append(self.buffer)

    def isatty(self):
        return False


def test_progress_is_printed_line_by_line_when_output_is_not_a_terminal(monkeypatch):
    """On a pipe or in a log file every event is a line, flushed as it is written (a live
    display would show nothing until the run ends)."""
    import types

    from rich.console import Console

    stream = _Stream()
    rep = cli._reporter(Console(file=stream))
    assert isinstance(rep, cli._LineReporter)
    now = [0.0]
    monkeypatch.setattr(cli, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    a = types.SimpleNamespace(name="a", label="mode a")
    with rep:
        rep.stage("tracing every mode")
        rep.mode_start(a, 8)
        now[0] = 4.0
        rep.mode_compiled(a, 3.5)
        for i in range(8):
            now[0] = 5.0 + i
            rep.mode_step(a, i)
        rep.mode_end(a, {"status": "ok", "step_ms": 12.5})
    lines = stream.buffer.splitlines()
    assert lines == ["[hifigrad demo] tracing every mode",
                     "[hifigrad demo] mode a: compiled in 3.5 s",
                     "[hifigrad demo] mode a: step 2/8 (2.0 s)",
                     "[hifigrad demo] mode a: step 4/8 (4.0 s)",
                     "[hifigrad demo] mode a: step 6/8 (6.0 s)",
                     "[hifigrad demo] mode a: step 8/8 (8.0 s)",
                     "[hifigrad demo] mode a: done, 12.5 ms/step"]
    # each line reached the stream's reader before the next event
    assert stream.flushed == ["\n".join(lines[:i + 1]) + "\n" for i in range(len(lines))]


def test_progress_is_live_on_a_terminal():
    import io

    from rich.console import Console

    assert isinstance(cli._reporter(Console(file=io.StringIO(), force_terminal=True)),
                      cli._RichReporter)


def test_plot_styles_are_distinct_for_every_mode():
    from hifigrad.demo.report import _marker, _style

    styles = {name: (_style(name)["color"], _style(name)["linestyle"], _marker(name))
              for name in MODE_NAMES}
    colors = [c for c, _, _ in styles.values()]
    markers = [m for _, _, m in styles.values()]
    assert len(set(colors)) == len(MODE_NAMES), styles
    assert len(set(markers)) == len(MODE_NAMES), styles


@_QUICK_TEMP
def test_memory_plot_has_a_temp_bar_for_every_mode(quick, tmp_path, monkeypatch):
    """memory.png: the per-step panel has a saved and a temp bar for every mode; the bf16
    jax.checkpoint reference (never trained, so no temp) is only in the panel of saved bytes."""
    import matplotlib.figure

    from hifigrad.demo.report import plot_memory

    _, _, results, rows = quick
    fig_axes = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, path: fig_axes.append(fig.axes))
    plot_memory(results, tmp_path / "memory.png")
    (scale, top, bottom), = fig_axes
    assert [t.get_text() for t in scale.get_xticklabels()] == [
        rows[n]["label"] for n in results["memory_at_scale"]["temp_bytes"]]
    labels = [t.get_text() for t in bottom.get_xticklabels()]
    assert labels == [r["label"] for r in rows.values()]
    saved, temp = bottom.containers
    assert len(temp) == len(labels) and all(b.get_height() > 0 for b in temp)
    assert all(b.get_height() > 0 for b in saved)
    assert [t.get_text() for t in top.get_xticklabels()][0].startswith("bf16 jax.checkpoint")


@_QUICK_TEMP
def test_memory_is_compared_with_the_bf16_remat_scan_step(quick):
    """The report measures what a bf16 user runs today (the bf16 jax.checkpoint scan's whole
    training step, compiled) and states every mode's peak temp relative to it."""
    _, _, results, rows = quick
    remat = results["remat_bf16_temp_bytes"]
    assert isinstance(remat, int) and remat > 0
    text = " ".join(results["conclusions"])
    assert "relative to the bf16 jax.checkpoint scan's" in text
    ratio = rows["int8-hg"]["temp_bytes"] / remat
    assert f"{rows['int8-hg']['label']} {ratio:.2f}x" in text


def test_memory_at_scale_leads_with_the_saving(quick, tmp_path, monkeypatch):
    """Every GPT run also compiles (does not train) the compressed modes and the bf16
    jax.checkpoint scan at a size where the codec's saving shows, and leads the memory plot,
    the report and the memory conclusions with that comparison."""
    import matplotlib.figure

    from hifigrad.demo.report import plot_memory
    from hifigrad.demo.train import SCALE, SCALE_BATCH

    _, out, results, rows = quick
    scale = results["memory_at_scale"]
    assert scale["model"]["n_layers"] == SCALE.n_layers and scale["batch_size"] == SCALE_BATCH
    assert sorted(scale["temp_bytes"]) == ["fp8-hg", "int2-hg", "int4-hg", "int8-hg", "none-hg"]
    ref = scale["remat_bf16_temp_bytes"]
    ratios = {n: t / ref for n, t in scale["temp_bytes"].items()}
    assert all(x < 1.0 for x in ratios.values()), ratios  # the saving shows at this size
    text = " ".join(results["conclusions"])
    want = ", ".join(f"{rows[n]['label']} {x:.2f}x" for n, x in ratios.items())
    assert want in text and "At scale" in text
    # first among the memory conclusions
    memory = [c for c in results["conclusions"] if "MB" in c]
    assert memory[0].startswith("**At scale**")
    report = (out / "report.md").read_text()
    assert "## Memory at scale (compile-only)" in report
    assert f"| {rows['int8-hg']['label']} | " in report.split("## Memory at scale")[1]
    fig_axes = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, path: fig_axes.append(fig.axes))
    plot_memory(results, tmp_path / "memory.png")
    first = fig_axes[0][0]
    assert first.get_title().startswith("At scale")
    assert [round(b.get_height(), 6) for b in first.patches] == [
        round(x, 6) for x in ratios.values()]


def _with_temps(results, factor):
    """A copy of ``results`` whose compressed modes' step temp is ``factor`` times the bf16
    jax.checkpoint scan's."""
    import copy

    r = copy.deepcopy(results)
    for row in r["modes"]:
        if row["status"] == "ok" and row["saved"] not in ("all", "fp8-seed"):
            row["temp_bytes"] = int(factor * r["remat_bf16_temp_bytes"])
    r.pop("conclusions", None)
    return r


@_QUICK_TEMP
@pytest.mark.parametrize("factor", [1.2, 0.8])
def test_report_says_why_small_runs_show_no_saving(quick, tmp_path, monkeypatch, factor):
    """Where the compressed modes' step needs more temp than the bf16 remat scan's (as at
    --quick's size), the conclusions and the plot say why, and point at the size where the
    saving shows; where it does not, they say nothing of the kind."""
    import matplotlib.figure

    from hifigrad.demo.report import conclusions, plot_memory, small_size_note

    _, _, results, _ = quick
    r = _with_temps(results, factor)
    note = small_size_note(r)
    fig_axes = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, path: fig_axes.append(fig.axes))
    plot_memory(r, tmp_path / "memory.png")
    title = fig_axes[0][-1].get_title()
    if factor > 1:
        assert note in conclusions(r)
        assert "at this run's size" in note.lower() and f"up to {factor:.2f}x" in note
        assert "smaller than its fixed costs" in note and "at scale" in note
        assert "smaller than its fixed costs" in title
    else:
        assert note is None
        assert "fixed costs" not in " ".join(conclusions(r)) and "fixed costs" not in title


def test_conclusions_do_not_call_the_plain_scan_a_saving(quick):
    _, _, results, _ = quick
    text = " ".join(results["conclusions"])
    assert "lax.scan" in text and " saves " not in text


# ------------------------------------------------------------------------------ pieces

def test_corpus_is_deterministic_and_split_by_file():
    a, b = load_corpus(200_000), load_corpus(200_000)
    assert a.train.dtype == np.uint8 and a.train.size > 100_000 and a.val.size > 0
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.val, b.val)
    batches = sample_batches(a.train, 3, 2, 16, seed=0)
    assert batches.shape == (3, 2, 17) and batches.dtype == np.int32
    np.testing.assert_array_equal(batches, sample_batches(a.train, 3, 2, 16, seed=0))


def test_gradient_sqnr():
    g = np.array([1.0, 2.0, 3.0])
    assert gradient_sqnr_db(g, g) == math.inf
    assert gradient_sqnr_db(g * 1.1, g) == pytest.approx(20.0)  # error 10% of the signal
    assert gradient_sqnr_db(np.array([1.0, np.nan, 3.0]), g) is None


def test_no_command_says_a_command_is_needed(capsys):
    """``hifigrad`` alone: the usage and a line saying a command is needed, exit status 2."""
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "usage: hifigrad" in err
    assert err.strip().splitlines()[-1] == (
        "hifigrad: error: a command is needed, e.g. `hifigrad demo` "
        "(or `hifigrad demo --help`)")


def test_report_splits_the_saving_into_slicing_and_codec():
    """The memory conclusion at scale says what the sliced float32 backward saves alone (the
    'none-hg' row) and what each codec takes of that."""
    from hifigrad.demo.report import _split_conclusion

    results = {"modes": [{"name": "none-hg", "label": "bf16 act, f32 grad (hg)"},
                         {"name": "int8-hg", "label": "int8 act, f32 grad (hg)"},
                         {"name": "bf16-hg", "label": "bf16 hg exact"}],
               "memory_at_scale": {"remat_bf16_temp_bytes": 100,
                                   "temp_bytes": {"none-hg": 60, "int8-hg": 45,
                                                  "bf16-hg": 130}}}
    (line,) = _split_conclusion(results)
    assert "takes 0.60x of the bf16 jax.checkpoint scan's peak" in line
    assert "int8 act, f32 grad (hg) 0.75x" in line and "bf16 hg exact" not in line


# ------------------------------------------------------------------------------ the report's claims
# Synthetic results (no training run) fed to the report: each claim appears only where the
# numbers printed with it support it, and the opposite numbers give the opposite claim or none.

MB = 2**20


def _row(name, **fields):
    from hifigrad.demo.modes import get_mode

    m = get_mode(name)
    row = {"name": name, "label": m.label, "description": m.description, "saved": m.saved,
           "counterpart": m.counterpart, "grad": m.grad, "dtype": "bfloat16", "status": "ok",
           "reason": None, "losses": [2.5] * 20, "sqnr_db": [40.0], "sqnr_step0_db": 40.0,
           "sqnr_mean_db": 40.0, "final_loss": 2.5, "final_gap": 0.0, "mean_abs_gap": 0.005,
           "val_loss": 2.5, "residual_bytes": MB, "block_residual_bytes": MB // 2,
           "temp_bytes": 4 * MB, "step_ms": 30.0, "step_ms_quartiles": [29.0, 31.0],
           "compile_s": 10.0, "lost_grad_frac_step0": 0.0, "skipped_steps": 0}
    row.update(fields)
    return row


def _synthetic(*rows, config=None, **extra):
    import dataclasses

    from hifigrad.demo.train import DemoConfig

    f32 = _row("f32", final_gap=None, mean_abs_gap=None, sqnr_step0_db=None, sqnr_mean_db=None)
    results = {"config": dataclasses.asdict(DemoConfig(**(config or {}))),
               "environment": {"jax": "0.10.2", "python": "3.11", "backend": "cpu",
                               "device": "cpu", "device_count": 1},
               "corpus": "synthetic", "n_params": 235_904, "eval_steps": [0],
               "modes": [f32, *rows], "optimizer_temp_bytes": MB,
               "remat_bf16_block_residual_bytes": MB, "remat_bf16_temp_bytes": 4 * MB,
               "length_sweep": None, "memory_at_scale": None, "wall_s": 1.0}
    results.update(extra)
    return results


def _conclusions(results):
    from hifigrad.demo.report import conclusions

    return conclusions(results)


def _markdown(results):
    from hifigrad.demo.report import _markdown, conclusions

    results.setdefault("conclusions", conclusions(results))
    return _markdown(results, None)


def test_report_states_its_noise_threshold_first():
    from hifigrad.demo.report import SEED_SPREAD, noise

    r = _synthetic(_row("bf16"), config={"seed": 3})
    first = _conclusions(r)[0]
    n = noise(r)
    assert n["source"] == "default" and n["loss"] == SEED_SPREAD["default"]["loss"]
    assert first.startswith("**Noise threshold**") and "(seed 3)" in first
    assert f"differences under {n['loss']:g} nats in loss" in first
    assert f"{n['sqnr_step0']:g} dB in gradient SQNR at step 0" in first
    assert "over seeds 0 to 4 of the default configuration (the run-to-run spread)" in first


def test_noise_thresholds_are_those_measured_for_the_configuration_run():
    """--quick gets the spread measured on --quick; a configuration never measured gets the
    larger of the measured ones, and the report says it was not measured."""
    import dataclasses

    from hifigrad.demo.report import SEED_SPREAD, SPREAD_CONFIGS, noise
    from hifigrad.demo.train import QUICK, DemoConfig

    for name, cfg in (("default", DemoConfig()), ("--quick", QUICK)):
        sizes = {k: getattr(cfg, k) for k in SPREAD_CONFIGS[name]}
        assert sizes == SPREAD_CONFIGS[name], name
        n = noise({"config": dataclasses.asdict(dataclasses.replace(cfg, seed=7))})
        assert n == {**SEED_SPREAD[name], "source": name}
    other = {"config": dataclasses.asdict(dataclasses.replace(QUICK, steps=1000))}
    n = noise(other)
    assert n["source"] is None and n["loss"] == max(t["loss"] for t in SEED_SPREAD.values())
    from hifigrad.demo.report import noise_note

    assert "spread between seeds was not measured" in noise_note(
        {**other, "config": {**other["config"], "seed": 0}})


def test_loss_differences_within_the_threshold_are_not_claimed():
    """The case that prompted the threshold: 0.00006 apart in final loss, 0.0009 in mean
    |Δloss|: neither row is called closer to f32."""
    text = " ".join(_conclusions(_synthetic(
        _row("bf16", final_gap=-0.00200, mean_abs_gap=0.0060),
        _row("bf16-hg", final_gap=-0.00194, mean_abs_gap=0.0069))))
    assert "closer to f32" not in text and "further from f32" not in text
    assert "Closest" not in text and "Further from the f32 loss curve" not in text
    assert "gaps to f32 -0.0019 vs -0.002, within the noise threshold: neither is claimed " \
        "closer" in text
    assert "bf16 jax.grad 0.006, bf16 hg exact 0.0069; no order among these is claimed" in text


@pytest.mark.parametrize("hg_gap, plain_gap, word", [(-0.002, 0.05, "closer to"),
                                                     (0.05, -0.002, "further from")])
def test_loss_differences_beyond_the_threshold_are_claimed(hg_gap, plain_gap, word):
    out = _conclusions(_synthetic(_row("bf16", final_gap=plain_gap, mean_abs_gap=abs(plain_gap)),
                                  _row("bf16-hg", final_gap=hg_gap, mean_abs_gap=abs(hg_gap))))
    (line,) = [c for c in out if c.startswith("bf16 hg exact vs bf16 jax.grad")]
    assert f"final loss {word} f32's" in line
    (far,) = [c for c in out if c.startswith("Further from the f32 loss curve")]
    worse = "bf16 jax.grad" if plain_gap > hg_gap else "bf16 hg exact"
    better = "bf16 hg exact" if worse == "bf16 jax.grad" else "bf16 jax.grad"
    assert f"**{worse}** (mean |Δloss| 0.05, final-loss gap +0.05)" in far and better not in far


@pytest.mark.parametrize("step", [+1, 0, -1])
def test_sqnr_differences_are_named_only_beyond_the_threshold(step):
    """A difference of 1.5x the threshold is named (higher or lower), one of half of it is
    not; step 0 and the mean over training each against their own threshold."""
    from hifigrad.demo.report import noise

    base = _synthetic(_row("bf16"))
    n = noise(base)
    plain0, plain = 40.0, 40.0
    hg0 = plain0 + (1.5 * step or 0.5) * n["sqnr_step0"]
    hg = plain + (1.5 * step or 0.5) * n["sqnr_mean"]
    verdict = {1: "higher", 0: "within the noise threshold", -1: "lower"}[step]
    out = _conclusions(_synthetic(_row("bf16", sqnr_mean_db=plain, sqnr_step0_db=plain0),
                                  _row("bf16-hg", sqnr_mean_db=hg, sqnr_step0_db=hg0)))
    (line,) = [c for c in out if c.startswith("bf16 hg exact vs bf16 jax.grad")]
    assert f"({hg - plain:+.1f} dB, {verdict});" in line
    assert f"({hg0 - plain0:+.1f} dB, {verdict});" in line
    (ranked,) = [c for c in out if c.startswith("Gradient SQNR vs f32 (mean over training)")]
    if step == 0:
        assert f"every mode within {n['sqnr_mean']:g} dB" in ranked and "**" not in ranked
    else:
        best = "bf16 hg exact" if step > 0 else "bf16 jax.grad"
        assert f"Highest: **{best}**" in ranked


def test_memory_ratios_are_against_a_baseline_row_the_table_shows():
    """Every memory ratio is relative to a row of the table beside it, and the table says which
    row that is: the plain scan's 5.19x is read against the baseline's 1.00."""
    from hifigrad.demo.report import memory_table

    r = _synthetic(_row("bf16", block_residual_bytes=int(5.19 * MB), temp_bytes=6 * MB),
                   _row("int8-hg", block_residual_bytes=MB // 4, temp_bytes=3 * MB))
    header, rows = memory_table(r)
    assert header == ["mode", "blocks MB", "x baseline", "temp MB", "x baseline"]
    assert rows[0] == ["bf16 jax.checkpoint scan (baseline)", "1.00", "1.00", "4.00", "1.00"]
    assert rows[1][0] == "f32 reference"
    assert rows[2] == ["bf16 jax.grad", "5.19", "5.19", "6.00", "1.50"]
    assert rows[3] == ["int8 act, f32 grad (hg)", "0.25", "0.25", "3.00", "0.75"]
    text = " ".join(_conclusions(r))
    assert "relative to the memory table's baseline row" in text
    assert "keeps 5.19x the baseline's bytes" in text and "int8 act, f32 grad (hg) 0.25x" in text
    assert "int8 act, f32 grad (hg) 0.75x" in text
    report = _markdown(r)
    table = report.split("## Memory against the bf16 remat scan")[1]
    assert "The first row is the baseline" in table
    assert "| bf16 jax.checkpoint scan (baseline) | 1.00 | 1.00 | 4.00 | 1.00 |" in table


def _at_scale(int8, int4, int2, none=53):
    import dataclasses

    from hifigrad.demo.train import SCALE, SCALE_BATCH

    return {"model": dataclasses.asdict(SCALE), "batch_size": SCALE_BATCH,
            "remat_bf16_temp_bytes": 100 * MB, "compile_s": 1.0,
            "temp_bytes": {"none-hg": none * MB, "int8-hg": int8 * MB, "int4-hg": int4 * MB,
                           "int2-hg": int2 * MB}}


@pytest.mark.parametrize("temps, falls", [((37, 35, 34), True), ((37, 38, 37), False)])
def test_fewer_bits_give_a_lower_peak_only_where_the_peaks_fall(temps, falls):
    r = _synthetic(_row("none-hg"), _row("int8-hg"), _row("int4-hg"), _row("int2-hg"),
                   memory_at_scale=_at_scale(*temps))
    out = _conclusions(r)
    (line,) = [c for c in out if c.startswith("At scale, fewer bits per saved element")]
    shown = (f"int8 act, f32 grad (hg) {temps[0] / 100:.2f}x, int4 act, f32 grad (hg) "
             f"{temps[1] / 100:.2f}x, int2 act, f32 grad (hg) {temps[2] / 100:.2f}x")
    assert shown in line
    assert line.startswith("At scale, fewer bits per saved element give a lower peak") == falls
    assert ("do not give a lower peak" in line) != falls
    report = _markdown(r)
    assert "dominate" not in report
    table = report.split("## Memory at scale (compile-only)")[1]
    assert "| bf16 jax.checkpoint scan (baseline) | 100.00 | 1.00 | — |" in table
    assert f"| int8 act, f32 grad (hg) | {temps[0]:.2f} | {temps[0] / 100:.2f} | " \
           f"{temps[0] / 53:.2f} |" in table


def test_codec_share_bands_agree_with_the_measured_rows():
    """The bands the report quotes (how much int8 took off codec none's peak, by the
    checkpoints' share F) are those of the codec-share table it cites."""
    import pathlib

    from hifigrad.demo import report as R

    root = pathlib.Path(__file__).parent.parent
    data = json.loads((root / R.CODEC_SHARE_FILE).with_suffix(".json").read_text())
    size = data["size"]
    little, matters = [], []
    for key, row in data["rows"].items():
        layers, batch = int(key.split()[0]), int(key.split()[-1])
        share = R.checkpoint_estimate(layers, batch, size["seq"], size["d"], size["heads"],
                                      n_params=layers * 12 * size["d"] ** 2)["share"]
        taken = 1 - row["cc int8"] / row["cc none"]
        assert not R.SHARE_LITTLE <= share < R.SHARE_MATTERS, key  # the report: "none there"
        (little if share < R.SHARE_LITTLE else matters).append(taken)
    assert (round(min(little), 2), round(max(little), 2)) == R.CODEC_LITTLE
    assert (round(min(matters), 2), round(max(matters), 2)) == R.CODEC_MATTERS


@pytest.mark.parametrize("layers, batch, expect", [
    (4, 8, "expect the sliced backward to be the saving and a codec's bits to add little"),
    (12, 16, "no expectation either way"),
    (48, 64, "expect the codec's bits to matter")])
def test_report_estimates_the_codecs_share_for_the_model_it_ran(layers, batch, expect):
    from hifigrad.demo.report import _mb, checkpoint_estimate, codec_share_conclusions, gpt_params

    cfg = {"n_layers": layers, "batch_size": batch, "d_model": 256, "n_heads": 4,
           "seq_len": 128}
    model = {"n_layers": layers, "d_model": 256, "n_heads": 4, "seq_len": 128}
    n = gpt_params(model)
    r = _synthetic(_row("none-hg", temp_bytes=50 * MB), _row("int8-hg", temp_bytes=45 * MB),
                   config=cfg, n_params=n)
    (line,) = codec_share_conclusions(r)
    est = checkpoint_estimate(layers, batch, 128, 256, 4, n)
    assert f"are {est['share']:.2f} of the three" in line and expect in line
    assert f"in bf16, {_mb(est['checkpoints'])} MB)" in line
    assert "over codec none's (bf16 act, f32 grad (hg)): int8 act, f32 grad (hg) 0.90x" in line


def test_gpt_params_counts_the_demo_models_parameters():
    import dataclasses

    from hifigrad.demo.model import ModelConfig, init_params, n_params
    from hifigrad.demo.report import gpt_params

    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16)
    assert gpt_params(dataclasses.asdict(cfg)) == n_params(init_params(0, cfg))


@pytest.mark.parametrize("with_seed", [True, False])
def test_seed_label_is_explained_where_it_appears(with_seed):
    rows = [_row("bf16")] + ([_row("fp8-seed")] if with_seed else [])
    report = _markdown(_synthetic(*rows))
    assert ("*(seed)*: the fp8 recipe hifigrad started from" in report) == with_seed
    assert ("not the random seed" in report) == with_seed


def test_step_times_inside_the_fastest_ones_spread_are_not_ranked():
    r = _synthetic(_row("bf16", step_ms=30.0, step_ms_quartiles=[29.0, 31.5]),
                   _row("bf16-hg", step_ms=31.0, step_ms_quartiles=[30.0, 32.0]),
                   _row("int8-hg", step_ms=40.0, step_ms_quartiles=[39.0, 41.0]))
    r["modes"][0]["step_ms"] = 35.0  # f32: outside the fastest one's spread
    (line,) = [c for c in _conclusions(r) if c.startswith("Fastest step")]
    assert line.startswith("Fastest step: bf16 jax.grad (30.0 ms; the middle half of its "
                           "steps took 29.0 to 31.5 ms)")
    assert "with bf16 hg exact (31.0 ms) inside that spread, not ranked against it" in line
    assert "f32 reference" not in line
    assert "int8 act, f32 grad (hg) (40.0 ms) inside" not in line
    assert "slowest: int8 act, f32 grad (hg) (40.0 ms)" in line


@pytest.mark.parametrize("hg, plain, verdict", [(26.0, 6.5, "higher"),
                                                (26.0, 25.5, "within the noise threshold")])
def test_length_sweep_comparisons_use_the_threshold(hg, plain, verdict):
    sweep = {"lengths": [128, 2048], "batch_size": 4,
             "sqnr_db": {"bf16": [30.0, plain], "bf16-hg": [33.0, hg]}}
    out = _conclusions(_synthetic(_row("bf16"), _row("bf16-hg"), length_sweep=sweep))
    (line,) = [c for c in out if c.startswith("At length 2048")]
    assert line.endswith(f"({hg - plain:+.1f} dB, {verdict}).")
