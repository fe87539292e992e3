/*
 * dlpack_view.h: borrowing tensor views out of DLPack capsules.
 *
 * The DLPack structs below are our own declarations of the ABI described by the DLPack
 * specification (https://dmlc.github.io/dlpack/latest/c_api.html): field order and widths must
 * match, so they are facts we reproduce, not code we copied.
 *
 * We BORROW: the capsule is neither renamed nor consumed, so its destructor (the producer's) frees
 * the tensor when Python drops the capsule. A view is valid only while the caller holds the
 * capsule, i.e. for the duration of one call into _C; nothing keeps a pointer afterwards.
 */
#ifndef NCP_DLPACK_VIEW_H
#define NCP_DLPACK_VIEW_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "ncp/ncp.h"
#include "ncp_view.h"

/* ---- DLPack ABI (v0.8 legacy and v1.x versioned) ---------------------------------------- */
enum { NCP_DL_CPU = 1, NCP_DL_CUDA = 2, NCP_DL_CUDA_HOST = 3, NCP_DL_CUDA_MANAGED = 13 };
enum { NCP_DL_INT = 0, NCP_DL_UINT = 1, NCP_DL_FLOAT = 2, NCP_DL_BFLOAT = 4, NCP_DL_BOOL = 6 };

typedef struct {
    int32_t device_type;
    int32_t device_id;
} ncp_dl_device;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} ncp_dl_dtype;

typedef struct {
    void *data;
    ncp_dl_device device;
    int32_t ndim;
    ncp_dl_dtype dtype;
    int64_t *shape;
    int64_t *strides; /* NULL: compact row-major */
    uint64_t byte_offset;
} ncp_dl_tensor;

typedef struct ncp_dl_managed {
    ncp_dl_tensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct ncp_dl_managed *self);
} ncp_dl_managed;

typedef struct {
    uint32_t major;
    uint32_t minor;
} ncp_dl_version;

typedef struct ncp_dl_managed_versioned {
    ncp_dl_version version;
    void *manager_ctx;
    void (*deleter)(struct ncp_dl_managed_versioned *self);
    uint64_t flags;
    ncp_dl_tensor dl_tensor;
} ncp_dl_managed_versioned;

/* Fills *v from a DLPack capsule (legacy "dltensor" or "dltensor_versioned"); `name` is the
 * argument's name for error messages. None gives present = 0 when allow_none, else an error.
 * Returns 0 on success, -1 with a Python exception set. */
int ncp_view_from_capsule(PyObject *obj, const char *name, int allow_none, ncp_view *v);

#endif /* NCP_DLPACK_VIEW_H */
