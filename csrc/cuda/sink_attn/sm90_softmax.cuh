/*
 * sink_attn/sm90_softmax.cuh: the online softmax with the learned sink, on accumulator fragments
 * of 64 x NB scores per warpgroup (a thread holds rows r = 0, 1 (tile rows gq and gq + 8 of its
 * warp) and columns 8j + 2tq + {0, 1}: x[4j + 2r + c]), and the mask of a partial tile.
 *
 * In the log2 domain, per row: m_0 = sink * log2(e), l_0 = 1 (0 without a sink, m_0 = -inf);
 * per tile m' = max(m, scale * max_j s_j), corr = 2^(m - m'), p_j = 2^(scale s_j - m'),
 * l = l * corr + sum_j p_j; finally O = acc / l and lse = (m + log2 l) ln 2. A positive scale stays
 * out of the scores (the row max is scaled once and the scale goes into the exponent's FFMA); other
 * scales scale the scores first. NaN in a score or the sink gives NaN out (the epilogue keeps it);
 * +inf gives NaN (inf - inf), as documented in the README.
 */
#ifndef NCP_SINK_ATTN_SM90_SOFTMAX_CUH
#define NCP_SINK_ATTN_SM90_SOFTMAX_CUH

#include "common.cuh"

namespace ncp {

/* Masks the scores of keys [k0, k0 + NB) of a partial tile for the thread's two rows, whose
 * visible keys are [lo[r], hi[r]] (rows past Tq: lo = kNoKey, hi = -1). need_lo / need_hi: only
 * the bounds that cut the tile are tested (the diagonal tile needs only the upper one, a window's
 * far edge only the lower one); bounds are taken relative to the thread's first column, so each
 * element costs one compare against a constant column and a select. */
template <int NB>
__device__ __forceinline__ void mask_frag(float *x, int k0, int tq, const int *lo_row, const int *hi_row, bool need_lo,
                                          bool need_hi) {
    const int cb = k0 + 2 * tq;
    int lo[2], hi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        lo[r] = lo_row[r] - cb; /* kNoKey - cb: no overflow, cb >= 0 */
        hi[r] = hi_row[r] - cb;
    }
    if (need_lo && need_hi) {
#pragma unroll
        for (int j = 0; j < NB / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = 8 * j + (e & 1);
                if (c < lo[e >> 1] || c > hi[e >> 1]) x[4 * j + e] = -INFINITY;
            }
    } else if (need_hi) {
#pragma unroll
        for (int j = 0; j < NB / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (8 * j + (e & 1) > hi[e >> 1]) x[4 * j + e] = -INFINITY;
    } else {
#pragma unroll
        for (int j = 0; j < NB / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (8 * j + (e & 1) < lo[e >> 1]) x[4 * j + e] = -INFINITY;
    }
}

struct OnlineSoftmax {
    float m[2], l[2], corr[2];

    /* Starts both rows from the sink (sink_log2 = -inf: none); its term is counted on lane tq = 0
     * of the quad only, so the final quad sum counts it once. */
    __device__ __forceinline__ void init(float sink_log2, bool has_sink, int tq) {
        m[0] = m[1] = sink_log2;
        l[0] = l[1] = (has_sink && tq == 0) ? 1.f : 0.f;
    }

    /* Unnormalized probabilities of NB scores in place; corr becomes the factor O must be
     * rescaled by before it takes them. s_mul: the scale when it is folded into the exponent,
     * else 1 (the caller scaled the scores). Row max and sum over kAcc independent partials each
     * (short dependent chains). */
    template <int NB> __device__ __forceinline__ void step(float *x, float s_mul) {
        constexpr int kAcc = 4;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mp[kAcc];
#pragma unroll
            for (int a = 0; a < kAcc; ++a) mp[a] = -INFINITY;
#pragma unroll
            for (int j = 0; j < NB / 8; ++j)
                mp[j % kAcc] = fmaxf(mp[j % kAcc], fmaxf(x[4 * j + 2 * r], x[4 * j + 2 * r + 1]));
            float mx = fmaxf(fmaxf(mp[0], mp[1]), fmaxf(mp[2], mp[3]));
            mx = fmaxf(m[r], quad_max(mx) * s_mul); /* s_mul > 0: the max of the scaled scores */
            const float m_use = mx == -INFINITY ? 0.f : mx;
            corr[r] = ex2(m[r] - m_use);
            float sp[kAcc];
#pragma unroll
            for (int a = 0; a < kAcc; ++a) sp[a] = 0.f;
#pragma unroll
            for (int j = 0; j < NB / 8; ++j) {
                x[4 * j + 2 * r] = ex2(fmaf(x[4 * j + 2 * r], s_mul, -m_use));
                x[4 * j + 2 * r + 1] = ex2(fmaf(x[4 * j + 2 * r + 1], s_mul, -m_use));
                sp[j % kAcc] += x[4 * j + 2 * r] + x[4 * j + 2 * r + 1];
            }
            l[r] = l[r] * corr[r] + ((sp[0] + sp[1]) + (sp[2] + sp[3]));
            m[r] = mx;
        }
    }

    /* O *= corr, skipped when no row of the warp has a new maximum (corr is then exactly 1). */
    template <int D> __device__ __forceinline__ void rescale(float *o) const {
        if (!__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) return;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            o[4 * j + 0] *= corr[0];
            o[4 * j + 1] *= corr[0];
            o[4 * j + 2] *= corr[1];
            o[4 * j + 3] *= corr[1];
        }
    }

    /* Row sums over the quad, the factor 1 / l (0 for a row that saw nothing, NaN stays NaN) and
     * lse in natural log (-inf for an empty row without a sink). */
    __device__ __forceinline__ void finish(float *inv, float *lse) const {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float lt = quad_sum(l[r]);
            inv[r] = lt == 0.f ? 0.f : 1.f / lt;
            lse[r] = lt == 0.f ? -INFINITY : (m[r] + __log2f(lt)) * kLn2;
        }
    }
};

}  // namespace ncp

#endif /* NCP_SINK_ATTN_SM90_SOFTMAX_CUH */
