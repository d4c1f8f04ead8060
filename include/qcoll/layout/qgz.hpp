#pragma once
//! \file
//! The qgZ two-hop reorder: where each position of the reordered gradient comes from.
//!
//! Over N nodes of L ranks, with S = shard_numel elements per primary shard (one slice per rank),
//! the reordered buffer is L chunks of N * S elements. Chunk j (local index j) is the
//! concatenation, over nodes m = 0..N-1, of the primary shards owned by rank_at(m, j): reordered
//! slice q = j * N + m holds primary shard rank_at(m, j). Hop 1 is an all-to-all inside each node
//! (chunk j goes to the node's rank with local index j); hop 2 is an all-to-all among the ranks of
//! one local index, ordered by node (slice m of the received chunk goes to node m's rank), so
//! primary shard r ends on rank r. The one-hop variant needs no reorder (chunk r = shard r).
//!
//! The functions take plain values and the Topology::rank_at_table() so kernels can call them.

#include <cstddef>

#include "../core/config.hpp"

QCOLL_NAMESPACE_BEGIN

//! Primary shard held by reordered slice `q` (0 <= q < N * L) in the two-hop order:
//! rank_at(q % N, q / N). `rank_at_table` as Topology::rank_at_table() (N * L ints, row-major
//! [node][local]). O(1).
QCOLL_HOST_DEVICE int qgz_source_shard(int q, int num_nodes, int ranks_per_node, const int* rank_at_table) {
  const int local_index = q / num_nodes;
  const int node = q % num_nodes;
  return rank_at_table[node * ranks_per_node + local_index];
}

//! Element offset, in the original padded buffer, of reordered position `p`
//! (0 <= p < N * L * shard_numel) in the two-hop order. Arguments as qgz_source_shard; with
//! shard_numel = 0 there are no positions and `p` is returned unchanged. O(1).
QCOLL_HOST_DEVICE std::size_t qgz_source_offset(std::size_t p, std::size_t shard_numel, int num_nodes,
                                                int ranks_per_node, const int* rank_at_table) {
  if (shard_numel == 0) return p;
  const std::size_t q = p / shard_numel;
  const std::size_t within = p - q * shard_numel;
  const int shard = qgz_source_shard(static_cast<int>(q), num_nodes, ranks_per_node, rank_at_table);
  return static_cast<std::size_t>(shard) * shard_numel + within;
}

QCOLL_NAMESPACE_END
