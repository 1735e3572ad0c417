#pragma once
#include "llaisys/common.hpp"

#include <cuda_runtime.h>

#define LLAISYS_CUDA_CHECK(expr)                                                                       \
    do {                                                                                               \
        cudaError_t err_ = (expr);                                                                     \
        if (err_ != cudaSuccess)                                                                       \
            throw std::runtime_error(::llaisys::detail::concat("CUDA error: ", cudaGetErrorString(err_), \
                                                               " (", #expr, ")"));                     \
    } while (0)
