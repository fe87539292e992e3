/*
 * cuda/sink_attn_fwd_sm90.cu: learned-sink attention forward for Hopper (sm_90a): TMA + wgmma,
 * warp-specialized. Same math, interface and masks as sink_attn_fwd.cu (see its header comment);
 * chosen at run time on compute capability 9.0 when the build holds sm_90a code.
 *
 * CTA = 3 warpgroups over BM = 128 query rows of one head:
 *   warpgroup 0  producer: one thread issues TMA copies of the Q tile (once) and of the K and V
 *                tiles into a STAGES-deep ring of 128B-swizzled shared buffers, each guarded by
 *                full (transaction-count) and empty (consumer-arrival) mbarriers; registers are
 *                handed to the consumers with setmaxnreg.
 *   warpgroups 1-2  consumers, 64 query rows each: S = Q K^T with wgmma (A and B from shared
 *                memory), mask only on partial tiles, online softmax started from the sink in
 *                registers, then O += P V with wgmma (P from registers, V MN-major from shared).
 * Kv tiles of BN keys: 128 in contiguous mode (range from cu_seqlens and the window, diagonal
 * first), NCP_FWD_BN = 64 in positions mode (the plan's CSR schedule). Work items (q tile, head),
 * heads fastest and the heaviest q tiles first; either one CTA per item or a persistent grid of one
 * CTA per SM taking items b, b + grid, ... (NCP_SM90_FWD_PERSIST). On the persistent grid the Q tile
 * is double-buffered and the K/V ring, its mbarrier phases and the ping-pong turns run on across
 * items, so the producer loads item n + 1 while the consumers finish item n. The epilogue stages O
 * in the warpgroup's own rows of the item's Q buffer; the producer stores the tile with TMA (rows
 * past Tq are not written) before it loads a later Q there (NCP_SM90_FWD_OSTORE=0: the consumer
 * threads copy it out with 16-byte stores instead).
 *
 * The producer waits for a K slot and a V slot separately: consumers free K(it) as soon as S(it)
 * is done and V(it) after P(it) V(it), so the next K load starts half an iteration earlier.
 *
 * Schedules (template PINGPONG; NCP_SM90_FWD_SCHED=serial|pingpong, default ping-pong):
 *   serial: each warpgroup waits for S, runs the softmax, then waits for P V; the two consumer
 *     warpgroups overlap each other only as far as they drift apart.
 *   ping-pong: the consumer warpgroups take turns issuing MMAs (named barriers), and inside a
 *     warpgroup S(it) and P(it-1) V(it-1) are issued together so the softmax of S(it) overlaps
 *     P(it-1) V(it-1); P is packed into fragments only after that MMA finished (ptxas: no wgmma
 *     serialization, no spills).
 * Softmax: a positive scale stays out of the scores (the row max is scaled once and the scale is
 * folded into the exponent's FFMA); partial tiles are masked with per-row bounds relative to the
 * thread's columns, testing only the bounds that cut the tile. O is rescaled only in warps where a
 * row maximum changed (corr is exactly 1 otherwise; NCP_SM90_FWD_LAZY=0 rescales every tile).
 * Half tiles (contiguous mode): when a warpgroup's 64 rows cannot see one 64-key half of the item's
 * first or last kv tile, it computes S and the softmax on the other half only (P V stays K = 128
 * with zeros; NCP_SM90_FWD_HALF=0 computes whole tiles, with the same bits).
 * Measured on the H200: BENCHMARKS.md section 1.
 * Test: pytest tests/test_sink_attention_cuda.py   Bench: python benchmarks/bench_sink_attention.py
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "ncp/ncp_check.h"
#include "ncp_internal.h"
#include "sink_attn_common.cuh"
#include "sm90_gemm.cuh"

namespace ncp {
namespace {

constexpr int HBM = 128;          /* query rows per CTA: two consumer warpgroups of 64 */
constexpr int kThreads = 384;     /* producer + 2 consumer warpgroups */
constexpr int kPP = 3;            /* named barriers kPP, kPP + 1: ping-pong turns (1, 2: epilogue) */
constexpr int kSmemLimit = 232448; /* opt-in dynamic shared memory per block on sm_90 */
/* kernel flags */
constexpr int kFlagFold = 1;   /* a positive scale folded into the exponent's FFMA */
constexpr int kFlagOStore = 2; /* O stored by the producer with TMA from the staged Q buffer */
constexpr int kFlagLazy = 4;   /* skip the O rescale of a warp whose row maxima did not change */
constexpr int kFlagEagerStore = 8; /* with OStore: store an item's O as soon as its epilogue is done */
constexpr int kFlagHalf = 16;  /* contiguous mode: a warpgroup skips the half of an edge tile its rows cannot see */
constexpr int kFlagEarly = 32; /* ping-pong: the next item's S(0) goes with the last P V when its Q and K are loaded */
constexpr int kEarlyBar = 5;   /* named barriers kEarlyBar, kEarlyBar + 1: the per-warpgroup vote on it */

template <int N> struct ic { static constexpr int value = N; };

/* STAGES-deep K/V ring; two Q buffers (item n + 1 loads during item n) when they fit, else one. */
template <int D, int BN, int STAGES> struct fwd_layout {
    static constexpr int q_bytes = HBM * D * 2;
    static constexpr int kv_bytes = BN * D * 2;
    static constexpr int n_bars = 4 + 4 * STAGES; /* q_full[2], q_empty[2], k/v_full[S], k/v_empty[S] */
    static constexpr int n_q = 2 * q_bytes + 2 * STAGES * kv_bytes + n_bars * 8 + 1024 <= kSmemLimit ? 2 : 1;
    static constexpr int k_off = n_q * q_bytes;
    static constexpr int v_off = k_off + STAGES * kv_bytes;
    static constexpr int bar_off = v_off + STAGES * kv_bytes;
    static constexpr int bytes = bar_off + n_bars * 8 + 1024; /* + slack to align to 1024 */
    static_assert(bytes <= kSmemLimit, "forward tiles exceed the shared memory of an sm_90 block");
};

template <typename T, int D, int BN, bool PINGPONG, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    sink_attn_fwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                              const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                              const ncp_sink_attn_params p, int flags) {
#ifdef NCP_SM90_DEVICE
    using L = fwd_layout<D, BN, kStages>;
    constexpr int NQ = L::n_q;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t sK0 = base + L::k_off, sV0 = base + L::v_off;
    const uint32_t bars = base + L::bar_off;
    auto q_buf = [&](int b) { return base + b * L::q_bytes; };
    auto bar_q = [&](int b) { return bars + 8u * b; };
    auto bar_qe = [&](int b) { return bars + 8u * (2 + b); };
    auto bar_k = [&](int s) { return bars + 8u * (4 + s); };
    auto bar_v = [&](int s) { return bars + 8u * (4 + kStages + s); };
    auto bar_ke = [&](int s) { return bars + 8u * (4 + 2 * kStages + s); };
    auto bar_ve = [&](int s) { return bars + 8u * (4 + 3 * kStages + s); };

    const bool fold = flags & kFlagFold;
    const bool ostore = flags & kFlagOStore;
    const bool lazy = flags & kFlagLazy;
    const bool eager_store = flags & kFlagEagerStore;
    /* Half tiles need BN = 128. At D = 64 with a 3-stage ring (not the default) ptxas serializes
     * the ping-pong MMAs (C7515) once the half-tile paths are in, so they are compiled out there. */
    constexpr bool kHalves = BN == 128 && !(D == 64 && kStages == 3);
    const bool halves = kHalves && (flags & kFlagHalf);
    const bool early = PINGPONG && (flags & kFlagEarly);
    const int tid = threadIdx.x, wg = tid / 128, lane = tid & 31;
    /* The host launches BN = NCP_FWD_BN for positions mode and BN = 128 for contiguous mode, so
     * the D = 128 contiguous instantiations compile the positions paths out (with them, ptxas
     * spilled 16 bytes there). At D = 64 they stay: without them ptxas serialized the MMAs (C7511). */
    const bool positions = (D == 64 || BN == NCP_FWD_BN) && p.q_pos != nullptr;
    /* Work items t = (q tile, head), heads fastest and the heavy (late) q tiles first; CTA b takes
     * b, b + gridDim.x, ... (one item each when the grid covers them all). */
    const int n_qt = (p.Tq + HBM - 1) / HBM, n_items = n_qt * p.Hq, group = p.Hq / p.Hkv;

    if (tid == 0) {
        for (int b = 0; b < 2; ++b) {
            sm90::mbar_init(bar_q(b), 1);
            sm90::mbar_init(bar_qe(b), 8); /* one arrival per consumer warp after its epilogue */
        }
        for (int s = 0; s < kStages; ++s) {
            sm90::mbar_init(bar_k(s), 1);
            sm90::mbar_init(bar_v(s), 1);
            sm90::mbar_init(bar_ke(s), 8); /* one arrival per consumer warp once its S MMA is done */
            sm90::mbar_init(bar_ve(s), 8); /* ... once its P V MMA is done */
        }
        sm90::mbar_fence_init();
    }
    __syncthreads();

    /* ---- one work item: which kv tiles (both roles walk the same list) ------------------- */
    struct item {
        int h, tile, q0, n_it, e0;
        q_tile_range rng;
    };
    auto item_at = [&](int t) {
        item w;
        w.h = t % p.Hq;
        w.tile = n_qt - 1 - t / p.Hq;
        w.q0 = w.tile * HBM;
        w.e0 = 0;
        w.rng = q_tile_range{};
        if (positions) {
            w.e0 = __ldg(p.fwd_off + w.tile);
            w.n_it = __ldg(p.fwd_off + w.tile + 1) - w.e0;
        } else {
            w.rng = contiguous_q_range(p, w.q0, HBM, BN);
            w.n_it = max(0, w.rng.kt_hi - w.rng.kt_lo + 1);
        }
        return w;
    };
    auto tile_at = [&](const item &w, int it, bool &full) -> int {
        if (positions) {
            const int e = __ldg(p.fwd_ent + w.e0 + it);
            full = e & 1;
            return e >> 1;
        }
        const int kt = w.rng.kt_hi - it; /* diagonal (partial) tile first */
        full = contiguous_full(p, w.rng, kt, BN);
        return kt;
    };

    if (wg == 0) {
        /* ================= producer ================= */
        sm90::reg_dealloc<24>();
        if (tid == 0) {
            sm90::tma_prefetch_desc(&tm_q);
            sm90::tma_prefetch_desc(&tm_k);
            sm90::tma_prefetch_desc(&tm_v);
            if (ostore) sm90::tma_prefetch_desc(&tm_o);
            /* With ostore the consumers stage O in the item's Q buffer and arrive on q_empty; the
             * producer stores it with TMA (rows past Tq are not written), in item order, and reuses
             * the buffer once the store has read it. eager_store: an item's store goes out as soon
             * as its epilogue is done (tested without blocking between K/V loads), so the buffer is
             * free by the time the next Q needs it; otherwise only when that Q needs it. */
            int st_h0 = 0, st_q00 = 0, st_h1 = 0, st_q01 = 0; /* the item whose O Q buffer 0 / 1 stages */
            int stored = 0;                                    /* items whose O store is issued */
            auto store_next = [&]() {
                const int b = stored % NQ;
                sm90::tma_store_tile<D>(&tm_o, HBM, b ? st_h1 : st_h0, b ? st_q01 : st_q00, q_buf(b));
                sm90::bulk_commit();
                ++stored;
            };
            auto try_store = [&](int n_loaded) {
                if (ostore && eager_store && stored < n_loaded &&
                    sm90::mbar_test(bar_qe(stored % NQ), (uint32_t)((stored / NQ) & 1)))
                    store_next();
            };
            int kv = 0; /* kv tiles loaded so far: ring slot kv % kStages */
            int n = 0;
            for (int t = blockIdx.x; t < n_items; t += gridDim.x, ++n) {
                const item w = item_at(t);
                const int qb = n % NQ;
                if (n >= NQ) { /* item n - NQ must be done with buffer qb */
                    if (ostore) {
                        while (stored <= n - NQ) {
                            sm90::mbar_wait(bar_qe(stored % NQ), (uint32_t)((stored / NQ) & 1));
                            store_next();
                        }
                        sm90::bulk_wait_read<0>(); /* the stores have read their buffers */
                    } else {
                        sm90::mbar_wait(bar_qe(qb), ((n / NQ) & 1) ^ 1);
                    }
                }
                if (qb) st_h1 = w.h, st_q01 = w.q0;
                else st_h0 = w.h, st_q00 = w.q0;
                sm90::mbar_expect_tx(bar_q(qb), HBM * D * 2);
                sm90::tma_load_tile<D>(q_buf(qb), &tm_q, HBM, w.h, w.q0, bar_q(qb));
                const int g_kv = w.h / group;
                for (int it = 0; it < w.n_it; ++it, ++kv) {
                    const int s = kv % kStages;
                    const uint32_t par = ((kv / kStages) & 1) ^ 1;
                    bool full;
                    const int kt = tile_at(w, it, full);
                    const uint32_t sK = sK0 + s * L::kv_bytes, sV = sV0 + s * L::kv_bytes;
                    /* K and V slots are freed separately: K once every S MMA that read it is done,
                     * V only after P V, so the next K load starts earlier. */
                    try_store(n);
                    if (kv >= kStages) sm90::mbar_wait(bar_ke(s), par);
                    sm90::mbar_expect_tx(bar_k(s), L::kv_bytes);
                    sm90::tma_load_tile<D>(sK, &tm_k, BN, g_kv, kt * BN, bar_k(s));
                    try_store(n);
                    if (kv >= kStages) sm90::mbar_wait(bar_ve(s), par);
                    sm90::mbar_expect_tx(bar_v(s), L::kv_bytes);
                    sm90::tma_load_tile<D>(sV, &tm_v, BN, g_kv, kt * BN, bar_v(s));
                }
            }
            if (ostore) { /* the remaining outputs */
                while (stored < n) {
                    sm90::mbar_wait(bar_qe(stored % NQ), (uint32_t)((stored / NQ) & 1));
                    store_next();
                }
                sm90::bulk_wait<0>();
            }
        }
        return;
    }

    /* ================= consumers ================= */
    sm90::reg_alloc<240>();
    const int cw = wg - 1;                        /* consumer warpgroup: rows 64 cw .. */
    const int warp = (tid & 127) >> 5;            /* warp within the warpgroup: rows 16 warp .. */
    const int gq = lane >> 2, tq = lane & 3;
    const int row0 = 64 * cw + 16 * warp + gq;    /* tile rows row0 and row0 + 8 */
    const float scale_log2 = (float)p.scale * kLog2e;
    const bool scale_pos = fold && scale_log2 > 0.f; /* fold the scale into the exponent */
    const bool has_sink = p.sink != nullptr;
    /* Ping-pong turns (named barriers kPP + cw, 256 threads): a warpgroup waits on its own and
     * arrives on the other's after each of its MMA issues. Warpgroup 1 arrives once up front and
     * warpgroup 0 takes one extra turn at the end, so every barrier generation completes. */
    const int pp_me = kPP + cw, pp_other = kPP + 1 - cw;
    if (PINGPONG && cw == 1) sm90::named_arrive(kPP, 256);

    int kv0 = 0; /* kv tiles consumed before this item */
    item w{};
    int qpos[2], qlo[2];
    float m[2], l[2], corr[2], o[D / 2], sc[BN / 2];
    uint32_t pf[BN / 16][4];
    const uint32_t cw_off = cw * 64 * 128; /* this warpgroup's 64 rows in every column block */

    auto slot = [&](int it) { return (kv0 + it) % kStages; };
    auto phase = [&](int it) { return (uint32_t)(((kv0 + it) / kStages) & 1); };

    /* Half tiles (contiguous mode, BN = 128, kFlagHalf): the keys of an item's first (diagonal)
     * tile that lie past every row of a warpgroup, and those of its last tile that lie before every
     * row, are masked for all of that warpgroup's rows. When such keys make up a 64-key half, the
     * warpgroup computes only the other half (hc = 1: keys 0-63 of the tile, hc = 2: keys 64-127):
     * S is 64 x 64, the softmax runs over 64 columns and P V takes K = 64. The dropped keys would
     * only add exact zeros, so the bits are the same (a test checks it). On a window of 513 with
     * aligned tiles each warpgroup skips half a tile of the item's five; on a causal diagonal the
     * first warpgroup skips half of it. hc_first / hc_last: tile 0 / tile n_it - 1 of the item. */
    int hc_first = 0, hc_last = 0;
    auto half_of = [&](int it) { return it == 0 ? hc_first : (it == w.n_it - 1 ? hc_last : 0); };
    /* S = Q K^T (64 x BN per warpgroup), issued asynchronously; H = 1: the half tile of keys
     * hc * 64 - 64 .. into sc[0 .. BN / 4). ptxas serializes the wgmma pipeline (C7515) when
     * control flow merges while an MMA is in flight, so the callers choose the shape at compile
     * time, or branch around the whole stage (issue to wait). */
    auto issue_s = [&](uint32_t sQ, int s, auto h, int hc) {
        const uint32_t sK = sK0 + s * L::kv_bytes;
        if constexpr (BN == 128 && decltype(h)::value == 1)
            sm90::gemm_ss<T, BN / 2, D>(sc, sQ + cw_off, HBM * 128, sK + (hc == 2 ? BN / 2 * 128 : 0), BN * 128);
        else
            sm90::gemm_ss<T, BN, D>(sc, sQ + cw_off, HBM * 128, sK, BN * 128);
    };
    /* O (+)= P V, issued asynchronously (P stays live in registers until the wait); keep = 0 for
     * an item's first tile overwrites O. Always K = BN: the P of a half tile has zeros in the
     * other half (to_p), so the keys it skipped add exact zeros as masked keys do. */
    auto issue_pv = [&](int s, int keep) { sm90::gemm_rs<T, D, BN>(o, pf, sV0 + s * L::kv_bytes, BN * 128, keep); };
    /* Scale into the log2 domain, mask a partial tile, online softmax: sc becomes the
     * unnormalized probabilities, corr the factor O must be rescaled by before it takes them. */
    auto softmax_n = [&](auto nb, int it, int hc) {
        constexpr int NB = decltype(nb)::value; /* columns: BN, or BN / 2 on a half tile */
        bool full;
        const int kt = tile_at(w, it, full);
        if (NB != BN) full = contiguous_full_cols(p, w.rng, kt * BN + (hc == 2 ? BN - NB : 0), NB);
        /* A positive scale stays out of the scores: masking sets -inf either way, the row max is
         * scaled once and the scale goes into the exponent's FFMA. Other scales (and
         * NCP_SM90_FWD_FOLD=0) scale the scores first. */
        float s_mul = scale_log2;
        if (!scale_pos) {
#pragma unroll
            for (int i = 0; i < NB / 2; ++i) sc[i] *= scale_log2;
            s_mul = 1.f;
        }
        if (!full) { /* one branch per tile: full tiles keep a single straight-line block */
            if (positions) {
#pragma unroll
                for (int j = 0; j < NB / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int kj = kt * BN + 8 * j + 2 * tq + (e & 1);
                        const int kp = kj >= p.Tk ? kNoKey : __ldg(p.k_pos + kj);
                        if (kp < qlo[e >> 1] || kp > qpos[e >> 1]) sc[4 * j + e] = -INFINITY;
                    }
            } else {
                /* Contiguous keys: the row bounds relative to this thread's first column, so each
                 * element is a compare against a constant column and a select; a bound that no
                 * row of the tile reaches is not tested (the diagonal tile needs only the upper
                 * one, a window's far edge only the lower one). */
                const int k0 = kt * BN + (hc == 2 ? BN - NB : 0), cb = k0 + 2 * tq;
                int lo[2], hi[2];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    lo[r] = qlo[r] - cb; /* qlo = kNoKey (rows past Tq): no overflow, cb >= 0 */
                    hi[r] = min(qpos[r], p.Tk - 1) - cb;
                }
                const bool need_lo = k0 < w.rng.lo_last; /* q_lo grows with the row */
                const bool need_hi = !(w.rng.rows_complete && k0 + NB <= p.Tk && k0 + NB - 1 <= w.rng.q_first);
                if (need_lo && need_hi) {
#pragma unroll
                    for (int j = 0; j < NB / 8; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int c = 8 * j + (e & 1);
                            if (c < lo[e >> 1] || c > hi[e >> 1]) sc[4 * j + e] = -INFINITY;
                        }
                } else if (need_hi) {
#pragma unroll
                    for (int j = 0; j < NB / 8; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            if (8 * j + (e & 1) > hi[e >> 1]) sc[4 * j + e] = -INFINITY;
                } else {
#pragma unroll
                    for (int j = 0; j < NB / 8; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            if (8 * j + (e & 1) < lo[e >> 1]) sc[4 * j + e] = -INFINITY;
                }
            }
        }
        /* Row max and row sum over kAcc independent partials each (short dependent chains:
         * ncu put fixed-latency dependencies first among the stalls with one long chain). */
        constexpr int kAcc = 4;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mp[kAcc];
#pragma unroll
            for (int a = 0; a < kAcc; ++a) mp[a] = -INFINITY;
#pragma unroll
            for (int j = 0; j < NB / 8; ++j)
                mp[j % kAcc] = fmaxf(mp[j % kAcc], fmaxf(sc[4 * j + 2 * r], sc[4 * j + 2 * r + 1]));
            float mx = fmaxf(fmaxf(mp[0], mp[1]), fmaxf(mp[2], mp[3]));
            mx = fmaxf(m[r], quad_max(mx) * s_mul); /* s_mul > 0: the max of the scaled scores */
            const float m_use = mx == -INFINITY ? 0.f : mx;
            corr[r] = ex2(m[r] - m_use);
            float sp[kAcc];
#pragma unroll
            for (int a = 0; a < kAcc; ++a) sp[a] = 0.f;
#pragma unroll
            for (int j = 0; j < NB / 8; ++j) {
                sc[4 * j + 2 * r] = ex2(fmaf(sc[4 * j + 2 * r], s_mul, -m_use));
                sc[4 * j + 2 * r + 1] = ex2(fmaf(sc[4 * j + 2 * r + 1], s_mul, -m_use));
                sp[j % kAcc] += sc[4 * j + 2 * r] + sc[4 * j + 2 * r + 1];
            }
            l[r] = l[r] * corr[r] + ((sp[0] + sp[1]) + (sp[2] + sp[3]));
            m[r] = mx;
        }
    };
    auto softmax = [&](int it, int hc) {
        if constexpr (BN == 128) {
            if (hc != 0) {
                softmax_n(ic<BN / 2>{}, it, hc);
                return;
            }
        }
        softmax_n(ic<BN>{}, it, 0);
    };
    /* Pins the P fragments: defined before the next wgmma.fence (no non-wgmma instruction
     * defines a wgmma input inside a pipeline stage, ptxas C7513), untouched until their MMA is
     * waited. */
    auto fence_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(pf[kk][e])::"memory");
    };
    /* P into A fragments; a half tile's 64 columns go to fragments 0-3 (hc = 1) or 4-7 (hc = 2)
     * and the others are zero. */
    auto to_p = [&](int hc) {
        if constexpr (BN == 128) {
            if (hc == 1) {
                to_frags<T, BN / 2>(pf, sc);
#pragma unroll
                for (int kk = BN / 32; kk < BN / 16; ++kk) pf[kk][0] = pf[kk][1] = pf[kk][2] = pf[kk][3] = 0u;
            } else if (hc == 2) {
                to_frags<T, BN / 2>(pf + BN / 32, sc);
#pragma unroll
                for (int kk = 0; kk < BN / 32; ++kk) pf[kk][0] = pf[kk][1] = pf[kk][2] = pf[kk][3] = 0u;
            } else {
                to_frags<T, BN>(pf, sc);
            }
        } else {
            to_frags<T, BN>(pf, sc);
        }
        fence_p();
    };
    /* O *= corr; skipped (lazy) when no row of the warp has a new maximum: corr is then exactly 1. */
    auto rescale = [&]() {
        if (lazy && !__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) return;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            o[4 * j + 0] *= corr[0];
            o[4 * j + 1] *= corr[0];
            o[4 * j + 2] *= corr[1];
            o[4 * j + 3] *= corr[1];
        }
    };
    auto release_k = [&](int s) {
        __syncwarp();
        if (lane == 0) sm90::mbar_arrive(bar_ke(s));
    };
    auto release_v = [&](int s) {
        __syncwarp();
        if (lane == 0) sm90::mbar_arrive(bar_ve(s));
    };
    /* The item's O = acc / l staged in this warpgroup's rows of Q buffer qb, lse; then either the
     * producer stores it with TMA (ostore) or this warpgroup copies it out with 16-byte stores. The
     * arrival on q_empty hands the buffer back. */
    auto epilogue = [&](int qb) {
        const uint32_t sQ = q_buf(qb);
        float lt[2], inv[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            lt[r] = quad_sum(l[r]);
            inv[r] = lt[r] > 0.f ? 1.f / lt[r] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint32_t v = elem<T>::pack(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
                const uint32_t addr = sQ + sm90::sw128_offset(HBM, row0 + 8 * r, 8 * j + 2 * tq);
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v));
            }
        if (tq == 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = w.q0 + row0 + 8 * r;
                if (i < p.Tq) p.lse[(int64_t)w.h * p.Tq + i] = lt[r] > 0.f ? (m[r] + __log2f(lt[r])) * kLn2 : -INFINITY;
            }
        }
        if (!ostore) {
            sm90::named_sync(1 + cw, 128);
            T *oh = reinterpret_cast<T *>(p.out) + (int64_t)w.h * p.o_sh;
            constexpr int kChunks = D / 8;
            for (int i = tid & 127; i < 64 * kChunks; i += 128) {
                const int row = 64 * cw + i / kChunks, chunk = i % kChunks, q = w.q0 + row;
                if (q >= p.Tq) continue;
                uint4 v;
                asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                             : "r"(sQ + sm90::sw128_offset(HBM, row, chunk * 8)));
                *reinterpret_cast<uint4 *>(oh + (int64_t)q * p.o_st + chunk * 8) = v;
            }
        }
        /* Generic-proxy shared accesses ordered before the producer's TMA (the O store, the next
         * Q load into this buffer). */
        sm90::fence_proxy_async_smem();
        __syncwarp();
        if (lane == 0) sm90::mbar_arrive(bar_qe(qb));
    };
    /* The next item's tile range, row bounds and sink, loaded while the current one finishes. */
    item w_next;
    int qpos_next[2], qlo_next[2];
    float sink_next = -INFINITY;
    int hc_first_next = 0, hc_last_next = 0;
    auto prefetch = [&](int t) {
        if (t >= n_items) return;
        w_next = item_at(t);
        hc_first_next = hc_last_next = 0;
        if (halves && !positions && w_next.n_it > 0) {
            /* This warpgroup's rows wq0 .. wq0 + 63 see keys in [wklo, wkhi] only (first_key grows
             * with the row); rows past Tq see none, and any half is exact for them. */
            const int wq0 = w_next.q0 + 64 * cw;
            int wklo = INT_MAX, wkhi = -1;
            if (wq0 < p.Tq) {
                wkhi = min(min(wq0 + 63, p.Tq - 1), p.Tk - 1);
                wklo = first_key(p.cu_seqlens, p.n_cu, p.window, wq0);
            }
            const bool lo_first = wkhi < w_next.rng.kt_hi * BN + BN / 2; /* tile 0: keys 64-127 unseen */
            const bool hi_last = wklo >= w_next.rng.kt_lo * BN + BN / 2; /* last tile: keys 0-63 unseen */
            hc_first_next = lo_first ? 1 : (w_next.n_it == 1 && hi_last ? 2 : 0);
            hc_last_next = w_next.n_it > 1 && hi_last ? 2 : 0;
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) row_bounds(p, w_next.q0 + row0 + 8 * r, qpos_next[r], qlo_next[r]);
        if (has_sink) sink_next = __ldg(reinterpret_cast<const float *>(p.sink) + w_next.h) * kLog2e;
    };
    prefetch(blockIdx.x);
    bool early_s0 = false; /* this item's S(0) was issued and waited with the previous item's last P V */
    for (int t = blockIdx.x, n = 0; t < n_items; t += gridDim.x, ++n) {
        w = w_next;
        const int n_it = w.n_it, qb = n % NQ;
        const uint32_t sQ = q_buf(qb);
#pragma unroll
        for (int r = 0; r < 2; ++r) qpos[r] = qpos_next[r], qlo[r] = qlo_next[r];
        const float sink_log2 = sink_next;
        hc_first = hc_first_next;
        hc_last = hc_last_next;
        m[0] = m[1] = sink_log2;
        l[0] = l[1] = (has_sink && tq == 0) ? 1.f : 0.f; /* counted once by the final quad sum */
        sm90::mbar_wait(bar_q(qb), (n / NQ) & 1);
        if (n_it == 0) { /* no visible key: O = 0, lse = the sink's */
#pragma unroll
            for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
            prefetch(t + gridDim.x);
            epilogue(qb);
            continue;
        }
        if (!PINGPONG) { /* serial schedule: each MMA batch waited for at once */
            for (int it = 0; it < n_it; ++it) {
                const int s = slot(it);
                const int hc = half_of(it);
                sm90::mbar_wait(bar_k(s), phase(it));
                if (hc != 0) {
                    issue_s(sQ, s, ic<1>{}, hc);
                    sm90::wg_wait<0>();
                } else {
                    issue_s(sQ, s, ic<0>{}, 0);
                    sm90::wg_wait<0>();
                }
                sm90::fence_regs(sc, BN / 2);
                release_k(s);
                softmax(it, hc);
                to_p(hc);
                if (it > 0) rescale();
                sm90::mbar_wait(bar_v(s), phase(it));
                issue_pv(s, it > 0);
                sm90::wg_wait<0>();
                sm90::fence_regs(o, D / 2);
                fence_p();
                release_v(s);
            }
            prefetch(t + gridDim.x);
            epilogue(qb);
        } else {
            /* Ping-pong: one warpgroup's softmax runs while the other's MMAs occupy the tensor
             * cores; inside a warpgroup S(it) and P(it-1) V(it-1) are issued together and the
             * softmax of S(it) overlaps P(it-1) V(it-1). */
            if (!early_s0) {
                const int s0 = slot(0);
                sm90::mbar_wait(bar_k(s0), phase(0));
                sm90::named_sync(pp_me, 256);
                if (hc_first != 0) {
                    issue_s(sQ, s0, ic<1>{}, hc_first);
                    sm90::named_arrive(pp_other, 256);
                    sm90::wg_wait<0>();
                } else {
                    issue_s(sQ, s0, ic<0>{}, 0);
                    sm90::named_arrive(pp_other, 256);
                    sm90::wg_wait<0>();
                }
                sm90::fence_regs(sc, BN / 2);
                release_k(s0);
            }
            softmax(0, hc_first);
            to_p(hc_first);
            /* One turn: S(it) and P(it-1) V(it-1); H = 1: tile it is the item's last and a high
             * half for this warpgroup (only the last tile can be, so the loop runs the full shape
             * and the last turn is chosen as a whole). */
            auto turn = [&](int it, auto h) {
                constexpr int H = decltype(h)::value;
                const int s = slot(it), sp = slot(it - 1);
                sm90::mbar_wait(bar_k(s), phase(it));
                sm90::named_sync(pp_me, 256);
                issue_s(sQ, s, h, 2);
                if (it > 1) rescale(); /* O had P(it-2) V(it-2) added; the factor of tile it-1 */
                sm90::mbar_wait(bar_v(sp), phase(it - 1));
                issue_pv(sp, it > 1);
                sm90::named_arrive(pp_other, 256);
                sm90::wg_wait<1>(); /* S(it) done; P(it-1) V(it-1) may still run */
                sm90::fence_regs(sc, BN / 2);
                release_k(s);
                softmax_n(ic<H ? BN / 2 : BN>{}, it, H ? 2 : 0);
                sm90::wg_wait<0>();
                sm90::fence_regs(o, D / 2);
                fence_p(); /* P(it-1) registers stay untouched until its MMA finished */
                release_v(sp);
                to_p(H ? 2 : 0);
            };
            for (int it = 1; it < n_it - 1; ++it) turn(it, ic<0>{});
            if (n_it > 1) {
                if (BN == 128 && hc_last != 0) turn(n_it - 1, ic<1>{});
                else turn(n_it - 1, ic<0>{});
            }
            /* The last P V. early: when the next item's Q and first K tile are already loaded
             * (tested without waiting; the warpgroup votes, so it decides as one), its S(0) is
             * issued in the same turn and the next item starts at its softmax. S(0) takes one
             * ping-pong turn either way, so the two warpgroups may decide differently. */
            const int sl = slot(n_it - 1), tn = t + gridDim.x;
            bool go = false;
            const int qbn = (n + 1) % NQ, sn = (kv0 + n_it) % kStages;
            if (early) {
                prefetch(tn);
                bool ready = tn < n_items && w_next.n_it > 0;
                if (ready)
                    ready = sm90::mbar_test(bar_q(qbn), (uint32_t)(((n + 1) / NQ) & 1)) &&
                            sm90::mbar_test(bar_k(sn), (uint32_t)(((kv0 + n_it) / kStages) & 1));
                go = sm90::named_and(kEarlyBar + cw, 128, ready);
            }
            if (n_it > 1) rescale();
            sm90::mbar_wait(bar_v(sl), phase(n_it - 1));
            if (go) {
                sm90::named_sync(pp_me, 256);
                if (hc_first_next != 0) {
                    issue_pv(sl, n_it > 1);
                    issue_s(q_buf(qbn), sn, ic<1>{}, hc_first_next);
                    sm90::named_arrive(pp_other, 256);
                    sm90::wg_wait<0>();
                } else {
                    issue_pv(sl, n_it > 1);
                    issue_s(q_buf(qbn), sn, ic<0>{}, 0);
                    sm90::named_arrive(pp_other, 256);
                    sm90::wg_wait<0>();
                }
                sm90::fence_regs(sc, BN / 2);
                release_k(sn);
            } else {
                issue_pv(sl, n_it > 1);
                if (!early) prefetch(tn);
                sm90::wg_wait<0>();
            }
            sm90::fence_regs(o, D / 2);
            fence_p();
            release_v(sl);
            epilogue(qb);
            early_s0 = go;
        }
        kv0 += n_it;
    }
    if (PINGPONG && cw == 0) sm90::named_sync(kPP, 256); /* warpgroup 1's last arrival */
#else
    __trap(); /* never launched: the host only picks this kernel on sm_90a builds and devices */
#endif
}

/* Number of SMs of the current device (cached per device; 0 when it cannot be read). */
int sm_count() {
    static int cached[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) return 0;
    if (dev < 64 && cached[dev] > 0) return cached[dev];
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 0;
    if (dev < 64) cached[dev] = n;
    return n;
}

/* persistent: one CTA per SM walks the work items (the next item's Q and K/V tiles load during the
 * current item's last tiles and epilogue); otherwise one CTA per item. */
template <typename T, int D, int BN, bool PINGPONG, int STAGES>
ncp_status launch(const ncp_sink_attn_params &p, bool persistent, int flags, cudaStream_t stream) {
    CUtensorMap tq, tk, tv, to;
    NCP_TRY(ncp_sm90_tensor_map(&tq, p.q, p.Tq, p.Hq, D, p.q_st, p.q_sh, HBM));
    NCP_TRY(ncp_sm90_tensor_map(&tk, p.k, p.Tk, p.Hkv, D, p.k_st, p.k_sh, BN));
    NCP_TRY(ncp_sm90_tensor_map(&tv, p.v, p.Tk, p.Hkv, D, p.v_st, p.v_sh, BN));
    NCP_TRY(ncp_sm90_tensor_map(&to, p.out, p.Tq, p.Hq, D, p.o_st, p.o_sh, HBM));
    constexpr int bytes = fwd_layout<D, BN, STAGES>::bytes;
    auto kernel = sink_attn_fwd_sm90_kernel<T, D, BN, PINGPONG, STAGES>;
    NCP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    const int64_t items = (int64_t)p.Hq * ((p.Tq + HBM - 1) / HBM);
    NCP_CHECK(items <= INT32_MAX / 2, NCP_ERR_INVALID_ARG, "too many attention work items (Hq=%d, Tq=%d)", p.Hq, p.Tq);
    int64_t grid = items;
    if (persistent) {
        int64_t cap = sm_count(); /* __launch_bounds__(kThreads, 1): one CTA per SM */
        const char *e = getenv("NCP_SM90_FWD_GRID"); /* tests: fewer CTAs, many items each */
        if (e != nullptr && atoi(e) > 0) cap = atoi(e);
        if (cap > 0 && grid > cap) grid = cap;
    }
    kernel<<<(unsigned)grid, kThreads, bytes, stream>>>(tq, tk, tv, to, p, flags);
    NCP_CUDA_CHECK(cudaGetLastError());
    return NCP_OK;
}

template <typename T, int D, bool PINGPONG, int STAGES>
ncp_status launch_mode(const ncp_sink_attn_params &p, bool persistent, int flags, cudaStream_t s) {
    return p.q_pos != nullptr ? launch<T, D, NCP_FWD_BN, PINGPONG, STAGES>(p, persistent, flags, s)
                              : launch<T, D, 128, PINGPONG, STAGES>(p, persistent, flags, s);
}

/* Schedule: NCP_SM90_FWD_SCHED=serial|pingpong (read on every call), default ping-pong. Until the
 * K and V slots were freed separately, serial was faster on full-causal masks (529-531 vs 491-492
 * TFLOP/s on 32k documents at 336b2cb); with them ping-pong leads on causal 8k documents (555 vs
 * 498 at 991bc7b) and on windows. Grid: NCP_SM90_FWD_PERSIST=1|0, default persistent for every
 * mask (at 2972be1, with the TMA store of O and the next item's bounds loaded early, it was even
 * with one CTA per item on causal 8k documents and 10% ahead on 2k documents; before, causal masks
 * used one CTA per item). NCP_SM90_FWD_GRID=n caps a persistent grid at n CTAs, for tests. K/V ring
 * depth: NCP_SM90_FWD_STAGES=3|2, default 2 (at D = 128 a third stage leaves room for one Q buffer
 * only). A/B baselines: NCP_SM90_FWD_FOLD=0 scales every tile's scores before the softmax,
 * NCP_SM90_FWD_OSTORE=0 has the consumers copy O out, NCP_SM90_FWD_EAGER_STORE=0 issues the TMA
 * store of O only when its Q buffer is needed again, NCP_SM90_FWD_LAZY=0 rescales O on every
 * tile, NCP_SM90_FWD_HALF=0 computes whole edge tiles. NCP_SM90_FWD_EARLY=1 (off by default:
 * -0.5 to -0.7% at 27498c3) issues the next item's S(0) with the last P V when its loads are in.
 * BENCHMARKS.md section 1. */
template <typename T, int D> ncp_status launch_any(const ncp_sink_attn_params &p, cudaStream_t s) {
    const char *e = getenv("NCP_SM90_FWD_SCHED");
    bool pingpong = true;
    if (e != nullptr && strcmp(e, "serial") == 0) pingpong = false;
    const char *ep = getenv("NCP_SM90_FWD_PERSIST");
    bool persistent = true;
    if (ep != nullptr && strcmp(ep, "0") == 0) persistent = false;
    if (ep != nullptr && strcmp(ep, "1") == 0) persistent = true;
    auto off = [](const char *name) {
        const char *v = getenv(name);
        return v != nullptr && strcmp(v, "0") == 0;
    };
    auto on = [](const char *name) {
        const char *v = getenv(name);
        return v != nullptr && strcmp(v, "1") == 0;
    };
    const int flags = (off("NCP_SM90_FWD_FOLD") ? 0 : kFlagFold) | (off("NCP_SM90_FWD_OSTORE") ? 0 : kFlagOStore) |
                      (off("NCP_SM90_FWD_LAZY") ? 0 : kFlagLazy) | (off("NCP_SM90_FWD_EAGER_STORE") ? 0 : kFlagEagerStore) |
                      (off("NCP_SM90_FWD_HALF") ? 0 : kFlagHalf) |
                      (on("NCP_SM90_FWD_EARLY") ? kFlagEarly : 0);
    const char *es = getenv("NCP_SM90_FWD_STAGES");
    const bool three = es != nullptr && strcmp(es, "3") == 0;
    if (three)
        return pingpong ? launch_mode<T, D, true, 3>(p, persistent, flags, s)
                        : launch_mode<T, D, false, 3>(p, persistent, flags, s);
    return pingpong ? launch_mode<T, D, true, 2>(p, persistent, flags, s)
                    : launch_mode<T, D, false, 2>(p, persistent, flags, s);
}

}  // namespace
}  // namespace ncp

/* Hopper forward; the caller (ncp_sink_attn_fwd_cuda) has validated p and checked usability. */
extern "C" ncp_status ncp_sink_attn_fwd_sm90(const ncp_sink_attn_params *p, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    const bool bf16 = p->dtype == NCP_DT_BF16;
    if (p->D == 64) return bf16 ? ncp::launch_any<__nv_bfloat16, 64>(*p, s) : ncp::launch_any<__half, 64>(*p, s);
    return bf16 ? ncp::launch_any<__nv_bfloat16, 128>(*p, s) : ncp::launch_any<__half, 128>(*p, s);
}
