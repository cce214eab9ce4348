// The DLRM dot interaction on CPU (see interaction_cpu.cpp).
#pragma once

#include <torch/extension.h>

#include <tuple>

namespace tetrarec {

// [dense | pairwise dots of the rows (dense, e_0, ..., e_{F-1}), lower triangle]
at::Tensor dot_interaction_forward(const at::Tensor& dense, const at::Tensor& embeddings);

// (grad dense, grad embeddings) for the gradient of dot_interaction_forward's output
std::tuple<at::Tensor, at::Tensor> dot_interaction_backward(
    const at::Tensor& grad_out, const at::Tensor& dense, const at::Tensor& embeddings);

// [dense | pairwise dots of the rows rounded to BF16, FP32 sums]; forward only. native:
// the AVX512_BF16 kernel where this build has it (else the rounded-FP32 one, same bound).
at::Tensor dot_interaction_bf16_forward(const at::Tensor& dense, const at::Tensor& embeddings,
                                        bool native);

// Whether this build has the AVX512_BF16 kernel.
bool dot_interaction_bf16_native();

}  // namespace tetrarec
