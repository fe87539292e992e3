/*
 * sm90/gemm.cuh: the two warpgroup GEMM shapes of the Hopper sink-attention kernels, on 128B-swizzled
 * shared tiles (layout: arch.cuh), issued asynchronously and committed as one group:
 *   gemm_ss: acc[64 x N] (=|+=) A[64 x K] B[N x K]^T, both K-major (K = D: D/64 column blocks,
 *            a_cb / b_cb bytes apart); acc is overwritten (first k-step with scale_d = 0).
 *   gemm_rs: acc[64 x N] += A[64 x K] B[K x N], A as register fragments (K/16 of them), B MN-major
 *            (K rows from b, N = D in 64-wide column blocks lbo bytes apart); keep = 0 overwrites.
 * The caller waits (wg_wait) and fences the accumulators before reading them.
 */
#ifndef NCP_SM90_GEMM_CUH
#define NCP_SM90_GEMM_CUH

#include "arch.cuh"
#include "wgmma.cuh"

namespace ncp {
namespace sm90 {
#ifdef NCP_SM90_DEVICE
template <typename T, int N, int D>
__device__ __forceinline__ void gemm_ss(float *acc, uint32_t a, uint32_t a_cb, uint32_t b, uint32_t b_cb) {
    fence_regs(acc, N / 2);
    wg_fence();
    /* k-step ks: + (ks / 4) column blocks + 32 (ks % 4) bytes */
    const uint32_t la = desc_lo(a, kLboKMajor), lb = desc_lo(b, kLboKMajor);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
        wgmma<T, N>::template ss<0, 0>(acc, desc_of(la + (ks >> 2) * (a_cb >> 4) + (ks & 3) * 2),
                                       desc_of(lb + (ks >> 2) * (b_cb >> 4) + (ks & 3) * 2), ks > 0);
    wg_commit();
}

/* The k-steps of gemm_rs alone, for callers that put several GEMMs in one commit group; keep = 0:
 * the first k-step overwrites acc (no zeroing of the accumulators beforehand). */
template <typename T, int N, int K>
__device__ __forceinline__ void rs_steps(float *acc, uint32_t (*a)[4], uint32_t b, uint32_t lbo, int keep = 1) {
    const uint32_t lb = desc_lo(b, lbo); /* k-step kk: + 16 rows of 128 bytes */
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
        wgmma<T, N>::template rs<1>(acc, a[kk], desc_of(lb + kk * 128), kk > 0 || keep);
}

template <typename T, int N, int K>
__device__ __forceinline__ void gemm_rs(float *acc, uint32_t (*a)[4], uint32_t b, uint32_t lbo, int keep = 1) {
    fence_regs(acc, N / 2);
    wg_fence();
    rs_steps<T, N, K>(acc, a, b, lbo, keep);
    wg_commit();
}
#endif
}  // namespace sm90
}  // namespace ncp

#endif /* NCP_SM90_GEMM_CUH */
