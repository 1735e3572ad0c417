#include "core/cuda/check.hpp"
#include "llaisys/graph.hpp"
#include "llaisys/stream.hpp"

namespace llaisys {

Graph::Graph(Device device) : device_(device) {
    LLAISYS_CHECK(device.is_cuda(), std::invalid_argument, "Graph: CUDA graphs need a CUDA device, got ",
                  device.str());
    check_device_available(device);
}

Graph::~Graph() {
    if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
    if (graph_) cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
}

void Graph::capture(const std::function<void()> &work) {
    LLAISYS_CHECK(!exec_, std::logic_error, "Graph: already captured");
    DeviceGuard guard(device_);
    auto stream = static_cast<cudaStream_t>(current_stream(device_).handle());
    // Relaxed: the caching allocator and library handles may make (legal) runtime calls meanwhile.
    LLAISYS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    detail::set_capture_pool(&pool_);
    try {
        work();
    } catch (...) {
        detail::set_capture_pool(nullptr);
        cudaGraph_t g = nullptr;
        cudaStreamEndCapture(stream, &g); // leave the stream usable
        if (g) cudaGraphDestroy(g);
        cudaGetLastError();
        pool_.clear();
        throw;
    }
    detail::set_capture_pool(nullptr);
    cudaGraph_t g = nullptr;
    LLAISYS_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    graph_ = g;
    cudaGraphExec_t exec = nullptr;
    LLAISYS_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    exec_ = exec;
}

void Graph::replay() const {
    LLAISYS_CHECK(exec_, std::logic_error, "Graph: replay before capture");
    DeviceGuard guard(device_);
    LLAISYS_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_),
                                       static_cast<cudaStream_t>(current_stream(device_).handle())));
}

} // namespace llaisys
