#pragma once
//! \file
//! Error feedback for the quantized reduce-scatter (and the all-reduce built on it): the residual
//! state a caller owns, its options and its layout.
//!
//! With error feedback a rank does not send Q(x_t) but c_t = Q(x_t + e_t), and keeps
//! e_{t+1} = decay · (x_t + e_t - c_t): what the code failed to carry this step is sent in later
//! steps, so over T steps Σ c_t = Σ x_t - e_T (decay 1, exact arithmetic) instead of an error that
//! grows with T. A two-hop reduce-scatter quantizes twice, and each hop may carry its own residual:
//! hop 1 over the rank's whole padded gradient (indexed like the gradient), hop 2 over the partial
//! sums the rank re-quantizes (indexed like its hop-1 sum: node slice m, element i). LoCo's
//! variant (arXiv 2407.04480) stores the residual compactly and decays it; both are options here.

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "../core/error.hpp"
#include "../core/fpmath.hpp"
#include "../core/half.hpp"
#include "../core/workspace.hpp"

QCOLL_NAMESPACE_BEGIN

//! How a residual is stored.
enum class ResidualStorage : std::uint8_t {
  f32,   //!< fp32: the identity Σ c_t = Σ x_t - e_T holds to fp32 rounding
  bf16,  //!< bfloat16 (half the memory; the residual is rounded to 8 significant bits each step)
};

//! Error-feedback options of a residual state (fixed when the state is initialised).
struct FeedbackOptions {
  bool hop1 = true;    //!< carry the error of the rank's own (hop-1, or only) messages
  bool hop2 = true;    //!< carry the error of the re-quantized partial sums (two hops only)
  float decay = 1.0f;  //!< e_{t+1} = decay · (what the code failed to carry); in (0, 1]
  ResidualStorage storage = ResidualStorage::f32;  //!< fp32 or bf16
};

namespace detail {

//! The first 64 bytes of a residual state: what it belongs to and how it is kept.
struct ResidualHeader {
  std::uint32_t magic;   //!< kResidualMagic
  std::uint8_t hop1;     //!< FeedbackOptions::hop1
  std::uint8_t hop2;     //!< FeedbackOptions::hop2
  std::uint8_t storage;  //!< ResidualStorage
  std::uint8_t reserved0;
  float decay;  //!< FeedbackOptions::decay
  std::uint32_t reserved1;
  std::uint64_t plan;  //!< the plan identity's hash (call number 0)
  std::uint64_t n1;    //!< hop-1 residual elements (0 when off)
  std::uint64_t n2;    //!< hop-2 residual elements (0 when off)
  std::uint64_t reserved2[3];
};
static_assert(sizeof(ResidualHeader) == 64, "the residual header is 64 bytes");

//! "qRes" little-endian.
constexpr std::uint32_t kResidualMagic = 0x73655271u;

//! Bytes of one residual element.
inline std::size_t residual_element_bytes(ResidualStorage s) { return s == ResidualStorage::f32 ? 4 : 2; }

//! One hop's residual: n elements of `storage` at `data` (aligned to the storage type).
struct ResidualSpan {
  unsigned char* data = nullptr;
  std::size_t n = 0;
  ResidualStorage storage = ResidualStorage::f32;

  //! Element i as fp32 (0 when the span is empty).
  float get(std::size_t i) const {
    if (storage == ResidualStorage::f32) {
      float v;
      std::memcpy(&v, data + 4 * i, 4);
      return v;
    }
    bfloat16 v;
    std::memcpy(&v, data + 2 * i, 2);
    return to_float(v);
  }
  //! Stores v as element i.
  void set(std::size_t i, float v) const {
    if (storage == ResidualStorage::f32) {
      std::memcpy(data + 4 * i, &v, 4);
    } else {
      const bfloat16 b = from_float<bfloat16>(v);
      std::memcpy(data + 2 * i, &b, 2);
    }
  }
};

//! Byte layout of a residual state for n1 + n2 elements: header, hop-1 span, hop-2 span, each at a
//! multiple of kWorkspaceAlignment.
struct ResidualLayout {
  std::size_t n1, n2;
  ResidualStorage storage;
  std::size_t hop1_offset() const { return sizeof(ResidualHeader); }
  std::size_t hop2_offset() const {
    return hop1_offset() + (n1 * residual_element_bytes(storage) + kWorkspaceAlignment - 1) /
                               kWorkspaceAlignment * kWorkspaceAlignment;
  }
  std::size_t bytes() const { return hop2_offset() + n2 * residual_element_bytes(storage); }
};

}  // namespace detail
QCOLL_NAMESPACE_END
