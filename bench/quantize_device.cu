// Device quantizer throughput: quantize and dequantize of large bf16 / fp32 tensors for the main
// block formats, as achieved bandwidth (bytes read + bytes written per second), as a fraction of
// the device's peak memory bandwidth, and as a ratio to a device-to-device cudaMemcpyAsync of the
// same input size measured in the same run.
//
//   quantize_device [--bytes N[K|M|G]] [--reps R] [--warmup W]
//
// --bytes is the input tensor size (default 256M = 256 MiB); times are the median of R timed
// repetitions (default 20) after W warm-up runs (default 3), each timed with CUDA events on one
// stream. Prints one row per (format, dtype, operation) and a closing target line:
// int8 and fp8 quantize/dequantize of bf16 tensors >= 256 MiB at >= 85% of peak bandwidth and
// >= 0.95x the copy's rate ("meets" or "below", with the rows that miss). Exits with 77 and
// "skipped: no CUDA device" when there is no GPU.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <qcoll/cuda/quantize.cuh>

#include "bench_util.hpp"

namespace {

namespace qc = qcoll;

#define BENCH_CUDA(expr) QCOLL_CUDA_CHECK(expr)

struct Args {
  std::size_t bytes = std::size_t{256} << 20;
  int reps = 20;
  int warmup = 3;
};

[[noreturn]] void usage(const char* prog, int code) {
  std::fprintf(code == 0 ? stdout : stderr, "usage: %s [--bytes N[K|M|G]] [--reps R] [--warmup W]\n", prog);
  std::exit(code);
}

std::size_t parse_size(const char* s, const char* prog) {
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s, &end, 10);
  if (end == s) usage(prog, 2);
  std::size_t mult = 1;
  if (*end == 'K' || *end == 'k') mult = std::size_t{1} << 10;
  if (*end == 'M' || *end == 'm') mult = std::size_t{1} << 20;
  if (*end == 'G' || *end == 'g') mult = std::size_t{1} << 30;
  if (mult != 1) ++end;
  if (*end != '\0') usage(prog, 2);
  return static_cast<std::size_t>(v) * mult;
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string opt = argv[i];
    if (opt == "-h" || opt == "--help") usage(argv[0], 0);
    if (i + 1 >= argc) usage(argv[0], 2);
    if (opt == "--bytes") {
      a.bytes = parse_size(argv[++i], argv[0]);
    } else if (opt == "--reps") {
      a.reps = std::atoi(argv[++i]);
    } else if (opt == "--warmup") {
      a.warmup = std::atoi(argv[++i]);
    } else {
      usage(argv[0], 2);
    }
  }
  if (a.bytes < 1024 || a.reps < 1 || a.warmup < 0) usage(argv[0], 2);
  return a;
}

//! Values spread over 2^-8 .. 2^8 in runs of 4096 elements, from the counter-based generator.
template <class T>
__global__ void fill_kernel(T* p, std::size_t n, std::uint64_t seed) {
  const std::size_t step = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const float u = qc::fp::sub(qc::random_unit(qc::random_bits(seed, i)), 0.5f);
    const int e = static_cast<int>((i / 4096) % 17) - 8;
    p[i] = qc::from_float<T>(qc::fp::mul(u, qc::fp::exp2i(e)));
  }
}

//! Median time (ms) of `reps` runs of fn on `stream`, each bracketed by CUDA events.
template <class Fn>
double median_ms(Fn&& fn, const Args& args, cudaStream_t stream) {
  for (int i = 0; i < args.warmup; ++i) fn();
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int i = 0; i < args.reps; ++i) {
    BENCH_CUDA(cudaEventRecord(start, stream));
    fn();
    BENCH_CUDA(cudaEventRecord(stop, stream));
    BENCH_CUDA(cudaEventSynchronize(stop));
    float t = 0.0f;
    BENCH_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  BENCH_CUDA(cudaEventDestroy(start));
  BENCH_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Row {
  std::string format;
  std::string dtype;
  std::string op;
  double bytes;  // read + written
  double ms;
  bool target;  // part of the closing target line
};

struct Context {
  Args args;
  cudaStream_t stream;
  unsigned char* in;   // args.bytes
  unsigned char* out;  // args.bytes
  unsigned char* msg;  // args.bytes + slack
  unsigned char* ws;   // 256 bytes
  double peak;         // bytes/s, 0 if unknown
  double copy_rate;    // bytes/s
  std::vector<Row> rows;
};

template <class T>
void fill(Context& c, std::uint64_t seed) {
  const std::size_t n = c.args.bytes / sizeof(T);
  fill_kernel<T><<<1024, 256, 0, c.stream>>>(reinterpret_cast<T*>(c.in), n, seed);
  BENCH_CUDA(cudaGetLastError());
  BENCH_CUDA(cudaStreamSynchronize(c.stream));
}

template <class F, class T>
void bench(Context& c, const char* name, bool target) {
  const std::size_t n = c.args.bytes / sizeof(T);
  const std::size_t tensor = n * sizeof(T);
  const std::size_t packed = qc::packed_bytes<F>(n);
  const T* in = reinterpret_cast<const T*>(c.in);
  T* out = reinterpret_cast<T*>(c.out);
  const qc::host::QuantizeOptions opt;
  const char* dtype = qc::dtype_name(qc::dtype_of<T>::value);
  const double q = median_ms(
      [&] { qc::gpu::quantize<F, T>(in, n, c.msg, opt, c.stream, c.ws, qc::gpu::workspace_bytes<F>(n)); },
      c.args, c.stream);
  c.rows.push_back(Row{name, dtype, "quantize", static_cast<double>(tensor + packed), q, target});
  const double d = median_ms([&] { qc::gpu::dequantize<F, T>(c.msg, n, out, c.stream); }, c.args, c.stream);
  c.rows.push_back(Row{name, dtype, "dequantize", static_cast<double>(packed + tensor), d, target});
}

template <class T>
void bench_dtype(Context& c) {
  fill<T>(c, sizeof(T) == 2 ? 1 : 2);
  bench<qc::Int8<256>, T>(c, "int8/256", true);
  bench<qc::Int8<2048>, T>(c, "int8/2048", false);
  bench<qc::Int4<256>, T>(c, "int4/256", false);
  bench<qc::Fp8E4M3<256>, T>(c, "e4m3/256", true);
  bench<qc::Fp8E5M2<256>, T>(c, "e5m2/256", true);
  bench<qc::MxFp8E4M3, T>(c, "mxfp8e4/32", false);
  bench<qc::MxFp4, T>(c, "mxfp4/32", false);
  bench<qc::NvFp4, T>(c, "nvfp4/16", false);
}

//! Peak DRAM bandwidth (bytes/s) from the memory clock and bus width; 0 if the device does not
//! report them.
double peak_bandwidth(int dev) {
  int clock_khz = 0, bus_bits = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, dev) != cudaSuccess) clock_khz = 0;
  if (cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev) != cudaSuccess) bus_bits = 0;
  (void)cudaGetLastError();
  return 2.0 * static_cast<double>(clock_khz) * 1e3 * static_cast<double>(bus_bits) / 8.0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    std::printf("skipped: no CUDA device\n");
    return 77;
  }
  try {
    Context c;
    c.args = args;
    int dev = 0;
    BENCH_CUDA(cudaGetDevice(&dev));
    cudaDeviceProp prop;
    BENCH_CUDA(cudaGetDeviceProperties(&prop, dev));
    c.peak = peak_bandwidth(dev);
    BENCH_CUDA(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));
    BENCH_CUDA(cudaMalloc(&c.in, args.bytes));
    BENCH_CUDA(cudaMalloc(&c.out, args.bytes));
    BENCH_CUDA(cudaMalloc(&c.msg, args.bytes + (std::size_t{1} << 20)));
    BENCH_CUDA(cudaMalloc(&c.ws, 256));

    std::printf("# device %d: %s, sm_%d%d, %d SMs\n", dev, prop.name, prop.major, prop.minor,
                prop.multiProcessorCount);
    if (*qc::bench::quick_build_warning() != '\0') std::printf("# %s\n", qc::bench::quick_build_warning());
    if (c.peak > 0) {
      std::printf("# peak memory bandwidth %.1f GB/s (2 x memory clock x bus width)\n", c.peak / 1e9);
    } else {
      std::printf("# peak memory bandwidth unknown (device reports no memory clock / bus width)\n");
    }
    const double copy_ms = median_ms(
        [&] { BENCH_CUDA(cudaMemcpyAsync(c.out, c.in, args.bytes, cudaMemcpyDeviceToDevice, c.stream)); },
        args, c.stream);
    c.copy_rate = 2.0 * static_cast<double>(args.bytes) / (copy_ms * 1e-3);
    std::printf("# input %.1f MiB, median of %d runs after %d warm-up runs\n",
                static_cast<double>(args.bytes) / (1 << 20), args.reps, args.warmup);
    std::printf("# cudaMemcpyAsync D2D of the input: %.1f us, %.1f GB/s (read + write)", copy_ms * 1e3,
                c.copy_rate / 1e9);
    if (c.peak > 0) std::printf(", %.1f%% of peak", 100.0 * c.copy_rate / c.peak);
    std::printf("\n");

    bench_dtype<qc::bfloat16>(c);
    bench_dtype<float>(c);

    std::printf("%-12s %-5s %-10s %10s %10s %9s %7s %7s\n", "format", "dtype", "op", "MiB", "time_us", "GB/s",
                "%peak", "x_copy");
    std::vector<std::string> misses;
    bool target_evaluated = args.bytes >= (std::size_t{256} << 20);
    for (const Row& r : c.rows) {
      const double rate = r.bytes / (r.ms * 1e-3);
      const double frac = c.peak > 0 ? rate / c.peak : 0.0;
      const double ratio = rate / c.copy_rate;
      char peak_col[16];
      if (c.peak > 0) {
        std::snprintf(peak_col, sizeof peak_col, "%.1f", 100.0 * frac);
      } else {
        std::snprintf(peak_col, sizeof peak_col, "n/a");
      }
      std::printf("%-12s %-5s %-10s %10.1f %10.1f %9.1f %7s %7.3f\n", r.format.c_str(), r.dtype.c_str(),
                  r.op.c_str(), r.bytes / (1 << 20), r.ms * 1e3, rate / 1e9, peak_col, ratio);
      if (r.target && r.dtype == "bf16") {
        const bool ok = (c.peak <= 0 || frac >= 0.85) && ratio >= 0.95;
        if (!ok) misses.push_back(r.format + " " + r.op);
      }
    }
    if (!target_evaluated) {
      std::printf("target: not evaluated (input below 256 MiB)\n");
    } else {
      std::printf(
          "target: int8 and fp8 quantize/dequantize of bf16 >= 256 MiB at >= 85%% of peak and >= 0.95x copy: "
          "%s",
          misses.empty() ? "meets" : "below");
      if (c.peak <= 0) std::printf(" (peak unknown: copy ratio only)");
      for (std::size_t i = 0; i < misses.size(); ++i)
        std::printf("%s%s", i == 0 ? " (" : ", ", misses[i].c_str());
      std::printf("%s\n", misses.empty() ? "" : ")");
    }

    BENCH_CUDA(cudaFree(c.in));
    BENCH_CUDA(cudaFree(c.out));
    BENCH_CUDA(cudaFree(c.msg));
    BENCH_CUDA(cudaFree(c.ws));
    BENCH_CUDA(cudaStreamDestroy(c.stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "quantize_device: %s\n", e.what());
    return 1;
  }
  return 0;
}
