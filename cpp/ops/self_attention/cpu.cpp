#include "ops/self_attention/self_attention.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace llaisys::ops::cpu {

namespace {

constexpr int64_t kQueryBlock = 8; // queries of one work item (times its heads: rows sharing a K/V tile)
constexpr int64_t kKeyTile = 64;    // keys converted to f32 at a time

// n elements of a row -> f32. f16 is decoded inline (the shared to_float(f16_t) is an out-of-line
// call per element): shift exponent+mantissa into f32 position, rescale by 2^112 (which also
// normalises subnormals), restore Inf/NaN and the sign.
inline float half_bits_to_float(uint16_t h) {
    uint32_t u = uint32_t(h & 0x7fffu) << 13;
    float f;
    std::memcpy(&f, &u, 4);
    f *= 0x1p112f;
    std::memcpy(&u, &f, 4);
    if ((h & 0x7c00u) == 0x7c00u) u |= 0x7f800000u;
    u |= uint32_t(h & 0x8000u) << 16;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void row_to_f32(const float *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i]; // rows are short: a loop beats a memcpy call
}
inline void row_to_f32(const bf16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}
inline void row_to_f32(const f16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = half_bits_to_float(src[i].bits);
}

// Strided [seq, heads, dim] operand with a unit last stride.
template <typename T>
struct Rows {
    const T *data;
    int64_t s_seq, s_head;
    const T *row(int64_t i, int64_t h) const { return data + i * s_seq + h * s_head; }
};

// Online-softmax state of one query row: running max m, running sum l, unnormalised output acc.
struct RowState {
    float m = -std::numeric_limits<float>::infinity();
    float l = 0.f;
    float *acc; // [hd_v]
};

constexpr int64_t kLanes = 32; // floats a register-blocked loop keeps in registers (4 AVX2 vectors)

// scores[c] = q . k_c for c < n (rounded up to kLanes; kT has kKeyTile columns). The kLanes partial
// sums stay in registers over the whole d loop instead of being loaded and stored per d.
void tile_scores(const float *q, const float *kT, int64_t n, int64_t hd, float *scores) {
    for (int64_t c0 = 0; c0 < n; c0 += kLanes) {
        float s[kLanes] = {};
        for (int64_t d = 0; d < hd; ++d) {
            const float qd = q[d], *kd = kT + d * kKeyTile + c0;
            for (int64_t c = 0; c < kLanes; ++c) s[c] += qd * kd[c];
        }
        std::copy(s, s + kLanes, scores + c0);
    }
}

// acc [hd_v] += sum_c p[c] * v[c, :] for c < n; register-blocked over kLanes output dims.
void tile_pv(float *acc, const float *p, const float *v, int64_t n, int64_t hd_v) {
    int64_t d0 = 0;
    for (; d0 + kLanes <= hd_v; d0 += kLanes) {
        float a[kLanes];
        std::copy(acc + d0, acc + d0 + kLanes, a);
        for (int64_t c = 0; c < n; ++c) {
            const float pc = p[c], *vc = v + c * hd_v + d0;
            for (int64_t d = 0; d < kLanes; ++d) a[d] += pc * vc[d];
        }
        std::copy(a, a + kLanes, acc + d0);
    }
    for (int64_t c = 0; c < n; ++c) // the hd_v % kLanes tail
        for (int64_t d = d0; d < hd_v; ++d) acc[d] += p[c] * v[c * hd_v + d];
}

// Folds keys [0, n) of a converted tile into one row's state. q is pre-scaled; kT [hd, kKeyTile]
// (transposed so that the scores of many keys accumulate in one vectorised loop), v [n, hd_v].
void fold_tile(RowState &st, const float *q, const float *kT, const float *v, int64_t n, int64_t hd,
               int64_t hd_v, float *scores) {
    tile_scores(q, kT, n, hd, scores);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < n; ++c) mx = std::max(mx, scores[c]); // skips a NaN score; the sum keeps it
    const float m_new = std::max(st.m, mx);
    const float m_ref = m_new == -std::numeric_limits<float>::infinity() ? 0.f : m_new;
    const float corr = std::exp(st.m - m_ref);
    st.l *= corr;
    for (int64_t d = 0; d < hd_v; ++d) st.acc[d] *= corr;
    for (int64_t c = 0; c < n; ++c) {
        scores[c] = std::exp(scores[c] - m_ref);
        st.l += scores[c];
    }
    tile_pv(st.acc, scores, v, n, hd_v);
    st.m = m_new;
}

template <typename T>
struct Problem {
    T *out; // [qlen, nh, hd_v], contiguous
    Rows<T> q, k, v;
    int64_t qlen, kvlen, nh, nkvh, hd, hd_v;
    float scale;
    int64_t group() const { return nh / nkvh; }
    int64_t offset() const { return kvlen - qlen; } // query i sees keys j <= i + offset()
};

// A work item: heads [h0, h1) of kv head kvh (one GQA group or a part of it) x queries [i0, i1).
struct Item {
    int64_t kvh, h0, h1, i0, i1;
};

// Converts keys [j0, j0 + n) of kv head kvh to f32: kT [hd, kKeyTile] (transposed), vt [n, hd_v].
template <typename T>
void load_tile(const Problem<T> &p, int64_t kvh, int64_t j0, int64_t n, float *kT, float *vt, float *krow) {
    for (int64_t c = 0; c < n; ++c) {
        row_to_f32(p.k.row(j0 + c, kvh), krow, p.hd);
        for (int64_t d = 0; d < p.hd; ++d) kT[d * kKeyTile + c] = krow[d];
        row_to_f32(p.v.row(j0 + c, kvh), vt + c * p.hd_v, p.hd_v);
    }
}

// Runs one item. Each K/V tile is converted once and shared by all of the item's rows (query, head);
// each row folds only the keys it may see.
template <typename T>
void attend_item(const Problem<T> &p, const Item &it) {
    const int64_t nhead = it.h1 - it.h0, rows = (it.i1 - it.i0) * nhead, hd = p.hd, hd_v = p.hd_v;
    const int64_t kv_end = it.i1 + p.offset(); // keys seen by the item's last query
    std::vector<float> buf(size_t(rows * (hd + hd_v) + kKeyTile * (hd + hd_v + 1) + hd));
    float *qs = buf.data(), *acc = qs + rows * hd, *kT = acc + rows * hd_v, *vt = kT + kKeyTile * hd,
          *scores = vt + kKeyTile * hd_v, *krow = scores + kKeyTile;
    std::vector<RowState> st(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) { // row r = (query i0 + r / nhead, head h0 + r % nhead)
        row_to_f32(p.q.row(it.i0 + r / nhead, it.h0 + r % nhead), qs + r * hd, hd);
        for (int64_t d = 0; d < hd; ++d) qs[r * hd + d] *= p.scale;
        st[r].acc = acc + r * hd_v;
    }
    for (int64_t j0 = 0; j0 < kv_end; j0 += kKeyTile) {
        const int64_t n = std::min(kKeyTile, kv_end - j0);
        load_tile(p, it.kvh, j0, n, kT, vt, krow);
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t visible = std::min(n, it.i0 + r / nhead + p.offset() + 1 - j0);
            if (visible > 0) fold_tile(st[r], qs + r * hd, kT, vt, visible, hd, hd_v, scores);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        T *o = p.out + ((it.i0 + r / nhead) * p.nh + it.h0 + r % nhead) * hd_v;
        const float inv = 1.f / st[r].l;
        for (int64_t d = 0; d < hd_v; ++d) store(o, d, st[r].acc[d] * inv);
    }
}

// Items are (kv head, head chunk, query block). A GQA group is split into head chunks only when
// there are too few items to keep the threads busy (decode); otherwise each K/V tile is converted
// once per group, which is what bounds decode (memory) and short prefill (conversion).
template <typename T>
void attention_kernel(const Problem<T> &p) {
    const int64_t nqb = (p.qlen + kQueryBlock - 1) / kQueryBlock, group = p.group();
    const int64_t want = 2 * int64_t(max_threads()), base = p.nkvh * nqb;
    const int64_t heads_per_item = (group + std::min(group, (want + base - 1) / base) - 1) /
                                   std::min(group, (want + base - 1) / base);
    const int64_t hsplit = (group + heads_per_item - 1) / heads_per_item, items = base * hsplit;
    // Later query blocks see more keys: items are claimed heaviest first.
    run_tasks(items, p.qlen * p.kvlen * p.nh * p.hd >= (1 << 16), [&](int64_t n) {
        const int64_t b = nqb - 1 - n / (p.nkvh * hsplit), kvh = n / hsplit % p.nkvh, hc = n % hsplit;
        const int64_t h0 = kvh * group + hc * heads_per_item;
        const int64_t i0 = b * kQueryBlock;
        attend_item(p, Item{kvh, h0, std::min(h0 + heads_per_item, (kvh + 1) * group), i0,
                            std::min(p.qlen, i0 + kQueryBlock)});
    });
}

template <typename T>
Rows<T> rows_of(const Tensor &t) {
    return {t.data_as<T>(), t.stride(0), t.stride(1)};
}

} // namespace

void self_attention(const Tensor &out, const Tensor &q, const Tensor &k, const Tensor &v, float scale) {
    detail::dispatch_float("self_attention", q.dtype(), q.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        attention_kernel(Problem<T>{out.data_as<T>(), rows_of<T>(q), rows_of<T>(k), rows_of<T>(v), q.size(0),
                                    k.size(0), q.size(1), k.size(1), q.size(2), v.size(2), scale});
    });
}

} // namespace llaisys::ops::cpu
