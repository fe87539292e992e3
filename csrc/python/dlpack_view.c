/*
 * dlpack_view.c: turning a DLPack capsule into an ncp_view, with the consumer-side checks the
 * DLPack specification asks for (major version, device type, lanes == 1, known dtype).
 */
#include "dlpack_view.h"

#include <string.h>

static const char *kLegacy = "dltensor";
static const char *kVersioned = "dltensor_versioned";

static int map_dtype(const ncp_dl_dtype *d, const char *name, ncp_dtype *out) {
    if (d->lanes != 1) {
        PyErr_Format(PyExc_ValueError, "%s: vector dtypes (lanes=%u) are not supported", name, (unsigned)d->lanes);
        return -1;
    }
    switch (d->code) {
    case NCP_DL_INT:
        if (d->bits == 32) { *out = NCP_DT_I32; return 0; }
        if (d->bits == 64) { *out = NCP_DT_I64; return 0; }
        break;
    case NCP_DL_BOOL:
        if (d->bits == 8) { *out = NCP_DT_BOOL; return 0; }
        break;
    case NCP_DL_FLOAT:
        if (d->bits == 16) { *out = NCP_DT_F16; return 0; }
        if (d->bits == 32) { *out = NCP_DT_F32; return 0; }
        if (d->bits == 64) { *out = NCP_DT_F64; return 0; }
        break;
    case NCP_DL_BFLOAT:
        if (d->bits == 16) { *out = NCP_DT_BF16; return 0; }
        break;
    default: break;
    }
    PyErr_Format(PyExc_ValueError, "%s: unsupported dtype (DLPack code %u, %u bits)", name, (unsigned)d->code,
                 (unsigned)d->bits);
    return -1;
}

static int fill_view(const ncp_dl_tensor *t, const char *name, ncp_view *v) {
    if (t->ndim < 0 || t->ndim > NCP_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "%s: ndim %d is out of range [0, %d]", name, (int)t->ndim, NCP_MAX_NDIM);
        return -1;
    }
    switch (t->device.device_type) {
    case NCP_DL_CPU:
    case NCP_DL_CUDA_HOST: v->device = NCP_DEV_CPU; break;
    case NCP_DL_CUDA: v->device = NCP_DEV_CUDA; break;
    default:
        PyErr_Format(PyExc_ValueError, "%s: tensors must live on the CPU or a CUDA device (DLPack device type %d)",
                     name, (int)t->device.device_type);
        return -1;
    }
    if (map_dtype(&t->dtype, name, &v->dtype) < 0) return -1;
    v->device_id = t->device.device_id;
    v->ndim = t->ndim;
    v->data = (char *)t->data + t->byte_offset;
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
        v->shape[i] = t->shape[i];
        v->strides[i] = t->strides ? t->strides[i] : expect;
        expect *= t->shape[i];
    }
    v->present = 1;
    return 0;
}

int ncp_view_from_capsule(PyObject *obj, const char *name, int allow_none, ncp_view *v) {
    memset(v, 0, sizeof *v);
    if (obj == Py_None) {
        if (allow_none) return 0;
        PyErr_Format(PyExc_ValueError, "%s must be a tensor, not None", name);
        return -1;
    }
    if (!PyCapsule_CheckExact(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a DLPack capsule, got %.80s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *cname = PyCapsule_GetName(obj);
    if (cname != NULL && strcmp(cname, kVersioned) == 0) {
        ncp_dl_managed_versioned *m = (ncp_dl_managed_versioned *)PyCapsule_GetPointer(obj, kVersioned);
        if (m == NULL) return -1;
        if (m->version.major != 1) {
            PyErr_Format(PyExc_ValueError, "%s: unsupported DLPack major version %u", name, (unsigned)m->version.major);
            return -1;
        }
        return fill_view(&m->dl_tensor, name, v);
    }
    if (cname != NULL && strcmp(cname, kLegacy) == 0) {
        ncp_dl_managed *m = (ncp_dl_managed *)PyCapsule_GetPointer(obj, kLegacy);
        if (m == NULL) return -1;
        return fill_view(&m->dl_tensor, name, v);
    }
    PyErr_Format(PyExc_ValueError, "%s: capsule '%s' is not an unconsumed DLPack tensor", name,
                 cname ? cname : "(null)");
    return -1;
}

/* ---- the C exchange API ------------------------------------------------------------------- */

static const ncp_dl_exchange_api *g_api = NULL;
static PyTypeObject *g_types[4];
static int g_ntypes = 0;

int ncp_exchange_init(PyObject *types) {
    if (!PyTuple_Check(types) || PyTuple_GET_SIZE(types) < 1 || PyTuple_GET_SIZE(types) > 4) {
        PyErr_SetString(PyExc_TypeError, "exchange_init: types must be a tuple of 1 to 4 tensor types");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); ++i)
        if (!PyType_Check(PyTuple_GET_ITEM(types, i))) {
            PyErr_SetString(PyExc_TypeError, "exchange_init: types must hold type objects");
            return -1;
        }
    g_api = NULL;
    for (int i = 0; i < g_ntypes; ++i) Py_DECREF(g_types[i]);
    g_ntypes = 0;
    PyObject *cap = PyObject_GetAttrString(PyTuple_GET_ITEM(types, 0), "__dlpack_c_exchange_api__");
    if (cap == NULL) {
        PyErr_Clear(); /* an older framework: no fast path */
        return 0;
    }
    const ncp_dl_exchange_api *api = NULL;
    if (PyCapsule_CheckExact(cap) && PyCapsule_IsValid(cap, "dlpack_exchange_api"))
        api = (const ncp_dl_exchange_api *)PyCapsule_GetPointer(cap, "dlpack_exchange_api");
    Py_DECREF(cap);
    if (api == NULL || api->version.major != 1 || api->dltensor_from_py_object_no_sync == NULL ||
        api->current_work_stream == NULL) {
        PyErr_Clear();
        return 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); ++i) {
        /* every registered type must publish the same table (a subclass inherits it) */
        PyObject *c = PyObject_GetAttrString(PyTuple_GET_ITEM(types, i), "__dlpack_c_exchange_api__");
        const void *p = c != NULL && PyCapsule_IsValid(c, "dlpack_exchange_api")
                            ? PyCapsule_GetPointer(c, "dlpack_exchange_api") : NULL;
        Py_XDECREF(c);
        if (p != api) {
            PyErr_Clear();
            continue;
        }
        PyObject *type = PyTuple_GET_ITEM(types, i);
        Py_INCREF(type); /* held until the next registration */
        g_types[g_ntypes++] = (PyTypeObject *)type;
    }
    g_api = api;
    return 1;
}

int ncp_view_from_object(PyObject *obj, const char *name, ncp_view *v) {
    memset(v, 0, sizeof *v);
    if (obj == Py_None) return 1;
    if (g_api == NULL) return 0;
    PyTypeObject *t = Py_TYPE(obj);
    int known = 0;
    for (int i = 0; i < g_ntypes && !known; ++i) known = t == g_types[i];
    if (!known) return 0;
    ncp_dl_tensor dl;
    if (g_api->dltensor_from_py_object_no_sync(obj, &dl) != 0) {
        PyErr_Clear(); /* e.g. a meta tensor: the capsule path says which argument, as it always has */
        return 0;
    }
    return fill_view(&dl, name, v) < 0 ? -1 : 1;
}

int ncp_exchange_stream(int32_t dev_id, void **stream) {
    *stream = NULL;
    if (g_api == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the DLPack exchange API is not registered");
        return -1;
    }
    return g_api->current_work_stream(NCP_DL_CUDA, dev_id, stream) == 0 ? 0 : -1;
}
