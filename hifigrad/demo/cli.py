"""Command line of ``hifigrad demo``: parses flags, shows progress, prints the table, writes the
report. Flag errors print one line to stderr and return exit status 2.

``hifigrad --help`` and ``hifigrad demo --help`` need only hifigrad's own dependencies (jax,
numpy); running the demo needs the ``demo`` extra. Without it, ``hifigrad demo`` prints one line
naming how to install it and returns exit status 1."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]

PROG = "hifigrad"
# The demo's tasks (`hifigrad.demo.train.TASKS`, repeated here so that ``--help`` does not import
# the training code and its optax dependency; a test checks that the two agree).
TASKS = ("gpt", "recurrent")
# What the demo imports beyond hifigrad's own dependencies: the ``demo`` extra of pyproject.toml.
DEMO_EXTRA = ("flax", "optax", "rich", "matplotlib")
# (hifigrad is not on PyPI yet: the extra installs from a clone, or its packages by name.)
INSTALL_DEMO = "pip install -e '.[demo]' in a clone of hifigrad, or pip install " + " ".join(
    DEMO_EXTRA)
# The defaults of the flags whose value depends on --task and --quick, as ``demo --help`` shows
# them (the configurations of `hifigrad.demo.train`, repeated so that ``--help`` needs no optax;
# a test checks that the two agree): (task, quick) -> (steps, layers).
CONFIG_DEFAULTS = {("gpt", False): (200, 4), ("gpt", True): (30, 2),
                   ("recurrent", False): (100, 2), ("recurrent", True): (20, 2)}


class UsageError(Exception):
    """A bad command line: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage and exit
        raise UsageError(message)


def _int_at_least(minimum: int, expected: str, too_small: str):
    """An argparse type: an int of at least `minimum`, with one-line messages."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{too_small}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer", "must be at least 1")
_seed = _int_at_least(0, "an integer", "must be non-negative")


def _lengths(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated positive sequence lengths."""
    parse = _int_at_least(1, "comma-separated positive integers", "lengths must be at least 1")
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("no length given")
    return tuple(dict.fromkeys(parse(t) for t in items))


def _by_config(i: int) -> str:
    """``(default: ...)`` of a flag whose default depends on --task and --quick."""
    d = {k: v[i] for k, v in CONFIG_DEFAULTS.items()}
    return (f"(default: {d['gpt', False]}; with --quick {d['gpt', True]}; with --task "
            f"recurrent {d['recurrent', False]}, and --quick {d['recurrent', True]})")


def _version() -> str:
    import platform

    import jax

    import hifigrad

    return (f"{PROG} {hifigrad.__version__} (jax {jax.__version__}, Python "
            f"{platform.python_version()})")


def _parser() -> argparse.ArgumentParser:
    from .modes import MODES

    p = _Parser(prog=PROG, description="High-fidelity (float32) gradients for JAX models "
                                       "computed in bf16, fp16 or fp8.")
    p.add_argument("--version", action="version", version=_version(),
                   help="print hifigrad's version (and JAX's) and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    d = sub.add_parser(
        "demo", help="train a byte-level LM in every precision mode and compare them",
        description="Trains a byte-level language model on the Python standard library's "
                    "source once per precision mode (same init, same batches) and reports "
                    "gradient fidelity vs float32, loss curves, memory and speed. Tasks: 'gpt' "
                    "(default), a scanned GPT-style decoder, every mode; 'recurrent', an "
                    "LRU-style linear recurrence over a 1024-byte context, the precision modes "
                    "(f32, bf16, fp16), plus the gradient SQNR against the sequence length. "
                    "It writes report.md (tables and conclusions), results.json (every "
                    "measurement) and PNG plots (loss curves, gradient SQNR, memory) to --out. "
                    "How long: the default gpt run took 114 s on 2 idle CPU cores and 283 s on "
                    "2 cores shared at a load average of 10; --quick took 2 min 38 s to 4 min "
                    "49 s on 2 cores shared at load averages of 7 to 10 (about 80 s of CPU "
                    "time). "
                    f"Needs the demo extra: {INSTALL_DEMO}.",
        epilog="modes: " + "; ".join(f"{m.name} ({m.label})" for m in MODES))
    d.add_argument("--task", choices=TASKS, default="gpt",
                   help="the model to train (default: gpt)")
    d.add_argument("--steps", type=_positive_int,
                   help=f"training steps per mode {_by_config(0)}")
    d.add_argument("--modes", default=None,
                   help="comma-separated modes to run, or 'all' (default: all for gpt, the "
                        "precision modes for recurrent), see below")
    d.add_argument("--layers", type=_positive_int,
                   help=f"number of blocks {_by_config(1)}")
    d.add_argument("--lengths", type=_lengths,
                   help="recurrent task: comma-separated sequence lengths of the gradient-SQNR "
                        "sweep, besides the training length (default: 128,512,2048; with "
                        "--quick 1024)")
    d.add_argument("--seed", type=_seed, default=0,
                   help="seed of the init and the batches (default: 0)")
    d.add_argument("--out", default="demo-out",
                   help="output directory for report.md, results.json and the plots (default: "
                        "./demo-out)")
    d.add_argument("--quick", action="store_true",
                   help="tiny configuration (2 blocks, d_model 32, 30 steps; the recurrent "
                        "task: context 256, 20 steps), see above for its time (default: off)")
    d.add_argument("--devices", type=_positive_int, default=1,
                   help="data-parallel over this many devices (on CPU, simulated devices; "
                        "default: 1)")
    return p


def _parse_modes(text: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    from .modes import MODE_NAMES

    if text is None:
        return default
    if text.strip() == "all":
        return MODE_NAMES
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise UsageError("--modes: no mode given")
    bad = [n for n in names if n not in MODE_NAMES]
    if bad:
        raise UsageError(f"--modes: unknown mode {bad[0]!r} (valid: {', '.join(MODE_NAMES)})")
    return tuple(dict.fromkeys(names))


def missing_demo_packages() -> list[str]:
    """The packages of the ``demo`` extra that cannot be imported here."""
    import importlib

    missing = []
    for name in DEMO_EXTRA:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def _check_out(out: str) -> Path:
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".hifigrad-write-test-"):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise UsageError(f"--out: cannot write to {out!r}: {reason}") from None
    return path


def _config(args):
    from .train import QUICK, RECURRENT, RECURRENT_QUICK, DemoConfig

    if args.task == "recurrent":
        base = RECURRENT_QUICK if args.quick else RECURRENT
    else:
        base = QUICK if args.quick else DemoConfig()
    changes = {"modes": _parse_modes(args.modes, base.modes), "seed": args.seed,
               "devices": args.devices}
    if args.lengths is not None:
        if args.task != "recurrent":
            raise UsageError("--lengths: only the recurrent task has a length sweep "
                             "(add --task recurrent)")
        changes["sweep_lengths"] = args.lengths
    if args.steps is not None:
        changes["steps"] = args.steps
    if args.layers is not None:
        changes["n_layers"] = args.layers
    try:
        return dataclasses.replace(base, **changes)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _prepare_devices(n: int) -> None:
    """Asks XLA for ``n`` simulated CPU devices (used only where JAX has no accelerators).

    Only called when `main` runs as the process's command line, before any computation, so
    that no backend has started yet and no other code in the process sees the change.
    """
    if n <= 1:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hifigrad`` command; returns the exit status."""
    own_process = argv is None  # the command line, rather than a call from Python code
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help, --version: printed, then argparse exits
            return e.code if isinstance(e.code, int) else 0
        if args.command is None:
            parser.print_help(sys.stderr)
            print(f"\n{PROG}: error: a command is needed, e.g. `{PROG} demo` (or "
                  f"`{PROG} demo --help`)", file=sys.stderr)
            return 2
        missing = missing_demo_packages()
        if missing:
            print(f"{PROG} demo: error: the demo needs {', '.join(missing)}, not installed here; "
                  f"install the demo extra: {INSTALL_DEMO}", file=sys.stderr)
            return 1
        config = _config(args)
        if own_process:
            _prepare_devices(config.devices)
        import jax

        if jax.device_count() < config.devices:
            raise UsageError(
                f"--devices {config.devices}: JAX sees only {jax.device_count()} device(s) on "
                f"{jax.default_backend()} (on CPU, run `hifigrad demo` as a command, or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={config.devices})")
        out = _check_out(args.out)
    except UsageError as e:
        prog = f"{PROG} demo" if argv[:1] == ["demo"] else PROG
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return _run_demo(config, out, argv)


def _run_demo(config, out: Path, argv: list[str]) -> int:
    from rich.console import Console
    from rich.markup import escape

    from . import report as R
    from .train import describe_platform, run

    console = Console()
    if not console.is_terminal:  # a pipe or a log file: room for the whole table
        console = Console(width=max(console.width, 150))
    console.print(f"[bold]hifigrad demo[/] ({config.task}): {len(config.modes)} modes x "
                  f"{config.steps} steps, {config.n_layers} blocks, context {config.seq_len}; "
                  f"{describe_platform()}")
    with _reporter(console) as reporter:
        results = run(config, reporter)
    command = "hifigrad " + " ".join(shlex.quote(a) for a in argv)
    paths = R.write_report(results, out, command=command)
    for table in _rich_tables(results, console.width):
        console.print(table)
    if any(r["name"] == "fp8-seed" for r in results["modes"]):
        console.print(R.SEED_NOTE.replace("*", ""), highlight=False)
    console.print(_rich_memory_table(results), highlight=False)
    for c in results["conclusions"]:  # markdown bold -> rich bold
        console.print(" • " + re.sub(r"\*\*(.+?)\*\*", r"[bold]\1[/bold]", escape(c)),
                      highlight=False)
    console.print(f"Wrote {', '.join(p.name for p in paths)} to {out}/ "
                  f"(run took {results['wall_s']:.0f} s)")
    failed = [r["name"] for r in results["modes"] if r["status"] == "failed"]
    if failed:
        print(f"{PROG} demo: error: mode(s) failed: {', '.join(failed)} (see {out}/report.md)",
              file=sys.stderr)
        return 1
    return 0


def _rich_tables(results, width: int) -> list:
    """The results table for a terminal ``width`` columns wide: one table when it fits, else two
    (fidelity and loss; memory and speed), each with the mode column. No cell ever wraps: a
    wrapped mode label would read as a row of its own."""
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table

    from .report import TABLE_COLUMNS, table_rows

    rows = table_rows(results)
    title = "Gradient fidelity, loss, memory and speed per mode"

    def table(cols, title):
        t = Table(title=title, title_justify="left")
        for i in cols:
            t.add_column(TABLE_COLUMNS[i], justify="left" if i == 0 else "right", no_wrap=True)
        for row in rows:
            t.add_row(*(row[i] for i in cols))
        return t

    every = list(range(len(TABLE_COLUMNS)))
    whole = table(every, title)
    probe = Console(width=10_000)
    if Measurement.get(probe, probe.options, whole).maximum <= width:
        return [whole]
    split = TABLE_COLUMNS.index("saved MB")
    return [table(every[:split], "Gradient fidelity and loss per mode"),
            table([0, *every[split:]], "Memory and speed per mode")]


def _rich_memory_table(results):
    """The report's memory table at this run's size, its first row the baseline."""
    from rich.table import Table

    from .report import memory_table

    header, rows = memory_table(results)
    t = Table(title="Memory against the bf16 remat scan (the first row: the baseline, compiled, "
                    "not trained)", title_justify="left")
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        t.add_row(*row)
    return t


def _reporter(console):
    """Progress for ``console``: live bars on a terminal; on a pipe or in a log file (where
    a live display shows nothing until the end), one flushed line per event instead."""
    if console.is_terminal:
        return _RichReporter(console)
    return _LineReporter(console.file)


class _LineReporter:
    """Progress as plain lines, each flushed as it is written: a setup stage, a mode's
    compile, its training every `CHUNKS`-th of its steps (with the time since its start), its
    end. For output that is not a terminal (``hifigrad demo > log``, CI)."""

    CHUNKS = 4

    def __init__(self, stream):
        self.stream = stream
        self.t0: dict[str, float] = {}
        self.steps: dict[str, int] = {}
        self.clock = time.perf_counter()  # the last event: where the next mode's training starts

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def stage(self, text):
        self.clock = time.perf_counter()
        self._line(f"[{PROG} demo] {text}")

    def mode_start(self, mode, steps):
        self.steps[mode.name] = steps

    def mode_compiled(self, mode, seconds):
        self.clock = time.perf_counter()
        self._line(f"[{PROG} demo] {mode.label}: compiled in {seconds:.1f} s")

    def mode_step(self, mode, step):
        if step == 0:
            self.t0[mode.name] = self.clock
        n = self.steps[mode.name]
        every = max(1, -(-n // self.CHUNKS))
        if (step + 1) % every == 0 or step + 1 == n:
            elapsed = time.perf_counter() - self.t0[mode.name]
            self._line(f"[{PROG} demo] {mode.label}: step {step + 1}/{n} ({elapsed:.1f} s)")

    def mode_end(self, mode, row):
        self.clock = time.perf_counter()
        if row["status"] == "ok":
            self._line(f"[{PROG} demo] {mode.label}: done, {row['step_ms']:.1f} ms/step")
        else:
            self._line(f"[{PROG} demo] {mode.label}: {row['status']} ({row['reason']})")


def _own_time_column():
    """A progress column showing each row's own time: a stage's duration, a mode's training
    time (from its first step to its last; its compile time is in its description)."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class OwnTime(ProgressColumn):
        def render(self, task):
            t0, t1 = task.fields.get("t0"), task.fields.get("t1")
            if t0 is None:
                return Text("")
            return Text(f"{(t1 if t1 is not None else time.perf_counter()) - t0:6.1f} s",
                        style="progress.elapsed")

    return OwnTime()


class _RichReporter:
    """Shows setup stages as spinners and each mode as a progress bar. The modes compile
    together, then train one after the other; each bar's time is that mode's own training
    time."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), _own_time_column(), console=console,
                                 transient=False)
        self.stage_task = None
        self.tasks: dict[str, int] = {}
        self.clock = time.perf_counter()  # the last event: where the next mode's training starts

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self._end_stage()
        return self.progress.__exit__(*exc)

    def _tick(self) -> float:
        self.clock = time.perf_counter()
        return self.clock

    def _end_stage(self):
        if self.stage_task is not None:
            self.progress.update(self.stage_task, total=1, completed=1, t1=self._tick())
            self.stage_task = None

    def stage(self, text):
        self._end_stage()
        self.stage_task = self.progress.add_task(text, total=None, t0=self._tick())

    def mode_start(self, mode, steps):
        self._end_stage()
        self.tasks[mode.name] = self.progress.add_task(f"{mode.label}: compiling", total=steps)

    def mode_compiled(self, mode, seconds):
        self._tick()
        self.progress.update(self.tasks[mode.name],
                             description=f"{mode.label}: compiled in {seconds:.1f} s")

    def mode_step(self, mode, step):
        task = self.tasks[mode.name]
        if step == 0:  # its training began at the previous event, which for the first mode
            t0 = self.clock  # also ends the compiling stage
            if self.stage_task is not None:
                self.progress.update(self.stage_task, total=1, completed=1, t1=t0)
                self.stage_task = None
            self.progress.update(task, description=f"{mode.label}: training", t0=t0)
        self.progress.advance(task)

    def mode_end(self, mode, row):
        task = self.tasks[mode.name]
        now = self._tick()
        if row["status"] == "ok":
            self.progress.update(task, description=f"{mode.label}: done, "
                                                   f"{row['step_ms']:.1f} ms/step", t1=now)
        else:
            reason = row["reason"] if len(row["reason"]) < 70 else row["reason"][:67] + "..."
            self.progress.update(task, description=f"{mode.label}: {row['status']} ({reason})",
                                 total=1, completed=1, t1=now)
