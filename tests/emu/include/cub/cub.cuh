// qcoll-emu: the CUB subset qcoll uses. Test-only (see cuda_runtime.h).
#pragma once
#include "block/block_reduce.cuh"
