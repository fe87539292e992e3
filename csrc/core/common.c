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

#ifndef NCP_WITH_CUDA
/* A build without CUDA: no kernels, no workspace, no hooks to set. */
int64_t ncp_sink_attn_bwd_workspace(int32_t Tq, int32_t Tk, int32_t Hq, int32_t D, int32_t has_sink,
                                    int32_t deterministic, int32_t window) {
    (void)Tq, (void)Tk, (void)Hq, (void)D, (void)has_sink, (void)deterministic, (void)window;
    return 0;
}
void ncp_sink_attn_kernels(int32_t deterministic, int32_t D, int32_t window, const char **fwd, const char **bwd) {
    (void)deterministic, (void)D, (void)window;
    *fwd = *bwd = "none";
}
static ncp_attn_debug g_debug;
void ncp_attn_debug_set(const ncp_attn_debug *d) { g_debug = *d; }
ncp_attn_debug ncp_attn_debug_get(void) { return g_debug; }
#endif
