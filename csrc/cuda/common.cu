/*
 * cuda/common.cu: device selection around launches (the Python module makes the tensors' device
 * current for the length of one call and restores the caller's).
 */
#include <cuda_runtime.h>

#include "ncp/ncp.h"
#include "ncp/ncp_check.h"

extern "C" ncp_status ncp_cuda_device_enter(int32_t device, int32_t *previous) {
    int prev = 0;
    NCP_CUDA_CHECK(cudaGetDevice(&prev));
    *previous = prev;
    if (prev != device) NCP_CUDA_CHECK(cudaSetDevice(device));
    return NCP_OK;
}

extern "C" void ncp_cuda_device_exit(int32_t previous) {
    int cur = 0;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != previous) (void)cudaSetDevice(previous);
}
