// LLAISYS_HD: a function both the CPU and the CUDA backend of an op compile (inline on the host,
// __host__ __device__ __forceinline__ under nvcc), for the rules a backend pair must share bit for bit.
#pragma once

#ifdef __CUDACC__
#define LLAISYS_HD __host__ __device__ __forceinline__
#else
#define LLAISYS_HD inline
#endif
