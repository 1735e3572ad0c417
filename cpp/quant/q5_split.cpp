// Q5_0 rows between the file's blocks and QuantLayout::Q5Split (quant/formats.hpp says where each byte goes).
#include "quant/formats.hpp"

#include <cstring>

namespace llaisys::quant {

namespace {
uint32_t qh_of(const uint8_t *file_row, int64_t b) {
    uint32_t h;
    std::memcpy(&h, reinterpret_cast<const BlockQ5_0 *>(file_row)[b].qh, 4);
    return h;
}
} // namespace

void q5_split_row(const uint8_t *file_row, int64_t nb, uint8_t *split_row) {
    const auto *blocks = reinterpret_cast<const BlockQ5_0 *>(file_row);
    uint8_t *d = split_row, *qh = split_row + 2 * nb, *qs = split_row + 6 * nb;
    for (int64_t b = 0; b < nb; ++b) {
        std::memcpy(d + 2 * b, &blocks[b].d, 2);
        std::memcpy(qs + 16 * b, blocks[b].qs, 16);
    }
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint32_t h0 = qh_of(file_row, b), h1 = qh_of(file_row, b + 1);
        uint64_t pair = 0;
        for (int j = 0; j < kQK; ++j) {
            pair |= uint64_t((h0 >> j) & 1) << q5_split_bit(j, false);
            pair |= uint64_t((h1 >> j) & 1) << q5_split_bit(j, true);
        }
        std::memcpy(qh + 4 * b, &pair, 8);
    }
    if (b < nb) std::memcpy(qh + 4 * b, blocks[b].qh, 4); // the last of an odd count: as in the file
}

void q5_unsplit_row(const uint8_t *split_row, int64_t nb, uint8_t *file_row) {
    auto *blocks = reinterpret_cast<BlockQ5_0 *>(file_row);
    const uint8_t *d = split_row, *qh = split_row + 2 * nb, *qs = split_row + 6 * nb;
    for (int64_t b = 0; b < nb; ++b) {
        std::memcpy(&blocks[b].d, d + 2 * b, 2);
        std::memcpy(blocks[b].qs, qs + 16 * b, 16);
    }
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        uint64_t pair;
        std::memcpy(&pair, qh + 4 * b, 8);
        uint32_t h0 = 0, h1 = 0;
        for (int j = 0; j < kQK; ++j) {
            h0 |= uint32_t((pair >> q5_split_bit(j, false)) & 1) << j;
            h1 |= uint32_t((pair >> q5_split_bit(j, true)) & 1) << j;
        }
        std::memcpy(blocks[b].qh, &h0, 4);
        std::memcpy(blocks[b + 1].qh, &h1, 4);
    }
    if (b < nb) std::memcpy(blocks[b].qh, qh + 4 * b, 4);
}

} // namespace llaisys::quant
