// The paged KV cache: every layer's keys and values in fixed-size blocks of positions. Which block
// holds which positions of which sequence is the caller's business (the Python block manager hands
// out block ids; a step carries them as block tables and a slot mapping). Block 0 is reserved: the
// padded rows of a batched CUDA graph write their keys/values there, so no kernel needs a "skip" case.
#pragma once
#include "llaisys/tensor.hpp"

#include <cstdint>

namespace llaisys::runtime {

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

    Tensor keys(int64_t layer) const;   // [num_blocks, block_size, nkvh, hd]
    Tensor values(int64_t layer) const; // [num_blocks, block_size, nkvh, hd]
    // The same memory as rows: slot s = block * block_size + offset is row s ([num_blocks * block_size, nkvh, hd]).
    Tensor key_rows(int64_t layer) const;
    Tensor value_rows(int64_t layer) const;

private:
    Tensor k_, v_; // [layers, num_blocks, block_size, nkvh, hd]
};

// One step's batch as device tensors: what every kernel of the step reads. B sequences, T tokens in all;
// sequence b's tokens are rows q_start[b] .. q_start[b+1]-1. Built by the Runner from host arrays.
struct StepBatch {
    Tensor ids;          // [T] i64 token ids
    Tensor pos;          // [T] i64 position of each token in its sequence (RoPE)
    Tensor slots;        // [T] i64 cache row of each token's key/value (block * block_size + offset)
    Tensor block_tables; // [B, max_blocks] i32
    Tensor q_start;      // [B + 1] i32
    Tensor kv_len;       // [B] i32 context length after this step
    Tensor last;         // [B] i64 row in [0, T) whose logits each sequence needs (its last token)
    int64_t max_q_len = 1; // host-side bound of any sequence's token count (sizes attention's grid)
    int64_t num_seqs() const { return kv_len.size(0); }
    int64_t num_tokens() const { return ids.size(0); }
};

} // namespace llaisys::runtime
