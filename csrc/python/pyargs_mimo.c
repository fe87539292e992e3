/*
 * pyargs_mimo.c: argument parsing and checks of the THD / MiMo functions of _C (see the header).
 */
#include "pyargs_mimo.h"

#include <string.h>

#include "pyargs.h"

int ncp_pym_fallback(const char *reason) {
    PyErr_SetString(ncp_py_fallback_exc ? ncp_py_fallback_exc : PyExc_RuntimeError, reason);
    return -1;
}

/* An optional media token id: None, or an int; one beyond int64 is a Fallback. */
static int token_id(PyObject *o, const char *name, int64_t *id, int32_t *has) {
    *has = o != Py_None;
    *id = 0;
    if (!*has) return 0;
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int or None, got %.80s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow != 0) return ncp_pym_fallback("a media token id does not fit the dtype of input_ids");
    if (v == -1 && PyErr_Occurred()) return -1;
    *id = (int64_t)v;
    return 0;
}

int ncp_pym_mimo_scalars(PyObject *const *args, ncp_pym_mimo_args *a) {
    /* args[7..13]: num_chunks, cp_size, cp_rank, image_token_id, video_token_id, sentinel, outputs */
    int64_t outputs;
    memset(a, 0, sizeof *a);
    if (ncp_py_int64(args[7], "num_chunks", &a->num_chunks) < 0 || ncp_py_int64(args[8], "cp_size", &a->cp_size) < 0 ||
        ncp_py_int32(args[9], "cp_rank", &a->cp_rank) < 0 ||
        token_id(args[10], "image_token_id", &a->image_token_id, &a->has_image) < 0 ||
        token_id(args[11], "video_token_id", &a->video_token_id, &a->has_video) < 0 ||
        ncp_py_int64(args[12], "sentinel", &a->sentinel) < 0 || ncp_py_int64(args[13], "outputs", &outputs) < 0)
        return -1;
    if (outputs < 0 || outputs > 31) {
        PyErr_Format(PyExc_ValueError, "outputs=%lld is not a set of NCP_MIMO_* bits", (long long)outputs);
        return -1;
    }
    a->outputs = (unsigned)outputs;
    return 0;
}

static int is_int(const ncp_view *v) { return v->dtype == NCP_DT_I32 || v->dtype == NCP_DT_I64; }

static int same_place(const ncp_view *a, const ncp_view *b) {
    return a->device == b->device && a->device_id == b->device_id;
}

static int is_bs(const ncp_view *v, int64_t B, int64_t S) {
    return is_int(v) && v->ndim == 2 && v->shape[0] == B && v->shape[1] == S;
}

/* Inputs the native path covers (else _C.Fallback with the reason); same order as the reference's
 * own checks, so that an input outside the path never sees a native error first. */
static int check_inputs(const ncp_view *v, const ncp_pym_mimo_args *a) {
    const ncp_view *ids = &v[NCP_PYM_IDS], *lab = &v[NCP_PYM_LABELS], *pos = &v[NCP_PYM_POS];
    const ncp_view *sl = &v[NCP_PYM_SL], *slp = &v[NCP_PYM_SLP];
    if (a->num_chunks < 1 || a->num_chunks > INT32_MAX) return ncp_pym_fallback("num_chunks is not a positive int32");
    if (ids->ndim != 2) return ncp_pym_fallback("input_ids is not [batch, sequence]");
    const int64_t B = ids->shape[0], S = ids->shape[1];
    if (B % a->num_chunks || B * S == 0 || !is_int(ids))
        return ncp_pym_fallback("input_ids is empty, not integer, or not divisible into num_chunks");
    if (!lab->present || !is_bs(lab, B, S)) return ncp_pym_fallback("labels is not an integer [batch, sequence] tensor");
    if (!pos->present && (a->cp_size > 1 || a->num_chunks > 1)) return ncp_pym_fallback("position_ids is None");
    if (pos->present && !is_bs(pos, B, S))
        return ncp_pym_fallback("position_ids is not an integer [batch, sequence] tensor");
    if (!same_place(lab, ids) || (pos->present && !same_place(pos, ids)))
        return ncp_pym_fallback("token tensors live on different devices");
    if (!is_int(sl) || sl->ndim != 2 || sl->shape[0] != B)
        return ncp_pym_fallback("seq_lens is not an integer [batch, documents] tensor");
    if (!is_int(slp) || slp->ndim != 2 || slp->shape[0] != B)
        return ncp_pym_fallback("seq_lens_padded is not an integer [batch, documents] tensor");
    if (sl->device != NCP_DEV_CPU || slp->device != NCP_DEV_CPU)
        return ncp_pym_fallback("seq_lens / seq_lens_padded live on another device");
    if (a->cp_size < 1 || a->cp_size > INT32_MAX) return ncp_pym_fallback("cp_size does not fit in int32");
    if (a->cp_size > 1 && B / a->num_chunks * S > INT32_MAX) /* TE's int32 boundaries would wrap */
        return ncp_pym_fallback("tokens per chunk do not fit in int32 (TE's cu_seqlens)");
    if (ids->dtype == NCP_DT_I32) {
        int bad = (a->has_image && (a->image_token_id < INT32_MIN || a->image_token_id > INT32_MAX)) ||
                  (a->has_video && (a->video_token_id < INT32_MIN || a->video_token_id > INT32_MAX));
        if (bad) return ncp_pym_fallback("a media token id does not fit the dtype of input_ids");
    }
    return 0;
}

/* The output buffer and the host block (our own allocations: misuse is a ValueError). */
static int check_buffers(const ncp_view *v, const ncp_mimo_plan *plan) {
    const ncp_view *out = &v[NCP_PYM_OUT], *host = &v[NCP_PYM_HOST], *ids = &v[NCP_PYM_IDS];
    if (ncp_py_expect(out, "out", NCP_DT(NCP_DT_I64), 1, 2) < 0 || ncp_py_expect(host, "host", NCP_DT_INT, 1, 2) < 0)
        return -1;
    if (!same_place(out, ids)) {
        PyErr_SetString(PyExc_ValueError, "out must be on the device of input_ids");
        return -1;
    }
    if (out->shape[0] < plan->out_words) {
        PyErr_Format(PyExc_ValueError, "out must have at least %lld int64 words; got %lld", (long long)plan->out_words,
                     (long long)out->shape[0]);
        return -1;
    }
    /* host: int64, or int32 (Python's, which then needs no int32 view for the cu_seqlens outputs) */
    const int64_t host_words = host->dtype == NCP_DT_I32 ? host->shape[0] / 2 : host->shape[0];
    if (host->present && (host->device != NCP_DEV_CPU || ids->device != NCP_DEV_CUDA || host_words < plan->lay_words ||
                          ((uintptr_t)host->data & 7) != 0)) {
        PyErr_Format(PyExc_ValueError,
                     "host must be None, or an 8-byte aligned host int32 / int64 buffer of at least %lld int64 words "
                     "for CUDA tokens",
                     (long long)plan->lay_words);
        return -1;
    }
    return 0;
}

/* The pending exception becomes _C.Fallback with the same message; returns -1. */
static int to_fallback(void) {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
    PyObject *msg = PyObject_Str(exc);
    Py_DECREF(exc);
#else
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    PyObject *msg = exc ? PyObject_Str(exc) : NULL;
    Py_XDECREF(type);
    Py_XDECREF(exc);
    Py_XDECREF(tb);
#endif
    if (msg == NULL) return -1;
    PyErr_SetObject(ncp_py_fallback_exc ? ncp_py_fallback_exc : PyExc_RuntimeError, msg);
    Py_DECREF(msg);
    return -1;
}

int ncp_pym_mimo_views(PyObject *const *args, ncp_view *v) {
    static const char *names[NCP_PYM_NVIEWS] = {"input_ids", "labels", "position_ids", "seq_lens",
                                                "seq_lens_padded", "out", "host"};
    static const int optional[NCP_PYM_NVIEWS] = {0, 1, 1, 0, 0, 0, 1};
    for (int i = 0; i < NCP_PYM_NVIEWS; ++i) {
        if (ncp_view_from_capsule(args[i], names[i], optional[i], &v[i]) == 0) continue;
        /* a tensor DLPack carries but a view cannot hold (complex, uint8, int16, float8, > 8 dims, another
         * device, ...): outside the native path, so the reference decides. Misuse (None where a tensor is
         * required, a non-capsule, a consumed capsule) and any bad out / host stay errors. */
        int input = i < NCP_PYM_OUT && PyErr_ExceptionMatches(PyExc_ValueError) &&
                    (PyCapsule_IsValid(args[i], "dltensor") || PyCapsule_IsValid(args[i], "dltensor_versioned"));
        return input ? to_fallback() : -1;
    }
    return 0;
}

int ncp_pym_mimo_views_x(PyObject *const *args, ncp_view *v) {
    static const char *names[NCP_PYM_NVIEWS] = {"input_ids", "labels", "position_ids", "seq_lens",
                                                "seq_lens_padded", "out", "host"};
    static const int optional[NCP_PYM_NVIEWS] = {0, 1, 1, 0, 0, 0, 1};
    for (int i = 0; i < NCP_PYM_NVIEWS; ++i) {
        if (args[i] == Py_None && !optional[i]) return 0; /* misuse: the capsule call says so */
        const int r = ncp_view_from_object(args[i], names[i], &v[i]);
        if (r == 1) continue;
        if (r == 0) return 0;
        /* as ncp_pym_mimo_views: an input a view cannot hold is outside the native path */
        return i < NCP_PYM_OUT && PyErr_ExceptionMatches(PyExc_ValueError) ? to_fallback() : -1;
    }
    return 1;
}

static void fill_token(const ncp_view *v, const void **data, ncp_dtype *dt, int64_t *st0, int64_t *st1) {
    if (!v->present) return;
    *data = v->data;
    *dt = v->dtype;
    *st0 = v->strides[0];
    *st1 = v->strides[1];
}

int ncp_pym_mimo_params(const ncp_view *v, const ncp_pym_mimo_args *a, ncp_mimo_run_params *p) {
    if (check_inputs(v, a) < 0) return -1;
    const ncp_view *ids = &v[NCP_PYM_IDS], *sl = &v[NCP_PYM_SL], *slp = &v[NCP_PYM_SLP];
    if ((a->outputs & NCP_MIMO_POS) && !v[NCP_PYM_POS].present) {
        PyErr_SetString(PyExc_ValueError, "outputs asks for position_ids, but position_ids is None");
        return -1;
    }
    memset(p, 0, sizeof *p);
    ncp_mimo_layout_params *L = &p->layout;
    L->seq_lens = sl->data;
    L->sl_dt = sl->dtype;
    L->sl_st0 = sl->strides[0];
    L->sl_st1 = sl->strides[1];
    L->seq_lens_padded = slp->data;
    L->slp_dt = slp->dtype;
    L->slp_st0 = slp->strides[0];
    L->slp_st1 = slp->strides[1];
    L->B = ids->shape[0];
    L->S = ids->shape[1];
    L->n_real = sl->shape[1];
    L->n_pad = slp->shape[1];
    L->num_chunks = (int32_t)a->num_chunks;
    L->cp_size = (int32_t)a->cp_size;
    L->sentinel = a->sentinel;
    p->outputs = a->outputs;
    ncp_status st = ncp_mimo_plan_make(L->B, L->S, L->n_real, L->n_pad, L->num_chunks, L->cp_size, a->outputs, &p->plan);
    if (st != NCP_OK) {
        ncp_py_raise(st);
        return -1;
    }
    if (check_buffers(v, &p->plan) < 0) return -1;
    ncp_mimo_shard_params *s = &p->shard;
    fill_token(ids, &s->input_ids, &s->ids_dt, &s->ids_st0, &s->ids_st1);
    if (a->outputs & NCP_MIMO_TOKENS) fill_token(&v[NCP_PYM_LABELS], &s->labels, &s->lab_dt, &s->lab_st0, &s->lab_st1);
    if (a->outputs & NCP_MIMO_POS) fill_token(&v[NCP_PYM_POS], &s->position_ids, &s->pos_dt, &s->pos_st0, &s->pos_st1);
    s->B = L->B;
    s->S = L->S;
    s->num_chunks = L->num_chunks;
    s->cp_size = L->cp_size;
    s->cp_rank = a->cp_rank;
    s->image_token_id = a->image_token_id;
    s->video_token_id = a->video_token_id;
    s->has_image = a->has_image;
    s->has_video = a->has_video;
    p->out = (int64_t *)v[NCP_PYM_OUT].data;
    p->host = v[NCP_PYM_HOST].present ? (int64_t *)v[NCP_PYM_HOST].data : NULL;
    return 0;
}
