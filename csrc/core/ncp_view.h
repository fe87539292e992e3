/*
 * ncp_view.h: a borrowed tensor as the C core sees it (no Python, no DLPack): data pointer,
 * device, dtype, shape and strides in elements. csrc/python fills views from DLPack capsules; the
 * core validators (attn_args.c) check them and build the params structs of ncp.h.
 */
#ifndef NCP_VIEW_H
#define NCP_VIEW_H

#include <stdint.h>

#include "ncp/ncp.h"

#ifdef __cplusplus
extern "C" {
#endif

#define NCP_MAX_NDIM 8

typedef enum { NCP_DEV_NONE = 0, NCP_DEV_CPU = 1, NCP_DEV_CUDA = 2, NCP_DEV_META = 3 } ncp_device_kind;

typedef struct {
    void *data;           /* data + byte_offset */
    ncp_device_kind device;
    int32_t device_id;
    ncp_dtype dtype;
    int32_t ndim;
    int64_t shape[NCP_MAX_NDIM];
    int64_t strides[NCP_MAX_NDIM]; /* in elements, compact when the producer gave none */
    int present;          /* 0 for an optional argument passed as None */
} ncp_view;

/* Number of elements; 1 for 0-d. */
int64_t ncp_view_numel(const ncp_view *v);
/* Row-major contiguous (strides compact for the shape, size-1 dims ignored). */
int ncp_view_is_contiguous(const ncp_view *v);
const char *ncp_dtype_name(ncp_dtype dt);

#ifdef __cplusplus
}
#endif

#endif /* NCP_VIEW_H */
