// Sampling on CUDA: one block of 1024 threads per row of logits [B, V]. The rule is in sample_math.hpp;
// the CPU backend applies the same rule (selection and binary search over survivors). Per row:
//   1. max (and argmax) of the row; a row without a finite max gets -1 (ops.hpp); temperature <= 0
//      stops here (greedy).
//   2. survivor pass: min_p survivors' count, exact fixed-point mass per warp (warp w owns a contiguous
//      index range, so warp masses add up in index order) and, when top_k/top_p are on, a shared-memory
//      histogram of d = (l - m) / t in 1/8 bins (counts; masses too when top_p runs without top_k).
//   3. no top_k/top_p: draw directly: pick the warp by prefix over warp masses, then the whole block
//      splits that warp's range into contiguous slices and finds the token by a block scan.
//   4. top_k/top_p, fast path: the histogram gives a cut-off bin that holds every kept token; if at most
//      kCap tokens lie above it they are compacted into shared memory and bitonic-sorted by (key desc,
//      index asc): top_k and top_p thresholds are positions in that order. The kept tokens are then
//      re-sorted by index and drawn by a block scan, so every path draws in index order.
//      With top_k on, the cut-off comes before step 2 and without a pass of its own: the bin where the
//      threads' own maxima from step 1 first number k. Those k maxima are k distinct tokens, so the
//      k-th largest token, and every token top_k can keep, lies in that bin or above; step 2's histogram
//      of the whole row (an atomic a token: it made top_k twice the cost of plain sampling) is skipped.
//      The candidates are the survivors in those bins (all survivors when fewer than k are, since
//      min_p keeps a top set), so their masses also give top_p's total when top_k turns out off.
//   5. slow path (a cut-off holding more than kCap tokens, e.g. top_p alone on a flat distribution, or
//      top_k > kCap): thresholds by binary search over the 32-bit key, one block reduction over the row
//      per step (up to 64 passes), then the draw of step 3. Correct, but ~15x slower than the fast path
//      (about 1 ms at V = 151936 on an H100). TODO: refine the histogram instead (2-3 passes).
// With B = 1 one SM does all the work, so a row costs tens of microseconds, not the few that several
// blocks per row could reach; batched decode fills the GPU with rows instead.
#include "ops/sample/sample.hpp"

#include "ops/common/argmax_rows.cuh"
#include "ops/common/checks.hpp"
#include "ops/common/cuda.cuh"
#include "ops/sample/sample_math.hpp"

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace llaisys::ops::cuda {

using namespace sampling;

namespace {

using u64 = unsigned long long;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
// Histogram of d = (l - m) / t over (-32, 0] in 1/8 bins; lower weights (< e^-32) land in no bin.
constexpr int kBins = 256;
constexpr float kBinsPerUnit = 8.f;
// Most tokens the fast path sorts in shared memory (32 KiB of entries).
constexpr int kCap = 4096;

struct SampleSmem {
    ArgmaxSmem amax;
    unsigned hist_count[kBins];
    u64 hist_mass[kBins];
    u64 warp_mass[kWarps]; // mass of each warp's index range
    u64 scan[kWarps];      // block reduction scratch
    u64 cand[kCap];        // candidates: (key << 32 | ~index), later (~index << 32 | key)
    int n_cand;
    int found;   // position found by block_scan_find
    int cut_bin; // -1: no usable cut-off (slow path)
    int draw_warp;
    u64 draw_rest; // draw target within draw_warp's range
    int token;
};

// One row and its per-row constants. Passes over the row go through for_warp_tokens.
template <int VEC, typename T>
struct Row {
    const T *x; // [V]; with VEC > 1, 16-byte aligned and V % VEC == 0
    int V;
    float m, inv_t, min_p, scale;
    __device__ float logit(int i) const { return to_f32(x[i]); }
    __device__ float diff(float l) const { return scaled_diff(l, m, inv_t); }
    __device__ u64 mass_of_key(uint32_t key) const { return to_mass(weight_of(diff(key_float(key))), scale); }
    // Mass of the token with logit l if it survives min_p and its key is >= th, else 0.
    __device__ u64 kept_mass(float l, uint32_t th) const {
        if (float_key(l) < th) return 0;
        const float w = weight_of(diff(l));
        return w >= min_p ? to_mass(w, scale) : 0;
    }
    // Calls fn(i, logit) for the tokens of this warp's range [begin, end) (begin a multiple of 32 * VEC):
    // lanes read VEC consecutive tokens in one load and keep kUnroll loads in flight, since one SM
    // streams the whole row and would otherwise wait on each load in turn.
    template <typename Fn>
    __device__ __forceinline__ void for_warp_tokens(int begin, int end, Fn &&fn) const {
        constexpr int kUnroll = VEC >= 8 ? 2 : 4, kStep = 32 * VEC; // 32-64 bytes per lane in flight
        for (int base = begin + (int(threadIdx.x) & 31) * VEC; base < end; base += kStep * kUnroll) {
            RowPack<T, VEC> raw[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (base + u * kStep < end) raw[u] = *reinterpret_cast<const RowPack<T, VEC> *>(x + base + u * kStep);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                if (base + u * kStep >= end) break;
#pragma unroll
                for (int e = 0; e < VEC; ++e) fn(base + u * kStep + e, to_f32(raw[u].v[e]));
            }
        }
    }
};

__device__ __forceinline__ int bin_of(float d) {
    const float b = -d * kBinsPerUnit;
    return b < float(kBins) ? int(b) : kBins; // -inf and NaN -> no bin
}

// Warp w owns tokens [w * span, (w + 1) * span); span is a multiple of 32 lanes * 8 (the widest VEC).
__device__ __forceinline__ int warp_span(int V) { return int(ceil_div(ceil_div(V, kWarps), 256) * 256); }
__device__ __forceinline__ int warp_begin(int V) { return int(threadIdx.x >> 5) * warp_span(V); }
__device__ __forceinline__ int warp_end(int V) { return min(V, warp_begin(V) + warp_span(V)); }

__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    return v;
}
__device__ __forceinline__ u64 warp_inclusive_scan_u64(u64 v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 n = __shfl_up_sync(kFull, v, o);
        if (lane >= o) v += n;
    }
    return v;
}

__device__ u64 block_sum_u64(u64 v, u64 *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_u64(v);
    __syncthreads(); // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum_u64(scratch[lane]);
}

// Exclusive prefix of v over threads in order; `total` gets the block sum.
__device__ u64 block_exclusive_scan_u64(u64 v, u64 *scratch, u64 &total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 incl = warp_inclusive_scan_u64(v);
    __syncthreads();
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    const u64 wsum = scratch[lane], wincl = warp_inclusive_scan_u64(wsum);
    total = __shfl_sync(kFull, wincl, 31);
    return __shfl_sync(kFull, wincl - wsum, warp) + incl - v;
}

struct Survivors {
    u64 n, z; // count and mass
};

// Step 2: survivors' count and mass (warp masses into sm.warp_mass) and, when asked, the histogram.
template <typename R>
__device__ Survivors survivor_pass(const R &r, SampleSmem &sm, bool count_hist, bool mass_hist) {
    for (int b = threadIdx.x; b < kBins; b += kThreads) {
        sm.hist_count[b] = 0;
        sm.hist_mass[b] = 0;
    }
    __syncthreads();
    u64 n = 0, z = 0;
    r.for_warp_tokens(warp_begin(r.V), warp_end(r.V), [&](int, float l) {
        const float d = r.diff(l), w = weight_of(d);
        if (!(w >= r.min_p)) return;
        const u64 q = to_mass(w, r.scale);
        ++n;
        z += q;
        if (!count_hist && !mass_hist) return;
        const int bin = bin_of(d);
        if (bin >= kBins) return;
        if (count_hist) atomicAdd(&sm.hist_count[bin], 1u);
        if (mass_hist && q) atomicAdd(&sm.hist_mass[bin], q);
    });
    const u64 wz = warp_sum_u64(z);
    if ((threadIdx.x & 31) == 0) sm.warp_mass[threadIdx.x >> 5] = wz;
    const u64 total_n = block_sum_u64(n, sm.scan); // its barriers publish warp_mass and the histogram
    u64 total_z = 0;
    for (int w = 0; w < kWarps; ++w) total_z += sm.warp_mass[w];
    return {total_n, total_z};
}

// Sets sm.cut_bin to the first bin where the cumulative histogram (masses when by_mass, else counts)
// reaches target, or -1 when no bin does or more than kCap survivors lie at or above it. Warp 0 scans.
__device__ void pick_cut_bin(SampleSmem &sm, u64 target, bool by_mass) {
    if (threadIdx.x < 32) {
        constexpr int per = kBins / 32;
        const int lane = threadIdx.x;
        u64 cnt = 0, val = 0;
        for (int j = 0; j < per; ++j) {
            const int b = lane * per + j;
            cnt += sm.hist_count[b];
            val += by_mass ? sm.hist_mass[b] : sm.hist_count[b];
        }
        const u64 cnt_incl = warp_inclusive_scan_u64(cnt), val_incl = warp_inclusive_scan_u64(val);
        const bool mine = val_incl - val < target && val_incl >= target; // at most one lane
        if (mine) {
            u64 c = cnt_incl - cnt, v = val_incl - val;
            for (int j = 0; j < per; ++j) {
                const int b = lane * per + j;
                c += sm.hist_count[b];
                v += by_mass ? sm.hist_mass[b] : sm.hist_count[b];
                if (v >= target) {
                    sm.cut_bin = c <= u64(kCap) ? b : -1;
                    break;
                }
            }
        }
        if (__ballot_sync(kFull, mine) == 0 && lane == 0) sm.cut_bin = -1;
    }
    __syncthreads();
}

struct ScanHit {
    u64 total; // mass of positions [0, n)
    int pos;   // first position whose running mass reaches the target; -1 if the target > total
};

// Running mass over positions [0, n) in order, mass_at(j) each; thread t takes the contiguous slice
// [t * per, (t + 1) * per), then the thread holding the target walks its slice again.
template <typename MassAt>
__device__ ScanHit block_scan_find(int n, u64 target, SampleSmem &sm, MassAt &&mass_at) {
    const int per = (n + kThreads - 1) / kThreads, begin = min(n, int(threadIdx.x) * per), end = min(n, begin + per);
    u64 local = 0;
    for (int j = begin; j < end; ++j) local += mass_at(j);
    u64 total;
    const u64 before = block_exclusive_scan_u64(local, sm.scan, total);
    if (before < target && before + local >= target) { // exactly one thread when target <= total
        u64 acc = before;
        for (int j = begin; j < end; ++j) {
            acc += mass_at(j);
            if (acc >= target) {
                sm.found = j;
                break;
            }
        }
    }
    __syncthreads();
    return {total, target <= total ? sm.found : -1};
}

// Step 3 (and the end of step 5): draws from survivors with key >= th in index order. With
// have_warp_mass (th == 0), sm.warp_mass from survivor_pass is reused.
template <typename R>
__device__ int draw_in_order(const R &r, SampleSmem &sm, uint32_t th, bool have_warp_mass, u64 bits) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (!have_warp_mass) {
        u64 z = 0;
        r.for_warp_tokens(warp_begin(r.V), warp_end(r.V), [&](int, float l) { z += r.kept_mass(l, th); });
        z = warp_sum_u64(z);
        __syncthreads(); // warp_mass may still be read
        if (lane == 0) sm.warp_mass[warp] = z;
        __syncthreads();
    }
    if (warp == 0) {
        const u64 wm = sm.warp_mass[lane], incl = warp_inclusive_scan_u64(wm);
        const u64 target = scale_random(bits, __shfl_sync(kFull, incl, 31)); // total > 0: see sample_row
        const int w = __ffs(__ballot_sync(kFull, incl > target)) - 1;
        if (lane == w) {
            sm.draw_warp = w;
            sm.draw_rest = target - (incl - wm);
        }
    }
    __syncthreads();
    const int begin = sm.draw_warp * warp_span(r.V), end = min(r.V, begin + warp_span(r.V));
    const ScanHit hit = block_scan_find(end - begin, sm.draw_rest + 1, sm,
                                        [&](int j) { return r.kept_mass(r.logit(begin + j), th); });
    return hit.pos >= 0 ? begin + hit.pos : sm.token;
}

// Compacts survivors in bins <= cut_bin as (key << 32 | ~index) into sm.cand; returns their count.
template <typename R>
__device__ int compact_candidates(const R &r, SampleSmem &sm, int cut_bin) {
    if (threadIdx.x == 0) sm.n_cand = 0;
    __syncthreads();
    const float edge = float(cut_bin + 1); // bin_of(d) <= cut_bin <=> -d * kBinsPerUnit < cut_bin + 1 (no conversion)
    r.for_warp_tokens(warp_begin(r.V), warp_end(r.V), [&](int i, float l) {
        const float d = r.diff(l);
        if (!(-d * kBinsPerUnit < edge) || !(weight_of(d) >= r.min_p)) return;
        const int pos = atomicAdd(&sm.n_cand, 1);
        if (pos < kCap) sm.cand[pos] = (u64(float_key(l)) << 32) | u64(~unsigned(i));
    });
    __syncthreads();
    return min(sm.n_cand, kCap);
}

// Sorts a[0, n) descending (n <= kCap): bitonic network over n rounded up to a power of two, padded
// with zeros (below every real entry). The result depends only on the values, not on their order.
__device__ void sort_desc(u64 *a, int n) {
    int size = 1;
    while (size < n) size <<= 1;
    for (int i = n + threadIdx.x; i < size; i += kThreads) a[i] = 0;
    __syncthreads();
    for (int k = 2; k <= size; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < size; i += kThreads) {
                const int p = i ^ j;
                if (p <= i) continue;
                const u64 x = a[i], y = a[p];
                if ((i & k) == 0 ? x < y : x > y) {
                    a[i] = y;
                    a[p] = x;
                }
            }
            __syncthreads();
        }
}

// Entries of a[0, n) (sorted by key, descending) whose key is >= th.
__device__ int count_key_at_least(const u64 *a, int n, uint32_t th) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (uint32_t(a[mid] >> 32) >= th) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// Step 4: top_k (k > 0 = on) and top_p on the sorted candidates sm.cand[0, n), then the draw in index
// order. all_survivors: with top_k off the candidates are every survivor, so top_p's total is theirs
// (else survivor_mass, the whole row's).
template <typename R>
__device__ int sample_candidates(const R &r, SampleSmem &sm, int n, int k, float p, u64 survivor_mass,
                                 bool all_survivors, u64 bits) {
    sort_desc(sm.cand, n);
    const bool k_on = k > 0 && k <= n; // the cut-off bin holds at least k survivors
    auto by_key = [&](int j) { return r.mass_of_key(uint32_t(sm.cand[j] >> 32)); };
    int kept = k_on ? count_key_at_least(sm.cand, n, uint32_t(sm.cand[k - 1] >> 32)) : n;
    if (top_p_on(p)) {
        const u64 z = k_on || all_survivors ? block_scan_find(kept, ~0ull, sm, by_key).total : survivor_mass;
        const int j = block_scan_find(kept, top_p_target(p, z), sm, by_key).pos;
        if (j >= 0) kept = count_key_at_least(sm.cand, kept, uint32_t(sm.cand[j] >> 32));
    }
    __syncthreads(); // every thread is done reading sm.cand in key order
    for (int j = threadIdx.x; j < kept; j += kThreads) sm.cand[j] = (sm.cand[j] << 32) | (sm.cand[j] >> 32);
    sort_desc(sm.cand, kept); // now by index, ascending
    auto by_index = [&](int j) { return r.mass_of_key(uint32_t(sm.cand[j])); };
    const u64 z = block_scan_find(kept, ~0ull, sm, by_index).total;
    const int j = block_scan_find(kept, scale_random(bits, z) + 1, sm, by_index).pos;
    return j >= 0 ? int(~uint32_t(sm.cand[j] >> 32)) : sm.token;
}

// Count (or mass) of survivors with key >= th over the whole row.
template <typename R>
__device__ u64 block_kept(const R &r, SampleSmem &sm, uint32_t th, bool mass) {
    u64 acc = 0;
    r.for_warp_tokens(warp_begin(r.V), warp_end(r.V), [&](int, float l) {
        if (mass) acc += r.kept_mass(l, th);
        else if (float_key(l) >= th) acc += r.min_p <= 0.f || weight_of(r.diff(l)) >= r.min_p;
    });
    return block_sum_u64(acc, sm.scan);
}

// Step 5: thresholds by binary search over the key, each step one pass over the row.
template <typename R>
__device__ int sample_by_search(const R &r, SampleSmem &sm, bool k_on, int k, float p, u64 survivor_mass,
                                u64 bits) {
    uint32_t th = 0;
    if (k_on) th = search_threshold(0, u64(k), [&](uint32_t t) { return block_kept(r, sm, t, false); });
    if (top_p_on(p)) {
        const u64 z = k_on ? block_kept(r, sm, th, true) : survivor_mass;
        th = search_threshold(th, top_p_target(p, z), [&](uint32_t t) { return block_kept(r, sm, t, true); });
    }
    return draw_in_order(r, sm, th, false, bits);
}

// Step 4 with top_k on, its cut-off from own_max (this thread's max from step 1; see the top). Returns -2
// where it does not apply: fewer than k threads saw a token in a bin (k > kThreads, or a flat row), or
// more than kCap candidates; the caller then takes steps 2-5.
template <typename R>
__device__ int sample_top_k(const R &r, SampleSmem &sm, int k, float p, float own_max, u64 bits) {
    for (int b = threadIdx.x; b < kBins; b += kThreads) sm.hist_count[b] = 0;
    __syncthreads();
    const int bin = bin_of(r.diff(own_max)); // -inf (nothing seen) lands in no bin
    if (bin < kBins) atomicAdd(&sm.hist_count[bin], 1u);
    __syncthreads();
    pick_cut_bin(sm, u64(k), false);
    if (sm.cut_bin < 0) return -2;
    const int n = compact_candidates(r, sm, sm.cut_bin);
    if (sm.n_cand > kCap) return -2; // every thread reads it after compact_candidates' barrier
    return sample_candidates(r, sm, n, k, p, 0, true, bits);
}

// Steps 2-5 for a row with temperature > 0 and a finite max, which has weight 1 and survives any
// min_p <= 1, so the survivors' mass is > 0.
template <typename R>
__device__ int sample_row(const R &r, SampleSmem &sm, int k, float p, float own_max, bool floor, u64 bits) {
    if (k > 0 && floor) {
        const int token = sample_top_k(r, sm, k, p, own_max, bits);
        __syncthreads(); // sm is reused below
        if (token != -2) return token;
    }
    const bool p_on = top_p_on(p);
    // With top_k the cut-off is chosen by count, so the mass histogram is only built without it (if
    // k >= survivors turns top_k off after all, the missing masses just send the row to the slow path).
    const Survivors s = survivor_pass(r, sm, k > 0 || p_on, p_on && k <= 0);
    const bool k_on = top_k_on(k, s.n);
    if (!k_on && !p_on) return draw_in_order(r, sm, 0, true, bits);
    pick_cut_bin(sm, k_on ? u64(k) : top_p_target(p, s.z), !k_on);
    if (sm.cut_bin >= 0)
        return sample_candidates(r, sm, compact_candidates(r, sm, sm.cut_bin), k_on ? k : 0, p, s.z, false, bits);
    return sample_by_search(r, sm, k_on, k, p, s.z, bits);
}

// One block of kThreads per row of logits [B, V]; parameters [B] are read on the device, so a CUDA graph
// can replay the launch with new values. VEC: width of the loads of step 1.
template <int VEC, typename T>
__global__ void __launch_bounds__(kThreads)
    sample_kernel(int64_t *out, const T *logits, int V, const float *temperature, const int *top_k,
                  const float *top_p, const float *min_p, sampling::SeedSource seeds, float scale, bool floor) {
    __shared__ SampleSmem sm;
    const int b = blockIdx.x;
    const T *x = logits + int64_t(b) * V;
    float own_max;
    const RowMax mx = block_row_max<VEC>(x, V, sm.amax, &own_max);
    if (threadIdx.x == 0) sm.token = mx.idx; // defensive default for the draw
    const float t = temperature[b];
    int token = finite_max(mx) ? mx.idx : -1; // greedy, or no token at all
    if (token >= 0 && !is_greedy(t)) {
        const Row<VEC, T> r{x, V, mx.val, 1.f / t, clean_min_p(min_p[b]), scale};
        token = sample_row(r, sm, top_k[b], top_p[b], own_max, floor, seeds.bits(uint64_t(b)));
    }
    if (threadIdx.x == 0) out[b] = token;
}

// LLAISYS_SAMPLE_TOPK_FLOOR=0 sends top_k rows through step 2's histogram as before the floor (an A/B
// switch for benchmarks, read once).
bool top_k_floor() {
    static const bool on = [] {
        const char *e = std::getenv("LLAISYS_SAMPLE_TOPK_FLOOR");
        return e == nullptr || std::strcmp(e, "0") != 0;
    }();
    return on;
}

} // namespace

void sample(const Tensor &out_ids, const Tensor &logits, const Tensor &temperature, const Tensor &top_k,
            const Tensor &top_p, const Tensor &min_p, const sampling::SeedSource &seeds) {
    const int64_t B = logits.size(0), V = logits.size(1);
    LLAISYS_CHECK(B <= INT32_MAX, std::invalid_argument, "sample: too many rows for one launch: ", B);
    LLAISYS_CHECK(V < (int64_t(1) << 30), std::invalid_argument, "sample: vocabulary must be < 2^30 on CUDA, got ", V);
    const float scale = ldexpf(1.f, mass_shift(V));
    detail::dispatch_float("sample", logits.dtype(), logits.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        using D = device_t<T>;
        auto launch = [&](auto kernel) {
            kernel<<<unsigned(B), kThreads, 0, stream_of(out_ids)>>>(
                out_ids.data_as<int64_t>(), dptr<T>(logits), int(V), temperature.data_as<float>(),
                top_k.data_as<int32_t>(), top_p.data_as<float>(), min_p.data_as<float>(), seeds, scale,
                top_k_floor());
            CUDA_CHECK_LAUNCH();
        };
        if (rows_vectorizable<D>(logits.data(), V)) launch(sample_kernel<kRowVec<D>, D>);
        else launch(sample_kernel<1, D>);
    });
}

} // namespace llaisys::ops::cuda
