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
