/*
 * cuda/cp_exchange.cu: the Flint CP rank step's bookkeeping around the all-to-all (ncp.h), one
 * memory-bound kernel each: gather the rows a rank sends ([k | v] by send_idx; in the backward the
 * gradients of received rows by recv_slot), assemble the K/V buffer sorted by global position from
 * the local rows and the received ones, and sum the gradients other ranks return (fp32, rank
 * order, so bitwise repeatable). One thread moves 16 bytes (8 elements of 16 bits); an index
 * outside its table reads zeros. 16-bit dtypes; the CPU twin is cpu/cp_exchange.c. Also the
 * expansion of a plan's tables from their runs (its host twin is core/plan.c).
 * Tests: tests/test_flint_plan.py (CUDA cases)   Bench: benchmarks/bench_flint.py
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ncp/ncp.h"
#include "ncp/ncp_check.h"

extern "C" ncp_status ncp_kv_gather_check(const ncp_kv_gather_params *p);
extern "C" ncp_status ncp_kv_assemble_check(const ncp_kv_assemble_params *p);
extern "C" ncp_status ncp_kv_grad_sum_check(const ncp_kv_grad_sum_params *p);

namespace ncp {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint4 row_chunk(const ncp_kv_pair &s, int64_t r, int h, int c, bool second) {
    if (r < 0 || r >= s.rows) return make_uint4(0, 0, 0, 0);
    const char *base = static_cast<const char *>(second ? s.b : s.a);
    const int64_t off = (r * (second ? s.b_st : s.a_st) + (int64_t)h * (second ? s.b_sh : s.a_sh)) * 2 + (int64_t)c * 16;
    return __ldg(reinterpret_cast<const uint4 *>(base + off));
}

/* thread i: output row i / (H * 2C), head, then chunk of [a | b] (C = D / 8 chunks per half) */
__global__ void __launch_bounds__(kThreads) kv_gather_kernel(const ncp_kv_gather_params p) {
    const int C = p.src.D / 8, per_row = p.src.H * 2 * C;
    const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
    if (i >= (int64_t)p.n * per_row) return;
    const int j = (int)(i / per_row), rem = (int)(i % per_row), h = rem / (2 * C), c2 = rem % (2 * C);
    const uint4 v = row_chunk(p.src, __ldg(p.idx + j), h, c2 % C, c2 >= C);
    reinterpret_cast<uint4 *>(p.out)[i] = v;
}

/* thread i: slot i / (H * C), head, chunk; writes the chunk of K and of V */
__global__ void __launch_bounds__(kThreads) kv_assemble_kernel(const ncp_kv_assemble_params p) {
    const int C = p.local.D / 8, H = p.local.H;
    const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
    if (i >= (int64_t)p.n_slots * H * C) return;
    const int s = (int)(i / (H * C)), h = (int)(i / C % H), c = (int)(i % C);
    const int64_t r = __ldg(p.slot_src + s);
    uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
    if (r < p.local.rows) {
        kv = row_chunk(p.local, r, h, c, false);
        vv = row_chunk(p.local, r, h, c, true);
    } else if (r - p.local.rows < p.n_recv) {
        const uint4 *src = reinterpret_cast<const uint4 *>(p.recv) + ((r - p.local.rows) * H + h) * 2 * C;
        kv = __ldg(src + c);
        vv = __ldg(src + C + c);
    }
    reinterpret_cast<uint4 *>(p.kbuf)[i] = kv;
    reinterpret_cast<uint4 *>(p.vbuf)[i] = vv;
}

template <typename T> struct cvt;
template <> struct cvt<__nv_bfloat16> {
    static __device__ __forceinline__ float2 in(uint32_t u) {
        return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 *>(&u));
    }
    static __device__ __forceinline__ uint32_t out(float a, float b) {
        __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<uint32_t *>(&v);
    }
};
template <> struct cvt<__half> {
    static __device__ __forceinline__ float2 in(uint32_t u) { return __half22float2(*reinterpret_cast<__half2 *>(&u)); }
    static __device__ __forceinline__ uint32_t out(float a, float b) {
        __half2 v = __floats2half2_rn(a, b);
        return *reinterpret_cast<uint32_t *>(&v);
    }
};

template <typename T> __device__ __forceinline__ void add8(float *acc, uint4 v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 f = cvt<T>::in(w[k]);
        acc[2 * k] += f.x;
        acc[2 * k + 1] += f.y;
    }
}

/* thread i: local row i / (H * 2C), head, chunk of [dk | dv] */
template <typename T> __global__ void __launch_bounds__(kThreads) kv_grad_sum_kernel(const ncp_kv_grad_sum_params p) {
    const int C = p.buf.D / 8, H = p.buf.H, per_row = H * 2 * C;
    const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
    if (i >= (int64_t)p.n_local * per_row) return;
    const int row = (int)(i / per_row), rem = (int)(i % per_row), h = rem / (2 * C), c2 = rem % (2 * C);
    const bool second = c2 >= C;
    const int c = c2 % C;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    add8<T>(acc, row_chunk(p.buf, __ldg(p.local_slot + row), h, c, second));
    const int j0 = __ldg(p.ret_off + row), j1 = __ldg(p.ret_off + row + 1);
    for (int j = max(j0, 0); j < min(j1, p.n_back); ++j) { /* rank order: bitwise repeatable */
        const int r = __ldg(p.ret_idx + j);
        if (r < 0 || r >= p.n_back) continue;
        add8<T>(acc, __ldg(reinterpret_cast<const uint4 *>(p.back) + ((int64_t)r * H + h) * 2 * C + c2));
    }
    uint4 o;
    o.x = cvt<T>::out(acc[0], acc[1]);
    o.y = cvt<T>::out(acc[2], acc[3]);
    o.z = cvt<T>::out(acc[4], acc[5]);
    o.w = cvt<T>::out(acc[6], acc[7]);
    reinterpret_cast<uint4 *>(second ? p.dv : p.dk)[((int64_t)row * H + h) * C + c] = o;
}

/* The 16-byte access rules of these kernels (outputs and received rows are contiguous tensors the
 * caller allocated: 16-byte aligned too, checked with the sources). */
ncp_status check_vectors(const ncp_kv_pair &s, const char *op, const void *o1, const void *o2 = nullptr,
                         const void *o3 = nullptr) {
    NCP_ARG_CHECK((uintptr_t)o1 % 16 == 0 && (uintptr_t)o2 % 16 == 0 && (uintptr_t)o3 % 16 == 0,
                  "%s: outputs and received rows must be 16-byte aligned on CUDA", op);
    NCP_ARG_CHECK(s.dtype == NCP_DT_F16 || s.dtype == NCP_DT_BF16, "%s: k and v must be float16 or bfloat16 on CUDA", op);
    NCP_ARG_CHECK(s.D % 8 == 0, "%s: head_dim must be a multiple of 8 on CUDA; got %d", op, s.D);
    NCP_ARG_CHECK((uintptr_t)s.a % 16 == 0 && (uintptr_t)s.b % 16 == 0 && s.a_st % 8 == 0 && s.a_sh % 8 == 0 &&
                      s.b_st % 8 == 0 && s.b_sh % 8 == 0,
                  "%s: k and v must be 16-byte aligned with strides that are multiples of 8 elements on CUDA", op);
    return NCP_OK;
}

unsigned blocks(int64_t n) { return (unsigned)((n + kThreads - 1) / kThreads); }

/* A plan's tables from their runs: blocks stride over the runs, threads over a run's entries. */
__global__ void __launch_bounds__(kThreads) runs_expand_kernel(const ncp_run *runs, int32_t n_runs, int32_t *out,
                                                              int64_t n_out) {
    for (int32_t b = blockIdx.x; b < n_runs; b += gridDim.x) {
        const ncp_run r = runs[b];
        for (int32_t t = threadIdx.x; t < r.len; t += kThreads) {
            const int64_t o = (int64_t)r.out + (int64_t)t * r.stride;
            if (o >= 0 && o < n_out) out[o] = (int32_t)((int64_t)r.val + (int64_t)t * r.step);
        }
    }
}

}  // namespace
}  // namespace ncp

extern "C" ncp_status ncp_kv_gather_cuda(const ncp_kv_gather_params *p, void *stream) {
    NCP_TRY(ncp_kv_gather_check(p));
    NCP_TRY(ncp::check_vectors(p->src, "kv_gather", p->out));
    const int64_t n = (int64_t)p->n * p->src.H * (p->src.D / 4);
    if (n == 0) return NCP_OK;
    ncp::kv_gather_kernel<<<ncp::blocks(n), ncp::kThreads, 0, (cudaStream_t)stream>>>(*p);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}

extern "C" ncp_status ncp_kv_assemble_cuda(const ncp_kv_assemble_params *p, void *stream) {
    NCP_TRY(ncp_kv_assemble_check(p));
    NCP_TRY(ncp::check_vectors(p->local, "kv_assemble", p->kbuf, p->vbuf, p->recv));
    const int64_t n = (int64_t)p->n_slots * p->local.H * (p->local.D / 8);
    if (n == 0) return NCP_OK;
    ncp::kv_assemble_kernel<<<ncp::blocks(n), ncp::kThreads, 0, (cudaStream_t)stream>>>(*p);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}

extern "C" ncp_status ncp_kv_grad_sum_cuda(const ncp_kv_grad_sum_params *p, void *stream) {
    NCP_TRY(ncp_kv_grad_sum_check(p));
    NCP_TRY(ncp::check_vectors(p->buf, "kv_grad_sum", p->dk, p->dv, p->back));
    const int64_t n = (int64_t)p->n_local * p->buf.H * (p->buf.D / 4);
    if (n == 0) return NCP_OK;
    cudaStream_t s = (cudaStream_t)stream;
    if (p->buf.dtype == NCP_DT_BF16)
        ncp::kv_grad_sum_kernel<__nv_bfloat16><<<ncp::blocks(n), ncp::kThreads, 0, s>>>(*p);
    else
        ncp::kv_grad_sum_kernel<__half><<<ncp::blocks(n), ncp::kThreads, 0, s>>>(*p);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}

extern "C" ncp_status ncp_runs_expand_cuda(const ncp_run *runs_host, const ncp_run *runs_dev, int32_t n_runs, int32_t *out,
                                           int64_t n_out, void *stream) {
    NCP_TRY(ncp_runs_check(runs_host, n_runs, n_out));
    NCP_ARG_CHECK(n_runs == 0 || (runs_dev != nullptr && out != nullptr), "runs_dev and out must not be NULL");
    if (n_runs == 0) return NCP_OK;
    const unsigned grid = n_runs < 4096 ? (unsigned)n_runs : 4096u;
    ncp::runs_expand_kernel<<<grid, ncp::kThreads, 0, (cudaStream_t)stream>>>(runs_dev, n_runs, out, n_out);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}
