/*
 * sink_attn/sm90_bwd.cu: learned-sink attention backward for Hopper (sm_90a): the dK/dV kernel
 * (consumer in sm90_bwd_dkdv.cuh), the dQ kernel of the deterministic mode, the conversion of the
 * atomic dQ workspace, and their launchers. The portable pre-pass (portable_bwd.cu: Delta and the
 * dsink partials) runs first; the dispatcher (dispatch.cu) picks these kernels on compute
 * capability 9.0 with an sm_90a build.
 *
 * In the log2 domain with x = s log2(e) <q, k>:  P = 2^(x - lse log2(e)) on visible pairs,
 *   dS = P (dP - Delta),  dP = dO V^T,  dV = sum P^T dO,  dK = s sum dS^T Q,  dQ = s sum dS K.
 * dQ kernel: CTA = 128 query rows of one head (64 per consumer warpgroup), Q and dO stationary; it
 * walks the kv tiles of 64 keys the rows see (as the forward), streaming K and V:
 * S = Q K^T, dP = dO V^T, then dQ += dS K.
 * Both grids take their tiles longest first (the pre-pass ranks them; launch.h).
 * Instantiations: dK/dV 2 modes x 2 dtypes x 2 head dims x 2 masks (documents, tables) x 2 (with
 * and without skipping), dQ 2 x 2 x 2 x 2.
 * Test: pytest tests/test_sink_attention_cuda.py   Bench: python benchmarks/bench_sink_attention.py
 */
#include "sm90_bwd_dkdv.cuh"

namespace ncp {
namespace bwd90 {
namespace {

/* Skipping warpgroup items (sm90_bwd_dkdv.cuh) pays under a window, not under a causal mask: a
 * separate kernel each (dK/dV and dQ), so the causal kernels keep their code. Documents say their
 * window; a table (CP) carries the window it was built with as a hint (ncp.h; the Flint plan sets
 * it). Either kernel gives the same results on any mask: the hint only picks the faster one. */
inline bool skips_items(const ncp_sink_attn_params &p) { return p.mask.window > 0; }
/* The skipping D = 128 atomic kernel takes the deferred loop in a CTA whose keys at least this
 * many q tiles see (a warpgroup then skips at most about 2 items in 8), else the loop that skips
 * whole items with one barrier per item. */
constexpr int kDeferredMinQTiles = 8;

template <typename T, int D, bool ADQ, class Mask, bool SKIP>
__global__ void __launch_bounds__(kThreads, 1)
    bwd_dkdv_sm90_kernel(const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                         const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                         const ncp_sink_attn_bwd_params b, const bwd_workspace ws) {
#ifdef NCP_SM90_DEVICE
    using L = Layout<D, KVB, KQB, ADQ>;
    const ncp_sink_attn_params &p = b.f;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const Bars bar{base + L::bar_off};
    float *s_l2 = reinterpret_cast<float *>(smem_raw + (base - smem_u32(smem_raw)) + L::vec_off); /* [S][KQB] */
    float *s_dl = s_l2 + kStages * KQB;
    uint16_t *s_kb = reinterpret_cast<uint16_t *>(s_dl + kStages * KQB); /* [S][KQB] key bounds */
    if (threadIdx.x == 0) {
        NCP_CLOCK_REC(r_[0] = gtimer());
        bar.init(2); /* a_full: the TMA thread and the lse/Delta warp */
    }
    __syncthreads();
    const Mask mask(p);
    const int kt = ws.kv.order != nullptr ? __ldg(ws.kv.order + blockIdx.y) : blockIdx.y; /* longest first */
    const KvItems w(mask, blockIdx.x, kt * KVB, p.Hq / p.Hkv);
    if (threadIdx.x == 0) {
        NCP_CLOCK_REC(unsigned sm_; asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_));
                      r_[4] = sm_ | (unsigned long long)(w.n_q & 255) << 8 | (unsigned long long)(w.n_it & 65535) << 16 |
                              (unsigned long long)(kt & 65535) << 32 | (unsigned long long)(blockIdx.x & 65535) << 48);
    }
    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        Split::producer(); /* 24 registers; warp 1's key bounds (documents: a binary search) fit */
        if constexpr (ADQ && D == 128) { /* warps 2 and 3: the dQ writers of consumer warpgroups 0 and 1 */
            const int pw = threadIdx.x >> 5;
            if (pw >= 2) {
                if ((threadIdx.x & 31) == 0)
                    write_dq(w, bar, pw - 2, base + L::stage_off + (pw - 2) * 64 * 64 * 4, p.Tq, ws.dq_accum, ws.dq_flag);
                return;
            }
        }
        produce_dkdv<D>(w, bar, base, base + L::s1_off, base + L::a_off, base + L::b_off, s_l2, s_dl, s_kb, mask, p,
                        ws.delta, &tm_k, &tm_v, &tm_q, &tm_do);
        return;
    }
    Split::consumer();
    DkdvConsumer<T, D, ADQ> c(p, w, bar, base, s_l2, s_dl, s_kb, sm90::warp_uniform(wg - 1));
    sm90::mbar_wait(bar.stat(), 0);
    if (threadIdx.x == 128) NCP_CLOCK_REC(r_[5] = gtimer());
    if constexpr (ADQ && D == 128 && !SKIP) c.template run_adq_deferred<false>();
    else if constexpr (ADQ && D == 128) {
        /* Skipping: a warpgroup skips the first and last q tile of the key tile's run per head
         * (under a window; 2 in n_q items). The deferred loop skips only the softmax (its dV, dK and
         * full-width dQ MMAs run on zeros), so it pays where skips are rare (docs/EXPERIMENTS.md). */
        if (w.n_q >= kDeferredMinQTiles) c.template run_adq_deferred<true>();
        else c.template run_adq<true>(ws.dq_accum);
    } else if constexpr (ADQ) c.template run_adq<SKIP>(ws.dq_accum);
    else c.template run_det<SKIP>();
    /* With D = 128 each warpgroup's dQ MMAs read all 128 rows of K; store() rewrites this
     * warpgroup's rows, so both warpgroups' last dQ MMAs must be done first. */
    if (threadIdx.x == 128) NCP_CLOCK_REC(r_[6] = gtimer());
    if constexpr (ADQ && D == 128) sm90::named_sync(kKFree, 256);
    c.store(b);
    if ((threadIdx.x & 127) == 0) NCP_CLOCK_REC(atomicMax(&r_[1], gtimer()));
#else
    __trap(); /* never launched: the dispatcher picks this kernel only on sm_90a builds and devices */
#endif
}

template <typename T, int D, class Mask, bool SKIP>
__global__ void __launch_bounds__(kThreads, 1)
    bwd_dq_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                       const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                       const ncp_sink_attn_bwd_params b, const bwd_workspace ws) {
#ifdef NCP_SM90_DEVICE
    using L = Layout<D, QQB, QKB>;
    const ncp_sink_attn_params &p = b.f;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t sQ = base, sO = base + L::s1_off, sK0 = base + L::a_off, sV0 = base + L::b_off;
    const Bars bar{base + L::bar_off};
    const int tid = threadIdx.x, wg = tid / 128, lane = tid & 31;
    const int qt = ws.q.order != nullptr ? __ldg(ws.q.order + blockIdx.y) : gridDim.y - 1 - blockIdx.y;
    const int h = blockIdx.x, g_kv = h / (p.Hq / p.Hkv), q0 = qt * QQB; /* longest first (launch.h) */
    if (tid == 0) bar.init(1);
    __syncthreads();
    const Mask mask(p);
    const q_tile_range rng = q_range(mask, q0, QQB, QKB);
    const int n_it = max(0, rng.kt_hi - rng.kt_lo + 1);
    if (wg == 0) {
        Split::producer();
        if (tid == 0) produce_dq<D>(rng, n_it, bar, sQ, sO, sK0, sV0, h, g_kv, q0, &tm_q, &tm_do, &tm_k, &tm_v);
        return;
    }
    Split::consumer();
    const int cw = sm90::warp_uniform(wg - 1), tq = lane & 3, row0 = 64 * cw + 16 * ((tid & 127) >> 5) + (lane >> 2);
    int lo[2], hi[2];
    float l2[2], dl[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = q0 + row0 + 8 * r;
        row_bounds(mask, i, lo[r], hi[r]);
        l2[r] = i < p.Tq ? __ldg(p.lse + (int64_t)h * p.Tq + i) * kLog2e : 0.f;
        dl[r] = i < p.Tq ? __ldg(ws.delta + (int64_t)h * p.Tq + i) : 0.f;
    }
    /* SKIP (as in the dK/dV kernel): this warpgroup's 64 rows take the kv tiles [wr.kt_lo,
     * wr.kt_hi] only and skip the others (their P and dS are zero), after the wait on their stage,
     * so it never arrives on a stage's empty barrier for a later fill before the other warpgroup
     * arrived for this one; without SKIP wr is the CTA's range. */
    const int w0 = q0 + 64 * cw;
    q_tile_range wr = rng;
    if constexpr (SKIP) {
        wr = q_tile_range{0, -1, 0, 0, 0};
        if (w0 < p.Tq) wr = q_range(mask, w0, 64, QKB);
    }
    const float scale_log2 = (float)p.scale * kLog2e;
    float dq[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dq[i] = 0.f;
    sm90::mbar_wait(bar.stat(), 0);
    for (int it = 0; it < n_it; ++it) {
        const int s = Ring::slot(it), kt = rng.kt_hi - it;
        const uint32_t sK = sK0 + s * L::tile_bytes, sV = sV0 + s * L::tile_bytes;
        sm90::mbar_wait(bar.a(s), Ring::full_phase(it));
        if (SKIP && (kt < wr.kt_lo || kt > wr.kt_hi)) {
            /* V's load too before the release: when both warpgroups skip a tile (a table whose rows
             * jump past it) nobody else waits for it, and the producer would re-arm its barrier
             * with the load in flight. */
            sm90::mbar_wait(bar.b(s), Ring::full_phase(it));
            sm90::warp_arrive(bar.e(s));
            continue;
        }
        const bool full = full_cols(wr, kt * QKB, QKB, p.Tk);
        float sc[QKB / 2], dp[QKB / 2];
        sm90::gemm_ss<T, QKB, D>(sc, sQ + cw * 64 * 128, QQB * 128, sK, QKB * 128);
        sm90::mbar_wait(bar.b(s), Ring::full_phase(it));
        sm90::gemm_ss<T, QKB, D>(dp, sO + cw * 64 * 128, QQB * 128, sV, QKB * 128);
        sm90::wg_wait<0>();
        sm90::fence_regs(sc, QKB / 2);
        sm90::fence_regs(dp, QKB / 2);
#pragma unroll
        for (int j = 0; j < QKB / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1, kj = kt * QKB + 8 * j + 2 * tq + (e & 1);
                const bool vis = full || (kj >= lo[r] && kj <= hi[r]);
                const float pv = vis ? ex2(sc[4 * j + e] * scale_log2 - l2[r]) : 0.f;
                dp[4 * j + e] = pv * (dp[4 * j + e] - dl[r]);
            }
        uint32_t df[QKB / 16][4];
        to_frags<T, QKB>(df, dp);
        sm90::gemm_rs<T, D, QKB>(dq, df, sK, QKB * 128);
        sm90::wg_wait<0>();
        sm90::fence_regs(dq, D / 2);
        sm90::fence_frags(df, QKB / 16);
        sm90::warp_arrive(bar.e(s));
    }
    store_rows<T, D, QQB>(dq, (float)p.scale, sQ, 64 * cw, reinterpret_cast<T *>(b.dq) + (int64_t)h * b.dq_sh, b.dq_st,
                          q0 + 64 * cw, p.Tq, cw);
#else
    __trap(); /* never launched: the dispatcher picks this kernel only on sm_90a builds and devices */
#endif
}

/* dq[t, h, :] = scale * dq_accum in T; 8 columns per thread; dq_accum in 64 x 64 tiles
 * (h, t / 64, d / 64) in fragment order (dq_frag_pos). With claim flags (D = 128), a tile nobody
 * claimed (no key tile added into it: rows that see no key) holds no value: its dq is zero. */
template <typename T, int D>
__global__ void __launch_bounds__(256) dq_convert_kernel(const float *__restrict__ acc, const int32_t *__restrict__ flag,
                                                         T *dq, int64_t st, int64_t sh, int Tq, int Hq, float scale) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, n = (int64_t)Hq * Tq * (D / 8);
    if (i >= n) return;
    const int c = (int)(i % (D / 8)) * 8;
    const int64_t ht = i / (D / 8);
    const int t = (int)(ht % Tq), h = (int)(ht / Tq);
    const int n_qt = (Tq + 63) / 64, row = t % 64, rr = row % 16;
    const int64_t tile = ((int64_t)h * n_qt + t / 64) * (D / 64) + c / 64;
    const float *src = acc + tile * 4096 + 2 * dq_frag_pos(row / 16, (c % 64) / 8, rr / 8, (rr % 8) * 4);
    uint4 v = make_uint4(0u, 0u, 0u, 0u); /* +0.0 in both T */
    if (flag != nullptr && __ldg(flag + tile) == 0) {
        *reinterpret_cast<uint4 *>(dq + (int64_t)t * st + (int64_t)h * sh + c) = v;
        return;
    }
    const float4 a = *reinterpret_cast<const float4 *>(src);
    const float4 b = *reinterpret_cast<const float4 *>(src + 4);
    v.x = elem<T>::pack(a.x * scale, a.y * scale);
    v.y = elem<T>::pack(a.z * scale, a.w * scale);
    v.z = elem<T>::pack(b.x * scale, b.y * scale);
    v.w = elem<T>::pack(b.z * scale, b.w * scale);
    *reinterpret_cast<uint4 *>(dq + (int64_t)t * st + (int64_t)h * sh + c) = v;
}

template <typename T, int D, bool ADQ, class Mask, bool SKIP> struct ic_dkdv {};
template <typename T, int D, class Mask, bool SKIP> struct ic_dq {};

template <typename T, int D, bool ADQ, class Mask, bool SKIP>
ncp_status launch_dkdv_t(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, const attn_config &cfg,
                       cudaStream_t stream) {
    const ncp_sink_attn_params &p = b.f;
    CUtensorMap tk, tv, tq, tdo;
    NCP_TRY(ncp_sm90_tensor_map(&tk, p.k, p.Tk, p.Hkv, D, p.k_st, p.k_sh, KVB));
    NCP_TRY(ncp_sm90_tensor_map(&tv, p.v, p.Tk, p.Hkv, D, p.v_st, p.v_sh, KVB));
    NCP_TRY(ncp_sm90_tensor_map(&tq, p.q, p.Tq, p.Hq, D, p.q_st, p.q_sh, KQB));
    NCP_TRY(ncp_sm90_tensor_map(&tdo, b.dout, p.Tq, p.Hq, D, b.do_st, b.do_sh, KQB));
    NCP_ARG_CHECK(((int64_t)p.Tk + KVB - 1) / KVB <= 65535, "too many key tiles for one launch (Tk=%d)", p.Tk);
    constexpr int bytes = Layout<D, KVB, KQB, ADQ>::bytes;
    auto kernel = bwd_dkdv_sm90_kernel<T, D, ADQ, Mask, SKIP>;
    NCP_TRY((sm90::kernel_setup<ic_dkdv<T, D, ADQ, Mask, SKIP>, Split>(kernel, bytes, cfg.device)));
    kernel<<<dim3(p.Hkv, (p.Tk + KVB - 1) / KVB), kThreads, bytes, stream>>>(tk, tv, tq, tdo, b, ws);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}
template <typename T, int D, bool ADQ, class Mask>
ncp_status launch_dkdv(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, const attn_config &cfg,
                       cudaStream_t stream) {
    return skips_items(b.f) ? launch_dkdv_t<T, D, ADQ, Mask, true>(b, ws, cfg, stream)
                            : launch_dkdv_t<T, D, ADQ, Mask, false>(b, ws, cfg, stream);
}

template <typename T, int D, class Mask, bool SKIP>
ncp_status launch_dq_t(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, const attn_config &cfg,
                     cudaStream_t stream) {
    const ncp_sink_attn_params &p = b.f;
    CUtensorMap tq, tdo, tk, tv;
    NCP_TRY(ncp_sm90_tensor_map(&tq, p.q, p.Tq, p.Hq, D, p.q_st, p.q_sh, QQB));
    NCP_TRY(ncp_sm90_tensor_map(&tdo, b.dout, p.Tq, p.Hq, D, b.do_st, b.do_sh, QQB));
    NCP_TRY(ncp_sm90_tensor_map(&tk, p.k, p.Tk, p.Hkv, D, p.k_st, p.k_sh, QKB));
    NCP_TRY(ncp_sm90_tensor_map(&tv, p.v, p.Tk, p.Hkv, D, p.v_st, p.v_sh, QKB));
    NCP_ARG_CHECK(((int64_t)p.Tq + QQB - 1) / QQB <= 65535, "too many query tiles for one launch (Tq=%d)", p.Tq);
    constexpr int bytes = Layout<D, QQB, QKB>::bytes;
    auto kernel = bwd_dq_sm90_kernel<T, D, Mask, SKIP>;
    NCP_TRY((sm90::kernel_setup<ic_dq<T, D, Mask, SKIP>, Split>(kernel, bytes, cfg.device)));
    kernel<<<dim3(p.Hq, (p.Tq + QQB - 1) / QQB), kThreads, bytes, stream>>>(tq, tdo, tk, tv, b, ws);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}
template <typename T, int D, class Mask>
ncp_status launch_dq(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, const attn_config &cfg,
                     cudaStream_t stream) {
    return skips_items(b.f) ? launch_dq_t<T, D, Mask, true>(b, ws, cfg, stream)
                            : launch_dq_t<T, D, Mask, false>(b, ws, cfg, stream);
}

/* Deterministic: the dK/dV kernel, then the dQ kernel. Atomic dQ: the dK/dV kernel adds dQ into
 * the accumulator (D = 64: zeroed by the pre-pass; D = 128: the dQ writers store each tile's first
 * share, write_dq), one pass converts it to dq. */
template <typename T, int D, class Mask>
ncp_status launch(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, const attn_config &cfg, cudaStream_t s) {
    const ncp_sink_attn_params &p = b.f;
    if (ws.dq_accum != nullptr) {
        if (p.Tk > 0) NCP_TRY((launch_dkdv<T, D, true, Mask>(b, ws, cfg, s)));
        const int64_t n = (int64_t)p.Hq * p.Tq * (D / 8);
        dq_convert_kernel<T, D><<<(unsigned)((n + 255) / 256), 256, 0, s>>>(
            ws.dq_accum, ws.dq_flag, reinterpret_cast<T *>(b.dq), b.dq_st, b.dq_sh, p.Tq, p.Hq, (float)p.scale);
        NCP_CUDA_CHECK(cudaGetLastError());
        return NCP_OK;
    }
    if (p.Tk > 0) NCP_TRY((launch_dkdv<T, D, false, Mask>(b, ws, cfg, s)));
    if (p.Tq > 0) NCP_TRY((launch_dq<T, D, Mask>(b, ws, cfg, s)));
    return NCP_OK;
}

}  // namespace
}  // namespace bwd90

ncp_status attn_bwd_sm90(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, const attn_config &cfg,
                         cudaStream_t s) {
    const bool bf16 = b.f.dtype == NCP_DT_BF16, table = b.f.mask.kind == NCP_MASK_TABLE;
#define NCP_BWD90(T, D) \
    (table ? bwd90::launch<T, D, TableMask>(b, ws, cfg, s) : bwd90::launch<T, D, DocsMask>(b, ws, cfg, s))
    if (b.f.D == 64) return bf16 ? NCP_BWD90(__nv_bfloat16, 64) : NCP_BWD90(__half, 64);
    return bf16 ? NCP_BWD90(__nv_bfloat16, 128) : NCP_BWD90(__half, 128);
#undef NCP_BWD90
}

}  // namespace ncp

#if defined(NCP_CTA_CLOCK) && defined(NCP_SM90A_BUILD)
/* Probe builds: copy the dK/dV kernel's per-CTA records (bwd90::g_cta_clock, 64 bytes each) to host
 * memory and zero them (benchmarks/probe_cta_clock.py loads this through ctypes). 0 on success. */
extern "C" __attribute__((visibility("default"))) int ncp_cta_clock_read(void *host, size_t bytes) {
    const size_t cap = sizeof(ncp::bwd90::g_cta_clock);
    if (host == nullptr || bytes > cap) return 1;
    if (cudaDeviceSynchronize() != cudaSuccess) return 2;
    if (cudaMemcpyFromSymbol(host, ncp::bwd90::g_cta_clock, bytes) != cudaSuccess) return 3;
    void *dev = nullptr;
    if (cudaGetSymbolAddress(&dev, ncp::bwd90::g_cta_clock) != cudaSuccess || cudaMemset(dev, 0, cap) != cudaSuccess) return 4;
    return cudaDeviceSynchronize() == cudaSuccess ? 0 : 5;
}
#endif
