/*
 * sm90/arch.cuh: Hopper (sm_90a) primitives: mbarriers, TMA tensor copies and bulk stores and
 * reductions, wgmma shared-memory descriptors and fences, register reallocation, named barriers,
 * and the host side that encodes a THD tensor as a TMA tensor map (tma_host.cu).
 *
 * Shared tiles use the 128-byte swizzle that TMA writes and wgmma reads: a tile of R rows x D
 * 16-bit columns is stored as D/64 column blocks of R x 128 bytes; inside a block, 16-byte chunk c
 * of row r sits at chunk c ^ (r % 8) (address bits [4,7) ^= bits [7,10), so blocks start on
 * 1024-byte boundaries).
 *
 * Descriptors (PTX ISA, "Matrix Descriptor Format"): start >> 4 in bits [0,14), leading byte offset
 * >> 4 in [16,30), stride byte offset >> 4 in [32,46), swizzle mode in [62,64) (1 = 128 B).
 *   K-major (rows = M or N, 64 K-elements per 128-byte row): SBO = 1024 (next 8-row group), LBO
 *     unused; step K by 16 elements with start + 32 bytes, by 64 with the next column block.
 *   MN-major (rows = K, 64 M/N-elements per 128-byte row): SBO = 1024 (next 8 K-rows), LBO = bytes
 *     between 64-wide M/N column blocks; step K by 16 rows with start + 16 * 128 bytes.
 */
#ifndef NCP_SM90_ARCH_CUH
#define NCP_SM90_ARCH_CUH

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "ncp/ncp.h"
#include "ncp/ncp_check.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define NCP_SM90_DEVICE 1
#endif

namespace ncp {
namespace sm90 {

/* ---- device primitives (valid only in sm_90a device code) -------------------------------- */
#ifdef NCP_SM90_DEVICE
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

/* Non-blocking: has the phase with this parity completed? */
__device__ __forceinline__ bool mbar_test(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
    return done != 0;
}

/* TMA: box at coordinates (c0 innermost, c1, c2) of a 3-D tensor map into shared memory; the
 * barrier's transaction count drops by the box's bytes (zero-filled outside the tensor). */
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
/* A tile of `rows` tokens x D columns of head `head` from token `row0`: D / 64 boxes, one per
 * 128B-swizzled column block of `rows` x 128 bytes at dst. */
template <int D>
__device__ __forceinline__ void tma_load_tile(uint32_t dst, const CUtensorMap *map, int rows, int head, int row0, uint32_t bar) {
#pragma unroll
    for (int cb = 0; cb < D / 64; ++cb) tma_load_3d(dst + cb * rows * 128, map, cb * 64, head, row0, bar);
}
/* Two such tiles of the same rows (e.g. K and V) on one barrier, column block by column block. */
template <int D>
__device__ __forceinline__ void tma_load_tile_pair(uint32_t dst_a, const CUtensorMap *map_a, uint32_t dst_b,
                                                   const CUtensorMap *map_b, int rows, int head, int row0, uint32_t bar) {
#pragma unroll
    for (int cb = 0; cb < D / 64; ++cb) {
        tma_load_3d(dst_a + cb * rows * 128, map_a, cb * 64, head, row0, bar);
        tma_load_3d(dst_b + cb * rows * 128, map_b, cb * 64, head, row0, bar);
    }
}
/* TMA store: box at coordinates (c0, c1, c2) of a 3-D tensor map from shared memory at src, in the
 * current bulk group (box rows outside the tensor are not written). */
__device__ __forceinline__ void tma_store_3d(const CUtensorMap *map, int c0, int c1, int c2, uint32_t src) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(c0), "r"(c1), "r"(c2), "r"(src)
                 : "memory");
}
/* The inverse of tma_load_tile: `rows` tokens x D columns of head `head` from token `row0`, read
 * from D / 64 swizzled column blocks of `rows` x 128 bytes at src. */
template <int D>
__device__ __forceinline__ void tma_store_tile(const CUtensorMap *map, int rows, int head, int row0, uint32_t src) {
#pragma unroll
    for (int cb = 0; cb < D / 64; ++cb) tma_store_3d(map, cb * 64, head, row0, src + cb * rows * 128);
}
__device__ __forceinline__ void tma_prefetch_desc(const CUtensorMap *map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

/* Orders this thread's generic-proxy shared-memory stores before later async-proxy reads (wgmma). */
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
/* Relaxed gpu-scope vector reduction: p[0] += a, p[1] += b (8-byte aligned global p). */
__device__ __forceinline__ void red_add_v2(float *p, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
}

/* Bulk asynchronous reduction dst[i] += src[i] over `bytes` (multiple of 16) of fp32 from shared
 * memory, committed as one bulk group; bulk_wait_read<N> waits until at most N groups still read
 * their shared source. */
__device__ __forceinline__ void bulk_reduce_add_f32(float *dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 "cp.async.bulk.commit_group;\n" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}
/* Bulk asynchronous copy of `bytes` (multiple of 16) from shared memory to global dst, committed as
 * one bulk group. */
__device__ __forceinline__ void bulk_store(void *dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                 "cp.async.bulk.commit_group;\n" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}
/* Orders this thread's global accesses of the generic proxy with those of the async proxy (bulk
 * copies and reductions) on either side. */
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
/* gpu-scope compare-and-swap with acquire semantics: returns the old value of *p, and *p = v where
 * it was `cmp`; a thread that reads a value released by st_release sees the writes before it. */
__device__ __forceinline__ int32_t atom_cas_acquire(int32_t *p, int32_t cmp, int32_t v) {
    int32_t old;
    asm volatile("atom.acquire.gpu.global.cas.b32 %0, [%1], %2, %3;\n" : "=r"(old) : "l"(p), "r"(cmp), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ int32_t ld_acquire(const int32_t *p) {
    int32_t v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release(int32_t *p, int32_t v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
/* Waits until at most N bulk groups of this thread are still running (writes included). */
template <int N> __device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* Keeps the compiler from moving accumulator reads/writes across an in-flight wgmma. */
__device__ __forceinline__ void fence_regs(float *r, int n) {
#pragma unroll
    for (int i = 0; i < n; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
/* The same for n A fragments of an rs wgmma (its register operand), kept until the MMA is done. */
__device__ __forceinline__ void fence_frags(uint32_t (*f)[4], int n) {
#pragma unroll
    for (int i = 0; i < n; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(f[i][e])::"memory");
}

template <int N> __device__ __forceinline__ void reg_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void reg_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

/* Barrier over `threads` threads (a multiple of 32) with id 1..15 (0 is __syncthreads). */
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
/* named_sync for warps that reach the barrier at different instructions (bar.sync is
 * barrier.sync.aligned: every thread must execute the same instruction). */
__device__ __forceinline__ void named_sync_unaligned(int id, int threads) {
    asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
/* Counts the calling warps toward barrier `id` without waiting for it. */
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
/* x as lane 0 holds it: the compiler then knows the value is warp-uniform and keeps what derives
 * from it (the consumers' shared-memory descriptors) in uniform registers, with no per-MMA
 * register-to-uniform moves. For values every lane already holds alike (a warpgroup's index). */
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

/* wgmma shared-memory descriptors of 128B-swizzled tiles: the low word holds the start address >> 4
 * (bits 0-13) and the leading byte offset >> 4 (bits 16-29); the high word (stride byte offset 1024,
 * 128B swizzle) is the same for every descriptor here. A CTA's shared addresses lie below 2^18
 * (228 KiB), so for off a multiple of 16 with addr + off inside the CTA's shared memory the low
 * word of addr + off is desc_lo(addr) + (off >> 4): no carry leaves the start field. Loops over the
 * k-steps of a tile add to the low word (one integer add per MMA, not the mask and shifts again). */
constexpr uint32_t kDescHi = (1024u >> 4) | (1u << 30);
constexpr uint32_t kLboKMajor = 16; /* a K-major swizzled operand's leading byte offset field (1) */
__device__ __forceinline__ uint32_t desc_lo(uint32_t addr, uint32_t lbo) { return ((addr & 0x3FFFFu) >> 4) | ((lbo >> 4) << 16); }
__device__ __forceinline__ uint64_t desc_of(uint32_t lo) { return ((uint64_t)kDescHi << 32) | lo; }
#endif /* NCP_SM90_DEVICE */

/* The register split of a CTA of one producer and W - 1 consumer warpgroups, launched with
 * __launch_bounds__(128 W, 1): every thread starts with kLaunch registers (65536 / (128 W),
 * rounded down to 8: what ptxas gives such a kernel, checked at run time by kernel_setup), and
 * setmaxnreg.inc waits until the CTA's pool holds what it asks for. The pool holds only what the
 * launch allocated, so the producer must free at least what the consumers take: one register
 * short and the consumers wait forever (a producer at 32 with consumers at 240 in a 384-thread
 * CTA hangs). */
template <int W, int kProducer, int kConsumer> struct RegSplit {
    static constexpr int kThreads = 128 * W;
    static constexpr int kLaunch = 65536 / kThreads / 8 * 8;
    static constexpr int kProducerRegs = kProducer, kConsumerRegs = kConsumer;
    static_assert(kProducer % 8 == 0 && kConsumer % 8 == 0 && kProducer >= 24 && kConsumer <= 256,
                  "setmaxnreg takes a multiple of 8 in [24, 256]");
    static_assert(kProducer <= kLaunch && kConsumer >= kLaunch, "the producer gives registers, the consumers take");
    /* Whether a kernel that starts with `start` registers a thread can make the split. */
    static constexpr bool fits(int start) {
        return start >= kProducer && 128 * (start - kProducer) >= 128 * (W - 1) * (kConsumer - start);
    }
    static_assert(fits(kLaunch),
                  "the consumers' setmaxnreg.inc asks for more registers than the producer frees: it would never return");
#ifdef NCP_SM90_DEVICE
    static __device__ __forceinline__ void producer() { reg_dealloc<kProducer>(); }
    static __device__ __forceinline__ void consumer() { reg_alloc<kConsumer>(); }
#endif
};

/* Once per kernel (Tag) and device, before its first launch: the dynamic shared memory limit,
 * and the check that the registers ptxas gave the kernel (kLaunch with today's toolkits) make its
 * register split (an error, not a hang, if a toolkit ever allocates fewer). */
template <typename Tag, typename Split, typename K> ncp_status kernel_setup(K kernel, int smem_bytes, int device) {
    constexpr int kMaxDev = 64;
    static bool done[kMaxDev];
    if (device >= 0 && device < kMaxDev && done[device]) return NCP_OK;
    NCP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    cudaFuncAttributes fa;
    NCP_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
    NCP_CHECK(Split::fits(fa.numRegs), NCP_ERR_CUDA,
              "a Hopper kernel was compiled with %d registers a thread, too few for its warpgroup register split "
              "(%d, producer %d, consumers %d)", fa.numRegs, Split::kLaunch, Split::kProducerRegs, Split::kConsumerRegs);
    if (device >= 0 && device < kMaxDev) done[device] = true;
    return NCP_OK;
}


/* Byte offset of element (row, col) of a 128B-swizzled tile of `rows` rows (see the top comment). */
__host__ __device__ __forceinline__ uint32_t sw128_offset(int rows, int row, int col) {
    return (uint32_t)((col >> 6) * rows * 128 + row * 128 + ((((col & 63) >> 3) ^ (row & 7)) << 4) + (col & 7) * 2);
}

}  // namespace sm90
}  // namespace ncp

/* ---- host: tensor maps (tma_host.cu) --------------------------------------------------------- */
/* Encodes the (T, H, D) 16-bit tensor at `base` (element strides st per token, sh per head) as a
 * 3-D TMA map with boxes of 64 columns x 1 head x box_rows tokens and 128-byte swizzle. */
ncp_status ncp_sm90_tensor_map(CUtensorMap *map, const void *base, int T, int H, int D, int64_t st, int64_t sh,
                               int box_rows);
/* 1 when this build holds sm_90a kernels and the current device is compute capability 9.0. */
int ncp_sm90_usable(void);

#endif /* NCP_SM90_ARCH_CUH */
