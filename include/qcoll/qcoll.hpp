#pragma once
//! \file
//! Umbrella header for the parts of qcoll that compile with a plain C++17 host compiler: core
//! types, block formats, layouts, host kernels, the in-process transport and the collective plans.
//! The MPI transport is separate (`qcoll/transport/mpi.hpp`, needs <mpi.h>); the CUDA parts come
//! with `qcoll/qcoll.cuh`.

#include "collective/all_gather.hpp"
#include "collective/common.hpp"
#include "collective/delta_all_gather.hpp"
#include "collective/feedback.hpp"
#include "collective/hpz.hpp"
#include "collective/reduce_scatter.hpp"
#include "core/checked.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/fpmath.hpp"
#include "core/half.hpp"
#include "core/hash.hpp"
#include "core/rng.hpp"
#include "core/version.hpp"
#include "core/workspace.hpp"
#include "format/dispatch.hpp"
#include "format/format.hpp"
#include "format/hadamard.hpp"
#include "format/message.hpp"
#include "format/minifloat.hpp"
#include "host/quantize.hpp"
#include "layout/group.hpp"
#include "layout/qgz.hpp"
#include "layout/shard.hpp"
#include "layout/topology.hpp"
#include "transport/common.hpp"
#include "transport/local.hpp"
