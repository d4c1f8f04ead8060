// qcoll-emu: cub::BlockReduce (Reduce with a functor, Sum) over the emulator's warp shuffles and
// __syncthreads, with CUB's contract: every thread of a block of BLOCK_DIM_X * Y * Z threads calls
// it, the result is valid in thread 0 only, and TempStorage is reused only after a barrier.
// Test-only (see cuda_runtime.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace cub {

enum BlockReduceAlgorithm {
  BLOCK_REDUCE_RAKING_COMMUTATIVE_ONLY,
  BLOCK_REDUCE_RAKING,
  BLOCK_REDUCE_WARP_REDUCTIONS,
};

struct Sum {
  template <class T>
  T operator()(const T& a, const T& b) const {
    return a + b;
  }
};

template <class T, int BLOCK_DIM_X, BlockReduceAlgorithm ALGORITHM = BLOCK_REDUCE_WARP_REDUCTIONS,
          int BLOCK_DIM_Y = 1, int BLOCK_DIM_Z = 1, int LEGACY_PTX_ARCH = 0>
class BlockReduce {
  static constexpr int kThreads = BLOCK_DIM_X * BLOCK_DIM_Y * BLOCK_DIM_Z;
  static constexpr int kWarps = kThreads / 32;
  static_assert(kThreads % 32 == 0, "qcoll-emu's BlockReduce covers whole warps only");

 public:
  struct TempStorage {
    T warp[kWarps];
  };

  explicit BlockReduce(TempStorage& tmp) : tmp_(tmp) {
    const dim3 b = blockDim;
    if (static_cast<int>(b.x) != BLOCK_DIM_X || static_cast<int>(b.y) != BLOCK_DIM_Y ||
        static_cast<int>(b.z) != BLOCK_DIM_Z) {
      std::fprintf(
          stderr, "qcoll-emu: cub::BlockReduce for a block of %dx%dx%d threads used in a block of %ux%ux%u\n",
          BLOCK_DIM_X, BLOCK_DIM_Y, BLOCK_DIM_Z, b.x, b.y, b.z);
      std::fflush(stderr);
      std::_Exit(70);
    }
  }

  template <class Op>
  T Reduce(T x, Op op) {
    const int t = static_cast<int>(threadIdx.x + BLOCK_DIM_X * (threadIdx.y + BLOCK_DIM_Y * threadIdx.z));
    const int lane = t % 32, warp = t / 32;
    for (int o = 1; o < 32; o *= 2) {
      const T y = __shfl_down_sync(0xffffffffu, x, o);
      if (lane + o < 32) x = op(x, y);
    }
    if (lane == 0) tmp_.warp[warp] = x;
    __syncthreads();
    if (t == 0)
      for (int w = 1; w < kWarps; ++w) x = op(x, tmp_.warp[w]);
    return x;
  }
  T Sum(T x) { return Reduce(x, cub::Sum{}); }

 private:
  TempStorage& tmp_;
};

}  // namespace cub
