/*
 * status.c: the thread-local error message behind ncp_status.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "ncp/ncp_check.h"

#define NCP_ERR_BUF_SIZE 65536

static _Thread_local char ncp_err_buf[NCP_ERR_BUF_SIZE];

ncp_status ncp_set_error(ncp_status code, const char *file, int line, const char *func, const char *cond,
                         const char *fmt, ...) {
    size_t used = 0;
    if (file != NULL) {
        const char *base = strrchr(file, '/');
        int n = snprintf(ncp_err_buf, sizeof ncp_err_buf, "%s:%d %s: `%s` failed: ", base ? base + 1 : file,
                         line, func ? func : "?", cond ? cond : "?");
        used = (n > 0 && (size_t)n < sizeof ncp_err_buf) ? (size_t)n : 0;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ncp_err_buf + used, sizeof ncp_err_buf - used, fmt, ap);
    va_end(ap);
    return code;
}

const char *ncp_last_error(void) { return ncp_err_buf; }

const char *ncp_status_name(ncp_status st) {
    switch (st) {
    case NCP_OK: return "NCP_OK";
    case NCP_ERR_INVALID_ARG: return "NCP_ERR_INVALID_ARG";
    case NCP_ERR_UNSUPPORTED: return "NCP_ERR_UNSUPPORTED";
    case NCP_ERR_CUDA: return "NCP_ERR_CUDA";
    case NCP_ERR_NOMEM: return "NCP_ERR_NOMEM";
    case NCP_ERR_FALLBACK: return "NCP_ERR_FALLBACK";
    }
    return "NCP_ERR_?";
}
