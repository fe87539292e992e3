/*
 * cpu/thd_shard.c: CPU backend (and second oracle) of the thd_partition family.
 *
 *   ncp_thd_partition_cpu   Transformer Engine's DualChunkSwap partition of one rank.
 *   ncp_thd_partition_validate(_total)  host checks of cu_seqlens for validating callers.
 *   ncp_mimo_shard_cpu      MiMo's one-pass shard: gathers, padding mask, local indices, media masks.
 *   ncp_mimo_run_cpu        one whole sharder call: layout into the output buffer, then the pass.
 *
 * The index math lives in core/thd_layout.h and is shared with csrc/cuda/thd_shard.cu.
 * Tests: tests/test_thd_partition.py, tests/test_mimo_native.py. Bench: benchmarks/bench_mimo_shard.py.
 */
#include <inttypes.h>
#include <string.h>

#include "ncp/ncp.h"
#include "ncp/ncp_check.h"
#include "../core/ncp_internal.h"
#include "../core/thd_layout.h"

/* Host-visible argument checks shared by the CPU and CUDA entry points. */
ncp_status ncp_thd_partition_check(const ncp_thd_partition_params *p) {
    NCP_ARG_CHECK(p != NULL, "thd_partition: params must not be NULL");
    NCP_ARG_CHECK(p->cp_size > 0, "cp_size must be > 0; got %" PRId32, p->cp_size);
    NCP_ARG_CHECK(p->cp_rank >= 0 && p->cp_rank < p->cp_size, "cp_rank must be in [0, cp_size=%" PRId32 "); got %" PRId32,
                  p->cp_size, p->cp_rank);
    NCP_ARG_CHECK(p->n_cu >= 2, "cu_seqlens must have at least 2 entries; got %" PRId32, p->n_cu);
    NCP_ARG_CHECK(p->total_tokens > 0 && p->total_tokens % (2 * (int64_t)p->cp_size) == 0,
                  "total_tokens must be positive and divisible by 2 * cp_size (%" PRId64 "); got %" PRId64,
                  2 * (int64_t)p->cp_size, p->total_tokens);
    NCP_ARG_CHECK(p->total_tokens / p->cp_size <= INT32_MAX, "total_tokens / cp_size must fit in int32; got %" PRId64,
                  p->total_tokens / p->cp_size);
    NCP_ARG_CHECK(p->cu_seqlens != NULL && p->out != NULL, "cu_seqlens and out must not be NULL");
    return NCP_OK;
}

ncp_status ncp_thd_partition_validate(const int32_t *cu, int32_t n_cu, int32_t cp_size) {
    NCP_ARG_CHECK(cu != NULL && n_cu >= 2, "cu_seqlens must have at least 2 entries; got %" PRId32, n_cu);
    NCP_ARG_CHECK(cp_size > 0, "cp_size must be > 0; got %" PRId32, cp_size);
    const int64_t div = 2 * (int64_t)cp_size;
    NCP_ARG_CHECK(cu[0] >= 0, "cu_seqlens[0] must be >= 0; got %" PRId32, cu[0]);
    for (int32_t i = 1; i < n_cu; ++i) {
        int64_t len = (int64_t)cu[i] - cu[i - 1];
        NCP_ARG_CHECK(len >= 0, "cu_seqlens must be non-decreasing; cu_seqlens[%" PRId32 "]=%" PRId32
                      " < cu_seqlens[%" PRId32 "]=%" PRId32, i, cu[i], i - 1, cu[i - 1]);
        NCP_ARG_CHECK(len % div == 0, "every document length in cu_seqlens must be divisible by 2 * cp_size (%" PRId64
                      "); document %" PRId32 " has length %" PRId64, div, i - 1, len);
    }
    return NCP_OK;
}

ncp_status ncp_thd_partition_validate_total(const int32_t *cu, int32_t n_cu, int32_t cp_size, int64_t total_tokens) {
    NCP_TRY(ncp_thd_partition_validate(cu, n_cu, cp_size));
    NCP_ARG_CHECK((int64_t)cu[n_cu - 1] <= total_tokens,
                  "cu_seqlens[-1] must not exceed total_tokens: cu_seqlens[-1]=%" PRId32 " > total_tokens=%" PRId64,
                  cu[n_cu - 1], total_tokens);
    return NCP_OK;
}

ncp_status ncp_thd_partition_cpu(const ncp_thd_partition_params *p) {
    NCP_TRY(ncp_thd_partition_check(p));
    const int64_t n_out = p->total_tokens / p->cp_size;
    for (int64_t t = 0; t < n_out; ++t) p->out[t] = ncp_te_src_index(p->cu_seqlens, p->n_cu, t, p->cp_size, p->cp_rank);
    return NCP_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* MiMo shard                                                                                 */
/* ---------------------------------------------------------------------------------------- */

ncp_status ncp_mimo_shard_check(const ncp_mimo_shard_params *p) {
    NCP_ARG_CHECK(p != NULL, "mimo_shard: params must not be NULL");
    NCP_ARG_CHECK(p->num_chunks >= 1 && p->B >= 0 && p->S >= 0 && p->B % p->num_chunks == 0,
                  "MiMo THD num_chunks=%" PRId32 " must evenly divide batch size %" PRId64, p->num_chunks, p->B);
    NCP_ARG_CHECK(p->cp_size >= 1 && p->cp_rank >= 0 && p->cp_rank < p->cp_size,
                  "cp_rank must be in [0, cp_size=%" PRId32 "); got %" PRId32, p->cp_size, p->cp_rank);
    NCP_ARG_CHECK(p->table != NULL, "mimo_shard: the layout table must not be NULL");
    NCP_ARG_CHECK(p->ids_dt == NCP_DT_I32 || p->ids_dt == NCP_DT_I64, "input_ids must be int32 or int64");
    NCP_ARG_CHECK(p->out_local != NULL, "mimo_shard: out_local (the local index output) is required");
    NCP_ARG_CHECK(!p->has_image || p->out_image != NULL, "mimo_shard: out_image is required with image_token_id");
    NCP_ARG_CHECK(!p->has_video || p->out_video != NULL, "mimo_shard: out_video is required with video_token_id");
    if (p->cp_size > 1) {
        int64_t tc = (p->B / p->num_chunks) * p->S;
        NCP_ARG_CHECK(tc % (2 * (int64_t)p->cp_size) == 0,
                      "input_ids: tokens per chunk (%" PRId64 ") must be divisible by 2 * cp_size (%" PRId64 ")", tc,
                      2 * (int64_t)p->cp_size);
    }
    NCP_ARG_CHECK((p->out_ids == NULL) == (p->out_labels == NULL), "mimo_shard: out_ids and out_labels go together");
    NCP_ARG_CHECK(p->out_ids == NULL || p->cp_size > 1, "mimo_shard: out_ids is written only at cp_size > 1");
    NCP_ARG_CHECK(p->out_pos == NULL || p->out_ids != NULL, "mimo_shard: out_pos needs out_ids");
    if (p->out_ids != NULL)
        NCP_ARG_CHECK(p->labels != NULL && (p->lab_dt == NCP_DT_I32 || p->lab_dt == NCP_DT_I64),
                      "labels must be int32 or int64");
    if (p->out_pos != NULL)
        NCP_ARG_CHECK(p->position_ids != NULL && (p->pos_dt == NCP_DT_I32 || p->pos_dt == NCP_DT_I64),
                      "position_ids must be int32 or int64");
    return NCP_OK;
}

static inline int64_t load_int(const void *base, ncp_dtype dt, int64_t off) {
    return dt == NCP_DT_I64 ? ((const int64_t *)base)[off] : (int64_t)((const int32_t *)base)[off];
}

/* Token at flat position g of chunk c: row c*rpc + g / S, column g % S (no division when the rows
 * are laid out back to back, st0 == S * st1, the usual case). */
static inline int64_t token_offset(int64_t c, int64_t rpc, int64_t S, int64_t g, int64_t st0, int64_t st1) {
    if (st0 == S * st1) return (c * rpc * S + g) * st1;
    int64_t row = c * rpc + g / S, col = g % S;
    return row * st0 + col * st1;
}

static int compare_token(int64_t v, ncp_dtype dt, int64_t id) {
    return dt == NCP_DT_I64 ? v == id : (int32_t)v == (int32_t)id;
}

ncp_status ncp_mimo_shard_cpu(const ncp_mimo_shard_params *p) {
    NCP_TRY(ncp_mimo_shard_check(p));
    const int64_t C = p->num_chunks, rpc = p->B / C, S = p->S, Tc = rpc * S;
    const int32_t W = p->cp_size, r = p->cp_rank;
    const int64_t L = W > 1 ? Tc / W : Tc;
    for (int64_t c = 0; c < C; ++c) {
        const int64_t *desc = p->table + 1 + NCP_MIMO_DESC * c;
        const int32_t *cu = (const int32_t *)(p->table + desc[0]);
        const int64_t *starts = p->table + desc[2], *reals = p->table + desc[4];
        if (p->has_image || p->has_video) {
            for (int64_t g = 0; g < Tc; ++g) {
                int64_t v = load_int(p->input_ids, p->ids_dt, token_offset(c, rpc, S, g, p->ids_st0, p->ids_st1));
                if (p->has_image) p->out_image[c * Tc + g] = (uint8_t)compare_token(v, p->ids_dt, p->image_token_id);
                if (p->has_video) p->out_video[c * Tc + g] = (uint8_t)compare_token(v, p->ids_dt, p->video_token_id);
            }
        }
        for (int64_t t = 0; t < L; ++t) {
            int64_t doc = 0;
            int64_t g = W > 1 ? ncp_te_src_index_doc(cu, (int32_t)desc[1], t, W, r, &doc) : t;
            int64_t o = c * L + t;
            p->out_local[o] = g;
            if (p->out_pad != NULL)
                p->out_pad[o] = (uint8_t)ncp_mimo_is_padding(starts, desc[3], reals, desc[5], g, doc, desc[6]);
            if (p->out_ids == NULL) continue;
            p->out_ids[o] = load_int(p->input_ids, p->ids_dt, token_offset(c, rpc, S, g, p->ids_st0, p->ids_st1));
            p->out_labels[o] = load_int(p->labels, p->lab_dt, token_offset(c, rpc, S, g, p->lab_st0, p->lab_st1));
            if (p->out_pos != NULL)
                p->out_pos[o] = load_int(p->position_ids, p->pos_dt, token_offset(c, rpc, S, g, p->pos_st0, p->pos_st1));
        }
    }
    return NCP_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* One whole sharder call                                                                    */
/* ---------------------------------------------------------------------------------------- */

ncp_status ncp_mimo_run_prepare(ncp_mimo_run_params *p) {
    NCP_ARG_CHECK(p != NULL && p->out != NULL, "mimo_run: out must not be NULL");
    const ncp_mimo_plan *pl = &p->plan;
    NCP_ARG_CHECK(p->layout.B == p->shard.B && p->layout.S == p->shard.S && p->layout.num_chunks == p->shard.num_chunks &&
                      p->layout.cp_size == p->shard.cp_size,
                  "mimo_run: layout and shard params disagree on the shapes");
    ncp_mimo_plan want;
    NCP_TRY(ncp_mimo_plan_make(p->layout.B, p->layout.S, p->layout.n_real, p->layout.n_pad, p->layout.num_chunks,
                               p->layout.cp_size, p->outputs, &want));
    NCP_ARG_CHECK(memcmp(&want, pl, sizeof want) == 0, "mimo_run: plan does not match the shapes and outputs");
    NCP_ARG_CHECK(!(p->outputs & NCP_MIMO_TOKENS) || p->shard.cp_size > 1,
                  "mimo_run: the token outputs exist only at cp_size > 1");
    NCP_ARG_CHECK(!(p->outputs & NCP_MIMO_IMAGE) == !p->shard.has_image, "mimo_run: outputs and image_token_id disagree");
    NCP_ARG_CHECK(!(p->outputs & NCP_MIMO_VIDEO) == !p->shard.has_video, "mimo_run: outputs and video_token_id disagree");
    uint8_t *bytes = (uint8_t *)p->out;
    ncp_mimo_shard_params *s = &p->shard;
    s->out_local = p->out + pl->local_off;
    s->out_ids = pl->ids_off >= 0 ? p->out + pl->ids_off : NULL;
    s->out_labels = pl->lab_off >= 0 ? p->out + pl->lab_off : NULL;
    s->out_pos = pl->pos_off >= 0 ? p->out + pl->pos_off : NULL;
    s->out_pad = pl->pad_off >= 0 ? bytes + pl->pad_off : NULL;
    s->out_image = pl->img_off >= 0 ? bytes + pl->img_off : NULL;
    s->out_video = pl->vid_off >= 0 ? bytes + pl->vid_off : NULL;
    s->table = p->out + pl->lay_off;
    p->layout.buf_words = pl->lay_words;
    return NCP_OK;
}

ncp_status ncp_mimo_run_cpu(ncp_mimo_run_params *p, ncp_mimo_layout_info *info) {
    NCP_TRY(ncp_mimo_run_prepare(p));
    NCP_ARG_CHECK(p->host == NULL, "mimo_run: host must be NULL when the tokens are on the CPU");
    p->layout.buf = p->out + p->plan.lay_off;
    NCP_TRY(ncp_mimo_layout(&p->layout, info));
    return ncp_mimo_shard_cpu(&p->shard);
}
