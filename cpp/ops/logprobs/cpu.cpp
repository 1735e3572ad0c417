#include "ops/logprobs/logprobs.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"
#include "ops/common/vexp.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace llaisys::ops::cpu {

using namespace logprobs_rule;

namespace {

// Independent accumulators per loop, so the compiler vectorizes reductions without reassociating them.
constexpr int kLanes = 16;
// Elements the top-k scan tests against its floor at once.
constexpr int64_t kBlock = 64;
// Elements per chunk of the max-and-sum pass (4 KiB of f32: they stay in L1 between its two loops), summed
// in float before the chunk's sum goes into the double total.
constexpr int64_t kChunk = 1024;

// e^d for d <= 0: exp_nonpositive (ops/common/vexp.hpp), plain arithmetic, so the loops below vectorize;
// CMake builds this file with -fno-trapping-math, without which GCC keeps the float selects here and in
// row_max as branches.

// Max of x [V] over its non-NaN values (-inf if none), and whether it holds a NaN.
template <typename T>
float row_max(const T *x, int64_t V, bool &any_nan) {
    float mx[kLanes];
    int nan[kLanes] = {};
    std::fill(mx, mx + kLanes, -INFINITY);
    auto step = [&](int j, float v) {
        nan[j] |= int(v != v);
        mx[j] = v > mx[j] ? v : mx[j];
    };
    int64_t i = 0;
    for (; i + kLanes <= V; i += kLanes)
        for (int j = 0; j < kLanes; ++j) step(j, load(x, i + j));
    for (int j = 0; i + j < V; ++j) step(j, load(x, i + j));
    any_nan = std::any_of(nan, nan + kLanes, [](int b) { return b != 0; });
    return *std::max_element(mx, mx + kLanes);
}

// sum_i e^((x_i - m) * inv_t) over x [n], in float per lane.
template <typename T>
float chunk_sum_exp(const T *x, int64_t n, float m, float inv_t) {
    float acc[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
        for (int j = 0; j < kLanes; ++j) acc[j] += exp_nonpositive((load(x, i + j) - m) * inv_t);
    for (int j = 0; i + j < n; ++j) acc[j] += exp_nonpositive((load(x, i + j) - m) * inv_t);
    float total = 0;
    for (float a : acc) total += a;
    return total;
}

// One pass over row x [V] in chunks that stay in L1: each chunk's max, then its sum of exp against the
// running max m (the double total rescaled when m grows). Returns sum_i e^((x_i - m) * inv_t) with m the
// row's max over non-NaN values (-inf if none); any_nan says whether it holds a NaN.
template <typename T>
double row_max_sum_exp(const T *x, int64_t V, float inv_t, float &m, bool &any_nan) {
    m = -INFINITY;
    any_nan = false;
    double total = 0;
    for (int64_t c = 0; c < V; c += kChunk) {
        const int64_t n = std::min(kChunk, V - c);
        bool nan = false;
        const float cm = row_max(x + c, n, nan);
        any_nan |= nan;
        if (cm > m) {
            total *= m > -INFINITY ? std::exp(double(m - cm) * double(inv_t)) : 0.0;
            m = cm;
        }
        if (m > -INFINITY) total += double(chunk_sum_exp(x + c, n, m, inv_t));
    }
    return total;
}

// The k largest keys of row x [V] into top (sorted, highest first); returns how many (min(k, V)).
template <typename T>
int row_top_keys(const T *x, int64_t V, int k, uint64_t *top) {
    int n = 0;
    float floor_v = -INFINITY; // the k-th value once n == k: a value below it (or equal: a higher index) loses
    for (int64_t c = 0; c < V; c += kBlock) {
        const int64_t end = std::min(V, c + kBlock);
        if (n == k && end - c == kBlock) { // skip a whole block below the floor (a vectorized test)
            int above = 0;
            for (int64_t i = c; i < end; ++i) above |= int(!(load(x, i) < floor_v)); // NaN counts as above
            if (!above) continue;
        }
        for (int64_t i = c; i < end; ++i) {
            const float v = load(x, i);
            if (n == k && v < floor_v) continue;
            insert_key(top, n, k, order_key(v, i));
            if (n == k) floor_v = load(x, key_index(top[k - 1]));
        }
    }
    return n;
}

// Output row r reads logits row b = rows[r] (x [V]): lp_i = (x_i - m) / t - log(sum_j exp((x_j - m) / t))
// with m the row's max; chosen_lp[r] = lp at chosen[b], and the k largest (value, then lower index) with
// their lp, highest first. Two passes over the row: max and sum together, then the top-k keys. A row without a finite max (a NaN, a +inf, only -inf) gets NaN logprobs, as
// NumPy's formula does; slots past V (k > V) get id -1 and -inf.
template <typename T>
void logprobs_row(float *chosen_lp, int64_t *top_ids, float *top_lp, const T *x, int64_t V, float inv_t,
                  int64_t chosen, int k) {
    bool nan = false;
    float m;
    const double sum = row_max_sum_exp(x, V, inv_t, m, nan);
    const bool finite = !nan && std::isfinite(m);
    const float lse = finite ? float(std::log(sum)) : 0.f;
    const float qnan = std::numeric_limits<float>::quiet_NaN();
    auto lp = [&](int64_t i) { return finite ? (load(x, i) - m) * inv_t - lse : qnan; };
    *chosen_lp = lp(chosen);
    uint64_t top[kMaxTopK];
    const int n = k > 0 ? row_top_keys(x, V, k, top) : 0;
    for (int j = 0; j < k; ++j) {
        top_ids[j] = j < n ? key_index(top[j]) : -1;
        top_lp[j] = j < n ? lp(top_ids[j]) : -INFINITY;
    }
}

} // namespace

void logprobs(const Tensor &chosen_lp, const Tensor &top_ids, const Tensor &top_lp, const Tensor &logits,
              const Tensor &temperature, const Tensor &chosen, const Tensor &rows) {
    const int64_t V = logits.size(1), R = rows.size(0);
    const int k = int(top_ids.size(1));
    const int64_t *row = rows.data_as<int64_t>(), *id = chosen.data_as<int64_t>();
    const float *t = temperature.data_as<float>();
    detail::dispatch_float("logprobs", logits.dtype(), logits.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const T *x = logits.data_as<T>(); // [B, V]
        float *clp = chosen_lp.data_as<float>(), *tlp = top_lp.data_as<float>(); // [R], [R, k]
        int64_t *ids = top_ids.data_as<int64_t>();                                // [R, k]
        parallel_for(R, 4 * V, [&](int64_t r) {
            const int64_t b = row[r];
            logprobs_row(clp + r, ids + r * k, tlp + r * k, x + b * V, V, inv_temperature(t[b]), id[b], k);
        });
    });
}

} // namespace llaisys::ops::cpu
