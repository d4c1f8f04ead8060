#pragma once
//! \file
//! AVX2 block kernels of the host quantizers (x86-64; GCC 12+ or Clang). host/quantize.hpp runs
//! them when the processor has AVX2 and F16C, and the portable loops otherwise.
//!
//! Quantizing runs over groups of up to eight full blocks: their absmax is reduced in vector
//! registers (one lane per block after a transposing max tree), their metas are computed lane by
//! lane, and each block (still in L1) is encoded eight elements at a time and packed to 8, 6 or 4
//! bits in registers (MXFP8 of bfloat16 and fp16 input: sixteen at a time, on the 16-bit patterns); the
//! asymmetric formats reduce their order keys the same way, compute make_meta in double lanes (one
//! per block) and encode from a float estimate, with the double arithmetic where the estimate is
//! near a rounding boundary (they decode by FMA where that rounds as the double sum does, on
//! processors with FMA). Decoding unpacks codes straight into 32-bit lanes (8- and 6-bit minifloat
//! codes into fp16 words, which the fp16 conversion widens exactly), looks the other minifloat
//! codes up in a table of their values (a permutation for 4-bit codes, a gather otherwise), takes
//! 16-bit outputs of 4-bit codes from byte tables of the block's sixteen outputs (pshufb; NVFP4:
//! of each of its 256 block scales, once per message; FP8 to bfloat16 from blocks of 64 on: of
//! the codes of exponent fields 0 and 1, the others' exponents added), runs the common kinds of block (FP8
//! with a moderate fp32 scale, NVFP4 with a moderate message scale, MX with exact products) in loops of their
//! own, and writes 16 values at a time, non-temporally for large outputs, rounding 16-bit outputs without the
//! NaN fix-up where no value can be NaN. The identity formats (unquantized f32, bf16, f16) have conversion
//! loops of their own. Every vector step is the IEEE operation (or integer bit manipulation) that the
//! format's scalar function performs, in the same order, or one shown to give the same result (noted where
//! used), so the bytes are those of the portable loops.
//!
//! Written with the compilers' vector extensions and a few x86 builtins instead of <immintrin.h>,
//! whose parsing alone would cost every includer about half a second.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../format/format.hpp"
#include "block_stats.hpp"

#if !defined(QCOLL_HOST_AVX2_DISPATCH)
#if defined(__x86_64__) && !defined(__CUDACC__) && \
    (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
//! 1: host quantizers run AVX2 kernels where the processor has AVX2 and F16C (define to 0 to turn
//! off; then they run the portable loops).
#define QCOLL_HOST_AVX2_DISPATCH 1
#else
#define QCOLL_HOST_AVX2_DISPATCH 0
#endif
#endif

#if QCOLL_HOST_AVX2_DISPATCH
//! Marks a function compiled for AVX2 + F16C.
#define QCOLL_AVX2 __attribute__((target("avx2,f16c")))
//! Marks an AVX2 helper that is always inlined (only called from QCOLL_AVX2 functions).
#define QCOLL_AVX2_INLINE inline __attribute__((target("avx2,f16c"), always_inline))
//! Marks a function compiled for AVX2 + F16C + FMA (called where has_fma() holds). The compiler
//! may contract a product and a sum into one FMA in such a function: only where the product is
//! exact (the result is then the same) may one be written there.
#define QCOLL_AVX2_FMA __attribute__((target("avx2,f16c,fma")))
//! Unrolls the loop that follows completely: short loops over vectors meant to live in registers,
//! which -O2 (no complete unrolling of such loops) would keep as loops over arrays in memory.
#define QCOLL_UNROLL _Pragma("GCC unroll 16")
//! Unrolls the loop over a block's elements that follows up to four times (completely for the
//! short blocks, whose loops -O2 would otherwise run as loops of one or two iterations).
#define QCOLL_UNROLL_BLOCK _Pragma("GCC unroll 4")

QCOLL_NAMESPACE_BEGIN
namespace host {
namespace detail {
namespace avx2 {

typedef float f32x8 __attribute__((vector_size(32)));
typedef double f64x4 __attribute__((vector_size(32)));
typedef int i32x8 __attribute__((vector_size(32)));
typedef unsigned u32x8 __attribute__((vector_size(32)));
typedef long long i64x4 __attribute__((vector_size(32)));
typedef short i16x16 __attribute__((vector_size(32)));
typedef unsigned short u16x16 __attribute__((vector_size(32)));
typedef char i8x32 __attribute__((vector_size(32)));
typedef unsigned char u8x32 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int i32x4 __attribute__((vector_size(16)));
typedef short i16x8 __attribute__((vector_size(16)));
typedef unsigned short u16x8 __attribute__((vector_size(16)));
typedef char i8x16 __attribute__((vector_size(16)));
typedef long long i64x2 __attribute__((vector_size(16)));

//! Whether the running processor has what the kernels use.
inline bool supported() {
#if defined(__clang__)
  return __builtin_cpu_supports("avx2");  // Clang has no "f16c" query; AVX2 processors have F16C
#else
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#endif
}

//! Whether the running processor has FMA (every AVX2 processor made has; checked all the same).
inline bool has_fma() { return __builtin_cpu_supports("fma"); }

//! Set (by the tests) to run the encoders a processor without FMA runs on one that has it.
inline bool& encode_without_fma() {
  static bool off = false;
  return off;
}

//! Whether the encoders that have an FMA variant (encode_full_run<NvFp4, T, true>) run it.
inline bool encode_fma() { return has_fma() && !encode_without_fma(); }

// ---- elementwise helpers ---------------------------------------------------------------------

//! a * b + c rounded once (vfmadd213ps), for code that runs only where has_fma() holds. Inline
//! assembly, so that the functions around it need no FMA target, under which the compiler could
//! fuse their own products and sums (see docs/formats.md).
QCOLL_AVX2_INLINE f32x8 fused_mul_add(f32x8 a, f32x8 b, f32x8 c) {
  __asm__("vfmadd213ps %2, %1, %0" : "+x"(a) : "x"(b), "x"(c));
  return a;
}

//! Four lanes widened to double, exactly (one vcvtps2pd or vcvtdq2pd: GCC expands
//! __builtin_convertvector of a 128-bit vector to a 256-bit one as two 128-bit conversions and an
//! insert, four to five instructions).
template <class V>
QCOLL_AVX2_INLINE f64x4 to_f64(V x) {
  static_assert(std::is_same<V, f32x4>::value || std::is_same<V, i32x4>::value, "four floats or ints");
#if defined(__clang__)
  return __builtin_convertvector(x, f64x4);
#else
  if constexpr (std::is_same<V, f32x4>::value)
    return __builtin_ia32_cvtps2pd256(x);
  else
    return __builtin_ia32_cvtdq2pd256(x);
#endif
}

//! m ? a : b per 32-bit lane (m is all ones or all zeros per lane).
template <class V>
QCOLL_AVX2_INLINE V sel(i32x8 m, V a, V b) {
  return (V)(((i32x8)a & m) | ((i32x8)b & ~m));
}
QCOLL_AVX2_INLINE i32x8 splat(int v) { return i32x8{} + v; }
//! v in every lane, -0 included (f32x8{} + v would give +0 for -0).
QCOLL_AVX2_INLINE f32x8 splat_f(float v) { return f32x8{v, v, v, v, v, v, v, v}; }
QCOLL_AVX2_INLINE i32x8 vmax(i32x8 a, i32x8 b) { return a > b ? a : b; }
QCOLL_AVX2_INLINE i32x8 vmin(i32x8 a, i32x8 b) { return a < b ? a : b; }
QCOLL_AVX2_INLINE i16x16 vmin(i16x16 a, i16x16 b) { return a < b ? a : b; }
//! The unsigned bytes of v less m, saturated at 0 (vpsubusb).
QCOLL_AVX2_INLINE i8x32 sub_sat_u8(i8x32 v, unsigned char m) {
#if defined(__clang__)
#if __has_builtin(__builtin_elementwise_sub_sat)
  return (i8x32)__builtin_elementwise_sub_sat((u8x32)v, u8x32{} + m);
#else
  return (i8x32)(__builtin_elementwise_max((u8x32)v, u8x32{} + m) - m);
#endif
#else
  return __builtin_ia32_psubusb256(v, (i8x32)(u8x32{} + m));
#endif
}
//! The largest (Max) or smallest lane, in every lane.
template <bool Max>
QCOLL_AVX2_INLINE int reduce(i32x8 v) {
  i32x8 w = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v = Max ? vmax(v, w) : vmin(v, w);
  w = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v = Max ? vmax(v, w) : vmin(v, w);
  w = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  v = Max ? vmax(v, w) : vmin(v, w);
  return v[0];
}
//! The largest (Max) or smallest of sixteen signed 16-bit lanes.
template <bool Max>
QCOLL_AVX2_INLINE int reduce_i16(i16x16 v) {
  const i32x8 lo = ((i32x8)v << 16) >> 16, hi = (i32x8)v >> 16;  // sign-extended halves
  return reduce<Max>(Max ? vmax(lo, hi) : vmin(lo, hi));
}
//! x > lo ? x : lo and x < hi ? x : hi (NaN x gives lo), as maxps / minps.
QCOLL_AVX2_INLINE f32x8 clamp(f32x8 x, float lo, float hi) {
  return __builtin_ia32_minps256(__builtin_ia32_maxps256(x, f32x8{} + lo), f32x8{} + hi);
}
QCOLL_AVX2_INLINE i32x8 is_finite(f32x8 v) { return ((i32x8)v & 0x7f800000) != 0x7f800000; }

//! detail::scale_value per lane: v * scale, saturated to ±FLT_MAX when scale is finite and the
//! product is not.
//! Sat = false: the caller has checked that it cannot saturate (see may_saturate).
template <bool Sat>
QCOLL_AVX2_INLINE f32x8 scale_value(f32x8 v, float scale) {
  const f32x8 r = v * scale;
  if constexpr (!Sat) return r;
  // min(|r|, FLT_MAX) is FLT_MAX for |r| Inf or NaN (minps returns its second operand then)
  const f32x8 mag = __builtin_ia32_minps256((f32x8)((i32x8)r & 0x7fffffff), (f32x8)splat(0x7f7fffff));
  return (f32x8)((i32x8)mag | ((i32x8)r & int(0x80000000u)));
}
//! Scales below this (2^100) in magnitude cannot overflow a finite code (|code value| < 2^16).
constexpr float small_scale = 1.2676506e30f;
//! Whether scale_value(v, scale) may differ from v * scale for v a decoded code (|v| < 2^16, or
//! NaN / Inf when the codes have them): only when scale is finite and either large or the codes
//! can be non-finite.
inline bool may_saturate(float scale, bool nonfinite_codes) {
  return fp::is_finite(scale) && (nonfinite_codes || !(fp::abs(scale) < small_scale));
}

//! Eight elements as floats (exact widening).
QCOLL_AVX2_INLINE f32x8 load(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
//! Zero- or (Signed) sign-extends 8 bytes to 32-bit lanes (vpmovzxbd / vpmovsxbd).
template <bool Signed>
QCOLL_AVX2_INLINE i32x8 widen8(const unsigned char* p) {
  long long w;
  std::memcpy(&w, p, 8);
#if defined(__clang__)
  typedef signed char s8x16 __attribute__((vector_size(16)));
  typedef unsigned char u8x16 __attribute__((vector_size(16)));
  using V = std::conditional_t<Signed, s8x16, u8x16>;
  const V b = (V)(i64x2{w, 0});
  return __builtin_convertvector(__builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7), i32x8);
#else
  if constexpr (Signed) {
    return __builtin_ia32_pmovsxbd256((i8x16)(i64x2{w, 0}));
  } else {
    return __builtin_ia32_pmovzxbd256((i8x16)(i64x2{w, 0}));
  }
#endif
}
//! Zero-extends 8 16-bit words to 32-bit lanes (vpmovzxwd).
QCOLL_AVX2_INLINE i32x8 widen_u16(const void* p) {
  i16x8 h;
  std::memcpy(&h, p, sizeof h);
#if defined(__clang__)
  return __builtin_convertvector((u16x8)h, i32x8);
#else
  return __builtin_ia32_pmovzxwd256(h);
#endif
}
QCOLL_AVX2_INLINE f32x8 load(const bfloat16* p) { return (f32x8)(widen_u16(p) << 16); }
QCOLL_AVX2_INLINE f32x8 load(const half* p) {
  i16x8 h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_ia32_vcvtph2ps256(h);
}

//! Eight floats rounded to V = bfloat16 or half (nearest even, NaN as from_float<V>: 0x7fff).
QCOLL_AVX2_INLINE i16x8 narrow(f32x8 v, const bfloat16*) {
  const u32x8 u = (u32x8)v;
  const i32x8 nan = ((i32x8)u & 0x7fffffff) > 0x7f800000;
  const i32x8 r = sel(nan, splat(0x7fff), (i32x8)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16));
  return __builtin_ia32_packusdw128(__builtin_shufflevector(r, r, 0, 1, 2, 3),
                                    __builtin_shufflevector(r, r, 4, 5, 6, 7));
}
QCOLL_AVX2_INLINE i16x8 narrow(f32x8 v, const half*) {
  const i32x8 nan = ((i32x8)v & 0x7fffffff) > 0x7f800000;
  const i16x8 n16 = __builtin_ia32_packssdw128(__builtin_shufflevector(nan, nan, 0, 1, 2, 3),
                                               __builtin_shufflevector(nan, nan, 4, 5, 6, 7));
  const i16x8 h = __builtin_ia32_vcvtps2ph256(v, 0);  // rounding mode 0: nearest even
  return (h & ~n16) | (n16 & 0x7fff);
}

//! The lanes of a, then of b (each in [0, 2^16)), as sixteen 16-bit words in lane order (vpackusdw
//! interleaves the 128-bit halves; the shuffle puts them back).
QCOLL_AVX2_INLINE i64x4 pack_u16(i32x8 a, i32x8 b) {
  const i64x4 q = (i64x4)__builtin_ia32_packusdw256(a, b);  // a0-3 b0-3 | a4-7 b4-7
  return __builtin_shufflevector(q, q, 0, 2, 1, 3);
}

//! Sixteen floats rounded to bfloat16 or half as narrow() rounds them, in element order in one
//! vector. NanFree: no lane is NaN (the caller knows), so the NaN fix-up is left out. Exact (V =
//! bfloat16 only): every lane is a bfloat16 value or a NaN whose top half is 0x7fff (the caller
//! knows), so the top halves are the results, with no rounding.
template <bool NanFree, bool Exact = false, class V>
QCOLL_AVX2_INLINE i64x4 narrow16(f32x8 v0, f32x8 v1, const V* p) {
  static_assert(!Exact || std::is_same<V, bfloat16>::value, "Exact: bfloat16 outputs");
  if constexpr (!NanFree && !Exact) {
    const i64x2 lo = (i64x2)narrow(v0, p), hi = (i64x2)narrow(v1, p);
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3);
  } else if constexpr (std::is_same<V, bfloat16>::value) {
    // No NaN, so bits + 0x8000 stays below 2^32 and the results below 2^16 (packusdw keeps them).
    u32x8 a = (u32x8)v0, b = (u32x8)v1;
    if constexpr (!Exact) {
      a = a + 0x7fffu + ((a >> 16) & 1u);
      b = b + 0x7fffu + ((b >> 16) & 1u);
    }
    return pack_u16((i32x8)(a >> 16), (i32x8)(b >> 16));
  } else {
    static_assert(std::is_same<V, half>::value, "bfloat16 or half");
    const i64x2 lo = (i64x2)__builtin_ia32_vcvtps2ph256(v0, 0),
                hi = (i64x2)__builtin_ia32_vcvtps2ph256(v1, 0);
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3);
  }
}

//! Stores eight floats as V (rounded to nearest even, NaN as from_float<V>), or adds them to
//! eight fp32 accumulators.
QCOLL_AVX2_INLINE void put(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }
template <class V>
QCOLL_AVX2_INLINE void put(V* p, f32x8 v) {
  const i16x8 h = narrow(v, p);
  std::memcpy(p, &h, sizeof h);
}
QCOLL_AVX2_INLINE void accumulate(float* p, f32x8 v) { put(p, load(p) + v); }

//! What a decoder does with its values: store them as V, store them bypassing the caches
//! (non-temporal; 16-byte aligned destination, large outputs), or add them to fp32 accumulators.
enum class Sink { store, stream, add };

//! A 16-byte non-temporal store (p 16-byte aligned).
QCOLL_AVX2_INLINE void stream16(void* p, i64x2 w) {
#if defined(__clang__)
  __builtin_nontemporal_store(w, static_cast<i64x2*>(p));
#else
  __builtin_ia32_movntdq(static_cast<i64x2*>(p), w);
#endif
}

//! A 32-byte non-temporal store: one where p is 32-byte aligned, else two 16-byte ones (p 16-byte
//! aligned). Full 32-byte stores fill the write-combining buffers with half the operations.
QCOLL_AVX2_INLINE void stream32(void* p, i64x4 w) {
  if (reinterpret_cast<std::uintptr_t>(p) % 32 == 0) {
#if defined(__clang__)
    __builtin_nontemporal_store(w, static_cast<i64x4*>(p));
#else
    __builtin_ia32_movntdq256(static_cast<i64x4*>(p), w);
#endif
    return;
  }
  stream16(p, __builtin_shufflevector(w, w, 0, 1));
  stream16(static_cast<unsigned char*>(p) + 16, __builtin_shufflevector(w, w, 2, 3));
}

//! Sixteen 16-bit outputs h (in element order) to p[0, 16) of 16-bit V: stored, or streamed
//! (non-temporal; p 16-byte aligned), by sink.
template <Sink S, class V>
QCOLL_AVX2_INLINE void put16(V* p, i64x4 h) {
  static_assert(sizeof(V) == 2 && S != Sink::add, "16-bit outputs, stored");
  if constexpr (S == Sink::stream) {
    stream32(p, h);
  } else {
    std::memcpy(p, &h, sizeof h);
  }
}

//! Sixteen values to p[0, 16): put, stream (non-temporal; p 16-byte aligned) or accumulate, by
//! sink. NanFree, Exact: as narrow16 takes them, for 16-bit V.
template <Sink S, bool NanFree = false, bool Exact = false, class V>
QCOLL_AVX2_INLINE void emit(V* p, f32x8 v0, f32x8 v1) {
  if constexpr (S == Sink::add) {
    accumulate(p, v0);
    accumulate(p + 8, v1);
  } else if constexpr (sizeof(V) == 4) {
    if constexpr (S == Sink::stream) {
      stream32(p, (i64x4)v0);
      stream32(p + 8, (i64x4)v1);
    } else {
      put(p, v0);
      put(p + 8, v1);
    }
  } else {
    put16<S>(p, narrow16<NanFree, Exact>(v0, v1, p));
  }
}

//! Orders the non-temporal stores before later stores (sfence).
QCOLL_AVX2 inline void fence() { __builtin_ia32_sfence(); }

//! out[i] = fp::sub(out[i], v[i]), then v[i] = -0, for i in [0, n - n % 8) (subtract_decoded, which
//! does the rest); returns n - n % 8. O(n).
QCOLL_AVX2 inline std::size_t subtract_and_clear(float* out, float* v, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    put(out + i, load(out + i) - load(v + i));
    put(v + i, splat_f(-0.0f));
  }
  return i;
}

// ---- block statistics ------------------------------------------------------------------------

//! Lane-wise extremes of the bit patterns of a full block of n elements, n a multiple of 16, in the
//! form lane_tree reduces (signed maxima): in hi the largest pattern as a signed integer, in um the
//! largest unsigned pattern with its sign bit flipped, in nu the smallest unsigned pattern with its
//! other bits flipped; eight 32-bit lanes of float bits, or sixteen 16-bit lanes of the half or
//! bfloat16 patterns (viewed as i32x8). encode_full_blocks turns the reduced three into the block's
//! smallest and largest values: three operations per vector, where the order keys of block_stats
//! take five (asymmetric integers quantize 1.07-1.14x faster in cache with fp32 input, 1.02-1.04x
//! with bfloat16; Intel Xeon).
template <class T>
QCOLL_AVX2_INLINE void extreme_lanes(const T* x, std::size_t n, i32x8& hi, i32x8& um, i32x8& nu) {
  if constexpr (sizeof(T) == 4) {
    i32x8 h = (i32x8)load(x);
    u32x8 a = (u32x8)h, b = (u32x8)h;
    QCOLL_UNROLL_BLOCK
    for (std::size_t i = 8; i < n; i += 8) {
      const i32x8 u = (i32x8)load(x + i);
      h = vmax(u, h);
      a = (u32x8)u > a ? (u32x8)u : a;
      b = (u32x8)u < b ? (u32x8)u : b;
    }
    hi = h;
    um = (i32x8)a ^ INT32_MIN;
    nu = (i32x8)b ^ INT32_MAX;
  } else {
    i16x16 h;
    std::memcpy(&h, x, sizeof h);
    u16x16 a = (u16x16)h, b = (u16x16)h;
    QCOLL_UNROLL_BLOCK
    for (std::size_t i = 16; i < n; i += 16) {
      i16x16 v;
      std::memcpy(&v, x + i, sizeof v);
      h = v > h ? v : h;
      a = (u16x16)v > a ? (u16x16)v : a;
      b = (u16x16)v < b ? (u16x16)v : b;
    }
    hi = (i32x8)h;
    um = (i32x8)((i16x16)a ^ static_cast<short>(INT16_MIN));
    nu = (i32x8)((i16x16)b ^ static_cast<short>(INT16_MAX));
  }
}

//! Lane-wise largest |x| bits of a full block of n elements, n a positive multiple of 16: for float input,
//! eight 32-bit lanes; for half and bfloat16, sixteen 16-bit lanes (viewed as i32x8) of the
//! 16-bit patterns (the conversion to float is exact and monotone, so it commutes with max). The
//! maxima start from the first 16 elements, not from zero (the compiler cannot tell that a maximum
//! with zero is the value itself): a third fewer operations for a block of 16.
template <class T>
QCOLL_AVX2_INLINE i32x8 absmax_lanes(const T* x, std::size_t n) {
  if constexpr (sizeof(T) == 4) {
    i32x8 m0 = (i32x8)load(x) & 0x7fffffff, m1 = (i32x8)load(x + 8) & 0x7fffffff;
    QCOLL_UNROLL_BLOCK
    for (std::size_t i = 16; i < n; i += 16) {
      m0 = vmax((i32x8)load(x + i) & 0x7fffffff, m0);
      m1 = vmax((i32x8)load(x + i + 8) & 0x7fffffff, m1);
    }
    return vmax(m0, m1);
  } else {
    i16x16 m;
    std::memcpy(&m, x, sizeof m);
    m &= 0x7fff;
    QCOLL_UNROLL_BLOCK
    for (std::size_t i = 16; i < n; i += 16) {
      i16x16 v;
      std::memcpy(&v, x + i, sizeof v);
      v &= 0x7fff;
      m = v > m ? v : m;
    }
    return (i32x8)m;
  }
}

//! Where group_meta keeps block k's absmax_lanes so that max_tree puts it in lane k.
constexpr std::size_t tree_slot(std::size_t k) { return k < 4 ? 2 * k : 2 * (k - 4) + 1; }

//! Lane-wise max of two absmax_lanes vectors (32-bit or, Wide16, 16-bit lanes).
template <bool Wide16>
QCOLL_AVX2_INLINE i32x8 lane_max(i32x8 a, i32x8 b) {
  if constexpr (Wide16) {
    const i16x16 x = (i16x16)a, y = (i16x16)b;
    return (i32x8)(x > y ? x : y);
  } else {
    return vmax(a, b);
  }
}

//! Reduces eight vectors of lane-wise maxima (v[tree_slot(k)] of block k; 16-bit lanes when
//! Wide16) to one vector whose lane k is block k's maximum (sign-extended from 16 bits when
//! Wide16). Three levels of shuffles and maxima, 21 operations for the eight blocks.
template <bool Wide16>
QCOLL_AVX2_INLINE i32x8 lane_tree(const i32x8* v) {
  constexpr bool w16 = Wide16;
  i32x8 w[4], x[2];
  QCOLL_UNROLL
  for (int j = 0; j < 4; ++j)
    w[j] = lane_max<w16>(__builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11),
                         __builtin_shufflevector(v[2 * j], v[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15));
  QCOLL_UNROLL
  for (int j = 0; j < 2; ++j)
    x[j] = lane_max<w16>(__builtin_shufflevector(w[2 * j], w[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13),
                         __builtin_shufflevector(w[2 * j], w[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15));
  const i32x8 z = lane_max<w16>(__builtin_shufflevector(x[0], x[1], 0, 2, 8, 10, 4, 6, 12, 14),
                                __builtin_shufflevector(x[0], x[1], 1, 3, 9, 11, 5, 7, 13, 15));
  if constexpr (w16) return (lane_max<true>(z, (i32x8)((u32x8)z >> 16)) << 16) >> 16;
  return z;
}

//! Float bits of eight 16-bit patterns of T (half or bfloat16), one per 32-bit lane (upper half 0).
template <class T>
QCOLL_AVX2_INLINE i32x8 widen_bits16(i32x8 b) {
  if constexpr (std::is_same<T, half>::value) {
    const i16x8 h = __builtin_ia32_packusdw128(__builtin_shufflevector(b, b, 0, 1, 2, 3),
                                               __builtin_shufflevector(b, b, 4, 5, 6, 7));
    return (i32x8)__builtin_ia32_vcvtph2ps256(h);
  } else {
    return b << 16;
  }
}

//! Reduces eight absmax_lanes vectors (v[tree_slot(k)] of block k) to one vector whose lane k is
//! block k's largest |x| as float bits (NaN or Inf bits >= 0x7f800000 when the block holds one).
template <class T>
QCOLL_AVX2_INLINE i32x8 max_tree(const i32x8* v) {
  const i32x8 z = lane_tree<sizeof(T) == 2>(v);
  if constexpr (sizeof(T) == 2) return widen_bits16<T>(z);  // |x| patterns: the sign bit is 0
  return z;
}

//! Float bits of eight bit patterns of T, one per lane (16-bit ones zero-extended).
template <class T>
QCOLL_AVX2_INLINE i32x8 widen_bits(i32x8 p) {
  if constexpr (sizeof(T) == 4) return p;
  return widen_bits16<T>(p);
}

//! Bit k set for the lanes k of v (float bits) that are NaN or ±Inf.
QCOLL_AVX2_INLINE unsigned nonfinite_lanes(i32x8 v) {
  return static_cast<unsigned>(__builtin_ia32_movmskps256((f32x8)(((v & 0x7fffffff) >= 0x7f800000))));
}

//! detail::reciprocal per lane: (pre, inv) with x * pre * inv ≈ x / scale. Where no usable scale
//! is subnormal (the common case, tested once for the eight), pre = 1 and inv = 1 / scale without
//! the selects.
QCOLL_AVX2_INLINE void reciprocal_lanes(f32x8 scale, f32x8& pre, f32x8& inv) {
  const i32x8 usable = (scale > 0.0f) & is_finite(scale);
  const i32x8 tiny = usable & (scale < 1.17549435e-38f);
  if (__builtin_ia32_movmskps256((f32x8)tiny) == 0) {
    pre = f32x8{} + 1.0f;
    inv = (f32x8)(usable & (i32x8)(1.0f / scale));
    return;
  }
  const float big = 18446744073709551616.0f;  // 2^64
  pre = sel(tiny, f32x8{} + big, f32x8{} + 1.0f);
  inv = sel(usable, 1.0f / sel(tiny, scale * big, scale), f32x8{});
}

//! Stores the first `count` lanes of v as consecutive little-endian fp32 values (store_f32).
QCOLL_AVX2_INLINE void store_f32_lanes(f32x8 v, std::size_t count, unsigned char* p) {
  if (count == 8) {
    std::memcpy(p, &v, sizeof v);
  } else {
    std::memcpy(p, &v, 4 * count);
  }
}
//! Stores the low byte of the first `count` lanes of v.
QCOLL_AVX2_INLINE void store_u8_lanes(i32x8 v, std::size_t count, unsigned char* p) {
  if (count == 8) {
    const i8x32 idx = {0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                       0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    const i32x8 b = (i32x8)__builtin_ia32_pshufb256((i8x32)v, idx);
    const i32x4 w = __builtin_shufflevector(b, b, 0, 4, 1, 5);
    std::memcpy(p, &w, 8);
  } else {
    for (std::size_t k = 0; k < count; ++k) p[k] = static_cast<unsigned char>(v[k]);
  }
}

//! Encoding factors of eight blocks, one lane per block: codes from x * a * b (a: the Reciprocal's
//! pre factor, 1 unless the scale is tiny; 1 for MX).
struct EncLanes {
  f32x8 a, b;
};

// ---- minifloat element codecs ------------------------------------------------------------------

//! What minifloat_magnitude<E, Clamp, true> adds to each code before its shift
//! (minifloat_code_shift): the exponent field of 2^emin plus 23 - mbits, shifted as the codes'
//! exponents are (the biased codes, at most 1254, stay below 2^15 once shifted).
template <class E>
constexpr int minifloat_code_bias() {
  return static_cast<int>(minifloat::detail::Facts<E>::min_normal_bits >> (23 - E::mbits)) +
         ((23 - E::mbits) << E::mbits);
}
//! The left shift of minifloat_magnitude<E, Clamp, true>'s biased codes.
template <class E>
constexpr int minifloat_code_shift() {
  return 7 - E::mbits;
}

//! The magnitude code of minifloat::encode<E> per lane (sign bit clear) for y not NaN (the
//! kernels encode finite blocks only, whose scaled values are finite or ±Inf). One IEEE addition
//! rounds |y| (clamped to max_normal) to its step: m = 2^(max(e, emin) + 23 - mbits), for e the
//! exponent of |y|, has ulp(m) = the step of the codes at |y|, so fl(|y| + m) - m is |y| rounded
//! to nearest even (the sum stays below 2m), and bits(fl(|y| + m)) - bits(m) counts the steps:
//! the code, less (max(e, emin) - emin) << mbits for normal values. The same code as the scalar
//! function's separate normal (integer rounding) and subnormal (magic addition) paths. Clamp =
//! false: the caller knows |y| < max_normal + half its step, which rounds to max_normal anyway.
//! value (if not null): the value of the code, fl(|y| + m) - m (an exact subtraction), that is
//! minifloat::decode<E> of the code without its sign. Biased: (code + minifloat_code_bias<E>()) <<
//! minifloat_code_shift<E>(), in one operation: fl(|y| + m) has m's exponent field and the count
//! of steps (at most 2^(mbits + 1)) as its fraction, so one multiply-add of its two 16-bit halves
//! (pmaddwd: the count times 2^(7 - mbits) plus the field << 7) gives the field << mbits plus the
//! count, shifted, where the plain code takes three (codes32 shifts and takes the bias off once per
//! sixteen codes, after its first pack). Quantize in the caches and from memory (AMD EPYC, side by
//! side, both orders of the two builds): E4M3 at block 2048 1.15-1.20x faster with bfloat16 and half
//! input, 1.10x with fp32 in the caches (bound by the memory beyond them); E4M3 at block 32
//! 1.08-1.12x; MXFP6 1.07-1.14x; MXFP8 1.15x with fp32 input (16-bit input: Mx16, unchanged).
template <class E, bool Clamp = true, bool Biased = false>
QCOLL_AVX2_INLINE i32x8 minifloat_magnitude(f32x8 y, f32x8* value = nullptr) {
  using Fa = minifloat::detail::Facts<E>;
  constexpr int drop = 23 - E::mbits;
  const i32x8 a = (i32x8)y & 0x7fffffff;
  const i32x8 u = Clamp ? vmin(a, splat(static_cast<int>(Fa::max_bits))) : a;
  const i32x8 ex = vmax(u & 0x7f800000, splat(static_cast<int>(Fa::min_normal_bits)));
  const i32x8 m = ex + (drop << 23);
  const i32x8 s = (i32x8)((f32x8)u + (f32x8)m);
  if (value) *value = (f32x8)s - (f32x8)m;
  if constexpr (Biased) {
    constexpr short step = 1 << minifloat_code_shift<E>();
    return __builtin_ia32_pmaddwd256(
        (i16x16)s, i16x16{step, 1, step, 1, step, 1, step, 1, step, 1, step, 1, step, 1, step, 1});
  } else {
    return (s - m) + ((ex - static_cast<int>(Fa::min_normal_bits)) >> drop);
  }
}

//! minifloat_magnitude<minifloat::E2M1> without its clamp, with five of its nine operations
//! floating-point ones (three in minifloat_magnitude): 1.02-1.04x faster NVFP4 and MXFP4 quantize
//! in cache, whose loops are heavy in integer packs and shuffles, on an Intel Xeon. The code of a =
//! |y| is RNE(g(a)) for g(a) = min(2a, a + 2, a / 2 + 4): g is linear between the values of
//! neighbouring codes (0, 0.5, 1, 1.5, 2, 3, 4, 6 go to 0, 1, ..., 7), so a midpoint goes to c +
//! 1/2 and its tie to the even code, as E2M1's even mantissa; beyond 6, g < 7.5 up to a = 7.
//! Rounding is monotonic and commutes with adding even integers, so RNE(g(a)) = min(RNE(2a), RNE(a)
//! + 2, RNE(a / 2) + 4), and each term is the bits of one IEEE addition of 2^23 + {0, 2, 4} (2a and
//! a / 2 are exact; a subnormal a / 2 rounds, and every term of it is 0) less those of 2^23. For a
//! >= 7 (Inf included) the result is 8 or more (positive): the caller clamps it to 7, after packing
//! (codes32). Positive: y >= +0 (or NaN) is taken as its own magnitude. Fma (where has_fma()
//! holds): 2a + 2^23 and a / 2 + 2^23 + 4 as one fused operation each, the same values (2a is exact,
//! and a subnormal a / 2 gives 2^23 + 4 either way), two operations fewer per eight codes: NVFP4
//! quantize with bfloat16 input 1.09x faster in the caches, 1.06-1.09x from memory, fp32 1.02-1.04x
//! (AMD EPYC, side by side, both orders of the two builds).
template <bool Positive = false, bool Fma = false>
QCOLL_AVX2_INLINE i32x8 e2m1_magnitude(f32x8 y) {
  constexpr float m = 8388608.0f;  // 2^23
  const f32x8 a = Positive ? y : (f32x8)((i32x8)y & 0x7fffffff);
  f32x8 t1, t3;
  if constexpr (Fma) {
    t1 = fused_mul_add(a, f32x8{} + 2.0f, f32x8{} + m);
    t3 = fused_mul_add(a, f32x8{} + 0.5f, f32x8{} + (m + 4.0f));
  } else {
    t1 = (a + a) + m;
    t3 = a * 0.5f + (m + 4.0f);
  }
  const i32x8 r = vmin(vmin((i32x8)t1, (i32x8)(a + (m + 2.0f))), (i32x8)t3);
  return r - 0x4b000000;
}

//! minifloat::decode<E> per lane.
template <class E>
QCOLL_AVX2_INLINE f32x8 minifloat_decode(i32x8 code) {
  using Fa = minifloat::detail::Facts<E>;
  const i32x8 c = code & ((1 << E::bits) - 1);
  const i32x8 sign = (c >> (E::bits - 1)) << 31;
  const i32x8 mag = c & ((1 << (E::bits - 1)) - 1);
  const i32x8 normal = (mag << (23 - E::mbits)) + static_cast<int>((127u - E::bias) << 23);
  const f32x8 sub = __builtin_convertvector(mag, f32x8) * fp::from_bits(Fa::sub_step_bits);
  i32x8 out = sel((mag >> E::mbits) != 0, normal, (i32x8)sub) | sign;
  constexpr int inf_code = ((1 << E::ebits) - 1) << E::mbits;
  const i32x8 inf = E::has_inf ? (mag == inf_code) : i32x8{};
  if constexpr (E::has_inf) out = sel(inf, sign | 0x7f800000, out);
  if constexpr (E::has_nan) out = sel((mag > static_cast<int>(E::max_code)) & ~inf, splat(0x7fffffff), out);
  return (f32x8)out;
}

//! minifloat::decode<E> of every code of E, as a table the decoders look codes up in (filled
//! with minifloat_decode, so it holds the same values).
template <class E>
struct MinifloatTable {
  static constexpr int codes = 1 << E::bits;
  alignas(32) int bits[codes < 8 ? 8 : codes];
  QCOLL_AVX2_INLINE void fill() {
    for (int c = 0; c < codes; c += 8) {
      const f32x8 v = minifloat_decode<E>(splat(c) + i32x8{0, 1, 2, 3, 4, 5, 6, 7});
      std::memcpy(bits + c, &v, sizeof v);
    }
  }
  //! minifloat_decode<E>(code) for codes in [0, 2^E::bits): 4-bit codes by a permutation of the
  //! eight magnitudes and the sign bit, wider codes by a gather.
  QCOLL_AVX2_INLINE f32x8 operator()(i32x8 code) const {
    if constexpr (E::bits == 4) {
      static_assert(!E::has_nan && !E::has_inf, "4-bit codes: value(c | 8) = -value(c)");
      f32x8 mag;
      std::memcpy(&mag, bits, sizeof mag);
      return (f32x8)((i32x8)__builtin_ia32_permvarsf256(mag, code) | ((code & 8) << 28));
    } else {
#if defined(__clang__)
      return (f32x8)__builtin_ia32_gatherd_d256(i32x8{}, bits, code, splat(-1), 4);
#else
      return (f32x8)__builtin_ia32_gathersiv8si(i32x8{}, bits, code, splat(-1), 4);
#endif
    }
  }
};

// ---- per-format vector codecs ------------------------------------------------------------------

//! detail::mx_make_meta per lane for finite absmax lanes: stores the E8M0 codes of the first
//! `count` lanes and returns the encode factors a = 1, b = 2^-X (in [2^-127, 2^127]). One
//! multiplication by 2^-X gives the codes of detail::mx_scale_in's two (by 2^e1, then by 2^e2;
//! e1 = -X / 2, e2 = -X - e1). Neither overflows: |x| * 2^-X < 2^(emax + 1). For X <= 0 both
//! scale up, exactly. For X > 0 both scale down, exactly where |x * 2^-X| >= 2^-126 (x * 2^e1 is
//! then normal too); below that both give a zero code (of x's sign where codes carry one), every
//! MX element's smallest step being at least 2^-16.
template <int Emax>
QCOLL_AVX2_INLINE EncLanes mx_enc_lanes(f32x8 amax, std::size_t count, unsigned char* meta) {
  // floor(log2(absmax)) - emax from the exponent field; zero and subnormal absmax (field 0) give
  // at most -127 - emax, clamped to -127 as the scalar function's ilog2 path and zero case are.
  static_assert(Emax >= 0, "subnormal absmax clamps to -127 only for emax >= 0");
  i32x8 x = (((i32x8)amax & 0x7fffffff) >> 23) - (127 + Emax);
  x = vmin(vmax(x, splat(-127)), splat(127));
  store_u8_lanes(x + 127, count, meta);
  const i32x8 n = -x;
  const i32x8 e1 = (n - (n >> 31)) >> 1;  // n / 2, rounded toward zero
  // 2^n as the product of two normal powers of two (2^-127 is subnormal)
  return EncLanes{f32x8{} + 1.0f, (f32x8)((e1 + 127) << 23) * (f32x8)((n - e1 + 127) << 23)};
}

//! Vector versions of F::encode (Enc: from eight blocks' absmax lanes by make_enc, or from the
//! block's Meta by enc for the range formats) and F::decode (Dec). Defined for the scaled formats;
//! `range` says whether make_meta reads lo and hi (then encode_full_blocks runs the scalar
//! make_meta per block); unit_a, whether make_enc always gives a = 1 (MX).
//! Enc::scaled(x) is F's scaling x * a * b of a block whose factor a is 1 (blocks whose a is not
//! 1, with a scale below the normal range, are left to the scalar encoder), Enc::code<Clamp>(y)
//! the code of a scaled value: a signed integer (signed_codes) or a minifloat magnitude
//! (sign_from_input: its sign is the sign bit of y, added when the codes are packed; plus Enc::bias
//! and shifted, and clamped only there, see MinifloatCodec). exact_scale:
//! the block scale is fl(absmax / largest code value), and the encoding factor fl(1 / scale) (a =
//! 1) when the scale is normal, so |y| <= largest * (1 + 3 * 2^-24), which rounds to the largest
//! code: Clamp = false leaves out the clamp, for the same codes.
template <class F>
struct Codec {
  static constexpr bool defined = false;
};

//! Codes from a value scaled by two factors: minifloats with an fp32 (or E4M3) block scale, MX
//! minifloats, symmetric integers.
template <class E, bool Saturating>
struct MinifloatCodec {
  static constexpr bool defined = true, range = false, signed_codes = false, sign_from_input = true;
  static constexpr unsigned code_bits_of = E::bits;  //!< bits of a code (the sign bit's place)
  static constexpr bool e2m1 = std::is_same<E, minifloat::E2M1>::value;
  struct Enc {
    //! What code() adds to each code, and its left shift, taken off by codes32 after its first
    //! pack (16-bit lanes).
    static constexpr int bias = e2m1 ? 0 : minifloat_code_bias<E>();
    static constexpr int shift = e2m1 ? 0 : minifloat_code_shift<E>();
    //! Whether codes32 hands code() the magnitudes |y| of bfloat16 input (Positive), the sign
    //! bits cleared in the 16-bit patterns: one operation per 16 elements instead of one per 8.
    //! E2M1 only: NVFP4 quantize 1.03x faster in the caches and from memory, E4M3 at block 32
    //! and MXFP6 0.98-0.99x (AMD EPYC, side by side, both orders of the two builds).
    static constexpr bool magnitudes = e2m1;
    float b;
    QCOLL_AVX2_INLINE f32x8 scaled(f32x8 x) const { return x * b; }
    //! The magnitude's code of y, plus bias and shifted (minifloat_magnitude's Biased), unclamped
    //! for every Clamp: codes32 clamps the packed bytes to the largest code (one operation per 32
    //! codes instead of one per 8; codes of larger magnitudes, below 2^(emax + 1) in a finite MX
    //! block and Inf included for E2M1, are positive and pack to bytes above it, the same code as
    //! clamping first, rounding being monotonic). MX quantize 1.06x faster with fp32 input from
    //! memory (MXFP8 1.10x in the caches), MXFP6 1.06-1.07x with 16-bit input (AMD EPYC, side by
    //! side, both orders of the two builds).
    template <bool Clamp = true, bool Positive = false, bool Fma = false>
    QCOLL_AVX2_INLINE i32x8 code(f32x8 y) const {
      static_assert(!Positive || magnitudes, "magnitudes only where they serve");
      if constexpr (e2m1) return e2m1_magnitude<Positive, Fma>(y);
      return minifloat_magnitude<E, false, true>(y);
    }
  };
  //! Codes are decoded by look-up in a MinifloatTable<E> (see Dec::scaled).
  using Element = E;
  struct Dec {
    // Saturating: scale_value(v * b, a), where v * b is exact (b = 1, or NVFP4's E4M3 block scale,
    // whose NaN makes the block NaN); else v * a * b.
    float a, b;
    bool saturates() const { return Saturating && may_saturate(a, E::has_nan || E::has_inf); }
    //! Whether no decoded value can be NaN: finite codes only, and finite factors.
    bool nan_free() const { return !E::has_nan && !E::has_inf && fp::is_finite(a) && fp::is_finite(b); }
    template <bool Sat>
    QCOLL_AVX2_INLINE f32x8 apply(i32x8 c) const {
      return scaled<Sat>(minifloat_decode<E>(c));
    }
    //! The value of decoded codes v (minifloat::decode<E>).
    template <bool Sat>
    QCOLL_AVX2_INLINE f32x8 scaled(f32x8 v) const {
      if constexpr (Saturating) {
        if (!fp::is_finite(b)) return v * b;
        return scale_value<Sat>(v * b, a);
      } else {
        return v * a * b;
      }
    }
  };
};

template <class E, std::size_t K>
struct Codec<Fp8Scaled<E, K>> : MinifloatCodec<E, true> {
  using M = typename Fp8Scaled<E, K>::Meta;
  static constexpr bool exact_scale = true;
  static constexpr bool unit_a = false;
  static constexpr bool via_half = true;  // decode_codes converts the codes as fp16 (fp8_as_half)
  //! make_meta + store_meta of eight blocks (the first `count` stored) from their absmax lanes.
  QCOLL_AVX2_INLINE static EncLanes make_enc(f32x8 amax, float, std::size_t count, unsigned char* meta) {
    const f32x8 scale = amax / E::max_normal;
    store_f32_lanes(scale, count, meta);
    EncLanes e;
    reciprocal_lanes(scale, e.a, e.b);
    return e;
  }
  static typename MinifloatCodec<E, true>::Dec dec(const M& m) { return {m.scale, 1.0f}; }
};
template <>
struct Codec<NvFp4> : MinifloatCodec<minifloat::E2M1, true> {
  static constexpr bool exact_scale = false;  // the block scale is rounded to E4M3
  static constexpr bool unit_a = false;
  //! Whether every block's a factor is 1 in a message of this scale: its block scales fl(v *
  //! message_scale), v an E4M3 value (0, or in [2^-9, 448]), are then 0 or normal and finite, as
  //! 2^-9 * 2^-117 = 2^-126 and 448 * 2^119 < 2^128 (the bound above only rules out Inf: a finite
  //! message's scale is at most FLT_MAX / 2688 < 2^117). Unit: make_enc for such a scale, whose
  //! block reciprocals are 1 / scale (0 for a zero scale), with no lane to check.
  static bool unit_a_at(float message_scale) {
    return message_scale >= 0x1p-117f && message_scale < 0x1p119f;
  }
  template <bool Unit = false>
  QCOLL_AVX2_INLINE static EncLanes make_enc(f32x8 amax, float message_scale, std::size_t count,
                                             unsigned char* meta) {
    const float denom = 6.0f * message_scale;                            // > 0 where Unit
    const f32x8 target = Unit || denom > 0.0f ? amax / denom : f32x8{};  // >= 0: its code is its magnitude's
    f32x8 value;
    store_u8_lanes(minifloat_magnitude<minifloat::E4M3>(target, &value), count, meta);
    const f32x8 scale = value * message_scale;
    EncLanes e;
    if constexpr (Unit) {  // reciprocal_lanes' values for such scales
      e.a = f32x8{} + 1.0f;
      e.b = (f32x8)((scale > 0.0f) & (i32x8)(1.0f / scale));
    } else {
      reciprocal_lanes(scale, e.a, e.b);
    }
    return e;
  }
  static Dec dec(const NvFp4::Meta& m) { return {m.message_scale, m.block_scale}; }
};
template <class E>
struct Codec<MxFloat<E>> : MinifloatCodec<E, false> {
  static constexpr bool exact_scale = false;  // power-of-two scales
  static constexpr bool unit_a = true;
  QCOLL_AVX2_INLINE static EncLanes make_enc(f32x8 amax, float, std::size_t count, unsigned char* meta) {
    return mx_enc_lanes<E::emax>(amax, count, meta);
  }
  static typename MinifloatCodec<E, false>::Dec dec(const ::qcoll::detail::MxMeta& m) {
    return {m.dec_a, m.dec_b};
  }
};

//! Integer codes: y = x * a * b * post, rounded to nearest even, clamped to [-q, q]; decoded
//! as a sign-extended Bits-bit integer times `unit`, then scaled (scale_value for a fp32 block
//! scale, two exact factors for MX).
template <unsigned Bits, bool MxScaled>
struct IntCodec {
  // codes as signed lanes; the packing keeps their low Bits bits
  static constexpr bool defined = true, range = false, signed_codes = true, sign_from_input = false;
  static constexpr int q = Bits == 8 ? 127 : 7;
  struct Enc {
    float b;
    QCOLL_AVX2_INLINE f32x8 scaled(f32x8 x) const { return x * b; }
    static constexpr bool magnitudes = false;  // signed codes: see MinifloatCodec
    template <bool Clamp = true, bool = false, bool = false>
    QCOLL_AVX2_INLINE i32x8 code(f32x8 y) const {
      if constexpr (MxScaled) {
        // MxInt8: rint(y * 64) clamped to [-127, 127]. In the finite blocks the kernels encode,
        // |y * 64| < 128, so cvtps2dq (nearest even) and an integer clamp give the same codes.
        return vmin(vmax(__builtin_ia32_cvtps2dq256(y * 64.0f), splat(-127)), splat(127));
      } else {  // SymmetricInt: clamp (if Clamp), then round (cvtps2dq rounds to nearest even)
        return __builtin_ia32_cvtps2dq256(Clamp ? clamp(y, -float(q), float(q)) : y);
      }
    }
  };
  struct Dec {
    float a, b;
    bool saturates() const { return !MxScaled && may_saturate(a, false); }
    //! Whether no decoded value can be NaN: finite factors (the codes are integers).
    bool nan_free() const { return fp::is_finite(a) && (!MxScaled || fp::is_finite(b)); }
    //! The value of codes c, sign-extended to 32 bits (unpack8<Bits, true>).
    template <bool Sat>
    QCOLL_AVX2_INLINE f32x8 apply(i32x8 c) const {
      const f32x8 v = __builtin_convertvector(c, f32x8);
      if constexpr (MxScaled) {
        return v * 0.015625f * a * b;
      } else {
        return scale_value<Sat>(v, a);
      }
    }
  };
};

template <unsigned B, std::size_t K>
struct Codec<SymmetricInt<B, K>> : IntCodec<B, false> {
  using M = typename SymmetricInt<B, K>::Meta;
  static constexpr bool exact_scale = true;
  static constexpr bool unit_a = false;
  QCOLL_AVX2_INLINE static EncLanes make_enc(f32x8 amax, float, std::size_t count, unsigned char* meta) {
    const f32x8 scale = amax / static_cast<float>(SymmetricInt<B, K>::qmax);
    store_f32_lanes(scale, count, meta);
    EncLanes e;
    reciprocal_lanes(scale, e.a, e.b);
    return e;
  }
  static typename IntCodec<B, false>::Dec dec(const M& m) { return {m.scale, 1.0f}; }
};
template <>
struct Codec<MxInt8> : IntCodec<8, true> {
  static constexpr bool exact_scale = false;
  static constexpr bool unit_a = true;
  QCOLL_AVX2_INLINE static EncLanes make_enc(f32x8 amax, float, std::size_t count, unsigned char* meta) {
    return mx_enc_lanes<0>(amax, count, meta);
  }
  static Dec dec(const ::qcoll::detail::MxMeta& m) { return {m.dec_a, m.dec_b}; }
};

//! Asymmetric integers: the scalar double arithmetic, four lanes at a time.
template <unsigned B, std::size_t K>
struct Codec<AsymmetricInt<B, K>> {
  using F = AsymmetricInt<B, K>;
  static constexpr bool defined = true, range = true, signed_codes = false;
  struct Enc {
    double offset, inv;
    QCOLL_AVX2_INLINE i32x4 half_enc(f32x4 x) const {
      const f64x4 y = (to_f64(x) - offset) * inv;
      // Clamping first (NaN becomes 0), then cvtpd2dq's nearest-even rounding: the same code as
      // drint, then clamping, as 0 and qmax are integers.
      const f64x4 c = __builtin_ia32_minpd256(__builtin_ia32_maxpd256(y, f64x4{}), f64x4{} + double(F::qmax));
      return __builtin_ia32_cvtpd2dq256(c);
    }
    QCOLL_AVX2_INLINE i32x8 operator()(f32x8 x) const {
      const i32x4 lo = half_enc(__builtin_shufflevector(x, x, 0, 1, 2, 3));
      const i32x4 hi = half_enc(__builtin_shufflevector(x, x, 4, 5, 6, 7));
      return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7);
    }
  };
  struct Dec {
    double offset, scale;
    QCOLL_AVX2_INLINE f32x4 half_dec(i32x4 c) const {
      return __builtin_convertvector(offset + to_f64(c) * scale, f32x4);
    }
    bool saturates() const { return false; }
    bool nan_free() const { return false; }  // not worth a second instantiation
    template <bool>
    QCOLL_AVX2_INLINE f32x8 apply(i32x8 c) const {
      const f32x4 lo = half_dec(__builtin_shufflevector(c, c, 0, 1, 2, 3));
      const f32x4 hi = half_dec(__builtin_shufflevector(c, c, 4, 5, 6, 7));
      return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7);
    }
  };
  static Enc enc(const typename F::Meta& m) { return {double(m.offset), m.inv}; }
  static Dec dec(const typename F::Meta& m) { return {double(m.offset), double(m.scale)}; }

  //! The float estimate of Enc's double arithmetic for the elements of a block (lo <= x <= hi), as
  //! a fixed-point number: t = (x - offset) * inv + bias in float, inv = 1 / scale rounded to
  //! float, bias = 256 + 1/2 - 3 * 2^-15. Such an element's y = (x - offset) * inv lies in [0, qmax
  //! * (1 + 2^-21)], so t lies in [256, 512), where floats step by 2^-15: t's fraction bits are T =
  //! (y + 1/2) * 2^15 - 3 rounded to an integer (the addition's rounding, at most 1/2), whose bits
  //! 15-22 are the estimated code floor(y + 1/2) (at most qmax) and bits 0-14 its fraction f.
  //! Against Enc's double value the float value of y errs by at most 3.01 * 2^-24 * |y| + 2^-48
  //! (three float roundings, three double ones; a subnormal difference errs by 2^-150 times inv <=
  //! 2^100), below 1.51 * 2^-15 for |y| < 256. So the double y + 1/2 lies in [T + 0.99, T + 5.01] *
  //! 2^-15, strictly between the integers around it wherever f <= 2^15 - 6: there the code is
  //! Enc's (no tie, and no clamp, as 0 <= code <= qmax). Where f >= 2^15 - 5 Enc decides. Scales
  //! outside [2^-100, 2^100] (0 included) take Enc; below 2^100, x - offset <= hi - lo stays
  //! finite (blocks holding NaN or an infinity never get here). Five operations per 8 elements;
  //! per 32, five to check (unsure) and six (bfloat16: seven) to pack the codes (word_bytes32).
  struct Estimate {
    float offset, inv;
    static constexpr float bias = 256.5f - 3 * 0x1p-15f;
    //! The bits of t for x. t >> 15 (t > 0: the shift is logical) is code + 0x8700 (t's exponent
    //! field above the code).
    QCOLL_AVX2_INLINE i32x8 operator()(f32x8 x) const { return (i32x8)((x - offset) * inv + bias); }
    //! The lanes of `fraction` (fractions f) near a tie, f >= 2^15 - 5: there Enc decides.
    static QCOLL_AVX2_INLINE i32x8 near_fraction(i32x8 fraction) { return fraction > (1 << 15) - 6; }
    //! Whether some lane of the four t is near a tie (a tree of the fractions' maxima).
    static QCOLL_AVX2_INLINE bool unsure(const i32x8* t) {
      const i32x8 m =
          near_fraction(vmax(vmax(t[0] & 0x7fff, t[1] & 0x7fff), vmax(t[2] & 0x7fff, t[3] & 0x7fff)));
      return !__builtin_ia32_ptestz256((i64x4)m, (i64x4)m);
    }
  };

  //! Whether F::decode's double sum offset + code * scale, rounded to float, equals one float FMA
  //! (one rounding of the exact sum): when that sum fits in double's 53 bits, so that the double
  //! sum is exact. offset is an integer below 2^24 times its last bit's weight 2^lo, code * scale
  //! one below 2^32 times 2^ls (lo, ls: biased exponent, at least 1, minus 150); the sum fits
  //! when -20 <= lo - ls <= 28, or when either is zero. Non-finite metas take Dec.
  static bool fma_exact(float offset, float scale) {
    const std::uint32_t uo = fp::bits(offset), us = fp::bits(scale);
    const int eo = static_cast<int>(uo >> 23 & 0xff), es = static_cast<int>(us >> 23 & 0xff);
    if (eo == 0xff || es == 0xff) return false;
    if ((uo & 0x7fffffffu) == 0 || (us & 0x7fffffffu) == 0) return true;
    const int d = (eo > 1 ? eo : 1) - (es > 1 ? es : 1);
    return d >= -20 && d <= 28;
  }
};

// ---- packing -----------------------------------------------------------------------------------

//! The bytes of four vectors of codes packed by packssdw(c0, c1), packssdw(c2, c3) and a byte pack
//! of those two, put in element order: the packs leave 4-byte groups in the order 0, 4, 1, 5, 2,
//! 6, 3, 7, or (Paired: the vectors held elements as load16 pairs them) 8-byte groups in the order
//! 0, 2, 1, 3.
template <bool Paired>
QCOLL_AVX2_INLINE i8x32 in_order(i32x8 b) {
  if constexpr (Paired) {
    const i64x4 q = (i64x4)b;
    return (i8x32)__builtin_shufflevector(q, q, 0, 2, 1, 3);
  } else {
    return (i8x32)__builtin_shufflevector(b, b, 0, 4, 1, 5, 2, 6, 3, 7);
  }
}

//! Codes of 32-bit lanes to bytes in element order, 4 vectors at a time: codes in [0, 255], or
//! (Signed) in [-128, 127], stored as their low byte. Paired (the vectors held elements as load16
//! pairs them): left in the packs' order, which store_codes32<..., true> puts in element order.
template <bool Signed, bool Paired = false>
QCOLL_AVX2_INLINE i8x32 bytes32(i32x8 c0, i32x8 c1, i32x8 c2, i32x8 c3) {
  const i16x16 lo = __builtin_ia32_packssdw256(c0, c1), hi = __builtin_ia32_packssdw256(c2, c3);
  const i32x8 b = (i32x8)(Signed ? __builtin_ia32_packsswb256(lo, hi) : __builtin_ia32_packuswb256(lo, hi));
  return Paired ? (i8x32)b : in_order<false>(b);
}

//! The 32 code bytes of four vectors of words code + 0x8700 (Codec<AsymmetricInt>::Estimate) or
//! code (Enc) of elements in load16's order (Split: load16_split's), in element order: an unsigned
//! pack to 16-bit words, their low bytes, a byte pack, then the order.
template <bool Split>
QCOLL_AVX2_INLINE i8x32 word_bytes32(i32x8 w0, i32x8 w1, i32x8 w2, i32x8 w3) {
  const i16x16 lo = __builtin_ia32_packusdw256(w0, w1) & 0xff, hi = __builtin_ia32_packusdw256(w2, w3) & 0xff;
  const i8x32 b = __builtin_ia32_packuswb256(lo, hi);
  if constexpr (Split) {  // each 8-byte group holds four even elements, then four odd ones
    const i8x32 odd_even{0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                         0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};
    return in_order<true>((i32x8)__builtin_ia32_pshufb256(b, odd_even));
  } else {
    return in_order<false>((i32x8)b);
  }
}

//! Minifloat codes of 4 vectors to bytes in element order: magnitudes m0..m3 plus Bias, shifted
//! left by Shift (each in [Bias << Shift, 2^15)), with the sign bits of `sg` (one byte per code, in
//! the packs' order: the sign is the byte's top bit) in bit Bits - 1. The shift and the bias come
//! off after the first pack; magnitudes are then at most 127, or (Max < 127) clamped to Max (larger
//! ones, up to 2^15 - 1, pack to 255 first).
//! Paired: see bytes32.
template <unsigned Bits, bool Paired = false, int Bias = 0, int Max = 127, int Shift = 0>
QCOLL_AVX2_INLINE i8x32 signed_bytes32(i32x8 m0, i32x8 m1, i32x8 m2, i32x8 m3, i8x32 sg) {
  i16x16 lo = __builtin_ia32_packssdw256(m0, m1), hi = __builtin_ia32_packssdw256(m2, m3);
  if constexpr (Shift != 0) {
    lo >>= Shift;
    hi >>= Shift;
  }
  if constexpr (Bias != 0) {
    lo -= static_cast<short>(Bias);
    hi -= static_cast<short>(Bias);
  }
  i8x32 mag = __builtin_ia32_packuswb256(lo, hi);
  if constexpr (Max < 127) {
#if defined(__clang__)
    mag = (i8x32)__builtin_elementwise_min((u8x32)mag, (u8x32){} + static_cast<unsigned char>(Max));
#else
    mag = __builtin_ia32_pminub256(mag, i8x32{} + static_cast<char>(Max));  // unsigned bytes
#endif
  }
  const i8x32 sign = Bits == 8 ? (i8x32)(sg & (char)0x80) : (i8x32)((sg < 0) & (char)(1 << (Bits - 1)));
  return Paired ? mag | sign : in_order<false>((i32x8)(mag | sign));
}

//! The sign bytes of signed_bytes32 for the values y0..y3 (or, of bfloat16 input, w0 and w1):
//! signed saturation packs a float's bits (or a bfloat16 pattern) to a byte whose top bit is its
//! sign (-0 included), so the signs cost three packs for 32 values (one from 16-bit patterns,
//! which the packs leave in the order of the packed codes of paired loads).
QCOLL_AVX2_INLINE i8x32 sign_bytes(f32x8 y0, f32x8 y1, f32x8 y2, f32x8 y3) {
  return __builtin_ia32_packsswb256(__builtin_ia32_packssdw256((i32x8)y0, (i32x8)y1),
                                    __builtin_ia32_packssdw256((i32x8)y2, (i32x8)y3));
}
QCOLL_AVX2_INLINE i8x32 sign_bytes(i16x16 w0, i16x16 w1) { return __builtin_ia32_packsswb256(w0, w1); }

//! Writes 32 codes (one per byte of c, in element order, low Bits bits used) as Bits-bit codes:
//! 32, 24 or 16 bytes (a little-endian bit stream; 4-bit codes two to a byte, element 2k low).
//! stream: 8-bit codes with non-temporal stores (out 16-byte aligned; the caller fences). Clean:
//! the bytes are codes already (below 2^Bits; minifloat codes), so their high bits need no clearing.
//! Paired: c holds the codes in the order that the packs leave those of paired loads (bytes32),
//! which 4-bit codes put in element order with the permutation that gathers their packed bytes
//! (one instead of two: quantize of bfloat16 input in the caches, int4 at blocks 32 and 256
//! 1.04-1.07x faster, NVFP4 1.02x; AMD EPYC, side by side, both orders of the two builds).
template <unsigned Bits, bool Clean = false, bool Paired = false>
QCOLL_AVX2_INLINE void store_codes32(i8x32 c, unsigned char* out, bool stream = false) {
  if constexpr (Paired && Bits != 4) {
    store_codes32<Bits, Clean>(in_order<true>((i32x8)c), out, stream);
  } else if constexpr (Bits == 8) {
    if (stream) {
      stream32(out, (i64x4)c);
    } else {
      std::memcpy(out, &c, 32);
    }
  } else if constexpr (Bits == 4) {  // byte k = code 2k | code 2k+1 << 4
    const i8x32 f = {1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16,
                     1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16};
    const i16x16 w = __builtin_ia32_pmaddubsw256(Clean ? c : c & (char)0x0f, f);
    const i32x8 p = (i32x8)__builtin_ia32_packuswb256(w, w);  // 4 bytes per 8 codes, twice per half
    // the 8-code groups in element order: 0 1 | 2 3 of each half, or (Paired) 0 2 | 1 3
    const i32x4 q =
        Paired ? __builtin_shufflevector(p, p, 0, 4, 1, 5) : __builtin_shufflevector(p, p, 0, 1, 4, 5);
    std::memcpy(out, &q, 16);
  } else {  // 6 bits: four codes to 24 bits, then 3 bytes of each 32-bit lane
    static_assert(Bits == 6, "codes of 4, 6 or 8 bits");
    const i8x32 f = {1, 64, 1, 64, 1, 64, 1, 64, 1, 64, 1, 64, 1, 64, 1, 64,
                     1, 64, 1, 64, 1, 64, 1, 64, 1, 64, 1, 64, 1, 64, 1, 64};
    const i16x16 g = {1, 4096, 1, 4096, 1, 4096, 1, 4096, 1, 4096, 1, 4096, 1, 4096, 1, 4096};
    const i32x8 d = __builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256(Clean ? c : c & (char)0x3f, f), g);
    const i8x32 idx = {0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                       0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1};
    const i32x8 t = (i32x8)__builtin_ia32_pshufb256((i8x32)d, idx);
    const i32x8 u = __builtin_shufflevector(t, t, 0, 1, 2, 4, 5, 6, 3, 7);
    std::memcpy(out, &u, 24);
  }
}

//! store_codes32<4, true, true> of c0 (codes 0 to 31) and c1 (32 to 63) with one byte pack, one
//! permutation and one store for the two. NVFP4 quantize of bfloat16 input 1.03x faster in the
//! caches and from memory; with fp32 and half input (codes in element order) 0.88-0.94x, so
//! those keep 32 codes per step.
QCOLL_AVX2_INLINE void store_codes64(i8x32 c0, i8x32 c1, unsigned char* out) {
  const i8x32 f = {1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16,
                   1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16};
  // 4 bytes per 8 codes: c0's first two groups of each half, then c1's
  const i32x8 p = (i32x8)__builtin_ia32_packuswb256(__builtin_ia32_pmaddubsw256(c0, f),
                                                    __builtin_ia32_pmaddubsw256(c1, f));
  const i32x8 q = __builtin_shufflevector(p, p, 0, 4, 1, 5, 2, 6, 3, 7);
  std::memcpy(out, &q, sizeof q);
}

//! The eight Bits-bit codes (4 or 8 bits; 6-bit codes: fp6_as_half) of elements [j, j + 8) of a
//! packed block, one per 32-bit lane: zero- or (Signed) sign-extended.
template <unsigned Bits, bool Signed = false>
QCOLL_AVX2_INLINE i32x8 unpack8(const unsigned char* codes, std::size_t j) {
  static_assert(Bits == 8 || Bits == 4, "codes of 4 or 8 bits");
  if constexpr (Bits == 8) {
    return widen8<Signed>(codes + j);
  } else if constexpr (Bits == 4) {
    std::uint32_t w;
    std::memcpy(&w, codes + j / 2, 4);
    if constexpr (Signed) {  // each code to the top nibble, then back down with its sign
      return (i32x8)((u32x8{} + w) << u32x8{28, 24, 20, 16, 12, 8, 4, 0}) >> 28;
    } else {
      return (i32x8)(((u32x8{} + w) >> u32x8{0, 4, 8, 12, 16, 20, 24, 28}) & 0xfu);
    }
  }
}

// ---- block kernels -----------------------------------------------------------------------------

//! Whether the kernels below serve format F.
template <class F>
constexpr bool has_kernels() {
  return Codec<F>::defined;
}

//! Full blocks handled together by encode_full_run and encode_full_blocks (at most 8, one vector
//! lane each): enough that their metas' arithmetic is shared, few enough that the group (at most 8 KiB of
//! fp32 input) stays in L1 between the statistics and the encoding.
template <class F>
constexpr std::size_t group_blocks() {
  return F::block >= 2048 ? 1 : (2048 / F::block < 8 ? 2048 / F::block : 8);
}

//! How far past the group it encodes encode_group prefetches its input, in bytes: enough to cover
//! the memory latency at the kernels' rate, not so far that the prefetched lines wait long in the
//! line fill buffers. Measured with fp32 inputs far beyond the caches at block 32: on an AMD Zen 3,
//! 2 KiB and 8 KiB ran 10-13% slower than 4 KiB (and no faster at block 2048); on an Intel Xeon
//! (Sapphire Rapids class), 2 KiB ran 3-10% faster than 4 KiB, and 3 KiB as fast as 4 KiB, but 4%
//! slower with bfloat16 input (MXFP4, int8). So 2 KiB for fp32 input on Intel processors, 4 KiB
//! otherwise. O(1) (reads the processor model the runtime keeps).
template <class T>
inline std::size_t prefetch_ahead() {
  return sizeof(T) == 4 && __builtin_cpu_is("intel") ? 2048 : 4096;
}

//! How much further than prefetch_ahead<T>() prefetch_next also requests its lines into L2, in
//! bytes: they then arrive ahead of the L1 requests, which find them there (the processor's own L2
//! prefetcher stops at each 4 KiB boundary, so each page began with misses the L1 requests alone
//! did not hide). Quantize from memory (Intel Xeon, 64 Mi N(0, 1) values in 2 MiB pages, side by
//! side, two rounds), fp32 input: 1.00-1.20x (int8 at blocks 32 and 2048 1.11x and 1.19x, int4
//! at 256 1.11x; e4m3 at 32 and 2048 1.05x and 1.08x; int8a at 32 1.07x; MXFP8 1.05x; NVFP4 and
//! MXFP4 1.02-1.04x; MXFP6 level); bfloat16 input 0.99-1.16x (int8 at 2048 1.16x, int4 at 256
//! 1.09x, int8 and int4 at 32 1.05x; the other formats level). In the caches the two requests per
//! line cost up to 3% (int8 at block 32, 64 Ki and 1 Mi values). 16 KiB further measured like 4 KiB
//! for most formats, but left the asymmetric integers at block 256 0.94-0.97x.
inline constexpr std::size_t l2_prefetch_further = 4096;

//! Prefetches the lines of the 32 elements of T that lie `ahead` (prefetch_ahead<T>()) bytes past the
//! group of F that holds p[0, 32), and those l2_prefetch_further bytes beyond into L2.
//! encode_full_run reads each group twice, for its statistics and to encode it; the second read
//! hits the caches, and the prefetches issued there keep the memory busy while the codes are
//! computed. Issued in the statistics loop instead, they left FP8 and MX quantize of fp32 input
//! 12-32% slower, and int4 at block 2048 24% slower with bf16 input (no different with fp32).
//! encode_full_blocks (the asymmetric integers) likewise: there, instead of one group ahead in the
//! statistics loop, 1.09-1.28x from memory at block 2048, 1.01-1.15x at 256, level at 32 (AMD EPYC).
template <class F, class T>
QCOLL_AVX2_INLINE void prefetch_next(const T* p, std::size_t ahead) {
  const char* q = reinterpret_cast<const char*>(p) + ahead + group_blocks<F>() * F::block * sizeof(T);
  QCOLL_UNROLL
  for (std::size_t line = 0; line < 32 * sizeof(T); line += 64) {
    __builtin_prefetch(q + line);
    __builtin_prefetch(q + l2_prefetch_further + line, 0, 2);  // prefetcht1: into L2
  }
}

//! Whether load16 pairs the elements of T: bfloat16 widens by interleaving with zero words (one
//! operation per eight elements instead of a zero extension and a shift).
template <class T>
constexpr bool paired_load = std::is_same<T, bfloat16>::value;

//! p[0, 16) as floats: a = p[0, 8), b = p[8, 16), or (paired_load<T>) a = p[0, 4) + p[8, 12),
//! b = p[4, 8) + p[12, 16), whose codes the packs return to element order (in_order<true>).
//! Positive: |p[i]| instead (paired_load<T> only: the sign bits cleared in the 16-bit patterns,
//! one operation per 16 elements instead of one per 8 on the floats).
template <class T, bool Positive = false>
QCOLL_AVX2_INLINE void load16(const T* p, f32x8& a, f32x8& b) {
  static_assert(!Positive || paired_load<T>, "magnitudes from 16-bit patterns");
  if constexpr (paired_load<T>) {
    i16x16 v;
    std::memcpy(&v, p, sizeof v);
    if constexpr (Positive) v &= 0x7fff;
    const i16x16 z{};
    a = (f32x8)__builtin_shufflevector(z, v, 0, 16, 1, 17, 2, 18, 3, 19, 8, 24, 9, 25, 10, 26, 11, 27);
    b = (f32x8)__builtin_shufflevector(z, v, 4, 20, 5, 21, 6, 22, 7, 23, 12, 28, 13, 29, 14, 30, 15, 31);
  } else {
    a = load(p);
    b = load(p + 8);
  }
}

//! p[0, 16) of bfloat16 as floats without a shuffle (a bfloat16 is the high half of its float):
//! a = the even elements p[0], p[2], ..., p[14], b = the odd ones.
QCOLL_AVX2_INLINE void load16_split(const bfloat16* p, f32x8& a, f32x8& b) {
  i32x8 v;
  std::memcpy(&v, p, sizeof v);
  a = (f32x8)(v << 16);
  b = (f32x8)(v & static_cast<int>(0xffff0000u));
}

//! 32 codes as bytes in element order, or in the packs' order of paired loads (paired_load<T>,
//! see bytes32): p0[0, 16) scaled with e0, p1[0, 16) with e1, blocks whose a factor is 1
//! (encode_group). Formats with exact_scale leave out Enc::code's clamp (see Codec). Fma: see
//! e2m1_magnitude. HalfSigns (half input, minifloat codes): the signs from the 16-bit patterns, one
//! pack and one permutation where the floats take three packs (quantize in the caches and from
//! memory: MXFP6 1.05x faster, NVFP4 1.02x, E4M3 at block 32 1.02x; E4M3 at block 2048, whose loop
//! also reads the next block, 0.98x, so encode32 asks for them below 128 elements only).
template <class C, class T, bool Fma = false, bool HalfSigns = true>
QCOLL_AVX2_INLINE i8x32 codes32(const typename C::Enc& e0, const typename C::Enc& e1, const T* p0,
                                const T* p1) {
  constexpr bool Clamp = !C::exact_scale;
  // codes of bfloat16 input from the magnitudes (their signs come from the patterns)
  constexpr bool Positive = C::Enc::magnitudes && paired_load<T>;
  f32x8 x0, x1, x2, x3;
  load16<T, Positive>(p0, x0, x1);
  load16<T, Positive>(p1, x2, x3);
  const f32x8 y0 = e0.scaled(x0), y1 = e0.scaled(x1);
  const f32x8 y2 = e1.scaled(x2), y3 = e1.scaled(x3);
  const i32x8 c0 = e0.template code<Clamp, Positive, Fma>(y0),
              c1 = e0.template code<Clamp, Positive, Fma>(y1);
  const i32x8 c2 = e1.template code<Clamp, Positive, Fma>(y2),
              c3 = e1.template code<Clamp, Positive, Fma>(y3);
  if constexpr (C::sign_from_input) {
    using Enc = typename C::Enc;
    constexpr int max = Clamp ? static_cast<int>(C::Element::max_code) : 127;
    if constexpr (paired_load<T> || (HalfSigns && std::is_same<T, half>::value)) {
      // y's sign is x's (the factors are positive or zero): from the 16-bit patterns, in the packs'
      // order of paired loads, or (half) put in that of element-order vectors
      i16x16 w0, w1;
      std::memcpy(&w0, p0, sizeof w0);
      std::memcpy(&w1, p1, sizeof w1);
      const i32x8 sg = (i32x8)sign_bytes(w0, w1);
      constexpr bool paired = paired_load<T>;
      return signed_bytes32<C::code_bits_of, paired, Enc::bias, max, Enc::shift>(
          c0, c1, c2, c3,
          paired ? (i8x32)sg : (i8x32)__builtin_shufflevector(sg, sg, 0, 4, 2, 6, 1, 5, 3, 7));
    } else {
      return signed_bytes32<C::code_bits_of, false, Enc::bias, max, Enc::shift>(c0, c1, c2, c3,
                                                                                sign_bytes(y0, y1, y2, y3));
    }
  } else {
    return bytes32<C::signed_codes, paired_load<T>>(c0, c1, c2, c3);
  }
}

//! codes32 of F written at out by store_codes32 (stream: see there). Fma: see e2m1_magnitude.
template <class F, bool Fma = false, class T>
QCOLL_AVX2_INLINE void encode32(const typename Codec<F>::Enc& e0, const typename Codec<F>::Enc& e1,
                                const T* p0, const T* p1, unsigned char* out, bool stream = false) {
  using C = Codec<F>;
  constexpr bool paired = paired_load<T>;  // minifloat codes are clean: see encode_group
  store_codes32<F::code_bits, C::sign_from_input, paired>(
      codes32<C, T, Fma, (F::block < 128)>(e0, e1, p0, p1), out, stream);
}

//! Whether encode_group computes F's codes of T input on the 16-bit patterns (Mx16): MX formats
//! with 8-bit minifloat elements, bfloat16 or half input.
template <class E>
constexpr bool mx_16_element = E::bits == 8 || std::is_same<E, minifloat::E2M1>::value;
template <class F, class T>
struct mx_16 : std::false_type {};
template <class E>
struct mx_16<MxFloat<E>, bfloat16> : std::bool_constant<mx_16_element<E>> {};
template <class E>
struct mx_16<MxFloat<E>, half> : std::bool_constant<mx_16_element<E>> {};

//! The codes of MxFloat<E> (8-bit elements) of T = bfloat16 or half input, computed on the 16-bit
//! patterns: sixteen lanes per operation where codes32 widens to eight. The constants live in
//! registers, built once before a loop (an empty asm statement per vector keeps the compiler from
//! re-creating them in every iteration, as it otherwise does).
template <class E, class T>
struct Mx16 {
  using Fa = minifloat::detail::Facts<E>;
  static constexpr bool is_half = std::is_same<T, half>::value;
  static constexpr int mbits = is_half ? 10 : 7;   //!< T's fraction bits
  static constexpr int bias = is_half ? 15 : 127;  //!< T's exponent bias
  static constexpr int drop = mbits - E::mbits;
  //! A normal magnitude 2^e * 1.f as a T pattern less k is ((e + E::bias) << mbits) | f: E's code
  //! with mbits fraction bits, which a rounded shift by `drop` makes the code. k is a multiple of
  //! 2^drop, so the parity bit of the shift is unchanged.
  static constexpr int k = (bias - E::bias) << mbits;
  //! The pattern of E's largest value written with T's fraction bits and exponent bias.
  static constexpr int max_pattern = static_cast<int>(((Fa::max_bits >> 23) - 127 + bias) << mbits) |
                                     static_cast<int>((Fa::max_bits >> (23 - mbits)) & ((1u << mbits) - 1));
  //! E2M1: the codes of magnitudes below 2^emin (0, the subnormal 1 for 2^emin / 2, and 2, the
  //! code of 2^emin, which they round up to from 3/4 of it) come from two comparisons (see code)
  //! instead of being left to codes32.
  static constexpr bool e2m1 = std::is_same<E, minifloat::E2M1>::value;
  i16x16 top, normal, half_step, one, half_less, three_quarters;
  QCOLL_AVX2_INLINE Mx16() {
    top = i16x16{} + static_cast<short>(max_pattern - k);                         // max_normal
    normal = i16x16{} + static_cast<short>((Fa::emin + E::bias) * (1 << mbits));  // 2^emin
    half_step = i16x16{} + static_cast<short>((bias + Fa::emin - E::mbits - 1) * (1 << mbits) - k);
    one = i16x16{} + 1;
    half_less = i16x16{} + static_cast<short>((1 << (drop - 1)) - 1);
    // E2M1: 3/4 of 2^emin, the midpoint of its subnormal step 1/2 and 1
    three_quarters = i16x16{} + static_cast<short>(
                                    e2m1 ? (Fa::emin - 1 + E::bias) * (1 << mbits) + (1 << (mbits - 1)) : 0);
    __asm__("" : "+x"(top), "+x"(normal), "+x"(half_step), "+x"(one), "+x"(half_less), "+x"(three_quarters));
  }
  //! Codes of sixteen magnitudes s (patterns less k), clamped to max_normal first as
  //! minifloat_magnitude does, rounded to nearest even; negative (code 0 once packed) below
  //! 2^emin. `sub` marks the lanes above half the smallest subnormal step and below 2^emin.
  //! E2M1: no lane is marked; below 2^emin the code is 0 up to 2^emin / 4 (half the subnormal
  //! step; the tie rounds to the even 0), 1 above it, and 2 (the code of 2^emin) from 3/4 of 2^emin
  //! on (the tie rounds to the even 2).
  QCOLL_AVX2_INLINE i16x16 code(i16x16 s, i16x16& sub) const {
    s = vmin(s, top);
    const i16x16 c = (s + (((s >> drop) & one) + half_less)) >> drop;
    if constexpr (e2m1) {
      sub = i16x16{};
      const i16x16 low = -((s > half_step) + (s >= three_quarters));  // 0, 1 or 2
      return normal > s ? low : c;
    } else {
      sub = (normal > s) & (s > half_step);
      return c;
    }
  }
  //! The largest n for which every zero or subnormal x reads as at most half E's smallest subnormal
  //! step 2^(emin - mbits - 1), where its code is 0 (the pattern of such an x plus n << mbits, less
  //! k, reads as less than 2^(n - bias + 1)).
  static constexpr int plain_n = bias - 2 + Fa::emin - E::mbits;
  //! bfloat16 and half: the largest n for which such an x reads below 2^emin (lanes that codes32
  //! leaves to the caller unless they are at most half the smallest step); E2M1, whose subnormal
  //! codes code() counts: plain_n.
  static constexpr int max_n = e2m1 ? plain_n : bias - 1 + Fa::emin;
  //! The magnitudes of sixteen patterns x scaled by 2^n (shift = n << mbits, less k) as code()
  //! takes them, and in `odd` the lanes code() cannot serve: |x|'s pattern plus shift, none odd,
  //! but for half input: if n <= max_n (not Careful), zeros become -2^15 (code 0, not below
  //! half_step) unless E2M1 (n <= plain_n: code 0 as they are), and nonzero subnormals stay as
  //! they are: with no implicit bit their pattern plus shift reads as more than x * 2^n but less
  //! than 2^(n - 14) <= 2^emin, so code() marks them, or gives code 0, which is then their code
  //! too; if n > max_n (Careful), zeros the same, and nonzero subnormals are odd. The zeros' minimum
  //! is there for speed: left to the caller, MXFP8 quantize of half input with a tenth of its
  //! values zero ran 0.64x as fast.
  template <bool Careful>
  QCOLL_AVX2_INLINE i16x16 scaled(i16x16 x, short shift, i16x16& odd) const {
    const i16x16 t = x & 0x7fff;
    const i16x16 s = t + shift;
    odd = i16x16{};
    if constexpr (!is_half || (e2m1 && !Careful)) {
      return s;
    } else {
      // nonzero subnormals: t - 1 below 0x3ff as unsigned, so t + 0x7fff (wrapping) below -2^15 +
      // 0x3ff as signed: one addition and one comparison where tests of t against 0x400 and 0
      // took three and the zeros a blend of their own (MXFP8 quantize of half input where n >
      // max_n, E4M3 and E5M2, 1.03-1.04x faster from memory, both orders of the two builds)
      if constexpr (Careful) odd = (short)(-32768 + 0x3ff) > (i16x16)((u16x16)t + (unsigned short)0x7fff);
      return vmin(s, (t == 0) ^ (short)0x7fff);  // zeros: -2^15
    }
  }
  //! The codes of the 32 elements p[0, 32) of a block whose encode factor is 2^n, as codes32
  //! computes them, in element order. x * 2^n is exact in fp32 wherever it is normal, and for a
  //! normal x its pattern less k is |x|'s plus (n << mbits) - k, read with E's exponent bias (in
  //! range: the block's absmax times 2^n is below 2^(emax + 1), so no sum of normal lanes
  //! overflows 16 bits). Magnitudes below 2^emin (exponents that the addition took below zero
  //! included, as negative lanes) give code 0: right up to half the smallest subnormal step (the
  //! tie rounds to the even 0), and for the magnitudes under 2^-126 that codes32 scales to a
  //! subnormal fp32 (also code 0). Returns false (out unspecified) when some magnitude lies above
  //! that half step and below 2^emin: a subnormal code, which the caller computes with codes32
  //! (E2M1: never, code() counts its subnormal codes); bfloat16: also when n > max_n, where a zero
  //! or subnormal bfloat16 x (whose pattern plus n << 7 reads as more than x * 2^n) could read as
  //! a code the caller must compute; half: when n > max_n and a nonzero subnormal x is in the
  //! block (scaled), or the shift does not fit in 16 bits (a block of zeros and subnormals, which
  //! have none of the normal lanes that bound it). The sign bit is x's (the factor is positive),
  //! taken by a saturating pack of the patterns, put in bit E::bits - 1. O(1), about 30 operations
  //! (half: 34, or 38 where n > max_n). MXFP4 quantize against codes32 (AMD EPYC, side by side, in
  //! the caches and from memory): bfloat16 input 1.25x faster, half 1.28x. Half input with n <=
  //! max_n (blocks of values near 1: MXFP8 E4M3's max_n is 8) against the handling of n > max_n in
  //! every block: MXFP8 E4M3 quantize 1.10-1.13x faster from memory and in the caches (N(0, 1)
  //! values, also with a tenth of them zero), 1.02-1.03x on bench_quantize's values (a third of
  //! its blocks have n > max_n); MXFP4 level.
  QCOLL_AVX2_INLINE bool codes32(const T* p, int n, i8x32& out) const {
    if (n <= max_n) return codes32_of<false>(p, n, out);
    if constexpr (is_half) return codes32_of<true>(p, n, out);
    return false;
  }
  //! codes32 for n <= max_n or (half) Careful.
  template <bool Careful>
  QCOLL_AVX2_INLINE bool codes32_of(const T* p, int n, i8x32& out) const {
    const int sh = n * (1 << mbits) - k;  // n << mbits (n may be negative)
    if (sh < -32768 || sh > 32767) return false;
    const short shift = static_cast<short>(sh);
    i16x16 x0, x1, sub0, sub1, odd0, odd1;
    std::memcpy(&x0, p, sizeof x0);
    std::memcpy(&x1, p + 16, sizeof x1);
    const i16x16 c0 = code(scaled<Careful>(x0, shift, odd0), sub0),
                 c1 = code(scaled<Careful>(x1, shift, odd1), sub1);
    const i64x4 sub = (i64x4)(sub0 | sub1 | odd0 | odd1);
    if (!__builtin_ia32_ptestz256(sub, sub)) return false;
    const i8x32 mag = __builtin_ia32_packuswb256(c0, c1);
    const i8x32 sg = sign_bytes(x0, x1);
    const i8x32 sign =
        E::bits == 8 ? (i8x32)(sg & (char)0x80) : (i8x32)((sg < 0) & (char)(1 << (E::bits - 1)));
    const i64x4 w = (i64x4)(mag | sign);  // packs interleave the 128-bit halves of c0 and c1
    out = (i8x32)__builtin_shufflevector(w, w, 0, 2, 1, 3);
    return true;
  }
};

//! The encode pass of encode_full_run: blocks k < count (at x + k * F::block) whose b factors are b[k]
//! (lanes of an EncLanes' b, or an array), encoded as if every a factor were 1 (group_meta_of hands
//! the other blocks back). For
//! formats with exact_scale every block scale is then normal, zero or unusable, so that codes32
//! leaves out the clamp. Groups of one block (2048 elements or more) kept it while the compiler
//! unrolled their loop or not by its own estimate (the shorter loop was then 5-10% slower from
//! memory); with the loop unrolled in the source, leaving it out made quantize at block 2048
//! 1.01-1.13x faster from memory (int8, int4, e4m3; fp32 and bf16 input; 64 Mi elements) and
//! 1.03-1.48x in cache (Intel Xeon). ahead: prefetch_ahead<T>(). side: NoSide, or (blocks of 128
//! elements and more) AbsmaxSide, which gathers the next group's statistics on the way: side.chunk
//! for the elements of block k that match those encoded, side.put once per block. The blocks are
//! addressed from x: an array of their pointers, which each group filled and read back through
//! memory, left int8 and int4 at block 32 8-13% slower in cache and MXFP8 6% slower, and with
//! bfloat16 input from memory int8 and int4 at block 32 7-10% slower (but int8 at block 32 with
//! fp32 input from memory, bound by the memory, 3-6% faster, and e4m3 at block 32 with bfloat16
//! input 3% faster; AMD EPYC, side by side, both orders of the two builds).
template <class F, bool Fma = false, class T, class B, class Side>
QCOLL_AVX2_INLINE void encode_group(const T* x, std::size_t count, const B& b, unsigned char* codes,
                                    bool stream, std::size_t ahead, Side&& side) {
  using C = Codec<F>;
  using Enc = typename C::Enc;
  constexpr std::size_t code_bytes = F::block * F::code_bits / 8;
  constexpr bool clean = C::sign_from_input;  // codes32 gives codes, not wider signed bytes
  if constexpr (mx_16<F, T>::value) {
    // 16-bit patterns (Mx16) where they serve, in a loop of its own; then codes32 for
    // the blocks they do not
    using E = typename C::Element;
    static_assert(F::block == 32, "one block per 32 codes");
    unsigned wide = 0;
    const Mx16<E, T> narrow;
    for (std::size_t k = 0; k < count; ++k) {
      const T* xk = x + k * F::block;
      prefetch_next<F>(xk, ahead);
      // the factor 2^n (n in [-127, 127]; 2^-127 has exponent field 0, which gives -127 too)
      const int n = static_cast<int>(fp::bits(b[k]) >> 23) - 127;
      i8x32 c;
      if (narrow.codes32(xk, n, c)) {
        store_codes32<F::code_bits, clean>(c, codes + k * code_bytes, stream);
      } else {
        wide |= 1u << k;
      }
    }
    for (; wide != 0; wide &= wide - 1) {
      const std::size_t k = static_cast<std::size_t>(__builtin_ctz(wide));
      const Enc e{b[k]};
      const T* xk = x + k * F::block;
      encode32<F, Fma>(e, e, xk, xk + 16, codes + k * code_bytes, stream);
    }
  } else if constexpr (F::block == 16) {  // two blocks per 32 codes (bfloat16: four per 64 first)
    static_assert(F::code_bits == 4, "NVFP4's 4-bit codes");
    std::size_t k = 0;
    if constexpr (paired_load<T>) {
      for (; k + 4 <= count; k += 4) {
        const T* xk = x + k * F::block;
        prefetch_next<F>(xk, ahead);
        prefetch_next<F>(xk + 32, ahead);
        const i8x32 c0 = codes32<C, T, Fma>(Enc{b[k]}, Enc{b[k + 1]}, xk, xk + 16);
        const i8x32 c1 = codes32<C, T, Fma>(Enc{b[k + 2]}, Enc{b[k + 3]}, xk + 32, xk + 48);
        store_codes64(c0, c1, codes + k * code_bytes);
      }
    }
    for (; k < count; k += 2) {
      const Enc e0{b[k]};
      const T* xk = x + k * F::block;
      unsigned char* out = codes + k * code_bytes;
      prefetch_next<F>(xk, ahead);
      if (k + 1 < count) {
        const Enc e1{b[k + 1]};
        encode32<F, Fma>(e0, e1, xk, xk + F::block, out, stream);
      } else {
        alignas(32) unsigned char tmp[32];  // the last block alone: its codes twice, the first kept
        encode32<F, Fma>(e0, e0, xk, xk, tmp);
        std::memcpy(out, tmp, code_bytes);
      }
    }
  } else {
    // 64 elements per iteration where the block has them, unrolled here: the compiler's own
    // unrolling of the 32-element loop depended on its size estimate, and so differed from one
    // instance to the next. From memory (Intel Xeon, 64 Mi elements, side by side): left rolled,
    // int4 at block 2048 (fp32 input) ran 5% slower; 128 elements per iteration left FP8 at block
    // 2048 with bfloat16 input 2-10% slower; 64 measured level with both.
    constexpr std::size_t step = F::block >= 64 ? 64 : 32;
    for (std::size_t k = 0; k < count; ++k) {
      const Enc e{b[k]};
      const T* xk = x + k * F::block;
      unsigned char* ck = codes + k * code_bytes;
      i32x8 m{};
      for (std::size_t j0 = 0; j0 < F::block; j0 += step) {
        QCOLL_UNROLL
        for (std::size_t j = j0; j < j0 + step; j += 32) {
          prefetch_next<F>(xk + j, ahead);
          m = lane_max<sizeof(T) == 2>(m, side.chunk(k, j, 32));
          encode32<F, Fma>(e, e, xk + j, xk + j + 16, ck + j * F::code_bits / 8, stream);
        }
      }
      side.put(k, m);
    }
  }
}

//! float(span / Qmax) per lane, the double quotient rounded to float, for finite spans >= 0, as
//! AsymmetricInt::make_meta computes the scale. The quotient q as p = span * R, R = 1 / Qmax
//! rounded to double: p = (span / Qmax)(1 + d1)(1 + d2) and q = (span / Qmax)(1 + d3), |di| <=
//! 2^-53, so |p - q| < 3.002 units in the last place of p, a normal double (span / Qmax <= p (1 +
//! 2^-51); a nonzero span of floats is at least 2^-149). Rounding to float is monotonic, so float(p)
//! = float(q) unless a float rounding boundary lies between them or on one of them: a midpoint of
//! two floats within 3 units of p, hence in p's binade (those of the next binades are 2^27 units
//! away), where the 29 bits below float's 24 are 1 and 28 zeros; or p is in (0, 2^-125), where
//! floats are subnormal, or near it. Lanes within 8 units of a midpoint, or that small, take the
//! division (the four together): one lane in 2^25 of random spans. Against a division per four
//! blocks: quantize at block 32 1.02-1.03x faster in cache and with bfloat16 input from memory,
//! level with fp32 input from memory (Intel Xeon).
template <int Qmax>
QCOLL_AVX2_INLINE f32x4 span_scale(f64x4 span) {
  f64x4 q = span * (1.0 / double(Qmax));
  const i64x4 b = (i64x4)q;
  constexpr long long tiny = (1023LL - 125) << 52;  // the bits of 2^-125
  const i64x4 risky = (((b + (8 - (1LL << 28))) & 0x1fffffff) < 17) | ((b > 0) & (b < tiny));
  if (__builtin_expect(!__builtin_ia32_ptestz256(risky, risky), 0)) q = span / double(Qmax);
  return __builtin_convertvector(q, f32x4);
}

//! The codes of the 32 elements at x of a block of meta m, written at `codes`: the double
//! arithmetic's (Enc, F::encode's value in every lane), for all the lanes, which costs less than
//! picking the ones where the float estimate is unsure (a loop over them mispredicted as often as
//! the branch that AsymLater removes), and less than the estimate's codes with Enc's in those lanes
//! only (which computed the estimate again; without, bfloat16 quantize 1.01-1.04x faster from
//! memory, half level, both orders). The values are read again: handing those of
//! encode_full_blocks' loop to its rare fp32 call kept them live there, and int8 at blocks 256 and
//! 2048 quantized fp32 input 0.80-0.87x as fast.
template <class F, class T>
QCOLL_AVX2_INLINE void asym_redo(const T* x, const typename F::Meta& m, unsigned char* codes) {
  const typename Codec<F>::Enc e = Codec<F>::enc(m);
  store_codes32<F::code_bits>(bytes32<false>(e(load(x)), e(load(x + 8)), e(load(x + 16)), e(load(x + 24))),
                              codes);
}

//! The groups of 32 elements of bfloat16 input whose codes encode_full_blocks wrote from the float
//! estimate where it is unsure of some lanes (Codec<AsymmetricInt>::Estimate): their input and
//! their codes, gathered without a branch (every group is written to the next free entry, which
//! only an unsure one keeps) and redone by flush() with asym_redo (the caller's flush, once its
//! blocks are all written; encode_full_blocks' own when `flush_at` wait, their input still in L2).
//! With bfloat16 input about 1 in 12 groups of 32 of normal data is unsure (x - lo and the span of
//! a bfloat16 block have short significands, so y often lies on k + 1/2 or within float's rounding
//! of it, where only the double arithmetic tells the code), and a branch per group mispredicted
//! about as often as it was taken. Quantize of bfloat16 input from memory against that branch
//! (AMD EPYC, side by side, both orders of the two builds): int8 at block 32 1.10-1.13x faster,
//! int4 at 32 1.10x, int8 at 256 1.17-1.19x, int8 and int4 at 2048 1.09-1.13x. fp32 input, whose
//! 24-bit significands make unsure groups rare (about 1 in 230 groups of 32 of normal data), keeps
//! the branch, and so does half input (about 1 in 70): against AsymLater, once asym_redo no longer
//! computed the estimate again, int8 at blocks 256 and 2048 1.06-1.09x faster, at 32 1.01-1.02x,
//! int4 at 32 1.02x and at 2048 0.98-0.99x (from memory, both orders). The inputs must stay valid
//! until the flush (every Source's blocks do, for the call).
template <class F, class T>
struct AsymLater {
  struct Group {
    const T* x;
    unsigned char* codes;
  };
  //! The groups a call of encode_full_blocks can add.
  static constexpr std::size_t per_call = group_blocks<F>() * (F::block / 32);
  static constexpr std::size_t flush_at = 64;
  //! The message's codes and metas (block b's at codes + b * code bytes, metas + b * meta_bytes).
  const unsigned char* codes;
  const unsigned char* metas;
  Group group[flush_at + per_call];
  std::size_t n = 0;
  //! Redoes the waiting groups. O(n).
  QCOLL_AVX2 inline void flush() {
    constexpr std::size_t code_bytes = F::block * F::code_bits / 8;
    for (std::size_t i = 0; i < n; ++i) {
      const Group& g = group[i];
      const std::size_t b = static_cast<std::size_t>(g.codes - codes) / code_bytes;
      asym_redo<F>(g.x, F::load_meta(metas + b * F::meta_bytes, 0.0f), g.codes);
    }
    n = 0;
  }
};

//! The AsymLater of quantize_blocks_impl for F and T: for the formats encode_full_blocks serves;
//! else an empty stand-in. flush_later flushes either.
template <class F, class T, bool = Codec<F>::defined>
struct later_for {
  using type = char;
};
template <class F, class T>
struct later_for<F, T, true> {
  using type = std::conditional_t<Codec<F>::range, AsymLater<F, T>, char>;
};
inline void flush_later(char&) {}
template <class F, class T>
inline void flush_later(AsymLater<F, T>& later) {
  if (later.n != 0) later.flush();
}

//! What encode_full_blocks needs of a group of blocks once their statistics are gathered: lane k
//! of block k's offset lo and scale, the inverse of the scale in float, and the blocks left to the
//! caller (bit k: those holding NaN or ±Inf). Float arrays, so that code built without AVX2 holds it.
struct AsymStats {
  alignas(32) float lo[8], scale[8], inv[8];
  unsigned skipped;
};

//! The statistics and metas of 1 <= `count` <= group_blocks<F>() full blocks (block k at x[k]) of
//! a format whose meta reads lo and hi (the asymmetric integers): vector statistics and make_meta
//! one lane per block, written to `st` and, but for skipped blocks, to the meta bytes (meta + k *
//! F::meta_bytes). O(count * F::block).
template <class F, class T>
QCOLL_AVX2 inline void asym_stats(const T* const* x, std::size_t count, unsigned char* meta, AsymStats& st) {
  static_assert(Codec<F>::range, "the other formats go through encode_full_run");
  // Statistics and metas of the whole group first, one lane per block: the patterns' extremes
  // (extreme_lanes, lane_tree), then the values they give, nonfinite blocks (a NaN or infinite
  // extreme), then F::make_meta's double arithmetic four blocks at a time.
  constexpr bool w16 = sizeof(T) == 2;
  i32x8 hi_part[8], um_part[8], nu_part[8];
  extreme_lanes(x[0], F::block, hi_part[tree_slot(0)], um_part[tree_slot(0)], nu_part[tree_slot(0)]);
  QCOLL_UNROLL
  for (std::size_t k = 1; k < 8; ++k) {
    const std::size_t slot = tree_slot(k);
    if (k >= count) {  // unused lanes repeat block 0
      hi_part[slot] = hi_part[tree_slot(0)];
      um_part[slot] = um_part[tree_slot(0)];
      nu_part[slot] = nu_part[tree_slot(0)];
      continue;
    }
    extreme_lanes(x[k], F::block, hi_part[slot], um_part[slot], nu_part[slot]);
  }
  // Patterns of the extremes (16-bit ones sign-extended by lane_tree): a clear sign bit is a value
  // >= +0, and of those the largest pattern is the largest value; of set sign bits the smallest
  // unsigned pattern is the largest value, the largest the smallest. So hi is the largest signed
  // pattern unless that one is negative (no value >= +0: then the smallest unsigned one), lo the
  // largest unsigned pattern where its sign bit is set (some value <= -0), else the smallest. -0
  // comes below +0 as in the order keys of block_stats; a NaN (of either sign) or an infinity
  // among the values is an extreme (a pattern beyond the infinities' on its side).
  const i32x8 smax = lane_tree<w16>(hi_part);
  constexpr int sign = w16 ? 0x8000 : INT32_MIN, rest = w16 ? 0x7fff : INT32_MAX, mask = w16 ? 0xffff : -1;
  const i32x8 umax = (lane_tree<w16>(um_part) ^ sign) & mask, umin = (lane_tree<w16>(nu_part) ^ rest) & mask;
  const i32x8 hb = sel(smax < 0, umin, smax & mask), lb = sel((umax & sign) != 0, umax, umin);
  constexpr int inf = !w16 ? 0x7f800000 : std::is_same<T, half>::value ? 0x7c00 : 0x7f80;
  const i32x8 bad = ((hb & rest) >= inf) | ((lb & rest) >= inf);
  const unsigned live = (1u << count) - 1u;
  const unsigned skipped = static_cast<unsigned>(__builtin_ia32_movmskps256((f32x8)bad)) & live;
  f32x8 lo = (f32x8)(widen_bits<T>(lb) & ~bad), hi = (f32x8)(widen_bits<T>(hb) & ~bad);
  const unsigned zero = static_cast<unsigned>(__builtin_ia32_movmskps256(
                            (f32x8)((((i32x8)lo & 0x7fffffff) == 0) | (((i32x8)hi & 0x7fffffff) == 0)))) &
                        live & ~skipped;
  if (zero != 0) {  // a zero lo or hi takes the sign of the block's first zero (block_stats)
    float l[8], h[8];
    std::memcpy(l, &lo, sizeof l);
    std::memcpy(h, &hi, sizeof h);
    for (std::size_t k = 0; k < count; ++k) {
      if (!(zero & (1u << k))) continue;
      BlockStats st{0.0f, l[k], h[k], false};
      stats_zero_sign(x[k], F::block, st);
      l[k] = st.lo;
      h[k] = st.hi;
    }
    std::memcpy(&lo, l, sizeof l);
    std::memcpy(&hi, h, sizeof h);
  }
  // make_meta: scale = float((double(hi) - double(lo)) / qmax); the double inverse only where Enc runs
  f32x4 scale_part[2];
  QCOLL_UNROLL
  for (int half4 = 0; half4 < 2; ++half4) {
    const f32x4 l4 =
        half4 ? __builtin_shufflevector(lo, lo, 4, 5, 6, 7) : __builtin_shufflevector(lo, lo, 0, 1, 2, 3);
    const f32x4 h4 =
        half4 ? __builtin_shufflevector(hi, hi, 4, 5, 6, 7) : __builtin_shufflevector(hi, hi, 0, 1, 2, 3);
    scale_part[half4] = span_scale<F::qmax>(to_f64(h4) - to_f64(l4));
  }
  const f32x8 scale = __builtin_shufflevector(scale_part[0], scale_part[1], 0, 1, 2, 3, 4, 5, 6, 7);
  // The metas (scale, offset = lo): all eight with two stores when the group is whole (the caller
  // rewrites those of skipped blocks), else block by block.
  if (count == 8) {
    const f32x8 a = __builtin_shufflevector(scale, lo, 0, 8, 1, 9, 4, 12, 5, 13);    // blocks 0 1 | 4 5
    const f32x8 c = __builtin_shufflevector(scale, lo, 2, 10, 3, 11, 6, 14, 7, 15);  // blocks 2 3 | 6 7
    const f32x8 m03 = __builtin_shufflevector(a, c, 0, 1, 2, 3, 8, 9, 10, 11);
    const f32x8 m47 = __builtin_shufflevector(a, c, 4, 5, 6, 7, 12, 13, 14, 15);
    std::memcpy(meta, &m03, sizeof m03);
    std::memcpy(meta + sizeof m03, &m47, sizeof m47);
  } else {
    for (std::size_t k = 0; k < count; ++k)
      if (!(skipped & (1u << k)))
        F::store_meta(typename F::Meta{scale[k], lo[k], 0.0}, meta + k * F::meta_bytes);
  }
  const f32x8 inv_f = 1.0f / scale;  // read only for the blocks that are not slow (encode_full_blocks)
  std::memcpy(st.lo, &lo, sizeof lo);
  std::memcpy(st.scale, &scale, sizeof scale);
  std::memcpy(st.inv, &inv_f, sizeof inv_f);
  st.skipped = skipped;
}

//! Encodes the group of 1 <= `count` <= group_blocks<F>() full blocks (block k at x[k]) that `st`
//! describes (asym_stats) with nearest rounding into their packed codes (codes + k * code bytes),
//! exactly as encode_block does, and returns its skipped blocks (bit k; the caller runs
//! encode_block for them). Pipelined: first, where next_count > 0, it gathers into `st` the
//! statistics of the next group (next[k], metas at next_meta), so that their chain of reductions
//! and divisions overlaps this group's encoding: quantize at block 32 1.06-1.10x faster from memory
//! with fp32 input, 1.08-1.11x with 16-bit input (1.10-1.16x in the caches), blocks of 256 and 2048
//! level (AMD EPYC, side by side, both orders). Its prefetches reach past the next group, whose
//! lines the statistics read first (one group short, fp32 at block 2048 ran 0.82x as fast).
//! bfloat16 input: groups whose codes the float estimate is unsure of wait in `later`, which the
//! caller flushes after its last call (AsymLater). O((count + next_count) * F::block).
template <class F, class T>
QCOLL_AVX2 inline unsigned encode_full_blocks(const T* const* x, std::size_t count, AsymStats& st,
                                              const T* const* next, std::size_t next_count,
                                              unsigned char* next_meta, unsigned char* codes,
                                              AsymLater<F, T>& later) {
  using C = Codec<F>;
  constexpr std::size_t code_bytes = F::block * F::code_bits / 8;
  f32x8 lo, scale, inv_f;
  std::memcpy(&lo, st.lo, sizeof lo);
  std::memcpy(&scale, st.scale, sizeof scale);
  std::memcpy(&inv_f, st.inv, sizeof inv_f);
  const unsigned skipped = st.skipped;
  if (next_count > 0) asym_stats<F>(next, next_count, next_meta, st);
  using Est = typename C::Estimate;
  const unsigned slow = ~static_cast<unsigned>(__builtin_ia32_movmskps256(
      (f32x8)((scale >= f32x8{} + 0x1p-100f) & (scale <= f32x8{} + 0x1p100f))));  // NaN: slow
  const std::size_t ahead = prefetch_ahead<T>() + group_blocks<F>() * F::block * sizeof(T);
  constexpr bool split = std::is_same<T, bfloat16>::value;  // load16_split's order; AsymLater
  // (a local: the stores of codes could alias later.n). fp32 and half input add no group, but the
  // same bookkeeping for them measured faster (without it, int8 at block 32 with fp32 input 0.95x
  // in the caches, side by side)
  std::size_t n_later = later.n;
  for (std::size_t k = 0; k < count; ++k) {
    if (skipped & (1u << k)) continue;
    const T* xk = x[k];
    if (slow & (1u << k)) {  // Enc's double arithmetic throughout
      const typename F::Meta m = F::meta_from(scale[k], lo[k]);
      for (std::size_t j = 0; j < F::block; j += 32)
        asym_redo<F>(xk + j, m, codes + k * code_bytes + j * F::code_bits / 8);
      continue;
    }
    const Est est{lo[k], inv_f[k]};
    QCOLL_UNROLL_BLOCK
    for (std::size_t j = 0; j < F::block; j += 32) {
      prefetch_next<F>(xk + j, ahead);
      const T* p = xk + j;
      unsigned char* out = codes + k * code_bytes + j * F::code_bits / 8;
      // The float estimate's codes; groups where it is unsure are redone (bfloat16: later)
      f32x8 v[4];
      if constexpr (split) {
        load16_split(p, v[0], v[1]);
        load16_split(p + 16, v[2], v[3]);
      } else {
        QCOLL_UNROLL
        for (int i = 0; i < 4; ++i) v[i] = load(p + 8 * i);
      }
      i32x8 t[4], w[4];
      QCOLL_UNROLL
      for (int i = 0; i < 4; ++i) {
        t[i] = est(v[i]);
        w[i] = t[i] >> 15;
      }
      store_codes32<F::code_bits>(word_bytes32<split>(w[0], w[1], w[2], w[3]), out);
      if constexpr (!split) {
        if (Est::unsure(t)) asym_redo<F>(p, F::meta_from(scale[k], lo[k]), out);  // rare: see AsymLater
      } else {
        later.group[n_later] = {p, out};
        n_later += Est::unsure(t);
      }
    }
  }
  later.n = n_later;
  if (n_later >= later.flush_at) later.flush();
  return skipped;
}

//! A callback by reference: fn(ctx, k), made by of(f) for a callable f (which must outlive it) as
//! f(k). encode_full_run takes its callback so, so that one instance serves every caller.
struct BlockRedo {
  void (*fn)(const void*, std::size_t);
  const void* ctx;
  void operator()(std::size_t k) const { fn(ctx, k); }
  template <class Fn>
  static BlockRedo of(const Fn& f) {
    return {[](const void* c, std::size_t k) { (*static_cast<const Fn*>(c))(k); }, &f};
  }
};

//! Statistics and metas of one group of encode_full_run: its blocks' encode factors, and the
//! blocks the kernels leave to the scalar encoder (bit k for block k): those holding NaN or ±Inf,
//! and those whose a factor is not 1 (a block scale below the normal range).
struct GroupMeta {
  EncLanes lanes;
  unsigned skipped;
};

//! The metas of a group of `count` blocks from their largest |x| (lane k: block k's, as float bits;
//! zero in the lanes from count on): writes them and returns the group's encode factors.
template <class F>
QCOLL_AVX2_INLINE GroupMeta group_meta_from(i32x8 amax, std::size_t count, float message_scale,
                                            unsigned char* meta) {
  using C = Codec<F>;
  GroupMeta g;
  g.lanes = C::make_enc((f32x8)amax, message_scale, count, meta);
  unsigned skipped = nonfinite_lanes(amax);
  if constexpr (!C::unit_a)
    skipped |= static_cast<unsigned>(__builtin_ia32_movmskps256((f32x8)(g.lanes.a != 1.0f)));
  g.skipped = skipped & ((1u << count) - 1u);
  return g;
}

//! The metas of a group of `count` blocks from their absmax_lanes (block k's in part[tree_slot(k)],
//! zero vectors in the other slots): writes them and returns the group's encode factors.
template <class F, class T>
QCOLL_AVX2_INLINE GroupMeta group_meta_of(const i32x8* part, std::size_t count, float message_scale,
                                          unsigned char* meta) {
  return group_meta_from<F>(max_tree<T>(part), count, message_scale, meta);
}

//! The absmax_lanes of the group of `count` full blocks at x (consecutive in memory) as max_tree
//! takes them: block k's in part[tree_slot(k)], zero vectors in the other slots.
template <class F, class T>
QCOLL_AVX2_INLINE void group_parts(const T* x, std::size_t count, i32x8* part) {
  constexpr std::size_t G = group_blocks<F>();
  if (count == G) {  // unrolled, in registers
    QCOLL_UNROLL
    for (std::size_t k = 0; k < 8; ++k)
      part[tree_slot(k)] = k < G ? absmax_lanes(x + k * F::block, F::block) : i32x8{};
  } else {
    for (std::size_t k = 0; k < 8; ++k) part[k] = i32x8{};
    for (std::size_t k = 0; k < count; ++k) part[tree_slot(k)] = absmax_lanes(x + k * F::block, F::block);
  }
}

//! Reduces the group of `count` full blocks at x (consecutive in memory) and writes its metas.
template <class F, class T>
QCOLL_AVX2_INLINE GroupMeta group_meta(const T* x, std::size_t count, float message_scale,
                                       unsigned char* meta) {
  i32x8 part[8];
  group_parts<F>(x, count, part);
  return group_meta_of<F, T>(part, count, message_scale, meta);
}

//! What encode_group does besides the codes: nothing (see AbsmaxSide).
struct NoSide {
  QCOLL_AVX2_INLINE i32x8 chunk(std::size_t, std::size_t, std::size_t) const { return i32x8{}; }
  QCOLL_AVX2_INLINE void put(std::size_t, i32x8) const {}
};

//! What encode_group does besides the codes: the statistics of the next group of F's blocks (its
//! `count` blocks at next; none at the end of a run), gathered while the codes are computed.
//! chunk(k, j, n): absmax_lanes of the next group's block k, elements j to j + n (n a multiple of
//! 16), or for k >= count of the encoded group's first block at `here` (in L1; put drops it), so
//! that one loop serves every group. put(k, m): m (the lane-wise max of block k's chunks) into
//! part[tree_slot(k)] for k < count; the other slots stay zero, as group_meta_of takes them.
template <class F, class T>
struct AbsmaxSide {
  const T* next;
  std::size_t count;
  const T* here;
  i32x8 part[8];
  QCOLL_AVX2_INLINE i32x8 chunk(std::size_t k, std::size_t j, std::size_t n) const {
    return absmax_lanes((k < count ? next + k * F::block : here) + j, n);
  }
  QCOLL_AVX2_INLINE void put(std::size_t k, i32x8 m) {
    if (k < count) part[tree_slot(k)] = m;
  }
};

//! Runs of encode_full_run from which it reads its input as two streams, in bytes of input: below
//! it, one. See encode_full_run.
inline constexpr std::size_t two_stream_run_bytes = std::size_t(1) << 20;

//! How encode_full_run reads a run of `nblocks` full blocks of F from T input: as `streams` streams
//! (1 or 2), stream s holding the `per` blocks from s * per, the last one also the nblocks -
//! streams * per left over. O(1).
struct RunStreams {
  std::size_t streams, per;
  //! Blocks of stream s.
  std::size_t blocks(std::size_t s, std::size_t nblocks) const {
    return s + 1 == streams ? nblocks - s * per : per;
  }
};
template <class F, class T>
QCOLL_AVX2_INLINE RunStreams run_streams(std::size_t nblocks) {
  const bool two = F::block < 128 && sizeof(T) == 4 && nblocks * F::block * sizeof(T) >= two_stream_run_bytes;
  return two ? RunStreams{2, nblocks / 2} : RunStreams{1, nblocks};
}

//! Where the block maxima that absmax_entries leaves for encode_full_run (NVFP4) of a stream of m
//! blocks whose codes start at `codes` lie: the last m * sizeof(T) bytes of those codes, block j's
//! at j * sizeof(T) from there (the float bits of fp32 input, the 16-bit pattern of half or
//! bfloat16 input, whose maximum is one of its elements). The codes
//! of block j overlap only the maxima of blocks i <= j (for entry bytes e below the code bytes c of
//! a block, the codes end at (j + 1) c, and i e + m (c - e) < (j + 1) c gives i < j + 1 as j < m), so
//! that encode_kept, which reads a chunk's maxima before it writes the chunk's codes, reads every
//! maximum before any code overwrites it.
template <class F, class T>
QCOLL_AVX2_INLINE unsigned char* entries_of(unsigned char* codes, std::size_t m) {
  constexpr std::size_t code_bytes = F::block * F::code_bits / 8;
  static_assert(sizeof(T) < code_bytes, "a block maximum fits in the block's code bytes");
  return codes + m * (code_bytes - sizeof(T));
}

//! A vector V whose first `bytes` bytes are p[0, bytes), the rest zero; whole vectors with one load
//! (a copy of a variable count of bytes goes through memory, and the load after it waits).
template <class V>
QCOLL_AVX2_INLINE V load_prefix(const unsigned char* p, std::size_t bytes) {
  V v;
  if (bytes == sizeof v) {
    std::memcpy(&v, p, sizeof v);
  } else {
    unsigned char w[sizeof v] = {};
    std::memcpy(w, p, bytes);
    std::memcpy(&v, w, sizeof v);
  }
  return v;
}

//! The first `bytes` bytes of v to p[0, bytes); whole vectors with one store.
template <class V>
QCOLL_AVX2_INLINE void store_prefix(unsigned char* p, const V& v, std::size_t bytes) {
  if (bytes == sizeof v) {
    std::memcpy(p, &v, sizeof v);
  } else {
    unsigned char w[sizeof v];
    std::memcpy(w, &v, sizeof v);
    std::memcpy(p, w, bytes);
  }
}

//! The maxima of `count` blocks (at most 8) that absmax_entries left at e, as group_meta_from takes
//! them: float bits, zero in the lanes from count on.
template <class T>
QCOLL_AVX2_INLINE i32x8 load_entries(const unsigned char* e, std::size_t count) {
  if constexpr (sizeof(T) == 4) {
    return load_prefix<i32x8>(e, count * 4);
  } else {
    const i16x8 h = load_prefix<i16x8>(e, count * 2);
    if constexpr (std::is_same<T, half>::value) return (i32x8)__builtin_ia32_vcvtph2ps256(h);
#if defined(__clang__)
    return __builtin_convertvector((u16x8)h, i32x8) << 16;
#else
    return __builtin_ia32_pmovzxwd256(h) << 16;
#endif
  }
}

//! encode_full_run's blocks [0, count) at x for F with a message scale (NVFP4), whose metas come
//! from the block maxima at e (absmax_entries) rather than the input: in chunks of up to
//! kept_chunk_blocks, the metas of a whole chunk first (its b factors to an array), then its codes
//! in one loop, then redo(first + k) for its skipped blocks k. Where every a factor is 1 (unit_a_at:
//! every message scale from 2^-117 on), the metas loop leaves out the lane checks, and gathers the
//! chunk's non-finite maxima in one vector, which names the blocks to skip only if it holds one.
//! Both loops keep their constants in registers, where groups of 8 blocks (metas, then codes) set
//! them up again for each group. NVFP4 quantize against groups of 8 (AMD EPYC, side by side, both
//! orders of the two builds): in the caches, bfloat16 input 1.04x, fp32 1.06x faster; from memory
//! 1.03x and 1.05-1.075x. The chunk's maxima are all read before its codes overwrite any (see
//! entries_of).
inline constexpr std::size_t kept_chunk_blocks = 512;
template <class F, bool Fma, class T>
QCOLL_AVX2_INLINE void encode_kept(const T* x, std::size_t count, const unsigned char* e, float message_scale,
                                   unsigned char* codes, unsigned char* meta, bool stream, std::size_t ahead,
                                   std::size_t first, BlockRedo redo) {
  using C = Codec<F>;
  constexpr std::size_t G = group_blocks<F>(), chunk = kept_chunk_blocks;
  constexpr std::size_t code_bytes = F::block * F::code_bits / 8;
  static_assert(chunk % G == 0 && G == 8, "whole groups of eight blocks per chunk");
  alignas(32) float b[chunk];
  unsigned skipped[chunk / G];
  const bool unit = C::unit_a_at(message_scale);
  for (std::size_t c = 0; c < count; c += chunk) {
    const std::size_t n = count - c < chunk ? count - c : chunk;
    // (no lambdas for the vectors: they would not take the function's target)
    const auto group = [&](std::size_t g) { return n - g < G ? n - g : G; };
    unsigned any = 0;
    if (unit) {
      i32x8 bad{};
      for (std::size_t g = 0; g < n; g += G) {
        const i32x8 amax = load_entries<T>(e + (c + g) * sizeof(T), group(g));
        const EncLanes lanes =
            C::template make_enc<true>((f32x8)amax, message_scale, group(g), meta + (c + g) * F::meta_bytes);
        std::memcpy(b + g, &lanes.b, sizeof lanes.b);  // those from group(g) on unused
        bad |= amax > 0x7f7fffff;                      // NaN or ±Inf (non-negative patterns)
      }
      if (__builtin_expect(!__builtin_ia32_ptestz256((i64x4)bad, (i64x4)bad), 0))
        for (std::size_t g = 0; g < n; g += G) {
          // (the lanes from group(g) on are zero)
          skipped[g / G] = nonfinite_lanes(load_entries<T>(e + (c + g) * sizeof(T), group(g)));
          any |= skipped[g / G];
        }
    } else {
      for (std::size_t g = 0; g < n; g += G) {
        const GroupMeta gm = group_meta_from<F>(load_entries<T>(e + (c + g) * sizeof(T), group(g)), group(g),
                                                message_scale, meta + (c + g) * F::meta_bytes);
        std::memcpy(b + g, &gm.lanes.b, sizeof gm.lanes.b);
        skipped[g / G] = gm.skipped;
        any |= gm.skipped;
      }
    }
    encode_group<F, Fma>(x + c * F::block, n, b, codes + c * code_bytes, stream, ahead, NoSide{});
    if (__builtin_expect(any != 0, 0))
      for (std::size_t g = 0; g < n; g += G)
        for (unsigned k = skipped[g / G]; k != 0; k &= k - 1)
          redo(first + c + g + static_cast<std::size_t>(__builtin_ctz(k)));
  }
}

//! Encodes `nblocks` full blocks that follow each other in memory from x with nearest rounding,
//! exactly as encode_block does, in groups of group_blocks<F>(): a group's statistics and metas,
//! then its codes while the group is in L1 (encode_group prefetches the groups ahead). The next
//! group's statistics and metas are computed before this group's codes, so that their chain of
//! dependent steps (reductions, divisions, NVFP4's E4M3 rounding) overlaps the encoding: 3-12%
//! faster from memory and 5-20% in cache on an Intel Xeon (NVFP4, FP8, MX, int8 at block 32); an
//! earlier version of these kernels measured it 3-8% slower on an AMD Zen 3. From block 128 on,
//! the next group's statistics are gathered inside this group's encoding loop (AbsmaxSide), 32
//! elements per 32 codes, so that its reads from memory are spread over the arithmetic instead of
//! running as a pass of their own: quantize from memory 12-46% faster (int8, int4, FP8 at blocks
//! 128 to 2048, fp32 input; 2-13% with 16-bit input), no slower in cache. At blocks 32 and 64 it
//! was 10-28% slower in cache and no faster from memory, so they keep the pass; there, fp32 runs of
//! two_stream_run_bytes and more are read as two streams instead (one core draws more from memory
//! over two, most of all where the hardware prefetchers stop at each 4 KiB page): the run's halves
//! in turns of 1024 elements, each turn encoded as above. Encode pass from memory (Intel Xeon, 64
//! Mi N(0, 1) values in 4 KiB pages, side by side): 1.20-1.28x (NVFP4, MXFP4, int8, int4 and e4m3
//! at block 32); turns of 256 elements 1.12-1.26x, of 2048 1.10-1.16x, three streams 1.10-1.20x;
//! quantize in 2 MiB pages (as bench_quantize allocates) 1.07-1.19x; no faster with 16-bit input
//! (those loops are bound by arithmetic), nor from block 128 on, whose single pass already
//! overlaps its reads; 0.98-1.11x for runs of 1 to 4 MiB in the caches. Calls redo(k) after the
//! group of block k for each block k that GroupMeta::skipped names (NaN or ±Inf, or a scale below
//! the normal range; its codes and meta bytes unspecified until then). F without range statistics
//! only. stream: codes written with non-temporal stores where they are 8 bits (codes 16-byte
//! aligned; the caller fences). F with a message scale (NVFP4): the caller has run absmax_entries
//! over the same run, whose block maxima in the codes the metas read instead of the input, in
//! chunks of blocks instead of groups (encode_kept; redo(k) after block k's chunk), and with FMA
//! where encode_fma() holds (the instance with Fma = true; see e2m1_magnitude).
//! One instance per (F, T), whatever the caller's redo.
template <class F, class T, bool Fma = false>
QCOLL_AVX2 inline void encode_full_run(const T* x, std::size_t nblocks, float message_scale,
                                       unsigned char* codes, unsigned char* meta, bool stream,
                                       BlockRedo redo) {
  static_assert(!Codec<F>::range, "range formats go through encode_full_blocks");
  if constexpr (has_message_scale<F> && !Fma) {
    if (encode_fma())
      return encode_full_run<F, T, true>(x, nblocks, message_scale, codes, meta, stream, redo);
  }
  constexpr std::size_t G = group_blocks<F>();
  constexpr std::size_t code_bytes = F::block * F::code_bits / 8;
  const std::size_t ahead = prefetch_ahead<T>();
  const RunStreams rs = run_streams<F, T>(nblocks);
  const std::size_t streams = rs.streams, per = rs.per;  // per: blocks of each stream
  const std::size_t turn = streams == 2 ? 1024 / F::block : per;
  for (std::size_t r = 0; r < per; r += turn)
    for (std::size_t s = 0; s < streams; ++s) {
      // blocks [first, first + count) of the run, as one pipeline of groups; the last turn of the
      // last stream takes the block left over by an odd count
      const std::size_t first = s * per + r;
      std::size_t count = per - r < turn ? per - r : turn;
      if (s + 1 == streams && r + count == per) count += nblocks - streams * per;
      const T* const xp = x + first * F::block;
      const auto group_count = [&](std::size_t b) { return count - b < G ? count - b : G; };
      if constexpr (has_message_scale<F>) {
        // the block maxima of blocks [first, first + count), where absmax_entries left them
        const unsigned char* ep =
            entries_of<F, T>(codes + s * per * code_bytes, rs.blocks(s, nblocks)) + r * sizeof(T);
        encode_kept<F, Fma>(xp, count, ep, message_scale, codes + first * code_bytes,
                            meta + first * F::meta_bytes, stream, ahead, first, redo);
      } else {
        GroupMeta next = group_meta<F>(xp, group_count(0), message_scale, meta + first * F::meta_bytes);
        for (std::size_t b = 0; b < count; b += G) {
          const GroupMeta cur = next;
          const T* xg = xp + b * F::block;
          unsigned char* cg = codes + (first + b) * code_bytes;
          unsigned char* mg = meta + (first + b + G) * F::meta_bytes;  // the next group's
          const std::size_t next_count = b + G < count ? group_count(b + G) : 0;
          if constexpr (F::block >= 128) {
            // the next group's statistics inside this group's encoding
            AbsmaxSide<F, T> side{next_count > 0 ? xg + G * F::block : xg, next_count, xg, {}};
            encode_group<F>(xg, group_count(b), cur.lanes.b, cg, stream, ahead, side);
            if (next_count > 0) next = group_meta_of<F, T>(side.part, next_count, message_scale, mg);
          } else {
            // the next group's metas first, overlapping their latency with this group's codes
            if (next_count > 0) next = group_meta<F>(xg + G * F::block, next_count, message_scale, mg);
            NoSide none;
            encode_group<F>(xg, group_count(b), cur.lanes.b, cg, stream, ahead, none);
          }
          if (__builtin_expect(cur.skipped != 0, 0))
            for (unsigned k = cur.skipped; k != 0; k &= k - 1)
              redo(first + b + static_cast<std::size_t>(__builtin_ctz(k)));
        }
      }
    }
}

//! How far ahead the single-pass streaming loops (absmax_finite, convert_codes, decode_identity)
//! prefetch their input, in bytes: the hardware prefetchers alone fall behind. In absmax_finite,
//! one line requested 2 KiB ahead per 64 bytes read made NVFP4's message maximum (and so its
//! quantize, which reads the input twice) 1.03-1.08x faster with fp32 input and 1.03-1.13x with
//! bfloat16 from memory (Intel Xeon, 64 Mi elements); 1 KiB gave 1.03-1.05x, 4 KiB 1.04-1.07x in
//! some runs and 0.90-0.93x in others.
inline constexpr std::size_t stream_prefetch_ahead = 2048;

//! The value of a non-negative bit pattern r of T (float bits, or a 16-bit pattern), as float.
template <class T>
QCOLL_AVX2_INLINE float pattern_value(int r) {
  if constexpr (sizeof(T) == 4) {
    return fp::from_bits(static_cast<std::uint32_t>(r));
  } else {
    return to_float(T{static_cast<std::uint16_t>(r)});
  }
}

//! Largest |x| over the finite elements of x[0, n) (0 if none), n a multiple of 16. O(n), one read
//! of x, as four streams a quarter of x apart: one core reads more from memory over several
//! streams than over one. Measured on an Intel Xeon (64 Mi fp32 values, a loop of loads and
//! maxima with the prefetch below), in 4 KiB pages: one stream 0.31-0.39 ns per element, two
//! 0.26-0.29, four 0.24-0.25, eight no faster than four (memcpy 0.37-0.40 ns per element read and
//! written); in 2 MiB pages: one stream 0.25-0.26, four 0.24.
template <class T>
QCOLL_AVX2 inline float absmax_finite(const T* x, std::size_t n) {
  constexpr bool w16 = sizeof(T) == 2;
  constexpr std::size_t step = 64 / sizeof(T);  // one line per stream and step
  const std::size_t quarter = n / (4 * step) * step;
  i32x8 part[4] = {};
  for (std::size_t i = 0; i < quarter; i += step) {
    QCOLL_UNROLL
    for (std::size_t s = 0; s < 4; ++s) {
      const T* p = x + s * quarter + i;
      __builtin_prefetch(reinterpret_cast<const char*>(p) + stream_prefetch_ahead);
      part[s] = lane_max<w16>(part[s], absmax_lanes(p, step));
    }
  }
  // the last n - 4 * quarter < 4 * step elements
  if (4 * quarter < n) part[0] = lane_max<w16>(part[0], absmax_lanes(x + 4 * quarter, n - 4 * quarter));
  i32x8 m = lane_max<w16>(lane_max<w16>(part[0], part[1]), lane_max<w16>(part[2], part[3]));
  const int inf = sizeof(T) == 4 ? 0x7f800000 : std::is_same<T, half>::value ? 0x7c00 : 0x7f80;
  if constexpr (sizeof(T) == 4) {
    const int r = reduce<true>(m);
    if (r < inf) return pattern_value<T>(r);
    m = i32x8{};
    for (std::size_t i = 0; i < n; i += 8) {
      const i32x8 a = (i32x8)load(x + i) & 0x7fffffff;
      m = vmax(m, a & (a < inf));
    }
    return pattern_value<T>(reduce<true>(m));
  } else {
    int r = reduce_i16<true>((i16x16)m);  // lanes in [0, 0x7fff]
    if (r >= inf) {
      i16x16 w{};
      for (std::size_t i = 0; i < n; i += 16) {
        i16x16 v;
        std::memcpy(&v, x + i, sizeof v);
        v &= 0x7fff;
        v &= (v < (short)inf);
        w = v > w ? v : w;
      }
      r = reduce_i16<true>(w);
    }
    return pattern_value<T>(r);
  }
}

//! The largest |x| patterns of the n <= 8 blocks of 16 at p (lane k: block k's, NaN and ±Inf
//! included; zero from lane n on), also stored at e, sizeof(T) bytes each. A whole group
//! prefetches as absmax_finite does.
template <class F, class T>
QCOLL_AVX2_INLINE i32x8 group_entries(const T* p, std::size_t n, unsigned char* e) {
  constexpr bool w16 = sizeof(T) == 2;
  // each line into L1 only: with L2 requests further on as well (as prefetch_next), this pass took
  // 1.1-1.2x as long from memory, and NVFP4 quantize 1.01-1.04x (bf16), 1.03-1.05x (half) and
  // 1.05-1.06x (fp32; AMD EPYC, side by side, both orders)
  if (n == 8)
    for (std::size_t line = 0; line < 8 * F::block * sizeof(T); line += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(p) + stream_prefetch_ahead + line);
  i32x8 part[8];
  group_parts<F>(p, n, part);
  const i32x8 z = lane_tree<w16>(part);  // lane k: block k's largest |x| pattern
  if constexpr (w16) {
    store_prefix(e,
                 __builtin_ia32_packssdw128(__builtin_shufflevector(z, z, 0, 1, 2, 3),
                                            __builtin_shufflevector(z, z, 4, 5, 6, 7)),
                 n * 2);
  } else {
    store_prefix(e, z, n * 4);
  }
  return z;
}

//! absmax_finite of a run of `nblocks` full blocks of F at x that also leaves each block's largest
//! |x| (NaN and ±Inf included) in the run's code bytes at `codes`, where encode_full_run
//! (encode_kept) reads them instead of reducing the blocks again (entries_of, per stream of run_streams),
//! so that its encode pass is left with the arithmetic of the codes. F with a message scale (NVFP4:
//! blocks of 16, groups of 8). One read of x, as four streams a quarter of each stream of
//! run_streams apart, O(n); the maxima take a sixteenth of the input's bytes (fp32: float bits;
//! half, bfloat16: 16-bit patterns). Where a block holds NaN or ±Inf, absmax_finite then reads x
//! again for the maximum of the finite values (those of such blocks count). Quantize (both passes)
//! from memory, against absmax_finite and a reduction in the encode pass (AMD EPYC, 64 Mi N(0, 1)
//! values, side by side): fp32 input 1.05-1.09x, bfloat16 1.10-1.15x; in the caches 1.11-1.12x.
//! This pass itself takes 1.13-1.2x absmax_finite's time (one stream: 1.25x).
template <class F, class T>
QCOLL_AVX2 inline float absmax_entries(const T* x, std::size_t nblocks, unsigned char* codes) {
  static_assert(F::block == 16 && group_blocks<F>() == 8, "groups of eight blocks of 16");
  constexpr std::size_t code_bytes = F::block * F::code_bits / 8, eb = sizeof(T);
  constexpr int inf = sizeof(T) == 4 ? 0x7f800000 : std::is_same<T, half>::value ? 0x7c00 : 0x7f80;
  const RunStreams rs = run_streams<F, T>(nblocks);
  i32x8 m{};
  for (std::size_t s = 0; s < rs.streams; ++s) {
    const std::size_t count = rs.blocks(s, nblocks);
    const T* const xs = x + s * rs.per * F::block;
    unsigned char* const e = entries_of<F, T>(codes + s * rs.per * code_bytes, count);
    // four streams a quarter apart (as absmax_finite), then the groups left
    const std::size_t quarter = count / 32 * 8;
    for (std::size_t g = 0; g < quarter; g += 8) {
      QCOLL_UNROLL
      for (std::size_t t = 0; t < 4; ++t) {
        const std::size_t b = t * quarter + g;
        m = vmax(m, group_entries<F>(xs + b * F::block, 8, e + b * eb));
      }
    }
    for (std::size_t b = 4 * quarter; b < count; b += 8) {
      m = vmax(m, group_entries<F>(xs + b * F::block, count - b < 8 ? count - b : 8, e + b * eb));
    }
  }
  const int r = reduce<true>(m);
  // a block holding NaN or ±Inf: the finite values' maximum by absmax_finite (another read)
  return r >= inf ? absmax_finite(x, nblocks * F::block) : pattern_value<T>(r);
}

//! Whether Codec<F> decodes codes by table look-up (minifloat codes).
template <class C, class = void>
struct looks_up : std::false_type {};
template <class C>
struct looks_up<C, std::void_t<typename C::Element>> : std::true_type {};

//! MX formats with 8- or 6-bit minifloat elements: decode_codes converts their codes as fp16
//! (fp8_as_half, fp6_as_half; exact) rather than looking them up, which takes a gather per eight
//! codes.
template <class F>
struct mx_via_half : std::false_type {};
template <class E>
struct mx_via_half<MxFloat<E>> : std::bool_constant<E::bits == 8 || E::bits == 6> {};

//! The look-up table of F's decoder (an empty one for formats that compute their values or convert
//! them as fp16).
template <class F, bool = looks_up<Codec<F>>::value && !mx_via_half<F>::value>
struct DecodeTable {
  QCOLL_AVX2_INLINE void fill() {}
};
template <class F>
struct DecodeTable<F, true> : MinifloatTable<typename Codec<F>::Element> {};

//! Whether Codec<F> decodes 8-bit minifloat codes through the fp16 conversion (fp8_as_half).
template <class C, class = void>
struct via_half : std::false_type {};
template <class C>
struct via_half<C, std::void_t<decltype(C::via_half)>> : std::bool_constant<C::via_half> {};

//! Sixteen FP8 codes of E (E4M3 or E5M2) at p, decoded by the fp16 conversion: E5M2 codes are
//! the top byte of the fp16 of the same value; an E4M3 magnitude shifted into an fp16 (exponent
//! bias 15 instead of 7) is its value times 2^-8, subnormals included (the caller multiplies by
//! 2^8 where it scales). vcvtph2ps is exact and ignores MXCSR.DAZ. NaN codes give a NaN: E4M3's
//! always the fp16 0x7fff (the float 0x7fffe000), E5M2's that one where CanonicalNaN, else one of
//! either sign (which half_value makes minifloat_decode's 0x7fffffff). FiniteCodes: the caller has
//! checked that no code is NaN (fp8_finite_codes), and E4M3 leaves out the NaN fix-up.
template <class E, bool CanonicalNaN = false, bool FiniteCodes = false>
QCOLL_AVX2_INLINE void fp8_as_half(const unsigned char* p, f32x8& lo, f32x8& hi) {
  static_assert(E::bits == 8, "FP8 codes");
  i8x16 b;
  std::memcpy(&b, p, sizeof b);
  // sign-extended: bits 7-15 copy the sign (shifted out or cleared below)
#if defined(__clang__)
  typedef signed char s8x16 __attribute__((vector_size(16)));
  const i16x16 w = __builtin_convertvector((s8x16)b, i16x16);
#else
  const i16x16 w = (i16x16)__builtin_ia32_pmovsxbw256(b);
#endif
  i16x16 h;
  if constexpr (E::ebits == 5) {
    static_assert(E::has_nan && E::has_inf && E::max_code == 0x7b, "E5M2: NaN = S.11111.{01,10,11}");
    h = w << 8;
    if constexpr (CanonicalNaN) {
      const i16x16 nan = (h & 0x7fff) > 0x7c00;
      h = (h & ~nan) | (nan & 0x7fff);
    }
  } else {
    static_assert(E::ebits == 4 && E::has_nan && !E::has_inf && E::max_code == 0x7e,
                  "E4M3: NaN = S.1111.111");
    // the magnitude in bits 13-7, the sign in bits 15 and 14; bit 14 (the fp16 exponent's top
    // bit) cleared
    h = (w << 7) & (short)0xbf80;
    if constexpr (!FiniteCodes) {
      const i16x16 nan = (w & 0x7f) == 0x7f;
      h = (h & ~nan) | (nan & 0x7fff);
    }
  }
  lo = __builtin_ia32_vcvtph2ps256(__builtin_shufflevector(h, h, 0, 1, 2, 3, 4, 5, 6, 7));
  hi = __builtin_ia32_vcvtph2ps256(__builtin_shufflevector(h, h, 8, 9, 10, 11, 12, 13, 14, 15));
}

//! The sixteen 6-bit minifloat codes of elements [j, j + 16) of a packed block of CodeBytes bytes
//! (j a multiple of 16; code i in bits [6i, 6i + 6) of the little-endian block) as fp16 patterns:
//! the sign in bit 15, the magnitude bits in bits 10 - E::mbits to 14 - E::mbits, so that the
//! pattern's value is the code's times 2^(E::bias - 15), subnormals included. One 16-byte load,
//! inside the block (ending at its end for the block's last 16 codes), copied to both halves; a
//! byte shuffle puts the two bytes holding code i in 16-bit word i, and a multiplication by
//! 2^(10 - r) (r: the code's bit offset in its first byte) moves the code to bits 10-15, the sign
//! at bit 15; an arithmetic shift by mbits then places the magnitude, and the mask clears the
//! sign's copies and the bits below the code.
template <class E, std::size_t CodeBytes>
QCOLL_AVX2_INLINE i16x16 fp6_words(const unsigned char* codes, std::size_t j) {
  static_assert(E::bits == 6 && !E::has_nan && !E::has_inf, "finite 6-bit codes");
  static_assert(CodeBytes % 24 == 0, "blocks of a multiple of 32 codes");
  const std::size_t first = j / 4 * 3;       // the byte holding code j's first bit
  const bool last = first + 16 > CodeBytes;  // then load the block's last 16 bytes
  i64x2 b;
  std::memcpy(&b, codes + (last ? CodeBytes - 16 : first), sizeof b);
  const i8x32 both = (i8x32)__builtin_shufflevector(b, b, 0, 1, 0, 1);
  // code 8L + w (w < 8) starts at bit 48L + 6w: byte 6L + 6w / 8, offset 6w % 8
  const i8x32 idx0 = {0, 1, 0, 1, 1, 2, 2, 3, 3, 4,  3, 4,  4,  5,  5,  6,
                      6, 7, 6, 7, 7, 8, 8, 9, 9, 10, 9, 10, 10, 11, 11, 12};
  const i8x32 idx = last ? idx0 + 4 : idx0;
  const i16x16 w = (i16x16)__builtin_ia32_pshufb256(both, idx);
  const i16x16 top = (i16x16)((u16x16)w * u16x16{1024, 16, 64, 256, 1024, 16, 64, 256, 1024, 16, 64, 256,
                                                 1024, 16, 64, 256});
  return (top >> E::mbits) & static_cast<short>(0x8000 | (0x1f << (10 - E::mbits)));
}

//! fp6_words converted to floats (exact): the codes' values times 2^(E::bias - 15).
template <class E, std::size_t CodeBytes>
QCOLL_AVX2_INLINE void fp6_as_half(const unsigned char* codes, std::size_t j, f32x8& lo, f32x8& hi) {
  const i16x16 h = fp6_words<E, CodeBytes>(codes, j);
  lo = __builtin_ia32_vcvtph2ps256(__builtin_shufflevector(h, h, 0, 1, 2, 3, 4, 5, 6, 7));
  hi = __builtin_ia32_vcvtph2ps256(__builtin_shufflevector(h, h, 8, 9, 10, 11, 12, 13, 14, 15));
}

//! v with every NaN lane the positive 0x7fffffff (minifloat_decode's NaN).
QCOLL_AVX2_INLINE f32x8 canonical_nan(f32x8 v) {
  return sel(((i32x8)v & 0x7fffffff) > 0x7f800000, (f32x8)splat(0x7fffffff), v);
}

//! minifloat_decode<E> of codes from their fp16 conversion v (fp8_as_half, fp6_as_half): v times
//! 2^(15 - E::bias) for E4M3 and the 6-bit elements (exact), every NaN as the positive 0x7fffffff.
template <class E>
QCOLL_AVX2_INLINE f32x8 half_value(f32x8 v) {
  constexpr int shift = E::bits == 8 && E::ebits == 5 ? 0 : 15 - E::bias;
  if constexpr (shift != 0) v = v * static_cast<float>(1 << shift);
  if constexpr (E::has_nan) v = canonical_nan(v);
  return v;
}

//! The bytes of lo and hi interleaved into 16-bit words (lo's the low bytes) within each 128-bit
//! lane: w0 of bytes 0-7 of both lanes, w1 of bytes 8-15 (vpunpcklbw, vpunpckhbw).
QCOLL_AVX2_INLINE void interleave_bytes(i8x32 lo, i8x32 hi, i16x16& w0, i16x16& w1) {
  w0 = (i16x16)__builtin_shufflevector(lo, hi, 0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 16, 48,
                                       17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55);
  w1 = (i16x16)__builtin_shufflevector(lo, hi, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47,
                                       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63);
}

//! The sixteen 16-bit outputs of a block's 4-bit codes 0 to 15 as pshufb tables: lo holds their
//! low bytes, hi their high bytes (byte c: code c's), in both 128-bit lanes. words: the outputs
//! in code order.
struct NibbleTable {
  i8x32 lo, hi;
};
QCOLL_AVX2_INLINE NibbleTable nibble_table(i64x4 words) {
  // lane 0: low bytes of outputs 0-7, then their high bytes; lane 1: the same of outputs 8-15
  const i8x32 split = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                       0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};
  const i64x4 s = (i64x4)__builtin_ia32_pshufb256((i8x32)words, split);
  return {(i8x32)__builtin_shufflevector(s, s, 0, 2, 0, 2), (i8x32)__builtin_shufflevector(s, s, 1, 3, 1, 3)};
}

//! The 32 packed 4-bit codes at p (16 bytes; code 2i in byte i's low nibble, 2i + 1 in its high
//! one) as their outputs in t, to out[0, 32) by sink (put16). Twelve operations: the code bytes
//! are arranged so that the byte interleaves, which work within 128-bit lanes, give the outputs
//! in element order with no shuffle across the lanes.
template <Sink S, class V>
QCOLL_AVX2_INLINE void emit_nibbles32(const NibbleTable& t, const unsigned char* p, V* out) {
  i32x4 b;
  std::memcpy(&b, p, sizeof b);
  // lane 0: bytes 0-3 and 8-11 (codes 0-7 and 16-23); lane 1: bytes 4-7 and 12-15 (8-15, 24-31)
  const i8x32 q = (i8x32)__builtin_shufflevector(b, b, 0, 2, 0, 2, 1, 3, 1, 3);
  const i8x32 lo = q & (char)0x0f, hi = (i8x32)((u16x16)q >> 4) & (char)0x0f;
  // the codes one to a byte: lane 0 codes 0-7 and 16-23, lane 1 codes 8-15 and 24-31 (the
  // second half repeats them)
  i16x16 idx, again;
  interleave_bytes(lo, hi, idx, again);
  i16x16 w0, w1;
  interleave_bytes(__builtin_ia32_pshufb256(t.lo, (i8x32)idx), __builtin_ia32_pshufb256(t.hi, (i8x32)idx), w0,
                   w1);
  put16<S>(out, (i64x4)w0);
  put16<S>(out + 16, (i64x4)w1);
}

//! Whether F's blocks decode to V by sink S through a NibbleTable: 16-bit outputs, stored, of
//! 4-bit codes in blocks of a multiple of 32.
template <class F, class V, Sink S>
constexpr bool nibble_lookup() {
  return F::code_bits == 4 && sizeof(V) == 2 && S != Sink::add && F::block % 32 == 0;
}

//! Decodes the Block codes (Block a multiple of 32) of a block of 4-bit codes to out[0, Block) by
//! sink: the output of code c is word c of `words` (the block's sixteen outputs in code order).
//! The same bytes as computing each element, a third of the operations, or less.
template <std::size_t Block, Sink S, class V>
QCOLL_AVX2_INLINE void decode_nibbles(i64x4 words, const unsigned char* codes, V* out) {
  const NibbleTable t = nibble_table(words);
  for (std::size_t j = 0; j < Block; j += 32) {
    __builtin_prefetch(codes + j / 2 + 1024);  // the hardware prefetchers alone fall behind
    emit_nibbles32<S>(t, codes + j / 2, out + j);
  }
}

template <class F, Sink S, bool Sat, bool NanFree, class Dec, class V>
QCOLL_AVX2_INLINE void decode_codes(const Dec& dec, const DecodeTable<F>& table, const unsigned char* codes,
                                    V* out) {
  static_assert(F::block % 16 == 0, "blocks of 16 elements or more");
  constexpr bool sx = Codec<F>::signed_codes;
  if constexpr (nibble_lookup<F, V, S>()) {  // the sixteen outputs computed as the loop below does
    i32x8 c0 = {0, 1, 2, 3, 4, 5, 6, 7}, c1 = c0 + 8;
    if constexpr (sx) {  // unpack8<4, true>'s sign extension
      c0 = (c0 << 28) >> 28;
      c1 = (c1 << 28) >> 28;
    }
    i64x4 words;
    if constexpr (looks_up<Codec<F>>::value) {
      words =
          narrow16<NanFree>(dec.template scaled<Sat>(table(c0)), dec.template scaled<Sat>(table(c1)), out);
    } else {
      words = narrow16<NanFree>(dec.template apply<Sat>(c0), dec.template apply<Sat>(c1), out);
    }
    decode_nibbles<F::block, S>(words, codes, out);
    return;
  }
  // Four 16-element steps per iteration (at block 32, the block's two), unrolled here, in the
  // instance that decodes most blocks (not saturating; NaN-free where the outputs are 16-bit): the
  // compiler's own unrolling depended on its size estimates, so that some instances were unrolled
  // and others not. At block 32, one iteration per block instead of two: int8 to bfloat16 from
  // memory 1.04-1.10x, and 0.160 ns per element wherever the linker placed it, against 0.166-0.185
  // for the loop of two (fp32 outputs and the caches level). The instances for the rare blocks
  // (large scales, NaN or ±Inf) take one step per iteration, for less code.
  constexpr bool main_instance = !Sat && (NanFree || sizeof(V) == 4);
  constexpr std::size_t step = main_instance ? (F::block < 64 ? F::block : 64) : 16;
  for (std::size_t j0 = 0; j0 < F::block; j0 += step) {
    QCOLL_UNROLL
    for (std::size_t j = j0; j < j0 + step; j += 16) {
      __builtin_prefetch(codes + j * F::code_bits / 8 + 1024);  // the hardware prefetchers alone fall behind
      if constexpr (mx_via_half<F>::value) {
        using E = typename Codec<F>::Element;
        f32x8 v0, v1;
        if constexpr (F::code_bits == 8) {
          fp8_as_half<E>(codes + j, v0, v1);
        } else {
          fp6_as_half<E, F::block * 6 / 8>(codes, j, v0, v1);
        }
        emit<S, NanFree>(out + j, dec.template scaled<Sat>(half_value<E>(v0)),
                         dec.template scaled<Sat>(half_value<E>(v1)));
      } else {
        const i32x8 c0 = unpack8<F::code_bits, sx>(codes, j), c1 = unpack8<F::code_bits, sx>(codes, j + 8);
        if constexpr (looks_up<Codec<F>>::value) {
          emit<S, NanFree>(out + j, dec.template scaled<Sat>(table(c0)), dec.template scaled<Sat>(table(c1)));
        } else {
          emit<S, NanFree>(out + j, dec.template apply<Sat>(c0), dec.template apply<Sat>(c1));
        }
      }
    }
  }
}

//! Whether decode_fp8_blocks decodes FP8 with block scale a: 0 < |a| < 2^100 (NaN fails).
QCOLL_AVX2_INLINE bool fp8_direct(float a) {
  const float m = fp::abs(a);
  return m > 0.0f && m < small_scale;
}

//! Whether the FP8 codes c[0, n) of E (n a multiple of 32) are all finite: no NaN code, and for
//! E5M2 no ±Inf code; Normal: and none has exponent field 0 (a zero or a subnormal). O(n), four
//! operations per 32 codes (Normal: seven).
template <class E, bool Normal = false>
QCOLL_AVX2_INLINE bool fp8_finite_codes(const unsigned char* c, std::size_t n) {
  constexpr char last = static_cast<char>(E::max_code);                       // the largest finite magnitude
  constexpr char field = static_cast<char>(0x7f & ~((1u << E::mbits) - 1u));  // the exponent field
  i8x32 any{};
  for (std::size_t j = 0; j < n; j += 32) {
    i8x32 b;
    std::memcpy(&b, c + j, sizeof b);
    any |= (b & (char)0x7f) > last;
    if constexpr (Normal) any |= (b & field) == 0;
  }
  return __builtin_ia32_ptestz256((i64x4)any, (i64x4)any);
}

//! The 32 code bytes at p arranged for interleave_bytes: lane 0 codes 0-7 and 16-23, lane 1 codes
//! 8-15 and 24-31, so that the byte interleaves of their look-ups give the outputs in element
//! order.
QCOLL_AVX2_INLINE i8x32 interleave_ready(const unsigned char* p) {
  i64x4 b;
  std::memcpy(&b, p, sizeof b);
  return (i8x32)__builtin_shufflevector(b, b, 0, 2, 1, 3);
}

//! The least |s| (decode_fp8_block's scale) that fp8_bf16_lookup takes: 2^-90.
constexpr float fp8_lookup_least = 0x1p-90f;

//! The FP8 codes c[0, n) of E (n a multiple of 32; finite codes) decoded to bfloat16 as
//! decode_fp8_block computes them, with s its scale, by look-up. The outputs of the codes of
//! exponent field 0 and 1 (2^(mbits + 1) magnitudes) are computed as there, once, into a
//! NibbleTable; a code of field e >= 1 gives the output of its field-1 twin (same fraction) with
//! e - 1 added to the exponent field, and a code of field 0 its own; the code's sign is added
//! last (bit 15: an addition modulo 2^16 flips the sign of a negative s's outputs, as it should).
//! Exact where fp8_lookup_least <= |s| < 2^108 (fp8_direct's bound, times 2^8): every product of
//! a normal code is then a normal fp32 value at least 2^-104 and below 2^125, so multiplying by
//! 2^(e - 1) commutes with both roundings (to fp32, then bfloat16); field-0 codes (zeros and
//! subnormals) are in the table. Per 32 codes about 24 operations (decode_fp8_block: about 45),
//! plus about 20 per call for the table.
template <class E, Sink S>
QCOLL_AVX2_INLINE void fp8_bf16_lookup(const unsigned char* c, std::size_t n, float s, bfloat16* o,
                                       std::size_t ahead) {
  static_assert(E::bits == 8 && S != Sink::add, "FP8 codes, stored");
  constexpr int mb = E::mbits, sh = 7 - E::mbits;
  constexpr unsigned char M = 1u << mb;                       // the codes of one exponent field
  constexpr char field = static_cast<char>(0x7f & ~(M - 1));  // the exponent field's bits
  // table word i: code M + i (field 1) for i < M, code i - M (field 0) for i < 2M, else code 0
  unsigned char tc[16];
  for (unsigned i = 0; i < 16; ++i)
    tc[i] = static_cast<unsigned char>(i < M ? M + i : i < 2u * M ? i - M : 0);
  f32x8 v0, v1;
  fp8_as_half<E, false, true>(tc, v0, v1);
  const NibbleTable t = nibble_table(narrow16<true>(v0 * s, v1 * s, o));
  for (std::size_t j = 0; j < n; j += 32) {
    __builtin_prefetch(c + j + ahead);  // the hardware prefetchers alone fall behind
    const i8x32 q = interleave_ready(c + j);
    const i8x32 x = q & field;
    const i8x32 idx = (q & static_cast<char>(M - 1)) | ((x == 0) & static_cast<char>(M));
    const i8x32 e1 = sub_sat_u8(x, M);  // (e - 1) << mbits, 0 for field 0
    // the additions' bytes: low (e - 1) << 7 & 0xff, high (e - 1) >> 1 and the sign
    const i8x32 alo = (i8x32)((u16x16)e1 << sh) & static_cast<char>(0xff << sh);
    const i8x32 ahi =
        ((i8x32)((u16x16)e1 >> (8 - sh)) & static_cast<char>(0xff >> (8 - sh))) | (q & (char)0x80);
    i16x16 t0, t1, a0, a1;
    interleave_bytes(__builtin_ia32_pshufb256(t.lo, idx), __builtin_ia32_pshufb256(t.hi, idx), t0, t1);
    interleave_bytes(alo, ahi, a0, a1);
    put16<S>(o + j, (i64x4)(t0 + a0));
    put16<S>(o + j + 16, (i64x4)(t1 + a1));
  }
}

//! Whether decode_fp8_blocks decodes F's blocks to V by sink S through Fp8NormalLookup
//! where their codes are all normal: bfloat16 outputs, stored (in cache 1.5-1.6x at block 32,
//! 1.9-2x at 64, 1.1-1.5x from 128 on, where fp8_bf16_lookup served).
template <class F, class V, Sink S>
constexpr bool fp8_normal_lookup() {
  return std::is_same<V, bfloat16>::value && S != Sink::add;
}

//! Decodes FP8 codes of E, all normal (fp8_finite_codes<E, true>), to bfloat16 as
//! decode_fp8_block computes them, with a the block scale: the code's value times a, rounded to
//! fp32, then to bfloat16 (decode_fp8_block's E4M3 product (value * 2^-8) * (a * 2^8) is the same
//! real number). As fp8_bf16_lookup, and exact under the same bound (fp8_lookup_least <= |a| * 2^8
//! for E4M3, |a| for E5M2; |a| < 2^100), but its table takes one multiplication: only the 2^mbits
//! codes of exponent field 1 are multiplied and rounded (T[m], the output of fraction m). A code's
//! low four bits, its fraction m and the low R = 4 - mbits bits r of its field e, index sixteen
//! words: T[m] + (r - 1) * 2^7 for r >= 1, and for r = 0 the word of field 2^R, T[m] + (2^R - 1)
//! * 2^7, less 2^(R-1) * 2^8, which is T[m] - 2^7. Each word plus (e >> R) * 2^(R-1) * 2^8 is T[m]
//! + (e - 1) * 2^7, the output of field e: a multiple of 2^8, so it is added to the words' high
//! bytes, as bytes, with the code's sign. Per 32 codes 14 operations, plus 13 per block for the
//! table. Its constants are made once (and kept in registers: GCC would rebuild each of them in
//! every block of an unrolled run).
template <class E>
struct Fp8NormalLookup {
  static_assert(E::bits == 8, "FP8 codes");
  static_assert(E::ebits == 4 ? E::bias == 7 && E::mbits == 3 : E::bias == 15 && E::mbits == 2, "E4M3, E5M2");
  static constexpr unsigned M = 1u << E::mbits, rows = 16 / M;
  static_assert(rows == 2 || rows == 4, "two or four rows");
  //! The value of the code of field 1 and fraction m, (M + m) * 2^(1 - bias - mbits).
  static constexpr float field1(unsigned m) {
    return static_cast<float>(M + m % M) * (E::ebits == 4 ? 0x1p-9f : 0x1p-16f);
  }
  //! Word k = r * M + m of the table less T[m], in bits 16-31 (modulo 2^32).
  static constexpr unsigned delta(unsigned k) { return (k < M ? 0u - 0x80u : (k / M - 1) * 0x80u) << 16; }
  f32x8 v;       // lane i: field1(i)
  u32x8 d0, d1;  // delta of words 0-7, 8-15
  u32x8 one, half;
  i8x32 low, emask, sign;
  QCOLL_AVX2_INLINE Fp8NormalLookup() {
    v = f32x8{field1(0), field1(1), field1(2), field1(3), field1(4), field1(5), field1(6), field1(7)};
    d0 = u32x8{delta(0), delta(1), delta(2), delta(3), delta(4), delta(5), delta(6), delta(7)};
    d1 = u32x8{delta(8), delta(9), delta(10), delta(11), delta(12), delta(13), delta(14), delta(15)};
    one = u32x8{} + 1u;
    half = u32x8{} + 0x7fffu;
    low = i8x32{} + static_cast<char>(0x0f);
    emask = i8x32{} + static_cast<char>(rows == 4 ? 0x0e : 0x07);
    sign = i8x32{} + static_cast<char>(0x80);
    __asm__("" : "+x"(v), "+x"(d0), "+x"(d1), "+x"(one), "+x"(half), "+x"(low), "+x"(emask), "+x"(sign));
  }
  //! The codes c[0, n) (n a multiple of 32) to o by sink, with a the block scale in every lane.
  template <Sink S>
  QCOLL_AVX2_INLINE void decode(const unsigned char* c, std::size_t n, f32x8 a, bfloat16* o,
                                std::size_t ahead) const {
    static_assert(S != Sink::add, "stored");
    const u32x8 p = (u32x8)(v * a);                // normal, finite: |a| within the bound
    const u32x8 t = p + half + ((p >> 16) & one);  // T[i % M] in bits 16-31
    // lane 0: low bytes of words 0-3, their high bytes, low bytes of words 8-11, their high bytes;
    // lane 1: the same of words 4-7 and 12-15
    const i8x32 pick0 = {2, 6, 10, 14, 3, 7, 11, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                         2, 6, 10, 14, 3, 7, 11, 15, -1, -1, -1, -1, -1, -1, -1, -1};
    const i8x32 pick1 = {-1, -1, -1, -1, -1, -1, -1, -1, 2, 6, 10, 14, 3, 7, 11, 15,
                         -1, -1, -1, -1, -1, -1, -1, -1, 2, 6, 10, 14, 3, 7, 11, 15};
    const i32x8 w = (i32x8)(__builtin_ia32_pshufb256((i8x32)(t + d0), pick0) |
                            __builtin_ia32_pshufb256((i8x32)(t + d1), pick1));
    const i8x32 tlo = (i8x32)__builtin_shufflevector(w, w, 0, 4, 2, 6, 0, 4, 2, 6);
    const i8x32 thi = (i8x32)__builtin_shufflevector(w, w, 1, 5, 3, 7, 1, 5, 3, 7);
    // the high byte's addition, (e >> R) * 2^(R-1), is the code's bits 4-6 times 2^(R-1)
    constexpr int sh = rows == 4 ? 3 : 4;
    for (std::size_t j = 0; j < n; j += 32) {
      __builtin_prefetch(c + j + ahead);  // the hardware prefetchers alone fall behind
      const i8x32 q = interleave_ready(c + j);
      const i8x32 idx = q & low;
      const i8x32 hi = __builtin_ia32_pshufb256(thi, idx) + (((i8x32)((u16x16)q >> sh) & emask) | (q & sign));
      i16x16 w0, w1;
      interleave_bytes(__builtin_ia32_pshufb256(tlo, idx), hi, w0, w1);
      put16<S>(o + j, (i64x4)w0);
      put16<S>(o + j + 16, (i64x4)w1);
    }
  }
};

//! The codes c[0, F::block) of a block of FP8 F decoded as decode_fp8_blocks does, with s the
//! scale (E4M3: times 2^8), to o by sink; prefetches `ahead` bytes past the codes. bfloat16
//! outputs, stored, of blocks of 64 codes or more: by fp8_bf16_lookup where |s| >=
//! fp8_lookup_least (from memory 1.1x at block 64, 1.5x at 128, 2x from 256 on; at block 32 its
//! table costs as much as the block, and it ran 0.75x). decode_fp8_blocks sends here only the
//! blocks that Fp8NormalLookup does not take (a zero or subnormal code among them).
template <class F, Sink S, class V>
QCOLL_AVX2_INLINE void decode_fp8_block(const unsigned char* c, float s, V* o, std::size_t ahead) {
  using E = typename Codec<F>::Element;
  if constexpr (std::is_same<V, bfloat16>::value && S != Sink::add && F::block >= 64) {
    if (fp::abs(s) >= fp8_lookup_least) return fp8_bf16_lookup<E, S>(c, F::block, s, o, ahead);
  }
  QCOLL_UNROLL_BLOCK
  for (std::size_t j = 0; j < F::block; j += 16) {
    __builtin_prefetch(c + j + ahead);  // the hardware prefetchers alone fall behind
    f32x8 v0, v1;
    fp8_as_half<E, false, true>(c + j, v0, v1);
    emit<S, true>(o + j, v0 * s, v1 * s);
  }
}

//! decode_codes<F, S, true> for FP8 with an fp32 block scale, over blocks k, k + 1, ... while
//! their scale `a` passes fp8_direct and their codes are finite (fp8_finite_codes; one loop, so
//! its constants stay in registers): codes converted as fp16 (fp8_as_half), times the scale
//! (E4M3: times 2^8 * a, the same real product, so the same rounding). Neither NaN nor ±Inf
//! arises (|code value| <= 57344, |a| < 2^100), so scale_value's saturation never applies and
//! nothing is written NaN. Blocks of up to 128 elements are checked eight at a time (their
//! scales as one vector, their codes in one pass), then decoded with no test of their own; the
//! rest (and a run that fails its check) one at a time. Blocks of normal codes decoded to
//! bfloat16 take Fp8NormalLookup (fp8_normal_lookup). Returns the first block not decoded
//! (count when all are); a block holding NaN or Inf codes (which no quantizer writes from finite
//! input) takes decode_codes. O(blocks decoded * F::block).
template <class F, Sink S, class V>
QCOLL_AVX2_INLINE std::size_t decode_fp8_blocks(const unsigned char* codes, const unsigned char* meta,
                                                float message_scale, V* out, std::size_t k,
                                                std::size_t count) {
  using E = typename Codec<F>::Element;
  constexpr std::size_t code_bytes = F::block;
  // Prefetch distance: 1 KiB past the codes decoded, and from block 1024 on past the next block,
  // which fp8_finite_codes reads before it is decoded (at block 2048, 1.09-1.31x from memory).
  constexpr std::size_t ahead = F::block >= 1024 ? F::block + 1024 : 1024;
  // the least |a| of Fp8NormalLookup (fp8_lookup_least, on a * 2^8 for E4M3)
  [[maybe_unused]] constexpr float least = E::ebits == 4 ? fp8_lookup_least * 0x1p-8f : fp8_lookup_least;
  [[maybe_unused]] const std::conditional_t<fp8_normal_lookup<F, V, S>(), Fp8NormalLookup<E>, char> look{};
  if constexpr (F::block <= 128) {
    static_assert(F::meta_bytes == 4, "an fp32 block scale per block (F::load_meta reads store_f32's bytes)");
    for (; k + 8 <= count; k += 8) {
      f32x8 a;  // the scales of blocks k to k + 7 (little-endian fp32, as store_f32 writes them)
      std::memcpy(&a, meta + k * 4, sizeof a);
      const f32x8 m = (f32x8)((i32x8)a & 0x7fffffff);  // fp8_direct per lane
      const i32x8 below = m < small_scale;
      const unsigned direct = static_cast<unsigned>(__builtin_ia32_movmskps256((f32x8)((m > 0.0f) & below)));
      const unsigned char* c = codes + k * code_bytes;
      if constexpr (fp8_normal_lookup<F, V, S>()) {
        const f32x8 in = (f32x8)((m >= least) & below);
        if (__builtin_ia32_movmskps256(in) == 0xff && fp8_finite_codes<E, true>(c, 8 * F::block)) {
          QCOLL_UNROLL
          for (std::size_t b = 0; b < 8; ++b)  // each scale broadcast from memory, not from a's lane
            look.template decode<S>(c + b * code_bytes, F::block,
                                    splat_f(::qcoll::detail::load_f32(meta + (k + b) * 4)),
                                    out + (k + b) * F::block, ahead);
          continue;
        }
      }
      if (direct != 0xffu || !fp8_finite_codes<E>(c, 8 * F::block)) break;
      const f32x8 s = E::ebits == 4 ? a * 256.0f : a;
      QCOLL_UNROLL
      for (std::size_t b = 0; b < 8; ++b)
        decode_fp8_block<F, S>(c + b * code_bytes, s[b], out + (k + b) * F::block, ahead);
    }
  }
  for (; k < count; ++k) {
    const float a = Codec<F>::dec(F::load_meta(meta + k * F::meta_bytes, message_scale)).a;
    const unsigned char* c = codes + k * code_bytes;
    if (!fp8_direct(a)) break;
    if constexpr (fp8_normal_lookup<F, V, S>()) {
      if (fp::abs(a) >= least && fp8_finite_codes<E, true>(c, F::block)) {
        look.template decode<S>(c, F::block, splat_f(a), out + k * F::block, ahead);
        continue;
      }
    }
    if (!fp8_finite_codes<E>(c, F::block)) break;
    decode_fp8_block<F, S>(c, E::ebits == 4 ? a * 256.0f : a, out + k * F::block, ahead);
  }
  return k;
}

//! The elements of an MX format F as decode_mx_exact_blocks reads them (defined for the formats
//! whose element values have at most 8 significant bits, so that their exact products are
//! bfloat16 values): `read` gives sixteen values r, each the element value v divided by `unit` (a
//! power of two, 2^unit_log2), exactly, NaN codes as a NaN; `least` is the least nonzero |v|;
//! `nan_codes`, whether some codes are NaN.
template <class F>
struct MxElements;
template <class E>
struct MxElements<MxFloat<E>> {
  static_assert(E::mbits <= 7, "at most 8 significant bits");
  using F = MxFloat<E>;
  static constexpr double least = 1.0 / static_cast<double>(1ull << (E::bias + E::mbits - 1));
  static constexpr bool nan_codes = E::has_nan;
  //! fp16-converted codes (see half_value) carry 2^(bias - 15), E5M2's none; looked-up ones none
  static constexpr int unit_log2 =
      !mx_via_half<F>::value || (E::bits == 8 && E::ebits == 5) ? 0 : 15 - E::bias;
  QCOLL_AVX2_INLINE static void read(const DecodeTable<F>& table, const unsigned char* p, std::size_t j,
                                     f32x8& v0, f32x8& v1) {
    if constexpr (F::code_bits == 8) {
      fp8_as_half<E, true>(p + j, v0, v1);
    } else if constexpr (F::code_bits == 6) {
      fp6_as_half<E, F::block * 6 / 8>(p, j, v0, v1);
    } else {
      v0 = table(unpack8<F::code_bits>(p, j));
      v1 = table(unpack8<F::code_bits>(p, j + 8));
    }
  }
};
template <>
struct MxElements<MxInt8> {
  static constexpr double least = 0.015625;  // codes times 2^-6
  static constexpr bool nan_codes = false;
  static constexpr int unit_log2 = -6;
  QCOLL_AVX2_INLINE static void read(const DecodeTable<MxInt8>&, const unsigned char* p, std::size_t j,
                                     f32x8& v0, f32x8& v1) {
    v0 = __builtin_convertvector(widen8<true>(p + j), f32x8);
    v1 = __builtin_convertvector(widen8<true>(p + j + 8), f32x8);
  }
};

//! Whether decode_mx_exact_blocks serves F.
template <class F, class = void>
struct mx_exact : std::false_type {};
template <class F>
struct mx_exact<F, std::void_t<decltype(MxElements<F>::least)>> : std::true_type {};

//! Whether decode_mx_exact_blocks decodes a block of F with decode factors a, b: both finite,
//! least * |a| and least * |a * b| at least 2^-126, and a * b * unit at most 2^127 (see there).
template <class F>
inline bool mx_exact_factors(float a, float b) {
  using X = MxElements<F>;
  // (MX factors are positive powers of two or NaN; anything else fails)
  constexpr double unit = X::unit_log2 >= 0 ? static_cast<double>(1ull << X::unit_log2)
                                            : 1.0 / static_cast<double>(1ull << -X::unit_log2);
  const double ab = static_cast<double>(a) * static_cast<double>(b);
  return fp::is_finite(a) && fp::is_finite(b) && X::least * static_cast<double>(a) >= 0x1p-126 &&
         X::least * ab >= 0x1p-126 && ab * unit <= 0x1p127;
}

//! The E8M0 codes [lo, hi] of the blocks of F whose decode factors pass mx_exact_factors (empty:
//! lo > hi; every format without MxElements). The factors depend on the code e alone (a * b =
//! 2^(e - 127)), and each condition is monotone in e, so the codes that pass form one interval:
//! found once per message, by tests from both ends (a few in practice, at most 255).
struct MxCodes {
  unsigned lo, hi;
};
template <class F>
inline MxCodes mx_exact_codes(float message_scale) {
  if constexpr (mx_exact<F>::value) {
    static_assert(F::meta_bytes == 1, "an E8M0 code per block");
    const auto passes = [message_scale](unsigned e) {
      const unsigned char m = static_cast<unsigned char>(e);
      const auto dec = Codec<F>::dec(F::load_meta(&m, message_scale));
      return mx_exact_factors<F>(dec.a, dec.b);
    };
    MxCodes r{0, 254};  // 255 is NaN
    while (r.lo <= r.hi && !passes(r.lo)) ++r.lo;
    while (r.lo <= r.hi && !passes(r.hi)) --r.hi;
    return r;
  } else {
    return MxCodes{1, 0};
  }
}

//! MX blocks of 6-bit elements E decoded to half in 16-bit lanes, from the fp16 patterns h of
//! fp6_words, for the blocks whose every nonzero value v * 2^x (x = e - 127, the block's E8M0 code
//! e) is a normal half (`serves`): F::decode's exact product, which from_float<half> keeps. A normal
//! code (exponent field 1 or more) has the pattern h + k, k = (x + 15 - E::bias) << 10 (h carries
//! 2^(E::bias - 15), and the sum stays below the sign bit); a subnormal code m or zero the pattern
//! in a byte look-up of m, by the block (one addition per block to a table of its values at x = 0,
//! the zero's entry kept 0): every such pattern has at most mbits significant bits and its field
//! below 31, so its bits from 10 - mbits on fit a byte. Nine operations per sixteen outputs after
//! fp6_words, where the fp16 conversions took four and two products: MXFP6 dequantize to half
//! 1.16-1.23x faster (AMD EPYC, in the caches and from memory, both orders of the two builds).
//! bfloat16 outputs keep the conversions: their fields do not fit a byte with the pattern's
//! fraction bits, and the same arithmetic with the byte look-up sign-extended and k added per lane
//! (twelve operations) measured 0.94-0.96x.
template <class E>
struct MxWords {
  static_assert(E::bits == 6 && !E::has_inf && !E::has_nan, "6-bit elements: every field finite");
  static constexpr int sh = 10 - E::mbits;                    //!< where fp6_words puts a code's magnitude
  static constexpr int emax = (1 << E::ebits) - 1 - E::bias;  //!< exponent of E's largest value
  i8x32 table;  //!< pattern(m * 2^(1 - E::bias - mbits) * 2^x) >> sh less (x << mbits), m < 2^mbits
  QCOLL_AVX2_INLINE MxWords() {
    table = i8x32{};
    for (int m = 1; m < (1 << E::mbits); ++m) {
      // m = 2^j * (1 + f): exponent field j + 1 - bias - mbits + 15 at x = 0
      const int j = 31 - __builtin_clz(static_cast<unsigned>(m));
      const int p = ((j + 16 - E::bias - E::mbits) << E::mbits) + ((m - (1 << j)) << (E::mbits - j));
      table[m] = table[m + 16] = static_cast<char>(p);
    }
  }
  //! Whether blocks of exponent x take words(): E's least nonzero value 2^(1 - E::bias - mbits) and
  //! its largest (below 2^(emax + 1)) times 2^x have exponent fields 1 to 30.
  static bool serves(int x) { return 16 - E::bias - E::mbits + x >= 1 && emax + x + 15 <= 30; }
  //! The per-block arguments of words() for exponent x (serves(x)): k, and the table at x.
  QCOLL_AVX2_INLINE void at(int x, short& k, i8x32& t) const {
    k = static_cast<short>((x + 15 - E::bias) * (1 << 10));
    const i8x32 keep = {0, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0,
                        0, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    t = table + ((i8x32{} + static_cast<char>(x * (1 << E::mbits))) & keep);
  }
  //! The half patterns of the codes h (fp6_words) of a block whose at() gave k and t.
  static QCOLL_AVX2_INLINE i16x16 words(i16x16 h, short k, i8x32 t) {
    const i16x16 mag = h & 0x7fff;
    const i16x16 low = (i16x16)__builtin_ia32_pshufb256(t, (i8x32)(mag >> sh));  // high bytes: t[0] = 0
    const i16x16 sub = (low << sh) | (h & (short)0x8000);
    return (short)(1 << 10) > mag ? sub : h + k;
  }
};

//! Whether decode_mx_exact_blocks decodes F to V by sink S with MxWords where they serve; `type`:
//! that MxWords, or (not) an empty stand-in.
template <class F, class V, Sink S>
struct mx_words : std::false_type {
  using type = char;
};
template <class E, class V, Sink S>
struct mx_words<MxFloat<E>, V, S>
    : std::bool_constant<E::bits == 6 && std::is_same<V, half>::value && S != Sink::add> {
  using type = std::conditional_t<mx_words::value, MxWords<E>, char>;
};

//! decode_codes<F, S, false, false> for an MX format F (MxElements), over blocks k, k + 1, ...
//! whose E8M0 code e lies in `codes` (mx_exact_codes): each value read times c = a * b * unit,
//! one multiplication, c's bits being (e + unit_log2) << 23. F::decode computes (v * a) * b;
//! v * a is exact there (normal, and finite: |a| <= 2^63), so that product is one rounding of
//! the real v * a * b, and so is r * c, c being exact (a power of two, at least 2^-126). Every
//! nonzero product is normal or ±Inf with at most 8 significant bits, a bfloat16 value, so
//! bfloat16 outputs are the top halves. E4M3 and E5M2 NaN codes read as the NaN 0x7fffe000
//! (fp8_as_half, canonical), which the product keeps (c is not NaN) and which is 0x7fff both as
//! its top half (bfloat16) and as cvtps2ph converts it to half (sign, exponent and the top ten
//! fraction bits), so 16-bit outputs need no NaN fix-up; it is made F::decode's 0x7fffffff for
//! fp32 outputs. A block costs a byte load and a comparison besides its
//! elements. Returns the first block not decoded (count when all are).
//! O(blocks decoded * F::block).
template <class F, Sink S, class V>
QCOLL_AVX2_INLINE std::size_t decode_mx_exact_blocks(const DecodeTable<F>& table, MxCodes range,
                                                     const unsigned char* codes, const unsigned char* meta,
                                                     V* out, std::size_t k, std::size_t count) {
  using X = MxElements<F>;
  constexpr std::size_t code_bytes = F::block * F::code_bits / 8;
  if (range.lo > range.hi) return k;
  [[maybe_unused]] const typename mx_words<F, V, S>::type words{};
  for (; k < count; ++k) {
    const unsigned e = meta[k];
    if (e - range.lo > range.hi - range.lo) break;  // e < lo wraps around
    const unsigned char* p = codes + k * code_bytes;
    V* o = out + k * F::block;
    if constexpr (mx_words<F, V, S>::value) {
      const int x = static_cast<int>(e) - 127;
      if (words.serves(x)) {
        short kx;
        i8x32 tx;
        words.at(x, kx, tx);
        QCOLL_UNROLL_BLOCK
        for (std::size_t j = 0; j < F::block; j += 16) {
          __builtin_prefetch(p + j * F::code_bits / 8 + 1024);
          put16<S>(o + j,
                   (i64x4)words.words(fp6_words<typename Codec<F>::Element, code_bytes>(p, j), kx, tx));
        }
        continue;
      }
    }
    const float c = fp::from_bits(static_cast<std::uint32_t>(static_cast<int>(e) + X::unit_log2) << 23);
    if constexpr (nibble_lookup<F, V, S>()) {  // the sixteen outputs as the loop below makes them
      const i32x8 n0 = {0, 1, 2, 3, 4, 5, 6, 7};
      decode_nibbles<F::block, S>(
          narrow16<true, std::is_same<V, bfloat16>::value>(table(n0) * c, table(n0 + 8) * c, o), p, o);
      continue;
    }
    QCOLL_UNROLL_BLOCK
    for (std::size_t j = 0; j < F::block; j += 16) {
      __builtin_prefetch(p + j * F::code_bits / 8 + 1024);  // the hardware prefetchers alone fall behind
      f32x8 v0, v1;
      X::read(table, p, j, v0, v1);
      v0 = v0 * c;
      v1 = v1 * c;
      if constexpr (sizeof(V) == 2) {  // no NaN fix-up: 0x7fffe000 becomes 0x7fff either way
        emit<S, true, std::is_same<V, bfloat16>::value>(o + j, v0, v1);
      } else {
        if constexpr (X::nan_codes) {
          v0 = canonical_nan(v0);
          v1 = canonical_nan(v1);
        }
        emit<S>(o + j, v0, v1);
      }
    }
  }
  return k;
}

//! decode_codes<NvFp4, S, false, true> over blocks k, k + 1, ... while their block scale (an E4M3
//! code) is not NaN, for a message scale a that cannot saturate (finite, |a| < 2^100; the caller
//! checks): each value (v * b) * a as NvFp4::decode computes it, b from a table of the 256 E4M3
//! values (`scales`). One loop whose constants stay in registers. Returns the first block not
//! decoded (count when all are). O(blocks decoded * 16).
template <Sink S, class V>
QCOLL_AVX2_INLINE std::size_t decode_nvfp4_blocks(const DecodeTable<NvFp4>& table,
                                                  const MinifloatTable<minifloat::E4M3>& scales,
                                                  const unsigned char* codes, const unsigned char* meta,
                                                  float a, V* out, std::size_t k, std::size_t count) {
  static_assert(NvFp4::block == 16 && NvFp4::meta_bytes == 1, "16 E2M1 codes and one E4M3 code per block");
  if constexpr (sizeof(V) == 2 && S != Sink::add) {
    // 16-bit outputs: an output depends on the code and the block scale's code alone, so the
    // sixteen outputs of each of the 256 block scales are computed once, as decode_codes computes
    // them (8 KiB, as pshufb tables: row e holds the low bytes of block scale e's outputs, then
    // their high bytes), and each block looks its codes up, NaN block scales included. Worth its
    // set-up (about 4096 elements' work) on messages of 256 blocks or more.
    if (count - k >= 256) {
      alignas(32) unsigned char rows[256][32];
      for (unsigned e = 0; e < 256; ++e) {
        const float b = fp::from_bits(static_cast<std::uint32_t>(scales.bits[e]));
        const Codec<NvFp4>::Dec dec{a, b};  // a cannot saturate (the caller checks)
        const i32x8 n0 = {0, 1, 2, 3, 4, 5, 6, 7};
        const NibbleTable t = nibble_table(
            narrow16<false>(dec.scaled<false>(table(n0)), dec.scaled<false>(table(n0 + 8)), out));
        const i64x4 lo = (i64x4)t.lo, hi = (i64x4)t.hi;
        const i64x4 row = __builtin_shufflevector(lo, hi, 0, 1, 4, 5);
        std::memcpy(rows[e], &row, sizeof row);
      }
      for (; k < count; ++k) {
        const unsigned char* c = codes + k * 8;
        __builtin_prefetch(c + 1024);  // the hardware prefetchers alone fall behind
        i8x16 lo, hi;
        std::memcpy(&lo, rows[meta[k]], 16);
        std::memcpy(&hi, rows[meta[k]] + 16, 16);
        long long w;  // one 8-byte load (movq): a vector filled by parts would stall its load
        std::memcpy(&w, c, 8);
        const i8x16 q = (i8x16)i64x2{w, 0};
        const i8x16 ql = q & (char)0x0f, qh = (i8x16)((u16x8)q >> 4) & (char)0x0f;
        const i8x16 idx =
            __builtin_shufflevector(ql, qh, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const i8x16 l = __builtin_ia32_pshufb128(lo, idx), h = __builtin_ia32_pshufb128(hi, idx);
        put16<S>(out + k * 16, (i64x4)__builtin_shufflevector(l, h, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21,
                                                              6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12,
                                                              28, 13, 29, 14, 30, 15, 31));
      }
      return k;
    }
  }
  for (; k < count; ++k) {
    if ((meta[k] & 0x7f) == 0x7f) break;  // a NaN block scale
    const float b = fp::from_bits(static_cast<std::uint32_t>(scales.bits[meta[k]]));
    const unsigned char* c = codes + k * 8;
    __builtin_prefetch(c + 1024);  // the hardware prefetchers alone fall behind
    emit<S, true>(out + k * 16, table(unpack8<4>(c, 0)) * b * a, table(unpack8<4>(c, 8)) * b * a);
  }
  return k;
}

//! decode_codes<F, S, false, false> of one block, out of line: the rare blocks that
//! decode_asymmetric_blocks hands to the double arithmetic, kept out of its loop (inlined there,
//! with decode_codes' loop unrolled, they left that loop 7% slower in cache, int8a to fp16; out
//! of line, it ran 1.08-1.12x faster than with decode_codes inlined and not unrolled).
template <class F, Sink S, class Dec, class V>
QCOLL_AVX2 __attribute__((noinline)) void decode_block_outlined(const Dec& dec, const DecodeTable<F>& table,
                                                                const unsigned char* codes, V* out) {
  decode_codes<F, S, false, false>(dec, table, codes, out);
}

//! decode_full_blocks for the asymmetric integers, on a processor with FMA: a block whose sum
//! offset + code * scale is exact in double (Codec::fma_exact) decodes by one float FMA per
//! element, which rounds that sum once as F::decode does; the others by Dec's double arithmetic.
template <class F, Sink S, class V>
QCOLL_AVX2_FMA inline void decode_asymmetric_blocks(const unsigned char* codes, const unsigned char* meta,
                                                    V* out, std::size_t count) {
  using C = Codec<F>;
  constexpr std::size_t code_bytes = F::block * F::code_bits / 8;
  const DecodeTable<F> table{};
  for (std::size_t k = 0; k < count; ++k) {
    const unsigned char* c = codes + k * code_bytes;
    const unsigned char* mk = meta + k * F::meta_bytes;
    const float scale = ::qcoll::detail::load_f32(mk), offset = ::qcoll::detail::load_f32(mk + 4);
    V* o = out + k * F::block;
    if (!C::fma_exact(offset, scale)) {
      decode_block_outlined<F, S>(typename C::Dec{double(offset), double(scale)}, table, c, o);
      continue;
    }
    const f32x8 vs = splat_f(scale), vo = splat_f(offset);
    if constexpr (nibble_lookup<F, V, S>()) {  // the sixteen outputs by the FMA below
      const f32x8 n0 = {0, 1, 2, 3, 4, 5, 6, 7}, n1 = n0 + 8.0f;
      decode_nibbles<F::block, S>(
          narrow16<true>(__builtin_ia32_vfmaddps256(n0, vs, vo), __builtin_ia32_vfmaddps256(n1, vs, vo), o),
          c, o);
      continue;
    }
    for (std::size_t j = 0; j < F::block; j += 16) {
      __builtin_prefetch(c + j * F::code_bits / 8 + 1024);
      const f32x8 c0 = __builtin_convertvector(unpack8<F::code_bits, false>(c, j), f32x8),
                  c1 = __builtin_convertvector(unpack8<F::code_bits, false>(c, j + 8), f32x8);
      // No NaN: scale and offset are finite.
      emit<S, true>(o + j, __builtin_ia32_vfmaddps256(c0, vs, vo), __builtin_ia32_vfmaddps256(c1, vs, vo));
    }
  }
}

//! Decodes `count` full blocks (codes of block k at codes + k * code bytes, its meta bytes at
//! meta + k * F::meta_bytes) into out[0, count * F::block) as V, or adds them to fp32
//! accumulators (Sink::add): equal to F::decode per element followed by from_float<V> (or
//! fp::add). Sink::stream: out 16-byte aligned. O(count * F::block), plus an O(256) set-up for
//! NVFP4 (its E4M3 table) and MX (the interval of mx_exact_codes). Fma = false leaves out the
//! asymmetric integers' FMA loop (what a processor without FMA runs; the tests call it so).
template <class F, class V, Sink S, bool Fma = true>
QCOLL_AVX2 inline void decode_full_blocks(const unsigned char* codes, const unsigned char* meta,
                                          float message_scale, V* out, std::size_t count) {
  if constexpr (Fma && Codec<F>::range) {  // the asymmetric integers
    if (has_fma()) return decode_asymmetric_blocks<F, S>(codes, meta, out, count);
  }
  constexpr std::size_t code_bytes = F::block * F::code_bits / 8;
  DecodeTable<F> table;
  table.fill();
  // NVFP4: the values of the 256 E4M3 block-scale codes (decode_nvfp4_blocks)
  [[maybe_unused]] std::conditional_t<std::is_same<F, NvFp4>::value, MinifloatTable<minifloat::E4M3>, char>
      scales;
  if constexpr (std::is_same<F, NvFp4>::value) scales.fill();
  [[maybe_unused]] const MxCodes mx_codes = mx_exact_codes<F>(message_scale);
  for (std::size_t k = 0; k < count; ++k) {
    if constexpr (via_half<Codec<F>>::value) {
      k = decode_fp8_blocks<F, S>(codes, meta, message_scale, out, k, count);
      if (k == count) break;
    }
    if constexpr (std::is_same<F, NvFp4>::value) {
      if (fp::abs(message_scale) < small_scale) {  // finite, cannot saturate (NaN fails)
        k = decode_nvfp4_blocks<S>(table, scales, codes, meta, message_scale, out, k, count);
        if (k == count) break;
      }
    }
    if constexpr (mx_exact<F>::value) {
      k = decode_mx_exact_blocks<F, S>(table, mx_codes, codes, meta, out, k, count);
      if (k == count) break;
    }
    const auto dec = Codec<F>::dec(F::load_meta(meta + k * F::meta_bytes, message_scale));
    // Instances: saturating (for codes that can be NaN or ±Inf, every finite scale; else scales of
    // 2^100 and more), not saturating with NaN-free values (NanFree speeds up 16-bit outputs only,
    // so fp32 outputs go to the next one), and not saturating: three for 16-bit outputs, two for
    // fp32. The saturating instance takes NaN-free blocks too (the NaN fix-up then changes
    // nothing): rare blocks, for one instance less.
    constexpr bool narrow16_out = sizeof(V) == 2;
    const unsigned char* c = codes + k * code_bytes;
    V* o = out + k * F::block;
    if (dec.saturates()) {
      decode_codes<F, S, true, false>(dec, table, c, o);
    } else if (narrow16_out && dec.nan_free()) {
      decode_codes<F, S, false, narrow16_out>(dec, table, c, o);
    } else {
      decode_codes<F, S, false, false>(dec, table, c, o);
    }
  }
}

// ---- identity formats: element type conversions -------------------------------------------------

//! Eight elements widened to float as to_float does: exact, and a half NaN becomes 0x7fffffff.
QCOLL_AVX2_INLINE f32x8 load_exact(const float* p) { return load(p); }
QCOLL_AVX2_INLINE f32x8 load_exact(const bfloat16* p) { return load(p); }
QCOLL_AVX2_INLINE f32x8 load_exact(const half* p) {
  const f32x8 v = load(p);
  return sel(((i32x8)v & 0x7fffffff) > 0x7f800000, (f32x8)splat(0x7fffffff), v);
}

//! Sixteen 16-bit codes w of W as V = bfloat16 or half (from_float<V> of to_float), in element
//! order, without a NaN fix-up per conversion: the NaN codes (magnitude above W's infinity) become
//! 0x7fff in one select on the codes. A code of W = V is its own value; half to bfloat16 rounds
//! the exact fp32 value to nearest even (never past bfloat16's largest finite value); bfloat16 to
//! half converts with cvtps2ph (nearest even, overflow to ±Inf).
template <class W, class V>
QCOLL_AVX2_INLINE i64x4 narrow_codes16(i16x16 w) {
  constexpr short inf = std::is_same<W, half>::value ? 0x7c00 : 0x7f80;
  const i16x16 nan = (w & 0x7fff) > inf;
  i16x16 r;
  if constexpr (std::is_same<W, V>::value) {
    r = w;
  } else {
    const i16x8 lo = __builtin_shufflevector(w, w, 0, 1, 2, 3, 4, 5, 6, 7);
    const i16x8 hi = __builtin_shufflevector(w, w, 8, 9, 10, 11, 12, 13, 14, 15);
    if constexpr (std::is_same<V, bfloat16>::value) {  // NaN lanes: any result, replaced below
      u32x8 a = (u32x8)__builtin_ia32_vcvtph2ps256(lo), b = (u32x8)__builtin_ia32_vcvtph2ps256(hi);
      a = (a + 0x7fffu + ((a >> 16) & 1u)) >> 16;
      b = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
      r = (i16x16)pack_u16((i32x8)a, (i32x8)b);
    } else {
      const f32x8 a = (f32x8)(widen_u16(&lo) << 16), b = (f32x8)(widen_u16(&hi) << 16);
      const i16x8 ha = __builtin_ia32_vcvtps2ph256(a, 0), hb = __builtin_ia32_vcvtps2ph256(b, 0);
      r = __builtin_shufflevector(ha, hb, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    }
  }
  return (i64x4)((r & ~nan) | (nan & 0x7fff));
}

//! Writes from_float<W>(to_float(in[i])) for i in [0, n) to out (W codes, no alignment needed)
//! and returns whether any of them is ±Inf or NaN (Identity<W>::code_nonfinite). O(n).
template <class W, class T>
QCOLL_AVX2 inline bool convert_codes(const T* in, std::size_t n, unsigned char* out) {
  i32x8 bad{};  // lanes of all ones where a code is ±Inf or NaN
  std::size_t i = 0;
  if constexpr (sizeof(T) == 2 && sizeof(W) == 2) {  // sixteen at a time, no widening for W = T
    constexpr short inf = std::is_same<W, half>::value ? 0x7c00 : 0x7f80;
    for (; i + 16 <= n; i += 16) {
      __builtin_prefetch(in + i + stream_prefetch_ahead / sizeof(T));
      i16x16 t;
      std::memcpy(&t, in + i, sizeof t);
      const i16x16 h = (i16x16)narrow_codes16<T, W>(t);
      bad |= (i32x8)((h & 0x7fff) >= inf);
      std::memcpy(out + 2 * i, &h, sizeof h);
    }
  }
  for (; i + 8 <= n; i += 8) {
    __builtin_prefetch(in + i + stream_prefetch_ahead / sizeof(T));
    const f32x8 v = load_exact(in + i);
    if constexpr (std::is_same<W, float>::value) {
      bad |= ((i32x8)v & 0x7fffffff) > 0x7f7fffff;
      std::memcpy(out + 4 * i, &v, sizeof v);
    } else {
      const i16x8 h = narrow(v, static_cast<const W*>(nullptr));
      constexpr short inf = std::is_same<W, half>::value ? 0x7c00 : 0x7f80;
      const i16x8 m = (h & 0x7fff) >= inf;
      bad |= (i32x8)__builtin_shufflevector(m, m, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
      std::memcpy(out + 2 * i, &h, sizeof h);
    }
  }
  const i64x4 q = (i64x4)bad;
  bool any = (q[0] | q[1] | q[2] | q[3]) != 0;
  for (; i < n; ++i) {
    const W w = from_float<W>(to_float(in[i]));
    std::memcpy(out + sizeof(W) * i, &w, sizeof w);
    any |= (fp::bits(to_float(w)) & 0x7fffffffu) >= 0x7f800000u;
  }
  return any;
}

//! Eight codes of W at p (no alignment needed) as to_float gives them (load_exact).
template <class W>
QCOLL_AVX2_INLINE f32x8 load_codes(const unsigned char* p) {
  if constexpr (std::is_same<W, float>::value) {
    f32x8 v;
    std::memcpy(&v, p, sizeof v);
    return v;
  } else if constexpr (std::is_same<W, bfloat16>::value) {
    return (f32x8)(widen_u16(p) << 16);
  } else {
    i16x8 h;
    std::memcpy(&h, p, sizeof h);
    const f32x8 v = __builtin_ia32_vcvtph2ps256(h);
    return sel(((i32x8)v & 0x7fffffff) > 0x7f800000, (f32x8)splat(0x7fffffff), v);
  }
}

//! Decodes codes of W (in[0, n), no alignment needed) into out[0, n) as V (from_float<V> of
//! to_float), or adds them to fp32 accumulators (Sink::add). Sink::stream: out 16-byte aligned.
//! O(n).
template <class W, Sink S, class V>
QCOLL_AVX2 inline void decode_identity(const unsigned char* in, std::size_t n, V* out) {
  std::size_t i = 0;
  if constexpr (sizeof(W) == 2 && sizeof(V) == 2 && S != Sink::add) {
    for (; i + 16 <= n; i += 16) {
      __builtin_prefetch(in + sizeof(W) * i + stream_prefetch_ahead);
      i16x16 w;
      std::memcpy(&w, in + sizeof(W) * i, sizeof w);
      const i64x4 h = narrow_codes16<W, V>(w);
      if constexpr (S == Sink::stream) {
        stream32(out + i, h);
      } else {
        std::memcpy(out + i, &h, sizeof h);
      }
    }
  }
  for (; i + 16 <= n; i += 16) {
    __builtin_prefetch(in + sizeof(W) * i + stream_prefetch_ahead);
    emit<S>(out + i, load_codes<W>(in + sizeof(W) * i), load_codes<W>(in + sizeof(W) * (i + 8)));
  }
  for (; i < n; ++i) {
    W w;
    std::memcpy(&w, in + sizeof(W) * i, sizeof w);
    const float v = to_float(w);
    if constexpr (S == Sink::add) {
      out[i] = fp::add(out[i], v);
    } else {
      out[i] = from_float<V>(v);
    }
  }
}

}  // namespace avx2
}  // namespace detail
}  // namespace host
QCOLL_NAMESPACE_END
#endif  // QCOLL_HOST_AVX2_DISPATCH
