// logprobs on CUDA: one block of kThreads threads per output row r (reading logits row b = rows[r]). Thread t
// reads packs of VEC elements (16 bytes when the rows allow it) at t, t + kThreads, ..., kUnroll packs in flight.
//   1. Each thread's online max and sum of exp((x - max) / T) (the sum rescaled when its max grows).
//   2. The block's k-th largest thread maximum is a floor for the row's k-th value; a second scan keys only
//      the elements not below it (order_key: value, then lower index) into each thread's sorted top list.
//   3. The block reduces the max, then the rescaled sums.
//   4. The threads' lists merge in k rounds of a block max over each thread's head key (the winner pops it).
// Step 2's floor is what makes it a stream of the logits: see the comment there (bench/RESULTS.md, session 36).
#include "ops/logprobs/logprobs.hpp"

#include "ops/common/argmax_rows.cuh"
#include "ops/common/checks.hpp"
#include "ops/common/cuda.cuh"

#include <cstdint>
#include <type_traits>

namespace llaisys::ops::cuda {

using namespace logprobs_rule;

namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;

// The value a key was made of (order_key's inverse on its high half; -0.0 comes back as +0.0).
__device__ __forceinline__ float key_value(uint64_t key) {
    const uint32_t o = uint32_t(key >> 32);
    return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

// The max key over the block; every thread gets it. `scratch` holds 32 keys; blockDim.x % 32 == 0.
__device__ __forceinline__ uint64_t block_max_key(uint64_t k, uint64_t *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const uint64_t other = __shfl_xor_sync(0xffffffffu, (unsigned long long)k, o);
        k = other > k ? other : k;
    }
    __syncthreads(); // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = k;
    __syncthreads();
    k = lane < nwarps ? scratch[lane] : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const uint64_t other = __shfl_xor_sync(0xffffffffu, (unsigned long long)k, o);
        k = other > k ? other : k;
    }
    return k;
}

// chosen_lp [R], top_ids [R, k], top_lp [R, k] from logits [B, V], temperature [B], chosen [B], rows [R].
// A row index out of range (not checked on the host: that would need a sync) gives ids -1 and NaN
// logprobs; a chosen id out of range, a NaN chosen_lp.
// With VEC > 1 every row is 16-byte aligned and V % VEC == 0 (rows_vectorizable).
template <int VEC, typename T>
__global__ void __launch_bounds__(kThreads)
    logprobs_kernel(float *chosen_lp, int64_t *top_ids, float *top_lp, const T *logits, const float *temperature,
                    const int64_t *chosen, const int64_t *rows, int64_t B, int V, int k) {
    __shared__ float fscratch[32];
    __shared__ uint64_t kscratch[32];
    const int64_t r = blockIdx.x, b = rows[r];
    const bool row_ok = b >= 0 && b < B;
    const T *x = logits + (row_ok ? b : 0) * int64_t(V);
    const float inv_t = inv_temperature(row_ok ? temperature[b] : 1.f);
    constexpr int stride = kThreads * VEC;
    // Calls fn(first index, pack) for this thread's packs in increasing index order, kUnroll packs in flight.
    auto scan = [&](auto &&fn) {
        for (int base = int(threadIdx.x) * VEC; base < V; base += kUnroll * stride) {
            RowPack<T, VEC> raw[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (base + u * stride < V) raw[u] = *reinterpret_cast<const RowPack<T, VEC> *>(x + base + u * stride);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                if (base + u * stride >= V) break;
                fn(base + u * stride, raw[u]);
            }
        }
    };
    // 1. this thread's max and sum of exp((x - max) / T): per pack, its max first (the sum rescaled only
    //    when that grows, a branch rarely taken), then one expf an element, without divergent branches.
    //    NaN is left out of both (fmaxf skips it, and !(NaN > -inf)) and flagged.
    float m = -INFINITY, s = 0.f;
    bool nan = false;
    scan([&](int, const RowPack<T, VEC> &p) {
        float pm = -INFINITY;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const float v = to_f32(p.v[e]);
            nan |= v != v;
            pm = fmaxf(pm, v);
        }
        if (pm > m) { // -inf - (finite or +inf) = -inf: the old sum's weight is 0
            s *= expf((m - pm) * inv_t);
            m = pm;
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const float v = to_f32(p.v[e]);
            s += v > -INFINITY ? expf((v - m) * inv_t) : 0.f;
        }
    });
    // 2. a floor for the row's k-th value: the k-th largest of the threads' maxima (k elements are at least
    //    that). Only elements not below it (and NaNs, whose keys rank first) enter the threads' top lists in a
    //    second scan (the row again, from L2 where it stayed): keying every element that beat its thread's own
    //    k-th made nearly every warp step take some lane's insertion, 246 us for 256 rows x 151936 bf16 on an
    //    H200 (session 36) against 26 us for argmax's scan of the same logits.
    float theta = INFINITY;
    if (k > 0) {
        uint64_t mine = order_key(m, threadIdx.x), kth = 0; // distinct keys: one thread owns each maximum
        for (int j = 0; j < k; ++j) {
            const uint64_t best = block_max_key(mine, kscratch);
            if (mine == best) mine = 0;
            kth = best;
        }
        theta = kth != 0 ? key_value(kth) : -INFINITY;
    }
    uint64_t top[kMaxTopK];
    int n = 0;
    float floor_v = -INFINITY; // this thread's k-th value once n == k: a value below it loses
    if (k > 0)
        scan([&](int base, const RowPack<T, VEC> &p) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float v = to_f32(p.v[e]);
                if (!(v < theta) && !(n == k && v < floor_v)) { // NaN passes both, as its key ranks first
                    insert_key(top, n, k, order_key(v, base + e));
                    if (n == k) floor_v = key_value(top[k - 1]);
                }
            }
        });
    // 3. the row's max and sum
    nan = __syncthreads_or(nan);
    const float M = block_max(m, fscratch);
    const bool finite = !nan && isfinite(M) && row_ok;
    const float S = block_sum(m > -INFINITY ? s * expf((m - M) * inv_t) : 0.f, fscratch);
    const float lse = logf(S);
    auto lp = [&](int64_t i) { return finite ? (to_f32(x[i]) - M) * inv_t - lse : NAN; };
    if (threadIdx.x == 0) {
        const int64_t c = row_ok ? chosen[b] : -1;
        chosen_lp[r] = c >= 0 && c < V ? lp(c) : NAN;
    }
    // 4. merge the threads' lists
    int head = 0;
    for (int j = 0; j < k; ++j) {
        const uint64_t mine = head < n ? top[head] : 0;
        const uint64_t best = block_max_key(mine, kscratch);
        if (best != 0 && mine == best) ++head; // keys are distinct: one thread owns it
        if (threadIdx.x == 0) {
            const int64_t i = best != 0 && row_ok ? key_index(best) : -1;
            top_ids[r * k + j] = i;
            top_lp[r * k + j] = !row_ok ? NAN : i >= 0 ? lp(i) : -INFINITY;
        }
    }
}

} // namespace

void logprobs(const Tensor &chosen_lp, const Tensor &top_ids, const Tensor &top_lp, const Tensor &logits,
              const Tensor &temperature, const Tensor &chosen, const Tensor &rows) {
    const int64_t B = logits.size(0), V = logits.size(1), R = rows.size(0);
    LLAISYS_CHECK(R <= INT32_MAX, std::invalid_argument, "logprobs: too many rows for one launch: ", R);
    detail::dispatch_float("logprobs", logits.dtype(), logits.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        auto launch = [&](auto vec) {
            logprobs_kernel<decltype(vec)::value, device_t<T>><<<unsigned(R), kThreads, 0, stream_of(logits)>>>(
                chosen_lp.data_as<float>(), top_ids.data_as<int64_t>(), top_lp.data_as<float>(), dptr<T>(logits),
                temperature.data_as<float>(), chosen.data_as<int64_t>(), rows.data_as<int64_t>(), B, int(V),
                int(top_ids.size(1)));
        };
        if (rows_vectorizable<device_t<T>>(logits.data(), V))
            launch(std::integral_constant<int, kRowVec<device_t<T>>>{});
        else
            launch(std::integral_constant<int, 1>{});
        CUDA_CHECK_LAUNCH();
    });
}

} // namespace llaisys::ops::cuda
