// The paged KV cache: every layer's keys and values in fixed-size blocks of positions. Which block
// holds which positions of which sequence is the caller's business (the Python block manager hands
// out block ids; a step carries them as block tables and a slot mapping). Block 0 is reserved: the
// padded rows of a batched CUDA graph write their keys/values there, so no kernel needs a "skip" case.
#pragma once
#include "llaisys/step_batch.hpp"

#include <cstdint>

namespace llaisys::runtime {

using llaisys::StepBatch;

class KVPool {
public:
    KVPool(int64_t num_layers, int64_t num_blocks, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
           DType dtype, Device device);
    // Bytes one block takes over all layers (keys and values): what a memory budget is divided by.
    static int64_t block_bytes(int64_t num_layers, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
                               DType dtype);

    int64_t num_layers() const { return k_.size(0); }
    int64_t num_blocks() const { return k_.size(1); }
    int64_t block_size() const { return k_.size(2); }
    DType dtype() const { return k_.dtype(); }
    Device device() const { return k_.device(); }
    int64_t nbytes() const { return 2 * k_.numel() * int64_t(k_.element_size()); }

    // What a model's step reads and writes (llaisys/step_batch.hpp).
    KVView view() const { return {k_, v_}; }
    Tensor keys(int64_t layer) const { return view().keys(layer); }
    Tensor values(int64_t layer) const { return view().values(layer); }

private:
    Tensor k_, v_; // [layers, num_blocks, block_size, nkvh, hd]
};

} // namespace llaisys::runtime
