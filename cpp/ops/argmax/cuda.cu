// argmax over the last dim of x [rows, V] on CUDA: the first maximum, its value copied from x (nothing is
// re-rounded); a row without a finite maximum (a NaN, a +inf, nothing above -inf) gets -1 and NumPy's max.
//
// Two paths, chosen on the host from V, rows and the SM count:
//  - one block per row (argmax_kernel, block_row_max of common/argmax_rows.cuh): rows of <= 32 KiB, or
//    rows >= SMs (enough blocks to fill the GPU). A 1024-thread block has 64 KiB in flight per pass.
//  - P blocks per row (a long row and few rows, e.g. greedy decode over V = 151936, where one SM
//    streaming 304 KiB costs ~10 us): grid (P, rows), P = min(ceil(row bytes / 8 KiB), ceil(2 * SMs /
//    rows)); block p reads elements [p * chunk, min((p + 1) * chunk, V)) (chunk a multiple of 8, so
//    16-byte aligned for the vector loads) and writes its max orderable key (argmax_key: order-
//    preserving float bits, NaN above +inf, then ~index) to a workspace [rows, P]. A second one-warp
//    kernel per row takes the max of the P keys, which is the answer (or says there is no finite max).
//    The workspace comes from the stream-ordered caching allocator (capture-safe); there is no host
//    sync, memset or counter, so the pair replays in a CUDA graph.
#include "ops/argmax/argmax.hpp"

#include "ops/argmax/argmax.cuh"
#include "ops/common/argmax_rows.cuh"
#include "ops/common/checks.hpp"

#include <algorithm>

namespace llaisys::ops::cuda {

namespace {

// Rows of at most this many bytes stay on one block: a 1024-thread block reads 64 KiB per pass.
constexpr int64_t kSingleBlockMaxBytes = 32 * 1024;
// Bytes of a row each block of the split path reads (about): kPartThreads x 2 packs of 16 bytes.
constexpr int64_t kChunkBytes = 8 * 1024;
constexpr int kPartThreads = 256;

// One block per row of x [rows, V]; blockDim.x threads (32..1024) read VEC-wide packs.
template <int VEC, typename T>
__global__ void __launch_bounds__(1024) argmax_kernel(int64_t *max_idx, T *max_val, const T *x, int V) {
    __shared__ ArgmaxSmem sm;
    const T *row = x + int64_t(blockIdx.x) * V;
    const RowMax m = block_row_max<VEC>(row, V, sm);
    if (threadIdx.x == 0) {
        const bool finite = finite_max(m);
        max_idx[blockIdx.x] = finite ? m.idx : -1;
        max_val[blockIdx.x] = finite ? row[m.idx] : from_f32<T>(m.any_nan ? NAN : m.val);
    }
}

// Block (p, r) of the split path: the max key over elements [p * chunk, min((p + 1) * chunk, V)) of row r
// goes to keys[r * gridDim.x + p]. With VEC > 1: x 16-byte aligned, V % VEC == 0 and chunk % VEC == 0,
// so every pack that starts below the chunk's end lies inside it.
template <int VEC, typename T>
__global__ void __launch_bounds__(kPartThreads)
    argmax_part_kernel(ArgmaxKey *keys, const T *x, int V, int64_t chunk) {
    constexpr int UNROLL = VEC > 1 ? 4 : 8; // packs in flight per thread
    __shared__ ArgmaxKey scratch[32];
    pdl_trigger(); // launched with PDL (cuda.cuh): nothing is read before the previous kernel is done
    pdl_wait();
    const int64_t r = blockIdx.y;
    const T *row = x + r * V;
    const int64_t lo = int64_t(blockIdx.x) * chunk, hi = std::min<int64_t>(V, lo + chunk);
    const int64_t stride = int64_t(blockDim.x) * VEC;
    float top = -INFINITY;
    int top_i = INT_MAX;
    bool nan = false;
    thread_scan_max<VEC, UNROLL>(row, lo + int64_t(threadIdx.x) * VEC, hi, stride, top, top_i, nan);
    // One key per thread (64 rows x 151936 took 17.5 us with a key per element, 11.8 us this way on an
    // H100). Only -inf seen: key 0, the identity (a row of nothing but -inf keeps it). A NaN beats every
    // number and makes the row's answer -1, so its index does not matter.
    ArgmaxKey best = nan ? argmax_key(NAN, 0) : top_i == INT_MAX ? 0 : argmax_key(top, top_i);
    best = block_max_key(best, scratch);
    if (threadIdx.x == 0) keys[r * gridDim.x + blockIdx.x] = best;
}

// One warp per row: the max of the row's `parts` keys is the answer; the value is copied from x.
template <typename T>
__global__ void __launch_bounds__(32)
    argmax_combine_kernel(int64_t *max_idx, T *max_val, const T *x, const ArgmaxKey *keys, int V, int parts) {
    pdl_wait(); // launched with PDL after the part kernel
    const int64_t r = blockIdx.x;
    ArgmaxKey best = 0;
    for (int p = threadIdx.x; p < parts; p += 32) best = max_key(best, keys[r * parts + p]);
    best = warp_max_key(best);
    if (threadIdx.x == 0) {
        const uint32_t order = uint32_t(best >> 32);
        if (best == 0 || order >= argmax_order(INFINITY)) { // only -inf, or a +inf or NaN: no finite max
            max_idx[r] = -1;
            max_val[r] = from_f32<T>(best == 0 ? -INFINITY : order == argmax_order(NAN) ? NAN : INFINITY);
        } else {
            const int i = int(argmax_key_index(best));
            max_idx[r] = i;
            max_val[r] = x[r * V + i];
        }
    }
}

// Threads per block: enough for one pass of packs over the row, a power of two in [32, 1024].
int argmax_threads(int64_t packs) {
    int t = 32;
    while (t < 1024 && t < packs) t <<= 1;
    return t;
}

// Blocks per row before rounding the chunk; 1 keeps the one-block path.
int64_t argmax_parts(int64_t rows, int64_t V, int64_t elem_size, int device) {
    const int64_t bytes = V * elem_size;
    if (bytes <= kSingleBlockMaxBytes) return 1;
    const int64_t sms = sm_count(device);
    if (rows >= sms || rows > 65535) return 1; // one 1024-thread block per row fills the GPU; grid.y limit
    return std::min(ceil_div(bytes, kChunkBytes), ceil_div(2 * sms, rows));
}

} // namespace

void argmax(const Tensor &max_idx, const Tensor &max_val, const Tensor &x) {
    const int64_t V = x.shape().back(), rows = x.numel() / V;
    LLAISYS_CHECK(rows <= INT32_MAX, std::invalid_argument, "argmax: too many rows for one launch: ", rows);
    detail::dispatch_float("argmax", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        using D = device_t<T>;
        const bool wide = rows_vectorizable<D>(x.data(), V);
        const int vec = wide ? kRowVec<D> : 1;
        cudaStream_t s = stream_of(max_idx);
        int64_t parts = argmax_parts(rows, V, int64_t(sizeof(D)), x.device().index), chunk = V;
        if (parts > 1) {
            chunk = ceil_div(ceil_div(V, parts), 8) * 8; // a multiple of every VEC: chunks start 16-byte aligned
            parts = ceil_div(V, chunk);                  // every part non-empty
        }
        if (parts <= 1) {
            const dim3 grid{unsigned(rows)}, block{unsigned(argmax_threads(ceil_div(V, vec)))};
            if (wide)
                argmax_kernel<kRowVec<D>><<<grid, block, 0, s>>>(max_idx.data_as<int64_t>(), dptr<T>(max_val), dptr<T>(x), int(V));
            else
                argmax_kernel<1><<<grid, block, 0, s>>>(max_idx.data_as<int64_t>(), dptr<T>(max_val), dptr<T>(x), int(V));
            CUDA_CHECK_LAUNCH();
            return;
        }
        // Keys [rows, parts]; freed at scope exit into this stream's pool, after the launches below.
        const Tensor ws = Tensor::empty(Shape{rows * parts}, DType::I64, x.device());
        ArgmaxKey *keys = reinterpret_cast<ArgmaxKey *>(ws.data());
        const dim3 grid{unsigned(parts), unsigned(rows)};
        const int dev = x.device().index;
        if (wide) launch_pdl(argmax_part_kernel<kRowVec<D>, D>, grid, kPartThreads, 0, s, dev, keys, dptr<T>(x), int(V), chunk);
        else launch_pdl(argmax_part_kernel<1, D>, grid, kPartThreads, 0, s, dev, keys, dptr<T>(x), int(V), chunk);
        launch_pdl(argmax_combine_kernel<D>, unsigned(rows), 32, 0, s, dev, max_idx.data_as<int64_t>(), dptr<T>(max_val),
                   dptr<T>(x), keys, int(V), int(parts));
    });
}

} // namespace llaisys::ops::cuda
