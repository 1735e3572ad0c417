// all_reduce / all_gather: the checks at the op boundary, then the rank's communicator (llaisys/comm.hpp:
// NCCL on CUDA, the in-process group on the CPU), which holds the backends' code.
#include "llaisys/comm.hpp"
#include "llaisys/ops.hpp"

#include "llaisys/common.hpp"

namespace llaisys::ops {

namespace {
void check_rank_tensor(const char *op, const char *name, const Tensor &t, const Communicator &comm) {
    LLAISYS_CHECK(t.defined(), std::invalid_argument, op, ": ", name, " is undefined");
    LLAISYS_CHECK(t.is_contiguous(), std::invalid_argument, op, ": ", name, " must be contiguous");
    const Device d = t.device(), c = comm.device();
    LLAISYS_CHECK(d.type == c.type && (d.type == DeviceType::CPU || d.index == c.index), std::invalid_argument, op,
                  ": ", name, " is on ", d.str(), " but rank ", comm.rank(), "'s communicator is on ", c.str());
}
} // namespace

void all_reduce(const Tensor &x, Communicator &comm) {
    constexpr const char *op = "all_reduce";
    check_rank_tensor(op, "x", x, comm);
    LLAISYS_CHECK(is_float(x.dtype()), TypeError, op, ": x must be f32, f16 or bf16, got ", dtype_name(x.dtype()));
    if (comm.world() == 1 || x.numel() == 0) return;
    comm.all_reduce_sum(x);
}

void all_gather(const Tensor &out, const Tensor &x, Communicator &comm) {
    constexpr const char *op = "all_gather";
    check_rank_tensor(op, "x", x, comm);
    check_rank_tensor(op, "out", out, comm);
    LLAISYS_CHECK(out.dtype() == x.dtype(), TypeError, op, ": out is ", dtype_name(out.dtype()), " but x is ",
                  dtype_name(x.dtype()));
    LLAISYS_CHECK(out.numel() == x.numel() * comm.world(), std::invalid_argument, op, ": out has ", out.numel(),
                  " elements; world ", comm.world(), " x ", x.numel(), " are gathered");
    if (x.numel() == 0) return;
    comm.all_gather(out, x);
}

} // namespace llaisys::ops
