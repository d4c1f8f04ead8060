// Device kernels (qcoll/cuda/quantize.cuh) against the host kernels (qcoll/host/quantize.hpp), the
// oracle: for the same input and options every message byte (header, message meta, codes, scales,
// padding) and every decoded element must be identical. The only allowed difference is the payload
// of a NaN decoded into a float output (the host propagates the NaN scale's payload, the device
// produces the canonical NaN), so float outputs compare NaN == NaN.
//
// Exits with 77 (reported as skipped by CTest) when there is no CUDA device.

#include "../common/gpu_main.hpp"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <qcoll/cuda/quantize.cuh>

namespace {

namespace qc = qcoll;
namespace qh = qcoll::host;
namespace qd = qcoll::gpu;

// ---------------------------------------------------------------------------------------------
// Device memory helpers
// ---------------------------------------------------------------------------------------------

#define TEST_CUDA(expr) QCOLL_CUDA_CHECK(expr)

//! Owning device allocation of `bytes` bytes.
class DeviceBytes {
 public:
  DeviceBytes() = default;
  explicit DeviceBytes(std::size_t bytes) { resize(bytes); }
  ~DeviceBytes() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  //! Makes room for at least `bytes` bytes (contents are not kept).
  void resize(std::size_t bytes) {
    if (bytes <= size_ && p_ != nullptr) return;
    if (p_ != nullptr) TEST_CUDA(cudaFree(p_));
    p_ = nullptr;
    size_ = bytes < 64 ? 64 : bytes;
    TEST_CUDA(cudaMalloc(&p_, size_));
  }
  unsigned char* get() const { return static_cast<unsigned char*>(p_); }

 private:
  void* p_ = nullptr;
  std::size_t size_ = 0;
};

//! Scratch buffers shared by the tests, grown on demand. Never destroyed: freeing device memory
//! from a static destructor would run after the CUDA runtime has shut down.
struct Scratch {
  DeviceBytes in, out, out2, ws;
  static Scratch& get() {
    static Scratch* s = new Scratch;
    return *s;
  }
};

void upload(void* dst, const void* src, std::size_t bytes) {
  if (bytes > 0) TEST_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
void download(void* dst, const void* src, std::size_t bytes) {
  if (bytes > 0) TEST_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
void sync() {
  TEST_CUDA(cudaGetLastError());
  TEST_CUDA(cudaDeviceSynchronize());
}

// ---------------------------------------------------------------------------------------------
// Inputs
// ---------------------------------------------------------------------------------------------

// Exponent ranges that T holds without overflow (fp16: |x| < 65504, so 2^10 times a normal draw).
template <class T>
constexpr int max_exponent() {
  return std::is_same<T, qc::half>::value ? 10 : 120;
}
template <class T>
constexpr int min_exponent() {
  return std::is_same<T, qc::half>::value ? -22 : -140;
}
template <class T>
constexpr int run_exponent() {
  return std::is_same<T, qc::half>::value ? 10 : 30;
}

//! Sign constraint of generated values.
enum class Signs { mixed, nonnegative, nonpositive };

//! n finite values of T in runs of 32 with varied structure: ordinary runs at magnitudes 2^-e..2^e,
//! runs of ±0 (signs random), constants, runs with zeros sprinkled in, subnormal-sized and
//! near-overflow runs where T can hold them. Deterministic in `seed`.
template <class T>
std::vector<T> make_input(std::size_t n, std::uint64_t seed, Signs signs = Signs::mixed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_int_distribution<int> pattern(0, 15);
  std::uniform_int_distribution<int> expo(-run_exponent<T>(), run_exponent<T>());
  std::uniform_int_distribution<int> coin(0, 1);
  std::vector<T> out(n);
  float run_scale = 1.0f;
  int run_kind = 0;
  float constant = 0.0f;
  for (std::size_t i = 0; i < n; ++i) {
    if (i % 32 == 0) {
      run_kind = pattern(rng);
      run_scale = std::ldexp(1.0f, expo(rng));
      if (run_kind == 11) run_scale = std::ldexp(1.0f, min_exponent<T>() + 4);
      if (run_kind == 12) run_scale = std::ldexp(1.0f, max_exponent<T>());
      constant = static_cast<float>(normal(rng)) * run_scale;
    }
    float x;
    switch (run_kind) {
      case 9: x = coin(rng) ? 0.0f : -0.0f; break;                                         // only ±0
      case 10: x = constant; break;                                                        // constant run
      case 13: x = coin(rng) ? 0.0f : static_cast<float>(normal(rng)) * run_scale; break;  // half zeros
      default: x = static_cast<float>(normal(rng)) * run_scale; break;
    }
    if (x == 0.0f && coin(rng)) x = -x;
    if (signs == Signs::nonnegative && x != 0.0f) x = std::fabs(x);
    if (signs == Signs::nonpositive && x != 0.0f) x = -std::fabs(x);
    out[i] = qc::from_float<T>(x);
  }
  return out;
}

template <class T>
const char* type_name() {
  return qc::dtype_name(qc::dtype_of<T>::value);
}

template <class F>
std::string format_label() {
  std::ostringstream os;
  os << qc::format_name(F::id) << "/" << F::block;
  return os.str();
}

//! Where byte `off` of a message of n elements of F lies, for failure messages.
template <class F>
std::string describe_byte(std::size_t off, std::size_t n) {
  using L = qc::MessageLayout<F>;
  std::ostringstream os;
  const std::size_t nb = L::blocks(n);
  if (off < 16) {
    os << "header byte " << off;
  } else if (off < L::codes_offset) {
    os << "message meta byte " << off - 16;
  } else if (off < L::codes_offset + nb * L::block_code_bytes) {
    const std::size_t rel = off - L::codes_offset;
    os << "codes of block " << rel / L::block_code_bytes << " (byte " << rel % L::block_code_bytes << ")";
  } else if (off < L::metas_offset(n)) {
    os << "code padding";
  } else if (off < L::metas_offset(n) + nb * F::meta_bytes) {
    os << "meta of block " << (off - L::metas_offset(n)) / (F::meta_bytes > 0 ? F::meta_bytes : 1);
  } else {
    os << "meta padding";
  }
  return os.str();
}

//! "" when the messages are equal, else where they first differ.
template <class F>
std::string compare_messages(const std::vector<unsigned char>& want, const std::vector<unsigned char>& got,
                             std::size_t n) {
  if (want.size() != got.size()) return "size differs";
  std::size_t first = want.size(), count = 0;
  for (std::size_t i = 0; i < want.size(); ++i)
    if (want[i] != got[i]) {
      if (first == want.size()) first = i;
      ++count;
    }
  if (count == 0) return "";
  std::ostringstream os;
  os << count << " byte(s) differ; first at offset " << first << " (" << describe_byte<F>(first, n)
     << "): host 0x" << std::hex << static_cast<int>(want[first]) << ", device 0x"
     << static_cast<int>(got[first]);
  return os.str();
}

template <class T>
std::uint32_t bits_of(T x) {
  if constexpr (sizeof(T) == 4) {
    std::uint32_t u;
    std::memcpy(&u, &x, 4);
    return u;
  } else {
    return x.bits;
  }
}

template <class T>
bool is_nan_value(T x) {
  return std::isnan(qc::to_float(x));
}

//! "" when equal bit for bit (NaN == NaN for float), else the first difference.
template <class T>
std::string compare_elements(const std::vector<T>& want, const std::vector<T>& got) {
  for (std::size_t i = 0; i < want.size(); ++i) {
    const bool same = bits_of(want[i]) == bits_of(got[i]) ||
                      (sizeof(T) == 4 && is_nan_value(want[i]) && is_nan_value(got[i]));
    if (!same) {
      std::ostringstream os;
      os << "element " << i << ": host 0x" << std::hex << bits_of(want[i]) << ", device 0x"
         << bits_of(got[i]);
      return os.str();
    }
  }
  return "";
}

qh::QuantizeOptions options(qc::Rounding r) {
  qh::QuantizeOptions o;
  o.rounding = r;
  o.seed = 0x5eed1234abcdull;
  o.index_base = r == qc::Rounding::stochastic ? 977 : 0;
  return o;
}

constexpr unsigned char kGarbage = 0xA5;

// The doctest assertions live in these two non-template functions, so the many instantiations of
// the templates below do not each expand the assertion machinery (compile time).

//! Passes when `diff` is empty; otherwise fails with the context and the difference.
void expect_same(const std::string& context, const std::string& diff) {
  INFO(context);
  CHECK_MESSAGE(diff.empty(), diff);
}

//! Passes when `ok`; otherwise fails with the context and `what`.
void expect_true(bool ok, const std::string& context, const std::string& what) {
  INFO(context);
  CHECK_MESSAGE(ok, what);
}

// ---------------------------------------------------------------------------------------------
// Quantize + dequantize of one (format, type, size, rounding, alignment)
// ---------------------------------------------------------------------------------------------

//! Quantizes on host and device, compares the messages, then decodes the device message on the
//! device and compares with host::dequantize. in_shift: elements the device input is offset by;
//! out_shift: bytes the device message (and decoded output, in elements) is offset by.
template <class F, class T>
void check_roundtrip(const std::vector<T>& x, qc::Rounding rounding, std::size_t in_shift,
                     std::size_t out_shift) {
  const std::size_t n = x.size();
  const std::size_t bytes = qc::packed_bytes<F>(n);
  const qh::QuantizeOptions opt = options(rounding);
  std::ostringstream ctx;
  ctx << "format " << format_label<F>() << ", input " << type_name<T>() << ", rounding "
      << (rounding == qc::Rounding::nearest ? "nearest" : "stochastic") << ", n " << n << ", in_shift "
      << in_shift << ", out_shift " << out_shift;

  std::vector<unsigned char> want(bytes);
  qh::quantize<F, T>(x.data(), n, want.data(), bytes, opt);

  Scratch& s = Scratch::get();
  s.in.resize((n + 1) * sizeof(T) + 16);
  s.out.resize(bytes + 32);
  s.out2.resize((n + 1) * sizeof(T) + 16);
  s.ws.resize(qd::workspace_bytes<F>(n) + 16);
  T* d_in = reinterpret_cast<T*>(s.in.get()) + in_shift;
  unsigned char* d_msg = s.out.get() + out_shift;
  upload(d_in, x.data(), n * sizeof(T));
  TEST_CUDA(cudaMemset(s.out.get(), kGarbage, bytes + 32));
  qd::quantize<F, T>(d_in, n, d_msg, opt, nullptr, s.ws.get(), qd::workspace_bytes<F>(n));
  sync();
  std::vector<unsigned char> got(bytes);
  download(got.data(), d_msg, bytes);
  const std::string diff = compare_messages<F>(want, got, n);
  expect_same(ctx.str() + ": quantize", diff);
  // Bytes past the message stay untouched.
  unsigned char after[16];
  download(after, d_msg + bytes, 16);
  bool untouched = true;
  for (unsigned char c : after) untouched = untouched && c == kGarbage;
  expect_true(untouched, ctx.str(), "quantize wrote past packed_bytes");

  // Dequantize the (verified) message on the device.
  std::vector<T> want_x(n), got_x(n);
  if (n > 0) qh::dequantize<F, T>(want.data(), bytes, want_x.data(), n);
  T* d_x = reinterpret_cast<T*>(s.out2.get()) + (out_shift != 0 ? 1 : 0);
  qd::dequantize<F, T>(d_msg, n, d_x, nullptr);
  sync();
  download(got_x.data(), d_x, n * sizeof(T));
  const std::string xdiff = compare_elements(want_x, got_x);
  expect_same(ctx.str() + ": dequantize", xdiff);
}

template <class F, class T>
void sweep_type(std::uint64_t seed) {
  const std::size_t b = F::block;
  const std::size_t sizes[] = {0, 1, 97, b - 1, b, b + 1, 5 * b + 3, (std::size_t{1} << 20) + 7};
  for (std::size_t n : sizes) {
    const std::vector<T> x = make_input<T>(n, seed + n);
    for (qc::Rounding r : {qc::Rounding::nearest, qc::Rounding::stochastic}) {
      check_roundtrip<F, T>(x, r, 0, 0);
      if (n < (std::size_t{1} << 20)) check_roundtrip<F, T>(x, r, 1, 1);  // element / byte offsets
    }
  }
  // The big size once with mixed alignments: vector loads with byte stores and the reverse.
  const std::vector<T> big = make_input<T>((std::size_t{1} << 20) + 7, seed ^ 0x77);
  check_roundtrip<F, T>(big, qc::Rounding::nearest, 1, 0);
  check_roundtrip<F, T>(big, qc::Rounding::nearest, 0, 1);
}

template <class F>
void sweep_all_types(std::uint64_t seed) {
  sweep_type<F, float>(seed);
  sweep_type<F, qc::half>(seed + 1);
  sweep_type<F, qc::bfloat16>(seed + 2);
}

// ---------------------------------------------------------------------------------------------
// Reductions
// ---------------------------------------------------------------------------------------------

//! k host-made messages of F laid out at `stride` bytes, uploaded to the device.
template <class F>
std::vector<unsigned char> make_messages(std::size_t n, int k, std::size_t stride, std::uint64_t seed,
                                         bool with_nan) {
  std::vector<unsigned char> all(stride * static_cast<std::size_t>(k), 0);
  for (int i = 0; i < k; ++i) {
    std::vector<float> x = make_input<float>(n, seed + static_cast<std::uint64_t>(i));
    if (with_nan && i == 1 && n > F::block) x[F::block + 3] = std::nanf("");
    qh::quantize<F, float>(x.data(), n, all.data() + static_cast<std::size_t>(i) * stride, stride);
  }
  return all;
}

//! The host twin of dequantize_reduce: fp32 sum from +0 in message order, then post_scale.
template <class F>
std::vector<float> host_reduce(const std::vector<unsigned char>& msgs, std::size_t stride, int k,
                               std::size_t n, float post_scale) {
  std::vector<float> acc(n, 0.0f);
  for (int i = 0; i < k; ++i)
    qh::dequantize_accumulate<F>(msgs.data() + static_cast<std::size_t>(i) * stride, stride, acc.data(), n);
  if (post_scale != 1.0f)
    for (float& a : acc) a = qc::fp::mul(a, post_scale);
  return acc;
}

template <class F, class T>
void check_reduce(std::size_t n, int k, float post_scale, bool with_nan) {
  std::ostringstream ctx;
  ctx << "dequantize_reduce " << format_label<F>() << " -> " << type_name<T>() << ", n " << n << ", k " << k
      << ", post_scale " << post_scale;
  const std::size_t stride = qc::align16(qc::packed_bytes<F>(n)) + 16;
  const std::vector<unsigned char> msgs = make_messages<F>(n, k, stride, 0xabc + n, with_nan);
  const std::vector<float> acc = host_reduce<F>(msgs, stride, k, n, post_scale);
  std::vector<T> want(n), got(n);
  for (std::size_t i = 0; i < n; ++i) want[i] = qc::from_float<T>(acc[i]);

  Scratch& s = Scratch::get();
  s.in.resize(msgs.size() + 16);
  s.out2.resize((n + 1) * sizeof(T) + 16);
  for (std::size_t shift : {std::size_t{0}, std::size_t{1}}) {
    upload(s.in.get() + shift, msgs.data(), msgs.size());
    T* d_out = reinterpret_cast<T*>(s.out2.get()) + shift;
    qd::dequantize_reduce<F, T>(s.in.get() + shift, stride, k, n, post_scale, d_out, nullptr);
    sync();
    download(got.data(), d_out, n * sizeof(T));
    expect_same(ctx.str() + ", shift " + std::to_string(shift), compare_elements(want, got));
  }
}

template <class F, class F2>
void check_requantize(std::size_t n, int k, float post_scale, qc::Rounding rounding, bool with_nan) {
  std::ostringstream ctx;
  ctx << "dequantize_reduce_requantize " << format_label<F>() << " -> " << format_label<F2>() << ", "
      << (rounding == qc::Rounding::nearest ? "nearest" : "stochastic") << ", n " << n << ", k " << k
      << ", post_scale " << post_scale;
  const std::size_t stride = qc::align16(qc::packed_bytes<F>(n)) + 32;
  const std::vector<unsigned char> msgs = make_messages<F>(n, k, stride, 0xdef + n, with_nan);
  const std::vector<float> acc = host_reduce<F>(msgs, stride, k, n, post_scale);
  const qh::QuantizeOptions opt = options(rounding);
  const std::size_t bytes = qc::packed_bytes<F2>(n);
  std::vector<unsigned char> want(bytes), got(bytes);
  qh::quantize<F2, float>(acc.data(), n, want.data(), bytes, opt);

  Scratch& s = Scratch::get();
  s.in.resize(msgs.size() + 16);
  s.out.resize(bytes + 16);
  s.ws.resize(qd::workspace_bytes<F2>(n) + 16);
  for (std::size_t shift : {std::size_t{0}, std::size_t{3}}) {
    upload(s.in.get() + shift, msgs.data(), msgs.size());
    TEST_CUDA(cudaMemset(s.out.get(), kGarbage, bytes + 16));
    qd::dequantize_reduce_requantize<F, F2>(s.in.get() + shift, stride, k, n, post_scale, s.out.get() + shift,
                                            opt, nullptr, s.ws.get(), qd::workspace_bytes<F2>(n));
    sync();
    download(got.data(), s.out.get() + shift, bytes);
    expect_same(ctx.str() + ", shift " + std::to_string(shift), compare_messages<F2>(want, got, n));
  }
}

// ---------------------------------------------------------------------------------------------
// Mapped (qgZ reorder) quantization
// ---------------------------------------------------------------------------------------------

template <class F, class T>
void check_mapped(const qd::SourceMap& host_map, const qd::SourceMap& device_map,
                  const std::vector<T>& buffer, std::size_t n, qc::Rounding rounding) {
  std::ostringstream ctx;
  ctx << "quantize_mapped " << format_label<F>() << " " << type_name<T>()
      << (host_map.shard_numel != 0 ? " (qgz)" : " (identity)") << ", n " << n << ", position0 "
      << host_map.position0 << ", numel " << host_map.numel << ", rounding "
      << (rounding == qc::Rounding::nearest ? "nearest" : "stochastic");
  const qh::QuantizeOptions opt = options(rounding);
  const std::size_t bytes = qc::packed_bytes<F>(n);
  std::vector<unsigned char> want(bytes), got(bytes);
  qh::detail::quantize_blocks<F, T>(
      n,
      [&](std::size_t b) {
        const qd::MappedBlock mb = qd::map_block(host_map, b, F::block, n);
        return qh::detail::BlockSource<T>{buffer.data() + mb.offset, mb.valid};
      },
      want.data(), opt);

  Scratch& s = Scratch::get();
  s.in.resize(buffer.size() * sizeof(T) + 16);
  s.out.resize(bytes + 16);
  s.ws.resize(qd::workspace_bytes<F>(n) + 16);
  upload(s.in.get(), buffer.data(), buffer.size() * sizeof(T));
  TEST_CUDA(cudaMemset(s.out.get(), kGarbage, bytes + 16));
  qd::quantize_mapped<F, T>(reinterpret_cast<const T*>(s.in.get()), n, device_map, s.out.get(), opt, nullptr,
                            s.ws.get(), qd::workspace_bytes<F>(n));
  sync();
  download(got.data(), s.out.get(), bytes);
  expect_same(ctx.str(), compare_messages<F>(want, got, n));
}

template <class F, class T>
void sweep_mapped(std::uint64_t seed) {
  // Two nodes of three ranks whose numbering is not node-major.
  const int N = 2, L = 3;
  const std::vector<int> rank_at = {4, 0, 2, 1, 5, 3};  // [node][local]
  DeviceBytes d_rank_at(rank_at.size() * sizeof(int));
  upload(d_rank_at.get(), rank_at.data(), rank_at.size() * sizeof(int));
  const int* d_table = reinterpret_cast<const int*>(d_rank_at.get());

  for (std::size_t shard_blocks : {std::size_t{1}, std::size_t{3}}) {
    const std::size_t shard = shard_blocks * F::block;
    const std::size_t padded = shard * static_cast<std::size_t>(N * L);
    // numel cuts into a shard that the reorder moves to the middle of a chunk; also numel = 0 and
    // numel = padded.
    for (std::size_t numel : {padded - F::block - 5, padded, std::size_t{0}, shard + 1}) {
      const std::vector<T> buffer = make_input<T>(padded, seed + numel);
      for (int j = 0; j < L; ++j) {
        const std::size_t position0 = static_cast<std::size_t>(j * N) * shard;
        const std::size_t n = static_cast<std::size_t>(N) * shard;
        for (qc::Rounding r : {qc::Rounding::nearest, qc::Rounding::stochastic}) {
          check_mapped<F, T>(qd::SourceMap::qgz(numel, shard, N, L, rank_at.data(), position0),
                             qd::SourceMap::qgz(numel, shard, N, L, d_table, position0), buffer, n, r);
        }
      }
      // Identity map with an offset and a message running past numel.
      const std::size_t pos = F::block + 7, n = padded - pos;
      check_mapped<F, T>(qd::SourceMap::identity(numel, pos), qd::SourceMap::identity(numel, pos), buffer, n,
                         qc::Rounding::nearest);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Non-finite blocks
// ---------------------------------------------------------------------------------------------

template <class F, class T>
void check_nonfinite() {
  const std::size_t b = F::block;
  const std::size_t n = 6 * b + 5;
  std::vector<T> x = make_input<T>(n, 99);
  x[b + 1] = qc::from_float<T>(std::nanf(""));
  x[3 * b] = qc::from_float<T>(INFINITY);
  x[n - 1] = qc::from_float<T>(-INFINITY);
  for (qc::Rounding r : {qc::Rounding::nearest, qc::Rounding::stochastic}) {
    check_roundtrip<F, T>(x, r, 0, 0);
    check_roundtrip<F, T>(x, r, 1, 1);
  }
  // The header flag is set (the comparison above already demands the host's header; this is the
  // property itself) and a finite input leaves it clear.
  Scratch& s = Scratch::get();
  const std::size_t bytes = qc::packed_bytes<F>(n);
  const std::vector<T> finite = make_input<T>(n, 100);
  for (int with_nan = 0; with_nan < 2; ++with_nan) {
    const std::vector<T>& in = with_nan ? x : finite;
    s.in.resize(n * sizeof(T));
    s.out.resize(bytes);
    s.ws.resize(qd::workspace_bytes<F>(n) + 16);
    upload(s.in.get(), in.data(), n * sizeof(T));
    qd::quantize<F, T>(reinterpret_cast<const T*>(s.in.get()), n, s.out.get(), options(qc::Rounding::nearest),
                       nullptr, s.ws.get(), qd::workspace_bytes<F>(n));
    sync();
    qc::MessageHeader h;
    download(&h, s.out.get(), sizeof h);
    expect_true(
        (h.flags & qc::kFlagNonFinite) == (with_nan ? qc::kFlagNonFinite : 0u),
        "header flag of " + format_label<F>() + " / " + type_name<T>(),
        with_nan ? "kFlagNonFinite not set for a NaN input" : "kFlagNonFinite set for a finite input");
  }
}

// ---------------------------------------------------------------------------------------------
// Asymmetric formats: blocks whose minimum or maximum is ±0
// ---------------------------------------------------------------------------------------------

template <class F, class T>
void check_signed_zero_extremes() {
  for (Signs sg : {Signs::nonnegative, Signs::nonpositive}) {
    for (std::size_t n : {std::size_t{F::block} * 9 + 17, std::size_t{4096} + 3}) {
      const std::vector<T> x = make_input<T>(n, 7 + n, sg);
      check_roundtrip<F, T>(x, qc::Rounding::nearest, 0, 0);
      check_roundtrip<F, T>(x, qc::Rounding::stochastic, 1, 1);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Test cases
// ---------------------------------------------------------------------------------------------

TEST_CASE("int8 symmetric, blocks 32, 256 and 8192") {
  sweep_all_types<qc::Int8<256>>(1);
  sweep_all_types<qc::Int8<8192>>(2);
  sweep_type<qc::Int8<32>, qc::bfloat16>(3);
}

TEST_CASE("int4 symmetric, blocks 256 and 8192") {
  sweep_all_types<qc::Int4<256>>(10);
  sweep_type<qc::Int4<8192>, float>(11);
}

TEST_CASE("asymmetric int8 / int4") {
  sweep_all_types<qc::Int8Asym<256>>(20);
  sweep_all_types<qc::Int4Asym<64>>(21);
  check_signed_zero_extremes<qc::Int8Asym<256>, float>();
  check_signed_zero_extremes<qc::Int8Asym<256>, qc::bfloat16>();
  check_signed_zero_extremes<qc::Int4Asym<64>, qc::half>();
}

TEST_CASE("fp8 e4m3 / e5m2 with fp32 block scales") {
  sweep_all_types<qc::Fp8E4M3<256>>(30);
  sweep_all_types<qc::Fp8E5M2<1024>>(31);
}

TEST_CASE("MX formats") {
  sweep_all_types<qc::MxFp8E4M3>(40);
  sweep_all_types<qc::MxFp4>(41);
  sweep_type<qc::MxFp8E5M2, qc::bfloat16>(42);
  sweep_type<qc::MxFp6E2M3, float>(43);
  sweep_type<qc::MxInt8, qc::half>(44);
}

TEST_CASE("NVFP4 (message scale from a device pre-pass)") { sweep_all_types<qc::NvFp4>(50); }

TEST_CASE("identity formats") {
  sweep_all_types<qc::Identity<qc::bfloat16, 32>>(60);
  sweep_type<qc::Identity<float, 1>, qc::half>(61);
}

TEST_CASE("non-finite blocks: NaN scale, header flag") {
  check_nonfinite<qc::Int8<256>, float>();
  check_nonfinite<qc::Int4<256>, qc::bfloat16>();
  check_nonfinite<qc::Int8Asym<256>, qc::half>();
  check_nonfinite<qc::Fp8E4M3<256>, qc::bfloat16>();
  check_nonfinite<qc::MxFp4, float>();
  check_nonfinite<qc::NvFp4, qc::bfloat16>();
  check_nonfinite<qc::Int8<8192>, float>();
  check_nonfinite<qc::Identity<qc::bfloat16, 32>, float>();
  check_nonfinite<qc::Identity<float, 1>, qc::half>();
}

TEST_CASE("fused qgZ reorder equals host quantize_blocks with the same map") {
  sweep_mapped<qc::Int4<256>, qc::bfloat16>(70);
  sweep_mapped<qc::Int8<256>, float>(71);
  sweep_mapped<qc::Int4Asym<64>, qc::half>(72);
  sweep_mapped<qc::NvFp4, qc::bfloat16>(73);
  sweep_mapped<qc::Identity<qc::bfloat16, 32>, float>(74);
}

TEST_CASE("dequantize_reduce: fixed-order fp32 sums, post scale") {
  for (std::size_t n : {std::size_t{1}, std::size_t{97}, std::size_t{4099}, (std::size_t{1} << 18) + 5}) {
    for (int k : {1, 3, 8}) {
      check_reduce<qc::Int4<256>, qc::bfloat16>(n, k, 1.0f, false);
      check_reduce<qc::Int4<256>, float>(n, k, 1.0f / static_cast<float>(k), false);
      check_reduce<qc::Int8<256>, qc::half>(n, k, 0.125f, false);
      check_reduce<qc::NvFp4, float>(n, k, 1.0f, false);
      check_reduce<qc::MxFp4, qc::bfloat16>(n, k, 1.0f / 3.0f, false);
    }
  }
  check_reduce<qc::Int8<256>, float>(1000, 3, 1.0f, true);
  check_reduce<qc::Int8<256>, qc::bfloat16>(1000, 3, 0.5f, true);
}

TEST_CASE("dequantize_reduce_requantize equals host quantize of the host sums") {
  for (std::size_t n :
       {std::size_t{1}, std::size_t{97}, std::size_t{2048}, std::size_t{4099}, (std::size_t{1} << 18) + 5}) {
    for (qc::Rounding r : {qc::Rounding::nearest, qc::Rounding::stochastic}) {
      check_requantize<qc::Int8<256>, qc::Int4<256>>(n, 4, 1.0f, r, false);
      check_requantize<qc::Int4<256>, qc::Int4<2048>>(n, 3, 1.0f / 3.0f, r, false);
      check_requantize<qc::Int8<256>, qc::NvFp4>(n, 2, 1.0f, r, false);
      check_requantize<qc::Fp8E4M3<256>, qc::Identity<qc::bfloat16, 32>>(n, 3, 0.5f, r, false);
      check_requantize<qc::MxFp4, qc::Int8Asym<256>>(n, 5, 1.0f, r, false);
    }
  }
  check_requantize<qc::Int8<256>, qc::Int4<256>>(1000, 3, 1.0f, qc::Rounding::nearest, true);
}

// ---------------------------------------------------------------------------------------------
// The kernels' own fp16 widening equals qcoll::half_bits_to_float for all 65536 patterns
// ---------------------------------------------------------------------------------------------

__global__ void widen_all_halves(std::uint32_t* out) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 65536u) out[i] = qc::fp::bits(qd::detail::half_bits_to_float_fast(i));
}

TEST_CASE("fp16 widening used by the kernels is exact, on host and device") {
  std::vector<std::uint32_t> device(65536);
  DeviceBytes d(65536 * sizeof(std::uint32_t));
  widen_all_halves<<<256, 256>>>(reinterpret_cast<std::uint32_t*>(d.get()));
  sync();
  download(device.data(), d.get(), device.size() * sizeof(std::uint32_t));
  std::size_t host_bad = 0, device_bad = 0;
  for (std::uint32_t h = 0; h < 65536u; ++h) {
    const std::uint32_t want = qc::fp::bits(qc::half_bits_to_float(static_cast<std::uint16_t>(h)));
    host_bad += qc::fp::bits(qd::detail::half_bits_to_float_fast(h)) != want;
    device_bad += device[h] != want;
  }
  CHECK(host_bad == 0);
  CHECK(device_bad == 0);
}

// ---------------------------------------------------------------------------------------------
// Bad arguments
// ---------------------------------------------------------------------------------------------

//! Runs fn, expects qcoll::Error whose message names `argument`.
void expect_error(const std::function<void()>& fn, const std::string& argument) {
  bool thrown = false;
  try {
    fn();
  } catch (const qc::Error& e) {
    thrown = true;
    const std::string what = e.what();
    CHECK_MESSAGE(what.find("'" + argument + "'") != std::string::npos, what);
  }
  CHECK_MESSAGE(thrown, "no qcoll::Error for bad '" << argument << "'");
}

TEST_CASE("bad arguments throw qcoll::Error before anything is enqueued") {
  using F = qc::Int8<256>;
  const std::size_t n = 1000;
  const std::size_t bytes = qc::packed_bytes<F>(n);
  DeviceBytes d_in(n * sizeof(float)), d_msg(bytes + 64), d_ws(64);
  const float* in = reinterpret_cast<const float*>(d_in.get());
  std::vector<float> host_in(n, 1.0f);
  std::vector<unsigned char> host_msg(bytes);
  const qh::QuantizeOptions opt;
  TEST_CUDA(cudaMemset(d_msg.get(), kGarbage, bytes + 64));

  expect_error([&] { qd::quantize<F, float>(host_in.data(), n, d_msg.get(), opt, nullptr); }, "in");
  expect_error([&] { qd::quantize<F, float>(in, n, host_msg.data(), opt, nullptr); }, "out");
  expect_error([&] { qd::quantize<F, float>(nullptr, n, d_msg.get(), opt, nullptr); }, "in");
  expect_error([&] { qd::quantize<F, float>(in, n, nullptr, opt, nullptr); }, "out");
  // NVFP4 needs its workspace: missing, too small, misaligned, host memory.
  using N4 = qc::NvFp4;
  const std::size_t need = qd::workspace_bytes<N4>(n);
  expect_error([&] { qd::quantize<N4, float>(in, n, d_msg.get(), opt, nullptr); }, "workspace");
  expect_error([&] { qd::quantize<N4, float>(in, n, d_msg.get(), opt, nullptr, d_ws.get(), need - 1); },
               "workspace_size");
  expect_error([&] { qd::quantize<N4, float>(in, n, d_msg.get(), opt, nullptr, d_ws.get() + 4, need); },
               "workspace");
  std::vector<unsigned char> host_ws(64);
  expect_error([&] { qd::quantize<N4, float>(in, n, d_msg.get(), opt, nullptr, host_ws.data(), need); },
               "workspace");
  // Dequantize and reductions.
  std::vector<float> host_out(n);
  float* d_out = reinterpret_cast<float*>(d_in.get());
  expect_error([&] { qd::dequantize<F, float>(host_msg.data(), n, d_out, nullptr); }, "msg");
  expect_error([&] { qd::dequantize<F, float>(d_msg.get(), n, host_out.data(), nullptr); }, "out");
  expect_error([&] { qd::dequantize_reduce<F, float>(d_msg.get(), bytes, 0, n, 1.0f, d_out, nullptr); }, "k");
  expect_error([&] { qd::dequantize_reduce<F, float>(d_msg.get(), bytes - 1, 2, n, 1.0f, d_out, nullptr); },
               "stride");
  expect_error([&] { qd::dequantize_reduce<F, float>(d_msg.get(), bytes, 1, n, NAN, d_out, nullptr); },
               "post_scale");
  expect_error(
      [&] {
        qd::dequantize_reduce_requantize<F, F>(d_msg.get(), bytes, 1, n, 1.0f, host_msg.data(), opt, nullptr);
      },
      "out_msg");
  // Mapped: shard not a multiple of the block, host rank table, positions past the buffer.
  const std::vector<int> table = {0, 1};
  DeviceBytes d_table(2 * sizeof(int));
  upload(d_table.get(), table.data(), 2 * sizeof(int));
  const int* dt = reinterpret_cast<const int*>(d_table.get());
  expect_error(
      [&] {
        qd::quantize_mapped<F, float>(in, 256, qd::SourceMap::qgz(n, 300, 1, 2, dt), d_msg.get(), opt,
                                      nullptr);
      },
      "map.shard_numel");
  expect_error(
      [&] {
        qd::quantize_mapped<F, float>(in, 256, qd::SourceMap::qgz(n, 256, 1, 2, table.data()), d_msg.get(),
                                      opt, nullptr);
      },
      "map.rank_at");
  expect_error(
      [&] {
        qd::quantize_mapped<F, float>(in, 512, qd::SourceMap::qgz(n, 256, 1, 2, dt, 256), d_msg.get(), opt,
                                      nullptr);
      },
      "n");

  // Nothing was written by any of the failed calls.
  sync();
  std::vector<unsigned char> after(bytes + 64);
  download(after.data(), d_msg.get(), after.size());
  bool untouched = true;
  for (unsigned char c : after) untouched = untouched && c == kGarbage;
  CHECK(untouched);
}

// ---------------------------------------------------------------------------------------------
// CUDA graphs
// ---------------------------------------------------------------------------------------------

TEST_CASE("capture into a CUDA graph and replay: same bytes as eager calls") {
  using F = qc::Int8<256>;
  using N4 = qc::NvFp4;
  using T = qc::bfloat16;
  const std::size_t n = 100003;
  const std::vector<T> x = make_input<T>(n, 123);
  const qh::QuantizeOptions opt = options(qc::Rounding::stochastic);
  const std::size_t b8 = qc::packed_bytes<F>(n), b4 = qc::packed_bytes<N4>(n);
  DeviceBytes d_in(n * sizeof(T)), d_q8(b8), d_q4(b4), d_x8(n * sizeof(T)), d_x4(n * sizeof(T)), d_ws(64);
  upload(d_in.get(), x.data(), n * sizeof(T));
  const T* in = reinterpret_cast<const T*>(d_in.get());
  T* x8 = reinterpret_cast<T*>(d_x8.get());
  T* x4 = reinterpret_cast<T*>(d_x4.get());

  cudaStream_t stream;
  TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto enqueue = [&] {
    qd::quantize<F, T>(in, n, d_q8.get(), opt, stream);
    qd::dequantize<F, T>(d_q8.get(), n, x8, stream);
    qd::quantize<N4, T>(in, n, d_q4.get(), opt, stream, d_ws.get(), qd::workspace_bytes<N4>(n));
    qd::dequantize<N4, T>(d_q4.get(), n, x4, stream);
  };
  auto snapshot = [&] {
    TEST_CUDA(cudaStreamSynchronize(stream));
    std::vector<unsigned char> all(b8 + b4 + 2 * n * sizeof(T));
    download(all.data(), d_q8.get(), b8);
    download(all.data() + b8, d_q4.get(), b4);
    download(all.data() + b8 + b4, x8, n * sizeof(T));
    download(all.data() + b8 + b4 + n * sizeof(T), x4, n * sizeof(T));
    return all;
  };
  auto scribble = [&] {
    TEST_CUDA(cudaMemsetAsync(d_q8.get(), kGarbage, b8, stream));
    TEST_CUDA(cudaMemsetAsync(d_q4.get(), kGarbage, b4, stream));
    TEST_CUDA(cudaMemsetAsync(x8, kGarbage, n * sizeof(T), stream));
    TEST_CUDA(cudaMemsetAsync(x4, kGarbage, n * sizeof(T), stream));
    TEST_CUDA(cudaMemsetAsync(d_ws.get(), kGarbage, 64, stream));
  };

  enqueue();
  const std::vector<unsigned char> eager = snapshot();
  // The eager results are the host's.
  {
    std::vector<unsigned char> want(b8);
    qh::quantize<F, T>(x.data(), n, want.data(), b8, opt);
    CHECK(std::memcmp(want.data(), eager.data(), b8) == 0);
  }

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  enqueue();
  TEST_CUDA(cudaStreamEndCapture(stream, &graph));
  TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    CAPTURE(replay);
    scribble();
    TEST_CUDA(cudaGraphLaunch(exec, stream));
    const std::vector<unsigned char> got = snapshot();
    CHECK(got == eager);
  }
  TEST_CUDA(cudaGraphExecDestroy(exec));
  TEST_CUDA(cudaGraphDestroy(graph));
  TEST_CUDA(cudaStreamDestroy(stream));
}

}  // namespace
