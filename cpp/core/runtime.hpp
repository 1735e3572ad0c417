// Internal seam between the device-neutral core and the CUDA runtime (cpp/core/cuda/, CUDA builds only).
#pragma once
#include "llaisys/memory.hpp"
#include "llaisys/stream.hpp"

#include <cstddef>
#include <memory>

namespace llaisys::runtime {

// Copies n bytes between any two devices. Copies that touch host memory are finished when this
// returns (the host may reuse the buffer); device-to-device copies are ordered on the current stream.
void memcpy(void *dst, Device dst_device, const void *src, Device src_device, size_t n);
// Like memcpy but never waits: host memory must be pinned and stay untouched until the copy has run
// (order it with an Event). Used by the model's input staging so a decode step has no extra host sync.
void memcpy_async(void *dst, Device dst_device, const void *src, Device src_device, size_t n);

#ifdef LLAISYS_WITH_CUDA
namespace cuda {
std::shared_ptr<Storage> allocate(size_t nbytes, Device device);
std::shared_ptr<Storage> allocate_pinned(size_t nbytes);
void record_stream(const Storage &storage, const Stream &stream);
MemoryStats stats(Device device);
void reset_peak(Device device);
void empty_cache(Device device);
DeviceMemoryInfo mem_info(Device device);
void memcpy(void *dst, const void *src, size_t n, const Stream &stream, bool wait);
// A per-device int in device memory that kernels set to report bad input without a host sync; checked
// and cleared by synchronize(). Codes: 1 embedding id out of range, 2 index_copy index out of range,
// 3 self_attention_cached length out of range, 4 rope_qkv_cache position out of range, 5 paged_attention
// metadata out of range.
int *error_flag(Device device);
} // namespace cuda
#endif

} // namespace llaisys::runtime
