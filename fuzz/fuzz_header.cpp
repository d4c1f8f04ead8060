// libFuzzer target: message headers and the sizes derived from element counts.
//
// Input: [format id][block selector][sizeof(MessageHeader) header bytes][8 bytes n][2 bytes: a run-time
// format id and a block exponent for dispatch_format]. Contracts: check_header accepts a header exactly when
// its fields are F's with count n, and otherwise throws qcoll::Error (formatting any field without
// undefined behaviour); make_header's headers pass; packed_bytes is exact up to max_count and
// saturates above it, where checked_packed_bytes throws; dispatch_format accepts exactly the
// documented (format, block) pairs.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include <qcoll/format/dispatch.hpp>
#include <qcoll/format/message.hpp>

#include "fuzz_input.hpp"

namespace {

template <class F>
void check_sizes(std::size_t n) {
  using namespace qcoll;
  using L = MessageLayout<F>;
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
  const std::size_t bytes = packed_bytes<F>(n);
  const unsigned __int128 exact = fuzz::exact_bytes<F>(n);
  // max_count is the largest whole-block count whose size fits: above it a size would not.
  fuzz::expect(n > max_count<F>() || exact == bytes, "packed_bytes differs from the exact size");
  fuzz::expect(n <= max_count<F>() || exact + 64 + 2 * F::block > kMax || n > kMax - F::block,
               "max_count rejects a count whose size fits with room to spare");
  if (n <= max_count<F>()) {
    fuzz::expect(!fuzz::throws_error([&] { checked_packed_bytes<F>(n, "fuzz", "n"); }),
                 "checked_packed_bytes rejects a count within max_count");
    fuzz::expect(checked_packed_bytes<F>(n, "fuzz", "n") == bytes, "checked and plain sizes differ");
    const std::size_t nb = L::blocks(n);
    fuzz::expect(nb * F::block >= n && nb * F::block - n < F::block, "blocks(n) is not ceil(n / block)");
    // The areas the decoders read lie inside the message.
    fuzz::expect(L::codes_offset + nb * L::block_code_bytes <= L::metas_offset(n), "codes overlap metas");
    fuzz::expect(L::metas_offset(n) + nb * F::meta_bytes <= bytes, "metas run past the message");
    fuzz::expect(bytes < kMax, "a size within the limit equals the saturated value");
  } else {
    fuzz::expect(bytes == kMax, "packed_bytes above max_count does not saturate");
    fuzz::expect(fuzz::throws_error([&] { checked_packed_bytes<F>(n, "fuzz", "n"); }),
                 "checked_packed_bytes accepts a count above max_count");
  }
}

template <class F>
void check(const qcoll::MessageHeader& h, std::size_t n) {
  using namespace qcoll;
  const bool want_ok = h.magic == kMessageMagic && h.format == static_cast<std::uint8_t>(F::id) &&
                       h.log2_block == log2_exact(F::block) && h.count == n;
  const bool threw = fuzz::throws_error([&] { check_header<F>(h, n, "fuzz", "message"); });
  fuzz::expect(threw == !want_ok, "check_header's verdict differs from the header's fields");
  const MessageHeader made = make_header<F>(n);
  fuzz::expect(!fuzz::throws_error([&] { check_header<F>(made, n, "fuzz", "made"); }),
               "make_header's header is rejected");
  check_sizes<F>(n);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Reader in(data, size);
  const std::uint8_t id = in.u8(), block_sel = in.u8();
  qcoll::MessageHeader h;
  unsigned char raw[sizeof h];
  for (unsigned char& b : raw) b = in.u8();
  std::memcpy(&h, raw, sizeof h);
  const std::size_t n = in.u64();
  const std::uint8_t rt_id = in.u8(), rt_log2 = in.u8();
  fuzz::with_format(id, block_sel, [&](auto f) { check<decltype(f)>(h, n); });

  // Run-time dispatch: any id and block either reaches a format of that id and block or throws.
  const std::size_t block = rt_log2 < 64 ? std::size_t{1} << rt_log2 : 0;
  std::uint8_t got_id = 0;
  std::size_t got_block = 0;
  const bool threw = fuzz::throws_error([&] {
    qcoll::dispatch_format(static_cast<qcoll::FormatId>(rt_id), block, [&](auto f) {
      using F = decltype(f);
      got_id = static_cast<std::uint8_t>(F::id);
      got_block = F::block;
      return 0;
    });
  });
  if (!threw) {
    fuzz::expect(got_id == rt_id, "dispatch_format reached another format");
    fuzz::expect(got_block == block || (block == 0 && rt_id >= 10), "dispatch_format reached another block");
  }
  return 0;
}
