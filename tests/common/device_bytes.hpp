// An owning device allocation for the GPU tests.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

#include <qcoll/cuda/check.cuh>

namespace testing_support {

//! Owning device allocation of at least 64 bytes (so an empty buffer is still a valid pointer).
class DeviceBytes {
 public:
  explicit DeviceBytes(std::size_t bytes) : size_(bytes) {
    QCOLL_CUDA_CHECK(cudaMalloc(&p_, bytes < 64 ? 64 : bytes));
  }
  ~DeviceBytes() { (void)cudaFree(p_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  unsigned char* get() const { return static_cast<unsigned char*>(p_); }
  template <class T = unsigned char>
  T* as() const {
    return static_cast<T*>(p_);
  }
  //! The size asked for, in bytes.
  std::size_t size() const { return size_; }

 private:
  void* p_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace testing_support
