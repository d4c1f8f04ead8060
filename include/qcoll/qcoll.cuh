#pragma once
//! \file
//! Umbrella header for all of qcoll, CUDA parts included; needs nvcc. The device kernels live in
//! namespace qcoll::gpu (not qcoll::cuda, which would clash with CCCL's ::cuda after a
//! `using namespace qcoll;`).

#include "collective/device.cuh"
#include "cuda/check.cuh"
#include "cuda/quantize.cuh"
#include "qcoll.hpp"
#include "transport/cuda_local.cuh"
#include "transport/nccl.cuh"
