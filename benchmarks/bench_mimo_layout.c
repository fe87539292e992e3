/*
 * bench_mimo_layout.c: host time of ncp_mimo_layout (csrc/core/mimo_layout.c), the C pass of every
 * MiMo sharder call over the seq_lens / seq_lens_padded tables, alone. Built and run by
 * benchmarks/bench_mimo_layout.py against a tree's csrc/core (so two trees can be compared).
 *
 *   bench_mimo_layout B S CP DOCS_LO DOCS_HI CHUNKS REPS SEED
 *
 * Tables as make_mimo_batch draws them: each row holds DOCS_LO..DOCS_HI documents whose padded
 * lengths are positive multiples of 2 * CP summing to S, real lengths 1..padded, the rest of the
 * row -1000; int64. Prints one line: the median over 15 batches of REPS calls, microseconds per call.
 */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ncp/ncp.h"

static uint64_t rng_state;
static uint64_t next(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static int64_t uniform(int64_t lo, int64_t hi) { return lo + (int64_t)(next() % (uint64_t)(hi - lo + 1)); }

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc != 9) {
        fprintf(stderr, "usage: %s B S CP DOCS_LO DOCS_HI CHUNKS REPS SEED\n", argv[0]);
        return 2;
    }
    const int64_t B = atoll(argv[1]), S = atoll(argv[2]), W = atoll(argv[3]), lo = atoll(argv[4]), hi = atoll(argv[5]);
    const int32_t C = (int32_t)atoi(argv[6]);
    const long reps = atol(argv[7]);
    rng_state = (uint64_t)atoll(argv[8]);
    const int64_t unit = 2 * W, units = S / unit, ncol = hi;
    if (B < 1 || S < unit || S % unit || lo < 1 || hi < lo || C < 1 || B % C || reps < 1) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    int64_t *sl = malloc((size_t)(B * ncol) * sizeof(int64_t)), *slp = malloc((size_t)(B * ncol) * sizeof(int64_t));
    for (int64_t b = 0; b < B; ++b) {
        int64_t nd = uniform(lo, hi);
        if (nd > units) nd = units;
        int64_t left = units; /* units of 2 CP slots still to place in this row */
        for (int64_t j = 0; j < ncol; ++j) {
            int64_t *r = sl + b * ncol + j, *p = slp + b * ncol + j;
            if (j >= nd) {
                *r = *p = -1000;
                continue;
            }
            const int64_t rest = nd - 1 - j; /* documents after this one, one unit each at least */
            const int64_t fair = (left - rest) / (rest + 1) * 2; /* twice an even share of what is left */
            const int64_t u = j == nd - 1 ? left : uniform(1, fair > 1 ? fair : 1);
            const int64_t take = u > left - rest ? left - rest : u;
            *p = take * unit;
            *r = uniform(1, *p);
            left -= take;
        }
    }
    ncp_mimo_layout_params p = {0};
    p.seq_lens = sl;
    p.seq_lens_padded = slp;
    p.sl_dt = p.slp_dt = NCP_DT_I64;
    p.sl_st0 = p.slp_st0 = ncol;
    p.sl_st1 = p.slp_st1 = 1;
    p.B = B;
    p.S = S;
    p.n_real = p.n_pad = ncol;
    p.num_chunks = C;
    p.cp_size = (int32_t)W;
    p.sentinel = -1000;
    p.buf_words = ncp_mimo_layout_words(B, ncol, ncol, C);
    p.buf = malloc((size_t)p.buf_words * sizeof(int64_t));
    ncp_mimo_layout_info info;
    if (ncp_mimo_layout(&p, &info) != NCP_OK) {
        fprintf(stderr, "ncp_mimo_layout: %s\n", ncp_last_error());
        return 1;
    }
    double t[15];
    for (int k = 0; k < 15; ++k) {
        struct timespec a, e;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (long i = 0; i < reps; ++i) ncp_mimo_layout(&p, &info);
        clock_gettime(CLOCK_MONOTONIC, &e);
        t[k] = ((double)(e.tv_sec - a.tv_sec) * 1e9 + (double)(e.tv_nsec - a.tv_nsec)) / (double)reps / 1e3;
    }
    qsort(t, 15, sizeof(double), cmp_double);
    printf("%.4f %lld %lld\n", t[7], (long long)info.kernel_words, (long long)info.total_words);
    free(sl);
    free(slp);
    free(p.buf);
    return 0;
}
