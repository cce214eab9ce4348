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
#include "check.h"
#include "interaction_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
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
      float* pairs = ob + D;
      for (int64_t i0 = 1; i0 < n; i0 += kRows) {
        const float* a[kRows];
        for (int64_t r = 0; r < kRows; ++r)
          a[r] = i0 + r < n ? eb + (i0 + r - 1) * D : zero_row.data();
        // rows i0..i0+3 need the columns j < i <= i0+3
        const int64_t cols = round_up(std::min(i0 + kRows - 1, n), kLanes);
        for (int64_t j0 = 0; j0 < cols; j0 += 2 * kLanes) {
          const int64_t w = std::min<int64_t>(2 * kLanes, cols - j0);
          if (w == 2 * kLanes) {
            gram_block<2>(a, ct.data() + j0, ld, D, acc);
          } else {
            gram_block<1>(a, ct.data() + j0, ld, D, acc);
          }
          for (int64_t r = 0; r < kRows && i0 + r < n; ++r) {
            const int64_t i = i0 + r;
            for (int64_t j = j0; j < std::min(i, j0 + w); ++j)
              pairs[i * (i - 1) / 2 + j] = acc[r * w + (j - j0)];
          }
        }
      }
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

}  // namespace tetrarec
