// CUDA graphs: capture the work a function enqueues on the device's current stream once, replay it
// with one launch. Memory allocated while capturing stays owned by the graph (replays write to those
// addresses), so nothing else can reuse it while the graph lives. Capture needs a warmed-up caching
// allocator (no cudaMalloc) and no host syncs inside the captured work. A part of the work captured
// through switchable() can be switched off and on between replays, so one graph (and one copy of its
// memory) serves steps that differ only in whether that part runs.
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
    // Only inside capture()'s work: runs `part` and returns its id. Its nodes run in every replay until
    // set_enabled(id, false) (cudaGraphNodeSetEnabled: they then do nothing, and what depends on them still
    // waits for what they depended on). Only kernel, memset and memcpy nodes can be switched.
    size_t switchable(const std::function<void()> &part);
    void set_enabled(size_t part, bool on); // for the replays enqueued after it


private:
    Device device_;
    void *graph_ = nullptr, *exec_ = nullptr;
    std::vector<std::shared_ptr<Storage>> pool_;
    std::vector<std::vector<void *>> parts_; // nodes of each switchable part
};

namespace detail {
// While set (during Graph::capture on this thread), every allocation is also kept in *pool.
void set_capture_pool(std::vector<std::shared_ptr<Storage>> *pool);
} // namespace detail

} // namespace llaisys
