// The CPU communicator of a group whose ranks are processes (issue 30's launch across hosts, and what CI
// runs with 2 processes on one machine): one rank per process, a star of TCP connections around global
// rank 0, which the caller made and hands over connected (engine/nodes.py's rendezvous).
//
// Every collective is one round trip: each rank k > 0 sends (op, dtype, numel, its buffer) to rank 0;
// rank 0 reads them in rank order, sums in f32 in rank order (all_reduce: the same order, hence the same
// bits, as the in-process CPU group) or concatenates (all_gather), and sends each rank the result. Ranks
// that disagree on the call (op, dtype or size) compute different things: the group breaks. Slow for large tensors (rank 0 moves everything) but exact and simple; it is for tests and
// CPU runs, not for speed. Byte order: the host's (every platform we build for is little-endian).
//
// Faults: every wait is bounded by the group's timeout; a closed connection or a timeout breaks the group
// (abort: shutdown() of every socket, which ends a peer's blocked read too), and every later call raises.
#include "llaisys/comm.hpp"

#include "llaisys/common.hpp"
#include "llaisys/dtype.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>

namespace llaisys {

namespace {

using Clock = std::chrono::steady_clock;

struct Header {
    uint8_t op;    // 1 all_reduce, 2 all_gather
    uint8_t dtype; // DType
    int64_t numel;
};

class SocketCommunicator final : public Communicator {
public:
    // rank 0: fds[k] is the connection to rank k (fds[0] unused); rank k > 0: fds[0] is the one to rank 0
    SocketCommunicator(int rank, int world, std::vector<int> fds, double timeout_s)
        : Communicator(rank, world, Device::cpu()), fds_(std::move(fds)), timeout_s_(timeout_s) {}
    ~SocketCommunicator() override {
        for (size_t k = 0; k < fds_.size(); ++k)
            if (fds_[k] >= 0 && !(rank() == 0 && k == 0)) ::close(fds_[k]);
    }

    std::string backend() const override { return "cpu sockets"; }

    void abort(const std::string &why) override {
        std::lock_guard<std::mutex> lock(mu_);
        if (!broken_.empty()) return;
        broken_ = why;
        for (size_t k = 0; k < fds_.size(); ++k)
            if (fds_[k] >= 0 && !(rank() == 0 && k == 0)) ::shutdown(fds_[k], SHUT_RDWR);
    }

    void all_reduce_sum(const Tensor &x) override {
        collective(1, x, x.numel());
    }

    void all_gather(const Tensor &out, const Tensor &in) override {
        LLAISYS_CHECK(out.numel() == in.numel() * world() && out.dtype() == in.dtype(), std::invalid_argument,
                      "all_gather: out must hold world x in's elements of in's dtype");
        collective(2, in, in.numel(), &out);
    }

private:
    void collective(uint8_t op, const Tensor &x, int64_t n, const Tensor *out = nullptr) {
        const char *what = op == 1 ? "all_reduce" : "all_gather";
        check_alive(what);
        LLAISYS_CHECK(op == 2 || x.dtype() == DType::F32 || x.dtype() == DType::F16 || x.dtype() == DType::BF16,
                      TypeError, what, ": the socket group sums f32, f16 or bf16, not ", dtype_name(x.dtype()));
        deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
        const Header h{op, uint8_t(x.dtype()), n};
        const size_t bytes = size_t(n) * dtype_size(x.dtype());
        try {
            if (rank() == 0) serve(what, h, x, bytes, out);
            else join(h, x, bytes, out);
        } catch (const std::exception &e) {
            abort(e.what());
            throw std::runtime_error(detail::concat(what, ": the tensor-parallel group is broken: ", e.what()));
        }
    }

    // rank 0: every rank's buffer in rank order, then each rank's answer
    void serve(const char *what, const Header &h, const Tensor &x, size_t bytes, const Tensor *out) {
        const int w = world();
        std::vector<std::vector<char>> bufs(static_cast<size_t>(w));
        for (int k = 1; k < w; ++k) {
            Header p{};
            recv_all(k, &p, sizeof p);
            LLAISYS_CHECK(p.op == h.op && p.dtype == h.dtype && p.numel == h.numel, std::runtime_error, what,
                          ": rank ", k, " made call ", int(p.op), " with ", p.numel, " elements of dtype ",
                          int(p.dtype), ", rank 0 call ", int(h.op), " with ", h.numel, " of ",
                          dtype_name(x.dtype()), ": the ranks compute different things");
            bufs[size_t(k)].resize(bytes);
            recv_all(k, bufs[size_t(k)].data(), bytes);
        }
        std::vector<char> result;
        if (h.op == 1) {
            reduce(x, bufs);
            result.assign(static_cast<const char *>(x.data()), static_cast<const char *>(x.data()) + bytes);
        } else {
            std::memcpy(out->data(), x.data(), bytes);
            for (int k = 1; k < w; ++k)
                std::memcpy(static_cast<char *>(out->data()) + bytes * size_t(k), bufs[size_t(k)].data(), bytes);
            result.assign(static_cast<const char *>(out->data()), static_cast<const char *>(out->data()) + bytes * w);
        }
        for (int k = 1; k < w; ++k) send_all(k, result.data(), result.size());
    }

    // rank k > 0: send ours, read the answer
    void join(const Header &h, const Tensor &x, size_t bytes, const Tensor *out) {
        send_all(0, &h, sizeof h);
        send_all(0, x.data(), bytes);
        if (h.op == 1) recv_all(0, x.data(), bytes);
        else recv_all(0, out->data(), bytes * size_t(world()));
    }

    void reduce(const Tensor &x, const std::vector<std::vector<char>> &bufs) {
        switch (x.dtype()) {
        case DType::F32: reduce_as<float>(x, bufs); break;
        case DType::F16: reduce_as<f16_t>(x, bufs); break;
        default: reduce_as<bf16_t>(x, bufs); break;
        }
    }

    // x = x + bufs[1] + ... in f32, in rank order
    template <typename T>
    void reduce_as(const Tensor &x, const std::vector<std::vector<char>> &bufs) {
        T *own = static_cast<T *>(x.data());
        for (int64_t i = 0; i < x.numel(); ++i) {
            float acc = 0.f + to_float(own[i]);
            for (int k = 1; k < world(); ++k) acc += to_float(reinterpret_cast<const T *>(bufs[size_t(k)].data())[i]);
            own[i] = from_float<T>(acc);
        }
    }

    void check_alive(const char *what) {
        std::lock_guard<std::mutex> lock(mu_);
        LLAISYS_CHECK(broken_.empty(), std::runtime_error, what, ": the tensor-parallel group is broken: ", broken_);
    }

    int fd_of(int peer) const { return fds_[size_t(rank() == 0 ? peer : 0)]; }

    // Waits (until the call's deadline) for fd to be ready; raises naming the peer on a timeout or a hang-up.
    void wait_ready(int peer, short events) {
        for (;;) {
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now()).count();
            LLAISYS_CHECK(left > 0, std::runtime_error, "rank ", rank(), " waited ", timeout_s_, " s for rank ", peer,
                          " (a rank that died or stalled)");
            pollfd p{fd_of(peer), events, 0};
            const int r = ::poll(&p, 1, int(std::min<long long>(left, 1000)));
            if (r < 0 && errno == EINTR) continue;
            LLAISYS_CHECK(r >= 0, std::runtime_error, "poll: ", std::strerror(errno));
            if (r > 0) return; // readable/writable, or an error the next read/write reports
            check_alive("a collective");
        }
    }

    void recv_all(int peer, void *dst, size_t n) {
        char *p = static_cast<char *>(dst);
        while (n > 0) {
            wait_ready(peer, POLLIN);
            const ssize_t r = ::recv(fd_of(peer), p, n, 0);
            if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            LLAISYS_CHECK(r > 0, std::runtime_error, "rank ", rank(), "'s connection to rank ", peer, " closed",
                          r < 0 ? detail::concat(" (", std::strerror(errno), ")") : std::string(),
                          " (its process died or its group was aborted)");
            p += r;
            n -= size_t(r);
        }
    }

    void send_all(int peer, const void *src, size_t n) {
        const char *p = static_cast<const char *>(src);
        while (n > 0) {
            wait_ready(peer, POLLOUT);
            const ssize_t r = ::send(fd_of(peer), p, n, MSG_NOSIGNAL);
            if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            LLAISYS_CHECK(r > 0, std::runtime_error, "rank ", rank(), " could not send to rank ", peer, ": ",
                          r < 0 ? std::strerror(errno) : "closed", " (its process died or its group was aborted)");
            p += r;
            n -= size_t(r);
        }
    }

    std::vector<int> fds_;
    double timeout_s_;
    Clock::time_point deadline_;
    std::mutex mu_;
    std::string broken_;
};

} // namespace

std::shared_ptr<Communicator> socket_group_rank(int rank, int world, const std::vector<int> &fds, double timeout_s) {
    LLAISYS_CHECK(world >= 2 && rank >= 0 && rank < world, std::invalid_argument, "socket_group: rank ", rank,
                  " of ", world, " (world must be >= 2)");
    LLAISYS_CHECK(timeout_s > 0, std::invalid_argument, "socket_group: timeout_s must be > 0, got ", timeout_s);
    LLAISYS_CHECK(int(fds.size()) == (rank == 0 ? world : 1), std::invalid_argument, "socket_group: rank ", rank,
                  " needs ", rank == 0 ? world : 1, " socket(s) (rank 0: one per rank, its own -1), got ", fds.size());
    for (size_t k = 0; k < fds.size(); ++k)
        LLAISYS_CHECK(fds[k] >= 0 || (rank == 0 && k == 0), std::invalid_argument, "socket_group: socket ", k,
                      " is ", fds[k]);
    return std::make_shared<SocketCommunicator>(rank, world, fds, timeout_s);
}

} // namespace llaisys
