/*
 * cuda/thd_shard.cu: the thd_partition family on the GPU.
 *
 *   thd_partition_kernel   TE's DualChunkSwap indices of one rank (core/thd_layout.h math).
 *   mimo_shard_kernel      MiMo's fused shard pass over every pipeline chunk at once:
 *                          for local slot t of chunk c: g = src(t); out_local = g; padding mask from
 *                          the framework's (starts, reals) tables; ids/labels/positions gathered and
 *                          widened to int64 (cp > 1); for global token g of chunk c: both media
 *                          masks. One launch, grid-stride, no host sync.
 * CPU twin and second oracle: csrc/cpu/thd_shard.c. Tests: tests/test_mimo_native.py,
 * tests/test_thd_partition.py (CUDA cases). Bench: benchmarks/bench_mimo_shard.py.
 */
#include <cuda_runtime.h>

#include "ncp/ncp.h"
#include "ncp/ncp_check.h"
#include "ncp_internal.h"
#include "thd_layout.h"

namespace ncp {
namespace {

constexpr int kThreads = 256;

int grid_for(int64_t n) {
    int64_t blocks = (n + kThreads - 1) / kThreads;
    if (blocks < 1) blocks = 1;
    return (int)(blocks > 65536 ? 65536 : blocks);
}

/* ---------------------------------------------------------------------------------------- */
/* kernels                                                                                   */
/* ---------------------------------------------------------------------------------------- */

__global__ void thd_partition_kernel(const int32_t *__restrict__ cu, int32_t n_cu, int64_t n_out, int32_t W,
                                            int32_t r, int32_t *__restrict__ out) {
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < n_out; t += (int64_t)gridDim.x * blockDim.x)
        out[t] = (int32_t)ncp_te_src_index(cu, n_cu, t, W, r);
}

__device__ __forceinline__ int64_t load_int(const void *base, ncp_dtype dt, int64_t off) {
    return dt == NCP_DT_I64 ? __ldg((const long long *)base + off) : (int64_t)__ldg((const int *)base + off);
}

__device__ __forceinline__ int64_t token_off(int64_t c, int64_t rpc, int64_t S, int64_t g, int64_t st0, int64_t st1) {
    if (st0 == S * st1) return (c * rpc * S + g) * st1; /* rows back to back: no division */
    return (c * rpc + g / S) * st0 + (g % S) * st1;
}

__device__ __forceinline__ bool eq_token(int64_t v, ncp_dtype dt, int64_t id) {
    return dt == NCP_DT_I64 ? v == id : (int32_t)v == (int32_t)id;
}

__global__ void mimo_shard_kernel(ncp_mimo_shard_params p, int64_t Tc, int64_t L) {
    const int64_t rpc = p.B / p.num_chunks, C = p.num_chunks;
    const int64_t n_mask = (p.has_image || p.has_video) ? C * Tc : 0, n_local = C * L;
    const int64_t n = n_mask > n_local ? n_mask : n_local;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        if (i < n_mask) { /* global media masks, token (c, g) */
            const int64_t c = i / Tc, g = i - c * Tc;
            const int64_t v = load_int(p.input_ids, p.ids_dt, token_off(c, rpc, p.S, g, p.ids_st0, p.ids_st1));
            if (p.has_image) p.out_image[i] = eq_token(v, p.ids_dt, p.image_token_id);
            if (p.has_video) p.out_video[i] = eq_token(v, p.ids_dt, p.video_token_id);
        }
        if (i < n_local) { /* local slot t of chunk c */
            const int64_t c = i / L, t = i - c * L;
            const int64_t *desc = p.table + 1 + NCP_MIMO_DESC * c;
            const int64_t cu_off = desc[0], n_cu = desc[1], st_off = desc[2], n_slots = desc[3];
            const int64_t re_off = desc[4], n_reals = desc[5];
            const int64_t g = p.cp_size > 1
                                  ? ncp_te_src_index((const int32_t *)(p.table + cu_off), (int32_t)n_cu, t, p.cp_size,
                                                     p.cp_rank)
                                  : t;
            p.out_local[i] = g;
            p.out_pad[i] = ncp_thd_is_padding(p.table + st_off, n_slots, p.table + re_off, n_reals, g);
            if (p.cp_size > 1) {
                p.out_ids[i] = load_int(p.input_ids, p.ids_dt, token_off(c, rpc, p.S, g, p.ids_st0, p.ids_st1));
                p.out_labels[i] = load_int(p.labels, p.lab_dt, token_off(c, rpc, p.S, g, p.lab_st0, p.lab_st1));
                if (p.out_pos != nullptr)
                    p.out_pos[i] = load_int(p.position_ids, p.pos_dt, token_off(c, rpc, p.S, g, p.pos_st0, p.pos_st1));
            }
        }
    }
}

}  // namespace
}  // namespace ncp

/* ---------------------------------------------------------------------------------------- */
/* entry points                                                                              */
/* ---------------------------------------------------------------------------------------- */

extern "C" ncp_status ncp_thd_partition_cuda(const ncp_thd_partition_params *p, void *stream) {
    NCP_TRY(ncp_thd_partition_check(p));
    const int64_t n_out = p->total_tokens / p->cp_size;
    cudaStream_t s = (cudaStream_t)stream;
    ncp::thd_partition_kernel<<<ncp::grid_for(n_out), ncp::kThreads, 0, s>>>(p->cu_seqlens, p->n_cu, n_out, p->cp_size, p->cp_rank,
                                                              p->out);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}

extern "C" ncp_status ncp_mimo_shard_cuda(const ncp_mimo_shard_params *p, void *stream) {
    NCP_TRY(ncp_mimo_shard_check(p));
    const int64_t Tc = (p->B / p->num_chunks) * p->S;
    const int64_t L = p->cp_size > 1 ? Tc / p->cp_size : Tc;
    const int64_t n = p->num_chunks * Tc;
    if (n == 0) return NCP_OK;
    ncp::mimo_shard_kernel<<<ncp::grid_for(n), ncp::kThreads, 0, (cudaStream_t)stream>>>(*p, Tc, L);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}
