// CUDA quantized linear, linear + SwiGLU and embedding over GGUF block weights (readers: blocks.cuh).
//   M <= 8 (decode): quantize_x_kernel turns x into 8-bit blocks of the weight's block size, as the CPU
//   op defines them (d = max|x| / 127 in f32, q = round(x / d)), and quant_gemv_kernel dots each W row
//   with them in integer arithmetic (__dp4a), scaling each sub-block's sum in f32. Both are launched
//   with PDL; the GEMV prefetches the head of its W rows into L2 before it waits for x.
//   M > 8 (prefill, large batches): the whole weight is decoded into a dense scratch [N, K] of x's dtype
//   and the dense linear (cuBLASLt) runs on it with the unquantized x. Memory: N * K * sizeof(T) for the
//   call (bf16: 3.6x the Q4_K bytes; the 1.5B LM head, 151936 x 1536, takes 467 MB), handed back to the
//   caching allocator after it. TODO: a tensor-core GEMM that decodes W tiles in shared memory.
// quant_embedding decodes the picked rows with the M > 8 path's kernel.
#include "ops/quant_linear/quant_linear.hpp"

#include "core/runtime.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/cuda.cuh"
#include "ops/linear/linear.hpp"
#include "ops/quant_linear/blocks.cuh"

#include <algorithm>

namespace llaisys::ops::cuda {
namespace {

using namespace qblocks;

constexpr int64_t kMaxGemvM = kQuantGemvMaxRows; // larger batches take the dequantize + cuBLASLt path
constexpr int kWarps = 8;        // warps per block of the GEMV
constexpr int kIdOutOfRange = 1; // the device error code embedding uses (synchronize raises IndexError)

// x quantized on the device: q int8 [M, K], d f32 [M, K / BK] (one scale per block of BK elements).
struct QuantX {
    const int8_t *q;
    const float *d;
};

// x [M, K] (rows ldx apart) -> q, d, as cpu.cpp's quantize_row (same f32 operations, so the same
// bits): each thread takes 8 elements and the BK / 8 threads of a block (<= 32: one warp) reduce
// max|x| and finiteness by shuffles. A block holding NaN or Inf gets d = NaN and q = 0.
// Launch: ceil(M K / 8 / 256) blocks of 256 threads.
template <typename T, int BK>
__global__ void quantize_x_kernel(int8_t *__restrict__ q, float *__restrict__ d, const T *__restrict__ x,
                                  int64_t ldx, int64_t M, int64_t K) {
    pdl_trigger();
    pdl_wait();
    const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, per_row = K / 8;
    const bool valid = g < M * per_row; // whole BK-blocks are in or out, and every lane reaches the shuffles
    const int64_t m = valid ? g / per_row : 0, k0 = valid ? g % per_row * 8 : 0;
    float v[8], amax = 0.f;
    int bad = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        v[j] = valid ? to_f32(x[m * ldx + k0 + j]) : 0.f;
        bad |= !isfinite(v[j]);
        amax = fmaxf(amax, fabsf(v[j]));
    }
#pragma unroll
    for (int o = 1; o < BK / 8; o <<= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    }
    if (!valid) return;
    const float dd = amax / 127.f, id = dd != 0.f && !bad ? 1.f / dd : 0.f;
    uint32_t packed[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int qj = bad ? 0 : int(roundf(__fmul_rn(v[j], id))); // halves away from zero, as std::round
        packed[j / 4] |= uint32_t(uint8_t(int8_t(qj))) << (8 * (j % 4));
    }
    *reinterpret_cast<uint2 *>(q + m * K + k0) = make_uint2(packed[0], packed[1]);
    if (k0 % BK == 0) d[m * (K / BK) + k0 / BK] = bad ? __int_as_float(0x7fc00000) : dd;
}

// One sub-block of W dotted with 32 x codes, in f32: exact integer sums, then the scales. The codes'
// offsets and the mins multiply the sums of the x codes of each 16 (xs_lo, xs_hi).
__device__ __forceinline__ float sub_dot(const Sub32 &w, const int (&x)[8], int xs_lo, int xs_hi) {
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) lo = __dp4a(w.q[i], x[i], lo), hi = __dp4a(w.q[4 + i], x[4 + i], hi);
    const int isum = w.isc[0] * (lo - w.off * xs_lo) + w.isc[1] * (hi - w.off * xs_hi);
    return w.d * float(isum) - w.dm * float(xs_lo + xs_hi);
}

// out [M, N] = x @ W^T (+ bias [N]) with W [N, K], or with kSwiglu out = swiglu(x @ W[:N]^T, x @ W[N:]^T)
// with W [2N, K], g and u rounded to T first as linear + swiglu would. M <= MR: x rows past M repeat
// the last (computed, never stored).
// Launch: at most one wave of blocks of kWarps warps; warp w takes output columns n = w, w + all warps,
// ... For each it reads its W row(s) once: lane l takes sub-blocks l, l + 32, ... (32 weights each),
// dots them with the MR x rows, and shuffles reduce the lanes' f32 sums. A row's summation order
// depends on K alone, so linear_swiglu's g and u equal linear's outputs bit for bit.
template <class F, typename T, int MR, bool kSwiglu>
__global__ void __launch_bounds__(kWarps * 32, 2) // <= 128 registers: 2+ blocks per SM for M = 8, swiglu
    quant_gemv_kernel(T *__restrict__ out, const uint8_t *__restrict__ w, int64_t row_bytes, QuantX xq,
                      const T *__restrict__ bias, int64_t M, int64_t N, int64_t K) {
    constexpr int R = kSwiglu ? 2 : 1;
    const int lane = threadIdx.x & 31;
    const int64_t warp0 = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5), nwarps = int64_t(gridDim.x) * kWarps;
    const int64_t nsub = K / 32, nb = K / F::kBK;
    // W is not written by the kernels ahead: the first rows stream into L2 while they finish.
    if (warp0 < N)
        for (int r = 0; r < R; ++r)
            for (int64_t off = 128 * lane; off < row_bytes; off += 32 * 128)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(w + (warp0 + r * N) * row_bytes + off));
    pdl_trigger();
    pdl_wait();
    const int8_t *xr[MR];
    const float *dr[MR];
#pragma unroll
    for (int m = 0; m < MR; ++m) {
        const int64_t row = m < M ? m : M - 1;
        xr[m] = xq.q + row * K, dr[m] = xq.d + row * nb;
    }
    for (int64_t n = warp0; n < N; n += nwarps) {
        float acc[MR][R] = {};
        for (int64_t s = lane; s < nsub; s += 32) {
            const int64_t b = s / F::kSubs;
            Sub32 sub[R];
#pragma unroll
            for (int r = 0; r < R; ++r) sub[r] = F::sub(w + (n + r * N) * row_bytes + b * F::kBytes, int(s % F::kSubs));
#pragma unroll
            for (int m = 0; m < MR; ++m) {
                const int4 *xp = reinterpret_cast<const int4 *>(xr[m] + s * 32);
                const int4 x0 = __ldg(xp), x1 = __ldg(xp + 1);
                const int xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
                int xs_lo = 0, xs_hi = 0;
                if constexpr (F::kOffsets)
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        xs_lo = __dp4a(xv[i], 0x01010101, xs_lo), xs_hi = __dp4a(xv[4 + i], 0x01010101, xs_hi);
                const float dx = __ldg(dr[m] + b);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[m][r] += dx * sub_dot(sub[r], xv, xs_lo, xs_hi);
            }
        }
#pragma unroll
        for (int m = 0; m < MR; ++m)
#pragma unroll
            for (int r = 0; r < R; ++r) acc[m][r] = warp_sum(acc[m][r]);
        if (lane != 0) continue;
#pragma unroll
        for (int m = 0; m < MR; ++m) {
            if (m >= M) break;
            if constexpr (kSwiglu) { // the swiglu op's formula (ops/swiglu/cuda.cu)
                const float g = to_f32(from_f32<T>(acc[m][0])), u = to_f32(from_f32<T>(acc[m][1]));
                out[m * N + n] = from_f32<T>(u * (g / (1.f + expf(-g))));
            } else {
                out[m * N + n] = from_f32<T>(acc[m][0] + (bias ? to_f32(bias[n]) : 0.f));
            }
        }
    }
}

// out [n, K] = rows ids[i] of W [V, K] decoded (embedding; an id outside [0, V) sets the device error
// flag and zero-fills its row), or rows i when ids is null (the M > 8 path's dense copy of W).
// Launch: one block per output row; each thread decodes sub-blocks of 32 weights and stores them with
// 16-byte writes where the row allows.
template <class F, typename T, typename Id>
__global__ void decode_rows_kernel(T *__restrict__ out, const Id *__restrict__ ids, const uint8_t *__restrict__ w,
                                   int64_t row_bytes, int64_t V, int64_t K, int *error_flag) {
    const int64_t i = blockIdx.x, r = ids ? int64_t(ids[i]) : i;
    T *dst = out + i * K;
    if (r < 0 || r >= V) {
        if (threadIdx.x == 0) *error_flag = kIdOutOfRange;
        for (int64_t k = threadIdx.x; k < K; k += blockDim.x) dst[k] = from_f32<T>(0.f);
        return;
    }
    constexpr int kVec = int(32 * sizeof(T) / 16); // 16-byte words per sub-block
    for (int64_t s = threadIdx.x; s < K / 32; s += blockDim.x) {
        const Sub32 sub = F::sub(w + r * row_bytes + s / F::kSubs * F::kBytes, int(s % F::kSubs));
        union {
            T v[32];
            uint4 u[kVec];
        } vals;
#pragma unroll
        for (int j = 0; j < 32; ++j) vals.v[j] = from_f32<T>(decode<F>(sub, j));
        T *o = dst + s * 32;
        if (reinterpret_cast<uintptr_t>(o) % 16 == 0) {
#pragma unroll
            for (int c = 0; c < kVec; ++c) reinterpret_cast<uint4 *>(o)[c] = vals.u[c];
        } else {
#pragma unroll
            for (int j = 0; j < 32; ++j) o[j] = vals.v[j];
        }
    }
}

// The readers load 4-byte words at 2- or 4-byte offsets from a row start (F::kAlign): every row starts
// so aligned when the matrix does (row_bytes is a multiple of the block size).
template <class F>
void check_aligned(const char *op, const QuantMatrix &w) {
    LLAISYS_CHECK(reinterpret_cast<uintptr_t>(w.bytes().data()) % F::kAlign == 0, std::invalid_argument, op, ": ",
                  quant_format_info(w.format()).name, " weight bytes must start on a ", F::kAlign,
                  "-byte boundary on ", w.device().str());
}

template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads) {
    int n = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
    return std::max(n, 1);
}

// Quantizes x [M, K] into scratch, then launches the GEMV for N outputs (see quant_gemv_kernel).
template <class F, typename T, int MR, bool kSwiglu>
void launch_gemv(const Tensor &out, const Tensor &x, const QuantMatrix &w, const Tensor &bias, int64_t N) {
    using D = device_t<T>;
    const int64_t M = x.size(0), K = w.cols(), nb = K / F::kBK;
    const int dev = out.device().index;
    const cudaStream_t stream = stream_of(out);
    // q int8 [M, K], then d f32 [M, nb] (K % 32 == 0 keeps both 16-byte aligned); freed stream-ordered.
    const Tensor scratch = Tensor::empty({M * K + M * nb * 4}, DType::U8, out.device());
    int8_t *q = reinterpret_cast<int8_t *>(scratch.data());
    float *d = reinterpret_cast<float *>(q + M * K);
    launch_pdl(quantize_x_kernel<D, F::kBK>, dim3(unsigned(ceil_div(M * K / 8, 256))), dim3(256), 0, stream, dev, q,
               d, dptr<T>(x), linear_detail::ld(x), M, K);
    auto kernel = quant_gemv_kernel<F, D, MR, kSwiglu>;
    static const int per_sm = blocks_per_sm(kernel, kWarps * 32);
    const int64_t blocks = std::min(ceil_div(N, kWarps), int64_t(sm_count(dev)) * per_sm);
    launch_pdl(kernel, dim3(unsigned(blocks)), dim3(kWarps * 32), 0, stream, dev, dptr<T>(out),
               w.bytes().data_as<uint8_t>(), w.row_bytes(), QuantX{q, d},
               bias.defined() ? dptr<T>(bias) : nullptr, M, N, K);
}

template <typename T, bool kSwiglu>
void gemv(const char *op, const Tensor &out, const Tensor &x, const QuantMatrix &w, const Tensor &bias) {
    const int64_t M = x.size(0), N = out.size(1);
    dispatch_format(w.format(), [&](auto f) {
        using F = decltype(f);
        check_aligned<F>(op, w);
        if (M == 1) launch_gemv<F, T, 1, kSwiglu>(out, x, w, bias, N);
        else if (M == 2) launch_gemv<F, T, 2, kSwiglu>(out, x, w, bias, N);
        else if (M <= 4) launch_gemv<F, T, 4, kSwiglu>(out, x, w, bias, N);
        else launch_gemv<F, T, 8, kSwiglu>(out, x, w, bias, N);
    });
}

// out [n, K] (T, contiguous) = decode_rows_kernel over W's rows ids (or all rows when ids is null).
template <typename T, typename Id>
void decode_rows(const char *op, const Tensor &out, const Id *ids, const QuantMatrix &w) {
    const int64_t n = out.size(0), K = w.cols();
    LLAISYS_CHECK(n <= INT32_MAX, std::invalid_argument, op, ": too many rows for one launch: ", n);
    const int threads = int(std::min<int64_t>(256, ceil_div(K / 32, 32) * 32));
    dispatch_format(w.format(), [&](auto f) {
        using F = decltype(f);
        check_aligned<F>(op, w);
        decode_rows_kernel<F, device_t<T>, Id><<<unsigned(n), threads, 0, stream_of(out)>>>(
            dptr<T>(out), ids, w.bytes().data_as<uint8_t>(), w.row_bytes(), w.rows(), K,
            ::llaisys::runtime::cuda::error_flag(out.device()));
        CUDA_CHECK_LAUNCH();
    });
}

// W decoded into a new dense tensor [rows, K] of dtype T (the M > 8 path's scratch).
template <typename T>
Tensor dense_weight(const char *op, const QuantMatrix &w, DType dtype) {
    const Tensor dense = Tensor::empty({w.rows(), w.cols()}, dtype, w.device());
    decode_rows<T, int64_t>(op, dense, nullptr, w);
    return dense;
}

} // namespace

void quant_linear(const Tensor &out, const Tensor &x, const QuantMatrix &weight, const Tensor &bias) {
    constexpr const char *op = "quant_linear";
    detail::dispatch_float(op, x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        if (x.size(0) > kMaxGemvM) return linear(out, x, dense_weight<T>(op, weight, x.dtype()), bias, false);
        gemv<T, false>(op, out, x, weight, bias);
    });
}

void quant_linear_swiglu(const Tensor &out, const Tensor &x, const QuantMatrix &w_gate_up) {
    constexpr const char *op = "quant_linear_swiglu";
    detail::dispatch_float(op, x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        if (x.size(0) > kMaxGemvM) return linear_swiglu(out, x, dense_weight<T>(op, w_gate_up, x.dtype()), false);
        gemv<T, true>(op, out, x, w_gate_up, Tensor());
    });
}

void quant_embedding(const Tensor &out, const Tensor &ids, const QuantMatrix &weight) {
    constexpr const char *op = "quant_embedding";
    detail::dispatch_float(op, out.dtype(), out.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        detail::dispatch_index(op, ids.dtype(), ids.device(), [&](auto itag) {
            using Id = typename decltype(itag)::type;
            decode_rows<T, Id>(op, out, ids.data_as<Id>(), weight);
        });
    });
}

} // namespace llaisys::ops::cuda
