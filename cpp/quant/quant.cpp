// Format traits, the QuantMatrix container and the reference (host) dequantization.
#include "llaisys/quant.hpp"

#include "quant/formats.hpp"

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

namespace llaisys {

namespace {
constexpr QuantFormatInfo kInfo[] = {
    // name, block elements, block bytes, GGML type id
    {"q4_0", quant::kQK, sizeof(quant::BlockQ4_0), 2},     {"q4_k", quant::kQK_K, sizeof(quant::BlockQ4_K), 12},
    {"q5_0", quant::kQK, sizeof(quant::BlockQ5_0), 6},     {"q5_k", quant::kQK_K, sizeof(quant::BlockQ5_K), 13},
    {"q6_k", quant::kQK_K, sizeof(quant::BlockQ6_K), 14}, {"q8_0", quant::kQK, sizeof(quant::BlockQ8_0), 8},
};
constexpr QuantFormat kAll[] = {QuantFormat::Q4_0, QuantFormat::Q4_K, QuantFormat::Q5_0,
                                QuantFormat::Q5_K, QuantFormat::Q6_K, QuantFormat::Q8_0};
} // namespace

const QuantFormatInfo &quant_format_info(QuantFormat format) { return kInfo[int(format)]; }

QuantFormat quant_format_from_name(const std::string &name) {
    std::string lower = name;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    for (QuantFormat f : kAll)
        if (lower == quant_format_info(f).name) return f;
    throw std::invalid_argument("unknown quantized format '" + name + "' (expected q4_0, q4_k, q5_0, q5_k, q6_k or q8_0)");
}

QuantFormat quant_format_from_gguf(int gguf_type) {
    for (QuantFormat f : kAll)
        if (quant_format_info(f).gguf_type == gguf_type) return f;
    throw std::invalid_argument(detail::concat("GGML type ", gguf_type,
                                               " is not a quantized format llaisys reads (Q4_0, Q4_K, Q5_0, Q5_K, "
                                               "Q6_K, Q8_0)"));
}

int64_t quant_row_bytes(QuantFormat format, int64_t cols) {
    const QuantFormatInfo &f = quant_format_info(format);
    LLAISYS_CHECK(cols > 0 && cols % f.block_elems == 0, std::invalid_argument, "QuantMatrix: ", f.name,
                  " rows hold blocks of ", f.block_elems, " weights, so cols must be a positive multiple of ",
                  f.block_elems, ", got ", cols);
    return cols / f.block_elems * f.block_bytes;
}

QuantMatrix::QuantMatrix(QuantFormat format, int64_t rows, int64_t cols, Tensor bytes, QuantLayout layout)
    : layout_(layout), format_(format), rows_(rows), cols_(cols), bytes_(std::move(bytes)) {
    const int64_t rb = quant_row_bytes(format, cols);
    LLAISYS_CHECK(rows >= 0, std::invalid_argument, "QuantMatrix: rows must be >= 0, got ", rows);
    LLAISYS_CHECK(bytes_.defined() && bytes_.dtype() == DType::U8, TypeError, "QuantMatrix: bytes must be a u8 tensor");
    LLAISYS_CHECK(bytes_.shape() == Shape({rows, rb}) && bytes_.is_contiguous(), std::invalid_argument,
                  "QuantMatrix: ", quant_format_info(format).name, " [", rows, ", ", cols,
                  "] needs contiguous bytes of shape ", shape_str({rows, rb}), ", got ", shape_str(bytes_.shape()),
                  bytes_.is_contiguous() ? "" : " (not contiguous)");
    LLAISYS_CHECK(layout == QuantLayout::File || (format == QuantFormat::Q5_0 && bytes_.device().is_cpu()),
                  std::invalid_argument, "QuantMatrix: the split layout is for Q5_0 in host memory, not ",
                  quant_format_info(format).name, " on ", bytes_.device().str());
}

QuantMatrix QuantMatrix::concat_rows(const std::vector<QuantMatrix> &parts) {
    LLAISYS_CHECK(!parts.empty(), std::invalid_argument, "QuantMatrix::concat_rows: no parts");
    const QuantMatrix &first = parts.front();
    int64_t rows = 0;
    for (const QuantMatrix &p : parts) {
        LLAISYS_CHECK(p.defined() && p.format() == first.format() && p.cols() == first.cols() &&
                          p.device() == first.device() && p.layout() == first.layout(),
                      std::invalid_argument, "QuantMatrix::concat_rows: parts must share format, cols, layout and device (",
                      quant_format_info(first.format()).name, " x ", first.cols(), " on ", first.device().str(),
                      "), got ", quant_format_info(p.format()).name, " x ", p.cols(), " on ", p.device().str());
        rows += p.rows();
    }
    Tensor bytes = Tensor::empty({rows, first.row_bytes()}, DType::U8, first.device());
    int64_t r = 0;
    for (const QuantMatrix &p : parts) {
        bytes.slice(0, r, r + p.rows()).copy_(p.bytes());
        r += p.rows();
    }
    return QuantMatrix(first.format(), rows, first.cols(), bytes, first.layout());
}

QuantMatrix QuantMatrix::slice_rows(int64_t start, int64_t end) const {
    LLAISYS_CHECK(0 <= start && start <= end && end <= rows_, std::out_of_range, "QuantMatrix::slice_rows: [", start,
                  ", ", end, ") is outside the ", rows_, " rows");
    return QuantMatrix(format_, end - start, cols_, bytes_.slice(0, start, end), layout_);
}

QuantMatrix QuantMatrix::to(Device device) const {
    if (device == this->device()) return *this;
    const QuantMatrix file = with_layout(QuantLayout::File); // only the host reads the split layout
    return QuantMatrix(format_, rows_, cols_, file.bytes_.to(device));
}

QuantMatrix QuantMatrix::with_layout(QuantLayout layout) const {
    if (layout == layout_) return *this;
    LLAISYS_CHECK(defined() && format_ == QuantFormat::Q5_0 && device().is_cpu(), std::invalid_argument,
                  "QuantMatrix.with_layout: only a Q5_0 matrix in host memory has a split layout, this is ",
                  quant_format_info(format_).name, defined() ? " on " + device().str() : std::string(" undefined"));
    Tensor out = Tensor::empty({rows_, row_bytes()}, DType::U8, device());
    const int64_t nb = cols_ / quant::kQK, rb = row_bytes();
    uint8_t *o = out.data_as<uint8_t>();
    for (int64_t r = 0; r < rows_; ++r) {
        if (layout == QuantLayout::Q5Split) quant::q5_split_row(row(r), nb, o + r * rb);
        else quant::q5_unsplit_row(row(r), nb, o + r * rb);
    }
    return QuantMatrix(format_, rows_, cols_, out, layout);
}

// ---- Reference decoding: one block into `out` [block elems], the f32 operations of gguf-py's
// dequantize in the same order. Every product of d (an f16), a 6- or 8-bit scale and a 4- or 5-bit q is
// exact in f32, so only Q4_K/Q5_K's subtraction and Q6_K's second product round, as they do there.
namespace {
using namespace quant;

void decode(const BlockQ4_0 &b, float *out) {
    const float d = to_float(b.d);
    for (int j = 0; j < kQK / 2; ++j) {
        out[j] = d * float((b.qs[j] & 0x0F) - 8);
        out[j + kQK / 2] = d * float((b.qs[j] >> 4) - 8);
    }
}

void decode(const BlockQ5_0 &b, float *out) {
    const float d = to_float(b.d);
    const uint32_t qh = uint32_t(b.qh[0]) | uint32_t(b.qh[1]) << 8 | uint32_t(b.qh[2]) << 16 | uint32_t(b.qh[3]) << 24;
    for (int j = 0; j < kQK / 2; ++j) {
        const int lo = (b.qs[j] & 0x0F) | int((qh >> j) & 1) << 4;
        const int hi = (b.qs[j] >> 4) | int((qh >> (j + 16)) & 1) << 4;
        out[j] = d * float(lo - 16);
        out[j + kQK / 2] = d * float(hi - 16);
    }
}

void decode(const BlockQ8_0 &b, float *out) {
    const float d = to_float(b.d);
    for (int j = 0; j < kQK; ++j) out[j] = float(b.qs[j]) * d;
}

// Q4_K and Q5_K: qh is null for Q4_K.
void decode_k(f16_t d16, f16_t dmin16, const uint8_t *scales, const uint8_t *qh, const uint8_t *qs, float *out) {
    const float d = to_float(d16), dmin = to_float(dmin16);
    for (int s = 0; s < 8; ++s) {
        uint8_t sc, m;
        scale_min_k4(scales, s, sc, m);
        const float dl = d * float(sc), ml = dmin * float(m);
        const uint8_t *q = qs + 32 * (s / 2);
        for (int l = 0; l < 32; ++l) {
            int v = (s % 2 ? q[l] >> 4 : q[l] & 0x0F);
            if (qh) v |= ((qh[l] >> s) & 1) << 4;
            out[32 * s + l] = dl * float(v) - ml;
        }
    }
}
void decode(const BlockQ4_K &b, float *out) { decode_k(b.d, b.dmin, b.scales, nullptr, b.qs, out); }
void decode(const BlockQ5_K &b, float *out) { decode_k(b.d, b.dmin, b.scales, b.qh, b.qs, out); }

void decode(const BlockQ6_K &b, float *out) {
    const float d = to_float(b.d);
    for (int e = 0; e < kQK_K; ++e) {
        const int h = e / 128, r = e % 128;
        const int lo = (b.ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
        const int hi = (b.qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
        out[e] = (d * float(b.scales[e / 16])) * float((lo | hi << 4) - 32);
    }
}

template <class Block>
void decode_row(const uint8_t *row, int64_t nblocks, float *out, int block_elems) {
    const Block *b = reinterpret_cast<const Block *>(row);
    for (int64_t i = 0; i < nblocks; ++i) decode(b[i], out + i * block_elems);
}
} // namespace

void dequantize_rows(const QuantMatrix &m, int64_t row0, int64_t n, float *out) {
    LLAISYS_CHECK(m.defined() && m.device().is_cpu(), std::invalid_argument,
                  "dequantize_rows: the matrix must be in host memory");
    LLAISYS_CHECK(0 <= row0 && n >= 0 && row0 + n <= m.rows(), std::out_of_range, "dequantize_rows: rows [", row0,
                  ", ", row0 + n, ") are outside the ", m.rows(), " rows");
    const int be = quant_format_info(m.format()).block_elems;
    const int64_t nb = m.cols() / be;
    std::vector<uint8_t> file_row(m.layout() == QuantLayout::File ? 0 : size_t(m.row_bytes()));
    for (int64_t r = 0; r < n; ++r) {
        const uint8_t *row = m.row(row0 + r);
        if (!file_row.empty()) quant::q5_unsplit_row(row, nb, file_row.data()), row = file_row.data();
        float *o = out + r * m.cols();
        switch (m.format()) {
        case QuantFormat::Q4_0: decode_row<BlockQ4_0>(row, nb, o, be); break;
        case QuantFormat::Q4_K: decode_row<BlockQ4_K>(row, nb, o, be); break;
        case QuantFormat::Q5_0: decode_row<BlockQ5_0>(row, nb, o, be); break;
        case QuantFormat::Q5_K: decode_row<BlockQ5_K>(row, nb, o, be); break;
        case QuantFormat::Q6_K: decode_row<BlockQ6_K>(row, nb, o, be); break;
        case QuantFormat::Q8_0: decode_row<BlockQ8_0>(row, nb, o, be); break;
        }
    }
}

} // namespace llaisys
