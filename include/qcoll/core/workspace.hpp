#pragma once
//! \file
//! Workspace carving, CUB's two-phase idiom: the same code computes a plan's workspace size (with
//! a null base) and hands out its pieces (with the user's buffer), so the two cannot disagree.

#include <cstddef>
#include <cstdint>

#include "checked.hpp"
#include "config.hpp"

QCOLL_NAMESPACE_BEGIN

//! Alignment of every workspace piece and of the workspace itself, in bytes.
constexpr std::size_t kWorkspaceAlignment = 64;

//! Hands out aligned pieces of one buffer. With base == nullptr it only counts bytes.
class WorkspaceCarver {
 public:
  //! base: the workspace (kWorkspaceAlignment-aligned), or nullptr to measure.
  explicit WorkspaceCarver(void* base = nullptr) noexcept : base_(static_cast<unsigned char*>(base)) {}

  //! Reserves `count` * `copies` objects of T (rounded up to the alignment); returns nullptr when
  //! measuring. Throws qcoll::Error, naming the count and the limit, if the piece's size or the
  //! workspace's total does not fit in std::size_t. O(1).
  template <class T>
  T* take(std::size_t count, std::size_t copies = 1) {
    const char* fn = "WorkspaceCarver::take";
    const std::size_t objects = checked_mul(count, copies, fn, "count");
    const std::size_t bytes =
        checked_round_up(checked_mul(objects, sizeof(T), fn, "count"), kWorkspaceAlignment, fn, "count");
    const std::size_t at = used_;
    used_ = checked_add(used_, bytes, fn, "workspace bytes");
    return base_ ? reinterpret_cast<T*>(base_ + at) : nullptr;
  }

  //! Bytes reserved so far.
  std::size_t bytes() const noexcept { return used_; }

 private:
  unsigned char* base_;
  std::size_t used_ = 0;
};

QCOLL_NAMESPACE_END
