/*
 * magi_dispatch.c: MagiAttention's default token dispatch, written from spec flint_magi.md 1.3-1.4.
 *
 *   chunk   = min(requested, ceil(T / (min_chunks_per_rank * cp)))    (Magi caps the chunk size)
 *   T_pad   = T rounded up to a multiple of chunk * cp                 (tail pad rows see nothing)
 *   work(c) = sum over real tokens p of chunk c of (p - doc_start(p) + 1)   (full-causal mask area)
 *   MinHeap: chunks in descending work (ties: higher chunk id first, i.e. a stable ascending
 *   argsort reversed); each goes to the rank with the smallest (load, rank) that still has room
 *   for N / cp chunks; a full rank leaves the heap for good.
 *
 * Integer workloads make the result bit-identical on every rank and pipeline stage, so plans need
 * no collective. Tests: tests/test_flint_plan.py (against nemo_cp_native.reference.magi).
 */
#include <inttypes.h>
#include <stdlib.h>

#include "ncp/ncp.h"
#include "ncp/ncp_check.h"

ncp_status ncp_magi_geometry(int64_t total, int32_t cp_size, int32_t requested_chunk, int32_t min_chunks_per_rank,
                             int32_t *chunk_size, int64_t *total_padded) {
    NCP_ARG_CHECK(cp_size >= 1, "cp_size must be >= 1; got %" PRId32, cp_size);
    NCP_ARG_CHECK(requested_chunk >= 1, "magi_chunk_size must be >= 1; got %" PRId32, requested_chunk);
    NCP_ARG_CHECK(min_chunks_per_rank >= 1, "min_chunks_per_rank must be >= 1; got %" PRId32, min_chunks_per_rank);
    NCP_ARG_CHECK(total >= 1, "cu_seqlens must describe a non-empty pack; got %" PRId64 " tokens", total);
    const int64_t denom = (int64_t)min_chunks_per_rank * cp_size;
    const int64_t cap = (total + denom - 1) / denom;
    const int64_t chunk = requested_chunk < cap ? requested_chunk : cap;
    NCP_ARG_CHECK((total + chunk - 1) / chunk >= cp_size,
                  "a pack of %" PRId64 " tokens is too short for cp_size=%" PRId32 ": it makes only %" PRId64
                  " chunks of %" PRId64 " tokens",
                  total, cp_size, (total + chunk - 1) / chunk, chunk);
    const int64_t unit = chunk * cp_size;
    const int64_t padded = (total + unit - 1) / unit * unit;
    NCP_ARG_CHECK(padded <= INT32_MAX, "cu_seqlens: the padded pack (%" PRId64 " tokens) must fit in int32", padded);
    *chunk_size = (int32_t)chunk;
    *total_padded = padded;
    return NCP_OK;
}

/* Full-causal visible pairs of the queries in [a, b) within documents cu (closed form per doc). */
static int64_t chunk_work(const int32_t *cu, int32_t n_cu, int32_t *doc, int64_t a, int64_t b) {
    int64_t work = 0;
    while (*doc < n_cu - 1 && cu[*doc + 1] <= a) ++*doc;
    for (int32_t d = *doc; d < n_cu - 1 && cu[d] < b; ++d) {
        const int64_t s = cu[d], e = cu[d + 1];
        const int64_t lo = a > s ? a : s, hi = b < e ? b : e;
        if (hi <= lo) continue;
        work += (hi - s) * (hi - s + 1) / 2 - (lo - s) * (lo - s + 1) / 2;
    }
    return work;
}

typedef struct {
    int64_t work;
    int32_t id;
} job;

/* Descending work; among equal work the higher chunk id first. */
static int job_cmp(const void *pa, const void *pb) {
    const job *a = (const job *)pa, *b = (const job *)pb;
    if (a->work != b->work) return a->work > b->work ? -1 : 1;
    return a->id > b->id ? -1 : (a->id < b->id);
}

typedef struct {
    int64_t load;
    int32_t rank;
} bucket;

static int bucket_less(bucket a, bucket b) { return a.load < b.load || (a.load == b.load && a.rank < b.rank); }

static void heap_push(bucket *h, int32_t *n, bucket x) {
    int32_t i = (*n)++;
    while (i > 0) {
        int32_t parent = (i - 1) / 2;
        if (!bucket_less(x, h[parent])) break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = x;
}

static bucket heap_pop(bucket *h, int32_t *n) {
    bucket top = h[0], last = h[--*n];
    int32_t i = 0;
    for (;;) {
        int32_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && bucket_less(h[c + 1], h[c])) ++c;
        if (!bucket_less(h[c], last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n > 0) h[i] = last;
    return top;
}

ncp_status ncp_magi_dispatch(const int32_t *cu, int32_t n_cu, int32_t cp_size, int32_t chunk_size,
                             int64_t total_padded, int32_t *owner) {
    NCP_ARG_CHECK(cu != NULL && n_cu >= 2 && cu[0] == 0, "cu_seqlens must start at 0 and hold at least one document");
    NCP_ARG_CHECK(cp_size >= 1 && chunk_size >= 1, "cp_size and chunk_size must be >= 1");
    NCP_ARG_CHECK(total_padded % ((int64_t)chunk_size * cp_size) == 0 && total_padded >= cu[n_cu - 1],
                  "total_padded must be a multiple of chunk_size * cp_size covering the pack");
    const int32_t n = (int32_t)(total_padded / chunk_size), limit = n / cp_size;
    job *jobs = (job *)malloc((size_t)n * sizeof(job));
    bucket *heap = (bucket *)malloc((size_t)cp_size * sizeof(bucket));
    int32_t *count = (int32_t *)calloc((size_t)cp_size, sizeof(int32_t));
    if (!jobs || !heap || !count) {
        free(jobs);
        free(heap);
        free(count);
        NCP_FAIL(NCP_ERR_NOMEM, "out of host memory in magi dispatch");
    }
    int32_t doc = 0;
    for (int32_t c = 0; c < n; ++c) {
        jobs[c].id = c;
        jobs[c].work = chunk_work(cu, n_cu, &doc, (int64_t)c * chunk_size, (int64_t)(c + 1) * chunk_size);
    }
    qsort(jobs, (size_t)n, sizeof(job), job_cmp);
    int32_t hn = 0;
    for (int32_t r = 0; r < cp_size; ++r) heap_push(heap, &hn, (bucket){0, r});
    ncp_status st = NCP_OK;
    for (int32_t j = 0; j < n; ++j) {
        bucket b = {0, -1};
        while (hn > 0) {
            b = heap_pop(heap, &hn);
            if (count[b.rank] < limit) break;
            b.rank = -1;
        }
        if (b.rank < 0) {
            st = ncp_set_error(NCP_ERR_INVALID_ARG, __FILE__, __LINE__, __func__, "bucket found",
                               "no rank has room for chunk %" PRId32, jobs[j].id);
            break;
        }
        owner[jobs[j].id] = b.rank;
        ++count[b.rank];
        heap_push(heap, &hn, (bucket){b.load + jobs[j].work, b.rank});
    }
    free(jobs);
    free(heap);
    free(count);
    return st;
}
