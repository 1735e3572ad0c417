// Streams, events, device guards and the device-side error flag for CUDA builds.
#include "core/cuda/check.hpp"
#include "core/runtime.hpp"
#include "llaisys/stream.hpp"

#include <mutex>
#include <string>
#include <vector>

namespace llaisys {

int cuda_runtime_device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); // no driver / no device: clear the error and report none
        return 0;
    }
    return n;
}

std::string cuda_runtime_device_name(int index) {
    cudaDeviceProp prop{};
    LLAISYS_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
    return prop.name;
}

namespace {
struct StreamTable {
    std::mutex mu;
    std::vector<cudaStream_t> current; // per device; null until first use
    std::vector<int *> error_flags;
};
StreamTable &table() {
    static StreamTable *t = new StreamTable(); // leaked on purpose: used during interpreter teardown
    return *t;
}

// Reads and clears the device error flag after a sync; raises if a kernel reported bad input.
void check_error_flag(Device device) {
    auto &t = table();
    int *flag = nullptr;
    {
        std::lock_guard<std::mutex> lock(t.mu);
        if (size_t(device.index) < t.error_flags.size()) flag = t.error_flags[device.index];
    }
    if (!flag) return;
    int code = 0;
    LLAISYS_CUDA_CHECK(cudaMemcpy(&code, flag, sizeof(int), cudaMemcpyDeviceToHost));
    if (code == 0) return;
    LLAISYS_CUDA_CHECK(cudaMemset(flag, 0, sizeof(int)));
    if (code == 1) throw std::out_of_range("embedding: an id is out of range of the embedding table (found on " +
                                           device.str() + " at synchronize)");
    if (code == 2) throw std::out_of_range("index_copy: an index is out of range of the destination (found on " +
                                           device.str() + " at synchronize)");
    if (code == 3) throw std::out_of_range("self_attention_cached: kv_len out of range [qlen, capacity] (found on " +
                                           device.str() + " at synchronize)");
    if (code == 4) throw std::out_of_range("rope_qkv_cache: a position is out of range of the KV cache (found on " +
                                           device.str() + " at synchronize)");
    if (code == 5) throw std::out_of_range("paged_attention: q_start, kv_len or a block id out of range (found on " +
                                           device.str() + " at synchronize)");
    if (code == 6) throw std::out_of_range("kv_shift: a row is out of range of the KV cache (found on " +
                                           device.str() + " at synchronize)");
    throw std::runtime_error("a CUDA kernel reported error code " + std::to_string(code));
}
} // namespace

namespace runtime::cuda {
int *error_flag(Device device) {
    auto &t = table();
    std::lock_guard<std::mutex> lock(t.mu);
    if (t.error_flags.size() <= size_t(device.index)) t.error_flags.resize(device.index + 1, nullptr);
    int *&flag = t.error_flags[device.index];
    if (!flag) {
        DeviceGuard g(device);
        LLAISYS_CUDA_CHECK(cudaMalloc(&flag, sizeof(int)));
        LLAISYS_CUDA_CHECK(cudaMemset(flag, 0, sizeof(int)));
    }
    return flag;
}
} // namespace runtime::cuda

Stream current_stream(Device device) {
    check_device_available(device);
    if (device.is_cpu()) return Stream(device, nullptr);
    auto &t = table();
    std::lock_guard<std::mutex> lock(t.mu);
    if (t.current.size() <= size_t(device.index)) t.current.resize(device.index + 1, nullptr);
    cudaStream_t &s = t.current[device.index];
    if (!s) {
        DeviceGuard g(device);
        LLAISYS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    }
    return Stream(device, s);
}

void set_current_stream(const Stream &stream) {
    check_device_available(stream.device());
    if (stream.device().is_cpu()) return;
    current_stream(stream.device()); // sizes the table
    auto &t = table();
    std::lock_guard<std::mutex> lock(t.mu);
    t.current[stream.device().index] = static_cast<cudaStream_t>(stream.handle());
}

Stream new_stream(Device device) {
    check_device_available(device);
    if (device.is_cpu()) return Stream(device, nullptr);
    DeviceGuard g(device);
    cudaStream_t s;
    LLAISYS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return Stream(device, s); // lives for the process, like torch's stream pool
}

bool Stream::capturing() const {
    if (device_.is_cpu()) return false;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    LLAISYS_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(handle_), &status));
    return status != cudaStreamCaptureStatusNone;
}

namespace {
// A host wait inside a capture would fail in the driver and invalidate the capture; say why instead.
void check_not_capturing(const Stream &stream, const char *what) {
    LLAISYS_CHECK(!stream.capturing(), std::logic_error, what, ": cannot wait for ", stream.device().str(),
                  " while its current stream is being captured into a CUDA graph (a host wait cannot be captured)");
}
} // namespace

void Stream::synchronize() const {
    if (device_.is_cpu()) return;
    check_not_capturing(*this, "Stream.synchronize");
    DeviceGuard g(device_);
    LLAISYS_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(handle_)));
    check_error_flag(device_);
}

void synchronize(Device device) {
    check_device_available(device);
    if (device.is_cpu()) return;
    check_not_capturing(current_stream(device), "synchronize");
    DeviceGuard g(device);
    LLAISYS_CUDA_CHECK(cudaDeviceSynchronize());
    check_error_flag(device);
}

Event::Event(Device device, bool timing) : device_(device) {
    check_device_available(device);
    if (device.is_cpu()) return;
    DeviceGuard g(device);
    cudaEvent_t e;
    LLAISYS_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
    handle_ = e;
}
Event::~Event() {
    if (handle_) cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
}
void Event::record(const Stream &stream) {
    if (!handle_) return;
    LLAISYS_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(handle_), static_cast<cudaStream_t>(stream.handle())));
}
void Event::wait(const Stream &stream) const {
    if (!handle_ || stream.device().is_cpu()) return;
    LLAISYS_CUDA_CHECK(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream.handle()), static_cast<cudaEvent_t>(handle_), 0));
}
void Event::synchronize() const {
    if (!handle_) return;
    LLAISYS_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_)));
    check_error_flag(device_);
}
bool Event::query() const {
    if (!handle_) return true;
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(handle_));
    if (e == cudaErrorNotReady) return false;
    LLAISYS_CUDA_CHECK(e);
    return true;
}
float Event::elapsed_ms(const Event &end) const {
    LLAISYS_CHECK(handle_ && end.handle_, std::invalid_argument, "Event.elapsed_ms: needs two CUDA events");
    float ms = 0;
    LLAISYS_CUDA_CHECK(
        cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(handle_), static_cast<cudaEvent_t>(end.handle_)));
    return ms;
}

DeviceGuard::DeviceGuard(Device device) {
    if (!device.is_cuda()) return;
    LLAISYS_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device.index) LLAISYS_CUDA_CHECK(cudaSetDevice(device.index));
    else previous_ = -1;
}
DeviceGuard::~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
}

} // namespace llaisys
