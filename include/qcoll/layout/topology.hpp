#pragma once
//! \file
//! qcoll::Topology: which node every rank sits on and its index among that node's ranks, read from
//! a table rather than assumed from the numbering.

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "../core/config.hpp"
#include "../core/error.hpp"
#include "../core/hash.hpp"

QCOLL_NAMESPACE_BEGIN

//! The placement of W ranks on N nodes of L ranks each (W = N * L), seen from one rank.
//!
//! Every rank has a node index in [0, N) and a local index in [0, L). Nodes are numbered in order
//! of their lowest rank; a rank's local index is its position among its node's ranks in increasing
//! rank order. Nothing assumes node-major numbering (`rank = node * L + local`): the tables come
//! from whatever placement the job has. Sub-groups: the intra-node group (ranks on this rank's node,
//! ordered by local index) and the inter-node group (ranks with this rank's local index, ordered by
//! node). Copyable value type; queries are O(1) unless stated.
class Topology {
 public:
  //! Builds the topology from a node id per rank (`node_id_of_rank[r]` for r = 0..W-1): any
  //! integers, e.g. hashes of host names; equal ids mean the same node. O(W).
  //! Throws qcoll::Error if the table is empty, if `rank` is outside [0, W), or if the nodes hold
  //! different numbers of ranks (the message names both sizes).
  static Topology from_node_ids(const std::vector<long long>& node_id_of_rank, int rank) {
    const char* fn = "Topology::from_node_ids";
    QCOLL_REQUIRE(!node_id_of_rank.empty(), fn, "node_id_of_rank", "an empty table", "needs at least",
                  "one rank");
    QCOLL_REQUIRE(node_id_of_rank.size() <= static_cast<std::size_t>(kMaxWorld), fn, "node_id_of_rank",
                  "a table of " + std::to_string(node_id_of_rank.size()) + " ranks", "exceeds the limit of",
                  kMaxWorld);
    const int world = static_cast<int>(node_id_of_rank.size());
    QCOLL_REQUIRE(rank >= 0 && rank < world, fn, "rank", rank, "is outside [0, world size) with world size",
                  world);

    Topology t;
    t.world_ = world;
    t.rank_ = rank;
    t.node_of_.assign(static_cast<std::size_t>(world), 0);
    t.local_of_.assign(static_cast<std::size_t>(world), 0);

    // Ranks are visited in increasing order, so a node's index is assigned at its lowest rank and
    // a rank's local index is the number of lower ranks already seen on its node.
    std::unordered_map<long long, int> node_index_of_id;
    std::vector<int> node_size;
    std::vector<long long> node_id;
    for (int r = 0; r < world; ++r) {
      const long long id = node_id_of_rank[static_cast<std::size_t>(r)];
      auto found = node_index_of_id.find(id);
      int node;
      if (found == node_index_of_id.end()) {
        node = static_cast<int>(node_size.size());
        node_index_of_id.emplace(id, node);
        node_size.push_back(0);
        node_id.push_back(id);
      } else {
        node = found->second;
      }
      t.node_of_[static_cast<std::size_t>(r)] = node;
      t.local_of_[static_cast<std::size_t>(r)] = node_size[static_cast<std::size_t>(node)]++;
    }

    t.num_nodes_ = static_cast<int>(node_size.size());
    t.ranks_per_node_ = node_size[0];
    for (int n = 1; n < t.num_nodes_; ++n) {
      const int size = node_size[static_cast<std::size_t>(n)];
      QCOLL_REQUIRE(size == t.ranks_per_node_, fn, "node_id_of_rank",
                    "a table whose node " + std::to_string(n) + " (id " +
                        std::to_string(node_id[static_cast<std::size_t>(n)]) + ") holds " +
                        std::to_string(size) + " rank(s)",
                    "but node 0 (id " + std::to_string(node_id[0]) + ") holds",
                    std::to_string(t.ranks_per_node_) + " rank(s); every node must hold the same number");
    }

    t.rank_at_.assign(static_cast<std::size_t>(world), -1);
    for (int r = 0; r < world; ++r) {
      const std::size_t cell = static_cast<std::size_t>(t.node_of_[static_cast<std::size_t>(r)]) *
                                   static_cast<std::size_t>(t.ranks_per_node_) +
                               static_cast<std::size_t>(t.local_of_[static_cast<std::size_t>(r)]);
      t.rank_at_[cell] = r;
    }
    return t;
  }

  //! Node-major placement: rank r sits on node r / L with local index r % L. Throws qcoll::Error
  //! if `world` < 1, `ranks_per_node` < 1, `ranks_per_node` does not divide `world`, or `rank` is
  //! outside [0, world). O(W).
  static Topology node_major(int world, int ranks_per_node, int rank) {
    check_shape("Topology::node_major", world, ranks_per_node, rank);
    std::vector<long long> ids(static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) ids[static_cast<std::size_t>(r)] = r / ranks_per_node;
    return from_node_ids(ids, rank);
  }

  //! Round-robin placement: rank r sits on node r % N (N = world / ranks_per_node) with local index
  //! r / N. Same argument checks as node_major. O(W).
  static Topology round_robin(int world, int ranks_per_node, int rank) {
    check_shape("Topology::round_robin", world, ranks_per_node, rank);
    const int nodes = world / ranks_per_node;
    std::vector<long long> ids(static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) ids[static_cast<std::size_t>(r)] = r % nodes;
    return from_node_ids(ids, rank);
  }

  //! Number of ranks W.
  int world_size() const noexcept { return world_; }
  //! This rank, in [0, W).
  int rank() const noexcept { return rank_; }
  //! Ranks per node L.
  int ranks_per_node() const noexcept { return ranks_per_node_; }
  //! Number of nodes N = W / L.
  int num_nodes() const noexcept { return num_nodes_; }

  //! Node index of rank `r`, in [0, N). Throws qcoll::Error if `r` is outside [0, W).
  int node_of(int r) const {
    check_rank("Topology::node_of", r);
    return node_of_[static_cast<std::size_t>(r)];
  }
  //! Local index of rank `r` on its node, in [0, L). Throws qcoll::Error if `r` is outside [0, W).
  int local_index_of(int r) const {
    check_rank("Topology::local_index_of", r);
    return local_of_[static_cast<std::size_t>(r)];
  }
  //! Node index of this rank.
  int node() const noexcept { return node_of_[static_cast<std::size_t>(rank_)]; }
  //! Local index of this rank.
  int local_index() const noexcept { return local_of_[static_cast<std::size_t>(rank_)]; }

  //! The rank with the given node and local index (inverse of node_of / local_index_of). Throws
  //! qcoll::Error if `node` is outside [0, N) or `local_index` outside [0, L).
  int rank_at(int node, int local_index) const {
    QCOLL_REQUIRE(node >= 0 && node < num_nodes_, "Topology::rank_at", "node", node,
                  "is outside [0, number of nodes) with number of nodes", num_nodes_);
    QCOLL_REQUIRE(local_index >= 0 && local_index < ranks_per_node_, "Topology::rank_at", "local_index",
                  local_index, "is outside [0, ranks per node) with ranks per node", ranks_per_node_);
    return rank_at_[static_cast<std::size_t>(node) * static_cast<std::size_t>(ranks_per_node_) +
                    static_cast<std::size_t>(local_index)];
  }

  //! The inverse table as N * L ints, row-major: entry node * L + local is rank_at(node, local).
  //! For kernels (copy it to device memory first); valid while this Topology lives.
  const int* rank_at_table() const noexcept { return rank_at_.data(); }

  //! Ranks on this rank's node, ordered by local index (L entries). O(L).
  std::vector<int> intra_node_ranks() const {
    std::vector<int> out(static_cast<std::size_t>(ranks_per_node_));
    for (int j = 0; j < ranks_per_node_; ++j) out[static_cast<std::size_t>(j)] = rank_at(node(), j);
    return out;
  }
  //! Ranks with this rank's local index, ordered by node (N entries). O(N).
  std::vector<int> inter_node_ranks() const {
    std::vector<int> out(static_cast<std::size_t>(num_nodes_));
    for (int m = 0; m < num_nodes_; ++m) out[static_cast<std::size_t>(m)] = rank_at(m, local_index());
    return out;
  }

  //! 64-bit hash of the whole node table (world size and every rank's node and local index), the
  //! same on every rank of a job that agrees on the placement; not of this rank's own index. O(W).
  std::uint64_t fingerprint() const noexcept {
    Fnv1a h;
    h.mix(static_cast<std::uint64_t>(world_));
    for (std::size_t r = 0; r < node_of_.size(); ++r)
      h.mix(static_cast<std::uint64_t>(node_of_[r]) << 32 | static_cast<std::uint32_t>(local_of_[r]));
    return h.value;
  }

  //! Same world, same rank and the same placement of every rank. O(W).
  bool operator==(const Topology& o) const {
    return world_ == o.world_ && rank_ == o.rank_ && ranks_per_node_ == o.ranks_per_node_ &&
           node_of_ == o.node_of_ && local_of_ == o.local_of_;
  }
  bool operator!=(const Topology& o) const { return !(*this == o); }

 private:
  // Large enough for any job; keeps W * sizeof(int) and every int index comfortably in range.
  static constexpr int kMaxWorld = 1 << 24;

  Topology() = default;

  static void check_shape(const char* fn, int world, int ranks_per_node, int rank) {
    QCOLL_REQUIRE(world >= 1, fn, "world", world, "is below the minimum", 1);
    QCOLL_REQUIRE(world <= kMaxWorld, fn, "world", world, "exceeds the limit of", kMaxWorld);
    QCOLL_REQUIRE(ranks_per_node >= 1, fn, "ranks_per_node", ranks_per_node, "is below the minimum", 1);
    QCOLL_REQUIRE(world % ranks_per_node == 0, fn, "ranks_per_node", ranks_per_node,
                  "does not divide the world size", world);
    QCOLL_REQUIRE(rank >= 0 && rank < world, fn, "rank", rank, "is outside [0, world) with world", world);
  }
  void check_rank(const char* fn, int r) const {
    QCOLL_REQUIRE(r >= 0 && r < world_, fn, "r", r, "is outside [0, world size) with world size", world_);
  }

  int world_ = 0;
  int rank_ = 0;
  int ranks_per_node_ = 0;
  int num_nodes_ = 0;
  std::vector<int> node_of_;   // [rank] -> node index
  std::vector<int> local_of_;  // [rank] -> local index
  std::vector<int> rank_at_;   // [node * L + local] -> rank
};

QCOLL_NAMESPACE_END
