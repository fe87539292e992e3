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
 * (NCP_MASK_TABLE).
 *
 * Every table is piecewise arithmetic: chunks are runs of consecutive positions, and inside a
 * piece of a chunk that lies in one document the bounds move by 0 or 1 per row. So the plan is
 * built as runs (ncp_run, a few per chunk piece) in time that grows with chunks x ranks and with
 * documents, not with tokens; ncp_runs_expand (here) or its CUDA twin (cuda/cp_exchange.cu) writes
 * the tables out where they are used. Test: pytest tests/test_flint_plan.py
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "ncp/ncp.h"
#include "ncp/ncp_check.h"

/* ---------------------------------------------------------------------------------------------
 * runs
 * ------------------------------------------------------------------------------------------- */

ncp_status ncp_runs_check(const ncp_run *runs, int32_t n_runs, int64_t n_out) {
    NCP_ARG_CHECK(n_runs >= 0 && (n_runs == 0 || runs != NULL), "runs: %" PRId32 " runs without data", n_runs);
    NCP_ARG_CHECK(n_out >= 0, "out: %" PRId64 " entries", n_out);
    for (int32_t i = 0; i < n_runs; ++i) {
        const ncp_run r = runs[i];
        NCP_ARG_CHECK(r.len >= 0, "runs[%" PRId32 "] has len=%" PRId32 " < 0", i, r.len);
        if (r.len == 0) continue;
        const int64_t last_out = (int64_t)r.out + (int64_t)(r.len - 1) * r.stride;
        const int64_t last_val = (int64_t)r.val + (int64_t)(r.len - 1) * r.step;
        NCP_ARG_CHECK(r.stride >= 1 && r.out >= 0 && last_out < n_out,
                      "runs[%" PRId32 "] (out=%" PRId32 ", len=%" PRId32 ", stride=%" PRId32
                      ") writes outside a table of %" PRId64 " entries",
                      i, r.out, r.len, r.stride, n_out);
        NCP_ARG_CHECK(last_val >= INT32_MIN && last_val <= INT32_MAX,
                      "runs[%" PRId32 "] (val=%" PRId32 ", len=%" PRId32 ", step=%" PRId32 ") leaves int32", i, r.val,
                      r.len, r.step);
    }
    return NCP_OK;
}

ncp_status ncp_runs_expand(const ncp_run *runs, int32_t n_runs, int32_t *out, int64_t n_out) {
    NCP_ARG_CHECK(out != NULL || n_out == 0, "out must not be NULL");
    NCP_TRY(ncp_runs_check(runs, n_runs, n_out));
    for (int32_t i = 0; i < n_runs; ++i) {
        const ncp_run r = runs[i];
        int32_t *o = out + r.out;
        /* in int64: val + t * step is checked to fit int32, t * step alone need not */
        if (r.stride == 1) {
            for (int32_t t = 0; t < r.len; ++t) o[t] = (int32_t)((int64_t)r.val + (int64_t)t * r.step);
        } else {
            for (int32_t t = 0; t < r.len; ++t) o[(int64_t)t * r.stride] = (int32_t)((int64_t)r.val + (int64_t)t * r.step);
        }
    }
    return NCP_OK;
}

typedef struct {
    ncp_run *data;
    int32_t n, cap;
    int32_t floor; /* runs below this index are closed: nothing merges into them */
    int failed;    /* out of memory */
} runvec;

/* Appends a run, or extends the last one when the new run continues it. */
static void run_push(runvec *v, int64_t out, int64_t len, int32_t stride, int64_t val, int32_t step) {
    if (len <= 0 || v->failed) return;
    if (v->n > v->floor) {
        ncp_run *l = &v->data[v->n - 1];
        if (l->stride == stride && l->step == step && (int64_t)l->out + (int64_t)l->len * stride == out &&
            (int64_t)l->val + (int64_t)l->len * step == val && (int64_t)l->len + len <= INT32_MAX) {
            l->len += (int32_t)len;
            return;
        }
    }
    if (v->n == v->cap) {
        const int32_t cap = v->cap ? v->cap * 2 : 64;
        ncp_run *d = (ncp_run *)realloc(v->data, (size_t)cap * sizeof(ncp_run));
        if (d == NULL) {
            v->failed = 1;
            return;
        }
        v->data = d;
        v->cap = cap;
    }
    v->data[v->n++] = (ncp_run){(int32_t)out, (int32_t)len, stride, (int32_t)val, step};
}

static ncp_status oom(void) {
    return ncp_set_error(NCP_ERR_NOMEM, NULL, 0, NULL, NULL, "out of host memory building a Flint plan");
}

static int cmp_i32(const void *a, const void *b) {
    const int32_t u = *(const int32_t *)a, v = *(const int32_t *)b;
    return (u > v) - (u < v);
}

/* ---------------------------------------------------------------------------------------------
 * one window
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    int64_t a, b; /* [a, b) */
} ival;

/* Shared facts of one plan build. */
typedef struct {
    const int32_t *cu;
    int32_t n_cu, cp, rank, chunk, n_chunks, L;
    int64_t T, T_pad;
    const int32_t *owner;
    const int32_t *chunk_slot; /* chunk -> index among its owner's chunks */
    const int32_t *by_owner;   /* the chunks grouped by owner, ascending within each */
    const int32_t *owner_first; /* (cp + 1,) rank r's chunks: by_owner[owner_first[r] .. owner_first[r + 1]) */
    ival *iv;                  /* scratch: needed intervals */
    int32_t *scratch;          /* (cp + 1,) */
} plan_ctx;

/* The runs of one window while they are built: one list per table, and the send runs again in
 * local-row space grouped by destination (for the returned-rows tables). */
typedef struct {
    runvec t[NCP_PT_COUNT];
    runvec send_rows;
    int32_t *send_first; /* (cp + 1,) first send_rows run of each destination */
    int64_t len[NCP_PT_COUNT];
} window_runs;

/* Needed key intervals of `receiver` for window w, merged and sorted (self-owned keys included). */
static int64_t needed_intervals(const plan_ctx *x, int32_t receiver, int32_t w, ival *out) {
    int64_t n = 0;
    int32_t doc = 0;
    for (int32_t j = x->owner_first[receiver]; j < x->owner_first[receiver + 1]; ++j) {
        const int32_t c = x->by_owner[j];
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

/* The pieces of the intervals cut at chunk edges: [p, e) inside chunk c. */
typedef struct {
    const ival *iv;
    int64_t n, k, p;
    int32_t chunk;
} piece_iter;

static int next_piece(piece_iter *it, int64_t *p, int64_t *e, int32_t *c) {
    while (it->k < it->n && it->p >= it->iv[it->k].b)
        if (++it->k < it->n) it->p = it->iv[it->k].a;
    if (it->k >= it->n) return 0;
    *p = it->p;
    *c = (int32_t)(*p / it->chunk);
    const int64_t ce = (int64_t)(*c + 1) * it->chunk, b = it->iv[it->k].b;
    *e = b < ce ? b : ce;
    it->p = *e;
    return 1;
}

static piece_iter pieces(const ival *iv, int64_t n, int32_t chunk) {
    piece_iter it = {iv, n, 0, n > 0 ? iv[0].a : 0, chunk};
    return it;
}

/* The same pieces restricted to the chunks of one owner (ascending), in the same order: a walk
 * over that owner's chunks and the intervals together, not over every piece. */
typedef struct {
    const ival *iv;
    int64_t n, k;
    const int32_t *ch;
    int32_t m, j, chunk;
} owned_iter;

static int next_owned(owned_iter *it, int64_t *p, int64_t *e, int32_t *c) {
    while (it->j < it->m) {
        const int32_t cc = it->ch[it->j];
        const int64_t ca = (int64_t)cc * it->chunk, cb = ca + it->chunk;
        while (it->k < it->n && it->iv[it->k].b <= ca) ++it->k;
        if (it->k < it->n && it->iv[it->k].a < cb) {
            const ival v = it->iv[it->k];
            *p = v.a > ca ? v.a : ca;
            *e = v.b < cb ? v.b : cb;
            *c = cc;
            if (v.b <= cb) ++it->k; /* the next interval may start in this chunk too */
            else ++it->j;
            return 1;
        }
        ++it->j;
    }
    return 0;
}

static owned_iter owned_pieces(const plan_ctx *x, const ival *iv, int64_t n, int32_t owner) {
    owned_iter it = {iv, n, 0, x->by_owner + x->owner_first[owner], x->owner_first[owner + 1] - x->owner_first[owner],
                     0, x->chunk};
    return it;
}

/* The pad rows (positions T .. T_pad - 1, nobody's keys, seeing nothing) of chunk c when this rank
 * owns it: [*a, *b); 0 when there are none. */
static int pad_rows(const plan_ctx *x, int32_t c, int64_t *a, int64_t *b) {
    const int64_t a0 = (int64_t)c * x->chunk;
    *b = a0 + x->chunk;
    *a = a0 > x->T ? a0 : x->T;
    return x->owner[c] == x->rank && *a < *b;
}

/* Local row of position p of chunk c (owned by this rank). */
static inline int64_t local_row(const plan_ctx *x, int32_t c, int64_t p) {
    return (int64_t)x->chunk_slot[c] * x->chunk + (p - (int64_t)c * x->chunk);
}

/* Buffer slot of a real position p that the buffer holds (kv_pos runs ascend in position). */
static int64_t slot_of(const runvec *kv, int64_t p) {
    int32_t lo = 0, hi = kv->n - 1;
    while (lo < hi) { /* last run with val <= p */
        const int32_t mid = (lo + hi + 1) / 2;
        if (kv->data[mid].val <= p) lo = mid;
        else hi = mid - 1;
    }
    return kv->data[lo].out + (p - kv->data[lo].val);
}

/* send_idx / recv_pos and their counts: what every other rank needs from us, what we need. */
static void exchange_runs(const plan_ctx *x, int32_t w, window_runs *r, ncp_plan_window *pw, int64_t *n_self_iv) {
    int64_t S = 0, R = 0;
    for (int32_t d = 0; d < x->cp; ++d) {
        r->send_first[d] = r->send_rows.n;
        r->send_rows.floor = r->send_rows.n;
        if (d == x->rank) continue;
        const int64_t before = S;
        owned_iter it = owned_pieces(x, x->iv, needed_intervals(x, d, w, x->iv), x->rank);
        int64_t p, e;
        int32_t c;
        while (next_owned(&it, &p, &e, &c)) {
            run_push(&r->t[NCP_PT_SEND_IDX], S, e - p, 1, local_row(x, c, p), 1);
            run_push(&r->send_rows, local_row(x, c, p), e - p, 1, S, 1);
            S += e - p;
        }
        pw->send_counts.data[d] = (int32_t)(S - before);
    }
    r->send_first[x->cp] = r->send_rows.n;
    *n_self_iv = needed_intervals(x, x->rank, w, x->iv);
    for (int32_t o = 0; o < x->cp; ++o) {
        if (o == x->rank) continue;
        const int64_t before = R;
        owned_iter it = owned_pieces(x, x->iv, *n_self_iv, o);
        int64_t p, e;
        int32_t c;
        while (next_owned(&it, &p, &e, &c)) {
            run_push(&r->t[NCP_PT_RECV_POS], R, e - p, 1, p, 1);
            R += e - p;
        }
        pw->recv_counts.data[o] = (int32_t)(R - before);
    }
    const int64_t L = x->L;
    const int64_t lens[NCP_PT_COUNT] = {S, R, L + R, L + R, L, R, L, L, L, L + 1, S};
    memcpy(r->len, lens, sizeof lens);
}

/* The K/V buffer: this rank's needed positions in order (local rows and received ones), then the
 * local pad rows (positions past T, never seen). */
static void buffer_runs(const plan_ctx *x, window_runs *r, int64_t n_self_iv, const ncp_plan_window *pw) {
    int32_t *next = x->scratch; /* per source: its next row in the received block */
    for (int32_t o = 0, base = 0; o < x->cp; ++o) {
        next[o] = base;
        base += pw->recv_counts.data[o];
    }
    int64_t j = 0;
    piece_iter it = pieces(x->iv, n_self_iv, x->chunk);
    int64_t p, e;
    int32_t c;
    while (next_piece(&it, &p, &e, &c)) {
        const int64_t n = e - p;
        run_push(&r->t[NCP_PT_KV_POS], j, n, 1, p, 1);
        if (x->owner[c] == x->rank) {
            const int64_t i = local_row(x, c, p);
            run_push(&r->t[NCP_PT_KV_SRC], j, n, 1, i, 1);
            run_push(&r->t[NCP_PT_LOCAL_SLOT], i, n, 1, j, 1);
        } else {
            const int64_t i = next[x->owner[c]];
            next[x->owner[c]] += (int32_t)n;
            run_push(&r->t[NCP_PT_KV_SRC], j, n, 1, x->L + i, 1);
            run_push(&r->t[NCP_PT_RECV_SLOT], i, n, 1, j, 1);
        }
        j += n;
    }
    for (int32_t cc = (int32_t)(x->T / x->chunk); cc < x->n_chunks; ++cc) {
        int64_t a, b;
        if (!pad_rows(x, cc, &a, &b)) continue;
        const int64_t i = local_row(x, cc, a);
        run_push(&r->t[NCP_PT_KV_POS], j, b - a, 1, a, 1);
        run_push(&r->t[NCP_PT_KV_SRC], j, b - a, 1, i, 1);
        run_push(&r->t[NCP_PT_LOCAL_SLOT], i, b - a, 1, j, 1);
        j += b - a;
    }
}

/* Per local query: q_lo, row_lo, row_hi, and the visible pairs. Inside a piece of a chunk in one
 * document, row_hi moves by 1 per row and lo(p) (so q_lo and row_lo) by 0 before p = ds + w - 1
 * and by 1 from there: every key in [lo, p] is in the buffer, in consecutive slots. */
static void query_runs(const plan_ctx *x, int32_t w, window_runs *r, const runvec *kv_real, ncp_plan_window *pw) {
    const int64_t Lkv = r->len[NCP_PT_KV_POS];
    int64_t last_hi = -1;
    int32_t doc = 0;
    pw->visible_pairs = 0;
    for (int32_t j = x->owner_first[x->rank]; j < x->owner_first[x->rank + 1]; ++j) {
        const int32_t c = x->by_owner[j];
        const int64_t a = (int64_t)c * x->chunk, b0 = a + x->chunk, b = b0 < x->T ? b0 : x->T;
        for (int64_t p = a; p < b;) {
            while (doc < x->n_cu - 2 && x->cu[doc + 1] <= p) ++doc;
            const int64_t ds = x->cu[doc], de = x->cu[doc + 1] < b ? x->cu[doc + 1] : b;
            const int64_t split = w > 0 ? ds + w - 1 : de; /* from here lo = p - w + 1 */
            const int64_t e = p < split ? (split < de ? split : de) : de;
            const int32_t step = p < split ? 0 : 1;
            const int64_t n = e - p, lo = step ? p - w + 1 : ds;
            const int64_t i = local_row(x, c, p), hi0 = slot_of(kv_real, p), lo0 = slot_of(kv_real, lo);
            run_push(&r->t[NCP_PT_Q_LO], i, n, 1, lo, step);
            run_push(&r->t[NCP_PT_ROW_LO], i, n, 1, lo0, step);
            run_push(&r->t[NCP_PT_ROW_HI], i, n, 1, hi0, 1);
            pw->visible_pairs += n * (hi0 - lo0 + 1) + (1 - step) * n * (n - 1) / 2;
            last_hi = hi0 + n - 1;
            p = e;
        }
    }
    for (int32_t c = (int32_t)(x->T / x->chunk); c < x->n_chunks; ++c) { /* both bounds stay monotone */
        int64_t a, b;
        if (!pad_rows(x, c, &a, &b)) continue;
        const int64_t i = local_row(x, c, a);
        run_push(&r->t[NCP_PT_Q_LO], i, b - a, 1, INT32_MAX, 0);
        run_push(&r->t[NCP_PT_ROW_LO], i, b - a, 1, Lkv, 0);
        run_push(&r->t[NCP_PT_ROW_HI], i, b - a, 1, last_hi, 0);
    }
}

/* ret_off / ret_idx: each local row's copies in send_idx, in rank order. The send runs of all
 * destinations cut the local rows into segments with one set of copies each: a segment is one
 * ret_off run (step = its number of copies k) and one ret_idx run of stride k per copy. */
static ncp_status return_runs(const plan_ctx *x, window_runs *r) {
    const runvec *s = &r->send_rows;
    int32_t *cuts = (int32_t *)malloc((size_t)(2 * (int64_t)s->n + 2) * sizeof(int32_t));
    if (cuts == NULL) return oom();
    int32_t n = 0;
    cuts[n++] = 0;
    cuts[n++] = x->L;
    for (int32_t i = 0; i < s->n; ++i) {
        cuts[n++] = s->data[i].out;
        cuts[n++] = s->data[i].out + s->data[i].len;
    }
    qsort(cuts, (size_t)n, sizeof(int32_t), cmp_i32);
    int32_t *ptr = x->scratch; /* per destination: its first send run not yet passed */
    for (int32_t d = 0; d < x->cp; ++d) ptr[d] = r->send_first[d];
    int64_t off = 0;
    for (int32_t i = 0; i + 1 < n; ++i) {
        const int32_t a = cuts[i], b = cuts[i + 1];
        if (a == b) continue;
        int32_t k = 0;
        for (int32_t d = 0; d < x->cp; ++d) {
            while (ptr[d] < r->send_first[d + 1] && s->data[ptr[d]].out + s->data[ptr[d]].len <= a) ++ptr[d];
            k += ptr[d] < r->send_first[d + 1] && s->data[ptr[d]].out <= a;
        }
        run_push(&r->t[NCP_PT_RET_OFF], a, b - a, 1, off, k);
        for (int32_t d = 0, m = 0; d < x->cp; ++d)
            if (ptr[d] < r->send_first[d + 1] && s->data[ptr[d]].out <= a) {
                const ncp_run *sr = &s->data[ptr[d]];
                run_push(&r->t[NCP_PT_RET_IDX], off + m++, b - a, k, (int64_t)sr->val + (a - sr->out), 1);
            }
        off += (int64_t)k * (b - a);
    }
    run_push(&r->t[NCP_PT_RET_OFF], x->L, 1, 1, off, 0);
    free(cuts);
    return NCP_OK;
}

static ncp_status alloc_array(ncp_i32_array *a, int64_t n) {
    a->n = (int32_t)n;
    a->data = (int32_t *)calloc((size_t)(n > 0 ? n : 1), sizeof(int32_t));
    if (a->data == NULL) return oom();
    return NCP_OK;
}

/* The runs of every table of one window, concatenated with table offsets. */
static ncp_status build_window(const plan_ctx *x, int32_t w, ncp_plan_window *pw) {
    pw->window = w;
    NCP_TRY(alloc_array(&pw->send_counts, x->cp));
    NCP_TRY(alloc_array(&pw->recv_counts, x->cp));
    window_runs r;
    memset(&r, 0, sizeof r);
    ncp_status st = NCP_OK;
    r.send_first = (int32_t *)malloc((size_t)(x->cp + 1) * sizeof(int32_t));
    if (r.send_first == NULL) st = oom();
    int64_t n_self_iv = 0;
    if (st == NCP_OK) {
        exchange_runs(x, w, &r, pw, &n_self_iv);
        buffer_runs(x, &r, n_self_iv, pw);
        /* real positions only for slot lookups: the pad runs come last */
        runvec kv_real = r.t[NCP_PT_KV_POS];
        while (kv_real.n > 0 && kv_real.data[kv_real.n - 1].val >= x->T) --kv_real.n;
        query_runs(x, w, &r, &kv_real, pw);
        st = return_runs(x, &r);
    }
    int64_t total = 0, n_runs = 0;
    for (int t = 0; t < NCP_PT_COUNT; ++t) {
        pw->table_off[t] = total;
        total += r.len[t];
        n_runs += r.t[t].n;
        if (r.t[t].failed && st == NCP_OK) st = oom();
    }
    pw->table_off[NCP_PT_COUNT] = total;
    if (st == NCP_OK && r.send_rows.failed) st = oom();
    if (st == NCP_OK && (total > INT32_MAX || n_runs > INT32_MAX))
        st = ncp_set_error(NCP_ERR_INVALID_ARG, NULL, 0, NULL, NULL,
                           "cu_seqlens: this pack's plan tables (%" PRId64 " entries) must fit in int32", total);
    if (st == NCP_OK) {
        pw->runs = (ncp_run *)malloc((size_t)(n_runs > 0 ? n_runs : 1) * sizeof(ncp_run));
        if (pw->runs == NULL) st = oom();
    }
    if (st == NCP_OK) {
        int32_t k = 0;
        for (int t = 0; t < NCP_PT_COUNT; ++t)
            for (int32_t i = 0; i < r.t[t].n; ++i) {
                pw->runs[k] = r.t[t].data[i];
                pw->runs[k++].out += (int32_t)pw->table_off[t];
            }
        pw->n_runs = k;
    }
    for (int t = 0; t < NCP_PT_COUNT; ++t) free(r.t[t].data);
    free(r.send_rows.data);
    free(r.send_first);
    return st;
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
    plan_ctx x;
    memset(&x, 0, sizeof x);
    x.cu = cu, x.n_cu = n_cu, x.cp = cp_size, x.rank = cp_rank, x.T = cu[n_cu - 1];
    NCP_TRY(ncp_magi_geometry(x.T, cp_size, requested_chunk, min_chunks_per_rank, &x.chunk, &x.T_pad));
    /* refused before anything is allocated: the partition's tables hold one entry per chunk */
    NCP_ARG_CHECK(x.T_pad / x.chunk <= NCP_PLAN_MAX_CHUNKS,
                  "cu_seqlens: a pack of %" PRId64 " tokens in chunks of %" PRId32 " needs %" PRId64
                  " chunks; at most %d are supported (raise config.magi_chunk_size)",
                  x.T, x.chunk, x.T_pad / x.chunk, NCP_PLAN_MAX_CHUNKS);
    x.n_chunks = (int32_t)(x.T_pad / x.chunk);
    x.L = (int32_t)(x.T_pad / cp_size);
    plan->total = x.T;
    plan->total_padded = x.T_pad;
    plan->chunk_size = x.chunk;
    plan->n_chunks = x.n_chunks;
    plan->cp_size = cp_size;
    plan->cp_rank = cp_rank;
    ncp_status st = alloc_array(&plan->owner, x.n_chunks);
    int32_t *slots = (int32_t *)malloc((size_t)x.n_chunks * sizeof(int32_t));
    int32_t *by_owner = (int32_t *)malloc((size_t)x.n_chunks * sizeof(int32_t));
    int32_t *owner_first = (int32_t *)malloc((size_t)(cp_size + 1) * sizeof(int32_t));
    x.scratch = (int32_t *)malloc((size_t)(cp_size + 1) * sizeof(int32_t));
    x.iv = (ival *)malloc((size_t)(x.n_chunks + n_cu + 1) * sizeof(ival));
    plan->windows = (ncp_plan_window *)calloc((size_t)n_windows, sizeof(ncp_plan_window));
    runvec local = {0};
    if (st == NCP_OK && (!slots || !by_owner || !owner_first || !x.scratch || !x.iv || !plan->windows))
        st = oom();
    if (st == NCP_OK) st = ncp_magi_dispatch(cu, n_cu, cp_size, x.chunk, x.T_pad, plan->owner.data);
    if (st == NCP_OK) {
        x.owner = plan->owner.data;
        x.chunk_slot = slots;
        memset(x.scratch, 0, (size_t)cp_size * sizeof(int32_t)); /* per-rank chunk counter */
        for (int32_t c = 0; c < x.n_chunks; ++c) slots[c] = x.scratch[x.owner[c]]++;
        owner_first[0] = 0; /* the chunks grouped by owner: a counting sort, ascending within each */
        for (int32_t r = 0; r < cp_size; ++r) owner_first[r + 1] = owner_first[r] + x.scratch[r];
        for (int32_t c = 0; c < x.n_chunks; ++c) by_owner[owner_first[x.owner[c]] + slots[c]] = c;
        x.by_owner = by_owner;
        x.owner_first = owner_first;
        for (int32_t j = owner_first[cp_rank]; j < owner_first[cp_rank + 1]; ++j)
            run_push(&local, (int64_t)(j - owner_first[cp_rank]) * x.chunk, x.chunk, 1, (int64_t)by_owner[j] * x.chunk, 1);
        if (local.failed) st = oom();
        plan->local_runs = local.data;
        plan->n_local_runs = local.n;
        plan->n_windows = n_windows;
        for (int32_t wi = 0; st == NCP_OK && wi < n_windows; ++wi) st = build_window(&x, windows[wi], &plan->windows[wi]);
    }
    free(slots);
    free(by_owner);
    free(owner_first);
    free(x.scratch);
    free(x.iv);
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
    free(plan->local_runs);
    for (int32_t w = 0; plan->windows != NULL && w < plan->n_windows; ++w) {
        free_array(&plan->windows[w].send_counts);
        free_array(&plan->windows[w].recv_counts);
        free(plan->windows[w].runs);
    }
    free(plan->windows);
    memset(plan, 0, sizeof *plan);
}
