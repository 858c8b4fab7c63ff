// A matmul's weight in quantized blocks as plain pointers, for kernels other than
// quant_linear.cpp's own ops to run over it: a mixture of experts (moe.cpp) runs each expert's
// blocks at its offset in the layer's stacked tensors.
#pragma once

#include <ATen/core/Tensor.h>
#include <cstdint>

namespace pagedllm {

// Formats by ggml's type ids, except Q4_1: ours, packed in pairs of blocks, and MXFP4_IL: MXFP4
// repacked for the int8 outer-product kernel (quant_linear.cpp, mxfp4_interleave).
constexpr int64_t BLOCKS_Q4_1 = 3, BLOCKS_Q8_0 = 8, BLOCKS_MXFP4_IL = 1039;

struct BlockWeight {
  int64_t type;          // BLOCKS_Q4_1, BLOCKS_Q8_0, or a raw ggml type (Q5_0 6, Q5_1 7, Q4_K 12, Q5_K 13, Q6_K 14)
  const void* q;         // q4_1 pairs' nibbles, q8_0's codes, or the file's bytes
  const c10::Half* d;    // q4_1 / q8_0 scales (null for raw types)
  const c10::Half* m;    // q4_1 mins
  int64_t n, k;          // W [n, k]
};

// out [rows, n] = x [rows, k] . W^T, x and out bf16 (bf16 = true) or fp32, contiguous. Called from
// inside a parallel region it runs on the calling thread.
void block_matmul(const BlockWeight& w, const void* x, void* out, int64_t rows, bool bf16);

// Bytes (or elements) of one row of W [., k] in `type`'s storage; a bad type or K: c10::Error.
int64_t block_row_bytes(int64_t type, int64_t k);

}  // namespace pagedllm
