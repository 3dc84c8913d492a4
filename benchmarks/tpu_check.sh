#!/usr/bin/env bash
# `make tpu-check`: the test suite on one TPU chip (the lent TPU v5e machine: python3 with
# jax 0.10.2 and libtpu, no network; hifigrad run from this source tree), in chunks that each fit
# one device call of at most 10 minutes.
#
#   make tpu-check TPU_CHUNK=1/4 OUT=$OUT      # the first quarter of the suite's tests
#   make tpu-check TPU_CHUNK=2/4 OUT=$OUT ...  # the next call, and so on (a third of the
#                                               # suite took 520 s on a TPU v5e: use n >= 4)
#
# TPU_CHUNK=i/n keeps the i-th of n contiguous slices of the selected tests (tests/conftest.py,
# HIFIGRAD_TEST_CHUNK): every test is in exactly one chunk. The suite runs in ONE process (one
# program at a time can hold the chip; no pytest -n); the suite's own subprocesses run on the CPU
# (tests/conftest.py). tests/test_distributed.py is left out: its workers talk over TCP, and that
# machine opens no socket.
#
# Writes into $OUT (default tpu-out; at most 8 files come back from the device tool):
#   junit-<i>of<n>.xml   per-test outcomes (written even when the time limit cuts the run)
#   pytest-<i>of<n>.log  the suite's output
#   summary-<i>of<n>.md  counts, failures, the slowest tests, the phases' times
#   run.log              the plan and each phase's time (and the benchmark's output, BENCH=1)
#
# Environment: SUITE_S (whole-suite limit, default 480 s: SIGINT, so pytest still writes the
# junit file), TEST_TIMEOUT_S (per test, default 150, needs pytest-timeout), TESTS (default
# tests), PYTEST_EXTRA (more pytest arguments, split on spaces), PYTEST_K (a -k expression, kept
# whole: PYTEST_K="not eager" runs each case jitted only), DEPS=0 (install nothing),
# BENCH=1 (after the suite: python3 benchmarks/tpu_bench.py $BENCH_ARGS into $OUT).
# Optional packages (flax, optax, pytest-timeout, and the demo's rich and matplotlib; the tests
# that need others skip) install from
# the machine's own index (file:///opt/pypi/simple) into $SITE, appended to PYTHONPATH so that
# the machine's JAX stays first.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-tpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
CHUNK=${TPU_CHUNK:-1/1}
TAG=$(echo "$CHUNK" | tr '/' 'o' | sed 's/o/of/')
SUITE_S=${SUITE_S:-480}
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-150}
TESTS=${TESTS:-tests}
KILL_AFTER_S=${KILL_AFTER_S:-15}
SITE=${SITE:-/tmp/hifigrad-tpu-site}
INDEX=${INDEX:-file:///opt/pypi/simple}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

LOG="$OUT/run.log"
touch "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
PHASES=()

say "== tpu-check chunk $CHUNK $(date -u '+%Y-%m-%d %H:%M UTC') in $ROOT, output $OUT"

# ------------------------------------------------------------------ 0. optional packages
t=$(now)
if [ "${DEPS:-1}" = 1 ] && [ -d "${INDEX#file://}" ]; then
  want=()
  $PY -c 'import flax' 2> /dev/null || want+=(flax)
  $PY -c 'import optax' 2> /dev/null || want+=(optax)
  $PY -c 'import pytest_timeout' 2> /dev/null || want+=(pytest-timeout)
  $PY -c 'import rich' 2> /dev/null || want+=(rich)
  $PY -c 'import matplotlib' 2> /dev/null || want+=(matplotlib)
  if [ ${#want[@]} -gt 0 ]; then
    say "installing ${want[*]} from $INDEX into $SITE"
    PIP_CONFIG_FILE=/dev/null $PY -m pip install --isolated -q --only-binary=:all: \
      --index-url "$INDEX" --target "$SITE" "${want[@]}" >> "$LOG" 2>&1 || say "   (pip failed)"
  fi
fi
[ -d "$SITE" ] && export PYTHONPATH="$PYTHONPATH:$SITE"
PHASES+=("deps $(( $(now) - t )) s")
say "python: $($PY -c 'import sys, jax; print(sys.version.split()[0], "jax", jax.__version__, jax.__file__, jax.default_backend(), jax.devices()[0].device_kind)' 2>&1 | tail -1)"
TIMEOUT_ARG=()
if $PY -c 'import pytest_timeout' 2> /dev/null; then
  TIMEOUT_ARG=(--timeout="$TEST_TIMEOUT_S")
fi

# ------------------------------------------------------------------ 1. the suite (one chunk)
t=$(now)
say "== [$(now) s] suite chunk $CHUNK: pytest ${TIMEOUT_ARG[*]} $TESTS ${PYTEST_EXTRA:-}, <= $SUITE_S s"
# shellcheck disable=SC2086
HIFIGRAD_TEST_CHUNK=$CHUNK timeout -s INT -k "$KILL_AFTER_S" "$SUITE_S" \
  $PY -m pytest -p no:cacheprovider -rfE --durations=15 "${TIMEOUT_ARG[@]}" \
  --junitxml="$OUT/junit-$TAG.xml" --ignore=tests/test_distributed.py $TESTS ${PYTEST_EXTRA:-} \
  ${PYTEST_K:+-k "$PYTEST_K"} \
  > "$OUT/pytest-$TAG.log" 2>&1
rc=$?
PHASES+=("suite $CHUNK rc=$rc $(( $(now) - t )) s")
case $rc in
  124) why="cut by the time limit (SIGINT); " ;;
  137) why="cut by the time limit, killed $KILL_AFTER_S s after SIGINT; " ;;
  *) why="" ;;
esac
say "   suite: rc=$rc (${why}$(tail -1 "$OUT/pytest-$TAG.log" | cut -c1-200)) in $(( $(now) - t )) s"

# ------------------------------------------------------------------ 2. the benchmark (BENCH=1)
if [ "${BENCH:-0}" = 1 ]; then
  t=$(now)
  say "== [$(now) s] benchmarks/tpu_bench.py ${BENCH_ARGS:-}"
  # shellcheck disable=SC2086
  timeout -s INT -k "$KILL_AFTER_S" "${BENCH_S:-300}" $PY benchmarks/tpu_bench.py \
    --out-dir "$OUT" ${BENCH_ARGS:-} 2>&1 | tee -a "$LOG"
  PHASES+=("bench rc=${PIPESTATUS[0]} $(( $(now) - t )) s")
fi

# ------------------------------------------------------------------ 3. the summary
$PY - "$OUT/junit-$TAG.xml" "$OUT/pytest-$TAG.log" "$CHUNK" "${PHASES[@]}" \
  > "$OUT/summary-$TAG.md" 2>&1 << 'EOF'
import re, sys
sys.path.insert(0, "benchmarks")
from gpu_check_summary import junit_summary
junit, log, chunk, phases = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
print(f"# tpu-check chunk {chunk}\n")
lines, _ = junit_summary(junit)
print("\n".join(lines))
print("\n## Phases\n")
print("\n".join(f"- {p}" for p in phases))
text = open(log, errors="replace").read()
m = re.search(r"=+ slowest \d+ durations =+\n(.*?)\n\n", text, re.S)
if m:
    print("\n## Slowest tests\n\n```\n" + m.group(1) + "\n```")
EOF
cat "$OUT/summary-$TAG.md" | tee -a "$LOG"
say "== tpu-check chunk $CHUNK done in $(now) s"
