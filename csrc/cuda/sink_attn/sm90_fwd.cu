/*
 * sink_attn/sm90_fwd.cu: learned-sink attention forward for Hopper (sm_90a): TMA + wgmma,
 * warp-specialized, persistent. The kernel and its launcher only; the parts are in
 * sm90_fwd_mainloop.cuh (layout, barriers, producer), sm90_fwd_consumer.cuh (ping-pong mainloop,
 * epilogue), sm90_softmax.cuh, sm90_scheduler.cuh and mask.cuh; the dispatcher (dispatch.cu) picks
 * this kernel on compute capability 9.0 when the build holds sm_90a code.
 *
 * Math (per query row i of head h, kv head h / (Hq / Hkv), scale s, sink a_h, log2 domain):
 *     m_0 = a_h log2(e), l_0 = 1;  per kv tile: m' = max(m, s log2(e) max_j <q_i, k_j>),
 *     l = l 2^(m - m') + sum_j 2^(s log2(e) <q_i, k_j> - m'), acc likewise;
 *     O_i = acc / l,  lse_i = (m + log2 l) ln 2          (the sink's value vector is zero)
 * bf16/fp16, D in {64, 128}, fp32 accumulation; both mask policies (documents, tables).
 * Instantiations: 2 dtypes x 2 head dims x 2 masks = 8.
 * Test: pytest tests/test_sink_attention_cuda.py   Bench: python benchmarks/bench_sink_attention.py
 */
#include <type_traits>

#include "launch.h"
#include "sm90_fwd_consumer.cuh"

namespace ncp {
namespace fwd90 {
namespace {

template <typename T, int D, class Mask>
__global__ void __launch_bounds__(kThreads, 1)
    sink_attn_fwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                              const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                              const ncp_sink_attn_params p, int halves) {
#ifdef NCP_SM90_DEVICE
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const Smem<D> sm{base, reinterpret_cast<int *>(smem_raw + (base - smem_u32(smem_raw)))};
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) sm.init_barriers();
    __syncthreads();
    if (wg == 0) {
        Split::producer();
        if (threadIdx.x == 0)
            produce<D>(sm, TileScheduler(p.Tq, p.Hq, BM), Mask(p), p.Hq / p.Hkv, &tm_q, &tm_k, &tm_v, &tm_o);
        else if (threadIdx.x / 32 == 1)
            produce_facts<D>(sm, TileScheduler(p.Tq, p.Hq, BM), Mask(p), p, halves != 0);
        return;
    }
    Split::consumer();
    /* Descriptors in uniform registers (sm90::warp_uniform), except in the D = 64 table kernels:
     * with it ptxas 13.0 serializes their wgmma. */
    constexpr bool kUniform = D == 128 || !std::is_same<Mask, TableMask>::value;
    const int cw = kUniform ? sm90::warp_uniform(wg - 1) : wg - 1;
    Consumer<T, D> c(p, sm, cw);
    c.run();
#else
    __trap(); /* never launched: the dispatcher picks this kernel only on sm_90a builds and devices */
#endif
}

template <typename T, int D, class Mask> struct fwd_tag {};

template <typename T, int D, class Mask>
ncp_status launch_t(const ncp_sink_attn_params &p, const attn_config &cfg, cudaStream_t stream) {
    CUtensorMap tq, tk, tv, to;
    NCP_TRY(ncp_sm90_tensor_map(&tq, p.q, p.Tq, p.Hq, D, p.q_st, p.q_sh, BM));
    NCP_TRY(ncp_sm90_tensor_map(&tk, p.k, p.Tk, p.Hkv, D, p.k_st, p.k_sh, BN));
    NCP_TRY(ncp_sm90_tensor_map(&tv, p.v, p.Tk, p.Hkv, D, p.v_st, p.v_sh, BN));
    NCP_TRY(ncp_sm90_tensor_map(&to, p.out, p.Tq, p.Hq, D, p.o_st, p.o_sh, BM));
    constexpr int bytes = Layout<D>::bytes;
    auto kernel = sink_attn_fwd_sm90_kernel<T, D, Mask>;
    NCP_TRY((sm90::kernel_setup<fwd_tag<T, D, Mask>, Split>(kernel, bytes, cfg.device)));
    const int64_t items = (int64_t)p.Hq * ((p.Tq + BM - 1) / BM);
    NCP_CHECK(items <= INT32_MAX / 2, NCP_ERR_INVALID_ARG, "too many attention work items (Hq=%d, Tq=%d)", p.Hq, p.Tq);
    int64_t grid = items;
    const int64_t cap = cfg.grid > 0 ? cfg.grid : cfg.sm_count; /* one CTA per SM by default */
    if (cap > 0 && grid > cap) grid = cap;
    kernel<<<(unsigned)grid, kThreads, bytes, stream>>>(tq, tk, tv, to, p, cfg.whole_tiles ? 0 : 1);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}

}  // namespace
}  // namespace fwd90

ncp_status attn_fwd_sm90(const ncp_sink_attn_params &p, const attn_config &cfg, cudaStream_t s) {
    const bool bf16 = p.dtype == NCP_DT_BF16, table = p.mask.kind == NCP_MASK_TABLE;
#define NCP_FWD90(T, D) (table ? fwd90::launch_t<T, D, TableMask>(p, cfg, s) : fwd90::launch_t<T, D, DocsMask>(p, cfg, s))
    if (p.D == 64) return bf16 ? NCP_FWD90(__nv_bfloat16, 64) : NCP_FWD90(__half, 64);
    return bf16 ? NCP_FWD90(__nv_bfloat16, 128) : NCP_FWD90(__half, 128);
#undef NCP_FWD90
}

}  // namespace ncp
