// qcoll-mpi-ranks: 2 3 4 6 8
// Tests of the MPI transport (include/qcoll/transport/mpi.hpp), run under mpiexec -n K. Every
// rank runs every test case in the same order; checks never stop a test case early (CHECK, not
// REQUIRE) so all ranks keep calling the same collectives. Only rank 0 prints doctest's report;
// another rank prints its own only if it saw a failure. The exit code is non-zero on every rank
// if any rank failed.

#include <qcoll/transport/mpi.hpp>

#include "../common/mpi_main.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using qcoll::MpiTransport;
using qcoll::ReduceOp;

using mpi_main::world_rank;
using mpi_main::world_size;

//! Position-dependent part of the test pattern: base[i] = 13 i + floor(i / 512) + 1 (mod 256).
unsigned char pattern_base(std::size_t i) {
  return static_cast<unsigned char>((i * 13u + (i >> 9) + 1u) & 0xffu);
}

//! Sender/receiver-dependent offset: 151 src + 37 dst (mod 256); both factors are odd, so blocks
//! of different senders (or for different receivers) differ in every byte.
unsigned char pattern_offset(int src, int dst) {
  return static_cast<unsigned char>((static_cast<unsigned>(src) * 151u + static_cast<unsigned>(dst) * 37u) &
                                    0xffu);
}

//! Writes the block that rank `src` sends to rank `dst` (dst = 0 for all_gather).
void fill_block(unsigned char* p, std::size_t n, int src, int dst) {
  const unsigned char off = pattern_offset(src, dst);
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<unsigned char>(pattern_base(i) + off);
}

//! Number of bytes of p[0, n) that differ from the block `src` sends to `dst`.
long long count_wrong(const unsigned char* p, std::size_t n, int src, int dst) {
  const unsigned char off = pattern_offset(src, dst);
  long long bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += p[i] != static_cast<unsigned char>(pattern_base(i) + off);
  return bad;
}

//! all_gather (out of place and in place) and all_to_all of b bytes per rank; returns the number
//! of wrong bytes this rank received.
long long exchange_and_count(MpiTransport& t, std::size_t b) {
  const int me = t.rank();
  const std::size_t w = static_cast<std::size_t>(t.size());
  long long bad = 0;
  std::vector<unsigned char> send(b), recv(w * b, 0xEE), a2a(w * b);
  fill_block(send.data(), b, me, 0);
  t.all_gather(send.data(), recv.data(), b);
  for (std::size_t r = 0; r < w; ++r) bad += count_wrong(recv.data() + r * b, b, static_cast<int>(r), 0);

  std::fill(recv.begin(), recv.end(), 0xEE);
  fill_block(recv.data() + static_cast<std::size_t>(me) * b, b, me, 0);
  t.all_gather(recv.data() + static_cast<std::size_t>(me) * b, recv.data(), b);
  for (std::size_t r = 0; r < w; ++r) bad += count_wrong(recv.data() + r * b, b, static_cast<int>(r), 0);

  std::fill(recv.begin(), recv.end(), 0xEE);
  for (std::size_t d = 0; d < w; ++d) fill_block(a2a.data() + d * b, b, me, static_cast<int>(d));
  t.all_to_all(a2a.data(), recv.data(), b);
  for (std::size_t s = 0; s < w; ++s) bad += count_wrong(recv.data() + s * b, b, static_cast<int>(s), me);
  return bad;
}

//! Sets detail::mpi_max_count for one scope, so that small buffers take the large-message path.
class MaxCountScope {
 public:
  explicit MaxCountScope(std::size_t n) : saved_(qcoll::detail::mpi_max_count) {
    qcoll::detail::mpi_max_count = n;
  }
  ~MaxCountScope() { qcoll::detail::mpi_max_count = saved_; }
  MaxCountScope(const MaxCountScope&) = delete;
  MaxCountScope& operator=(const MaxCountScope&) = delete;

 private:
  std::size_t saved_;
};

//! Checks all_reduce for every op against a plain loop over the values every rank contributes.
long long check_all_reduce(MpiTransport& t, std::size_t n) {
  auto value = [](int r, std::size_t k) -> std::uint64_t {
    // near the top of the range so that sum wraps modulo 2^64
    return ~std::uint64_t{0} -
           static_cast<std::uint64_t>((r * 7919 + static_cast<long long>(k) * 104729) % 100003) -
           (static_cast<std::uint64_t>(r % 3) << 62);
  };
  long long bad = 0;
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::min, ReduceOp::max, ReduceOp::bit_or}) {
    std::vector<std::uint64_t> data(n);
    for (std::size_t k = 0; k < n; ++k) data[k] = value(t.rank(), k);
    t.all_reduce(data.data(), n, op);
    for (std::size_t k = 0; k < n; ++k) {
      std::uint64_t ref = value(0, k);
      for (int r = 1; r < t.size(); ++r) {
        const std::uint64_t v = value(r, k);
        if (op == ReduceOp::sum) ref += v;
        if (op == ReduceOp::min && v < ref) ref = v;
        if (op == ReduceOp::max && v > ref) ref = v;
        if (op == ReduceOp::bit_or) ref |= v;
      }
      bad += data[k] != ref;
    }
  }
  return bad;
}

}  // namespace

TEST_CASE("mpi: all_gather, all_to_all and all_reduce move exactly the right bytes") {
  MpiTransport t(MPI_COMM_WORLD);
  CHECK(t.size() == world_size());
  CHECK(t.rank() == world_rank());
  for (std::size_t b :
       {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4096}, std::size_t{1} << 20}) {
    CAPTURE(b);
    CHECK(exchange_and_count(t, b) == 0);
  }
  CHECK(check_all_reduce(t, 5) == 0);
  t.all_reduce(nullptr, 0, ReduceOp::max);
  t.all_gather(nullptr, nullptr, 0);
  t.all_to_all(nullptr, nullptr, 0);
  t.barrier();
  CHECK(t.counters().calls == 5 * 3 + 2);
}

TEST_CASE("mpi: messages above the int count limit use derived datatypes and chunks") {
  // With the per-call count limit lowered to 1000, every size below exercises one branch of the
  // large-message path: 1001 = 1 chunk + 1, 4103 = 4 chunks + 103, 1000000 = 1000 chunks exactly,
  // 200003 = 200 chunks + 3. all_reduce of 2500 words runs as 3 calls (1000, 1000, 500).
  MpiTransport t(MPI_COMM_WORLD);
  MaxCountScope limit(1000);
  for (std::size_t b :
       {std::size_t{1000}, std::size_t{1001}, std::size_t{4103}, std::size_t{1000000}, std::size_t{200003}}) {
    CAPTURE(b);
    CHECK(exchange_and_count(t, b) == 0);
  }
  CHECK(check_all_reduce(t, 2500) == 0);
  // beyond max_count^2 bytes (1001000 = 1001 chunks) the type cannot be built: a clear error
  CHECK_THROWS_WITH_AS(qcoll::detail::MpiBytes(1001000, 1000), doctest::Contains("bytes_per_rank"),
                       qcoll::Error);
}

TEST_CASE("mpi: sizes above 2^31 bytes" * doctest::skip()) {
  // Needs about 9 GiB of memory with 2 ranks; run with --no-skip under mpiexec -n 2.
  MpiTransport t(MPI_COMM_WORLD);
  if (t.size() == 2) {
    const std::size_t b = (std::size_t{1} << 31) + 5;
    const std::size_t me = static_cast<std::size_t>(t.rank());
    std::vector<unsigned char> full(2 * b, 0);
    full[me * b] = static_cast<unsigned char>(10 + me);
    full[me * b + b / 2] = static_cast<unsigned char>(30 + me);
    full[me * b + b - 1] = static_cast<unsigned char>(20 + me);
    t.all_gather(full.data() + me * b, full.data(), b);
    for (std::size_t r = 0; r < 2; ++r) {
      CHECK(full[r * b] == 10 + r);
      CHECK(full[r * b + b / 2] == 30 + r);
      CHECK(full[r * b + b - 1] == 20 + r);
    }
  }
}

TEST_CASE("mpi: discover_node_ids on one machine puts every rank on node 0") {
  // All processes of this test share one machine, so they form one shared-memory group whose
  // lowest rank is 0.
  const std::vector<long long> ids = MpiTransport::discover_node_ids(MPI_COMM_WORLD);
  CHECK(ids == std::vector<long long>(static_cast<std::size_t>(world_size()), 0));
  MpiTransport t(MPI_COMM_WORLD);
  for (int r = 0; r < t.size(); ++r) CHECK(t.node_of(r) == 0);
  std::vector<unsigned char> buf(static_cast<std::size_t>(t.size()) * 10);
  t.all_gather(buf.data() + t.rank() * 10, buf.data(), 10);
  CHECK(t.counters().intra_node == 10u * static_cast<unsigned>(t.size() - 1));
  CHECK(t.counters().inter_node == 0);
  // on a sub-communicator the ids are the sub-communicator's own ranks: reversed order, still
  // one machine, so again all 0
  MPI_Comm reversed;
  MPI_Comm_split(MPI_COMM_WORLD, 0, -world_rank(), &reversed);
  CHECK(MpiTransport::discover_node_ids(reversed) ==
        std::vector<long long>(static_cast<std::size_t>(world_size()), 0));
  MPI_Comm_free(&reversed);
  // discover_topology: one node holding every rank, local index = rank.
  const qcoll::Topology topo = qcoll::discover_topology(MPI_COMM_WORLD);
  CHECK(topo.num_nodes() == 1);
  CHECK(topo.ranks_per_node() == world_size());
  CHECK(topo.local_index() == world_rank());
}

TEST_CASE("mpi: byte counters follow an explicit node table (ids r % 2)") {
  const int k = world_size();
  std::vector<long long> table(static_cast<std::size_t>(k));
  for (int r = 0; r < k; ++r) table[static_cast<std::size_t>(r)] = r % 2;
  MpiTransport t(MPI_COMM_WORLD, table);
  const int me = t.rank();
  // ranks on node 0: the ceil(k/2) even ranks; on node 1: the floor(k/2) odd ones. Same-node
  // peers exclude the rank itself.
  const std::uint64_t intra_peers = static_cast<std::uint64_t>(me % 2 == 0 ? (k + 1) / 2 - 1 : k / 2 - 1);
  const std::uint64_t inter_peers = static_cast<std::uint64_t>(k - 1) - intra_peers;
  std::vector<unsigned char> send(static_cast<std::size_t>(k) * 100), recv(static_cast<std::size_t>(k) * 100);
  t.all_gather(send.data(), recv.data(), 100);
  CHECK(t.counters().intra_node == 100 * intra_peers);
  CHECK(t.counters().inter_node == 100 * inter_peers);
  t.all_to_all(send.data(), recv.data(), 7);
  CHECK(t.counters().intra_node == 107 * intra_peers);
  CHECK(t.counters().inter_node == 107 * inter_peers);
  CHECK(t.counters().calls == 2);
  std::uint64_t flag = 1;
  t.all_reduce(&flag, 1, ReduceOp::sum);
  t.barrier();
  CHECK(t.counters().calls == 2);
  CHECK(flag == static_cast<std::uint64_t>(k));
  t.reset_counters();
  CHECK(t.counters().total() == 0);
  // the sub-group of even ranks is all on node 0: only intra-node traffic
  MpiTransport parity = t.split(me % 2, me);
  parity.all_gather(send.data(), recv.data(), 3);
  CHECK(parity.counters().intra_node == 3u * static_cast<unsigned>(parity.size() - 1));
  CHECK(parity.counters().inter_node == 0);
  for (int i = 0; i < parity.size(); ++i) CHECK(parity.node_of(i) == me % 2);
  // the sub-group {2j, 2j+1} spans both nodes: one peer, on the other node
  MpiTransport pair = t.split(me / 2, me);
  pair.all_gather(send.data(), recv.data(), 3);
  CHECK(pair.counters().intra_node == 0);
  CHECK(pair.counters().inter_node == 3u * static_cast<unsigned>(pair.size() - 1));
}

TEST_CASE("mpi: split into node-like and stride-like sub-groups") {
  const int k = world_size(), me = world_rank(), L = 2;
  std::vector<long long> table(static_cast<std::size_t>(k));
  for (int r = 0; r < k; ++r) table[static_cast<std::size_t>(r)] = 100 + (r * 5) % 3;  // any placement
  MpiTransport t(MPI_COMM_WORLD, table);
  // sub-group rank i must be world rank members[i]: checked through all_gather of world ranks,
  // node_of, an all_to_all addressed by sub-group rank, and a full data exchange
  auto check_sub = [&](MpiTransport& sub, const std::vector<int>& members) {
    const int n = static_cast<int>(members.size());
    CHECK(sub.size() == n);
    CHECK(sub.rank() == static_cast<int>(std::find(members.begin(), members.end(), me) - members.begin()));
    std::vector<int> got(static_cast<std::size_t>(n), -1);
    sub.all_gather(&me, got.data(), sizeof(int));
    CHECK(got == members);
    for (int i = 0; i < n; ++i)
      CHECK(sub.node_of(i) == table[static_cast<std::size_t>(members[static_cast<std::size_t>(i)])]);
    std::vector<int> out(static_cast<std::size_t>(n)), in(static_cast<std::size_t>(n), -1);
    for (int i = 0; i < n; ++i)
      out[static_cast<std::size_t>(i)] = me * 1000 + members[static_cast<std::size_t>(i)];
    sub.all_to_all(out.data(), in.data(), sizeof(int));
    for (int i = 0; i < n; ++i)
      CHECK(in[static_cast<std::size_t>(i)] == members[static_cast<std::size_t>(i)] * 1000 + me);
    CHECK(exchange_and_count(sub, 4096 + 3) == 0);
  };
  {
    MpiTransport node = t.split(me / L, me);
    std::vector<int> members;
    for (int r = (me / L) * L; r < std::min(k, (me / L + 1) * L); ++r) members.push_back(r);
    check_sub(node, members);
  }
  {
    MpiTransport stride = t.split(me % L, me);
    std::vector<int> members;
    for (int r = me % L; r < k; r += L) members.push_back(r);
    check_sub(stride, members);
    // nested split: the first two members of each stride group, and the rest
    MpiTransport nested = stride.split(stride.rank() < 2 ? 0 : 1, 0);
    std::vector<int> nested_members;
    for (int i = 0; i < static_cast<int>(members.size()); ++i)
      if ((i < 2) == (stride.rank() < 2)) nested_members.push_back(members[static_cast<std::size_t>(i)]);
    check_sub(nested, nested_members);
  }
  {
    MpiTransport reversed = t.split(0, -me);
    std::vector<int> members;
    for (int r = k - 1; r >= 0; --r) members.push_back(r);
    check_sub(reversed, members);
  }
  // moving keeps the communicator; the moved-from transport holds none
  MpiTransport a = t.split(0, me);
  const MPI_Comm c = a.comm();
  MpiTransport b = std::move(a);
  CHECK(b.comm() == c);
  CHECK(a.comm() == MPI_COMM_NULL);  // NOLINT(bugprone-use-after-move): documented state
  MpiTransport d = t.split(1, me);
  d = std::move(b);  // frees d's own communicator, takes b's
  CHECK(d.comm() == c);
  CHECK(exchange_and_count(d, 5) == 0);
}

TEST_CASE("mpi: error handlers: qcoll's communicators return errors, the user's is left alone") {
  MPI_Comm user;
  MPI_Comm_dup(MPI_COMM_WORLD, &user);  // default handler MPI_ERRORS_ARE_FATAL
  {
    MpiTransport t(user);
    MPI_Errhandler h;
    MPI_Comm_get_errhandler(user, &h);
    CHECK(h == MPI_ERRORS_ARE_FATAL);
    MPI_Errhandler_free(&h);

    MpiTransport sub = t.split(0, 0);
    MPI_Comm_get_errhandler(sub.comm(), &h);
    CHECK(h == MPI_ERRORS_RETURN);
    MPI_Errhandler_free(&h);

    // An invalid call on the qcoll-created communicator returns an error code instead of
    // aborting, and mpi_check turns it into qcoll::Error with the call's name and MPI's text.
    int value = 0;
    const int rc = MPI_Bcast(&value, 1, MPI_INT, /*root=*/sub.size() + 3, sub.comm());
    CHECK(rc != MPI_SUCCESS);
    char text[MPI_MAX_ERROR_STRING] = {};
    int len = 0;
    MPI_Error_string(rc, text, &len);
    CHECK(len > 0);
    CHECK_THROWS_WITH_AS(qcoll::detail::mpi_check(rc, "MPI_Bcast"), doctest::Contains("MPI_Bcast"),
                         qcoll::Error);
    CHECK_THROWS_WITH_AS(qcoll::detail::mpi_check(rc, "MPI_Bcast"),
                         doctest::Contains(std::string(text, len).c_str()), qcoll::Error);
    CHECK_NOTHROW(qcoll::detail::mpi_check(MPI_SUCCESS, "MPI_Bcast"));
    sub.barrier();  // the communicator is still usable
  }
  MPI_Comm_free(&user);
}

TEST_CASE("mpi: bad arguments are rejected with the argument's name, before anything is sent") {
  MpiTransport t(MPI_COMM_WORLD);
  const std::size_t w = static_cast<std::size_t>(t.size());
  std::vector<unsigned char> a(64 * w, 1), b(64 * w, 2);
  // every rank passes the same bad argument, so every rank throws before calling MPI
  CHECK_THROWS_WITH_AS(t.all_gather(nullptr, b.data(), 8), doctest::Contains("'send'"), qcoll::Error);
  CHECK_THROWS_WITH_AS(t.all_gather(a.data(), nullptr, 8), doctest::Contains("'recv'"), qcoll::Error);
  CHECK_THROWS_WITH_AS(t.all_gather(a.data() + 1, a.data(), 8), doctest::Contains("'send'"), qcoll::Error);
  CHECK_THROWS_WITH_AS(t.all_to_all(nullptr, b.data(), 8), doctest::Contains("'send'"), qcoll::Error);
  CHECK_THROWS_WITH_AS(t.all_to_all(a.data(), nullptr, 8), doctest::Contains("'recv'"), qcoll::Error);
  CHECK_THROWS_WITH_AS(t.all_to_all(a.data(), a.data() + 8, 8), doctest::Contains("overlaps"), qcoll::Error);
  CHECK_THROWS_WITH_AS(t.all_gather(a.data(), b.data(), SIZE_MAX / 2 + 1),
                       doctest::Contains("'bytes_per_rank'"), qcoll::Error);
  CHECK_THROWS_WITH_AS(t.all_reduce(nullptr, 3, ReduceOp::sum), doctest::Contains("'data'"), qcoll::Error);
  std::uint64_t x = 0;
  CHECK_THROWS_WITH_AS(t.all_reduce(&x, 1, static_cast<ReduceOp>(7)), doctest::Contains("'op'"),
                       qcoll::Error);
  CHECK_THROWS_WITH_AS((void)t.node_of(t.size()), doctest::Contains("'peer'"), qcoll::Error);
  CHECK_THROWS_WITH_AS(t.split(-2, 0), doctest::Contains("'color'"), qcoll::Error);
  CHECK_THROWS_WITH_AS(MpiTransport(MPI_COMM_WORLD, {0}), doctest::Contains("'node_id_of_rank.size()'"),
                       qcoll::Error);
  CHECK_THROWS_WITH_AS(MpiTransport(MPI_COMM_NULL), doctest::Contains("'comm'"), qcoll::Error);
  CHECK_THROWS_WITH_AS(MpiTransport::discover_node_ids(MPI_COMM_NULL), doctest::Contains("'comm'"),
                       qcoll::Error);
  CHECK(a == std::vector<unsigned char>(64 * w, 1));
  CHECK(b == std::vector<unsigned char>(64 * w, 2));
  CHECK(t.counters().calls == 0);
  // still usable afterwards
  CHECK(exchange_and_count(t, 64) == 0);
}
