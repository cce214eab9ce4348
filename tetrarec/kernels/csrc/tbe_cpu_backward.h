// Fused backward + sparse optimizer for CPU; included by tbe_cpu.cpp (same namespace).
#pragma once

#include <type_traits>

namespace {

enum class Kind { kSgd, kAdagrad, kRowwiseAdagrad, kAdam, kRowwiseAdam };

Kind optim_kind(const std::string& name) {
  if (name == "sgd") return Kind::kSgd;
  if (name == "adagrad") return Kind::kAdagrad;
  if (name == "rowwise_adagrad") return Kind::kRowwiseAdagrad;
  if (name == "adam") return Kind::kAdam;
  if (name == "rowwise_adam") return Kind::kRowwiseAdam;
  TETRAREC_CHECK(false, "tetrarec tbe: unknown optimizer ", name);
}

struct BackwardArgs {
  const Meta* M = nullptr;
  int64_t B = 0, ld = 0;
  const float* grad = nullptr;
  const int64_t* offsets = nullptr;
  Kind kind = Kind::kSgd;
  float lr = 0, eps = 0, wd = 0;
  double beta1 = 0, beta2 = 0;
  bool stochastic = false;
  uint64_t seed = 0;
  const float* psw = nullptr;
  float* psw_grad = nullptr;
  float* state[3] = {nullptr, nullptr, nullptr};
  const int64_t* state_off[3] = {nullptr, nullptr, nullptr};
};

// g += wd * w: weight decay, added to the summed gradient before any rule reads it.
inline void add_weight_decay(float wd, const float* w, float* g, int64_t D) {
  for (int64_t d = 0; d < D; ++d) g[d] += wd * w[d];
}

// Sum of g^2 over a row's D columns, in column order: what the row-wise rules add to
// their per-row state (divided by D), and what row_shares_impl reports, bitwise.
inline float sum_squares(const float* g, int64_t D) {
  float sq = 0.0f;
  for (int64_t d = 0; d < D; ++d) sq += g[d] * g[d];
  return sq;
}

// The rules of optim_rules.py, one row at a time; `g` is the summed gradient (clobbered).
inline void apply_rule(const BackwardArgs& A, int64_t t, int64_t row, int64_t D, float* w,
                       float* g) {
  if (A.wd != 0.0f) add_weight_decay(A.wd, w, g, D);
  switch (A.kind) {
    case Kind::kSgd:
      for (int64_t d = 0; d < D; ++d) w[d] -= A.lr * g[d];
      break;
    case Kind::kAdagrad: {
      float* m = A.state[0] + A.state_off[0][t] + row * D;
      for (int64_t d = 0; d < D; ++d) {
        m[d] += g[d] * g[d];
        w[d] -= A.lr * (g[d] / (std::sqrt(m[d]) + A.eps));
      }
      break;
    }
    case Kind::kRowwiseAdagrad: {
      float* m = A.state[0] + A.state_off[0][t] + row;
      *m += sum_squares(g, D) / static_cast<float>(D);
      const float mult = A.lr / (std::sqrt(*m) + A.eps);
      for (int64_t d = 0; d < D; ++d) w[d] -= g[d] * mult;
      break;
    }
    case Kind::kAdam:
    case Kind::kRowwiseAdam: {
      const bool rowwise = A.kind == Kind::kRowwiseAdam;
      float* m = A.state[0] + A.state_off[0][t] + row * D;
      float* v = A.state[1] + A.state_off[1][t] + row * (rowwise ? 1 : D);
      float* step = A.state[2] + A.state_off[2][t] + row;
      *step += 1.0f;
      // 1 - beta rounded once from the double, as optim_rules.py's lerp_ weight and add_
      // alpha are (1.0f - 0.999f is 0.00100004673: (1 - beta2) off by 5e-5 of itself).
      const float b2 = static_cast<float>(A.beta2);
      const float omb1 = static_cast<float>(1.0 - A.beta1), omb2 = static_cast<float>(1.0 - A.beta2);
      const double bc1 = 1.0 - std::pow(A.beta1, static_cast<double>(*step));
      const float bc2s = static_cast<float>(std::sqrt(1.0 - std::pow(A.beta2, static_cast<double>(*step))));
      const float step_size = static_cast<float>(A.lr / bc1);
      if (rowwise) *v = *v * b2 + omb2 * (sum_squares(g, D) / static_cast<float>(D));
      for (int64_t d = 0; d < D; ++d) {
        m[d] += omb1 * (g[d] - m[d]);
        float vd;
        if (rowwise) {
          vd = *v;
        } else {
          v[d] = v[d] * b2 + omb2 * (g[d] * g[d]);
          vd = v[d];
        }
        w[d] -= m[d] / (std::sqrt(vd) / bc2s + A.eps) * step_size;
      }
      break;
    }
  }
}

// Buffers reused across calls (per calling thread): no allocation or page faults per step.
struct Scratch {
  HugeArray<uint64_t> keys, tmp;  // read and written at random: huge pages when large
  HugeArray<int32_t> seg;
  std::vector<int64_t> hist;
  HugeArray<float> grad;
};
inline Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// Stable LSD radix sort of a[0, n) = (key << 32 | position) on the key bits; parallel
// over chunks. Stability makes the result independent of the chunking, hence of the
// thread count. Returns the buffer holding the result (`a` or `tmp`).
uint64_t* radix_sort_keys(uint64_t* a, uint64_t* tmp, int64_t n, int key_bits,
                          std::vector<int64_t>& hist) {
  constexpr int kDigit = 13, kBuckets = 1 << kDigit;  // 2 passes for up to 2^26 rows
  if (n < 2) return a;
  // Parallel only when large: each parallel region costs a barrier.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 131072));
  const int64_t chunk = (n + parts - 1) / parts;
  hist.resize(parts * kBuckets);
  for (int shift = 32; shift < 32 + key_bits; shift += kDigit) {
    std::fill(hist.begin(), hist.end(), 0);
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        int64_t* h = hist.data() + p * kBuckets;
        const int64_t e = std::min(n, (p + 1) * chunk);
        for (int64_t i = p * chunk; i < e; ++i) ++h[(a[i] >> shift) & (kBuckets - 1)];
      }
    });
    int64_t total = 0;
    for (int d = 0; d < kBuckets; ++d)
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t c = hist[p * kBuckets + d];
        hist[p * kBuckets + d] = total;
        total += c;
      }
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        int64_t* h = hist.data() + p * kBuckets;
        const int64_t e = std::min(n, (p + 1) * chunk);
        for (int64_t i = p * chunk; i < e; ++i) tmp[h[(a[i] >> shift) & (kBuckets - 1)]++] = a[i];
      }
    });
    std::swap(a, tmp);
  }
  return a;
}

// Stable LSD radix sort of each feature's segment of keys [start[f], start[f + 1]) on the
// bits of the id within its table, features in parallel. Valid when no table of the
// store is looked up by two features: a segment then holds every id of its table, so
// the sort groups each row's ids in position order, as the global sort does (the same
// sums in the same order), while each segment's passes run in cache and on fewer bits.
inline void segment_sort_keys(uint64_t* keys, uint64_t* tmp, const Meta& M, const int64_t* start) {
  constexpr int kMaxDigit = 11;  // 2048 buckets: the histogram stays in L1
  at::parallel_for(0, M.F, 1, [&](int64_t f0, int64_t f1) {
    std::vector<int64_t> hist(int64_t(1) << kMaxDigit);
    for (int64_t f = f0; f < f1; ++f) {
      const int64_t t = M.feat_table[f], n = start[f + 1] - start[f];
      if (t < 0 || n < 2) continue;
      int bits = 1;
      while ((int64_t(1) << bits) < M.rows[t]) ++bits;
      const int passes = (bits + kMaxDigit - 1) / kMaxDigit;
      const int digit = (bits + passes - 1) / passes;
      const uint64_t mask = (uint64_t(1) << digit) - 1, roff = static_cast<uint64_t>(M.row_off[t]);
      uint64_t *a = keys + start[f], *b = tmp + start[f];
      for (int p = 0; p < passes; ++p) {
        const int shift = p * digit;
        std::fill(hist.begin(), hist.begin() + (mask + 1), 0);
        for (int64_t i = 0; i < n; ++i) ++hist[(((a[i] >> 32) - roff) >> shift) & mask];
        int64_t total = 0;
        for (uint64_t d = 0; d <= mask; ++d) {
          const int64_t c = hist[d];
          hist[d] = total;
          total += c;
        }
        for (int64_t i = 0; i < n; ++i) b[hist[(((a[i] >> 32) - roff) >> shift) & mask]++] = a[i];
        std::swap(a, b);
      }
      if (a != keys + start[f]) std::memcpy(keys + start[f], a, n * sizeof(uint64_t));
    }
  });
}

// Sorted (key << 32 | low) pairs of every id of the group's features, where low is the
// id's position j when per-id weights need it, else its bag s = f * B + b (which saves a
// random lookup of seg[j] per id later). seg[j] = s is filled only in the first case.
// Built in parallel: the id at position j of feature f goes to slot j - skipped[f].
template <typename Idx>
const uint64_t* sorted_keys(const BackwardArgs& A, const Idx* values, Scratch& S, int64_t* n_out) {
  const Meta& M = *A.M;
  const bool by_position = A.psw != nullptr;
  const int64_t N = A.offsets[M.F * A.B];
  std::vector<int64_t> skipped(M.F + 1, 0);
  int64_t total_rows = 1;
  for (int64_t f = 0; f < M.F; ++f) {
    const int64_t t = M.feat_table[f];
    const int64_t cnt = A.offsets[(f + 1) * A.B] - A.offsets[f * A.B];
    skipped[f + 1] = skipped[f] + (t < 0 ? cnt : 0);
    if (t >= 0) total_rows = std::max(total_rows, M.row_off[t] + M.rows[t]);
  }
  TETRAREC_CHECK(total_rows < (int64_t(1) << 32), "tetrarec tbe: ", total_rows,
              " rows in one store, more than 2^32");
  const int64_t n = N - skipped[M.F];
  if (static_cast<int64_t>(S.keys.size()) < n) {
    S.keys.resize(n);
    S.tmp.resize(n);
  }
  if (by_position && static_cast<int64_t>(S.seg.size()) < N) S.seg.resize(N);
  uint64_t* keys = S.keys.data();
  int32_t* seg = S.seg.data();
  std::atomic<int64_t> bad_pos{N};
  // seg is read only for the keys' positions: the features of other stores (t < 0,
  // as every other table's for row_shares_impl) are skipped whole.
  at::parallel_for(0, M.F * A.B, 2048, [&](int64_t s0, int64_t s1) {
    int64_t bad = N;
    for (int64_t f = s0 / A.B; f * A.B < s1; ++f) {
      const int64_t t = M.feat_table[f];
      if (t < 0) continue;
      const int64_t rows = M.rows[t], roff = M.row_off[t], sk = skipped[f];
      const int64_t b1 = std::min(s1, (f + 1) * A.B);
      for (int64_t s = std::max(s0, f * A.B); s < b1; ++s) {
        const int64_t j0 = A.offsets[s], j1 = A.offsets[s + 1];
        if (by_position)
          for (int64_t j = j0; j < j1; ++j) seg[j] = static_cast<int32_t>(s);
        for (int64_t j = j0; j < j1; ++j) {
          const int64_t id = static_cast<int64_t>(values[j]);
          if (id < 0 || id >= rows) {
            bad = std::min(bad, j);
            continue;
          }
          const uint64_t low = static_cast<uint64_t>(by_position ? j : s);
          keys[j - sk] = static_cast<uint64_t>(roff + id) << 32 | low;
        }
      }
    }
    if (bad < N) {
      int64_t cur = bad_pos.load();
      while (bad < cur && !bad_pos.compare_exchange_weak(cur, bad)) {
      }
    }
  });
  if (bad_pos.load() < N) {
    const int64_t j = bad_pos.load();
    const int64_t s = std::upper_bound(A.offsets, A.offsets + M.F * A.B + 1, j) - A.offsets - 1;
    TETRAREC_CHECK(false, "tetrarec tbe backward: feature ", s / A.B,
                " (its index in the feature order): id ", static_cast<int64_t>(values[j]),
                " is outside its table of ", M.rows[M.feat_table[s / A.B]], " rows");
  }
  *n_out = n;
  std::vector<int64_t> per_table(M.T, 0);
  bool one_feature_per_table = true;
  for (int64_t f = 0; f < M.F; ++f)
    if (M.feat_table[f] >= 0) one_feature_per_table &= ++per_table[M.feat_table[f]] == 1;
  if (one_feature_per_table) {
    std::vector<int64_t> start(M.F + 1);
    for (int64_t f = 0; f <= M.F; ++f) start[f] = A.offsets[f * A.B] - skipped[f];
    segment_sort_keys(keys, S.tmp.data(), M, start.data());
    return keys;
  }
  int bits = 1;
  while ((int64_t(1) << bits) < total_rows) ++bits;
  return radix_sort_keys(keys, S.tmp.data(), n, bits, S.hist);
}

// Row-wise Adagrad for up to kBatch rows at once. Each row's sum of squares is the same
// sequential sum as apply_rule's (bitwise), but the rows' chains are interleaved so the
// adds of different rows overlap instead of waiting on each other.
constexpr int kBatch = 8;
inline void rowwise_adagrad_batch(const BackwardArgs& A, int n, const int64_t* ts,
                                  const int64_t* rows, const int64_t* Ds, float* const* w,
                                  float* const* g) {
  if (A.wd != 0.0f)
    for (int i = 0; i < n; ++i) add_weight_decay(A.wd, w[i], g[i], Ds[i]);
  float sq[kBatch] = {};
  bool same = true;
  for (int i = 1; i < n; ++i) same = same && Ds[i] == Ds[0];
  if (same && n == kBatch) {
    const int64_t D = Ds[0];
    for (int64_t d = 0; d < D; ++d)
      for (int i = 0; i < kBatch; ++i) sq[i] += g[i][d] * g[i][d];
  } else {
    for (int i = 0; i < n; ++i) sq[i] = sum_squares(g[i], Ds[i]);
  }
  for (int i = 0; i < n; ++i) {
    const int64_t D = Ds[i];
    float* m = A.state[0] + A.state_off[0][ts[i]] + rows[i];
    *m += sq[i] / static_cast<float>(D);
    const float mult = A.lr / (std::sqrt(*m) + A.eps);
    float* wi = w[i];
    const float* gi = g[i];
    for (int64_t d = 0; d < D; ++d) wi[d] -= gi[d] * mult;
  }
}

// The sorted ids visit bags in random order: gather the gradient rows of this store's
// features bag-major (feature f's bags contiguous, (B, D_f)), already divided by the bag
// length for mean pooling (the same division as the direct path: same bits). A feature's
// block is then a few hundred KiB of consecutive pages instead of B strided rows.
// Skipped (direct reads of grad_out) when there are fewer ids than two per bag.
struct GradRows {
  const BackwardArgs* A = nullptr;
  const float* gathered = nullptr;
  std::vector<int64_t> goff;  // (F,) first element of each feature's block
  uint32_t B32 = 1;

  GradRows(const BackwardArgs& args, int64_t n, HugeArray<float>& buf) : A(&args) {
    const Meta& M = *A->M;
    const int64_t FB = M.F * A->B;
    B32 = static_cast<uint32_t>(A->B);
    goff.assign(M.F, 0);
    int64_t gsize = 0;
    for (int64_t f = 0; f < M.F; ++f) {
      goff[f] = gsize;
      if (M.feat_table[f] >= 0) gsize += A->B * M.dims[M.feat_table[f]];
    }
    if (n < 2 * FB) return;
    if (static_cast<int64_t>(buf.size()) < gsize) buf.resize(gsize);
    float* gt = buf.data();
    at::parallel_for(0, FB, 512, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t f = s / A->B, b = s % A->B, t = M.feat_table[f];
        if (t < 0) continue;
        const int64_t D = M.dims[t];
        const float* go = A->grad + b * A->ld + M.feat_cols[f];
        float* dst = gt + goff[f] + b * D;
        const float L = bag_divisor(s, f);
        if (L != 1.0f) {
          for (int64_t d = 0; d < D; ++d) dst[d] = go[d] / L;
        } else {
          std::memcpy(dst, go, D * 4);
        }
      }
    });
    gathered = gt;
  }
  float bag_divisor(int64_t s, int64_t f) const {
    return A->M->feat_mean[f] ? static_cast<float>(A->offsets[s + 1] - A->offsets[s]) : 1.0f;
  }
  // Gradient row of bag s; *f_out = its feature, *L_out = the divisor still to apply.
  const float* row(int64_t s, int64_t* f_out, float* L_out) const {
    const Meta& M = *A->M;
    const uint32_t f = static_cast<uint32_t>(s) / B32, b = static_cast<uint32_t>(s) - f * B32;
    *f_out = f;
    if (gathered != nullptr) {
      *L_out = 1.0f;
      return gathered + goff[f] + static_cast<int64_t>(b) * M.dims[M.feat_table[f]];
    }
    *L_out = bag_divisor(s, f);
    return A->grad + static_cast<int64_t>(b) * A->ld + M.feat_cols[f];
  }
};

// One range of sorted ids per part (thread), each starting at a new row: (parts+1,).
inline std::vector<int64_t> row_aligned_bounds(const uint64_t* keys, int64_t n) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 4096));
  std::vector<int64_t> bounds(parts + 1, n);
  bounds[0] = 0;
  for (int64_t p = 1; p < parts; ++p) {
    int64_t k = std::max(bounds[p - 1], n * p / parts);
    while (k > 0 && k < n && (keys[k] >> 32) == (keys[k - 1] >> 32)) ++k;
    bounds[p] = k;
  }
  return bounds;
}

// Everything one part of the update needs.
struct UpdateCtx {
  const BackwardArgs* A;
  const uint64_t* keys;
  const int32_t* seg;  // position -> bag, when keys hold positions
  const GradRows* grads;
  uint8_t* base;
  int64_t bag_of(uint64_t k) const {
    const int64_t low = static_cast<int64_t>(k & 0xFFFFFFFFULL);
    return A->psw != nullptr ? seg[low] : low;
  }
};

constexpr int64_t kGradAhead = 4;  // ids of a row whose gradients are prefetched ahead

// Sum the gradients of the ids [*k, end of their row) into acc (w: the decoded row, for
// the per-id weight gradient); advances *k past them.
inline void sum_row_grads(const UpdateCtx& C, int64_t* k, int64_t k_end, int64_t D,
                          const float* w, float* acc) {
  const BackwardArgs& A = *C.A;
  const uint64_t key = C.keys[*k] >> 32;
  std::fill(acc, acc + D, 0.0f);
  for (; *k < k_end && (C.keys[*k] >> 32) == key; ++*k) {
    const int64_t j = static_cast<int64_t>(C.keys[*k] & 0xFFFFFFFFULL);
    int64_t f;
    float L;
    if (*k + kGradAhead < k_end && (C.keys[*k + kGradAhead] >> 32) == key)  // a long row
      prefetch_row(reinterpret_cast<const uint8_t*>(
                       C.grads->row(C.bag_of(C.keys[*k + kGradAhead]), &f, &L)),
                   D * 4);
    const float* go = C.grads->row(C.bag_of(C.keys[*k]), &f, &L);
    if (A.psw != nullptr) {
      if (A.psw_grad != nullptr) {
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += (go[d] / L) * w[d];
        A.psw_grad[j] = dot;
      }
      const float pw = A.psw[j];
      for (int64_t d = 0; d < D; ++d) acc[d] += (go[d] / L) * pw;
    } else if (L != 1.0f) {
      for (int64_t d = 0; d < D; ++d) acc[d] += go[d] / L;
    } else {
      for (int64_t d = 0; d < D; ++d) acc[d] += go[d];
    }
  }
}

// Update the rows of sorted ids [k, k_end), kBatch rows at a time, prefetching the row,
// its state and the gradients of its ids kAhead rows ahead. FP32 rows are updated where
// they lie (decoding and encoding them would be two plain copies); other precisions are
// decoded to FP32, updated and encoded back.
template <class Codec>
void update_range(const UpdateCtx& C, int64_t k, int64_t k_end) {
  constexpr bool in_place = std::is_same_v<Codec, F32>;
  const BackwardArgs& A = *C.A;
  const Meta& M = *A.M;
  const bool rowwise = A.kind == Kind::kRowwiseAdagrad;
  std::vector<float> wbuf(in_place ? 0 : kBatch * M.max_dim), abuf(kBatch * M.max_dim);
  float *wp[kBatch], *ap[kBatch];
  uint8_t* rps[kBatch];
  int64_t ts[kBatch], rows[kBatch], Ds[kBatch];
  uint64_t rkeys[kBatch];
  auto locate = [&](uint64_t key, int64_t* t, int64_t* row) -> uint8_t* {
    int64_t f;
    float L;
    C.grads->row(C.bag_of(key), &f, &L);
    *t = M.feat_table[f];
    *row = static_cast<int64_t>(key >> 32) - M.row_off[*t];
    return C.base + (M.w_off[*t] + *row * Codec::width(M.dims[*t])) * Codec::kElem;
  };
  int64_t kc = k;  // look-ahead cursor: start of a later row
  auto advance_prefetch = [&]() {
    if (kc >= k_end) return;
    const uint64_t key = C.keys[kc];
    int64_t tp, rp, fp;
    float Lp;
    const uint8_t* r = locate(key, &tp, &rp);
    const int64_t bytes = Codec::width(M.dims[tp]) * Codec::kElem;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(r + b, in_place ? 1 : 0);
    if (rowwise) __builtin_prefetch(A.state[0] + A.state_off[0][tp] + rp, 1);
    // The gradients of the row's first kGradAhead ids; sum_row_grads prefetches the rest
    // of a long (hot) row as it goes, instead of thousands of rows here at once.
    for (int64_t i = 0; kc < k_end && (C.keys[kc] >> 32) == (key >> 32); ++kc, ++i)
      if (i < kGradAhead)
        prefetch_row(
            reinterpret_cast<const uint8_t*>(C.grads->row(C.bag_of(C.keys[kc]), &fp, &Lp)),
            M.dims[tp] * 4);
  };
  for (int64_t i = 0; i < kBatch; ++i) {
    wp[i] = in_place ? nullptr : wbuf.data() + i * M.max_dim;
    ap[i] = abuf.data() + i * M.max_dim;
  }
  for (int64_t i = 0; i < kAhead; ++i) advance_prefetch();
  while (k < k_end) {
    int nb = 0;
    for (; nb < kBatch && k < k_end; ++nb) {
      advance_prefetch();
      rps[nb] = locate(C.keys[k], &ts[nb], &rows[nb]);
      rkeys[nb] = static_cast<uint64_t>(M.row_keys[ts[nb]]) + static_cast<uint64_t>(rows[nb]);
      Ds[nb] = M.dims[ts[nb]];
      if constexpr (in_place) {
        wp[nb] = reinterpret_cast<float*>(rps[nb]);
      } else {
        Codec::load(rps[nb], Ds[nb], wp[nb]);
      }
      sum_row_grads(C, &k, k_end, Ds[nb], wp[nb], ap[nb]);
    }
    if (rowwise) {
      rowwise_adagrad_batch(A, nb, ts, rows, Ds, wp, ap);
    } else {
      for (int i = 0; i < nb; ++i) apply_rule(A, ts[i], rows[i], Ds[i], wp[i], ap[i]);
    }
    if constexpr (!in_place) {
      for (int i = 0; i < nb; ++i)
        Codec::store(rps[i], Ds[i], wp[i], A.stochastic,
                     mix64(A.seed ^ (rkeys[i] * 0xA24BAED4963EE407ULL)), M.col_starts[ts[i]]);
    }
  }
}

template <class Codec, typename Idx>
void backward_impl(at::Tensor& weights, const BackwardArgs& A, const Idx* values, int64_t N) {
  const Meta& M = *A.M;
  TETRAREC_CHECK(N < (int64_t(1) << 31) && M.F * A.B < (int64_t(1) << 31),
              "tetrarec tbe backward: batch too large: ", N, " ids and ", M.F * A.B,
              " bags, each must be below 2^31");
  Scratch& S = scratch();
  int64_t n = 0;
  const uint64_t* keys = sorted_keys(A, values, S, &n);
  const GradRows grads(A, n, S.grad);
  const UpdateCtx C{&A, keys, S.seg.data(), &grads, reinterpret_cast<uint8_t*>(weights.data_ptr())};
  const std::vector<int64_t> bounds = row_aligned_bounds(keys, n);
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t p0, int64_t p1) {
    update_range<Codec>(C, bounds[p0], bounds[p1]);
  });
}

// ---- row-wise shares of one table (column-split tables, sharding/block_group.py) ----

// The store's meta with every feature of a table other than t marked "another store"
// (-1): sorted_keys and GradRows then sort and gather table t's ids only.
struct OneTableMeta {
  std::vector<int64_t> feat_table;
  Meta M;
  OneTableMeta(const Meta& all, int64_t t)
      : feat_table(all.feat_table, all.feat_table + all.F), M(all) {
    for (int64_t& ft : feat_table) ft = ft == t ? t : -1;
    M.feat_table = feat_table.data();
  }
  OneTableMeta(const OneTableMeta&) = delete;  // M points into feat_table
  OneTableMeta& operator=(const OneTableMeta&) = delete;
};

// Number of unique rows among sorted ids [k0, k1) (one part of row_aligned_bounds).
inline int64_t count_rows(const uint64_t* keys, int64_t k0, int64_t k1) {
  int64_t u = 0;
  for (int64_t k = k0; k < k1; ++k) u += k == k0 || (keys[k] >> 32) != (keys[k - 1] >> 32);
  return u;
}

// For table t (A.M masked by OneTableMeta): its touched rows, sorted and unique, and per
// row share = sum_d g'_d^2, g' = the row's summed gradient + wd * w (w the stored row,
// decoded). Every step is the backward's own: sorted_keys (the same order of a row's
// ids, by position), GradRows and sum_row_grads (the same per-id gradients, mean
// division and per-id weights, summed in the same order), add_weight_decay and
// sum_squares; so `share` is bitwise the sum of squares the row-wise update of the
// whole table would compute. Rows are split over threads by row_aligned_bounds, each
// row computed by one thread alone: the results do not depend on the thread count.
template <class Codec, typename Idx>
void row_shares_impl(const at::Tensor& weights, const BackwardArgs& A, const Idx* values,
                     int64_t t, at::Tensor* rows_out, at::Tensor* share_out) {
  const Meta& M = *A.M;
  Scratch& S = scratch();
  int64_t n = 0;
  const uint64_t* keys = sorted_keys(A, values, S, &n);
  const GradRows grads(A, n, S.grad);
  const uint8_t* table =
      reinterpret_cast<const uint8_t*>(weights.data_ptr()) + M.w_off[t] * Codec::kElem;
  const UpdateCtx C{&A, keys, S.seg.data(), &grads, nullptr};
  const std::vector<int64_t> bounds = row_aligned_bounds(keys, n);
  const int64_t parts = static_cast<int64_t>(bounds.size()) - 1;
  std::vector<int64_t> first(parts + 1, 0);  // first output slot of each part
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) first[p + 1] = count_rows(keys, bounds[p], bounds[p + 1]);
  });
  for (int64_t p = 0; p < parts; ++p) first[p + 1] += first[p];
  *rows_out = at::empty({first[parts]}, at::kLong);
  *share_out = at::empty({first[parts]}, at::kFloat);
  int64_t* rows = rows_out->data_ptr<int64_t>();
  float* share = share_out->data_ptr<float>();
  const int64_t D = M.dims[t], roff = M.row_off[t], bytes = Codec::width(D) * Codec::kElem;
  // The ids' gradient rows (and, with weight decay, the table rows) are read at random:
  // prefetch those of the ids kIdsAhead positions ahead so that the reads overlap.
  constexpr int64_t kIdsAhead = 16;
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> w(D), acc(D);
    int64_t f;
    float L;
    for (int64_t p = p0; p < p1; ++p) {
      int64_t u = first[p], kp = bounds[p];
      for (int64_t k = bounds[p]; k < bounds[p + 1]; ++u) {
        for (const int64_t ke = std::min(bounds[p + 1], k + kIdsAhead); kp < ke; ++kp) {
          prefetch_row(
              reinterpret_cast<const uint8_t*>(C.grads->row(C.bag_of(keys[kp]), &f, &L)), D * 4);
          if (A.wd != 0.0f && (kp == bounds[p] || (keys[kp] >> 32) != (keys[kp - 1] >> 32)))
            prefetch_row(table + (static_cast<int64_t>(keys[kp] >> 32) - roff) * bytes, bytes);
        }
        const int64_t row = static_cast<int64_t>(keys[k] >> 32) - roff;
        if (A.wd != 0.0f) Codec::load(table + row * bytes, D, w.data());
        sum_row_grads(C, &k, bounds[p + 1], D, w.data(), acc.data());
        if (A.wd != 0.0f) add_weight_decay(A.wd, w.data(), acc.data(), D);
        rows[u] = row;
        share[u] = sum_squares(acc.data(), D);
      }
    }
  });
}

}  // namespace
