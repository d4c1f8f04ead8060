// Host quantizer throughput: quantize and dequantize of every block format and input type, in
// GB/s of bytes read + written and G elements/s, next to a memcpy of the input measured in the
// same run (interleaved: memcpy, quantize, memcpy, dequantize, dequantize-accumulate per
// repetition, and the repetitions of a format's input types in turns). Buffers are far
// larger than the last-level cache. After timing, results are checked against a scalar
// re-computation from the format's per-element functions (sampled blocks) and, where it holds,
// against quantize(dequantize(message)) == message. Exit status: 0, or 1 if a check failed, or 2
// on a bad command line.

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iterator>
#include <string>
#include <vector>

#include <qcoll/format/dispatch.hpp>
#include <qcoll/host/quantize.hpp>

#include "bench_util.hpp"

using namespace qcoll;

namespace {

const char* const kHelp =
    "usage: quantize [flags]\n"
    "Throughput of the host quantize/dequantize kernels against memcpy of the same input.\n"
    "\n"
    "  --formats LIST    comma-separated formats (default: all):\n"
    "                    int8 int4 int8a int4a e4m3 e5m2 mxfp8e4 mxfp8e5 mxfp6e2 mxfp6e3 mxfp4\n"
    "                    mxint8 nvfp4, and the unquantized identity formats f32 f16 bf16\n"
    "  --types LIST      input element types among f32,bf16,f16 (default: f32,bf16,f16; f32\n"
    "                    only in a quick build)\n"
    "  --blocks LIST     block sizes of int*, e4m3, e5m2 and identity, powers of two in\n"
    "                    [32, 8192] (default: 32,2048); MX formats use 32, nvfp4 16\n"
    "  --elements N      elements per buffer, suffixes K/M/G (= 2^10/2^20/2^30). Default: 64M,\n"
    "                    raised so that the input is at least 8x the last-level cache, then\n"
    "                    lowered by halves until the buffers fit in 3/4 of the memory\n"
    "  -n, --iters N     timed repetitions, the median is reported (default: 5)\n"
    "  -w, --warmup N    untimed repetitions first (default: 1)\n"
    "  --rounding R      nearest | stochastic (default: nearest)\n"
    "  --csv             comma-separated rows (comment lines start with '#')\n"
    "  --device          run the GPU benchmark instead: bench_quantize_device, next to this\n"
    "                    program, with the other arguments (see its --help)\n"
    "  -h, --help        this text\n"
    "\n"
    "Columns: GB/s counts bytes read + written (quantize: input + message, dequantize:\n"
    "message + output, accumulate: message + 2 x 4 bytes of fp32 accumulator per element;\n"
    "1 GB = 1e9 bytes); memcpy GB/s counts 2 x input bytes per copy;\n"
    "ratio = op GB/s / memcpy GB/s; wrong = mismatches found by the result checks.\n";

// ---- options -----------------------------------------------------------------------------------

struct Options {
  std::vector<FormatId> formats;
  // The quick build (bench_util.hpp) has f32 input only.
  std::vector<DType> types = bench::kQuickBuild ? std::vector<DType>{DType::f32}
                                                : std::vector<DType>{DType::f32, DType::bf16, DType::f16};
  std::vector<std::size_t> blocks{32, 2048};
  std::size_t elements = 0;  // 0: automatic
  int iters = 5;
  int warmup = 1;
  Rounding rounding = Rounding::nearest;
  bool csv = false;
};

const FormatId kAllFormats[] = {
    FormatId::int8,       FormatId::int4,         FormatId::int8_asym,     FormatId::int4_asym,
    FormatId::fp8_e4m3,   FormatId::fp8_e5m2,     FormatId::mxfp8_e4m3,    FormatId::mxfp8_e5m2,
    FormatId::mxfp6_e2m3, FormatId::mxfp6_e3m2,   FormatId::mxfp4,         FormatId::mxint8,
    FormatId::nvfp4,      FormatId::identity_f32, FormatId::identity_bf16, FormatId::identity_f16};

bool fixed_block(FormatId id) { return id >= FormatId::mxfp8_e4m3; }

Options parse_options(int argc, char** argv, bool& help) {
  Options o;
  o.formats.assign(std::begin(kAllFormats), std::end(kAllFormats));
  help = false;
  for (bench::Args a(argc, argv); !a.done();) {
    if (a.flag("-h", "--help")) {
      help = true;
    } else if (a.flag("--formats")) {
      const std::string v = a.value();
      o.formats.clear();
      for (const std::string& name : bench::split_list(v)) {
        if (name == "all") {
          o.formats.insert(o.formats.end(), std::begin(kAllFormats), std::end(kAllFormats));
          continue;
        }
        try {
          o.formats.push_back(parse_format(name));
        } catch (const Error& e) {
          throw bench::UsageError("flag --formats: " + std::string(e.what()));
        }
      }
      if (o.formats.empty()) throw bench::UsageError("flag --formats: empty list");
    } else if (a.flag("--types")) {
      const std::string v = a.value();
      o.types.clear();
      for (const std::string& t : bench::split_list(v)) {
        if (t == "f32") {
          o.types.push_back(DType::f32);
        } else if (t == "bf16") {
          o.types.push_back(DType::bf16);
        } else if (t == "f16") {
          o.types.push_back(DType::f16);
        } else {
          throw bench::UsageError("flag --types: '" + t + "' is not one of f32, bf16, f16");
        }
        bench::check_quick_build_type("--types", t);
      }
      if (o.types.empty()) throw bench::UsageError("flag --types: empty list");
    } else if (a.flag("--blocks")) {
      const std::string v = a.value();
      o.blocks.clear();
      for (const std::string& b : bench::split_list(v)) {
        const std::size_t block = bench::parse_count(b, "--blocks");
        if (!valid_block(block)) {
          throw bench::UsageError("flag --blocks: " + b + " is not a power of two in [32, 8192]");
        }
        o.blocks.push_back(block);
      }
      if (o.blocks.empty()) throw bench::UsageError("flag --blocks: empty list");
    } else if (a.flag("--elements")) {
      o.elements = bench::parse_count(a.value(), a.name());
      if (o.elements > (std::size_t{1} << 40))
        throw bench::UsageError("flag --elements: more than 2^40 elements");
    } else if (a.flag("-n", "--iters")) {
      o.iters = static_cast<int>(bench::parse_int(a.value(), a.name(), 1, 100000));
    } else if (a.flag("-w", "--warmup")) {
      o.warmup = static_cast<int>(bench::parse_int(a.value(), a.name(), 0, 100000));
    } else if (a.flag("--rounding")) {
      const std::string v = a.value();
      if (v == "nearest") {
        o.rounding = Rounding::nearest;
      } else if (v == "stochastic") {
        o.rounding = Rounding::stochastic;
      } else {
        throw bench::UsageError("flag --rounding: '" + v + "' is not nearest or stochastic");
      }
    } else if (a.flag("--csv")) {
      o.csv = true;
    } else {
      a.unknown();
    }
  }
  return o;
}

// ---- input data --------------------------------------------------------------------------------

std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Roughly Gaussian values (sum of four 16-bit uniforms, unit variance) whose scale changes by a
// power of two in [2^-4, 2^4] every 4096 elements, like the layers of a model. All finite.
template <class T>
void fill_input(T* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t r = mix64(i);
    const float s = static_cast<float>(r & 0xffff) + static_cast<float>((r >> 16) & 0xffff) +
                    static_cast<float>((r >> 32) & 0xffff) + static_cast<float>(r >> 48);
    const int e = static_cast<int>(mix64(~(i >> 12)) % 9) - 4;
    // Irwin-Hall(4) on [0, 4 * 65535]: mean 2 * 65535.5, standard deviation 65536 / sqrt(3)
    const float v = (s - 131071.0f) * (1.7320508f / 65536.0f);
    x[i] = from_float<T>(fp::mul(v, fp::exp2i(e)));
  }
}

// ---- reference (scalar re-computation from the format's per-element functions) -----------------

// Code i of a block stored as a little-endian bit stream of F::code_bits-bit codes.
template <class F>
std::uint32_t get_code(const unsigned char* block_codes, std::size_t i) {
  constexpr std::size_t bits = F::code_bits;
  std::uint32_t v = 0;
  for (std::size_t k = 0; k < bits; ++k) {
    const std::size_t bit = i * bits + k;
    v |= static_cast<std::uint32_t>((block_codes[bit / 8] >> (bit % 8)) & 1u) << k;
  }
  return v;
}

template <class F>
void put_code(unsigned char* block_codes, std::size_t i, std::uint32_t code) {
  constexpr std::size_t bits = F::code_bits;
  for (std::size_t k = 0; k < bits; ++k) {
    const std::size_t bit = i * bits + k;
    if ((code >> k) & 1u)
      block_codes[bit / 8] = static_cast<unsigned char>(block_codes[bit / 8] | (1u << (bit % 8)));
  }
}

// Blocks the checks look at: about 2048 spread over the message, plus the first and the last.
std::vector<std::size_t> sample_blocks(std::size_t nblocks) {
  std::vector<std::size_t> out;
  if (nblocks == 0) return out;
  const std::size_t stride = nblocks / 2048 + 1;
  for (std::size_t b = 0; b < nblocks; b += stride) out.push_back(b);
  if (out.back() != nblocks - 1) out.push_back(nblocks - 1);
  return out;
}

// Mismatching bytes between the message and a scalar re-encoding of the sampled blocks (header,
// message scale, codes, block metas).
template <class F, class T>
std::size_t check_quantized(const T* x, std::size_t n, const unsigned char* msg,
                            const host::QuantizeOptions& opt) {
  using L = MessageLayout<F>;
  std::size_t wrong = 0;
  MessageHeader h = make_header<F>(n);
  wrong += std::memcmp(&h, msg, sizeof h) != 0;
  float mscale = 0.0f;
  if constexpr (has_message_scale<F>) {
    float amax = 0.0f;
    for (std::size_t i = 0; i < n; ++i) {
      const float v = to_float(x[i]);
      if (fp::is_finite(v)) amax = fp::max(amax, fp::abs(v));
    }
    mscale = F::message_scale(amax);
    unsigned char want[4];
    detail::store_f32(want, mscale);
    wrong += std::memcmp(want, msg + L::message_meta_offset, 4) != 0;
  }
  std::vector<unsigned char> codes(L::block_code_bytes);
  unsigned char meta[F::meta_bytes + 1];
  for (std::size_t b : sample_blocks(L::blocks(n))) {
    const std::size_t first = b * F::block;
    const std::size_t valid = n - first < F::block ? n - first : F::block;
    BlockStats s = stats_empty();
    for (std::size_t i = 0; i < valid; ++i) stats_add(s, to_float(x[first + i]));
    const typename F::Meta m = F::make_meta(s, mscale);
    F::store_meta(m, meta);
    std::fill(codes.begin(), codes.end(), static_cast<unsigned char>(0));
    for (std::size_t i = 0; i < valid; ++i) {
      const float v = to_float(x[first + i]);
      const std::uint32_t c = opt.rounding == Rounding::nearest
                                  ? static_cast<std::uint32_t>(F::encode(v, m))
                                  : static_cast<std::uint32_t>(F::encode_sr(
                                        v, m, random_bits(opt.seed, opt.index_base + first + i)));
      put_code<F>(codes.data(), i, c);
    }
    const unsigned char* got_codes = msg + L::codes_offset + b * L::block_code_bytes;
    const unsigned char* got_meta = msg + L::metas_offset(n) + b * F::meta_bytes;
    for (std::size_t k = 0; k < L::block_code_bytes; ++k) wrong += codes[k] != got_codes[k];
    for (std::size_t k = 0; k < F::meta_bytes; ++k) wrong += meta[k] != got_meta[k];
  }
  return wrong;
}

// Mismatching elements between out and a scalar decoding of the sampled blocks of msg.
template <class F, class T>
std::size_t check_dequantized(const unsigned char* msg, std::size_t n, const T* out) {
  using L = MessageLayout<F>;
  float mscale = 0.0f;
  if constexpr (has_message_scale<F>) mscale = detail::load_f32(msg + L::message_meta_offset);
  std::size_t wrong = 0;
  for (std::size_t b : sample_blocks(L::blocks(n))) {
    const std::size_t first = b * F::block;
    const std::size_t valid = n - first < F::block ? n - first : F::block;
    const typename F::Meta m = F::load_meta(msg + L::metas_offset(n) + b * F::meta_bytes, mscale);
    const unsigned char* codes = msg + L::codes_offset + b * L::block_code_bytes;
    for (std::size_t i = 0; i < valid; ++i) {
      const T want = from_float<T>(F::decode(get_code<F>(codes, i), m));
      wrong += std::memcmp(&want, &out[first + i], sizeof(T)) != 0;
    }
  }
  return wrong;
}

// Whether quantize(dequantize(quantize(x))) == quantize(x) byte for byte is claimed for (F, T).
// It holds for nearest rounding when every decoded value is exactly representable in T and the
// block scale is recomputed exactly from the decoded block maximum: for f32 and bf16 outputs of
// all scaled formats except NVFP4 (whose E4M3 block scale, relative to the message scale, loses
// precision and range), and for identity formats whose word type is f32 or the input type.
// f16 outputs overflow or go subnormal for values outside f16's range, so they are excluded.
// (Checked on Gaussian, layered, wide-exponent and tiny inputs for every format and type.)
template <class F, class T>
bool idempotence_claimed(Rounding r) {
  if (r != Rounding::nearest) return false;
  if (F::id == FormatId::identity_f32) return true;
  if (F::id == FormatId::identity_bf16) return dtype_of<T>::value == DType::bf16;
  if (F::id == FormatId::identity_f16) return dtype_of<T>::value == DType::f16;
  if (F::id == FormatId::nvfp4) return false;
  return dtype_of<T>::value != DType::f16;
}

// ---- measurement -------------------------------------------------------------------------------

struct Buffers {
  bench::Buffer in, copy, msg, out, msg2, acc;
};

struct Result {
  std::string format;
  std::size_t block;
  DType type;
  std::size_t n;
  double t_copy, t_q, t_dq, t_acc;
  std::size_t in_bytes, msg_bytes;
  std::size_t wrong_q, wrong_dq;
};

// The memcpy baseline, called through a volatile pointer so that the copy into a never-read
// buffer cannot be optimised away.
void copy_bytes(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }
void (*volatile g_copy)(void*, const void*, std::size_t) = copy_bytes;

// The timings of one case (format, block, input type) over its repetitions so far.
struct Timings {
  std::vector<double> tc, tq, tdq, tacc;
};

// One repetition of a case: memcpy, quantize, memcpy, dequantize, dequantize-accumulate, each
// timed (kept when `record`). `last`: then the result checks run, on this repetition's message and
// output, and r gets the case's figures (medians of the kept timings).
template <class F, class T>
void run_rep(Buffers& buf, std::size_t n, const Options& o, bool record, bool last, Timings& tm, Result& r) {
  const T* in = buf.in.as<T>();
  T* out = buf.out.as<T>();
  const std::size_t in_bytes = n * sizeof(T);
  const std::size_t pb = packed_bytes<F>(n);
  host::QuantizeOptions qo;
  qo.rounding = o.rounding;
  qo.seed = 0x5eed;
  float* acc = buf.acc.as<float>();
  const double c1 = bench::time_seconds([&] { g_copy(buf.copy.data(), in, in_bytes); });
  const double q = bench::time_seconds([&] { host::quantize<F>(in, n, buf.msg.data(), pb, qo); });
  const double c2 = bench::time_seconds([&] { g_copy(buf.copy.data(), in, in_bytes); });
  const double dq = bench::time_seconds([&] { host::dequantize<F>(buf.msg.data(), pb, out, n); });
  const double ac = bench::time_seconds([&] { host::dequantize_accumulate<F>(buf.msg.data(), pb, acc, n); });
  if (record) {
    tm.tc.push_back(c1);
    tm.tc.push_back(c2);
    tm.tq.push_back(q);
    tm.tdq.push_back(dq);
    tm.tacc.push_back(ac);
  }
  if (!last) return;
  r = Result{};
  r.format = format_name(F::id);
  r.block = F::block;
  r.type = dtype_of<T>::value;
  r.n = n;
  r.t_copy = bench::median(tm.tc);
  r.t_q = bench::median(tm.tq);
  r.t_dq = bench::median(tm.tdq);
  r.t_acc = bench::median(tm.tacc);
  r.in_bytes = in_bytes;
  r.msg_bytes = pb;
  r.wrong_q = check_quantized<F>(in, n, buf.msg.data(), qo);
  r.wrong_dq = check_dequantized<F>(buf.msg.data(), n, out);
  if (idempotence_claimed<F, T>(o.rounding)) {
    host::quantize<F>(out, n, buf.msg2.data(), pb, qo);
    for (std::size_t k = 0; k < pb; ++k) r.wrong_dq += buf.msg.data()[k] != buf.msg2.data()[k];
  }
}

template <class T>
void rep_typed(FormatId id, std::size_t block, Buffers& buf, std::size_t n, const Options& o, bool record,
               bool last, Timings& tm, Result& r) {
  dispatch_format(id, block, [&](auto f) {
    run_rep<decltype(f), T>(buf, n, o, record, last, tm, r);
    return 0;
  });
}

void rep_any(DType t, FormatId id, std::size_t block, Buffers& buf, std::size_t n, const Options& o,
             bool record, bool last, Timings& tm, Result& r) {
#if QCOLL_BENCH_QUICK_BUILD
  (void)t;  // parse() admits f32 only: a third of the instantiations
  rep_typed<float>(id, block, buf, n, o, record, last, tm, r);
#else
  switch (t) {
    case DType::f32: return rep_typed<float>(id, block, buf, n, o, record, last, tm, r);
    case DType::bf16: return rep_typed<bfloat16>(id, block, buf, n, o, record, last, tm, r);
    case DType::f16: return rep_typed<half>(id, block, buf, n, o, record, last, tm, r);
  }
#endif
}

void fill_any(DType t, Buffers& buf, std::size_t n) {
  switch (t) {
    case DType::f32: fill_input(buf.in.as<float>(), n); break;
    case DType::bf16: fill_input(buf.in.as<bfloat16>(), n); break;
    case DType::f16: fill_input(buf.in.as<half>(), n); break;
  }
}

std::size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

// Largest packed message over the cases that will run with n elements.
std::size_t max_packed(const Options& o, std::size_t n) {
  std::size_t m = 0;
  for (FormatId id : o.formats) {
    if (fixed_block(id)) {
      m = std::max(m, dispatch_format(id, 0, [&](auto f) { return packed_bytes<decltype(f)>(n); }));
      continue;
    }
    for (std::size_t b : o.blocks) {
      m = std::max(m, dispatch_format(id, b, [&](auto f) { return packed_bytes<decltype(f)>(n); }));
    }
  }
  return m;
}

// ---- report ------------------------------------------------------------------------------------

// The project's throughput targets on one core, as ratios to memcpy in the same run, for f32
// and bf16 input: {quantize, dequantize, dequantize-accumulate} (0: none). Besides, bf16 and f16
// input must reach f32 input's elements per second (checked where f32 was measured).
struct Targets {
  double q, dq, acc;
};
Targets targets(const std::string& format, DType t) {
  if (t != DType::f32 && t != DType::bf16) return {0, 0, 0};
  const double acc = t == DType::f32 ? 0.6 : 0.0;  // the accumulator is fp32 whatever the input
  if (format == "int8") return {0.6, 0.75, acc};
  if (format == "int4") return {0.5, 0.6, acc};
  if (format == "e4m3" || format == "e5m2" || format == "mxfp8e4" || format == "mxfp8e5" ||
      format == "mxint8")
    return {0.5, 0.5, 0};
  if (format == "mxfp4" || format == "mxfp6e2" || format == "mxfp6e3" || format == "nvfp4")
    return {0.35, 0.35, 0};
  return {0, 0, 0};
}

const char* build_flags() {
#if defined(__AVX512F__)
  return "AVX-512";
#elif defined(__AVX2__)
  return "AVX2";
#elif defined(__AVX__)
  return "AVX";
#elif defined(__SSE4_1__)
  return "SSE4.1";
#elif defined(__x86_64__)
  return "baseline x86-64 (SSE2)";
#else
  return "default target";
#endif
}

// --device: replaces this process with bench_quantize_device from the same folder, passing on
// every other argument. Returns only on failure (exit status 2).
int run_device_benchmark(int argc, char** argv) {
  std::string path = argv[0];
  const std::size_t slash = path.rfind('/');
  path = (slash == std::string::npos ? std::string(".") : path.substr(0, slash)) + "/bench_quantize_device";
  std::vector<char*> args{const_cast<char*>(path.c_str())};
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--device") != 0) args.push_back(argv[i]);
  args.push_back(nullptr);
  execv(path.c_str(), args.data());
  std::fprintf(stderr, "quantize: flag --device: cannot run %s: %s\n", path.c_str(), std::strerror(errno));
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--device") == 0) return run_device_benchmark(argc, argv);
  Options o;
  try {
    bool help = false;
    o = parse_options(argc, argv, help);
    if (help) {
      std::fputs(kHelp, stdout);
      return 0;
    }
  } catch (const bench::UsageError& e) {
    std::fprintf(stderr, "quantize: %s\n", e.what());
    return 2;
  }

  const bench::CacheInfo llc = bench::last_level_cache();
  bench::Table table({{"format", 8, true},
                      {"block", 5},
                      {"type", 4, true},
                      {"op", 10, true},
                      {"elements", 10},
                      {"time_ms", 9},
                      {"GB/s", 7},
                      {"Gelem/s", 7},
                      {"memcpy_GB/s", 11},
                      {"ratio", 6},
                      {"wrong", 5}},
                     o.csv);
#if defined(__OPTIMIZE__)
  const char* opt_level = "optimized";
#else
  const char* opt_level = "NOT optimized";
#endif
  table.note(bench::strf("qcoll %d.%d.%d host quantizer benchmark, %s build, compiler %s",
                         QCOLL_VERSION_MAJOR, QCOLL_VERSION_MINOR, QCOLL_VERSION_PATCH, opt_level,
                         __VERSION__));
  if (*bench::quick_build_warning() != '\0') table.note(bench::quick_build_warning());
  table.note(bench::strf("kernels run with: %s (chosen at run time; the program is compiled for %s)",
                         host::kernel_isa(), build_flags()));
  if (llc.bytes != 0) {
    table.note("last-level cache: " + bench::format_bytes(static_cast<double>(llc.bytes)) + " (" +
               llc.source + ")");
  } else {
    table.note("last-level cache: unknown (inputs default to 64M elements)");
  }
  table.note(bench::strf("repetitions: %d timed (median) after %d warm-up; rounding: %s", o.iters, o.warmup,
                         o.rounding == Rounding::nearest ? "nearest" : "stochastic"));

  std::vector<Result> results;
  bool failed = false;
  try {
    // Elements per type: the requested count, or 64M raised to 8x the last-level cache, lowered
    // (by halves) until the buffers fit in 3/4 of the machine's memory.
    std::vector<std::size_t> counts;
    std::size_t max_in = 0, max_msg = 0, max_n = 0;
    const std::size_t memory = bench::physical_memory();
    // The buffers' bytes for counts: an input per type, copy and output, two messages, fp32
    // accumulators.
    std::size_t sum_in = 0;
    const auto size_buffers = [&] {
      max_in = max_msg = max_n = sum_in = 0;
      for (std::size_t ti = 0; ti < o.types.size(); ++ti) {
        max_in = std::max(max_in, counts[ti] * dtype_size(o.types[ti]));
        sum_in += counts[ti] * dtype_size(o.types[ti]);
        max_msg = std::max(max_msg, max_packed(o, counts[ti]));
        max_n = std::max(max_n, counts[ti]);
      }
      return sum_in + 2 * max_in + 2 * max_msg + max_n * sizeof(float);
    };
    for (DType t : o.types) {
      std::size_t n = o.elements;
      if (n == 0) {
        n = std::size_t{64} << 20;
        const std::size_t need = (8 * llc.bytes + dtype_size(t) - 1) / dtype_size(t);
        if (n < need) n = (need + 8191) / 8192 * 8192;
      }
      counts.push_back(n);
    }
    std::size_t total = size_buffers();
    if (o.elements == 0) {
      bool lowered = false;
      while (memory != 0 && total > memory / 4 * 3 && max_n > (std::size_t{1} << 20)) {
        for (std::size_t& n : counts) n = (n / 2 + 8191) / 8192 * 8192;
        total = size_buffers();
        lowered = true;
      }
      if (lowered)
        table.note("elements lowered to fit the buffers in 3/4 of the memory (" +
                   bench::format_bytes(static_cast<double>(memory)) + ")");
    } else if (memory != 0 && total > memory) {
      throw bench::UsageError(
          bench::strf("flag --elements: %zu elements need %s of buffers, more than the %s of memory",
                      o.elements, bench::format_bytes(static_cast<double>(total)).c_str(),
                      bench::format_bytes(static_cast<double>(memory)).c_str()));
    }
    for (std::size_t ti = 0; ti < o.types.size(); ++ti) {
      const std::size_t bytes = counts[ti] * dtype_size(o.types[ti]);
      if (bytes < 8 * llc.bytes)
        std::fprintf(stderr,
                     "quantize: note: %s input of %s is below 8x the last-level cache; the figures "
                     "include cache effects\n",
                     dtype_name(o.types[ti]), bench::format_bytes(static_cast<double>(bytes)).c_str());
    }
    Buffers buf;
    // One input per type, filled once (also the first touch of its pages): a format's input types
    // take turns repetition by repetition, so that the comparisons between types (elements per
    // second of 16-bit input against fp32 input) are of runs side by side.
    std::vector<bench::Buffer> inputs(o.types.size());
    for (std::size_t ti = 0; ti < o.types.size(); ++ti) {
      buf.in.resize(counts[ti] * dtype_size(o.types[ti]));
      fill_any(o.types[ti], buf, counts[ti]);
      std::swap(buf.in, inputs[ti]);
    }
    buf.copy.resize(max_in);
    buf.out.resize(max_in);
    buf.msg.resize(max_msg);
    buf.msg2.resize(max_msg);
    buf.acc.resize(max_n * sizeof(float));
    buf.acc.touch();
    buf.copy.touch();
    buf.out.touch();
    buf.msg.touch();
    buf.msg2.touch();
    std::string per_type = "elements:";
    for (std::size_t ti = 0; ti < o.types.size(); ++ti) {
      per_type +=
          bench::strf(" %s %zu (%s)", dtype_name(o.types[ti]), counts[ti],
                      bench::format_bytes(static_cast<double>(counts[ti] * dtype_size(o.types[ti]))).c_str());
    }
    table.note(per_type);
    table.note(bench::strf("buffers: inputs %s, copy %s, output %s, message 2 x %s, accumulator %s",
                           bench::format_bytes(static_cast<double>(sum_in)).c_str(),
                           bench::format_bytes(static_cast<double>(max_in)).c_str(),
                           bench::format_bytes(static_cast<double>(max_in)).c_str(),
                           bench::format_bytes(static_cast<double>(max_msg)).c_str(),
                           bench::format_bytes(static_cast<double>(max_n * sizeof(float))).c_str()));
    table.header();

    for (FormatId id : o.formats) {
      std::vector<std::size_t> blocks = o.blocks;
      if (fixed_block(id)) blocks.assign(1, 0);
      for (std::size_t b : blocks) {
        // The input types' repetitions in turns (f32, bf16, f16, f32, ...), so that the comparisons
        // between types are of runs side by side, not seconds apart.
        std::vector<Timings> tms(o.types.size());
        std::vector<Result> rs(o.types.size());
        const int reps = o.warmup + o.iters;
        for (int rep = 0; rep < reps; ++rep)
          for (std::size_t ti = 0; ti < o.types.size(); ++ti) {
            std::swap(buf.in, inputs[ti]);
            rep_any(o.types[ti], id, b, buf, counts[ti], o, rep >= o.warmup, rep + 1 == reps, tms[ti],
                    rs[ti]);
            std::swap(buf.in, inputs[ti]);
          }
        for (std::size_t ti = 0; ti < o.types.size(); ++ti) {
          const DType t = o.types[ti];
          const std::size_t n = counts[ti];
          const Result& r = rs[ti];
          const double copy_gbs = 2.0 * static_cast<double>(r.in_bytes) / r.t_copy * 1e-9;
          const double moved = static_cast<double>(r.in_bytes + r.msg_bytes);
          const double q_gbs = moved / r.t_q * 1e-9, dq_gbs = moved / r.t_dq * 1e-9;
          const std::string blk = std::to_string(r.block);
          table.row({r.format, blk, dtype_name(t), "quantize", std::to_string(n),
                     bench::strf("%.3f", r.t_q * 1e3), bench::strf("%.2f", q_gbs),
                     bench::strf("%.3f", n / r.t_q * 1e-9), bench::strf("%.2f", copy_gbs),
                     bench::strf("%.2f", q_gbs / copy_gbs), std::to_string(r.wrong_q)});
          table.row({r.format, blk, dtype_name(t), "dequantize", std::to_string(n),
                     bench::strf("%.3f", r.t_dq * 1e3), bench::strf("%.2f", dq_gbs),
                     bench::strf("%.3f", n / r.t_dq * 1e-9), bench::strf("%.2f", copy_gbs),
                     bench::strf("%.2f", dq_gbs / copy_gbs), std::to_string(r.wrong_dq)});
          const double acc_gbs = (static_cast<double>(r.msg_bytes) + 8.0 * n) / r.t_acc * 1e-9;
          table.row({r.format, blk, dtype_name(t), "accumulate", std::to_string(n),
                     bench::strf("%.3f", r.t_acc * 1e3), bench::strf("%.2f", acc_gbs),
                     bench::strf("%.3f", n / r.t_acc * 1e-9), bench::strf("%.2f", copy_gbs),
                     bench::strf("%.2f", acc_gbs / copy_gbs), "-"});
          if (r.wrong_q != 0 || r.wrong_dq != 0) failed = true;
          results.push_back(r);
        }
      }
    }
  } catch (const bench::UsageError& e) {
    std::fprintf(stderr, "quantize: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "quantize: error: %s\n", e.what());
    return 1;
  }

  table.note(
      "checks: 'wrong' of quantize = message bytes differing from a scalar re-encoding of ~2048 sampled");
  table.note(
      "blocks; of dequantize = sampled elements differing from a scalar decoding, plus (nearest rounding,");
  table.note("f32/bf16 outputs, not nvfp4) message bytes where quantize(dequantize(message)) != message.");
  table.note(
      "targets (one core, ratio to memcpy; f32 and bf16 input): int8 quantize >= 0.6, dequantize >= 0.75;");
  table.note(
      "int4 >= 0.5 and >= 0.6; int8 and int4 dequantize-accumulate (f32 rows) >= 0.6; e4m3, e5m2, mxfp8e4,");
  table.note(
      "mxfp8e5, mxint8 >= 0.5 both ways; mxfp4, mxfp6e2, mxfp6e3, nvfp4 >= 0.35 both ways; bf16 and f16");
  table.note("input >= f32 input's Gelem/s (quantize and dequantize, same format and block).");
  int covered = 0, met = 0;
  const auto check = [&](const std::string& what, double got, double want, const char* unit) {
    ++covered;
    const bool ok = got >= want;
    met += ok;
    table.note(bench::strf("target %-46s %6.3f %-8s (>= %.2f)  %s", what.c_str(), got, unit, want,
                           ok ? "pass" : "FAIL"));
  };
  for (const Result& r : results) {
    const std::string name =
        bench::strf("%-8s block %-5zu %-4s", r.format.c_str(), r.block, dtype_name(r.type));
    const double copy_gbs = 2.0 * static_cast<double>(r.in_bytes) / r.t_copy;
    const double moved = static_cast<double>(r.in_bytes + r.msg_bytes);
    const Targets want = targets(r.format, r.type);
    if (want.q > 0) check(name + " quantize", moved / r.t_q / copy_gbs, want.q, "x memcpy");
    if (want.dq > 0) check(name + " dequantize", moved / r.t_dq / copy_gbs, want.dq, "x memcpy");
    if (want.acc > 0)
      check(name + " accumulate", (static_cast<double>(r.msg_bytes) + 8.0 * r.n) / r.t_acc / copy_gbs,
            want.acc, "x memcpy");
    if (r.type == DType::f32) continue;
    for (const Result& f : results) {
      if (f.type != DType::f32 || f.format != r.format || f.block != r.block) continue;
      // elements per second relative to the f32 input row, their repetitions taken in turns
      check(name + " quantize Gelem/s", (r.n / r.t_q) / (f.n / f.t_q), 1.0, "x f32's");
      check(name + " dequantize Gelem/s", (r.n / r.t_dq) / (f.n / f.t_dq), 1.0, "x f32's");
    }
  }
  if (covered == 0) {
    table.note("no measured case is covered by the targets");
  } else {
    table.note(bench::strf("targets met: %d of %d", met, covered));
  }
  if (failed) {
    std::fprintf(stderr, "quantize: result checks FAILED (see the 'wrong' column)\n");
    return 1;
  }
  return 0;
}
