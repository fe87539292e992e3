/*
 * cuda/thd_shard.cu: the thd_partition family on the GPU.
 *
 *   thd_partition_kernel   TE's DualChunkSwap indices of one rank (core/thd_layout.h math).
 *   mimo_shard_kernel      MiMo's fused shard pass over every pipeline chunk at once:
 *                          for local slot t of chunk c: g = src(t); out_local = g; padding mask from
 *                          the framework's (starts, reals) tables; ids/labels/positions gathered and
 *                          widened to int64 (cp > 1); for global token g of chunk c: both media
 *                          masks. One launch, grid-stride, no host sync.
 *   ncp_mimo_run_cuda      one whole sharder call. Metadata on the host (the layout block's int32
 *                          outputs stay there) and a kernel table of at most 30 KiB: the host pass
 *                          writes the host block and the table rides in the launch's parameters
 *                          (mimo_shard_param_kernel; 8, 16 or 30 KiB blocks): one driver call. Else the host
 *                          pass (or the table) goes into a pinned staging slot, one
 *                          cudaMemcpyAsync of it into the output buffer, one event, then
 *                          mimo_shard_kernel; all on the caller's stream.
 *
 * Staging ring: pinned host slots owned by this file, per device, reused only once the event
 * recorded after their copy has completed (cudaEventQuery, never a wait), so a call never blocks
 * on the GPU. Only when NCP_STAGE_SLOTS copies of one device are all still in flight does the
 * next call wait for the oldest (cudaEventSynchronize): that needs more than 32 sharder calls
 * queued ahead of the GPU. Slots live for the process (a few KB to MB each); sizes are powers of
 * two of at least 64 KiB, so a slot is replaced (cudaFreeHost, which synchronizes) only when a
 * table outgrows every slot.
 *
 * CPU twin and second oracle: csrc/cpu/thd_shard.c. Tests: tests/test_mimo_native.py,
 * tests/test_mimo_native_integration.py, tests/test_thd_partition.py (CUDA cases).
 * Bench: benchmarks/bench_mimo_shard.py.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include <mutex>

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
        out[t] = ncp_te_src_index(cu, n_cu, t, W, r);
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

/* The fused pass; `table` is p.table (global memory) or the kernel-parameter copy of it. */
__device__ __forceinline__ void mimo_shard_body(const ncp_mimo_shard_params &p, const int64_t *__restrict__ table,
                                                int64_t Tc, int64_t L) {
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
            const int64_t *desc = table + 1 + NCP_MIMO_DESC * c;
            const int64_t cu_off = desc[0], n_cu = desc[1], st_off = desc[2], n_slots = desc[3];
            const int64_t re_off = desc[4], n_reals = desc[5], same_docs = desc[6];
            int64_t doc = 0;
            const int64_t g = p.cp_size > 1 ? ncp_te_src_index_doc((const int32_t *)(table + cu_off), (int32_t)n_cu,
                                                                    t, p.cp_size, p.cp_rank, &doc)
                                            : t;
            p.out_local[i] = g;
            if (p.out_pad != nullptr) /* one search per slot on validated layouts (same_docs) */
                p.out_pad[i] = ncp_mimo_is_padding(table + st_off, n_slots, table + re_off, n_reals, g, doc,
                                                   same_docs);
            if (p.out_ids != nullptr) {
                p.out_ids[i] = load_int(p.input_ids, p.ids_dt, token_off(c, rpc, p.S, g, p.ids_st0, p.ids_st1));
                p.out_labels[i] = load_int(p.labels, p.lab_dt, token_off(c, rpc, p.S, g, p.lab_st0, p.lab_st1));
                if (p.out_pos != nullptr)
                    p.out_pos[i] = load_int(p.position_ids, p.pos_dt, token_off(c, rpc, p.S, g, p.pos_st0, p.pos_st1));
            }
        }
    }
}

__global__ void mimo_shard_kernel(ncp_mimo_shard_params p, int64_t Tc, int64_t L) { mimo_shard_body(p, p.table, Tc, L); }

/* The kernel table passed by value (kernel parameters may take 32764 bytes from CUDA 12.1 on
 * sm_70+): a call with a small table needs no staging copy, no event and no slot, only the launch.
 * __grid_constant__: the table is read in place (parameter space), never copied per thread. A
 * launch copies its whole parameter block, so the table comes in three sizes (8, 16, 30 KiB) and a
 * call takes the smallest that holds it. */
constexpr int kParamTableWords = 3840; /* 30 KiB; with the other parameters under 32764 bytes */
template <int W> struct ParamTable {
    int64_t w[W];
};
static_assert(sizeof(ParamTable<kParamTableWords>) + sizeof(ncp_mimo_shard_params) + 2 * sizeof(int64_t) <= 32764,
              "kernel parameters above the 32764-byte limit");

template <int W>
__global__ void mimo_shard_param_kernel(ncp_mimo_shard_params p, int64_t Tc, int64_t L,
                                        const __grid_constant__ ParamTable<W> table) {
    mimo_shard_body(p, table.w, Tc, L);
}

/* Launches the W-word kernel with the table's first `words` words (the rest of the block is
 * zero; the kernel reads only the table's own extent). */
template <int W>
ncp_status launch_param(const ncp_mimo_shard_params &sp, int64_t Tc, int64_t L, const int64_t *table, int64_t words,
                        cudaStream_t stream) {
    static ParamTable<W> block; /* filled and launched under the lock (a launch copies its arguments) */
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    memcpy(block.w, table, (size_t)words * sizeof(int64_t));
    mimo_shard_param_kernel<W><<<grid_for(sp.num_chunks * Tc), kThreads, 0, stream>>>(sp, Tc, L, block);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* pinned staging ring                                                                       */
/* ---------------------------------------------------------------------------------------- */

constexpr int kStageDevices = 16;
constexpr int kStageSlots = 32; /* NCP_STAGE_SLOTS in the header comment */
constexpr size_t kStageMinBytes = 64 << 10;

struct StageSlot {
    void *ptr;          /* pinned host memory, or nullptr before first use */
    size_t bytes;
    cudaEvent_t ev;     /* recorded after the slot's last copy (created on the slot's device) */
    uint64_t seq;       /* order of use, for the wait when every slot is in flight */
    int claimed;        /* taken by a call that has not recorded its event yet */
};

std::mutex g_stage_mu;
StageSlot g_stage[kStageDevices][kStageSlots];
uint64_t g_stage_seq = 0;

size_t stage_round(size_t bytes) {
    size_t n = kStageMinBytes;
    while (n < bytes) n <<= 1;
    return n;
}

/* Index of a free slot (never used, or its last copy has completed) with room for `bytes`, else of
 * a never-used one, else -1; *small_free: a free slot that is too small, or -1. */
int stage_find_free(StageSlot *slots, size_t bytes, int *small_free) {
    int empty = -1;
    *small_free = -1;
    for (int i = 0; i < kStageSlots; ++i) {
        StageSlot *sl = &slots[i];
        if (sl->claimed) continue;
        if (sl->ptr == nullptr) {
            if (empty < 0) empty = i;
            continue;
        }
        cudaError_t q = cudaEventQuery(sl->ev);
        if (q == cudaErrorNotReady) {
            (void)cudaGetLastError(); /* not an error: clear it so later checks do not see it */
            continue;
        }
        if (q != cudaSuccess) continue;
        if (sl->bytes >= bytes) return i;
        if (*small_free < 0) *small_free = i;
    }
    return empty;
}

/* Makes the slot hold at least `bytes` (allocating, or replacing memory that is too small). */
ncp_status stage_fit(StageSlot *sl, size_t bytes) {
    if (sl->ptr != nullptr && sl->bytes >= bytes) return NCP_OK;
    if (sl->ptr != nullptr) {
        NCP_CUDA_CHECK(cudaFreeHost(sl->ptr));
        sl->ptr = nullptr;
        sl->bytes = 0;
    }
    size_t n = stage_round(bytes);
    NCP_CUDA_CHECK(cudaHostAlloc(&sl->ptr, n, cudaHostAllocPortable));
    sl->bytes = n;
    if (sl->ev == nullptr) NCP_CUDA_CHECK(cudaEventCreateWithFlags(&sl->ev, cudaEventDisableTiming));
    return NCP_OK;
}

/* Claims a slot of the current device with room for `bytes`; *slot_out points at it. */
ncp_status stage_acquire(int dev, size_t bytes, StageSlot **slot_out) {
    NCP_ARG_CHECK(dev >= 0 && dev < kStageDevices,
                  "input_ids is on CUDA device %d; the MiMo sharder's staging ring covers devices 0..%d", dev,
                  kStageDevices - 1);
    std::lock_guard<std::mutex> lock(g_stage_mu);
    StageSlot *slots = g_stage[dev];
    int small = -1;
    int i = stage_find_free(slots, bytes, &small);
    if (i < 0) i = small;
    if (i < 0) { /* every slot in flight: wait for the oldest (more than kStageSlots calls queued) */
        for (int k = 0; k < kStageSlots; ++k)
            if (!slots[k].claimed && (i < 0 || slots[k].seq < slots[i].seq)) i = k;
        NCP_CHECK(i >= 0, NCP_ERR_UNSUPPORTED, "every staging slot of device %d is claimed by a running call", dev);
        NCP_CUDA_CHECK(cudaEventSynchronize(slots[i].ev));
    }
    NCP_TRY(stage_fit(&slots[i], bytes));
    slots[i].claimed = 1;
    slots[i].seq = ++g_stage_seq;
    *slot_out = &slots[i];
    return NCP_OK;
}

/* Copies `words` of the slot to dst on `stream`, records the slot's event and releases it. */
ncp_status stage_copy_release(StageSlot *sl, int64_t *dst, int64_t words, cudaStream_t stream) {
    cudaError_t err = cudaMemcpyAsync(dst, sl->ptr, (size_t)words * sizeof(int64_t), cudaMemcpyHostToDevice, stream);
    if (err == cudaSuccess) err = cudaEventRecord(sl->ev, stream);
    std::lock_guard<std::mutex> lock(g_stage_mu);
    sl->claimed = 0;
    if (err != cudaSuccess) { /* the slot may still be read by a queued copy: wait before reuse */
        (void)cudaStreamSynchronize(stream);
        (void)cudaGetLastError();
    }
    NCP_CUDA_CHECK(err);
    return NCP_OK;
}

void stage_release(StageSlot *sl) {
    std::lock_guard<std::mutex> lock(g_stage_mu);
    sl->claimed = 0;
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

extern "C" ncp_status ncp_mimo_run_cuda(ncp_mimo_run_params *p, ncp_mimo_layout_info *info, void *stream) {
    NCP_TRY(ncp_mimo_run_prepare(p));
    if (p->host != nullptr) { /* metadata on the host: the layout goes straight into host */
        p->layout.buf = p->host;
        NCP_TRY(ncp_mimo_layout(&p->layout, info));
        const ncp_mimo_shard_params &sp = p->shard;
        if (info->kernel_words <= ncp::kParamTableWords) { /* the table rides in the launch */
            NCP_TRY(ncp_mimo_shard_check(&sp));
            const int64_t Tc = (sp.B / sp.num_chunks) * sp.S, L = sp.cp_size > 1 ? Tc / sp.cp_size : Tc;
            if (sp.num_chunks * Tc == 0) return NCP_OK;
            const int64_t words = info->kernel_words;
            cudaStream_t s = (cudaStream_t)stream;
            if (words <= 1024) return ncp::launch_param<1024>(sp, Tc, L, p->host, words, s);
            if (words <= 2048) return ncp::launch_param<2048>(sp, Tc, L, p->host, words, s);
            return ncp::launch_param<ncp::kParamTableWords>(sp, Tc, L, p->host, words, s);
        }
    }
    int dev = 0;
    NCP_CUDA_CHECK(cudaGetDevice(&dev));
    ncp::StageSlot *slot = nullptr;
    NCP_TRY(ncp::stage_acquire(dev, (size_t)p->plan.lay_words * sizeof(int64_t), &slot));
    if (p->host != nullptr) { /* a table too large for the launch: staged from the host block */
        memcpy(slot->ptr, p->host, (size_t)info->kernel_words * sizeof(int64_t));
    } else {
        p->layout.buf = (int64_t *)slot->ptr;
        ncp_status st = ncp_mimo_layout(&p->layout, info);
        if (st != NCP_OK) {
            ncp::stage_release(slot);
            return st;
        }
    }
    const int64_t words = p->host != nullptr ? info->kernel_words : info->total_words;
    NCP_TRY(ncp::stage_copy_release(slot, p->out + p->plan.lay_off, words, (cudaStream_t)stream));
    return ncp_mimo_shard_cuda(&p->shard, stream);
}
