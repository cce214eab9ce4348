// Round FP32 values to the nearest BF16 value (ties to even), kept in FP32, in one pass.
//
// For the BF16 emulation of the dense path (tetrarec/models/precision.py): the same
// result as x.to(bfloat16).to(float32), without the BF16 temporary and its second pass,
// and in place when out is x. NaN stays NaN (quieted), infinities stay infinite.
#include "check.h"
#include "bf16_cpu.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace tetrarec {

void round_to_bf16_out(const at::Tensor& x, at::Tensor& out) {
  TETRAREC_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "round_to_bf16 (CPU kernel): FP32 tensors");
  TETRAREC_CHECK(x.is_contiguous() && out.is_contiguous() && x.numel() == out.numel(),
              "round_to_bf16 (CPU kernel): contiguous tensors of one size");
  const uint32_t* src = reinterpret_cast<const uint32_t*>(x.data_ptr<float>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<float>());
  at::parallel_for(0, x.numel(), 1 << 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint32_t u = src[i];
      const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
      const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
      dst[i] = nan ? ((u | 0x00400000u) & 0xFFFF0000u) : rounded;
    }
  });
}

}  // namespace tetrarec
