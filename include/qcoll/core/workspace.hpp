#pragma once
//! \file
//! Workspace carving, CUB's two-phase idiom: the same code computes a plan's workspace size (with
//! a null base) and hands out its pieces (with the user's buffer), so the two cannot disagree.

#include <cstddef>
#include <cstdint>

#include "config.hpp"

QCOLL_NAMESPACE_BEGIN

//! Alignment of every workspace piece and of the workspace itself, in bytes.
constexpr std::size_t kWorkspaceAlignment = 64;

//! Hands out aligned pieces of one buffer. With base == nullptr it only counts bytes.
class WorkspaceCarver {
 public:
  //! base: the workspace (kWorkspaceAlignment-aligned), or nullptr to measure.
  explicit WorkspaceCarver(void* base = nullptr) noexcept : base_(static_cast<unsigned char*>(base)) {}

  //! Reserves `count` objects of T (rounded up to the alignment); returns nullptr when measuring.
  template <class T>
  T* take(std::size_t count) noexcept {
    const std::size_t at = used_;
    used_ += (count * sizeof(T) + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
    return base_ ? reinterpret_cast<T*>(base_ + at) : nullptr;
  }

  //! Bytes reserved so far.
  std::size_t bytes() const noexcept { return used_; }

 private:
  unsigned char* base_;
  std::size_t used_ = 0;
};

QCOLL_NAMESPACE_END
