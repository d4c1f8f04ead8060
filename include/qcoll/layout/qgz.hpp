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
#include "shard.hpp"

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

//! Describes where the blocks of a mapped quantization (host collectives, gpu::quantize_mapped)
//! read their input: a plain run of the input buffer (identity), or the qgZ two-hop reorder.
//!
//! Message element i sits at reordered position p = position0 + i. Its source offset in the input
//! buffer is p (identity, shard_numel == 0) or qgz_source_offset(p, shard_numel, num_nodes,
//! ranks_per_node, rank_at). Source offsets >= numel are padding: such elements are left out of
//! the block statistics and get code 0, like the tail lanes of the last block. A plain value type;
//! `rank_at` must point to device-accessible memory when the qgZ reorder is used.
struct SourceMap {
  std::size_t numel = 0;         //!< input elements holding data; offsets >= numel are padding
  std::size_t position0 = 0;     //!< reordered position of message element 0
  std::size_t shard_numel = 0;   //!< 0: identity map; else elements per primary shard (qgZ reorder)
  int num_nodes = 1;             //!< N of the qgZ reorder
  int ranks_per_node = 1;        //!< L of the qgZ reorder
  const int* rank_at = nullptr;  //!< N * L ints, row-major [node][local] (Topology::rank_at_table())
  SlotTable slots{};          //!< a tensor group's slots (host memory for the host plans, device memory for
                              //!< kernels): padding below numel; slots = 0 for a flat buffer
  std::size_t slot_base = 0;  //!< global position (in the slots' buffer) of input element 0

  //! Identity map: message element i reads input element position0 + i, if below numel.
  static SourceMap identity(std::size_t numel, std::size_t position0 = 0) {
    SourceMap m;
    m.numel = numel;
    m.position0 = position0;
    return m;
  }
  //! qgZ two-hop reorder over `num_nodes` x `ranks_per_node` ranks with `shard_numel` elements per
  //! shard; `rank_at` is a device copy of Topology::rank_at_table().
  static SourceMap qgz(std::size_t numel, std::size_t shard_numel, int num_nodes, int ranks_per_node,
                       const int* rank_at, std::size_t position0 = 0) {
    SourceMap m;
    m.numel = numel;
    m.position0 = position0;
    m.shard_numel = shard_numel;
    m.num_nodes = num_nodes;
    m.ranks_per_node = ranks_per_node;
    m.rank_at = rank_at;
    return m;
  }
};

//! Where one message block reads from: its first element's source offset and how many of its
//! elements hold data (the rest of the block is padding).
struct MappedBlock {
  std::size_t offset;  //!< source offset of the block's element 0
  std::size_t valid;   //!< elements [0, valid) are read; [valid, block) are padding
};

//! Source offset of reordered position p under map m (identity or qgZ). O(1).
QCOLL_HOST_DEVICE std::size_t map_position(const SourceMap& m, std::size_t p) {
  return m.shard_numel == 0 ? p
                            : qgz_source_offset(p, m.shard_numel, m.num_nodes, m.ranks_per_node, m.rank_at);
}

//! Elements of data at the start of the input run [src, src + count) (a run inside one block):
//! those below m.numel, and with a tensor group's slots, inside a tensor's data (data_in_slots at
//! global position slot_base + src). O(1) flat, O(log tensors) grouped.
QCOLL_HOST_DEVICE std::size_t map_data(const SourceMap& m, std::size_t src, std::size_t count) {
  std::size_t valid = src >= m.numel ? 0 : (m.numel - src < count ? m.numel - src : count);
  if (m.slots.slots > 0 && valid > 0) valid = data_in_slots(m.slots, m.slot_base + src, valid);
  return valid;
}

//! Source of block b of a message of n elements with `block` elements per block: offset
//! map_position(position0 + b * block) and valid = min(block, n - b * block, numel - offset),
//! 0 when offset >= numel, and with a tensor group's slots, at most the data of the block's tensor
//! from offset on (map_data): the host collectives hand host::detail::quantize_blocks
//! BlockSource{in + offset, valid} for block b, and the device kernels read the same elements.
//! Blocks never straddle a qgZ shard when shard_numel and position0 are multiples of the block
//! (the plans and gpu::quantize_mapped require it). O(1).
QCOLL_HOST_DEVICE MappedBlock map_block(const SourceMap& m, std::size_t b, std::size_t block, std::size_t n) {
  const std::size_t first = b * block;
  const std::size_t src = map_position(m, m.position0 + first);
  return MappedBlock{src, map_data(m, src, n - first < block ? n - first : block)};
}

QCOLL_NAMESPACE_END
