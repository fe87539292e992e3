/*
 * common.c: small facts about the build and the dtypes.
 */
#include "ncp/ncp.h"

#ifndef NCP_CUDA_ARCHS_STR
#define NCP_CUDA_ARCHS_STR ""
#endif

size_t ncp_dtype_size(ncp_dtype dt) {
    switch (dt) {
    case NCP_DT_BOOL: return 1;
    case NCP_DT_F16:
    case NCP_DT_BF16: return 2;
    case NCP_DT_I32:
    case NCP_DT_F32: return 4;
    case NCP_DT_I64:
    case NCP_DT_F64: return 8;
    }
    return 0;
}

int ncp_built_with_cuda(void) {
#ifdef NCP_WITH_CUDA
    return 1;
#else
    return 0;
#endif
}

const char *ncp_cuda_archs(void) { return NCP_CUDA_ARCHS_STR; }

/* Rows per pre-pass block, rounded up; in 64 bits, so Tq near INT32_MAX does not overflow. */
int32_t ncp_sink_attn_bwd_n_part(int32_t Tq) {
    return Tq <= 0 ? 1 : (int32_t)(((int64_t)Tq + NCP_BWD_PRE_ROWS - 1) / NCP_BWD_PRE_ROWS);
}

#ifndef NCP_WITH_CUDA
int ncp_sink_attn_fwd_variant(void) { return 0; }
int ncp_sink_attn_bwd_variant(void) { return 0; }
#endif
