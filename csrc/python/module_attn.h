/*
 * module_attn.h: the _C functions of module_attn.c (sink attention, Magi plans) and module_cp.c (the
 * CP rank step) and their method table entries, which module.c puts in the module's table.
 */
#ifndef NCP_MODULE_ATTN_H
#define NCP_MODULE_ATTN_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *ncp_py_sink_attn_fwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *ncp_py_sink_attn_bwd(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *ncp_py_sink_attn_fwd_x(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *ncp_py_sink_attn_bwd_x(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *ncp_py_exchange_init(PyObject *m, PyObject *types);
PyObject *ncp_py_sink_attn_bwd_workspace(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *ncp_py_sink_attn_kernels(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *ncp_py_sink_attn_check_mask(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *ncp_py_attn_debug(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *ncp_py_magi_dispatch(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
PyObject *ncp_py_plan_build(PyObject *m, PyObject *const *args, Py_ssize_t nargs);
/* module_cp.c */
PyObject *ncp_py_kv_gather(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *ncp_py_kv_assemble(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *ncp_py_kv_grad_sum(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *ncp_py_runs_expand(PyObject *m, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);

#define NCP_KW_METHOD(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL | METH_KEYWORDS, doc}
#define NCP_ATTN_METHODS                                                                                             \
    NCP_KW_METHOD("sink_attn_fwd", ncp_py_sink_attn_fwd,                                                             \
                  "sink_attn_fwd(*, q, k, v, out, lse, sink=None, scale, cu_seqlens=None, window=0, row_lo=None, "    \
                  "row_hi=None, stream=None): learned-sink attention forward into out and lse."),                    \
    NCP_KW_METHOD("sink_attn_bwd", ncp_py_sink_attn_bwd,                                                             \
                  "sink_attn_bwd(*, q, k, v, out, lse, dout, dq, dk, dv, sink=None, dsink=None, workspace=None, "     \
                  "scale, cu_seqlens=None, window=0, row_lo=None, row_hi=None, deterministic=0, stream=None)."),     \
    {"sink_attn_fwd_x", (PyCFunction)(void (*)(void))ncp_py_sink_attn_fwd_x, METH_FASTCALL,                       \
     "sink_attn_fwd_x(q, k, v, out, lse, sink, cu_seqlens, row_lo, row_hi, scale, window): sink_attn_fwd with "     \
     "tensor objects read through the DLPack C exchange API, on their current stream; NotImplemented when a "      \
     "tensor is not for that path."},                                                                              \
    {"sink_attn_bwd_x", (PyCFunction)(void (*)(void))ncp_py_sink_attn_bwd_x, METH_FASTCALL,                       \
     "sink_attn_bwd_x(q, k, v, out, lse, dout, dq, dk, dv, sink, dsink, workspace, cu_seqlens, row_lo, row_hi, "   \
     "scale, window, deterministic): sink_attn_bwd likewise."},                                                    \
    {"exchange_init", (PyCFunction)ncp_py_exchange_init, METH_O,                                                   \
     "exchange_init(types) -> bool: registers the tensor types (a tuple; the first carries "                       \
     "__dlpack_c_exchange_api__) whose objects the _x calls read; False when the API is not usable."},             \
    NCP_KW_METHOD("sink_attn_bwd_workspace", ncp_py_sink_attn_bwd_workspace,                                         \
                  "sink_attn_bwd_workspace(*, Tq, Tk, Hq, D, has_sink, deterministic, device) -> bytes of workspace " \
                  "the CUDA backward needs on that device (0 without CUDA)."),                                       \
    NCP_KW_METHOD("sink_attn_kernels", ncp_py_sink_attn_kernels,                                                     \
                  "sink_attn_kernels(*, deterministic=0, device=0) -> (forward, backward) kernel names."),           \
    NCP_KW_METHOD("sink_attn_check_mask", ncp_py_sink_attn_check_mask,                                               \
                  "sink_attn_check_mask(*, Tq, Tk, cu_seqlens=None, row_lo=None, row_hi=None): host check of the "   \
                  "mask data."),                                                                                     \
    NCP_KW_METHOD("attn_debug", ncp_py_attn_debug,                                                                   \
                  "attn_debug(*, portable=None, grid=None, whole_tiles=None, order_waves=None) -> previous "         \
                  "(portable, grid, whole_tiles, order_waves): test hooks of the attention dispatcher."),            \
    NCP_KW_METHOD("kv_gather", ncp_py_kv_gather,                                                                     \
                  "kv_gather(*, a, b, idx, out, stream=None): out[j] = [a[idx[j]] | b[idx[j]]] (CP rank step)."),     \
    NCP_KW_METHOD("kv_assemble", ncp_py_kv_assemble,                                                                 \
                  "kv_assemble(*, k, v, recv, slot_src, kbuf, vbuf, stream=None): the K/V buffer sorted by "         \
                  "position from local and received rows (CP rank step)."),                                          \
    NCP_KW_METHOD("kv_grad_sum", ncp_py_kv_grad_sum,                                                                 \
                  "kv_grad_sum(*, dkbuf, dvbuf, local_slot, back, ret_off, ret_idx, dk, dv, stream=None): "          \
                  "gradients of local rows plus those other ranks returned, fp32, rank order (CP rank step)."),      \
    NCP_KW_METHOD("runs_expand", ncp_py_runs_expand,                                                                 \
                  "runs_expand(*, runs, out, runs_dev=None, stream=None): out[o + t * stride] = val + t * step for "  \
                  "every run (o, len, stride, val, step) of the host table runs (a plan's tables)."),               \
    {"magi_dispatch", (PyCFunction)(void (*)(void))ncp_py_magi_dispatch, METH_FASTCALL,                             \
     "magi_dispatch(cu_seqlens_host, cp_size, chunk_size, total_padded, owner_out)."},                              \
    {"plan_build", (PyCFunction)(void (*)(void))ncp_py_plan_build, METH_FASTCALL,                                   \
     "plan_build(cu_seqlens_host, cp_size, cp_rank, requested_chunk, min_chunks_per_rank, windows) -> dict."}

#endif /* NCP_MODULE_ATTN_H */
