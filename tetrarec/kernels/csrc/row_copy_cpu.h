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
// Each row is decoded or encoded by the row codecs of tbe_cpu.cpp, so the bits are the
// fused kernels' and reference.load_rows / reference.store_rows's. Rows are independent:
// any thread count gives the same bits. Included by tbe_cpu.cpp after its codecs.
#pragma once

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
                 op, ": src and dst must be contiguous 2-D row buffers");
  for (const at::Tensor* ix : {&src_index, &dst_index})
    TETRAREC_CHECK(ix->scalar_type() == at::kLong && ix->dim() == 1 && ix->is_contiguous(), op,
                   ": src_index and dst_index must be contiguous 1-D int64");
  TETRAREC_CHECK(src_index.numel() == dst_index.numel(), op, ": ", src_index.numel(),
                 " source and ", dst_index.numel(), " destination indices");
  RowCopyArgs a{src_index.numel(), D, src.size(0), dst.size(0), src_index.data_ptr<int64_t>(),
                dst_index.data_ptr<int64_t>()};
  for (int64_t j = 0; j < a.n; ++j) {
    TETRAREC_CHECK(a.src_index[j] >= 0 && a.src_index[j] < a.src_rows, op, ": source row ",
                   a.src_index[j], " is outside 0..", a.src_rows - 1);
    TETRAREC_CHECK(a.dst_index[j] >= 0 && a.dst_index[j] < a.dst_rows, op, ": destination row ",
                   a.dst_index[j], " is outside 0..", a.dst_rows - 1);
  }
  return a;
}

constexpr int64_t kRowCopyGrain = 256;

void load_rows(const at::Tensor& src, const at::Tensor& src_index, at::Tensor& dst,
               const at::Tensor& dst_index, const std::string& precision) {
  TETRAREC_CHECK(dst.scalar_type() == at::kFloat, "tetrarec load_rows: dst must be float32, got ",
                 dst.scalar_type());
  const int64_t D = dst.dim() == 2 ? dst.size(1) : 0;
  const RowCopyArgs a = row_copy_args(src, src_index, dst, dst_index, D, "tetrarec load_rows");
  dispatch_codec(src, precision, [&](auto codec) {
    using Codec = decltype(codec);
    const int64_t width = Codec::width(D);
    TETRAREC_CHECK(src.size(1) == width, "tetrarec load_rows: ", precision, " rows of dim ", D,
                   " are ", width, " wide, src is ", src.size(1));
    const uint8_t* s = static_cast<const uint8_t*>(src.data_ptr());
    float* d = dst.data_ptr<float>();
    at::parallel_for(0, a.n, kRowCopyGrain, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j)
        Codec::load(s + a.src_index[j] * width * Codec::kElem, D, d + a.dst_index[j] * D);
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
  const RowCopyArgs a = row_copy_args(src, src_index, dst, dst_index, D, "tetrarec store_rows");
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
        const uint64_t key = row_key + static_cast<uint64_t>(a.dst_index[j]);
        Codec::store(d + a.dst_index[j] * width * Codec::kElem, D, s + a.src_index[j] * D, sr,
                     mix64(step ^ (key * 0xA24BAED4963EE407ULL)), col0);
      }
    });
  });
}

}  // namespace
