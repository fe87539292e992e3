/*
 * sink_attn/sm90_bwd_parts.cuh: the parts of the Hopper backward (sm90_bwd.cu): shared-memory
 * layout and barriers, the producers of the dK/dV and dQ kernels, the per-key visibility of the
 * dK/dV kernel's mask pass, and the epilogue that stores a warpgroup's accumulator tile.
 *
 * Both kernels keep two tiles stationary in shared memory (dK/dV: K and V of 128 keys; dQ: Q and
 * dO of 128 rows) and stream tiles of 64 rows through a 3-stage ring (dK/dV: Q and dO; dQ: K and V):
 * one producer thread issues TMA, and in the dK/dV kernel warp 1 of the producer warpgroup writes
 * lse * log2(e) and Delta of each streamed q tile into shared memory (the stage's "a" barrier
 * counts both arrivals).
 */
#ifndef NCP_SINK_ATTN_SM90_BWD_PARTS_CUH
#define NCP_SINK_ATTN_SM90_BWD_PARTS_CUH

#include "../sm90/gemm.cuh"
#include "../sm90/pipeline.cuh"
#include "common.cuh"
#include "launch.h"
#include "mask.cuh"

namespace ncp {
namespace bwd90 {

#if defined(NCP_CTA_CLOCK)
/* Probe builds only (setup.py, NCP_CTA_CLOCK=1; benchmarks/probe_cta_clock.py). Per dK/dV CTA
 * (blockIdx.y * gridDim.x + blockIdx.x), %globaltimer in ns: [0] entry, [1] end (after the dK/dV
 * store), [2] time consumer warpgroup 0 waited for items' stage a (Q, lse, Delta, key bounds),
 * [3] time the dQ writers spun on another CTA's claim, [4] smid | n_q << 8 | n_it << 16 | key tile
 * << 32 | kv head << 48, [5] K and V in, [6] end of the item loop, [7] time the TMA thread waited
 * for free stages. */
constexpr int kClockCtas = 1 << 17;
__device__ unsigned long long g_cta_clock[kClockCtas][8];
__device__ __forceinline__ unsigned long long gtimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define NCP_CLOCK_REC(...)                                                                         \
    do {                                                                                           \
        const unsigned cta_ = blockIdx.y * gridDim.x + blockIdx.x;                                 \
        if (cta_ < (unsigned)kClockCtas) {                                                         \
            unsigned long long *r_ = g_cta_clock[cta_];                                            \
            __VA_ARGS__;                                                                           \
        }                                                                                          \
    } while (0)
/* Runs stmt; with cond, adds the ns it took to record word i. */
#define NCP_CLOCK_SPAN(cond, i, stmt)                                                              \
    do {                                                                                           \
        const bool on_ = (cond);                                                                   \
        const unsigned long long t_ = on_ ? gtimer() : 0ull;                                       \
        stmt;                                                                                      \
        if (on_) NCP_CLOCK_REC(atomicAdd(&r_[i], gtimer() - t_));                                  \
    } while (0)
#else
#define NCP_CLOCK_REC(...) \
    do {               \
    } while (0)
#define NCP_CLOCK_SPAN(cond, i, stmt) \
    do {                          \
        stmt;                     \
    } while (0)
#endif

constexpr int kThreads = 384; /* producer + 2 consumer warpgroups */
using Split = sm90::RegSplit<3, 24, 240>; /* producer 24 registers, consumers 240 */
static_assert(Split::kThreads == kThreads, "one producer and two consumer warpgroups");
constexpr int kStages = 3;
constexpr int KVB = 128;      /* dK/dV kernel: keys per CTA */
constexpr int KQB = 64;       /* dK/dV kernel: q rows per streamed tile */
constexpr int QQB = 128;      /* dQ kernel: q rows per CTA */
constexpr int QKB = 64;       /* dQ kernel: keys per streamed tile */
constexpr int kDsBar = 3;     /* named barrier: both warpgroups' dS^T stored (atomic-dQ kernel) */
constexpr int kDsReady = 4;   /* named barriers 4..7: a warpgroup's dS^T of an item stored (deferred dQ) */
constexpr int kDqDone = 8;    /* named barriers 8..11: a warpgroup's dQ MMA of an item done (deferred dQ) */
constexpr int kKFree = 12;    /* named barrier: both warpgroups' last dQ MMAs (which read all of K) done */
static_assert(KVB == kBwdKvTile && KQB == kBwdKvStep && QQB == kBwdQTile && QKB == kBwdQStep,
              "the pre-pass measures the grids' tile work with the tiles of launch.h");
using Ring = sm90::Ring<kStages>;

/* Two stationary tiles of SR rows, kStages x two streamed tiles of TR rows, with DS (atomic-dQ
 * dK/dV kernel) two dS^T tiles of SR x TR and two 64 x 64 fp32 dQ staging tiles, the mbarriers,
 * then kStages x TR floats of lse * log2(e) and of Delta for the streamed q tiles, and kStages x
 * TR packed key bounds (key_bounds). The D = 128 atomic-dQ dK/dV layout fills the 227 KiB of an
 * sm_90 block exactly. */
template <int D, int SR, int TR, bool DS = false> struct Layout {
    static constexpr int stat_bytes = SR * D * 2;
    static constexpr int tile_bytes = TR * D * 2;
    static constexpr int s1_off = stat_bytes;
    static constexpr int a_off = 2 * stat_bytes;
    static constexpr int b_off = a_off + kStages * tile_bytes;
    static constexpr int ds_bytes = SR * TR * 2; /* one dS^T tile: SR key rows x TR queries */
    static constexpr int ds_off = b_off + kStages * tile_bytes;
    static constexpr int stage_off = ds_off + (DS ? 2 * ds_bytes : 0);
    static constexpr int bar_off = stage_off + (DS ? 2 * 64 * 64 * 4 : 0);
    static constexpr int vec_off = bar_off + 128;
    static constexpr int kb_off = vec_off + 2 * kStages * TR * 4;
    static constexpr int bytes = kb_off + kStages * TR * 2 + 1024;
    static_assert(bytes <= 232448, "backward tiles exceed the shared memory of an sm_90 block");
};

#ifdef NCP_SM90_DEVICE
/* stat_full, then per stage a_full (stream tile a, plus lse/Delta in the dK/dV kernel), b_full
 * (stream tile b) and empty (one arrival per consumer warp); then, for the dQ writer warps of the
 * D = 128 atomic-dQ dK/dV kernel (write_dq), per consumer warpgroup c: dq_full(c) (one arrival per
 * warp of c once its dQ tile is staged) and dq_empty(c) (the writer read it). */
struct Bars {
    uint32_t base;
    __device__ __forceinline__ uint32_t stat() const { return base; }
    __device__ __forceinline__ uint32_t a(int s) const { return base + 8u * (1 + s); }
    __device__ __forceinline__ uint32_t b(int s) const { return base + 8u * (1 + kStages + s); }
    __device__ __forceinline__ uint32_t e(int s) const { return base + 8u * (1 + 2 * kStages + s); }
    __device__ __forceinline__ uint32_t dq_full(int c) const { return base + 8u * (1 + 3 * kStages + c); }
    __device__ __forceinline__ uint32_t dq_empty(int c) const { return base + 8u * (3 + 3 * kStages + c); }
    __device__ __forceinline__ void init(int a_arrivals) const {
        sm90::mbar_init(stat(), 1);
        for (int s = 0; s < kStages; ++s) {
            sm90::mbar_init(a(s), a_arrivals);
            sm90::mbar_init(b(s), 1);
            sm90::mbar_init(e(s), 8);
        }
        for (int c = 0; c < 2; ++c) {
            sm90::mbar_init(dq_full(c), 4);
            sm90::mbar_init(dq_empty(c), 1);
        }
        sm90::mbar_fence_init();
    }
};
static_assert(8 * (5 + 3 * kStages) <= 128, "the barriers fit the 128 bytes at Layout::bar_off");

/* The (query head, q tile) items of a dK/dV CTA: the q tiles [qt_lo, qt_lo + n_q) that see a key
 * of [k0, k0 + KVB), for each of the G query heads of its kv head. */
struct KvItems {
    int g_kv, k0, G, qt_lo, n_q, n_it;
    template <class Mask> __device__ __forceinline__ KvItems(const Mask &mask, int g_kv_, int k0_, int G_)
        : g_kv(g_kv_), k0(k0_), G(G_) {
        q_tiles_seeing(mask, k0, min(k0 + KVB, mask.Tk) - 1, KQB, qt_lo, n_q);
        n_it = n_q * G;
    }
    __device__ __forceinline__ int head(int it) const { return g_kv * G + it / n_q; }
    __device__ __forceinline__ int q0(int it) const { return (qt_lo + it % n_q) * KQB; }
};

/* Which of the CTA's keys k0 + d (0 <= d < KVB) row q sees, for the mask pass: a <= d < b, packed
 * as a | b << 8 (a, b in [0, KVB]; rows past Tq and keys past Tk see nothing). */
__device__ __forceinline__ uint16_t pack_key_bounds(int lo, int hi, int k0) {
    static_assert(KVB < 256, "key bounds are packed in 8 bits each");
    const int a = min(max(lo - k0, 0), KVB), b = min(max(hi - k0 + 1, 0), KVB);
    return (uint16_t)(a | b << 8);
}
template <class Mask> __device__ __forceinline__ uint16_t key_bounds(const Mask &m, int q, int k0) {
    if (q >= m.Tq) return (uint16_t)KVB; /* a = KVB, b = 0 */
    return pack_key_bounds(m.lo(q), m.hi(q), k0);
}

/* key_bounds of the rows of one dK/dV CTA (keys [k0, k0 + KVB)), for the producer's lse/Delta
 * warp: the values of key_bounds. A table's bounds are two loads per row. Under the document mask
 * a row's bounds need its document's start, a binary search over cu_seqlens: about log2(documents)
 * dependent loads per row and item, on the path of every item's stage (64k tokens in 2k documents:
 * 6 loads; the consumers then waited 0.76 us per 2.9 us item for their stage, against 0.29 us in 8k
 * documents; padding the 8k pack's cu_seqlens to the same depth made its dK/dV kernel 13% slower:
 * benchmarks/probe_cta_clock.py, docs/EXPERIMENTS.md). So the warp searches once, for the CTA's
 * last key: its document [ds, de) holds every row that sees the CTA's keys from the end of the
 * previous document on, and those rows take ds without a search (the same value as the search on
 * a monotone cu_seqlens); rows before ds (a key tile across a document boundary) or from de on
 * search as before. */
template <class Mask> struct CtaKeyBounds {
    const Mask &m;
    const int k0;
    __device__ __forceinline__ CtaKeyBounds(const Mask &m_, int k0_) : m(m_), k0(k0_) {}
    __device__ __forceinline__ uint16_t operator()(int q) const { return key_bounds(m, q, k0); }
};
template <> struct CtaKeyBounds<DocsMask> {
    const DocsMask &m;
    const int k0;
    int ds, de; /* the document of key min(k0 + KVB, Tk) - 1: [ds, de); empty when n_cu < 2 */
    __device__ __forceinline__ CtaKeyBounds(const DocsMask &m_, int k0_) : m(m_), k0(k0_) {
        const int d = doc_index(m.cu, m.n_cu, min(k0 + KVB, m.Tk) - 1);
        ds = m.n_cu >= 2 ? __ldg(m.cu + d) : 0;
        de = m.n_cu >= 2 ? __ldg(m.cu + d + 1) : 0;
    }
    __device__ __forceinline__ uint16_t operator()(int q) const {
        if (q >= m.Tq) return (uint16_t)KVB; /* a = KVB, b = 0 */
        /* in [ds, de), doc_start(q) = max(ds, 0): DocsMask::lo without its search */
        const int lo = q >= ds && q < de ? m.lo_in_doc(q, max(ds, 0)) : m.lo(q);
        return pack_key_bounds(lo, m.hi(q), k0);
    }
};

/* dK/dV producer. Thread 0: K and V once, then Q and dO of every item. Warp 1: lse * log2(e) and
 * Delta of every item's 64 rows into shared memory, and their key bounds (key_bounds), so the
 * consumers' mask pass is one shared load and two compares per query, whatever the mask. */
template <int D, class Mask>
__device__ __forceinline__ void produce_dkdv(const KvItems &w, const Bars &bar, uint32_t sK, uint32_t sV, uint32_t sQ0,
                                             uint32_t sO0, float *s_l2, float *s_dl, uint16_t *s_kb, const Mask &mask,
                                             const ncp_sink_attn_params &p, const float *delta, const CUtensorMap *tm_k,
                                             const CUtensorMap *tm_v, const CUtensorMap *tm_q, const CUtensorMap *tm_do) {
    using L = Layout<D, KVB, KQB>;
    const int tid = threadIdx.x, lane = tid & 31;
    if (tid == 0) {
        sm90::mbar_expect_tx(bar.stat(), 2 * L::stat_bytes);
        sm90::tma_load_tile_pair<D>(sK, tm_k, sV, tm_v, KVB, w.g_kv, w.k0, bar.stat());
        for (int it = 0; it < w.n_it; ++it) {
            const int s = Ring::slot(it), h = w.head(it), q0 = w.q0(it);
            if (it >= kStages) NCP_CLOCK_SPAN(true, 7, sm90::mbar_wait(bar.e(s), Ring::empty_phase(it)));
            sm90::mbar_expect_tx(bar.a(s), L::tile_bytes);
            sm90::tma_load_tile<D>(sQ0 + s * L::tile_bytes, tm_q, KQB, h, q0, bar.a(s));
            sm90::mbar_expect_tx(bar.b(s), L::tile_bytes);
            sm90::tma_load_tile<D>(sO0 + s * L::tile_bytes, tm_do, KQB, h, q0, bar.b(s));
        }
    } else if (tid >> 5 == 1) {
        /* Item it + 1's values are loaded (and its key bounds searched) before the wait for its
         * stage, so a stage freed late is filled by stores alone. */
        static_assert(KQB == 64, "a lane takes rows lane and lane + 32");
        float l2v[2], dlv[2];
        uint32_t kbv[2];
        const CtaKeyBounds<Mask> bounds(mask, w.k0);
        const auto load = [&](int it) {
            const int h = w.head(it), q0 = w.q0(it);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int q = q0 + lane + 32 * r;
                const bool ok = q < p.Tq;
                l2v[r] = ok ? __ldg(p.lse + (int64_t)h * p.Tq + q) * kLog2e : 0.f;
                dlv[r] = ok ? __ldg(delta + (int64_t)h * p.Tq + q) : 0.f;
                kbv[r] = bounds(q);
            }
        };
        if (w.n_it > 0) load(0);
        for (int it = 0; it < w.n_it; ++it) {
            const int s = Ring::slot(it);
            if (it >= kStages) sm90::mbar_wait(bar.e(s), Ring::empty_phase(it));
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                s_l2[s * KQB + lane + 32 * r] = l2v[r];
                s_dl[s * KQB + lane + 32 * r] = dlv[r];
                s_kb[s * KQB + lane + 32 * r] = (uint16_t)kbv[r];
            }
            sm90::warp_arrive(bar.a(s));
            if (it + 1 < w.n_it) load(it + 1);
        }
    }
}

/* dQ writer of the D = 128 atomic-dQ dK/dV kernel: one thread (lane 0 of producer warp 2 + c) for
 * consumer warpgroup c. For each item it takes c's staged 64 x 64 fp32 dQ share (dq_full), adds it
 * into its tile of dq_accum and frees the staging (dq_empty). The accumulator is not zeroed: each
 * tile has a flag (0: untouched, 1: claimed, 2: stored; zeroed by the pre-pass), the first CTA to
 * claim a tile stores its share with a bulk copy and releases the flag once the copy is performed,
 * and later adders wait for that release before their bulk reduction. A tile is claimed only once
 * its share is staged, and a claimer waits on no other CTA before its release, so a writer that
 * waits always waits on one that progresses. */
__device__ __forceinline__ void write_dq(const KvItems &w, const Bars &bar, int c, uint32_t sSt, int Tq, float *acc,
                                         int32_t *flag) {
    const int n_qt = (Tq + KQB - 1) / KQB;
    for (int it = 0; it < w.n_it; ++it) {
        const int64_t tile = ((int64_t)w.head(it) * n_qt + w.q0(it) / KQB) * 2 + c;
        int32_t *f = flag + tile;
        float *dst = acc + tile * 4096;
        /* Most shares find their tile stored already: that read, taken before the wait (it claims
         * nothing), keeps the round trip of a claim off the hand-off. */
        const int32_t seen = sm90::ld_acquire(f);
        sm90::mbar_wait(bar.dq_full(c), (uint32_t)(it & 1));
        const int32_t old = seen == 2 ? 2 : sm90::atom_cas_acquire(f, 0, 1);
        if (old == 0) {
            sm90::bulk_store(dst, sSt, 64 * 64 * 4);
        } else {
            if (old == 1)
                NCP_CLOCK_SPAN(true, 3, while (sm90::ld_acquire(f) != 2) __nanosleep(32));
            sm90::fence_proxy_async_global(); /* the acquired store, before this async-proxy reduction */
            sm90::bulk_reduce_add_f32(dst, sSt, 64 * 64 * 4);
        }
        sm90::bulk_wait_read<0>();
        sm90::mbar_arrive(bar.dq_empty(c));
        if (old == 0) {
            sm90::bulk_wait<0>();             /* the copy is performed */
            sm90::fence_proxy_async_global(); /* ... and ordered before the release (generic proxy) */
            sm90::st_release(f, 2);
        }
    }
}

/* dQ producer (thread 0): Q and dO once, then K and V of every kv tile the rows see. */
template <int D>
__device__ __forceinline__ void produce_dq(const q_tile_range &rng, int n_it, const Bars &bar, uint32_t sQ, uint32_t sO,
                                           uint32_t sK0, uint32_t sV0, int h, int g_kv, int q0, const CUtensorMap *tm_q,
                                           const CUtensorMap *tm_do, const CUtensorMap *tm_k, const CUtensorMap *tm_v) {
    using L = Layout<D, QQB, QKB>;
    sm90::mbar_expect_tx(bar.stat(), 2 * L::stat_bytes);
    sm90::tma_load_tile_pair<D>(sQ, tm_q, sO, tm_do, QQB, h, q0, bar.stat());
    for (int it = 0; it < n_it; ++it) {
        const int s = Ring::slot(it), kt = rng.kt_hi - it;
        if (it >= kStages) sm90::mbar_wait(bar.e(s), Ring::empty_phase(it));
        sm90::mbar_expect_tx(bar.a(s), L::tile_bytes);
        sm90::tma_load_tile<D>(sK0 + s * L::tile_bytes, tm_k, QKB, g_kv, kt * QKB, bar.a(s));
        sm90::mbar_expect_tx(bar.b(s), L::tile_bytes);
        sm90::tma_load_tile<D>(sV0 + s * L::tile_bytes, tm_v, QKB, g_kv, kt * QKB, bar.b(s));
    }
}

/* For the mask pass of a partial dK/dV item: pair(s, col) loads the key bounds (key_bounds) of
 * columns col, col + 1 (col even) of the q tile in stage s; vis(bounds, r): whether the thread's
 * key k0 + krow + 8 r is seen by that column; all_visible(s): whether the item needs no mask pass;
 * flags(s, key0, okey0): how the item's rows see the 64 keys key0 .. key0 + 63 of the CTA (a
 * warpgroup's) and whether they see one of okey0 .. okey0 + 63 (the other's), for the consumers
 * that skip. */
struct KeyVis {
    uint32_t kb; /* shared-space address of the key bounds, [kStages][KQB] uint16 */
    int krow;
    __device__ __forceinline__ KeyVis(const uint16_t *s_kb, int krow_) : kb(smem_u32(s_kb)), krow(krow_) {}
    __device__ __forceinline__ uint32_t pair(int s, int col) const {
        uint32_t v;
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(kb + 2u * (s * KQB + col)));
        return v;
    }
    __device__ __forceinline__ bool operator()(uint32_t b, int r) const {
        const int d = krow + 8 * r;
        return (int)(b & 0xffu) <= d && d < (int)((b >> 8) & 0xffu);
    }
    /* Whether the item in stage s sees all its KQB x KVB pairs (no mask pass). The bounds are
     * non-decreasing in the row (mask.cuh), so it is enough that the first row sees the CTA's
     * last key and the last row its first key; rows past Tq (a = KVB) and keys past Tk (b < KVB)
     * fail the test. */
    __device__ __forceinline__ bool all_visible(int s) const {
        uint32_t first, last;
        asm volatile("ld.shared.u16 %0, [%1];\n" : "=r"(first) : "r"(kb + 2u * (s * KQB)));
        asm volatile("ld.shared.u16 %0, [%1];\n" : "=r"(last) : "r"(kb + 2u * (s * KQB + KQB - 1)));
        return (first >> 8) == (uint32_t)KVB && (last & 0xffu) == 0u;
    }
    /* Bit 0: some row of the item in stage s sees one of the keys key0 .. key0 + 63; bit 1: every
     * row sees all of them (no mask pass); bit 2: some row sees one of the keys okey0 .. okey0 + 63
     * (the other warpgroup's). Each lane tests two rows, the warp reduces; exact for any bounds (no
     * monotonicity assumed; rows past Tq see nothing). */
    __device__ __forceinline__ uint32_t flags(int s, int key0, int okey0) const {
        static_assert(KQB == 64, "a lane tests two rows");
        const uint32_t b2 = pair(s, 2 * (threadIdx.x & 31));
        uint32_t seen = 0, all = 1;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int a = (int)(b2 >> (16 * c) & 0xffu), b = (int)(b2 >> (16 * c + 8) & 0xffu);
            seen |= a < b && a < key0 + 64 && b > key0 ? 1u : 0u;
            seen |= a < b && a < okey0 + 64 && b > okey0 ? 4u : 0u;
            all &= a <= key0 && b >= key0 + 64 ? 1u : 0u;
        }
        return __reduce_or_sync(0xffffffffu, seen) | __reduce_and_sync(0xffffffffu, all) << 1;
    }
};

/* Stores a warpgroup's 64 x D fp32 accumulator tile (times mul) as T rows [r0, r0 + 64) of dst,
 * staged through rows [srow0, srow0 + 64) of the 128B-swizzled shared tile `stage` of SR rows. */
template <typename T, int D, int SR>
__device__ __forceinline__ void store_rows(const float *acc, float mul, uint32_t stage, int srow0, T *dst, int64_t st,
                                           int r0, int n_rows, int cw) {
    const int tid = threadIdx.x & 127, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint32_t v = elem<T>::pack(acc[4 * j + 2 * r] * mul, acc[4 * j + 2 * r + 1] * mul);
            const uint32_t addr = stage + sm90::sw128_offset(SR, srow0 + 16 * warp + gq + 8 * r, 8 * j + 2 * tq);
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v));
        }
    sm90::named_sync(1 + cw, 128);
    copy_staged_rows<T, D, 64, 128>(
        [stage, srow0](int row, int chunk) { return stage + sm90::sw128_offset(SR, srow0 + row, chunk * 8); }, dst, st,
        r0, n_rows, tid);
    sm90::named_sync(1 + cw, 128);
}
#endif /* NCP_SM90_DEVICE */

/* Position (in float2 units) of a warpgroup's dQ fragment pair (warp, j, r, lane) inside a staged
 * 64 x 64 fp32 tile in "fragment order": rows 16 warp + lane / 4 + 8 r, columns 8 j + 2 (lane % 4)
 * + {0, 1}. A warp's 32 lanes write 256 contiguous bytes (no bank conflicts). */
__host__ __device__ __forceinline__ int dq_frag_pos(int warp, int j, int r, int lane) {
    return ((warp * 8 + j) * 2 + r) * 32 + lane;
}

}  // namespace bwd90
}  // namespace ncp

#endif /* NCP_SINK_ATTN_SM90_BWD_PARTS_CUH */
