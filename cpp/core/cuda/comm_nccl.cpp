// NCCL communicators for the CUDA ranks of one process (issue 30). Compiled only where CMake found NCCL
// (LLAISYS_HAVE_NCCL); see llaisys/comm.hpp for the contract. Each collective is enqueued on the current
// stream of the rank's device, so it orders with the rank's other kernels and is captured into a CUDA
// graph like them.
#ifdef LLAISYS_HAVE_NCCL
#include "llaisys/comm.hpp"

#include "core/cuda/check.hpp"
#include "core/cuda/peer_all_reduce.hpp"
#include "llaisys/stream.hpp"

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

namespace llaisys {

#define LLAISYS_NCCL_CHECK(expr)                                                                       \
    do {                                                                                               \
        ncclResult_t r_ = (expr);                                                                      \
        if (r_ != ncclSuccess)                                                                         \
            throw std::runtime_error(::llaisys::detail::concat("NCCL error: ", ncclGetErrorString(r_), \
                                                               " (", #expr, ")"));                     \
    } while (0)

namespace {

ncclDataType_t nccl_type(DType d, const char *what) {
    switch (d) {
    case DType::F32: return ncclFloat32;
    case DType::F16: return ncclFloat16;
    case DType::BF16: return ncclBfloat16;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    default: throw TypeError(detail::concat(what, ": NCCL takes no ", dtype_name(d)));
    }
}

class NcclCommunicator final : public Communicator {
public:
    NcclCommunicator(int rank, int world, int device, ncclComm_t comm,
                     std::shared_ptr<runtime::cuda::PeerAllReduce> peer = nullptr)
        : Communicator(rank, world, Device::cuda(device)), comm_(comm), peer_(std::move(peer)) {}
    ~NcclCommunicator() override {
        if (!aborted_.load()) {
            ncclCommDestroy(comm_);
            return;
        }
        // the abort's thread returns once every graph holding this communicator is gone (the runners that own
        // them go first); should it not, it is left behind rather than hanging the process's exit (it holds
        // its own AbortDone, so it may return after this object is gone)
        if (!abort_thread_.joinable()) return; // abort() could not start its thread: comm_ is left as it is
        std::unique_lock<std::mutex> lock(abort_done_->mu);
        if (abort_done_->cv.wait_for(lock, std::chrono::seconds(30), [&] { return abort_done_->done; })) {
            lock.unlock();
            abort_thread_.join();
        } else {
            abort_thread_.detach();
        }
    }

    std::string backend() const override {
        const std::string nccl = "nccl " + nccl_version();
        if (!peer_) return nccl;
        const size_t push_kib = peer_->push_max_bytes() / 1024;
        return nccl + " + peer memory up to " + std::to_string(peer_->max_bytes() / 1024) + " KiB " +
               (push_kib == 0 ? std::string("(pull)") : "(push up to " + std::to_string(push_kib) + " KiB, pull above)");
    }

    std::map<std::string, int64_t> all_reduce_paths() const override {
        return {{"push", push_.load()}, {"pull", pull_.load()}, {"nccl", nccl_.load()}};
    }

    // ncclCommAbort raises the communicator's abort flag first (its kernels then end), but since NCCL 2.26 it
    // returns only once every CUDA graph that captured the communicator is destroyed, and a rank's runner
    // holds its graphs until the engine closes: called here it would never return (seen on 4 x H100, NCCL
    // 2.28.3). So it runs on a thread of its own; the caller goes on as soon as the flag is up.
    void abort(const std::string &why) override {
        std::lock_guard<std::mutex> lock(abort_mu_);
        if (aborted_.load()) return;
        why_ = why;
        aborted_.store(true);
        if (peer_) peer_->abort(); // its kernels waiting for a peer leave
        abort_thread_ = std::thread([comm = comm_, done = abort_done_] { // no `this`: see the destructor
            ncclCommAbort(comm); // frees the communicator; its pending kernels end early
            {
                std::lock_guard<std::mutex> lock(done->mu);
                done->done = true;
            }
            done->cv.notify_all();
        });
    }

    // Small messages (a decode step's activations) take the one-shot peer-memory kernel, the rest NCCL.
    void all_reduce_sum(const Tensor &x) override {
        check_alive();
        DeviceGuard guard(device());
        if (peer_ && peer_->takes(x)) {
            const char *path = peer_->all_reduce(rank(), x);
            ++(std::strcmp(path, "push") == 0 ? push_ : pull_);
            return;
        }
        LLAISYS_NCCL_CHECK(ncclAllReduce(x.data(), x.data(), size_t(x.numel()), nccl_type(x.dtype(), "all_reduce"),
                                         ncclSum, comm_, stream()));
        ++nccl_;
    }

    void all_gather(const Tensor &out, const Tensor &in) override {
        check_alive();
        DeviceGuard guard(device());
        LLAISYS_NCCL_CHECK(ncclAllGather(in.data(), out.data(), size_t(in.numel()), nccl_type(in.dtype(), "all_gather"),
                                         comm_, stream()));
    }

private:
    void check_alive() const {
        if (!aborted_.load()) return;
        std::lock_guard<std::mutex> lock(abort_mu_);
        throw std::runtime_error(detail::concat("the tensor-parallel group is broken: ", why_));
    }
    cudaStream_t stream() const { return static_cast<cudaStream_t>(current_stream(device()).handle()); }
    ncclComm_t comm_;
    std::shared_ptr<runtime::cuda::PeerAllReduce> peer_; // shared by the group's ranks; null: NCCL alone
    std::atomic<bool> aborted_{false};
    std::atomic<int64_t> push_{0}, pull_{0}, nccl_{0}; // all_reduce_paths()
    mutable std::mutex abort_mu_;
    std::string why_;
    std::thread abort_thread_;
    struct AbortDone {
        std::mutex mu;
        std::condition_variable cv;
        bool done = false;
    };
    std::shared_ptr<AbortDone> abort_done_ = std::make_shared<AbortDone>(); // shared with the abort's thread
};

} // namespace

std::vector<std::shared_ptr<Communicator>> nccl_group(const std::vector<int> &devices) {
    int count = 0;
    LLAISYS_CUDA_CHECK(cudaGetDeviceCount(&count));
    for (int d : devices)
        LLAISYS_CHECK(d >= 0 && d < count, std::invalid_argument, "local_group: no CUDA device ", d, " (this machine has ",
                      count, ")");
    std::vector<ncclComm_t> comms(devices.size());
    LLAISYS_NCCL_CHECK(ncclCommInitAll(comms.data(), int(devices.size()), devices.data()));
    // The peer path (on by default for 2 to 4 ranks, LLAISYS_PEER_ALLREDUCE; peer_all_reduce.hpp): messages up to
    // LLAISYS_PEER_ALLREDUCE_KB (default 512: a decode step's activations up to batch ~64 of a 7B model) go over
    // peer memory where every pair of GPUs reaches the other's; up to 512 KiB by the push kernel at 2 ranks
    // (LLAISYS_PEER_ALLREDUCE_PUSH=1/0 forces it on or off), by the pull kernel otherwise
    const char *kb = std::getenv("LLAISYS_PEER_ALLREDUCE_KB");
    const size_t max_bytes = size_t(kb != nullptr && std::atol(kb) > 0 ? std::atol(kb) : 512) * 1024;
    std::shared_ptr<runtime::cuda::PeerAllReduce> peer = runtime::cuda::PeerAllReduce::create(devices, max_bytes);
    std::vector<std::shared_ptr<Communicator>> out;
    for (size_t r = 0; r < devices.size(); ++r)
        out.push_back(std::make_shared<NcclCommunicator>(int(r), int(devices.size()), devices[r], comms[r], peer));
    return out;
}

std::string nccl_make_unique_id() {
    ncclUniqueId id;
    LLAISYS_NCCL_CHECK(ncclGetUniqueId(&id));
    return std::string(id.internal, sizeof id.internal);
}

// This process's GPUs as global ranks first_rank.. of `world` (the other ranks in other processes, joined
// through the same id). One thread inits several GPUs, so the inits are grouped (NCCL requires it).
std::vector<std::shared_ptr<Communicator>> nccl_group_from_id(const std::vector<int> &devices, int first_rank,
                                                              int world, const std::string &id) {
    ncclUniqueId uid;
    LLAISYS_CHECK(id.size() == sizeof uid.internal, std::invalid_argument, "group_from_id: an NCCL id has ",
                  sizeof uid.internal, " bytes, got ", id.size());
    std::memcpy(uid.internal, id.data(), sizeof uid.internal);
    int count = 0;
    LLAISYS_CUDA_CHECK(cudaGetDeviceCount(&count));
    for (int d : devices)
        LLAISYS_CHECK(d >= 0 && d < count, std::invalid_argument, "group_from_id: no CUDA device ", d,
                      " (this machine has ", count, ")");
    std::vector<ncclComm_t> comms(devices.size());
    int previous = 0;
    LLAISYS_CUDA_CHECK(cudaGetDevice(&previous));
    LLAISYS_NCCL_CHECK(ncclGroupStart());
    for (size_t i = 0; i < devices.size(); ++i) {
        cudaSetDevice(devices[i]);
        const ncclResult_t r = ncclCommInitRank(&comms[i], world, uid, first_rank + int(i));
        if (r != ncclSuccess) {
            ncclGroupEnd();
            cudaSetDevice(previous);
            LLAISYS_NCCL_CHECK(r);
        }
    }
    const ncclResult_t r = ncclGroupEnd();
    cudaSetDevice(previous);
    LLAISYS_NCCL_CHECK(r);
    std::vector<std::shared_ptr<Communicator>> out;
    for (size_t i = 0; i < devices.size(); ++i)
        out.push_back(std::make_shared<NcclCommunicator>(first_rank + int(i), world, devices[i], comms[i]));
    return out;
}

std::string nccl_version_string() {
    int v = 0;
    LLAISYS_NCCL_CHECK(ncclGetVersion(&v));
    return detail::concat(v / 10000, ".", (v / 100) % 100, ".", v % 100);
}

void nccl_group_calls(const std::function<void()> &fn) {
    LLAISYS_NCCL_CHECK(ncclGroupStart());
    try {
        fn();
    } catch (...) {
        ncclGroupEnd();
        throw;
    }
    LLAISYS_NCCL_CHECK(ncclGroupEnd());
}

} // namespace llaisys
#endif
