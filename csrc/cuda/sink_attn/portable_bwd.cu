/*
 * sink_attn/portable_bwd.cu: learned-sink attention backward on tensor cores with mma.sync (any
 * sm_80+ GPU), and the pre-pass every backward runs. Kernels and launchers only (the dispatcher,
 * dispatch.cu, decides which backward runs).
 *
 * With P_ij = exp(s <q_i, k_j> - lse_i) (lse includes the sink) and D_i = <dO_i, O_i>:
 *     dS_ij = P_ij (<dO_i, v_j> - D_i)
 *     dQ_i = s sum_j dS_ij k_j,  dK_j = s sum_i dS_ij q_i,  dV_j = sum_i P_ij dO_i
 *     dsink_h = -sum_i exp(sink_h - lse_i) D_i                 (the sink has a zero value vector)
 * Kernels, all deterministic (no atomics, fixed reduction orders):
 *   bwd_pre_kernel    D_i for every (row, head) and per-block dsink partial sums (the Delta pre-pass);
 *                     on Hopper also the work of every tile of the backward grids (launch.h) and
 *                     the zeros of the atomic-dQ accumulator (D = 64) or of its tiles' claim flags
 *                     (D = 128: sm90_bwd_parts.cuh, write_dq)
 *   bwd_order_kernel  dsink_h = ordered sum of the partials; the grids' longest-first tile orders
 *   bwd_dkdv_kernel   one CTA per (kv tile of 64 keys, kv head): loops over the G query heads of
 *                     the group and every q tile that sees the keys; computes S^T = K Q^T so that
 *                     P^T and dS^T are born in registers as A fragments of dV += P^T dO and
 *                     dK += dS^T Q (no shared-memory round trip)
 *   bwd_dq_kernel     one CTA per (q tile of 64 rows, head): recomputes P and dP = dO V^T over the
 *                     same visible tiles as the forward and accumulates dQ in registers
 * dQ from its own kernel costs two extra GEMMs instead of fp32 atomics, and makes every gradient
 * bitwise reproducible. Both mask policies (mask.cuh).
 * Test: pytest tests/test_sink_attention_cuda.py   Bench: python benchmarks/bench_sink_attention.py
 */
#include "common.cuh"
#include "launch.h"
#include "mask.cuh"

namespace ncp {
namespace {

constexpr int QB = 64; /* query rows per step / per dQ CTA */
constexpr int KB = 64; /* keys per dK/dV CTA and per dQ kv tile */
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
static_assert(QB == 16 * kWarps && KB == 16 * kWarps, "one m16 tile per warp");

/* ======================================================================================== */
/* pre-pass: delta and dsink partials                                                        */
/* ======================================================================================== */

constexpr int kPreThreads = 256;

/* Work of every tile of the Hopper backward grids (ws.kv, ws.q; launch.h), blocks x of the extra
 * row y = Hq of the pre-pass grid, grid-stride over the tiles. */
template <class Mask> __device__ __forceinline__ void tile_work(const ncp_sink_attn_params &p, const bwd_workspace &ws) {
    const Mask mask(p);
    const int stride = gridDim.x * kPreThreads;
    for (int t = blockIdx.x * kPreThreads + threadIdx.x; t < ws.kv.n; t += stride) {
        int t0, n;
        const int k1 = (int)min((int64_t)(t + 1) * kBwdKvTile, (int64_t)p.Tk) - 1; /* no int overflow near 2^31 */
        q_tiles_seeing(mask, t * kBwdKvTile, k1, kBwdKvStep, t0, n);
        ws.kv.work[t] = n;
    }
    for (int t = blockIdx.x * kPreThreads + threadIdx.x; t < ws.q.n; t += stride) {
        const q_tile_range r = q_range(mask, t * kBwdQTile, kBwdQTile, kBwdQStep);
        ws.q.work[t] = max(0, r.kt_hi - r.kt_lo + 1);
    }
}

template <typename T, int D, class Mask>
__global__ void __launch_bounds__(kPreThreads) bwd_pre_kernel(const ncp_sink_attn_bwd_params b, const bwd_workspace ws) {
    constexpr int LPR = D / 8, RPW = 32 / LPR, kRows = kPreRows;
    const ncp_sink_attn_params &p = b.f;
    if (blockIdx.y == p.Hq) {
        tile_work<Mask>(p, ws);
        return;
    }
    const int h = blockIdx.y, r0 = blockIdx.x * kRows, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (ws.dq_accum != nullptr) { /* the atomic-dQ accumulator's 64-row tiles of these rows: zeroed here (no
                                   * memset), or with D = 128 their claim flags (the first adder stores) */
        const int n_qt = (p.Tq + 63) / 64, t0 = blockIdx.x * (kRows / 64), nt = min(kRows / 64, n_qt - t0);
        if (ws.dq_flag != nullptr) {
            int32_t *flag = ws.dq_flag + ((int64_t)h * n_qt + t0) * (D / 64);
            for (int i = threadIdx.x; i < nt * (D / 64); i += kPreThreads) flag[i] = 0;
        } else {
            float4 *acc = reinterpret_cast<float4 *>(ws.dq_accum + ((int64_t)h * n_qt + t0) * 64 * D);
            for (int i = threadIdx.x; i < nt * 64 * D / 4; i += kPreThreads) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
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
            ws.delta[(int64_t)h * p.Tq + i] = d;
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
        ws.dsink_part[(int64_t)h * ws.n_part + blockIdx.x] = total;
    }
}

/* Ranks tile t of one grid within its chunk [c0, c1): order[c0 + #tiles of the chunk with more
 * work + #tiles before t with as much] = t (the threads of a chunk read the same words). */
__device__ __forceinline__ void rank_tiles(const tile_order &o) {
    const int t = blockIdx.x * kOrderThreads + threadIdx.x;
    if (t >= o.n) return;
    const int c0 = t / o.chunk * o.chunk, c1 = min(c0 + o.chunk, o.n);
    const int32_t w = o.work[t];
    int pos = c0;
    for (int j = c0; j < t; ++j) pos += o.work[j] >= w;
    for (int j = t + 1; j < c1; ++j) pos += o.work[j] > w;
    o.order[pos] = t;
}

/* Row y = 0: dsink_h = the ordered sum of the partials (block x = 0); rows 1, 2: the dK/dV and dQ
 * grids' longest-first orders. */
__global__ void __launch_bounds__(kOrderThreads) bwd_order_kernel(const ncp_sink_attn_bwd_params b, const bwd_workspace ws) {
    if (blockIdx.y == 1) return rank_tiles(ws.kv);
    if (blockIdx.y == 2) return rank_tiles(ws.q);
    if (blockIdx.x != 0 || b.dsink == nullptr) return;
    /* One warp per head: lane l sums partials l, l + 32, ... in order, then a fixed xor tree (the
     * same order every run: dsink stays bitwise repeatable). With a thread per head summing its
     * partials serially this kernel took 26.5 us at 64k tokens (H200, docs/EXPERIMENTS.md). */
    const int lane = threadIdx.x & 31;
    for (int h = threadIdx.x >> 5; h < b.f.Hq; h += kOrderThreads / 32) {
        const float *part = ws.dsink_part + (int64_t)h * ws.n_part;
        float total = 0.f;
        for (int k = lane; k < ws.n_part; k += 32) total += part[k];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
        if (lane == 0) reinterpret_cast<float *>(b.dsink)[h] = total;
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
    copy_staged_rows<T, D, 64, kThreads>(stage, dst, st, r0, n_rows, tid);
    __syncthreads();
}

/* acc (16 x N per warp) = A B^T: rows [arow, arow + 16) of the [row][k] tile sA against rows
 * [0, N) of the [n][k] tile sB, k over D. */
template <typename T, int D, int N>
__device__ __forceinline__ void mma_abt(float (*acc)[4], uint32_t sA, int arow, uint32_t sB, int lane) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[4];
        load_a<D>(a, sA, arow, 2 * ks, lane);
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            uint32_t bb[4];
            load_b_nk<D>(bb, sB, np * 16, 2 * ks, lane);
            mma16816<T>(acc[2 * np], a, bb);
            mma16816<T>(acc[2 * np + 1], a, bb + 2);
        }
    }
}

/* acc (16 x D per warp) += P B: P the warp's 16 x K accumulators (packed to A fragments), B rows
 * [0, K) of the [k][d] tile sB. */
template <typename T, int D, int K>
__device__ __forceinline__ void mma_pb(float (*acc)[4], const float (*pm)[4], uint32_t sB, int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        uint32_t a[4];
        pack_frag<T>(a, pm[2 * kk], pm[2 * kk + 1]);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t bb[4];
            load_b_kn<D>(bb, sB, kk * 16, 2 * dp, lane);
            mma16816<T>(acc[2 * dp], a, bb);
            mma16816<T>(acc[2 * dp + 1], a, bb + 2);
        }
    }
}

/* ======================================================================================== */
/* dK / dV                                                                                   */
/* ======================================================================================== */

template <int D> constexpr int dkdv_smem_bytes() { return (2 * KB * D + 4 * QB * D) * 2 + 2 * 4 * QB * 4; }

template <typename T, int D, class Mask>
__global__ void __launch_bounds__(kThreads, 2) bwd_dkdv_kernel(const ncp_sink_attn_bwd_params b, const bwd_workspace ws) {
    extern __shared__ __align__(128) unsigned char smem[];
    const ncp_sink_attn_params &p = b.f;
    const uint32_t sK = smem_u32(smem), sV = sK + KB * D * 2, sQ0 = sV + KB * D * 2, sO0 = sQ0 + 2 * QB * D * 2;
    float *s_lse = reinterpret_cast<float *>(smem + (2 * KB * D + 4 * QB * D) * 2); /* [2][QB] */
    float *s_dl = s_lse + 2 * QB;
    int *s_qpos = reinterpret_cast<int *>(s_dl + 2 * QB), *s_qlo = s_qpos + 2 * QB; /* row bounds hi, lo */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int g_kv = blockIdx.x, k0 = blockIdx.y * KB, G = p.Hq / p.Hkv;
    const Mask mask(p);
    int r0, r1; /* the rows that see a key of the CTA */
    mask.rows_seeing(k0, min(k0 + KB, p.Tk) - 1, r0, r1);
    const int qt_lo = r0 / QB, n_q = r1 >= r0 ? r1 / QB - qt_lo + 1 : 0, n_it = n_q * G;
    auto item = [&](int it, int &h, bool &full) -> int {
        const int qt = qt_lo + it % n_q, a = qt * QB;
        h = g_kv * G + it / n_q;
        full = a + QB <= p.Tq && k0 + KB <= p.Tk && k0 + KB - 1 <= mask.hi(a) && k0 >= mask.lo(min(a + QB, p.Tq) - 1);
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
            int lo, hi;
            row_bounds(mask, i, lo, hi);
            s_qpos[stage * QB + tid] = hi;
            s_qlo[stage * QB + tid] = lo;
            s_lse[stage * QB + tid] = i < p.Tq ? p.lse[(int64_t)h * p.Tq + i] * kLog2e : 0.f;
            s_dl[stage * QB + tid] = i < p.Tq ? ws.delta[(int64_t)h * p.Tq + i] : 0.f;
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
        kpos[r] = j >= p.Tk ? kNoKey : j;
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
        mma_abt<T, D, QB>(pt, sK, warp * 16, sQ, lane);
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
        mma_pb<T, D, QB>(dv, pt, sO, lane); /* dV += P^T dO */
        /* dP^T = V dO^T, then dS^T = P^T (dP^T - delta) */
        float ds[QB / 8][4];
        mma_abt<T, D, QB>(ds, sV, warp * 16, sO, lane);
#pragma unroll
        for (int nt = 0; nt < QB / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) ds[nt][e] = pt[nt][e] * (ds[nt][e] - dl[nt * 8 + 2 * tq + (e & 1)]);
        mma_pb<T, D, QB>(dk, ds, sQ, lane); /* dK += dS^T Q */
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

template <int D> constexpr int dq_smem_bytes() { return (2 * QB * D + 4 * KB * D) * 2; }

template <typename T, int D, class Mask>
__global__ void __launch_bounds__(kThreads, 2) bwd_dq_kernel(const ncp_sink_attn_bwd_params b, const bwd_workspace ws) {
    extern __shared__ __align__(128) unsigned char smem[];
    const ncp_sink_attn_params &p = b.f;
    const uint32_t sQ = smem_u32(smem), sO = sQ + QB * D * 2, sK0 = sO + QB * D * 2, sV0 = sK0 + 2 * KB * D * 2;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int h = blockIdx.x, g_kv = h / (p.Hq / p.Hkv);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * QB;
    const Mask mask(p);
    const q_tile_range rng = q_range(mask, q0, QB, KB);
    const int n_it = max(0, rng.kt_hi - rng.kt_lo + 1); /* kv tile of step it: kt_hi - it */
    const T *kh = reinterpret_cast<const T *>(p.k) + (int64_t)g_kv * p.k_sh;
    const T *vh = reinterpret_cast<const T *>(p.v) + (int64_t)g_kv * p.v_sh;
    auto load_kv = [&](int it, int stage) {
        const int kt = rng.kt_hi - it;
        load_tile<D, KB, kThreads>(sK0 + stage * KB * D * 2, kh, p.k_st, kt * KB, p.Tk, tid);
        load_tile<D, KB, kThreads>(sV0 + stage * KB * D * 2, vh, p.v_st, kt * KB, p.Tk, tid);
    };

    load_tile<D, QB, kThreads>(sQ, reinterpret_cast<const T *>(p.q) + (int64_t)h * p.q_sh, p.q_st, q0, p.Tq, tid);
    load_tile<D, QB, kThreads>(sO, reinterpret_cast<const T *>(b.dout) + (int64_t)h * b.do_sh, b.do_st, q0, p.Tq, tid);
    if (n_it > 0) load_kv(0, 0);
    cp_async_commit();

    int lo[2], hi[2];
    float lse[2], dl[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = q0 + warp * 16 + gq + 8 * r;
        row_bounds(mask, i, lo[r], hi[r]);
        lse[r] = i < p.Tq ? p.lse[(int64_t)h * p.Tq + i] * kLog2e : 0.f;
        dl[r] = i < p.Tq ? ws.delta[(int64_t)h * p.Tq + i] : 0.f;
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
        const int k0 = (rng.kt_hi - it) * KB;
        const bool full = full_cols(rng, k0, KB, p.Tk);
        const uint32_t sK = sK0 + stage * KB * D * 2, sV = sV0 + stage * KB * D * 2;

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
                    const int k = k0 + nt * 8 + 2 * tq + (e & 1);
                    if (k < lo[r] || k > hi[r]) x = -INFINITY;
                }
                s[nt][e] = ex2(x) * (dp[nt][e] - dl[r]);
            }
        mma_pb<T, D, KB>(dq, s, sK, lane); /* dQ += dS K */
        __syncthreads();
    }
    cp_async_wait<0>();
    __syncthreads();
    store_tile<T, D>(dq, (float)p.scale, sQ, reinterpret_cast<T *>(b.dq) + (int64_t)h * b.dq_sh, b.dq_st, q0, p.Tq, tid);
}

/* ======================================================================================== */
/* launchers                                                                                 */
/* ======================================================================================== */

/* The pre-pass (plus one row of blocks for the tile work when the grids are ordered), then the
 * order kernel when there is a dsink to sum or an order to rank. */
template <typename T, int D, class Mask>
ncp_status launch_prepass(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, cudaStream_t s) {
    const ncp_sink_attn_params &p = b.f;
    const bool ordered = ws.kv.n > 0 || ws.q.n > 0;
    bwd_pre_kernel<T, D, Mask><<<dim3(ws.n_part, p.Hq + (ordered ? 1 : 0)), kPreThreads, 0, s>>>(b, ws);
    NCP_CUDA_CHECK(cudaGetLastError());
    if (p.sink != nullptr || ordered) {
        const int nb = (max(1, max(ws.kv.n, ws.q.n)) + kOrderThreads - 1) / kOrderThreads;
        bwd_order_kernel<<<dim3(nb, 3), kOrderThreads, 0, s>>>(b, ws);
        NCP_CUDA_CHECK(cudaGetLastError());
    }
    return NCP_OK;
}

template <typename T, int D, class Mask>
ncp_status launch(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, cudaStream_t s) {
    const ncp_sink_attn_params &p = b.f;
    NCP_ARG_CHECK((p.Tq + QB - 1) / QB <= 65535 && (p.Tk + KB - 1) / KB <= 65535,
                  "too many tiles for one launch (Tq=%d, Tk=%d)", p.Tq, p.Tk);
    constexpr int kv_bytes = dkdv_smem_bytes<D>(), q_bytes = dq_smem_bytes<D>();
    auto kv_kernel = bwd_dkdv_kernel<T, D, Mask>;
    auto q_kernel = bwd_dq_kernel<T, D, Mask>;
    NCP_CUDA_CHECK(cudaFuncSetAttribute(kv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kv_bytes));
    NCP_CUDA_CHECK(cudaFuncSetAttribute(q_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, q_bytes));
    if (p.Tk > 0) {
        kv_kernel<<<dim3(p.Hkv, (p.Tk + KB - 1) / KB), kThreads, kv_bytes, s>>>(b, ws);
        NCP_CUDA_CHECK(cudaGetLastError());
    }
    if (p.Tq > 0) {
        q_kernel<<<dim3(p.Hq, (p.Tq + QB - 1) / QB), kThreads, q_bytes, s>>>(b, ws);
        NCP_CUDA_CHECK(cudaGetLastError());
    }
    return NCP_OK;
}

}  // namespace

ncp_status attn_bwd_prepass(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, cudaStream_t s) {
    const bool bf16 = b.f.dtype == NCP_DT_BF16, table = b.f.mask.kind == NCP_MASK_TABLE;
#define NCP_PRE(T, D) (table ? launch_prepass<T, D, TableMask>(b, ws, s) : launch_prepass<T, D, DocsMask>(b, ws, s))
    if (b.f.D == 64) return bf16 ? NCP_PRE(__nv_bfloat16, 64) : NCP_PRE(__half, 64);
    return bf16 ? NCP_PRE(__nv_bfloat16, 128) : NCP_PRE(__half, 128);
#undef NCP_PRE
}

ncp_status attn_bwd_portable(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, cudaStream_t s) {
    const bool bf16 = b.f.dtype == NCP_DT_BF16, table = b.f.mask.kind == NCP_MASK_TABLE;
#define NCP_BWD(T, D) (table ? launch<T, D, TableMask>(b, ws, s) : launch<T, D, DocsMask>(b, ws, s))
    if (b.f.D == 64) return bf16 ? NCP_BWD(__nv_bfloat16, 64) : NCP_BWD(__half, 64);
    return bf16 ? NCP_BWD(__nv_bfloat16, 128) : NCP_BWD(__half, 128);
#undef NCP_BWD
}

}  // namespace ncp
