/*
 * module.c: nemo_cp_native._C, the Python-facing C (CPython C API, METH_FASTCALL); this file holds
 * the module definition and the THD/MiMo functions, module_attn.c the attention and plan ones.
 *
 * Every function takes DLPack capsules (Python calls t.detach().__dlpack__(...)) and plain ints,
 * validates what it receives (device, dtype, ndim, shape, strides), picks the CPU or CUDA entry
 * point, and maps ncp_status to an exception:
 *     INVALID_ARG -> ValueError, UNSUPPORTED -> NotImplementedError, CUDA -> RuntimeError,
 *     NOMEM -> MemoryError, FALLBACK -> _C.Fallback (the caller runs the reference path).
 * CUDA work is launched on the stream the caller passes (torch's current stream, as an int).
 * Python allocates every output; nothing here allocates tensors or keeps pointers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "dlpack_view.h"
#include "ncp/ncp.h"
#include "pyargs.h"
#include "pyargs_mimo.h"

#include "module_attn.h"

/* ======================================================================================== */
/* thd partition                                                                             */
/* ======================================================================================== */

static PyObject *py_thd_partition(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    /* (cu_seqlens, out, total_tokens, cp_size, cp_rank, stream) */
    (void)m;
    if (ncp_py_nargs("thd_partition", nargs, 6) < 0) return NULL;
    ncp_view cu, out;
    ncp_thd_partition_params p;
    memset(&p, 0, sizeof p);
    void *stream;
    if (ncp_view_from_capsule(args[0], "cu_seqlens", 0, &cu) < 0 || ncp_view_from_capsule(args[1], "out", 0, &out) < 0 ||
        ncp_py_int64(args[2], "total_tokens", &p.total_tokens) < 0 || ncp_py_int32(args[3], "cp_size", &p.cp_size) < 0 ||
        ncp_py_int32(args[4], "cp_rank", &p.cp_rank) < 0 || ncp_py_stream(args[5], &stream) < 0)
        return NULL;
    if (ncp_py_expect(&cu, "cu_seqlens", NCP_DT(NCP_DT_I32), 1, 2) < 0 || ncp_py_expect(&out, "out", NCP_DT(NCP_DT_I32), 1, 2) < 0) return NULL;
    ncp_view *views[] = {&cu, &out};
    const char *names[] = {"cu_seqlens", "out"};
    ncp_device_kind dev;
    int32_t dev_id;
    if (ncp_py_same_device(views, names, 2, &dev, &dev_id) < 0) return NULL;
    if (p.cp_size > 0 && out.shape[0] != p.total_tokens / p.cp_size) {
        PyErr_Format(PyExc_ValueError, "out must have total_tokens / cp_size = %lld entries; got %lld",
                     (long long)(p.total_tokens / p.cp_size), (long long)out.shape[0]);
        return NULL;
    }
    if (cu.shape[0] > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "cu_seqlens has %lld entries; at most 2^31 - 1 are supported",
                     (long long)cu.shape[0]);
        return NULL;
    }
    p.cu_seqlens = (const int32_t *)cu.data;
    p.n_cu = (int32_t)cu.shape[0];
    p.out = (int32_t *)out.data;
    ncp_status st;
    NCP_PY_RUN(dev, dev_id, ncp_thd_partition_cpu(&p), ncp_thd_partition_cuda(&p, stream), st);
    if (st != NCP_OK) return ncp_py_raise(st);
    Py_RETURN_NONE;
}

static PyObject *py_thd_partition_validate(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    /* (cu_seqlens_host, cp_size[, total_tokens]): with total_tokens, also cu_seqlens[-1] <= total_tokens */
    (void)m;
    if (nargs != 2 && nargs != 3) {
        PyErr_Format(PyExc_TypeError, "thd_partition_validate() takes 2 or 3 arguments (%zd given)", nargs);
        return NULL;
    }
    ncp_view cu;
    int32_t cp;
    int64_t total = 0;
    if (ncp_view_from_capsule(args[0], "cu_seqlens", 0, &cu) < 0 || ncp_py_int32(args[1], "cp_size", &cp) < 0) return NULL;
    if (nargs == 3 && ncp_py_int64(args[2], "total_tokens", &total) < 0) return NULL;
    if (ncp_py_expect(&cu, "cu_seqlens", NCP_DT(NCP_DT_I32), 1, 2) < 0) return NULL;
    if (cu.device != NCP_DEV_CPU) {
        PyErr_SetString(PyExc_ValueError, "cu_seqlens must be a host tensor here (thd_partition_validate reads it on the host)");
        return NULL;
    }
    if (cu.shape[0] > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "cu_seqlens has %lld entries; at most 2^31 - 1 are supported",
                     (long long)cu.shape[0]);
        return NULL;
    }
    const int32_t *data = (const int32_t *)cu.data;
    const int32_t n = (int32_t)cu.shape[0];
    ncp_status st = nargs == 3 ? ncp_thd_partition_validate_total(data, n, cp, total) : ncp_thd_partition_validate(data, n, cp);
    if (st != NCP_OK) return ncp_py_raise(st);
    Py_RETURN_NONE;
}

/* ======================================================================================== */
/* MiMo sharder                                                                              */
/* ======================================================================================== */

static PyObject *py_mimo_plan(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    /* (B, S, n_real, n_pad, num_chunks, cp_size, outputs) -> (L, Tc, local_off, ids_off, lab_off, pos_off,
     *  pad_off, img_off, vid_off, lay_off, lay_words, out_words) */
    (void)m;
    if (ncp_py_nargs("mimo_plan", nargs, 7) < 0) return NULL;
    int64_t B, S, nr, np_, outputs;
    int32_t C, W;
    if (ncp_py_int64(args[0], "B", &B) < 0 || ncp_py_int64(args[1], "S", &S) < 0 ||
        ncp_py_int64(args[2], "n_real", &nr) < 0 || ncp_py_int64(args[3], "n_pad", &np_) < 0 ||
        ncp_py_int32(args[4], "num_chunks", &C) < 0 || ncp_py_int32(args[5], "cp_size", &W) < 0 ||
        ncp_py_int64(args[6], "outputs", &outputs) < 0)
        return NULL;
    if (outputs < 0 || outputs > 31) {
        PyErr_Format(PyExc_ValueError, "outputs=%lld is not a set of NCP_MIMO_* bits", (long long)outputs);
        return NULL;
    }
    ncp_mimo_plan pl;
    ncp_status st = ncp_mimo_plan_make(B, S, nr, np_, C, W, (unsigned)outputs, &pl);
    if (st != NCP_OK) return ncp_py_raise(st);
    return Py_BuildValue("(LLLLLLLLLLLL)", (long long)pl.L, (long long)pl.Tc, (long long)pl.local_off,
                         (long long)pl.ids_off, (long long)pl.lab_off, (long long)pl.pos_off, (long long)pl.pad_off,
                         (long long)pl.img_off, (long long)pl.vid_off, (long long)pl.lay_off, (long long)pl.lay_words,
                         (long long)pl.out_words);
}

static ncp_kwspec mimo_run_spec = {"mimo_run", 15, 0x3fbb,
                                   {"input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded", "out", "host",
                                    "num_chunks", "cp_size", "cp_rank", "image_token_id", "video_token_id", "sentinel",
                                    "outputs", "stream"},
                                   {0}};

/* The rest of one mimo_run / mimo_run_x call once the views are read: scalars args[7..13], checks,
 * the run. `exchange`: launch on torch's current stream of input_ids' device (DLPack C exchange
 * API), else on `stream`. */
static PyObject *mimo_run_views(const ncp_view *v, PyObject *const *args, void *stream, int exchange) {
    ncp_pym_mimo_args a;
    if (ncp_pym_mimo_scalars(args, &a) < 0) return NULL;
    ncp_mimo_run_params p;
    if (ncp_pym_mimo_params(v, &a, &p) < 0) return NULL;
    if (exchange && v[NCP_PYM_IDS].device == NCP_DEV_CUDA && ncp_exchange_stream(v[NCP_PYM_IDS].device_id, &stream) < 0)
        return NULL;
    ncp_mimo_layout_info info;
    memset(&info, 0, sizeof info);
    ncp_status st;
    NCP_PY_RUN(v[NCP_PYM_IDS].device, v[NCP_PYM_IDS].device_id, ncp_mimo_run_cpu(&p, &info),
               ncp_mimo_run_cuda(&p, &info, stream), st);
    if (st != NCP_OK) return ncp_py_raise(st);
    return Py_BuildValue("(LLLLLi)", (long long)info.cu_off, (long long)info.cu_width, (long long)info.cup_off,
                         (long long)info.cup_width, (long long)info.maxlen_off, (int)info.emit_padded);
}

static PyObject *py_mimo_run(PyObject *m, PyObject *const *kwargs, Py_ssize_t nargs, PyObject *kwnames) {
    /* keyword-only: (input_ids, labels, position_ids=None, seq_lens, seq_lens_padded, out, host=None,
     *  num_chunks, cp_size, cp_rank, image_token_id, video_token_id, sentinel, outputs, stream=None)
     *  -> (cu_off, cu_width, cup_off, cup_width, maxlen_off, emit_padded), int64 word offsets into the
     *  layout block (out[lay_off:], or host: int32 or int64). Token or length inputs outside the native
     *  path, including dtypes DLPack carries but a view does not map, raise _C.Fallback. */
    (void)m;
    PyObject *args[15];
    if (ncp_py_kwargs(&mimo_run_spec, kwargs, nargs, kwnames, args) < 0) return NULL;
    for (int i = 0; i < 15; ++i)
        if (args[i] == NULL) args[i] = Py_None;
    ncp_view v[NCP_PYM_NVIEWS];
    if (ncp_pym_mimo_views(args, v) < 0) return NULL;
    void *stream;
    if (ncp_py_stream(args[14], &stream) < 0) return NULL;
    return mimo_run_views(v, args, stream, 0);
}

static PyObject *py_mimo_run_x(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    /* mimo_run with positional tensor objects read through the DLPack C exchange API and the
     * framework's current stream of input_ids' device: (input_ids, labels, position_ids, seq_lens,
     * seq_lens_padded, out, host, num_chunks, cp_size, cp_rank, image_token_id, video_token_id,
     * sentinel, outputs) -> mimo_run's tuple, or NotImplemented, having done nothing, when a tensor
     * is not for this path (the caller makes capsules and calls mimo_run). */
    (void)m;
    if (ncp_py_nargs("mimo_run_x", nargs, 14) < 0) return NULL;
    ncp_view v[NCP_PYM_NVIEWS];
    const int r = ncp_pym_mimo_views_x(args, v);
    if (r < 0) return NULL;
    if (r == 0) Py_RETURN_NOTIMPLEMENTED;
    return mimo_run_views(v, args, NULL, 1);
}

/* ======================================================================================== */
/* module definition                                                                         */
/* ======================================================================================== */

static PyObject *py_build_info(PyObject *m, PyObject *noargs) {
    (void)m;
    (void)noargs;
    return Py_BuildValue("{s:O,s:s}", "cuda", ncp_built_with_cuda() ? Py_True : Py_False, "cuda_archs", ncp_cuda_archs());
}

static PyMethodDef methods[] = {
    {"thd_partition", (PyCFunction)(void (*)(void))py_thd_partition, METH_FASTCALL,
     "thd_partition(cu_seqlens, out, total_tokens, cp_size, cp_rank, stream): TE's DualChunkSwap indices."},
    {"thd_partition_validate", (PyCFunction)(void (*)(void))py_thd_partition_validate, METH_FASTCALL,
     "thd_partition_validate(cu_seqlens_host, cp_size[, total_tokens]): host check of document lengths (and, "
     "with total_tokens, that cu_seqlens[-1] <= total_tokens)."},
    {"mimo_plan", (PyCFunction)(void (*)(void))py_mimo_plan, METH_FASTCALL,
     "mimo_plan(B, S, n_real, n_pad, num_chunks, cp_size, outputs) -> carving of the flat output buffer."},
    {"mimo_run", (PyCFunction)(void (*)(void))py_mimo_run, METH_FASTCALL | METH_KEYWORDS,
     "mimo_run(*, input_ids, labels, position_ids=None, seq_lens, seq_lens_padded, out, host=None, num_chunks, cp_size, "
     "cp_rank, image_token_id, video_token_id, sentinel, outputs, stream=None) -> layout offsets: one whole MiMo "
     "sharder call (Fallback for inputs outside the native path)."},
    {"mimo_run_x", (PyCFunction)(void (*)(void))py_mimo_run_x, METH_FASTCALL,
     "mimo_run_x(input_ids, labels, position_ids, seq_lens, seq_lens_padded, out, host, num_chunks, cp_size, cp_rank, "
     "image_token_id, video_token_id, sentinel, outputs): mimo_run with tensor objects read through the DLPack C "
     "exchange API, on their current stream; NotImplemented when a tensor is not for that path."},
    NCP_ATTN_METHODS,
    {"build_info", py_build_info, METH_NOARGS, "build_info() -> dict describing this build."},
    {NULL, NULL, 0, NULL},
};

typedef struct {
    PyObject *fallback; /* _C.Fallback */
} module_state;

static module_state *get_state(PyObject *m) { return (module_state *)PyModule_GetState(m); }

static int module_exec(PyObject *m) {
    module_state *s = get_state(m);
    s->fallback = PyErr_NewExceptionWithDoc(
        "nemo_cp_native._C.Fallback",
        "Raised by a native entry point for valid input outside its fast path; the caller runs the reference.", NULL,
        NULL);
    if (s->fallback == NULL) return -1;
    ncp_py_fallback_exc = s->fallback;
    if (PyModule_AddObjectRef(m, "Fallback", s->fallback) < 0) return -1;
    if (PyModule_AddIntConstant(m, "CUDA", ncp_built_with_cuda()) < 0) return -1;
    return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg) {
    Py_VISIT(get_state(m)->fallback);
    return 0;
}

static int module_clear(PyObject *m) {
    if (ncp_py_fallback_exc == get_state(m)->fallback) ncp_py_fallback_exc = NULL;
    Py_CLEAR(get_state(m)->fallback);
    return 0;
}

static void module_free(void *m) { module_clear((PyObject *)m); }

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, (void *)module_exec},
    {0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "nemo_cp_native._C", "Native core of nemo_cp_native (C/CUDA over DLPack).",
    sizeof(module_state),  methods,             slots,
    module_traverse,       module_clear,        module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&moduledef); }
