#include "llaisys/kv_pool.hpp"

namespace llaisys::runtime {

KVPool::KVPool(int64_t num_layers, int64_t num_blocks, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
               DType dtype, Device device) {
    LLAISYS_CHECK(num_layers > 0 && num_kv_heads > 0 && head_dim > 0, std::invalid_argument,
                  "KVPool: layers, kv heads and head_dim must be positive, got ", num_layers, ", ", num_kv_heads,
                  ", ", head_dim);
    LLAISYS_CHECK(num_blocks >= 2, std::invalid_argument, "KVPool: need at least 2 blocks (block 0 is reserved), got ",
                  num_blocks, "; give the KV cache more memory");
    LLAISYS_CHECK(block_size >= 1 && block_size <= 1024, std::invalid_argument,
                  "KVPool: block_size must be in [1, 1024], got ", block_size);
    const Shape shape{num_layers, num_blocks, block_size, num_kv_heads, head_dim};
    // On CUDA zeroed once: block 0 and unwritten rows are read by nothing but padded graph rows, and
    // finite values there keep those rows' (discarded) results finite. The CPU runs no padded rows, so
    // its pool is left unwritten: pages the OS has not handed out yet cost no memory until a block is used.
    k_ = device.is_cuda() ? Tensor::zeros(shape, dtype, device) : Tensor::empty(shape, dtype, device);
    v_ = device.is_cuda() ? Tensor::zeros(shape, dtype, device) : Tensor::empty(shape, dtype, device);
}

int64_t KVPool::block_bytes(int64_t num_layers, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
                            DType dtype) {
    return 2 * num_layers * block_size * num_kv_heads * head_dim * int64_t(dtype_size(dtype));
}

} // namespace llaisys::runtime
