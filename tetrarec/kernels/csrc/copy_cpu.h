// Row-wise copies of column runs between two row-major buffers (see copy_cpu.cpp).
#pragma once

#include <torch/extension.h>

namespace tetrarec {

// For every row b < rows and every run r of `runs` ((R, 5) int64: src_offset,
// src_row_stride, dst_offset, dst_row_stride, length, in elements):
//   dst[dst_offset + b * dst_row_stride + i] = src[src_offset + b * src_row_stride + i]
// for i < length. src and dst are flat, contiguous and of one dtype.
void copy_row_runs(const at::Tensor& src, at::Tensor& dst, const at::Tensor& runs, int64_t rows);

}  // namespace tetrarec
