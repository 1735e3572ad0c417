#include "core/runtime.hpp"
#include "llaisys/graph.hpp"
#include "llaisys/common.hpp"

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <mutex>

namespace llaisys {

namespace {
// CPU buffers are 64-byte aligned (one cache line, a full AVX-512 vector) and counted like device memory.
struct CpuCounters {
    std::mutex mu;
    MemoryStats stats;
};
CpuCounters &cpu_counters() {
    static CpuCounters *c = new CpuCounters(); // never destroyed: storages may outlive static teardown
    return *c;
}

std::shared_ptr<Storage> allocate_cpu(size_t nbytes) {
    const size_t rounded = (std::max<size_t>(nbytes, 1) + 63) / 64 * 64;
    void *p = std::aligned_alloc(64, rounded);
    if (!p)
        throw OutOfMemoryError(detail::concat("out of host memory: tried to allocate ", nbytes, " bytes"));
    {
        auto &c = cpu_counters();
        std::lock_guard<std::mutex> lock(c.mu);
        c.stats.allocated += int64_t(rounded);
        c.stats.reserved = c.stats.allocated;
        c.stats.peak_allocated = std::max(c.stats.peak_allocated, c.stats.allocated);
    }
    return std::make_shared<Storage>(p, nbytes, Device::cpu(), [rounded](void *q) {
        std::free(q);
        auto &c = cpu_counters();
        std::lock_guard<std::mutex> lock(c.mu);
        c.stats.allocated -= int64_t(rounded);
        c.stats.reserved = c.stats.allocated;
    });
}
} // namespace

namespace {
thread_local std::vector<std::shared_ptr<Storage>> *capture_pool = nullptr;
}

void detail::set_capture_pool(std::vector<std::shared_ptr<Storage>> *pool) { capture_pool = pool; }

std::shared_ptr<Storage> allocate(size_t nbytes, Device device, bool pinned) {
    check_device_available(device);
#ifdef LLAISYS_WITH_CUDA
    if (device.is_cuda()) {
        auto storage = runtime::cuda::allocate(nbytes, device);
        if (capture_pool) capture_pool->push_back(storage); // a graph replays into this memory
        return storage;
    }
    if (pinned && cuda_device_count() > 0) return runtime::cuda::allocate_pinned(nbytes);
#endif
    return allocate_cpu(nbytes);
}

void record_stream(const Storage &storage, const Stream &stream) {
#ifdef LLAISYS_WITH_CUDA
    if (storage.device().is_cuda()) runtime::cuda::record_stream(storage, stream);
#endif
}

MemoryStats memory_stats(Device device) {
    check_device_available(device);
#ifdef LLAISYS_WITH_CUDA
    if (device.is_cuda()) return runtime::cuda::stats(device);
#endif
    auto &c = cpu_counters();
    std::lock_guard<std::mutex> lock(c.mu);
    return c.stats;
}

void reset_peak_memory(Device device) {
    check_device_available(device);
#ifdef LLAISYS_WITH_CUDA
    if (device.is_cuda()) return runtime::cuda::reset_peak(device);
#endif
    auto &c = cpu_counters();
    std::lock_guard<std::mutex> lock(c.mu);
    c.stats.peak_allocated = c.stats.allocated;
}

void empty_cache(Device device) {
    check_device_available(device);
#ifdef LLAISYS_WITH_CUDA
    if (device.is_cuda()) runtime::cuda::empty_cache(device);
#endif
}

DeviceMemoryInfo device_memory_info(Device device) {
    check_device_available(device);
#ifdef LLAISYS_WITH_CUDA
    if (device.is_cuda()) return runtime::cuda::mem_info(device);
#endif
    DeviceMemoryInfo info;
    std::ifstream meminfo("/proc/meminfo");
    std::string key, unit;
    size_t kib = 0;
    while (meminfo >> key >> kib >> unit) {
        if (key == "MemTotal:") info.total = kib << 10;
        if (key == "MemAvailable:") info.free = kib << 10;
    }
    return info;
}

namespace runtime {
namespace {
// Host-to-host is a plain memcpy; anything touching a CUDA device goes on that device's current stream.
// `wait` makes the host wait for the copy (memcpy's contract when host memory is involved).
void copy_bytes(void *dst, Device dst_device, const void *src, Device src_device, size_t n, bool wait) {
    if (n == 0) return;
    if (dst_device.is_cpu() && src_device.is_cpu()) {
        std::memcpy(dst, src, n);
        return;
    }
#ifdef LLAISYS_WITH_CUDA
    cuda::memcpy(dst, src, n, current_stream(dst_device.is_cuda() ? dst_device : src_device), wait);
#else
    throw NotCompiledError("copy to or from a CUDA device: this build of llaisys has no CUDA backend");
#endif
}
} // namespace

void memcpy(void *dst, Device dst_device, const void *src, Device src_device, size_t n) {
    copy_bytes(dst, dst_device, src, src_device, n, dst_device.is_cpu() || src_device.is_cpu());
}

void memcpy_async(void *dst, Device dst_device, const void *src, Device src_device, size_t n) {
    copy_bytes(dst, dst_device, src, src_device, n, false);
}
} // namespace runtime

} // namespace llaisys
