// What one step of a model reads: the batch (StepBatch) and the paged KV cache it writes and attends over
// (KVView). Both sit below the runtime (which builds them) and the models (which read them), so calls go
// one way: runtime -> models -> ops.
#pragma once
#include "llaisys/tensor.hpp"

#include <cstdint>

namespace llaisys {

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

// Every layer's keys and values in fixed-size blocks of positions: k, v [layers, num_blocks, block_size,
// nkvh, hd]. Block 0 is reserved for the padded rows of batched CUDA graphs (runtime::KVPool owns it).
struct KVView {
    Tensor k, v;
    int64_t num_layers() const { return k.size(0); }
    int64_t num_blocks() const { return k.size(1); }
    int64_t block_size() const { return k.size(2); }
    DType dtype() const { return k.dtype(); }
    Device device() const { return k.device(); }
    Tensor keys(int64_t layer) const { return k.select(0, layer); }   // [num_blocks, block_size, nkvh, hd]
    Tensor values(int64_t layer) const { return v.select(0, layer); } // [num_blocks, block_size, nkvh, hd]
    // The same memory as rows: slot s = block * block_size + offset is row s ([num_blocks * block_size, nkvh, hd]).
    Tensor key_rows(int64_t layer) const { return rows(keys(layer)); }
    Tensor value_rows(int64_t layer) const { return rows(values(layer)); }

private:
    Tensor rows(const Tensor &t) const { return t.view({t.size(0) * t.size(1), t.size(2), t.size(3)}); }
};

} // namespace llaisys
