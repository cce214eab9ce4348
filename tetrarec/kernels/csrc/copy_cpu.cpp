// Row-wise copies of column runs: how a sharded collection puts each rank's block of
// pooled columns back in feature order (and the gradient back into blocks).
//
// torch.cat over column slices, or a strided copy_, moves a (1024, 64) FP32 run at about a
// third of memcpy's speed; here each row of each run is one memcpy, rows outermost so the
// destination row is written in order while it is in cache.
#include "check.h"
#include "copy_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace tetrarec {

void copy_row_runs(const at::Tensor& src, at::Tensor& dst, const at::Tensor& runs, int64_t rows) {
  TETRAREC_CHECK(src.is_contiguous() && dst.is_contiguous(), "copy_row_runs: contiguous buffers");
  TETRAREC_CHECK(src.scalar_type() == dst.scalar_type(), "copy_row_runs: one dtype");
  TETRAREC_CHECK(runs.scalar_type() == at::kLong && runs.dim() == 2 && runs.size(1) == 5 &&
                  runs.is_contiguous() && runs.device().is_cpu(),
              "copy_row_runs: runs is a contiguous (R, 5) int64 CPU tensor");
  const int64_t R = runs.size(0), elem = static_cast<int64_t>(src.element_size());
  const int64_t* run = runs.data_ptr<int64_t>();
  const int64_t src_n = src.numel(), dst_n = dst.numel();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t* p = run + 5 * r;
    const int64_t n = p[4];
    if (n == 0 || rows == 0) continue;
    TETRAREC_CHECK(n > 0 && p[0] >= 0 && p[1] >= 0 && p[2] >= 0 && p[3] >= 0,
                "copy_row_runs: negative offset, stride or length in run ", r);
    TETRAREC_CHECK(p[0] + (rows - 1) * p[1] + n <= src_n && p[2] + (rows - 1) * p[3] + n <= dst_n,
                "copy_row_runs: run ", r, " reaches past its buffer");
  }
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  int64_t bytes_per_row = 0;
  for (int64_t r = 0; r < R; ++r) bytes_per_row += run[5 * r + 4] * elem;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(bytes_per_row, 1));
  at::parallel_for(0, rows, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t r = 0; r < R; ++r) {
        const int64_t* p = run + 5 * r;
        if (p[4] == 0) continue;
        std::memcpy(d + (p[2] + b * p[3]) * elem, s + (p[0] + b * p[1]) * elem, p[4] * elem);
      }
    }
  });
}

}  // namespace tetrarec
