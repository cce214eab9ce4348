// Fused table-batched embedding kernels for CPU (ATen + OpenMP via at::parallel_for).
//
// Same arguments and results as tetrarec/kernels/reference.py (the oracle):
//   meta = [w_offsets, dims, num_rows, row_offsets, feat_table, feat_cols, feat_mean]
//   weights: flat row storage; table t, row r starts at element w_offsets[t] + r * width(t)
//   values (N,), offsets (F*B+1,) key-major bags; out / grad_out (B, sum of dims).
//
// Forward: one task per (feature, sample) bag, rows decoded to FP32 and summed in order.
// Backward: (row key, position) pairs are radix-sorted (stable, so duplicates of a row
// are summed in position order whatever the thread count: bitwise deterministic), then
// each unique row is decoded, updated by the optimizer rule and encoded in place.
// Row shares: the backward's sort and gradient sums for one table, reporting per touched
// row the sum of squares the row-wise rules use instead of updating (column-split tables).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "check.h"
#include "bf16_cpu.h"
#include "copy_cpu.h"
#include "interaction_cpu.h"
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

// ---- stochastic rounding randomness: counter-based, so thread count never matters ----
inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// 16 random bits per element of a row: a 32-bit counter-based hash of (row key, global
// column col0 + d), written so that the compiler vectorizes it (8 lanes with AVX2).
// reference.rounding_noise computes the same bits.
inline const uint16_t* random16(uint64_t key, int64_t D, int64_t col0) {
  thread_local std::vector<uint16_t> r;
  if (static_cast<int64_t>(r.size()) < D) r.resize(D);
  const uint32_t lo = static_cast<uint32_t>(key), hi = static_cast<uint32_t>(key >> 32);
  uint16_t* out = r.data();
  for (int64_t d = 0; d < D; ++d) {
    uint32_t z = lo + static_cast<uint32_t>(col0 + d) * 0x9E3779B9u;
    z ^= z >> 16;
    z *= 0x85EBCA6Bu;
    z ^= z >> 13;
    z *= 0xC2B2AE35u;
    z ^= z >> 16;
    out[d] = static_cast<uint16_t>((z ^ hi) >> 8);
  }
  return out;
}
inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Sixteen lanes (one AVX-512 register; GCC splits them where vectors are narrower).
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint8_t v8u8 __attribute__((vector_size(8)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
// Eight floats in one vector register (AVX2: a ymm; GCC splits it where vectors are
// narrower). Loads and stores go through memcpy: rows need not be 32-byte aligned.
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
inline v16f load16(const float* p) {
  v16f x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
template <typename To, typename From>
inline To bit_cast_vec(const From& x) {
  static_assert(sizeof(To) == sizeof(From));
  To y;
  std::memcpy(&y, &x, sizeof y);
  return y;
}

// Widening and narrowing lane conversions. GCC's __builtin_convertvector from 8- or
// 16-byte vectors (and to them) compiles to one scalar insert or extract per lane; the
// zero-extending loads and truncating stores below are one instruction each.
inline v8i widen_u8x8(const uint8_t* p) {
#if defined(__AVX2__)
  return bit_cast_vec<v8i>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  v8u8 q;
  std::memcpy(&q, p, sizeof q);
  return __builtin_convertvector(q, v8i);
#endif
}
inline v8i widen_u16x8(const uint16_t* p) {
#if defined(__AVX2__)
  return bit_cast_vec<v8i>(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  v8u16 q;
  std::memcpy(&q, p, sizeof q);
  return __builtin_convertvector(q, v8i);
#endif
}
inline v16i widen_u8x16(const uint8_t* p) {
#if defined(__AVX512F__)
  return bit_cast_vec<v16i>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  const v8i a = widen_u8x8(p), b = widen_u8x8(p + 8);
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}
inline v16i widen_u16x16(const uint16_t* p) {
#if defined(__AVX512F__)
  return bit_cast_vec<v16i>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
  const v8i a = widen_u16x8(p), b = widen_u16x8(p + 8);
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}
// The low byte (or half) of each lane, stored.
inline void store_low8x16(uint8_t* p, v16i x) {
#if defined(__AVX512F__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(bit_cast_vec<__m512i>(x)));
#else
  const v16u8 y = __builtin_convertvector(x, v16u8);
  std::memcpy(p, &y, sizeof y);
#endif
}
inline void store_low8x8(uint8_t* p, v8i x) {
#if defined(__AVX512F__) && defined(__AVX512VL__)
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm256_cvtepi32_epi8(bit_cast_vec<__m256i>(x)));
#else
  const v8u8 y = __builtin_convertvector(x, v8u8);
  std::memcpy(p, &y, sizeof y);
#endif
}
inline void store_low16x16(uint16_t* p, v16i x) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bit_cast_vec<__m512i>(x)));
#else
  const v16u16 y = __builtin_convertvector(x, v16u16);
  std::memcpy(p, &y, sizeof y);
#endif
}

// ---- half helpers ----
inline void half_to_float(const uint16_t* src, float* dst, int64_t n) {
  int64_t d = 0;
#if defined(__F16C__)
  for (; d + 8 <= n; d += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
    _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(h));
  }
#endif
  for (; d < n; ++d) dst[d] = static_cast<float>(c10::Half(src[d], c10::Half::from_bits()));
}
inline uint16_t half_bits(float x) { return c10::Half(x).x; }
inline float half_value(uint16_t b) {  // exact either way: F16C's is one instruction
#if defined(__F16C__)
  return _cvtsh_ss(b);
#else
  return static_cast<float>(c10::Half(b, c10::Half::from_bits()));
#endif
}
inline uint16_t bf16_bits(float x) { return c10::BFloat16(x).x; }

// FP16 bits of x rounded towards -inf / +inf (x within FP16's range). With F16C one
// instruction (its rounding-mode immediate); without, round to nearest and step once.
inline uint16_t half_bits_down(float x) {
#if defined(__F16C__)
  return _cvtss_sh(x, 1);  // 1: round down
#else
  uint16_t h = half_bits(x);
  if (half_value(h) > x) h = (h & 0x7FFFu) == 0 ? uint16_t(0x8001u) : (h & 0x8000u) ? uint16_t(h + 1) : uint16_t(h - 1);
  return h;
#endif
}
inline uint16_t half_bits_up(float x) {  // x >= 0
#if defined(__F16C__)
  return _cvtss_sh(x, 2);  // 2: round up
#else
  uint16_t h = half_bits(x);
  if (half_value(h) < x) h = uint16_t(h + 1);
  return h;
#endif
}

// The FP16 scale and bias of an integer row whose values span [lo, hi]: lo rounded down
// and the step (hi - bias) / levels rounded up, so that the grid bias + q * scale
// (q = 0..levels) covers the row. Rounded to nearest, a row's min or max could fall
// outside its grid and be clamped to the end code, and stochastic rounding of the codes
// was then biased there: a small update of the min or max, or of a row whose values are
// all equal (scale 0, the value in the bias alone), was doubled or lost. A row whose
// ends are FP16 values keeps them exactly. lo and hi saturate at +-65504 as FP16 rows do
// (past it the bias or scale would be inf and the row NaN). Every operation rounds once
// (the step multiplies by FP32(1 / levels)), so quant.py's quantize_rows computes the
// same bits; no branch on the data: the row's values wait for this on every encode.
struct IntGrid {
  uint16_t scale_bits, bias_bits;
  float scale, bias;
};
inline IntGrid int_row_grid(float lo, float hi, float levels) {
  lo = std::min(std::max(lo, -65504.0f), 65504.0f);
  hi = std::min(std::max(hi, -65504.0f), 65504.0f);
  const uint16_t b = half_bits_down(lo);
  const float bv = half_value(b);
  const float step = static_cast<float>(1.0 / static_cast<double>(levels));
  const uint16_t s = half_bits_up(std::max((hi - bv) * step, 0.0f));
  return {s, b, half_value(s), bv};
}

// FP16 stochastic rounding from 16 random bits r, as the F16C path of F16::store computes
// it (and reference.py's stochastic_round): add r's low 13 bits below FP16's last mantissa
// bit and truncate, saturating at +-65504; below 2^-14 (FP16's subnormals, spacing 2^-24)
// floor(|x| 2^24 + (r + 1/2) / 2^16) 2^-24. Non-finite values stay as they are.
inline uint16_t half_stochastic(float x, uint16_t r) {
  if (!std::isfinite(x)) return half_bits(x);
  const float a = std::fabs(x);
  if (a < 6.103515625e-05f) {
    const float u = (static_cast<float>(r) + 0.5f) * (1.0f / 65536.0f);
    return half_bits(std::copysign(std::floor(a * 16777216.0f + u) * 5.9604644775390625e-08f, x));
  }
  float t = float_of((bits_of(x) + (r & 0x1FFFu)) & 0xFFFFE000u);
  if (std::fabs(t) > 65504.0f) t = std::copysign(65504.0f, x);
  return half_bits(t);  // exact: t is an FP16 value
}

#if defined(__F16C__)
// The 8 values that F16::store's stochastic rounding truncates to FP16, lane-wise (r16:
// each value's 16 random bits): in the normal range x plus r's low 13 bits below FP16's
// last mantissa bit; below 2^-14 floor(|x| 2^24 + (r + 1/2) / 2^16) 2^-24 with x's sign
// (the floor of a value in [0, 2^10 + 1) is its truncation); non-finite x as it is.
// half_stochastic's operations, every case computed in every lane, each lane's selected.
inline v8f half_noisy8(v8f x, v8u16 r16) {
  v8u32 u;
  std::memcpy(&u, &x, sizeof u);
  const v8u32 au = u & 0x7FFFFFFFu;
  v8f a;
  std::memcpy(&a, &au, sizeof a);
  const v8u32 r = bit_cast_vec<v8u32>(widen_u16x8(reinterpret_cast<const uint16_t*>(&r16)));
  const v8f ur = (__builtin_convertvector(__builtin_convertvector(r, v8i), v8f) + 0.5f) * (1.0f / 65536.0f);
  const v8f t = __builtin_convertvector(__builtin_convertvector(a * 16777216.0f + ur, v8i), v8f);
  const v8f mag = t * 5.9604644775390625e-08f;
  v8u32 sub;
  std::memcpy(&sub, &mag, sizeof sub);
  sub = (sub & 0x7FFFFFFFu) | (u & 0x80000000u);
  const v8u32 nrm = u + (r & 0x1FFFu);
  const v8i finite = (u & 0x7F800000u) != 0x7F800000u;
  const v8i small = a < 6.103515625e-05f;
  const v8u32 out = finite ? (small ? sub : nrm) : u;
  v8f y;
  std::memcpy(&y, &out, sizeof y);
  return y;
}
#endif

// ---- row codecs: decode a row to FP32 (or accumulate it) and encode it back ----
struct F32 {
  static constexpr int64_t kElem = 4;
  static int64_t width(int64_t D) { return D; }
  static void accum(const uint8_t* r, int64_t D, float w, float* acc, float*) {
    const float* p = reinterpret_cast<const float*>(r);
    for (int64_t d = 0; d < D; ++d) acc[d] += w * p[d];
  }
  static void load(const uint8_t* r, int64_t D, float* dst) { std::memcpy(dst, r, D * 4); }
  static void store(uint8_t* r, int64_t D, const float* src, bool, uint64_t, int64_t) {
    std::memcpy(r, src, D * 4);
  }
};

struct F16 {
  static constexpr int64_t kElem = 2;
  static int64_t width(int64_t D) { return D; }
  static void load(const uint8_t* r, int64_t D, float* dst) {
    half_to_float(reinterpret_cast<const uint16_t*>(r), dst, D);
  }
  static void accum(const uint8_t* r, int64_t D, float w, float* acc, float* tmp) {
    load(r, D, tmp);
    for (int64_t d = 0; d < D; ++d) acc[d] += w * tmp[d];
  }
  static void store(uint8_t* r, int64_t D, const float* src, bool sr, uint64_t key, int64_t col0) {
    uint16_t* p = reinterpret_cast<uint16_t*>(r);
    int64_t d = 0;
#if defined(__F16C__)
    if (!sr) {
      for (; d + 8 <= D; d += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p + d),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
    } else {
      // Normal FP16 range: add 13 random bits below FP16's last mantissa bit, then
      // truncate (round toward zero). Subnormal range (|x| < 2^-14, fixed spacing
      // 2^-24): floor(|x| * 2^24 + u) * 2^-24, which FP16 holds exactly. Both unbiased.
      // The tail of a row that is not a multiple of 8 goes through the same 8 lanes
      // (zero-padded), so an element rounds the same wherever it sits in the row: a
      // column block of a table rounds exactly as the whole table does.
      const uint16_t* rnd = random16(key, D, col0);
      for (; d < D; d += 8) {
        const int n = static_cast<int>(std::min<int64_t>(8, D - d));
        v8f x = {};
        v8u16 r16 = {};
        if (n == 8) {  // a full 8: plain loads (through a copy of n, the loads stalled)
          std::memcpy(&x, src + d, sizeof x);
          std::memcpy(&r16, rnd + d, sizeof r16);
        } else {
          std::memcpy(&x, src + d, n * sizeof(float));
          std::memcpy(&r16, rnd + d, n * sizeof(uint16_t));
        }
        const v8f noisy = half_noisy8(x, r16);
        __m256 nv;
        std::memcpy(&nv, &noisy, sizeof nv);
        const __m128i h = _mm256_cvtps_ph(nv, _MM_FROUND_TO_ZERO);
        if (n == 8) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(p + d), h);
        } else {
          alignas(16) uint16_t lanes[8];
          _mm_store_si128(reinterpret_cast<__m128i*>(lanes), h);
          std::memcpy(p + d, lanes, n * sizeof(uint16_t));
        }
      }
    }
#endif
    // Without F16C: the same rule, one element at a time (the same bits).
    const uint16_t* rnd = sr && d < D ? random16(key, D, col0) : nullptr;
    for (; d < D; ++d) p[d] = sr ? half_stochastic(src[d], rnd[d]) : half_bits(src[d]);
  }
};

struct BF16 {
  static constexpr int64_t kElem = 2;
  static int64_t width(int64_t D) { return D; }
  static void load(const uint8_t* r, int64_t D, float* dst) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(r);
    uint32_t* o = reinterpret_cast<uint32_t*>(dst);
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<uint32_t>(p[d]) << 16;
  }
  static void accum(const uint8_t* r, int64_t D, float w, float* acc, float* tmp) {
    load(r, D, tmp);
    for (int64_t d = 0; d < D; ++d) acc[d] += w * tmp[d];
  }
  static void store(uint8_t* r, int64_t D, const float* src, bool sr, uint64_t key, int64_t col0) {
    uint16_t* p = reinterpret_cast<uint16_t*>(r);
    // Round to nearest even as c10::BFloat16 does (a NaN becomes 0x7FC0); stochastic:
    // add 16 random bits below BF16's last mantissa bit and truncate (unbiased), a
    // non-finite value rounded to nearest. 16 lanes at a time, then the tail.
    const uint16_t* rnd = sr ? random16(key, D, col0) : nullptr;
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      v16u32 u;
      std::memcpy(&u, src + d, sizeof u);
      const v16i nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
      v16u32 o = nan ? v16u32{} + 0x7FC0u : (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
      if (sr) {
        const v16u32 rb = bit_cast_vec<v16u32>(widen_u16x16(rnd + d));
        const v16i finite = (u & 0x7F800000u) != 0x7F800000u;
        o = finite ? (u + rb) >> 16 : o;
      }
      store_low16x16(p + d, bit_cast_vec<v16i>(o));
    }
    for (; d < D; ++d) {
      const uint32_t u = bits_of(src[d]);
      const bool finite = (u & 0x7F800000u) != 0x7F800000u;
      p[d] = sr && finite ? static_cast<uint16_t>((u + rnd[d]) >> 16) : bf16_bits(src[d]);
    }
  }
};


// The smallest and largest of src[0, D) as the sequential loop lo = std::min(lo, x),
// hi = std::max(hi, x) from src[0] finds them: a NaN is never taken (unless src[0] is
// one), and of equal values the first is kept, which only matters for the sign of a
// zero. 16 lanes at once (a lane takes x only when strictly smaller or larger: the same
// rule), then the sequential loop again in the two cases where lanes could differ from
// it: src[0] a NaN, or an end that is zero (+0 or -0: the first one in the row).
inline void min_max16(const float* src, int64_t D, float* lo_out, float* hi_out) {
  float lo = src[0], hi = src[0];
  int64_t d = 1;
  if (D >= 32 && lo == lo) {
    v16f vlo = v16f{} + lo, vhi = vlo;
    for (d = 0; d + 16 <= D; d += 16) {
      const v16f x = load16(src + d);
      vlo = x < vlo ? x : vlo;
      vhi = vhi < x ? x : vhi;
    }
    // Halves folded onto each other (4 steps, not a chain of 16): every lane is a
    // number, so the order changes no value (a zero's sign is settled below).
    v8f l8 = __builtin_shufflevector(vlo, vlo, 0, 1, 2, 3, 4, 5, 6, 7);
    v8f h8 = __builtin_shufflevector(vhi, vhi, 0, 1, 2, 3, 4, 5, 6, 7);
    const v8f l8b = __builtin_shufflevector(vlo, vlo, 8, 9, 10, 11, 12, 13, 14, 15);
    const v8f h8b = __builtin_shufflevector(vhi, vhi, 8, 9, 10, 11, 12, 13, 14, 15);
    l8 = l8b < l8 ? l8b : l8;
    h8 = h8 < h8b ? h8b : h8;
    v4f l4 = __builtin_shufflevector(l8, l8, 0, 1, 2, 3), h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3);
    const v4f l4b = __builtin_shufflevector(l8, l8, 4, 5, 6, 7);
    const v4f h4b = __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
    l4 = l4b < l4 ? l4b : l4;
    h4 = h4 < h4b ? h4b : h4;
    lo = std::min(std::min(l4[0], l4[1]), std::min(l4[2], l4[3]));
    hi = std::max(std::max(h4[0], h4[1]), std::max(h4[2], h4[3]));
  }
  for (; d < D; ++d) {
    lo = std::min(lo, src[d]);
    hi = std::max(hi, src[d]);
  }
  if (D >= 32 && (lo == 0.0f || hi == 0.0f || src[0] != src[0])) {
    lo = hi = src[0];
    for (d = 1; d < D; ++d) {
      lo = std::min(lo, src[d]);
      hi = std::max(hi, src[d]);
    }
  }
  *lo_out = lo;
  *hi_out = hi;
}

// Row-wise affine integer rows: [packed codes | fp16 scale | fp16 bias | pad].
template <int Bits>
struct IntRow {
  static constexpr int64_t kElem = 1;
  static constexpr int kLevels = (1 << Bits) - 1;
  static int64_t payload(int64_t D) { return (D * Bits + 7) / 8; }
  static int64_t width(int64_t D) { return (payload(D) + 4 + 3) / 4 * 4; }
  static void tail(const uint8_t* r, int64_t D, float* scale, float* bias) {
    uint16_t sb[2];
    std::memcpy(sb, r + payload(D), 4);
    *scale = half_value(sb[0]);
    *bias = half_value(sb[1]);
  }
  static int code(const uint8_t* r, int64_t d) {
    if (Bits == 8) return r[d];
    return (r[d >> 1] >> ((d & 1) * 4)) & 0x0F;
  }
  // 16 codes a register (INT4: two words of 8 nibbles), then the tail one at a time:
  // code * scale, then + bias, in both.
  static void load(const uint8_t* r, int64_t D, float* dst) {
    float s, b;
    tail(r, D, &s, &b);
    const v16f vs = v16f{} + s, vb = v16f{} + b;
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      v16f x;
      if (Bits == 8) {
        x = __builtin_convertvector(widen_u8x16(r + d), v16f);
      } else {
        uint32_t w[2];
        std::memcpy(w, r + d / 2, sizeof w);
        const v8u32 sh = {0, 4, 8, 12, 16, 20, 24, 28};
        const v8u32 a = ((v8u32{} + w[0]) >> sh) & 0x0Fu, c = ((v8u32{} + w[1]) >> sh) & 0x0Fu;
        const v16u32 q =
            __builtin_shufflevector(a, c, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        x = __builtin_convertvector(__builtin_convertvector(q, v16i), v16f);
      }
      const v16f y = x * vs + vb;
      std::memcpy(dst + d, &y, sizeof y);
    }
    for (; d < D; ++d) dst[d] = static_cast<float>(code(r, d)) * s + b;
  }
  static void accum(const uint8_t* r, int64_t D, float w, float* acc, float* tmp) {
    load(r, D, tmp);
    for (int64_t d = 0; d < D; ++d) acc[d] += w * tmp[d];
  }
  static void store(uint8_t* r, int64_t D, const float* src, bool sr, uint64_t key, int64_t col0) {
    float lo, hi;
    min_max16(src, D, &lo, &hi);
    const IntGrid grid = int_row_grid(lo, hi, static_cast<float>(kLevels));
    const uint16_t sb[2] = {grid.scale_bits, grid.bias_bits};
    const float s = grid.scale, b = grid.bias;
    const float inv = s > 0 ? 1.0f / s : 0.0f, top = static_cast<float>(kLevels);
    std::memset(r, 0, width(D));
    const uint16_t* rnd = sr ? random16(key, D, col0) : nullptr;
    // code = clamp(q, 0, levels) rounded: floor(q + u) (stochastic) or nearbyint(q), then
    // clamped, as the portable path computes it. Clamping first gives the same codes (the
    // ends are integers, and both roundings are monotone), after which floor is the
    // truncation of a value >= 0 and nearbyint is (x + 2^23) - 2^23: 16 lanes at a time,
    // without a rounding instruction per element. A NaN stays NaN through the clamp and
    // truncates to code 0 either way.
    int64_t d = 0;
    const v16f vb = v16f{} + b, vinv = v16f{} + inv, vtop = v16f{} + top, vzero = v16f{};
    for (; d + 16 <= D; d += 16) {
      v16f q = (load16(src + d) - vb) * vinv;
      if (sr) {
        q = q + (__builtin_convertvector(widen_u16x16(rnd + d), v16f) + 0.5f) * (1.0f / 65536.0f);
      }
      q = q < vzero ? vzero : q;
      q = vtop < q ? vtop : q;
      if (!sr) q = (q + 8388608.0f) - 8388608.0f;
      const v16i c = __builtin_convertvector(q, v16i);
      if (Bits == 8) {
        store_low8x16(r + d, c);
      } else {
        const v8i lo4 = __builtin_shufflevector(c, c, 0, 2, 4, 6, 8, 10, 12, 14);
        const v8i hi4 = __builtin_shufflevector(c, c, 1, 3, 5, 7, 9, 11, 13, 15);
        store_low8x8(r + d / 2, (lo4 & 0x0F) | (hi4 << 4));
      }
    }
    for (; d < D; ++d) {  // the same operations, one element at a time
      float q = (src[d] - b) * inv;
      if (sr) q = q + (static_cast<float>(rnd[d]) + 0.5f) * (1.0f / 65536.0f);
      q = q < 0.0f ? 0.0f : q;
      q = top < q ? top : q;
      if (!sr) q = (q + 8388608.0f) - 8388608.0f;
      const int c = static_cast<int>(q);
      if (Bits == 8) {
        r[d] = static_cast<uint8_t>(c);
      } else {
        r[d >> 1] |= static_cast<uint8_t>((c & 0x0F) << ((d & 1) * 4));
      }
    }
    std::memcpy(r + payload(D), sb, 4);
  }
};

struct Meta {
  const int64_t *w_off, *dims, *rows, *row_off, *feat_table, *feat_cols, *feat_mean;
  const int64_t *row_keys, *col_starts;  // stochastic rounding: global row key, column
  int64_t T, F, max_dim;
};

Meta read_meta(const std::vector<at::Tensor>& meta) {
  TETRAREC_CHECK(meta.size() == 9, "tetrarec tbe: meta needs 9 tensors, got ", meta.size());
  for (const auto& m : meta) {
    TETRAREC_CHECK(m.scalar_type() == at::kLong && m.is_contiguous() && m.device().is_cpu(),
                "tetrarec tbe: meta tensors must be contiguous int64 on CPU");
  }
  Meta M{meta[0].data_ptr<int64_t>(), meta[1].data_ptr<int64_t>(), meta[2].data_ptr<int64_t>(),
         meta[3].data_ptr<int64_t>(), meta[4].data_ptr<int64_t>(), meta[5].data_ptr<int64_t>(),
         meta[6].data_ptr<int64_t>(), meta[7].data_ptr<int64_t>(), meta[8].data_ptr<int64_t>(),
         meta[0].numel(), meta[4].numel(), 1};
  for (int64_t t = 0; t < M.T; ++t) M.max_dim = std::max(M.max_dim, M.dims[t]);
  return M;
}

// Ask Linux to back [p, p + bytes) with 2 MiB pages (its 2 MiB-aligned interior) before it
// is first written. For the large buffers the kernels write or read at random (a fresh
// output of tens of MiB, the gathered gradients, the sort keys) 4 KiB pages cost a page
// fault per 4 KiB on first touch and a TLB miss per random read: at batch 8192 x 26
// features x dim 64 (a 54 MB output) the faults were 2/3 of the forward's time here.
// No effect on memory already touched; TETRAREC_HUGE_PAGES=0 turns it off, as for the
// tables (kernels/memory.py).
constexpr uintptr_t kHugePage = uintptr_t(2) << 20;
inline void advise_huge_pages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  static const bool enabled = [] {
    const char* e = std::getenv("TETRAREC_HUGE_PAGES");
    return e == nullptr || std::strcmp(e, "0") != 0;
  }();
  if (!enabled || bytes < 4 * kHugePage) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

// A growable scratch array (no copy, no initialization on growth) whose large
// allocations are 2 MiB-aligned and advised onto huge pages before first touch.
template <typename T>
class HugeArray {
 public:
  HugeArray() = default;
  HugeArray(const HugeArray&) = delete;
  HugeArray& operator=(const HugeArray&) = delete;
  ~HugeArray() { std::free(ptr_); }
  size_t size() const { return size_; }
  T* data() const { return ptr_; }
  void resize(size_t n) {  // grows only; the contents are not kept
    if (n <= size_) return;
    std::free(ptr_);
    const size_t bytes = n * sizeof(T);
    const size_t align = bytes >= 4 * kHugePage ? kHugePage : 64;
    ptr_ = static_cast<T*>(std::aligned_alloc(align, (bytes + align - 1) / align * align));
    TETRAREC_CHECK(ptr_ != nullptr, "tetrarec tbe: out of memory for ", bytes, " bytes of scratch");
    advise_huge_pages(ptr_, bytes);
    size_ = n;
  }

 private:
  T* ptr_ = nullptr;
  size_t size_ = 0;
};

inline void prefetch_row(const uint8_t* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

// Exclusive prefix sum of the bag lengths: (F*B+1,) offsets. Serial: cheap next to the
// lookups, and it avoids a parallel region per call.
inline void offsets_into(const at::Tensor& lengths, std::vector<int64_t>* out) {
  TETRAREC_CHECK(lengths.is_contiguous(), "tetrarec tbe: lengths must be contiguous");
  std::vector<int64_t>& off = *out;
  off.resize(lengths.numel() + 1);
  off[0] = 0;
  int64_t negative_at = -1;  // a negative length would make a bag start past its end
  AT_DISPATCH_INDEX_TYPES(lengths.scalar_type(), "tbe_offsets", [&] {
    const index_t* l = lengths.data_ptr<index_t>();
    index_t smallest = 0;
    for (int64_t i = 0; i < lengths.numel(); ++i) {
      off[i + 1] = off[i] + static_cast<int64_t>(l[i]);
      smallest = std::min(smallest, l[i]);
    }
    if (smallest < 0) {
      for (int64_t i = 0; i < lengths.numel() && negative_at < 0; ++i) {
        if (l[i] < 0) negative_at = i;
      }
    }
  });
  TETRAREC_CHECK(negative_at < 0, "tetrarec tbe: bag length ", negative_at, " is ",
                 negative_at >= 0 ? off[negative_at + 1] - off[negative_at] : 0,
                 " (lengths must be >= 0)");
}
inline std::vector<int64_t> offsets_of(const at::Tensor& lengths) {
  std::vector<int64_t> off;
  offsets_into(lengths, &off);
  return off;
}

// The batch against the store's layout, checked before any read: without it lengths of
// another batch size, a gradient or output narrower than the store's columns, or lengths
// that add up to more ids than `values` (or its per-id weights) holds, are read past
// their ends. `B` and `width` are the rows and columns of `what` (the output or the
// gradient); `offsets` are the lengths' prefix sums (one more than the lengths).
inline void check_batch(const Meta& M, const char* where, const char* what, int64_t B,
                        int64_t width, const std::vector<int64_t>& offsets,
                        const at::Tensor& values, const c10::optional<at::Tensor>& psw) {
  const int64_t n_lengths = static_cast<int64_t>(offsets.size()) - 1;
  TETRAREC_CHECK(n_lengths == M.F * B, "tetrarec tbe ", where, ": lengths must have F*B = ", M.F,
              "*", B, " entries, got ", n_lengths);
  int64_t cols = 0;
  for (int64_t f = 0; f < M.F; ++f) {
    if (M.feat_table[f] >= 0) cols = std::max(cols, M.feat_cols[f] + M.dims[M.feat_table[f]]);
  }
  TETRAREC_CHECK(width >= cols, "tetrarec tbe ", where, ": ", what, " has ", width,
              " columns, the features need ", cols);
  const int64_t ids = offsets.back();
  TETRAREC_CHECK(ids == values.numel(), "tetrarec tbe ", where, ": the lengths add up to ", ids,
              " ids, values holds ", values.numel());
  if (psw.has_value()) {
    TETRAREC_CHECK(ids == psw->numel(), "tetrarec tbe ", where, ": the lengths add up to ", ids,
                " ids, the per-id weights hold ", psw->numel());
  }
}

constexpr int64_t kAhead = 8;  // unique rows prefetched ahead in backward

// Rows prefetched ahead in a feature's id stream: about 4 KiB of rows in flight, so
// that the random row reads overlap (one row at a time waits a full memory latency
// each). 16 rows of 256 B (FP32, D=64); 6 to 24 rows for other sizes.
inline int64_t prefetch_distance(int64_t row_bytes) {
  return std::min<int64_t>(24, std::max<int64_t>(6, 4096 / std::max<int64_t>(row_bytes, 1)));
}

inline v8f load8(const float* p) {
  v8f x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
inline void store8(float* p, v8f x) { std::memcpy(p, &x, sizeof x); }

// Where a forward bag's ids are and what to do with them (see forward_impl).
template <typename Idx>
struct BagScan {
  const Idx* values;
  const float* psw;
  int64_t rows, ahead, j_end, f;
  bool check;
  int64_t* bad;
  void record_bad(int64_t id) const {
#pragma omp critical
    if (bad[0] < 0 || f < bad[0] || (f == bad[0] && id < bad[1])) {
      bad[0] = f;
      bad[1] = id;
    }
  }
};

// Readers of eight FP32 values of a row at a time, for the register path below: `open`
// takes what a row holds besides its values (an integer row's scale and bias) once per
// row, `get` decodes columns [c, c + 8) with the same operations as the codec's `load`
// (an integer code: code * scale, then + bias), so both paths give the same bits.
struct F32Lanes {
  struct Row {
    const float* p;
  };
  static Row open(const uint8_t* r, int64_t) { return {reinterpret_cast<const float*>(r)}; }
  static v8f get(const Row& row, int64_t c) { return load8(row.p + c); }
};

struct Int8Lanes {
  struct Row {
    const uint8_t* p;
    v8f scale, bias;
  };
  static Row open(const uint8_t* r, int64_t D) {
    float s, b;
    IntRow<8>::tail(r, D, &s, &b);
    return {r, v8f{} + s, v8f{} + b};
  }
  static v8f get(const Row& row, int64_t c) {
    return __builtin_convertvector(widen_u8x8(row.p + c), v8f) * row.scale + row.bias;
  }
};

// INT4: two codes a byte, the low nibble first.
struct Int4Lanes {
  struct Row {
    const uint8_t* p;
    v8f scale, bias;
  };
  static Row open(const uint8_t* r, int64_t D) {
    float s, b;
    IntRow<4>::tail(r, D, &s, &b);
    return {r, v8f{} + s, v8f{} + b};
  }
  static v8f get(const Row& row, int64_t c) {
    uint32_t p;  // eight codes; code k in bits [4k, 4k + 4) (little-endian)
    std::memcpy(&p, row.p + c / 2, sizeof p);  // c is a multiple of 8
    const v8u32 q = ((v8u32{} + p) >> v8u32{0, 4, 8, 12, 16, 20, 24, 28}) & 0x0Fu;
    return __builtin_convertvector(__builtin_convertvector(q, v8i), v8f) * row.scale + row.bias;
  }
};

// BF16: the top half of an FP32 (exact).
struct BF16Lanes {
  struct Row {
    const uint16_t* p;
  };
  static Row open(const uint8_t* r, int64_t) { return {reinterpret_cast<const uint16_t*>(r)}; }
  static v8f get(const Row& row, int64_t c) {
    const v8u32 u = bit_cast_vec<v8u32>(widen_u16x8(row.p + c)) << 16;
    v8f x;
    std::memcpy(&x, &u, sizeof x);
    return x;
  }
};

#if defined(__F16C__)
// FP16: F16C's conversion (exact, as half_to_float's).
struct F16Lanes {
  struct Row {
    const uint16_t* p;
  };
  static Row open(const uint8_t* r, int64_t) { return {reinterpret_cast<const uint16_t*>(r)}; }
  static v8f get(const Row& row, int64_t c) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row.p + c)));
    v8f out;
    std::memcpy(&out, &x, sizeof out);
    return out;
  }
};
#endif

// Columns [d0, d0 + 8 NV) of one bag summed in NV vector registers, in id order (0,
// then + w * row per id, then / L for mean pooling: the portable path's operations),
// then stored once. Summing in the output row instead made every add wait for the
// output line's fetch; registers also save a load and a store per id and vector. The
// first chunk of a row (d0 == 0) prefetches ahead and records bad ids. Every row format
// whose dim is a multiple of 8 (INT8 took 2.7x FP32's time per lookup at pooling 1
// through the generic sum_bag, FP16 2.4x; measured in benchmarks/results).
template <int NV, class Lanes, typename Idx>
inline void sum_chunk(const BagScan<Idx>& S, const uint8_t* table, int64_t D, int64_t bytes,
                      int64_t j0, int64_t j1, int64_t d0, float mean_L, float* o) {
  v8f acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = v8f{};
  for (int64_t j = j0; j < j1; ++j) {
    if (d0 == 0 && j + S.ahead < S.j_end) {
      const int64_t next = static_cast<int64_t>(S.values[j + S.ahead]);
      if (next >= 0 && next < S.rows) prefetch_row(table + next * bytes, bytes);
    }
    const int64_t id = static_cast<int64_t>(S.values[j]);
    if (id < 0 || id >= S.rows) {
      if (d0 == 0 && S.check) S.record_bad(id);
      continue;
    }
    const typename Lanes::Row row = Lanes::open(table + id * bytes, D);
    const float w = S.psw ? S.psw[j] : 1.0f;
    for (int v = 0; v < NV; ++v) acc[v] += w * Lanes::get(row, d0 + 8 * v);
  }
  if (mean_L > 0.0f)
    for (int v = 0; v < NV; ++v) acc[v] = acc[v] / mean_L;
  for (int v = 0; v < NV; ++v) store8(o + d0 + 8 * v, acc[v]);
}

template <class Lanes, typename Idx>
inline void sum_lanes_bag(const BagScan<Idx>& S, const uint8_t* table, int64_t D, int64_t bytes,
                          int64_t j0, int64_t j1, float mean_L, float* o) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    switch (std::min<int64_t>(64, D - d0) / 8) {
      case 8: sum_chunk<8, Lanes>(S, table, D, bytes, j0, j1, d0, mean_L, o); break;
      case 7: sum_chunk<7, Lanes>(S, table, D, bytes, j0, j1, d0, mean_L, o); break;
      case 6: sum_chunk<6, Lanes>(S, table, D, bytes, j0, j1, d0, mean_L, o); break;
      case 5: sum_chunk<5, Lanes>(S, table, D, bytes, j0, j1, d0, mean_L, o); break;
      case 4: sum_chunk<4, Lanes>(S, table, D, bytes, j0, j1, d0, mean_L, o); break;
      case 3: sum_chunk<3, Lanes>(S, table, D, bytes, j0, j1, d0, mean_L, o); break;
      case 2: sum_chunk<2, Lanes>(S, table, D, bytes, j0, j1, d0, mean_L, o); break;
      default: sum_chunk<1, Lanes>(S, table, D, bytes, j0, j1, d0, mean_L, o); break;
    }
  }
}

// The register path's reader of a codec's rows (none: the generic sum_bag).
template <class Codec>
struct LanesOf {
  using type = void;
};
template <>
struct LanesOf<F32> {
  using type = F32Lanes;
};
template <>
struct LanesOf<IntRow<8>> {
  using type = Int8Lanes;
};
template <>
struct LanesOf<IntRow<4>> {
  using type = Int4Lanes;
};
template <>
struct LanesOf<BF16> {
  using type = BF16Lanes;
};
#if defined(__F16C__)
template <>
struct LanesOf<F16> {
  using type = F16Lanes;
};
#endif

// One-column rows (a first-order term's tables): the generic sum_bag's operations on a
// scalar, without its per-bag fills and copies (they were most of a dim-1 lookup).
template <class Codec, typename Idx>
inline void sum_scalar_bag(const BagScan<Idx>& S, const uint8_t* table, int64_t bytes,
                           int64_t j0, int64_t j1, float mean_L, float* o) {
  float acc = 0.0f;
  for (int64_t j = j0; j < j1; ++j) {
    if (j + S.ahead < S.j_end) {
      const int64_t next = static_cast<int64_t>(S.values[j + S.ahead]);
      if (next >= 0 && next < S.rows) __builtin_prefetch(table + next * bytes);
    }
    const int64_t id = static_cast<int64_t>(S.values[j]);
    if (id < 0 || id >= S.rows) {
      if (S.check) S.record_bad(id);
      continue;
    }
    float x;
    Codec::load(table + id * bytes, 1, &x);
    acc += (S.psw ? S.psw[j] : 1.0f) * x;
  }
  o[0] = mean_L > 0.0f ? acc / mean_L : acc;
}

// Any row format: decode each row and sum it into acc (L1-resident), then write the
// output row once.
template <class Codec, typename Idx>
inline void sum_bag(const BagScan<Idx>& S, const uint8_t* table, int64_t D, int64_t bytes,
                    int64_t j0, int64_t j1, float mean_L, float* acc, float* tmp, float* o) {
  std::fill(acc, acc + D, 0.0f);
  for (int64_t j = j0; j < j1; ++j) {
    if (j + S.ahead < S.j_end) {
      const int64_t next = static_cast<int64_t>(S.values[j + S.ahead]);
      if (next >= 0 && next < S.rows) prefetch_row(table + next * bytes, bytes);
    }
    const int64_t id = static_cast<int64_t>(S.values[j]);
    if (id < 0 || id >= S.rows) {
      if (S.check) S.record_bad(id);
      continue;
    }
    Codec::accum(table + id * bytes, D, S.psw ? S.psw[j] : 1.0f, acc, tmp);
  }
  if (mean_L > 0.0f) {
    for (int64_t d = 0; d < D; ++d) o[d] = acc[d] / mean_L;
  } else {
    for (int64_t d = 0; d < D; ++d) o[d] = acc[d];
  }
}

// Pooled lookup. Each thread takes a range of bags s = f * B + b (key-major, so one
// feature's bags, and their ids, are contiguous) and walks it feature by feature: the
// table, dim and row size are fixed within a feature, and the row of the id `ahead`
// positions later in the feature's id stream is prefetched whatever the bag sizes. An
// id outside its table is skipped (and reported when `check`).
template <class Codec, typename Idx>
void forward_impl(const at::Tensor& weights, const Meta& M, const Idx* values,
                  const int64_t* offsets, const float* psw, float* out, int64_t B, int64_t ld,
                  bool check, int64_t* bad) {
  const uint8_t* base = reinterpret_cast<const uint8_t*>(weights.data_ptr());
  at::parallel_for(0, M.F * B, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M.max_dim), tmp(M.max_dim);
    for (int64_t f = begin / B; f * B < end; ++f) {
      const int64_t t = M.feat_table[f];
      if (t < 0) continue;  // a feature of another row store
      const int64_t s0 = std::max(begin, f * B), s1 = std::min(end, (f + 1) * B);
      const int64_t D = M.dims[t], bytes = Codec::width(D) * Codec::kElem;
      const uint8_t* table = base + M.w_off[t] * Codec::kElem;
      const BagScan<Idx> S{values, psw, M.rows[t], prefetch_distance(bytes), offsets[s1], f,
                           check, bad};
      for (int64_t j = offsets[s0]; j < std::min(S.j_end, offsets[s0] + S.ahead); ++j) {
        const int64_t id = static_cast<int64_t>(values[j]);
        if (id >= 0 && id < S.rows) prefetch_row(table + id * bytes, bytes);
      }
      using Lanes = typename LanesOf<Codec>::type;
      // The register path for FP32 rows, and for narrow rows of the other formats: at
      // dim 64 the compiler's 16-wide decode into L1 then sum (sum_bag) measured faster.
      const bool lanes = !std::is_void_v<Lanes> && D % 8 == 0 &&
                         (!std::is_same_v<Codec, IntRow<8>> || D <= 32);
      float* out_f = out + M.feat_cols[f];
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t j0 = offsets[s], j1 = offsets[s + 1];
        const float mean_L = M.feat_mean[f] && j1 > j0 ? static_cast<float>(j1 - j0) : 0.0f;
        float* o = out_f + (s - f * B) * ld;
        if constexpr (!std::is_void_v<Lanes>) {
          if (lanes) {
            sum_lanes_bag<Lanes>(S, table, D, bytes, j0, j1, mean_L, o);
            continue;
          }
        }
        if (D == 1) {
          sum_scalar_bag<Codec>(S, table, bytes, j0, j1, mean_L, o);
        } else {
          sum_bag<Codec>(S, table, D, bytes, j0, j1, mean_L, acc.data(), tmp.data(), o);
        }
      }
    }
  });
}

}  // namespace

#include "tbe_cpu_backward.h"

namespace {

template <typename Fn>
void dispatch_codec(const at::Tensor& weights, const std::string& precision, Fn&& fn) {
  if (precision == "fp32") {
    TETRAREC_CHECK(weights.scalar_type() == at::kFloat,
                "tetrarec tbe: fp32 rows need float32 storage, got ", weights.scalar_type());
    fn(F32{});
  } else if (precision == "fp16") {
    TETRAREC_CHECK(weights.scalar_type() == at::kHalf,
                "tetrarec tbe: fp16 rows need float16 storage, got ", weights.scalar_type());
    fn(F16{});
  } else if (precision == "bf16") {
    TETRAREC_CHECK(weights.scalar_type() == at::kBFloat16,
                "tetrarec tbe: bf16 rows need bfloat16 storage, got ", weights.scalar_type());
    fn(BF16{});
  } else if (precision == "int8") {
    TETRAREC_CHECK(weights.scalar_type() == at::kByte,
                "tetrarec tbe: int8 rows need uint8 storage, got ", weights.scalar_type());
    fn(IntRow<8>{});
  } else if (precision == "int4") {
    TETRAREC_CHECK(weights.scalar_type() == at::kByte,
                "tetrarec tbe: int4 rows need uint8 storage, got ", weights.scalar_type());
    fn(IntRow<4>{});
  } else {
    TETRAREC_CHECK(false, "tetrarec tbe: unsupported row precision ", precision);
  }
}

at::Tensor tbe_forward(const at::Tensor& weights, const std::vector<at::Tensor>& meta,
                       const at::Tensor& values, const at::Tensor& lengths,
                       const c10::optional<at::Tensor>& psw, at::Tensor& out,
                       const std::string& precision, bool check) {
  const Meta M = read_meta(meta);
  TETRAREC_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.dim() == 2,
              "tetrarec tbe forward: out must be a contiguous 2-D float32 tensor, got ",
              out.dim(), "-D ", out.scalar_type());
  TETRAREC_CHECK(weights.is_contiguous() && values.is_contiguous(),
              "tetrarec tbe forward: weights and values must be contiguous");
  const int64_t B = out.size(0);
  const std::vector<int64_t> offsets = offsets_of(lengths);
  check_batch(M, "forward", "out", B, out.size(1), offsets, values, psw);
  const float* psw_p = nullptr;
  at::Tensor psw_c;
  if (psw.has_value()) {
    psw_c = psw->contiguous().to(at::kFloat);
    psw_p = psw_c.data_ptr<float>();
  }
  at::Tensor bad = at::full({2}, -1, at::kLong);
  int64_t* bad_p = bad.data_ptr<int64_t>();
  advise_huge_pages(out.data_ptr(), out.numel() * sizeof(float));
  dispatch_codec(weights, precision, [&](auto codec) {
    using Codec = decltype(codec);
    AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "tbe_forward", [&] {
      forward_impl<Codec, index_t>(weights, M, values.data_ptr<index_t>(),
                                   offsets.data(), psw_p, out.data_ptr<float>(), B,
                                   out.size(1), check, bad_p);
    });
  });
  return bad;
}

at::Tensor tbe_backward_update(const at::Tensor& grad_out, at::Tensor& weights,
                               const std::vector<at::Tensor>& meta, const at::Tensor& values,
                               const at::Tensor& lengths, const c10::optional<at::Tensor>& psw,
                               std::vector<at::Tensor> states,
                               const std::vector<at::Tensor>& state_offsets,
                               const std::string& optimizer, const std::vector<double>& hparams,
                               const std::string& precision, const std::vector<int64_t>& flags) {
  const Meta M = read_meta(meta);
  at::Tensor g = grad_out.contiguous().to(at::kFloat);
  TETRAREC_CHECK(hparams.size() == 5 && flags.size() == 5,
              "tetrarec tbe backward: hparams and flags need 5 entries each, got ", hparams.size(),
              " and ", flags.size());
  TETRAREC_CHECK(g.dim() == 2, "tetrarec tbe backward: grad_out must be 2-D, got ", g.dim(), "-D");
  const std::vector<int64_t> offsets = offsets_of(lengths);
  check_batch(M, "backward", "grad_out", g.size(0), g.size(1), offsets, values, psw);
  TETRAREC_CHECK(values.is_contiguous(), "tetrarec tbe: values must be contiguous");
  BackwardArgs A;
  A.M = &M;
  A.B = g.size(0);
  A.ld = g.size(1);
  A.grad = g.data_ptr<float>();
  A.offsets = offsets.data();
  A.kind = optim_kind(optimizer);
  A.lr = static_cast<float>(hparams[0]);
  A.eps = static_cast<float>(hparams[1]);
  A.beta1 = hparams[2];
  A.beta2 = hparams[3];
  A.wd = static_cast<float>(hparams[4]);
  A.stochastic = flags[0] != 0;
  A.seed = static_cast<uint64_t>(flags[1]) * 0x9E3779B97F4A7C15ULL ^ static_cast<uint64_t>(flags[2]);
  at::Tensor psw_c, psw_grad = at::empty({0}, g.options());
  if (psw.has_value()) {
    psw_c = psw->contiguous().to(at::kFloat);
    A.psw = psw_c.data_ptr<float>();
    if (flags[4]) {
      psw_grad = at::zeros({values.numel()}, g.options());
      A.psw_grad = psw_grad.data_ptr<float>();
    }
  }
  TETRAREC_CHECK(states.size() == state_offsets.size() && states.size() <= 3,
              "tetrarec tbe backward: one offsets tensor per state tensor and at most 3 states, "
              "got ", states.size(), " states and ", state_offsets.size(), " offsets");
  for (size_t k = 0; k < states.size(); ++k) {
    TETRAREC_CHECK(states[k].scalar_type() == at::kFloat && states[k].is_contiguous(),
                "tetrarec tbe backward: optimizer state ", k, " must be contiguous float32, got ",
                states[k].scalar_type());
    A.state[k] = states[k].data_ptr<float>();
    A.state_off[k] = state_offsets[k].data_ptr<int64_t>();
  }
  dispatch_codec(weights, precision, [&](auto codec) {
    using Codec = decltype(codec);
    AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "tbe_backward", [&] {
      backward_impl<Codec, index_t>(weights, A, values.data_ptr<index_t>(), values.numel());
    });
  });
  return psw_grad;
}

// For table `table` of the store: its touched rows (sorted, unique, int64 (U,)) and the
// per-row sum over its columns of the squared summed gradient (+ weight_decay * row),
// FP32 (U,), as the fused backward computes it (row_shares_impl). Nothing is updated.
std::tuple<at::Tensor, at::Tensor> tbe_row_gradient_shares(
    const at::Tensor& grad_out, const at::Tensor& weights, const std::vector<at::Tensor>& meta,
    const at::Tensor& values, const at::Tensor& lengths, const c10::optional<at::Tensor>& psw,
    int64_t table, double weight_decay, const std::string& precision) {
  const Meta all = read_meta(meta);
  TETRAREC_CHECK(table >= 0 && table < all.T, "tetrarec tbe row shares: table ", table,
              " is not a table of this store (valid: 0..", all.T - 1, ")");
  const OneTableMeta one(all, table);
  at::Tensor g = grad_out.contiguous().to(at::kFloat);
  TETRAREC_CHECK(g.dim() == 2, "tetrarec tbe row shares: grad_out must be 2-D, got ", g.dim(),
              "-D");
  TETRAREC_CHECK(values.is_contiguous() && weights.is_contiguous(),
              "tetrarec tbe row shares: weights and values must be contiguous");
  TETRAREC_CHECK(values.numel() < (int64_t(1) << 31) && all.F * g.size(0) < (int64_t(1) << 31),
              "tetrarec tbe row shares: batch too large: ", values.numel(), " ids and ",
              all.F * g.size(0), " bags, each must be below 2^31");
  // Reused across calls: a column-split table's blocks call this once per block and
  // step, each time for the whole batch's bags.
  thread_local std::vector<int64_t> offsets;
  offsets_into(lengths, &offsets);
  check_batch(one.M, "row shares", "grad_out", g.size(0), g.size(1), offsets, values, psw);
  BackwardArgs A;
  A.M = &one.M;
  A.B = g.size(0);
  A.ld = g.size(1);
  A.grad = g.data_ptr<float>();
  A.offsets = offsets.data();
  A.wd = static_cast<float>(weight_decay);
  at::Tensor psw_c;
  if (psw.has_value()) {
    psw_c = psw->contiguous().to(at::kFloat);
    A.psw = psw_c.data_ptr<float>();
  }
  at::Tensor rows, share;
  dispatch_codec(weights, precision, [&](auto codec) {
    using Codec = decltype(codec);
    AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "tbe_row_gradient_shares", [&] {
      row_shares_impl<Codec, index_t>(weights, A, values.data_ptr<index_t>(), table, &rows, &share);
    });
  });
  return {rows, share};
}

// What this binary was compiled for (-march=native: the build machine's CPU) and which
// hand-written vector paths that enables, for benchmark reports. Every other loop is
// left to the compiler's auto-vectorizer at the same -march.
std::map<std::string, std::string> build_info() {
  std::string isa;
#if defined(__AVX512F__)
  isa += "avx512f ";
#endif
#if defined(__AVX512BW__)
  isa += "avx512bw ";
#endif
#if defined(__AVX512BF16__)
  isa += "avx512bf16 ";
#endif
#if defined(__AVX2__)
  isa += "avx2 ";
#endif
#if defined(__FMA__)
  isa += "fma ";
#endif
#if defined(__F16C__)
  isa += "f16c ";
#endif
  if (!isa.empty()) isa.pop_back();
  std::string paths;
#if defined(__F16C__)
  paths += "fp16 rows: F16C 8-lane convert; ";
#endif
#if defined(__AVX2__) && defined(__FMA__)
  paths += "dot interaction: AVX2+FMA 8-lane; ";
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  paths += "bf16 dot interaction: AVX512_BF16 dpbf16; ";
#endif
  paths += "other loops: auto-vectorized";
  return {{"isa", isa.empty() ? "generic" : isa},
          {"vector_paths", paths},
          {"compiler", __VERSION__}};
}

}  // namespace

#include "row_copy_cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("build_info", &build_info, "instruction sets and vector paths this build uses");
  m.def("tbe_forward", &tbe_forward, "pooled table-batched lookup (CPU)");
  m.def("tbe_backward_update", &tbe_backward_update, "fused backward + optimizer (CPU)");
  m.def("tbe_row_gradient_shares", &tbe_row_gradient_shares,
        "one table's touched rows and per-row sums of squared gradients (CPU)");
  m.def("dot_interaction_forward", &tetrarec::dot_interaction_forward,
        "DLRM dot interaction forward (CPU)");
  m.def("dot_interaction_backward", &tetrarec::dot_interaction_backward,
        "DLRM dot interaction backward (CPU)");
  m.def("dot_interaction_bf16_forward", &tetrarec::dot_interaction_bf16_forward,
        "DLRM dot interaction forward, BF16 products, FP32 sums (CPU)");
  m.def("dot_interaction_bf16_native", &tetrarec::dot_interaction_bf16_native,
        "whether the BF16 dot interaction has its AVX512_BF16 kernel in this build");
  m.def("round_to_bf16_out", &tetrarec::round_to_bf16_out,
        "FP32 rounded to the nearest BF16 value, in FP32 (CPU)");
  m.def("copy_row_runs", &tetrarec::copy_row_runs,
        "row-wise copies of column runs between flat row-major buffers (CPU)");
  m.def("load_rows", &load_rows, "rows of a store decoded into FP32 rows, by index (CPU)");
  m.def("store_rows", &store_rows,
        "FP32 rows encoded into rows of a store, by index, stochastic rounding keyed by row (CPU)");
}
