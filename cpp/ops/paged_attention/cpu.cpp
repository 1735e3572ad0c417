#include "ops/paged_attention/paged_attention.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"
#include "ops/common/vexp.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

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

// a * b + c rounded once where the build has FMA (as the vectorised loops below compute it), else twice.
inline float madd(float a, float b, float c) {
#if defined(__FMA__)
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
}

// The two sums of a tile, each element summed in the same order as a plain loop would (scores over d, the
// output over keys), with the running sums in registers: summed through memory, each step of a row waited
// for the previous step's store (FMA + store-forwarding latency per key).

// The scores and values of R rows that see the same keys of a tile (R = 4: the heads of one query, GQA): each
// key row, value row and kT line is loaded once for all of them in the 16-wide loops; each row's sums are in the
// order and with the operations of the one-row case (its bits), and the narrower loops after them run a row at
// a time.

// scores[r][c] = q[r] . kT[:, c] for c < n, each over d in order.
template <int R>
void tile_scores(const float *const (&q)[R], const float *kT, int64_t n, int64_t hd, float *const (&scores)[R]) {
    int64_t c0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; c0 + 16 <= n; c0 += 16) {
        __m256 s[R][2];
        for (auto &r : s) r[0] = r[1] = _mm256_setzero_ps();
        for (int64_t d = 0; d < hd; ++d) {
            const float *kd = kT + d * kKeyTile + c0;
            const __m256 k0 = _mm256_loadu_ps(kd), k1 = _mm256_loadu_ps(kd + 8);
            for (int r = 0; r < R; ++r) {
                const __m256 qd = _mm256_broadcast_ss(q[r] + d);
                s[r][0] = _mm256_fmadd_ps(qd, k0, s[r][0]);
                s[r][1] = _mm256_fmadd_ps(qd, k1, s[r][1]);
            }
        }
        for (int r = 0; r < R; ++r) {
            _mm256_storeu_ps(scores[r] + c0, s[r][0]);
            _mm256_storeu_ps(scores[r] + c0 + 8, s[r][1]);
        }
    }
#endif
    for (int r = 0; r < R; ++r) {
        int64_t c = c0;
#if defined(__AVX2__) && defined(__FMA__)
        // 8 keys at a time, the last 1-7 too (each lane's sum is the scalar loop's): there the lanes past n read
        // what follows them in the scratch (kT's next line, or vt: never past attend_item's buffer) and are dropped
        for (; c < n; c += 8) {
            __m256 s = _mm256_setzero_ps();
            for (int64_t d = 0; d < hd; ++d)
                s = _mm256_fmadd_ps(_mm256_broadcast_ss(q[r] + d), _mm256_loadu_ps(kT + d * kKeyTile + c), s);
            if (c + 8 <= n) {
                _mm256_storeu_ps(scores[r] + c, s);
            } else {
                alignas(32) float t[8];
                _mm256_store_ps(t, s);
                for (int64_t k = c; k < n; ++k) scores[r][k] = t[k - c];
            }
        }
#endif
        for (; c < n; ++c) {
            float s = 0.f;
            for (int64_t d = 0; d < hd; ++d) s = madd(q[r][d], kT[d * kKeyTile + c], s);
            scores[r][c] = s;
        }
    }
}

// acc[r][d] += p[r][c] * v[c][d] for c < n, each over c in key order (v[c]: key c's row [hd]).
template <int R>
void tile_values(float *const (&acc)[R], const float *const (&p)[R], const float *const *v, int64_t n, int64_t hd) {
    int64_t d0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; d0 + 16 <= hd; d0 += 16) {
        __m256 a[R][2];
        for (int r = 0; r < R; ++r) a[r][0] = _mm256_loadu_ps(acc[r] + d0), a[r][1] = _mm256_loadu_ps(acc[r] + d0 + 8);
        for (int64_t c = 0; c < n; ++c) {
            const __m256 v0 = _mm256_loadu_ps(v[c] + d0), v1 = _mm256_loadu_ps(v[c] + d0 + 8);
            for (int r = 0; r < R; ++r) {
                const __m256 pc = _mm256_broadcast_ss(p[r] + c);
                a[r][0] = _mm256_fmadd_ps(pc, v0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(pc, v1, a[r][1]);
            }
        }
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc[r] + d0, a[r][0]), _mm256_storeu_ps(acc[r] + d0 + 8, a[r][1]);
    }
#endif
    for (int r = 0; r < R; ++r) {
        int64_t d = d0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; d + 8 <= hd; d += 8) {
            __m256 a = _mm256_loadu_ps(acc[r] + d);
            for (int64_t c = 0; c < n; ++c) a = _mm256_fmadd_ps(_mm256_broadcast_ss(p[r] + c), _mm256_loadu_ps(v[c] + d), a);
            _mm256_storeu_ps(acc[r] + d, a);
        }
#endif
        for (; d < hd; ++d) {
            float a = acc[r][d];
            for (int64_t c = 0; c < n; ++c) a = madd(p[r][c], v[c][d], a);
            acc[r][d] = a;
        }
    }
}

constexpr int kRows = 4;

// A row's online-softmax update from its tile scores: the new max, the old state rescaled, the scores turned
// into weights (in place) and summed in key order.
void fold_scores(RowState &st, float *scores, int64_t n, int64_t hd) {
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
    for (int64_t c = 0; c < n; ++c) st.l += scores[c];
    st.m = m_new;
}

// fold_tile for kRows rows st[0..kRows) (q rows hd apart) that see the same n keys; scores [kRows][kKeyTile].
void fold_tile_rows(RowState *st, const float *q, const float *kT, const float *const *v, int64_t n, int64_t hd,
                    float *scores) {
    const float *const qs[kRows] = {q, q + hd, q + 2 * hd, q + 3 * hd};
    float *const sc[kRows] = {scores, scores + kKeyTile, scores + 2 * kKeyTile, scores + 3 * kKeyTile};
    tile_scores<kRows>(qs, kT, n, hd, sc);
    for (int r = 0; r < kRows; ++r) fold_scores(st[r], sc[r], n, hd);
    float *const acc[kRows] = {st[0].acc, st[1].acc, st[2].acc, st[3].acc};
    const float *const p[kRows] = {sc[0], sc[1], sc[2], sc[3]};
    tile_values<kRows>(acc, p, v, n, hd);
}

// Folds the first n keys of a gathered tile into a row's state. q [hd] is pre-scaled, kT [hd, kKeyTile]
// (transposed: one vectorised loop accumulates the scores of many keys), v [n] the keys' value rows [hd].
void fold_tile(RowState &st, const float *q, const float *kT, const float *const *v, int64_t n, int64_t hd,
               float *scores) {
    const float *const qs[1] = {q};
    float *const sc[1] = {scores};
    tile_scores<1>(qs, kT, n, hd, sc);
    fold_scores(st, scores, n, hd);
    float *const acc[1] = {st.acc};
    const float *const p[1] = {scores};
    tile_values<1>(acc, p, v, n, hd);
}

// A work item: queries [i0, i1) of sequence b with the heads of kv head kvh.
struct Item {
    int64_t b, kvh, i0, i1;
};

// kT[d * kKeyTile + r] = k[r * row + d] for r < keys, d < hd: keys (rows `row` elements apart) transposed,
// 8 x 8 at a time in registers where f32 allows (scalar stores 16 floats apart cost most of a decode
// row's gather).
template <typename T>
void transpose_keys(const T *k, int64_t row, int64_t keys, int64_t hd, float *kT) {
    int64_t r0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (std::is_same_v<T, float>)
        if (hd % 8 == 0)
            for (; r0 + 8 <= keys; r0 += 8)
                for (int64_t d0 = 0; d0 < hd; d0 += 8) {
                    __m256 r[8], t[8];
                    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(k + (r0 + i) * row + d0);
                    for (int i = 0; i < 8; i += 2) {
                        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
                    }
                    for (int i = 0; i < 8; i += 4) {
                        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
                        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
                        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
                        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
                    }
                    for (int i = 0; i < 4; ++i) { // column d0 + i in the low halves, d0 + 4 + i in the high
                        _mm256_storeu_ps(kT + (d0 + i) * kKeyTile + r0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
                        _mm256_storeu_ps(kT + (d0 + 4 + i) * kKeyTile + r0, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
                    }
                }
#endif
    for (; r0 < keys; ++r0)
        for (int64_t d = 0; d < hd; ++d) kT[d * kKeyTile + r0] = load(k + r0 * row, d);
}

// Keys [j0, j0 + n) of the item's sequence: kT [hd, kKeyTile] (transposed, f32) and each key's value row
// vrows[c] (the cache's own row for f32, else converted into vt [n, hd]). One block-table lookup per run of
// keys inside a block (a division per key cost as much as a decode row's arithmetic at head_dim 16).
template <typename T>
void gather_tile(const Paged<T> &p, const Item &it, int64_t j0, int64_t n, float *kT, float *vt,
                 const float **vrows) {
    const int64_t hd = p.hd, row = p.nkvh * hd; // a cache row holds every kv head of one position
    for (int64_t c = 0; c < n;) {
        const int64_t j = j0 + c, run = std::min(n - c, p.block_size - j % p.block_size);
        const int64_t o = p.kv_offset(it.b, j, it.kvh);
        transpose_keys(p.k + o, row, run, hd, kT + c);
        const T *v = p.v + o;
        for (int64_t r = 0; r < run; ++r, ++c, v += row) {
            if constexpr (std::is_same_v<T, float>) {
                vrows[c] = v;
            } else {
                for (int64_t d = 0; d < hd; ++d) vt[c * hd + d] = load(v, d);
                vrows[c] = vt + c * hd;
            }
        }
    }
}

// An item's working memory, kept per thread: a decode batch runs B * nkvh items, and two heap allocations
// per item cost about as much as its arithmetic at small head dims.
struct Scratch {
    std::vector<float> buf;
    std::vector<RowState> st;
    const float *vrows[kKeyTile];
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
    static thread_local Scratch scratch;
    const size_t need = size_t(2 * rows * hd + 2 * kKeyTile * hd + kRows * kKeyTile);
    if (scratch.buf.size() < need) scratch.buf.resize(need);
    if (scratch.st.size() < size_t(rows)) scratch.st.resize(size_t(rows));
    float *qs = scratch.buf.data(), *acc = qs + rows * hd, *kT = acc + rows * hd, *vt = kT + kKeyTile * hd,
          *scores = vt + kKeyTile * hd;
    std::fill(acc, acc + rows * hd, 0.f);
    RowState *st = scratch.st.data(); // row r = (query i0 + r / group, head kvh * group + r % group)
    for (int64_t r = 0; r < rows; ++r) {
        const T *src = p.q + (row0 + r / group) * p.q_s0 + (it.kvh * group + r % group) * p.q_s1;
        for (int64_t d = 0; d < hd; ++d) qs[r * hd + d] = load(src, d) * p.scale;
        st[r] = RowState{};
        st[r].acc = acc + r * hd;
    }
    for (int64_t j0 = first_key(it.i0); j0 < kv_end; j0 += kKeyTile) {
        const int64_t n = std::min(kKeyTile, kv_end - j0);
        gather_tile(p, it, j0, n, kT, vt, scratch.vrows);
        for (int64_t r = 0; r < rows;) { // the row sees the tile's keys [c0, visible); the heads of one query alike
            const int64_t i = it.i0 + r / group, visible = std::min(n, i + off + 1 - j0);
            const int64_t c0 = std::max<int64_t>(0, first_key(i) - j0);
            const int64_t take = r % group + kRows <= group ? kRows : 1;
            if (visible > c0 && take == kRows)
                fold_tile_rows(st + r, qs + r * hd, kT + c0, scratch.vrows + c0, visible - c0, hd, scores);
            else if (visible > c0)
                fold_tile(st[r], qs + r * hd, kT + c0, scratch.vrows + c0, visible - c0, hd, scores);
            r += take;
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        T *dst = p.out + (row0 + r / group) * p.o_s0 + (it.kvh * group + r % group) * p.o_s1;
        const float inv = 1.f / st[r].l;
        for (int64_t d = 0; d < hd; ++d) store(dst, d, st[r].acc[d] * inv);
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
