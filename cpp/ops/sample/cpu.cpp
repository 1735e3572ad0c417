#include "ops/sample/sample.hpp"

#include "ops/common/argmax_rows.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"
#include "ops/sample/sample_math.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

namespace llaisys::ops::cpu {

using namespace sampling;

namespace {

struct RowParams {
    float temperature;
    int top_k;
    float top_p;
    float min_p;
};

// Tokens that survive min_p, in index order: logit keys, fixed-point masses and indices (separate
// arrays so the threshold passes are vectorized loops over keys and masses).
struct Survivors {
    std::vector<uint32_t> key;
    std::vector<uint64_t> mass;
    std::vector<int32_t> idx; // V < 2^31 (checked by the op)

    // Mass of survivors whose key is >= th.
    uint64_t mass_from(uint32_t th) const {
        uint64_t z = 0;
        for (size_t i = 0; i < key.size(); ++i) z += key[i] >= th ? mass[i] : 0;
        return z;
    }
};

// Survivors of row [V] with max m (see sample_math.hpp for the weights) among its tokens whose key is >=
// floor, into s, whose capacity is reused: fresh megabyte-sized vectors for every row cost more in page
// faults than the sampling itself. chunk_max (kFloorChunk-token chunks' max keys, see top_k_floor), if
// given: chunks below the floor are not read. floor 0: every token.
constexpr int64_t kFloorChunk = 128;

template <typename T>
void find_survivors(Survivors &s, const T *row, int64_t V, float m, float inv_t, float min_p, float scale,
                    uint32_t floor = 0, const uint32_t *chunk_max = nullptr) {
    s.key.clear();
    s.mass.clear();
    s.idx.clear();
    for (int64_t i = 0; i < V; ++i) {
        if (chunk_max != nullptr && i % kFloorChunk == 0 && chunk_max[i / kFloorChunk] < floor) {
            i += kFloorChunk - 1; // no token of this chunk reaches the floor
            continue;
        }
        const float l = load(row, i);
        const uint32_t key = float_key(l);
        if (key < floor) continue;
        const float w = weight_of(scaled_diff(l, m, inv_t));
        if (!(w >= min_p)) continue;
        s.key.push_back(key);
        s.mass.push_back(to_mass(w, scale));
        s.idx.push_back(int32_t(i));
    }
}

// With top_k on, a floor under the k-th largest key, so that only the tokens above it pay for exp and the
// survivor arrays: the k-th largest of the maxima of the row's kFloorChunk-token chunks (into chunk_max).
// k distinct tokens reach it, so every token top_k can keep does. The survivors above it are also every
// survivor when fewer than k survive (min_p keeps the tokens above a weight, and all below the floor weigh
// less), so the rule's thresholds and draw over them are the rule's over the row (same tokens). 0 (no
// floor) where top_k is off, the row has fewer than k chunks, or no chunk holds a token above NaN's key.
template <typename T>
uint32_t top_k_floor(const T *row, int64_t V, int k, std::vector<uint32_t> &chunk_max, std::vector<uint32_t> &keys) {
    const int64_t chunks = (V + kFloorChunk - 1) / kFloorChunk;
    if (k <= 0 || chunks < k) return 0;
    chunk_max.resize(size_t(chunks));
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t end = std::min(V, (c + 1) * kFloorChunk);
        uint32_t best = 0;
        for (int64_t i = c * kFloorChunk; i < end; ++i) best = std::max(best, float_key(load(row, i)));
        chunk_max[size_t(c)] = best;
    }
    keys.assign(chunk_max.begin(), chunk_max.end());
    std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint32_t>());
    return keys[size_t(k - 1)];
}

// The k-th largest survivor key (k < survivors): the top_k threshold, by selection in O(V).
uint32_t kth_largest_key(const Survivors &s, int k, std::vector<uint32_t> &keys) {
    keys.assign(s.key.begin(), s.key.end());
    std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint32_t>());
    return keys[size_t(k - 1)];
}

struct KeyValue {
    uint32_t key;
    uint64_t value;
};

// The top_p threshold: the largest θ >= lo with mass(survivors with key >= θ) >= target. Binary search
// over the key bits like search_threshold, but each step drops the survivors the answer no longer
// depends on, so the work shrinks as the range narrows (a few passes over the row, not 32).
uint32_t mass_threshold(const Survivors &s, uint32_t lo, uint64_t target, std::vector<KeyValue> &c) {
    c.clear();
    for (size_t i = 0; i < s.key.size(); ++i)
        if (s.key[i] >= lo) c.push_back({s.key[i], s.mass[i]});
    uint64_t good = lo, bad = uint64_t(1) << 32, above = 0; // above: dropped survivors with key >= bad
    while (bad - good > 1) {
        const uint32_t mid = uint32_t((good + bad) / 2);
        const auto split = std::partition(c.begin(), c.end(), [&](const KeyValue &e) { return e.key >= mid; });
        uint64_t upper = above;
        for (auto it = c.begin(); it != split; ++it) upper += it->value;
        if (upper >= target) { // θ >= mid: keys below mid never count again
            good = mid;
            c.erase(split, c.end());
        } else { // θ < mid: keys >= mid always count
            bad = mid;
            above = upper;
            c.erase(c.begin(), split);
        }
    }
    return uint32_t(good);
}

// One row: -1 without a finite maximum (ops.hpp), else greedy or the filtered draw of sample_math.hpp
// with random bits `bits`.
template <typename T>
int64_t sample_row(const T *row, int64_t V, const RowParams &p, float scale, uint64_t bits) {
    bool any_nan = false;
    const float m = row_max(row, V, any_nan);
    if (!finite_max(m, any_nan)) return -1;
    if (is_greedy(p.temperature)) return first_index_of(row, V, m);
    static thread_local Survivors s; // scratch, one per OpenMP thread
    static thread_local std::vector<KeyValue> scratch;
    static thread_local std::vector<uint32_t> keys, chunk_max;
    // The max has weight 1 and survives any min_p <= 1, so the kept mass is > 0.
    const float inv_t = 1.f / p.temperature, min_p = clean_min_p(p.min_p);
    const uint32_t floor = top_k_floor(row, V, p.top_k, chunk_max, keys);
    find_survivors(s, row, V, m, inv_t, min_p, scale, floor, floor > 0 ? chunk_max.data() : nullptr);
    uint32_t th = 0;
    if (top_k_on(p.top_k, s.key.size())) th = kth_largest_key(s, p.top_k, keys);
    if (top_p_on(p.top_p)) th = mass_threshold(s, th, top_p_target(p.top_p, s.mass_from(th)), scratch);
    const uint64_t r = scale_random(bits, s.mass_from(th));
    uint64_t acc = 0;
    for (size_t i = 0; i < s.key.size(); ++i) {
        if (s.key[i] < th) continue;
        acc += s.mass[i];
        if (acc > r) return s.idx[i];
    }
    return first_index_of(row, V, m); // unreachable: r < the kept mass
}

} // namespace

void sample(const Tensor &out_ids, const Tensor &logits, const Tensor &temperature, const Tensor &top_k,
            const Tensor &top_p, const Tensor &min_p, const sampling::SeedSource &seeds) {
    const int64_t B = logits.size(0), V = logits.size(1);
    const float scale = std::ldexp(1.f, mass_shift(V));
    int64_t *out = out_ids.data_as<int64_t>();
    detail::dispatch_float("sample", logits.dtype(), logits.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const T *x = logits.data_as<T>();
        parallel_for(B, V * 8, [&](int64_t b) {
            const RowParams p{temperature.data_as<float>()[b], top_k.data_as<int32_t>()[b], top_p.data_as<float>()[b],
                              min_p.data_as<float>()[b]};
            out[b] = sample_row(x + b * V, V, p, scale, seeds.bits(uint64_t(b)));
        });
    });
}

} // namespace llaisys::ops::cpu
