// libFuzzer target: argument checks of the host entry points (host::quantize, host::dequantize,
// host::dequantize_accumulate) with fuzzed counts (the full 64-bit range), buffer sizes, pointer
// offsets (misaligned typed pointers) and null pointers.
//
// Input: [format id][block selector][type][flags][8 bytes n][2 bytes out size][in offset]
// [out offset][msg offset][then input values]. The buffers are real allocations of exactly the
// sizes passed (a caller that tells the truth); only the count is free. Contracts: a call either
// throws qcoll::Error having written nothing, or succeeds having written only what its contract
// says (quantize: packed_bytes<F>(n) bytes; dequantize: n elements); misaligned typed pointers
// and counts above max_count<F>() are rejected; what quantize writes decodes again.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include <qcoll/host/quantize.hpp>

#include "fuzz_input.hpp"

namespace {

// Input buffers hold at most this many elements; an output buffer at most kMaxOut bytes, so any
// larger count needs more than kMaxOut bytes of message and must be rejected before reading.
constexpr std::size_t kMaxIn = std::size_t{1} << 16;
constexpr std::size_t kMaxOut = std::size_t{1} << 15;
constexpr unsigned char kCanary = 0xA5;

template <class F, class T>
void run(fuzz::Reader& in, std::size_t n, std::uint8_t flags) {
  using namespace qcoll;
  const std::size_t lo = in.u8(), hi = in.u8();
  const std::size_t out_size = (lo | hi << 8) % kMaxOut;
  const std::size_t in_off = in.u8() % (2 * sizeof(T)), out_off = in.u8() % 16, msg_off = in.u8() % 16;
  const bool in_null = (flags & 1) != 0, out_null = (flags & 2) != 0;
  host::QuantizeOptions opt;
  opt.rounding = (flags & 4) != 0 ? Rounding::stochastic : Rounding::nearest;
  opt.seed = flags;
  opt.index_base = n * 7;

  // The input: n elements at in_off bytes into an exact allocation, from the fuzzer's bytes.
  const bool in_fits = n <= kMaxIn;
  std::vector<unsigned char> in_raw(in_fits ? in_off + n * sizeof(T) : in_off + sizeof(T));
  for (std::size_t i = in_off; i < in_raw.size(); ++i) in_raw[i] = in.u8();
  const T* x = in_null ? nullptr : reinterpret_cast<const T*>(in_raw.data() + in_off);
  std::vector<unsigned char> out_raw(out_off + out_size, kCanary);
  void* out = out_null ? nullptr : out_raw.data() + out_off;

  const std::size_t need = packed_bytes<F>(n);
  const bool fits_out = fuzz::exact_bytes<F>(n) <= out_size;
  if (!in_fits && fits_out) return;  // a real caller would hold n input elements
  std::size_t wrote = 0;
  const bool threw = fuzz::throws_error([&] { wrote = host::quantize<F>(x, n, out, out_size, opt); });
  const bool aligned = reinterpret_cast<std::uintptr_t>(x) % alignof(T) == 0;
  const bool valid = (x != nullptr || n == 0) && out != nullptr && fits_out && aligned;
  fuzz::expect(threw == !valid, "host::quantize's verdict differs from its documented checks");
  for (std::size_t i = 0; i < out_raw.size(); ++i) {
    const bool written = !threw && i >= out_off && i - out_off < need;
    if (!written) fuzz::expect(out_raw[i] == kCanary, "host::quantize wrote outside its message");
  }
  if (threw) return;
  fuzz::expect(wrote == need, "host::quantize returned another size");

  // Decode what was written, from a copy at msg_off, into outputs at fuzzed offsets.
  std::vector<unsigned char> msg_raw(msg_off + need);
  std::memcpy(msg_raw.data() + msg_off, out, need);
  const unsigned char* msg = msg_raw.data() + msg_off;
  const std::size_t dec_off = in_off;  // reuse the input's offset for the output's
  std::vector<unsigned char> y_raw(dec_off + n * sizeof(T), kCanary);
  T* y = reinterpret_cast<T*>(y_raw.data() + dec_off);
  const bool y_aligned = reinterpret_cast<std::uintptr_t>(y) % alignof(T) == 0;
  const std::size_t claimed = (flags & 8) != 0 && need > 0 ? need - 1 : need;  // sometimes too short
  std::uint32_t got = 0;
  const bool dthrew = fuzz::throws_error([&] { got = host::dequantize<F, T>(msg, claimed, y, n); });
  fuzz::expect(dthrew == (!y_aligned || claimed < need),
               "host::dequantize's verdict differs from its checks");
  if (dthrew)
    for (unsigned char b : y_raw) fuzz::expect(b == kCanary, "a rejected host::dequantize wrote its output");
  MessageHeader h;
  std::memcpy(&h, msg, sizeof h);
  if (!dthrew) fuzz::expect(got == h.flags, "host::dequantize returned other flags than the header's");

  if constexpr (std::is_same<T, float>::value) {
    std::vector<unsigned char> acc_raw(dec_off + n * sizeof(float), 0);
    float* acc = reinterpret_cast<float*>(acc_raw.data() + dec_off);
    const bool athrew = fuzz::throws_error([&] { host::dequantize_accumulate<F>(msg, claimed, acc, n); });
    fuzz::expect(athrew == (!y_aligned || claimed < need),
                 "host::dequantize_accumulate's verdict differs from its checks");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Reader in(data, size);
  const std::uint8_t id = in.u8(), block_sel = in.u8(), type = in.u8(), flags = in.u8();
  std::uint64_t n = in.u64();
  // Mostly small counts (real buffers); flag 16 keeps the full 64-bit value (huge counts).
  if ((flags & 16) == 0) n %= 4 * 8192 + 1;
  fuzz::with_format(id, block_sel, [&](auto f) {
    using F = decltype(f);
    switch (fuzz::pick(type, 3)) {
      case 0: run<F, float>(in, n, flags); break;
      case 1: run<F, qcoll::half>(in, n, flags); break;
      default: run<F, qcoll::bfloat16>(in, n, flags); break;
    }
  });
  return 0;
}
