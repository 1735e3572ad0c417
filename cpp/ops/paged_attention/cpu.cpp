#include "ops/paged_attention/paged_attention.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"
#include "ops/common/vexp.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace llaisys::ops::cpu {

namespace {

constexpr int64_t kQueryBlock = 8; // queries of one work item; with their GQA heads they share each K/V tile
constexpr int64_t kKeyTile = 64;   // keys gathered from the blocks and converted to f32 at a time

template <typename T>
struct Paged {
    T *out;             // [T, nh, hd], strides (o_s0, o_s1, 1)
    const T *q;         // [T, nh, hd], strides (q_s0, q_s1, 1)
    const T *k, *v;     // [num_blocks, block_size, nkvh, hd], contiguous
    const int32_t *tables, *q_start, *kv_len; // [B, max_blocks], [B + 1], [B]
    int64_t o_s0, o_s1, q_s0, q_s1, max_blocks, block_size, nh, nkvh, hd;
    int64_t window; // > 0: the query at position p sees keys (p - window, p]; 0: all keys <= p
    float scale;
    int64_t group() const { return nh / nkvh; }
    int64_t qlen(int64_t b) const { return q_start[b + 1] - q_start[b]; }
    // Offset of key j of sequence b, kv head kvh, in k and v: its block from the table, then its row.
    int64_t kv_offset(int64_t b, int64_t j, int64_t kvh) const {
        const int64_t slot = int64_t(tables[b * max_blocks + j / block_size]) * block_size + j % block_size;
        return (slot * nkvh + kvh) * hd;
    }
};

// Every metadata rule of ops.hpp, checked before anything is written. With a window, only the table
// entries of blocks holding a key some query sees.
void check_batch(const int32_t *tables, const int32_t *q_start, const int32_t *kv_len, int64_t B,
                 int64_t max_blocks, int64_t num_blocks, int64_t block_size, int64_t tokens, int64_t max_q_len,
                 int64_t window) {
    constexpr const char *op = "paged_attention";
    for (int64_t b = 0; b < B; ++b) {
        const int64_t qs = q_start[b], qe = q_start[b + 1], qlen = qe - qs, kv = kv_len[b];
        LLAISYS_CHECK(qs >= 0 && qs <= qe && qe <= tokens, std::invalid_argument, op, ": sequence ", b,
                      " has query rows [", qs, ", ", qe, "): q_start must be non-decreasing within [0, ", tokens,
                      "]");
        LLAISYS_CHECK(qlen <= max_q_len, std::invalid_argument, op, ": sequence ", b, " has ", qlen,
                      " queries, more than max_q_len = ", max_q_len);
        LLAISYS_CHECK(kv >= qlen && kv <= max_blocks * block_size, std::out_of_range, op, ": kv_len[", b, "] = ", kv,
                      " is out of range [", qlen, ", ", max_blocks * block_size,
                      "] (its query count .. max_blocks * block_size)");
        const int64_t first = window > 0 ? std::max<int64_t>(0, kv - qlen - window + 1) : 0; // first key seen
        for (int64_t j = first / block_size; j * block_size < kv; ++j) {
            const int64_t id = tables[b * max_blocks + j];
            LLAISYS_CHECK(id >= 0 && id < num_blocks, std::out_of_range, op, ": block_tables[", b, ", ", j, "] = ", id,
                          " is out of range [0, ", num_blocks, ")");
        }
    }
}

// Online-softmax state of one query row: running max m, running sum l, unnormalised output acc [hd].
struct RowState {
    float m = -std::numeric_limits<float>::infinity();
    float l = 0.f;
    float *acc;
};

// Folds the first n keys of a gathered tile into a row's state. q [hd] is pre-scaled, kT [hd, kKeyTile]
// (transposed: one vectorised loop accumulates the scores of many keys), v [n, hd].
void fold_tile(RowState &st, const float *q, const float *kT, const float *v, int64_t n, int64_t hd,
               float *scores) {
    std::fill(scores, scores + n, 0.f);
    for (int64_t d = 0; d < hd; ++d) {
        const float qd = q[d], *kd = kT + d * kKeyTile;
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) scores[c] += qd * kd[c];
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < n; ++c) mx = std::max(mx, scores[c]); // skips a NaN score; the sum keeps it
    const float m_new = std::max(st.m, mx);
    const float m_ref = m_new == -std::numeric_limits<float>::infinity() ? 0.f : m_new; // avoid -inf - -inf
    const float corr = exp_nonpositive(st.m - m_ref);
    st.l *= corr;
    for (int64_t d = 0; d < hd; ++d) st.acc[d] *= corr;
    // the tile's weights in one vectorised pass (vexp.hpp; a libm call per key kept it scalar), then summed
    // in key order as before
    for (int64_t c = 0; c < n; ++c) scores[c] = exp_nonpositive(scores[c] - m_ref);
    for (int64_t c = 0; c < n; ++c) {
        const float p = scores[c];
        st.l += p;
        const float *vc = v + c * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) st.acc[d] += p * vc[d];
    }
    st.m = m_new;
}

// A work item: queries [i0, i1) of sequence b with the heads of kv head kvh.
struct Item {
    int64_t b, kvh, i0, i1;
};

// Runs one item: each tile of the sequence's keys is gathered through the block table and converted
// once, then folded into every row (query, head) of the item for the keys that row may see. With a
// window, the tiles start at the first key the item's first query sees (keys before it are seen by none).
template <typename T>
void attend_item(const Paged<T> &p, const Item &it) {
    const int64_t group = p.group(), rows = (it.i1 - it.i0) * group, hd = p.hd;
    const int64_t off = p.kv_len[it.b] - p.qlen(it.b); // query i sees keys j <= i + off (and j > i + off - window)
    const int64_t kv_end = it.i1 + off, row0 = p.q_start[it.b] + it.i0;
    // first key query i sees
    const auto first_key = [&](int64_t i) { return p.window > 0 ? std::max<int64_t>(0, i + off - p.window + 1) : 0; };
    std::vector<float> buf(size_t(2 * rows * hd + 2 * kKeyTile * hd + kKeyTile));
    float *qs = buf.data(), *acc = qs + rows * hd, *kT = acc + rows * hd, *vt = kT + kKeyTile * hd,
          *scores = vt + kKeyTile * hd;
    std::vector<RowState> st(static_cast<size_t>(rows)); // row r = (query i0 + r / group, head kvh * group + r % group)
    for (int64_t r = 0; r < rows; ++r) {
        const T *src = p.q + (row0 + r / group) * p.q_s0 + (it.kvh * group + r % group) * p.q_s1;
        for (int64_t d = 0; d < hd; ++d) qs[r * hd + d] = load(src, d) * p.scale;
        st[size_t(r)].acc = acc + r * hd;
    }
    for (int64_t j0 = first_key(it.i0); j0 < kv_end; j0 += kKeyTile) {
        const int64_t n = std::min(kKeyTile, kv_end - j0);
        for (int64_t c = 0; c < n; ++c) {
            const int64_t o = p.kv_offset(it.b, j0 + c, it.kvh);
            for (int64_t d = 0; d < hd; ++d) {
                kT[d * kKeyTile + c] = load(p.k + o, d);
                vt[c * hd + d] = load(p.v + o, d);
            }
        }
        for (int64_t r = 0; r < rows; ++r) { // the row sees the tile's keys [c0, visible)
            const int64_t i = it.i0 + r / group, visible = std::min(n, i + off + 1 - j0);
            const int64_t c0 = std::max<int64_t>(0, first_key(i) - j0);
            if (visible > c0)
                fold_tile(st[size_t(r)], qs + r * hd, kT + c0, vt + c0 * hd, visible - c0, hd, scores);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        T *dst = p.out + (row0 + r / group) * p.o_s0 + (it.kvh * group + r % group) * p.o_s1;
        const float inv = 1.f / st[size_t(r)].l;
        for (int64_t d = 0; d < hd; ++d) store(dst, d, st[size_t(r)].acc[d] * inv);
    }
}

// Items are (sequence, query block, kv head); a decode batch has B * nkvh of them.
template <typename T>
void paged_kernel(const Paged<T> &p, int64_t B) {
    std::vector<Item> items;
    int64_t work = 0; // scores of all items, for parallel_for's threshold
    for (int64_t b = 0; b < B; ++b)
        for (int64_t i0 = 0; i0 < p.qlen(b); i0 += kQueryBlock)
            for (int64_t kvh = 0; kvh < p.nkvh; ++kvh) {
                items.push_back({b, kvh, i0, std::min(p.qlen(b), i0 + kQueryBlock)});
                const int64_t keys = p.window > 0 ? std::min<int64_t>(p.kv_len[b], p.window + kQueryBlock) : p.kv_len[b];
                work += (items.back().i1 - i0) * p.group() * keys * p.hd;
            }
    if (items.empty()) return;
    parallel_for(int64_t(items.size()), work / int64_t(items.size()),
                 [&](int64_t n) { attend_item(p, items[size_t(n)]); });
}

} // namespace

void paged_attention(const Tensor &out, const Tensor &q, const Tensor &k_cache, const Tensor &v_cache,
                     const Tensor &block_tables, const Tensor &q_start, const Tensor &kv_len, float scale,
                     int64_t max_q_len, int64_t window) {
    const int64_t B = block_tables.size(0), max_blocks = block_tables.size(1), block_size = k_cache.size(1);
    const int32_t *tables = block_tables.data_as<int32_t>(), *starts = q_start.data_as<int32_t>(),
                  *lens = kv_len.data_as<int32_t>();
    check_batch(tables, starts, lens, B, max_blocks, k_cache.size(0), block_size, q.size(0), max_q_len, window);
    detail::dispatch_float("paged_attention", q.dtype(), q.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const Paged<T> p{out.data_as<T>(), q.data_as<T>(), k_cache.data_as<T>(), v_cache.data_as<T>(), tables,
                         starts, lens, out.stride(0), out.stride(1), q.stride(0), q.stride(1), max_blocks,
                         block_size, q.size(1), k_cache.size(2), q.size(2), window, scale};
        paged_kernel(p, B);
    });
}

} // namespace llaisys::ops::cpu
