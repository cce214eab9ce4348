// The DLRM dot interaction on CPU: forward and backward, one sample per task.
//
// Same arguments and results as tetrarec/kernels/reference.py (the oracle):
//   dense (B, D), embeddings (B, F*D), both FP32 and contiguous; per sample the rows
//   C_0 = dense[b], C_{f+1} = embeddings[b, f*D : (f+1)*D]   (n = F+1 rows)
//   out (B, D + n(n-1)/2) = [dense | <C_i, C_j> for i > j, row-major (tril offset -1)]
// Backward: grad C_i = sum_{j != i} g(i,j) C_j, with g(i,j) = g(j,i) the gradient of the
// pair's output; grad dense = grad_out[:, :D] + grad C_0.
//
// A sample's rows (n*D floats: 6.9 KB for 27 x 64) stay in L1 while its products are
// formed; nothing of size B x n x n is ever written, and no input is copied into a
// stacked (B, n, D) tensor. Every sum runs in a fixed order inside one sample, one fused
// multiply-add per term (AVX2 + FMA, or std::fma elsewhere: the same results), so the
// results are bitwise the same for any thread count.
//
// BF16 forward (inference, no backward): the same layout, the products of the rows
// rounded to BF16 (nearest, ties to even), each product exact in FP32, summed in FP32.
// With AVX512_BF16 each sample's rows are converted to BF16 pairs (k, k+1) in 32-bit
// lanes and C^T is formed in that layout, so that one _mm512_dpbf16_ps adds two terms of
// 16 dot products (a 64-term dot is 32 instructions instead of 64 FMAs over half-width
// registers); elsewhere the rows are rounded and go through the FP32 blocks above. Both
// add a dot's D exact terms in one chain, k ascending (the AVX512_BF16 path two per
// instruction, in the hardware's order within the pair): at most D roundings, the same
// for any thread count. They differ from the portable definition (reference.py: a
// pairwise tree over k) by that reordering only. The AVX512_BF16 instructions treat FP32
// subnormal inputs and partial sums as zero (DAZ/FTZ, |x| < 2^-126); the portable path
// does not.
#include "check.h"
#include "interaction_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace tetrarec {
namespace {

constexpr int64_t kLanes = 8;  // floats per AVX2 register; every width is padded to it
constexpr int64_t kRows = 4;   // forward: rows i formed together (they share C^T loads)

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Forward block: acc[r][0:8*NV] = sum_k a[r][k] * ct[k*ld + 0:8*NV] for kRows rows a[r],
// k ascending, one fused multiply-add per term. kRows * NV independent accumulators keep
// both FMA ports busy (one row alone is bound by the add latency).
template <int NV>
inline void gram_block(const float* const* a, const float* ct, int64_t ld, int64_t D,
                       float* acc) {
  constexpr int64_t W = NV * kLanes;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 s[kRows][NV];
  for (int64_t r = 0; r < kRows; ++r)
    for (int v = 0; v < NV; ++v) s[r][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < D; ++k) {
    __m256 c[NV];
    for (int v = 0; v < NV; ++v) c[v] = _mm256_loadu_ps(ct + k * ld + v * kLanes);
    for (int64_t r = 0; r < kRows; ++r) {
      const __m256 x = _mm256_broadcast_ss(a[r] + k);
      for (int v = 0; v < NV; ++v) s[r][v] = _mm256_fmadd_ps(x, c[v], s[r][v]);
    }
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(acc + r * W + v * kLanes, s[r][v]);
#else
  for (int64_t i = 0; i < kRows * W; ++i) acc[i] = 0.0f;
  for (int64_t k = 0; k < D; ++k)
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t j = 0; j < W; ++j)
        acc[r * W + j] = std::fma(a[r][k], ct[k * ld + j], acc[r * W + j]);
#endif
}

// Backward block: acc[0:8*NV] = sum_j s[j] * rows[j*ld + 0:8*NV], j = 0..n-1 ascending.
template <int NV>
inline void combine_block(const float* s, const float* rows, int64_t ld, int64_t n,
                          float* acc) {
  constexpr int64_t W = NV * kLanes;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 t[NV];
  for (int v = 0; v < NV; ++v) t[v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 g = _mm256_broadcast_ss(s + j);
    for (int v = 0; v < NV; ++v)
      t[v] = _mm256_fmadd_ps(g, _mm256_loadu_ps(rows + j * ld + v * kLanes), t[v]);
  }
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(acc + v * kLanes, t[v]);
#else
  for (int64_t k = 0; k < W; ++k) acc[k] = 0.0f;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t k = 0; k < W; ++k) acc[k] = std::fma(s[j], rows[j * ld + k], acc[k]);
#endif
}

inline void combine_any(int nv, const float* s, const float* rows, int64_t ld, int64_t n,
                        float* acc) {
  switch (nv) {
    case 1: return combine_block<1>(s, rows, ld, n, acc);
    case 2: return combine_block<2>(s, rows, ld, n, acc);
    case 3: return combine_block<3>(s, rows, ld, n, acc);
    case 4: return combine_block<4>(s, rows, ld, n, acc);
    case 5: return combine_block<5>(s, rows, ld, n, acc);
    case 6: return combine_block<6>(s, rows, ld, n, acc);
    case 7: return combine_block<7>(s, rows, ld, n, acc);
    default: return combine_block<8>(s, rows, ld, n, acc);
  }
}

void check_inputs(const at::Tensor& dense, const at::Tensor& embeddings) {
  TETRAREC_CHECK(dense.dim() == 2 && embeddings.dim() == 2,
              "dot_interaction: dense and embeddings must be 2-D, got ", dense.dim(), "-D and ",
              embeddings.dim(), "-D");
  TETRAREC_CHECK(dense.scalar_type() == at::kFloat && embeddings.scalar_type() == at::kFloat,
              "dot_interaction (CPU kernel): FP32 inputs");
  TETRAREC_CHECK(dense.is_contiguous() && embeddings.is_contiguous(),
              "dot_interaction (CPU kernel): contiguous inputs");
  TETRAREC_CHECK(dense.size(0) == embeddings.size(0) && dense.size(1) > 0 &&
                  embeddings.size(1) % dense.size(1) == 0,
              "dot_interaction: embeddings must be (B, F*D) for dense (B, D)");
}

// One sample's pairs <C_i, C_j> (i > j) into pairs[i(i-1)/2 + j], kRows rows i at a time
// against C^T (D, ld; C^T[k][j] = C_j[k], zero-padded): row_of(i) is row C_i, or a row of
// zeros for i >= n. acc holds kRows * 2 * kLanes floats. (The FP32 forward and the BF16
// forward's any-CPU path both run it.)
template <typename RowOf>
inline void gram_pairs(RowOf row_of, const float* ct, int64_t ld, int64_t D, int64_t n,
                       float* pairs, float* acc) {
  for (int64_t i0 = 1; i0 < n; i0 += kRows) {
    const float* a[kRows];
    for (int64_t r = 0; r < kRows; ++r) a[r] = row_of(i0 + r);
    // rows i0..i0+3 need the columns j < i <= i0+3
    const int64_t cols = round_up(std::min(i0 + kRows - 1, n), kLanes);
    for (int64_t j0 = 0; j0 < cols; j0 += 2 * kLanes) {
      const int64_t w = std::min<int64_t>(2 * kLanes, cols - j0);
      if (w == 2 * kLanes) {
        gram_block<2>(a, ct + j0, ld, D, acc);
      } else {
        gram_block<1>(a, ct + j0, ld, D, acc);
      }
      for (int64_t r = 0; r < kRows && i0 + r < n; ++r) {
        const int64_t i = i0 + r;
        for (int64_t j = j0; j < std::min(i, j0 + w); ++j)
          pairs[i * (i - 1) / 2 + j] = acc[r * w + (j - j0)];
      }
    }
  }
}

}  // namespace

at::Tensor dot_interaction_forward(const at::Tensor& dense, const at::Tensor& embeddings) {
  check_inputs(dense, embeddings);
  const int64_t B = dense.size(0), D = dense.size(1);
  const int64_t n = embeddings.size(1) / D + 1;
  const int64_t P = n * (n - 1) / 2;
  at::Tensor out = at::empty({B, D + P}, dense.options());
  const float* x = dense.data_ptr<float>();
  const float* e = embeddings.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t ld = round_up(n, kLanes);  // C^T (D, ld): C^T[k][j] = C_j[k], zero-padded

  at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> ct(D * ld, 0.0f);
    const std::vector<float> zero_row(D, 0.0f);  // stands in for rows past the last
    float acc[kRows * 2 * kLanes];
    for (int64_t b = b0; b < b1; ++b) {
      const float* xb = x + b * D;
      const float* eb = e + b * (n - 1) * D;
      float* ob = o + b * (D + P);
      std::memcpy(ob, xb, D * sizeof(float));
      for (int64_t k = 0; k < D; ++k) ct[k * ld] = xb[k];
      for (int64_t j = 1; j < n; ++j) {
        const float* r = eb + (j - 1) * D;
        for (int64_t k = 0; k < D; ++k) ct[k * ld + j] = r[k];
      }
      gram_pairs(
          [&](int64_t i) { return i < n ? eb + (i - 1) * D : zero_row.data(); }, ct.data(), ld,
          D, n, ob + D, acc);
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> dot_interaction_backward(
    const at::Tensor& grad_out, const at::Tensor& dense, const at::Tensor& embeddings) {
  check_inputs(dense, embeddings);
  const int64_t B = dense.size(0), D = dense.size(1);
  const int64_t n = embeddings.size(1) / D + 1;
  const int64_t P = n * (n - 1) / 2;
  TETRAREC_CHECK(grad_out.scalar_type() == at::kFloat && grad_out.is_contiguous() &&
                  grad_out.dim() == 2 && grad_out.size(0) == B && grad_out.size(1) == D + P,
              "dot_interaction_backward: grad_out must be contiguous FP32 (B, D + P)");
  at::Tensor grad_dense = at::empty({B, D}, dense.options());
  at::Tensor grad_emb = at::empty({B, (n - 1) * D}, dense.options());
  const float* x = dense.data_ptr<float>();
  const float* e = embeddings.data_ptr<float>();
  const float* g = grad_out.data_ptr<float>();
  float* gx = grad_dense.data_ptr<float>();
  float* ge = grad_emb.data_ptr<float>();
  const int64_t ld = round_up(D, kLanes);  // rows copied to a zero-padded (n, ld) block

  at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> rows(n * ld, 0.0f);
    std::vector<float> sym(n * n);
    std::vector<float> acc(ld);
    for (int64_t b = b0; b < b1; ++b) {
      const float* gb = g + b * (D + P);
      std::memcpy(rows.data(), x + b * D, D * sizeof(float));
      for (int64_t j = 1; j < n; ++j)
        std::memcpy(rows.data() + j * ld, e + (b * (n - 1) + j - 1) * D, D * sizeof(float));
      for (int64_t i = 0; i < n; ++i) {  // sym = G + G^T, zero diagonal
        sym[i * n + i] = 0.0f;
        for (int64_t j = 0; j < i; ++j) {
          const float v = gb[D + i * (i - 1) / 2 + j];
          sym[i * n + j] = v;
          sym[j * n + i] = v;
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t k0 = 0; k0 < ld; k0 += 8 * kLanes) {
          const int nv = static_cast<int>(std::min<int64_t>(8, (ld - k0) / kLanes));
          combine_any(nv, sym.data() + i * n, rows.data() + k0, ld, n, acc.data() + k0);
        }
        if (i == 0) {
          float* dst = gx + b * D;
          for (int64_t k = 0; k < D; ++k) dst[k] = gb[k] + acc[k];
        } else {
          std::memcpy(ge + (b * (n - 1) + i - 1) * D, acc.data(), D * sizeof(float));
        }
      }
    }
  });
  return {grad_dense, grad_emb};
}

// ---- BF16 forward -----------------------------------------------------------------------

namespace {

inline float round_bf16(float x) {  // nearest BF16 value, ties to even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  u = nan ? ((u | 0x00400000u) & 0xFFFF0000u) : ((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
  std::memcpy(&x, &u, 4);
  return x;
}

// Any CPU: the rows rounded to BF16 (kept in FP32: every product of two is exact), then
// the FP32 forward's blocks: k ascending, one FMA per term.
void bf16_forward_rounded(const float* x, const float* e, float* o, int64_t B, int64_t D,
                          int64_t n) {
  const int64_t P = n * (n - 1) / 2;
  const int64_t ld = round_up(n, kLanes);
  at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> ct(D * ld, 0.0f), rows((n + 1) * D, 0.0f);  // row n: zeros
    float acc[kRows * 2 * kLanes];
    for (int64_t b = b0; b < b1; ++b) {
      const float* xb = x + b * D;
      const float* eb = e + b * (n - 1) * D;
      float* ob = o + b * (D + P);
      std::memcpy(ob, xb, D * sizeof(float));
      for (int64_t k = 0; k < D; ++k) rows[k] = round_bf16(xb[k]);
      for (int64_t k = 0; k < (n - 1) * D; ++k) rows[D + k] = round_bf16(eb[k]);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t k = 0; k < D; ++k) ct[k * ld + j] = rows[j * D + k];
      gram_pairs([&](int64_t i) { return rows.data() + std::min(i, n) * D; }, ct.data(), ld, D,
                 n, ob + D, acc);
    }
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr int64_t kBLanes = 16;  // FP32 lanes of a zmm: 16 dot products per instruction

// 32 floats of a row from src (n < 32 of them: zero-padded) as 16 lanes of BF16 pairs.
inline __m512i bf16_pairs(const float* src, int64_t n) {
  if (n >= 32)
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
  const __mmask16 lo = static_cast<__mmask16>((1u << std::min<int64_t>(n, 16)) - 1);
  const __mmask16 hi = static_cast<__mmask16>(n > 16 ? (1u << (n - 16)) - 1 : 0);
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, src + 16),
                                      _mm512_maskz_loadu_ps(lo, src));
}

// In-register transpose of a 16 x 16 block of 32-bit lanes: r[c] becomes column c.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c], 128-bit lane L: column 4L + c, rows 4i..4i+3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i) {
    for (int k = 0; k < 4; ++k) {
      t[8 * i + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + k + 4], 0x88);
      t[8 * i + k + 4] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + k + 4], 0xdd);
    }
  }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd);
  }
}

// One sample's C^T in BF16 pairs: ct[kp*ld + j] = (C_j[2kp], C_j[2kp+1]), columns j >= n
// zero. Rows converted 16 at a time and transposed in registers.
inline void transposed_bf16_pairs(const float* xb, const float* eb, int64_t D, int64_t n,
                                  int64_t ld, uint32_t* ct) {
  const int64_t KP = (D + 1) / 2;
  for (int64_t j0 = 0; j0 < n; j0 += kBLanes) {
    for (int64_t kp0 = 0; kp0 < KP; kp0 += kBLanes) {
      __m512i r[16];
      for (int64_t q = 0; q < kBLanes; ++q) {
        const int64_t j = j0 + q;
        const float* row = j == 0 ? xb : eb + (j - 1) * D;
        r[q] = j < n ? bf16_pairs(row + 2 * kp0, D - 2 * kp0) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int64_t q = 0; q < std::min<int64_t>(kBLanes, KP - kp0); ++q)
        _mm512_storeu_si512(ct + (kp0 + q) * ld + j0, r[q]);
    }
  }
}

// s[r][v] = sum_kp dot2(a[r] + kp*ld, ct[kp*ld + 16v .. 16v+15]) for R rows whose pairs
// sit in column a[r] of ct: each lane adds its two terms per instruction, kp ascending.
// The accumulators are named variables, not an array: GCC 12 kept an array of 8 or 16
// zmm in memory and stored (and reloaded) accumulators on every iteration.
#define TETRAREC_BF16_ROW(r)                                                      \
  if constexpr (r < R) {                                                          \
    const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r][kp * ld])); \
    s##r##0 = _mm512_dpbf16_ps(s##r##0, x, c0);                                   \
    if constexpr (NV == 2) s##r##1 = _mm512_dpbf16_ps(s##r##1, x, c1);            \
  }
template <int R, int NV>
inline void gram_block_bf16(const uint32_t* const* a, const uint32_t* ct, int64_t ld,
                            int64_t KP, __m512* out) {
  static_assert(R <= 8 && NV <= 2, "at most 8 rows of 2 vectors");
  const __m512 z = _mm512_setzero_ps();
  __m512 s00 = z, s01 = z, s10 = z, s11 = z, s20 = z, s21 = z, s30 = z, s31 = z;
  __m512 s40 = z, s41 = z, s50 = z, s51 = z, s60 = z, s61 = z, s70 = z, s71 = z;
  for (int64_t kp = 0; kp < KP; ++kp) {
    const __m512bh c0 = (__m512bh)_mm512_loadu_si512(ct + kp * ld);
    const __m512bh c1 =
        NV == 2 ? (__m512bh)_mm512_loadu_si512(ct + kp * ld + kBLanes) : c0;
    TETRAREC_BF16_ROW(0)
    TETRAREC_BF16_ROW(1)
    TETRAREC_BF16_ROW(2)
    TETRAREC_BF16_ROW(3)
    TETRAREC_BF16_ROW(4)
    TETRAREC_BF16_ROW(5)
    TETRAREC_BF16_ROW(6)
    TETRAREC_BF16_ROW(7)
  }
  const __m512 all[16] = {s00, s01, s10, s11, s20, s21, s30, s31,
                          s40, s41, s50, s51, s60, s61, s70, s71};
  for (int i = 0; i < 2 * R; ++i) out[i] = all[i];
}
#undef TETRAREC_BF16_ROW

void bf16_forward_native(const float* x, const float* e, float* o, int64_t B, int64_t D,
                         int64_t n) {
  const int64_t P = n * (n - 1) / 2;
  const int64_t KP = (D + 1) / 2;
  const int64_t ld = round_up(n + 1, kBLanes);  // column n (and on) stays zero
  at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
    std::vector<uint32_t> ct(KP * ld, 0u);
    __m512 s[8 * 2];
    for (int64_t b = b0; b < b1; ++b) {
      const float* xb = x + b * D;
      const float* eb = e + b * (n - 1) * D;
      float* ob = o + b * (D + P);
      if (b + 1 < b1) {  // the next sample's rows: its loads would wait on memory
        const char* next = reinterpret_cast<const char*>(eb + (n - 1) * D);
        for (int64_t k = 0; k < (n - 1) * D * 4; k += 64) _mm_prefetch(next + k, _MM_HINT_T0);
        const char* next_x = reinterpret_cast<const char*>(xb + D);
        for (int64_t k = 0; k < D * 4; k += 64) _mm_prefetch(next_x + k, _MM_HINT_T0);
      }
      std::memcpy(ob, xb, D * sizeof(float));
      transposed_bf16_pairs(xb, eb, D, n, ld, ct.data());
      float* pairs = ob + D;
      // Groups of 8 rows (8 or 16 accumulators: enough independent chains to hide the
      // instruction's latency), 4 for a short last group.
      for (int64_t i0 = 1; i0 < n;) {
        const int64_t R = n - i0 > 4 ? 8 : 4;
        const uint32_t* a[8];
        for (int64_t r = 0; r < R; ++r) a[r] = ct.data() + std::min(i0 + r, n);
        const int64_t last = std::min(i0 + R - 1, n - 1);  // rows i0..last need j < i
        for (int64_t j0 = 0; j0 < last; j0 += 2 * kBLanes) {
          const int nv = last - j0 > kBLanes ? 2 : 1;
          const uint32_t* c = ct.data() + j0;
          if (R == 8) {
            if (nv == 2) gram_block_bf16<8, 2>(a, c, ld, KP, s);
            else gram_block_bf16<8, 1>(a, c, ld, KP, s);
          } else {
            if (nv == 2) gram_block_bf16<4, 2>(a, c, ld, KP, s);
            else gram_block_bf16<4, 1>(a, c, ld, KP, s);
          }
          for (int64_t r = 0; r < R && i0 + r < n; ++r) {
            const int64_t i = i0 + r;
            for (int v = 0; v < nv; ++v) {
              const int64_t j = j0 + v * kBLanes, cnt = std::min<int64_t>(i - j, kBLanes);
              if (cnt <= 0) break;
              const __mmask16 m = static_cast<__mmask16>((1u << cnt) - 1);
              _mm512_mask_storeu_ps(pairs + i * (i - 1) / 2 + j, m, s[r * 2 + v]);
            }
          }
        }
        i0 += R;
      }
    }
  });
}
#endif

}  // namespace

bool dot_interaction_bf16_native() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

at::Tensor dot_interaction_bf16_forward(const at::Tensor& dense, const at::Tensor& embeddings,
                                        bool native) {
  check_inputs(dense, embeddings);
  const int64_t B = dense.size(0), D = dense.size(1);
  const int64_t n = embeddings.size(1) / D + 1;
  at::Tensor out = at::empty({B, D + n * (n - 1) / 2}, dense.options());
  const float* x = dense.data_ptr<float>();
  const float* e = embeddings.data_ptr<float>();
  float* o = out.data_ptr<float>();
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (native) {
    bf16_forward_native(x, e, o, B, D, n);
    return out;
  }
#endif
  (void)native;
  bf16_forward_rounded(x, e, o, B, D, n);
  return out;
}

}  // namespace tetrarec
