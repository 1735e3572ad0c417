#include "core/cuda/check.hpp"
#include "llaisys/graph.hpp"
#include "llaisys/stream.hpp"

#include <algorithm>
#include <functional>
#include <iterator>

namespace llaisys {

// The nodes captured so far into the graph `stream` is capturing, sorted (for set_difference).
static std::vector<cudaGraphNode_t> captured_nodes(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaGraph_t graph = nullptr;
    LLAISYS_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph));
    LLAISYS_CHECK(status == cudaStreamCaptureStatusActive && graph, std::logic_error,
                  "Graph::switchable: only inside the work of Graph::capture");
    size_t n = 0;
    LLAISYS_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
    std::vector<cudaGraphNode_t> nodes(n);
    if (n > 0) LLAISYS_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &n));
    nodes.resize(n);
    std::sort(nodes.begin(), nodes.end(), std::less<cudaGraphNode_t>());
    return nodes;
}

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
        parts_.clear();
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

// The part's nodes are those the capture gained while it ran (one stream captures, so nothing else adds
// nodes meanwhile).
size_t Graph::switchable(const std::function<void()> &part) {
    auto stream = static_cast<cudaStream_t>(current_stream(device_).handle());
    const std::vector<cudaGraphNode_t> before = captured_nodes(stream);
    part();
    const std::vector<cudaGraphNode_t> after = captured_nodes(stream);
    std::vector<void *> added;
    std::set_difference(after.begin(), after.end(), before.begin(), before.end(), std::back_inserter(added),
                        std::less<cudaGraphNode_t>());
    for (void *node : added) {
        cudaGraphNodeType type;
        LLAISYS_CUDA_CHECK(cudaGraphNodeGetType(static_cast<cudaGraphNode_t>(node), &type));
        LLAISYS_CHECK(type == cudaGraphNodeTypeKernel || type == cudaGraphNodeTypeMemset ||
                          type == cudaGraphNodeTypeMemcpy,
                      std::logic_error, "Graph::switchable: the part captured a node of type ", int(type),
                      " (only kernel, memset and memcpy nodes can be switched)");
    }
    parts_.push_back(std::move(added));
    return parts_.size() - 1;
}

void Graph::set_enabled(size_t part, bool on) {
    LLAISYS_CHECK(exec_ && part < parts_.size(), std::logic_error, "Graph::set_enabled: no part ", part,
                  " in a captured graph");
    DeviceGuard guard(device_);
    for (void *node : parts_[part])
        LLAISYS_CUDA_CHECK(cudaGraphNodeSetEnabled(static_cast<cudaGraphExec_t>(exec_),
                                                   static_cast<cudaGraphNode_t>(node), on ? 1u : 0u));
}

void Graph::replay() const {
    LLAISYS_CHECK(exec_, std::logic_error, "Graph: replay before capture");
    DeviceGuard guard(device_);
    LLAISYS_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_),
                                       static_cast<cudaStream_t>(current_stream(device_).handle())));
}

} // namespace llaisys
