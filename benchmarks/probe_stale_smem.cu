/*
 * benchmarks/probe_stale_smem.cu: fills the shared memory of every SM with one 32-bit pattern
 * (0xFFFFFFFF: NaN in fp16 and bf16), so that a kernel launched next that reads a shared tile
 * before its load has landed reads NaN instead of whatever the last kernel left (usually finite).
 * Used by benchmarks/probe_stale_smem.py through ctypes:
 *   nvcc -shared -Xcompiler -fPIC -o build/probe_stale_smem.so benchmarks/probe_stale_smem.cu
 */
#include <cuda_runtime.h>

namespace {
constexpr int kBytes = 232448; /* an sm_90 block's largest dynamic shared memory */
__global__ void poison(unsigned v) {
    extern __shared__ unsigned s[];
    for (int i = threadIdx.x; i < kBytes / 4; i += blockDim.x) s[i] = v;
}
}  // namespace

/* Launches 8 blocks per SM of the current device on the legacy default stream; returns the CUDA
 * error code (0: launched). */
extern "C" int ncp_probe_poison_smem(unsigned value) {
    int dev = 0, sms = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(poison, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
    if (e != cudaSuccess) return (int)e;
    poison<<<8 * sms, 1024, kBytes>>>(value);
    return (int)cudaGetLastError();
}
