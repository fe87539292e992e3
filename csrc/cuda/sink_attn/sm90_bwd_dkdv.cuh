/*
 * sink_attn/sm90_bwd_dkdv.cuh: a consumer warpgroup of the Hopper dK/dV kernel (sm90_bwd.cu).
 *
 * CTA = 128 keys of one kv head (64 per consumer warpgroup), K and V stationary in shared memory;
 * it walks the (query head, q tile of 64 rows) items that see a key of the CTA. Per item and
 * warpgroup: S^T = K Q^T and dP^T = V dO^T (A and B from shared memory), P^T and dS^T in registers
 * (the mask is a separate pass on partial items: folded into the exponentials it cost enough
 * registers for ptxas to serialize every wgmma), then dV += P^T dO (A from registers) and
 * dK += dS^T Q. Two modes:
 *   ADQ (default, not deterministic): dS^T also goes to shared memory; dK += dS^T Q and dQ = dS K
 *     read it from there, and each warpgroup adds its 64 x 64 dQ tile into the fp32 workspace with
 *     one bulk asynchronous reduction (5 MMAs per item; the order of the additions, so the last
 *     bits of dq, vary from run to run); with D = 128 it stages the tile for a dQ writer warp of the
 *     producer warpgroup (write_dq), which stores a tile's first share and adds the others, so the
 *     accumulator needs no zeroing. With D = 128 and no skipping (causal, CP tables) an item's
 *     dQ MMA runs one item late (run_adq_deferred), so the warpgroups need not meet at one barrier
 *     per item and their softmaxes interleave with each other's MMAs (+2.7% to +3.1% causal
 *     forward+backward, docs/EXPERIMENTS.md). The skipping D = 128 kernel takes the same loop in
 *     CTAs whose keys 8 or more q tiles see, skipping there only a skipped item's softmax (1.2% to
 *     2.2% less backward time on window 513, 8k and 32k documents).
 *   deterministic: no atomics; dQ comes from the dQ kernel (7 MMAs per item in all).
 * Skipping (SKIP, chosen per launch: documents with a window; docs/EXPERIMENTS.md): a warpgroup none
 * of whose 64 keys a row of the item sees (KeyVis::flags) skips the item. Under a window the first
 * q tile that sees the CTA's keys sees only their low half and the last one only the high half
 * (2 of 10 warpgroup items for a window of 513); under a causal mask only the first, about 1 in 65
 * at 8k, which does not pay for the per-item test. With D = 128 and atomic dQ the skipping
 * warpgroup still computes its dQ columns, over the other warpgroup's 64 keys alone, and the other
 * warpgroup's dQ MMA then runs over its own 64 keys (half the k-steps each; the skipped rows of
 * dS^T are never written nor read).
 */
#ifndef NCP_SINK_ATTN_SM90_BWD_DKDV_CUH
#define NCP_SINK_ATTN_SM90_BWD_DKDV_CUH

#include "sm90_bwd_parts.cuh"

namespace ncp {
namespace bwd90 {

#ifdef NCP_SM90_DEVICE
/* Mask-agnostic: the mask reaches the consumers only as the producer's key bounds (KeyVis). */
template <typename T, int D, bool ADQ> struct DkdvConsumer {
    using L = Layout<D, KVB, KQB, ADQ>;
    const ncp_sink_attn_params &p;
    const KvItems &w;
    const Bars bar;
    const uint32_t base;
    const float *s_l2, *s_dl;
    const int cw, warp, lane, tq, krow0; /* this thread's key rows krow0, krow0 + 8 of the CTA */
    const float scale_log2;
    const KeyVis vis;
    float dk[D / 2], dv[D / 2];

    __device__ __forceinline__ DkdvConsumer(const ncp_sink_attn_params &p_, const KvItems &w_, Bars bar_,
                                            uint32_t base_, const float *l2, const float *dl, const uint16_t *kb, int cw_)
        : p(p_), w(w_), bar(bar_), base(base_), s_l2(l2), s_dl(dl), cw(cw_), warp((threadIdx.x & 127) >> 5),
          lane(threadIdx.x & 31), tq(lane & 3), krow0(64 * cw_ + 16 * warp + (lane >> 2)),
          scale_log2((float)p_.scale * kLog2e), vis(kb, krow0) {
#pragma unroll
        for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
    }
    __device__ __forceinline__ uint32_t sK() const { return base; }
    __device__ __forceinline__ uint32_t sV() const { return base + L::s1_off; }
    __device__ __forceinline__ uint32_t sQ(int s) const { return base + L::a_off + s * L::tile_bytes; }
    __device__ __forceinline__ uint32_t sO(int s) const { return base + L::b_off + s * L::tile_bytes; }
    /* dS^T buffer of item i (double-buffered; atomic-dQ layout) */
    __device__ __forceinline__ uint32_t sDs(int i) const { return base + L::ds_off + (i & 1) * L::ds_bytes; }

    /* Waits for item it's stage a (Q, lse, Delta, key bounds) and returns this warpgroup's view of
     * it: bit 0, whether a row of the item sees one of the warpgroup's keys (else the warpgroup
     * skips the item: its P^T and dS^T are zero); bit 1, whether every row sees all of them (no
     * mask pass); bit 2, whether a row sees one of the other warpgroup's keys. A skipping warpgroup still waits here, so it never arrives on a stage's empty
     * barrier for a later fill before the other warpgroup arrived for this one. The loops ask for
     * item it + 1 while item it's last MMAs run (the last item asks for itself again: its phase is
     * complete and its stage not refilled), so the test is off the MMA issue path. */
    __device__ __forceinline__ uint32_t wait_item(int it) const {
        it = min(it, w.n_it - 1);
        const int s = Ring::slot(it);
        NCP_CLOCK_SPAN(threadIdx.x == 128, 2, sm90::mbar_wait(bar.a(s), Ring::full_phase(it)));
        return vis.flags(s, 64 * cw, 64 * (1 - cw));
    }
    /* S^T = K Q^T and dP^T = V dO^T of item it (stage a waited: wait_item), issued asynchronously. */
    __device__ __forceinline__ void issue_sdp(float *st, float *dpt, int it) const {
        const int s = Ring::slot(it);
        sm90::gemm_ss<T, KQB, D>(st, sK() + cw * 64 * 128, KVB * 128, sQ(s), KQB * 128);
        sm90::mbar_wait(bar.b(s), Ring::full_phase(it));
        sm90::gemm_ss<T, KQB, D>(dpt, sV() + cw * 64 * 128, KVB * 128, sO(s), KQB * 128);
    }
    /* P^T and dS^T of item it in place for accumulator column blocks [j0, j1); columns are queries
     * q0 + 8j + 2tq + c, rows the thread's two keys. */
    __device__ __forceinline__ void probs_cols(float *st, float *dpt, int it, bool full, int j0, int j1) const {
        const int s = Ring::slot(it);
#pragma unroll
        for (int j = j0; j < j1; ++j) {
            /* the two columns' lse and Delta as one 8-byte shared load each */
            const float2 l2v = *reinterpret_cast<const float2 *>(s_l2 + s * KQB + 8 * j + 2 * tq);
            const float2 dlv = *reinterpret_cast<const float2 *>(s_dl + s * KQB + 8 * j + 2 * tq);
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float l2 = c ? l2v.y : l2v.x, dl = c ? dlv.y : dlv.x;
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int e = 2 * r + c;
                    const float pv = ex2(st[4 * j + e] * scale_log2 - l2);
                    st[4 * j + e] = pv;
                    dpt[4 * j + e] = pv * (dpt[4 * j + e] - dl);
                }
            }
        }
        if (!full) { /* a separate pass, so full items carry none of the mask's registers */
#pragma unroll
            for (int j = j0; j < j1; ++j) {
                const uint32_t b2 = vis.pair(s, 8 * j + 2 * tq); /* both columns' key bounds */
#pragma unroll
                for (int c = 0; c < 2; ++c)
#pragma unroll
                    for (int r = 0; r < 2; ++r)
                        if (!vis(c ? b2 >> 16 : b2 & 0xffffu, r))
                            st[4 * j + 2 * r + c] = dpt[4 * j + 2 * r + c] = 0.f; /* hidden inf/nan too */
            }
        }
    }
    __device__ __forceinline__ void release(int it) const { sm90::warp_arrive(bar.e(Ring::slot(it))); }
    /* A skipped item: wait for its dO load too before the stage is released. Only sdp waits for it
     * otherwise, and when both warpgroups skip an item (a table whose rows jump past the CTA's
     * keys) the producer could re-arm a barrier whose load is still in flight. */
    __device__ __forceinline__ void wait_b(int it) const {
        sm90::mbar_wait(bar.b(Ring::slot(it)), Ring::full_phase(it));
    }
    /* After the wait for an atomic-dQ item's dV, dK and dQ MMAs: their accumulators and the P^T
     * fragments the dV MMA read. */
    __device__ __forceinline__ void fence_waited(float *dq, uint32_t (*pf)[4]) {
        sm90::fence_regs(dv, D / 2);
        sm90::fence_regs(dk, D / 2);
        sm90::fence_regs(dq, 32);
        sm90::fence_frags(pf, KQB / 16);
    }

    /* Without skipping: item it's stage a waited at the top of its turn, and whether it needs the
     * mask pass from the key bounds after its S and dP are done (as bit 1, like flags). */
    __device__ __forceinline__ void wait_stage(int it) const {
        NCP_CLOCK_SPAN(threadIdx.x == 128, 2, sm90::mbar_wait(bar.a(Ring::slot(it)), Ring::full_phase(it)));
    }
    __device__ __forceinline__ uint32_t full_flags(int it) const { return 1u | (uint32_t)vis.all_visible(Ring::slot(it)) << 1; }

    /* S^T and dP^T of item it, done (without SKIP the stage is waited here); returns the item's
     * flags: f as given with SKIP (wait_item), else from the key bounds (full_flags). */
    template <bool SKIP> __device__ __forceinline__ uint32_t sdp(float *st, float *dpt, int it, uint32_t f) const {
        if (!SKIP) wait_stage(it);
        issue_sdp(st, dpt, it);
        sm90::wg_wait<0>();
        sm90::fence_regs(st, KQB / 2);
        sm90::fence_regs(dpt, KQB / 2);
        return SKIP ? f : full_flags(it);
    }

    /* Deterministic mode: dV += P^T dO and dK += dS^T Q from registers. */
    template <bool SKIP> __device__ __forceinline__ void run_det() {
        uint32_t f = SKIP ? wait_item(0) : 1u;
        for (int it = 0; it < w.n_it; ++it) {
            if (SKIP && !(f & 1u)) { /* none of this warpgroup's keys is seen: nothing to add */
                wait_b(it);
                release(it);
                f = wait_item(it + 1);
                continue;
            }
            float st[KQB / 2], dpt[KQB / 2];
            uint32_t pf[KQB / 16][4], df[KQB / 16][4];
            f = sdp<SKIP>(st, dpt, it, f);
            probs_cols(st, dpt, it, (f >> 1) & 1u, 0, KQB / 8);
            to_frags<T, KQB>(pf, st);
            to_frags<T, KQB>(df, dpt);
            const int s = Ring::slot(it);
            sm90::fence_regs(dv, D / 2);
            sm90::fence_regs(dk, D / 2);
            sm90::wg_fence();
            sm90::rs_steps<T, D, KQB>(dv, pf, sO(s), KQB * 128);
            sm90::rs_steps<T, D, KQB>(dk, df, sQ(s), KQB * 128);
            sm90::wg_commit();
            if (SKIP) f = wait_item(it + 1);
            sm90::wg_wait<0>();
            sm90::fence_regs(dv, D / 2);
            sm90::fence_regs(dk, D / 2);
            sm90::fence_frags(pf, KQB / 16);
            sm90::fence_frags(df, KQB / 16);
            release(it);
        }
    }

    /* P^T into fragments and dS^T (keys x queries, 128B-swizzled rows of 64 queries) into shared
     * memory, 16 queries at a time to bound the live registers. */
    __device__ __forceinline__ void probs_to_smem(float *st, float *dpt, uint32_t (*pf)[4], uint32_t sDS, int it,
                                                  bool full) const {
#pragma unroll
        for (int kk = 0; kk < KQB / 16; ++kk) {
            probs_cols(st, dpt, it, full, 2 * kk, 2 * kk + 2);
            pack_frag<T>(pf[kk], st + 8 * kk, st + 8 * kk + 4);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = 8 * kk + 2 * (e & 1) + 4 * (e >> 1); /* the to_frags pairing */
                const uint32_t v = elem<T>::pack(dpt[c], dpt[c + 1]);
                const uint32_t addr = sDS + sm90::sw128_offset(KVB, krow0 + 8 * (e & 1), 16 * kk + 8 * (e >> 1) + 2 * tq);
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v));
            }
        }
    }

    /* Atomic-dQ item after S^T and dP^T: P^T into fragments and dS^T into shared memory, then
     * dV += P^T dO issued (not waited), and the async-proxy fence for the MMAs that read dS^T. */
    __device__ __forceinline__ void ds_and_dv(float *st, float *dpt, uint32_t (*pf)[4], uint32_t sDS, int it, bool full) {
        probs_to_smem(st, dpt, pf, sDS, it, full);
        sm90::fence_regs(dv, D / 2);
        sm90::wg_fence();
        sm90::rs_steps<T, D, KQB>(dv, pf, sO(Ring::slot(it)), KQB * 128);
        sm90::wg_commit();
        sm90::fence_proxy_async_smem(); /* the generic-proxy stores above, before wgmma reads */
    }

    /* dK += dS^T Q (A: this warpgroup's dS^T rows at la, B: Q at lb), issued asynchronously after
     * the register fences of dK and of the dQ accumulator the next MMAs write. */
    __device__ __forceinline__ void issue_dk(uint32_t la, uint32_t lb, float *dq) {
        sm90::fence_regs(dk, D / 2);
        sm90::fence_regs(dq, 32);
        sm90::wg_fence();
#pragma unroll
        for (int ks = 0; ks < KQB / 16; ++ks) /* k-step ks: + 32 bytes of A, 16 rows of B */
            sm90::wgmma<T, D>::template ss<0, 1>(dk, sm90::desc_of(la + ks * 2), sm90::desc_of(lb + ks * 128), 1);
    }
    /* dQ (this warpgroup's share) = dS K over the CTA's keys [kb, kb + NK), issued asynchronously:
     * D = 128, columns [64 cw, 64 cw + 64) (sKc: K's column block); D = 64, all 64 columns. */
    template <int NK> __device__ __forceinline__ void issue_dq(float *dq, uint32_t sDS, uint32_t sKc, int kb) const {
        const uint32_t la = sm90::desc_lo(sDS + kb * 128, KQB * 128), lb = sm90::desc_lo(sKc + kb * 128, KVB * 128);
#pragma unroll
        for (int ks = 0; ks < NK / 16; ++ks) /* k-step ks: + 16 rows of 128 bytes in both */
            sm90::wgmma<T, 64>::template ss<1, 1>(dq, sm90::desc_of(la + ks * 128), sm90::desc_of(lb + ks * 128), ks > 0);
    }
    /* Atomic-dQ mode with skipping (D = 64: also without; D = 128: in CTAs that fewer than
     * kDeferredMinQTiles q tiles see, the others and the kernel without skipping take
     * run_adq_deferred). D = 128: warpgroup cw computes dQ columns [64 cw, 64 cw + 64) over all 128
     * keys (over the 64 seen ones when an item sees no key of one warpgroup: flags bit 2), so both
     * warpgroups' dS^T must be in shared memory (named barrier kDsBar); D = 64: each
     * warpgroup adds its own 64 keys' share of all 64 columns. dS^T is double-buffered: a
     * warpgroup rewrites buffer it & 1 only after passing the barrier of item it - 1, which the
     * other reaches after its dQ MMA of item it - 2 is done. The staging tile of the bulk reduction
     * is rewritten only after its leader thread waited for the previous reduction's reads (D = 64)
     * or after the dQ writer warp read it (D = 128: dq_empty, hand_dq). dq_accum
     * is (Hq, ceil(Tq / 64), D / 64, 4096) in fragment order (dq_frag_pos). */
    template <bool SKIP> __device__ __forceinline__ void run_adq(float *dq_accum) {
        static_assert(SKIP || D == 64, "D = 128 without skipping runs run_adq_deferred");
        const int key0 = D == 128 ? 0 : 64 * cw, cb = D == 128 ? cw : 0;
        constexpr int kDqKeys = D == 128 ? KVB : 64;
        const uint32_t sKc = sK() + cb * KVB * 128; /* K's column block of this warpgroup's dQ columns */
        const uint32_t sStw = base + L::stage_off + cw * 64 * 64 * 4;
        const bool leader = (threadIdx.x & 127) == 0;
        uint32_t f = SKIP ? wait_item(0) : 1u;
        for (int it = 0; it < w.n_it; ++it) {
            if (SKIP && D == 64 && !(f & 1u)) { /* this warpgroup's share of dK, dV and dQ is zero */
                wait_b(it);
                release(it);
                f = wait_item(it + 1);
                continue;
            }
            const int s = Ring::slot(it);
            const uint32_t sDS = sDs(it);
            float dq[32];
            /* Each branch waits for its MMAs before the paths merge (see the forward's note on C7515). */
            if (!SKIP || (f & 1u)) {
                float st[KQB / 2], dpt[KQB / 2]; /* per item: no loop-carried accumulator copies */
                uint32_t pf[KQB / 16][4];
                f = sdp<SKIP>(st, dpt, it, f);
                ds_and_dv(st, dpt, pf, sDS, it, (f >> 1) & 1u);
                if (D == 64 && leader) sm90::bulk_wait_read<0>(); /* staging free once this barrier passes */
                if (D == 128) sm90::named_sync_unaligned(kDsBar, 256); /* also reached from the branch below */
                else sm90::named_sync(1 + cw, 128);
                const uint32_t la = sm90::desc_lo(sDS + 64 * cw * 128, sm90::kLboKMajor), lb = sm90::desc_lo(sQ(s), KQB * 128);
                if (D == 128 && SKIP && !(f & 4u)) { /* the other warpgroup's keys unseen: dQ over this one's */
                    issue_dk(la, lb, dq);
                    issue_dq<64>(dq, sDS, sKc, 64 * cw);
                    sm90::wg_commit();
                    f = wait_item(it + 1);
                    sm90::wg_wait<0>();
                } else {
                    issue_dk(la, lb, dq);
                    issue_dq<kDqKeys>(dq, sDS, sKc, key0);
                    sm90::wg_commit();
                    if (SKIP) f = wait_item(it + 1);
                    sm90::wg_wait<0>();
                }
                fence_waited(dq, pf);
            } else { /* D = 128, none of this warpgroup's keys seen: its dS^T rows would be zero, so
                      * neither warpgroup reads them (bit 2 of the other's flags), and its dQ columns
                      * take the other warpgroup's keys alone, or are zero when no key is seen */
                wait_b(it);
                sm90::named_sync_unaligned(kDsBar, 256);
                if (f & 4u) {
                    sm90::fence_regs(dq, 32);
                    sm90::wg_fence();
                    issue_dq<64>(dq, sDS, sKc, 64 * (1 - cw));
                    sm90::wg_commit();
                    f = wait_item(it + 1);
                    sm90::wg_wait<0>();
                    sm90::fence_regs(dq, 32);
                } else {
#pragma unroll
                    for (int i = 0; i < 32; ++i) dq[i] = 0.f;
                    f = wait_item(it + 1);
                }
            }
            release(it);
            if constexpr (D == 128) hand_dq(dq, it, sStw);
            else reduce_dq(dq, it, sStw, cb, dq_accum);
        }
        if (D == 64 && leader) sm90::bulk_wait_read<0>(); /* shared memory must outlive the last reads */
    }

    /* D = 64: this warpgroup's 64 x 64 dQ share of item it, staged in fragment order, then added into
     * the fp32 workspace by one bulk reduction of the leader thread (which has waited for the staging
     * tile's previous reads behind a barrier that the warpgroup passed since). */
    __device__ __forceinline__ void reduce_dq(const float *dq, int it, uint32_t sStw, int cb, float *dq_accum) const {
        stage_dq(dq, sStw);
        sm90::named_sync(1 + cw, 128);
        if ((threadIdx.x & 127) == 0) {
            const int n_qt = (p.Tq + KQB - 1) / KQB, qt = w.q0(it) / KQB;
            float *dst = dq_accum + (((int64_t)w.head(it) * n_qt + qt) * (D / 64) + cb) * 4096;
            sm90::bulk_reduce_add_f32(dst, sStw, 64 * 64 * 4);
        }
    }
    /* D = 128: this warpgroup's share of item it, staged for its dQ writer warp (write_dq) once the
     * writer has read the share of item it - 1; each warp arrives when its 16 rows are stored. */
    __device__ __forceinline__ void hand_dq(const float *dq, int it, uint32_t sStw) const {
        if (it > 0) sm90::mbar_wait(bar.dq_empty(cw), (uint32_t)((it - 1) & 1));
        stage_dq(dq, sStw);
        sm90::warp_arrive(bar.dq_full(cw));
    }
    /* The 64 x 64 fp32 tile in fragment order at sStw, fenced for the async proxy's reads. */
    __device__ __forceinline__ void stage_dq(const float *dq, uint32_t sStw) const {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(sStw + 8 * dq_frag_pos(warp, j, r, lane)),
                             "f"(dq[4 * j + 2 * r]), "f"(dq[4 * j + 2 * r + 1]));
        sm90::fence_proxy_async_smem();
    }

    /* Atomic dQ, D = 128, no skipping (causal and table masks): the dQ MMA of item it runs one item
     * late, beside the dK MMA of item it + 1, so neither warpgroup waits at a common barrier for the
     * other's dS^T of the item it is on: the two may drift up to about one item apart, and one's
     * softmax then runs beside the other's MMAs. Hand-offs by named barriers, one arriving
     * warpgroup and one syncing (256 threads each, ids kDsReady and kDqDone + 2 warpgroup + parity):
     *   ready(c, i): warpgroup c stored its dS^T rows of item i (buffer i & 1); the other syncs on
     *                it before the dQ MMA of item i (which reads both warpgroups' rows);
     *   done(c, i):  warpgroup c's dQ MMA of item i is complete; the other syncs on it before it
     *                rewrites buffer i & 1 with item i + 2.
     * Each barrier instance gets its arrival before the next one on the same id can be made, so
     * the counts never mix: c arrives on ready(c, i + 2) only after syncing done(1 - c, i), which
     * the other arrives on after syncing ready(c, i). */
    template <bool SKIP> __device__ __forceinline__ void run_adq_deferred() {
        static_assert(D == 128, "the D = 64 kernels compute each warpgroup's dQ from its own keys");
        const uint32_t sStw = base + L::stage_off + cw * 64 * 64 * 4;
        const int n = w.n_it;
        if (n == 0) return;
        uint32_t f = SKIP ? wait_item(0) : 1u;
        f = deferred_item<true, SKIP>(0, f, sStw); /* item 0 has no dQ of an earlier item: peeled, so
                                                    * no MMA is issued under a run-time branch (C7512) */
        for (int it = 1; it < n; ++it) f = deferred_item<false, SKIP>(it, f, sStw);
        /* the last item's dQ */
        float dq[32];
        sm90::named_sync(kDsReady + 2 * (1 - cw) + ((n - 1) & 1), 256);
        sm90::fence_regs(dq, 32);
        sm90::wg_fence();
        issue_dq<KVB>(dq, sDs(n - 1), sK() + cw * KVB * 128, 0);
        sm90::wg_commit();
        sm90::wg_wait<0>();
        sm90::fence_regs(dq, 32);
        hand_dq(dq, n - 1, sStw);
    }
    /* Item it of run_adq_deferred: its S^T, dP^T, dV and dK, and the dQ of item it - 1 (FIRST: none).
     * f: the item's flags (SKIP: wait_item, asked for during the previous item's MMAs); returns the
     * next item's. SKIP: a warpgroup none of whose keys a row of the item sees computes no S^T,
     * dP^T nor softmax, and stores zeros as its dS^T rows and P^T fragments, so every dQ MMA keeps
     * all 128 keys and the hand-offs stay the same (its dV and dK MMAs add those zeros). */
    template <bool FIRST, bool SKIP>
    __device__ __forceinline__ uint32_t deferred_item(int it, uint32_t f, uint32_t sStw) {
        const int other = 1 - cw, n = w.n_it, s = Ring::slot(it);
        const uint32_t sDS = sDs(it);
        float dq[32];
        uint32_t pf[KQB / 16][4];
        if (!SKIP || (f & 1u)) {
            float st[KQB / 2], dpt[KQB / 2];
            f = sdp<SKIP>(st, dpt, it, f);
            if (it >= 2) sm90::named_sync(kDqDone + 2 * other + (it & 1), 256); /* dQ of item it - 2 read buffer it & 1 */
            probs_to_smem(st, dpt, pf, sDS, it, (f >> 1) & 1u);
        } else { /* no MMA in this branch: a wgmma in one path only serializes them all (C7515) */
            /* The dV MMA below reads this stage's dO even with P^T = 0, and 0 x NaN is NaN: wait
             * for its load as sdp does (stale shared memory gave dv 64 NaN, docs/EXPERIMENTS.md). */
            wait_b(it);
            if (it >= 2) sm90::named_sync(kDqDone + 2 * other + (it & 1), 256);
            zero_ds_rows(sDS);
#pragma unroll
            for (int kk = 0; kk < KQB / 16; ++kk)
#pragma unroll
                for (int e = 0; e < 4; ++e) pf[kk][e] = 0u;
        }
        sm90::fence_regs(dv, D / 2); /* dV += P^T dO (P^T = 0 where skipped), as ds_and_dv */
        sm90::wg_fence();
        sm90::rs_steps<T, D, KQB>(dv, pf, sO(s), KQB * 128);
        sm90::wg_commit();
        sm90::fence_proxy_async_smem(); /* the dS^T stores (or zeros), before wgmma reads them */
        sm90::named_arrive(kDsReady + 2 * cw + (it & 1), 256);
        if (!FIRST) {
            sm90::named_sync(kDsReady + 2 * other + ((it - 1) & 1), 256);
        }
        issue_dk(sm90::desc_lo(sDS + 64 * cw * 128, sm90::kLboKMajor), sm90::desc_lo(sQ(s), KQB * 128), dq);
        if (!FIRST) issue_dq<KVB>(dq, sDs(it - 1), sK() + cw * KVB * 128, 0);
        sm90::wg_commit();
        const uint32_t fn = SKIP ? wait_item(it + 1) : 1u; /* off the MMA issue path */
        sm90::wg_wait<0>();
        fence_waited(dq, pf);
        release(it);
        if (!FIRST) {
            if (it - 1 <= n - 3) sm90::named_arrive(kDqDone + 2 * cw + ((it - 1) & 1), 256);
            hand_dq(dq, it - 1, sStw);
        }
        return fn;
    }
    /* Zeros as this warpgroup's 64 rows of the dS^T buffer at sDS (8 KiB, contiguous). */
    __device__ __forceinline__ void zero_ds_rows(uint32_t sDS) const {
        const uint32_t a = sDS + 64 * cw * 128 + 64 * (threadIdx.x & 127);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(a + 16 * i), "r"(0u) : "memory");
    }

    /* The rows of this warpgroup in sK / sV are free once its MMAs are done: stage dK, dV there. */
    __device__ __forceinline__ void store(const ncp_sink_attn_bwd_params &b) const {
        store_rows<T, D, KVB>(dk, (float)p.scale, sK(), 64 * cw, reinterpret_cast<T *>(b.dk) + (int64_t)w.g_kv * b.dk_sh,
                              b.dk_st, w.k0 + 64 * cw, p.Tk, cw);
        store_rows<T, D, KVB>(dv, 1.f, sV(), 64 * cw, reinterpret_cast<T *>(b.dv) + (int64_t)w.g_kv * b.dv_sh, b.dv_st,
                              w.k0 + 64 * cw, p.Tk, cw);
    }
};
#endif /* NCP_SM90_DEVICE */

}  // namespace bwd90
}  // namespace ncp

#endif /* NCP_SINK_ATTN_SM90_BWD_DKDV_CUH */
