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
 * Dtypes bf16/fp16, D in {64, 128}, fp32 accumulation. CTA = BM = 128 query rows: 4 warps x 32 rows
 * (default, NCP_FWD_VARIANT=3; 2 = the same with 32-key inner blocks) or 8 warps x 16 rows with Q in
 * registers (NCP_FWD_VARIANT=1); kv tiles of BN = 64 keys
 * double-buffered through cp.async; P goes from the S accumulators straight into the P @ V
 * A-fragments. Grid (Hq, q tiles), heaviest tiles first.
 * Only kv tiles holding a visible pair are visited (contiguous mode: computed per CTA from
 * cu_seqlens and the window; positions mode: the plan's CSR schedule), and only partial tiles pay
 * for the mask.
 *
 * Versions: v1 (this) FA2-style mma.sync. Measured: BENCHMARKS.md.
 * Test: pytest tests/test_sink_attention_cuda.py   Bench: python benchmarks/bench_sink_attention.py
 */
#include <stdlib.h>

#include "ncp/ncp_check.h"
#include "ncp_internal.h"
#include "sink_attn_common.cuh"
#include "sm90_common.cuh"

namespace ncp {
namespace {

constexpr int BM = NCP_FWD_BM; /* 128 query rows per CTA */
constexpr int BN = NCP_FWD_BN; /* 64 keys per kv tile */

template <int D> constexpr int smem_bytes() { return (BM * D + 4 * BN * D) * 2 + 2 * BN * 4; }

/* MT m16 tiles (16 * MT query rows) per warp and NW warps: MT = 2 halves the shared-memory reads
 * of K and V per FLOP (each B fragment feeds two MMAs) at the price of registers, so Q fragments
 * then come from shared memory at every k step instead of living in registers. */
template <typename T, int D, int MT, int NW, int BNI>
__global__ void __launch_bounds__(32 * NW, MT == 1 ? 1 : 2) sink_attn_fwd_kernel(const ncp_sink_attn_params p) {
    static_assert(16 * MT * NW == BM, "a CTA covers BM query rows");
    static_assert(BN % BNI == 0, "the kv tile splits into inner blocks of BNI keys");
    constexpr int kThreads = 32 * NW;
    constexpr bool kQInRegs = MT == 1;
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t sQ = smem_u32(smem);
    const uint32_t sK0 = sQ + BM * D * 2, sV0 = sK0 + 2 * BN * D * 2;
    int *s_kpos = reinterpret_cast<int *>(smem + (BM * D + 4 * BN * D) * 2);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.x, g_kv = h / (p.Hq / p.Hkv);
    const int tile = gridDim.y - 1 - blockIdx.y; /* heavy (late) tiles first */
    const int q0 = tile * BM, wrow = warp * 16 * MT;
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
        if (positions && tid < BN) {
            const int j = kt * BN + tid;
            s_kpos[stage * BN + tid] = j >= p.Tk ? kNoKey : __ldg(p.k_pos + j);
        }
    };

    load_tile<D, BM, kThreads>(sQ, qh, p.q_st, q0, p.Tq, tid);
    if (n_it > 0) load_kv(0, 0);
    cp_async_commit();

    /* ---- per-row state: rows wrow + 16 mt + g (+ 8) --------------------------------------- */
    const int gq = lane >> 2, tq = lane & 3;
    int qpos[MT][2], qlo[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) row_bounds(p, q0 + wrow + 16 * mt + gq + 8 * r, qpos[mt][r], qlo[mt][r]);
    const float scale_log2 = (float)p.scale * kLog2e;
    const bool has_sink = p.sink != nullptr;
    const float sink_log2 = has_sink ? __ldg(reinterpret_cast<const float *>(p.sink) + h) * kLog2e : -INFINITY;
    /* the sink's exp(a - m) term starts on one lane of the quad so the final quad sum counts it once */
    const float l0 = (has_sink && tq == 0) ? 1.f : 0.f;
    float m[MT][2], l[MT][2];
    float acc[MT][D / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m[mt][0] = m[mt][1] = sink_log2;
        l[mt][0] = l[mt][1] = l0;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
    }
    uint32_t qf[kQInRegs ? D / 16 : 1][4];

    for (int it = 0; it < n_it; ++it) {
        const int stage = it & 1;
        if (it + 1 < n_it) load_kv(it + 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        if (kQInRegs && it == 0) {
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) load_a<D>(qf[kQInRegs ? ks : 0], sQ, wrow, 2 * ks, lane);
        }
        bool full;
        const int kt = tile_at(it, full);
        const uint32_t sK = sK0 + stage * BN * D * 2, sV = sV0 + stage * BN * D * 2;

#pragma unroll 1
        for (int sub = 0; sub < BN / BNI; ++sub) {
            /* S = Q K^T (16 MT x BNI per warp), per inner block of the kv tile */
            float s[MT][BNI / 8][4];
    #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
                for (int i = 0; i < BNI / 8; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
    #pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
                uint32_t a[MT][4];
    #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if (kQInRegs) {
    #pragma unroll
                        for (int e = 0; e < 4; ++e) a[mt][e] = qf[kQInRegs ? ks : 0][e];
                    } else {
                        load_a<D>(a[mt], sQ, wrow + 16 * mt, 2 * ks, lane);
                    }
                }
    #pragma unroll
                for (int np = 0; np < BNI / 16; ++np) {
                    uint32_t b[4];
                    load_b_nk<D>(b, sK, sub * BNI + np * 16, 2 * ks, lane);
    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816<T>(s[mt][2 * np], a[mt], b);
                        mma16816<T>(s[mt][2 * np + 1], a[mt], b + 2);
                    }
                }
            }
            /* scale into the log2 domain, mask partial tiles, online softmax */
    #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
    #pragma unroll
                for (int nt = 0; nt < BNI / 8; ++nt)
    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float x = s[mt][nt][e] * scale_log2;
                        if (!full) {
                            const int col = sub * BNI + nt * 8 + 2 * tq + (e & 1);
                            const int kp = positions ? s_kpos[stage * BN + col] : (kt * BN + col < p.Tk ? kt * BN + col : kNoKey);
                            if (kp < qlo[mt][e >> 1] || kp > qpos[mt][e >> 1]) x = -INFINITY;
                        }
                        s[mt][nt][e] = x;
                    }
    #pragma unroll
                for (int r = 0; r < 2; ++r) {
                    float mx = m[mt][r];
    #pragma unroll
                    for (int nt = 0; nt < BNI / 8; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
                    mx = quad_max(mx);
                    const float m_use = mx == -INFINITY ? 0.f : mx;
                    const float corr = ex2(m[mt][r] - m_use);
                    float sum = 0.f;
    #pragma unroll
                    for (int nt = 0; nt < BNI / 8; ++nt) {
                        s[mt][nt][2 * r] = ex2(s[mt][nt][2 * r] - m_use);
                        s[mt][nt][2 * r + 1] = ex2(s[mt][nt][2 * r + 1] - m_use);
                        sum += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
                    }
                    l[mt][r] = l[mt][r] * corr + sum; /* quad partial sums; reduced once at the end */
                    m[mt][r] = mx;
    #pragma unroll
                    for (int dt = 0; dt < D / 8; ++dt) {
                        acc[mt][dt][2 * r] *= corr;
                        acc[mt][dt][2 * r + 1] *= corr;
                    }
                }
            }
            /* O += P V */
    #pragma unroll
            for (int kk = 0; kk < BNI / 16; ++kk) {
                uint32_t a[MT][4];
    #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    a[mt][0] = elem<T>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                    a[mt][1] = elem<T>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                    a[mt][2] = elem<T>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                    a[mt][3] = elem<T>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
                }
    #pragma unroll
                for (int dp = 0; dp < D / 16; ++dp) {
                    uint32_t b[4];
                    load_b_kn<D>(b, sV, sub * BNI + kk * 16, 2 * dp, lane);
    #pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816<T>(acc[mt][2 * dp], a[mt], b);
                        mma16816<T>(acc[mt][2 * dp + 1], a[mt], b + 2);
                    }
                }
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();
    __syncthreads();

    /* ---- epilogue: O = acc / l through shared memory, lse ------------------------------ */
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[mt][r] = quad_sum(l[mt][r]);
            inv[r] = l[mt][r] > 0.f ? 1.f / l[mt][r] : 0.f;
        }
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = wrow + 16 * mt + gq + 8 * r;
                const uint32_t v = elem<T>::pack(acc[mt][dt][2 * r] * inv[r], acc[mt][dt][2 * r + 1] * inv[r]);
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sQ + swz<D>(row, dt) + tq * 4), "r"(v));
            }
        if (tq == 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = q0 + wrow + 16 * mt + gq + 8 * r;
                if (i < p.Tq)
                    p.lse[(int64_t)h * p.Tq + i] = l[mt][r] > 0.f ? (m[mt][r] + __log2f(l[mt][r])) * kLn2 : -INFINITY;
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

template <typename T, int D, int MT, int NW, int BNI>
ncp_status launch(const ncp_sink_attn_params &p, cudaStream_t stream) {
    constexpr int bytes = smem_bytes<D>();
    auto kernel = sink_attn_fwd_kernel<T, D, MT, NW, BNI>;
    NCP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    const dim3 grid(p.Hq, (p.Tq + BM - 1) / BM);
    kernel<<<grid, 32 * NW, bytes, stream>>>(p);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}

/* Kernel layout (NCP_FWD_VARIANT, read once): 1 = 8 warps x 16 rows, Q in registers;
 * 2 = 4 warps x 32 rows with 32-key inner blocks at D = 128 (register budget); 3 = 4 warps x 32
 * rows with 64-key blocks; 4 = the Hopper kernel (sink_attn_fwd_sm90.cu). Default (0): 4 where
 * usable (sm_90a build on a compute capability 9.0 device), else 3. */
int variant() {
    const char *e = getenv("NCP_FWD_VARIANT"); /* per call: tests switch kernels in one process */
    return (e != nullptr && e[0] >= '1' && e[0] <= '4' && e[1] == 0) ? e[0] - '0' : 0;
}

template <typename T, int D> ncp_status launch_any(const ncp_sink_attn_params &p, cudaStream_t s) {
    switch (variant()) {
    case 1: return launch<T, D, 1, 8, 64>(p, s);
    case 2: return launch<T, D, 2, 4, D == 128 ? 32 : 64>(p, s);
    default: return launch<T, D, 2, 4, 64>(p, s); /* 3, and 0/4 where the Hopper kernel is unusable */
    }
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
    if (ncp_sink_attn_fwd_variant() == 4) return ncp_sink_attn_fwd_sm90(p, stream);
    const bool bf16 = p->dtype == NCP_DT_BF16;
    if (p->D == 64) return bf16 ? ncp::launch_any<__nv_bfloat16, 64>(*p, s) : ncp::launch_any<__half, 64>(*p, s);
    return bf16 ? ncp::launch_any<__nv_bfloat16, 128>(*p, s) : ncp::launch_any<__half, 128>(*p, s);
}

extern "C" int ncp_sink_attn_fwd_variant(void) {
    const int v = ncp::variant();
    if (v == 0 || v == 4) return ncp_sm90_usable() ? 4 : 3;
    return v;
}

/* Shared with the backward file. */
extern "C" ncp_status ncp_sink_attn_check_vector_access(const ncp_sink_attn_params *p) {
    return check_vector_access(p);
}
