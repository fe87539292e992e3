/*
 * attn_args.c: the one validator of the sink-attention inputs.
 *
 * Two layers, each fact checked once:
 *   ncp_attn_args_fwd / _bwd   tensor facts of borrowed views (presence, device, dtype, rank,
 *                              shapes that must agree, contiguity), then the params struct of ncp.h;
 *   ncp_sink_attn_validate     facts of the params struct (sizes, head dims and dtypes per backend,
 *                              scale, mask fields, and for CUDA the 16-byte access rules); every
 *                              C entry point calls it, whoever built the struct.
 * Host-side data checks of the mask (cu_seqlens monotone, tables in range) are separate
 * (ncp_attn_mask_check_host): the CPU path runs them on its host data, Python asks for them
 * explicitly. Every message names the argument.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "attn_args.h"
#include "ncp/ncp_check.h"

/* ---------------------------------------------------------------------------------------- */
/* tensor facts                                                                              */
/* ---------------------------------------------------------------------------------------- */

static ncp_status want(const ncp_view *v, const char *name, int ndim, int last_dim_contig) {
    NCP_ARG_CHECK(v->present, "%s must be a tensor, not None", name);
    NCP_ARG_CHECK(v->ndim == ndim, "%s must be %d-D; got %" PRId32 "-D", name, ndim, v->ndim);
    if (last_dim_contig == 2)
        NCP_ARG_CHECK(ncp_view_is_contiguous(v), "%s must be contiguous", name);
    else if (last_dim_contig == 1 && ndim > 0)
        NCP_ARG_CHECK(v->shape[ndim - 1] <= 1 || v->strides[ndim - 1] == 1,
                      "%s must have a contiguous last dimension (stride 1)", name);
    return NCP_OK;
}

/* "(a, b, c)" or "(a,)" into buf. */
static const char *shape_str(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t used = (size_t)snprintf(buf, cap, "(");
    for (int j = 0; j < ndim && used < cap; ++j)
        used += (size_t)snprintf(buf + used, cap - used, "%s%" PRId64, j ? ", " : "", shape[j]);
    if (used < cap) snprintf(buf + used, cap - used, ndim == 1 ? ",)" : ")");
    return buf;
}

static ncp_status want_shape(const ncp_view *v, const char *name, int ndim, const int64_t *shape, const char *desc) {
    for (int i = 0; i < ndim; ++i) {
        if (v->shape[i] == shape[i]) continue;
        char got[128], exp[128];
        NCP_FAIL(NCP_ERR_INVALID_ARG, "%s must have shape %s = %s; got %s", name, desc,
                 shape_str(exp, sizeof exp, ndim, shape), shape_str(got, sizeof got, ndim, v->shape));
    }
    return NCP_OK;
}

static ncp_status want_dtype(const ncp_view *v, const char *name, ncp_dtype dt, const char *why) {
    NCP_ARG_CHECK(v->dtype == dt, "%s must be %s%s; got %s", name, ncp_dtype_name(dt), why, ncp_dtype_name(v->dtype));
    return NCP_OK;
}

/* Every present view on the device of q (the first view). */
static ncp_status same_device(const ncp_view *const *views, const char *const *names, int n, ncp_device_kind *dev,
                              int32_t *dev_id) {
    const ncp_view *q = views[0];
    for (int i = 0; i < n; ++i) {
        const ncp_view *v = views[i];
        if (!v->present) continue;
        NCP_ARG_CHECK(v->device != NCP_DEV_META, "%s is a meta tensor; sink_attention needs real data", names[i]);
        NCP_ARG_CHECK(v->device == q->device && (v->device == NCP_DEV_CPU || v->device_id == q->device_id),
                      "%s must be on the device of q (%s:%" PRId32 "); got %s:%" PRId32, names[i],
                      q->device == NCP_DEV_CUDA ? "cuda" : "cpu", q->device_id,
                      v->device == NCP_DEV_CUDA ? "cuda" : "cpu", v->device_id);
    }
    *dev = q->device;
    *dev_id = q->device_id;
    return NCP_OK;
}

static ncp_status mask_fields(const ncp_attn_args *a, int64_t Tq, ncp_sink_attn_params *p) {
    const int docs = a->cu_seqlens.present, table = a->row_lo.present || a->row_hi.present;
    NCP_ARG_CHECK(docs != table, "give either cu_seqlens (documents) or row_lo and row_hi (a table mask), not %s",
                  docs ? "both" : "neither");
    if (docs) {
        NCP_TRY(want(&a->cu_seqlens, "cu_seqlens", 1, 2));
        NCP_TRY(want_dtype(&a->cu_seqlens, "cu_seqlens", NCP_DT_I32, ""));
        NCP_ARG_CHECK(a->cu_seqlens.shape[0] >= 1 && a->cu_seqlens.shape[0] <= INT32_MAX,
                      "cu_seqlens must have between 1 and 2^31 - 1 entries; got %" PRId64, a->cu_seqlens.shape[0]);
        p->mask.kind = NCP_MASK_DOCS;
        p->mask.cu_seqlens = (const int32_t *)a->cu_seqlens.data;
        p->mask.n_cu = (int32_t)a->cu_seqlens.shape[0];
        p->mask.window = a->window;
        return NCP_OK;
    }
    p->mask.window = a->window; /* a table's window: a kernel-choice hint (ncp.h) */
    const int64_t nq[1] = {Tq};
    NCP_TRY(want(&a->row_lo, "row_lo", 1, 2));
    NCP_TRY(want(&a->row_hi, "row_hi", 1, 2));
    NCP_TRY(want_dtype(&a->row_lo, "row_lo", NCP_DT_I32, ""));
    NCP_TRY(want_dtype(&a->row_hi, "row_hi", NCP_DT_I32, ""));
    NCP_TRY(want_shape(&a->row_lo, "row_lo", 1, nq, "(total_q,)"));
    NCP_TRY(want_shape(&a->row_hi, "row_hi", 1, nq, "(total_q,)"));
    p->mask.kind = NCP_MASK_TABLE;
    p->mask.row_lo = (const int32_t *)a->row_lo.data;
    p->mask.row_hi = (const int32_t *)a->row_hi.data;
    return NCP_OK;
}

ncp_status ncp_attn_args_fwd(const ncp_attn_args *a, ncp_sink_attn_params *p, ncp_device_kind *dev, int32_t *dev_id) {
    memset(p, 0, sizeof *p);
    const ncp_view *q = &a->q, *k = &a->k, *v = &a->v, *sink = &a->sink;
    NCP_TRY(want(q, "q", 3, 1));
    NCP_TRY(want(k, "k", 3, 1));
    NCP_TRY(want(v, "v", 3, 1));
    const int64_t Tq = q->shape[0], Hq = q->shape[1], D = q->shape[2], Tk = k->shape[0], Hkv = k->shape[1];
    NCP_ARG_CHECK(k->dtype == q->dtype && v->dtype == q->dtype, "k and v must have the dtype of q (%s); got %s and %s",
                  ncp_dtype_name(q->dtype), ncp_dtype_name(k->dtype), ncp_dtype_name(v->dtype));
    const int64_t kshape[3] = {Tk, Hkv, D}, qshape[3] = {Tq, Hq, D}, lshape[2] = {Hq, Tq}, hq[1] = {Hq};
    NCP_TRY(want_shape(k, "k", 3, kshape, "(total_k, num_kv_heads, head_dim of q)"));
    NCP_TRY(want_shape(v, "v", 3, kshape, "(total_k, num_kv_heads, head_dim) like k"));
    if (sink->present) {
        NCP_TRY(want(sink, "sink", 1, 2));
        NCP_TRY(want_shape(sink, "sink", 1, hq, "(num_heads,)"));
    }
    NCP_TRY(want(&a->out, "out", 3, 1));
    NCP_TRY(want_dtype(&a->out, "out", q->dtype, " (the dtype of q)"));
    NCP_TRY(want_shape(&a->out, "out", 3, qshape, "(total_q, num_heads, head_dim) like q"));
    NCP_TRY(want(&a->lse, "lse", 2, 2));
    NCP_TRY(want_dtype(&a->lse, "lse", NCP_DT_F32, ""));
    NCP_TRY(want_shape(&a->lse, "lse", 2, lshape, "(num_heads, total_q)"));
    NCP_ARG_CHECK(Tq <= INT32_MAX && Tk <= INT32_MAX, "q and k must have at most 2^31 - 1 tokens; got %" PRId64
                  " and %" PRId64, Tq, Tk);
    NCP_ARG_CHECK(Hq <= INT32_MAX && Hkv <= INT32_MAX && D <= INT32_MAX, "q and k have too many heads or a too "
                  "large head_dim (num_heads %" PRId64 ", num_kv_heads %" PRId64 ", head_dim %" PRId64 ")", Hq, Hkv, D);
    NCP_TRY(mask_fields(a, Tq, p));
    const ncp_view *all[] = {q, k, v, sink, &a->out, &a->lse, &a->cu_seqlens, &a->row_lo, &a->row_hi};
    const char *names[] = {"q", "k", "v", "sink", "out", "lse", "cu_seqlens", "row_lo", "row_hi"};
    NCP_TRY(same_device(all, names, 9, dev, dev_id));
    p->q = q->data, p->k = k->data, p->v = v->data;
    p->sink = sink->present ? sink->data : NULL;
    p->sink_dt = sink->present ? sink->dtype : NCP_DT_F32;
    p->out = a->out.data;
    p->lse = (float *)a->lse.data;
    p->q_st = q->strides[0], p->q_sh = q->strides[1];
    p->k_st = k->strides[0], p->k_sh = k->strides[1];
    p->v_st = v->strides[0], p->v_sh = v->strides[1];
    p->o_st = a->out.strides[0], p->o_sh = a->out.strides[1];
    p->Tq = (int32_t)Tq, p->Tk = (int32_t)Tk, p->Hq = (int32_t)Hq, p->Hkv = (int32_t)Hkv, p->D = (int32_t)D;
    p->scale = a->scale;
    p->dtype = q->dtype;
    return NCP_OK;
}

/* A gradient (or dout) of the shape and dtype of `like`; returns its two strides. */
static ncp_status grad_like(const ncp_view *g, const char *name, const ncp_view *like, const char *like_name,
                            int64_t *st, int64_t *sh) {
    NCP_TRY(want(g, name, 3, 1));
    NCP_ARG_CHECK(g->dtype == like->dtype, "%s must have the dtype of %s (%s); got %s", name, like_name,
                  ncp_dtype_name(like->dtype), ncp_dtype_name(g->dtype));
    char desc[48];
    snprintf(desc, sizeof desc, "the shape of %s", like_name);
    for (int i = 0; i < 3; ++i)
        NCP_ARG_CHECK(g->shape[i] == like->shape[i], "%s must have %s (%" PRId64 ", %" PRId64 ", %" PRId64 "); got (%"
                      PRId64 ", %" PRId64 ", %" PRId64 ")", name, desc, like->shape[0], like->shape[1], like->shape[2],
                      g->shape[0], g->shape[1], g->shape[2]);
    *st = g->strides[0];
    *sh = g->strides[1];
    return NCP_OK;
}

ncp_status ncp_attn_args_bwd(const ncp_attn_args *a, ncp_sink_attn_bwd_params *b, ncp_device_kind *dev,
                             int32_t *dev_id) {
    memset(b, 0, sizeof *b);
    NCP_TRY(ncp_attn_args_fwd(a, &b->f, dev, dev_id));
    NCP_TRY(grad_like(&a->dout, "dout", &a->q, "q", &b->do_st, &b->do_sh));
    NCP_TRY(grad_like(&a->dq, "dq", &a->q, "q", &b->dq_st, &b->dq_sh));
    NCP_TRY(grad_like(&a->dk, "dk", &a->k, "k", &b->dk_st, &b->dk_sh));
    NCP_TRY(grad_like(&a->dv, "dv", &a->v, "v", &b->dv_st, &b->dv_sh));
    NCP_ARG_CHECK(a->sink.present == a->dsink.present, "dsink must be given exactly when sink is");
    if (a->dsink.present) {
        NCP_TRY(want(&a->dsink, "dsink", 1, 2));
        NCP_TRY(want_dtype(&a->dsink, "dsink", a->sink.dtype, " (the dtype of sink)"));
        const int64_t hq[1] = {a->q.shape[1]};
        NCP_TRY(want_shape(&a->dsink, "dsink", 1, hq, "(num_heads,)"));
    }
    if (a->workspace.present) {
        NCP_TRY(want(&a->workspace, "workspace", 1, 2));
        NCP_ARG_CHECK(a->workspace.dtype == NCP_DT_F32 || a->workspace.dtype == NCP_DT_I32,
                      "workspace must be a float32 or int32 tensor; got %s", ncp_dtype_name(a->workspace.dtype));
    }
    const ncp_view *all[] = {&a->q, &a->dout, &a->dq, &a->dk, &a->dv, &a->dsink, &a->workspace};
    const char *names[] = {"q", "dout", "dq", "dk", "dv", "dsink", "workspace"};
    NCP_TRY(same_device(all, names, 7, dev, dev_id));
    b->dout = a->dout.data;
    b->dq = a->dq.data, b->dk = a->dk.data, b->dv = a->dv.data;
    b->dsink = a->dsink.present ? a->dsink.data : NULL;
    b->deterministic = a->deterministic;
    b->workspace = a->workspace.present ? a->workspace.data : NULL;
    b->workspace_bytes = a->workspace.present ? ncp_view_numel(&a->workspace) * 4 : 0;
    return NCP_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* params facts                                                                              */
/* ---------------------------------------------------------------------------------------- */

/* The 16-byte vector and TMA access rules of the CUDA kernels. */
static ncp_status check_cuda_access(const ncp_sink_attn_params *p) {
    const void *ptrs[4] = {p->q, p->k, p->v, p->out};
    const char *names[4] = {"q", "k", "v", "out"};
    const int64_t strides[8] = {p->q_st, p->q_sh, p->k_st, p->k_sh, p->v_st, p->v_sh, p->o_st, p->o_sh};
    for (int i = 0; i < 4; ++i)
        NCP_ARG_CHECK((uintptr_t)ptrs[i] % 16 == 0, "%s must be 16-byte aligned on CUDA (use .contiguous())", names[i]);
    for (int i = 0; i < 8; ++i)
        NCP_ARG_CHECK(strides[i] % 8 == 0 && strides[i] >= 0, "%s must have token and head strides that are "
                      "non-negative multiples of 8 elements on CUDA (use .contiguous()); got %" PRId64 " and %" PRId64,
                      names[i / 2], strides[i & ~1], strides[i | 1]);
    return NCP_OK;
}

ncp_status ncp_sink_attn_validate(const ncp_sink_attn_params *p, int on_cuda) {
    NCP_ARG_CHECK(p != NULL, "sink_attention: params must not be NULL");
    NCP_ARG_CHECK(p->Tq >= 0 && p->Tk >= 0, "token counts must be >= 0; got Tq=%" PRId32 ", Tk=%" PRId32, p->Tq, p->Tk);
    NCP_ARG_CHECK(p->Hq > 0 && p->Hkv > 0 && p->Hq % p->Hkv == 0,
                  "the number of query heads (%" PRId32 ") must be a positive multiple of the kv heads (%" PRId32 ")",
                  p->Hq, p->Hkv);
    NCP_ARG_CHECK(p->D > 0, "q, k and v must have head_dim > 0; got %" PRId32, p->D);
    NCP_ARG_CHECK(p->Tq == 0 || (p->q && p->out && p->lse), "q, out and lse must not be NULL");
    NCP_ARG_CHECK(p->Tk == 0 || (p->k && p->v), "k and v must not be NULL");
    NCP_ARG_CHECK(isfinite(p->scale), "scale must be finite; got %g", p->scale);
    NCP_ARG_CHECK(p->sink == NULL || p->sink_dt == NCP_DT_F32 ||
                      (!on_cuda && p->sink_dt == NCP_DT_F64 && p->dtype == NCP_DT_F64),
                  "sink must be float32%s; got %s", on_cuda ? "" : " (or float64 with float64 q on the CPU)",
                  ncp_dtype_name(p->sink_dt));
    if (on_cuda) {
        NCP_ARG_CHECK(p->dtype == NCP_DT_F16 || p->dtype == NCP_DT_BF16,
                      "q must be float16 or bfloat16 on CUDA; got %s", ncp_dtype_name(p->dtype));
        NCP_ARG_CHECK(p->D == 64 || p->D == 128, "head_dim must be 64 or 128 on CUDA; got %" PRId32, p->D);
        NCP_ARG_CHECK(p->Hq <= 65535 * 64, "at most %d query heads on CUDA; got %" PRId32, 65535 * 64, p->Hq);
        NCP_TRY(check_cuda_access(p));
    } else {
        NCP_ARG_CHECK(p->dtype == NCP_DT_F16 || p->dtype == NCP_DT_BF16 || p->dtype == NCP_DT_F32 ||
                          p->dtype == NCP_DT_F64,
                      "q must be float16, bfloat16, float32 or float64 on the CPU; got %s", ncp_dtype_name(p->dtype));
    }
    const ncp_attn_mask *m = &p->mask;
    if (m->kind == NCP_MASK_DOCS) {
        NCP_ARG_CHECK(p->Tq == p->Tk, "q and k must have the same number of tokens; got %" PRId32 " and %" PRId32,
                      p->Tq, p->Tk);
        NCP_ARG_CHECK(m->cu_seqlens != NULL && m->n_cu >= 1, "cu_seqlens must have at least one entry");
        NCP_ARG_CHECK(m->window >= 0, "window must be >= 0; got %" PRId32, m->window);
    } else {
        NCP_ARG_CHECK(m->kind == NCP_MASK_TABLE, "mask kind must be NCP_MASK_DOCS or NCP_MASK_TABLE; got %d", (int)m->kind);
        NCP_ARG_CHECK(m->window >= 0, "window must be >= 0; got %" PRId32, m->window);
        NCP_ARG_CHECK(p->Tq == 0 || (m->row_lo != NULL && m->row_hi != NULL), "a table mask needs row_lo and row_hi");
    }
    return NCP_OK;
}

ncp_status ncp_sink_attn_bwd_validate(const ncp_sink_attn_bwd_params *b, int on_cuda) {
    NCP_ARG_CHECK(b != NULL, "sink_attention backward: params must not be NULL");
    NCP_TRY(ncp_sink_attn_validate(&b->f, on_cuda));
    NCP_ARG_CHECK(b->f.Tq == 0 || (b->dout && b->dq), "dout and dq must not be NULL");
    NCP_ARG_CHECK(b->f.Tk == 0 || (b->dk && b->dv), "dk and dv must not be NULL");
    NCP_ARG_CHECK((b->f.sink == NULL) == (b->dsink == NULL), "dsink must be given exactly when sink is");
    if (on_cuda) {
        const void *ptrs[4] = {b->dout, b->dq, b->dk, b->dv};
        const char *names[4] = {"dout", "dq", "dk", "dv"};
        const int64_t strides[8] = {b->do_st, b->do_sh, b->dq_st, b->dq_sh, b->dk_st, b->dk_sh, b->dv_st, b->dv_sh};
        for (int i = 0; i < 4; ++i)
            NCP_ARG_CHECK((uintptr_t)ptrs[i] % 16 == 0, "%s must be 16-byte aligned on CUDA (use .contiguous())", names[i]);
        for (int i = 0; i < 8; ++i)
            NCP_ARG_CHECK(strides[i] % 8 == 0 && strides[i] >= 0, "%s must have token and head strides that are "
                          "non-negative multiples of 8 elements on CUDA; got %" PRId64 " and %" PRId64, names[i / 2],
                          strides[i & ~1], strides[i | 1]);
        NCP_ARG_CHECK((uintptr_t)b->workspace % 256 == 0, "workspace must be 256-byte aligned on CUDA");
    }
    return NCP_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* host data                                                                                 */
/* ---------------------------------------------------------------------------------------- */

ncp_status ncp_attn_mask_check_host(const ncp_attn_mask *m, int32_t Tq, int32_t Tk) {
    if (m->kind == NCP_MASK_DOCS) {
        const int32_t *cu = m->cu_seqlens;
        NCP_ARG_CHECK(cu[0] == 0, "cu_seqlens must start at 0; got %" PRId32, cu[0]);
        for (int32_t i = 1; i < m->n_cu; ++i)
            NCP_ARG_CHECK(cu[i] >= cu[i - 1], "cu_seqlens must be non-decreasing; cu_seqlens[%" PRId32 "]=%" PRId32
                          " < cu_seqlens[%" PRId32 "]=%" PRId32, i, cu[i], i - 1, cu[i - 1]);
        NCP_ARG_CHECK(cu[m->n_cu - 1] == Tq, "cu_seqlens must end at the number of tokens (%" PRId32 "); got %" PRId32,
                      Tq, cu[m->n_cu - 1]);
        return NCP_OK;
    }
    for (int32_t i = 0; i < Tq; ++i) {
        const int32_t lo = m->row_lo[i], hi = m->row_hi[i];
        NCP_ARG_CHECK(lo >= 0 && lo <= Tk && hi >= -1 && hi < Tk, "row_lo/row_hi must lie in [0, %" PRId32 "]; row %"
                      PRId32 " has [%" PRId32 ", %" PRId32 "]", Tk, i, lo, hi);
        NCP_ARG_CHECK(i == 0 || (lo >= m->row_lo[i - 1] && hi >= m->row_hi[i - 1]),
                      "row_lo and row_hi must be non-decreasing (row %" PRId32 ")", i);
    }
    return NCP_OK;
}
