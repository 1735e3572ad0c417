// Tensor: a strided view (shape, strides in elements, byte offset) of shared, reference-counted
// storage. Copying a Tensor copies the handle, not the data (like torch.Tensor).
#pragma once
#include "llaisys/common.hpp"
#include "llaisys/device.hpp"
#include "llaisys/dtype.hpp"
#include "llaisys/memory.hpp"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace llaisys {

using Shape = std::vector<int64_t>;
using Strides = std::vector<int64_t>;

Strides contiguous_strides(const Shape &shape);
int64_t shape_numel(const Shape &shape);
std::string shape_str(const std::vector<int64_t> &shape);

class Tensor {
public:
    Tensor() = default; // undefined tensor: defined() is false

    static Tensor empty(const Shape &shape, DType dtype, Device device = Device::cpu(), bool pinned = false);
    static Tensor zeros(const Shape &shape, DType dtype, Device device = Device::cpu());
    // Wraps memory owned elsewhere; `on_free` runs when the last view is gone (zero-copy imports).
    static Tensor from_blob(void *data, const Shape &shape, const Strides &strides, DType dtype, Device device,
                            std::function<void()> on_free);

    bool defined() const { return storage_ != nullptr; }
    const Shape &shape() const { return shape_; }
    const Strides &strides() const { return strides_; }
    int64_t size(int dim) const;
    int64_t stride(int dim) const;
    int ndim() const { return int(shape_.size()); }
    int64_t numel() const { return shape_numel(shape_); }
    DType dtype() const { return dtype_; }
    size_t element_size() const { return dtype_size(dtype_); }
    Device device() const { return device_; }
    size_t offset_bytes() const { return offset_; }
    const std::shared_ptr<Storage> &storage() const { return storage_; }
    void *data() const { return static_cast<char *>(storage_->data()) + offset_; }
    template <typename T>
    T *data_as() const { return static_cast<T *>(data()); }
    bool is_contiguous() const;
    bool is_pinned() const { return storage_ && storage_->pinned(); }

    // Views share storage. view() raises if the strides cannot express `shape`; reshape() copies then.
    Tensor view(Shape shape) const;
    Tensor reshape(Shape shape) const;
    Tensor permute(const std::vector<int> &order) const;
    Tensor transpose(int dim0, int dim1) const;
    Tensor slice(int dim, int64_t start, int64_t end) const; // [start, end), negative indices allowed
    Tensor select(int dim, int64_t index) const;             // removes `dim`
    Tensor contiguous() const;
    Tensor clone() const;
    Tensor to(Device device) const;
    // Reinterprets the bytes as another dtype of the same element size (e.g. u16 storage as bf16).
    Tensor view_dtype(DType dtype) const;

    Tensor &copy_(const Tensor &src); // any strides, any devices; same shape and dtype
    Tensor &fill_(double value);

    std::string repr(int64_t max_elements = 16) const;

private:
    Tensor(std::shared_ptr<Storage> storage, Shape shape, Strides strides, size_t offset, DType dtype);
    int wrap_dim(int dim) const;
    Shape infer_shape(Shape shape) const; // resolves one -1

    std::shared_ptr<Storage> storage_;
    Shape shape_;
    Strides strides_;
    size_t offset_ = 0;
    DType dtype_ = DType::F32;
    Device device_;
};

} // namespace llaisys
