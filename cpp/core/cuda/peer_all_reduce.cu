// The one-shot peer-memory all-reduce (peer_all_reduce.hpp says why and what it promises).
#include "core/cuda/peer_all_reduce.hpp"

#include "core/cuda/check.hpp"
#include "llaisys/stream.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace llaisys::runtime::cuda {

namespace {
using PAR = PeerAllReduce;

struct Peers {                                // every rank's memory, as this rank's kernel reaches it
    void *buf[2][PAR::kMaxRanks];             // the two alternating input buffers
    uint32_t *flags[PAR::kMaxRanks];          // [kBlocks][kMaxRanks]: flags[r][b][s] = the epoch rank s reached
};

__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ void st_release_sys(uint32_t *addr, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t *addr) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
    return v;
}

// A unit is one element, or (Vec) 16 bytes of them: the loads of a large message go 16 bytes at a time.
template <typename T, bool Vec> struct Unit {
    static constexpr int kElems = Vec ? int(16 / sizeof(T)) : 1;
    using Raw = std::conditional_t<Vec, uint4, T>;
};

// Block b owns chunk b of the units. It copies the chunk into this rank's buffer of the epoch's parity, tells
// every peer (flag), waits until every peer told it, then sums the chunk over all ranks' buffers in rank order.
template <typename T, bool Vec>
__global__ void __launch_bounds__(PAR::kThreads)
    peer_all_reduce_kernel(T *x, int64_t units, Peers p, uint32_t *counters, int rank, int world, volatile int *host) {
    using U = Unit<T, Vec>;
    using Raw = typename U::Raw;
    const int b = blockIdx.x, t = threadIdx.x;
    const uint32_t epoch = counters[b] + 1; // written below by thread 0 only after every thread passed the barriers
    const int parity = int(epoch & 1u);
    const int64_t per = (units + gridDim.x - 1) / gridDim.x, lo = min(units, b * per), hi = min(units, lo + per);
    Raw *xs = reinterpret_cast<Raw *>(x);
    Raw *mine = static_cast<Raw *>(p.buf[parity][rank]);
    for (int64_t i = lo + t; i < hi; i += blockDim.x) mine[i] = xs[i];
    __syncthreads(); // the block's copy is done; the signalling thread's release below carries it to the peers
    if (t < world && t != rank) {
        __threadfence_system();
        st_release_sys(p.flags[t] + b * PAR::kMaxRanks + rank, epoch);
        const uint32_t *from = p.flags[rank] + b * PAR::kMaxRanks + t;
        const uint64_t start = now_ns();
        // >= (wrapping): a fast peer may already have moved on to epoch + 1, never further (it waits for us).
        // The abort flag lives in mapped host memory (a PCIe round trip a read): looked at every 256 spins
        for (uint32_t spin = 1; int32_t(ld_acquire_sys(from) - epoch) < 0; ++spin) {
            if ((spin & 255u) != 0) continue;
            if (host[0] != 0) break; // the group was aborted
            if (now_ns() - start > uint64_t(PAR::kTimeoutNs)) {
                host[1] = 1;
                break;
            }
        }
    }
    __syncthreads();
    for (int64_t i = lo + t; i < hi; i += blockDim.x) {
        float acc[U::kElems];
#pragma unroll
        for (int j = 0; j < U::kElems; ++j) acc[j] = 0.f;
        // every rank's unit is requested before any is summed: the NVLink reads' latencies overlap instead of
        // adding up one rank after another (at 4 ranks the loop form took 22.6 us against 9.4 at 2)
        Raw v[PAR::kMaxRanks];
#pragma unroll
        for (int r = 0; r < PAR::kMaxRanks; ++r) {
            if (r >= world) break;
            if constexpr (Vec) {
                v[r] = __ldcg(static_cast<const uint4 *>(p.buf[parity][r]) + i);
            } else if constexpr (sizeof(T) == 2) { // past L1: the peers wrote it after this SM last looked
                const unsigned short bits = __ldcg(static_cast<const unsigned short *>(p.buf[parity][r]) + i);
                memcpy(&v[r], &bits, 2);
            } else {
                v[r] = __ldcg(static_cast<const float *>(p.buf[parity][r]) + i);
            }
        }
#pragma unroll
        for (int r = 0; r < PAR::kMaxRanks; ++r) { // in rank order: every rank gets the same bits
            if (r >= world) break;
            const T *e = reinterpret_cast<const T *>(&v[r]);
#pragma unroll
            for (int j = 0; j < U::kElems; ++j) acc[j] += to_f(e[j]);
        }
        Raw out;
        T *o = reinterpret_cast<T *>(&out);
#pragma unroll
        for (int j = 0; j < U::kElems; ++j) o[j] = from_f<T>(acc[j]);
        xs[i] = out;
    }
    if (t == 0) counters[b] = epoch;
}

template <typename T>
void launch(const Tensor &x, const Peers &p, uint32_t *counters, int rank, int world, int *host, cudaStream_t s) {
    const int64_t n = x.numel();
    constexpr int64_t V = 16 / sizeof(T);
    T *data = static_cast<T *>(x.data());
    if (n % V == 0 && reinterpret_cast<uintptr_t>(data) % 16 == 0)
        peer_all_reduce_kernel<T, true><<<PAR::kBlocks, PAR::kThreads, 0, s>>>(data, n / V, p, counters, rank, world, host);
    else
        peer_all_reduce_kernel<T, false><<<PAR::kBlocks, PAR::kThreads, 0, s>>>(data, n, p, counters, rank, world, host);
    LLAISYS_CUDA_CHECK(cudaGetLastError());
}

} // namespace

struct PeerAllReduce::Rank {
    int device = 0;
    void *buf[2] = {nullptr, nullptr};
    uint32_t *flags = nullptr, *counters = nullptr;
    int *host = nullptr; // the mapped host flags as this device addresses them
};

std::shared_ptr<PeerAllReduce> PeerAllReduce::create(const std::vector<int> &devices, size_t max_bytes) {
    const int world = int(devices.size());
    // Default: on for 2 to 4 ranks, where it was measured faster than NCCL (bench/RESULTS.md, sessions 28 and
    // 29), off for more until a run measures it there; LLAISYS_PEER_ALLREDUCE=1/0 forces it.
    const char *env = std::getenv("LLAISYS_PEER_ALLREDUCE");
    const bool on = env != nullptr && *env != '\0' ? std::strcmp(env, "0") != 0 : world <= 4;
    if (world < 2 || world > kMaxRanks || !on) return nullptr;
    for (int a : devices)
        for (int b : devices) {
            int can = 0;
            if (a != b && (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess || !can)) {
                cudaGetLastError();
                return nullptr; // NCCL alone then
            }
        }
    std::shared_ptr<PeerAllReduce> g(new PeerAllReduce());
    g->max_bytes_ = max_bytes;
    LLAISYS_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void **>(&g->host_flags_), 2 * sizeof(int),
                                     cudaHostAllocMapped | cudaHostAllocPortable));
    g->host_flags_[0] = g->host_flags_[1] = 0;
    for (int d : devices) {
        DeviceGuard on(Device::cuda(d));
        for (int peer : devices) {
            if (peer == d) continue;
            const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
            if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError(); // NCCL may have done it
            else LLAISYS_CUDA_CHECK(e);
        }
        auto r = std::make_unique<Rank>();
        r->device = d;
        for (void *&buf : r->buf) LLAISYS_CUDA_CHECK(cudaMalloc(&buf, max_bytes));
        const size_t flag_bytes = size_t(kBlocks) * kMaxRanks * sizeof(uint32_t);
        LLAISYS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void **>(&r->flags), flag_bytes));
        LLAISYS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void **>(&r->counters), kBlocks * sizeof(uint32_t)));
        LLAISYS_CUDA_CHECK(cudaMemset(r->flags, 0, flag_bytes));
        LLAISYS_CUDA_CHECK(cudaMemset(r->counters, 0, kBlocks * sizeof(uint32_t)));
        LLAISYS_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void **>(&r->host), g->host_flags_, 0));
        LLAISYS_CUDA_CHECK(cudaDeviceSynchronize()); // zeroed before any peer's kernel can read them
        g->ranks_.push_back(std::move(r));
    }
    return g;
}

PeerAllReduce::~PeerAllReduce() {
    for (auto &r : ranks_) {
        int previous = 0;
        cudaGetDevice(&previous);
        cudaSetDevice(r->device);
        for (void *buf : r->buf) cudaFree(buf);
        cudaFree(r->flags);
        cudaFree(r->counters);
        cudaSetDevice(previous);
    }
    if (host_flags_ != nullptr) cudaFreeHost(host_flags_);
}

bool PeerAllReduce::takes(const Tensor &x) const {
    const DType d = x.dtype();
    return x.device().is_cuda() && x.is_contiguous() && size_t(x.numel()) * x.element_size() <= max_bytes_ &&
           (d == DType::F32 || d == DType::F16 || d == DType::BF16) && host_flags_[0] == 0;
}

void PeerAllReduce::all_reduce(int rank, const Tensor &x) {
    LLAISYS_CHECK(error().empty(), std::runtime_error, error());
    LLAISYS_CHECK(rank >= 0 && rank < int(ranks_.size()), std::out_of_range, "peer all_reduce: rank ", rank);
    const Rank &me = *ranks_[size_t(rank)];
    Peers p{};
    for (size_t r = 0; r < ranks_.size(); ++r) {
        p.buf[0][r] = ranks_[r]->buf[0];
        p.buf[1][r] = ranks_[r]->buf[1];
        p.flags[r] = ranks_[r]->flags;
    }
    const auto s = static_cast<cudaStream_t>(current_stream(x.device()).handle());
    const int world = int(ranks_.size());
    switch (x.dtype()) {
    case DType::F32: launch<float>(x, p, me.counters, rank, world, me.host, s); break;
    case DType::F16: launch<__half>(x, p, me.counters, rank, world, me.host, s); break;
    case DType::BF16: launch<__nv_bfloat16>(x, p, me.counters, rank, world, me.host, s); break;
    default: throw TypeError(detail::concat("peer all_reduce takes f32, f16 or bf16, got ", dtype_name(x.dtype())));
    }
}

void PeerAllReduce::abort() { *static_cast<volatile int *>(host_flags_) = 1; }

std::string PeerAllReduce::error() const {
    if (static_cast<volatile int *>(host_flags_)[1] == 0) return "";
    return detail::concat("peer all_reduce: a rank did not reach the barrier within ", kTimeoutNs / 1'000'000'000LL,
                          " s; the group's sums since are not valid");
}

} // namespace llaisys::runtime::cuda
