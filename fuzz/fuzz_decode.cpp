// libFuzzer target: decoding messages of every format from arbitrary bytes.
//
// Input: [format id][block selector][mode][message bytes...]. The message is decoded with
// host::dequantize (into float, half or bfloat16) or host::dequantize_accumulate, with n taken from
// the message's own header (a hostile sender chooses it). Contracts: a call either throws
// qcoll::Error or returns the header's flags; it reads only the message's bytes and writes only
// out[0, n) (AddressSanitizer checks both: the message ends where the fuzzer's buffer ends, the
// output vector holds exactly n elements); whenever the message is shorter than packed_bytes<F>(n)
// it throws before touching the output.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include <qcoll/host/quantize.hpp>

#include "fuzz_input.hpp"

namespace {

// Outputs are allocated only up to this many elements; a larger n needs a message of at least
// n / 2 bytes, far beyond what the fuzzer sends, so it must be rejected.
constexpr std::size_t kMaxOutput = std::size_t{1} << 20;

template <class F, class T>
void decode(const std::uint8_t* msg, std::size_t bytes, std::size_t n, bool accumulate) {
  using namespace qcoll;
  qcoll::MessageHeader h{};
  if (bytes >= sizeof h) std::memcpy(&h, msg, sizeof h);
  const bool short_message = bytes < fuzz::exact_bytes<F>(n);
  if (n > kMaxOutput) {
    if (!short_message) return;  // a caller would need a real output of n elements
    T canary[4] = {};
    fuzz::expect(fuzz::throws_error([&] {
                   if constexpr (std::is_same<T, float>::value) {
                     if (accumulate) {
                       host::dequantize_accumulate<F>(msg, bytes, canary, n);
                       return;
                     }
                   }
                   host::dequantize<F>(msg, bytes, canary, n);
                 }),
                 "a message shorter than its announced count was accepted");
    return;
  }
  std::vector<T> out(n, from_float<T>(1.0f));
  std::uint32_t flags = 0;
  const bool threw = fuzz::throws_error([&] {
    if constexpr (std::is_same<T, float>::value) {
      if (accumulate) {
        flags = host::dequantize_accumulate<F>(msg, bytes, out.data(), n);
        return;
      }
    }
    flags = host::dequantize<F>(msg, bytes, out.data(), n);
  });
  if (threw) {
    for (const T& v : out)
      fuzz::expect(std::memcmp(&v, &out[0], sizeof v) == 0 && to_float(v) == 1.0f,
                   "a rejected decode wrote its output");
    return;
  }
  fuzz::expect(!short_message, "a short message was decoded");
  fuzz::expect(flags == h.flags, "the returned flags are not the header's");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Reader in(data, size);
  const std::uint8_t id = in.u8(), block_sel = in.u8(), mode = in.u8();
  const std::uint8_t* msg = in.rest();
  const std::size_t bytes = in.rest_size();
  std::uint64_t n = 0;
  if (bytes >= 16) std::memcpy(&n, msg + 8, 8);           // the header's count field
  if (mode & 0x80) n ^= std::uint64_t{1} << (mode & 63);  // sometimes a caller's different count
  fuzz::with_format(id, block_sel, [&](auto f) {
    using F = decltype(f);
    switch (fuzz::pick(mode & 0x7f, 4)) {
      case 0: decode<F, float>(msg, bytes, n, false); break;
      case 1: decode<F, qcoll::half>(msg, bytes, n, false); break;
      case 2: decode<F, qcoll::bfloat16>(msg, bytes, n, false); break;
      default: decode<F, float>(msg, bytes, n, true); break;
    }
  });
  return 0;
}
