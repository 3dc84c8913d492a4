#!/usr/bin/env bash
# `make gpu-check`: the whole GPU check in one command, for the lent GPU machine (one H200,
# python3 with jax 0.11.2 + CUDA plugin; hifigrad run from this source tree; no network).
#
# Writes at most 8 files into $OUT (default gpu-out), which is what the device tool brings back:
#   junit.xml      per-test outcomes of the suite (written even when the time limit cuts it)
#   pytest.log     the suite's output
#   run.log        the plan, each phase's time, the demo's and the benchmark's output
#   gpt_<tag>.md/.json, mlp_<tag>.md/.json   benchmarks/gpu_bench.py's tables (tag: gpu on a GPU)
#   summary.md     pass/fail counts from junit, demo modes, benchmark rows, phase times
#
# Phases, each with its own time limit (seconds; override by environment), so that the whole run
# stays under 8 minutes on an H200:
#   1. the default test suite except tests/test_distributed.py, pytest -n $WORKERS, a per-test
#      --timeout and a whole-run limit sent as SIGINT (pytest then still writes junit.xml);
#   2. python3 -m hifigrad demo --quick (its folder goes to a temporary directory; log only);
#   3. python3 benchmarks/gpu_bench.py --budget-s $BENCH_BUDGET_S (the tables are rewritten after
#      every row, so a cut run keeps what it measured);
#   4. the summary.
# GPU_CHECK_SMALL=1: a CPU dry run of the same script (a few test files, 2 workers, the demo
# --quick, gpu_bench.py --small with a small budget).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
SMALL=${GPU_CHECK_SMALL:-0}

if [ "$SMALL" = 1 ]; then
  WORKERS=${WORKERS:-2}
  SUITE_S=${SUITE_S:-150}
  TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-120}
  TESTS=${TESTS:-tests/test_policy.py tests/test_codecs.py tests/test_gpu_bench.py}
  DEMO_S=${DEMO_S:-240}
  BENCH_BUDGET_S=${BENCH_BUDGET_S:-90}
  BENCH_S=${BENCH_S:-200}
  BENCH_ARGS=${BENCH_ARGS:---small --steps 2 --blocks 1 --mlp-blocks 2}
else
  WORKERS=${WORKERS:-14}
  SUITE_S=${SUITE_S:-230}
  TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-150}
  TESTS=${TESTS:-tests}
  DEMO_S=${DEMO_S:-70}
  BENCH_BUDGET_S=${BENCH_BUDGET_S:-115}
  BENCH_S=${BENCH_S:-150}
  BENCH_ARGS=${BENCH_ARGS:---compile-threads 8}
fi
KILL_AFTER_S=${KILL_AFTER_S:-15}

LOG="$OUT/run.log"
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
PHASES=()

say "== gpu-check $(date -u '+%Y-%m-%d %H:%M UTC') in $ROOT, output $OUT"
say "python: $($PY -c 'import sys, jax; print(sys.version.split()[0], "jax", jax.__version__, jax.default_backend(), jax.devices()[0].device_kind)' 2>&1 | tail -1)"
if command -v nvidia-smi > /dev/null; then
  say "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
fi
say "plan (limits in s; worst case $(( SUITE_S + KILL_AFTER_S + DEMO_S + BENCH_S + KILL_AFTER_S )) s):"
say "  1. pytest -n $WORKERS --timeout=$TEST_TIMEOUT_S on: $TESTS (not tests/test_distributed.py); whole run <= $SUITE_S (SIGINT, then kill after $KILL_AFTER_S)"
say "  2. $PY -m hifigrad demo --quick, <= $DEMO_S"
say "  3. $PY benchmarks/gpu_bench.py $BENCH_ARGS --budget-s $BENCH_BUDGET_S, <= $BENCH_S"
say "  4. summary -> $OUT/summary.md"

# ------------------------------------------------------------------ 1. the test suite
t=$(now)
say ""
say "== [$(now) s] phase 1: test suite"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT -k "$KILL_AFTER_S" "$SUITE_S" \
  $PY -m pytest -n "$WORKERS" -p no:cacheprovider -p no:benchmark -rfE \
  --junitxml="$OUT/junit.xml" --timeout="$TEST_TIMEOUT_S" \
  --ignore=tests/test_distributed.py $TESTS > "$OUT/pytest.log" 2>&1
rc=$?
PHASES+=("suite rc=$rc $(( $(now) - t )) s")
case $rc in
  124) why="cut by the time limit (SIGINT); " ;;
  137) why="cut by the time limit, killed $KILL_AFTER_S s after SIGINT; " ;;
  *) why="" ;;
esac
say "   suite: rc=$rc (${why}$(tail -1 "$OUT/pytest.log" | cut -c1-200)) in $(( $(now) - t )) s"

# ------------------------------------------------------------------ 2. the demo
t=$(now)
say ""
say "== [$(now) s] phase 2: hifigrad demo --quick"
DEMO_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-demo.XXXXXX")
timeout -s INT -k "$KILL_AFTER_S" "$DEMO_S" $PY -m hifigrad demo --quick --out "$DEMO_DIR" \
  >> "$LOG" 2>&1
rc=$?
PHASES+=("demo rc=$rc $(( $(now) - t )) s")
say "   demo: rc=$rc in $(( $(now) - t )) s"

# ------------------------------------------------------------------ 3. the benchmark
t=$(now)
say ""
say "== [$(now) s] phase 3: benchmarks/gpu_bench.py"
# shellcheck disable=SC2086
timeout -s INT -k "$KILL_AFTER_S" "$BENCH_S" $PY benchmarks/gpu_bench.py $BENCH_ARGS \
  --budget-s "$BENCH_BUDGET_S" --out-dir "$OUT" >> "$LOG" 2>&1
rc=$?
PHASES+=("bench rc=$rc $(( $(now) - t )) s")
say "   bench: rc=$rc in $(( $(now) - t )) s"

# ------------------------------------------------------------------ 4. the summary
say ""
say "== [$(now) s] phase 4: summary"
$PY benchmarks/gpu_check_summary.py --out "$OUT" --demo "$DEMO_DIR" --total-s "$(now)" \
  --phases "${PHASES[@]}" 2>&1 | tee -a "$LOG"
rm -rf "$DEMO_DIR"
say "== gpu-check done in $(now) s; files in $OUT:"
ls -la "$OUT" | tee -a "$LOG"
