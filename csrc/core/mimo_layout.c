/*
 * mimo_layout.c: the host half of shard_batch_for_mimo_te, for every pipeline chunk at once.
 *
 * All partition metadata derives from the small seq_lens / seq_lens_padded rows. The reference
 * computes it with ~10 blocking device syncs per chunk (spec mimo_te.md 4, 7.3-7.8); we bring the
 * rows to the host once and do all of it here:
 *   - MiMo's validation of padded lengths (W > 1), chunk by chunk, with the reference's messages;
 *   - process_input_for_thd: sentinel filtering, real and padded cu_seqlens (int32 after an int64
 *     cumsum), the absorption rule, max_seqlen, and whether cu_seqlens_padded is emitted;
 *   - the framework's THD view at W > 1: cu_seqlens = the padded rows, max_seqlen = the max padded
 *     length, rows right-padded with -1000 to the widest chunk (pad_and_stack);
 *   - the tables the shard kernel reads: TE partition boundaries, padding-mask starts and reals.
 *
 * Output: buf[0, kernel_words) is the kernel table (see thd_layout.h), followed by the int32
 * outputs, each a contiguous row-major block whose word offset is reported in ncp_mimo_layout_info.
 *
 * Also here: ncp_mimo_plan_make, the carving of the one flat output buffer of a sharder call
 * (token outputs, masks, layout block), a pure function of the shapes that Python caches.
 *
 * Wraparound: the reference's int64 cumsum and int32 casts wrap on absurd length tables (values
 * near 2^31 or 2^63); we reproduce that with the explicit helpers of thd_layout.h (two's
 * complement, mod 2^32 / 2^64), so the result is defined without -fwrapv.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ncp/ncp.h"
#include "ncp/ncp_check.h"
#include "thd_layout.h"

/* Per-chunk facts gathered in the first pass. */
typedef struct {
    int64_t n_real, n_pad;   /* entries left after dropping sentinels */
    int32_t emitted;         /* cu_seqlens_padded differs from cu_seqlens */
    int32_t max_real, max_pad;
    int32_t *cu_real;        /* (n_real + 1,) after absorption */
    int32_t *row;            /* (n_pad + 1,) or cu_real: the padded view the framework keeps */
    int64_t row_len;
} mimo_chunk;

static int64_t words_for_i32(int64_t n) { return (n + 1) / 2; }

int64_t ncp_mimo_layout_words(int64_t B, int64_t n_real, int64_t n_pad, int32_t num_chunks) {
    if (B < 0 || n_real < 0 || n_pad < 0 || num_chunks <= 0) return 0;
    int64_t C = num_chunks, rpc = B / C;
    int64_t dr = rpc * n_real, dp = rpc * n_pad;
    int64_t width = (dr > dp ? dr : dp) + 1;
    int64_t words = 1 + NCP_MIMO_DESC * C;
    words += C * (words_for_i32(dp + 1) + (dp + 1) + (dr > 0 ? dr : 1));
    words += 2 * words_for_i32(C * width) + words_for_i32(C);
    return words + 4;
}

/* Appends "[a, b, c]" (Python list formatting) of n int32 values to the error message. */
static ncp_status fail_divisible(const int32_t *lens, int64_t n, int64_t divisor) {
    size_t cap = 64 + (size_t)n * 13;
    char *list = (char *)malloc(cap);
    if (list == NULL) NCP_FAIL(NCP_ERR_NOMEM, "out of host memory formatting an error message");
    size_t used = 0;
    list[used++] = '[';
    for (int64_t i = 0; i < n; ++i)
        used += (size_t)snprintf(list + used, cap - used, i ? ", %" PRId32 : "%" PRId32, lens[i]);
    snprintf(list + used, cap - used, "]");
    ncp_status st = ncp_set_error(NCP_ERR_INVALID_ARG, NULL, 0, NULL, NULL,
                                  "MiMo TE context parallelism requires every padded document length "
                                  "to be divisible by 2 * cp_size (%" PRId64 "); got %s",
                                  divisor, list);
    free(list);
    return st;
}

/* The sentinel as torch compares it with a table of dtype dt (`t != sentinel`): a Python int is cast
 * to the tensor's integer dtype, so an int32 table meets it wrapped modulo 2^32. */
static int64_t sentinel_in(ncp_dtype dt, int64_t sentinel) {
    return dt == NCP_DT_I64 ? sentinel : (int64_t)ncp_wrap_i32((uint32_t)(uint64_t)sentinel);
}

/* Copies the non-sentinel entries of rows [r0, r1) of a (B, ncol) int32/int64 table with element
 * strides (st0, st1), widened to int64; the comparison is torch's in the table's own dtype.
 * Branch-free (every entry is stored, the count advances past kept ones: sentinels may sit
 * anywhere in a row), one loop per dtype. `out` holds ncol * (r1 - r0) entries. */
static int64_t filter_rows(const void *tab, ncp_dtype dt, int64_t st0, int64_t st1, int64_t ncol, int64_t r0,
                           int64_t r1, int64_t sentinel, int64_t *out) {
    const int64_t s = sentinel_in(dt, sentinel);
    int64_t n = 0;
    if (dt == NCP_DT_I64) {
        const int64_t *t = (const int64_t *)tab;
        for (int64_t row = r0; row < r1; ++row)
            for (int64_t col = 0; col < ncol; ++col) {
                const int64_t v = t[row * st0 + col * st1];
                out[n] = v;
                n += v != s;
            }
    } else {
        const int32_t *t = (const int32_t *)tab;
        for (int64_t row = r0; row < r1; ++row)
            for (int64_t col = 0; col < ncol; ++col) {
                const int64_t v = t[row * st0 + col * st1];
                out[n] = v;
                n += v != s;
            }
    }
    return n;
}

/* MiMo's _chunk_partition_indices checks for one chunk; writes the int32 boundaries TE receives. */
static ncp_status mimo_validate_chunk(const int64_t *vals, int64_t n, int64_t tokens, int32_t W,
                                      int32_t *lens, int32_t *cu, int *exact) {
    int bad = (n == 0);
    int64_t sum = 0;
    for (int64_t i = 0; i < n; ++i) {
        lens[i] = ncp_wrap_i32((uint32_t)vals[i]); /* .to(torch.int32): the low 32 bits */
        bad |= lens[i] <= 0;
        sum += lens[i];
    }
    if (bad) NCP_FAIL(NCP_ERR_INVALID_ARG, "MiMo TE THD padded document lengths must be positive");
    if (sum != tokens)
        NCP_FAIL(NCP_ERR_INVALID_ARG,
                 "MiMo TE THD seq_lens_padded must cover each pipeline chunk: got %" PRId64 " slots for %" PRId64
                 " tokens",
                 sum, tokens);
    /* Every lens[i] is positive here and div = 2 W <= 2^32 - 2, so the remainder is the unsigned
     * 32-bit one (a 64-bit division per entry took a fifth of this pass); a mask when div is a
     * power of two (every cp size in practice). int64: 2 * W overflows int32 for W >= 2^30. */
    const int64_t div = 2 * (int64_t)W;
    const uint32_t d32 = (uint32_t)div;
    uint32_t rem = 0;
    if ((d32 & (d32 - 1)) == 0)
        for (int64_t i = 0; i < n; ++i) rem |= (uint32_t)lens[i] & (d32 - 1);
    else
        for (int64_t i = 0; i < n && rem == 0; ++i) rem = (uint32_t)lens[i] % d32;
    if (rem != 0) return fail_divisible(lens, n, div);
    cu[0] = 0;
    for (int64_t i = 0; i < n; ++i) cu[i + 1] = ncp_add_wrap_i32(cu[i], lens[i]); /* TE's int32 cumsum */
    /* The framework's int64 padding starts equal these boundaries when no value was cut to int32
     * (lens are then positive and sum to tokens, so the int32 cumsum cannot wrap either). */
    *exact = tokens <= INT32_MAX;
    for (int64_t i = 0; i < n && *exact; ++i) *exact = vals[i] == (int64_t)lens[i];
    return NCP_OK;
}

/* int64 cumsum from 0, each entry then cast to int32 (torch: cat([0], cumsum(v)).to(int32)).
 * Documented result on wrapping input: the cumsum wraps mod 2^64 and the cast keeps the low 32
 * bits, as torch does. */
static void cumsum_to_i32(const int64_t *v, int64_t n, int32_t *cu) {
    int64_t acc = 0;
    cu[0] = 0;
    for (int64_t i = 0; i < n; ++i) {
        acc = ncp_add_wrap_i64(acc, v[i]);
        cu[i + 1] = ncp_wrap_i32((uint32_t)acc);
    }
}

/* max(cu[1:] - cu[:-1]) with torch's int32 (wrapping) subtraction. */
static int32_t max_diff_i32(const int32_t *cu, int64_t n_entries) {
    int32_t best = 0;
    for (int64_t i = 1; i < n_entries; ++i) {
        int32_t d = ncp_sub_wrap_i32(cu[i], cu[i - 1]);
        if (i == 1 || d > best) best = d;
    }
    return best;
}

/* process_input_for_thd's cu_seqlens, cu_seqlens_padded, absorption and max_seqlen for one chunk. */
static ncp_status framework_chunk(const int64_t *vl, int64_t n_r, const int64_t *vp, int64_t n_p, int64_t tokens,
                                  int32_t W, int64_t sentinel, mimo_chunk *ch, int32_t *cu_pad) {
    if (n_r == 0)
        NCP_FAIL(NCP_ERR_FALLBACK, "a chunk has no real document length; the reference raises from torch here");
    cumsum_to_i32(vl, n_r, ch->cu_real);
    cumsum_to_i32(vp, n_p, cu_pad);
    int prefix_equal = (n_r == n_p);
    for (int64_t i = 0; prefix_equal && i < n_r; ++i) prefix_equal = ch->cu_real[i] == cu_pad[i];
    if (prefix_equal && (int64_t)ch->cu_real[n_r] < tokens) {
        ch->cu_real[n_r] = (int32_t)tokens;
        memcpy(cu_pad, ch->cu_real, (size_t)(n_r + 1) * sizeof(int32_t));
    }
    int equal = (n_r == n_p) && memcmp(ch->cu_real, cu_pad, (size_t)(n_r + 1) * sizeof(int32_t)) == 0;
    ch->emitted = !equal;
    ch->row = ch->emitted ? cu_pad : ch->cu_real;
    ch->row_len = (ch->emitted ? n_p : n_r) + 1;
    ch->max_real = max_diff_i32(ch->cu_real, n_r + 1);
    if (W > 1) { /* max over the padded (int32) row with sentinel entries filtered out */
        const int32_t s32 = (int32_t)sentinel_in(NCP_DT_I32, sentinel);
        int32_t prev = 0, best = 0;
        int64_t kept = 0;
        for (int64_t i = 0; i < ch->row_len; ++i) {
            if (ch->row[i] == s32) continue;
            int32_t d = ncp_sub_wrap_i32(ch->row[i], prev);
            if (kept == 1 || (kept > 1 && d > best)) best = d;
            prev = ch->row[i];
            ++kept;
        }
        if (kept < 2) NCP_FAIL(NCP_ERR_FALLBACK, "a padded cu_seqlens row has fewer than two entries");
        ch->max_pad = best;
    }
    ch->n_real = n_r;
    ch->n_pad = n_p;
    return NCP_OK;
}

static void write_rows(int32_t *dst, const mimo_chunk *chunks, int64_t C, int64_t width, int use_row, int32_t pad) {
    for (int64_t c = 0; c < C; ++c) {
        const int32_t *src = use_row ? chunks[c].row : chunks[c].cu_real;
        int64_t len = use_row ? chunks[c].row_len : chunks[c].n_real + 1;
        for (int64_t i = 0; i < width; ++i) dst[c * width + i] = i < len ? src[i] : pad;
    }
}

static ncp_status check_layout_args(const ncp_mimo_layout_params *p) {
    NCP_ARG_CHECK(p != NULL, "mimo_layout: params must not be NULL");
    NCP_ARG_CHECK(p->num_chunks >= 1, "num_chunks must be >= 1; got %" PRId32, p->num_chunks);
    NCP_ARG_CHECK(p->B >= 0 && p->S >= 0, "input_ids must have a non-negative shape; got (%" PRId64 ", %" PRId64 ")",
                  p->B, p->S);
    NCP_ARG_CHECK(p->B % p->num_chunks == 0, "MiMo THD num_chunks=%" PRId32 " must evenly divide batch size %" PRId64,
                  p->num_chunks, p->B);
    NCP_ARG_CHECK(p->cp_size >= 1, "cp_size must be >= 1; got %" PRId32, p->cp_size);
    NCP_ARG_CHECK(p->n_real >= 0 && p->n_pad >= 0, "seq_lens and seq_lens_padded must be 2-D");
    NCP_ARG_CHECK(p->seq_lens != NULL || p->B * p->n_real == 0, "seq_lens must be a host table");
    NCP_ARG_CHECK(p->seq_lens_padded != NULL || p->B * p->n_pad == 0, "seq_lens_padded must be a host table");
    NCP_ARG_CHECK(p->sl_dt == NCP_DT_I32 || p->sl_dt == NCP_DT_I64, "seq_lens must be int32 or int64");
    NCP_ARG_CHECK(p->slp_dt == NCP_DT_I32 || p->slp_dt == NCP_DT_I64, "seq_lens_padded must be int32 or int64");
    int64_t need = ncp_mimo_layout_words(p->B, p->n_real, p->n_pad, p->num_chunks);
    NCP_ARG_CHECK(p->buf != NULL && p->buf_words >= need, "mimo_layout: buf too small: %" PRId64 " < %" PRId64 " words",
                  p->buf_words, need);
    return NCP_OK;
}

/* Geometry and scratch of one ncp_mimo_layout call. */
typedef struct {
    int64_t C, rpc, Tc, cap;
    int32_t W;
    int64_t off;                                    /* the kernel table's next free word */
    mimo_chunk *chunks;
    int64_t *vl;                                    /* (cap,) a chunk's filtered real lengths */
    int64_t *vp;                                    /* (C, cap) every chunk's filtered padded lengths */
    int64_t *n_vp;                                  /* (C,) their counts (-1: not filtered yet, W <= 1) */
    int32_t *i32;                                   /* lens, cu_te, then 2 * cap per chunk */
} layout_ctx;

/* Pass 1, MiMo (spec 4): every chunk is validated before the framework runs; writes the TE
 * partition boundaries (W > 1) and every chunk's descriptor. */
static ncp_status pass_mimo(const ncp_mimo_layout_params *p, layout_ctx *x) {
    int64_t *buf = p->buf;
    int32_t *lens = x->i32, *cu_te = x->i32 + x->cap;
    buf[0] = x->C;
    for (int64_t c = 0; c < x->C; ++c) {
        int64_t *desc = buf + 1 + NCP_MIMO_DESC * c;
        desc[0] = x->off; /* W <= 1: no boundaries (n_cu 0) */
        if (x->W <= 1) continue;
        int64_t *vp = x->vp + c * x->cap; /* kept for pass 2, which needs the same entries */
        int64_t n = x->n_vp[c] = filter_rows(p->seq_lens_padded, p->slp_dt, p->slp_st0, p->slp_st1, p->n_pad,
                                             c * x->rpc, (c + 1) * x->rpc, p->sentinel, vp);
        int exact = 0;
        NCP_TRY(mimo_validate_chunk(vp, n, x->Tc, x->W, lens, cu_te, &exact));
        memcpy(buf + desc[0], cu_te, (size_t)(n + 1) * sizeof(int32_t));
        desc[1] = n + 1;
        desc[6] = exact;
        x->off += words_for_i32(n + 1);
    }
    return NCP_OK;
}

/* Pass 2, framework (spec 7.3-7.5): cu_seqlens per chunk and the padding-mask tables. */
static ncp_status pass_framework(const ncp_mimo_layout_params *p, layout_ctx *x) {
    int64_t *buf = p->buf;
    for (int64_t c = 0; c < x->C; ++c) {
        int64_t *desc = buf + 1 + NCP_MIMO_DESC * c;
        int64_t n_r = filter_rows(p->seq_lens, p->sl_dt, p->sl_st0, p->sl_st1, p->n_real, c * x->rpc,
                                  (c + 1) * x->rpc, p->sentinel, x->vl);
        int64_t *vp = x->vp + c * x->cap;
        int64_t n_p = x->n_vp[c] >= 0 ? x->n_vp[c]
                                      : filter_rows(p->seq_lens_padded, p->slp_dt, p->slp_st0, p->slp_st1, p->n_pad,
                                                    c * x->rpc, (c + 1) * x->rpc, p->sentinel, vp);
        mimo_chunk *ch = &x->chunks[c];
        ch->cu_real = x->i32 + 2 * x->cap + 2 * c * x->cap;
        NCP_TRY(framework_chunk(x->vl, n_r, vp, n_p, x->Tc, x->W, p->sentinel, ch, ch->cu_real + x->cap));
        desc[2] = x->off; /* the table holds what the rows hold, not their capacity */
        desc[4] = x->off + n_p + 1;
        x->off += n_p + 1 + n_r;
        int64_t *starts = buf + desc[2], *reals = buf + desc[4];
        starts[0] = 0; /* torch's int64 cumsum: wraps mod 2^64 on absurd lengths */
        for (int64_t i = 0; i < n_p; ++i) starts[i + 1] = ncp_add_wrap_i64(starts[i], vp[i]);
        memcpy(reals, x->vl, (size_t)n_r * sizeof(int64_t));
        desc[3] = n_p;
        desc[5] = n_r;
    }
    return NCP_OK;
}

/* Pass 3: the host-computed outputs, packed after the kernel table. */
static void pass_outputs(const ncp_mimo_layout_params *p, const layout_ctx *x, ncp_mimo_layout_info *info) {
    int64_t cu_width = 0, cup_width = 0;
    int emit = 0;
    for (int64_t c = 0; c < x->C; ++c) {
        const mimo_chunk *ch = &x->chunks[c];
        int64_t mine = x->W > 1 ? ch->row_len : ch->n_real + 1;
        if (mine > cu_width) cu_width = mine;
        if (ch->row_len > cup_width) cup_width = ch->row_len;
        emit |= ch->emitted;
    }
    int64_t *buf = p->buf;
    const int32_t pad = (int32_t)sentinel_in(NCP_DT_I32, p->sentinel); /* the stacked rows' fill, int32 */
    info->kernel_words = x->off;
    info->cu_off = info->kernel_words;
    info->cu_width = cu_width;
    write_rows((int32_t *)(buf + info->cu_off), x->chunks, x->C, cu_width, x->W > 1, pad);
    info->cup_off = info->cu_off + words_for_i32(x->C * cu_width);
    info->emit_padded = (x->W <= 1) && emit;
    info->cup_width = info->emit_padded ? cup_width : 0;
    if (info->emit_padded)
        write_rows((int32_t *)(buf + info->cup_off), x->chunks, x->C, cup_width, 1, pad);
    info->maxlen_off = info->cup_off + words_for_i32(x->C * info->cup_width);
    int32_t *maxlen = (int32_t *)(buf + info->maxlen_off);
    for (int64_t c = 0; c < x->C; ++c) maxlen[c] = x->W > 1 ? x->chunks[c].max_pad : x->chunks[c].max_real;
    info->total_words = info->maxlen_off + words_for_i32(x->C);
}

ncp_status ncp_mimo_layout(const ncp_mimo_layout_params *p, ncp_mimo_layout_info *info) {
    NCP_TRY(check_layout_args(p));
    NCP_ARG_CHECK(info != NULL, "mimo_layout: info must not be NULL");
    layout_ctx x;
    memset(&x, 0, sizeof x);
    x.C = p->num_chunks;
    x.rpc = p->B / x.C;
    x.Tc = x.rpc * p->S;
    x.W = p->cp_size;
    const int64_t dr = x.rpc * p->n_real, dp = x.rpc * p->n_pad;
    x.cap = (dr > dp ? dr : dp) + 2;
    x.off = 1 + NCP_MIMO_DESC * x.C; /* the descriptors, then each chunk's arrays as filled */
    memset(p->buf, 0, (size_t)p->buf_words * sizeof(int64_t));

    ncp_status st = NCP_OK;
    x.chunks = (mimo_chunk *)calloc((size_t)x.C, sizeof(mimo_chunk));
    /* vl (cap), then vp (C x cap), then n_vp (C) */
    int64_t *vals = (int64_t *)malloc(((size_t)x.cap * (1 + (size_t)x.C) + (size_t)x.C) * sizeof(int64_t));
    x.i32 = (int32_t *)malloc((size_t)x.cap * (2 + 2 * (size_t)x.C) * sizeof(int32_t));
    if (x.chunks == NULL || vals == NULL || x.i32 == NULL) {
        st = ncp_set_error(NCP_ERR_NOMEM, NULL, 0, NULL, NULL, "out of host memory in mimo_layout");
        goto done;
    }
    x.vl = vals;
    x.vp = vals + x.cap;
    x.n_vp = x.vp + x.C * x.cap;
    for (int64_t c = 0; c < x.C; ++c) x.n_vp[c] = -1;
    st = pass_mimo(p, &x);
    if (st == NCP_OK) st = pass_framework(p, &x);
    if (st == NCP_OK) pass_outputs(p, &x, info);
done:
    free(x.chunks);
    free(vals);
    free(x.i32);
    return st;
}

/* ---------------------------------------------------------------------------------------- */
/* The flat output buffer of one sharder call                                                */
/* ---------------------------------------------------------------------------------------- */

ncp_status ncp_mimo_plan_make(int64_t B, int64_t S, int64_t n_real, int64_t n_pad, int32_t num_chunks,
                              int32_t cp_size, unsigned outputs, ncp_mimo_plan *plan) {
    NCP_ARG_CHECK(plan != NULL, "mimo_plan: plan must not be NULL");
    NCP_ARG_CHECK(num_chunks >= 1, "num_chunks must be >= 1; got %" PRId32, num_chunks);
    NCP_ARG_CHECK(cp_size >= 1, "cp_size must be >= 1; got %" PRId32, cp_size);
    NCP_ARG_CHECK(B >= 0 && S >= 0, "input_ids must have a non-negative shape; got (%" PRId64 ", %" PRId64 ")", B, S);
    NCP_ARG_CHECK(n_real >= 0 && n_pad >= 0, "seq_lens and seq_lens_padded must have a non-negative width");
    NCP_ARG_CHECK(B % num_chunks == 0, "MiMo THD num_chunks=%" PRId32 " must evenly divide batch size %" PRId64,
                  num_chunks, B);
    NCP_ARG_CHECK(!(outputs & NCP_MIMO_POS) || (outputs & NCP_MIMO_TOKENS),
                  "outputs: position_ids are gathered only with the token outputs");
    memset(plan, 0, sizeof *plan);
    const int64_t C = num_chunks;
    plan->Tc = B / C * S;
    plan->L = cp_size > 1 ? plan->Tc / cp_size : plan->Tc;
    const int64_t CL = C * plan->L, CT = C * plan->Tc;
    int64_t words = 0;
    plan->local_off = words;
    words += CL;
    plan->ids_off = plan->lab_off = plan->pos_off = -1;
    if (outputs & NCP_MIMO_TOKENS) {
        plan->ids_off = words;
        plan->lab_off = words + CL;
        words += 2 * CL;
    }
    if (outputs & NCP_MIMO_POS) {
        plan->pos_off = words;
        words += CL;
    }
    int64_t bytes = words * 8;
    plan->pad_off = (outputs & NCP_MIMO_PAD) ? bytes : -1;
    bytes += (outputs & NCP_MIMO_PAD) ? CL : 0;
    plan->img_off = (outputs & NCP_MIMO_IMAGE) ? bytes : -1;
    bytes += (outputs & NCP_MIMO_IMAGE) ? CT : 0;
    plan->vid_off = (outputs & NCP_MIMO_VIDEO) ? bytes : -1;
    bytes += (outputs & NCP_MIMO_VIDEO) ? CT : 0;
    plan->lay_off = (bytes + 7) / 8;
    plan->lay_words = ncp_mimo_layout_words(B, n_real, n_pad, num_chunks);
    plan->out_words = plan->lay_off + plan->lay_words;
    return NCP_OK;
}
