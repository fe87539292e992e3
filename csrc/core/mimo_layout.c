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

/* Copies the non-sentinel entries of rows [r0, r1) of a (B, ncol) row-major table. */
static int64_t filter_rows(const int64_t *tab, int64_t ncol, int64_t r0, int64_t r1, int64_t sentinel, int64_t *out) {
    int64_t n = 0;
    for (int64_t i = r0 * ncol; i < r1 * ncol; ++i)
        if (tab[i] != sentinel) out[n++] = tab[i];
    return n;
}

/* MiMo's _chunk_partition_indices checks for one chunk; writes the int32 boundaries TE receives. */
static ncp_status mimo_validate_chunk(const int64_t *vals, int64_t n, int64_t tokens, int32_t W,
                                      int32_t *lens, int32_t *cu) {
    int bad = (n == 0);
    int64_t sum = 0;
    for (int64_t i = 0; i < n; ++i) {
        lens[i] = (int32_t)vals[i];
        bad |= lens[i] <= 0;
        sum += lens[i];
    }
    if (bad) NCP_FAIL(NCP_ERR_INVALID_ARG, "MiMo TE THD padded document lengths must be positive");
    if (sum != tokens)
        NCP_FAIL(NCP_ERR_INVALID_ARG,
                 "MiMo TE THD seq_lens_padded must cover each pipeline chunk: got %" PRId64 " slots for %" PRId64
                 " tokens",
                 sum, tokens);
    const int64_t div = 2 * (int64_t)W; /* int64: 2 * W overflows int32 for W >= 2^30 */
    for (int64_t i = 0; i < n; ++i)
        if (lens[i] % div != 0) return fail_divisible(lens, n, div);
    cu[0] = 0;
    for (int64_t i = 0; i < n; ++i) cu[i + 1] = (int32_t)((uint32_t)cu[i] + (uint32_t)lens[i]);
    return NCP_OK;
}

/* int64 cumsum from 0, each entry then cast to int32 (torch: cat([0], cumsum(v)).to(int32)). */
static void cumsum_to_i32(const int64_t *v, int64_t n, int32_t *cu) {
    int64_t acc = 0;
    cu[0] = 0;
    for (int64_t i = 0; i < n; ++i) {
        acc += v[i];
        cu[i + 1] = (int32_t)acc;
    }
}

static int32_t max_diff_i32(const int32_t *cu, int64_t n_entries) {
    int32_t best = 0;
    for (int64_t i = 1; i < n_entries; ++i) {
        int32_t d = (int32_t)((uint32_t)cu[i] - (uint32_t)cu[i - 1]);
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
    if (W > 1) { /* max over the padded row with sentinel entries filtered out */
        int32_t prev = 0, best = 0;
        int64_t kept = 0;
        for (int64_t i = 0; i < ch->row_len; ++i) {
            if ((int64_t)ch->row[i] == sentinel) continue;
            int32_t d = (int32_t)((uint32_t)ch->row[i] - (uint32_t)prev);
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
    NCP_ARG_CHECK((p->seq_lens != NULL || p->B * p->n_real == 0) && (p->seq_lens_padded != NULL || p->B * p->n_pad == 0),
                  "seq_lens and seq_lens_padded must be host int64 tables");
    int64_t need = ncp_mimo_layout_words(p->B, p->n_real, p->n_pad, p->num_chunks);
    NCP_ARG_CHECK(p->buf != NULL && p->buf_words >= need, "mimo_layout workspace too small: %" PRId64 " < %" PRId64 " words",
                  p->buf_words, need);
    return NCP_OK;
}

ncp_status ncp_mimo_layout(const ncp_mimo_layout_params *p, ncp_mimo_layout_info *info) {
    NCP_TRY(check_layout_args(p));
    NCP_ARG_CHECK(info != NULL, "mimo_layout: info must not be NULL");
    const int64_t C = p->num_chunks, rpc = p->B / C, Tc = rpc * p->S;
    const int32_t W = p->cp_size;
    const int64_t dr = rpc * p->n_real, dp = rpc * p->n_pad;
    const int64_t cap = (dr > dp ? dr : dp) + 2;
    int64_t *buf = p->buf;
    memset(buf, 0, (size_t)p->buf_words * sizeof(int64_t));

    /* table geometry: fixed per-chunk strides */
    const int64_t cu_words = words_for_i32(dp + 1), st_words = dp + 1, re_words = dr > 0 ? dr : 1;
    const int64_t arrays0 = 1 + NCP_MIMO_DESC * C;
    const int64_t per_chunk = cu_words + st_words + re_words;

    ncp_status st = NCP_OK;
    mimo_chunk *chunks = (mimo_chunk *)calloc((size_t)C, sizeof(mimo_chunk));
    int64_t *vals = (int64_t *)malloc((size_t)cap * 2 * sizeof(int64_t));
    int32_t *i32 = (int32_t *)malloc((size_t)cap * (2 + 2 * (size_t)C) * sizeof(int32_t));
    if (chunks == NULL || vals == NULL || i32 == NULL) {
        st = ncp_set_error(NCP_ERR_NOMEM, NULL, 0, NULL, NULL, "out of host memory in mimo_layout");
        goto done;
    }
    int64_t *vl = vals, *vp = vals + cap;
    int32_t *lens = i32, *cu_te = i32 + cap;

    buf[0] = C;
    /* Pass 1, MiMo (spec 4): every chunk is validated before the framework runs. */
    for (int64_t c = 0; c < C; ++c) {
        int64_t *desc = buf + 1 + NCP_MIMO_DESC * c;
        int64_t base = arrays0 + c * per_chunk;
        desc[0] = base;
        desc[2] = base + cu_words;
        desc[4] = base + cu_words + st_words;
        if (W <= 1) continue;
        int64_t n = filter_rows(p->seq_lens_padded, p->n_pad, c * rpc, (c + 1) * rpc, p->sentinel, vp);
        st = mimo_validate_chunk(vp, n, Tc, W, lens, cu_te);
        if (st != NCP_OK) goto done;
        memcpy(buf + desc[0], cu_te, (size_t)(n + 1) * sizeof(int32_t));
        desc[1] = n + 1;
    }
    /* Pass 2, framework (spec 7.3-7.5). */
    for (int64_t c = 0; c < C; ++c) {
        int64_t *desc = buf + 1 + NCP_MIMO_DESC * c;
        int64_t n_r = filter_rows(p->seq_lens, p->n_real, c * rpc, (c + 1) * rpc, p->sentinel, vl);
        int64_t n_p = filter_rows(p->seq_lens_padded, p->n_pad, c * rpc, (c + 1) * rpc, p->sentinel, vp);
        chunks[c].cu_real = i32 + 2 * cap + 2 * c * cap;
        st = framework_chunk(vl, n_r, vp, n_p, Tc, W, p->sentinel, &chunks[c], chunks[c].cu_real + cap);
        if (st != NCP_OK) goto done;
        int64_t *starts = buf + desc[2], *reals = buf + desc[4];
        starts[0] = 0;
        for (int64_t i = 0; i < n_p; ++i) starts[i + 1] = starts[i] + vp[i];
        memcpy(reals, vl, (size_t)n_r * sizeof(int64_t));
        desc[3] = n_p;
        desc[5] = n_r;
    }
    /* Pass 3: the host-computed outputs, packed after the kernel table. */
    {
        int64_t cu_width = 0, cup_width = 0;
        int emit = 0;
        for (int64_t c = 0; c < C; ++c) {
            int64_t real_len = chunks[c].n_real + 1;
            int64_t mine = W > 1 ? chunks[c].row_len : real_len;
            if (mine > cu_width) cu_width = mine;
            if (chunks[c].row_len > cup_width) cup_width = chunks[c].row_len;
            emit |= chunks[c].emitted;
        }
        info->kernel_words = arrays0 + C * per_chunk;
        info->cu_off = info->kernel_words;
        info->cu_width = cu_width;
        write_rows((int32_t *)(buf + info->cu_off), chunks, C, cu_width, W > 1, (int32_t)p->sentinel);
        info->cup_off = info->cu_off + words_for_i32(C * cu_width);
        info->emit_padded = (W <= 1) && emit;
        info->cup_width = info->emit_padded ? cup_width : 0;
        if (info->emit_padded) write_rows((int32_t *)(buf + info->cup_off), chunks, C, cup_width, 1, (int32_t)p->sentinel);
        info->maxlen_off = info->cup_off + words_for_i32(C * info->cup_width);
        int32_t *maxlen = (int32_t *)(buf + info->maxlen_off);
        for (int64_t c = 0; c < C; ++c) maxlen[c] = W > 1 ? chunks[c].max_pad : chunks[c].max_real;
        info->total_words = info->maxlen_off + words_for_i32(C);
    }
done:
    free(chunks);
    free(vals);
    free(i32);
    return st;
}
