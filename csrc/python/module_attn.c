/*
 * module_attn.c: the _C functions of the sink-attention family and of Flint's Magi plans.
 *
 * Attention arguments cross by name (keyword-only, METH_FASTCALL | METH_KEYWORDS); tensors are
 * DLPack capsules, the mask is either cu_seqlens (+ window) or row_lo and row_hi:
 *   sink_attn_fwd(*, q, k, v, out, lse, sink=None, scale, cu_seqlens=None, window=0, row_lo=None,
 *                 row_hi=None, stream=None)
 *   sink_attn_bwd(*, q, k, v, out, lse, dout, dq, dk, dv, sink=None, dsink=None, workspace=None,
 *                 scale, cu_seqlens=None, window=0, row_lo=None, row_hi=None, deterministic=0,
 *                 stream=None)
 *   sink_attn_bwd_workspace(*, Tq, Tk, Hq, D, has_sink, deterministic, device, window=0) -> bytes
 *                 (window: the call's, as passed to sink_attn_bwd; it picks the kernels)
 *   sink_attn_kernels(*, deterministic=0, device=0, D=128, window=0) -> (forward, backward) kernel
 *                 names for a call of head dim D and that window ("none" when no GPU can run them)
 *   sink_attn_check_mask(*, Tq, Tk, cu_seqlens=None, row_lo=None, row_hi=None)   host data check
 *   attn_debug(*, portable=None, grid=None, whole_tiles=None, order_waves=None) -> the previous
 *                 (portable, grid, whole_tiles, order_waves); test hooks of the dispatcher
 * Every tensor fact is checked once, by the core validator (csrc/core/attn_args.c).
 *   magi_dispatch, plan_build (host only).
 */
#include <string.h>

#include "attn_args.h"
#include "dlpack_view.h"
#include "module_attn.h"
#include "ncp/ncp.h"
#include "pyargs.h"

/* ======================================================================================== */
/* sink attention                                                                            */
/* ======================================================================================== */

enum { K_Q, K_K, K_V, K_OUT, K_LSE, K_DOUT, K_DQ, K_DK, K_DV, K_SINK, K_DSINK, K_WS, K_SCALE, K_CU, K_WINDOW,
       K_ROW_LO, K_ROW_HI, K_DET, K_STREAM, K_N };
#define ATTN_NAMES                                                                                                   \
    {"q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv", "sink", "dsink", "workspace", "scale", "cu_seqlens",      \
     "window", "row_lo", "row_hi", "deterministic", "stream"}
#define BIT(k) (1u << (k))

static ncp_kwspec fwd_spec = {"sink_attn_fwd", K_N, BIT(K_Q) | BIT(K_K) | BIT(K_V) | BIT(K_OUT) | BIT(K_LSE) | BIT(K_SCALE),
                              ATTN_NAMES, {0}};
static ncp_kwspec bwd_spec = {"sink_attn_bwd", K_N,
                              BIT(K_Q) | BIT(K_K) | BIT(K_V) | BIT(K_OUT) | BIT(K_LSE) | BIT(K_DOUT) | BIT(K_DQ) |
                                  BIT(K_DK) | BIT(K_DV) | BIT(K_SCALE),
                              ATTN_NAMES, {0}};

static ncp_view *view_slot(ncp_attn_args *a, int k) {
    switch (k) {
    case K_Q: return &a->q;
    case K_K: return &a->k;
    case K_V: return &a->v;
    case K_OUT: return &a->out;
    case K_LSE: return &a->lse;
    case K_DOUT: return &a->dout;
    case K_DQ: return &a->dq;
    case K_DK: return &a->dk;
    case K_DV: return &a->dv;
    case K_SINK: return &a->sink;
    case K_DSINK: return &a->dsink;
    case K_WS: return &a->workspace;
    case K_CU: return &a->cu_seqlens;
    case K_ROW_LO: return &a->row_lo;
    case K_ROW_HI: return &a->row_hi;
    default: return NULL;
    }
}

/* Views of every given tensor and the scalars; absent tensors stay not present. */
static int parse_attn(ncp_kwspec *spec, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, ncp_attn_args *a,
                      void **stream) {
    PyObject *v[K_N];
    if (ncp_py_kwargs(spec, args, nargs, kwnames, v) < 0) return -1;
    memset(a, 0, sizeof *a);
    for (int k = 0; k < K_N; ++k) {
        ncp_view *slot = view_slot(a, k);
        if (slot != NULL && v[k] != NULL && ncp_view_from_capsule(v[k], spec->names[k], 1, slot) < 0) return -1;
    }
    *stream = NULL;
    if (ncp_py_f64(v[K_SCALE], "scale", &a->scale) < 0) return -1;
    if (v[K_WINDOW] != NULL && ncp_py_i32(v[K_WINDOW], "window", &a->window) < 0) return -1;
    if (v[K_DET] != NULL && ncp_py_i32(v[K_DET], "deterministic", &a->deterministic) < 0) return -1;
    if (v[K_STREAM] != NULL && ncp_py_stream(v[K_STREAM], stream) < 0) return -1;
    return 0;
}

/* Validates and runs one forward / backward. `exchange`: launch on torch's current stream of the
 * tensors' device (asked through the DLPack C exchange API), else on `stream` (the caller's). */
static PyObject *run_fwd(ncp_attn_args *a, void *stream, int exchange) {
    ncp_sink_attn_params p;
    ncp_device_kind dev;
    int32_t dev_id;
    ncp_status st = ncp_attn_args_fwd(a, &p, &dev, &dev_id);
    if (st != NCP_OK) return ncp_py_raise(st);
    if (exchange && dev == NCP_DEV_CUDA && ncp_exchange_stream(dev_id, &stream) < 0) return NULL;
    NCP_PY_RUN(dev, dev_id, ncp_sink_attn_fwd_cpu(&p), ncp_sink_attn_fwd_cuda(&p, stream), st);
    if (st != NCP_OK) return ncp_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *run_bwd(ncp_attn_args *a, void *stream, int exchange) {
    ncp_sink_attn_bwd_params b;
    ncp_device_kind dev;
    int32_t dev_id;
    ncp_status st = ncp_attn_args_bwd(a, &b, &dev, &dev_id);
    if (st != NCP_OK) return ncp_py_raise(st);
    if (exchange && dev == NCP_DEV_CUDA && ncp_exchange_stream(dev_id, &stream) < 0) return NULL;
    NCP_PY_RUN(dev, dev_id, ncp_sink_attn_bwd_cpu(&b), ncp_sink_attn_bwd_cuda(&b, stream), st);
    if (st != NCP_OK) return ncp_py_raise(st);
    Py_RETURN_NONE;
}

PyObject *ncp_py_sink_attn_fwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)m;
    ncp_attn_args a;
    void *stream;
    if (parse_attn(&fwd_spec, args, nargs, kwnames, &a, &stream) < 0) return NULL;
    return run_fwd(&a, stream, 0);
}

PyObject *ncp_py_sink_attn_bwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)m;
    ncp_attn_args a;
    void *stream;
    if (parse_attn(&bwd_spec, args, nargs, kwnames, &a, &stream) < 0) return NULL;
    return run_bwd(&a, stream, 0);
}

/* ---- the same two calls with positional tensor objects, read through the DLPack C exchange API ----
 *   sink_attn_fwd_x(q, k, v, out, lse, sink, cu_seqlens, row_lo, row_hi, scale, window)
 *   sink_attn_bwd_x(q, k, v, out, lse, dout, dq, dk, dv, sink, dsink, workspace, cu_seqlens, row_lo,
 *                   row_hi, scale, window, deterministic)
 * Tensors are the framework's objects (None where absent), read without a capsule or a Python call
 * (ncp_view_from_object), and a CUDA launch goes on the framework's current stream of the tensors'
 * device (ncp_exchange_stream): the host path of every eager attention call. They return None when
 * done and NotImplemented, having done nothing, when some tensor is not for this path (no exchange
 * API, another tensor type, one the framework refuses): the caller then makes capsules and calls
 * sink_attn_fwd / sink_attn_bwd, whose errors name the argument. Everything else (validation,
 * dispatch, errors) is the keyword functions' own code. */

static const int fwd_x_slots[] = {K_Q, K_K, K_V, K_OUT, K_LSE, K_SINK, K_CU, K_ROW_LO, K_ROW_HI};
static const int bwd_x_slots[] = {K_Q,    K_K,     K_V,  K_OUT, K_LSE, K_DOUT,   K_DQ,  K_DK,
                                  K_DV,   K_SINK,  K_DSINK, K_WS, K_CU,  K_ROW_LO, K_ROW_HI};
static const char *const attn_names[K_N] = ATTN_NAMES;

/* 1: views filled, 0: not for this path (nothing set), -1: exception. */
static int parse_x(const char *fn, const int *slots, int nt, int nscalars, PyObject *const *args, Py_ssize_t nargs,
                   ncp_attn_args *a) {
    if (nargs != nt + nscalars) {
        PyErr_Format(PyExc_TypeError, "%s() takes %d positional arguments (%zd given)", fn, nt + nscalars, nargs);
        return -1;
    }
    memset(a, 0, sizeof *a);
    for (int i = 0; i < nt; ++i) {
        const int r = ncp_view_from_object(args[i], attn_names[slots[i]], view_slot(a, slots[i]));
        if (r <= 0) return r;
    }
    if (ncp_py_f64(args[nt], "scale", &a->scale) < 0) return -1;
    if (ncp_py_i32(args[nt + 1], "window", &a->window) < 0) return -1;
    if (nscalars > 2 && ncp_py_i32(args[nt + 2], "deterministic", &a->deterministic) < 0) return -1;
    return 1;
}

PyObject *ncp_py_sink_attn_fwd_x(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    (void)m;
    ncp_attn_args a;
    const int r = parse_x("sink_attn_fwd_x", fwd_x_slots, 9, 2, args, nargs, &a);
    if (r < 0) return NULL;
    if (r == 0) Py_RETURN_NOTIMPLEMENTED;
    return run_fwd(&a, NULL, 1);
}

PyObject *ncp_py_sink_attn_bwd_x(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    (void)m;
    ncp_attn_args a;
    const int r = parse_x("sink_attn_bwd_x", bwd_x_slots, 15, 3, args, nargs, &a);
    if (r < 0) return NULL;
    if (r == 0) Py_RETURN_NOTIMPLEMENTED;
    return run_bwd(&a, NULL, 1);
}

PyObject *ncp_py_exchange_init(PyObject *m, PyObject *types) {
    (void)m;
    const int r = ncp_exchange_init(types);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

static ncp_kwspec ws_spec = {"sink_attn_bwd_workspace", 8, 0x7f, {"Tq", "Tk", "Hq", "D", "has_sink", "deterministic", "device", "window"}, {0}};

PyObject *ncp_py_sink_attn_bwd_workspace(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)m;
    PyObject *v[8];
    int32_t x[8] = {0};
    if (ncp_py_kwargs(&ws_spec, args, nargs, kwnames, v) < 0) return NULL;
    for (int i = 0; i < 8; ++i) /* window is optional (0: no window) */
        if (v[i] != NULL && ncp_py_i32(v[i], ws_spec.names[i], &x[i]) < 0) return NULL;
    static const int32_t least[8] = {0, 0, 1, 1, 0, 0, 0, 0}; /* Tq, Tk >= 0; Hq, D >= 1; flags, device, window >= 0 */
    for (int i = 0; i < 8; ++i)
        if (x[i] < least[i]) {
            PyErr_Format(PyExc_ValueError, "%s must be >= %d; got %d", ws_spec.names[i], (int)least[i], (int)x[i]);
            return NULL;
        }
    int32_t prev = 0;
    ncp_status st = ncp_py_cuda_enter(x[6], &prev);
    if (st != NCP_OK) return ncp_py_raise(st);
    const int64_t bytes = ncp_sink_attn_bwd_workspace(x[0], x[1], x[2], x[3], x[4], x[5], x[7]);
    ncp_py_cuda_exit(prev);
    return PyLong_FromLongLong((long long)bytes);
}

static ncp_kwspec kern_spec = {"sink_attn_kernels", 4, 0, {"deterministic", "device", "D", "window"}, {0}};

PyObject *ncp_py_sink_attn_kernels(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)m;
    PyObject *v[4];
    int32_t det = 0, device = 0, D = 128, window = 0;
    if (ncp_py_kwargs(&kern_spec, args, nargs, kwnames, v) < 0) return NULL;
    if ((v[0] && ncp_py_i32(v[0], "deterministic", &det) < 0) || (v[1] && ncp_py_i32(v[1], "device", &device) < 0) ||
        (v[2] && ncp_py_i32(v[2], "D", &D) < 0) || (v[3] && ncp_py_i32(v[3], "window", &window) < 0))
        return NULL;
    if (D < 1 || window < 0) {
        PyErr_Format(PyExc_ValueError, D < 1 ? "D must be >= 1; got %d" : "window must be >= 0; got %d",
                     D < 1 ? (int)D : (int)window);
        return NULL;
    }
    const char *fwd = "none", *bwd = "none";
    int32_t prev = 0;
    if (ncp_built_with_cuda() && ncp_py_cuda_enter(device, &prev) == NCP_OK) { /* else no GPU can run them */
        ncp_sink_attn_kernels(det, D, window, &fwd, &bwd);
        ncp_py_cuda_exit(prev);
    }
    return Py_BuildValue("(ss)", fwd, bwd);
}

static ncp_kwspec mask_spec = {"sink_attn_check_mask", 5, 0x3, {"Tq", "Tk", "cu_seqlens", "row_lo", "row_hi"}, {0}};

PyObject *ncp_py_sink_attn_check_mask(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)m;
    PyObject *v[5];
    int32_t Tq, Tk;
    if (ncp_py_kwargs(&mask_spec, args, nargs, kwnames, v) < 0 || ncp_py_i32(v[0], "Tq", &Tq) < 0 ||
        ncp_py_i32(v[1], "Tk", &Tk) < 0)
        return NULL;
    ncp_view views[3];
    memset(views, 0, sizeof views);
    for (int i = 0; i < 3; ++i)
        if (v[2 + i] != NULL && ncp_view_from_capsule(v[2 + i], mask_spec.names[2 + i], 1, &views[i]) < 0) return NULL;
    ncp_attn_mask mask;
    memset(&mask, 0, sizeof mask);
    for (int i = 0; i < 3; ++i)
        if (views[i].present && (views[i].device != NCP_DEV_CPU || views[i].dtype != NCP_DT_I32 || views[i].ndim != 1 ||
                                 !ncp_view_is_contiguous(&views[i]))) {
            PyErr_Format(PyExc_ValueError, "%s must be a contiguous 1-D int32 CPU tensor", mask_spec.names[2 + i]);
            return NULL;
        }
    if (views[0].present) {
        if (views[0].shape[0] < 1 || views[0].shape[0] > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "cu_seqlens must have between 1 and 2^31 - 1 entries");
            return NULL;
        }
        mask.kind = NCP_MASK_DOCS;
        mask.cu_seqlens = (const int32_t *)views[0].data;
        mask.n_cu = (int32_t)views[0].shape[0];
    } else if (views[1].present && views[2].present && views[1].shape[0] == Tq && views[2].shape[0] == Tq) {
        mask.kind = NCP_MASK_TABLE;
        mask.row_lo = (const int32_t *)views[1].data;
        mask.row_hi = (const int32_t *)views[2].data;
    } else {
        PyErr_SetString(PyExc_ValueError, "give cu_seqlens, or row_lo and row_hi of Tq entries each");
        return NULL;
    }
    ncp_status st = ncp_attn_mask_check_host(&mask, Tq, Tk);
    if (st != NCP_OK) return ncp_py_raise(st);
    Py_RETURN_NONE;
}

static ncp_kwspec dbg_spec = {"attn_debug", 4, 0, {"portable", "grid", "whole_tiles", "order_waves"}, {0}};

PyObject *ncp_py_attn_debug(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)m;
    PyObject *v[4];
    if (ncp_py_kwargs(&dbg_spec, args, nargs, kwnames, v) < 0) return NULL;
    const ncp_attn_debug prev = ncp_attn_debug_get();
    ncp_attn_debug d = prev;
    int32_t *fields[4] = {&d.portable, &d.grid, &d.whole_tiles, &d.order_waves};
    for (int i = 0; i < 4; ++i)
        if (v[i] != NULL && v[i] != Py_None && ncp_py_i32(v[i], dbg_spec.names[i], fields[i]) < 0) return NULL;
    if (d.grid < 0) {
        PyErr_Format(PyExc_ValueError, "grid must be >= 0 (0: one CTA per SM); got %d", (int)d.grid);
        return NULL;
    }
    if (d.order_waves < -1) {
        PyErr_Format(PyExc_ValueError,
                     "order_waves must be >= -1 (0: the default, -1: index order, k > 0: chunks of k waves); got %d",
                     (int)d.order_waves);
        return NULL;
    }
    ncp_attn_debug_set(&d);
    return Py_BuildValue("(iiii)", (int)prev.portable, (int)prev.grid, (int)prev.whole_tiles, (int)prev.order_waves);
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

/* A malloc'd run list as a bytearray of (n, 5) int32 (Python views it with torch.frombuffer). */
static int put_runs(PyObject *d, const char *key, const ncp_run *runs, int32_t n) {
    PyObject *b = PyByteArray_FromStringAndSize((const char *)runs, (Py_ssize_t)n * (Py_ssize_t)sizeof(ncp_run));
    if (b == NULL) return -1;
    int rc = PyDict_SetItemString(d, key, b);
    Py_DECREF(b);
    return rc;
}

static PyObject *int_tuple(const int32_t *v, int32_t n) {
    PyObject *t = PyTuple_New(n);
    for (int32_t i = 0; t != NULL && i < n; ++i) {
        PyObject *x = PyLong_FromLong(v[i]);
        if (x == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* {window, visible_pairs, send_counts, recv_counts, table_off (NCP_PT_COUNT + 1 ints), runs} */
static PyObject *window_dict(const ncp_plan_window *w) {
    PyObject *off = PyTuple_New(NCP_PT_COUNT + 1);
    for (int i = 0; off != NULL && i <= NCP_PT_COUNT; ++i) {
        PyObject *x = PyLong_FromLongLong((long long)w->table_off[i]);
        if (x == NULL) {
            Py_CLEAR(off);
            break;
        }
        PyTuple_SET_ITEM(off, i, x);
    }
    PyObject *sc = int_tuple(w->send_counts.data, w->send_counts.n), *rc_ = int_tuple(w->recv_counts.data, w->recv_counts.n);
    PyObject *d = (off && sc && rc_) ? Py_BuildValue("{s:i,s:L,s:O,s:O,s:O}", "window", (int)w->window, "visible_pairs",
                                                     (long long)w->visible_pairs, "send_counts", sc, "recv_counts", rc_,
                                                     "table_off", off)
                                     : NULL;
    Py_XDECREF(off);
    Py_XDECREF(sc);
    Py_XDECREF(rc_);
    if (d != NULL && put_runs(d, "runs", w->runs, w->n_runs) < 0) Py_CLEAR(d);
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
    if (rc == 0) rc = put_array(out, "owner", &plan.owner) | put_runs(out, "local_runs", plan.local_runs, plan.n_local_runs);
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
