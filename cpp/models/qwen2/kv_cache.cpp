#include "llaisys/ops.hpp"
#include "llaisys/qwen2.hpp"

namespace llaisys::models {

KVCache::KVCache(int64_t num_layers, int num_slots, int64_t max_seq_len, int64_t num_kv_heads, int64_t head_dim,
                 DType dtype, Device device)
    : max_seq_len_(max_seq_len), lengths_(size_t(num_slots), 0) {
    LLAISYS_CHECK(num_slots >= 1 && max_seq_len >= 1, std::invalid_argument,
                  "KVCache: need at least one slot and one position, got ", num_slots, " slots and max_seq_len ",
                  max_seq_len);
    const Shape shape{num_layers, num_slots, max_seq_len, num_kv_heads, head_dim};
    k_ = Tensor::empty(shape, dtype, device);
    v_ = Tensor::empty(shape, dtype, device);
}

void KVCache::check_slot(int slot) const {
    LLAISYS_CHECK(slot >= 0 && slot < num_slots(), std::out_of_range, "KVCache: slot ", slot, " out of range (",
                  num_slots(), " slots)");
}

int64_t KVCache::length(int slot) const {
    check_slot(slot);
    return lengths_[slot];
}

void KVCache::truncate(int slot, int64_t length) {
    check_slot(slot);
    LLAISYS_CHECK(length >= 0 && length <= lengths_[slot], std::invalid_argument, "KVCache: cannot truncate slot ",
                  slot, " of length ", lengths_[slot], " to ", length);
    lengths_[slot] = length;
}

void KVCache::advance(int slot, int64_t n) {
    check_slot(slot);
    LLAISYS_CHECK(lengths_[slot] + n <= max_seq_len_, std::invalid_argument, "KVCache: slot ", slot, " would hold ",
                  lengths_[slot] + n, " positions, more than max_seq_len ", max_seq_len_);
    lengths_[slot] += n;
}

void KVCache::write(int layer, int slot, const Tensor &positions, const Tensor &k, const Tensor &v) {
    check_slot(slot);
    ops::index_copy(k_.select(0, layer).select(0, slot), positions, k);
    ops::index_copy(v_.select(0, layer).select(0, slot), positions, v);
}

Tensor KVCache::keys(int layer, int slot, int64_t start, int64_t n) const {
    check_slot(slot);
    return k_.select(0, layer).select(0, slot).slice(0, start, start + n);
}

Tensor KVCache::values(int layer, int slot, int64_t start, int64_t n) const {
    check_slot(slot);
    return v_.select(0, layer).select(0, slot).slice(0, start, start + n);
}

} // namespace llaisys::models
