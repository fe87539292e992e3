/*
 * cuda/sink_attn_fwd.cu: learned-sink attention forward, tensor cores (mma.sync, sm_80+).
 *
 * Per query row i of head h (kv head h / G), scale s, sink a_h, in the log2 domain:
 *     x_j = s * log2(e) * <q_i, k_j>,     m_0 = a_h * log2(e),  l_0 = 1,  acc_0 = 0
 *     per kv tile: m' = max(m, max_j x_j); l = l * 2^(m - m') + sum_j 2^(x_j - m'); acc likewise
 *     O_i = acc / l,   lse_i = (m + log2 l) * ln 2           (the sink's value vector is zero)
 * With no sink m_0 = -inf, l_0 = 0, and a row that sees no key gets O = 0, lse = -inf.
 *
 * Layout: THD q (Tq, Hq, D), k/v (Tk, Hkv, D), last dim contiguous, rows 16-byte aligned; lse (Hq, Tq).
 * Dtypes bf16/fp16, D in {64, 128}, fp32 accumulation. CTA = 8 warps x 16 query rows (BM = 128),
 * kv tiles of BN = 64 keys double-buffered through cp.async; Q stays in registers; P goes from the
 * S accumulators straight into the P @ V A-fragments. Grid (Hq, q tiles), heaviest tiles first.
 * Only kv tiles holding a visible pair are visited (contiguous mode: computed per CTA from
 * cu_seqlens and the window; positions mode: the plan's CSR schedule), and only partial tiles pay
 * for the mask.
 *
 * Versions: v1 (this) FA2-style mma.sync. Measured: BENCHMARKS.md.
 * Test: pytest tests/test_sink_attention_cuda.py   Bench: python benchmarks/bench_sink_attention.py
 */
#include "ncp/ncp_check.h"
#include "ncp_internal.h"
#include "sink_attn_common.cuh"

namespace ncp {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int BM = NCP_FWD_BM; /* 128 = kWarps * 16 */
constexpr int BN = NCP_FWD_BN; /* 64 */
static_assert(BM == kWarps * 16, "one m16 tile per warp");

template <int D> constexpr int smem_bytes() { return (BM * D + 4 * BN * D) * 2 + 2 * BN * 4; }

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) sink_attn_fwd_kernel(const ncp_sink_attn_params p) {
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t sQ = smem_u32(smem);
    const uint32_t sK0 = sQ + BM * D * 2, sV0 = sK0 + 2 * BN * D * 2;
    int *s_kpos = reinterpret_cast<int *>(smem + (BM * D + 4 * BN * D) * 2);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.x, g_kv = h / (p.Hq / p.Hkv);
    const int tile = gridDim.y - 1 - blockIdx.y; /* heavy (late) tiles first */
    const int q0 = tile * BM;
    const bool positions = p.q_pos != nullptr;

    /* ---- which kv tiles ---------------------------------------------------------------- */
    int n_it, e0 = 0;
    q_tile_range rng{};
    if (positions) {
        e0 = __ldg(p.fwd_off + tile);
        n_it = __ldg(p.fwd_off + tile + 1) - e0;
    } else {
        rng = contiguous_q_range(p, q0, BM, BN);
        n_it = max(0, rng.kt_hi - rng.kt_lo + 1);
    }
    auto tile_at = [&](int it, bool &full) -> int {
        if (positions) {
            const int e = __ldg(p.fwd_ent + e0 + it);
            full = e & 1;
            return e >> 1;
        }
        const int kt = rng.kt_hi - it; /* diagonal (partial) tile first */
        full = contiguous_full(p, rng, kt, BN);
        return kt;
    };

    const T *qh = reinterpret_cast<const T *>(p.q) + (int64_t)h * p.q_sh;
    const T *kh = reinterpret_cast<const T *>(p.k) + (int64_t)g_kv * p.k_sh;
    const T *vh = reinterpret_cast<const T *>(p.v) + (int64_t)g_kv * p.v_sh;

    auto load_kv = [&](int it, int stage) {
        bool full;
        const int kt = tile_at(it, full);
        load_tile<D, BN, kThreads>(sK0 + stage * BN * D * 2, kh, p.k_st, kt * BN, p.Tk, tid);
        load_tile<D, BN, kThreads>(sV0 + stage * BN * D * 2, vh, p.v_st, kt * BN, p.Tk, tid);
        if (tid < BN) {
            const int j = kt * BN + tid;
            s_kpos[stage * BN + tid] = j >= p.Tk ? kNoKey : (positions ? __ldg(p.k_pos + j) : j);
        }
    };

    load_tile<D, BM, kThreads>(sQ, qh, p.q_st, q0, p.Tq, tid);
    if (n_it > 0) load_kv(0, 0);
    cp_async_commit();

    /* ---- per-row state: rows r0 = warp*16 + g and r0 + 8 ----------------------------------- */
    const int gq = lane >> 2, tq = lane & 3;
    int qpos[2], qlo[2];
    row_bounds(p, q0 + warp * 16 + gq, qpos[0], qlo[0]);
    row_bounds(p, q0 + warp * 16 + gq + 8, qpos[1], qlo[1]);
    const float scale_log2 = p.scale * kLog2e;
    const bool has_sink = p.sink != nullptr;
    const float sink_log2 = has_sink ? __ldg(reinterpret_cast<const float *>(p.sink) + h) * kLog2e : -INFINITY;
    /* the sink's exp(a - m) term starts on one lane of the quad so the final quad sum counts it once */
    const float l0 = (has_sink && tq == 0) ? 1.f : 0.f;
    float m[2] = {sink_log2, sink_log2}, l[2] = {l0, l0};
    float acc[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    uint32_t qf[D / 16][4];

    for (int it = 0; it < n_it; ++it) {
        const int stage = it & 1;
        if (it + 1 < n_it) load_kv(it + 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        if (it == 0) {
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) load_a<D>(qf[ks], sQ, warp * 16, 2 * ks, lane);
        }
        bool full;
        (void)tile_at(it, full);
        const uint32_t sK = sK0 + stage * BN * D * 2, sV = sV0 + stage * BN * D * 2;

        /* S = Q K^T (16 x 64 per warp) */
        float s[BN / 8][4];
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
            for (int np = 0; np < BN / 16; ++np) {
                uint32_t b[4];
                load_b_nk<D>(b, sK, np * 16, 2 * ks, lane);
                mma16816<T>(s[2 * np], qf[ks], b);
                mma16816<T>(s[2 * np + 1], qf[ks], b + 2);
            }
        }
        /* scale into the log2 domain, mask partial tiles */
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[nt][e] * scale_log2;
                if (!full) {
                    const int kp = s_kpos[stage * BN + nt * 8 + 2 * tq + (e & 1)];
                    const int r = e >> 1;
                    if (kp < qlo[r] || kp > qpos[r]) x = -INFINITY;
                }
                s[nt][e] = x;
            }
        }
        /* online softmax, rows r = 0 (g) and 1 (g + 8) */
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = m[r];
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
            mx = quad_max(mx);
            const float m_use = mx == -INFINITY ? 0.f : mx;
            const float corr = ex2(m[r] - m_use);
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
                s[nt][2 * r] = ex2(s[nt][2 * r] - m_use);
                s[nt][2 * r + 1] = ex2(s[nt][2 * r + 1] - m_use);
                sum += s[nt][2 * r] + s[nt][2 * r + 1];
            }
            l[r] = l[r] * corr + sum; /* quad partial sums; reduced once at the end */
            m[r] = mx;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                acc[dt][2 * r] *= corr;
                acc[dt][2 * r + 1] *= corr;
            }
        }
        /* O += P V */
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            uint32_t a[4];
            a[0] = elem<T>::pack(s[2 * kk][0], s[2 * kk][1]);
            a[1] = elem<T>::pack(s[2 * kk][2], s[2 * kk][3]);
            a[2] = elem<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = elem<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t b[4];
                load_b_kn<D>(b, sV, kk * 16, 2 * dp, lane);
                mma16816<T>(acc[2 * dp], a, b);
                mma16816<T>(acc[2 * dp + 1], a, b + 2);
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();
    if (n_it == 0) {
        __syncthreads();
    }

    /* ---- epilogue: O = acc / l through shared memory, lse ------------------------------ */
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float lsum = quad_sum(l[r]);
        l[r] = lsum;
        inv[r] = lsum > 0.f ? 1.f / lsum : 0.f;
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = warp * 16 + gq + 8 * r;
            const uint32_t v = elem<T>::pack(acc[dt][2 * r] * inv[r], acc[dt][2 * r + 1] * inv[r]);
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sQ + swz<D>(row, dt) + tq * 4), "r"(v));
        }
    }
    if (tq == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = q0 + warp * 16 + gq + 8 * r;
            if (i < p.Tq) {
                const float lse = l[r] > 0.f ? (m[r] + __log2f(l[r])) * kLn2 : -INFINITY;
                p.lse[(int64_t)h * p.Tq + i] = lse;
            }
        }
    }
    __syncthreads();
    T *oh = reinterpret_cast<T *>(p.out) + (int64_t)h * p.o_sh;
    constexpr int kChunks = D / 8;
    for (int i = tid; i < BM * kChunks; i += kThreads) {
        const int row = i / kChunks, chunk = i % kChunks, q = q0 + row;
        if (q >= p.Tq) continue;
        uint4 v;
        asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(sQ + swz<D>(row, chunk)));
        *reinterpret_cast<uint4 *>(oh + (int64_t)q * p.o_st + chunk * 8) = v;
    }
}

template <typename T, int D> ncp_status launch(const ncp_sink_attn_params &p, cudaStream_t stream) {
    constexpr int bytes = smem_bytes<D>();
    auto kernel = sink_attn_fwd_kernel<T, D>;
    NCP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    const dim3 grid(p.Hq, (p.Tq + BM - 1) / BM);
    kernel<<<grid, kThreads, bytes, stream>>>(p);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}

}  // namespace
}  // namespace ncp

/* Checks alignment of the tensors the kernels read with 16-byte vector copies. */
static ncp_status check_vector_access(const ncp_sink_attn_params *p) {
    const uintptr_t ptrs[4] = {(uintptr_t)p->q, (uintptr_t)p->k, (uintptr_t)p->v, (uintptr_t)p->out};
    const int64_t strides[8] = {p->q_st, p->q_sh, p->k_st, p->k_sh, p->v_st, p->v_sh, p->o_st, p->o_sh};
    for (int i = 0; i < 4; ++i)
        NCP_ARG_CHECK(ptrs[i] % 16 == 0, "q, k, v and out must be 16-byte aligned on CUDA (use .contiguous())");
    for (int i = 0; i < 8; ++i)
        NCP_ARG_CHECK(strides[i] % 8 == 0, "token and head strides of q, k, v and out must be multiples of 8 elements");
    return NCP_OK;
}

extern "C" ncp_status ncp_sink_attn_fwd_cuda(const ncp_sink_attn_params *p, void *stream) {
    NCP_TRY(ncp_sink_attn_check(p, 1));
    NCP_TRY(check_vector_access(p));
    NCP_ARG_CHECK((p->Tq + NCP_FWD_BM - 1) / NCP_FWD_BM <= 65535, "too many query tiles for one launch (Tq=%d)", p->Tq);
    if (p->Tq == 0) return NCP_OK;
    cudaStream_t s = (cudaStream_t)stream;
    const bool bf16 = p->dtype == NCP_DT_BF16;
    if (p->D == 64) return bf16 ? ncp::launch<__nv_bfloat16, 64>(*p, s) : ncp::launch<__half, 64>(*p, s);
    return bf16 ? ncp::launch<__nv_bfloat16, 128>(*p, s) : ncp::launch<__half, 128>(*p, s);
}

/* Shared with the backward file. */
extern "C" ncp_status ncp_sink_attn_check_vector_access(const ncp_sink_attn_params *p) {
    return check_vector_access(p);
}
