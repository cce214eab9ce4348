// Fused backward + sparse optimizer for CPU; included by tbe_cpu.cpp (same namespace).
#pragma once

namespace {

enum class Kind { kSgd, kAdagrad, kRowwiseAdagrad, kAdam, kRowwiseAdam };

Kind optim_kind(const std::string& name) {
  if (name == "sgd") return Kind::kSgd;
  if (name == "adagrad") return Kind::kAdagrad;
  if (name == "rowwise_adagrad") return Kind::kRowwiseAdagrad;
  if (name == "adam") return Kind::kAdam;
  if (name == "rowwise_adam") return Kind::kRowwiseAdam;
  TORCH_CHECK(false, "tetrarec tbe: unknown optimizer ", name);
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

// The rules of optim_rules.py, one row at a time; `g` is the summed gradient (clobbered).
inline void apply_rule(const BackwardArgs& A, int64_t t, int64_t row, int64_t D, float* w,
                       float* g) {
  if (A.wd != 0.0f)
    for (int64_t d = 0; d < D; ++d) g[d] += A.wd * w[d];
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
      float sq = 0.0f;
      for (int64_t d = 0; d < D; ++d) sq += g[d] * g[d];
      *m += sq / static_cast<float>(D);
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
      const float b1 = static_cast<float>(A.beta1), b2 = static_cast<float>(A.beta2);
      const double bc1 = 1.0 - std::pow(A.beta1, static_cast<double>(*step));
      const float bc2s = static_cast<float>(std::sqrt(1.0 - std::pow(A.beta2, static_cast<double>(*step))));
      const float step_size = static_cast<float>(A.lr / bc1);
      if (rowwise) {
        float sq = 0.0f;
        for (int64_t d = 0; d < D; ++d) sq += g[d] * g[d];
        *v = *v * b2 + (1.0f - b2) * (sq / static_cast<float>(D));
      }
      for (int64_t d = 0; d < D; ++d) {
        m[d] += (1.0f - b1) * (g[d] - m[d]);
        float vd;
        if (rowwise) {
          vd = *v;
        } else {
          v[d] = v[d] * b2 + (1.0f - b2) * (g[d] * g[d]);
          vd = v[d];
        }
        w[d] -= m[d] / (std::sqrt(vd) / bc2s + A.eps) * step_size;
      }
      break;
    }
  }
}

// Stable LSD radix sort of (key << 32 | position) on the key bits; parallel over chunks.
// Stability makes the result independent of the chunking, hence of the thread count.
void radix_sort_keys(std::vector<uint64_t>& a, int key_bits) {
  constexpr int kDigit = 13, kBuckets = 1 << kDigit;  // 2 passes for up to 2^26 rows
  const int64_t n = static_cast<int64_t>(a.size());
  if (n < 2) return;
  std::vector<uint64_t> tmp(n);
  // Parallel only when large: each parallel region costs a barrier.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 262144));
  const int64_t chunk = (n + parts - 1) / parts;
  std::vector<int64_t> hist(parts * kBuckets);
  for (int shift = 32; shift < 32 + key_bits; shift += kDigit) {
    std::fill(hist.begin(), hist.end(), 0);
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        int64_t* h = hist.data() + p * kBuckets;
        for (int64_t i = p * chunk; i < std::min(n, (p + 1) * chunk); ++i)
          ++h[(a[i] >> shift) & (kBuckets - 1)];
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
        for (int64_t i = p * chunk; i < std::min(n, (p + 1) * chunk); ++i)
          tmp[h[(a[i] >> shift) & (kBuckets - 1)]++] = a[i];
      }
    });
    a.swap(tmp);
  }
}

// Sorted (key << 32 | low) pairs of every id of the group's features, where low is the
// id's position j when per-id weights need it, else its bag s = f * B + b (which saves a
// random lookup of seg[j] per id later). seg[j] = s is filled only in the first case.
template <typename Idx>
std::vector<uint64_t> sorted_keys(const BackwardArgs& A, const Idx* values, std::vector<int32_t>& seg) {
  const Meta& M = *A.M;
  const bool by_position = A.psw != nullptr;
  std::vector<uint64_t> keys;
  keys.reserve(A.offsets[M.F * A.B]);
  int64_t total_rows = 1;
  for (int64_t f = 0; f < M.F; ++f) {
    const int64_t t = M.feat_table[f];
    for (int64_t s = f * A.B; s < (f + 1) * A.B; ++s) {
      for (int64_t j = A.offsets[s]; j < A.offsets[s + 1]; ++j) {
        if (by_position) seg[j] = static_cast<int32_t>(s);
        if (t < 0) continue;
        const int64_t id = static_cast<int64_t>(values[j]);
        TORCH_CHECK(id >= 0 && id < M.rows[t], "tetrarec tbe backward: id ", id,
                    " outside table of ", M.rows[t], " rows");
        const uint64_t low = static_cast<uint64_t>(by_position ? j : s);
        keys.push_back(static_cast<uint64_t>(M.row_off[t] + id) << 32 | low);
      }
    }
    if (t >= 0) total_rows = std::max(total_rows, M.row_off[t] + M.rows[t]);
  }
  TORCH_CHECK(total_rows < (int64_t(1) << 32), "tetrarec tbe: more than 2^32 rows in one store");
  int bits = 1;
  while ((int64_t(1) << bits) < total_rows) ++bits;
  radix_sort_keys(keys, bits);
  return keys;
}

template <class Codec, typename Idx>
void backward_impl(at::Tensor& weights, const BackwardArgs& A, const Idx* values, int64_t N) {
  const Meta& M = *A.M;
  TORCH_CHECK(N < (int64_t(1) << 31) && M.F * A.B < (int64_t(1) << 31), "batch too large");
  std::vector<int32_t> seg(A.psw != nullptr ? N : 0);
  const std::vector<uint64_t> keys = sorted_keys(A, values, seg);
  const bool by_position = A.psw != nullptr;
  auto bag_of = [&](uint64_t k) -> int64_t {
    const int64_t low = static_cast<int64_t>(k & 0xFFFFFFFFULL);
    return by_position ? seg[low] : low;
  };
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < static_cast<int64_t>(keys.size()); ++i)
    if (i == 0 || (keys[i] >> 32) != (keys[i - 1] >> 32)) starts.push_back(i);
  starts.push_back(static_cast<int64_t>(keys.size()));
  uint8_t* base = reinterpret_cast<uint8_t*>(weights.data_ptr());
  const int64_t U = static_cast<int64_t>(starts.size()) - 1;
  auto row_of = [&](int64_t u, int64_t* t_out) {
    const int64_t t = M.feat_table[bag_of(keys[starts[u]]) / A.B];
    *t_out = t;
    return static_cast<int64_t>(keys[starts[u]] >> 32) - M.row_off[t];
  };
  at::parallel_for(0, U, 64, [&](int64_t u0, int64_t u1) {
    std::vector<float> w(M.max_dim), acc(M.max_dim);
    for (int64_t u = u0; u < u1; ++u) {
      if (u + kAhead < u1) {  // prefetch a later row, its state and its first gradient
        int64_t tp;
        const int64_t rp = row_of(u + kAhead, &tp);
        const int64_t width = Codec::width(M.dims[tp]);
        prefetch_row(base + (M.w_off[tp] + rp * width) * Codec::kElem, width * Codec::kElem);
        if (A.kind == Kind::kRowwiseAdagrad) __builtin_prefetch(A.state[0] + A.state_off[0][tp] + rp);
        const int64_t sp = bag_of(keys[starts[u + kAhead]]);
        prefetch_row(reinterpret_cast<const uint8_t*>(A.grad + (sp % A.B) * A.ld + M.feat_cols[sp / A.B]),
                     M.dims[tp] * 4);
      }
      const uint64_t key = keys[starts[u]] >> 32;
      const int64_t t = M.feat_table[bag_of(keys[starts[u]]) / A.B];
      const int64_t D = M.dims[t], row = static_cast<int64_t>(key) - M.row_off[t];
      uint8_t* rp = base + (M.w_off[t] + row * Codec::width(D)) * Codec::kElem;
      Codec::load(rp, D, w.data());
      std::fill(acc.begin(), acc.begin() + D, 0.0f);
      for (int64_t k = starts[u]; k < starts[u + 1]; ++k) {
        const int64_t j = static_cast<int64_t>(keys[k] & 0xFFFFFFFFULL), s = bag_of(keys[k]);
        const int64_t f = s / A.B, b = s % A.B;
        const float* go = A.grad + b * A.ld + M.feat_cols[f];
        const float L = M.feat_mean[f] ? static_cast<float>(A.offsets[s + 1] - A.offsets[s]) : 1.0f;
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
      apply_rule(A, t, row, D, w.data(), acc.data());
      Codec::store(rp, D, w.data(), A.stochastic, mix64(A.seed ^ (key * 0xA24BAED4963EE407ULL)));
    }
  });
}

}  // namespace
