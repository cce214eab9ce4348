// FP32 -> nearest BF16 value, kept in FP32 (see bf16_cpu.cpp).
#pragma once

#include <torch/extension.h>

namespace tetrarec {

// out = x rounded to BF16 (ties to even); out may be x itself.
void round_to_bf16_out(const at::Tensor& x, at::Tensor& out);

}  // namespace tetrarec
