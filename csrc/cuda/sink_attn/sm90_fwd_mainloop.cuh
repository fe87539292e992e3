/*
 * sink_attn/sm90_fwd_mainloop.cuh: the parts of the Hopper forward (sm90_fwd.cu): shared-memory
 * layout and barriers, the work item, the producer (TMA loads of Q and the K/V ring, TMA stores of
 * O) and the consumer warpgroups' mainloop (ping-pong S = Q K^T and O += P V with the online
 * softmax) and epilogue.
 *
 * CTA = 3 warpgroups over BM = 128 query rows of one head: warpgroup 0 is the producer (one thread
 * issues TMA), warpgroups 1-2 are consumers of 64 rows each. Kv tiles of BN = 128 keys in a
 * 2-stage ring, K and V slots freed separately (K once S is done, V after P V). On the persistent
 * grid the Q tile is double-buffered and the ring, its phases and the ping-pong turns run on across
 * items, so the producer loads item n + 1 while the consumers finish item n. The epilogue stages O
 * in the warpgroup's own rows of the item's Q buffer; the producer stores it with TMA (rows past Tq
 * are not written) as soon as both warpgroups are done with it.
 *
 * Ping-pong: the consumer warpgroups take turns issuing MMAs (named barriers kPP, kPP + 1), and
 * inside a warpgroup S(it) and P(it-1) V(it-1) are issued together so the softmax of S(it) overlaps
 * P(it-1) V(it-1). Half tiles: when a warpgroup's 64 rows cannot see one 64-key half of the item's
 * first or last kv tile, it computes S and the softmax on the other half only (P V stays K = 128
 * with zeros, so the bits are those of whole tiles).
 */
#ifndef NCP_SINK_ATTN_SM90_FWD_MAINLOOP_CUH
#define NCP_SINK_ATTN_SM90_FWD_MAINLOOP_CUH

#include <limits.h>

#include "../sm90/gemm.cuh"
#include "../sm90/pipeline.cuh"
#include "common.cuh"
#include "mask.cuh"
#include "sm90_scheduler.cuh"
#include "sm90_softmax.cuh"

namespace ncp {
namespace fwd90 {

constexpr int BM = 128;            /* query rows per CTA: two consumer warpgroups of 64 */
constexpr int BN = 128;            /* keys per kv tile */
constexpr int kStages = 2;         /* K/V ring depth */
constexpr int kThreads = 384;      /* producer + 2 consumer warpgroups */
using Split = sm90::RegSplit<3, 24, 240>; /* producer 24 registers, consumers 240 */
static_assert(Split::kThreads == kThreads, "one producer and two consumer warpgroups");
constexpr int kPP = 3;             /* named barriers kPP, kPP + 1: ping-pong turns (1, 2: epilogue) */
constexpr int kSmemLimit = 232448; /* opt-in dynamic shared memory per block on sm_90 */
using KV = sm90::Ring<kStages>;

/* Q buffers (two when they fit: item n + 1 loads during item n), the K and V rings, barriers. */
template <int D> struct Layout {
    static constexpr int q_bytes = BM * D * 2;
    static constexpr int kv_bytes = BN * D * 2;
    static constexpr int n_bars = 4 + 4 * kStages; /* q_full[2], q_empty[2], k/v_full[S], k/v_empty[S] */
    static constexpr int n_q = 2 * q_bytes + 2 * kStages * kv_bytes + n_bars * 8 + 1024 <= kSmemLimit ? 2 : 1;
    static constexpr int k_off = n_q * q_bytes;
    static constexpr int v_off = k_off + kStages * kv_bytes;
    static constexpr int bar_off = v_off + kStages * kv_bytes;
    static constexpr int bytes = bar_off + n_bars * 8 + 1024; /* + slack to align to 1024 */
    static_assert(bytes <= kSmemLimit, "forward tiles exceed the shared memory of an sm_90 block");
};

/* Shared-memory addresses of one CTA. */
template <int D> struct Smem {
    using L = Layout<D>;
    uint32_t base;
    __device__ __forceinline__ uint32_t q(int b) const { return base + b * L::q_bytes; }
    __device__ __forceinline__ uint32_t k(int s) const { return base + L::k_off + s * L::kv_bytes; }
    __device__ __forceinline__ uint32_t v(int s) const { return base + L::v_off + s * L::kv_bytes; }
    __device__ __forceinline__ uint32_t bar(int i) const { return base + L::bar_off + 8u * i; }
    __device__ __forceinline__ uint32_t q_full(int b) const { return bar(b); }
    __device__ __forceinline__ uint32_t q_empty(int b) const { return bar(2 + b); }
    __device__ __forceinline__ uint32_t k_full(int s) const { return bar(4 + s); }
    __device__ __forceinline__ uint32_t v_full(int s) const { return bar(4 + kStages + s); }
    __device__ __forceinline__ uint32_t k_empty(int s) const { return bar(4 + 2 * kStages + s); }
    __device__ __forceinline__ uint32_t v_empty(int s) const { return bar(4 + 3 * kStages + s); }
#ifdef NCP_SM90_DEVICE
    __device__ __forceinline__ void init_barriers() const {
        for (int b = 0; b < 2; ++b) {
            sm90::mbar_init(q_full(b), 1);
            sm90::mbar_init(q_empty(b), 8); /* one arrival per consumer warp after its epilogue */
        }
        for (int s = 0; s < kStages; ++s) {
            sm90::mbar_init(k_full(s), 1);
            sm90::mbar_init(v_full(s), 1);
            sm90::mbar_init(k_empty(s), 8); /* one arrival per consumer warp once its S MMA is done */
            sm90::mbar_init(v_empty(s), 8); /* ... once its P V MMA is done */
        }
        sm90::mbar_fence_init();
    }
#endif
};

/* One work item: head, q tile and the kv tiles its rows see (both roles walk the same list). */
struct Item {
    int h, q0, n_it;
    q_tile_range rng;
};
template <class Mask> __device__ __forceinline__ Item item_at(const TileScheduler &sched, const Mask &mask, int t) {
    Item w;
    w.h = sched.head(t);
    w.q0 = sched.tile(t) * BM;
    w.rng = q_range(mask, w.q0, BM, BN);
    w.n_it = max(0, w.rng.kt_hi - w.rng.kt_lo + 1);
    return w;
}
/* Kv tile of turn it: the diagonal (partial) tile first. */
__device__ __forceinline__ int tile_of(const Item &w, int it) { return w.rng.kt_hi - it; }

#ifdef NCP_SM90_DEVICE
/* ---- producer -------------------------------------------------------------------------------- */
/* One thread: Q of every item into its buffer, K and V tiles into the ring, and the TMA store of
 * every item's O from its Q buffer, issued as soon as both consumer warpgroups released it (tested
 * without blocking between K/V loads) and before the buffer takes a later Q. */
template <int D, class Mask>
__device__ __forceinline__ void produce(const Smem<D> &sm, const TileScheduler &sched, const Mask &mask, int group,
                                        const CUtensorMap *tm_q, const CUtensorMap *tm_k, const CUtensorMap *tm_v,
                                        const CUtensorMap *tm_o) {
    constexpr int NQ = Layout<D>::n_q;
    sm90::tma_prefetch_desc(tm_q);
    sm90::tma_prefetch_desc(tm_k);
    sm90::tma_prefetch_desc(tm_v);
    sm90::tma_prefetch_desc(tm_o);
    int st_h0 = 0, st_q00 = 0, st_h1 = 0, st_q01 = 0; /* the item whose O Q buffer 0 / 1 stages */
    int stored = 0;                                    /* items whose O store is issued */
    auto store_next = [&]() {
        const int b = stored % NQ;
        sm90::tma_store_tile<D>(tm_o, BM, b ? st_h1 : st_h0, b ? st_q01 : st_q00, sm.q(b));
        sm90::bulk_commit();
        ++stored;
    };
    auto try_store = [&](int n_loaded) {
        if (stored < n_loaded && sm90::mbar_test(sm.q_empty(stored % NQ), (uint32_t)((stored / NQ) & 1))) store_next();
    };
    int kv = 0; /* kv tiles loaded so far */
    int n = 0;
    for (int t = sched.first(); sched.valid(t); t = sched.next(t), ++n) {
        const Item w = item_at(sched, mask, t);
        const int qb = n % NQ;
        if (n >= NQ) { /* item n - NQ must be done with buffer qb: its O stored, the store read */
            while (stored <= n - NQ) {
                sm90::mbar_wait(sm.q_empty(stored % NQ), (uint32_t)((stored / NQ) & 1));
                store_next();
            }
            sm90::bulk_wait_read<0>();
        }
        if (qb) st_h1 = w.h, st_q01 = w.q0;
        else st_h0 = w.h, st_q00 = w.q0;
        sm90::mbar_expect_tx(sm.q_full(qb), BM * D * 2);
        sm90::tma_load_tile<D>(sm.q(qb), tm_q, BM, w.h, w.q0, sm.q_full(qb));
        const int g_kv = w.h / group;
        for (int it = 0; it < w.n_it; ++it, ++kv) {
            const int s = KV::slot(kv), kt = tile_of(w, it);
            try_store(n);
            if (kv >= kStages) sm90::mbar_wait(sm.k_empty(s), KV::empty_phase(kv));
            sm90::mbar_expect_tx(sm.k_full(s), Layout<D>::kv_bytes);
            sm90::tma_load_tile<D>(sm.k(s), tm_k, BN, g_kv, kt * BN, sm.k_full(s));
            try_store(n);
            if (kv >= kStages) sm90::mbar_wait(sm.v_empty(s), KV::empty_phase(kv));
            sm90::mbar_expect_tx(sm.v_full(s), Layout<D>::kv_bytes);
            sm90::tma_load_tile<D>(sm.v(s), tm_v, BN, g_kv, kt * BN, sm.v_full(s));
        }
    }
    while (stored < n) { /* the remaining outputs */
        sm90::mbar_wait(sm.q_empty(stored % NQ), (uint32_t)((stored / NQ) & 1));
        store_next();
    }
    sm90::bulk_wait<0>();
}
#endif /* NCP_SM90_DEVICE */

}  // namespace fwd90
}  // namespace ncp

#endif /* NCP_SINK_ATTN_SM90_FWD_MAINLOOP_CUH */
