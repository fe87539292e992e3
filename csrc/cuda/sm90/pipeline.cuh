/*
 * sm90/pipeline.cuh: the bookkeeping of mbarrier-guarded shared-memory rings on Hopper, shared by
 * the forward and backward kernels. A ring of S stages is used in order: the n-th use takes stage
 * n % S and waits for phase parity (n / S) & 1 of that stage's "full" barrier (the producer's TMA
 * completes it); the producer waits for the opposite parity of the "empty" barrier before it
 * reuses a stage (the consumers' warps each arrive once when they are done with it).
 */
#ifndef NCP_SM90_PIPELINE_CUH
#define NCP_SM90_PIPELINE_CUH

#include "arch.cuh"

namespace ncp {
namespace sm90 {

template <int S> struct Ring {
    static constexpr int kStages = S;
    static __device__ __forceinline__ int slot(int n) { return n % S; }
    /* Parity the consumer waits for on the full barrier of use n. */
    static __device__ __forceinline__ uint32_t full_phase(int n) { return (uint32_t)((n / S) & 1); }
    /* Parity the producer waits for on the empty barrier before use n (n >= S). */
    static __device__ __forceinline__ uint32_t empty_phase(int n) { return (uint32_t)(((n / S) & 1) ^ 1); }
};

#ifdef NCP_SM90_DEVICE
/* One arrival per warp on `bar` once every lane of the warp is done (its reads precede it). */
__device__ __forceinline__ void warp_arrive(uint32_t bar) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(bar);
}
#endif

}  // namespace sm90
}  // namespace ncp

#endif /* NCP_SM90_PIPELINE_CUH */
