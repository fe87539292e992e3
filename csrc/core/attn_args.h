/*
 * attn_args.h: the sink-attention arguments as borrowed views, and the one validator that turns
 * them into the params structs of ncp.h (attn_args.c). Not part of the public ABI.
 */
#ifndef NCP_ATTN_ARGS_H
#define NCP_ATTN_ARGS_H

#include "ncp/ncp.h"
#include "ncp_view.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Every argument of the forward and backward calls by name; absent views have present = 0. */
typedef struct {
    ncp_view q, k, v, sink, out, lse;            /* forward */
    ncp_view dout, dq, dk, dv, dsink, workspace; /* backward */
    ncp_view cu_seqlens, row_lo, row_hi;         /* mask: documents or a table */
    int32_t window;
    double scale;
    int32_t deterministic;
} ncp_attn_args;

/* Tensor facts of the forward arguments; fills *p and the device of the call. */
ncp_status ncp_attn_args_fwd(const ncp_attn_args *a, ncp_sink_attn_params *p, ncp_device_kind *dev, int32_t *dev_id);
/* The same for the backward (forward fields plus dout, gradients, dsink and workspace). */
ncp_status ncp_attn_args_bwd(const ncp_attn_args *a, ncp_sink_attn_bwd_params *b, ncp_device_kind *dev,
                             int32_t *dev_id);
/* Host check of the mask data (pointers must be host memory): cu_seqlens from 0, non-decreasing,
 * ending at Tq; or row_lo/row_hi within [0, Tk] / [-1, Tk) and non-decreasing. */
ncp_status ncp_attn_mask_check_host(const ncp_attn_mask *m, int32_t Tq, int32_t Tk);

#ifdef __cplusplus
}
#endif

#endif /* NCP_ATTN_ARGS_H */
