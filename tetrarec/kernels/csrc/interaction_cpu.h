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

}  // namespace tetrarec
