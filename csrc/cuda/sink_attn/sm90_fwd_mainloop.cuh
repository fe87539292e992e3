/*
 * sink_attn/sm90_fwd_mainloop.cuh: the parts of the Hopper forward (sm90_fwd.cu): shared-memory
 * layout and barriers, the work item, the producer (TMA loads of Q and the K/V ring, TMA stores of
 * O) and the consumer warpgroups' mainloop (ping-pong S = Q K^T and O += P V with the online
 * softmax) and epilogue.
 *
 * CTA = 3 warpgroups over BM = 128 query rows of one head: warpgroup 0 is the producer (one thread
 * issues TMA; warp 1 writes each item's facts, Facts, beside its Q buffer), warpgroups 1-2 are
 * consumers of 64 rows each. The consumers search no mask themselves: their searches, even hidden
 * under an item's last P V, cost the window forward 7-10% (docs/EXPERIMENTS.md). Kv tiles of BN =
 * 128 keys in a 2-stage ring, K and V slots freed separately (K once S is done, V after P V). On
 * the persistent grid the Q tile is double-buffered and the ring, its phases and the ping-pong
 * turns run on across items, so the producer loads item n + 1 while the consumers finish item n.
 * The epilogue stages O in the warpgroup's own rows of the item's Q buffer; the producer stores it
 * with TMA (rows past Tq are not written) as soon as both warpgroups are done with it.
 *
 * Ping-pong: the consumer warpgroups take turns issuing MMAs (named barriers kPP, kPP + 1), and
 * inside a warpgroup S(it) and P(it-1) V(it-1) are issued together so the softmax of S(it) overlaps
 * P(it-1) V(it-1) (with D = 128; see Consumer::kOverlap). Half tiles: when a warpgroup's 64 rows
 * cannot see one 64-key half of the item's first or last kv tile, it computes S and the softmax on
 * the other half only (P V stays K = 128 with zeros, so the bits are those of whole tiles).
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

/* Q buffers (two when they fit: item n + 1 loads during item n), the K and V rings, the item
 * facts of each Q buffer (Facts), barriers. */
template <int D> struct Layout {
    static constexpr int q_bytes = BM * D * 2;
    static constexpr int kv_bytes = BN * D * 2;
    static constexpr int facts_bytes = 64 + 2 * BM * 4; /* header, then lo[BM], hi[BM] */
    static constexpr int n_bars = 4 + 4 * kStages; /* q_full[2], q_empty[2], k/v_full[S], k/v_empty[S] */
    static constexpr int n_q =
        2 * (q_bytes + facts_bytes) + 2 * kStages * kv_bytes + n_bars * 8 + 1024 <= kSmemLimit ? 2 : 1;
    static constexpr int k_off = n_q * q_bytes;
    static constexpr int v_off = k_off + kStages * kv_bytes;
    static constexpr int facts_off = v_off + kStages * kv_bytes;
    static constexpr int bar_off = facts_off + n_q * facts_bytes;
    static constexpr int bytes = bar_off + n_bars * 8 + 1024; /* + slack to align to 1024 */
    static_assert(bytes <= kSmemLimit, "forward tiles exceed the shared memory of an sm_90 block");
};

/* The facts of one item, written by the producer's facts warp (produce_facts) next to its Q buffer
 * and read by the consumers once q_full says the buffer is loaded: the item (Item), per consumer
 * warpgroup the half-tile codes of its first and last kv tile, the sink (log2 domain), and the key
 * bounds [lo, hi] of each of the BM rows (row_bounds). The consumers do no mask search of their own. */
struct Facts {
    enum : int { kH, kQ0, kNIt, kKtLo, kKtHi, kHiFirst, kLoLast, kRowsComplete, kHc /* [cw][first, last] */,
                 kSink = kHc + 4, kHeaderInts = 16 };
    static constexpr int kLo = kHeaderInts, kHi = kHeaderInts + BM; /* int offsets of lo[BM], hi[BM] */
};

/* Shared-memory addresses of one CTA. */
template <int D> struct Smem {
    using L = Layout<D>;
    uint32_t base;
    int *gen; /* the same aligned base as a generic pointer (the facts are read and written through it) */
    __device__ __forceinline__ uint32_t q(int b) const { return base + b * L::q_bytes; }
    __device__ __forceinline__ uint32_t k(int s) const { return base + L::k_off + s * L::kv_bytes; }
    __device__ __forceinline__ uint32_t v(int s) const { return base + L::v_off + s * L::kv_bytes; }
    __device__ __forceinline__ uint32_t bar(int i) const { return base + L::bar_off + 8u * i; }
    __device__ __forceinline__ int *facts(int b) const { return gen + (L::facts_off + b * L::facts_bytes) / 4; }
    __device__ __forceinline__ uint32_t q_full(int b) const { return bar(b); }
    __device__ __forceinline__ uint32_t q_empty(int b) const { return bar(2 + b); }
    __device__ __forceinline__ uint32_t k_full(int s) const { return bar(4 + s); }
    __device__ __forceinline__ uint32_t v_full(int s) const { return bar(4 + kStages + s); }
    __device__ __forceinline__ uint32_t k_empty(int s) const { return bar(4 + 2 * kStages + s); }
    __device__ __forceinline__ uint32_t v_empty(int s) const { return bar(4 + 3 * kStages + s); }
#ifdef NCP_SM90_DEVICE
    __device__ __forceinline__ void init_barriers() const {
        for (int b = 0; b < 2; ++b) {
            sm90::mbar_init(q_full(b), 2); /* the Q load's expect_tx and the facts warp */
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

/* Warp 1 of the producer warpgroup: the facts of every item (Facts) into the slot of its Q buffer,
 * once the consumers released that buffer (q_empty, as the TMA thread waits before it loads Q
 * there); its arrival is the second one q_full counts. Each lane takes rows lane, lane + 32, ... */
template <int D, class Mask>
__device__ __forceinline__ void produce_facts(const Smem<D> &sm, const TileScheduler &sched, const Mask &mask,
                                              const ncp_sink_attn_params &p, bool halves) {
    constexpr int NQ = Layout<D>::n_q;
    const int lane = threadIdx.x & 31;
    int n = 0;
    for (int t = sched.first(); sched.valid(t); t = sched.next(t), ++n) {
        const int qb = n % NQ;
        if (n >= NQ) sm90::mbar_wait(sm.q_empty(qb), (uint32_t)((n / NQ - 1) & 1));
        int *f = sm.facts(qb);
        const int q0 = sched.tile(t) * BM;
        for (int r = lane; r < BM; r += 32) {
            int lo, hi;
            row_bounds(mask, q0 + r, lo, hi);
            f[Facts::kLo + r] = lo;
            f[Facts::kHi + r] = hi;
        }
        __syncwarp();
        /* The item from the rows' bounds: the values q_range (item_at, the TMA thread's list) asks
         * the mask for, so the same kv tiles. Lane cw: warpgroup cw's half-tile codes. */
        if (lane < 2) {
            const int nr = min(BM, p.Tq - q0); /* real rows, >= 1 */
            const int lo_first = f[Facts::kLo], hi_last = f[Facts::kHi + nr - 1];
            const int kt_lo = lo_first / BN, kt_hi = hi_last >= lo_first ? hi_last / BN : kt_lo - 1;
            const int n_it = max(0, kt_hi - kt_lo + 1);
            int hc_first = 0, hc_last = 0;
            const int wr = 64 * lane; /* warpgroup lane's first row */
            if (halves && n_it > 0 && wr < nr) {
                /* Its rows see keys in [lo(first), hi(last real)] only; with no real row (the other
                 * branch) any half is exact. */
                const bool lo_first_half = f[Facts::kHi + min(wr + 63, nr - 1)] < kt_hi * BN + BN / 2;
                const bool hi_last_half = f[Facts::kLo + wr] >= kt_lo * BN + BN / 2;
                hc_first = lo_first_half ? 1 : (n_it == 1 && hi_last_half ? 2 : 0);
                hc_last = n_it > 1 && hi_last_half ? 2 : 0;
            } else if (halves && n_it > 0) {
                hc_first = 1; /* keys 64-127 of tile 0 unseen (wkhi = -1), as the search gave */
                hc_last = n_it > 1 ? 2 : 0;
            }
            f[Facts::kHc + 2 * lane] = hc_first;
            f[Facts::kHc + 2 * lane + 1] = hc_last;
            if (lane == 0) {
                f[Facts::kH] = sched.head(t);
                f[Facts::kQ0] = q0;
                f[Facts::kNIt] = n_it;
                f[Facts::kKtLo] = kt_lo;
                f[Facts::kKtHi] = kt_hi;
                f[Facts::kHiFirst] = f[Facts::kHi];
                f[Facts::kLoLast] = f[Facts::kLo + nr - 1];
                f[Facts::kRowsComplete] = nr == BM;
                const float sink = p.sink != nullptr ? __ldg(reinterpret_cast<const float *>(p.sink) + sched.head(t)) * kLog2e
                                                     : -INFINITY;
                f[Facts::kSink] = __float_as_int(sink);
            }
        }
        sm90::warp_arrive(sm.q_full(qb)); /* mbarrier arrive: release of the stores above */
    }
}
#endif /* NCP_SM90_DEVICE */

}  // namespace fwd90
}  // namespace ncp

#endif /* NCP_SINK_ATTN_SM90_FWD_MAINLOOP_CUH */
