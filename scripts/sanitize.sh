#!/usr/bin/env bash
# Runs qcoll's host tests under sanitizers (no GPU, no CUDA):
#   build-asan/  AddressSanitizer + UndefinedBehaviorSanitizer (-fno-sanitize-recover=all): every
#                unit test (label `unit`) but unit.test_host_kernels, and every MPI test (label
#                `mpi`, when MPI is found). The host kernels run under ASan + UBSan in the fuzz
#                targets instead (scripts/fuzz.sh: fuzz_host_args and fuzz_decode call quantize,
#                dequantize and dequantize-accumulate on buffers of exactly the sizes passed, the
#                AVX2 kernels included), which find out-of-bounds accesses better than fixed
#                cases; compiling test_host_kernels' thousand kernel instantiations with ASan
#                took more than a third of the sanitizer run. The tree is built with
#                QCOLL_HOST_AVX2_DISPATCH=0 (the portable loops; the AVX2 kernels are the fuzz
#                targets' to check), which takes a fifth off every compile that quantizes.
#                Compiled by clang (ASAN_CXX, default clang++, the fuzz targets' compiler): the
#                tree built in 123 s of wall time against 245 s with GCC, its tests ran in
#                134 s against 117 s (one run of each, two jobs);
#   build-tsan/  ThreadSanitizer: the in-process transport and collective unit tests
#                (unit.test_transport_local, unit.test_collectives, unit.test_overlap), whose
#                ranks are threads. Compiled by GCC (CXX): clang's tree built no faster and its
#                tests ran 35 s against 14 s.
# Open MPI's own allocations outlive MPI_Finalize and LeakSanitizer reports them as leaks, so the
# MPI tests run with ASAN_OPTIONS=detect_leaks=0 (leaks are still checked in the unit tests).
# Open MPI is not run under TSan.
#
# Usage: bash scripts/sanitize.sh [asan|tsan ...]   (default: asan tsan)
# Environment: JOBS (parallel build jobs, default 2), ASAN_DIR / TSAN_DIR (build directories),
# ASAN_CXX (the ASan tree's C++ compiler, default clang++; the TSan tree uses CXX or c++).
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

qcoll_install_packages "${QCOLL_CHECK_PACKAGES[@]}"

ASAN_DIR="${ASAN_DIR:-$QCOLL_ROOT/build-asan}"
TSAN_DIR="${TSAN_DIR:-$QCOLL_ROOT/build-tsan}"
modes=("$@")
((${#modes[@]} > 0)) || modes=(asan tsan)

# Host-only test build; warnings are errors in the main build (scripts/test.sh), not here, where
# sanitizer instrumentation makes GCC's flow-based warnings report false positives.
common_args=(-DQCOLL_ENABLE_CUDA=OFF -DQCOLL_BUILD_BENCH=OFF -DQCOLL_BUILD_EXAMPLES=OFF -DQCOLL_BUILD_EMU_TESTS=OFF
             -DQCOLL_BUILD_HEADER_TESTS=OFF -DQCOLL_WERROR=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo)

# The ASan tree is compiled at -O0 (measured with GCC): its 21 translation units took 1255 CPU-s
# at -O1 and 512 as built here (unit_test_format alone 315 s -> 54 s), the largest share of the
# sanitizer run. Instrumented code at -O0 checks at least as much (nothing is optimized away).
# The tests that spend their time in exhaustive arithmetic loops instead of in compiling ran 3-5x
# slower at -O0 (unit.test_demo 51 s -> 155 s, unit.test_half 20 s -> 106 s), so they stay at
# -O1 (QCOLL_TESTS_AT_O1).
asan_opt_args=("-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O0 -g1"
               "-DQCOLL_TESTS_AT_O1=test_demo;test_half;test_minifloat;test_host_identity")
tsan_opt_args=("-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1")

timed() {
  local label="$1" start=$SECONDS
  shift
  "$@"
  echo "sanitize: $label took $((SECONDS - start)) s"
}

# Builds the given targets of a build tree, $JOBS compiles at once. Ninja schedules them all in one
# call; make runs the targets named on one command line one after another (each is a single
# translation unit), so under make they are started $JOBS at a time.
build_targets() {
  local dir="$1" target pids=()
  shift
  if [ -f "$dir/build.ninja" ]; then
    cmake --build "$dir" -j "$JOBS" --target "$@"
    return
  fi
  cmake --build "$dir" --target qcoll_doctest_main
  for target in "$@"; do
    cmake --build "$dir" --target "$target" &
    pids+=($!)
    if ((${#pids[@]} >= JOBS)); then
      wait "${pids[0]}"
      pids=("${pids[@]:1}")
    fi
  done
  for target in "${pids[@]}"; do wait "$target"; done
}

# Configures build tree $1 (Ninja when new and installed) with the common arguments and the rest.
configure() {
  local dir="$1" args=()
  shift
  qcoll_generator_args "$dir" args
  cmake -S "$QCOLL_ROOT" -B "$dir" "${args[@]}" "${common_args[@]}" "$@" >/dev/null
}

run_asan() {
  local flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
  flags+=" -DQCOLL_HOST_AVX2_DISPATCH=0"  # portable host loops (see the top of this file)
  timed "asan configure" configure "$ASAN_DIR" "${asan_opt_args[@]}" "-DCMAKE_CXX_COMPILER=${ASAN_CXX:-clang++}" \
    "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined"
  # Without benchmarks, examples and header tests, `all` is the unit and MPI test executables;
  # all of them but unit_test_host_kernels (see the top of this file).
  local targets
  targets=$(cmake --build "$ASAN_DIR" --target help | grep -oE '(unit_test|mpi)_[a-z0-9_]+' |
    grep -vx unit_test_host_kernels | sort -u)
  # shellcheck disable=SC2086 # one word per target
  timed "asan build" build_targets "$ASAN_DIR" $targets
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
  ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1" \
    timed "asan unit tests" ctest --test-dir "$ASAN_DIR" --output-on-failure -L unit -j "$CTEST_JOBS" \
    -E '^unit\.test_host_kernels$'
  if grep -q '^QCOLL_ENABLE_MPI:BOOL=ON$' "$ASAN_DIR/CMakeCache.txt"; then
    ASAN_OPTIONS="detect_leaks=0:abort_on_error=1" \
      timed "asan mpi tests" ctest --test-dir "$ASAN_DIR" --output-on-failure -L mpi -j "$CTEST_JOBS"
  else
    echo "sanitize: MPI not found; MPI tests not run under ASan"
  fi
}

run_tsan() {
  timed "tsan configure" configure "$TSAN_DIR" -DQCOLL_ENABLE_MPI=OFF "${tsan_opt_args[@]}" \
    "-DCMAKE_CXX_FLAGS=-fsanitize=thread" "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread"
  timed "tsan build" build_targets "$TSAN_DIR" unit_test_transport_local unit_test_collectives unit_test_overlap
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1" \
    timed "tsan tests" ctest --test-dir "$TSAN_DIR" --output-on-failure -j "$CTEST_JOBS" \
    -R '^unit\.(test_transport_local|test_collectives|test_overlap)$'
}

for mode in "${modes[@]}"; do
  case "$mode" in
    asan) run_asan ;;
    tsan) run_tsan ;;
    *) echo "usage: bash scripts/sanitize.sh [asan|tsan ...]" >&2; exit 2 ;;
  esac
done
