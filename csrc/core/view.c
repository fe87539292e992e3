/*
 * view.c: facts about borrowed tensor views (ncp_view.h) shared by the core validators and the
 * Python module: element counts, contiguity, dtype names.
 */
#include "ncp_view.h"

const char *ncp_dtype_name(ncp_dtype dt) {
    switch (dt) {
    case NCP_DT_BOOL: return "bool";
    case NCP_DT_I32: return "int32";
    case NCP_DT_I64: return "int64";
    case NCP_DT_F16: return "float16";
    case NCP_DT_BF16: return "bfloat16";
    case NCP_DT_F32: return "float32";
    case NCP_DT_F64: return "float64";
    }
    return "?";
}

int64_t ncp_view_numel(const ncp_view *v) {
    int64_t n = 1;
    for (int i = 0; i < v->ndim; ++i) n *= v->shape[i];
    return n;
}

int ncp_view_is_contiguous(const ncp_view *v) {
    for (int i = 0; i < v->ndim; ++i)
        if (v->shape[i] == 0) return 1; /* as torch: an empty tensor is contiguous whatever its strides */
    int64_t expect = 1;
    for (int i = v->ndim - 1; i >= 0; --i) {
        if (v->shape[i] != 1 && v->strides[i] != expect) return 0;
        expect *= v->shape[i];
    }
    return 1;
}
