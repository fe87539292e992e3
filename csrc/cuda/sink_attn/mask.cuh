/*
 * sink_attn/mask.cuh: the mask policy of the sink-attention kernels, one interface with two
 * implementations (ncp.h, ncp_attn_mask):
 *   DocsMask   contiguous THD documents: row i sees keys [max(doc_start(i), i - window + 1), i];
 *   TableMask  per-row bounds from tables (CP): row i sees keys [row_lo[i], row_hi[i]].
 * Both bounds are non-decreasing in the row, so a block of rows [q0, q1] sees the one key range
 * [lo(q0), hi(q1)], a block of keys [k0, k1] is seen by one row range, and a (rows, keys) tile is
 * fully visible iff lo(q1) <= k0 and k1 <= hi(q0). Every kernel (portable and Hopper, forward and
 * backward) takes the policy as a template parameter and asks it only these questions:
 *   row(i, lo, hi)          bounds of row i, clamped to [0, Tk); rows past Tq: (kNoKey, -1)
 *   q_range(q0, bm, bn)     kv tiles of bn keys that rows [q0, q0 + bm) see, plus the facts of the
 *                           full-tile test (q_tile_range)
 *   rows_seeing(k0, k1)     the rows that see a key of [k0, k1] (q_tiles_seeing: as tiles)
 * Malformed inputs (cu_seqlens not monotone, tables out of range) give wrong values but never an
 * out-of-bounds index: every bound is clamped before use.
 */
#ifndef NCP_SINK_ATTN_MASK_CUH
#define NCP_SINK_ATTN_MASK_CUH

#include "common.cuh"

namespace ncp {

/* Rows [q0, q0 + bm) of q against kv tiles of bn keys: tiles [kt_lo, kt_hi] (kt_hi < kt_lo: none),
 * and hi(q0), lo(q_last) and whether the block has bm real rows, for full_cols(). */
struct q_tile_range {
    int kt_lo, kt_hi;
    int hi_first, lo_last, rows_complete;
};

/* Every (row, key) pair of keys [k0, k0 + n) visible to every row of the block? */
__device__ __forceinline__ bool full_cols(const q_tile_range &r, int k0, int n, int Tk) {
    const int k1 = k0 + n;
    return r.rows_complete && k1 <= Tk && k1 - 1 <= r.hi_first && k0 >= r.lo_last;
}

/* ---- documents ----------------------------------------------------------------------------- */
/* Index d of the document holding token i: the largest cu[d] <= i, searched in [0, n_cu - 1). */
__device__ __forceinline__ int doc_index(const int32_t *cu, int n_cu, int i) {
    int lo = 0, hi = n_cu - 1;
    while (hi - lo > 1) {
        const int mid = lo + ((hi - lo) >> 1);
        if (__ldg(cu + mid) <= i) lo = mid;
        else hi = mid;
    }
    return lo;
}
/* Start of the document holding token i, clamped to [0, i]. */
__device__ __forceinline__ int doc_start(const int32_t *cu, int n_cu, int i) {
    const int s = __ldg(cu + doc_index(cu, n_cu, i));
    return s < 0 ? 0 : (s > i ? i : s);
}
/* End (exclusive) of the document holding token i, clamped to [i + 1, n]. */
__device__ __forceinline__ int doc_end(const int32_t *cu, int n_cu, int i, int n) {
    const int d = doc_index(cu, n_cu, i);
    const int e = d + 1 < n_cu ? __ldg(cu + d + 1) : n;
    return e > n ? n : (e <= i ? i + 1 : e);
}

struct DocsMask {
    const int32_t *cu;
    int n_cu, window, Tq, Tk;
    __device__ __forceinline__ explicit DocsMask(const ncp_sink_attn_params &p)
        : cu(p.mask.cu_seqlens), n_cu(p.mask.n_cu), window(p.mask.window), Tq(p.Tq), Tk(p.Tk) {}
    /* First visible key of row i < Tq. */
    __device__ __forceinline__ int lo(int i) const { return lo_in_doc(i, doc_start(cu, n_cu, i)); }
    /* The same for a row whose document start s (0 <= s <= i) is known: the window's clamp. */
    __device__ __forceinline__ int lo_in_doc(int i, int s) const {
        return window > 0 && i - window + 1 > s ? i - window + 1 : s;
    }
    __device__ __forceinline__ int hi(int i) const { return min(i, Tk - 1); }
    /* Rows that see a key of [k0, k1] (k0 <= k1 < Tk): from k0 to the end of k1's document, or
     * k1 + window - 1. */
    __device__ __forceinline__ void rows_seeing(int k0, int k1, int &r0, int &r1) const {
        int q = doc_end(cu, n_cu, k1, Tq) - 1;
        if (window > 0) q = min(q, k1 + window - 1);
        r0 = k0;
        r1 = min(q, Tq - 1);
    }
};

/* ---- tables -------------------------------------------------------------------------------- */
struct TableMask {
    const int32_t *lo_t, *hi_t;
    int Tq, Tk;
    __device__ __forceinline__ explicit TableMask(const ncp_sink_attn_params &p)
        : lo_t(p.mask.row_lo), hi_t(p.mask.row_hi), Tq(p.Tq), Tk(p.Tk) {}
    __device__ __forceinline__ int lo(int i) const { return max(__ldg(lo_t + i), 0); }
    __device__ __forceinline__ int hi(int i) const { return min(__ldg(hi_t + i), Tk - 1); }
    /* Rows that see a key of [k0, k1]: the first row with hi >= k0 to the last with lo <= k1. */
    __device__ __forceinline__ void rows_seeing(int k0, int k1, int &r0, int &r1) const {
        int a = 0, b = Tq; /* first i with hi_t[i] >= k0 */
        while (a < b) {
            const int m = a + ((b - a) >> 1);
            if (__ldg(hi_t + m) < k0) a = m + 1;
            else b = m;
        }
        r0 = a;
        a = 0, b = Tq; /* first i with lo_t[i] > k1 */
        while (a < b) {
            const int m = a + ((b - a) >> 1);
            if (__ldg(lo_t + m) <= k1) a = m + 1;
            else b = m;
        }
        r1 = a - 1;
    }
};

/* ---- the questions every kernel asks ---------------------------------------------------------- */
/* Bounds of row i (any i >= 0): rows past Tq see nothing. */
template <class M> __device__ __forceinline__ void row_bounds(const M &m, int i, int &lo, int &hi) {
    if (i >= m.Tq) {
        lo = kNoKey;
        hi = -1;
    } else {
        lo = m.lo(i);
        hi = m.hi(i);
    }
}

/* Kv tiles of bn keys that rows [q0, q0 + bm) see (q0 < Tq). */
template <class M> __device__ __forceinline__ q_tile_range q_range(const M &m, int q0, int bm, int bn) {
    q_tile_range r;
    const int q_last = min(q0 + bm, m.Tq) - 1;
    const int lo_first = m.lo(q0), hi_last = m.hi(q_last);
    r.hi_first = m.hi(q0);
    r.lo_last = m.lo(q_last);
    r.rows_complete = q0 + bm <= m.Tq;
    r.kt_lo = lo_first / bn;
    r.kt_hi = hi_last >= lo_first ? hi_last / bn : r.kt_lo - 1;
    return r;
}

/* Tiles of bm rows that see a key of [k0, k1] (k0 <= k1 < Tk): first tile and count (0: none). */
template <class M> __device__ __forceinline__ void q_tiles_seeing(const M &m, int k0, int k1, int bm, int &t0, int &n) {
    int r0, r1;
    m.rows_seeing(k0, k1, r0, r1);
    t0 = r0 / bm;
    n = r1 >= r0 ? r1 / bm - t0 + 1 : 0;
}

/* The policy of a call. */
template <bool TABLE> struct mask_of { using type = DocsMask; };
template <> struct mask_of<true> { using type = TableMask; };

}  // namespace ncp

#endif /* NCP_SINK_ATTN_MASK_CUH */
