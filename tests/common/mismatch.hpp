// Counts the mismatches of a bit-exactness sweep and remembers the first one for the report.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace testing_support {

struct Mismatch {
  std::uint64_t count = 0;
  std::uint32_t x = 0;  // input bits of the first mismatch
  unsigned got = 0, want = 0;
  void add(std::uint32_t xb, unsigned g, unsigned w) {
    if (count++ == 0) {
      x = xb;
      got = g;
      want = w;
    }
  }
  std::string describe() const {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%llu mismatches; first: x bits 0x%08x got 0x%x want 0x%x",
                  static_cast<unsigned long long>(count), x, got, want);
    return buf;
  }
};

}  // namespace testing_support
