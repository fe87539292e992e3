/*
 * sink_attn/launch.h: what the dispatcher (dispatch.cu) hands the kernel files: the decisions of
 * one call (attn_config), the carved backward workspace, and the launchers each kernel file
 * exports. Internal to the CUDA objects; the C ABI is ncp.h.
 */
#ifndef NCP_SINK_ATTN_LAUNCH_H
#define NCP_SINK_ATTN_LAUNCH_H

#include <cuda_runtime.h>

#include "ncp/ncp.h"
#include "ncp/ncp_check.h"

namespace ncp {

constexpr int kMaxDevices = 64;

/* Facts and test hooks of one call, read once by the dispatcher. */
struct attn_config {
    int device;      /* current CUDA device */
    int sm_count;    /* its multiprocessors: the persistent grid */
    int grid;        /* test hook: cap of the persistent grid (0: sm_count) */
    int whole_tiles; /* test hook: no half tiles in the Hopper forward */
};

/* The backward workspace, carved by the dispatcher out of the caller's buffer. */
struct bwd_workspace {
    float *delta;      /* (Hq, Tq) rowsum(dO * O) */
    float *dsink_part; /* (Hq, n_part) dsink partial sums, or NULL without a sink */
    int32_t n_part;
    float *dq_accum;   /* atomic-dQ Hopper backward: (Hq, ceil(Tq / 64), D / 64, 64 x 64) fp32, else NULL */
};

/* Rows per dsink partial sum in the backward pre-pass. */
constexpr int kPreRows = 128;

/* portable_fwd.cu / portable_bwd.cu: mma.sync kernels, any sm_80+ GPU. */
ncp_status attn_fwd_portable(const ncp_sink_attn_params &p, cudaStream_t s);
ncp_status attn_bwd_prepass(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, cudaStream_t s);
ncp_status attn_bwd_portable(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, cudaStream_t s);
/* sm90_fwd.cu / sm90_bwd.cu: Hopper (sm_90a) kernels. */
ncp_status attn_fwd_sm90(const ncp_sink_attn_params &p, const attn_config &cfg, cudaStream_t s);
ncp_status attn_bwd_sm90(const ncp_sink_attn_bwd_params &b, const bwd_workspace &ws, const attn_config &cfg,
                         cudaStream_t s);

}  // namespace ncp

#endif /* NCP_SINK_ATTN_LAUNCH_H */
