#include "runtime/staging.hpp"

#include "core/runtime.hpp"

#include <cstring>

namespace llaisys::runtime {

InputStaging::InputStaging(Device device, size_t ring) : device_(device), slots_(ring) {}

Tensor InputStaging::upload_bytes(const void *data, size_t nbytes, const Shape &shape, DType dtype) {
    Tensor out = Tensor::empty(shape, dtype, device_);
    upload_into(out, data, nbytes);
    return out;
}

void InputStaging::reserve(size_t nbytes) {
    if (device_.is_cpu()) return;
    for (Slot &slot : slots_)
        if (!slot.host.defined() || slot.host.numel() < int64_t(nbytes))
            slot.host = Tensor::empty({int64_t(nbytes)}, DType::U8, Device::cpu(), true);
}

void InputStaging::upload_into(const Tensor &dst, const void *data, size_t nbytes) {
    LLAISYS_CHECK(dst.is_contiguous() && size_t(dst.numel()) * dst.element_size() == nbytes, std::invalid_argument,
                  "InputStaging: destination does not match the ", nbytes, " bytes to upload");
    if (device_.is_cpu()) {
        std::memcpy(dst.data(), data, nbytes);
        return;
    }
    Slot &slot = slots_[next_];
    next_ = (next_ + 1) % slots_.size();
    if (slot.done) slot.done->synchronize(); // the previous copy out of this buffer has run
    if (!slot.host.defined() || slot.host.numel() < int64_t(nbytes))
        slot.host = Tensor::empty({int64_t(std::max<size_t>(nbytes, 256))}, DType::U8, Device::cpu(), true);
    std::memcpy(slot.host.data(), data, nbytes);
    runtime::memcpy_async(dst.data(), device_, slot.host.data(), Device::cpu(), nbytes);
    if (!slot.done) slot.done = std::make_unique<Event>(device_);
    slot.done->record(current_stream(device_));
}

} // namespace llaisys::runtime
