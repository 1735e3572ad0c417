// Device memory: 64-byte aligned CPU buffers, pinned host buffers and a stream-ordered caching
// allocator per CUDA device. A freed block returns to the pool of the stream it was allocated on, so
// reusing it there is ordered after every earlier use; blocks used on other streams
// (`record_stream`) wait for an event on each such stream before they become reusable.
#pragma once
#include "llaisys/device.hpp"
#include "llaisys/stream.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

namespace llaisys {

class Storage {
public:
    using Deleter = std::function<void(void *)>;
    Storage(void *data, size_t nbytes, Device device, Deleter deleter, bool pinned = false)
        : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)), pinned_(pinned) {}
    ~Storage() {
        if (deleter_) deleter_(data_);
    }
    Storage(const Storage &) = delete;
    Storage &operator=(const Storage &) = delete;

    void *data() const { return data_; }
    size_t nbytes() const { return nbytes_; }
    Device device() const { return device_; }
    bool pinned() const { return pinned_; }

private:
    void *data_;
    size_t nbytes_;
    Device device_;
    Deleter deleter_;
    bool pinned_;
};

struct MemoryStats {
    int64_t allocated = 0;       // bytes in live blocks
    int64_t reserved = 0;        // bytes held from the driver (live + cached)
    int64_t peak_allocated = 0;  // high-water mark of `allocated`
    int64_t num_device_mallocs = 0;
    int64_t num_device_frees = 0;
};

// Allocates `nbytes` on `device` (on the current stream for CUDA). `pinned` asks for page-locked
// host memory (only meaningful for CPU storage in a CUDA build; plain memory otherwise).
std::shared_ptr<Storage> allocate(size_t nbytes, Device device, bool pinned = false);
// Marks a CUDA storage as used on `stream` too, so its memory is not reused before that work ends.
void record_stream(const Storage &storage, const Stream &stream);
MemoryStats memory_stats(Device device);
void reset_peak_memory(Device device);
// Returns cached, unused device blocks to the driver.
void empty_cache(Device device);

// What the driver reports for a CUDA device (cudaMemGetInfo); for the CPU, the system's available and
// total memory (MemAvailable / MemTotal). Blocks cached by llaisys' allocator count as used.
struct DeviceMemoryInfo {
    size_t free = 0, total = 0;
};
DeviceMemoryInfo device_memory_info(Device device);

} // namespace llaisys
