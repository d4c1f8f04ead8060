// Writes the seed corpus of the fuzz targets (fuzz/corpus/<target>/) in the input encodings the
// targets read: valid headers and messages of every format, produced by qcoll itself, and host
// argument records around the interesting sizes. Run by `scripts/fuzz.sh --make-seeds`.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <qcoll/host/quantize.hpp>

#include "fuzz_input.hpp"

namespace {

std::string g_root;

void put_u64(std::vector<std::uint8_t>& v, std::uint64_t x) {
  for (int i = 0; i < 8; ++i) v.push_back(static_cast<std::uint8_t>(x >> (8 * i)));
}

void write(const std::string& target, const std::string& name, const std::vector<std::uint8_t>& bytes) {
  const std::string path = g_root + "/" + target + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    std::perror(path.c_str());
    std::exit(1);
  }
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
}

// Inputs with a NaN, an Inf, a value beyond half's range, subnormals and ordinary values.
std::vector<float> values(std::size_t n) {
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<int>(i % 23) - 11) * 0.37f;
  if (n > 3) x[3] = 1e-40f;
  if (n > 40) x[40] = 70000.0f;
  if (n > 100) x[100] = std::numeric_limits<float>::infinity();
  if (n > 200) x[200] = std::numeric_limits<float>::quiet_NaN();
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds <corpus directory>\n");
    return 2;
  }
  g_root = argv[1];
  for (unsigned id = 0; id < 16; ++id)
    for (unsigned bsel = 0; bsel < 3; ++bsel) {
      if (id >= 9 && bsel > 0) continue;  // MX and NVFP4 have one block
      fuzz::with_format(static_cast<std::uint8_t>(id), static_cast<std::uint8_t>(bsel), [&](auto f) {
        using F = decltype(f);
        const std::string tag = std::string(qcoll::format_name(F::id)) + "-" + std::to_string(F::block);
        // header: [id][block sel][header][n][run-time id][run-time log2 block]
        for (std::size_t n : {std::size_t{0}, std::size_t{300}, qcoll::max_count<F>()}) {
          std::vector<std::uint8_t> h = {static_cast<std::uint8_t>(id), static_cast<std::uint8_t>(bsel)};
          const qcoll::MessageHeader mh = qcoll::make_header<F>(n);
          const auto* p = reinterpret_cast<const std::uint8_t*>(&mh);
          h.insert(h.end(), p, p + sizeof mh);
          put_u64(h, n);
          h.push_back(static_cast<std::uint8_t>(F::id));
          h.push_back(static_cast<std::uint8_t>(qcoll::log2_exact(F::block)));
          write("header", tag + "-n" + std::to_string(n), h);
        }
        // decode: [id][block sel][mode][message]
        for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{33}, std::size_t{300}}) {
          if (bsel == 2 && n != 0) continue;  // blocks of 8192 make large seeds
          const std::vector<float> x = values(n);
          std::vector<std::uint8_t> msg(qcoll::packed_bytes<F>(n));
          qcoll::host::quantize<F>(x.data(), n, msg.data(), msg.size());
          for (std::uint8_t mode : {0, 1, 2, 3}) {
            if (n != 300 && mode != 0) continue;
            std::vector<std::uint8_t> d = {static_cast<std::uint8_t>(id), static_cast<std::uint8_t>(bsel),
                                           mode};
            d.insert(d.end(), msg.begin(), msg.end());
            write("decode", tag + "-n" + std::to_string(n) + "-m" + std::to_string(mode), d);
          }
        }
        // host_args: [id][block sel][type][flags][n][out size lo, hi][in off][out off][msg off][values]
        for (std::size_t n : {std::size_t{0}, std::size_t{5}, std::size_t{300}}) {
          for (std::uint8_t type : {0, 1, 2}) {
            if ((n == 0 && type != 1) || (n == 300 && type != 0)) continue;
            std::vector<std::uint8_t> a = {static_cast<std::uint8_t>(id), static_cast<std::uint8_t>(bsel),
                                           type, 0};
            put_u64(a, n);
            const std::size_t out = qcoll::packed_bytes<F>(n) + 7;
            a.push_back(static_cast<std::uint8_t>(out));
            a.push_back(static_cast<std::uint8_t>(out >> 8));
            a.push_back(type == 0 ? 0 : 2);
            a.push_back(3);
            a.push_back(1);
            const std::vector<float> x = values(n);
            for (float v : x) {
              const qcoll::bfloat16 b = qcoll::from_float<qcoll::bfloat16>(v);
              const qcoll::half hv = qcoll::from_float<qcoll::half>(v);
              std::uint8_t bytes[4];
              if (type == 0) std::memcpy(bytes, &v, 4);
              if (type == 1) std::memcpy(bytes, &hv, 2);
              if (type == 2) std::memcpy(bytes, &b, 2);
              a.insert(a.end(), bytes, bytes + (type == 0 ? 4 : 2));
            }
            write("host_args", tag + "-n" + std::to_string(n) + "-t" + std::to_string(type), a);
          }
        }
      });
    }
  // plan: [kind][format][type][flags][numel][granule][workspace size lo, hi][workspace offset][values]
  for (std::uint8_t kind : {0, 1, 2})
    for (std::uint8_t format : {0, 1, 2, 3, 4})
      for (std::size_t numel : {std::size_t{0}, std::size_t{300}}) {
        std::vector<std::uint8_t> p = {kind, format, 0, 8};  // flag 8: the workspace the plan asks for
        put_u64(p, numel);
        put_u64(p, 255);  // granule 256 (the target adds 1)
        p.insert(p.end(), {0, 0, 0});
        for (float v : values(numel)) {
          std::uint8_t bytes[4];
          std::memcpy(bytes, &v, 4);
          p.insert(p.end(), bytes, bytes + 4);
        }
        write("plan",
              "k" + std::to_string(kind) + "-f" + std::to_string(format) + "-n" + std::to_string(numel), p);
      }
  std::printf("seeds written under %s\n", g_root.c_str());
  return 0;
}
