#pragma once
//! \file
//! Configuration macros shared by host and device code.

#include "version.hpp"

#if defined(__CUDACC__)
//! Marks functions compiled for host and device; plain `inline` without nvcc.
#define QCOLL_HOST_DEVICE __host__ __device__ __forceinline__
//! Marks device-only helpers (only meaningful under nvcc).
#define QCOLL_DEVICE __device__ __forceinline__
#elif defined(__GNUC__)
// Always inlined on the host as on the device: the per-element math must fuse into the callers'
// loops to vectorize, also in translation units that instantiate many formats.
#define QCOLL_HOST_DEVICE inline __attribute__((always_inline))
#define QCOLL_DEVICE inline __attribute__((always_inline))
#else
#define QCOLL_HOST_DEVICE inline
#define QCOLL_DEVICE inline
#endif

#if defined(__CUDA_ARCH__)
//! Defined to 1 while compiling device code.
#define QCOLL_DEVICE_CODE 1
#else
#define QCOLL_DEVICE_CODE 0
#endif
