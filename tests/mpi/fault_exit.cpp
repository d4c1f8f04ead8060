// A job in which one rank dies mid-sequence: rank 2 of 4 exits (without MPI_Finalize) after its
// second all-gather while its peers go on calling. The job must end by itself, with a non-zero
// status, within a bounded time (tests/mpi/run_fault_exit.cmake checks this): MPI's abort of the
// job is the expected way; the watchdog bounds the survivors if the launcher does not act.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <qcoll/collective/all_gather.hpp>
#include <qcoll/transport/mpi.hpp>

#include "../common/collective_harness.hpp"
#include "../common/watchdog.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  testing_support::Watchdog dog(45, "fault_exit");
  qcoll::MpiTransport t(MPI_COMM_WORLD);
  const qcoll::ShardLayout layout(4096, t.size(), qcoll::granule_for(4, {32}));
  qcoll::QuantizedAllGather<float, qcoll::Int8<32>, qcoll::MpiTransport> ag(t, layout);
  harness::Workspace ws(ag.workspace_bytes());
  std::vector<float> shard(layout.shard_numel(), 1.0f), full(layout.padded_numel());
  for (int step = 0; step < 100; ++step) {
    if (t.rank() == 2 && step == 2) {
      std::printf("fault_exit: rank 2 exits at step 2\n");
      std::fflush(stdout);
      std::_Exit(3);
    }
    ag(shard.data(), full.data(), ws.ptr, ws.bytes);
  }
  std::printf("fault_exit: rank %d finished all steps (unexpected)\n", t.rank());
  MPI_Finalize();
  return 0;
}
