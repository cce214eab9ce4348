// Rows between an FP32 buffer and a row store of any precision, by index: how the
// mixed-precision cache (cache/collection.py) admits rows (decode into its FP32 slots) and
// writes evicted rows back (encode with stochastic rounding into the backing store).
//
//   load_rows:  dst[dst_index[j]] = decode(src[src_index[j]])           dst FP32 (S, D)
//   store_rows: dst[dst_index[j]] = encode(src[src_index[j]], key_j)    src FP32 (S, D)
//               key_j = mix64(step ^ ((row_key + dst_index[j]) * 0xA24BAED4963EE407)),
//               step = seed * golden ^ iteration: the draws tbe_backward_update makes for
//               that row at that iteration (reference.rounding_noise's bits).
//
// Each row is decoded or encoded by the row codecs of tbe_cpu.cpp (the integer formats by
// 8-lane AVX2 versions of them, the same bits), so the bits are the fused kernels' and
// reference.load_rows / reference.store_rows's. Rows are independent:
// any thread count gives the same bits. Included by tbe_cpu.cpp after its codecs.
#pragma once

#include <type_traits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

struct RowCopyArgs {
  int64_t n, D, src_rows, dst_rows;
  const int64_t *src_index, *dst_index;
};

// Shapes, dtypes and every index checked before any row moves (an error changes nothing).
RowCopyArgs row_copy_args(const at::Tensor& src, const at::Tensor& src_index,
                          const at::Tensor& dst, const at::Tensor& dst_index, int64_t D,
                          const char* op) {
  TETRAREC_CHECK(src.dim() == 2 && dst.dim() == 2 && src.is_contiguous() && dst.is_contiguous(),
                 "tetrarec ", op, ": src and dst must be contiguous 2-D row buffers");
  for (const at::Tensor* ix : {&src_index, &dst_index})
    TETRAREC_CHECK(ix->scalar_type() == at::kLong && ix->dim() == 1 && ix->is_contiguous(),
                   "tetrarec ", op, ": src_index and dst_index must be contiguous 1-D int64");
  TETRAREC_CHECK(src_index.numel() == dst_index.numel(), "tetrarec ", op, ": ",
                 src_index.numel(),
                 " source and ", dst_index.numel(), " destination indices");
  RowCopyArgs a{src_index.numel(), D, src.size(0), dst.size(0), src_index.data_ptr<int64_t>(),
                dst_index.data_ptr<int64_t>()};
  for (int64_t j = 0; j < a.n; ++j) {
    TETRAREC_CHECK(a.src_index[j] >= 0 && a.src_index[j] < a.src_rows, "tetrarec ", op,
                   ": source row ", a.src_index[j], " is outside 0..", a.src_rows - 1);
    TETRAREC_CHECK(a.dst_index[j] >= 0 && a.dst_index[j] < a.dst_rows, "tetrarec ", op,
                   ": destination row ", a.dst_index[j], " is outside 0..", a.dst_rows - 1);
  }
  return a;
}

constexpr int64_t kRowCopyGrain = 256;
constexpr int64_t kRowCopyAhead = 8;  // rows prefetched ahead: both buffers are read at random

template <class Codec>
constexpr bool kIsIntRow = std::is_same_v<Codec, IntRow<8>> || std::is_same_v<Codec, IntRow<4>>;

// The min and max IntRow::store finds scanning src in order (std::min / std::max: the
// first of equal values wins, NaN after the first element is skipped). The 8 lanes give
// the same values; only the sign of a zero could depend on the order, so a row whose min
// or max is zero is scanned again in order.
inline void row_min_max(const float* src, int64_t D, float* lo_out, float* hi_out) {
  float lo = src[0], hi = src[0];
  int64_t d = 0;
#if defined(__AVX2__)
  if (D >= 8) {
    __m256 lv = _mm256_set1_ps(src[0]), hv = lv;
    for (; d + 8 <= D; d += 8) {
      const __m256 x = _mm256_loadu_ps(src + d);
      lv = _mm256_min_ps(x, lv);  // x < lo ? x : lo, per lane
      hv = _mm256_max_ps(x, hv);  // x > hi ? x : hi
    }
    alignas(32) float l8[8], h8[8];
    _mm256_store_ps(l8, lv);
    _mm256_store_ps(h8, hv);
    for (int k = 0; k < 8; ++k) {
      lo = std::min(lo, l8[k]);
      hi = std::max(hi, h8[k]);
    }
  }
#endif
  for (; d < D; ++d) {
    lo = std::min(lo, src[d]);
    hi = std::max(hi, src[d]);
  }
  if (lo == 0.0f || hi == 0.0f) {
    lo = hi = src[0];
    for (int64_t e = 1; e < D; ++e) {
      lo = std::min(lo, src[e]);
      hi = std::max(hi, src[e]);
    }
  }
  *lo_out = lo;
  *hi_out = hi;
}

// IntRow<Bits>::store, bit for bit, 8 lanes at a time: the same scale and bias, the same
// random bits (random16's hash), q = floor((x - bias) * inv + u) (or round to nearest
// even), clamped to [0, levels] as std::min(std::max(q, 0), levels) clamps (NaN passes).
template <int Bits>
inline void int_row_store(uint8_t* r, int64_t D, const float* src, bool sr, uint64_t key,
                          int64_t col0) {
  using Row = IntRow<Bits>;
  const float levels = static_cast<float>(Row::kLevels);
  float lo, hi;
  row_min_max(src, D, &lo, &hi);
  const IntGrid grid = int_row_grid(lo, hi, levels);
  const uint16_t sb[2] = {grid.scale_bits, grid.bias_bits};
  const float s = grid.scale, b = grid.bias;
  const float inv = s > 0 ? 1.0f / s : 0.0f;
  thread_local std::vector<int32_t> codes;
  if (static_cast<int64_t>(codes.size()) < D + 8) codes.resize(D + 8);
  int32_t* c = codes.data();
  const uint32_t klo = static_cast<uint32_t>(key), khi = static_cast<uint32_t>(key >> 32);
  int64_t d = 0;
#if defined(__AVX2__)
  const __m256 vb = _mm256_set1_ps(b), vinv = _mm256_set1_ps(inv), zero = _mm256_setzero_ps();
  const __m256 vl = _mm256_set1_ps(levels), half = _mm256_set1_ps(0.5f);
  const __m256 scale16 = _mm256_set1_ps(1.0f / 65536.0f);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (; d + 8 <= D; d += 8) {
    __m256 q = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(src + d), vb), vinv);
    if (sr) {
      const __m256i col = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(col0 + d)), lane);
      __m256i z = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(klo)),
                                   _mm256_mullo_epi32(col, _mm256_set1_epi32(static_cast<int32_t>(0x9E3779B9u))));
      z = _mm256_xor_si256(z, _mm256_srli_epi32(z, 16));
      z = _mm256_mullo_epi32(z, _mm256_set1_epi32(static_cast<int32_t>(0x85EBCA6Bu)));
      z = _mm256_xor_si256(z, _mm256_srli_epi32(z, 13));
      z = _mm256_mullo_epi32(z, _mm256_set1_epi32(static_cast<int32_t>(0xC2B2AE35u)));
      z = _mm256_xor_si256(z, _mm256_srli_epi32(z, 16));
      z = _mm256_and_si256(_mm256_srli_epi32(_mm256_xor_si256(z, _mm256_set1_epi32(khi)), 8),
                           _mm256_set1_epi32(0xFFFF));
      const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(z), half), scale16);
      q = _mm256_floor_ps(_mm256_add_ps(q, u));
    } else {
      q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    q = _mm256_blendv_ps(q, zero, _mm256_cmp_ps(q, zero, _CMP_LT_OQ));  // q < 0 ? 0 : q
    q = _mm256_blendv_ps(q, vl, _mm256_cmp_ps(vl, q, _CMP_LT_OQ));      // levels < q ? levels : q
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + d), _mm256_cvttps_epi32(q));
  }
#endif
  if (d < D) {
    const uint16_t* rnd = sr ? random16(key, D, col0) : nullptr;
    for (; d < D; ++d) {
      float q = (src[d] - b) * inv;
      q = sr ? std::floor(q + (static_cast<float>(rnd[d]) + 0.5f) * (1.0f / 65536.0f))
             : std::nearbyint(q);
      c[d] = static_cast<int>(std::min(std::max(q, 0.0f), levels));
    }
  }
  std::memset(r, 0, Row::width(D));
  if (Bits == 8) {
    for (int64_t e = 0; e < D; ++e) r[e] = static_cast<uint8_t>(c[e]);
  } else {
    for (int64_t e = 0; e < D; ++e) r[e >> 1] |= static_cast<uint8_t>(c[e] << ((e & 1) * 4));
  }
  std::memcpy(r + Row::payload(D), sb, 4);
}

// IntRow<Bits>::load, 8 lanes at a time (code * scale + bias, no fused multiply-add).
template <int Bits>
inline void int_row_load(const uint8_t* r, int64_t D, float* dst) {
  float s, b;
  IntRow<Bits>::tail(r, D, &s, &b);
  int64_t d = 0;
#if defined(__AVX2__)
  if (Bits == 8) {
    const __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
    for (; d + 8 <= D; d += 8) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + d));
      const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
      _mm256_storeu_ps(dst + d, _mm256_add_ps(_mm256_mul_ps(x, vs), vb));
    }
  }
#endif
  for (; d < D; ++d) dst[d] = static_cast<float>(IntRow<Bits>::code(r, d)) * s + b;
}

template <class Codec>
inline void codec_load(const uint8_t* r, int64_t D, float* dst) {
  if constexpr (std::is_same_v<Codec, IntRow<8>>) {
    int_row_load<8>(r, D, dst);
  } else if constexpr (std::is_same_v<Codec, IntRow<4>>) {
    int_row_load<4>(r, D, dst);
  } else {
    Codec::load(r, D, dst);
  }
}

template <class Codec>
inline void codec_store(uint8_t* r, int64_t D, const float* src, bool sr, uint64_t key,
                        int64_t col0) {
  if constexpr (std::is_same_v<Codec, IntRow<8>>) {
    int_row_store<8>(r, D, src, sr, key, col0);
  } else if constexpr (std::is_same_v<Codec, IntRow<4>>) {
    int_row_store<4>(r, D, src, sr, key, col0);
  } else {
    Codec::store(r, D, src, sr, key, col0);
  }
}

inline void prefetch_bytes(const void* p, int64_t bytes, int rw) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) {
    if (rw) {
      __builtin_prefetch(c + b, 1);
    } else {
      __builtin_prefetch(c + b, 0);
    }
  }
}

void load_rows(const at::Tensor& src, const at::Tensor& src_index, at::Tensor& dst,
               const at::Tensor& dst_index, const std::string& precision) {
  TETRAREC_CHECK(dst.scalar_type() == at::kFloat, "tetrarec load_rows: dst must be float32, got ",
                 dst.scalar_type());
  const int64_t D = dst.dim() == 2 ? dst.size(1) : 0;
  const RowCopyArgs a = row_copy_args(src, src_index, dst, dst_index, D, "load_rows");
  dispatch_codec(src, precision, [&](auto codec) {
    using Codec = decltype(codec);
    const int64_t width = Codec::width(D);
    TETRAREC_CHECK(src.size(1) == width, "tetrarec load_rows: ", precision, " rows of dim ", D,
                   " are ", width, " wide, src is ", src.size(1));
    const uint8_t* s = static_cast<const uint8_t*>(src.data_ptr());
    float* d = dst.data_ptr<float>();
    at::parallel_for(0, a.n, kRowCopyGrain, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        if (j + kRowCopyAhead < j1) {
          prefetch_bytes(s + a.src_index[j + kRowCopyAhead] * width * Codec::kElem,
                         width * Codec::kElem, 0);
          prefetch_bytes(d + a.dst_index[j + kRowCopyAhead] * D, D * 4, 1);
        }
        codec_load<Codec>(s + a.src_index[j] * width * Codec::kElem, D, d + a.dst_index[j] * D);
      }
    });
  });
}

// flags: [stochastic, seed, iteration, row_key, col_start].
void store_rows(const at::Tensor& src, const at::Tensor& src_index, at::Tensor& dst,
                const at::Tensor& dst_index, const std::string& precision,
                const std::vector<int64_t>& flags) {
  TETRAREC_CHECK(src.scalar_type() == at::kFloat, "tetrarec store_rows: src must be float32, got ",
                 src.scalar_type());
  TETRAREC_CHECK(flags.size() == 5, "tetrarec store_rows: flags are [stochastic, seed, "
                 "iteration, row_key, col_start], got ", flags.size(), " values");
  const int64_t D = src.dim() == 2 ? src.size(1) : 0;
  const RowCopyArgs a = row_copy_args(src, src_index, dst, dst_index, D, "store_rows");
  const bool sr = flags[0] != 0;
  const uint64_t step =
      static_cast<uint64_t>(flags[1]) * 0x9E3779B97F4A7C15ULL ^ static_cast<uint64_t>(flags[2]);
  const uint64_t row_key = static_cast<uint64_t>(flags[3]);
  const int64_t col0 = flags[4];
  dispatch_codec(dst, precision, [&](auto codec) {
    using Codec = decltype(codec);
    const int64_t width = Codec::width(D);
    TETRAREC_CHECK(dst.size(1) == width, "tetrarec store_rows: ", precision, " rows of dim ", D,
                   " are ", width, " wide, dst is ", dst.size(1));
    const float* s = src.data_ptr<float>();
    uint8_t* d = static_cast<uint8_t*>(dst.data_ptr());
    at::parallel_for(0, a.n, kRowCopyGrain, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        if (j + kRowCopyAhead < j1) {
          prefetch_bytes(s + a.src_index[j + kRowCopyAhead] * D, D * 4, 0);
          prefetch_bytes(d + a.dst_index[j + kRowCopyAhead] * width * Codec::kElem,
                         width * Codec::kElem, 1);
        }
        const uint64_t key = row_key + static_cast<uint64_t>(a.dst_index[j]);
        codec_store<Codec>(d + a.dst_index[j] * width * Codec::kElem, D, s + a.src_index[j] * D,
                           sr, mix64(step ^ (key * 0xA24BAED4963EE407ULL)), col0);
      }
    });
  });
}

}  // namespace
