// A one-rank NCCL communicator for the GPU tests: world 1 through ncclCommInitAll on device 0
// (with one GPU, the only NCCL world a test can build). Only where the NCCL transport is compiled.
#pragma once

#include <qcoll/transport/nccl.cuh>

#if QCOLL_HAS_NCCL

//! A one-rank communicator on device 0, destroyed at the end of the scope.
struct OneRankComm {
  ncclComm_t comm = nullptr;
  OneRankComm() {
    int dev = 0;
    QCOLL_NCCL_CHECK(comm, ncclCommInitAll(&comm, 1, &dev));
  }
  ~OneRankComm() { (void)ncclCommDestroy(comm); }
  OneRankComm(const OneRankComm&) = delete;
  OneRankComm& operator=(const OneRankComm&) = delete;
};

#endif
