/*
 * plan.c: Flint CP plans. One MinHeap partition (magi_dispatch.c) shared by every window, and per
 * window the exact K/V exchange plus the row bounds the attention kernels read.
 *
 * Window w (0 = whole causal document, else w keys counting the current token): query p < T sees
 * keys [lo(p), p] with lo(p) = max(doc_start(p), p - w + 1). A receiver's needed keys are the union
 * of those intervals over its queries; every such key another rank owns is sent exactly once, so
 * no rank receives a token it cannot see. The K/V buffer of a rank is its local rows plus the
 * received ones, sorted by global position: the keys of a query are then one contiguous buffer
 * range [row_lo, row_hi], non-decreasing in the row, which is what the kernels read
 * (NCP_MASK_TABLE): a block of query rows then sees one contiguous key range, so the plan grows with
 * the pack, not with its square.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "ncp/ncp.h"
#include "ncp/ncp_check.h"

typedef struct {
    int64_t a, b; /* [a, b) */
} ival;

typedef struct {
    int32_t *data;
    int64_t n, cap;
} i32vec;

static int vec_push(i32vec *v, int32_t x) {
    if (v->n == v->cap) {
        int64_t cap = v->cap ? v->cap * 2 : 256;
        int32_t *d = (int32_t *)realloc(v->data, (size_t)cap * sizeof(int32_t));
        if (d == NULL) return 0;
        v->data = d;
        v->cap = cap;
    }
    v->data[v->n++] = x;
    return 1;
}

static ncp_i32_array vec_take(i32vec *v) {
    ncp_i32_array a = {(int32_t)v->n, v->data};
    v->data = NULL;
    v->n = v->cap = 0;
    return a;
}

static ncp_status alloc_array(ncp_i32_array *a, int64_t n) {
    a->n = (int32_t)n;
    a->data = (int32_t *)calloc((size_t)(n > 0 ? n : 1), sizeof(int32_t));
    if (a->data == NULL) NCP_FAIL(NCP_ERR_NOMEM, "out of host memory building a Flint plan");
    return NCP_OK;
}

/* Shared facts of one plan build. */
typedef struct {
    const int32_t *cu;
    int32_t n_cu, cp, rank, chunk, n_chunks;
    int64_t T, T_pad;
    const int32_t *owner;
    int32_t *chunk_slot; /* chunk -> index among its owner's chunks */
} plan_ctx;

/* Needed key intervals of `receiver` for window w, merged and sorted (self-owned keys included). */
static int64_t needed_intervals(const plan_ctx *x, int32_t receiver, int32_t w, ival *out) {
    int64_t n = 0;
    int32_t doc = 0;
    for (int32_t c = 0; c < x->n_chunks; ++c) {
        if (x->owner[c] != receiver) continue;
        const int64_t a = (int64_t)c * x->chunk, b0 = (int64_t)(c + 1) * x->chunk, b = b0 < x->T ? b0 : x->T;
        if (a >= b) continue;
        while (doc < x->n_cu - 1 && x->cu[doc + 1] <= a) ++doc;
        for (int32_t d = doc; d < x->n_cu - 1 && x->cu[d] < b; ++d) {
            const int64_t s = x->cu[d], e = x->cu[d + 1];
            const int64_t qlo = a > s ? a : s, qhi = b < e ? b : e;
            if (qhi <= qlo) continue;
            int64_t klo = s;
            if (w > 0 && qlo - w + 1 > klo) klo = qlo - w + 1;
            if (n > 0 && klo <= out[n - 1].b) {
                if (qhi > out[n - 1].b) out[n - 1].b = qhi;
            } else {
                out[n++] = (ival){klo, qhi};
            }
        }
    }
    return n;
}

/* Appends every position of the intervals that rank `src` owns (`src` != `receiver`): the position
 * itself (as_local = 0) or its row in the owner's local order (as_local = 1). */
static int emit_owned(const plan_ctx *x, const ival *iv, int64_t n_iv, int32_t src, int32_t receiver, int as_local,
                      i32vec *outv) {
    if (src == receiver) return 1;
    for (int64_t k = 0; k < n_iv; ++k)
        for (int64_t p = iv[k].a; p < iv[k].b;) {
            const int32_t c = (int32_t)(p / x->chunk);
            const int64_t c_end = (int64_t)(c + 1) * x->chunk, end = iv[k].b < c_end ? iv[k].b : c_end;
            if (x->owner[c] == src) {
                const int64_t shift = as_local ? (int64_t)x->chunk_slot[c] * x->chunk - (int64_t)c * x->chunk : 0;
                for (int64_t q = p; q < end; ++q)
                    if (!vec_push(outv, (int32_t)(q + shift))) return 0;
            }
            p = end;
        }
    return 1;
}

static int32_t doc_start(const plan_ctx *x, int64_t p, int32_t *doc) {
    while (*doc < x->n_cu - 2 && x->cu[*doc + 1] <= p) ++*doc;
    return x->cu[*doc];
}

/* Exchange tables, K/V buffer order and query bounds of one window. */
static ncp_status build_window(const plan_ctx *x, const int32_t *local_pos, int32_t L, int32_t w, ival *ivbuf,
                               int32_t *mark, ncp_plan_window *pw) {
    pw->window = w;
    NCP_TRY(alloc_array(&pw->send_counts, x->cp));
    NCP_TRY(alloc_array(&pw->recv_counts, x->cp));
    i32vec send = {0}, recv = {0};
    for (int32_t rho = 0; rho < x->cp; ++rho) { /* what every other rank needs from us */
        if (rho == x->rank) continue;
        const int64_t n_iv = needed_intervals(x, rho, w, ivbuf), before = send.n;
        if (!emit_owned(x, ivbuf, n_iv, x->rank, rho, 1, &send)) goto oom;
        pw->send_counts.data[rho] = (int32_t)(send.n - before);
    }
    const int64_t n_iv = needed_intervals(x, x->rank, w, ivbuf);
    for (int32_t o = 0; o < x->cp; ++o) { /* what we need from every other rank */
        const int64_t before = recv.n;
        if (!emit_owned(x, ivbuf, n_iv, o, x->rank, 0, &recv)) goto oom;
        pw->recv_counts.data[o] = (int32_t)(recv.n - before);
    }
    pw->send_idx = vec_take(&send);
    pw->recv_pos = vec_take(&recv);
    /* ret_off / ret_idx: for each local row, the positions in send_idx (so in the gradients other
     * ranks return) of its copies, ascending (rank order): a counting sort by row. */
    NCP_TRY(alloc_array(&pw->ret_off, (int64_t)L + 1));
    NCP_TRY(alloc_array(&pw->ret_idx, pw->send_idx.n));
    for (int32_t j = 0; j < pw->send_idx.n; ++j) pw->ret_off.data[pw->send_idx.data[j] + 1]++;
    for (int32_t i = 0; i < L; ++i) pw->ret_off.data[i + 1] += pw->ret_off.data[i];
    for (int32_t j = 0; j < pw->send_idx.n; ++j) pw->ret_idx.data[pw->ret_off.data[pw->send_idx.data[j]]++] = j;
    for (int32_t i = L; i > 0; --i) pw->ret_off.data[i] = pw->ret_off.data[i - 1]; /* undo the fill's shift */
    pw->ret_off.data[0] = 0;

    /* K/V buffer: local and received rows sorted by global position. */
    const int32_t R = pw->recv_pos.n, Lkv = L + R;
    NCP_TRY(alloc_array(&pw->kv_pos, Lkv));
    NCP_TRY(alloc_array(&pw->kv_src, Lkv));
    NCP_TRY(alloc_array(&pw->local_slot, L));
    NCP_TRY(alloc_array(&pw->recv_slot, R));
    /* The buffer's positions are the union of this rank's needed intervals (ivbuf, sorted, local
     * keys included) followed by the local pad rows: walk them in order, O(L + R), and give each
     * position its source (a local row, or the next row received from its owner). */
    int32_t *cnt = mark; /* per-source running index into recv */
    for (int32_t o = 0, base = 0; o < x->cp; ++o) {
        cnt[o] = base;
        base += pw->recv_counts.data[o];
    }
    int64_t j = 0;
    for (int64_t k = 0; k < n_iv; ++k)
        for (int64_t p = ivbuf[k].a; p < ivbuf[k].b && j < Lkv; ++p, ++j) {
            const int32_t c = (int32_t)(p / x->chunk), o = x->owner[c];
            const int32_t src = o == x->rank ? x->chunk_slot[c] * x->chunk + (int32_t)(p - (int64_t)c * x->chunk)
                                             : L + cnt[o]++;
            pw->kv_pos.data[j] = (int32_t)p;
            pw->kv_src.data[j] = src;
            if (src < L) pw->local_slot.data[src] = (int32_t)j;
            else pw->recv_slot.data[src - L] = (int32_t)j;
        }
    for (int32_t i = 0; i < L && j < Lkv; ++i) /* pad rows: positions past T, never seen, at the end */
        if (local_pos[i] >= x->T) {
            pw->kv_pos.data[j] = local_pos[i];
            pw->kv_src.data[j] = i;
            pw->local_slot.data[i] = (int32_t)j++;
        }
    NCP_CHECK(j == Lkv, NCP_ERR_INVALID_ARG, "plan: %lld buffer slots for %d rows", (long long)j, (int)Lkv);

    /* Per query: first visible position and its buffer range [row_lo, row_hi] (NCP_MASK_TABLE).
     * Local rows ascend in position, so both bounds are non-decreasing; pad rows (positions past
     * T, last in local order) see nothing: row_lo = Lkv and row_hi = the last real row's, which
     * keeps both non-decreasing and a tile's key range ending at its last real row's keys. */
    NCP_TRY(alloc_array(&pw->q_lo, L));
    NCP_TRY(alloc_array(&pw->row_lo, L));
    NCP_TRY(alloc_array(&pw->row_hi, L));
    int32_t doc = 0, j_lo = 0, j_hi = 0;
    pw->visible_pairs = 0;
    for (int32_t i = 0; i < L; ++i) {
        const int64_t p = local_pos[i];
        if (p >= x->T) {
            pw->q_lo.data[i] = INT32_MAX;
            pw->row_lo.data[i] = Lkv;
            pw->row_hi.data[i] = j_hi - 1;
            continue;
        }
        int64_t lo = doc_start(x, p, &doc);
        if (w > 0 && p - w + 1 > lo) lo = p - w + 1;
        pw->q_lo.data[i] = (int32_t)lo;
        while (j_lo < Lkv && pw->kv_pos.data[j_lo] < lo) ++j_lo;
        while (j_hi < Lkv && pw->kv_pos.data[j_hi] <= p) ++j_hi;
        pw->row_lo.data[i] = j_lo;
        pw->row_hi.data[i] = j_hi - 1;
        pw->visible_pairs += j_hi - j_lo;
    }
    return NCP_OK;
oom:
    free(send.data);
    free(recv.data);
    NCP_FAIL(NCP_ERR_NOMEM, "out of host memory building a Flint plan");
}

static ncp_status check_plan_args(const int32_t *cu, int32_t n_cu, int32_t cp_size, int32_t cp_rank,
                                  const int32_t *windows, int32_t n_windows) {
    NCP_ARG_CHECK(cu != NULL && n_cu >= 2, "cu_seqlens must hold at least one document ([documents + 1] entries)");
    NCP_ARG_CHECK(cu[0] == 0, "cu_seqlens must start at 0; got %" PRId32, cu[0]);
    for (int32_t i = 1; i < n_cu; ++i)
        NCP_ARG_CHECK(cu[i] > cu[i - 1], "cu_seqlens must be strictly increasing; cu_seqlens[%" PRId32 "]=%" PRId32
                      " <= cu_seqlens[%" PRId32 "]=%" PRId32, i, cu[i], i - 1, cu[i - 1]);
    NCP_ARG_CHECK(cp_size >= 1, "cp_size must be >= 1; got %" PRId32, cp_size);
    NCP_ARG_CHECK(cp_rank >= 0 && cp_rank < cp_size, "cp_rank must be in [0, %" PRId32 "); got %" PRId32, cp_size, cp_rank);
    NCP_ARG_CHECK(windows != NULL && n_windows >= 1, "at least one window is required");
    for (int32_t i = 0; i < n_windows; ++i) {
        NCP_ARG_CHECK(windows[i] >= 0, "windows must be >= 0; got %" PRId32, windows[i]);
        for (int32_t k = 0; k < i; ++k) NCP_ARG_CHECK(windows[k] != windows[i], "windows must be distinct");
    }
    return NCP_OK;
}

ncp_status ncp_plan_build(const int32_t *cu, int32_t n_cu, int32_t cp_size, int32_t cp_rank, int32_t requested_chunk,
                          int32_t min_chunks_per_rank, const int32_t *windows, int32_t n_windows, ncp_plan *plan) {
    NCP_ARG_CHECK(plan != NULL, "plan must not be NULL");
    memset(plan, 0, sizeof *plan);
    NCP_TRY(check_plan_args(cu, n_cu, cp_size, cp_rank, windows, n_windows));
    plan_ctx x = {cu, n_cu, cp_size, cp_rank, 0, 0, cu[n_cu - 1], 0, NULL, NULL};
    NCP_TRY(ncp_magi_geometry(x.T, cp_size, requested_chunk, min_chunks_per_rank, &x.chunk, &x.T_pad));
    x.n_chunks = (int32_t)(x.T_pad / x.chunk);
    plan->total = x.T;
    plan->total_padded = x.T_pad;
    plan->chunk_size = x.chunk;
    plan->n_chunks = x.n_chunks;
    plan->cp_size = cp_size;
    plan->cp_rank = cp_rank;
    ncp_status st = alloc_array(&plan->owner, x.n_chunks);
    int32_t *slots = (int32_t *)malloc((size_t)x.n_chunks * sizeof(int32_t));
    int32_t *mark = (int32_t *)malloc((size_t)(cp_size > x.n_chunks ? cp_size : x.n_chunks) * sizeof(int32_t));
    ival *ivbuf = (ival *)malloc((size_t)(x.n_chunks + n_cu + 1) * sizeof(ival));
    plan->windows = (ncp_plan_window *)calloc((size_t)n_windows, sizeof(ncp_plan_window));
    if (st == NCP_OK && (!slots || !mark || !ivbuf || !plan->windows))
        st = ncp_set_error(NCP_ERR_NOMEM, NULL, 0, NULL, NULL, "out of host memory building a Flint plan");
    if (st == NCP_OK) st = ncp_magi_dispatch(cu, n_cu, cp_size, x.chunk, x.T_pad, plan->owner.data);
    if (st == NCP_OK) {
        x.owner = plan->owner.data;
        x.chunk_slot = slots;
        int32_t *count = mark; /* scratch: per-rank chunk counter */
        memset(count, 0, (size_t)cp_size * sizeof(int32_t));
        for (int32_t c = 0; c < x.n_chunks; ++c) slots[c] = count[x.owner[c]]++;
        const int32_t L = (int32_t)(x.T_pad / cp_size);
        st = alloc_array(&plan->local_pos, L);
        for (int32_t c = 0, i = 0; st == NCP_OK && c < x.n_chunks; ++c)
            if (x.owner[c] == cp_rank)
                for (int32_t k = 0; k < x.chunk; ++k) plan->local_pos.data[i++] = c * x.chunk + k;
        plan->n_windows = n_windows;
        for (int32_t wi = 0; st == NCP_OK && wi < n_windows; ++wi)
            st = build_window(&x, plan->local_pos.data, L, windows[wi], ivbuf, mark, &plan->windows[wi]);
    }
    free(slots);
    free(mark);
    free(ivbuf);
    if (st != NCP_OK) ncp_plan_free(plan);
    return st;
}

static void free_array(ncp_i32_array *a) {
    free(a->data);
    a->data = NULL;
    a->n = 0;
}

void ncp_plan_free(ncp_plan *plan) {
    if (plan == NULL) return;
    free_array(&plan->owner);
    free_array(&plan->local_pos);
    for (int32_t w = 0; plan->windows != NULL && w < plan->n_windows; ++w) {
        ncp_plan_window *pw = &plan->windows[w];
        ncp_i32_array *arrays[] = {&pw->send_counts, &pw->recv_counts, &pw->send_idx, &pw->recv_pos,
                                   &pw->kv_pos,      &pw->kv_src,      &pw->local_slot, &pw->recv_slot,
                                   &pw->q_lo,        &pw->row_lo,      &pw->row_hi,   &pw->ret_off,
                                   &pw->ret_idx};
        for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; ++i) free_array(arrays[i]);
    }
    free(plan->windows);
    memset(plan, 0, sizeof *plan);
}
