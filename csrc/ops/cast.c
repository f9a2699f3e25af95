/* cast.c: the CPU implementation of acc_cast (cast.h): scalar, AVX2 and AVX-512 paths chosen at run time,
 * all producing the bits of the scalar reference in fpconv.h, split over threads by acc_parallel_for.
 * The conversions themselves (scalar and vector) are fpconv.h's; this file adds loads, stores, amax and the
 * loop layout, as the triple range_scalar / range_avx2 / range_avx512 (simd.h).
 * Not for: strided inputs, other rounding modes, or Python.
 *
 * Layout of one chunk [b, e) (every path): a scalar prologue until the destination is 64-byte aligned,
 * a vector loop of 16 elements per step (streaming stores when the output is large, see cast.h), and a
 * scalar tail. amax is tracked as an integer "magnitude key": the source bits with the sign cleared, whose
 * unsigned order is the order of |x| with every NaN above +inf, so NaN propagation costs nothing and the
 * per-chunk partials combine exactly in any order. The key is turned into an fp32 value once at the end.
 *
 * Each loop body is an always-inline function of constant (src dtype, dst dtype, has scale, has amax)
 * arguments, instantiated for all 60 combinations per ISA by the DISPATCH macro, so the inner loops carry
 * no per-element branches on dtype. */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "acc.h"
#include "fpconv.h"
#include "ops/cast.h"
#include "options.h"
#include "parallel.h"
#include "simd.h"

#define MIN_PER_THREAD ((size_t)1 << 20) /* threads are created per call (~30-50 us each): give each >= 1M elements */

typedef struct {
    const void *src;
    void *dst;
    float scale;
    int nt; /* use streaming stores */
    acc_simd_level level;
    acc_dtype sd, dd;
    int has_scale, has_amax;
    uint32_t key[ACC_MAX_THREADS]; /* per-chunk amax keys */
} cast_ctx;

/* ---- scalar element (the reference every path uses for prologues and tails) -------------------------- */

static inline ACC_AI uint32_t mag_key(const void *src, size_t i, const int S) {
    if (S == ACC_F32) return ((const uint32_t *)src)[i] & 0x7fffffffu;
    return ((const uint16_t *)src)[i] & 0x7fffu;
}

static inline ACC_AI float load1(const void *src, size_t i, const int S) {
    if (S == ACC_F32) return ((const float *)src)[i];
    if (S == ACC_BF16) return acc_bf16_to_f32(((const uint16_t *)src)[i]);
    return acc_f16_to_f32(((const uint16_t *)src)[i]);
}

static inline ACC_AI void store1(void *dst, size_t i, float v, const int D, uint16_t nan16) {
    switch (D) {
    case ACC_F32: ((float *)dst)[i] = v; break;
    case ACC_BF16: ((uint16_t *)dst)[i] = acc_f32_to_bf16(v, nan16); break;
    case ACC_F16: ((uint16_t *)dst)[i] = acc_f32_to_f16(v); break;
    case ACC_E4M3: ((uint8_t *)dst)[i] = acc_f32_to_e4m3(v); break;
    default: ((uint8_t *)dst)[i] = acc_f32_to_e5m2(v); break;
    }
}

/* torch's fp16 -> bf16 (no multiply) goes through c10's scalar converter, whose NaN is 0x7FC0; every
 * other route to bf16 goes through the vectorised fp32 -> bf16 trick, whose NaN is 0xFFFF. */
#define NAN16(S, HS) ((uint16_t)(((S) == ACC_F16 && !(HS)) ? 0x7fc0 : 0xffff))

static inline ACC_AI uint32_t scalar_part(const cast_ctx *c, size_t b, size_t e, const int S, const int D,
                                      const int HS, const int HA, uint32_t key) {
    const uint16_t nan16 = NAN16(S, HS);
    for (size_t i = b; i < e; i++) {
        if (HA) {
            uint32_t k = mag_key(c->src, i, S);
            key = k > key ? k : key;
        }
        float v = load1(c->src, i, S);
        if (HS) v = v * c->scale;
        store1(c->dst, i, v, D, nan16);
    }
    return key;
}

static inline size_t dsize(const int D) { return D == ACC_F32 ? 4 : (D == ACC_BF16 || D == ACC_F16) ? 2 : 1; }

/* elements to process before dst + i*osz is 64-byte aligned (capped at e - i) */
static inline size_t align_prologue(const void *dst, size_t i, size_t e, size_t osz) {
    uintptr_t addr = (uintptr_t)dst + i * osz;
    size_t pro = ((64 - (addr & 63)) & 63) / osz;
    return pro > e - i ? e - i : pro;
}

static inline ACC_AI uint32_t body_scalar(const cast_ctx *c, size_t b, size_t e, const int S, const int D, const int HS,
                                      const int HA) {
    return scalar_part(c, b, e, S, D, HS, HA, 0);
}

/* ---- AVX-512 (conversions: fpconv.h) ------------------------------------------------------------------ */

static inline ACC_AI ACC_TARGET_AVX512 __m512 ld512(const void *src, size_t i, const int S, const int HA,
                                                    __m512i *key) {
    if (S == ACC_F32) {
        __m512 v = _mm512_loadu_ps((const float *)src + i);
        if (HA) *key = _mm512_max_epu32(*key, _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
        return v;
    }
    __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i));
    if (HA) *key = _mm512_max_epu32(*key, _mm512_and_si512(_mm512_cvtepu16_epi32(raw), _mm512_set1_epi32(0x7fff)));
    if (S == ACC_BF16) return acc_bf16x16_to_f32(raw);
    return acc_f16x16_to_f32(raw);
}

static inline ACC_AI ACC_TARGET_AVX512 void st512(void *dst, size_t i, __m512 v, const int D, uint16_t nan16, int nt) {
    if (D == ACC_F32) {
        if (nt) _mm512_stream_ps((float *)dst + i, v);
        else _mm512_storeu_ps((float *)dst + i, v);
        return;
    }
    if (D == ACC_BF16 || D == ACC_F16) {
        __m256i h;
        if (D == ACC_F16) h = acc_f32x16_to_f16(v);
        else h = acc_f32x16_to_bf16(v, nan16);
        __m256i *p = (__m256i *)((uint16_t *)dst + i);
        if (nt) _mm256_stream_si256(p, h);
        else _mm256_storeu_si256(p, h);
        return;
    }
    __m128i b = acc_f32x16_to_fp8(v, D == ACC_E4M3);
    __m128i *p = (__m128i *)((uint8_t *)dst + i);
    if (nt) _mm_stream_si128(p, b);
    else _mm_storeu_si128(p, b);
}

static inline ACC_AI ACC_TARGET_AVX512 uint32_t body512(const cast_ctx *c, size_t b, size_t e, const int S, const int D,
                                                        const int HS, const int HA) {
    const uint16_t nan16 = NAN16(S, HS);
    size_t i = b + align_prologue(c->dst, b, e, dsize(D));
    uint32_t key = scalar_part(c, b, i, S, D, HS, HA, 0);
    const int nt = c->nt && (((uintptr_t)c->dst + i * dsize(D)) & 63) == 0;
    const __m512 vs = _mm512_set1_ps(c->scale);
    __m512i vkey = _mm512_setzero_si512();
    for (; i + 16 <= e; i += 16) {
        __m512 v = ld512(c->src, i, S, HA, &vkey);
        if (HS) v = _mm512_mul_ps(v, vs);
        st512(c->dst, i, v, D, nan16, nt);
    }
    if (nt) _mm_sfence();
    if (HA) {
        uint32_t k = _mm512_reduce_max_epu32(vkey);
        key = k > key ? k : key;
    }
    return scalar_part(c, i, e, S, D, HS, HA, key);
}

/* ---- AVX2 (8 lanes; the loop handles 16 elements per step so the fp8 output is one 16-byte store) ------ */

static inline ACC_AI ACC_TARGET_AVX2 __m256 ld256(const void *src, size_t i, const int S, const int HA, __m256i *key) {
    if (S == ACC_F32) {
        __m256 v = _mm256_loadu_ps((const float *)src + i);
        if (HA) *key = _mm256_max_epu32(*key, _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff)));
        return v;
    }
    __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)src + i));
    if (HA) *key = _mm256_max_epu32(*key, _mm256_and_si256(_mm256_cvtepu16_epi32(raw), _mm256_set1_epi32(0x7fff)));
    if (S == ACC_BF16) return acc_bf16x8_to_f32(raw);
    return acc_f16x8_to_f32(raw);
}

static inline ACC_AI ACC_TARGET_AVX2 void st128(void *p, __m128i v, int nt) {
    if (nt) _mm_stream_si128((__m128i *)p, v);
    else _mm_storeu_si128((__m128i *)p, v);
}

static inline ACC_AI ACC_TARGET_AVX2 void st256x2(void *dst, size_t i, __m256 v0, __m256 v1, const int D, uint16_t nan16,
                                                  int nt) {
    if (D == ACC_F32) {
        float *p = (float *)dst + i;
        if (nt) { _mm256_stream_ps(p, v0); _mm256_stream_ps(p + 8, v1); }
        else { _mm256_storeu_ps(p, v0); _mm256_storeu_ps(p + 8, v1); }
    } else if (D == ACC_F16) {
        uint16_t *p = (uint16_t *)dst + i;
        st128(p, acc_f32x8_to_f16(v0), nt);
        st128(p + 8, acc_f32x8_to_f16(v1), nt);
    } else if (D == ACC_BF16) {
        uint16_t *p = (uint16_t *)dst + i;
        st128(p, acc_f32x8_to_bf16(v0, nan16), nt);
        st128(p + 8, acc_f32x8_to_bf16(v1, nan16), nt);
    } else {
        /* two vectors a, b of byte codes in 32-bit lanes -> 16 bytes in order. packus works within 128-bit
         * lanes, so after the two packs the dwords are [a0-3, b0-3, ..] | [a4-7, b4-7, ..]; the permute
         * picks dwords 0, 4, 1, 5 = a0-3, a4-7, b0-3, b4-7. */
        const int e4 = D == ACC_E4M3;
        __m256i p16 = _mm256_packus_epi32(acc_f32x8_to_fp8_lanes(v0, e4), acc_f32x8_to_fp8_lanes(v1, e4));
        __m256i p8 = _mm256_packus_epi16(p16, p16);
        __m256i ord = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        st128((uint8_t *)dst + i, _mm256_castsi256_si128(ord), nt);
    }
}

static inline ACC_AI ACC_TARGET_AVX2 uint32_t body256(const cast_ctx *c, size_t b, size_t e, const int S, const int D,
                                                      const int HS, const int HA) {
    const uint16_t nan16 = NAN16(S, HS);
    size_t i = b + align_prologue(c->dst, b, e, dsize(D));
    uint32_t key = scalar_part(c, b, i, S, D, HS, HA, 0);
    const int nt = c->nt && (((uintptr_t)c->dst + i * dsize(D)) & 63) == 0;
    const __m256 vs = _mm256_set1_ps(c->scale);
    __m256i vkey = _mm256_setzero_si256();
    for (; i + 16 <= e; i += 16) {
        __m256 v0 = ld256(c->src, i, S, HA, &vkey), v1 = ld256(c->src, i + 8, S, HA, &vkey);
        if (HS) { v0 = _mm256_mul_ps(v0, vs); v1 = _mm256_mul_ps(v1, vs); }
        st256x2(c->dst, i, v0, v1, D, nan16, nt);
    }
    if (nt) _mm_sfence();
    if (HA) {
        uint32_t k[8];
        _mm256_storeu_si256((__m256i *)k, vkey);
        for (int j = 0; j < 8; j++) key = k[j] > key ? k[j] : key;
    }
    return scalar_part(c, i, e, S, D, HS, HA, key);
}

/* ---- dispatch over the 60 constant combinations ------------------------------------------------------- */

#define CASE_D(BODY, S, D)                                                                                     \
    case D:                                                                                                    \
        if (c->has_scale) return c->has_amax ? BODY(c, b, e, S, D, 1, 1) : BODY(c, b, e, S, D, 1, 0);          \
        return c->has_amax ? BODY(c, b, e, S, D, 0, 1) : BODY(c, b, e, S, D, 0, 0);
#define CASE_S(BODY, S)                                                                                        \
    case S:                                                                                                    \
        switch (c->dd) {                                                                                       \
            CASE_D(BODY, S, ACC_F32)                                                                           \
            CASE_D(BODY, S, ACC_BF16)                                                                          \
            CASE_D(BODY, S, ACC_F16)                                                                           \
            CASE_D(BODY, S, ACC_E4M3)                                                                          \
            CASE_D(BODY, S, ACC_E5M2)                                                                          \
        default: return 0;                                                                                     \
        }
#define DISPATCH(BODY)                                                                                         \
    switch (c->sd) {                                                                                           \
        CASE_S(BODY, ACC_F32)                                                                                  \
        CASE_S(BODY, ACC_BF16)                                                                                 \
        CASE_S(BODY, ACC_F16)                                                                                  \
    default: return 0;                                                                                         \
    }

static uint32_t range_scalar(const cast_ctx *c, size_t b, size_t e) { DISPATCH(body_scalar) }
static ACC_TARGET_AVX2 uint32_t range_avx2(const cast_ctx *c, size_t b, size_t e) { DISPATCH(body256) }
static ACC_TARGET_AVX512 uint32_t range_avx512(const cast_ctx *c, size_t b, size_t e) { DISPATCH(body512) }

/* Same dtype, no scale: a copy (keeps every bit, NaN payloads included) plus the amax scan, done in
 * L1-sized blocks so the data is read from memory once. */
static uint32_t scan_key_scalar(const void *p, size_t n, int s32) {
    uint32_t key = 0;
    if (s32) for (size_t i = 0; i < n; i++) { uint32_t k = ((const uint32_t *)p)[i] & 0x7fffffffu; key = k > key ? k : key; }
    else for (size_t i = 0; i < n; i++) { uint32_t k = ((const uint16_t *)p)[i] & 0x7fffu; key = k > key ? k : key; }
    return key;
}
static ACC_TARGET_AVX2 uint32_t scan_key_avx2(const void *p, size_t n, int s32) { return scan_key_scalar(p, n, s32); }
static ACC_TARGET_AVX512 uint32_t scan_key_avx512(const void *p, size_t n, int s32) {
    return scan_key_scalar(p, n, s32);
}

static uint32_t copy_range(const cast_ctx *c, size_t b, size_t e) {
    const size_t es = dsize(c->sd), blk = 8192 / es;
    const char *s = (const char *)c->src;
    char *d = (char *)c->dst;
    uint32_t key = 0;
    for (size_t i = b; i < e; i += blk) {
        size_t m = e - i < blk ? e - i : blk;
        if (d != s) memcpy(d + i * es, s + i * es, m * es);
        if (c->has_amax) {
            uint32_t k = ACC_SIMD_CALL(c->level, scan_key, s + i * es, m, es == 4);
            key = k > key ? k : key;
        }
    }
    return key;
}

static int cast_chunk(void *ctx, size_t b, size_t e, int chunk) {
    cast_ctx *c = (cast_ctx *)ctx;
    uint32_t key;
    if (c->sd == c->dd && !c->has_scale) key = copy_range(c, b, e);
    else key = ACC_SIMD_CALL(c->level, range, c, b, e);
    c->key[chunk] = key;
    return 0;
}

/* a context with no scale and no amax, at the current SIMD level (acc_cast adds its options) */
static void cast_ctx_init(cast_ctx *c, const void *src, acc_dtype sd, void *dst, acc_dtype dd, int nt) {
    static const cast_ctx zero;
    *c = zero;
    c->src = src;
    c->dst = dst;
    c->sd = sd;
    c->dd = dd;
    c->scale = 1.0f;
    c->nt = nt;
    c->level = acc_simd_level_get();
}

void acc_cast_span(const void *src, acc_dtype src_dtype, void *dst, acc_dtype dst_dtype, size_t n, int nt) {
    cast_ctx c;
    cast_ctx_init(&c, src, src_dtype, dst, dst_dtype, nt);
    if (n) (void)cast_chunk(&c, 0, n, 0);
}

/* A fresh output from torch.empty is untouched anonymous memory: writing it costs one page fault per 4 KiB,
 * which on the 2-core VM runs at ~1 GB/s, slower than the cast itself. With transparent huge pages in
 * "madvise" mode, MADV_HUGEPAGE on the 2 MiB-aligned interior of the output cuts that to one fault per
 * 2 MiB (measured 4-10x faster first touch on a fresh box) but, when memory is fragmented, the kernel
 * compacts on fault and a 1 GiB first touch took 0.25-5.5 s instead of ~1 s. So it is opt-in: the option
 * cast_thp (options.h; _C.set_options(cast_thp=True), which accelerate_c sets from ACCELERATE_C_CAST_THP=1).
 * Only advice: failure is ignored and the bits are unaffected. The real fix is to reuse outputs
 * (ops.cast(..., out=)). */
static void advise_huge(void *dst, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    if (bytes < 2 * huge || !acc_options_cast_thp()) return;
    uintptr_t a = ((uintptr_t)dst + huge - 1) & ~(huge - 1), e = ((uintptr_t)dst + bytes) & ~(huge - 1);
    if (e > a) (void)madvise((void *)a, e - a, MADV_HUGEPAGE);
#else
    (void)dst; (void)bytes;
#endif
}

static float key_to_f32(uint32_t key, acc_dtype sd) {
    if (sd == ACC_F32) return key > 0x7f800000u ? acc_u2f(0x7fc00000u) : acc_u2f(key);
    if (sd == ACC_BF16) return key > 0x7f80u ? acc_u2f(0x7fc00000u) : acc_bf16_to_f32((uint16_t)key);
    return key > 0x7c00u ? acc_u2f(0x7fc00000u) : acc_f16_to_f32((uint16_t)key);
}

acc_status acc_cast(const void *src, acc_dtype src_dtype, void *dst, acc_dtype dst_dtype, size_t n,
                    const float *scale, float *amax_out, int nthreads, void *stream) {
    if (stream) {
        acc_set_error("acc_cast: the CPU kernel takes no stream");
        return ACC_ERR_ARG;
    }
    if (src_dtype != ACC_F32 && src_dtype != ACC_BF16 && src_dtype != ACC_F16) {
        acc_set_error("acc_cast: unsupported input dtype %s (float32, bfloat16, float16)", acc_dtype_name(src_dtype));
        return ACC_ERR_DTYPE;
    }
    if (dst_dtype != ACC_F32 && dst_dtype != ACC_BF16 && dst_dtype != ACC_F16 && dst_dtype != ACC_E4M3 &&
        dst_dtype != ACC_E5M2) {
        acc_set_error("acc_cast: unsupported output dtype %s", acc_dtype_name(dst_dtype));
        return ACC_ERR_DTYPE;
    }
    if (n && (!src || !dst)) {
        acc_set_error("acc_cast: NULL buffer");
        return ACC_ERR_ARG;
    }
    if (n && src != dst) { /* partial overlap would make the result depend on the split */
        const char *s = (const char *)src, *d = (const char *)dst;
        size_t sb = n * acc_dtype_size(src_dtype), db = n * acc_dtype_size(dst_dtype);
        if (s < d + db && d < s + sb) {
            acc_set_error("acc_cast: input and output overlap");
            return ACC_ERR_ARG;
        }
    } else if (n && acc_dtype_size(src_dtype) != acc_dtype_size(dst_dtype)) {
        acc_set_error("acc_cast: in-place cast needs equal element sizes");
        return ACC_ERR_ARG;
    }
    cast_ctx c;
    cast_ctx_init(&c, src, src_dtype, dst, dst_dtype, n * acc_dtype_size(dst_dtype) >= ACC_CAST_NT_BYTES);
    c.has_scale = scale != NULL;
    c.scale = scale ? *scale : 1.0f;
    c.has_amax = amax_out != NULL;
    if (!(src == dst)) advise_huge(dst, n * acc_dtype_size(dst_dtype));
    int chunks = 1;
    int rc = n ? acc_parallel_for(n, nthreads, MIN_PER_THREAD, cast_chunk, &c, &chunks) : 0;
    if (rc) return (acc_status)rc;
    if (amax_out) {
        uint32_t key = 0;
        for (int t = 0; t < chunks && n; t++) key = c.key[t] > key ? c.key[t] : key;
        *amax_out = key_to_f32(key, src_dtype);
    }
    return ACC_OK;
}
