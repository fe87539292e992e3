/*
 * ncp_check.h: the one error sink of nemo_cp_native.
 *
 * Every failure writes a message into a thread-local buffer (read with ncp_last_error()) and
 * returns an ncp_status. Nothing here exits or aborts: the library lives inside a training job.
 *
 *   NCP_CHECK(cond, code, fmt, ...)   internal invariant; message "file:line func: `cond` failed: ..."
 *   NCP_ARG_CHECK(cond, fmt, ...)     user-facing argument check (INVALID_ARG); message is fmt as is,
 *                                     and must name the offending argument
 *   NCP_FAIL(code, fmt, ...)          set a user-facing message verbatim and return code
 *   NCP_TRY(expr)                     propagate a non-OK status
 *   NCP_CUDA_CHECK(call)              CUDA runtime call (CUDA builds only), mapped to NCP_ERR_CUDA
 */
#ifndef NCP_CHECK_H
#define NCP_CHECK_H

#include "ncp/ncp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Writes a message for `code` into the thread-local buffer and returns `code`. When `file` is
 * non-NULL the message is prefixed with "file:line func: `cond` failed: ". */
ncp_status ncp_set_error(ncp_status code, const char *file, int line, const char *func, const char *cond,
                         const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 6, 7)))
#endif
    ;

#ifdef __cplusplus
}
#endif

#define NCP_CHECK(cond, code, ...)                                                          \
    do {                                                                                    \
        if (!(cond)) return ncp_set_error((code), __FILE__, __LINE__, __func__, #cond, __VA_ARGS__); \
    } while (0)

#define NCP_ARG_CHECK(cond, ...)                                                            \
    do {                                                                                    \
        if (!(cond)) return ncp_set_error(NCP_ERR_INVALID_ARG, NULL, 0, NULL, NULL, __VA_ARGS__); \
    } while (0)

#define NCP_FAIL(code, ...) return ncp_set_error((code), NULL, 0, NULL, NULL, __VA_ARGS__)

#define NCP_TRY(expr)                      \
    do {                                   \
        ncp_status ncp_try_st_ = (expr);   \
        if (ncp_try_st_ != NCP_OK) return ncp_try_st_; \
    } while (0)

#ifdef __CUDACC__
#define NCP_CUDA_CHECK(call)                                                                  \
    do {                                                                                      \
        cudaError_t ncp_cuda_err_ = (call);                                                   \
        if (ncp_cuda_err_ != cudaSuccess)                                                     \
            return ncp_set_error(NCP_ERR_CUDA, __FILE__, __LINE__, __func__, #call, "%s (%s)", \
                                 cudaGetErrorString(ncp_cuda_err_), cudaGetErrorName(ncp_cuda_err_)); \
    } while (0)
#endif

#endif /* NCP_CHECK_H */
