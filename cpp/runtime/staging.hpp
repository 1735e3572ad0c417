// Host -> device uploads of a step's small inputs (token ids, positions, sampling parameters) without a
// host sync: each upload goes through its own pinned buffer from a ring, and a buffer is refilled only
// after the event recorded behind its previous copy has completed. On the CPU it is a plain copy.
#pragma once
#include "llaisys/stream.hpp"
#include "llaisys/tensor.hpp"

#include <memory>
#include <vector>

namespace llaisys::runtime {

class InputStaging {
public:
    explicit InputStaging(Device device, size_t ring = 16);
    template <typename T>
    Tensor upload(const std::vector<T> &values, DType dtype) {
        return upload_bytes(values.data(), values.size() * sizeof(T), {int64_t(values.size())}, dtype);
    }
    Tensor upload_bytes(const void *data, size_t nbytes, const Shape &shape, DType dtype);
    // Gives every pinned buffer of the ring at least nbytes now (tensor parallelism: pinned allocations,
    // which may wait for other devices' work, then never happen while a rank's collectives wait for another).
    void reserve(size_t nbytes);
    // Writes into an existing device tensor (the fixed input buffers a CUDA graph reads).
    void upload_into(const Tensor &dst, const void *data, size_t nbytes);

private:
    struct Slot {
        Tensor host;
        std::unique_ptr<Event> done;
    };
    Device device_;
    std::vector<Slot> slots_;
    size_t next_ = 0;
};

} // namespace llaisys::runtime
