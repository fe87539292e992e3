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

/* ---- the DLPack C exchange API (DLPack 1.3: `type(t).__dlpack_c_exchange_api__`, a capsule named
 * "dlpack_exchange_api"; torch 2.10 and later) ----------------------------------------------
 * Function pointers a framework publishes so that a C extension reads its tensors without a
 * Python call or a capsule: `dltensor_from_py_object_no_sync` fills a caller-owned DLTensor that
 * borrows the tensor's data, shape and strides (valid while the object lives: the length of one
 * call into _C), and `current_work_stream` names the framework's current stream of a device. We
 * declare only the layout (the header and the five pointers, in the specification's order) and call
 * those two; the other three are never called. */
typedef struct {
    ncp_dl_version version;
    void *prev_api;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    int (*dltensor_from_py_object_no_sync)(void *py_object, ncp_dl_tensor *out);
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void **out_stream);
} ncp_dl_exchange_api;

/* Registers the tensor types whose objects the exchange API may read: `types` is a tuple of type
 * objects (torch.Tensor, torch.nn.Parameter), the first of which carries the API. Returns 1 when
 * the API is usable (major version 1, both functions present), 0 when not (older torch: the
 * capsule path stays the only one), -1 with an exception for a bad argument. */
int ncp_exchange_init(PyObject *types);

/* Fills *v from a registered tensor object through the exchange API (None: present = 0).
 * Returns 1 when filled, 0 when this object is not for the fast path (the API is not
 * registered, the object's type is not one of the registered ones, or the framework refused it;
 * no exception is left set: the caller takes the capsule path, whose errors name the argument),
 * -1 with an exception naming the argument for what the view itself cannot hold (dtype, ndim). */
int ncp_view_from_object(PyObject *obj, const char *name, ncp_view *v);

/* The framework's current stream on CUDA device dev_id, through the exchange API (registered).
 * Returns 0, or -1 with the framework's exception set. */
int ncp_exchange_stream(int32_t dev_id, void **stream);

/* Fills *v from a DLPack capsule (legacy "dltensor" or "dltensor_versioned"); `name` is the
 * argument's name for error messages. None gives present = 0 when allow_none, else an error.
 * Returns 0 on success, -1 with a Python exception set. */
int ncp_view_from_capsule(PyObject *obj, const char *name, int allow_none, ncp_view *v);

#endif /* NCP_DLPACK_VIEW_H */
