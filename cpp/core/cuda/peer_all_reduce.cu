// The one-shot peer-memory all-reduce (peer_all_reduce.hpp says why and what it promises).
#include "core/cuda/peer_all_reduce.hpp"

#include "core/cuda/check.hpp"
#include "llaisys/stream.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
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

struct PushPeers {                             // every rank's receive buffer of one dtype width
    uint4 *buf[PAR::kMaxRanks];               // [3 phases][world slots][cap units of 16 bytes]
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

// ---- push ("Lamport") kernel ----

// Every 32-bit word of an empty slot: -0.0 in every element (one f32, or two f16/bf16: their -0.0 is 0x8000).
// The two widths keep separate buffers, so a slot cleared after an f32 call still reads empty to a bf16 one.
template <typename T> constexpr uint32_t kEmptyWord = sizeof(T) == 4 ? 0x80000000u : 0x80008000u;

template <typename T> __device__ __forceinline__ bool word_empty(uint32_t w) {
    if constexpr (sizeof(T) == 4) return w == 0x80000000u;
    else return (w & 0xffffu) == 0x8000u || (w >> 16) == 0x8000u; // either element still empty
}
// -0.0 -> +0.0: the sum is the same, and data never looks like an empty slot.
template <typename T> __device__ __forceinline__ uint32_t no_neg_zero(uint32_t w) {
    if constexpr (sizeof(T) == 4) return w == 0x80000000u ? 0u : w;
    else {
        const uint32_t lo = (w & 0xffffu) == 0x8000u ? 0u : (w & 0xffffu);
        const uint32_t hi = (w >> 16) == 0x8000u ? 0u : (w >> 16);
        return lo | (hi << 16);
    }
}
template <typename T> __device__ __forceinline__ bool unit_full(const uint4 &u) {
    return !word_empty<T>(u.x) && !word_empty<T>(u.y) && !word_empty<T>(u.z) && !word_empty<T>(u.w);
}

// The posted write to a peer and the poll of this rank's own buffer are strong (.relaxed.sys) accesses: the poll
// goes to this GPU's L2, where the peers' NVLink writes land, never to a stale L1 line, and the compiler keeps
// every poll (asm volatile). No acquire is needed: the data is its own flag, and nothing else is read because
// of it. Torn writes: PTX promises single-copy atomicity only per element of a vector access (32 bits here),
// not for the 16 bytes, so this code does not assume a 16-byte store arrives in one piece (it likely does over
// NVLink, but nothing documents it). A poll may see some words of a unit new and some still empty; unit_full
// checks every word, and within a word both 16-bit elements (a word arrives whole, so that is belt and braces),
// and the unit counts only once all of them hold data; the values summed are those of that same load. A word
// that is not the sentinel can only be this call's data: the slot was emptied after its last read and no one
// writes it before this call (the race argument at the kernel).
__device__ __forceinline__ void st_sys_v4(uint4 *addr, const uint4 &v) {
    asm volatile("st.relaxed.sys.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(addr), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
}
__device__ __forceinline__ uint4 ld_sys_v4(const uint4 *addr) {
    uint4 v;
    asm volatile("ld.relaxed.sys.global.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(addr)
                 : "memory");
    return v;
}

// Unit i of x (16 bytes: 16 / sizeof(T) elements) with -0.0 made +0.0; past the end of x, +0.0.
template <typename T> __device__ __forceinline__ uint4 load_unit(const T *x, int64_t n, int64_t i, bool aligned) {
    constexpr int V = 16 / sizeof(T);
    uint4 u;
    if (aligned && (i + 1) * V <= n) {
        u = reinterpret_cast<const uint4 *>(x)[i];
    } else { // a misaligned x, or the tail of an odd count
        uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const int64_t k = i * V + j;
            if (k >= n) break;
            uint32_t bits = 0;
            memcpy(&bits, x + k, sizeof(T));
            w[j * sizeof(T) / 4] |= bits << (8 * ((j * sizeof(T)) % 4));
        }
        u = make_uint4(w[0], w[1], w[2], w[3]);
    }
    return make_uint4(no_neg_zero<T>(u.x), no_neg_zero<T>(u.y), no_neg_zero<T>(u.z), no_neg_zero<T>(u.w));
}

template <typename T> __device__ __forceinline__ void store_unit(T *x, int64_t n, int64_t i, bool aligned, const uint4 &u) {
    constexpr int V = 16 / sizeof(T);
    if (aligned && (i + 1) * V <= n) {
        reinterpret_cast<uint4 *>(x)[i] = u;
        return;
    }
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const int64_t k = i * V + j;
        if (k >= n) break;
        const uint32_t bits = w[j * sizeof(T) / 4] >> (8 * ((j * sizeof(T)) % 4));
        memcpy(x + k, &bits, sizeof(T)); // little-endian: the low bytes of bits
    }
}

// Push call e (counting this kernel's calls only: pull and NCCL calls between do not move the phase) uses phase
// e % 3 of every rank's receive buffer: rank s writes its input into slot [phase][s] of every peer's buffer (its
// own slot of its own buffer stays empty: its input is in registers), then each rank polls its own buffer until
// every peer's slot of its units is full, sums in rank order, and empties those slots again.
// Why this is race-free. (1) No early overwrite: a peer s writes slot [p][s] of this rank R's buffer again only
// at call e + 3. Its kernel of e + 3 starts after its kernel of e + 2 ended, which waited for at least one unit
// of R's input of e + 2 (every call has one: empty tensors never get here). R pushes that only from its kernel of
// e + 2, which starts after R's kernel of e ended, emptying included: R runs its calls on one stream, in order,
// and a kernel's writes are done and visible to later work when it ends. So nothing of call e + 3 lands in the
// slot before R has read and emptied it for call e. (2) No stale data: at call e the slot holds the sentinel or
// call e's data, since the write of call e - 3 was read and emptied by R's kernel of e - 3. One phase would race
// (s, done with call e, needs only R's data of e, which R pushes before it reads its own slots, and could then
// overwrite them with e + 1); two would do while each rank's kernels run strictly one after another; the third
// keeps a call of margin (should a successor kernel ever start before this one ends, e.g. programmatic
// dependent launch), for 1.5x the memory. Every rank's thread i handles unit i (the same fixed grid on every
// rank), so the units of one rank's thread depend only on other ranks' threads, which push before they wait:
// no rank's block waits for another block of its own rank, so the kernel needs no co-residency and cannot
// deadlock by scheduling. Needs: every rank calls with the same count and dtype in the same order (the
// group's contract), each rank's calls on one stream.
template <typename T>
__global__ void __launch_bounds__(PAR::kPushThreads)
    push_all_reduce_kernel(T *x, int64_t n, PushPeers p, uint4 *own_buf, uint32_t *phases, int64_t cap, int rank,
                           int world, volatile int *host) {
    __shared__ uint32_t phase_s;
    if (threadIdx.x == 0) { // every block runs every call, so the blocks' phases stay equal (and equal the peers')
        phase_s = phases[blockIdx.x];
        phases[blockIdx.x] = (phase_s + 1) % 3u; // mod 3 here, not of a wrapping count: 2^32 is not a multiple of 3
    }
    __syncthreads();
    constexpr int V = 16 / sizeof(T);
    const int64_t units = (n + V - 1) / V, first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0;
    const int64_t phase_base = int64_t(phase_s) * world * cap;
    // all of this thread's units go out before it waits for any: the peers' polls start as early as they can
    for (int64_t i = first; i < units; i += stride) {
        const uint4 u = load_unit(x, n, i, aligned);
#pragma unroll
        for (int r = 0; r < PAR::kMaxRanks; ++r) {
            if (r >= world) break;
            if (r != rank) st_sys_v4(p.buf[r] + phase_base + int64_t(rank) * cap + i, u);
        }
    }
    uint4 *const mine = own_buf + phase_base; // = p.buf[rank], passed apart: a dynamic index of p goes to local memory
    uint32_t spin = 0;
    uint64_t start = 0;
    bool gave_up = false;
    for (int64_t i = first; i < units; i += stride) {
        uint4 v[PAR::kMaxRanks];
        const uint4 own = load_unit(x, n, i, aligned); // this thread has not written x yet
        uint32_t pending = ((1u << world) - 1u) & ~(1u << rank);
#pragma unroll
        for (int r = 0; r < PAR::kMaxRanks; ++r) v[r] = own; // v[rank] = own without a dynamic register index
        while (pending != 0u && !gave_up) {
            // every pending slot is read before any is looked at: the reads' latencies overlap
            const uint32_t reading = pending;
#pragma unroll
            for (int r = 0; r < PAR::kMaxRanks; ++r) {
                if (r >= world) break;
                if ((reading >> r) & 1u) v[r] = ld_sys_v4(mine + int64_t(r) * cap + i);
            }
#pragma unroll
            for (int r = 0; r < PAR::kMaxRanks; ++r) {
                if (r >= world) break;
                if (((reading >> r) & 1u) && unit_full<T>(v[r])) pending &= ~(1u << r);
            }
            // a peer that never comes: the abort flag (mapped host memory, a PCIe round trip a read) and the
            // clock are looked at every 1024 polls, about half a millisecond of waiting
            if (pending != 0u && (++spin & 1023u) == 0u) {
                const uint64_t t = now_ns();
                if (start == 0) start = t;
                // the group was aborted, or some thread (of any rank, any kernel) already timed out: the sums
                // are void, so every waiting thread leaves within half a millisecond, not after its own 120 s
                if (host[0] != 0 || host[1] != 0) gave_up = true;
                else if (t - start > uint64_t(PAR::kTimeoutNs)) {
                    host[1] = 1;
                    gave_up = true;
                }
            }
        }
        float acc[V];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = 0.f;
#pragma unroll
        for (int r = 0; r < PAR::kMaxRanks; ++r) { // in rank order: every rank gets the same bits
            if (r >= world) break;
            T e[V];
            memcpy(e, &v[r], 16);
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] += to_f(e[j]);
        }
        T o[V];
#pragma unroll
        for (int j = 0; j < V; ++j) o[j] = from_f<T>(acc[j]);
        uint4 out;
        memcpy(&out, o, 16);
        store_unit(x, n, i, aligned, out);
        const uint4 empty = make_uint4(kEmptyWord<T>, kEmptyWord<T>, kEmptyWord<T>, kEmptyWord<T>);
#pragma unroll
        for (int r = 0; r < PAR::kMaxRanks; ++r) { // emptied for call e + 3 (the kernel's end publishes it)
            if (r >= world) break;
            if (r != rank) mine[int64_t(r) * cap + i] = empty;
        }
    }
}

__global__ void fill_words(uint32_t *p, size_t n, uint32_t w) {
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) p[i] = w;
}

template <typename T>
void launch_push(const Tensor &x, const PushPeers &p, uint32_t *phases, int64_t cap, int rank, int world, int *host,
                 cudaStream_t s) {
    push_all_reduce_kernel<T><<<PAR::kPushBlocks, PAR::kPushThreads, 0, s>>>(
        static_cast<T *>(x.data()), x.numel(), p, p.buf[rank], phases, cap, rank, world, host);
    LLAISYS_CUDA_CHECK(cudaGetLastError());
}

} // namespace

struct PeerAllReduce::Rank {
    int device = 0;
    void *buf[2] = {nullptr, nullptr};
    uint32_t *flags = nullptr, *counters = nullptr;
    int *host = nullptr; // the mapped host flags as this device addresses them
    uint4 *recv[2] = {nullptr, nullptr}; // push: receive buffers for 4-byte and 2-byte dtypes (null: push off)
    uint32_t *phases = nullptr;          // push: [kPushBlocks] the phase of the next call
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
    // Push by default at 2 ranks, the only size it has run on GPUs (2 H200s, bench/RESULTS.md session 40);
    // LLAISYS_PEER_ALLREDUCE_PUSH=1/0 forces it on (3-4 ranks) or off (every message pulls, the A/B). Read once
    // here, so all ranks agree.
    const char *push_env = std::getenv("LLAISYS_PEER_ALLREDUCE_PUSH");
    const bool push = push_env != nullptr && *push_env != '\0' ? std::strcmp(push_env, "0") != 0 : world == 2;
    g->push_max_bytes_ = push ? std::min(max_bytes, kPushMaxBytes) / 16 * 16 : 0;
    const size_t slot_units = g->push_max_bytes_ / 16, recv_words = 3 * size_t(world) * slot_units * 4;
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
        if (slot_units > 0) {
            for (int w = 0; w < 2; ++w) {
                LLAISYS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void **>(&r->recv[w]), recv_words * sizeof(uint32_t)));
                fill_words<<<256, 256>>>(reinterpret_cast<uint32_t *>(r->recv[w]), recv_words,
                                         w == 0 ? kEmptyWord<float> : kEmptyWord<__nv_bfloat16>);
                LLAISYS_CUDA_CHECK(cudaGetLastError());
            }
            LLAISYS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void **>(&r->phases), kPushBlocks * sizeof(uint32_t)));
            LLAISYS_CUDA_CHECK(cudaMemset(r->phases, 0, kPushBlocks * sizeof(uint32_t)));
        }
        LLAISYS_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void **>(&r->host), g->host_flags_, 0));
        LLAISYS_CUDA_CHECK(cudaDeviceSynchronize()); // zeroed / emptied before any peer's kernel touches them
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
        for (uint4 *recv : r->recv) cudaFree(recv);
        cudaFree(r->phases);
        cudaSetDevice(previous);
    }
    if (host_flags_ != nullptr) cudaFreeHost(host_flags_);
}

bool PeerAllReduce::takes(const Tensor &x) const {
    const DType d = x.dtype();
    return x.device().is_cuda() && x.is_contiguous() && size_t(x.numel()) * x.element_size() <= max_bytes_ &&
           (d == DType::F32 || d == DType::F16 || d == DType::BF16) && host_flags_[0] == 0;
}

const char *PeerAllReduce::all_reduce(int rank, const Tensor &x) {
    LLAISYS_CHECK(error().empty(), std::runtime_error, error());
    LLAISYS_CHECK(rank >= 0 && rank < int(ranks_.size()), std::out_of_range, "peer all_reduce: rank ", rank);
    const DType d = x.dtype();
    LLAISYS_CHECK(d == DType::F32 || d == DType::F16 || d == DType::BF16, TypeError,
                  "peer all_reduce takes f32, f16 or bf16, got ", dtype_name(d));
    const Rank &me = *ranks_[size_t(rank)];
    const auto s = static_cast<cudaStream_t>(current_stream(x.device()).handle());
    const int world = int(ranks_.size());
    if (size_t(x.numel()) * x.element_size() <= push_max_bytes_) {
        const int w = x.element_size() == 4 ? 0 : 1;
        PushPeers p{};
        for (size_t r = 0; r < ranks_.size(); ++r) p.buf[r] = ranks_[r]->recv[w];
        const int64_t cap = int64_t(push_max_bytes_ / 16);
        switch (d) {
        case DType::F32: launch_push<float>(x, p, me.phases, cap, rank, world, me.host, s); break;
        case DType::F16: launch_push<__half>(x, p, me.phases, cap, rank, world, me.host, s); break;
        default: launch_push<__nv_bfloat16>(x, p, me.phases, cap, rank, world, me.host, s); break;
        }
        return "push";
    }
    Peers p{};
    for (size_t r = 0; r < ranks_.size(); ++r) {
        p.buf[0][r] = ranks_[r]->buf[0];
        p.buf[1][r] = ranks_[r]->buf[1];
        p.flags[r] = ranks_[r]->flags;
    }
    switch (d) {
    case DType::F32: launch<float>(x, p, me.counters, rank, world, me.host, s); break;
    case DType::F16: launch<__half>(x, p, me.counters, rank, world, me.host, s); break;
    default: launch<__nv_bfloat16>(x, p, me.counters, rank, world, me.host, s); break;
    }
    return "pull";
}

void PeerAllReduce::abort() { *static_cast<volatile int *>(host_flags_) = 1; }

std::string PeerAllReduce::error() const {
    if (static_cast<volatile int *>(host_flags_)[1] == 0) return "";
    return detail::concat("peer all_reduce: a rank did not arrive within ", kTimeoutNs / 1'000'000'000LL,
                          " s; the group's sums since are not valid");
}

} // namespace llaisys::runtime::cuda
