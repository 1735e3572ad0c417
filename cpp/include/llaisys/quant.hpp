// Quantized weights: GGUF block formats kept as they are in the file, and the ops that read them.
//
// A QuantMatrix is not a Tensor dtype: its elements come in blocks (32 or 256 of them) that share
// scales, so per-element strides cannot describe it. It holds the raw blocks of an [N, K] matrix as a
// u8 Tensor [N, row_bytes] (host or device memory, shared like any tensor's storage), row n being the
// blocks of weights W[n, 0:K].
#pragma once
#include "llaisys/tensor.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace llaisys {

enum class QuantFormat : uint8_t { Q4_0, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0 };

struct QuantFormatInfo {
    const char *name;  // "q4_0", ...
    int block_elems;   // weights per block: 32, or 256 for the K-quants
    int block_bytes;   // bytes per block
    int gguf_type;     // GGML type id in GGUF files (gguf.GGMLQuantizationType)
};

const QuantFormatInfo &quant_format_info(QuantFormat format);
QuantFormat quant_format_from_name(const std::string &name); // "q4_0" or "Q4_0"; ValueError otherwise
QuantFormat quant_format_from_gguf(int gguf_type);           // ValueError for types not listed above
// Bytes of one row of `cols` weights; ValueError unless cols is a positive multiple of the block size.
int64_t quant_row_bytes(QuantFormat format, int64_t cols);

// How a matrix's rows hold their blocks. File: as GGUF stores them, one block after another. Q5Split (Q5_0
// in host memory only): each row's scales, then its fifth bits, then its nibbles (quant/formats.hpp), the
// same bytes a row; the AVX2 decode kernel runs it ~1.25x faster (bench/RESULTS.md, session 28). Every
// op gives the same bits for both layouts.
enum class QuantLayout : uint8_t { File, Q5Split };

class QuantMatrix {
public:
    QuantMatrix() = default; // undefined: defined() is false
    // Wraps `bytes` (u8 [rows, quant_row_bytes(format, cols)], contiguous) without copying; a view of
    // a mapped file keeps the file alive through the tensor's storage (Tensor::from_blob's on_free).
    QuantMatrix(QuantFormat format, int64_t rows, int64_t cols, Tensor bytes, QuantLayout layout = QuantLayout::File);
    // Rows of `parts` stacked in order (fused q/k/v, gate/up): same format, cols and device; a copy.
    static QuantMatrix concat_rows(const std::vector<QuantMatrix> &parts);

    bool defined() const { return bytes_.defined(); }
    QuantFormat format() const { return format_; }
    int64_t rows() const { return rows_; }
    int64_t cols() const { return cols_; }
    int64_t row_bytes() const { return defined() ? bytes_.size(1) : 0; }
    int64_t nbytes() const { return rows_ * row_bytes(); }
    Device device() const { return bytes_.device(); }
    const Tensor &bytes() const { return bytes_; }
    const uint8_t *row(int64_t r) const { return bytes_.data_as<uint8_t>() + r * row_bytes(); }

    QuantLayout layout() const { return layout_; }

    QuantMatrix slice_rows(int64_t start, int64_t end) const; // a view of rows [start, end)
    // A copy on `device` (self if already there); a Q5Split matrix goes to another device in the file layout.
    QuantMatrix to(Device device) const;
    // The same weights in `layout` (self if already in it): a host copy. Q5Split only for Q5_0.
    QuantMatrix with_layout(QuantLayout layout) const;

private:
    QuantLayout layout_ = QuantLayout::File;
    QuantFormat format_ = QuantFormat::Q8_0;
    int64_t rows_ = 0, cols_ = 0;
    Tensor bytes_; // u8 [rows, row_bytes]
};

// out [n, cols] (host f32, contiguous) = the weights of rows [row0, row0 + n) of a host matrix, decoded
// with the same f32 arithmetic as gguf-py's gguf.quants.dequantize (bit for bit).
void dequantize_rows(const QuantMatrix &m, int64_t row0, int64_t n, float *out);

// Which CPU code the quantized ops run. Auto picks the widest the CPU has at run time; the others
// force a path (ValueError if this CPU lacks it): for A/B tests and for testing the portable path.
enum class QuantCpuPath { Auto, Portable, Avx2, Avx512Vnni };
void set_quant_cpu_path(QuantCpuPath path);
QuantCpuPath quant_cpu_path();               // what runs now (never Auto)
bool quant_cpu_path_supported(QuantCpuPath path);
const char *quant_cpu_path_name(QuantCpuPath path);
// The layout a model on the CPU keeps a weight of this format and width in: Q5Split for Q5_0 rows of up to
// kQuantCpuSplitMaxCols where the best path is AVX2 (AVX-512 VNNI adds the fifth bit with one masked add and
// keeps the file's blocks), else File. Longer rows ran slower split (K = 4864: 0.83-0.89x; K = 896: 1.04-1.3x;
// bench/RESULTS.md, session 28): a row is then three long streams instead of one.
constexpr int64_t kQuantCpuSplitMaxCols = 2048;
QuantLayout quant_cpu_layout(QuantFormat format, int64_t cols);
// For A/B runs, not a user setting: off, quant_cpu_layout says File for every format (models loaded after).
void set_quant_cpu_split(bool on);
QuantCpuPath quant_cpu_path_from_name(const std::string &name); // "auto", "portable", "avx2", "avx512vnni"

// CUDA's quant_linear runs its int8 GEMV for up to this many rows of x; above, a K-quant weight goes
// through the tensor-core GEMM that decodes W tiles in shared memory for up to kQuantTcMaxRows rows
// (LLAISYS_QUANT_TC_MAX_ROWS overrides it, 0 turns that GEMM off), and every other case decodes the whole
// weight into a dense copy for cuBLASLt.
constexpr int64_t kQuantGemvMaxRows = 8;
// 64: the crossover measured on an H200 (bench_ops, session 34: 1536 -> 2 x 8960 Q4_K + SwiGLU 44.0 us
// against the copy's 49.7 at 64 rows, 74.0 against 51.1 at 128; bench/RESULTS.md).
constexpr int64_t kQuantTcMaxRows = 64;

namespace ops {
// out [..., N] = x [..., K] @ dequant(weight)[N, K]^T (+ bias [N]); x, bias and out share a float dtype.
// On the CPU each x row is first quantized to 8-bit blocks (d = max|x| / 127 per block of 32, or of
// 256 for the K-quants, q = round(x / d)) and the products are integer dot products per block, as
// llama.cpp computes them; the result is thus x's 8-bit rounding times the exact weights. CUDA does
// the same for M <= 8 rows of x; for more it multiplies the unquantized x by the weight decoded to x's
// dtype: on tensor cores from W tiles decoded in shared memory where quant_linear_tc says so, else through
// a transient dense [N, K] copy and the dense linear (ops/quant_linear/cuda.cu; a model decodes into a
// buffer of its own instead: quant_dequantize, models::linear).
void quant_linear(const Tensor &out, const Tensor &x, const QuantMatrix &weight, const Tensor &bias);
// out [..., I] = swiglu(x @ w_gate_up[:I]^T, x @ w_gate_up[I:]^T) with w_gate_up [2I, K]; g and u are
// rounded to out's dtype before the SwiGLU, so it equals two quant_linear calls + swiglu bit for bit.
void quant_linear_swiglu(const Tensor &out, const Tensor &x, const QuantMatrix &w_gate_up);
// out [n, D] = dequantized rows of weight [V, D] picked by ids [n] (i64/i32); an id outside [0, V) raises
// (on CUDA at the next synchronize, as embedding does, its row zero-filled).
void quant_embedding(const Tensor &out, const Tensor &ids, const QuantMatrix &weight);
// out [N, K] (a float dtype, on the weight's device) = the whole weight decoded, as quant_embedding decodes
// a row: quant_embedding with ids 0..N-1, without the ids. It allocates nothing (for a contiguous out), so a
// buffer decoded into over and over can live inside a captured CUDA graph: how a model's multi-row steps on
// CUDA read a quantized weight (models::linear).
void quant_dequantize(const Tensor &out, const QuantMatrix &weight);
// add_rms_norm then quant_linear (swiglu: quant_linear_swiglu, bias undefined) of its output, with the
// residual out of place: residual_out = residual + delta (rounded to the dtype), x = rms_norm(residual_out) *
// norm_weight, out = the projection of x. residual, delta, residual_out [M, K], norm_weight [K], out [M, N]
// (swiglu: [M, rows / 2]); residual_out may not overlap the others. The same bits as copying residual to
// residual_out, add_rms_norm into x and the projection; x itself is not kept. On CUDA, where
// add_rms_norm_quant_linear_fused() says so, one launch: the GEMV makes x from the residual in its own
// prologue (a decode step's layer input: one kernel less per norm); otherwise those ops run.
void add_rms_norm_quant_linear(const Tensor &out, const Tensor &residual_out, const Tensor &residual,
                               const Tensor &delta, const Tensor &norm_weight, float eps, const QuantMatrix &weight,
                               const Tensor &bias = Tensor(), bool swiglu = false);
// Whether add_rms_norm_quant_linear runs as one kernel for rows x cols of dtype on device (given 16-byte
// aligned operands, as fresh tensors are): CUDA, a 2-byte dtype, rows <= kQuantGemvMaxRows and a width
// whose add_rms_norm the GEMV reproduces (cols / 8 in [1, 32] or (64, 256]: every Qwen2 up to 3B).
bool add_rms_norm_quant_linear_fused(DType dtype, Device device, int64_t rows, int64_t cols);
// Whether CUDA's quant_linear and quant_linear_swiglu run the tensor-core GEMM over a weight of `format` for
// `rows` rows of x of dtype on device (given x rows 16-byte aligned, as fresh tensors are): a K-quant
// (Q4_K, Q5_K, Q6_K), a 2-byte dtype, kQuantGemvMaxRows < rows <= the limit above. No dense copy is made
// then, so a model passes no decode buffer (models::linear).
bool quant_linear_tc(DType dtype, Device device, int64_t rows, QuantFormat format);
} // namespace ops

} // namespace llaisys
