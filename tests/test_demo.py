"""The `hifigrad demo` command: one quick run shared by the tests, and the flag errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest
from platforms import on_cpu

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
