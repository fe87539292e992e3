/*
 * sink_attn/sm90_fwd_consumer.cuh: a consumer warpgroup of the Hopper forward (layout, producer
 * and the schedule in sm90_fwd_mainloop.cuh). Per item: S(0) alone, then turns that issue S(it)
 * with P(it-1) V(it-1), then the last P V and the epilogue. The item's tile range, half-tile codes,
 * row bounds and sink come from shared memory (Facts, written by the producer's facts warp).
 *
 * ptxas serializes the wgmma pipeline (C7515) when control flow merges while an MMA is in flight,
 * so the shape of every issue (half or whole tile) is chosen at compile time and branches go around
 * whole stages (issue to wait), never around single MMAs.
 */
#ifndef NCP_SINK_ATTN_SM90_FWD_CONSUMER_CUH
#define NCP_SINK_ATTN_SM90_FWD_CONSUMER_CUH

#include "sm90_fwd_mainloop.cuh"

namespace ncp {
namespace fwd90 {

#ifdef NCP_SM90_DEVICE
template <typename T, int D> struct Consumer {
    static constexpr int NQ = Layout<D>::n_q;
    /* The softmax of S(it) above the wait for P(it-1) V(it-1) (see turn): against the same kernel
     * without it, forward causal 8k / 32k +1.0% / +2.5%, windows within 1.7% either way (H200,
     * 7796434). Not with D = 64, whose wgmma ptxas 13.0 then serializes (C7511). */
    static constexpr bool kOverlap = D == 128;
    const ncp_sink_attn_params &p;
    const Smem<D> sm;
    const TileScheduler sched;
    const int cw, lane, tq, row0, pp_me, pp_other;
    const uint32_t cw_off; /* this warpgroup's 64 rows in every column block */
    const float scale_log2;
    const bool scale_pos, has_sink;

    int kv0 = 0;    /* kv tiles consumed before this item */
    Item w;
    int lo[2], hi[2]; /* bounds of the thread's rows */
    int hc_first = 0, hc_last = 0;
    OnlineSoftmax sm_;
    float o[D / 2], sc[BN / 2];
    uint32_t pf[BN / 16][4];

    __device__ __forceinline__ Consumer(const ncp_sink_attn_params &p_, const Smem<D> &s, int cw_)
        : p(p_), sm(s), sched(p_.Tq, p_.Hq, BM), cw(cw_), lane(threadIdx.x & 31), tq(lane & 3),
          row0(64 * cw_ + 16 * ((threadIdx.x & 127) >> 5) + (lane >> 2)), pp_me(kPP + cw_), pp_other(kPP + 1 - cw_),
          cw_off(cw_ * 64 * 128), scale_log2((float)p_.scale * kLog2e), scale_pos(scale_log2 > 0.f),
          has_sink(p_.sink != nullptr) {}

    __device__ __forceinline__ int slot(int it) const { return KV::slot(kv0 + it); }
    __device__ __forceinline__ uint32_t phase(int it) const { return KV::full_phase(kv0 + it); }

    /* ---- the item's facts (Facts; q_full of its buffer waited) ---------------------------------- */
    __device__ __forceinline__ float load_facts(int qb) {
        const int *f = sm.facts(qb);
        w.h = f[Facts::kH];
        w.q0 = f[Facts::kQ0];
        w.n_it = f[Facts::kNIt];
        w.rng = q_tile_range{f[Facts::kKtLo], f[Facts::kKtHi], f[Facts::kHiFirst], f[Facts::kLoLast],
                             f[Facts::kRowsComplete]};
        hc_first = f[Facts::kHc + 2 * cw];
        hc_last = f[Facts::kHc + 2 * cw + 1];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            lo[r] = f[Facts::kLo + row0 + 8 * r];
            hi[r] = f[Facts::kHi + row0 + 8 * r];
        }
        return __int_as_float(f[Facts::kSink]);
    }

    /* ---- MMAs --------------------------------------------------------------------------------- */
    /* S = Q K^T (64 x BN per warpgroup), issued asynchronously; H = 1: the half tile of keys
     * hc * 64 - 64 .. into sc[0 .. BN / 4). */
    template <int H> __device__ __forceinline__ void issue_s(uint32_t sQ, int s, int hc) {
        if constexpr (H == 1)
            sm90::gemm_ss<T, BN / 2, D>(sc, sQ + cw_off, BM * 128, sm.k(s) + (hc == 2 ? BN / 2 * 128 : 0), BN * 128);
        else
            sm90::gemm_ss<T, BN, D>(sc, sQ + cw_off, BM * 128, sm.k(s), BN * 128);
    }
    /* O (+)= P V, issued asynchronously; keep = 0 for an item's first tile overwrites O. Always
     * K = BN: the P of a half tile has zeros in the other half. */
    __device__ __forceinline__ void issue_pv(int s, int keep) { sm90::gemm_rs<T, D, BN>(o, pf, sm.v(s), BN * 128, keep); }
    /* Pins the P fragments: defined before the next wgmma.fence, untouched until their MMA is waited. */
    __device__ __forceinline__ void fence_p() {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(pf[kk][e])::"memory");
    }
    __device__ __forceinline__ void release_k(int s) const { sm90::warp_arrive(sm.k_empty(s)); }
    __device__ __forceinline__ void release_v(int s) const { sm90::warp_arrive(sm.v_empty(s)); }

    /* ---- softmax of one tile ------------------------------------------------------------------ */
    /* NB columns (BN, or BN / 2 on a half tile hc); masks a partial tile, then the online softmax. */
    template <int NB> __device__ __forceinline__ void softmax_n(int it, int hc) {
        const int k0 = tile_of(w, it) * BN + (hc == 2 ? BN - NB : 0);
        const bool full = full_cols(w.rng, k0, NB, p.Tk);
        float s_mul = scale_log2;
        if (!scale_pos) {
#pragma unroll
            for (int i = 0; i < NB / 2; ++i) sc[i] *= scale_log2;
            s_mul = 1.f;
        }
        if (!full) { /* one branch per tile: full tiles keep a single straight-line block */
            const bool need_lo = k0 < w.rng.lo_last; /* lo grows with the row */
            const bool need_hi = !(w.rng.rows_complete && k0 + NB <= p.Tk && k0 + NB - 1 <= w.rng.hi_first);
            mask_frag<NB>(sc, k0, tq, lo, hi, need_lo, need_hi);
        }
        sm_.template step<NB>(sc, s_mul);
    }
    __device__ __forceinline__ void softmax(int it, int hc) {
        if (hc != 0) softmax_n<BN / 2>(it, hc);
        else softmax_n<BN>(it, 0);
    }
    /* P into A fragments; a half tile's 64 columns go to fragments 0-3 (hc = 1) or 4-7 (hc = 2)
     * and the others are zero. */
    __device__ __forceinline__ void to_p(int hc) {
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
        fence_p();
    }

    /* ---- the item ---------------------------------------------------------------------------- */
    /* S(0) alone, in a ping-pong turn. */
    __device__ __forceinline__ void first_tile(uint32_t sQ) {
        const int s0 = slot(0);
        sm90::mbar_wait(sm.k_full(s0), phase(0));
        sm90::named_sync(pp_me, 256);
        if (hc_first != 0) {
            issue_s<1>(sQ, s0, hc_first);
            sm90::named_arrive(pp_other, 256);
            sm90::wg_wait<0>();
        } else {
            issue_s<0>(sQ, s0, 0);
            sm90::named_arrive(pp_other, 256);
            sm90::wg_wait<0>();
        }
        sm90::fence_regs(sc, BN / 2);
        release_k(s0);
        softmax(0, hc_first);
        to_p(hc_first);
    }
    /* One turn: S(it) and P(it-1) V(it-1); H = 1: tile it is the item's last and a high half for
     * this warpgroup (only the last tile can be, so the loop runs the whole shape). */
    template <int H> __device__ __forceinline__ void turn(uint32_t sQ, int it) {
        const int s = slot(it), sp = slot(it - 1);
        sm90::mbar_wait(sm.k_full(s), phase(it));
        sm90::named_sync(pp_me, 256);
        issue_s<H>(sQ, s, 2);
        if (it > 1) sm_.template rescale<D>(o); /* O had P(it-2) V(it-2) added; the factor of tile it-1 */
        sm90::mbar_wait(sm.v_full(sp), phase(it - 1));
        issue_pv(sp, it > 1);
        sm90::named_arrive(pp_other, 256);
        sm90::wg_wait<1>(); /* S(it) done; P(it-1) V(it-1) may still run */
        sm90::fence_regs(sc, BN / 2);
        release_k(s);
        softmax_n<H ? BN / 2 : BN>(it, H ? 2 : 0);
        /* ptxas places the wait below at the top of the basic block that holds it, so without a block
         * boundary the softmax runs after P(it-1) V(it-1) instead of under it; the wait for V(it)
         * (needed by P(it) V(it) next anyway) ends the block. */
        if constexpr (kOverlap) sm90::mbar_wait(sm.v_full(s), phase(it));
        sm90::wg_wait<0>();
        sm90::fence_regs(o, D / 2);
        fence_p(); /* P(it-1) registers stay untouched until its MMA finished */
        release_v(sp);
        to_p(H ? 2 : 0);
    }
    /* The last P V (no turn of its own). */
    __device__ __forceinline__ void last_pv() {
        const int n_it = w.n_it, sl = slot(n_it - 1);
        if (n_it > 1) sm_.template rescale<D>(o);
        sm90::mbar_wait(sm.v_full(sl), phase(n_it - 1));
        issue_pv(sl, n_it > 1);
        sm90::wg_wait<0>();
        sm90::fence_regs(o, D / 2);
        fence_p();
        release_v(sl);
    }

    /* The item's O = acc / l staged in this warpgroup's rows of Q buffer qb (the producer stores
     * it with TMA), lse to global; the arrival on q_empty hands the buffer back. */
    __device__ __forceinline__ void epilogue(int qb) {
        const uint32_t sQ = sm.q(qb);
        float inv[2], lse[2];
        sm_.finish(inv, lse);
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint32_t v = elem<T>::pack(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
                const uint32_t addr = sQ + sm90::sw128_offset(BM, row0 + 8 * r, 8 * j + 2 * tq);
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v));
            }
        if (tq == 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = w.q0 + row0 + 8 * r;
                if (i < p.Tq) p.lse[(int64_t)w.h * p.Tq + i] = lse[r];
            }
        }
        /* Generic-proxy shared stores ordered before the producer's TMA (the O store, the next Q). */
        sm90::fence_proxy_async_smem();
        sm90::warp_arrive(sm.q_empty(qb));
    }

    /* Every item of this CTA. */
    __device__ __forceinline__ void run() {
        /* Warpgroup 1 arrives once up front and warpgroup 0 takes one extra turn at the end, so
         * every generation of the ping-pong barriers completes. */
        if (cw == 1) sm90::named_arrive(kPP, 256);
        for (int t = sched.first(), n = 0; sched.valid(t); t = sched.next(t), ++n) {
            const int qb = n % NQ;
            const uint32_t sQ = sm.q(qb);
            sm90::mbar_wait(sm.q_full(qb), (uint32_t)((n / NQ) & 1)); /* Q loaded, facts written */
            sm_.init(load_facts(qb), has_sink, tq);
            if (w.n_it == 0) { /* no visible key: O = 0, lse = the sink's */
#pragma unroll
                for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
                epilogue(qb);
                continue;
            }
            first_tile(sQ);
            for (int it = 1; it < w.n_it - 1; ++it) turn<0>(sQ, it);
            if (w.n_it > 1) {
                if (hc_last != 0) turn<1>(sQ, w.n_it - 1);
                else turn<0>(sQ, w.n_it - 1);
            }
            last_pv();
            epilogue(qb);
            kv0 += w.n_it;
        }
        if (cw == 0) sm90::named_sync(kPP, 256); /* warpgroup 1's last arrival */
    }
};
#endif /* NCP_SM90_DEVICE */

}  // namespace fwd90
}  // namespace ncp

#endif /* NCP_SINK_ATTN_SM90_FWD_CONSUMER_CUH */
