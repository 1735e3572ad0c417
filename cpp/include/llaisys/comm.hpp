// Collectives between the ranks of a tensor-parallel group (issue 30): every rank holds a shard of the
// model and the ranks sum their partial outputs (all_reduce) or concatenate their slices (all_gather).
//
// A group is made once for all its ranks in one process (local_group): on CUDA one NCCL communicator per
// GPU (ncclCommInitAll), stream-ordered on each rank's current stream and so capturable in CUDA graphs; on
// the CPU an in-process group whose ranks are threads (what CI runs, and what the CPU engine would use).
// Every rank must make the same calls in the same order with tensors of the same shape and dtype, each
// from its own thread (or, on CUDA, inside one group_calls() scope). A rank that does not arrive within
// the group's timeout makes the others raise, naming it, and the group is then broken: every later call
// raises at once instead of hanging.
#pragma once
#include "llaisys/tensor.hpp"

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace llaisys {

class Communicator {
public:
    virtual ~Communicator() = default;
    int rank() const { return rank_; }
    int world() const { return world_; }
    Device device() const { return device_; }
    // In place: x = the sum of every rank's x (f32 / f16 / bf16; sums accumulate in f32 in rank order on
    // the CPU, NCCL's order on CUDA).
    virtual void all_reduce_sum(const Tensor &x) = 0;
    // out [world * n, ...] = every rank's in [n, ...] in rank order (contiguous tensors of one dtype).
    virtual void all_gather(const Tensor &out, const Tensor &in) = 0;
    // "nccl 2.x.y", "cpu threads"
    virtual std::string backend() const = 0;
    // How many all_reduce_sum calls of this rank took each path ("push", "pull", "nccl" on CUDA; empty where
    // there is one path). Counted when enqueued: a call captured into a CUDA graph counts once, not per replay.
    virtual std::map<std::string, int64_t> all_reduce_paths() const { return {}; }
    // Breaks the group: calls blocked in a collective (a peer that died or stalled) return with an error
    // (NCCL: ncclCommAbort, which also ends its kernels on the device), and every later call raises `why`.
    // Safe from any thread, also while another thread waits in a collective; later aborts do nothing.
    virtual void abort(const std::string &why) = 0;

protected:
    Communicator(int rank, int world, Device device) : rank_(rank), world_(world), device_(device) {}

private:
    int rank_, world_;
    Device device_;
};

// The ranks of one group: `devices` are CUDA device indices (one rank each), or for the CPU `world`
// ranks (devices then lists world zeros). timeout_s bounds the wait for the other ranks (CPU; on CUDA
// NCCL's own watchdog is the caller's: see group_calls).
std::vector<std::shared_ptr<Communicator>> local_group(DeviceType type, const std::vector<int> &devices,
                                                       double timeout_s = 300.0);

// Groups whose ranks span processes (several hosts: engine/nodes.py makes them after its rendezvous).
// CUDA: the GPUs `devices` of this process are global ranks first_rank .. first_rank + devices.size() - 1
// of `world`, joined through NCCL's unique id (nccl_unique_id() on global rank 0's process, handed to
// every process; ncclCommInitRank per GPU inside one ncclGroupStart/End). Blocks until every rank joined.
std::string nccl_unique_id();
std::vector<std::shared_ptr<Communicator>> group_from_id(const std::vector<int> &devices, int first_rank, int world,
                                                         const std::string &id);
// CPU: this process is rank `rank` of `world`, one rank per process, over connected TCP sockets the caller
// made (a star around rank 0: rank 0 passes one per rank, its own -1; a rank k > 0 the one to rank 0). The
// communicator owns (closes) them. comm_socket.cpp says how a collective travels.
std::shared_ptr<Communicator> socket_group(int rank, int world, const std::vector<int> &fds, double timeout_s);

// Whether this build can make CUDA groups, and NCCL's version ("" when not).
bool nccl_available();
std::string nccl_version();

// Runs fn with the calls it makes to several ranks' communicators batched (ncclGroupStart/End), which one
// thread driving several GPUs needs; on the CPU it just runs fn.
void group_calls(DeviceType type, const std::function<void()> &fn);

} // namespace llaisys
