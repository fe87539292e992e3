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

#include "module_attn.h"

/* ======================================================================================== */
/* thd partition                                                                             */
/* ======================================================================================== */

static PyObject *py_thd_partition(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    /* (cu_seqlens, out, total_tokens, cp_size, cp_rank, stream) */
    if (ncp_py_nargs("thd_partition", nargs, 6) < 0) return NULL;
    ncp_view cu, out;
    ncp_thd_partition_params p;
    memset(&p, 0, sizeof p);
    void *stream;
    if (ncp_view_from_capsule(args[0], "cu_seqlens", 0, &cu) < 0 || ncp_view_from_capsule(args[1], "out", 0, &out) < 0 ||
        ncp_py_i64(args[2], "total_tokens", &p.total_tokens) < 0 || ncp_py_i32(args[3], "cp_size", &p.cp_size) < 0 ||
        ncp_py_i32(args[4], "cp_rank", &p.cp_rank) < 0 || ncp_py_stream(args[5], &stream) < 0)
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
        PyErr_SetString(PyExc_ValueError, "cu_seqlens is too long");
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
    /* (cu_seqlens_host, cp_size) */
    if (ncp_py_nargs("thd_partition_validate", nargs, 2) < 0) return NULL;
    ncp_view cu;
    int32_t cp;
    if (ncp_view_from_capsule(args[0], "cu_seqlens", 0, &cu) < 0 || ncp_py_i32(args[1], "cp_size", &cp) < 0) return NULL;
    if (ncp_py_expect(&cu, "cu_seqlens", NCP_DT(NCP_DT_I32), 1, 2) < 0) return NULL;
    if (cu.device != NCP_DEV_CPU) {
        PyErr_SetString(PyExc_ValueError, "thd_partition_validate reads cu_seqlens on the host");
        return NULL;
    }
    ncp_status st = ncp_thd_partition_validate((const int32_t *)cu.data, (int32_t)cu.shape[0], cp);
    if (st != NCP_OK) return ncp_py_raise(st);
    Py_RETURN_NONE;
}

/* ======================================================================================== */
/* MiMo sharder                                                                              */
/* ======================================================================================== */

static PyObject *py_mimo_layout_words(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    (void)m;
    if (ncp_py_nargs("mimo_layout_words", nargs, 4) < 0) return NULL;
    int64_t B, nr, np_;
    int32_t C;
    if (ncp_py_i64(args[0], "B", &B) < 0 || ncp_py_i64(args[1], "n_real", &nr) < 0 || ncp_py_i64(args[2], "n_pad", &np_) < 0 ||
        ncp_py_i32(args[3], "num_chunks", &C) < 0)
        return NULL;
    return PyLong_FromLongLong((long long)ncp_mimo_layout_words(B, nr, np_, C));
}

static PyObject *py_mimo_layout(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    /* (seq_lens, seq_lens_padded, buf, S, num_chunks, cp_size, sentinel) -> info tuple */
    if (ncp_py_nargs("mimo_layout", nargs, 7) < 0) return NULL;
    ncp_view sl, slp, buf;
    ncp_mimo_layout_params p;
    memset(&p, 0, sizeof p);
    if (ncp_view_from_capsule(args[0], "seq_lens", 0, &sl) < 0 ||
        ncp_view_from_capsule(args[1], "seq_lens_padded", 0, &slp) < 0 ||
        ncp_view_from_capsule(args[2], "buf", 0, &buf) < 0 || ncp_py_i64(args[3], "S", &p.S) < 0 ||
        ncp_py_i32(args[4], "num_chunks", &p.num_chunks) < 0 || ncp_py_i32(args[5], "cp_size", &p.cp_size) < 0 ||
        ncp_py_i64(args[6], "sentinel", &p.sentinel) < 0)
        return NULL;
    if (ncp_py_expect(&sl, "seq_lens", NCP_DT(NCP_DT_I64), 2, 2) < 0 || ncp_py_expect(&slp, "seq_lens_padded", NCP_DT(NCP_DT_I64), 2, 2) < 0 ||
        ncp_py_expect(&buf, "buf", NCP_DT(NCP_DT_I64), 1, 2) < 0)
        return NULL;
    if (sl.device != NCP_DEV_CPU || slp.device != NCP_DEV_CPU || buf.device != NCP_DEV_CPU) {
        PyErr_SetString(PyExc_ValueError, "mimo_layout works on host copies of seq_lens and seq_lens_padded");
        return NULL;
    }
    if (sl.shape[0] != slp.shape[0]) {
        PyErr_Format(PyExc_ValueError, "seq_lens and seq_lens_padded must have the same number of rows; got %lld and %lld",
                     (long long)sl.shape[0], (long long)slp.shape[0]);
        return NULL;
    }
    p.seq_lens = (const int64_t *)sl.data;
    p.seq_lens_padded = (const int64_t *)slp.data;
    p.B = sl.shape[0];
    p.n_real = sl.shape[1];
    p.n_pad = slp.shape[1];
    p.buf = (int64_t *)buf.data;
    p.buf_words = buf.shape[0];
    ncp_mimo_layout_info info;
    memset(&info, 0, sizeof info);
    ncp_status st;
    Py_BEGIN_ALLOW_THREADS st = ncp_mimo_layout(&p, &info);
    Py_END_ALLOW_THREADS if (st != NCP_OK) return ncp_py_raise(st);
    return Py_BuildValue("(LLLLLLiL)", (long long)info.kernel_words, (long long)info.cu_off, (long long)info.cu_width,
                         (long long)info.cup_off, (long long)info.cup_width, (long long)info.maxlen_off,
                         (int)info.emit_padded, (long long)info.total_words);
}

static int optional_token_id(PyObject *o, const char *name, int64_t *id, int32_t *has) {
    *has = o != Py_None;
    *id = 0;
    return *has ? ncp_py_i64(o, name, id) : 0;
}

static PyObject *py_mimo_shard(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    /* (input_ids, labels, position_ids, table, out_ids, out_labels, out_pos, out_pad, out_local,
     *  out_image, out_video, num_chunks, cp_size, cp_rank, image_token_id, video_token_id, stream) */
    if (ncp_py_nargs("mimo_shard", nargs, 17) < 0) return NULL;
    static const char *names[] = {"input_ids", "labels",    "position_ids", "table",     "out_ids",    "out_labels",
                                  "out_pos",   "out_pad",   "out_local",    "out_image", "out_video"};
    static const int optional[] = {0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 1};
    ncp_view v[11];
    for (int i = 0; i < 11; ++i)
        if (ncp_view_from_capsule(args[i], names[i], optional[i], &v[i]) < 0) return NULL;
    ncp_mimo_shard_params p;
    memset(&p, 0, sizeof p);
    void *stream;
    if (ncp_py_i32(args[11], "num_chunks", &p.num_chunks) < 0 || ncp_py_i32(args[12], "cp_size", &p.cp_size) < 0 ||
        ncp_py_i32(args[13], "cp_rank", &p.cp_rank) < 0 ||
        optional_token_id(args[14], "image_token_id", &p.image_token_id, &p.has_image) < 0 ||
        optional_token_id(args[15], "video_token_id", &p.video_token_id, &p.has_video) < 0 ||
        ncp_py_stream(args[16], &stream) < 0)
        return NULL;
    if (ncp_py_expect(&v[0], names[0], NCP_DT_INT, 2, 0) < 0 || ncp_py_expect(&v[1], names[1], NCP_DT_INT, 2, 0) < 0 ||
        ncp_py_expect(&v[2], names[2], NCP_DT_INT, 2, 0) < 0 || ncp_py_expect(&v[3], names[3], NCP_DT(NCP_DT_I64), 1, 2) < 0)
        return NULL;
    for (int i = 4; i < 11; ++i) {
        unsigned mask = (i == 7 || i >= 9) ? NCP_DT(NCP_DT_BOOL) : NCP_DT(NCP_DT_I64);
        if (ncp_py_expect(&v[i], names[i], mask, -1, 2) < 0) return NULL;
    }
    ncp_view *vp[11];
    for (int i = 0; i < 11; ++i) vp[i] = &v[i];
    ncp_device_kind dev;
    int32_t dev_id;
    if (ncp_py_same_device(vp, names, 11, &dev, &dev_id) < 0) return NULL;
    p.B = v[0].shape[0];
    p.S = v[0].shape[1];
    const int64_t BS[2] = {p.B, p.S};
    if (ncp_py_shape(&v[1], "labels", 2, BS, "[batch, sequence] like input_ids") < 0 ||
        ncp_py_shape(&v[2], "position_ids", 2, BS, "[batch, sequence] like input_ids") < 0)
        return NULL;
    if (p.num_chunks >= 1 && p.cp_size >= 1 && p.B % p.num_chunks == 0) {
        const int64_t C = p.num_chunks, Tc = p.B / C * p.S, L = p.cp_size > 1 ? Tc / p.cp_size : Tc;
        const int64_t CL = C * L, CT = C * Tc;
        if ((v[4].present && ncp_view_numel(&v[4]) != CL) || (v[5].present && ncp_view_numel(&v[5]) != CL) ||
            (v[6].present && ncp_view_numel(&v[6]) != CL) || ncp_view_numel(&v[7]) != CL ||
            ncp_view_numel(&v[8]) != CL || (v[9].present && ncp_view_numel(&v[9]) != CT) ||
            (v[10].present && ncp_view_numel(&v[10]) != CT)) {
            PyErr_SetString(PyExc_ValueError, "mimo_shard: an output has the wrong number of elements");
            return NULL;
        }
    }
    p.input_ids = v[0].data;
    p.ids_dt = v[0].dtype;
    p.ids_st0 = v[0].strides[0];
    p.ids_st1 = v[0].strides[1];
    if (v[1].present) {
        p.labels = v[1].data;
        p.lab_dt = v[1].dtype;
        p.lab_st0 = v[1].strides[0];
        p.lab_st1 = v[1].strides[1];
    }
    if (v[2].present) {
        p.position_ids = v[2].data;
        p.pos_dt = v[2].dtype;
        p.pos_st0 = v[2].strides[0];
        p.pos_st1 = v[2].strides[1];
    }
    p.table = (const int64_t *)v[3].data;
    p.out_ids = (int64_t *)v[4].data;
    p.out_labels = (int64_t *)v[5].data;
    p.out_pos = (int64_t *)v[6].data;
    p.out_pad = (uint8_t *)v[7].data;
    p.out_local = (int64_t *)v[8].data;
    p.out_image = (uint8_t *)v[9].data;
    p.out_video = (uint8_t *)v[10].data;
    ncp_status st;
    NCP_PY_RUN(dev, dev_id, ncp_mimo_shard_cpu(&p), ncp_mimo_shard_cuda(&p, stream), st);
    if (st != NCP_OK) return ncp_py_raise(st);
    Py_RETURN_NONE;
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
     "thd_partition_validate(cu_seqlens_host, cp_size): host check of document lengths."},
    {"mimo_layout_words", (PyCFunction)(void (*)(void))py_mimo_layout_words, METH_FASTCALL,
     "mimo_layout_words(B, n_real, n_pad, num_chunks) -> workspace words."},
    {"mimo_layout", (PyCFunction)(void (*)(void))py_mimo_layout, METH_FASTCALL,
     "mimo_layout(seq_lens, seq_lens_padded, buf, S, num_chunks, cp_size, sentinel) -> info tuple."},
    {"mimo_shard", (PyCFunction)(void (*)(void))py_mimo_shard, METH_FASTCALL,
     "mimo_shard(...): fused MiMo shard pass (gathers, masks, local indices)."},
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
