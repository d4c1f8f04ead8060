#pragma once
//! \file
//! Small helpers shared by qcoll's benchmark programs: command-line parsing, wall-clock timing,
//! page-touched aligned buffers, the last-level cache size, and a table printer that can also
//! write CSV. Not part of the library's public API.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include <qcoll/core/config.hpp>

QCOLL_NAMESPACE_BEGIN
namespace bench {

//! A bad command line; the message names the flag and what is wrong with it. Programs print it
//! and exit with status 2.
class UsageError : public std::runtime_error {
 public:
  explicit UsageError(const std::string& what) : std::runtime_error(what) {}
};

#ifndef QCOLL_BENCH_QUICK_BUILD
#define QCOLL_BENCH_QUICK_BUILD 0
#endif
//! True in a build with QCOLL_BENCH_QUICK_BUILD (host code at -O0, for builds that only check that
//! the benchmarks compile; the device benchmark then has f32 only).
inline constexpr bool kQuickBuild = QCOLL_BENCH_QUICK_BUILD != 0;

//! Refuses, in a quick build, an element type other than f32 given to `flag` as `value`.
inline void check_quick_build_type(const char* flag, const std::string& value) {
  if (kQuickBuild && value != "f32")
    throw UsageError(std::string("flag ") + flag + ": '" + value +
                     "': this build (QCOLL_BENCH_QUICK_BUILD) has f32 only");
}

//! A header line for a benchmark built with QCOLL_BENCH_QUICK_BUILD, else "".
inline const char* quick_build_warning() {
  return kQuickBuild ? "WARNING: built with QCOLL_BENCH_QUICK_BUILD (-O0, f32 input only): these figures are "
                       "not representative"
                     : "";
}

//! Splits "a,b,c" at `sep`; empty items are dropped.
inline std::vector<std::string> split_list(const std::string& text, char sep = ',') {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t end = text.find(sep, start);
    if (end == std::string::npos) end = text.size();
    if (end > start) out.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

//! Parses a count with an optional binary suffix: "4096", "64K", "64M", "1G" (K = 2^10, M = 2^20,
//! G = 2^30; a trailing "i" as in "64Mi" is accepted). Throws UsageError naming `flag` when the
//! text is not such a count, is zero while `allow_zero` is false, or overflows.
inline std::size_t parse_count(const std::string& text, const std::string& flag, bool allow_zero = false) {
  auto bad = [&](const char* why) {
    return UsageError("flag " + flag + ": '" + text + "' " + why +
                      " (expected a count such as 4096, 64K, 64M or 1G)");
  };
  std::size_t i = 0;
  std::uint64_t v = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    const std::uint64_t digit = static_cast<std::uint64_t>(text[i] - '0');
    if (v > (UINT64_MAX - digit) / 10) throw bad("is too large");
    v = v * 10 + digit;
    ++i;
  }
  if (i == 0) throw bad("is not a number");
  std::string suffix = text.substr(i);
  if (suffix.size() == 2 && (suffix[1] == 'i' || suffix[1] == 'I')) suffix.resize(1);
  unsigned shift = 0;
  if (suffix == "k" || suffix == "K") {
    shift = 10;
  } else if (suffix == "m" || suffix == "M") {
    shift = 20;
  } else if (suffix == "g" || suffix == "G") {
    shift = 30;
  } else if (!suffix.empty()) {
    throw bad("has an unknown suffix");
  }
  if (shift != 0 && v > (UINT64_MAX >> shift)) throw bad("is too large");
  v <<= shift;
  if (v > SIZE_MAX) throw bad("is too large");
  if (v == 0 && !allow_zero) throw bad("must be positive");
  return static_cast<std::size_t>(v);
}

//! Parses an integer in [lo, hi]; throws UsageError naming `flag` otherwise.
inline long parse_int(const std::string& text, const std::string& flag, long lo, long hi) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < lo || v > hi) {
    throw UsageError("flag " + flag + ": '" + text + "' is not an integer in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]");
  }
  return v;
}

//! Walks argv. Usage:
//! ```
//! for (bench::Args a(argc, argv); !a.done();) {
//!   if (a.flag("-n", "--iters")) iters = bench::parse_int(a.value(), a.name(), 1, 1000);
//!   else if (a.flag("--csv")) csv = true;
//!   else a.unknown();
//! }
//! ```
//! A flag's value is the next argument or follows '=' ("--iters=5").
class Args {
 public:
  Args(int argc, char** argv) : args_(argv + (argc > 0 ? 1 : 0), argv + argc) {}

  //! True when every argument has been consumed.
  bool done() const { return pos_ >= args_.size(); }

  //! If the current argument is `a` or `b` (optionally followed by "=value"), consumes it and
  //! returns true.
  bool flag(const char* a, const char* b = nullptr) {
    const std::string& cur = args_[pos_];
    const std::size_t eq = cur.find('=');
    const std::string key = cur.substr(0, eq);
    if (key != a && (b == nullptr || key != b)) return false;
    name_ = key;
    inline_value_ = eq == std::string::npos ? nullptr : &cur[eq + 1];
    ++pos_;
    return true;
  }

  //! The flag matched last, as written.
  const std::string& name() const { return name_; }

  //! The value of the flag matched last; throws UsageError if there is none.
  std::string value() {
    if (inline_value_ != nullptr) return inline_value_;
    if (done()) throw UsageError("flag " + name_ + " needs a value");
    return args_[pos_++];
  }

  //! Throws UsageError naming the current argument as unknown.
  [[noreturn]] void unknown() const { throw UsageError("unknown flag '" + args_[pos_] + "' (see --help)"); }

 private:
  std::vector<std::string> args_;
  std::size_t pos_ = 0;
  std::string name_;
  const char* inline_value_ = nullptr;
};

//! Seconds on a monotonic clock.
inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

//! Wall-clock seconds one call of fn() takes.
template <class Fn>
double time_seconds(Fn&& fn) {
  const double t0 = now_seconds();
  fn();
  return now_seconds() - t0;
}

//! Median of a non-empty sample (mean of the two middle values for an even count).
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

//! A heap buffer aligned to 2 MiB (transparent huge pages are requested where Linux offers them,
//! so TLB misses do not dominate streaming loops). Its pages are written once by touch(), so that
//! first-touch page faults happen before any timing.
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(std::size_t bytes) { resize(bytes); }

  //! Replaces the contents by `bytes` uninitialized bytes (a size of 0 frees the buffer).
  void resize(std::size_t bytes) {
    ptr_.reset();
    bytes_ = 0;
    if (bytes == 0) return;
    constexpr std::size_t align = std::size_t{2} << 20;
    const std::size_t rounded = (bytes + align - 1) / align * align;
    void* p = std::aligned_alloc(align, rounded);
    if (p == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    (void)::madvise(p, rounded, MADV_HUGEPAGE);  // a hint: failure only costs speed
#endif
    ptr_.reset(static_cast<unsigned char*>(p));
    bytes_ = bytes;
  }

  //! Writes every page once (with `fill` bytes).
  void touch(unsigned char fill = 0) {
    if (bytes_ != 0) std::memset(ptr_.get(), fill, bytes_);
  }

  unsigned char* data() { return ptr_.get(); }
  const unsigned char* data() const { return ptr_.get(); }
  std::size_t size() const { return bytes_; }
  template <class T>
  T* as() {
    return reinterpret_cast<T*>(ptr_.get());
  }

 private:
  struct Free {
    void operator()(unsigned char* p) const { std::free(p); }
  };
  std::unique_ptr<unsigned char, Free> ptr_;
  std::size_t bytes_ = 0;
};

//! Size of the last-level cache and where the figure came from.
struct CacheInfo {
  std::size_t bytes = 0;  //!< 0 when unknown
  std::string source;     //!< e.g. "/sys/devices/system/cpu/cpu0/cache/index3"
};

namespace detail {
inline std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}
}  // namespace detail

//! The machine's physical memory in bytes (sysconf), or 0 where unknown.
inline std::size_t physical_memory() {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
#endif
  return 0;
}

//! The data (or unified) cache of the highest level listed for CPU 0 under /sys; when /sys has
//! none, sysconf(_SC_LEVEL3_CACHE_SIZE), then _SC_LEVEL2_CACHE_SIZE.
inline CacheInfo last_level_cache() {
  CacheInfo best;
#if defined(__linux__)
  int best_level = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i);
    const std::string level = detail::read_line(dir + "/level");
    if (level.empty()) continue;
    const std::string type = detail::read_line(dir + "/type");
    if (type == "Instruction") continue;
    const std::string size = detail::read_line(dir + "/size");  // e.g. "32768K"
    char* end = nullptr;
    const unsigned long long v = std::strtoull(size.c_str(), &end, 10);
    const std::size_t mult = (*end == 'K')   ? 1024
                             : (*end == 'M') ? (1u << 20)
                             : (*end == 'G') ? (1u << 30)
                                             : 1;
    const int lv = std::atoi(level.c_str());
    if (v != 0 && lv > best_level) {
      best_level = lv;
      best.bytes = static_cast<std::size_t>(v) * mult;
      best.source = dir;
    }
  }
  if (best.bytes != 0) return best;
#endif
#if defined(_SC_LEVEL3_CACHE_SIZE)
  const long l3 = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) return CacheInfo{static_cast<std::size_t>(l3), "sysconf(_SC_LEVEL3_CACHE_SIZE)"};
#endif
#if defined(_SC_LEVEL2_CACHE_SIZE)
  const long l2 = ::sysconf(_SC_LEVEL2_CACHE_SIZE);
  if (l2 > 0) return CacheInfo{static_cast<std::size_t>(l2), "sysconf(_SC_LEVEL2_CACHE_SIZE)"};
#endif
  return best;
}

//! "123 B", "32 KiB", "64 MiB", "1.5 GiB".
inline std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf,
                bytes == static_cast<double>(static_cast<long long>(bytes)) ? "%.0f %s" : "%.1f %s", bytes,
                units[u]);
  return buf;
}

//! printf-style formatting into a std::string.
template <class... A>
std::string strf(const char* fmt, A... args) {
  const int n = std::snprintf(nullptr, 0, fmt, args...);
  std::string s(static_cast<std::size_t>(n > 0 ? n : 0), '\0');
  if (n > 0) std::snprintf(&s[0], s.size() + 1, fmt, args...);
  return s;
}

//! A column of a Table: its title, width (characters) and alignment.
struct Column {
  std::string title;
  int width;
  bool left = false;  //!< left-aligned (text) instead of right-aligned (numbers)
};

//! Prints rows as an aligned text table, or as CSV (title row, then comma-separated cells). In
//! CSV mode, note() lines start with '#' so that readers can skip them.
class Table {
 public:
  Table(std::vector<Column> columns, bool csv, std::FILE* out = stdout)
      : cols_(std::move(columns)), csv_(csv), out_(out) {}

  bool csv() const { return csv_; }

  //! Prints the titles.
  void header() const {
    std::vector<std::string> titles;
    for (const Column& c : cols_) titles.push_back(c.title);
    print(titles, !csv_);
  }

  //! Prints one row (one cell per column).
  void row(const std::vector<std::string>& cells) const { print(cells, false); }

  //! A free-form line (a comment in CSV mode).
  void note(const std::string& line) const {
    std::fprintf(out_, "%s%s\n", csv_ ? "# " : "", line.c_str());
    std::fflush(out_);
  }

 private:
  void print(const std::vector<std::string>& cells, bool hash) const {
    std::string line = hash ? "#" : "";
    for (std::size_t i = 0; i < cells.size() && i < cols_.size(); ++i) {
      if (csv_) {
        if (i) line += ',';
        line += cells[i];
      } else {
        int w = cols_[i].width - (i == 0 && hash ? 1 : 0);
        const int pad = w - static_cast<int>(cells[i].size());
        if (i) line += ' ';
        if (!cols_[i].left && pad > 0) line.append(static_cast<std::size_t>(pad), ' ');
        line += cells[i];
        if (cols_[i].left && pad > 0 && i + 1 < cells.size()) line.append(static_cast<std::size_t>(pad), ' ');
      }
    }
    std::fprintf(out_, "%s\n", line.c_str());
    std::fflush(out_);
  }

  std::vector<Column> cols_;
  bool csv_;
  std::FILE* out_;
};

}  // namespace bench
QCOLL_NAMESPACE_END
