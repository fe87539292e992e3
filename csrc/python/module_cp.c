/*
 * module_cp.c: the _C functions of the Flint CP rank step (keyword-only, tensors as DLPack
 * capsules; ncp.h section "Flint CP rank step"):
 *   kv_gather(*, a, b, idx, out, stream=None)               out[j] = [a[idx[j]] | b[idx[j]]]
 *   kv_assemble(*, k, v, recv, slot_src, kbuf, vbuf, stream=None)
 *   kv_grad_sum(*, dkbuf, dvbuf, local_slot, back, ret_off, ret_idx, dk, dv, stream=None)
 *   runs_expand(*, runs, out, runs_dev=None, stream=None)    a plan's tables from their runs
 * Every tensor fact is checked here (shapes that must agree, dtypes, devices, contiguity) with a
 * message naming the argument; the C entry points check the rest.
 */
#include <string.h>

#include "dlpack_view.h"
#include "module_attn.h"
#include "ncp/ncp.h"
#include "pyargs.h"

/* Views of the given capsules, by the spec's names (absent optional ones not present). */
static int views(ncp_kwspec *spec, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, ncp_view *v, int n_tensors,
                 void **stream) {
    PyObject *o[NCP_KW_MAX];
    if (ncp_py_kwargs(spec, args, nargs, kwnames, o) < 0) return -1;
    for (int i = 0; i < n_tensors; ++i)
        if (ncp_view_from_capsule(o[i] != NULL ? o[i] : Py_None, spec->names[i], 1, &v[i]) < 0) return -1;
    *stream = NULL;
    return o[n_tensors] != NULL ? ncp_py_stream(o[n_tensors], stream) : 0;
}

static int fail(PyObject *type, const char *fmt, const char *a, const char *b) {
    PyErr_Format(type, fmt, a, b);
    return -1;
}

/* a and b: present, 3-D, one dtype and shape, last dim contiguous. */
static int pair(const ncp_view *a, const ncp_view *b, const char *na, const char *nb, ncp_kv_pair *out) {
    if (ncp_py_expect(a, na, NCP_DT_FLOAT, 3, 1) < 0 || ncp_py_expect(b, nb, NCP_DT_FLOAT, 3, 1) < 0) return -1;
    if (!a->present || !b->present) return fail(PyExc_ValueError, "%s and %s must be tensors", na, nb);
    if (a->dtype != b->dtype || a->shape[0] != b->shape[0] || a->shape[1] != b->shape[1] || a->shape[2] != b->shape[2])
        return fail(PyExc_ValueError, "%s and %s must have the same dtype and shape", na, nb);
    if (a->shape[0] > INT32_MAX || a->shape[1] > INT32_MAX || a->shape[2] > INT32_MAX)
        return fail(PyExc_ValueError, "%s and %s are too large", na, nb);
    out->a = a->data, out->b = b->data;
    out->a_st = a->strides[0], out->a_sh = a->strides[1], out->b_st = b->strides[0], out->b_sh = b->strides[1];
    out->rows = (int32_t)a->shape[0], out->H = (int32_t)a->shape[1], out->D = (int32_t)a->shape[2];
    out->dtype = a->dtype;
    return 0;
}

/* A contiguous int32 index vector. */
static int index_vec(const ncp_view *v, const char *name, int64_t *n) {
    if (!v->present) return fail(PyExc_ValueError, "%s must be a tensor%s", name, "");
    if (ncp_py_expect(v, name, NCP_DT(NCP_DT_I32), 1, 2) < 0) return -1;
    if (v->shape[0] > INT32_MAX) return fail(PyExc_ValueError, "%s is too long%s", name, "");
    *n = v->shape[0];
    return 0;
}

/* A contiguous tensor of the pair's dtype and shape (rows, H, width). */
static int rows_of(const ncp_view *v, const char *name, const ncp_kv_pair *p, int64_t rows, int64_t width) {
    if (!v->present) return fail(PyExc_ValueError, "%s must be a tensor%s", name, "");
    if (ncp_py_expect(v, name, NCP_DT(p->dtype), 3, 2) < 0) return -1;
    const int64_t shape[3] = {rows, p->H, width};
    return ncp_py_shape(v, name, 3, shape, "(rows, heads, width) of its sources");
}

static int one_device(ncp_view *v, int n, ncp_kwspec *spec, ncp_device_kind *dev, int32_t *dev_id) {
    ncp_view *p[NCP_KW_MAX];
    for (int i = 0; i < n; ++i) p[i] = &v[i];
    return ncp_py_same_device(p, spec->names, n, dev, dev_id);
}

static ncp_kwspec gather_spec = {"kv_gather", 5, 0xf, {"a", "b", "idx", "out", "stream"}, {0}};

PyObject *ncp_py_kv_gather(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)m;
    ncp_view v[4];
    void *stream;
    ncp_kv_gather_params p;
    memset(&p, 0, sizeof p);
    int64_t n;
    if (views(&gather_spec, args, nargs, kwnames, v, 4, &stream) < 0 || pair(&v[0], &v[1], "a", "b", &p.src) < 0 ||
        index_vec(&v[2], "idx", &n) < 0 || rows_of(&v[3], "out", &p.src, n, 2LL * p.src.D) < 0)
        return NULL;
    ncp_device_kind dev;
    int32_t dev_id;
    if (one_device(v, 4, &gather_spec, &dev, &dev_id) < 0) return NULL;
    p.idx = (const int32_t *)v[2].data, p.n = (int32_t)n, p.out = v[3].data;
    ncp_status st;
    NCP_PY_RUN(dev, dev_id, ncp_kv_gather_cpu(&p), ncp_kv_gather_cuda(&p, stream), st);
    if (st != NCP_OK) return ncp_py_raise(st);
    Py_RETURN_NONE;
}

static ncp_kwspec assemble_spec = {"kv_assemble", 7, 0x3f, {"k", "v", "recv", "slot_src", "kbuf", "vbuf", "stream"}, {0}};

PyObject *ncp_py_kv_assemble(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)m;
    ncp_view v[6];
    void *stream;
    ncp_kv_assemble_params p;
    memset(&p, 0, sizeof p);
    int64_t n;
    if (views(&assemble_spec, args, nargs, kwnames, v, 6, &stream) < 0 || pair(&v[0], &v[1], "k", "v", &p.local) < 0 ||
        index_vec(&v[3], "slot_src", &n) < 0)
        return NULL;
    const int64_t n_recv = v[2].present ? v[2].shape[0] : -1;
    if (n_recv < 0 || n_recv > INT32_MAX || rows_of(&v[2], "recv", &p.local, n_recv, 2LL * p.local.D) < 0 ||
        rows_of(&v[4], "kbuf", &p.local, n, p.local.D) < 0 || rows_of(&v[5], "vbuf", &p.local, n, p.local.D) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "recv must be a tensor of (rows, heads, 2 head_dim)");
        return NULL;
    }
    ncp_device_kind dev;
    int32_t dev_id;
    if (one_device(v, 6, &assemble_spec, &dev, &dev_id) < 0) return NULL;
    p.recv = v[2].data, p.n_recv = (int32_t)n_recv, p.slot_src = (const int32_t *)v[3].data, p.n_slots = (int32_t)n;
    p.kbuf = v[4].data, p.vbuf = v[5].data;
    ncp_status st;
    NCP_PY_RUN(dev, dev_id, ncp_kv_assemble_cpu(&p), ncp_kv_assemble_cuda(&p, stream), st);
    if (st != NCP_OK) return ncp_py_raise(st);
    Py_RETURN_NONE;
}

static ncp_kwspec sum_spec = {"kv_grad_sum", 9, 0xff,
                              {"dkbuf", "dvbuf", "local_slot", "back", "ret_off", "ret_idx", "dk", "dv", "stream"}, {0}};

PyObject *ncp_py_kv_grad_sum(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)m;
    ncp_view v[8];
    void *stream;
    ncp_kv_grad_sum_params p;
    memset(&p, 0, sizeof p);
    int64_t n_local, n_off, n_idx;
    if (views(&sum_spec, args, nargs, kwnames, v, 8, &stream) < 0 || pair(&v[0], &v[1], "dkbuf", "dvbuf", &p.buf) < 0 ||
        index_vec(&v[2], "local_slot", &n_local) < 0 || index_vec(&v[4], "ret_off", &n_off) < 0 ||
        index_vec(&v[5], "ret_idx", &n_idx) < 0)
        return NULL;
    if (n_off != n_local + 1) {
        PyErr_SetString(PyExc_ValueError, "ret_off must have len(local_slot) + 1 entries");
        return NULL;
    }
    if (rows_of(&v[3], "back", &p.buf, n_idx, 2LL * p.buf.D) < 0 || rows_of(&v[6], "dk", &p.buf, n_local, p.buf.D) < 0 ||
        rows_of(&v[7], "dv", &p.buf, n_local, p.buf.D) < 0)
        return NULL;
    ncp_device_kind dev;
    int32_t dev_id;
    if (one_device(v, 8, &sum_spec, &dev, &dev_id) < 0) return NULL;
    p.local_slot = (const int32_t *)v[2].data, p.n_local = (int32_t)n_local, p.back = v[3].data;
    p.n_back = (int32_t)n_idx, p.ret_off = (const int32_t *)v[4].data, p.ret_idx = (const int32_t *)v[5].data;
    p.dk = v[6].data, p.dv = v[7].data;
    ncp_status st;
    NCP_PY_RUN(dev, dev_id, ncp_kv_grad_sum_cpu(&p), ncp_kv_grad_sum_cuda(&p, stream), st);
    if (st != NCP_OK) return ncp_py_raise(st);
    Py_RETURN_NONE;
}

static ncp_kwspec runs_spec = {"runs_expand", 4, 0x3, {"runs", "out", "runs_dev", "stream"}, {0}};

/* runs: host (n, 5) int32; out: int32 1-D on the CPU or a CUDA device; runs_dev: a copy of runs on
 * out's CUDA device (the kernel reads it; the host copy is what is checked). */
PyObject *ncp_py_runs_expand(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)m;
    ncp_view v[3];
    void *stream;
    if (views(&runs_spec, args, nargs, kwnames, v, 3, &stream) < 0) return NULL;
    if (ncp_py_expect(&v[0], "runs", NCP_DT(NCP_DT_I32), 2, 2) < 0 || ncp_py_expect(&v[1], "out", NCP_DT(NCP_DT_I32), 1, 2) < 0)
        return NULL;
    if (v[0].device != NCP_DEV_CPU || v[0].shape[1] != 5 || v[0].shape[0] > INT32_MAX)
        return fail(PyExc_ValueError, "runs must be a host int32 tensor of shape (runs, 5)%s%s", "", ""), NULL;
    const int32_t n = (int32_t)v[0].shape[0];
    const ncp_run *runs = (const ncp_run *)v[0].data;
    ncp_status st;
    if (v[1].device == NCP_DEV_CPU) {
        if (v[2].present) return fail(PyExc_ValueError, "runs_dev is only for a CUDA out%s%s", "", ""), NULL;
        Py_BEGIN_ALLOW_THREADS st = ncp_runs_expand(runs, n, (int32_t *)v[1].data, v[1].shape[0]);
        Py_END_ALLOW_THREADS
    } else {
        if (!v[2].present || ncp_py_expect(&v[2], "runs_dev", NCP_DT(NCP_DT_I32), 2, 2) < 0 ||
            v[2].shape[0] != v[0].shape[0] || v[2].shape[1] != 5) {
            if (!PyErr_Occurred()) fail(PyExc_ValueError, "runs_dev must be a copy of runs on out's device%s%s", "", "");
            return NULL;
        }
        ncp_view *both[2] = {&v[1], &v[2]};
        const char *names[2] = {"out", "runs_dev"};
        ncp_device_kind dev;
        int32_t dev_id;
        if (ncp_py_same_device(both, names, 2, &dev, &dev_id) < 0) return NULL;
        NCP_PY_RUN(dev, dev_id, NCP_OK,
                   ncp_runs_expand_cuda(runs, (const ncp_run *)v[2].data, n, (int32_t *)v[1].data, v[1].shape[0], stream), st);
    }
    if (st != NCP_OK) return ncp_py_raise(st);
    Py_RETURN_NONE;
}
