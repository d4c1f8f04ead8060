#pragma once
//! \file
//! Shard layouts: the primary partition of a flat buffer over all ranks (qcoll::ShardLayout) and
//! the secondary partition over the ranks of one node for hpZ (qcoll::SecondaryLayout).

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <vector>

#include "../core/config.hpp"
#include "../core/error.hpp"
#include "topology.hpp"

QCOLL_NAMESPACE_BEGIN

//! Number of elements of the range [offset, offset + count) that lie below `numel`, i.e. that hold
//! data rather than padding. For kernels masking the tail of a shard or block. O(1).
QCOLL_HOST_DEVICE std::size_t valid_elements_in(std::size_t numel, std::size_t offset, std::size_t count) {
  if (offset >= numel) return 0;
  const std::size_t rest = numel - offset;
  return rest < count ? rest : count;
}

//! Where the data of a tensor group's buffer lies: tensor k holds the n_k elements starting at
//! slot_start[k] (a multiple of the group's granule); the rest of its slot, up to the next tensor's
//! slot_start, is padding. Starts ascend; an empty tensor's slot has no elements. Read through
//! data_in_slots. Built by TensorGroup (layout/group.hpp) in host memory; a device plan keeps a
//! device copy for its kernels.
struct SlotTable {
  const std::size_t* slot_start = nullptr;  //!< first element of tensor k's slot
  const std::size_t* data_end = nullptr;    //!< slot_start[k] + n_k
  std::size_t slots = 0;                    //!< number of tensors (0: no table, the buffer is flat)
};

namespace detail {
//! Number of the first n elements of the ascending array v that are <= x (the index where x would
//! be inserted after its equals). O(log n).
QCOLL_HOST_DEVICE std::size_t count_at_most(const std::size_t* v, std::size_t n, std::size_t x) {
  std::size_t lo = 0, hi = n;
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (v[mid] <= x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}
}  // namespace detail

//! Elements of data at the start of [offset, offset + count): the data elements of offset's tensor
//! from `offset` on, at most `count` (a range inside one tensor's slot, such as a block of a layout
//! whose granule is a multiple of the block, gets exactly its data; a longer one, the data up to
//! the end of offset's tensor). O(log slots) (binary search).
QCOLL_HOST_DEVICE std::size_t data_in_slots(const SlotTable& t, std::size_t offset, std::size_t count) {
  // The last tensor whose slot starts at or before offset (empty tensors sharing that start come
  // before the one that holds data, so the last is the right one).
  const std::size_t k = detail::count_at_most(t.slot_start, t.slots, offset);
  if (k == 0) return 0;
  const std::size_t end = t.data_end[k - 1];
  if (end <= offset) return 0;
  return end - offset < count ? end - offset : count;
}

//! True when global position `pos` holds data by the table (always for slots = 0, a flat buffer,
//! whose tail the caller masks). O(log slots).
QCOLL_HOST_DEVICE bool is_data_in_slots(const SlotTable& t, std::size_t pos) {
  return t.slots == 0 || data_in_slots(t, pos, 1) != 0;
}

namespace detail {
//! The tensors of a group as a ShardLayout carries them (layout/group.hpp builds it).
struct GroupSlots {
  std::vector<std::size_t> slot_start;  //!< first element of tensor k's slot
  std::vector<std::size_t> data_end;    //!< slot_start[k] + numel of tensor k
  std::uint64_t fingerprint = 0;        //!< hash of the tensor list (sizes and shapes)
};
}  // namespace detail

//! Primary partition: a flat buffer of numel() elements is padded up to padded_numel(), the
//! smallest multiple of parts() * granule() that is >= numel(), and cut into parts() equal shards
//! of shard_numel() elements; shard r (starting at shard_offset(r)) belongs to rank r. Elements at
//! positions >= numel() are padding. A layout with numel() = 0 has padded_numel() = 0 and
//! shard_numel() = 0: every shard is empty. All sizes and offsets are in elements.
//!
//! A layout made from a TensorGroup (layout/group.hpp) of two or more tensors also has padding
//! below numel(): the end of each tensor's slot. data_in() and for_each_padding() say where; a
//! one-tensor group is a flat layout.
class ShardLayout {
 public:
  //! `parts` >= 1 shards; `granule` >= 1 elements (usually from granule_for). Throws qcoll::Error if
  //! `parts` < 1, `granule` = 0, or the padded size does not fit in std::size_t. O(1).
  ShardLayout(std::size_t numel, int parts, std::size_t granule)
      : numel_(numel), parts_(parts), granule_(granule) {
    const char* fn = "ShardLayout";
    constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
    QCOLL_REQUIRE(parts >= 1, fn, "parts", parts, "is below the minimum", 1);
    QCOLL_REQUIRE(granule >= 1, fn, "granule", granule, "is below the minimum", 1);
    const std::size_t p = static_cast<std::size_t>(parts);
    QCOLL_REQUIRE(granule <= kMax / p, fn, "granule", granule, "times parts overflows std::size_t; parts is",
                  parts);
    const std::size_t unit = p * granule;
    const std::size_t units = numel / unit + (numel % unit != 0 ? 1 : 0);
    QCOLL_REQUIRE(units <= kMax / unit, fn, "numel", numel,
                  "padded to a multiple of parts * granule overflows std::size_t; parts * granule is", unit);
    padded_numel_ = units * unit;
    shard_numel_ = padded_numel_ / p;
  }

  //! The layout of a tensor group's buffer (TensorGroup::layout() calls it): numel is the end of
  //! the last tensor's data, `slots` where each tensor's data lies. O(1) beyond the flat layout.
  ShardLayout(std::size_t numel, int parts, std::size_t granule,
              std::shared_ptr<const detail::GroupSlots> slots)
      : ShardLayout(numel, parts, granule) {
    group_ = std::move(slots);
  }

  //! Elements of data (before padding).
  std::size_t numel() const noexcept { return numel_; }
  //! Number of shards (ranks).
  int parts() const noexcept { return parts_; }
  //! Granule in elements; padded_numel() and every shard size are multiples of it.
  std::size_t granule() const noexcept { return granule_; }
  //! Size of the padded buffer: the smallest multiple of parts() * granule() that is >= numel().
  std::size_t padded_numel() const noexcept { return padded_numel_; }
  //! Elements per shard: padded_numel() / parts().
  std::size_t shard_numel() const noexcept { return shard_numel_; }

  //! First element of shard `r`: r * shard_numel(). Throws qcoll::Error if `r` is outside [0, parts()).
  std::size_t shard_offset(int r) const {
    check_part("ShardLayout::shard_offset", r);
    return static_cast<std::size_t>(r) * shard_numel_;
  }
  //! Elements of shard `r` that hold data (positions < numel()); they come first in the shard, the
  //! rest is padding. May be 0. Throws qcoll::Error if `r` is outside [0, parts()).
  std::size_t valid_in_shard(int r) const {
    check_part("ShardLayout::valid_in_shard", r);
    return valid_elements_in(numel_, static_cast<std::size_t>(r) * shard_numel_, shard_numel_);
  }

  //! True for the layout of a group of two or more tensors (padding inside [0, numel)).
  bool grouped() const noexcept { return group_ != nullptr; }
  //! Hash of the group's tensor list; 0 for a flat layout (and a one-tensor group).
  std::uint64_t group_fingerprint() const noexcept { return group_ ? group_->fingerprint : 0; }
  //! The group's slot table (slots = 0 for a flat layout), for SourceMap and kernels on the host.
  SlotTable slots() const noexcept {
    if (!group_) return SlotTable{};
    return SlotTable{group_->slot_start.data(), group_->data_end.data(), group_->slot_start.size()};
  }

  //! Elements of data at the start of [offset, offset + count): for a range inside one block of a
  //! format whose block divides granule() (so inside one tensor's slot), its data; for a longer
  //! range, the run of data from offset on (up to the end of offset's tensor's data, grouped).
  //! Flat: those below numel(). O(1) flat, O(log tensors) grouped.
  std::size_t data_in(std::size_t offset, std::size_t count) const noexcept {
    return group_ ? data_in_slots(slots(), offset, count) : valid_elements_in(numel_, offset, count);
  }

  //! Calls fn(first, count) for each run of padding inside [offset, offset + count) below numel()
  //! (the ends of tensor slots; none for a flat layout), in ascending order; positions are global.
  //! O(log tensors + runs).
  template <class Fn>
  void for_each_inner_padding(std::size_t offset, std::size_t count, Fn&& fn) const {
    if (!group_) return;
    if (offset >= numel_) return;
    const std::size_t end = count < numel_ - offset ? offset + count : numel_;
    const std::vector<std::size_t>& start = group_->slot_start;
    const std::vector<std::size_t>& data_end = group_->data_end;
    // First tensor whose slot ends after offset: the last one starting at or before it.
    const std::size_t lo = detail::count_at_most(start.data(), start.size(), offset);
    for (std::size_t k = lo == 0 ? 0 : lo - 1; k < start.size() && start[k] < end; ++k) {
      const std::size_t slot_end = k + 1 < start.size() ? start[k + 1] : padded_numel_;
      const std::size_t a = data_end[k] > offset ? data_end[k] : offset;
      const std::size_t b = slot_end < end ? slot_end : end;
      if (a < b) fn(a, b - a);
    }
  }

  //! Sets to zero every element of out[0, count) that is padding below numel(), `out` holding the
  //! buffer's elements from global position `offset` on. No-op for a flat layout.
  template <class T>
  void zero_inner_padding(T* out, std::size_t offset, std::size_t count) const {
    for_each_inner_padding(offset, count, [&](std::size_t first, std::size_t n) {
      for (std::size_t i = 0; i < n; ++i) out[first - offset + i] = T{};
    });
  }

  //! Same numel, parts, granule and tensor group.
  bool operator==(const ShardLayout& o) const noexcept {
    return numel_ == o.numel_ && parts_ == o.parts_ && granule_ == o.granule_ &&
           group_fingerprint() == o.group_fingerprint();
  }
  bool operator!=(const ShardLayout& o) const noexcept { return !(*this == o); }

 private:
  void check_part(const char* fn, int r) const {
    QCOLL_REQUIRE(r >= 0 && r < parts_, fn, "r", r, "is outside [0, parts) with parts", parts_);
  }

  std::size_t numel_;
  int parts_;
  std::size_t granule_;
  std::size_t padded_numel_ = 0;
  std::size_t shard_numel_ = 0;
  std::shared_ptr<const detail::GroupSlots> group_;
};

namespace detail {
inline std::size_t gcd_size(std::size_t a, std::size_t b) noexcept {
  while (b != 0) {
    const std::size_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}
}  // namespace detail

//! Smallest granule, in elements of `elem_bytes` bytes each, that is a multiple of every block size
//! in `block_sizes` (elements) and whose byte size is a multiple of 16, so every shard of a layout
//! built with it starts 16-byte aligned and holds whole blocks. An empty list means no block
//! constraint. Throws qcoll::Error if `elem_bytes` = 0, a block size is 0, or the result overflows
//! std::size_t. O(number of block sizes).
inline std::size_t granule_for(std::size_t elem_bytes, std::initializer_list<std::size_t> block_sizes) {
  const char* fn = "granule_for";
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
  QCOLL_REQUIRE(elem_bytes >= 1, fn, "elem_bytes", elem_bytes, "is below the minimum", 1);
  // g * elem_bytes is a multiple of 16 exactly when g is a multiple of 16 / gcd(16, elem_bytes).
  std::size_t g = 16 / detail::gcd_size(16, elem_bytes);
  for (std::size_t b : block_sizes) {
    QCOLL_REQUIRE(b >= 1, fn, "block_sizes", b, "contains a block size below the minimum", 1);
    const std::size_t factor = b / detail::gcd_size(g, b);
    QCOLL_REQUIRE(factor <= kMax / g, fn, "block_sizes", b,
                  "makes the least common multiple overflow std::size_t; the multiple so far is", g);
    g *= factor;
  }
  return g;
}

//! Secondary partition (hpZ): the same padded buffer as a primary layout over W = N * L ranks, cut
//! into L shards for the L ranks of a node. Secondary shard j (held by the node's rank with local
//! index j) is the run of N consecutive primary shards [j * N, (j + 1) * N), so it can be taken
//! from the gathered full buffer without communication. Independent of the rank placement: only
//! N and L matter. Sizes and offsets in elements.
class SecondaryLayout {
 public:
  //! Throws qcoll::Error unless primary.parts() == topo.world_size(). O(1).
  SecondaryLayout(const ShardLayout& primary, const Topology& topo)
      : numel_(primary.numel()),
        padded_numel_(primary.padded_numel()),
        primary_shard_numel_(primary.shard_numel()),
        num_nodes_(topo.num_nodes()),
        parts_(topo.ranks_per_node()) {
    QCOLL_REQUIRE(primary.parts() == topo.world_size(), "SecondaryLayout", "primary.parts()", primary.parts(),
                  "differs from the world size of topo", topo.world_size());
  }

  //! Number of secondary shards: L, the ranks per node.
  int parts() const noexcept { return parts_; }
  //! Primary shards per secondary shard: N, the number of nodes.
  int primary_shards_per_shard() const noexcept { return num_nodes_; }
  //! Elements of data in the buffer (the primary layout's numel()).
  std::size_t numel() const noexcept { return numel_; }
  //! Size of the padded buffer (the primary layout's padded_numel()); L * shard_numel().
  std::size_t padded_numel() const noexcept { return padded_numel_; }
  //! Elements per secondary shard: N * primary shard_numel().
  std::size_t shard_numel() const noexcept {
    return static_cast<std::size_t>(num_nodes_) * primary_shard_numel_;
  }
  //! First element of secondary shard `local_index`, in the padded buffer. Throws qcoll::Error if
  //! `local_index` is outside [0, L).
  std::size_t shard_offset(int local_index) const {
    check_part("SecondaryLayout::shard_offset", local_index);
    return static_cast<std::size_t>(local_index) * shard_numel();
  }
  //! Index of the first primary shard inside secondary shard `local_index`: local_index * N.
  //! Throws qcoll::Error if `local_index` is outside [0, L).
  int first_primary_shard(int local_index) const {
    check_part("SecondaryLayout::first_primary_shard", local_index);
    return local_index * num_nodes_;
  }
  //! Elements of secondary shard `local_index` that hold data (positions < numel()); may be 0.
  //! Throws qcoll::Error if `local_index` is outside [0, L).
  std::size_t valid_in_shard(int local_index) const {
    check_part("SecondaryLayout::valid_in_shard", local_index);
    return valid_elements_in(numel_, static_cast<std::size_t>(local_index) * shard_numel(), shard_numel());
  }

 private:
  void check_part(const char* fn, int local_index) const {
    QCOLL_REQUIRE(local_index >= 0 && local_index < parts_, fn, "local_index", local_index,
                  "is outside [0, ranks per node) with ranks per node", parts_);
  }

  std::size_t numel_;
  std::size_t padded_numel_;
  std::size_t primary_shard_numel_;
  int num_nodes_;
  int parts_;
};

QCOLL_NAMESPACE_END
