/*
 * cuda/sink_attn_bwd_sm90.cu: learned-sink attention backward for Hopper (sm_90a), contiguous
 * mode: TMA + wgmma, warp-specialized like sink_attn_fwd_sm90.cu (one producer warpgroup issuing
 * TMA into mbarrier-guarded stages, two consumer warpgroups with setmaxnreg). The portable
 * pre-pass (sink_attn_bwd.cu: Delta = rowsum(dO * O) and the dsink partials) runs before these.
 *
 * In the log2 domain with x = s log2(e) <q, k>:  P = 2^(x - lse log2(e)) on visible pairs,
 *   dS = P (dP - Delta),  dP = dO V^T,  dV = sum P^T dO,  dK = s sum dS^T Q,  dQ = s sum dS K.
 *
 * dK/dV kernel: CTA = 128 keys of one kv head (64 per consumer warpgroup), K and V stationary in
 *   shared memory; it walks (query head of the group, q tile of 64 rows) over the q tiles that see
 *   a key of the CTA, streaming Q and dO tiles. Per tile and warpgroup: S^T = K Q^T and
 *   dP^T = V dO^T (A and B from shared memory), P^T and dS^T in registers (the mask is a separate
 *   pass on partial tiles only: folded into the exponentials it cost enough registers for ptxas to
 *   serialize every wgmma), then dV += P^T dO (A from registers) and dK += dS^T Q.
 * Modes (template MODE):
 *   kAtomicDq / kAtomicDqBulk (default; not under NCP_DETERMINISTIC=1 or torch deterministic mode):
 *     dS^T also goes to shared memory; dK += dS^T Q and dQ = dS K read it from there, and dQ is
 *     added into the fp32 workspace b.dq_accum: by one bulk asynchronous reduction of a staged
 *     64 x 64 tile per warpgroup and item (BULK, default), or by per-thread red.global.add.v2.f32
 *     (NCP_SM90_DQ=red, slower). A small kernel then writes dq = scale * dq_accum. 5 MMAs per
 *     tile; the order of the dQ additions, so the last bits of dq, vary from run to run.
 *   kDet / kDetOverlap (deterministic): no atomics; dQ comes from the dQ kernel below, which
 *     recomputes S and dP (7 MMAs per tile). kDetOverlap (NCP_SM90_BWD_OVERLAP=1) runs the dV/dK
 *     MMAs of item it back to back with S/dP of it+1; slower.
 * dQ kernel (deterministic mode): CTA = 128 query rows of one head (64 per consumer warpgroup), Q
 *   and dO stationary; it walks the kv tiles of 64 keys the rows see (as the forward), streaming K
 *   and V: S = Q K^T, dP = dO V^T, then dQ += dS K.
 * Positions mode (Flint CP) keeps the portable kernels.
 *
 * H200, bf16, 32/4/128, causal 8k documents (commit 336b2cb): forward+backward 432 TFLOP/s with the
 * default backward, 406 deterministic (before the mask pass, when ptxas serialized the wgmma: 362
 * and 328). Measured: BENCHMARKS.md section 1.
 * Test: pytest tests/test_sink_attention_cuda.py   Bench: python benchmarks/bench_sink_attention.py
 */
#include <stdlib.h>
#include <string.h>

#include "ncp/ncp_check.h"
#include "ncp_internal.h"
#include "sink_attn_common.cuh"
#include "sm90_gemm.cuh"

namespace ncp {
namespace {

constexpr int kThreads = 384; /* producer + 2 consumer warpgroups */
constexpr int kStages = 3;
constexpr int KVB = 128;      /* dK/dV kernel: keys per CTA */
constexpr int KQB = 64;       /* dK/dV kernel: q rows per streamed tile */
constexpr int QQB = 128;      /* dQ kernel: q rows per CTA */
constexpr int QKB = 64;       /* dQ kernel: keys per streamed tile */
constexpr int kDsBar = 3;     /* named barrier: both warpgroups' dS^T stored (atomic-dQ kernel) */
/* dK/dV kernel modes: deterministic (dQ from its own kernel), the same with MMA overlap, and dQ
 * accumulated in the kernel, by per-thread vector reductions (RED) or by bulk async reductions
 * of a staged 64 x 64 fp32 tile (BULK). */
enum { kDet = 0, kDetOverlap = 1, kAtomicDq = 2, kAtomicDqBulk = 3 };

/* Shared layout of both kernels: two stationary tiles of SR rows, kStages x two streamed tiles of
 * TR rows, with DS (atomic-dQ dK/dV kernel) two dS^T tiles of SR x TR, the mbarriers (stat_full, a_full[S], b_full[S], empty[S]), then kStages x TR floats of
 * lse * log2(e) and of Delta for the streamed q tiles (dK/dV kernel). */
template <int D, int SR, int TR, bool DS = false, bool STAGE = false> struct bwd_layout {
    static constexpr int stat_bytes = SR * D * 2;
    static constexpr int tile_bytes = TR * D * 2;
    static constexpr int s1_off = stat_bytes;
    static constexpr int a_off = 2 * stat_bytes;
    static constexpr int b_off = a_off + kStages * tile_bytes;
    static constexpr int ds_bytes = SR * TR * 2; /* one dS^T tile: SR key rows x TR queries */
    static constexpr int ds_off = b_off + kStages * tile_bytes;
    static constexpr int stage_off = ds_off + (DS ? 2 * ds_bytes : 0); /* 2 x 64 x 64 fp32 dQ tiles */
    static constexpr int bar_off = stage_off + (STAGE ? 2 * 64 * 64 * 4 : 0);
    static constexpr int vec_off = bar_off + 128;
    static constexpr int bytes = vec_off + 2 * kStages * TR * 4 + 1024;
};

#ifdef NCP_SM90_DEVICE
struct bars {
    uint32_t base;
    __device__ uint32_t stat() const { return base; }
    __device__ uint32_t a(int s) const { return base + 8u * (1 + s); }
    __device__ uint32_t b(int s) const { return base + 8u * (1 + kStages + s); }
    __device__ uint32_t e(int s) const { return base + 8u * (1 + 2 * kStages + s); }
    __device__ void init(int a_arrivals) const {
        sm90::mbar_init(stat(), 1);
        for (int s = 0; s < kStages; ++s) {
            sm90::mbar_init(a(s), a_arrivals);
            sm90::mbar_init(b(s), 1);
            sm90::mbar_init(e(s), 8); /* one arrival per consumer warp */
        }
        sm90::mbar_fence_init();
    }
};

/* Stores a warpgroup's 64 x D fp32 accumulator tile (times mul) as T rows [r0, r0 + 64) of dst,
 * staged through rows [srow0, srow0 + 64) of the 128B-swizzled shared tile `stage` of SR rows. */
template <typename T, int D, int SR>
__device__ __forceinline__ void store_rows(const float *acc, float mul, uint32_t stage, int srow0, T *dst, int64_t st,
                                           int r0, int n_rows, int cw) {
    const int tid = threadIdx.x & 127, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint32_t v = elem<T>::pack(acc[4 * j + 2 * r] * mul, acc[4 * j + 2 * r + 1] * mul);
            const uint32_t addr = stage + sm90::sw128_offset(SR, srow0 + 16 * warp + gq + 8 * r, 8 * j + 2 * tq);
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v));
        }
    sm90::named_sync(1 + cw, 128);
    constexpr int kChunks = D / 8;
    for (int i = tid; i < 64 * kChunks; i += 128) {
        const int row = i / kChunks, chunk = i % kChunks, g = r0 + row;
        if (g >= n_rows) continue;
        uint4 v;
        asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(stage + sm90::sw128_offset(SR, srow0 + row, chunk * 8)));
        *reinterpret_cast<uint4 *>(dst + (int64_t)g * st + chunk * 8) = v;
    }
    sm90::named_sync(1 + cw, 128);
}
#endif


/* Position (in float2 units) of a warpgroup's dQ fragment pair (warp, j, r, lane) inside a staged
 * 64 x 64 fp32 tile in "fragment order": rows 16 warp + lane / 4 + 8 r, columns 8 j + 2 (lane % 4)
 * + {0, 1}. A warp's 32 lanes write 256 contiguous bytes (no bank conflicts). */
__host__ __device__ __forceinline__ int dq_frag_pos(int warp, int j, int r, int lane) {
    return ((warp * 8 + j) * 2 + r) * 32 + lane;
}

/* ======================================================================================== */
/* dK / dV                                                                                   */
/* ======================================================================================== */
template <typename T, int D, int MODE>
__global__ void __launch_bounds__(kThreads, 1)
    bwd_dkdv_sm90_kernel(const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                         const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                         const ncp_sink_attn_bwd_params b) {
#ifdef NCP_SM90_DEVICE
    constexpr bool OVERLAP = MODE == kDetOverlap, BULK = MODE == kAtomicDqBulk, ADQ = MODE == kAtomicDq || BULK;
    using L = bwd_layout<D, KVB, KQB, ADQ, BULK>;
    const ncp_sink_attn_params &p = b.f;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t sK = base, sV = base + L::s1_off, sQ0 = base + L::a_off, sO0 = base + L::b_off;
    const uint32_t sDS0 = base + L::ds_off, sStage = base + L::stage_off;
    const bars bar{base + L::bar_off};
    float *s_l2 = reinterpret_cast<float *>(smem_raw + (base - smem_u32(smem_raw)) + L::vec_off); /* [S][KQB] */
    float *s_dl = s_l2 + kStages * KQB;
    const int tid = threadIdx.x, wg = tid / 128, lane = tid & 31;
    const int g_kv = blockIdx.x, k0 = blockIdx.y * KVB, G = p.Hq / p.Hkv;
    if (tid == 0) bar.init(2); /* a_full: the TMA thread and the lse/Delta warp */
    __syncthreads();

    /* q tiles that see a key of [k0, k0 + KVB): rows k0 .. doc end / window reach */
    const int k_last = min(k0 + KVB, p.Tk) - 1;
    int q_hi = doc_end(p.cu_seqlens, p.n_cu, k_last, p.Tq) - 1;
    if (p.window > 0) q_hi = min(q_hi, k_last + p.window - 1);
    q_hi = min(q_hi, p.Tq - 1);
    const int qt_lo = k0 / KQB, n_q = max(0, q_hi / KQB - qt_lo + 1), n_it = n_q * G;

    if (wg == 0) {
        sm90::reg_dealloc<24>();
        if (tid == 0) {
            sm90::mbar_expect_tx(bar.stat(), 2 * L::stat_bytes);
            sm90::tma_load_tile_pair<D>(sK, &tm_k, sV, &tm_v, KVB, g_kv, k0, bar.stat());
            for (int it = 0; it < n_it; ++it) {
                const int s = it % kStages, h = g_kv * G + it / n_q, q0 = (qt_lo + it % n_q) * KQB;
                if (it >= kStages) sm90::mbar_wait(bar.e(s), ((it / kStages) & 1) ^ 1);
                const uint32_t sQ = sQ0 + s * L::tile_bytes, sO = sO0 + s * L::tile_bytes;
                sm90::mbar_expect_tx(bar.a(s), L::tile_bytes);
                sm90::tma_load_tile<D>(sQ, &tm_q, KQB, h, q0, bar.a(s));
                sm90::mbar_expect_tx(bar.b(s), L::tile_bytes);
                sm90::tma_load_tile<D>(sO, &tm_do, KQB, h, q0, bar.b(s));
            }
        } else if (tid >> 5 == 1) {
            /* warp 1: lse * log2(e) and Delta of each streamed q tile into shared memory */
            for (int it = 0; it < n_it; ++it) {
                const int s = it % kStages, h = g_kv * G + it / n_q, q0 = (qt_lo + it % n_q) * KQB;
                if (it >= kStages) sm90::mbar_wait(bar.e(s), ((it / kStages) & 1) ^ 1);
                for (int c = lane; c < KQB; c += 32) {
                    const int q = q0 + c;
                    const bool ok = q < p.Tq;
                    s_l2[s * KQB + c] = ok ? __ldg(p.lse + (int64_t)h * p.Tq + q) * kLog2e : 0.f;
                    s_dl[s * KQB + c] = ok ? __ldg(b.delta + (int64_t)h * p.Tq + q) : 0.f;
                }
                __syncwarp();
                if (lane == 0) sm90::mbar_arrive(bar.a(s));
            }
        }
        return;
    }

    sm90::reg_alloc<240>();
    const int cw = wg - 1, warp = (tid & 127) >> 5, gq = lane >> 2, tq = lane & 3;
    const int krow0 = 64 * cw + 16 * warp + gq; /* this thread's key rows krow0, krow0 + 8 of the CTA */
    int kpos[2], kend[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int k = k0 + krow0 + 8 * r;
        kpos[r] = k < p.Tk ? k : kNoKey;
        kend[r] = k < p.Tk ? doc_end(p.cu_seqlens, p.n_cu, k, p.Tq) : 0; /* queries < kend share k's document */
    }
    const float scale_log2 = (float)p.scale * kLog2e;
    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
    const uint32_t sKw = sK + cw * 64 * 128, sVw = sV + cw * 64 * 128;
    sm90::mbar_wait(bar.stat(), 0);

    /* S^T = K Q^T and dP^T = V dO^T of item it, issued asynchronously */
    auto issue_sdp = [&](float *st, float *dpt, int it) {
        const int s = it % kStages;
        const uint32_t ph = (it / kStages) & 1;
        const uint32_t sQ = sQ0 + s * L::tile_bytes, sO = sO0 + s * L::tile_bytes;
        sm90::mbar_wait(bar.a(s), ph);
        sm90::gemm_ss<T, KQB, D>(st, sKw, KVB * 128, sQ, KQB * 128);
        sm90::mbar_wait(bar.b(s), ph);
        sm90::gemm_ss<T, KQB, D>(dpt, sVw, KVB * 128, sO, KQB * 128);
    };
    /* Whether every (key, query) pair of item it is visible (no mask needed). */
    auto item_full = [&](int it) {
        const int q0 = (qt_lo + it % n_q) * KQB;
        const int lo_last = first_key(p.cu_seqlens, p.n_cu, p.window, min(q0 + KQB, p.Tq) - 1);
        return q0 + KQB <= p.Tq && k0 + KVB <= p.Tk && k0 + KVB - 1 <= q0 && k0 >= lo_last;
    };
    /* P^T and dS^T of item it in place for accumulator column blocks j in [j0, j1); columns are
     * queries q0 + 8j + 2tq + c, rows the two keys */
    auto probs_cols = [&](float *st, float *dpt, int it, bool full, int j0, int j1) {
        const int s = it % kStages, q0 = (qt_lo + it % n_q) * KQB;
#pragma unroll
        for (int j = j0; j < j1; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float l2 = s_l2[s * KQB + 8 * j + 2 * tq + c];
                const float dl = s_dl[s * KQB + 8 * j + 2 * tq + c];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int e = 2 * r + c;
                    const float pv = ex2(st[4 * j + e] * scale_log2 - l2);
                    st[4 * j + e] = pv;
                    dpt[4 * j + e] = pv * (dpt[4 * j + e] - dl);
                }
            }
        if (!full) { /* a separate pass, so full items carry none of the mask's registers */
#pragma unroll
            for (int j = j0; j < j1; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int q = q0 + 8 * j + 2 * tq + c;
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int e = 2 * r + c;
                        const bool vis = q < p.Tq && kpos[r] <= q && q < kend[r] && (p.window <= 0 || q - kpos[r] < p.window);
                        if (!vis) st[4 * j + e] = dpt[4 * j + e] = 0.f; /* overwrites inf/nan of hidden pairs */
                    }
                }
        }
    };
    auto probs = [&](float *st, float *dpt, int it) { probs_cols(st, dpt, it, item_full(it), 0, KQB / 8); };
    /* dV += P^T dO, dK += dS^T Q of item it, issued asynchronously */
    auto issue_dkdv = [&](uint32_t (*pf)[4], uint32_t (*df)[4], int it) {
        const int s = it % kStages;
        sm90::fence_regs(dv, D / 2);
        sm90::fence_regs(dk, D / 2);
        sm90::wg_fence();
        sm90::rs_steps<T, D, KQB>(dv, pf, sO0 + s * L::tile_bytes, KQB * 128);
        sm90::rs_steps<T, D, KQB>(dk, df, sQ0 + s * L::tile_bytes, KQB * 128);
        sm90::wg_commit();
    };
    auto fence_frags = [&](uint32_t (*pf)[4], uint32_t (*df)[4]) {
#pragma unroll
        for (int kk = 0; kk < KQB / 16; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(pf[kk][e]), "+r"(df[kk][e])::"memory");
    };
    auto release = [&](int it) {
        __syncwarp(); /* every lane's reads of the stage (lse/Delta) precede the warp's arrival */
        if (lane == 0) sm90::mbar_arrive(bar.e(it % kStages));
    };

    if (ADQ) {
        /* dQ of the item's 64 query rows, dS K, accumulated in fp32 into b.dq_accum. D = 128:
         * warpgroup cw computes columns [64 cw, 64 cw + 64) over all 128 keys, so both warpgroups'
         * dS^T must be in shared memory (named barrier kDsBar, 256 threads). D = 64: each warpgroup
         * adds its own 64 keys' share of all 64 columns. dS^T is double-buffered: a warpgroup
         * rewrites buffer it & 1 only after passing the barrier of item it - 1, which the other
         * warpgroup reaches after its dQ MMA of item it - 2 is done.
         * RED: dq_accum is (Hq, Tq, D); each thread adds its fragments with red.global.add.v2.f32.
         * BULK: dq_accum is (Hq, ceil(Tq / 64), D / 64, 4096) in fragment order (dq_frag_index);
         *   the warpgroup stages its 64 x 64 tile in shared memory and one thread adds it with one
         *   asynchronous bulk reduction; the staging tile is rewritten only after that thread has
         *   waited for the previous reduction's reads, before the barrier that precedes the MMA. */
        constexpr int kDqKeys = D == 128 ? KVB : 64;
        const int key0 = D == 128 ? 0 : 64 * cw, cb = D == 128 ? cw : 0;
        const uint32_t sKcol = sK + cb * KVB * 128 + key0 * 128;
        const uint32_t sStw = sStage + cw * 64 * 64 * 4;
        const bool leader = (tid & 127) == 0;
        const int n_qt = (p.Tq + KQB - 1) / KQB;
        for (int it = 0; it < n_it; ++it) {
            float st[KQB / 2], dpt[KQB / 2]; /* per item: no loop-carried accumulator copies */
            uint32_t pf[KQB / 16][4];
            issue_sdp(st, dpt, it);
            sm90::wg_wait<0>();
            sm90::fence_regs(st, KQB / 2);
            sm90::fence_regs(dpt, KQB / 2);
            /* P^T into fragments and dS^T (keys x queries, 128B-swizzled rows of 64 queries) into
             * shared memory, 16 queries at a time to bound the live registers. dS^T is the A operand
             * of dK += dS^T Q (K-major, this warpgroup's 64 rows) and of dQ = dS K (MN-major), both
             * from shared memory, so no dS fragments stay in registers while the MMAs run. */
            const uint32_t sDS = sDS0 + (it & 1) * L::ds_bytes;
            const bool full = item_full(it);
#pragma unroll
            for (int kk = 0; kk < KQB / 16; ++kk) {
                probs_cols(st, dpt, it, full, 2 * kk, 2 * kk + 2);
                pf[kk][0] = elem<T>::pack(st[8 * kk + 0], st[8 * kk + 1]);
                pf[kk][1] = elem<T>::pack(st[8 * kk + 2], st[8 * kk + 3]);
                pf[kk][2] = elem<T>::pack(st[8 * kk + 4], st[8 * kk + 5]);
                pf[kk][3] = elem<T>::pack(st[8 * kk + 6], st[8 * kk + 7]);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int c = 8 * kk + 2 * (e & 1) + 4 * (e >> 1); /* the to_frags pairing */
                    const uint32_t v = elem<T>::pack(dpt[c], dpt[c + 1]);
                    const uint32_t addr = sDS + sm90::sw128_offset(KVB, krow0 + 8 * (e & 1), 16 * kk + 8 * (e >> 1) + 2 * tq);
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v));
                }
            }
            const int s = it % kStages;
            const uint32_t sQs = sQ0 + s * L::tile_bytes, sOs = sO0 + s * L::tile_bytes;
            sm90::fence_regs(dv, D / 2);
            sm90::wg_fence();
            sm90::rs_steps<T, D, KQB>(dv, pf, sOs, KQB * 128); /* dV += P^T dO */
            sm90::wg_commit();
            sm90::fence_proxy_async_smem(); /* the generic-proxy stores above, before wgmma reads */
            if (BULK && leader) sm90::bulk_wait_read<0>(); /* staging free once this barrier passes */
            if (D == 128)
                sm90::named_sync(kDsBar, 256);
            else
                sm90::named_sync(1 + cw, 128);
            float dq[32];
            sm90::fence_regs(dk, D / 2);
            sm90::fence_regs(dq, 32);
            sm90::wg_fence();
#pragma unroll
            for (int ks = 0; ks < KQB / 16; ++ks) /* dK += dS^T Q */
                sm90::wgmma<T, D>::template ss<0, 1>(dk, sm90::desc_kmajor(sDS + 64 * cw * 128 + ks * 32),
                                                     sm90::desc_mnmajor(sQs + ks * 16 * 128, KQB * 128), 1);
#pragma unroll
            for (int ks = 0; ks < kDqKeys / 16; ++ks) /* dQ (this warpgroup's share) = dS K */
                sm90::wgmma<T, 64>::template ss<1, 1>(dq, sm90::desc_mnmajor(sDS + (key0 + 16 * ks) * 128, KQB * 128),
                                                      sm90::desc_mnmajor(sKcol + ks * 16 * 128, KVB * 128), ks > 0);
            sm90::wg_commit();
            sm90::wg_wait<0>();
            sm90::fence_regs(dv, D / 2);
            sm90::fence_regs(dk, D / 2);
            sm90::fence_regs(dq, 32);
#pragma unroll
            for (int kk = 0; kk < KQB / 16; ++kk)
#pragma unroll
                for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(pf[kk][e])::"memory");
            release(it);
            const int h = g_kv * G + it / n_q, qt = qt_lo + it % n_q, q0 = qt * KQB;
            if (BULK) {
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int r = 0; r < 2; ++r)
                        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(sStw + 8 * dq_frag_pos(warp, j, r, lane)),
                                     "f"(dq[4 * j + 2 * r]), "f"(dq[4 * j + 2 * r + 1]));
                sm90::fence_proxy_async_smem();
                sm90::named_sync(1 + cw, 128);
                if (leader) {
                    float *dst = b.dq_accum + (((int64_t)h * n_qt + qt) * (D / 64) + cb) * 4096;
                    sm90::bulk_reduce_add_f32(dst, sStw, 64 * 64 * 4);
                }
            } else {
                float *dqh = b.dq_accum + (int64_t)h * p.Tq * D + 64 * cb + 2 * tq;
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int q = q0 + 16 * warp + gq + 8 * r;
                    if (q < p.Tq) {
#pragma unroll
                        for (int j = 0; j < 8; ++j)
                            sm90::red_add_v2(dqh + (int64_t)q * D + 8 * j, dq[4 * j + 2 * r], dq[4 * j + 2 * r + 1]);
                    }
                }
            }
        }
        if (BULK && leader) sm90::bulk_wait_read<0>(); /* shared memory must outlive the last reads */
    } else if (!OVERLAP) {
        for (int it = 0; it < n_it; ++it) {
            float st[KQB / 2], dpt[KQB / 2];
            uint32_t pf[KQB / 16][4], df[KQB / 16][4];
            issue_sdp(st, dpt, it);
            sm90::wg_wait<0>();
            sm90::fence_regs(st, KQB / 2);
            sm90::fence_regs(dpt, KQB / 2);
            probs(st, dpt, it);
            to_frags<T, KQB>(pf, st);
            to_frags<T, KQB>(df, dpt);
            issue_dkdv(pf, df, it);
            sm90::wg_wait<0>();
            sm90::fence_regs(dv, D / 2);
            sm90::fence_regs(dk, D / 2);
            fence_frags(pf, df);
            release(it);
        }
    } else if (n_it > 0) {
        float st[KQB / 2], dpt[KQB / 2];
        uint32_t pf[KQB / 16][4], df[KQB / 16][4];
        /* dV/dK of item it and S^T/dP^T of item it + 1 run back to back on the tensor cores */
        issue_sdp(st, dpt, 0);
        for (int it = 0; it < n_it; ++it) {
            sm90::wg_wait<0>();
            sm90::fence_regs(st, KQB / 2);
            sm90::fence_regs(dpt, KQB / 2);
            sm90::fence_regs(dv, D / 2);
            sm90::fence_regs(dk, D / 2);
            fence_frags(pf, df);
            if (it > 0) release(it - 1);
            probs(st, dpt, it);
            to_frags<T, KQB>(pf, st);
            to_frags<T, KQB>(df, dpt);
            issue_dkdv(pf, df, it);
            if (it + 1 < n_it) issue_sdp(st, dpt, it + 1);
        }
        sm90::wg_wait<0>();
        sm90::fence_regs(dv, D / 2);
        sm90::fence_regs(dk, D / 2);
        fence_frags(pf, df);
        release(n_it - 1);
    }

    /* rows of this warpgroup in sK / sV are free once its MMAs are done: stage dK, dV there */
    store_rows<T, D, KVB>(dk, (float)p.scale, sK, 64 * cw, reinterpret_cast<T *>(b.dk) + (int64_t)g_kv * b.dk_sh, b.dk_st,
                          k0 + 64 * cw, p.Tk, cw);
    store_rows<T, D, KVB>(dv, 1.f, sV, 64 * cw, reinterpret_cast<T *>(b.dv) + (int64_t)g_kv * b.dv_sh, b.dv_st,
                          k0 + 64 * cw, p.Tk, cw);
#else
    __trap(); /* never launched: the host only picks this kernel on sm_90a builds and devices */
#endif
}

/* ======================================================================================== */
/* dQ                                                                                        */
/* ======================================================================================== */
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1)
    bwd_dq_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                       const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                       const ncp_sink_attn_bwd_params b) {
#ifdef NCP_SM90_DEVICE
    using L = bwd_layout<D, QQB, QKB>;
    const ncp_sink_attn_params &p = b.f;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t sQ = base, sO = base + L::s1_off, sK0 = base + L::a_off, sV0 = base + L::b_off;
    const bars bar{base + L::bar_off};
    const int tid = threadIdx.x, wg = tid / 128, lane = tid & 31;
    const int h = blockIdx.x, g_kv = h / (p.Hq / p.Hkv);
    const int tile = gridDim.y - 1 - blockIdx.y, q0 = tile * QQB;
    if (tid == 0) bar.init(1);
    __syncthreads();

    const q_tile_range rng = contiguous_q_range(p, q0, QQB, QKB);
    const int n_it = max(0, rng.kt_hi - rng.kt_lo + 1);

    if (wg == 0) {
        sm90::reg_dealloc<24>();
        if (tid == 0) {
            sm90::mbar_expect_tx(bar.stat(), 2 * L::stat_bytes);
            sm90::tma_load_tile_pair<D>(sQ, &tm_q, sO, &tm_do, QQB, h, q0, bar.stat());
            for (int it = 0; it < n_it; ++it) {
                const int s = it % kStages, kt = rng.kt_hi - it;
                if (it >= kStages) sm90::mbar_wait(bar.e(s), ((it / kStages) & 1) ^ 1);
                const uint32_t sK = sK0 + s * L::tile_bytes, sV = sV0 + s * L::tile_bytes;
                sm90::mbar_expect_tx(bar.a(s), L::tile_bytes);
                sm90::tma_load_tile<D>(sK, &tm_k, QKB, g_kv, kt * QKB, bar.a(s));
                sm90::mbar_expect_tx(bar.b(s), L::tile_bytes);
                sm90::tma_load_tile<D>(sV, &tm_v, QKB, g_kv, kt * QKB, bar.b(s));
            }
        }
        return;
    }

    sm90::reg_alloc<240>();
    const int cw = wg - 1, warp = (tid & 127) >> 5, gq = lane >> 2, tq = lane & 3;
    const int row0 = 64 * cw + 16 * warp + gq;
    int qpos[2], qlo[2];
    float l2[2], dl[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = q0 + row0 + 8 * r;
        row_bounds(p, i, qpos[r], qlo[r]);
        l2[r] = i < p.Tq ? __ldg(p.lse + (int64_t)h * p.Tq + i) * kLog2e : 0.f;
        dl[r] = i < p.Tq ? __ldg(b.delta + (int64_t)h * p.Tq + i) : 0.f;
    }
    const float scale_log2 = (float)p.scale * kLog2e;
    float dq[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dq[i] = 0.f;
    const uint32_t sQw = sQ + cw * 64 * 128, sOw = sO + cw * 64 * 128;
    sm90::mbar_wait(bar.stat(), 0);

    for (int it = 0; it < n_it; ++it) {
        const int s = it % kStages, kt = rng.kt_hi - it;
        const uint32_t ph = (it / kStages) & 1;
        const bool full = contiguous_full(p, rng, kt, QKB);
        const uint32_t sK = sK0 + s * L::tile_bytes, sV = sV0 + s * L::tile_bytes;

        float sc[QKB / 2], dp[QKB / 2];
        sm90::mbar_wait(bar.a(s), ph);
        sm90::gemm_ss<T, QKB, D>(sc, sQw, QQB * 128, sK, QKB * 128);
        sm90::mbar_wait(bar.b(s), ph);
        sm90::gemm_ss<T, QKB, D>(dp, sOw, QQB * 128, sV, QKB * 128);
        sm90::wg_wait<0>();
        sm90::fence_regs(sc, QKB / 2);
        sm90::fence_regs(dp, QKB / 2);

#pragma unroll
        for (int j = 0; j < QKB / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                bool vis = true;
                if (!full) {
                    const int kj = kt * QKB + 8 * j + 2 * tq + (e & 1);
                    vis = kj < p.Tk && kj >= qlo[r] && kj <= qpos[r];
                }
                const float pv = vis ? ex2(sc[4 * j + e] * scale_log2 - l2[r]) : 0.f;
                dp[4 * j + e] = pv * (dp[4 * j + e] - dl[r]);
            }
        uint32_t df[QKB / 16][4];
        to_frags<T, QKB>(df, dp);
        sm90::gemm_rs<T, D, QKB>(dq, df, sK, QKB * 128);
        sm90::wg_wait<0>();
        sm90::fence_regs(dq, D / 2);
#pragma unroll
        for (int kk = 0; kk < QKB / 16; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(df[kk][e])::"memory");
        __syncwarp();
        if (lane == 0) sm90::mbar_arrive(bar.e(s));
    }
    store_rows<T, D, QQB>(dq, (float)p.scale, sQ, 64 * cw, reinterpret_cast<T *>(b.dq) + (int64_t)h * b.dq_sh, b.dq_st,
                          q0 + 64 * cw, p.Tq, cw);
#else
    __trap(); /* never launched: the host only picks this kernel on sm_90a builds and devices */
#endif
}

/* dq[t, h, :] = scale * dq_accum in T; 8 columns per thread. RED layout: dq_accum[h, t, :]; BULK
 * layout: 64 x 64 tiles (h, t / 64, d / 64) in fragment order (dq_frag_pos). */
template <typename T, int D, bool BULK>
__global__ void __launch_bounds__(256) dq_convert_kernel(const float *__restrict__ acc, T *dq, int64_t st, int64_t sh,
                                                         int Tq, int Hq, float scale) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, n = (int64_t)Hq * Tq * (D / 8);
    if (i >= n) return;
    const int c = (int)(i % (D / 8)) * 8;
    const int64_t ht = i / (D / 8);
    const int t = (int)(ht % Tq), h = (int)(ht / Tq);
    const float *src = acc + ht * D + c;
    if (BULK) {
        const int n_qt = (Tq + 63) / 64, row = t % 64, rr = row % 16;
        const int64_t tile = ((int64_t)h * n_qt + t / 64) * (D / 64) + c / 64;
        src = acc + tile * 4096 + 2 * dq_frag_pos(row / 16, (c % 64) / 8, rr / 8, (rr % 8) * 4);
    }
    const float4 a = *reinterpret_cast<const float4 *>(src);
    const float4 b = *reinterpret_cast<const float4 *>(src + 4);
    uint4 v;
    v.x = elem<T>::pack(a.x * scale, a.y * scale);
    v.y = elem<T>::pack(a.z * scale, a.w * scale);
    v.z = elem<T>::pack(b.x * scale, b.y * scale);
    v.w = elem<T>::pack(b.z * scale, b.w * scale);
    *reinterpret_cast<uint4 *>(dq + (int64_t)t * st + (int64_t)h * sh + c) = v;
}

/* NCP_SM90_DQ=red|bulk picks how the atomic-dQ kernel adds dQ (read per call; default bulk). */
static bool dq_bulk() {
    const char *e = getenv("NCP_SM90_DQ");
    return !(e != nullptr && strcmp(e, "red") == 0);
}

/* The dK/dV kernel in mode MODE over every 128-key block (Tk > 0). */
template <typename T, int D, int MODE> ncp_status launch_dkdv(const ncp_sink_attn_bwd_params &b, cudaStream_t stream) {
    const ncp_sink_attn_params &p = b.f;
    CUtensorMap tk, tv, tq, tdo;
    NCP_TRY(ncp_sm90_tensor_map(&tk, p.k, p.Tk, p.Hkv, D, p.k_st, p.k_sh, KVB));
    NCP_TRY(ncp_sm90_tensor_map(&tv, p.v, p.Tk, p.Hkv, D, p.v_st, p.v_sh, KVB));
    NCP_TRY(ncp_sm90_tensor_map(&tq, p.q, p.Tq, p.Hq, D, p.q_st, p.q_sh, KQB));
    NCP_TRY(ncp_sm90_tensor_map(&tdo, b.dout, p.Tq, p.Hq, D, b.do_st, b.do_sh, KQB));
    constexpr bool adq = MODE == kAtomicDq || MODE == kAtomicDqBulk;
    constexpr int bytes = bwd_layout<D, KVB, KQB, adq, MODE == kAtomicDqBulk>::bytes;
    auto kernel = bwd_dkdv_sm90_kernel<T, D, MODE>;
    NCP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    kernel<<<dim3(p.Hkv, (p.Tk + KVB - 1) / KVB), kThreads, bytes, stream>>>(tk, tv, tq, tdo, b);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}

template <typename T, int D, int MODE> ncp_status launch_adq(const ncp_sink_attn_bwd_params &b, cudaStream_t stream) {
    const ncp_sink_attn_params &p = b.f;
    const size_t n_acc = (size_t)p.Hq * ((p.Tq + 63) / 64) * 64 * D;
    NCP_CUDA_CHECK(cudaMemsetAsync(b.dq_accum, 0, sizeof(float) * n_acc, stream));
    if (p.Tk > 0) NCP_TRY((launch_dkdv<T, D, MODE>(b, stream)));
    const int64_t n = (int64_t)p.Hq * p.Tq * (D / 8);
    dq_convert_kernel<T, D, MODE == kAtomicDqBulk><<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(
        b.dq_accum, reinterpret_cast<T *>(b.dq), b.dq_st, b.dq_sh, p.Tq, p.Hq, (float)p.scale);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}

template <typename T, int D> ncp_status launch(const ncp_sink_attn_bwd_params &b, cudaStream_t stream) {
    const ncp_sink_attn_params &p = b.f;
    if (!p.deterministic && b.dq_accum != nullptr && p.Tq > 0)
        return dq_bulk() ? launch_adq<T, D, kAtomicDqBulk>(b, stream) : launch_adq<T, D, kAtomicDq>(b, stream);
    if (p.Tk > 0) {
        const char *e = getenv("NCP_SM90_BWD_OVERLAP");
        const bool overlap = e != nullptr && e[0] == '1';
        NCP_TRY((overlap ? launch_dkdv<T, D, kDetOverlap>(b, stream) : launch_dkdv<T, D, kDet>(b, stream)));
    }
    if (p.Tq > 0) {
        CUtensorMap tq, tdo, tk, tv;
        NCP_TRY(ncp_sm90_tensor_map(&tq, p.q, p.Tq, p.Hq, D, p.q_st, p.q_sh, QQB));
        NCP_TRY(ncp_sm90_tensor_map(&tdo, b.dout, p.Tq, p.Hq, D, b.do_st, b.do_sh, QQB));
        NCP_TRY(ncp_sm90_tensor_map(&tk, p.k, p.Tk, p.Hkv, D, p.k_st, p.k_sh, QKB));
        NCP_TRY(ncp_sm90_tensor_map(&tv, p.v, p.Tk, p.Hkv, D, p.v_st, p.v_sh, QKB));
        constexpr int bytes = bwd_layout<D, QQB, QKB>::bytes;
        auto kernel = bwd_dq_sm90_kernel<T, D>;
        NCP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        kernel<<<dim3(p.Hq, (p.Tq + QQB - 1) / QQB), kThreads, bytes, stream>>>(tq, tdo, tk, tv, b);
        NCP_CUDA_CHECK(cudaGetLastError());
    }
    return NCP_OK;
}

}  // namespace
}  // namespace ncp

/* dK/dV and dQ on Hopper after the portable pre-pass; contiguous mode, ncp_sm90_usable() true. */
extern "C" ncp_status ncp_sink_attn_bwd_sm90(const ncp_sink_attn_bwd_params *b, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    const bool bf16 = b->f.dtype == NCP_DT_BF16;
    if (b->f.D == 64) return bf16 ? ncp::launch<__nv_bfloat16, 64>(*b, s) : ncp::launch<__half, 64>(*b, s);
    return bf16 ? ncp::launch<__nv_bfloat16, 128>(*b, s) : ncp::launch<__half, 128>(*b, s);
}
