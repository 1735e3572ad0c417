#include "llaisys/tensor.hpp"

#include "core/copy.hpp"
#include "core/runtime.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

namespace llaisys {

Strides contiguous_strides(const Shape &shape) {
    Strides s(shape.size());
    int64_t acc = 1;
    for (size_t i = shape.size(); i-- > 0;) {
        s[i] = acc;
        acc *= std::max<int64_t>(shape[i], 1);
    }
    return s;
}

int64_t shape_numel(const Shape &shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
}

std::string shape_str(const std::vector<int64_t> &shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

static void check_shape_valid(const Shape &shape) {
    for (int64_t d : shape)
        LLAISYS_CHECK(d >= 0, std::invalid_argument, "invalid shape ", shape_str(shape), ": negative dimension");
}

Tensor::Tensor(std::shared_ptr<Storage> storage, Shape shape, Strides strides, size_t offset, DType dtype)
    : storage_(std::move(storage)), shape_(std::move(shape)), strides_(std::move(strides)), offset_(offset),
      dtype_(dtype), device_(storage_->device()) {}

Tensor Tensor::empty(const Shape &shape, DType dtype, Device device, bool pinned) {
    check_shape_valid(shape);
    check_device_available(device);
    auto storage = allocate(size_t(shape_numel(shape)) * dtype_size(dtype), device, pinned);
    return Tensor(std::move(storage), shape, contiguous_strides(shape), 0, dtype);
}

Tensor Tensor::zeros(const Shape &shape, DType dtype, Device device) {
    Tensor t = empty(shape, dtype, device);
    t.fill_(0.0);
    return t;
}

Tensor Tensor::from_blob(void *data, const Shape &shape, const Strides &strides, DType dtype, Device device,
                         std::function<void()> on_free) {
    check_shape_valid(shape);
    LLAISYS_CHECK(strides.size() == shape.size(), std::invalid_argument, "from_blob: ", strides.size(),
                  " strides for a ", shape.size(), "-D shape");
    // Storage extent: the furthest element reachable through the strides (negative strides unsupported).
    int64_t extent = shape_numel(shape) ? 1 : 0;
    for (size_t i = 0; i < shape.size(); ++i) {
        LLAISYS_CHECK(strides[i] >= 0, std::invalid_argument, "from_blob: negative strides are not supported");
        if (shape[i] > 0) extent += (shape[i] - 1) * strides[i];
    }
    auto storage = std::make_shared<Storage>(data, size_t(extent) * dtype_size(dtype), device,
                                             [f = std::move(on_free)](void *) {
                                                 if (f) f();
                                             });
    return Tensor(std::move(storage), shape, strides, 0, dtype);
}

int Tensor::wrap_dim(int dim) const {
    const int n = ndim();
    LLAISYS_CHECK(dim >= -n && dim < n, std::out_of_range, "dimension ", dim, " out of range for a ", n,
                  "-D tensor");
    return dim < 0 ? dim + n : dim;
}

int64_t Tensor::size(int dim) const { return shape_[wrap_dim(dim)]; }
int64_t Tensor::stride(int dim) const { return strides_[wrap_dim(dim)]; }

bool Tensor::is_contiguous() const {
    int64_t expected = 1;
    for (size_t i = shape_.size(); i-- > 0;) {
        if (shape_[i] == 1) continue;
        if (strides_[i] != expected) return false;
        expected *= shape_[i];
    }
    return true;
}

Shape Tensor::infer_shape(Shape shape) const {
    int infer = -1;
    int64_t known = 1;
    for (size_t i = 0; i < shape.size(); ++i) {
        if (shape[i] == -1) {
            LLAISYS_CHECK(infer < 0, std::invalid_argument, "only one dimension can be -1 in ", shape_str(shape));
            infer = int(i);
        } else {
            LLAISYS_CHECK(shape[i] >= 0, std::invalid_argument, "invalid shape ", shape_str(shape));
            known *= shape[i];
        }
    }
    if (infer >= 0) {
        LLAISYS_CHECK(known != 0 && numel() % known == 0, std::invalid_argument, "cannot reshape a tensor of ",
                      numel(), " elements into ", shape_str(shape));
        shape[infer] = numel() / known;
    }
    LLAISYS_CHECK(shape_numel(shape) == numel(), std::invalid_argument, "cannot reshape a tensor of shape ",
                  shape_str(shape_), " (", numel(), " elements) into ", shape_str(shape));
    return shape;
}

// Strides for `shape` over the same memory, or empty if the current strides cannot express it.
// Walks both shapes from the innermost dim, matching runs of dims that are contiguous with each other.
static bool view_strides(const Shape &old_shape, const Strides &old_strides, const Shape &shape, Strides &out) {
    out.assign(shape.size(), 0);
    if (shape_numel(old_shape) == 0 || old_shape.empty()) {
        out = contiguous_strides(shape);
        return true;
    }
    int view_d = int(shape.size()) - 1;
    int64_t chunk_stride = old_strides.back(), tensor_numel = 1, view_numel = 1;
    for (int d = int(old_shape.size()) - 1; d >= 0; --d) {
        tensor_numel *= old_shape[d];
        const bool chunk_ends = d == 0 || (old_shape[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_stride);
        if (!chunk_ends) continue;
        while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
            out[view_d] = view_numel * chunk_stride;
            view_numel *= shape[view_d];
            --view_d;
        }
        if (view_numel != tensor_numel) return false;
        if (d > 0) {
            chunk_stride = old_strides[d - 1];
            tensor_numel = view_numel = 1;
        }
    }
    return view_d == -1;
}

Tensor Tensor::view(Shape shape) const {
    shape = infer_shape(std::move(shape));
    Strides strides;
    LLAISYS_CHECK(view_strides(shape_, strides_, shape, strides), std::invalid_argument, "view: shape ",
                  shape_str(shape), " is incompatible with the strides ", shape_str(strides_), " of a tensor of shape ",
                  shape_str(shape_), "; use reshape() (which copies) or contiguous() first");
    return Tensor(storage_, shape, strides, offset_, dtype_);
}

Tensor Tensor::reshape(Shape shape) const {
    shape = infer_shape(std::move(shape));
    Strides strides;
    if (view_strides(shape_, strides_, shape, strides)) return Tensor(storage_, shape, strides, offset_, dtype_);
    return contiguous().view(shape);
}

Tensor Tensor::permute(const std::vector<int> &order) const {
    LLAISYS_CHECK(int(order.size()) == ndim(), std::invalid_argument, "permute: got ", order.size(),
                  " dims for a ", ndim(), "-D tensor");
    Shape shape(order.size());
    Strides strides(order.size());
    std::vector<bool> seen(order.size(), false);
    for (size_t i = 0; i < order.size(); ++i) {
        const int d = wrap_dim(order[i]);
        LLAISYS_CHECK(!seen[d], std::invalid_argument, "permute: dimension ", d, " repeated");
        seen[d] = true;
        shape[i] = shape_[d];
        strides[i] = strides_[d];
    }
    return Tensor(storage_, shape, strides, offset_, dtype_);
}

Tensor Tensor::transpose(int dim0, int dim1) const {
    std::vector<int> order(ndim());
    std::iota(order.begin(), order.end(), 0);
    std::swap(order[wrap_dim(dim0)], order[wrap_dim(dim1)]);
    return permute(order);
}

Tensor Tensor::slice(int dim, int64_t start, int64_t end) const {
    dim = wrap_dim(dim);
    const int64_t n = shape_[dim];
    if (start < 0) start += n;
    if (end < 0) end += n;
    LLAISYS_CHECK(start >= 0 && start <= end && end <= n, std::out_of_range, "slice [", start, ", ", end,
                  ") out of range for dimension ", dim, " of size ", n);
    Shape shape = shape_;
    shape[dim] = end - start;
    return Tensor(storage_, shape, strides_, offset_ + size_t(start * strides_[dim]) * element_size(), dtype_);
}

Tensor Tensor::select(int dim, int64_t index) const {
    dim = wrap_dim(dim);
    const int64_t n = shape_[dim];
    LLAISYS_CHECK(index >= -n && index < n, std::out_of_range, "index ", index, " out of range for dimension ", dim,
                  " of size ", n);
    if (index < 0) index += n;
    Tensor t = slice(dim, index, index + 1);
    t.shape_.erase(t.shape_.begin() + dim);
    t.strides_.erase(t.strides_.begin() + dim);
    return t;
}

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor Tensor::clone() const {
    Tensor out = empty(shape_, dtype_, device_);
    out.copy_(*this);
    return out;
}

Tensor Tensor::to(Device device) const {
    if (device == device_) return *this;
    Tensor out = empty(shape_, dtype_, device);
    out.copy_(*this);
    return out;
}

Tensor Tensor::view_dtype(DType dtype) const {
    LLAISYS_CHECK(dtype_size(dtype) == element_size(), TypeError, "view_dtype: cannot view ", dtype_name(dtype_),
                  " as ", dtype_name(dtype), " (element sizes differ)");
    return Tensor(storage_, shape_, strides_, offset_, dtype);
}

Tensor &Tensor::copy_(const Tensor &src) {
    LLAISYS_CHECK(defined() && src.defined(), std::invalid_argument, "copy_: undefined tensor");
    LLAISYS_CHECK(src.shape_ == shape_, std::invalid_argument, "copy_: shape ", shape_str(src.shape_),
                  " does not match destination shape ", shape_str(shape_));
    LLAISYS_CHECK(src.dtype_ == dtype_, TypeError, "copy_: dtype ", dtype_name(src.dtype_),
                  " does not match destination dtype ", dtype_name(dtype_), " (use ops::to_dtype to convert)");
    if (numel() == 0) return *this;
    if (src.device_ == device_) {
        runtime::copy_strided(*this, src);
        return *this;
    }
    // Across devices: bytes move densely, strides are fixed on the side that owns them.
    const Tensor dense_src = src.contiguous();
    Tensor dense_dst = is_contiguous() ? *this : empty(shape_, dtype_, device_);
    runtime::memcpy(dense_dst.data(), dense_dst.device_, dense_src.data(), dense_src.device_,
                    size_t(numel()) * element_size());
    if (!is_contiguous()) runtime::copy_strided(*this, dense_dst);
    return *this;
}

Tensor &Tensor::fill_(double value) {
    LLAISYS_CHECK(defined(), std::invalid_argument, "fill_: undefined tensor");
    if (device_.is_cuda()) { // fill on the host once, then one upload; fill_ is not on hot paths
        copy_(Tensor::empty(shape_, dtype_).fill_(value));
        return *this;
    }
    Tensor one = empty({1}, dtype_);
    switch (dtype_) {
    case DType::F32: *one.data_as<float>() = float(value); break;
    case DType::F16: *one.data_as<f16_t>() = from_float<f16_t>(float(value)); break;
    case DType::BF16: *one.data_as<bf16_t>() = from_float<bf16_t>(float(value)); break;
    case DType::I32: *one.data_as<int32_t>() = int32_t(value); break;
    case DType::I64: *one.data_as<int64_t>() = int64_t(value); break;
    case DType::U8: *one.data_as<uint8_t>() = uint8_t(value); break;
    case DType::Bool: *one.data_as<uint8_t>() = value != 0; break;
    }
    // A broadcast view (all strides 0) of the single value, copied with the strided copy.
    Tensor src(one.storage_, shape_, Strides(shape_.size(), 0), 0, dtype_);
    runtime::copy_strided(*this, src);
    return *this;
}

static std::string format_element(const Tensor &t, int64_t i) {
    char buf[48];
    switch (t.dtype()) {
    case DType::F32: std::snprintf(buf, sizeof buf, "%.6g", double(t.data_as<float>()[i])); break;
    case DType::F16: std::snprintf(buf, sizeof buf, "%.4g", double(to_float(t.data_as<f16_t>()[i]))); break;
    case DType::BF16: std::snprintf(buf, sizeof buf, "%.4g", double(to_float(t.data_as<bf16_t>()[i]))); break;
    case DType::I32: std::snprintf(buf, sizeof buf, "%d", t.data_as<int32_t>()[i]); break;
    case DType::I64: std::snprintf(buf, sizeof buf, "%lld", (long long)t.data_as<int64_t>()[i]); break;
    case DType::U8: std::snprintf(buf, sizeof buf, "%u", unsigned(t.data_as<uint8_t>()[i])); break;
    case DType::Bool: return t.data_as<uint8_t>()[i] ? "True" : "False";
    }
    return buf;
}

std::string Tensor::repr(int64_t max_elements) const {
    if (!defined()) return "Tensor(undefined)";
    std::string s = "Tensor(shape=" + shape_str(shape_) + ", dtype=" + dtype_name(dtype_) + ", device=" +
                    device_.str();
    if (!is_contiguous()) s += ", strides=" + shape_str(strides_);
    s += ", data=[";
    const Tensor host = to(Device::cpu()).contiguous();
    const int64_t n = std::min(numel(), max_elements);
    for (int64_t i = 0; i < n; ++i) s += (i ? ", " : "") + format_element(host, i);
    if (numel() > n) s += ", ... (" + std::to_string(numel() - n) + " more)";
    return s + "])";
}

} // namespace llaisys
