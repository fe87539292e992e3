/*
 * cpu/sink_attn.c: learned-sink attention, CPU backend and second oracle (forward and backward).
 *
 * For query i, query head h, kv head g = h / (Hq / Hkv), visible keys V(i), scale s, sink a_h:
 *     z_ij  = s * <q_i, k_j>                      (the sink logit a_h is not scaled)
 *     m_i   = max(a_h, max_j z_ij),  l_i = exp(a_h - m_i) + sum_j exp(z_ij - m_i)
 *     lse_i = m_i + log l_i,  O_i = sum_j exp(z_ij - lse_i) v_j        (the sink's value is zero)
 * Backward: D_i = <dO_i, O_i>, dz_ij = P_ij (<dO_i, v_j> - D_i), dq = s * dz k, dk = s * dz^T q,
 * dv = P^T dO, dsink_h = -sum_i exp(a_h - lse_i) D_i. A row that sees nothing: O = 0, lse = a_h.
 *
 * Masks: contiguous mode (q_pos == NULL): V(i) = [max(doc_start(i), i - window + 1), i];
 * positions mode: V(i) = { j : q_lo[i] <= k_pos[j] <= q_pos[i] } with k_pos non-decreasing.
 *
 * Plain loops, every sum in double: any of f16/bf16/f32/f64 in (converted once to contiguous double
 * arrays), the same dtype out, lse in fp32. The backward recomputes the softmax statistics in double
 * (the lse input is validated, not trusted).
 * Tests: tests/test_sink_attention.py (CPU cases, gradcheck in fp64).
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ncp/ncp.h"
#include "ncp/ncp_check.h"
#include "../core/ncp_internal.h"

/* ---------------------------------------------------------------------------------------- */
/* scalar conversions                                                                        */
/* ---------------------------------------------------------------------------------------- */

static double half_to_double(uint16_t h) {
    int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    double v;
    if (exp == 0) v = ldexp((double)man, -24);
    else if (exp == 31) v = man ? NAN : INFINITY;
    else v = ldexp((double)(man | 0x400), exp - 25);
    return sign ? -v : v;
}

static uint16_t double_to_half(double d) {
    float f = (float)d;
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
    if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to inf */
    if (absx < 0x38800000u) {                                   /* subnormal or zero in half */
        float a;
        memcpy(&a, &absx, 4);
        uint32_t q = (uint32_t)nearbyintf(a * 16777216.0f);     /* units of 2^-24, ties to even */
        return (uint16_t)(sign | q);
    }
    uint32_t man = absx & 0x7fffffu, e = (absx >> 23) - 127 + 15;
    uint32_t out = (e << 10) | (man >> 13);
    uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (out & 1u))) out += 1;
    return (uint16_t)(sign | out);
}

static double bf16_to_double(uint16_t b) {
    uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static uint16_t double_to_bf16(double d) {
    float f = (float)d;
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

static double load(const void *base, ncp_dtype dt, int64_t i) {
    switch (dt) {
    case NCP_DT_F16: return half_to_double(((const uint16_t *)base)[i]);
    case NCP_DT_BF16: return bf16_to_double(((const uint16_t *)base)[i]);
    case NCP_DT_F32: return ((const float *)base)[i];
    default: return ((const double *)base)[i];
    }
}

static void store(void *base, ncp_dtype dt, int64_t i, double v) {
    switch (dt) {
    case NCP_DT_F16: ((uint16_t *)base)[i] = double_to_half(v); break;
    case NCP_DT_BF16: ((uint16_t *)base)[i] = double_to_bf16(v); break;
    case NCP_DT_F32: ((float *)base)[i] = (float)v; break;
    default: ((double *)base)[i] = v; break;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* validation (shared with the CUDA entry points)                                            */
/* ---------------------------------------------------------------------------------------- */

ncp_status ncp_sink_attn_check(const ncp_sink_attn_params *p, int on_cuda) {
    NCP_ARG_CHECK(p != NULL, "sink_attention: params must not be NULL");
    NCP_ARG_CHECK(p->Tq == 0 || (p->q && p->out && p->lse), "q, out and lse must not be NULL");
    NCP_ARG_CHECK(p->Tk == 0 || (p->k && p->v), "k and v must not be NULL");
    NCP_ARG_CHECK(p->Tq >= 0 && p->Tk >= 0, "token counts must be >= 0; got Tq=%" PRId32 ", Tk=%" PRId32, p->Tq, p->Tk);
    NCP_ARG_CHECK(p->Hq > 0 && p->Hkv > 0 && p->Hq % p->Hkv == 0,
                  "the number of query heads (%" PRId32 ") must be a positive multiple of the kv heads (%" PRId32 ")",
                  p->Hq, p->Hkv);
    NCP_ARG_CHECK(p->D > 0, "head_dim must be > 0; got %" PRId32, p->D);
    NCP_ARG_CHECK(p->window >= 0, "window must be >= 0; got %" PRId32, p->window);
    NCP_ARG_CHECK(isfinite(p->scale), "scale must be finite");
    NCP_ARG_CHECK(p->sink == NULL || p->sink_dt == NCP_DT_F32 || (!on_cuda && p->sink_dt == NCP_DT_F64),
                  "sink must be float32%s", on_cuda ? "" : " (or float64 with float64 q on the CPU)");
    if (on_cuda) {
        NCP_ARG_CHECK(p->dtype == NCP_DT_F16 || p->dtype == NCP_DT_BF16,
                      "q, k and v must be float16 or bfloat16 on CUDA");
        NCP_ARG_CHECK(p->D == 64 || p->D == 128, "head_dim must be 64 or 128 on CUDA; got %" PRId32, p->D);
    } else {
        NCP_ARG_CHECK(p->dtype == NCP_DT_F16 || p->dtype == NCP_DT_BF16 || p->dtype == NCP_DT_F32 ||
                          p->dtype == NCP_DT_F64,
                      "q, k and v must be float16, bfloat16, float32 or float64 on the CPU");
    }
    if (p->q_pos == NULL) {
        NCP_ARG_CHECK(p->Tq == p->Tk, "q and k must have the same number of tokens; got %" PRId32 " and %" PRId32,
                      p->Tq, p->Tk);
        NCP_ARG_CHECK(p->cu_seqlens != NULL && p->n_cu >= 1, "cu_seqlens must have at least one entry");
    } else {
        NCP_ARG_CHECK(p->q_lo != NULL && p->k_pos != NULL, "positions mode needs q_pos, q_lo and k_pos");
        NCP_ARG_CHECK(!on_cuda || (p->fwd_off != NULL && p->fwd_ent != NULL),
                      "positions mode on CUDA needs a forward tile schedule");
    }
    return NCP_OK;
}

ncp_status ncp_sink_attn_bwd_check(const ncp_sink_attn_bwd_params *p, int on_cuda) {
    NCP_ARG_CHECK(p != NULL, "sink_attention backward: params must not be NULL");
    NCP_TRY(ncp_sink_attn_check(&p->f, on_cuda));
    NCP_ARG_CHECK(p->f.Tq == 0 || (p->dout && p->dq), "dout and dq must not be NULL");
    NCP_ARG_CHECK(p->f.Tk == 0 || (p->dk && p->dv), "dk and dv must not be NULL");
    NCP_ARG_CHECK((p->f.sink == NULL) == (p->dsink == NULL), "dsink must be given exactly when sink is");
    if (on_cuda) {
        NCP_ARG_CHECK(p->delta != NULL, "the CUDA backward needs a delta workspace");
        NCP_ARG_CHECK(p->f.sink == NULL || (p->dsink_part != NULL && p->n_part >= ncp_sink_attn_bwd_n_part(p->f.Tq)),
                      "the CUDA backward needs a dsink workspace of %" PRId32 " partials per head",
                      ncp_sink_attn_bwd_n_part(p->f.Tq));
        NCP_ARG_CHECK(p->f.q_pos == NULL || (p->dq_off && p->dq_ent && p->dkv_off && p->dkv_ent),
                      "positions mode on CUDA needs the dq and dk/dv tile schedules");
    }
    return NCP_OK;
}

/* Host-side checks of the mask arrays (CPU path only: the data is on the host). */
static ncp_status check_mask_host(const ncp_sink_attn_params *p) {
    if (p->q_pos == NULL) {
        const int32_t *cu = p->cu_seqlens;
        NCP_ARG_CHECK(cu[0] == 0, "cu_seqlens must start at 0; got %" PRId32, cu[0]);
        for (int32_t i = 1; i < p->n_cu; ++i)
            NCP_ARG_CHECK(cu[i] >= cu[i - 1], "cu_seqlens must be non-decreasing; cu_seqlens[%" PRId32 "]=%" PRId32
                          " < cu_seqlens[%" PRId32 "]=%" PRId32, i, cu[i], i - 1, cu[i - 1]);
        NCP_ARG_CHECK(cu[p->n_cu - 1] == p->Tq, "cu_seqlens must end at the number of tokens %" PRId32 "; got %" PRId32,
                      p->Tq, cu[p->n_cu - 1]);
    } else {
        for (int32_t j = 1; j < p->Tk; ++j)
            NCP_ARG_CHECK(p->k_pos[j] >= p->k_pos[j - 1], "k_pos must be non-decreasing (index %" PRId32 ")", j);
    }
    return NCP_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* per-row key ranges                                                                        */
/* ---------------------------------------------------------------------------------------- */

static int32_t lower_bound_i32(const int32_t *a, int32_t n, int64_t v) {
    int32_t lo = 0, hi = n;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if ((int64_t)a[mid] < v) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Visible keys of query i form the index range [*j0, *j1). `doc` walks cu_seqlens forward. */
static void key_range(const ncp_sink_attn_params *p, int32_t i, int32_t *doc, int32_t *j0, int32_t *j1) {
    if (p->q_pos == NULL) {
        while (*doc + 1 < p->n_cu - 1 && p->cu_seqlens[*doc + 1] <= i) ++*doc;
        int64_t lo = p->cu_seqlens[*doc];
        if (p->window > 0 && (int64_t)i - p->window + 1 > lo) lo = (int64_t)i - p->window + 1;
        *j0 = (int32_t)lo;
        *j1 = i + 1;
        return;
    }
    *j0 = lower_bound_i32(p->k_pos, p->Tk, p->q_lo[i]);
    *j1 = lower_bound_i32(p->k_pos, p->Tk, (int64_t)p->q_pos[i] + 1);
    if (*j1 < *j0) *j1 = *j0;
}

/* The tensors as contiguous double arrays [T][H][D], converted once (the loops below then run on
 * plain doubles instead of converting every element at every use). */
typedef struct {
    double *q, *k, *v, *o, *dout; /* q, o, dout: (Tq, Hq, D); k, v: (Tk, Hkv, D) */
    double sink[4096];
} dense;

static double *to_double(const void *src, ncp_dtype dt, int32_t T, int32_t H, int32_t D, int64_t st, int64_t sh) {
    double *out = (double *)malloc(((size_t)T * H * D + 1) * sizeof(double));
    if (out == NULL) return NULL;
    for (int32_t t = 0; t < T; ++t)
        for (int32_t h = 0; h < H; ++h)
            for (int32_t d = 0; d < D; ++d) out[((size_t)t * H + h) * D + d] = load(src, dt, (int64_t)t * st + (int64_t)h * sh + d);
    return out;
}

static void dense_free(dense *x) {
    free(x->q);
    free(x->k);
    free(x->v);
    free(x->o);
    free(x->dout);
}

/* q, k, v (and out, dout for the backward) as doubles; NCP_ERR_NOMEM on failure. */
static ncp_status dense_init(dense *x, const ncp_sink_attn_params *p, const ncp_sink_attn_bwd_params *b) {
    memset(x, 0, sizeof *x);
    x->q = to_double(p->q, p->dtype, p->Tq, p->Hq, p->D, p->q_st, p->q_sh);
    x->k = to_double(p->k, p->dtype, p->Tk, p->Hkv, p->D, p->k_st, p->k_sh);
    x->v = to_double(p->v, p->dtype, p->Tk, p->Hkv, p->D, p->v_st, p->v_sh);
    int ok = x->q && x->k && x->v;
    if (b != NULL) {
        x->o = to_double(p->out, p->dtype, p->Tq, p->Hq, p->D, p->o_st, p->o_sh);
        x->dout = to_double(b->dout, p->dtype, p->Tq, p->Hq, p->D, b->do_st, b->do_sh);
        ok = ok && x->o && x->dout;
    }
    for (int32_t h = 0; p->sink != NULL && h < p->Hq; ++h) x->sink[h] = load(p->sink, p->sink_dt, h);
    if (ok) return NCP_OK;
    dense_free(x);
    NCP_FAIL(NCP_ERR_NOMEM, "out of host memory in sink_attention");
}

/* Scores of row (i, h) over keys [j0, j1) into z; returns lse (or -inf without sink and keys). */
static double row_scores(const ncp_sink_attn_params *p, const dense *x, int32_t i, int32_t h, int32_t j0, int32_t j1,
                         double *z) {
    const int32_t g = h / (p->Hq / p->Hkv), D = p->D;
    const double *qrow = x->q + ((size_t)i * p->Hq + h) * D;
    double m = p->sink ? x->sink[h] : -INFINITY;
    for (int32_t j = j0; j < j1; ++j) {
        const double *krow = x->k + ((size_t)j * p->Hkv + g) * D;
        double acc = 0.0;
        for (int32_t d = 0; d < D; ++d) acc += qrow[d] * krow[d];
        z[j - j0] = acc * p->scale;
        if (z[j - j0] > m) m = z[j - j0];
    }
    if (m == -INFINITY) return -INFINITY;
    double l = p->sink ? exp(x->sink[h] - m) : 0.0;
    for (int32_t j = j0; j < j1; ++j) l += exp(z[j - j0] - m);
    return m + log(l);
}

/* ---------------------------------------------------------------------------------------- */
/* forward                                                                                   */
/* ---------------------------------------------------------------------------------------- */

ncp_status ncp_sink_attn_fwd_cpu(const ncp_sink_attn_params *p) {
    NCP_TRY(ncp_sink_attn_check(p, 0));
    NCP_TRY(check_mask_host(p));
    NCP_ARG_CHECK(p->Hq <= 4096, "at most 4096 query heads on the CPU; got %" PRId32, p->Hq);
    const int32_t D = p->D, G = p->Hq / p->Hkv;
    dense x;
    NCP_TRY(dense_init(&x, p, NULL));
    double *z = (double *)malloc(((size_t)p->Tk + 1) * sizeof(double));
    double *acc = (double *)malloc((size_t)D * sizeof(double));
    if (z == NULL || acc == NULL) {
        free(z);
        free(acc);
        dense_free(&x);
        NCP_FAIL(NCP_ERR_NOMEM, "out of host memory in sink_attention");
    }
    int32_t doc = 0;
    for (int32_t i = 0; i < p->Tq; ++i) {
        int32_t j0, j1;
        key_range(p, i, &doc, &j0, &j1);
        for (int32_t h = 0; h < p->Hq; ++h) {
            const double lse = row_scores(p, &x, i, h, j0, j1, z);
            memset(acc, 0, (size_t)D * sizeof(double));
            for (int32_t j = j0; lse != -INFINITY && j < j1; ++j) {
                const double w = exp(z[j - j0] - lse);
                const double *vrow = x.v + ((size_t)j * p->Hkv + h / G) * D;
                for (int32_t d = 0; d < D; ++d) acc[d] += w * vrow[d];
            }
            const int64_t ob = (int64_t)i * p->o_st + (int64_t)h * p->o_sh;
            for (int32_t d = 0; d < D; ++d) store(p->out, p->dtype, ob + d, acc[d]);
            p->lse[(int64_t)h * p->Tq + i] = (float)lse;
        }
    }
    free(z);
    free(acc);
    dense_free(&x);
    return NCP_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* backward                                                                                  */
/* ---------------------------------------------------------------------------------------- */

/* One (query, head) row of the backward: accumulates dk/dv (double) and returns its dsink term. */
static double bwd_row(const ncp_sink_attn_bwd_params *b, const dense *x, int32_t i, int32_t h, int32_t j0, int32_t j1,
                      double *z, double *dqrow, double *dk_acc, double *dv_acc) {
    const ncp_sink_attn_params *p = &b->f;
    const int32_t D = p->D, g = h / (p->Hq / p->Hkv);
    const double lse = row_scores(p, x, i, h, j0, j1, z);
    const size_t rb = ((size_t)i * p->Hq + h) * D;
    const double *qrow = x->q + rb, *orow = x->o + rb, *dorow = x->dout + rb;
    double delta = 0.0;
    for (int32_t d = 0; d < D; ++d) {
        delta += dorow[d] * orow[d];
        dqrow[d] = 0.0;
    }
    for (int32_t j = j0; lse != -INFINITY && j < j1; ++j) {
        const double P = exp(z[j - j0] - lse);
        const size_t kb = ((size_t)j * p->Hkv + g) * D;
        const double *krow = x->k + kb, *vrow = x->v + kb;
        double dp = 0.0;
        for (int32_t d = 0; d < D; ++d) dp += dorow[d] * vrow[d];
        const double dz = P * (dp - delta) * p->scale;
        double *dkj = dk_acc + kb, *dvj = dv_acc + kb;
        for (int32_t d = 0; d < D; ++d) {
            dqrow[d] += dz * krow[d];
            dkj[d] += dz * qrow[d];
            dvj[d] += P * dorow[d];
        }
    }
    const int64_t qb = (int64_t)i * b->dq_st + (int64_t)h * b->dq_sh;
    for (int32_t d = 0; d < D; ++d) store(b->dq, p->dtype, qb + d, dqrow[d]);
    if (b->delta != NULL) b->delta[(int64_t)h * p->Tq + i] = (float)delta;
    return p->sink && lse != -INFINITY ? -exp(x->sink[h] - lse) * delta : 0.0;
}

ncp_status ncp_sink_attn_bwd_cpu(const ncp_sink_attn_bwd_params *b) {
    NCP_TRY(ncp_sink_attn_bwd_check(b, 0));
    const ncp_sink_attn_params *p = &b->f;
    NCP_TRY(check_mask_host(p));
    NCP_ARG_CHECK(p->Hq <= 4096, "at most 4096 query heads on the CPU; got %" PRId32, p->Hq);
    const int32_t D = p->D, Hkv = p->Hkv;
    const size_t kv_elems = (size_t)p->Tk * (size_t)Hkv * (size_t)D;
    dense x;
    NCP_TRY(dense_init(&x, p, b));
    double *z = (double *)malloc(((size_t)p->Tk + 1) * sizeof(double));
    double *dqrow = (double *)malloc(((size_t)D + 1) * sizeof(double));
    double *dk_acc = (double *)calloc(kv_elems + 1, sizeof(double));
    double *dv_acc = (double *)calloc(kv_elems + 1, sizeof(double));
    double *ds = (double *)calloc((size_t)p->Hq, sizeof(double));
    ncp_status st = NCP_OK;
    if (!z || !dqrow || !dk_acc || !dv_acc || !ds) {
        st = ncp_set_error(NCP_ERR_NOMEM, NULL, 0, NULL, NULL, "out of host memory in sink_attention backward");
        goto done;
    }
    int32_t doc = 0;
    for (int32_t i = 0; i < p->Tq; ++i) {
        int32_t j0, j1;
        key_range(p, i, &doc, &j0, &j1);
        for (int32_t h = 0; h < p->Hq; ++h) ds[h] += bwd_row(b, &x, i, h, j0, j1, z, dqrow, dk_acc, dv_acc);
    }
    for (int32_t j = 0; j < p->Tk; ++j)
        for (int32_t g = 0; g < Hkv; ++g)
            for (int32_t d = 0; d < D; ++d) {
                const size_t a = ((size_t)j * Hkv + g) * D + d;
                store(b->dk, p->dtype, (int64_t)j * b->dk_st + (int64_t)g * b->dk_sh + d, dk_acc[a]);
                store(b->dv, p->dtype, (int64_t)j * b->dv_st + (int64_t)g * b->dv_sh + d, dv_acc[a]);
            }
    if (b->dsink != NULL)
        for (int32_t h = 0; h < p->Hq; ++h) store(b->dsink, p->sink_dt, h, ds[h]);
done:
    free(z);
    free(dqrow);
    free(dk_acc);
    free(dv_acc);
    free(ds);
    dense_free(&x);
    return st;
}
