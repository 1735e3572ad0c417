// Where a tensor lives.
#pragma once
#include <string>

namespace llaisys {

enum class DeviceType : int { CPU = 1, CUDA = 2 }; // values match DLPack's kDLCPU / kDLCUDA

struct Device {
    DeviceType type = DeviceType::CPU;
    int index = 0;

    static Device cpu() { return {DeviceType::CPU, 0}; }
    static Device cuda(int index = 0) { return {DeviceType::CUDA, index}; }
    static Device parse(const std::string &spec); // "cpu", "cuda", "cuda:1"; ValueError otherwise
    bool is_cpu() const { return type == DeviceType::CPU; }
    bool is_cuda() const { return type == DeviceType::CUDA; }
    std::string str() const;
    bool operator==(const Device &o) const { return type == o.type && index == o.index; }
    bool operator!=(const Device &o) const { return !(*this == o); }
};

// True when this build contains the CUDA backend.
bool cuda_compiled();
// Number of visible CUDA devices (0 in a CPU build or without a driver).
int cuda_device_count();
// The product name of CUDA device `index` ("NVIDIA H100 80GB HBM3"); raises where it is not available.
std::string cuda_device_name(int index);
// Throws a clear error unless `device` can be used by this build on this machine.
void check_device_available(const Device &device);

} // namespace llaisys
