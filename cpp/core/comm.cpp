// Communicators: the CPU group (ranks are threads of this process) and the dispatch to NCCL.
#include "llaisys/comm.hpp"

#include "llaisys/common.hpp"
#include "llaisys/dtype.hpp"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>

namespace llaisys {

#ifdef LLAISYS_HAVE_NCCL
// cpp/core/cuda/comm_nccl.cpp
std::vector<std::shared_ptr<Communicator>> nccl_group(const std::vector<int> &devices);
std::string nccl_version_string();
void nccl_group_calls(const std::function<void()> &fn);
std::string nccl_make_unique_id();
std::vector<std::shared_ptr<Communicator>> nccl_group_from_id(const std::vector<int> &devices, int first_rank,
                                                              int world, const std::string &id);
#endif
// cpp/core/comm_socket.cpp
std::shared_ptr<Communicator> socket_group_rank(int rank, int world, const std::vector<int> &fds, double timeout_s);

namespace {

// What the ranks of one CPU group share: a barrier with a timeout, and each rank's posted buffer.
struct CpuShared {
    explicit CpuShared(int world, double timeout_s) : world(world), timeout_s(timeout_s), bufs(world), numel(world),
                                                      dtype(world), arrived_flags(world, 0) {}
    const int world;
    const double timeout_s;
    std::mutex m;
    std::condition_variable cv;
    int arrived = 0;
    uint64_t generation = 0;
    std::string broken; // why, once a wait timed out: every later call raises it
    std::vector<void *> bufs;
    std::vector<int64_t> numel;
    std::vector<DType> dtype;
    std::vector<char> arrived_flags; // who reached the current barrier (for the timeout's message)
    std::vector<float> scratch;

    void abort(const std::string &why) {
        std::lock_guard<std::mutex> lock(m);
        if (broken.empty()) broken = why;
        cv.notify_all();
    }

    // Every rank waits here until all have arrived (or raises after timeout_s, naming the missing ones).
    void wait(int rank, const char *what) {
        std::unique_lock<std::mutex> lock(m);
        LLAISYS_CHECK(broken.empty(), std::runtime_error, what, ": the group is broken: ", broken);
        const uint64_t gen = generation;
        arrived_flags[rank] = 1;
        if (++arrived == world) {
            arrived = 0;
            ++generation;
            std::fill(arrived_flags.begin(), arrived_flags.end(), 0);
            cv.notify_all();
            return;
        }
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
        while (generation == gen && broken.empty()) {
            if (cv.wait_until(lock, deadline) == std::cv_status::timeout && generation == gen && broken.empty()) {
                std::string missing;
                for (int r = 0; r < world; ++r)
                    if (!arrived_flags[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
                broken = detail::concat("rank ", rank, " waited ", timeout_s, " s in ", what, " for rank(s) ",
                                        missing, ", which never arrived (a rank that died or stalled)");
                cv.notify_all();
            }
        }
        LLAISYS_CHECK(generation != gen, std::runtime_error, what, ": ", broken);
    }
};

template <typename T>
void reduce_slice(CpuShared &s, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
        float acc = 0.f;
        for (int r = 0; r < s.world; ++r) acc += to_float(static_cast<const T *>(s.bufs[r])[i]);
        s.scratch[size_t(i)] = acc;
    }
}

template <typename T>
void write_back(const CpuShared &s, void *dst, int64_t n) {
    T *out = static_cast<T *>(dst);
    for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(s.scratch[size_t(i)]);
}

class CpuCommunicator final : public Communicator {
public:
    CpuCommunicator(int rank, std::shared_ptr<CpuShared> shared)
        : Communicator(rank, shared->world, Device::cpu()), s_(std::move(shared)) {}

    std::string backend() const override { return "cpu threads"; }
    void abort(const std::string &why) override { s_->abort(why); }

    void all_reduce_sum(const Tensor &x) override {
        const int r = rank(), w = world();
        post(x, "all_reduce");
        s_->wait(r, "all_reduce");
        agree("all_reduce", x);
        const int64_t n = x.numel(), begin = n * r / w, end = n * (r + 1) / w;
        if (r == 0) s_->scratch.resize(size_t(n)); // before the others write: the next wait orders it
        s_->wait(r, "all_reduce");
        switch (x.dtype()) { // each rank sums its slice over all ranks, then everyone copies the sums
        case DType::F32: reduce_slice<float>(*s_, begin, end); break;
        case DType::F16: reduce_slice<f16_t>(*s_, begin, end); break;
        default: reduce_slice<bf16_t>(*s_, begin, end); break;
        }
        s_->wait(r, "all_reduce");
        switch (x.dtype()) {
        case DType::F32: write_back<float>(*s_, x.data(), n); break;
        case DType::F16: write_back<f16_t>(*s_, x.data(), n); break;
        default: write_back<bf16_t>(*s_, x.data(), n); break;
        }
        s_->wait(r, "all_reduce"); // nobody posts the next call's buffer while another still reads this one
    }

    void all_gather(const Tensor &out, const Tensor &in) override {
        const int r = rank();
        post(in, "all_gather");
        s_->wait(r, "all_gather");
        agree("all_gather", in);
        const size_t bytes = size_t(in.numel()) * dtype_size(in.dtype());
        for (int k = 0; k < world(); ++k)
            std::memcpy(static_cast<char *>(out.data()) + bytes * size_t(k), s_->bufs[k], bytes);
        s_->wait(r, "all_gather");
    }

private:
    void post(const Tensor &x, const char *) {
        s_->bufs[rank()] = x.data();
        s_->numel[rank()] = x.numel();
        s_->dtype[rank()] = x.dtype();
    }
    // Every rank checks every rank's tensor: all raise together, so none is left waiting for the others.
    void agree(const char *what, const Tensor &x) const {
        for (int k = 0; k < world(); ++k)
            LLAISYS_CHECK(s_->numel[k] == x.numel() && s_->dtype[k] == x.dtype(), std::invalid_argument, what,
                          ": rank ", k, " passed ", s_->numel[k], " elements of ", dtype_name(s_->dtype[k]),
                          ", rank ", rank(), " ", x.numel(), " of ", dtype_name(x.dtype()),
                          ": every rank must pass the same shape and dtype");
    }
    std::shared_ptr<CpuShared> s_;
};

} // namespace

#ifndef LLAISYS_HAVE_NCCL
namespace {
[[noreturn]] void no_nccl() {
    throw NotCompiledError("tensor parallelism on CUDA needs NCCL, and this build of llaisys has none "
                           "(install the nvidia-nccl-cu13 wheel, or NCCL itself, and rebuild: "
                           "llaisys.build_info()['nccl'] says what a build has)");
}
} // namespace
#endif

std::vector<std::shared_ptr<Communicator>> local_group(DeviceType type, const std::vector<int> &devices,
                                                       double timeout_s) {
    LLAISYS_CHECK(!devices.empty(), std::invalid_argument, "local_group: no ranks");
    LLAISYS_CHECK(timeout_s > 0, std::invalid_argument, "local_group: timeout_s must be > 0, got ", timeout_s);
    if (type == DeviceType::CUDA) {
#ifdef LLAISYS_HAVE_NCCL
        return nccl_group(devices);
#else
        no_nccl();
#endif
    }
    auto shared = std::make_shared<CpuShared>(int(devices.size()), timeout_s);
    std::vector<std::shared_ptr<Communicator>> out;
    for (int r = 0; r < int(devices.size()); ++r) out.push_back(std::make_shared<CpuCommunicator>(r, shared));
    return out;
}

std::string nccl_unique_id() {
#ifdef LLAISYS_HAVE_NCCL
    return nccl_make_unique_id();
#else
    no_nccl();
#endif
}

std::vector<std::shared_ptr<Communicator>> group_from_id(const std::vector<int> &devices, int first_rank, int world,
                                                         const std::string &id) {
    LLAISYS_CHECK(!devices.empty() && first_rank >= 0 && first_rank + int(devices.size()) <= world,
                  std::invalid_argument, "group_from_id: ranks ", first_rank, "..", first_rank + int(devices.size()) - 1,
                  " are not within a world of ", world);
#ifdef LLAISYS_HAVE_NCCL
    return nccl_group_from_id(devices, first_rank, world, id);
#else
    (void)id;
    no_nccl();
#endif
}

std::shared_ptr<Communicator> socket_group(int rank, int world, const std::vector<int> &fds, double timeout_s) {
    return socket_group_rank(rank, world, fds, timeout_s);
}

bool nccl_available() {
#ifdef LLAISYS_HAVE_NCCL
    return true;
#else
    return false;
#endif
}

std::string nccl_version() {
#ifdef LLAISYS_HAVE_NCCL
    return nccl_version_string();
#else
    return "";
#endif
}

void group_calls(DeviceType type, const std::function<void()> &fn) {
#ifdef LLAISYS_HAVE_NCCL
    if (type == DeviceType::CUDA) return nccl_group_calls(fn);
#endif
    (void)type;
    fn();
}

} // namespace llaisys
