/*
 * cpu/cp_exchange.c: the Flint CP rank step's bookkeeping around the all-to-all (ncp.h): gather
 * the rows a rank sends, assemble the K/V buffer sorted by global position, and sum the gradients
 * other ranks return, on the CPU (the gloo path and the oracle of the CUDA kernels), plus the
 * argument checks both backends share. Plain loops; an index outside its table reads zeros.
 * Tests: tests/test_flint_plan.py, tests/test_flint_dist.py   CUDA: cuda/cp_exchange.cu
 */
#include <inttypes.h>
#include <math.h>
#include <string.h>

#include "ncp/ncp.h"
#include "ncp/ncp_check.h"

static ncp_status check_pair(const ncp_kv_pair *s, const char *name) {
    NCP_ARG_CHECK(s->rows >= 0 && s->H > 0 && s->D > 0, "%s: rows >= 0, heads > 0 and head_dim > 0 required; got "
                  "%" PRId32 ", %" PRId32 ", %" PRId32, name, s->rows, s->H, s->D);
    NCP_ARG_CHECK(s->rows == 0 || (s->a != NULL && s->b != NULL), "%s: tensors must not be NULL", name);
    NCP_ARG_CHECK(s->dtype == NCP_DT_F16 || s->dtype == NCP_DT_BF16 || s->dtype == NCP_DT_F32 || s->dtype == NCP_DT_F64,
                  "%s: dtype must be float16, bfloat16, float32 or float64", name);
    return NCP_OK;
}

ncp_status ncp_kv_gather_check(const ncp_kv_gather_params *p) {
    NCP_ARG_CHECK(p != NULL, "kv_gather: params must not be NULL");
    NCP_TRY(check_pair(&p->src, "kv_gather"));
    NCP_ARG_CHECK(p->n >= 0 && (p->n == 0 || (p->idx != NULL && p->out != NULL)), "kv_gather: idx and out required");
    return NCP_OK;
}

ncp_status ncp_kv_assemble_check(const ncp_kv_assemble_params *p) {
    NCP_ARG_CHECK(p != NULL, "kv_assemble: params must not be NULL");
    NCP_TRY(check_pair(&p->local, "kv_assemble"));
    NCP_ARG_CHECK(p->n_recv >= 0 && (p->n_recv == 0 || p->recv != NULL), "kv_assemble: recv required");
    NCP_ARG_CHECK(p->n_slots >= 0 && (p->n_slots == 0 || (p->slot_src && p->kbuf && p->vbuf)),
                  "kv_assemble: slot_src, kbuf and vbuf required");
    return NCP_OK;
}

ncp_status ncp_kv_grad_sum_check(const ncp_kv_grad_sum_params *p) {
    NCP_ARG_CHECK(p != NULL, "kv_grad_sum: params must not be NULL");
    NCP_TRY(check_pair(&p->buf, "kv_grad_sum"));
    NCP_ARG_CHECK(p->n_local >= 0 && p->n_back >= 0, "kv_grad_sum: sizes must be >= 0");
    NCP_ARG_CHECK(p->n_local == 0 || (p->local_slot && p->ret_off && p->dk && p->dv),
                  "kv_grad_sum: local_slot, ret_off, dk and dv required");
    NCP_ARG_CHECK(p->n_back == 0 || (p->back && p->ret_idx), "kv_grad_sum: back and ret_idx required");
    return NCP_OK;
}

static double ld(const void *base, ncp_dtype dt, int64_t i) {
    switch (dt) {
    case NCP_DT_F16: {
        const uint16_t h = ((const uint16_t *)base)[i];
        const int sign = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
        double v = e == 0 ? m * 0x1p-24 : (e == 31 ? (m ? NAN : INFINITY) : (1.0 + m * 0x1p-10) * (double)(1 << e) * 0x1p-15);
        return sign ? -v : v;
    }
    case NCP_DT_BF16: {
        const uint32_t x = (uint32_t)((const uint16_t *)base)[i] << 16;
        float f;
        memcpy(&f, &x, 4);
        return f;
    }
    case NCP_DT_F32: return ((const float *)base)[i];
    default: return ((const double *)base)[i];
    }
}

/* Rounds to the nearest even 16-bit value (the kernels' cvt.rn). */
static void st(void *base, ncp_dtype dt, int64_t i, double v) {
    if (dt == NCP_DT_F32) {
        ((float *)base)[i] = (float)v;
        return;
    }
    if (dt == NCP_DT_F64) {
        ((double *)base)[i] = v;
        return;
    }
    float f = (float)v;
    uint32_t x;
    memcpy(&x, &f, 4);
    if (dt == NCP_DT_BF16) {
        const uint16_t r = (x & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((x >> 16) | 0x40u)
                                                           : (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
        ((uint16_t *)base)[i] = r;
        return;
    }
    /* float16 via the exact reference conversion of cpu/sink_attn.c semantics: round to nearest even */
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    uint16_t h;
    if (ax >= 0x7f800000u) h = (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    else if (ax >= 0x477ff000u) h = (uint16_t)(sign | 0x7c00u);
    else if (ax < 0x38800000u) {
        float a;
        memcpy(&a, &ax, 4);
        h = (uint16_t)(sign | (uint32_t)nearbyintf(a * 16777216.0f));
    } else {
        uint32_t out = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13), rem = ax & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (out & 1u))) out += 1;
        h = (uint16_t)(sign | out);
    }
    ((uint16_t *)base)[i] = h;
}

/* Copies row r of the pair (zeros when r is out of range) into dst[0, 2D) as [a | b]. */
static void copy_row(const ncp_kv_pair *s, int64_t r, void *dst, int64_t dst_off, int half) {
    const int64_t es = (int64_t)ncp_dtype_size(s->dtype), D = s->D;
    for (int32_t h = 0; h < s->H; ++h) {
        char *d = (char *)dst + (dst_off + (int64_t)h * (half ? D : 2 * D)) * es;
        for (int part = 0; part < (half ? 1 : 2); ++part) {
            const int use_b = half == 2 || part == 1;
            const void *src = use_b ? s->b : s->a;
            const int64_t st_ = use_b ? s->b_st : s->a_st, sh = use_b ? s->b_sh : s->a_sh;
            if (r < 0 || r >= s->rows) memset(d + part * D * es, 0, (size_t)(D * es));
            else memcpy(d + part * D * es, (const char *)src + (r * st_ + h * sh) * es, (size_t)(D * es));
        }
    }
}

ncp_status ncp_kv_gather_cpu(const ncp_kv_gather_params *p) {
    NCP_TRY(ncp_kv_gather_check(p));
    const int64_t row = 2LL * p->src.H * p->src.D;
    for (int32_t j = 0; j < p->n; ++j) copy_row(&p->src, p->idx[j], p->out, j * row, 0);
    return NCP_OK;
}

ncp_status ncp_kv_assemble_cpu(const ncp_kv_assemble_params *p) {
    NCP_TRY(ncp_kv_assemble_check(p));
    const ncp_kv_pair *l = &p->local;
    const int64_t es = (int64_t)ncp_dtype_size(l->dtype), HD = (int64_t)l->H * l->D;
    for (int32_t s = 0; s < p->n_slots; ++s) {
        const int64_t r = p->slot_src[s];
        if (r < l->rows) {
            copy_row(l, r, p->kbuf, s * HD, 1);
            copy_row(l, r, p->vbuf, s * HD, 2);
            continue;
        }
        const int64_t m = r - l->rows;
        for (int32_t h = 0; h < l->H; ++h) {
            char *kd = (char *)p->kbuf + (s * HD + (int64_t)h * l->D) * es, *vd = (char *)p->vbuf + (s * HD + (int64_t)h * l->D) * es;
            if (m >= p->n_recv) {
                memset(kd, 0, (size_t)(l->D * es));
                memset(vd, 0, (size_t)(l->D * es));
                continue;
            }
            const char *src = (const char *)p->recv + (m * 2 * HD + (int64_t)h * 2 * l->D) * es;
            memcpy(kd, src, (size_t)(l->D * es));
            memcpy(vd, src + l->D * es, (size_t)(l->D * es));
        }
    }
    return NCP_OK;
}

ncp_status ncp_kv_grad_sum_cpu(const ncp_kv_grad_sum_params *p) {
    NCP_TRY(ncp_kv_grad_sum_check(p));
    const ncp_kv_pair *b = &p->buf;
    const int64_t D = b->D, HD = (int64_t)b->H * D;
    for (int32_t i = 0; i < p->n_local; ++i) {
        const int64_t slot = p->local_slot[i];
        const int32_t j0 = p->ret_off[i], j1 = p->ret_off[i + 1];
        for (int32_t h = 0; h < b->H; ++h)
            for (int part = 0; part < 2; ++part) {
                const void *src = part ? b->b : b->a;
                const int64_t st_ = part ? b->b_st : b->a_st, sh = part ? b->b_sh : b->a_sh;
                for (int64_t d = 0; d < D; ++d) {
                    double acc = slot >= 0 && slot < b->rows ? ld(src, b->dtype, slot * st_ + h * sh + d) : 0.0;
                    for (int32_t j = j0; j < j1 && j >= 0 && j1 <= p->n_back; ++j) {
                        const int64_t r = p->ret_idx[j];
                        if (r >= 0 && r < p->n_back) acc += ld(p->back, b->dtype, r * 2 * HD + h * 2 * D + part * D + d);
                    }
                    st(part ? p->dv : p->dk, b->dtype, i * HD + h * D + d, acc);
                }
            }
    }
    return NCP_OK;
}
