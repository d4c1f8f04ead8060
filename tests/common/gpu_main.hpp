// main() for doctest programs that need a CUDA device: without one they print "skipped: no CUDA
// device" and exit 77, which CTest reports as skipped (SKIP_RETURN_CODE), never as passed.
#pragma once

#include <cuda_runtime.h>

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  // Before the first CUDA call, as qcoll::cuda_local_request_queues() does: the cuda_local graph
  // tests run up to 8 ranks' streams besides others, more than CUDA's default 8 hardware queues.
  (void)setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    std::printf("skipped: no CUDA device\n");
    return 77;
  }
  doctest::Context context;
  context.applyCommandLine(argc, argv);
  return context.run();
}
