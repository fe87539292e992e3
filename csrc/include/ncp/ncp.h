/*
 * ncp.h: the C ABI of nemo_cp_native.
 *
 * Status codes, the dtype enum, one POD params struct per op, and the entry points. Kernels see
 * only these structs (plus a stream for CUDA); no PyObject, DLPack or torch type crosses this line.
 * Every entry point validates what it receives and reports failures through ncp_status plus a
 * thread-local message (ncp_last_error()). Nothing here exits, aborts or keeps a pointer after
 * returning.
 *
 * Shapes in field comments use: B rows, S row length, C pipeline chunks, W cp size, L local tokens,
 * T tokens, Hq/Hkv heads, D head dim.
 */
#ifndef NCP_H
#define NCP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------ */
/* Status                                                                                      */
/* ------------------------------------------------------------------------------------------ */

typedef enum {
    NCP_OK = 0,
    NCP_ERR_INVALID_ARG = 1, /* -> ValueError */
    NCP_ERR_UNSUPPORTED = 2, /* -> NotImplementedError */
    NCP_ERR_CUDA = 3,        /* -> RuntimeError */
    NCP_ERR_NOMEM = 4,       /* -> MemoryError */
    NCP_ERR_FALLBACK = 5,    /* input valid but outside the native fast path: caller runs the reference */
} ncp_status;

/* The message of the last failure on this thread (empty if none). */
const char *ncp_last_error(void);
const char *ncp_status_name(ncp_status st);

typedef enum {
    NCP_DT_BOOL = 0,
    NCP_DT_I32 = 1,
    NCP_DT_I64 = 2,
    NCP_DT_F16 = 3,
    NCP_DT_BF16 = 4,
    NCP_DT_F32 = 5,
    NCP_DT_F64 = 6,
} ncp_dtype;

size_t ncp_dtype_size(ncp_dtype dt);

/* Build information (compiled with CUDA, for which archs). */
int ncp_built_with_cuda(void);
const char *ncp_cuda_archs(void);

/* CUDA builds: make `device` current for the calls that follow (saving the previous one), and
 * restore it. Used by the Python module around every launch. */
ncp_status ncp_cuda_device_enter(int32_t device, int32_t *previous);
void ncp_cuda_device_exit(int32_t previous);

/* ------------------------------------------------------------------------------------------ */
/* THD DualChunkSwap partition (Transformer Engine's thd_get_partitioned_indices)              */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
    const int32_t *cu_seqlens; /* (n_cu,) document boundaries; lengths should be multiples of 2*cp_size */
    int32_t n_cu;              /* entries of cu_seqlens, >= 2 */
    int64_t total_tokens;      /* stream length, > 0 and a multiple of 2*cp_size */
    int32_t cp_size;           /* > 0 */
    int32_t cp_rank;           /* in [0, cp_size) */
    int32_t *out;              /* (total_tokens / cp_size,) int32 global token indices of this rank */
} ncp_thd_partition_params;

/* Writes TE's DualChunkSwap partition of one rank, bit for bit (spec mimo_te.md section 11.3,
 * including slots past cu_seqlens[n_cu-1] and lengths TE would silently mis-partition). Only the
 * scalar fields are validated; call ncp_thd_partition_validate on host boundaries for the rest. */
ncp_status ncp_thd_partition_cpu(const ncp_thd_partition_params *p);
/* Same on the device: cu_seqlens and out are device pointers; launches on `stream`. */
ncp_status ncp_thd_partition_cuda(const ncp_thd_partition_params *p, void *stream);
/* Host check of boundaries: cu[0] >= 0, non-decreasing, every length a multiple of 2*cp_size. */
ncp_status ncp_thd_partition_validate(const int32_t *cu_seqlens, int32_t n_cu, int32_t cp_size);
/* The same, plus cu_seqlens[n_cu-1] <= total_tokens (TE reads past the stream otherwise and
 * returns indices >= total_tokens). For validating callers; TE itself does not check it. */
ncp_status ncp_thd_partition_validate_total(const int32_t *cu_seqlens, int32_t n_cu, int32_t cp_size,
                                            int64_t total_tokens);

/* ------------------------------------------------------------------------------------------ */
/* MiMo THD sharder: host layout + one fused shard pass, in one call                            */
/* ------------------------------------------------------------------------------------------ */

#define NCP_SEQ_LENS_SENTINEL (-1000)

typedef struct {
    const void *seq_lens;        /* (B, n_real) int32/int64 real document lengths, sentinel = none */
    const void *seq_lens_padded; /* (B, n_pad) int32/int64 padded document lengths, sentinel = none */
    ncp_dtype sl_dt, slp_dt;
    int64_t sl_st0, sl_st1, slp_st0, slp_st1; /* element strides of the two tables */
    int64_t B, S, n_real, n_pad;
    int32_t num_chunks;          /* C >= 1, divides B */
    int32_t cp_size;             /* W >= 1 */
    int64_t sentinel;            /* seq_lens_padding_value (-1000) */
    int64_t *buf;                /* (buf_words,) host workspace from ncp_mimo_layout_words */
    int64_t buf_words;
} ncp_mimo_layout_params;

/* Where ncp_mimo_layout put things, as word offsets into buf. buf[0, kernel_words) is the table
 * the shard kernel reads; the rest are host-computed outputs stored as packed int32. */
typedef struct {
    int64_t kernel_words;
    int64_t cu_off, cu_width;   /* int32 (C, cu_width): the "cu_seqlens" output rows */
    int64_t cup_off, cup_width; /* int32 (C, cup_width): "cu_seqlens_padded" rows (W<=1, emit_padded) */
    int64_t maxlen_off;         /* int32 (C,): "max_seqlen" */
    int32_t emit_padded;        /* W<=1: the output has a cu_seqlens_padded key */
    int64_t total_words;
} ncp_mimo_layout_info;

/* Upper bound of words ncp_mimo_layout needs for these shapes (0 for invalid shapes). */
int64_t ncp_mimo_layout_words(int64_t B, int64_t n_real, int64_t n_pad, int32_t num_chunks);

/* Host pass of shard_batch_for_mimo_te over every chunk: MiMo's validation (W > 1, with the
 * reference's exact messages, chunk by chunk), sentinel filtering, real and padded cu_seqlens with
 * the absorption rule, max_seqlen, and the padding-mask tables. Returns NCP_ERR_FALLBACK for
 * inputs the reference handles by raising from torch (a chunk with no real length). */
ncp_status ncp_mimo_layout(const ncp_mimo_layout_params *p, ncp_mimo_layout_info *info);

/* Which outputs one sharder call writes (bit set). The local-index map is always written. */
enum {
    NCP_MIMO_TOKENS = 1, /* input_ids and labels gathered to int64 (W > 1) */
    NCP_MIMO_POS = 2,    /* position_ids gathered to int64 (needs NCP_MIMO_TOKENS) */
    NCP_MIMO_PAD = 4,    /* padding mask */
    NCP_MIMO_IMAGE = 8,  /* global image-placeholder mask */
    NCP_MIMO_VIDEO = 16, /* global video-placeholder mask */
};

/* Carving of the one flat int64 output buffer of a sharder call; a pure function of the shapes
 * (Python caches it). Blocks are row-major and contiguous; -1 marks an absent output. */
typedef struct {
    int64_t L, Tc;                               /* local tokens and tokens per chunk */
    int64_t local_off, ids_off, lab_off, pos_off; /* word offsets of int64 (C, L) blocks */
    int64_t pad_off, img_off, vid_off;           /* byte offsets of bool (C, L) / (C, Tc) blocks */
    int64_t lay_off, lay_words;                  /* the layout block: kernel table, then the int32 outputs */
    int64_t out_words;                           /* size of the whole buffer */
} ncp_mimo_plan;

ncp_status ncp_mimo_plan_make(int64_t B, int64_t S, int64_t n_real, int64_t n_pad, int32_t num_chunks,
                              int32_t cp_size, unsigned outputs, ncp_mimo_plan *plan);

typedef struct {
    const void *input_ids;     /* (B, S) int32/int64, any strides */
    const void *labels;        /* (B, S) int32/int64, or NULL without NCP_MIMO_TOKENS */
    const void *position_ids;  /* (B, S) int32/int64, or NULL without NCP_MIMO_POS */
    int64_t ids_st0, ids_st1, lab_st0, lab_st1, pos_st0, pos_st1; /* element strides */
    ncp_dtype ids_dt, lab_dt, pos_dt;
    const int64_t *table;      /* buf[0, kernel_words) of ncp_mimo_layout, on the kernel's device */
    int64_t B, S;
    int32_t num_chunks, cp_size, cp_rank;
    int64_t image_token_id, video_token_id;
    int32_t has_image, has_video;
    int64_t *out_ids;          /* (C, L) int64, or NULL (then out_labels and out_pos are NULL too) */
    int64_t *out_labels;       /* (C, L) int64 or NULL */
    int64_t *out_pos;          /* (C, L) int64 or NULL */
    uint8_t *out_pad;          /* bool (C, L), or NULL */
    int64_t *out_local;        /* (C, L) int64 local-token global indices (L = Tc at W <= 1) */
    uint8_t *out_image;        /* bool (C, Tc) global placeholder mask, or NULL */
    uint8_t *out_video;        /* bool (C, Tc) or NULL */
} ncp_mimo_shard_params;

/* One pass over every chunk: DualChunkSwap gathers of ids/labels/positions (cast to int64),
 * padding mask, local indices and both media masks. */
ncp_status ncp_mimo_shard_cpu(const ncp_mimo_shard_params *p);
ncp_status ncp_mimo_shard_cuda(const ncp_mimo_shard_params *p, void *stream);

/* One whole sharder call. The caller fills layout (without buf), shard (inputs, ids, ranks; the
 * run sets table and the outputs from plan and out), plan and outputs. */
typedef struct {
    ncp_mimo_layout_params layout;
    ncp_mimo_shard_params shard;
    ncp_mimo_plan plan;
    unsigned outputs;           /* NCP_MIMO_* bits the plan was made with */
    int64_t *out;               /* (plan.out_words,) int64, on the device of the tokens */
    int64_t *host;              /* (plan.lay_words,) host int64 that receives the layout block
                                   (its int32 outputs) when the tokens are on a GPU and the
                                   metadata on the host; NULL otherwise */
} ncp_mimo_run_params;

/* Host layout straight into out's layout block, then the CPU shard pass. */
ncp_status ncp_mimo_run_cpu(ncp_mimo_run_params *p, ncp_mimo_layout_info *info);
/* With host set and a kernel table of at most 30 KiB: the host layout pass writes host, and the
 * fused kernel takes the table as a launch parameter (one launch, no copy). Otherwise: the host
 * layout (or, with host set, its table) goes into a pinned staging slot, copied to out's layout
 * block on `stream` (the whole block when host is NULL), then the fused kernel on `stream`.
 * No host synchronization: a slot is reused only once its copy has completed (an event). */
ncp_status ncp_mimo_run_cuda(ncp_mimo_run_params *p, ncp_mimo_layout_info *info, void *stream);

/* ------------------------------------------------------------------------------------------ */
/* Learned-sink attention                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* Which keys each query row sees: row i sees the keys [lo(i), hi(i)] (none when lo(i) > hi(i)),
 * with lo and hi non-decreasing in i, so a block of rows sees one contiguous key range.
 *   NCP_MASK_DOCS   contiguous THD documents (single device): Tq == Tk, key j sits at position j,
 *                   lo(i) = max(doc_start(i), i - window + 1), hi(i) = i.
 *   NCP_MASK_TABLE  per-row bounds from tables (context parallelism: the K/V buffer is sorted by
 *                   global position, so what a query sees is one buffer range):
 *                   lo(i) = row_lo[i], hi(i) = row_hi[i]. Kernels clamp both to [0, Tk) and never
 *                   read or write out of bounds; tables that are not non-decreasing give
 *                   undefined values but no invalid memory access. */
typedef enum { NCP_MASK_DOCS = 0, NCP_MASK_TABLE = 1 } ncp_mask_kind;

typedef struct {
    ncp_mask_kind kind;
    const int32_t *cu_seqlens; /* DOCS: (n_cu,) document boundaries, cu[0] = 0, cu[n_cu-1] = Tq */
    int32_t n_cu;
    int32_t window;            /* DOCS: keys counting the current token; 0 = whole causal document.
                                  TABLE: the window the table was built with, a hint (0: none) that
                                  picks the backward kernels which skip what a window leaves out;
                                  results are the same for any value */
    const int32_t *row_lo;     /* TABLE: (Tq,) first visible key row */
    const int32_t *row_hi;     /* TABLE: (Tq,) last visible key row (< row_lo: sees nothing) */
} ncp_attn_mask;

typedef struct {
    const void *q;       /* (Tq, Hq, D) */
    const void *k;       /* (Tk, Hkv, D) */
    const void *v;       /* (Tk, Hkv, D) */
    const void *sink;    /* (Hq,) logits (fp32; fp64 also on the CPU with fp64 q), or NULL: no sink */
    ncp_dtype sink_dt;
    void *out;           /* (Tq, Hq, D), dtype of q */
    float *lse;          /* (Hq, Tq) fp32, includes the sink */
    int64_t q_st, q_sh, k_st, k_sh, v_st, v_sh, o_st, o_sh; /* element strides (token, head) */
    int32_t Tq, Tk, Hq, Hkv, D;
    double scale;        /* score scale (double: fp64 CPU runs use it exactly; kernels round it) */
    ncp_dtype dtype;     /* of q, k, v, out */
    ncp_attn_mask mask;
} ncp_sink_attn_params;

typedef struct {
    ncp_sink_attn_params f;  /* forward fields; out and lse are inputs here */
    const void *dout;        /* (Tq, Hq, D) */
    int64_t do_st, do_sh;
    void *dq;                /* (Tq, Hq, D) */
    void *dk;                /* (Tk, Hkv, D) */
    void *dv;                /* (Tk, Hkv, D) */
    int64_t dq_st, dq_sh, dk_st, dk_sh, dv_st, dv_sh;
    void *dsink;             /* (Hq,) dtype f.sink_dt, or NULL when f.sink is NULL */
    int32_t deterministic;   /* nonzero: bitwise repeatable (CUDA: dQ from its own kernel, no atomics) */
    void *workspace;         /* CUDA: ncp_sink_attn_bwd_workspace() bytes, 256-byte aligned; CPU: unused */
    int64_t workspace_bytes;
} ncp_sink_attn_bwd_params;

/* Validates every fact about the arguments that C can check (NULL pointers, sizes, dtypes, head
 * dims, strides and alignment for the CUDA kernels, the mask fields) with messages that name the
 * argument. on_cuda selects the CUDA rules. Called by every entry point below. */
ncp_status ncp_sink_attn_validate(const ncp_sink_attn_params *p, int on_cuda);
ncp_status ncp_sink_attn_bwd_validate(const ncp_sink_attn_bwd_params *p, int on_cuda);

/* Forward: out and lse. CPU: any of f16/bf16/f32/f64, every sum in double (the second oracle). */
ncp_status ncp_sink_attn_fwd_cpu(const ncp_sink_attn_params *p);
ncp_status ncp_sink_attn_bwd_cpu(const ncp_sink_attn_bwd_params *p);
/* CUDA: f16/bf16, D in {64, 128}; launches on `stream` (the kernel choice: ncp_sink_attn_kernels). */
ncp_status ncp_sink_attn_fwd_cuda(const ncp_sink_attn_params *p, void *stream);
ncp_status ncp_sink_attn_bwd_cuda(const ncp_sink_attn_bwd_params *p, void *stream);

/* Bytes of workspace the CUDA backward needs on the current device for these sizes (0 on a build
 * without CUDA); the dispatcher alone decides, so callers never size buffers by kernel. Tq and Tk
 * are the query rows and keys of the call (Tk sizes the Hopper kernels' longest-first tile order);
 * window is the call's mask window (documents) or window hint (tables), 0 for none: with D = 128
 * a small window takes the deterministic kernel pair even when not asked (dispatch.cu). */
int64_t ncp_sink_attn_bwd_workspace(int32_t Tq, int32_t Tk, int32_t Hq, int32_t D, int32_t has_sink,
                                    int32_t deterministic, int32_t window);

/* Names of the kernels a call on the current device runs for head dim D and mask window (0: none):
 * forward and backward, e.g. "sm90" and "sm90-atomic-dq", "sm90-deterministic", "portable"; "none"
 * without a CUDA build. */
void ncp_sink_attn_kernels(int32_t deterministic, int32_t D, int32_t window, const char **fwd, const char **bwd);

/* Test hooks, one struct read once per call by the dispatcher (never environment variables):
 * portable = 1 runs the portable mma.sync kernels on any GPU; grid > 0 caps the persistent Hopper
 * forward at that many CTAs (a value >= the work items gives one CTA per item); whole_tiles = 1
 * turns the Hopper forward's half tiles off (the same bits); order_waves sets the Hopper backward
 * grids' longest-first orders (0: the default, index order under a window and chunks of 2 waves
 * without; -1: index order; k > 0: longest first within chunks of k waves; every order gives the
 * same bits in the deterministic mode). */
typedef struct {
    int32_t portable;
    int32_t grid;
    int32_t whole_tiles;
    int32_t order_waves;
} ncp_attn_debug;
void ncp_attn_debug_set(const ncp_attn_debug *d);
ncp_attn_debug ncp_attn_debug_get(void);

/* ------------------------------------------------------------------------------------------ */
/* Flint CP rank step: the K/V exchange bookkeeping around the all-to-all                        */
/* ------------------------------------------------------------------------------------------ */

/* Rows of two (T, H, D) tensors a and b (token and head strides in elements, last dim contiguous).
 * Row indices are int32; an index outside [0, rows) reads as zeros (never out of bounds). */
typedef struct {
    const void *a, *b;         /* (rows, H, D) */
    int64_t a_st, a_sh, b_st, b_sh;
    int32_t rows, H, D;
    ncp_dtype dtype;           /* f16, bf16, f32, f64 (the CPU also takes any of them; CUDA: 16-bit) */
} ncp_kv_pair;

/* out[j] = [a[idx[j]] | b[idx[j]]] for j < n: the rows a rank sends (k, v by send_idx), or the
 * gradients of received rows it returns (dk, dv buffers by recv_slot). */
typedef struct {
    ncp_kv_pair src;
    const int32_t *idx;        /* (n,) */
    int32_t n;
    void *out;                 /* (n, H, 2D) contiguous */
} ncp_kv_gather_params;

/* The K/V buffer sorted by global position: for slot s < n_slots with r = slot_src[s],
 * kbuf[s] = r < local.rows ? local.a[r] : recv[r - local.rows][:D], vbuf[s] likewise with the
 * second half; r outside [0, local.rows + n_recv) gives zeros. */
typedef struct {
    ncp_kv_pair local;         /* this rank's k, v */
    const void *recv;          /* (n_recv, H, 2D) contiguous, received [k | v] rows */
    int32_t n_recv;
    const int32_t *slot_src;   /* (n_slots,) */
    int32_t n_slots;
    void *kbuf, *vbuf;         /* (n_slots, H, D) contiguous */
} ncp_kv_assemble_params;

/* Gradients of local rows: for i < n_local, dk[i] = buf.a[local_slot[i]] + sum of back[j][:D] over
 * j in ret_idx[ret_off[i] .. ret_off[i + 1]) (the rows other ranks returned for i, in rank order),
 * summed in fp32 (double on the CPU) in that fixed order; dv[i] likewise with buf.b and the second
 * half. Bitwise repeatable. */
typedef struct {
    ncp_kv_pair buf;           /* dk, dv of the sorted K/V buffer */
    const int32_t *local_slot; /* (n_local,) */
    int32_t n_local;
    const void *back;          /* (n_back, H, 2D) contiguous */
    int32_t n_back;
    const int32_t *ret_off;    /* (n_local + 1,) */
    const int32_t *ret_idx;    /* (n_back,) rows of back, grouped by local row */
    void *dk, *dv;             /* (n_local, H, D) contiguous, dtype of buf */
} ncp_kv_grad_sum_params;

ncp_status ncp_kv_gather_cpu(const ncp_kv_gather_params *p);
ncp_status ncp_kv_gather_cuda(const ncp_kv_gather_params *p, void *stream);
ncp_status ncp_kv_assemble_cpu(const ncp_kv_assemble_params *p);
ncp_status ncp_kv_assemble_cuda(const ncp_kv_assemble_params *p, void *stream);
ncp_status ncp_kv_grad_sum_cpu(const ncp_kv_grad_sum_params *p);
ncp_status ncp_kv_grad_sum_cuda(const ncp_kv_grad_sum_params *p, void *stream);

/* ------------------------------------------------------------------------------------------ */
/* Magi dispatch and Flint CP plans (host)                                                     */
/* ------------------------------------------------------------------------------------------ */

/* MagiAttention's chunk size and padded length for a stream of `total` tokens (spec
 * flint_magi.md section 1.3 item 2-3): chunk = min(requested, ceil(total / (8 * cp))), padded to a
 * multiple of chunk * cp. min_chunks_per_rank is Magi's MAGI_ATTENTION_MIN_CHUNKS_PER_RANK (8). */
ncp_status ncp_magi_geometry(int64_t total, int32_t cp_size, int32_t requested_chunk, int32_t min_chunks_per_rank,
                             int32_t *chunk_size, int64_t *total_padded);

/* MinHeap dispatch of the full-causal workload (section 1.4): owner[c] = rank of chunk c.
 * cu_seqlens must start at 0, increase strictly and end at `total`. */
ncp_status ncp_magi_dispatch(const int32_t *cu_seqlens, int32_t n_cu, int32_t cp_size, int32_t chunk_size,
                             int64_t total_padded, int32_t *owner);

typedef struct {
    int32_t n;           /* entries */
    int32_t *data;       /* malloc'd, n entries (NULL when n == 0) */
} ncp_i32_array;

/* A run of an int32 table: out[out + t * stride] = val + t * step for t in [0, len). A plan's
 * tables are piecewise arithmetic (chunks are contiguous positions), so a plan is a few runs per
 * chunk, not an entry per token; ncp_runs_expand (host) and ncp_runs_expand_cuda (device) write
 * the tables out. */
typedef struct {
    int32_t out, len, stride, val, step;
} ncp_run;

/* Checks that every run writes inside [0, n_out) with values in int32, then expands them. */
ncp_status ncp_runs_check(const ncp_run *runs, int32_t n_runs, int64_t n_out);
ncp_status ncp_runs_expand(const ncp_run *runs, int32_t n_runs, int32_t *out, int64_t n_out);
/* The same on the device, on `stream`: runs_host is checked, runs_dev (a device copy of it) is read;
 * the kernel drops any write outside [0, n_out) whatever runs_dev holds. */
ncp_status ncp_runs_expand_cuda(const ncp_run *runs_host, const ncp_run *runs_dev, int32_t n_runs, int32_t *out,
                                int64_t n_out, void *stream);

/* The tables of one window, in this order in the window's expanded buffer. */
enum {
    NCP_PT_SEND_IDX,   /* (S,) local rows to send, grouped by destination rank */
    NCP_PT_RECV_POS,   /* (R,) global positions of received rows, grouped by source */
    NCP_PT_KV_POS,     /* (L + R,) sorted positions of the K/V buffer */
    NCP_PT_KV_SRC,     /* (L + R,) row of cat(local, received) feeding each buffer slot */
    NCP_PT_LOCAL_SLOT, /* (L,) buffer slot of each local row */
    NCP_PT_RECV_SLOT,  /* (R,) buffer slot of each received row */
    NCP_PT_Q_LO,       /* (L,) first visible global position per local query */
    NCP_PT_ROW_LO,     /* (L,) NCP_MASK_TABLE bounds: buffer slots [row_lo, row_hi] */
    NCP_PT_ROW_HI,     /* (L,) */
    NCP_PT_RET_OFF,    /* (L + 1,) CSR of send_idx by local row: offsets */
    NCP_PT_RET_IDX,    /* (S,) positions in send_idx of each local row's copies, rank order */
    NCP_PT_COUNT
};

/* One rank's view of one window. Arrays are malloc'd; free with ncp_plan_free. */
typedef struct {
    int32_t window;
    int64_t visible_pairs;          /* sum over local queries of visible keys (FLOP counting) */
    ncp_i32_array send_counts;      /* (cp,) tokens this rank sends to each rank */
    ncp_i32_array recv_counts;      /* (cp,) tokens this rank receives from each rank */
    int64_t table_off[NCP_PT_COUNT + 1]; /* table t = entries [table_off[t], table_off[t + 1]) */
    int32_t n_runs;
    ncp_run *runs;                  /* expand into table_off[NCP_PT_COUNT] int32 entries */
} ncp_plan_window;

typedef struct {
    int64_t total, total_padded;
    int32_t chunk_size, n_chunks, cp_size, cp_rank;
    ncp_i32_array owner;            /* (n_chunks,) */
    int32_t n_local_runs;
    ncp_run *local_runs;            /* expand into (L,) this rank's global positions, ascending */
    int32_t n_windows;
    ncp_plan_window *windows;
} ncp_plan;

/* Builds rank `cp_rank`'s plan for every window in `windows` (0 = full causal, W = W keys counting
 * the current token) over one shared MinHeap partition. Deterministic: every rank computes the
 * same partition and exchange tables, so no collective is needed. Its cost grows with the chunks
 * and documents, not with the tokens. A pack of more than NCP_PLAN_MAX_CHUNKS chunks is refused
 * (INVALID_ARG) before anything is allocated. */
#define NCP_PLAN_MAX_CHUNKS (1 << 26)
ncp_status ncp_plan_build(const int32_t *cu_seqlens, int32_t n_cu, int32_t cp_size, int32_t cp_rank,
                          int32_t requested_chunk, int32_t min_chunks_per_rank, const int32_t *windows,
                          int32_t n_windows, ncp_plan *plan);
void ncp_plan_free(ncp_plan *plan);

#ifdef __cplusplus
}
#endif

#endif /* NCP_H */
