// main() for doctest programs that run under mpiexec -n K. Every rank runs every test case in the
// same order; test cases must not stop early on one rank only (use CHECK, not REQUIRE, around
// collectives) so all ranks keep calling the same collectives. Only rank 0 prints doctest's
// report; another rank prints its own only if it saw a failure. The exit code is non-zero if any
// rank failed, and a watchdog aborts a run that hangs (mpiexec then fails the whole job).
#pragma once

#include <qcoll/transport/mpi.hpp>  // includes <mpi.h> without Open MPI's C++ bindings

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <iostream>
#include <sstream>

#include "watchdog.hpp"

namespace mpi_main {

//! This process's rank in MPI_COMM_WORLD.
inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

//! Number of ranks in MPI_COMM_WORLD.
inline int world_size() {
  int s = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

}  // namespace mpi_main

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int failed = 0;
  bool exit_early = false;
  {
    testing_support::Watchdog dog(240, argv[0]);
    doctest::Context context(argc, argv);
    std::ostringstream captured;
    if (rank != 0) context.setCout(&captured);
    failed = context.run() != 0 ? 1 : 0;
    exit_early = context.shouldExit();
    if (failed && rank != 0)
      std::cerr << "---- doctest report of rank " << rank << " ----\n" << captured.str() << std::flush;
  }
  int failed_ranks = 0;
  if (!exit_early) MPI_Allreduce(&failed, &failed_ranks, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0 && failed_ranks > 0) std::cerr << failed_ranks << " rank(s) failed\n";
  MPI_Finalize();
  return failed_ranks > 0 || failed ? 1 : 0;
}
