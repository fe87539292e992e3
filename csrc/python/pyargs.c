/*
 * pyargs.c: argument parsing, validation and error mapping shared by the _C functions.
 */
#include "pyargs.h"

#include <math.h>
#include <string.h>

#include "ncp/ncp_check.h"

PyObject *ncp_py_fallback_exc = NULL;

PyObject *ncp_py_raise(ncp_status st) {
    const char *msg = ncp_last_error();
    switch (st) {
    case NCP_ERR_INVALID_ARG: PyErr_SetString(PyExc_ValueError, msg); break;
    case NCP_ERR_UNSUPPORTED: PyErr_SetString(PyExc_NotImplementedError, msg); break;
    case NCP_ERR_NOMEM: PyErr_SetString(PyExc_MemoryError, msg); break;
    case NCP_ERR_FALLBACK:
        PyErr_SetString(ncp_py_fallback_exc ? ncp_py_fallback_exc : PyExc_RuntimeError, msg);
        break;
    default: PyErr_Format(PyExc_RuntimeError, "nemo_cp_native CUDA error: %s", msg); break;
    }
    return NULL;
}

int ncp_py_nargs(const char *fn, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", fn, want, nargs);
    return -1;
}

static int parse_i64(PyObject *o, const char *name, int bool_ok, int64_t *out) {
    if (!PyLong_Check(o) || (!bool_ok && PyBool_Check(o))) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, got %.80s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow != 0) {
        PyErr_Format(PyExc_ValueError, "%s=%R does not fit in int64", name, o);
        return -1;
    }
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)v;
    return 0;
}

static int parse_i32(PyObject *o, const char *name, int bool_ok, int32_t *out) {
    int64_t v;
    if (parse_i64(o, name, bool_ok, &v) < 0) return -1;
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s=%lld does not fit in int32", name, (long long)v);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

int ncp_py_i64(PyObject *o, const char *name, int64_t *out) { return parse_i64(o, name, 0, out); }
int ncp_py_i32(PyObject *o, const char *name, int32_t *out) { return parse_i32(o, name, 0, out); }
int ncp_py_int64(PyObject *o, const char *name, int64_t *out) { return parse_i64(o, name, 1, out); }
int ncp_py_int32(PyObject *o, const char *name, int32_t *out) { return parse_i32(o, name, 1, out); }

int ncp_py_f64(PyObject *o, const char *name, double *out) {
    if (PyBool_Check(o) || !(PyFloat_Check(o) || PyLong_Check(o))) {
        PyErr_Format(PyExc_TypeError, "%s must be a float, got %.80s", name, Py_TYPE(o)->tp_name);
        return -1;
    }
    double v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) return -1;
    if (!isfinite(v)) {
        PyErr_Format(PyExc_ValueError, "%s must be finite; got %R", name, o);
        return -1;
    }
    *out = v;
    return 0;
}

int ncp_py_stream(PyObject *o, void **out) {
    if (o == Py_None) {
        *out = NULL;
        return 0;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (void *)(uintptr_t)v;
    return 0;
}

int ncp_py_expect(const ncp_view *v, const char *name, unsigned dtype_mask, int ndim, int contiguous) {
    if (!v->present) return 0;
    if (!((1u << v->dtype) & dtype_mask)) {
        PyErr_Format(PyExc_ValueError, "%s has an unsupported dtype %s", name, ncp_dtype_name(v->dtype));
        return -1;
    }
    if (ndim >= 0 && v->ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s must be %d-D; got %d-D", name, ndim, (int)v->ndim);
        return -1;
    }
    if (contiguous == 2 && !ncp_view_is_contiguous(v)) {
        PyErr_Format(PyExc_ValueError, "%s must be contiguous", name);
        return -1;
    }
    if (contiguous == 1 && v->ndim > 0 && v->shape[v->ndim - 1] > 1 && v->strides[v->ndim - 1] != 1) {
        PyErr_Format(PyExc_ValueError, "%s must be contiguous in its last dimension", name);
        return -1;
    }
    return 0;
}

int ncp_py_same_device(ncp_view *const *views, const char *const *names, int n, ncp_device_kind *dev, int32_t *dev_id) {
    int first = -1;
    for (int i = 0; i < n; ++i) {
        if (!views[i]->present) continue;
        if (first < 0) {
            first = i;
            continue;
        }
        if (views[i]->device != views[first]->device || views[i]->device_id != views[first]->device_id) {
            PyErr_Format(PyExc_ValueError, "%s and %s must be on the same device", names[first], names[i]);
            return -1;
        }
    }
    *dev = first < 0 ? NCP_DEV_CPU : views[first]->device;
    *dev_id = first < 0 ? 0 : views[first]->device_id;
    return 0;
}

int ncp_py_shape(const ncp_view *v, const char *name, int ndim, const int64_t *shape, const char *desc) {
    if (!v->present) return 0;
    int ok = v->ndim == ndim;
    for (int i = 0; ok && i < ndim; ++i) ok = v->shape[i] == shape[i];
    if (ok) return 0;
    char got[200];
    int used = snprintf(got, sizeof got, "(");
    for (int i = 0; i < v->ndim && used < (int)sizeof got - 32; ++i)
        used += snprintf(got + used, sizeof got - (size_t)used, i ? ", %lld" : "%lld", (long long)v->shape[i]);
    snprintf(got + used, sizeof got - (size_t)used, v->ndim == 1 ? ",)" : ")");
    PyErr_Format(PyExc_ValueError, "%s must have shape %s; got %s", name, desc, got);
    return -1;
}

ncp_status ncp_py_no_cuda(void) {
    return ncp_set_error(NCP_ERR_UNSUPPORTED, NULL, 0, NULL, NULL,
                         "nemo_cp_native was built without CUDA (nvcc was not found at build time); "
                         "reinstall with nvcc on PATH or CUDA_HOME set");
}

ncp_status ncp_py_cuda_enter(int32_t dev_id, int32_t *prev) {
#ifdef NCP_WITH_CUDA
    return ncp_cuda_device_enter(dev_id, prev);
#else
    (void)dev_id;
    *prev = 0;
    return ncp_py_no_cuda();
#endif
}

void ncp_py_cuda_exit(int32_t prev) {
#ifdef NCP_WITH_CUDA
    ncp_cuda_device_exit(prev);
#else
    (void)prev;
#endif
}

/* ---- keyword arguments -------------------------------------------------------------------- */

int ncp_py_kwargs(ncp_kwspec *spec, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **out) {
    if (spec->interned[0] == NULL) { /* first call: intern the names once */
        for (int i = 0; i < spec->n; ++i)
            if ((spec->interned[i] = PyUnicode_InternFromString(spec->names[i])) == NULL) return -1;
    }
    if (nargs != 0) {
        PyErr_Format(PyExc_TypeError, "%s() takes keyword arguments only (%zd positional given)", spec->fn, nargs);
        return -1;
    }
    for (int i = 0; i < spec->n; ++i) out[i] = NULL;
    const Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t j = 0; j < nk; ++j) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, j);
        int found = -1;
        for (int i = 0; i < spec->n && found < 0; ++i)
            if (key == spec->interned[i]) found = i; /* call-site names are interned */
        for (int i = 0; i < spec->n && found < 0; ++i)
            if (PyUnicode_Compare(key, spec->interned[i]) == 0) found = i;
        if (found < 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", spec->fn, key);
            return -1;
        }
        out[found] = args[nargs + j];
    }
    for (int i = 0; i < spec->n; ++i)
        if (out[i] == NULL && ((spec->required >> i) & 1u)) {
            PyErr_Format(PyExc_TypeError, "%s() missing required keyword argument '%s'", spec->fn, spec->names[i]);
            return -1;
        }
    return 0;
}
