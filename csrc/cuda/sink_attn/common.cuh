/*
 * sink_attn/common.cuh: building blocks shared by the sink-attention kernels: element types,
 * mma.sync m16n8k16 with fp32 accumulation and the C -> A fragment packer (also the wgmma register
 * layouts), ldmatrix from XOR-swizzled shared tiles, cp.async global->shared copies with zero fill,
 * exp2 and quad reductions. The mask policies are in mask.cuh.
 *
 * Fragment conventions (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4):
 *   A (16x16, row):  a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 8+2t..)  a3 (g+8, 8+2t..)
 *   B (16x8, col):   b0 (k = 2t..2t+1, n = g)  b1 (k = 8+2t.., n = g)
 *   C (16x8):        c0,c1 (g, 2t..2t+1)  c2,c3 (g+8, 2t..2t+1)
 * so a C tile pair converts to an A fragment in registers (P for P @ V without shared memory).
 *
 * Shared tiles hold rows of D 16-bit elements as D/8 chunks of 16 bytes; chunk c of row r lives at
 * chunk (c ^ (r & 7)), which makes every ldmatrix phase and every cp.async row conflict-free.
 */
#ifndef NCP_SINK_ATTN_COMMON_CUH
#define NCP_SINK_ATTN_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "ncp/ncp.h"

namespace ncp {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kNoKey = 0x7fffffff; /* lower bound of a row that sees nothing */

/* ---- element types ---------------------------------------------------------------------- */
template <typename T> struct elem;
template <> struct elem<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
    static __device__ __forceinline__ float2 unpack(uint32_t u) {
        __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162 *>(&u);
        return __bfloat1622float2(v);
    }
};
template <> struct elem<__half> {
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
    static __device__ __forceinline__ float2 unpack(uint32_t u) {
        __half2 v = *reinterpret_cast<__half2 *>(&u);
        return __half22float2(v);
    }
};

template <typename T> __device__ __forceinline__ void mma16816(float *c, const uint32_t *a, const uint32_t *b);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float *c, const uint32_t *a, const uint32_t *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mma16816<__half>(float *c, const uint32_t *a, const uint32_t *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* One A fragment of type T (16 columns) from two C-layout accumulator blocks of 8 columns, r0
 * and r1 (4 values each): the C -> A identity of the layouts above. */
template <typename T> __device__ __forceinline__ void pack_frag(uint32_t *f, const float *r0, const float *r1) {
    f[0] = elem<T>::pack(r0[0], r0[1]);
    f[1] = elem<T>::pack(r0[2], r0[3]);
    f[2] = elem<T>::pack(r1[0], r1[1]);
    f[3] = elem<T>::pack(r1[2], r1[3]);
}

/* A row of N fp32 accumulators in the C layout (x[4j + e], columns 8j..8j+7) as N/16 A fragments
 * of type T for the next MMA (pack_frag; also the wgmma register layouts: the accumulator of m64nN
 * and the A operand of an rs wgmma). */
template <typename T, int N> __device__ __forceinline__ void to_frags(uint32_t (*f)[4], const float *x) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) pack_frag<T>(f[kk], x + 8 * kk, x + 8 * kk + 4);
}

/* ---- shared memory ---------------------------------------------------------------------- */
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile of D-element rows. */
template <int D> __device__ __forceinline__ uint32_t swz(int row, int chunk) {
    return (uint32_t)(row * (D * 2) + ((chunk ^ (row & 7)) << 4));
}

/* Rows [0, ROWS) of a staging tile in shared memory to rows g0 + row of a global tensor of row
 * stride st elements, leaving out rows g0 + row >= n: THREADS threads from tid, 16 bytes each;
 * addr(row, chunk) is the shared address of 16-byte chunk `chunk` of a row (its swizzle). */
template <typename T, int D, int ROWS, int THREADS, class Addr>
__device__ __forceinline__ void copy_staged_rows(const Addr &addr, T *dst, int64_t st, int g0, int n, int tid) {
    constexpr int kChunks = D / 8;
    for (int i = tid; i < ROWS * kChunks; i += THREADS) {
        const int row = i / kChunks, chunk = i % kChunks, g = g0 + row;
        if (g >= n) continue;
        uint4 v;
        asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(addr(row, chunk)));
        *reinterpret_cast<uint4 *>(dst + (int64_t)g * st + chunk * 8) = v;
    }
}
/* The same from a tile swizzled as swz. */
template <typename T, int D, int ROWS, int THREADS>
__device__ __forceinline__ void copy_staged_rows(uint32_t stage, T *dst, int64_t st, int g0, int n, int tid) {
    copy_staged_rows<T, D, ROWS, THREADS>([stage](int row, int chunk) { return stage + swz<D>(row, chunk); }, dst, st,
                                          g0, n, tid);
}

__device__ __forceinline__ void ldsm_x4(uint32_t *r, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t *r, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* A fragment (16 rows x 16 k) of a [row][k] tile at (row0, k chunk kc0). */
template <int D> __device__ __forceinline__ void load_a(uint32_t *a, uint32_t base, int row0, int kc0, int lane) {
    ldsm_x4(a, base + swz<D>(row0 + (lane & 15), kc0 + (lane >> 4)));
}
/* B fragments of two n-tiles (n0, n0+8) x 16 k from an [n][k] tile: b[0..1] tile 0, b[2..3] tile 1. */
template <int D> __device__ __forceinline__ void load_b_nk(uint32_t *b, uint32_t base, int n0, int kc0, int lane) {
    ldsm_x4(b, base + swz<D>(n0 + (lane & 7) + ((lane >> 4) << 3), kc0 + ((lane >> 3) & 1)));
}
/* B fragments of two n-tiles (n chunks nc0, nc0+1) x 16 k from a [k][n] tile (transposing load). */
template <int D> __device__ __forceinline__ void load_b_kn(uint32_t *b, uint32_t base, int k0, int nc0, int lane) {
    ldsm_x4_t(b, base + swz<D>(k0 + (lane & 7) + (((lane >> 3) & 1) << 3), nc0 + (lane >> 4)));
}

/* ---- cp.async --------------------------------------------------------------------------- */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

/* Copies rows [r0, r0 + ROWS) of a (n_rows, ., D) tensor (row stride `st` elements, base already
 * at the head) into a swizzled tile; rows past n_rows are zero-filled. */
template <int D, int ROWS, int THREADS, typename T>
__device__ __forceinline__ void load_tile(uint32_t tile, const T *base, int64_t st, int r0, int n_rows, int tid) {
    constexpr int kChunks = D / 8, kTotal = ROWS * kChunks;
#pragma unroll
    for (int i = tid; i < kTotal; i += THREADS) {
        const int row = i / kChunks, chunk = i % kChunks, g = r0 + row;
        const bool ok = g < n_rows;
        const T *src = base + (int64_t)(ok ? g : 0) * st + chunk * 8;
        cp_async16(tile + swz<D>(row, chunk), src, ok);
    }
}

/* ---- math -------------------------------------------------------------------------------- */
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x)); /* pure: free to schedule */
    return y;
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

}  // namespace ncp

#endif /* NCP_SINK_ATTN_COMMON_CUH */
