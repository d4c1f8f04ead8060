// Deliberate faults the emulator must report (tests/emu/CMakeLists.txt registers one CTest per
// line below; a test passes when its pattern appears in the output). `clean` runs the correct
// version of every kernel here and must pass without a report.
//
// clang-format off
// qcoll-emu-selftest: clean selftest: clean run passed
// qcoll-emu-selftest: divergent_syncthreads qcoll-emu: .*divergent barriers
// qcoll-emu-selftest: exited_before_syncthreads qcoll-emu: .*exited while .* threads wait at __syncthreads
// qcoll-emu-selftest: missing_syncthreads selftest: wrong block sums
// qcoll-emu-selftest: shuffle_lane_not_in_mask qcoll-emu: .*__shfl_xor_sync.*which does not name it
// qcoll-emu-selftest: shuffle_reads_outside_mask qcoll-emu: .*reads lane 16.*not in the mask
// qcoll-emu-selftest: branch_around_warp_vote qcoll-emu: .*exited, but lanes 0-2 wait for it in __any_sync
// qcoll-emu-selftest: wrong_stream_order selftest: stale copy
// qcoll-emu-selftest: missing_graph_dependency selftest: graph replay out of order
// qcoll-emu-selftest: spin_wait_in_block selftest: spin done
// qcoll-emu-selftest: launch_bad_config selftest: launch rejected: cudaErrorInvalidConfiguration
// qcoll-emu-selftest: capture_unsafe_call selftest: capture refused: cudaErrorStreamCaptureUnsupported
// clang-format on

#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <cuda/atomic>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

#define CHECK_CUDA(expr)                                                     \
  do {                                                                       \
    const cudaError_t e_ = (expr);                                           \
    if (e_ != cudaSuccess) {                                                 \
      std::printf("selftest: %s failed: %s\n", #expr, cudaGetErrorName(e_)); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

// Block sums through shared memory: every thread writes its slot, then thread 0 adds them. Without
// the barrier, thread 0 adds slots the other threads have not written yet.
template <bool kBarrier>
__global__ void block_sum(const unsigned* in, unsigned* out) {
  __shared__ unsigned slots[128];
  slots[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
  if (kBarrier) __syncthreads();
  if (threadIdx.x == 0) {
    unsigned s = 0;
    for (unsigned i = 0; i < blockDim.x; ++i) s += slots[i];
    out[blockIdx.x] = s;
  }
  if (kBarrier) __syncthreads();     // slots are reused by the next block only after every read
  slots[threadIdx.x] = 0xdeadbeefu;  // what a later block would otherwise see
}

__global__ void divergent_syncthreads(unsigned* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

__global__ void exited_before_syncthreads(unsigned* out) {
  if (threadIdx.x == 5) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

// Warp max by butterfly from lane distance kFirst down. kMask: the mask passed; kLanes: how many
// lanes call.
template <unsigned kMask, int kLanes, int kFirst = 16>
__global__ void warp_max(const unsigned* in, unsigned* out) {
  unsigned x = in[threadIdx.x];
  if (static_cast<int>(threadIdx.x) < kLanes) {
    for (int o = kFirst; o > 0; o /= 2) {
      const unsigned y = __shfl_xor_sync(kMask, x, o);
      x = y > x ? y : x;
    }
  }
  out[threadIdx.x] = x;
}

// A vote inside a lane-dependent branch: lanes >= 8 never join it.
__global__ void branch_around_vote(const unsigned* in, unsigned* out) {
  const unsigned x = in[threadIdx.x];
  if (x < 8) {
    out[threadIdx.x] = __any_sync(0xffffffffu, x == 3) ? 1u : 0u;
  } else {
    out[threadIdx.x] = 2;
  }
}

// Thread 0 writes a value after a delay; the kernel on a second stream copies it.
__global__ void slow_write(unsigned* p, unsigned v) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  while (std::chrono::steady_clock::now() < until) __nanosleep(1000);
  *p = v;
}

__global__ void copy_one(const unsigned* from, unsigned* to) { *to = *from; }
__global__ void set_one(unsigned* p, unsigned v) { *p = v; }

// Thread 1 polls a flag that thread 0 of the same warp sets later: polling lets the others run.
__global__ void spin_in_block(unsigned* flag) {
  cuda::atomic_ref<unsigned, cuda::thread_scope_device> f(*flag);
  if (threadIdx.x == 1) {
    while (f.load(cuda::memory_order_acquire) == 0) {
    }
  } else {
    __syncwarp(0x1u);
    f.store(1, cuda::memory_order_release);
  }
}

// Each lane reads its right neighbour (a per-lane source lane).
__global__ void rotate(const unsigned* in, unsigned* out) {
  const unsigned lane = threadIdx.x % 32;
  out[threadIdx.x] = __shfl_sync(0xffffffffu, in[threadIdx.x], static_cast<int>((lane + 1) % 32));
}

__global__ void reduce_block(const unsigned* in, unsigned* out) {
  using R = cub::BlockReduce<unsigned, 128>;
  __shared__ typename R::TempStorage tmp;
  const unsigned s = R(tmp).Sum(in[blockIdx.x * blockDim.x + threadIdx.x]);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}

struct Buf {
  unsigned* p = nullptr;
  explicit Buf(std::size_t n) { CHECK_CUDA(cudaMalloc(&p, n * sizeof(unsigned))); }
  ~Buf() { (void)cudaFree(p); }
};

std::vector<unsigned> iota(std::size_t n) {
  std::vector<unsigned> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned>(i * 7 % 13);
  return v;
}

std::vector<unsigned> get(const unsigned* d, std::size_t n) {
  std::vector<unsigned> h(n);
  CHECK_CUDA(cudaMemcpy(h.data(), d, n * sizeof(unsigned), cudaMemcpyDeviceToHost));
  return h;
}

bool run_block_sum(bool barrier) {
  const std::size_t blocks = 3, n = blocks * 128;
  const std::vector<unsigned> h = iota(n);
  Buf in(n), out(blocks);
  CHECK_CUDA(cudaMemcpy(in.p, h.data(), n * sizeof(unsigned), cudaMemcpyHostToDevice));
  if (barrier) {
    block_sum<true><<<blocks, 128>>>(in.p, out.p);
  } else {
    block_sum<false><<<blocks, 128>>>(in.p, out.p);
  }
  CHECK_CUDA(cudaGetLastError());
  const std::vector<unsigned> got = get(out.p, blocks);
  for (std::size_t b = 0; b < blocks; ++b) {
    unsigned want = 0;
    for (std::size_t i = 0; i < 128; ++i) want += h[b * 128 + i];
    if (got[b] != want) return false;
  }
  return true;
}

template <unsigned kMask, int kLanes, int kFirst = 16>
std::vector<unsigned> run_warp_max() {
  const std::vector<unsigned> h = iota(32);
  Buf in(32), out(32);
  CHECK_CUDA(cudaMemcpy(in.p, h.data(), 32 * sizeof(unsigned), cudaMemcpyHostToDevice));
  warp_max<kMask, kLanes, kFirst><<<1, 32>>>(in.p, out.p);
  return get(out.p, 32);
}

// Stream A delays its write; stream B copies without waiting for A (kOrdered: with an event).
bool run_stream_order(bool ordered) {
  Buf v(1), copy(1);
  CHECK_CUDA(cudaMemset(v.p, 0, sizeof(unsigned)));
  CHECK_CUDA(cudaMemset(copy.p, 0, sizeof(unsigned)));
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaStream_t a, b;
  cudaEvent_t written;
  CHECK_CUDA(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  CHECK_CUDA(cudaEventCreate(&written));
  slow_write<<<1, 1, 0, a>>>(v.p, 42u);
  CHECK_CUDA(cudaEventRecord(written, a));
  if (ordered) CHECK_CUDA(cudaStreamWaitEvent(b, written, 0));
  copy_one<<<1, 1, 0, b>>>(v.p, copy.p);
  unsigned got = 0;
  CHECK_CUDA(cudaMemcpyAsync(&got, copy.p, sizeof got, cudaMemcpyDeviceToHost, b));
  CHECK_CUDA(cudaStreamSynchronize(b));
  CHECK_CUDA(cudaStreamSynchronize(a));
  CHECK_CUDA(cudaEventDestroy(written));
  CHECK_CUDA(cudaStreamDestroy(a));
  CHECK_CUDA(cudaStreamDestroy(b));
  return got == 42u;
}

// A fork inside a capture: `set` on stream b, then `copy` on stream a. With the join
// (kJoined), the copy depends on the set; without, the replay may run them in either order.
bool run_graph(bool joined) {
  Buf v(1), copy(1);
  CHECK_CUDA(cudaMemset(v.p, 0, sizeof(unsigned)));
  CHECK_CUDA(cudaMemset(copy.p, 0, sizeof(unsigned)));
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaStream_t a, b;
  cudaEvent_t fork, join;
  CHECK_CUDA(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  CHECK_CUDA(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CHECK_CUDA(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  cudaGraph_t g;
  CHECK_CUDA(cudaStreamBeginCapture(a, cudaStreamCaptureModeThreadLocal));
  CHECK_CUDA(cudaEventRecord(fork, a));
  CHECK_CUDA(cudaStreamWaitEvent(b, fork, 0));
  set_one<<<1, 1, 0, b>>>(v.p, 7u);
  CHECK_CUDA(cudaEventRecord(join, b));
  if (joined) {
    CHECK_CUDA(cudaStreamWaitEvent(a, join, 0));
    copy_one<<<1, 1, 0, a>>>(v.p, copy.p);
  } else {
    copy_one<<<1, 1, 0, a>>>(v.p, copy.p);
    CHECK_CUDA(cudaStreamWaitEvent(a, join, 0));  // joined only after the copy
  }
  CHECK_CUDA(cudaStreamEndCapture(a, &g));
  cudaGraphExec_t x;
  CHECK_CUDA(cudaGraphInstantiate(&x, g, 0));
  CHECK_CUDA(cudaGraphLaunch(x, a));
  CHECK_CUDA(cudaStreamSynchronize(a));
  const unsigned got = get(copy.p, 1)[0];
  CHECK_CUDA(cudaGraphExecDestroy(x));
  CHECK_CUDA(cudaGraphDestroy(g));
  CHECK_CUDA(cudaEventDestroy(fork));
  CHECK_CUDA(cudaEventDestroy(join));
  CHECK_CUDA(cudaStreamDestroy(a));
  CHECK_CUDA(cudaStreamDestroy(b));
  return got == 7u;
}

int clean() {
  if (!run_block_sum(true)) {
    std::printf("selftest: block_sum with barriers is wrong\n");
    return 1;
  }
  const std::vector<unsigned> m = run_warp_max<0xffffffffu, 32>();
  for (unsigned x : m)
    if (x != 12u) {
      std::printf("selftest: warp max %u\n", x);
      return 1;
    }
  {
    const std::vector<unsigned> h = iota(64);
    Buf in(64), out(64);
    CHECK_CUDA(cudaMemcpy(in.p, h.data(), 64 * sizeof(unsigned), cudaMemcpyHostToDevice));
    rotate<<<1, 64>>>(in.p, out.p);
    const std::vector<unsigned> r = get(out.p, 64);
    for (std::size_t i = 0; i < 64; ++i)
      if (r[i] != h[i / 32 * 32 + (i + 1) % 32]) {
        std::printf("selftest: rotate by __shfl_sync wrong at %zu\n", i);
        return 1;
      }
  }
  if (!run_stream_order(true) || !run_graph(true)) {
    std::printf("selftest: ordered streams or joined graph wrong\n");
    return 1;
  }
  {
    const std::vector<unsigned> h = iota(256);
    Buf in(256), out(2);
    CHECK_CUDA(cudaMemcpy(in.p, h.data(), 256 * sizeof(unsigned), cudaMemcpyHostToDevice));
    reduce_block<<<2, 128>>>(in.p, out.p);
    const std::vector<unsigned> s = get(out.p, 2);
    unsigned w0 = 0, w1 = 0;
    for (int i = 0; i < 128; ++i) {
      w0 += h[static_cast<std::size_t>(i)];
      w1 += h[static_cast<std::size_t>(128 + i)];
    }
    if (s[0] != w0 || s[1] != w1) {
      std::printf("selftest: cub::BlockReduce sums %u %u, want %u %u\n", s[0], s[1], w0, w1);
      return 1;
    }
  }
  std::printf("selftest: clean run passed\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "clean";
  if (what == "clean") return clean();
  if (what == "divergent_syncthreads" || what == "exited_before_syncthreads") {
    Buf out(64);
    if (what == "divergent_syncthreads") {
      divergent_syncthreads<<<1, 64>>>(out.p);
    } else {
      exited_before_syncthreads<<<1, 64>>>(out.p);
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    std::printf("selftest: no report\n");
    return 1;
  }
  if (what == "missing_syncthreads") {
    std::printf(run_block_sum(false) ? "selftest: sums right\n" : "selftest: wrong block sums\n");
    return 1;
  }
  if (what == "shuffle_lane_not_in_mask") (void)run_warp_max<0x0000ffffu, 32, 8>();
  if (what == "shuffle_reads_outside_mask") (void)run_warp_max<0x0000ffffu, 16>();
  if (what == "branch_around_warp_vote") {
    const std::vector<unsigned> h = iota(32);
    Buf in(32), out(32);
    CHECK_CUDA(cudaMemcpy(in.p, h.data(), 32 * sizeof(unsigned), cudaMemcpyHostToDevice));
    branch_around_vote<<<1, 32>>>(in.p, out.p);
    (void)get(out.p, 32);
  }
  if (what == "wrong_stream_order") {
    std::printf(run_stream_order(false) ? "selftest: copy current\n" : "selftest: stale copy\n");
    return 1;
  }
  if (what == "missing_graph_dependency") {
    std::printf(run_graph(false) ? "selftest: graph replay in order\n"
                                 : "selftest: graph replay out of order\n");
    return 1;
  }
  if (what == "spin_wait_in_block") {
    Buf flag(1);
    CHECK_CUDA(cudaMemset(flag.p, 0, sizeof(unsigned)));
    spin_in_block<<<1, 2>>>(flag.p);
    CHECK_CUDA(cudaDeviceSynchronize());
    std::printf("selftest: spin done\n");
    return 0;
  }
  if (what == "launch_bad_config") {
    Buf out(1);
    set_one<<<1, 2048>>>(out.p, 1u);
    std::printf("selftest: launch rejected: %s\n", cudaGetErrorName(cudaGetLastError()));
    return 1;
  }
  if (what == "capture_unsafe_call") {
    cudaStream_t s;
    CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CHECK_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    void* p = nullptr;
    std::printf("selftest: capture refused: %s\n", cudaGetErrorName(cudaMalloc(&p, 64)));
    cudaGraph_t g = nullptr;
    const cudaError_t e = cudaStreamEndCapture(s, &g);
    std::printf("selftest: end capture: %s\n", cudaGetErrorName(e));
    return 1;
  }
  std::printf("selftest: unknown case %s\n", what.c_str());
  return 2;
}
