/*
 * module_attn.c: the _C functions of the sink-attention family and of Flint's Magi plans.
 *
 *   sink_attn_fwd(q, k, v, sink, out, lse, scale, mask, stream)
 *   sink_attn_bwd(q, k, v, sink, out, lse, dout, dq, dk, dv, dsink, delta, dsink_part, scale, mask,
 *                 deterministic, stream, dq_accum)
 *       mask = (cu_seqlens, window)                                     contiguous THD mode
 *            | (q_pos, q_lo, k_pos, fwd_off, fwd_ent[, dq_off, dq_ent, dkv_off, dkv_ent])   CP mode
 *   magi_geometry, magi_dispatch, plan_build (host only).
 */
#include <string.h>

#include "dlpack_view.h"
#include "ncp/ncp.h"
#include "pyargs.h"

PyObject *ncp_py_sink_attn_fwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *ncp_py_sink_attn_bwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *ncp_py_sink_attn_bwd_n_part(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *ncp_py_magi_geometry(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *ncp_py_magi_dispatch(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *ncp_py_plan_build(PyObject *m, PyObject *const *args, Py_ssize_t nargs);

/* ======================================================================================== */
/* sink attention                                                                            */
/* ======================================================================================== */

enum { A_Q, A_K, A_V, A_SINK, A_OUT, A_LSE, A_DOUT, A_DQ, A_DK, A_DV, A_DSINK, A_DELTA, A_DPART,
       A_CU, A_QPOS, A_QLO, A_KPOS, A_FOFF, A_FENT, A_QOFF, A_QENT, A_KVOFF, A_KVENT, A_DQACC, A_N };

static const char *kNames[A_N] = {"q",        "k",          "v",       "sink",   "out",     "lse",
                                  "dout",     "dq",         "dk",      "dv",     "dsink",   "delta",
                                  "dsink_part", "cu_seqlens", "q_pos", "q_lo", "k_pos", "fwd_off", "fwd_ent",
                                  "dq_off",   "dq_ent",     "dkv_off", "dkv_ent", "dq_accum"};

typedef struct {
    ncp_view v[A_N];
    ncp_device_kind dev;
    int32_t dev_id;
} attn_args;

static int view_at(attn_args *a, int slot, PyObject *obj, int allow_none) {
    return ncp_view_from_capsule(obj, kNames[slot], allow_none, &a->v[slot]);
}

/* Parses the mask tuple into views: 2 entries (contiguous) or 5 / 9 entries (positions). */
static int parse_mask(attn_args *a, PyObject *mask, int32_t *window, int backward) {
    if (!PyTuple_Check(mask)) {
        PyErr_SetString(PyExc_TypeError, "mask must be a tuple");
        return -1;
    }
    const Py_ssize_t n = PyTuple_GET_SIZE(mask);
    *window = 0;
    if (n == 2) {
        if (view_at(a, A_CU, PyTuple_GET_ITEM(mask, 0), 0) < 0 || ncp_py_i32(PyTuple_GET_ITEM(mask, 1), "window", window) < 0)
            return -1;
        if (*window < 0) {
            PyErr_Format(PyExc_ValueError, "window must be >= 0; got %d", (int)*window);
            return -1;
        }
        return ncp_py_expect(&a->v[A_CU], "cu_seqlens", NCP_DT(NCP_DT_I32), 1, 2);
    }
    const Py_ssize_t want = backward ? 9 : 5;
    if (n != want) {
        PyErr_Format(PyExc_TypeError, "mask must have 2 or %zd entries; got %zd", want, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (view_at(a, A_QPOS + (int)i, PyTuple_GET_ITEM(mask, i), 0) < 0) return -1;
        if (ncp_py_expect(&a->v[A_QPOS + i], kNames[A_QPOS + i], NCP_DT(NCP_DT_I32), 1, 2) < 0) return -1;
    }
    return 0;
}

/* Shapes, dtypes and devices of q/k/v/sink/out/lse and the mask; fills the forward params. */
static int check_forward(attn_args *a, ncp_sink_attn_params *p) {
    ncp_view *q = &a->v[A_Q], *k = &a->v[A_K], *v = &a->v[A_V], *sink = &a->v[A_SINK];
    if (ncp_py_expect(q, "q", NCP_DT_FLOAT, 3, 1) < 0) return -1;
    const int64_t Tq = q->shape[0], Hq = q->shape[1], D = q->shape[2];
    if (ncp_py_expect(k, "k", NCP_DT_FLOAT, 3, 1) < 0 || ncp_py_expect(v, "v", NCP_DT_FLOAT, 3, 1) < 0) return -1;
    if (k->dtype != q->dtype || v->dtype != q->dtype) {
        PyErr_Format(PyExc_ValueError, "k and v must have the dtype of q (%s); got %s and %s", ncp_dtype_name(q->dtype),
                     ncp_dtype_name(k->dtype), ncp_dtype_name(v->dtype));
        return -1;
    }
    const int64_t Tk = k->shape[0], Hkv = k->shape[1];
    const int64_t kshape[3] = {Tk, Hkv, D};
    if (ncp_py_shape(k, "k", 3, kshape, "(total_k, num_kv_heads, head_dim of q)") < 0 ||
        ncp_py_shape(v, "v", 3, kshape, "(total_k, num_kv_heads, head_dim) like k") < 0)
        return -1;
    const int64_t hq[1] = {Hq}, qshape[3] = {Tq, Hq, D}, lshape[2] = {Hq, Tq};
    if (ncp_py_expect(sink, "sink", NCP_DT(NCP_DT_F32) | NCP_DT(NCP_DT_F64), 1, 2) < 0 ||
        ncp_py_shape(sink, "sink", 1, hq, "(num_heads,)") < 0)
        return -1;
    if (ncp_py_expect(&a->v[A_OUT], "out", NCP_DT(q->dtype), 3, 1) < 0 ||
        ncp_py_shape(&a->v[A_OUT], "out", 3, qshape, "(total_q, num_heads, head_dim) like q") < 0 ||
        ncp_py_expect(&a->v[A_LSE], "lse", NCP_DT(NCP_DT_F32), 2, 2) < 0 ||
        ncp_py_shape(&a->v[A_LSE], "lse", 2, lshape, "(num_heads, total_q)") < 0)
        return -1;
    if (Tq > INT32_MAX || Tk > INT32_MAX || Hq > 4096 || Hkv > 4096 || D > 1024) {
        PyErr_SetString(PyExc_ValueError, "sink_attention: a dimension is too large");
        return -1;
    }
    if (a->v[A_QPOS].present) {
        const int64_t nq[1] = {Tq}, nk[1] = {Tk};
        if (ncp_py_shape(&a->v[A_QPOS], "q_pos", 1, nq, "(total_q,)") < 0 ||
            ncp_py_shape(&a->v[A_QLO], "q_lo", 1, nq, "(total_q,)") < 0 ||
            ncp_py_shape(&a->v[A_KPOS], "k_pos", 1, nk, "(total_k,)") < 0)
            return -1;
    }
    ncp_view *all[A_N];
    for (int i = 0; i < A_N; ++i) all[i] = &a->v[i];
    if (ncp_py_same_device(all, kNames, A_N, &a->dev, &a->dev_id) < 0) return -1;
    p->q = q->data;
    p->k = k->data;
    p->v = v->data;
    p->sink = sink->present ? sink->data : NULL;
    p->sink_dt = sink->present ? sink->dtype : NCP_DT_F32;
    p->out = a->v[A_OUT].data;
    p->lse = (float *)a->v[A_LSE].data;
    p->q_st = q->strides[0], p->q_sh = q->strides[1];
    p->k_st = k->strides[0], p->k_sh = k->strides[1];
    p->v_st = v->strides[0], p->v_sh = v->strides[1];
    p->o_st = a->v[A_OUT].strides[0], p->o_sh = a->v[A_OUT].strides[1];
    p->Tq = (int32_t)Tq, p->Tk = (int32_t)Tk, p->Hq = (int32_t)Hq, p->Hkv = (int32_t)Hkv, p->D = (int32_t)D;
    p->dtype = q->dtype;
    if (a->v[A_CU].present) {
        p->cu_seqlens = (const int32_t *)a->v[A_CU].data;
        p->n_cu = (int32_t)a->v[A_CU].shape[0];
    } else {
        p->q_pos = (const int32_t *)a->v[A_QPOS].data;
        p->q_lo = (const int32_t *)a->v[A_QLO].data;
        p->k_pos = (const int32_t *)a->v[A_KPOS].data;
        p->fwd_off = (const int32_t *)a->v[A_FOFF].data;
        p->fwd_ent = (const int32_t *)a->v[A_FENT].data;
    }
    return 0;
}

PyObject *ncp_py_sink_attn_fwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    (void)m;
    if (ncp_py_nargs("sink_attn_fwd", nargs, 9) < 0) return NULL;
    attn_args a;
    memset(&a, 0, sizeof a);
    ncp_sink_attn_params p;
    memset(&p, 0, sizeof p);
    void *stream;
    if (view_at(&a, A_Q, args[0], 0) < 0 || view_at(&a, A_K, args[1], 0) < 0 || view_at(&a, A_V, args[2], 0) < 0 ||
        view_at(&a, A_SINK, args[3], 1) < 0 || view_at(&a, A_OUT, args[4], 0) < 0 || view_at(&a, A_LSE, args[5], 0) < 0 ||
        ncp_py_f64(args[6], "scale", &p.scale) < 0 || parse_mask(&a, args[7], &p.window, 0) < 0 ||
        ncp_py_stream(args[8], &stream) < 0 || check_forward(&a, &p) < 0)
        return NULL;
    ncp_status st;
    NCP_PY_RUN(a.dev, a.dev_id, ncp_sink_attn_fwd_cpu(&p), ncp_sink_attn_fwd_cuda(&p, stream), st);
    if (st != NCP_OK) return ncp_py_raise(st);
    Py_RETURN_NONE;
}

static int check_grad(attn_args *a, int slot, int like, int64_t st[2], void **data) {
    ncp_view *g = &a->v[slot], *ref = &a->v[like];
    if (ncp_py_expect(g, kNames[slot], NCP_DT(ref->dtype), 3, 1) < 0) return -1;
    const int64_t shape[3] = {ref->shape[0], ref->shape[1], ref->shape[2]};
    char desc[64];
    snprintf(desc, sizeof desc, "the shape of %s", kNames[like]);
    if (ncp_py_shape(g, kNames[slot], 3, shape, desc) < 0) return -1;
    st[0] = g->strides[0];
    st[1] = g->strides[1];
    *data = g->data;
    return 0;
}

PyObject *ncp_py_sink_attn_bwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    (void)m;
    if (ncp_py_nargs("sink_attn_bwd", nargs, 18) < 0) return NULL;
    attn_args a;
    memset(&a, 0, sizeof a);
    ncp_sink_attn_bwd_params b;
    memset(&b, 0, sizeof b);
    void *stream;
    static const int slots[13] = {A_Q, A_K, A_V, A_SINK, A_OUT, A_LSE, A_DOUT, A_DQ, A_DK, A_DV, A_DSINK, A_DELTA, A_DPART};
    static const int optional[13] = {0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1};
    for (int i = 0; i < 13; ++i)
        if (view_at(&a, slots[i], args[i], optional[i]) < 0) return NULL;
    if (view_at(&a, A_DQACC, args[17], 1) < 0) return NULL; /* its device is checked with the rest */
    if (ncp_py_f64(args[13], "scale", &b.f.scale) < 0 || parse_mask(&a, args[14], &b.f.window, 1) < 0 ||
        ncp_py_i32(args[15], "deterministic", &b.f.deterministic) < 0 || ncp_py_stream(args[16], &stream) < 0 ||
        check_forward(&a, &b.f) < 0)
        return NULL;
    int64_t st2[2];
    void *ptr;
    if (check_grad(&a, A_DOUT, A_Q, st2, &ptr) < 0) return NULL;
    b.dout = ptr, b.do_st = st2[0], b.do_sh = st2[1];
    if (check_grad(&a, A_DQ, A_Q, st2, &ptr) < 0) return NULL;
    b.dq = ptr, b.dq_st = st2[0], b.dq_sh = st2[1];
    if (check_grad(&a, A_DK, A_K, st2, &ptr) < 0) return NULL;
    b.dk = ptr, b.dk_st = st2[0], b.dk_sh = st2[1];
    if (check_grad(&a, A_DV, A_V, st2, &ptr) < 0) return NULL;
    b.dv = ptr, b.dv_st = st2[0], b.dv_sh = st2[1];
    ncp_view *ds = &a.v[A_DSINK], *dl = &a.v[A_DELTA], *dp = &a.v[A_DPART];
    const int64_t hq[1] = {b.f.Hq}, lshape[2] = {b.f.Hq, b.f.Tq};
    if (ds->present && (ncp_py_expect(ds, "dsink", NCP_DT(a.v[A_SINK].dtype), 1, 2) < 0 ||
                        ncp_py_shape(ds, "dsink", 1, hq, "(num_heads,)") < 0))
        return NULL;
    if (ncp_py_expect(dl, "delta", NCP_DT(NCP_DT_F32), 2, 2) < 0 || ncp_py_shape(dl, "delta", 2, lshape, "(num_heads, total_q)") < 0 ||
        ncp_py_expect(dp, "dsink_part", NCP_DT(NCP_DT_F32), 2, 2) < 0)
        return NULL;
    if (dp->present && dp->shape[0] != b.f.Hq) {
        PyErr_SetString(PyExc_ValueError, "dsink_part must have shape (num_heads, n_part)");
        return NULL;
    }
    b.dsink = ds->present ? ds->data : NULL;
    b.delta = dl->present ? (float *)dl->data : NULL;
    b.dsink_part = dp->present ? (float *)dp->data : NULL;
    b.n_part = dp->present ? (int32_t)dp->shape[1] : 0;
    ncp_view *qa = &a.v[A_DQACC];
    const int64_t ashape[3] = {b.f.Hq, (b.f.Tq + 63) / 64 * 64, b.f.D};
    if (qa->present && (ncp_py_expect(qa, "dq_accum", NCP_DT(NCP_DT_F32), 3, 2) < 0 ||
                        ncp_py_shape(qa, "dq_accum", 3, ashape, "(num_heads, total_q rounded up to 64, head_dim)") < 0))
        return NULL;
    b.dq_accum = qa->present ? (float *)qa->data : NULL;
    if (a.v[A_QOFF].present) {
        b.dq_off = (const int32_t *)a.v[A_QOFF].data;
        b.dq_ent = (const int32_t *)a.v[A_QENT].data;
        b.dkv_off = (const int32_t *)a.v[A_KVOFF].data;
        b.dkv_ent = (const int32_t *)a.v[A_KVENT].data;
    }
    ncp_status st;
    NCP_PY_RUN(a.dev, a.dev_id, ncp_sink_attn_bwd_cpu(&b), ncp_sink_attn_bwd_cuda(&b, stream), st);
    if (st != NCP_OK) return ncp_py_raise(st);
    Py_RETURN_NONE;
}

PyObject *ncp_py_sink_attn_bwd_n_part(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    (void)m;
    int32_t tq;
    if (ncp_py_nargs("sink_attn_bwd_n_part", nargs, 1) < 0 || ncp_py_i32(args[0], "Tq", &tq) < 0) return NULL;
    return PyLong_FromLong((long)ncp_sink_attn_bwd_n_part(tq));
}

/* ======================================================================================== */
/* Magi dispatch and plans (host)                                                            */
/* ======================================================================================== */

static int host_i32_1d(PyObject *obj, const char *name, ncp_view *v) {
    if (ncp_view_from_capsule(obj, name, 0, v) < 0) return -1;
    if (v->dtype != NCP_DT_I32 || v->ndim != 1 || v->device != NCP_DEV_CPU || !ncp_view_is_contiguous(v)) {
        PyErr_Format(PyExc_ValueError, "%s must be a contiguous 1-D int32 CPU tensor", name);
        return -1;
    }
    if (v->shape[0] > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s is too long", name);
        return -1;
    }
    return 0;
}

PyObject *ncp_py_magi_geometry(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    (void)m;
    int64_t total;
    int32_t cp, req, minc, chunk;
    int64_t padded;
    if (ncp_py_nargs("magi_geometry", nargs, 4) < 0 || ncp_py_i64(args[0], "total", &total) < 0 ||
        ncp_py_i32(args[1], "cp_size", &cp) < 0 || ncp_py_i32(args[2], "requested_chunk", &req) < 0 ||
        ncp_py_i32(args[3], "min_chunks_per_rank", &minc) < 0)
        return NULL;
    ncp_status st = ncp_magi_geometry(total, cp, req, minc, &chunk, &padded);
    if (st != NCP_OK) return ncp_py_raise(st);
    return Py_BuildValue("(iL)", (int)chunk, (long long)padded);
}

PyObject *ncp_py_magi_dispatch(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    (void)m;
    ncp_view cu, owner;
    int32_t cp, chunk;
    int64_t padded;
    if (ncp_py_nargs("magi_dispatch", nargs, 5) < 0 || host_i32_1d(args[0], "cu_seqlens", &cu) < 0 ||
        ncp_py_i32(args[1], "cp_size", &cp) < 0 || ncp_py_i32(args[2], "chunk_size", &chunk) < 0 ||
        ncp_py_i64(args[3], "total_padded", &padded) < 0 || host_i32_1d(args[4], "owner", &owner) < 0)
        return NULL;
    if (chunk <= 0 || owner.shape[0] * (int64_t)chunk != padded) {
        PyErr_SetString(PyExc_ValueError, "owner must have total_padded / chunk_size entries");
        return NULL;
    }
    ncp_status st;
    Py_BEGIN_ALLOW_THREADS st = ncp_magi_dispatch((const int32_t *)cu.data, (int32_t)cu.shape[0], cp, chunk, padded,
                                                  (int32_t *)owner.data);
    Py_END_ALLOW_THREADS if (st != NCP_OK) return ncp_py_raise(st);
    Py_RETURN_NONE;
}

/* A malloc'd int32 array as a bytearray (Python wraps it with torch.frombuffer). */
static int put_array(PyObject *d, const char *key, const ncp_i32_array *a) {
    PyObject *b = PyByteArray_FromStringAndSize((const char *)a->data, (Py_ssize_t)a->n * (Py_ssize_t)sizeof(int32_t));
    if (b == NULL) return -1;
    int rc = PyDict_SetItemString(d, key, b);
    Py_DECREF(b);
    return rc;
}

static PyObject *window_dict(const ncp_plan_window *w) {
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    PyObject *vp = PyLong_FromLongLong((long long)w->visible_pairs), *win = PyLong_FromLong(w->window);
    int rc = (vp && win) ? (PyDict_SetItemString(d, "visible_pairs", vp) | PyDict_SetItemString(d, "window", win)) : -1;
    Py_XDECREF(vp);
    Py_XDECREF(win);
    const struct {
        const char *k;
        const ncp_i32_array *a;
    } arrays[] = {{"send_counts", &w->send_counts}, {"recv_counts", &w->recv_counts}, {"send_idx", &w->send_idx},
                  {"recv_pos", &w->recv_pos},       {"kv_pos", &w->kv_pos},           {"kv_src", &w->kv_src},
                  {"local_slot", &w->local_slot},   {"recv_slot", &w->recv_slot},     {"q_lo", &w->q_lo},
                  {"fwd_off", &w->fwd_off},         {"fwd_ent", &w->fwd_ent},         {"dq_off", &w->dq_off},
                  {"dq_ent", &w->dq_ent},           {"dkv_off", &w->dkv_off},         {"dkv_ent", &w->dkv_ent}};
    for (size_t i = 0; rc == 0 && i < sizeof arrays / sizeof arrays[0]; ++i) rc = put_array(d, arrays[i].k, arrays[i].a);
    if (rc != 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

PyObject *ncp_py_plan_build(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    (void)m;
    ncp_view cu;
    int32_t cp, rank, req, minc;
    if (ncp_py_nargs("plan_build", nargs, 6) < 0 || host_i32_1d(args[0], "cu_seqlens", &cu) < 0 ||
        ncp_py_i32(args[1], "cp_size", &cp) < 0 || ncp_py_i32(args[2], "cp_rank", &rank) < 0 ||
        ncp_py_i32(args[3], "requested_chunk", &req) < 0 || ncp_py_i32(args[4], "min_chunks_per_rank", &minc) < 0)
        return NULL;
    PyObject *wt = args[5];
    if (!PyTuple_Check(wt) || PyTuple_GET_SIZE(wt) < 1 || PyTuple_GET_SIZE(wt) > 16) {
        PyErr_SetString(PyExc_ValueError, "windows must be a tuple of 1 to 16 ints");
        return NULL;
    }
    int32_t windows[16];
    const int32_t nw = (int32_t)PyTuple_GET_SIZE(wt);
    for (int32_t i = 0; i < nw; ++i)
        if (ncp_py_i32(PyTuple_GET_ITEM(wt, i), "window", &windows[i]) < 0) return NULL;
    ncp_plan plan;
    ncp_status st;
    Py_BEGIN_ALLOW_THREADS st = ncp_plan_build((const int32_t *)cu.data, (int32_t)cu.shape[0], cp, rank, req, minc,
                                               windows, nw, &plan);
    Py_END_ALLOW_THREADS if (st != NCP_OK) return ncp_py_raise(st);
    PyObject *out = Py_BuildValue("{s:L,s:L,s:i,s:i,s:i,s:i}", "total", (long long)plan.total, "total_padded",
                                  (long long)plan.total_padded, "chunk_size", (int)plan.chunk_size, "n_chunks",
                                  (int)plan.n_chunks, "cp_size", (int)plan.cp_size, "cp_rank", (int)plan.cp_rank);
    PyObject *wins = out ? PyTuple_New(nw) : NULL;
    int rc = (out && wins) ? 0 : -1;
    if (rc == 0) rc = put_array(out, "owner", &plan.owner) | put_array(out, "local_pos", &plan.local_pos);
    for (int32_t i = 0; rc == 0 && i < nw; ++i) {
        PyObject *wd = window_dict(&plan.windows[i]);
        if (wd == NULL) rc = -1;
        else PyTuple_SET_ITEM(wins, i, wd);
    }
    if (rc == 0) rc = PyDict_SetItemString(out, "windows", wins);
    Py_XDECREF(wins);
    ncp_plan_free(&plan);
    if (rc != 0) {
        Py_XDECREF(out);
        return NULL;
    }
    return out;
}
