#include "llaisys/common.hpp"
#include "llaisys/device.hpp"

#include <cctype>

namespace llaisys {

#ifdef LLAISYS_WITH_CUDA
int cuda_runtime_device_count();                 // cuda/stream_cuda.cpp
std::string cuda_runtime_device_name(int index); // cuda/stream_cuda.cpp
#endif

Device Device::parse(const std::string &spec) {
    if (spec == "cpu") return cpu();
    if (spec == "cuda") return cuda(0);
    if (spec.rfind("cuda:", 0) == 0 && spec.size() > 5) {
        const std::string idx = spec.substr(5);
        bool digits = idx.size() < 6;
        for (char c : idx) digits = digits && std::isdigit(static_cast<unsigned char>(c));
        if (digits) return cuda(std::stoi(idx));
    }
    throw std::invalid_argument("invalid device '" + spec + "' (expected 'cpu', 'cuda' or 'cuda:N')");
}

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }

bool cuda_compiled() {
#ifdef LLAISYS_WITH_CUDA
    return true;
#else
    return false;
#endif
}

int cuda_device_count() {
#ifdef LLAISYS_WITH_CUDA
    return cuda_runtime_device_count();
#else
    return 0;
#endif
}

std::string cuda_device_name(int index) {
    check_device_available(Device::cuda(index));
#ifdef LLAISYS_WITH_CUDA
    return cuda_runtime_device_name(index);
#else
    return "";
#endif
}

void check_device_available(const Device &device) {
    if (device.is_cpu()) return;
    if (!cuda_compiled())
        throw NotCompiledError("device " + device.str() +
                               " requested, but this build of llaisys has no CUDA backend. Rebuild with a CUDA "
                               "toolkit and cuBLAS installed: LLAISYS_CUDA=ON pip install . "
                               "(llaisys.build_info() shows what was compiled)");
    const int n = cuda_device_count();
    LLAISYS_CHECK(device.index >= 0 && device.index < n, std::invalid_argument, "device ", device.str(),
                  " is not available: ", n, " CUDA device(s) visible");
}

} // namespace llaisys
