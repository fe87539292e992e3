/*
 * sink_attn/portable_fwd.cu: learned-sink attention forward on tensor cores with mma.sync (any
 * sm_80+ GPU); the dispatcher (dispatch.cu) runs it where the Hopper kernel cannot run. Kernel and
 * launcher only.
 *
 * Per query row i of head h (kv head h / G), scale s, sink a_h, in the log2 domain:
 *     x_j = s * log2(e) * <q_i, k_j>,     m_0 = a_h * log2(e),  l_0 = 1,  acc_0 = 0
 *     per kv tile: m' = max(m, max_j x_j); l = l * 2^(m - m') + sum_j 2^(x_j - m'); acc likewise
 *     O_i = acc / l,   lse_i = (m + log2 l) * ln 2           (the sink's value vector is zero)
 * With no sink m_0 = -inf, l_0 = 0, and a row that sees no key gets O = 0, lse = -inf.
 *
 * Layout: THD q (Tq, Hq, D), k/v (Tk, Hkv, D), last dim contiguous, rows 16-byte aligned; lse (Hq, Tq).
 * Dtypes bf16/fp16, D in {64, 128}, fp32 accumulation. CTA = BM = 128 query rows: 4 warps x 32 rows
 * (two m16 tiles per warp, so each K/V fragment feeds two MMAs); kv tiles of BN = 64 keys
 * double-buffered through cp.async; P goes from the S accumulators straight into the P @ V
 * A-fragments. Grid (Hq, q tiles), heaviest tiles first. Only kv tiles holding a visible pair are
 * visited (the mask policy's key range of the q tile), and only partial tiles pay for the mask.
 * Test: pytest tests/test_sink_attention_cuda.py   Bench: python benchmarks/bench_sink_attention.py
 */
#include "common.cuh"
#include "launch.h"
#include "mask.cuh"

namespace ncp {
namespace {

constexpr int BM = 128; /* query rows per CTA */
constexpr int BN = 64;  /* keys per kv tile */
constexpr int MT = 2;   /* m16 tiles per warp */
constexpr int NW = 4;   /* warps */

template <int D> constexpr int smem_bytes() { return (BM * D + 4 * BN * D) * 2; }

/* S = Q K^T of the warp's 16 MT rows against the BN keys of tile sK (Q fragments from shared
 * memory at every k step: two m16 tiles per warp halve the K/V reads per FLOP). */
template <typename T, int D>
__device__ __forceinline__ void scores(float (*s)[BN / 8][4], uint32_t sQ, uint32_t sK, int wrow, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_a<D>(a[mt], sQ, wrow + 16 * mt, 2 * ks, lane);
#pragma unroll
        for (int np = 0; np < BN / 16; ++np) {
            uint32_t b[4];
            load_b_nk<D>(b, sK, np * 16, 2 * ks, lane);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816<T>(s[mt][2 * np], a[mt], b);
                mma16816<T>(s[mt][2 * np + 1], a[mt], b + 2);
            }
        }
    }
}

/* acc += P V, P packed from the probabilities in s. */
template <typename T, int D>
__device__ __forceinline__ void accumulate_pv(float (*acc)[D / 8][4], float (*s)[BN / 8][4], uint32_t sV, int lane) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) pack_frag<T>(a[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t b[4];
            load_b_kn<D>(b, sV, kk * 16, 2 * dp, lane);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816<T>(acc[mt][2 * dp], a[mt], b);
                mma16816<T>(acc[mt][2 * dp + 1], a[mt], b + 2);
            }
        }
    }
}

template <typename T, int D, class Mask>
__global__ void __launch_bounds__(32 * NW, 2) sink_attn_fwd_kernel(const ncp_sink_attn_params p) {
    constexpr int kThreads = 32 * NW;
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t sQ = smem_u32(smem);
    const uint32_t sK0 = sQ + BM * D * 2, sV0 = sK0 + 2 * BN * D * 2;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int h = blockIdx.x, g_kv = h / (p.Hq / p.Hkv);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BM, wrow = warp * 16 * MT; /* heavy (late) tiles first */
    const Mask mask(p);
    const q_tile_range rng = q_range(mask, q0, BM, BN);
    const int n_it = max(0, rng.kt_hi - rng.kt_lo + 1); /* kv tile of step it: kt_hi - it, diagonal first */
    const T *kh = reinterpret_cast<const T *>(p.k) + (int64_t)g_kv * p.k_sh;
    const T *vh = reinterpret_cast<const T *>(p.v) + (int64_t)g_kv * p.v_sh;
    auto load_kv = [&](int it, int stage) {
        const int k0 = (rng.kt_hi - it) * BN;
        load_tile<D, BN, kThreads>(sK0 + stage * BN * D * 2, kh, p.k_st, k0, p.Tk, tid);
        load_tile<D, BN, kThreads>(sV0 + stage * BN * D * 2, vh, p.v_st, k0, p.Tk, tid);
    };
    load_tile<D, BM, kThreads>(sQ, reinterpret_cast<const T *>(p.q) + (int64_t)h * p.q_sh, p.q_st, q0, p.Tq, tid);
    if (n_it > 0) load_kv(0, 0);
    cp_async_commit();

    /* per-row state: rows wrow + 16 mt + gq (+ 8) */
    int lo[MT][2], hi[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) row_bounds(mask, q0 + wrow + 16 * mt + gq + 8 * r, lo[mt][r], hi[mt][r]);
    const float scale_log2 = (float)p.scale * kLog2e;
    const bool has_sink = p.sink != nullptr;
    const float sink_log2 = has_sink ? __ldg(reinterpret_cast<const float *>(p.sink) + h) * kLog2e : -INFINITY;
    float m[MT][2], l[MT][2], acc[MT][D / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m[mt][0] = m[mt][1] = sink_log2;
        l[mt][0] = l[mt][1] = (has_sink && tq == 0) ? 1.f : 0.f; /* the sink counted once per quad */
#pragma unroll
        for (int i = 0; i < D / 8; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
    }

    for (int it = 0; it < n_it; ++it) {
        const int stage = it & 1, k0 = (rng.kt_hi - it) * BN;
        if (it + 1 < n_it) load_kv(it + 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const bool full = full_cols(rng, k0, BN, p.Tk);
        float s[MT][BN / 8][4];
        scores<T, D>(s, sQ, sK0 + stage * BN * D * 2, wrow, lane);
        /* scale into the log2 domain, mask partial tiles, online softmax */
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int kj = k0 + nt * 8 + 2 * tq + (e & 1);
                    s[mt][nt][e] *= scale_log2;
                    if (!full && (kj < lo[mt][e >> 1] || kj > hi[mt][e >> 1])) s[mt][nt][e] = -INFINITY;
                }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = m[mt][r];
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
                mx = quad_max(mx);
                const float m_use = mx == -INFINITY ? 0.f : mx;
                const float corr = ex2(m[mt][r] - m_use);
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < BN / 8; ++nt) {
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
        accumulate_pv<T, D>(acc, s, sV0 + stage * BN * D * 2, lane);
        __syncthreads();
    }
    cp_async_wait<0>();
    __syncthreads();

    /* epilogue: O = acc / l through shared memory, lse (NaN stays NaN) */
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[mt][r] = quad_sum(l[mt][r]);
            inv[r] = l[mt][r] == 0.f ? 0.f : 1.f / l[mt][r];
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
                    p.lse[(int64_t)h * p.Tq + i] = l[mt][r] == 0.f ? -INFINITY : (m[mt][r] + __log2f(l[mt][r])) * kLn2;
            }
        }
    }
    __syncthreads();
    copy_staged_rows<T, D, BM, kThreads>(sQ, reinterpret_cast<T *>(p.out) + (int64_t)h * p.o_sh, p.o_st, q0, p.Tq, tid);
}

template <typename T, int D, class Mask> ncp_status launch(const ncp_sink_attn_params &p, cudaStream_t stream) {
    constexpr int bytes = smem_bytes<D>();
    auto kernel = sink_attn_fwd_kernel<T, D, Mask>;
    NCP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    NCP_ARG_CHECK((p.Tq + BM - 1) / BM <= 65535, "too many query tiles for one launch (Tq=%d)", p.Tq);
    const dim3 grid(p.Hq, (p.Tq + BM - 1) / BM);
    kernel<<<grid, 32 * NW, bytes, stream>>>(p);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}

}  // namespace

ncp_status attn_fwd_portable(const ncp_sink_attn_params &p, cudaStream_t s) {
    const bool bf16 = p.dtype == NCP_DT_BF16, table = p.mask.kind == NCP_MASK_TABLE;
#define NCP_FWD(T, D) (table ? launch<T, D, TableMask>(p, s) : launch<T, D, DocsMask>(p, s))
    if (p.D == 64) return bf16 ? NCP_FWD(__nv_bfloat16, 64) : NCP_FWD(__half, 64);
    return bf16 ? NCP_FWD(__nv_bfloat16, 128) : NCP_FWD(__half, 128);
#undef NCP_FWD
}

}  // namespace ncp
