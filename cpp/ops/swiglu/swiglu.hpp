#pragma once
#include "llaisys/tensor.hpp"

// Backends receive validated, contiguous tensors of one shape; out may alias gate or up.
namespace llaisys::ops::cpu {
void swiglu(const Tensor &out, const Tensor &gate, const Tensor &up);
}
namespace llaisys::ops::cuda {
void swiglu(const Tensor &out, const Tensor &gate, const Tensor &up);
}
