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
/* Host layout into a pinned staging slot, copied to out's layout block on `stream` (the whole
 * block when host is NULL, the kernel table alone otherwise), then the fused kernel on `stream`.
 * No host synchronization: the slot is reused only once its copy has completed (an event). */
ncp_status ncp_mimo_run_cuda(ncp_mimo_run_params *p, ncp_mimo_layout_info *info, void *stream);

/* ------------------------------------------------------------------------------------------ */
/* Learned-sink attention                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* Tile geometry of the CUDA kernels; schedules built on the host use these. */
#define NCP_FWD_BM 128
#define NCP_FWD_BN 64
#define NCP_BWD_BM 64
#define NCP_BWD_BN 64

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
    /* Mask, contiguous mode (q_pos == NULL): Tq == Tk and token i sits at position i. */
    const int32_t *cu_seqlens; /* (n_cu,) document boundaries, cu[0] = 0, cu[n_cu-1] = Tq */
    int32_t n_cu;
    int32_t window;      /* keys counting the current token; 0 = whole causal document */
    /* Mask, positions mode: query i sees key j iff q_lo[i] <= k_pos[j] <= q_pos[i]. */
    const int32_t *q_pos; /* (Tq,) global positions */
    const int32_t *q_lo;  /* (Tq,) first visible position (INT32_MAX: sees nothing) */
    const int32_t *k_pos; /* (Tk,) non-decreasing global positions */
    /* Tile schedules (CUDA, positions mode): CSR over tiles, entries = tile * 2 + full. */
    const int32_t *fwd_off;  /* (ceil(Tq/NCP_FWD_BM)+1,) */
    const int32_t *fwd_ent;
    int32_t deterministic;   /* backward: nonzero = bitwise repeatable (see dq_accum); forward: unused */
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
    float *delta;            /* (Hq, Tq) fp32 workspace: rowsum(dO * O) */
    float *dsink_part;       /* (Hq, n_part) fp32 workspace (CUDA) */
    int32_t n_part;
    const int32_t *dq_off, *dq_ent;     /* positions mode: q tiles (NCP_BWD_BM) -> kv tiles */
    const int32_t *dkv_off, *dkv_ent;   /* positions mode: kv tiles (NCP_BWD_BN) -> q tiles */
    /* (Hq, ceil(Tq / 64) * 64, D) fp32 contiguous workspace, 16-byte aligned, or NULL. With
     * f.deterministic == 0 the Hopper backward (contiguous mode) zeroes it and accumulates dQ there
     * with atomic reductions inside the dK/dV kernel (5 MMAs per tile instead of 7; the summation
     * order, so the last bits of dq, vary from run to run). NULL or f.deterministic != 0: the
     * deterministic two-kernel backward. Other paths ignore it. */
    float *dq_accum;
} ncp_sink_attn_bwd_params;

/* Validates and computes out and lse. CPU: any of f16/bf16/f32/f64, accumulation in double. */
ncp_status ncp_sink_attn_fwd_cpu(const ncp_sink_attn_params *p);
ncp_status ncp_sink_attn_bwd_cpu(const ncp_sink_attn_bwd_params *p);
/* CUDA: f16/bf16, D in {64, 128}, tensor cores; launches on `stream`. */
ncp_status ncp_sink_attn_fwd_cuda(const ncp_sink_attn_params *p, void *stream);
ncp_status ncp_sink_attn_bwd_cuda(const ncp_sink_attn_bwd_params *p, void *stream);
/* Rows per dsink partial sum in the CUDA backward's pre-pass. */
#define NCP_BWD_PRE_ROWS 128
/* Number of dsink partial sums per head the CUDA backward needs for Tq queries. */
int32_t ncp_sink_attn_bwd_n_part(int32_t Tq);
/* Which CUDA forward kernel a call on the current device runs: 4 = Hopper (wgmma + TMA, sm_90a
 * build on compute capability 9.0), 1-3 = the portable mma.sync layouts, 0 = no CUDA build.
 * NCP_FWD_VARIANT=1..4 in the environment picks one (4 falls back to 3 where unusable). */
int ncp_sink_attn_fwd_variant(void);
/* Which CUDA backward kernels a contiguous-mode call runs: 4 = Hopper dK/dV and dQ, 1 = portable,
 * 0 = no CUDA build. NCP_BWD_VARIANT=1 forces the portable ones. Positions mode is always 1. */
int ncp_sink_attn_bwd_variant(void);

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

/* One rank's view of one window. Arrays are malloc'd; free with ncp_plan_free. */
typedef struct {
    int32_t window;
    int64_t visible_pairs;          /* sum over local queries of visible keys (FLOP counting) */
    ncp_i32_array send_counts;      /* (cp,) tokens this rank sends to each rank */
    ncp_i32_array recv_counts;      /* (cp,) tokens this rank receives from each rank */
    ncp_i32_array send_idx;         /* local rows to send, grouped by destination rank */
    ncp_i32_array recv_pos;         /* global positions of received rows, grouped by source */
    ncp_i32_array kv_pos;           /* (L + R,) sorted positions of the K/V buffer */
    ncp_i32_array kv_src;           /* (L + R,) row of cat(local, received) feeding each buffer slot */
    ncp_i32_array local_slot;       /* (L,) buffer slot of each local row */
    ncp_i32_array recv_slot;        /* (R,) buffer slot of each received row */
    ncp_i32_array q_lo;             /* (L,) first visible position per local query */
    ncp_i32_array fwd_off, fwd_ent; /* forward schedule, NCP_FWD_BM x NCP_FWD_BN */
    ncp_i32_array dq_off, dq_ent;   /* dq schedule, NCP_BWD_BM x NCP_BWD_BN */
    ncp_i32_array dkv_off, dkv_ent; /* dk/dv schedule, kv tiles -> q tiles */
} ncp_plan_window;

typedef struct {
    int64_t total, total_padded;
    int32_t chunk_size, n_chunks, cp_size, cp_rank;
    ncp_i32_array owner;            /* (n_chunks,) */
    ncp_i32_array local_pos;        /* (L,) this rank's global positions, ascending */
    int32_t n_windows;
    ncp_plan_window *windows;
} ncp_plan;

/* Builds rank `cp_rank`'s plan for every window in `windows` (0 = full causal, W = W keys counting
 * the current token) over one shared MinHeap partition. Deterministic: every rank computes the
 * same partition and exchange tables, so no collective is needed. */
ncp_status ncp_plan_build(const int32_t *cu_seqlens, int32_t n_cu, int32_t cp_size, int32_t cp_rank,
                          int32_t requested_chunk, int32_t min_chunks_per_rank, const int32_t *windows,
                          int32_t n_windows, ncp_plan *plan);
void ncp_plan_free(ncp_plan *plan);

#ifdef __cplusplus
}
#endif

#endif /* NCP_H */
