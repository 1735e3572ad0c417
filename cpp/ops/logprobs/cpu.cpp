#include "ops/logprobs/logprobs.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

#include <cmath>
#include <limits>

namespace llaisys::ops::cpu {

using namespace logprobs_rule;

// Output row r reads logits row b = rows[r] (x [V]): lp_i = (x_i - m) / t - log(sum_j exp((x_j - m) / t))
// with m the row's max; chosen_lp[r] = lp at chosen[b], and the k largest (value, then lower index) with
// their lp, highest first. Two passes: the max, then the sum (in double) and the top-k keys. A row
// without a finite max (a NaN, a +inf, only -inf) gets NaN logprobs, as NumPy's formula does; slots past
// V (k > V) get id -1 and -inf.
template <typename T>
static void logprobs_row(float *chosen_lp, int64_t *top_ids, float *top_lp, const T *x, int64_t V, float inv_t,
                         int64_t chosen, int k) {
    float m = -INFINITY;
    bool nan = false;
    for (int64_t i = 0; i < V; ++i) {
        const float v = load(x, i);
        nan |= v != v;
        m = v > m ? v : m;
    }
    const bool finite = !nan && std::isfinite(m);
    uint64_t top[kMaxTopK];
    int n = 0;
    double sum = 0;
    for (int64_t i = 0; i < V; ++i) {
        const float v = load(x, i);
        sum += double(std::exp((v - m) * inv_t));
        if (k > 0) insert_key(top, n, k, order_key(v, i));
    }
    const float lse = float(std::log(sum)), qnan = std::numeric_limits<float>::quiet_NaN();
    auto lp = [&](int64_t i) { return finite ? (load(x, i) - m) * inv_t - lse : qnan; };
    *chosen_lp = lp(chosen);
    for (int j = 0; j < k; ++j) {
        top_ids[j] = j < n ? key_index(top[j]) : -1;
        top_lp[j] = j < n ? lp(top_ids[j]) : -INFINITY;
    }
}

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
