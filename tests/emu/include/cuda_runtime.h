// qcoll-emu: the subset of the CUDA runtime API and of the device language that qcoll's device
// code, GPU tests, device benchmark and device example use, executed on the CPU. Test-only: never
// installed, never included from include/qcoll. See docs/device.md ("CPU emulation") for what a
// run under it proves and what it cannot.
//
// Device code is compiled as ordinary C++ (g++), after a build step (tests/emu/rewrite.cmake) has
// rewritten each kernel launch `k<<<g, b, s, st>>>(args)` into
// `k << ::qcoll_emu::LaunchConfig(__FILE__, __LINE__, g, b, s, st)(args)`. Every CUDA thread of a
// block runs as a fiber on the launching stream's worker thread; __syncthreads and the warp
// collectives are meeting points of those fibers, checked for divergence (see runtime.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

// ---------------------------------------------------------------------------------------------
// Types and enums of the runtime API
// ---------------------------------------------------------------------------------------------

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorHostMemoryAlreadyRegistered = 712,
  cudaErrorHostMemoryNotRegistered = 713,
  cudaErrorLaunchFailure = 719,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureUnmatched = 903,
  cudaErrorStreamCaptureUnjoined = 904,
  cudaErrorStreamCaptureImplicit = 906,
  cudaErrorStreamCaptureWrongThread = 908,
};

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

enum cudaMemoryType {
  cudaMemoryTypeUnregistered = 0,
  cudaMemoryTypeHost = 1,
  cudaMemoryTypeDevice = 2,
  cudaMemoryTypeManaged = 3,
};

struct cudaPointerAttributes {
  cudaMemoryType type;
  int device;
  void* devicePointer;
  void* hostPointer;
};

enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2,
};

enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};

enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxThreadsPerMultiProcessor = 39,
};

struct cudaDeviceProp {
  char name[256];
  std::size_t totalGlobalMem;
  std::size_t sharedMemPerBlock;
  int warpSize;
  int maxThreadsPerBlock;
  int maxThreadsPerMultiProcessor;
  int multiProcessorCount;
  int major;
  int minor;
};

struct CUstream_st;
struct CUevent_st;
struct CUgraph_st;
struct CUgraphExec_st;
struct CUgraphNode_st;
using cudaStream_t = CUstream_st*;
using cudaEvent_t = CUevent_st*;
using cudaGraph_t = CUgraph_st*;
using cudaGraphExec_t = CUgraphExec_st*;
using cudaGraphNode_t = CUgraphNode_st*;

#define cudaStreamLegacy (reinterpret_cast<cudaStream_t>(0x1))
#define cudaStreamPerThread (reinterpret_cast<cudaStream_t>(0x2))
#define cudaStreamDefault 0x0u
#define cudaStreamNonBlocking 0x1u
#define cudaEventDefault 0x0u
#define cudaEventDisableTiming 0x2u
#define cudaHostAllocDefault 0x0u
#define cudaHostAllocPortable 0x1u
#define cudaHostAllocMapped 0x2u
#define cudaHostRegisterDefault 0x0u
#define cudaMemAttachGlobal 0x1u

// ---------------------------------------------------------------------------------------------
// Runtime API (runtime.cpp)
// ---------------------------------------------------------------------------------------------

cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorName(cudaError_t err);
const char* cudaGetErrorString(cudaError_t err);

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaMemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes);

cudaError_t cudaMalloc(void** p, std::size_t bytes);
cudaError_t cudaMallocManaged(void** p, std::size_t bytes, unsigned flags = cudaMemAttachGlobal);
cudaError_t cudaMallocHost(void** p, std::size_t bytes);
cudaError_t cudaHostAlloc(void** p, std::size_t bytes, unsigned flags);
cudaError_t cudaMallocAsync(void** p, std::size_t bytes, cudaStream_t stream);
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream);
cudaError_t cudaFree(void* p);
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaHostRegister(void* p, std::size_t bytes, unsigned flags);
cudaError_t cudaHostUnregister(void* p);
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* p);

template <class T>
cudaError_t cudaMalloc(T** p, std::size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
template <class T>
cudaError_t cudaMallocManaged(T** p, std::size_t bytes, unsigned flags = cudaMemAttachGlobal) {
  return cudaMallocManaged(reinterpret_cast<void**>(p), bytes, flags);
}
template <class T>
cudaError_t cudaMallocHost(T** p, std::size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(p), bytes);
}
template <class T>
cudaError_t cudaHostAlloc(T** p, std::size_t bytes, unsigned flags) {
  return cudaHostAlloc(reinterpret_cast<void**>(p), bytes, flags);
}
template <class T>
cudaError_t cudaMallocAsync(T** p, std::size_t bytes, cudaStream_t stream) {
  return cudaMallocAsync(reinterpret_cast<void**>(p), bytes, stream);
}

cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* p, int value, std::size_t bytes);
cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t stream = nullptr);

cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags = 0);

cudaError_t cudaEventCreate(cudaEvent_t* event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status);
cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode);
cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t* nodes, std::size_t* count);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);

// ---------------------------------------------------------------------------------------------
// Device language
// ---------------------------------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __shared__ static thread_local
#define __restrict__ __restrict

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

constexpr int warpSize = 32;

namespace qcoll_emu {
namespace detail {

//! The running CUDA thread's coordinates (one per fiber).
struct ThreadCoords {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
//! The fiber running on this OS thread (null outside kernels).
extern __thread ThreadCoords* tl_coords;

[[noreturn]] void outside_kernel(const char* what);
inline ThreadCoords& coords(const char* what) {
  if (tl_coords == nullptr) outside_kernel(what);
  return *tl_coords;
}

enum class WarpOp : int { shfl, shfl_up, shfl_down, shfl_xor, any, all, ballot, syncwarp };
enum class BarrierOp : int { sync, sync_or, sync_and, sync_count };

std::uint64_t warp_collective(WarpOp op, unsigned mask, std::uint64_t value, int arg, int width,
                              const char* file, int line);
int block_barrier(BarrierOp op, int predicate, const char* file, int line);
[[noreturn]] void trap(const char* file, int line);
void spin_hint();
std::uint64_t global_timer_ns_impl();

template <class T>
T shuffle(WarpOp op, unsigned mask, T v, int arg, int width, const char* file, int line) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of an unsupported type");
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = warp_collective(op, mask, bits, arg, width, file, line);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

//! A kernel launch whose arguments are known, waiting for the kernel (operator<< below).
template <class... A>
struct PendingLaunch;

void enqueue_kernel(const char* file, int line, dim3 grid, dim3 block, std::size_t shmem, cudaStream_t stream,
                    const char* signature, std::function<void()> body);

}  // namespace detail

//! `<<<grid, block, shmem, stream>>>` after the rewrite, with the launch site.
struct LaunchConfig {
  const char* file;
  int line;
  dim3 grid, block;
  std::size_t shmem;
  cudaStream_t stream;
  LaunchConfig(const char* f, int l, dim3 g, dim3 b, std::size_t s = 0, cudaStream_t st = nullptr)
      : file(f), line(l), grid(g), block(b), shmem(s), stream(st) {}
  template <class... A>
  detail::PendingLaunch<std::decay_t<A>...> operator()(A&&... args) const {
    return detail::PendingLaunch<std::decay_t<A>...>{
        *this, std::tuple<std::decay_t<A>...>(std::forward<A>(args)...)};
  }
};

namespace detail {
template <class... A>
struct PendingLaunch {
  LaunchConfig cfg;
  std::tuple<A...> args;
};

template <class... P>
const char* kernel_signature() {
  return __PRETTY_FUNCTION__;
}

//! Performs (or, while the stream is captured, records) the launch of `kernel`. The arguments are
//! converted to the kernel's parameter types and copied now, as CUDA copies them at launch.
template <class... P, class... A>
void operator<<(void (*kernel)(P...), PendingLaunch<A...>&& launch) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel launched with the wrong number of arguments");
  auto params = std::make_shared<std::tuple<std::decay_t<P>...>>(
      std::make_from_tuple<std::tuple<std::decay_t<P>...>>(std::move(launch.args)));
  enqueue_kernel(launch.cfg.file, launch.cfg.line, launch.cfg.grid, launch.cfg.block, launch.cfg.shmem,
                 launch.cfg.stream, kernel_signature<P...>(),
                 [kernel, params] { std::apply(kernel, *params); });
}
}  // namespace detail

//! %globaltimer: nanoseconds of a steady clock. Yields the calling CUDA thread (a kernel reading
//! the clock is polling).
inline std::uint64_t global_timer_ns() { return detail::global_timer_ns_impl(); }

}  // namespace qcoll_emu

#define threadIdx (::qcoll_emu::detail::coords("threadIdx").thread_idx)
#define blockIdx (::qcoll_emu::detail::coords("blockIdx").block_idx)
#define blockDim (::qcoll_emu::detail::coords("blockDim").block_dim)
#define gridDim (::qcoll_emu::detail::coords("gridDim").grid_dim)

#define QCOLL_EMU_SHFL(op, mask, v, arg, width)                                                        \
  ::qcoll_emu::detail::shuffle(::qcoll_emu::detail::WarpOp::op, (mask), (v), (arg), (width), __FILE__, \
                               __LINE__)
#define QCOLL_EMU_SHFL_W(op, mask, v, arg, ...) \
  QCOLL_EMU_SHFL(op, mask, v, arg, (__VA_ARGS__ + 0 == 0 ? 32 : __VA_ARGS__ + 0))
#define __shfl_sync(mask, v, lane, ...) QCOLL_EMU_SHFL_W(shfl, mask, v, lane, __VA_ARGS__)
#define __shfl_up_sync(mask, v, delta, ...) QCOLL_EMU_SHFL_W(shfl_up, mask, v, delta, __VA_ARGS__)
#define __shfl_down_sync(mask, v, delta, ...) QCOLL_EMU_SHFL_W(shfl_down, mask, v, delta, __VA_ARGS__)
#define __shfl_xor_sync(mask, v, lanemask, ...) QCOLL_EMU_SHFL_W(shfl_xor, mask, v, lanemask, __VA_ARGS__)
#define __any_sync(mask, pred)                                                                             \
  (::qcoll_emu::detail::warp_collective(::qcoll_emu::detail::WarpOp::any, (mask), (pred) ? 1u : 0u, 0, 32, \
                                        __FILE__, __LINE__) != 0)
#define __all_sync(mask, pred)                                                                             \
  (::qcoll_emu::detail::warp_collective(::qcoll_emu::detail::WarpOp::all, (mask), (pred) ? 1u : 0u, 0, 32, \
                                        __FILE__, __LINE__) != 0)
#define __ballot_sync(mask, pred)                                                                         \
  static_cast<unsigned>(::qcoll_emu::detail::warp_collective(::qcoll_emu::detail::WarpOp::ballot, (mask), \
                                                             (pred) ? 1u : 0u, 0, 32, __FILE__, __LINE__))
#define __syncwarp(...)                                                                                      \
  ((void)::qcoll_emu::detail::warp_collective(::qcoll_emu::detail::WarpOp::syncwarp,                         \
                                              (__VA_ARGS__ + 0 == 0 ? 0xffffffffu : __VA_ARGS__ + 0u), 0, 0, \
                                              32, __FILE__, __LINE__))
#define __syncthreads() \
  ((void)::qcoll_emu::detail::block_barrier(::qcoll_emu::detail::BarrierOp::sync, 0, __FILE__, __LINE__))
#define __syncthreads_or(pred)                                                                          \
  ::qcoll_emu::detail::block_barrier(::qcoll_emu::detail::BarrierOp::sync_or, (pred) ? 1 : 0, __FILE__, \
                                     __LINE__)
#define __syncthreads_and(pred)                                                                          \
  ::qcoll_emu::detail::block_barrier(::qcoll_emu::detail::BarrierOp::sync_and, (pred) ? 1 : 0, __FILE__, \
                                     __LINE__)
#define __syncthreads_count(pred)                                                                          \
  ::qcoll_emu::detail::block_barrier(::qcoll_emu::detail::BarrierOp::sync_count, (pred) ? 1 : 0, __FILE__, \
                                     __LINE__)
#define __trap() ::qcoll_emu::detail::trap(__FILE__, __LINE__)
#define __nanosleep(ns) ((void)(ns), ::qcoll_emu::detail::spin_hint())
#define __threadfence() __atomic_thread_fence(__ATOMIC_SEQ_CST)

//! Device atomics: the old value; sequentially consistent on the host.
template <class T>
T atomicOr(T* p, T v) {
  return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);
}
template <class T>
T atomicAnd(T* p, T v) {
  return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST);
}
template <class T>
T atomicAdd(T* p, T v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
template <class T>
T atomicMax(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
template <class T>
T atomicMin(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (v < old && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
template <class T>
T atomicCAS(T* p, T expected, T desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;
}
