// Tests of the in-process transport (include/qcoll/transport/local.hpp): data movement of every
// collective against a pattern each receiver can recompute, sub-groups, byte counters, argument
// checks, and the fault path (a failing rank never leaves its peers hanging).

#include <doctest/doctest.h>

#include "../common/watchdog.hpp"

#include <qcoll/transport/local.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using qcoll::LocalGroup;
using qcoll::LocalTransport;
using qcoll::ReduceOp;

//! A hang in a collective fails the test loudly (default limit 120 s, generous for a loaded CI).
struct Watchdog : testing_support::Watchdog {
  explicit Watchdog(int seconds = 120) : testing_support::Watchdog(seconds, "test_transport_local") {}
};

const std::size_t kSizes[] = {0, 1, 7, 4096, std::size_t{1} << 20};

//! Position-dependent part of the test pattern: base[i] = 13 i + floor(i / 512) + 1 (mod 256).
const std::vector<unsigned char>& pattern_base() {
  static const std::vector<unsigned char> base = [] {
    std::vector<unsigned char> v(std::size_t{1} << 20);
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = static_cast<unsigned char>((i * 13u + (i >> 9) + 1u) & 0xffu);
    return v;
  }();
  return base;
}

//! Sender/receiver-dependent offset: 151 src + 37 dst (mod 256). 151 and 37 are odd, hence
//! invertible mod 256, so blocks from different senders (or for different receivers) of one
//! world up to 256 ranks differ in every byte, and a shifted copy differs from base.
unsigned char pattern_offset(int src, int dst) {
  return static_cast<unsigned char>((static_cast<unsigned>(src) * 151u + static_cast<unsigned>(dst) * 37u) &
                                    0xffu);
}

//! Writes the block that rank `src` sends to rank `dst` (dst = 0 for all_gather).
void fill_block(unsigned char* p, std::size_t n, int src, int dst) {
  const unsigned char* base = pattern_base().data();
  const unsigned char off = pattern_offset(src, dst);
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<unsigned char>(base[i] + off);
}

//! Number of bytes of p[0, n) that differ from the block `src` sends to `dst`.
long long count_wrong(const unsigned char* p, std::size_t n, int src, int dst) {
  const unsigned char* base = pattern_base().data();
  const unsigned char off = pattern_offset(src, dst);
  long long bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += p[i] != static_cast<unsigned char>(base[i] + off);
  return bad;
}

//! Runs every data collective for one world size; returns the number of wrong bytes/words seen by
//! all ranks together.
long long exercise_world(int world, std::size_t max_bytes) {
  LocalGroup group(world);
  std::vector<long long> wrong(static_cast<std::size_t>(world), 0);
  (void)pattern_base();  // build the shared table before the threads read it
  group.run([&](LocalTransport& t) {
    const int me = t.rank();
    long long& bad = wrong[static_cast<std::size_t>(me)];
    if (t.size() != world) ++bad;
    const std::size_t w = static_cast<std::size_t>(world);
    // buffers sized for the largest call, reused (and re-poisoned) for every size
    std::vector<unsigned char> send(max_bytes), recv(w * max_bytes), a2a_send(w * max_bytes);
    for (std::size_t b : kSizes) {
      if (b > max_bytes) continue;
      // out-of-place all_gather
      std::fill(recv.begin(), recv.begin() + static_cast<std::ptrdiff_t>(w * b), 0xEE);
      fill_block(send.data(), b, me, 0);
      t.all_gather(send.data(), recv.data(), b);
      for (std::size_t r = 0; r < w; ++r) bad += count_wrong(recv.data() + r * b, b, static_cast<int>(r), 0);
      // in-place all_gather: own block already in recv, others' regions hold garbage
      std::fill(recv.begin(), recv.begin() + static_cast<std::ptrdiff_t>(w * b), 0xEE);
      fill_block(recv.data() + static_cast<std::size_t>(me) * b, b, me, 0);
      t.all_gather(recv.data() + static_cast<std::size_t>(me) * b, recv.data(), b);
      for (std::size_t r = 0; r < w; ++r) bad += count_wrong(recv.data() + r * b, b, static_cast<int>(r), 0);
      // all_to_all
      std::fill(recv.begin(), recv.begin() + static_cast<std::ptrdiff_t>(w * b), 0xEE);
      for (std::size_t d = 0; d < w; ++d) fill_block(a2a_send.data() + d * b, b, me, static_cast<int>(d));
      t.all_to_all(a2a_send.data(), recv.data(), b);
      for (std::size_t s = 0; s < w; ++s) bad += count_wrong(recv.data() + s * b, b, static_cast<int>(s), me);
    }
    // all_reduce: each op against a plain loop over the values every rank contributes.
    const std::size_t n = 5;
    auto value = [](int r, std::size_t k) -> std::uint64_t {
      // near the top of the range so that sum wraps modulo 2^64 for larger worlds
      return ~std::uint64_t{0} -
             static_cast<std::uint64_t>((r * 7919 + static_cast<int>(k) * 104729) % 100003) -
             (static_cast<std::uint64_t>(r % 3) << 62);
    };
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::min, ReduceOp::max, ReduceOp::bit_or}) {
      std::vector<std::uint64_t> data(n);
      for (std::size_t k = 0; k < n; ++k) data[k] = value(me, k);
      t.all_reduce(data.data(), n, op);
      for (std::size_t k = 0; k < n; ++k) {
        std::uint64_t ref = value(0, k);
        for (int r = 1; r < world; ++r) {
          const std::uint64_t v = value(r, k);
          if (op == ReduceOp::sum) ref += v;
          if (op == ReduceOp::min && v < ref) ref = v;
          if (op == ReduceOp::max && v > ref) ref = v;
          if (op == ReduceOp::bit_or) ref |= v;
        }
        bad += data[k] != ref;
      }
    }
    t.all_reduce(nullptr, 0, ReduceOp::sum);  // zero words is a valid collective
    t.barrier();
  });
  long long total = 0;
  for (long long x : wrong) total += x;
  return total;
}

}  // namespace

TEST_CASE("local: all_gather, all_to_all and all_reduce move exactly the right bytes (worlds 1..16)") {
  Watchdog dog;
  // 1 MiB blocks cost world^2 MiB of copies per collective; they run for a spread of worlds, the
  // others stop at 4096 bytes (same code path, smaller loops). ThreadSanitizer checks every byte
  // copied (about 30x slower), so its build uses 64 KiB blocks.
#if defined(__SANITIZE_THREAD__)
  const std::size_t big_bytes = std::size_t{1} << 16;
#else
  const std::size_t big_bytes = std::size_t{1} << 20;
#endif
  for (int world = 1; world <= 16; ++world) {
    CAPTURE(world);
    const bool big = world <= 5 || world == 8 || world == 13 || world == 16;
    CHECK(exercise_world(world, big ? big_bytes : 4096) == 0);
  }
}

TEST_CASE("local: 64 ranks") {
  Watchdog dog;
  // 64 ranks x 64 blocks of 1 MiB would need 4 GiB per collective; 4096 bytes covers the same code.
  CHECK(exercise_world(64, 4096) == 0);
}

TEST_CASE("local: 256 ranks gather and split") {
  Watchdog dog;
  const int world = 256;
  LocalGroup group(world);
  std::vector<int> wrong(world, 0);
  group.run([&](LocalTransport& t) {
    std::vector<int> all(world, -1);
    const int me = t.rank();
    t.all_gather(&me, all.data(), sizeof(int));
    for (int r = 0; r < world; ++r)
      wrong[static_cast<std::size_t>(me)] += all[static_cast<std::size_t>(r)] != r;
    LocalTransport sub = t.split(me % 16, me);
    wrong[static_cast<std::size_t>(me)] += sub.size() != 16 || sub.rank() != me / 16;
  });
  for (int r = 0; r < world; ++r) CHECK(wrong[static_cast<std::size_t>(r)] == 0);
}

TEST_CASE("local: zero bytes with null buffers is a valid collective") {
  Watchdog dog;
  LocalGroup group(4);
  std::atomic<int> done{0};
  group.run([&](LocalTransport& t) {
    t.all_gather(nullptr, nullptr, 0);
    t.all_to_all(nullptr, nullptr, 0);
    CHECK(t.counters().calls == 2);
    CHECK(t.counters().total() == 0);
    ++done;
  });
  CHECK(done.load() == 4);
}

TEST_CASE("local: split into node-like and stride-like sub-groups") {
  Watchdog dog;
  // 12 ranks, L = 4: color r / 4 gives 3 groups of 4 consecutive ranks, color r % 4 gives 4
  // groups of 3 ranks with stride 4. Node ids are an arbitrary non-node-major table; a sub-group
  // must report the ids of its members' original ranks.
  const int world = 12, L = 4;
  const std::vector<long long> nodes = {5, 2, 5, 9, 2, 2, 9, 5, 9, 2, 5, 9};
  LocalGroup group(world, nodes);
  std::vector<long long> wrong(world, 0);
  group.run([&](LocalTransport& t) {
    const int me = t.rank();
    long long& bad = wrong[static_cast<std::size_t>(me)];
    // check that sub-group rank i is world rank members[i] via an all_gather of world ranks,
    // node_of, and an all_to_all addressed by sub-group rank.
    auto check_sub = [&](LocalTransport& sub, const std::vector<int>& members) {
      const int n = static_cast<int>(members.size());
      bad += sub.size() != n;
      int pos = -1;
      for (int i = 0; i < n; ++i)
        if (members[static_cast<std::size_t>(i)] == me) pos = i;
      bad += sub.rank() != pos;
      std::vector<int> got(static_cast<std::size_t>(n), -1);
      sub.all_gather(&me, got.data(), sizeof(int));
      bad += got != members;
      for (int i = 0; i < n; ++i)
        bad += sub.node_of(i) != nodes[static_cast<std::size_t>(members[static_cast<std::size_t>(i)])];
      std::vector<int> out(static_cast<std::size_t>(n)), in(static_cast<std::size_t>(n), -1);
      for (int i = 0; i < n; ++i)
        out[static_cast<std::size_t>(i)] = me * 1000 + members[static_cast<std::size_t>(i)];
      sub.all_to_all(out.data(), in.data(), sizeof(int));
      for (int i = 0; i < n; ++i)
        bad += in[static_cast<std::size_t>(i)] != members[static_cast<std::size_t>(i)] * 1000 + me;
    };
    {
      LocalTransport node = t.split(me / L, me);
      std::vector<int> members;
      for (int r = (me / L) * L; r < (me / L + 1) * L; ++r) members.push_back(r);
      check_sub(node, members);
    }
    {
      LocalTransport stride = t.split(me % L, me);
      std::vector<int> members;
      for (int r = me % L; r < world; r += L) members.push_back(r);
      check_sub(stride, members);
      // nested split of a sub-group: the first two members of each stride group
      LocalTransport nested = stride.split(stride.rank() < 2 ? 0 : 1, 0);
      std::vector<int> nested_members;
      for (int i = 0; i < static_cast<int>(members.size()); ++i)
        if ((i < 2) == (stride.rank() < 2)) nested_members.push_back(members[static_cast<std::size_t>(i)]);
      check_sub(nested, nested_members);
    }
    {
      // key reverses the order; equal keys fall back to rank order
      LocalTransport rev = t.split(me % L, -me);
      std::vector<int> members;
      for (int r = world - L + me % L; r >= 0; r -= L) members.push_back(r);
      check_sub(rev, members);
      LocalTransport tied = t.split(0, me % 2);  // evens (key 0) first, then odds, each ascending
      std::vector<int> tied_members;
      for (int r = 0; r < world; r += 2) tied_members.push_back(r);
      for (int r = 1; r < world; r += 2) tied_members.push_back(r);
      check_sub(tied, tied_members);
    }
    // the parent still works after its sub-groups are gone
    std::vector<int> all(world, -1);
    t.all_gather(&me, all.data(), sizeof(int));
    for (int r = 0; r < world; ++r) bad += all[static_cast<std::size_t>(r)] != r;
  });
  for (int r = 0; r < world; ++r) CHECK(wrong[static_cast<std::size_t>(r)] == 0);
}

TEST_CASE("local: byte counters split intra- and inter-node volume by the node table") {
  Watchdog dog;
  SUBCASE("2 nodes x 4 ranks, not node-major") {
    // node 0 = ranks {0, 3, 4, 6}, node 1 = ranks {1, 2, 5, 7}: every rank has 3 peers on its
    // node and 4 elsewhere. all_gather of 100 B: 300 intra, 400 inter; all_to_all of 10 B per
    // peer: +30 intra, +40 inter.
    LocalGroup group(8, {0, 1, 1, 0, 0, 1, 0, 1});
    std::vector<long long> wrong(8, 0);
    group.run([&](LocalTransport& t) {
      long long& bad = wrong[static_cast<std::size_t>(t.rank())];
      std::vector<unsigned char> send(8 * 100), recv(8 * 100);
      t.all_gather(send.data(), recv.data(), 100);
      bad += t.counters().intra_node != 300 || t.counters().inter_node != 400 || t.counters().calls != 1;
      t.all_to_all(send.data(), recv.data(), 10);
      bad += t.counters().intra_node != 330 || t.counters().inter_node != 440 || t.counters().calls != 2;
      bad += t.counters().total() != 770;
      // control traffic is not counted
      std::uint64_t flag = 1;
      t.all_reduce(&flag, 1, ReduceOp::bit_or);
      t.barrier();
      bad += t.counters().total() != 770 || t.counters().calls != 2;
      // in-place all_gather counts the same as out-of-place
      t.all_gather(recv.data() + static_cast<std::size_t>(t.rank()) * 50, recv.data(), 50);
      bad += t.counters().intra_node != 480 || t.counters().inter_node != 640 || t.counters().calls != 3;
      t.reset_counters();
      bad += t.counters().total() != 0 || t.counters().calls != 0;
      // sub-group split by parity: evens {0, 2, 4, 6} on nodes {0, 1, 0, 0}, odds {1, 3, 5, 7} on
      // nodes {1, 0, 1, 1}. Same-node peers: ranks 0, 4, 6, 1, 5, 7 have 2 (1 elsewhere); ranks 2
      // and 3 have 0 (3 elsewhere). all_gather of 8 B.
      LocalTransport half = t.split(t.rank() % 2, t.rank());
      half.all_gather(send.data(), recv.data(), 8);
      const bool lonely = t.rank() == 2 || t.rank() == 3;
      bad += half.counters().intra_node != (lonely ? 0u : 16u);
      bad += half.counters().inter_node != (lonely ? 24u : 8u);
      bad += t.counters().total() != 0;  // the parent's counters are separate
    });
    for (int r = 0; r < 8; ++r) CHECK(wrong[static_cast<std::size_t>(r)] == 0);
  }
  SUBCASE("uneven nodes") {
    // node 7 = {0, 1, 3}, node 3 = {2, 4}, node 9 = {5}: same-node peers 2, 2, 1, 2, 1, 0 and
    // other-node peers 5 minus that. all_to_all of 1000 B per peer.
    const std::vector<std::uint64_t> intra_peers = {2, 2, 1, 2, 1, 0};
    LocalGroup group(6, {7, 7, 3, 7, 3, 9});
    std::vector<long long> wrong(6, 0);
    group.run([&](LocalTransport& t) {
      const std::size_t r = static_cast<std::size_t>(t.rank());
      std::vector<unsigned char> send(6 * 1000), recv(6 * 1000);
      t.all_to_all(send.data(), recv.data(), 1000);
      wrong[r] += t.counters().intra_node != 1000 * intra_peers[r];
      wrong[r] += t.counters().inter_node != 1000 * (5 - intra_peers[r]);
      wrong[r] += t.node_of(5) != 9 || t.node_of(2) != 3;
    });
    for (int r = 0; r < 6; ++r) CHECK(wrong[static_cast<std::size_t>(r)] == 0);
  }
  SUBCASE("default table: one node") {
    LocalGroup group(3);
    group.run([&](LocalTransport& t) {
      std::vector<unsigned char> buf(3 * 4);
      t.all_gather(buf.data() + t.rank() * 4, buf.data(), 4);
      if (t.counters().intra_node != 8 || t.counters().inter_node != 0 || t.node_of(2) != 0)
        throw std::runtime_error("wrong default counters");
    });
  }
}

namespace {
template <class F>
void four_ranks_call(F&& f) {
  LocalGroup four(4);
  four.run(f);
}
}  // namespace

TEST_CASE("local: bad arguments are rejected with the argument's name, before anything is sent") {
  Watchdog dog;
  LocalGroup one(1);
  one.run([](LocalTransport& t) {
    std::vector<unsigned char> a(64, 1), b(64, 2);
    CHECK_THROWS_WITH_AS(t.all_gather(nullptr, b.data(), 8), doctest::Contains("'send'"), qcoll::Error);
    CHECK_THROWS_WITH_AS(t.all_gather(a.data(), nullptr, 8), doctest::Contains("'recv'"), qcoll::Error);
    CHECK_THROWS_WITH_AS(t.all_to_all(nullptr, b.data(), 8), doctest::Contains("'send'"), qcoll::Error);
    CHECK_THROWS_WITH_AS(t.all_to_all(a.data(), nullptr, 8), doctest::Contains("'recv'"), qcoll::Error);
    CHECK_THROWS_WITH_AS(t.all_to_all(a.data(), a.data() + 4, 8), doctest::Contains("overlaps"),
                         qcoll::Error);
    // world 1: the in-place block is recv + 0; send = recv + 4 overlaps without being in place
    CHECK_THROWS_WITH_AS(t.all_gather(a.data() + 4, a.data(), 8), doctest::Contains("'send'"), qcoll::Error);
    CHECK_THROWS_WITH_AS(t.all_reduce(nullptr, 2, ReduceOp::sum), doctest::Contains("'data'"), qcoll::Error);
    std::uint64_t x = 0;
    CHECK_THROWS_WITH_AS(t.all_reduce(&x, 1, static_cast<ReduceOp>(9)), doctest::Contains("'op'"),
                         qcoll::Error);
    CHECK_THROWS_WITH_AS((void)t.node_of(1), doctest::Contains("'peer'"), qcoll::Error);
    CHECK_THROWS_WITH_AS((void)t.node_of(-1), doctest::Contains("'peer'"), qcoll::Error);
    CHECK_THROWS_WITH_AS(t.split(-1, 0), doctest::Contains("'color'"), qcoll::Error);
    // nothing was written, nothing was counted
    CHECK(a == std::vector<unsigned char>(64, 1));
    CHECK(b == std::vector<unsigned char>(64, 2));
    CHECK(t.counters().calls == 0);
    // the transport is still usable
    t.all_gather(a.data(), b.data(), 8);
    CHECK(b[0] == 1);
  });
  CHECK_THROWS_WITH_AS(LocalGroup(0), doctest::Contains("'world'"), qcoll::Error);
  CHECK_THROWS_WITH_AS(LocalGroup(1025), doctest::Contains("'world'"), qcoll::Error);
  CHECK_THROWS_WITH_AS(LocalGroup(4, {0, 1}), doctest::Contains("'node_id_of_rank.size()'"), qcoll::Error);
  CHECK_THROWS_WITH_AS(LocalGroup(2, {0, -3}), doctest::Contains("node_id_of_rank[r]"), qcoll::Error);

  // Every rank asks for more than size_t can hold: each throws before the rendezvous.
  CHECK_THROWS_WITH_AS(four_ranks_call([](LocalTransport& t) {
                         std::vector<unsigned char> send(16), recv(16);
                         t.all_gather(send.data(), recv.data(), SIZE_MAX / 2);
                       }),
                       doctest::Contains("'bytes_per_rank'"), qcoll::Error);
  CHECK_THROWS_WITH_AS(four_ranks_call([](LocalTransport& t) {
                         std::vector<unsigned char> send(16), recv(16);
                         t.all_to_all(send.data(), recv.data(), SIZE_MAX / 3);
                       }),
                       doctest::Contains("'bytes_per_rank'"), qcoll::Error);

  // Every rank passes a null send: each throws its own error before the rendezvous, and run()
  // reports the one that was recorded first.
  LocalGroup four(4);
  CHECK_THROWS_WITH_AS(four.run([](LocalTransport& t) {
    std::vector<unsigned char> recv(16);
    t.all_gather(nullptr, recv.data(), 4);
  }),
                       doctest::Contains("'send'"), qcoll::Error);
}

TEST_CASE("local: ranks that disagree on a collective all get an error, none hangs") {
  Watchdog dog;
  LocalGroup group(4);
  std::vector<std::string> messages(4);
  auto record = [&](LocalTransport& t, auto&& call) {
    try {
      call();
    } catch (const qcoll::Error& e) {
      messages[static_cast<std::size_t>(t.rank())] = e.what();
      throw;
    }
  };
  SUBCASE("different sizes") {
    CHECK_THROWS_AS(group.run([&](LocalTransport& t) {
      std::vector<unsigned char> send(16), recv(64);
      record(t, [&] { t.all_gather(send.data(), recv.data(), t.rank() == 2 ? 16 : 8); });
    }),
                    qcoll::Error);
    for (const auto& m : messages) CHECK(m.find("disagree") != std::string::npos);
  }
  SUBCASE("different operations") {
    CHECK_THROWS_AS(group.run([&](LocalTransport& t) {
      std::vector<unsigned char> send(64), recv(64);
      record(t, [&] {
        if (t.rank() == 1)
          t.barrier();
        else
          t.all_to_all(send.data(), recv.data(), 8);
      });
    }),
                    qcoll::Error);
    for (const auto& m : messages) CHECK(m.find("disagree") != std::string::npos);
  }
}

namespace {
struct Boom : std::exception {
  const char* what() const noexcept override { return "boom from the test"; }
};
}  // namespace

TEST_CASE("local: a failing rank makes its peers' collectives throw instead of hanging") {
  Watchdog dog;
  const int world = 8, victim = 3;
  LocalGroup group(world, {0, 0, 0, 0, 1, 1, 1, 1});
  std::vector<std::string> messages(world);
  std::vector<int> returned(world, 0);
  // Every healthy rank must end in a qcoll::Error that names the failed peer and its message.
  auto check_peers = [&] {
    for (int r = 0; r < world; ++r) {
      if (r == victim) continue;
      CAPTURE(r);
      CHECK(messages[static_cast<std::size_t>(r)].find("peer rank 3 failed") != std::string::npos);
      CHECK(messages[static_cast<std::size_t>(r)].find("boom from the test") != std::string::npos);
      CHECK(returned[static_cast<std::size_t>(r)] == 0);
    }
  };
  auto guarded = [&](LocalTransport& t, auto&& body) {
    try {
      body();
      returned[static_cast<std::size_t>(t.rank())] = 1;
    } catch (const qcoll::Error& e) {
      messages[static_cast<std::size_t>(t.rank())] = e.what();
      throw;
    }
  };

  SUBCASE("the rank throws after its peers are blocked in all_gather") {
    // run() rethrows the victim's own exception object (type Boom), not a peer's qcoll::Error
    CHECK_THROWS_AS(group.run([&](LocalTransport& t) {
      if (t.rank() == victim) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        throw Boom();
      }
      guarded(t, [&] {
        std::vector<unsigned char> send(32), recv(32 * world);
        t.all_gather(send.data(), recv.data(), 32);
      });
    }),
                    Boom);
    check_peers();
  }
  SUBCASE("the rank throws before its peers enter the collective") {
    CHECK_THROWS_AS(group.run([&](LocalTransport& t) {
      if (t.rank() == victim) throw Boom();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      guarded(t, [&] {
        std::vector<unsigned char> send(8 * world), recv(8 * world);
        t.all_to_all(send.data(), recv.data(), 8);
      });
    }),
                    Boom);
    check_peers();
  }
  SUBCASE("a failure inside one sub-group aborts the other sub-groups and the parent") {
    CHECK_THROWS_AS(group.run([&](LocalTransport& t) {
      LocalTransport node = t.split(t.rank() / 4, t.rank());
      if (t.rank() == victim) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        throw Boom();
      }
      guarded(t, [&] {
        // ranks 4..7 do not need the victim for their sub-group calls, so they reach the world
        // barrier (or are already stuck in a later node barrier) and must be released from there
        for (int i = 0; i < 1000000; ++i) node.barrier();
        t.barrier();
      });
    }),
                    Boom);
    check_peers();
  }
  SUBCASE("peers that wrap the peer error do not hide the root cause") {
    // the victim fails first in time (its peers only fail once they see its failure), so run()
    // rethrows Boom even though every other rank ends in a different exception of its own
    CHECK_THROWS_AS(group.run([&](LocalTransport& t) {
      if (t.rank() == victim) throw Boom();
      try {
        t.barrier();
      } catch (const qcoll::Error& e) {
        messages[static_cast<std::size_t>(t.rank())] = e.what();
        throw std::runtime_error(std::string("step failed: ") + e.what());
      }
    }),
                    Boom);
    check_peers();
  }
  SUBCASE("a non-standard exception is carried as is") {
    CHECK_THROWS_AS(group.run([&](LocalTransport& t) {
      if (t.rank() == victim) throw 42;
      t.barrier();
    }),
                    int);
  }
  // The same group runs again with fresh state after any of the failures above.
  std::vector<int> all(world, -1);
  group.run([&](LocalTransport& t) {
    const int me = t.rank();
    std::vector<int> got(world, -1);
    t.all_gather(&me, got.data(), sizeof(int));
    if (me == 0) all = got;
  });
  for (int r = 0; r < world; ++r) CHECK(all[static_cast<std::size_t>(r)] == r);
}

TEST_CASE("local: a rank that returns while its peers wait makes them throw") {
  Watchdog dog;
  LocalGroup group(4);
  std::vector<std::string> messages(4);
  CHECK_THROWS_WITH_AS(group.run([&](LocalTransport& t) {
    if (t.rank() == 2) return;  // skips the barrier the others call
    try {
      t.barrier();
    } catch (const qcoll::Error& e) {
      messages[static_cast<std::size_t>(t.rank())] = e.what();
      throw;
    }
  }),
                       doctest::Contains("rank 2 returned"), qcoll::Error);
  for (int r : {0, 1, 3}) CHECK(messages[static_cast<std::size_t>(r)].find("rank 2") != std::string::npos);
}

TEST_CASE("local: sizes above 2^31 bytes" * doctest::skip()) {
  // Needs about 9 GiB of memory and a minute; run with --no-skip.
  Watchdog dog(300);
  const std::size_t b = (std::size_t{1} << 31) + 5;
  {
    LocalGroup group(2);
    std::vector<long long> wrong(2, 0);
    group.run([&](LocalTransport& t) {
      const std::size_t me = static_cast<std::size_t>(t.rank());
      std::vector<unsigned char> full(2 * b, 0);
      full[me * b] = static_cast<unsigned char>(10 + me);
      full[me * b + b - 1] = static_cast<unsigned char>(20 + me);
      t.all_gather(full.data() + me * b, full.data(), b);
      for (std::size_t r = 0; r < 2; ++r)
        wrong[me] += full[r * b] != 10 + r || full[r * b + b - 1] != 20 + r || full[r * b + b / 2] != 0;
    });
    CHECK(wrong[0] == 0);
    CHECK(wrong[1] == 0);
  }
  {
    LocalGroup group(1);
    group.run([&](LocalTransport& t) {
      std::vector<unsigned char> send(b, 3), recv(b, 0);
      send[b - 1] = 9;
      t.all_to_all(send.data(), recv.data(), b);
      CHECK(recv[0] == 3);
      CHECK(recv[b - 1] == 9);
    });
  }
}
