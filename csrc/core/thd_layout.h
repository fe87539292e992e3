/*
 * thd_layout.h: the index math shared by the CPU and CUDA paths (NCP_HD = host and device).
 *
 * DualChunkSwap (Transformer Engine's thd_get_partitioned_indices): every document of padded
 * length n is cut into 2W chunks of n/(2W) tokens; rank r owns chunk r and chunk 2W-1-r. For
 * output slot t of rank r, with cs[i] = cu[i] / W:
 *     s    = the last i with cs[i] <= t (TE's binary search over cs[1..batch])
 *     i    = t - cs[s],  half = (cs[s+1] - cs[s]) / 2
 *     off  = i < half ? r : 2W - 2 - r
 *     src  = i + cs[s] * W + half * off
 * Slots past cu[-1] keep the last document's tail offset, exactly as TE does (spec 11.4). TE's
 * arithmetic is int32; so is ours (ncp_te_src_index), with the wraparound made explicit.
 *
 * Also: torch.searchsorted(..., right=True) semantics (upper bound), used by the padding mask of
 * the framework's _thd_padding_mask, reproduced bit for bit even on unsorted input.
 *
 * Integer hygiene (issue 17): every binary search takes its midpoint in int64, so a cu_seqlens of
 * 2^30 or more entries cannot overflow it. Where the reference wraps on absurd inputs (TE's int32
 * arithmetic, torch's int64 cumsum), we wrap explicitly: compute in unsigned types, where wrapping
 * is defined, and convert back with ncp_wrap_i32 / ncp_wrap_i64, which give the two's-complement
 * value for every input on every compiler (no reliance on -fwrapv or implementation-defined casts).
 */
#ifndef NCP_THD_LAYOUT_H
#define NCP_THD_LAYOUT_H

#include <stdint.h>

#ifdef __CUDACC__
#define NCP_HD __host__ __device__ __forceinline__
#else
#define NCP_HD static inline
#endif

/* The two's-complement int32 / int64 with the bits of u: the documented result of every
 * wrapping operation below (mod 2^32 / 2^64 arithmetic, as TE's int32 kernel and torch's int64
 * ops give on the hardware they run on). Compilers turn both into a plain move. */
NCP_HD int32_t ncp_wrap_i32(uint32_t u) {
    return u <= (uint32_t)INT32_MAX ? (int32_t)u : (int32_t)(u - (uint32_t)INT32_MAX - 1u) + INT32_MIN;
}

NCP_HD int64_t ncp_wrap_i64(uint64_t u) {
    return u <= (uint64_t)INT64_MAX ? (int64_t)u : (int64_t)(u - (uint64_t)INT64_MAX - 1u) + INT64_MIN;
}

/* a - b and a + b with int32 wraparound (torch / TE int32 arithmetic on absurd lengths). */
NCP_HD int32_t ncp_sub_wrap_i32(int32_t a, int32_t b) { return ncp_wrap_i32((uint32_t)a - (uint32_t)b); }
NCP_HD int32_t ncp_add_wrap_i32(int32_t a, int32_t b) { return ncp_wrap_i32((uint32_t)a + (uint32_t)b); }
/* a - b and a + b with int64 wraparound (torch's int64 cumsum and subtraction). */
NCP_HD int64_t ncp_sub_wrap_i64(int64_t a, int64_t b) { return ncp_wrap_i64((uint64_t)a - (uint64_t)b); }
NCP_HD int64_t ncp_add_wrap_i64(int64_t a, int64_t b) { return ncp_wrap_i64((uint64_t)a + (uint64_t)b); }

NCP_HD int32_t ncp_mul_wrap_i32(int32_t a, int32_t b) { return ncp_wrap_i32((uint32_t)a * (uint32_t)b); }

/* Global source index of output slot t for rank r: TE's kernel line for line, in TE's int32
 * arithmetic (every step wraps mod 2^32 as TE's `int` does on the GPU, so absurd boundaries give
 * TE's exact answer), except that the search bounds are int64: TE's int32 (left + right) / 2
 * overflows from 2^30 + 1 entries on and reads before the table. Requires n_cu >= 2,
 * 0 <= t <= INT32_MAX, W > 0 (so cu / W cannot overflow) and 0 <= r < W. On a valid layout
 * (non-negative, non-decreasing, lengths divisible by 2W, cu[-1] < 2^31) nothing wraps. */
NCP_HD int32_t ncp_te_src_index_doc(const int32_t *cu, int32_t n_cu, int64_t t64, int32_t W, int32_t r,
                                    int64_t *doc) {
    const int32_t t = (int32_t)t64;
    int64_t left = 1, right = (int64_t)n_cu - 1;
    while (left < right) {
        int64_t mid = (left + right) / 2;
        if (cu[mid] / W <= t) left = mid + 1;
        else right = mid;
    }
    const int64_t s = left - 1;
    *doc = s;
    const int32_t start = cu[s] / W;
    const int32_t len = ncp_sub_wrap_i32(cu[s + 1] / W, start);
    const int32_t i = ncp_sub_wrap_i32(t, start);
    const int32_t half = len / 2;
    const int32_t off = i < half ? r : ncp_sub_wrap_i32(ncp_mul_wrap_i32(ncp_sub_wrap_i32(W, 1), 2), r);
    return ncp_add_wrap_i32(i, ncp_add_wrap_i32(ncp_mul_wrap_i32(start, W), ncp_mul_wrap_i32(half, off)));
}

/* The same, without the document index (*_doc reports s, the document TE's search found). */
NCP_HD int32_t ncp_te_src_index(const int32_t *cu, int32_t n_cu, int64_t t, int32_t W, int32_t r) {
    int64_t doc;
    return ncp_te_src_index_doc(cu, n_cu, t, W, r, &doc);
}

/* torch.searchsorted(sorted, value, right=True) on n entries: the upper bound, with torch's loop. */
NCP_HD int64_t ncp_upper_bound_i64(const int64_t *a, int64_t n, int64_t value) {
    int64_t start = 0, end = n;
    while (start < end) {
        int64_t mid = start + ((end - start) >> 1);
        if (!(value < a[mid])) start = mid + 1;
        else end = mid;
    }
    return start;
}

/* The framework's _thd_padding_mask at position p of a chunk (spec mimo_te.md 7.4):
 * starts has n_slots+1 entries (0, cumsum(slots)), reals has n_reals >= 1 entries. */
NCP_HD int ncp_thd_is_padding_seg(const int64_t *starts, int64_t n_slots, const int64_t *reals, int64_t n_reals,
                                  int64_t p, int64_t seg) {
    if (seg > n_reals - 1) seg = n_reals - 1;
    /* int64 wraparound as torch computes it: only absurd (wrapping) length tables get here */
    int pad = ncp_sub_wrap_i64(p, starts[seg]) >= reals[seg];
    return pad || (p >= starts[n_slots]);
}

NCP_HD int ncp_thd_is_padding(const int64_t *starts, int64_t n_slots, const int64_t *reals, int64_t n_reals,
                              int64_t p) {
    return ncp_thd_is_padding_seg(starts, n_slots, reals, n_reals, p, ncp_upper_bound_i64(starts + 1, n_slots, p));
}

/* Padding flag of global token g of a chunk whose TE search found document doc. With same_docs
 * (desc[6], set by ncp_mimo_layout) the padding starts ARE TE's boundaries (a validated layout whose
 * padded lengths fit int32 and sum to at most INT32_MAX tokens): g lies in document doc, so the
 * second search would find doc again and is skipped. Otherwise the framework's own search runs. */
NCP_HD int ncp_mimo_is_padding(const int64_t *starts, int64_t n_slots, const int64_t *reals, int64_t n_reals,
                               int64_t g, int64_t doc, int64_t same_docs) {
    return same_docs ? ncp_thd_is_padding_seg(starts, n_slots, reals, n_reals, g, doc)
                     : ncp_thd_is_padding(starts, n_slots, reals, n_reals, g);
}

/* Layout of the MiMo kernel table (int64 words), written by ncp_mimo_layout:
 *   word 0: C; then per chunk c at 1 + NCP_MIMO_DESC * c:
 *     [0] cu_off   [1] n_cu     partition boundaries (W > 1), int32 packed two per word
 *     [2] st_off   [3] n_slots  padding-mask starts (n_slots + 1 entries)
 *     [4] re_off   [5] n_reals  padding-mask real lengths
 *     [6] same_docs             1: the padding starts equal the partition boundaries (W > 1)
 *   then the arrays, packed in the order they are filled (every chunk's boundaries, then every
 *   chunk's starts and real lengths): the table holds what the rows hold, not the tables' capacity,
 *   about 2.5 words per document (B = 8 rows of 16-64 documents: about 6 KiB, the launch's
 *   8 KiB parameter block).
 */
#define NCP_MIMO_DESC 8

#endif /* NCP_THD_LAYOUT_H */
