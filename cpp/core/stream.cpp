// Device-neutral front of streams and events; the CUDA side is in cuda/stream_cuda.cpp.
#include "llaisys/common.hpp"
#include "llaisys/stream.hpp"

namespace llaisys {

#ifndef LLAISYS_WITH_CUDA
// CPU-only build: the CPU has one synchronous "stream"; anything CUDA raises NotCompiledError.
Stream current_stream(Device device) {
    check_device_available(device);
    return Stream(device, nullptr);
}
void set_current_stream(const Stream &stream) { check_device_available(stream.device()); }
Stream new_stream(Device device) { return current_stream(device); }
void synchronize(Device device) { check_device_available(device); }
void Stream::synchronize() const {}
bool Stream::capturing() const { return false; }

Event::Event(Device device, bool) : device_(device) { check_device_available(device); }
Event::~Event() = default;
void Event::record(const Stream &) {}
void Event::wait(const Stream &) const {}
void Event::synchronize() const {}
bool Event::query() const { return true; }
float Event::elapsed_ms(const Event &) const {
    throw std::invalid_argument("Event.elapsed_ms: timing events exist only on CUDA devices");
}

DeviceGuard::DeviceGuard(Device) {}
DeviceGuard::~DeviceGuard() = default;
#endif

} // namespace llaisys
