// main() for doctest programs that run under mpiexec: every rank runs every test case; only rank 0
// prints doctest's report; the exit code is non-zero on every rank if any rank failed.
#pragma once

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // only the C API is used; the C++ bindings do not build warning-free
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <sstream>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context context(argc, argv);
  std::ostringstream report;  // ranks other than 0 print their report only when they failed
  if (rank != 0) context.setCout(&report);
  int failed = context.run() != 0 ? 1 : 0;
  if (rank != 0 && failed) std::printf("[rank %d]\n%s", rank, report.str().c_str());
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any && !failed) std::printf("a test failed on another rank (its report is above)\n");
  MPI_Finalize();
  return any;
}
