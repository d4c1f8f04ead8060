#pragma once
//! \file
//! qcoll::Error and the argument checks that raise it.

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

#include "config.hpp"

QCOLL_NAMESPACE_BEGIN

//! The one exception qcoll throws. Messages name what failed: for a bad argument, the function,
//! the argument, its value and the limit it broke; for an engine failure, the engine's message.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

//! Throws qcoll::Error "qcoll::FUNC: argument 'ARG' = VALUE RELATION LIMIT" unless `cond` holds.
//! VALUE and LIMIT may be stream chains (`a << "/" << b`). Example:
//! `QCOLL_REQUIRE(out_bytes >= need, "quantize", "out_bytes", out_bytes, "is below the required", need);`
#define QCOLL_REQUIRE(cond, function, argument, value, relation, limit)                                  \
  do {                                                                                                   \
    if (!(cond)) {                                                                                       \
      std::ostringstream qcoll_require_os_;                                                              \
      qcoll_require_os_ << "qcoll::" << function << ": argument '" << argument << "' = " << value << " " \
                        << relation << " " << limit;                                                     \
      throw ::qcoll::Error(qcoll_require_os_.str());                                                     \
    }                                                                                                    \
  } while (0)

//! Throws qcoll::Error "qcoll::FUNCTION: argument 'ARGUMENT' = ADDRESS is not aligned to ALIGNMENT
//! bytes" unless `ptr` is a multiple of `alignment` (a power of two). A null pointer is aligned
//! (null checks are separate). Typed data pointers (T*) are checked with alignof(T): qcoll loads
//! and stores them as T. O(1).
inline void check_aligned(const char* function, const char* argument, const void* ptr,
                          std::size_t alignment) {
  QCOLL_REQUIRE(reinterpret_cast<std::uintptr_t>(ptr) % alignment == 0, function, argument, ptr,
                "is not aligned to", alignment << " bytes");
}

QCOLL_NAMESPACE_END
