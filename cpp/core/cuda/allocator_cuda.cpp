// Stream-ordered caching allocator, one pool set per CUDA device.
//
// A block belongs to the stream it was allocated on. Freeing it returns it to that stream's pool at
// once: work enqueued later on the same stream is ordered after every earlier use, so reuse there is
// safe without a sync. If the block was also used on other streams (record_stream), an event is
// recorded on each of them at free time and the block becomes reusable only when all have completed.
// cudaMalloc happens only when no cached block fits; repeating a sequence of ops therefore reaches a
// steady state with no new device mallocs (num_device_mallocs stops growing).
//
// LLAISYS_CUDA_ALLOC=exact (read once) turns the cache off for debugging: every tensor gets its own
// cudaMalloc of exactly its size, freed with cudaFree (which waits for the device) when released, so
// compute-sanitizer's memcheck sees an access past a tensor's end instead of landing in a cached
// block's slack. Slow; the steady-state guarantee above does not hold.
#include "core/cuda/check.hpp"
#include "core/runtime.hpp"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace llaisys::runtime::cuda {
namespace {

struct Block {
    void *ptr;
    size_t size;
    cudaStream_t stream;                    // allocation stream: the pool it returns to
    std::vector<cudaStream_t> other_streams; // recorded uses elsewhere
};

struct PendingFree {
    Block *block;
    std::vector<cudaEvent_t> events;
};

// One per device, with its own lock: ranks of a tensor-parallel group allocate from their own threads, and a
// driver call one makes (cudaMalloc, or cudaDeviceSynchronize on running out) must never keep another rank
// from enqueueing the collective that call may be waiting for.
struct DevicePool {
    std::mutex mu;
    std::map<cudaStream_t, std::multimap<size_t, Block *>> free_blocks;
    std::unordered_map<void *, Block *> live;
    std::vector<PendingFree> pending;
    MemoryStats stats;
};

constexpr size_t kSmall = 1 << 20;

bool exact_mode() {
    static const bool exact = [] {
        const char *v = std::getenv("LLAISYS_CUDA_ALLOC");
        return v && std::string(v) == "exact";
    }();
    return exact;
}

size_t round_size(size_t n) {
    n = std::max<size_t>(n, 1);
    if (exact_mode()) return n;
    return n < kSmall ? (n + 511) / 512 * 512 : (n + (1 << 16) - 1) / (1 << 16) * (1 << 16);
}

// A cached block serves a request when it is not much larger than asked (caps the waste).
bool fits(size_t block, size_t want) { return block >= want && block <= (want < kSmall ? 2 * want : want + want / 8); }

class Allocator {
public:
    std::shared_ptr<Storage> allocate(size_t nbytes, Device device) {
        DeviceGuard guard(device);
        const cudaStream_t stream = static_cast<cudaStream_t>(current_stream(device).handle());
        const size_t size = round_size(nbytes);
        DevicePool &pool = pool_for(device);
        std::lock_guard<std::mutex> lock(pool.mu);
        collect_pending(pool);
        Block *block = take_cached(pool, stream, size);
        if (!block) block = device_malloc(pool, device, stream, size);
        pool.live[block->ptr] = block;
        pool.stats.allocated += int64_t(block->size);
        pool.stats.peak_allocated = std::max(pool.stats.peak_allocated, pool.stats.allocated);
        return std::make_shared<Storage>(block->ptr, nbytes, device, [this, device](void *p) { release(device, p); });
    }

    void record_stream(const Storage &storage, const Stream &stream) {
        DevicePool &pool = pool_for(storage.device());
        std::lock_guard<std::mutex> lock(pool.mu);
        auto it = pool.live.find(storage.data());
        if (it == pool.live.end()) return; // not ours (imported through DLPack)
        auto s = static_cast<cudaStream_t>(stream.handle());
        Block *b = it->second;
        if (s != b->stream && std::find(b->other_streams.begin(), b->other_streams.end(), s) == b->other_streams.end())
            b->other_streams.push_back(s);
    }

    MemoryStats stats(Device device) {
        DevicePool &pool = pool_for(device);
        std::lock_guard<std::mutex> lock(pool.mu);
        return pool.stats;
    }

    void reset_peak(Device device) {
        DevicePool &pool = pool_for(device);
        std::lock_guard<std::mutex> lock(pool.mu);
        auto &s = pool.stats;
        s.peak_allocated = s.allocated;
    }

    void empty_cache(Device device) {
        DeviceGuard guard(device);
        LLAISYS_CUDA_CHECK(cudaDeviceSynchronize());
        DevicePool &pool = pool_for(device);
        std::lock_guard<std::mutex> lock(pool.mu);
        collect_pending(pool);
        free_cached(pool);
    }

private:
    DevicePool &pool_for(Device device) {
        std::lock_guard<std::mutex> lock(mu_); // only the table; each pool has its own lock
        while (pools_.size() <= size_t(device.index)) pools_.push_back(std::make_unique<DevicePool>());
        return *pools_[device.index];
    }

    Block *take_cached(DevicePool &pool, cudaStream_t stream, size_t size) {
        auto &blocks = pool.free_blocks[stream];
        auto it = blocks.lower_bound(size);
        if (it == blocks.end() || !fits(it->first, size)) return nullptr;
        Block *b = it->second;
        blocks.erase(it);
        return b;
    }

    Block *device_malloc(DevicePool &pool, Device device, cudaStream_t stream, size_t size) {
        void *ptr = nullptr;
        cudaError_t err = cudaMalloc(&ptr, size);
        if (err == cudaErrorMemoryAllocation) { // give the cache back to the driver and try once more
            cudaGetLastError();
            cudaDeviceSynchronize();
            collect_pending(pool);
            free_cached(pool);
            err = cudaMalloc(&ptr, size);
        }
        if (err != cudaSuccess) {
            cudaGetLastError();
            size_t free_b = 0, total_b = 0;
            cudaMemGetInfo(&free_b, &total_b);
            throw OutOfMemoryError(detail::concat(
                "CUDA out of memory on ", device.str(), ": tried to allocate ", size >> 20, " MiB (",
                cudaGetErrorString(err), "); llaisys holds ", pool.stats.allocated >> 20, " MiB in tensors, ",
                pool.stats.reserved >> 20, " MiB reserved; the device has ", free_b >> 20, " MiB free of ",
                total_b >> 20, " MiB"));
        }
        pool.stats.reserved += int64_t(size);
        pool.stats.num_device_mallocs += 1;
        return new Block{ptr, size, stream, {}};
    }

    void release(Device device, void *ptr) {
        DevicePool &pool = pool_for(device);
        std::lock_guard<std::mutex> lock(pool.mu);
        auto it = pool.live.find(ptr);
        if (it == pool.live.end()) return;
        Block *b = it->second;
        pool.live.erase(it);
        pool.stats.allocated -= int64_t(b->size);
        if (exact_mode()) { // cudaFree waits for every stream's work, other_streams' included
            DeviceGuard guard(device);
            device_free(pool, b);
            return;
        }
        if (b->other_streams.empty()) {
            pool.free_blocks[b->stream].emplace(b->size, b);
            return;
        }
        PendingFree pf{b, {}};
        DeviceGuard guard(device);
        for (cudaStream_t s : b->other_streams) {
            cudaEvent_t e;
            if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) continue;
            cudaEventRecord(e, s);
            pf.events.push_back(e);
        }
        b->other_streams.clear();
        pool.pending.push_back(std::move(pf));
    }

    // Moves blocks whose cross-stream uses have finished back into their pool.
    void collect_pending(DevicePool &pool) {
        auto done = [&](PendingFree &pf) {
            for (cudaEvent_t e : pf.events)
                if (cudaEventQuery(e) == cudaErrorNotReady) return false;
            for (cudaEvent_t e : pf.events) cudaEventDestroy(e);
            cudaGetLastError();
            pool.free_blocks[pf.block->stream].emplace(pf.block->size, pf.block);
            return true;
        };
        pool.pending.erase(std::remove_if(pool.pending.begin(), pool.pending.end(), done), pool.pending.end());
    }

    // Gives a block's memory back to the driver (current device: the block's).
    void device_free(DevicePool &pool, Block *b) {
        cudaFree(b->ptr);
        pool.stats.reserved -= int64_t(b->size);
        pool.stats.num_device_frees += 1;
        delete b;
    }

    void free_cached(DevicePool &pool) {
        for (auto &[stream, blocks] : pool.free_blocks) {
            for (auto &[size, b] : blocks) device_free(pool, b);
            blocks.clear();
        }
    }

    std::mutex mu_; // pools_ (grown, never shrunk: a pool's address stays)
    std::vector<std::unique_ptr<DevicePool>> pools_;
};

Allocator &allocator() {
    static Allocator *a = new Allocator(); // never destroyed: Python may free tensors after static teardown
    return *a;
}

} // namespace

std::shared_ptr<Storage> allocate(size_t nbytes, Device device) { return allocator().allocate(nbytes, device); }

std::shared_ptr<Storage> allocate_pinned(size_t nbytes) {
    void *p = nullptr;
    const cudaError_t err = cudaHostAlloc(&p, std::max<size_t>(nbytes, 1), cudaHostAllocDefault);
    if (err != cudaSuccess) {
        cudaGetLastError();
        throw OutOfMemoryError(detail::concat("could not allocate ", nbytes, " bytes of pinned host memory: ",
                                              cudaGetErrorString(err)));
    }
    return std::make_shared<Storage>(p, nbytes, Device::cpu(), [](void *q) { cudaFreeHost(q); }, true);
}

void record_stream(const Storage &storage, const Stream &stream) { allocator().record_stream(storage, stream); }
MemoryStats stats(Device device) { return allocator().stats(device); }
void reset_peak(Device device) { allocator().reset_peak(device); }
void empty_cache(Device device) { allocator().empty_cache(device); }

DeviceMemoryInfo mem_info(Device device) {
    DeviceGuard guard(device);
    size_t free_b = 0, total_b = 0;
    LLAISYS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return {free_b, total_b};
}

void memcpy(void *dst, const void *src, size_t n, const Stream &stream, bool wait) {
    DeviceGuard guard(stream.device());
    auto s = static_cast<cudaStream_t>(stream.handle());
    LLAISYS_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s));
    if (wait) LLAISYS_CUDA_CHECK(cudaStreamSynchronize(s));
}

} // namespace llaisys::runtime::cuda
