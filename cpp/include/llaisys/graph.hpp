// CUDA graphs: capture the work a function enqueues on the device's current stream once, replay it
// with one launch. Memory allocated while capturing stays owned by the graph (replays write to those
// addresses), so nothing else can reuse it while the graph lives. Capture needs a warmed-up caching
// allocator (no cudaMalloc) and no host syncs inside the captured work.
#pragma once
#include "llaisys/memory.hpp"

#include <functional>
#include <memory>
#include <vector>

namespace llaisys {

class Graph {
public:
    explicit Graph(Device device);
    ~Graph();
    Graph(const Graph &) = delete;
    Graph &operator=(const Graph &) = delete;

    void capture(const std::function<void()> &work); // runs `work` once under stream capture
    void replay() const;                             // enqueues the captured work on the current stream
    bool captured() const { return exec_ != nullptr; }

private:
    Device device_;
    void *graph_ = nullptr, *exec_ = nullptr;
    std::vector<std::shared_ptr<Storage>> pool_;
};

namespace detail {
// While set (during Graph::capture on this thread), every allocation is also kept in *pool.
void set_capture_pool(std::vector<std::shared_ptr<Storage>> *pool);
} // namespace detail

} // namespace llaisys
