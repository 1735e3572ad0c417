// CPU-only builds: graphs exist only on CUDA.
#include "llaisys/common.hpp"
#include "llaisys/graph.hpp"

#ifndef LLAISYS_WITH_CUDA
namespace llaisys {
Graph::Graph(Device device) : device_(device) {
    throw NotCompiledError("CUDA graphs need the CUDA backend; this build of llaisys has none");
}
Graph::~Graph() = default;
void Graph::capture(const std::function<void()> &) {}
void Graph::replay() const {}
size_t Graph::switchable(const std::function<void()> &) { return 0; }
void Graph::set_enabled(size_t, bool) {}
} // namespace llaisys
#endif
