/*
 * sm90/tma_host.cu: host helpers shared by the Hopper (sm_90a) attention kernels: the TMA tensor
 * map of a [T, H, D] 16-bit tensor (cuTensorMapEncodeTiled through the runtime's driver entry
 * point, 128B swizzle, boxes of 64 columns x one head x box_rows tokens) and the run-time check
 * that the Hopper kernels can run (sm_90a build, compute capability 9.0, the driver entry point).
 * Declared in arch.cuh. Test: pytest tests/test_sink_attention_cuda.py
 */
#include "ncp/ncp_check.h"
#include "ncp_internal.h"
#include "arch.cuh"

typedef CUresult (*ncp_encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                        const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                        CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static ncp_encode_tiled_fn encode_fn(void) {
    static ncp_encode_tiled_fn fn = []() -> ncp_encode_tiled_fn {
        void *f = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            return nullptr;
        return reinterpret_cast<ncp_encode_tiled_fn>(f);
    }();
    return fn;
}

ncp_status ncp_sm90_tensor_map(CUtensorMap *map, const void *base, int T, int H, int D, int64_t st, int64_t sh,
                               int box_rows) {
    ncp_encode_tiled_fn fn = encode_fn();
    NCP_CHECK(fn != nullptr, NCP_ERR_CUDA, "cuTensorMapEncodeTiled is not available from the CUDA driver");
    const cuuint64_t dims[3] = {(cuuint64_t)D, (cuuint64_t)H, (cuuint64_t)(T > 0 ? T : 1)};
    const cuuint64_t strides[2] = {(cuuint64_t)sh * 2, (cuuint64_t)st * 2};
    const cuuint32_t box[3] = {64, 1, (cuuint32_t)box_rows};
    const cuuint32_t estr[3] = {1, 1, 1};
    const CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT16 /* a copy of 16-bit elements */, 3, const_cast<void *>(base), dims, strides, box, estr,
                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    NCP_CHECK(r == CUDA_SUCCESS, NCP_ERR_CUDA, "cuTensorMapEncodeTiled failed (CUresult %d; T=%d H=%d D=%d strides %lld/%lld)",
              (int)r, T, H, D, (long long)st, (long long)sh);
    return NCP_OK;
}

int ncp_sm90_usable(void) {
#ifdef NCP_SM90A_BUILD
    static int cached[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) return 0;
    if (dev < 64 && cached[dev] != 0) return cached[dev] > 0;
    int major = 0, minor = 0;
    const int ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                   cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
                   major == 9 && minor == 0 && encode_fn() != nullptr;
    if (dev < 64) cached[dev] = ok ? 1 : -1;
    return ok;
#else
    return 0;
#endif
}
