#pragma once
//! \file
//! Tensor groups: many tensors of one element type in one sharded buffer, each tensor in its own
//! slot of whole granules, so that no block of any format whose block divides the granule holds
//! elements of two tensors (one scale never spans the end of one weight matrix and the start of
//! the next).

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "../core/config.hpp"
#include "../core/error.hpp"
#include "../core/hash.hpp"
#include "shard.hpp"

QCOLL_NAMESPACE_BEGIN

//! A tensor's shape: numel elements, 1-D, or a rows x cols matrix (rows * cols = numel).
struct TensorShape {
  std::size_t numel = 0;  //!< elements
  std::size_t rows = 0;   //!< 0 for a 1-D tensor
  std::size_t cols = 0;   //!< 0 for a 1-D tensor

  TensorShape() = default;
  //! numel elements as rows x cols (both 0: 1-D). Explicit, so that a braced list of counts is
  //! never taken for a list of shapes.
  explicit TensorShape(std::size_t numel_, std::size_t rows_ = 0, std::size_t cols_ = 0)
      : numel(numel_), rows(rows_), cols(cols_) {}
  //! A 1-D tensor of n elements.
  static TensorShape vector(std::size_t n) { return TensorShape(n); }
  //! A rows x cols matrix (row-major; the group lays it out as rows * cols consecutive elements).
  static TensorShape matrix(std::size_t rows, std::size_t cols) {
    return TensorShape(rows * cols, rows, cols);
  }
};

//! A list of tensors laid out in one padded buffer for the collective plans: tensor k occupies
//! [offset(k), offset(k) + numel(k)); its slot runs to offset(k + 1), a multiple of granule()
//! (the padding is never read as data: blocks of the plans' formats exclude it from their
//! statistics, decoding writes it as zero). The slots are then sharded like a flat buffer
//! (ShardLayout): every rank gets shard_numel() elements, so shards stay balanced, and a tensor
//! may span several shards. Every plan that takes a ShardLayout takes a TensorGroup (it converts
//! to its layout()); a group of one tensor is exactly the flat layout of that tensor (same bytes
//! on the wire). Device plans take groups too (same bytes as the host plans; they copy the slot
//! table to device memory once, at construction). All sizes and offsets are in elements.
class TensorGroup {
 public:
  //! The part of one tensor that lies in one shard.
  struct Piece {
    std::size_t tensor;         //!< tensor index k
    std::size_t tensor_offset;  //!< first element of the piece within the tensor
    std::size_t offset;         //!< its position in the full buffer
    std::size_t count;          //!< elements (0: the tensor has no data in the shard)
  };

  //! Tensors of the given element counts over `parts` shards with slots of whole `granule`s
  //! (granule_for(sizeof(T), {every block size the plans use})). Throws qcoll::Error naming the
  //! argument if parts < 1, granule = 0, or the padded size overflows std::size_t. O(tensors).
  TensorGroup(const std::vector<std::size_t>& numels, int parts, std::size_t granule)
      : TensorGroup(shapes_of(numels), parts, granule, 0) {}

  //! As the constructor, with shapes (a matrix's rows and cols become part of the group's
  //! description, which every rank must give identically). Also throws if a shape's rows * cols
  //! differs from its numel.
  static TensorGroup from_shapes(std::vector<TensorShape> shapes, int parts, std::size_t granule) {
    return TensorGroup(std::move(shapes), parts, granule, 0);
  }

 private:
  TensorGroup(std::vector<TensorShape> shapes, int parts, std::size_t granule, int)
      : shapes_(std::move(shapes)), layout_(0, parts, granule) {
    const char* fn = "TensorGroup";
    constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
    auto slots = std::make_shared<detail::GroupSlots>();
    slots->slot_start.reserve(shapes_.size());
    slots->data_end.reserve(shapes_.size());
    Fnv1a h;
    h.mix(shapes_.size());
    std::size_t at = 0, data_end = 0;
    for (std::size_t k = 0; k < shapes_.size(); ++k) {
      const TensorShape& s = shapes_[k];
      QCOLL_REQUIRE(
          s.rows == 0 ? s.cols == 0 : s.cols != 0 && s.numel / s.cols == s.rows && s.numel % s.cols == 0, fn,
          "shapes[" << k << "]", s.rows << " x " << s.cols, "does not match its element count", s.numel);
      const std::size_t units = s.numel / granule + (s.numel % granule != 0 ? 1 : 0);
      QCOLL_REQUIRE(units <= (kMax - at) / granule, fn, "shapes[" << k << "].numel", s.numel,
                    "makes the group's padded size overflow std::size_t after", at);
      slots->slot_start.push_back(at);
      slots->data_end.push_back(at + s.numel);
      if (s.numel > 0) data_end = at + s.numel;
      at += units * granule;
      h.mix(s.numel).mix(s.rows).mix(s.cols);
    }
    slots->fingerprint = h.value == 0 ? 1 : h.value;
    data_numel_ = 0;
    for (const TensorShape& s : shapes_) data_numel_ += s.numel;
    // One tensor (or none) is a flat buffer: no table, so the plans run exactly as for a ShardLayout.
    layout_ = shapes_.size() <= 1 ? ShardLayout(data_end, parts, granule)
                                  : ShardLayout(data_end, parts, granule, std::move(slots));
  }

 public:
  //! Number of tensors.
  std::size_t size() const noexcept { return shapes_.size(); }
  //! Elements of tensor k. Throws qcoll::Error if k >= size().
  std::size_t numel(std::size_t k) const { return shape(k).numel; }
  //! Shape of tensor k. Throws qcoll::Error if k >= size().
  const TensorShape& shape(std::size_t k) const {
    check_tensor("TensorGroup::shape", k);
    return shapes_[k];
  }
  //! Position of tensor k's first element in the full buffer (a multiple of granule()). Throws
  //! qcoll::Error if k >= size().
  std::size_t offset(std::size_t k) const {
    check_tensor("TensorGroup::offset", k);
    const SlotTable t = layout_.slots();
    return t.slots == 0 ? 0 : t.slot_start[k];
  }
  //! Elements of tensor k's slot: numel(k) rounded up to whole granules. Throws if k >= size().
  std::size_t slot_numel(std::size_t k) const {
    const std::size_t n = numel(k), g = layout_.granule();
    return (n / g + (n % g != 0 ? 1 : 0)) * g;
  }
  //! Elements of data over all tensors (no padding).
  std::size_t data_numel() const noexcept { return data_numel_; }
  //! Size of the full buffer (ShardLayout::padded_numel of layout()).
  std::size_t padded_numel() const noexcept { return layout_.padded_numel(); }
  //! Elements per shard.
  std::size_t shard_numel() const noexcept { return layout_.shard_numel(); }
  //! Number of shards.
  int parts() const noexcept { return layout_.parts(); }
  //! Slot granule in elements.
  std::size_t granule() const noexcept { return layout_.granule(); }
  //! Hash of the tensor list (counts and shapes); 0 for a group of at most one tensor, which is a
  //! flat layout. Part of every plan's identity, so ranks with different groups are rejected.
  std::uint64_t fingerprint() const noexcept { return layout_.group_fingerprint(); }

  //! The sharded layout of the group's buffer, which the plans take.
  const ShardLayout& layout() const noexcept { return layout_; }
  //! The plans take a group wherever they take a ShardLayout.
  operator const ShardLayout&() const noexcept { return layout_; }

  //! The part of tensor k in shard r (count 0 when none). Throws qcoll::Error if k >= size() or r
  //! is outside [0, parts()). O(1).
  Piece piece(std::size_t k, int r) const {
    const std::size_t first = offset(k), n = shapes_[k].numel;
    const std::size_t lo = layout_.shard_offset(r), hi = lo + layout_.shard_numel();
    const std::size_t a = first > lo ? first : lo, b = first + n < hi ? first + n : hi;
    if (a >= b) return Piece{k, 0, first, 0};
    return Piece{k, a - first, a, b - a};
  }

  //! Calls fn(piece) for every tensor with data in shard r, in order of position. Throws
  //! qcoll::Error if r is outside [0, parts()). O(log tensors + pieces).
  template <class Fn>
  void for_each_piece(int r, Fn&& fn) const {
    const std::size_t lo = layout_.shard_offset(r), hi = lo + layout_.shard_numel();
    const SlotTable t = layout_.slots();
    if (t.slots == 0) {
      if (!shapes_.empty()) {
        const Piece p = piece(0, r);
        if (p.count > 0) fn(p);
      }
      return;
    }
    // The first tensor whose data ends after lo (data ends ascend with the slots).
    for (std::size_t k = detail::count_at_most(t.data_end, t.slots, lo); k < t.slots && t.slot_start[k] < hi;
         ++k) {
      const Piece p = piece(k, r);
      if (p.count > 0) fn(p);
    }
  }

  //! Padding the group adds over the flat layout of its data_numel() elements, as a fraction of
  //! that layout's padded size (0 when the flat layout is empty). O(1).
  double padding_overhead() const {
    const ShardLayout flat(data_numel_, parts(), granule());
    if (flat.padded_numel() == 0) return 0.0;
    return static_cast<double>(padded_numel() - flat.padded_numel()) /
           static_cast<double>(flat.padded_numel());
  }

 private:
  static std::vector<TensorShape> shapes_of(const std::vector<std::size_t>& numels) {
    std::vector<TensorShape> s;
    s.reserve(numels.size());
    for (std::size_t n : numels) s.push_back(TensorShape::vector(n));
    return s;
  }
  void check_tensor(const char* fn, std::size_t k) const {
    QCOLL_REQUIRE(k < shapes_.size(), fn, "k", k, "is outside [0, size()) with size()", shapes_.size());
  }

  std::vector<TensorShape> shapes_;
  ShardLayout layout_;
  std::size_t data_numel_ = 0;
};

QCOLL_NAMESPACE_END
