/* gradops.c: CPU implementation of the multi-buffer gradient passes in gradops.h (unscale + non-finite
 * check, global norm, scale by a factor). Not for: Python, casts to other dtypes (cast.c).
 *
 * All buffers form one flat index space [0, total); acc_parallel_for splits it into per-thread chunks, and
 * each chunk walks the buffers it overlaps. Within a buffer the work goes in blocks of BLK elements that
 * are first widened to fp32 (bf16/fp16), so every kernel is an fp32 loop; the widening, the check and the
 * multiply are exact or single-rounding operations, so all SIMD levels give the same bits. Only the fp64
 * sum of squares differs in association between levels (documented in gradops.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "acc.h"
#include "fpconv.h"
#include "ops/gradops.h"
#include "parallel.h"
#include "simd.h"

#define BLK 2048
#define MIN_PER_THREAD ((size_t)1 << 20) /* threads are created per call: give each >= 1M elements */

enum { OP_SCALE = 0, OP_NORM2 = 1, OP_NORM1 = 2, OP_NORMINF = 3 };

typedef struct {
    const acc_buf *bufs;
    size_t nbufs;
    const size_t *off; /* off[t] = first flat index of buffer t; off[nbufs] = total */
    float factor;
    int check, op;
    acc_simd_level level;
    int found[ACC_MAX_THREADS];
    double part[ACC_MAX_THREADS]; /* sum (norm 1/2) or max |x| (inf) of each chunk */
} multi_ctx;

/* ---- ISA-specific pieces (separate functions: intrinsics cannot be inlined into the scalar path) ------- */

/* fp16 <-> fp32 with F16C, whole groups of 8; return how many elements were done */
static ACC_TARGET_AVX2 size_t widen_f16_f16c(const uint16_t *h, size_t m, float *tmp) {
    size_t j = 0;
    for (; j + 8 <= m; j += 8) _mm256_storeu_ps(tmp + j, acc_f16x8_to_f32(_mm_loadu_si128((const __m128i *)(h + j))));
    return j;
}

static ACC_TARGET_AVX2 size_t narrow_f16_f16c(uint16_t *h, size_t m, const float *tmp) {
    size_t j = 0;
    for (; j + 8 <= m; j += 8) _mm_storeu_si128((__m128i *)(h + j), acc_f32x8_to_f16(_mm256_loadu_ps(tmp + j)));
    return j;
}

/* sum of squares in fp64 over whole vectors; returns elements done, adds the sum to *s */
static ACC_TARGET_AVX512 size_t sum_sq_avx512(const float *x, size_t m, double *s) {
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    size_t j = 0;
    for (; j + 16 <= m; j += 16) {
        __m512d lo = _mm512_cvtps_pd(_mm256_loadu_ps(x + j)), hi = _mm512_cvtps_pd(_mm256_loadu_ps(x + j + 8));
        a0 = _mm512_fmadd_pd(lo, lo, a0);
        a1 = _mm512_fmadd_pd(hi, hi, a1);
    }
    *s += _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
    return j;
}

static ACC_TARGET_AVX2 size_t sum_sq_avx2(const float *x, size_t m, double *s) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    size_t j = 0;
    for (; j + 8 <= m; j += 8) {
        __m256d lo = _mm256_cvtps_pd(_mm_loadu_ps(x + j)), hi = _mm256_cvtps_pd(_mm_loadu_ps(x + j + 4));
        a0 = _mm256_fmadd_pd(lo, lo, a0);
        a1 = _mm256_fmadd_pd(hi, hi, a1);
    }
    double t[4];
    _mm256_storeu_pd(t, _mm256_add_pd(a0, a1));
    *s += (t[0] + t[1]) + (t[2] + t[3]);
    return j;
}

/* ---- per-block kernels, generic C instantiated per ISA (ISA: 0 scalar, 1 avx2, 2 avx512) ---------------- */

static inline ACC_AI void widen(const void *data, acc_dtype dt, size_t i, size_t m, float *tmp, const int ISA) {
    const uint16_t *h = (const uint16_t *)data + i;
    if (dt == ACC_BF16) {
        for (size_t j = 0; j < m; j++) tmp[j] = acc_bf16_to_f32(h[j]);
        return;
    }
    size_t j = ISA >= 1 ? widen_f16_f16c(h, m, tmp) : 0;
    for (; j < m; j++) tmp[j] = acc_f16_to_f32(h[j]);
}

static inline ACC_AI void narrow(void *data, acc_dtype dt, size_t i, size_t m, const float *tmp, const int ISA) {
    uint16_t *h = (uint16_t *)data + i;
    if (dt == ACC_BF16) {
        for (size_t j = 0; j < m; j++) h[j] = acc_f32_to_bf16(tmp[j], 0xffff); /* torch's vectorised NaN */
        return;
    }
    size_t j = ISA >= 1 ? narrow_f16_f16c(h, m, tmp) : 0;
    for (; j < m; j++) h[j] = acc_f32_to_f16(tmp[j]);
}

static inline ACC_AI int any_nonfinite(const float *x, size_t m) {
    uint32_t bad = 0;
    for (size_t j = 0; j < m; j++) bad |= (acc_f2u(x[j]) & 0x7f800000u) == 0x7f800000u;
    return bad != 0;
}

static inline ACC_AI double sum_sq(const float *x, size_t m, const int ISA) {
    double s = 0;
    size_t j = ISA == 2 ? sum_sq_avx512(x, m, &s) : ISA == 1 ? sum_sq_avx2(x, m, &s) : 0;
    double s0 = 0, s1 = 0;
    for (; j + 2 <= m; j += 2) {
        s0 += (double)x[j] * x[j];
        s1 += (double)x[j + 1] * x[j + 1];
    }
    if (j < m) s0 += (double)x[j] * x[j];
    return s + (s0 + s1);
}

static inline ACC_AI double sum_abs(const float *x, size_t m) {
    double s0 = 0, s1 = 0;
    size_t j = 0;
    for (; j + 2 <= m; j += 2) {
        s0 += fabs((double)x[j]);
        s1 += fabs((double)x[j + 1]);
    }
    if (j < m) s0 += fabs((double)x[j]);
    return s0 + s1;
}

static inline ACC_AI uint32_t max_key(const float *x, size_t m) { /* |x| bits; NaN sorts above inf */
    uint32_t k = 0;
    for (size_t j = 0; j < m; j++) {
        uint32_t a = acc_f2u(x[j]) & 0x7fffffffu;
        k = a > k ? a : k;
    }
    return k;
}

/* One segment [lo, hi) of one buffer. Returns found (OP_SCALE) and accumulates into *acc (norms). */
static inline ACC_AI int segment(const multi_ctx *c, const acc_buf *bf, size_t lo, size_t hi, double *acc,
                                 uint32_t *key, const int ISA) {
    float tmp[BLK];
    int found = 0;
    for (size_t i = lo; i < hi; i += BLK) {
        size_t m = hi - i < BLK ? hi - i : BLK;
        float *x;
        if (bf->dtype == ACC_F32) x = (float *)bf->data + i;
        else { widen(bf->data, bf->dtype, i, m, tmp, ISA); x = tmp; }
        switch (c->op) {
        case OP_SCALE:
            if (c->check) found |= any_nonfinite(x, m);
            if (c->factor != 1.0f) {
                const float f = c->factor;
                for (size_t j = 0; j < m; j++) x[j] = x[j] * f;
                if (bf->dtype != ACC_F32) narrow(bf->data, bf->dtype, i, m, tmp, ISA);
            }
            break;
        case OP_NORM2: *acc += sum_sq(x, m, ISA); break;
        case OP_NORM1: *acc += sum_abs(x, m); break;
        default: {
            uint32_t k = max_key(x, m);
            *key = k > *key ? k : *key;
        }
        }
    }
    return found;
}

static inline ACC_AI int chunk_impl(multi_ctx *c, size_t b, size_t e, int chunk, const int ISA) {
    /* first buffer whose range reaches past b (buffers may be empty) */
    size_t lo = 0, hi = c->nbufs;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (c->off[mid + 1] <= b) lo = mid + 1;
        else hi = mid;
    }
    int found = 0;
    double acc = 0;
    uint32_t key = 0;
    for (size_t t = lo; t < c->nbufs && c->off[t] < e; t++) {
        size_t s0 = b > c->off[t] ? b - c->off[t] : 0, s1 = (e < c->off[t + 1] ? e : c->off[t + 1]) - c->off[t];
        if (s0 < s1) found |= segment(c, &c->bufs[t], s0, s1, &acc, &key, ISA);
    }
    c->found[chunk] = found;
    c->part[chunk] = c->op == OP_NORMINF ? (key > 0x7f800000u ? NAN : (double)acc_u2f(key)) : acc;
    return 0;
}

ACC_SIMD_INSTANCES(int, chunk, (multi_ctx *c, size_t b, size_t e, int k), chunk_impl, c, b, e, k)

static int multi_chunk(void *ctx, size_t b, size_t e, int chunk) {
    multi_ctx *c = (multi_ctx *)ctx;
    return ACC_SIMD_CALL(c->level, chunk, c, b, e, chunk);
}

static acc_status run(multi_ctx *c, const acc_buf *bufs, size_t nbufs, int nthreads, void *stream, int *chunks) {
    if (stream) {
        acc_set_error("the CPU gradient kernels take no stream");
        return ACC_ERR_ARG;
    }
    size_t *off = (size_t *)malloc((nbufs + 1) * sizeof *off);
    if (!off) {
        acc_set_error("out of memory for %zu buffer offsets", nbufs);
        return ACC_ERR_NOMEM;
    }
    off[0] = 0;
    for (size_t t = 0; t < nbufs; t++) {
        acc_dtype d = bufs[t].dtype;
        if (d != ACC_F32 && d != ACC_BF16 && d != ACC_F16) {
            free(off);
            acc_set_error("buffer %zu: unsupported dtype %s (float32, bfloat16, float16)", t, acc_dtype_name(d));
            return ACC_ERR_DTYPE;
        }
        if (bufs[t].n && !bufs[t].data) {
            free(off);
            acc_set_error("buffer %zu: NULL data", t);
            return ACC_ERR_ARG;
        }
        off[t + 1] = off[t] + bufs[t].n;
    }
    c->bufs = bufs;
    c->nbufs = nbufs;
    c->off = off;
    c->level = acc_simd_level_get();
    *chunks = 0;
    int rc = off[nbufs] ? acc_parallel_for(off[nbufs], nthreads, MIN_PER_THREAD, multi_chunk, c, chunks) : 0;
    free(off);
    return (acc_status)rc;
}

acc_status acc_multi_scale(const acc_buf *bufs, size_t nbufs, float factor, float *found_inf, int nthreads,
                           void *stream) {
    static multi_ctx zero;
    multi_ctx c = zero;
    c.op = OP_SCALE;
    c.factor = factor;
    c.check = found_inf != NULL;
    int chunks;
    acc_status st = run(&c, bufs, nbufs, nthreads, stream, &chunks);
    if (st) return st;
    for (int t = 0; t < chunks && found_inf; t++)
        if (c.found[t]) *found_inf = 1.0f;
    return ACC_OK;
}

acc_status acc_multi_norm(const acc_buf *bufs, size_t nbufs, double norm_type, double *out, int nthreads,
                          void *stream) {
    static multi_ctx zero;
    multi_ctx c = zero;
    if (norm_type == 2.0) c.op = OP_NORM2;
    else if (norm_type == 1.0) c.op = OP_NORM1;
    else if (isinf(norm_type) && norm_type > 0) c.op = OP_NORMINF;
    else {
        acc_set_error("acc_multi_norm: norm_type must be 1, 2 or inf (got %g)", norm_type);
        return ACC_ERR_ARG;
    }
    int chunks;
    acc_status st = run(&c, bufs, nbufs, nthreads, stream, &chunks);
    if (st) return st;
    double r = 0;
    for (int t = 0; t < chunks; t++) {
        double p = c.part[t];
        if (c.op == OP_NORMINF) r = (isnan(p) || isnan(r)) ? NAN : (p > r ? p : r);
        else r += p;
    }
    *out = c.op == OP_NORM2 ? sqrt(r) : r;
    return ACC_OK;
}
