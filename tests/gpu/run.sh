#!/usr/bin/env bash
# Builds the CUDA tests and benchmarks for sm_90, runs them, and writes logs and result tables to
# $OUT (or build/gpu-results when OUT is unset). Meant for a machine with one GPU; budget: a few
# minutes of build plus the runs. Exit status: non-zero if a test failed or was skipped (a run
# without a GPU is not a pass).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${OUT:-$root/build/gpu-results}"
build="${GPU_BUILD_DIR:-$root/build-gpu}"
nvcc="${CUDACXX:-/usr/local/cuda/bin/nvcc}"
mkdir -p "$out"
status=0

nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
echo "== configure" | tee "$out/summary.txt"
if ! cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DQCOLL_BUILD_HEADER_TESTS=OFF >"$out/configure.log" 2>&1; then
  echo "configure failed (see configure.log)" | tee -a "$out/summary.txt"
  exit 1
fi
echo "== build" | tee -a "$out/summary.txt"
mapfile -t gpu_targets < <(cd "$root/tests/gpu" && ls test_*.cu | sed 's/\.cu$//; s/^/gpu_/')
if ! cmake --build "$build" -j "$(nproc)" --target "${gpu_targets[@]}" bench_quantize_device \
  bench_collectives_device quickstart_device >"$out/build.log" 2>&1; then
  echo "build failed (see build.log)" | tee -a "$out/summary.txt"
  exit 1
fi

for exe in "$build"/tests/gpu/test_*; do
  name="$(basename "$exe")"
  timeout 120 "$exe" >"$out/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc" | tee -a "$out/summary.txt"
  [ "$rc" -eq 0 ] || status=1
done
timeout 60 "$build/bin/quickstart_device" >"$out/quickstart_device.txt" 2>&1
rc=$?
echo "quickstart_device: exit $rc" | tee -a "$out/summary.txt"
[ "$rc" -eq 0 ] || status=1
timeout 150 "$build/bin/bench_quantize_device" >"$out/bench_quantize_device.txt" 2>&1
echo "bench_quantize_device: exit $?" | tee -a "$out/summary.txt"
timeout 90 "$build/bin/bench_collectives_device" >"$out/bench_collectives_device.txt" 2>&1
echo "bench_collectives_device: exit $?" | tee -a "$out/summary.txt"
timeout 90 "$build/bin/bench_collectives_device" -c 1 --sizes 1M,4M -n 5 -w 2 \
  >"$out/bench_collectives_device_check.txt" 2>&1
rc=$?
echo "bench_collectives_device -c 1 (device = host plan, bit for bit): exit $rc" | tee -a "$out/summary.txt"
[ "$rc" -eq 0 ] || status=1
timeout 60 "$build/bin/bench_collectives_device" --graph --sizes 4M,64M -w 2 \
  >"$out/bench_collectives_device_graph.txt" 2>&1
echo "bench_collectives_device --graph: exit $?" | tee -a "$out/summary.txt"
exit "$status"
