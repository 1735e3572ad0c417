// Streams and events. Every op enqueues on the current stream of its device and never synchronizes.
// On the CPU, work is synchronous and these are no-ops.
#pragma once
#include "llaisys/device.hpp"

#include <memory>

namespace llaisys {

class Stream {
public:
    Stream() = default;
    Stream(Device device, void *handle) : device_(device), handle_(handle) {}
    Device device() const { return device_; }
    void *handle() const { return handle_; } // cudaStream_t on CUDA; null on the CPU
    void synchronize() const;                // raises kernel errors as exceptions
    bool capturing() const;                  // being captured into a CUDA graph (Graph::capture)
    bool operator==(const Stream &o) const { return device_ == o.device_ && handle_ == o.handle_; }

private:
    Device device_;
    void *handle_ = nullptr;
};

// The stream ops on `device` enqueue on (per device, per process). The first one is created lazily
// as a non-blocking stream so that work is never serialized with the legacy default stream.
Stream current_stream(Device device);
void set_current_stream(const Stream &stream);
Stream new_stream(Device device);
// Waits for all work on the device; surfaces asynchronous kernel errors as exceptions. Both waits raise
// std::logic_error while the stream (here: the device's current stream) is being captured.
void synchronize(Device device);

class Event {
public:
    explicit Event(Device device, bool timing = false);
    ~Event();
    Event(const Event &) = delete;
    Event &operator=(const Event &) = delete;
    void record(const Stream &stream);
    void wait(const Stream &stream) const; // `stream` waits for this event, the host does not
    void synchronize() const;
    bool query() const;
    float elapsed_ms(const Event &end) const;

private:
    Device device_;
    void *handle_ = nullptr;
};

// Makes `device` current for the calling thread for the guard's lifetime (CUDA only).
class DeviceGuard {
public:
    explicit DeviceGuard(Device device);
    ~DeviceGuard();
    DeviceGuard(const DeviceGuard &) = delete;
    DeviceGuard &operator=(const DeviceGuard &) = delete;

private:
    int previous_ = -1;
};

} // namespace llaisys
