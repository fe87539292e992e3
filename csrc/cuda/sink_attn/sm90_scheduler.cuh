/*
 * sink_attn/sm90_scheduler.cuh: the persistent tile scheduler of the Hopper kernels. Work items
 * t = (tile, head) with heads fastest and the last tiles first (under a causal or windowed mask
 * the late query tiles see the most keys, so the longest items start first and the short ones fill
 * the tail); a grid of one CTA per SM (or fewer) walks t = blockIdx.x, + gridDim.x, ...; a grid as
 * large as the item count gives one CTA per item.
 */
#ifndef NCP_SINK_ATTN_SM90_SCHEDULER_CUH
#define NCP_SINK_ATTN_SM90_SCHEDULER_CUH

namespace ncp {

struct TileScheduler {
    int n_tiles, n_heads, n_items;
    __device__ __forceinline__ TileScheduler(int rows, int heads, int rows_per_tile)
        : n_tiles((rows + rows_per_tile - 1) / rows_per_tile), n_heads(heads), n_items(n_tiles * heads) {}
    __device__ __forceinline__ int first() const { return blockIdx.x; }
    __device__ __forceinline__ int next(int t) const { return t + gridDim.x; }
    __device__ __forceinline__ bool valid(int t) const { return t < n_items; }
    __device__ __forceinline__ int head(int t) const { return t % n_heads; }
    __device__ __forceinline__ int tile(int t) const { return n_tiles - 1 - t / n_heads; }
};

}  // namespace ncp

#endif /* NCP_SINK_ATTN_SM90_SCHEDULER_CUH */
