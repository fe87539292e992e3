/*
 * pyargs_mimo.h: argument parsing and checks of the THD / MiMo functions of _C (module.c).
 *
 * Every error names its argument. The MiMo checks decide whether a call can take the native path:
 * inputs the native path does not cover (float token ids, a shape the reference would reject
 * through torch, tensors on different devices, ...) raise _C.Fallback with the reason, and
 * nemo_cp_native.mimo then runs the pure-PyTorch reference, so the outcome stays exact.
 */
#ifndef NCP_PYARGS_MIMO_H
#define NCP_PYARGS_MIMO_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "dlpack_view.h"
#include "ncp/ncp.h"

/* Raises _C.Fallback(reason); returns -1. */
int ncp_pym_fallback(const char *reason);

/* The views of one mimo_run call, in argument order. */
enum { NCP_PYM_IDS, NCP_PYM_LABELS, NCP_PYM_POS, NCP_PYM_SL, NCP_PYM_SLP, NCP_PYM_OUT, NCP_PYM_HOST, NCP_PYM_NVIEWS };

/* The scalars of one mimo_run call. */
typedef struct {
    int64_t num_chunks, cp_size;
    int32_t cp_rank;
    int64_t image_token_id, video_token_id, sentinel;
    int32_t has_image, has_video;
    unsigned outputs;
} ncp_pym_mimo_args;

/* Parses the capsules args[0..6] of mimo_run into v (NCP_PYM_* order). A token or length tensor
 * (args[0..4]) that a view cannot hold (a dtype, rank or device DLPack carries but we do not map)
 * raises _C.Fallback with the parser's message; anything else (None for a required tensor, a
 * non-capsule, a consumed capsule, a bad out / host) raises as the parser does. */
int ncp_pym_mimo_views(PyObject *const *args, ncp_view *v);

/* ncp_pym_mimo_views for tensor objects read through the DLPack C exchange API (mimo_run_x):
 * returns 1 when every view is filled, 0 when some argument is not for that path (nothing set:
 * the caller takes the capsule call), -1 with an exception as ncp_pym_mimo_views raises it. */
int ncp_pym_mimo_views_x(PyObject *const *args, ncp_view *v);

/* Parses the scalars args[7..13] of mimo_run (see module.c). A media token id that does not fit
 * in int64 raises _C.Fallback (the reference compares it against the tokens, whatever it is). */
int ncp_pym_mimo_scalars(PyObject *const *args, ncp_pym_mimo_args *a);

/* Checks the views and scalars of a mimo_run call: _C.Fallback for inputs outside the native path,
 * ValueError for misuse of the output buffers. Fills the run params (inputs, shapes, tables; the
 * plan is made here too). Returns 0, or -1 with the exception set. */
int ncp_pym_mimo_params(const ncp_view *v, const ncp_pym_mimo_args *a, ncp_mimo_run_params *p);

#endif /* NCP_PYARGS_MIMO_H */
