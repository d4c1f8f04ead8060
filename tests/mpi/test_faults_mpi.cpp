// qcoll-mpi-ranks: 4
// Ranks that disagree on what they call, across MPI processes: every rank gets qcoll::Error naming
// what differs and which ranks differ, no rank hangs, nothing is sent, and the next agreed call
// works. Also with MPI_ERRORS_RETURN on the communicator (where a mismatched MPI call would hang
// or truncate instead of aborting).
#include "../common/mpi_main.hpp"

#include <string>

#include <qcoll/collective/all_gather.hpp>
#include <qcoll/collective/hpz.hpp>
#include <qcoll/collective/reduce_scatter.hpp>

#include "../common/collective_harness.hpp"

#include "../common/error_of.hpp"

using namespace qcoll;
using namespace harness;

namespace {

using mpi_main::world_rank;
using mpi_main::world_size;

using AG = QuantizedAllGather<float, Int8<32>, MpiTransport>;
using RS = QuantizedReduceScatter<float, Int4<32>, Int4<32>, MpiTransport>;

// Two nodes, ranks placed round-robin (not node-major).
std::vector<long long> round_robin_ids(int W) {
  std::vector<long long> ids(W);
  for (int r = 0; r < W; ++r) ids[r] = r % 2;
  return ids;
}

using testing_support::error_of;

// A duplicate of MPI_COMM_WORLD with the given error handler (freed by the destructor).
struct Comm {
  MPI_Comm comm = MPI_COMM_NULL;
  explicit Comm(MPI_Errhandler handler) {
    MPI_Comm_dup(MPI_COMM_WORLD, &comm);
    MPI_Comm_set_errhandler(comm, handler);
  }
  ~Comm() { MPI_Comm_free(&comm); }
};

// One agreed all-gather over `t`: the plans still work after a disagreement was reported.
void check_next_call_works(MpiTransport& t, const ShardLayout& layout) {
  AG ag(t, layout);
  Workspace ws(ag.workspace_bytes());
  std::vector<float> shard(layout.shard_numel(), static_cast<float>(t.rank())), full(layout.padded_numel());
  CHECK(ag(shard.data(), full.data(), ws.ptr, ws.bytes) == 0u);
  CHECK(full[layout.shard_offset(t.size() - 1)] == static_cast<float>(t.size() - 1));
}

}  // namespace

TEST_CASE("disagreements over MPI raise qcoll::Error on every rank, with either error handler") {
  const int W = world_size(), me = world_rank();
  REQUIRE(W >= 4);
  const auto ids = round_robin_ids(W);
  const ShardLayout a(1000, W, granule_for(4, {32})), b(999, W, granule_for(4, {32}));
  for (MPI_Errhandler handler : {MPI_ERRORS_ARE_FATAL, MPI_ERRORS_RETURN}) {
    Comm c(handler);
    MpiTransport t(c.comm, ids);
    const Topology topo = Topology::from_node_ids(ids, me);
    AG pa(t, a), pb(t, b);
    RS rs(t, topo, a, Reduce::mean, Hops::two);
    Workspace ws(std::max(pa.workspace_bytes(), rs.workspace_bytes()));
    std::vector<float> grad(a.padded_numel(), 1.0f), full(a.padded_numel(), 5.0f),
        shard(a.shard_numel(), 1.0f);

    // Rank 1 calls the two-hop reduce-scatter while its peers call an all-gather.
    std::string e = error_of([&] {
      if (me == 1)
        rs(grad.data(), shard.data(), ws.ptr, ws.bytes);
      else
        pa(shard.data(), full.data(), ws.ptr, ws.bytes);
    });
    CHECK_MESSAGE(has(e, "kind: all-gather (ranks 0,2,3) vs reduce-scatter (rank 1)"), e);
    CHECK(full[0] == 5.0f);

    // Rank 2 calls a plan whose messages have the same size (numel 999 vs 1000).
    e = error_of([&] { (me == 2 ? pb : pa)(shard.data(), full.data(), ws.ptr, ws.bytes); });
    CHECK_MESSAGE(has(e, "numel: 1000 (ranks 0,1,3) vs 999 (rank 2)"), e);

    // Rank 3 builds its plans with another (valid) node table, or another numel.
    e = error_of([&] {
      const Topology other = me == 3 ? Topology::node_major(W, W / 2, me) : Topology::from_node_ids(ids, me);
      SecondaryShard<float, Identity<float, 32>, MpiTransport> hpz(t, other, a);
    });
    CHECK_MESSAGE(has(e, "node table: #"), e);
    e = error_of([&] { RS other(t, topo, me == 3 ? b : a, Reduce::mean); });
    CHECK_MESSAGE(has(e, "numel: 1000 (ranks 0,1,2) vs 999 (rank 3)"), e);

    check_next_call_works(t, a);
  }
}
