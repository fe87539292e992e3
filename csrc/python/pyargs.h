/*
 * pyargs.h: argument parsing, validation and error mapping shared by the _C functions.
 */
#ifndef NCP_PYARGS_H
#define NCP_PYARGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "dlpack_view.h"
#include "ncp/ncp.h"

/* _C.Fallback, owned by the module state; set in module_exec. */
extern PyObject *ncp_py_fallback_exc;

/* Sets the exception for `st` with ncp_last_error() as its message; returns NULL. */
PyObject *ncp_py_raise(ncp_status st);

int ncp_py_nargs(const char *fn, Py_ssize_t nargs, Py_ssize_t want);
int ncp_py_i64(PyObject *o, const char *name, int64_t *out);
int ncp_py_i32(PyObject *o, const char *name, int32_t *out);
/* As ncp_py_i64 / ncp_py_i32, but a bool counts as an int, as in Python: the THD and MiMo names
 * accept what the reference accepts there. */
int ncp_py_int64(PyObject *o, const char *name, int64_t *out);
int ncp_py_int32(PyObject *o, const char *name, int32_t *out);
int ncp_py_f64(PyObject *o, const char *name, double *out);
int ncp_py_stream(PyObject *o, void **out);

/* Keyword-only arguments of a METH_FASTCALL | METH_KEYWORDS function, by name (no positional
 * lists at the boundary). `required` has bit i set for each required name; absent optional
 * arguments come back as NULL. The names are interned on the first call. */
#define NCP_KW_MAX 32
typedef struct {
    const char *fn;
    int n;
    unsigned required;
    const char *names[NCP_KW_MAX];
    PyObject *interned[NCP_KW_MAX];
} ncp_kwspec;
int ncp_py_kwargs(ncp_kwspec *spec, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **out);

#define NCP_DT(x) (1u << (x))
#define NCP_DT_INT (NCP_DT(NCP_DT_I32) | NCP_DT(NCP_DT_I64))
#define NCP_DT_FLOAT (NCP_DT(NCP_DT_F16) | NCP_DT(NCP_DT_BF16) | NCP_DT(NCP_DT_F32) | NCP_DT(NCP_DT_F64))

/* Checks a present view: dtype in dtype_mask, ndim (< 0: any), contiguity (0 none, 1 last dim,
 * 2 whole tensor). Returns 0 or -1 with ValueError naming the argument. */
int ncp_py_expect(const ncp_view *v, const char *name, unsigned dtype_mask, int ndim, int contiguous);
/* Exact shape check; `desc` describes the expected shape in the message. */
int ncp_py_shape(const ncp_view *v, const char *name, int ndim, const int64_t *shape, const char *desc);
/* Every present view on one device; returns it through dev/dev_id. */
int ncp_py_same_device(ncp_view *const *views, const char *const *names, int n, ncp_device_kind *dev, int32_t *dev_id);

/* Makes dev_id current (CUDA builds) or reports that CUDA was not built. */
ncp_status ncp_py_cuda_enter(int32_t dev_id, int32_t *prev);
void ncp_py_cuda_exit(int32_t prev);

#ifdef NCP_WITH_CUDA
#define NCP_PY_CUDA(expr) (expr)
#else
#define NCP_PY_CUDA(expr) ncp_py_no_cuda()
#endif
ncp_status ncp_py_no_cuda(void);

/* st_out = cpu_expr on the CPU (GIL released), or cuda_expr with dev_id current. */
#define NCP_PY_RUN(dev, dev_id, cpu_expr, cuda_expr, st_out)                                   \
    do {                                                                                      \
        if ((dev) == NCP_DEV_CPU) {                                                           \
            Py_BEGIN_ALLOW_THREADS(st_out) = (cpu_expr);                                      \
            Py_END_ALLOW_THREADS                                                              \
        } else {                                                                              \
            int32_t prev_ = 0;                                                                \
            (st_out) = ncp_py_cuda_enter((dev_id), &prev_);                                   \
            if ((st_out) == NCP_OK) {                                                         \
                (st_out) = NCP_PY_CUDA(cuda_expr);                                            \
                ncp_py_cuda_exit(prev_);                                                      \
            }                                                                                 \
        }                                                                                     \
    } while (0)

#endif /* NCP_PYARGS_H */
