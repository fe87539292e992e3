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
    int order_waves; /* Hopper backward orders: waves per chunk, or -1: index order (the default
                      * under a window, kOrderWaves without; dispatch.cu, choose) */
};

/* Longest-first orders of the Hopper backward grids. Under a causal, windowed or document mask
 * the work of a dK/dV CTA (kBwdKvTile keys: the q tiles of kBwdKvStep rows that see them) and of a
 * dQ CTA (kBwdQTile rows: the kv tiles of kBwdQStep keys they see) varies many-fold, and a grid of
 * a few waves in index order ends on a tail of long CTAs. The pre-pass measures every tile's work,
 * the order kernel ranks the tiles (most work first, ties by index) and the grid's CTA i takes the
 * i-th tile, so the hardware's in-order dispatch to the first free SM is longest-processing-time-
 * first list scheduling. Ordering a whole large grid that way would run the same position of
 * every document at once and lose the L2 reuse of index order (CTAs of neighbouring key tiles
 * read the same Q and dO tiles and add into the same dQ tiles), so the tiles are ranked within
 * consecutive chunks of kOrderWaves waves: the last chunk, the tail, is longest first, and the
 * CTAs in flight stay within a few documents. Under a window the work hardly varies and the
 * dispatcher keeps index order (dispatch.cu, choose). */
constexpr int kBwdKvTile = 128, kBwdKvStep = 64, kBwdQTile = 128, kBwdQStep = 64;
constexpr int kOrderWaves = 2;
constexpr int kOrderThreads = 256;

/* One grid's longest-first order (NULL pointers: index order). */
struct tile_order {
    int32_t *work;  /* (n,) work per tile, written by the pre-pass */
    int32_t *order; /* (n,) order[i] = the tile with the i-th most work of i's chunk */
    int32_t n;      /* tiles */
    int32_t chunk;  /* tiles per chunk (>= 1) */
};

/* The backward workspace, carved by the dispatcher out of the caller's buffer. */
struct bwd_workspace {
    float *delta;      /* (Hq, Tq) rowsum(dO * O) */
    float *dsink_part; /* (Hq, n_part) dsink partial sums, or NULL without a sink */
    int32_t n_part;
    float *dq_accum;   /* atomic-dQ Hopper backward: (Hq, ceil(Tq / 64), D / 64, 64 x 64) fp32, else NULL */
    int32_t *dq_flag;  /* with D = 128: (Hq, ceil(Tq / 64), D / 64) claims of dq_accum's tiles (sm90_bwd_parts.cuh,
                        * write_dq), zeroed by the pre-pass in place of the accumulator; else NULL */
    tile_order kv;     /* Hopper dK/dV grid (key tiles) */
    tile_order q;      /* Hopper deterministic dQ grid (query tiles) */
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
