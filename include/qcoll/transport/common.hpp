#pragma once
//! \file
//! Types shared by every transport, and the argument checks and byte accounting they all use.
//!
//! A transport is a class with this member set (the collectives are templates over it):
//! \code
//!   static constexpr MemorySpace memory_space;     // where the collectives' buffers live
//!   using stream_type = ...;                       // HostStream for host transports
//!   int rank() const; int size() const;
//!   int node_of(int peer) const;                   // node id of a rank of this group
//!   void all_gather(const void* send, void* recv, std::size_t bytes_per_rank, stream_type = {});
//!   void all_to_all(const void* send, void* recv, std::size_t bytes_per_rank, stream_type = {});
//!   void all_reduce(std::uint64_t* data, std::size_t count, ReduceOp op);
//!   void barrier();
//!   Transport split(int color, int key);
//!   const ByteCounters& counters() const; void reset_counters();
//! \endcode
//! Host transports (LocalTransport, MpiTransport) also start the two data exchanges without
//! waiting, for the plans' start()/finish() (docs/overlap.md):
//! \code
//!   class Request;                                  // movable; active() until completed
//!   Request start_all_gather(const void* send, void* recv, std::size_t bytes_per_rank);
//!   Request start_all_to_all(const void* send, void* recv, std::size_t bytes_per_rank);
//!   bool test(Request&);                            // done? never blocks on peers
//!   void wait(Request&);                            // blocks until done
//! \endcode

#include <climits>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <vector>

#include "../core/config.hpp"
#include "../core/error.hpp"

QCOLL_NAMESPACE_BEGIN

//! Where a transport expects the buffers of all_gather / all_to_all to live.
enum class MemorySpace { host, device };

//! The stream type of host transports: there is no stream, every call blocks until it is done.
struct HostStream {};

//! Reduction of the small all_reduce (on unsigned 64-bit integers; `sum` wraps modulo 2^64).
enum class ReduceOp { sum, min, max, bit_or };

//! Name of a ReduceOp ("sum", "min", "max", "bit_or").
inline const char* to_string(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::min: return "min";
    case ReduceOp::max: return "max";
    case ReduceOp::bit_or: return "bit_or";
  }
  return "invalid";
}

//! Writes to_string(op), or "ReduceOp(N)" for a value outside the enumeration.
inline std::ostream& operator<<(std::ostream& os, ReduceOp op) {
  const char* name = to_string(op);
  if (name[0] == 'i') return os << "ReduceOp(" << static_cast<int>(op) << ")";
  return os << name;
}

//! Bytes this rank has handed to the transport for other ranks (never counts the copy to itself),
//! split by whether the destination is on the same node. Logical point-to-point volume: an
//! all-gather of b bytes per rank counts b for every peer; an all-to-all counts b for every peer.
//! Only all_gather and all_to_all are counted (and only calls that returned normally; their
//! nonblocking forms when test() or wait() completes them); all_reduce,
//! barrier and split are control traffic and leave the counters alone. Each transport object
//! (a group or a sub-group made by split) has its own counters, starting at zero.
struct ByteCounters {
  std::uint64_t intra_node = 0;  //!< bytes for peers on this rank's node
  std::uint64_t inter_node = 0;  //!< bytes for peers on other nodes
  std::uint64_t calls = 0;       //!< number of all_gather and all_to_all calls
  //! intra_node + inter_node.
  std::uint64_t total() const noexcept { return intra_node + inter_node; }
};

namespace detail {

//! Validates a per-rank node table for a group of `size` ranks and converts it to int ids.
//! Empty table: every rank on node 0. Otherwise it needs one entry per rank, each in [0, INT_MAX].
inline std::vector<int> make_node_table(const char* function, const std::vector<long long>& table, int size) {
  if (table.empty()) return std::vector<int>(static_cast<std::size_t>(size), 0);
  QCOLL_REQUIRE(table.size() == static_cast<std::size_t>(size), function, "node_id_of_rank.size()",
                table.size(), "differs from the group size", size);
  std::vector<int> nodes(table.size());
  for (std::size_t r = 0; r < table.size(); ++r) {
    QCOLL_REQUIRE(table[r] >= 0 && table[r] <= INT_MAX, function, "node_id_of_rank[r]", table[r],
                  "is outside [0, INT_MAX] =", INT_MAX);
    nodes[r] = static_cast<int>(table[r]);
  }
  return nodes;
}

//! Number of ranks other than `rank` whose node id equals that of `rank`.
inline int count_same_node_peers(const std::vector<int>& nodes, int rank) {
  int n = 0;
  for (std::size_t r = 0; r < nodes.size(); ++r)
    if (static_cast<int>(r) != rank && nodes[r] == nodes[static_cast<std::size_t>(rank)]) ++n;
  return n;
}

//! Adds one data collective that sent `bytes` to each of `intra_peers` same-node peers and
//! `inter_peers` other-node peers.
inline void count_exchange(ByteCounters& c, int intra_peers, int inter_peers, std::size_t bytes) noexcept {
  c.intra_node += static_cast<std::uint64_t>(bytes) * static_cast<std::uint64_t>(intra_peers);
  c.inter_node += static_cast<std::uint64_t>(bytes) * static_cast<std::uint64_t>(inter_peers);
  ++c.calls;
}

//! True when the byte ranges [a, a + na) and [b, b + nb) share at least one byte.
inline bool ranges_overlap(const void* a, std::size_t na, const void* b, std::size_t nb) noexcept {
  if (na == 0 || nb == 0) return false;
  const auto pa = reinterpret_cast<std::uintptr_t>(a);
  const auto pb = reinterpret_cast<std::uintptr_t>(b);
  return pa >= pb ? pa - pb < nb : pb - pa < na;  // no sum, so no wrap-around near the top
}

//! Checks the arguments of all_gather; returns true when the call is in place
//! (send == recv + rank * bytes_per_rank). Throws qcoll::Error naming the bad argument.
inline bool check_all_gather(const char* function, const void* send, const void* recv,
                             std::size_t bytes_per_rank, int rank, int size) {
  QCOLL_REQUIRE(bytes_per_rank <= SIZE_MAX / static_cast<std::size_t>(size), function, "bytes_per_rank",
                bytes_per_rank, "times the group size overflows size_t; group size =", size);
  if (bytes_per_rank == 0) return send == recv;
  QCOLL_REQUIRE(send != nullptr, function, "send", "nullptr",
                "is not allowed with bytes_per_rank =", bytes_per_rank);
  QCOLL_REQUIRE(recv != nullptr, function, "recv", "nullptr",
                "is not allowed with bytes_per_rank =", bytes_per_rank);
  const std::size_t total = bytes_per_rank * static_cast<std::size_t>(size);
  const auto own =
      reinterpret_cast<std::uintptr_t>(recv) + static_cast<std::uintptr_t>(rank) * bytes_per_rank;
  if (reinterpret_cast<std::uintptr_t>(send) == own) return true;
  QCOLL_REQUIRE(!ranges_overlap(send, bytes_per_rank, recv, total), function, "send", send,
                "overlaps recv but is not the in-place block recv + rank * bytes_per_rank =",
                reinterpret_cast<const void*>(own));
  return false;
}

//! Checks the arguments of all_to_all (non-null buffers when bytes move, no overlap).
inline void check_all_to_all(const char* function, const void* send, const void* recv,
                             std::size_t bytes_per_rank, int size) {
  QCOLL_REQUIRE(bytes_per_rank <= SIZE_MAX / static_cast<std::size_t>(size), function, "bytes_per_rank",
                bytes_per_rank, "times the group size overflows size_t; group size =", size);
  if (bytes_per_rank == 0) return;
  QCOLL_REQUIRE(send != nullptr, function, "send", "nullptr",
                "is not allowed with bytes_per_rank =", bytes_per_rank);
  QCOLL_REQUIRE(recv != nullptr, function, "recv", "nullptr",
                "is not allowed with bytes_per_rank =", bytes_per_rank);
  const std::size_t total = bytes_per_rank * static_cast<std::size_t>(size);
  QCOLL_REQUIRE(!ranges_overlap(send, total, recv, total), function, "recv", recv,
                "overlaps the send buffer starting at", send);
}

//! Checks the arguments of all_reduce.
inline void check_all_reduce(const char* function, const std::uint64_t* data, std::size_t count,
                             ReduceOp op) {
  QCOLL_REQUIRE(op == ReduceOp::sum || op == ReduceOp::min || op == ReduceOp::max || op == ReduceOp::bit_or,
                function, "op", op, "is not one of", "sum, min, max, bit_or");
  QCOLL_REQUIRE(data != nullptr || count == 0, function, "data", "nullptr",
                "is not allowed with count =", count);
}

//! acc[i] = acc[i] (op) x[i] for i < n.
inline void reduce_into(std::uint64_t* acc, const std::uint64_t* x, std::size_t n, ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum:
      for (std::size_t i = 0; i < n; ++i) acc[i] += x[i];
      break;
    case ReduceOp::min:
      for (std::size_t i = 0; i < n; ++i) acc[i] = x[i] < acc[i] ? x[i] : acc[i];
      break;
    case ReduceOp::max:
      for (std::size_t i = 0; i < n; ++i) acc[i] = x[i] > acc[i] ? x[i] : acc[i];
      break;
    case ReduceOp::bit_or:
      for (std::size_t i = 0; i < n; ++i) acc[i] |= x[i];
      break;
  }
}

//! Checks `peer` for node_of and returns it as an index.
inline std::size_t check_peer(const char* function, int peer, int size) {
  QCOLL_REQUIRE(peer >= 0 && peer < size, function, "peer", peer, "is outside [0, size) with size =", size);
  return static_cast<std::size_t>(peer);
}

}  // namespace detail

QCOLL_NAMESPACE_END
