/*
 * sink_attn/sm90_bwd.cu: learned-sink attention backward for Hopper (sm_90a): the dK/dV kernel
 * (consumer in sm90_bwd_dkdv.cuh, producer and ordered dQ writer in sm90_bwd_parts.cuh), the
 * conversion of the dQ workspace, and their launchers. The portable pre-pass (portable_bwd.cu:
 * Delta, the dsink partials, the tile order, the workspace's zeros) runs first; the dispatcher
 * (dispatch.cu) picks these kernels on compute capability 9.0 with an sm_90a build.
 *
 * In the log2 domain with x = s log2(e) <q, k>:  P = 2^(x - lse log2(e)) on visible pairs,
 *   dS = P (dP - Delta),  dP = dO V^T,  dV = sum P^T dO,  dK = s sum dS^T Q,  dQ = s sum dS K.
 * One kernel computes all three: a CTA holds 128 keys and walks the (query head, 64-row q tile)
 * items that see them; dQ's partial sums over its keys go into an fp32 workspace by bulk
 * reductions, in any order (default) or in the grid's dispatch order per dQ tile (deterministic:
 * bitwise repeatable for a given device and shape), and one pass converts the workspace to dq.
 * The grid takes its key tiles longest first (the pre-pass ranks them; launch.h).
 * Instantiations: 2 modes x 2 dtypes x 2 head dims x 2 masks (documents, tables) x 2 (with and
 * without skipping).
 * Test: pytest tests/test_sink_attention_cuda.py   Bench: python benchmarks/bench_sink_attention.py
 */
#include "sm90_bwd_dkdv.cuh"

namespace ncp {
namespace bwd90 {
namespace {

/* Skipping warpgroup items (sm90_bwd_dkdv.cuh) pays under a window, not under a causal mask: a
 * separate kernel, so the causal kernels keep their code. Documents say their
 * window; a table (CP) carries the window it was built with as a hint (ncp.h; the Flint plan sets
 * it). Either kernel gives the same results on any mask: the hint only picks the faster one. */
inline bool skips_items(const ncp_sink_attn_params &p) { return p.mask.window > 0; }

template <typename T, int D, bool ORD, class Mask, bool SKIP>
__global__ void __launch_bounds__(kThreads, 1)
    bwd_dkdv_sm90_kernel(const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                         const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                         const ncp_sink_attn_bwd_params b, const bwd_workspace ws) {
#ifdef NCP_SM90_DEVICE
    using L = Layout<D, KVB, KQB>;
    const ncp_sink_attn_params &p = b.f;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const Bars bar{base + L::bar_off};
    float *s_l2 = reinterpret_cast<float *>(smem_raw + (base - smem_u32(smem_raw)) + L::vec_off); /* [S][KQB] */
    float *s_dl = s_l2 + kStages * KQB;
    uint16_t *s_kb = reinterpret_cast<uint16_t *>(s_dl + kStages * KQB); /* [S][KQB] key bounds */
    if (threadIdx.x == 0) bar.init(2); /* a_full: the TMA thread and the lse/Delta warp */
    __syncthreads();
    const Mask mask(p);
    const int kt = ws.kv.order != nullptr ? __ldg(ws.kv.order + blockIdx.y) : blockIdx.y; /* longest first */
    const KvItems<ORD> w(mask, blockIdx.x, kt * KVB, p.Hq / p.Hkv);
    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        Split::producer(); /* 24 registers; warp 1's key bounds (documents: a binary search) fit */
        if (ORD && threadIdx.x / 32 == 2) {
            DqTurns(ws, kt, p.Tq, p.Hq).write<D>(w, bar, base + L::stage_off, ws.dq_accum, mask);
            return;
        }
        produce_dkdv<D>(w, bar, base, base + L::s1_off, base + L::a_off, base + L::b_off, s_l2, s_dl, s_kb, mask, p,
                        ws.delta, &tm_k, &tm_v, &tm_q, &tm_do);
        return;
    }
    Split::consumer();
    DkdvConsumer<T, D, KvItems<ORD>> c(p, w, bar, base, s_l2, s_dl, s_kb, sm90::warp_uniform(wg - 1));
    sm90::mbar_wait(bar.stat(), 0);
    c.template run<SKIP, ORD>(ws.dq_accum);
    c.store(b);
#else
    __trap(); /* never launched: the dispatcher picks this kernel only on sm_90a builds and devices */
#endif
}

/* dq[t, h, :] = scale * dq_accum in T; 8 columns per thread; dq_accum in 64 x 64 tiles
 * (h, t / 64, d / 64) in fragment order (dq_frag_pos). */
template <typename T, int D>
__global__ void __launch_bounds__(256) dq_convert_kernel(const float *__restrict__ acc, T *dq, int64_t st, int64_t sh,
                                                         int Tq, int Hq, float scale) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, n = (int64_t)Hq * Tq * (D / 8);
    if (i >= n) return;
    const int c = (int)(i % (D / 8)) * 8;
    const int64_t ht = i / (D / 8);
    const int t = (int)(ht % Tq), h = (int)(ht / Tq);
    const int n_qt = (Tq + 63) / 64, row = t % 64, rr = row % 16;
    const int64_t tile = ((int64_t)h * n_qt + t / 64) * (D / 64) + c / 64;
    const float *src = acc + tile * 4096 + 2 * dq_frag_pos(row / 16, (c % 64) / 8, rr / 8, (rr % 8) * 4);
    const float4 a = *reinterpret_cast<const float4 *>(src);
    const float4 b = *reinterpret_cast<const float4 *>(src + 4);
    uint4 v;
    v.x = elem<T>::pack(a.x * scale, a.y * scale);
    v.y = elem<T>::pack(a.z * scale, a.w * scale);
    v.z = elem<T>::pack(b.x * scale, b.y * scale);
    v.w = elem<T>::pack(b.z * scale, b.w * scale);
    *reinterpret_cast<uint4 *>(dq + (int64_t)t * st + (int64_t)h * sh + c) = v;
}

template <typename T, int D, bool ORD, class Mask, bool SKIP> struct ic_dkdv {};

template <typename T, int D, bool ORD, class Mask, bool SKIP>
ncp_status launch_dkdv_t(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, const attn_config &cfg,
                         cudaStream_t stream) {
    const ncp_sink_attn_params &p = b.f;
    CUtensorMap tk, tv, tq, tdo;
    NCP_TRY(ncp_sm90_tensor_map(&tk, p.k, p.Tk, p.Hkv, D, p.k_st, p.k_sh, KVB));
    NCP_TRY(ncp_sm90_tensor_map(&tv, p.v, p.Tk, p.Hkv, D, p.v_st, p.v_sh, KVB));
    NCP_TRY(ncp_sm90_tensor_map(&tq, p.q, p.Tq, p.Hq, D, p.q_st, p.q_sh, KQB));
    NCP_TRY(ncp_sm90_tensor_map(&tdo, b.dout, p.Tq, p.Hq, D, b.do_st, b.do_sh, KQB));
    NCP_ARG_CHECK(((int64_t)p.Tk + KVB - 1) / KVB <= 65535, "too many key tiles for one launch (Tk=%d)", p.Tk);
    constexpr int bytes = Layout<D, KVB, KQB>::bytes;
    auto kernel = bwd_dkdv_sm90_kernel<T, D, ORD, Mask, SKIP>;
    NCP_TRY((sm90::kernel_setup<ic_dkdv<T, D, ORD, Mask, SKIP>, Split>(kernel, bytes, cfg.device)));
    kernel<<<dim3(p.Hkv, (p.Tk + KVB - 1) / KVB), kThreads, bytes, stream>>>(tk, tv, tq, tdo, b, ws);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}
template <typename T, int D, bool ORD, class Mask>
ncp_status launch_dkdv(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, const attn_config &cfg,
                       cudaStream_t stream) {
    return skips_items(b.f) ? launch_dkdv_t<T, D, ORD, Mask, true>(b, ws, cfg, stream)
                            : launch_dkdv_t<T, D, ORD, Mask, false>(b, ws, cfg, stream);
}

/* The dK/dV kernel adds dQ into the accumulator that the pre-pass zeroed (in a fixed order when
 * deterministic: ws.dq_turn), then one pass converts it to dq. */
template <typename T, int D, class Mask>
ncp_status launch(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, const attn_config &cfg, cudaStream_t s) {
    const ncp_sink_attn_params &p = b.f;
    if (p.Tk > 0) {
        if (ws.dq_turn != nullptr) NCP_TRY((launch_dkdv<T, D, true, Mask>(b, ws, cfg, s)));
        else NCP_TRY((launch_dkdv<T, D, false, Mask>(b, ws, cfg, s)));
    }
    if (p.Tq > 0) {
        const int64_t n = (int64_t)p.Hq * p.Tq * (D / 8);
        dq_convert_kernel<T, D><<<(unsigned)((n + 255) / 256), 256, 0, s>>>(ws.dq_accum, reinterpret_cast<T *>(b.dq),
                                                                             b.dq_st, b.dq_sh, p.Tq, p.Hq, (float)p.scale);
        NCP_CUDA_CHECK(cudaGetLastError());
    }
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
