#pragma once
//! \file
//! CUDA error handling: QCOLL_CUDA_CHECK turns a failed CUDA runtime call into qcoll::Error, and
//! require_device_accessible() rejects pointers a kernel cannot read or write.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "../core/error.hpp"

QCOLL_NAMESPACE_BEGIN
namespace gpu {
namespace detail {

//! Throws qcoll::Error "qcoll: CUDA error NAME (CODE): DESCRIPTION in `EXPR` at FILE:LINE". Clears
//! the runtime's last-error slot first, so a later check does not report the same failure again.
[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  (void)cudaGetLastError();
  std::ostringstream os;
  os << "qcoll: CUDA error " << cudaGetErrorName(err) << " (" << static_cast<int>(err)
     << "): " << cudaGetErrorString(err) << " in `" << expr << "` at " << file << ":" << line;
  throw ::qcoll::Error(os.str());
}

}  // namespace detail
}  // namespace gpu
QCOLL_NAMESPACE_END

//! Evaluates a CUDA runtime call once; throws qcoll::Error with the runtime's own error name and
//! text (cudaGetErrorName / cudaGetErrorString) unless it returned cudaSuccess.
#define QCOLL_CUDA_CHECK(expr)                                                                  \
  do {                                                                                          \
    const cudaError_t qcoll_cuda_check_err_ = (expr);                                           \
    if (qcoll_cuda_check_err_ != cudaSuccess)                                                   \
      ::qcoll::gpu::detail::throw_cuda_error(qcoll_cuda_check_err_, #expr, __FILE__, __LINE__); \
  } while (0)

//! Checks that the kernel launch just made was accepted (bad configuration, missing device code
//! for this GPU, ...); throws qcoll::Error otherwise. Does not wait for the kernel.
#define QCOLL_CUDA_CHECK_LAUNCH() QCOLL_CUDA_CHECK(cudaGetLastError())

QCOLL_NAMESPACE_BEGIN
namespace gpu {

namespace detail {
//! Puts the calling thread in relaxed stream-capture mode for its lifetime, so pure queries such
//! as cudaPointerGetAttributes are legal while the caller's stream is being captured into a graph.
class RelaxedCaptureScope {
 public:
  RelaxedCaptureScope() { ok_ = cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess; }
  ~RelaxedCaptureScope() {
    if (ok_) (void)cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureScope(const RelaxedCaptureScope&) = delete;
  RelaxedCaptureScope& operator=(const RelaxedCaptureScope&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool ok_ = false;
};
}  // namespace detail

//! Throws qcoll::Error naming `function` and `argument` unless `p` is null or memory a kernel on
//! the current device can access: device memory (cudaMalloc, cudaMallocAsync), managed memory, or
//! pinned host memory (cudaHostAlloc, cudaHostRegister). Ordinary pageable host memory (a
//! std::vector's data, a stack array) is rejected. One cudaPointerGetAttributes query; legal
//! while the stream is being captured.
inline void require_device_accessible(const void* p, const char* function, const char* argument) {
  if (p == nullptr) return;
  cudaPointerAttributes attr{};
  cudaError_t err;
  {
    detail::RelaxedCaptureScope relaxed;
    err = cudaPointerGetAttributes(&attr, p);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    QCOLL_REQUIRE(false, function, argument, p, "is not a pointer CUDA can resolve:",
                  cudaGetErrorName(err) << " (" << cudaGetErrorString(err) << ")");
  }
  QCOLL_REQUIRE(attr.type != cudaMemoryTypeUnregistered, function, argument, p,
                "is pageable host memory; expected",
                "device-accessible memory (cudaMalloc, cudaMallocManaged or pinned host memory)");
}

//! Throws qcoll::Error unless `p` is a multiple of `alignment` bytes (a power of two).
inline void require_aligned(const void* p, std::size_t alignment, const char* function,
                            const char* argument) {
  QCOLL_REQUIRE(reinterpret_cast<std::uintptr_t>(p) % alignment == 0, function, argument, p,
                "is not aligned to", alignment << " bytes");
}

}  // namespace gpu
QCOLL_NAMESPACE_END
