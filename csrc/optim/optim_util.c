/* optim_util.c: the multi-tensor parallel driver and the non-finite gradient check (see optim_util.h).
 * Not for: the optimizer updates (adam.c, sgd.c). */
#include <stdlib.h>

#include "optim_util.h"
#include "parallel.h"
#include "simd.h"

typedef struct {
    const size_t *ns;
    const size_t *start; /* prefix sums: start[k] = sum of ns[0..k) ; start[nseg] = total */
    size_t nseg;
    acc_seg_fn fn;
    void *ctx;
} seg_job;

static int seg_range(void *vctx, size_t begin, size_t end, int chunk) {
    seg_job *j = (seg_job *)vctx;
    /* first segment whose end is past `begin` (binary search over the prefix sums) */
    size_t lo = 0, hi = j->nseg;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (j->start[mid + 1] <= begin) lo = mid + 1;
        else hi = mid;
    }
    for (size_t s = lo; s < j->nseg && j->start[s] < end; s++) {
        size_t a = begin > j->start[s] ? begin - j->start[s] : 0;
        size_t b = end < j->start[s + 1] ? end - j->start[s] : j->ns[s];
        if (a < b) j->fn(j->ctx, s, a, b);
    }
    return 0;
}

acc_status acc_segments_parallel(const size_t *ns, size_t nseg, int nthreads, acc_seg_fn fn, void *ctx) {
    return acc_segments_parallel_min(ns, nseg, nthreads, ACC_OPTIM_MIN_PER_THREAD, fn, ctx);
}

acc_status acc_segments_parallel_min(const size_t *ns, size_t nseg, int nthreads, size_t min_per_thread,
                                     acc_seg_fn fn, void *ctx) {
    if (nseg == 0) return ACC_OK;
    size_t *start = (size_t *)malloc((nseg + 1) * sizeof(size_t));
    if (!start) return ACC_ERR_NOMEM;
    start[0] = 0;
    for (size_t k = 0; k < nseg; k++) start[k + 1] = start[k] + ns[k];
    seg_job j = {ns, start, nseg, fn, ctx};
    int rc = acc_parallel_for(start[nseg], nthreads, min_per_thread, seg_range, &j, NULL);
    free(start);
    return (acc_status)rc;
}

/* ---- non-finite check -------------------------------------------------------------------------- */

typedef struct {
    const void *const *grads;
    const acc_dtype *dts;
    float scale;
    volatile int found; /* set by any thread; only ever goes 0 -> 1 */
} nf_ctx;

static int nf_scalar(const void *g, acc_dtype dt, size_t lo, size_t hi, float scale) {
    for (size_t i = lo; i < hi; i++) {
        float x = acc_load_elem(g, dt, i) * scale;
        if (x - x != 0.0f) return 1; /* inf - inf and NaN - NaN are NaN; finite - itself is 0 */
    }
    return 0;
}

#ifdef ACC_X86
ACC_TARGET_AVX512 static int nf_avx512(const void *g, acc_dtype dt, size_t lo, size_t hi, float scale) {
    const __m512 s = _mm512_set1_ps(scale);
    __mmask16 bad = 0;
    size_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m512 x;
        if (dt == ACC_F32) x = _mm512_loadu_ps((const float *)g + i);
        else if (dt == ACC_BF16) x = acc_bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i)));
        else x = acc_f16x16_to_f32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i)));
        x = _mm512_mul_ps(x, s);
        bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), _mm512_sub_ps(x, x), _CMP_UNORD_Q);
        if ((i & 4095) == 0 && bad) return 1;
    }
    return bad ? 1 : nf_scalar(g, dt, i, hi, scale);
}

ACC_TARGET_AVX2 static int nf_avx2(const void *g, acc_dtype dt, size_t lo, size_t hi, float scale) {
    const __m256 s = _mm256_set1_ps(scale);
    __m256 bad = _mm256_setzero_ps();
    size_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m256 x;
        if (dt == ACC_F32) x = _mm256_loadu_ps((const float *)g + i);
        else if (dt == ACC_BF16) x = acc_bf16x8_to_f32(_mm_loadu_si128((const __m128i *)((const uint16_t *)g + i)));
        else x = acc_f16x8_to_f32(_mm_loadu_si128((const __m128i *)((const uint16_t *)g + i)));
        x = _mm256_mul_ps(x, s);
        __m256 z = _mm256_sub_ps(x, x);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(z, z, _CMP_UNORD_Q));
    }
    return _mm256_movemask_ps(bad) ? 1 : nf_scalar(g, dt, i, hi, scale);
}
#endif

static void nf_seg(void *vctx, size_t seg, size_t lo, size_t hi) {
    nf_ctx *c = (nf_ctx *)vctx;
    if (c->found) return;
    if (ACC_SIMD_CALL(acc_simd_level_get(), nf, c->grads[seg], c->dts[seg], lo, hi, c->scale)) c->found = 1;
}

acc_status acc_grads_nonfinite(const void *const *grads, const acc_dtype *dts, const size_t *ns, size_t nseg,
                               float scale, int nthreads, int *found) {
    for (size_t k = 0; k < nseg; k++)
        if (dts[k] != ACC_F32 && dts[k] != ACC_BF16 && dts[k] != ACC_F16) {
            acc_set_error("gradient dtype %s is not supported (float32, bfloat16, float16)", acc_dtype_name(dts[k]));
            return ACC_ERR_DTYPE;
        }
    nf_ctx c = {grads, dts, scale, 0};
    acc_status st = acc_segments_parallel(ns, nseg, nthreads, nf_seg, &c);
    *found = c.found;
    return st;
}
