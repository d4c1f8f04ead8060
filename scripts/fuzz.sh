#!/usr/bin/env bash
# Builds qcoll's libFuzzer targets (fuzz/fuzz_*.cpp) with clang and runs each for a bounded time.
#
# Usage: bash scripts/fuzz.sh [seconds-per-target] [target ...]
#        bash scripts/fuzz.sh --make-seeds        # rewrite the committed seed corpus fuzz/corpus/
#
#   seconds-per-target  libFuzzer -max_total_time per target (default 30; CI runs the default:
#                       2 minutes of fuzzing in all, two targets at a time with JOBS=2;
#                       a longer run: bash scripts/fuzz.sh 3600)
#   target              header, decode, host_args, plan (default: all of fuzz/fuzz_*.cpp)
#
# Each target is built with -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all and
# started on fuzz/corpus/<target>/ (read only) plus $FUZZ_DIR/corpus/<target>/ (where new inputs
# go). Any crash, sanitizer report, timeout, out-of-memory or broken contract is a finding: the
# input is saved under $FUZZ_DIR/findings/<target>/ and the script exits 1. Replay one with
# $FUZZ_DIR/fuzz_<target> <file>.
#
# Environment: FUZZ_DIR (default <repo>/build-fuzz), FUZZ_CXX (default clang++), JOBS (parallel
# builds, default 2).
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

FUZZ_DIR="${FUZZ_DIR:-$QCOLL_ROOT/build-fuzz}"
FUZZ_CXX="${FUZZ_CXX:-clang++}"
qcoll_install_packages "${QCOLL_CHECK_PACKAGES[@]}"
mkdir -p "$FUZZ_DIR"

if [ "${1:-}" = "--make-seeds" ]; then
  c++ -std=c++17 -O1 -ffp-contract=off -Wall -Wextra -Werror -I "$QCOLL_ROOT/include" \
    "$QCOLL_ROOT/fuzz/make_seeds.cpp" -o "$FUZZ_DIR/make_seeds"
  for t in header decode host_args plan; do
    rm -rf "$QCOLL_ROOT/fuzz/corpus/$t"
    mkdir -p "$QCOLL_ROOT/fuzz/corpus/$t"
  done
  "$FUZZ_DIR/make_seeds" "$QCOLL_ROOT/fuzz/corpus"
  exit 0
fi

seconds="${1:-30}"
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: bash scripts/fuzz.sh [seconds-per-target] [target ...]" >&2
  exit 2
fi
shift || true
targets=("$@")
if ((${#targets[@]} == 0)); then
  for f in "$QCOLL_ROOT"/fuzz/fuzz_*.cpp; do
    t="$(basename "$f" .cpp)"
    targets+=("${t#fuzz_}")
  done
fi

flags=(-std=c++17 -O1 -g1 -fno-omit-frame-pointer "-fsanitize=fuzzer,address,undefined"
       -fno-sanitize-recover=all -ffp-contract=off -fno-trapping-math -Wall -Wextra -Werror
       -I "$QCOLL_ROOT/include" -I "$QCOLL_ROOT/fuzz")
start=$SECONDS
building=0  # compiles running; a new one starts as soon as any ends (wait -n)
for t in "${targets[@]}"; do
  src="$QCOLL_ROOT/fuzz/fuzz_$t.cpp"
  [ -f "$src" ] || { echo "fuzz: no target $t ($src)" >&2; exit 2; }
  # Rebuild only when a source or header changed.
  if [ ! -x "$FUZZ_DIR/fuzz_$t" ] || [ -n "$(find "$QCOLL_ROOT/include" "$QCOLL_ROOT/fuzz" -newer "$FUZZ_DIR/fuzz_$t" \
       \( -name '*.hpp' -o -name '*.cpp' \) -print -quit)" ]; then
    echo "fuzz: building fuzz_$t"
    "$FUZZ_CXX" "${flags[@]}" "$src" -o "$FUZZ_DIR/fuzz_$t" &
    building=$((building + 1))
    if ((building >= JOBS)); then
      wait -n  # a failed compile ends the script (set -e)
      building=$((building - 1))
    fi
  fi
done
while ((building > 0)); do
  wait -n
  building=$((building - 1))
done
echo "fuzz: built in $((SECONDS - start)) s"

export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# Runs one target for $seconds; prints its statistics, or its log's tail on a finding (exit 1).
run_target() {
  local t="$1" seeds="$QCOLL_ROOT/fuzz/corpus/$1" work="$FUZZ_DIR/corpus/$1" findings="$FUZZ_DIR/findings/$1"
  local log="$FUZZ_DIR/fuzz_$1.log"
  mkdir -p "$work" "$findings" "$seeds"
  echo "fuzz: running fuzz_$t for $seconds s (log: $log)"
  if "$FUZZ_DIR/fuzz_$t" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=2048 -print_final_stats=1 \
       -artifact_prefix="$findings/" "$work" "$seeds" >"$log" 2>&1; then
    echo "fuzz: fuzz_$t: $(grep -E '^stat::number_of_executed_units|^stat::new_units_added' "$log" | tr '\n' ' ')"
  else
    echo "fuzz: fuzz_$t FOUND A PROBLEM; last lines of $log:" >&2
    tail -n 40 "$log" >&2
    ls -l "$findings" >&2
    return 1
  fi
}

# Up to $JOBS targets at once (each fuzzer uses one core).
failed=()
running=()
names=()
for t in "${targets[@]}"; do
  run_target "$t" &
  running+=($!)
  names+=("$t")
  if ((${#running[@]} >= JOBS)); then
    wait "${running[0]}" || failed+=("${names[0]}")
    running=("${running[@]:1}")
    names=("${names[@]:1}")
  fi
done
for i in "${!running[@]}"; do
  wait "${running[$i]}" || failed+=("${names[$i]}")
done
echo "fuzz: total $((SECONDS - start)) s"
if ((${#failed[@]} > 0)); then
  echo "fuzz: findings in: ${failed[*]} (inputs under $FUZZ_DIR/findings/)" >&2
  exit 1
fi
