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
 * Masks (ncp.h, ncp_attn_mask): documents, V(i) = [max(doc_start(i), i - window + 1), i]; a table,
 * V(i) = [row_lo[i], row_hi[i]] clipped to [0, Tk). NaN in a visible score or in the sink makes the
 * row's out, lse and gradients NaN; +inf there gives NaN too (documented, not the limit).
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
#include "attn_args.h"

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
/* per-row key ranges                                                                        */
/* ---------------------------------------------------------------------------------------- */

/* Visible keys of query i form the index range [*j0, *j1). `doc` walks cu_seqlens forward. */
static void key_range(const ncp_sink_attn_params *p, int32_t i, int32_t *doc, int32_t *j0, int32_t *j1) {
    const ncp_attn_mask *m = &p->mask;
    int64_t lo, hi;
    if (m->kind == NCP_MASK_DOCS) {
        while (*doc + 1 < m->n_cu - 1 && m->cu_seqlens[*doc + 1] <= i) ++*doc;
        lo = m->cu_seqlens[*doc];
        if (m->window > 0 && (int64_t)i - m->window + 1 > lo) lo = (int64_t)i - m->window + 1;
        hi = i;
    } else {
        lo = m->row_lo[i];
        hi = m->row_hi[i];
    }
    if (lo < 0) lo = 0;
    if (hi > (int64_t)p->Tk - 1) hi = (int64_t)p->Tk - 1;
    *j0 = (int32_t)lo;
    *j1 = hi + 1 > lo ? (int32_t)(hi + 1) : (int32_t)lo;
}

/* The tensors as contiguous double arrays [T][H][D], converted once (the loops below then run on
 * plain doubles instead of converting every element at every use). */
typedef struct {
    double *q, *k, *v, *o, *dout; /* q, o, dout: (Tq, Hq, D); k, v: (Tk, Hkv, D) */
    double *sink;                 /* (Hq,) */
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
    free(x->sink);
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
    x->sink = (double *)malloc(((size_t)p->Hq + 1) * sizeof(double));
    ok = ok && x->sink;
    for (int32_t h = 0; ok && p->sink != NULL && h < p->Hq; ++h) x->sink[h] = load(p->sink, p->sink_dt, h);
    if (ok) return NCP_OK;
    dense_free(x);
    NCP_FAIL(NCP_ERR_NOMEM, "out of host memory in sink_attention");
}

/* Scores of row (i, h) over keys [j0, j1) into z; returns lse: -inf without sink and keys, NaN
 * when a score or the sink is NaN (NaN in, NaN out) and, as documented, when a score or the sink is
 * +inf (exp(inf - inf)). */
static double row_scores(const ncp_sink_attn_params *p, const dense *x, int32_t i, int32_t h, int32_t j0, int32_t j1,
                         double *z) {
    const int32_t g = h / (p->Hq / p->Hkv), D = p->D;
    const double *qrow = x->q + ((size_t)i * p->Hq + h) * D;
    double m = p->sink ? x->sink[h] : -INFINITY;
    int nan = isnan(m);
    for (int32_t j = j0; j < j1; ++j) {
        const double *krow = x->k + ((size_t)j * p->Hkv + g) * D;
        double acc = 0.0;
        for (int32_t d = 0; d < D; ++d) acc += qrow[d] * krow[d];
        z[j - j0] = acc * p->scale;
        nan |= isnan(z[j - j0]);
        if (z[j - j0] > m) m = z[j - j0];
    }
    if (nan) return NAN;
    if (m == -INFINITY) return -INFINITY;
    double l = p->sink ? exp(x->sink[h] - m) : 0.0;
    for (int32_t j = j0; j < j1; ++j) l += exp(z[j - j0] - m);
    return m + log(l);
}

/* ---------------------------------------------------------------------------------------- */
/* forward                                                                                   */
/* ---------------------------------------------------------------------------------------- */

ncp_status ncp_sink_attn_fwd_cpu(const ncp_sink_attn_params *p) {
    NCP_TRY(ncp_sink_attn_validate(p, 0));
    NCP_TRY(ncp_attn_mask_check_host(&p->mask, p->Tq, p->Tk));
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
    return p->sink && lse != -INFINITY ? -exp(x->sink[h] - lse) * delta : 0.0;
}

ncp_status ncp_sink_attn_bwd_cpu(const ncp_sink_attn_bwd_params *b) {
    NCP_TRY(ncp_sink_attn_bwd_validate(b, 0));
    const ncp_sink_attn_params *p = &b->f;
    NCP_TRY(ncp_attn_mask_check_host(&p->mask, p->Tq, p->Tk));
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
