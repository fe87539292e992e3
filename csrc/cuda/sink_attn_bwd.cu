/*
 * cuda/sink_attn_bwd.cu: learned-sink attention backward, tensor cores (mma.sync, sm_80+).
 *
 * With P_ij = exp(s <q_i, k_j> - lse_i) (lse includes the sink) and D_i = <dO_i, O_i>:
 *     dS_ij = P_ij (<dO_i, v_j> - D_i)
 *     dQ_i = s sum_j dS_ij k_j,  dK_j = s sum_i dS_ij q_i,  dV_j = sum_i P_ij dO_i
 *     dsink_h = -sum_i exp(sink_h - lse_i) D_i                 (the sink has a zero value vector)
 * Kernels, all deterministic (no atomics, fixed reduction orders):
 *   bwd_pre_kernel    D_i for every (row, head) and per-block dsink partial sums (the Delta pre-pass)
 *   dsink_reduce      dsink_h = ordered sum of the partials
 *   bwd_dkdv_kernel   one CTA per (kv tile of 64 keys, kv head): loops over the G query heads of
 *                     the group and every q tile that sees the keys; computes S^T = K Q^T so that
 *                     P^T and dS^T are born in registers as A fragments of dV += P^T dO and
 *                     dK += dS^T Q (no shared-memory round trip)
 *   bwd_dq_kernel     one CTA per (q tile of 64 rows, head): recomputes P and dP = dO V^T over the
 *                     same visible tiles as the forward and accumulates dQ in registers
 * dQ from its own kernel costs two extra GEMMs instead of fp32 atomics, and makes every gradient
 * bitwise reproducible.
 *
 * Versions: v1 (this). Measured: BENCHMARKS.md.
 * Test: pytest tests/test_sink_attention_cuda.py   Bench: python benchmarks/bench_sink_attention.py
 */
#include <stdlib.h>

#include "ncp/ncp_check.h"
#include "ncp_internal.h"
#include "sink_attn_common.cuh"
#include "sm90_common.cuh"

extern "C" ncp_status ncp_sink_attn_check_vector_access(const ncp_sink_attn_params *p);

namespace ncp {
namespace {

constexpr int QB = NCP_BWD_BM; /* 64 query rows per step / per dQ CTA */
constexpr int KB = NCP_BWD_BN; /* 64 keys per dK/dV CTA and per dQ kv tile */
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
static_assert(QB == 16 * kWarps && KB == 16 * kWarps, "one m16 tile per warp");

/* ======================================================================================== */
/* pre-pass: delta and dsink partials                                                        */
/* ======================================================================================== */

constexpr int kPreThreads = 256;

template <typename T, int D> __global__ void __launch_bounds__(kPreThreads) bwd_pre_kernel(const ncp_sink_attn_bwd_params b) {
    constexpr int LPR = D / 8, RPW = 32 / LPR, kRows = NCP_BWD_PRE_ROWS;
    const ncp_sink_attn_params &p = b.f;
    const int h = blockIdx.y, r0 = blockIdx.x * kRows, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool has_sink = p.sink != nullptr;
    const float sink = has_sink ? __ldg(reinterpret_cast<const float *>(p.sink) + h) : 0.f;
    const T *oh = reinterpret_cast<const T *>(p.out) + (int64_t)h * p.o_sh;
    const T *dh = reinterpret_cast<const T *>(b.dout) + (int64_t)h * b.do_sh;
    float part = 0.f;
    for (int row = warp * RPW + lane / LPR; row < kRows; row += (kPreThreads / 32) * RPW) {
        const int i = r0 + row, c = lane % LPR;
        float d = 0.f;
        if (i < p.Tq) {
            const uint4 o = *reinterpret_cast<const uint4 *>(oh + (int64_t)i * p.o_st + c * 8);
            const uint4 g = *reinterpret_cast<const uint4 *>(dh + (int64_t)i * b.do_st + c * 8);
            const uint32_t ov[4] = {o.x, o.y, o.z, o.w}, gv[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float2 a = elem<T>::unpack(ov[k]), e = elem<T>::unpack(gv[k]);
                d = fmaf(a.x, e.x, fmaf(a.y, e.y, d));
            }
        }
#pragma unroll
        for (int off = LPR / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
        if (c == 0 && i < p.Tq) {
            b.delta[(int64_t)h * p.Tq + i] = d;
            if (has_sink) part -= expf(sink - p.lse[(int64_t)h * p.Tq + i]) * d;
        }
    }
    if (!has_sink) return;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
    __shared__ float s_part[kPreThreads / 32];
    if (lane == 0) s_part[warp] = part;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int w = 0; w < kPreThreads / 32; ++w) total += s_part[w];
        b.dsink_part[(int64_t)h * b.n_part + blockIdx.x] = total;
    }
}

__global__ void dsink_reduce_kernel(const ncp_sink_attn_bwd_params b, int n_blocks) {
    for (int h = blockIdx.x * blockDim.x + threadIdx.x; h < b.f.Hq; h += gridDim.x * blockDim.x) {
        float total = 0.f;
        for (int k = 0; k < n_blocks; ++k) total += b.dsink_part[(int64_t)h * b.n_part + k];
        reinterpret_cast<float *>(b.dsink)[h] = total;
    }
}

/* ======================================================================================== */
/* shared pieces of the dK/dV and dQ kernels                                                 */
/* ======================================================================================== */

/* Stores a 64 x D fp32 register tile (rows warp*16 + g, + 8) times `mul` through the swizzled
 * staging tile `stage` to rows [r0, r0 + 64) of a (n_rows, ., D) tensor. */
template <typename T, int D>
__device__ __forceinline__ void store_tile(float (*acc)[4], float mul, uint32_t stage, T *dst, int64_t st, int r0,
                                           int n_rows, int tid) {
    const int lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint32_t v = elem<T>::pack(acc[dt][2 * r] * mul, acc[dt][2 * r + 1] * mul);
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(stage + swz<D>(warp * 16 + gq + 8 * r, dt) + tq * 4), "r"(v));
        }
    }
    __syncthreads();
    constexpr int kChunks = D / 8;
    for (int i = tid; i < 64 * kChunks; i += kThreads) {
        const int row = i / kChunks, chunk = i % kChunks, g = r0 + row;
        if (g >= n_rows) continue;
        uint4 v;
        asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(stage + swz<D>(row, chunk)));
        *reinterpret_cast<uint4 *>(dst + (int64_t)g * st + chunk * 8) = v;
    }
    __syncthreads();
}

/* Contiguous mode: q tiles [qt_lo, qt_hi] that see some key of [k0, k0 + KB). */
__device__ __forceinline__ void contiguous_kv_range(const ncp_sink_attn_params &p, int k0, int &qt_lo, int &qt_hi) {
    const int k_last = min(k0 + KB, p.Tk) - 1;
    int q_hi = doc_end(p.cu_seqlens, p.n_cu, k_last, p.Tq) - 1;
    if (p.window > 0) q_hi = min(q_hi, k_last + p.window - 1);
    q_hi = min(q_hi, p.Tq - 1);
    qt_lo = k0 / QB;
    qt_hi = q_hi / QB;
}

/* ======================================================================================== */
/* dK / dV                                                                                   */
/* ======================================================================================== */

template <int D> constexpr int dkdv_smem_bytes() { return (2 * KB * D + 4 * QB * D) * 2 + 2 * 4 * QB * 4; }

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) bwd_dkdv_kernel(const ncp_sink_attn_bwd_params b) {
    extern __shared__ __align__(128) unsigned char smem[];
    const ncp_sink_attn_params &p = b.f;
    const uint32_t sK = smem_u32(smem), sV = sK + KB * D * 2, sQ0 = sV + KB * D * 2, sO0 = sQ0 + 2 * QB * D * 2;
    float *s_lse = reinterpret_cast<float *>(smem + (2 * KB * D + 4 * QB * D) * 2); /* [2][QB] */
    float *s_dl = s_lse + 2 * QB;
    int *s_qpos = reinterpret_cast<int *>(s_dl + 2 * QB), *s_qlo = s_qpos + 2 * QB;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int g_kv = blockIdx.x, kt = blockIdx.y, k0 = kt * KB, G = p.Hq / p.Hkv;
    const bool positions = p.q_pos != nullptr;

    int n_q, e0 = 0, qt_lo = 0, qt_hi = -1;
    if (positions) {
        e0 = __ldg(b.dkv_off + kt);
        n_q = __ldg(b.dkv_off + kt + 1) - e0;
    } else {
        contiguous_kv_range(p, k0, qt_lo, qt_hi);
        n_q = max(0, qt_hi - qt_lo + 1);
    }
    const int n_it = n_q * G;
    auto item = [&](int it, int &h, bool &full) -> int {
        const int qi = it % n_q;
        h = g_kv * G + it / n_q;
        if (positions) {
            const int e = __ldg(b.dkv_ent + e0 + qi);
            full = e & 1;
            return e >> 1;
        }
        const int qt = qt_lo + qi, a = qt * QB;
        const int lo_last = first_key(p.cu_seqlens, p.n_cu, p.window, min(a + QB, p.Tq) - 1);
        full = a + QB <= p.Tq && k0 + KB <= p.Tk && k0 + KB - 1 <= a && k0 >= lo_last;
        return qt;
    };
    const T *kh = reinterpret_cast<const T *>(p.k) + (int64_t)g_kv * p.k_sh;
    const T *vh = reinterpret_cast<const T *>(p.v) + (int64_t)g_kv * p.v_sh;
    auto load_q = [&](int it, int stage) {
        int h;
        bool full;
        const int qt = item(it, h, full), a = qt * QB;
        load_tile<D, QB, kThreads>(sQ0 + stage * QB * D * 2, reinterpret_cast<const T *>(p.q) + (int64_t)h * p.q_sh,
                                   p.q_st, a, p.Tq, tid);
        load_tile<D, QB, kThreads>(sO0 + stage * QB * D * 2, reinterpret_cast<const T *>(b.dout) + (int64_t)h * b.do_sh,
                                   b.do_st, a, p.Tq, tid);
        if (tid < QB) {
            const int i = a + tid;
            int qpos, qlo;
            row_bounds(p, i, qpos, qlo);
            s_qpos[stage * QB + tid] = qpos;
            s_qlo[stage * QB + tid] = qlo;
            s_lse[stage * QB + tid] = i < p.Tq ? p.lse[(int64_t)h * p.Tq + i] * kLog2e : 0.f;
            s_dl[stage * QB + tid] = i < p.Tq ? b.delta[(int64_t)h * p.Tq + i] : 0.f;
        }
    };

    load_tile<D, KB, kThreads>(sK, kh, p.k_st, k0, p.Tk, tid);
    load_tile<D, KB, kThreads>(sV, vh, p.v_st, k0, p.Tk, tid);
    if (n_it > 0) load_q(0, 0);
    cp_async_commit();

    int kpos[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int j = k0 + warp * 16 + gq + 8 * r;
        kpos[r] = j >= p.Tk ? kNoKey : (positions ? __ldg(p.k_pos + j) : j);
    }
    const float scale_log2 = (float)p.scale * kLog2e;
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;

    for (int it = 0; it < n_it; ++it) {
        const int stage = it & 1;
        if (it + 1 < n_it) load_q(it + 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        int h;
        bool full;
        (void)item(it, h, full);
        const uint32_t sQ = sQ0 + stage * QB * D * 2, sO = sO0 + stage * QB * D * 2;
        const float *lse = s_lse + stage * QB, *dl = s_dl + stage * QB;
        const int *qpos = s_qpos + stage * QB, *qlo = s_qlo + stage * QB;

        /* S^T = K Q^T: 16 keys x 64 queries per warp */
        float pt[QB / 8][4];
#pragma unroll
        for (int i = 0; i < QB / 8; ++i) pt[i][0] = pt[i][1] = pt[i][2] = pt[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            uint32_t a[4];
            load_a<D>(a, sK, warp * 16, 2 * ks, lane);
#pragma unroll
            for (int np = 0; np < QB / 16; ++np) {
                uint32_t bb[4];
                load_b_nk<D>(bb, sQ, np * 16, 2 * ks, lane);
                mma16816<T>(pt[2 * np], a, bb);
                mma16816<T>(pt[2 * np + 1], a, bb + 2);
            }
        }
        /* P^T = exp2(x - lse), masked */
#pragma unroll
        for (int nt = 0; nt < QB / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = nt * 8 + 2 * tq + (e & 1), r = e >> 1;
                float x = pt[nt][e] * scale_log2 - lse[col];
                if (!full && (kpos[r] < qlo[col] || kpos[r] > qpos[col])) x = -INFINITY;
                pt[nt][e] = ex2(x);
            }
        /* dV += P^T dO */
#pragma unroll
        for (int kk = 0; kk < QB / 16; ++kk) {
            uint32_t a[4];
            a[0] = elem<T>::pack(pt[2 * kk][0], pt[2 * kk][1]);
            a[1] = elem<T>::pack(pt[2 * kk][2], pt[2 * kk][3]);
            a[2] = elem<T>::pack(pt[2 * kk + 1][0], pt[2 * kk + 1][1]);
            a[3] = elem<T>::pack(pt[2 * kk + 1][2], pt[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t bb[4];
                load_b_kn<D>(bb, sO, kk * 16, 2 * dp, lane);
                mma16816<T>(dv[2 * dp], a, bb);
                mma16816<T>(dv[2 * dp + 1], a, bb + 2);
            }
        }
        /* dP^T = V dO^T, then dS^T = P^T (dP^T - delta) */
        float ds[QB / 8][4];
#pragma unroll
        for (int i = 0; i < QB / 8; ++i) ds[i][0] = ds[i][1] = ds[i][2] = ds[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            uint32_t a[4];
            load_a<D>(a, sV, warp * 16, 2 * ks, lane);
#pragma unroll
            for (int np = 0; np < QB / 16; ++np) {
                uint32_t bb[4];
                load_b_nk<D>(bb, sO, np * 16, 2 * ks, lane);
                mma16816<T>(ds[2 * np], a, bb);
                mma16816<T>(ds[2 * np + 1], a, bb + 2);
            }
        }
#pragma unroll
        for (int nt = 0; nt < QB / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[nt][e] = pt[nt][e] * (ds[nt][e] - dl[nt * 8 + 2 * tq + (e & 1)]);
        /* dK += dS^T Q */
#pragma unroll
        for (int kk = 0; kk < QB / 16; ++kk) {
            uint32_t a[4];
            a[0] = elem<T>::pack(ds[2 * kk][0], ds[2 * kk][1]);
            a[1] = elem<T>::pack(ds[2 * kk][2], ds[2 * kk][3]);
            a[2] = elem<T>::pack(ds[2 * kk + 1][0], ds[2 * kk + 1][1]);
            a[3] = elem<T>::pack(ds[2 * kk + 1][2], ds[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t bb[4];
                load_b_kn<D>(bb, sQ, kk * 16, 2 * dp, lane);
                mma16816<T>(dk[2 * dp], a, bb);
                mma16816<T>(dk[2 * dp + 1], a, bb + 2);
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();
    __syncthreads();
    store_tile<T, D>(dk, (float)p.scale, sQ0, reinterpret_cast<T *>(b.dk) + (int64_t)g_kv * b.dk_sh, b.dk_st, k0, p.Tk, tid);
    store_tile<T, D>(dv, 1.f, sQ0, reinterpret_cast<T *>(b.dv) + (int64_t)g_kv * b.dv_sh, b.dv_st, k0, p.Tk, tid);
}

/* ======================================================================================== */
/* dQ                                                                                        */
/* ======================================================================================== */

template <int D> constexpr int dq_smem_bytes() { return (2 * QB * D + 4 * KB * D) * 2 + 2 * KB * 4; }

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) bwd_dq_kernel(const ncp_sink_attn_bwd_params b) {
    extern __shared__ __align__(128) unsigned char smem[];
    const ncp_sink_attn_params &p = b.f;
    const uint32_t sQ = smem_u32(smem), sO = sQ + QB * D * 2, sK0 = sO + QB * D * 2, sV0 = sK0 + 2 * KB * D * 2;
    int *s_kpos = reinterpret_cast<int *>(smem + (2 * QB * D + 4 * KB * D) * 2);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int h = blockIdx.x, g_kv = h / (p.Hq / p.Hkv);
    const int tile = gridDim.y - 1 - blockIdx.y, q0 = tile * QB;
    const bool positions = p.q_pos != nullptr;

    int n_it, e0 = 0;
    q_tile_range rng{};
    if (positions) {
        e0 = __ldg(b.dq_off + tile);
        n_it = __ldg(b.dq_off + tile + 1) - e0;
    } else {
        rng = contiguous_q_range(p, q0, QB, KB);
        n_it = max(0, rng.kt_hi - rng.kt_lo + 1);
    }
    auto tile_at = [&](int it, bool &full) -> int {
        if (positions) {
            const int e = __ldg(b.dq_ent + e0 + it);
            full = e & 1;
            return e >> 1;
        }
        const int kt = rng.kt_hi - it;
        full = contiguous_full(p, rng, kt, KB);
        return kt;
    };
    const T *kh = reinterpret_cast<const T *>(p.k) + (int64_t)g_kv * p.k_sh;
    const T *vh = reinterpret_cast<const T *>(p.v) + (int64_t)g_kv * p.v_sh;
    auto load_kv = [&](int it, int stage) {
        bool full;
        const int kt = tile_at(it, full);
        load_tile<D, KB, kThreads>(sK0 + stage * KB * D * 2, kh, p.k_st, kt * KB, p.Tk, tid);
        load_tile<D, KB, kThreads>(sV0 + stage * KB * D * 2, vh, p.v_st, kt * KB, p.Tk, tid);
        if (tid < KB) {
            const int j = kt * KB + tid;
            s_kpos[stage * KB + tid] = j >= p.Tk ? kNoKey : (positions ? __ldg(p.k_pos + j) : j);
        }
    };

    load_tile<D, QB, kThreads>(sQ, reinterpret_cast<const T *>(p.q) + (int64_t)h * p.q_sh, p.q_st, q0, p.Tq, tid);
    load_tile<D, QB, kThreads>(sO, reinterpret_cast<const T *>(b.dout) + (int64_t)h * b.do_sh, b.do_st, q0, p.Tq, tid);
    if (n_it > 0) load_kv(0, 0);
    cp_async_commit();

    int qpos[2], qlo[2];
    float lse[2], dl[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = q0 + warp * 16 + gq + 8 * r;
        row_bounds(p, i, qpos[r], qlo[r]);
        lse[r] = i < p.Tq ? p.lse[(int64_t)h * p.Tq + i] * kLog2e : 0.f;
        dl[r] = i < p.Tq ? b.delta[(int64_t)h * p.Tq + i] : 0.f;
    }
    const float scale_log2 = (float)p.scale * kLog2e;
    float dq[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;

    for (int it = 0; it < n_it; ++it) {
        const int stage = it & 1;
        if (it + 1 < n_it) load_kv(it + 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        bool full;
        (void)tile_at(it, full);
        const uint32_t sK = sK0 + stage * KB * D * 2, sV = sV0 + stage * KB * D * 2;
        const int *kp = s_kpos + stage * KB;

        float s[KB / 8][4], dp[KB / 8][4];
#pragma unroll
        for (int i = 0; i < KB / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            uint32_t aq[4], ao[4];
            load_a<D>(aq, sQ, warp * 16, 2 * ks, lane);
            load_a<D>(ao, sO, warp * 16, 2 * ks, lane);
#pragma unroll
            for (int np = 0; np < KB / 16; ++np) {
                uint32_t bk[4], bv[4];
                load_b_nk<D>(bk, sK, np * 16, 2 * ks, lane);
                load_b_nk<D>(bv, sV, np * 16, 2 * ks, lane);
                mma16816<T>(s[2 * np], aq, bk);
                mma16816<T>(s[2 * np + 1], aq, bk + 2);
                mma16816<T>(dp[2 * np], ao, bv);
                mma16816<T>(dp[2 * np + 1], ao, bv + 2);
            }
        }
        /* dS = P (dP - delta), P = exp2(x - lse) masked */
#pragma unroll
        for (int nt = 0; nt < KB / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                float x = s[nt][e] * scale_log2 - lse[r];
                if (!full) {
                    const int k = kp[nt * 8 + 2 * tq + (e & 1)];
                    if (k < qlo[r] || k > qpos[r]) x = -INFINITY;
                }
                s[nt][e] = ex2(x) * (dp[nt][e] - dl[r]);
            }
        /* dQ += dS K */
#pragma unroll
        for (int kk = 0; kk < KB / 16; ++kk) {
            uint32_t a[4];
            a[0] = elem<T>::pack(s[2 * kk][0], s[2 * kk][1]);
            a[1] = elem<T>::pack(s[2 * kk][2], s[2 * kk][3]);
            a[2] = elem<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = elem<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp2 = 0; dp2 < D / 16; ++dp2) {
                uint32_t bb[4];
                load_b_kn<D>(bb, sK, kk * 16, 2 * dp2, lane);
                mma16816<T>(dq[2 * dp2], a, bb);
                mma16816<T>(dq[2 * dp2 + 1], a, bb + 2);
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();
    __syncthreads();
    store_tile<T, D>(dq, (float)p.scale, sQ, reinterpret_cast<T *>(b.dq) + (int64_t)h * b.dq_sh, b.dq_st, q0, p.Tq, tid);
}

/* ======================================================================================== */
/* launcher                                                                                  */
/* ======================================================================================== */

template <typename T, int D> ncp_status launch(const ncp_sink_attn_bwd_params &b, cudaStream_t s) {
    const ncp_sink_attn_params &p = b.f;
    const int n_part = ncp_sink_attn_bwd_n_part(p.Tq);
    bwd_pre_kernel<T, D><<<dim3(n_part, p.Hq), kPreThreads, 0, s>>>(b);
    NCP_CUDA_CHECK(cudaGetLastError());
    if (p.sink != nullptr) {
        dsink_reduce_kernel<<<(p.Hq + 127) / 128, 128, 0, s>>>(b, n_part);
        NCP_CUDA_CHECK(cudaGetLastError());
    }
    if (p.q_pos == nullptr && ncp_sink_attn_bwd_variant() == 4) return ncp_sink_attn_bwd_sm90(&b, s);
    constexpr int kv_bytes = dkdv_smem_bytes<D>(), q_bytes = dq_smem_bytes<D>();
    auto kv_kernel = bwd_dkdv_kernel<T, D>;
    auto q_kernel = bwd_dq_kernel<T, D>;
    NCP_CUDA_CHECK(cudaFuncSetAttribute(kv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kv_bytes));
    NCP_CUDA_CHECK(cudaFuncSetAttribute(q_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, q_bytes));
    if (p.Tk > 0) {
        kv_kernel<<<dim3(p.Hkv, (p.Tk + KB - 1) / KB), kThreads, kv_bytes, s>>>(b);
        NCP_CUDA_CHECK(cudaGetLastError());
    }
    if (p.Tq > 0) {
        q_kernel<<<dim3(p.Hq, (p.Tq + QB - 1) / QB), kThreads, q_bytes, s>>>(b);
        NCP_CUDA_CHECK(cudaGetLastError());
    }
    return NCP_OK;
}

}  // namespace
}  // namespace ncp

extern "C" int ncp_sink_attn_bwd_variant(void) {
    const char *e = getenv("NCP_BWD_VARIANT"); /* per call: tests switch kernels in one process */
    if (e != nullptr && e[0] == '1' && e[1] == 0) return 1;
    return ncp_sm90_usable() ? 4 : 1;
}

extern "C" ncp_status ncp_sink_attn_bwd_cuda(const ncp_sink_attn_bwd_params *b, void *stream) {
    NCP_TRY(ncp_sink_attn_bwd_check(b, 1));
    NCP_TRY(ncp_sink_attn_check_vector_access(&b->f));
    const uintptr_t ptrs[4] = {(uintptr_t)b->dout, (uintptr_t)b->dq, (uintptr_t)b->dk, (uintptr_t)b->dv};
    const int64_t strides[8] = {b->do_st, b->do_sh, b->dq_st, b->dq_sh, b->dk_st, b->dk_sh, b->dv_st, b->dv_sh};
    for (int i = 0; i < 4; ++i)
        NCP_ARG_CHECK(ptrs[i] % 16 == 0, "dout, dq, dk and dv must be 16-byte aligned on CUDA (use .contiguous())");
    NCP_ARG_CHECK((uintptr_t)b->dq_accum % 16 == 0, "dq_accum must be 16-byte aligned on CUDA");
    for (int i = 0; i < 8; ++i)
        NCP_ARG_CHECK(strides[i] % 8 == 0, "token and head strides of dout, dq, dk and dv must be multiples of 8 elements");
    NCP_ARG_CHECK((b->f.Tq + NCP_BWD_BM - 1) / NCP_BWD_BM <= 65535 && (b->f.Tk + NCP_BWD_BN - 1) / NCP_BWD_BN <= 65535,
                  "too many tiles for one launch (Tq=%d, Tk=%d)", b->f.Tq, b->f.Tk);
    if (b->f.Tq == 0 && b->f.Tk == 0) return NCP_OK;
    cudaStream_t s = (cudaStream_t)stream;
    const bool bf16 = b->f.dtype == NCP_DT_BF16;
    if (b->f.D == 64) return bf16 ? ncp::launch<__nv_bfloat16, 64>(*b, s) : ncp::launch<__half, 64>(*b, s);
    return bf16 ? ncp::launch<__nv_bfloat16, 128>(*b, s) : ncp::launch<__half, 128>(*b, s);
}
