// Property tests for the layout layer: Topology, ShardLayout, SecondaryLayout, granule_for and the
// qgZ two-hop reorder, over sweeps of element count, world size, ranks per node and rank placement.

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "qcoll/core/error.hpp"
#include "qcoll/layout/qgz.hpp"
#include "qcoll/layout/shard.hpp"
#include "qcoll/layout/topology.hpp"

namespace {

using qcoll::granule_for;
using qcoll::SecondaryLayout;
using qcoll::ShardLayout;
using qcoll::Topology;

// ---------------------------------------------------------------------------------------------
// Sweep parameters

// Element counts: empty, tiny, primes, around typical block sizes (32, 256, 2048), and large-ish.
const std::vector<std::size_t> kNumels = {0,    1,    2,    3,    5,    7,     13,    31,    32,
                                          33,   97,   255,  256,  257,  1021,  2047,  2048,  2049,
                                          4099, 6143, 8191, 8192, 8193, 65521, 65536, 65537, 1000003};

// Granules: unconstrained, odd, and what granule_for gives for common (element type, block) pairs.
std::vector<std::size_t> granules() {
  return {1,
          3,
          granule_for(4, {}),         // fp32, no block: 4 elements = 16 bytes
          granule_for(2, {32}),       // bf16, MX-style block of 32
          granule_for(2, {256}),      // bf16, int8 default block
          granule_for(4, {2048}),     // fp32, large block
          granule_for(2, {48, 32})};  // a non-power-of-two block
}

// Ranks per node to try for a world: 1, 2, 4 and the whole world, where they divide it.
std::vector<int> ranks_per_node_options(int world) {
  std::vector<int> out;
  for (int l : {1, 2, 4, world}) {
    if (world % l != 0) continue;
    bool seen = false;
    for (int x : out) seen = seen || x == l;
    if (!seen) out.push_back(l);
  }
  return out;
}

// A 64-bit mix, used to turn node labels into arbitrary (large, unsorted, possibly negative) ids.
long long scramble(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return static_cast<long long>(x);
}

// A named rank placement: the node id of every rank.
struct Placement {
  std::string name;
  std::vector<long long> ids;
};

// node-major, round-robin and seeded random placements of world ranks on world / l nodes. Random
// ones shuffle a table holding each node label l times (Fisher-Yates over mt19937's specified
// output, so the same on every platform) and map labels to scrambled ids.
std::vector<Placement> placements(int world, int l) {
  const int nodes = world / l;
  std::vector<Placement> out;
  Placement nm{"node_major", std::vector<long long>(static_cast<std::size_t>(world))};
  Placement rr{"round_robin", std::vector<long long>(static_cast<std::size_t>(world))};
  for (int r = 0; r < world; ++r) {
    nm.ids[static_cast<std::size_t>(r)] = r / l;
    rr.ids[static_cast<std::size_t>(r)] = r % nodes;
  }
  out.push_back(nm);
  out.push_back(rr);
  for (std::uint32_t seed = 1; seed <= 4; ++seed) {
    std::vector<int> label(static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) label[static_cast<std::size_t>(r)] = r / l;
    std::mt19937 gen(seed * 7919u + static_cast<std::uint32_t>(world * 31 + l));
    for (int i = world - 1; i > 0; --i) {
      const int j = static_cast<int>(gen() % static_cast<std::uint32_t>(i + 1));
      std::swap(label[static_cast<std::size_t>(i)], label[static_cast<std::size_t>(j)]);
    }
    Placement p{"shuffled seed " + std::to_string(seed),
                std::vector<long long>(static_cast<std::size_t>(world))};
    for (int r = 0; r < world; ++r)
      p.ids[static_cast<std::size_t>(r)] =
          scramble(static_cast<std::uint64_t>(label[static_cast<std::size_t>(r)]) * 1000003u + seed);
    out.push_back(p);
  }
  return out;
}

// The Topology of every rank for one placement.
std::vector<Topology> topologies(const std::vector<long long>& ids) {
  std::vector<Topology> out;
  for (int r = 0; r < static_cast<int>(ids.size()); ++r) out.push_back(Topology::from_node_ids(ids, r));
  return out;
}

// Message of the qcoll::Error that f throws; fails the test (and returns "") if it throws nothing.
template <class F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const qcoll::Error& e) {
    return e.what();
  }
  FAIL_CHECK("expected qcoll::Error");
  return {};
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---------------------------------------------------------------------------------------------
// Topology checks

// The tables of t are fully determined by these properties: (node, local) <-> rank is a bijection
// onto [0,N) x [0,L); equal ids <=> equal node; local indices increase with rank inside a node;
// nodes are numbered in increasing order of their lowest rank.
void check_topology(const Topology& t, const std::vector<long long>& ids, int rank) {
  const int w = static_cast<int>(ids.size());
  const int l = t.ranks_per_node();
  const int n = t.num_nodes();
  REQUIRE(t.world_size() == w);
  REQUIRE(t.rank() == rank);
  REQUIRE(l >= 1);
  REQUIRE(n * l == w);

  std::vector<int> hits(static_cast<std::size_t>(w), 0);
  for (int m = 0; m < n; ++m) {
    for (int j = 0; j < l; ++j) {
      const int r = t.rank_at(m, j);
      REQUIRE(r >= 0);
      REQUIRE(r < w);
      ++hits[static_cast<std::size_t>(r)];
      CHECK(t.node_of(r) == m);
      CHECK(t.local_index_of(r) == j);
      CHECK(t.rank_at_table()[m * l + j] == r);
      if (j + 1 < l) CHECK(r < t.rank_at(m, j + 1));
    }
    if (m + 1 < n) CHECK(t.rank_at(m, 0) < t.rank_at(m + 1, 0));
  }
  for (int r = 0; r < w; ++r) {
    CHECK(hits[static_cast<std::size_t>(r)] == 1);
    CHECK(t.rank_at(t.node_of(r), t.local_index_of(r)) == r);
    for (int s = 0; s < w; ++s)
      CHECK((ids[static_cast<std::size_t>(r)] == ids[static_cast<std::size_t>(s)]) ==
            (t.node_of(r) == t.node_of(s)));
  }

  CHECK(t.node() == t.node_of(rank));
  CHECK(t.local_index() == t.local_index_of(rank));
  const std::vector<int> intra = t.intra_node_ranks();
  REQUIRE(static_cast<int>(intra.size()) == l);
  for (int j = 0; j < l; ++j) {
    CHECK(t.node_of(intra[static_cast<std::size_t>(j)]) == t.node());
    CHECK(t.local_index_of(intra[static_cast<std::size_t>(j)]) == j);
  }
  const std::vector<int> inter = t.inter_node_ranks();
  REQUIRE(static_cast<int>(inter.size()) == n);
  for (int m = 0; m < n; ++m) {
    CHECK(t.node_of(inter[static_cast<std::size_t>(m)]) == m);
    CHECK(t.local_index_of(inter[static_cast<std::size_t>(m)]) == t.local_index());
  }
}

// ---------------------------------------------------------------------------------------------
// Two-hop exchange simulation

// What one element of a buffer stands for: the element of the original padded gradient it carries
// (`offset`) and the set of ranks whose gradients have been summed into it (`sources`, bit s = rank s).
struct Partial {
  std::size_t offset = 0;
  std::uint32_t sources = 0;
};

// Adds `in` into `acc` as a reduction would, and checks that both stand for the same original
// element and that no rank's contribution is counted twice.
void accumulate(Partial& acc, const Partial& in, bool first) {
  if (first) {
    acc = in;
    return;
  }
  CHECK(acc.offset == in.offset);
  CHECK((acc.sources & in.sources) == 0u);
  acc.sources |= in.sources;
}

// Runs the qgZ two-hop reduce-scatter on symbolic data for every rank of one placement, moving
// messages by rank as the all-to-alls over the intra-node and inter-node groups would, with slices
// of `s` elements, and checks that rank r ends with exactly primary shard r, every element summed
// over all W ranks exactly once.
void simulate_two_hops(const std::vector<Topology>& topo, std::size_t s) {
  const int w = static_cast<int>(topo.size());
  const int l = topo[0].ranks_per_node();
  const int n = topo[0].num_nodes();
  const std::size_t chunk = static_cast<std::size_t>(n) * s;  // elements per hop-1 message
  const std::size_t full = static_cast<std::size_t>(w) * s;

  // Before hop 1: every rank quantizes its own gradient in reordered order.
  std::vector<std::vector<Partial>> reordered(static_cast<std::size_t>(w), std::vector<Partial>(full));
  for (int r = 0; r < w; ++r) {
    const Topology& t = topo[static_cast<std::size_t>(r)];
    std::vector<int> seen(full, 0);
    for (std::size_t p = 0; p < full; ++p) {
      const std::size_t src = qcoll::qgz_source_offset(p, s, n, l, t.rank_at_table());
      REQUIRE(src < full);
      ++seen[src];
      reordered[static_cast<std::size_t>(r)][p] = Partial{src, 1u << r};
    }
    for (std::size_t e = 0; e < full; ++e) REQUIRE(seen[e] == 1);  // the reorder is a permutation
  }

  // Hop 1: all-to-all inside each node; message j (chunk j) goes to intra-node group member j.
  // inbox1[d][i] is what rank d received from its group member i.
  std::vector<std::vector<std::vector<Partial>>> inbox1(
      static_cast<std::size_t>(w), std::vector<std::vector<Partial>>(static_cast<std::size_t>(l)));
  for (int r = 0; r < w; ++r) {
    const std::vector<int> group = topo[static_cast<std::size_t>(r)].intra_node_ranks();
    for (int j = 0; j < l; ++j) {
      const int d = group[static_cast<std::size_t>(j)];
      const std::vector<int> dgroup = topo[static_cast<std::size_t>(d)].intra_node_ranks();
      const int i = topo[static_cast<std::size_t>(d)].local_index_of(r);
      REQUIRE(dgroup[static_cast<std::size_t>(i)] == r);  // both ends agree on the group
      auto& slot = inbox1[static_cast<std::size_t>(d)][static_cast<std::size_t>(i)];
      REQUIRE(slot.empty());
      const auto& src = reordered[static_cast<std::size_t>(r)];
      slot.assign(src.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(j) * chunk),
                  src.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(j + 1) * chunk));
    }
  }
  // Each rank reduces its L received chunks in source order.
  std::vector<std::vector<Partial>> partial(static_cast<std::size_t>(w), std::vector<Partial>(chunk));
  for (int d = 0; d < w; ++d) {
    for (int i = 0; i < l; ++i) {
      const auto& msg = inbox1[static_cast<std::size_t>(d)][static_cast<std::size_t>(i)];
      REQUIRE(msg.size() == chunk);
      for (std::size_t k = 0; k < chunk; ++k)
        accumulate(partial[static_cast<std::size_t>(d)][k], msg[k], i == 0);
    }
  }

  // Hop 2: all-to-all among ranks of one local index; slice m goes to inter-node group member m.
  std::vector<std::vector<std::vector<Partial>>> inbox2(
      static_cast<std::size_t>(w), std::vector<std::vector<Partial>>(static_cast<std::size_t>(n)));
  for (int r = 0; r < w; ++r) {
    const std::vector<int> group = topo[static_cast<std::size_t>(r)].inter_node_ranks();
    for (int m = 0; m < n; ++m) {
      const int d = group[static_cast<std::size_t>(m)];
      const std::vector<int> dgroup = topo[static_cast<std::size_t>(d)].inter_node_ranks();
      const int i = topo[static_cast<std::size_t>(d)].node_of(r);
      REQUIRE(dgroup[static_cast<std::size_t>(i)] == r);
      auto& slot = inbox2[static_cast<std::size_t>(d)][static_cast<std::size_t>(i)];
      REQUIRE(slot.empty());
      const auto& src = partial[static_cast<std::size_t>(r)];
      slot.assign(src.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(m) * s),
                  src.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(m + 1) * s));
    }
  }

  const std::uint32_t everyone = w == 32 ? ~0u : ((1u << w) - 1u);
  for (int d = 0; d < w; ++d) {
    std::vector<Partial> result(s);
    for (int i = 0; i < n; ++i) {
      const auto& msg = inbox2[static_cast<std::size_t>(d)][static_cast<std::size_t>(i)];
      REQUIRE(msg.size() == s);
      for (std::size_t k = 0; k < s; ++k) accumulate(result[k], msg[k], i == 0);
    }
    // Rank d holds primary shard d, element by element, summed over every rank.
    for (std::size_t k = 0; k < s; ++k) {
      CHECK(result[k].offset == static_cast<std::size_t>(d) * s + k);
      CHECK(result[k].sources == everyone);
    }
  }
}

}  // namespace

// =============================================================================================

TEST_CASE("Topology: tables from node ids, for every placement") {
  for (int w = 1; w <= 16; ++w) {
    for (int l : ranks_per_node_options(w)) {
      for (const Placement& p : placements(w, l)) {
        CAPTURE(w);
        CAPTURE(l);
        CAPTURE(p.name);
        const std::vector<Topology> topo = topologies(p.ids);
        for (int r = 0; r < w; ++r) {
          check_topology(topo[static_cast<std::size_t>(r)], p.ids, r);
          // Every rank sees the same placement.
          for (int s = 0; s < w; ++s)
            CHECK(topo[static_cast<std::size_t>(r)].node_of(s) == topo[0].node_of(s));
        }
      }
    }
  }
}

TEST_CASE("Topology: node_major and round_robin place ranks as named") {
  for (int w = 1; w <= 16; ++w) {
    for (int l : ranks_per_node_options(w)) {
      const int n = w / l;
      for (int rank = 0; rank < w; ++rank) {
        CAPTURE(w);
        CAPTURE(l);
        CAPTURE(rank);
        const Topology nm = Topology::node_major(w, l, rank);
        const Topology rr = Topology::round_robin(w, l, rank);
        REQUIRE(nm.num_nodes() == n);
        REQUIRE(rr.num_nodes() == n);
        for (int r = 0; r < w; ++r) {
          CHECK(nm.node_of(r) == r / l);
          CHECK(nm.local_index_of(r) == r % l);
          CHECK(rr.node_of(r) == r % n);
          CHECK(rr.local_index_of(r) == r / n);
        }
        // Node-major and round-robin coincide only when one of N, L is 1.
        CHECK((nm == rr) == (n == 1 || l == 1));
      }
    }
  }
}

TEST_CASE("Topology: arbitrary ids, equality and the concrete example") {
  // Ids that are large, negative and unsorted; ranks 0,3,5 | 1,2,4 by id.
  const long long a = 9000000000000000001LL, b = -42;
  const std::vector<long long> ids = {a, b, b, a, b, a};
  const Topology t = Topology::from_node_ids(ids, 4);
  CHECK(t.world_size() == 6);
  CHECK(t.num_nodes() == 2);
  CHECK(t.ranks_per_node() == 3);
  // Node 0 is the node of rank 0 (lowest rank); local indices follow rank order.
  CHECK(t.intra_node_ranks() == std::vector<int>{1, 2, 4});
  CHECK(t.inter_node_ranks() == std::vector<int>{5, 4});
  CHECK(t.node() == 1);
  CHECK(t.local_index() == 2);
  CHECK(t.rank_at(0, 0) == 0);
  CHECK(t.rank_at(0, 1) == 3);
  CHECK(t.rank_at(0, 2) == 5);
  CHECK(t.rank_at(1, 0) == 1);
  CHECK(t.rank_at(1, 1) == 2);
  CHECK(t.rank_at(1, 2) == 4);
  const std::vector<int> table(t.rank_at_table(), t.rank_at_table() + 6);
  CHECK(table == std::vector<int>{0, 3, 5, 1, 2, 4});

  // Equality sees the placement and the rank, not the id values.
  const Topology relabeled = Topology::from_node_ids({7, 8, 8, 7, 8, 7}, 4);
  CHECK(t == relabeled);
  CHECK_FALSE(t != relabeled);
  CHECK(t != Topology::from_node_ids(ids, 3));
  CHECK(t != Topology::from_node_ids({7, 7, 7, 8, 8, 8}, 4));
  CHECK(Topology::from_node_ids({7, 7, 7, 8, 8, 8}, 4) == Topology::node_major(6, 3, 4));

  // One rank, one node.
  const Topology one = Topology::from_node_ids({123}, 0);
  CHECK(one.world_size() == 1);
  CHECK(one.num_nodes() == 1);
  CHECK(one.ranks_per_node() == 1);
  CHECK(one.intra_node_ranks() == std::vector<int>{0});
  CHECK(one.inter_node_ranks() == std::vector<int>{0});
}

TEST_CASE("Topology: bad arguments raise qcoll::Error naming them") {
  // Nodes of different sizes: node 0 (id 5) holds 2 ranks, node 1 (id 7) holds 1.
  std::string msg = error_message([] { Topology::from_node_ids({5, 5, 7}, 0); });
  CHECK(contains(msg, "node_id_of_rank"));
  CHECK(contains(msg, "holds 1 rank"));
  CHECK(contains(msg, "holds 2 rank"));
  // The first node differing from node 0 is reported, with both sizes.
  msg = error_message([] { Topology::from_node_ids({1, 2, 2, 3, 3, 3}, 0); });
  CHECK(contains(msg, "holds 2 rank"));
  CHECK(contains(msg, "holds 1 rank"));

  CHECK_THROWS_WITH_AS(Topology::from_node_ids({}, 0), doctest::Contains("node_id_of_rank"), qcoll::Error);
  CHECK_THROWS_WITH_AS(Topology::from_node_ids({1, 1}, 2), doctest::Contains("'rank' = 2"), qcoll::Error);
  CHECK_THROWS_WITH_AS(Topology::from_node_ids({1, 1}, -1), doctest::Contains("'rank' = -1"), qcoll::Error);

  CHECK_THROWS_WITH_AS(Topology::node_major(6, 4, 0), doctest::Contains("ranks_per_node"), qcoll::Error);
  CHECK_THROWS_WITH_AS(Topology::node_major(6, 0, 0), doctest::Contains("ranks_per_node"), qcoll::Error);
  CHECK_THROWS_WITH_AS(Topology::node_major(0, 1, 0), doctest::Contains("world"), qcoll::Error);
  CHECK_THROWS_WITH_AS(Topology::node_major(4, 2, 4), doctest::Contains("rank"), qcoll::Error);
  CHECK_THROWS_WITH_AS(Topology::round_robin(6, 4, 0), doctest::Contains("ranks_per_node"), qcoll::Error);
  CHECK_THROWS_WITH_AS(Topology::round_robin(-3, 1, 0), doctest::Contains("world"), qcoll::Error);

  const Topology t = Topology::node_major(8, 4, 0);
  CHECK_THROWS_WITH_AS(t.node_of(8), doctest::Contains("'r' = 8"), qcoll::Error);
  CHECK_THROWS_WITH_AS(t.local_index_of(-1), doctest::Contains("'r' = -1"), qcoll::Error);
  CHECK_THROWS_WITH_AS(t.rank_at(2, 0), doctest::Contains("'node' = 2"), qcoll::Error);
  CHECK_THROWS_WITH_AS(t.rank_at(0, 4), doctest::Contains("'local_index' = 4"), qcoll::Error);
}

TEST_CASE("ShardLayout: shards tile the padded buffer; padding is minimal and never inside data") {
  for (std::size_t g : granules()) {
    for (std::size_t numel : kNumels) {
      for (int parts = 1; parts <= 16; ++parts) {
        CAPTURE(g);
        CAPTURE(numel);
        CAPTURE(parts);
        const ShardLayout lay(numel, parts, g);
        const std::size_t unit = static_cast<std::size_t>(parts) * g;
        CHECK(lay.numel() == numel);
        CHECK(lay.parts() == parts);
        CHECK(lay.granule() == g);

        // padded_numel is a multiple of parts * granule, holds numel, and one unit less would not.
        const std::size_t padded = lay.padded_numel();
        CHECK(padded % unit == 0);
        CHECK(padded >= numel);
        if (numel == 0) {
          CHECK(padded == 0);
        } else {
          CHECK(padded - unit < numel);
        }

        // Equal shards, a multiple of the granule each, laid end to end from 0 to padded.
        const std::size_t sn = lay.shard_numel();
        CHECK(sn % g == 0);
        CHECK(lay.shard_offset(0) == 0);
        for (int r = 0; r + 1 < parts; ++r) CHECK(lay.shard_offset(r + 1) == lay.shard_offset(r) + sn);
        CHECK(lay.shard_offset(parts - 1) + sn == padded);

        // The valid part of a shard is its prefix below numel: it holds no padding, and when it
        // is shorter than the shard everything after it is padding. Together they cover numel.
        std::size_t total = 0;
        for (int r = 0; r < parts; ++r) {
          const std::size_t off = lay.shard_offset(r), v = lay.valid_in_shard(r);
          CHECK(v <= sn);
          if (v > 0) CHECK(off + v <= numel);   // [off, off + v) is all data
          if (v < sn) CHECK(off + v >= numel);  // [off + v, off + sn) is all padding
          total += v;
        }
        CHECK(total == numel);
      }
    }
  }
}

TEST_CASE("ShardLayout: element-by-element cover for small sizes") {
  // Owner of each padded element through shard_offset / shard_numel, counted independently.
  for (std::size_t numel : {std::size_t{0}, std::size_t{1}, std::size_t{37}, std::size_t{1000}}) {
    for (int parts : {1, 3, 7, 16}) {
      for (std::size_t g : {std::size_t{1}, std::size_t{8}, std::size_t{32}}) {
        CAPTURE(numel);
        CAPTURE(parts);
        CAPTURE(g);
        const ShardLayout lay(numel, parts, g);
        std::vector<int> owners(lay.padded_numel(), 0);
        std::size_t data = 0;
        for (int r = 0; r < parts; ++r) {
          for (std::size_t k = 0; k < lay.shard_numel(); ++k) {
            const std::size_t e = lay.shard_offset(r) + k;
            REQUIRE(e < owners.size());
            ++owners[e];
            if (k < lay.valid_in_shard(r)) {
              CHECK(e < numel);
              ++data;
            } else {
              CHECK(e >= numel);
            }
          }
        }
        for (int c : owners) CHECK(c == 1);
        CHECK(data == numel);
      }
    }
  }
}

TEST_CASE("ShardLayout: bad arguments raise qcoll::Error naming them") {
  CHECK_THROWS_WITH_AS(ShardLayout(10, 0, 1), doctest::Contains("'parts' = 0"), qcoll::Error);
  CHECK_THROWS_WITH_AS(ShardLayout(10, -2, 1), doctest::Contains("'parts' = -2"), qcoll::Error);
  CHECK_THROWS_WITH_AS(ShardLayout(10, 2, 0), doctest::Contains("'granule' = 0"), qcoll::Error);
  const std::size_t max = std::numeric_limits<std::size_t>::max();
  // parts * granule itself overflows.
  CHECK_THROWS_WITH_AS(ShardLayout(10, 4, max / 2), doctest::Contains("granule"), qcoll::Error);
  // Rounding numel up to a multiple of 16 overflows.
  CHECK_THROWS_WITH_AS(ShardLayout(max - 3, 2, 8), doctest::Contains("numel"), qcoll::Error);
  // The largest numel that still rounds up inside size_t is accepted: max - 15 is a multiple of 16.
  CHECK(ShardLayout(max - 15, 2, 8).padded_numel() == max - 15);

  const ShardLayout lay(100, 4, 8);
  CHECK_THROWS_WITH_AS(lay.shard_offset(4), doctest::Contains("'r' = 4"), qcoll::Error);
  CHECK_THROWS_WITH_AS(lay.valid_in_shard(-1), doctest::Contains("'r' = -1"), qcoll::Error);
}

TEST_CASE("granule_for: smallest multiple of every block that is a whole number of 16-byte units") {
  const std::vector<std::size_t> elem_sizes = {1, 2, 3, 4, 6, 8, 12, 16, 32};
  const std::vector<std::vector<std::size_t>> block_lists = {{},   {1},    {7},      {32},
                                                             {48}, {3, 5}, {16, 24}, {256, 2048}};
  for (std::size_t eb : elem_sizes) {
    for (const auto& blocks : block_lists) {
      std::size_t g = 0;
      switch (blocks.size()) {
        case 0: g = granule_for(eb, {}); break;
        case 1: g = granule_for(eb, {blocks[0]}); break;
        default: g = granule_for(eb, {blocks[0], blocks[1]}); break;
      }
      CAPTURE(eb);
      CAPTURE(g);
      auto fits = [&](std::size_t c) {
        if ((c * eb) % 16 != 0) return false;
        for (std::size_t b : blocks)
          if (c % b != 0) return false;
        return true;
      };
      REQUIRE(g >= 1);
      CHECK(fits(g));
      // Minimal: no smaller positive count fits (g is at most lcm(16, 2048), so brute force is cheap).
      for (std::size_t c = 1; c < g; ++c) REQUIRE_FALSE(fits(c));
    }
  }
  CHECK_THROWS_WITH_AS(granule_for(0, {32}), doctest::Contains("elem_bytes"), qcoll::Error);
  CHECK_THROWS_WITH_AS(granule_for(2, {32, 0}), doctest::Contains("block_sizes"), qcoll::Error);
  const std::size_t max = std::numeric_limits<std::size_t>::max();
  // Two coprime blocks near 2^63 and 2^63 - 1: their least common multiple overflows.
  CHECK_THROWS_WITH_AS(granule_for(1, {max / 2 + 1, max / 2}), doctest::Contains("block_sizes"),
                       qcoll::Error);
}

TEST_CASE("SecondaryLayout: L shards tiling the buffer, shard j = primary shards j*N .. j*N+N-1") {
  for (std::size_t g : {std::size_t{1}, granule_for(2, {256})}) {
    for (std::size_t numel : kNumels) {
      for (int w = 1; w <= 16; ++w) {
        for (int l : ranks_per_node_options(w)) {
          CAPTURE(g);
          CAPTURE(numel);
          CAPTURE(w);
          CAPTURE(l);
          const int n = w / l;
          const ShardLayout primary(numel, w, g);
          // The secondary layout depends only on N and L, not on where the ranks sit.
          const Topology nm = Topology::node_major(w, l, 0);
          const Topology rr = Topology::round_robin(w, l, w - 1);
          const SecondaryLayout sec(primary, nm);
          const SecondaryLayout sec_rr(primary, rr);
          REQUIRE(sec.parts() == l);
          CHECK(sec.primary_shards_per_shard() == n);
          CHECK(sec.numel() == numel);
          CHECK(sec.padded_numel() == primary.padded_numel());
          CHECK(sec_rr.shard_numel() == sec.shard_numel());

          const std::size_t sn = sec.shard_numel();
          CHECK(sec.shard_offset(0) == 0);
          CHECK(sec.shard_offset(l - 1) + sn == primary.padded_numel());
          std::size_t total = 0;
          for (int j = 0; j < l; ++j) {
            if (j + 1 < l) CHECK(sec.shard_offset(j + 1) == sec.shard_offset(j) + sn);
            CHECK(sec_rr.shard_offset(j) == sec.shard_offset(j));
            // [off, off + sn) is exactly the run of primary shards j*N .. j*N+N-1.
            CHECK(sec.first_primary_shard(j) == j * n);
            const int first = j * n, last = j * n + n - 1;
            CHECK(sec.shard_offset(j) == primary.shard_offset(first));
            CHECK(sec.shard_offset(j) + sn == primary.shard_offset(last) + primary.shard_numel());
            std::size_t valid = 0;
            for (int r = first; r <= last; ++r) valid += primary.valid_in_shard(r);
            CHECK(sec.valid_in_shard(j) == valid);
            total += sec.valid_in_shard(j);
          }
          CHECK(total == numel);
        }
      }
    }
  }
}

TEST_CASE("SecondaryLayout: bad arguments raise qcoll::Error naming them") {
  const ShardLayout primary(100, 8, 4);
  CHECK_THROWS_WITH_AS(SecondaryLayout(primary, Topology::node_major(4, 2, 0)),
                       doctest::Contains("primary.parts()"), qcoll::Error);
  const SecondaryLayout sec(primary, Topology::node_major(8, 4, 0));
  CHECK_THROWS_WITH_AS(sec.shard_offset(4), doctest::Contains("'local_index' = 4"), qcoll::Error);
  CHECK_THROWS_WITH_AS(sec.valid_in_shard(-1), doctest::Contains("'local_index' = -1"), qcoll::Error);
  CHECK_THROWS_WITH_AS(sec.first_primary_shard(5), doctest::Contains("'local_index' = 5"), qcoll::Error);
}

TEST_CASE("qgZ reorder: hand-worked orders") {
  // W = 4, L = 2, node-major: nodes {0,1} and {2,3}. Chunk 0 (local index 0) holds the shards of
  // ranks (node 0, local 0) = 0 and (node 1, local 0) = 2; chunk 1 holds ranks 1 and 3.
  const Topology nm = Topology::node_major(4, 2, 0);
  std::vector<int> order;
  for (int q = 0; q < 4; ++q) order.push_back(qcoll::qgz_source_shard(q, 2, 2, nm.rank_at_table()));
  CHECK(order == std::vector<int>{0, 2, 1, 3});
  // Round-robin: nodes {0,2} and {1,3}; the ranks of local index 0 are 0 and 1, of local index 1
  // are 2 and 3, so the order is the identity.
  const Topology rr = Topology::round_robin(4, 2, 0);
  order.clear();
  for (int q = 0; q < 4; ++q) order.push_back(qcoll::qgz_source_shard(q, 2, 2, rr.rank_at_table()));
  CHECK(order == std::vector<int>{0, 1, 2, 3});
  // Element granularity, 3 elements per shard, node-major: positions 3..5 come from shard 2.
  CHECK(qcoll::qgz_source_offset(0, 3, 2, 2, nm.rank_at_table()) == 0);
  CHECK(qcoll::qgz_source_offset(3, 3, 2, 2, nm.rank_at_table()) == 6);
  CHECK(qcoll::qgz_source_offset(5, 3, 2, 2, nm.rank_at_table()) == 8);
  CHECK(qcoll::qgz_source_offset(6, 3, 2, 2, nm.rank_at_table()) == 3);
  CHECK(qcoll::qgz_source_offset(11, 3, 2, 2, nm.rank_at_table()) == 11);
}

TEST_CASE("qgZ reorder: a permutation, and two simulated hops deliver shard r to rank r from all ranks") {
  for (int w = 1; w <= 16; ++w) {
    for (int l : ranks_per_node_options(w)) {
      const int n = w / l;
      for (const Placement& p : placements(w, l)) {
        CAPTURE(w);
        CAPTURE(l);
        CAPTURE(p.name);
        const std::vector<Topology> topo = topologies(p.ids);
        const int* table = topo[0].rank_at_table();

        // Slice order: every primary shard exactly once, and chunk j holds only shards of ranks
        // with local index j, one per node, in node order.
        std::vector<int> seen(static_cast<std::size_t>(w), 0);
        for (int q = 0; q < w; ++q) {
          const int shard = qcoll::qgz_source_shard(q, n, l, table);
          REQUIRE(shard >= 0);
          REQUIRE(shard < w);
          ++seen[static_cast<std::size_t>(shard)];
          CHECK(topo[0].local_index_of(shard) == q / n);
          CHECK(topo[0].node_of(shard) == q % n);
        }
        for (int c : seen) CHECK(c == 1);

        // Slices of one element, then of several (including sizes that are not block multiples).
        for (std::size_t s :
             {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{16}, std::size_t{37}}) {
          CAPTURE(s);
          simulate_two_hops(topo, s);
        }
      }
    }
  }
}

TEST_CASE("qgZ reorder: permutation of the padded buffer of real layouts") {
  for (std::size_t numel : kNumels) {
    for (int w : {1, 2, 3, 6, 8, 12, 16}) {
      for (int l : ranks_per_node_options(w)) {
        const int n = w / l;
        const std::vector<Placement> pl = placements(w, l);
        // Node-major plus one shuffled placement; the full sweep of placements runs above.
        for (const Placement* p : {&pl[0], &pl[2]}) {
          CAPTURE(numel);
          CAPTURE(w);
          CAPTURE(l);
          CAPTURE(p->name);
          const Topology t = Topology::from_node_ids(p->ids, 0);
          const ShardLayout lay(numel, w, granule_for(2, {32}));
          const std::size_t sn = lay.shard_numel();
          std::vector<unsigned char> seen(lay.padded_numel(), 0);
          bool ok = true;
          for (std::size_t pos = 0; pos < lay.padded_numel(); ++pos) {
            const std::size_t src = qcoll::qgz_source_offset(pos, sn, n, l, t.rank_at_table());
            // Within a slice the order is kept: the offset inside the source shard is pos % sn.
            ok = ok && src < seen.size() && seen[src] == 0 && src % sn == pos % sn;
            if (src < seen.size()) seen[src] = 1;
          }
          CHECK(ok);
          // With small shards also run the full element-level two-hop exchange.
          if (sn > 0 && sn <= 64) simulate_two_hops(topologies(p->ids), sn);
        }
      }
    }
  }
}
